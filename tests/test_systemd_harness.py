"""Our sd_notify, journald and logging code under a real systemd 252 (booted with systemd-nspawn).

The production unit with the real agent is exercised in tests/test_systemd_agent.py.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from parallel import HEAVY
from systemd_container import SystemdContainer, default_binds, ensure_rootfs, nspawn_unavailable_reason

import nodeagent

REPO = Path(nodeagent.__file__).resolve().parent.parent
PY = sys.executable
_reason = nspawn_unavailable_reason()
pytestmark = [
    pytest.mark.system,
    HEAVY,
    pytest.mark.skipif(_reason is not None, reason=f"cannot boot a systemd container here: {_reason}"),
]


@pytest.fixture(scope="module")
def container() -> Iterator[SystemdContainer]:
    ensure_rootfs()
    with SystemdContainer(binds_ro=default_binds()) as c:
        yield c


def show(c: SystemdContainer, unit: str, *props: str) -> dict[str, str]:
    out = c.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for(what: str, pred: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def install_unit(c: SystemdContainer, name: str, service: str, script: str) -> None:
    c.write_file(f"/opt/dsv4-test/{name}.py", script)
    c.write_file(f"/etc/systemd/system/{name}.service", service)
    c.run(["systemctl", "daemon-reload"])


def unit_processes(c: SystemdContainer, marker: str) -> list[int]:
    """Host PIDs in the container whose command line mentions ``marker``."""
    found = []
    for pid in c.processes():
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except OSError:
            pass
    return found


NOTIFY_SCRIPT = """
import os, signal, subprocess, sys, time
from loguru import logger
from nodeagent.core import journal
from nodeagent.core.logsetup import setup_logging
from nodeagent.core.sdnotify import Notifier

fmt = setup_logging("node-t", "auto")
n = Notifier()
n.status("starting: fmt=" + fmt)
fd = journal.open_stream("childtest")
subprocess.run([sys.executable, "-c", "print('hello from the child')"], stdout=fd, stderr=fd, check=True)
os.close(fd)
logger.bind(component="vllm", event="restart", attempt=2).info("structured line from the agent")
# Bigger than a datagram with this socket buffer: exercises the sealed-memfd path against the real journald.
assert journal.JournalSender(sndbuf=65536).send("BIG" + "x" * 300000, 6, SYSLOG_IDENTIFIER="bigtest")
time.sleep(1.0)  # systemctl start must wait for READY through this


def on_term(signum, frame):
    n.stopping()
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
n.ready(status="serving: notify test " + fmt)
while True:
    time.sleep(1)
"""


def test_notify_journal_and_logging(container: SystemdContainer) -> None:
    c = container
    unit = "dsv4-notify-test"
    install_unit(
        c,
        unit,
        f"""[Service]
Type=notify
NotifyAccess=main
Environment=PYTHONPATH={REPO}
ExecStart={PY} /opt/dsv4-test/{unit}.py
TimeoutStartSec=20
""",
        NOTIFY_SCRIPT,
    )
    t0 = time.monotonic()
    c.run(["systemctl", "start", unit], timeout=30)
    elapsed = time.monotonic() - t0
    assert elapsed >= 1.0, f"systemctl start returned after {elapsed:.2f} s, before READY"
    st = show(c, unit, "ActiveState", "SubState", "StatusText", "MainPID")
    assert (st["ActiveState"], st["SubState"]) == ("active", "running")
    assert st["StatusText"] == "serving: notify test journal"
    assert 'Status: "serving: notify test journal"' in c.run(["systemctl", "status", unit], check=False).stdout

    def journal_lines(*args: str) -> list[str]:
        return c.run(["journalctl", "--no-pager", "-u", unit, *args]).stdout.splitlines()

    wait_for("the child's line", lambda: "hello from the child" in journal_lines("-t", "childtest", "-o", "cat"))

    def structured() -> list[dict[str, str]]:
        return [json.loads(x) for x in journal_lines("COMPONENT=vllm", "-o", "json")]

    wait_for("the structured line", lambda: bool(structured()))
    (entry,) = structured()
    assert entry["MESSAGE"] == "structured line from the agent"
    assert entry["SYSLOG_IDENTIFIER"] == "dsv4-agent"
    assert entry["NODE"] == "node-t"
    assert entry["EVENT"] == "restart"
    assert entry["ATTEMPT"] == "2"
    assert entry["PRIORITY"] == "6"
    assert entry["CODE_FILE"] == f"/opt/dsv4-test/{unit}.py"
    assert entry["_SYSTEMD_UNIT"] == f"{unit}.service"

    def big() -> list[dict[str, str]]:
        return [json.loads(x) for x in journal_lines("-t", "bigtest", "-o", "json", "--all")]

    wait_for("the memfd entry", lambda: bool(big()))
    assert big()[0]["MESSAGE"] == "BIG" + "x" * 300000

    c.run(["systemctl", "stop", unit], timeout=30)
    st = show(c, unit, "ActiveState", "MainPID", "Result")
    assert (st["ActiveState"], st["MainPID"], st["Result"]) == ("inactive", "0", "success")
    assert unit_processes(c, f"/opt/dsv4-test/{unit}.py") == []


WATCHDOG_SCRIPT = """
import time
from nodeagent.core.sdnotify import Notifier

n = Notifier()
interval = n.watchdog_interval()
n.ready(status=f"watchdog={interval}")
for _ in range(3):
    time.sleep(interval / 4)
    n.watchdog()
time.sleep(3600)  # hung: no more pings
"""


def test_watchdog_restarts_a_silent_service(container: SystemdContainer) -> None:
    c = container
    unit = "dsv4-watchdog-test"
    install_unit(
        c,
        unit,
        f"""[Service]
Type=notify
NotifyAccess=main
Environment=PYTHONPATH={REPO}
ExecStart={PY} /opt/dsv4-test/{unit}.py
WatchdogSec=2
Restart=always
RestartSec=0.2
LimitCORE=0
""",
        WATCHDOG_SCRIPT,
    )
    c.run(["systemctl", "start", unit], timeout=30)
    first = show(c, unit, "MainPID", "StatusText", "NRestarts")
    assert first["StatusText"] == "watchdog=2.0"  # WATCHDOG_USEC/WATCHDOG_PID parsed under real systemd
    assert first["NRestarts"] == "0"
    wait_for("a watchdog restart", lambda: show(c, unit, "NRestarts")["NRestarts"] != "0", timeout=15)
    wait_for("the new main process", lambda: show(c, unit, "ActiveState")["ActiveState"] == "active")
    assert show(c, unit, "MainPID")["MainPID"] not in ("0", first["MainPID"])
    log = c.run(["journalctl", "--no-pager", "-u", unit, "-o", "cat"]).stdout
    assert "Watchdog timeout" in log
    c.run(["systemctl", "stop", unit], timeout=30)
    assert unit_processes(c, f"/opt/dsv4-test/{unit}.py") == []




"""Our sd_notify, journald and logging code under a real systemd 252 (booted with systemd-nspawn).

Also pins down the systemd behaviour the production unit relies on: with KillMode=process a crashed agent's
children survive and the restarted agent adopts them; with KillMode=mixed systemd SIGKILLs them at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

try:
    from systemd_container import SYSTEM_DIRS, SystemdContainer, ensure_rootfs, nspawn_unavailable_reason
except ImportError:  # tests/ became a package
    from tests.systemd_container import (
        SYSTEM_DIRS,
        SystemdContainer,
        ensure_rootfs,
        nspawn_unavailable_reason,
    )

import nodeagent

REPO = Path(nodeagent.__file__).resolve().parent.parent
PY = sys.executable
_reason = nspawn_unavailable_reason()
pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(_reason is not None, reason=f"cannot boot a systemd container here: {_reason}"),
]


def _binds() -> list[str]:
    """Repo, venv and interpreter prefix, each mounted read-only at its own path (nested ones dropped).

    A distro interpreter (prefix /usr) is not bound: the container's bookworm python3 is the same one.
    """
    paths = sorted({str(REPO), sys.prefix, sys.base_prefix} - SYSTEM_DIRS, key=len)
    keep: list[str] = []
    for p in paths:
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            keep.append(p)
    return keep


@pytest.fixture(scope="module")
def container() -> Iterator[SystemdContainer]:
    ensure_rootfs()
    with SystemdContainer(binds_ro=_binds()) as c:
        yield c


def show(c: SystemdContainer, unit: str, *props: str) -> dict[str, str]:
    out = c.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for(what: str, pred: Callable[[], bool], timeout: float = 10) -> None:
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
from nodeagent import journal
from nodeagent.logsetup import setup_logging
from nodeagent.sdnotify import Notifier

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
from nodeagent.sdnotify import Notifier

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


FAKE_AGENT = """
import os, signal, subprocess, sys, time
from pathlib import Path
from nodeagent import journal
from nodeagent.sdnotify import Notifier

n = Notifier()
state = Path("/run/dsv4-agent/child.pid")  # RuntimeDirectory, preserved across restarts
pid = int(state.read_text()) if state.exists() else None
adopted = pid is not None and Path(f"/proc/{pid}").exists()
if not adopted:
    fd = journal.open_stream("fakechild")
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\\nwhile True: time.sleep(1)", "fake-vllm"],
        stdout=fd, stderr=fd, start_new_session=True,
    )
    os.close(fd)
    pid = child.pid
    state.write_text(str(pid))


def on_term(signum, frame):
    n.stopping()
    os.kill(pid, signal.SIGTERM)
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        time.sleep(0.05)
    state.unlink()
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, lambda *_: os._exit(1))  # "crash" on demand
n.ready(status=("adopted" if adopted else "spawned") + f" child {pid}")
interval = n.watchdog_interval() or 2
while True:
    time.sleep(interval / 2)
    n.watchdog()
"""


def test_production_unit_children_survive_agent_crash(container: SystemdContainer) -> None:
    """The shipped unit (ExecStart swapped for a fake agent) keeps children across an agent crash."""
    c = container
    unit = "dsv4-agent"
    prod = (REPO / "systemd" / "dsv4-agent.service").read_text()
    c.write_file("/etc/systemd/system/dsv4-agent.service", prod)
    dropin = f"ExecStart=\nExecStart={PY} /opt/dsv4-test/fake_agent.py\nEnvironment=PYTHONPATH={REPO}\n"
    c.write_file("/etc/systemd/system/dsv4-agent.service.d/test.conf", "[Service]\n" + dropin)
    c.write_file("/opt/dsv4-test/fake_agent.py", FAKE_AGENT)
    c.run(["systemctl", "daemon-reload"])
    c.run(["systemctl", "start", unit], timeout=30)
    st = show(c, unit, "StatusText", "MainPID", "NRestarts")
    assert st["StatusText"].startswith("spawned child ")
    child = int(st["StatusText"].rsplit(" ", 1)[1])
    child_host = c.host_pid_of(child)

    def crash_and_wait_restart(n: int) -> str:
        os.kill(c.host_pid_of(int(show(c, unit, "MainPID")["MainPID"])), signal.SIGUSR1)
        wait_for(f"restart #{n}", lambda: show(c, unit, "NRestarts")["NRestarts"] == str(n), timeout=15)
        wait_for("the agent to be ready again", lambda: show(c, unit, "SubState")["SubState"] == "running")
        return show(c, unit, "StatusText")["StatusText"]

    # KillMode=process (the shipped unit): the child outlives the crash and the new agent adopts it.
    assert crash_and_wait_restart(1) == f"adopted child {child}"
    assert Path(f"/proc/{child_host}").exists()

    # KillMode=mixed, for contrast: the crash takes the child down with it, so the new agent must spawn anew.
    c.write_file("/etc/systemd/system/dsv4-agent.service.d/mixed.conf", "[Service]\nKillMode=mixed\n")
    c.run(["systemctl", "daemon-reload"])
    status = crash_and_wait_restart(2)
    assert status.startswith("spawned child ") and status != f"spawned child {child}"
    assert not Path(f"/proc/{child_host}").exists()

    # A clean stop: the agent stops its child itself and nothing is left.
    c.run(["systemctl", "stop", unit], timeout=60)
    assert show(c, unit, "ActiveState")["ActiveState"] == "inactive"
    assert unit_processes(c, "fake_agent.py") == []
    assert unit_processes(c, "fake-vllm") == []

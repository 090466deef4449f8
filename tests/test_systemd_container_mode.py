"""Container mode under a real systemd: the agent as the dsv4-agent unit in a booted systemd (nspawn) drives the
host's podman (run inside the machine: tests/nspawn_podman.py), and everything an operator uses on the host works
as with host processes — `systemctl start` returns after READY, the stack runs inside the node's container
(found by its listening ports, in the container's cgroup), journald per component (`journalctl -u dsv4-agent -t
vllm`: the component's own lines), `nodeagentctl status` (the container line), /status, /metrics and the status
page, and `systemctl stop` leaves nothing of ours running."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import free_port
from containerhelpers import SKIP_REASON, built_image, stack_run_args
from nspawn_podman import configure_podman, podman_binds
from parallel import HEAVY
from systemd_container import SystemdContainer, default_binds, ensure_rootfs, nspawn_unavailable_reason

import nodeagent

REPO = Path(nodeagent.__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
_reason = nspawn_unavailable_reason() or SKIP_REASON
pytestmark = [
    pytest.mark.system,
    HEAVY,
    pytest.mark.skipif(_reason is not None, reason=f"no systemd container with podman here: {_reason}"),
]
STACK_MARKERS = ("datasystem_worker", "etcd", "VLLM::", "vllm-standin", "conmon")
STANDIN_MODEL = REPO / "config" / "standin-model"
DROPIN = f"""[Service]
ExecStart=
ExecStart={BIN}/dsv4-agent --config /etc/dsv4-agent/config.yaml
TimeoutStopSec=90
"""


def _config(ports: dict[str, int], image: str, name: str) -> dict:
    """test_systemd_agent's stack (all three inside), with a container section of only what the bare test image
    needs to find the stack (the venv mounts, as in test_container_system)."""
    state = "/var/lib/dsv4-agent"
    return yaml.safe_load(f"""
cluster: {{name: ctc, etcd_endpoints: ["127.0.0.1:{ports['etcd']}"]}}
node: {{name: ctc0, ip: 127.0.0.1, role: master, npus: 0}}
agent:
  state_dir: {state}
  log_dir: /var/log/dsv4-agent
  api: {{listen: "127.0.0.1:{ports['api']}", token_file: /etc/dsv4-agent/token}}
container: {{engine: podman, image: "{image}", name: {name}, run_args: {json.dumps(stack_run_args())}}}
components:
  etcd: {{kind: etcd, command: etcd, client_port: {ports['etcd']}, peer_port: {ports['peer']},
          data_dir: {state}/etcd-data}}
  datasystem: {{kind: datasystem, command: dscli, workdir: {state}/yr, worker_port: {ports['worker']},
                shared_memory_size_mb: 256, liveness_check_path: {state}/yr/liveness, start_timeout_s: 60,
                client_log_dir: {state}/client-logs, depends_on: [etcd]}}
  vllm: {{kind: vllm, command: vllm-standin, model: {STANDIN_MODEL}, port: {ports['vllm']}, tensor_parallel_size: 1,
          ld_preload: [], stop_grace_s: 10, env: {{VLLM_STANDIN_STARTUP_DELAY_S: "0.5"}},
          probes: {{startup: {{period_s: 0.5, failure_threshold: 120}}, liveness: {{period_s: 2, timeout_s: 2}},
                   readiness: {{period_s: 1, timeout_s: 2}}}},
          depends_on: [datasystem]}}
""")


@pytest.fixture(scope="module")
def machine() -> Iterator[tuple[SystemdContainer, dict[str, int], str]]:
    rootfs = ensure_rootfs()
    image = built_image()
    name = "dsv4-ctc"
    with podman_binds(rootfs) as binds, SystemdContainer(
        rootfs, binds_ro=[*default_binds(), *binds.ro], binds=binds.rw, container_engine=True
    ) as c:
        configure_podman(c)
        ports = {k: free_port() for k in ("etcd", "peer", "worker", "vllm", "api")}
        c.write_file("/etc/dsv4-agent/config.yaml", yaml.safe_dump(_config(ports, image, name), sort_keys=False))
        c.write_file("/etc/systemd/system/dsv4-agent.service", (REPO / "systemd" / "dsv4-agent.service").read_text())
        c.write_file("/etc/systemd/system/dsv4-agent.service.d/test.conf", DROPIN)
        c.run(["systemctl", "daemon-reload"])
        try:
            yield c, ports, name
        finally:
            c.run(["systemctl", "stop", "dsv4-agent"], check=False, timeout=120)
            c.run(["podman", "rm", "-f", "-t", "0", name], check=False, timeout=60)


def show(c: SystemdContainer, *props: str) -> dict[str, str]:
    out = c.run(["systemctl", "show", "dsv4-agent", *(f"--property={p}" for p in props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait(c: SystemdContainer, what: str, pred, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    """Wait for `pred`; on a timeout say what the agent's unit last logged."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            tail = c.run(["journalctl", "-u", "dsv4-agent", "-n", "60", "--no-pager"], check=False).stdout
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; the unit's journal:\n{tail}")
        time.sleep(0.2)


def cgroups(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


def listener(port: int) -> int | None:
    """The host PID listening on a TCP port, from the kernel's socket table (not from the agent)."""
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid is not None:
            return conn.pid
    return None


def machine_stack(c: SystemdContainer) -> list[str]:
    """Stack processes anywhere below the machine (its own PID namespace and the podman container's nested one),
    by the machine's cgroup, which every process started in it inherits."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        ours = f"/{c.name}/" in cgroups(proc.info["pid"]) and not cmd.startswith("systemd-nspawn")  # its binds
        if ours and any(m in cmd for m in STACK_MARKERS):
            found.append(f"{proc.info['pid']}: {cmd[:120]}")
    return found


def get(port: int, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status, r.read().decode()


def test_container_mode_under_systemd(machine: tuple[SystemdContainer, dict[str, int], str]) -> None:
    c, ports, name = machine
    t0 = time.monotonic()
    c.run(["systemctl", "start", "dsv4-agent"], timeout=120)
    ready_s = time.monotonic() - t0
    assert show(c, "ActiveState")["ActiveState"] == "active", "systemctl start returns only after READY=1"

    def all_up() -> bool:
        text = show(c, "StatusText")["StatusText"]
        return all(f"{n} running" in text or f"{n} ready" in text for n in ("etcd", "datasystem", "vllm"))

    wait(c, "STATUS= with all three up", all_up, 180)
    up_s = time.monotonic() - t0
    found = json.loads(c.run(["podman", "inspect", "--type", "container", name]).stdout)[0]
    cid = found["Id"]
    assert found["State"]["Running"]
    # Membership from the kernel: the process behind each port is in the container's cgroup, below the machine's.
    for comp in ("etcd", "worker", "vllm"):
        pid = listener(ports[comp])
        assert pid is not None, f"nothing listens on {comp}'s port {ports[comp]}"
        assert cid in cgroups(pid) and f"/{c.name}/" in cgroups(pid), f"{comp} (pid {pid}) is not in {name}"

    # journald: each component's own output under the agent's unit, by its identifier
    def journal(ident: str) -> str:
        return c.run(["journalctl", "-u", "dsv4-agent", "-t", ident, "--no-pager", "-q", "-o", "cat"],
                     check=False).stdout  # fmt: skip

    wait(c, "vLLM's own startup line", lambda: "Application startup complete." in journal("vllm"), 30)
    wait(c, "dscli's output for the worker", lambda: "PID:" in journal("datasystem"), 30)
    wait(c, "etcd's own log lines", lambda: '"msg":' in journal("etcd"), 30)

    # nodeagentctl in the machine (the host of the container), /status, /metrics and the status page
    shown = c.run([str(BIN / "nodeagentctl"), "--config", "/etc/dsv4-agent/config.yaml", "status"], timeout=30)
    assert f"container {name} (podman, " in shown.stdout and f"{cid[:12]} up since" in shown.stdout, shown.stdout
    code, body = get(ports["api"], "/status")
    status = json.loads(body)
    assert code == 200 and status["container"]["id"] == cid[:12] and status["container"]["up"]
    code, metrics = get(ports["api"], "/metrics")
    assert code == 200 and "dsv4_" in metrics
    code, page = get(ports["api"], "/ui")
    assert code == 200 and "<html" in page.lower()
    print(f"\ncontainer mode under systemd: READY after {ready_s:.1f} s, stack up inside after {up_s:.1f} s")

    inside = machine_stack(c)  # what the check after the stop looks for is visible while the stack runs
    assert any("vllm-standin" in p for p in inside) and any("datasystem_worker" in p for p in inside), inside

    # systemctl stop: the stack stopped, the container stopped (on_stop: stop), nothing of ours left running
    c.run(["systemctl", "stop", "dsv4-agent"], timeout=120)
    assert show(c, "ActiveState")["ActiveState"] in ("inactive", "failed")
    deadline = time.monotonic() + 30
    while (left := machine_stack(c)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], "stack processes outlived systemctl stop"
    assert not [p.pid for p in psutil.process_iter() if cid in cgroups(p.pid)]
    assert all(listener(ports[comp]) is None for comp in ("etcd", "worker", "vllm"))
    after = json.loads(c.run(["podman", "inspect", "--type", "container", name]).stdout)[0]
    assert after["State"]["Running"] is False
    scopes = c.run(["systemctl", "list-units", "--type=scope", "--no-legend", "--plain", "dsv4-*"]).stdout
    assert scopes.strip() == "", scopes

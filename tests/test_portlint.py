"""The ports lint: every port a member of the cluster file binds, collisions, the ephemeral range and its fix —
pure on the 8-node example, live against a real listener, and `nodeagentctl ports` on a private sysctl tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from nodeagent.config.load import load_config
from nodeagent.layers.port_check import PortsApplyError, apply_reserved, lint_node, read_sysctls
from nodeagent.layers.portlint import (
    COLLISION,
    TAKEN,
    PortUse,
    collisions,
    lint_ports,
    merge_ranges,
    node_uses,
    parse_port_range,
    parse_ranges,
    subtract,
)
from nodeagent.layers.preflight import PASS, WARN, check_ports_lint
from nodeagent.node.hostfacts import Host

ROOT = Path(__file__).resolve().parents[1]
EIGHT = ROOT / "config" / "dsv4-flash-a2-8node.yaml"
SYSCTL_TREE = Path(__file__).resolve().parent / "fixtures" / "hosts" / "doc-sysctl"
DEFAULT = (32768, 60999)


def uses_of(path: Path, node: str | None) -> list[PortUse]:
    return node_uses(load_config(path, node=node), {})


def by_purpose(uses: list[PortUse], component: str, prefix: str) -> list[tuple[int, int]]:
    return [(u.low, u.high) for u in uses if u.component == component and u.purpose.startswith(prefix)]


def cluster_file(tmp: Path, change: Any = None) -> Path:
    data = yaml.safe_load(EIGHT.read_text())
    if change:
        change(data)
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_eight_node_example_every_member() -> None:
    """Prefill ranks take kv_port + rank·TP .. +TP-1 (TP 4), decode ranks one port each (TP 1); no two of our
    listeners collide on any member, and none sits in the default ephemeral range (the file moves HCCL's host
    ports from 60000 to 61000: `ports` and preflight print no WARN on a stock kernel)."""
    p0 = uses_of(EIGHT, "a2-0")
    assert by_purpose(p0, "vllm-dp0", "MooncakeHybridConnector handshake") == [(30000, 30003)]
    assert by_purpose(p0, "vllm-dp1", "MooncakeHybridConnector handshake") == [(30004, 30007)]
    assert by_purpose(p0, "vllm-dp0", "DP RPC") == [(12321, 12321)] and not by_purpose(p0, "vllm-dp1", "DP RPC")
    assert by_purpose(p0, "vllm-dp1", "ADXL") == [(20400, 20500), (20500, 20600), (20600, 20700), (20700, 20800)]
    assert {(u.component, u.low) for u in p0 if u.purpose in ("etcd client", "etcd peer", "PD proxy")} == {
        ("etcd", 2379), ("etcd", 2380), ("proxy", 18020)}
    p3 = uses_of(EIGHT, "a2-3")
    assert by_purpose(p3, "vllm-dp1", "MooncakeHybridConnector handshake") == [(30304, 30307)]
    d5 = uses_of(EIGHT, "a2-5")
    assert by_purpose(d5, "vllm-dp8", "MooncakeHybridConnector handshake") == [(30408, 30408)]
    assert not any(u.purpose.startswith("DP RPC") for u in d5), "only rank 0's process binds the RPC port"
    assert not any(u.component == "etcd" or u.component == "proxy" for u in d5)
    for node in (f"a2-{i}" for i in range(8)):
        report = lint_ports(uses_of(EIGHT, node), DEFAULT, [])
        assert not report.collisions, (node, [f.message for f in report.collisions])
        assert report.to_reserve == [] and report.findings == [], (node, [f.message for f in report.findings])
        assert {(u.low, u.high) for u in report.uses if u.purpose.startswith("HCCL")} == {(61000, 61015)}, node
    single = lint_ports(uses_of(ROOT / "config" / "dsv4-flash-a2.yaml", None), DEFAULT, [])
    assert single.findings == [] and single.to_reserve == []


def test_kv_port_inside_the_adxl_range_collides_as_in_8938(tmp_path: Path) -> None:
    path = cluster_file(tmp_path, lambda d: d["cluster"].__setitem__("pd", {"kv_port_base": 20002}))
    report = lint_ports(uses_of(path, "a2-0"), DEFAULT, [])
    found = [f for f in report.collisions if f.kind == COLLISION]
    assert found, report.findings
    first = found[0]
    assert (first.low, first.high) == (20002, 20005)
    assert "ADXL listen (NPU 0, ASCEND_BASE_PORT 20000) 20000-20100" in first.message
    assert "vllm-dp0 MooncakeHybridConnector handshake (kv_port 20002 + rank·TP) 20002-20005" in first.message
    assert "#8938" in first.message

    def moved(d: dict[str, Any]) -> None:
        d["cluster"]["pd"] = {"kv_port_base": 20002}
        d["components"]["vllm"]["env"]["ASCEND_BASE_PORT"] = "22000"  # the fix the maintainer gave

    report = lint_ports(uses_of(cluster_file(tmp_path, moved), "a2-0"), DEFAULT, [])
    assert not report.collisions
    assert by_purpose(report.uses, "vllm-dp0", "ADXL")[0] == (22000, 22100)


def test_two_fixed_listeners_on_one_port_collide(tmp_path: Path) -> None:
    """The layout already refuses two HTTP listeners on one address; the handshake ranges it does not know."""
    path = cluster_file(tmp_path, lambda d: d["components"]["datasystem"].__setitem__("worker_port", 30005))
    found = collisions(uses_of(path, "a2-0"))
    assert [(f.low, f.first.label, f.second.label if f.second else None) for f in found] == [
        (30005, "datasystem datasystem worker 30005",
         "vllm-dp1 MooncakeHybridConnector handshake (kv_port 30000 + rank·TP) 30004-30007")]


def test_hccl_base_port_moves_its_range_and_reserved_ports_merge(tmp_path: Path) -> None:
    path = cluster_file(tmp_path, lambda d: d["components"]["vllm"]["env"].__setitem__("HCCL_IF_BASE_PORT", "45000"))
    uses = uses_of(path, "a2-4")
    assert set(by_purpose(uses, "vllm-dp3", "HCCL host ports (HCCL_IF_BASE_PORT)")) == {(45000, 45015)}
    report = lint_ports(uses, DEFAULT, parse_ranges("45000-45007,50000"))
    assert report.to_reserve == [(45008, 45015)]
    assert report.reserved_value() == "45000-45015,50000"
    assert report.sysctl_line() == "net.ipv4.ip_local_reserved_ports = 45000-45015,50000"
    assert len(report.exposed) == 1, "one finding for the node's shared HCCL range, not one per rank"
    assert not lint_ports(uses, DEFAULT, parse_ranges("45000-45015")).findings
    narrow = lint_ports(uses, (61000, 65535), [])
    assert not narrow.findings and not narrow.to_reserve


def test_range_arithmetic() -> None:
    assert parse_port_range("32768\t60999\n") == (32768, 60999)
    assert parse_port_range("garbage") is None and parse_port_range(None) is None
    assert parse_ranges("8080, 20000-20100,bad,20050-20200\n") == [(8080, 8080), (20000, 20200)]
    assert merge_ranges([(5, 6), (1, 2), (3, 3)]) == [(1, 3), (5, 6)]
    assert subtract(10, 20, [(12, 13), (18, 30)]) == [(10, 11), (14, 17)]
    assert subtract(10, 20, []) == [(10, 20)]


def test_this_machines_ephemeral_range_is_readable() -> None:
    ephemeral, reserved = read_sysctls(Host())
    assert ephemeral is not None and 1024 <= ephemeral[0] <= ephemeral[1] <= 65535
    assert all(a <= b for a, b in reserved)


@pytest.fixture
def sysctl_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(SYSCTL_TREE, root)
    return root


@pytest.mark.usefixtures("fixed_ports")  # live checks of the 8-node file's ports
def test_a_stranger_listening_inside_a_kv_range_is_reported_live(tmp_path: Path, sysctl_root: Path,
                                                                  listener: subprocess.Popen[bytes]) -> None:
    port = listener.port  # type: ignore[attr-defined]
    # prefill0's rank 1 takes kv_port+4 .. +7: the listener sits on its third port
    path = cluster_file(tmp_path, lambda d: d["cluster"].__setitem__("pd", {"kv_port_base": port - 6}))
    config = load_config(path, node="a2-0")
    report = lint_node(config, Host(root=sysctl_root), ours=set())
    taken = [f for f in report.findings if f.kind == TAKEN]
    assert [(f.low, f.first.component) for f in taken] == [(port, "vllm-dp1")]
    assert f"pid {listener.pid}" in taken[0].message
    check = list(check_ports_lint(SimpleNamespace(config=config, host=Host(root=sysctl_root), ours=set())))
    # a stranger holds the port: that component's start waits (named), the stack is not held for it
    assert check[0].status == WARN and f"{port}: vllm-dp1" in check[0].value
    # the same listener counted as ours: no finding
    assert not [f for f in lint_node(config, Host(root=sysctl_root), ours={listener.pid}).findings if f.kind == TAKEN]


@pytest.mark.usefixtures("fixed_ports")  # live checks of the 8-node file's ports
def test_preflight_check_warns_then_passes_once_reserved(tmp_path: Path, sysctl_root: Path) -> None:
    # HCCL's default host ports (the shipped file moves them out of the range)
    config = load_config(cluster_file(tmp_path, lambda d: d["components"]["vllm"]["env"].pop("HCCL_IF_BASE_PORT")),
                         node="a2-6")  # fmt: skip
    ctx = SimpleNamespace(config=config, host=Host(root=sysctl_root), ours=set())
    (check,) = check_ports_lint(ctx)
    assert check.status == WARN and "60000-60015" in check.value and "ports --apply" in check.hint
    report = lint_node(config, Host(root=sysctl_root), live=False)
    (sysctl_root / "proc/sys/net/ipv4/ip_local_reserved_ports").write_text("8080\n")
    report = lint_node(config, Host(root=sysctl_root), live=False)
    assert apply_reserved(Host(root=sysctl_root), report) == "8080,60000-60015"
    assert (sysctl_root / "proc/sys/net/ipv4/ip_local_reserved_ports").read_text() == "8080,60000-60015\n"
    (check,) = check_ports_lint(ctx)
    assert check.status == PASS and "none in the ephemeral range 32768-60999 unreserved" in check.value


def test_apply_on_the_real_proc_needs_root() -> None:
    report = lint_ports([PortUse("x", "test", 40000, 40000)], DEFAULT, [])
    with pytest.raises(PortsApplyError, match="needs root: run `sudo nodeagentctl ports --apply`"):
        apply_reserved(Host(), report, euid=1000)


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "DSV4_AGENT_CONFIG": ""}
    return subprocess.run([sys.executable, "-m", "nodeagent.cli", *args], capture_output=True, text=True,
                          env=env, timeout=60)  # fmt: skip


@pytest.mark.usefixtures("fixed_ports")  # live checks of the 8-node file's ports
def test_cli_ports_json_and_apply(tmp_path: Path, sysctl_root: Path) -> None:
    node_file = tmp_path / "node.yaml"  # one member's view: the cluster file with node.name set
    data = yaml.safe_load(EIGHT.read_text())
    data["node"] = {"name": "a2-7"}
    del data["components"]["vllm"]["env"]["HCCL_IF_BASE_PORT"]  # HCCL's default host ports, to reserve
    node_file.write_text(yaml.safe_dump(data, sort_keys=False))
    out = _cli("--config", str(node_file), "ports", "--json", "--root", str(sysctl_root), home=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["to_reserve"] == "60000-60015" and data["applied"] is None and data["ok"]
    assert {"vllm-dp31"} <= {u["component"] for u in data["uses"]}
    out = _cli("--config", str(node_file), "ports", "--apply", "--root", str(sysctl_root), home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "wrote ip_local_reserved_ports = 60000-60015" in out.stdout
    assert "net.ipv4.ip_local_reserved_ports = 60000-60015" in out.stdout.splitlines()[-1]
    assert (sysctl_root / "proc/sys/net/ipv4/ip_local_reserved_ports").read_text() == "60000-60015\n"


@pytest.mark.usefixtures("fixed_ports")  # live checks of the 8-node file's ports
def test_cli_ports_of_any_member_from_one_host(tmp_path: Path, sysctl_root: Path) -> None:
    """`ports --node NAME` (its own error used to say "pass --node" and then refuse it)."""
    for args in (["ports", "--node", "a2-5"], ["--node", "a2-5", "ports"]):
        out = _cli("--config", str(EIGHT), *args, "--json", "--root", str(sysctl_root), home=tmp_path)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert {f"vllm-dp{r}" for r in range(8, 16)} == {u["component"] for u in data["uses"]} - {"datasystem",
                                                                                                   "agent"}
        assert data["ok"] and data["to_reserve"] == ""

"""The member record other nodes read is built from the node's view and the layers' typed reports (issue 28 item
2), never from /status: its wire keys are the previous version's, and renaming a /status key changes nothing
between nodes. Pure, and the real supervisor without a process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fakestore import FakeStore

from nodeagent.cluster.member_record import member_record
from nodeagent.cluster.membership import Membership
from nodeagent.config.load import parse_config
from nodeagent.config.model import RestartSpec
from nodeagent.core.events import EventBus
from nodeagent.node.supervisor import Supervisor
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import ComponentView, Hold, HoldKind, MemberReport, NodeView, ReportLayer


def view(name: str, **kw: Any) -> ComponentView:
    base: dict[str, Any] = {"name": name, "kind": "vllm", "state": "ready", "running": True, "up": True,
                            "ready": True, "desired": "running", "deps": (), "deps_up": True,
                            "restart": RestartSpec(), "pid": 7}  # fmt: skip
    return ComponentView(**{**base, **kw})


def test_the_record_has_the_previous_versions_keys() -> None:
    """The wire format: what an agent of the previous version wrote for the same node (it reads ours)."""
    held = Hold(HoldKind.BARRIER, "waiting 4s at the start barrier", data={"group": "g"})
    node = NodeView(node="n0", paused=True, pause={"by": "op"}, redeploying=False, components={
        "vllm": view("vllm", state="starting", ready=False, last_load_s=1800.0, loading=True, load_left_s=0.0),
        "vllm-dp1": view("vllm-dp1", state="stopped", running=False, ready=False, pid=None, hold=held),
        "etcd": view("etcd", hold=held),  # a process runs: its hold is not shown
    }, recovery={"state": "isolated", "reason": "chip 3 lost", "drain": "isolated@1"})  # fmt: skip
    report = MemberReport(gangs={"g": {"generation": 3}}).merged(MemberReport(kv_transfers=[[1.5, "d0", "p0"]]))
    record = member_record({"name": "n0", "ip": "10.0.0.1"}, node, report, {"pid": 5}, 99.0).to_wire()
    assert record == {
        "name": "n0", "ip": "10.0.0.1", "wall_clock": 99.0, "paused": True,
        "components": {
            "vllm": {"state": "starting", "pid": 7, "ready": False, "last_load_s": 1800.0, "load": "longer than usual"},
            "vllm-dp1": {"state": "stopped", "pid": None, "ready": False,
                         "hold": {"kind": "barrier", "reason": "waiting 4s at the start barrier",
                                  "resolves_itself": True}},
            "etcd": {"state": "ready", "pid": 7, "ready": True},
        },
        "gangs": {"g": {"generation": 3}}, "agent": {"pid": 5}, "isolated": "chip 3 lost",
        "kv_transfers": [[1.5, "d0", "p0"]],
    }  # fmt: skip
    assert list(record) == ["name", "ip", "wall_clock", "paused", "components", "gangs", "agent", "isolated",
                            "kv_transfers"]  # fmt: skip


def test_a_process_publishes_the_cluster_file_it_was_launched_with() -> None:
    """An incompatible rollout routes a group by what its ranks run (`rollout.running`): a process's file, only while
    it runs and only when its agent knows it (the previous version's keys otherwise)."""
    node = NodeView(node="n0", paused=False, pause=None, redeploying=False, components={
        "vllm": view("vllm", launched_file="S-old"),
        "vllm-dp1": view("vllm-dp1", state="stopped", running=False, ready=False, pid=None, launched_file="S-old"),
    })  # fmt: skip
    comps = member_record({"name": "n0"}, node, MemberReport(), {}, 1.0).to_wire()["components"]
    assert comps["vllm"]["file"] == "S-old" and "file" not in comps["vllm-dp1"]


class Gangs(ReportLayer):
    def member_report(self) -> MemberReport:
        return MemberReport(gangs={"g": {"generation": 2, "released": True}})

    def status_section(self) -> dict[str, Any]:
        return {"gangs": {"g": {"generation": 2, "released": True}}}


def renamed(status: dict[str, Any]) -> dict[str, Any]:
    """/status with its keys renamed, as an API change might: `state` → `phase`, `paused` → `on_hold`..."""
    comps = {n: {("phase" if k == "state" else k): v for k, v in c.items()} for n, c in status["components"].items()}
    return {("on_hold" if k == "paused" else "groups" if k == "gangs" else k): v
            for k, v in {**status, "components": comps}.items()}  # fmt: skip


@pytest.mark.parametrize("rename", [False, True])
async def test_renaming_a_status_key_does_not_change_the_member_record(tmp_path: Path, monkeypatch: Any,
                                                                      rename: bool) -> None:  # fmt: skip
    """The real supervisor (not started: no process) as membership's host, a layer reporting its gangs."""
    config = parse_config(f"""
cluster: {{name: fake}}
node: {{name: n0, ip: 127.0.0.1, role: master}}
agent: {{state_dir: {tmp_path}/state, log_dir: {tmp_path}/logs, systemd_scopes: never}}
components:
  a: {{kind: process, command: ["python3", "-c", "pass"]}}
""")  # fmt: skip
    sup = Supervisor(config, EventBus())
    sup.attach(Gangs())
    sup.set_paused(True, "op")
    if rename:
        original = Supervisor.status
        monkeypatch.setattr(Supervisor, "status", lambda self: renamed(original(self)))
        assert "phase" in sup.status()["components"]["a"] and "on_hold" in sup.status()
    record = Membership(config, sup, FakeStore(), clock=Clock()).record()
    assert record["paused"] is True and record["gangs"] == {"g": {"generation": 2, "released": True}}
    assert record["components"] == {"a": {"state": "stopped", "pid": None, "ready": False}}

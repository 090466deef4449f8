"""The rollout's pure parts: the planner (what changes, the order under the floor, refusals) on real cluster
files, and the step state machine on hand-made observations."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import ClusterHarness

from nodeagent.cluster.rollout import rules as rr
from nodeagent.cluster.rollout.plan import Options, PlanError, make_plan
from nodeagent.cluster.rollout.record import Record, Step, new_record
from nodeagent.cluster.rollout.states import RESTARTS, Phase, Status
from nodeagent.cluster.rollout.view import time_left
from nodeagent.config.cluster import cluster_file_hash
from nodeagent.config.load import load_config

NODES = ["n0", "n1", "n2", "n3", "n4", "n5"]


def harness(tmp: Path, decode_groups: int = 1) -> ClusterHarness:
    h = ClusterHarness(tmp, "127.0.0.1:2379", NODES)
    groups = [{"name": "p0", "kind": "prefill", "nodes": ["n0", "n1"], "data_parallel_rpc_port": 43000},
              {"name": "p1", "kind": "prefill", "nodes": ["n2", "n3"], "data_parallel_rpc_port": 43001},
              {"name": "d0", "kind": "decode", "nodes": ["n4"]}]  # fmt: skip
    if decode_groups == 2:
        groups.append({"name": "d1", "kind": "decode", "nodes": ["n5"]})
    else:
        groups[2]["nodes"] = ["n4", "n5"]
        groups[2]["data_parallel_rpc_port"] = 43002
    h.data["cluster"]["vllm_groups"] = groups
    h.data["cluster"]["pd"] = {"kv_port_base": 41000}
    return h


def plan_for(tmp: Path, edit: Any, decode_groups: int = 1, load_s: dict[str, float] | None = None,
             overhead_s: dict[str, float] | None = None, **options: Any) -> Any:  # fmt: skip
    h = harness(tmp / "old", decode_groups)
    old = load_config(h.write("n0"))
    new_h = harness(tmp / "new", decode_groups)
    new_h.data = copy.deepcopy(h.data)
    new_h.home = tmp / "new"
    edit(new_h.data)
    new = load_config(new_h.write("n0"))
    return make_plan(old, new, Options.from_dict(options), old_hash=cluster_file_hash(old),
                     new_hash=cluster_file_hash(new), load_s=load_s, overhead_s=overhead_s)  # fmt: skip


def group_env(*groups: str, **env: str) -> Any:
    def edit(data: dict[str, Any]) -> None:
        for g in data["cluster"]["vllm_groups"]:
            if g["name"] in groups:
                g["env"] = {**g.get("env", {}), **env}

    return edit


def test_a_change_of_every_group_steps_prefill_then_decode_and_the_single_decode_refuses(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["components"]["vllm"]["max_model_len"] = 8192

    plan = plan_for(tmp_path, edit, load_s={"d0": 1800.0})
    assert [c.group for c in plan.changes] == ["p0", "p1", "d0"]
    assert "n0/vllm: --max_model_len 204800 → 8192" in plan.changes[0].reasons
    assert [s.groups for s in plan.steps] == [("p0",), ("p1",), ("d0",)]
    assert not plan.ok
    assert plan.refused == ("decode has one group (d0): its step takes decode down for ~30 min (its last load); "
                            "pass --allow-outage decode",)  # fmt: skip
    allowed = plan_for(tmp_path / "b", edit, load_s={"d0": 1800.0}, allow_outage="decode")
    assert allowed.ok and allowed.steps[2].outage == ("decode",) and allowed.steps[2].expected_outage_s == 1800.0


def test_a_steps_outage_is_measured_and_the_next_estimate_adds_its_drain_stop_and_readd(tmp_path: Path) -> None:
    """issue 31: the dry run promised 'prefill outage expected ~3 s' (the last load) and the step was out of the
    proxy 7.5 s. A step now records when the proxy let its groups go and took them back, and the time in each
    phase; the next plan expects the last load plus what the last step cost beyond it."""
    from nodeagent.cli.remote import outage_text, rollout_lines
    from nodeagent.cluster.rollout.view import measured_overhead_s

    step = Step(("d0",), ("decode",), "a", "b", outage=("decode",), expected_outage_s=3.0)
    record = Record("r1", "n0: op", 0.0, "a", "b", Options(), (step,))
    t = 100.0
    record = record.with_step(0, rr._enter(step, "draining", t))
    record = rr.mark(record, 0, "proxy_out", "n0", now=t + 0.5)
    for phase, at in (("staging", 2.0), ("restarting", 3.0), ("gating", 6.0), ("rejoining", 6.5)):
        record = record.with_step(0, rr._enter(record.steps[0], phase, t + at))
    record = rr.mark(record, 0, "proxy_in", "n0", now=t + 8.0)
    record = record.with_step(0, rr._enter(record.steps[0], "done", t + 9.0))
    done = record.steps[0]
    assert done.out_of_proxy_s == 7.5 and done.phase_s == {"draining": 2.0, "staging": 1.0, "restarting": 3.0,
                                                            "gating": 0.5, "rejoining": 2.5}  # fmt: skip
    assert Step.from_dict(done.to_dict()) == done
    assert measured_overhead_s(record) == {"d0": 4.5}  # 7.5 s out of the proxy, 3 s of it loading
    assert outage_text(done.to_dict()) == "out of the proxy 7.5 s (expected ~3.0 s)"
    assert rollout_lines(record.to_dict())[-1].endswith("— out of the proxy 7.5 s (expected ~3.0 s)")

    def edit(data: dict[str, Any]) -> None:
        data["components"]["vllm"]["max_model_len"] = 8192

    plan = plan_for(tmp_path, edit, load_s={"d0": 3.0}, overhead_s=measured_overhead_s(record),
                    allow_outage="decode")  # fmt: skip
    assert plan.steps[2].expected_outage_s == 7.5
    assert plan.steps[2].note == ("decode outage expected ~8 s (its last load + drain, stop and proxy re-add as its "
                                  "last rollout step measured them): requests through the proxy fail meanwhile")
    unmeasured = plan_for(tmp_path / "b", edit, load_s={"d0": 3.0}, allow_outage="decode")
    assert unmeasured.steps[2].note.startswith("decode outage expected ~3 s (its last load): ")


def test_order_canary_and_max_unavailable(tmp_path: Path) -> None:
    edit = group_env("p0", "p1", "d0", "d1", X="1")
    plan = plan_for(tmp_path, edit, decode_groups=2, order="decode,prefill", canary="p1")
    assert [s.groups for s in plan.steps] == [("p1",), ("d0",), ("d1",), ("p0",)] and plan.ok
    assert plan.steps[0].note == "canary"
    wide = plan_for(tmp_path / "b", edit, decode_groups=2, max_unavailable=3)
    assert [s.groups for s in wide.steps] == [("p0",), ("p1",), ("d0",), ("d1",)], "never every group of a kind"
    with pytest.raises(PlanError, match="unknown group 'nope'"):
        plan_for(tmp_path / "c", edit, canary="nope")
    with pytest.raises(PlanError, match="order: unknown kind 'prefil'"):
        Options.from_dict({"order": "prefil,decode"})


def test_unchanged_groups_are_left_and_nothing_to_do_is_said(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, group_env("p1", X="1"))
    assert [c.group for c in plan.changes] == ["p1"] and plan.unchanged == ("p0", "d0") and plan.ok
    none = plan_for(tmp_path / "b", lambda data: None)
    assert not none.ok and none.notes == ("no vLLM group renders differently: nothing to roll out",)


def test_topology_and_changes_outside_the_groups_are_refused(tmp_path: Path) -> None:
    def move(data: dict[str, Any]) -> None:
        data["cluster"]["vllm_groups"][1]["nodes"] = ["n3", "n2"]

    assert any("group p1 changes its kind, nodes or ranks: that is a topology change" in r
               for r in plan_for(tmp_path, move).refused)  # fmt: skip

    def worker(data: dict[str, Any]) -> None:
        data["components"]["datasystem"]["shared_memory_size_mb"] = 512

    refused = plan_for(tmp_path / "b", worker).refused
    assert refused and all("datasystem changes" in r and "vLLM groups only" in r for r in refused)


def test_an_incompatible_connector_change_switches_a_pair_then_the_rest(tmp_path: Path) -> None:
    def connector(data: dict[str, Any]) -> None:
        data["cluster"]["pd"]["use_ascend_direct"] = False

    plan = plan_for(tmp_path, connector, decode_groups=2, max_unavailable=2)
    assert plan.incompatible and all("KV connector" in i for i in plan.incompatible)
    assert [s.groups for s in plan.steps] == [("p0", "d0"), ("p1", "d1")]
    assert plan.exclusive and plan.switch_gap_s is None, "no proxy in this file: nothing of ours to switch"
    assert plan.ok, plan.refused
    narrow = plan_for(tmp_path / "b", connector, decode_groups=2)
    assert any("needs --max-unavailable 2" in r for r in narrow.refused)
    half = plan_for(tmp_path / "c", group_env("p0", "d1", VLLM_ASCEND_X="1"), decode_groups=2)
    assert not half.incompatible, "an env change is compatible"


def with_proxy(edit: Any) -> Any:
    def both(data: dict[str, Any]) -> None:
        edit(data)
        data["components"]["proxy"] = {"kind": "proxy", "command": "python3", "script": "/opt/proxy.py", "port": 42000,
                                       "host": "127.0.0.1", "activation_check_s": 2}  # fmt: skip

    return both


def test_an_incompatible_change_behind_the_proxy_states_the_switch_and_needs_the_outage_allowed(
        tmp_path: Path) -> None:  # fmt: skip
    """The proxy cannot swap both kinds at once, and no request may meet both files: between the old groups
    leaving it and the new pair joining it, nothing serves — an outage of both kinds, stated and allowed."""

    def connector(data: dict[str, Any]) -> None:
        data["cluster"]["pd"]["use_ascend_direct"] = False

    def plan(tmp: Path, **options: Any) -> Any:
        h = harness(tmp / "old", 2)
        with_proxy(lambda data: None)(h.data)
        old = load_config(h.write("n0"))
        new_h = harness(tmp / "new", 2)
        new_h.data = copy.deepcopy(h.data)
        new_h.home = tmp / "new"
        connector(new_h.data)
        new = load_config(new_h.write("n0"))
        return make_plan(old, new, Options.from_dict(options), old_hash="old", new_hash="new",
                         load_s={"p1": 1500.0, "d1": 1800.0})  # fmt: skip

    refused = plan(tmp_path / "a", max_unavailable=2)
    assert refused.exclusive and refused.switch_gap_s == 2.25
    assert refused.refused == ("an incompatible change switches the proxy from the old groups to the new pair with no "
                               "group in it for ~2 s (the proxy cannot swap both kinds at once, and no request may "
                               "meet both files): pass --allow-outage prefill,decode",)  # fmt: skip
    allowed = plan(tmp_path / "b", max_unavailable=2, allow_outage=["prefill", "decode"])
    assert allowed.ok, allowed.refused
    first, rest = allowed.steps
    assert first.outage == () and first.note == ("first pair: the old groups serve meanwhile; as it rejoins, the proxy "
                                                 "switches (the old groups leave, then the pair joins: ~2 s with no "
                                                 "group)")  # fmt: skip
    assert rest.note == ("the rest at once, out of the proxy since the switch: p0, d0 serve alone meanwhile (their "
                         "load ~30 min, then the bake)")  # fmt: skip
    assert new_record("r1", "op", 0.0, allowed).exclusive


def exclusive_record() -> Record:
    opts = Options.from_dict({"bake_s": 60, "drain_timeout_s": 30, "gate_timeout_s": 600, "max_unavailable": 2})
    return Record("r1", "n0", 0.0, "old", "new", opts, (Step(("p0", "d0"), ("prefill", "decode"), "old", "new"),
                                                          Step(("p1", "d1"), ("prefill", "decode"), "old", "new")),
                     exclusive=True)  # fmt: skip


def test_an_exclusive_rollout_keeps_the_files_apart_in_the_proxy() -> None:
    """Before the pair passes its gate the proxy routes the old groups; as it rejoins, every old group is held out
    and the pair is fenced until they left; a failure after the switch turns it back; abort never leaves a mix."""
    rec = exclusive_record()
    assert rr.held_out(rec) == {} and rr.fence(rec) == {}, "nothing moved: nothing held"
    staging = rec.with_step(0, replace(rec.steps[0], phase="staging"))
    assert set(rr.held_out(staging)) == {"p0", "d0"} and rr.serving_hash(staging) == "old"
    assert rr.fence(staging) == {"p1": ("d0", "p0"), "d1": ("d0", "p0")}, "the old ones are never added beside it"
    switched = rec.with_step(0, replace(rec.steps[0], phase="rejoining"))
    assert rr.serving_hash(switched) == "new"
    held = rr.held_out(switched)
    assert set(held) == {"p1", "d1"} and "runs old while the proxy routes new" in held["p1"]
    assert rr.fence(switched) == {"p0": ("d1", "p1"), "d0": ("d1", "p1")}
    assert Record.from_dict(switched.to_dict()) == switched, "exclusive survives etcd"
    with pytest.raises(ValueError, match=r"would leave d1, p1 on the other file"):
        rr.control(switched, "abort", 5, "op")
    assert rr.control(staging, "pause", 5, "op").status == "paused"
    assert rr.control(rec, "abort", 5, "op").status == "aborting", "before the pair's restart: nothing mixes"
    baked_badly = rr._fail(switched, 0, switched.steps[0], "while baking: errors", 9)
    assert rr.serving_hash(baked_badly) == "old" and set(rr.held_out(baked_badly)) == {"p0", "d0"}
    assert rr.fence(baked_badly) == {"p1": ("d0", "p0"), "d1": ("d0", "p0")}, "the old ones back once the pair left"
    done = switched.with_step(0, replace(switched.steps[0], phase="done"))
    done = done.with_step(1, replace(done.steps[1], phase="done"))
    assert rr.held_out(done) == {} and rr.fence(done) == {}
    plain = replace(switched, exclusive=False)
    assert rr.held_out(plain) == {} and rr.fence(plain) == {}, "a compatible change mixes freely"


def test_an_exclusive_rollout_routes_a_group_by_the_file_its_ranks_run_after_its_way_back_failed() -> None:
    """Found by the simulation (seed 760050, 8-node, an incompatible change): the second step failed its bake, and
    its way back failed too (a crash during the gate): `failed`, the step left in `gating`. The record then said
    "either file" for its groups for good, so they stayed out of the proxy — also once the operator's rollback had
    put the first pair back on the old file; and that rollback drove the stuck step again (failing it again), never
    its undo. The groups are judged by the file their ranks run (`running.group_runs`), the stuck step is closed."""
    opts = Options.from_dict({"bake_s": 60, "drain_timeout_s": 30, "gate_timeout_s": 600, "max_unavailable": 2})
    pair = Step(("p0", "d0"), ("prefill", "decode"), "old", "new", phase=Phase.DONE)
    back = Step(("p1",), ("prefill",), "new", "old", failed="while baking: p1 failed", phase=Phase.GATING)
    rec = Record("r1", "n0", 0.0, "old", "new", opts, (pair, back), Status.FAILED, exclusive=True,
                 new_shared="S-new", old_shared="S-old")  # fmt: skip
    assert Record.from_dict(rec.to_dict()) == rec, "old_shared survives etcd"
    runs = {"p0": frozenset({"S-new"}), "d0": frozenset({"S-new"}), "p1": frozenset({"S-old"})}
    assert set(rr.held_out(rec, runs)) == {"p1"}, "p1 runs the old file while the pair serves the new one"
    rolling = rr.control(rec, "rollback", 10, "op")
    assert [(s.groups, s.phase) for s in rolling.steps] == [(("p0", "d0"), "done"), (("p1",), "skipped"),
                                                            (("p0", "d0"), "pending")]  # fmt: skip
    assert rolling.current() == 2, "the stuck step is closed: the undo of the pair runs, not the stuck step again"
    undone = rolling.with_step(2, replace(rolling.steps[2], phase=Phase.DONE))
    undone = replace(undone, status=Status.ROLLED_BACK)
    assert rr.serving_hash(undone) == "old" and rr.wanted_hash(undone, "p1", "n2") == "old"
    old = {"p0": frozenset({"S-old"}), "d0": frozenset({"S-old"}), "p1": frozenset({"S-old"})}
    assert rr.held_out(undone, old) == {} and rr.fence(undone, old) == {}, "every group runs the old file: routed"
    mixed = {**old, "p1": frozenset({"S-old", "S-new"})}
    assert set(rr.held_out(undone, mixed)) == {"p1"}, "a group with ranks on both files is never routed"
    assert set(rr.held_out(undone, {**old, "d0": frozenset({"S-new"})})) == {"d0"}, "nor one on the other file"
    assert set(rr.held_out(undone, {**old, "p1": frozenset({"S-reloaded"})})) == {"p1"}, "another file: the record"
    assert set(rr.held_out(undone)) == {"p1"}, "no member says: the record decides (its step said the new file)"
    assert rr.held_out(rec, old) == {}, "failed, the record routing the new file, every group on the old: all routed"


def test_what_a_groups_ranks_run_comes_from_its_members_records() -> None:
    """A rank with a process: the file it was launched with; without: its member's config (its next start)."""
    from types import SimpleNamespace

    from nodeagent.cluster.rollout.running import group_runs

    def group(name: str, *ranks: str) -> Any:
        return SimpleNamespace(name=name, processes=[SimpleNamespace(node=n, component="vllm") for n in ranks])

    members = {"n0": {"cluster_hash": "S-new", "components": {"vllm": {"pid": 7, "file": "S-old"}}},
               "n1": {"cluster_hash": "S-new", "components": {"vllm": {"pid": None}}},
               "n2": {"cluster_hash": "S-old", "components": {"vllm": {"pid": 9}}}}  # fmt: skip
    groups = [group("p0", "n0", "n1"), group("p1", "n2"), group("d0", "n3")]
    assert group_runs(groups, members) == {"p0": frozenset({"S-old", "S-new"})}, \
        "n2's process has no file (an older agent) and n3 no record: the record decides for them"


def test_an_exclusive_steps_ranks_start_only_once_the_proxy_lists_none_of_its_groups() -> None:
    """`proxy_wait`: from staging to the gate (the phases in which its ranks start on the other file), until the
    proxy's agent marks the step unlisted; marked again from scratch when the step turns back."""
    rec = exclusive_record()
    assert rr.proxy_wait(rec, "p0", True) is None, "pending: the old processes run on"
    for phase in RESTARTS:
        moving = rec.with_step(0, replace(rec.steps[0], phase=phase))
        why = rr.proxy_wait(moving, "d0", True)
        assert why is not None and "waiting for the proxy to delete p0, d0" in why, phase
        assert rr.proxy_wait(moving, "p1", True) is None, "another step's group"
        assert rr.proxy_wait(moving, "d0", False) is None, "no proxy: nothing routes"
        assert rr.proxy_wait(replace(moving, exclusive=False), "d0", True) is None, "a compatible change mixes freely"
        unlisted = rr.mark(moving, 0, "unlisted", "n0")
        assert unlisted is not None and rr.proxy_wait(unlisted, "d0", True) is None
        assert rr.mark(unlisted, 0, "unlisted", "n1") is None, "marked once"
        assert Step.from_dict(unlisted.steps[0].to_dict()) == unlisted.steps[0], "survives etcd"
    draining = rec.with_step(0, replace(rec.steps[0], phase="draining"))
    assert rr.mark(draining, 0, "unlisted", "n0") is None, "only while its ranks may start"
    gating = rr.mark(rec.with_step(0, replace(rec.steps[0], phase="gating")), 0, "unlisted", "n0")
    assert gating is not None
    back = rr._fail(gating, 0, gating.steps[0], "the canary failed", 9)
    assert not back.steps[0].unlisted and rr.proxy_wait(back, "p0", True) is not None, "turned back: asked again"


# ---- the state machine ----------------------------------------------------------------------------------------

GROUPS = {"p0": ("prefill", ("n0", "n1")), "p1": ("prefill", ("n2", "n3")), "d0": ("decode", ("n4",))}


def observed(now: float, gens: dict[str, int], healthy: dict[str, bool] | None = None,
             failed: dict[str, dict[str, int]] | None = None, proxy: bool = True) -> rr.Observed:  # fmt: skip
    healthy = healthy or {}
    groups = {g: rr.GroupObs(kind, nodes, gens.get(g, 1), healthy.get(g, True), "" if healthy.get(g, True) else
                             "n2/vllm is starting", (failed or {}).get(g, {}))
              for g, (kind, nodes) in GROUPS.items()}  # fmt: skip
    reports = {n: {"hash": "new", "previous": "old"} for _, (_, nodes) in GROUPS.items() for n in nodes}
    return rr.Observed(now, groups, reports, proxy)


def record(*steps: tuple[str, ...], **options: Any) -> Record:
    opts = Options.from_dict({"bake_s": 60, "drain_timeout_s": 30, "gate_timeout_s": 600, **options})
    return Record("r1", "n0", 0.0, "old", "new", opts, tuple(Step(s, ("prefill",), "old", "new") for s in steps))


def move(rec: Record, obs: rr.Observed) -> tuple[Record, list[rr.Ask]]:
    out = rr.advance(rec, obs)
    assert out is not None, f"nothing moved from {rec.steps[rec.current() or 0].phase}: {rec.message}"
    return out


def marked(rec: Record, what: str, *nodes: str, value: str = "") -> Record:
    for node in nodes:
        new = rr.mark(rec, rec.current() or 0, what, node, value)
        assert new is not None
        rec = new
    return rec


def to_gating(rec: Record) -> Record:
    """p0's step drained, staged and restarted (generation 1 → 2): at its gate."""
    rec, _ = move(rec, observed(1, {}))
    rec = marked(marked(rec, "drained", "n0", "n1"), "proxy_out", "n0")
    rec, _ = move(rec, observed(2, {}))
    rec, _ = move(marked(rec, "staged", "n0", "n1"), observed(3, {"p0": 1}))
    rec, _ = move(rec, observed(4, {"p0": 2}))
    assert rec.steps[0].phase == "gating"
    return rec


def test_one_step_through_every_phase() -> None:
    rec = record(("p0",), ("p1",))
    rec, _ = move(rec, observed(10, {}))
    assert rec.steps[0].phase == "draining" and rr.held_out(rec) == {"p0": "rollout r1 step 1: draining"}
    assert rr.advance(rec, observed(11, {})) is None, "no drain yet"
    rec = marked(rec, "drained", "n0", "n1")
    assert rr.advance(rec, observed(12, {})) is None, "the proxy has not taken it out yet"
    rec = marked(rec, "proxy_out", "n0")
    rec, _ = move(rec, observed(12, {}))
    assert rec.steps[0].phase == "staging"
    assert rr.wanted_hash(rec, "p0", "n0") == "old"
    rec = marked(rec, "staged", "n0")
    assert rr.wanted_hash(rec, "p0", "n0") == "new" and rr.wanted_hash(rec, "p0", "n1") == "old"
    rec = marked(rec, "staged", "n1")
    rec, asks = move(rec, observed(13, {"p0": 4}))
    assert rec.steps[0].phase == "restarting" and asks == [rr.Ask("p0", 4, "rollout r1: old → new")]
    assert rr.advance(rec, observed(14, {"p0": 4})) is None
    assert move(rec, observed(30, {"p0": 4}))[1] == asks, "asked again after 10 s (idempotent)"
    rec, _ = move(rec, observed(31, {"p0": 5}, {"p0": False}))
    assert rec.steps[0].phase == "gating"
    assert rr.advance(rec, observed(32, {"p0": 5})) is None, "healthy, canary not answered yet"
    rec = marked(rec, "canary", "p0", value="ok")
    rec, _ = move(rec, observed(33, {"p0": 5}))
    assert rec.steps[0].phase == "rejoining" and rr.held_out(rec) == {}
    rec = marked(rec, "proxy_in", "n0")
    rec, _ = move(rec, observed(34, {"p0": 5}))
    assert rec.steps[0].phase == "baking"
    assert rr.advance(rec, observed(60, {"p0": 5})) is None
    rec, _ = move(rec, observed(94, {"p0": 5}))
    assert rec.steps[0].phase == "done" and rec.current() == 1


def test_done_waits_for_every_member_to_publish_the_new_file() -> None:
    """The last step done: the member no step touched (n4) takes the new file now, and the rollout is done once
    every member record publishes it, or after PUBLISH_TIMEOUT_S naming who does not."""
    rec = replace(record(("p0",)), new_shared="NEW")
    rec = rec.with_step(0, replace(rec.steps[0], phase="done", finished=100.0))
    assert rec.finishing and rr.wanted_hash(rec, "d0", "n4") == "new" and rr.wanted_hash(rec, None, "n9") == "new"
    assert rr.wanted_hash(replace(rec, status="rolling_back"), "d0", "n4") == "old"

    def obs(now: float, n4: str) -> rr.Observed:
        return replace(observed(now, {}), published={"n0": "NEW", "n1": "NEW", "n4": n4})

    waiting, _ = move(rec, obs(101, "OLD"))
    assert waiting.status == "running" and "waiting for every member to publish NEW" in waiting.message
    assert rr.advance(waiting, obs(102, "OLD")) is None, "the wait is written once"
    done, _ = move(waiting, obs(103, "NEW"))
    assert done.status == "done" and done.message == "rollout r1: every step done"
    late, _ = move(waiting, obs(100 + rr.PUBLISH_TIMEOUT_S, "OLD"))
    assert late.status == "done" and "n4 (OLD) still publish another file after 60s" in late.message
    legacy = replace(rec, new_shared="")
    assert move(legacy, obs(101, "OLD"))[0].status == "done", "a record without the hash: done as before"


def test_the_floor_holds_a_step_and_the_drain_times_out() -> None:
    rec = record(("p0",))
    out = move(rec, observed(1, {}, {"p1": False}))[0]
    assert out.steps[0].phase == "pending" and "floor: no other prefill group serving (p1" in out.message
    assert rr.advance(out, observed(2, {}, {"p1": False})) is None, "the same wait is written once"
    assert rr.advance(out, observed(3, {}, {"p1": False, "d0": False})) is None, "another wait: not within 30 s"
    assert "floor: no other decode" in move(out, observed(40, {}, {"p1": True, "d0": False}))[0].message
    rec, _ = move(rec, observed(3, {}))
    rec, _ = move(rec, observed(40, {}))
    assert rec.steps[0].phase == "staging" and "drain timed out after 30s" in rec.message


def test_a_failure_in_the_gate_turns_the_step_back_and_halts() -> None:
    rec = record(("p0",), ("p1",))
    rec = to_gating(rec)
    rec, _ = move(rec, observed(5, {"p0": 2}, failed={"p0": {"n1/vllm": 2}}))
    step = rec.steps[0]
    assert step.phase == "staging" and step.failed == "n1/vllm failed" and (step.from_hash, step.to_hash) == ("new",
                                                                                                            "old")
    assert rr.held_out(rec) == {"p0": "rollout r1 step 1: staging"}, "still out of the proxy"
    rec, asks = move(marked(rec, "staged", "n0", "n1"), observed(6, {"p0": 3}))
    assert asks[0].base == 3 and asks[0].reason.startswith("rollback")
    rec, _ = move(rec, observed(7, {"p0": 4}, failed={"p0": {"n1/vllm": 2}}))
    assert rec.steps[0].phase == "gating", "the old failure (generation 2) is not the rollback's"
    rec, _ = move(marked(rec, "canary", "p0", value="ok"), observed(8, {"p0": 4}))
    rec, _ = move(marked(rec, "proxy_in", "n0"), observed(9, {"p0": 4}))
    assert rec.steps[0].phase == "rolled_back" and rec.status == "halted" and rec.steps[1].phase == "pending"
    assert rr.wanted_hash(rec, "p0", "n0") == "old" and rr.advance(rec, observed(10, {"p0": 4})) is None
    resumed = rr.control(rec, "resume", 11, "op")
    assert resumed.status == "running" and resumed.steps[0].phase == "pending"
    assert (resumed.steps[0].from_hash, resumed.steps[0].to_hash) == ("old", "new")


def test_a_rollout_that_failed_going_back_holds_its_group_out_of_the_proxy_no_longer() -> None:
    """Found by the simulation (seed 760038, 8-node): a cluster redeploy during decode0's gate failed the step, and
    its way back too ("the group is left as it is", status failed). The step stays in `gating` in the final record,
    and the proxy kept the only decode group out for good — however healthy, nothing left to take it back in."""
    rec = to_gating(record(("p0",), ("p1",)))
    rec, _ = move(rec, observed(5, {"p0": 2}, failed={"p0": {"n1/vllm": 2}}))
    rec, _ = move(marked(rec, "staged", "n0", "n1"), observed(6, {"p0": 3}))
    rec, _ = move(rec, observed(7, {"p0": 4}))
    assert rec.steps[0].phase == "gating" and rec.steps[0].failed
    rec, _ = move(rec, observed(8, {"p0": 5}))
    assert rec.status == "failed" and rec.steps[0].phase == "gating", rec.message
    assert rr.held_out(rec) == {}, "a final rollout holds nothing out: the group's own health decides"


def test_a_group_failing_its_bake_is_drained_before_it_goes_back() -> None:
    """Failed while baking, the group is in the proxy and serving: it leaves and drains as on the way out before
    the rollback restarts it (CI: straight to staging, the restart killed four requests in flight), keeps
    running the new file meanwhile, and an abort does not cancel that drain."""
    rec = record(("p0",), ("p1",))
    rec = to_gating(rec)
    rec, _ = move(marked(rec, "canary", "p0", value="ok"), observed(5, {"p0": 2}))
    rec, _ = move(marked(rec, "proxy_in", "n0"), observed(6, {"p0": 2}))
    rec, _ = move(marked(rec, "bake", "p0", value="mean TTFT 20x"), observed(7, {"p0": 2}))
    step = rec.steps[0]
    assert step.phase == "draining" and step.failed == "while baking, p0: mean TTFT 20x"
    assert (step.from_hash, step.to_hash) == ("new", "old") and not step.proxy_out and not step.drained
    assert rr.held_out(rec) == {"p0": "rollout r1 step 1: draining"} and rr.wanted_hash(rec, "p0", "n0") == "new"
    assert rr.advance(rec, observed(8, {"p0": 2})) is None, "not drained yet"
    aborting = rr.control(rec, "abort", 8, "op")
    assert rr.advance(aborting, observed(9, {"p0": 2})) is None, "an abort does not cancel the way back"
    rec = marked(marked(rec, "drained", "n0", "n1"), "proxy_out", "n0")
    rec, _ = move(rec, observed(9, {"p0": 2}))
    assert rec.steps[0].phase == "staging" and rr.wanted_hash(rec, "p0", "n0") == "new"
    rec, asks = move(marked(rec, "staged", "n0", "n1"), observed(10, {"p0": 2}))
    assert asks[0].reason.startswith("rollback") and rr.wanted_hash(rec, "p0", "n0") == "old"
    rec, _ = move(rec, observed(11, {"p0": 3}))
    rec, _ = move(marked(rec, "canary", "p0", value="ok"), observed(12, {"p0": 3}))
    rec, _ = move(marked(rec, "proxy_in", "n0"), observed(13, {"p0": 3}))
    assert rec.steps[0].phase == "rolled_back" and rec.status == "halted"


def test_pause_abort_and_rollback_controls() -> None:
    rec = record(("p0",), ("p1",))
    rec, _ = move(rec, observed(1, {}))
    paused = rr.control(rec, "pause", 2, "op")
    assert paused.status == "paused" and paused.steps[0].phase == "draining"
    with pytest.raises(ValueError, match="only a running rollout pauses"):
        rr.control(paused, "pause", 3, "op")
    aborted = rr.control(rec, "abort", 3, "op")
    assert [s.phase for s in aborted.steps] == ["draining", "skipped"]
    aborted, _ = move(aborted, observed(4, {}))
    assert aborted.steps[0].phase == "skipped" and rr.held_out(aborted) == {}
    aborted, _ = move(aborted, observed(5, {}))
    assert aborted.status == "aborted"
    back = rr.control(rec, "rollback", 6, "op")
    assert back.status == "rolling_back" and [(s.groups, s.rollback, s.phase) for s in back.steps] == [
        (("p0",), False, "draining"), (("p1",), False, "skipped"), (("p0",), True, "pending")]
    assert (back.steps[2].from_hash, back.steps[2].to_hash) == ("new", "old")


def test_abort_closes_a_halted_rollout_so_the_next_can_start() -> None:
    """A halted rollout whose only step was rolled back has nothing to resume into safely nor to roll back: abort
    closes it (else no new rollout could ever start: `plan` refuses beside a halted one)."""
    halted = replace(record(("p1",)), status="halted")
    closed = rr.control(halted, "abort", 7, "op")
    assert closed.status == "aborted" and not closed.active and "closed by op" in closed.message
    with pytest.raises(ValueError, match="aborted already"):
        rr.control(closed, "abort", 8, "op")
    with pytest.raises(ValueError, match="no step was done"):
        rr.control(halted, "rollback", 8, "op")


def test_time_left_from_load_times_then_from_steps_done() -> None:
    rec = record(("p0",), ("p1",))
    assert time_left(rec, {}, 0) is None
    assert time_left(rec, {"p0": 100.0, "p1": 200.0}, 0) == 100 + 60 + 200 + 60
    done = rec.with_step(0, Step(("p0",), (), "old", "new", phase="done", started=0.0, finished=500.0))
    assert time_left(done, {}, 600) == 500
    assert Record.from_dict(done.to_dict()) == done, "the record survives etcd"


def test_phases_and_statuses_are_enums_with_the_same_strings_in_etcd() -> None:
    """`Phase`/`Status` are StrEnums: read from etcd they are members, written back the JSON text is unchanged; a
    phase or status this version does not know makes the record unreadable, like any malformed one."""
    rec = replace(record(("p0",), ("p1",)), status="rolling_back")
    text = json.dumps(rec.with_step(0, replace(rec.steps[0], phase="staging")).to_dict())
    back = Record.from_dict(json.loads(text))
    assert back is not None and back.status is Status.ROLLING_BACK and back.steps[0].phase is Phase.STAGING
    assert back.steps[1].phase is Phase.PENDING
    assert json.dumps(back.to_dict()) == text and '"phase": "staging"' in text and '"status": "rolling_back"' in text
    assert Record.from_dict({**json.loads(text), "status": "sideways"}) is None


def test_a_late_view_neither_passes_the_gate_nor_fails_a_healthy_group() -> None:
    """Each agent sees member and gang records through its own watch, a little late (found by the simulation at
    N = 64: a healthy group failed its bake on one agent's late view)."""
    rec = record(("p0",))
    rec = to_gating(rec)
    rec = marked(rec, "canary", "p0", value="ok")
    assert rr.advance(rec, observed(5, {"p0": 1})) is None, "the old generation, all ready: not the gate"
    assert not rr.ready_again(rec.steps[0], observed(5, {"p0": 1}), "p0")
    rec, _ = move(rec, observed(6, {"p0": 2}))
    rec, _ = move(marked(rec, "proxy_in", "n0"), observed(7, {"p0": 2}))
    assert rec.steps[0].phase == "baking"
    assert rr.advance(rec, observed(8, {"p0": 2}, {"p0": False})) is None, "a late view of a healthy group"
    failed, _ = move(rec, observed(9, {"p0": 3}))
    assert failed.steps[0].failed == "while baking: group p0 restarted again (generation 3): a rank failed"


def test_a_step_waiting_for_a_file_says_for_how_long_and_halts_after_the_bound() -> None:
    """The new file on some members only: the step said "waiting for the file … on n1" with a frozen time left for
    ever. It says how long it has waited, halts after FILES_WAIT_S, and a resume waits anew."""
    rec = record(("p0",))
    obs = observed(10, {})
    obs.reports["n1"] = {"hash": "old", "previous": "older"}
    rec, _ = move(rec, obs)
    assert rec.status == "running" and rec.message.startswith("step 1 (p0) waits (0s): waiting for the file new")
    assert "n1 (its file has old" in rec.message
    obs = replace(obs, now=10 + rr.WAIT_SAY_S + 5)
    rec, _ = move(rec, obs)
    assert rec.message.startswith(f"step 1 (p0) waits ({rr.WAIT_SAY_S + 5:.0f}s):"), "since when, not frozen"
    late = replace(obs, now=10 + rr.FILES_WAIT_S)
    halted, _ = move(rec, late)
    assert halted.status == "halted" and "halted after 15 min waiting for the file new" in halted.message
    assert "cluster rollout resume" in halted.message
    resumed = rr.control(halted, "resume", late.now + 1, "op")
    again, _ = move(resumed, replace(late, now=late.now + 2))
    assert again.status == "running" and again.message.startswith("step 1 (p0) waits (0s)"), "a resume waits anew"


def test_the_cli_says_the_same_bound() -> None:
    from nodeagent.cli.remote import FILES_WAIT_MIN, format_plan

    assert FILES_WAIT_MIN * 60 == rr.FILES_WAIT_S
    text = format_plan({"old_hash": "a" * 64, "new_hash": "b" * 64, "have_new_file": ["n0"],
                        "missing_new_file": {"n1": "a" * 12, "n2": "no report"}, "ok": True})  # fmt: skip
    assert "members with the new file: 1 of 3 (n0)" in text
    assert "WITHOUT the new file" in text and "n1 (has aaaaaaaaaaaa), n2 (has no report)" in text

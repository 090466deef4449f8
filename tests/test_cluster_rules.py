"""The cluster's rules as pure functions: generations, barriers, the group's policy, pause, redeploy duties."""

from __future__ import annotations

from nodeagent.cluster.rules import (
    CommandOutcome,
    CommandResult,
    GangRecord,
    GangView,
    RedeployRecord,
    barrier_state,
    bump,
    command_error,
    effective_pause,
    epoch_baseline,
    failed_in,
    may_wipe,
    must_restart_for,
    redeploy_duty,
    settle,
)
from nodeagent.config.model import RestartSpec

SPEC = RestartSpec(backoff_initial_s=10, backoff_max_s=300, redeploy_after_failures=5, stable_after_s=600)
NOW = 1_800_000_000.0


def test_concurrent_failures_make_one_generation() -> None:
    """Two members both saw generation 5 fail: the first CAS wins with 6; the second re-reads 6 and follows."""
    current = GangRecord(generation=5, epoch="e1")
    first = bump(current, 5, node="a2-4", reason="vllm exited", now=NOW, epoch="e1", spec=SPEC)
    assert first is not None
    record, decision = first
    assert record.generation == 6 and record.by == "a2-4" and decision.delay_s == 0
    assert bump(record, 5, node="a2-5", reason="vllm exited", now=NOW, epoch="e1", spec=SPEC) is None


def test_a_rank_failure_asks_from_the_generation_it_ran_in_and_never_twice() -> None:
    """A failure asks the group to leave the generation the rank ran in; one the group has left already (a peer's
    failure or an FT escalation got there first; the rank dies as the gang restart reaches it) asks nothing."""
    running = GangView(GangRecord(generation=5, epoch="e1"), acted=5, acted_epoch="e1")
    assert failed_in(running, 5) == 5 and failed_in(running, None) == 5
    acted = GangView(GangRecord(generation=6, epoch="e1"), acted=6, acted_epoch="e1")
    assert failed_in(acted, 5) is None, "generation 6 is under way here: it restarts that rank"
    assert failed_in(acted, 6) == 6, "a rank of generation 6 that fails asks for 7"
    seen = GangView(GangRecord(generation=6, epoch="e1"), acted=5, acted_epoch="e1")
    assert failed_in(seen, 5) is None, "asked by a peer, not yet acted on here"
    assert failed_in(GangView(GangRecord(generation=1, epoch="e2"), acted=1, acted_epoch="e2"), 9) == 1, (
        "a generation noted before etcd was wiped counts as the one acted on")
    assert failed_in(GangView(GangRecord(generation=3, epoch="e2"), acted=5, acted_epoch="e1"), 5) == 5, (
        "a record of another store is no answer: the bump's CAS decides")
    assert failed_in(GangView(None, acted=0, acted_epoch=""), None) == 0


def test_a_crash_looping_group_backs_off_as_one() -> None:
    record = GangRecord(generation=1, epoch="e1")
    delays = []
    for n in range(4):
        out = bump(record, record.generation, node=f"a2-{n}", reason="hang", now=NOW + n, epoch="e1", spec=SPEC)
        assert out is not None
        record, decision = out
        delays.append(decision.delay_s)
        assert record.not_before == NOW + n + decision.delay_s
    assert delays == [0, 10, 20, 40]  # whoever saw the failure, the counters are the group's
    assert bump(record, record.generation, node="x", reason="op", now=NOW, epoch="e1", spec=SPEC,
                planned=True)[1].delay_s == 0  # type: ignore[index]


def test_a_stable_group_settles_once() -> None:
    record = GangRecord(generation=3, epoch="e1")
    for _ in range(2):
        record = bump(record, record.generation, node="a", reason="x", now=NOW, epoch="e1", spec=SPEC)[0]  # type: ignore[index]
    assert settle(record, NOW + 100, SPEC, healthy_since=NOW) is None  # not stable yet
    settled = settle(record, NOW + 700, SPEC, healthy_since=NOW)
    assert settled is not None and settled.policy["consecutive_failures"] == 0
    assert settle(settled, NOW + 800, SPEC, healthy_since=NOW) is None  # nothing left to write


def test_act_once_per_generation_and_never_on_a_new_store() -> None:
    rec = GangRecord(generation=7, epoch="e1")
    assert must_restart_for(GangView(rec, acted=6, acted_epoch="e1"), "e1") == 7
    assert must_restart_for(GangView(rec, acted=7, acted_epoch="e1"), "e1") is None
    # etcd wiped: generations start again; not a restart
    fresh = GangRecord(generation=1, epoch="e2")
    assert must_restart_for(GangView(fresh, acted=7, acted_epoch="e1"), "e2") is None
    assert must_restart_for(GangView(None, acted=7, acted_epoch="e1"), "e2") is None
    # a bump in a stale epoch is ignored; a bump in a new one starts from its own generation
    out = bump(GangRecord(generation=9, epoch="e1"), 1, node="a", reason="x", now=NOW, epoch="e2", spec=SPEC)
    assert out is not None and out[0].generation == 2 and out[0].epoch == "e2"


def test_an_agent_back_across_an_etcd_wipe_owes_the_restarts_asked_in_the_new_epoch() -> None:
    """Seed 686167: etcd wiped while n2's agent was away; the new epoch began at generation 1 (every rank running
    then belongs to it) and an operator's restart made 2. n2's agent, back, had acted in the old epoch: its rank
    is of generation 1 and must restart for 2 — it adopted 2 and its peer waited at the barrier for ever."""
    first = GangRecord(generation=1, epoch="e2", base=1)
    made = bump(first, 1, node="n1", reason="operator restart", now=NOW, epoch="e2", spec=SPEC, planned=True)
    assert made is not None and made[0].generation == 2 and made[0].base == 1, "the epoch's base is kept"
    assert epoch_baseline(made[0], wiped=True) == 1
    assert must_restart_for(GangView(made[0], acted=1, acted_epoch="e2"), "e2") == 2
    assert epoch_baseline(made[0], wiped=False) == 2, "a first contact (no epoch acted in) adopts what runs"
    fresh = bump(None, 4, node="n1", reason="vllm exited", now=NOW, epoch="e3", spec=SPEC)
    assert fresh is not None and (fresh[0].generation, fresh[0].base) == (5, 4), \
        "a new epoch's record made by a failure: the ranks that ran before it are of the one it leaves"
    old = GangRecord.from_dict({"generation": 3, "epoch": "e2"})
    assert old.base == 0 and epoch_baseline(old, wiped=True) == 3, "a record from before `base`: as before"
    assert GangRecord.from_dict(made[0].to_dict()) == made[0]


def test_barrier_releases_only_when_all_arrived_and_names_the_late() -> None:
    expected = ("a2-4", "a2-5", "a2-6", "a2-7")
    waiting = barrier_state(expected, {"a2-4", "a2-6", "a2-1"}, waited_s=30, timeout_s=300)
    assert not waiting.released and waiting.missing == ("a2-5", "a2-7") and not waiting.overdue
    late = barrier_state(expected, {"a2-4"}, waited_s=301, timeout_s=300)
    assert late.overdue and "a2-5, a2-6, a2-7" in late.describe("decode0", 3, 301)
    assert barrier_state(expected, set(expected), 0, 300).released


def test_pause_and_redeploy_duties() -> None:
    assert effective_pause(None, None) is None
    p = effective_pause({"by": "alice", "at": 1}, {"by": "bob", "at": 2})
    assert p is not None and p.by == "bob" and p.scope == "cluster"
    rec = RedeployRecord("r1", "key not found", "a2-0", NOW)
    assert redeploy_duty(rec, set()) == "stop"
    assert redeploy_duty(RedeployRecord("r1", "", "", NOW, phase="done"), set()) == "start"
    assert redeploy_duty(rec, {"r1"}) is None
    assert may_wipe({"a", "b"}, {"a", "b"}, 1, 60) and not may_wipe({"a"}, {"a", "b"}, 1, 60)
    assert may_wipe({"a"}, {"a", "b"}, 61, 60)
    assert RedeployRecord.from_dict(rec.to_dict()) == rec


def test_command_errors_name_what_is_wrong() -> None:
    assert command_error({"action": "restart", "component": "vllm"}, ["vllm"]) is None
    kill = command_error({"action": "kill", "component": "vllm"}, ["vllm"])
    assert kill is not None and "unknown action 'kill'" in kill.message and kill.outcome.exit_code == 2
    x = command_error({"action": "stop", "component": "x"}, ["vllm"])
    assert x is not None and "unknown component 'x'" in x.message
    assert x.to_dict() == {"ok": False, "code": 4, "message": x.message}, "the wire format, the CLI's exit code"
    assert CommandResult(CommandOutcome.DONE, "n1: stop vllm").to_dict() == {
        "ok": True, "code": 0, "message": "n1: stop vllm"}


def test_a_one_node_groups_rank_started_while_etcd_was_away_is_noted_in_the_generation_acted() -> None:
    """Seed 638887: p0 (one node) acted on generation 2, etcd went away while its old tree stopped, and the new rank
    started without a barrier (a one-node group restarts locally). Not noted as running in 2, the agent's successor
    took it for unrestarted and restarted it — under a cluster pause. A rank still being stopped is not noted; a
    multi-node group's only through its barrier."""
    from types import SimpleNamespace

    from nodeagent.cluster.gang import GangState

    def gang(nodes: tuple[str, ...]) -> GangState:
        gs = GangState(SimpleNamespace(nodes=nodes), ("vllm",))  # type: ignore[arg-type]
        gs.acted, gs.released, gs.ran = 2, 1, {"vllm": 1}
        return gs

    one, two = gang(("n0",)), gang(("n0", "n1"))
    assert one.runs_acted("vllm", running=True, going_down=False, reachable=False)
    assert not one.runs_acted("vllm", running=True, going_down=True, reachable=False), "the old tree, stopping"
    assert not one.runs_acted("vllm", running=True, going_down=False, reachable=True), "with etcd: its barrier says"
    assert not two.runs_acted("vllm", running=True, going_down=False, reachable=False)
    two.released = 2
    assert two.runs_acted("vllm", running=True, going_down=False, reachable=True)
    two.ran["vllm"] = 2
    assert not two.runs_acted("vllm", running=True, going_down=False, reachable=True), "noted already"

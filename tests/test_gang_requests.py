"""One writer per group's coordination state (issue 29 items 1 and 3), without processes: generation requests
queue for the coordinator's work loop, which decides them on one snapshot; a gate reports, it never asks; a rank
is not launched for a generation that a newer one known or asked already replaces (`tests/cluster_fakes.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from cluster_fakes import World

from nodeagent.core.failure import Failure
from nodeagent.seam.stackport import ComponentView, Hold, HoldKind

NODES = ["n0", "n1", "n2", "n3", "n4"]
GROUPS = [
    {"name": "p0", "kind": "prefill", "nodes": ["n0", "n1"], "data_parallel_rpc_port": 43000},
    {"name": "p1", "kind": "prefill", "nodes": ["n2", "n3"], "data_parallel_rpc_port": 43001},
    {"name": "d0", "kind": "decode", "nodes": ["n4"]},
]

pytestmark = pytest.mark.usefixtures("no_processes")


async def cold(worlds: Callable[..., World]) -> World:
    world = worlds(NODES, [dict(g) for g in GROUPS], True)
    world.start()
    await world.until("every component of every node up", world.all_up, within=120)
    return world


def vllm_starts(world: World) -> dict[str, int]:
    return {n: s.started("vllm") for n, s in world.stacks.items()}


class CasHook:
    """The store as one coordinator sees it: `during` runs once, while a gang record's compare-and-swap is on its
    way (after the work loop took the requests it decides on, before the answer)."""

    def __init__(self, store: Any, during: Callable[[], None]) -> None:
        self.store, self.during = store, during

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def compare_and_swap(self, key: str, mod_revision: int, value: Any, *args: Any, **kwargs: Any) -> Any:
        during = self.during
        if "/gangs/" in key and during is not None:
            self.during = None
            during()
            await asyncio.sleep(0)
        return await self.store.compare_and_swap(key, mod_revision, value, *args, **kwargs)


async def test_a_request_arriving_while_a_generation_is_written_is_answered_by_it_not_dropped(
        worlds: Callable[..., World]) -> None:  # fmt: skip
    """A crash's generation is being written (the CAS awaits) when an operator's restart of the group arrives. It
    was cleared with the crash's request once the CAS returned: lost without a word. Now it stays queued and the
    next decision reads it against the record just written: that generation restarts every rank after the
    request was made, so it answers it (said, with its reason) — no second generation, each rank launched once."""
    world = await cold(worlds)
    co = world.agents["n3"].coordinator
    answers: list[str] = []
    co.store = CasHook(co.store, lambda: answers.append(co.request_generation("p1", "operator restart (ops)")))
    world.stacks["n3"].crash("vllm")
    await world.until("p1's ranks both started again", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2)  # noqa: E501
    await world.advance(60)
    assert answers == ["restarting group p1 as generation 2: every rank on n2, n3 restarts once"]
    assert vllm_starts(world) == {"n0": 1, "n1": 1, "n2": 2, "n3": 2, "n4": 1}, "one launch per rank"
    assert {world.gang(n, "p1").record.generation for n in ("n2", "n3")} == {2}
    (joined,) = world.stacks["n3"].events_of("gang_joined")
    assert "operator restart (ops): answered by generation 2 (n3/vllm: killed by SIGKILL)" in joined["message"]
    assert not world.gang("n3", "p1").requests, "decided, nothing left queued"


class HoldLayer:
    """A layer whose gate holds vLLM with an earlier kind than the group's (preflight, isolation, a container)."""

    def __init__(self, kind: HoldKind) -> None:
        self.kind: HoldKind | None = kind

    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        if self.kind is None or comp.kind != "vllm":
            return None
        return Hold(self.kind, f"{self.kind} holds vLLM")

    def decide(self, comp: ComponentView, failure: Failure) -> str | None:
        return None

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> str | None:
        return None

    def status_section(self) -> dict[str, Any]:
        return {}

    def on_node_change(self) -> None:
        return None


async def test_the_group_gate_under_an_earlier_hold_asks_for_nothing(worlds: Callable[..., World]) -> None:
    """A rank that died while paused must restart its whole group — but only once it could start. While an earlier
    hold (here preflight) holds it at resume, its group's gate only says so: it used to ask the next generation
    from inside the gate, and the peer stopped for a rank that could not start."""
    world = await cold(worlds)
    n0 = world.stacks["n0"]
    preflight = HoldLayer(HoldKind.PREFLIGHT)
    n0.layers.append(preflight)
    await world.agents["n0"].coordinator.set_pause(True, "operator", "switch maintenance")
    await world.until("every node paused", lambda: all(s.paused for s in world.stacks.values()), 5)
    n0.crash("vllm")  # its peer n1 runs on
    await world.advance(30)
    await world.agents["n0"].coordinator.set_pause(False, "operator")
    await world.until("n0's rank held by preflight", lambda: (h := n0.components["vllm"].hold) is not None
                      and h.kind == HoldKind.PREFLIGHT, 30)  # fmt: skip
    await world.advance(120)
    assert world.gang("n1", "p0").record.generation == 1 and not world.gang("n0", "p0").requests, "nothing asked"
    assert world.stacks["n1"].restarts == [] and world.stacks["n1"].components["vllm"].running, "the peer serves on"
    preflight.kind = None  # preflight passes
    n0.notify()
    await world.until("p0 restarted as one", lambda: vllm_starts(world)["n0"] == vllm_starts(world)["n1"] == 2, 60)
    assert world.gang("n1", "p0").acted == 2 and [r[0] for r in world.stacks["n1"].restarts] == ["vllm"]


def test_requests_decided_together_make_one_generation_and_a_later_one_is_answered_by_it() -> None:
    """Pure: what the work loop decides over its snapshot of the queue."""
    from nodeagent.cluster.rules import GangRecord, GenRequest, merge_requests

    record = GangRecord(generation=5, epoch="e1", reason="first generation")
    crash = GenRequest(5, "n3/vllm: killed by SIGKILL")
    operator = GenRequest(5, "operator restart (ops)", planned=True)
    merged, done = merge_requests(record, "e1", [crash, operator, crash])
    assert merged == GenRequest(5, "n3/vllm: killed by SIGKILL | operator restart (ops)", planned=False), \
        "one generation; a failure's is not drained and counts in the policy"
    assert done == []
    assert merge_requests(record, "e1", [operator]) == (operator, []), "planned when every request is"
    written = GangRecord(generation=6, epoch="e1", reason=crash.reason)
    assert merge_requests(written, "e1", [operator]) == (None, [operator]), "asked after 5: answered by 6"
    stale = GenRequest(4, "FT escalation of generation 4")
    assert merge_requests(record, "e1", [stale, crash]) == (crash, [stale])
    assert merge_requests(GangRecord(generation=9, epoch="e0"), "e1", [stale])[0] == stale, "another epoch's record"


def test_a_rank_that_ran_already_asks_only_once_its_groups_hold_wins() -> None:
    from nodeagent.cluster.rules import rank_to_rejoin
    from nodeagent.config.model import RestartSpec

    def view(hold: Hold | None, running: bool = False, desired: str = "running") -> ComponentView:
        return ComponentView(name="vllm", kind="vllm", state="stopped", running=running, up=False, ready=False,
                             desired=desired, deps=(), deps_up=True, restart=RestartSpec(), hold=hold)  # fmt: skip

    ours = Hold(HoldKind.COORDINATION, "group p0: vllm ran in generation 3 already", data={"rejoin": 3})
    assert rank_to_rejoin(True, 3, 3, {"vllm": 3}, {"vllm": view(ours)}, ("vllm",)) == "vllm"
    for other in (Hold(HoldKind.PREFLIGHT, "preflight FAIL"), Hold(HoldKind.ISOLATED, "isolated"),
                  Hold(HoldKind.CONTAINER, "container being made"), None):  # fmt: skip
        assert rank_to_rejoin(True, 3, 3, {"vllm": 3}, {"vllm": view(other)}, ("vllm",)) is None, other
    assert rank_to_rejoin(False, 3, 3, {"vllm": 3}, {"vllm": view(ours)}, ("vllm",)) is None, "one node: no group"
    assert rank_to_rejoin(True, 3, 3, {"vllm": 2}, {"vllm": view(ours)}, ("vllm",)) is None, "not run in 3 yet"
    assert rank_to_rejoin(True, 3, 2, {"vllm": 3}, {"vllm": view(ours)}, ("vllm",)) is None, "not released"
    assert rank_to_rejoin(True, 3, 3, {"vllm": 3}, {"vllm": view(ours, running=True)}, ("vllm",)) is None
    assert rank_to_rejoin(True, 3, 3, {"vllm": 3}, {"vllm": view(ours, desired="stopped")}, ("vllm",)) is None


async def test_a_rank_is_not_launched_in_a_generation_a_newer_known_one_replaces(
        worlds: Callable[..., World]) -> None:  # fmt: skip
    """The watch delivered generation 2 before the work loop acted on it: a rank that would start now in 1 waits
    (it passed the gate, released in 1, and the next step stopped it at once)."""
    world = await cold(worlds)
    co = world.agents["n2"].coordinator
    gs = co.gangs["p1"]
    assert gs.record is not None and gs.acted == gs.released == 1
    gs.record = replace(gs.record, generation=2, reason="n3/vllm: killed by SIGKILL")
    gs.ran.pop("vllm")  # a rank that did not run in 1 (it was stopped before its release): nothing else holds it
    view = world.stacks["n2"].component("vllm")
    hold = co.gate(replace(view, running=False), False)
    assert hold is not None and hold.kind == HoldKind.COORDINATION
    assert "generation 2 is known, not yet acted on here: the rank starts in it, not in 1" in hold.reason


async def test_a_canary_crash_then_its_rollback_launch_each_rank_once_on_the_rollbacks_file(tmp_path: Any) -> None:
    """A rollout step whose new command exits at once: the crash asks generation N, the rollback's generation N+1
    follows. Generation N used to launch a rank (on the previous file, staged by then) that N+1 killed right
    away (CI: 11 ms later, in 4 of 8 runs; here, every run on n2). Now nothing starts for a generation the
    rollout's next known decision replaces: each rank of the group is launched once after the crash, on the
    rollback's file."""
    from test_rollout_layer import disk_hash, launched, record, set_group_env, start, status, up_world

    from nodeagent.config.cluster import cluster_file_hash

    world = await up_world(tmp_path)
    try:
        old = cluster_file_hash(world.stacks["n0"].config)
        world.install(set_group_env(["p0"], {"X": "1"}))
        world.install(set_group_env(["p1"], {"FAKE_START": "crash"}))
        new = disk_hash(world)
        await start(world)
        await world.until("halted", lambda: status(world, "n2") == "halted", 300)
        await world.until("p1 up", lambda: world.all_up(["n2", "n3"]), 60)
        await world.advance(30)
        assert record(world).steps[1].phase == "rolled_back"
        for node in ("n2", "n3"):
            assert launched(world, node) == [old, new, old], f"{node}: to the new file, then once back"
        generations = [world.gang(n, "p1").acted for n in ("n2", "n3")]
        assert generations[0] == generations[1] == world.gang("n2", "p1").record.generation
        assert generations[0] >= 4, "the crash's generation and the rollback's: two generations, one launch"
    finally:
        await world.close()


async def test_a_rank_waits_for_the_rollbacks_generation_while_the_way_back_is_staged(tmp_path: Any) -> None:
    """The rollout decided the way back (its record says so) but the rollback's generation is not written yet — a
    member takes its time to stage the previous file. The crash's generation must launch nothing meanwhile: not
    the previous file on the member that staged it, not the crashing file again on the one that did not."""
    from test_rollout_layer import disk_hash, launched, set_group_env, start, status, up_world

    from nodeagent.config.cluster import cluster_file_hash

    world = await up_world(tmp_path)
    try:
        executor = world.agents["n3"].rollout
        stage = executor._stage

        async def slow_way_back(index: int, step: Any) -> None:
            if step.failed:
                await world.clock.sleep(20.0)
            await stage(index, step)

        executor._stage = slow_way_back
        old = cluster_file_hash(world.stacks["n0"].config)
        world.install(set_group_env(["p0"], {"X": "1"}))
        world.install(set_group_env(["p1"], {"FAKE_START": "crash"}))
        new = disk_hash(world)
        await start(world)
        await world.until("halted", lambda: status(world, "n2") == "halted", 300)
        await world.until("p1 up", lambda: world.all_up(["n2", "n3"]), 60)
        for node in ("n2", "n3"):
            assert launched(world, node) == [old, new, old], f"{node}: to the new file, then once back"
    finally:
        await world.close()


def test_the_rollouts_next_known_decision_holds_a_start_it_would_replace() -> None:
    """Pure: `rollout_rules.next_restart` through a step's phases, the way back's too."""
    from test_rollout_rules import marked, move, observed, record, to_gating

    from nodeagent.cluster.rollout import rules as rr

    def why(rec: Any, acted: int, gens: dict[str, int] | None = None, group: str = "p0") -> str | None:
        return rr.next_restart(rec, group, acted, lambda: observed(0, gens or {}))

    rec = record(("p0",), ("p1",))
    assert why(rec, 1) is None, "pending: nothing decided"
    rec, _ = move(rec, observed(1, {}))
    assert "step 1 restarts p0 once every member is drained and took the file" in (why(rec, 1) or "")
    assert why(rec, 1, group="p1") is None, "a group of another step"
    assert why(replace(rec, status="aborting"), 1) is None, "cancelled before its restart: nothing follows"
    rec = marked(marked(rec, "drained", "n0", "n1"), "proxy_out", "n0")
    rec, _ = move(rec, observed(2, {}))
    assert rec.steps[0].phase == "staging" and "once every member took the file" in (why(rec, 1) or "")
    rec, _ = move(marked(rec, "staged", "n0", "n1"), observed(3, {"p0": 1}))
    assert rec.steps[0].phase == "restarting" and "generation past 1 is asked" in (why(rec, 1) or "")
    assert why(rec, 2) is None, "the step's generation acted on: it starts in it"
    gating = to_gating(record(("p0",), ("p1",)))
    assert why(gating, 2, {"p0": 2}) is None, "healthy so far"
    assert "goes back to the previous file next" in (why(gating, 3, {"p0": 3}) or ""), "crashed: generation 3"
    back, _ = move(gating, observed(5, {"p0": 3}))
    assert back.steps[0].phase == "staging" and back.steps[0].failed and why(back, 3) is not None
    back, _ = move(marked(back, "staged", "n0", "n1"), observed(6, {"p0": 3}))
    assert why(back, 3) is not None and why(back, 4) is None, "the rollback's generation 4 starts"
    back, _ = move(back, observed(7, {"p0": 4}))
    assert back.steps[0].phase == "gating" and why(back, 5, {"p0": 5}) is None, "a way back that fails: left as is"
    assert why(replace(gating, status="halted"), 3, {"p0": 3}) is None, "an ended rollout holds nothing"


class CasThenNewer:
    """The store as one coordinator sees it: its gang record's compare-and-swap succeeds, and before the answer
    reaches the work loop another member writes the next generation, which the watch delivers at once."""

    def __init__(self, store: Any, world: World, newer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.store, self.world, self.newer = store, world, newer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def compare_and_swap(self, key: str, mod_revision: int, value: Any, *args: Any, **kwargs: Any) -> Any:
        import json

        result = await self.store.compare_and_swap(key, mod_revision, value, *args, **kwargs)
        if "/gangs/" in key and result.succeeded and self.newer is not None:
            newer, self.newer = self.newer, None  # type: ignore[assignment]
            self.store.write_from_elsewhere(key, json.dumps(newer(json.loads(value))))
            for _ in range(50):
                await asyncio.sleep(0)  # the watches deliver it (to this agent too) before the answer is read
        return result


async def test_a_newer_generation_the_watch_brings_during_the_write_is_not_overwritten_by_ours(
        worlds: Callable[..., World]) -> None:  # fmt: skip
    """n3 writes generation 2; before its CAS answer is read, n2 writes 3 and the watch delivers it. Setting the
    record to our 2 after the await clobbered the 3: n3 acted on 2 and never saw 3 again (the watch had delivered
    it already), while n2 waited at generation 3's barrier for it. The newest revision wins."""
    world = await cold(worlds)
    co = world.agents["n3"].coordinator

    def operator_restart(ours: dict[str, Any]) -> dict[str, Any]:
        return {**ours, "generation": ours["generation"] + 1, "reason": "operator restart", "by": "n2",
                "planned": True}  # fmt: skip

    co.store = CasThenNewer(co.store, world, operator_restart)
    world.stacks["n3"].crash("vllm")
    await world.until("p1's ranks both started again", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2, 60)  # noqa: E501
    for node in ("n2", "n3"):
        gs = world.gang(node, "p1")
        assert gs.record.generation == gs.acted == gs.released == 3, node


class LostCasThenNewer:
    """The store as one coordinator sees it: its gang record's compare-and-swap loses to a write made just before
    it (generation 2), and before the answer reaches the work loop a third write (generation 3) arrives through
    the watch."""

    def __init__(self, store: Any) -> None:
        self.store, self.armed = store, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def compare_and_swap(self, key: str, mod_revision: int, value: Any, *args: Any, **kwargs: Any) -> Any:
        import json

        if "/gangs/" not in key or not self.armed:
            return await self.store.compare_and_swap(key, mod_revision, value, *args, **kwargs)
        self.armed = False
        ours = json.loads(value)
        self.store.write_from_elsewhere(key, json.dumps({**ours, "by": "n2", "reason": "n2/vllm: killed"}))
        result = await self.store.compare_and_swap(key, mod_revision, value, *args, **kwargs)
        assert not result.succeeded
        third = {**ours, "generation": ours["generation"] + 1, "by": "n2", "reason": "operator restart"}
        self.store.write_from_elsewhere(key, json.dumps(third))
        for _ in range(50):
            await asyncio.sleep(0)  # the watches deliver it before the lost answer is read
        return result


async def test_a_lost_write_does_not_bring_back_a_record_older_than_the_watch_gave(
        worlds: Callable[..., World]) -> None:  # fmt: skip
    """n3's CAS loses to n2's generation 2; generation 3 arrives through the watch before n3 reads the answer.
    Taking the answer's record (2) over it, n3 acted on 2 and never on 3 while n2 waited at 3's barrier."""
    world = await cold(worlds)
    co = world.agents["n3"].coordinator
    co.store = LostCasThenNewer(co.store)
    world.stacks["n3"].crash("vllm")
    await world.until("p1's ranks both started again", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2, 60)  # noqa: E501
    for node in ("n2", "n3"):
        gs = world.gang(node, "p1")
        assert gs.record.generation == gs.acted == gs.released == 3, node


def test_a_rank_launched_before_the_generation_its_agent_acted_on_is_restarted_by_the_successor() -> None:
    """Seed 760353: the agent saved `acted` 2 and died before its drain stopped the rank of generation 1."""
    from nodeagent.cluster.rules import unrestarted

    assert unrestarted({"vllm": 1}, 2, ["vllm"]) == ["vllm"]
    assert unrestarted({"vllm": 2}, 2, ["vllm"]) == [], "restarted: adopted as it runs"
    assert unrestarted({}, 2, ["vllm"]) == [], "unknown (an older agent's file): adopted, as before"
    assert unrestarted({"vllm": 1}, 2, []) == [], "not running: the barrier starts it"

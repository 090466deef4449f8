"""One writer per group's coordination state (issue 29 items 1 and 3), without processes: generation requests
queue for the coordinator's work loop, which decides them on one snapshot; a gate reports, it never asks; a rank
is not launched for a generation that a newer one known or asked already replaces (`tests/cluster_fakes.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from cluster_fakes import World

from nodeagent.failure import Failure
from nodeagent.stackport import ComponentView, Hold, HoldKind

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
    from nodeagent.config_model import RestartSpec

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

"""The cluster layer without processes: several agents (Membership, Coordinator, ClusterOps, ProxySync) on one
FakeStore, fake stacks behind the StackPort, one virtual clock (`tests/cluster_fakes.py`). Every gang scenario
of the system tests (test_gang_system.py, test_cluster_system.py) in milliseconds: a lost rank, two at once,
barriers, pause, remote restart, an agent killed mid-restart, an etcd outage and a wipe, the cluster redeploy,
the proxy following the gangs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from cluster_fakes import World

NODES = ["n0", "n1", "n2", "n3", "n4"]
GROUPS = [
    {"name": "p0", "kind": "prefill", "nodes": ["n0", "n1"], "data_parallel_rpc_port": 43000},
    {"name": "p1", "kind": "prefill", "nodes": ["n2", "n3"], "data_parallel_rpc_port": 43001},
    {"name": "d0", "kind": "decode", "nodes": ["n4"]},
]


pytestmark = pytest.mark.usefixtures("no_processes")


@pytest.fixture
def make_world(worlds: Callable[..., World]) -> Callable[..., World]:
    def make(names: list[str] = NODES, groups: list[dict[str, Any]] | None = GROUPS, proxy: bool = True) -> World:
        return worlds(names, groups, proxy)

    return make


async def cold(make_world: Callable[..., World], **kw: Any) -> World:
    world = make_world(**kw)
    world.start()
    await world.until("every component of every node up", world.all_up, within=120)
    return world


def vllm_starts(world: World) -> dict[str, int]:
    return {n: s.started("vllm") for n, s in world.stacks.items()}


async def test_cold_start_goes_through_the_barriers(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    for node in ("n2", "n3"):
        gs = world.gang(node, "p1")
        assert gs.record is not None and gs.record.generation == gs.acted == 1 and gs.released == 1
        assert gs.arrivals == {"n2", "n3"}
    assert vllm_starts(world) == dict.fromkeys(NODES, 1)
    released = world.stacks["n2"].events_of("barrier_released")
    assert len(released) == 1 and "every node arrived (n2, n3)" in released[0]["message"]


def p1_endpoints(world: World) -> set[str]:
    from nodeagent.config.layout import cluster_layout

    layout = cluster_layout(world.agents["n0"].coordinator.config)
    return set(layout.group("p1").endpoints)


async def test_a_lost_rank_restarts_its_group_once_after_every_old_rank_stopped(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    world = await cold(make_world)
    proxy = world.proxy
    assert proxy is not None
    await world.until("the proxy ready", lambda: world.stacks["n0"].components["proxy"].ready)
    mark = len(proxy.calls)
    world.stacks["n2"].components["vllm"].stop_s = 30.0  # the head's old tree takes 30 s to die

    verdict = world.stacks["n3"].crash("vllm")  # a headless rank
    assert verdict == "group p1 restarts as one: generation 2 on n2, n3"
    await world.until("p1 out of the proxy", lambda: not p1_endpoints(world) & proxy.routed["prefill"], 10)
    assert world.stacks["n0"].components["proxy"].ready, "p0 still serves prefill"
    await world.until("p1's ranks both started again", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2)  # noqa: E501
    n2, n3 = world.stacks["n2"].components["vllm"], world.stacks["n3"].components["vllm"]
    assert min(n2.starts[1], n3.starts[1]) >= n2.gone[-1], "no rank starts before every old rank has stopped"
    await world.until("p1 back in the proxy", lambda: p1_endpoints(world) <= proxy.routed["prefill"], 60)
    assert vllm_starts(world) == {"n0": 1, "n1": 1, "n2": 2, "n3": 2, "n4": 1}, "other groups untouched"
    for node in ("n2", "n3"):
        gs = world.gang(node, "p1")
        assert gs.record.generation == gs.acted == 2, "one generation"
        acted = [e for e in world.stacks[node].events_of("gang_restart") if e["data"]["generation"] == 2]
        assert len(acted) == 1, "acted on exactly once"
    assert world.stacks["n2"].restarts == [("vllm", "gang p1 generation 2: n3/vllm: killed by SIGKILL", False)]
    assert world.stacks["n3"].restarts == [], "the crashed rank is not running: it only starts again"
    p1 = tuple(sorted(p1_endpoints(world)))
    calls = proxy.calls[mark:]  # removed by each node as its rank stopped (proxy_evict) and by the sync; one add
    assert set(calls[:-1]) == {("remove", "prefill", p1)} and calls[-1] == ("add", "prefill", p1), calls


async def test_a_group_the_busy_proxy_keeps_isolated_is_reported_once_and_returns_when_it_is_idle(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    """vllm-ascend's proxy only taints an instance removed under load and ignores an add of it until it is idle
    at a check: under steady traffic the restarted group is healthy but unused. One warning after 180 s (not
    one per sync step), and it is back at the proxy's first idle check."""
    world = await cold(make_world)
    proxy = world.proxy
    assert proxy is not None
    p1 = p1_endpoints(world)
    await world.until("p1 routed", lambda: p1 <= proxy.serving("prefill") and proxy.calls[-1][0] == "add", 30)
    proxy.busy = True
    world.stacks["n3"].crash("vllm")
    await world.until("p1 tainted", lambda: p1 <= proxy.tainted["prefill"], 10)
    assert not p1 & proxy.serving("prefill"), "not routed while p0 serves"
    await world.until("p1 healthy again", lambda: world.agents["n0"].coordinator.proxies[0].health.get("p1", "")
                      .startswith("healthy; the proxy keeps it isolated"), 120)  # fmt: skip
    await world.advance(170)
    assert world.stacks["n0"].events_of("proxy_isolated") == [], "not before 180 s"
    await world.advance(200)
    warned = world.stacks["n0"].events_of("proxy_isolated")
    assert len(warned) == 1 and warned[0]["level"] == "warning", warned
    assert "group p1 healthy but still not routed after 180s" in warned[0]["message"]
    assert "restart of the proxy at a quiet moment" in warned[0]["message"]
    proxy.busy = False
    proxy.idle()
    await world.until("p1 back in the proxy", lambda: p1 <= proxy.serving("prefill"), 30)
    await world.until("and reported back", lambda: world.agents["n0"].coordinator.proxies[0].health["p1"] == "", 10)
    assert len(world.stacks["n0"].events_of("proxy_isolated")) == 1


async def test_the_peers_stop_while_the_crashed_ranks_own_tree_is_still_being_stopped(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    """The crashed rank's node asks the next generation as soon as the failure is known, not once its own stop of
    what is left of the tree ended (an orphaned A2 EngineCore frees its NPUs in up to ~50 s): the peer's stop
    begins at once. The barrier still waits for the crashed tree, the group gets one generation, and the crashed
    rank — already stopping — is not restarted a second time by it. The peer's own rank dying as that restart
    reaches it (its exit read first) is the same fault: still one generation."""
    world = await cold(make_world)
    n2, n3 = world.stacks["n2"].components["vllm"], world.stacks["n3"].components["vllm"]
    n3.stop_s = 30.0  # what is left of the crashed rank's tree takes 30 s to stop
    crashed_at = world.clock.monotonic()
    assert world.stacks["n3"].crash("vllm") == "group p1 restarts as one: generation 2 on n2, n3"
    await world.until("the peer's rank stopping", lambda: n2.stops, 5)
    peer_stop = n2.stops[-1] - crashed_at
    assert peer_stop < 1.0 and n3.running, "the peer stops while the crashed tree is still being stopped"
    verdict = world.stacks["n2"].crash("vllm")  # n2's rank dies too, as its restart reaches it
    assert verdict is not None and "generation 2 (already asked)" in verdict
    await world.until("p1's ranks both started again", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2)  # noqa: E501
    own_stop, peer_gone = n3.gone[-1] - crashed_at, n2.gone[-1] - crashed_at
    print(f"crash at 0 s: the peer's stop began at {peer_stop:.1f} s and its old rank was gone at {peer_gone:.1f} s; "
          f"the crashed node's own stop ended at {own_stop:.1f} s (asked only then, the peer would have begun "
          f"{own_stop - peer_stop:.1f} s later)")  # fmt: skip
    assert own_stop == pytest.approx(30.0) and peer_gone < 1.0
    assert min(n2.starts[1], n3.starts[1]) >= n3.gone[-1], "no rank starts before the crashed tree is gone"
    await world.until("p1 up", lambda: world.all_up(["n2", "n3"]), 60)
    await world.advance(60)
    assert vllm_starts(world) == {"n0": 1, "n1": 1, "n2": 2, "n3": 2, "n4": 1}
    generations = [e for n in ("n2", "n3") for e in world.stacks[n].events_of("gang_generation")]
    assert len(generations) == 1 and {world.gang(n, "p1").acted for n in ("n2", "n3")} == {2}, "one generation"
    assert world.stacks["n3"].restarts == [], "the crashed rank's stop was under way: it is not restarted again"
    (acted,) = world.stacks["n3"].events_of("gang_restart")
    assert "restarting nothing running here (vllm already stopping)" in acted["message"]


async def test_two_ranks_lost_at_once_make_one_generation(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    world.stacks["n2"].crash("vllm")
    world.stacks["n3"].crash("vllm")
    await world.until("both back", lambda: world.all_up(["n2", "n3"]) and vllm_starts(world)["n2"] == 2)
    await world.advance(30)
    assert vllm_starts(world) == {"n0": 1, "n1": 1, "n2": 2, "n3": 2, "n4": 1}
    assert {world.gang(n, "p1").record.generation for n in ("n2", "n3")} == {2}
    generations = [e for n in ("n2", "n3") for e in world.stacks[n].events_of("gang_generation")]
    assert len(generations) == 1, "exactly one of them wrote the next generation (the other followed)"


async def test_a_rank_whose_failure_is_decided_after_the_peers_generation_makes_no_second_one(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    """Both API servers killed at once (real ranks): a failure decided late — after the rest of the rank's tree
    is stopped, seconds for an orphaned EngineCore, as the supervisor once did — finds the peer's generation acted
    on here. That generation already restarts this rank: the failure must not ask for another one (it did:
    two generations, the group's backoff doubled, and the extra failure counted towards a cluster redeploy)."""
    world = await cold(make_world)
    late = asyncio.ensure_future(world.stacks["n2"].crash_later("vllm", stop_s=5.0))
    world.stacks["n3"].crash("vllm")
    await world.until("n2 acted on n3's generation while its own tree still stops",
                      lambda: world.gang("n2", "p1").acted == 2 and not late.done(), 3)  # fmt: skip
    verdict = await world.run(late)
    assert verdict is not None and "generation 2" in verdict, verdict
    await world.until("both back", lambda: world.all_up(["n2", "n3"]) and vllm_starts(world)["n2"] == 2)
    await world.advance(60)
    assert vllm_starts(world) == {"n0": 1, "n1": 1, "n2": 2, "n3": 2, "n4": 1}
    for node in ("n2", "n3"):
        gs = world.gang(node, "p1")
        assert gs.record.generation == gs.acted == 2, f"{node}: one generation, not {gs.record.generation}"
    generations = [e for n in ("n2", "n3") for e in world.stacks[n].events_of("gang_generation")]
    assert len(generations) == 1, [e["message"] for e in generations]


async def test_a_rank_waits_at_the_barrier_for_a_dead_agent_which_acts_once_when_back(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    world = await cold(make_world)
    await world.kill_agent("n3")  # the agent alone: its vLLM runs on
    world.stacks["n2"].crash("vllm")
    await world.until("n2 waits at the barrier for n3", lambda: "at the start barrier for n3" in (
        world.stacks["n2"].components["vllm"].hold or "").__str__(), 30)  # fmt: skip
    await world.advance(120)
    assert vllm_starts(world)["n2"] == 1, "no rank starts before every node of its group arrived"
    assert world.stacks["n3"].components["vllm"].running, "the dead agent's rank runs on"

    world.start_agent("n3")  # over the same state folder
    await world.until("p1 started again on both", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2)
    await world.until("up", lambda: world.all_up(["n2", "n3"]))
    assert world.gang("n3", "p1").acted == 2
    assert [r[0] for r in world.stacks["n3"].restarts] == ["vllm"], "n3's new agent acted on generation 2 once"

    await world.kill_agent("n3")  # killed again right after acting: its successor must not act twice
    world.start_agent("n3")
    await world.advance(60)
    assert [r[0] for r in world.stacks["n3"].restarts] == ["vllm"] and vllm_starts(world)["n3"] == 2
    assert vllm_starts(world) == {"n0": 1, "n1": 1, "n2": 2, "n3": 2, "n4": 1}


async def test_a_rank_that_died_unwatched_is_cleaned_before_its_node_arrives_at_the_barrier(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    """Arriving means "my ranks are stopped": a rank that died while its agent was down (its EngineCore may run on,
    holding the group's ports) is cleaned first, and a node whose cleanup is held does not arrive at all."""
    world = await cold(make_world)
    n2, n3 = world.stacks["n2"].components["vllm"], world.stacks["n3"].components["vllm"]
    await world.kill_agent("n3")
    world.stacks["n3"].crash("vllm")  # nobody watched it die
    n3.unclean = "port 43001 in use by pid 4242 (python3), not ours, never signalled"
    world.start_agent("n3")
    await world.until("n3 says why it does not arrive", lambda: world.stacks["n3"].events_of("barrier_held"), 60)
    held = world.stacks["n3"].events_of("barrier_held")
    assert len(held) == 1 and "port 43001 in use by pid 4242" in held[0]["message"]
    await world.until("n3's rank held", lambda: n3.hold is not None and "port 43001" in n3.hold.reason)
    assert n3.hold.resolves_itself is False, "a stranger on its port goes only when someone acts (--wait ends)"
    await world.advance(60)
    gs = world.gang("n2", "p1")
    assert gs.acted == 2 and "n3" not in gs.arrivals, "n3 never said it was stopped"
    assert vllm_starts(world)["n2"] == 1 and not n2.running, "n2 stopped its rank and waits: no half group"
    assert len(world.stacks["n3"].events_of("barrier_held")) == 1, "said once, not every retry"

    n3.unclean = None  # the operator freed the port
    await world.until("p1 started again on both", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2)
    assert n3.cleaned_at and n3.cleaned_at[-1] <= min(n2.starts[1], n3.starts[1]), "cleaned before any rank starts"
    assert ("vllm", "start", False) in world.stacks["n3"].cleaned
    await world.until("up", lambda: world.all_up(["n2", "n3"]))


async def test_a_rank_held_by_a_stranger_before_the_barrier_is_rechecked_not_cleaned_every_step(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    """A stranger on a rank's port held its cleanup before the barrier: every step (~3 s) ran the whole cleanup
    again (a 3 s port wait and a WARNING line, with a line per other action). The cleanup runs once; then only the
    hold's re-check, saying a new holder at once; status shows who holds the port at every moment."""
    world = await cold(make_world)
    n3 = world.stacks["n3"].components["vllm"]
    await world.kill_agent("n3")
    world.stacks["n3"].crash("vllm")
    n3.unclean = "port 43001 in use: 43001 held by pid 4242 'python3'"
    world.start_agent("n3")
    await world.until("n3's rank held", lambda: n3.hold is not None and "pid 4242" in n3.hold.reason, 60)
    await world.advance(300)
    assert len(n3.held_cleanups) == 1, f"the held cleanup ran {len(n3.held_cleanups)} times in 5 minutes"
    assert len(world.stacks["n3"].events_of("barrier_held")) == 1
    n3.unclean = "port 43001 in use: 43001 held by pid 5151 'nc -l 43001'"  # another stranger took the port
    await world.until("status shows the new holder", lambda: n3.hold is not None and "pid 5151" in n3.hold.reason)
    held = world.stacks["n3"].events_of("barrier_held")
    assert len(held) == 2 and "pid 5151" in held[-1]["message"], "a new holder is said once"
    await world.advance(60)
    assert len(n3.held_cleanups) == 1 and len(world.stacks["n3"].events_of("barrier_held")) == 2
    n3.unclean = None
    await world.until("p1 started again on both", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2)
    assert ("vllm", "start", False) in world.stacks["n3"].cleaned, "the whole cleanup ran once the port was free"


async def test_a_rank_stopped_whole_is_not_scanned_again_before_the_barrier(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    for node in ("n2", "n3"):
        world.stacks[node].cleaned.clear()
    world.stacks["n3"].crash("vllm")
    await world.until("p1 started again on both",
                      lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2)  # fmt: skip
    assert world.stacks["n3"].cleaned == [("vllm", "start", False)], "the crashed rank: cleaned"
    assert world.stacks["n2"].cleaned == [], "the rank its agent stopped whole: nothing to clean"


async def test_a_cluster_pause_holds_every_automatic_action_until_resume(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    await world.agents["n1"].coordinator.set_pause(True, "operator", "switch maintenance")
    await world.until("every node paused", lambda: all(s.paused for s in world.stacks.values()), 5)
    assert world.stacks["n3"].pause_info()["by"].startswith("n1")
    world.stacks["n0"].crash("vllm")  # p0 is one unit: its other rank goes with it
    world.stacks["n1"].crash("vllm")
    await world.advance(300)
    assert vllm_starts(world)["n0"] == vllm_starts(world)["n1"] == 1, "nothing restarts while paused"
    assert world.stacks["n0"].events_of("no_action"), "the failure is seen and left alone"
    await world.agents["n0"].coordinator.set_pause(False, "operator")
    await world.until("p0 back", lambda: world.all_up(["n0", "n1"]) and vllm_starts(world)["n0"] == 2, 60)
    assert vllm_starts(world) == {"n0": 2, "n1": 2, "n2": 1, "n3": 1, "n4": 1}


async def test_a_rank_lost_while_paused_restarts_its_whole_group_at_resume(make_world: Callable[..., World]) -> None:
    """A DP group cannot take a rank back: a rank that died while the cluster was paused does not start alone at
    resume (its peer would hang); the group restarts as one new generation."""
    world = await cold(make_world)
    await world.agents["n0"].coordinator.set_pause(True, "operator", "switch maintenance")
    await world.until("every node paused", lambda: all(s.paused for s in world.stacks.values()), 5)
    world.stacks["n0"].crash("vllm")  # its peer n1 runs on
    await world.advance(60)
    assert vllm_starts(world)["n0"] == 1 and world.stacks["n1"].components["vllm"].running
    await world.agents["n0"].coordinator.set_pause(False, "operator")
    await world.until("p0 restarted as one", lambda: vllm_starts(world)["n0"] == vllm_starts(world)["n1"] == 2, 60)
    await world.until("p0 up", lambda: world.all_up(["n0", "n1"]), 60)
    assert world.gang("n0", "p0").record.generation == world.gang("n1", "p0").acted == 2
    assert [r[0] for r in world.stacks["n1"].restarts] == ["vllm"], "the peer restarted once, for generation 2"
    assert vllm_starts(world) == {"n0": 2, "n1": 2, "n2": 1, "n3": 1, "n4": 1}


async def test_an_operator_start_of_a_stopped_rank_restarts_its_group(make_world: Callable[..., World]) -> None:
    """`stop` then `start` of one rank: the start is a new generation of the group, not a rank joining alone."""
    world = await cold(make_world)
    n2 = world.stacks["n2"]
    n2.command("vllm", "stop")
    await world.until("n2's rank stopped", lambda: not n2.components["vllm"].running, 30)
    await world.advance(10)
    n2.command("vllm", "start")
    await world.until("p1 restarted as one", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2, 60)
    assert world.gang("n3", "p1").acted == 2 and [r[0] for r in world.stacks["n3"].restarts] == ["vllm"]


async def test_a_generation_asked_while_paused_is_acted_on_at_resume(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    n3 = world.stacks["n3"]
    n3.node_pause = {"by": "operator", "at": world.clock.time(), "reason": "disk swap"}
    n3.notify()
    world.stacks["n2"].crash("vllm")
    await world.until("n3 defers generation 2", lambda: n3.events_of("gang_deferred"), 30)
    await world.advance(120)
    assert n3.restarts == [] and vllm_starts(world)["n2"] == 1, "n2 waits at the barrier for the paused n3"
    n3.node_pause = None
    n3.notify()
    await world.until("p1 restarted as one", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2, 60)
    assert [r[0] for r in n3.restarts] == ["vllm"] and world.gang("n3", "p1").acted == 2


async def test_restarting_a_remote_rank_restarts_its_group(make_world: Callable[..., World]) -> None:
    from nodeagent.core.errors import UnknownComponentError

    world = await cold(make_world)
    ops = world.agents["n4"].coordinator.ops
    assert ops is not None
    answer = await world.run(ops.remote("n2", "vllm", "restart", True, "operator"))
    assert answer["ok"] and "restarting group p1 as generation 2" in answer["message"], answer
    assert "n2, n3" in answer["message"]
    await world.until("p1 restarted", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2, 60)
    assert world.stacks["n2"].restarts[0][2] and world.stacks["n3"].restarts[0][2], "planned: drained first"
    assert vllm_starts(world)["n4"] == 1
    bad = await world.run(ops.remote("n2", "nope", "restart", True, "operator"))
    assert bad["code"] == 4 and "unknown component 'nope'" in bad["message"], bad
    odd = await world.run(ops.remote("n2", "vllm", "restart_component", True, "operator"))
    assert odd["code"] == 2 and "unknown action 'restart_component'" in odd["message"], "the outcome, not the words"
    with pytest.raises(UnknownComponentError, match="node 'n9' has no agent"):
        await world.run(ops.remote("n9", "vllm", "restart", True, "operator"))


async def test_an_etcd_outage_stops_nothing_and_a_group_failure_waits_for_it(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    world.store.set_reachable(False)
    await world.advance(60)
    assert vllm_starts(world) == dict.fromkeys(NODES, 1), "losing etcd never stops a serving stack"
    assert all(c.running for s in world.stacks.values() for c in s.components.values())

    verdict = world.stacks["n2"].crash("vllm")
    assert verdict is not None and "etcd unreachable" in verdict
    world.stacks["n4"].crash("vllm")  # a one-node group restarts locally while etcd is away
    await world.until("d0 back", lambda: world.stacks["n4"].components["vllm"].up, 30)
    await world.advance(120)
    assert vllm_starts(world)["n2"] == 1 and world.stacks["n3"].restarts == [], "p1's restart waits for etcd"
    assert world.stacks["n3"].components["vllm"].up, "the other rank keeps serving meanwhile"

    world.store.set_reachable(True)
    await world.until("p1 restarted as one", lambda: vllm_starts(world)["n2"] == vllm_starts(world)["n3"] == 2, 60)
    assert world.gang("n3", "p1").record.generation == 2
    assert vllm_starts(world) == {"n0": 1, "n1": 1, "n2": 2, "n3": 2, "n4": 2}


async def test_a_wiped_etcd_starts_generations_again_without_restarting(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    epoch = world.agents["n1"].coordinator.epoch
    world.stacks["n2"].crash("vllm")  # generation 2 of p1, so a new store's 1 is visibly "again"
    await world.until("p1 at generation 2", lambda: world.all_up(["n2", "n3"]) and world.gang("n3", "p1").acted == 2)
    starts = vllm_starts(world)

    world.store.wipe()
    await world.until("a new epoch everywhere", lambda: all(
        a.coordinator.epoch not in (None, epoch) for a in world.agents.values()), 30)  # fmt: skip
    await world.until("every member back", lambda: all(
        len(a.membership.members) == len(NODES) for a in world.agents.values()), 30)  # fmt: skip
    await world.advance(60)
    assert vllm_starts(world) == starts, "an empty etcd is no reason to restart anything"
    assert world.gang("n2", "p1").record.generation == 1
    for name, stack in world.stacks.items():
        assert len(stack.events_of("cluster_reset")) == 1, f"{name}: one alarm per wipe, not one per watch"


async def test_no_false_alarm_on_a_fresh_store(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    await world.advance(60)
    for stack in world.stacks.values():
        assert stack.events_of("cluster_reset") == [] and stack.events_of("cluster_view_reread") == []


async def test_a_cluster_redeploy_runs_once_and_starts_everything_through_the_barriers(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    world = await cold(make_world)
    await world.store.put("/datasystem/cluster/key", "residue")
    first = await world.agents["n2"].coordinator.ops.ask_redeploy("key not found", "operator")  # type: ignore[union-attr]
    second = await world.agents["n4"].coordinator.ops.ask_redeploy("again", "operator")  # type: ignore[union-attr]
    assert not first["already_in_progress"] and second["already_in_progress"], "it runs once however many ask"
    await world.until("done everywhere", lambda: all(s.events_of("cluster_redeploy_done") for s in world.stacks.values()))  # noqa: E501
    await world.until("everything up again", world.all_up, 120)
    for name, stack in world.stacks.items():
        assert stack.started("vllm") == stack.started("datasystem") == 2, name
        assert {(c, scope) for c, scope, _ in stack.cleaned} >= {("vllm", "redeploy"), ("datasystem", "redeploy")}
        vllm, worker = stack.components["vllm"], stack.components["datasystem"]
        assert vllm.gone[0] <= worker.gone[0], "vLLM stops first, then the worker"
    assert await world.store.get("/datasystem/cluster/key") is None, "the datasystem's keys in etcd are wiped"
    for node in ("n0", "n2", "n4"):
        assert all(gs.acted == 2 for gs in world.agents[node].coordinator.gangs.values()), "a new generation"
    await world.until("the proxy ready again", lambda: world.stacks["n0"].components["proxy"].ready, 60)


async def test_without_a_healthy_group_of_a_kind_the_proxy_is_not_ready(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    proxy = world.stacks["n0"].components["proxy"]
    await world.until("the proxy ready", lambda: proxy.ready)
    world.stacks["n4"].components["vllm"].start_s = 20.0  # the decode group takes a while to come back
    world.stacks["n4"].crash("vllm")
    await world.until("the proxy not ready", lambda: not proxy.ready, 10)
    assert "no healthy decode group" in proxy.blocks["backends"]
    await world.until("ready again", lambda: proxy.ready, 60)

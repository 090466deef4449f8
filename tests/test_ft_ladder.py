"""The group's ladder without processes: vLLM's fault-tolerance retry first, the gang restart after it
(`cluster.ft_rung` beside the coordinator), two agents each running one rank of one externally launched group,
over `ft_fakes.FakeFtApi` (the wheel's API shape and semantics) on the virtual clock of `cluster_fakes.World`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from cluster_fakes import World

NODES = ["n0", "n1"]
GROUPS = [{"name": "g", "kind": "mixed", "nodes": NODES, "dp_launch": "external", "data_parallel_rpc_port": 43000}]
FT = {"enabled": True, "engine_recovery_timeout_s": 120, "retry_timeout_s": 30, "status_interval_s": 2}
RANKS = {"n0": "vllm-dp0", "n1": "vllm-dp1"}


pytestmark = pytest.mark.usefixtures("no_processes")


@pytest.fixture
def make_world(worlds: Callable[..., World]) -> Callable[..., World]:
    def make(ft: dict[str, Any] | None = FT) -> World:
        return worlds(NODES, GROUPS, proxy=False, ft=ft)

    return make


async def cold(make_world: Callable[..., World], **kw: Any) -> World:
    world = make_world(**kw)
    world.start()
    await world.until("both ranks up", world.all_up, within=120)
    if world.ft is not None and kw.get("ft", FT) is not None:
        await world.until("fault tolerance armed on both nodes",
                          lambda: all(ft(world, n)["supported"] is not None for n in NODES), within=30)  # fmt: skip
    return world


def ft(world: World, node: str) -> dict[str, Any]:
    return world.stacks[node].status()["fault_tolerance"]["g"]  # type: ignore[no-any-return]


def generation(world: World) -> int:
    record = world.gang("n0", "g").record
    assert record is not None
    return record.generation


def starts(world: World) -> dict[str, int]:
    return {n: world.stacks[n].started(RANKS[n]) for n in NODES}


async def exactly_one_generation(world: World) -> None:
    """The group came back as generation 2, each rank restarted once, and nothing follows."""
    await world.until("both ranks up again", world.all_up, 60)
    await world.advance(100)
    assert generation(world) == 2 and starts(world) == {"n0": 2, "n1": 2}


def kinds(world: World, node: str) -> list[str]:
    return [e.event for e in world.stacks[node].events.recent if e.event.startswith("ft_")]


def outcomes(world: World, node: str) -> list[tuple[str, str]]:
    return [(s["rung"], s["outcome"]) for s in ft(world, node)["ladder"]]


async def test_an_engine_fault_recovered_by_retry_restarts_nothing_and_makes_no_generation(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    world = await cold(make_world)
    assert ft(world, "n0")["supported"] is True and ft(world, "n0")["rung"] == "watching"
    assert world.ft is not None
    world.ft.fault("vllm-dp1", "transient")
    await world.until("recovered on both nodes", lambda: all(ft(world, n)["recovered"] == 1 for n in NODES), 60)
    for node in NODES:
        assert outcomes(world, node) == [("retry", "fault"), ("retry", "sent"), ("retry", "recovered")]
        assert kinds(world, node) == ["ft_armed", "ft_fault", "ft_retry", "ft_recovered"]
        assert ft(world, node)["rung"] == "watching" and ft(world, node)["escalated"] == 0
    assert [c for c in world.ft.calls if c[0] == "retry"] in ([("retry", "vllm-dp0"), ("retry", "vllm-dp1")],
                                                              [("retry", "vllm-dp1"), ("retry", "vllm-dp0")])
    await world.advance(300)  # and it stays so: no late generation, no restart
    assert generation(world) == 1 and starts(world) == {"n0": 1, "n1": 1}
    assert not world.stacks["n0"].restarts and not world.stacks["n1"].restarts
    assert not world.stacks["n0"].postmortems and not world.stacks["n1"].postmortems


async def test_the_watch_is_a_prober_not_a_loop(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    assert world.ft is not None
    before = len(world.ft.calls)
    await world.advance(60)
    per_rank = (len(world.ft.calls) - before) / 2
    assert 28 <= per_rank <= 31, per_rank  # every status_interval_s (2 s) per rank, nothing in between


async def test_a_retry_that_times_out_escalates_to_exactly_one_generation(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    assert world.ft is not None
    world.ft.fault("vllm-dp1", "retry_hangs")
    await world.until("a retry sent on both", lambda: all(ft(world, n)["rung"] == "retry sent" for n in NODES), 30)
    sent_at = world.clock.monotonic()
    await world.until("generation 2", lambda: generation(world) == 2, 60)
    assert world.clock.monotonic() - sent_at == pytest.approx(30, abs=2.5)  # retry_timeout_s, not the engines' 120
    await world.until("both ranks up again", world.all_up, 60)
    await world.advance(200)
    assert generation(world) == 2 and starts(world) == {"n0": 2, "n1": 2}
    escalated = [n for n in NODES if ft(world, n)["escalated"]]
    assert escalated, "someone escalated"
    for node in escalated:
        steps = outcomes(world, node)
        assert steps[:4] == [("retry", "fault"), ("retry", "sent"), ("retry", "escalated"), ("gang", "asked")]
        assert ("gang", "superseded") in steps
        assert "retry timed out after 30 s" in ft(world, node)["ladder"][2]["detail"]
        (pm,) = world.stacks[node].postmortems
        assert pm["component"] == RANKS[node] and "generation 2" in pm["decision"]
        assert [s["outcome"] for s in pm["ladder"]] == ["fault", "sent", "escalated", "asked"]
    for node in NODES:  # the new generation is watched afresh
        assert ft(world, node)["rung"] == "watching"
        assert ft(world, node)["ranks"][RANKS[node]]["state"] == "healthy"


async def test_a_retry_that_fails_escalates_at_once(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    assert world.ft is not None
    world.ft.fault("vllm-dp1", "retry_fails")
    t0 = world.clock.monotonic()
    await world.until("generation 2", lambda: generation(world) == 2, 60)
    assert world.clock.monotonic() - t0 < 10  # not the 30 s timeout
    reasons = [s["detail"] for n in NODES for s in ft(world, n)["ladder"] if s["outcome"] == "escalated"]
    assert any("retry failed on rank 1" in r for r in reasons), reasons
    await exactly_one_generation(world)


async def test_a_dead_engine_goes_to_the_gang_restart_without_a_retry(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    assert world.ft is not None
    world.ft.fault("vllm-dp1", "dead")
    await world.until("generation 2", lambda: generation(world) == 2, 30)
    assert ("retry", "vllm-dp1") not in world.ft.calls
    n1 = ft(world, "n1")["ladder"]
    assert n1[1]["outcome"] == "escalated" and "rank 1 gone" in n1[1]["detail"]
    await exactly_one_generation(world)


async def test_a_dead_rank_process_goes_straight_to_the_gang_restart(make_world: Callable[..., World]) -> None:
    world = await cold(make_world)
    assert world.ft is not None
    verdict = world.stacks["n1"].crash("vllm-dp1")
    assert verdict is not None and "generation 2" in verdict
    skipped = ft(world, "n1")["ladder"][-1]
    assert skipped["rung"] == "retry" and skipped["outcome"] == "skipped"
    assert "a retry cannot bring back a lost rank" in skipped["detail"]
    assert ("retry", "vllm-dp1") not in world.ft.calls
    await exactly_one_generation(world)


async def test_a_vllm_without_the_routes_is_said_once_and_faults_go_to_the_gang(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    world = make_world()
    assert world.ft is not None
    world.ft.routes = False
    world.start()
    await world.until("said on both", lambda: all(ft(world, n)["supported"] is False for n in NODES), 60)
    await world.advance(30)
    for node in NODES:
        assert kinds(world, node) == ["ft_unsupported"]
        assert ft(world, node)["rung"] == "unsupported" and "404" not in ft(world, node)["reason"]
        assert "no /fault_tolerance routes" in ft(world, node)["reason"]
    calls = len(world.ft.calls)
    await world.advance(60)
    assert len(world.ft.calls) == calls  # said once, then not asked again
    world.stacks["n0"].crash("vllm-dp0")
    await world.until("generation 2", lambda: generation(world) == 2, 30)
    assert "vLLM cannot retry" in ft(world, "n0")["ladder"][-1]["detail"]
    await world.until("both ranks up again", world.all_up, 60)
    await world.advance(60)
    assert kinds(world, "n0").count("ft_unsupported") == 1


async def test_a_vllm_known_unsupported_at_its_launch_is_said_once_without_asking_it(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    """The launch read an older vLLM and left the flags out (`ComponentView.ft_unsupported`): the rung says why
    once, never reads a status, and a rank fault goes straight to the gang restart."""
    world = make_world()
    assert world.ft is not None
    why = "vLLM 0.31.0 predates the fault-tolerance API of vLLM 0.32: its flags are not rendered"
    world.start()
    for node in NODES:  # before the virtual clock runs: from the first launch on
        world.stacks[node].components[RANKS[node]].ft_unsupported = why
    await world.until("said on both", lambda: all(ft(world, n)["supported"] is False for n in NODES), 60)
    await world.until("both ranks up", world.all_up, 60)
    await world.advance(30)
    for node in NODES:
        assert kinds(world, node) == ["ft_unsupported"]
        assert ft(world, node)["rung"] == "unsupported" and ft(world, node)["reason"] == why
        assert ft(world, node)["ladder"] == [{"at": ft(world, node)["ladder"][0]["at"], "rung": "retry",
                                              "outcome": "unsupported", "detail": why, "generation": 1}]
    assert "vLLM 0.31.0 predates" in next(e.message for e in world.stacks["n0"].events.recent
                                          if e.event == "ft_unsupported")  # fmt: skip
    world.stacks["n1"].crash("vllm-dp1")
    await world.until("generation 2", lambda: generation(world) == 2, 30)
    assert f"vLLM cannot retry ({why})" in ft(world, "n1")["ladder"][-1]["detail"]
    await exactly_one_generation(world)
    assert world.ft.calls == [], "a vLLM known not to take part is never asked"
    assert [kinds(world, n).count("ft_unsupported") for n in NODES] == [1, 1]


async def test_without_the_config_there_is_no_rung(make_world: Callable[..., World]) -> None:
    world = await cold(make_world, ft=None)
    await world.advance(30)
    assert "fault_tolerance" not in world.stacks["n0"].status()


def test_the_status_table_names_a_rung_at_work_and_keeps_quiet_otherwise() -> None:
    from nodeagent.cli.status import format_fault_tolerance

    watching = {"rung": "watching", "recovered": 2, "escalated": 0, "ladder": []}
    sent = {"rung": "retry sent", "recovered": 2, "escalated": 0,
            "ladder": [{"detail": "rank 1 unhealthy"}, {"detail": "retry sent to rank 1; waiting up to 30 s"}]}
    said = {"rung": "unsupported", "reason": "the vLLM serves no /fault_tolerance routes", "ladder": []}
    assert format_fault_tolerance({"g": watching}) == []
    assert format_fault_tolerance({"g": sent, "h": said}) == [
        "fault tolerance g: retry sent — retry sent to rank 1; waiting up to 30 s (recovered 2, escalated 0)",
        "fault tolerance h: unsupported — the vLLM serves no /fault_tolerance routes (recovered 0, escalated 0)"]


async def test_the_ranks_liveness_is_held_through_the_episode_and_given_back_after_it(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    """vLLM parks its busy loop during the retry and the liveness canary fails: a local restart then would kill
    the group the retry recovers. The rung holds the liveness of its ranks from the fault on, at most vLLM's own
    recovery window, and gives it back when the episode ends — recovered, or taken over by the gang restart."""
    world = await cold(make_world)
    assert world.ft is not None
    world.ft.fault("vllm-dp1", "transient")
    await world.until("recovered on both nodes", lambda: all(ft(world, n)["recovered"] == 1 for n in NODES), 60)
    for node in NODES:
        log = world.stacks[node].liveness_hold_log
        assert [reason is not None for _, reason in log] == [True, False], log
        assert log[0][0] == RANKS[node] and "retry is recovering" in str(log[0][1])
        assert not world.stacks[node].liveness_holds
    world.ft.fault("vllm-dp1", "retry_hangs")
    await world.until("a retry sent on both", lambda: all(ft(world, n)["rung"] == "retry sent" for n in NODES), 30)
    now = world.clock.monotonic()
    for node in NODES:
        reason, until = world.stacks[node].liveness_holds[RANKS[node]]
        assert "retry is recovering" in reason
        assert now < until <= now + FT["engine_recovery_timeout_s"] + 10
    await world.until("someone escalated", lambda: any(ft(world, n)["escalated"] for n in NODES), 60)
    escalated = next(n for n in NODES if ft(world, n)["escalated"])
    assert "generation 2 on n0, n1 is asked" in world.stacks[escalated].liveness_holds[RANKS[escalated]][0]
    await world.until("generation 2", lambda: generation(world) == 2, 60)
    await world.until("both ranks up again", world.all_up, 60)
    await world.until("the holds given back", lambda: not any(world.stacks[n].liveness_holds for n in NODES), 30)


async def test_a_peer_escalating_while_this_node_reads_its_ranks_makes_no_second_generation(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    """n0's status read is slow (a loaded machine); n1's retry times out first and its generation is acted on n0
    while n0's read is in flight. n0 must not then escalate the fault a second time (CI saw generations 2 and 3
    for one hung retry)."""
    world = await cold(make_world)
    api = world.ft
    assert api is not None
    plain, slow = api.status, {"on": False}

    async def status(url: str) -> Any:
        out = await plain(url)
        if slow["on"] and api.ranks[url].component == "vllm-dp0":
            await world.clock.sleep(8)
        return out

    api.status = status  # type: ignore[method-assign]
    api.fault("vllm-dp1", "retry_hangs")
    await world.until("a retry sent on both", lambda: all(ft(world, n)["rung"] == "retry sent" for n in NODES), 30)
    slow["on"] = True
    await world.until("generation 2", lambda: generation(world) == 2, 60)
    slow["on"] = False
    await exactly_one_generation(world)


async def test_a_rank_dying_as_the_escalated_gang_restart_reaches_it_makes_no_second_generation(
        make_world: Callable[..., World]) -> None:  # fmt: skip
    """A hung retry escalates to generation 2; n1's rank, whose liveness was held through the episode, dies just as
    that restart reaches it (its exit read first, its old tree slow to stop). Its failure is decided at once, as
    every failure now is: it belongs to generation 1, which the group has left — no generation 3."""
    world = await cold(make_world)
    assert world.ft is not None
    n1 = world.stacks["n1"].components["vllm-dp1"]
    n1.stop_s = 20.0
    world.ft.fault("vllm-dp1", "retry_hangs")
    await world.until("generation 2 acted on n1", lambda: world.gang("n1", "g").acted == 2, 60)
    verdict = world.stacks["n1"].crash("vllm-dp1")
    assert verdict is not None and "generation 2 (already asked)" in verdict
    await exactly_one_generation(world)
    assert [e["data"]["generation"] for n in NODES for e in world.stacks[n].events_of("gang_generation")] == [2]

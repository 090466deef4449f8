"""Container mode in the whole-cluster simulation (`tests/sim_container.py`): the real `ContainerMode` over a
simulated engine replays its run event for event, and the bugs its invariants exist for are found when planted —
a rank's restart that recreates a healthy container, a dead container made twice, a container's recovery that stops
a host component."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import simulation
from simulation import make_schedule, run_schedule
from test_simulation import DURATION, VALIDATED_FIRST_SEED

from nodeagent.container.plan import Step

KEPT_CONTAINER: list[tuple[int, str, float, str]] = [
    # (seed, layout, duration, what it found) in container mode — docs/simulation.md has each bug's story
    (760011, "8node", 180, "dockerd not answering for 10 s was taken for the container's death: a node redeploy "
     "stopped every rank inside (a model load each) though the container's init lived"),
    (760353, "8node", 180, "an operator's restart lost: `--node a2-3 restart vllm` answered, a2-3's agent killed "
     "33 ms later (its drain under way, nothing stopped yet), its successor adopted the generation-1 rank as "
     "generation 2 (cluster.json said acted 2) and never restarted it (nothing of the container in it)"),
    (880633, "local-cluster", 180, "the simulation's own: an agent starting in container mode looks at its container "
     "(an engine call, virtual time) before its loops begin; the check read that moment as components left "
     "unsupervised (unsupervised)"),
    (875065, "local-cluster", 180, "an agent back while its container engine answered nothing took the failed "
     "inspect for no container: its ranks inside could not be adopted, its group restarted (restart_without_cause)"),
    (880505, "small", 180, "the same on the small layout's p1"),
]


@pytest.mark.parametrize(("seed", "layout", "duration", "found"), KEPT_CONTAINER,
                         ids=[f"container{k[0]}" for k in KEPT_CONTAINER])  # fmt: skip
def test_a_seed_that_found_a_bug_in_container_mode_stays_fixed(seed: int, layout: str, duration: float,
                                                               found: str) -> None:  # fmt: skip
    result = run_schedule(make_schedule(seed, layout, duration, node="container"))
    assert result.ok, f"{found}\n" + simulation.describe(result) + "\n" + "\n".join(result.trace[-40:])


CONTAINER_WINDOW = 8
"""Container mode's window: one seed in eight of the CI budget's (760001, 760009, ...: `simulation.node_for`); its
one finding (seed 760353, fixed since) is kept above."""


def container_seeds(count: int) -> list[int]:
    """Container mode's window, in order."""
    first = int(VALIDATED_FIRST_SEED)
    return [s for s in range(first + 1, first + 1 + CONTAINER_WINDOW * count, CONTAINER_WINDOW)]


def planted_find(invariants: set[str], tries: int = 24) -> dict[str, Any] | None:
    """The budget's container seeds in order until one of `invariants` fails; that seed must replay its run."""
    for seed in container_seeds(tries):
        schedule = make_schedule(seed, simulation.layout_for(seed, "mixed"), DURATION, node="container")
        result = run_schedule(schedule)
        hit = [v for v in result.violations if v.invariant in invariants]
        if hit:
            assert run_schedule(schedule).trace == result.trace, f"seed {seed} does not replay its run"
            return {"seed": seed, "violation": str(hit[0]), "replay": simulation.replay_line(schedule)}
    return None


def test_the_container_schedules_draw_container_faults_and_replay_event_for_event() -> None:
    schedules = (make_schedule(s, "local-cluster", 300, node="container") for s in container_seeds(20))
    schedule = next(s for s in schedules if any(e.kind == "container_death" for e in s.events))
    first, second = run_schedule(schedule), run_schedule(schedule)
    assert first.ok, simulation.describe(first) + "\n" + "\n".join(first.trace[-40:])
    assert any("container sim-" in line and "died" in line for line in first.trace), "a container died"
    assert len(first.trace) > 10 and first.trace == second.trace


def test_a_seed_replays_its_run_whatever_ran_before_it_in_the_process() -> None:
    """The agents' heartbeat jitter is `random.uniform`: without the run seeding it, a replay after other schedules
    wrote member records at other instants (here: the compaction's revision differed by one)."""
    import random

    schedule = make_schedule(760083, "8node", 240, node="container")
    random.seed(1)
    first = run_schedule(schedule)
    random.seed(2)
    second = run_schedule(schedule)
    assert any("compacted at" in line for line in first.trace) and first.trace == second.trace


def test_a_rank_restart_that_recreates_a_healthy_container_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug (issue 32 item 4 undone): a component inside that fails takes the container with it — the
    engine removes it, and the node makes a new one, though its init was alive."""
    import asyncio

    from nodeagent.container.mode import ContainerMode

    original = ContainerMode.decide
    removals: list[asyncio.Future[None]] = []

    def recreates(self: ContainerMode, comp: Any, failure: Any) -> Any:
        if self.runs_inside(comp.name) and self.problem is None:
            removals.append(asyncio.ensure_future(self.engine.remove()))
        return original(self, comp, failure)

    monkeypatch.setattr(ContainerMode, "decide", recreates)
    found = planted_find({"container_recreated"})
    assert found is not None, "the simulation did not find a rank restart that recreates a healthy container"
    print(f"found: {found}")


def test_a_dead_container_made_twice_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the plan for a dead container removes and creates it twice over."""
    import nodeagent.container.engine as engine

    original = engine.plan_container

    def twice(*args: Any) -> Any:
        plan = original(*args)
        return replace(plan, steps=(*plan.steps, Step.REMOVE, Step.CREATE)) if Step.CREATE in plan.steps else plan

    monkeypatch.setattr(engine, "plan_container", twice)
    found = planted_find({"container_recreated"})
    assert found is not None, "the simulation did not find a dead container recreated twice"
    print(f"found: {found}")


def test_a_container_recovery_that_stops_host_components_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: a dead container's node redeploy stops the whole node — the master's proxy, a host
    component, too."""
    import nodeagent.node.nodeport as nodeport
    from nodeagent.node.blast_radius import Blast

    original = nodeport.redeploy_scope

    def whole_node(blast: Blast, members: Any, origin: str | None = None) -> tuple[str, ...]:
        return tuple(m.name for m in members) if blast == Blast.CONTAINER else original(blast, members, origin)

    monkeypatch.setattr(nodeport, "redeploy_scope", whole_node)
    found = planted_find({"recovery_beyond_blast_radius", "restart_without_cause"})
    assert found is not None, "the simulation did not find a container recovery that stops a host component"
    print(f"found: {found}")

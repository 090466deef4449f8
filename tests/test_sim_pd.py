"""The PD watch in the whole-cluster simulation (`tests/sim_pd.py`, `simulation.py --pd`): the real `PdWatch` on the
proxy's agent attributes a decode group's empty 200s and a hung proxy and acts on them within its bound, a seed
replays its run, and the bugs `pd_unattributed` exists for are found when planted — a streak never acted on, a
proxy never blamed, an empty answer blamed on the wrong group."""

from __future__ import annotations

from typing import Any

import pytest
import simulation
from simulation import make_schedule, run_schedule

LAYOUTS = ("local-cluster", "small", "8node")


def schedules(count: int, kind: str | None = None) -> list[simulation.Schedule]:
    """Seeds from 1, fake and real node in turn, the layouts in turn; only those with a `kind` fault if given."""
    out = []
    for seed in range(1, 400):
        schedule = make_schedule(seed, LAYOUTS[seed % 3], 180, node="real" if seed % 2 else "fake", pd=True)
        if kind is None or any(e.kind == kind for e in schedule.events):
            out.append(schedule)
        if len(out) == count:
            break
    return out


def planted_find(invariants: set[str], kind: str, tries: int = 8) -> dict[str, Any] | None:
    for schedule in schedules(tries, kind):
        result = run_schedule(schedule)
        hit = [v for v in result.violations if v.invariant in invariants]
        if hit:
            assert run_schedule(schedule).trace == result.trace, f"seed {schedule.seed} does not replay its run"
            return {"seed": schedule.seed, "violation": str(hit[0]), "replay": simulation.replay_line(schedule)}
    return None


def test_empty_answers_and_a_hung_proxy_are_attributed_and_acted_on_within_the_bound() -> None:
    for schedule in [*schedules(3, "pd_empty"), *schedules(2, "pd_hang")]:
        result = run_schedule(schedule)
        assert result.ok, simulation.describe(result) + "\n" + "\n".join(result.trace[-40:])
        assert any("pd watch:" in line for line in result.trace) or any("pd: " in line and "restarted" in line
                                                                         for line in result.trace)  # fmt: skip
        assert result.faults["pd_empty"] + result.faults["pd_hang"] > 0
    again = schedules(1, "pd_hang")[0]
    assert run_schedule(again).trace == run_schedule(again).trace


def test_an_empty_streak_never_acted_on_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the streak of answers without tokens never reaches its threshold."""
    from nodeagent.cluster import pd_watch

    monkeypatch.setattr(pd_watch.EmptyCounter, "observe", lambda self, endpoint, ok, at=None: False)
    found = planted_find({"pd_unattributed"}, "pd_empty")
    assert found is not None, "the simulation did not find empty answers the PD watch never acted on"
    print(f"found: {found}")


def test_a_proxy_never_blamed_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the proxy's failed answer is never its own fault (the backends always take the blame)."""
    from nodeagent.cluster import pd_watch

    monkeypatch.setattr(pd_watch, "proxy_fault", lambda *args: None)
    found = planted_find({"pd_unattributed"}, "pd_hang")
    assert found is not None, "the simulation did not find a hung proxy the PD watch never restarted"
    print(f"found: {found}")


def test_empty_answers_blamed_on_the_wrong_group_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the group restarted for a decode instance's empty answers is the first prefill group."""
    from nodeagent.cluster.pd_watch import PdWatch

    original = PdWatch._restart

    async def wrong(self: PdWatch, why: str, group: str, reason: str) -> bool:
        if why == "empty":
            group = next(g.name for g in self.groups.values() if g.kind == "prefill")
        return await original(self, why, group, reason)

    monkeypatch.setattr(PdWatch, "_restart", wrong)
    found = planted_find({"pd_unattributed", "restart_without_cause"}, "pd_empty")
    assert found is not None, "the simulation did not find empty answers blamed on the wrong group"
    print(f"found: {found}")

"""Pure: what a rollout's status says beyond its record — what serves per kind now (the floor as it stands), each
group's load time from the members' own records, and the time left.

Load times come from the member records (`last_load_s`, each agent's persisted load history: `loadtime`), so an
agent restarted mid-rollout still knows how long a group takes to come back; nothing here is kept in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nodeagent.cluster.rollout.record import Record
from nodeagent.cluster.rollout.rules import (
    Observed,
    files_problem,
    floor_problem,
    held_out,
    kept_apart,
)
from nodeagent.cluster.rollout.states import ENDED, MOVING, Phase


def group_load_s(groups: Iterable[Any], members: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """group → its last load time (start to ready), the slowest of its ranks' `last_load_s`; groups none of whose
    ranks ever loaded under an agent are absent (an adopted process is not timed)."""
    out: dict[str, float] = {}
    for group in groups:
        known = []
        for proc in group.processes:
            comp = ((members.get(proc.node) or {}).get("components") or {}).get(proc.component) or {}
            if isinstance(comp.get("last_load_s"), int | float):
                known.append(float(comp["last_load_s"]))
        if known:
            out[group.name] = max(known)
    return out


def measured_overhead_s(record: Record | None) -> dict[str, float]:
    """group → what its last measured step out of the proxy cost beyond its load: drain, stop and proxy re-add
    (`out_of_proxy_s` less the restarting phase), from the last rollout's record. A new plan's outage estimate is
    this plus the group's last load: a load of 3 s behind a 7.5 s outage is not promised as ~3 s again."""
    out: dict[str, float] = {}
    for step in record.steps if record is not None else ():
        total = step.out_of_proxy_s
        if total is None or step.rollback or step.failed:
            continue
        for group in step.groups:
            out[group] = round(max(0.0, total - step.phase_s.get("restarting", 0.0)), 3)
    return out


def serving_now(record: Record, obs: Observed) -> dict[str, list[str]]:
    """kind → the groups serving as the rollout stands: healthy, not held out of the proxy, and (a group whose step
    is rejoining) back in it. While an exclusive rollout's switch waits for the old groups to leave the proxy they
    still serve (it deletes them once idle): "p1 (until the switch)". A kind with none is down."""
    held = held_out(record, obs.runs)
    rejoining = {g for s in record.steps if s.phase == Phase.REJOINING and not s.proxy_in and obs.proxy
                 for g in s.groups}  # fmt: skip
    switching, apart = record.exclusive and bool(rejoining), kept_apart(record, obs.runs)
    out: dict[str, list[str]] = {}
    for g, o in obs.groups.items():
        out.setdefault(o.kind, [])
        if not o.healthy or g in rejoining:
            continue
        if g not in held:
            out[o.kind].append(g)
        elif switching and g in apart:
            out[o.kind].append(f"{g} (until the switch)")
    return out


def floor_text(record: Record, obs: Observed) -> str:
    """What the status shows as the floor: why the next step waits, else what serves per kind now."""
    i = record.current()
    if i is not None and record.steps[i].phase == Phase.PENDING and record.status in MOVING:
        why = files_problem(record.steps[i], obs) or floor_problem(record, record.steps[i], obs)
        if why is not None:
            return f"step {i + 1} waits: {why.removeprefix('floor: ')}"
    parts = []
    for kind, groups in serving_now(record, obs).items():
        allowed = " (--allow-outage)" if kind in record.options.allow_outage else ""
        parts.append(f"{kind} {', '.join(groups)}" if groups else f"{kind} NONE{allowed}")
    return "serving: " + "; ".join(parts)



def time_left(record: Record, load_s: Mapping[str, float], now: float) -> float | None:
    """Seconds until the last step ends, estimated: each step's groups' last load (or the mean duration of the
    steps done) plus the bake; None when nothing is known to estimate from."""
    if not record.active:
        return 0.0
    took = [s.finished - s.started for s in record.steps
            if s.phase == Phase.DONE and s.finished is not None and s.started is not None]  # fmt: skip
    mean = sum(took) / len(took) if took else None
    total = 0.0
    for s in record.steps:
        if s.phase in ENDED:
            continue
        load = max((load_s[g] for g in s.groups if g in load_s), default=None)
        each = mean if mean is not None else (load + (0.0 if s.rollback else record.options.bake_s)
                                              if load is not None else None)  # fmt: skip
        if each is None:
            return None
        total += max(0.0, each - (now - s.started if s.in_progress and s.started else 0.0))
    return total

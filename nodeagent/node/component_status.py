"""One component as `/status` shows it (the view of a `Component`, read-only)."""

from __future__ import annotations

from typing import Any

from nodeagent.core.loadtime import load_status
from nodeagent.core.states import RESTART_CAUSES, State

Component = Any
"""A `nodeagent.node.component.Component` (not imported: it imports this module)."""


def loading_for(comp: Component, now: float) -> float | None:
    """Seconds this launch has been loading (not for an adopted process: its start is not ours to time)."""
    if comp.state != State.STARTING or comp.record is None or not comp.started_at or comp.adopted:
        return None
    return now - comp.started_at


def by_cause(counts: dict[str, int]) -> dict[str, int]:
    """In `RESTART_CAUSES` order (a cause recorded by another version last), as status and the table show them."""
    order = {cause: i for i, cause in enumerate(RESTART_CAUSES)}
    return dict(sorted(counts.items(), key=lambda item: order.get(item[0], len(order))))


def component_status(comp: Component, now: float) -> dict[str, Any]:
    failure = comp.failure
    return {
        "kind": comp.kind,
        "state": str(comp.state),
        "pid": comp.record.pid if comp.record else None,
        "ready": comp.ready,
        "ready_blockers": dict(comp.ready_blockers),
        "up": comp.up.is_set(),
        "restarts": comp.restarts,
        "restarts_by_cause": by_cause(comp.restarts_by_cause),
        "started_at": comp.started_at if comp.record else None,
        "uptime_s": round(now - comp.started_at, 1) if comp.started_at and comp.record else None,
        "last_exit": comp.last_exit,
        "load": load_status(comp.loads, loading_for(comp, now)),
        "failure": failure.to_dict() if failure is not None and comp.state == State.FAILED else None,
        "backoff_remaining_s": round(comp.backoff_until - now, 1) if comp.backoff_until else None,
        "held": comp.held if comp.record is None else None,
        "hold": comp.hold.to_dict() if comp.hold is not None and comp.record is None else None,
        "probes": comp.prober.snapshot() if comp.prober is not None else {},
        **comp.extra_status,
    }

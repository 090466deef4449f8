"""What a restart costs: how long a component took to come up (start → startup probes passed) the last few times,
and for one that is starting, about how long it has left — from its own history on this node.

On an A2 a vLLM rank loading a 300 GB model takes 30-60 min; an operator deciding whether to restart a group
needs that number, and one watching a start needs to know whether it is late. Pure: the component keeps the
list (persisted with its history), the status and member keys carry `load_status`, every view shows its `note`.
"""

from __future__ import annotations

import statistics
from typing import Any

LOADS_KEPT = 5
"""The last loads kept: enough for a median that one slow start (a cold page cache) does not move."""
LOAD_BUCKETS = (5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0, 5400.0, 7200.0)
"""dsv4_agent_vllm_load_seconds: the stand-in's seconds up to a 300 GB model's two hours."""


def remember(loads: list[float], seconds: float) -> list[float]:
    return [*loads, round(max(0.0, seconds), 1)][-LOADS_KEPT:]


def expected_s(loads: list[float]) -> float | None:
    return statistics.median(loads) if loads else None


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def load_status(loads: list[float], loading_for: float | None) -> dict[str, Any] | None:
    """`loading_for`: seconds since the start of a component that is loading now (None: it is not). None when
    there is nothing to say (never loaded, not loading)."""
    if not loads and loading_for is None:
        return None
    expected = expected_s(loads)
    out: dict[str, Any] = {"last_s": loads[-1] if loads else None, "expected_s": expected, "history_s": list(loads)}
    if loading_for is None:
        out["note"] = f"last load {_minutes(loads[-1])}"
        return out
    out["loading_s"] = round(loading_for, 1)
    if expected is None:
        out["left_s"] = None
        out["note"] = f"loading for {_minutes(loading_for)} (first load here: no estimate yet)"
    elif loading_for <= expected:
        out["left_s"] = round(expected - loading_for, 1)
        out["note"] = f"loading, about {_minutes(expected - loading_for)} left (usually {_minutes(expected)})"
    else:
        out["left_s"] = 0.0
        out["note"] = (f"loading for {_minutes(loading_for)}, {_minutes(loading_for - expected)} longer than "
                       f"usual ({_minutes(expected)})")  # fmt: skip
    return out

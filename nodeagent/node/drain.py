"""When a drain ends: pure, so the component's drain loop only reads counters and waits.

A planned restart or stop of a serving vLLM turns readiness off, then waits until no request is running or
waiting — once readiness has been off for `SETTLE_S` —, or its timeout, or until the counters cannot be read three
times in a row (a hung /metrics must not hold a restart for ever)."""

from __future__ import annotations

from dataclasses import dataclass

UNKNOWN_READS = 3
SETTLE_S = 3.0
"""Readiness off at least this long before an idle engine counts as drained: the load balancer must have seen it
first. Behind the PD proxy that is the member record (written at most once a second), the proxy's agent's sync
(a 1 s period) and its /instances/remove — 0.4 s in the fault campaign (issue 33), where a drain that ended at
0.0 s stopped the rank before the proxy had removed it and a request routed meanwhile came back 200-empty."""


@dataclass(frozen=True)
class DrainEnd:
    event: str
    message: str
    level: str = "info"


def drain_end(left: tuple[int, int] | None, waited: float, timeout: float, unknown: int) -> DrainEnd | None:
    """The drain's end after one read of the in-flight counters (`left`: running, waiting; None: unreadable, the
    `unknown`-th time in a row); None: keep draining."""
    if left is not None and left == (0, 0) and waited >= min(SETTLE_S, timeout):
        return DrainEnd("drained", f"drained in {waited:.1f}s")
    if unknown >= UNKNOWN_READS:
        return DrainEnd("drain_unknown", "cannot read in-flight requests; stopping now", "warning")
    if waited >= timeout:
        running, waiting = left if left is not None else ("?", "?")
        return DrainEnd("drain_timeout", f"drain timed out after {timeout:g}s with {running} running, {waiting} "
                        "waiting; stopping anyway", "warning")  # fmt: skip
    return None

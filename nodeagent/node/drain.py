"""When a drain ends: pure, so the component's drain loop only reads counters and waits.

A planned restart or stop of a serving vLLM turns readiness off, then waits until no request is running or
waiting, or its timeout, or until the counters cannot be read three times in a row (a hung /metrics must not hold
a restart for ever)."""

from __future__ import annotations

from dataclasses import dataclass

UNKNOWN_READS = 3


@dataclass(frozen=True)
class DrainEnd:
    event: str
    message: str
    level: str = "info"


def drain_end(left: tuple[int, int] | None, waited: float, timeout: float, unknown: int) -> DrainEnd | None:
    """The drain's end after one read of the in-flight counters (`left`: running, waiting; None: unreadable, the
    `unknown`-th time in a row); None: keep draining."""
    if left is not None and left == (0, 0):
        return DrainEnd("drained", f"drained in {waited:.1f}s")
    if unknown >= UNKNOWN_READS:
        return DrainEnd("drain_unknown", "cannot read in-flight requests; stopping now", "warning")
    if waited >= timeout:
        running, waiting = left if left is not None else ("?", "?")
        return DrainEnd("drain_timeout", f"drain timed out after {timeout:g}s with {running} running, {waiting} "
                        "waiting; stopping anyway", "warning")  # fmt: skip
    return None

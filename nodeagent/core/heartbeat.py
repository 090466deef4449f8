"""Heartbeats of the agent's loops, and the rule that gates systemd's watchdog ping on them.

Why: a loop that dies or hangs (an awaited future nobody resolves, a task ended by a bug) leaves its component
unsupervised while the event loop itself still runs and would keep pinging systemd. So every component loop (and
the node redeploy, and the agent's main loop) ticks a `Heartbeat` on every iteration and every bounded wait; the
agent sends WATCHDOG=1 only while `watchdog_ok` holds, and a wedged agent is restarted by systemd — the next one
adopts the stack. Host work that may rightly take long without a tick (a stop grace, a launch, a residue cleanup)
is declared with `busy(now, seconds)`: the loop counts as alive until that bound, not forever. Pure: no clock read
here, every time is passed in (monotonic seconds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["HEARTBEAT_MAX_AGE_S", "HOST_MARGIN_S", "PREPARE_BOUND_S", "TICK_S", "Heartbeat", "stale", "watchdog_ok"]

HEARTBEAT_MAX_AGE_S = 60.0
"""A loop not ticked for this long (outside a declared busy bound) is wedged. Its idle waits are bounded well
below it (a component ticks at least every few seconds), so only a hang, not a slow machine, gets near it."""
TICK_S = 5.0
"""A component loop's longest idle wait: it ticks at least this often."""
PREPARE_BOUND_S = 180.0
"""A start's cleanup (port waits, leftovers' stops), besides the NPUs' `clean_slate_timeout_s`."""
HOST_MARGIN_S = 60.0
"""Beyond a host operation's own bound (stop grace, launch timeout, cleanup) before its loop counts as wedged."""


@dataclass
class Heartbeat:
    """When a loop last ticked, and until when a declared long operation excuses it from ticking."""

    at: float
    busy_until: float | None = None
    doing: str = ""
    """What the declared operation is (for the log line that names a wedged loop)."""

    def tick(self, now: float) -> None:
        self.at = now
        self.busy_until = None
        self.doing = ""

    def busy(self, now: float, seconds: float, doing: str = "") -> None:
        """A tick now, and no tick needed for `seconds` (a bounded operation: its own timeout, plus a margin)."""
        self.at = now
        self.busy_until = now + max(0.0, seconds)
        self.doing = doing

    def age(self, now: float) -> float:
        return now - self.at

    def fresh(self, now: float, max_age: float) -> bool:
        return now - self.at <= max_age or (self.busy_until is not None and now <= self.busy_until)


def stale(heartbeats: Mapping[str, Heartbeat], now: float, max_age: float) -> list[str]:
    """The loops that have not ticked within `max_age` (nor are within a declared busy bound), by name."""
    return [name for name, beat in heartbeats.items() if not beat.fresh(now, max_age)]


def watchdog_ok(heartbeats: Mapping[str, Heartbeat], now: float, max_age: float = HEARTBEAT_MAX_AGE_S) -> bool:
    """May the agent ping systemd's watchdog: has every loop ticked recently."""
    return not stale(heartbeats, now, max_age)

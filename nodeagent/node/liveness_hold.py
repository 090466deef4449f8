"""Liveness failures a layer above asks the node to hold: vLLM's fault-tolerance retry is recovering the rank.

During an engine fault vLLM 0.32 parks the busy loop for up to `engine_recovery_timeout_sec` (120 s by default)
waiting for a `retry`; a chat waits the whole time and `/health` stays 200, so our liveness canary fails after a
few periods (<= 16.5 s with the defaults). Acting on that failure would kill the rank — and with it the group a
retry is about to recover (a DP group cannot take a restarted rank back). So the fault-tolerance rung holds the
group's ranks' liveness for the episode (`StackPort.hold_liveness`): a failure seen meanwhile is noted, shown
and not acted on.

Nothing is lost by holding: the hold has a deadline (the rung sets it past vLLM's own timeout), and when the hold
ends — released by the rung, or its deadline passed — the failure held is judged again by the next liveness
result: a rank that passes again is left alone, one that fails still is restarted at once. Everything runs from
the probes' own results; no timer of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nodeagent.seam.host import Clock

Emit = Callable[..., None]
Act = Callable[[str, int, str], None]
"""(component, probe generation, detail): the liveness failure carried out (the component's signal)."""


@dataclass
class LivenessHold:
    reason: str
    until: float
    """Monotonic deadline."""
    held: tuple[int, str] | None = None
    """The failure held (probe generation, detail), until a liveness result passes again."""
    held_at: float | None = None


class LivenessHolds:
    """Per component: the hold a layer asked for, and the failures to judge again once it ends."""

    def __init__(self, clock: Clock, emit: Emit, act: Act) -> None:
        self.clock = clock
        self.emit = emit
        self.act = act
        self.holds: dict[str, LivenessHold] = {}
        self.rejudge: dict[str, tuple[int, str]] = {}

    def set(self, name: str, reason: str | None, for_s: float = 0.0) -> None:
        """Hold (reason given) for `for_s` from now, or release (None)."""
        hold = self.holds.get(name)
        if reason is None:
            if hold is not None:
                self._end(name, hold, "released")
            return
        until = self.clock.monotonic() + for_s
        if hold is None:
            self.holds[name] = LivenessHold(reason, until)
        else:
            hold.reason, hold.until = reason, until

    def failed(self, name: str, gen: int, detail: str) -> bool:
        """A liveness failure: True when it is held (the caller does not act on it)."""
        hold = self._active(name)
        if hold is None:
            return False
        first = hold.held is None
        hold.held, hold.held_at = (gen, detail), hold.held_at or self.clock.monotonic()
        if first:
            left = hold.until - self.clock.monotonic()
            self.emit("liveness_held", f"liveness failed ({detail}); not acted on: {hold.reason} (at most "
                      f"{left:.0f}s more)", name, "warning", reason=hold.reason, detail=detail)  # fmt: skip
        return True

    def result(self, name: str, gen: int, ok: bool, detail: str) -> None:
        """Every liveness result: a pass clears a held failure; once the hold has ended, the next result judges
        the failure it held."""
        hold = self._active(name)
        if hold is not None:
            if ok:
                hold.held = hold.held_at = None
            return
        pending = self.rejudge.pop(name, None)
        if pending is None or pending[0] != gen:
            return
        if ok:
            self.emit("liveness_hold_end", "liveness passes again after the hold: nothing to do", name)
            return
        self.emit("liveness_hold_end", f"liveness still fails after the hold ({detail}): acting on it now", name,
                  "warning", detail=detail)  # fmt: skip
        self.act(name, gen, detail)

    def status(self, name: str) -> dict[str, Any] | None:
        hold = self._active(name)
        if hold is None:
            return None
        return {"reason": hold.reason, "left_s": round(max(0.0, hold.until - self.clock.monotonic()), 1),
                "failure_held": hold.held[1] if hold.held else None}  # fmt: skip

    def _active(self, name: str) -> LivenessHold | None:
        hold = self.holds.get(name)
        if hold is not None and self.clock.monotonic() >= hold.until:
            self._end(name, hold, "expired")
            return None
        return hold

    def _end(self, name: str, hold: LivenessHold, how: str) -> None:
        del self.holds[name]
        if hold.held is None:
            return
        self.rejudge[name] = hold.held
        held_s = self.clock.monotonic() - (hold.held_at or self.clock.monotonic())
        self.emit("liveness_hold_end", f"liveness hold {how} ({hold.reason}); the failure held {held_s:.0f}s is "
                  "judged by the next liveness result", name, how=how)  # fmt: skip

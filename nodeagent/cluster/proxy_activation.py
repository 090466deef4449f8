"""An instance the PD proxy never activates: its activation thread is gone.

vllm-ascend's proxy does not route an added instance at once: a thread of its own (`NodeListener`) asks the
instance's `/v1/models` every `--waiting-retry-interval` and activates it, or drops it after
`--max-waiting-retries` (the agent's sync then adds it again). That thread has no guard: an exception ends it —
a `KeyError` in `_push_heap` did, on a remove then add of an instance it no longer listed (the campaign's seed
3306) — and the proxy serves on with what it routes, never activating anything again: a restarted group stays out
for good, and no probe of ours fails. Seen from here: an instance the sync added stays waiting (added, not listed)
far past the proxy's own window while it answers the proxy's check. Then the proxy is the fault and restarts (a
new process routes to everything its launch is given at once). An instance that does not answer `/v1/models` is
its own fault, not the proxy's: said, never acted on here.

Decisions are pure functions; `ActivationWatch` is the thin check the PD watch runs beside its others."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from nodeagent.core.bindaddr import connect_host
from nodeagent.seam.host import Clock

SCRIPT_CHECK_S = 10.0
SCRIPT_RETRIES = 3
"""vllm-ascend's defaults of `--waiting-retry-interval` and `--max-waiting-retries` (a flag left out)."""
STUCK_MIN_S = 60.0
"""Never sooner than this, however short the proxy's window: an instance re-added after a drop waits again."""


def activation_window(check_s: float | None, retries: int | None) -> float:
    """How long the proxy may keep an added instance waiting before it activates or drops it."""
    return (SCRIPT_CHECK_S if check_s is None else check_s) * (SCRIPT_RETRIES if retries is None else retries)


def stuck_activations(pending_since: Mapping[str, float], now: float, window_s: float) -> list[str]:
    """The instances added but not listed for over twice the proxy's window (a live activation thread activates
    or drops each within one window; a dropped one is added again and waits one more)."""
    limit = max(2 * window_s, STUCK_MIN_S)
    return sorted(e for e, since in pending_since.items() if now - since > limit)


@dataclass(frozen=True)
class ActivationVerdict:
    answering: tuple[str, ...]
    """Stuck instances that answer the proxy's own check: proof against the proxy."""
    silent: tuple[str, ...]
    """Stuck instances that do not: their own fault."""

    @property
    def proxy_fault(self) -> bool:
        return bool(self.answering)

    def message(self, waited_s: float, check_s: float | None) -> str:
        every = f"every {check_s:g} s" if check_s is not None else f"every {SCRIPT_CHECK_S:g} s"
        if self.answering:
            return (f"the proxy has not activated {', '.join(self.answering)} for {waited_s:.0f} s though "
                    f"{'it answers' if len(self.answering) == 1 else 'they answer'} its check (/v1/models, asked "
                    f"{every}): its activation thread is not running")  # fmt: skip
        return (f"the proxy has not activated {', '.join(self.silent)} for {waited_s:.0f} s: "
                f"{'it does' if len(self.silent) == 1 else 'they do'} not answer /v1/models (not the proxy's fault)")


Get = Callable[[str, float], Awaitable[int]]
"""(url, timeout) → HTTP status; raises OSError when nobody answers."""


class ActivationWatch:
    """Judges the sync's waiting instances at each call; `restart` and `say` (message, event level: "error" when
    the proxy is the fault) are the PD watch's."""

    def __init__(self, pending_since: Callable[[], Mapping[str, float]],
                 window: Callable[[], tuple[float | None, int | None]], get: Get,
                 restart: Callable[[str], Awaitable[None]], say: Callable[[str, str], None],
                 clock: Clock) -> None:  # fmt: skip
        self._pending, self._window, self._get = pending_since, window, get
        self._restart, self._say, self.clock = restart, say, clock
        self.last: str | None = None
        """What the last check said (None: nothing stuck)."""
        self._found: ActivationVerdict | None = None
        """What the last check found: said again only when it changes."""

    async def check(self) -> ActivationVerdict | None:
        pending = self._pending()
        check_s, retries = self._window()
        now = self.clock.monotonic()
        stuck = stuck_activations(pending, now, activation_window(check_s, retries))
        if not stuck:
            if self._found is not None:
                self._say("the proxy activates what it is given again", "info")
            self.last = self._found = None
            return None
        answering = tuple([e for e in stuck if await self._answers(e)])
        verdict = ActivationVerdict(answering, tuple(e for e in stuck if e not in answering))
        message = verdict.message(max(now - pending[e] for e in stuck), check_s)
        if verdict != self._found:
            self._say(message, "error" if verdict.proxy_fault else "warning")
        self.last, self._found = message, verdict
        if verdict.proxy_fault:
            await self._restart(message)
        return verdict

    async def _answers(self, endpoint: str) -> bool:
        host, _, port = endpoint.rpartition(":")
        try:
            return await self._get(f"http://{connect_host(host)}:{port}/v1/models", 5.0) == 200
        except (OSError, ValueError):
            return False

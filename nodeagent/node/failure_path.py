"""A component's failure, from the moment it is known: judged at once, its tree stopped, then acted on.

The order is what matters. A data-parallel rank's failure restarts its whole group as one new generation (the
cluster layer's `decide`), and the stop of what is left of the failed tree can last a stop grace: an orphaned A2
EngineCore frees its NPUs in up to ~50 s. Judged *before* that stop, the generation is asked while the tree still
dies, so the group's other nodes begin stopping their ranks at once instead of a stop grace later; the start
barrier still waits for this tree (the rank is `running` until the whole tree is gone), and the layers see it
`stopping`, so a gang restart leaves it to the stop under way. The judgement only decides and notes — a bind-race
retry, the classified failure, the host's decision, the restart counted — and never waits: a backoff, the failed
state's retry and a node redeploy come after the stop, as they always did.

`FailurePath` is a mixin of `component.Component` (its state, seen from the failure path), as `nodeport.NodePort`
is of the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.core.failure import Failure, classify
from nodeagent.core.heartbeat import TICK_S
from nodeagent.core.states import State
from nodeagent.node.blast_radius import Blast
from nodeagent.seam.policy import backoff_delay

if TYPE_CHECKING:
    from collections.abc import Iterator

    from nodeagent.core.states import Signal, SignalKind, SignalName
    from nodeagent.node.bindrace import BindRaceRetries, BindRetry
    from nodeagent.seam.host import Process
    from nodeagent.seam.policy import RestartDecision

INTERNAL_MIN_DELAY_S = 1.0
"""The shortest wait after an internal error: a bug that recurs at once must never make a tight loop."""

Judged = tuple[Failure, "BindRetry | None", "RestartDecision | None"]
"""A failure as judged: classified, and either a bind-race retry or the host's decision (None: no action)."""


class FailurePath:
    """The failure path of `Component`."""

    if TYPE_CHECKING:  # the component's own, used here
        name: str
        cfg: Any
        host: Any
        """The component's `component.ComponentHost`."""
        failure: Failure | None
        bind_retries: BindRaceRetries
        backoff_until: float | None
        internal_errors: int
        proc: Process | None

        def _set(self, state: State, message: str = "", level: str = "info", **data: Any) -> None: ...
        def _going_down(self, why: str) -> Process | None: ...
        async def _stopped(self, proc: Process | None, why: str) -> dict[str, Any]: ...
        async def stop_process(self, why: str) -> dict[str, Any]: ...
        def count_restart(self, cause: str) -> None: ...
        def tick(self) -> None: ...
        async def _next(self) -> Signal: ...
        def _take_command(self, sig: Signal) -> None: ...
        def signal(self, kind: SignalKind | SignalName, gen: int | None = None, detail: str = "", *,
                   operator: bool = False, drain: bool = True, cause: str = "") -> None: ...  # fmt: skip

    async def _failed(self, failure: Failure, why: str) -> None:
        """Its process failed: evidence first, the stop begun, the failure judged, the tree gone, then acted on."""
        evidence = self.host.capture(self, failure)
        proc = self._going_down(why)
        judged = self._judge(failure)  # nothing awaited since the stop began: the layers see it `stopping`
        stopped = await self._stopped(proc, why)
        await self._after_failure(judged, evidence, stopped.get("tree"))

    def _judge(self, failure: Failure) -> Judged:
        """What a failure means, decided without waiting: a lost port race to retry (bindrace.py: not a failure,
        nothing counted, nothing archived), else the classified failure and the host's decision; a restart decided
        is counted now (one the host's layers took over, a gang restart, the host counted itself)."""
        retry = self.bind_retries.on_failure(failure)
        if retry is not None:
            return failure, retry, None
        failure = classify(failure, self.failure, self.cfg.restart.quick_exit_s)
        self.failure = failure
        decision = self.host.decide(self, failure)
        if decision is not None:
            self.count_restart(failure.cause)
        return failure, None, decision

    async def _after_failure(self, judged: Judged, evidence: Any = None, tree: Any = None) -> None:
        """Carry the judgement out once the tree is gone: the post-mortem, then the backoff, the failed state or a
        node redeploy."""
        failure, retry, decision = judged
        if retry is not None:
            self._set(State.BACKOFF, retry.reason, "warning", delay_s=retry.delay_s, bind_race_retry=retry.attempt)
            await self._sleep_interruptibly(retry.delay_s)
            return
        self.host.archive(self, failure, evidence, tree, decision)  # written off the crash path
        if decision is None:
            return
        if decision.action == "redeploy":
            if decision.delay_s > 0:
                self._set(State.BACKOFF, f"node redeploy in {decision.delay_s:.0f}s: {decision.reason}", "warning",
                          delay_s=decision.delay_s)  # fmt: skip
                if await self._sleep_interruptibly(decision.delay_s):
                    return
            self._redeploy(f"{self.name}: {failure.detail}")
            return
        if decision.action == "failed":
            reason = failure.permanent or decision.reason
            self._set(State.FAILED, f"failed: {reason}; retrying in {decision.delay_s:.0f}s", "critical",
                      retry_in_s=decision.delay_s, permanent=failure.permanent is not None,
                      output_tail=list(failure.output_tail))  # fmt: skip
            if await self._sleep_interruptibly(decision.delay_s) or failure.permanent:
                return
            self._redeploy(f"{self.name}: retry after failed state")
            return
        if decision.delay_s > 0:
            self._set(State.BACKOFF, f"restart in {decision.delay_s:.0f}s: {decision.reason}", "warning",
                      delay_s=decision.delay_s, consecutive_failures=decision.consecutive_failures)  # fmt: skip
            await self._sleep_interruptibly(decision.delay_s)

    def _redeploy(self, reason: str) -> None:
        """The ladder's node redeploy, of this component and what restarts with it only (`blast_radius`): a worker
        failure never restarts etcd, a rank failure never the worker."""
        self.host.request_redeploy(reason, self.host.blast(Blast.COMPONENT, self.name))

    async def _sleep_interruptibly(self, delay: float) -> bool:
        """Back off; an operator's start/restart/stop cuts the wait short (returns True then)."""
        self.backoff_until = self.host.clock.time() + delay
        self.host.on_state(self)
        sleeper = asyncio.ensure_future(self.host.clock.sleep(delay))
        try:
            while True:
                self.tick()
                getter = asyncio.ensure_future(self._next())
                try:
                    done, _ = await asyncio.wait({getter, sleeper}, timeout=TICK_S, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    getter.cancel()
                if not done:  # only the heartbeat's bound: the backoff goes on
                    continue
                if getter not in done or getter.cancelled():  # a signal that came with the timer is not lost
                    return False
                sig = getter.result()
                if sig.kind in ("restart", "wake", "stop"):
                    self._take_command(sig)
                    if sig.kind == "stop":
                        self.signal("wake")
                    return True
        finally:
            sleeper.cancel()
            self.backoff_until = None

    async def _internal_error(self, exc: Exception) -> None:
        """A bug in the loop or in its host (an OSError from a full log folder, a raising callback): never a silent
        `starting` forever. Logged with its traceback, an event, what runs of it stopped (its state is unknown),
        shown `failed: internal error: <type>: <message>`, and the loop re-armed after the normal restart backoff
        (`policy.backoff_delay` over the consecutive internal errors; reset once it is up again). Every step is
        guarded: this path itself must not end the loop."""
        what = f"internal error: {type(exc).__name__}: {exc}"
        logger.opt(exception=exc).error(f"{self.name}: {what}")
        self.internal_errors += 1
        delay = max(INTERNAL_MIN_DELAY_S, backoff_delay(self.cfg.restart, self.internal_errors))
        with _logged(self.name, "its event"):
            self.host.events.emit("internal_error", f"{what}; retrying in {delay:.0f}s", self.name, "error",
                                  error=type(exc).__name__, retry_in_s=delay)  # fmt: skip
        if self.proc is not None:
            with _logged(self.name, "the stop of its process"):
                await self.stop_process(what)
        self.failure = Failure("internal", f"failed: {what}")
        with _logged(self.name, "its failed state"):
            self._set(State.FAILED, f"failed: {what}; retrying in {delay:.0f}s", "critical", retry_in_s=delay)
        try:
            await self._sleep_interruptibly(delay)
        except Exception:
            logger.exception(f"{self.name}: the backoff after an internal error failed; waiting {delay:.0f}s")
            await asyncio.sleep(delay)


@contextlib.contextmanager
def _logged(name: str, what: str) -> Iterator[None]:
    """One step of the internal-error path: its own exception is logged, never raised."""
    try:
        yield
    except Exception:
        logger.exception(f"{name}: {what} failed after an internal error")

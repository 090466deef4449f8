"""What a component needs from whoever runs it: a small interface instead of the whole supervisor.

Four jobs, shaped like the API's `Controller` Protocol: **gate** (may it start now, and what to wait on),
**launch** (clean residue, spawn, stop), **decide** (what a failure means), **observe** (bookkeeping: persist,
probe, tell dependents). The supervisor implements it for real; tests implement it with a fake launcher and a
fake clock, so the state machine is exercised without processes or sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.errors import AgentError
from nodeagent.stackport import Hold, HoldKind

if TYPE_CHECKING:
    import subprocess

    from nodeagent.component import Component
    from nodeagent.events import EventBus
    from nodeagent.failure import Failure
    from nodeagent.policy import RestartDecision
    from nodeagent.process import ProcessRecord


class StartHeld(AgentError):
    """A start must wait for something that is not ours to fix (a foreign process on our port, on an NPU).

    Not a failure: nothing is counted, nothing escalates. `recheck()` answers cheaply whether the obstacle is
    still there (its description, or None once gone)."""

    def __init__(self, reason: str, recheck: Any = None, kind: HoldKind = HoldKind.FOREIGN_HOLDER) -> None:
        super().__init__(reason)
        self.reason = reason
        self.recheck = recheck
        self.hold = Hold(kind, reason, resolves_itself=False)
        """Nothing the agent does ends it: a foreign process must go (or an operator act)."""


class Clock:
    """Wall-clock time, a monotonic clock, sleeping and waiting with a timeout; tests substitute a clock that jumps
    instead of waiting (the component's, and the cluster layer's in `tests/cluster_fakes.py`)."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """Until `event` is set, at most `timeout` seconds of this clock; whether it is set."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout)):
                await event.wait()
        return event.is_set()


@dataclass
class Process:
    """A launched (or adopted) process as the component sees it."""

    record: ProcessRecord
    exited: asyncio.Future[int | None]
    """Resolves with the exit code (None when not our child) once the process is gone."""
    popen: subprocess.Popen[bytes] | None = None
    output: str = ""
    """Where its output goes, for the event log."""
    close: Any = None
    """Stops watching (without touching the process)."""
    extra: dict[str, Any] = field(default_factory=dict)


class ComponentHost(Protocol):
    events: EventBus
    clock: Clock

    # ---- gate
    def start_gate(self, comp: Component, operator: bool) -> Hold | None:
        """Why it may not start now (desired stopped, paused, dependency down, held...), or None."""

    def gate_waiters(self, comp: Component) -> list[Awaitable[Any]]:
        """Awaitables that complete when the gate's answer may have changed."""

    # ---- launch
    async def prepare(self, comp: Component) -> None:
        """Prerequisites and residue before a start; raises StartHeld, or LaunchError(permanent=...)"""

    async def launch(self, comp: Component) -> Process: ...

    async def adopt(self, comp: Component, record: ProcessRecord) -> Process:
        """Watch a process a previous agent started; raises AdoptError when it is not the recorded one."""

    async def terminate(self, comp: Component, proc: Process, why: str) -> dict[str, Any]:
        """Stop the process's whole tree."""

    def output_tail(self, comp: Component, proc: Process) -> tuple[str, ...]:
        """The last lines it printed (for a failure's reason)."""

    def drain_timeout(self, comp: Component) -> float | None:
        """How long a planned stop may wait for in-flight requests; None: this kind is not drained."""

    async def inflight(self, comp: Component) -> tuple[int, int] | None:
        """(running, waiting) requests right now; None when they cannot be read."""

    # ---- decide
    def decide(self, comp: Component, failure: Failure) -> RestartDecision | None:
        """What a failure leads to; None: no automatic action (paused, held)."""

    def capture(self, comp: Component, failure: Failure) -> Any:
        """What explains a failure, taken before anything is stopped or cleaned (fast: no file reads)."""

    def archive(self, comp: Component, failure: Failure, evidence: Any, tree: Any,
                decision: RestartDecision | None) -> None:  # fmt: skip
        """Write the failure's post-mortem bundle in the background (off the crash path)."""

    def request_redeploy(self, reason: str) -> bool: ...

    # ---- observe
    def on_process(self, comp: Component) -> None:
        """Its process record changed (started, adopted, refreshed, gone): persist it, probe it or stop probing."""

    def on_up(self, comp: Component) -> None:
        """The startup probes passed."""

    def on_going_down(self, comp: Component) -> None:
        """Its process is about to be stopped: dependents follow per their edges."""

    def on_state(self, comp: Component) -> None:
        """Its state changed: persist status, tell listeners."""

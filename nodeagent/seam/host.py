"""The plain values a component and its host exchange: a launched `Process`, a `StartHeld` obstacle, the `Clock`.

What a component needs from its host is `component.ComponentHost`, written next to the component it serves; this
module imports neither, so the component and its host (the supervisor, or a test's fake) share these types
without importing each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nodeagent.core.errors import AgentError
from nodeagent.seam.stackport import Hold, HoldKind

if TYPE_CHECKING:
    import subprocess

    from nodeagent.core.process import ProcessRecord


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
    fingerprint: str | None = None
    """What it was launched with (argv, env, cwd, files), to tell on a reload whether it must restart."""

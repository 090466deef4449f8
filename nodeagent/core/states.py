"""The vocabulary of a component's state machine: its states, and the signals that drive it.

Kept apart from `component.py` so that observers (metrics, API, the cluster layer) can name states without
importing the machine itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"


class Desired(StrEnum):
    """The operator's intent for a component (`intent.json`'s `desired`, the same strings)."""

    RUNNING = "running"
    STOPPED = "stopped"


UP_STATES = frozenset({State.RUNNING, State.READY, State.DRAINING})
"""Up: its process runs and its startup probes passed. Draining is up — a draining vLLM still serves its in-flight
requests, so `/livez` says live (docs/architecture.md, "Types where strings decided")."""
SERVING_STATES = frozenset({State.RUNNING, State.READY})
"""Up and not being taken down: what readiness toggles between; a drain ends in a stop, so whatever waits for a
component to serve on (its own processes watched, the proxy's backends, the PD watch's proxy) leaves draining out."""


def is_up(state: State | str) -> bool:
    """The one test of "up" (`UP_STATES`); a string from a status record compares equal to its `State`."""
    return state in UP_STATES


class SignalKind(StrEnum):
    """What a signal tells the machine (the event's text keeps these strings)."""

    EXITED = "exited"
    STARTUP_OK = "startup_ok"
    STARTUP_FAILED = "startup_failed"
    LIVENESS_FAILED = "liveness_failed"
    READY = "ready"
    NOT_READY = "not_ready"
    STOP = "stop"
    RESTART = "restart"
    WAKE = "wake"
    DEP_RESTART = "dep_restart"

    @property
    def failed_probe(self) -> str:
        """The probe whose failure this reports — "startup" | "liveness", the `Failure.what` it becomes — or ""
        for a signal that reports none (read from the member, not from the spelling of its name)."""
        return _FAILED_PROBE.get(self, "")


_FAILED_PROBE = {SignalKind.STARTUP_FAILED: "startup", SignalKind.LIVENESS_FAILED: "liveness"}
SignalName = Literal["exited", "startup_ok", "startup_failed", "liveness_failed", "ready", "not_ready", "stop",
                     "restart", "wake", "dep_restart"]
"""A `SignalKind` by its string, as the host's calls spell it (mypy checks the spelling)."""


@dataclass(frozen=True)
class Signal:
    """One input to the machine; consumed strictly in order by the component's single task."""

    kind: SignalKind
    gen: int | None = None
    """The process generation it concerns; stale signals of an older process are dropped."""
    detail: str = ""
    operator: bool = False
    """Asked for by an operator (API, CLI, remote command): allowed while paused."""
    drain: bool = True
    """For a planned restart or stop: drain in-flight requests first (vLLM); `--no-drain` clears it."""
    cause: str = ""
    """Why a restart is asked for (one of `RESTART_CAUSES`): counted by cause in status and /metrics."""


RESTART_CAUSES = ("crash", "probe", "launch", "gang", "operator", "reload", "dependency", "redeploy",
                  "npu_reset")
"""What a counted restart was for: a crash of the process, a failed startup/liveness probe, a start that failed,
the group's gang restart, an operator's restart, a config reload, a dependency's restart, a node or cluster
redeploy, a chip reset (or an isolation) of the node's NPUs."""

COMMANDS = frozenset({SignalKind.STOP, SignalKind.RESTART, SignalKind.WAKE, SignalKind.DEP_RESTART})

"""The vocabulary of a component's state machine: its states, and the signals that drive it.

Kept apart from `component.py` so that observers (metrics, API, the cluster layer) can name states without
importing the machine itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


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


@dataclass(frozen=True)
class Signal:
    """One input to the machine; consumed strictly in order by the component's single task."""

    kind: str
    """exited | startup_ok | startup_failed | liveness_failed | ready | not_ready | stop | restart | wake
    | dep_restart"""
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

COMMANDS = frozenset({"stop", "restart", "wake", "dep_restart"})

"""A rollout's vocabulary, standard library only (the CLI and the status page read it too): a step's phases, the
record's statuses, and the sets of them that the rules and the views decide by. StrEnums: the record in etcd and
every JSON keep the same strings."""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Phase(StrEnum):
    """Where one step is (`rollout_rules`' module docstring draws the way)."""

    PENDING = "pending"
    DRAINING = "draining"
    STAGING = "staging"
    RESTARTING = "restarting"
    GATING = "gating"
    REJOINING = "rejoining"
    BAKING = "baking"
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    SKIPPED = "skipped"


PHASES = (Phase.PENDING, Phase.DRAINING, Phase.STAGING, Phase.RESTARTING, Phase.GATING, Phase.REJOINING,
          Phase.BAKING, Phase.DONE)  # fmt: skip
"""One step's way, in order."""
ENDED = (Phase.DONE, Phase.ROLLED_BACK, Phase.SKIPPED)
OUT_OF_PROXY = (Phase.DRAINING, Phase.STAGING, Phase.RESTARTING, Phase.GATING)
RESTARTS = (Phase.STAGING, Phase.RESTARTING, Phase.GATING)
"""The phases in which a step's ranks may start on the file it takes them to."""


class Status(StrEnum):
    """Where the whole rollout is."""

    RUNNING = "running"
    PAUSED = "paused"
    ROLLING_BACK = "rolling_back"
    ABORTING = "aborting"
    HALTED = "halted"
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"
    FAILED = "failed"


MOVING = (Status.RUNNING, Status.ROLLING_BACK)
"""Statuses in which the next step may start."""
FINAL = (Status.DONE, Status.ROLLED_BACK, Status.HALTED, Status.ABORTED, Status.FAILED)
"""Nothing runs for the rollout any more (a halted one waits for the operator: resume, rollback or abort)."""
UNDER_WAY = tuple(s for s in Status if s not in FINAL)
"""Not final (`Record.active`): running, paused, rolling back or aborting — a step may be in progress, so the
floor and the time left mean something (`nodeagentctl cluster`, the status page; ui.js keeps a copy)."""


def under_way(status: object) -> bool:
    """A status as /cluster's JSON has it (a string, or None without a rollout) is `UNDER_WAY`."""
    return status in UNDER_WAY


def outage_text(step: dict[str, Any]) -> str:
    """What a step measured out of the proxy beside what its plan expected (the CLI's and the status page's:
    ui.js `outageText`); "" until the step is back in the proxy."""
    actual, expected = step.get("out_of_proxy_s"), step.get("expected_outage_s")
    if not isinstance(actual, int | float):
        return ""
    return f"out of the proxy {actual:.1f} s" + (f" (expected ~{expected:.1f} s)"
                                                 if isinstance(expected, int | float) else "")

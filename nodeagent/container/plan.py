"""Lifecycle decisions for the node's container, as pure functions of what `inspect` says and what we recorded.

The guide's recovery is "restart the container and redo the whole deployment": a container that died (exited,
OOM-killed, removed, replaced) is recreated, set up again and the stack redeployed; one that restarted under us
(engine restart, `docker restart`) keeps its files, so only the stack is redeployed. A changed image, run line or
setup list is a planned recreate: drain the stack first. Setup runs once per new container: its stamp is the
container id plus the setup list's hash, and the steps done so far are recorded, so a failed step resumes there
instead of repeating the steps before it (`git am` twice fails). `nodeagent.container.engine` is the shell.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any


class ContainerInspectError(ValueError):
    """`inspect` printed something that is not one container's JSON."""


@dataclass(frozen=True)
class ContainerState:
    """One container as `docker inspect` / `podman inspect` describe it (the fields both print)."""

    id: str
    name: str
    status: str
    """created, running, paused, restarting, removing, exited, dead (podman also: configured, stopped)."""
    running: bool
    image: str
    """The image as the run line named it."""
    image_id: str = ""
    """The image's ID (what the name pointed at when the container was made): the compile caches' key."""
    exit_code: int | None = None
    oom_killed: bool = False
    error: str = ""
    pid: int | None = None
    """The container's init on the host (0 / None when it is not running)."""
    started_at: str | None = None
    finished_at: str | None = None

    def describe(self) -> str:
        """One line for logs and the post-mortem: status, exit code, OOM, the engine's error."""
        # podman says `stopped` for an exited container whose cleanup has not run yet: the same fact
        text = "exited" if self.status == "stopped" else self.status
        if text in ("exited", "dead") and self.exit_code is not None:
            text += f" with code {self.exit_code}"
        if self.oom_killed:
            text += " (OOM-killed)"
        if self.error:
            text += f": {self.error}"
        return text


def parse_inspect(text: str) -> ContainerState | None:
    """`inspect` output → the container, or None for an empty list (no such container)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ContainerInspectError(f"inspect printed no JSON: {exc}") from None
    if isinstance(data, list):
        if not data:
            return None
        data = data[0]
    if not isinstance(data, dict) or not isinstance(data.get("State"), dict):
        raise ContainerInspectError("inspect printed no container (no State)")
    state: dict[str, Any] = data["State"]
    config = data["Config"] if isinstance(data.get("Config"), dict) else {}
    pid = state.get("Pid")
    return ContainerState(
        id=str(data.get("Id", "")), name=str(data.get("Name", "")).lstrip("/"),
        status=str(state.get("Status", "")).lower(), running=bool(state.get("Running")),
        image=str(data.get("ImageName") or config.get("Image") or data.get("Image", "")),
        image_id=str(data.get("Image") or ""),
        exit_code=state.get("ExitCode"), oom_killed=bool(state.get("OOMKilled")), error=str(state.get("Error") or ""),
        pid=pid if isinstance(pid, int) and pid > 0 else None,
        started_at=_time(state.get("StartedAt")), finished_at=_time(state.get("FinishedAt")),
    )  # fmt: skip


def _time(value: Any) -> str | None:
    """The engines print Go's zero time for "never"."""
    return str(value) if value and not str(value).startswith("0001-01-01") else None


def setup_hash(setup: Sequence[Sequence[str]]) -> str:
    return hashlib.sha256(json.dumps([list(s) for s in setup]).encode()).hexdigest()[:16]


def setup_stamp(container_id: str, setup: Sequence[Sequence[str]]) -> str:
    """Setup is done once per (container, setup list)."""
    return f"{container_id[:12]}-{setup_hash(setup)}"


@dataclass(frozen=True)
class ContainerRecord:
    """What the agent stored about the container it runs the stack in (in its state folder)."""

    container_id: str
    fingerprint: str
    """`ContainerSpec.fingerprint()` it was created with."""
    setup_hash: str
    started_at: str | None = None
    """StartedAt when the stack was deployed: a different one means the container restarted under us."""
    setup_stamp: str | None = None
    setup_done: int = 0
    """Setup steps that succeeded under setup_stamp."""
    stopped_by_agent: str | None = None
    """When the agent itself stopped it (`on_stop: stop`). Its exit status then reads like a crash — `Exited
    (137)`: bash, the guide's entrypoint, ignores SIGTERM, so the engine SIGKILLs it after stop_timeout_s — but
    it is none: the next agent starts it again (set up already), no death, no redeploy counted."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ContainerRecord:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class Step(StrEnum):
    REMOVE = "remove"
    CREATE = "create"
    """Create and start (the run line)."""
    START = "start"
    UNPAUSE = "unpause"
    SETUP = "setup"


@dataclass(frozen=True)
class ContainerPlan:
    steps: tuple[Step, ...]
    reason: str
    drain: bool = False
    """A planned recreate: drain and stop the stack before the first step."""
    redeploy: bool = False
    """The stack's processes died with the container: redeploy it (counted as a node redeploy)."""
    wait: bool = False
    """The engine is busy with it (restarting, removing): look again shortly, do nothing now."""

    @property
    def nothing(self) -> bool:
        return not self.steps and not self.redeploy and not self.wait


DEAD = ("exited", "stopped", "dead")


def plan_container(state: ContainerState | None, record: ContainerRecord | None, fingerprint: str, image: str,
                   setup: Sequence[Sequence[str]]) -> ContainerPlan:
    """What to do to have a running, set-up container made from this fingerprint."""
    with_setup = (Step.SETUP,) if setup else ()
    ours = record is not None and state is not None and record.container_id == state.id
    if state is None:
        return ContainerPlan((Step.CREATE, *with_setup), "absent" if record is None else "removed under us",
                             redeploy=record is not None)
    if state.status in ("restarting", "removing"):
        return ContainerPlan((), f"container is {state.status}", wait=True)
    # the run the agent stopped (same StartedAt): one started again by hand since and died is a death
    stopped_by_us = ours and record is not None and record.stopped_by_agent is not None and state.status in DEAD \
        and state.started_at == record.started_at
    if state.status in DEAD and not stopped_by_us:
        return ContainerPlan((Step.REMOVE, Step.CREATE, *with_setup), f"container {state.describe()}",
                             redeploy=ours)
    replaced = record is not None and not ours
    if state.image != image:
        return ContainerPlan((Step.REMOVE, Step.CREATE, *with_setup), f"image changed ({state.image} → {image})",
                             drain=True, redeploy=replaced)
    if ours and record is not None and record.fingerprint != fingerprint:
        return ContainerPlan((Step.REMOVE, Step.CREATE, *with_setup), "run line changed", drain=True)
    if ours and record is not None and record.setup_hash != setup_hash(setup):
        return ContainerPlan((Step.REMOVE, Step.CREATE, *with_setup), "setup changed (it runs once per new "
                             "container)", drain=True)
    first: tuple[Step, ...] = ()
    if state.status == "paused":
        first = (Step.UNPAUSE,)
    elif not state.running:  # created, configured, initialized: never started
        first = (Step.START,)
    todo = with_setup if setup_todo(record if ours else None, state.id, setup) else ()
    restarted = ours and record is not None and record.started_at is not None and state.running \
        and state.started_at != record.started_at
    if replaced:
        reason = "replaced under us (another container by that name)"
    elif record is None:
        reason = "adopted (not created by this agent: its run line is not checked)"
    elif restarted:
        reason = f"restarted under us (started {state.started_at}, was {record.started_at})"
    elif stopped_by_us:
        reason = (f"stopped by the agent at {record.stopped_by_agent} ({state.describe()}: its bash entrypoint "
                  "ignores SIGTERM, so the engine kills it; no crash)")
    else:
        reason = "up" if not first and not todo else f"container {state.status}"
    return ContainerPlan((*first, *todo), reason, redeploy=replaced or restarted)


def setup_todo(record: ContainerRecord | None, container_id: str, setup: Sequence[Sequence[str]]
               ) -> list[tuple[int, list[str]]]:
    """The setup steps still to run in this container, numbered from 1."""
    stamp = setup_stamp(container_id, setup)
    done = record.setup_done if record is not None and record.setup_stamp == stamp else 0
    return [(i + 1, list(step)) for i, step in enumerate(setup) if i >= done]


def setup_progress(record: ContainerRecord, container_id: str, setup: Sequence[Sequence[str]],
                   done: int) -> ContainerRecord:
    return replace(record, setup_stamp=setup_stamp(container_id, setup), setup_done=done)


@dataclass(frozen=True)
class SetupStepFailed(Exception):
    """A setup step exited non-zero: the stack is held, and the message names the step."""

    index: int
    total: int
    argv: tuple[str, ...]
    returncode: int | None
    output_tail: str = ""

    def __str__(self) -> str:
        how = "timed out" if self.returncode is None else f"exited {self.returncode}"
        text = f"container setup step {self.index}/{self.total} ({' '.join(self.argv)}) {how}"
        return text + (f": {self.output_tail.strip()}" if self.output_tail.strip() else "")


@dataclass(frozen=True)
class Death:
    """Why the container is no longer the one the stack runs in."""

    kind: str
    """exited, removed, restarted, replaced, engine-unresponsive."""
    detail: str
    state: ContainerState | None = None


class DeathWatch:
    """Judges successive observations of the container (an inspect after an engine event, or a poll).

    `observe(now, state)` with state None = no such container; `engine_failed(now)` when inspect itself failed
    (engine down or hung): that becomes a death after `unresponsive_after_s` without an answer — unless the
    container's init is seen alive on the host meanwhile (`init_alive`): the engine's silence (dockerd restarting
    or hung) is then no death, and a node redeploy would cost every rank inside its model load for nothing.
    """

    def __init__(self, container_id: str, started_at: str | None, now: float,
                 unresponsive_after_s: float = 10.0) -> None:  # fmt: skip
        self.container_id, self.started_at = container_id, started_at
        self.unresponsive_after_s = unresponsive_after_s
        self.last_answer = now

    def observe(self, now: float, state: ContainerState | None) -> Death | None:
        self.last_answer = now
        if state is None:
            return Death("removed", "the container was removed")
        if state.id != self.container_id:
            return Death("replaced", f"another container {state.id[:12]} has its name", state)
        if not state.running:
            return Death("exited", f"container {state.describe()}", state)
        if self.started_at is not None and state.started_at != self.started_at:
            return Death("restarted", f"container restarted at {state.started_at}", state)
        return None

    def engine_failed(self, now: float, error: str, init_alive: bool = False) -> Death | None:
        if init_alive:  # /proc answers for the engine: the container lives
            self.last_answer = now
            return None
        silent = now - self.last_answer
        if silent >= self.unresponsive_after_s:
            return Death("engine-unresponsive", f"the engine has not answered inspect for {silent:.0f} s: {error}")
        return None


DEATH_EVENTS = frozenset({"die", "died", "oom", "kill", "stop", "remove", "cleanup", "restart"})
"""Engine events after which the watcher inspects at once (docker says die, podman died)."""


def event_status(line: str) -> str | None:
    """The event's status/action from one line of `events --format json` (podman) or `{{json .}}` (docker)."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    value = data.get("Status") or data.get("status") or data.get("Action")
    return str(value).lower() if value else None

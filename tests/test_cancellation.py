"""Cancelling an agent task ends the processes it started: the engine commands (on a timeout too, the whole
group) and the container watch's `podman events` follower. Real short-lived processes (`sleep`), no engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nodeagent.container import mode as container_mode
from nodeagent.container.engine import ContainerEngine, EngineError, run_engine
from nodeagent.container.mode import ContainerMode
from nodeagent.container.plan import ContainerPlan, ContainerState
from nodeagent.container.world import HostContainerWorld


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie not yet reaped by its new parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


async def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return not alive(pid)


async def pid_in(path: Path, seconds: float = 5.0) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int(path.read_text().strip())
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} never written")


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def test_a_timed_out_engine_command_leaves_no_child_behind(tmp_path: Path) -> None:
    """A shell's background child (a setup step's) is in the command's group: the timeout kills it too."""
    pidfile = tmp_path / "child"
    began = time.monotonic()
    with pytest.raises(EngineError, match="timed out"):
        await run_engine(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], 0.5)
    took = time.monotonic() - began
    child = await pid_in(pidfile)
    try:
        assert await gone_within(child, 2.0), "the command's child outlived its timeout"
        assert took < 5.0, f"the timeout took {took:.1f} s (waited for the child holding the pipes)"
    finally:
        kill(child)


async def test_a_cancelled_engine_command_is_killed_with_its_children(tmp_path: Path) -> None:
    """(asyncio kills the command itself when its transport is collected; its children are ours to end.)"""
    pidfile = tmp_path / "cmd"
    task = asyncio.create_task(run_engine(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], 30.0))
    pid = await pid_in(pidfile)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    try:
        assert await gone_within(pid, 2.0), "the engine command outlived the cancelled task"
    finally:
        kill(pid)


class _Spec:
    """An engine spec whose `events` is a plain process writing its PID (no podman)."""

    def __init__(self, pidfile: Path) -> None:
        self.pidfile = pidfile

    def events_argv(self) -> tuple[str, ...]:
        return ("sh", "-c", f"echo $$ > {self.pidfile}; exec sleep 60")


class _Engine(ContainerEngine):
    def __init__(self, pidfile: Path, state: ContainerState) -> None:
        super().__init__(_Spec(pidfile), 5.0)  # type: ignore[arg-type]
        self.state = state

    async def inspect(self) -> ContainerState | None:
        return self.state


async def test_cancelling_the_container_task_ends_its_watch_and_the_events_child(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    state = ContainerState("c1", "node", "running", True, "img", started_at="t0")

    async def ensure(*_: Any, **__: Any) -> tuple[ContainerState, ContainerPlan]:
        return state, ContainerPlan((), "found running")

    monkeypatch.setattr(container_mode, "ensure_container", ensure)
    mode = ContainerMode.__new__(ContainerMode)
    pidfile = tmp_path / "events"
    mode.engine = _Engine(pidfile, state)
    mode.world = HostContainerWorld()
    mode.sup = SimpleNamespace(events=SimpleNamespace(emit=lambda *a, **k: None), wake=lambda: None,
                               on_state=lambda _: None, clock=SimpleNamespace(monotonic=time.monotonic))  # fmt: skip
    mode.spec = SimpleNamespace(name="node")  # type: ignore[assignment]
    mode.section = SimpleNamespace(setup=[])  # type: ignore[assignment]
    mode.records = None  # type: ignore[assignment]
    mode.state, mode.problem, mode._recreating = None, None, False
    mode._wake, mode._reconfigured = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(mode._run())
    pid = await pid_in(pidfile)
    before = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    try:
        assert await gone_within(pid, 2.0), "`podman events` outlived the cancelled container task"
        left = [t for t in before if not t.done() and t is not task]
        assert not left, f"tasks left running: {left}"
    finally:
        kill(pid)

"""The one command runner (`core.run`): its timeout and its caller's cancellation end the whole process group,
a grandchild included (a `sh -c` whose background child holds the pipes). Real short-lived processes (`sleep`)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from test_cancellation import gone_within, kill, pid_in

from nodeagent.core.run import RunTimeout, run, run_blocking

GRANDCHILD = "sleep 60 & echo $! > {pidfile}; wait"


async def test_a_timeout_kills_the_grandchild_and_returns_at_once(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild"
    began = time.monotonic()
    with pytest.raises(RunTimeout, match=r"timed out after 0\.3s"):
        await run(["sh", "-c", GRANDCHILD.format(pidfile=pidfile)], 0.3)
    took = time.monotonic() - began
    grandchild = await pid_in(pidfile)
    try:
        assert await gone_within(grandchild, 2.0), "the grandchild outlived the command's timeout"
        assert took < 5.0, f"the timeout took {took:.1f} s (waited for the grandchild holding the pipes)"
    finally:
        kill(grandchild)


async def test_a_cancellation_kills_the_grandchild(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild"
    task = asyncio.create_task(run(["sh", "-c", GRANDCHILD.format(pidfile=pidfile)]))
    grandchild = await pid_in(pidfile)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    try:
        assert await gone_within(grandchild, 2.0), "the grandchild outlived the cancelled task"
    finally:
        kill(grandchild)


async def test_the_blocking_runner_kills_the_grandchild_on_its_timeout(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild"
    outcome: list[BaseException] = []

    def blocking() -> None:
        try:
            run_blocking(["sh", "-c", GRANDCHILD.format(pidfile=pidfile)], 0.3)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=blocking)
    thread.start()
    grandchild = await pid_in(pidfile)
    await asyncio.to_thread(thread.join, 10.0)
    try:
        assert [type(exc) for exc in outcome] == [RunTimeout]
        assert await gone_within(grandchild, 2.0), "the grandchild outlived the blocking command's timeout"
    finally:
        kill(grandchild)


async def test_output_input_and_exit_code(tmp_path: Path) -> None:
    apart = await run(["sh", "-c", "read x; echo out $x; echo err >&2; exit 3"], 5.0, input=b"y\n")
    assert (apart.returncode, apart.stdout, apart.stderr) == (3, "out y\n", "err\n")
    merged = await run(["sh", "-c", "echo out; echo err >&2"], 5.0, merge_stderr=True, cwd=tmp_path)
    assert (merged.returncode, merged.output, merged.stderr) == (0, "out\nerr\n", "")
    assert run_blocking(["sh", "-c", "echo $X"], 5.0, env={"X": "1", "PATH": "/usr/bin:/bin"}).stdout == "1\n"
    with pytest.raises(FileNotFoundError):
        await run(["/nonexistent/program"], 5.0)

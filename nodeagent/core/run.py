"""The one way the agent runs a short command (npu-smi, hccn_tool, the container engine, exec probes, dscli):
in a session of its own, so that its process group names everything it started, and that group is SIGKILLed and
the command reaped both when its timeout passes and when the task awaiting it is cancelled. A command that
outlived its caller (a `sh -c` setup step's children, a `podman` left running) would hold NPUs, ports or locks
nobody supervises.

Long-lived children (the supervised components, the log relay, a followed event stream) are not commands: they
are started by `core.process` or by their owner, which still ends them with `kill_group`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REAP_BOUND_S = 5.0
"""SIGKILL cannot be ignored, so the leader is gone in milliseconds; the bound only guards a lost waiter."""


class RunTimeout(TimeoutError):
    """The command ran past its timeout; its whole process group was killed."""

    def __init__(self, argv: Sequence[str], timeout_s: float) -> None:
        super().__init__(f"{' '.join(argv)} timed out after {timeout_s:g}s")
        self.argv = tuple(argv)
        self.timeout_s = timeout_s


@dataclass(frozen=True)
class RunResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    """Empty when stderr was merged into stdout (`merge_stderr`)."""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process group a `start_new_session` child leads, then reap the child. The group is killed even
    when the leader already exited (its children may not have); a second cancel leaves the reaping to go on by
    itself (shielded) and is not swallowed."""
    _killpg(proc.pid)
    with contextlib.suppress(TimeoutError, ProcessLookupError):
        await asyncio.wait_for(asyncio.shield(proc.wait()), REAP_BOUND_S)


async def run(argv: Sequence[str], timeout_s: float | None = None, *, input: bytes | None = None,
              merge_stderr: bool = False, cwd: Path | str | None = None,
              env: Mapping[str, str] | None = None) -> RunResult:  # fmt: skip
    """Run `argv` to its end in a new session. `timeout_s` None: bounded by the caller (a cancellation).
    Raises RunTimeout after `timeout_s`, OSError when the program cannot be started; stdin is /dev/null unless
    `input` is given."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL if input is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE,
        cwd=cwd, env=dict(env) if env is not None else None, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(input), timeout_s)
    except TimeoutError:
        await kill_group(proc)
        raise RunTimeout(argv, timeout_s or 0.0) from None
    except BaseException:  # cancelled: the command must not outlive the task that ran it
        await kill_group(proc)
        raise
    assert proc.returncode is not None
    return RunResult(tuple(argv), proc.returncode, out.decode(errors="replace"),
                     (err or b"").decode(errors="replace"))  # fmt: skip


def run_blocking(argv: Sequence[str], timeout_s: float, *, env: Mapping[str, str] | None = None) -> RunResult:
    """`run` for callers without an event loop (preflight's host facts, read from a worker thread or the CLI),
    under the same rule: its own session, the whole group SIGKILLed on the timeout. Raises RunTimeout, OSError."""
    with subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=dict(env) if env is not None else None, start_new_session=True) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            proc.wait()
            raise RunTimeout(argv, timeout_s) from None
        except BaseException:
            _killpg(proc.pid)
            raise
    return RunResult(tuple(argv), proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

"""Launch, adopt and stop a component inside the node's container, by its host PID.

The engine's `exec` client is only a launcher and the pipe its output reaches the log sink (journald or the log
file) through: the component inside is found by a launch marker in its environment among the container's
processes (`container.container_pids`), then watched with a pidfd, adopted and stopped by its host PID like a
host process. runc makes every exec'd process a session leader, so its session names the whole tree inside,
orphans included. A killed exec client therefore changes nothing but the output (conmon drains it): the
component stays supervised, and the agent says so. Every signal is limited to processes of our container
(`in_container`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from nodeagent.container.engine import container_pids, host_pid, in_container
from nodeagent.container.render import ContainerSpec
from nodeagent.core.errors import AdoptError, LaunchError
from nodeagent.core.process import ExitWatch, ProcessRecord, record_of, verify
from nodeagent.node import launcher
from nodeagent.render.launch import LaunchSpec

LAUNCH_VAR = "DSV4_AGENT_LAUNCH"
"""Set on every exec: the one value that tells the launched process from everything else in the container."""
FIND_POLL_S = 0.01
FIND_TIMEOUT_S = 30.0
CLIENT_CODE_WAIT_S = 2.0


def exec_spec(spec: LaunchSpec, container: ContainerSpec, nonce: str) -> LaunchSpec:
    """The host side of an in-container launch: the engine's exec client runs spec's argv inside, with spec's
    environment on top of the image's (`-e`), its unset variables removed and its cwd (`-w`). The client itself
    keeps spec's environment (the residue scan recognises it as ours) and cwd (created on the host, which the
    container sees at the same path)."""
    env = {**spec.env, LAUNCH_VAR: nonce}
    argv = container.exec_argv(list(spec.argv), env, str(spec.cwd), unset=spec.unset)
    return replace(spec, argv=tuple(argv), env=env)


def find_launched(container_id: str, nonce: str, proc: Path = Path("/proc")) -> int | None:
    """The host PID of the process this launch started: the session leader carrying its marker (its children
    inherit the marker, but not the leadership)."""
    marker = f"{LAUNCH_VAR}={nonce}".encode()
    for pid in container_pids(container_id, proc):
        with contextlib.suppress(OSError, ValueError):
            if marker in (proc / str(pid) / "environ").read_bytes().split(b"\0"):
                sid = int((proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[3])
                if sid == pid:
                    return pid
    return None


class InsideWatch:
    """The component's exit, seen by a pidfd on its host PID; its status from the exec client when the client is
    still attached (the engine reports the status as the client's own, a signal as 128 + N), else unknown."""

    def __init__(self, pid: int, client: subprocess.Popen[bytes] | None,
                 client_lost: Callable[[int], None] | None = None) -> None:  # fmt: skip
        self.loop = asyncio.get_running_loop()
        self.client = client
        self.done: asyncio.Future[int | None] = self.loop.create_future()
        self.inner = ExitWatch(pid, None)
        self.inner.done.add_done_callback(self._inner_done)
        self.outer: ExitWatch | None = None
        self._task: asyncio.Task[None] | None = None
        if client is not None and client_lost is not None:
            self.outer = ExitWatch(client.pid, client)

            def lost(fut: asyncio.Future[int | None]) -> None:
                if not fut.cancelled() and not self.inner.done.done():
                    client_lost(client.pid)

            self.outer.done.add_done_callback(lost)

    def _inner_done(self, fut: asyncio.Future[int | None]) -> None:
        if fut.cancelled():
            return
        client = self.client
        if client is None or (self.outer is not None and self.outer.done.done()):
            self._finish(None)  # no client, or it died before the component: its status says nothing
            return
        self._task = self.loop.create_task(self._client_code(client))

    async def _client_code(self, client: subprocess.Popen[bytes]) -> None:
        code = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = await asyncio.to_thread(client.wait, CLIENT_CODE_WAIT_S)
        self._finish(code if code is not None and code >= 0 else None)

    def _finish(self, code: int | None) -> None:
        if not self.done.done():
            self.done.set_result(code)

    def close(self) -> None:
        self.inner.close()
        if self.outer is not None:
            self.outer.close()
        if not self.done.done():
            self.done.cancel()


async def launch_inside(spec: LaunchSpec, container: ContainerSpec, container_id: str, log_dir: Path,
                        base_env: Mapping[str, str], capture_dir: Path, timeout_s: float, scope: str | None,
                        tail_file: Path | None,
                        ) -> tuple[launcher.Launched, subprocess.Popen[bytes] | None]:  # fmt: skip
    """Start the component inside; (its record by host PID, the exec client still running or None)."""
    nonce = secrets.token_hex(8)
    outer = exec_spec(spec, container, nonce)
    if spec.daemonizes:  # dscli prints the worker's PID in the container's namespace
        launched = await launcher.launch(outer, log_dir, base_env, capture_dir, timeout_s, scope, tail_file,
                                         map_pid=lambda pid: host_pid(container_id, pid))  # fmt: skip
        return launched, None
    launched = await launcher.launch(outer, log_dir, base_env, capture_dir, timeout_s, scope, tail_file)
    client = launched.popen
    assert client is not None
    try:
        pid = await _found(container_id, nonce, client, FIND_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            client.kill()
        raise
    return launcher.Launched(record_of(pid), client, launched.output), client


async def _found(container_id: str, nonce: str, client: subprocess.Popen[bytes], timeout_s: float) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        pid = await asyncio.to_thread(find_launched, container_id, nonce)
        if pid is not None:
            return pid
        if client.poll() is not None:
            raise LaunchError(f"{client.args[0] if isinstance(client.args, list) else 'exec'} exec exited "
                              f"{client.returncode} before its process started (see the component's log)")
        if loop.time() >= deadline:
            raise LaunchError(f"the exec'd process did not appear in the container within {timeout_s:g} s")
        await asyncio.sleep(FIND_POLL_S)


def adopt_inside(record: ProcessRecord, container_id: str) -> None:
    """A recorded process is adopted only if it is still the same one and still in our container."""
    verify(record)
    if not in_container(container_id, record.pid):
        raise AdoptError(f"pid {record.pid} is not a process of container {container_id[:12]}")


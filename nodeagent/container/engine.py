"""The thin shell around the container engine's CLI: inspect, create, start, exec, kill, remove, and a death watch.

Every command runs with a timeout and in its own session (our signals never reach the engine's CLI by
accident). What to do is decided by `nodeagent.container.plan`; this module only carries it out and records
what it made (`container.json` in the agent's state folder: the id, the fingerprint, the setup progress).

The death watch follows the engine's `events` stream and inspects at once on a die/kill/remove event, and also
inspects every `poll_s` (the stream can be absent or lag); both noticed a `podman kill` here well within 5 s
(tests/test_container_engine.py measures them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path

from loguru import logger

from nodeagent.container.plan import (
    DEATH_EVENTS,
    ContainerInspectError,
    ContainerPlan,
    ContainerRecord,
    ContainerState,
    Death,
    DeathWatch,
    SetupStepFailed,
    Step,
    event_status,
    parse_inspect,
    plan_container,
    setup_hash,
    setup_progress,
    setup_todo,
)
from nodeagent.container.render import ContainerSpec
from nodeagent.core.run import RunResult, RunTimeout, kill_group, run
from nodeagent.core.statefile import read_json, write_json_atomic

RECORD_FILE = "container.json"


class EngineError(RuntimeError):
    """An engine command failed or timed out; the message has the command and the engine's own words."""


EngineResult = RunResult


async def run_engine(argv: Sequence[str], timeout_s: float, check: bool = True) -> EngineResult:
    """Run one engine command (`core.run`: its own session; on the timeout and on cancellation the whole process
    group is killed and reaped: a setup step's shell leaves its children behind otherwise, and a cancelled agent
    task must not leave a `podman` running)."""
    try:
        result = await run(argv, timeout_s)
    except RunTimeout:
        raise EngineError(f"{' '.join(argv[:4])} ... timed out after {timeout_s:g} s") from None
    if check and result.returncode != 0:
        raise EngineError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()[-500:]}")
    return result


def _no_such(result: EngineResult) -> bool:
    return "no such" in result.stderr.lower() or result.stdout.strip() == "[]"


class ContainerEngine:
    """One container (`spec`) through its engine's CLI."""

    def __init__(self, spec: ContainerSpec, timeout_s: float = 30.0) -> None:
        self.spec = spec
        self.timeout_s = timeout_s

    async def inspect_text(self) -> str | None:
        """`inspect`'s own JSON (for a post-mortem), or None when there is no such container."""
        result = await run_engine(self.spec.inspect_argv(), self.timeout_s, check=False)
        if result.returncode != 0:
            if _no_such(result):
                return None
            raise EngineError(f"{' '.join(result.argv)} exited {result.returncode}: {result.stderr.strip()[-500:]}")
        return None if result.stdout.strip() == "[]" else result.stdout

    async def inspect(self) -> ContainerState | None:
        """The container, or None when there is none by that name; EngineError when the engine does not answer."""
        text = await self.inspect_text()
        if text is None:
            return None
        try:
            return parse_inspect(text)
        except ContainerInspectError as exc:
            raise EngineError(f"{' '.join(self.spec.inspect_argv())}: {exc}") from None

    async def create(self) -> str:
        """The run line (create and start, detached); the new container's id."""
        result = await run_engine(self.spec.run_argv(), max(self.timeout_s, 120.0))
        return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""

    async def start(self) -> None:
        await run_engine(self.spec.start_argv(), self.timeout_s)

    async def unpause(self) -> None:
        await run_engine(self.spec.unpause_argv(), self.timeout_s)

    async def stop(self, grace_s: float) -> None:
        await run_engine(self.spec.stop_argv(grace_s), grace_s + self.timeout_s)

    async def kill(self, sig: str = "KILL") -> None:
        await run_engine(self.spec.kill_argv(sig), self.timeout_s)

    async def remove(self) -> None:
        await run_engine(self.spec.rm_argv(), max(self.timeout_s, 60.0))

    async def exec(self, argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout_s: float | None = None, check: bool = True) -> EngineResult:
        """Run a short command inside and wait for it (setup steps, probes, kill by in-container pid)."""
        return await run_engine(self.spec.exec_argv(argv, env, cwd), timeout_s or self.timeout_s, check=check)

    async def run_setup(self, steps: Sequence[tuple[int, list[str]]], total: int,
                        done: Callable[[int], None], log: Callable[[str], None],
                        timeout_s: float = 1800.0) -> None:  # fmt: skip
        """Run the numbered setup steps in order; `done(i)` after each success; SetupStepFailed names the one
        that fails. Each step's output goes to `log` line by line."""
        for index, argv in steps:
            log(f"container setup step {index}/{total}: {' '.join(argv)}")
            try:
                result = await self.exec(argv, timeout_s=timeout_s, check=False)
            except EngineError:
                raise SetupStepFailed(index, total, tuple(argv), None) from None
            for line in result.output.splitlines():
                log(line)
            if result.returncode != 0:
                raise SetupStepFailed(index, total, tuple(argv), result.returncode, result.output[-2000:])
            done(index)

    async def events(self, wake: asyncio.Event, statuses: frozenset[str] = DEATH_EVENTS) -> None:
        """Follow the engine's event stream; set `wake` on each event that may mean a death. Returns when the
        stream ends (the caller's poll carries on). A stream, not a command `core.run` waits out: started here, its
        group ended by `kill_group` all the same."""
        proc = await asyncio.create_subprocess_exec(*self.spec.events_argv(), stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        assert proc.stdout is not None
        try:
            async for raw in proc.stdout:
                if event_status(raw.decode(errors="replace")) in statuses:
                    wake.set()
        finally:
            await kill_group(proc)

    async def watch(self, container_id: str, started_at: str | None, poll_s: float = 1.0, use_events: bool = True,
                    unresponsive_after_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                    wake: asyncio.Event | None = None,
                    init_alive: Callable[[], bool] = lambda: False) -> Death:  # fmt: skip
        """Return when the container dies (exited, OOM, removed, replaced, restarted) or the engine stops
        answering for `unresponsive_after_s` while `init_alive()` (the container's init on the host) is not
        seen. Setting `wake` makes it inspect at once (a component inside died)."""
        judge = DeathWatch(container_id, started_at, clock(), unresponsive_after_s)
        wake = wake or asyncio.Event()
        follower = asyncio.create_task(self.events(wake)) if use_events else None
        try:
            while True:
                try:
                    death = judge.observe(clock(), await self.inspect())
                except EngineError as exc:
                    death = judge.engine_failed(clock(), str(exc), init_alive())
                if death is not None:
                    return death
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), poll_s)
        finally:
            if follower is not None:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower


def container_pids(container_id: str, proc: Path = Path("/proc")) -> list[int]:
    """Host PIDs of the processes in the container's cgroup (docker and podman both name it after the id):
    what may be signalled on its behalf, and nothing else."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if container_id in (entry / "cgroup").read_text():
                pids.append(int(entry.name))
    return sorted(pids)


def in_container(container_id: str, pid: int, proc: Path = Path("/proc")) -> bool:
    """Is this host PID a process of the container (its cgroup is named after the id)?"""
    try:
        return bool(container_id) and container_id in (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return False


def host_pid(container_id: str, pid_inside: int, proc: Path = Path("/proc")) -> int | None:
    """The host PID of the container's process that has `pid_inside` in the container's PID namespace."""
    for pid in container_pids(container_id, proc):
        if inner_pid(pid, proc) == pid_inside:
            return pid
    return None


PF_EXITING = 0x4


def init_alive(pid: int | None, proc: Path = Path("/proc")) -> bool:
    """The container's init is alive and not exiting. When it dies the kernel kills every process of its PID
    namespace from the init's exit path (PF_EXITING is already set then), so a component that died with its
    container is recognised synchronously, before the engine has even noticed."""
    if pid is None:
        return False
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] not in ("Z", "X", "x") and not int(fields[6]) & PF_EXITING


def inner_pid(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The PID a host process has inside its own (innermost) PID namespace: `NSpid` in its status."""
    with contextlib.suppress(OSError):
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return None


class RecordStore:
    """What the agent made: `container.json` in its state folder."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / RECORD_FILE

    def load(self) -> ContainerRecord | None:
        data = read_json(self.path, None)
        return ContainerRecord.from_json(data) if isinstance(data, dict) else None

    def save(self, record: ContainerRecord) -> None:
        write_json_atomic(self.path, record.to_json())


async def _create(engine: ContainerEngine) -> None:
    """The run line; when the runtime fails it (exit 126/127), the container is left `created` under our name and
    would be adopted next time as one we did not make, never recreated: remove it. A never-started container has
    no process, so nothing is signalled even were it another's.

    A bind mount's source must exist: the guide's shared folders this host lacks are made first, before every run
    line (docker would create them; podman refuses the line — `statfs /data: no such file or directory`)."""
    for folder in engine.spec.create_on_host:
        with contextlib.suppress(OSError):
            Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        await engine.create()
    except EngineError:
        with contextlib.suppress(EngineError):
            left = await engine.inspect()
            if left is not None and left.status == "created" and left.image == engine.spec.image:
                await engine.remove()
        raise


async def ensure_container(engine: ContainerEngine, setup: Sequence[Sequence[str]], store: RecordStore,
                           log: Callable[[str], None], drain: Callable[[str], Awaitable[None]] | None = None,
                           ) -> tuple[ContainerState, ContainerPlan]:
    """Inspect, decide (`plan_container`) and carry the plan out: the container runs, set up, and is recorded.

    `drain(reason)` stops the stack before a planned recreate. The caller redeploys when `plan.redeploy`.
    Raises SetupStepFailed (the progress so far is recorded) or EngineError.
    """
    spec = engine.spec
    state, record = await engine.inspect(), store.load()
    plan = plan_container(state, record, spec.fingerprint(), spec.image, setup)
    if plan.wait:
        raise EngineError(f"container {spec.name}: {plan.reason}; try again shortly")
    if plan.steps or plan.redeploy:
        logger.info("container {}: {} → {}", spec.name, plan.reason, ", ".join(plan.steps) or "redeploy")
    if plan.drain and drain is not None:
        await drain(plan.reason)
    keep_record = record is not None and state is not None and record.container_id == state.id
    for step in plan.steps:
        if step is Step.REMOVE:
            await engine.remove()
            keep_record = False
        elif step is Step.CREATE:
            await _create(engine)
        elif step is Step.START:
            await engine.start()
        elif step is Step.UNPAUSE:
            await engine.unpause()
    state = await engine.inspect()
    if state is None or not state.running:
        raise EngineError(f"container {spec.name} is not running after {', '.join(plan.steps) or 'inspect'}: "
                          f"{state.describe() if state else 'absent'}")
    current = ContainerRecord(state.id, spec.fingerprint(), setup_hash(setup), state.started_at)
    if keep_record and record is not None:
        current = replace(current, setup_stamp=record.setup_stamp, setup_done=record.setup_done)
    store.save(current)
    if Step.SETUP in plan.steps:
        progress = {"record": current}

        def done(index: int) -> None:
            progress["record"] = setup_progress(progress["record"], state.id, setup, index)
            store.save(progress["record"])

        await engine.run_setup(setup_todo(current, state.id, setup), len(setup), done, log)
    return state, plan

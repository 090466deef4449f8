"""Thin OS shell for process trees: launch in a new session, adopt, watch exits instantly, stop whole trees.

Every child starts in its own session, so its session id names the whole tree — including descendants that
outlive their parent and get re-parented to PID 1 (vLLM's EngineCore after its API server is SIGKILLed, the
datasystem worker after `dscli start` exits). Exits are seen through `os.pidfd_open` registered with the event
loop: immediate for our children and for daemonised processes we never forked alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import psutil
from loguru import logger

from nodeagent.core.errors import AdoptError, LaunchError
from nodeagent.core.proctable import CREATE_TIME_SLACK_S, TABLES, ProcessTable, scan

STOP_TABLE_AGE_S = 0.25
"""A stop starts from a process table at most this old (stops begun together share one pass); a descendant born
in between is still found by the stop's last look, a pass begun after the signals."""


@dataclass(frozen=True)
class ProcessRecord:
    """Enough to find a process again after an agent restart, and to refuse a reused PID."""

    pid: int
    create_time: float
    cmdline: tuple[str, ...]
    sid: int

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "cmdline": list(self.cmdline)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ProcessRecord:
        return cls(
            pid=int(data["pid"]),  # type: ignore[call-overload]  # JSON: an int
            create_time=float(data["create_time"]),  # type: ignore[arg-type]  # JSON: a number
            cmdline=tuple(data["cmdline"]),  # type: ignore[arg-type]  # JSON: a list of strings
            sid=int(data["sid"]),  # type: ignore[call-overload]  # JSON: an int
        )


def record_of(pid: int) -> ProcessRecord:
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return ProcessRecord(pid, proc.create_time(), tuple(proc.cmdline()), os.getsid(pid))
    except (psutil.Error, ProcessLookupError) as exc:
        raise LaunchError(f"process {pid} vanished right after start: {exc}") from None


def verify(record: ProcessRecord) -> psutil.Process:
    """The live process the record describes, or AdoptError saying why not (gone, PID reused, changed)."""
    try:
        proc = psutil.Process(record.pid)
        with proc.oneshot():
            if abs(proc.create_time() - record.create_time) > 0.05:
                raise AdoptError(f"pid {record.pid} was reused by another process")
            if proc.status() == psutil.STATUS_ZOMBIE:
                raise AdoptError(f"pid {record.pid} has exited (zombie)")
            # pid + create_time identify the process (a reused PID has a later create time); the cmdline
            # may legitimately differ from the one recorded at spawn: launchers (systemd-run --scope, the
            # venv's console scripts) exec the real program afterwards. It must still be a live program.
            if not proc.cmdline():
                raise AdoptError(f"pid {record.pid} has no command line (kernel thread or exiting)")
        return proc
    except psutil.NoSuchProcess:
        raise AdoptError(f"pid {record.pid} is gone") from None
    except psutil.AccessDenied as exc:
        raise AdoptError(f"pid {record.pid}: {exc}") from None


def spawn(argv: list[str], env: dict[str, str], cwd: str, output_fd: int) -> subprocess.Popen[bytes]:
    """Start a child in its own session; output to a file or journald stream, never a pipe we own."""
    try:
        return subprocess.Popen(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=output_fd, stderr=output_fd,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]}: command not found (PATH={env.get('PATH', '')})") from None
    except PermissionError:
        raise LaunchError(f"{argv[0]}: permission denied") from None
    except OSError as exc:
        raise LaunchError(f"{argv[0]}: cannot start: {exc}") from None


class ExitWatch:
    """Resolves when a process exits, via a pidfd on the event loop; works for non-children too."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.popen = popen
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[int | None] = self.loop.create_future()
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self.fd = None
            self._finish()
            return
        self.loop.add_reader(self.fd, self._finish)

    def _finish(self) -> None:
        if self.fd is not None:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = None
        code: int | None = None
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.popen.wait(timeout=1)
        if not self.done.done():
            self.done.set_result(code)

    def close(self) -> None:
        if self.fd is not None:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = None
        if not self.done.done():
            self.done.cancel()


def tree_of(record: ProcessRecord, member: Callable[[int], bool] | None = None,
            table: ProcessTable | None = None) -> list[psutil.Process]:  # fmt: skip
    """The main process (if it is still the recorded one), its descendants and its session (`ProcessTable.tree`);
    with `member`, only the processes it accepts (a component inside a container: the container's own).

    From `table` when given (on the event loop: `proctable.TABLES.get()` took it in a thread), else from a pass
    over /proc now (blocking: off the loop only). A PID reused since the table was taken is left out."""
    table = table if table is not None else scan()
    procs = []
    for pid in table.tree(record):
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if abs(proc.create_time() - table.procs[pid].create_time) <= CREATE_TIME_SLACK_S:
                procs.append(proc)
    return [p for p in procs if member is None or member(p.pid)]


def _signal(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def _alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


async def _wait_gone(procs: list[psutil.Process], deadline: float) -> list[psutil.Process]:
    """Poll fast at first (most trees are gone within tens of ms), then back off to spare the CPU."""
    started = time.monotonic()
    while True:
        procs = _alive(procs)
        if not procs or time.monotonic() >= deadline:
            return procs
        await asyncio.sleep(0.002 if time.monotonic() - started < 0.25 else 0.02)


async def stop_tree(record: ProcessRecord, grace_s: float, what: str = "",
                    member: Callable[[int], bool] | None = None) -> dict[str, object]:  # fmt: skip
    """SIGTERM the main process, then every remembered descendant, then SIGKILL what is left.

    Descendants are remembered *before* signalling: once vLLM's API server is gone its EngineCore is no
    longer its child. `member` limits every signal to the processes it accepts. Returns what happened, for the
    event log.
    """
    started = time.monotonic()
    tree = tree_of(record, member, await TABLES.get(STOP_TABLE_AGE_S))
    if not tree:
        return {"signalled": 0, "killed": 0, "survivors": 0, "elapsed_s": 0.0, "tree": []}
    seen = [_describe(p) for p in tree]
    main = [p for p in tree if p.pid == record.pid]
    rest = [p for p in tree if p.pid != record.pid]
    deadline = started + grace_s
    # SIGCONT after SIGTERM, as systemd does: a stopped (hung, SIGSTOPped) process could not act on SIGTERM
    # and would burn the whole grace period.
    _signal(main or rest, signal.SIGTERM)
    _signal(main or rest, signal.SIGCONT)
    await _wait_gone(main or rest, deadline)
    left = _alive(rest)
    if left:
        _signal(left, signal.SIGTERM)
        _signal(left, signal.SIGCONT)
        await _wait_gone(left, max(deadline, time.monotonic() + min(5.0, grace_s)))
    late = {p.pid: p for p in _alive(tree)}
    for proc in tree_of(record, member, await TABLES.get(0)):  # descendants born during the stop
        late.setdefault(proc.pid, proc)
    killed = list(late.values())
    if killed:
        logger.bind(event="stop").warning(
            f"{what}: SIGKILL {len(killed)} process(es) still alive after {grace_s:.0f}s grace: "
            + ", ".join(f"{p.pid}" for p in killed)
        )
        _signal(killed, signal.SIGKILL)
        survivors = len(await _wait_gone(killed, time.monotonic() + 10))
    else:
        survivors = 0
    return {"signalled": len(tree), "killed": len(killed), "survivors": survivors,
            "elapsed_s": round(time.monotonic() - started, 3), "tree": seen}


def _describe(proc: psutil.Process) -> dict[str, object]:
    """A process as it was before the stop (for a failure's post-mortem)."""
    info: dict[str, object] = {"pid": proc.pid}
    with contextlib.suppress(psutil.Error), proc.oneshot():
        info.update(ppid=proc.ppid(), status=proc.status(), cmdline=" ".join(proc.cmdline())[:300],
                    rss_bytes=proc.memory_info().rss)  # fmt: skip
    return info


_DSCLI_PID = re.compile(r"Starting worker service with PID: (\d+)|success, PID: (\d+)")


def parse_dscli_pid(output: str) -> int | None:
    """The worker PID `dscli start` prints (first on launch, again on success)."""
    pid = None
    for match in _DSCLI_PID.finditer(output):
        pid = int(match.group(1) or match.group(2))
    return pid


def find_datasystem_worker(pid: int, address: str) -> ProcessRecord:
    """Check that `pid` is the datasystem_worker serving `address` (exact match, not dscli's loose one)."""
    record = record_of(pid)
    if not any(os.path.basename(a) == "datasystem_worker" for a in record.cmdline[:1]):
        shown = " ".join(record.cmdline)[:200]
        raise LaunchError(f"pid {pid} from dscli is not a datasystem_worker: {shown}")
    if f"--worker_address={address}" not in record.cmdline:
        raise LaunchError(f"pid {pid} serves another address than {address}")
    return record

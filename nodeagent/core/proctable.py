"""One table of the host's processes, read in a thread and shared: the event loop never walks `/proc` itself.

A full pass over `/proc` costs tens of milliseconds on a host with a few hundred processes (more under load), and
the agent needed one for every process stop (twice), every NPU poll (the foreign-process check) and every
`/metrics` scrape — each on the event loop, where it stalled every probe, watch and API request meanwhile.
`ProcessTables.get` takes the pass (the fields of /proc/PID/stat) with `asyncio.to_thread` and shares it:
callers within `max_age_s` get the same table, concurrent callers wait on the same pass. `ProcessTable.tree` is
the one definition of a component's process tree (`process.tree_of`, `metrics.tree_usage` and
`npu_monitor.our_pids` read it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import psutil

CREATE_TIME_SLACK_S = 0.05
"""A recorded create_time matches a live one within this (psutil rounds it from clock ticks)."""


class Recorded(Protocol):
    """What a tree is found from (`process.ProcessRecord` is it; not imported: process.py imports this module)."""

    @property
    def pid(self) -> int: ...

    @property
    def create_time(self) -> float: ...

    @property
    def sid(self) -> int: ...


@dataclass(frozen=True)
class ProcInfo:
    """What the pass reads of every process: /proc/PID/stat's fields (one read each). Not the command line: a
    second read per process, and only a record's main process needs it (`ProcessTable.tree` reads that one)."""

    pid: int
    ppid: int
    create_time: float
    status: str
    sid: int

    @property
    def zombie(self) -> bool:
        return self.status == psutil.STATUS_ZOMBIE


@dataclass
class ProcessTable:
    """The processes as one pass over `/proc` saw them; `taken_at` is the monotonic time the pass began."""

    procs: dict[int, ProcInfo]
    taken_at: float
    own_sid: int = field(default_factory=lambda: os.getsid(0))
    children: dict[int, list[int]] = field(init=False)
    by_sid: dict[int, list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.children = defaultdict(list)
        self.by_sid = defaultdict(list)
        for info in self.procs.values():
            self.children[info.ppid].append(info.pid)
            self.by_sid[info.sid].append(info.pid)

    def matches(self, record: Recorded) -> ProcInfo | None:
        """The recorded process if it is still the one recorded (same create_time), else None."""
        info = self.procs.get(record.pid)
        if info is None or abs(info.create_time - record.create_time) > CREATE_TIME_SLACK_S:
            return None
        return info

    def tree(self, record: Recorded) -> list[int]:
        """The PIDs of a record's tree: the main process if it is still the recorded one and a live program, its
        descendants, and every live member of its session (descendants re-parented to PID 1 stay in it)."""
        found: dict[int, None] = {}
        main = self.matches(record)
        if main is not None and not main.zombie and has_cmdline(main.pid):
            stack = [main.pid]
            while stack:
                pid = stack.pop()
                if pid not in found:
                    found[pid] = None
                    stack.extend(self.children.get(pid, ()))
        if record.sid > 1 and record.sid != self.own_sid:
            for pid in self.by_sid.get(record.sid, ()):
                if not self.procs[pid].zombie:
                    found.setdefault(pid, None)
        return list(found)


def has_cmdline(pid: int) -> bool:
    """A live program, not a kernel thread or a process exiting (`process.verify`'s test)."""
    try:
        return bool(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


_STATUS = {"R": psutil.STATUS_RUNNING, "S": psutil.STATUS_SLEEPING, "D": psutil.STATUS_DISK_SLEEP,
           "T": psutil.STATUS_STOPPED, "t": psutil.STATUS_TRACING_STOP, "Z": psutil.STATUS_ZOMBIE,
           "X": psutil.STATUS_DEAD, "x": psutil.STATUS_DEAD, "I": psutil.STATUS_IDLE}  # fmt: skip
"""/proc/PID/stat's state letters as psutil names them (what `ProcInfo.status` holds)."""
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_stat(pid: int, data: bytes, boot_time: float) -> ProcInfo:
    """One /proc/PID/stat line → its fields, create_time as psutil computes it (start ticks / CLK_TCK + boot time,
    so a `ProcessRecord` taken through psutil matches it exactly). The command name may hold spaces and ')'."""
    fields = data[data.rindex(b")") + 2:].split()
    state = fields[0].decode()
    return ProcInfo(pid, int(fields[1]), int(fields[19]) / _CLOCK_TICKS + boot_time, _STATUS.get(state, state),
                    int(fields[3]))  # fmt: skip


def scan(clock: Callable[[], float] = time.monotonic, proc: str = "/proc") -> ProcessTable:
    """One pass over `/proc` (blocking: call it in a thread): one read of /proc/PID/stat per process. Read
    directly: psutil's per-process objects cost 4-8 times as much for the same fields (measured here: 84 ms
    against 350-700 ms for 430 processes at load 10), all of it GIL time taken from the event loop."""
    began = clock()
    boot_time = psutil.boot_time()
    procs: dict[int, ProcInfo] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # gone since the listing
            continue
        with contextlib.suppress(ValueError, IndexError):
            procs[int(name)] = parse_stat(int(name), data, boot_time)
    return ProcessTable(procs, began)


class ProcessTables:
    """The shared table: `get(max_age_s)` answers from the last pass when it is young enough, else from a new pass
    in a thread that every caller meanwhile shares."""

    def __init__(self, max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 scanner: Callable[[], ProcessTable] | None = None) -> None:  # fmt: skip
        self.max_age_s = max_age_s
        self.clock = clock
        self.scanner = scanner or (lambda: scan(clock))
        self.latest: ProcessTable | None = None
        self.scans = 0
        self._inflight: asyncio.Future[ProcessTable] | None = None
        self._inflight_began = 0.0

    async def get(self, max_age_s: float | None = None) -> ProcessTable:
        """A table whose pass began at most `max_age_s` (default: the set's) before this call; 0 = a pass begun
        after it (a stop's last look for descendants born meanwhile)."""
        oldest = self.clock() - (self.max_age_s if max_age_s is None else max_age_s)
        if self.latest is not None and self.latest.taken_at >= oldest:
            return self.latest
        loop = asyncio.get_running_loop()
        task = self._inflight
        if task is None or task.done() or task.get_loop() is not loop or self._inflight_began < oldest:
            self._inflight_began = self.clock()
            task = self._inflight = asyncio.ensure_future(self._scan())
        return await asyncio.shield(task)

    async def _scan(self) -> ProcessTable:
        table = await asyncio.to_thread(self.scanner)
        self.scans += 1
        if self.latest is None or table.taken_at >= self.latest.taken_at:
            self.latest = table
        return table


TABLES = ProcessTables()
"""The agent's one shared table (process stops, the NPU monitor, the metrics)."""

"""Warm this node's weight shards in the page cache (issue 32 item 3): the agent reads them after it starts and
while a local vLLM rank is not serving (its old tree stopping, the gang's barrier wait, its load), so the next load
reads RAM instead of disk. What to read is `vllm.warm_plan`'s (pure); this module is the thin shell around it:

- residency: mincore(2) over a read-only mapping of each shard, via ctypes (no page is touched by asking);
- the reader: one thread at nice 19 and the idle IO class, chunks of `CHUNK` already resident skipped, the
  rate bounded (`recovery.warm_weights.rate_mb_s`), at most the plan's budget of new bytes, stopped as soon as
  MemAvailable falls under the worker's shared memory and the margin (a serving rank never loses to it);
- `WeightWarmer`, a reporting `NodeLayer`: `weights` in /status, the resident bytes on /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import mmap
import os
import platform
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.core.states import SERVING_STATES, Desired
from nodeagent.layers.worker_headroom import meminfo, read_meminfo
from nodeagent.render.launch import render_vllm_argv
from nodeagent.seam.stackport import ReportLayer
from nodeagent.vllm.warm_plan import Shard, WarmAction, WarmPlan, host_path, models_by_folder, plan_warm
from nodeagent.vllm.weights import shard_names

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.seam.stackport import StackPort

CHUNK = 8 << 20
WINDOW = 1 << 30
"""mincore is asked per window of a shard: a 1 GiB window's vector is 256 KiB."""
PAGE = mmap.PAGESIZE
REFRESH_S = 60.0
"""How often the residency is measured again when nothing happens (the page cache changes under us)."""
MEASURE_DUTY = 50
"""…but no more often than every 50 times a measurement's own length: mincore walks the page cache, 55-90 ms per
resident GB on this (loaded) host, so 300 GB of shards take seconds — at most 2 % of a core."""
MIN_PASS_GAP_S = 5.0
"""Passes no closer than this while a rank is not serving (node changes come in bursts)."""
IOPRIO_CLASS_IDLE = 3
IOPRIO_WHO_PROCESS = 1
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_ONE_BIT = bytes(b & 1 for b in range(256))

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_range(fd: int, offset: int, length: int) -> int:
    """Bytes of [offset, offset+length) of an open file in the page cache (`offset` page-aligned)."""
    if length <= 0:
        return 0
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    try:
        pages = (length + PAGE - 1) // PAGE
        vec = ctypes.create_string_buffer(pages)
        if _libc.mincore(addr, length, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        count = vec.raw[:pages].translate(_ONE_BIT).count(1)
    finally:
        _libc.munmap(addr, length)
    return min(length, count * PAGE)


def resident_bytes(path: Path) -> tuple[int, int]:
    """(size, bytes of it in the page cache) of one file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return size, sum(resident_range(f.fileno(), off, min(WINDOW, size - off)) for off in range(0, size, WINDOW))


def lower_priority() -> None:
    """This thread only: nice 19 and the idle IO class (it reads only when the disk is otherwise idle)."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    number = _IOPRIO_SET.get(platform.machine())
    if number is not None:
        _libc.syscall(number, IOPRIO_WHO_PROCESS, tid, IOPRIO_CLASS_IDLE << 13)


@dataclass
class ReadResult:
    read: int = 0
    """New bytes brought into the page cache (chunks found resident are skipped)."""
    stopped: str | None = None
    """Why the pass ended early (memory, cancelled); None: it read what it was given."""


def read_warm(files: Iterable[Path], budget: int, rate_bps: float, memory_ok: Callable[[], str | None],
              cancel: threading.Event, clock: Callable[[], float] = time.monotonic,
              progress: Callable[[int], None] | None = None) -> ReadResult:  # fmt: skip
    """Read `files` in order into the page cache: at most `budget` new bytes at `rate_bps`; `memory_ok` says why
    to stop (None: go on), asked before every chunk."""
    out, start, buf = ReadResult(), clock(), bytearray(CHUNK)
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            logger.warning(f"warm weights: {path}: {exc.strerror or exc}")
            continue
        try:
            # No readahead: pages it brought in beside a chunk would be skipped as resident, uncounted by the
            # budget and the rate (measured: every other 8 MB chunk); 8 MB reads are large enough alone.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            size = os.fstat(fd).st_size
            for off in range(0, size, CHUNK):
                if out.read >= budget:
                    return out
                if cancel.is_set():
                    out.stopped = "cancelled"
                    return out
                if (why := memory_ok()) is not None:
                    out.stopped = why
                    return out
                length = min(CHUNK, size - off)
                new = length - resident_range(fd, off, length)
                if new <= 0:
                    continue
                os.preadv(fd, [memoryview(buf)[:length]], off)
                out.read += new
                if progress is not None:
                    progress(out.read)
                ahead = out.read / rate_bps - (clock() - start)
                if ahead > 0:
                    cancel.wait(ahead)
        finally:
            os.close(fd)
    return out


@dataclass
class ModelShards:
    model: str
    components: list[str]
    shards: list[Shard]
    problem: str | None = None


class WeightWarmer(ReportLayer):
    """The reporting `NodeLayer`: passes when the agent starts and while a local vLLM rank is not serving."""

    def __init__(self, port: StackPort, read_mem: Callable[[], str] = read_meminfo,
                 clock: Callable[[], float] = time.monotonic,
                 read_proc_status: Callable[[int], str] = lambda pid: Path(f"/proc/{pid}/status").read_text()) -> None:
        self.port = port
        self._read_mem = read_mem
        self._read_proc_status = read_proc_status
        self._clock = clock
        self._wake = asyncio.Event()
        self._cancel = threading.Event()
        self.models: list[ModelShards] = []
        self.plan: WarmPlan | None = None
        self.state = "idle"
        self.read_bytes = 0
        """Bytes the warmer read into the page cache since the agent started (all passes)."""
        self.last_pass: dict[str, Any] = {}
        self.measured_at: float | None = None
        self._measured_mono: float | None = None
        self._measure_s = 0.0
        self._last_pass_at: float | None = None
        self._was_wanted = False
        self._pending = False
        """A rank left serving since the last pass: pass as soon as MIN_PASS_GAP_S allows."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="warm-weights")
        """Its own thread: `lower_priority` stays with it, never with the loop's shared executor."""

    @property
    def config(self) -> Config:
        return self.port.config

    def _shared_memory(self) -> int:
        """The workers' shared memory not yet in use: their pool fills as it is used, and what a running worker
        touched (its RssShmem) is already out of MemAvailable — counted again, a full 500 GB pool would leave the
        shards no room on a host that has it."""
        view = self.port.snapshot().components
        total = 0
        for name, c in self.config.active_components().items():
            if c.kind != "datasystem":
                continue
            pid = getattr(view.get(name), "pid", None)
            used = 0
            if pid is not None:
                with contextlib.suppress(OSError, ValueError):
                    used = meminfo(self._read_proc_status(pid)).get("RssShmem", 0) * 1024
            total += max(0, (c.shared_memory_size_mb << 20) - used)
        return total

    def memory_room(self) -> tuple[int, int, int]:
        """(MemAvailable, the workers' shared memory, the margin) in bytes, now."""
        available = meminfo(self._read_mem()).get("MemAvailable", 0) * 1024
        return available, self._shared_memory(), self.config.recovery.warm_weights.margin_mb << 20

    def memory_ok(self) -> str | None:
        available, shm, margin = self.memory_room()
        if available < shm + margin:
            return (f"MemAvailable {available >> 20} MB fell under the worker's {shm >> 20} MB shared memory and "
                    f"the {margin >> 20} MB margin")  # fmt: skip
        return None

    def measure(self) -> None:
        """Each local model's shards and how much of them is resident (in a thread: reads the disk's metadata)."""
        started = self._clock()
        argvs = {n: render_vllm_argv(c) for n, c in self.config.active_components().items() if c.kind == "vllm"}
        models = []
        volumes = self._container_volumes()
        for model, names in models_by_folder(argvs).items():
            entry = ModelShards(model, names, [])
            inside = volumes is not None and any(self.config.active_components()[n].container for n in names)
            mapped = host_path(volumes or (), model) if inside else Path(model).expanduser()
            if mapped is None:
                entry.problem = "no host folder is mounted there in the container's run line"
                models.append(entry)
                continue
            folder = mapped
            if not folder.is_dir():
                entry.problem = (f"{folder} is not a folder on this host" if inside else
                                 "not a folder on this host (a hub id, or not mounted here)")  # fmt: skip
                models.append(entry)
                continue
            try:
                for name in shard_names(folder):
                    size, resident = resident_bytes(folder / name)
                    entry.shards.append(Shard(folder / name, size, resident))
            except (OSError, ValueError) as exc:
                entry.problem = f"shards unreadable: {exc}"
            models.append(entry)
        self.models = models
        self.measured_at = time.time()
        self._measured_mono = self._clock()
        self._measure_s = self._measured_mono - started

    def _container_volumes(self) -> list[str] | None:
        """The `-v` values of the node's container's run line (container mode), None without a container: a rank
        inside reads its model where the container sees it, the host where the mount's source is."""
        if self.config.container is None:
            return None
        from nodeagent.container.render import render_container

        options = render_container(self.config).options
        return [o.value for o in options if o.canonical == "--volume" and o.value]

    def _measure_due(self) -> bool:
        last = self._measured_mono
        return last is None or self._clock() - last >= max(REFRESH_S, MEASURE_DUTY * self._measure_s)

    def pass_once(self) -> None:
        """Measure, plan, read, measure again: one warm pass (in a thread)."""
        settings = self.config.recovery.warm_weights
        self._last_pass_at = self._clock()
        self.measure()
        shards = [s for m in self.models for s in m.shards]
        self.plan = plan_warm(shards, *self.memory_room())
        if self.plan.action not in (WarmAction.ALL, WarmAction.PREFIX):
            self.state = "idle"
            return
        self.state = "reading"
        started, before = self._clock(), self.read_bytes
        lower_priority()  # the layer's own thread (`_thread`)
        result = read_warm(self.plan.files, self.plan.budget, settings.rate_mb_s * 1e6, self.memory_ok,
                           self._cancel, self._clock, lambda n: setattr(self, "read_bytes", before + n))  # fmt: skip
        took = self._clock() - started
        self.last_pass = {"read_bytes": result.read, "seconds": round(took, 3), "stopped": result.stopped,
                          "mb_s": round(result.read / 1e6 / took, 1) if took > 0 else None}  # fmt: skip
        self.state = "idle"
        if result.stopped == "cancelled":
            return
        if result.stopped:
            self.port.emit("weights_warm", f"warming weights stopped after {result.read >> 20} MB: {result.stopped}")
        self.measure()

    def wanted(self) -> bool:
        """A local vLLM rank meant to run is not serving: stopping, waiting at a barrier, loading."""
        view = self.port.snapshot().components
        return any(c.kind == "vllm" and c.desired == Desired.RUNNING and c.state not in SERVING_STATES
                   for c in view.values())  # fmt: skip

    def next_work(self) -> Callable[[], None] | None:
        """What the loop does now: a pass at the start and as soon as a rank leaves serving (`_pending`: no closer
        than MIN_PASS_GAP_S to the last); while ranks stay down (a load is 30-60 min) a pass only when a measurement
        is due — each pass measures, and mincore over 300 GB takes seconds; otherwise a measurement when due."""
        wanted = self.wanted()
        if wanted and not self._was_wanted:
            self._pending = True
        self._was_wanted = wanted
        gap_ok = self._last_pass_at is None or self._clock() - self._last_pass_at >= MIN_PASS_GAP_S
        if self._last_pass_at is None or (wanted and ((self._pending and gap_ok) or self._measure_due())):
            self._pending = False
            return self.pass_once
        return self.measure if self._measure_due() else None

    async def run(self) -> None:
        while not self._cancel.is_set():
            self._wake.clear()
            if self.config.recovery.warm_weights.enabled:
                try:
                    work = self.next_work()
                    if work is not None:
                        await asyncio.get_running_loop().run_in_executor(self._thread, work)
                except Exception as exc:  # a pass must never end the loop: the next one tries again
                    self.state = "idle"
                    logger.warning(f"warm weights: {type(exc).__name__}: {exc}")
            else:
                self.state = "off"
            wait = MIN_PASS_GAP_S if self._pending else max(REFRESH_S, MEASURE_DUTY * self._measure_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    def close(self) -> None:
        """Stop a pass under way at its next chunk, and the loop."""
        self._cancel.set()
        self._wake.set()
        self._thread.shutdown(wait=False)

    def on_node_change(self) -> None:
        self._wake.set()

    def resident(self) -> tuple[dict[str, tuple[int, int]], int, int]:
        """({component: (bytes, resident)}, the node's shard bytes, resident) as last measured."""
        per: dict[str, tuple[int, int]] = {}
        total = resident = 0
        seen: set[Path] = set()
        for m in self.models:
            size = sum(s.size for s in m.shards)
            res = sum(s.resident for s in m.shards)
            for name in m.components:
                per[name] = (size, res)
            for s in m.shards:
                if s.path not in seen:
                    seen.add(s.path)
                    total += s.size
                    resident += s.resident
        return per, total, resident

    def status_section(self) -> dict[str, Any]:
        per, total, resident = self.resident()
        settings = self.config.recovery.warm_weights
        return {"weights": {
            "state": self.state if settings.enabled else "off",
            "total_bytes": total, "resident_bytes": resident, "read_bytes": self.read_bytes,
            "plan": self.plan.reason if self.plan else None, "last_pass": self.last_pass or None,
            "measured_at": self.measured_at, "rate_mb_s": settings.rate_mb_s,
            "models": [{"model": m.model, "components": m.components, "shards": len(m.shards),
                        "total_bytes": per.get(m.components[0], (0, 0))[0],
                        "resident_bytes": per.get(m.components[0], (0, 0))[1], "problem": m.problem}
                       for m in self.models],
            "components": {n: {"total_bytes": b, "resident_bytes": r} for n, (b, r) in per.items()},
        }}  # fmt: skip

"""A datasystem worker killed with -9 keeps its shared memory while clients map it (openYuanrong FAQ §3): the
vLLM ranks' clients still map the dead worker's segments, so a new worker started at once allocates its whole
pool again beside them — with huge pages (`enable_huge_tlb`, RH2D) that can run out. On a worker crash this layer
checks the headroom; when it is short the worker restarts with the local vLLM ranks, as one step: the ranks stop
(their mappings go), the worker waits for that (`memory_headroom` hold), then starts, then the ranks (their
dependency). With headroom the worker restarts alone, as before (its clients reconnect by themselves).

`headroom` is pure over /proc/meminfo's text; `WorkerHeadroom` is the `NodeLayer`, reading the node only
through its port.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nodeagent.seam.stackport import ComponentView, Delegated, Hold, HoldKind, MemberReport

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.core.failure import Failure
    from nodeagent.seam.stackport import StackPort


@dataclass(frozen=True)
class Headroom:
    short: bool
    detail: str


def meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo → {key: value} (kB for sizes, a count for HugePages_*)."""
    out = {}
    for line in text.splitlines():
        if m := re.match(r"(\w+):\s+(\d+)", line):
            out[m[1]] = int(m[2])
    return out


def headroom(text: str, shm_mb: int, huge_pages: bool, margin_mb: int) -> Headroom:
    """With huge pages: the free huge pages must hold the new worker's whole pool plus the margin (the dead one's
    pages stay taken while mapped). Without: the pool is filled as it is used, so only MemAvailable below the
    margin is short."""
    info = meminfo(text)
    if huge_pages:
        size_kb = info.get("Hugepagesize", 2048)
        free_mb = info.get("HugePages_Free", 0) * size_kb // 1024
        need = shm_mb + margin_mb
        return Headroom(free_mb < need, f"{free_mb} MB of huge pages free, the new worker needs {shm_mb} MB "
                        f"+ {margin_mb} MB")  # fmt: skip
    available = info.get("MemAvailable", 0) // 1024
    return Headroom(available < margin_mb, f"{available} MB available (the pool fills as used; margin {margin_mb} MB)")


def read_meminfo() -> str:
    with open("/proc/meminfo") as f:
        return f.read()


class WorkerHeadroom:
    """The `NodeLayer`: decides on a datasystem worker's failure, holds its start until the ranks let go."""

    def __init__(self, config: Config, port: StackPort, read: Callable[[], str] = read_meminfo) -> None:
        self.port = port
        self._read = read
        self.waiting: dict[str, tuple[str, ...]] = {}
        """worker → the vLLM ranks it waits for (they still map the dead worker's segments)."""

    @property
    def config(self) -> Config:
        """The node's config now, through the port: a reload reaches it (`stackport.StackPort.config`)."""
        return self.port.config

    def _dependents(self, worker: str) -> list[str]:
        return [n for n, c in self.config.active_components().items() if c.kind == "vllm" and worker in c.depends_on]

    def decide(self, comp: ComponentView, failure: Failure) -> Delegated | None:
        if comp.kind != "datasystem" or failure.permanent:
            return None
        cfg = self.config.active_components()[comp.name]
        huge = bool(getattr(cfg, "enable_huge_tlb", None) or getattr(cfg, "remote_h2d_device_ids", None))
        try:
            room = headroom(self._read(), cfg.shared_memory_size_mb, huge,
                            self.config.recovery.worker_headroom_margin_mb)  # fmt: skip
        except OSError as exc:
            room = Headroom(True, f"/proc/meminfo unreadable ({exc.strerror or exc}): assumed short")
        here = self.port.snapshot().components
        ranks = tuple(n for n in self._dependents(comp.name) if n in here and here[n].running)
        if not room.short or not ranks:
            if ranks:
                self.port.emit("worker_headroom", f"{room.detail}: the worker restarts alone", comp.name)
            return None
        self.waiting[comp.name] = ranks
        self.port.restart(list(ranks), f"{comp.name} died keeping its shared memory mapped ({room.detail})",
                          planned=False, cause="dependency")  # fmt: skip
        self.port.wake()
        return Delegated(f"memory headroom short ({room.detail}): the worker restarts with {', '.join(ranks)} as one "
                         "step (they stop first, releasing the dead worker's shared memory)")

    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        ranks = self.waiting.get(comp.name)
        if not ranks:
            return None
        here = self.port.snapshot().components
        still = [n for n in ranks if here[n].running]
        if not still:
            del self.waiting[comp.name]
            return None
        return Hold(HoldKind.MEMORY_HEADROOM, f"waiting for {', '.join(still)} to stop: they still map the dead "
                    "worker's shared memory", data={"waiting": still})  # fmt: skip

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> None:
        return None

    def status_section(self) -> dict[str, Any]:
        return {}

    def member_report(self) -> MemberReport | None:
        return None

    def on_node_change(self) -> None:
        if self.waiting:
            self.port.wake()

"""vLLM 0.32's fault-tolerance API for the process-less cluster tests: the `ft_rung.FtClient` of every agent of a
`cluster_fakes.World`, over the fake stacks' vLLM ranks, on the virtual clock.

It behaves as the wheel does (docs/architecture.md, "vLLM fault tolerance"), as `standin/vllm_standin/
fault_tolerance.py` does for the system tests: a rank answers its status only while its process is up (a new
process starts `healthy`); a fault makes the faulty rank and every peer of its group `unhealthy` (its peers' next
all2all times out); `retry` on a rank that is not `unhealthy` is refused (its status keeps the error under the
request id); a retry completes when every rank of the group was told, and then all are `healthy`; an engine
left `unhealthy` for `engine_recovery_timeout_s` dies (its process exits). A rank whose process dies faults its
peers. Fault modes: `transient`, `retry_fails`, `retry_hangs`, `dead` (the executor failed: `dead`, no retry).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nodeagent.config.model import VllmComponent
from nodeagent.core.bindaddr import connect_host, url_host
from nodeagent.vllm.ft_client import FtNotServed, FtUnreachable
from nodeagent.vllm.ft_rules import RankStatus

if TYPE_CHECKING:
    from cluster_fakes import FakeStack, World

_IDS = itertools.count(1)


@dataclass
class FakeRank:
    stack: FakeStack
    component: str
    rank: int
    group: str
    recovery_timeout_s: float
    pid: int | None = None
    state: str = "healthy"
    fault_info: str | None = None
    ft_error: str | None = None
    last_id: str | None = None
    mode: str = "none"
    joined: bool = False
    faults: int = 0


@dataclass
class FakeFtApi:
    world: World
    routes: bool = True
    """False: a vLLM without the fault-tolerance routes (every status and apply is a 404)."""
    calls: list[tuple[str, str]] = field(default_factory=list)
    """Every call: (status | retry, component)."""
    ranks: dict[str, FakeRank] = field(default_factory=dict)
    tasks: set[asyncio.Future[None]] = field(default_factory=set)

    def _load(self) -> None:
        if not self.ranks:
            for stack in self.world.stacks.values():
                for name, cfg in stack.config.active_components().items():
                    if isinstance(cfg, VllmComponent) and cfg.data_parallel_rank is not None:
                        key = f"http://{url_host(connect_host(cfg.host))}:{cfg.port}"
                        self.ranks[key] = FakeRank(stack, name, cfg.data_parallel_rank, str(cfg.group),
                                                   float(cfg.fault_tolerance.engine_recovery_timeout_s))  # fmt: skip

    def _by_url(self, url: str) -> FakeRank:
        self._load()
        rank = self.ranks[url]
        comp = rank.stack.components[rank.component]
        if not comp.up:
            raise FtUnreachable(f"GET {url}/fault_tolerance/status: ClientConnectorError: connection refused")
        if not self.routes:
            raise FtNotServed(f"{url}/fault_tolerance/status: 404 Not Found")
        if rank.pid != comp.pid:  # a new process: a new engine
            rank.pid, rank.state, rank.fault_info, rank.ft_error, rank.last_id = comp.pid, "healthy", None, None, None
            rank.mode, rank.joined = "none", False
        return rank

    def rank_of(self, component: str) -> FakeRank:
        self._load()
        return next(r for r in self.ranks.values() if r.component == component)

    def peers(self, rank: FakeRank) -> list[FakeRank]:
        return [r for r in self.ranks.values() if r.group == rank.group]

    # ---- FtClient ---------------------------------------------------------------------------------------------
    async def status(self, url: str) -> list[RankStatus]:
        rank = self._by_url(url)
        self.calls.append(("status", rank.component))
        self._peer_gone(rank)
        return [RankStatus(rank.rank, rank.state, rank.fault_info if rank.state == "unhealthy" else None,  # type: ignore[arg-type]
                           rank.ft_error, rank.last_id if rank.ft_error else None)]  # fmt: skip

    async def retry(self, url: str, timeout_s: float) -> str:
        rank = self._by_url(url)
        self.calls.append(("retry", rank.component))
        request_id = f"req-{next(_IDS)}"
        if rank.state != "unhealthy":
            rank.ft_error = f"[FT] Rejecting retry on engine {rank.rank}: status is {rank.state.upper()}"
            rank.last_id = request_id
            return request_id
        if rank.mode == "retry_fails":
            rank.ft_error, rank.last_id = "RuntimeError: the all2all buffers could not be cleaned", request_id
            for peer in self.peers(rank):
                if peer is not rank and peer.joined:
                    peer.ft_error, peer.joined = "RuntimeError: a peer's retry failed", False
            return request_id
        if rank.mode == "retry_hangs":
            return request_id
        rank.joined, rank.last_id = True, request_id
        group = self.peers(rank)
        if all(p.joined for p in group):
            for p in group:
                p.state, p.fault_info, p.ft_error, p.joined, p.mode = "healthy", None, None, False, "none"
        return request_id

    async def close(self) -> None:
        """One agent's rung stopped: the ranks (shared by every agent of the world) live on."""

    async def shutdown(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # ---- the test's controls ------------------------------------------------------------------------------------
    def fault(self, component: str, mode: str = "transient") -> None:
        """`component`'s engine faults; every peer of its group notices at its next all2all (here: at once)."""
        rank = self.rank_of(component)
        rank.mode = mode
        for peer in self.peers(rank):
            self._unhealthy(peer, "dead" if peer is rank and mode == "dead" else "unhealthy")

    def _unhealthy(self, rank: FakeRank, state: str) -> None:
        comp = rank.stack.components[rank.component]
        if rank.state != "healthy" or not comp.up:
            return
        rank.pid = comp.pid
        rank.state, rank.fault_info, rank.ft_error, rank.faults = state, "RuntimeError", None, rank.faults + 1
        task = asyncio.ensure_future(self._give_up(rank, comp.pid, rank.faults))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _peer_gone(self, rank: FakeRank) -> None:
        for peer in self.peers(rank):
            if peer is not rank and not peer.stack.components[peer.component].running and peer.pid is not None:
                self._unhealthy(rank, "unhealthy")

    async def _give_up(self, rank: FakeRank, pid: int | None, fault: int) -> None:
        """vLLM: no retry within engine_recovery_timeout_sec re-raises the fault; the engine and its server die."""
        await self.world.clock.sleep(rank.recovery_timeout_s)
        comp = rank.stack.components[rank.component]
        if rank.faults == fault and rank.state != "healthy" and comp.pid == pid and comp.running:
            rank.stack.crash(rank.component, "exited with code 1 (EngineDeadError: no FT recovery in time)")

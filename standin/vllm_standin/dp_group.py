"""Multi-node data parallelism as the agent sees it: a group is one unit that cannot lose a rank.

vLLM's head (the node without `--headless`) waits for every other node's engines on
`--data-parallel-address:--data-parallel-rpc-port` before it serves; headless nodes serve no HTTP and give up
when the head does not answer within minutes; once running, a lost node breaks the whole group (the head's
engine core fails and the API server exits; headless engines exit when the head goes). The stand-in keeps a
TCP connection per headless node to the head to show exactly that.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from vllm_standin.common import env_float, log

PROC = "DPCoordinator"
HEADLESS_WAIT_S = 300.0
"""vLLM's headless engines wait this long for the head (VLLM_STANDIN_DP_WAIT_S overrides)."""


@dataclass(frozen=True)
class DpPlan:
    size: int
    size_local: int
    start_rank: int
    address: str
    rpc_port: int
    headless: bool

    @property
    def multi_node(self) -> bool:
        return self.size > self.size_local


class Head:
    """Waits for the other nodes' engines, then reports the first one lost."""

    def __init__(self, plan: DpPlan) -> None:
        self.plan = plan
        self.expected = plan.size - plan.size_local
        self.joined = 0
        self.all_joined = asyncio.Event()
        self.lost = asyncio.Event()
        self.reason = ""
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._peer, self.plan.address, self.plan.rpc_port)
        log(PROC, "coordinator.py:71", f"DP coordinator on {self.plan.address}:{self.plan.rpc_port}: waiting for "
            f"{self.expected} remote engine(s)")  # fmt: skip

    async def _peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = (await reader.readline()).decode().split()
        size = int(hello[2]) if len(hello) == 3 and hello[0] == "hello" and hello[2].isdigit() else 0
        rank = hello[1] if len(hello) == 3 else "?"
        self.joined += size
        log(PROC, "coordinator.py:95", f"remote engines of ranks {rank}+ joined ({self.joined}/{self.expected})")
        if self.joined >= self.expected:
            self.all_joined.set()
        writer.write(b"ok\n")
        await writer.drain()
        await reader.read()  # EOF: that node's engines are gone
        if not self.lost.is_set():
            self.reason = f"DP rank {rank} disconnected"
            self.lost.set()
        writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()


async def run_headless(plan: DpPlan, stop: asyncio.Event) -> int:
    """Connect to the head (retrying), then live until it goes (1) or we are stopped (0)."""
    deadline = asyncio.get_running_loop().time() + (env_float("VLLM_STANDIN_DP_WAIT_S", HEADLESS_WAIT_S) or 300.0)
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(plan.address, plan.rpc_port)
            break
        except OSError:
            if asyncio.get_running_loop().time() >= deadline:
                log(PROC, "core.py:811", f"TimeoutError: did not reach the DP head at {plan.address}:"
                    f"{plan.rpc_port} in time; giving up", "ERROR")  # fmt: skip
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    else:
        return 0
    writer.write(f"hello {plan.start_rank} {plan.size_local}\n".encode())
    await writer.drain()
    await reader.readline()
    log(PROC, "core.py:820", f"headless engines of ranks {plan.start_rank}..{plan.start_rank + plan.size_local - 1}"
        f" joined the DP group at {plan.address}:{plan.rpc_port}")  # fmt: skip
    eof = asyncio.ensure_future(reader.read())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({eof, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for fut in (eof, stopped):
        fut.cancel()
    writer.close()
    if stop.is_set():
        return 0
    log(PROC, "core.py:840", "RuntimeError: the DP group's head is gone; headless engines exit", "ERROR")
    return 1

"""A vLLM's own processes, watched: vLLM does not notice every death in its tree.

Measured with real CPU vLLM 0.32 (a data-parallel group of two ranks, external launch): kill -9 of rank 0's
`VLLM::DPCoordinator` leaves both ranks answering /health 200 and `/v1/models` for 90 s and more — the group can no
longer run a wave together, and nothing any probe reads says so. A dead `VLLM::EngineCore` or `VLLM::Worker` is
seen by vLLM (its API server exits or answers 500) but only after its own timeouts (~40 s for a Worker here).

So once a vLLM is up, the processes of its tree titled `VLLM::…` are its members: one that is gone while the
main process (the API server) runs is a liveness failure, at once. Processes that appear later join; titles are
read once, a member is known by (pid, start time), so a reused PID is not mistaken for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import psutil

from nodeagent.process import ProcessRecord, tree_of

TITLE_PREFIX = "VLLM::"
WATCH_PERIOD_S = 2.0
"""A tree walk costs one pass over /proc (~2 ms for a few hundred processes): cheap beside vLLM's own timeouts."""

Member = tuple[int, float]
"""(pid, create time)"""


class TreeMembers:
    """The members seen so far and which of them are gone (pure: the caller lists the processes)."""

    def __init__(self) -> None:
        self.members: dict[Member, str] = {}

    def observe(self, alive: Mapping[Member, str]) -> list[str]:
        """Take what is alive now; the members that are not, as `VLLM::DPCoordinator (pid 42)`."""
        lost = [key for key in self.members if key not in alive]
        gone = [f"{self.members.pop(key)} (pid {key[0]})" for key in lost]
        self.members.update(alive)
        return gone


def loss_detail(gone: list[str]) -> str:
    return (f"{', '.join(gone)} exited while this vLLM's API server runs — vLLM does not notice every such death "
            f"(a dead DPCoordinator leaves /health 200)")


def vllm_processes(record: ProcessRecord) -> dict[Member, str]:
    """The tree's processes titled `VLLM::…`, the main process left out (its own exit is watched already)."""
    found: dict[Member, str] = {}
    for proc in tree_of(record):
        if proc.pid == record.pid:
            continue
        with contextlib.suppress(psutil.Error):
            words = proc.cmdline()
            if words and words[0].startswith(TITLE_PREFIX) and proc.status() != psutil.STATUS_ZOMBIE:
                found[(proc.pid, proc.create_time())] = words[0]
    return found


async def watch_tree(record: ProcessRecord, still_ours: Callable[[], bool], on_loss: Callable[[str], None],
                     period_s: float = WATCH_PERIOD_S,
                     list_members: Callable[[ProcessRecord], dict[Member, str]] = vllm_processes) -> None:
    """Until `still_ours()` turns false (another run, a stop begun): report the first loss and end."""
    members = TreeMembers()
    members.observe(await asyncio.to_thread(list_members, record))
    while True:
        await asyncio.sleep(period_s)
        if not still_ours():
            return
        gone = members.observe(await asyncio.to_thread(list_members, record))
        if gone and still_ours():
            on_loss(loss_detail(gone))
            return

"""A vLLM's own processes, watched: vLLM does not notice every death in its tree.

Measured with real CPU vLLM 0.32 (a data-parallel group of two ranks, external launch): kill -9 of rank 0's
`VLLM::DPCoordinator` leaves both ranks answering /health 200 and `/v1/models` for 90 s and more — the group can no
longer run a wave together, and nothing any probe reads says so. A dead `VLLM::EngineCore` or `VLLM::Worker` is
seen by vLLM through its own error path (its API server exits or answers 500); a SIGSTOPped EngineCore is not:
both ranks stay at /health 200.

So once a vLLM is up, the processes of its tree titled `VLLM::…` are its members: one that is gone while the
main process (the API server) runs is a liveness failure, at once; so is any of them, the API server included,
stopped by a signal for `STOPPED_AFTER_S` (a SIGSTOPped EngineCore_DP1 leaves both DP ranks at /health 200).
Processes that appear later join; a member is known by (pid, start time), so a reused PID is not mistaken for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil

from nodeagent.core.process import ProcessRecord, tree_of

TITLE_PREFIX = "VLLM::"
WATCH_PERIOD_S = 2.0
"""A tree walk costs one pass over /proc (~2 ms for a few hundred processes): cheap beside vLLM's own timeouts."""

Member = tuple[int, float]
"""(pid, create time)"""

STOPPED_AFTER_S = 10.0
"""A process stopped by a signal (state T: SIGSTOP, SIGTSTP) this long is hung: vLLM never stops itself, and a
debugger's stop is another state (t, tracing) that is left alone."""


@dataclass(frozen=True)
class Seen:
    title: str
    stopped: bool = False
    main: bool = False
    """The API server: its exit is the pidfd's to see; only a stop of it is this watch's."""


class TreeMembers:
    """The members seen so far, which of them are gone and which stay stopped (pure: the caller lists the
    processes and gives the time)."""

    def __init__(self) -> None:
        self.members: dict[Member, str] = {}
        self.stopped_since: dict[Member, float] = {}

    def observe(self, alive: Mapping[Member, Seen], now: float) -> list[str]:
        """Take what is alive now; the problems: `VLLM::DPCoordinator (pid 42) exited`, `VLLM::EngineCore_DP1
        (pid 43) stopped for 12 s`."""
        lost = [key for key in self.members if key not in alive]
        problems = [f"{self.members.pop(key)} (pid {key[0]}) exited" for key in lost]
        self.members.update({key: seen.title for key, seen in alive.items() if not seen.main})
        for key in [k for k in self.stopped_since if k not in alive or not alive[k].stopped]:
            del self.stopped_since[key]
        for key, seen in alive.items():
            if seen.stopped:
                since = self.stopped_since.setdefault(key, now)
                if now - since >= STOPPED_AFTER_S:
                    problems.append(f"{seen.title} (pid {key[0]}) stopped for {now - since:.0f} s")
        return problems


def problem_detail(problems: list[str]) -> str:
    return (f"{', '.join(problems)} while this vLLM's API server runs — vLLM does not notice (a dead or stopped "
            f"DPCoordinator or EngineCore leaves /health 200)")


def vllm_processes(record: ProcessRecord) -> dict[Member, Seen]:
    """The main process and the tree's processes titled `VLLM::…`, each with whether a signal stopped it."""
    found: dict[Member, Seen] = {}
    for proc in tree_of(record):
        with contextlib.suppress(psutil.Error):
            main = proc.pid == record.pid
            words = proc.cmdline() if not main else ["API server"]
            status = proc.status()
            if words and (main or words[0].startswith(TITLE_PREFIX)) and status != psutil.STATUS_ZOMBIE:
                found[(proc.pid, proc.create_time())] = Seen(words[0], status == psutil.STATUS_STOPPED, main)
    return found


async def watch_tree(record: ProcessRecord, still_ours: Callable[[], bool], on_problem: Callable[[str], None],
                     period_s: float = WATCH_PERIOD_S,
                     list_members: Callable[[ProcessRecord], dict[Member, Seen]] = vllm_processes,
                     clock: Callable[[], float] = time.monotonic) -> None:
    """Until `still_ours()` turns false (another run, a stop begun): report the first problem and end."""
    members = TreeMembers()
    members.observe(await asyncio.to_thread(list_members, record), clock())
    while True:
        await asyncio.sleep(period_s)
        if not still_ours():
            return
        problems = members.observe(await asyncio.to_thread(list_members, record), clock())
        if problems and still_ours():
            on_problem(problem_detail(problems))
            return

"""What every part of the cluster layer runs beside the node: named tasks that stop together, and watches that
outlive their own bugs (the store already retries outages, compactions and wipes; this is the last resort)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from loguru import logger

if TYPE_CHECKING:
    from nodeagent.cluster.store import Store, WatchItem
    from nodeagent.seam.host import Clock

WatchHandler = Callable[["WatchItem"], Awaitable[None] | None]


class TaskSet:
    """The tasks of one part (coordinator, membership, rollout): started one by one, cancelled as one.

    Only the running ones are kept: a finished task leaves the set at once (a long-lived agent spawns one per
    command, barrier, bump; they were all kept, with their results, until the layer stopped)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def start(self, work: Awaitable[Any], name: str | None = None) -> None:
        task = asyncio.ensure_future(work)
        if name is not None and isinstance(task, asyncio.Task):
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def __len__(self) -> int:
        return len(self._tasks)

    def cancel(self) -> list[asyncio.Future[Any]]:
        """Cancel without waiting (what a kill -9 does to them); the cancelled tasks are returned."""
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        return tasks

    async def stop(self) -> None:
        tasks = self.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def follow(store: Store, prefix: str, handle: WatchHandler, *, clock: Clock, retry_s: float,
                 what: str) -> None:  # fmt: skip
    """Feed every item of the watch of `prefix` (first its snapshot) to `handle`, for as long as the task runs."""
    while True:
        try:
            async with contextlib.aclosing(store.watch_prefix(prefix)) as items:
                async for item in items:
                    done = handle(item)
                    if inspect.isawaitable(done):
                        await done
        except Exception:
            logger.exception(f"{what}: the watch of {prefix} failed; restarting it")
            await clock.sleep(retry_s)



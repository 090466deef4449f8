"""What a long-lived agent remembers stays bounded: finished cluster tasks, answered remote commands, redeploys
done. No store, no process: the parts are fed directly."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from nodeagent.cluster.coordinator import DONE_REDEPLOYS_KEPT, Coordinator
from nodeagent.cluster.ops import ClusterOps
from nodeagent.cluster.store import KV
from nodeagent.cluster.tasks import TaskSet


async def test_a_taskset_keeps_only_its_running_tasks() -> None:
    tasks = TaskSet()
    for _ in range(100):
        tasks.start(asyncio.sleep(0))
    forever = asyncio.Event()
    tasks.start(forever.wait(), name="forever")
    await asyncio.sleep(0.01)
    assert len(tasks) == 1
    await tasks.stop()
    assert len(tasks) == 0


def ops() -> tuple[ClusterOps, list[Any]]:
    spawned: list[Any] = []

    def spawn(work: Any) -> None:
        spawned.append(work)
        work.close()  # not run: only counted

    co = SimpleNamespace(port=None, store=None, cluster="c", node="n1", spawn=spawn)
    return ClusterOps(co), spawned  # type: ignore[arg-type]


def command(key: str, state: str, rev: int) -> KV:
    body = {"action": "restart", "component": "vllm", "state": state}
    return KV(key, json.dumps(body).encode(), 1, rev)


def test_a_remote_command_runs_once_and_is_forgotten_once_answered_or_gone() -> None:
    o, spawned = ops()
    for i in range(50):
        key = f"/dsv4-agent/c/commands/n1/{i}"
        o._on_command(key, command(key, "pending", 1))
        o._on_command(key, command(key, "pending", 1))  # a watch re-read: not run twice
        o._on_command(key, command(key, "done", 2))
        o._on_command(key, None)
    assert len(spawned) == 50
    assert o.handled == set()


def test_a_pending_command_is_remembered_while_pending() -> None:
    o, spawned = ops()
    key = "/dsv4-agent/c/commands/n1/x"
    o._on_command(key, command(key, "pending", 1))
    assert o.handled == {key}
    o._on_command(key, command(key, "pending", 1))
    assert len(spawned) == 1


def test_the_redeploys_done_are_bounded_in_memory_too() -> None:
    co = SimpleNamespace(done_redeploys=[], save=lambda: None)
    for i in range(DONE_REDEPLOYS_KEPT * 3):
        Coordinator.redeploy_done(co, f"r{i}")  # type: ignore[arg-type]
    last = DONE_REDEPLOYS_KEPT * 3 - 1
    assert len(co.done_redeploys) == DONE_REDEPLOYS_KEPT and co.done_redeploys[-1] == f"r{last}"
    Coordinator.redeploy_done(co, f"r{last}")  # done once
    assert co.done_redeploys.count(f"r{last}") == 1

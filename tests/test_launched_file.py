"""The real supervisor publishes the cluster file each process was launched with (`ComponentView.launched_file`,
the member record's component `file`), also for a process its successor adopted: an incompatible rollout keeps
groups apart by it (`rollout.running`). Over `sim_node` (virtual time, no process)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sim_node import LoopClock, RealStack, RealWorld, caches_off

from nodeagent.config.cluster import cluster_file_hash

GROUPS = [{"name": "p0", "kind": "prefill", "nodes": ["n0"]}, {"name": "d0", "kind": "decode", "nodes": ["n1"]}]


def files(world: RealWorld, node: str) -> dict[str, str | None]:
    record = world.agents[node].membership.record()
    return {name: comp.get("file") for name, comp in record["components"].items()}


def test_each_process_publishes_the_file_it_was_launched_with_also_once_adopted(tmp_path: Path) -> None:
    async def run() -> None:
        world = RealWorld(tmp_path, ["n0", "n1"], [dict(g) for g in GROUPS], proxy=True, clock=LoopClock())
        world.clock.install(asyncio.get_running_loop())  # type: ignore[attr-defined]
        parsed = world.config
        world.config = lambda name: caches_off(parsed(name))  # type: ignore[method-assign]
        for name in ("n0", "n1"):
            world.stacks[name] = RealStack(world.config(name), world.clock, lambda: world.store.reachable)
        world.start()
        try:
            await world.until("every component up", world.all_up, within=300)
            launched = cluster_file_hash(world.config("n1"))
            assert set(files(world, "n1").values()) == {launched}, files(world, "n1")
            await world.kill_agent("n1")
            world.start_agent("n1")
            await world.until("adopted", world.all_up, within=120)
            assert set(files(world, "n1").values()) == {launched}, "adopted: as its launch recorded it"
        finally:
            await world.close()

    asyncio.run(run())

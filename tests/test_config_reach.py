"""Config reaches every holder (issue 29 item 3): the layers read the node's config through the port
(`StackPort.config`) and keep no copy, so a reload — the supervisor replaces its config, the port's — reaches the
rollout's drain and canary, the fault-tolerance rung, the PD watch, the KV transfer log and the worker headroom.

Without processes: agents on a FakeStore, fake stacks and a virtual clock (`tests/cluster_fakes.py`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cluster_fakes import World

from nodeagent.cluster.pd_watch import PdWatch
from nodeagent.cluster.rollout.plan import PlanError
from nodeagent.core.errors import ConfigError
from nodeagent.layers.kvlog import KvTransferLog
from nodeagent.layers.worker_headroom import WorkerHeadroom

NODES = ["n0", "n1"]
GROUPS = [{"name": "g", "kind": "mixed", "nodes": NODES, "dp_launch": "external", "data_parallel_rpc_port": 43000}]
FT = {"enabled": True, "engine_recovery_timeout_s": 120, "retry_timeout_s": 30, "status_interval_s": 2}


async def test_a_reload_reaches_the_rollouts_drain_and_canary_and_every_layer(tmp_path: Path) -> None:
    world = World(tmp_path, NODES, [dict(g) for g in GROUPS], ft=dict(FT), rollouts=True)
    world.start()
    try:
        await world.until("every component up", world.all_up, within=120)
        agent, stack = world.agents["n0"], world.stacks["n0"]
        co, rollout = agent.coordinator, agent.rollout
        rank = co.gangs["g"].components[0]
        seen: dict[str, list[str]] = {"drain": [], "canary": []}

        async def inflight(component: str, cfg: Any) -> tuple[int, int]:
            seen["drain"].append(cfg.served_model_name)
            return (0, 0)

        async def canary(endpoint: str, cfg: Any) -> tuple[bool, str]:
            if cfg is not None:  # the peer's rank: not in this node's config
                seen["canary"].append(cfg.served_model_name)
            return (True, "ok")

        rollout._inflight, rollout._canary = inflight, canary
        pd = PdWatch(co, None, lambda: {})
        kvlog = KvTransferLog(stack.config, stack)  # type: ignore[arg-type]
        headroom = WorkerHeadroom(stack.config, stack, read=lambda: "")  # type: ignore[arg-type]
        group = co.layout.group("g")
        await rollout._drained(SimpleNamespace(groups=["g"]))
        await rollout._group_canary(group)
        assert seen == {"drain": ["dsv4"], "canary": ["dsv4"]} and pd.model == "dsv4"
        assert co.ft.groups["g"].spec.retry_timeout_s == 30

        def edit(data: dict[str, Any]) -> None:
            data["components"]["vllm"]["served_model_name"] = "dsv4-renamed"
            data["components"]["vllm"]["fault_tolerance"]["retry_timeout_s"] = 45

        world.install(edit)
        new = world.config("n0")
        stack.config = new  # what the agent's reload does: Supervisor.reload replaces the node's (the port's) config
        seen = {"drain": [], "canary": []}
        await rollout._drained(SimpleNamespace(groups=["g"]))
        await rollout._group_canary(group)
        assert seen == {"drain": ["dsv4-renamed"], "canary": ["dsv4-renamed"]}
        assert co.config is new and pd.model == "dsv4-renamed"
        assert kvlog.config is new and headroom.config is new
        assert co.config.components[rank].served_model_name == "dsv4-renamed"  # type: ignore[union-attr]
        await world.until("the rung's next round", lambda: co.ft.groups["g"].spec.retry_timeout_s == 45, 30)
    finally:
        await world.close()


async def test_a_rollout_refuses_a_new_file_whose_listeners_collide(tmp_path: Path) -> None:
    """The rollout's doors (its plan, a step's staging) read the new file as the agent loads it: a file whose
    listeners collide is refused there, naming the keys, before any group is touched (issue 29 item 1)."""
    world = World(tmp_path, NODES, [dict(g) for g in GROUPS], rollouts=True)
    world.start()
    try:
        await world.until("every component up", world.all_up, within=120)

        def collide(data: dict[str, Any]) -> None:
            n0 = next(n for n in data["cluster"]["nodes"] if n["name"] == "n0")
            n0["components"]["datasystem"]["worker_port"] = world.harness.api_ports["n0"]  # the agent's own API

        world.install(collide)
        rollout = world.agents["n0"].rollout
        with pytest.raises(ConfigError, match=r"agent\.api\.listen and components\.datasystem\.worker_port: .*collide"):
            rollout.member.config_for(rollout.member.hash(world.config("n0")))  # a step's staging
        with pytest.raises(PlanError, match="collide"):
            await world.run(rollout.plan(None, {}, dry_run=True, by="test"))
    finally:
        await world.close()

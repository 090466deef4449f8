"""Start guards: a failed preflight holds the whole stack (an operator start still works) until it passes;
checks the agent handles per component (a busy port) never hold the stack."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from apihelpers import tiny_config, wait_until, write_config

from nodeagent.agent import Agent, load_checked
from nodeagent.layers import preflight
from nodeagent.layers.preflight import Check, PreflightReport


def report(*checks: Check) -> PreflightReport:
    return PreflightReport(list(checks))


async def test_a_failed_preflight_holds_the_stack_until_it_passes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    now = report(Check("memory", "FAIL", "MemAvailable 10 GB < shared_memory_size_mb 500 GB", "lower it"),
                 Check("ports", "FAIL", "8080 held by pid 1", "stop it"))
    monkeypatch.setattr(preflight, "run_preflight", lambda config: now)
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    agent = Agent(load_checked(path), path)
    sup = agent.supervisor
    try:
        await agent.guards.start()
        agent.attach_layers()  # as Agent.run does: the composition root attaches every layer, in its order
        await sup.start()
        a = sup.components["a"]
        await wait_until("held", lambda: a.held and a.held.startswith("preflight failed: memory: MemAvailable"))
        assert "ports" not in a.held, "a busy port holds only its component (residue), not the stack"
        assert a.record is None
        events = [e.message for e in sup.events.recent if e.event == "preflight_failed"]
        assert events and "the stack is held" in events[0]
        sup.command("a", "start")  # an operator start passes the preflight hold
        await wait_until("a started by the operator", lambda: a.up.is_set())
        assert sup.components["b"].record is None
        now = report(Check("memory", "PASS", "ok"))
        monkeypatch.setattr(preflight, "run_preflight", lambda config: now)
        await agent.guards.run_preflight()
        await wait_until("b starts once preflight passes", lambda: sup.components["b"].up.is_set())
        assert agent.guards.status()["preflight"]["blocking"] == []
    finally:
        await agent.guards.close()
        await sup.shutdown()


async def test_force_turns_failures_into_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "run_preflight",
                        lambda config: report(Check("hdk", "FAIL", "25.0.1 < 25.2.3", "upgrade")))
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    agent = Agent(load_checked(path), path, force=True)
    try:
        await agent.guards.start()
        agent.attach_layers()
        await agent.supervisor.start()
        await wait_until("up despite the FAIL", lambda: agent.supervisor.components["b"].up.is_set())
        assert any(e.event == "preflight_warning" for e in agent.supervisor.events.recent)
    finally:
        await agent.guards.close()
        await agent.supervisor.shutdown()
        await asyncio.sleep(0)


def test_the_composition_root_writes_the_order_of_layers_once(tmp_path: Path) -> None:
    """Who decides first is `Agent.layers()`' order, and nothing else attaches: the guards (gates), the NPU ladder,
    the worker's headroom, the weight warmer and the start phases (report only), then the observers; a layer made
    is not attached until the root attaches it."""
    from nodeagent.layers.chip_reset import NodeRecovery
    from nodeagent.layers.start_phases import StartPhaseWatch
    from nodeagent.layers.weight_warm import WeightWarmer
    from nodeagent.layers.worker_headroom import WorkerHeadroom
    from nodeagent.seam.stackport import ChangeObserver

    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    agent = Agent(load_checked(path), path)
    assert agent.supervisor.layers == [], "made, not attached"
    agent.attach_layers()
    kinds = [type(layer) for layer in agent.supervisor.layers]
    assert kinds == [type(agent.guards), NodeRecovery, WorkerHeadroom, WeightWarmer, StartPhaseWatch,
                     ChangeObserver], kinds


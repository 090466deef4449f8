"""The hold list and the port, without processes: which hold wins (pure), and that the node and the simulation's
host both offer the cluster layer the same `StackPort` (the simulation is the layer's other real user)."""

from __future__ import annotations

import importlib.util
import inspect
import random
import sys
from pathlib import Path
from types import ModuleType

from cluster_fakes import FakeStack

from nodeagent.node.supervisor import Supervisor
from nodeagent.seam.stackport import (
    HOLD_ORDER,
    NODE_KINDS,
    PAUSES,
    STOPS_AUTOMATIC,
    Hold,
    HoldKind,
    StackPort,
    first_hold,
)

ROOT = Path(__file__).resolve().parents[1]


def hold(kind: HoldKind) -> Hold:
    return Hold(kind, f"held by {kind}")


def test_the_earliest_kind_wins_whatever_order_the_gates_answer_in() -> None:
    rng = random.Random(15)
    for _ in range(200):
        kinds = rng.sample(list(HoldKind), rng.randint(1, len(HoldKind)))
        answers: list[Hold | None] = [hold(k) for k in kinds] + [None] * rng.randint(0, 3)
        rng.shuffle(answers)
        won = first_hold(answers)
        assert won is not None and won.kind == min(kinds, key=HOLD_ORDER.index)
    assert first_hold([]) is None and first_hold([None, None]) is None


def test_the_node_holds_come_before_every_layers_hold() -> None:
    """The supervisor asks its own gates first and stops at the first that holds: that is only the same answer as
    asking everything if each of its kinds comes before each of the layers' kinds."""
    assert NODE_KINDS == (HoldKind.DESIRED_STOPPED, HoldKind.NODE_PAUSE, HoldKind.CLUSTER_PAUSE,
                          HoldKind.ETCD_UNREACHABLE, HoldKind.NODE_REDEPLOY, HoldKind.DEPENDENCY)  # fmt: skip
    layers = [k for k in HOLD_ORDER if k not in NODE_KINDS]
    assert max(map(HOLD_ORDER.index, NODE_KINDS)) < min(map(HOLD_ORDER.index, layers))
    assert HOLD_ORDER[-1] == HoldKind.FOREIGN_HOLDER, "found by prepare, after every gate passed"


def test_what_an_automatic_action_respects_is_decided_by_kind() -> None:
    assert {HoldKind.DESIRED_STOPPED, *PAUSES} == STOPS_AUTOMATIC
    assert set(NODE_KINDS) >= STOPS_AUTOMATIC, "decide asks only the node's gates"
    looks_paused = Hold(HoldKind.BARRIER, "paused: waiting for the group")
    assert not looks_paused.is_pause and looks_paused.kind not in STOPS_AUTOMATIC, "never by the text"


def load_cluster_sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cluster_sim", ROOT / "bench" / "cluster_sim.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cluster_sim"] = module
    spec.loader.exec_module(module)
    return module


def port_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(StackPort).items()
            if callable(member) and not name.startswith("_")}  # fmt: skip


def parameters(sig: inspect.Signature) -> list[tuple[str, object, bool]]:
    return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in sig.parameters.values()]


def test_the_supervisor_and_the_simulation_implement_the_whole_port() -> None:
    wanted = port_methods()
    assert {"snapshot", "component", "restart", "command", "clean", "wait", "emit", "set_cluster_pause",
            "cluster_pause", "wake", "attach", "block_ready", "postmortem", "hold_liveness",
            "route_proxy", "show_recovery", "member_report", "recent_events"} == set(wanted)  # fmt: skip
    assert isinstance(vars(StackPort)["base_env"], property), "a declared member, never a getattr"
    for host in (Supervisor, load_cluster_sim().SimHost, FakeStack):
        for name, sig in wanted.items():
            method = getattr(host, name, None)
            assert method is not None, f"{host.__name__} lacks {name}"
            assert parameters(inspect.signature(method)) == parameters(sig), f"{host.__name__}.{name}"
            assert inspect.iscoroutinefunction(method) == inspect.iscoroutinefunction(getattr(StackPort, name))

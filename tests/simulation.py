"""A deterministic simulation of a whole cluster: random fault schedules from a seed, invariants after every step.

What runs is the agents' own cluster code — `Membership`, `Coordinator` with its barriers, gangs, `ClusterOps`,
`ProxySync` and the FT rung — one agent per node, all on one `FakeStore`, one `VirtualClock` and one event loop
(`tests/cluster_fakes.World`). Each node's stack is `cluster_fakes.FakeStack`: components start through the same
ordered gates as the supervisor's, are up `start_s` later, a stop takes the tree `stop_s` to end. Nothing waits
for real time; a run of an hour of cluster time takes seconds.

A schedule is (seed, layout, fault mix, duration): the seed draws every fault and command, their times and
parameters, before the run starts, so the same seed replays the same run event for event (`Trace`). A violated
invariant is recorded with the virtual time and the trace up to it; `shrink` then removes events while the same
invariant still fails (Hypothesis-style: halves, then single events), and prints the smallest schedule.

The invariants (checked on every change a node or the proxy reports, and after every event):
- `two_generations`: never two generations of a group's ranks alive at once (the barrier means "stopped");
- `restart_while_paused`: nothing is stopped or started by an automatic action while its node or the cluster is
  paused;
- `restart_without_cause`: every stop of a component is licensed by a fault or command the rules name (a crash
  licenses its own component and its group's ranks; an operator restart its target and group; a cluster redeploy
  every component);
- `etcd_loss_stopped_serving`: while the store is unreachable, nothing that was serving is stopped unless a fault
  hit its group;
- `generations_per_fault`: at most one new generation per fault or command that touched the group;
- `command_lost` (liveness): an operator restart the agents acknowledged is carried out (its target starts again);
- `routed_down`: the proxy routes to no rank that has been down for more than `ROUTED_DOWN_S`;
- `no_convergence` (liveness): once the faults stop and heal, every component of every node is up, every gang
  acted on its group's generation and the proxy routes every group, within a bound derived from the config;
- rollouts (`ROLLOUTS`, the real `RolloutExecutor`): `rollout_floor` (a step starts only under the floor its rules
  state, judged on what runs), `mixed_routes` (never both KV connector settings routed), `refused_changed` and
  `second_rollout` (a refused start changes nothing), `rollout_stuck` (an active rollout ends within a bound from
  the rules' timeouts).

Usage: `.venv/bin/python tests/simulation.py --seed 7 --layout local-cluster` (one run, its trace and verdict);
`--schedules 500 --jobs 2` (a batch, seeds from `--seed` on); `bench/sim_campaign.py --hours 1` (a long campaign
with a report). Replays need the same PYTHONHASHSEED (the runner sets 0 for its workers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from cluster_fakes import FakeComponent, FakeStack, World  # noqa: E402

from nodeagent.cluster.rollout.record import Record, Step, rollout_key  # noqa: E402
from nodeagent.cluster.rollout.rules import FILES_WAIT_S, PUBLISH_TIMEOUT_S, REJOIN_TIMEOUT_S, STAGE_TIMEOUT_S  # noqa: E402
from nodeagent.cluster.rollout.states import RESTARTS, Phase, Status  # noqa: E402
from nodeagent.config.model import Config  # noqa: E402

ROUTED_DOWN_S = 30.0
"""How long the proxy may still route to a rank that is down: the sync removes a group as its generation is asked
(≤ 1 s) and re-reads the proxy every second; 30 s leaves room for an agent that is being restarted."""
LICENSE_S = 400.0
"""How long a fault or command licenses the stops it implies (a gang restart under a long backoff comes late)."""
FLOOR_GRACE_S = 10.0
"""A group counts as down for the rollout's floor once its ranks have been down this long: the agents see a rank
through its member record, which a dead agent's lease keeps saying "up" for up to a TTL (3 s here)."""


# ---- layouts ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    name: str
    nodes: tuple[str, ...]
    groups: tuple[dict[str, Any], ...]


def layout_from_file(path: Path, name: str) -> Layout:
    """A shipped cluster file's topology (node names, groups, kinds; the master first): what the agents coordinate."""
    data = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # each run reads it
    cluster = data["cluster"]
    nodes = tuple(n["name"] for n in cluster["nodes"])
    groups = []
    for i, g in enumerate(cluster["vllm_groups"]):
        group = {"name": g["name"], "kind": g["kind"], "nodes": list(g["nodes"])}
        if len(g["nodes"]) > 1:
            group["data_parallel_rpc_port"] = 43000 + i
        groups.append(group)
    return Layout(name, nodes, tuple(groups))


def layouts() -> dict[str, Layout]:
    small = Layout("small", ("n0", "n1", "n2", "n3", "n4"), (
        {"name": "p0", "kind": "prefill", "nodes": ["n0", "n1"], "data_parallel_rpc_port": 43000},
        {"name": "p1", "kind": "prefill", "nodes": ["n2", "n3"], "data_parallel_rpc_port": 43001},
        {"name": "d0", "kind": "decode", "nodes": ["n4"]},
    ))  # fmt: skip
    return {
        "local-cluster": layout_from_file(ROOT / "config" / "local-cluster.yaml", "local-cluster"),
        "8node": layout_from_file(ROOT / "config" / "dsv4-flash-a2-8node.yaml", "8node"),
        "small": small,
    }


def fleet_layout(nodes: int) -> Layout:
    """A fleet of the guide's 8-node blocks (each 4×1P + 1×4D; the master first): `64node` is 8 of them — 32
    prefill groups and 8 decode groups of 4 nodes. Not in `layouts()`: a `mixed` seed's layout stays the one it
    was."""
    if nodes <= 0 or nodes % 8:
        raise ValueError(f"a fleet is made of 8-node blocks, not {nodes} nodes")
    names = tuple(f"f{i}" for i in range(nodes))
    prefill = [{"name": f"prefill{b * 4 + i}", "kind": "prefill", "nodes": [names[b * 8 + i]]}
               for b in range(nodes // 8) for i in range(4)]  # fmt: skip
    decode = [{"name": f"decode{b}", "kind": "decode", "nodes": list(names[b * 8 + 4:b * 8 + 8]),
               "data_parallel_rpc_port": 43000 + b} for b in range(nodes // 8)]  # fmt: skip
    return Layout(f"{nodes}node", names, tuple(prefill + decode))


def layout_named(name: str) -> Layout:
    """A shipped layout (`layouts()`), or a generated fleet: `64node`, `16node`… (`fleet_layout`)."""
    known = layouts()
    if name in known:
        return known[name]
    if name.endswith("node") and name[:-4].isdigit():
        return fleet_layout(int(name[:-4]))
    raise KeyError(f"no layout {name!r} (the shipped: {', '.join(sorted(known))}; or a fleet: 64node, 16node…)")


# ---- schedules -------------------------------------------------------------------------------------------------------

FAULTS: dict[str, float] = {
    # kind: weight in the default mix
    "crash": 6.0,            # kill -9 of a running component (its tree takes a random time to die)
    "crash_pair": 1.0,       # two ranks of one group die together
    "agent_kill": 2.0,       # kill -9 of an agent, a successor after a while (adoption)
    "agent_pause": 1.0,      # an agent paused past its lease (SIGSTOP), then resumed
    "etcd_down": 1.5,        # the store unreachable from every agent for a while
    "etcd_wipe": 0.5,        # etcd's data gone
    "compact": 0.5,          # the store compacted (watches resume past it)
    "op_restart": 2.0,       # nodeagentctl restart COMPONENT on one node
    "op_remote_restart": 1.0,  # nodeagentctl --node N restart vllm from another node
    "node_pause": 1.0,       # nodeagentctl pause / resume on one node
    "cluster_pause": 1.0,    # nodeagentctl cluster pause / resume
    "cluster_redeploy": 0.3,  # nodeagentctl cluster redeploy
}  # fmt: skip
REAL_FAULTS: dict[str, float] = {
    **FAULTS,
    "node_pause": 2.0,       # the pause and the failure paths are what the real node adds: they weigh more
    "cluster_pause": 2.0,
    "hang": 4.0,             # a process stops answering (its probes time out: the liveness failure path)
    "start_fail": 1.5,       # the datasystem worker is killed at every start for a while (the policy escalates)
}  # fmt: skip
"""The mix of a schedule over the real node (`sim_node`): its failure paths need faults the fake stack has not."""
REAL_POLICY = {"backoff_initial_s": 2.0, "backoff_max_s": 20.0, "redeploy_after_failures": 3}
"""The datasystem worker's restart policy in real-node schedules: short enough that a start failure lasting
tens of seconds escalates to a node redeploy (the blast radius) within a schedule."""

ROLLOUTS_ALL: dict[str, float] = {
    # drawn from a stream of their own (the seeds kept before rollouts were simulated keep their schedules)
    "rollout": 3.0,               # a new file installed and rolled out: an env change of some groups (compatible)
    "rollout_incompatible": 1.0,  # the KV connector changed (exclusive: old and new never routed together)
    "rollout_control": 2.0,       # pause (resumed later), abort or rollback of the rollout there is
    "rollout_bad": 0.5,           # a file that does not load: refused, nothing changes
}  # fmt: skip
ROLLOUTS: dict[str, float] = dict(ROLLOUTS_ALL)
"""The default mix (the CI budget's): every kind, incompatible rollouts too (left out while their findings were open:
docs/simulation.md, seeds 760050 on). `--rollouts all` is the same mix."""
ROLLOUT_GAP_S = 60.0


@dataclass(frozen=True)
class Event:
    at: float
    """Virtual seconds after the cluster first came up."""
    kind: str
    node: int
    """Index into the layout's nodes (the target, or the node the command is given on)."""
    pick: int
    """Chooses among what is applicable when the event runs (a component, a peer), modulo their number."""
    duration: float
    """How long the fault lasts before it heals (a stop's tree, an outage, a pause)."""


@dataclass(frozen=True)
class Schedule:
    seed: int
    layout: str
    duration: float
    events: tuple[Event, ...]
    node: str = "fake"
    """"fake": each node's stack is `cluster_fakes.FakeStack`; "real": the real supervisor (`sim_node`)."""

    def without(self, drop: set[int]) -> Schedule:
        return Schedule(self.seed, self.layout, self.duration,
                        tuple(e for i, e in enumerate(self.events) if i not in drop), self.node)  # fmt: skip


def make_schedule(seed: int, layout: str = "local-cluster", duration: float = 600.0,
                  mix: dict[str, float] | None = None, mean_gap_s: float = 25.0,
                  node: str = "fake", rollouts: dict[str, float] | None = None,
                  pd: bool = False, npu: bool = False) -> Schedule:  # fmt: skip
    """The seed's faults and commands, drawn before the run: exponential gaps, kinds by weight. Rollout commands
    come from a stream of their own (`ROLLOUTS`; `{}`: none — a schedule as drawn before rollouts were simulated;
    the real node's schedules have none: its agents run no rollout executor yet)."""
    if mix is None and node == "container":
        from sim_container import CONTAINER_FAULTS

        mix = {**REAL_FAULTS, **CONTAINER_FAULTS}
    events = _draw(random.Random(seed), mix or (REAL_FAULTS if node == "real" else FAULTS), duration, mean_gap_s)
    weights = ({} if node in ("real", "container") else ROLLOUTS) if rollouts is None else rollouts
    if weights:
        events += _draw(random.Random(f"rollouts/{seed}"), weights, duration, ROLLOUT_GAP_S)
    if pd:  # the PD watch's faults (`sim_pd`), a stream of their own on top: opt-in, not in the CI budget's mix
        from sim_pd import PD_FAULTS, PD_GAP_S

        events += _draw(random.Random(f"pd/{seed}"), PD_FAULTS, duration, PD_GAP_S)
    if npu:  # chip faults, failed resets, uncordon (`sim_npu`): a stream of their own, the real node only, opt-in
        from sim_npu import NPU_FAULTS, NPU_GAP_S

        if node not in ("real", "container"):
            raise ValueError(f"--npu needs the real node (--node real), not --node {node}")
        events += _draw(random.Random(f"npu/{seed}"), NPU_FAULTS, duration, NPU_GAP_S)
    return Schedule(seed, layout, duration, tuple(sorted(events, key=lambda e: e.at)), node)


def _draw(rng: random.Random, weights: dict[str, float], duration: float, mean_gap_s: float) -> list[Event]:
    kinds, w = list(weights), list(weights.values())
    events: list[Event] = []
    at = rng.uniform(1.0, mean_gap_s)
    while at < duration:
        kind = rng.choices(kinds, w)[0]
        lasting = {"etcd_down": (2.0, 60.0), "agent_kill": (0.5, 40.0), "agent_pause": (4.0, 20.0),
                   "node_pause": (5.0, 90.0), "cluster_pause": (5.0, 90.0), "hang": (5.0, 60.0),
                   "start_fail": (5.0, 60.0), "rollout_control": (5.0, 60.0)}.get(kind, (0.1, 45.0))  # fmt: skip
        events.append(Event(round(at, 3), kind, rng.randrange(1 << 16), rng.randrange(1 << 16),
                            round(rng.uniform(*lasting), 3)))  # fmt: skip
        at += rng.expovariate(1.0 / mean_gap_s)
    return events


# ---- the run ---------------------------------------------------------------------------------------------------------


@dataclass
class Violation:
    invariant: str
    at: float
    detail: str

    def __str__(self) -> str:
        return f"[{self.invariant}] t={self.at:.3f}s: {self.detail}"


@dataclass
class Result:
    schedule: Schedule
    violations: list[Violation]
    trace: list[str]
    checks: int
    faults: Counter[str]
    simulated_s: float
    wall_s: float

    @property
    def ok(self) -> bool:
        return not self.violations


_PARSED: dict[tuple[str, str, str], Config | Exception] = {}
_HASH = re.compile(r"\b[0-9a-f]{12}\b")


def parsed(path: str, node: str) -> Config:
    """`load_checked` of a node's file, remembered by its content (each agent start and each member's report reads
    it) — also from one schedule to the next (a config is frozen; the seeds of a layout write the same files): the
    YAML parse was a third of a schedule's CPU. A file that does not load raises its error again each time."""
    from nodeagent.agent import load_checked

    key = (path, node, Path(path).read_text())
    config = _PARSED.get(key)
    if config is None:
        if len(_PARSED) > 512:
            _PARSED.clear()
        try:
            config = _PARSED[key] = load_checked(path, node=node)
        except Exception as exc:
            _PARSED[key] = exc
            raise
    if isinstance(config, Exception):
        raise config.with_traceback(None)
    return config


_OFF: dict[int, tuple[Config, Config]] = {}


def parsed_caches_off(path: str, node: str) -> Config:
    """`parsed`, with the compile caches off (`sim_node.caches_off`): the same object for the same file, as the
    agent keeps the one it loaded (what hashes and layouts it is asked for are remembered by identity)."""
    from sim_node import caches_off

    config = parsed(path, node)
    seen = _OFF.get(id(config))
    if seen is None or seen[0] is not config:
        if len(_OFF) > 512:
            _OFF.clear()
        seen = _OFF[id(config)] = (config, caches_off(config))
    return seen[1]


class SimStack(FakeStack):
    """A FakeStack that tells the simulation of every launch, stop and restart ask (the checks run there)."""

    sim: Simulation

    def _launch(self, comp: FakeComponent) -> None:
        self.sim.before_launch(self, comp)
        super()._launch(comp)

    def restart(self, names: Sequence[str], reason: str, *, planned: bool, cause: str = "gang") -> None:
        self.sim.on_restart(self, names, reason, planned)
        super().restart(names, reason, planned=planned, cause=cause)

    def notify(self) -> None:
        super().notify()
        self.sim.check(self)


class Simulation:
    def __init__(self, schedule: Schedule, home: Path) -> None:
        self.schedule = schedule
        self.layout = layout_named(schedule.layout)
        self.real = schedule.node in ("real", "container")
        self.container: Any = None
        """Container mode (`sim_container.SimContainers`): the node's ranks in its container."""
        if self.real:
            from sim_node import LoopClock, RealWorld

            self.world = RealWorld(home, list(self.layout.nodes), [dict(g) for g in self.layout.groups], proxy=True,
                                   clock=LoopClock())  # fmt: skip
            self.world.harness.data["components"]["datasystem"]["restart"] = dict(REAL_POLICY)
            if schedule.node == "container":
                from sim_container import SimContainers

                self.container = SimContainers(self)
        else:
            self.world = World(home, list(self.layout.nodes), [dict(g) for g in self.layout.groups], proxy=True,
                               rollouts=True)
            self.world.clock.inline_threads = True  # a replay is event for event (cluster_fakes.InlineWork)
        self.clock = self.world.clock
        self.violations: list[Violation] = []
        self.trace: list[str] = []
        self.checks = 0
        self.faults: Counter[str] = Counter()
        self.started_at = 0.0
        self.epoch = 0
        """Bumped at an etcd wipe: generations start again at 1 there."""
        self.alive: dict[tuple[str, str], tuple[int, int]] = {}
        """(group, node) → the (epoch, generation) its running rank was launched in."""
        self.licenses: list[tuple[float, str, str, str]] = []
        """(until, node or '*', component or '*', why): stops a fault or command implies."""
        self.group_causes: Counter[str] = Counter()
        self.generations: dict[str, set[tuple[int, int]]] = {}
        self.outage = False
        self.outage_hit: set[str] = set()
        self.outage_since = 0.0
        self.redeploys_seen: dict[str, float] = {}
        """A cluster redeploy's first stop: one under way when etcd went away goes on (its stack stopped serving)."""
        """Groups a fault hit during the current etcd outage."""
        self.down_since: dict[str, float] = {}
        """endpoint → when its rank was last seen not up."""
        self.paused_agents: set[str] = set()
        self.acked: list[tuple[str, str, float, str]] = []
        """(node, component, when, what): operator restarts the agents answered as done or under way."""
        self.store_back: float | None = 0.0
        """When the store was last reachable again (None while it is not): the proxy sync needs it."""
        self.tasks: list[asyncio.Task[Any]] = []
        self.running = False
        self.files: dict[str, str] = {}
        harness = self.world.harness
        # the harness draws the cluster's name and the ports: a run's order of events follows the endpoints'
        # names (sets of them), so a seed replays its run only with the same ones (never bound here)
        harness.cluster_name = harness.data["cluster"]["name"] = "sim"
        harness.data["components"]["datasystem"]["extra_args"] = ["--cluster_name", "sim"]
        harness.api_ports = {n: 40000 + i for i, n in enumerate(self.layout.nodes)}
        for i, entry in enumerate(harness.data["cluster"]["nodes"]):
            entry["components"]["datasystem"]["worker_port"] = 40300 + i
            entry["components"]["vllm"]["port"] = 40600 + i
        self.write_files()
        # an agent loads the file on its disk (a rollout installs new ones): parsed once per content
        load = parsed_caches_off if self.real else parsed  # the real node's: see sim_node.caches_off
        self.world.config = lambda name: load(str(harness.config_path(name)), name)  # type: ignore[method-assign]
        self.world.load_checked = load  # type: ignore[method-assign]
        self.rollout_key = rollout_key(harness.cluster_name)
        self.rollout: Record | None = None
        """The rollout record as etcd holds it (after every write of it)."""
        self.steps_seen: dict[tuple[str, int, bool, bool], str] = {}
        """(rollout, step, failed, rollback) → the phase it was last written in."""
        self.rollouts_started = 0
        self.group_down: dict[str, float] = {}
        """group → since when one of its ranks is not up."""
        self.connector: dict[str, bool] = {}
        """node → the KV connector setting its running rank was launched with."""
        self._hook_rollout_writes()
        for name in self.layout.nodes:
            if self.real:
                self.world.stacks[name] = self.real_stack(self.world.config(name))
                continue
            stack = SimStack(self.world.config(name), self.clock, lambda: self.world.store.reachable)
            stack.sim = self
            self.world.stacks[name] = stack
        self.ranks = {e: (name, stack.components["vllm"]) for name, stack in self.world.stacks.items()
                      for e in stack.endpoints()}  # fmt: skip
        """endpoint → (node, its vLLM rank)."""
        self.group_of: dict[str, str] = {}
        for g in self.layout.groups:
            for n in g["nodes"]:
                self.group_of[n] = g["name"]
        self.pd: Any = None
        """The PD watch on the proxy's agent (`sim_pd.PdSim`), when the schedule has its faults."""
        if any(e.kind.startswith("pd_") for e in schedule.events):
            from sim_pd import PdSim

            self.pd = PdSim(self)
        self.npu: Any = None
        """The NPU guards and the chip-reset ladder over a simulated chip set (`sim_npu.NpuSim`), with its faults."""
        if any(e.kind.startswith("npu_") for e in schedule.events):
            from sim_npu import NpuSim

            self.npu = NpuSim(self)

    def real_stack(self, config: Any) -> Any:
        """A node over the real supervisor (`sim_node.RealStack`), its launches, stops and restarts checked here."""
        from sim_node import RealStack

        stack = RealStack(config, self.clock, lambda: self.world.store.reachable)
        stack.before_launch = lambda comp: self.before_launch(stack, comp)  # type: ignore[method-assign]
        stack.on_restart = lambda names, reason, planned: self.on_restart(stack, names, reason, planned)
        stack.host.on_stop = lambda name: self.on_stop(stack, name)
        stack.listeners.append(lambda: self.check(stack))
        return stack

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    def now(self) -> float:
        return self.clock.monotonic() - self.started_at

    def log(self, line: str) -> None:
        # a file's hash names it by the order it was met: a run's files carry the ports the harness drew
        line = _HASH.sub(lambda m: self.files.setdefault(m.group(0), f"file{len(self.files) + 1}"), line)
        self.trace.append(f"{self.now():9.3f} {line}")

    def violate(self, invariant: str, detail: str) -> None:
        if any(v.invariant == invariant and v.detail == detail for v in self.violations):
            return
        self.violations.append(Violation(invariant, self.now(), detail))
        self.log(f"VIOLATION {invariant}: {detail}")

    def license(self, node: str, component: str, why: str) -> None:
        self.licenses.append((self.clock.monotonic() + LICENSE_S, node, component, why))

    def licensed(self, node: str, component: str) -> bool:
        now = self.clock.monotonic()
        return any(until >= now and n in ("*", node) and c in ("*", component) for until, n, c, _ in self.licenses)

    def license_group(self, group: str, why: str) -> None:
        self.group_causes[group] += 1
        for g in self.layout.groups:
            if g["name"] == group:
                for n in g["nodes"]:
                    self.license(n, "vllm", why)
        if self.outage:
            self.outage_hit.add(group)

    def generation(self, node: str, group: str) -> int | None:
        agent = self.world.agents.get(node)
        gs = agent.coordinator.gangs.get(group) if agent is not None else None
        return gs.acted if gs is not None else None

    # ---- hooks from the stacks ---------------------------------------------------------------------------------
    def before_launch(self, stack: FakeStack, comp: FakeComponent) -> None:
        if not self.running:
            return
        paused = stack.pause_info()
        if paused is not None and not comp.operator_start:
            self.violate("restart_while_paused", f"{stack.node}/{comp.name} started while {paused['scope']} paused")
        group = self.group_of.get(stack.node)
        if comp.kind == "vllm":
            self.connector[stack.node] = stack.config.cluster.pd.use_ascend_direct
        if comp.kind == "vllm" and group is not None:
            gen = self.generation(stack.node, group)
            self.alive[(group, stack.node)] = (self.epoch, gen or 0)
            self.generations.setdefault(group, set()).add((self.epoch, gen or 0))
            self.log(f"launch {stack.node}/{comp.name} group {group} generation {gen}")
        else:
            self.log(f"launch {stack.node}/{comp.name}")

    def on_restart(self, stack: FakeStack, names: Sequence[str], reason: str, planned: bool) -> None:
        if not self.running:
            return
        self.log(f"restart asked {stack.node}/{','.join(names)}: {reason} (planned={planned})")
        for name in names:
            comp = stack.components[name]
            if not comp.running:
                continue
            if not self.licensed(stack.node, name) and not reason.startswith("cluster redeploy"):
                self.violate("restart_without_cause", f"{stack.node}/{name} restarted: {reason}")
            if stack.paused and not planned:
                self.violate("restart_while_paused", f"{stack.node}/{name} restarted while paused: {reason}")
            group = self.group_of.get(stack.node)
            redeploy = reason.split(":")[0] if reason.startswith("cluster redeploy") else None
            if redeploy is not None:
                self.redeploys_seen.setdefault(redeploy, self.clock.monotonic())
            under_way = redeploy is not None and self.redeploys_seen[redeploy] < self.outage_since
            if self.outage and comp.up and group not in self.outage_hit and not planned and not under_way:
                self.violate("etcd_loss_stopped_serving", f"{stack.node}/{name} stopped during an etcd outage: "
                             f"{reason}")  # fmt: skip

    def on_stop(self, stack: Any, name: str) -> None:
        """Real node: every stop of a tree, whatever path asked it, is licensed by a fault or command; one a node
        redeploy makes beyond what its failure class may touch is the blast radius broken."""
        if not self.running or self.licensed(stack.node, name):
            return
        sup = stack.supervisor
        if sup is not None and sup.redeploying is not None and not sup.redeploying.done():
            self.violate("recovery_beyond_blast_radius", f"{stack.node}/{name} stopped by a node redeploy of "
                         f"{list(sup.redeploy_scope)} that no fault or command of it licenses")  # fmt: skip
        else:
            self.violate("restart_without_cause", f"{stack.node}/{name} stopped without a fault or command")
        self.log(f"unlicensed stop of {stack.node}/{name}")

    def check_supervised(self) -> None:
        """Real node, when the loop is settled: no component left unsupervised."""
        for name, stack in self.world.stacks.items():
            for problem in stack.unsupervised():
                self.violate("unsupervised", f"{name}/{problem}")

    def license_component(self, node: str, name: str, why: str) -> None:
        """What a fault or command on one component licenses: itself, its group (a rank), the ranks over it."""
        self.license(node, name, why)
        kind = self.world.stacks[node].components[name].kind
        if kind == "vllm" and node in self.group_of:
            self.license_group(self.group_of[node], why)
        elif kind in ("datasystem", "etcd"):
            self.license(node, "vllm", f"{why}: under its rank")
            if node in self.group_of:
                self.license_group(self.group_of[node], f"{why}: under {node}'s rank")

    def check(self, stack: FakeStack | None = None) -> None:
        """Safety, after every change a node reports."""
        if not self.running:
            return
        self.checks += 1
        for group, node in list(self.alive):
            comp = self.world.stacks[node].components.get("vllm")
            if comp is None or not comp.running:
                del self.alive[(group, node)]
        by_group: dict[str, set[tuple[int, int]]] = {}
        for (group, _node), gen in self.alive.items():
            by_group.setdefault(group, set()).add(gen)
        for group, gens in by_group.items():
            if len(gens) > 1:
                ranks = {n: (g, self.world.stacks[n].components["vllm"].state) for (gr, n), g in self.alive.items()
                         if gr == group}  # fmt: skip
                self.violate("two_generations", f"group {group} has ranks of generations {sorted(gens)} alive at "
                             f"once: {ranks}")  # fmt: skip
        now = self.clock.monotonic()
        for g in self.layout.groups:
            if all(self.world.stacks[n].components["vllm"].up for n in g["nodes"]):
                self.group_down.pop(g["name"], None)
            else:
                self.group_down.setdefault(g["name"], now)
        self.check_proxy()
        self.check_mixed()
        if self.container is not None:
            self.container.check()

    def endpoint_ranks(self) -> dict[str, tuple[str, FakeComponent]]:
        return self.ranks

    def check_proxy(self) -> None:
        proxy = self.world.proxy
        now = self.clock.monotonic()
        if not self.world.store.reachable:
            self.store_back = None
            return
        if self.store_back is None:
            self.store_back = now
        if proxy is None or proxy.busy:
            return
        ranks = self.endpoint_ranks()
        for endpoint, (_node, comp) in ranks.items():
            if comp.up:
                self.down_since.pop(endpoint, None)
            else:
                self.down_since.setdefault(endpoint, now)
        if not any(c.up for st in self.world.stacks.values() for c in st.components.values() if c.kind == "proxy"):
            return  # its process is down (killed, or not restarted under a pause): it routes nothing
        for kind in ("prefill", "decode"):
            serving = proxy.serving(kind)
            up = {e for e in serving if e in ranks and ranks[e][1].up}
            if not up:
                continue  # nothing else to route to: a down instance listed is no worse than none
            for endpoint in serving:
                since = self.down_since.get(endpoint)
                if since is not None and now - max(since, self.store_back) > ROUTED_DOWN_S:
                    self.violate("routed_down", f"the proxy routes {kind} to {endpoint}, down for "
                                 f"{now - since:.0f}s")  # fmt: skip

    # ---- rollouts ----------------------------------------------------------------------------------------------
    def _hook_rollout_writes(self) -> None:
        """Every write of the rollout record is looked at as it happens (a step may leave `pending` and move on
        within one instant of virtual time)."""
        store = self.world.store
        write = store._write

        def watched(key: str, value: bytes | None, lease_id: int = 0, *, same_revision: bool = False) -> int:
            revision = write(key, value, lease_id, same_revision=same_revision)
            if key == self.rollout_key:
                self.on_rollout(Record.from_dict(json.loads(value)) if value is not None else None)
            return revision

        store._write = watched  # type: ignore[method-assign]

    def on_rollout(self, record: Record | None) -> None:
        self.rollout = record
        if record is None or not self.running:
            return
        for i, step in enumerate(record.steps):
            key = (record.id, i, bool(step.failed), step.rollback)
            before = self.steps_seen.get(key)
            if before == step.phase:
                continue
            self.steps_seen[key] = step.phase
            self.log(f"rollout {record.id} step {i + 1} ({','.join(step.groups)}"
                     f"{', back' if step.failed else ''}{', rollback' if step.rollback else ''}): {step.phase}")
            if step.phase == Phase.DRAINING and not step.failed:
                self.check_floor(record, i, step)
            if step.phase in RESTARTS and before not in RESTARTS:
                for g in step.groups:  # the step's one planned generation of each of its groups
                    self.license_group(g, f"rollout {record.id} step {i + 1}")

    def check_floor(self, record: Record, i: int, step: Step) -> None:
        """A step leaves `pending` (out of the proxy, then restarted) only while the floor its rules state holds:
        every kind keeps a serving group (unless the step takes its kind's outage, allowed), and no more than
        `max_unavailable` groups are down with it — judged on what runs, not on what the agents saw."""
        now = self.clock.monotonic()
        others = [g for g in self.layout.groups if g["name"] not in step.groups]
        down = sorted(g["name"] for g in others
                      if now - self.group_down.get(g["name"], now) >= FLOOR_GRACE_S)  # fmt: skip
        opts = record.options
        for kind in sorted({g["kind"] for g in self.layout.groups}):
            if kind in step.outage and kind in opts.allow_outage:
                continue
            serving = [g["name"] for g in others if g["kind"] == kind and g["name"] not in down]
            if not serving:
                self.violate("rollout_floor", f"rollout {record.id} step {i + 1} ({', '.join(step.groups)}) started "
                             f"with no other {kind} group serving (down: {', '.join(down) or 'none'})")  # fmt: skip
        if len(down) + len(step.groups) > opts.max_unavailable:
            self.violate("rollout_floor", f"rollout {record.id} step {i + 1} ({', '.join(step.groups)}) started while "
                         f"{', '.join(down)} were down: over --max-unavailable {opts.max_unavailable}")  # fmt: skip

    def check_mixed(self) -> None:
        """An incompatible change never has the proxy route to ranks of both KV connector settings at once."""
        proxy = self.world.proxy
        if proxy is None:
            return
        settings = {}
        for kind in ("prefill", "decode"):
            for endpoint in proxy.serving(kind):
                node, comp = self.ranks.get(endpoint, ("", None))
                if comp is not None and comp.running and node in self.connector:
                    settings[endpoint] = self.connector[node]
        if len(set(settings.values())) > 1:
            self.violate("mixed_routes", f"the proxy routes ranks of both KV connector settings: {settings}")

    def rollout_bound(self, record: Record) -> float:
        """From the rules' timeouts: each step left may drain, stage, restart, gate, rejoin and bake to its limit,
        and fail and go back the same way; then the members publish the file."""
        opts = record.options
        per_step = opts.drain_timeout_s + STAGE_TIMEOUT_S + 10.0 + opts.gate_timeout_s + REJOIN_TIMEOUT_S + opts.bake_s
        left = sum(1 for s in record.steps if s.phase in (Phase.PENDING, *RESTARTS, Phase.DRAINING, Phase.REJOINING,
                                                          Phase.BAKING))  # fmt: skip
        return max(left, 1) * 2 * per_step + PUBLISH_TIMEOUT_S + FILES_WAIT_S

    def write_files(self) -> None:
        """Every node's file as `ClusterHarness.write` makes it, with libyaml (a rollout installs files often)."""
        harness = self.world.harness
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        # the sections every node shares, dumped once: a top-level mapping's text is its keys' texts one after
        # the other (node and agent come last, as in ClusterHarness.write)
        shared = yaml.dump({k: v for k, v in harness.data.items() if k not in ("node", "agent")}, Dumper=dumper,
                           sort_keys=False)  # fmt: skip
        for name in harness.names:
            folder = harness.home / name
            own = {"node": {"name": name, "npus": 0},
                   "agent": {"state_dir": str(folder / "state"), "log_dir": str(folder / "logs"),
                             "systemd_scopes": "never",
                             "api": {"listen": f"127.0.0.1:{harness.api_ports[name]}",
                                     "token_file": str(folder / "token")}}}  # fmt: skip
            folder.mkdir(parents=True, exist_ok=True)
            text = shared + yaml.dump(own, Dumper=dumper, sort_keys=False)
            if not (path := harness.config_path(name)).is_file() or path.read_text() != text:
                path.write_text(text)

    def rollout_ended(self) -> bool:
        return self.rollout is None or not self.rollout.active

    def any_executor(self) -> Any:
        for name in self.layout.nodes:
            agent = self.world.agents.get(name)
            if agent is not None and agent.rollout is not None:
                return agent.rollout
        return None

    async def rollout_event(self, event: Event, node: str, executor: Any) -> None:
        kind = event.kind
        if kind == "rollout_control":
            action = ("pause", "abort", "rollback")[event.pick % 3]
            self.faults[f"rollout_{action}"] += 1
            self.command(f"operator on {node}: cluster rollout {action}", self.control(executor, action))
            if action == "pause":

                async def resume() -> None:
                    other = self.any_executor()
                    if other is None:
                        return self.later(5.0, resume)
                    self.command("operator: cluster rollout resume", self.control(other, "resume"))
                    return None

                self.later(event.duration, resume)
            return None
        record = self.rollout
        if record is not None and record.status == Status.HALTED:
            # the operator closes the halted one first (a halted rollout refuses the next)
            self.log(f"operator on {node}: cluster rollout abort (closing halted {record.id}): "
                     f"{await self.control(executor, 'abort')}")
        harness = self.world.harness
        saved = copy.deepcopy(harness.data)
        self.rollouts_started += 1
        n = self.rollouts_started
        options: dict[str, Any] = {"bake_s": (5, 20)[event.pick % 2], "drain_timeout_s": 30,
                                   "gate_timeout_s": 90}  # fmt: skip
        groups = harness.data["cluster"]["vllm_groups"]
        single = sorted({g["kind"] for g in groups if sum(o["kind"] == g["kind"] for o in groups) == 1})
        if kind == "rollout_incompatible":
            self.faults[kind] += 1
            pd = harness.data["cluster"].setdefault("pd", {})
            pd["use_ascend_direct"] = not pd.get("use_ascend_direct", True)
            options |= {"max_unavailable": max(2, len(groups) - 2), "allow_outage": ["decode", "prefill"]}
            what = f"the KV connector (use_ascend_direct={pd['use_ascend_direct']})"
        elif kind == "rollout_bad":
            self.faults[kind] += 1
            groups[event.pick % len(groups)]["nodes"] = ["nowhere"]
            what = "a file naming an unknown node"
        else:
            self.faults[kind] += 1
            choice = (event.pick >> 2) % 3
            changed = [g for g in groups if choice == 1 or (choice == 0 and g["kind"] == "prefill")] or groups
            if choice == 2:
                changed = [groups[(event.pick >> 4) % len(groups)]]
            for g in changed:
                g["env"] = {**g.get("env", {}), "VLLM_SIM_ROLLOUT": str(n)}
            options["max_unavailable"] = 1 + (event.pick >> 6) % 2
            if (event.pick >> 7) % 4:  # the operator allows what the plan needs (else: refused, nothing changes)
                options["allow_outage"] = single
            what = f"env of {', '.join(g['name'] for g in changed)}"
        self.write_files()
        before = record.id if record is not None else None
        configs = {name: stack.config for name, stack in self.world.stacks.items()}
        try:
            answer: Any = await executor.plan(None, options, dry_run=False, by="operator")
        except Exception as exc:
            answer = {"started": False, "refused": [f"{type(exc).__name__}: {exc}"]}
        started = bool(answer.get("started"))
        why = "; ".join(answer.get("refused") or answer.get("notes") or []).replace(str(harness.home), "~")[:300]
        self.log(f"operator on {node}: cluster rollout start ({what}, {options}): "
                 + ("started" if started else f"refused: {why}"))
        if started and record is not None and record.active:
            self.violate("second_rollout", f"a rollout started while {before} was {record.status}")
        if not started:
            after = self.rollout.id if self.rollout is not None else None
            changed_configs = [name for name, stack in self.world.stacks.items() if stack.config is not configs[name]]
            if after != before or changed_configs:
                self.violate("refused_changed", f"a refused rollout changed the record ({before} → {after}) or "
                             f"the config of {changed_configs}")  # fmt: skip
            harness.data = saved  # the operator puts the file back
            self.write_files()
        return None

    async def control(self, executor: Any, action: str) -> str:
        try:
            view = await executor.control(action, "operator")
        except Exception as exc:
            return f"refused: {exc}"
        return f"{(view.get('rollout') or {}).get('status')}"

    # ---- faults and commands -----------------------------------------------------------------------------------
    def node_of(self, event: Event) -> str:
        return self.layout.nodes[event.node % len(self.layout.nodes)]

    def later(self, seconds: float, what: Callable[[], Any]) -> None:
        async def run() -> None:
            await self.clock.sleep(seconds)
            result = what()
            if asyncio.iscoroutine(result):
                await result

        self.tasks.append(asyncio.ensure_future(run()))

    def command(self, what: str, call: Any, then: Callable[[Any], None] | None = None) -> None:
        """An operator's command runs beside the cluster (the CLI waits for its answer while time goes on)."""

        async def run() -> None:
            try:
                answer = await call
            except Exception as exc:
                answer = f"refused: {type(exc).__name__}: {exc}"
            else:
                if then is not None:
                    then(answer)
            self.log(f"{what}: {_rounded(answer)}")

        self.log(f"{what} ...")
        self.tasks.append(asyncio.ensure_future(run()))

    async def apply(self, event: Event) -> None:
        node = self.node_of(event)
        stack = self.world.stacks[node]
        kind = event.kind
        if self.container is not None and kind in self.container.kinds:
            return await self.container.apply(event, node)
        if self.pd is not None and kind in self.pd.kinds:
            return await self.pd.apply(event, node)
        if self.npu is not None and kind in self.npu.kinds:
            return await self.npu.apply(event, node)
        if kind in ("crash", "crash_pair"):
            running = sorted(n for n, c in stack.components.items() if c.running and not c.stopping and not c.dying)
            if not running:
                return self.log(f"skip {kind} on {node}: nothing running")
            name = running[event.pick % len(running)]
            targets = [(node, name)]
            group = self.group_of.get(node)
            if kind == "crash_pair" and group is not None:
                peers = [n for g in self.layout.groups if g["name"] == group for n in g["nodes"] if n != node]
                for peer in peers[:1]:
                    comp = self.world.stacks[peer].components.get("vllm")
                    if comp is not None and comp.running and not comp.stopping and not comp.dying:
                        targets = [(node, "vllm"), (peer, "vllm")] if stack.components["vllm"].running else targets
            for target_node, target in targets:
                tstack = self.world.stacks[target_node]
                comp = tstack.components[target]
                if not comp.running or comp.stopping or comp.dying:
                    continue
                comp.stop_s = min(event.duration, 40.0)
                self.faults["crash"] += 1
                self.license(target_node, target, f"crash of {target_node}/{target}")
                if comp.kind == "vllm" and target_node in self.group_of:
                    self.license_group(self.group_of[target_node], f"crash of {target_node}/{target}")
                elif comp.kind in ("datasystem", "etcd"):
                    self.license(target_node, "vllm", f"{target} crashed under it")  # its dependants may follow
                    for peer_node, g in self.group_of.items():
                        if peer_node == target_node:
                            self.license_group(g, f"{target} crashed under {target_node}'s rank")
                verdict = tstack.crash(target)  # without an agent: the tree is gone, nobody decides
                deciding = tstack.agent_alive and target_node not in self.paused_agents
                self.log(f"crash {target_node}/{target} (tree {comp.stop_s:.1f}s): {verdict}" if deciding
                         else f"crash {target_node}/{target} with no agent deciding")  # fmt: skip
            return None
        if kind == "agent_kill":
            if node not in self.world.agents or node in self.paused_agents:
                return self.log(f"skip agent_kill {node}: not running")
            self.faults[kind] += 1
            self.agent_fault(node)
            await self.world.kill_agent(node)
            self.log(f"agent {node} killed; back in {event.duration:.1f}s")
            self.later(event.duration, lambda: self.start_agent(node))
            return None
        if kind == "agent_pause":
            if node not in self.world.agents or node in self.paused_agents:
                return self.log(f"skip agent_pause {node}")
            # A stopped agent: its lease runs out, it decides nothing; then it goes on (its successor is itself).
            self.faults[kind] += 1
            self.agent_fault(node)
            self.paused_agents.add(node)
            await self.world.kill_agent(node)
            self.log(f"agent {node} paused for {event.duration:.1f}s (past its lease)")

            def resume() -> None:
                self.paused_agents.discard(node)
                self.start_agent(node)

            self.later(event.duration, resume)
            return None
        if kind == "etcd_down":
            if not self.world.store.reachable:
                return self.log("skip etcd_down: down already")
            self.faults[kind] += 1
            self.outage, self.outage_hit, self.outage_since = True, set(), self.clock.monotonic()
            self.world.store.set_reachable(False)
            self.log(f"etcd unreachable for {event.duration:.1f}s")

            def heal() -> None:
                self.outage = False
                self.world.store.set_reachable(True)
                self.log("etcd reachable again")

            self.later(event.duration, heal)
            return None
        if kind == "etcd_wipe":
            if not self.world.store.reachable:
                return self.log("skip etcd_wipe: etcd down")
            self.faults[kind] += 1
            self.epoch += 1
            self.world.store.wipe()
            self.rollout = None  # its record is gone with the rest
            self.log("etcd wiped")
            return None
        if kind == "compact":
            self.faults[kind] += 1
            self.world.store.compact(self.world.store.revision)
            self.log(f"etcd compacted at {self.world.store.revision}")
            return None
        if kind == "hang":
            running = sorted(n for n, c in stack.components.items() if c.running and not c.dying)
            if not running:
                return self.log(f"skip hang on {node}: nothing running")
            name = running[event.pick % len(running)]
            self.faults[kind] += 1
            self.license_component(node, name, f"hang of {node}/{name}")
            stack.host.hang(name, event.duration)
            return self.log(f"{node}/{name} hangs for {event.duration:.1f}s")
        if kind == "start_fail":
            comp = stack.components["datasystem"]
            self.faults[kind] += 1
            self.license_component(node, "datasystem", f"start failures of {node}/datasystem")
            stack.host.start_fail_until["datasystem"] = self.clock.monotonic() + event.duration
            if comp.running and not comp.dying:
                stack.crash("datasystem")
            return self.log(f"{node}/datasystem killed at every start for {event.duration:.1f}s")
        agent = self.world.agents.get(node)
        if agent is None:
            return self.log(f"skip {kind} on {node}: no agent")
        if kind in ROLLOUTS_ALL:
            return await self.rollout_event(event, node, agent.rollout)
        if kind == "op_restart":
            names = sorted(stack.components)
            name = names[event.pick % len(names)]
            self.faults[kind] += 1
            if self.real:
                self.license_component(node, name, f"operator restart of {node}/{name}")
            else:
                self.license(node, name, f"operator restart of {node}/{name}")
                if stack.components[name].kind == "vllm" and node in self.group_of:
                    self.license_group(self.group_of[node], f"operator restart of {node}/{name}")
            try:
                answer = stack.command(name, "restart")
            except Exception as exc:
                answer = f"refused: {exc}"
            else:
                self.acked.append((node, name, self.clock.monotonic(), f"restart {node}/{name}: {answer}"))
            self.log(f"operator: restart {node}/{name}: {answer}")
            return None
        if kind == "op_remote_restart":
            target = self.layout.nodes[event.pick % len(self.layout.nodes)]
            if "vllm" not in self.world.stacks[target].components or agent.coordinator.ops is None:
                return self.log(f"skip remote restart of {target}")
            self.faults[kind] += 1
            self.license(target, "vllm", f"remote restart of {target}/vllm")
            if target in self.group_of:
                self.license_group(self.group_of[target], f"remote restart of {target}/vllm")
            asked_at = self.clock.monotonic()

            def acked(answer: Any) -> None:
                if isinstance(answer, dict) and answer.get("ok"):
                    self.acked.append((target, "vllm", asked_at, f"--node {target} restart vllm: {answer}"))

            self.command(f"operator on {node}: --node {target} restart vllm",
                         agent.coordinator.ops.remote(target, "vllm", "restart", True, "operator"), acked)
            return None
        if kind == "node_pause" and self.real:
            if stack.paused and stack.pause_info()["scope"] == "node":
                return self.log(f"skip node_pause {node}")
            self.faults[kind] += 1
            stack.set_node_pause(True)
            self.log(f"operator: pause {node} for {event.duration:.1f}s")

            def resume_real() -> None:
                if stack.set_node_pause(False):
                    self.log(f"operator: resume {node}")
                else:
                    self.later(5.0, resume_real)  # no agent answered: the operator tries again

            self.later(event.duration, resume_real)
            return None
        if kind == "node_pause":
            if stack.node_pause is not None:
                return self.log(f"skip node_pause {node}")
            self.faults[kind] += 1
            stack.node_pause = {"by": "operator", "at": self.clock.time(), "reason": "simulated maintenance"}
            stack.notify()
            self.log(f"operator: pause {node} for {event.duration:.1f}s")

            def resume_node() -> None:
                stack.node_pause = None
                stack.notify()
                self.log(f"operator: resume {node}")

            self.later(event.duration, resume_node)
            return None
        if kind == "cluster_pause":
            self.faults[kind] += 1
            self.command(f"operator on {node}: cluster pause for {event.duration:.1f}s",
                         agent.coordinator.set_pause(True, "operator", "simulated maintenance"))

            async def resume_cluster() -> None:
                for name in self.layout.nodes:
                    a = self.world.agents.get(name)
                    if a is None:
                        continue
                    with contextlib.suppress(Exception):
                        await a.coordinator.set_pause(False, "operator")
                        self.log(f"operator on {name}: cluster resume")
                        return
                self.later(5.0, resume_cluster)  # no agent could: the operator tries again

            self.later(event.duration, resume_cluster)
            return None
        if kind == "cluster_redeploy":
            if agent.coordinator.ops is None:
                return self.log("skip cluster_redeploy")
            self.faults[kind] += 1
            self.license("*", "*", "cluster redeploy")
            for g in self.layout.groups:
                self.license_group(g["name"], "cluster redeploy")
            self.command(f"operator on {node}: cluster redeploy",
                         agent.coordinator.ops.ask_redeploy("simulated", "operator"))
            return None
        raise ValueError(f"unknown event kind {kind!r}")

    def agent_fault(self, node: str) -> None:
        """An agent gone past its lease: its groups may need one generation (a rank that died meanwhile)."""
        if node in self.group_of:
            self.group_causes[self.group_of[node]] += 1
            if self.outage:
                self.outage_hit.add(self.group_of[node])

    def start_agent(self, node: str) -> None:
        if node in self.world.agents:
            return
        self.world.start_agent(node)
        self.world.stacks[node].wake()  # a new agent looks at every component at once (the supervisor's start)
        self.log(f"agent {node} started (adopting)")

    # ---- liveness ----------------------------------------------------------------------------------------------
    def converged(self) -> str | None:
        """None once the cluster serves again; else what is still missing."""
        if any(n not in self.world.agents for n in self.layout.nodes):
            return "an agent is not running"
        for name, stack in self.world.stacks.items():
            if stack.paused:
                return f"{name} paused"
            for comp in stack.components.values():
                if not comp.up or comp.stopping or comp.dying:
                    return f"{name}/{comp.name} {comp.state}" + (f" (held: {comp.hold})" if comp.hold else "")
        proxy = self.world.proxy
        if proxy is not None:
            ranks = self.endpoint_ranks()
            for g in self.layout.groups:
                endpoints = {e for e, (n, _c) in ranks.items() if n in g["nodes"]}
                if endpoints and not endpoints & proxy.serving(g["kind"]):
                    return f"group {g['name']} not routed by the proxy"
        return None

    async def settle_rollout(self) -> None:
        """After the faults: the operator closes the rollout there is — a halted one waits for him (an incompatible
        one keeps its new groups out of the proxy), and so does a failed one (its way back failed; also one that
        fails while it is awaited): he rolls it back, as its message says; a paused one whose resume was refused
        (etcd away) he resumes — and the rollout must end within its bound."""
        for _ in range(3):
            record = self.rollout
            executor = self.any_executor()
            if record is not None and executor is not None and record.status in (Status.HALTED, Status.FAILED):
                answer = await self.control(executor, "rollback")
                self.log(f"operator: cluster rollout rollback (closing {record.status} {record.id}): {answer}")
            elif record is not None and executor is not None and record.status == Status.PAUSED:
                answer = await self.control(executor, "resume")
                self.log(f"operator: cluster rollout resume (paused {record.id}, its resume refused): {answer}")
            record = self.rollout
            if record is None or not record.active:
                return
            rollout_bound = self.rollout_bound(record)
            try:
                await self.world.until("the rollout to end", self.rollout_ended, within=rollout_bound)
            except AssertionError:
                self.violate("rollout_stuck", f"rollout {record.id} still {self.rollout and self.rollout.status} "
                             f"{rollout_bound:.0f}s after the faults healed: "
                             f"{self.rollout and self.rollout.message}")  # fmt: skip
                return

    def convergence_bound(self) -> float:
        """From the config's timeouts: the longest tree stop, the group's backoff at its cap, a lease, the proxy's
        re-add, a start, plus the barrier's own wait — with margin for a successor agent's adoption."""
        config = self.world.stacks[self.layout.nodes[0]].config
        vllm = config.components.get("vllm")
        backoff = float(getattr(getattr(vllm, "restart", None), "max_backoff_s", 60.0) or 60.0)
        bound = 40.0 + 2 * backoff + 3.0 + 5.0 + 60.0 + (self.container.extra_bound() if self.container else 0.0)
        bound += self.npu.extra_bound() if self.npu is not None else 0.0
        failed = [st.supervisor for st in self.world.stacks.values()
                  if self.real and st.supervisor is not None and st.supervisor.redeploys.failed]  # fmt: skip
        if failed:  # a failed node (policy: failed_after_redeploys) restarts anything at its backoff cap
            bound += max(c.cfg.restart.backoff_max_s for sup in failed for c in sup.components.values())
        return bound

    # ---- the whole run -----------------------------------------------------------------------------------------
    async def run(self) -> None:
        wall = time.perf_counter()
        if self.real:
            self.clock.install(asyncio.get_running_loop())  # type: ignore[attr-defined]
        self.world.start()
        await self.world.until("every component of every node up", self.world.all_up, within=300)
        await self.world.until("the proxy routes every group", lambda: self.converged() is None, within=120)
        self.started_at = self.clock.monotonic()
        self.running = True
        self.log(f"cluster up ({self.schedule.layout}: {len(self.layout.nodes)} nodes)")
        try:
            for event in self.schedule.events:
                wait = event.at - self.now()
                if wait > 0:
                    await self.world.advance(wait)
                await self.apply(event)
                await self.clock.settle()
                self.check()
                if self.real:
                    self.check_supervised()
            end = self.schedule.duration - self.now()
            if end > 0:
                await self.world.advance(end)
            # the faults heal: every pending heal runs, then the cluster must converge
            heal_by = max((e.at + e.duration for e in self.schedule.events), default=0.0) + 1.0
            if heal_by > self.now():
                await self.world.advance(heal_by - self.now())
            await self.settle_rollout()
            if self.npu is not None:
                await self.npu.heal()  # the chips replaced: the operator uncordons what is still isolated
            bound = self.convergence_bound()
            try:
                await self.world.until("convergence", lambda: self.converged() is None, within=bound)
            except AssertionError:
                self.violate("no_convergence", f"not converged {bound:.0f}s after the faults healed: "
                             f"{self.converged()}")  # fmt: skip
            if self.real:
                self.check_supervised()
            if self.container is not None:
                self.container.check_end()
            if self.pd is not None:
                await self.pd.finish()
            if self.npu is not None:
                self.npu.check_end()
            for node, name, when, what in self.acked:
                comp = self.world.stacks[node].components[name]
                if not any(start >= when for start in comp.starts):
                    self.violate("command_lost", f"the operator was answered ({what}) but {node}/{name} never "
                                 "started again")  # fmt: skip
            for group, gens in self.generations.items():
                made = len(gens) - 1
                if made > self.group_causes[group]:
                    self.violate("generations_per_fault", f"group {group}: {made} new generations for "
                                 f"{self.group_causes[group]} faults/commands")  # fmt: skip
        finally:
            self.running = False
            if self.pd is not None:
                self.pd.close()
            if self.npu is not None:
                self.npu.close()
            for task in self.tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*self.tasks, return_exceptions=True)
            await self.world.close()
            self.wall_s = time.perf_counter() - wall


def _rounded(value: Any) -> Any:
    """An answer as the trace shows it: times to the millisecond (float sums differ in the last bits)."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


def run_schedule(schedule: Schedule) -> Result:
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()  # the real node's state: no flushes
    # one folder per process, the same for each of its schedules: the files written there are then the same
    # text from one schedule to the next, and `parsed` finds them parsed
    home = Path(shm) / f"dsv4-sim-{os.getpid()}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    # the agents' own draws come from the seed too: the heartbeat's jitter (`random`), the ids they make (an
    # instance, an epoch, a command's key: `uuid4`) — drawn from the OS, two processes ordered a run's writes
    # differently (a command's key orders the commands, an epoch the barriers' ties)
    state, uuid4, ids = random.getstate(), uuid.uuid4, random.Random(f"ids/{schedule.seed}")
    random.seed(f"agents/{schedule.seed}")
    uuid.uuid4 = lambda: uuid.UUID(int=ids.getrandbits(128), version=4)
    try:
        sim = Simulation(schedule, home)
        asyncio.run(_quiet(sim.run()))
        return Result(schedule, sim.violations, sim.trace, sim.checks, sim.faults, sim.now(), sim.wall_s)
    finally:
        random.setstate(state)
        uuid.uuid4 = uuid4
        shutil.rmtree(home, ignore_errors=True)


async def _quiet(work: Any) -> None:
    from loguru import logger

    logger.remove()
    await work


def layout_for(seed: int, layout: str) -> str:
    """`mixed`: the seed chooses among the layouts (the shipped 8-node file, the local cluster, the small one)."""
    names = sorted(layouts())
    return names[seed % len(names)] if layout == "mixed" else layout


def node_for(seed: int, node: str) -> str:
    """`mixed`: one seed in four runs the real node (`sim_node`: ~2× the CPU of a fake one) — every other one of
    them in container mode (`sim_container`: the real node, its ranks in a simulated container), the rest with
    the NPU guards and ladder over simulated chips (`npu_for`) —, the others the fake stack; the CI budget stays
    within 5 minutes on 2 cores (docs/performance.md)."""
    if node != "mixed":
        return node
    return {1: "container", 5: "real"}.get(seed % 8, "fake")


def npu_for(seed: int, node: str, npu: bool = False) -> bool:
    """`mixed`: the seeds that run the plain real node (not in a container) get the chips too (`sim_npu`)."""
    return npu or (node == "mixed" and node_for(seed, node) == "real")


def run_seed(seed: int, layout: str, duration: float, node: str = "fake", npu: bool = False) -> dict[str, Any]:
    """One schedule, summed up (a worker process's answer: plain data)."""
    cpu = time.process_time()
    result = run_schedule(make_schedule(seed, layout_for(seed, layout), duration, node=node_for(seed, node),
                                        npu=npu_for(seed, node, npu)))  # fmt: skip
    return {"cpu_s": time.process_time() - cpu,
            "seed": seed, "layout": result.schedule.layout, "ok": result.ok, "report": describe(result),
            "violations": [asdict(v) for v in result.violations], "simulated_s": result.simulated_s,
            "wall_s": result.wall_s, "checks": result.checks, "faults": dict(result.faults),
            "node": result.schedule.node,
            "events": len(result.schedule.events), "replay": replay_line(result.schedule)}  # fmt: skip


def batch(first: int, count: int, layout: str, duration: float, jobs: int,
          node: str = "fake", npu: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """`count` seeds from `first` over `jobs` worker processes (each with PYTHONHASHSEED=0: replays match)."""
    import concurrent.futures
    import multiprocessing

    os.environ["PYTHONHASHSEED"] = "0"
    seeds = range(first, first + count)
    if jobs <= 1:
        return [run_seed(seed, layout, duration, node, npu) for seed in seeds]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        return list(pool.map(run_seed, seeds, [layout] * count, [duration] * count, [node] * count, [npu] * count,
                             chunksize=4))  # fmt: skip


def shrink(schedule: Schedule, invariant: str, budget: int = 200) -> Schedule:
    """The fewest events that still violate `invariant` (ddmin-style: chunks, then single events)."""

    def fails(s: Schedule) -> bool:
        return any(v.invariant == invariant for v in run_schedule(s).violations)

    current, tries = schedule, 0
    chunk = max(1, len(current.events) // 2)
    while chunk >= 1 and tries < budget:
        i, progressed = 0, False
        while i < len(current.events) and tries < budget:
            candidate = current.without(set(range(i, i + chunk)))
            tries += 1
            if candidate.events != current.events and fails(candidate):
                current, progressed = candidate, True
            else:
                i += chunk
        if not progressed:
            chunk //= 2
    return current


def describe(result: Result) -> str:
    s = result.schedule
    head = (f"seed {s.seed} layout {s.layout} duration {s.duration:g}s: {len(s.events)} events, "
            f"{result.checks} checks, {result.simulated_s:.0f}s simulated in {result.wall_s:.2f}s")  # fmt: skip
    if result.ok:
        return head + ": OK"
    return head + "\n" + "\n".join(f"  {v}" for v in result.violations)


def replay_line(s: Schedule) -> str:
    pd = " --pd" if any(e.kind.startswith("pd_") for e in s.events) else ""
    pd += " --npu" if any(e.kind.startswith("npu_") for e in s.events) else ""
    return (f"PYTHONHASHSEED=0 .venv/bin/python tests/simulation.py --seed {s.seed} --layout {s.layout} "
            f"--duration {s.duration:g} --node {s.node}{pd}")  # fmt: skip


def planted_found(schedules: Iterable[Schedule], invariants: set[str]) -> dict[str, Any] | None:
    """A planted bug's finding: the first of `schedules` that violates one of `invariants`, checked to replay its run
    event for event (its seed, the violation, the replay line); None when none does."""
    for schedule in schedules:
        result = run_schedule(schedule)
        hit = [v for v in result.violations if v.invariant in invariants]
        if hit:
            assert run_schedule(schedule).trace == result.trace, f"seed {schedule.seed} does not replay its run"
            return {"seed": schedule.seed, "violation": str(hit[0]), "replay": replay_line(schedule)}
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="the first seed (default: from the time)")
    parser.add_argument("--schedules", type=int, default=1)
    parser.add_argument("--layout", default="local-cluster", choices=[*sorted(layouts()), "64node", "mixed"])
    parser.add_argument("--duration", type=float, default=600.0, help="virtual seconds of faults per schedule")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--node", default="fake", choices=["fake", "real", "container", "mixed"],
                        help="each node's stack: the fake one, the real supervisor (sim_node), or every other seed")
    parser.add_argument("--rollouts", default="default", choices=["default", "all", "none"],
                        help="the rollout commands drawn: default (compatible ones), all (incompatible too), none")
    parser.add_argument("--pd", action="store_true", help="draw the PD watch's faults too (sim_pd; single runs)")
    parser.add_argument("--npu", action="store_true", help="the NPU guards and chip-reset ladder over simulated "
                        "chips, with chip faults, failed resets and uncordon (sim_npu; --node real)")
    parser.add_argument("--trace", action="store_true", help="print the whole trace of a single run")
    parser.add_argument("--shrink", action="store_true", help="shrink a failing single run")
    parser.add_argument("--json", type=Path, help="write the batch's summary here")
    args = parser.parse_args(argv)
    first = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    if args.schedules == 1:
        mix = {"default": None, "all": ROLLOUTS_ALL, "none": {}}[args.rollouts]
        result = run_schedule(make_schedule(first, layout_for(first, args.layout), args.duration,
                                            node=node_for(first, args.node), rollouts=mix, pd=args.pd,
                                            npu=npu_for(first, args.node, args.npu)))
        print(describe(result))
        if args.trace or not result.ok:
            print("\n".join(result.trace if args.trace else result.trace[-80:]))
        if not result.ok and args.shrink:
            small = shrink(result.schedule, result.violations[0].invariant)
            print(f"shrunk to {len(small.events)} events:")
            print("\n".join(f"  {asdict(e)}" for e in small.events))
            print("\n".join(run_schedule(small).trace))
        if not result.ok:
            print("replay: " + replay_line(result.schedule))
        return 0 if result.ok else 1
    started = time.perf_counter()
    results = batch(first, args.schedules, args.layout, args.duration, args.jobs, args.node, args.npu)
    wall = time.perf_counter() - started
    failed = [r for r in results if not r["ok"]]
    for r in failed:
        print(r["report"])
        print("  replay: " + r["replay"])
    print(summary_line(first, results, wall))
    if args.json:
        args.json.write_text(json.dumps(summary(first, results, wall), indent=1))
    return 1 if failed else 0


def summary(first: int, results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    faults: Counter[str] = Counter()
    violations: Counter[str] = Counter()
    for r in results:
        faults.update(r["faults"])
        violations.update(v["invariant"] for v in r["violations"])
    simulated = sum(r["simulated_s"] for r in results)
    return {"first_seed": first, "schedules": len(results), "failed": sum(not r["ok"] for r in results),
            "failed_seeds": [r["seed"] for r in results if not r["ok"]], "simulated_s": simulated,
            "wall_s": wall, "speed": simulated / max(wall, 1e-9),
            "cpu_s_per_schedule": sum(r["wall_s"] for r in results) / max(len(results), 1),
            "checks": sum(r["checks"] for r in results), "faults": dict(sorted(faults.items())),
            "violations": dict(sorted(violations.items())),
            "layouts": dict(Counter(r["layout"] for r in results)),
            "nodes": dict(Counter(r.get("node", "fake") for r in results))}  # fmt: skip


def summary_line(first: int, results: list[dict[str, Any]], wall: float) -> str:
    s = summary(first, results, wall)
    return (f"{s['schedules']} schedules from seed {first}: {s['failed']} failed; {s['simulated_s']:.0f}s simulated "
            f"in {wall:.1f}s ({s['speed']:.0f}x real time); {s['checks']} invariant checks; faults: {s['faults']}; "
            f"violations: {s['violations']}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())

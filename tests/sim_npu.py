"""The NPU guards and the chip-reset ladder in the whole-cluster simulation (`tests/simulation.py --npu`, real node
only): each node's **real** `layers.guards.StartGuards` — the `NpuMonitor` (its polls, `HealthEvaluator`'s levels
and debounces, the foreign-process rule, the start hold), `layers.chip_reset.NodeRecovery` (`LadderState.decide`,
`reset_plan`'s steps, the verify, isolation, `uncordon`, `recovery.json` across agents) — and the cluster's
`cluster.reset_drain.RecoveryFollower`, attached as `agent.Agent.layers` orders them, over a simulated chip set
behind the product's own seam (`layers.chip_reset.NpuHost`).

What is simulated (`SimNpus`, one per node): `npu-smi` and `hccn_tool` answer with the text the real tools print —
the very renderers of tests/fixtures/ascend/fake_ascend.py, the fake the real-process ladder test
(tests/test_recovery_system.py) runs — so `NpuTools`' parsers run too: eight 910B3 chips, each `OK` or `Alarm`
with error code 80CB8009 (RestartNPU: reset at once) or `Critical` (SeparateNPU: never reset, isolate), HBM at its
idle 3162 MB, and one process row per chip for every live tree of a vLLM rank (a tree being stopped still holds
its chips). `npu-smi set -t reset` answers as the fake does: `Status : Fail` while any process is on a chip, else
the reset (a whole node's on an A2) that clears a curable fault — or `Status : Fail` (`npu_reset_fail`) or no
answer until npu-smi's timeout (`npu_reset_hang`) while such a window lasts. Our PIDs are the supervisor's live
records, nobody else resets chips, no device file is held but through the table.

Faults (`NPU_FAULTS`, a stream of their own from `npu/SEED`): a rank's chip goes `Alarm` (a reset cures it; the
operator replaces it after 30–165 s at the latest), one a reset does not cure (the budget is spent: isolation), a
`Critical` chip (isolated at once), the node's resets failing or hanging for 10–100 s, and the operator's
`nodeagentctl uncordon` (the call the API's handler makes) on a node isolated or resetting if there is one.

Invariants (strict): `npu_beyond_ladder` — a stop the ladder asks (`cause="npu_reset"`) names only this node's NPU
users (never the worker, etcd or the proxy); other nodes' ranks stop only through their group's generation, which a
chip fault licenses (`restart_without_cause` otherwise); `ladder_order` — no isolation before the reset budget is
spent (`recovery.resets_per_chip_per_hour` resets since the last uncordon) unless a chip is `Critical` or the reset
found its chips held; `isolated_healthy` — no isolation once the chips have read OK for more than a poll period;
`npu_user_on_bad_chip` — no NPU user launched while its node is isolated or a reset runs
(from the ladder's stop to its start, or a reset command at the chips); after the faults heal and the operator's
last uncordon, the node converges (`no_convergence`, with the ladder's own times added to the bound) and the
ladder is at rest (`ladder_stuck`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "ascend"))
import fake_ascend

from nodeagent.cluster.proxy_evict import ProxyEvict
from nodeagent.cluster.reset_drain import RecoveryFollower
from nodeagent.config.model import Config
from nodeagent.core.process import ProcessRecord
from nodeagent.core.run import RunTimeout
from nodeagent.layers.chip_reset import NotIsolated
from nodeagent.layers.guards import StartGuards
from nodeagent.npu.tools import NpuTools

NPU_FAULTS: dict[str, float] = {
    "npu_chip_fault": 3.0,     # a rank's chip Alarm (80CB8009, RestartNPU): a reset cures it
    "npu_chip_sticky": 1.0,    # ... one no reset cures: the budget is spent, the node isolated until uncordon
    "npu_chip_critical": 0.5,  # a chip Critical (SeparateNPU): isolated at once, never reset
    "npu_reset_fail": 1.0,     # the node's resets answer `Status : Fail` for a while
    "npu_reset_hang": 0.5,     # the node's resets answer nothing until npu-smi's timeout, for a while
    "npu_uncordon": 2.5,       # nodeagentctl uncordon (a node isolated or resetting if there is one)
}  # fmt: skip
NPU_GAP_S = 30.0
"""The mean gap between two of them (on top of the seed's other events)."""
NPUS = 8
IDLE_HBM_MB = 3162
RANK_HBM_MB = 50_000
RESET_TAKES_S = 2.0
"""How long `npu-smi set -t reset` runs when it works."""
RECOVERY = {"resets_per_chip_per_hour": 2, "pause_after_reset_s": 10.0, "idle_timeout_s": 60.0,
            "stop_timeout_s": 120.0}  # fmt: skip
"""The ladder's limits in these schedules: two resets per chip (isolation within a schedule), a short pause."""
ALARM = {"health": "Alarm", "error_codes": ["80CB8009"]}
CRITICAL = {"health": "Critical", "error_codes": ["80E18005"]}


def npu_users(config: Config) -> list[str]:
    """What holds the chips in this world (the checker's own fact, not the ladder's rule it checks): the vLLM ranks,
    and a datasystem worker with RH2D device ids."""
    return [n for n, c in config.active_components().items()
            if c.kind == "vllm" or (c.kind == "datasystem" and getattr(c, "remote_h2d_device_ids", None))]  # fmt: skip


def npu_config(config: Config) -> Config:
    """The node's config on an A2: eight NPUs, no RoCE polls (links are not simulated), the ladder's limits above."""
    node = msgspec.structs.replace(config.node, npus=NPUS,
                                   npu_health=msgspec.structs.replace(config.node.npu_health, roce=False))  # fmt: skip
    recovery = msgspec.structs.replace(config.recovery, **RECOVERY)
    return msgspec.structs.replace(config, node=node, recovery=recovery)


@dataclass
class ChipFault:
    npu: int
    state: dict[str, Any]
    """Its row as the fake's scenario says it (`ALARM`, `CRITICAL`)."""
    heals_at: float
    """When the operator has replaced it (virtual monotonic)."""
    reset_cures: bool


@dataclass
class SimNpus:
    """One node's chips (`NpuHost`): npu-smi's answers from the faults and the node's process table."""

    node: str
    sim: Any
    stack: Any
    faults: dict[int, ChipFault] = field(default_factory=dict)
    reset_fail_until: float = 0.0
    reset_hang_until: float = 0.0
    resetting: int = 0
    """Reset commands running at the chips now."""
    resets: int = 0
    healthy_since: float = 0.0
    critical_gone: float = float("-inf")
    """When the last `Critical` chip was replaced (the monitor may see it for one more poll period)."""
    """When the last fault went (replaced or cured by a reset): the chips read OK since, if none is left."""

    @property
    def clock(self) -> Any:
        return self.sim.clock

    def now(self) -> float:
        return float(self.clock.monotonic())

    def heal_due(self) -> None:
        now = self.now()
        for npu, fault in list(self.faults.items()):
            if fault.heals_at <= now:
                del self.faults[npu]
                self.healthy_since = max(self.healthy_since, fault.heals_at)
                if fault.state is CRITICAL:
                    self.critical_gone = max(self.critical_gone, fault.heals_at)
                self.sim.log(f"npu: {self.node} npu {npu} replaced (healthy)")

    def users_alive(self) -> list[tuple[int, str]]:
        """(pid, name) of every live tree of an NPU user here: each holds every chip (a rank of TP 8)."""
        users = set(npu_users(self.stack.config))
        return [(p.pid, p.component) for p in self.stack.host.procs.values() if p.component in users and not p.gone]

    def scenario(self) -> dict[str, Any]:
        self.heal_due()
        procs = [{"npu": n, "pid": pid, "name": "python3", "memory_mb": RANK_HBM_MB}
                 for pid, _ in self.users_alive() for n in range(NPUS)]  # fmt: skip
        chips: dict[str, Any] = {str(n): dict(f.state) for n, f in self.faults.items()}
        for p in procs:
            chips.setdefault(str(p["npu"]), {})["hbm_used_mb"] = IDLE_HBM_MB + RANK_HBM_MB
        return {"npus": NPUS, "hbm_used_mb": IDLE_HBM_MB, "chips": chips, "processes": procs}

    # ---- NpuHost -------------------------------------------------------------------------------------------
    def tools(self, spec: Any) -> NpuTools:
        return NpuTools("npu-smi", "hccn_tool", spec.timeout_s, runner=self)

    async def run(self, argv: list[str], timeout_s: float, stdin: bytes | None,
                  env: Any) -> tuple[int, str]:  # fmt: skip
        tool, args = argv[0].rsplit("/", 1)[-1], argv[1:]
        sc = self.scenario()
        if tool == "hccn_tool":
            return 0, "link status: UP\n" if "-link" in args else "net health status: Healthy\n"
        if args[:1] == ["set"]:
            return await self.reset(args, timeout_s, stdin, argv)
        if args == ["info"]:
            return 0, fake_ascend.npu_smi_info(sc)
        if args == ["info", "-m"]:
            return 0, fake_ascend.npu_smi_map(sc)
        opts = dict(zip(args[1::2], args[2::2], strict=False))
        npu = int(opts.get("-i", "-1"))
        if opts.get("-t") == "health":
            return 0, fake_ascend.npu_smi_health(sc, npu)
        if opts.get("-t") == "ecc":
            return 0, fake_ascend.npu_smi_ecc(sc, npu)
        return 255, f"Error parameter of -t: {opts.get('-t')}\n"

    async def reset(self, args: list[str], timeout_s: float, stdin: bytes | None,
                    argv: list[str]) -> tuple[int, str]:  # fmt: skip
        """`npu-smi set -t reset -i N -c 0`, as the fake answers it (its prompt, `Status`/`Message` lines)."""
        out = fake_ascend.RESET_PROMPT + "\n"
        if (stdin or b"").strip().lower() not in (b"y", b"yes"):
            return 255, out + "        Message                        : reset cancelled.\n"
        out += "        Message                        : resetting ...\n"
        if self.users_alive():
            self.sim.log(f"npu: {self.node} reset refused: a process holds a chip")
            return 255, out + "        Status                         : Fail\n" \
                              "        Message                        : device is busy.\n"  # fmt: skip
        now = self.now()
        self.resetting += 1
        try:
            if now < self.reset_hang_until:
                self.sim.log(f"npu: {self.node} reset hangs")
                await self.clock.sleep(timeout_s)
                raise RunTimeout(argv, timeout_s)
            await self.clock.sleep(RESET_TAKES_S)
        finally:
            self.resetting -= 1
        self.resets += 1
        if now < self.reset_fail_until:
            self.sim.log(f"npu: {self.node} reset fails")
            return 255, out + "        Status                         : Fail\n" \
                              "        Message                        : Reset card failed.\n"  # fmt: skip
        cured = [n for n, f in self.faults.items() if f.reset_cures]
        for n in cured:
            del self.faults[n]
            self.healthy_since = self.now()
        self.sim.log(f"npu: {self.node} reset done (cured: {cured or 'nothing'})")
        return 0, out + "        Status                         : OK\n" \
                        "        Message                        : Reset card successfully.\n"  # fmt: skip

    def pid_visible(self, pid: int) -> bool:
        return True

    async def our_pids(self, records: Iterable[ProcessRecord]) -> set[int]:
        procs = self.stack.host.procs
        return {r.pid for r in records if r.pid in procs and not procs[r.pid].gone
                and procs[r.pid].record.create_time == r.create_time}  # fmt: skip

    def resetter(self) -> str | None:
        return None

    async def holders(self, devices: list[str]) -> list[str]:
        """The device files' holders (`fuser`): none beyond what npu-smi's table lists."""
        return []


class NpuSim:
    """The NPU layers on every real node, the chips under them, their faults and invariants."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.kinds = frozenset(NPU_FAULTS)
        world = sim.world
        load, checked = world.config, world.load_checked
        world.config = lambda name: npu_config(load(name))
        world.load_checked = lambda path, name: npu_config(checked(path, name))
        self.chips: dict[str, SimNpus] = {}
        for name, stack in world.stacks.items():
            stack.config = npu_config(stack.config)
            self.chips[name] = SimNpus(name, sim, stack)
        self.guards: dict[str, StartGuards] = {}
        self.attempts: dict[str, list[float]] = {n: [] for n in world.stacks}
        """node → when each reset rung began since the node was last uncordoned (the ladder's budget)."""
        self.isolated: dict[str, str | None] = dict.fromkeys(world.stacks)
        """node → why its ladder isolated it, until the operator's uncordon is answered (across its agents)."""
        self.uncordons = 0
        world.node_layers = self.node_layers
        kill_agent, before_launch = world.kill_agent, sim.before_launch

        async def killed(name: str) -> None:
            guards = self.guards.pop(name, None)
            if guards is not None:
                for task in list(guards._tasks):
                    task.cancel()
            await kill_agent(name)

        def launched(stack: Any, comp: Any) -> None:
            before_launch(stack, comp)
            self.launched(stack, comp)

        world.kill_agent, sim.before_launch = killed, launched

    def node_layers(self, stack: Any, sup: Any, coordinator: Any) -> tuple[list[Any], list[Any], Any]:
        """As `agent.Agent.layers`: the guards and the ladder first, the drain after the proxy evict."""
        guards = StartGuards(sup, "off", self.chips[stack.node])
        self.guards[stack.node] = guards
        real_restart, real_emit = sup.restart, sup.events.emit

        def restart(names: Sequence[str], reason: str, *, planned: bool, cause: str = "gang") -> None:
            if cause == "npu_reset":
                self.ladder_stops(stack, names, reason)
            real_restart(names, reason, planned=planned, cause=cause)

        def emit(event: str, message: str, component: str | None = None, level: str = "info", **data: Any) -> Any:
            self.on_event(stack.node, event, message)
            return real_emit(event, message, component, level, **data)

        sup.restart, sup.events.emit = restart, emit
        world = self.sim.world

        async def post(url: str, body: dict[str, Any]) -> dict[str, Any] | None:
            """What the proxy answers (`cluster_fakes.FakeProxy`); none yet: not reachable."""
            if world.proxy is None:
                raise OSError("no proxy yet")
            return await world.proxy.post(url, body)  # type: ignore[no-any-return]

        evict = ProxyEvict(coordinator, post)  # the agent gives its drain the proxy evict it attaches
        return [guards, guards.recovery], [RecoveryFollower(coordinator, sup, evict)], guards.start

    # ---- what the ladder does, checked -------------------------------------------------------------------------
    def ladder_stops(self, stack: Any, names: Sequence[str], reason: str) -> None:
        users = set(npu_users(stack.config))
        beyond = [n for n in names if n not in users]
        if beyond and self.sim.running:
            self.sim.violate("npu_beyond_ladder", f"{stack.node}: the ladder stops {beyond}, not NPU users "
                             f"({sorted(users)}): {reason}")  # fmt: skip

    def on_event(self, node: str, event: str, message: str) -> None:
        if not self.sim.running:
            return
        if event in ("npu_reset", "node_isolated", "node_uncordoned", "npu_reset_failed", "gang_drain"):
            self.sim.log(f"{node} {event}: {message}")
        group = self.sim.group_of.get(node)
        if event == "npu_reset":
            self.attempts[node].append(self.sim.clock.monotonic())
            if group is not None:  # the drain: one generation of the group per rung (reset_drain)
                self.sim.group_causes[group] += 1
        elif event == "node_isolated":
            self.isolated[node] = message
            self.judge_isolation(node, message)
            if group is not None:
                self.sim.group_causes[group] += 1
        elif event == "node_uncordoned":
            self.attempts[node].clear()

    def judge_isolation(self, node: str, message: str) -> None:
        guards = self.guards.get(node)
        if guards is None:
            return
        policy = guards.recovery.state.policy
        now = self.sim.clock.monotonic()
        spent = [t for t in self.attempts[node] if now - t < policy.reset_window_s]
        chips = self.chips[node]
        chips.heal_due()
        period = guards.npu.period_s
        if not chips.faults and now - chips.healthy_since > period + 1.0:
            self.sim.violate("isolated_healthy", f"{node} isolated while its chips have read OK for "
                             f"{now - chips.healthy_since:.0f}s (more than a poll period): {message}")  # fmt: skip
            return
        critical = any(f.state is CRITICAL for f in chips.faults.values()) or now - chips.critical_gone <= period + 1.0
        if critical or "chip reset impossible" in message or len(spent) >= policy.resets_per_chip:
            return
        self.sim.violate("ladder_order", f"{node} isolated after {len(spent)} reset(s) of a budget of "
                         f"{policy.resets_per_chip}, no chip Critical: {message}")  # fmt: skip

    def launched(self, stack: Any, comp: Any) -> None:
        if not self.sim.running or comp.name not in npu_users(stack.config):
            return
        guards = self.guards.get(stack.node)
        rec = guards.recovery if guards is not None else None
        why = None
        if self.isolated[stack.node] is not None:
            why = f"isolated ({self.isolated[stack.node]}) and not uncordoned"
        elif rec is not None and rec.rung is not None:
            why = f"a chip reset runs ({rec.rung.get('step')})"
        elif self.chips[stack.node].resetting:
            why = "a reset command runs at its chips"
        if why is not None:
            self.sim.violate("npu_user_on_bad_chip", f"{stack.node}/{comp.name} launched while {why}")

    # ---- faults and commands -----------------------------------------------------------------------------------
    def license(self, node: str, why: str) -> None:
        """A chip fault licenses what the ladder may stop: the node's NPU users and, through the drain, its group."""
        sim = self.sim
        for name in npu_users(sim.world.stacks[node].config):
            sim.license(node, name, why)
        if node in sim.group_of:
            sim.license_group(sim.group_of[node], why)

    async def apply(self, event: Any, node: str) -> None:
        sim = self.sim
        chips = self.chips[node]
        now = sim.clock.monotonic()
        kind = event.kind
        sim.faults[kind] += 1
        if kind in ("npu_chip_fault", "npu_chip_sticky", "npu_chip_critical"):
            npu = event.pick % NPUS
            state = CRITICAL if kind == "npu_chip_critical" else ALARM
            lasting = 30.0 + 3.0 * event.duration
            fault, was = ChipFault(npu, state, now + lasting, kind == "npu_chip_fault"), chips.faults.get(npu)
            if was is not None:  # a second fault of a faulty chip: the worse state, the later replacement
                fault = ChipFault(npu, CRITICAL if CRITICAL in (state, was.state) else ALARM,
                                  max(fault.heals_at, was.heals_at), fault.reset_cures and was.reset_cures)  # fmt: skip
            chips.faults[npu] = fault
            self.license(node, f"{kind} of {node} npu {npu}")
            return sim.log(f"npu: {node} npu {npu} {state['health']} ({kind}; replaced after {lasting:.0f}s)")
        if kind == "npu_reset_fail":
            chips.reset_fail_until = now + 10.0 + 2.0 * event.duration
            return sim.log(f"npu: {node}'s resets fail for {10.0 + 2.0 * event.duration:.0f}s")
        if kind == "npu_reset_hang":
            chips.reset_hang_until = now + 10.0 + 2.0 * event.duration
            return sim.log(f"npu: {node}'s resets hang for {10.0 + 2.0 * event.duration:.0f}s")
        if kind == "npu_uncordon":
            busy = sorted(n for n, g in self.guards.items()
                          if g.recovery.state.isolated is not None or g.recovery.rung is not None)  # fmt: skip
            return self.uncordon(busy[event.pick % len(busy)] if busy else node)
        raise ValueError(f"unknown NPU fault {kind!r}")

    def uncordon(self, node: str) -> None:
        """`nodeagentctl uncordon` on that node: the API's handler's call (a node not isolated: 409)."""
        guards = self.guards.get(node)
        if guards is None:
            return self.sim.log(f"operator: uncordon {node}: no agent answers")
        try:
            was = guards.recovery.uncordon("operator (sim)")
        except NotIsolated as exc:
            return self.sim.log(f"operator: uncordon {node} refused: {exc}")
        self.uncordons += 1
        self.isolated[node] = None
        if node in self.sim.group_of:
            self.sim.group_causes[self.sim.group_of[node]] += 1
        self.sim.log(f"operator: uncordon {node} (was isolated: {was})")

    # ---- the end -----------------------------------------------------------------------------------------------
    def extra_bound(self) -> float:
        """The ladder's own times on top of the cluster's: a poll, a reset's rung (stop, the reset, the settle, the
        verify) twice with its pause, npu-smi's timeout of a hung reset."""
        config = self.sim.world.stacks[self.sim.layout.nodes[0]].config
        rc, spec = config.recovery, config.node.npu_health
        return spec.period_s + 2 * (max(20.0, rc.settle_s) + RESET_TAKES_S + rc.pause_after_reset_s + spec.timeout_s)

    async def heal(self) -> None:
        """The chips replaced, the reset windows over; then the operator uncordons every node still isolated."""
        last = max((f.heals_at for c in self.chips.values() for f in c.faults.values()), default=0.0)
        last = max([last, *(max(c.reset_fail_until, c.reset_hang_until) for c in self.chips.values())])
        if last > self.sim.clock.monotonic():
            await self.sim.world.advance(last - self.sim.clock.monotonic() + 1.0)
        for chips in self.chips.values():
            chips.heal_due()
        # the operator waits for each ladder to come to rest (a rung under way, a failed reset's next rung may still
        # isolate) and uncordons what is isolated; an uncordon judges the chips afresh
        for _ in range(3):
            try:
                await self.sim.world.until("every ladder at rest", self.at_rest, within=self.extra_bound())
            except AssertionError:
                return  # `check_end` names it
            isolated = [n for n, g in sorted(self.guards.items()) if g.recovery.state.isolated is not None]
            if not isolated:
                return
            for node in isolated:
                self.uncordon(node)
            await self.sim.world.advance(1.0)

    def at_rest(self) -> bool:
        """No rung under way, no failed reset waiting for its next rung (isolated counts as at rest)."""
        return all(g.recovery.state.isolated is not None or (g.recovery.rung is None and g.recovery.unverified is None)
                   for g in self.guards.values())  # fmt: skip

    def check_end(self) -> None:
        for node, guards in sorted(self.guards.items()):
            rec = guards.recovery
            if rec.state.isolated is not None or rec.rung is not None:
                self.sim.violate("ladder_stuck", f"{node}'s ladder not at rest after the faults healed: "
                                 f"isolated={rec.state.isolated}, rung={rec.rung}")  # fmt: skip

    def close(self) -> None:
        for guards in self.guards.values():
            for task in list(guards._tasks):
                task.cancel()

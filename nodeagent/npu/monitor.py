"""The thin shell around the NPU facts: poll `NpuTools` every period, feed `HealthEvaluator`, tell the world.

One `NpuMonitor` per agent. It answers the questions the supervisor asks before a vLLM start
(`may_start_vllm()` → allowed, or held with reasons such as `npu 3 health Critical`), takes an operator's
override, emits an event whenever a fault appears or clears, and keeps the last snapshot for status, metrics
and the `npu` probe kind. Where `npu-smi` does not exist (a dev box) it checks nothing and says so: every
answer is "allowed, not checked: npu-smi not found", never an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.core.proctable import ProcessTable, scan
from nodeagent.npu.health import Change, Fault, HealthEvaluator, HealthPolicy, StartDecision, policy_from
from nodeagent.npu.tools import NpuSnapshot, NpuTools

if TYPE_CHECKING:
    from nodeagent.config.model import Config, NpuProbe
    from nodeagent.core.events import EventBus
    from nodeagent.core.process import ProcessRecord

OursFn = Callable[[], "set[int] | Awaitable[set[int] | None] | None"]
"""Our PIDs (the foreign-process rule): an async one reads the shared process table (`proctable.TABLES`)."""


def expected_npus(config: Config) -> int:
    """`node.npus`, else what the node's vLLM needs: TP × local DP ranks (0 without vLLM).

    A host without NPUs (a dev box running the stand-in) says so in its config, `node.npus: 0`: nothing here
    guesses it from a program's name."""
    if config.node.npus is not None:
        return config.node.npus
    need = 0
    for comp in config.active_components().values():
        if comp.kind == "vllm":
            local = comp.data_parallel_size_local or comp.data_parallel_size
            need = max(need, comp.tensor_parallel_size * local)
            if comp.visible_devices:  # one DP rank of several on this node: the NPUs up to its slice
                need = max(need, max(comp.visible_devices) + 1)
    return need


def our_pids(records: Iterable[ProcessRecord], table: ProcessTable | None = None) -> set[int]:
    """Every PID of these components' process trees (what is ours on the NPUs), from `table` or a pass over /proc
    now (blocking: the CLI's; the agent's monitor passes the shared table)."""
    table = table if table is not None else scan()
    return {pid for record in records for pid in table.tree(record)}


class NpuMonitor:
    def __init__(self, tools: NpuTools, policy: HealthPolicy, period_s: float = 10.0, detail_every: int = 6,
                 roce: bool = True, ours: OursFn | None = None, events: EventBus | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:  # fmt: skip
        """`clock` measures every duration (the debounces, a snapshot's freshness): monotonic, so a wall-clock
        step (NTP) neither ends nor stretches one; `wall` only dates what is shown and kept (a fault's `since`,
        `polled_at`: see `to_wall`)."""
        self.tools = tools
        self.evaluator = HealthEvaluator(policy)
        self.period_s = period_s
        self.detail_every = max(1, detail_every)
        self.roce = roce
        self.ours = ours
        self.events = events
        self.clock = clock
        self.wall = wall
        self.last: NpuSnapshot | None = None
        self.last_polled_at: float | None = None
        self.last_poll_s: float = 0.0
        self.polls = 0
        self.appeared_total: Counter[tuple[str, str]] = Counter()
        """(what, level) → faults that appeared since the agent started (metrics)."""
        self._inflight: asyncio.Task[NpuSnapshot | None] | None = None
        self.on_change: list[Callable[[], None]] = []
        """Called after a poll or an override changed the faults (e.g. `Supervisor.poke`, to re-check gates)."""

    @classmethod
    def from_config(cls, config: Config, spec: NpuProbe | None = None, ours: OursFn | None = None,
                    events: EventBus | None = None, clock: Callable[[], float] = time.monotonic,
                    wall: Callable[[], float] = time.time, tools: NpuTools | None = None) -> NpuMonitor:  # fmt: skip
        """`tools`: the NPU host's (`layers.chip_reset.NpuHost.tools`); default: this host's, as `spec` names them."""
        spec = spec or config.node.npu_health
        tools = tools or NpuTools.locate(spec.npu_smi, spec.hccn_tool, timeout_s=spec.timeout_s)
        return cls(tools, policy_from(spec, expected_npus(config)), spec.period_s, spec.detail_every, spec.roce,
                   ours, events, clock, wall)  # fmt: skip

    @property
    def policy(self) -> HealthPolicy:
        return self.evaluator.policy

    @property
    def skipped(self) -> str | None:
        """Why nothing is checked, or None."""
        return self.tools.missing

    @property
    def faults(self) -> list[Fault]:
        """The faults now, each `since` a wall-clock time (what /status shows and the recovery ladder compares
        with its own wall-clock times and the resets it keeps on disk)."""
        return [replace(f, since=self.to_wall(f.since)) for f in self.evaluator.faults]

    def to_wall(self, at: float) -> float:
        """A time of `clock` as wall-clock time now: after a wall-clock step it moves with it, so that
        `wall() - to_wall(at)` is always the true time since."""
        return self.wall() - (self.clock() - at)

    # ------------------------------------------------------------------------------------------- polling

    async def poll(self, begun_after_call: bool = False) -> NpuSnapshot | None:
        """One snapshot now (concurrent callers share it); None where npu-smi does not exist.

        `begun_after_call`: the snapshot must be read after this call (an uncordon judges the chips as they are
        now; a poll already under way may have read them before the operator fixed them)."""
        if self.skipped is not None:
            return None
        if begun_after_call and self._inflight is not None and not self._inflight.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._inflight)
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._poll())
        return await asyncio.shield(self._inflight)

    async def _poll(self) -> NpuSnapshot:
        began = time.monotonic()
        detail = self.polls % self.detail_every == 0
        snap = await self.tools.snapshot(detail=detail, roce=self.roce)
        self.polls += 1
        self.last_poll_s = time.monotonic() - began
        now = self.clock()
        ours = None
        if self.ours is not None:
            try:
                found = self.ours()
                ours = await found if inspect.isawaitable(found) else found
            except Exception:  # the foreign-process rule is skipped rather than the whole poll lost
                logger.exception("npu monitor: listing our PIDs failed")
        changes = self.evaluator.observe(snap, ours, now)
        self.last, self.last_polled_at = snap, now
        for change in changes:
            self._announce(change)
        if changes:
            self._notify()
        if snap.tool_errors:
            logger.debug("npu poll: {}", "; ".join(snap.tool_errors))
        return snap

    async def fresh(self) -> NpuSnapshot | None:
        """The last snapshot if younger than one period, else a new one."""
        if self.last_polled_at is not None and self.clock() - self.last_polled_at < self.period_s:
            return self.last
        return await self.poll()

    async def run(self) -> None:
        """Poll every period until cancelled (the agent runs this as a task)."""
        if self.skipped is not None:
            logger.info("NPU health not checked: {}", self.skipped)
            return
        while True:
            try:
                await self.poll()
            except Exception:  # a bug must not end the monitoring silently
                logger.exception("npu monitor poll failed")
            await asyncio.sleep(self.period_s)

    def _notify(self) -> None:
        for callback in self.on_change:
            try:
                callback()
            except Exception:
                logger.exception("npu monitor on_change callback failed")

    def _announce(self, change: Change) -> None:
        fault = change.fault
        if change.kind == "appeared":
            self.appeared_total[(fault.what, fault.level.name)] += 1
        if self.events is None:
            return
        holds = fault.level >= self.policy.hold_level and not fault.overridden
        if change.kind == "cleared":
            event, level, text = "npu_fault_cleared", "info", f"cleared: {fault.message}"
        else:
            event, level = "npu_fault", ("error" if holds else "warning")
            text = f"{fault.message} ({fault.level.name}{', holds vLLM starts' if holds else ''})"
        self.events.emit(event, text, None, level, npu=fault.npu, what=fault.what, fault_level=fault.level.name,
                         change=change.kind)  # fmt: skip

    # ------------------------------------------------------------------------------------------- answers

    def decision(self) -> StartDecision:
        """From what the last poll saw (no I/O)."""
        if self.skipped is not None:
            return StartDecision(True, (f"NPU health not checked: {self.skipped}",), checked=False)
        if self.last is None:
            return StartDecision(True, ("NPU health not polled yet",), checked=False)
        return self.evaluator.start_decision()

    async def may_start_vllm(self) -> StartDecision:
        """Ask before every vLLM start: a fresh poll if the last is older than a period, then the verdict."""
        with contextlib.suppress(Exception):
            await self.fresh()
        return self.decision()

    def override(self, npu: int | None = None, by: str = "operator") -> list[Fault]:
        """Start anyway despite the faults holding now (of `npu`, or all); they hold again if they clear
        and come back. Emits one event naming what was overridden."""
        done = [replace(f, since=self.to_wall(f.since)) for f in self.evaluator.override(npu)]
        if done and self.events is not None:
            self.events.emit("npu_override", f"{by} overrode: " + "; ".join(f.message for f in done), None,
                             "warning", npu=npu, faults=[f.to_dict() for f in done])  # fmt: skip
        if done:
            self._notify()
        return done

    def start_gate(self, component: Any, operator: bool = False) -> str | None:
        """A `Supervisor.gates` entry: holds vLLM starts (operator starts too: only `override` lets one
        through) while a fault holds; other kinds never wait on NPUs."""
        if getattr(component, "kind", None) != "vllm":
            return None
        decision = self.decision()
        return None if decision.allowed else "hardware: " + "; ".join(decision.reasons)

    async def check(self) -> tuple[bool, str, bool]:
        """The `npu` probe kind: (ok, one-line detail, skipped). Not ok only when a fault holds vLLM starts."""
        if self.skipped is not None:
            return True, f"skipped: {self.skipped}", True
        snap = await self.fresh()
        decision = self.evaluator.start_decision()
        if not decision.allowed:
            return False, "; ".join(decision.reasons), False
        minor = [f.message for f in self.faults if not f.overridden]
        count = len(snap.info.npu_ids) if snap is not None and snap.info is not None else 0
        links = " RoCE links checked," if snap is not None and snap.roce_checked else ""
        base = f"{count} NPUs healthy,{links} no fault holding vLLM" if not minor else "; ".join(minor)
        return True, base, False

    def status(self) -> dict[str, Any]:
        """For /status: what is checked, the faults, the verdict, per-NPU HBM and link state."""
        snap = self.last
        out: dict[str, Any] = {
            "checked": self.skipped is None, "skipped": self.skipped, "expected_npus": self.policy.expected_npus,
            "polled_at": None if self.last_polled_at is None else self.to_wall(self.last_polled_at),
            "faults": [f.to_dict() for f in self.faults],
            "start": {"allowed": self.decision().allowed, "reasons": list(self.decision().reasons)},
        }  # fmt: skip
        if snap is not None and snap.info is not None:
            out["npus"] = [
                {"npu": c.npu, "chip": c.chip, "name": c.name, "health": c.health, "hbm_used_mb": c.hbm_used_mb,
                 "hbm_total_mb": c.hbm_total_mb, "link": snap.links.get(c.npu)}
                for c in snap.info.chips
            ]  # fmt: skip
            out["processes"] = [{"npu": p.npu, "pid": p.pid, "name": p.name, "memory_mb": p.memory_mb}
                                for p in snap.info.processes]  # fmt: skip
        elif snap is not None:
            out["error"] = snap.error
        return out

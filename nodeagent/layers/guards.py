"""What holds a start besides the supervisor's own gate: a failed preflight, and broken NPU hardware.

Both answer the node's start gate (the agent attaches the guards as a `stackport.NodeLayer`), so they hold
without counting failures or escalating. Preflight
runs before the stack first starts and again every minute while it fails (an operator fixing the host sees
the stack start without restarting the agent); an operator's start of a component passes it, `--force` or
`agent.preflight: warn|off` turns it off. The NPU monitor holds vLLM starts while a fault of hold level is
active; only an operator override lets one through.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.core.task_owner import log_death
from nodeagent.layers.chip_reset import HostNpu, NodeRecovery, NpuHost
from nodeagent.layers.worker_headroom import WorkerHeadroom
from nodeagent.npu.monitor import NpuMonitor
from nodeagent.seam.stackport import ComponentView, Hold, HoldKind, MemberReport, StackPort

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.core.events import EventBus
    from nodeagent.core.failure import Failure
    from nodeagent.core.process import ProcessRecord
    from nodeagent.layers.preflight import PreflightReport
    from nodeagent.seam.host import Clock

PREFLIGHT_RECHECK_S = 60.0
PER_COMPONENT_CHECKS = frozenset({"ports", "npu_processes", "npu_health"})
"""Failures the agent already handles per component, with the holder named: a busy port or a foreign NPU
process holds that component's start (residue), a sick chip holds vLLM (NPU monitor). They do not hold the
whole stack."""


class GuardedNode(StackPort, Protocol):
    """What the guards (and the ladder, the headroom they make) use of the node: the port, and beside it the
    config, the event bus the NPU monitor reports on, where the monitor is given, the processes that are ours
    (a foreign NPU process is one that is not), a change to tell of, and the node's redeploy times."""

    config: Config
    events: EventBus
    clock: Clock

    def use_npu_monitor(self, npu: NpuMonitor) -> None: ...

    def process_records(self) -> Mapping[str, ProcessRecord]: ...

    def state_changed(self) -> None: ...

    @property
    def redeploys(self) -> Any:
        """The node's redeploy policy (`redeploy_times`: when each node redeploy began)."""


class StartGuards:
    def __init__(self, supervisor: GuardedNode, mode: str = "enforce", host: NpuHost | None = None) -> None:
        """`host`: where the NPUs are (`HostNpu`: this host's tools, /proc; a simulation gives its chip set)."""
        self.host: NpuHost = host or HostNpu()
        self.sup = supervisor
        self.mode = mode
        """enforce: a FAIL holds the stack; warn: reported only; off: not run."""
        self.report: PreflightReport | None = None
        self.blocking: list[str] = []
        clock = supervisor.clock
        self.npu = NpuMonitor.from_config(supervisor.config, ours=self._our_pids, events=supervisor.events,
                                          clock=clock.monotonic, wall=clock.time,
                                          tools=self.host.tools(supervisor.config.node.npu_health))  # fmt: skip
        self.npu.on_change.append(supervisor.wake)
        supervisor.use_npu_monitor(self.npu)
        self.recovery = NodeRecovery(supervisor.config, supervisor, self.npu, changed=supervisor.state_changed,
                                     redeploy_times=lambda: list(supervisor.redeploys.redeploy_times), clock=clock,
                                     host=self.host)  # fmt: skip
        """The ladder past node redeploy (chip reset, isolation): a layer of its own, after this one."""
        self.headroom = WorkerHeadroom(supervisor.config, supervisor)
        """A SIGKILLed worker's shared memory (openYuanrong FAQ §3): a layer of its own, after the ladder."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._announced: tuple[str, ...] = ()

    async def _our_pids(self) -> set[int]:
        return await self.host.our_pids(self.sup.process_records().values())

    @property
    def has_vllm(self) -> bool:
        return any(c.kind == "vllm" for c in self.sup.snapshot().components.values())

    # ---- what the node asks (NodeLayer) -------------------------------------------------------------------
    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        if self.blocking and not operator:
            return Hold(HoldKind.PREFLIGHT, "preflight failed: " + "; ".join(self.blocking)
                        + " (nodeagentctl preflight for the fixes)", operator_passes=True,
                        resolves_itself=False)  # fmt: skip
        why = self.npu.start_gate(comp, operator)
        return Hold(HoldKind.NPU_FAULT, why, resolves_itself=False) if why else None

    def decide(self, comp: ComponentView, failure: Failure) -> None:
        return None  # a failure is the policy's (or the cluster's): the guards only hold starts

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> None:
        return None

    def status_section(self) -> dict[str, Any]:
        return {}  # the API adds `status()` itself (the preflight report is not for status.json)

    def member_report(self) -> MemberReport | None:
        return None

    def on_node_change(self) -> None:
        pass

    # ---- preflight ----------------------------------------------------------------------------------------
    async def run_preflight(self) -> None:
        if self.mode == "off":
            return
        from nodeagent.layers.preflight import run_preflight

        self.report = await asyncio.to_thread(run_preflight, self.sup.config)
        failed = [c for c in self.report.failed if c.name not in PER_COMPONENT_CHECKS]
        blocking = [f"{c.name}: {c.value}" for c in failed] if self.mode == "enforce" else []
        if tuple(blocking) != self._announced:
            if blocking:
                self.sup.events.emit("preflight_failed", "preflight failed, the stack is held: " + "; ".join(blocking),
                                     None, "error", checks=[c.name for c in failed])  # fmt: skip
            elif self._announced:
                self.sup.events.emit("preflight_passed", "preflight passes now: starting the stack")
            self._announced = tuple(blocking)
        for check in self.report.failed if self.mode == "warn" else ():
            self.sup.events.emit("preflight_warning", f"preflight {check.name}: {check.value}", None, "warning")
        self.blocking = blocking
        self.sup.wake()

    async def _recheck_preflight(self) -> None:
        while True:
            await asyncio.sleep(PREFLIGHT_RECHECK_S)
            if self.blocking:
                await self.run_preflight()

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Before the stack starts: preflight once, then keep watching the hardware and a failing preflight."""
        await self.run_preflight()
        self._spawn(self._recheck_preflight(), "preflight-recheck")
        if self.has_vllm and self.npu.skipped is None:
            self._spawn(self.npu.run(), "npu-monitor")
            self._spawn(self.recovery.run(), "recovery-ladder")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(log_death)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def override_npu(self, npu: int | None, by: str) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.npu.override(npu, by)]

    def status(self) -> dict[str, Any]:
        report = self.report
        return {
            "preflight": None if report is None else {
                "mode": self.mode, "blocking": self.blocking, "counts": report.counts(),
                "failed": [c.name for c in report.failed], "warnings": [c.name for c in report.warnings],
            },
            "npu": self.npu.status(),
        }  # fmt: skip

"""Probe semantics as Kubernetes defines them, split like its prober: pure result evaluation, worker loops.

`ProbeTracker` turns a probe's results into a status with hysteresis: `failure` only after
`failure_threshold` consecutive failures, `success` only after `success_threshold` consecutive successes,
otherwise the previous status stands. One departure from Kubernetes: a result marked `definite` fails at
once. The `vllm_progress` probe debounces over time itself (it reports a stall only once nothing moved for
`stall_after_s`; an errored engine cannot heal), so the threshold would only add periods to a verdict that
is already certain; its failed canaries and scrapes still count against `failure_threshold`.

`ComponentProber` runs one worker task per probe: startup probes first (each stops once it succeeds); when
every startup probe has succeeded, liveness and readiness probes run, each at its own period. It only
reports, through `on_change(role, status, result)`: the supervisor decides (startup or liveness `failure`
→ restart; readiness → ready or not).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from loguru import logger

from nodeagent.config.model import ProbeBase
from nodeagent.config.probe_defaults import ROLES
from nodeagent.probes.kinds import ProbeContext, ProbeResult, ResolvedProbe, probe_state
from nodeagent.seam.host import Clock

Status = Literal["unknown", "success", "failure"]
Phase = Literal["stopped", "startup", "running"]
OnChange = Callable[[str, Status, ProbeResult | None], None]
"""(role, new status, the result that caused it; None when the role has no probes and succeeds at once)."""
OnResult = Callable[[str, ResolvedProbe, ProbeResult], None]


class ProbeTracker:
    """Consecutive-result counting for one probe (Kubernetes' worker.go `resultRun`), no I/O."""

    def __init__(self, spec: ProbeBase) -> None:
        self.spec = spec
        self.status: Status = "unknown"
        self.consecutive_successes = 0
        self.consecutive_failures = 0
        self.runs = 0
        self.failures_total = 0
        self.last: ProbeResult | None = None

    def observe(self, result: ProbeResult) -> Status:
        self.runs += 1
        self.last = result
        if result.ok:
            self.consecutive_successes += 1
            self.consecutive_failures = 0
            if self.consecutive_successes >= self.spec.success_threshold:
                self.status = "success"
        else:
            self.failures_total += 1
            self.consecutive_failures += 1
            self.consecutive_successes = 0
            if result.definite or self.consecutive_failures >= self.spec.failure_threshold:
                self.status = "failure"
        return self.status

    @property
    def budget_s(self) -> float:
        """How long a startup probe may keep failing: initial delay + period × failure threshold."""
        return self.spec.initial_delay_s + self.spec.period_s * self.spec.failure_threshold

    def snapshot(self) -> dict[str, Any]:
        last = self.last
        return {
            "status": self.status,
            "consecutive_successes": self.consecutive_successes,
            "consecutive_failures": self.consecutive_failures,
            "runs": self.runs,
            "failures_total": self.failures_total,
            "last": None
            if last is None
            else {"ok": last.ok, "detail": last.detail, "latency_s": round(last.latency_s, 6), "at": last.at,
                  **({"skipped": True} if last.skipped else {})},
        }


def aggregate(statuses: Sequence[Status]) -> Status:
    """A role is failed if any probe failed, succeeded if all did (or it has none), else unknown."""
    if "failure" in statuses:
        return "failure"
    if all(s == "success" for s in statuses):
        return "success"
    return "unknown"


class ComponentProber:
    """Runs one component's probes with startup gating; see the module docstring for the semantics.

    Callbacks run inside the worker tasks: keep them synchronous and cheap (schedule real work). An
    exception in one is logged and swallowed. They may call `reset()`/`start()`; results of the old
    generation are then dropped. Callbacks never fire from inside `start()` or `reset()` themselves.
    """

    def __init__(
        self,
        name: str,
        probes: Mapping[str, Sequence[ResolvedProbe]],
        context: ProbeContext,
        on_change: OnChange,
        on_result: OnResult | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        unknown = set(probes) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown probe roles {sorted(unknown)} (known: {', '.join(ROLES)})")
        self.name = name
        self.probes: dict[str, list[ResolvedProbe]] = {role: list(probes.get(role, ())) for role in ROLES}
        self.context = context
        self.on_change = on_change
        self.on_result = on_result
        self.clock = clock or Clock()
        """The host's clock (the simulation's virtual one): start times and initial delays count on it."""
        self.phase: Phase = "stopped"
        self.started_at: float | None = None
        self._started_mono = 0.0
        """`started_at` on the monotonic clock: the initial delays count on it (a wall-clock step must not stretch
        or skip them)."""
        self.startup_succeeded_at: float | None = None
        self._gen = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._fresh()

    def _fresh(self) -> None:
        self.trackers = {role: [ProbeTracker(p.spec) for p in self.probes[role]] for role in ROLES}
        self.states = {role: [probe_state(p) for p in self.probes[role]] for role in ROLES}
        self.role_status: dict[str, Status] = dict.fromkeys(ROLES, "unknown")
        self.startup_succeeded_at = None

    # ------------------------------------------------------------------------------------------ control

    def start(self, started_at: float | None = None) -> None:
        """Probe a new process from the startup phase with fresh trackers; `started_at` is its wall-clock
        start (an adopted process's create_time), from which every `initial_delay_s` counts."""
        self._cancel()
        self._fresh()
        now = self.clock.time()
        self.started_at = now if started_at is None else started_at
        self._started_mono = self.clock.monotonic() - max(0.0, now - self.started_at)
        self.phase = "startup"
        gen = self._gen
        if self.probes["startup"]:
            for index in range(len(self.probes["startup"])):
                self._spawn(gen, "startup", index)
        else:
            asyncio.get_running_loop().call_soon(self._startup_complete, gen, None)

    def reset(self, started_at: float | None = None) -> None:
        """Forget every result (a new process); if probing, start over from the startup phase."""
        if self.phase == "stopped":
            self._cancel()
            self._fresh()
        else:
            self.start(started_at)

    async def stop(self) -> None:
        """Cancel every worker (an in-flight probe's subprocess is killed) and wait for them; keep results."""
        self._cancel()
        self.phase = "stopped"
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_once(self, role: str) -> list[ProbeResult]:
        """Run a role's probes once, concurrently, without touching the trackers (CLI, diagnostics)."""
        if role not in ROLES:
            raise ValueError(f"unknown probe role {role!r} (known: {', '.join(ROLES)})")
        return list(await asyncio.gather(*(self.context.run(p) for p in self.probes[role])))

    # ----------------------------------------------------------------------------------------- queries

    def status(self, role: str) -> Status:
        return self.role_status[role]

    @property
    def live(self) -> bool:
        return self.phase == "running" and self.role_status["liveness"] != "failure"

    @property
    def ready(self) -> bool:
        return self.phase == "running" and self.role_status["readiness"] == "success"

    @property
    def startup_budget_s(self) -> float:
        """The longest any startup probe may keep failing before startup counts as failed (0: none)."""
        return max((t.budget_s for t in self.trackers["startup"]), default=0.0)

    @property
    def startup_deadline(self) -> float | None:
        """Wall-clock time by which startup should have succeeded if probes finish within their period."""
        return None if self.started_at is None else self.started_at + self.startup_budget_s

    @property
    def startup_exhausted(self) -> bool:
        """A startup probe reached its failure threshold: the supervisor should restart the component."""
        return any(t.status == "failure" for t in self.trackers["startup"])

    def snapshot(self) -> dict[str, Any]:
        roles: dict[str, Any] = {}
        for role in ROLES:
            probes = []
            for probe, tracker in zip(self.probes[role], self.trackers[role], strict=True):
                spec = probe.spec
                probes.append(
                    {
                        "kind": probe.kind,
                        "target": probe.target,
                        "period_s": spec.period_s,
                        "timeout_s": spec.timeout_s,
                        "failure_threshold": spec.failure_threshold,
                        "success_threshold": spec.success_threshold,
                        **tracker.snapshot(),
                    }
                )
            roles[role] = {"status": self.role_status[role], "probes": probes}
        return {
            "component": self.name,
            "phase": self.phase,
            "started_at": self.started_at,
            "startup_budget_s": self.startup_budget_s,
            "startup_deadline": self.startup_deadline,
            "startup_exhausted": self.startup_exhausted,
            "startup_succeeded_at": self.startup_succeeded_at,
            "roles": roles,
        }

    # ---------------------------------------------------------------------------------------- internals

    def _cancel(self) -> None:
        self._gen += 1
        for task in self._tasks:
            task.cancel()

    def _spawn(self, gen: int, role: str, index: int) -> None:
        task = asyncio.get_running_loop().create_task(
            self._worker(gen, role, index), name=f"probe:{self.name}:{role}:{index}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _emit(self, role: str, status: Status, result: ProbeResult | None) -> None:
        try:
            self.on_change(role, status, result)
        except Exception:
            logger.exception("probe on_change callback failed for {} {} {}", self.name, role, status)

    def _observe(self, gen: int, role: str, index: int, result: ProbeResult) -> None:
        self.trackers[role][index].observe(result)
        if self.on_result is not None:
            try:
                self.on_result(role, self.probes[role][index], result)
            except Exception:
                logger.exception("probe on_result callback failed for {} {}", self.name, role)
            if gen != self._gen:
                return
        status = aggregate([t.status for t in self.trackers[role]])
        if status != self.role_status[role]:
            self.role_status[role] = status
            self._emit(role, status, result)
            if gen != self._gen:
                return
        if role == "startup" and status == "success" and self.phase == "startup":
            self._startup_complete(gen, result)

    def _startup_complete(self, gen: int, result: ProbeResult | None) -> None:
        """Every startup probe succeeded: liveness and readiness take over (roles without probes succeed)."""
        if gen != self._gen or self.phase != "startup":
            return
        self.phase = "running"
        self.startup_succeeded_at = self.clock.time()
        if result is None:
            self.role_status["startup"] = "success"
            self._emit("startup", "success", None)
        for role in ("liveness", "readiness"):
            if gen != self._gen:
                return
            if self.probes[role]:
                for index in range(len(self.probes[role])):
                    self._spawn(gen, role, index)
            else:
                self.role_status[role] = "success"
                self._emit(role, "success", None)

    async def _worker(self, gen: int, role: str, index: int) -> None:
        probe = self.probes[role][index]
        spec = probe.spec
        loop = asyncio.get_running_loop()
        assert self.started_at is not None
        delay = self._started_mono + spec.initial_delay_s - self.clock.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        next_at = loop.time()
        while gen == self._gen:
            try:
                result = await self.context.run(probe, self.states[role][index])
                if gen != self._gen:
                    return
                self._observe(gen, role, index, result)
            except Exception:  # run() and _observe() do not raise; a bug must not silently end probing
                logger.exception("probe worker {}:{}:{} failed", self.name, role, index)
            if role == "startup" and self.trackers[role][index].status == "success":
                return  # like Kubernetes: a startup probe stops once it has succeeded
            next_at += spec.period_s
            now = loop.time()
            if next_at < now:  # the probe overran its period: skip the missed ticks
                next_at += math.ceil((now - next_at) / spec.period_s) * spec.period_s
            await asyncio.sleep(next_at - now)

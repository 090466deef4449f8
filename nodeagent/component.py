"""One component's state machine: a single task consumes one signal queue, so exits, probe results and
operator commands are handled strictly in order and never race each other.

    stopped ──start──▶ starting ──startup ok──▶ running ◀──▶ ready
       ▲                  │   ╲                    │
       │               failure  exit / liveness failure / restart / dependency restart
       │                  ▼                         ▼
       └──desired stop── stopping ──failure──▶ backoff ──delay──▶ starting
                                   ╲─escalation─▶ node redeploy · failed (still retrying at the cap)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from nodeagent.errors import AdoptError, LaunchError
from nodeagent.process import ExitWatch, ProcessRecord, record_of, stop_tree, verify

if TYPE_CHECKING:
    import subprocess

    from nodeagent.supervisor import Supervisor


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"


@dataclass(frozen=True)
class Signal:
    kind: str
    """exited | startup_ok | startup_failed | liveness_failed | ready | not_ready | stop | restart | wake
    | dep_restart"""
    gen: int | None = None
    """The process generation it concerns; stale signals of an older process are dropped."""
    detail: str = ""


COMMANDS = frozenset({"stop", "restart", "wake", "dep_restart"})


class Component:
    def __init__(self, name: str, spec: Any, supervisor: Supervisor) -> None:
        self.name = name
        self.cfg = spec
        self.kind: str = spec.kind
        self.sup = supervisor
        self.state = State.STOPPED
        self.ready = False
        self.up = asyncio.Event()
        self.signals: asyncio.Queue[Signal] = asyncio.Queue()
        self.gen = 0
        self.record: ProcessRecord | None = None
        self.popen: subprocess.Popen[bytes] | None = None
        self.watch: ExitWatch | None = None
        self.started_at: float | None = None
        self.restarts = 0
        self.last_exit: dict[str, Any] | None = None
        self.backoff_until: float | None = None
        self.held: str | None = None
        self.fingerprint: str | None = None
        self.prober: Any = None

    # ---- signals -------------------------------------------------------------------------------------------
    def signal(self, kind: str, gen: int | None = None, detail: str = "") -> None:
        self.signals.put_nowait(Signal(kind, gen, detail))

    async def _next(self) -> Signal:
        while True:
            sig = await self.signals.get()
            if sig.gen is None or sig.gen == self.gen:
                return sig

    def _set(self, state: State, message: str = "", level: str = "info", **data: Any) -> None:
        if state != self.state or message:
            old, self.state = self.state, state
            self.sup.events.emit("state", message or f"{old} → {state}", self.name, level, state=str(state),
                                 previous=str(old), **data)  # fmt: skip
            self.sup.state_changed()

    # ---- the loop ------------------------------------------------------------------------------------------
    async def run(self, adopt: ProcessRecord | None) -> None:
        while True:
            if adopt is None:
                await self._until_wanted()
            launched = await self._start(adopt)
            adopt = None
            if not launched:
                continue
            outcome, detail = await self._supervise()
            await self.stop_process(detail)
            if outcome == "failure":
                await self.sup.archive_failure(self, detail)
                await self._after_failure(detail)
            elif outcome == "restart":
                self.restarts += 1
                self._drain({"restart"})

    async def _until_wanted(self) -> None:
        """Wait until the operator wants it running, no pause holds it, and its dependencies are up."""
        while True:
            why = self.sup.blocked(self)
            if why is None:
                return
            if self.record is None and self.state in (State.BACKOFF, State.FAILED, State.UNHEALTHY):
                self._set(State.STOPPED, f"not restarting: {why}")
            if why != self.held:
                self.held = why
                self.sup.events.emit("held", f"waiting: {why}", self.name)
            waiters = [asyncio.ensure_future(self.signals.get())]
            waiters += [asyncio.ensure_future(self.sup.components[d].up.wait()) for d in self.sup.deps(self)]
            waiters.append(asyncio.ensure_future(self.sup.intent_changed.wait()))
            try:
                done, _ = await asyncio.wait(waiters, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
            finally:
                # Also when we are cancelled (redeploy, shutdown): an orphaned queue getter would swallow
                # the next signal — the exit of the process the new task starts.
                for w in waiters:
                    w.cancel()
            if waiters[0] in done and not waiters[0].cancelled():
                sig = waiters[0].result()
                if sig.kind == "restart":
                    self.sup.set_desired(self.name, "running")

    async def _start(self, adopt: ProcessRecord | None) -> bool:
        self.held = None
        self.gen += 1
        self.ready = False
        if adopt is not None:
            try:
                verify(adopt)
            except AdoptError as exc:
                self.sup.events.emit("adopt_failed", f"cannot adopt pid {adopt.pid}: {exc}", self.name, "warning")
                return False
            self.record, self.popen = adopt, None
            self._set(State.STARTING, f"adopted running pid {adopt.pid}", pid=adopt.pid)
        else:
            self._set(State.STARTING)
            try:
                await self.sup.before_start(self)
                launched = await self.sup.launch(self)
            except LaunchError as exc:
                self.last_exit = {"at": time.time(), "reason": f"launch failed: {exc}", "code": None}
                self.sup.events.emit("launch_failed", str(exc), self.name, "error")
                await self.sup.archive_failure(self, f"launch failed: {exc}")
                await self._after_failure(f"launch failed: {exc}")
                return False
            self.record, self.popen = launched.record, launched.popen
            self.sup.events.emit("started", f"started pid {self.record.pid} (output: {launched.output})",
                                 self.name, pid=self.record.pid)  # fmt: skip
        self.started_at = time.time()
        self.sup.remember(self)
        self.watch = ExitWatch(self.record.pid, self.popen)
        gen = self.gen
        self.watch.done.add_done_callback(
            lambda fut: self.signal("exited", gen, "" if fut.cancelled() else f"code {fut.result()}")
        )
        self.sup.start_probes(self)
        return True

    async def _supervise(self) -> tuple[str, str]:
        while True:
            sig = await self._next()
            if sig.kind == "startup_ok":
                self._refresh_record()
                self.up.set()
                self.sup.policy_started(self)
                self._set(State.RUNNING, f"up after {time.time() - (self.started_at or time.time()):.1f}s")
            elif sig.kind in ("ready", "not_ready"):
                self.ready = sig.kind == "ready"
                if self.state in (State.RUNNING, State.READY):
                    self._set(State.READY if self.ready else State.RUNNING)
            elif sig.kind == "exited":
                self.last_exit = {"at": time.time(), "reason": f"exited ({sig.detail})", "code": sig.detail}
                return "failure", f"process exited unexpectedly ({sig.detail})"
            elif sig.kind in ("startup_failed", "liveness_failed"):
                self._set(State.UNHEALTHY, f"{sig.kind.replace('_', ' ')}: {sig.detail}", "warning")
                self.last_exit = {"at": time.time(), "reason": f"{sig.kind}: {sig.detail}", "code": None}
                return "failure", f"{sig.kind}: {sig.detail}"
            elif sig.kind == "stop":
                return "stop", "stop requested"
            elif sig.kind in ("restart", "dep_restart"):
                return "restart", sig.detail or "restart requested"

    def _refresh_record(self) -> None:
        """Re-read the cmdline once up: launchers such as the venv's `etcd` wrapper exec the real binary
        after we recorded the PID, and adoption compares the cmdline."""
        if self.record is None:
            return
        with contextlib.suppress(LaunchError):
            fresh = record_of(self.record.pid)
            if abs(fresh.create_time - self.record.create_time) < 0.05 and fresh.cmdline != self.record.cmdline:
                self.record = fresh
                self.sup.remember(self)

    async def stop_process(self, why: str) -> None:
        """Stop this component's whole tree (if any) and forget it; dependents follow per their edges."""
        self.up.clear()
        self.ready = False
        self.sup.stop_probes(self)
        self.sup.dependency_going_down(self)
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        record = self.record
        if record is not None:
            self._set(State.STOPPING, f"stopping pid {record.pid}: {why}")
            result = await stop_tree(record, self.cfg.stop_grace_s, self.name)
            self.sup.events.emit("stopped", f"stopped pid {record.pid}", self.name, **result)
        self.record = None
        self.popen = None
        self.sup.forget(self)
        self._set(State.STOPPED)

    async def _after_failure(self, detail: str) -> None:
        decision = self.sup.policy_failure(self, detail)
        if decision is None:
            return
        self.restarts += 1
        if decision.action == "redeploy":
            self.sup.request_redeploy(f"{self.name}: {detail}")
            return
        if decision.action == "failed":
            self._set(State.FAILED, decision.reason, "critical", retry_in_s=decision.delay_s)
            await self._sleep_interruptibly(decision.delay_s)
            self.sup.request_redeploy(f"{self.name}: retry after failed state")
            return
        if decision.delay_s > 0:
            self.backoff_until = time.time() + decision.delay_s
            if decision.action != "failed":
                self._set(State.BACKOFF, f"restart in {decision.delay_s:.0f}s: {decision.reason}", "warning",
                          delay_s=decision.delay_s, consecutive_failures=decision.consecutive_failures)
            await self._sleep_interruptibly(decision.delay_s)

    async def _sleep_interruptibly(self, delay: float) -> None:
        """Back off, but an operator's start/restart/stop cuts the wait short."""
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    while True:
                        sig = await self._next()
                        if sig.kind in ("restart", "wake", "stop"):
                            if sig.kind == "stop":
                                self.signal("wake")
                            return
        finally:
            self.backoff_until = None

    def _drain(self, kinds: set[str]) -> None:
        """Coalesce: commands of these kinds queued while one was being carried out are already done."""
        keep = []
        while not self.signals.empty():
            sig = self.signals.get_nowait()
            if sig.kind not in kinds:
                keep.append(sig)
        for sig in keep:
            self.signals.put_nowait(sig)

    # ---- views ---------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.time()
        return {
            "kind": self.kind,
            "state": str(self.state),
            "desired": self.sup.desired(self.name),
            "pid": self.record.pid if self.record else None,
            "ready": self.ready,
            "up": self.up.is_set(),
            "restarts": self.restarts,
            "uptime_s": round(now - self.started_at, 1) if self.started_at and self.record else None,
            "last_exit": self.last_exit,
            "backoff_remaining_s": round(self.backoff_until - now, 1) if self.backoff_until else None,
            "held": self.held,
            "probes": self.prober.snapshot() if self.prober is not None else {},
            "policy": self.sup.policy_view(self),
        }

"""One component's state machine: a single task consumes one signal queue, so exits, probe results and
operator commands are handled strictly in order and never race each other.

    stopped ──gate open──▶ starting ──startup ok──▶ running ◀──▶ ready
       ▲  ▲                   │   ╲                    │
       │  └─held (foreign     │  failure     exit / liveness failure / restart / dependency restart
       │    port, paused...)  ▼                         ▼
       └──desired stop──── stopping ◀──draining (planned restart of vLLM)
                              │
                           failure ──▶ backoff ──delay──▶ starting
                                    ╲─▶ failed: permanent (retry at the cap) · node redeploy · node failed

The component decides nothing about policy: it asks its host (`ComponentHost`, below) whether it may start,
how to launch, and what a failure means, and reports what it observes. It owns its data: the host reads it and
changes it only through the methods here (`reconfigure`, `refresh_record`, `attach_prober`, `restore_history`,
`scanned_clean`, `record_load`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.core.errors import AdoptError, LaunchError, MissingPrerequisite
from nodeagent.core.failure import Failure, exit_text
from nodeagent.core.heartbeat import HOST_MARGIN_S, PREPARE_BOUND_S, TICK_S, Heartbeat
from nodeagent.core.loadtime import LOADS_KEPT, remember
from nodeagent.core.process import ProcessRecord
from nodeagent.core.states import COMMANDS, SERVING_STATES, Signal, SignalKind, SignalName, State
from nodeagent.node.bindrace import BindRaceRetries
from nodeagent.node.component_status import component_status
from nodeagent.node.drain import drain_end
from nodeagent.node.failure_path import FailurePath
from nodeagent.seam.host import Clock, Process, StartHeld
from nodeagent.seam.stackport import Hold

if TYPE_CHECKING:
    from collections.abc import Sequence

    from nodeagent.core.events import EventBus
    from nodeagent.node.blast_radius import Blast
    from nodeagent.seam.policy import RestartDecision

__all__ = ["COMMANDS", "Component", "ComponentHost", "Signal", "State"]

HOLD_RECHECK_S = 2.0
HOLD_LOG_EVERY_S = 60.0
DRAIN_POLL_S = 1.0


class ComponentHost(Protocol):
    """What a component needs from whoever runs it: a small interface instead of the whole supervisor.

    Four jobs: **gate** (may it start now, and what to wait on), **launch** (clean residue, spawn, stop),
    **decide** (what a failure means), **observe** (bookkeeping: persist, probe, tell dependents). The supervisor
    implements it; tests replace its OS work with a fake launcher and a fake clock, so the state machine is
    exercised without processes or sleeps."""

    events: EventBus
    clock: Clock

    # ---- gate
    def start_gate(self, comp: Component, operator: bool) -> Hold | None:
        """Why it may not start now (desired stopped, paused, dependency down, held...), or None."""

    def gate_waiters(self, comp: Component) -> list[Awaitable[Any]]:
        """Awaitables that complete when the gate's answer may have changed."""

    # ---- launch
    async def prepare(self, comp: Component) -> None:
        """Prerequisites and residue before a start; raises StartHeld, or LaunchError(permanent=...)"""

    async def launch(self, comp: Component) -> Process: ...

    async def adopt(self, comp: Component, record: ProcessRecord) -> Process:
        """Watch a process a previous agent started; raises AdoptError when it is not the recorded one."""

    async def terminate(self, comp: Component, proc: Process, why: str) -> dict[str, Any]:
        """Stop the process's whole tree."""

    def output_tail(self, comp: Component, proc: Process) -> tuple[str, ...]:
        """The last lines it printed (for a failure's reason)."""

    def drain_timeout(self, comp: Component) -> float | None:
        """How long a planned stop may wait for in-flight requests; None: this kind is not drained."""

    async def inflight(self, comp: Component) -> tuple[int, int] | None:
        """(running, waiting) requests right now; None when they cannot be read."""

    # ---- decide
    def decide(self, comp: Component, failure: Failure) -> RestartDecision | None:
        """What a failure leads to; None: no automatic action (paused, held). Asked as soon as the failure is known,
        while its tree is being stopped (`stopping`, `running`: `component_failure`): decide and note, never wait."""

    def capture(self, comp: Component, failure: Failure) -> Any:
        """What explains a failure, taken before anything is stopped or cleaned (fast: no file reads)."""

    def archive(self, comp: Component, failure: Failure, evidence: Any, tree: Any,
                decision: RestartDecision | None) -> None:  # fmt: skip
        """Write the failure's post-mortem bundle in the background (off the crash path)."""

    def request_redeploy(self, reason: str, components: Sequence[str] | None = None) -> bool:
        """A node redeploy of these components (None: the whole node)."""

    def blast(self, blast: Blast, origin: str | None = None) -> tuple[str, ...]:
        """What a redeploy of this failure class may touch (`blast_radius`)."""

    # ---- observe
    def on_process(self, comp: Component) -> None:
        """Its process record changed (started, adopted, refreshed, gone): persist it, probe it or stop probing."""

    def on_up(self, comp: Component) -> None:
        """The startup probes passed."""

    def on_going_down(self, comp: Component) -> None:
        """Its process is about to be stopped: dependents follow per their edges."""

    def on_state(self, comp: Component) -> None:
        """Its state changed: persist status, tell listeners."""


class Component(FailurePath):
    def __init__(self, name: str, spec: Any, host: ComponentHost) -> None:
        self.name = name
        self.cfg = spec
        self.kind: str = spec.kind
        self.host = host
        self.bind_retries = BindRaceRetries(name)
        self.state = State.STOPPED
        self.probe_ready = False
        self.ready_blockers: dict[str, str] = {}
        """Reasons besides its probes why it must not be reported ready (draining, no healthy backend...)."""
        self.up = asyncio.Event()
        self.gone = asyncio.Event()
        """Set while no process of ours exists: cleared at a launch or adoption, set again only once the stop of
        its whole tree returned (not when the stop began)."""
        self.gone.set()
        self.signals: asyncio.Queue[Signal] = asyncio.Queue()
        self.gen = 0
        self.proc: Process | None = None
        self.started_at: float | None = None
        """The process's real start time (the kernel's, for an adopted one)."""
        self.restarts = 0
        self.restarts_by_cause: dict[str, int] = {}
        self.loads: list[float] = []
        """Seconds from start to up, the last few times (`loadtime`)."""
        self._restart_cause = "operator"
        self.last_exit: dict[str, Any] | None = None
        self.failure: Failure | None = None
        """The last failure, classified; kept across restarts to recognise the same error twice."""
        self.backoff_until: float | None = None
        self.hold: Hold | None = None
        """Why it waits to start (a typed hold: compared by kind, never by its text)."""
        self._hold_logged_at = float("-inf")
        self.operator_start = False
        """An operator asked for a start: it passes the pause gate (operator commands work while paused)."""
        self.fingerprint: str | None = None
        self.prober: Any = None
        self.stopped_cleanly = False
        """The last process was stopped by us, whole, and nothing of it survived: the next start may skip the
        scan of every process for leftovers."""
        self.adoption_tried = False
        """The previous agent's record of its process was tried (adopted, or found gone): `NodeView.adoptable`
        no longer lists it."""
        self.extra_status: dict[str, Any] = {}
        """What the host adds to this component's status (draining, gang generation...)."""
        self.internal_errors = 0
        """Consecutive internal errors of its loop (`_internal_error`): their backoff; reset once it is up."""
        self.heartbeat = Heartbeat(host.clock.monotonic())
        """Ticked on every iteration and bounded wait of its loop: the agent's watchdog ping requires it fresh."""

    @property
    def ready(self) -> bool:
        return self.probe_ready and not self.ready_blockers

    @ready.setter
    def ready(self, value: bool) -> None:
        self.probe_ready = value

    def block_ready(self, key: str, reason: str | None) -> None:
        """Set (or with None, clear) a reason for not being ready; the state follows."""
        if reason is None:
            if self.ready_blockers.pop(key, None) is None:
                return
        elif self.ready_blockers.get(key) == reason:
            return
        else:
            self.ready_blockers[key] = reason
        if self.state in SERVING_STATES:
            self._set(State.READY if self.ready else State.RUNNING)
        else:
            self.host.on_state(self)

    @property
    def record(self) -> ProcessRecord | None:
        return self.proc.record if self.proc is not None else None

    @property
    def running(self) -> bool:
        """A process of ours exists, also while it is being stopped (until its whole tree is gone)."""
        return self.proc is not None

    # ---- what the host may change ----------------------------------------------------------------------------
    def reconfigure(self, spec: Any) -> None:
        """A reloaded config: the next start uses it (a running process keeps what it was launched with)."""
        self.cfg = spec

    def refresh_record(self, record: ProcessRecord) -> bool:
        """The same process, re-read (a launcher exec'd the real binary after we recorded it); False if not ours."""
        if self.proc is None or self.proc.record.pid != record.pid:
            return False
        self.proc.record = record
        return True

    def attach_prober(self, prober: Any) -> Any:
        """Probe this process with `prober` (None: no longer probed); returns the previous one, to stop it."""
        old, self.prober = self.prober, prober
        return old

    def scanned_clean(self) -> None:
        """A scan found nothing of its last process alive: the next start may skip the scan (not while one runs)."""
        self.stopped_cleanly = self.stopped_cleanly or self.proc is None

    def record_load(self, now: float) -> float | None:
        """This launch's time from start to up, kept with the last few (`loadtime`); None: its start is unknown."""
        if not self.started_at:
            return None
        self.loads = remember(self.loads, now - self.started_at)
        return self.loads[-1]

    def restore_history(self, saved: dict[str, Any]) -> None:
        """Restart count, last exit and failure as the previous agent left them."""
        self.restarts = int(saved.get("restarts") or 0)
        by_cause = saved.get("restarts_by_cause")
        self.restarts_by_cause = {str(k): int(v) for k, v in by_cause.items()} if isinstance(by_cause, dict) else {}
        self.last_exit = saved.get("last_exit")
        self.loads = [float(x) for x in saved.get("loads") or [] if isinstance(x, int | float)][-LOADS_KEPT:]
        if saved.get("failure"):
            self.failure = Failure.from_dict(saved["failure"])

    # ---- signals -------------------------------------------------------------------------------------------
    def signal(self, kind: SignalKind | SignalName, gen: int | None = None, detail: str = "", *, operator: bool = False,
               drain: bool = True, cause: str = "") -> None:  # fmt: skip
        self.signals.put_nowait(Signal(SignalKind(kind), gen, detail, operator, drain, cause))

    def count_restart(self, cause: str) -> None:
        """One restart, for this cause: `restarts` is the sum of `restarts_by_cause`."""
        self.restarts += 1
        self.restarts_by_cause[cause] = self.restarts_by_cause.get(cause, 0) + 1

    async def _next(self) -> Signal:
        while True:
            sig = await self.signals.get()
            if sig.gen is None or sig.gen == self.gen:
                return sig

    def _set(self, state: State, message: str = "", level: str = "info", **data: Any) -> None:
        if state != self.state or message:
            old, self.state = self.state, state
            self.host.events.emit("state", message or f"{old} → {state}", self.name, level, state=str(state),
                                  previous=str(old), **data)  # fmt: skip
            self.host.on_state(self)

    # ---- the loop ------------------------------------------------------------------------------------------
    def tick(self) -> None:
        self.heartbeat.tick(self.host.clock.monotonic())

    def _busy(self, seconds: float, doing: str) -> None:
        """Host work that may rightly take `seconds` without a tick (plus a margin): the watchdog waits that long."""
        self.heartbeat.busy(self.host.clock.monotonic(), seconds + HOST_MARGIN_S, doing)

    async def run(self, adopt: ProcessRecord | None) -> None:
        """Supervise for as long as the task runs: an exception of one cycle (a bug, an OSError of the host) is the
        failure path's `_internal_error`, and the loop goes on — only a cancel ends it."""
        while True:
            self.tick()
            try:
                await self._cycle(adopt)
            except Exception as exc:
                await self._internal_error(exc)
            adopt = None

    async def _cycle(self, adopt: ProcessRecord | None) -> None:
        """One start, its supervision and its end."""
        if self.proc is not None:  # left by an internal error whose stop failed: never a second process beside it
            await self.stop_process("left running by an internal error")
        if adopt is None:
            await self._until_startable()
        if not await self._start(adopt):
            return
        outcome, detail, failure, drain = await self._supervise()
        if failure is not None:
            await self._failed(failure, detail)
            return
        if drain:
            await self._drain(detail)
        await self.stop_process(detail)
        if outcome == "restart":
            self.count_restart(self._restart_cause)
            self._drain_queue({"restart"})
            self.host.on_state(self)

    async def _until_startable(self) -> None:
        """Wait until the one start gate opens: desired running, not paused (unless an operator asked),
        dependencies up, nothing holding it."""
        while True:
            self.tick()
            why = self.host.start_gate(self, self.operator_start)
            if why is None:
                self.hold = None  # the gate is open: what held it no longer does
                return
            resting = (State.BACKOFF, State.UNHEALTHY) if why.is_pause else (
                State.BACKOFF, State.UNHEALTHY, State.FAILED)  # a failed component stays visible while paused
            if self.proc is None and self.state in resting:
                self._set(State.STOPPED, f"not restarting: {why}")
            self._hold(why)
            waiters = [asyncio.ensure_future(self.signals.get())]
            waiters += [asyncio.ensure_future(w) for w in self.host.gate_waiters(self)]
            try:
                done, _ = await asyncio.wait(waiters, timeout=HOLD_RECHECK_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                # Also when we are cancelled (redeploy, shutdown): an orphaned queue getter would swallow
                # the next signal — the exit of the process the new task starts.
                for w in waiters:
                    w.cancel()
            if waiters[0] in done and not waiters[0].cancelled():
                self._take_command(waiters[0].result())

    def _take_command(self, sig: Signal) -> None:
        if sig.kind in ("restart", "wake") and sig.operator:
            self.operator_start = True

    @property
    def held(self) -> str | None:
        """The hold's reason, as status and events show it."""
        return self.hold.reason if self.hold is not None else None

    def _hold(self, why: Hold) -> None:
        """Show a hold; log it when what holds changes, and once a minute while only its wait grows (a rank at
        a barrier for 30 min would otherwise log a line a second)."""
        if why == self.hold:
            return
        old, self.hold = self.hold, why
        now = self.host.clock.time()
        same = old is not None and old.kind == why.kind and (
            old.data == why.data if why.data else old.reason == why.reason)
        if not same or now - self._hold_logged_at >= HOLD_LOG_EVERY_S:
            self._hold_logged_at = now
            self.host.events.emit("held", f"waiting: {why.reason}", self.name, hold=str(why.kind))
        self.host.on_state(self)

    async def _start(self, adopt: ProcessRecord | None) -> bool:
        self.gen += 1
        self.ready = False
        if adopt is not None:
            try:
                self._busy(0.0, "adopting")
                self.proc = await self.host.adopt(self, adopt)
            except AdoptError as exc:  # it died while no agent watched: the start that follows is a restart
                self.adoption_tried = True
                self.last_exit = {"at": self.host.clock.time(), "reason": f"died unwatched: {exc}", "code": None}
                self.count_restart("crash")
                self.host.events.emit("adopt_failed", f"cannot adopt pid {adopt.pid}: {exc}", self.name, "warning")
                return False
            self.hold = None
            self.adoption_tried = True
            self.gone.clear()
            self.fingerprint = self.proc.fingerprint
            self.started_at = adopt.create_time
            self._set(State.STARTING, f"adopted running pid {adopt.pid}", pid=adopt.pid)
        else:
            self._set(State.STARTING)
            try:
                self._busy(PREPARE_BOUND_S + float(getattr(self.cfg, "clean_slate_timeout_s", 0) or 0), "cleaning up")
                await self.host.prepare(self)
                # The cleanup can take a minute (HBM back to idle): a gate that closed meanwhile (a new generation
                # of the group acted while nothing ran here to restart) holds the launch, not only the next start.
                late = self.host.start_gate(self, self.operator_start)
                if late is not None:
                    self._set(State.STOPPED, f"not starting after its cleanup: {late}")
                    self._hold(late)
                    return False
                self.stopped_cleanly = False
                # An operator's restart or start queued while it waited (a backoff that ran out as the command came,
                # the cleanup) is what this launch carries out: left queued, it would kill the new process at once.
                self._drain_queue({"restart", "wake"})
                self._busy(float(getattr(self.cfg, "start_timeout_s", 0) or 60) + 30, "launching")
                self.proc = await self.host.launch(self)
            except StartHeld as held:
                await self._wait_out(held)
                return False
            except LaunchError as exc:
                what = "precheck" if isinstance(exc, MissingPrerequisite) else "launch"
                self.hold = None
                self.last_exit = {"at": self.host.clock.time(), "reason": f"launch failed: {exc}", "code": None}
                self.host.events.emit("launch_failed", str(exc), self.name, "error")
                detail = str(exc) if what == "precheck" else f"launch failed: {exc}"
                failure = Failure(what, detail, output_tail=(str(exc),))
                evidence = self.host.capture(self, failure)
                await self._after_failure(self._judge(failure), evidence)
                return False
            self.hold = None
            self.gone.clear()
            self.fingerprint = self.proc.fingerprint
            self.started_at = self.proc.record.create_time
            self.host.events.emit("started", f"started pid {self.proc.record.pid} (output: {self.proc.output})",
                                  self.name, pid=self.proc.record.pid)  # fmt: skip
        self.operator_start = False
        gen = self.gen
        self.proc.exited.add_done_callback(
            lambda fut: self.signal("exited", gen, "" if fut.cancelled() else str(fut.result()))
        )
        self.host.on_process(self)
        self.host.on_state(self)
        return True

    async def _wait_out(self, held: StartHeld) -> None:
        """A foreign obstacle: show it, re-check it cheaply, and go back to the gate once it is gone (or an
        operator command arrives). Nothing counts as a failure."""
        if self.state == State.STARTING:
            self._set(State.STOPPED, f"start held: {held.reason}", "warning")
        self._hold(held.hold)
        while True:
            self.tick()
            getter = asyncio.ensure_future(self._next())
            try:
                done, _ = await asyncio.wait({getter}, timeout=HOLD_RECHECK_S)
            finally:
                getter.cancel()
            if getter in done and not getter.cancelled():
                sig = getter.result()
                self._take_command(sig)
                if sig.kind in COMMANDS:
                    return
            still = held.recheck() if held.recheck is not None else None
            if still is None:
                self.host.events.emit("released", f"no longer held ({held.reason})", self.name)
                return
            self._hold(Hold(held.hold.kind, still, resolves_itself=held.hold.resolves_itself))

    async def _supervise(self) -> tuple[str, str, Failure | None, bool]:
        while True:
            sig = await self._next_ticking()
            if sig.kind == "startup_ok":
                self.internal_errors = 0
                self.up.set()
                self.host.on_up(self)
                self.bind_retries.on_up()
                age = self.host.clock.time() - (self.started_at or 0)
                self._set(State.RUNNING, f"adopted, up (running for {age:.0f} s)" if self.adopted
                          else f"up after {age:.1f}s")
            elif sig.kind in ("ready", "not_ready"):
                self.ready = sig.kind == "ready"
                if self.state in SERVING_STATES:
                    self._set(State.READY if self.ready else State.RUNNING)
            elif sig.kind == "exited":
                code = int(sig.detail) if sig.detail.lstrip("-").isdigit() else None
                text = exit_text(code)
                failure = Failure("exit", f"process {text}", code, self._uptime(), self._tail(),
                                  was_up=self.up.is_set() and bool(self.cfg.probes.startup))
                self.last_exit = {"at": self.host.clock.time(), "reason": text, "code": code}
                return "failure", f"process {text} unexpectedly", failure, False
            elif sig.kind in ("startup_failed", "liveness_failed"):
                what, text = sig.kind.failed_probe, f"{sig.kind.replace('_', ' ')}: {sig.detail}"
                self._set(State.UNHEALTHY, text, "warning")
                self.last_exit = {"at": self.host.clock.time(), "reason": text, "code": None}
                return "failure", f"{sig.kind}: {sig.detail}", Failure(what, text, uptime_s=self._uptime()), False
            elif sig.kind == "stop":
                return "stop", sig.detail or "stop requested", None, sig.drain and sig.operator
            elif sig.kind in ("restart", "dep_restart"):
                planned = sig.drain and sig.operator and sig.kind == "restart"
                self._restart_cause = sig.cause or ("dependency" if sig.kind == "dep_restart" else "operator")
                return "restart", sig.detail or "restart requested", None, planned

    async def _next_ticking(self) -> Signal:
        """The next signal of this generation, the heartbeat ticked at least every `TICK_S` while none comes."""
        while True:
            self.tick()
            with contextlib.suppress(TimeoutError):  # in this task, no hop: a queued signal is taken at once
                async with asyncio.timeout(TICK_S):
                    return await self._next()

    async def _drain(self, why: str) -> None:
        """A planned restart or stop of a serving component: readiness off first (so the proxy or load
        balancer stops sending), then wait until no request is running or waiting, or the drain timeout."""
        timeout = self.host.drain_timeout(self)
        if timeout is None or self.proc is None or not self.up.is_set():
            return
        started = self.host.clock.monotonic()  # a duration: a wall-clock step (NTP) must not end or stretch it
        self.ready_blockers["draining"] = f"draining before: {why}"
        self._set(State.DRAINING, f"draining (readiness off) before {why}; up to {timeout:g}s", timeout_s=timeout)
        unknown = 0
        try:
            while True:
                self.tick()
                left = await self.host.inflight(self)
                waited = self.host.clock.monotonic() - started
                unknown = unknown + 1 if left is None else 0
                if left is not None:
                    self.extra_status["draining"] = {"running": left[0], "waiting": left[1],
                                                     "remaining_s": round(max(0.0, timeout - waited), 1)}
                    self.host.on_state(self)
                end = drain_end(left, waited, timeout, unknown)
                if end is not None:
                    self.host.events.emit(end.event, end.message, self.name, end.level)
                    return
                getter = asyncio.ensure_future(self._next())
                try:
                    done, _ = await asyncio.wait({getter}, timeout=DRAIN_POLL_S)
                finally:
                    getter.cancel()
                if getter in done and not getter.cancelled():
                    sig = getter.result()
                    if sig.kind == "exited":
                        return
                    if sig.kind in ("stop", "restart") and not sig.drain:
                        self.host.events.emit("drain_skipped", "drain cut short by a --no-drain command", self.name)
                        return
                    if sig.kind in ("ready", "not_ready"):
                        self.ready = sig.kind == "ready"
        finally:
            self.ready_blockers.pop("draining", None)
            self.extra_status.pop("draining", None)

    def _uptime(self) -> float | None:
        return None if self.started_at is None else round(self.host.clock.time() - self.started_at, 3)

    def _tail(self) -> tuple[str, ...]:
        with contextlib.suppress(Exception):
            if self.proc is not None:
                return self.host.output_tail(self, self.proc)
        return ()

    async def stop_process(self, why: str) -> dict[str, Any]:
        """Stop this component's whole tree (if any) and forget it; dependents follow per their edges.
        Returns what the stop did, with the tree as it was (for a post-mortem).

        The process stays ours (`running`, `record`) until the stop returned: a stop cancelled half-way (a node
        redeploy, the agent stopping) leaves it to the next stop instead of forgetting a tree that still dies."""
        return await self._stopped(self._going_down(why), why)

    def _going_down(self, why: str) -> Process | None:
        """The stop begins, before anything waits: not up, dependents told, `stopping` shown."""
        self.up.clear()
        self.ready = False
        self.host.on_going_down(self)
        proc = self.proc
        if proc is not None:
            if proc.close is not None:
                proc.close()
            self._set(State.STOPPING, f"stopping pid {proc.record.pid}: {why}")
        return proc

    async def _stopped(self, proc: Process | None, why: str) -> dict[str, Any]:
        if proc is None:
            self._set(State.STOPPED)
            return {}
        self._busy(float(getattr(self.cfg, "stop_grace_s", 0) or 0), "stopping")
        result = await self.host.terminate(self, proc, why)
        self.tick()
        self.proc = None
        self.gen += 1  # what the old process's probes still report is stale now
        self.gone.set()
        self.stopped_cleanly = result.get("survivors", 1) == 0
        tree = result.pop("tree", [])
        self.host.events.emit("stopped", f"stopped pid {proc.record.pid}", self.name, **result)
        result["tree"] = tree
        self.host.on_process(self)
        self._set(State.STOPPED)
        return result

    def _drain_queue(self, kinds: set[str]) -> None:
        """Coalesce: commands of these kinds queued while one was being carried out are already done."""
        for sig in [self.signals.get_nowait() for _ in range(self.signals.qsize())]:
            if sig.kind not in kinds:
                self.signals.put_nowait(sig)

    # ---- views ---------------------------------------------------------------------------------------------
    @property
    def adopted(self) -> bool:
        """Its process is one the previous agent started (adopted at our start), not one we launched."""
        return self.proc is not None and self.proc.output == "adopted"

    def status(self) -> dict[str, Any]:
        return component_status(self, self.host.clock.time())

"""Ties components together: dependency order, adoption after an agent restart, operator intent, probes,
restart policy, residue cleanup, node redeploys, and an orderly (or detached) shutdown.

The Supervisor is each component's host (`component.ComponentHost`): it answers the start gate, launches and
stops processes, turns failures into decisions with the pure policy, and keeps the books (state files, probes,
dependents). To the layers above it (the cluster coordinator, preflight and hardware health) it is a
`stackport.StackPort` (`nodeport.NodePort`): they attach once, read frozen views, give the port's few commands,
and answer its gate, its decisions and its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.config.cluster import cluster_file_hash
from nodeagent.config.model import Config
from nodeagent.core import logsink
from nodeagent.core.errors import ConfigError, LaunchError, MissingPrerequisite, UnknownComponentError
from nodeagent.core.events import EventBus
from nodeagent.core.failure import Failure
from nodeagent.core.graph import start_order
from nodeagent.core.heartbeat import Heartbeat
from nodeagent.core.output_tail import read_tail
from nodeagent.core.postmortem import Evidence
from nodeagent.core.process import ProcessRecord
from nodeagent.core.statefile import StateStore, write_json_atomic
from nodeagent.core.states import SERVING_STATES, State
from nodeagent.core.task_owner import guarded, log_death
from nodeagent.node import launcher, residue, residue_plan, vllm_install
from nodeagent.node.caches import CacheStore
from nodeagent.node.component import Component
from nodeagent.node.evidence import PostMortems
from nodeagent.node.intent import NodeIntent
from nodeagent.node.loops import NodeLoops
from nodeagent.node.nodeport import NodePort
from nodeagent.node.nodeworld import HostWorld, NodeWorld
from nodeagent.probes.kinds import ProbeContext, resolve_probe_set
from nodeagent.probes.prober import ComponentProber
from nodeagent.render.launch import component_dir, launch_fingerprint, routed_proxy
from nodeagent.seam.host import Clock, Process, StartHeld
from nodeagent.seam.policy import RestartDecision, restarts_with
from nodeagent.seam.stackport import STOPS_AUTOMATIC, Delegated, HoldKind

if TYPE_CHECKING:
    from nodeagent.node.component import ComponentHost
    from nodeagent.node.residue_plan import ResiduePlan
    from nodeagent.npu.monitor import NpuMonitor
    from nodeagent.probes.resolve import ResolvedProbe

STABILITY_TICK_S = 30.0
STATE_FLUSH_S = 0.02


class NodeContainer(Protocol):
    """What the node asks of its container in container mode (`container.mode.ContainerMode` is it): the host of
    a component inside, whether and where a component runs, its residue plan and probes as seen from the host."""

    def host(self, cfg: Any) -> ComponentHost: ...

    def runs_inside(self, name: str) -> bool: ...

    def where(self, name: str) -> str: ...

    def adapt_plan(self, name: str, plan: ResiduePlan) -> ResiduePlan: ...

    def adapt_probes(self, name: str, probes: dict[str, list[ResolvedProbe]]) -> dict[str, list[ResolvedProbe]]: ...


class Supervisor(NodePort, NodeLoops):
    def __init__(self, config: Config, events: EventBus | None = None, clock: Clock | None = None, *,
                 container: Callable[[Supervisor], NodeContainer] | None = None, world: NodeWorld | None = None,
                 probe_ctx: ProbeContext | None = None) -> None:  # fmt: skip
        """`world`: where its processes run (`nodeworld`; the host by default), `probe_ctx`: what its probes dial."""
        self.config = config
        self.events = events or EventBus()
        self.clock = clock or Clock()
        self.world: NodeWorld = world or HostWorld()
        self.store = StateStore(config.agent.state_dir)
        self.base_env = launcher.base_environment()
        self.caches = CacheStore()
        self.on_probe_result: list[Any] = []
        """Callbacks (component, role, ProbeResult) for metrics; called from probe tasks, keep them cheap."""
        self.on_load: list[Any] = []
        """(component, kind, seconds) once a launch is up: the load-time histogram."""
        self.npu: NpuMonitor | None = None
        active = config.active_components()
        self.order = start_order({n: list(c.depends_on) for n, c in active.items()})
        self.intent_store = NodeIntent(self.store, {n: active[n].restart for n in self.order})
        self.container: NodeContainer | None = None
        """The node's container (container mode): its components' host is `container.host(...)`. Given by the
        composition root (`container`: `container.mode.ContainerMode`): the node does not import container mode."""
        if config.container is not None:
            if container is None:
                raise ConfigError("container mode: the node needs its container host (Supervisor(container=...))")
            self.container = container(self)
        self.components = {name: Component(name, active[name], self.container.host(active[name]) if self.container
                                           else self) for name in self.order}  # fmt: skip
        for name, comp in self.components.items():
            comp.restore_history(self.intent_store.history(name))
        self._init_port(self.store.load_children())  # the node's gates and the layers' (nodeport)
        self.postmortems = PostMortems(lambda: self.config, self.events, self._keep,
                                       lambda: self.npu.status() if self.npu is not None else None)  # fmt: skip
        self._delegated: dict[str, str] = {}
        """What a layer does instead of the policy for a failure (the gang restart), for its post-mortem."""
        self.probe_ctx = probe_ctx or ProbeContext()
        self._background: set[asyncio.Task[Any]] = set()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.redeploying: asyncio.Task[None] | None = None
        self.redeploy_beat = Heartbeat(self.clock.monotonic())
        """The redeploy's own heartbeat: while it runs, the component loops are cancelled and it is what ticks."""
        self.redeploy_scope, self._next_redeploy = (), None  # what the running one touches; the one to follow
        self.started_at = self.clock.time()
        self.remote_etcd_ok = True
        self._saved_launches: dict[str, dict[str, Any]] = {}
        """What each launch recorded in children.json as the previous agent left it (read once, at start): its
        fingerprint, and why vLLM's fault tolerance was left out of its command line (`ft_unsupported`)."""
        self._flush_handle: asyncio.TimerHandle | None = None
        self._history_dirty = False

    # ---- intent (persisted; re-checked before every automatic action) --------------------------------------
    @property
    def trackers(self) -> dict[str, Any]:
        return self.intent_store.trackers

    @property
    def redeploys(self) -> Any:
        return self.intent_store.redeploys

    def desired(self, name: str) -> str:
        return self.intent_store.desired(name)

    def set_desired(self, name: str, desired: str) -> None:
        self.intent_store.set_desired(name, desired)

    def set_paused(self, paused: bool, by: str = "operator") -> None:
        self.intent_store.set_paused(paused, by)
        self.events.emit("pause" if paused else "resume", "maintenance pause " + ("on" if paused else "off")
                         + f" ({by})")  # fmt: skip
        self.on_state(None)

    def _save_intent(self, durable: bool = True) -> None:
        self.intent_store.save(durable)

    def deps(self, comp: Component) -> list[str]:
        return [d for d in comp.cfg.depends_on if d in self.components]

    def etcd_reachable(self) -> bool:
        """The node's etcd if it runs one (its startup/liveness probes decide), else the cluster's."""
        local = [c for c in self.components.values() if c.kind == "etcd"]
        return local[0].up.is_set() if local else self.remote_etcd_ok

    async def _watch_remote_etcd(self) -> None:
        """On worker nodes: is any cluster etcd endpoint healthy? Holds datasystem restarts while not."""
        while True:
            ok = False
            for endpoint in self.config.cluster.etcd_endpoints:
                ok = await self.world.etcd_ok(self.probe_ctx, endpoint)
                if ok:
                    break
            if ok != self.remote_etcd_ok:
                self.remote_etcd_ok = ok
                self.events.emit("etcd", "cluster etcd reachable again" if ok else "cluster etcd unreachable",
                                 None, "info" if ok else "error")  # fmt: skip
                self.intent_store.notify()
            await asyncio.sleep(2.0)

    def process_records(self) -> dict[str, ProcessRecord]:
        """The process of each component that runs one (also while it is being stopped)."""
        return {n: c.record for n, c in self.components.items() if c.record is not None}

    def use_npu_monitor(self, npu: NpuMonitor) -> None:
        """The hardware monitor's view, for the `npu` probe and post-mortems."""
        self.npu = npu
        self.probe_ctx.npu = npu

    # ---- host: launch -----------------------------------------------------------------------------------------
    def _last_records(self, name: str) -> list[tuple[int, float]]:
        rec = self.store.load_children().get(name)
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return [(int(rec["pid"]), float(rec["create_time"]))] if rec else []
        return []

    async def cleanup(self, comp: Component, scope: str = "start", reason: str | None = None,
                      wipe_etcd: bool = False) -> None:  # fmt: skip
        """Clean residue. A leftover of ours that would not die fails the start (a duplicate start must never
        happen: a second `dscli start` deletes the live worker's ready file); a port or an NPU held by a process
        we cannot prove is ours holds it, never a kill."""
        scan = scope != "start" or not comp.stopped_cleanly
        plan = residue_plan.plan_start_cleanup(comp.name, comp.cfg, self.config, scope=scope,  # type: ignore[arg-type]
                                               reason=reason, records=self._last_records(comp.name),
                                               scan=scan, wipe_etcd=wipe_etcd)  # fmt: skip
        plan = self.container.adapt_plan(comp.name, plan) if self.container is not None else plan
        outcomes = await self.world.clean(plan)
        for outcome in outcomes:
            if outcome.ok:
                continue
            action = outcome.action
            if isinstance(action, residue_plan.KillProcesses):
                raise LaunchError(f"start blocked: a leftover of ours would not die: {outcome.detail}")
            if isinstance(action, residue_plan.WaitPortsFree):
                ports = action.ports
                why = residue.busy_ports_description(ports) or f"port {','.join(map(str, ports))} busy"
                raise StartHeld(f"{why} — not ours, never signalled; starting once it is free",
                                functools.partial(residue.busy_ports_description, ports))  # fmt: skip
            if isinstance(action, residue_plan.WaitDevicesFree):
                if outcome.held:
                    raise StartHeld(f"NPUs not free: {outcome.detail} — not ours, never signalled")
                raise LaunchError(f"no clean slate on the NPUs: {outcome.detail}")
            self.events.emit("residue_failed", outcome.detail, comp.name, "warning")
        if scan:
            comp.scanned_clean()

    # `inside`: the node's container (container_mode.ContainerMode) for a component that runs in it; it launches
    # through the engine's exec, watches and stops by host PID, and signals nothing outside the container.
    async def prepare(self, comp: Component, inside: Any = None) -> None:
        # inside a container: the image's prerequisites, not ours
        missing = self.world.missing_prerequisite(comp.cfg, self.base_env) if inside is None else None
        if missing:
            raise MissingPrerequisite(missing)
        await self.cleanup(comp)

    async def launch(self, comp: Component, inside: Any = None) -> Process:
        spec = vllm_install.launch_spec(comp.name, self.config, self.base_env)
        fingerprint = launch_fingerprint(spec)  # the config's command line: what a reload compares with
        spec = routed_proxy(spec, self.config, self.launch_backends(comp.name) if comp.kind == "proxy" else None)
        spec = await self.caches.apply(self.config, comp.name, spec, self.base_env, inside)  # after the fingerprint
        timeout = float(getattr(comp.cfg, "start_timeout_s", 60)) + 30.0
        scope = launcher.scope_unit(self.config.agent.systemd_scopes, self.config.cluster.name, comp.name)
        tail = component_dir(self.config, comp.name) / "output.tail"
        log_offset = logsink.log_offset(self.config.agent.log_dir, comp.name)
        start = self.world.launch if inside is None else inside.launch
        launched, watch = await start(spec, self.config.agent.log_dir, self.base_env,
                                      component_dir(self.config, comp.name), timeout, scope, tail)  # fmt: skip
        return Process(launched.record, watch.done, launched.popen, launched.output, watch.close,
                       {"log_offset": log_offset, "tail_file": tail, "ft_unsupported": spec.ft_unsupported,
                        "file": cluster_file_hash(self.config)}, fingerprint)  # fmt: skip

    async def adopt(self, comp: Component, record: ProcessRecord, inside: Any = None) -> Process:
        watch = self.world.adopt(record) if inside is None else inside.adopt(record)
        self.caches.adopted(self.config, comp.name, record.pid)  # its cache folder is in use
        tail = component_dir(self.config, comp.name) / "output.tail"
        saved = self._saved_launches.get(comp.name, {})
        # as launched, not as installed now: an upgrade since does not put the flags on its command line
        return Process(record, watch.done, None, "adopted", watch.close,
                       {"log_offset": None, "tail_file": tail, "adopted": True,
                        "ft_unsupported": saved.get("ft_unsupported"), "file": saved.get("file")},
                       saved.get("fingerprint"))  # fmt: skip

    async def terminate(self, comp: Component, proc: Process, why: str, inside: Any = None) -> dict[str, Any]:
        return await self.world.stop_tree(proc.record, comp.cfg.stop_grace_s, comp.name,
                                          inside.member if inside else None)  # fmt: skip

    def drain_timeout(self, comp: Component) -> float | None:
        timeout = getattr(comp.cfg, "drain_timeout_s", None)
        return timeout if timeout else None

    async def inflight(self, comp: Component) -> tuple[int, int] | None:
        return await self.world.inflight(self.probe_ctx, comp.name, comp.cfg)

    def output_tail(self, comp: Component, proc: Process) -> tuple[str, ...]:
        return read_tail(logsink.log_path(self.config.agent.log_dir, comp.name), proc.extra.get("log_offset"),
                         proc.extra.get("tail_file"))  # fmt: skip

    # ---- host: observe ----------------------------------------------------------------------------------------
    def on_state(self, comp: Component | None = None) -> None:
        """Tell listeners (sd_notify STATUS=); persist status.json (readable when the API is not) and the
        history soon after — coalesced, so a burst of state changes on the crash path costs one write later."""
        if comp is not None and self.intent_store.record_history(comp.name, {
            "restarts": comp.restarts, "restarts_by_cause": dict(comp.restarts_by_cause), "last_exit": comp.last_exit,
            "failure": comp.failure.to_dict() if comp.failure is not None else None, "loads": list(comp.loads),
        }):  # fmt: skip
            self._history_dirty = True
        if self._flush_handle is None:
            with contextlib.suppress(RuntimeError):
                self._flush_handle = asyncio.get_running_loop().call_later(STATE_FLUSH_S, self.flush_state)
        self.tell_layers()  # the one change channel: the layers, and observers attached as `ChangeObserver`

    def flush_state(self) -> None:
        self._flush_handle = None
        if self._history_dirty:
            self._history_dirty = False
            with contextlib.suppress(OSError):
                self.intent_store.save(durable=False, notify=False)
        with contextlib.suppress(OSError):
            write_json_atomic(self.config.agent.state_dir / "status.json", self.status(), durable=False)

    def state_changed(self) -> None:
        self.on_state(None)

    def on_process(self, comp: Component) -> None:
        if comp.proc is not None:
            self._save_children()
            self.start_probes(comp)
        else:
            self._save_children(durable=False)  # a stale record is harmless: adoption verifies pid + create_time

    def on_up(self, comp: Component) -> None:
        self._refresh_record(comp)
        now = self.clock.time()
        if not comp.adopted:
            # An adopted process is the run that was already going: its stability clock carries on.
            self.trackers[comp.name].record_start(now)
            seconds = comp.record_load(now)
            if seconds is not None:
                for callback in self.on_load:
                    guarded("load-time observer", callback, comp.name, comp.kind, seconds)
        if not comp.cfg.probes.liveness:
            self.trackers[comp.name].record_healthy(now)
        if comp.kind == "vllm" and comp.proc is not None:
            self._watch_tree(comp, comp.proc)

    def _watch_tree(self, comp: Component, proc: Process) -> None:
        """vLLM's own processes (`tree_watch`): one that dies while the API server runs is a liveness failure."""
        gen = comp.gen
        self._keep(asyncio.ensure_future(self.world.watch_tree(
            proc.record, lambda: comp.proc is proc and comp.gen == gen and comp.state in SERVING_STATES,
            lambda detail: comp.signal("liveness_failed", gen, detail))))

    def _refresh_record(self, comp: Component) -> None:
        """Re-read the cmdline once up: launchers such as the venv's `etcd` wrapper exec the real binary
        after we recorded the PID, and adoption compares the cmdline."""
        record = comp.record
        if record is None:
            return
        with contextlib.suppress(LaunchError):
            fresh = self.world.record_of(record.pid)
            same = abs(fresh.create_time - record.create_time) < 0.05
            if same and fresh.cmdline != record.cmdline and comp.refresh_record(fresh):
                self._save_children()

    def on_going_down(self, comp: Component) -> None:
        self.stop_probes(comp)
        for other in self.components.values():
            edge = other.cfg.depends_on.get(comp.name)
            if edge is None or other.record is None:
                continue
            if restarts_with(other.kind, comp.kind, edge):
                other.signal("dep_restart", None, f"dependency {comp.name} restarts", cause="dependency")

    def _save_children(self, detached: bool = False, durable: bool = True) -> None:
        children = {  # not one being stopped: the next agent must not adopt a tree that dies
            name: {**c.record.to_dict(), "started_at": c.started_at, "fingerprint": c.fingerprint,
                   "ft_unsupported": c.proc.extra.get("ft_unsupported") if c.proc is not None else None,
                   "file": c.proc.extra.get("file") if c.proc is not None else None}
            for name, c in self.components.items() if c.record is not None and c.state != State.STOPPING
        }  # fmt: skip
        self.store.save_children(children, detached=detached, durable=durable)

    def start_probes(self, comp: Component) -> None:
        probes = resolve_probe_set(comp.cfg, self.config)
        probes = self.container.adapt_probes(comp.name, probes) if self.container is not None else probes
        gen = comp.gen

        def on_change(role: str, status: str, result: Any) -> None:
            detail = getattr(result, "detail", "") if result is not None else ""
            if role == "startup":
                comp.signal("startup_ok" if status == "success" else "startup_failed", gen, detail)
            elif role == "liveness" and status == "failure" and not self.liveness_holds.failed(comp.name, gen, detail):
                comp.signal("liveness_failed", gen, detail)
            elif role == "readiness" and status in ("success", "failure"):
                comp.signal("ready" if status == "success" else "not_ready", gen, detail)

        def on_result(role: str, probe: Any, result: Any) -> None:
            if role == "liveness":
                if result.ok:
                    self.policy_healthy(comp)  # every passing check: a stable run must be noticed
                self.liveness_holds.result(comp.name, gen, result.ok, result.detail)
            for callback in self.on_probe_result:
                guarded("probe-result observer", callback, comp.name, role, result)

        prober = ComponentProber(comp.name, probes, self.probe_ctx, on_change, on_result, clock=self.clock)
        self._stop_prober(comp.attach_prober(prober))
        # initial delays count from the process's start
        age = self.clock.time() - comp.started_at if comp.started_at else 0.0
        prober.start(self.clock.time() - max(0.0, age))

    def _keep(self, task: asyncio.Task[Any] | asyncio.Future[Any]) -> None:
        self._background.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._background.discard)
        task.add_done_callback(log_death)

    def stop_probes(self, comp: Component) -> None:
        self._stop_prober(comp.prober)

    def _stop_prober(self, prober: ComponentProber | None) -> None:
        if prober is not None:
            self._keep(asyncio.ensure_future(prober.stop()))

    # ---- host: decide -----------------------------------------------------------------------------------------
    def policy_healthy(self, comp: Component) -> None:
        """A passing liveness check; once every component ran stably the node's failed state clears."""
        now = self.clock.time()
        cleared = self.trackers[comp.name].record_healthy(now)
        if self.redeploys.failed and all(t.is_stable(now) for t in self.trackers.values()):
            self.redeploys.record_stable()
            self.events.emit("recovered", "every component ran stably: node failed state cleared")
            cleared = True
        if cleared:
            self._save_intent()

    async def _stability_tick(self) -> None:
        """Components without liveness probes are healthy while up: tell the policy now and then."""
        while True:
            await asyncio.sleep(STABILITY_TICK_S)
            for comp in self.components.values():
                if comp.up.is_set() and not comp.cfg.probes.liveness:
                    self.policy_healthy(comp)

    def capture(self, comp: Component, failure: Failure) -> Evidence:
        return self.postmortems.capture(comp, failure, self._tail_now(comp), self.clock.time())

    def _tail_now(self, comp: Component) -> tuple[str, ...]:
        with contextlib.suppress(Exception):
            if comp.proc is not None:
                return self.output_tail(comp, comp.proc)
        return ()

    def archive(self, comp: Component, failure: Failure, evidence: Evidence | None, tree: Any,
                decision: RestartDecision | None) -> None:  # fmt: skip
        self.postmortems.archive(comp.name, failure, evidence, tree, decision, self._delegated.pop(comp.name, None))

    def decide(self, comp: Component, failure: Failure) -> RestartDecision | None:
        """What a failure leads to. The node's gates first (a desired stop or a pause leaves it alone; the
        worker's restart waits for etcd), then the layers (a rank's failure restarts its whole group), then the
        policy."""
        hold = self.node_hold(comp, False)
        if hold is not None and hold.kind in STOPS_AUTOMATIC:
            self.events.emit("no_action", f"{failure.detail}; not restarting: {hold}", comp.name, "warning")
            return None
        if hold is not None and hold.kind == HoldKind.ETCD_UNREACHABLE:
            self.events.emit("held", f"{failure.detail}; {hold}", comp.name, "error")
            return None
        verdict = self.layer_decision(comp, failure)
        if isinstance(verdict, Delegated):
            self._delegated[comp.name] = f"delegated: {verdict}"
            comp.count_restart(failure.cause)  # the layer restarts it (a gang restart): a restart for this crash
            self.events.emit("failure", f"{failure.detail}; next: {verdict}", comp.name, "warning",
                             action="delegated", permanent=failure.permanent is not None,
                             output_tail=list(failure.output_tail))  # fmt: skip
            return None
        if verdict is not None:
            return verdict
        now = self.clock.time()
        tracker = self.trackers[comp.name]
        if failure.permanent:
            decision = tracker.record_permanent(now, failure.permanent)
        else:
            decision = tracker.record_failure(now, failure.detail, node_failed=self.redeploys.failed)
            decision = self.redeploys.escalate(decision, now, comp.cfg.restart)
        self._save_intent(durable=decision.action != "restart")
        level = "critical" if decision.action == "failed" else "warning"
        what = {"restart": "restart", "redeploy": "node redeploy", "failed": "retry"}[decision.action]
        when = "now" if decision.delay_s <= 0 else f"in {decision.delay_s:.0f}s"
        reason = f"failed: {failure.permanent}" if failure.permanent else failure.detail
        self.events.emit("failure", f"{reason}; next: {what} {when}", comp.name, level, action=decision.action,
                         delay_s=decision.delay_s, consecutive_failures=decision.consecutive_failures,
                         permanent=failure.permanent is not None, output_tail=list(failure.output_tail))  # fmt: skip
        return decision

    def policy_view(self, comp: Component) -> dict[str, Any]:
        return self.trackers[comp.name].status(self.clock.time())

    def reset(self, name: str | None = None) -> None:
        for n in [name] if name else list(self.trackers):
            self.trackers[n].reset()
        if name is None:
            self.redeploys.reset()
        self._save_intent()
        self.events.emit("reset", f"restart counters reset ({name or 'all components'})", name)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _adoptable(self) -> dict[str, ProcessRecord]:
        saved = self.store.load_children()
        return {name: ProcessRecord.from_dict(rec) for name, rec in saved.items() if name in self.components}

    async def _rotate_logs(self, every_s: float = 30.0) -> None:
        """copytruncate each component's log file past log_max_bytes (journald rotates its own)."""
        agent = self.config.agent
        while True:
            for name in self.components:
                path = logsink.log_path(agent.log_dir, name)
                try:
                    if await asyncio.to_thread(logsink.rotate_if_large, path, agent.log_max_bytes, agent.log_keep):
                        self.events.emit("log_rotated", f"rotated {path}", name)
                except OSError as exc:
                    self.events.emit("log_rotate_failed", f"cannot rotate {path}: {exc}", name, "warning")
            await asyncio.sleep(every_s)

    async def start(self) -> None:
        self.begin_stack_run()  # a crash loop belongs to one stack run (docs/operations.md); under the lock
        if not logsink.use_journal():
            self._keep(asyncio.create_task(self._rotate_logs(), name="log-rotation"))
        self._keep(asyncio.create_task(self._stability_tick(), name="stability"))
        kinds = {c.kind for c in self.components.values()}
        if "datasystem" in kinds and "etcd" not in kinds:
            self._keep(asyncio.create_task(self._watch_remote_etcd(), name="etcd-watch"))
        # read once: each adoption rewrites children.json with the components adopted so far, so a later
        # adoption must not read what its launch recorded back from the file (a reload would then see none)
        self._saved_launches = {n: {k: r.get(k) for k in ("fingerprint", "ft_unsupported", "file")}
                                for n, r in self.store.load_children().items()}  # fmt: skip
        adopt = self._adoptable()
        for name in self.order:
            self._start_loop(name, adopt.get(name))

    def get(self, name: str) -> Component:
        try:
            return self.components[name]
        except KeyError:
            known = ", ".join(self.components)
            raise UnknownComponentError(f"unknown component {name!r} (this node runs: {known})") from None

    def command(self, name: str, action: str, *, drain: bool = True, by: str = "operator") -> str:
        """An operator's start/stop/restart: always honoured, paused or not. Returns what will happen."""
        comp = self.get(name)
        message = self.layer_command(comp, action, drain, by)
        if message:
            self.events.emit("command", f"{by}: {action}: {message}", name)
            return message
        if action == "stop":
            self.set_desired(name, "stopped")
            comp.signal("stop", operator=True, drain=drain)
        elif action == "start":
            self.set_desired(name, "running")
            comp.signal("wake", operator=True)
        elif action == "restart":
            self.set_desired(name, "running")
            comp.signal("restart", None, "operator restart", operator=True, drain=drain, cause="operator")
        self.events.emit("command", f"{by}: {action}", name)
        return f"{action} {name}" + ("" if drain or action == "start" else " (no drain)")

    async def _stop_all_processes(self, why: str, names: Sequence[str] | None = None) -> None:
        for name in (n for n in reversed(self.order) if names is None or n in names):
            await self.components[name].stop_process(why)

    async def shutdown(self, detach: bool = False) -> None:
        """Stop everything in reverse order — or, detached, leave the stack running for the next agent."""
        if self.redeploying is not None:
            self.redeploying.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.redeploying
        await self._cancel_tasks()
        for task in list(self._background):
            task.cancel()
        if detach:
            for comp in self.components.values():
                self.stop_probes(comp)
                if comp.proc is not None and comp.proc.close is not None:
                    comp.proc.close()
            self._save_children(detached=True)
            self._save_intent()  # the stability clocks (healthy_since) carry over to the adopting agent
            self.events.emit("detached", "agent exits leaving the stack running for adoption")
        else:
            await self._stop_all_processes("agent stopping")
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self.flush_state()
        await self.probe_ctx.close()

    def reload(self, config: Config, restart: bool = True) -> dict[str, list[str]]:
        """Take a new config (`nodeagent.node.reload`)."""
        from nodeagent.node.reload import reload_config

        return reload_config(self, config, restart)

    def status(self) -> dict[str, Any]:
        components = {}
        for name, comp in self.components.items():
            components[name] = {**comp.status(), "desired": self.desired(name), "policy": self.policy_view(comp),
                                "liveness_hold": self.liveness_holds.status(name),
                                "log_files": [str(p) for p in residue_plan.own_log_files(name, comp.cfg,
                                                                                         self.config)]}  # fmt: skip
        return {
            "node": {"name": self.config.node.name, "ip": self.config.node.ip, "role": self.config.node.role,
                     "cluster": self.config.cluster.name},
            "paused": self.paused,
            "pause": self.pause_info(),
            "redeploying": self.redeploying is not None and not self.redeploying.done(),
            "node_policy": {"failed": self.redeploys.failed, "failed_reason": self.redeploys.failed_reason,
                            "redeploys_total": self.redeploys.redeploys_total},
            "components": components,
            "caches": self.caches.status(self.config),
            **self.layer_status(),
        }  # fmt: skip


"""The node's side of the seam: the supervisor as a `stackport.StackPort` for the layers above it, and the one
ordered list of gates every start passes (the node's own, then the layers').

The layers (the cluster coordinator, the start guards) are attached once each (`attach`, by `agent.Agent.layers`).
They read frozen views (`snapshot`, `component`) and act only through the port's commands (`restart`, `clean`,
`wait`, ...). The node asks every layer at one place each: its gate (`layer_hold`), its say on a failure
(`layer_decision`), an operator's command (`layer_command`), its /status sections (`layer_status`), what it adds
to the member record (`member_report`), and tells it of every change (`tell_layers`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.core.failure import Failure
from nodeagent.core.loadtime import load_status
from nodeagent.core.states import Desired
from nodeagent.core.task_owner import guarded
from nodeagent.node.blast_radius import Blast, Member, redeploy_scope
from nodeagent.node.component_status import loading_for
from nodeagent.node.intent import stack_identity
from nodeagent.node.liveness_hold import LivenessHolds
from nodeagent.seam.policy import RestartDecision, hold_for_dependency, restarts_with
from nodeagent.seam.stackport import (
    ComponentView,
    Delegated,
    Hold,
    HoldKind,
    MemberReport,
    NodeLayer,
    NodeView,
    ProxyBackends,
    ProxyRouting,
    first_hold,
)

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.core.events import EventBus
    from nodeagent.core.postmortem import Evidence
    from nodeagent.node.component import Component
    from nodeagent.node.evidence import PostMortems
    from nodeagent.node.intent import NodeIntent
    from nodeagent.seam.host import Clock

WAIT_CONDITIONS = ("stopped", "up")


class NodePort:
    """The `StackPort` part of `Supervisor` (a mixin: the supervisor's state, seen from above)."""

    config: Config
    events: EventBus
    clock: Clock
    components: dict[str, Component]
    intent_store: NodeIntent
    redeploying: asyncio.Task[None] | None
    redeploy_scope: tuple[str, ...]
    _next_redeploy: tuple[str, tuple[str, ...]] | None
    postmortems: PostMortems
    order: list[str]
    container: Any

    if TYPE_CHECKING:  # the supervisor's own, used here

        def get(self, name: str) -> Component: ...
        def desired(self, name: str) -> str: ...
        def deps(self, comp: Component) -> list[str]: ...
        def on_state(self, comp: Component | None = None) -> None: ...
        def etcd_reachable(self) -> bool: ...
        def capture(self, comp: Component, failure: Failure) -> Evidence: ...
        def request_redeploy(self, reason: str, components: Sequence[str] | None = None) -> bool: ...
        async def cleanup(self, comp: Component, scope: str = "start", reason: str | None = None,
                          wipe_etcd: bool = False) -> None: ...  # fmt: skip

    def _init_port(self, recorded: Mapping[str, Any]) -> None:
        self.layers: list[NodeLayer] = []
        self.proxy_routing: dict[str, ProxyRouting] = {}
        self.liveness_holds = LivenessHolds(self.clock, self.emit, lambda name, gen, detail: self.components[
            name].signal("liveness_failed", gen, detail))  # fmt: skip
        self._gate_poked = asyncio.Event()
        self._cluster_pause: dict[str, Any] | None = None
        """The cluster-wide maintenance pause as last read from etcd (kept while etcd is unreachable)."""
        self._recorded = frozenset(n for n in recorded if n in self.components)
        self._recovery_view: Callable[[], Mapping[str, Any] | None] = lambda: None
        """The ladder's state for `NodeView.recovery` (`recovery.NodeRecovery` gives it: `show_recovery`)."""
        self.node_gates: tuple[Callable[[Component, bool], Hold | None], ...] = (
            self._desired_hold, self._pause_hold, self.dependency_hold, self._redeploy_hold, self._dependency_hold)
        """The node's own gates, in `stackport.HOLD_ORDER`; the layers' gates follow them."""

    # ---- intent the layers read ------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self.intent_store.paused or self._cluster_pause is not None

    def pause_info(self) -> dict[str, Any] | None:
        """Who paused and when: the cluster's pause first (it is wider), then this node's."""
        if self._cluster_pause is not None:
            return {**self._cluster_pause, "scope": "cluster"}
        info = self.intent_store.pause_info()
        return {**info, "scope": "node"} if info else None

    def cluster_pause(self) -> Mapping[str, Any] | None:
        return self._cluster_pause

    def set_cluster_pause(self, info: Mapping[str, Any] | None) -> None:
        info = dict(info) if info is not None else None
        if info == self._cluster_pause:
            return
        self._cluster_pause = info
        if info is None:
            self.events.emit("resume", "cluster maintenance pause off")
        else:
            self.events.emit("pause", f"cluster maintenance pause on ({info.get('by', '?')})")
        self.intent_store.notify()
        self.on_state(None)

    # ---- views -----------------------------------------------------------------------------------------------
    def deps_waiting(self, comp: Component) -> list[str]:
        """Its dependencies that are not up (what the dependency gate waits for)."""
        return [d for d in self.deps(comp) if not self.components[d].up.is_set()]

    def view(self, comp: Component) -> ComponentView:
        record = comp.record
        load = load_status(comp.loads, loading_for(comp, self.clock.time())) or {}
        return ComponentView(
            name=comp.name, kind=comp.kind, state=comp.state, running=comp.running, up=comp.up.is_set(),
            ready=comp.ready, desired=Desired(self.desired(comp.name)), deps=tuple(self.deps(comp)),
            deps_up=not self.deps_waiting(comp), restart=comp.cfg.restart, pid=record.pid if record else None,
            hold=comp.hold, clean=comp.stopped_cleanly,
            ft_unsupported=comp.proc.extra.get("ft_unsupported") if comp.proc is not None else None,
            last_load_s=load.get("last_s"), loading=load.get("loading_s") is not None, load_left_s=load.get("left_s"),
            started_at=comp.started_at if record else None,
            log_offset=comp.proc.extra.get("log_offset") if comp.proc is not None else None,
            launched_file=comp.proc.extra.get("file") if comp.proc is not None and record else None,
        )  # fmt: skip

    def snapshot(self) -> NodeView:
        return NodeView(node=self.config.node.name, paused=self.paused, pause=self.pause_info(),
                        redeploying=self.redeploying is not None and not self.redeploying.done(),
                        components={n: self.view(c) for n, c in self.components.items()},
                        adoptable=frozenset(n for n in self._recorded if not self.components[n].adoption_tried),
                        recovery=self._recovery_view())  # fmt: skip

    def component(self, name: str) -> ComponentView:
        return self.view(self.get(name))

    # ---- commands the layers give ----------------------------------------------------------------------------
    def restart(self, names: Sequence[str], reason: str, *, planned: bool, cause: str = "gang") -> None:
        for name in names:
            self.get(name).signal("restart", None, reason, operator=planned, drain=planned, cause=cause)

    def redeploy(self, components: Sequence[str], cause: str) -> RestartDecision:
        """A node redeploy of these components only (container mode: what ran in its dead container), counted by
        the node's restart policy like any (it may turn the node `failed`: the decision says); the node keeps its
        counters itself."""
        comps = [self.get(n) for n in components] or list(self.components.values())
        decision = self.intent_store.redeploys.escalate(RestartDecision("redeploy", 0.0, cause, 0, False),
                                                        self.clock.time(), comps[0].cfg.restart)  # fmt: skip
        self.intent_store.save()
        self.request_redeploy(cause, components)
        return decision

    def begin_stack_run(self, names: Sequence[str] | None = None) -> list[str]:
        """The components (default: all) whose stack changed since their restart counters were kept — another
        config section, host ↔ container, a new container — start a new stack run: no crash loop carried over
        (a brand-new container stack showed the host stack's `crash loop`). At the agent's start, after a reload,
        when container mode made a new container."""
        where = self.container.where if self.container is not None else (lambda name: "host")
        fresh = [n for n in (self.order if names is None else names)
                 if self.intent_store.begin_stack(n, stack_identity(self.components[n].cfg, where(n)))]  # fmt: skip
        self.intent_store.save(durable=False)
        if fresh:
            self.events.emit("stack_run", f"a new stack run: crash loop and backoff start afresh ({', '.join(fresh)})")
        return fresh

    def blast(self, blast: Blast, origin: str | None = None) -> tuple[str, ...]:
        """What a redeploy of this class may touch here (`blast_radius`), in start order."""
        inside = self.container.runs_inside if self.container is not None else (lambda name: False)
        members = [Member(n, inside(n), {d: restarts_with(self.components[n].kind, self.components[d].kind, edge)
                                         for d, edge in self.components[n].cfg.depends_on.items()
                                         if d in self.components}) for n in self.order]  # fmt: skip
        return redeploy_scope(blast, members, origin)

    async def clean(self, name: str, scope: str, reason: str, *, wipe_etcd: bool = False) -> None:
        await self.cleanup(self.get(name), scope, reason, wipe_etcd=wipe_etcd)

    async def wait(self, name: str, condition: str, timeout: float | None = None) -> bool:
        if condition not in WAIT_CONDITIONS:
            raise ValueError(f"wait for {condition!r}? expected one of {WAIT_CONDITIONS}")
        comp = self.get(name)
        event = comp.gone if condition == "stopped" else comp.up
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()
            return True
        return False

    def emit(self, kind: str, message: str, component: str | None = None, level: str = "info",
             **data: Any) -> None:  # fmt: skip
        self.events.emit(kind, message, component, level, **data)

    def recent_events(self, kinds: Collection[str]) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.events.recent if e.event in kinds]

    def hold_liveness(self, name: str, reason: str | None, for_s: float = 0.0) -> None:
        self.get(name)
        self.liveness_holds.set(name, reason, for_s)

    def postmortem(self, name: str, detail: str, ladder: Sequence[Mapping[str, Any]], decision: str) -> None:
        comp = self.get(name)
        failure = Failure("engine_fault", detail)
        evidence = self.capture(comp, failure)
        evidence.ladder = [dict(step) for step in ladder]
        self.postmortems.archive(name, failure, evidence, [], None, decision)  # the tree runs on until the restart

    def wake(self) -> None:
        """Something a gate reads changed: every waiting component re-checks its gate now."""
        self._gate_poked.set()
        self._gate_poked = asyncio.Event()

    def block_ready(self, name: str, key: str, reason: str | None) -> None:
        self.get(name).block_ready(key, reason)

    def route_proxy(self, name: str, routing: ProxyRouting) -> None:
        self.get(name)
        if name in self.proxy_routing:
            raise ValueError(f"{name} is routed already")
        self.proxy_routing[name] = routing

    def launch_backends(self, name: str) -> ProxyBackends | None:
        """What the proxy `name` starting now is launched with (None: the config's command line)."""
        routing = self.proxy_routing.get(name)
        if routing is None:
            return None
        try:
            return routing.launch_backends()
        except Exception:  # a bug of the layer must not keep the proxy from starting: as without it
            logger.exception("asking the cluster layer what {} is launched with failed", name)
            return None

    def show_recovery(self, view: Callable[[], Mapping[str, Any] | None]) -> None:
        self._recovery_view = view

    def member_report(self) -> MemberReport:
        report = MemberReport()
        for layer in self.layers:
            report = report.merged(layer.member_report())
        return report

    def attach(self, layer: NodeLayer) -> None:
        if any(existing is layer for existing in self.layers):
            raise ValueError(f"{type(layer).__name__} is attached already")
        self.layers.append(layer)

    # ---- host: gate (the node's own gates, in HOLD_ORDER) -----------------------------------------------------
    def _desired_hold(self, comp: Component, operator: bool) -> Hold | None:
        if self.desired(comp.name) != "running":
            return Hold(HoldKind.DESIRED_STOPPED, "desired state is stopped", resolves_itself=False)
        return None

    def _pause_hold(self, comp: Component, operator: bool) -> Hold | None:
        if not self.paused or operator:
            return None
        info = self.pause_info() or {}
        cluster = info.get("scope") == "cluster"
        scope = "cluster paused" if cluster else "paused"
        return Hold(HoldKind.CLUSTER_PAUSE if cluster else HoldKind.NODE_PAUSE,
                    f"{scope} by {info.get('by', '?')}: no automatic start (an operator start/restart still works)",
                    operator_passes=True, resolves_itself=False, data=dict(info))  # fmt: skip

    def dependency_hold(self, comp: Component, operator: bool = False) -> Hold | None:
        """The datasystem worker cannot start without etcd: its restart waits until etcd answers."""
        why = hold_for_dependency(comp.kind, self.etcd_reachable(), first_start=comp.started_at is None)
        return Hold(HoldKind.ETCD_UNREACHABLE, why) if why else None

    def _redeploy_hold(self, comp: Component, operator: bool) -> Hold | None:
        if self.redeploying is not None and not self.redeploying.done() and comp.name in self.redeploy_scope:
            return Hold(HoldKind.NODE_REDEPLOY, "node redeploy in progress")
        return None

    def _dependency_hold(self, comp: Component, operator: bool) -> Hold | None:
        waiting = self.deps_waiting(comp)
        if waiting:
            return Hold(HoldKind.DEPENDENCY, "dependencies not up: " + ", ".join(waiting), data={"waiting": waiting})
        return None

    def node_hold(self, comp: Component, operator: bool = False) -> Hold | None:
        """The node's own answer: the first of its gates that holds."""
        for gate in self.node_gates:
            hold = gate(comp, operator)
            if hold is not None:
                return hold
        return None

    def start_gate(self, comp: Component, operator: bool = False) -> Hold | None:
        """The one gate every start passes, automatic or not (re-checked right before acting): the node's gates,
        then the layers' — every kind of `stackport.HOLD_ORDER` but the foreign holder `prepare` finds; the
        earliest that holds wins."""
        return self.node_hold(comp, operator) or self.layer_hold(comp, operator)

    def gate_waiters(self, comp: Component) -> list[Awaitable[Any]]:
        """What completes when the gate's answer may have changed: the intent, a `wake`, a dependency up — only one
        that is not up yet (an up one's `wait()` is done at once: a held start spun on it)."""
        waiters: list[Awaitable[Any]] = [self.intent_store.changed.wait(), self._gate_poked.wait()]
        waiters += [self.components[d].up.wait() for d in self.deps_waiting(comp)]
        return waiters

    # ---- what the node asks its layers -----------------------------------------------------------------------
    def layer_hold(self, comp: Component, operator: bool) -> Hold | None:
        """Every layer's gate is asked, the earliest kind wins: a gate only reports (what follows from its hold is
        the layer's own loop's, once the rank shows that hold — `ComponentView.hold`)."""
        if not self.layers:
            return None
        view = self.view(comp)
        return first_hold(layer.gate(view, operator) for layer in self.layers)

    def layer_decision(self, comp: Component, failure: Failure) -> RestartDecision | Delegated | None:
        if not self.layers:
            return None
        view = self.view(comp)
        for layer in self.layers:
            verdict = layer.decide(view, failure)
            if verdict is not None:
                return verdict
        return None

    def layer_command(self, comp: Component, action: str, drain: bool, by: str) -> str | None:
        if not self.layers:
            return None
        view = self.view(comp)
        for layer in self.layers:
            message = layer.command(view, action, drain, by)
            if message:
                return message
        return None

    def layer_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for layer in self.layers:
            out.update(layer.status_section())
        return out

    def tell_layers(self) -> None:
        """Each layer on its own: one that raises is logged and the others are still told."""
        for layer in self.layers:
            guarded(f"layer {type(layer).__name__}.on_node_change", layer.on_node_change)

"""The one interface between the node and the cluster layer.

The node (`Supervisor`) implements `StackPort`; the cluster layer (`nodeagent.cluster`) sees the node only
through it: frozen snapshots of the components and of the node's intent, and the few commands the cluster may
give. The cluster layer in turn is a `NodeLayer`: the node asks it, at one place each, whether a component may
start (`gate`), what a failure means (`decide`), whether it carries out an operator command itself (`command`),
and what to add to `/status` (`status_section`) and to the member record other nodes read (`member_report`,
typed: never picked out of /status). The start guards (preflight, NPU health) are layers too; the composition
root (`agent.Agent.layers`) attaches every layer, in the one order written there. Observers of the node's
changes are layers that only listen (`ChangeObserver`): there is no second change channel.
`nodeagent.node.nodeport` is the supervisor's side; `bench/cluster_sim.py` and the process-less cluster tests
implement `StackPort` with fakes.

Every reason a component may not start is a `Hold`: one type, compared by `kind`, never by its text. The node
asks one ordered list of gates (`HOLD_ORDER`: its own, then every layer's); the earliest kind that holds wins.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.core.states import Desired, State

if TYPE_CHECKING:
    from nodeagent.config.model import Config, RestartSpec
    from nodeagent.core.failure import Failure
    from nodeagent.seam.policy import RestartDecision


class HoldKind(StrEnum):
    """What holds a start, in the order the gates are asked."""

    DESIRED_STOPPED = "desired_stopped"
    NODE_PAUSE = "node_pause"
    CLUSTER_PAUSE = "cluster_pause"
    ETCD_UNREACHABLE = "etcd_unreachable"
    """The datasystem worker cannot start without etcd: its restart waits until etcd answers."""
    NODE_REDEPLOY = "node_redeploy"
    DEPENDENCY = "dependency"
    CONTAINER = "container"
    """The node's container is not up and set up yet (being created, set up, recreated after a death)."""
    CLUSTER_REDEPLOY = "cluster_redeploy"
    ISOLATED = "isolated"
    """The node is isolated (chip resets did not help, or a SeparateNPU fault): NPU users stay stopped until
    `nodeagentctl uncordon`."""
    NPU_RESET = "npu_reset"
    """A chip reset is being carried out: every NPU user waits for it (a reset of one A2 NPU resets all eight)."""
    MEMORY_HEADROOM = "memory_headroom"
    """A crashed datasystem worker waits for the vLLM ranks that still map its shared memory to stop."""
    PREFLIGHT = "preflight"
    NPU_FAULT = "npu_fault"
    COORDINATION = "coordination"
    """A multi-node group cannot start its ranks while etcd is away (or a generation is being asked for)."""
    GROUP_BACKOFF = "group_backoff"
    ROLLOUT = "rollout"
    """An incompatible rollout's step: its ranks wait for the proxy to stop listing their group; any step: its ranks
    wait for the generation its next known decision makes (`rollout_rules.next_restart`); a proxy to start waits
    while a step holds every group of a kind out (`ProxySync.launch_hold`)."""
    BARRIER = "barrier"
    FOREIGN_HOLDER = "foreign_holder"
    """A process that is not ours holds a port or an NPU: the start waits, nothing is signalled."""


HOLD_ORDER: tuple[HoldKind, ...] = tuple(HoldKind)

PAUSES = frozenset({HoldKind.NODE_PAUSE, HoldKind.CLUSTER_PAUSE})
STOPS_AUTOMATIC = frozenset({HoldKind.DESIRED_STOPPED, *PAUSES})
"""Holds under which no automatic action (a restart after a failure, a node redeploy) touches the component."""
NODE_KINDS = HOLD_ORDER[: HOLD_ORDER.index(HoldKind.DEPENDENCY) + 1]
"""The node's own gates (the supervisor's); the layers' gates (cluster, preflight, hardware) come after them."""


@dataclass(frozen=True)
class Hold:
    """Why a component may not start now."""

    kind: HoldKind
    reason: str
    """One line for an operator: what holds and what ends it."""
    operator_passes: bool = False
    """An operator's start/restart goes through it (pauses, preflight); others hold operators too."""
    resolves_itself: bool = True
    """False when only an operator (or something outside the agent) can end it: a foreign process on our
    port, a desired stop. `restart --wait` ends early on such a hold."""
    data: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_pause(self) -> bool:
        return self.kind in PAUSES

    def __str__(self) -> str:
        return self.reason

    def to_dict(self) -> dict[str, Any]:
        return {"kind": str(self.kind), "reason": self.reason, "operator_passes": self.operator_passes,
                "resolves_itself": self.resolves_itself, **({"data": dict(self.data)} if self.data else {})}


def first_hold(holds: Iterable[Hold | None]) -> Hold | None:
    """The hold that wins: the earliest kind in `HOLD_ORDER` (pure; None when nothing holds)."""
    found = [h for h in holds if h is not None]
    return min(found, key=lambda h: HOLD_ORDER.index(h.kind)) if found else None


@dataclass(frozen=True)
class ComponentView:
    """One component as the cluster layer sees it: a snapshot, never the live object."""

    name: str
    kind: str
    state: State
    running: bool
    """A process of ours exists — also while it is being stopped: `False` only once its whole tree is confirmed
    stopped (a rank about to arrive at a start barrier must not see its old tree still dying as "stopped")."""
    up: bool
    """Its startup probes passed."""
    ready: bool
    desired: Desired
    """The operator's intent."""
    deps: tuple[str, ...]
    deps_up: bool
    """Every dependency is up (the node's dependency gate passes)."""
    restart: RestartSpec
    pid: int | None = None
    hold: Hold | None = None
    """Why it is waiting to start, when it is."""
    clean: bool = True
    """Its last tree was seen to die whole, or its residue was cleaned since: `False` after a crash or an agent
    restart (an orphaned EngineCore may still hold the group's ports)."""
    ft_unsupported: str | None = None
    """Its config asks for vLLM's fault tolerance but the vLLM it was launched with cannot take it (why): the
    flags were left out of its command line."""
    last_load_s: float | None = None
    """Its last load's seconds (start → up); None: never loaded here."""
    loading: bool = False
    """Its launch is loading now (not an adopted process: its start is not ours to time)."""
    load_left_s: float | None = None
    """While loading: about how long is left (0: longer than usual); None: no estimate (a first load)."""
    started_at: float | None = None
    """Its process's start (the agent's clock); None: no process."""
    log_offset: int | None = None
    """Where this launch's output starts in its log file (`logsink.log_offset`); None: not ours to read (journald,
    an adopted process)."""
    launched_file: str | None = None
    """The cluster file its process was launched with (`cluster_file_hash`, the shared sections); None: no process,
    or one an agent started that did not record it. An incompatible rollout routes a group by what its ranks run,
    not by where its step stood (`rollout.running`)."""

    @property
    def stopped(self) -> bool:
        return not self.running

    @property
    def going_down(self) -> bool:
        """Its process is being stopped (after a failure, a stop, a restart): it will not run on, and a restart
        asked now would only repeat the stop under way. Still `running` until its whole tree is gone."""
        return self.running and self.state == State.STOPPING


@dataclass(frozen=True)
class NodeView:
    """The node's intent and its components, at one instant."""

    node: str
    paused: bool
    """A maintenance pause holds automatic actions here: this node's or the cluster's (one store: the node's)."""
    pause: Mapping[str, Any] | None
    """Who paused, when, and `scope` (cluster | node); None when not paused."""
    redeploying: bool
    components: Mapping[str, ComponentView]
    adoptable: frozenset[str] = frozenset()
    """Components whose process the previous agent recorded and whose adoption has not been tried yet (at start:
    whether the process still runs is not known until it has)."""
    recovery: Mapping[str, Any] | None = None
    """The ladder past node redeploy (`nodeagent.layers.chip_reset`):
    `{"state": "resetting"|"isolated", "reason", "drain"}` while a chip reset runs or the node is isolated — its
    ranks must not arrive at a barrier; None otherwise."""


@dataclass(frozen=True)
class MemberReport:
    """What the layers add to the member record other nodes read (`cluster/member_record.py`): typed, so that a
    /status key renamed changes nothing between nodes. Each field comes from the first layer that gives it."""

    gangs: Mapping[str, Any] | None = None
    """The coordinator's: the generation each group's ranks here were started for (`Coordinator.acks`)."""
    kv_transfers: Sequence[Sequence[Any]] | None = None
    """`kvlog`'s: recent KV transfer failures, `[time, engine, peer]` each (the PD watch sums them per pair)."""

    def merged(self, other: MemberReport | None) -> MemberReport:
        """This report's fields, and `other`'s where this one has none."""
        if other is None:
            return self
        return MemberReport(gangs=self.gangs if self.gangs is not None else other.gangs,
                            kv_transfers=self.kv_transfers if self.kv_transfers is not None else other.kv_transfers)


@dataclass(frozen=True)
class ProxyBackends:
    """The endpoints (HOST:PORT) a PD proxy starting now is launched with, per kind: the ones the cluster layer
    routes to. `full`: the kinds launched with every endpoint of the config after all (nothing of that kind is
    wanted now, and the script needs at least one), with why (one line for an operator)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    full: Mapping[str, str] = field(default_factory=dict)


class ProxyRouting(Protocol):
    """The cluster layer's answer for one PD proxy component, asked by the node at each launch of it."""

    def launch_backends(self) -> ProxyBackends | None:
        """What to launch it with; None: not known yet (the node launches the config's whole command line)."""


class StackPort(Protocol):
    """What the cluster layer may read from, and ask of, the node."""

    @property
    def config(self) -> Config:
        """The node's config now: a reload or a rollout's staging replaces it. A layer reads its settings here
        each time and keeps no copy of its own (issue 29: five layers kept the config they were made with)."""

    @property
    def base_env(self) -> Mapping[str, str]:
        """The environment the node launches its components with (a rendered command's, e.g. `PYTHONHASHSEED`)."""

    def snapshot(self) -> NodeView: ...

    def component(self, name: str) -> ComponentView:
        """Raises UnknownComponentError for a name this node does not run."""

    def restart(self, names: Sequence[str], reason: str, *, planned: bool, cause: str = "gang") -> None:
        """Restart these components once each (the caller picks the running ones; a stopped one would start as
        its gate allows). Planned: drained first and allowed while paused (an operator's or a rollout's);
        unplanned: a gang restart after a failure. `cause` is what the restart counts as (`RESTART_CAUSES`)."""

    def command(self, name: str, action: str, *, drain: bool = True, by: str = "operator") -> str:
        """An operator's start/stop/restart, as the local API runs it (remote commands arrive here)."""

    async def clean(self, name: str, scope: str, reason: str, *, wipe_etcd: bool = False) -> None:
        """Clean a stopped component's residue (scope `redeploy` archives logs; `wipe_etcd` its data). Raises
        `errors.LaunchError` (a leftover of ours would not die) or `host.StartHeld` (a port or NPU held by a
        process not ours)."""

    async def wait(self, name: str, condition: str, timeout: float | None = None) -> bool:
        """Until the component is `stopped` (whole tree gone) or `up`; False on timeout. Event-driven."""

    def emit(self, kind: str, message: str, component: str | None = None, level: str = "info",
             **data: Any) -> None: ...  # fmt: skip

    def recent_events(self, kinds: Collection[str]) -> list[dict[str, Any]]:
        """The node's recent events of these kinds, oldest first (a post-mortem bundle's history)."""

    def hold_liveness(self, name: str, reason: str | None, for_s: float = 0.0) -> None:
        """Do not act on this component's liveness failures for `for_s` (reason: why, for the operator); None
        releases. A failure held is judged again by the first liveness result after the hold (`liveness_hold`)."""

    def postmortem(self, name: str, detail: str, ladder: Sequence[Mapping[str, Any]], decision: str) -> None:
        """A post-mortem of a component that did not fail by itself but that the cluster layer restarts (an engine
        fault vLLM's retry did not recover): its evidence as at a failure, with the ladder and what comes next."""

    def set_cluster_pause(self, info: Mapping[str, Any] | None) -> None:
        """The cluster-wide pause as read from etcd (None: none). The node stores it once, here."""

    def cluster_pause(self) -> Mapping[str, Any] | None: ...

    def wake(self) -> None:
        """Something a gate reads changed: waiting components re-check their gate now."""

    def block_ready(self, name: str, key: str, reason: str | None) -> None:
        """Report the component not ready for this reason (None clears it): the PD proxy without a backend."""

    def route_proxy(self, name: str, routing: ProxyRouting) -> None:
        """Launch the proxy component `name` with the backends `routing` answers (once; again: ValueError). Its
        launch fingerprint stays the config's command line: a reload compares the config, not the routing."""

    def show_recovery(self, view: Callable[[], Mapping[str, Any] | None]) -> None:
        """Where `NodeView.recovery` is read from (the node's ladder, `nodeagent.layers.chip_reset`, once)."""

    def member_report(self) -> MemberReport:
        """What the attached layers add to this node's member record (each field from the first that gives it)."""

    def attach(self, layer: NodeLayer) -> None:
        """A layer attaches once (again: ValueError); the node asks it at its gate, its decisions, operator
        commands and its status, and tells it of every change — the node's one change channel (an observer that
        only listens is a `ChangeObserver`). The layers are asked in the order they attached: the composition
        root (`agent.py`) attaches them, in one place."""


@dataclass(frozen=True)
class Delegated:
    """A layer's answer to a failure it carries out itself (a gang restart, the container's recovery): a type of its
    own, so that no caller tells it from a decision by its being a string. `message` says what happens next."""

    message: str

    def __str__(self) -> str:
        return self.message


class NodeLayer(Protocol):
    """What the node asks a layer above it (the cluster coordinator; the start guards)."""

    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        """Why this component may not start now (barrier, group backoff, coordination, cluster redeploy)."""

    def decide(self, comp: ComponentView, failure: Failure) -> RestartDecision | Delegated | None:
        """A decision; `Delegated` when the layer handles the failure itself (a gang restart); None: not its."""

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> str | None:
        """A message when the layer carries the operator's command out itself; raises to refuse it."""

    def status_section(self) -> dict[str, Any]:
        """Sections for /status (`cluster`, `gangs`)."""

    def on_node_change(self) -> None:
        """A component's state or the node's intent changed (cheap: wake the layer's loop)."""

    def member_report(self) -> MemberReport | None:
        """What it adds to the member record other nodes read; None: nothing."""


class ReportLayer:
    """A layer that only reports (its /status section): it holds no start, decides no failure, takes no command."""

    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        return None

    def decide(self, comp: ComponentView, failure: Failure) -> RestartDecision | Delegated | None:
        return None

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> str | None:
        return None

    def status_section(self) -> dict[str, Any]:
        return {}

    def on_node_change(self) -> None:
        pass

    def member_report(self) -> MemberReport | None:
        return None


class ChangeObserver(ReportLayer):
    """A layer that only listens: told of every change of the node (sd_notify's status line, MQTT, the member
    record). The node has one change channel, `attach`; this is it for an observer."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self.changed = changed

    def on_node_change(self) -> None:
        self.changed()

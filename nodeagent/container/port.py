"""What the container mode (`container_mode.py`) sees of the node: narrow Protocols the supervisor implements,
instead of the whole supervisor (which imports the container mode: a Protocol is no import circle). `inside` is
the `ContainerMode` a launch goes through (None: on the host)."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.core.events import EventBus
    from nodeagent.core.failure import Failure
    from nodeagent.core.process import ProcessRecord
    from nodeagent.node.blast_radius import Blast
    from nodeagent.node.component import Component
    from nodeagent.seam.host import Clock, Process
    from nodeagent.seam.policy import RestartDecision
    from nodeagent.seam.stackport import Hold, NodeLayer


class NodeHost(Protocol):
    """The supervisor as a component's host (`component.ComponentHost`) whose launches, adoptions and stops can go
    through the container (`inside=`)."""

    events: EventBus
    clock: Clock

    def start_gate(self, comp: Component, operator: bool) -> Hold | None: ...

    def gate_waiters(self, comp: Component) -> list[Awaitable[Any]]: ...

    async def prepare(self, comp: Component, inside: Any = None) -> None: ...

    async def launch(self, comp: Component, inside: Any = None) -> Process: ...

    async def adopt(self, comp: Component, record: ProcessRecord, inside: Any = None) -> Process: ...

    async def terminate(self, comp: Component, proc: Process, why: str,
                        inside: Any = None) -> dict[str, Any]: ...  # fmt: skip

    def output_tail(self, comp: Component, proc: Process) -> tuple[str, ...]: ...

    def drain_timeout(self, comp: Component) -> float | None: ...

    async def inflight(self, comp: Component) -> tuple[int, int] | None: ...

    def decide(self, comp: Component, failure: Failure) -> RestartDecision | None: ...

    def request_redeploy(self, reason: str, components: Sequence[str] | None = None) -> bool: ...

    def blast(self, blast: Blast, origin: str | None = None) -> tuple[str, ...]: ...

    def capture(self, comp: Component, failure: Failure) -> Any: ...

    def archive(self, comp: Component, failure: Failure, evidence: Any, tree: Any,
                decision: RestartDecision | None) -> None: ...  # fmt: skip

    def on_process(self, comp: Component) -> None: ...

    def on_up(self, comp: Component) -> None: ...

    def on_going_down(self, comp: Component) -> None: ...

    def on_state(self, comp: Component) -> None: ...


class ContainerNode(NodeHost, Protocol):
    """What the container mode uses of the node: the host of the components inside, its config and components,
    events, a wake of the gates, planned restarts; and the node-redeploy path (`_redeploy`: the node's policy,
    intent and redeploy request)."""

    config: Config
    events: EventBus
    clock: Clock
    order: list[str]

    @property
    def components(self) -> Mapping[str, Component]: ...

    @property
    def redeploys(self) -> Any: ...

    @property
    def intent_store(self) -> Any: ...

    @property
    def postmortems(self) -> Any: ...

    def attach(self, layer: NodeLayer) -> None: ...

    def wake(self) -> None: ...

    def on_state(self, comp: Component | None = None) -> None: ...

    def restart(self, names: Sequence[str], reason: str, *, planned: bool, cause: str = "gang") -> None: ...

    async def wait(self, name: str, condition: str, timeout: float | None = None) -> bool: ...

    def redeploy(self, components: Sequence[str], cause: str) -> RestartDecision:
        """A node redeploy of these components only, counted by the node (`blast_radius`)."""
        ...

    def begin_stack_run(self, names: Sequence[str] | None = None) -> list[str]: ...


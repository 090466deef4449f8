"""The cluster's side of the ladder past node redeploy: a node that resets its chips or is isolated leaves its
groups cleanly.

It reads the node only through its port (`NodeView.recovery`, set by `nodeagent.layers.chip_reset` while a chip reset
runs or the node is isolated). Once per reset or isolation it asks a new generation of every group with a rank
here (planned: drained first), so the other members restart their ranks at once instead of hanging on a lost
peer and wait at the start barrier; this node does not arrive there while `recovery` is set
(`barrier.StartBarrier`). The member record carries `isolated` (membership), and the PD proxy sync keeps a group
with an isolated member out of the proxy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nodeagent.seam.stackport import ComponentView, Hold, MemberReport, StackPort

if TYPE_CHECKING:
    from nodeagent.cluster.coordinator_port import CoordinatorPort
    from nodeagent.cluster.proxy_evict import ProxyEvict
    from nodeagent.core.failure import Failure


class RecoveryFollower:
    """A `NodeLayer` (it only listens): drains the node's groups once per reset or isolation."""

    def __init__(self, coordinator: CoordinatorPort, port: StackPort, evict: ProxyEvict | None = None) -> None:
        """`evict`: takes the drained groups out of every PD proxy at once, without etcd or the proxy's agent."""
        self.coordinator = coordinator
        self.port = port
        self.evict = evict
        self.drained: set[str] = set()

    def member_report(self) -> MemberReport | None:
        return None

    def on_node_change(self) -> None:
        view = self.port.snapshot().recovery
        if not view or view.get("drain") in self.drained:
            return
        self.drained.add(str(view.get("drain")))
        node = self.coordinator.node
        for name in self.coordinator.gangs:
            self.coordinator.request_generation(name, f"{node} {view.get('state')}: {view.get('reason')}",
                                                planned=True)  # fmt: skip
            self.port.emit("gang_drain", f"group {name} drains: {node} is {view.get('state')} "
                           f"({view.get('reason')}); its other members restart and wait for it", None, "warning",
                           group=name)  # fmt: skip
        if self.evict is not None:
            self.evict.evict(list(self.coordinator.gangs), f"{node} {view.get('state')}")

    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        return None

    def decide(self, comp: ComponentView, failure: Failure) -> None:
        return None

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> None:
        return None

    def status_section(self) -> dict[str, Any]:
        return {}

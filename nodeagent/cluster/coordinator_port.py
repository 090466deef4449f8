"""What the layers beside the coordinator (the rollout, the PD watch, the recovery follower) may read of it and ask
of it: a Protocol, so that they never reach into the `Coordinator` class (`tests/test_structure.py` fails on a
module importing `cluster.coordinator` but the composition root). `coordinator.Coordinator` implements it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nodeagent.cluster.gang import GangState
    from nodeagent.cluster.rules import GangRecord
    from nodeagent.cluster.store import Store
    from nodeagent.config.layout import ClusterLayout, ProxyPlan
    from nodeagent.config.model import Config
    from nodeagent.seam.host import Clock
    from nodeagent.seam.stackport import StackPort

ProxyHold = Callable[[], Mapping[str, str] | None]
"""Groups a proxy must keep out however healthy (group → why); None: not known yet (nothing changes meanwhile)."""
ProxyFence = Callable[[], Mapping[str, Collection[str]]]
"""group → the groups that must have left the proxy before it is added (an incompatible rollout's switch)."""


class ProxyView(Protocol):
    """One PD proxy this node keeps in sync (`proxy_sync.ProxySync`), as read from beside the coordinator."""

    @property
    def plan(self) -> ProxyPlan: ...

    @property
    def url(self) -> str: ...

    @property
    def health(self) -> Mapping[str, str]:
        """group → why it is out of the proxy ("" when in)."""

    @property
    def applied(self) -> Mapping[str, set[str]] | None:
        """What the proxy was last told to route to (None: no proxy process)."""

    @property
    def active(self) -> Mapping[str, set[str]] | None:
        """What the proxy itself routes to, by its last answer (None: no proxy process)."""

    @property
    def pending_since(self) -> Mapping[str, float]:
        """Instance → since when it is added but not listed by the proxy (monotonic)."""


class MemberSource(Protocol):
    """The members' records (`membership.Membership`) and the node's lease."""

    @property
    def members(self) -> Mapping[str, Any]:
        """name → `membership.MemberView` (its `record`)."""

    @property
    def lease(self) -> Any: ...


class CoordinatorPort(Protocol):
    """The coordinator as the rollout and the PD watch see it."""

    @property
    def port(self) -> StackPort: ...

    @property
    def store(self) -> Store: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def config(self) -> Config: ...

    @property
    def node(self) -> str: ...

    @property
    def cluster(self) -> str: ...

    @property
    def layout(self) -> ClusterLayout: ...

    @property
    def membership(self) -> MemberSource: ...

    @property
    def reachable(self) -> bool:
        """etcd answers."""

    @property
    def epoch(self) -> str | None:
        """The store's incarnation as last read (None: not yet)."""

    @property
    def gangs(self) -> Mapping[str, GangState]:
        """This node's groups: what it knows of each (generation acted on, ...)."""

    @property
    def records(self) -> Mapping[str, GangRecord]:
        """Every group's generation record as last read."""

    @property
    def proxies(self) -> Sequence[ProxyView]:
        """The PD proxies this node keeps in sync (none but on the proxy's node)."""

    def spawn(self, work: Awaitable[Any]) -> None:
        """Run `work` beside the coordinator's loop; cancelled when it stops."""

    def hold_out(self, hold: ProxyHold, fence: ProxyFence) -> None:
        """Every proxy of this node keeps out what `hold` says, and adds a group only past its `fence`."""

    def request_generation(self, group: str, reason: str, planned: bool = True) -> str:
        """The next generation of one of this node's groups (`gangs`); KeyError for another group."""

    async def ask_generations(self, groups: list[str], reason: str, planned: bool) -> dict[str, str]:
        """A new generation of each group (every member restarts once)."""

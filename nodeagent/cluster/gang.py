"""What one node knows of one data-parallel group it runs ranks of: the generation it acted on, its barrier."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nodeagent.cluster import rules
from nodeagent.config.layout import Group


@dataclass
class GangState:
    """One group this node runs ranks of."""

    group: Group
    components: tuple[str, ...]
    record: rules.GangRecord | None = None
    mod_revision: int = 0
    acted: int = 0
    acted_epoch: str = ""
    requests: list[rules.GenRequest] = field(default_factory=list)
    """Generation requests queued here (a failure, an operator, FT, recovery, a rank that ran already): anyone
    appends (`Coordinator.ask`), only the work loop's decision step removes what it decided on — a request
    arriving while a generation is being written waits for the next decision, never dropped."""
    deferred: int | None = None
    """A generation seen while paused, acted on at resume."""
    arrivals: set[str] = field(default_factory=set)
    arrived_for: int = 0
    released: int = 0
    """The generation whose barrier released."""
    waiting_since: float | None = None
    last_late_event: float = 0.0
    up_since: float | None = None
    fresh: bool = True
    """Not yet compared with the store since this agent started."""
    down_at_baseline: bool = False
    """Our ranks were not running on when a wiped etcd's new epoch was adopted: once they are stopped, the group's
    next generation is asked (the peers may have been adopted running: a DP group cannot take a rank back)."""
    ran: dict[str, int] = field(default_factory=dict)
    """The generation each local rank was last seen running in: a rank runs once per generation."""
    ran_before: dict[str, int] = field(default_factory=dict)
    """`ran` as the previous agent saved it (same epoch as `acted`): what its adopted ranks were launched in."""
    unclean: str | None = None
    """Why a local rank's residue could not be cleaned before arriving (last said)."""
    unclean_settles: bool = True
    """False when that is a process not ours (on its port, its NPUs): only someone outside the agent ends it."""
    unclean_recheck: tuple[str, Callable[[], str | None]] | None = None
    """The rank whose cleanup is held and the hold's cheap re-check (who holds the port now; None once free):
    the whole cleanup runs again only once it answers free, not at every step (each run waited 3 s and logged
    a line per action)."""
    unclean_holder: str | None = None
    """What that re-check answered last: a new holder is said once."""

    @property
    def pending(self) -> bool:
        """A request is queued: the next generation is being asked for."""
        return bool(self.requests)

    @property
    def multi(self) -> bool:
        return len(self.group.nodes) > 1

    def runs_acted(self, name: str, running: bool, going_down: bool, reachable: bool) -> bool:
        """This running rank runs in `acted` and is not noted so yet: its barrier released in it — or, a one-node
        group while etcd is away, it started without one (seed 638887: a successor took it for unrestarted and
        restarted it under a cluster pause)."""
        return running and self.ran.get(name) != self.acted and (
            self.released == self.acted or (not self.multi and not reachable and not going_down))

    def status(self) -> dict[str, Any]:
        """The group's part of the cluster section of /status."""
        record = self.record
        return {"kind": self.group.kind, "nodes": list(self.group.nodes), "acted": self.acted,
                "generation": record.generation if record else None,
                "reason": record.reason if record else None, "by": record.by if record else None,
                "barrier": {"arrived": sorted(self.arrivals), "released": self.released == self.acted},
                "crash_loop": (record.policy.get("consecutive_failures", 0) >= 2) if record else False,
                "pending": self.pending}  # fmt: skip

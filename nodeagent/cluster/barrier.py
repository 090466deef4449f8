"""A group's start barrier, as one node takes part in it: arrive once every local rank is stopped and clean, wait
for every node of the group, release.

Arriving means "my ranks of the old generation are gone", not "I would like to start": a node arrives only once
each local rank's whole old tree is gone and, where it was not seen to go (a crash, a death while no agent
watched), its residue is cleaned. The keys live under the member's lease: a dead agent's arrival goes with it.
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING

from nodeagent.cluster import rules
from nodeagent.cluster.gang import GangState
from nodeagent.cluster.store import KV, StoreError
from nodeagent.core.errors import AgentError
from nodeagent.core.states import Desired
from nodeagent.seam.host import Clock, StartHeld
from nodeagent.seam.stackport import Hold, HoldKind, NodeView, StackPort

if TYPE_CHECKING:
    from nodeagent.cluster.membership import Membership

BARRIER_TIMEOUT_S = 300.0
"""vLLM's headless engines give up after ~5 min without their head: say who is missing by then."""


class StartBarrier:
    """This node's side of every start barrier of its groups (the coordinator's work loop drives it)."""

    def __init__(self, cluster: str, node: str, port: StackPort, membership: Membership, clock: Clock) -> None:
        self.cluster, self.node, self.port, self.membership, self.clock = cluster, node, port, membership, clock
        self.store = membership.store

    async def step(self, gs: GangState, here: NodeView) -> None:
        """Arrive for the generation acted on, once this node may."""
        if gs.arrived_for != gs.acted and self._wants_start(gs, here) and await self._clean_ranks(gs, here):
            await self._arrive(gs)

    def on_key(self, gs: GangState | None, key: str, kv: KV | None) -> None:
        """A barrier key changed: an arrival for the generation acted on, or one gone with its lease."""
        parts = key.rsplit("/", 3)
        if gs is None or len(parts) != 4:
            return
        _, _, gen, node = parts
        if gen.isdigit() and int(gen) == gs.acted:
            if kv is None:
                gs.arrivals.discard(node)
            elif arrival_epoch(kv) in (None, gs.acted_epoch):
                gs.arrivals.add(node)

    @staticmethod
    def _wants_start(gs: GangState, here: NodeView) -> bool:
        """Every local rank is stopped — its whole old tree gone, not merely being stopped — and wants to start,
        its dependencies up (the worker is ready), no chip reset or isolation here, and this node not paused: a
        paused node's rank will not start, and its arrival would start the peers without it (a DP group that
        cannot take the rank back later)."""
        ranks = [here.components[c] for c in gs.components]
        return here.recovery is None and not here.paused and all(
            r.stopped and r.desired == Desired.RUNNING and r.deps_up for r in ranks)

    async def _clean_ranks(self, gs: GangState, here: NodeView) -> bool:
        """A rank whose old tree was not seen to die whole may have left an EngineCore holding the group's ports:
        clean it first, or the peers start beside it. False: not cleanable now (the event says why, once per
        change); the next step tries again — while a stranger holds a port, only its cheap re-check runs."""
        if gs.unclean_recheck is not None:
            rank, recheck = gs.unclean_recheck
            still = None if here.components[rank].clean else recheck()
            if still is not None:
                if still != gs.unclean_holder:
                    gs.unclean_holder = still
                    self._held(gs, rank, still)
                return False
            gs.unclean_recheck = gs.unclean_holder = None
        for name in gs.components:
            if here.components[name].clean:
                continue
            try:
                await self.port.clean(name, "start", f"gang {gs.group.name} generation {gs.acted}: before arriving")
            except AgentError as exc:
                # a stranger on the rank's port (StartHeld) goes only when someone acts: a peer's --wait ends on it
                gs.unclean_settles = not isinstance(exc, StartHeld)
                if isinstance(exc, StartHeld) and exc.recheck is not None:
                    gs.unclean_recheck, gs.unclean_holder = (name, exc.recheck), exc.recheck()
                self._held(gs, name, str(exc))
                return False
        gs.unclean = None
        return True

    def _held(self, gs: GangState, name: str, why: str) -> None:
        """Show why a rank is not cleaned (status); say it when it changes."""
        if gs.unclean != why:
            gs.unclean = why
            self.port.emit("barrier_held", f"group {gs.group.name} generation {gs.acted}: not arriving at the start "
                           f"barrier: {why}", name, "error", group=gs.group.name, generation=gs.acted)  # fmt: skip

    async def _arrive(self, gs: GangState) -> None:
        gen = gs.acted
        key = rules.barrier_key(self.cluster, gs.group.name, gen, self.node)
        value = {"at": self.clock.time(), "epoch": gs.acted_epoch}
        await self.store.put(key, json.dumps(value), lease=self.membership.lease)
        if gs.arrived_for:
            with contextlib.suppress(StoreError):
                await self.store.delete(rules.barrier_key(self.cluster, gs.group.name, gs.arrived_for, self.node))
        gs.arrived_for = gen
        gs.arrivals.add(self.node)
        gs.waiting_since = self.clock.monotonic()
        snap = await self.store.get_prefix(rules.barrier_prefix(self.cluster, gs.group.name, gen))
        gs.arrivals |= {k.rsplit("/", 1)[-1] for k, kv in snap.items.items()
                        if arrival_epoch(kv) in (None, gs.acted_epoch)}  # fmt: skip

    def check(self, gs: GangState) -> None:
        """Release when every node arrived; say who is late once per timeout."""
        if gs.released == gs.acted or gs.arrived_for != gs.acted:
            return
        waited = self._waited(gs)
        state = rules.barrier_state(gs.group.nodes, gs.arrivals, waited, BARRIER_TIMEOUT_S)
        if state.released:
            gs.released = gs.acted
            self.port.emit("barrier_released", state.describe(gs.group.name, gs.acted, waited), None,
                           group=gs.group.name, generation=gs.acted)  # fmt: skip
            self.port.wake()
        elif state.overdue and self.clock.monotonic() - gs.last_late_event >= BARRIER_TIMEOUT_S:
            gs.last_late_event = self.clock.monotonic()
            self.port.emit("barrier_late", state.describe(gs.group.name, gs.acted, waited) + "; not starting "
                           "half a group", None, "error", missing=list(state.missing))  # fmt: skip

    def hold(self, gs: GangState) -> Hold:
        """What a rank of a generation not yet released waits for."""
        name = gs.group.name
        if gs.arrived_for != gs.acted:
            if gs.unclean:
                return Hold(HoldKind.BARRIER, f"group {name} generation {gs.acted}: not arriving at the start "
                            f"barrier before its residue is cleaned: {gs.unclean}",
                            resolves_itself=gs.unclean_settles)  # fmt: skip
            return Hold(HoldKind.BARRIER, f"group {name} generation {gs.acted}: about to arrive at the start barrier")
        waited = self._waited(gs)
        state = rules.barrier_state(gs.group.nodes, gs.arrivals, waited, BARRIER_TIMEOUT_S)
        return Hold(HoldKind.BARRIER, state.describe(name, gs.acted, waited),
                    data={"group": name, "generation": gs.acted, "missing": list(state.missing)})

    def _waited(self, gs: GangState) -> float:
        return self.clock.monotonic() - (gs.waiting_since or self.clock.monotonic())


def arrival_epoch(kv: KV) -> str | None:
    """The epoch an arrival was made in (None: an agent from before arrivals carried it). Generations count again
    from 1 after etcd lost its data, and a lease re-granted after the wipe writes its keys back: an arrival for
    generation N of the old epoch must not count for the new epoch's generation N (the simulation found a rank
    started beside a peer's old tree that way: tests/test_simulation.py, seeds 108 and 109)."""
    data = kv.json()
    epoch = data.get("epoch") if isinstance(data, dict) else None
    return str(epoch) if epoch is not None else None

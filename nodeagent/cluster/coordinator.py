"""The cluster layer's etcd I/O: gang restarts of a data-parallel group, start barriers, the cluster-wide pause.

The rules are `cluster.rules` (pure); this module reads and writes the keys and sees the node only through its
`stackport.StackPort`: frozen views of the components, and the port's few commands (restart these, wake the gates). It
attaches to the node once, as its `NodeLayer`: a start gate, a say on failures and operator commands, and a /status
section. Losing etcd freezes coordination and never stops a serving stack: a group that needs a restart while etcd is
down waits (a single-node group restarts locally as before).

Per group this node belongs to: `acted` — the generation its vLLM was (re)started for — is persisted in
`state_dir/cluster.json` before acting, so each generation is acted on exactly once, across agent restarts."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.cluster import rules
from nodeagent.cluster.barrier import StartBarrier
from nodeagent.cluster.ft_rung import FtClient, FtRung
from nodeagent.cluster.gang import GangState
from nodeagent.cluster.ops import ClusterOps
from nodeagent.cluster.proxy_sync import ProxyPost, ProxySync
from nodeagent.cluster.store import KV, Resync, StoreError, WatchItem
from nodeagent.cluster.tasks import TaskSet, follow
from nodeagent.config.layout import cluster_layout
from nodeagent.core.errors import CoordinationUnavailable
from nodeagent.core.statefile import read_json, write_json_atomic
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import ComponentView, Delegated, Hold, HoldKind, MemberReport, NodeView, StackPort

if TYPE_CHECKING:
    from nodeagent.cluster.coordinator_port import ProxyFence, ProxyHold
    from nodeagent.cluster.membership import Membership
    from nodeagent.config.model import Config
    from nodeagent.core.failure import Failure

SETTLE_EVERY_S = 30.0
RETRY_S = 1.0
IDLE_TICK_S = 5.0
"""At rest the work loop wakes only for watch events and gate checks, and otherwise this often (barrier timeouts,
settling): an idle agent costs next to nothing and sends no etcd request."""
DONE_REDEPLOYS_KEPT = 20
"""Cluster redeploys this node did its part of, newest last. There is one `redeploy` record at a time and a new
one has a new id, so only the current record's id must be known; the last few cover a record read late."""


class Coordinator:
    """The cluster layer of one node (`stackport.NodeLayer`; the composition root attaches it, `agent.layers`)."""

    def __init__(self, config: Config, port: StackPort, membership: Membership, *, clock: Clock | None = None,
                 operations: bool = True, proxy_post: ProxyPost | None = None,
                 ft_client: FtClient | None = None) -> None:  # fmt: skip
        """operations: run the cluster redeploy and remote commands too (`ops.ClusterOps`; the scale simulation
        leaves them out). proxy_post, ft_client: how the PD proxy and vLLM's FT API are called (tests: fakes)."""
        self.clock = clock or Clock()
        self.port = port
        self.membership = membership
        self.store = membership.store
        self.cluster = config.cluster.name
        self.node = config.node.name
        self.layout = cluster_layout(config)
        self.state_path = config.agent.state_dir / "cluster.json"
        saved = read_json(self.state_path, {})
        here = port.snapshot()
        self.epoch: str | None = None
        self._epoch_before_reset: str | None = None
        """The epoch we knew when a watch said etcd was reset: a different one then means etcd lost our keys."""
        self.gangs: dict[str, GangState] = {}
        for group in self.layout.groups:
            if self.node not in group.nodes:
                continue
            mine = tuple(c for c in group.components(self.node) if c in here.components)
            if not mine:
                continue
            gs = GangState(group, mine)
            old = (saved.get("gangs") or {}).get(group.name) or {}
            gs.acted, gs.acted_epoch = int(old.get("acted", 0)), str(old.get("epoch", ""))
            gs.ran_before = {str(c): int(g) for c, g in (old.get("ran") or {}).items()}
            self.gangs[group.name] = gs
        self.by_component = {c: gs for gs in self.gangs.values() for c in gs.components}
        self.done_redeploys: list[str] = list(saved.get("redeploys_done") or [])
        self.records: dict[str, rules.GangRecord] = {}
        """Every group's generation record (the proxy follows groups this node is not in)."""
        self.proxies = [ProxySync(plan, self.layout.groups, functools.partial(port.component, plan.component),
                                  lambda: {n: m.record for n, m in membership.members.items()},
                                  lambda: self.records, port.emit,
                                  functools.partial(port.block_ready, plan.component, "backends"),
                                  self.clock, proxy_post, lambda: self.store.state, config.cluster.member_ttl_s)
                        for plan in self.layout.proxies
                        if plan.node == self.node and plan.component in here.components]  # fmt: skip
        for proxy in self.proxies:
            port.route_proxy(proxy.plan.component, proxy)  # a restarted proxy starts with what the sync routes
        self.tasks = TaskSet()
        self.barrier = StartBarrier(self.cluster, self.node, port, membership, self.clock)
        self._wake = asyncio.Event()
        self.ops = ClusterOps(self, self.clock) if operations else None
        self.ft = FtRung(self, self.clock, ft_client)
        """vLLM's FT retry before the gang: a layer of its own, attached before this one (`agent.layers`)."""

    @property
    def config(self) -> Config:
        """The node's config now, through the port (a reload reaches the rung, drain, canary, PD watch); what
        `__init__` took from it (cluster, node, layout, groups) a reload cannot change."""
        return self.port.config

    # ---- persistence ------------------------------------------------------------------------------------------
    def save(self) -> None:
        data = {"gangs": {n: {"acted": g.acted, "epoch": g.acted_epoch, "ran": {**g.ran_before, **g.ran}}
                          for n, g in self.gangs.items()},
                "redeploys_done": self.done_redeploys[-DONE_REDEPLOYS_KEPT:]}  # fmt: skip
        with contextlib.suppress(OSError):
            write_json_atomic(self.state_path, data)

    @property
    def reachable(self) -> bool:
        return bool(self.store.state.reachable)

    def hold_out(self, hold: ProxyHold, fence: ProxyFence) -> None:
        """`coordinator_port.CoordinatorPort.hold_out`: every proxy of this node asks `hold` and `fence`."""
        for proxy in self.proxies:
            proxy.holds.append(hold)
            proxy.fences.append(fence)

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        p = rules.prefix(self.cluster)
        watches = [(p + "gangs/", self._on_gang), (p + "barriers/", self._on_barrier),
                   (rules.pause_key(self.cluster), self._on_pause), *(self.ops.watches() if self.ops else ())]
        for key, apply in watches:
            self.tasks.start(follow(self.store, key, functools.partial(self._on_watch, key, apply), clock=self.clock,
                                    retry_s=RETRY_S, what="cluster"), f"cluster:watch:{key}")  # fmt: skip
        self.tasks.start(self._work(), "cluster:work")
        self.tasks.start(self.ft.run(), "cluster:fault-tolerance")
        for proxy in self.proxies:
            self.tasks.start(proxy.run(), f"cluster:proxy:{proxy.plan.component}")
        self.store.on_state_change.append(lambda _s: self.wake())

    async def stop(self) -> None:
        await self.tasks.stop()

    def wake(self) -> None:
        self._wake.set()

    def on_node_change(self) -> None:
        """A rank started or stopped, a pause ended: note which generation each running rank runs in; look again."""
        if self.by_component:
            here = self.port.snapshot().components
            seen = {(c, gs.acted) for gs in self.gangs.values() for c in gs.components
                    if gs.runs_acted(c, here[c].running, here[c].going_down, self.reachable)}  # fmt: skip
            for c, generation in seen:
                self.by_component[c].ran[c] = generation
            if seen:
                self.save()  # for a successor: what its adopted ranks run (`rules.unrestarted`)
        self.wake()

    def spawn(self, work: Awaitable[Any]) -> None:
        """Run `work` beside the loop; it is cancelled when the coordinator stops."""
        self.tasks.start(work)

    async def _on_watch(self, prefix: str, apply: Any, item: WatchItem) -> None:
        if isinstance(item, Resync):
            await self._resync(prefix, item, apply)
        else:
            apply(item.key, item.kv)
        self.wake()

    async def _resync(self, prefix: str, item: Resync, apply: Any) -> None:
        if item.reason == "reset" and self.epoch is not None:
            # The store re-read everything: whether etcd really lost our keys, its epoch key says (ensure_epoch)
            self._epoch_before_reset, self.epoch = self.epoch, None
        if prefix.endswith("/gangs/"):
            self.records.clear()
            for gs in self.gangs.values():
                gs.record, gs.mod_revision = None, 0
        elif prefix.endswith("/barriers/"):
            for gs in self.gangs.values():
                gs.arrivals, gs.arrived_for = set(), 0
        elif not prefix.endswith("/"):  # a single key (pause, redeploy): absent unless the snapshot has it
            apply(prefix, None)
        for key, kv in item.snapshot.items.items():
            apply(key, kv)

    # ---- what the watches see -----------------------------------------------------------------------------------
    def _on_gang(self, key: str, kv: KV | None) -> None:
        name = key.rsplit("/", 1)[-1]
        if kv is None:
            self.records.pop(name, None)
        else:
            self.records[name] = rules.GangRecord.from_dict(kv.json())
        gs = self.gangs.get(name)
        if gs is None:
            return
        gs.record = rules.GangRecord.from_dict(kv.json()) if kv is not None else None
        gs.mod_revision = kv.mod_revision if kv is not None else 0

    def _wrote(self, gs: GangState, record: rules.GangRecord, revision: int) -> None:
        """Our write of the group's record succeeded: it is ours unless the watch brought a newer one during the
        await (that one is not delivered again: taking ours over it, this node acted on an old generation and
        never on the new one)."""
        if revision > gs.mod_revision:
            gs.record, gs.mod_revision = record, revision
            self.records[gs.group.name] = record

    def _lost_write(self, gs: GangState, current: KV | None) -> None:
        """Our write lost to another: the record the store answered with, unless the watch brought a newer one
        during the await (as `_wrote`)."""
        if current is None or current.mod_revision > gs.mod_revision:
            self._on_gang(rules.gang_key(self.cluster, gs.group.name), current)

    def _on_barrier(self, key: str, kv: KV | None) -> None:
        parts = key.rsplit("/", 3)
        self.barrier.on_key(self.gangs.get(parts[1]) if len(parts) == 4 else None, key, kv)

    def _on_pause(self, key: str, kv: KV | None) -> None:
        info = kv.json() if kv is not None else None
        self.port.set_cluster_pause(info if isinstance(info, dict) else None)

    # ---- the work loop: everything that writes -----------------------------------------------------------
    async def _work(self) -> None:
        last_settle = 0.0
        while True:
            busy = not self.reachable or any(g.pending or g.released != g.acted for g in self.gangs.values())
            await self.clock.wait(self._wake, RETRY_S if busy else IDLE_TICK_S)
            self._wake.clear()
            try:
                if self.reachable:
                    await self.ensure_epoch()
                    for gs in self.gangs.values():
                        await self._step(gs)
                    if self.clock.monotonic() - last_settle >= SETTLE_EVERY_S:
                        last_settle = self.clock.monotonic()
                        for gs in self.gangs.values():
                            await self._settle(gs)
                    if self.ops is not None:
                        await self.ops.step()
                for gs in self.gangs.values():
                    self.barrier.check(gs)
            except StoreError as exc:
                logger.debug(f"cluster: deferred: {exc}")
            except Exception:
                logger.exception("cluster: coordination step failed")
                await self.clock.sleep(RETRY_S)

    async def ensure_epoch(self) -> None:
        """Read (or create) the store's epoch: generations count within one epoch of one etcd's data."""
        if self.epoch is not None:
            return
        key = rules.epoch_key(self.cluster)
        result = await self.store.compare_and_swap(key, 0, uuid.uuid4().hex)
        if result.succeeded:
            current = await self.store.get(key)
        else:
            current = result.current
        if current is not None:
            self.epoch = current.text()
            before, self._epoch_before_reset = self._epoch_before_reset, None
            if before is not None and before != self.epoch:  # once per wipe, however many watches re-read
                self.port.emit("cluster_reset", "etcd came back without our keys (wiped or replaced): generations "
                               "start again, nothing is restarted for it", None, "warning")  # fmt: skip

    async def renew_epoch(self, attempts: int = 600, every_s: float = 0.5) -> None:
        """etcd's data was wiped (a cluster redeploy): forget the epoch and create the new one, once etcd answers."""
        self.epoch = None
        for _ in range(attempts):
            with contextlib.suppress(StoreError):
                await self.ensure_epoch()
                return
            await self.clock.sleep(every_s)

    def restart_every_group(self, reason: str) -> None:
        """Every group starts again as a new generation, through its barrier (after a cluster redeploy). A group
        another member already moved on for the same reason is followed, not bumped again (a member that finishes
        late would otherwise make a second generation)."""
        for gs in self.gangs.values():
            gs.released = 0
            if gs.record is None or reason not in gs.record.reason.split(rules.REASONS_SEP):
                self.ask(gs, gs.acted, reason, False)
        self.wake()

    def redeploy_done(self, rid: str) -> None:
        """This node did its part of cluster redeploy `rid` (persisted: it is not done twice)."""
        if rid not in self.done_redeploys:
            self.done_redeploys = [*self.done_redeploys, rid][-DONE_REDEPLOYS_KEPT:]
            self.save()

    def ask(self, gs: GangState, seen: int, reason: str, planned: bool) -> None:
        """Queue a request for the group's next generation. Only the work loop decides and writes it (one writer
        per group's record): nothing here awaits, and no request replaces another — those decided together make
        one generation, a later one is decided on the record written meanwhile (`rules.merge_requests`)."""
        gs.requests.append(rules.GenRequest(seen, reason, planned))
        self.wake()

    async def _step(self, gs: GangState) -> None:
        assert self.epoch is not None
        epoch = self.epoch
        if gs.requests:
            await self._bump(gs, epoch)
        view = rules.GangView(gs.record, gs.acted, gs.acted_epoch)
        if rules.baseline(view, epoch):  # (a new agent's rank not adopted yet is not down: the baseline waits for it)
            if not any(c in self.port.snapshot().adoptable for c in gs.components):
                await self._adopt_baseline(gs, epoch)
            return
        here = self.port.snapshot()
        if gs.fresh:
            if any(c in here.adoptable for c in gs.components):
                return  # whether the previous agent's ranks still run is known once their adoption was tried
            ranks = [here.components[c] for c in gs.components]
            if any(r.going_down for r in ranks):
                return  # a tree still being stopped (a restart or a failure the previous agent saw): decided once gone
            stale = gs.record and rules.unrestarted(gs.ran_before, gs.acted, [r.name for r in ranks if r.running])
            if stale and here.paused and not gs.record.planned:  # type: ignore[union-attr]
                return  # decided once the pause ends (a failure's restart waits for it, as below)
            gs.fresh = False
            if stale:
                return self._act(gs, gs.acted, here)  # the previous agent acted, then died before stopping them
            if any(r.running for r in ranks):
                gs.released = gs.acted  # adopted: they run on in the generation they started in
            elif not gs.requests:
                # Back without our ranks while the group ran on (they died unwatched, or never ran): a DP group
                # cannot take a rank back; restart it.
                self.ask(gs, gs.acted, f"{self.node} came back without its ranks of the group", False)
                return
        if gs.down_at_baseline and not any(here.components[c].going_down for c in gs.components):
            gs.down_at_baseline = False  # (a rank lost while paused, etcd wiped: it waited for a peer adopted running)
            if not gs.requests:
                return self.ask(gs, gs.acted, f"{self.node}: its ranks were down at the new epoch's baseline", False)
        target = rules.must_restart_for(view, epoch)
        if target is not None:
            assert gs.record is not None
            if here.paused and not gs.record.planned:
                if gs.deferred != target:
                    gs.deferred = target
                    self.port.emit("gang_deferred", f"group {gs.group.name} generation {target} asked by "
                                   f"{gs.record.by}: paused, acting on resume", None, "warning")  # fmt: skip
                return
            self._act(gs, target, here)
        elif not gs.requests and (rank := rules.rank_to_rejoin(gs.multi, gs.acted, gs.released, gs.ran,
                                                                 here.components, gs.components)):
            # the gate said so (its hold won: nothing earlier holds the rank); asking is this step's, not the gate's
            self.ask(gs, gs.acted, f"{self.node}/{rank} stopped during generation {gs.acted}: its group cannot take "
                     "a rank back", False)  # fmt: skip
        await self.barrier.step(gs, here)

    async def _adopt_baseline(self, gs: GangState, epoch: str) -> None:
        """First contact with this store: take its generation as ours, or create generation 1."""
        if gs.record is None or gs.record.epoch != epoch:
            first = rules.GangRecord(generation=1, reason="first generation", by=self.node, at=self.clock.time(),
                                     epoch=epoch, base=1)  # fmt: skip
            result = await self.store.compare_and_swap(rules.gang_key(self.cluster, gs.group.name), gs.mod_revision,
                                                       json.dumps(first.to_dict()))  # fmt: skip
            if not result.succeeded:
                self._lost_write(gs, result.current)
                return
            self._wrote(gs, first, result.revision)
        assert gs.record is not None
        wiped = gs.acted_epoch not in ("", epoch)  # we had acted in another epoch: etcd lost its data since
        gs.acted, gs.acted_epoch = rules.epoch_baseline(gs.record, wiped), epoch
        gs.fresh, gs.deferred = False, None  # old epoch's
        gs.arrivals, gs.arrived_for = set(), 0
        ranks = [self.port.snapshot().components[c] for c in gs.components]
        # a rank running on is adopted; one being stopped (a restart under way) starts only through the barrier
        gs.released = gs.acted if any(r.running and not r.going_down for r in ranks) else 0
        gs.down_at_baseline = wiped and gs.multi and not gs.released  # asked once its ranks are stopped (_step)
        self.save()
        self.port.wake()

    def _act(self, gs: GangState, target: int, here: NodeView) -> None:
        """A new generation: persist it, then restart every local rank of the group once."""
        assert gs.record is not None
        record = gs.record
        gs.acted, gs.deferred, gs.arrivals, gs.arrived_for = target, None, set(), 0
        self.save()
        planned = record.planned
        ranks = [here.components[c] for c in gs.components]
        running = [r.name for r in ranks if r.running and not r.going_down]
        leaving = [r.name for r in ranks if r.going_down]  # a failed rank's stop under way: not a second restart
        what = ", ".join(running) or "nothing running here"
        what += f" ({', '.join(leaving)} already stopping)" if leaving else ""
        self.port.emit("gang_restart", f"group {gs.group.name} generation {target} ({record.reason}, asked by "
                       f"{record.by}): restarting {what}", None, "warning", group=gs.group.name,
                       generation=target)  # fmt: skip
        self.port.restart(running, f"gang {gs.group.name} generation {target}: {record.reason}", planned=planned)
        self.port.wake()

    async def _bump(self, gs: GangState, epoch: str) -> None:
        """Decide the queued requests on one snapshot (the record and the queue as they are now), write the one
        generation they make, and remove only what was decided: a request queued during the write is decided at
        the next step, against the record just written."""
        batch = list(gs.requests)
        merged, done = rules.merge_requests(gs.record, epoch, batch)
        for request in done:  # someone (maybe us, a moment ago) already moved the group on: we follow theirs
            self._joined(gs, request)
        out = None
        if merged is not None:
            spec = self.port.component(gs.components[0]).restart
            out = rules.bump(gs.record, merged.seen, node=self.node, reason=merged.reason, now=self.clock.time(),
                             epoch=epoch, spec=spec, planned=merged.planned)  # fmt: skip
        if out is None:
            del gs.requests[:len(batch)]
            return
        record, decision = out
        reason = record.reason
        key = rules.gang_key(self.cluster, gs.group.name)
        result = await self.store.compare_and_swap(key, gs.mod_revision, json.dumps(record.to_dict()))
        if not result.succeeded:
            gs.requests[:len(batch)] = [r for r in batch if r not in done]  # said once
            self._lost_write(gs, result.current)  # re-read; the next step decides again
            self.wake()
            return
        del gs.requests[:len(batch)]  # appended only at the end: the batch is still the queue's head
        if gs.requests:
            self.wake()
        self._wrote(gs, record, result.revision)
        when = "now" if decision.delay_s <= 0 else f"in {decision.delay_s:.0f}s"
        self.port.emit("gang_generation", f"group {gs.group.name}: generation {record.generation} ({reason}); "
                       f"every node of the group restarts, {when}", None, "warning", group=gs.group.name,
                       generation=record.generation, delay_s=decision.delay_s)  # fmt: skip
        if decision.action == "redeploy" and self.ops is not None:
            self.ops.request_redeploy(f"group {gs.group.name} keeps failing: {decision.reason}", self.node)

    def _joined(self, gs: GangState, request: rules.GenRequest) -> None:
        """A request the generation under way answers: said, not dropped (a second generation would restart the
        group just started once more)."""
        record = gs.record
        assert record is not None
        if request.reason in record.reason.split(rules.REASONS_SEP):
            return  # the one the record was written for
        self.port.emit("gang_joined", f"group {gs.group.name}: {request.reason}: answered by generation "
                       f"{record.generation} ({record.reason}), asked after generation {request.seen}: every rank "
                       "restarts once, in it", None, group=gs.group.name, generation=record.generation)  # fmt: skip

    async def _settle(self, gs: GangState) -> None:
        """The group ran stably: clear its crash loop in etcd (the head writes; only when it changes)."""
        if gs.record is None or gs.group.head != self.node:
            return
        here = self.port.snapshot().components
        ranks = [here[c] for c in gs.components]
        if not all(r.up for r in ranks):
            gs.up_since = None
            return
        gs.up_since = gs.up_since or self.clock.time()
        spec = ranks[0].restart
        settled = rules.settle(gs.record, self.clock.time(), spec, max(gs.up_since, gs.record.at))
        if settled is not None:
            key = rules.gang_key(self.cluster, gs.group.name)
            result = await self.store.compare_and_swap(key, gs.mod_revision, json.dumps(settled.to_dict()))
            if result.succeeded:
                self._wrote(gs, settled, result.revision)
                self.port.emit("gang_stable", f"group {gs.group.name} ran stably: crash loop cleared")

    # ---- what the node asks (NodeLayer) -------------------------------------------------------------------------
    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        """The cluster's holds on a start: a cluster redeploy (ClusterOps), the group's coordination, backoff and
        barrier, the proxy's `launch_hold`. Side-effect free: the earliest hold of every layer wins — what follows
        from ours (asking a generation) is the work loop's, once it is the hold the rank shows."""
        held = self.ops.gate(comp, operator) if self.ops is not None else None
        proxy = next((p for p in self.proxies if p.plan.component == comp.name), None)
        return held or self._group_gate(comp) or (proxy.launch_hold() if proxy is not None else None)

    def _group_gate(self, comp: ComponentView) -> Hold | None:
        gs = self.by_component.get(comp.name)
        if gs is None:
            return None
        if not gs.multi and not self.reachable:
            return None  # a one-node group restarts locally while etcd is away
        name = gs.group.name
        if self.epoch is None or not self.reachable:
            return Hold(HoldKind.COORDINATION,
                        f"group {name}: waiting for etcd to coordinate its start ({self.store.state.endpoint})")
        if gs.requests:
            return Hold(HoldKind.COORDINATION, f"group {name}: asking for the next generation")
        if gs.deferred is not None:
            return Hold(HoldKind.COORDINATION, f"group {name}: generation {gs.deferred} waits for the end of the pause",
                        resolves_itself=False)  # fmt: skip
        newer = rules.must_restart_for(rules.GangView(gs.record, gs.acted, gs.acted_epoch), self.epoch)
        if newer is not None:  # one generation, one launch: not in `acted`, which the next one stops at once
            return Hold(HoldKind.COORDINATION, f"group {name}: generation {newer} is known, not yet acted on here: "
                        f"the rank starts in it, not in {gs.acted}")  # fmt: skip
        record = gs.record
        if record is not None and record.not_before > self.clock.time():
            left = record.not_before - self.clock.time()
            return Hold(HoldKind.GROUP_BACKOFF,
                        f"group {name}: backing off {left:.0f}s as one (generation {record.generation})")
        if gs.released == gs.acted:
            if rules.rejoins(gs.multi, gs.acted, gs.ran.get(comp.name), comp.running):
                # It ran in this generation and stopped without the group's restart (it died while paused, an
                # operator stopped and starts it): a DP group cannot take a rank back; the group starts again.
                # Only said here: the work loop asks, once this hold is the one that wins (`rank_to_rejoin`).
                return Hold(HoldKind.COORDINATION, f"group {name}: {comp.name} ran in generation {gs.acted} "
                            "already: the group starts again as one (the next generation is asked)",
                            data={"rejoin": gs.acted})  # fmt: skip
            return None
        return self.barrier.hold(gs)  # the rank shown held wakes the work loop (on_node_change): it arrives then

    def decide(self, comp: ComponentView, failure: Failure) -> Delegated | None:
        """A rank's failure restarts its whole group, as one new generation (None: not a gang matter). Asked as soon
        as the failure is known, while the rank's old tree is still being stopped: the generation is written now
        and the peers begin their stops at once; the barrier still waits for this tree."""
        gs = self.by_component.get(comp.name)
        if gs is None or failure.permanent:
            return None  # a permanent failure is this node's: failed, retried at the cap; no group restart helps
        if not self.reachable and not gs.multi:
            return None
        name, nodes = gs.group.name, ", ".join(gs.group.nodes)
        seen = rules.failed_in(rules.GangView(gs.record, gs.acted, gs.acted_epoch), gs.ran.get(comp.name))
        if seen is None:
            self.wake()
            under_way = gs.record.generation if gs.record is not None else gs.acted
            return Delegated(f"group {name} restarts as one: generation {under_way} (already asked) on {nodes}")
        reason = f"{self.node}/{comp.name}: {failure.detail}"
        self.ask(gs, seen, reason, False)
        if not self.reachable:
            return Delegated(f"group {name}: etcd unreachable, the group's restart waits until etcd is back "
                             "(the other nodes keep serving)")  # fmt: skip
        return Delegated(f"group {name} restarts as one: generation {seen + 1} on {nodes}")

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> str | None:
        """An operator's restart of a rank restarts its group (a planned generation: drained first). Refused while a
        cluster redeploy runs (ClusterOps)."""
        if self.ops is not None:
            self.ops.refuse_while_redeploying(comp, action)
        gs = self.by_component.get(comp.name)
        if gs is None or action != "restart" or (not gs.multi and not self.reachable):
            return None
        if not self.reachable:
            raise CoordinationUnavailable(f"etcd unreachable: cannot restart group {gs.group.name} as one now "
                                          "(its other ranks would hang); retry once etcd answers")
        return self.request_generation(gs.group.name, f"operator restart of {self.node}/{comp.name} ({by})",
                                       drain)  # fmt: skip

    def request_generation(self, group: str, reason: str, planned: bool = True) -> str:
        gs = self.gangs.get(group)
        if gs is None:
            raise KeyError(group)
        self.ask(gs, gs.acted, reason, planned)
        return (f"restarting group {group} as generation {gs.acted + 1}: every rank on "
                f"{', '.join(gs.group.nodes)} restarts once")  # fmt: skip

    async def ask_generations(self, groups: list[str], reason: str, planned: bool) -> dict[str, str]:
        """`nodeagentctl cluster restart`: a new generation of each group, written from here (this node need not
        be in the group): every member restarts once."""
        if not self.reachable or self.epoch is None:
            raise CoordinationUnavailable(f"etcd unreachable ({self.store.state.endpoint})")
        out = {}
        for group in groups:
            spec = next(iter(self.port.snapshot().components.values())).restart
            for _attempt in range(5):
                key = rules.gang_key(self.cluster, group)
                kv = await self.store.get(key)
                current = rules.GangRecord.from_dict(kv.json()) if kv is not None else None
                seen = current.generation if current is not None and current.epoch == self.epoch else 0
                made = rules.bump(current, seen, node=self.node, reason=reason, now=self.clock.time(), epoch=self.epoch,
                                  spec=spec, planned=planned)  # fmt: skip
                assert made is not None
                result = await self.store.compare_and_swap(key, kv.mod_revision if kv else 0,
                                                           json.dumps(made[0].to_dict()))  # fmt: skip
                if result.succeeded:
                    out[group] = f"generation {made[0].generation}"
                    break
            else:
                out[group] = "busy: another node is changing it; try again"
        self.wake()
        return out

    async def set_pause(self, paused: bool, by: str, reason: str = "") -> dict[str, Any] | None:
        key = rules.pause_key(self.cluster)
        if not paused:
            await self.store.delete(key)
            return None
        info = {"by": f"{self.node}: {by}", "at": self.clock.time(), "reason": reason}
        await self.store.put(key, json.dumps(info))
        return info

    # ---- views --------------------------------------------------------------------------------------------------
    def status_section(self) -> dict[str, Any]:
        return {"cluster": self.status(), "gangs": self.acks()}

    def member_report(self) -> MemberReport:
        return MemberReport(gangs=self.acks())

    def acks(self) -> dict[str, Any]:
        """For the member key: the generation each group's ranks here were started for."""
        here = self.port.snapshot().components
        return {n: {"generation": g.acted, "epoch": g.acted_epoch, "released": g.released == g.acted,
                    "ranks": list(g.components),
                    "running": [c for c in g.components if here[c].running]}
                for n, g in self.gangs.items()}  # fmt: skip

    def status(self) -> dict[str, Any]:
        return {"etcd": "reachable" if self.reachable else "unreachable", "epoch": self.epoch,
                "pause": self.port.cluster_pause(), "gangs": {n: gs.status() for n, gs in self.gangs.items()},
                "redeploy": self.ops.status() if self.ops is not None else None,
                "proxies": [p.status() for p in self.proxies]}  # fmt: skip

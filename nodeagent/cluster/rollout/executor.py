"""The rollout's etcd I/O: the plan and its progress in the `rollout` key, each member's report in
`rollout_nodes/<node>`, and what this agent sees and does for the step in progress.

The rules are `cluster.rollout_rules` (pure) and the plan `cluster.rollout_plan` (pure). There is no
coordinator of our own: every agent watches the record, adds what only it can see (its ranks drained, its config
staged, the canary of a group it heads, the proxy it runs taking a group out and back in) and moves the step on
when it can, each write a transaction on the record's mod_revision. It acts through the existing pieces: a
group's restart is one planned gang generation (`rules.bump`, exactly once per step), the proxy membership is
`ProxySync` (a hold-out source), the node is reached through its `StackPort` and three calls on the agent
(`ConfigHost`: the running config, this node's file on disk, take a config for the next starts).

Attached to the node as a second `NodeLayer`: it holds a rank of a step that changes the container's image until
the container runs it, and adds `rollout` to /status. Made before the container and the stack start: an agent
restarted mid-rollout takes back the config its group runs (`MemberConfig.restore`) before either starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.cluster import rules
from nodeagent.cluster.proxy_sync import group_healthy
from nodeagent.cluster.rollout import rules as rr
from nodeagent.cluster.rollout.bake import BakeWatch, Scrape
from nodeagent.cluster.rollout.http import http_canary, http_inflight, http_scrape
from nodeagent.cluster.rollout.member_config import ConfigHost, MemberConfig
from nodeagent.cluster.rollout.plan import Options, PlanError, make_plan
from nodeagent.cluster.rollout.record import Record, Step, new_record, report_prefix, rollout_key
from nodeagent.cluster.rollout.running import group_runs
from nodeagent.cluster.rollout.states import RESTARTS, Phase, Status
from nodeagent.cluster.rollout.view import floor_text, group_load_s, measured_overhead_s, serving_now, time_left
from nodeagent.cluster.store import KV, Resync, StoreError, WatchItem
from nodeagent.cluster.tasks import TaskSet, follow
from nodeagent.core.errors import CoordinationUnavailable
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import Hold, HoldKind

if TYPE_CHECKING:
    from nodeagent.cluster.coordinator_port import CoordinatorPort, ProxyView
    from nodeagent.core.failure import Failure
    from nodeagent.seam.stackport import ComponentView, MemberReport

ACTIVE_TICK_S = 1.0
IDLE_TICK_S = 5.0
STALE_S = 30.0
"""Agents outside the step drive it only when nobody moved the record for this long (its drivers are gone)."""
DRAIN_QUIET_S = 2.0
"""Drained = no request on the group's ranks at two looks this far apart (a request may be between hops)."""

Inflight = Callable[[str, Any], Awaitable[tuple[int, int] | None]]
Canary = Callable[[str, Any], Awaitable[tuple[bool, str]]]


class RolloutRefused(ValueError):
    """A rollout that cannot start or a control that does not apply: the API answers 409 with the reason."""


class RolloutExecutor:
    """One agent's part in rollouts (`stackport.NodeLayer`; the composition root attaches it, `agent.layers`)."""

    def __init__(self, coordinator: CoordinatorPort, host: ConfigHost, *, clock: Clock | None = None,
                 inflight: Inflight | None = None, canary: Canary | None = None,
                 scrape: Scrape | None = None, new_id: Callable[[], str] | None = None) -> None:  # fmt: skip
        """`new_id`: a new rollout's id (random; the simulation draws it from its seed, so a run replays)."""
        self.co = coordinator
        self.host = host
        self.port = coordinator.port
        self.store = coordinator.store
        self.clock = clock or coordinator.clock
        self.node = coordinator.node
        self.cluster = coordinator.cluster
        self.layout = coordinator.layout
        self.group = self.layout.group_of(self.node)
        self.key = rollout_key(self.cluster)
        self.report_key = report_prefix(self.cluster) + self.node
        self._inflight = inflight or http_inflight
        self._canary = canary or http_canary
        self.bake = BakeWatch(scrape or http_scrape)
        self._new_id = new_id or (lambda: uuid.uuid4().hex[:8])
        self._recreated: set[tuple[str, int, str]] = set()
        self.record: Record | None = None
        self.synced = False
        """The record was read once: until then the proxy is told nothing (a group held out must stay out)."""
        self.mod_revision = 0
        self.changed_at = self.clock.monotonic()
        self.reports: dict[str, dict[str, Any]] = {}
        self._quiet_since: float | None = None
        self._reported: dict[str, Any] | None = None
        self._stage_error: str | None = None
        self.member = MemberConfig(host, self.co.config.agent.state_dir, self.co.config.source)
        self._hash = self.member.hash
        self._wake = asyncio.Event()
        self.tasks = TaskSet()
        self.co.hold_out(self.out_of_proxy, self.fence)
        with contextlib.suppress(Exception):  # never fatal: the record, once read, stages what it wants
            restored = self.member.restore()
            if restored:
                self.port.emit("rollout_staged", restored)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        for key, apply in ((self.key, self._on_record), (report_prefix(self.cluster), self._on_report)):
            self.tasks.start(follow(self.store, key, functools.partial(self._on_watch, key, apply), clock=self.clock,
                                    retry_s=ACTIVE_TICK_S, what="rollout"), f"rollout:watch:{key}")  # fmt: skip
        self.tasks.start(self._work(), "rollout:work")

    async def stop(self) -> None:
        await self.tasks.stop()

    def wake(self) -> None:
        self._wake.set()

    def _on_watch(self, prefix: str, apply: Callable[[str, KV | None], None], item: WatchItem) -> None:
        if isinstance(item, Resync):
            if prefix.endswith("/"):
                self.reports.clear()
            else:
                apply(prefix, None)
                self.synced = True
            for key, kv in item.snapshot.items.items():
                apply(key, kv)
        else:
            apply(item.key, item.kv)
        self.wake()

    def _on_record(self, key: str, kv: KV | None) -> None:
        if key != self.key:
            return
        record = Record.from_dict(kv.json()) if kv is not None else None
        if kv is None or kv.mod_revision != self.mod_revision:
            self.changed_at = self.clock.monotonic()
        self.record, self.mod_revision = record, kv.mod_revision if kv is not None else 0

    def _on_report(self, key: str, kv: KV | None) -> None:
        node = key.rsplit("/", 1)[-1]
        data = kv.json() if kv is not None else None
        if isinstance(data, dict):
            self.reports[node] = data
        else:
            self.reports.pop(node, None)

    # ---- the loop ---------------------------------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            active = self.record is not None and self.record.active
            await self.clock.wait(self._wake, ACTIVE_TICK_S if active else IDLE_TICK_S)
            self._wake.clear()
            try:
                self._keep_staged()
                if self.synced:
                    self.member.remember(self.host.running_config())
                if self.co.reachable:
                    await self._report()
                    if self.record is not None and self.record.active:
                        await self._duties()
                        await self._drive()
            except StoreError as exc:
                logger.debug(f"rollout: deferred: {exc}")
            except Exception:
                logger.exception("rollout: step failed")
                await self.clock.sleep(ACTIVE_TICK_S)

    async def _cas(self, record: Record) -> bool:
        result = await self.store.compare_and_swap(self.key, self.mod_revision, json.dumps(record.to_dict()))
        if result.succeeded:
            self.record, self.mod_revision, self.changed_at = record, result.revision, self.clock.monotonic()
            return True
        self._on_record(self.key, result.current)
        self.wake()
        return False

    # ---- this member's config --------------------------------------------------------------------------------
    def _keep_staged(self) -> None:
        """The config in memory follows the rollout: after an agent restart (which loaded the file on disk) a
        group not yet rolled keeps its previous config, a group rolled back keeps the one it went back to."""
        record = self.record
        if record is None:
            return
        running = self.member.running()
        previous = self.member.previous
        if running == record.old_hash and (previous is None or self._hash(previous) != running):
            self.member.save_previous(self.host.running_config())
        want = rr.wanted_hash(record, self.group.name if self.group else None, self.node)
        if want is not None and running in (record.old_hash, record.new_hash):
            self.member.keep_wanted(record.id, record.old_hash, record.new_hash, want)
        if want is None or want == running or running not in (record.old_hash, record.new_hash):
            return
        try:
            self.host.stage_config(self.member.config_for(want))
            self._stage_error = None
            self.port.emit("rollout_staged", f"rollout {record.id}: this node takes {want[:12]} as the rollout "
                           f"stands (it had {running[:12]} in memory)")  # fmt: skip
        except Exception as exc:
            if self._stage_error != str(exc):
                self._stage_error = str(exc)
                self.port.emit("rollout_stage_failed", f"rollout {record.id}: cannot take {want[:12]}: {exc}",
                               None, "error")  # fmt: skip

    async def _report(self) -> None:
        """This member's report: the file on its disk, the previous file it saved."""
        disk, error = self.member.disk(self.record.id if self.record is not None else None)
        previous = self.member.previous
        data = {"hash": disk, "error": error, "running": self.member.running(),
                "previous": self._hash(previous) if previous is not None else None,
                "rollout": self.record.id if self.record is not None else None}  # fmt: skip
        if data != self._reported or self.reports.get(self.node) != data:
            # (also when our key is gone: it lives on the lease, which a long stall can lose and re-grant)
            await self.store.put(self.report_key, json.dumps(data), lease=self.co.membership.lease)
            self._reported = data
            self.reports[self.node] = data

    # ---- what only this agent can see -------------------------------------------------------------------------
    async def _duties(self) -> None:
        record = self.record
        assert record is not None
        i = record.current()
        if i is None:
            return
        step = record.steps[i]
        nodes = step.nodes({g.name: g.nodes for g in self.layout.groups})
        self.bake.keep_only(record.id)
        if step.phase in (Phase.RESTARTING, Phase.GATING) and self.group is not None and self.group.name in step.groups:
            await self._recreate_container(record, i, step)
        if (record.exclusive and step.phase in RESTARTS and self.co.proxies and not step.unlisted
                and all(self._proxy_unlisted(p, step) for p in self.co.proxies)):  # fmt: skip
            await self._mark(i, "unlisted")
        if step.phase == Phase.DRAINING:
            for g in step.groups:  # the old processes' record, before the restart: the bake's baseline
                group = self.layout.group(g)
                if group.head == self.node and not step.failed and not step.rollback:
                    await self.bake.remember_baseline((record.id, i, g), self._endpoints(group))
            if self.co.proxies and not step.proxy_out and all(self._proxy_out(p, step) for p in self.co.proxies):
                await self._mark(i, "proxy_out")
            mine = self.node in nodes and self.node not in step.drained
            if mine and (step.proxy_out or not self.layout.proxies) and await self._drained(step):
                await self._mark(i, "drained")
        elif step.phase == Phase.STAGING and self.node in nodes and self.node not in (*step.staged, *step.stage_errors):
            await self._stage(i, step)
        elif step.phase == Phase.GATING:
            obs = self._observe()
            for g in step.groups:
                group = self.layout.group(g)
                if group.head == self.node and g not in step.canary and rr.ready_again(step, obs, g):
                    ok, detail = await self._group_canary(group)
                    await self._mark(i, "canary", g, "ok" if ok else detail)
        elif step.phase == Phase.BAKING and not step.failed and not step.rollback:
            for g in step.groups:
                group = self.layout.group(g)
                if group.head == self.node and g not in step.bake:
                    opts = record.options
                    peers = [e for other in self.layout.groups if other.kind == group.kind
                             and other.name not in step.groups for e in self._endpoints(other)]  # fmt: skip
                    why = await self.bake.check((record.id, i, g), self._endpoints(group), opts.bake_error_rate,
                                                opts.bake_ttft_factor, peers)  # fmt: skip
                    if why is not None:
                        await self._mark(i, "bake", g, why)
        elif step.phase == Phase.REJOINING and self.co.proxies and not step.proxy_in and all(
                all(p.health.get(g) == "" for g in step.groups) for p in self.co.proxies):  # fmt: skip
            await self._mark(i, "proxy_in")

    async def _mark(self, index: int, what: str, node: str | None = None, value: str = "") -> None:
        assert self.record is not None
        new = rr.mark(self.record, index, what, node or self.node, value, now=self.clock.time())
        if new is not None:
            await self._cas(new)

    def _proxy_out(self, proxy: ProxyView, step: Step) -> bool:
        """The proxy was told to stop routing to the step's groups (it deletes them once idle: not waited for)."""
        if proxy.applied is None:
            return True  # no proxy process: nothing routes to them
        return all(not set(self.layout.group(g).endpoints) & proxy.applied.get(self.layout.group(g).kind, set())
                   for g in step.groups)  # fmt: skip

    def _proxy_unlisted(self, proxy: ProxyView, step: Step) -> bool:
        """The proxy lists none of the step's groups, as its last answer said (None: no proxy process)."""
        if proxy.active is None:
            return True
        return all(not set(self.layout.group(g).endpoints) & proxy.active.get(self.layout.group(g).kind, set())
                   for g in step.groups)  # fmt: skip

    async def _drained(self, step: Step) -> bool:
        """No request running or waiting on this node's serving ranks of the step, twice DRAIN_QUIET_S apart."""
        here = self.port.snapshot().components
        busy = 0
        for g in step.groups:
            group = self.layout.group(g)
            for proc in group.processes:
                if proc.node != self.node or not proc.endpoint or not here[proc.component].running:
                    continue
                seen = await self._inflight(proc.component, self.co.config.components[proc.component])
                busy += 1 if seen is None else seen[0] + seen[1]
        now = self.clock.monotonic()
        if busy:
            self._quiet_since = None
            return False
        if self._quiet_since is None:
            self._quiet_since = now
            self.wake()
        return now - self._quiet_since >= DRAIN_QUIET_S

    async def _stage(self, index: int, step: Step) -> None:
        running = self.host.running_config()
        if self._hash(running) == step.from_hash and not step.failed and not step.rollback:
            self.member.save_previous(running)
        try:
            config = self.member.config_for(step.to_hash)
            if self._hash(running) != step.to_hash:
                self.host.stage_config(config)
        except Exception as exc:
            await self._mark(index, "stage_error", value=str(exc).splitlines()[0][:300])
            return
        assert self.record is not None
        self.member.keep_wanted(self.record.id, self.record.old_hash, self.record.new_hash, step.to_hash)
        self.port.emit("rollout_staged", f"rollout step {index + 1}: the next start of "
                       f"{', '.join(self.group.components(self.node)) if self.group else 'vLLM'} uses "
                       f"{step.to_hash[:12]}")  # fmt: skip
        await self._mark(index, "staged")

    async def _recreate_container(self, record: Record, i: int, step: Step) -> None:
        """A step that changes the container's image: once the step's generation stopped this node's ranks, the
        container is recreated with it (a planned recreate: the worker inside stops and starts too) before the
        ranks start again; `gate` holds them until then."""
        assert self.group is not None
        key = (record.id, i, step.to_hash)
        gs = self.co.gangs.get(self.group.name)
        if key in self._recreated or gs is None or gs.acted <= step.base.get(self.group.name, 0):
            return
        here = self.port.snapshot().components
        if not all(here[c].stopped for c in self.group.components(self.node) if c in here):
            return
        pending = self.host.container_pending()
        self._recreated.add(key)
        if pending is None:
            return
        what = self.host.recreate_container()
        self.port.emit("rollout_container", f"rollout {record.id} step {i + 1}: recreating the container ({what} "
                       "changed); the ranks start in the new one")  # fmt: skip

    @staticmethod
    def _endpoints(group: Any) -> list[str]:
        return [proc.endpoint for proc in group.processes if proc.endpoint]

    async def _group_canary(self, group: Any) -> tuple[bool, str]:
        for proc in group.processes:
            if proc.endpoint:
                ok, detail = await self._canary(proc.endpoint, self.co.config.components.get(proc.component))
                if not ok:
                    return False, detail
        return True, "ok"

    # ---- moving the step on ------------------------------------------------------------------------------------
    def _observe(self) -> rr.Observed:
        members = {n: m.record for n, m in self.co.membership.members.items()}
        groups = {}
        for g in self.layout.groups:
            gang = self.co.records.get(g.name)
            generation = gang.generation if gang is not None and gang.epoch == self.co.epoch else None
            healthy, why = group_healthy(g, members, generation)
            failed = {}
            for p in g.processes:
                record = members.get(p.node) or {}
                if ((record.get("components") or {}).get(p.component) or {}).get("state") == "failed":
                    acted = ((record.get("gangs") or {}).get(g.name) or {}).get("generation")
                    failed[f"{p.node}/{p.component}"] = int(acted or 0)
            groups[g.name] = rr.GroupObs(g.kind, g.nodes, generation, healthy, why, failed)
        published = {n: r.get("cluster_hash") for n, r in members.items()}
        return rr.Observed(self.clock.time(), groups, dict(self.reports), bool(self.layout.proxies), published,
                           group_runs(self.layout.groups, members))  # fmt: skip

    def _may_drive(self, record: Record) -> bool:
        i = record.current()
        master = self.layout.master
        if i is None or (master is not None and master.name == self.node):
            return True
        if self.node in record.steps[i].nodes({g.name: g.nodes for g in self.layout.groups}):
            return True
        return self.clock.monotonic() - self.changed_at >= STALE_S

    async def _drive(self) -> None:
        record = self.record
        if record is None or self.co.epoch is None or not self._may_drive(record):
            return
        out = rr.advance(record, self._observe())
        if out is None:
            return
        new, asks = out
        if new is not record:
            if not await self._cas(new):
                return
            bad = new.status in (Status.HALTED, Status.FAILED)
            self.port.emit("rollout", new.message, None, "error" if bad else "info",
                           rollout=new.id, status=new.status)  # fmt: skip
        for ask in asks:
            await self._ask_generation(ask)
        self.wake()

    async def _ask_generation(self, ask: rr.Ask) -> None:
        """A planned generation past `base` for the group, exactly once however many agents ask."""
        epoch = self.co.epoch
        known = self.co.records.get(ask.group)
        if epoch is None or (known is not None and known.epoch == epoch and known.generation > ask.base):
            return
        key = rules.gang_key(self.cluster, ask.group)
        kv = await self.store.get(key)
        current = rules.GangRecord.from_dict(kv.json()) if kv is not None else None
        spec = next(iter(self.port.snapshot().components.values())).restart
        made = rules.bump(current, ask.base, node=self.node, reason=ask.reason, now=self.clock.time(), epoch=epoch,
                          spec=spec, planned=True)  # fmt: skip
        if made is not None:
            await self.store.compare_and_swap(key, kv.mod_revision if kv is not None else 0,
                                              json.dumps(made[0].to_dict()))  # fmt: skip

    # ---- the operator's side (API) -------------------------------------------------------------------------------
    async def plan(self, path: str | None, options: Mapping[str, Any], *, dry_run: bool, by: str) -> dict[str, Any]:
        """Compare `path` (this node's new file) with the running one; store the plan unless dry_run."""
        if not self.co.reachable or self.co.epoch is None:
            raise CoordinationUnavailable(f"etcd unreachable ({self.store.state.endpoint})")
        try:
            opts = Options.from_dict(options)
            new = self.host.read_config_file(path)
        except PlanError:
            raise
        except Exception as exc:
            raise PlanError(f"the new file: {exc}") from None
        old = self.host.running_config()
        old_hash, new_hash = self._hash(old), self._hash(new)
        from nodeagent.config.cluster import cluster_file_hash

        shared = cluster_file_hash(old)  # what member records publish: the shared sections (the image is not in it)
        differ = {n: str(m.record.get("cluster_hash"))[:12] for n, m in self.co.membership.members.items()
                  if m.record.get("cluster_hash") != shared}  # fmt: skip
        differ |= {n: str(r.get("running"))[:12] for n, r in self.reports.items()
                   if r.get("running") not in (None, old_hash)}  # fmt: skip
        plan = make_plan(old, new, opts, old_hash=old_hash, new_hash=new_hash, load_s=self._load_s(),
                         base_env=self.port.base_env,
                         overhead_s=measured_overhead_s(self.record))  # fmt: skip
        out = plan.to_dict()
        if differ:
            out["refused"] = [*out["refused"], "the members do not run one file: " + ", ".join(
                f"{n} has {h}" for n, h in sorted(differ.items())) + f" (this node runs {old_hash[:12]})"]
            out["ok"] = False
        current = self.record
        if (current is not None and current.active) or (current is not None and current.status == Status.HALTED):
            out["refused"] = [*out["refused"], f"rollout {current.id} is {current.status}: "
                              "abort or roll it back first"]  # fmt: skip
            out["ok"] = False
        out["have_new_file"] = sorted(n for n, r in self.reports.items() if r.get("hash") == new_hash)
        members = sorted({m.name for m in self.port.config.cluster.nodes} | set(self.reports))
        out["missing_new_file"] = {n: str((self.reports.get(n) or {}).get("hash") or "no report")[:12]
                                   for n in members if n not in out["have_new_file"]}  # fmt: skip
        if dry_run or not out["ok"]:
            return {**out, "started": False}
        record = new_record(self._new_id(), f"{self.node}: {by}", self.clock.time(), plan,
                               new_shared=cluster_file_hash(new), old_shared=shared)  # fmt: skip
        if not await self._cas(record):
            raise RolloutRefused("another rollout was stored meanwhile: see `nodeagentctl cluster rollout status`")
        self.port.emit("rollout", record.message, None, rollout=record.id, status=record.status)
        return {**out, "started": True, "id": record.id}

    async def control(self, action: str, by: str) -> dict[str, Any]:
        for _attempt in range(5):
            kv = await self.store.get(self.key)
            self._on_record(self.key, kv)
            if self.record is None:
                raise RolloutRefused("no rollout in etcd")
            try:
                new = rr.control(self.record, action, self.clock.time(), f"{self.node}: {by}")
            except ValueError as exc:
                raise RolloutRefused(str(exc)) from None
            if await self._cas(new):
                self.port.emit("rollout", new.message, None, rollout=new.id, status=new.status)
                self.wake()
                return self.view()
        raise RolloutRefused("the rollout changes too fast to apply it; try again")

    def out_of_proxy(self) -> dict[str, str] | None:
        return rr.held_out(self.record, self._runs()) if self.synced else None

    def fence(self) -> dict[str, tuple[str, ...]]:
        return rr.fence(self.record, self._runs())

    def _runs(self) -> dict[str, frozenset[str]] | None:
        """What each group's ranks run, as their members say (only an exclusive rollout asks)."""
        if self.record is None or not self.record.exclusive:
            return None
        return group_runs(self.layout.groups, {n: m.record for n, m in self.co.membership.members.items()})

    def _load_s(self) -> dict[str, float]:
        """Each group's last load time, from the members' records (their agents keep it across restarts)."""
        return group_load_s(self.layout.groups, {n: m.record for n, m in self.co.membership.members.items()})

    def view(self) -> dict[str, Any]:
        record = self.record
        if record is None:
            return {"rollout": None}
        obs = self._observe()
        return {"rollout": {**record.to_dict(), "current": record.current(), "floor": floor_text(record, obs),
                            "serving": serving_now(record, obs), "held_out": rr.held_out(record, self._runs()),
                            # while a step waits (a file, the floor) nothing moves: no estimate, the wait says why
                            "time_left_s": None if " waits (" in record.message else time_left(
                                record, self._load_s(), self.clock.time()),
                            "have_new_file": sorted(n for n, r in self.reports.items()
                                                    if r.get("hash") == record.new_hash)}}  # fmt: skip

    # ---- NodeLayer ---------------------------------------------------------------------------------------------
    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        """A rank of a step that changes the container's image starts only in the new container; in an
        incompatible change, only once the proxy lists its group no more (`rollout_rules.proxy_wait`); never for a
        generation the step's next known decision replaces (`rollout_rules.next_restart`)."""
        record, group = self.record, self.group
        if record is None or group is None or comp.name not in group.components(self.node):
            return None
        gs = self.co.gangs.get(group.name)
        replaced = rr.next_restart(record, group.name, gs.acted, self._observe) if gs is not None else None
        if replaced is not None and not comp.running:
            return Hold(HoldKind.ROLLOUT, replaced)
        i = record.current()
        step = record.steps[i] if i is not None else None
        if i is None or step is None or group.name not in step.groups or step.phase not in RESTARTS:
            return None
        if step.phase == Phase.STAGING and self.node not in step.staged:
            return None
        pending = self.host.container_pending()
        if pending is not None:
            return Hold(HoldKind.CONTAINER, f"rollout {record.id} step {i + 1}: the container is recreated first "
                        f"({pending} changed), after the step's generation stopped the ranks")  # fmt: skip
        wait = rr.proxy_wait(record, group.name, bool(self.layout.proxies))
        return Hold(HoldKind.ROLLOUT, wait) if wait is not None else None

    def decide(self, comp: ComponentView, failure: Failure) -> None:
        return None

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> str | None:
        return None

    def status_section(self) -> dict[str, Any]:
        record = self.record
        if record is None:
            return {}
        i = record.current()
        step = record.steps[i] if i is not None else None
        return {"rollout": {"id": record.id, "status": record.status, "message": record.message,
                            "step": i + 1 if i is not None else None, "steps": len(record.steps),
                            "phase": step.phase if step else None, "groups": list(step.groups) if step else []}}

    def member_report(self) -> MemberReport | None:
        return None

    def on_node_change(self) -> None:
        self.wake()

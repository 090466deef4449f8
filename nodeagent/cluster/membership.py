"""This node as a member of the cluster, and its view of the other members, through the coordination store.

Keys (`/dsv4-agent/<cluster>/`):
- `nodes/<name>`: this node's member record (JSON, `member_record`) on its lease: a dead agent's key is gone
  after at most `cluster.member_ttl_s`. Written on every change the others must see (`steady`: a component's
  state, pid, readiness, the kind of its hold; bursts coalesced to one write per `MIN_WRITE_INTERVAL_S`) and every
  `cluster.member_heartbeat_s` (fresh clock samples, and a hold's latest text).
- `duplicates/<name>/<instance>`: an agent that finds `nodes/<name>` held by another agent (another host or
  state folder) does not overwrite it: it writes its record here, peers report a duplicate name, and it claims
  the key again once the holder's lease has expired. Its own previous incarnation (same host and state folder,
  e.g. after a kill -9 and restart within the TTL) it simply takes over.

At rest this costs about one etcd request per second at most: a keepalive every ttl/3 and a write per heartbeat;
the watches are streams. Nothing here blocks or raises into the agent: while etcd is unreachable the view keeps
what it last knew and says so (`etcd.state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from loguru import logger

from nodeagent import __version__
from nodeagent.cluster.consistency import ClockSamples, Expected, Finding, check_all
from nodeagent.cluster.member_record import member_record
from nodeagent.cluster.store import KV, Change, Resync, Store, StoreError, StoreUnavailable, WatchItem
from nodeagent.cluster.tasks import TaskSet, follow
from nodeagent.core.bindaddr import is_wildcard, url_host
from nodeagent.seam.host import Clock

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.seam.stackport import MemberReport, NodeView

MIN_WRITE_INTERVAL_S = 1.0
RETRY_S = 2.0
RECHECK_DELAY_S = 2.0
"""Watch events coalesce into one consistency check at most this often: the check reads every member, so one per
event cost O(N) per event — O(N²) per agent for N members' heartbeats, which alone saturated the simulation's
cores at N = 256. A warning (a hash seed, a skewed clock) is raised within this delay; readers of the findings
(`view`, `status_section`) run a pending check first, so what the API shows is never stale."""
CLOCK_RECHECK_S = 15.0
"""A heartbeat changes only a record's `wall_clock` (a clock sample): it is checked this late, with the others."""
LOOPBACK = ("127.", "::1", "localhost")


def cluster_prefix(cluster: str) -> str:
    return f"/dsv4-agent/{cluster}/"


def _same_beyond_clock(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal but for `wall_clock` (a heartbeat's only change), without copying either record."""
    return a.keys() == b.keys() and all(v == b[k] for k, v in a.items() if k != "wall_clock")


def member_key(cluster: str, name: str) -> str:
    return f"{cluster_prefix(cluster)}nodes/{name}"


class MemberHost(Protocol):
    """What membership needs of the node (a part of `stackport.StackPort`): the record is built from the node's
    view and the layers' typed reports (`member_record`), never from /status."""

    @property
    def base_env(self) -> Mapping[str, str]: ...

    def snapshot(self) -> NodeView: ...

    def member_report(self) -> MemberReport: ...

    def emit(self, kind: str, message: str, component: str | None = None, level: str = "info",
             **data: Any) -> None: ...  # fmt: skip


@dataclass(frozen=True)
class Identity:
    """Which agent process writes the record: tells a duplicate name from our own previous incarnation."""

    host: str
    state_dir: str
    pid: int = field(default_factory=os.getpid)
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started_at: float = field(default_factory=time.time)

    def same_node(self, agent: Mapping[str, Any]) -> bool:
        return agent.get("host") == self.host and agent.get("state_dir") == self.state_dir

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "state_dir": self.state_dir, "pid": self.pid, "instance": self.instance,
                "started_at": self.started_at}  # fmt: skip


# ---- what the cluster file says (pure) ------------------------------------------------------------------------


def expected_members(config: Config) -> list[Expected]:
    from nodeagent.config.layout import cluster_layout

    layout = cluster_layout(config)
    out = []
    for m in layout.members:
        group = layout.group_of(m.name)
        piece = group.slice_of(m.name) if group is not None else None
        out.append(Expected(m.name, m.ip, m.role, group.name if group else None,
                            (piece.start_rank, piece.size_local) if piece else None))  # fmt: skip
    return out


def api_url(config: Config) -> str | None:
    """Where peers reach this agent's API; None when it listens on loopback on a node with a routable IP."""
    host, port = config.agent.api.host, config.agent.api.port
    ip = config.node.ip
    if is_wildcard(host):
        host = ip
    elif host.startswith(LOOPBACK) and not ip.startswith(LOOPBACK):
        return None
    return f"http://{url_host(host)}:{port}"


def static_facts(config: Config, base_env: Mapping[str, str]) -> dict[str, Any]:
    """The parts of the record that change only with the config."""
    from nodeagent.config.cluster import cluster_file_hash
    from nodeagent.render.launch import render_component

    own = next((e for e in expected_members(config) if e.name == config.node.name), None)
    seeds = {}
    for name, comp in config.active_components().items():
        if comp.kind == "vllm":
            seeds[name] = render_component(name, config, base_env).environment(base_env).get("PYTHONHASHSEED")
    return {
        "name": config.node.name, "ip": config.node.ip, "role": config.node.role,
        "group": own.group if own else None,
        "ranks": {"start": own.ranks[0], "count": own.ranks[1]} if own and own.ranks else None,
        "version": __version__, "cluster_hash": cluster_file_hash(config), "pythonhashseed": seeds,
        "api_url": api_url(config),
    }  # fmt: skip


def steady(record: Mapping[str, Any]) -> dict[str, Any]:
    """What of a record must reach the others at once: all but its clock sample and the text of a hold whose
    kind stays (a barrier's or a backoff's reason counts seconds; the next heartbeat carries it). A hold that
    appears, changes kind or ends is published within `MIN_WRITE_INTERVAL_S`."""
    comps = {n: {**c, "hold": {k: v for k, v in c["hold"].items() if k != "reason"}} if c.get("hold") else c
             for n, c in (record.get("components") or {}).items()}  # fmt: skip
    return {**{k: v for k, v in record.items() if k != "wall_clock"}, "components": comps}


# ---- the view of the others -----------------------------------------------------------------------------------


@dataclass
class MemberView:
    record: dict[str, Any]
    kv: KV
    seen_at: float | None
    """Our clock when a live write of it arrived; None when only read from a snapshot or a replay."""


class Membership:
    def __init__(self, config: Config, host: MemberHost, store: Store | None = None,
                 clock: Clock | None = None) -> None:  # fmt: skip
        self.config = config
        self.host = host
        self.clock = clock or Clock()
        self.cluster = config.cluster.name
        self.name = config.node.name
        self.key = member_key(self.cluster, self.name)
        self.identity = Identity(socket.gethostname(), str(config.agent.state_dir))
        self._store = store
        self.expected = expected_members(config)
        self.static = static_facts(config, host.base_env)
        self.members: dict[str, MemberView] = {}
        self.duplicates: dict[str, dict[str, dict[str, Any]]] = {}
        """name → instance → record of agents that could not claim the name."""
        self.clocks: dict[str, ClockSamples] = {}
        self.findings: list[Finding] = []
        self.resyncs: dict[str, int] = {}
        self.conflict: dict[str, Any] | None = None
        """The record of the agent holding our name, while we cannot claim it."""
        self.view_since: float | None = None
        self.writes = 0
        self._owned_rev: int | None = None
        self._dup_key: str | None = None
        self._dirty = asyncio.Event()
        self._force = False
        """Write even a record that reads the same (a re-granted lease, a lost key, a fresh clock sample)."""
        self._published: dict[str, Any] | None = None
        """The record our key holds (as last written by us); None: none known to."""
        self._last_write = 0.0
        self._beat_due = 0.0
        self.tasks = TaskSet()
        self._lease: Any = None
        self._recheck_timer: asyncio.Task[None] | None = None
        self._recheck_due: float | None = None
        """When the armed check runs (this clock's monotonic time)."""
        self._content_changed = False
        """A member record changed beyond its clock sample since the last check."""

    @property
    def lease(self) -> Any:
        """The node's lease (its member key and its barrier arrivals live on it)."""
        return self._lease

    @property
    def store(self) -> Store:
        if self._store is None:
            from nodeagent.cluster.etcdstore import EtcdStore

            self._store = EtcdStore.from_config(self.config.cluster)
        return self._store

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin at once, whether or not etcd answers (the master's agent starts etcd itself)."""
        self._lease = self.store.lease(self.config.cluster.member_ttl_s)
        self._lease.on_regrant.append(lambda _id: self.changed())
        self._lease.on_lost.append(self._on_lost)
        self.store.on_state_change.append(lambda _state: self.changed())
        prefix = cluster_prefix(self.cluster)
        self.tasks.start(self._publish(), "membership:publish")
        for key, apply in ((prefix + "nodes/", self._on_member), (prefix + "duplicates/", self._on_duplicate)):
            self.tasks.start(follow(self.store, key, functools.partial(self._apply, key, apply=apply),
                                    clock=self.clock, retry_s=RETRY_S, what="membership"), f"membership:{key}")
        self.changed()

    async def stop(self, leave: bool = True) -> None:
        """leave: revoke the lease (the key disappears now: the node is leaving). Otherwise (detach) the key
        expires by itself unless the next agent takes it over first."""
        self._cancel_recheck()
        await self.tasks.stop()
        if leave and self._lease is not None:
            await self._lease.revoke()
        with contextlib.suppress(Exception):
            await self.store.close()

    def changed(self) -> None:
        """Write the record soon, even if it reads the same (bursts coalesce)."""
        self._force = True
        self._dirty.set()

    def status_changed(self) -> None:
        """The node's state changed: write the record soon if what the others must see changed (`steady`): a
        rank at a barrier re-states its hold every 2 s, which wrote the key every 2 s."""
        self._dirty.set()

    def update_config(self, config: Config) -> None:
        self.config = config
        self.expected = expected_members(config)
        self.static = static_facts(config, self.host.base_env)
        self._recheck()
        self.changed()

    # ---- writing our record ---------------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """Our record as the key holds it: from the node's view and the layers' reports, never /status."""
        return member_record(self.static, self.host.snapshot(), self.host.member_report(), self.identity.to_dict(),
                             self.clock.time()).to_wire()  # fmt: skip

    async def _publish(self) -> None:
        while True:
            await self.clock.wait(self._dirty, self._beat_due - self.clock.monotonic())
            wait = self._last_write + MIN_WRITE_INTERVAL_S - self.clock.monotonic()
            if wait > 0:
                await self.clock.sleep(wait)
            self._dirty.clear()
            record = self.record()
            now = self.clock.monotonic()
            if (not self._force and now < self._beat_due and self._published is not None
                    and steady(self._published) == steady(record)):  # fmt: skip
                continue
            self._last_write = now
            # jittered ±20 %: agents started together (a cluster cold start) would otherwise beat in step, and
            # every beat is a write every other agent's watch receives — N² events in one burst
            self._beat_due = now + self.config.cluster.member_heartbeat_s * random.uniform(0.8, 1.2)
            self._force = False
            try:
                if self._lease.id is None and not await self._lease.wait_granted(RETRY_S):
                    raise StoreUnavailable("no lease yet")
                self._published = record if await self._write(record) else None
            except StoreError as exc:
                logger.debug(f"membership: write deferred: {exc}")
                self._retry_soon()
                await self.clock.sleep(RETRY_S)
            except Exception:  # a bug must not end membership (the key would expire): log, retry
                logger.exception("membership: writing the member record failed")
                self._retry_soon()
                await self.clock.sleep(RETRY_S)

    def _retry_soon(self) -> None:
        self._published = None
        self.changed()

    async def _write(self, record: dict[str, Any]) -> bool:
        """Claim our key with this record; False when another agent holds it (written under `duplicates/`)."""
        import json

        value = json.dumps(record, separators=(",", ":"), default=str)
        store, lease = self.store, self._lease
        for _attempt in range(3):
            result = await store.compare_and_swap(self.key, self._owned_rev or 0, value, lease)
            if result.succeeded:
                self._owned_rev = result.revision
                self.writes += 1
                if self.conflict is not None or self._dup_key is not None:
                    await self._resolve_conflict()
                return True
            current = result.current
            if current is None:
                self._owned_rev = None  # our key expired meanwhile: claim it afresh
                continue
            holder = current.json() or {}
            if current.lease == lease.id or self.identity.same_node(holder.get("agent") or {}):
                self._owned_rev = current.mod_revision  # ours (re-put after a re-grant) or our previous life
                continue
            await self._report_conflict(holder, value)
            return False
        return False

    async def _report_conflict(self, holder: dict[str, Any], value: str) -> None:
        self._owned_rev = None
        if self.conflict is None:
            agent = holder.get("agent") or {}
            self.host.emit("cluster_duplicate_name", f"node name {self.name!r} is held by another agent "
                                  f"({agent.get('host')}, {holder.get('ip')}, state {agent.get('state_dir')}); "
                                  "not overwriting it; check node.name in both configs", None, "error")  # fmt: skip
        self.conflict = holder
        self._dup_key = f"{cluster_prefix(self.cluster)}duplicates/{self.name}/{self.identity.instance}"
        await self.store.put(self._dup_key, value, lease=self._lease)
        self._recheck()

    async def _resolve_conflict(self) -> None:
        if self._dup_key is not None:
            with contextlib.suppress(StoreError):
                await self.store.delete(self._dup_key)
            self._dup_key = None
        if self.conflict is not None:
            self.conflict = None
            self.host.emit("cluster_duplicate_name_cleared", f"node name {self.name!r} claimed")
        self._recheck()

    def _on_lost(self, key: str, current: KV | None) -> None:
        if key == self.key:
            self._owned_rev = None
            self.changed()

    # ---- watching the others --------------------------------------------------------------------------------
    def _apply(self, prefix: str, item: WatchItem, apply: Callable[[str, KV | None, bool], None]) -> None:
        if isinstance(item, Resync):
            self.resyncs[item.reason] = self.resyncs.get(item.reason, 0) + 1
            if item.reason != "initial":
                self.host.emit("cluster_view_reread", f"cluster view re-read from etcd ({item.reason})")
            for key in list(self._known(prefix)):
                apply(key, None, False)
            for key, kv in item.snapshot.items.items():
                apply(key, kv, False)
            if self.view_since is None and prefix.endswith("/nodes/"):
                self.view_since = self.clock.monotonic()
        else:
            assert isinstance(item, Change)
            apply(item.key, item.kv, item.live)
        if isinstance(item, Resync) or not prefix.endswith("/nodes/"):
            self._content_changed = True
        self._recheck_soon(RECHECK_DELAY_S if self._content_changed else CLOCK_RECHECK_S)

    def _recheck_soon(self, delay: float) -> None:
        due = self.clock.monotonic() + delay
        if self._recheck_timer is not None and self._recheck_due is not None and self._recheck_due <= due:
            return
        self._cancel_recheck()
        self._recheck_due = due
        self._recheck_timer = asyncio.ensure_future(self._recheck_after(delay))

    async def _recheck_after(self, delay: float) -> None:
        await self.clock.sleep(delay)
        self._recheck_timer = None  # (so the check does not cancel its own task)
        self._recheck()

    def _known(self, prefix: str) -> list[str]:
        if prefix.endswith("/nodes/"):
            return [view.kv.key for view in self.members.values()]
        return [f"{prefix}{name}/{inst}" for name, claims in self.duplicates.items() for inst in claims]

    def _on_member(self, key: str, kv: KV | None, live: bool) -> None:
        name = key.rsplit("/", 1)[-1]
        if kv is None:
            self._content_changed = True
            self.members.pop(name, None)
            self.clocks.pop(name, None)
            return
        record = kv.json()
        if not isinstance(record, dict):
            logger.warning(f"membership: {key} holds no member record; ignored")
            return
        old = self.members.get(name)
        if old is None or not _same_beyond_clock(old.record, record):
            self._content_changed = True
        now = self.clock.time()
        self.members[name] = MemberView(record, kv, now if live else None)
        wall = record.get("wall_clock")
        if live and name != self.name and isinstance(wall, int | float):
            self.clocks.setdefault(name, ClockSamples()).add(now, float(wall))

    def _on_duplicate(self, key: str, kv: KV | None, live: bool) -> None:
        name, _, instance = key.removeprefix(f"{cluster_prefix(self.cluster)}duplicates/").partition("/")
        if kv is None:
            self.duplicates.get(name, {}).pop(instance, None)
            if not self.duplicates.get(name):
                self.duplicates.pop(name, None)
            return
        record = kv.json()
        if isinstance(record, dict):
            self.duplicates.setdefault(name, {})[instance] = record

    # ---- consistency ----------------------------------------------------------------------------------------
    def offsets(self) -> dict[str, float]:
        now = self.clock.time()
        out = {self.name: 0.0} if self.name in self.members else {}
        for name, samples in self.clocks.items():
            estimate = samples.estimate(now)
            if estimate is not None and name in self.members:
                out[name] = estimate
        return out

    def _cancel_recheck(self) -> None:
        if self._recheck_timer is not None:
            self._recheck_timer.cancel()
            self._recheck_timer = None
        self._recheck_due = None

    def _recheck(self) -> None:
        self._cancel_recheck()
        self._content_changed = False
        grace = self.view_since is None or self.clock.monotonic() - self.view_since < self.config.cluster.member_ttl_s
        duplicates: dict[str, list[Mapping[str, Any]]] = {n: list(c.values()) for n, c in self.duplicates.items() if c}
        found = check_all(self.expected, {n: v.record for n, v in self.members.items()}, duplicates, self.offsets(),
                          self.config.cluster.clock_skew_max_s, missing_ok=grace)  # fmt: skip
        old, new = {(f.code, f.node): f for f in self.findings}, {(f.code, f.node): f for f in found}
        for key in new.keys() - old.keys():
            f = new[key]
            self.host.emit("cluster_warning", f"{f.node}: {f.message}", None, "warning", code=f.code,
                                  node=f.node)  # fmt: skip
        for key in old.keys() - new.keys():
            f = old[key]
            self.host.emit("cluster_warning_cleared", f"{f.node}: {f.code} cleared", None, "info",
                                  code=f.code, node=f.node)  # fmt: skip
        self.findings = found

    def _recheck_if_pending(self) -> None:
        """Readers of the findings never see them stale: a check that events armed runs now."""
        if self._recheck_timer is not None:
            self._recheck()

    # ---- what the API shows ---------------------------------------------------------------------------------
    def etcd_state(self) -> dict[str, Any]:
        return {**self.store.state.to_dict(), "requests": getattr(self.store, "requests", None),
                "lease": getattr(self._lease, "id", None)}  # fmt: skip

    def view(self) -> dict[str, Any]:
        """`GET /cluster`: every member (listed and not, present and not), etcd's state, the findings."""
        self._recheck_if_pending()
        now = self.clock.time()
        offsets = self.offsets()
        rows = []
        listed = {e.name: e for e in self.expected}
        for e in self.expected:
            member = self.members.get(e.name)
            if member is None:
                rows.append({"name": e.name, "ip": e.ip, "role": e.role, "group": e.group,
                             "ranks": {"start": e.ranks[0], "count": e.ranks[1]} if e.ranks else None,
                             "present": False, "listed": True})  # fmt: skip
            else:
                rows.append(self._row(member, now, offsets, listed=True))
        rows += [self._row(m, now, offsets, listed=False) for n, m in sorted(self.members.items()) if n not in listed]
        return {
            "cluster": self.cluster, "self": self.name, "etcd": self.etcd_state(), "members": rows,
            "missing": [e.name for e in self.expected if e.name not in self.members],
            "warnings": [f.to_dict() for f in self.findings],
            "conflict": self.conflict, "resyncs": dict(self.resyncs),
            "view_complete": self.view_since is not None,
        }  # fmt: skip

    def _row(self, member: MemberView, now: float, offsets: Mapping[str, float], listed: bool) -> dict[str, Any]:
        record = member.record
        if member.seen_at is not None:
            age = now - member.seen_at
        elif isinstance(record.get("wall_clock"), int | float):
            age = now - record["wall_clock"] + offsets.get(record.get("name", ""), 0.0)
        else:
            age = None
        offset = offsets.get(record.get("name", ""))
        return {**record, "present": True, "listed": listed, "age_s": round(age, 1) if age is not None else None,
                "clock_offset_s": round(offset, 3) if offset is not None else None,
                "lease": member.kv.lease, "mod_revision": member.kv.mod_revision}  # fmt: skip

    def status_section(self) -> dict[str, Any]:
        """For `/status`: etcd's state and the findings, in brief."""
        self._recheck_if_pending()
        return {"etcd": self.etcd_state(), "members": len(self.members), "expected": len(self.expected),
                "warnings": [f.to_dict() for f in self.findings]}  # fmt: skip

"""Cluster actions carried through etcd: the cluster redeploy, the cluster-wide pause, remote commands.

- **Redeploy** (the guide's "clean the residue and redeploy", for every node): one `redeploy` record at a time,
  however many nodes ask. Every agent holds and stops its vLLM, then its worker, cleans their residue and acks;
  the master archives and wipes etcd's data once the live members acked (a multi-member etcd instead deletes
  the datasystem's keys), then writes `done`; everything starts again in order through the barriers. An agent
  that was down meanwhile does its part when it comes back.
- **Remote commands**: `commands/<node>/<id>` carries an operator's start/stop/restart; the target writes the
  result back into the same key, and the asking agent returns it.

It sees the node only through its `stackport.StackPort` (views, restart, wait, clean, command) and the
coordinator only through `Coordination`, the few public things it needs of it.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.cluster import rules
from nodeagent.cluster.store import KV, Store, StoreError
from nodeagent.core.errors import AgentError, CoordinationUnavailable, UnknownComponentError
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import ComponentView, Hold, HoldKind, StackPort

if TYPE_CHECKING:
    from nodeagent.cluster.membership import Membership
    from nodeagent.config.model import Config

ACK_TIMEOUT_S = 180.0
"""How long the master waits for live members to ack before it wipes anyway (a dead one joins later)."""
STOP_TIMEOUT_S = 600.0
COMMAND_TIMEOUT_S = 60.0
DATASYSTEM_PREFIXES = ("/datasystem/",)


class Coordination(Protocol):
    """What ClusterOps needs of the coordinator that runs it (`cluster.Coordinator` is it)."""

    @property
    def config(self) -> Config: ...
    port: StackPort
    membership: Membership
    store: Store
    cluster: str
    node: str
    epoch: str | None
    done_redeploys: list[str]

    @property
    def reachable(self) -> bool: ...

    def wake(self) -> None: ...

    def spawn(self, work: Awaitable[Any]) -> None: ...

    def restart_every_group(self, reason: str) -> None: ...

    def redeploy_done(self, rid: str) -> None: ...

    async def renew_epoch(self, attempts: int = 600, every_s: float = 0.5) -> None: ...


class ClusterOps:
    def __init__(self, coordinator: Coordination, clock: Clock | None = None) -> None:
        self.co = coordinator
        self.clock = clock or Clock()
        self.port = coordinator.port
        self.store = coordinator.store
        self.cluster = coordinator.cluster
        self.node = coordinator.node
        self.record: rules.RedeployRecord | None = None
        self.record_rev = 0
        self.ack_map: dict[str, set[str]] = {}
        """redeploy id → nodes that acked (acks may arrive before the record)."""
        self.phase: str | None = None
        """This node's part: stopping | acked | wiping | None."""
        self.stop_began = 0.0
        self.handled: set[str] = set()
        """Command keys taken while they are pending in etcd: a watch re-read (compaction, new store, restarted
        watch) shows a pending key again, and it must not run twice. Forgotten once the key is answered or gone
        (the asker deletes it; it lives on the asker's lease): neither comes back pending (ids are unique)."""
        self._busy = False
        self.deferred: str | None = None
        """The redeploy this node missed and defers while paused (said once)."""

    def watches(self) -> list[tuple[str, Any]]:
        p = rules.prefix(self.cluster)
        return [(rules.redeploy_key(self.cluster), self._on_record), (p + "redeploy_acks/", self._on_ack),
                (rules.command_prefix(self.cluster, self.node), self._on_command)]

    # ---- what the watches see ---------------------------------------------------------------------------------
    def _on_record(self, key: str, kv: KV | None) -> None:
        if key != rules.redeploy_key(self.cluster):
            return  # the prefix watch also sees redeploy_acks/
        self.record = rules.RedeployRecord.from_dict(kv.json()) if kv is not None else None
        self.record_rev = kv.mod_revision if kv is not None else 0

    def _on_ack(self, key: str, kv: KV | None) -> None:
        parts = key.rsplit("/", 2)
        if len(parts) == 3:
            acked = self.ack_map.setdefault(parts[1], set())
            (acked.add if kv is not None else acked.discard)(parts[2])

    @property
    def acks(self) -> set[str]:
        return self.ack_map.get(self.record.id, set()) if self.record is not None else set()

    def _on_command(self, key: str, kv: KV | None) -> None:
        body = kv.json() if kv is not None else None
        if kv is None or not isinstance(body, dict) or body.get("state") != "pending":
            self.handled.discard(key)  # answered or gone: it never comes back pending
        elif key not in self.handled:
            self.handled.add(key)
            self.co.spawn(self._execute(key, kv, body))

    # ---- redeploy -----------------------------------------------------------------------------------------------
    @property
    def is_master(self) -> bool:
        return self.co.config.node.role == "master"

    def _local(self, kinds: tuple[str, ...] = ("etcd",), exclude: bool = True) -> list[ComponentView]:
        return [c for c in self.port.snapshot().components.values() if (c.kind in kinds) != exclude]

    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        if self.phase is None:
            return None
        if comp.kind != "etcd":
            rid = self.record.id if self.record else "?"
            return Hold(HoldKind.CLUSTER_REDEPLOY,
                        f"cluster redeploy {rid}: {self.phase} (starts again once it is done)")
        if self.phase == "wiping":
            return Hold(HoldKind.CLUSTER_REDEPLOY, "cluster redeploy: archiving and wiping etcd's data")
        return None

    def refuse_while_redeploying(self, comp: ComponentView, action: str) -> None:
        """An operator's start or restart waits for the cluster redeploy (raises AgentError)."""
        if self.phase is not None and action in ("start", "restart") and comp.kind != "etcd":
            raise AgentError(f"a cluster redeploy is running ({self.phase}): {comp.name} starts with it")

    def request_redeploy(self, reason: str, by: str, planned: bool = False) -> None:
        self._spawn(self._request(reason, by, planned))

    async def ask_redeploy(self, reason: str, by: str, planned: bool = True) -> dict[str, Any]:
        return await self._request(reason, by, planned)

    async def _request(self, reason: str, by: str, planned: bool) -> dict[str, Any]:
        key = rules.redeploy_key(self.cluster)
        current = await self.store.get(key)
        record = rules.RedeployRecord.from_dict(current.json()) if current is not None else None
        if record is not None and record.phase != "done":
            return {"id": record.id, "already_in_progress": True, "phase": record.phase}
        new = rules.RedeployRecord(uuid.uuid4().hex[:12], reason, by, self.clock.time(), epoch=self.co.epoch or "")
        body = {**new.to_dict(), "planned": planned}
        result = await self.store.compare_and_swap(key, current.mod_revision if current else 0, json.dumps(body))
        if not result.succeeded:
            return {"id": None, "already_in_progress": True, "phase": "another node asked at the same moment"}
        self.port.emit("cluster_redeploy", f"cluster redeploy {new.id} asked by {by}: {reason}", None, "warning")
        self.co.wake()
        return {"id": new.id, "already_in_progress": False, "phase": "stopping"}

    async def step(self) -> None:
        """Called by the coordinator's work loop while etcd answers; never blocks on a slow part."""
        if self._busy:
            return
        duty = rules.redeploy_duty(self.record, set(self.co.done_redeploys))
        if duty is None:
            if self.phase is not None and self.phase != "wiping":
                self._finish(self.record.id if self.record else "?")
            return
        assert self.record is not None
        if duty == "stop" and self.phase is None:
            self._spawn(self._stop_and_ack(self.record))
        elif duty == "stop" and self.phase == "acked" and self.is_master:
            live = {n for n, m in self.co.membership.members.items()} | {self.node}
            if rules.may_wipe(self.acks, live, self.clock.monotonic() - self.stop_began, ACK_TIMEOUT_S):
                self._spawn(self._wipe(self.record))
        elif duty == "start":
            if self.phase is None and self.port.snapshot().paused:
                # we were away while it ran, and the node or the cluster is paused now: the operator's pause
                # came after the redeploy's ask, and a pause means no stop the operator did not ask for now
                if self.deferred != self.record.id:
                    self.deferred = self.record.id
                    self.port.emit("cluster_redeploy_deferred", f"cluster redeploy {self.record.id}: this node "
                                   "missed it and is paused: doing its part at resume", None, "warning")  # fmt: skip
            elif self.phase is None:  # we were away while it ran: do our part now
                self._spawn(self._stop_and_ack(self.record, ack=False))
            elif self.phase == "acked":
                self._finish(self.record.id)

    def _spawn(self, coro: Any) -> None:
        async def guarded() -> None:
            self._busy = True
            try:
                await coro
            except (StoreError, CoordinationUnavailable) as exc:
                self.port.emit("cluster_redeploy_deferred", f"cluster redeploy waits for etcd: {exc}", None)
            finally:
                self._busy = False
                self.co.wake()

        self.co.spawn(guarded())

    async def _stop_and_ack(self, record: rules.RedeployRecord, ack: bool = True) -> None:
        self.phase, self.stop_began = "stopping", self.clock.monotonic()
        self.port.emit("cluster_redeploy_stop", f"cluster redeploy {record.id}: stopping vLLM, then the worker", None,
                       "warning")  # fmt: skip
        planned = bool((await self._raw(rules.redeploy_key(self.cluster))).get("planned"))
        for comp in sorted(self._local(), key=lambda c: c.kind != "vllm"):  # vLLM first, then the worker
            if self.port.component(comp.name).running:  # its restart waits at our gate until the redeploy is done
                self.port.restart([comp.name], f"cluster redeploy {record.id}", planned=planned, cause="redeploy")
            await self.port.wait(comp.name, "stopped", STOP_TIMEOUT_S)
        for comp in self._local():
            with contextlib.suppress(AgentError):
                await self.port.clean(comp.name, "redeploy", f"cluster-redeploy-{record.id}")
        self.phase = "acked"
        if ack:
            key = rules.redeploy_ack_prefix(self.cluster, record.id) + self.node
            await self.store.put(key, json.dumps({"at": self.clock.time()}), lease=self.co.membership.lease)
            self.ack_map.setdefault(record.id, set()).add(self.node)
        self.port.emit("cluster_redeploy_stopped", f"cluster redeploy {record.id}: stopped and cleaned here"
                       + ("" if ack else " (late: it is already done elsewhere)"))  # fmt: skip

    async def _raw(self, key: str) -> dict[str, Any]:
        kv = await self.store.get(key)
        data = kv.json() if kv is not None else None
        return data if isinstance(data, dict) else {}

    async def _wipe(self, record: rules.RedeployRecord) -> None:
        """The master: clear the FAQ's "key not found" residue in etcd, then declare the redeploy done."""
        local = self._local(("etcd",), exclude=False)
        members = self.co.config.cluster.etcd_members
        if local and len(members) <= 1:
            self.phase = "wiping"
            etcd = local[0].name
            self.port.restart([etcd], f"cluster redeploy {record.id}: wiping etcd's data", planned=True,
                              cause="redeploy")  # fmt: skip
            await self.port.wait(etcd, "stopped")  # our gate holds its start meanwhile
            await self.port.clean(etcd, "redeploy", f"cluster-redeploy-{record.id}", wipe_etcd=True)
            self.phase = "acked"
            self.port.wake()
            await self.port.wait(etcd, "up")
            await self.co.renew_epoch()
        else:
            for prefix in DATASYSTEM_PREFIXES:
                snap = await self.store.get_prefix(prefix)
                for key in snap.items:
                    await self.store.delete(key)
        done = rules.RedeployRecord(record.id, record.reason, record.by, record.at, "done", self.co.epoch or "")
        await self.store.put(rules.redeploy_key(self.cluster), json.dumps(done.to_dict()))
        self.record = done
        self._finish(record.id)

    def _finish(self, rid: str) -> None:
        self.co.restart_every_group(f"cluster redeploy {rid}")
        self.co.redeploy_done(rid)
        self.phase = None
        self.ack_map.pop(rid, None)
        self.port.emit("cluster_redeploy_done", f"cluster redeploy {rid} done: starting in order through the barriers")
        self.port.wake()

    # ---- remote commands ----------------------------------------------------------------------------------------
    async def remote(self, node: str, component: str, action: str, drain: bool, by: str) -> dict[str, Any]:
        """Ask `node`'s agent to run the command; its answer, or a clear error. Raises CoordinationUnavailable."""
        if not self.co.reachable:
            raise CoordinationUnavailable(f"etcd unreachable: cannot reach node {node!r} ({self.store.state.endpoint})")
        if node not in self.co.membership.members:
            known = ", ".join(sorted(self.co.membership.members)) or "none"
            raise UnknownComponentError(f"node {node!r} has no agent in the cluster now (members: {known})")
        key = rules.command_prefix(self.cluster, node) + uuid.uuid4().hex[:12]
        body = {"action": action, "component": component, "drain": drain, "by": f"{by} via {self.node}",
                "at": self.clock.time(), "state": "pending"}  # fmt: skip
        await self.store.put(key, json.dumps(body), lease=self.co.membership.lease)
        try:
            deadline = self.clock.monotonic() + COMMAND_TIMEOUT_S
            while self.clock.monotonic() < deadline:
                answer = await self._raw(key)
                if answer.get("state") == "done":
                    return dict(answer.get("result") or {})
                await self.clock.sleep(0.1)
            silent = f"node {node} did not answer within {COMMAND_TIMEOUT_S:g}s"
            return rules.CommandResult(rules.CommandOutcome.FAILED, silent).to_dict()
        finally:
            with contextlib.suppress(StoreError):
                await self.store.delete(key)

    async def _execute(self, key: str, kv: KV, body: dict[str, Any]) -> None:
        result = rules.command_error(body, list(self.port.snapshot().components))
        if result is None:
            try:
                message = self.port.command(body["component"], body["action"], drain=bool(body.get("drain", True)),
                                           by=f"remote {body.get('by', '?')}")  # fmt: skip
                result = rules.CommandResult(rules.CommandOutcome.DONE, f"{self.node}: {message}")
            except AgentError as exc:
                result = rules.CommandResult(rules.CommandOutcome.FAILED, f"{self.node}: {exc}")
        answer = {**body, "state": "done", "result": result.to_dict()}
        with contextlib.suppress(StoreError):
            await self.store.compare_and_swap(key, kv.mod_revision, json.dumps(answer), self.co.membership.lease)

    def status(self) -> dict[str, Any] | None:
        record = self.record
        if record is None:
            return None
        return {**record.to_dict(), "here": self.phase or ("done" if record.id in self.co.done_redeploys else None),
                "acks": sorted(self.acks)}  # fmt: skip

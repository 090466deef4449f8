"""The coordination store on real etcd (aetcd, asyncio gRPC): failover across endpoints, TLS, user/password,
a timeout on every call, an observable connection state, watches that survive outages, and leases kept alive.

What aetcd leaves to its user, done here:
- `Lease.refresh()` sends one keepalive: `KeptLease` runs its own task (every ttl/3), grants a new lease when the
  old one is gone (etcd answers TTL 0) and writes the keys it carried again.
- a watch ends on a lost stream or a compacted revision: `watch_prefix` re-creates it from the last revision it
  delivered, re-reads the prefix when that revision was compacted, and re-reads it when etcd went back in time
  (wiped and restarted empty), telling the consumer with a `Resync`.
- `Client.connect` only opens plaintext channels: `nodeagent.cluster.etcdclient.Client` opens TLS ones too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from aetcd import exceptions as aexc
from aetcd import rpc, utils
from loguru import logger

from nodeagent.cluster.etcdclient import UNREACHABLE, Client, EtcdSettings, error_text, to_kv
from nodeagent.cluster.etcdlease import KeptLease
from nodeagent.cluster.store import (
    KV,
    CasResult,
    Change,
    ConnectionState,
    Lease,
    Resync,
    Snapshot,
    StoreError,
    StoreUnavailable,
    WatchItem,
    encode,
)
from nodeagent.core.etcd_endpoint import Endpoint

if TYPE_CHECKING:
    from nodeagent.config.cluster import ClusterConfig

T = TypeVar("T")

WATCH_RETRY_MAX_S = 2.0

_KNOWN_AT_SEND: contextvars.ContextVar[tuple[int, tuple[int, int]]] = contextvars.ContextVar("etcd_known_at_send")
"""(store epoch, highest (revision, term) answered) when the request now running was sent: see `_observe`."""


def _cancelled_by_grpc() -> bool:
    """A CancelledError that nobody asked our task for: gRPC cancels the calls of a channel being closed."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def _cancels_requested() -> int:
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def _kept(lease: Lease | None) -> KeptLease | None:
    """The store's contract takes any `Lease`; only one this store keeps has the ledger of its keys (written again
    after a re-grant): another store's lease here is a bug."""
    if lease is not None and not isinstance(lease, KeptLease):
        raise TypeError(f"not a lease of an EtcdStore: {lease!r}")
    return lease


class EtcdStore:
    """`nodeagent.cluster.store.Store` on etcd. Create it inside the event loop; `close()` it when done."""

    def __init__(self, settings: EtcdSettings) -> None:
        if not settings.endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.settings = settings
        self.timeout = settings.timeout_s
        self.on_state_change: list[Callable[[ConnectionState], Any]] = []
        self._index = 0
        self._client: Client | None = None
        self._state = ConnectionState(None, str(settings.endpoints[0]))
        self._high = (0, 0)
        """The highest (revision, raft term) any answer carried: a lower one later means etcd was wiped."""
        self.epoch = 0
        """Bumped when the store looks reset; watches then re-read everything."""
        self._watches: set[Any] = set()
        self._leases: set[KeptLease] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self.requests = 0
        """Requests sent (unary calls and watch creations): the at-rest budget is measured on it."""

    @classmethod
    def from_config(cls, cluster: ClusterConfig) -> EtcdStore:
        return cls(EtcdSettings.from_config(cluster))

    # ---- connection state -------------------------------------------------------------------------------------
    @property
    def state(self) -> ConnectionState:
        return self._state

    @property
    def endpoint(self) -> Endpoint:
        return self.settings.endpoints[self._index]

    def _set_state(self, reachable: bool, error: str | None) -> None:
        old = self._state
        endpoint = str(self.endpoint)
        if old.reachable == reachable and old.endpoint == endpoint and (reachable or old.last_error == error):
            return
        since = old.since if old.reachable == reachable else time.time()
        self._state = ConnectionState(reachable, endpoint, error if not reachable else old.last_error, since)
        if old.reachable != reachable:
            log = logger.info if reachable else logger.warning
            log(f"etcd {'reachable at ' + endpoint if reachable else 'unreachable: ' + (error or '?')}")
        for callback in self.on_state_change:
            callback(self._state)

    def _current(self) -> Client:
        if self._client is None:
            self._client = Client(self.endpoint, self.settings)
        return self._client

    def _failed(self, client: Client, exc: BaseException) -> None:
        """Drop the failing client and move on to the next endpoint (once per failure of the current client)."""
        error = f"{client._endpoint}: {error_text(exc)}"
        if client is self._client:
            self._client = None
            self._index = (self._index + 1) % len(self.settings.endpoints)
            self._discard(client)
        self._set_state(False, error)

    def _discard(self, client: Client) -> None:
        """Close a dropped client once the calls still running on it have had their timeout: gRPC cancels the
        calls of a closed channel, which would hit callers that did nothing wrong."""

        async def later() -> None:
            try:
                await asyncio.sleep(self.timeout + 0.5)
            finally:  # close() cancels the wait: then at once
                await self._close_quietly(client)

        task = asyncio.ensure_future(later())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_quietly(client: Client) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await client.close()

    def _observe(self, header: Any) -> None:
        """Track etcd's revision and term; going back means a wiped store (same cluster id, history gone).

        An answer is compared with what was known when its request was *sent*, not with the highest answer so
        far: concurrent requests are answered in any order (a read served at revision 14 may arrive after a
        write's answer at 15), and only a request sent after etcd said 15 must be answered at 15 or later."""
        seen = (header.revision, header.raft_term)
        epoch, floor = _KNOWN_AT_SEND.get((self.epoch, self._high))
        went_back = seen[0] < floor[0] or (seen[1] < floor[1] and seen[0] <= floor[0])
        if went_back and epoch == self.epoch:  # (a request sent before a reset was noticed says nothing new)
            self.suspect_reset(f"etcd revision went back from {floor[0]} to {seen[0]}")
            self._high = seen
        else:
            self._high = (max(seen[0], self._high[0]), max(seen[1], self._high[1]))

    def suspect_reset(self, why: str) -> None:
        """Something says etcd lost its history: every watch re-reads its prefix and tells its consumer."""
        logger.warning(f"etcd: {why}: re-reading watched prefixes")
        self.epoch += 1
        for watch in list(self._watches):
            task = asyncio.ensure_future(watch.cancel())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def call(self, what: str, op: Callable[[Client], Awaitable[T]]) -> T:
        """Run `op` on the current endpoint, failing over to the next ones within one timeout overall."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        last: str = "no endpoint tried"
        reauthenticated = False
        attempt = 0
        while attempt < len(self.settings.endpoints) and loop.time() < deadline:
            client = self._current()
            self.requests += 1
            _KNOWN_AT_SEND.set((self.epoch, self._high))  # this task runs one request at a time
            cancels = _cancels_requested()
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0.05)):
                    result = await op(client)
                if _cancels_requested() > cancels:  # lost inside aetcd (its connect waits with wait_for)
                    raise asyncio.CancelledError
            except aexc.UnauthenticatedError as exc:
                # The auth token expired (etcd's simple tokens live 5 minutes): a new channel authenticates again.
                self._failed(client, exc)
                last = error_text(exc)
                if reauthenticated:
                    attempt += 1
                reauthenticated = True
                continue
            except aexc.InvalidArgumentError as exc:
                if "authentication failed" in str(exc):
                    self._failed(client, exc)
                    raise StoreUnavailable(f"etcd {client._endpoint}: {error_text(exc)}") from None
                raise StoreError(f"etcd {what}: {error_text(exc)}") from None
            except UNREACHABLE as exc:
                self._failed(client, exc)
                last = f"{client._endpoint}: {error_text(exc)}"
                attempt += 1
                continue
            except aexc.ClientError as exc:
                raise StoreError(f"etcd {what}: {error_text(exc)}") from None
            except asyncio.CancelledError:
                if not _cancelled_by_grpc():
                    raise
                self._failed(client, ConnectionError("channel closed during the call"))
                last = f"{client._endpoint}: channel closed during the call"
                attempt += 1
                continue
            self._set_state(True, None)
            return result
        raise StoreUnavailable(f"etcd {what}: {last}")

    # ---- key-value ---------------------------------------------------------------------------------------------
    async def get(self, key: str) -> KV | None:
        async def op(c: Client) -> KV | None:
            reply = await self._range(c, key.encode(), None)
            return to_kv(reply.kvs[0]) if reply.kvs else None

        return await self.call(f"get {key}", op)

    async def _range(self, c: Client, key: bytes, range_end: bytes | None, count_only: bool = False) -> Any:
        await c.connect()
        request = rpc.RangeRequest(key=key, range_end=range_end or b"", count_only=count_only)
        reply = await c.kvstub.Range(request, timeout=self.timeout, metadata=c.metadata)
        self._observe(reply.header)
        return reply

    async def get_prefix(self, prefix: str) -> Snapshot:
        async def op(c: Client) -> Snapshot:
            raw = prefix.encode()
            reply = await self._range(c, raw, utils.prefix_range_end(raw))
            return Snapshot(reply.header.revision, {kv.key: kv for kv in map(to_kv, reply.kvs)})

        return await self.call(f"get prefix {prefix}", op)

    async def _head(self, prefix: str) -> tuple[int, int]:
        """The store's current (revision, raft term), from a count-only range (cheap)."""

        async def op(c: Client) -> tuple[int, int]:
            raw = prefix.encode()
            reply = await self._range(c, raw, utils.prefix_range_end(raw), count_only=True)
            return reply.header.revision, reply.header.raft_term

        return await self.call("revision", op)

    def _lease_id(self, lease: KeptLease | None) -> int | None:
        if lease is None:
            return None
        if lease.id is None:
            raise StoreUnavailable("etcd lease not granted yet (etcd unreachable since the agent started?)")
        return lease.id

    async def _call_on_lease(self, key: str, what: str, op: Callable[[Client, int | None], Awaitable[T]],
                             lease: KeptLease | None) -> T:  # fmt: skip
        """A write of `key` on `lease`. One etcd no longer knows (it expired while a loaded agent's keepalive was
        late) is granted anew; a key new to the lease is then tried once more on it (an operator's remote command
        failed on that in CI, the new lease came 0.4 s later). A key the lease keeps is not: the re-grant writes
        its last value back create-only, and ours beside it would turn that into a key "held by someone else".
        Otherwise, or not granted within the store's timeout: unavailable, the caller retries."""
        lease_id = self._lease_id(lease)
        try:
            return await self.call(what, lambda c: op(c, lease_id))
        except StoreUnavailable:
            raise
        except StoreError as exc:
            if lease is None or "lease not found" not in str(exc):
                raise
            lease.lost("etcd no longer knows the lease")
            if key in lease.attached or not await lease.wait_granted(self.timeout):
                raise StoreUnavailable(f"{exc} (lease lost; granting a new one)") from None
        regranted = self._lease_id(lease)
        return await self.call(what, lambda c: op(c, regranted))

    async def put(self, key: str, value: bytes | str, lease: Lease | None = None) -> int:
        lease = _kept(lease)
        data = encode(value)

        async def op(c: Client, lease_id: int | None) -> int:
            reply = await c.put(key.encode(), data, lease=lease_id)
            self._observe(reply.header)
            return reply.header.revision

        revision = await self._call_on_lease(key, f"put {key}", op, lease)
        if lease is not None:
            lease.attached[key] = data
        return revision

    async def delete(self, key: str) -> bool:
        async def op(c: Client) -> bool:
            await c.connect()
            request = rpc.DeleteRangeRequest(key=key.encode())
            reply = await c.kvstub.DeleteRange(request, timeout=self.timeout, metadata=c.metadata)
            self._observe(reply.header)
            return reply.deleted > 0

        for lease in self._leases:
            lease.forget(key)
        return await self.call(f"delete {key}", op)

    async def compare_and_swap(self, key: str, mod_revision: int, value: bytes | str | None,
                               lease: Lease | None = None) -> CasResult:  # fmt: skip
        lease = _kept(lease)
        raw = key.encode()
        data = encode(value) if value is not None else None

        async def op(c: Client, lease_id: int | None) -> CasResult:
            await c.connect()
            compare = rpc.Compare(key=raw, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=mod_revision)
            if data is None:
                success = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=raw))
            else:
                success = rpc.RequestOp(request_put=rpc.PutRequest(key=raw, value=data, lease=lease_id or 0))
            failure = rpc.RequestOp(request_range=rpc.RangeRequest(key=raw))
            request = rpc.TxnRequest(compare=[compare], success=[success], failure=[failure])
            reply = await c.kvstub.Txn(request, timeout=self.timeout, metadata=c.metadata)
            self._observe(reply.header)
            if reply.succeeded:
                return CasResult(True, reply.header.revision)
            kvs = reply.responses[0].response_range.kvs
            return CasResult(False, reply.header.revision, to_kv(kvs[0]) if kvs else None)

        result = await self._call_on_lease(key, f"compare-and-swap {key}", op, lease if data is not None else None)
        if result.succeeded and lease is not None and data is not None:
            lease.attached[key] = data
        elif result.succeeded and data is None:
            for kept in self._leases:
                kept.forget(key)
        return result

    async def compact(self, revision: int) -> None:
        """Drop history before `revision` (operators and tests; the agent itself never compacts)."""

        async def op(c: Client) -> None:
            await c.compact(revision, physical=True)

        await self.call(f"compact {revision}", op)

    # ---- watches ------------------------------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str, from_revision: int | None = None) -> AsyncGenerator[WatchItem, None]:
        """See `store.Store.watch_prefix`. Use it with `contextlib.aclosing` so its watch is cancelled."""
        retry = 0.2
        epoch = self.epoch
        next_rev = from_revision
        known_at: int | None = None
        """After a re-read: the snapshot's revision (what comes later arrives as it happens, not replayed)."""
        while True:
            try:
                if next_rev is None or epoch != self.epoch:
                    reason: Literal["initial", "reset"] = "initial" if next_rev is None else "reset"
                    epoch = self.epoch
                    snapshot = await self.get_prefix(prefix)
                    yield Resync(reason, snapshot)
                    next_rev, known_at = snapshot.revision + 1, snapshot.revision
                revision, _term = await self._head(prefix)
                if epoch != self.epoch or revision < next_rev - 1:
                    if epoch == self.epoch:
                        self.suspect_reset(f"etcd is at revision {revision}, the watch was at {next_rev - 1}")
                    continue
                live_after, known_at = (revision if known_at is None else known_at), None
                async for item in self._stream(prefix, next_rev, live_after):
                    yield item
                    next_rev = item.revision + 1
                    retry = 0.2
            except aexc.RevisionCompactedError:
                snapshot = await self._read_retrying(prefix)
                yield Resync("compacted", snapshot)
                next_rev, known_at = snapshot.revision + 1, snapshot.revision
                continue
            except StoreUnavailable:
                pass
            await asyncio.sleep(retry)
            retry = min(retry * 2, WATCH_RETRY_MAX_S)

    async def _read_retrying(self, prefix: str) -> Snapshot:
        retry = 0.2
        while True:
            try:
                return await self.get_prefix(prefix)
            except StoreUnavailable:
                await asyncio.sleep(retry)
                retry = min(retry * 2, WATCH_RETRY_MAX_S)

    @contextlib.contextmanager
    def _watch_errors(self, client: Client, prefix: str) -> Iterator[None]:
        """A watch's failures as the store's: a lost endpoint (or a channel gRPC closed) is StoreUnavailable; a
        compacted revision goes out as it is (the caller re-reads)."""
        try:
            yield
        except aexc.RevisionCompactedError:
            raise
        except (*UNREACHABLE, aexc.ClientError) as exc:
            self._failed(client, exc)
            raise StoreUnavailable(f"etcd watch {prefix}: {error_text(exc)}") from None
        except asyncio.CancelledError:
            if not _cancelled_by_grpc():
                raise
            raise StoreUnavailable(f"etcd watch {prefix}: channel closed") from None

    async def _stream(self, prefix: str, start: int, live_after: int) -> AsyncIterator[Change]:
        """One aetcd watch from `start` until its stream ends; RevisionCompactedError and StoreUnavailable out."""
        client = self._current()
        self.requests += 1
        cancels = _cancels_requested()
        with self._watch_errors(client, prefix):
            async with asyncio.timeout(self.timeout):
                watch = await client.watch_prefix(prefix.encode(), start_revision=start)
        self._set_state(True, None)
        self._watches.add(watch)
        try:
            if _cancels_requested() > cancels:
                # aetcd makes the watch through Python 3.11's wait_for, which returns the result and drops a cancel
                # of ours arriving with it: the watch then waited for events forever in a task asked to end (a
                # test's close hung 3 times in 80 runs under load).
                raise asyncio.CancelledError
            with self._watch_errors(client, prefix):
                async for event in watch:
                    kv = to_kv(event.kv)
                    live = kv.mod_revision > live_after
                    if event.kind == "PUT":
                        yield Change("put", kv.key, kv.mod_revision, kv, live)
                    else:
                        yield Change("delete", kv.key, kv.mod_revision, None, live)
        finally:
            self._watches.discard(watch)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await watch.cancel()

    # ---- leases -------------------------------------------------------------------------------------------------
    def lease(self, ttl: float) -> KeptLease:
        kept = KeptLease(self, ttl)
        self._leases.add(kept)
        return kept

    async def grant(self, ttl: float) -> int:
        async def op(c: Client) -> int:
            return (await c.lease(max(2, math.ceil(ttl)))).id

        return await self.call("lease grant", op)

    async def keepalive(self, lease_id: int) -> float:
        """One keepalive; the TTL etcd granted (0: the lease is gone)."""

        async def op(c: Client) -> float:
            reply = await c.refresh_lease(lease_id)
            if reply is not None:
                self._observe(reply.header)
            return float(reply.TTL) if reply is not None else 0.0

        return await self.call("lease keepalive", op)

    async def revoke_lease(self, lease_id: int) -> None:
        async def op(c: Client) -> None:
            await c.revoke_lease(lease_id)

        await self.call("lease revoke", op)

    async def close(self) -> None:
        for kept in list(self._leases):
            kept.stop()
        self._leases.clear()
        for watch in list(self._watches):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await watch.cancel()
        if self._client is not None:
            await self._close_quietly(self._client)
            self._client = None
        for task in list(self._closing):
            task.cancel()
        for task in list(self._closing):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task

"""One contract, two stores: every test here runs against `tests/fakestore.FakeStore` and against
`nodeagent.cluster.etcdstore.EtcdStore` on real etcd, so "FakeStore behaves like etcd" is checked, not claimed.

What differs is only how a test makes things happen (`Backend`): the fake's clock jumps where etcd's time passes
for real; an outage is the fake's `set_reachable(False)` where the etcd client is cut off by a TCP proxy that it
talks through; "someone else writes" is the fake's `write_from_elsewhere` where it is a second etcd client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from fakestore import FakeStore

from nodeagent.cluster.store import KV, Change, ConnectionState, Resync, Store, StoreUnavailable, WatchItem

TTL = 2.0
"""etcd's shortest lease (the store asks at least 2 s)."""


class Backend:
    kind = "?"
    store: Store

    async def write_elsewhere(self, key: str, value: str | None) -> int:
        """Another client, one that reaches the store, writes `key` (None: deletes it); the revision."""
        raise NotImplementedError

    async def elapse(self, seconds: float) -> None:
        raise NotImplementedError

    async def cut(self) -> None:
        """The client under test loses the store (the store itself stays up)."""
        raise NotImplementedError

    async def restore(self) -> None:
        raise NotImplementedError

    async def compact(self, revision: int) -> None:
        raise NotImplementedError

    def die(self, lease: Any) -> None:
        """The agent holding `lease` died: no more keepalives."""
        raise NotImplementedError

    async def eventually(self, what: str, check: Callable[[], Awaitable[bool]], within: float) -> None:
        """`check` comes true within `within` seconds of the store's time (the fake's clock moves in steps)."""
        deadline = time.monotonic() + (within if self.kind == "etcd" else 5.0)
        step = 0.1 if self.kind == "etcd" else within / 20
        while True:
            with contextlib.suppress(StoreUnavailable):
                if await check():
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.kind}: not within {within}s: {what}")
            await self.elapse(step)

    async def close(self) -> None:
        await self.store.close()


class FakeBackend(Backend):
    kind = "fake"

    def __init__(self) -> None:
        self.fake = FakeStore()
        self.store = self.fake

    async def write_elsewhere(self, key: str, value: str | None) -> int:
        return self.fake.write_from_elsewhere(key, value)

    async def elapse(self, seconds: float) -> None:
        self.fake.advance(seconds)
        for _ in range(5):
            await asyncio.sleep(0)

    async def cut(self) -> None:
        self.fake.set_reachable(False)

    async def restore(self) -> None:
        self.fake.set_reachable(True)

    async def compact(self, revision: int) -> None:
        self.fake.compact(revision)

    def die(self, lease: Any) -> None:
        lease.abandon()


class EtcdBackend(Backend):
    kind = "etcd"

    def __init__(self, endpoint: str, client_port: int) -> None:
        self.endpoint, self.client_port = endpoint, client_port

    async def open(self) -> EtcdBackend:
        from tcpproxy import TcpProxy
        from test_etcdstore import store_for

        self.proxy = await TcpProxy(self.client_port).start()
        self.store = store_for(self.proxy.endpoint, timeout=1.0)
        self.direct = store_for(self.endpoint)
        return self

    async def write_elsewhere(self, key: str, value: str | None) -> int:
        if value is None:
            await self.direct.delete(key)
            return (await self.direct.get_prefix(key)).revision
        return await self.direct.put(key, value)

    async def elapse(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def cut(self) -> None:
        await self.proxy.cut()

    async def restore(self) -> None:
        await self.proxy.restore()

    async def compact(self, revision: int) -> None:
        await self.direct.compact(revision)  # type: ignore[attr-defined]

    def die(self, lease: Any) -> None:
        lease.stop()

    async def close(self) -> None:
        await self.store.close()
        await self.direct.close()
        await self.proxy.close()


@pytest.fixture(params=["fake", pytest.param("etcd", marks=pytest.mark.system)])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "fake":
        made: Backend = FakeBackend()
    else:
        server = request.getfixturevalue("etcd")
        made = await EtcdBackend(server.endpoint, server.client_port).open()
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
def p(unique_name: str) -> str:
    """This test's key prefix (the etcd is shared by the session)."""
    return f"/{unique_name}/"


class Watch:
    """A watch run in the background: what it delivered, in order."""

    def __init__(self, store: Store, prefix: str, from_revision: int | None = None) -> None:
        self.items: list[WatchItem] = []
        self._iter = store.watch_prefix(prefix, from_revision)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for item in self._iter:
            self.items.append(item)

    def changes(self) -> list[Change]:
        return [i for i in self.items if isinstance(i, Change)]

    def resyncs(self) -> list[Resync]:
        return [i for i in self.items if isinstance(i, Resync)]

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        with contextlib.suppress(Exception):
            await self._iter.aclose()  # type: ignore[attr-defined]


async def seen(backend: Backend, watch: Watch, count: int, what: str = "changes", within: float = 5.0) -> None:
    async def check() -> bool:
        return len(watch.changes()) >= count

    await backend.eventually(f"{count} {what}", check, within)


# ---- key-value ---------------------------------------------------------------------------------------------------


async def test_get_put_delete_and_revisions(backend: Backend, p: str) -> None:
    store = backend.store
    assert await store.get(p + "a") is None
    r1 = await store.put(p + "a", "1")
    r2 = await store.put(p + "a", "1")
    assert r2 == r1 + 1, "every write bumps the one global revision by one, an unchanged value too"
    kv = await store.get(p + "a")
    assert kv is not None and (kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (
        b"1", r1, r2, 2, 0)  # fmt: skip
    assert kv.text() == "1" and kv.json() == 1
    r3 = await store.put(p + "b", b"\xff not json")
    assert (await store.get(p + "b")).json() is None  # type: ignore[union-attr]

    assert await store.delete(p + "a") is True
    assert await store.delete(p + "a") is False
    snap = await store.get_prefix(p)
    assert snap.revision == r3 + 1, "deleting an absent key writes nothing"
    again = await store.put(p + "a", "new")
    kv = await store.get(p + "a")
    assert kv is not None and (kv.create_revision, kv.version) == (again, 1), "a deleted key starts afresh"


async def test_get_prefix_is_one_revision_in_key_order(backend: Backend, p: str) -> None:
    store = backend.store
    await store.put(p + "b", "2")
    await store.put(p + "a/x", "1")
    last = await store.put(p + "c", "3")
    await store.put(p[:-1] + "-other/z", "outside")  # shares the characters, not the prefix
    snap = await store.get_prefix(p)
    assert list(snap.items) == [p + "a/x", p + "b", p + "c"]
    assert snap.revision == last + 1 and all(isinstance(v, KV) for v in snap.items.values())
    assert (await store.get_prefix(p + "nothing/")).items == {}


async def test_compare_and_swap_on_mod_revision(backend: Backend, p: str) -> None:
    store = backend.store
    created = await store.compare_and_swap(p + "k", 0, "1")
    assert created.succeeded and created.current is None
    kv = await store.get(p + "k")
    assert kv is not None and kv.mod_revision == created.revision == kv.create_revision

    taken = await store.compare_and_swap(p + "k", 0, "x")
    assert not taken.succeeded and taken.current == kv, "0 means absent; a failure returns the key as it is"
    assert taken.revision == created.revision, "a failed swap writes nothing"
    stale = await store.compare_and_swap(p + "k", kv.mod_revision - 1, "x")
    assert not stale.succeeded and stale.current == kv

    swapped = await store.compare_and_swap(p + "k", kv.mod_revision, "2")
    assert swapped.succeeded and swapped.revision == created.revision + 1
    assert (await store.get(p + "k")).version == 2  # type: ignore[union-attr]

    deleted = await store.compare_and_swap(p + "k", swapped.revision, None)
    assert deleted.succeeded and deleted.revision == swapped.revision + 1 and await store.get(p + "k") is None
    nothing = await store.compare_and_swap(p + "k", 0, None)
    assert nothing.succeeded and nothing.revision == deleted.revision, "deleting an absent key writes nothing"
    late = await store.compare_and_swap(p + "k", swapped.revision, "3")
    assert not late.succeeded and late.current is None


# ---- leases ------------------------------------------------------------------------------------------------------


async def test_a_key_on_a_lease_lives_while_kept_and_goes_when_its_holder_dies(backend: Backend, p: str) -> None:
    store = backend.store
    lease = store.lease(TTL)
    assert await lease.wait_granted(5) and lease.id is not None
    rev = await store.put(p + "member", "alive", lease=lease)
    swapped = await store.compare_and_swap(p + "claim", 0, "mine", lease)
    assert swapped.succeeded
    kv = await store.get(p + "member")
    assert kv is not None and kv.lease == lease.id and kv.mod_revision == rev
    watch = Watch(store, p, rev)
    await seen(backend, watch, 2)
    await backend.elapse(TTL * 1.5)
    assert await store.get(p + "member") is not None, "a kept lease outlives its TTL"

    backend.die(lease)

    async def gone() -> bool:
        return await store.get(p + "member") is None and await store.get(p + "claim") is None

    await backend.eventually("the dead holder's keys expired", gone, TTL + 3)
    await seen(backend, watch, 4, "deletes")
    assert [(c.kind, c.key) for c in watch.changes()[2:]] in (
        [("delete", p + "member"), ("delete", p + "claim")], [("delete", p + "claim"), ("delete", p + "member")])
    assert all(c.kv is None for c in watch.changes()[2:])
    assert watch.changes()[2].revision == watch.changes()[3].revision, "one transaction deletes a lease's keys"
    await watch.close()


async def test_revoke_removes_the_keys_and_a_deleted_key_is_not_written_again(backend: Backend, p: str) -> None:
    store = backend.store
    lease = store.lease(TTL)
    assert await lease.wait_granted(5)
    await store.put(p + "a", "1", lease=lease)
    await store.put(p + "b", "2", lease=lease)
    await store.delete(p + "b")
    await backend.cut()
    await backend.elapse(TTL + 1.5)  # the lease expires while we cannot keep it

    async def expired() -> bool:
        return not await _exists(backend, p + "a")

    await backend.eventually("the lease expired in the store", expired, TTL + 3)
    await backend.restore()

    async def back() -> bool:
        kv = await store.get(p + "a")
        return kv is not None and kv.lease == lease.id

    await backend.eventually("the kept key written again on a new lease", back, 10)
    assert await store.get(p + "b") is None, "a key deleted by its owner is forgotten by the lease"
    await lease.revoke()
    assert await store.get(p + "a") is None and lease.id is None


async def _exists(backend: Backend, key: str) -> bool:
    if isinstance(backend, EtcdBackend):
        return await backend.direct.get(key) is not None
    return key in backend.fake.data  # type: ignore[attr-defined]


async def test_outage_longer_than_the_ttl_regrants_and_reports_a_key_taken_meanwhile(
        backend: Backend, p: str) -> None:  # fmt: skip
    store = backend.store
    lease = store.lease(TTL)
    regrants: list[int] = []
    lost: list[tuple[str, KV | None]] = []
    lease.on_regrant.append(regrants.append)
    lease.on_lost.append(lambda key, kv: lost.append((key, kv)))
    assert await lease.wait_granted(5)
    first = lease.id
    await store.put(p + "mine", "1", lease=lease)
    await store.put(p + "contested", "1", lease=lease)
    await backend.cut()

    async def expired() -> bool:
        return not await _exists(backend, p + "mine")

    await backend.eventually("the lease expired", expired, TTL + 3)
    await backend.write_elsewhere(p + "contested", "theirs")
    await backend.restore()

    async def regranted() -> bool:
        kv = await store.get(p + "mine")
        return kv is not None and lease.id not in (None, first) and kv.lease == lease.id and regrants == [lease.id]

    await backend.eventually("a new lease, our key written again, on_regrant told", regranted, 10)
    kv = await store.get(p + "contested")
    assert kv is not None and kv.value == b"theirs" and kv.lease == 0, "someone else's key is not overwritten"
    assert [k for k, _ in lost] == [p + "contested"] and lost[0][1] is not None and lost[0][1].value == b"theirs"


async def test_a_write_on_a_lease_not_granted_is_unavailable(backend: Backend, p: str) -> None:
    await backend.cut()
    lease = backend.store.lease(TTL)
    assert lease.id is None and not await lease.wait_granted(0.2)
    with pytest.raises(StoreUnavailable, match="lease not granted"):
        await backend.store.put(p + "x", "1", lease=lease)
    await backend.restore()
    assert await lease.wait_granted(5) and lease.id is not None


# ---- watches -------------------------------------------------------------------------------------------------------


async def test_watch_from_a_revision_replays_in_order_then_goes_live(backend: Backend, p: str) -> None:
    store = backend.store
    r1 = await store.put(p + "a", "1")
    await store.put("/elsewhere-" + p.strip("/"), "x")
    r3 = await store.put(p + "b", "2")
    r4 = (await store.compare_and_swap(p + "a", r1, None)).revision
    watch = Watch(store, p, r1)
    await seen(backend, watch, 3)
    got = watch.changes()
    assert [(c.kind, c.key, c.revision) for c in got] == [("put", p + "a", r1), ("put", p + "b", r3),
                                                          ("delete", p + "a", r4)]  # fmt: skip
    assert got[0].kv is not None and got[0].kv.value == b"1" and got[2].kv is None
    assert not any(c.live for c in got), "what was written before the watch began is a replay"
    assert watch.resyncs() == []
    r5 = await store.put(p + "c", "3")
    await seen(backend, watch, 4)
    live = watch.changes()[3]
    assert (live.key, live.revision, live.live) == (p + "c", r5, True)
    await watch.close()


async def test_watch_without_a_revision_starts_with_a_snapshot(backend: Backend, p: str) -> None:
    store = backend.store
    await store.put(p + "a", "1")
    await store.put(p + "b", "2")
    watch = Watch(store, p)

    async def snapped() -> bool:
        return bool(watch.resyncs())

    await backend.eventually("the initial snapshot", snapped, 5)
    (initial,) = watch.resyncs()
    assert initial.reason == "initial" and list(initial.snapshot.items) == [p + "a", p + "b"]
    r = await store.put(p + "a", "again")
    await seen(backend, watch, 1)
    (change,) = watch.changes()
    assert change.revision == r > initial.snapshot.revision and change.live
    await watch.close()


async def test_watch_from_a_compacted_revision_rereads(backend: Backend, p: str) -> None:
    store = backend.store
    first = await store.put(p + "a", "1")
    await store.put(p + "a", "2")
    last = await store.put(p + "b", "3")
    await backend.compact(last)

    at_the_compaction = Watch(store, p, last)
    await seen(backend, at_the_compaction, 1)
    assert at_the_compaction.resyncs() == [] and at_the_compaction.changes()[0].revision == last, (
        "the compaction revision itself is still there")  # fmt: skip
    await at_the_compaction.close()

    before = Watch(store, p, first)

    async def resynced() -> bool:
        return bool(before.resyncs())

    await backend.eventually("a compacted resync", resynced, 5)
    (resync,) = before.resyncs()
    assert resync.reason == "compacted" and {k: v.value for k, v in resync.snapshot.items.items()} == {
        p + "a": b"2", p + "b": b"3"}  # fmt: skip
    assert before.changes() == []
    r = await store.put(p + "c", "4")
    await seen(backend, before, 1)
    assert (before.changes()[0].revision, before.changes()[0].live) == (r, True)
    await before.close()


async def test_watch_across_an_outage_delivers_what_it_missed_as_replayed(backend: Backend, p: str) -> None:
    store = backend.store
    states: list[ConnectionState] = []
    store.on_state_change.append(states.append)
    r1 = await store.put(p + "a", "1")
    watch = Watch(store, p, r1 + 1)
    await store.put(p + "b", "live")
    await seen(backend, watch, 1)
    assert store.state.reachable is True

    await backend.cut()
    began = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await store.get(p + "a")
    assert time.monotonic() - began < 1.5, "an outage answers within the store's timeout"
    assert store.state.reachable is False and store.state.last_error
    assert states and states[-1].reachable is False
    missed = [await backend.write_elsewhere(p + "c", "while away"), await backend.write_elsewhere(p + "b", None)]

    await backend.restore()
    await seen(backend, watch, 3)
    assert [(c.kind, c.key, c.revision, c.live) for c in watch.changes()[1:]] == [
        ("put", p + "c", missed[0], False), ("delete", p + "b", missed[1], False)]  # fmt: skip
    assert watch.resyncs() == [], "nothing was lost: no re-read"
    assert await store.get(p + "c") is not None and store.state.reachable is True
    assert states[-1].reachable is True
    await store.put(p + "d", "after")
    await seen(backend, watch, 4)
    assert watch.changes()[3].live
    await watch.close()


async def test_connection_state_before_and_after_the_first_answer(backend: Backend, p: str) -> None:
    store = backend.store
    assert store.state.reachable is None, "unknown until the first request is answered"
    assert store.state.to_dict()["state"] == "unknown"
    await store.get(p + "x")
    state = store.state.to_dict()
    assert state["state"] == "reachable" and state["endpoint"].startswith("http")


# ---- a wiped store ------------------------------------------------------------------------------------------------


class WipeBackend:
    """A store to wipe: the fake's `wipe()`, or a real etcd of this test alone deleted and started empty."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request

    async def open(self, kind: str) -> tuple[Store, Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        if kind == "fake":
            fake = FakeStore()

            async def wipe_fake() -> None:
                fake.wipe()

            async def nothing() -> None:
                pass

            return fake, wipe_fake, nothing
        from test_etcdstore import store_for

        server = self.request.getfixturevalue("own_etcd")

        async def wipe_etcd() -> None:
            await asyncio.to_thread(server.wipe)
            await asyncio.to_thread(server.start)

        store = store_for(server.endpoint)
        return store, wipe_etcd, store.close


@pytest.mark.parametrize("kind", ["fake", pytest.param("etcd", marks=pytest.mark.system)])
async def test_a_wiped_store_resets_the_watch_and_regrants_the_lease(
        kind: str, request: pytest.FixtureRequest) -> None:  # fmt: skip
    store, wipe, close = await WipeBackend(request).open(kind)
    p = "/wiped/"
    try:
        for i in range(20):  # history the wiped store will not have
            await store.put(p + "noise", str(i))
        lease = store.lease(10)
        regrants: list[int] = []
        lease.on_regrant.append(regrants.append)
        assert await lease.wait_granted(5)
        await store.put(p + "me", "alive", lease=lease)
        watch = Watch(store, p)
        deadline = time.monotonic() + 10
        while not watch.resyncs() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

        await wipe()

        async def reset_seen() -> bool:
            return [r.reason for r in watch.resyncs()][-1:] == ["reset"]

        while not await reset_seen() and time.monotonic() < deadline + 20:
            await asyncio.sleep(0.05)
        assert [r.reason for r in watch.resyncs()] == ["initial", "reset"]
        reset = watch.resyncs()[-1]
        assert p + "noise" not in reset.snapshot.items, "after a reset only what the new store has"
        while time.monotonic() < deadline + 20:
            with contextlib.suppress(StoreUnavailable):
                kv = await store.get(p + "me")
                if kv is not None:
                    break
            await asyncio.sleep(0.05)
        assert kv is not None and kv.value == b"alive" and kv.lease == lease.id and regrants == [lease.id]
        await watch.close()
    finally:
        await close()

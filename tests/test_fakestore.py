"""The in-memory store keeps etcd's semantics (the ones test_etcdstore.py checks against real etcd), so the
cluster's rules can be tested on it: revisions, compare-and-swap, leases on a fake clock, watches."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from fakestore import FakeStore

from nodeagent.store import Change, Resync, StoreUnavailable, WatchItem


async def take(it: object, n: int) -> list[WatchItem]:
    out: list[WatchItem] = []
    async with asyncio.timeout(2):
        async for item in it:  # type: ignore[attr-defined]
            out.append(item)
            if len(out) == n:
                break
    return out


async def test_revisions_and_compare_and_swap() -> None:
    store = FakeStore()
    r1 = await store.put("/a", "1")
    r2 = await store.put("/a", "2")
    kv = await store.get("/a")
    assert kv is not None and (kv.create_revision, kv.mod_revision, kv.version) == (r1, r2, 2)
    assert not (await store.compare_and_swap("/a", 0, "x")).succeeded
    assert (await store.compare_and_swap("/a", r2, "3")).succeeded
    assert (await store.compare_and_swap("/b", 0, "new")).succeeded
    assert (await store.get_prefix("/")).revision == store.revision == 4


async def test_abandoned_lease_expires_and_its_keys_vanish() -> None:
    store = FakeStore()
    lease = store.lease(10)
    await store.put("/m/x", "alive", lease=lease)
    store.advance(60)
    assert await store.get("/m/x") is not None, "a kept lease lives on"
    lease.abandon()
    store.advance(9)
    assert await store.get("/m/x") is not None
    store.advance(2)
    assert await store.get("/m/x") is None and lease.id is None


async def test_outage_longer_than_the_ttl_regrants_and_rewrites() -> None:
    store = FakeStore()
    lease = store.lease(10)
    regrants: list[int] = []
    lease.on_regrant.append(regrants.append)
    await store.put("/m/x", "alive", lease=lease)
    first = lease.id
    store.set_reachable(False)
    with pytest.raises(StoreUnavailable):
        await store.get("/m/x")
    store.advance(11)
    store.set_reachable(True)
    kv = await store.get("/m/x")
    assert kv is not None and kv.lease == lease.id != first and regrants == [lease.id]


async def test_watch_from_revision_compaction_and_wipe() -> None:
    store = FakeStore()
    r1 = await store.put("/p/a", "1")
    await store.put("/q/other", "x")
    await store.put("/p/b", "2")
    it = store.watch_prefix("/p/", r1)
    got = await take(it, 2)
    assert [(c.kind, c.key) for c in got if isinstance(c, Change)] == [("put", "/p/a"), ("put", "/p/b")]
    assert not any(c.live for c in got if isinstance(c, Change)), "history before the watch is replayed"
    await it.aclose()

    store.compact(store.revision)
    it = store.watch_prefix("/p/", r1)
    (resync,) = await take(it, 1)
    assert isinstance(resync, Resync) and resync.reason == "compacted" and set(resync.snapshot.items) == {
        "/p/a", "/p/b"}  # fmt: skip
    nxt = asyncio.ensure_future(take(it, 1))
    await asyncio.sleep(0)
    await store.put("/p/c", "3")
    (live,) = await nxt
    assert isinstance(live, Change) and live.live and live.key == "/p/c"

    nxt = asyncio.ensure_future(take(it, 1))
    await asyncio.sleep(0)
    store.wipe()
    (reset,) = await nxt
    assert isinstance(reset, Resync) and reset.reason == "reset" and reset.snapshot.items == {}
    with contextlib.suppress(Exception):
        await it.aclose()

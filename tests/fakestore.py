"""An in-memory `nodeagent.cluster.store.Store` with etcd's semantics, for pure tests of the cluster's rules.
`tests/test_store_contract.py` runs the same tests on it and on real etcd: what it claims is checked there.

One global revision bumped by every write; create/mod revisions per key; compare-and-swap on mod_revision
(0 = absent); leases with a TTL on a settable clock (`advance`); watches from a revision, with compaction,
an outage (`set_reachable(False)`: calls raise StoreUnavailable, watches deliver what they missed afterwards,
marked not live) and a wipe (`wipe()`: history gone, watches get Resync("reset")).

Leases are kept alive by the fake itself while reachable (the real store's keepalive task); `abandon()` stops
that, as an agent's death does, and the lease then expires `ttl` seconds of fake time later. A kept lease that
expired during an outage is granted anew once reachable again and its keys are written again if still absent.
`write_from_elsewhere` is another client writing while this one is cut off. A lease's keys expire in one
transaction (one revision), as etcd's.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import Any

from nodeagent.cluster.store import (
    KV,
    CasResult,
    Change,
    ConnectionState,
    Resync,
    Snapshot,
    StoreUnavailable,
    WatchItem,
    encode,
)


class FakeLease:
    def __init__(self, store: FakeStore, ttl: float) -> None:
        self.store = store
        self.ttl = ttl
        self.on_regrant: list[Callable[[int], Any]] = []
        self.on_lost: list[Callable[[str, KV | None], Any]] = []
        self.attached: dict[str, bytes] = {}
        self.kept = True
        self.grants = 0
        self._id: int | None = None
        self._granted = asyncio.Event()
        store._lease_objects[self] = None
        if store.reachable:
            store._grant(self)

    @property
    def id(self) -> int | None:
        return self._id

    async def wait_granted(self, timeout: float) -> bool:
        return self._granted.is_set()

    def forget(self, key: str) -> None:
        self.attached.pop(key, None)

    def abandon(self) -> None:
        """Stop the keepalives (the agent died): the lease expires ttl seconds of fake time later."""
        self.kept = False

    async def revoke(self) -> None:
        self.kept = False
        self.attached.clear()
        if self._id is not None and self.store.reachable:
            self.store._expire(self._id)
        self._id = None
        self._granted.clear()


class FakeStore:
    def __init__(self, now: float = 1_000_000.0, endpoint: str = "http://fake:2379") -> None:
        self.now = now
        self.endpoint = endpoint
        self.on_state_change: list[Callable[[ConnectionState], Any]] = []
        self.revision = 0
        self.compacted = 0
        self.data: dict[str, KV] = {}
        self.history: list[Change] = []
        self.leases: dict[int, tuple[FakeLease, float]] = {}
        """lease id → (lease, deadline on the fake clock)"""
        self.reachable = True
        self._state = ConnectionState(None, endpoint, None, now)
        """Unknown until the first request is answered, as etcd's."""
        self._ids = itertools.count(0x1000)
        self._epoch = 0
        self._wakeups: dict[asyncio.Event, str] = {}
        """A watch's wakeup → its prefix: a write wakes only the watches it concerns (in a world of agents most
        writes concern few of them, and every needless wakeup was a task switch per watch and write)."""
        self._caught_up: dict[asyncio.Event, int] = {}
        """A waiting watch no write concerned since → the revision it has seen all of (at a compaction): as etcd's
        synced watcher, it is no gap for it."""
        self._lease_objects: dict[FakeLease, None] = {}
        """Every lease made, in the order they were made (a set re-granted them after an outage in the order of their
        addresses: lease ids, and a simulated run with them, differed from one process to the next)."""
        self.requests = 0
        self._written_while_away: set[int] = set()
        self._trimmed = 0
        """Entries dropped from the front of `history` (compaction, wipe): a watch's cursor counts them too."""
        """Revisions written while this client was cut off: a watch replays them after the outage (not live)."""

    # ---- the test's controls -----------------------------------------------------------------------------------
    def clock(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for lease_id, (lease, deadline) in list(self.leases.items()):
            if lease.kept and self.reachable:
                self.leases[lease_id] = (lease, self.now + lease.ttl)
            elif deadline <= self.now:
                self._expire(lease_id)

    def set_reachable(self, reachable: bool, error: str = "connection refused") -> None:
        self.reachable = reachable
        self._set_state(ConnectionState(reachable, self.endpoint, None if reachable else error, self.now))
        if reachable:
            for lease in self._all_leases():
                if lease.kept and lease.id not in self.leases:
                    self._grant(lease)
        self._wake()

    def compact(self, revision: int) -> None:
        for wake in self._wakeups:
            if not wake.is_set():
                self._caught_up[wake] = self.revision
        self.compacted = max(self.compacted, revision)
        kept = [c for c in self.history if c.revision >= revision]
        self._trimmed += len(self.history) - len(kept)  # (history is in revision order: the front went)
        self.history = kept

    def write_from_elsewhere(self, key: str, value: bytes | str | None) -> int:
        """Another client, one that still reaches the store, writes `key` (None: deletes it): what peers do
        while this one is cut off (`set_reachable(False)`). The store's revision afterwards."""
        if value is None:
            return self._write(key, None) if key in self.data else self.revision
        return self._write(key, encode(value))

    def wipe(self) -> None:
        """An empty store in its place: data, history and leases gone, revisions start again."""
        self.data.clear()
        self._trimmed += len(self.history)
        self.history.clear()
        self._written_while_away.clear()
        self.revision = self.compacted = 0
        self.leases.clear()
        self._epoch += 1
        if self.reachable:
            for lease in self._all_leases():
                if lease.kept:
                    self._grant(lease)
        self._wake()

    # ---- internals ----------------------------------------------------------------------------------------------
    def _all_leases(self) -> list[FakeLease]:
        return list(self._lease_objects)

    def _wake(self, key: str | None = None) -> None:
        """The watches `key` concerns (None: every watch)."""
        for event, prefix in self._wakeups.items():
            if key is None or key.startswith(prefix):
                event.set()

    def _check(self) -> None:
        self.requests += 1
        if not self.reachable:
            raise StoreUnavailable(f"etcd {self.endpoint}: {self._state.last_error}")
        if self._state.reachable is None:
            self._set_state(ConnectionState(True, self.endpoint, None, self.now))

    def _set_state(self, state: ConnectionState) -> None:
        self._state = state
        for callback in self.on_state_change:
            callback(state)

    def _write(self, key: str, value: bytes | None, lease_id: int = 0, *, same_revision: bool = False) -> int:
        """One write; `same_revision`: part of the transaction the previous write began (etcd deletes a lease's
        keys in one transaction: one revision, one event per key)."""
        if not same_revision:
            self.revision += 1
        if not self.reachable:
            self._written_while_away.add(self.revision)
        if value is None:
            self.data.pop(key, None)
            self.history.append(Change("delete", key, self.revision))
        else:
            old = self.data.get(key)
            kv = KV(key, value, old.create_revision if old else self.revision, self.revision,
                    (old.version + 1) if old else 1, lease_id)  # fmt: skip
            self.data[key] = kv
            self.history.append(Change("put", key, self.revision, kv))
        self._wake(key)
        return self.revision

    def _grant(self, lease: FakeLease) -> None:
        lease_id = next(self._ids)
        self.leases[lease_id] = (lease, self.now + lease.ttl)
        regrant = lease.grants > 0
        lease._id = lease_id
        lease.grants += 1
        lease._granted.set()
        for key, value in list(lease.attached.items()):
            if key in self.data:
                lease.forget(key)
                for cb in lease.on_lost:
                    cb(key, self.data[key])
            else:
                self._write(key, value, lease_id)
        if regrant:
            for cb in lease.on_regrant:
                cb(lease_id)

    def _expire(self, lease_id: int) -> None:
        lease, _ = self.leases.pop(lease_id)
        for i, key in enumerate(sorted(k for k, kv in self.data.items() if kv.lease == lease_id)):
            self._write(key, None, same_revision=i > 0)
        if lease.id == lease_id:
            lease._id = None
            lease._granted.clear()

    def _lease_id(self, lease: Any) -> int:
        if lease is None:
            return 0
        if lease.id is None or lease.id not in self.leases:
            raise StoreUnavailable("etcd lease not granted yet")
        return lease.id

    # ---- the Store interface -------------------------------------------------------------------------------------
    @property
    def state(self) -> ConnectionState:
        return self._state

    async def get(self, key: str) -> KV | None:
        self._check()
        return self.data.get(key)

    async def get_prefix(self, prefix: str) -> Snapshot:
        self._check()
        return Snapshot(self.revision, {k: self.data[k] for k in sorted(self.data) if k.startswith(prefix)})

    async def put(self, key: str, value: bytes | str, lease: Any = None) -> int:
        lease_id = self._lease_id(lease)
        self._check()
        revision = self._write(key, encode(value), lease_id)
        if lease is not None:
            lease.attached[key] = encode(value)
        return revision

    async def delete(self, key: str) -> bool:
        self._check()
        for lease in self._all_leases():
            lease.forget(key)
        if key not in self.data:
            return False
        self._write(key, None)
        return True

    async def compare_and_swap(self, key: str, mod_revision: int, value: bytes | str | None,
                               lease: Any = None) -> CasResult:  # fmt: skip
        lease_id = self._lease_id(lease) if value is not None else 0
        self._check()
        current = self.data.get(key)
        if (current.mod_revision if current else 0) != mod_revision:
            return CasResult(False, self.revision, current)
        if value is None:
            return CasResult(True, self._write(key, None) if current else self.revision)
        revision = self._write(key, encode(value), lease_id)
        if lease is not None:
            lease.attached[key] = encode(value)
        return CasResult(True, revision)

    async def watch_prefix(self, prefix: str, from_revision: int | None = None) -> AsyncGenerator[WatchItem, None]:
        wake = asyncio.Event()
        self._wakeups[wake] = prefix
        epoch = self._epoch
        try:
            while not self.reachable:
                wake.clear()
                await wake.wait()
            self._caught_up.pop(wake, None)  # it has seen nothing yet
            next_rev = from_revision
            if next_rev is None:
                snapshot = await self.get_prefix(prefix)
                yield Resync("initial", snapshot)
                next_rev = snapshot.revision + 1
            cursor = self._trimmed + next(
                (i for i, c in enumerate(self.history) if c.revision >= next_rev), len(self.history))
            """The next entry of `history` to look at (counting the trimmed ones): each wakeup reads only what
            is new, not the whole history."""
            live_after = self.revision
            while True:
                if self.reachable and epoch != self._epoch:
                    epoch = self._epoch
                    snapshot = await self.get_prefix(prefix)
                    yield Resync("reset", snapshot)
                    next_rev, live_after = snapshot.revision + 1, self.revision
                    cursor = self._trimmed + len(self.history)
                    continue
                if self.reachable and next_rev < self.compacted:
                    snapshot = await self.get_prefix(prefix)
                    yield Resync("compacted", snapshot)
                    next_rev, live_after = snapshot.revision + 1, self.revision
                    cursor = self._trimmed + len(self.history)
                    continue
                batch: list[Change] = []
                if self.reachable:
                    i = max(cursor - self._trimmed, 0)
                    while i < len(self.history):
                        change = self.history[i]
                        if batch and change.revision != batch[0].revision:
                            break  # one transaction's changes at a time, all of them
                        i += 1
                        if change.key.startswith(prefix):
                            batch.append(change)
                    cursor = self._trimmed + i
                    if not batch:
                        next_rev = max(next_rev, self.revision + 1)  # caught up: a compaction now is no gap
                if batch:
                    revision = batch[0].revision
                    next_rev = revision + 1
                    live = revision > live_after and revision not in self._written_while_away
                    for change in batch:
                        yield replace(change, live=live)
                    continue
                wake.clear()
                await wake.wait()
                next_rev = max(next_rev, self._caught_up.pop(wake, 0) + 1)
        finally:
            self._wakeups.pop(wake, None)
            self._caught_up.pop(wake, None)

    def lease(self, ttl: float) -> FakeLease:
        return FakeLease(self, ttl)

    async def close(self) -> None:
        self._wake()

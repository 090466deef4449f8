"""The coordination store as the cluster code sees it: a small interface with two implementations —
`nodeagent.cluster.etcdstore.EtcdStore` (real etcd through aetcd) and `tests/fakestore.FakeStore` (in memory, a
settable clock) — so the cluster's rules are tested without processes.

Standard library and msgspec (which the config already loads) only: importing it costs nothing on a node without
`cluster.nodes`.

Semantics shared by both implementations (etcd's): every write bumps one global revision; a key carries the
revision that created and last modified it; `mod_revision == 0` in a compare-and-swap means "the key is absent";
a key written on a lease disappears when the lease expires. Every call either answers within the store's timeout
or raises `StoreUnavailable` — it never blocks the caller longer and never raises anything else for an outage.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec


class StoreError(Exception):
    """The store refused a request (bad argument, permission); retrying the same request will not help."""


class StoreUnavailable(StoreError):
    """No endpoint answered in time; the connection state says which, since when and why."""


_DECODER = msgspec.json.Decoder()


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int = 1
    lease: int = 0
    """The lease the key is attached to (0 = none)."""

    def text(self) -> str:
        return self.value.decode(errors="replace")

    def json(self) -> Any:
        """The value parsed as JSON; None when it is not JSON (a foreign or corrupt value). Every agent decodes
        every member's record on each change (N² a cluster): msgspec's decoder is ~10× `json.loads`; what it
        refuses and the standard one takes (NaN, integers past 64 bits, another encoding) goes to the latter."""
        try:
            return _DECODER.decode(self.value)
        except msgspec.DecodeError:
            pass
        try:
            return json.loads(self.value)
        except ValueError:
            return None


@dataclass(frozen=True)
class Snapshot:
    """Every key under a prefix as of one revision."""

    revision: int
    items: dict[str, KV] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """One put or delete seen by a watch."""

    kind: Literal["put", "delete"]
    key: str
    revision: int
    kv: KV | None = None
    """The new key-value for a put; None for a delete."""
    live: bool = True
    """False for events replayed after a reconnect (written while we were not watching): their arrival time says
    nothing about when they were written."""


@dataclass(frozen=True)
class Resync:
    """The watch had to re-read the prefix: drop what you knew and take `snapshot` as the whole truth.

    reason: `initial` (no start revision given), `compacted` (the revision to resume from was compacted away),
    `reset` (the store went back in time: wiped or replaced by an empty one, or our lease vanished with it)."""

    reason: Literal["initial", "compacted", "reset"]
    snapshot: Snapshot


WatchItem = Change | Resync


@dataclass(frozen=True)
class CasResult:
    succeeded: bool
    revision: int
    """The store's revision after the transaction (the new mod_revision of the key when it succeeded)."""
    current: KV | None = None
    """On failure: the key as it is now (None = absent), so the caller can decide and retry."""


@dataclass(frozen=True)
class ConnectionState:
    reachable: bool | None
    """None until the first request has been answered or failed."""
    endpoint: str
    """The endpoint in use (or last tried)."""
    last_error: str | None = None
    since: float = field(default_factory=time.time)
    """Wall-clock time of the last change of `reachable`."""

    def to_dict(self) -> dict[str, Any]:
        state = "unknown" if self.reachable is None else "reachable" if self.reachable else "unreachable"
        return {"state": state, "endpoint": self.endpoint, "last_error": self.last_error,
                "since": self.since}  # fmt: skip


class Lease(Protocol):
    """A lease the store keeps alive by itself and grants again after it was lost.

    Keys written with `lease=` are remembered: after a re-grant each is written again if it is still absent;
    a key that someone else holds by then is dropped and reported to the `on_lost` callbacks."""

    ttl: float
    on_regrant: list[Callable[[int], Any]]
    """Called with the new lease id after a re-grant (keys already re-put)."""
    on_lost: list[Callable[[str, KV | None], Any]]

    @property
    def id(self) -> int | None:
        """The current lease id; None while not granted (store unreachable since the start, or lost)."""

    async def wait_granted(self, timeout: float) -> bool: ...

    def forget(self, key: str) -> None:
        """Stop re-putting `key` after a re-grant (it stays in the store until deleted or the lease ends)."""

    async def revoke(self) -> None:
        """End the lease now (its keys disappear) and stop keeping it alive; never raises."""


class Store(Protocol):
    on_state_change: list[Callable[[ConnectionState], Any]]

    @property
    def state(self) -> ConnectionState: ...

    async def get(self, key: str) -> KV | None: ...

    async def get_prefix(self, prefix: str) -> Snapshot: ...

    async def put(self, key: str, value: bytes | str, lease: Lease | None = None) -> int:
        """The revision of the write. With a lease that is not granted yet: StoreUnavailable."""

    async def delete(self, key: str) -> bool: ...

    async def compare_and_swap(self, key: str, mod_revision: int, value: bytes | str | None,
                               lease: Lease | None = None) -> CasResult:
        """Write `value` (None: delete) only if the key's mod_revision is `mod_revision` (0: only if absent)."""

    def watch_prefix(self, prefix: str, from_revision: int | None = None) -> AsyncGenerator[WatchItem, None]:
        """Changes under `prefix` from `from_revision` on (None: first a Resync("initial") snapshot), across
        outages, restarts, compactions and wipes of the store; ends only when the consumer stops iterating."""

    def lease(self, ttl: float) -> Lease: ...

    async def close(self) -> None: ...


def encode(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value

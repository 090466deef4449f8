"""A lease kept alive by its own task: aetcd's `Lease.refresh()` sends one keepalive and nothing more.

Keepalives go out every ttl/3 (at least 1 s apart). When etcd answers TTL 0 the lease is gone — it expired while
etcd was unreachable, or etcd lost it — and a new one is granted at once; the keys written on the old lease are
written again, each only if it is still absent (someone else holding it by then is reported, not overwritten).
Nothing here raises into its owner: failures are retried on the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol

from loguru import logger

from nodeagent.cluster.store import KV, CasResult, StoreError, StoreUnavailable


class LeaseStore(Protocol):
    """What a kept lease needs from the etcd store that owns it (`etcdstore.EtcdStore`)."""

    async def grant(self, ttl: float) -> int: ...

    async def keepalive(self, lease_id: int) -> float: ...

    async def revoke_lease(self, lease_id: int) -> None: ...

    async def compare_and_swap(self, key: str, mod_revision: int, value: bytes | str | None,
                               lease: Any = None) -> CasResult: ...  # fmt: skip

    def suspect_reset(self, why: str) -> None: ...


class KeptLease:
    def __init__(self, store: LeaseStore, ttl: float) -> None:
        self.store = store
        self.ttl = ttl
        self.period = max(1.0, ttl / 3)
        self.attached: dict[str, bytes] = {}
        """Keys written on this lease (and their last value): written again after a re-grant."""
        self.on_regrant: list[Callable[[int], Any]] = []
        self.on_lost: list[Callable[[str, KV | None], Any]] = []
        self.grants = 0
        self.last_error: str | None = None
        self._id: int | None = None
        self._granted_ttl = 0.0
        self._last_ok: float | None = None
        self._pending: set[str] = set()
        self._granted = asyncio.Event()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = asyncio.create_task(self._keep(), name="etcd-lease")

    @property
    def id(self) -> int | None:
        return self._id

    async def wait_granted(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._granted.wait()
        return self._granted.is_set()

    def forget(self, key: str) -> None:
        self.attached.pop(key, None)
        self._pending.discard(key)

    def lost(self, why: str) -> None:
        """The lease no longer exists in etcd: grant a new one now."""
        if self._id is not None:
            logger.warning(f"etcd lease {self._id:x} lost ({why}); granting a new one")
        self._id = None
        self._granted.clear()
        self._wake.set()

    async def _keep(self) -> None:
        while True:
            try:
                if self._id is None:
                    await self._grant()
                else:
                    await self._refresh()
                if self._pending and self._id is not None:
                    await self._reput()
                self.last_error = None
            except StoreError as exc:
                self.last_error = str(exc)
            except Exception as exc:  # the keepalive task must outlive any bug, or the key expires
                logger.exception("etcd lease keepalive failed")
                self.last_error = str(exc) or type(exc).__name__
            if self._id is None and self.last_error is None:
                continue  # lost in this round: grant again at once
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.period):
                    await self._wake.wait()

    async def _refresh(self) -> None:
        assert self._id is not None
        lease_id = self._id
        ttl = await self.store.keepalive(lease_id)
        now = time.monotonic()
        if ttl > 0:
            self._last_ok, self._granted_ttl = now, ttl
            return
        # Gone although our last keepalive promised it would live longer: etcd lost it (wiped, replaced).
        expected_alive = self._last_ok is not None and now - self._last_ok < self._granted_ttl - 0.5
        self.lost("etcd answered TTL 0")
        if expected_alive:
            self.store.suspect_reset(f"lease {lease_id:x} vanished before its TTL ran out")

    async def _grant(self) -> None:
        self._id = await self.store.grant(self.ttl)
        self._granted_ttl, self._last_ok = float(max(2, self.ttl)), time.monotonic()
        self.grants += 1
        logger.info(f"etcd lease {self._id:x} granted (TTL {self.ttl:g}s)")
        self._pending = set(self.attached)
        self._granted.set()
        if self._pending:
            await self._reput()
        if self.grants > 1:  # the first grant is no re-grant
            for callback in self.on_regrant:
                callback(self._id)

    async def _reput(self) -> None:
        for key in sorted(self._pending):
            value = self.attached.get(key)
            if value is None:
                self._pending.discard(key)
                continue
            try:
                result = await self.store.compare_and_swap(key, 0, value, lease=self)
            except StoreUnavailable:
                return  # the next round tries again
            self._pending.discard(key)
            if not result.succeeded:
                self.forget(key)
                logger.warning(f"etcd: {key} is held by someone else now; not writing it again")
                for callback in self.on_lost:
                    callback(key, result.current)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def revoke(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        lease_id, self._id = self._id, None
        self._granted.clear()
        self.attached.clear()
        if lease_id is not None:
            with contextlib.suppress(StoreError):
                await self.store.revoke_lease(lease_id)

"""What only the etcd store has, against real etcd: a timeout on an unreachable endpoint, failover, TLS and auth,
the watch across an etcd restart and a partition longer than the lease with a compaction meanwhile, calls that
fail over concurrently, and no false alarm from answers that arrive out of order. What both stores share (key-value
calls, compare-and-swap, leases, watches, compaction, a wiped store) is `test_store_contract.py`."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from etcdserver import EtcdServer
from tcpproxy import TcpProxy

from nodeagent.cluster.etcdclient import EtcdSettings
from nodeagent.cluster.etcdstore import EtcdStore
from nodeagent.cluster.store import Resync, StoreUnavailable, WatchItem
from nodeagent.core.etcd_endpoint import parse_endpoint

pytestmark = pytest.mark.system


def store_for(*endpoints: str, timeout: float = 2.0, **tls_auth: Any) -> EtcdStore:
    tls = bool(tls_auth.get("ca_file"))
    return EtcdStore(EtcdSettings(tuple(parse_endpoint(e, tls) for e in endpoints), timeout, **tls_auth))


async def wait_until(what: str, check: Any, timeout: float = 20.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        with contextlib.suppress(StoreUnavailable):
            last = check()
            if asyncio.iscoroutine(last):
                last = await last
            if last:
                return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Collector:
    """Runs a watch in the background and keeps what it delivered, plus its own mirror of the prefix."""

    def __init__(self, store: EtcdStore, prefix: str, from_revision: int | None = None) -> None:
        self.items: list[WatchItem] = []
        self.view: dict[str, bytes] = {}
        self._iter: AsyncIterator[WatchItem] = store.watch_prefix(prefix, from_revision)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for item in self._iter:
            self.items.append(item)
            if isinstance(item, Resync):
                self.view = {k: kv.value for k, kv in item.snapshot.items.items()}
            elif item.kind == "put" and item.kv is not None:
                self.view[item.key] = item.kv.value
            else:
                self.view.pop(item.key, None)

    def resyncs(self) -> list[str]:
        return [i.reason for i in self.items if isinstance(i, Resync)]

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self._iter.aclose()  # type: ignore[attr-defined]


async def test_unreachable_etcd_answers_within_the_timeout_and_says_so() -> None:
    store = store_for(f"127.0.0.1:{free_port()}", timeout=1.0)
    try:
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"Connection refused|failed to connect"):
            await store.get("/x")
        assert time.monotonic() - began < 1.5
        state = store.state.to_dict()
        assert state["state"] == "unreachable" and "127.0.0.1" in state["last_error"]
        lease = store.lease(10)
        with pytest.raises(StoreUnavailable, match="lease not granted"):
            await store.put("/x", "1", lease=lease)
        assert not await lease.wait_granted(0.5)
    finally:
        await store.close()


async def test_fails_over_to_the_next_endpoint(etcd: EtcdServer, unique_name: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    store = store_for(dead, etcd.endpoint)
    try:
        await store.put(f"/{unique_name}/k", "v")
        assert store.state.reachable and store.state.endpoint == f"http://{etcd.endpoint}"
    finally:
        await store.close()


async def test_a_write_on_a_lease_etcd_forgot_goes_on_the_new_lease(etcd: EtcdServer, unique_name: str) -> None:
    """The lease expired in etcd while the agent still held its id (its keepalive late under load: CI lost a
    3 s lease, and an operator's remote command failed with it). A key new to the lease is written on the lease
    granted anew; a key the lease keeps is left to the re-grant, which writes its last value back."""
    store, other = store_for(etcd.endpoint), store_for(etcd.endpoint)
    p = f"/{unique_name}/"
    try:
        lease = store.lease(30)
        assert await lease.wait_granted(5) and lease.id is not None
        await store.put(p + "member", "v1", lease=lease)
        first = lease.id
        await other.revoke_lease(first)
        await store.put(p + "command", "restart", lease=lease)
        kv = await store.get(p + "command")
        assert kv is not None and lease.id not in (None, first) and kv.lease == lease.id, (kv, first, lease.id)
        member = await wait_until("the kept key written back", lambda: store.get(p + "member"), 10)
        assert member.value == b"v1" and member.lease == lease.id

        second = lease.id
        await other.revoke_lease(second)
        with pytest.raises(StoreUnavailable, match="lease lost"):
            await store.put(p + "member", "v2", lease=lease)
        member = await wait_until("the kept key written back again", lambda: store.get(p + "member"), 10)
        assert member.value == b"v1" and member.lease not in (first, second)
        await store.put(p + "member", "v2", lease=lease)
        assert (await store.get(p + "member")).value == b"v2"  # type: ignore[union-attr]
    finally:
        await store.close()
        await other.close()


async def test_watch_resumes_after_an_etcd_restart_without_rereading(own_etcd: EtcdServer, unique_name: str) -> None:
    store = store_for(own_etcd.endpoint)
    p = f"/{unique_name}/"
    watch = Collector(store, p)
    try:
        lease = store.lease(10)
        assert await lease.wait_granted(5)
        await store.put(p + "member", "1", lease=lease)
        await wait_until("the put seen", lambda: watch.view.get(p + "member") == b"1")
        lease_id = lease.id

        await asyncio.to_thread(own_etcd.kill)
        await wait_until("unreachable", lambda: store.state.reachable is False)
        await asyncio.to_thread(own_etcd.start)
        writer = store_for(own_etcd.endpoint)
        await writer.put(p + "after", "2")
        await wait_until("the put after the restart seen", lambda: watch.view.get(p + "after") == b"2")
        assert watch.resyncs() == ["initial"], "a restart loses nothing: the watch resumes, no re-read"
        assert store.state.reachable
        assert lease.id == lease_id and (await store.get(p + "member")) is not None
        await writer.close()
    finally:
        await watch.close()
        await store.close()


async def test_partition_longer_than_the_lease_then_compaction(own_etcd: EtcdServer, unique_name: str) -> None:
    """Cut off from a live etcd: the lease expires there and history is compacted meanwhile. Back, the watch
    re-reads (compacted) and the lease is granted anew with its key written again."""
    proxy = await TcpProxy(own_etcd.client_port).start()
    store = store_for(proxy.endpoint, timeout=1.0)
    direct = store_for(own_etcd.endpoint)
    p = f"/{unique_name}/"
    watch = Collector(store, p)
    try:
        lease = store.lease(2)
        assert await lease.wait_granted(5)
        await store.put(p + "me", "alive", lease=lease)
        await wait_until("own key seen", lambda: p + "me" in watch.view)
        old_lease = lease.id

        await proxy.cut()
        await wait_until("unreachable", lambda: store.state.reachable is False)
        await wait_until("the lease expired in etcd", lambda: _absent(direct, p + "me"), timeout=10)
        rev = await direct.put(p + "other", "x")
        await direct.put(p + "other", "y")
        await direct.compact(rev + 1)

        await proxy.restore()
        await wait_until("the watch re-read after the compaction", lambda: "compacted" in watch.resyncs())
        await wait_until("the view is the truth", lambda: watch.view.get(p + "other") == b"y")
        await wait_until("a new lease", lambda: lease.id not in (None, old_lease))
        await wait_until("own key written again", lambda: watch.view.get(p + "me") == b"alive")
        kv = await direct.get(p + "me")
        assert kv is not None and kv.lease == lease.id
    finally:
        await watch.close()
        await store.close()
        await direct.close()
        await proxy.close()


async def test_a_cancel_lost_while_the_watch_is_made_still_ends_the_watch(
        etcd: EtcdServer, unique_name: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """aetcd makes a watch through Python 3.11's `asyncio.wait_for`, which returns its result and drops a cancel
    that arrives with it. The partition test's close then hung (3 in 80 runs under load): the watch waited for
    events in a task asked to end. Here the cancel is dropped on purpose, as that race does."""
    store = store_for(etcd.endpoint)
    client = store._current()
    make_watch = client.watch_prefix
    making = asyncio.Event()

    async def losing_a_cancel(*args: Any, **kwargs: Any) -> Any:
        making.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        return await make_watch(*args, **kwargs)

    monkeypatch.setattr(client, "watch_prefix", losing_a_cancel)
    watch = Collector(store, f"/{unique_name}/")
    try:
        await asyncio.wait_for(making.wait(), 10)
        watch.task.cancel()
        done, _ = await asyncio.wait({watch.task}, timeout=10)
        assert done and watch.task.cancelled(), "the watch ended as asked"
        assert not store._watches, "and the watch it had just made is cancelled"
    finally:
        await watch.close()
        await store.close()


async def _absent(store: EtcdStore, key: str) -> bool:
    return await store.get(key) is None


async def test_fresh_etcd_with_busy_clients_raises_no_false_alarm(own_etcd: EtcdServer) -> None:
    """Issue 17: on a brand-new etcd, agents logged "etcd revision went back" and re-read everything. Concurrent
    requests of one client are answered in any order; only an answer older than what was known when its request
    was sent means etcd went back. (test_store_contract's wipe test still sees a real wipe.)"""
    stores = [store_for(own_etcd.endpoint) for _ in range(3)]
    watches: list[Collector] = []

    async def agent(i: int, store: EtcdStore) -> None:
        lease = store.lease(10)
        assert await lease.wait_granted(5)
        watches.extend(Collector(store, f"/c/{p}/") for p in ("nodes", "gangs", "barriers"))

        async def writer(k: int) -> None:
            rev = 0
            for n in range(30):
                result = await store.compare_and_swap(f"/c/nodes/{i}-{k}", rev, str(n), lease)
                rev = result.revision if result.succeeded else (result.current.mod_revision if result.current else 0)
                await store.get_prefix("/c/gangs/")

        await asyncio.gather(*(writer(k) for k in range(4)))

    try:
        await asyncio.gather(*(agent(i, s) for i, s in enumerate(stores)))
        await wait_until(
            "every node watch saw every last write",
            lambda: all(
                w.view.get(f"/c/nodes/{i}-{k}") == b"29" for w in watches[::3] for i in range(3) for k in range(4)
            ),
        )
        assert [s.epoch for s in stores] == [0, 0, 0], "no reset suspected on a healthy etcd"
        assert all(w.resyncs() == ["initial"] for w in watches)
    finally:
        for watch in watches:
            await watch.close()
        for store in stores:
            await store.close()


# ---- TLS and user/password ---------------------------------------------------------------------------------------


def make_certs(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=test-ca")  # fmt: skip
    ext = folder / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", str(ext))  # fmt: skip
    return {n: folder / f for n, f in (("ca", "ca.pem"), ("cert", "server.pem"), ("key", "server.key"),
                                       ("client_cert", "client.pem"), ("client_key", "client.key"))}  # fmt: skip


async def test_tls_with_client_certificate_and_password(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "pki")
    server = EtcdServer(tmp_path / "etcd", tls=certs).start()
    try:
        server.ctl("user", "add", "root:rootpw")
        server.ctl("user", "add", "agent:s3cret")
        server.ctl("role", "add", "agent")
        server.ctl("role", "grant-permission", "agent", "--prefix=true", "readwrite", "/dsv4-agent/")
        server.ctl("user", "grant-role", "agent", "agent")
        server.ctl("auth", "enable")
        pw = tmp_path / "pw"
        pw.write_text("s3cret\n")
        tls = {"ca_file": certs["ca"], "cert_file": certs["client_cert"], "key_file": certs["client_key"]}
        store = store_for(server.endpoint, **tls, username="agent", password_file=pw)
        try:
            await store.put("/dsv4-agent/tls/k", "v")
            assert (await store.get("/dsv4-agent/tls/k")).value == b"v"  # type: ignore[union-attr]
            assert store.state.endpoint == f"https://{server.endpoint}"
        finally:
            await store.close()
        pw.write_text("wrong\n")
        bad = store_for(server.endpoint, **tls, username="agent", password_file=pw)
        try:
            with pytest.raises(StoreUnavailable, match="authentication failed"):
                await bad.get("/dsv4-agent/tls/k")
            assert "authentication failed" in (bad.state.last_error or "")
        finally:
            await bad.close()
        plain = store_for(server.endpoint, timeout=1.0)  # no TLS against a TLS etcd: unreachable, not a hang
        try:
            with pytest.raises(StoreUnavailable):
                await plain.get("/dsv4-agent/tls/k")
        finally:
            await plain.close()
    finally:
        server.kill()


async def test_concurrent_calls_through_an_outage_all_recover(own_etcd: EtcdServer, unique_name: str) -> None:
    """Calls that fail over drop their client; calls still running on it must not be cancelled with it (gRPC
    cancels the calls of a closed channel) — or a lease's keepalive task, say, would die silently."""
    p = f"/{unique_name}/"
    await asyncio.to_thread(own_etcd.stop)
    store = store_for(own_etcd.endpoint, timeout=1.0)
    watches = [Collector(store, p) for _ in range(3)]
    leases = [store.lease(3) for _ in range(3)]
    stop = asyncio.Event()

    async def hammer() -> None:
        while not stop.is_set():
            with contextlib.suppress(StoreUnavailable):
                await store.get(p + "x")
            await asyncio.sleep(0.01)

    workers = [asyncio.create_task(hammer()) for _ in range(4)]
    try:
        await wait_until("every caller, the leases' keepalives too, failed meanwhile", lambda: store.state.reachable is
                         False and store.requests >= 40 and all(lease.last_error for lease in leases), timeout=10)
        await asyncio.to_thread(own_etcd.start)
        for lease in leases:
            assert await lease.wait_granted(10), "every lease is granted once etcd answers"
        await store.put(p + "after", "1", lease=leases[0])
        for watch in watches:
            await wait_until("every watch alive", lambda w=watch: w.view.get(p + "after") == b"1")
            assert not watch.task.done()
        assert all(not w.done() for w in workers)
    finally:
        stop.set()
        for task in workers:
            task.cancel()
        for watch in watches:
            await watch.close()
        await store.close()


async def test_a_lease_of_another_store_is_refused_before_any_call() -> None:
    """`Store.put`/`compare_and_swap` take any `Lease` (the contract mypy checks); only an `EtcdStore`'s own
    `KeptLease` has the ledger of its keys, so another store's is a bug, said at once (no etcd needed)."""
    from fakestore import FakeStore

    store = store_for(f"127.0.0.1:{free_port()}", timeout=0.5)
    foreign = FakeStore().lease(3.0)
    try:
        with pytest.raises(TypeError, match="not a lease of an EtcdStore"):
            await store.put("/k", "v", lease=foreign)
        with pytest.raises(TypeError, match="not a lease of an EtcdStore"):
            await store.compare_and_swap("/k", 0, "v", lease=foreign)
    finally:
        await store.close()

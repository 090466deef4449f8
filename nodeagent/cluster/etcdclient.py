"""The etcd connection as aetcd leaves it to us: settings from the config, a client that opens TLS channels too
(aetcd's `Client.connect` only opens plaintext ones) and authenticates per channel, and how errors read."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aetcd
import grpc
from aetcd import exceptions as aexc
from aetcd import rpc, watcher

from nodeagent.cluster.store import KV
from nodeagent.core.etcd_endpoint import Endpoint, parse_endpoint

if TYPE_CHECKING:
    from nodeagent.config.cluster import ClusterConfig

UNREACHABLE = (aexc.ConnectionFailedError, aexc.ConnectionTimeoutError, aexc.WatchTimeoutError,
               aexc.InternalError, TimeoutError, grpc.aio.AioRpcError, OSError)  # fmt: skip
"""Errors that mean "this endpoint does not answer" (try the next one), not "the request is wrong"."""

CHANNEL_OPTIONS = {
    # gRPC waits up to 120 s between reconnect attempts by default: after an etcd restart we want it back in ~1 s.
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    # A watch stream over a dead network path must fail rather than hang (etcd accepts pings every >= 5 s).
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}
@dataclass(frozen=True)
class EtcdSettings:
    endpoints: tuple[Endpoint, ...]
    timeout_s: float = 2.0
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    """TLS host name to check the server certificate against (default: the endpoint's host)."""
    username: str | None = None
    password_file: Path | None = None

    @classmethod
    def from_config(cls, cluster: ClusterConfig) -> EtcdSettings:
        tls, auth = cluster.etcd_tls, cluster.etcd_auth
        return cls(
            endpoints=tuple(parse_endpoint(e, tls is not None) for e in cluster.etcd_endpoints),
            timeout_s=cluster.etcd_timeout_s,
            ca_file=tls.ca_file if tls else None, cert_file=tls.cert_file if tls else None,
            key_file=tls.key_file if tls else None, server_name=tls.server_name if tls else None,
            username=auth.username if auth else None, password_file=auth.password_file if auth else None,
        )  # fmt: skip

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return path.read_bytes() if path is not None else None

        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))

    def password(self) -> str | None:
        if self.password_file is None:
            return None
        return self.password_file.read_text(encoding="utf-8").rstrip("\r\n")


class Client(aetcd.Client):
    """aetcd's client on a plaintext or TLS channel; authenticates when given a user (the token is per channel)."""

    def __init__(self, endpoint: Endpoint, settings: EtcdSettings) -> None:
        password = settings.password() if settings.username else None
        super().__init__(endpoint.host, endpoint.port, username=settings.username, password=password,
                         timeout=settings.timeout_s, options=CHANNEL_OPTIONS)  # fmt: skip
        self._endpoint = endpoint
        self._settings = settings
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        async with self._lock:
            if self._connected.is_set():
                return
            host = f"[{self._host}]" if ":" in self._host else self._host
            target, options = f"{host}:{self._port}", list(self._options.items())
            if self._endpoint.tls:
                if self._settings.server_name:
                    options.append(("grpc.ssl_target_name_override", self._settings.server_name))
                channel = grpc.aio.secure_channel(target, self._settings.credentials(), options)
            else:
                channel = grpc.aio.insecure_channel(target, options)
            metadata = None
            try:
                if self._username is not None:
                    request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                    reply = await rpc.AuthStub(channel).Authenticate(request, timeout=self._timeout)
                    metadata = (("token", reply.token),)
            except BaseException as exc:
                await channel.close()
                if isinstance(exc, grpc.aio.AioRpcError):
                    aexc._handle_exception(exc)
                raise
            self.channel, self.metadata = channel, metadata
            self.kvstub, self.leasestub = rpc.KVStub(channel), rpc.LeaseStub(channel)
            self.clusterstub, self.maintenancestub = rpc.ClusterStub(channel), rpc.MaintenanceStub(channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(channel), timeout=self._timeout, metadata=metadata)
            self._connected.set()


def to_kv(raw: Any) -> KV:
    return KV(raw.key.decode(errors="surrogateescape"), bytes(raw.value), raw.create_revision, raw.mod_revision,
              raw.version, raw.lease)  # fmt: skip


def error_text(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    if isinstance(exc, grpc.aio.AioRpcError):
        text = exc.details() or str(exc.code())
    return text.splitlines()[0][:300]

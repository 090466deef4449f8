"""Where to connect for a bind address: a wildcard bind (`0.0.0.0`, `::`, empty or unset) listens on every
address, so a client on this node dials loopback — or, where peers must reach it, the node's IP.

Standard library only (the CLI uses it too). Also: an etcd endpoint parsed (`parse_endpoint`: the config checks
it, the store dials it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import urllib.request

WILDCARDS = ("", "0.0.0.0", "::")
LOOPBACK = "127.0.0.1"


def is_wildcard(host: str | None) -> bool:
    return host is None or host.strip("[]") in WILDCARDS


def connect_host(bind: str | None, fallback: str = LOOPBACK) -> str:
    """The address to dial for a service bound to `bind`: `fallback` (loopback) for a wildcard, else `bind`."""
    return fallback if is_wildcard(bind) else str(bind)


def url_host(host: str) -> str:
    """A host as it goes into a URL or HOST:PORT: an IPv6 literal in brackets."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


def direct_opener() -> urllib.request.OpenerDirector:
    """urllib without the environment's proxies: nodes often export http_proxy for downloads without their own
    addresses in no_proxy, and the agent reaches its vLLMs, proxy and peers directly (aiohttp ignores the
    variables unless told). Imported lazily: urllib.request costs the CLI ~35 ms."""
    import urllib.request

    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    tls: bool = False

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"


def parse_endpoint(text: str, tls: bool = False) -> Endpoint:
    """`HOST:PORT`, `http://HOST:PORT` or `https://HOST:PORT` (IPv6 in brackets); ValueError otherwise."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = ("https" if tls else "http"), text
    if scheme not in ("http", "https"):
        raise ValueError(f"etcd endpoint {text!r}: scheme must be http or https")
    host, sep, port = rest.rstrip("/").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {text!r} is not HOST:PORT")
    return Endpoint(host, int(port), scheme == "https" or tls)

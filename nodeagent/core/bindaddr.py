"""Where to connect for a bind address: a wildcard bind (`0.0.0.0`, `::`, empty or unset) listens on every
address, so a client on this node dials loopback — or, where peers must reach it, the node's IP.

Standard library only (the CLI uses it too)."""

from __future__ import annotations

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

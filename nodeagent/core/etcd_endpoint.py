"""An etcd endpoint as the config names it and the store dials it: `HOST:PORT`, `http://HOST:PORT`, `https://...`.

Here, below both, so that the config checks it without importing the cluster layer."""

from __future__ import annotations

from dataclasses import dataclass


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

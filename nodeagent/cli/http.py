"""A minimal HTTP/1.1 client for the CLI (one request per connection), over TCP or a unix socket.

`http.client` costs ~30 ms of imports (it pulls in the `email` package), half of a status command's budget; the
agent's API answers small JSON with a Content-Length, so one socket, one request and a read to EOF do.
"""

from __future__ import annotations

import socket

from nodeagent.core.bindaddr import url_host


class BadResponse(Exception):
    """The peer answered something that is not an HTTP response."""


def request(host: str, port: int, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = 10.0,
            unix: str | None = None) -> tuple[int, bytes]:  # fmt: skip
    """(status, body); OSError when it cannot connect or times out, BadResponse on a malformed answer."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {url_host(host)}:{port}",
             "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]  # fmt: skip
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
    if unix is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(unix)
        except OSError:
            sock.close()
            raise
    else:
        sock = socket.create_connection((host, port), timeout=timeout)
    with sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return parse_response(b"".join(chunks))


def parse_response(raw: bytes) -> tuple[int, bytes]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if not sep or len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise BadResponse(f"not an HTTP response: {raw[:60]!r}")
    fields = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    if "chunked" in fields.get("transfer-encoding", "").lower():
        body = _dechunk(body)
    elif fields.get("content-length", "").isdigit():
        body = body[: int(fields["content-length"])]
    return int(parts[1]), body


def _dechunk(data: bytes) -> bytes:
    out: list[bytes] = []
    pos = 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            raise BadResponse("truncated chunked body")
        try:
            size = int(data[pos:end].split(b";")[0], 16)
        except ValueError:
            raise BadResponse("bad chunk size") from None
        if size == 0:
            return b"".join(out)
        out.append(data[end + 2 : end + 2 + size])
        pos = end + 4 + size

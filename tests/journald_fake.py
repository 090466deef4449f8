"""A fake journald for tests: a bound datagram socket and a decoder of the native protocol."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def fake_journald_socket() -> Iterator[tuple[socket.socket, str]]:
    """journald's native socket, in a short folder (sun_path is at most 108 bytes)."""
    folder = tempfile.mkdtemp(prefix="jrn-")
    path = os.path.join(folder, "socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    try:
        yield sock, path
    finally:
        sock.close()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


def parse_entry(data: bytes) -> dict[str, bytes]:
    """Decode the native protocol (both the ``NAME=value`` and the length-prefixed binary form)."""
    fields: dict[str, bytes] = {}
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            name, value = line.split(b"=", 1)
            fields[name.decode()] = value
            i = nl + 1
        else:
            (size,) = struct.unpack("<Q", data[nl + 1 : nl + 9])
            fields[line.decode()] = data[nl + 9 : nl + 9 + size]
            assert data[nl + 9 + size : nl + 10 + size] == b"\n"
            i = nl + 10 + size
    return fields

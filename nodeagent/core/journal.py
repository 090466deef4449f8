"""A pure-Python journald client: structured entries and log streams for children, without libsystemd.

Two protocols (systemd's "Native Journal Protocol" and journald's stdout-stream protocol):

- ``send()`` writes one datagram to ``/run/systemd/journal/socket``: ``NAME=value\\n`` per field, or, for
  a value containing a newline, ``NAME\\n<u64 little-endian length><value>\\n``. A datagram too big for the
  socket (EMSGSIZE/ENOBUFS/EAGAIN) is written into a sealed memfd whose descriptor is passed by SCM_RIGHTS in
  an otherwise empty datagram, as journald requires. Independently, every value is capped at MAX_VALUE_BYTES
  and the cut is marked, so one runaway message cannot make an entry journald refuses.
- ``open_stream()`` connects to ``/run/systemd/journal/stdout`` and writes the stream header (identifier, unit
  id, priority, level_prefix, forward_to_syslog, forward_to_kmsg, forward_to_console — one line each), then
  returns the descriptor. Handed to a child as stdout/stderr, every line the child prints becomes a journal
  entry with ``SYSLOG_IDENTIFIER=<identifier>`` (what ``systemd-cat -t`` does). The child owns a socket to
  journald, not a pipe to the agent, so an agent restart cannot SIGPIPE it (DESIGN §7).

Nothing here logs through loguru: the loguru journal sink calls ``send()``, and a failure must not recurse.
Functions report failure by return value (``send``) or OSError (``open_stream``).
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import re
import socket
import stat
import struct
import sys
import threading
from collections.abc import Mapping

__all__ = [
    "JOURNAL_SOCKET",
    "JOURNAL_STDOUT",
    "MAX_VALUE_BYTES",
    "JournalSender",
    "encode_entry",
    "journald_available",
    "open_stream",
    "running_under_systemd",
    "send",
]

JOURNAL_SOCKET = "/run/systemd/journal/socket"
JOURNAL_STDOUT = "/run/systemd/journal/stdout"
# Per-value cap. Larger than any sane log line or traceback; keeps an entry far below journald's entry limit.
MAX_VALUE_BYTES = 1 << 20
_SNDBUF = 8 << 20  # what libsystemd asks for, so most entries fit in one datagram
_SO_SNDBUFFORCE = 32  # Linux constant; Python's socket module does not export it
_FIELD_NAME_MAX = 64
_BAD_NAME_CHARS = re.compile(r"[^A-Z0-9_]")


def _field_name(name: str) -> str | None:
    """Map a Python keyword to a valid journal field name (A-Z, 0-9, _; not leading _ or digit; ≤ 64)."""
    n = _BAD_NAME_CHARS.sub("_", name.upper()).lstrip("_0123456789")[:_FIELD_NAME_MAX]
    return n or None


def _value_bytes(value: object) -> bytes:
    """Encode a value and cap it at MAX_VALUE_BYTES, saying how much was cut."""
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogateescape")
    if len(raw) <= MAX_VALUE_BYTES:
        return raw
    cut = raw[:MAX_VALUE_BYTES].decode("utf-8", "ignore").encode()  # never split a UTF-8 sequence
    return cut + f" …[truncated {len(raw) - len(cut)} bytes]".encode()


def encode_entry(fields: Mapping[str, object]) -> bytes:
    """Serialize fields in the native protocol (names already valid; None values skipped)."""
    out = bytearray()
    for name, value in fields.items():
        if value is None:
            continue
        data = _value_bytes(value)
        key = name.encode()
        if b"\n" in data:
            out += key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key + b"=" + data + b"\n"
    return bytes(out)


def _grow_sndbuf(sock: socket.socket, size: int) -> None:
    """Best effort, like libsystemd: SO_SNDBUF is capped by wmem_max, SO_SNDBUFFORCE (root) is not."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < size:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, size)


class JournalSender:
    """Sends native-protocol entries to one journald socket through one unbound datagram socket."""

    def __init__(self, socket_path: str = JOURNAL_SOCKET, sndbuf: int = _SNDBUF, timeout: float = 1.0) -> None:
        """``socket_path`` is a parameter so tests can run a fake journald; ``sndbuf`` sizes the datagrams.

        ``timeout`` bounds how long a send may block on a journald that stopped reading: the asyncio agent
        must rather lose a log line than stall its loop (and its watchdog pings).
        """
        self.socket_path = socket_path
        self._sndbuf = sndbuf
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _socket(self) -> socket.socket:
        """The datagram socket, created on first use."""
        with self._lock:
            if self._sock is None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                _grow_sndbuf(s, self._sndbuf)
                s.settimeout(self._timeout)
                self._sock = s
            return self._sock

    def send(self, message: str, priority: int = 6, /, **fields: object) -> bool:
        """Write one entry; fields are upper-cased (``component=`` → ``COMPONENT=``). False if not taken.

        ``SYSLOG_IDENTIFIER`` defaults to the program name, as in sd_journal_send(3).
        """
        if not 0 <= priority <= 7:
            raise ValueError(f"journal priority must be 0..7, got {priority}")
        entry: dict[str, object] = {"MESSAGE": message, "PRIORITY": priority}
        for key, value in fields.items():
            name = _field_name(key)
            if name is not None and name not in ("MESSAGE", "PRIORITY"):
                entry[name] = value
        if entry.get("SYSLOG_IDENTIFIER") is None:
            prog = os.path.basename(sys.argv[0] or "")
            entry["SYSLOG_IDENTIFIER"] = prog if prog and not prog.startswith("-") else "python"
        return self.send_raw(encode_entry(entry))

    def send_raw(self, payload: bytes) -> bool:
        """Send an already encoded entry, falling back to a sealed memfd when it is too big for a datagram."""
        try:
            sock = self._socket()
        except OSError:
            return False
        try:
            sock.sendto(payload, self.socket_path)
            return True
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError, PermissionError):
            return False
        except OSError as e:
            if e.errno not in (errno.EMSGSIZE, errno.ENOBUFS, errno.EAGAIN):
                return False
        return self._send_memfd(sock, payload)

    def _send_memfd(self, sock: socket.socket, payload: bytes) -> bool:
        """journald reads an entry from a passed memfd only if it is sealed against any change."""
        try:
            fd = os.memfd_create("journal-entry", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError:
            return False
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0, self.socket_path)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the socket (the next send opens a new one)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


_default = JournalSender()


def send(message: str, priority: int = 6, /, **fields: object) -> bool:
    """Write one structured entry to the system journal (see JournalSender.send)."""
    return _default.send(message, priority, **fields)


def open_stream(
    identifier: str, priority: int = 6, level_prefix: bool = False, socket_path: str = JOURNAL_STDOUT
) -> int:
    """Connect a journald stdout stream and return its fd, for a child's stdout/stderr.

    Lines become entries with ``SYSLOG_IDENTIFIER=identifier`` and ``PRIORITY=priority``; with
    ``level_prefix`` a line starting ``<N>`` sets its own priority (off by default: a child's output is not
    ours to parse). The descriptor is close-on-exec in this process (subprocess dup2()s it onto the child's
    1/2): close it after spawning. Raises OSError when journald is not there, so the caller can fall back to
    a log file.
    """
    if "\n" in identifier:
        raise ValueError("journal stream identifier must not contain a newline")
    if not 0 <= priority <= 7:
        raise ValueError(f"journal priority must be 0..7, got {priority}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(socket_path)
        sock.shutdown(socket.SHUT_RD)  # journald never writes back; a reader end would only leak buffers
        _grow_sndbuf(sock, _SNDBUF)
        header = f"{identifier}\n\n{priority}\n{int(level_prefix)}\n0\n0\n0\n"  # unit id empty; no forwarding
        sock.sendall(header.encode())
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def journald_available(socket_path: str = JOURNAL_SOCKET, environ: Mapping[str, str] | None = None) -> bool:
    """True if journald can take our entries: ``$JOURNAL_STREAM`` is set or its native socket exists."""
    env = os.environ if environ is None else environ
    if env.get("JOURNAL_STREAM"):
        return True
    try:
        return stat.S_ISSOCK(os.stat(socket_path).st_mode)
    except OSError:
        return False


def running_under_systemd(environ: Mapping[str, str] | None = None) -> bool:
    """True when systemd started us as a service (it sets INVOCATION_ID, NOTIFY_SOCKET or JOURNAL_STREAM)."""
    env = os.environ if environ is None else environ
    return any(env.get(k) for k in ("INVOCATION_ID", "NOTIFY_SOCKET", "JOURNAL_STREAM"))

"""sd_notify(3) in pure Python, so the agent talks to systemd without libsystemd.

The protocol is one AF_UNIX datagram of newline-separated ``KEY=VALUE`` lines to ``$NOTIFY_SOCKET`` (a path,
or an abstract name written ``@name``). Outside systemd every call is a no-op returning False. A dead notify
socket must never kill the agent, so send errors are swallowed (logged once per kind of error).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

from loguru import logger

__all__ = ["Notifier", "watchdog_interval"]


def _monotonic_usec() -> int:
    """CLOCK_MONOTONIC in µs, the clock systemd compares RELOADING's MONOTONIC_USEC against."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def watchdog_interval(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """WatchdogSec= in seconds if systemd expects WATCHDOG=1 pings from this process, else None.

    Ping at half this interval (sd_watchdog_enabled(3)). ``$WATCHDOG_PID``, when set, names the process the
    watchdog is meant for: a child that inherited the environment must not think it is watched.
    """
    env = os.environ if environ is None else environ
    raw = env.get("WATCHDOG_USEC")
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        return None
    if usec <= 0:
        return None
    wpid = env.get("WATCHDOG_PID")
    if wpid:
        try:
            if int(wpid) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return usec / 1_000_000


class Notifier:
    """A handle on ``$NOTIFY_SOCKET``; each method sends one datagram and returns whether it was sent."""

    def __init__(self, address: str | None = None, environ: dict[str, str] | None = None) -> None:
        """Use ``address`` if given, else ``$NOTIFY_SOCKET`` from ``environ`` (default: os.environ)."""
        env = os.environ if environ is None else environ
        raw = address if address is not None else env.get("NOTIFY_SOCKET", "")
        self._environ = env
        self._address: str | bytes | None = self._parse(raw)
        self._sock: socket.socket | None = None
        self._logged_errors: set[str] = set()

    @staticmethod
    def _parse(raw: str) -> str | bytes | None:
        """Turn ``$NOTIFY_SOCKET`` into a sendto() address; ``@name`` is abstract (a leading NUL byte)."""
        if not raw:
            return None
        if raw.startswith("@"):
            return b"\0" + raw[1:].encode()
        if raw.startswith("/"):
            return raw
        # systemd ≥ 254 may hand out vsock: addresses (VMs); the agent runs on bare metal, so just say so.
        logger.warning("NOTIFY_SOCKET={!r} is not a unix socket address; sd_notify disabled", raw)
        return None

    @property
    def enabled(self) -> bool:
        """True when there is a notify socket to talk to (we run under a Type=notify unit)."""
        return self._address is not None

    def watchdog_interval(self) -> float | None:
        """WatchdogSec= in seconds for this process (see the module function), None if not watched."""
        return watchdog_interval(self._environ) if self.enabled else None

    def send(self, **fields: str | int) -> bool:
        """Send the given fields (``send(STATUS="x", READY=1)``) as one datagram. False if not sent.

        A newline inside a value would start a new assignment, so it becomes a space.
        """
        if self._address is None or not fields:
            return False
        payload = "".join(f"{k}={str(v).replace(chr(10), ' ')}\n" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self._address)
        except OSError as e:
            key = type(e).__name__ + str(e.errno)
            if key not in self._logged_errors:
                self._logged_errors.add(key)
                logger.warning("sd_notify to {!r} failed (logged once): {}", self._address, e)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """READY=1: systemctl start returns; send it once the agent's own API answers."""
        return self.send(READY=1, STATUS=status) if status is not None else self.send(READY=1)

    def status(self, text: str) -> bool:
        """STATUS=<one line> shown by ``systemctl status``."""
        return self.send(STATUS=text)

    def watchdog(self) -> bool:
        """WATCHDOG=1: keep-alive ping, due every watchdog_interval()/2 seconds."""
        return self.send(WATCHDOG=1)

    def stopping(self, status: str | None = None) -> bool:
        """STOPPING=1: the agent is draining its stack; systemd shows ``deactivating``."""
        return self.send(STOPPING=1, STATUS=status) if status is not None else self.send(STOPPING=1)

    def reloading(self) -> bool:
        """RELOADING=1 + MONOTONIC_USEC (Type=notify-reload, systemd ≥ 253, requires it); READY=1 after."""
        return self.send(RELOADING=1, MONOTONIC_USEC=_monotonic_usec())

    def close(self) -> None:
        """Release the socket (a later call opens a new one)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

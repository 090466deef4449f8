"""sd_notify against real AF_UNIX datagram sockets (path and abstract), asserting the exact bytes sent."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from nodeagent.core.sdnotify import Notifier, watchdog_interval


@pytest.fixture
def path_socket() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket at a short path (sun_path is limited to 108 bytes)."""
    d = tempfile.mkdtemp(prefix="sdn-")
    path = os.path.join(d, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2)
    yield s, path
    s.close()
    with contextlib.suppress(FileNotFoundError):  # a test may have removed it
        os.unlink(path)
    os.rmdir(d)


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket in the abstract namespace, named as systemd writes it: ``@name``."""
    name = f"dsv4-sdnotify-test-{os.getpid()}-{time.monotonic_ns()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(b"\0" + name.encode())
    s.settimeout(2)
    yield s, "@" + name
    s.close()


def test_each_call_is_one_exact_datagram(path_socket: tuple[socket.socket, str]) -> None:
    sock, path = path_socket
    n = Notifier(environ={"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready()
    assert sock.recv(4096) == b"READY=1\n"
    assert n.status("adopted 3 components\nvllm loading")
    assert sock.recv(4096) == b"STATUS=adopted 3 components vllm loading\n"
    assert n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1\n"
    assert n.stopping()
    assert sock.recv(4096) == b"STOPPING=1\n"
    assert n.ready(status="ready")
    assert sock.recv(4096) == b"READY=1\nSTATUS=ready\n"
    assert n.send(STATUS="x", ERRNO=5)
    assert sock.recv(4096) == b"STATUS=x\nERRNO=5\n"
    n.close()


def test_abstract_socket(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, name = abstract_socket
    n = Notifier(environ={"NOTIFY_SOCKET": name})
    assert n.ready()
    assert sock.recv(4096) == b"READY=1\n"


def test_reloading_carries_monotonic_usec(path_socket: tuple[socket.socket, str]) -> None:
    sock, path = path_socket
    n = Notifier(path)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    data = sock.recv(4096)
    lines = data.decode().split("\n")
    assert lines[0] == "RELOADING=1"
    assert lines[1].startswith("MONOTONIC_USEC=")
    assert before <= int(lines[1].split("=", 1)[1]) <= after
    assert data.endswith(b"\n") and len(lines) == 3


def test_no_notify_socket_means_noop() -> None:
    n = Notifier(environ={})
    assert not n.enabled
    assert not n.ready()
    assert not n.status("x")
    assert not n.watchdog()
    assert not n.stopping()
    assert not n.reloading()
    assert not n.send(STATUS="x")
    assert n.watchdog_interval() is None


def test_unsupported_address_disables() -> None:
    assert not Notifier(environ={"NOTIFY_SOCKET": "vsock:2:1234"}).ready()


def test_dead_socket_is_swallowed_and_logged_once(path_socket: tuple[socket.socket, str]) -> None:
    sock, path = path_socket
    n = Notifier(path)
    assert n.ready()
    sock.close()
    os.unlink(path)  # systemd gone: ENOENT on every send
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    try:
        assert not n.watchdog()
        assert not n.watchdog()
        assert not n.status("still here")
    finally:
        logger.remove(sink)
    assert len(messages) == 1, messages
    assert "sd_notify" in messages[0]


def test_watchdog_interval() -> None:
    me = os.getpid()
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "2500000", "WATCHDOG_PID": str(me)}) == 2.5
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(me + 1)}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "garbage"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "7"}, pid=7) == 1.0


def test_notifier_watchdog_interval_uses_its_environ(tmp_path: Path) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "n"), "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(environ=env).watchdog_interval() == 4.0

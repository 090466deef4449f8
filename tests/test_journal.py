"""The journald client against a fake journald: our own AF_UNIX datagram and stream sockets in a temp dir."""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from journald_fake import fake_journald_socket, parse_entry

from nodeagent.core import journal
from nodeagent.core.journal import (
    JournalSender,
    encode_entry,
    journald_available,
    open_stream,
    running_under_systemd,
)


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory (sun_path ≤ 108 bytes) for fake journald sockets."""
    d = Path(tempfile.mkdtemp(prefix="jrn-"))
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


@pytest.fixture
def fake_journald() -> Iterator[tuple[socket.socket, str]]:
    """journald's native socket: a bound datagram socket."""
    with fake_journald_socket() as pair:
        yield pair


def test_send_exact_bytes(fake_journald: tuple[socket.socket, str]) -> None:
    sock, path = fake_journald
    sender = JournalSender(path)
    assert sender.send("vllm exited", 3, component="vllm", event="exit", SYSLOG_IDENTIFIER="dsv4-agent")
    assert sock.recv(65536) == (
        b"MESSAGE=vllm exited\nPRIORITY=3\nCOMPONENT=vllm\nEVENT=exit\nSYSLOG_IDENTIFIER=dsv4-agent\n"
    )
    sender.close()


def test_newlines_use_the_binary_form(fake_journald: tuple[socket.socket, str]) -> None:
    sock, path = fake_journald
    msg = "Traceback (most recent call last):\n  boom"
    assert JournalSender(path).send(msg, 6, detail="a\nb", SYSLOG_IDENTIFIER="t")
    data = sock.recv(65536)
    raw = msg.encode()
    assert data == (
        b"MESSAGE\n" + struct.pack("<Q", len(raw)) + raw + b"\n"
        b"PRIORITY=6\n"
        b"DETAIL\n" + struct.pack("<Q", 3) + b"a\nb\n"
        b"SYSLOG_IDENTIFIER=t\n"
    )
    assert parse_entry(data)["MESSAGE"] == raw


def test_field_names_are_sanitised_and_none_dropped(fake_journald: tuple[socket.socket, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sock, path = fake_journald
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/dsv4-agent", *sys.argv[1:]])  # not pytest's own (xdist: -c)
    fields = {"my-field": 1, "_trusted": "x", "9lives": "y", "gone": None, "priority": 0, "ok": b"\x00\x01"}
    assert JournalSender(path).send("m", 6, **fields)
    got = parse_entry(sock.recv(65536))
    assert got["MY_FIELD"] == b"1"
    assert got["TRUSTED"] == b"x"  # journald drops fields starting with "_" (trusted fields): strip it
    assert got["LIVES"] == b"y"
    assert got["PRIORITY"] == b"6"  # the priority argument wins over a stray field
    assert got["OK"] == b"\x00\x01"
    assert "GONE" not in got
    assert got["SYSLOG_IDENTIFIER"] == b"dsv4-agent"  # the program's name, as sd_journal_send(3) does
    monkeypatch.setattr(sys, "argv", ["-c"])  # `python -c ...` has no program name
    assert JournalSender(path).send("m", 6)
    assert parse_entry(sock.recv(65536))["SYSLOG_IDENTIFIER"] == b"python"


def test_large_entry_goes_through_a_sealed_memfd(fake_journald: tuple[socket.socket, str]) -> None:
    sock, path = fake_journald
    sender = JournalSender(path, sndbuf=65536)  # the kernel doubles it: 128 KiB datagram limit
    big = "x" * 300_000
    assert sender.send(big, 6, SYSLOG_IDENTIFIER="t")
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(65536, socket.CMSG_SPACE(fds.itemsize))
    assert data == b""  # journald ignores fds that come with payload
    level, kind, cdata = ancdata[0]
    assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
    fds.frombytes(cdata[: fds.itemsize])
    fd = fds[0]
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
        assert seals & want == want
        content = os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)
    assert parse_entry(content) == {"MESSAGE": big.encode(), "PRIORITY": b"6", "SYSLOG_IDENTIFIER": b"t"}


def test_values_are_capped_with_a_marker() -> None:
    value = "é" * journal.MAX_VALUE_BYTES  # 2 bytes each: the cut lands inside a character
    entry = parse_entry(encode_entry({"MESSAGE": value}))
    text = entry["MESSAGE"].decode()  # still valid UTF-8
    assert text.startswith("é" * 1000)
    assert text.endswith(f" …[truncated {journal.MAX_VALUE_BYTES} bytes]")
    assert len(entry["MESSAGE"]) < journal.MAX_VALUE_BYTES + 64


def test_no_journald_returns_false(sockdir: Path) -> None:
    assert not JournalSender(str(sockdir / "absent")).send("m", 6)
    with pytest.raises(ValueError):
        JournalSender(str(sockdir / "absent")).send("m", 8)


def test_open_stream_header_and_child_output(sockdir: Path) -> None:
    path = str(sockdir / "stdout")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(5)
    fd = open_stream("childtest", 5, socket_path=path)
    conn, _ = server.accept()
    try:
        assert not os.get_inheritable(fd)
        subprocess.run(
            [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
            stdout=fd,
            stderr=fd,
            check=True,
        )
        os.close(fd)
        conn.settimeout(5)
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
    finally:
        conn.close()
        server.close()
    assert got == b"childtest\n\n5\n0\n0\n0\n0\nout\nerr\n"


def test_open_stream_level_prefix_flag(sockdir: Path) -> None:
    path = str(sockdir / "stdout")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    fd = open_stream("x", level_prefix=True, socket_path=path)
    conn, _ = server.accept()
    os.close(fd)
    with conn, server:
        assert conn.recv(100) == b"x\n\n6\n1\n0\n0\n0\n"


def test_open_stream_errors(sockdir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_stream("x", socket_path=str(sockdir / "absent"))
    with pytest.raises(ValueError):
        open_stream("a\nb", socket_path=str(sockdir / "absent"))
    with pytest.raises(ValueError):
        open_stream("x", priority=9, socket_path=str(sockdir / "absent"))


def test_journald_available(sockdir: Path, fake_journald: tuple[socket.socket, str]) -> None:
    _, path = fake_journald
    assert journald_available(path, environ={})
    assert not journald_available(str(sockdir / "absent"), environ={})
    regular = sockdir / "regular"
    regular.write_text("")
    assert not journald_available(str(regular), environ={})
    assert journald_available(str(sockdir / "absent"), environ={"JOURNAL_STREAM": "8:1234"})


def test_running_under_systemd() -> None:
    assert not running_under_systemd({})
    assert not running_under_systemd({"INVOCATION_ID": ""})
    for key in ("INVOCATION_ID", "NOTIFY_SOCKET", "JOURNAL_STREAM"):
        assert running_under_systemd({key: "x"})


def test_module_send_uses_the_real_socket_path() -> None:
    # Outside systemd the real socket is absent: send() must say so, not raise.
    if Path(journal.JOURNAL_SOCKET).exists():
        pytest.skip("a journald runs on this host; the container test covers the real socket")
    assert journal.send("hello", 6) is False

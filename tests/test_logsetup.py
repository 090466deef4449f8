"""setup_logging: the text and JSON formats, and the journal sink against a fake journald socket."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from journald_fake import fake_journald_socket
from journald_fake import parse_entry as parse_bytes
from loguru import logger

from nodeagent.core.logsetup import journal_priority, setup_logging

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} ")


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """setup_logging replaces global sinks; give later tests loguru's default and the stdlib's old root."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    logger.remove()
    logger.add(sys.stderr)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def fake_journald() -> Iterator[tuple[socket.socket, str]]:
    with fake_journald_socket() as pair:
        yield pair


def parse_entry(data: bytes) -> dict[str, str]:
    return {k: v.decode() for k, v in parse_bytes(data).items()}


def test_text_format() -> None:
    out = io.StringIO()
    assert setup_logging("node-1", "text", stream=out) == "text"
    logger.bind(component="vllm").info("restart: exit code 1")
    logger.info("plain")
    logger.debug("hidden at INFO")
    logger.bind(component="etcd").warning("slow")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert TEXT_LINE.match(lines[0])
    assert lines[0][24:] == "INFO  [vllm] restart: exit code 1"
    assert lines[1][24:] == "INFO  plain"
    assert lines[2][24:] == "WARNING [etcd] slow"


def test_event_line_has_one_component_tag() -> None:
    """An event's log line carries its component once (it read "[etcd] [etcd] stopped → starting")."""
    from nodeagent.core.events import EventBus

    out = io.StringIO()
    setup_logging("node-1", "text", stream=out)
    EventBus().emit("state", "stopped → starting", component="etcd")
    EventBus().emit("agent", "started")
    lines = out.getvalue().splitlines()
    assert [line[24:] for line in lines] == ["INFO  [etcd] stopped → starting", "INFO  started"], lines


def test_text_format_exception_and_level() -> None:
    out = io.StringIO()
    setup_logging("n", "text", level="DEBUG", stream=out)
    logger.debug("shown")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    text = out.getvalue()
    assert "DEBUG shown" in text
    assert "ERROR failed\nTraceback (most recent call last):" in text
    assert "RuntimeError: boom" in text


def test_json_format() -> None:
    out = io.StringIO()
    assert setup_logging("node-1", "json", stream=out) == "json"
    logger.bind(component="vllm", event="restart", attempt=3).error("vllm exited")
    line = out.getvalue().splitlines()
    assert len(line) == 1
    obj = json.loads(line[0])
    assert obj["level"] == "ERROR"
    assert obj["node"] == "node-1"
    assert obj["message"] == "vllm exited"
    assert obj["component"] == "vllm"
    assert obj["event"] == "restart"
    assert obj["attempt"] == 3
    assert obj["file"] == __file__
    assert obj["function"] == "test_json_format"
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d$", obj["time"])


def test_journal_sink_fields(fake_journald: tuple[socket.socket, str]) -> None:
    sock, path = fake_journald
    assert setup_logging("node-7", "journal", journal_socket=path, environ={}) == "journal"
    logger.bind(component="vllm", event="restart", attempt=3, info={"a": 1}).warning("restarting vllm")
    line = sys._getframe().f_lineno - 1
    got = parse_entry(sock.recv(65536))
    assert got == {
        "MESSAGE": "restarting vllm",
        "PRIORITY": "4",
        "COMPONENT": "vllm",
        "EVENT": "restart",
        "ATTEMPT": "3",
        "INFO": '{"a": 1}',
        "SYSLOG_IDENTIFIER": "dsv4-agent",
        "NODE": "node-7",
        "CODE_FILE": __file__,
        "CODE_LINE": str(line),
        "CODE_FUNC": "test_journal_sink_fields",
    }


def test_journal_priorities(fake_journald: tuple[socket.socket, str]) -> None:
    sock, path = fake_journald
    setup_logging("n", "journal", level="TRACE", journal_socket=path, environ={})
    want = {"trace": 7, "debug": 7, "info": 6, "success": 5, "warning": 4, "error": 3, "critical": 2}
    for name, prio in want.items():
        getattr(logger, name)(name)
        got = parse_entry(sock.recv(65536))
        assert (got["MESSAGE"], got["PRIORITY"]) == (name, str(prio))
    assert journal_priority("CUSTOM", 35) == 3
    assert journal_priority("NOTICE", 22) == 5


def test_journal_exception_is_in_message(fake_journald: tuple[socket.socket, str]) -> None:
    sock, path = fake_journald
    setup_logging("n", "journal", journal_socket=path, environ={})
    try:
        raise ValueError("bad")
    except ValueError:
        logger.exception("probe crashed")
    got = parse_entry(sock.recv(65536))
    assert got["MESSAGE"].startswith("probe crashed\nTraceback (most recent call last):")
    assert got["MESSAGE"].endswith("ValueError: bad")
    assert got["PRIORITY"] == "3"


def test_journal_falls_back_to_stderr_when_journald_goes_away(
    fake_journald: tuple[socket.socket, str],
) -> None:
    sock, path = fake_journald
    out = io.StringIO()
    setup_logging("n", "journal", journal_socket=path, environ={}, stream=out)
    sock.close()
    os.unlink(path)
    logger.bind(component="vllm").error("still visible")
    assert out.getvalue().splitlines()[-1][24:] == "ERROR [vllm] still visible"


def test_auto_selection(fake_journald: tuple[socket.socket, str], tmp_path: Path) -> None:
    _, path = fake_journald
    out = io.StringIO()
    assert setup_logging("n", "auto", journal_socket=path, environ={"INVOCATION_ID": "abc"}, stream=out) == "journal"
    assert setup_logging("n", "auto", journal_socket=path, environ={"JOURNAL_STREAM": "8:9"}) == "journal"
    assert setup_logging("n", "auto", journal_socket=path, environ={}, stream=out) == "text"
    absent = str(tmp_path / "absent")
    assert setup_logging("n", "auto", journal_socket=absent, environ={"INVOCATION_ID": "abc"}) == "text"
    assert setup_logging("n", "journal", journal_socket=absent, environ={}, stream=out) == "text"
    assert "journald is not available" in out.getvalue().splitlines()[-1]
    with pytest.raises(ValueError):
        setup_logging("n", "xml", stream=out)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        setup_logging("n", "text", level="LOUD", stream=out)
    logger.info("the previous sinks are still in place")
    assert out.getvalue().splitlines()[-1].endswith("INFO  the previous sinks are still in place")


def test_stdlib_logging_is_routed(fake_journald: tuple[socket.socket, str]) -> None:
    out = io.StringIO()
    setup_logging("n", "text", stream=out)
    logging.getLogger("aiohttp.server").warning("bad request from %s", "10.0.0.1")
    logging.getLogger("aiohttp.access").debug("not at INFO")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0][24:] == "WARNING bad request from 10.0.0.1"
    sock, path = fake_journald
    setup_logging("n", "journal", journal_socket=path, environ={})
    logging.getLogger("aiohttp.server").error("oops")
    got = parse_entry(sock.recv(65536))
    assert (got["MESSAGE"], got["PRIORITY"], got["LOGGER"]) == ("oops", "3", "aiohttp.server")
    assert got["CODE_FUNC"] == "test_stdlib_logging_is_routed"

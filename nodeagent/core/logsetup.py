"""One call to route the agent's loguru output where an operator will look for it.

Under systemd the agent writes structured journal entries (``journalctl -t dsv4-agent COMPONENT=vllm``);
elsewhere one human-readable line per record on stderr, or one JSON object per line for log shippers.
Bound extras (``logger.bind(component="vllm", event="restart")``) become fields in every structured form.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any, Literal, TextIO

from loguru import logger

from nodeagent.core import journal

__all__ = ["IDENTIFIER", "LogFormat", "journal_priority", "setup_logging"]

LogFormat = Literal["auto", "text", "json", "journal"]
IDENTIFIER = "dsv4-agent"

_PRIORITY_BY_NAME = {"TRACE": 7, "DEBUG": 7, "INFO": 6, "SUCCESS": 5, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


def journal_priority(level_name: str, level_no: int) -> int:
    """syslog priority for a loguru level; custom levels map by their number."""
    if level_name in _PRIORITY_BY_NAME:
        return _PRIORITY_BY_NAME[level_name]
    for limit, prio in ((10, 7), (20, 6), (25, 5), (30, 4), (40, 3)):
        if level_no <= limit:
            return prio
    return 2


def _text_format(record: Any) -> str:
    """Format template: ``2026-12-02 18:00:00.123 INFO  [vllm] message`` (brackets only when bound)."""
    comp = " [{extra[component]}]" if record["extra"].get("component") is not None else ""
    return "{time:YYYY-MM-DD HH:mm:ss.SSS} {level: <5}" + comp + " {message}\n{exception}"


def _exception_text(record: Any) -> str | None:
    """The traceback of a ``logger.exception`` record as plain text, or None."""
    exc = record["exception"]
    if exc is None:
        return None
    return "".join(traceback.format_exception(exc.type, exc.value, exc.traceback)).rstrip("\n")


def _text_line(record: Any) -> str:
    """The text form of a record, for the journal sink's stderr fallback."""
    comp = record["extra"].get("component")
    head = record["time"].strftime("%Y-%m-%d %H:%M:%S.") + f"{record['time'].microsecond // 1000:03d}"
    tag = f" [{comp}]" if comp is not None else ""
    line = f"{head} {record['level'].name: <5}{tag} {record['message']}\n"
    exc = _exception_text(record)
    return line + (exc + "\n" if exc else "")


def _json_sink(node: str, stream: TextIO) -> Callable[[Any], None]:
    """One JSON object per line: fixed keys first, then every bound extra."""

    def sink(message: Any) -> None:
        r = message.record
        obj: dict[str, Any] = {
            "time": r["time"].isoformat(timespec="milliseconds"),
            "level": r["level"].name,
            "node": node,
            "message": r["message"],
        }
        for key, value in r["extra"].items():
            obj.setdefault(key, value)
        obj.update(file=r["file"].path, line=r["line"], function=r["function"])
        exc = _exception_text(r)
        if exc:
            obj["exception"] = exc
        stream.write(json.dumps(obj, default=str, ensure_ascii=False) + "\n")
        stream.flush()

    return sink


def _journal_sink(node: str, sender: journal.JournalSender, fallback: TextIO) -> Callable[[Any], None]:
    """Native journal entries; if journald does not take one, the text line goes to ``fallback``."""

    def sink(message: Any) -> None:
        r = message.record
        fields: dict[str, object] = {}
        for key, value in r["extra"].items():
            fields[key] = value if isinstance(value, str) else json.dumps(value, default=str)
        fields.update(
            SYSLOG_IDENTIFIER=IDENTIFIER,
            NODE=node,
            CODE_FILE=r["file"].path,
            CODE_LINE=r["line"],
            CODE_FUNC=r["function"],
        )
        text = r["message"]
        exc = _exception_text(r)
        if exc:
            text = f"{text}\n{exc}"
        if not sender.send(text, journal_priority(r["level"].name, r["level"].no), **fields):
            fallback.write(_text_line(r))
            fallback.flush()

    return sink


class _InterceptHandler(logging.Handler):
    """Send stdlib logging (aiohttp, asyncio, aetcd) through loguru so it lands in the same place."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        # Report the code that called logging, not logging's own frames (loguru's depth counts from here).
        frame: FrameType | None = sys._getframe(0)
        depth = 0
        while frame is not None and (depth == 0 or frame.f_code.co_filename == logging.__file__):
            frame = frame.f_back
            depth += 1
        logger.bind(logger=record.name).opt(depth=depth, exception=record.exc_info).log(level, record.getMessage())


def setup_logging(
    node: str,
    fmt: LogFormat = "auto",
    level: str = "INFO",
    *,
    stream: TextIO | None = None,
    journal_socket: str = journal.JOURNAL_SOCKET,
    environ: dict[str, str] | None = None,
) -> str:
    """Replace loguru's sinks with one for ``fmt`` and return the format chosen ("text"/"json"/"journal").

    ``auto`` picks the journal when systemd started us (``$JOURNAL_STREAM`` or ``$INVOCATION_ID``) and
    journald is there, else text. ``journal`` without a journald falls back to text and says so. ``stream``
    (default stderr), ``journal_socket`` and ``environ`` exist for tests. Stdlib logging is routed into
    loguru too.
    """
    env = os.environ if environ is None else environ
    out = stream if stream is not None else sys.stderr
    have_journald = journal.journald_available(journal_socket, env)
    chosen = fmt
    if fmt == "auto":
        under_systemd = bool(env.get("JOURNAL_STREAM") or env.get("INVOCATION_ID"))
        chosen = "journal" if under_systemd and have_journald else "text"
    elif fmt == "journal" and not have_journald:
        chosen = "text"
    elif fmt not in ("text", "json", "journal"):
        raise ValueError(f"log format must be auto, text, json or journal, not {fmt!r}")

    levelno = logger.level(level).no  # ValueError for an unknown level, before any sink is removed
    logger.remove()
    if chosen == "journal":
        sender = journal.JournalSender(journal_socket)
        logger.add(_journal_sink(node, sender, out), level=level, format="{message}", catch=True)
    elif chosen == "json":
        logger.add(_json_sink(node, out), level=level, format="{message}", catch=True)
    else:
        logger.add(out, level=level, format=_text_format, colorize=False, backtrace=False, diagnose=False)

    # loguru's level numbers match the stdlib's (DEBUG 10 … CRITICAL 50), so the root logger filters alike.
    logging.basicConfig(handlers=[_InterceptHandler()], level=levelno, force=True)
    if fmt == "journal" and chosen != "journal":
        logger.warning("log format 'journal' requested but journald is not available; logging text to stderr")
    return chosen

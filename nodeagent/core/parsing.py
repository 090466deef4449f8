"""Tiny parsers shared by the daemon and the CLI; standard library only, so `nodeagentctl` stays fast."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


def _number(text: str, kind: type[int] | type[float], what: str, ok: Callable[[float], bool], rule: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a positive, finite number of seconds."""
    return _number(text, float, "a number of seconds", lambda v: 0 < v < math.inf, "a positive number of seconds")


def positive_int(text: str) -> int:
    """argparse type: a whole number > 0."""
    return _number(text, int, "a whole number", lambda v: v > 0, "> 0")


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, "a number", lambda v: 0 < v < math.inf, "a finite number > 0")


def fraction(text: str) -> float:
    """argparse type: a number from 0 to 1."""
    return _number(text, float, "a number", lambda v: 0 <= v <= 1, "from 0 to 1")


def split_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 hosts in brackets) → (host without brackets, port)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)

"""Tiny parsers shared by the daemon and the CLI; standard library only, so `nodeagentctl` stays fast."""

from __future__ import annotations

import argparse


def positive_seconds(text: str) -> float:
    """argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def split_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 hosts in brackets) → (host without brackets, port)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)

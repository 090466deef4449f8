"""What every `nodeagentctl` command shares: exit codes, the one error type, defaults and small formatting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEFAULT_CONFIG = "/etc/dsv4-agent/config.yaml"
EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_UNKNOWN, EXIT_UNAUTHORISED, EXIT_CONFIG = 1, 2, 3, 4, 5, 78
DEFAULT_UNIT = "dsv4-agent"
DEFAULT_WAIT_S = 1800.0
"""`--wait` default: DeepSeek-V4 takes up to half an hour to load."""
NODE_COMMANDS = ("status", "render", "config", "start", "stop", "restart", "cluster", "preflight", "ports")
"""Commands that take --node NAME (another member of the cluster, or which of this host's agents)."""


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def error_text(data: Any, status: int) -> str:
    if isinstance(data, dict) and "error" in data:
        return str(data["error"])
    return f"HTTP {status}: {str(data)[:200]}"


def short_age(seconds: Any) -> str:
    """`45s`, `3m`: an age in a table cell or a status line."""
    if not isinstance(seconds, int | float):
        return "-"
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def pause_line(pause: dict[str, Any], now: float) -> str:
    """`CLUSTER PAUSED by n1: operator 3m ago — switch maintenance (no agent takes automatic actions)`; a node's own
    pause (scope `node`) reads `PAUSED by … (no automatic restarts on this node)`."""
    at = pause.get("at")
    when = f" {short_age(now - at)} ago" if isinstance(at, int | float) else ""
    reason = f" — {pause['reason']}" if pause.get("reason") else ""
    if pause.get("scope", "cluster") == "cluster":
        reason = reason or " — no reason given"
        return f"CLUSTER PAUSED by {pause.get('by') or '?'}{when}{reason} (no agent takes automatic actions)"
    return f"PAUSED by {pause.get('by') or '?'}{when}{reason} (no automatic restarts on this node)"


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Columns padded to their widest cell, trailing blanks dropped."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]

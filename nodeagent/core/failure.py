"""Pure: what a failed run was, and whether another attempt could help.

A *transient* failure (a crash after a long run, a hang, a lost dependency) is what restarts and node
redeploys are for. A *permanent* one — the command or the model missing, a configuration the component rejects,
the same error within seconds every time — cannot be fixed by restarting, and a node redeploy would only take
healthy components down with it: it ends in a visible `failed: <reason>` and retries at the backoff cap.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field, replace
from typing import Any

QUICK_EXIT_S = 30.0
"""An exit this soon after the start is a failed start, not a crash (vLLM's import and argument parsing take
~5-10 s; a DeepSeek-V4 load takes 30-60 min)."""
TAIL_LINES = 12


def exit_text(code: int | None) -> str:
    """`exited with code 1`, `killed by SIGKILL`: what an operator reads, never `code None`."""
    if code is None:
        return "exited (status unknown: not our child)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code > 128 and code - 128 < 65:
        # a shell or our log relay reports a signal death as 128 + N
        try:
            return f"exited with code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exited with code {code}"


_NOISE = (
    (re.compile(r"\b\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"), "<time>"),
    (re.compile(r"\b\d\d:\d\d:\d\d(?:[.,]\d+)?\b"), "<time>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<hex>"),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<uuid>"),
    (re.compile(r"\b\d+\b"), "<n>"),
)


def error_signature(lines: tuple[str, ...] | list[str]) -> str:
    """The last lines with times, pids, addresses and counts masked: equal for the same error, run after run."""
    text = "\n".join(line.strip() for line in lines if line.strip())
    for pattern, mask in _NOISE:
        text = pattern.sub(mask, text)
    return text


_USAGE = re.compile(r"(^|\n)\s*(usage:|error: (unrecognized|argument|the following arguments)|flag provided but not "
                    r"defined|invalid (value|choice))", re.IGNORECASE)  # fmt: skip


@dataclass(frozen=True)
class Failure:
    """One failed run, as the component saw it."""

    @property
    def cause(self) -> str:
        """The restart cause it counts as (`states.RESTART_CAUSES`)."""
        return {"exit": "crash", "startup": "probe", "liveness": "probe"}.get(self.what, "launch")

    what: str
    """precheck | launch | exit | startup | liveness | engine_fault (the process alive, its engine not)"""
    detail: str
    code: int | None = None
    uptime_s: float | None = None
    output_tail: tuple[str, ...] = field(default_factory=tuple)
    permanent: str | None = None
    """Why no restart can help, once classified; None for a transient failure."""
    was_up: bool = False
    """The run passed a startup probe: whatever ended it was a crash, not a failed start (a component without
    a startup probe is up at once, which proves nothing)."""

    @property
    def signature(self) -> str:
        return error_signature(self.output_tail)

    def last_line(self) -> str:
        return next((line.strip() for line in reversed(self.output_tail) if line.strip()), "")

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "detail": self.detail, "code": self.code, "uptime_s": self.uptime_s,
                "output_tail": list(self.output_tail), "permanent": self.permanent,
                "was_up": self.was_up}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Failure | None:
        try:
            return cls(what=str(data["what"]), detail=str(data["detail"]), code=data.get("code"),
                       uptime_s=data.get("uptime_s"), output_tail=tuple(data.get("output_tail") or ()),
                       permanent=data.get("permanent"), was_up=bool(data.get("was_up")))  # fmt: skip
        except (KeyError, TypeError):
            return None


def classify(failure: Failure, previous: Failure | None, quick_exit_s: float = QUICK_EXIT_S) -> Failure:
    """The failure with `permanent` set when no restart can help.

    Permanent: a precheck found the command, the model or a configured file missing; the command could not be
    executed; the component rejected its arguments (a usage error within seconds); or it exited within seconds
    twice in a row with the same error text, never having come up. Everything else (long runs, runs that came
    up, hangs, signals, a first quick exit with a new error) is transient.
    """
    if failure.permanent:
        return failure
    if failure.what == "precheck":
        return replace(failure, permanent=failure.detail)
    if failure.what == "launch" and ("command not found" in failure.detail or "permission denied" in failure.detail):
        return replace(failure, permanent=failure.detail)
    quick = failure.what == "launch" or (
        failure.what == "exit" and not failure.was_up and failure.uptime_s is not None
        and failure.uptime_s <= quick_exit_s
    )  # fmt: skip
    if quick_exit_s <= 0:
        quick = False
    if not quick or (failure.code is not None and failure.code < 0):
        return failure  # a long run, or killed by a signal: someone else's doing, not a broken start
    text = "\n".join(failure.output_tail)
    if failure.what == "exit" and failure.code == 2 and _USAGE.search(text):
        line = failure.last_line()
        return replace(failure, permanent=f"rejected its configuration (exit 2): {line}" if line else
                       "rejected its configuration (exit 2)")  # fmt: skip
    prev_quick = previous is not None and (
        previous.what == "launch"
        or (not previous.was_up and previous.uptime_s is not None and previous.uptime_s <= quick_exit_s)
    )
    if (
        previous is not None
        and prev_quick
        and previous.what == failure.what
        and previous.code == failure.code
        and failure.signature
        and previous.signature == failure.signature
    ):
        line = failure.last_line()
        again = "fails to launch" if failure.what == "launch" else f"exits within {quick_exit_s:g}s"
        return replace(failure, permanent=f"{again} with the same error each time" + (f": {line}" if line else ""))
    return failure

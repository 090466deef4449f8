"""Pure: a start that lost a port race is retried after a jittered delay, not counted as a failure.

vLLM picks many ports by probing (`get_open_port()` binds port 0, closes, returns the number) and binds them
later; a rank starting at the same moment, Mooncake's random ADXL pick or an outgoing connection can take the
port in between (vllm-ascend #15358, #16237: `ZMQError: Address already in use` in shm_broadcast.py). The next
start draws other ports, so a restart after 1-5 s almost always succeeds; counting it as a failure would push a
healthy rank towards crash-loop backoff and a node redeploy. A port that stays taken (a real collision, see
`portlint`) fails the same way every time: after `max_in_row` retries in a row the failure counts as usual.

Wired in `component_failure.FailurePath._judge`, before `classify` (two quick exits with the same text would
otherwise be marked permanent): a retry is a BACKOFF with `bind_race_retry`, no restart counted, no decision, no
archive; `on_up` where the startup probes pass ends the run of retries.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from nodeagent.core.failure import Failure

BIND_RACE_WINDOW_S = 3600.0
"""A failed start: Mooncake binds its handshake ports only after the weights are loaded (DeepSeek-V4: 30-60 min),
so the window is vLLM's engine-ready timeout the agent renders (VLLM_ENGINE_READY_TIMEOUT_S=3600)."""
RETRY_DELAY_S = (1.0, 5.0)
MAX_IN_ROW = 3

BIND_ERRORS = re.compile(
    r"Address already in use"  # ZMQError, OSError text, torch's TCPStore
    r"|\[Errno 98\]"  # Python's OSError (uvicorn: "[Errno 98] error while attempting to bind on address")
    r"|\bEADDRINUSE\b"  # torch DistNetworkError / c10d
    r"|server socket has failed to listen on any local network address"  # torch TCPStore
    r"|Failed to bind the IP port"  # HCCL EJ0003 (vllm-ascend #405)
    r"|Communication_Error_Bind_IP_Port",  # HCCL EI0019 (vllm-ascend #16205)
    re.IGNORECASE,
)
_PORT = re.compile(r"tcp://[^\s'\"]*:(\d{2,5})|\(\s*'[^']*',\s*(\d{2,5})\s*\)|port\[(\d{2,5})\]|port[: ]+(\d{2,5})",
                   re.IGNORECASE)  # fmt: skip


def is_bind_race(output_tail: Sequence[str], exit_code: int | None, uptime: float | None,
                 was_up: bool = False) -> bool:
    """A start that failed because a port it wanted was taken: it exited by itself (code > 0), never came up,
    within the start window, and its last lines say so."""
    if exit_code is None or exit_code <= 0 or was_up:
        return False
    if uptime is not None and uptime > BIND_RACE_WINDOW_S:
        return False
    return any(BIND_ERRORS.search(line) for line in output_tail)


def bind_race_port(output_tail: Sequence[str]) -> int | None:
    """The port named in the bind error (or a listen/bind line next to it, as HCCL prints), when one is named."""
    lines = list(reversed(output_tail))
    for line in [*(x for x in lines if BIND_ERRORS.search(x)), *(x for x in lines if re.search(r"listen|bind", x))]:
        if m := _PORT.search(line):
            return int(next(g for g in m.groups() if g))
    return None


@dataclass(frozen=True)
class BindRetry:
    delay_s: float
    attempt: int
    """1 for the first retry in a row."""
    reason: str


class BindRaceRetries:
    """One component's bind-race retries: at most `max_in_row` in a row, each after a seeded-random 1-5 s."""

    def __init__(self, component: str, max_in_row: int = MAX_IN_ROW, seed: int | None = None) -> None:
        self.component = component
        self.max_in_row = max_in_row
        self.rng = random.Random(zlib.crc32(component.encode()) if seed is None else seed)
        """Seeded per component: ranks that raced each other do not retry in lockstep, and tests are exact."""
        self.streak = 0

    def on_failure(self, failure: Failure) -> BindRetry | None:
        """A retry without counting, or None: count the failure as usual (not a race, or too many in a row)."""
        if failure.what != "exit" or not is_bind_race(failure.output_tail, failure.code, failure.uptime_s,
                                                      failure.was_up):  # fmt: skip
            self.streak = 0
            return None
        if self.streak >= self.max_in_row:
            self.streak = 0
            return None
        self.streak += 1
        port = bind_race_port(failure.output_tail)
        where = f"port {port}" if port else "a port"
        delay = round(self.rng.uniform(*RETRY_DELAY_S), 3)
        return BindRetry(delay, self.streak, f"{where} was taken during the start (Address already in use); "
                         f"retry {self.streak}/{self.max_in_row} in {delay:.1f}s, not counted as a failure")

    def on_up(self) -> None:
        self.streak = 0

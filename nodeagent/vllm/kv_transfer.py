"""Pure: KV transfer failures between prefill and decode engines, counted per pair from the logs, and which side
to restart — the one that fails with every peer, never both (vllm-ascend #10224, #7401, #10532).

The lines, from the sources and the issues that quote them:
- vllm-ascend's Mooncake connectors (`mooncake_connector.py`, `mooncake_hybrid_connector.py`), on the decode side
  that pulls the KV: `Mooncake transfer failed for request. remote_request_id=%s, ret=%d.` (older releases:
  `Mooncake transfer failed for request <id>`), `Failed to receive ACK for request. request_id=%s, source=%s:%d.`;
  on the prefill side: `Force freed expired request: %s. Reason: Request exceeded timeout threshold`
  (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT: decode never pulled it).
- Mooncake's AscendDirectTransport (glog): `Connect timeout to: <ip>:<port>`, `Failed to connect to target:
  <ip>:<port>`, `Failed to connect to segment: <ip>:<port>`, `transfer failed and disconnect to:<ip>:<port>`;
  the transfer engine: `Sync batch data transfer timeout after <n>ns`.
A line that names a peer (ip:port) is counted for the pair (this engine, that engine); one that does not is
counted against this engine alone. One failed request is logged by every TP worker and in several lines: events
of one pair within `dedupe_s` count once.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

_AT = r"(?P<host>[\w.\-\[\]:]+?):(?P<port>\d+)\b"
PEER_LINES = (
    ("connect-timeout", re.compile(r"Connect timeout to: ?" + _AT)),
    ("connect-failed", re.compile(r"Failed to connect to (?:target|segment): ?" + _AT)),
    ("transfer-failed", re.compile(r"transfer failed and disconnect to: ?" + _AT)),
    ("no-ack", re.compile(r"Failed to receive ACK for request\. request_id=\S+, source=" + _AT)),
)
LONE_LINES = (
    ("request-failed", re.compile(r"Mooncake transfer failed for request")),
    ("sync-timeout", re.compile(r"Sync batch data transfer timeout after \d+ns")),
    ("expired", re.compile(r"Force freed expired request: \S+\. Reason: Request exceeded timeout threshold")),
)


@dataclass(frozen=True)
class TransferFailure:
    kind: str
    host: str | None = None
    port: int | None = None


def parse_transfer_failure(line: str) -> TransferFailure | None:
    for kind, pattern in PEER_LINES:
        if m := pattern.search(line):
            return TransferFailure(kind, m["host"].strip("[]"), int(m["port"]))
    for kind, pattern in LONE_LINES:
        if pattern.search(line):
            return TransferFailure(kind)
    return None


Resolver = Callable[[str, int], str | None]
"""(peer ip, peer port) → the engine (group) that owns it, or None."""


@dataclass(frozen=True)
class RestartEngine:
    engine: str
    reason: str


@dataclass(frozen=True)
class TransportSuspect:
    """Every pair fails: the network or the transport, not one engine — restarting either side would not help."""

    reason: str


@dataclass
class TransferTimeouts:
    """Counts per (prefill, decode) pair in a sliding window; `decide` names the side to restart."""

    kinds: Mapping[str, str]
    """engine (group name) → prefill | decode."""
    threshold: int = 5
    window_s: float = 300.0
    dedupe_s: float = 1.0
    events: deque[tuple[float, str, str | None]] = field(default_factory=deque)
    """(time, this engine, peer engine or None)."""

    def record(self, engine: str, line: str, now: float, resolve: Resolver | None = None) -> TransferFailure | None:
        """One log line of `engine`; returns what it was (None: not a transfer failure)."""
        failure = parse_transfer_failure(line)
        if failure is None or engine not in self.kinds:
            return failure
        peer = None
        if failure.host is not None and failure.port is not None and resolve is not None:
            peer = resolve(failure.host, failure.port)
            if peer is not None and self.kinds.get(peer) == self.kinds[engine]:
                peer = None  # same kind: not a PD pair (a misattributed port)
        for t, e, p in reversed(self.events):
            if now - t > self.dedupe_s:
                break
            if e == engine and p == peer:
                return failure
        self.events.append((now, engine, peer))
        return failure

    def _trim(self, now: float) -> None:
        while self.events and now - self.events[0][0] > self.window_s:
            self.events.popleft()

    def pair_counts(self, now: float) -> dict[tuple[str, str], int]:
        """(prefill, decode) → failures seen by either side."""
        self._trim(now)
        counts: dict[tuple[str, str], int] = {}
        for _, engine, peer in self.events:
            if peer is None:
                continue
            pair = (engine, peer) if self.kinds[engine] == "prefill" else (peer, engine)
            counts[pair] = counts.get(pair, 0) + 1
        return counts

    def decide(self, now: float) -> list[RestartEngine] | TransportSuspect | None:
        """The engines that fail with every peer of the other kind (>= threshold each) — one side only; None below
        the threshold."""
        counts = self.pair_counts(now)
        prefills = sorted(e for e, k in self.kinds.items() if k == "prefill")
        decodes = sorted(e for e, k in self.kinds.items() if k == "decode")

        def bad_with_all(engine: str, peers: Iterable[str], kind: str) -> bool:
            peers = list(peers)
            pair = (lambda q: (engine, q)) if kind == "prefill" else (lambda q: (q, engine))
            return bool(peers) and all(counts.get(pair(q), 0) >= self.threshold for q in peers)

        bad_p = [p for p in prefills if bad_with_all(p, decodes, "prefill")]
        bad_d = [d for d in decodes if bad_with_all(d, prefills, "decode")]
        if bad_p and bad_d:
            # Both kinds have an engine that fails with all its peers: believe the side that has more peers
            # (4P1D, every pair failing: the one decode is what they share); a tie (1P1D, all of 2P2D) says nothing
            # about one engine.
            if len(decodes) == len(prefills):
                pairs = ", ".join(f"{p}↔{d} {n}" for (p, d), n in sorted(counts.items()))
                return TransportSuspect(f"KV transfers fail on every side ({pairs}): the network or the transport, "
                                        "not one engine")  # fmt: skip
            if len(prefills) > len(decodes):
                bad_p = []
            else:
                bad_d = []
        out = []
        for engine, peers in ((p, decodes) for p in bad_p):
            n = sum(counts[(engine, q)] for q in peers)
            out.append(RestartEngine(engine, f"{n} KV transfer failures in {self.window_s:g}s with every decode "
                                     f"engine ({', '.join(peers)})"))
        for engine in bad_d:
            n = sum(counts[(q, engine)] for q in prefills)
            out.append(RestartEngine(engine, f"{n} KV transfer failures in {self.window_s:g}s with every prefill "
                                     f"engine ({', '.join(prefills)})"))
        return out or None

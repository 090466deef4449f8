"""Pure consistency checks across the cluster's members, as one node sees them through etcd.

Each check returns `Finding`s (code, node, message). Differences are judged against the cluster's reference
value: the most common one, ties broken by what the deployment needs (PYTHONHASHSEED "0", the guide's FAQ) and
then by the master's value — so with two members the odd one is named, not both.

Clock skew, measured honestly with etcd in the middle: when a member writes its key it stamps it with its own
clock (`wall_clock`, read just before sending); this node notes its own clock when the write arrives through its
watch. sample = wall_clock − arrival = (member's offset from us) − (latency: member → etcd → us), and the latency
is never negative, so each sample is a lower bound of the member's offset, off by at most one network path. The
largest of the recent samples is the tightest bound (`ClockSamples`). Only live writes count: a key read from a
snapshot or replayed after a reconnect was written at an unknown earlier time. Offsets are then taken relative to
the cluster's median clock (the lower median for an even count; every observer picks the same member, since
the offsets it sees differ from another observer's only by a constant), so one bad clock — the master's too —
flags that node alone, from whichever node one looks. Two members: the faster clock is the one flagged.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SAMPLE_WINDOW_S = 600.0
SAMPLES_KEPT = 8


@dataclass(frozen=True, order=True)
class Finding:
    code: str
    """pythonhashseed | cluster_hash | version | clock_skew | missing | unknown | duplicate_name | duplicate_rank"""
    node: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "node": self.node, "message": self.message}


@dataclass(frozen=True)
class Expected:
    """A member the cluster file lists."""

    name: str
    ip: str
    role: str
    group: str | None = None
    ranks: tuple[int, int] | None = None
    """(first DP rank, count) in its group."""


@dataclass
class ClockSamples:
    """Recent lower bounds of one member's clock offset from ours (see the module docstring)."""

    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))

    def add(self, arrived_at: float, member_wall_clock: float) -> None:
        self.samples.append((arrived_at, member_wall_clock - arrived_at))

    def estimate(self, now: float) -> float | None:
        recent = [offset for at, offset in self.samples if now - at <= SAMPLE_WINDOW_S]
        return max(recent) if recent else None


def _reference(values: Mapping[str, Any], master: str | None, preferred: Any = None) -> Any:
    counts = Counter(v for v in values.values() if v is not None)
    if not counts:
        return None
    top = max(counts.values())
    leaders = [v for v, n in counts.items() if n == top]
    if preferred in leaders:
        return preferred
    if master is not None and values.get(master) in leaders:
        return values[master]
    return sorted(leaders, key=str)[0]


def _differing(code: str, what: str, values: Mapping[str, Any], master: str | None,
               preferred: Any = None) -> list[Finding]:  # fmt: skip
    ref = _reference(values, master, preferred)
    if ref is None or len(set(values.values())) < 2:
        return []
    return [Finding(code, name, f"{what} {value!r} differs from the cluster's {ref!r}")
            for name, value in sorted(values.items()) if value != ref]  # fmt: skip


def _with_suffix(finding: Finding, suffix: str) -> Finding:
    return Finding(finding.code, finding.node, finding.message + suffix)


def check_hashseed(members: Mapping[str, Mapping[str, Any]], master: str | None) -> list[Finding]:
    """Every vLLM of every node must hash alike, or the KV pool's keys never match ("KV Cache 未找到")."""
    findings, seeds = [], {}
    for name, record in sorted(members.items()):
        per_component = record.get("pythonhashseed") or {}
        if not per_component:
            continue
        values = set(per_component.values())
        if None in values:
            unset = ", ".join(sorted(c for c, v in per_component.items() if v is None))
            findings.append(Finding("pythonhashseed", name, f"PYTHONHASHSEED unset for {unset}: hashing is random "
                                    "per process, the KV pool never hits; set it to 0 on every node"))
            continue
        if len(values) > 1:
            shown = ", ".join(f"{c}={v}" for c, v in sorted(per_component.items()))
            findings.append(Finding("pythonhashseed", name, f"PYTHONHASHSEED differs between this node's vLLMs "
                                    f"({shown})"))
            continue
        seeds[name] = values.pop()
    return findings + [_with_suffix(f, " — the KV pool never hits across them (set 0 everywhere)")
                       for f in _differing("pythonhashseed", "PYTHONHASHSEED", seeds, master, "0")]  # fmt: skip


def check_same(members: Mapping[str, Mapping[str, Any]], master: str | None) -> list[Finding]:
    hashes = {n: r.get("cluster_hash") for n, r in members.items()}
    versions = {n: r.get("version") for n, r in members.items()}
    out = _differing("cluster_hash", "cluster file (hash of its shared sections)", hashes, master)
    return out + _differing("version", "agent version", versions, master)


def check_membership(expected: Iterable[Expected], members: Mapping[str, Mapping[str, Any]],
                     duplicates: Mapping[str, list[Mapping[str, Any]]], missing_ok: bool = False) -> list[Finding]:
    """Listed but absent, present but not listed, and one name claimed by several agents."""
    listed = {e.name: e for e in expected}
    out = []
    if not missing_ok:
        out += [Finding("missing", n, f"{n} ({e.ip}, {e.role}) is in the cluster file but has no member key: "
                        "its agent is down or cannot reach etcd") for n, e in listed.items() if n not in members]
    out += [Finding("unknown", n, f"{n} ({r.get('ip')}) is a member but not in this node's cluster file")
            for n, r in members.items() if n not in listed]  # fmt: skip
    for name, claims in sorted(duplicates.items()):
        holder = members.get(name, {}).get("agent", {})
        others = ", ".join(f"{(c.get('agent') or {}).get('host', '?')} ({c.get('ip')})" for c in claims)
        out.append(Finding("duplicate_name", name, f"node name {name!r} is claimed by several agents: held by "
                           f"{holder.get('host', '?')} ({members.get(name, {}).get('ip')}), also by {others}"))
    return out


def check_ranks(members: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    """Two members of one group claiming an overlapping DP rank range."""
    by_group: dict[str, list[tuple[int, int, str]]] = {}
    for name, record in members.items():
        ranks = record.get("ranks")
        if record.get("group") and isinstance(ranks, Mapping):
            start, count = int(ranks.get("start", 0)), int(ranks.get("count", 0))
            by_group.setdefault(record["group"], []).append((start, start + count, name))
    out = []
    for group, spans in sorted(by_group.items()):
        spans.sort()
        for (s1, e1, n1), (s2, e2, n2) in itertools.pairwise(spans):
            if s2 < e1:
                out.append(Finding("duplicate_rank", n2, f"group {group}: {n2} claims ranks {s2}..{e2 - 1}, "
                                   f"overlapping {n1}'s {s1}..{e1 - 1}"))
    return out


def relative_offsets(offsets: Mapping[str, float]) -> dict[str, float]:
    """Each member's clock offset from the cluster's (lower) median clock."""
    if not offsets:
        return {}
    ordered = sorted(offsets.values())
    ref = ordered[(len(ordered) - 1) // 2]
    return {name: value - ref for name, value in offsets.items()}


def check_clock(offsets: Mapping[str, float], threshold_s: float) -> list[Finding]:
    """offsets: member → its clock's offset from this node's (this node itself: 0); members without a sample
    are left out."""
    if len(offsets) < 2:
        return []
    rel = relative_offsets(offsets)
    return [Finding("clock_skew", name, f"clock {'ahead of' if d > 0 else 'behind'} the cluster's by {abs(d):.2f}s "
                    f"(> {threshold_s:g}s; check NTP: timedatectl)")
            for name, d in sorted(rel.items()) if abs(d) > threshold_s]  # fmt: skip


def check_all(expected: Iterable[Expected], members: Mapping[str, Mapping[str, Any]],
              duplicates: Mapping[str, list[Mapping[str, Any]]], offsets: Mapping[str, float],
              threshold_s: float, missing_ok: bool = False) -> list[Finding]:  # fmt: skip
    expected = list(expected)
    master = next((e.name for e in expected if e.role == "master"), None)
    findings = (check_membership(expected, members, duplicates, missing_ok) + check_hashseed(members, master)
                + check_same(members, master) + check_ranks(members) + check_clock(offsets, threshold_s))  # fmt: skip
    return sorted(set(findings))


def preflight_peers(view: Mapping[str, Any], now: float) -> list[dict[str, Any]]:
    """The other members of a `GET /cluster` view as preflight's peers: each one's hash seed (its vLLMs' seed when
    they agree, else the first that is not 0) and its wall clock as measured through etcd (our clock + offset)."""
    peers = []
    for member in view.get("members") or []:
        if not member.get("present") or member.get("name") == view.get("self"):
            continue
        seeds = {str(v) for v in (member.get("pythonhashseed") or {}).values()}
        seed = "0" if seeds <= {"0"} else next(iter(sorted(seeds - {"0"})))
        peer: dict[str, Any] = {"name": member.get("name"), "pythonhashseed": seed if seeds else None}
        offset = member.get("clock_offset_s")
        if isinstance(offset, int | float):
            peer.update(wall_clock=now + offset, observed_at=now)
        peers.append(peer)
    return peers

"""The fault campaign's checks and figures, computed after the run from its ledger alone (no process, no clock):
what an outside observer can say about the agents (bench/fault_campaign.py records; tests/test_fault_campaign.py
feeds these functions hand-made ledgers as well).

A ledger is plain JSON (times in seconds since the campaign began):

- `requests`: {sent, answered, status (0: no HTTP answer), nonempty, group (the decode group that served it, from
  the stand-in's `system_fingerprint`), error}
- `faults`: {id, cls, target, node, group, planned, injected, healed, detected, recovered}; `recovered` is the
  first moment after the heal the cluster is at full capacity again (every rank answers, the proxy routes every
  group, and a group the fault was on has served a request with tokens since)
- `processes`: {t, event: start|stop, pid, sid, node, role} as /proc showed them (polled)
- `overlaps`: {t, node, sids} — a moment two vLLM trees of one node were alive at once (two generations)
- `stopped_at_end`: {pid, node, role} left in state T once every fault had healed
- `empties`: {t, group} every 200 answer without a token; `attributed`: {t, group, polled} when the agent's PD
  watch asked the instance whose empty answer it counted (its status' `empty_since`), `polled` when the observer
  saw the count (its status' `empty_streaks`)
- `generations`: {t, group, generation, reason, by, backoff_s} each new generation in etcd; `backoff_s`: the group
  restart backoff it was written with (the recovery bound adds it: `backoff_in`)
- `bounds`: {recovery_s, probe_period_s, warmup}: the limits the config gives
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

PLANNED = frozenset({"restart_drain", "rollout", "pause_resume"})
"""Operator operations that must fail no request (the issue's target)."""
RANK = frozenset({"kill_vllm", "stop_vllm", "empty_rank"})
"""Unplanned faults of one rank: they may fail what was in flight on it plus what was sent while undetected."""
RESTART_ROLES = frozenset({"vllm", "datasystem"})
"""The supervised children whose restarts must each have a cause (a fault or a command on the cluster)."""
CAUSE_GRACE_S = 5.0
"""How long after a fault's recovery a start still counts as its consequence (the poll and the last restarts)."""


def window(fault: dict[str, Any], end_of_run: float) -> tuple[float, float]:
    """[injected, the later of healed and recovered]; open faults last to the end of the run."""
    ends = [t for t in (fault.get("healed"), fault.get("recovered")) if t is not None]
    return fault["injected"], max(ends) if ends else end_of_run


def active(faults: Iterable[dict[str, Any]], start: float, end: float, end_of_run: float) -> list[dict[str, Any]]:
    """The faults whose window overlaps [start, end]."""
    out = []
    for f in faults:
        lo, hi = window(f, end_of_run)
        if start <= hi and end >= lo:
            out.append(f)
    return out


def failed(req: dict[str, Any]) -> bool:
    return bool(req["status"] != 200)


def empty(req: dict[str, Any]) -> bool:
    return bool(req["status"] == 200 and not req["nonempty"])


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def unexplained_starts(ledger: dict[str, Any]) -> list[dict[str, Any]]:
    """Starts of a supervised child after warm-up that no fault or command explains: a restart without cause. A
    start is explained by a fault window it falls in, or by the stop it replaces falling in one — a group's backoff
    (10 s and more, stated) or a worker held until etcd answers can put the start past the window (seed 3307: a
    SIGSTOPped rank acted on at 572 s, its group restarted at 583 s, the fault healed at 577 s)."""
    end = ledger["duration"]
    warmup = ledger["bounds"]["warmup"]
    windows = [window(f, end) for f in ledger["faults"]]

    def covered(t: float) -> bool:
        return any(lo <= t <= hi + CAUSE_GRACE_S for lo, hi in windows)

    last_stop: dict[tuple[Any, str], float] = {}
    out = []
    for ev in sorted(ledger["processes"], key=lambda e: e["t"]):
        key = (ev["node"], ev["role"])
        if ev["event"] == "stop":
            last_stop[key] = ev["t"]
            continue
        if ev["event"] != "start" or ev["role"] not in RESTART_ROLES or ev["t"] <= warmup:
            continue
        if not covered(ev["t"]) and not (key in last_stop and covered(last_stop[key])):
            out.append(ev)
    return out


def fault_costs(ledger: dict[str, Any]) -> list[dict[str, Any]]:
    """Per fault: the requests it cost (sent or answered inside its window), detection and recovery times, and its
    target check. Overlapping faults each count a request both saw (said in `overlapped`)."""
    end = ledger["duration"]
    out = []
    for f in ledger["faults"]:
        lo, hi = window(f, end)
        seen = [r for r in ledger["requests"] if r["sent"] <= hi and (r["answered"] or end) >= lo]
        n_failed = sum(1 for r in seen if failed(r))
        n_empty = sum(1 for r in seen if empty(r))
        row: dict[str, Any] = {
            "id": f["id"], "cls": f["cls"], "target": f["target"], "planned": f["cls"] in PLANNED,
            "requests": len(seen), "failed": n_failed, "empty": n_empty,
            "detection_s": None if f.get("detected") is None else round(f["detected"] - f["injected"], 2),
            "full_capacity_s": None if f.get("recovered") is None else round(f["recovered"] - f["injected"], 2),
            "after_heal_s": (None if f.get("recovered") is None or f.get("healed") is None
                             else round(f["recovered"] - f["healed"], 2)),
            "overlapped": [o["id"] for o in active(ledger["faults"], lo, hi, end) if o["id"] != f["id"]],
        }  # fmt: skip
        row["target_ok"], row["check"] = target_check(ledger, f, row)
        out.append(row)
    return out


PROXY_REMOVAL_S = 0.5
"""After the agent acts on a dead rank, the proxy may route to it until the rank's node has removed it: that node's
own `POST /instances/remove` as the supervisor sees the exit (`cluster/proxy_evict.py`) — 0.11 s from the exit to
the proxy's answer in the short campaign (seed 33, a loaded machine), margin for a slower one. It was 2 s (the
member record, then the proxy sync: a killed decode rank answered 5 requests 200-empty in those 1.5 s)."""


def target_check(ledger: dict[str, Any], f: dict[str, Any], row: dict[str, Any]) -> tuple[bool | None, str]:
    """The issue's target for this fault's class: (met, what was checked); None when the class has none. A fault
    that overlapped another is held to the looser of the two (the target is per fault, alone)."""
    if row["overlapped"]:
        return None, "overlapped: no per-fault target"
    if f["cls"] in PLANNED:
        return row["failed"] == 0 and row["empty"] == 0, "planned: 0 requests failed or empty"
    if f["cls"] in RANK:
        # the detection window ends when the agent acts (a restart, a new generation, the proxy's membership), not
        # when it first counts a symptom (the PD watch's first empty answer of `empty_after`)
        detected = next((f[k] for k in ("acted", "detected", "recovered") if f.get(k) is not None), None)
        if detected is None:
            return False, "rank fault never detected"
        group = f.get("group")
        inflight = sum(1 for r in ledger["requests"]
                       if r["sent"] <= f["injected"] <= (r["answered"] or ledger["duration"])
                       and (group is None or r.get("group") in (group, None)))  # fmt: skip
        during = sum(1 for r in ledger["requests"] if f["injected"] <= r["sent"] <= detected + PROXY_REMOVAL_S)
        cost = row["failed"] + row["empty"]
        return cost <= inflight + during, (f"failed+empty {cost} <= in flight {inflight} + sent before it was out "
                                           f"of the proxy {during}")
    return None, "no target for this class"


def empties_attributed(ledger: dict[str, Any]) -> list[dict[str, Any]]:
    """Every group that answered 200-empty: when it did first (per fault window), when the agent attributed it (its
    PD watch asked the instance it counted, or it acted on that group), and whether within one probe period + 0.5 s
    (the probe's prefill request before the decode one is asked, and a round's drift on a loaded machine)."""
    period = ledger["bounds"]["probe_period_s"]
    rows = []
    for f in ledger["faults"]:
        if f["cls"] != "empty_rank":
            continue
        lo, hi = window(f, ledger["duration"])
        first = min((e["t"] for e in ledger["empties"] if lo <= e["t"] <= hi and e["group"] == f["group"]),
                    default=None)  # fmt: skip
        if first is None:
            continue
        # the agent attributes it by counting it (the PD watch) or by acting on the group: a new generation, or
        # the group taken out of the proxy (the rank's own readiness probe can be first)
        times = [a["t"] for a in ledger["attributed"] if a["group"] == f["group"]]
        times += [g["t"] for g in ledger["generations"] if g["group"] == f["group"]]
        kind = "decode" if ledger["proxy"] and f["group"] and f["group"].startswith("d") else "prefill"
        times += [b["t"] for a, b in zip(ledger["proxy"], ledger["proxy"][1:], strict=False) if b[kind] < a[kind]]
        seen = min((t for t in times if t >= lo), default=None)
        lag = None if seen is None else round(max(0.0, seen - first), 2)
        rows.append({"fault": f["id"], "group": f["group"], "first_empty": first, "attributed_after_s": lag,
                     "ok": lag is not None and lag <= period + 0.5})  # fmt: skip
    return rows


def backoff_in(ledger: dict[str, Any], fault: dict[str, Any]) -> float:
    """The longest group restart backoff the agents stated (a generation's `not_before`) while the fault lasted:
    the restart policy's crash-loop backoff is one of the config's bounds — a group that failed again and again
    (faults faster than the policy's `stable_after_s`) waits it before its next start, by design."""
    lo, hi = fault["injected"], fault.get("recovered") or ledger["duration"]
    return max((float(g.get("backoff_s", 0.0)) for g in ledger["generations"] if lo <= g["t"] <= hi), default=0.0)


def invariants(ledger: dict[str, Any]) -> dict[str, list[Any]]:
    """Each outside-visible invariant and its violations (empty list: held)."""
    slow = []
    for f in ledger["faults"]:
        took = None if f.get("recovered") is None else f["recovered"] - (f["healed"] or f["injected"])
        backoff = backoff_in(ledger, f)
        if took is not None and took > ledger["bounds"]["recovery_s"] + backoff:
            slow.append({"fault": f["id"], "cls": f["cls"], "after_heal_s": round(took, 2), "backoff_s": backoff})
    never = [{"fault": f["id"], "cls": f["cls"]} for f in ledger["faults"] if f.get("recovered") is None]
    return {
        "two_generations_alive": list(ledger["overlaps"]),
        "restart_without_cause": unexplained_starts(ledger),
        "stopped_after_heal": list(ledger["stopped_at_end"]),
        "recovery_over_bound": slow,
        "never_recovered": never,
    }


def unattributed_failures(ledger: dict[str, Any]) -> list[dict[str, Any]]:
    """Requests that failed or came back empty while no fault was active: a cost nothing explains."""
    end = ledger["duration"]
    return [r for r in ledger["requests"] if (failed(r) or empty(r))
            and not active(ledger["faults"], r["sent"], r["answered"] or end, end)]  # fmt: skip


def report(ledger: dict[str, Any]) -> dict[str, Any]:
    """Everything the run is judged by: per class (faults, requests failed and empty: median and p95 per fault,
    detection and full-capacity times), the invariants, the targets; `ok` only when all hold."""
    costs = fault_costs(ledger)
    classes: dict[str, dict[str, Any]] = {}
    for cls in sorted({c["cls"] for c in costs}):
        rows = [c for c in costs if c["cls"] == cls]

        def stat(key: str, rows: list[dict[str, Any]] = rows) -> dict[str, Any]:
            vals = [float(r[key]) for r in rows if r[key] is not None]
            return {"median": statistics.median(vals) if vals else None, "p95": pct(vals, 0.95), "n": len(vals)}

        classes[cls] = {"faults": len(rows), "failed": stat("failed"), "empty": stat("empty"),
                        "failed_total": sum(r["failed"] for r in rows), "requests": sum(r["requests"] for r in rows),
                        "detection_s": stat("detection_s"), "full_capacity_s": stat("full_capacity_s")}  # fmt: skip
    inv = invariants(ledger)
    missed = [{"fault": c["id"], "cls": c["cls"], "check": c["check"]} for c in costs if c["target_ok"] is False]
    empties = empties_attributed(ledger)
    late = [e for e in empties if not e["ok"]]
    stray = unattributed_failures(ledger)
    requests = ledger["requests"]
    return {
        "requests": len(requests), "ok_requests": sum(1 for r in requests if not failed(r) and not empty(r)),
        "failed": sum(1 for r in requests if failed(r)), "empty": sum(1 for r in requests if empty(r)),
        "faults": len(ledger["faults"]), "classes": classes, "per_fault": costs, "invariants": inv,
        "violations": sum(len(v) for v in inv.values()), "targets_missed": missed, "empties_attributed": empties,
        "empties_late": late, "unattributed_failures": len(stray),
        "ok": not any(inv.values()) and not missed and not late and not stray,
    }  # fmt: skip


def fill_detection(ledger: dict[str, Any]) -> None:
    """Each fault's `detected`: the first reaction an outsider sees after it — a start of one of its node's children,
    a new generation of its group, a change of the proxy's membership, the PD watch counting its group's empty
    answers — within its window (a cluster-wide fault: any of those anywhere); `acted`: the same without the
    counting (what ends the cost)."""
    end = ledger["duration"]
    for f in ledger["faults"]:
        lo, hi = window(f, end)
        node, group = f.get("node"), f.get("group")
        times = [e["t"] for e in ledger["processes"]
                 if e["event"] == "start" and e["role"] in ("vllm", "datasystem", "proxy")
                 and (node is None or e["node"] == node)]  # fmt: skip
        times += [g["t"] for g in ledger["generations"] if group is None or g["group"] == group]
        times += [p["t"] for p in ledger["proxy"]]
        acted = [t for t in times if lo < t <= hi]
        f["acted"] = min(acted) if acted else None
        times += [a["t"] for a in ledger["attributed"] if group is None or a["group"] == group]
        seen = [t for t in times if lo < t <= hi]
        f["detected"] = min(seen) if seen else None

"""`nodeagentctl cluster` and `nodeagentctl --node NAME status`: the cluster as the local agent sees it through
etcd, and another member's status. Standard library only (HTTP through `nodeagent.cli.http`: the CLI stays
fast); no etcd client here — the local agent's `GET /cluster` holds every member key, and each key names its
agent's API URL.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from typing import Any

from nodeagent.cli import http
from nodeagent.cli.common import pause_line, short_age
from nodeagent.cluster.rollout.states import outage_text, under_way

REMOTE_TIMEOUT_S = 3.0


def _ranks(ranks: Any) -> str:
    if not isinstance(ranks, dict) or not ranks.get("count"):
        return "-"
    start, count = int(ranks.get("start", 0)), int(ranks["count"])
    return str(start) if count == 1 else f"{start}-{start + count - 1}"


def _components(comps: Any) -> str:
    if not isinstance(comps, dict) or not comps:
        return "-"
    return " ".join(f"{name}:{(c or {}).get('state', '?')}{_load(c or {})}" for name, c in comps.items())


def _load(comp: dict[str, Any]) -> str:
    """`(~12 min left)` while loading, `(load 31m)` after: what a restart of it costs."""
    if comp.get("load"):
        return f"({comp['load']})"
    last = comp.get("last_load_s")
    return f"(load {short_age(last)})" if isinstance(last, int | float) else ""


def _generation(member: dict[str, Any]) -> str:
    """The generation of its group this member runs, as its own record says (`2`, or `3 barrier` while its ranks
    wait for the group's start barrier): after a gang restart every member of the group shows the same number."""
    gang = (member.get("gangs") or {}).get(member.get("group"))
    if not isinstance(gang, dict) or not isinstance(gang.get("generation"), int):
        return "-"
    return f"{gang['generation']}{'' if gang.get('released', True) else ' barrier'}"


def etcd_line(etcd: dict[str, Any], now: float) -> str:
    state = etcd.get("state", "?")
    text = f"etcd {state} ({etcd.get('endpoint')}"
    since = etcd.get("since")
    if isinstance(since, int | float) and state != "unknown":
        text += f", for {short_age(now - since)}"
    text += ")"
    if state != "reachable" and etcd.get("last_error"):
        text += f": {etcd['last_error']}"
    return text


def format_cluster(view: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    warnings = view.get("warnings") or []
    codes: dict[str, list[str]] = {}
    for w in warnings:
        codes.setdefault(w.get("node", "?"), []).append(w.get("code", "?"))
    head = f"cluster {view.get('cluster')} · seen from {view.get('self')} · {etcd_line(view.get('etcd') or {}, now)}"
    lines = [head]
    pause = (view.get("coordination") or {}).get("pause")
    if pause:
        lines.append(pause_line(pause, now))
    if not view.get("view_complete"):
        lines.append("(etcd not read yet: the member list may be incomplete)")
    rows = [("NAME", "IP", "ROLE", "GROUP", "GEN", "RANKS", "VERSION", "COMPONENTS", "SEEN", "WARNINGS")]
    for m in view.get("members") or []:
        name = str(m.get("name"))
        if not m.get("present"):
            comps, seen, version, gen = "(no member key)", "-", "-", "-"
        else:
            comps, version, gen = _components(m.get("components")), str(m.get("version")), _generation(m)
            seen = f"{short_age(m.get('age_s'))} ago"
        if not m.get("listed", True):
            name += " (not in file)"
        rows.append((name, str(m.get("ip") or "-"), str(m.get("role") or "-"), str(m.get("group") or "-"), gen,
                     _ranks(m.get("ranks")), version, comps, seen, ",".join(codes.get(str(m.get("name")), [])) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if warnings:
        lines += ["", f"{len(warnings)} warning{'s' if len(warnings) != 1 else ''}:"]
        lines += [f"  {w.get('node')}: {w.get('code')}: {w.get('message')}" for w in warnings]
    if view.get("rollout"):
        lines += ["", *rollout_lines(view["rollout"], now)]
    return "\n".join(lines)


def find_member(view: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in view.get("members") or [] if m.get("name") == name), None)


def fetch_status(api_url: str, timeout: float = REMOTE_TIMEOUT_S) -> dict[str, Any]:
    """GET API_URL/status; OSError / ValueError / http.BadResponse when it does not answer properly."""
    url = urllib.parse.urlsplit(api_url)
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"unsupported API URL {api_url!r}")
    status, body = http.request(url.hostname, url.port or 80, "GET", "/status", None,
                                {"Accept": "application/json"}, timeout)  # fmt: skip
    if status != 200:
        raise ValueError(f"HTTP {status}")
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("not a status object")
    return data


def remote_status(view: dict[str, Any], name: str) -> tuple[str, dict[str, Any], str | None]:
    """("api", its /status, None) when its agent answered, else ("member_key", its member record, why not).

    A KeyError names the members when `name` has no member key."""
    member = find_member(view, name)
    if member is None or not member.get("present"):
        listed = member is not None
        known = ", ".join(str(m.get("name")) for m in view.get("members") or [] if m.get("present"))
        why = "has no member key (its agent is down or cannot reach etcd)" if listed else "is not a member"
        raise KeyError(f"node {name!r} {why} (members with a key: {known or 'none'})")
    url = member.get("api_url")
    if not url:
        return "member_key", member, "its API listens on loopback only (agent.api.listen), unreachable from here"
    try:
        data = fetch_status(url)
    except (OSError, ValueError, http.BadResponse) as exc:
        return "member_key", member, f"its API at {url} did not answer: {getattr(exc, 'strerror', None) or exc}"
    if (data.get("node") or {}).get("name") != name:
        got = (data.get("node") or {}).get("name")
        return "member_key", member, f"the agent at {url} is {got!r}, not {name!r}"
    return "api", data, None


def format_member_status(member: dict[str, Any], reason: str) -> str:
    lines = [f"node {member.get('name')} ({member.get('role')}) · {member.get('ip')} · agent {member.get('version')}",
             f"from its member key in etcd, written {short_age(member.get('age_s'))} ago — {reason}", ""]
    rows = [("COMPONENT", "STATE", "PID", "READY", "NOTE")]
    for name, c in (member.get("components") or {}).items():
        c = c or {}
        rows.append((name, str(c.get("state")), str(c.get("pid") or "-"), "yes" if c.get("ready") else "no",
                     str((c.get("hold") or {}).get("reason") or "")))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _minutes(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "unknown"
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


FILES_WAIT_MIN = 15
"""`cluster.rollout.rules.FILES_WAIT_S` in minutes (the CLI imports no rollout rules)."""


def format_plan(plan: dict[str, Any]) -> str:
    """`nodeagentctl cluster rollout FILE [--dry-run]`: what changes and why, the steps, and why it cannot run."""
    lines = [f"rollout {plan.get('old_hash', '')[:12]} → {plan.get('new_hash', '')[:12]}"]
    for change in plan.get("changes") or []:
        lines.append(f"  {change['group']} ({change['kind']}, {', '.join(change['nodes'])}) changes:")
        lines += [f"      {why}" for why in change["reasons"][:12]]
        if len(change["reasons"]) > 12:
            lines.append(f"      … {len(change['reasons']) - 12} more")
    if plan.get("unchanged"):
        lines.append(f"  unchanged: {', '.join(plan['unchanged'])}")
    for why in plan.get("incompatible") or []:
        lines.append(f"  incompatible: {why}")
    if plan.get("exclusive"):
        gap = plan.get("switch_gap_s")
        lines.append("  never routed together: old and new groups are kept apart in the proxy" + (
            f"; at the switch it holds no group for ~{_minutes(gap)}" if gap is not None else ""))
    for i, step in enumerate(plan.get("steps") or [], 1):
        note = f"  ({step['note']})" if step.get("note") else ""
        lines.append(f"  step {i}: {', '.join(step['groups'])}{note}")
    for note in plan.get("notes") or []:
        lines.append(f"  note: {note}")
    have, missing = plan.get("have_new_file"), plan.get("missing_new_file") or {}
    if have is not None:
        lines.append(f"  members with the new file: {len(have)} of {len(have) + len(missing)} "
                     f"({', '.join(have) or 'none yet'})")
    if missing:
        lines.append("  WITHOUT the new file (install it there: a step waits for its members' file and halts after "
                     f"{FILES_WAIT_MIN} min): " + ", ".join(f"{n} (has {h})" for n, h in sorted(missing.items())))
    for why in plan.get("refused") or []:
        lines.append(f"  REFUSED: {why}")
    if plan.get("started"):
        lines.append(f"stored as rollout {plan.get('id')}: `nodeagentctl cluster rollout status` follows it")
    elif plan.get("ok"):
        lines.append("dry run: nothing stored")
    return "\n".join(lines)


def rollout_lines(rollout: dict[str, Any] | None, now: float | None = None) -> list[str]:
    """The rollout in progress (or the last one): status, the step and its phase, the floor, the time left."""
    if not rollout:
        return ["rollout: none"]
    now = time.time() if now is None else now
    steps = rollout.get("steps") or []
    current = rollout.get("current")
    head = f"rollout {rollout.get('id')}: {rollout.get('status')}"
    if current is not None and current < len(steps):
        step = steps[current]
        since = step.get("since")
        age = f" for {short_age(now - since)}" if isinstance(since, int | float) and since else ""
        head += f", step {current + 1}/{len(steps)} {', '.join(step['groups'])} {step['phase']}{age}"
    lines = [head, f"  {rollout.get('message', '')}"]
    if under_way(rollout.get("status")):
        lines.append(f"  floor: {rollout.get('floor')}; time left: {_minutes(rollout.get('time_left_s'))}")
        held = rollout.get("held_out") or {}
        if held:
            lines.append("  out of the proxy: " + "; ".join(f"{g} ({why})" for g, why in held.items()))
    for i, step in enumerate(steps, 1):
        extra = f" — {step['failed']}" if step.get("failed") else ""
        kind = "rollback " if step.get("rollback") else ""
        note = f" ({step['note']})" if step.get("note") and step.get("note") != "rollback" else ""
        outage = outage_text(step)  # measured vs expected, once the step is back in the proxy
        lines.append(f"  {i}. {kind}{', '.join(step['groups'])}: {step['phase']}{extra}{note}"
                     + (f" — {outage}" if outage else ""))
    return lines

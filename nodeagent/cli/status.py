"""`nodeagentctl status`: this node's components as a table (`--wide`: NOTE and LAST EXIT whole), its JSON, or
another member's status in the same shape (`--node NAME`)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from nodeagent.api.node_alerts import container_line, node_alerts
from nodeagent.cli.agentconfig import Client, connect
from nodeagent.cli.common import (
    EXIT_UNKNOWN,
    EXIT_USAGE,
    CliError,
    error_text,
    human_duration,
    pause_line,
    table,
)
from nodeagent.vllm.warm_plan import gb

LAST_EXIT_WIDTH = 48
OUTPUT_WIDTH = 100


def _cut(text: str, width: int | None) -> str:
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


def _last_exit(exit_info: dict[str, Any] | None, now: float, wide: bool = False) -> str:
    if not exit_info:
        return "-"
    text = _cut(str(exit_info.get("reason") or exit_info.get("code") or "?"), None if wide else LAST_EXIT_WIDTH)
    at = exit_info.get("at")
    return f"{human_duration(now - at)} ago: {text}" if isinstance(at, int | float) else text


def _restarts(comp: dict[str, Any]) -> str:
    """`3 (crash 1, gang 2)`: the total, and what it was for when the agent says (its order: `RESTART_CAUSES`)."""
    by_cause = ", ".join(f"{cause} {n}" for cause, n in (comp.get("restarts_by_cause") or {}).items() if n)
    return f"{comp.get('restarts', 0)}" + (f" ({by_cause})" if by_cause else "")


def _note(comp: dict[str, Any], wide: bool = False) -> str:
    notes = []
    if comp.get("desired") == "stopped":
        notes.append("desired stopped")
    if comp.get("backoff_remaining_s"):
        notes.append(f"retry in {human_duration(comp['backoff_remaining_s'])}")
    if comp.get("held"):
        notes.append(str(comp["held"]))
    load = comp.get("load") or {}
    if load.get("loading_s") is not None or (load and comp.get("kind") == "vllm" and comp.get("state") != "stopped"):
        notes.append(str(load.get("note")))  # loading (how long left), or for vLLM what its last load took
    if (comp.get("start_phase") or {}).get("note") and comp.get("state") == "starting":
        notes.append(str(comp["start_phase"]["note"]))  # the phase a loading vLLM is in (`start_phases`)
    failure = comp.get("failure") or {}
    if comp.get("state") == "failed" and failure:
        notes.append(f"failed: {failure.get('permanent') or failure.get('detail')}")
        last = next((line for line in reversed(failure.get("output_tail") or []) if line.strip()), None)
        if last and last not in notes[-1]:
            notes.append(f"last output: {last if wide else last[:OUTPUT_WIDTH]}")
    policy = comp.get("policy") or {}
    if policy.get("crash_loop"):
        notes.append("crash loop")
    return "; ".join(notes)


def format_mqtt(mqtt: dict[str, Any], now: float) -> str:
    """`mqtt: connected to mqtt://h:1883 · queued 0 · dropped 0` or `mqtt: DISCONNECTED from ...: <error> · ...`."""
    if mqtt.get("connected"):
        since = mqtt.get("connected_since")
        link = f"connected to {mqtt.get('broker')}" + (f" for {human_duration(now - since)}" if since else "")
    else:
        link = f"DISCONNECTED from {mqtt.get('broker')}: {mqtt.get('last_error') or 'connecting'}"
    return f"mqtt: {link} · queued {mqtt.get('queued', 0)} · dropped {mqtt.get('dropped', 0)}"


def format_fault_tolerance(groups: dict[str, Any]) -> list[str]:
    """One line per group whose FT rung is not quietly watching: a fault under way, or a vLLM that cannot."""
    lines = []
    for name, g in groups.items():
        if g.get("rung") == "watching":
            continue
        last = (g.get("ladder") or [{}])[-1]
        why = g.get("reason") if g.get("rung") == "unsupported" else last.get("detail", "")
        lines.append(f"fault tolerance {name}: {g.get('rung')} — {why} (recovered {g.get('recovered', 0)}, "
                     f"escalated {g.get('escalated', 0)})")
    return lines


def format_weights(weights: dict[str, Any]) -> list[str]:
    """`weights: 12 GB of 310 GB resident · reading ≤ 500 MB/s · <the plan's reason>` and a line per model that
    cannot be warmed; nothing without shards."""
    lines = [f"weights {m['model']}: {m['problem']}" for m in weights.get("models") or [] if m.get("problem")]
    if weights.get("total_bytes"):
        parts = [f"weights: {gb(weights.get('resident_bytes', 0))} of {gb(weights['total_bytes'])} resident"]
        if weights.get("state") == "reading":
            parts.append(f"reading ≤ {weights.get('rate_mb_s')} MB/s")
        if weights.get("plan"):
            parts.append(str(weights["plan"]))
        lines.insert(0, " · ".join(parts))
    return lines


def format_status(data: dict[str, Any], now: float | None = None, wide: bool = False) -> str:
    """The table; `wide`: LAST EXIT and NOTE whole (the terminal wraps them) instead of cut with `…`."""
    now = time.time() if now is None else now
    node, agent = data.get("node", {}), data.get("agent", {})
    head = (f"node {node.get('name')} ({node.get('role')}) · cluster {node.get('cluster')} · agent "
            f"{agent.get('version', '?')} pid {agent.get('pid', '?')} up {human_duration(agent.get('uptime_s'))}")
    flags = node_alerts(data)
    if data.get("paused"):
        flags.append(pause_line(data["pause"], now) if data.get("pause") else "PAUSED (no automatic restarts)")
    if data.get("redeploying"):
        flags.append("REDEPLOYING")
    policy = data.get("node_policy") or {}
    if policy.get("failed"):
        flags.append(f"NODE FAILED: {policy.get('failed_reason')}")
    if agent.get("stopping"):
        flags.append("AGENT STOPPING")
    if data.get("mqtt"):
        flags.append(format_mqtt(data["mqtt"], now))
    flags += format_fault_tolerance(data.get("fault_tolerance") or {})
    flags += format_weights(data.get("weights") or {})
    if data.get("container"):
        flags.append(container_line(data["container"]))
    if (caches := data.get("caches") or {}).get("enabled") and (caches.get("keys") or caches.get("unkeyed")):
        flags.append(caches_line(data["caches"]))
    rows = [("COMPONENT", "STATE", "PID", "READY", "RESTARTS", "UPTIME", "LAST EXIT", "NOTE")]
    for name, comp in data.get("components", {}).items():
        rows.append((name, str(comp.get("state")), str(comp.get("pid") or "-"), "yes" if comp.get("ready") else "no",
                     _restarts(comp), human_duration(comp.get("uptime_s")),
                     _last_exit(comp.get("last_exit"), now, wide),
                     _note({**comp, "start_phase": (data.get("start_phases") or {}).get(name)}, wide)))  # fmt: skip
    return "\n".join([head, *flags, "", *table(rows)])


def caches_line(caches: dict[str, Any]) -> str:
    """`compile caches /var/lib/dsv4-agent/cache: 12.4 GB (cap 200 GB), 2 stacks, in use 0.32.0-… (vllm)`."""
    keys = caches.get("keys") or []
    text = (f"compile caches {caches.get('dir')}: {caches.get('bytes', 0) / 1e9:.1f} GB "
            f"(cap {caches.get('max_bytes', 0) / 1e9:.0f} GB), {len(keys)} stack{'s' if len(keys) != 1 else ''}")
    used = [f"{k['key']} ({', '.join(k['used_by'])})" for k in keys if k.get("used_by")]
    if used:
        text += ", in use " + "; ".join(used)
    for name, why in (caches.get("unkeyed") or {}).items():
        text += f" · {name}: none ({why})"
    if caches.get("error"):
        text += f" · {caches['error']}"
    return text


def cluster_view(api: Client) -> dict[str, Any]:
    status, data = api.request("GET", "/cluster")
    if status == 404:
        raise CliError(f"{error_text(data, status)}: --node and cluster need cluster.nodes", EXIT_USAGE)
    if status != 200:
        raise CliError(f"GET /cluster: {error_text(data, status)}")
    return data


def member_key_status(member: dict[str, Any]) -> dict[str, Any]:
    """A member key in the shape of GET /status (what it does not say is absent or null)."""
    comps = {}
    for name, c in (member.get("components") or {}).items():
        c = c or {}
        hold = {"held": c["hold"].get("reason"), "hold": c["hold"]} if c.get("hold") else {}
        comps[name] = {"state": c.get("state"), "pid": c.get("pid"), "ready": bool(c.get("ready")), **hold}
    return {"node": {"name": member.get("name"), "role": member.get("role"), "ip": member.get("ip"),
                     "group": member.get("group")},
            "agent": {"version": member.get("version")}, "components": comps}  # fmt: skip


def _remote_status(api: Client, node: str, as_json: bool, wide: bool) -> int:
    """Another member's status: from its own API when it answers, else what its member key says (and why)."""
    from nodeagent.cli.remote import format_member_status, remote_status

    try:
        source, data, reason = remote_status(cluster_view(api), node)
    except KeyError as exc:
        raise CliError(str(exc.args[0]), EXIT_UNKNOWN) from None
    if as_json:
        remote: dict[str, Any] = {"source": source, "reason": reason}
        if source != "api":
            remote["member"] = data
        shaped = data if source == "api" else member_key_status(data)
        print(json.dumps({**shaped, "remote": remote}, indent=2))
    elif source == "api":
        print(format_status(data, wide=wide))
    else:
        print(format_member_status(data, reason or ""))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    api = connect(args)
    node = getattr(args, "node", None)
    data = api.get("/status")
    if node and node != (data.get("node") or {}).get("name"):
        return _remote_status(api, node, args.json, args.wide)
    print(json.dumps(data, indent=2) if args.json else format_status(data, wide=args.wide))
    return 0

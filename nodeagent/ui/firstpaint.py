"""The status page's first paint, rendered on the server: the node, its flags and the component table filled in
from the same data as `/status`, so `curl /ui`, a text browser or a screenshot tool sees the state without
JavaScript. `ui.js` then takes over and redraws every part from `/status` as before.

Every value is inserted as escaped text (`html.escape`): member records arrive from other nodes through etcd, and
nothing from them may become markup.
"""

from __future__ import annotations

import time
from html import escape
from typing import Any

from nodeagent.node_alerts import node_alerts

TBODY = '<table id="components">'


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "—"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def component_note(c: dict[str, Any]) -> str:
    """The NOTE column, as ui.js's componentNote writes it."""
    if c.get("held"):
        return f"held: {c['held']}"
    failure = c.get("failure")
    if failure:
        permanent = f" (permanent: {failure['permanent']})" if failure.get("permanent") else ""
        return f"failed: {failure.get('what', '')} — {failure.get('detail', '')}{permanent}"
    if c.get("backoff_remaining_s"):
        return f"backoff: next try in {_duration(c['backoff_remaining_s'])}"
    load = c.get("load") or {}
    if load.get("loading_s") is not None:
        return str(load.get("note"))
    blockers = c.get("ready_blockers") or {}
    if blockers:
        return "not ready: " + "; ".join(f"{k}: {v}" for k, v in blockers.items())
    policy = c.get("policy") or {}
    if policy.get("crash_loop"):
        return f"crash loop ({policy.get('failures_in_window', 0)} failures)"
    if c.get("kind") == "vllm" and load:
        return str(load.get("note"))
    return ""


def component_rows(status: dict[str, Any]) -> str:
    rows = []
    for name, c in (status.get("components") or {}).items():
        exit_ = (c.get("last_exit") or {}).get("reason") or "—"
        cells = [
            ("name", f"<b>{escape(name)}</b> <span class=\"muted\">{escape(str(c.get('kind', '')))}</span>"),
            ("state", escape(str(c.get("state", ""))) + ("" if c.get("ready") else " <span class=\"muted\">not ready"
                                                         "</span>")),
            ("desired", escape(str(c.get("desired") or ""))),
            ("pid", escape(str(c.get("pid") if c.get("pid") is not None else "—"))),
            ("uptime", escape(_duration(c.get("uptime_s")))),
            ("restarts", escape(str(c.get("restarts", 0)))),
            ("last_exit", escape(str(exit_))),
            ("note", escape(component_note(c))),
            ("probes", ""),
        ]  # fmt: skip
        tds = "".join(f'<td data-field="{field}">{value}</td>' for field, value in cells)
        rows.append(f'<tr data-component="{escape(name, quote=True)}">{tds}</tr>')
    return "".join(rows)


def first_paint(page: str, status: dict[str, Any], now: float | None = None) -> str:
    """The page template with the node's state written in (the template is untouched where a marker is
    missing: the page still works, it only paints later)."""
    node = status.get("node") or {}
    meta = " · ".join(str(node[k]) for k in ("role", "ip", "cluster") if node.get(k))
    name = escape(str(node.get("name") or "dsv4-agent"))
    page = page.replace('<span id="node">dsv4-agent</span>', f'<span id="node">{name}</span>', 1)
    page = page.replace('<span id="node-meta" class="muted"></span>',
                        f'<span id="node-meta" class="muted">{escape(meta)}</span>', 1)
    flags = []
    pause = status.get("pause")
    if status.get("paused"):
        who = f" by {pause.get('by', '?')}" if isinstance(pause, dict) else ""
        flags.append(f"PAUSED{who} (no automatic restarts)")
    if status.get("redeploying"):
        flags.append("REDEPLOYING")
    if (status.get("node_policy") or {}).get("failed"):
        flags.append(f"NODE FAILED: {status['node_policy'].get('failed_reason') or ''}")
    page = page.replace('<span id="node-flags"></span>',
                        f'<span id="node-flags">{escape(" · ".join(flags))}</span>', 1)
    alerts = node_alerts(status)
    if alerts:
        lines = "".join(f"<div>{escape(line)}</div>" for line in alerts)
        page = page.replace('<div id="node-alerts" class="alerts" hidden></div>',
                            f'<div id="node-alerts" class="alerts">{lines}</div>', 1)
    stamp = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    page = page.replace('<div id="conn" class="conn">connecting…</div>',
                        f'<div id="conn" class="conn">as of {stamp} (server render; live once scripts run)</div>', 1)
    at = page.find(TBODY)
    if at >= 0:
        body = page.find("<tbody></tbody>", at)
        if body >= 0:
            page = page[:body] + f"<tbody>{component_rows(status)}</tbody>" + page[body + len("<tbody></tbody>"):]
    return page

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

from nodeagent.api.node_alerts import container_line, node_alerts
from nodeagent.cluster.rollout.states import outage_text, under_way

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


def js_dur(seconds: Any) -> str:
    """As ui.js's `dur`: the rollout box reads the same before and after the script runs."""
    if not isinstance(seconds, int | float) or seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "—"
    s = max(0, int(seconds + 0.5))
    if s < 60:
        return f"{s}s"
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d {h}h" if d else f"{h}h {m}m" if h else f"{m}m {s}s"


def rollout_texts(r: dict[str, Any]) -> dict[str, str]:
    """The rollout box's lines as ui.js's renderRollout writes them: meta, floor, message."""
    steps = r.get("steps") or []
    cur = r.get("current")
    where = ""
    if isinstance(cur, int) and 0 <= cur < len(steps):
        where = f" · step {cur + 1}/{len(steps)} {', '.join(steps[cur].get('groups') or [])} {steps[cur].get('phase')}"
    floor = ""
    if under_way(r.get("status")):
        floor = f"floor: {r.get('floor') or '?'} · time left {js_dur(r.get('time_left_s'))}"
        if r.get("held_out"):
            floor += f" · out of the proxy: {', '.join(r['held_out'])}"
    return {"meta": f"{r.get('id')} · {r.get('status')}{where}", "floor": floor, "message": str(r.get("message") or "")}


def rollout_rows(r: dict[str, Any], now: float) -> str:
    rows = []
    for i, s in enumerate(r.get("steps") or [], 1):
        cls = "ok" if s.get("phase") == "done" else "failed" if s.get("failed") else "starting"
        since = f"{js_dur(now - s['since'])} ago" if isinstance(s.get("since"), int | float) and s["since"] else "—"
        note = " · ".join(x for x in ("rollback" if s.get("rollback") else "", s.get("failed") or "",
                                      s.get("note") or "", outage_text(s)) if x)  # fmt: skip
        rows.append(f'<tr data-step="{i}"><td class="num">{i}</td>'
                    f'<td data-field="groups">{escape(", ".join(s.get("groups") or []))}</td>'
                    f'<td data-field="phase"><span class="badge s-{cls}">{escape(str(s.get("phase")))}</span></td>'
                    f'<td data-field="since">{escape(since)}</td><td data-field="note" class="note">{escape(note)}</td>'
                    "</tr>")  # fmt: skip
    return "".join(rows)


def rollout_box(page: str, rollout: dict[str, Any] | None, now: float) -> str:
    """The rollout in progress (or the last one), as the live page shows it: the plan's steps, the step, the
    floor (what serves per kind) and the time left."""
    if not rollout:
        return page
    texts = rollout_texts(rollout)
    page = page.replace('<div id="rollout" hidden>', '<div id="rollout">', 1)
    for key in ("meta", "floor", "message"):
        for marker in (f'<span class="muted" id="rollout-{key}"></span>', f'<div id="rollout-{key}"></div>',
                       f'<div id="rollout-{key}" class="muted"></div>'):  # fmt: skip
            page = page.replace(marker, marker.replace("></", f">{escape(texts[key])}</", 1), 1)
    at = page.find('<table id="rollout-steps">')
    body = page.find("<tbody></tbody>", at) if at >= 0 else -1
    if body >= 0:
        page = page[:body] + f"<tbody>{rollout_rows(rollout, now)}</tbody>" + page[body + len("<tbody></tbody>"):]
    return page


def first_paint(page: str, status: dict[str, Any], now: float | None = None,
                rollout: dict[str, Any] | None = None) -> str:  # fmt: skip
    """The page template with the node's state written in (the template is untouched where a marker is
    missing: the page still works, it only paints later). `rollout`: /cluster's rollout view, when any."""
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
    if status.get("container"):
        line = escape(container_line(status["container"]))
        page = page.replace('<div id="container-line" class="muted" hidden></div>',
                            f'<div id="container-line" class="muted">{line}</div>', 1)
    stamp = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    page = page.replace('<div id="conn" class="conn">connecting…</div>',
                        f'<div id="conn" class="conn">as of {stamp} (server render; live once scripts run)</div>', 1)
    at = page.find(TBODY)
    if at >= 0:
        body = page.find("<tbody></tbody>", at)
        if body >= 0:
            page = page[:body] + f"<tbody>{component_rows(status)}</tbody>" + page[body + len("<tbody></tbody>"):]
    return rollout_box(page, rollout, now if now is not None else time.time())

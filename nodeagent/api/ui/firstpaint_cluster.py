"""The status page's cluster section in the first paint: the member table, the gangs and the etcd line written in
on the server from the same view as `GET /cluster`, as ui.js's renderCluster writes them — a screenshot at load
shows the members, not an empty table until the first poll. Every value is escaped: member records come from
other nodes through etcd."""

from __future__ import annotations

import json
from html import escape
from typing import Any

from nodeagent.api.ui.firstpaint import js_dur as _dur

SINGLE_NODE = ("Single-node config: this config lists no cluster.nodes, so there is no cluster table (members, "
               "groups, gangs).")  # fmt: skip
"""ui.js's note where /status has no cluster section."""


def cluster_meta(view: dict[str, Any]) -> str:
    etcd = view.get("etcd") or {}
    text = f"{view.get('cluster')} · seen from {view.get('self')} · etcd {etcd.get('state') or '?'}"
    if etcd.get("endpoint"):
        text += f" ({etcd['endpoint']})"
    if etcd.get("last_error") and etcd.get("state") != "reachable":
        text += f": {etcd['last_error']}"
    return text + ("" if view.get("view_complete") else " · view not complete yet")


def _member_components(record: dict[str, Any]) -> str:
    parts = []
    for name, c in (record.get("components") or {}).items():
        load = f" ({c['load']})" if c.get("load") else (f" (load {_dur(c['last_load_s'])})"
                                                         if c.get("last_load_s") is not None else "")
        parts.append(f"{name} {c.get('state')}{' ✓' if c.get('ready') else ''}{load}")
    return " · ".join(parts)


def _class(cls: str) -> str:
    return f' class="{cls}"' if cls else ""


def _td(field: str, content: str, cls: str = "") -> str:
    return f'<td data-field="{field}"{_class(cls)}>{content}</td>'


def member_rows(view: dict[str, Any]) -> str:
    by_node: dict[str, list[str]] = {}
    for w in view.get("warnings") or []:
        by_node.setdefault(str(w.get("node")), []).append(str(w.get("code")))
    me = view.get("self")
    rows = []
    for m in view.get("members") or []:
        name = str(m.get("name"))
        cls = " ".join(c for c in ("" if m.get("present") else "missing", "self" if name == me else "") if c)
        ranks = m.get("ranks")
        span = "—" if not ranks else (f"{ranks['start']}–{ranks['start'] + ranks['count'] - 1}"
                                      if ranks.get("count", 1) > 1 else f"{ranks['start']}")
        url = escape(str(m.get("api_url")), quote=True)
        link = (f' <a href="{url}/ui" title="this member&#x27;s own status page">↗</a>'
                if m.get("present") and m.get("api_url") and name != me else "")  # fmt: skip
        offset = m.get("clock_offset_s")
        offset_text = "—" if not isinstance(offset, int | float) else f"{'+' if offset >= 0 else ''}{offset:.3f} s"
        present = ('<span class="badge s-ok">present</span>' if m.get("present")
                   else '<span class="badge s-missing">missing</span>')  # fmt: skip
        name_cell = (f"{escape(name)}" + (' <span class="muted">(this node)</span>' if name == me else "") + link
                     + (' <span class="note">(not in the cluster file)</span>' if m.get("listed") is False else ""))
        tds = "".join((
            _td("name", name_cell), _td("role", escape(str(m.get("role") or ""))),
            _td("ip", escape(str(m.get("ip") or "")), "mono"), _td("group", escape(str(m.get("group") or "—"))),
            _td("ranks", escape(span)), _td("present", present),
            _td("age", escape(_dur(m.get("age_s")) if m.get("present") else "—"), "num"),
            _td("offset", escape(offset_text), "num"),
            _td("components", escape(_member_components(m)) if m.get("present") else ""),
            _td("warnings", escape(", ".join(by_node.get(name, []))), "note"),
        ))  # fmt: skip
        rows.append(f'<tr{_class(cls)} data-member="{escape(name, quote=True)}">{tds}</tr>')
    return "".join(rows)


def gang_rows(view: dict[str, Any]) -> str:
    rows = []
    for name, g in ((view.get("coordination") or {}).get("gangs") or {}).items():
        barrier = g.get("barrier") or {}
        arrived = barrier.get("arrived") or []
        if barrier.get("released"):
            text = "released" + (f" · arrived: {', '.join(arrived)}" if arrived else "")
        elif not arrived:
            text = "—"
        else:
            waiting = [n for n in g.get("nodes") or [] if n not in arrived]
            text = f"waiting for {', '.join(waiting) or 'release'} · arrived: {', '.join(arrived)}"
        acted = f"acted on {g['acted']}" if g.get("acted") is not None else ""
        state = " · ".join(s for s in ("restart pending" if g.get("pending") else "",
                                       "crash loop" if g.get("crash_loop") else "", acted) if s)  # fmt: skip
        by = f" (by {g['by']})" if g.get("by") else ""
        reason = f"{g['reason']}{by}" if g.get("reason") else "—"
        generation = g.get("generation")
        tds = "".join((
            _td("name", escape(str(name))), _td("kind", escape(str(g.get("kind") or ""))),
            _td("nodes", escape(", ".join(g.get("nodes") or []))),
            _td("generation", escape(str(generation if generation is not None else "—")), "num"),
            _td("reason", escape(reason)), _td("barrier", escape(text)), _td("state", escape(state or "—")),
        ))  # fmt: skip
        rows.append(f'<tr data-gang="{escape(str(name), quote=True)}">{tds}</tr>')
    return "".join(rows)


def coordination_extra(view: dict[str, Any]) -> str:
    co = view.get("coordination") or {}
    extra = []
    if co.get("etcd"):
        extra.append(f"coordination: etcd {co['etcd']}")
    if co.get("pause"):
        pause = co["pause"]
        extra.append(f"cluster paused by {pause.get('by') or '?'}" + (f": {pause['reason']}" if pause.get("reason")
                                                                      else ""))  # fmt: skip
    if co.get("redeploy"):
        extra.append(f"cluster redeploy {co['redeploy'].get('id') or ''}: {co['redeploy'].get('here') or 'pending'}")
    for p in co.get("proxies") or []:
        extra.append(f"proxy {p.get('proxy')}: {json.dumps(p.get('groups'), separators=(',', ':'))}")
    return " · ".join(extra)


def _warning_item(w: dict[str, Any]) -> str:
    code, node = str(w.get("code")), str(w.get("node"))
    text = escape(f"{code} · {node}: {w.get('message')}")
    return f'<li data-code="{escape(code, quote=True)}" data-node="{escape(node, quote=True)}">{text}</li>'


def _fill_table(page: str, table_id: str, rows: str) -> str:
    start = page.find(f'<table id="{table_id}" hidden>')
    body = page.find("<tbody></tbody>", start) if start >= 0 else -1
    if body < 0:
        return page
    page = page[:body] + f"<tbody>{rows}</tbody>" + page[body + len("<tbody></tbody>"):]
    return page.replace(f'<table id="{table_id}" hidden>', f'<table id="{table_id}">', 1) if rows or \
        table_id == "members" else page


def cluster_section(page: str, status: dict[str, Any], view: dict[str, Any] | None) -> str:
    """The cluster section as ui.js's renderCluster leaves it: the single-node note, or the member table, the
    gangs of this node's groups, the warnings and the coordination line (the template is untouched where a
    marker is missing, or when the view could not be read: the first poll fills it)."""
    if status.get("cluster") is None:  # as ui.js's `!ui.status.cluster` (an empty section is still one)
        return page.replace('<div id="cluster-note" class="note" hidden></div>',
                            f'<div id="cluster-note" class="note plain">{escape(SINGLE_NODE)}</div>', 1)
    if not view:
        return page
    page = page.replace('<span class="muted" id="cluster-meta"></span>',
                        f'<span class="muted" id="cluster-meta">{escape(cluster_meta(view))}</span>', 1)
    items = "".join(_warning_item(w) for w in view.get("warnings") or [])
    if view.get("conflict"):
        items = f"<li>{escape('name conflict: ' + json.dumps(view['conflict']))}</li>" + items
    page = page.replace('<ul id="cluster-warnings" class="warnings"></ul>',
                        f'<ul id="cluster-warnings" class="warnings">{items}</ul>', 1)
    page = _fill_table(page, "members", member_rows(view))
    page = _fill_table(page, "gangs", gang_rows(view))
    return page.replace('<div id="coordination-extra" class="muted"></div>',
                        f'<div id="coordination-extra" class="muted">{escape(coordination_extra(view))}</div>', 1)

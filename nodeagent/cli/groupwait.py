"""`--wait` through the members' keys in etcd (`GET /cluster` of the local agent), whichever node asked.

A restart of one rank of a multi-node vLLM group is a new generation of the whole group: the wait ends when every
rank of every node of the group runs a new process, ready, for that generation. Another node's component that is
not such a rank: when it runs a new process, ready (or, for a stop, none). A member key carries each component's
hold: the wait shows it, and ends early on one the agent will not resolve by itself, as the local wait does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nodeagent.cli.common import CliError


@dataclass(frozen=True)
class GroupWait:
    """What a group restart must reach: each member's ranks and the pids they had before it."""

    group: str | None
    """None: one component of one node, not a group's rank."""
    nodes: tuple[str, ...]
    generation: int
    """The first generation that counts: one past the newest any member had acted on before the restart."""
    before: dict[str, dict[str, Any]]
    """node → {rank component: pid before}"""
    stop: bool = False


def _rows(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(r.get("name")): r for r in view.get("members") or []}


def _gang(row: dict[str, Any], group: str) -> dict[str, Any]:
    return (row.get("gangs") or {}).get(group) or {}


def _comp(row: dict[str, Any], name: str) -> dict[str, Any]:
    return (row.get("components") or {}).get(name) or {}


def group_of(view: dict[str, Any], node: str, component: str) -> GroupWait | None:
    """The multi-node group `node`'s `component` is a rank of (None: not a rank of one, or the member's record
    does not say — then the node's own wait applies)."""
    rows = _rows(view)
    row = rows.get(node) or {}
    for group, gang in (row.get("gangs") or {}).items():
        if component not in (gang.get("ranks") or []):
            continue
        nodes = tuple(sorted(n for n, r in rows.items() if r.get("group") == group) or (node,))
        if len(nodes) < 2:
            return None
        known = [n for n in nodes if n in rows]
        acted = [int(_gang(rows[n], group).get("generation") or 0) for n in known]
        before = {n: {c: _comp(rows[n], c).get("pid") for c in _gang(rows[n], group).get("ranks") or []}
                  for n in known}  # fmt: skip
        return GroupWait(group, nodes, max(acted, default=0) + 1, before)
    return None


def component_of(view: dict[str, Any], node: str, component: str, action: str) -> GroupWait:
    """Another node's component as a one-node wait (its member key must list it)."""
    row = _rows(view).get(node) or {}
    return GroupWait(None, (node,), 0, {node: {component: _comp(row, component).get("pid")}}, action == "stop")


def followed(wait: GroupWait, view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`node/component` → its member record's entry, for every component the wait follows (a node without an
    agent: none). Each carries its hold, which `actions.StuckHolds` judges as the local wait does."""
    rows = _rows(view)
    out = {}
    for node in wait.nodes:
        row = rows.get(node)
        if row is None or not row.get("present", True):
            continue
        ranks = _gang(row, wait.group).get("ranks") if wait.group else None
        out.update({f"{node}/{c}": _comp(row, c) for c in ranks or wait.before.get(node, {})})
    return out


def group_progress(wait: GroupWait, view: dict[str, Any]) -> tuple[str | None, str]:
    """(the done message or None, a one-line summary of where the group is). Raises CliError when a rank failed."""
    rows = _rows(view)
    parts, done = [], True
    for node in wait.nodes:
        row = rows.get(node)
        if row is None or not row.get("present", True):
            parts.append(f"{node}: no agent")
            done = False
            continue
        gang: dict[str, Any] = _gang(row, wait.group) if wait.group else {"released": True}
        generation = int(gang.get("generation") or 0)
        ranks = gang.get("ranks") or list(wait.before.get(node, {}))
        states = []
        for c in ranks:
            comp = _comp(row, c)
            if comp.get("state") == "failed":
                raise CliError(f"group {wait.group}: {node}/{c} failed (see nodeagentctl --node {node} status)")
            fresh = comp.get("pid") is not None and comp.get("pid") != wait.before.get(node, {}).get(c)
            ok: object
            if wait.stop:
                ok = comp.get("pid") is None and comp.get("state") in ("stopped", "backoff", "failed")
            else:
                ok = generation >= wait.generation and gang.get("released") and comp.get("ready") and fresh
            done = done and bool(ok)
            held = (comp.get("hold") or {}).get("reason") if comp.get("pid") is None else None
            states.append(f"{c} {comp.get('state', '?')}" + (f" (held: {held})" if held else ""))
        if wait.group is None:
            parts.append(f"{node}: {', '.join(states)}")
            continue
        barrier = "" if gang.get("released") or generation < wait.generation else ", at the barrier"
        parts.append(f"{node}: generation {generation or '?'}, {', '.join(states) or 'no ranks'}{barrier}")
    head = f"group {wait.group} (generation {wait.generation}): " if wait.group else ""
    summary = head + "; ".join(parts)
    if not done:
        return None, summary
    pids = ", ".join(f"{n}/{c} pid {_comp(rows[n], c).get('pid')}"
                     for n in wait.nodes for c in wait.before.get(n, {}))  # fmt: skip
    if wait.group is None:
        name = next(f"{n}/{c}" for n in wait.nodes for c in wait.before.get(n, {}))
        return (f"{name} stopped" if wait.stop else f"{name} ready ({pids})"), summary
    return f"group {wait.group} generation {wait.generation} ready on every node ({pids})", summary

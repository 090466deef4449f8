"""`nodeagentctl start|stop|restart COMPONENT`, `redeploy`, and the one-shot node actions (pause, resume, reset,
reload, detach); `--wait` polls /status until the action is done or failed."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from nodeagent.cli.agentconfig import Client, connect, is_local_node
from nodeagent.cli.common import (
    EXIT_FAILED,
    EXIT_UNAUTHORISED,
    EXIT_UNKNOWN,
    EXIT_UNREACHABLE,
    CliError,
    error_text,
)
from nodeagent.cli.groupwait import GroupWait, component_of, followed, group_of, group_progress
from nodeagent.cli.status import cluster_view
from nodeagent.core.states import UP_STATES


def _components(client: Client) -> dict[str, Any]:
    return client.get("/status")["components"]


def _node_name(client: Client) -> str:
    return str(client.get("/status")["node"]["name"])


def _summary(status: dict[str, Any]) -> str:
    return ", ".join(f"{n} {c['state']}" + (f" (held: {c['held']})" if c.get("held") else "")
                     for n, c in status["components"].items())  # fmt: skip


def _wait(client: Client, what: str, done: Any, timeout: float, interval: float = 0.5) -> dict[str, Any]:
    """Poll /status until done(status) returns a message (success) or raises CliError (failure)."""
    message = _poll(lambda: client.get("/status"), what, lambda status: (done(status), _summary(status)), timeout,
                    interval)  # fmt: skip
    return {"message": message}


def _poll(fetch: Any, what: str, progress: Any, timeout: float, interval: float = 0.5) -> str:
    """fetch() until progress(it) gives (message, summary) with a message; each new summary is shown."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        message, summary = progress(fetch())
        if message:
            return str(message)
        if summary != last:
            print(f"  … {summary}", file=sys.stderr)
            last = summary
        if time.monotonic() >= deadline:
            raise CliError(f"timed out after {timeout:g}s waiting for {what} ({summary})")
        time.sleep(interval)


SETTLE_S = 1.0
"""`--wait` reports a start or restart done once the new process has been seen up this long."""
STUCK_S = 3.0
"""A hold the agent will not resolve by itself (a stranger on our port, a failed preflight, an NPU fault) ends
`--wait` once it has stood this long: waiting the whole --timeout would only hide why."""


class StuckHolds:
    """Remembers since when each component (`name`, or `node/name` through a member key) has shown a hold that
    does not resolve itself."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.since: dict[tuple[str, str], float] = {}
        self.clock = clock

    def check(self, name: str, comp: dict[str, Any], action: str) -> None:
        hold = comp.get("hold") or {}
        if not hold or hold.get("resolves_itself", True) or comp.get("pid") is not None:
            self.since = {k: v for k, v in self.since.items() if k[0] != name}
            return
        first = self.since.setdefault((name, str(hold.get("kind"))), self.clock())
        if self.clock() - first >= STUCK_S:
            raise CliError(f"{name} {action} held: {hold.get('reason')} — the agent will not resolve this by itself; "
                           f"the start follows once it is gone ({hold.get('kind')})")  # fmt: skip


def _component_waiter(name: str, action: str, before: dict[str, Any]) -> Any:
    old_pid = before.get("pid")
    seen = {"moved": False}
    stuck = StuckHolds()
    up_since: dict[Any, float] = {}
    """pid → when it was first seen up"""

    def done(status: dict[str, Any]) -> str | None:
        comp = status["components"][name]
        state, pid = comp["state"], comp["pid"]
        if action == "stop":
            # No process and none coming: a component stopped during its backoff keeps showing `backoff`.
            gone = pid is None and comp.get("desired") == "stopped" and state in ("stopped", "backoff", "failed")
            return f"{name} stopped" if gone else None
        stuck.check(name, comp, action)
        moved = state in ("stopping", "stopped", "starting") or (pid is not None and pid != old_pid)
        seen["moved"] = seen["moved"] or moved
        if state == "failed" or (state == "backoff" and (seen["moved"] or action == "start")):
            reason = (comp.get("last_exit") or {}).get("reason") or (comp.get("policy") or {}).get("last_reason")
            raise CliError(f"{name} {action} failed: {state} ({reason or 'see nodeagentctl logs ' + name})")
        if state in UP_STATES and (action == "start" or (pid is not None and pid != old_pid)):
            # Up is only proven once it stays up: a component without a startup probe is "ready" the moment it
            # forks, and one that exits with an error a few ms later must not be reported as restarted.
            first = up_since.setdefault(pid, time.monotonic())
            if time.monotonic() - first < SETTLE_S:
                return None
            # a restart of a stopped component had no pid before: no "was None"
            was = f", was {old_pid}" if action == "restart" and old_pid is not None else ""
            return f"{name} {state} (pid {pid}{was})"
        return None

    return done


def _group_wait_for(client: Client, node: str, args: argparse.Namespace, remote: bool = False) -> GroupWait | None:
    """With --wait, a start/restart of a rank of a multi-node group waits for the group's whole new generation;
    another node's other components are followed through its member key."""
    if not args.wait:
        return None
    try:
        view = cluster_view(client)
    except CliError:
        return None  # not a cluster member: the node's own wait applies
    group = group_of(view, node, args.component) if args.action != "stop" else None
    return group or (component_of(view, node, args.component, args.action) if remote else None)


def group_waiter(wait: GroupWait, action: str, stuck: StuckHolds) -> Callable[[dict[str, Any]], tuple[str | None, str]]:
    """progress(view) for `_poll`: where the group is, or done; raises CliError on a failed rank or on a hold that
    does not resolve itself, on whichever node (as the local wait does)."""

    def progress(view: dict[str, Any]) -> tuple[str | None, str]:
        if not wait.stop:
            for name, comp in followed(wait, view).items():
                stuck.check(name, comp, action)
        return group_progress(wait, view)

    return progress


def _wait_group(client: Client, wait: GroupWait, action: str, timeout: float) -> int:
    what = (f"group {wait.group}'s generation {wait.generation}" if wait.group
            else f"{wait.nodes[0]}/{next(iter(wait.before[wait.nodes[0]]))} (through its member key)")  # fmt: skip
    print(f"  waiting for {what}" + (f" on {', '.join(wait.nodes)}" if wait.group else ""), file=sys.stderr)
    began = time.monotonic()
    result = _poll(lambda: cluster_view(client), what, group_waiter(wait, action, StuckHolds()), timeout)
    print(f"{result} after {time.monotonic() - began:.1f}s")
    return 0


def _remote_component(client: Client, args: argparse.Namespace) -> int:
    """Another node's start/stop/restart, carried through etcd by the local agent; its agent's answer."""
    group = _group_wait_for(client, args.node, args, remote=True)
    body = {"drain": False} if getattr(args, "no_drain", False) else {}
    status, data = client.request("POST", f"/cluster/nodes/{args.node}/components/{args.component}/{args.action}",
                                  body)  # fmt: skip
    if status == 401:
        raise CliError(f"unauthorised: {error_text(data, status)}", EXIT_UNAUTHORISED)
    if status == 404:
        raise CliError(error_text(data, status), EXIT_UNKNOWN)
    if status == 503:
        raise CliError(error_text(data, status), EXIT_UNREACHABLE)
    if not isinstance(data, dict) or "message" not in data:
        raise CliError(error_text(data, status))
    code = int(data.get("code", 0 if status == 200 else EXIT_FAILED))
    print(data["message"], file=sys.stdout if code == 0 else sys.stderr)
    if code == 0 and group is not None:
        return _wait_group(client, group, args.action, args.timeout)
    return code


def cmd_component(args: argparse.Namespace) -> int:
    client = connect(args)
    if getattr(args, "node", None) and not is_local_node(args):
        return _remote_component(client, args)
    before = None
    if args.wait:
        comps = _components(client)
        if args.component not in comps:
            raise CliError(f"unknown component {args.component!r} (this node runs: {', '.join(comps)})",
                           EXIT_UNKNOWN)  # fmt: skip
        before = comps[args.component]
    group = _group_wait_for(client, _node_name(client), args) if before is not None else None
    body = {"drain": False} if getattr(args, "no_drain", False) else None
    answer = client.post(f"/components/{args.component}/{args.action}", body)
    message = answer.get("message") if isinstance(answer, dict) else None
    if message == f"{args.action} {args.component}":
        message = None
    if before is None:
        print(f"{args.action} {args.component}: accepted" + (f" — {message}" if message else ""))
        return 0
    if group is not None:
        return _wait_group(client, group, args.action, args.timeout)
    began = time.monotonic()
    result = _wait(client, f"{args.component} to {args.action}", _component_waiter(args.component, args.action, before),
                   args.timeout)  # fmt: skip
    print(f"{result['message']} after {time.monotonic() - began:.1f}s")
    return 0


def cmd_redeploy(args: argparse.Namespace) -> int:
    client = connect(args)
    before = _components(client) if args.wait else {}
    data = client.post("/redeploy", {"reason": args.reason} if args.reason else None)
    note = " (one was already in progress)" if data.get("already_in_progress") else ""
    print(f"redeploy: accepted{note}")
    if not args.wait:
        return 0
    old = {n: c["pid"] for n, c in before.items()}
    stuck = StuckHolds()

    def done(status: dict[str, Any]) -> str | None:
        if status.get("redeploying"):
            return None
        comps = status["components"]
        for n, c in comps.items():
            if c.get("desired") == "running":
                stuck.check(n, c, "redeploy")
        failed = [n for n, c in comps.items() if c["state"] == "failed"]
        if failed:
            raise CliError(f"redeploy failed: {', '.join(failed)} failed")
        wanted = {n: c for n, c in comps.items() if c.get("desired") == "running"}
        if all(c["state"] in UP_STATES and c["pid"] not in (None, old.get(n)) for n, c in wanted.items()):
            return "redeploy done: " + ", ".join(f"{n} {c['state']} (pid {c['pid']})" for n, c in wanted.items())
        return None

    began = time.monotonic()
    result = _wait(client, "the redeploy", done, args.timeout)
    print(f"{result['message']} after {time.monotonic() - began:.1f}s")
    return 0


def cmd_simple(args: argparse.Namespace) -> int:
    client = connect(args)
    action = args.command
    body = {"component": args.component} if action == "reset" and args.component else None
    data = client.post(f"/{action}", body)
    if action == "reload":
        started = f"; started {', '.join(data['started'])} (down by a failure or held)" if data.get("started") else ""
        print(f"reload: restarted {', '.join(data.get('restarted', [])) or 'nothing'}{started}")
    elif action == "detach":
        print("detach: the agent exits leaving the stack running; the next agent adopts it")
    elif action == "uncordon":
        print(f"uncordon: the node is back (it was isolated: {data.get('was_isolated')}); its NPU users start")
    elif action == "reset":
        print(f"reset: restart counters cleared ({args.component or 'all components and the node state'})")
    else:
        print(f"{action}: done")
    return 0


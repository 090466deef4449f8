"""`nodeagentctl cluster`: the members as the local agent sees them through etcd, and the cluster-wide
actions (pause, resume, redeploy, restart of vLLM groups)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from nodeagent.cli.agentconfig import connect
from nodeagent.cli.common import EXIT_FAILED, EXIT_UNKNOWN, EXIT_UNREACHABLE, EXIT_USAGE, CliError, error_text
from nodeagent.cli.status import cluster_view


def cmd_cluster(args: argparse.Namespace) -> int:
    from nodeagent.cli.remote import format_cluster

    client = connect(args)
    action = args.cluster_action
    if action in ("pause", "resume", "redeploy", "restart"):
        body: dict[str, Any] = {}
        if action in ("pause", "redeploy", "restart") and args.reason:
            body["reason"] = args.reason
        if action == "restart":
            body["component"] = args.target or "vllm"
            if args.group:
                body["group"] = args.group
            if args.no_drain:
                body["drain"] = False
        status, data = client.request("POST", f"/cluster/{action}", body)
        if status == 404:
            raise CliError(error_text(data, status), EXIT_UNKNOWN if action == "restart" else EXIT_USAGE)
        if status == 503:
            raise CliError(error_text(data, status), EXIT_UNREACHABLE)
        if status not in (200, 202):
            raise CliError(error_text(data, status), EXIT_USAGE if status == 400 else EXIT_FAILED)
        if action == "restart":
            for group, what in (data.get("groups") or {}).items():
                print(f"group {group}: {what} — every rank restarts once")
        elif action == "redeploy":
            print(f"cluster redeploy {data.get('id')}: " + ("already in progress" if data.get("already_in_progress")
                                                             else "asked; every node takes part"))  # fmt: skip
        else:
            print(f"cluster {action}: done" + (" (no agent takes automatic actions now)" if action == "pause" else ""))
        return 0
    if action == "rollout":
        return cmd_rollout(args, client)
    view = cluster_view(client)
    print(json.dumps(view, indent=2) if args.json else format_cluster(view))
    return 0


def seconds(text: str, what: str) -> float:
    """`10m`, `90s`, `1h`, `45` (seconds) → seconds; a clear error naming the option otherwise."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise CliError(f"{what}: {text!r} is not a duration (e.g. 10m, 90s, 1h)", EXIT_USAGE) from None
    if value < 0:
        raise CliError(f"{what}: {text!r} is negative", EXIT_USAGE)
    return value


def fraction(text: str, what: str) -> float:
    """`5%` or `0.05` → 0.05."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise CliError(f"{what}: {text!r} is not a rate (e.g. 5%, 0.05)", EXIT_USAGE) from None
    if not 0 <= value <= 1:
        raise CliError(f"{what}: {text!r} is not between 0 and 100%", EXIT_USAGE)
    return value


def rollout_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"file": os.path.abspath(args.target), "dry_run": args.dry_run}
    if args.max_unavailable is not None:
        body["max_unavailable"] = args.max_unavailable
    if args.order:
        body["order"] = args.order
    if args.canary:
        body["canary"] = args.canary
    for flag, key in (("bake", "bake_s"), ("drain_timeout", "drain_timeout_s"), ("gate_timeout", "gate_timeout_s")):
        if getattr(args, flag):
            body[key] = seconds(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.bake_error_rate:
        body["bake_error_rate"] = fraction(args.bake_error_rate, "--bake-error-rate")
    if args.bake_ttft_factor:
        try:
            body["bake_ttft_factor"] = float(args.bake_ttft_factor)
        except ValueError:
            raise CliError(f"--bake-ttft-factor: {args.bake_ttft_factor!r} is not a number (e.g. 2, 1.5)",
                           EXIT_USAGE) from None
        if body["bake_ttft_factor"] < 1:
            raise CliError(f"--bake-ttft-factor: {args.bake_ttft_factor!r} is below 1 (2 fails a TTFT twice the one "
                           "before the step)", EXIT_USAGE)  # fmt: skip
    if args.allow_outage:
        body["allow_outage"] = [k for item in args.allow_outage for k in item.split(",") if k]
    return body


def cmd_rollout(args: argparse.Namespace, client: Any) -> int:
    from nodeagent.cli.remote import format_plan, rollout_lines

    what = args.target or "status"
    if what == "status":
        view = cluster_view(client)
        print(json.dumps(view.get("rollout"), indent=2) if args.json else "\n".join(rollout_lines(view.get("rollout"))))
        return 0
    if what in ("pause", "resume", "abort", "rollback"):
        status, data = client.request("POST", f"/cluster/rollout/{what}", {})
    else:
        if not os.path.isfile(what):
            raise CliError(f"rollout: {what}: no such file (give the new cluster file, installed on every member, "
                           "or status|pause|resume|abort|rollback)", EXIT_USAGE)  # fmt: skip
        status, data = client.request("POST", "/cluster/rollout", rollout_body(args))
    if status == 503:
        raise CliError(error_text(data, status), EXIT_UNREACHABLE)
    if status not in (200, 202):
        raise CliError(error_text(data, status), EXIT_USAGE if status == 400 else EXIT_FAILED)
    if args.json:
        print(json.dumps(data, indent=2))
    elif what in ("pause", "resume", "abort", "rollback"):
        print("\n".join(rollout_lines(data.get("rollout"))))
    else:
        print(format_plan(data))
    if what not in ("pause", "resume", "abort", "rollback") and not data.get("ok"):
        return EXIT_FAILED
    return 0


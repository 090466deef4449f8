"""`nodeagentctl cluster`: the members as the local agent sees them through etcd, and the cluster-wide
actions (pause, resume, redeploy, restart of vLLM groups)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from nodeagent.cli.agentconfig import connect
from nodeagent.cli.common import EXIT_FAILED, EXIT_UNKNOWN, EXIT_UNREACHABLE, EXIT_USAGE, CliError, error_text
from nodeagent.cli.status import cluster_view


def cmd_cluster(args: argparse.Namespace) -> int:
    from nodeagent.clustercmd import format_cluster

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
    view = cluster_view(client)
    print(json.dumps(view, indent=2) if args.json else format_cluster(view))
    return 0


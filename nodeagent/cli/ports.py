"""`nodeagentctl ports`: every port this node binds, linted (`nodeagent.layers.port_check`), and `--apply`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nodeagent.layers.port_check import SYSCTL_D_FILE, PortsApplyError, apply_reserved, format_report, lint_node


def cmd_ports(args: argparse.Namespace) -> int:
    from nodeagent.cli.agentconfig import full_config
    from nodeagent.cli.common import EXIT_FAILED, CliError
    from nodeagent.node.hostfacts import Host

    config = full_config(args, getattr(args, "node", None))
    host = Host(root=Path(args.root))
    report = lint_node(config, host, host.our_pids(config.agent.state_dir))  # the running stack's own ports pass
    applied = None
    if args.apply and report.to_reserve:
        try:
            applied = apply_reserved(host, report)
        except PortsApplyError as exc:
            raise CliError(str(exc), EXIT_FAILED) from None
    if args.json:
        out = report.to_dict() | {"applied": applied}
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report))
        if applied is not None:
            print(f"wrote ip_local_reserved_ports = {applied}")
            print(f"to keep it after a reboot, put this line in {SYSCTL_D_FILE}:\n{report.sysctl_line()}")
    return EXIT_FAILED if report.collisions else 0

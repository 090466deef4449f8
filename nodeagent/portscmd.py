"""The thin shells around `portlint` (`nodeagentctl ports [--apply] [--json]`, and the live lint that preflight's
`ports_lint` check runs).

Both read the sysctls through a root (`hostfacts.Host.root`, `/` in production, a fixture tree in tests);
`--apply` writes `ip_local_reserved_ports` under that root, merging with what is reserved already, and prints the
sysctl.d line that keeps it across reboots (the write needs root: a clear error otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.portlint import (
    COLLISION,
    SYSCTL_DIR,
    TAKEN,
    PortReport,
    PortUse,
    lint_ports,
    node_uses,
    parse_port_range,
    parse_ranges,
)

if TYPE_CHECKING:
    from nodeagent.config_model import Config
    from nodeagent.hostfacts import Host

SYSCTL_D_FILE = "/etc/sysctl.d/90-dsv4-agent-ports.conf"


class PortsApplyError(Exception):
    """Writing ip_local_reserved_ports failed (not root, read-only /proc in a container, ...)."""


def read_sysctls(host: Host) -> tuple[tuple[int, int] | None, list[tuple[int, int]]]:
    """(ip_local_port_range or None when unreadable, ip_local_reserved_ports)."""
    ephemeral = parse_port_range(host.read_text(f"{SYSCTL_DIR}/ip_local_port_range"))
    return ephemeral, parse_ranges(host.read_text(f"{SYSCTL_DIR}/ip_local_reserved_ports"))


def listening_now(uses: Iterable[PortUse]) -> dict[int, set[int]]:
    """Who listens on our fixed ports right now; the agent's own API port is left out (it is the agent)."""
    from nodeagent.residue import listeners

    return listeners(p for u in uses if not u.random and u.component != "agent" for p in range(u.low, u.high + 1))


def lint_node(config: Config, host: Host, ours: set[int] | None = None, live: bool = True) -> PortReport:
    from nodeagent.launcher import base_environment

    uses = node_uses(config, base_environment())
    ephemeral, reserved = read_sysctls(host)
    return lint_ports(uses, ephemeral, reserved, listening_now(uses) if live else None, ours)


def apply_reserved(host: Host, report: PortReport, euid: int | None = None) -> str:
    """Write the merged ip_local_reserved_ports under host.root; returns the value written."""
    path = host.file(f"{SYSCTL_DIR}/ip_local_reserved_ports")
    value = report.reserved_value()
    if host.root == Path("/") and (os.geteuid() if euid is None else euid) != 0:
        raise PortsApplyError(f"writing {path} needs root: run `sudo nodeagentctl ports --apply` "
                              f"(or: sysctl -w {report.sysctl_line().replace(' ', '')})")  # fmt: skip
    try:
        path.write_text(value + "\n")
    except OSError as exc:
        raise PortsApplyError(f"cannot write {path}: {exc.strerror or exc}") from None
    return value


def format_report(report: PortReport) -> str:
    lines = [f"{u.component:<14} {u.purpose:<58} {u.low}-{u.high}" + (" (random)" if u.random else "")
             for u in report.uses]  # fmt: skip
    for f in report.findings:
        tag = "FAIL" if f.kind in (COLLISION, TAKEN) else "WARN"
        lines.append(f"{tag}  {f.message}")
    if report.to_reserve:
        lines.append(f"reserve: {report.sysctl_line()}")
    elif not report.findings:
        lines.append("ok: no collisions, no unreserved listener in the ephemeral range")
    return "\n".join(lines)


def cmd_ports(args: argparse.Namespace) -> int:
    from nodeagent.cli.agentconfig import full_config
    from nodeagent.cli.common import EXIT_FAILED, CliError
    from nodeagent.hostfacts import Host

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

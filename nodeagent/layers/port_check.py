"""The thin shells around `portlint` (`nodeagentctl ports [--apply] [--json]`, and the live lint that preflight's
`ports_lint` check runs).

Both read the sysctls through a root (`hostfacts.Host.root`, `/` in production, a fixture tree in tests);
`--apply` writes `ip_local_reserved_ports` under that root, merging with what is reserved already, and prints the
sysctl.d line that keeps it across reboots (the write needs root: a clear error otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.layers.portlint import (
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
    from nodeagent.config.model import Config
    from nodeagent.node.hostfacts import Host

SYSCTL_D_FILE = "/etc/sysctl.d/90-dsv4-agent-ports.conf"


class PortsApplyError(Exception):
    """Writing ip_local_reserved_ports failed (not root, read-only /proc in a container, ...)."""


def read_sysctls(host: Host) -> tuple[tuple[int, int] | None, list[tuple[int, int]]]:
    """(ip_local_port_range or None when unreadable, ip_local_reserved_ports)."""
    ephemeral = parse_port_range(host.read_text(f"{SYSCTL_DIR}/ip_local_port_range"))
    return ephemeral, parse_ranges(host.read_text(f"{SYSCTL_DIR}/ip_local_reserved_ports"))


def listening_now(uses: Iterable[PortUse]) -> dict[int, set[int]]:
    """Who listens on our fixed ports right now; the agent's own API port is left out (it is the agent)."""
    from nodeagent.node.residue import listeners

    return listeners(p for u in uses if not u.random and u.component != "agent" for p in range(u.low, u.high + 1))


def lint_node(config: Config, host: Host, ours: set[int] | None = None, live: bool = True) -> PortReport:
    from nodeagent.node.launcher import base_environment

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

"""`nodeagentctl`: the operator's command line. Imports stay light (no aiohttp) so it answers fast.

Exit codes: 0 ok, 1 action failed, 2 usage, 3 agent unreachable, 4 unknown component, 78 bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nodeagent import __version__

DEFAULT_CONFIG = "/etc/dsv4-agent/config.yaml"
EXIT_FAILED, EXIT_UNREACHABLE, EXIT_UNKNOWN, EXIT_CONFIG = 1, 3, 4, 78


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def _load(path: str):  # type: ignore[no-untyped-def]
    from nodeagent.config import load_config
    from nodeagent.errors import ConfigError

    try:
        return load_config(path)
    except ConfigError as exc:
        raise CliError(f"config error:\n{exc}", EXIT_CONFIG) from None


def cmd_render(args: argparse.Namespace) -> int:
    from nodeagent.launcher import base_environment
    from nodeagent.render import render_component

    config = _load(args.config)
    names = [args.component] if args.component else list(config.active_components())
    if args.component and args.component not in config.components:
        known = ", ".join(config.components)
        raise CliError(f"unknown component {args.component!r} (config has: {known})", EXIT_UNKNOWN)
    base = base_environment(os.environ)
    specs = [render_component(name, config, base) for name in names]
    if args.json:
        out = [{"component": s.component, "kind": s.kind, "argv": list(s.argv), "env": s.env,
                "unset": list(s.unset), "cwd": str(s.cwd), "daemonizes": s.daemonizes} for s in specs]
        print(json.dumps(out if not args.component else out[0], indent=2))
        return 0
    for spec in specs:
        print(f"# --- {spec.component} ({spec.kind})")
        print(spec.shell())
        print()
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    from nodeagent.agent import load_checked
    from nodeagent.errors import ConfigError

    try:
        config = load_checked(args.file)
    except ConfigError as exc:
        raise CliError(f"config error:\n{exc}", EXIT_CONFIG) from None
    active = ", ".join(config.active_components())
    print(f"{args.file}: OK — node {config.node.name} ({config.node.role}) runs: {active}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodeagentctl", description="Operate the dsv4-agent on this node.")
    parser.add_argument("--config", "-c", default=os.environ.get("DSV4_AGENT_CONFIG", DEFAULT_CONFIG),
                        help=f"agent config (default {DEFAULT_CONFIG}; env DSV4_AGENT_CONFIG)")
    # --config is accepted after the subcommand too (`nodeagentctl render --config FILE`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", default=argparse.SUPPRESS, help="agent config")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    render = sub.add_parser("render", parents=[common], help="print the exact command, environment and cwd of components")
    render.add_argument("component", nargs="?")
    render.add_argument("--json", action="store_true")
    render.set_defaults(func=cmd_render)
    config = sub.add_parser("config", help="config tools")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    validate = config_sub.add_parser("validate", help="validate a config file")
    validate.add_argument("file")
    validate.set_defaults(func=cmd_config_validate)
    version = sub.add_parser("version", help="print the version")
    version.set_defaults(func=lambda _args: print(f"nodeagentctl {__version__}") or 0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"nodeagentctl: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

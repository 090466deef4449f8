"""`nodeagentctl`: the operator's command line for the dsv4-agent on this node.

Each command family is a module here — `status`, `cluster`, `actions` (start/stop/restart, redeploy, pause,
resume, reset, reload, detach), `node` (preflight, npu, postmortem), `tools` (bench, cache, probe), `configcmd`
(render, config validate), `logs` — and only the module of the command that runs is imported, so `status`
answers in a few tens of ms: HTTP over one socket (`cli.http`), the `agent` section through the config's raw
layer (`nodeagent.config.raw`), no config model. The commands that need the validated model load it, and so does any
command whose `agent` section the raw layer cannot take, to report the exact config error.

Exit codes: 0 ok, 1 action failed, 2 usage, 3 agent unreachable, 4 unknown component, 5 unauthorised,
78 bad config or none found; `bench`: vllm bench's own code, 69 no `vllm` here, 73 --output-dir not writable.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from nodeagent.cli.common import (
    DEFAULT_CONFIG,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_UNAUTHORISED,
    EXIT_UNKNOWN,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    NODE_COMMANDS,
    CliError,
)

__all__ = ["DEFAULT_CONFIG", "EXIT_CONFIG", "EXIT_FAILED", "EXIT_UNAUTHORISED", "EXIT_UNKNOWN", "EXIT_UNREACHABLE",
           "EXIT_USAGE", "CliError", "main"]  # fmt: skip

_EXPORTS = {"format_status": "status", "format_mqtt": "status", "tail_lines": "logs", "follow": "logs",
            "build_parser": "parser", "Client": "agentconfig", "LightConfig": "agentconfig",
            "read_light_config": "agentconfig"}  # fmt: skip
"""Names other modules and tests use, from the family module that defines them (imported on first use)."""


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"nodeagent.cli.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _run(func: str, args: Any) -> int:
    if func == "version":
        from nodeagent import __version__

        print(f"nodeagentctl {__version__}")
        return 0
    module, _, name = func.partition(":")
    return int(getattr(importlib.import_module(f"nodeagent.cli.{module}"), name)(args))


def _runs_here(args: Any) -> bool:
    """--node NAME with a node-local command (pause, logs, npu, …): fine when NAME's agent runs on this host."""
    from nodeagent.cli.agentconfig import is_local_node

    try:
        return is_local_node(args)
    except CliError:
        return False


def main(argv: list[str] | None = None) -> int:
    from nodeagent.cli.parser import build_parser, command_word

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(command_word(argv))
    args = parser.parse_args(argv)
    try:
        if getattr(args, "node", None) and args.command not in NODE_COMMANDS and not _runs_here(args):
            parser.error(f"--node works with: {', '.join(NODE_COMMANDS)} (not {args.command}, unless node "
                         f"{args.node!r} has its agent on this host)")
        return _run(args.func, args)
    except CliError as exc:
        print(f"nodeagentctl: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130

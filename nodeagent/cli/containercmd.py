"""`nodeagentctl render container` (the exact run line of the node's container: the guide's start-docker.sh, and
the folders the agent adds) and `nodeagentctl shell` (the guide's `docker exec -it NAME bash`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from nodeagent.cli.common import EXIT_CONFIG, EXIT_UNKNOWN, CliError


def _spec(config: Any) -> Any:
    """The config's container (the guide's line with its run_args), or a CLI error saying why there is none."""
    from nodeagent.container_options import ContainerRenderError
    from nodeagent.render_container import render_container

    if config.container is None:
        raise CliError("this config has no container: section (its components run on the host)", EXIT_UNKNOWN)
    try:
        return render_container(config, os.environ)
    except ContainerRenderError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None


def print_container(config: Any, as_json: bool) -> int:
    from nodeagent.render_container import agent_mounts

    spec = _spec(config)
    inside = [n for n, c in config.active_components().items() if c.container]
    added = agent_mounts(config, spec)
    if as_json:
        print(json.dumps({"engine": spec.engine, "name": spec.name, "image": spec.image,
                          "argv": list(spec.run_argv()), "agent_mounts": [o.value for o in added],
                          "setup": [list(s) for s in config.container.setup],
                          "components": inside, "node": config.node.name}, indent=2))
        return 0
    print(f"# --- container {spec.name} ({spec.engine}; runs {', '.join(inside) or 'no component'})")
    print(spec.shell())
    if added:
        print("# the agent adds (its folders, not under a mount of this line, seen inside at the same path): "
              + " ".join(f"-v {o.value}" for o in added))
    for step in config.container.setup:
        print("# setup: " + " ".join(step))
    return 0


def cmd_shell(args: argparse.Namespace) -> int:
    """exec the engine's `exec -it NAME bash` (or the command given) in place of this process."""
    from nodeagent.cli.agentconfig import full_config

    spec = _spec(full_config(args))
    command = [a for a in args.shell_command if a != "--"] or ["bash"]
    argv = spec.exec_argv(command, interactive=sys.stdin.isatty())
    try:
        os.execvp(argv[0], list(argv))
    except OSError as exc:
        raise CliError(f"{argv[0]}: {exc}", EXIT_CONFIG) from None
    return 0  # not reached

"""`nodeagentctl render container` (the exact run line of the node's container on this host: the guide's
start-docker.sh adapted to what the host lacks, each adaptation said, and the folders the agent adds) and
`nodeagentctl shell` (the guide's `docker exec -it NAME bash`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from nodeagent.cli.common import EXIT_CONFIG, EXIT_UNKNOWN, CliError


def _spec(config: Any, root: str = "/") -> Any:
    """The config's container on this host (the guide's line with its run_args, adapted to the host as the agent
    adapts it), or a CLI error saying why there is none. `root`: a fixture tree standing for the host (tests)."""
    from pathlib import Path

    from nodeagent.config.container_options import ContainerRenderError
    from nodeagent.container.render import host_facts, render_container
    from nodeagent.node.hostfacts import Host

    if config.container is None:
        raise CliError("this config has no container: section (its components run on the host)", EXIT_UNKNOWN)
    try:
        return render_container(config, os.environ, facts=host_facts(config, Host(root=Path(root))))
    except ContainerRenderError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None


def print_container(config: Any, as_json: bool, root: str = "/") -> int:
    from nodeagent.container.render import agent_mounts

    spec = _spec(config, root)
    inside = [n for n, c in config.active_components().items() if c.container]
    added = agent_mounts(config, spec)
    if as_json:
        print(json.dumps({"engine": spec.engine, "name": spec.name, "image": spec.image,
                          "argv": list(spec.run_argv()), "agent_mounts": [o.value for o in added],
                          "adapted": [a.text for a in spec.adaptations], "problems": [a.text for a in spec.problems],
                          "create_on_host": list(spec.create_on_host),
                          "compile_caches": str(config.agent.cache_dir) if config.agent.caches.enabled else None,
                          "setup": [list(s) for s in config.container.setup],
                          "components": inside, "node": config.node.name}, indent=2))
        return 0
    print(f"# --- container {spec.name} ({spec.engine}; runs {', '.join(inside) or 'no component'})")
    for note in spec.adaptations:
        print(f"# adapted to this host ({note.topic}): {note.text}")
    for problem in spec.problems:
        print(f"# NOT adaptable ({problem.topic}): {problem.text}")
    print(spec.shell())
    if added:
        print("# the agent adds (its folders, not under a mount of this line, seen inside at the same path): "
              + " ".join(f"-v {o.value}" for o in added))
    if config.agent.caches.enabled:
        from nodeagent.render.caches import CACHE_VARS

        print(f"# compile caches (agent.caches): {config.agent.cache_dir} on the host, at the same path inside; a "
              f"vllm rank's {', '.join(CACHE_VARS)} point into its image's folder there")
    for step in config.container.setup:
        print("# setup: " + " ".join(step))
    return 0


def cmd_shell(args: argparse.Namespace) -> int:
    """exec the engine's `exec -it NAME bash` (or the command given) in place of this process."""
    from nodeagent.cli.agentconfig import full_config

    spec = _spec(full_config(args))
    words = list(args.shell_command)
    # only the separator goes: `shell -- git diff -- f` runs `git diff -- f`
    command = (words[1:] if words[:1] == ["--"] else words) or ["bash"]
    argv = spec.exec_argv(command, interactive=True, tty=sys.stdin.isatty())  # `echo cmd | … shell` works too
    try:
        os.execvp(argv[0], list(argv))
    except OSError as exc:
        raise CliError(f"{argv[0]}: {exc}", EXIT_CONFIG) from None
    return 0  # not reached

"""`nodeagentctl render` and `config validate`: the exact commands a config starts, and a full check of it."""

from __future__ import annotations

import argparse
import json
import os

from nodeagent.cli.agentconfig import full_config
from nodeagent.cli.common import EXIT_CONFIG, EXIT_UNKNOWN, CliError


def cmd_render(args: argparse.Namespace) -> int:
    from nodeagent.node.caches import preview
    from nodeagent.node.launcher import base_environment
    from nodeagent.node.vllm_install import launch_spec

    config = full_config(args, args.node)
    if args.component == "container" and "container" not in config.components:
        from nodeagent.cli.containercmd import print_container

        return print_container(config, args.json, args.root)
    names = [args.component] if args.component else list(config.active_components())
    if args.component and args.component not in config.components:
        known = ", ".join(config.components)
        where = f"node {config.node.name} has" if config.cluster.nodes else "config has"
        raise CliError(f"unknown component {args.component!r} ({where}: {known})", EXIT_UNKNOWN)
    base = base_environment(os.environ)
    # as the agent launches them: vLLM's fault-tolerance flags only for a vLLM installed here that takes them
    specs = [launch_spec(name, config, base) for name in names]
    # and the compile caches' variables they get (agent.caches; nodeagent.node.caches)
    previews = [preview(config, spec.component, spec, base) for spec in specs]
    specs, notes = [p[0] for p in previews], {p[0].component: p[1] for p in previews}
    if args.json:
        out = [{"component": s.component, "kind": s.kind, "argv": list(s.argv), "env": s.env,
                "unset": list(s.unset), "cwd": str(s.cwd), "daemonizes": s.daemonizes,
                "node": config.node.name, "group": getattr(config.components[s.component], "group", None),
                "ports": list(s.ports)} for s in specs]
        print(json.dumps(out if not args.component else out[0], indent=2))
        return 0
    for spec in specs:
        print(f"# --- {spec.component} ({spec.kind})")
        if notes.get(spec.component):
            print(f"# {notes[spec.component]}")
        print(spec.shell())
        print()
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    from nodeagent.core.errors import ConfigError
    from nodeagent.layers.config_checks import load_checked

    try:
        config = load_checked(args.file, args.node)
    except ConfigError as exc:
        raise CliError(f"config error:\n{exc}", EXIT_CONFIG) from None
    active = ", ".join(config.active_components())
    print(f"{args.file}: OK — node {config.node.name} ({config.node.role}) runs: {active}")
    if config.cluster.nodes:
        from nodeagent.config.cluster import cluster_file_hash
        from nodeagent.config.layout import cluster_layout

        layout = cluster_layout(config)
        groups = "; ".join(f"{g.name} ({g.kind}, {g.dp_launch}, DP{g.dp_size} TP{g.tensor_parallel_size}: "
                           f"{', '.join(g.nodes)})" for g in layout.groups)  # fmt: skip
        print(f"cluster {layout.cluster}: {len(layout.members)} members, groups {groups or 'none'}; "
              f"shared sections {cluster_file_hash(config)[:12]}")
    return 0


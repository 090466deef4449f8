"""`nodeagentctl render container`: the exact run line of the node's container (the guide's start-docker.sh)."""

from __future__ import annotations

import json
import os
from typing import Any

from nodeagent.cli.common import EXIT_CONFIG, EXIT_UNKNOWN, CliError


def print_container(config: Any, as_json: bool) -> int:
    from nodeagent.container_options import ContainerRenderError
    from nodeagent.render_container import render_container

    if config.container is None:
        raise CliError("this config has no container: section (its components run on the host)", EXIT_UNKNOWN)
    try:
        spec = render_container(config, os.environ)
    except ContainerRenderError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    inside = [n for n, c in config.active_components().items() if c.container]
    if as_json:
        print(json.dumps({"engine": spec.engine, "name": spec.name, "image": spec.image,
                          "argv": list(spec.run_argv()), "setup": [list(s) for s in config.container.setup],
                          "components": inside, "node": config.node.name}, indent=2))
        return 0
    print(f"# --- container {spec.name} ({spec.engine}; runs {', '.join(inside) or 'no component'})")
    print(spec.shell())
    for step in config.container.setup:
        print("# setup: " + " ".join(step))
    return 0

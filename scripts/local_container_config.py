"""Write config/local.yaml's stack in container mode for this machine and print the file's path.

The run line is the guide's as the agent adapts it to this host (no NPU devices or Ascend driver paths here with
`node.npus: 0`, runc and explicit ulimits where podman needs them: `nodeagent.container.host`), plus only what
the test image needs to find the stack, which it does not contain (scripts/build-test-image.sh): the repository
with its venv and the venv's interpreter read-only at their own paths, the venv first on PATH, and the agent's
home read-write (it may lie inside the read-only repository). etcd stays on the host (`container: false`), as
an operator may keep it.
Used by `scripts/run-local.sh --container` and the container tests (tests/containerhelpers.py).
  local_container_config.py IMAGE OUT.yaml HOME [NAME]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
INTERPRETER_HOME = Path(os.path.realpath(sys.executable)).parents[1]


def stack_run_args() -> list[str]:
    """What the test image needs to run the stack: the venv (the agent, etcd, dscli, the datasystem wheel, the
    stand-in), the worktree it is an editable install of, and the interpreter it links to, at their own paths; and
    the venv first on PATH (the components' commands are bare names: dscli, vllm-standin)."""
    mounts = [f"-v {p}:{p}:ro" for p in (ROOT, INTERPRETER_HOME)]
    return [*mounts, f"-e PATH={BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]


def local_container_config(image: str, home: Path, name: str = "dsv4-local") -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "config" / "local.yaml").read_text())
    data["container"] = {"engine": "podman", "image": image, "name": name,
                         "run_args": [*stack_run_args(), f"-v {home}:{home}"]}  # fmt: skip
    data["components"]["etcd"]["container"] = False
    return data


def main(argv: list[str]) -> int:
    image, out, home = argv[0], Path(argv[1]), Path(argv[2]).resolve()
    home.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(local_container_config(image, home, *argv[3:4]), sort_keys=False))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

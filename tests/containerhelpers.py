"""What the container tests share: the test image (built once per run, offline), the run line this machine
needs, and the reason to skip where there is no podman."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = Path(sys.executable)
INTERPRETER_HOME = Path(os.path.realpath(sys.executable)).parents[1]

sys.path.insert(0, str(ROOT / "scripts"))
from local_container_config import local_container_config, run_args_here  # noqa: E402

__all__ = ["INTERPRETER_HOME", "ROOT", "SKIP_REASON", "VENV_PYTHON", "built_image", "local_container_config",
           "run_args_here"]

SKIP_REASON = None
if shutil.which("podman") is None:
    SKIP_REASON = "podman is not installed (scripts/test.sh installs it: apt-get install podman runc)"
elif os.geteuid() != 0:
    SKIP_REASON = "podman runs as root on these machines (rootless needs subuids)"


@functools.cache
def built_image() -> str:
    """The image (scripts/build-test-image.sh: the cached test rootfs imported), built once per test run."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build-test-image.sh")], capture_output=True, text=True,
                         timeout=900, check=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]

"""What the container tests share: the test image (built once per run, offline), the run line this machine
needs, and the reason to skip where there is no podman."""

from __future__ import annotations

import functools
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

from nodeagent.container_options import guide_options

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = Path(sys.executable)
INTERPRETER_HOME = Path(os.path.realpath(sys.executable)).parents[1]

SKIP_REASON = None
if shutil.which("podman") is None:
    SKIP_REASON = "podman is not installed (scripts/test.sh installs it: apt-get install podman runc)"
elif os.geteuid() != 0:
    SKIP_REASON = "podman runs as root on these machines (rootless needs subuids)"


def limits() -> list[str]:
    """podman's default rlimits fail without CAP_SYS_RESOURCE; nproc above kernel.pid_max is refused here too."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], int(Path("/proc/sys/kernel/pid_max").read_text()))
    return [f"--ulimit nofile={nofile}:{nofile}", f"--ulimit nproc={nproc}:{nproc}"]


def run_args_here(mounts: list[Path]) -> list[str]:
    """The guide's line minus what this machine has not (the NPU devices, the Ascend driver paths)."""
    args = ["!--device", "--shm-size=1g", *limits()]
    for opt in guide_options({}):
        if opt.canonical == "--volume" and opt.value and not Path(opt.value.split(":")[0]).exists():
            args.append(f"!-v {opt.value.split(':')[1]}")
    args += [f"-v {p}:{p}:ro" for p in mounts]
    return args


@functools.cache
def built_image() -> str:
    """The image (scripts/build-test-image.sh: the cached test rootfs imported), built once per test run."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build-test-image.sh")], capture_output=True, text=True,
                         timeout=900, check=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]

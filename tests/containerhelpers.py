"""What the container tests share: the test image (built once per run, offline), what it needs to run the stack
(`stack_run_args`), the run line as the agent renders it on this machine (`spec_here`), and the reason to skip
where there is no podman."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = Path(sys.executable)
INTERPRETER_HOME = Path(os.path.realpath(sys.executable)).parents[1]

sys.path.insert(0, str(ROOT / "scripts"))
from local_container_config import local_container_config, stack_run_args  # noqa: E402

from nodeagent.config.container import ContainerConfig  # noqa: E402
from nodeagent.container.render import ContainerSpec, host_facts, render_container  # noqa: E402

__all__ = ["INTERPRETER_HOME", "ROOT", "SKIP_REASON", "VENV_PYTHON", "built_image", "local_container_config",
           "podman_docker_api", "spec_here", "stack_run_args"]

SKIP_REASON = None
if shutil.which("podman") is None:
    SKIP_REASON = "podman is not installed (scripts/test.sh installs it: apt-get install podman runc)"
elif os.geteuid() != 0:
    SKIP_REASON = "podman runs as root on these machines (rootless needs subuids)"


def spec_here(section: ContainerConfig) -> ContainerSpec:
    """The section's run line as the agent renders it here (adapted to this host, which has no NPUs)."""
    return render_container(section, facts=host_facts(section), npu_less=True)


@functools.cache
def built_image() -> str:
    """The image (scripts/build-test-image.sh: the cached test rootfs imported), built once per test run."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build-test-image.sh")], capture_output=True, text=True,
                         timeout=900, check=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


@contextlib.contextmanager
def podman_docker_api() -> Iterator[str]:
    """podman's docker-compatible API on a private socket (`podman system service`), for the docker CLI: there is
    no Docker daemon here. Yields the DOCKER_HOST value; the caller puts it in the environment."""
    folder = Path(tempfile.mkdtemp(prefix="pdapi-"))  # sun_path is 108 bytes at most
    sock = folder / "api.sock"
    service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    host = f"unix://{sock}"
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["docker", "version"], capture_output=True, timeout=10,
                             env={**os.environ, "DOCKER_HOST": host}).returncode != 0:  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError("podman's docker API socket did not answer within 30 s")
            time.sleep(0.2)
        yield host
    finally:
        service.terminate()
        service.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)

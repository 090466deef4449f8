"""Write config/local.yaml's stack in container mode for this machine and print the file's path.

The run line is the guide's minus what a dev box lacks (the NPU devices, the Ascend driver paths that do not
exist here), plus what podman needs here (runc, explicit ulimits: DESIGN §10), the repository with its venv and
the venv's interpreter read-only at their own paths (the stack runs from them inside), the venv first on PATH,
and the agent's home read-write. etcd stays on the host (`container: false`), as an operator may keep it.
Used by `scripts/run-local.sh --container` and the container tests (tests/containerhelpers.py).
  local_container_config.py IMAGE OUT.yaml HOME [NAME]
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
INTERPRETER_HOME = Path(os.path.realpath(sys.executable)).parents[1]
GUIDE_MOUNTS = ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi", "/etc/ascend_install.info",
                "/usr/local/sbin", "/etc/hccn.conf", "/home", "/mnt", "/tmp", "/data",
                "/usr/share/zoneinfo/Asia/Shanghai")  # fmt: skip
"""The host paths of start-docker.sh's `-v` (tests/golden/start-docker.sh)."""


def limits() -> list[str]:
    """podman's default rlimits fail without CAP_SYS_RESOURCE; nproc above kernel.pid_max is refused here too."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], int(Path("/proc/sys/kernel/pid_max").read_text()))
    return [f"--ulimit nofile={nofile}:{nofile}", f"--ulimit nproc={nproc}:{nproc}"]


def run_args_here(mounts: list[Path]) -> list[str]:
    """The guide's line minus what this machine has not, plus `mounts` read-only at their own paths."""
    args = ["!--device", "--shm-size=1g", *limits()]
    for src in GUIDE_MOUNTS:
        if not Path(src).exists():
            args.append(f"!-v {'/etc/localtime' if src.startswith('/usr/share/zoneinfo') else src}")
    return args + [f"-v {p}:{p}:ro" for p in mounts]


def local_container_config(image: str, home: Path, name: str = "dsv4-local") -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "config" / "local.yaml").read_text())
    data["container"] = {
        "engine": "podman", "image": image, "name": name, "runtime": "runc",
        "run_args": [*run_args_here([ROOT, INTERPRETER_HOME]), f"-v {home}:{home}",
                     f"-e PATH={BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    }  # fmt: skip
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

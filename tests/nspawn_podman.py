"""The host's podman (with its conmon and runc) inside a booted systemd container (tests/systemd_container.py), so
the agent can run in container mode as the dsv4-agent unit under a real systemd.

The test rootfs is a bare bookworm: the binaries are bound in read-only from the host (also bookworm), with the
few libraries the rootfs lacks bound at their soname paths (found with ldd, not listed by hand). Images come from
the host's store, bound read-only as podman's `additionalimagestores` (no import per run); the containers' own
storage is a fresh host folder (overlayfs cannot use the container's volatile overlay root as its upper layer).
podman inside uses the container's systemd as its cgroup manager and runc a session keyring, which nspawn
withholds by default: `SystemdContainer(container_engine=True)`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from systemd_container import SystemdContainer

__all__ = ["PodmanBinds", "configure_podman", "podman_binds"]

HOST_IMAGES = "/var/lib/dsv4-host-images"
# podman's helpers and configuration, beside the binaries (a path absent on a host is skipped).
SUPPORT = ("/usr/lib/podman", "/usr/libexec/podman", "/usr/share/containers", "/usr/lib/cni", "/etc/cni")
BINARIES = ("podman", "conmon", "runc")


class PodmanBinds:
    """What `SystemdContainer` must bind for podman to run inside: read-only and read-write `SRC:DST` lists."""

    def __init__(self, ro: list[str], rw: list[str], graphroot: Path) -> None:
        self.ro, self.rw, self.graphroot = ro, rw, graphroot


def _missing_libraries(rootfs: Path, binaries: list[str]) -> dict[str, str]:
    """Each library a binary links that the rootfs lacks: its ldd path → the host file it resolves to."""
    missing: dict[str, str] = {}
    for binary in binaries:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True, timeout=30).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/"):
                lib = parts[2]
                if not (rootfs / lib.lstrip("/")).exists():
                    missing[lib] = os.path.realpath(lib)
    return missing


@contextmanager
def podman_binds(rootfs: Path) -> Iterator[PodmanBinds]:
    """The binds, and a fresh graphroot for the containers made inside (removed afterwards)."""
    binaries = []
    for name in BINARIES:
        found = shutil.which(name, path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        if found is None:
            raise FileNotFoundError(f"{name} is not installed on the host (apt-get install podman runc)")
        binaries.append(f"{os.path.realpath(found)}:{found}")
    helpers = [p for p in SUPPORT if Path(p).exists()]
    libs = _missing_libraries(rootfs, [b.split(":")[0] for b in binaries])
    store = json.loads(subprocess.run(["podman", "info", "--format", "json"], capture_output=True, text=True,
                                      check=True, timeout=60).stdout)["store"]["graphRoot"]  # fmt: skip
    graphroot = Path(tempfile.mkdtemp(prefix="dsv4-nspawn-podman-"))
    ro = [*binaries, *helpers, *(f"{host}:{lib}" for lib, host in libs.items()), f"{store}:{HOST_IMAGES}"]
    try:
        yield PodmanBinds(ro, [f"{graphroot}:/var/lib/containers/storage"], graphroot)
    finally:
        shutil.rmtree(graphroot, ignore_errors=True)


def configure_podman(c: SystemdContainer) -> None:
    """podman's configuration inside: the host's policy and registries, our storage with the host's images."""
    for name in ("policy.json", "registries.conf"):
        host = Path("/etc/containers") / name
        if host.exists():
            c.write_file(f"/etc/containers/{name}", host.read_text())
    c.write_file("/etc/containers/storage.conf", f"""[storage]
driver = "overlay"
runroot = "/run/containers/storage"
graphroot = "/var/lib/containers/storage"
[storage.options]
additionalimagestores = ["{HOST_IMAGES}"]
""")

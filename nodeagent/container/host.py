"""The guide's run line adapted to the host it runs on, each change said: pure decisions over facts read once.

start-docker.sh is written for an A2 server with the Ascend driver and docker. On another host its defaults fail
before anything starts: podman refuses a `--device` or `-v` whose host path is missing (docker creates an empty
folder in its place), crun (podman's default where installed) refuses hybrid cgroups, and podman's default
rlimits need CAP_SYS_RESOURCE. `adapt` changes only start-docker.sh's own options (`RunOption.guide`), never an
operator's run_args or `container.runtime`, and returns each change as an `Adaptation` that preflight, `nodeagentctl
render container`, the agent's log and `/status` show:

- the NPU devices and Ascend driver paths missing on a host whose config says `node.npus: 0` are dropped; on an
  NPU host they stay (preflight FAILs: the driver is missing, and the engine would refuse the line);
- a missing zoneinfo file is dropped (the container keeps its image's time zone: a directory docker would create
  there would break /etc/localtime);
- a missing shared data folder (/home, /mnt, /tmp, /data) is created on the host before the run line, as docker
  does, so that what the stack writes there outlives the container and the line stays the guide's;
- podman without `container.runtime`, whose default runtime is crun, on hybrid cgroups whose unified hierarchy has
  controllers (crun's own condition: libcrun refuses that mode) → `--runtime runc` when runc is installed;
- no CAP_SYS_RESOURCE and no `--ulimit` for nofile/nproc on the line → `--ulimit nofile=H:H` and `--ulimit
  nproc=N:N` at the current hard limits (nproc also at most kernel.pid_max, above which podman's setrlimit fails).

`read_host_facts` is the thin shell (through `hostfacts.Host`, so tests use fixture trees and fake engines).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nodeagent.config.container_options import (
    DATA_MOUNTS,
    DRIVER_MOUNTS,
    GUIDE_DEVICES,
    ZONEINFO,
    RunOption,
    guide_paths,
)

if TYPE_CHECKING:
    from nodeagent.config.container import ContainerConfig
    from nodeagent.node.hostfacts import Host

CAP_SYS_RESOURCE = 24
RUNC_PATHS = ("/usr/bin/runc", "/usr/sbin/runc", "/usr/local/bin/runc", "/usr/local/sbin/runc", "/sbin/runc",
              "/bin/runc")  # fmt: skip
"""Where podman looks for runc (containers.conf's default `runtimes.runc` list)."""


@dataclass(frozen=True)
class HostFacts:
    """What of the host decides the run line. The defaults are an A2 host as the guide expects it (every path
    there, unified cgroups, the capability): nothing adapts."""

    absent: frozenset[str] = frozenset()
    """start-docker.sh's host paths (devices, bind-mount sources) missing on this host."""
    cgroup: str = "unified"
    """unified (cgroup2 at /sys/fs/cgroup), hybrid (v1 controllers and cgroup2 at /sys/fs/cgroup/unified), legacy."""
    unified_controllers: bool = False
    """Hybrid: the unified hierarchy lists controllers (/sys/fs/cgroup/unified/cgroup.controllers not empty)."""
    default_runtime: str | None = None
    """podman's default OCI runtime (`podman info`); read only when the cgroups make it matter."""
    runc: str | None = None
    cap_sys_resource: bool = True
    """In the agent's effective set (CapEff); unknown counts as present."""
    hard_nofile: int | None = None
    hard_nproc: int | None = None
    """None: unlimited or unknown."""
    pid_max: int | None = None

    @property
    def crun_refuses(self) -> bool:
        return self.cgroup == "hybrid" and self.unified_controllers


@dataclass(frozen=True)
class Adaptation:
    topic: str
    """devices, mounts, runtime, ulimits."""
    text: str
    """What changed on the line and why, one line."""


@dataclass(frozen=True)
class Adapted:
    options: tuple[RunOption, ...]
    runtime: str | None
    create: tuple[str, ...] = ()
    """Host folders the agent creates before the run line."""
    notes: tuple[Adaptation, ...] = ()
    problems: tuple[Adaptation, ...] = ()
    """What no adaptation fixes (crun refuses the cgroups and there is no runc): preflight FAILs."""


def _host_path(opt: RunOption) -> str | None:
    if not opt.value:
        return None
    if opt.canonical == "--device":
        return opt.value.split(":")[0]
    if opt.canonical == "--volume" and opt.value.startswith("/"):
        return opt.value.split(":")[0]
    return None


def adapt(options: Sequence[RunOption], engine: str, runtime: str | None, facts: HostFacts,
          npu_less: bool) -> Adapted:  # fmt: skip
    """The line for this host: start-docker.sh's options adapted, `runtime` (the configured one, or None) kept
    when set. `npu_less`: the config says the node has no NPUs (`node.npus: 0`)."""
    keep: list[RunOption] = []
    dropped_dev, dropped_driver, dropped_zone, create = [], [], [], []
    for opt in options:
        path = _host_path(opt)
        if not opt.guide or path is None or path not in facts.absent:
            keep.append(opt)
        elif path in GUIDE_DEVICES and npu_less:
            dropped_dev.append(path)
        elif path in DRIVER_MOUNTS and npu_less:
            dropped_driver.append(path)
        elif path == ZONEINFO:
            dropped_zone.append(path)
        elif path in DATA_MOUNTS:
            create.append(path)
            keep.append(opt)
        else:  # an NPU host without its driver: kept, preflight FAILs
            keep.append(opt)
    notes = []
    if dropped_dev:
        notes.append(Adaptation("devices", f"dropped --device {', '.join(dropped_dev)}: not on this host, and "
                                "node.npus: 0 says it has no NPUs"))  # fmt: skip
    if dropped_driver:
        notes.append(Adaptation("mounts", f"dropped -v {', '.join(dropped_driver)}: the Ascend driver's paths are "
                                "not on this host (node.npus: 0)"))  # fmt: skip
    if dropped_zone:
        notes.append(Adaptation("mounts", f"dropped -v {ZONEINFO}:/etc/localtime: no such file here (no tzdata); the "
                                "container keeps its image's time zone"))  # fmt: skip
    if create:
        notes.append(Adaptation("mounts", f"{', '.join(create)} missing on the host: the agent creates "
                                f"{'it' if len(create) == 1 else 'them'} before the run line, as docker does "
                                "(podman refuses a missing -v source)"))  # fmt: skip
    runtime, problems = _runtime(engine, runtime, facts, notes)
    keep += _ulimits(keep, facts, notes)
    return Adapted(tuple(keep), runtime, tuple(create), tuple(notes), tuple(problems))


def _runtime(engine: str, runtime: str | None, facts: HostFacts,
             notes: list[Adaptation]) -> tuple[str | None, list[Adaptation]]:  # fmt: skip
    if engine != "podman" or runtime is not None or not facts.crun_refuses or facts.default_runtime != "crun":
        return runtime, []
    why = ("podman's default runtime crun refuses this host's hybrid cgroups (cgroup2 at /sys/fs/cgroup/unified "
           "has controllers)")
    if facts.runc is None:
        return None, [Adaptation("runtime", f"{why}, and runc is not installed")]
    notes.append(Adaptation("runtime", f"--runtime runc: {why}"))
    return "runc", []


def _ulimits(options: Sequence[RunOption], facts: HostFacts, notes: list[Adaptation]) -> list[RunOption]:
    if facts.cap_sys_resource:
        return []
    have = {o.key()[1] for o in options if o.canonical == "--ulimit"}
    nproc_caps = [n for n in (facts.hard_nproc, facts.pid_max) if n is not None]
    wanted = {"nofile": facts.hard_nofile, "nproc": min(nproc_caps) if nproc_caps else None}
    added = [RunOption("--ulimit", f"{name}={n}:{n}") for name, n in wanted.items() if name not in have and n]
    if added:
        notes.append(Adaptation("ulimits", f"{' '.join(w for o in added for w in o.words())}: no CAP_SYS_RESOURCE "
                                "here, so the engine's default rlimits would fail (setrlimit); these are the current "
                                "hard limits (nproc at most kernel.pid_max)"))  # fmt: skip
    return added


# ---- reading the facts (the thin shell) ---------------------------------------------------------------------


def cgroup_mode(mounts: str) -> str:
    """/proc/self/mounts → unified, hybrid or legacy (unified when unreadable: nothing to adapt)."""
    fstype = {}
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            fstype[parts[1]] = parts[2]
    root = fstype.get("/sys/fs/cgroup")
    if root is None or root == "cgroup2":
        return "unified"
    return "hybrid" if fstype.get("/sys/fs/cgroup/unified") == "cgroup2" else "legacy"


def has_capability(status: str, cap: int) -> bool | None:
    """Is `cap` in CapEff of a /proc/PID/status text (None: no CapEff line)?"""
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status, re.MULTILINE)
    return bool(int(match[1], 16) >> cap & 1) if match else None


def hard_limits(limits: str) -> dict[str, int | None]:
    """/proc/self/limits → {"nofile": hard, "nproc": hard} (None: unlimited)."""
    out: dict[str, int | None] = {}
    for line in limits.splitlines():
        for label, name in (("Max open files", "nofile"), ("Max processes", "nproc")):
            if line.startswith(label):
                hard = line[len(label):].split()[1]
                out[name] = int(hard) if hard.isdigit() else None
    return out


def read_host_facts(container: ContainerConfig, engine: str, host: Host,
                    paths: Iterable[str] | None = None) -> HostFacts:  # fmt: skip
    """The facts `adapt` needs, read once: file reads and stats, and `podman info` only when podman's default
    runtime decides the line (hybrid cgroups with controllers, no `container.runtime`)."""
    absent = frozenset(p for p in (guide_paths() if paths is None else paths) if not host.file(p).exists())
    mode = cgroup_mode(host.read_text("/proc/self/mounts") or "")
    controllers = bool((host.read_text("/sys/fs/cgroup/unified/cgroup.controllers") or "").strip())
    default_runtime = None
    if engine == "podman" and container.runtime is None and mode == "hybrid" and controllers:
        out = host.run([engine, "info", "--format", "{{.Host.OCIRuntime.Name}}"], timeout=20)
        default_runtime = out.strip() if out else None
    runc = host.which("runc") or next((p for p in RUNC_PATHS if host.file(p).exists()), None)
    limits = hard_limits(host.read_text("/proc/self/limits") or "")
    pid_max = (host.read_text("/proc/sys/kernel/pid_max") or "").strip()
    return HostFacts(
        absent=absent, cgroup=mode, unified_controllers=controllers, default_runtime=default_runtime, runc=runc,
        cap_sys_resource=has_capability(host.read_text("/proc/self/status") or "", CAP_SYS_RESOURCE) is not False,
        hard_nofile=limits.get("nofile"), hard_nproc=limits.get("nproc"),
        pid_max=int(pid_max) if pid_max.isdigit() else None)  # fmt: skip


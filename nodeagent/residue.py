"""What a dead run leaves behind, and removing it before the next start (DESIGN §5, §10).

`plan_start_cleanup` is pure: config in, a `ResiduePlan` of typed actions out. `execute` is the thin shell
that carries a plan out with psutil, shutil and tarfile, logs every action with what it did and how long it
took, and never raises: the supervisor reads the outcomes.

Deletion is fenced twice. `validate_residue_paths` rejects a config whose managed folders are unsafe (the
loader exits 78 with its messages), and `check_deletable` re-checks every path right before it is touched,
after resolving symlinks, against the roots the config owns. Logs are archived before their folders go:
the evidence of why a run broke is not residue.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fnmatch
import os
import pwd
import re
import shutil
import socket
import stat
import sys
import tarfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import psutil
from loguru import logger

from nodeagent.config_model import (
    Config,
    DatasystemComponent,
    EtcdComponent,
    ProcessComponent,
    VllmComponent,
)
from nodeagent.errors import AgentError
from nodeagent.render import component_dir, worker_address

Scope = Literal["start", "redeploy", "failure"]

ENV_COMPONENT = "DSV4_AGENT_COMPONENT"
ENV_CLUSTER = "DSV4_AGENT_CLUSTER"
"""The launcher sets both on every child; they are how leftovers are recognised as ours."""

SHM_DIR = Path("/dev/shm")
SHM_PATTERNS = ("psm_*", "sem.mp-*")
PORT_TIMEOUT_S = 30.0
DEVICE_TIMEOUT_S = 120.0
"""NPU memory can take ~50 s to free after the owning processes die."""
SHM_MIN_AGE_S = 5.0
"""A segment younger than this may belong to a process that has created but not yet mapped it."""
KILL_CONFIRM_S = 5.0


class UnsafePathError(AgentError):
    """A path the agent was about to delete (or manage) is not safe to delete."""


# --------------------------------------------------------------------------------------------------------
# Actions


@dataclass(frozen=True)
class ProcessMatch:
    """How leftovers of one component are recognised; a process matching any clause is ours.

    - `env`: every pair is in its environment (the launcher's markers). Not enough alone: setproctitle,
      which vLLM uses for `VLLM::EngineCore`/`VLLM::Worker_TP<n>`, zeroes what /proc/<pid>/environ shows;
    - `program` + `option`: an argv element named `program` and the option with exactly that value
      (`--opt=V`, `-opt=V`, or `--opt V`) — anchored, so `:2848` never matches `:28481`;
    - `title_prefixes` + `cwd`: a process title starting so (vLLM's `VLLM::EngineCore`) running in `cwd`;
    - `cmdline_prefixes`: the space-joined cmdline starts so;
    - `ports`: it listens on one of them.
    """

    env: tuple[tuple[str, str], ...] = ()
    program: str | None = None
    option: tuple[str, str] | None = None
    title_prefixes: tuple[str, ...] = ()
    cwd: str | None = None
    cmdline_prefixes: tuple[str, ...] = ()
    ports: tuple[int, ...] = ()

    def describe(self) -> str:
        parts = []
        if self.env:
            parts.append("env " + ",".join(f"{k}={v}" for k, v in self.env))
        if self.program and self.option:
            parts.append(f"{self.program} --{self.option[0]}={self.option[1]}")
        if self.title_prefixes and self.cwd:
            parts.append(f"title {'|'.join(self.title_prefixes)}* in {self.cwd}")
        if self.cmdline_prefixes:
            parts.append("cmdline " + " | ".join(repr(p) for p in self.cmdline_prefixes))
        if self.ports:
            parts.append("listening on " + ",".join(map(str, self.ports)))
        return "; ".join(parts) or "nothing"


@dataclass(frozen=True)
class RemoveFile:
    path: Path

    def describe(self) -> str:
        return f"remove file {self.path}"


@dataclass(frozen=True)
class RemoveTree:
    path: Path

    def describe(self) -> str:
        return f"remove folder {self.path}"


@dataclass(frozen=True)
class ArchiveThenRemove:
    """Archive `path` (or only its `evidence` subpaths) to `<archive_dir>/<UTC ts>-<reason>.tar.gz`, keep
    the newest `keep` archives, then remove `path`. If archiving fails nothing is removed."""

    path: Path
    archive_dir: Path
    keep: int = 10
    reason: str = "cleanup"
    evidence: tuple[str, ...] = ()

    def describe(self) -> str:
        what = f"{self.path}/{{{','.join(self.evidence)}}}" if self.evidence else str(self.path)
        return f"archive {what} to {self.archive_dir}, then remove {self.path}"


@dataclass(frozen=True)
class ArchiveEvidence:
    """Archive the logs of a failed run, leaving them in place (a failure's evidence is not residue)."""

    paths: tuple[Path, ...]
    archive_dir: Path
    keep: int = 10
    reason: str = "failure"

    def describe(self) -> str:
        return f"archive {', '.join(str(p) for p in self.paths)} to {self.archive_dir}"


@dataclass(frozen=True)
class KillProcesses:
    match: ProcessMatch
    grace_s: float = 10.0

    def describe(self) -> str:
        return f"kill leftover processes ({self.match.describe()})"


@dataclass(frozen=True)
class WaitPortsFree:
    ports: tuple[int, ...]
    timeout_s: float = PORT_TIMEOUT_S

    def describe(self) -> str:
        return f"wait for ports {','.join(map(str, self.ports))} to be free"


@dataclass(frozen=True)
class WaitDevicesFree:
    """Wait until `npu-smi info` lists no process on any NPU; skipped where npu-smi does not exist."""

    timeout_s: float = DEVICE_TIMEOUT_S

    def describe(self) -> str:
        return "wait for NPU memory to be free"


@dataclass(frozen=True)
class RemoveShmSegments:
    """Remove shared-memory files matching `patterns` that no live process maps or holds open."""

    patterns: tuple[str, ...] = SHM_PATTERNS
    shm_dir: Path = SHM_DIR
    min_age_s: float = SHM_MIN_AGE_S

    def describe(self) -> str:
        return f"remove unused {','.join(self.patterns)} in {self.shm_dir}"


ResidueAction = (
    RemoveFile
    | RemoveTree
    | ArchiveThenRemove
    | ArchiveEvidence
    | KillProcesses
    | WaitPortsFree
    | WaitDevicesFree
    | RemoveShmSegments
)


@dataclass(frozen=True)
class ResiduePlan:
    component: str
    scope: Scope
    actions: tuple[ResidueAction, ...]
    roots: tuple[Path, ...]
    """Deletion is allowed only at or under these (re-checked at execution, after resolving symlinks)."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ActionOutcome:
    action: ResidueAction
    ok: bool
    detail: str
    duration_s: float


# --------------------------------------------------------------------------------------------------------
# Where each component lives (shared conventions with the launcher)


def component_workdir(name: str, comp: Any, config: Config) -> Path:
    """The component's cwd, as render gives it: its `workdir`, else its folder under the agent's state
    (dscli's `./datasystem` lands here)."""
    return comp.workdir if comp.workdir is not None else component_dir(config, name)


def component_tmpdir(name: str, config: Config) -> Path:
    """The private TMPDIR render gives every child (vLLM leaves its IPC socket files there)."""
    return component_dir(config, name) / "tmp"


def archive_dir(name: str, config: Config) -> Path:
    return config.agent.state_dir / "archive" / name


def client_log_dir(comp: DatasystemComponent) -> Path:
    """DATASYSTEM_CLIENT_LOG_DIR, or the client library's default `~/.datasystem`."""
    return comp.client_log_dir if comp.client_log_dir is not None else Path.home() / ".datasystem"


def component_ports(comp: Any) -> tuple[int, ...]:
    """The ports a component binds on this node; a start waits until they are free."""
    if isinstance(comp, EtcdComponent):
        return (comp.client_port, comp.peer_port)
    if isinstance(comp, DatasystemComponent):
        return (comp.worker_port,)
    if isinstance(comp, VllmComponent):
        rpc = comp.data_parallel_rpc_port
        return (comp.port,) if rpc is None or comp.headless else (comp.port, rpc)
    if isinstance(comp, ProcessComponent):
        return tuple(dict.fromkeys(comp.ports))
    return ()


def process_match(name: str, comp: Any, config: Config) -> ProcessMatch:
    """What identifies leftovers of this component (see ProcessMatch)."""
    env = ((ENV_COMPONENT, name), (ENV_CLUSTER, config.cluster.name))
    if isinstance(comp, DatasystemComponent):
        return ProcessMatch(
            env=env, program="datasystem_worker", option=("worker_address", worker_address(config, comp))
        )
    if isinstance(comp, EtcdComponent):
        return ProcessMatch(env=env, program="etcd", option=("data-dir", str(comp.data_dir)))
    if isinstance(comp, VllmComponent):
        # Orphaned EngineCore/Workers hold device memory while the API port is already free (DESIGN §10).
        return ProcessMatch(
            env=env,
            title_prefixes=("VLLM::",),
            cwd=str(component_workdir(name, comp, config)),
            ports=(comp.port,),
        )
    if isinstance(comp, ProcessComponent):
        prefixes = tuple(p for p in comp.process_match if p.strip())
        return ProcessMatch(env=env, cmdline_prefixes=prefixes, ports=component_ports(comp))
    raise TypeError(f"unknown component type {type(comp).__name__}")


# --------------------------------------------------------------------------------------------------------
# The plan (pure)


def plan_start_cleanup(
    name: str,
    component: Any,
    config: Config,
    scope: Scope = "start",
    *,
    wipe_etcd: bool = False,
    reason: str | None = None,
) -> ResiduePlan:
    """Residue to remove before (re)starting `name`. `redeploy` adds the node recovery's deeper cleanup.

    `wipe_etcd` (redeploy only) deletes the etcd data dir; it invalidates every worker's registration, so
    it is a cluster decision and only ever done on the master.
    """
    if scope not in ("start", "redeploy"):
        raise ValueError(f"scope must be 'start' or 'redeploy', got {scope!r}")
    reason = reason or scope
    actions: list[ResidueAction] = [
        KillProcesses(process_match(name, component, config), component.stop_grace_s)
    ]
    notes: list[str] = []
    ports = component_ports(component)
    if ports:
        actions.append(WaitPortsFree(ports))

    if isinstance(component, DatasystemComponent):
        ds_dir = component_workdir(name, component, config) / "datasystem"
        actions.append(RemoveFile(component.liveness_check_path))
        if scope == "redeploy":
            keep = config.agent.archive_keep
            archive = archive_dir(name, config)
            actions.append(ArchiveThenRemove(ds_dir, archive, keep, reason, evidence=("logs",)))
            actions.append(ArchiveThenRemove(client_log_dir(component), archive, keep, f"{reason}-client"))
        else:
            # A stale ready file would make a later dscli start believe at once; uds sockets pile up.
            actions += [
                RemoveFile(ds_dir / "probe" / "healthy"),
                RemoveFile(ds_dir / "probe" / "ready"),
                RemoveTree(ds_dir / "uds"),
            ]
    elif isinstance(component, VllmComponent):
        # Killed runs leave 160-250 MB psm_* segments each, and device memory frees only slowly.
        actions += [WaitDevicesFree(), RemoveShmSegments()]
    elif isinstance(component, EtcdComponent) and scope == "redeploy":
        if not wipe_etcd:
            notes.append(f"etcd data dir {component.data_dir} kept (no cluster-level wipe requested)")
        elif config.node.role != "master":
            notes.append(f"etcd data dir {component.data_dir} kept: only the master wipes etcd")
        else:
            actions.append(RemoveTree(component.data_dir))
    elif isinstance(component, EtcdComponent) and wipe_etcd:
        notes.append("wipe_etcd ignored: only a redeploy wipes etcd")
    actions.append(RemoveTree(component_tmpdir(name, config)))
    return ResiduePlan(name, scope, tuple(actions), tuple(residue_roots(config)), tuple(notes))


def plan_failure_evidence(name: str, component: Any, config: Config, reason: str) -> ResiduePlan:
    """After a failure, before cleanup: archive what explains it — the component's log file (journald keeps
    its own copy under systemd) and, for the datasystem worker, its own logs folder."""
    from nodeagent.logsink import log_path

    paths = [log_path(config.agent.log_dir, name)]
    if isinstance(component, DatasystemComponent):
        paths.append(component_workdir(name, component, config) / "datasystem" / "logs")
    action = ArchiveEvidence(tuple(paths), archive_dir(name, config), config.agent.archive_keep, reason)
    return ResiduePlan(name, "failure", (action,), tuple(residue_roots(config)), ())


def residue_roots(config: Config) -> list[Path]:
    """The folders (and the one file) the agent owns and may delete in."""
    roots: list[Path] = [config.agent.state_dir]
    for name, comp in config.components.items():
        if isinstance(comp, EtcdComponent):
            roots.append(comp.data_dir)
        elif isinstance(comp, DatasystemComponent):
            roots += [
                component_workdir(name, comp, config) / "datasystem",
                comp.liveness_check_path,
                client_log_dir(comp),
            ]
    roots += config.agent.residue_roots
    return list(dict.fromkeys(roots))


# --------------------------------------------------------------------------------------------------------
# Path safety

_SYSTEM_TREES = tuple(
    Path(p)
    for p in (
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/proc",
        "/sbin",
        "/sys",
        "/usr",
    )
)
"""Nothing at or under these is ever deleted."""
_SYSTEM_FOLDERS = frozenset(
    Path(p)
    for p in (
        "/home",
        "/media",
        "/mnt",
        "/opt",
        "/run",
        "/snap",
        "/srv",
        "/tmp",
        "/var",
        "/var/cache",
        "/var/lib",
        "/var/log",
        "/var/run",
        "/var/tmp",
        "/var/spool",
        "/var/mail",
        "/lost+found",
    )
)
"""These themselves are never deleted; things inside them may be."""


@lru_cache(maxsize=1)
def _home_folders() -> frozenset[Path]:
    homes = {Path("/root"), Path.home()}
    with contextlib.suppress(OSError):
        homes.update(Path(u.pw_dir) for u in pwd.getpwall() if u.pw_uid == 0 or 1000 <= u.pw_uid < 65534)
    return frozenset(Path(os.path.normpath(h)) for h in homes if h.is_absolute())


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def unsafe_reason(path: Path) -> str | None:
    """Why deleting `path` itself (absolute) is never acceptable, else None."""
    if path == Path("/"):
        return "not a safe folder to delete"
    if path in _home_folders() or path.parent == Path("/home"):
        return "not a safe folder to delete (a home folder)"
    in_shm = SHM_DIR in path.parents  # e.g. a liveness file on tmpfs; /dev/shm itself stays refused
    for top in _SYSTEM_TREES:
        if path == top:
            return "not a safe folder to delete (a system folder)"
        if _within(path, top) and not in_shm:
            return f"not a safe folder to delete (inside the system folder '{top}')"
    if path in _SYSTEM_FOLDERS or path == SHM_DIR:
        return "not a safe folder to delete (a system folder)"
    return None


def unsafe_root_reason(root: Path) -> str | None:
    """Why `root` cannot fence deletions, else None. A root is deleted *in*, so `/tmp` or a home may be
    one; `/` (it would fence nothing) and system trees may not."""
    if root == Path("/"):
        return "not a safe folder to delete"
    for top in _SYSTEM_TREES:
        if _within(root, top):
            return unsafe_reason(root)
    return None


def _real(path: Path) -> Path:
    """Resolve every symlink but the last component: deleting a symlink removes the link, not its target."""
    if path == Path(path.anchor):
        return path
    return path.parent.resolve() / path.name


def _usable_roots(roots: Iterable[Path]) -> list[Path]:
    usable = []
    for root in roots:
        for candidate in (_real(root), root.resolve()):
            if unsafe_root_reason(candidate) is None and candidate not in usable:
                usable.append(candidate)
    return usable


def check_deletable(path: Path, roots: Iterable[Path]) -> None:
    """Raise UnsafePathError unless `path` may be deleted: safe itself and, after symlinks, inside a root."""
    path = Path(path)
    if not path.is_absolute():
        raise UnsafePathError(f"refusing to delete '{path}': not an absolute path")
    if ".." in path.parts:
        raise UnsafePathError(f"refusing to delete '{path}': contains '..'")
    real = _real(path)
    why = unsafe_reason(path) or unsafe_reason(real)
    if why:
        shown = f"'{path}'" if real == path else f"'{path}' (resolves to '{real}')"
        raise UnsafePathError(f"refusing to delete {shown}: {why}")
    roots = [Path(r) for r in roots if Path(r).is_absolute()]
    if any(_within(real, root) for root in _usable_roots(roots)):
        return
    if any(_within(path, root) for root in roots):
        raise UnsafePathError(
            f"refusing to delete '{path}': it resolves through a symlink to '{real}',"
            " outside the configured roots"
        )
    shown = ", ".join(str(r) for r in roots) or "none"
    raise UnsafePathError(f"refusing to delete '{path}': outside the configured roots ({shown})")


def validate_residue_paths(config: Config) -> list[str]:
    """Errors for every managed path that is unsafe; the config loader exits 78 with them.

    Folders the agent deletes (etcd data, the worker's `datasystem/`, the liveness file, client logs) must be
    safe to delete themselves; roots (state_dir, residue_roots) must be able to fence deletions.
    """
    targets: list[tuple[str, Path]] = []
    roots: list[tuple[str, Path]] = [("agent.state_dir", config.agent.state_dir)]
    roots += [(f"agent.residue_roots[{i}]", p) for i, p in enumerate(config.agent.residue_roots)]
    for name, comp in config.components.items():
        key = f"components.{name}"
        if isinstance(comp, EtcdComponent):
            targets.append((f"{key}.data_dir", comp.data_dir))
        elif isinstance(comp, DatasystemComponent):
            targets.append((f"{key}.workdir", component_workdir(name, comp, config) / "datasystem"))
            targets.append((f"{key}.liveness_check_path", comp.liveness_check_path))
            targets.append((f"{key}.client_log_dir", client_log_dir(comp)))
    errors = []
    for rule, checks in ((unsafe_reason, targets), (unsafe_root_reason, roots)):
        for key, path in checks:
            if not path.is_absolute():
                errors.append(f"{key}: refusing to manage '{path}': not an absolute path")
                continue
            path = Path(os.path.normpath(path))
            real = path.resolve()
            why = rule(path) or rule(real)
            if why:
                shown = f"'{path}'" if real == path else f"'{path}' (resolves to '{real}')"
                errors.append(f"{key}: refusing to manage {shown}: {why}")
    return errors


# --------------------------------------------------------------------------------------------------------
# Process matching (pure)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    cmdline: tuple[str, ...]
    environ: Mapping[str, str] | None = None
    cwd: str | None = None
    listen_ports: frozenset[int] = frozenset()


def _has_option(argv: Sequence[str], option: str, value: str) -> bool:
    for i, arg in enumerate(argv):
        for dashes in ("--", "-"):
            flag = dashes + option
            if arg == f"{flag}={value}" or (arg == flag and i + 1 < len(argv) and argv[i + 1] == value):
                return True
    return False


def _joined(argv: Iterable[str]) -> str:
    """The cmdline as one string; a process title leaves empty padding arguments behind."""
    return " ".join(a for a in argv if a)


def match_reason(info: ProcInfo, match: ProcessMatch) -> str | None:
    """Why `info` is a leftover of the matched component, or None."""
    if match.env and info.environ is not None and all(info.environ.get(k) == v for k, v in match.env):
        return "agent env markers"
    argv = info.cmdline
    if match.program and match.option and any(os.path.basename(a) == match.program for a in argv):
        option, value = match.option
        if _has_option(argv, option, value):
            return f"{match.program} --{option}={value}"
    joined = _joined(argv)
    if match.cwd and info.cwd == match.cwd:
        for prefix in match.title_prefixes:
            if joined.startswith(prefix):
                return f"title {prefix}* in {match.cwd}"
    for prefix in match.cmdline_prefixes:
        if prefix.strip() and joined.startswith(prefix):
            return f"cmdline starts with {prefix!r}"
    ports = info.listen_ports.intersection(match.ports)
    if ports:
        return f"listens on {','.join(map(str, sorted(ports)))}"
    return None


# --------------------------------------------------------------------------------------------------------
# The executor (OS work)


async def execute(plan: ResiduePlan) -> list[ActionOutcome]:
    """Carry out a plan in order; every action gets an outcome and a log line, none raises."""
    log = logger.bind(component=plan.component, event="residue")
    for note in plan.notes:
        log.info(f"{plan.scope} cleanup: {note}")
    outcomes = []
    for action in plan.actions:
        started = time.monotonic()
        try:
            ok, detail = await _run(action, plan.roots)
        except UnsafePathError as exc:
            ok, detail = False, str(exc)
        except Exception as exc:  # cleanup reports; the supervisor decides what a failure means
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        outcome = ActionOutcome(action, ok, detail, time.monotonic() - started)
        outcomes.append(outcome)
        bound = log.bind(action=type(action).__name__, ok=ok, duration_s=round(outcome.duration_s, 3))
        line = f"{plan.scope} cleanup: {action.describe()}: {detail} ({outcome.duration_s:.2f}s)"
        if ok:
            bound.info(line)
        else:
            bound.warning(line)
    return outcomes


async def _run(action: ResidueAction, roots: Sequence[Path]) -> tuple[bool, str]:
    if isinstance(action, RemoveFile):
        return _remove_file(action.path, roots)
    if isinstance(action, RemoveTree):
        return await asyncio.to_thread(_remove_tree, action.path, roots)
    if isinstance(action, ArchiveThenRemove):
        return await asyncio.to_thread(_archive_then_remove, action, roots)
    if isinstance(action, ArchiveEvidence):
        return await asyncio.to_thread(_archive_evidence, action)
    if isinstance(action, KillProcesses):
        return await asyncio.to_thread(_kill_processes, action)
    if isinstance(action, WaitPortsFree):
        return await _wait_ports_free(action)
    if isinstance(action, WaitDevicesFree):
        return await _wait_devices_free(action)
    if isinstance(action, RemoveShmSegments):
        return await asyncio.to_thread(_remove_shm_segments, action)
    raise TypeError(f"unknown residue action {action!r}")


def _remove_file(path: Path, roots: Sequence[Path]) -> tuple[bool, str]:
    check_deletable(path, roots)
    try:
        path.unlink()
    except FileNotFoundError:
        return True, "absent"
    except IsADirectoryError:
        return False, "is a folder, not a file: left in place"
    return True, "removed"


def _remove_tree(path: Path, roots: Sequence[Path]) -> tuple[bool, str]:
    check_deletable(path, roots)
    if not os.path.lexists(path):
        return True, "absent"
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return True, "removed (not a folder)"
    files = _rmtree(path)
    return True, f"removed ({files} files)"


def _rmtree(path: Path) -> int:
    """shutil.rmtree that tolerates entries vanishing under it (a dying process may still delete files)."""
    files = sum(len(names) for _, _, names in os.walk(path))

    def ignore_missing(func: Any, name: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=ignore_missing)
    else:
        shutil.rmtree(path, onerror=lambda func, name, info: ignore_missing(func, name, info[1]))
    return files


_ARCHIVE_NAME = re.compile(r"^\d{8}T\d{6}\.\d{3}Z-[A-Za-z0-9_.-]+\.tar\.gz$")


def archive_name(when: datetime, reason: str) -> str:
    """`<UTC timestamp>-<reason>.tar.gz`; names sort chronologically."""
    when = when.astimezone(UTC)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", reason).strip("._") or "cleanup"
    return f"{when:%Y%m%dT%H%M%S}.{when.microsecond // 1000:03d}Z-{safe}.tar.gz"


def archives_to_prune(names: Iterable[str], keep: int) -> list[str]:
    """The archive names beyond the newest `keep` (names not made by `archive_name` are left alone)."""
    ours = sorted(n for n in names if _ARCHIVE_NAME.match(n))
    return ours[: max(0, len(ours) - keep)]


def _archive_then_remove(action: ArchiveThenRemove, roots: Sequence[Path]) -> tuple[bool, str]:
    path = action.path
    check_deletable(path, roots)
    check_deletable(action.archive_dir, roots)
    if not os.path.lexists(path):
        return True, "absent, nothing to archive"
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return True, "removed (not a folder, nothing archived)"
    sources = [path / rel for rel in action.evidence] if action.evidence else [path]
    files = [f for src in sources for f in _walk_files(src)]
    detail = "nothing to archive"
    if files:
        try:
            archive, count = _write_archive(action.archive_dir, action.reason, files, action.path.parent)
        except OSError as exc:
            return False, f"archive failed ({exc}); {path} kept"
        pruned = _prune_archives(action.archive_dir, action.keep)
        detail = f"archived {count} files to {archive}" + (f", pruned {len(pruned)} old" if pruned else "")
    removed = _rmtree(path)
    return True, f"{detail}; removed ({removed} files)"


def _walk_files(src: Path) -> list[Path]:
    if src.is_symlink() or src.is_file():
        return [src]
    return [Path(d) / n for d, _, names in os.walk(src) for n in sorted(names)]


def _archive_evidence(action: ArchiveEvidence) -> tuple[bool, str]:
    files = [f for src in action.paths if os.path.lexists(src) for f in _walk_files(src)]
    if not files:
        return True, "nothing to archive"
    try:
        archive, count = _write_archive(action.archive_dir, action.reason, files, Path("/"))
    except OSError as exc:
        return False, f"archive failed: {exc}"
    pruned = _prune_archives(action.archive_dir, action.keep)
    return True, f"archived {count} files to {archive}" + (f", pruned {len(pruned)} old" if pruned else "")


def _write_archive(archive_dir: Path, reason: str, files: list[Path], base: Path) -> tuple[Path, int]:
    archive_dir.mkdir(parents=True, exist_ok=True)
    name = archive_name(datetime.now(UTC), reason)
    target = archive_dir / name
    n = 1
    while target.exists():
        target = archive_dir / name.replace(".tar.gz", f"-{n}.tar.gz")
        n += 1
    partial = target.with_name(target.name + ".partial")
    count = 0
    try:
        with tarfile.open(partial, "w:gz", compresslevel=1) as tar:
            for file in files:
                try:
                    info = tar.gettarinfo(file, arcname=str(file.relative_to(base)))
                except FileNotFoundError:
                    continue  # rotated away while we walked
                if info is None or not (info.isreg() or info.issym()):
                    continue  # sockets, fifos: not evidence
                if info.isreg():
                    try:
                        with open(file, "rb") as fh:
                            tar.addfile(info, fh)
                    except FileNotFoundError:
                        continue
                else:
                    tar.addfile(info)
                count += 1
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return target, count


def _prune_archives(folder: Path, keep: int) -> list[str]:
    pruned = archives_to_prune(os.listdir(folder), keep)
    for name in pruned:
        (folder / name).unlink(missing_ok=True)
    return pruned


def _ancestors() -> set[int]:
    """This process and its ancestors: never killed, whatever they look like."""
    pids = {os.getpid()}
    with contextlib.suppress(psutil.Error):
        pids.update(p.pid for p in psutil.Process().parents())
    return pids


def _listening_ports() -> dict[int, set[int]]:
    ports: dict[int, set[int]] = {}
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid is not None and conn.laddr:
            ports.setdefault(conn.pid, set()).add(conn.laddr.port)
    return ports


def find_leftovers(match: ProcessMatch) -> list[tuple[psutil.Process, str]]:
    """Live processes matching `match` (with why), excluding this process and its ancestors."""
    protected = _ancestors()
    listeners = _listening_ports() if match.ports else {}
    attrs = ["cmdline"]
    if match.env:
        attrs.append("environ")
    if match.cwd:
        attrs.append("cwd")
    found = []
    for proc in psutil.process_iter(attrs, ad_value=None):
        if proc.pid in protected or proc.pid <= 1:
            continue
        info = ProcInfo(
            pid=proc.pid,
            cmdline=tuple(proc.info.get("cmdline") or ()),
            environ=proc.info.get("environ"),
            cwd=proc.info.get("cwd"),
            listen_ports=frozenset(listeners.get(proc.pid, ())),
        )
        why = match_reason(info, match)
        if why:
            found.append((proc, why))
    return found


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _kill_processes(action: KillProcesses) -> tuple[bool, str]:
    leftovers = find_leftovers(action.match)
    if not leftovers:
        return True, "none found"
    protected = _ancestors()
    targets: dict[int, psutil.Process] = {}
    labels: list[str] = []
    for proc, why in leftovers:
        targets[proc.pid] = proc
        labels.append(f"{proc.pid} {_joined(proc.info.get('cmdline') or ())[:80]!r} ({why})")
        try:  # snapshot the tree first: orphans re-parent to PID 1 once their parent dies
            for child in proc.children(recursive=True):
                if child.pid not in protected:
                    targets.setdefault(child.pid, child)
        except psutil.Error:
            pass
    procs = list(targets.values())
    for proc in procs:
        _signal(proc, "terminate")
    _, alive = psutil.wait_procs(procs, timeout=action.grace_s)
    alive = [p for p in alive if not _gone(p)]
    killed = [p.pid for p in alive]
    for proc in alive:
        _signal(proc, "kill")
    _, alive = psutil.wait_procs(alive, timeout=KILL_CONFIRM_S)
    alive = [p for p in alive if not _gone(p)]
    detail = f"stopped {len(procs)}: " + "; ".join(labels)
    if len(procs) > len(leftovers):
        detail += f" (+{len(procs) - len(leftovers)} descendants)"
    if killed:
        detail += f"; SIGKILL after {action.grace_s:g}s grace: {killed}"
    if alive:
        return False, detail + f"; still alive: {[p.pid for p in alive]}"
    return True, detail


def _signal(proc: psutil.Process, how: str) -> None:
    with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        proc.terminate() if how == "terminate" else proc.kill()  # a denied one shows up as still alive


def port_in_use(port: int) -> bool:
    """Busy if a wildcard bind, IPv4 or IPv6, fails with EADDRINUSE (SO_REUSEADDR, as servers bind:
    TIME_WAIT leftovers do not count)."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
        finally:
            sock.close()
    return False


def _port_holders(ports: Iterable[int]) -> str:
    wanted = set(ports)
    holders = []
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port in wanted:
                who = "?"
                if conn.pid:
                    try:
                        who = f"pid {conn.pid} {' '.join(psutil.Process(conn.pid).cmdline())[:60]!r}"
                    except psutil.Error:
                        who = f"pid {conn.pid}"
                holders.append(f"{conn.laddr.port} held by {who}")
    except psutil.Error:
        pass
    return "; ".join(holders)


async def _wait_ports_free(action: WaitPortsFree) -> tuple[bool, str]:
    deadline = time.monotonic() + action.timeout_s
    while True:
        busy = [p for p in action.ports if port_in_use(p)]
        if not busy:
            return True, "free"
        if time.monotonic() >= deadline:
            holders = await asyncio.to_thread(_port_holders, busy)
            return False, f"still in use after {action.timeout_s:g}s: {busy}" + (
                f" ({holders})" if holders else ""
            )
        await asyncio.sleep(0.1)


_NPU_PROCESS = re.compile(r"^\|\s*(\d+)\s+(\d+)\s*\|\s*(\d+)\s*\|\s*(.*?)\s*\|\s*(\d+)\s*\|?\s*$")


def npu_processes(text: str) -> list[tuple[int, int, str, int]]:
    """(npu, pid, name, memory MB) rows of `npu-smi info`'s process table."""
    rows = []
    in_table = False
    for line in text.splitlines():
        if "Process id" in line:
            in_table = True
            continue
        match = _NPU_PROCESS.match(line) if in_table else None
        if match:
            rows.append((int(match[1]), int(match[3]), match[4], int(match[5])))
    return rows


async def _wait_devices_free(action: WaitDevicesFree) -> tuple[bool, str]:
    npu_smi = shutil.which("npu-smi")
    if npu_smi is None:
        return True, "skipped: npu-smi not found"
    deadline = time.monotonic() + action.timeout_s
    while True:
        proc = await asyncio.create_subprocess_exec(
            npu_smi, "info", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            out = b""
        rows = npu_processes(out.decode(errors="replace")) if proc.returncode == 0 else None
        if rows == []:
            return True, "no process holds NPU memory"
        if time.monotonic() >= deadline:
            if rows is None:
                return (
                    False,
                    f"npu-smi info failed (exit {proc.returncode}): {out.decode(errors='replace')[:200]}",
                )
            held = ", ".join(f"npu {n} pid {pid} {name} {mb} MB" for n, pid, name, mb in rows)
            return False, f"still held after {action.timeout_s:g}s: {held}"
        await asyncio.sleep(2.0)


def _paths_in_use(folder: Path) -> set[str]:
    """Files under `folder` that some live process maps or holds open (from /proc/*/maps and fd links)."""
    prefix = str(folder).rstrip("/") + "/"
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(prefix):
                        used.add(parts[5].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefix):
                    used.add(target.removesuffix(" (deleted)"))
        except OSError:
            pass
    return used


def _remove_shm_segments(action: RemoveShmSegments) -> tuple[bool, str]:
    folder = Path(os.path.realpath(action.shm_dir))
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return True, f"{folder} absent"
    candidates = []
    now = time.time()
    me = os.geteuid()
    for name in names:
        if not any(fnmatch.fnmatchcase(name, p) for p in action.patterns):
            continue
        try:
            st = os.lstat(folder / name)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or (me != 0 and st.st_uid != me):
            continue
        if now - st.st_mtime < action.min_age_s:
            continue
        candidates.append((name, st.st_size))
    if not candidates:
        return True, "none unused"
    in_use = _paths_in_use(folder)
    removed, kept, freed = [], [], 0
    for name, size in candidates:
        if str(folder / name) in in_use:
            kept.append(name)
            continue
        try:
            (folder / name).unlink()
        except FileNotFoundError:
            continue
        removed.append(name)
        freed += size
    detail = f"removed {len(removed)} ({freed / 2**20:.0f} MB)"
    if removed:
        detail += ": " + ", ".join(removed[:20]) + (" ..." if len(removed) > 20 else "")
    if kept:
        detail += f"; kept {len(kept)} in use: " + ", ".join(kept[:20])
    return True, detail

"""What a dead run leaves behind, as a pure plan (DESIGN §5, §10): config in, typed actions out.

`plan_start_cleanup` lists what to remove, kill and wait for before a (re)start or a node redeploy;
`residue.execute` carries a plan out. (A failure's evidence is a post-mortem bundle: postmortem.py.)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nodeagent.config.model import (
    Config,
    DatasystemComponent,
    EtcdComponent,
    ProcessComponent,
    ProxyComponent,
    VllmComponent,
)
from nodeagent.core.errors import AgentError
from nodeagent.npu.hbm_baseline import baseline_path
from nodeagent.render.launch import component_dir, component_tmpdir, worker_address

Scope = Literal["start", "redeploy", "failure"]

ENV_COMPONENT = "DSV4_AGENT_COMPONENT"
ENV_CLUSTER = "DSV4_AGENT_CLUSTER"
ENV_STATE = "DSV4_AGENT_STATE"
"""The launcher sets both on every child; they are how leftovers are recognised as ours."""

SHM_DIR = Path("/dev/shm")
SHM_PATTERNS = ("psm_*", "sem.mp-*")
PORT_TIMEOUT_S = 3.0
"""Enough for the sockets of our own just-killed leftovers to close; a port still busy then is held by a
process we cannot prove is ours, and the start is held (never a kill) until it frees."""
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
    - `cmdline_prefixes`: the space-joined cmdline starts so (an operator-declared `process_match`);
    - `records`: the (pid, start time) this agent recorded for the component's last run.

    Listening on one of the component's ports is deliberately *not* a clause: a foreign process on our port is
    never signalled — the start is held with the holder named until the port frees (supervisor, StartHeld).
    """

    env: tuple[tuple[str, str], ...] = ()
    program: str | None = None
    option: tuple[str, str] | None = None
    title_prefixes: tuple[str, ...] = ()
    cwd: str | None = None
    cmdline_prefixes: tuple[str, ...] = ()
    records: tuple[tuple[int, float], ...] = ()

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
        if self.records:
            parts.append("recorded " + ",".join(f"pid {pid}" for pid, _ in self.records))
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
    """The clean slate before a vLLM start: no process on any NPU, and each NPU's HBM usage back to its idle
    baseline (within `tolerance_mb`), waited for up to `timeout_s` (device memory can take ~50 s to come back
    after an engine exits). The baseline is the lowest usage seen with no process on the chip, kept in
    `baseline_file`. Skipped where npu-smi does not exist."""

    timeout_s: float = DEVICE_TIMEOUT_S
    baseline_file: Path | None = None
    tolerance_mb: int = 512
    devices: tuple[int, ...] | None = None
    """Only these NPUs (a DP rank's `visible_devices`: its neighbours run on the others); None: every NPU."""
    npu_smi: Path | None = None
    """The node's configured npu-smi (`node.npu_health.npu_smi`); None: on PATH, else the driver's place."""

    def describe(self) -> str:
        which = f" {','.join(map(str, self.devices))}" if self.devices is not None else "s"
        return f"wait for a clean slate on the NPU{which} (no process, HBM back to idle)"


@dataclass(frozen=True)
class RemoveShmSegments:
    """Remove shared-memory files matching `patterns` that no live process maps or holds open."""

    patterns: tuple[str, ...] = SHM_PATTERNS
    shm_dir: Path = SHM_DIR
    min_age_s: float = SHM_MIN_AGE_S
    seen_as: Path | None = None
    """The folder as the processes using it see it, when `shm_dir` reaches it from outside: a container's
    /dev/shm through `/proc/<its init>/root/dev/shm` (its processes map `/dev/shm/...`)."""

    def describe(self) -> str:
        where = f"{self.seen_as} of the container ({self.shm_dir})" if self.seen_as else str(self.shm_dir)
        return f"remove unused {','.join(self.patterns)} in {where}"


ResidueAction = (
    RemoveFile
    | RemoveTree
    | ArchiveThenRemove
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
    held: bool = False
    """Not ok because of something that is not ours (a foreign process): hold the start, never kill."""


# --------------------------------------------------------------------------------------------------------
# Where each component lives (shared conventions with the launcher)


def component_workdir(name: str, comp: Any, config: Config) -> Path:
    """The component's cwd, as render gives it: its `workdir`, else its folder under the agent's state
    (dscli's `./datasystem` lands here)."""
    return comp.workdir if comp.workdir is not None else component_dir(config, name)


def archive_dir(name: str, config: Config) -> Path:
    return config.agent.state_dir / "archive" / name


def client_log_dir(comp: DatasystemComponent) -> Path:
    """DATASYSTEM_CLIENT_LOG_DIR, or the client library's default `~/.datasystem`."""
    return comp.client_log_dir if comp.client_log_dir is not None else Path.home() / ".datasystem"


def hbm_dirty(used: Mapping[int, int], baseline: Mapping[int, int], tolerance_mb: int) -> list[str]:
    """Chips whose HBM usage is not back to their idle baseline: `npu 3 HBM 41200 MB (idle 3162 + 512)`."""
    return [f"npu {npu} HBM {mb} MB (idle {baseline[npu]} + {tolerance_mb})"
            for npu, mb in sorted(used.items()) if npu in baseline and mb > baseline[npu] + tolerance_mb]


def own_log_files(name: str, comp: Any, config: Config) -> list[Path]:
    """Logs a component writes itself, beside its output: the datasystem worker's real logs (dscli prints three
    lines; the worker's stderr is a dead pipe once dscli exits)."""
    if isinstance(comp, DatasystemComponent):
        return [component_workdir(name, comp, config) / "datasystem" / "logs" / "datasystem_worker.INFO.log"]
    return []


def component_ports(comp: Any) -> tuple[int, ...]:
    """The ports a component binds on this node; a start waits until they are free."""
    if isinstance(comp, EtcdComponent):
        return (comp.client_port, comp.peer_port)
    if isinstance(comp, DatasystemComponent):
        return (comp.worker_port,)
    if isinstance(comp, VllmComponent):
        if comp.headless:  # no API server; the head owns the group's rpc port
            return ()
        rpc = comp.data_parallel_rpc_port
        # External launch: only rank 0 binds the rpc port; the other ranks of its node connect to it.
        owns_rpc = rpc is not None and not comp.data_parallel_rank
        return (comp.port, rpc) if owns_rpc and rpc is not None else (comp.port,)
    if isinstance(comp, ProxyComponent):
        return (comp.port,)
    if isinstance(comp, ProcessComponent):
        return tuple(dict.fromkeys(comp.ports))
    return ()


def process_match(name: str, comp: Any, config: Config,
                  records: Sequence[tuple[int, float]] = ()) -> ProcessMatch:  # fmt: skip
    """What proves a process is a leftover of this component (see ProcessMatch)."""
    env = ((ENV_COMPONENT, name), (ENV_CLUSTER, config.cluster.name), (ENV_STATE, str(config.agent.state_dir)))
    recorded = tuple(records)
    if isinstance(comp, DatasystemComponent):
        return ProcessMatch(env=env, program="datasystem_worker",
                            option=("worker_address", worker_address(config, comp)), records=recorded)  # fmt: skip
    if isinstance(comp, EtcdComponent):
        return ProcessMatch(env=env, program="etcd", option=("data-dir", str(comp.data_dir)), records=recorded)
    if isinstance(comp, VllmComponent):
        # Orphaned EngineCore/Workers hold device memory while the API port is already free (DESIGN §10);
        # setproctitle hides their environment, so their title and our private cwd identify them.
        return ProcessMatch(env=env, title_prefixes=("VLLM::",), cwd=str(component_workdir(name, comp, config)),
                            records=recorded)  # fmt: skip
    if isinstance(comp, ProcessComponent):
        prefixes = tuple(p for p in comp.process_match if p.strip())
        return ProcessMatch(env=env, cmdline_prefixes=prefixes, records=recorded)
    if isinstance(comp, ProxyComponent):
        return ProcessMatch(env=env, records=recorded)
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
    records: Sequence[tuple[int, float]] = (),
    scan: bool = True,
) -> ResiduePlan:
    """Residue to remove before (re)starting `name`. `redeploy` adds the node recovery's deeper cleanup.

    `wipe_etcd` (redeploy only) deletes the etcd data dir; it invalidates every worker's registration, so
    it is a cluster decision and only ever done on the master.
    """
    if scope not in ("start", "redeploy"):
        raise ValueError(f"scope must be 'start' or 'redeploy', got {scope!r}")
    reason = reason or scope
    actions: list[ResidueAction] = []
    notes: list[str] = []
    if scan:
        actions.append(KillProcesses(process_match(name, component, config, records), component.stop_grace_s))
    else:
        # The previous run was this agent's, stopped whole (session + descendants) and confirmed gone: the scan
        # of every process would find nothing; it runs on every other start (the first, after adoption, ...).
        notes.append("leftover scan skipped: the previous tree was stopped by this agent and confirmed gone")
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
        baseline = baseline_path(config.agent.state_dir)
        devices = tuple(component.visible_devices) if component.visible_devices is not None else None
        actions += [WaitDevicesFree(component.clean_slate_timeout_s, baseline, component.hbm_idle_tolerance_mb,
                                    devices, config.node.npu_health.npu_smi), RemoveShmSegments()]  # fmt: skip
    elif isinstance(component, EtcdComponent) and scope == "redeploy":
        if not wipe_etcd:
            notes.append(f"etcd data dir {component.data_dir} kept (no cluster-level wipe requested)")
        elif config.node.role != "master":
            notes.append(f"etcd data dir {component.data_dir} kept: only the master wipes etcd")
        else:
            # the FAQ's "key not found" residue; archived first: the evidence of why it broke is not residue
            actions.append(ArchiveThenRemove(component.data_dir, archive_dir(name, config), config.agent.archive_keep,
                                             reason))  # fmt: skip
    elif isinstance(component, EtcdComponent) and wipe_etcd:
        notes.append("wipe_etcd ignored: only a redeploy wipes etcd")
    actions.append(RemoveTree(component_tmpdir(config, name)))  # vLLM leaves IPC socket files there
    return ResiduePlan(name, scope, tuple(actions), tuple(residue_roots(config)), tuple(notes))


def residue_roots(config: Config) -> list[Path]:
    """The folders (and the one file) the agent owns and may delete in."""
    roots: list[Path] = [config.agent.state_dir]
    for name, comp in config.components.items():
        tmpdir = component_tmpdir(config, name)
        if config.agent.state_dir not in tmpdir.parents:  # a state path too long for vLLM's IPC sockets
            roots.append(tmpdir)
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
# Process matching (pure)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    cmdline: tuple[str, ...]
    environ: Mapping[str, str] | None = None
    cwd: str | None = None
    create_time: float | None = None


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
    if info.create_time is not None:
        for pid, created in match.records:
            if pid == info.pid and abs(created - info.create_time) < 0.05:
                return "the process this agent recorded (pid + start time)"
    return None



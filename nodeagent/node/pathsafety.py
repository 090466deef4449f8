"""Which paths the agent may delete: fenced twice (DESIGN §5).

`validate_residue_paths` rejects a config whose managed folders are unsafe (the loader exits 78 with its
messages), and `check_deletable` re-checks every path right before it is touched, after resolving symlinks,
against the roots the config owns.
"""

from __future__ import annotations

import contextlib
import os
import pwd
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from nodeagent.config.model import Config, DatasystemComponent, EtcdComponent
from nodeagent.node.residue_plan import SHM_DIR, UnsafePathError, client_log_dir, component_workdir

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
    """`path` is `root` or inside it (both absolute and normalised). On strings: `root in path.parents` built a
    Path per ancestor and made one residue check cost ~0.4 ms on the crash path."""
    p, r = str(path), str(root)
    return p == r or p.startswith(r if r.endswith("/") else r + "/")


def unsafe_reason(path: Path) -> str | None:
    """Why deleting `path` itself (absolute) is never acceptable, else None."""
    if path == Path("/"):
        return "not a safe folder to delete"
    if path in _home_folders() or path.parent == Path("/home"):
        return "not a safe folder to delete (a home folder)"
    in_shm = path != SHM_DIR and _within(path, SHM_DIR)  # e.g. a liveness file on tmpfs; /dev/shm itself stays refused
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



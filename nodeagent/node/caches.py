"""The compile caches on the host (`agent.caches`): the folder of a vLLM rank's software stack made before its
launch, the variables set, old stacks' folders removed by `render.caches.retention`, the sizes measured.

The rules are `nodeagent.render.caches`; this is the file work: a folder per key under the cache dir with its
parts in `key.json` (only such a folder is ever removed, after `pathsafety.check_deletable`), a `last_used`
stamp touched at every launch; the retention and the sizes in a thread after a launch (never on its path: a walk
of a big cache takes long), and the sizes again by a scrape at most once a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from nodeagent.config.model import Config
from nodeagent.node.pathsafety import check_deletable
from nodeagent.node.residue_plan import UnsafePathError
from nodeagent.node.vllm_install import dist_versions
from nodeagent.render.caches import (
    CACHE_VARS,
    HOST_DISTS,
    CacheEntry,
    cache_key,
    host_parts,
    retention,
    with_caches,
)
from nodeagent.render.launch import LaunchSpec

KEY_FILE = "key.json"
STAMP = "last_used"
MEASURE_MAX_AGE_S = 60.0


def tree_size(folder: Path) -> int:
    """Bytes of the files under `folder` (allocated blocks: what the disk holds; links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def scan(root: Path) -> list[CacheEntry]:
    """The key folders under `root` (those with a key.json: nothing else there is ours)."""
    out = []
    with contextlib.suppress(OSError):
        for folder in sorted(root.iterdir()):
            if not (folder / KEY_FILE).is_file():
                continue
            try:
                used = (folder / STAMP).stat().st_mtime
            except OSError:
                used = (folder / KEY_FILE).stat().st_mtime
            out.append(CacheEntry(folder.name, tree_size(folder), used))
    return out


async def key_parts(config: Config, name: str, spec: LaunchSpec, base_env: dict[str, str], inside: Any = None
                    ) -> tuple[dict[str, str] | None, str]:  # fmt: skip
    """What the key of `name`'s cache folder is made of (None: no key), and why there is none."""
    if inside is not None:
        why = await inside.read_versions(spec.argv[0])
        return inside.cache_parts(spec.argv[0]), why or "the container's image ID is not known yet"
    return host_key_parts(config, name, spec, base_env)


def host_key_parts(config: Config, name: str, spec: LaunchSpec, base_env: dict[str, str]
                   ) -> tuple[dict[str, str] | None, str]:  # fmt: skip
    found = dist_versions(config.components[name].command, spec.environment(base_env), HOST_DISTS)
    return (host_parts(found[1], found[0]) if found else None,
            "the vLLM its command runs has no readable version (no cache kept across versions)")


def preview(config: Config, name: str, spec: LaunchSpec, base_env: dict[str, str]) -> tuple[LaunchSpec, str | None]:
    """`nodeagentctl render`: the launch with the variables it will get, and a note; nothing made or removed. A
    rank inside the container is keyed by the image's ID and what it imports there, known once the container is
    up: KEY stands for it."""
    if spec.kind != "vllm" or not config.agent.caches.enabled:
        return spec, None
    root = config.agent.cache_dir
    if config.container is not None and config.components[name].container:
        return (with_caches(spec, root / "KEY"), f"compile caches in {root}/KEY: KEY = the container's image ID, "
                "setup and the versions its command imports there, read when it is up (the folder is mounted at the "
                "same path)")
    parts, why = host_key_parts(config, name, spec, base_env)
    if parts is None:
        return spec, f"no compile cache folder: {why}"
    versions = ", ".join(f"{k} {v}" for k, v in parts.items() if k != "python")
    return with_caches(spec, root / cache_key(parts), parts), f"compile caches in {root} (the folder of {versions})"


class CacheStore:
    """The node's cache folders: which key each vLLM rank was launched with, the last measurement."""

    def __init__(self) -> None:
        self.in_use: dict[str, str] = {}
        """Component → the key it was last launched with (never removed while the agent runs)."""
        self.unkeyed: dict[str, str] = {}
        """Component → why it got no cache folder."""
        self.entries: list[CacheEntry] = []
        self.measured_at: float | None = None
        self.removed: list[str] = []
        self.error: str | None = None
        self._sweep: asyncio.Task[None] | None = None

    async def apply(self, config: Config, name: str, spec: LaunchSpec, base_env: dict[str, str],
                    inside: Any = None) -> LaunchSpec:  # fmt: skip
        """The launch of `name` with its stack's cache folder (made now, old ones removed); unchanged for a
        component that is not vLLM, with the caches off, or without a key (the reason kept for /status)."""
        settings = config.agent.caches
        if spec.kind != "vllm" or not settings.enabled:
            return spec
        parts, why = await key_parts(config, name, spec, base_env, inside)
        if parts is None:
            self.unkeyed[name] = why
            return spec
        self.unkeyed.pop(name, None)
        key = cache_key(parts)
        self.in_use[name] = key
        try:
            folder = await asyncio.to_thread(self.prepare, config, key, parts)
        except OSError as exc:
            self.error = f"cannot make the cache folder of {name}: {exc}"
            return spec
        self.error = None  # (a removal that fails again says so again after the sweep)
        if self._sweep is None or self._sweep.done():  # off the launch: a walk of a big cache takes a while
            self._sweep = asyncio.create_task(asyncio.to_thread(self.sweep, config), name="cache-sweep")
        return with_caches(spec, folder, parts)

    def adopted(self, config: Config, name: str, pid: int, proc: Path = Path("/proc")) -> None:
        """A rank the agent adopted (launched by an agent before it): the key its environment names is in use, so
        the retention never removes the folder under it (read through the host's /proc, inside the container
        too)."""
        try:
            env = (proc / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            return
        for item in env:
            var, _, value = item.decode(errors="replace").partition("=")
            if var == "VLLM_CACHE_ROOT" and Path(value).parent.parent == config.agent.cache_dir:
                self.in_use[name] = Path(value).parent.name

    def prepare(self, config: Config, key: str, parts: dict[str, str]) -> Path:
        """Make the key's folder (its caches' subfolders: CANN wants its paths to exist) and stamp it used: a few
        syscalls, on the launch's path. Blocking."""
        root = config.agent.cache_dir
        folder = root / key
        for sub in CACHE_VARS.values():
            (folder / sub).mkdir(parents=True, exist_ok=True)
        if not (folder / KEY_FILE).is_file():
            (folder / KEY_FILE).write_text(json.dumps({"parts": parts, "created": time.time()}, indent=1) + "\n")
        (folder / STAMP).touch()
        return folder

    async def swept(self) -> None:
        """Until the sweep a launch began is done (tests; a shutdown need not wait: the next launch sweeps)."""
        if self._sweep is not None:
            await self._sweep

    def sweep(self, config: Config) -> None:
        """Remove what the retention says, measure what stays. Blocking."""
        settings, root = config.agent.caches, config.agent.cache_dir
        entries = scan(root)
        gone = retention(entries, set(self.in_use.values()), settings.keep, int(settings.max_gb * 1e9))
        for key in gone:
            try:
                check_deletable(root / key, [root])
                shutil.rmtree(root / key)
                self.removed = [*self.removed[-9:], key]
            except (OSError, UnsafePathError) as exc:
                self.error = f"cannot remove the cache folder {root / key}: {exc}"
        self.entries = [e for e in entries if e.key not in gone or (root / e.key).exists()]
        self.measured_at = time.time()

    async def refresh(self, config: Config, max_age_s: float = MEASURE_MAX_AGE_S) -> None:
        """Measure again if the last measurement is older than `max_age_s` (a compile writes after the launch)."""
        if not config.agent.caches.enabled:
            return
        if self.measured_at is None or time.time() - self.measured_at >= max_age_s:
            root = config.agent.cache_dir
            self.entries = await asyncio.to_thread(scan, root)
            self.measured_at = time.time()

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def status(self, config: Config) -> dict[str, Any]:
        settings = config.agent.caches
        users: dict[str, list[str]] = {}
        for comp, key in self.in_use.items():
            users.setdefault(key, []).append(comp)
        return {
            "enabled": settings.enabled, "dir": str(config.agent.cache_dir), "keep": settings.keep,
            "max_bytes": int(settings.max_gb * 1e9), "bytes": self.total_bytes(), "measured_at": self.measured_at,
            "keys": [{"key": e.key, "bytes": e.size, "last_used": e.last_used, "used_by": sorted(users.get(e.key, []))}
                     for e in sorted(self.entries, key=lambda e: e.last_used, reverse=True)],
            "unkeyed": dict(self.unkeyed), "removed": list(self.removed), "error": self.error,
        }  # fmt: skip

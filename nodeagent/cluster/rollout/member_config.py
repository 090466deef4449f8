"""A rollout's view of this node's config: what the executor asks of the agent (`ConfigHost`), the file's hash as
members compare it, the previous config saved as JSON (the operator overwrote the file on disk), and the file this
member runs as the last rollout record seen here stood (`MemberConfig`: an agent restarted mid-rollout takes it
back before anything of its stack starts)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.core.statefile import read_json, write_json_atomic

if TYPE_CHECKING:
    from nodeagent.config.model import Config


class ConfigHost(Protocol):
    """What the executor needs from the agent beyond the port: configs (the agent satisfies it)."""

    def running_config(self) -> Config: ...

    def read_config_file(self, path: str | None = None) -> Config: ...

    def stage_config(self, config: Config) -> None:
        """The config for the next starts of every component; restarts nothing (the container neither)."""

    def container_pending(self) -> str | None:
        """What of the staged config's container differs from the container the node keeps, or None."""

    def recreate_container(self) -> str | None:
        """Recreate the node's container as the staged config says (a planned recreate); what changed."""


def file_hash(config: Config) -> str:
    """The file as a rollout compares members: the shared sections, and the container's image and setup steps
    (the guide runs one image on every node; a new one is a change to roll). The run line's other options and the
    container's name may differ per node and stay out."""
    from nodeagent.config.cluster import cluster_file_hash

    shared = cluster_file_hash(config)
    if config.container is None:
        return shared
    image = {"image": config.container.image, "setup": [list(step) for step in config.container.setup]}
    return hashlib.sha256(json.dumps({"shared": shared, "container": image}, sort_keys=True).encode()).hexdigest()


def snapshot_config(config: Config) -> dict[str, Any]:
    """A config as JSON that `restore_config` turns back into the same config (the previous file may be gone)."""
    from nodeagent.config.base import to_plain

    return {"config": to_plain(replace_config(config, shared=None, source=None)),
            "shared": to_plain(config.shared) if config.shared is not None else None,
            "source": str(config.source) if config.source else None}  # fmt: skip


def replace_config(config: Config, **changes: Any) -> Config:
    from nodeagent.config.base import replace

    return replace(config, **changes)


def restore_config(data: Mapping[str, Any]) -> Config:
    from pathlib import Path

    from nodeagent.config.base import validate
    from nodeagent.config.cluster import SharedSections
    from nodeagent.config.model import Config

    config = validate(Config, data["config"])
    shared = validate(SharedSections, data["shared"]) if data.get("shared") else None
    return replace_config(config, shared=shared, source=Path(data["source"]) if data.get("source") else None)


class FileMismatch(ValueError):
    """This node has no config with the hash a step wants (the new file is not installed here)."""


class MemberConfig:
    """This member's configs in a rollout: the running one (the agent's), the file on disk, the previous one saved
    (`rollout-previous.json`) and the hash the rollout wants it to run (`rollout-wanted.json`), both kept across
    agent restarts."""

    def __init__(self, host: ConfigHost, state_dir: Path, source: Path | None) -> None:
        self.host = host
        self.source = source
        self.previous_path = state_dir / "rollout-previous.json"
        self.wanted_path = state_dir / "rollout-wanted.json"
        self.running_path = state_dir / "rollout-running.json"
        self.previous: Config | None = None
        saved = read_json(self.previous_path, {})
        with contextlib.suppress(Exception):
            self.previous = restore_config(saved) if saved else None
        self.last: Config | None = None
        """The config the previous agent ran (`remember`): an agent restarted after the operator installed a
        rollout's new file loads that one, while its adopted ranks run this (seeds 760170, 760023)."""
        saved = read_json(self.running_path, {})
        with contextlib.suppress(Exception):
            self.last = restore_config(saved) if saved else None
        self._wanted: dict[str, Any] = read_json(self.wanted_path, {})
        self._hashed: list[tuple[Any, str]] = []
        self._disk: tuple[str | None, str] = (None, "")
        self._disk_for: tuple[str | None, Any] | None = None

    def hash(self, config: Config) -> str:
        """file_hash, remembered for the last few configs (the running one is asked every second; a 256-member
        file is ~30 KB of JSON to digest)."""
        for seen, digest in self._hashed:
            if seen is config:
                return digest
        digest = file_hash(config)
        self._hashed = [(config, digest), *self._hashed[:3]]
        return digest

    def running(self) -> str:
        return self.hash(self.host.running_config())

    def disk(self, rollout: str | None, refresh: bool = False) -> tuple[str | None, str]:
        """(hash of this node's file on disk, why not readable): read again when the file changed (its size
        and mtime) and for each new rollout."""
        stamp: Any = None
        with contextlib.suppress(OSError, TypeError):
            st = os.stat(self.source)  # type: ignore[arg-type]  # None (no file): the TypeError is suppressed
            stamp = (st.st_mtime_ns, st.st_size)
        if refresh or self._disk_for != (rollout, stamp) or self._disk[0] is None:
            try:
                self._disk = (self.hash(self.host.read_config_file()), "")
            except Exception as exc:  # a bad file is reported, never raised into the loop
                self._disk = (None, f"cannot load the file: {str(exc).splitlines()[0][:200]}")
            self._disk_for = (rollout, stamp)
        return self._disk

    def save_previous(self, config: Config) -> None:
        self.previous = config
        with contextlib.suppress(OSError):
            write_json_atomic(self.previous_path, snapshot_config(config))

    def remember(self, config: Config) -> None:
        """The config this agent runs, kept for its successor (written only when it changes). Called once the
        rollout record was read: before that, a restarted agent's config is the file on disk, not yet decided."""
        if self.last is None or self.hash(self.last) != self.hash(config):
            self.last = config
            with contextlib.suppress(OSError):
                write_json_atomic(self.running_path, snapshot_config(config))

    def config_for(self, want: str) -> Config:
        """The config with file hash `want`: the saved previous one, the one the last agent ran, or this node's
        file on disk."""
        for saved in (self.previous, self.last):
            if saved is not None and self.hash(saved) == want:
                return saved
        disk = self.host.read_config_file()
        if self.hash(disk) != want:
            raise FileMismatch(f"this node's file has hash {self.hash(disk)[:12]}, the step wants {want[:12]} "
                               "(install the new file on every member first)")  # fmt: skip
        return disk

    def keep_wanted(self, rollout: str, old: str, new: str, want: str) -> None:
        """Remember what the rollout wants this member to run (written only when it changes)."""
        data = {"rollout": rollout, "old": old, "new": new, "want": want}
        if data != self._wanted:
            self._wanted = data
            with contextlib.suppress(OSError):
                write_json_atomic(self.wanted_path, data)

    def restore(self) -> str | None:
        """At the agent's start, before its container and stack start: it loaded the file on disk, which may be a
        rollout's new one while its group still runs the previous one. Take the previous one back if the last
        record seen here said so (etcd may not answer yet: on the master the agent starts it). What it did."""
        want = self._wanted.get("want")
        running = self.running()
        if not want or want == running or running not in (self._wanted.get("old"), self._wanted.get("new")):
            return None
        if self.previous is None or self.hash(self.previous) != want:
            return None
        self.host.stage_config(self.previous)
        return (f"rollout {self._wanted.get('rollout')}: this node starts on {want[:12]}, as the rollout stood when "
                f"its agent stopped (the file on disk is {running[:12]})")

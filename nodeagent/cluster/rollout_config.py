"""A rollout's view of this node's config: what the executor asks of the agent (`ConfigHost`), the file's hash as
members compare it, and the previous config saved as JSON (the operator overwrote the file on disk)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nodeagent.config_model import Config


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
    from nodeagent.config_cluster import cluster_file_hash

    shared = cluster_file_hash(config)
    if config.container is None:
        return shared
    image = {"image": config.container.image, "setup": [list(step) for step in config.container.setup]}
    return hashlib.sha256(json.dumps({"shared": shared, "container": image}, sort_keys=True).encode()).hexdigest()


def snapshot_config(config: Config) -> dict[str, Any]:
    """A config as JSON that `restore_config` turns back into the same config (the previous file may be gone)."""
    from nodeagent.config_base import to_plain

    return {"config": to_plain(replace_config(config, shared=None, source=None)),
            "shared": to_plain(config.shared) if config.shared is not None else None,
            "source": str(config.source) if config.source else None}  # fmt: skip


def replace_config(config: Config, **changes: Any) -> Config:
    from nodeagent.config_base import replace

    return replace(config, **changes)  # type: ignore[no-any-return]


def restore_config(data: Mapping[str, Any]) -> Config:
    from pathlib import Path

    from nodeagent.config_base import validate
    from nodeagent.config_cluster import SharedSections
    from nodeagent.config_model import Config

    config = validate(Config, data["config"])
    shared = validate(SharedSections, data["shared"]) if data.get("shared") else None
    return replace_config(config, shared=shared, source=Path(data["source"]) if data.get("source") else None)

"""A member's configs in a rollout (`rollout.member_config.MemberConfig`), over its state folder, without a process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nodeagent.cluster.rollout.member_config import FileMismatch, MemberConfig, file_hash
from nodeagent.config.load import parse_config


def config(tmp: Path, command: str) -> Any:
    return parse_config(f"""
cluster: {{name: fake}}
node: {{name: n0, ip: 127.0.0.1, role: master}}
agent: {{state_dir: {tmp}/state, log_dir: {tmp}/logs, systemd_scopes: never}}
components:
  a: {{kind: process, command: ["python3", "-c", "{command}"]}}
""")  # fmt: skip


class Host:
    """The agent's side (`ConfigHost`): it loaded `disk` at its start."""

    def __init__(self, disk: Any) -> None:
        self.disk = self.running = disk

    def running_config(self) -> Any:
        return self.running

    def read_config_file(self, path: str | None = None) -> Any:
        return self.disk

    def stage_config(self, config: Any) -> None:
        self.running = config


def test_an_agent_restarted_after_the_new_file_was_installed_finds_the_config_its_ranks_run(tmp_path: Path) -> None:
    """Found by the simulation (seeds 760170, 760023, 8-node, an incompatible rollout): an agent paused past its
    lease came back after the operator installed the new file; it loaded that one while its adopted ranks ran the
    old one, had no previous config saved (its step found it on the new file already) — and the step's way back
    failed: "this node's file has hash …, the step wants …". The config the last agent ran is kept for it."""
    old, new = config(tmp_path, "pass"), config(tmp_path, "print(1)")
    first = MemberConfig(Host(old), tmp_path / "state", None)
    first.remember(old)
    successor = MemberConfig(Host(new), tmp_path / "state", None)
    assert file_hash(successor.config_for(file_hash(old))) == file_hash(old)
    successor.remember(new)
    third = MemberConfig(Host(new), tmp_path / "state", None)
    with pytest.raises(FileMismatch):  # what the last agent ran, not every config ever
        third.config_for(file_hash(old))

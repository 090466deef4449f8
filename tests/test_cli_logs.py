"""`nodeagentctl logs container`: the node's container is no component, but the docs send operators to its log
(setup steps' output, lifecycle) under that name. No agent runs here: the answers are stubbed or absent."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port

from nodeagent.cli import logs as logscmd
from nodeagent.cli.agentconfig import Client, light_config
from nodeagent.cli.common import EXIT_UNKNOWN, CliError


def write_config(tmp_path: Path, container: bool) -> Path:
    config = tmp_path / "node.yaml"
    section = "container: {image: 'quay.io/ascend/vllm-ascend:v0.20.2rc1'}\n" if container else ""
    config.write_text(f"node: {{name: n1, ip: 127.0.0.1}}\n{section}"
                      f"agent: {{state_dir: {tmp_path / 'state'}, log_dir: {tmp_path / 'logs'},\n"
                      f"        api: {{listen: '127.0.0.1:{free_port()}', token_file: {tmp_path / 'token'}}}}}\n"
                      "components:\n  w: {kind: process, command: [sleep, '1000']}\n")  # fmt: skip
    (tmp_path / "logs").mkdir()
    return config


def args_for(config: Path, component: str) -> argparse.Namespace:
    return argparse.Namespace(config=str(config), node=None, component=component, source="auto", follow=False,
                              lines=50, unit="dsv4-agent")  # fmt: skip


def test_logs_container_with_the_agent_down_reads_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, container=True)
    (tmp_path / "logs" / "container.log").write_text("container setup step 1/2: git am x\nok\n")
    monkeypatch.setattr(logscmd, "_which", lambda name: None)  # no journal here
    assert logscmd.cmd_logs(args_for(config, "container")) == 0
    assert capsys.readouterr().out == "container setup step 1/2: git am x\nok\n"
    (tmp_path / "host").mkdir()
    without = write_config(tmp_path / "host", container=False)
    with pytest.raises(CliError, match="unknown component 'container'") as err:
        logscmd.cmd_logs(args_for(without, "container"))
    assert err.value.code == EXIT_UNKNOWN


def test_logs_container_through_a_running_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, container=True)
    status: dict[str, Any] = {"components": {"w": {}}, "container": {"name": "ds_v4_flash_yr"},
                              "agent": {"journal": False, "log_dir": str(tmp_path / "logs")}}
    monkeypatch.setattr(Client, "get", lambda self, path: status)
    args = args_for(config, "container")
    assert logscmd._log_source(args, light_config(args)) == ("file", tmp_path / "logs")
    status.pop("container")  # host mode: there is no container to show
    with pytest.raises(CliError, match=r"unknown component 'container' \(this node runs: w\)"):
        logscmd._log_source(args, light_config(args))

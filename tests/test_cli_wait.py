"""`restart --wait`'s last line and the agent-down hint, pure: the waiter fed /status snapshots, no agent."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import free_port

from nodeagent.cli import actions
from nodeagent.cli.common import CliError


def test_restart_of_a_stopped_component_never_prints_was_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(actions, "SETTLE_S", 0.0)
    up = {"components": {"vllm": {"state": "ready", "pid": 4242}}}
    stopped = actions._component_waiter("vllm", "restart", {"state": "stopped", "pid": None})
    assert stopped(up) == "vllm ready (pid 4242)"
    running = actions._component_waiter("vllm", "restart", {"state": "ready", "pid": 4100})
    assert running(up) == "vllm ready (pid 4242, was 4100)"


def test_agent_down_hint_suggests_systemctl_only_where_systemd_runs_the_agent(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from nodeagent.cli import agentconfig

    assert not agentconfig.systemd_runs_agent(tmp_path)  # no systemd
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    assert not agentconfig.systemd_runs_agent(tmp_path)  # systemd, but the agent's unit is not installed
    (tmp_path / "etc/systemd/system").mkdir(parents=True)
    (tmp_path / "etc/systemd/system/dsv4-agent.service").write_text("[Service]\n")
    assert agentconfig.systemd_runs_agent(tmp_path)
    light = agentconfig.LightConfig(Path("/srv/a.yaml"), f"127.0.0.1:{free_port()}", tmp_path / "token", None,
                                    tmp_path, tmp_path)  # fmt: skip
    for systemd, hint in ((False, "start it with `dsv4-agent --config /srv/a.yaml`"),
                          (True, "systemctl status dsv4-agent")):  # fmt: skip
        monkeypatch.setattr(agentconfig, "systemd_runs_agent", lambda systemd=systemd: systemd)
        with pytest.raises(CliError, match="agent unreachable") as err:
            agentconfig.Client(light, timeout=2.0).get("/status")
        assert hint in str(err.value) and (("systemctl" in str(err.value)) == systemd)

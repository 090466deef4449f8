"""As a new user would, on the local default: an agent owns its stack alone, never kills what is not its own,
tells a permanent failure from a transient one without taking healthy components down, and keeps its
history across a kill -9. Real etcd, the real datasystem worker, the vLLM stand-in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, LocalAgent, derived_config, free_port, wait_for

pytestmark = pytest.mark.system


def ctl(agent: LocalAgent, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "nodeagentctl"), "--config", str(agent.config_path), *args],
                          capture_output=True, text=True, timeout=60, env=env or agent.env)  # fmt: skip


def component(agent: LocalAgent, name: str) -> dict[str, Any]:
    return agent.status()["components"][name]


def squat(port: int) -> subprocess.Popen[bytes]:
    """Someone else's server on one of our ports (the trial used exactly this)."""
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    wait_for(f"squatter on {port}", lambda: _listening(port), 15)
    return proc


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_one_agent_per_state_dir_history_and_own_logs(local_agent: LocalAgent) -> None:
    agent = local_agent
    agent.start()
    agent.wait_all_up()
    before = agent.children()
    api = f"127.0.0.1:{agent.env['DSV4_API_PORT']}"

    # A second agent on the same config and state dir, another API port: refused, exit 75, names the holder.
    env = {**agent.env, "DSV4_API_PORT": str(free_port())}
    second = subprocess.run([str(BIN / "dsv4-agent"), "--config", str(agent.config_path)], env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert second.returncode == 75, second
    assert f"pid {agent.proc.pid}" in second.stderr and f"API {api}" in second.stderr  # type: ignore[union-attr]
    assert agent.children() == before, "the refused agent touched nothing"
    assert all(c["restarts"] == 0 for c in agent.status()["components"].values())

    # `logs datasystem` shows the worker's own log, not dscli's three lines.
    logs = ctl(agent, "logs", "datasystem", "-n", "5")
    assert logs.returncode == 0, logs
    assert "datasystem/logs/datasystem_worker.INFO.log" in logs.stderr
    assert len(logs.stdout.splitlines()) == 5

    # History survives a kill -9 of the agent: restart counts, real start times, last exit, the metric.
    old = before["vllm"]["pid"]
    os.kill(old, signal.SIGKILL)
    wait_for("vllm replaced", lambda: agent.children().get("vllm", {}).get("pid") not in (None, old), 60)
    agent.wait_all_up()
    history = {n: (c["restarts"], c["started_at"], c["last_exit"]) for n, c in agent.status()["components"].items()}
    assert history["vllm"][0] == 1 and "killed by SIGKILL" in history["vllm"][2]["reason"]
    agent.proc.kill()  # type: ignore[union-attr]
    agent.proc.wait(10)  # type: ignore[union-attr]
    agent.start()
    wait_for("adopted", lambda: agent.log().count("adopted running pid") >= 3, 60)
    agent.wait_all_up()
    again = {n: (c["restarts"], c["started_at"], c["last_exit"]) for n, c in agent.status()["components"].items()}
    assert again == history
    metrics = ctl(agent, "status", "--json")
    assert metrics.returncode == 0
    import urllib.request

    with urllib.request.urlopen(f"http://{api}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'dsv4_component_restarts_total{component="vllm"' in text
    line = next(x for x in text.splitlines() if x.startswith('dsv4_component_restarts_total{component="vllm"'))
    assert line.endswith(" 1.0"), line


def test_squatters_on_every_port_survive_and_the_stack_comes_up_once_they_go(local_agent: LocalAgent) -> None:
    agent = local_agent
    ports = {name: int(agent.env[var]) for name, var in
             (("etcd", "DSV4_ETCD_PORT"), ("datasystem", "DSV4_WORKER_PORT"), ("vllm", "DSV4_VLLM_PORT"))}
    squatters = {name: squat(port) for name, port in ports.items()}
    try:
        agent.start()
        released: set[str] = set()
        for name in ("etcd", "datasystem", "vllm"):
            sq = squatters[name]
            wait_for(f"{name} held naming its squatter",
                     lambda sq=sq, name=name: f"held by pid {sq.pid}" in (component(agent, name)["held"] or ""), 60)
            held = component(agent, name)["held"]
            assert "http.server" in held and "(user " in held, held
            assert component(agent, name)["state"] == "stopped" and component(agent, name)["pid"] is None
            assert all(s.poll() is None for n, s in squatters.items() if n not in released), "a squatter was signalled"
            assert component(agent, name)["policy"]["failures_total"] == 0, "a held start is not a failure"
            sq.terminate()
            sq.wait(10)
            released.add(name)
            agent.wait_states({name: {"running", "ready"}}, timeout=90)
        agent.wait_all_up()
        assert "(listens on" not in agent.log()
    finally:
        for sq in squatters.values():
            if sq.poll() is None:
                sq.kill()


def test_a_missing_model_fails_permanently_and_leaves_etcd_and_the_worker_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    config = derived_config(tmp_path / "config.yaml", {"components": {"vllm": {"model": "/nonexistent/dsv4"}}})
    agent = LocalAgent(home, config)
    try:
        agent.start()
        wait_for("vllm failed", lambda: component(agent, "vllm")["state"] == "failed", 90)
        first = agent.children()
        vllm = component(agent, "vllm")
        assert vllm["failure"]["permanent"] == "model path /nonexistent/dsv4 does not exist"
        out = ctl(agent, "status")
        assert "failed: model path /nonexistent/dsv4 does not exist" in out.stdout, out.stdout
        log = agent.log()
        assert "next: retry in 300s" in log and "node redeploy" not in log
        assert "[etcd] stopping" not in log and "[datasystem] stopping" not in log
        assert {n: first[n]["pid"] for n in ("etcd", "datasystem")} == {
            n: agent.children()[n]["pid"] for n in ("etcd", "datasystem")}
    finally:
        agent.cleanup()


def test_the_same_quick_error_twice_is_permanent_with_the_components_last_words(tmp_path: Path) -> None:
    model = tmp_path / "model-without-config"
    model.mkdir()  # exists (the precheck passes), but vllm refuses it within seconds, the same way each time
    home = tmp_path / "home"
    home.mkdir()
    config = derived_config(tmp_path / "config.yaml", {"components": {"vllm": {"model": str(model)}}})
    agent = LocalAgent(home, config)
    try:
        agent.start()
        wait_for("vllm failed", lambda: component(agent, "vllm")["state"] == "failed", 120)
        vllm = component(agent, "vllm")
        assert vllm["failure"]["permanent"].startswith("exits within 30s with the same error each time")
        assert any("Invalid repository ID or local directory" in line for line in vllm["failure"]["output_tail"])
        assert vllm["last_exit"]["reason"] == "exited with code 1"
        assert "node redeploy" not in agent.log()
    finally:
        agent.cleanup()

"""Issue 32 item 5: the vllm kind's DEFAULT liveness (no liveness keys) on the stand-in, through a real agent — a
busy engine whose steps come at the longest healthy gap is kept, its hang under load is caught within 30 s, an idle
hang within 20 s. The busy window is 60 s here (DSV4_DETECTION_BUSY_S sets it: the issue's check runs 7 minutes);
bench/liveness.py measures the same catch times as medians."""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, LocalAgent, wait_for
from test_liveness_system import liveness, long_completion, post, vllm

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

LONGEST_HEALTHY_STEP_S = 3.5
"""The longest healthy step the stall window is sized on (`nodeagent.vllm.progress.CHUNK_STEP_S`, 4096 tokens):
the busy stand-in steps this far apart, one token per step."""
BUSY_S = float(os.environ.get("DSV4_DETECTION_BUSY_S", "60"))
UP = ("running", "ready")


def config(home: Path, step_s: float) -> Path:
    vllm = {
        "kind": "vllm", "command": "vllm-standin", "model": str(ROOT / "config" / "standin-model"),
        "served_model_name": "dsv4", "port": "${DSV4_VLLM_PORT}", "tensor_parallel_size": 1, "max_num_seqs": 2,
        "ld_preload": [], "stop_grace_s": 5,
        "env": {"VLLM_STANDIN_STARTUP_DELAY_S": "0.5", "VLLM_STANDIN_STEP_S": str(step_s),
                "VLLM_STANDIN_TOKENS_PER_STEP": "1"},
        # /health, not the default chat: a readiness chat in flight at the hang would make an idle hang one under load
        "probes": {"readiness": {"kind": "http_get", "path": "/health", "period_s": 1, "timeout_s": 2}},
    }  # fmt: skip
    data = {
        "cluster": {"name": "detect", "etcd_endpoints": ["127.0.0.1:1"]},
        "node": {"name": "n0", "ip": "127.0.0.1", "role": "master", "npus": 0},
        "agent": {"state_dir": str(home / "state"), "log_dir": str(home / "logs"),
                  "api": {"listen": "127.0.0.1:${DSV4_API_PORT}", "token_file": str(home / "token")},
                  "systemd_scopes": "never"},
        "components": {"vllm": vllm},
    }  # fmt: skip
    path = home / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextlib.contextmanager
def agent_with(tmp_path: Path, step_s: float) -> Iterator[LocalAgent]:
    home = tmp_path / "home"
    home.mkdir()
    agent = LocalAgent(home, config(home, step_s))
    agent.start()
    try:
        agent.wait_states({"vllm": {"ready"}}, 120)
        yield agent
    finally:
        agent.cleanup()


def running(agent: LocalAgent) -> float:
    with urllib.request.urlopen(vllm(agent, "/metrics"), timeout=5) as response:
        found = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", response.read().decode(), re.M)
    return float(found.group(1)) if found else 0.0


def vllm_status(agent: LocalAgent) -> dict[str, Any]:
    return dict(agent.status()["components"]["vllm"])


def time_to_catch(agent: LocalAgent, pid: int, limit_s: float) -> float:
    """Hang the engine; seconds until the agent acts on it (the component leaves running/ready or is replaced)."""
    post(vllm(agent, "/standin/fault"), {"mode": "hang"})
    started = time.monotonic()
    while (waited := time.monotonic() - started) < limit_s + 30:
        with contextlib.suppress(OSError, ValueError):
            status = vllm_status(agent)
            if status["state"] not in UP or status.get("pid") != pid:
                return waited
        time.sleep(0.1)
    raise AssertionError(f"the hang was not caught within {limit_s + 30:.0f} s:\n{agent.log()[-3000:]}")


def test_a_busy_engine_at_the_longest_healthy_step_is_kept_and_its_hang_caught_within_30_s(tmp_path: Path) -> None:
    with agent_with(tmp_path, LONGEST_HEALTHY_STEP_S) as agent:
        pid = vllm_status(agent)["pid"]
        for _ in range(2):
            long_completion(vllm(agent, "/v1/chat/completions"))
        wait_for("two requests running", lambda: running(agent) == 2, 30)
        deadline = time.monotonic() + BUSY_S
        while time.monotonic() < deadline:
            status = vllm_status(agent)
            assert status["pid"] == pid and status["state"] in UP, (status, agent.log()[-3000:])
            time.sleep(1.0)
        assert "liveness failed" not in agent.log()
        time.sleep(random.uniform(0, 2.5))  # a random phase against the probe's period
        caught = time_to_catch(agent, pid, 30)
        print(f"hang under load caught after {caught:.1f} s")
        assert caught <= 30, caught
        assert "engine stalled: 2 requests running" in agent.log()


def test_an_idle_hang_is_caught_within_20_s(tmp_path: Path) -> None:
    with agent_with(tmp_path, 0.05) as agent:
        pid = vllm_status(agent)["pid"]
        wait_for("a canary answered", lambda: "canary answered" in liveness(agent)["last"]["detail"], 30)
        time.sleep(random.uniform(0, 2.5))
        caught = time_to_catch(agent, pid, 20)
        print(f"idle hang caught after {caught:.1f} s")
        assert caught <= 20, caught
        assert "but the canary chat failed (3rd in a row)" in agent.log()

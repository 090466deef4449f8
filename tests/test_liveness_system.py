"""The vllm kind's default liveness (`vllm_progress`) through a real agent on config/local.yaml: the real etcd,
the real datasystem worker and the vLLM stand-in. Short `stall_after_s` and periods; nothing here is timed
beyond generous bounds (the detection times are measured in bench/liveness.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import LocalAgent, derived_config, wait_for

pytestmark = pytest.mark.system

STALL_AFTER_S = 3.0
FAILURE_THRESHOLD = 5
"""High on purpose: a stall and an errored engine must fail at once, not after five results."""

WORKER_MAX_AGE_S = 8.0
"""The worker's liveness, explicit here so a test stays short (the default is the guide's 30 s)."""

CONFIG = {
    "components": {
        "datasystem": {"probes": {"liveness": {"period_s": 1, "failure_threshold": 2,
                                               "max_age_s": WORKER_MAX_AGE_S}}},
        "vllm": {
            "env": {"VLLM_STANDIN_STEP_S": "0.1", "VLLM_STANDIN_TOKENS_PER_STEP": "1"},
            "probes": {
                "liveness": {"period_s": 0.5, "timeout_s": 1, "failure_threshold": FAILURE_THRESHOLD,
                             "stall_after_s": STALL_AFTER_S},
                # /health, not the default chat: the agent's own readiness chat would be one more request in
                # the engine's counts (hung with it, or in flight at a drain's look) on a loaded machine
                "readiness": {"kind": "http_get", "path": "/health", "period_s": 1, "timeout_s": 2},
            },
        }
    }
}  # fmt: skip


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    base = tmp_path_factory.mktemp("liveness")
    home = base / "home"
    home.mkdir()
    a = LocalAgent(home, derived_config(base / "config.yaml", CONFIG))
    a.start()
    try:
        a.wait_all_up()
        yield a
    finally:
        a.cleanup()


def vllm(agent: LocalAgent, path: str) -> str:
    return f"http://127.0.0.1:{agent.env['DSV4_VLLM_PORT']}{path}"


def post(url: str, body: dict[str, Any], timeout: float = 5) -> int:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()
        return response.status


def long_completion(url: str) -> threading.Thread:
    """A completion that runs for hours at one token per 0.1 s step; it ends when its server goes away."""
    body = {"model": "dsv4", "messages": [{"role": "user", "content": "write a very long story"}],
            "max_tokens": 150000, "ignore_eos": True}  # fmt: skip

    def run() -> None:
        with contextlib.suppress(OSError, urllib.error.URLError):
            post(url, body, timeout=600)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def liveness(agent: LocalAgent) -> dict[str, Any]:
    """vLLM's liveness probe as the agent's API shows it now (status.json is written on state changes only)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.env['DSV4_API_PORT']}/status", timeout=5) as r:
        status = json.loads(r.read())
    return status["components"]["vllm"]["probes"]["roles"]["liveness"]["probes"][0]


def liveness_failures(agent: LocalAgent) -> float:
    """The agent's own dsv4_probe_failures_total for vLLM's liveness (cumulative across restarts)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.env['DSV4_API_PORT']}/metrics") as r:
        text = r.read().decode()
    pattern = r'^dsv4_probe_failures_total\{[^}]*component="vllm"[^}]*role="liveness"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def replaced(agent: LocalAgent, old_pid: int, timeout: float = 60) -> None:
    wait_for("vllm replaced", lambda: agent.children().get("vllm", {}).get("pid") not in (None, old_pid), timeout)
    agent.wait_all_up()


def test_busy_engine_is_kept_then_its_hang_under_load_is_caught(agent: LocalAgent) -> None:
    pid = agent.children()["vllm"]["pid"]
    threads = [long_completion(vllm(agent, "/v1/chat/completions")) for _ in range(2)]
    wait_for("liveness to see the two requests", lambda: "2 requests running" in liveness(agent)["last"]["detail"])
    started = time.monotonic()
    details = []
    while time.monotonic() - started < 4 * STALL_AFTER_S:  # four stall windows of steady decoding
        probe = liveness(agent)
        details.append(probe["last"]["detail"])
        assert probe["status"] == "success" and agent.children()["vllm"]["pid"] == pid
        time.sleep(0.5)
    assert all(t.is_alive() for t in threads)
    assert any(re.search(r"2 requests running; \+\d+ tokens", d) for d in details), details

    assert post(vllm(agent, "/standin/fault"), {"mode": "hang"}) == 200
    with urllib.request.urlopen(vllm(agent, "/health"), timeout=5) as response:
        assert response.status == 200, "vLLM's /health does not see a hung engine"
    replaced(agent, pid)
    log = agent.log()
    assert re.search(r"\[vllm\] liveness failed: engine stalled: 2 requests running, no token progress for \d", log)
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


def test_idle_hang_is_caught_by_the_canary(agent: LocalAgent) -> None:
    pid = agent.children()["vllm"]["pid"]
    wait_for("an idle engine answering the canary", lambda: "canary answered" in liveness(agent)["last"]["detail"])
    assert post(vllm(agent, "/standin/fault"), {"mode": "hang"}) == 200
    replaced(agent, pid)
    assert f"the canary chat failed ({FAILURE_THRESHOLD}th in a row): no answer within 1s" in agent.log()


def test_errored_engine_fails_at_once(agent: LocalAgent) -> None:
    pid = agent.children()["vllm"]["pid"]
    before = liveness_failures(agent)
    assert post(vllm(agent, "/standin/fault"), {"mode": "503"}) == 200
    replaced(agent, pid)
    assert "liveness failed: engine errored: " in agent.log()
    # One failed result fails the role; the threshold would have waited for five.
    assert liveness_failures(agent) - before < FAILURE_THRESHOLD - 2


def api(agent: LocalAgent, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    token = (agent.home / "token").read_text().strip()
    request = urllib.request.Request(f"http://127.0.0.1:{agent.env['DSV4_API_PORT']}{path}",
                                     json.dumps(body).encode() if body is not None else None,
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
                                     method=method)  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_planned_restart_under_load_drains_first(agent: LocalAgent) -> None:
    agent.wait_all_up()
    pid = agent.children()["vllm"]["pid"]
    finished: list[int] = []
    body = {"model": "dsv4", "messages": [{"role": "user", "content": "a short story"}], "max_tokens": 40,
            "ignore_eos": True}  # ~4 s at one token per 0.1 s step

    thread = threading.Thread(target=lambda: finished.append(post(vllm(agent, "/v1/chat/completions"), body, 60)))
    thread.start()
    wait_for("the request running", lambda: "1 request running" in liveness(agent)["last"]["detail"], 30)
    assert api(agent, "POST", "/components/vllm/restart")[0] == 202

    def draining() -> dict[str, Any] | None:
        # The state turns `draining` before the first look at vLLM's in-flight count fills `draining`.
        status = api(agent, "GET", "/status")[1]["components"]["vllm"]
        return status if status["state"] == "draining" and "draining" in status else None

    status = wait_for("draining with the requests left", draining, 10)
    assert status["draining"]["running"] + status["draining"]["waiting"] == 1, status.get("draining")
    assert api(agent, "GET", "/readyz")[0] == 503, "readiness goes false first: the balancer stops sending"
    assert agent.children()["vllm"]["pid"] == pid
    thread.join(60)
    assert finished == [200], "the in-flight request completed before the stop"
    replaced(agent, pid)
    assert "[vllm] drained in" in agent.log()


def test_no_drain_restarts_at_once_under_load(agent: LocalAgent) -> None:
    agent.wait_all_up()
    pid = agent.children()["vllm"]["pid"]
    long_completion(vllm(agent, "/v1/chat/completions"))
    wait_for("the request running", lambda: "1 request running" in liveness(agent)["last"]["detail"], 30)
    began, mark = time.monotonic(), len(agent.log())
    assert api(agent, "POST", "/components/vllm/restart", {"drain": False})[0] == 202
    replaced(agent, pid)
    assert time.monotonic() - began < 30
    assert "draining (readiness off)" not in agent.log()[mark:]


def test_a_worker_stall_shorter_than_max_age_keeps_it_a_longer_one_restarts_it(agent: LocalAgent) -> None:
    """A stall of the worker shorter than `max_age_s` (the guide's 30 s by default, 8 s here) keeps it and its KV
    pool; one longer restarts it. A 10.7 s SIGSTOP restarted the worker under the old 5 s default."""
    agent.wait_all_up()
    pid = agent.children()["datasystem"]["pid"]
    live = agent.home / "yr" / "liveness"
    mark = len(agent.log())
    seen = live.stat().st_mtime
    wait_for("the worker rewrites its liveness file", lambda: live.stat().st_mtime != seen, 30)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(WORKER_MAX_AGE_S / 2)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for("the file fresh again", lambda: time.time() - live.stat().st_mtime < 2, 30)
    time.sleep(3)  # a few more liveness results after the stall
    assert agent.children()["datasystem"]["pid"] == pid
    assert "[datasystem] liveness failed" not in agent.log()[mark:]
    os.kill(pid, signal.SIGSTOP)
    wait_for("the stopped worker replaced", lambda: agent.children().get("datasystem", {}).get("pid") not in
             (None, pid), 60)  # fmt: skip
    assert "[datasystem] liveness failed" in agent.log()[mark:]
    agent.wait_all_up()

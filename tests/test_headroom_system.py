"""Issue 19 item 5 on real processes: the real datasystem worker (under real etcd) killed with -9, the vLLM
stand-in depending on it, the agent's headroom rule over this machine's real /proc/meminfo. Without huge pages
(the only path a dev box has) the pool fills as it is used, so only MemAvailable below
`recovery.worker_headroom_margin_mb` is short: a margin of 0 leaves room — the worker restarts alone and vLLM keeps
its process; a margin above what is free is short — the worker and the local vLLM restart as one step (vLLM stops
first, the worker waits for it, then both start in order). What the stand-in cannot show: that its client really
mapped the dead worker's segments (it maps none) — the huge-page arithmetic is tests/test_recovery_layer.py's."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from conftest import LocalAgent, derived_config, wait_for

pytestmark = pytest.mark.system

SHORT_MB = 1 << 40
"""A margin no machine has free."""


@pytest.fixture(params=["room", "short"])
def agent(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalAgent, bool]]:  # fmt: skip
    base = tmp_path_factory.mktemp("headroom")
    home = base / "home"
    home.mkdir()
    changes = {"recovery": {"worker_headroom_margin_mb": SHORT_MB if request.param == "short" else 0},
               "components": {"vllm": {"env": {"VLLM_STANDIN_STARTUP_DELAY_S": "0.3"}}}}  # fmt: skip
    a = LocalAgent(home, derived_config(base / "config.yaml", changes))
    a.start()
    try:
        a.wait_all_up()
        yield a, request.param == "short"
    finally:
        a.cleanup()


def test_a_killed_worker_restarts_alone_with_room_and_with_the_local_vllm_when_short(
        agent: tuple[LocalAgent, bool]) -> None:  # fmt: skip
    agent, short = agent
    before = agent.children()
    mark = len(agent.log())
    os.kill(before["datasystem"]["pid"], signal.SIGKILL)
    wait_for("a new worker", lambda: agent.children().get("datasystem", {}).get("pid")
             not in (None, before["datasystem"]["pid"]), 90, 0.3)  # fmt: skip
    agent.wait_all_up()
    after, log = agent.children(), agent.log()[mark:]
    assert after["etcd"]["pid"] == before["etcd"]["pid"]
    if not short:
        assert "MB available (the pool fills as used; margin 0 MB): the worker restarts alone" in log, log
        assert "next: restart now" in log
        assert after["vllm"]["pid"] == before["vllm"]["pid"], "the client reconnects by itself: vLLM keeps running"
        assert "[vllm] stopping pid" not in log
        return
    assert "next: memory headroom short (" in log, log
    assert (f"MB available (the pool fills as used; margin {SHORT_MB} MB)): the worker restarts with vllm as one "
            "step") in log, log  # fmt: skip
    assert after["vllm"]["pid"] != before["vllm"]["pid"], "vLLM restarted with the worker"
    held = log.index("[datasystem] waiting: waiting for vllm to stop: they still map the dead worker's shared memory")
    stopped = log.index(f"[vllm] stopped pid {before['vllm']['pid']}")
    starting = log.index("[datasystem] stopped → starting")
    assert held < stopped < starting, "the worker held (memory_headroom) until vLLM let go, then started"
    assert starting < log.index("[vllm] stopped → starting"), "then vLLM, its dependent"

"""A vLLM's own processes watched (`nodeagent.tree_watch`): the pure bookkeeping, the loop with a fake lister, and
the lister on a real process tree whose children carry vLLM's titles (bash's `exec -a`)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

from conftest import wait_for

from nodeagent.process import record_of
from nodeagent.tree_watch import TreeMembers, loss_detail, vllm_processes, watch_tree


def test_a_member_gone_is_named_once_and_new_ones_join() -> None:
    members = TreeMembers()
    assert members.observe({(10, 1.0): "VLLM::EngineCore_DP0", (11, 1.0): "VLLM::DPCoordinator"}) == []
    assert members.observe({(10, 1.0): "VLLM::EngineCore_DP0", (12, 2.0): "VLLM::Worker_DP0"}) == [
        "VLLM::DPCoordinator (pid 11)"]
    assert members.observe({(10, 1.0): "VLLM::EngineCore_DP0", (12, 2.0): "VLLM::Worker_DP0"}) == []
    assert members.observe({(10, 9.0): "VLLM::EngineCore_DP0", (12, 2.0): "VLLM::Worker_DP0"}) == [
        "VLLM::EngineCore_DP0 (pid 10)"], "a reused PID is another process"
    assert "DPCoordinator (pid 11) exited" in loss_detail(["VLLM::DPCoordinator (pid 11)"])


async def test_the_loop_reports_the_first_loss_and_stops_when_the_run_is_no_longer_ours() -> None:
    seen = [{(1, 1.0): "VLLM::EngineCore", (2, 1.0): "VLLM::DPCoordinator"}, {(1, 1.0): "VLLM::EngineCore"}]
    losses: list[str] = []
    record = record_of(os.getpid())
    await asyncio.wait_for(watch_tree(record, lambda: True, losses.append, 0.001,
                                      lambda r: seen[0] if len(seen) == 1 else seen.pop(0)), 5)  # fmt: skip
    assert len(losses) == 1 and losses[0].startswith("VLLM::DPCoordinator (pid 2) exited")
    losses.clear()
    ours = [True]

    def lister(r: object) -> dict[tuple[int, float], str]:
        ours[0] = False  # a stop began: the dying tree is not a failure
        return {}

    await asyncio.wait_for(watch_tree(record, lambda: ours[0], losses.append, 0.001, lister), 5)
    assert losses == []


def test_the_lister_finds_the_titled_processes_of_a_real_tree_and_sees_one_die() -> None:
    script = ("(exec -a VLLM::EngineCore_DP0 sleep 300) & (exec -a VLLM::DPCoordinator sleep 300) & "
              "(exec -a helper sleep 300) & wait")
    main = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    try:
        record = record_of(main.pid)
        found = wait_for("two titled children", lambda: (lambda f: f if len(f) == 2 else None)(
            vllm_processes(record)), 10, 0.05)
        assert sorted(found.values()) == ["VLLM::DPCoordinator", "VLLM::EngineCore_DP0"], "helper and bash left out"
        members = TreeMembers()
        members.observe(found)
        (coordinator,) = [pid for (pid, _), title in found.items() if title == "VLLM::DPCoordinator"]
        os.kill(coordinator, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not (gone := members.observe(vllm_processes(record))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone == [f"VLLM::DPCoordinator (pid {coordinator})"]
    finally:
        os.killpg(main.pid, signal.SIGKILL)
        main.wait(10)

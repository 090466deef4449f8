"""A vLLM's own processes watched (`nodeagent.probes.tree_watch`): the pure bookkeeping, the loop with a fake lister,
and the lister on a real process tree whose children carry vLLM's titles (bash's `exec -a`)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

from conftest import wait_for

from nodeagent.core.process import record_of
from nodeagent.probes.tree_watch import STOPPED_AFTER_S, Seen, TreeMembers, problem_detail, vllm_processes, watch_tree


def seen(**titles: str) -> dict[tuple[int, float], Seen]:
    """`p10="VLLM::EngineCore"` → {(10, 1.0): Seen("VLLM::EngineCore")}; a title ending in `!` is stopped."""
    return {(int(k[1:]), 1.0): Seen(t.rstrip("!"), t.endswith("!"), t == "main") for k, t in titles.items()}


def test_a_member_gone_is_named_once_and_new_ones_join() -> None:
    members = TreeMembers()
    assert members.observe({**seen(p9="main", p10="VLLM::EngineCore_DP0", p11="VLLM::DPCoordinator")}, 0) == []
    assert members.observe({**seen(p9="main", p10="VLLM::EngineCore_DP0"), (12, 2.0): Seen("VLLM::Worker_DP0")},
                           2) == ["VLLM::DPCoordinator (pid 11) exited"]  # fmt: skip
    assert members.observe({**seen(p10="VLLM::EngineCore_DP0"), (12, 2.0): Seen("VLLM::Worker_DP0")}, 4) == [], (
        "the API server's own exit is the pidfd's")
    assert members.observe({(10, 9.0): Seen("VLLM::EngineCore_DP0"), (12, 2.0): Seen("VLLM::Worker_DP0")}, 6) == [
        "VLLM::EngineCore_DP0 (pid 10) exited"], "a reused PID is another process"
    assert "DPCoordinator (pid 11) exited while" in problem_detail(["VLLM::DPCoordinator (pid 11) exited"])


def test_a_process_stopped_long_enough_is_a_problem_and_one_that_resumes_is_not() -> None:
    members = TreeMembers()
    assert members.observe(seen(p9="main", p10="VLLM::EngineCore_DP1!"), 0) == []
    assert members.observe(seen(p9="main", p10="VLLM::EngineCore_DP1!"), STOPPED_AFTER_S - 1) == []
    assert members.observe(seen(p9="main", p10="VLLM::EngineCore_DP1"), STOPPED_AFTER_S + 1) == [], "it resumed"
    assert members.observe(seen(p9="main", p10="VLLM::EngineCore_DP1!"), 20) == [], "a new stop counts anew"
    assert members.observe(seen(p9="main", p10="VLLM::EngineCore_DP1!"), 20 + STOPPED_AFTER_S) == [
        f"VLLM::EngineCore_DP1 (pid 10) stopped for {STOPPED_AFTER_S:.0f} s"]
    assert members.observe(seen(p9="main!", p10="VLLM::EngineCore_DP1"), 40) == []
    assert members.observe(seen(p9="main!", p10="VLLM::EngineCore_DP1"), 52) == ["main (pid 9) stopped for 12 s"]


async def test_the_loop_reports_the_first_loss_and_stops_when_the_run_is_no_longer_ours() -> None:
    views = [seen(p1="VLLM::EngineCore", p2="VLLM::DPCoordinator"), seen(p1="VLLM::EngineCore")]
    losses: list[str] = []
    record = record_of(os.getpid())
    await asyncio.wait_for(watch_tree(record, lambda: True, losses.append, 0.001,
                                      lambda r: views[0] if len(views) == 1 else views.pop(0)), 5)  # fmt: skip
    assert len(losses) == 1 and losses[0].startswith("VLLM::DPCoordinator (pid 2) exited")
    losses.clear()
    ours = [True]

    def lister(r: object) -> dict[tuple[int, float], Seen]:
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
        found = wait_for("two titled children", lambda: (lambda f: f if len(f) == 3 else None)(
            vllm_processes(record)), 10, 0.05)
        assert sorted(s.title for s in found.values()) == ["API server", "VLLM::DPCoordinator",
                                                          "VLLM::EngineCore_DP0"], "the helper left out"
        members = TreeMembers()
        members.observe(found, 0)
        pids = {s.title: pid for (pid, _), s in found.items()}
        os.kill(pids["VLLM::EngineCore_DP0"], signal.SIGSTOP)
        stopped = wait_for("seen stopped", lambda: (lambda f: f if any(s.stopped for s in f.values()) else None)(
            vllm_processes(record)), 10, 0.05)
        assert members.observe(stopped, STOPPED_AFTER_S + 1) == [], "the first look starts the clock"
        assert members.observe(vllm_processes(record), 2 * STOPPED_AFTER_S + 1) == [
            f"VLLM::EngineCore_DP0 (pid {pids['VLLM::EngineCore_DP0']}) stopped for {STOPPED_AFTER_S + 0:.0f} s"]
        os.kill(pids["VLLM::DPCoordinator"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not (gone := members.observe(vllm_processes(record), 0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"VLLM::DPCoordinator (pid {pids['VLLM::DPCoordinator']}) exited" in gone
    finally:
        os.killpg(main.pid, signal.SIGKILL)
        main.wait(10)

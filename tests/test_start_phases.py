"""Issue 32 item 1: every phase of a vLLM start, from the engine's own lines (`vllm.start_phases`) — parsed on a
captured CPU vLLM 0.32 start and on vllm-ascend's lines as its source prints them (tests/fixtures/vllm/, each
file's header says where from); no process is started here."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nodeagent.vllm.start_phases import PHASES, StartPhases, died_in, line_time, phase_of_line

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


def lines(name: str) -> list[str]:
    return [line for line in (FIXTURES / name).read_text().splitlines() if not line.startswith("# ")]


def local(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))


def test_a_captured_cpu_vllm_start_gives_each_phase_the_engine_printed() -> None:
    start = local("2026-12-07 02:31:19")
    phases = StartPhases(start)
    for line in lines("captured-vllm_cpu_0.32_start.log"):
        phases.feed(line, start + 400)
    seconds = phases.seconds()
    assert seconds["imports"] == 20.0, "launch → the API server's first line (02:31:39)"
    assert seconds["weights"] == 0.11, "vLLM's own `Loading weights took 0.11 seconds`"
    assert seconds["compile"] == 175.0, "`Warming up model for the compilation` 02:33:04 → profiling run 02:35:59"
    assert seconds["kv_cache"] == 3.0, "compile's end → `CPU KV cache size` 02:36:02"
    assert seconds["api"] == 22.0, "→ `Starting vLLM server on` 02:36:24 (0.32's words), after the slowest rank"
    assert "graphs" not in seconds, "a CPU vLLM captures no graphs: not seen, not an error"
    assert "first_token" in seconds, "the 200 of a completion (uvicorn's access line, no stamp: when read)"
    assert phases.reached() == "first_token" and phases.weights_gib is None


def test_a_warm_compile_cache_is_recognised() -> None:
    phases = StartPhases(0.0)
    phases.feed("(Worker pid=9) INFO 12-07 02:40:01 [decorators.py:320] [backbone] Directly load AOT compilation "
                "from path /c/torch_compile_cache/torch_aot_compile/65/rank_0_0/model", 5.0)  # fmt: skip
    assert phases.compile_cached and phases.to_dict()["compile_cached"] is True


def test_vllm_ascend_ranks_are_kept_apart_and_the_start_is_as_far_as_its_slowest() -> None:
    start = local("2026-12-07 09:59:50")
    phases = StartPhases(start)
    log = lines("doc-vllm_ascend_dp2_start.log")
    for line in log:
        phases.feed(line, start + 1000)
    ranks = phases.to_dict()["ranks"]
    assert ranks["0"]["seconds"]["weights"] == 63.08 and ranks["1"]["seconds"]["weights"] == 70.41
    assert ranks["0"]["seconds"]["compile"] == 166.02 and ranks["1"]["seconds"]["graphs"] == 95.0
    seconds = phases.seconds()
    assert (seconds["weights"], seconds["compile"], seconds["graphs"]) == (70.41, 170.5, 95.0), "the slowest rank"
    assert phases.weights_gib == 41.25, "vllm-ascend's `Loading model weights took 41.2500 GB`"
    assert seconds["api"] == 5.0, "after the slowest rank's graphs (10:06:35) → the API server 10:06:40"
    assert phases.reached() == "api" and phases.current() == "ready", "the agent's probe has not passed yet"


def test_one_rank_behind_holds_the_phase_the_start_is_in() -> None:
    phases = StartPhases(0.0)
    phases.feed("(EngineCore_DP0 pid=1) INFO 12-07 10:00:00 [x.py:1] Loading weights took 3.00 seconds", 10.0)
    assert phases.current() == "compile"
    phases.feed("(EngineCore_DP1 pid=2) INFO 12-07 10:00:00 [x.py:1] Starting to load model /m...", 11.0)
    assert phases.reached() == "imports" and phases.current() == "weights", "rank 1 is still loading"


@pytest.mark.parametrize("line", [
    "", "garbage \x00\xff", "(APIServer pid=1) INFO 99-99 99:99:99 [x.py:1] Loading weights took nan seconds",
    "Loading weights took", "(Worker pid=1) INFO 12-07 10:00:00 [x.py:1] torch.compile took s in total",
    "INFO:     127.0.0.1:1 - \"POST /v1/completions HTTP/1.1\" 500 Internal Server Error",
    "(EngineCore_DP9999999999999999999 pid=1) INFO 12-07 10:00:00 [x.py:1] KV cache size: , tokens",
])  # fmt: skip
def test_unknown_and_broken_lines_never_break_it(line: str) -> None:
    phases = StartPhases(0.0)
    phases.feed(line, 1.0)
    assert set(phases.seconds()) <= {"imports"}, "no phase ended by a line that is not one of vLLM's"


def test_a_line_time_is_its_own_stamp_only_between_the_launch_and_the_read() -> None:
    start = local("2026-12-07 10:00:00")
    line = "(Worker pid=1) INFO 12-07 10:01:00 [x.py:1] hi"
    assert line_time(line, start + 120, start) == start + 60
    assert line_time(line, start + 30, start) == start + 30, "a stamp after the read (another clock): the read"
    assert line_time("no stamp", 7.0, 0.0) == 7.0


def test_the_engine_own_number_wins_and_the_agent_marks_ready() -> None:
    phases = StartPhases(100.0)
    phases.feed("(Worker pid=1) INFO 01-01 00:00:00 [gpu_model_runner.py:5150] Model loading took 12.5 GiB memory and "
                "61.234567 seconds", 170.0)  # fmt: skip
    phases.feed("(Worker pid=1) INFO 01-01 00:00:00 [graphs.py:1] Graph capturing finished in 88 secs, took 1.0 GiB",
                300.0)  # fmt: skip
    phases.mark("ready", 310.0)
    seconds = phases.seconds()
    assert seconds["weights"] == 61.235 and phases.weights_gib == 12.5
    assert seconds["graphs"] == 88.0 and seconds["ready"] == 10.0
    assert list(seconds) == [p for p in PHASES if p in seconds], "in the order a start passes them"


def test_a_start_that_died_names_the_phase() -> None:
    log = lines("doc-vllm_ascend_dp2_start.log")
    upto_weights = [line for line in log if "torch.compile" not in line][:8]
    found = died_in(upto_weights)
    assert found["died_in"] == "compile" and found["reached"] == "weights"
    assert died_in([])["died_in"] == "imports", "nothing printed: it died importing"
    assert phase_of_line("Graph capturing finished in 3 secs, took 0.10 GiB") is not None

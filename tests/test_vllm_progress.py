"""Load-safe vLLM liveness: the pure progress monitor on a fake clock, then the probe against the stand-in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import free_port

from nodeagent.config.load import load_config
from nodeagent.config.model import ProbeBase, VllmProgressProbe
from nodeagent.core.errors import ConfigError
from nodeagent.probes.kinds import ProbeContext, ProbeResult, ResolvedProbe, probe_state, vllm_probe_body
from nodeagent.probes.prober import ProbeTracker
from nodeagent.probes.resolve import resolve_probe_set
from nodeagent.vllm.progress import (
    EngineProgress,
    ProgressMetricsError,
    ProgressMonitor,
    default_stall_after_s,
    parse_progress,
)

STANDIN_MODEL = str(Path(__file__).resolve().parents[1] / "config" / "standin-model")

# A vLLM-shaped page: HELP/TYPE lines, `_created` samples, histogram buckets, two DP engines.
PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="dsv4"} 2.0
vllm:num_requests_running{engine="1",model_name="dsv4"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="dsv4"} 1.0
vllm:num_requests_waiting{engine="1",model_name="dsv4"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="dsv4"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="dsv4"} 0.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="dsv4"} 32768.0
vllm:prompt_tokens_created{engine="0",model_name="dsv4"} 1.7e+09
vllm:prompt_tokens_total{engine="1",model_name="dsv4"} 5.0
vllm:generation_tokens_total{engine="0",model_name="dsv4"} 1200.0
vllm:generation_tokens_total{engine="1",model_name="dsv4"} 2.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="dsv4"} 3.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="dsv4"} 611.0
vllm:iteration_tokens_total_count{engine="0",model_name="dsv4"} 611.0
vllm:iteration_tokens_total_sum{engine="0",model_name="dsv4"} 33968.0
vllm:iteration_tokens_total_created{engine="0",model_name="dsv4"} 1.7e+09
vllm:iteration_tokens_total_count{engine="1",model_name="dsv4"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="dsv4"} 999.0
"""


def engine(name: str = "0", **values: float) -> EngineProgress:
    return EngineProgress(name, **values)


def busy(gen: float, running: float = 2, waiting: float = 0, **more: float) -> dict[str, EngineProgress]:
    return {"0": engine(running=running, waiting=waiting, generation_tokens=gen, prompt_tokens=100,
                        steps=gen, kv_usage=0.1, **more)}  # fmt: skip


# ---------------------------------------------------------------------------------------------- parsing


def test_parse_reads_the_six_metrics_per_engine() -> None:
    engines = parse_progress(PAGE)
    assert engines == {
        "0": EngineProgress("0", running=2, waiting=1, kv_usage=0.25, generation_tokens=1200,
                            prompt_tokens=32768, steps=611),
        "1": EngineProgress("1", generation_tokens=2, prompt_tokens=5, steps=1),
    }  # fmt: skip
    assert engines["0"].in_flight and not engines["1"].in_flight


def test_parse_sums_other_labels_and_tolerates_odd_pages() -> None:
    # Several API servers (Prometheus multiprocess) or models add labels: sum them per engine.
    text = (
        'vllm:generation_tokens_total{model_name="a",engine="0",pid="1"} 3\n'
        'vllm:generation_tokens_total{model_name="b",engine="0",pid="2"} 4 1700000000000\n'
        "vllm:num_requests_running 1\n"  # no engine label: a single-engine server
        'vllm:gpu_cache_usage_perc{engine="2"} 0.5\n'  # the gauge's name before vLLM 0.10
    )
    engines = parse_progress(text)
    assert engines["0"].generation_tokens == 7 and engines["0"].running == 1
    assert engines["2"].kv_usage == 0.5
    assert parse_progress("<html><body>not metrics</body></html>") == {}
    assert parse_progress("") == {}
    with pytest.raises(ProgressMetricsError, match="no number"):
        parse_progress('vllm:num_requests_running{engine="0"} lots\n')
    with pytest.raises(ProgressMetricsError, match="impossible value"):
        parse_progress('vllm:generation_tokens_total{engine="0"} -1\n')


# ---------------------------------------------------------------------------------------------- the monitor


def test_an_engine_that_keeps_generating_is_never_stalled() -> None:
    monitor = ProgressMonitor(stall_after_s=60)
    for tick in range(0, 2 * 3600, 6):  # two hours of two long requests, one token per 6 s
        verdict = monitor.observe(float(tick), busy(gen=tick / 6))
        assert verdict.ok and not verdict.canary, (tick, verdict)
    assert verdict.detail == "2 requests running; +1 tokens, +1 steps in 6.0 s"


def test_a_hang_under_load_fails_definitely_after_stall_after_s() -> None:
    monitor = ProgressMonitor(stall_after_s=60)
    assert monitor.observe(0, busy(gen=10)).detail == "2 requests running; first look, watching progress"
    assert monitor.observe(6, busy(gen=20)).ok  # last progress seen at t=6
    for t in range(12, 66, 6):
        verdict = monitor.observe(t, busy(gen=20))
        assert verdict.ok and not verdict.definite
    assert verdict.detail == "2 requests running; engine without progress for 54 s (stalled at 60 s)"
    assert monitor.observe(65.4, busy(gen=20)).ok  # 59.4 s: not yet
    stalled = monitor.observe(67, busy(gen=20))
    assert not stalled.ok and stalled.definite
    assert stalled.detail == "engine stalled: 2 requests running, no token progress for 61 s"
    waiting = monitor.observe(70, busy(gen=20, running=1, waiting=3))  # a gauge changed: it stepped
    assert waiting.ok
    late = monitor.observe(131, busy(gen=20, running=1, waiting=3))
    assert late.detail == "engine stalled: 1 request running, 3 waiting, no token progress for 61 s"


def test_a_prefill_chunk_moves_only_the_kv_gauge_and_that_is_progress() -> None:
    monitor = ProgressMonitor(stall_after_s=60)
    for t in range(0, 600, 6):  # one 200k-token prefill: no output for ten minutes, KV blocks growing
        verdict = monitor.observe(t, {"0": engine(running=1, kv_usage=t / 1000)})
        assert verdict.ok, verdict
    assert verdict.detail == "1 request running; scheduler state changed in 6.0 s"


def test_idle_asks_for_the_canary_and_counts_its_failures() -> None:
    monitor = ProgressMonitor(stall_after_s=60)
    idle = monitor.observe(0, {"0": engine(generation_tokens=5)})
    assert idle.ok and idle.canary and idle.detail == "engine idle"
    assert [monitor.canary_result(False) for _ in range(3)] == [1, 2, 3]
    assert monitor.canary_result(True) == 0
    monitor.canary_result(False)
    monitor.observe(6, busy(gen=10))  # real traffic arrived: the engine stepped
    assert monitor.canary_failures == 0
    nothing = monitor.observe(12, {})
    assert nothing.canary and "judged by the canary alone" in nothing.detail


def test_an_idle_engine_is_never_stalled_however_long_it_rests() -> None:
    monitor = ProgressMonitor(stall_after_s=60)
    monitor.observe(0, {"0": engine(generation_tokens=5)})
    assert monitor.observe(3600, {"0": engine(generation_tokens=5)}).canary
    # Work arriving changes the gauges: the stall clock starts there, not at the last token an hour ago.
    assert monitor.observe(3606, busy(gen=5)).ok
    assert monitor.observe(3660, busy(gen=5)).ok
    assert monitor.observe(3666, busy(gen=5)).definite
    jitter = ProgressMonitor(stall_after_s=60)
    jitter.observe(0.003, busy(gen=1))
    assert jitter.observe(59.998, busy(gen=1)).definite  # ten 6 s periods, scraped 5 ms early: a stall


def test_counter_reset_is_neither_progress_nor_stall() -> None:
    monitor = ProgressMonitor(stall_after_s=60)
    monitor.observe(0, busy(gen=5000))
    assert monitor.observe(50, busy(gen=5000)).ok  # 50 s without progress on the old process
    # A new process (counters back near zero) with a request in flight: its clock starts now.
    reset = monitor.observe(56, busy(gen=3, running=1))
    assert reset.ok and "counters went back (a new vLLM process)" in reset.detail
    assert monitor.observe(115, busy(gen=3, running=1)).ok  # 59 s, not 115 s
    assert not monitor.observe(116, busy(gen=3, running=1)).ok


def test_data_parallel_engines_are_judged_one_by_one() -> None:
    monitor = ProgressMonitor(stall_after_s=60)

    def both(t: float, gen1: float) -> dict[str, EngineProgress]:
        return {"0": engine("0", running=1, generation_tokens=t), "1": engine("1", running=2, generation_tokens=gen1)}

    assert monitor.observe(0, both(0, 7)).ok
    ok = monitor.observe(30, both(30, 7))
    assert ok.ok and ok.detail.startswith("2 of 2 engines busy, 3 requests running; engine 1 without progress")
    stalled = monitor.observe(60, both(60, 7))
    assert stalled.definite and stalled.detail == "engine 1 stalled: 2 requests running, no token progress for 60 s"
    gone = monitor.observe(66, {"0": engine("0", running=1, generation_tokens=66)})
    assert gone.ok


# ---------------------------------------------------------------------------------------------- the prober


def test_a_definite_failure_beats_the_failure_threshold() -> None:
    tracker = ProbeTracker(ProbeBase(failure_threshold=3))

    def res(ok: bool, definite: bool = False) -> ProbeResult:
        return ProbeResult(ok, "x", 0.0, "vllm_progress", time.time(), definite=definite)

    assert tracker.observe(res(True)) == "success"
    assert tracker.observe(res(False)) == "success"  # a failed canary: 1 of 3
    assert tracker.observe(res(False, definite=True)) == "failure"
    assert tracker.observe(res(True)) == "success"


# ---------------------------------------------------------------------------------------------- config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


VLLM_ONLY = "components:\n  vllm:\n    kind: vllm\n    model: /m\n"


def test_the_default_and_a_partial_override(tmp_path: Path) -> None:
    live = load_config(write(tmp_path, VLLM_ONLY)).components["vllm"].probes.liveness
    assert live == [VllmProgressProbe(period_s=2.5, timeout_s=4, failure_threshold=3, stall_after_s=None)]
    tuned = VLLM_ONLY + "    probes: {liveness: {period_s: 5, timeout_s: 5, failure_threshold: 2}}\n"
    live = load_config(write(tmp_path, tuned)).components["vllm"].probes.liveness
    assert live == [VllmProgressProbe(period_s=5, timeout_s=5, failure_threshold=2, stall_after_s=None)]
    old = VLLM_ONLY + "    probes: {liveness: {kind: http, timeout_s: 60}}\n"
    assert load_config(write(tmp_path, old)).components["vllm"].probes.liveness[0].kind == "http"


def test_the_default_stall_window_scales_with_the_batched_tokens(tmp_path: Path) -> None:
    # 5 x the longest healthy step (3.5 s per 4096-token chunk), never below 20 s
    assert [default_stall_after_s(n) for n in (None, 512, 4096, 8192, 16384)] == [20, 20, 20, 35, 70]
    config = load_config(write(tmp_path, VLLM_ONLY))
    assert resolve_probe_set(config.components["vllm"], config)["liveness"][0].stall_after_s == 20
    big = load_config(write(tmp_path, VLLM_ONLY + "    max_num_batched_tokens: 16384\n"))
    assert resolve_probe_set(big.components["vllm"], big)["liveness"][0].stall_after_s == 70
    fixed = load_config(write(tmp_path, VLLM_ONLY + "    max_num_batched_tokens: 16384\n"
                              "    probes: {liveness: {stall_after_s: 45}}\n"))
    assert resolve_probe_set(fixed.components["vllm"], fixed)["liveness"][0].stall_after_s == 45


def _next_tick(next_at: float, now: float, period: float) -> float:
    """The prober's grid (`ComponentProber._worker`): the next tick, skipping those a long run overran."""
    next_at += period
    return next_at + math.ceil((now - next_at) / period) * period if next_at < now else next_at


def test_the_defaults_catch_a_hang_within_30_s_under_load_and_20_s_idle(tmp_path: Path) -> None:
    """The detection budget of the default probe, over every phase of the hang against the probe's grid: under
    load the monitor's stall window on the scrape grid; idle, failure_threshold canaries that each time out."""
    config = load_config(write(tmp_path, VLLM_ONLY))
    probe = resolve_probe_set(config.components["vllm"], config)["liveness"][0]
    period, timeout = probe.spec.period_s, probe.spec.timeout_s
    worst_load = worst_idle = 0.0
    for phase in (i / 50 * period for i in range(1, 51)):  # the hang lands `phase` s before the next scrape
        monitor, gen, t, hang = ProgressMonitor(probe.stall_after_s), 0.0, 0.0, 10 * period - phase
        while monitor.observe(t, busy(gen=gen)).ok:
            t += period
            gen = min(t, hang)  # a token per second until the hang
            assert t < 600
        worst_load = max(worst_load, t - hang)
        tracker, next_at, t = ProbeTracker(probe.spec), 10 * period, 10 * period
        while tracker.observe(ProbeResult(False, "canary: no answer", 0.0, "vllm_progress", 0.0)) != "failure":
            next_at = t = _next_tick(next_at, t + timeout + 0.05, period)  # scrape + a canary that times out
        worst_idle = max(worst_idle, t + timeout + 0.05 - (10 * period - phase))
    assert 20 <= worst_load <= 23 and worst_idle <= 17, (worst_load, worst_idle)


def test_config_errors_name_the_problem(tmp_path: Path) -> None:
    no_stats = VLLM_ONLY + "    extra_args: [--disable-log-stats]\n"
    with pytest.raises(ConfigError, match="--disable-log-stats, which removes the vllm:\\* metrics"):
        load_config(write(tmp_path, no_stats))
    startup = VLLM_ONLY + "    probes: {startup: {kind: vllm_progress}}\n"
    with pytest.raises(ConfigError, match="for startup use http_get /health"):
        load_config(write(tmp_path, startup))
    bad = VLLM_ONLY + "    probes: {liveness: {stall_after_s: 0}}\n"
    with pytest.raises(ConfigError, match="stall_after_s"):
        load_config(write(tmp_path, bad))


# ------------------------------------------------------------------------------------- the probe on the stand-in




@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`vllm-standin` (the real API server → EngineCore → Worker tree) decoding one token per 50 ms step."""
    port = free_port()
    tmp = tmp_path_factory.mktemp("standin")
    env = {**os.environ, "TMPDIR": str(tmp), "VLLM_STANDIN_STARTUP_DELAY_S": "0.2", "VLLM_STANDIN_STEP_S": "0.05",
           "VLLM_STANDIN_TOKENS_PER_STEP": "1", "VLLM_STANDIN_ORPHAN_EXIT_S": "20"}  # fmt: skip
    argv = [sys.executable, "-m", "vllm_standin.vllm", "serve", STANDIN_MODEL, "--served-model-name", "dsv4",
            "--port", str(port), "--max-num-seqs", "2"]  # fmt: skip
    with open(tmp / "standin.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=1):
                break
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "standin.log").read_text()
            time.sleep(0.05)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        proc.wait(10)


def fault(url: str, mode: str) -> None:
    request = urllib.request.Request(url + "/standin/fault", data=json.dumps({"mode": mode}).encode())
    urllib.request.urlopen(request, timeout=5).close()


def progress_probe(url: str, stall_after_s: float = 1.0, timeout_s: float = 0.5) -> ResolvedProbe:
    spec = VllmProgressProbe(timeout_s=timeout_s, stall_after_s=stall_after_s)
    return ResolvedProbe(spec, spec.kind, url, url=url, body=vllm_probe_body("dsv4"),
                         expect_nonempty="choices.0.message.content", stall_after_s=stall_after_s)  # fmt: skip


@pytest.fixture
async def ctx() -> AsyncIterator[ProbeContext]:
    context = ProbeContext()
    yield context
    await context.close()


async def long_requests(url: str, n: int) -> list[asyncio.Task[Any]]:
    body = {"model": "dsv4", "messages": [{"role": "user", "content": "write forever"}], "max_tokens": 100000,
            "ignore_eos": True}  # fmt: skip

    async def one() -> None:
        async with aiohttp.ClientSession() as session, session.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()

    return [asyncio.create_task(one()) for _ in range(n)]


async def test_probe_on_an_idle_standin_sends_the_canary(ctx: ProbeContext, standin: str) -> None:
    probe = progress_probe(standin)
    state = probe_state(probe)
    result = await ctx.run(probe, state)
    assert result.ok and result.detail.startswith("engine idle; canary answered: HTTP 200"), result.detail
    fault(standin, "hang")
    try:
        failed = [await ctx.run(probe, state) for _ in range(2)]
    finally:
        fault(standin, "none")
    assert [r.ok or r.definite for r in failed] == [False, False]  # counted by the threshold, not at once
    assert failed[1].detail == "engine idle, but the canary chat failed (2nd in a row): no answer within 0.5s"


async def test_probe_under_load_judges_progress_and_catches_the_hang(ctx: ProbeContext, standin: str) -> None:
    probe = progress_probe(standin, stall_after_s=1.0)
    state = probe_state(probe)
    tasks = await long_requests(standin, 3)  # --max-num-seqs 2: one of them waits
    try:
        async def look() -> ProbeResult:
            return await ctx.run(probe, state)

        first = await look()
        deadline = time.monotonic() + 10
        while "1 waiting" not in first.detail and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            first = await look()
        assert first.ok and first.detail.startswith("2 requests running, 1 waiting"), first.detail
        for _ in range(8):  # four stall windows of steady decoding: never stalled
            await asyncio.sleep(0.5)
            result = await look()
            assert result.ok and "tokens" in result.detail, result.detail
        fault(standin, "hang")
        started = time.monotonic()
        result = await look()
        while result.ok:
            await asyncio.sleep(0.2)
            result = await look()
        assert result.definite and 1.0 <= time.monotonic() - started < 3.0
        assert result.detail.startswith("engine stalled: 2 requests running, 1 waiting, no token progress for")
    finally:
        fault(standin, "none")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_probe_fails_at_once_on_an_errored_engine_and_reports_refusals(ctx: ProbeContext, standin: str) -> None:
    probe = progress_probe(standin)
    fault(standin, "503")
    try:
        result = await ctx.run(probe, probe_state(probe))
    finally:
        fault(standin, "none")
    assert not result.ok and result.definite
    assert result.detail == f"engine errored: {standin}/health answers 503 (vLLM reports its engine dead)"
    gone = f"http://127.0.0.1:{free_port()}"
    refused = await ctx.run(progress_probe(gone))
    assert not refused.ok and not refused.definite
    assert refused.detail == f"cannot connect to {gone}/health: Connection refused"

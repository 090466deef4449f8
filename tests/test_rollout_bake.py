"""The bake's judgement without processes: vLLM's /metrics text → what the group served, and the window since
the bake began against the old processes' record (`cluster.rollout_bake`)."""

from __future__ import annotations

import pytest

from nodeagent.cluster.rollout.bake import MIN_REQUESTS, ServingSample, judge_bake, parse_serving

# The names and labels vLLM 0.32 exposes (`vllm/v1/metrics/loggers.py`; http_requests_total from
# prometheus-fastapi-instrumentator, status grouped as "2xx"/"5xx", `entrypoints/serve/instrumentator/metrics.py`).
PAGE = """# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 90.0
http_requests_total{handler="/v1/chat/completions",method="POST",status="5xx"} 6.0
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 4.0
http_requests_total{handler="/v1/models",method="GET",status="2xx"} 1000.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="dsv4"} 80.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="dsv4"} 14.0
vllm:request_success_total{engine="0",finished_reason="error",model_name="dsv4"} 2.0
vllm:request_success_total{engine="1",finished_reason="error",model_name="dsv4"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="dsv4"} 94.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="dsv4"} 94.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="dsv4"} 47.0
"""


def test_a_page_reads_as_requests_errors_and_ttft() -> None:
    s = parse_serving(PAGE)
    assert s == ServingSample(requests=100.0, errors=6.0, ttft_sum=47.0, ttft_count=94.0)
    assert s.mean_ttft_s == pytest.approx(0.5)


def test_without_the_http_counters_vllms_own_finished_requests_count() -> None:
    s = parse_serving("\n".join(line for line in PAGE.splitlines() if not line.startswith("http_")))
    assert (s.requests, s.errors) == (97.0, 3.0)


def test_an_empty_or_foreign_page_served_nothing() -> None:
    assert parse_serving("") == ServingSample()
    assert parse_serving("garbage {\nprocess_cpu_seconds_total 3\n") == ServingSample()


def test_the_window_is_the_difference_and_a_restarted_process_counts_from_zero() -> None:
    start, now = ServingSample(100, 2, 50, 100), ServingSample(130, 5, 80, 120)
    assert now.since(start) == ServingSample(30, 3, 30, 20)
    assert ServingSample(4, 0, 1, 4).since(start) == ServingSample(4, 0, 1, 4)


def test_errors_past_the_rate_fail_the_bake() -> None:
    assert judge_bake(ServingSample(20, 1), None, 0.05, 2.0) is None  # 5% is the limit, not past it
    why = judge_bake(ServingSample(20, 2), None, 0.05, 2.0)
    assert why == "2 of 20 requests failed while baking (10%, more than 5%)"


def test_too_few_requests_say_nothing() -> None:
    assert judge_bake(ServingSample(MIN_REQUESTS - 1, MIN_REQUESTS - 1), 0.1, 0.05, 2.0) is None
    assert judge_bake(ServingSample(MIN_REQUESTS - 1, 0, 40.0, MIN_REQUESTS - 1), 0.1, 0.05, 2.0) is None


def test_ttft_past_the_factor_and_the_floor_fails_the_bake() -> None:
    slow = ServingSample(10, 0, ttft_sum=12.0, ttft_count=10)  # 1.2 s against 0.4 s
    assert judge_bake(slow, 0.4, 0.05, 2.0) == ("mean TTFT 1.20s over 10 requests while baking, 3.0x the 0.40s "
                                                "before the step (more than 2x)")  # fmt: skip
    assert judge_bake(slow, 0.4, 0.05, 4.0) is None, "within the factor"
    assert judge_bake(slow, None, 0.05, 2.0) is None, "no baseline: TTFT is not judged"
    noise = ServingSample(10, 0, ttft_sum=0.3, ttft_count=10)  # 30 ms against 5 ms: 6x, but 25 ms
    assert judge_bake(noise, 0.005, 0.05, 2.0) is None, "below the absolute floor"


def ttft_page(count: int, total_s: float) -> str:
    return (f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="dsv4"}} {count}\n'
            f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="dsv4"}} {total_s}\n'
            f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="dsv4"}} {count}\n')


async def test_without_the_old_processes_record_the_same_kind_peers_are_the_baseline() -> None:
    """A group that served nothing before its step (it was failing) leaves no TTFT: the other prefill groups'
    lifetime mean stands in, read as the bake begins."""
    from nodeagent.cluster.rollout.bake import BakeWatch

    pages = {"p1:8000": ttft_page(0, 0.0), "p0:8000": ttft_page(200, 20.0)}  # p0: 0.1 s per request

    async def scrape(endpoint: str) -> str:
        return pages[endpoint]

    watch = BakeWatch(scrape)
    key = ("r1", 0, "p1")
    await watch.remember_baseline(key, ["p1:8000"])
    assert watch.baselines[key] is None, "the old processes served nothing"
    assert await watch.check(key, ["p1:8000"], 0.05, 2.0, peers=["p0:8000"]) is None  # the window begins
    pages["p1:8000"] = ttft_page(10, 12.0)
    pages["p0:8000"] = ttft_page(400, 400.0)  # read once, at the start: later peer load does not move it
    why = await watch.check(key, ["p1:8000"], 0.05, 2.0, peers=["p0:8000"])
    assert why is not None and "1.20s over 10 requests" in why and "the 0.10s before the step" in why
    alone = BakeWatch(scrape)
    assert await alone.check(("r1", 0, "d0"), ["p1:8000"], 0.05, 2.0) is None, "no baseline at all: not judged"

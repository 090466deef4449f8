"""Hit-rate arithmetic and layout: resets, empty windows, engine sums, missing external metrics, garbage."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from nodeagent.vllm.cachehit import (
    CacheCounters,
    CacheMetricsError,
    compute_rates,
    compute_table,
    format_header,
    format_row,
    parse_cache_counters,
    rates_to_json,
    window_rates,
)

Counts = tuple[float, float, float | None, float | None]  # queries, hits, external queries, external hits


def exposition(engines: dict[str, Counts], model: str = "dsv4") -> str:
    """Text as vLLM's prometheus_client renders it: HELP/TYPE lines, ``_created`` gauges, other families."""
    names = (
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", 0),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", 1),
        ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector.", 2),
        ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector.", 3),
    )
    out = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
    ]
    out += [f'vllm:num_requests_running{{engine="{e}",model_name="{model}"}} 3.0' for e in engines]
    for name, help_text, idx in names:
        rows = [(e, v[idx]) for e, v in engines.items() if v[idx] is not None]
        if not rows:
            continue  # older vLLM, or no KV connector: the external families are absent altogether
        out += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
        out += [f'{name}_total{{engine="{e}",model_name="{model}"}} {value!r}' for e, value in rows]
        out += [f"# HELP {name}_created {help_text}", f"# TYPE {name}_created gauge"]
        out += [f'{name}_created{{engine="{e}",model_name="{model}"}} 1.7553e+09' for e, _ in rows]
    out += [
        "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="dsv4"} 2.0',
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="dsv4"} 5.0',
        'vllm:e2e_request_latency_seconds_count{engine="0",model_name="dsv4"} 5.0',
        'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="dsv4"} 7.25',
    ]
    return "\n".join(out) + "\n"


TS = datetime(2025, 1, 2, 3, 4, 5)


def test_parse_real_exposition_per_engine_ignoring_created_samples() -> None:
    text = exposition({"0": (1000.0, 750.0, 250.0, 100.0), "1": (400.0, 100.0, 300.0, 30.0)})
    counters = parse_cache_counters(text)
    assert list(counters) == ["0", "1"]
    assert counters["0"] == CacheCounters("0", 1000.0, 750.0, 250.0, 100.0)
    assert counters["1"] == CacheCounters("1", 400.0, 100.0, 300.0, 30.0)


def test_parse_without_external_metrics_gives_none() -> None:
    counters = parse_cache_counters(exposition({"0": (200.0, 50.0, None, None)}))
    assert counters["0"].ext_queries is None and counters["0"].ext_hits is None
    rates = compute_rates(None, counters["0"])
    assert rates.ext_win is None and rates.ext_total is None
    assert rates.eff_total == pytest.approx(0.25)  # no external cache: effective equals local


def test_parse_sums_model_names_and_labels_engineless_samples_unknown() -> None:
    text = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="a"} 10\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="b"} 5\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="a"} 4\n'
        "vllm:prefix_cache_queries_total 7\n"
    )
    counters = parse_cache_counters(text)
    assert counters["0"].queries == 15 and counters["0"].hits == 4
    assert counters["unknown"] == CacheCounters("unknown", 7.0, 0.0, None, None)


def test_parse_orders_engines_like_sort_v() -> None:
    engines = {e: (1.0, 1.0, None, None) for e in ("10", "2", "0")}
    assert list(parse_cache_counters(exposition(engines))) == ["0", "2", "10"]


def test_parse_text_without_cache_metrics_is_empty() -> None:
    assert parse_cache_counters("") == {}
    assert parse_cache_counters("# HELP up x\n# TYPE up gauge\nup 1\n") == {}


@pytest.mark.parametrize(
    "garbage",
    ["<html><body><h1>404 Not Found</h1></body></html>", '{"detail":"Not Found"}', "Internal Server Error"],
)
def test_parse_garbage_raises_clear_error(garbage: str) -> None:
    with pytest.raises(CacheMetricsError, match="not Prometheus metrics text") as info:
        parse_cache_counters(garbage)
    assert garbage[:20] in str(info.value)


@pytest.mark.parametrize("value", ["NaN", "-5"])
def test_parse_rejects_impossible_counter_values(value: str) -> None:
    with pytest.raises(CacheMetricsError, match="impossible counter value"):
        parse_cache_counters(f'vllm:prefix_cache_hits_total{{engine="0"}} {value}\n')


def test_first_window_is_since_start() -> None:
    rates = compute_rates(None, CacheCounters("0", 1000.0, 750.0, 250.0, 100.0))
    assert rates.local_win == rates.local_total == pytest.approx(0.75)
    assert rates.ext_win == rates.ext_total == pytest.approx(0.4)
    assert rates.eff_total == pytest.approx(0.85)
    assert not rates.reset


def test_window_uses_deltas() -> None:
    prev = CacheCounters("0", 1000.0, 750.0, 250.0, 100.0)
    cur = CacheCounters("0", 1400.0, 850.0, 550.0, 400.0)
    rates = compute_rates(prev, cur)
    assert rates.local_win == pytest.approx(100 / 400)
    assert rates.ext_win == pytest.approx(300 / 300)
    assert rates.local_total == pytest.approx(850 / 1400)
    assert rates.eff_total == pytest.approx(1250 / 1400)


def test_idle_window_is_undefined_not_zero() -> None:
    counters = CacheCounters("0", 1000.0, 750.0, 250.0, 100.0)
    rates = compute_rates(counters, counters)
    assert rates.local_win is None and rates.ext_win is None
    assert rates.local_total == pytest.approx(0.75)
    fresh = compute_rates(None, CacheCounters("0", 0.0, 0.0, 0.0, 0.0))
    assert (fresh.local_total, fresh.ext_total, fresh.eff_total) == (None, None, None)


def test_counter_reset_counts_new_values_since_restart() -> None:
    prev = CacheCounters("0", 1000.0, 750.0, 250.0, 100.0)
    cur = CacheCounters("0", 300.0, 30.0, 270.0, 27.0)
    rates = compute_rates(prev, cur)
    assert rates.reset
    assert rates.local_win == pytest.approx(0.1)
    assert rates.ext_win == pytest.approx(0.1)


def test_reset_seen_on_one_counter_resets_the_whole_engine() -> None:
    # Queries grew past their old value after the restart; only hits show it. Mixing a real delta of
    # queries with restarted hits would be nonsense, so all four restart together.
    prev = CacheCounters("0", 100.0, 90.0)
    cur = CacheCounters("0", 150.0, 15.0)
    rates = compute_rates(prev, cur)
    assert rates.reset and rates.local_win == pytest.approx(0.1)


def test_external_metrics_appearing_count_from_zero() -> None:
    rates = compute_rates(CacheCounters("0", 100.0, 50.0), CacheCounters("0", 200.0, 60.0, 140.0, 70.0))
    assert rates.ext_win == pytest.approx(0.5)


def test_table_sums_engines_and_keeps_total_window_sane_when_one_engine_restarts() -> None:
    prev = {"0": CacheCounters("0", 1000.0, 500.0, 500.0, 100.0), "1": CacheCounters("1", 800.0, 400.0)}
    cur = {"0": CacheCounters("0", 1200.0, 600.0, 600.0, 150.0), "1": CacheCounters("1", 100.0, 90.0)}
    rows = compute_table(prev, cur)
    assert [r.counters.engine for r in rows] == ["0", "1", "all"]
    zero, one, total = rows
    assert zero.local_win == pytest.approx(0.5) and not zero.reset
    assert one.reset and one.local_win == pytest.approx(0.9)
    assert total.counters == CacheCounters("all", 1300.0, 690.0, 600.0, 150.0)
    assert total.reset
    assert total.local_win == pytest.approx((100 + 90) / (200 + 100))
    assert total.ext_win == pytest.approx(50 / 100)
    assert total.eff_total == pytest.approx((690 + 150) / 1300)


def test_table_counts_a_new_engine_whole_and_first_table_is_since_start() -> None:
    first = compute_table(None, {"0": CacheCounters("0", 10.0, 5.0)})
    assert first[-1].local_win == first[-1].local_total == pytest.approx(0.5)
    prev = {"0": CacheCounters("0", 10.0, 5.0)}
    rows = compute_table(prev, {"0": CacheCounters("0", 10.0, 5.0), "1": CacheCounters("1", 30.0, 3.0)})
    assert rows[0].local_win is None
    assert rows[1].local_win == pytest.approx(0.1) and not rows[1].reset
    assert rows[2].local_win == pytest.approx(0.1)


def test_total_keeps_external_none_only_when_no_engine_has_it() -> None:
    assert CacheCounters.total([CacheCounters("0", 1.0, 1.0), CacheCounters("1", 2.0, 1.0)]).ext_hits is None
    mixed = CacheCounters.total([CacheCounters("0", 1.0, 1.0, 4.0, 2.0), CacheCounters("1", 2.0, 1.0)])
    assert mixed == CacheCounters("all", 3.0, 2.0, 4.0, 2.0)


def test_header_matches_script_printf_layout() -> None:
    assert format_header() == (
        "timestamp           engine   local_q    local_h    local_win   local_total "
        "ext_q      ext_h      ext_win     ext_total   eff_total  "
    )


def test_row_matches_script_printf_layout() -> None:
    prev = CacheCounters("0", 600.0, 550.0, 50.0, 20.0)
    rates = compute_rates(prev, CacheCounters("0", 1000.0, 750.0, 250.0, 100.0))
    assert format_row(TS, rates) == (
        "2025-01-02 03:04:05 0        1000       750        50.00%      75.00%      "
        "250        100        40.00%      40.00%      85.00%     "
    )
    idle = compute_rates(CacheCounters("1", 5.0, 1.0), CacheCounters("1", 5.0, 1.0))
    cells = format_row(TS, idle).split()
    assert cells[2:] == ["1", "5", "1", "n/a", "20.00%", "n/a", "n/a", "n/a", "n/a", "20.00%"]


def test_json_has_script_columns_with_nulls_and_integer_counts() -> None:
    rates = compute_rates(CacheCounters("0", 10.0, 5.0), CacheCounters("0", 10.0, 5.0))
    doc = json.loads(json.dumps(rates_to_json(TS.astimezone(), rates)))
    assert doc["engine"] == "0" and doc["local_q"] == 10 and isinstance(doc["local_q"], int)
    assert doc["local_win"] is None and doc["ext_q"] is None and doc["ext_total"] is None
    assert doc["local_total"] == pytest.approx(0.5) and doc["reset"] is False
    assert datetime.fromisoformat(doc["timestamp"]).replace(tzinfo=None) == TS


def test_window_rates_are_all_over_the_window_only() -> None:
    """A benchmark's own requests: eff over the window too (compute_rates' eff_total is since start)."""
    before = {"0": CacheCounters("0", 1000, 900, 100, 100), "1": CacheCounters("1", 10, 0, 10, 0)}
    after = {"0": CacheCounters("0", 1400, 1000, 400, 200), "1": CacheCounters("1", 110, 50, 60, 40),
             "2": CacheCounters("2", 100, 10, None, None)}  # fmt: skip
    rates = window_rates(before, after)
    q, h, eq, eh = 400 + 100 + 100, 100 + 50 + 10, 300 + 50, 100 + 40
    assert (rates.counters.queries, rates.counters.hits, rates.counters.ext_queries, rates.counters.ext_hits) == (
        q, h, eq, eh)  # fmt: skip
    assert rates.local_total == rates.local_win == pytest.approx(h / q)
    assert rates.ext_total == pytest.approx(eh / eq) and rates.eff_total == pytest.approx((h + eh) / q)
    assert not rates.reset


def test_window_rates_after_a_restart_and_without_traffic() -> None:
    restarted = window_rates({"0": CacheCounters("0", 1000, 900)}, {"0": CacheCounters("0", 50, 25)})
    assert restarted.reset and restarted.local_total == 0.5 and restarted.ext_total is None
    idle = window_rates({"0": CacheCounters("0", 10, 5, 5, 1)}, {"0": CacheCounters("0", 10, 5, 5, 1)})
    assert (idle.local_total, idle.ext_total, idle.eff_total) == (None, None, None)

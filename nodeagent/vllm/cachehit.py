"""Prefix-cache hit rates from vLLM's Prometheus counters, as vllm-ascend's watch_cache_hit_rate.sh has them.

Pure functions only, so the arithmetic (resets, empty windows, engine sums) is testable without a server;
``nodeagent.cli.cachewatch`` does the scraping and printing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from nodeagent.core.errors import AgentError
from nodeagent.vllm.promtext import MetricsTextError, samples

LOCAL_QUERIES = "vllm:prefix_cache_queries_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
EXT_QUERIES = "vllm:external_prefix_cache_queries_total"
EXT_HITS = "vllm:external_prefix_cache_hits_total"
_FIELD_BY_SAMPLE = {
    LOCAL_QUERIES: "queries",
    LOCAL_HITS: "hits",
    EXT_QUERIES: "ext_queries",
    EXT_HITS: "ext_hits",
}
ALL_ENGINES = "all"
UNKNOWN_ENGINE = "unknown"  # what the script calls samples without an ``engine`` label
NOT_AVAILABLE = "n/a"  # the script's marker for an undefined rate (no queries)

# The script's printf widths: timestamp engine local_q local_h local_win local_total ext_q ext_h ext_win
# ext_total eff_total, each left-aligned and space-separated (so rows carry trailing blanks, as there).
COLUMNS = (
    ("timestamp", 19), ("engine", 8), ("local_q", 10), ("local_h", 10), ("local_win", 11),
    ("local_total", 11), ("ext_q", 10), ("ext_h", 10), ("ext_win", 11), ("ext_total", 11),
    ("eff_total", 11),
)  # fmt: skip
TIMESTAMP_FORMAT = "%Y-%m-%d %H:%M:%S"


class CacheMetricsError(AgentError, ValueError):
    """The scraped text is not Prometheus exposition text (e.g. an HTML error page from a wrong port)."""


@dataclass(frozen=True, slots=True)
class CacheCounters:
    """Cumulative token counters of one engine; ``None`` external counts mean vLLM exposes no such metric."""

    engine: str
    queries: float = 0.0
    hits: float = 0.0
    ext_queries: float | None = None
    ext_hits: float | None = None

    @staticmethod
    def total(counters: Iterable[CacheCounters], engine: str = ALL_ENGINES) -> CacheCounters:
        """Sum over engines; external counts stay ``None`` only if no engine has them."""
        items = list(counters)
        return CacheCounters(
            engine=engine,
            queries=sum(c.queries for c in items),
            hits=sum(c.hits for c in items),
            ext_queries=_sum_optional(c.ext_queries for c in items),
            ext_hits=_sum_optional(c.ext_hits for c in items),
        )


@dataclass(frozen=True, slots=True)
class CacheRates:
    """Hit rates as fractions in [0, 1]; ``None`` where undefined (no queries in the window, no metric)."""

    counters: CacheCounters  # cumulative values at this scrape (the script's local_q/local_h/ext_q/ext_h)
    local_win: float | None
    local_total: float | None
    ext_win: float | None
    ext_total: float | None
    eff_total: float | None
    reset: bool = False  # a counter went down since the previous scrape: vLLM restarted


def _sum_optional(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _natural_key(engine: str) -> tuple[tuple[int, str], ...]:
    """Order engines as ``sort -V`` does in the script: "2" before "10"."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.findall(r"\d+|\D+", engine))


def parse_cache_counters(text: str) -> dict[str, CacheCounters]:
    """Sum the four prefix-cache counters per ``engine`` label (over ``model_name``s), sorted like the script.

    An empty dict means valid text without prefix-cache metrics; garbage raises :class:`CacheMetricsError`.
    """
    sums: dict[str, dict[str, float]] = {}
    try:
        for sample in samples(text, _FIELD_BY_SAMPLE, strict=True):
            if math.isnan(sample.value) or sample.value < 0:
                raise CacheMetricsError(f"{sample.name} has the impossible counter value {sample.value}")
            engine = sample.labels.get("engine", UNKNOWN_ENGINE)
            per_engine = sums.setdefault(engine, {})
            field = _FIELD_BY_SAMPLE[sample.name]
            per_engine[field] = per_engine.get(field, 0.0) + sample.value
    except MetricsTextError as exc:
        first = next((line for line in text.splitlines() if line.strip()), "")
        raise CacheMetricsError(f"not Prometheus metrics text ({exc}); it starts {first[:80]!r}") from exc
    return {
        engine: CacheCounters(engine=engine, **fields)
        for engine, fields in sorted(sums.items(), key=lambda item: _natural_key(item[0]))
    }


def _window(prev: CacheCounters | None, cur: CacheCounters) -> tuple[CacheCounters, bool]:
    """Counts accrued since ``prev``; ``prev=None`` means since vLLM started (its counters start at 0).

    A counter that went down means vLLM restarted, which zeroes all four together, so the whole new value
    is the window (Prometheus' rate() rule, applied per engine so hits and queries stay consistent).
    """
    if prev is None:
        return cur, False
    pairs = [(prev.queries, cur.queries), (prev.hits, cur.hits),
             (prev.ext_queries, cur.ext_queries), (prev.ext_hits, cur.ext_hits)]  # fmt: skip
    if any(p is not None and c is not None and c < p for p, c in pairs):
        return cur, True

    def delta(p: float | None, c: float | None) -> float | None:
        return None if c is None else c - (p or 0.0)

    return CacheCounters(
        engine=cur.engine,
        queries=cur.queries - prev.queries,
        hits=cur.hits - prev.hits,
        ext_queries=delta(prev.ext_queries, cur.ext_queries),
        ext_hits=delta(prev.ext_hits, cur.ext_hits),
    ), False


def _rates(cur: CacheCounters, window: CacheCounters, reset: bool) -> CacheRates:
    # External lookups only see tokens the local cache missed, so both kinds of hits are over local queries.
    return CacheRates(
        counters=cur,
        local_win=_ratio(window.hits, window.queries),
        local_total=_ratio(cur.hits, cur.queries),
        ext_win=_ratio(window.ext_hits, window.ext_queries),
        ext_total=_ratio(cur.ext_hits, cur.ext_queries),
        eff_total=_ratio(cur.hits + (cur.ext_hits or 0.0), cur.queries),
        reset=reset,
    )


def compute_rates(prev: CacheCounters | None, cur: CacheCounters) -> CacheRates:
    """Rates of one engine for the window ``prev`` → ``cur`` (since vLLM started when ``prev`` is None)."""
    window, reset = _window(prev, cur)
    return _rates(cur, window, reset)


def window_rates(prev: Mapping[str, CacheCounters], cur: Mapping[str, CacheCounters]) -> CacheRates:
    """Every rate over the window ``prev`` → ``cur`` only, summed over engines (keys), ``eff_total`` included:
    the hit rates of one benchmark's own requests. ``counters`` holds the window's counts; an engine absent
    from ``prev`` started since, so its whole count is new, as in :func:`compute_table`."""
    windows: list[CacheCounters] = []
    any_reset = False
    for key, counters in cur.items():
        window, reset = _window(prev.get(key), counters)
        windows.append(window)
        any_reset = any_reset or reset
    total = CacheCounters.total(windows)
    return _rates(total, total, any_reset)


def compute_table(prev: dict[str, CacheCounters] | None, cur: dict[str, CacheCounters]) -> list[CacheRates]:
    """One row per engine plus the ``all`` row, as the script prints them.

    The ``all`` window sums the per-engine windows, so a restart of one engine does not distort the total;
    an engine absent from ``prev`` has started since, so its whole count is new.
    """
    rows: list[CacheRates] = []
    windows: list[CacheCounters] = []
    any_reset = False
    for engine, counters in cur.items():
        window, reset = _window(None if prev is None else prev.get(engine), counters)
        rows.append(_rates(counters, window, reset))
        windows.append(window)
        any_reset = any_reset or reset
    total = CacheCounters.total(cur.values())
    rows.append(_rates(total, CacheCounters.total(windows), any_reset))
    return rows


def _pct(rate: float | None) -> str:
    return NOT_AVAILABLE if rate is None else f"{rate * 100:.2f}%"


def _number(value: float | None) -> float | int | None:
    """Counters are floats in the exposition but count tokens: keep JSON free of ``.0``."""
    return int(value) if value is not None and value.is_integer() else value


def _count(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:.0f}"


def _line(cells: Iterable[str]) -> str:
    return " ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, COLUMNS, strict=True))


def format_header() -> str:
    """The script's header line."""
    return _line(name for name, _ in COLUMNS)


def format_row(ts: datetime, rates: CacheRates) -> str:
    """One row in the script's layout: counts as integers, rates as ``87.50%``, ``n/a`` when undefined."""
    c = rates.counters
    return _line((
        ts.strftime(TIMESTAMP_FORMAT), c.engine, _count(c.queries), _count(c.hits),
        _pct(rates.local_win), _pct(rates.local_total), _count(c.ext_queries), _count(c.ext_hits),
        _pct(rates.ext_win), _pct(rates.ext_total), _pct(rates.eff_total),
    ))  # fmt: skip


def rates_to_json(ts: datetime, rates: CacheRates) -> dict[str, Any]:
    """A JSON-ready dict with the script's column names; rates are fractions, ``None`` (null) if undefined."""
    c = rates.counters
    return {
        "timestamp": ts.isoformat(timespec="seconds"),
        "engine": c.engine,
        "local_q": _number(c.queries),
        "local_h": _number(c.hits),
        "local_win": rates.local_win,
        "local_total": rates.local_total,
        "ext_q": _number(c.ext_queries),
        "ext_h": _number(c.ext_hits),
        "ext_win": rates.ext_win,
        "ext_total": rates.ext_total,
        "eff_total": rates.eff_total,
        "reset": rates.reset,
    }

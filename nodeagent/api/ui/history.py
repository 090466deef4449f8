"""The vLLM prefix-cache hit-rate history behind the status page's plot: one sample per scrape period, kept in
memory for `agent.ui.cache_history_s`.

`CacheHistory` is pure (samples in, JSON out); `CacheSampler` is its shell: its own `CacheWindow` on the agent's
one `VllmSampler`, so its `_win` windows are one period long whatever Prometheus or MQTT read.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.api.metrics import RATIO_KINDS
from nodeagent.api.vllm_sampler import CacheWindow, VllmSampler
from nodeagent.vllm.cachehit import ALL_ENGINES, CacheRates, rates_to_json

if TYPE_CHECKING:
    from nodeagent.config.model import UiConfig


@dataclass(frozen=True, slots=True)
class CacheSample:
    ts: float
    components: dict[str, dict[str, Any]]
    """Component → its `all` row: the five ratios (None = undefined), local queries, and whether vLLM reset."""

    def to_dict(self) -> dict[str, Any]:
        return {"ts": self.ts, "components": self.components}


def summarize(rows: Iterable[CacheRates]) -> dict[str, Any] | None:
    """The `all` row of one component's table, in the plot's terms."""
    for rates in rows:
        if rates.counters.engine == ALL_ENGINES:
            out: dict[str, Any] = {kind: getattr(rates, kind) for kind in RATIO_KINDS}
            out["queries"] = rates.counters.queries
            out["reset"] = rates.reset
            return out
    return None


class CacheHistory:
    """Samples of the last `history_s` seconds, oldest first; never more than history_s / period_s (+1)."""

    def __init__(self, history_s: float, period_s: float) -> None:
        self.history_s = history_s
        self.period_s = period_s
        self.samples: deque[CacheSample] = deque(maxlen=math.ceil(history_s / period_s) + 1)

    def add(self, ts: float, tables: Mapping[str, Iterable[CacheRates]]) -> CacheSample:
        """One scrape's result; a component without rows (down, loading, scrape failed) is absent: a gap."""
        components = {name: row for name, rows in tables.items() if (row := summarize(rows)) is not None}
        sample = CacheSample(round(ts, 3), components)  # as served: `since` compares with what clients saw
        self.samples.append(sample)
        self.prune(ts)
        return sample

    def prune(self, now: float) -> None:
        while self.samples and self.samples[0].ts < now - self.history_s:
            self.samples.popleft()

    def since(self, ts: float | None) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.samples if ts is None or s.ts > ts]


class CacheSampler:
    """Scrapes every up vLLM once per `cache_period_s` into a `CacheHistory` while the API runs."""

    def __init__(self, sampler: VllmSampler, cfg: UiConfig) -> None:
        self.cfg = cfg
        self.scraper = CacheWindow(sampler, max_age_s=cfg.cache_period_s / 2)
        self.history = CacheHistory(cfg.cache_history_s, cfg.cache_period_s)
        self.last_scrape_at: float | None = None
        self.started_at = time.time()
        """Names this history: a client holding samples of another (an agent restarted) starts afresh."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="ui:cache-history")

    async def sample(self) -> None:
        """One scrape → one sample; nothing at all while no vLLM is configured."""
        if not self.scraper.vllm_urls:
            return
        try:
            await self.scraper.refresh()
        except Exception as exc:  # a scrape must never end the loop
            logger.warning(f"status page: vLLM metrics scrape failed: {exc}")
        self.last_scrape_at = time.time()
        self.history.add(self.last_scrape_at, self.scraper.rows)

    async def _loop(self) -> None:
        """On a fixed grid: a slow scrape skips the slots it overran, never two samples in one period."""
        period = self.cfg.cache_period_s
        next_at = time.monotonic()
        while True:
            await self.sample()
            now = time.monotonic()
            next_at += period * max(1, math.ceil((now - next_at) / period))
            await asyncio.sleep(next_at - now)

    def view(self, since: float | None = None) -> dict[str, Any]:
        """GET /cache: the samples (after `since`), the latest per-engine tables, each component's scrape state."""
        now = time.time()
        self.history.prune(now)
        stamp = datetime.fromtimestamp(self.last_scrape_at or now).astimezone()
        return {
            "now": now, "started_at": self.started_at, "period_s": self.cfg.cache_period_s,
            "history_s": self.cfg.cache_history_s,
            "components": sorted(self.scraper.vllm_urls), "last_scrape_at": self.last_scrape_at,
            "scrape_ok": dict(self.scraper.scrape_ok),
            "latest": {name: [rates_to_json(stamp, r) for r in rows] for name, rows in self.scraper.rows.items()},
            "samples": self.history.since(since),
        }  # fmt: skip

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

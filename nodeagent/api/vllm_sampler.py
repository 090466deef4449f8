"""The one sampler of the node's vLLM `/metrics`, read by `/metrics`, MQTT's `cache` topic and the status page.

`VllmSampler` (one per agent, made at the composition root) scrapes each up vLLM and keeps its latest prefix-cache
counters; a reader that asks within `max_age_s` of the last scrape gets that sample, and readers asking together
share one scrape, so three consumers cost one request per rank and period instead of three. Each reader keeps its
own window (`CacheWindow`: its hit rates since *its* previous reading), so Prometheus' scrapes never shorten the
status page's windows or MQTT's. The rollout's bake reads ranks of other nodes too and stays with its own reading
(`cluster/rollout/http.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from loguru import logger

from nodeagent.core.http import fetch, new_session
from nodeagent.vllm.cachehit import CacheCounters, CacheMetricsError, CacheRates, compute_table, parse_cache_counters
from nodeagent.vllm.endpoints import vllm_metrics_urls

if TYPE_CHECKING:
    import aiohttp

VLLM_SCRAPE_TIMEOUT_S = 2.0

Fetch = Callable[[str], Awaitable[str]]
"""URL → its /metrics text; raises when it cannot (the process-less tests give a fake)."""


class Components(Protocol):
    """What the sampler reads of the supervisor: which vLLMs there are, and which are up."""

    @property
    def components(self) -> Mapping[str, Any]: ...


class VllmSampler:
    """The latest sample of each up vLLM's cache counters; `refresh(max_age_s)` scrapes only when it is older."""

    def __init__(self, supervisor: Components, vllm_urls: dict[str, str] | None = None,
                 fetch: Fetch | None = None, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.supervisor = supervisor
        self._fixed_urls = vllm_urls
        self._fetch = fetch or self._http_get
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._inflight: asyncio.Task[None] | None = None
        self.sampled_at: float | None = None
        self.counters: dict[str, dict[str, CacheCounters]] = {}
        """Component → engine → counters, from its latest successful, non-empty scrape."""
        self.sample_no: dict[str, int] = {}
        """Component → which scrape its counters come from (a reader computes a window once per sample)."""
        self.scrape_ok: dict[str, bool] = {}
        self.scrape_s: dict[str, float] = {}
        """URL → how long its latest scrape took."""
        self.scrapes = 0

    @property
    def vllm_urls(self) -> dict[str, str]:
        """From the live config each time, so a reload that moves vLLM's port is followed."""
        if self._fixed_urls is not None:
            return self._fixed_urls
        return vllm_metrics_urls({name: comp.cfg for name, comp in self.supervisor.components.items()})

    async def refresh(self, max_age_s: float = 0.0) -> None:
        """A sample at most `max_age_s` old; a refresh already under way is joined, not repeated."""
        if self._inflight is not None and self._inflight.done():  # its every reader was cancelled
            self._inflight = None
        if self._inflight is None and self.sampled_at is not None and self._clock() - self.sampled_at <= max_age_s:
            return
        if self._inflight is None:
            self._inflight = asyncio.get_running_loop().create_task(self._scrape_all(), name="vllm-sampler")
        task = self._inflight
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and self._inflight is task:
                self._inflight = None

    async def _scrape_all(self) -> None:
        """Each up vLLM, concurrently (short timeout). One that is not up yet (loading for half an hour) is not
        asked; its sample disappears."""
        self.scrapes += 1
        jobs, urls = {}, self.vllm_urls
        for name, url in urls.items():
            comp = self.supervisor.components.get(name)
            if comp is not None and comp.up.is_set():
                jobs[name] = self._scrape(url)
            else:
                self.counters.pop(name, None)
                self.scrape_ok.pop(name, None)
        for name in set(self.counters) - set(urls):
            self.counters.pop(name, None)
            self.scrape_ok.pop(name, None)
        results = await asyncio.gather(*jobs.values(), return_exceptions=True)
        for name, result in zip(jobs, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                self.scrape_ok[name] = False
                self.counters.pop(name, None)
                logger.debug(f"[{name}] metrics scrape failed: {result}")
                continue
            self.scrape_ok[name] = True
            if result:
                self.counters[name] = result
                self.sample_no[name] = self.scrapes
            else:
                self.counters.pop(name, None)
        self.sampled_at = self._clock()

    async def _scrape(self, url: str) -> dict[str, CacheCounters]:
        began = time.monotonic()
        try:
            text = await self._fetch(url)
        finally:
            self.scrape_s[url] = time.monotonic() - began
        return parse_cache_counters(text)

    async def _http_get(self, url: str) -> str:
        if self._session is None or self._session.closed:
            self._session = new_session()
        answer = await fetch("GET", url, VLLM_SCRAPE_TIMEOUT_S, session=self._session)
        if answer.status != 200:
            raise CacheMetricsError(f"{url}: HTTP {answer.status}")
        return answer.text

    async def close(self) -> None:
        if self._inflight is not None:
            self._inflight.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._inflight
            self._inflight = None
        if self._session is not None:
            await self._session.close()
            self._session = None


class CacheWindow:
    """One reader's hit rates over the window since its own previous reading of the shared sampler."""

    def __init__(self, sampler: VllmSampler, max_age_s: float = 0.0) -> None:
        self.sampler = sampler
        self.max_age_s = max_age_s
        self._prev: dict[str, dict[str, CacheCounters]] = {}
        self._seen: dict[str, int] = {}
        self.rows: dict[str, list[CacheRates]] = {}
        """Component → one row per engine plus the `all` row, from the latest sample."""

    @property
    def vllm_urls(self) -> dict[str, str]:
        return self.sampler.vllm_urls

    @property
    def scrape_ok(self) -> dict[str, bool]:
        return self.sampler.scrape_ok

    @property
    def scrape_s(self) -> dict[str, float]:
        return self.sampler.scrape_s

    async def refresh(self) -> None:
        """Rates since this reader's previous sample; a sample it already read leaves its rows as they were."""
        await self.sampler.refresh(self.max_age_s)
        for name in set(self.rows) - set(self.sampler.counters):
            self.rows.pop(name)
        for name, counters in self.sampler.counters.items():
            number = self.sampler.sample_no[name]
            if self._seen.get(name) != number:
                self.rows[name] = compute_table(self._prev.get(name), counters)
                self._prev[name], self._seen[name] = counters, number

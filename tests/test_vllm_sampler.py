"""The one sampler of the node's vLLM /metrics (`api.vllm_sampler`): readers asking within their max age share
one scrape, readers asking together share one request, and each reader's hit rates cover its own window. No
process, no HTTP: the fetch is a fake, the clock a variable."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from nodeagent.api.vllm_sampler import CacheWindow, VllmSampler
from nodeagent.vllm.cachehit import LOCAL_HITS, LOCAL_QUERIES


class FakeVllm:
    """Its /metrics text from two counters; counts the requests; `gate` holds them to overlap two readers."""

    def __init__(self) -> None:
        self.queries, self.hits, self.requests = 0, 0, 0
        self.gate: asyncio.Event | None = None

    def set(self, queries: int, hits: int) -> None:
        self.queries, self.hits = queries, hits

    async def fetch(self, url: str) -> str:
        self.requests += 1
        if self.gate is not None:
            await self.gate.wait()
        return (f'{LOCAL_QUERIES}{{engine="0"}} {self.queries}\n'
                f'{LOCAL_HITS}{{engine="0"}} {self.hits}\n')  # fmt: skip


def components(up: bool = True) -> Any:
    event = asyncio.Event()
    if up:
        event.set()
    return SimpleNamespace(components={"v": SimpleNamespace(up=event)})


def local_win(window: CacheWindow) -> float | None:
    (row,) = [r for r in window.rows["v"] if r.counters.engine == "0"]
    return row.local_win


async def test_readers_within_their_max_age_share_one_scrape_and_keep_their_own_windows() -> None:
    fake, now = FakeVllm(), [100.0]
    sampler = VllmSampler(components(), {"v": "http://v/metrics"}, fetch=fake.fetch, clock=lambda: now[0])
    prometheus, page, mqtt = CacheWindow(sampler), CacheWindow(sampler, 5.0), CacheWindow(sampler, 5.0)

    fake.set(100, 50)
    await prometheus.refresh()
    now[0] += 2.0
    await page.refresh()
    await mqtt.refresh()
    assert fake.requests == 1, "the page and MQTT scraped again instead of reading the sample"
    assert local_win(prometheus) == local_win(page) == local_win(mqtt) == pytest.approx(0.5)

    fake.set(200, 150)  # 100 queries, 100 hits since
    now[0] += 1.0
    await prometheus.refresh()  # max age 0: a new sample, Prometheus' window is that one
    assert fake.requests == 2 and local_win(prometheus) == pytest.approx(1.0)
    fake.set(300, 150)  # 100 queries, 0 hits since
    now[0] += 10.0
    await page.refresh()  # the sample is 10 s old: a new one; the page's window spans both steps
    assert fake.requests == 3 and local_win(page) == pytest.approx(0.5)
    await prometheus.refresh()
    assert local_win(prometheus) == pytest.approx(0.0)
    assert local_win(mqtt) == pytest.approx(0.5), "a reader that did not refresh keeps its rows"


async def test_readers_asking_together_share_one_request() -> None:
    fake = FakeVllm()
    fake.gate = asyncio.Event()
    sampler = VllmSampler(components(), {"v": "http://v/metrics"}, fetch=fake.fetch)
    fake.set(10, 5)
    readers = [CacheWindow(sampler) for _ in range(3)]
    tasks = [asyncio.create_task(r.refresh()) for r in readers]
    await asyncio.sleep(0)
    fake.gate.set()
    await asyncio.gather(*tasks)
    assert fake.requests == 1
    assert all(local_win(r) == pytest.approx(0.5) for r in readers)


async def test_a_reader_cancelled_mid_scrape_does_not_cancel_the_others() -> None:
    fake = FakeVllm()
    fake.gate = asyncio.Event()
    sampler = VllmSampler(components(), {"v": "http://v/metrics"}, fetch=fake.fetch)
    fake.set(10, 5)
    first, second = CacheWindow(sampler), CacheWindow(sampler)
    cancelled, kept = asyncio.create_task(first.refresh()), asyncio.create_task(second.refresh())
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0)
    fake.gate.set()
    await kept
    assert fake.requests == 1 and local_win(second) == pytest.approx(0.5)
    await sampler.close()


async def test_a_vllm_not_up_or_failing_has_no_rows() -> None:
    fake = FakeVllm()
    stack = components(up=False)
    sampler = VllmSampler(stack, {"v": "http://v/metrics"}, fetch=fake.fetch)
    window = CacheWindow(sampler)
    await window.refresh()
    assert fake.requests == 0 and window.rows == {} and window.scrape_ok == {}
    stack.components["v"].up.set()
    fake.set(4, 1)
    await window.refresh()
    assert local_win(window) == pytest.approx(0.25) and window.scrape_ok == {"v": True}

    async def broken(url: str) -> str:
        raise OSError("refused")

    sampler._fetch = broken
    await window.refresh()
    assert window.rows == {} and window.scrape_ok == {"v": False}

"""GET /metrics: component series read from a real Supervisor, probe histograms, process-tree usage, the vLLM
prefix-cache ratios over a served vLLM exposition (the stand-in's own metric classes), and promtool.

promtool: the Debian package `prometheus` ships it; only that binary is needed (`apt-get download prometheus &&
dpkg-deb -x prometheus_*.deb x && install x/usr/bin/promtool /usr/local/bin/`). Without it the promtool check
alone is skipped, saying so.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from apihelpers import InProcess, start_in_process, tiny_config
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm_standin.vllm import Metrics as VllmMetrics

from nodeagent.api.metrics import AgentMetrics, tree_usage
from nodeagent.api.vllm_sampler import VllmSampler
from nodeagent.core.process import tree_of
from nodeagent.core.states import RESTART_CAUSES, State

BURN = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
        "print('burnt', flush=True)\ntime.sleep(3600)")  # fmt: skip


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[InProcess]:
    data = tiny_config(tmp_path / "home")
    comps = data["components"]
    comps["tree"] = {"kind": "process", "command": ["sh", "-c", "sleep 3600 & sleep 3600 & wait"], "stop_grace_s": 3}
    comps["burn"] = {"kind": "process", "command": ["python3", "-c", BURN], "stop_grace_s": 3}
    comps["a"]["probes"] = {
        "liveness": {"kind": "exec", "command": ["true"], "period_s": 0.2},
        "readiness": {"kind": "exec", "command": ["false"], "period_s": 0.2, "failure_threshold": 1},
    }
    s = await start_in_process(tmp_path / "home", data)
    try:
        yield s
    finally:
        await s.close()


async def scrape(stack: InProcess) -> str:
    async with stack.session.get(stack.url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return await r.text()


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (see this module's docstring for the one-binary install)")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


async def test_component_series(stack: InProcess) -> None:
    sup = stack.agent.supervisor
    await stack.wait("probe results", lambda: sup.components["a"].prober.trackers["liveness"][0].runs >= 2
                     and sup.components["a"].prober.trackers["readiness"][0].failures_total >= 2)  # fmt: skip
    await stack.wait("burn done", lambda: (stack.agent.config.agent.log_dir / "burn.log").exists()
                     and "burnt" in (stack.agent.config.agent.log_dir / "burn.log").read_text())  # fmt: skip
    text = await scrape(stack)
    for name, comp in sup.components.items():
        lv = {"component": name, "kind": "process"}
        assert value(text, "dsv4_component_up", **lv) == 1.0
        assert value(text, "dsv4_component_ready", **lv) == float(comp.ready)
        assert value(text, "dsv4_component_restarts_total", **lv) == 0.0
        states = {st: value(text, "dsv4_component_state", **lv, state=str(st)) for st in State}
        assert states[comp.state] == 1.0 and sum(states.values()) == 1.0, states
        assert value(text, "dsv4_component_memory_rss_bytes", **lv) > 1e6
    assert value(text, "dsv4_component_ready", component="a", kind="process") == 0.0, "readiness exec false"
    assert value(text, "dsv4_component_processes", component="tree", kind="process") == 3.0
    assert value(text, "dsv4_component_cpu_seconds_total", component="burn", kind="process") >= 0.3
    assert value(text, "dsv4_agent_info", version="0.1.0", node="tiny", role="master",
                 cluster=stack.agent.config.cluster.name) == 1.0  # fmt: skip
    live = {"component": "a", "role": "liveness", "kind": "exec"}
    ready = {"component": "a", "role": "readiness", "kind": "exec"}
    assert value(text, "dsv4_probe_duration_seconds_count", **live) >= 2
    assert value(text, "dsv4_probe_duration_seconds_bucket", **live, le="+Inf") >= 2
    assert value(text, "dsv4_probe_failures_total", **ready) >= 2
    assert value(text, "dsv4_probe_failures_total", **live) is None, "a passing probe has no failures"
    assert "dsv4_vllm_cache_hit_ratio" not in text, "no vLLM here"

    # A restart shows up in restarts_total and moves the start time.
    started = value(text, "dsv4_component_start_time_seconds", component="b", kind="process")
    status, _ = await stack.post("/components/b/restart")
    assert status == 202
    await stack.wait("b restarted", lambda: sup.components["b"].restarts == 1 and sup.components["b"].up.is_set())
    text = await scrape(stack)
    assert value(text, "dsv4_component_restarts_total", component="b", kind="process") == 1.0
    assert value(text, "dsv4_component_start_time_seconds", component="b", kind="process") > started
    promtool_check(text)

    # issue 17: one counter that means one thing: a crash and the operator's restart, each under its cause
    os.kill(sup.components["b"].record.pid, signal.SIGKILL)
    await stack.wait("b back after its crash", lambda: sup.components["b"].restarts == 2
                     and sup.components["b"].up.is_set())  # fmt: skip
    text = await scrape(stack)
    causes = {cause: value(text, "dsv4_component_restarts_by_cause_total", component="b", kind="process", cause=cause)
              for cause in RESTART_CAUSES}  # fmt: skip
    assert causes == {cause: float(cause in ("crash", "operator")) for cause in RESTART_CAUSES}, causes
    assert sum(causes.values()) == value(text, "dsv4_component_restarts_total", component="b", kind="process")
    assert value(text, "dsv4_component_restarts_by_cause_total", component="a", kind="process", cause="crash") == 0

    status, _ = await stack.post("/components/tree/stop")
    await stack.wait_states({"tree": {"stopped"}})
    text = await scrape(stack)
    assert value(text, "dsv4_component_state", component="tree", kind="process", state="stopped") == 1.0
    assert value(text, "dsv4_component_up", component="tree", kind="process") == 0.0
    assert value(text, "dsv4_component_desired_running", component="tree", kind="process") == 0.0
    assert value(text, "dsv4_component_processes", component="tree", kind="process") is None


async def test_tree_usage_counts_the_same_processes_as_tree_of(stack: InProcess) -> None:
    records = {n: c.record for n, c in stack.agent.supervisor.components.items() if c.record is not None}
    usage = tree_usage(records)
    for name, record in records.items():
        assert usage[name][2] == len(tree_of(record)), name


class FakeVllm:
    """Serves /metrics from the stand-in's vLLM metric classes; `registry` can be swapped (a vLLM restart)."""

    def __init__(self) -> None:
        self.metrics = VllmMetrics("dsv4")
        self.delay = 0.0
        self.status = 200

    def set(self, queries: int, hits: int, ext_queries: int = 0, ext_hits: int = 0) -> None:
        m = self.metrics
        for counter, target in ((m.prefix_queries, queries), (m.prefix_hits, hits),
                                (m.external_queries, ext_queries), (m.external_hits, ext_hits)):  # fmt: skip
            counter.inc(target - counter._value.get())

    async def handle(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.delay)
        return web.Response(body=generate_latest(self.metrics.registry), status=self.status,
                            headers={"Content-Type": "text/plain; version=0.0.4"})  # fmt: skip


@pytest.fixture
async def fake_vllm() -> AsyncIterator[tuple[FakeVllm, str]]:
    fake = FakeVllm()
    app = web.Application()
    app.router.add_get("/metrics", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield fake, f"http://127.0.0.1:{port}/metrics"
    finally:
        await runner.cleanup()


def ratios(m: AgentMetrics, component: str = "a") -> dict[tuple[str, str], float]:
    text = m.generate().decode()
    return {(labels["engine"], labels["kind"]): v for (name, lv), v in samples(text).items()
            if name == "dsv4_vllm_cache_hit_ratio" and (labels := dict(lv))["component"] == component}  # fmt: skip


async def test_vllm_cache_ratios_windows_and_resets(stack: InProcess, fake_vllm: tuple[FakeVllm, str]) -> None:
    fake, url = fake_vllm
    sampler = VllmSampler(stack.agent.supervisor, {"a": url})
    m = AgentMetrics(stack.agent.supervisor, sampler)
    try:
        fake.set(100, 40, ext_queries=60, ext_hits=30)
        await m.refresh_vllm()
        r = ratios(m)
        assert r[("0", "local_total")] == pytest.approx(0.4) and r[("0", "local_win")] == pytest.approx(0.4)
        assert r[("0", "ext_total")] == pytest.approx(0.5) and r[("0", "eff_total")] == pytest.approx(0.7)
        assert {k: v for (e, k), v in r.items() if e == "all"} == {k: v for (e, k), v in r.items() if e == "0"}

        fake.set(200, 140, ext_queries=100, ext_hits=30)  # window: 100 queries, 100 hits; 40 ext, 0 hits
        await m.refresh_vllm()
        r = ratios(m)
        assert r[("0", "local_win")] == pytest.approx(1.0) and r[("0", "local_total")] == pytest.approx(0.7)
        assert r[("0", "ext_win")] == pytest.approx(0.0) and r[("0", "ext_total")] == pytest.approx(0.3)

        await m.refresh_vllm()  # nothing new: the window ratios are undefined, so absent; totals stay
        r = ratios(m)
        assert ("0", "local_win") not in r and r[("0", "local_total")] == pytest.approx(0.7)

        fake.metrics = VllmMetrics("dsv4")  # vLLM restarted: counters from zero
        fake.set(10, 5)
        await m.refresh_vllm()
        r = ratios(m)
        assert r[("0", "local_win")] == pytest.approx(0.5) and r[("0", "local_total")] == pytest.approx(0.5)
        promtool_check(m.generate().decode())

        # Down or hung: flagged, ratios dropped, the scrape bounded by its timeout.
        fake.delay = 3.0
        began = time.monotonic()
        await m.refresh_vllm()
        assert time.monotonic() - began < 4.0
        text = m.generate().decode()
        assert value(text, "dsv4_vllm_metrics_scrape_ok", component="a") == 0.0 and not ratios(m)
        fake.delay, fake.status = 0.0, 500
        await m.refresh_vllm()
        assert value(m.generate().decode(), "dsv4_vllm_metrics_scrape_ok", component="a") == 0.0

        # A vLLM that is not up (loading) is not asked at all.
        fake.status = 200
        await stack.post("/components/a/stop")
        await stack.wait_states({"a": {"stopped"}})
        await m.refresh_vllm()
        text = m.generate().decode()
        assert value(text, "dsv4_vllm_metrics_scrape_ok", component="a") is None and not ratios(m)
    finally:
        await sampler.close()


async def test_own_registries_never_the_global_one(stack: InProcess) -> None:
    sup, sampler = stack.agent.supervisor, stack.agent.vllm_sampler
    first = AgentMetrics(sup, sampler)
    second = AgentMetrics(sup, sampler)  # would raise "Duplicated timeseries" on a shared registry
    assert first.registry is not second.registry is not REGISTRY
    assert not any(name.startswith("dsv4_") for name in REGISTRY._names_to_collectors)
    assert b"dsv4_component_up" in first.generate()


def test_metrics_scrape_is_cheap(tmp_path: Path) -> None:
    """The per-scrape work (supervisor read, one pass over /proc) on this machine's process table."""

    async def run() -> list[float]:
        s = await start_in_process(tmp_path / "home")
        try:
            m = s.server.api.agent_metrics  # type: ignore[union-attr]
            times = []
            for _ in range(10):
                began = time.perf_counter()
                m.generate()
                times.append(time.perf_counter() - began)
            return times
        finally:
            await s.close()

    times: list[Any] = sorted(asyncio.run(run()))
    assert times[len(times) // 2] < 0.25, times

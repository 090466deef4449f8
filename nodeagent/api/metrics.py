"""Prometheus metrics of the agent, its components and vLLM's prefix-cache hit rates.

Own CollectorRegistry (never the global one), so a second agent in one process (tests) cannot collide.
Component state and process usage are read at scrape time by a custom collector — no bookkeeping on the
supervisor's hot path; probe latency and failures are pushed by `Supervisor.on_probe_result`. The vLLM hit
rates are computed like vllm-ascend's watch_cache_hit_rate.sh (`nodeagent.vllm.cachehit`) over the window since the
previous scrape of this agent's /metrics, from the agent's one `VllmSampler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from nodeagent import __version__
from nodeagent.api.vllm_sampler import CacheWindow, VllmSampler
from nodeagent.core.loadtime import LOAD_BUCKETS
from nodeagent.core.proctable import CREATE_TIME_SLACK_S, TABLES, ProcessTable, scan
from nodeagent.core.states import RESTART_CAUSES, State
from nodeagent.vllm.start_phases import PHASE_BUCKETS

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.core.process import ProcessRecord
    from nodeagent.npu.monitor import NpuMonitor


class Stack(Protocol):
    """What the metrics read of the supervisor (`Supervisor` is it): a Protocol, so metrics import no supervisor."""

    config: Config
    on_probe_result: list[Any]
    on_load: list[Any]

    @property
    def components(self) -> Mapping[str, Any]: ...

    @property
    def redeploys(self) -> Any: ...

    @property
    def paused(self) -> bool: ...

    def desired(self, name: str) -> str: ...

    def snapshot(self) -> Any: ...

    @property
    def caches(self) -> Any: ...


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The classic text format: what every Prometheus (and promtool) reads."""
PROBE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATIO_KINDS = ("local_total", "local_win", "ext_total", "ext_win", "eff_total")


def tree_usage(records: dict[str, ProcessRecord], table: ProcessTable | None = None,
               ) -> dict[str, tuple[float, int, int]]:  # fmt: skip
    """(CPU seconds, RSS bytes, process count) of each record's whole tree (`ProcessTable.tree`, the membership
    of `process.tree_of`), from `table` or a pass over /proc now: blocking, `AgentMetrics.refresh` runs it in a
    thread. CPU includes reaped children (children_user/system), so a short-lived helper's time is not lost; RSS is
    a plain sum (shared pages count once per process).
    """
    if not records:
        return {}
    table = table if table is not None else scan()
    out = {}
    for name, rec in records.items():
        cpu, rss, count = 0.0, 0, 0
        for pid in table.tree(rec):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                with proc.oneshot():
                    if abs(proc.create_time() - table.procs[pid].create_time) > CREATE_TIME_SLACK_S:
                        continue  # the PID was reused since the table was taken
                    times = proc.cpu_times()
                    cpu += times.user + times.system + times.children_user + times.children_system
                    rss += proc.memory_info().rss
                    count += 1
        out[name] = (cpu, rss, count)
    return out


class _StackCollector:
    """Reads the supervisor at scrape time: component state, restarts, process usage, agent info."""

    def __init__(self, owner: AgentMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        sup = self.owner.supervisor
        node = sup.config.node
        info = InfoMetricFamily("dsv4_agent", "The agent's version and where it runs.")
        info.add_metric([], {"version": __version__, "node": node.name, "role": node.role,
                             "cluster": sup.config.cluster.name})  # fmt: skip
        yield info
        yield GaugeMetricFamily("dsv4_agent_start_time_seconds", "When the agent started (Unix time).",
                                value=self.owner.started_at)  # fmt: skip
        yield GaugeMetricFamily("dsv4_agent_paused", "1 while the maintenance pause holds automatic actions.",
                                value=float(sup.paused))  # fmt: skip
        yield GaugeMetricFamily("dsv4_node_failed", "1 while the node is in the failed state (alert).",
                                value=float(sup.redeploys.failed))  # fmt: skip
        ladder = sup.snapshot().recovery or {}
        yield GaugeMetricFamily("dsv4_node_isolated", "1 while the node is isolated: chip resets did not help or an "
                                "NPU must be separated; until nodeagentctl uncordon (alert).",
                                value=float(ladder.get("state") == "isolated"))  # fmt: skip
        yield GaugeMetricFamily("dsv4_node_chip_reset_running", "1 while a chip reset of the node runs.",
                                value=float(ladder.get("state") == "resetting"))  # fmt: skip
        yield CounterMetricFamily("dsv4_node_redeploys", "Node redeploys (the guide's full stop-clean-start).",
                                  value=sup.redeploys.redeploys_total)  # fmt: skip

        labels = ["component", "kind"]
        up = GaugeMetricFamily("dsv4_component_up", "1 when the process is up (startup probes passed).", labels=labels)
        ready = GaugeMetricFamily("dsv4_component_ready", "1 when its readiness probes pass.", labels=labels)
        desired = GaugeMetricFamily("dsv4_component_desired_running", "1 when the operator wants it running.",
                                    labels=labels)  # fmt: skip
        state = GaugeMetricFamily("dsv4_component_state", "1 for the component's current state, 0 for the others.",
                                  labels=[*labels, "state"])  # fmt: skip
        restarts = CounterMetricFamily("dsv4_component_restarts",
                                       "Restarts of the component, kept across agent restarts and upgrades.",
                                       labels=labels)  # fmt: skip
        by_cause = CounterMetricFamily("dsv4_component_restarts_by_cause",
                                       "Restarts by cause (crash, probe, launch, gang, operator, reload, dependency, "
                                       "redeploy); they add up to dsv4_component_restarts_total.",
                                       labels=[*labels, "cause"])  # fmt: skip
        started = GaugeMetricFamily("dsv4_component_start_time_seconds",
                                    "When the current process started (Unix time).", labels=labels)  # fmt: skip
        cpu = CounterMetricFamily("dsv4_component_cpu_seconds",
                                  "User+system CPU of the component's process tree (live and reaped).", labels=labels)
        rss = GaugeMetricFamily("dsv4_component_memory_rss_bytes",
                                "Resident memory summed over the component's process tree.", labels=labels)
        procs = GaugeMetricFamily("dsv4_component_processes", "Processes in the component's tree.", labels=labels)
        records = {}
        for name, comp in sup.components.items():
            lv = [name, comp.kind]
            up.add_metric(lv, float(comp.up.is_set()))
            ready.add_metric(lv, float(comp.ready))
            desired.add_metric(lv, float(sup.desired(name) == "running"))
            for st in State:
                state.add_metric([*lv, str(st)], float(comp.state == st))
            restarts.add_metric(lv, comp.restarts)
            for cause in RESTART_CAUSES:
                by_cause.add_metric([*lv, cause], comp.restarts_by_cause.get(cause, 0))
            if comp.record is not None:
                records[name] = comp.record
                if comp.started_at is not None:
                    started.add_metric(lv, comp.started_at)
        usage = self.owner.usage
        for name, (seconds, resident, count) in usage.items():
            if name not in records:
                continue  # stopped since the refresh
            lv = [name, sup.components[name].kind]
            cpu.add_metric(lv, seconds)
            rss.add_metric(lv, resident)
            procs.add_metric(lv, count)
        yield from (up, ready, desired, state, restarts, by_cause, started, cpu, rss, procs)
        yield from cache_families(sup.caches.status(sup.config))
        yield from self.owner.vllm_families()


def cache_families(status: dict[str, Any]) -> Iterator[Metric]:
    """The compile caches on the host (`node.caches`), as last measured: the total against its cap, each key."""
    if not status["enabled"]:
        return
    yield GaugeMetricFamily("dsv4_agent_compile_cache_bytes", "Bytes of the vLLM ranks' compile caches kept on the "
                            "host (every software stack's folder; agent.caches).", value=status["bytes"])  # fmt: skip
    yield GaugeMetricFamily("dsv4_agent_compile_cache_max_bytes", "The cap of those caches (agent.caches.max_gb).",
                            value=status["max_bytes"])  # fmt: skip
    per_key = GaugeMetricFamily("dsv4_agent_compile_cache_key_bytes", "Bytes of one software stack's cache folder.",
                                labels=["key"])  # fmt: skip
    for entry in status["keys"]:
        per_key.add_metric([entry["key"]], entry["bytes"])
    yield per_key


def npu_families(monitor: NpuMonitor) -> Iterator[Metric]:
    """The node's NPUs as the monitor last saw them; only `dsv4_npu_checked` where npu-smi is absent."""
    yield GaugeMetricFamily("dsv4_npu_checked", "1 when npu-smi exists and NPU health is watched.",
                            value=float(monitor.skipped is None))  # fmt: skip
    if monitor.skipped is not None:
        return
    yield GaugeMetricFamily("dsv4_npu_expected", "NPUs this node must show (node.npus).",
                            value=monitor.policy.expected_npus)  # fmt: skip
    yield GaugeMetricFamily("dsv4_npu_start_held", "1 while a hardware fault holds vLLM starts.",
                            value=float(not monitor.decision().allowed))  # fmt: skip
    yield GaugeMetricFamily("dsv4_npu_poll_duration_seconds", "How long the last NPU poll took.",
                            value=monitor.last_poll_s)  # fmt: skip
    fault = GaugeMetricFamily("dsv4_npu_fault", "1 per active hardware fault (npu '' = the node).",
                              labels=["npu", "what", "level", "overridden"])  # fmt: skip
    for f in monitor.faults:
        fault.add_metric(["" if f.npu is None else str(f.npu), f.what, f.level.name, str(f.overridden).lower()], 1.0)
    appeared = CounterMetricFamily("dsv4_npu_faults", "Hardware faults that appeared since the agent started.",
                                   labels=["what", "level"])  # fmt: skip
    for (what, level), count in sorted(monitor.appeared_total.items()):
        appeared.add_metric([what, level], count)
    yield from (fault, appeared)
    snap = monitor.last
    if snap is None or snap.info is None:
        return
    labels = ["npu", "chip"]
    visible = GaugeMetricFamily("dsv4_npu_visible", "NPUs npu-smi info shows.", value=len(snap.info.npu_ids))
    healthy = GaugeMetricFamily("dsv4_npu_healthy", "1 when npu-smi shows the chip's health as OK.", labels=labels)
    used = GaugeMetricFamily("dsv4_npu_hbm_used_bytes", "HBM in use.", labels=labels)
    total = GaugeMetricFamily("dsv4_npu_hbm_total_bytes", "HBM size.", labels=labels)
    for chip in snap.info.chips:
        lv = [str(chip.npu), str(chip.chip)]
        healthy.add_metric(lv, float(chip.health == "OK"))
        if chip.hbm_used_mb is not None and chip.hbm_total_mb is not None:
            used.add_metric(lv, chip.hbm_used_mb * 2**20)
            total.add_metric(lv, chip.hbm_total_mb * 2**20)
    link = GaugeMetricFamily("dsv4_npu_roce_link_up", "1 when hccn_tool shows the NPU's RoCE link UP.", labels=["npu"])
    for npu, state in snap.links.items():
        link.add_metric([str(npu)], float(state == "UP"))
    procs = GaugeMetricFamily("dsv4_npu_processes", "Processes npu-smi lists on the NPU.", labels=["npu"])
    counts = {npu: 0 for npu in snap.info.npu_ids}
    for proc in snap.info.processes:
        counts[proc.npu] = counts.get(proc.npu, 0) + 1
    for npu, count in counts.items():
        procs.add_metric([str(npu)], count)
    yield from (visible, healthy, used, total, link, procs)


class _NpuCollector:
    def __init__(self, monitor: NpuMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        yield from npu_families(self.monitor)


class WeightsReport(Protocol):
    """What the metrics read of the weight warmer (`layers.weight_warm.WeightWarmer`)."""

    read_bytes: int

    def resident(self) -> tuple[dict[str, tuple[int, int]], int, int]: ...


class _WeightsCollector:
    """The shards of this node's models in the page cache, as the warmer last measured them (issue 32 item 3)."""

    def __init__(self, warmer: WeightsReport) -> None:
        self.warmer = warmer

    def collect(self) -> Iterator[Metric]:
        per, total, resident = self.warmer.resident()
        size = GaugeMetricFamily("dsv4_agent_weights_bytes", "Bytes of the weight shards a vLLM component loads.",
                                 labels=["component"])  # fmt: skip
        cached = GaugeMetricFamily("dsv4_agent_weights_resident_bytes", "Of those, bytes in the page cache "
                                   "(mincore): what its next load reads from RAM.", labels=["component"])  # fmt: skip
        for name, (b, r) in per.items():
            size.add_metric([name], b)
            cached.add_metric([name], r)
        yield from (size, cached)
        yield GaugeMetricFamily("dsv4_agent_weights_node_bytes", "Bytes of the shards of every model this node loads "
                                "(each file once).", value=total)  # fmt: skip
        yield GaugeMetricFamily("dsv4_agent_weights_node_resident_bytes", "Of those, bytes in the page cache.",
                                value=resident)  # fmt: skip
        yield CounterMetricFamily("dsv4_agent_weights_warmed_bytes", "Bytes the warmer read into the page cache.",
                                  value=self.warmer.read_bytes)  # fmt: skip


class AgentMetrics:
    """The registry behind GET /metrics. Call `refresh()` (async) before `generate()`: it reads what takes I/O
    (vLLM's /metrics, the process trees' usage) off the event loop; `generate()` only formats."""

    def __init__(self, supervisor: Stack, sampler: VllmSampler, started_at: float | None = None) -> None:
        self.supervisor = supervisor
        self.started_at = started_at if started_at is not None else time.time()
        self.registry = CollectorRegistry()
        labels = ["component", "role", "kind"]
        self.probe_duration = Histogram("dsv4_probe_duration_seconds", "How long each probe took.", labels,
                                        buckets=PROBE_BUCKETS, registry=self.registry)  # fmt: skip
        self.probe_failures = Counter("dsv4_probe_failures", "Probe runs that failed.", labels, registry=self.registry)
        self.vllm_load = Histogram("dsv4_agent_vllm_load_seconds",
                                   "From a vLLM launch to its startup probes passing (the model loaded): what a "
                                   "restart of it costs.", ["component"], buckets=LOAD_BUCKETS,
                                   registry=self.registry)  # fmt: skip
        self.vllm_phase = Histogram("dsv4_agent_vllm_start_phase_seconds",
                                    "Each phase of a vLLM start that came up (`vllm.start_phases`: imports, engine, "
                                    "weights, compile, kv_cache, graphs, api, ready, first_token), from its own log "
                                    "lines.",
                                    ["component", "phase"], buckets=PHASE_BUCKETS, registry=self.registry)  # fmt: skip
        ProcessCollector(namespace="dsv4_agent", registry=self.registry)
        self.registry.register(_StackCollector(self))
        supervisor.on_probe_result.append(self.observe_probe)
        supervisor.on_load.append(self.observe_load)
        self.cache = CacheWindow(sampler)
        """Max age 0: each /metrics scrape samples anew (Prometheus sets the window); the periodic readers reuse it."""
        self.usage: dict[str, tuple[float, int, int]] = {}
        """Each component's tree usage as of the last `refresh_usage` (what the scrape shows)."""

    def observe_probe(self, component: str, role: str, result: Any) -> None:
        """Supervisor.on_probe_result callback: cheap, synchronous."""
        labels = (component, role, result.kind)
        self.probe_duration.labels(*labels).observe(max(0.0, result.latency_s))
        if not result.ok:
            self.probe_failures.labels(*labels).inc()

    def observe_load(self, component: str, kind: str, seconds: float) -> None:
        if kind == "vllm":
            self.vllm_load.labels(component).observe(seconds)

    async def refresh(self) -> None:
        await self.refresh_vllm()
        await self.refresh_usage()
        await self.supervisor.caches.refresh(self.supervisor.config)  # measured at most once a minute

    async def refresh_vllm(self) -> None:
        await self.cache.refresh()

    async def refresh_usage(self) -> None:
        """The components' tree usage, from the shared process table, in a thread (a pass over /proc and a few
        reads per process stalled the loop on every scrape)."""
        records = {n: c.record for n, c in self.supervisor.components.items() if c.record is not None}
        table = await TABLES.get()
        self.usage = await asyncio.to_thread(tree_usage, records, table)

    def vllm_families(self) -> Iterator[Metric]:
        urls = self.cache.vllm_urls
        if not urls:
            return
        ok = GaugeMetricFamily("dsv4_vllm_metrics_scrape_ok", "1 if the last scrape of vLLM's /metrics worked.",
                               labels=["component"])  # fmt: skip
        took = GaugeMetricFamily("dsv4_vllm_metrics_scrape_duration_seconds", "How long that scrape took.",
                                 labels=["component"])  # fmt: skip
        for name, good in self.cache.scrape_ok.items():
            ok.add_metric([name], float(good))
            took.add_metric([name], self.cache.scrape_s.get(urls.get(name, ""), 0.0))
        ratio = GaugeMetricFamily(
            "dsv4_vllm_cache_hit_ratio",
            "vLLM prefix-cache hit ratio (0..1) like watch_cache_hit_rate.sh: local/ext _total since vLLM started, "
            "_win since the agent's previous scrape, eff_total = (local+ext hits)/local queries.",
            labels=["component", "engine", "kind"],
        )
        for name, rows in self.cache.rows.items():
            for rates in rows:
                engine = rates.counters.engine
                for kind in RATIO_KINDS:
                    value = getattr(rates, kind)
                    if value is not None:
                        ratio.add_metric([name, engine, kind], value)
        yield from (ok, took, ratio)

    def attach_npu(self, monitor: NpuMonitor) -> None:
        """Export the node's NPU health (read at scrape time from the monitor's last poll)."""
        self.registry.register(_NpuCollector(monitor))

    def attach_weights(self, warmer: WeightsReport) -> None:
        """Export the weight shards' residency (read at scrape time from the warmer's last measurement)."""
        self.registry.register(_WeightsCollector(warmer))
    def attach_phases(self, watch: Any) -> None:
        """Observe every completed vLLM start's phases (`layers.start_phases.StartPhaseWatch.observers`)."""
        watch.observers.append(lambda component, phase, seconds: self.vllm_phase.labels(component, phase).observe(
            seconds))

    def attach_mqtt(self, publisher: Any) -> None:
        """Export the MQTT link's counters (`nodeagent.api.mqtt.MqttPublisher.collect`, read at scrape time)."""
        self.registry.register(publisher)

    def generate(self) -> bytes:
        return generate_latest(self.registry)

__all__ = ["CONTENT_TYPE", "AgentMetrics", "npu_families", "tree_usage"]

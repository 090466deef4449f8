#!/usr/bin/env python3
"""The event loop's worst stalls while the agent works: the lateness of a 1 ms periodic task (p50, p99, max).

In one process, as in the agent: a real `Supervisor` with four `kind: process` components (each a small tree, `sh`
with two `sleep` children, in its own session), and beside it on the same loop
- a `/metrics` scrape (`AgentMetrics`: what `GET /metrics` runs) every `--scrape` seconds (the agent's scrape is
  every 10-15 s; shorter here to get samples),
- NPU polls with the fake `npu-smi` (tests/fixtures/ascend, `doc-healthy-a2`) every `--npu` seconds, our PIDs
  listed as the agent lists them (the foreign-process check),
- a stop of all four components at once, then their start, every `--stops` seconds.
A ticker sleeps 1 ms in a loop and records how late each wake-up was; nothing else measures. The anchor is issue 29's:
p99 <= 20 ms. The host's process count is printed (a pass over /proc grows with it), and the load average.

Usage: `.venv/bin/python bench/loop_stall.py [--seconds 30] [--scrape 0.5] [--npu 1] [--stops 3] [--json FILE]`.
Before/after: run it with `PYTHONPATH` pointing at another checkout (`git archive REV | tar -x -C DIR`): the
bench adapts to the code it finds (before `nodeagent.core.proctable`, the scrape has no `refresh` and our PIDs are
listed synchronously).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the fake Ascend tools

import psutil  # noqa: E402
from ascend_fake import FakeAscend  # noqa: E402
from loguru import logger  # noqa: E402

import nodeagent  # noqa: E402
from nodeagent.api.metrics import AgentMetrics  # noqa: E402
from nodeagent.api.vllm_sampler import VllmSampler  # noqa: E402
from nodeagent.config.load import parse_config  # noqa: E402
from nodeagent.core.events import EventBus  # noqa: E402
from nodeagent.node.supervisor import Supervisor  # noqa: E402
from nodeagent.npu.health import HealthPolicy  # noqa: E402
from nodeagent.npu.monitor import NpuMonitor, our_pids  # noqa: E402
from nodeagent.seam.host import Clock  # noqa: E402

TARGET_P99_MS = 20.0
STALL_MS = 20.0
"""A stall is one wake-up this late or later. A stall of 500 ms is one late sample among thousands: p99 hides it,
the count and the time lost in stalls show it."""
NAMES = ("c1", "c2", "c3", "c4")
HAS_TABLE = importlib.util.find_spec("nodeagent.core.proctable") is not None


def config_text(state: Path) -> str:
    tree = '["sh", "-c", "sleep 3600 & sleep 3600 & wait"]'
    comps = "\n".join(f"  {n}: {{kind: process, command: {tree}, stop_grace_s: 5}}" for n in NAMES)
    return f"""
cluster: {{name: bench}}
node: {{name: n0, ip: 127.0.0.1, role: master, npus: 0}}
agent: {{state_dir: {state}, log_dir: {state}/logs, systemd_scopes: never}}
components:
{comps}
"""


def proc_pass_ms() -> float:
    """One pass over /proc as this code takes it: `proctable.scan` (in a thread), or before it psutil's objects
    reading what `process.session_members` read of every process (on the loop)."""

    def psutil_pass() -> None:
        for proc in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                os.getsid(proc.pid)
                proc.status()

    if HAS_TABLE:
        from nodeagent.core.proctable import scan

        one: Any = scan
    else:
        one = psutil_pass
    times = []
    for _ in range(5):
        began = time.perf_counter()
        one()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def ticker(lags: list[float], done: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not done.is_set():
        began = loop.time()
        await asyncio.sleep(0.001)
        lags.append((loop.time() - began - 0.001) * 1000)


async def every(period: float, work: Any, done: asyncio.Event, count: list[int]) -> None:
    while not done.is_set():
        await work()
        count[0] += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), period)


def summary(lags: list[float]) -> dict[str, Any]:
    stalls = [lag for lag in lags if lag >= STALL_MS]
    return {"lag_ms": {"p50": round(statistics.median(lags), 2), "p99": round(percentile(lags, 0.99), 2),
                       "max": round(max(lags), 2), "samples": len(lags)},
            "stalls": {"over_20ms": len(stalls), "over_100ms": sum(1 for lag in lags if lag >= 100),
                       "stalled_s": round(sum(stalls) / 1000, 2)}}  # fmt: skip


async def floor(seconds: float) -> dict[str, Any]:
    """The ticker alone: what this machine's load does to a 1 ms sleep without any agent work."""
    lags: list[float] = []
    done = asyncio.Event()
    task = asyncio.create_task(ticker(lags, done))
    await asyncio.sleep(seconds)
    done.set()
    await task
    return summary(lags)


async def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    logger.remove()  # the agent's own lines go to a file, as under the agent (not this terminal)
    logger.add(folder / "agent.log", level="INFO")
    sup = Supervisor(parse_config(config_text(folder / "state")), EventBus(), Clock())
    metrics = AgentMetrics(sup, VllmSampler(sup))
    fake = FakeAscend(folder / "ascend", "doc-healthy-a2")

    def records() -> list[Any]:
        return [c.record for c in sup.components.values() if c.record is not None]

    if HAS_TABLE:
        from nodeagent.core.proctable import TABLES

        async def ours() -> set[int]:
            return our_pids(records(), await TABLES.get(0))  # type: ignore[call-arg]  # as guards.py
    else:

        def ours() -> set[int]:  # type: ignore[misc]
            return our_pids(records())

    npu = NpuMonitor(fake.tools(False), HealthPolicy(expected_npus=8), args.npu, 1, False, ours)  # type: ignore[arg-type]

    async def scrape() -> None:
        if hasattr(metrics, "refresh"):
            await metrics.refresh()
        else:
            await metrics.refresh_vllm()
        metrics.generate()

    async def stop_start() -> None:
        for name in NAMES:
            sup.command(name, "stop", drain=False)
        for name in NAMES:
            await sup.wait(name, "stopped", 30)
        for name in NAMES:
            sup.command(name, "start")
        for name in NAMES:
            await sup.wait(name, "up", 30)

    lags: list[float] = []
    done = asyncio.Event()
    counts = {"scrapes": [0], "npu_polls": [0], "stops": [0]}
    try:
        await sup.start()
        for name in NAMES:
            await sup.wait(name, "up", 30)
        tasks = [asyncio.create_task(ticker(lags, done)),
                 asyncio.create_task(every(args.scrape, scrape, done, counts["scrapes"])),
                 asyncio.create_task(every(args.npu, npu.poll, done, counts["npu_polls"])),
                 asyncio.create_task(every(args.stops, stop_start, done, counts["stops"]))]  # fmt: skip
        await asyncio.sleep(args.seconds)
        done.set()
        await asyncio.gather(*tasks)
    finally:  # also when interrupted: the components' trees are stopped
        await sup.shutdown()
        await metrics.close()
    return {**summary(lags), **{k: v[0] for k, v in counts.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--scrape", type=float, default=0.5, help="seconds between /metrics scrapes")
    parser.add_argument("--npu", type=float, default=1.0, help="seconds between NPU polls")
    parser.add_argument("--stops", type=float, default=3.0, help="seconds between 4-component stop+start cycles")
    parser.add_argument("--extra-procs", type=int, default=300,
                        help="idle processes started for the run (a DeepSeek node runs hundreds more than a dev box)")
    parser.add_argument("--floor", type=float, default=10.0, help="seconds of the ticker alone first (the floor)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` or kill still ends the idle processes
    extra = [subprocess.Popen(["sleep", "3600"], start_new_session=True) for _ in range(args.extra_procs)]
    try:
        pass_ms = proc_pass_ms()
        procs = sum(1 for entry in os.listdir("/proc") if entry.isdigit())
        with tempfile.TemporaryDirectory(prefix="dsv4-loopstall-") as tmp:
            idle = asyncio.run(floor(args.floor))
            result = asyncio.run(run(args, Path(tmp)))
    finally:
        for proc in extra:
            proc.kill()
            proc.wait()
    load = Path("/proc/loadavg").read_text().split()[:3]
    lag = result["lag_ms"]
    verdict = "PASS" if lag["p99"] <= TARGET_P99_MS else "FAIL"
    print(f"code: {Path(nodeagent.__file__).parent} ({'shared process table' if HAS_TABLE else 'no process table'})")
    print(f"host: {procs} processes during the run ({args.extra_procs} idle ones ours), load {' '.join(load)}; "
          f"one pass over /proc as this code takes it: {pass_ms:.1f} ms (median of 5)")
    print(f"work in {args.seconds:g} s: {result['scrapes']} scrapes, {result['npu_polls']} NPU polls, "
          f"{result['stops']} stop+start cycles of 4 components")
    print(f"1 ms ticker lateness ({lag['samples']} samples): p50 {lag['p50']:.2f} ms  p99 {lag['p99']:.2f} ms  "
          f"max {lag['max']:.2f} ms   anchor p99 <= {TARGET_P99_MS:g} ms: {verdict}")
    st = result["stalls"]
    print(f"stalls >= {STALL_MS:g} ms: {st['over_20ms']} ({st['over_100ms']} >= 100 ms), "
          f"{st['stalled_s']:.2f} s of the {args.seconds:g} s lost in them")
    fl, fs = idle["lag_ms"], idle["stalls"]
    print(f"floor, the ticker alone for {args.floor:g} s: p50 {fl['p50']:.2f} ms  p99 {fl['p99']:.2f} ms  "
          f"max {fl['max']:.2f} ms; stalls >= {STALL_MS:g} ms: {fs['over_20ms']}, {fs['stalled_s']:.2f} s lost")
    if args.json:
        args.json.write_text(json.dumps({**result, "floor": idle, "processes": procs, "proc_pass_ms": round(pass_ms, 2),
                                         "load": load, "table": HAS_TABLE}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()

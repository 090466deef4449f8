#!/usr/bin/env python3
"""A long simulation campaign: random fault schedules on every core until the time is up, then a report.

Each schedule is one seed of `tests/simulation.py` (the agents' own cluster layer on one FakeStore and one virtual
clock; the layouts: the shipped 8-node file, `config/local-cluster.yaml` and a small 5-node one). Prints, and writes
as JSON with `--json`: schedules run, simulated hours, faults injected by kind, invariant checks made, violations by
invariant with the seeds that replay them, and the speed (simulated seconds per wall second, per core and in all).

Usage: `.venv/bin/python bench/sim_campaign.py --hours 1 [--jobs N] [--duration 600] [--seed S] [--json FILE]`;
`--speed [--duration 180]` measures one core's speed instead (`taskset -c 0`): simulated seconds per CPU second
on the 8-node file and a 64-node fleet, fake and real node, medians (anchor: ≥ 1,000x real time for 8 nodes on
one core). `--node` (default mixed, as the CI budget) chooses each node's stack for a campaign.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import simulation  # noqa: E402


def campaign(hours: float, jobs: int, duration: float, first: int, node: str = "mixed") -> dict[str, Any]:
    deadline = time.perf_counter() + hours * 3600
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    seed = first
    chunk = max(jobs * 8, 8)
    while time.perf_counter() < deadline:
        results += simulation.batch(seed, chunk, "mixed", duration, jobs, node)
        seed += chunk
        done = simulation.summary(first, results, time.perf_counter() - started)
        print(f"  {done['schedules']} schedules, {done['simulated_s'] / 3600:.1f} h simulated, "
              f"{done['failed']} failed", flush=True)  # fmt: skip
    report = simulation.summary(first, results, time.perf_counter() - started)
    report["simulated_h"] = report["simulated_s"] / 3600
    report["jobs"] = jobs
    report["cpu_s"] = sum(r["cpu_s"] for r in results)
    report["simulated_per_cpu_s"] = report["simulated_s"] / max(report["cpu_s"], 1e-9)
    report["replays"] = {r["seed"]: r["replay"] for r in results if not r["ok"]}
    return report


def speed(duration: float, seeds: int, first: int = 760001, big_duration: float = 60.0,
          layouts: tuple[str, ...] = ("8node", "64node")) -> dict[str, Any]:
    """One core: simulated cluster seconds per CPU second of this process (the machine may be shared: CPU, not
    wall), the shipped 8-node layout and a 64-node fleet (`simulation.fleet_layout`), each node's stack fake and
    real; the median of `seeds` schedules, after one schedule of the layout that warms the process (its parses
    are kept from one schedule to the next, as in a campaign's worker) — that first one is printed apart. The
    64-node schedules draw `big_duration` seconds of faults (a rollout there steps through 40 groups)."""
    out: dict[str, Any] = {}
    for layout in layouts:
        for node in ("fake", "real"):
            rows = []
            length = duration if layout == "8node" else big_duration
            for seed in range(first - 1, first + seeds):
                cpu, wall = time.process_time(), time.perf_counter()
                result = simulation.run_schedule(simulation.make_schedule(seed, layout, length, node=node))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                rows.append({"seed": seed, "simulated_s": result.simulated_s, "cpu_s": cpu, "wall_s": wall,
                             "per_cpu_s": result.simulated_s / cpu, "ok": result.ok})  # fmt: skip
            cold, warm = rows[0], rows[1:]
            median = statistics.median(r["per_cpu_s"] for r in warm)
            out[f"{layout}/{node}"] = {"cold": cold, "runs": warm, "median_per_cpu_s": median}
            each = ", ".join(f"{r['per_cpu_s']:.0f}x" for r in warm)
            print(f"{layout:6s} {node}: median {median:6.0f}x real time per CPU s over {len(warm)} schedules of "
                  f"{length:g} s ({each}; the process's first: "
                  f"{cold['per_cpu_s']:.0f}x)   [anchor: >= 1000x for 8 nodes on one core]", flush=True)  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--duration", type=float, default=600.0, help="virtual seconds of faults per schedule")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--node", default="mixed", choices=("fake", "real", "mixed"),
                        help="each node's stack: mixed = the real supervisor on one seed in four (the CI budget's)")
    parser.add_argument("--speed", action="store_true", help="measure one core's speed instead")
    parser.add_argument("--speed-seeds", type=int, default=3, help="schedules per cell of --speed (a median)")
    parser.add_argument("--big-duration", type=float, default=60.0, help="--speed: the 64-node schedules' faults")
    parser.add_argument("--layouts", default="8node,64node", help="--speed: which layouts (comma-separated)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["PYTHONHASHSEED"] = "0"
    if args.speed:
        report = speed(args.duration, args.speed_seeds, big_duration=args.big_duration,
                       layouts=tuple(args.layouts.split(",")))
    else:
        first = args.seed if args.seed is not None else int(time.time()) % 1_000_000
        report = campaign(args.hours, args.jobs, args.duration, first, args.node)
        print(json.dumps({k: v for k, v in report.items() if k != "replays"}, indent=1))
        for seed, line in report["replays"].items():
            print(f"  seed {seed}: {line}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A long simulation campaign: random fault schedules on every core until the time is up, then a report.

Each schedule is one seed of `tests/simulation.py` (the agents' own cluster layer on one FakeStore and one virtual
clock; the layouts: the shipped 8-node file, `config/local-cluster.yaml` and a small 5-node one). Prints, and writes
as JSON with `--json`: schedules run, simulated hours, faults injected by kind, invariant checks made, violations by
invariant with the seeds that replay them, and the speed (simulated seconds per wall second, per core and in all).

Usage: `.venv/bin/python bench/sim_campaign.py --hours 1 [--jobs N] [--duration 600] [--seed S] [--json FILE]`;
`--speed` measures one core's speed on the 8-node and a 64-node layout instead (anchor: ≥ 1,000x real time for
8 nodes on one core).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import simulation  # noqa: E402


def campaign(hours: float, jobs: int, duration: float, first: int) -> dict[str, Any]:
    deadline = time.perf_counter() + hours * 3600
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    seed = first
    chunk = max(jobs * 8, 8)
    while time.perf_counter() < deadline:
        results += simulation.batch(seed, chunk, "mixed", duration, jobs)
        seed += chunk
        done = simulation.summary(first, results, time.perf_counter() - started)
        print(f"  {done['schedules']} schedules, {done['simulated_s'] / 3600:.1f} h simulated, "
              f"{done['failed']} failed", flush=True)  # fmt: skip
    report = simulation.summary(first, results, time.perf_counter() - started)
    report["simulated_h"] = report["simulated_s"] / 3600
    report["jobs"] = jobs
    report["replays"] = {r["seed"]: r["replay"] for r in results if not r["ok"]}
    return report


def speed(duration: float, seeds: int) -> dict[str, Any]:
    """One core: simulated seconds per wall second on the shipped 8-node layout and a 64-node one."""
    out = {}
    big = simulation.Layout("64node", tuple(f"n{i}" for i in range(64)), tuple(
        [{"name": f"p{i}", "kind": "prefill", "nodes": [f"n{i}"]} for i in range(32)]
        + [{"name": f"d{i}", "kind": "decode", "nodes": [f"n{32 + 4 * i + j}" for j in range(4)],
            "data_parallel_rpc_port": 44000 + i} for i in range(8)]))  # fmt: skip
    original = simulation.layouts

    def with_big() -> dict[str, simulation.Layout]:
        return {**original(), "64node": big}

    simulation.layouts = with_big  # type: ignore[assignment]
    for layout in ("8node", "64node"):
        wall = simulated = 0.0
        for seed in range(1, seeds + 1):
            result = simulation.run_schedule(simulation.make_schedule(seed, layout, duration))
            wall += result.wall_s
            simulated += result.simulated_s
        out[layout] = {"schedules": seeds, "simulated_s": simulated, "wall_s": wall, "speed": simulated / wall}
        print(f"{layout}: {simulated:.0f}s simulated in {wall:.1f}s on one core: {simulated / wall:.0f}x real time "
              f"(anchor: >= 1000x for 8 nodes)", flush=True)  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--duration", type=float, default=600.0, help="virtual seconds of faults per schedule")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--speed", action="store_true", help="measure one core's speed instead")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["PYTHONHASHSEED"] = "0"
    if args.speed:
        report = speed(args.duration, 3)
    else:
        first = args.seed if args.seed is not None else int(time.time()) % 1_000_000
        report = campaign(args.hours, args.jobs, args.duration, first)
        print(json.dumps({k: v for k, v in report.items() if k != "replays"}, indent=1))
        for seed, line in report["replays"].items():
            print(f"  seed {seed}: {line}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

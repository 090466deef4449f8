"""How fast the whole-cluster simulation runs with each node's stack fake or real (`tests/sim_node.py`): simulated
cluster seconds per wall second and per CPU second (this process's: the machine may be shared), for the shipped
8-node file and config/local-cluster.yaml, one core; `--nodes` chooses the stacks (container: the real node in
container mode, `tests/sim_container.py`; npu: the real node with the NPU guards and chip-reset ladder over
simulated chips and their faults, `tests/sim_npu.py`).

    PYTHONPATH=. .venv/bin/python bench/sim_node_speed.py --schedules 6 --duration 180
    PYTHONPATH=. .venv/bin/python bench/sim_node_speed.py --schedules 3 --nodes real,container
    PYTHONPATH=. .venv/bin/python bench/sim_node_speed.py --schedules 5 --nodes real,npu
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTHONHASHSEED", "0")

ANCHOR = "issue 30: >= 1,000x real time for 8 nodes on one core"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--schedules", type=int, default=6)
    parser.add_argument("--duration", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=760001)
    parser.add_argument("--nodes", default="fake,real", help="comma-separated: fake, real, container, npu")
    args = parser.parse_args()
    from simulation import make_schedule, run_schedule

    for layout in ("8node", "local-cluster"):
        for node in args.nodes.split(","):
            per_wall, per_cpu, cpu_s = [], [], []
            for seed in range(args.seed, args.seed + args.schedules):
                cpu, wall = time.process_time(), time.perf_counter()
                schedule = make_schedule(seed, layout, args.duration, node="real" if node == "npu" else node,
                                         npu=node == "npu")  # fmt: skip
                result = run_schedule(schedule)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                per_wall.append(result.simulated_s / wall)
                per_cpu.append(result.simulated_s / cpu)
                cpu_s.append(cpu)
            print(f"{layout:14s} {node}: median {statistics.median(per_wall):6.0f}x real time per wall s, "
                  f"{statistics.median(per_cpu):6.0f}x per CPU s, {statistics.median(cpu_s):5.2f} CPU s per schedule "
                  f"({args.schedules} schedules of {args.duration:g} s)   [{ANCHOR}]")  # fmt: skip


if __name__ == "__main__":
    main()

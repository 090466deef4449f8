#!/usr/bin/env python3
"""etcd requests per second of a cluster member at rest, with the production defaults (member_ttl_s 10,
member_heartbeat_s 15). Target (issue 8): at most ~1 request/s per agent, keepalives included.

Two real agents (tests/cluster_harness.py: real etcd, real datasystem workers, vLLM stand-ins) come up; once
every component is up the agents' own request counters (`GET /cluster` → etcd.requests: unary calls and watch
creations) are read twice, `--seconds` apart.

Usage: `.venv/bin/python bench/etcd_budget.py [--seconds 60]`
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cluster_harness import ClusterHarness  # noqa: E402
from etcdserver import EtcdServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsv4-etcd-budget-") as tmp:
        home = Path(tmp)
        etcd = EtcdServer(home / "etcd").start()
        harness = ClusterHarness(home / "cluster", etcd.endpoint, ["n0", "n1"], ttl_s=10.0, heartbeat_s=15.0)
        try:
            harness.start()
            harness.wait_members("n0", {"n0", "n1"}, timeout=120)
            harness.wait_up(timeout=180)
            time.sleep(2.0)  # the last state change's write
            first = {n: harness.cluster(n)["etcd"]["requests"] for n in harness.names}
            began = time.monotonic()
            time.sleep(args.seconds)
            elapsed = time.monotonic() - began
            for name in harness.names:
                rate = (harness.cluster(name)["etcd"]["requests"] - first[name]) / elapsed
                verdict = "PASS" if rate <= 1.0 else "FAIL"
                print(f"{name}: {rate:.2f} etcd requests/s at rest over {elapsed:.0f}s "
                      f"(expected ~{1 / (10 / 3) + 1 / 15:.2f}: keepalive every ttl/3 + one write per heartbeat) "
                      f"target <= 1.0: {verdict}")  # fmt: skip
        finally:
            harness.cleanup()
            etcd.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

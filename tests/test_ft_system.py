"""The ladder on real processes: two agents, real etcd and datasystem workers, one externally launched
data-parallel group of two ranks (one per node) with `fault_tolerance` enabled, each rank the vLLM stand-in with
the wheel's fault-tolerance API (`standin/vllm_standin/fault_tolerance.py`: FT needs GPU all2all, the one place a
stand-in stands for it). An engine fault recovered by vLLM's retry restarts nothing and makes no generation; a
retry that hangs escalates after `retry_timeout_s` to exactly one generation. Every other branch of the ladder is
`tests/test_ft_ladder.py`, without processes."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_harness import ClusterHarness
from conftest import free_port, wait_for

pytestmark = pytest.mark.system

NODES = ["n0", "n1"]
RANKS = {"n0": "vllm-dp0", "n1": "vllm-dp1"}
FT = {"enabled": True, "engine_recovery_timeout_s": 60, "retry_timeout_s": 10, "status_interval_s": 0.5}
RETRY_S = 6
"""How long the stand-in's collective re-initialisation takes: longer than the ranks' liveness takes to fail
(a canary of 3 s, each second, one failure acts: <= 4 s after the fault), shorter than retry_timeout_s."""


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHarness]:
    home = tmp_path_factory.mktemp("ftladder")
    h = ClusterHarness(home, None, NODES, run_etcd=True, ttl_s=3.0, heartbeat_s=5.0)
    h.data["cluster"]["vllm_groups"] = [{"name": "g", "kind": "mixed", "nodes": NODES, "dp_launch": "external",
                                         "data_parallel_rpc_port": free_port()}]  # fmt: skip
    vllm = h.data["components"]["vllm"]
    vllm["fault_tolerance"] = FT
    vllm["env"]["VLLM_STANDIN_FT_DIR"] = str(home / "ft-group")
    vllm["env"]["VLLM_STANDIN_FT_RETRY_S"] = str(RETRY_S)
    vllm["probes"]["liveness"] = {"period_s": 1, "timeout_s": 3, "failure_threshold": 1}
    try:
        h.start()
        up(h, 180)
        wait_for("fault tolerance armed on both nodes", lambda: all(ft(h, n)["supported"] for n in NODES), 60)
        yield h
    finally:
        h.cleanup()


def up(h: ClusterHarness, timeout: float) -> None:
    for node in NODES:
        comps = ["datasystem", RANKS[node]] + (["etcd"] if node == "n0" else [])
        h.wait_states(node, {c: {"running", "ready"} for c in comps}, timeout)


def ft(h: ClusterHarness, node: str) -> dict[str, Any]:
    return h.status(node).get("fault_tolerance", {}).get("g", {"supported": None})  # type: ignore[no-any-return]


def generation(h: ClusterHarness, node: str) -> int:
    return int(h.gang(node, "g")["generation"])


def pids(h: ClusterHarness) -> dict[str, int]:
    return {n: h.agents[n].children()[RANKS[n]]["pid"] for n in NODES}


def fault(h: ClusterHarness, node: str, mode: str) -> None:
    port = h.node(node)["components"]["vllm"]["port"]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/standin/ft_fault", json.dumps({"mode": mode}).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_an_engine_fault_recovered_by_retry_restarts_nothing(cl: ClusterHarness) -> None:
    """The retry takes longer than the ranks' liveness takes to fail (vLLM parks its busy loop, the canary
    waits): the liveness failure is held through the episode, and nothing restarts."""
    before, gen = pids(cl), generation(cl, "n0")
    faulted = time.monotonic()
    fault(cl, "n1", "transient")
    wait_for("the liveness hold on both ranks", lambda: all(
        cl.status(n)["components"][RANKS[n]]["liveness_hold"] for n in NODES), 5, 0.2)  # fmt: skip
    wait_for("recovered on both nodes", lambda: all(ft(cl, n)["recovered"] == 1 for n in NODES), 30, 0.2)
    took = time.monotonic() - faulted
    print(f"fault → recovered by retry on both nodes: {took:.2f}s (the re-initialisation takes {RETRY_S}s)")
    assert took >= RETRY_S
    for node in NODES:
        steps = [(s["rung"], s["outcome"]) for s in ft(cl, node)["ladder"]]
        assert steps == [("retry", "fault"), ("retry", "sent"), ("retry", "recovered")], steps
        assert ft(cl, node)["ranks"][RANKS[node]]["state"] == "healthy"
        log = cl.agents[node].log()
        assert "recovered by vLLM's retry" in log
        assert "not acted on: vLLM's fault-tolerance retry is recovering the group" in log, "the canary failed"
        assert cl.status(node)["components"][RANKS[node]]["liveness_hold"] is None
    time.sleep(2 * FT["status_interval_s"] + 2)  # a few more reads and liveness checks: still nothing to do
    assert pids(cl) == before and generation(cl, "n0") == generation(cl, "n1") == gen
    assert not any("liveness still fails after the hold" in cl.agents[n].log() for n in NODES)


def test_a_retry_that_hangs_escalates_to_exactly_one_generation(cl: ClusterHarness) -> None:
    before, gen = pids(cl), generation(cl, "n0")
    faulted = time.monotonic()
    fault(cl, "n1", "retry_hangs")
    wait_for(f"generation {gen + 1}", lambda: generation(cl, "n0") == gen + 1, 60, 0.2)
    asked = time.monotonic() - faulted
    print(f"fault → the next generation after a hung retry: {asked:.2f}s (retry_timeout_s {FT['retry_timeout_s']})")
    assert FT["retry_timeout_s"] <= asked < FT["engine_recovery_timeout_s"]
    wait_for("both ranks replaced", lambda: all(pids(cl)[n] != before[n] for n in NODES), 90, 0.2)
    up(cl, 90)
    wait_for("the new generation armed", lambda: all(ft(cl, n)["rung"] == "watching" for n in NODES), 30, 0.2)
    after = pids(cl)
    time.sleep(3)
    assert pids(cl) == after and generation(cl, "n0") == generation(cl, "n1") == gen + 1, "exactly one generation"
    for node in NODES:
        assert cl.agents[node].log().count(f"group g generation {gen + 1} (") == 1, "acted on exactly once"
    escalated = [n for n in NODES if ft(cl, n)["escalated"]]
    assert escalated
    for node in escalated:
        detail = next(s["detail"] for s in ft(cl, node)["ladder"] if s["outcome"] == "escalated")
        assert "retry timed out" in detail
        wait_for("its post-mortem written",
                 lambda n=node: RANKS[n] in cl.ctl(n, "postmortem", "list").stdout, 30)  # type: ignore[misc]
        bid = next(b["id"] for b in json.loads(cl.ctl(node, "postmortem", "list", "--json").stdout)
                   if b["component"] == RANKS[node])  # fmt: skip
        shown = cl.ctl(node, "postmortem", "show", bid)
        assert "ladder: retry sent: retry sent to rank" in shown.stdout, shown.stdout
        assert "ladder: retry escalated: retry timed out" in shown.stdout and f"generation {gen + 1}" in shown.stdout

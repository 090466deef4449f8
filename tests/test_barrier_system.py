"""The start barrier means "stopped", shown with a head whose old tree is slow to die (issue 16 item 0).

Two agents on one machine, one external-launch group `g` of two vLLM stand-in ranks — `vllm-dp0` on n0 (the
group's head) and `vllm-dp1` on n1 — where the head's engine runs on for EXIT_S seconds after its SIGTERM
(`VLLM_STANDIN_EXIT_S`: an A2 engine can take up to ~50 s to free its NPUs, and a new rank that handshakes with a
dying head hangs or fails). kill -9 of rank 1's API server: n1 asks the next generation at once and, once its
orphaned engine is cleaned, arrives at the barrier; n0 arrives only when its old head's whole tree is gone, ~EXIT_S
later. No process of the new generation may appear on either node before the last process of the old trees is
gone (a process watch from outside, as with real ranks in `test_realdp_system.py`): one generation, each rank
restarted once. Before the barrier meant "stopped" (it released once both nodes had *arrived*), n1's new rank
started while n0's old head still ran.

Then kill -9 of the slow head's own API server: n0 asks the next generation as soon as it sees the exit, while the
agent still waits EXIT_S for its orphaned engine; n1's old rank is gone 0.2 s after the kill, the head's tree at
10.0 s, the next generation after both. When n0 asked only once its own stop had returned, n1's old rank went
10.1 s after the kill.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from cluster_harness import ClusterHarness
from conftest import free_port, wait_for
from etcdserver import EtcdServer
from process_watch import ProcessWatch, assert_no_overlap

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

NODES = ["n0", "n1"]
RANKS = {"n0": "vllm-dp0", "n1": "vllm-dp1"}
EXIT_S = 10
"""How long the head's old engine (and so its API server) runs on after its SIGTERM."""


@dataclass
class Group:
    h: ClusterHarness
    watch: ProcessWatch

    def gang(self, node: str) -> dict[str, Any]:
        return self.h.gang(node, "g")

    def serving(self, timeout: float = 120) -> None:
        for node, comp in RANKS.items():
            self.h.wait_states(node, {comp: {"ready"}}, timeout)

    def next_generation(self, old: dict[Any, Any], gen: int, killed_at: float) -> dict[Any, Any]:
        """The group serves again as generation gen + 1, acted on once per node, and no process of it appeared
        before every process of `old` was gone; its processes."""
        wait_for("generation +1 acted on both", lambda: all(self.gang(n)["acted"] == gen + 1 for n in NODES), 60, 0.5)
        self.serving()
        new = assert_no_overlap(self.watch, old, killed_at, self.h.log_tails(40))
        assert {s.component for s in new.values()} == set(RANKS.values())
        for node in NODES:
            g = self.gang(node)
            assert (g["generation"], g["acted"]) == (gen + 1, gen + 1), f"{node}: {g}"
            assert self.h.agents[node].log().count(f"group g generation {gen + 1} (") == 1, "acted on exactly once"
        return new


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory, etcd: EtcdServer) -> Iterator[Group]:
    h = ClusterHarness(tmp_path_factory.mktemp("slowhead"), etcd.endpoint, NODES, ttl_s=3.0, heartbeat_s=5.0)
    vllm = h.data["components"]["vllm"]
    vllm.pop("depends_on")
    vllm["stop_grace_s"] = EXIT_S + 20  # the agent waits the head out: no SIGKILL before it is gone by itself
    h.data["components"] = {"vllm": vllm}  # no datasystem: the ranks alone
    for node in h.data["cluster"]["nodes"]:
        node["components"] = {"vllm": {k: node["components"]["vllm"][k] for k in ("port", "workdir")}}
    h.node("n0")["components"]["vllm"]["env"] = {"VLLM_STANDIN_EXIT_S": str(EXIT_S)}
    h.data["cluster"]["vllm_groups"] = [{"name": "g", "nodes": NODES, "dp_launch": "external",
                                         "data_parallel_address": "127.0.0.1",
                                         "data_parallel_rpc_port": free_port()}]  # fmt: skip
    watch = ProcessWatch(h.cluster_name).start()
    try:
        h.start()
        g = Group(h, watch)
        g.serving()
        yield g
    finally:
        watch.stop()
        h.cleanup()


def test_no_rank_of_the_next_generation_starts_before_the_slow_heads_old_tree_is_gone(group: Group) -> None:
    h = group.h
    old, gen = dict(group.watch.alive()), group.gang("n0")["generation"]
    before = {n: group.h.status(n)["components"][c]["restarts"] for n, c in RANKS.items()}
    head = {k: s for k, s in old.items() if s.component == RANKS["n0"]}
    assert any(s.title == "VLLM::EngineCore" for s in head.values()), group.watch.timeline(0)
    killed_at = time.monotonic()
    os.kill(int(h.agents["n1"].children()[RANKS["n1"]]["pid"]), signal.SIGKILL)

    def n1_alone_at_the_barrier() -> bool:
        barrier = group.gang("n1").get("barrier") or {}
        return barrier.get("arrived") == ["n1"] and not barrier.get("released")

    # n1 arrived (its orphaned engine cleaned) while n0's old head still dies: the barrier holds
    wait_for("n1 alone at the barrier of the next generation", n1_alone_at_the_barrier, EXIT_S, 0.2)
    assert any(s.gone is None for s in head.values()), "the head's old tree is still dying meanwhile"
    new = group.next_generation(old, gen, killed_at)
    head_gone = max(s.gone or 0.0 for s in head.values()) - killed_at
    first_new = min(s.first for s in new.values()) - killed_at
    print(f"kill -9 of rank 1's API server → the head's old tree gone after {head_gone:.1f}s, the first process "
          f"of the next generation after {first_new:.1f}s")  # fmt: skip
    assert head_gone >= EXIT_S, f"the head's tree took {head_gone:.1f}s, not its {EXIT_S}s"
    for node, comp in RANKS.items():
        assert group.gang(node)["barrier"] == {"arrived": ["n0", "n1"], "released": True}, group.gang(node)
        assert group.h.status(node)["components"][comp]["restarts"] == before[node] + 1, node


def test_the_peer_stops_its_rank_while_the_crashed_heads_own_tree_is_still_dying(group: Group) -> None:
    """kill -9 of the slow head's own API server (n0): n0 asks the next generation as soon as it sees the exit,
    while its orphaned engine still takes EXIT_S to stop after the agent's SIGTERM; n1 stops its rank at once, not
    EXIT_S later, and the barrier still waits for the head's last process. The crashed rank counts one crash, its
    peer one gang restart."""
    h = group.h
    group.serving()
    old, gen = dict(group.watch.alive()), group.gang("n0")["generation"]
    before = {n: group.h.status(n)["components"][c]["restarts_by_cause"] for n, c in RANKS.items()}
    head = {k: s for k, s in old.items() if s.component == RANKS["n0"]}
    peer = {k: s for k, s in old.items() if s.component == RANKS["n1"]}
    assert any(s.title == "VLLM::EngineCore" for s in head.values()), group.watch.timeline(0)
    killed_at = time.monotonic()
    os.kill(int(h.agents["n0"].children()[RANKS["n0"]]["pid"]), signal.SIGKILL)

    wait_for("n1's old rank gone", lambda: all(s.gone is not None for s in peer.values()), EXIT_S + 30, 0.1)
    peer_gone = max(s.gone or 0.0 for s in peer.values()) - killed_at
    assert any(s.gone is None for s in head.values()), (
        f"n1's rank went {peer_gone:.1f}s after the kill, after the head's old tree\n{group.watch.timeline(killed_at)}")
    new = group.next_generation(old, gen, killed_at)
    head_gone = max(s.gone or 0.0 for s in head.values()) - killed_at
    first_new = min(s.first for s in new.values()) - killed_at
    print(f"kill -9 of the head's API server → n1's old rank gone after {peer_gone:.1f}s, the head's old tree after "
          f"{head_gone:.1f}s, the first process of the next generation after {first_new:.1f}s")  # fmt: skip
    assert head_gone >= EXIT_S and peer_gone < head_gone - EXIT_S / 2, (
        f"n1 waited for the head's stop\n{group.watch.timeline(killed_at)}")
    after = {n: group.h.status(n)["components"][c]["restarts_by_cause"] for n, c in RANKS.items()}
    grew = {n: {k: v - before[n].get(k, 0) for k, v in after[n].items() if v != before[n].get(k, 0)} for n in RANKS}
    assert grew == {"n0": {"crash": 1}, "n1": {"gang": 1}}, grew

"""A real vLLM data-parallel group through the agents (issue 16 items 0 and 1): two agents on one machine, one
cluster file, one external-launch group `g` of two ranks — `vllm-dp0` on n0 (the head: it binds the DP RPC port)
and `vllm-dp1` on n1 — each a real CPU `vllm serve` of the tiny random MoE made at test time. Probed with
/health only (a completion fails on this CPU build under DP and takes the whole group down).

What real ranks do that the stand-in never did: a rank whose API server is killed leaves its EngineCore and
Worker running re-parented to PID 1, and that EngineCore ignores SIGTERM; the survivor keeps answering /health
200. So the tests watch every process of the cluster (by the DSV4_AGENT_CLUSTER variable each child inherits)
and fail if any process of an old generation is still alive when a process of the new one appears, on either
node. One group for the module: a rank costs ~70 s and a core to start."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
import realvllm
from cluster_harness import ClusterHarness
from conftest import free_port, wait_for
from etcdserver import EtcdServer
from parallel import HEAVY
from process_watch import ProcessWatch, Seen, assert_no_overlap

pytestmark = [pytest.mark.system, pytest.mark.timeout(600), HEAVY]

RANKS = {"n0": "vllm-dp0", "n1": "vllm-dp1"}


@dataclass
class Group:
    h: ClusterHarness
    watch: ProcessWatch
    ports: dict[str, int]
    up_after_s: float

    def gang(self, node: str) -> dict[str, Any]:
        return self.h.gang(node, "g")

    def main_pid(self, node: str) -> int:
        return int(self.h.agents[node].children()[RANKS[node]]["pid"])

    def healthy(self) -> bool:
        return all(realvllm.health(p) == 200 for p in self.ports.values())

    def wait_serving(self, timeout: float = 300) -> None:
        """Both ranks ready in their agents and answering /health 200."""
        try:
            for node, comp in RANKS.items():
                self.h.wait_states(node, {comp: {"ready"}}, timeout)
            wait_for("both ranks /health 200", self.healthy, 60, 0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.h.log_tails(60)}") from None


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory, etcd: EtcdServer) -> Iterator[Group]:
    why = realvllm.missing()
    if why is not None:
        pytest.skip(f"no real CPU vLLM: {why}")
    home = tmp_path_factory.mktemp("realdp")
    model = realvllm.make_model(home / "tiny-moe")
    h = ClusterHarness(home, etcd.endpoint, list(RANKS), ttl_s=3.0, heartbeat_s=5.0)
    realvllm.dp_group(h, model, free_port())
    ports = {n: h.node(n)["components"]["vllm"]["port"] for n in RANKS}
    watch = ProcessWatch(h.cluster_name).start()
    try:
        began = time.monotonic()
        h.start()
        g = Group(h, watch, ports, 0.0)
        g.wait_serving()
        g.up_after_s = time.monotonic() - began
        print(f"\ncold start: both ranks /health 200 after {g.up_after_s:.1f}s")
        yield g
    finally:
        watch.stop()
        h.cleanup()


def test_cold_start_through_the_barrier_with_real_ranks(group: Group) -> None:
    for node in RANKS:
        g = group.gang(node)
        assert g["generation"] == g["acted"] and g["barrier"] == {"arrived": ["n0", "n1"], "released": True}, g
    assert "every node arrived (n0, n1)" in group.h.agents["n1"].log()
    comps = {s.component for s in group.watch.alive().values()}
    assert comps == set(RANKS.values()), comps

    def metrics(node: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{group.h.api_ports[node]}/metrics", timeout=10) as r:
            return r.read().decode()

    def counted(comp: str, phase: str) -> str:
        return f'dsv4_agent_vllm_start_phase_seconds_count{{component="{comp}",phase="{phase}"}} 1.0'

    for node, comp in RANKS.items():  # issue 32: each phase of a real vLLM start, from its own lines, exported
        # recorded by the watch's next look after the rank turned ready (every 0.5 s), not at the same instant
        wait_for(f"{comp}'s start phases exported", lambda n=node, c=comp: counted(c, "ready") in metrics(n), 15, 0.25)
        text = metrics(node)
        for phase in ("imports", "weights", "kv_cache", "api", "ready"):
            assert counted(comp, phase) in text, (
                phase, [line for line in text.splitlines() if "start_phase_seconds_count" in line])  # fmt: skip
        seen = group.h.status(node)["start_phases"][comp]["run"]["seconds"]
        assert "graphs" not in seen and seen["weights"] < 60, seen  # --enforce-eager: no compile, no graphs on CPU


def vllm_process(group: Group, node: str, title: str) -> int:
    """The PID of the process titled `title` (`VLLM::DPCoordinator`) in that rank's session."""
    sid = int(group.h.agents[node].children()[RANKS[node]]["sid"])
    (pid,) = [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0] == title
              and os.getsid(p.pid) == sid]  # fmt: skip
    return pid


def engine_core(group: Group, node: str) -> int:
    return vllm_process(group, node, f"VLLM::EngineCore_DP{node[1:]}")


def restarts(group: Group) -> dict[str, int]:
    return {n: group.h.status(n)["components"][c]["restarts"] for n, c in RANKS.items()}


@dataclass
class Fault:
    """The cluster just before a fault: its processes, the group's generation and each rank's restarts."""

    old: dict[tuple[int, float], Seen]
    gen: int
    before: dict[str, int]
    at: float

    @classmethod
    def begin(cls, group: Group) -> Fault:
        return cls(dict(group.watch.alive()), group.gang("n0")["generation"], restarts(group), time.monotonic())

    def wait_generation(self, group: Group, timeout: float) -> None:
        wait_for("generation +1 on both", lambda: all(group.gang(n)["acted"] == self.gen + 1 for n in RANKS),
                 timeout, 0.5)  # fmt: skip

    def took(self) -> str:
        return f"{time.monotonic() - self.at:.1f}s"

    def one_generation(self, group: Group) -> None:
        """Exactly one new generation, acted on once per node, each rank restarted once, and no process of it
        started on either node before every process of the old trees was gone."""
        new = assert_no_overlap(group.watch, self.old, self.at, group.h.log_tails(40))
        timeline = f"processes (seconds from the kill):\n{group.watch.timeline(self.at)}\n{group.h.log_tails(40)}"
        gen = self.gen + 1
        for node, comp in RANKS.items():
            g = group.gang(node)
            assert (g["generation"], g["acted"]) == (gen, gen), f"{node}: {g}\n{timeline}"
            assert group.h.agents[node].log().count(f"group g generation {gen} (") == 1, "acted on exactly once"
            assert group.h.status(node)["components"][comp]["restarts"] == self.before[node] + 1, f"{node}\n{timeline}"
        mains = [s for s in new.values() if s.gone is None and "--port" in s.name]  # the API servers
        assert sorted(s.component for s in mains) == sorted(RANKS.values()), f"one API server per rank\n{timeline}"


def test_a_killed_api_server_restarts_the_group_once_after_every_old_process_is_gone(group: Group) -> None:
    """kill -9 of rank 1's API server: its EngineCore_DP1 and Worker_DP1 run on (re-parented, and the
    EngineCore ignores SIGTERM) while rank 0 still answers /health 200 — both ranks restart, once."""
    fault = Fault.begin(group)
    titles = {s.title for s in fault.old.values() if s.component == RANKS["n1"]}
    assert "VLLM::EngineCore_DP1" in titles and any(t.startswith("VLLM::Worker") for t in titles), titles
    os.kill(group.main_pid("n1"), signal.SIGKILL)
    fault.wait_generation(group, 120)
    group.wait_serving()
    print(f"kill -9 of rank 1's API server → both /health 200 again after {fault.took()}")
    fault.one_generation(group)


def test_a_hung_head_is_found_by_its_liveness_and_its_stopped_tree_is_gone_before_the_relaunch(group: Group) -> None:
    """SIGSTOP of rank 0's API server (the group's head: a hang, not a death): /health stops answering, liveness
    fails, one generation; the stopped tree (SIGCONT, then SIGKILL) and rank 1's are gone before either relaunch."""
    fault = Fault.begin(group)
    os.kill(group.main_pid("n0"), signal.SIGSTOP)
    fault.wait_generation(group, 180)
    group.wait_serving()
    print(f"SIGSTOP of rank 0's API server → both /health 200 again after {fault.took()}")
    fault.one_generation(group)


def test_a_killed_dp_coordinator_that_vllm_never_notices_restarts_the_group_once(group: Group) -> None:
    """kill -9 of rank 0's `VLLM::DPCoordinator`: real vLLM notices nothing (both ranks answer /health 200 for
    90 s and more, measured) although the group can no longer run a wave; the agent watches the rank's vLLM
    processes (`tree_watch`) — one generation, both ranks restarted once."""
    coordinator = vllm_process(group, "n0", "VLLM::DPCoordinator")
    fault = Fault.begin(group)
    os.kill(coordinator, signal.SIGKILL)
    fault.wait_generation(group, 60)
    print(f"kill -9 of the DPCoordinator → generation {fault.gen + 1} after {fault.took()}")
    group.wait_serving()
    assert f"VLLM::DPCoordinator (pid {coordinator}) exited" in group.h.agents["n0"].log()
    fault.one_generation(group)


def test_a_stopped_engine_core_is_a_hang_found_by_the_tree_watch(group: Group) -> None:
    """SIGSTOP of rank 1's `VLLM::EngineCore_DP1` (a hung engine, its API server fine): vLLM's /health stays 200
    on both ranks; the agent sees the process stopped for 10 s — one generation, the stopped tree gone."""
    engine = engine_core(group, "n1")
    fault = Fault.begin(group)
    os.kill(engine, signal.SIGSTOP)
    time.sleep(5)
    seen = {n: realvllm.health(p) for n, p in group.ports.items()}
    fault.wait_generation(group, 90)
    print(f"SIGSTOP of EngineCore_DP1 (/health 5 s later: {seen}) → generation {fault.gen + 1} after {fault.took()}")
    group.wait_serving()
    assert f"VLLM::EngineCore_DP1 (pid {engine}) stopped for" in group.h.agents["n1"].log()
    fault.one_generation(group)


def test_a_killed_engine_core_of_the_survivor_and_an_agent_killed_while_its_rank_restarts(group: Group) -> None:
    """kill -9 of rank 0's EngineCore alone (its API server is left to notice), then, while the group
    restarts, kill -9 of n1's agent as its new rank loads, long enough for its member key to expire: the next
    agent adopts that rank, and nobody starts another generation."""
    fault = Fault.begin(group)
    old_pid = group.main_pid("n1")
    os.kill(engine_core(group, "n0"), signal.SIGKILL)
    fault.wait_generation(group, 120)

    def loading() -> int | None:
        rec = group.h.agents["n1"].children().get(RANKS["n1"])
        state = group.h.agents["n1"].states().get(RANKS["n1"])
        return int(rec["pid"]) if rec and int(rec["pid"]) != old_pid and state == "starting" else None

    pid = wait_for("n1's new rank loading", loading, 120, 0.2)
    group.h.kill("n1")
    group.h.wait_members("n0", {"n0"}, timeout=30)  # n1's member key is gone too: its rank loads on, unwatched
    group.h.start("n1")
    group.wait_serving()
    print(f"kill -9 of rank 0's EngineCore → both /health 200 again after {fault.took()}")
    assert group.main_pid("n1") == pid, "the new agent adopted the loading rank"
    assert f"adopted running pid {pid}" in group.h.agents["n1"].log()
    fault.one_generation(group)

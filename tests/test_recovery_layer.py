"""The ladder past node redeploy carried out (`nodeagent.layers.chip_reset`) with the cluster layer around it, without
processes: the real NpuMonitor and HealthEvaluator over in-memory NPU tools (a table of chips, a reset that heals
them or not), the real Coordinator, Membership, ProxySync and RecoveryFollower on the FakeStore and fake stacks
(tests/cluster_fakes.py), one virtual clock — so the 20 s settle and the 30 s pauses cost nothing. Every rung is
shown taken and not taken: a chip reset (drain → stop → idle → reset → settle → verify → start), no reset for a
mild fault or under an external resetter, isolation after the budget, isolation for SeparateNPU, uncordon."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from cluster_fakes import World

from nodeagent.cluster.reset_drain import RecoveryFollower
from nodeagent.core.failure import Failure
from nodeagent.layers.chip_reset import NodeRecovery, NotIsolated
from nodeagent.npu.hbm_baseline import baseline_path, read_baseline, write_baseline
from nodeagent.npu.health import HealthPolicy
from nodeagent.npu.monitor import NpuMonitor
from nodeagent.npu.tools import NpuChip, NpuInfo, NpuProcess, NpuSnapshot
from nodeagent.seam.stackport import HoldKind

NODES = ["n0", "n1", "n2"]
GROUPS = [{"name": "p0", "kind": "prefill", "nodes": ["n0", "n1"], "data_parallel_rpc_port": 43000},
          {"name": "d0", "kind": "decode", "nodes": ["n2"]}]  # fmt: skip


class FakeTools:
    """`NpuTools` as the monitor and the ladder use it: a chip table (`health` per NPU) and the reset command."""

    missing = None

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.health = dict.fromkeys(range(8), "OK")
        self.hbm = dict.fromkeys(range(8), 3162)
        self.resets: list[int] = []
        self.heals = True
        self.busy: Callable[[], bool] = lambda: False
        """While true, a process holds every chip (the node's vLLM ranks), as npu-smi's process table lists it."""
        self.after_reset: dict[int, int] = {}
        """HBM use (MB) per chip once reset: device memory a reset did not give back."""

    async def snapshot(self, detail: bool = False, roce: bool = True) -> NpuSnapshot:
        chips = tuple(NpuChip(n, 0, "910B3", h, hbm_used_mb=self.hbm[n], hbm_total_mb=65536)
                      for n, h in self.health.items())  # fmt: skip
        procs = tuple(NpuProcess(n, 0, 4000 + n, "python3", 50000) for n in self.health) if self.busy() else ()
        return NpuSnapshot(self.clock.time(), NpuInfo("24.1.rc2", chips, procs))

    async def info_text(self) -> str:
        return "npu-smi 24.1.rc2 (the fake's table)"

    async def reset(self, argv: list[str]) -> str:
        self.resets.append(int(argv[argv.index("-i") + 1]))
        if self.heals:
            self.health = dict.fromkeys(self.health, "OK")
        self.hbm.update(self.after_reset)
        return ("        Status                         : OK\n"
                "        Message                        : Reset card successfully.")


class Ladder:
    def __init__(self, world: World, node: str, resetter: str | None = None,
                 busy: Callable[[], bool] | None = None) -> None:  # fmt: skip
        agent = world.agents[node]
        self.stack = agent.stack
        self.tools = FakeTools(world.clock)
        if busy is not None:
            self.tools.busy = busy
        self.npu = NpuMonitor(self.tools, HealthPolicy(expected_npus=8), clock=world.clock.monotonic,  # type: ignore[arg-type]
                              wall=world.clock.time, events=self.stack.events)  # fmt: skip
        self.redeploys: list[float] = []
        self.rec = NodeRecovery(self.stack.config, self.stack, self.npu, changed=self.stack.notify,  # type: ignore[arg-type]
                                redeploy_times=lambda: self.redeploys, clock=world.clock,
                                resetter=lambda: resetter)  # fmt: skip
        self.stack.attach(self.rec)
        self.stack.attach(RecoveryFollower(agent.coordinator, self.stack))  # type: ignore[arg-type]
        world.agents[node].coordinator.spawn(self.rec.run())

    async def chips(self, **health: str) -> None:
        self.tools.health.update({int(k.removeprefix("npu")): v for k, v in health.items()})
        await self.npu.poll()

    def events(self, kind: str) -> list[dict[str, Any]]:
        return self.stack.events_of(kind)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path / "w", NODES, GROUPS, proxy=True)
    w.start()
    await w.until("every component up", w.all_up, within=120)
    yield w
    await w.close()


def starts(world: World) -> dict[str, int]:
    return {n: s.started("vllm") for n, s in world.stacks.items()}


async def test_an_alarm_resets_the_chips_as_a_whole_node_event(world: World) -> None:
    ladder = Ladder(world, "n1")
    await world.until("the proxy ready", lambda: world.stacks["n0"].components["proxy"].ready)
    await ladder.chips(npu3="Alarm")  # RestartNPU: reset at once
    await world.until("the reset done", lambda: ladder.events("npu_reset_done"), 120)
    assert ladder.tools.resets == [3], "the reset command on the faulty chip only (all eight reset with it)"
    steps = [e["message"].split(":")[0] for e in ladder.events("npu_reset_step")]
    assert steps == ["drain_groups", "stop", "wait_idle", "reset", "settle", "verify", "start"]
    await world.until("every rank up again", world.all_up, 120)
    assert starts(world) == {"n0": 2, "n1": 2, "n2": 1}, "p0 restarted once on both nodes, d0 untouched"
    gs = world.gang("n0", "p0")
    assert gs.record is not None and gs.record.generation == 2 and "n1 resetting" in gs.record.reason
    assert world.stacks["n1"].restarts[0][0] == "vllm" and world.stacks["n1"].restarts[0][2] is True
    settle = next(s for s in ladder.rec.steps if s["step"] == "settle")
    assert settle["detail"] == "waited 20s"
    status = ladder.rec.status()
    assert status["resets_last_hour"] == dict.fromkeys(range(8), 1) and status["last_reset"]["verified"] is True
    assert ladder.rec.view() is None and not ladder.npu.faults
    await world.until("the post-mortem bundle", lambda: ladder.events("postmortem"), 30)
    assert "(npu_reset)" in ladder.events("postmortem")[0]["message"]
    assert list((ladder.stack.config.agent.state_dir / "postmortem" / "node").glob("*.tar*"))
    assert read_baseline(baseline_path(ladder.stack.config.agent.state_dir)) == dict.fromkeys(range(8), 3162), \
        "the idle chips the ladder saw are kept on disk, for the next agent"


@pytest.mark.parametrize("known", ["on disk", "none", "beside what the ladder saw"])
async def test_after_an_agent_restart_the_reset_is_verified_against_the_baseline_on_disk(world: World,
                                                                                        known: str) -> None:
    """The agent restarted beside running ranks: the chips are never idle while it watches, so only the baseline
    kept on disk (a former agent's, the clean-slate wait's) can judge the HBM after the reset. Known: a chip whose
    memory the reset did not give back fails the verify. Unknown: the verify says the HBM was not checked. The
    ladder's own idle readings (npu 3 in Alarm is not one) are merged into the file, never written over it."""
    n1 = world.stacks["n1"]
    path = baseline_path(n1.config.agent.state_dir)
    path.unlink(missing_ok=True)
    if known == "on disk":
        write_baseline(path, dict.fromkeys(range(8), 3162))
    busy = (lambda: False) if known == "beside what the ladder saw" else (lambda: n1.components["vllm"].running)
    ladder = Ladder(world, "n1", busy=busy)
    if known == "beside what the ladder saw":  # the clean-slate wait before a vLLM start, after the agent began
        write_baseline(path, dict.fromkeys(range(8), 3162))
    ladder.tools.after_reset = {3: 60000}
    await ladder.chips(npu3="Alarm")
    await world.until("the reset's verify", lambda: any(s["step"] == "verify" for s in ladder.rec.steps), 120)
    verify = next(s for s in ladder.rec.steps if s["step"] == "verify")
    if known != "none":
        assert not verify["ok"] and verify["detail"] == "npu 3 HBM 60000 MB > baseline 3162 MB", verify
        assert "chip reset failed at verify: npu 3 HBM 60000 MB" in ladder.events("npu_reset_failed")[0]["message"]
    else:
        assert verify["ok"], verify
        assert verify["detail"].startswith("all chips OK; HBM NOT CHECKED: no idle baseline known for npu 0-7"), verify
        assert "HBM NOT CHECKED" in ladder.events("npu_reset_done")[0]["message"]


async def test_a_mild_fault_or_an_external_resetter_resets_nothing(world: World) -> None:
    mild = Ladder(world, "n1")
    await mild.chips(npu2="Warning")  # SubHealthFault: the service restart is the cure, not a reset
    other = Ladder(world, "n2", resetter="MindCluster Container Manager (container-manager run)")
    await other.chips(npu0="Alarm")
    await world.advance(300)
    assert mild.tools.resets == [] and other.tools.resets == []
    assert not mild.events("npu_reset") and not other.events("npu_reset")
    skipped = other.events("npu_reset_skipped")
    assert len(skipped) == 1
    assert "Container Manager (container-manager run) resets chips on this host; never both" in skipped[0]["message"]
    assert starts(world) == dict.fromkeys(NODES, 1)


async def test_a_failed_reset_is_judged_again_on_the_chips_as_they_are(world: World) -> None:
    """The simulation's finding (seed 760012 and ten more, `tests/test_sim_npu.py`): a reset that failed its verify
    left a pseudo-fault (`unverified`) that drove the next rungs on its own — the chip replaced meanwhile (or back
    late), the ladder reset healthy chips again and isolated a node whose chips read OK. The next rung looks first."""
    ladder = Ladder(world, "n1")
    ladder.tools.heals = False
    await world.until("the proxy ready", lambda: world.stacks["n0"].components["proxy"].ready)
    await ladder.chips(npu0="Alarm")
    await world.until("the reset failed its verify", lambda: ladder.events("npu_reset_failed"), 120)
    assert ladder.rec.unverified is not None and ladder.tools.resets == [0]
    ladder.tools.health[0] = "OK"  # the operator replaced the card during the pause; no poll has seen it yet
    await world.until("every rank up again", world.all_up, 300)
    assert ladder.tools.resets == [0], "no second reset of chips that read OK"
    assert ladder.rec.state.isolated is None and ladder.rec.unverified is None and ladder.rec.view() is None
    (done,) = ladder.events("npu_reset_done")
    assert "read OK after the failed reset" in done["message"], done
    await world.advance(600)
    assert ladder.tools.resets == [0] and ladder.rec.state.isolated is None


async def test_resets_that_do_not_help_end_in_isolation_until_uncordon(world: World) -> None:
    ladder = Ladder(world, "n1")
    ladder.tools.heals = False  # the chip stays in Alarm whatever the reset does
    await world.until("the proxy ready", lambda: world.stacks["n0"].components["proxy"].ready)
    await ladder.chips(npu0="Alarm")
    await world.until("the node isolated", lambda: ladder.rec.state.isolated, 900)
    assert ladder.tools.resets == [0, 0, 0], "three resets of the chip within the hour, then no more"
    assert len(ladder.events("npu_reset_failed")) == 3
    at = [r.at for r in ladder.rec.state.resets]
    gaps = [b - a for a, b in itertools.pairwise(at)]
    assert len(gaps) == 2 and all(g >= 20 + 30 - 1e-3 for g in gaps), f"settle, then a pause, after each reset: {gaps}"
    assert "3 resets of npu 0 within 1 h did not help" in ladder.rec.state.isolated
    isolated = ladder.events("node_isolated")
    assert len(isolated) == 1 and isolated[0]["level"] == "critical"
    n1 = world.stacks["n1"]
    await world.until("n1 held", lambda: n1.components["vllm"].hold is not None
                      and n1.components["vllm"].hold.kind == HoldKind.ISOLATED)  # fmt: skip
    assert n1.status()["isolated"] == ladder.rec.state.isolated
    await world.until("n1's member record says isolated",
                      lambda: (world.agents["n0"].membership.members["n1"].record or {}).get("isolated"))
    sync = world.agents["n0"].coordinator.proxies[0]
    await world.until("p0 out of the proxy", lambda: "isolated" in sync.health.get("p0", ""), 30)
    await world.advance(600)
    assert not n1.components["vllm"].running, "isolated: stays out"
    assert ladder.tools.resets == [0, 0, 0]

    ladder.tools.health[0] = "OK"  # the operator replaced the card
    await ladder.npu.poll()
    assert ladder.rec.uncordon("operator (test)").startswith("npu 0 health Alarm")
    with pytest.raises(NotIsolated):
        ladder.rec.uncordon()
    await world.until("every rank up again", world.all_up, 300)
    await world.until("p0 back in the proxy", lambda: sync.health.get("p0") == "", 60)
    assert ladder.events("node_uncordoned")


async def test_a_separate_npu_fault_isolates_at_once_without_a_reset(world: World) -> None:
    ladder = Ladder(world, "n1")
    await ladder.chips(npu5="Critical")  # SeparateNPU: never reset
    await world.until("the node isolated", lambda: ladder.rec.state.isolated, 60)
    assert ladder.tools.resets == []
    assert "SeparateNPU: never reset" in ladder.rec.state.isolated
    await world.advance(120)
    n0 = world.stacks["n0"].components["vllm"]
    assert n0.hold is not None and n0.hold.kind == HoldKind.BARRIER, "n0's rank waits for its group"
    assert world.stacks["n1"].components["vllm"].hold.kind == HoldKind.ISOLATED  # type: ignore[union-attr]
    assert world.gang("n0", "p0").arrivals == {"n0"}, "the isolated node never arrives at the barrier"


async def test_failed_redeploys_with_an_npu_cause_reset_and_other_causes_do_not(world: World) -> None:
    ladder = Ladder(world, "n1")
    view = ladder.stack.component("vllm")
    oom = Failure("exit", "exit 1", code=1, output_tail=("torch.OutOfMemoryError: CUDA out of memory",), uptime_s=60)
    for _ in range(2):
        ladder.redeploys.append(world.clock.time())
        ladder.rec.decide(view, oom)
        await world.advance(60)
    assert ladder.tools.resets == [] and len(ladder.rec.state.redeploys) == 2

    acl = Failure("exit", "exit 1", code=1, uptime_s=60,
                  output_tail=("RuntimeError: ACL stream synchronize failed, error code:507035",))  # fmt: skip
    for _ in range(2):
        ladder.redeploys.append(world.clock.time())
        ladder.rec.decide(view, acl)
        await world.advance(5)
    await world.until("the reset done", lambda: ladder.events("npu_reset_done"), 120)
    assert ladder.tools.resets == [0]
    assert "2 node redeploys in a row failed with an NPU error" in ladder.events("npu_reset")[0]["message"]


def test_the_fake_npu_smi_reset_answers_through_the_facade(tmp_path: Path) -> None:
    """`NpuTools.reset` against the fake npu-smi (the npu-smi reference's prompt and Status lines; the refusal
    while a process holds a chip is ours): OK clears the Alarm of every chip; busy raises."""
    import asyncio

    from ascend_fake import FakeAscend

    from nodeagent.layers.reset_ladder import reset_command
    from nodeagent.npu.tools import NpuToolError

    fake = FakeAscend(tmp_path, "doc-alarm-then-reset")
    tools = fake.tools()
    out = asyncio.run(tools.reset(reset_command(3)))
    assert "Reset card successfully." in out
    assert all(c.health == "OK" for c in asyncio.run(tools.info()).chips)
    fake.set({**fake.data, "processes": [{"npu": 1, "pid": 4242, "name": "python3", "memory_mb": 3000}]})
    with pytest.raises(NpuToolError, match="Status : Fail; Message : device is busy"):
        asyncio.run(tools.reset(reset_command(1)))



MEMINFO = """MemTotal:       1056000000 kB
MemAvailable:   {available} kB
HugePages_Total:   260000
HugePages_Free:    {huge_free}
Hugepagesize:       2048 kB
"""  # the keys and units of Linux's /proc/meminfo (fs/proc/meminfo.c)


def test_headroom_with_and_without_huge_pages() -> None:
    from nodeagent.layers.worker_headroom import headroom

    dead_still_mapped = MEMINFO.format(available=600_000_000, huge_free=10_000)  # 20,000 MB of huge pages free
    assert headroom(dead_still_mapped, 500_000, huge_pages=True, margin_mb=4096).short
    released = MEMINFO.format(available=600_000_000, huge_free=260_000)
    room = headroom(released, 500_000, huge_pages=True, margin_mb=4096)
    assert not room.short and room.detail.startswith("520000 MB of huge pages free")
    assert not headroom(dead_still_mapped, 500_000, huge_pages=False, margin_mb=4096).short, "filled as used"
    assert headroom(MEMINFO.format(available=1_000_000, huge_free=0), 500_000, False, 4096).short


@pytest.mark.parametrize("short", [True, False])
async def test_a_killed_worker_restarts_with_its_vllm_ranks_only_when_memory_is_short(world: World,
                                                                                      short: bool) -> None:
    from nodeagent.layers.worker_headroom import WorkerHeadroom

    stack = world.stacks["n2"]
    available = 1_000_000 if short else 600_000_000
    stack.attach(WorkerHeadroom(stack.config, stack,
                                read=lambda: MEMINFO.format(available=available, huge_free=0)))  # type: ignore[arg-type]
    stack.components["vllm"].stop_s = 20.0  # the ranks take their time to let go
    verdict = stack.crash("datasystem", "killed by SIGKILL")
    if short:
        assert verdict is not None and "the worker restarts with vllm as one step" in verdict
        await world.until("the worker held", lambda: stack.components["datasystem"].hold is not None
                          and stack.components["datasystem"].hold.kind == HoldKind.MEMORY_HEADROOM)  # fmt: skip
        await world.until("the worker started again", lambda: stack.started("datasystem") == 2, 60)
        vllm = stack.components["vllm"]
        assert stack.components["datasystem"].starts[1] >= vllm.gone[-1], "the worker starts once the ranks let go"
        assert [r[0] for r in stack.restarts] == ["vllm"]
    else:
        assert verdict is None
        await world.until("the worker started again", lambda: stack.started("datasystem") == 2, 60)
        assert stack.restarts == [] and stack.started("vllm") == 1, "the worker restarts alone"
    await world.until("everything up", world.all_up, 120)

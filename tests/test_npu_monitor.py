"""The NPU monitor shell, the `npu` probe kind, its config, events and metrics — against the fake executables."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ascend_fake import FAKE_BIN, FakeAscend
from prometheus_client import CollectorRegistry, generate_latest

from nodeagent.api.metrics import _NpuCollector
from nodeagent.config.base import replace
from nodeagent.config.load import load_config
from nodeagent.core.errors import ConfigError
from nodeagent.core.events import EventBus
from nodeagent.npu.health import HealthPolicy
from nodeagent.npu.monitor import NpuMonitor, expected_npus, our_pids
from nodeagent.npu.tools import NpuTools
from nodeagent.probes.kinds import ProbeContext, resolve_probe

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def monitor(fake: FakeAscend, clock: Clock, events: EventBus | None = None, ours: Any = None,
            roce: bool = False) -> NpuMonitor:  # fmt: skip
    return NpuMonitor(fake.tools(roce), HealthPolicy(expected_npus=8), period_s=10, detail_every=1, roce=roce,
                      ours=ours or (lambda: set()), events=events, clock=clock)  # fmt: skip


async def test_fault_holds_start_emits_events_and_clears(tmp_path: Path) -> None:
    fake, clock, bus = FakeAscend(tmp_path, "doc-critical-chip"), Clock(), EventBus()
    mon = monitor(fake, clock, bus)
    decision = await mon.may_start_vllm()
    assert not decision.allowed and decision.reasons[0].startswith("npu 3 health Critical")
    (event,) = [e for e in bus.recent if e.event == "npu_fault"]
    assert event.level == "error" and event.data["npu"] == 3 and event.data["fault_level"] == "SeparateNPU"
    assert "holds vLLM starts" in event.message
    ok, detail, skipped = await mon.check()
    assert (ok, skipped) == (False, False) and detail.startswith("npu 3 health Critical")
    polls = mon.polls
    await mon.may_start_vllm()
    assert mon.polls == polls, "younger than a period: no new poll"

    fake.set("doc-healthy-a2")
    clock.now += 10
    assert (await mon.may_start_vllm()).allowed
    assert [e.event for e in bus.recent][-1] == "npu_fault_cleared"
    ok, detail, _ = await mon.check()
    assert ok and detail == "8 NPUs healthy, no fault holding vLLM"
    status = mon.status()
    assert status["checked"] and status["start"] == {"allowed": True, "reasons": []}
    assert status["npus"][0] == {"npu": 0, "chip": 0, "name": "910B3", "health": "OK", "hbm_used_mb": 3162,
                                 "hbm_total_mb": 65536, "link": None}  # fmt: skip


async def test_a_poll_begun_after_the_call_never_answers_with_a_reading_from_before(tmp_path: Path) -> None:
    """An uncordon judges the chips as they are now: a poll already under way read them before the operator fixed
    them. A plain poll shares it (one npu-smi at a time); `begun_after_call` waits it out and reads again."""
    fake, clock = FakeAscend(tmp_path, "doc-critical-chip"), Clock()
    mon = monitor(fake, clock)
    read, release = asyncio.Event(), asyncio.Event()
    real = mon.tools.snapshot

    async def slow_snapshot(**kwargs: Any) -> Any:
        snap = await real(**kwargs)
        read.set()
        await release.wait()  # the reading is taken; its answer is late (a loaded host)
        return snap

    mon.tools.snapshot = slow_snapshot  # type: ignore[method-assign]
    stale = asyncio.ensure_future(mon.poll())
    await read.wait()
    fake.set("doc-healthy-a2")  # the operator replaced the chip
    shared = asyncio.ensure_future(mon.poll())
    now = asyncio.ensure_future(mon.poll(begun_after_call=True))
    release.set()
    assert (await stale) is (await shared), "a plain poll shares the one under way"
    mon.tools.snapshot = real  # type: ignore[method-assign]
    snap = await now
    assert snap is not None and snap is not (await stale) and mon.faults == [], mon.faults
    assert mon.polls == 2


async def test_override_lets_the_start_through_and_says_so(tmp_path: Path) -> None:
    fake, clock, bus = FakeAscend(tmp_path, "doc-link-down"), Clock(), EventBus()
    mon = monitor(fake, clock, bus, roce=True)
    for _ in range(5):
        await mon.poll()
        clock.now += 10
    held = mon.decision()
    assert not held.allowed and held.reasons == ("npu 5 RoCE link down for 30s",)
    pokes: list[int] = []
    mon.on_change.append(lambda: pokes.append(1))

    class Comp:
        kind = "vllm"

    assert mon.start_gate(Comp(), operator=True) == "hardware: npu 5 RoCE link down for 30s"
    Comp.kind = "datasystem"
    assert mon.start_gate(Comp()) is None, "only vLLM waits on NPUs"
    (fault,) = mon.override(by="nodeagentctl")
    assert fault.npu == 5 and mon.decision().allowed and pokes == [1]
    assert bus.recent[-1].event == "npu_override" and "nodeagentctl overrode: npu 5 RoCE link" in bus.recent[-1].message


async def test_foreign_process_against_our_real_process_tree(tmp_path: Path) -> None:
    """Ours = the PIDs of a component's process tree (here: a real child); anything else on an NPU holds."""
    from nodeagent.core.process import record_of

    ours_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record = record_of(ours_proc.pid)
        fake = FakeAscend(tmp_path, {"npus": 8, "processes": [
            {"npu": 0, "pid": ours_proc.pid, "name": "VLLM::Worker_TP0", "memory_mb": 60000},
            {"npu": 4, "pid": stranger.pid, "name": "python3", "memory_mb": 30210}]})  # fmt: skip
        mon = monitor(fake, Clock(), ours=lambda: our_pids([record]))
        decision = await mon.may_start_vllm()
        assert decision.reasons == (f"npu 4 held by pid {stranger.pid} python3 (30210 MB), not ours",)
    finally:
        for proc in (ours_proc, stranger):
            proc.kill()
            proc.wait()


async def test_without_npu_smi_everything_is_skip_never_an_error(tmp_path: Path) -> None:
    mon = NpuMonitor(NpuTools.locate(bin_dir=tmp_path), HealthPolicy(expected_npus=8))
    decision = await mon.may_start_vllm()
    assert decision.allowed and not decision.checked and "npu-smi not found" in decision.reasons[0]
    assert await mon.check() == (True, f"skipped: npu-smi not found (PATH, {'/usr/local/bin/npu-smi'})", True)
    await mon.run()  # returns at once: nothing to watch
    registry = CollectorRegistry()
    registry.register(_NpuCollector(mon))
    text = generate_latest(registry).decode()
    assert "dsv4_npu_checked 0.0" in text and "dsv4_npu_fault" not in text


async def test_metrics_of_a_sick_host(tmp_path: Path) -> None:
    fake = FakeAscend(tmp_path, {"npus": 8, "chips": {"3": {"health": "Critical"}}, "links": {"5": "DOWN"},
                                 "processes": [{"npu": 1, "pid": 1, "name": "init", "memory_mb": 5}]})  # fmt: skip
    mon = monitor(fake, Clock(), roce=True)
    await mon.poll()
    registry = CollectorRegistry()
    registry.register(_NpuCollector(mon))
    text = generate_latest(registry).decode()
    for line in ('dsv4_npu_checked 1.0', 'dsv4_npu_start_held 1.0', 'dsv4_npu_visible 8.0',
                 'dsv4_npu_fault{level="SeparateNPU",npu="3",overridden="false",what="health"} 1.0',
                 'dsv4_npu_fault{level="PreSeparateNPU",npu="1",overridden="false",what="process"} 1.0',
                 'dsv4_npu_faults_total{level="SeparateNPU",what="health"} 1.0',
                 'dsv4_npu_healthy{chip="0",npu="3"} 0.0', 'dsv4_npu_roce_link_up{npu="5"} 0.0',
                 'dsv4_npu_hbm_total_bytes{chip="0",npu="0"} 6.8719476736e+10',
                 'dsv4_npu_processes{npu="1"} 1.0'):  # fmt: skip
        assert line in text, line


def vllm_with(probes: dict[str, Any], **node: Any) -> dict[str, Any]:
    return {
        "node": {"name": "n", "ip": "127.0.0.1", **node},
        "agent": {"state_dir": "/tmp/x", "log_dir": "/tmp/y"},
        "components": {"vllm": {"kind": "vllm", "command": "vllm", "model": "/m", "probes": probes}},
    }


def load(tmp_path: Path, data: dict[str, Any]) -> Any:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_config(path)


async def test_npu_probe_kind_in_a_role_and_the_node_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAscend(tmp_path / "fake", "doc-critical-chip")
    monkeypatch.setenv("ASCEND_FAKE_SCENARIO", str(fake.path))
    monkeypatch.setenv("ASCEND_FAKE_STATE", str(fake.state))
    npu = {"kind": "npu", "npu_smi": str(FAKE_BIN / "npu-smi"), "roce": False}
    cfg = load(tmp_path, vllm_with({"readiness": [{"kind": "http"}, npu]}))
    spec = cfg.components["vllm"].probes.readiness[1]
    probe = resolve_probe(spec, cfg.components["vllm"], cfg)
    assert (probe.kind, probe.expected_npus, spec.failure_threshold, spec.period_s) == ("npu", 8, 1, 10)
    ctx = ProbeContext()
    result = await ctx.run(probe)
    assert not result.ok and not result.skipped and result.detail.startswith("npu 3 health Critical")
    assert ctx.npu is not None and (await ctx.run(probe)).kind == "npu", "the monitor is shared, created once"

    shared = NpuMonitor.from_config(cfg)
    assert shared.policy.expected_npus == 8 and shared.period_s == 10 and shared.detail_every == 6
    tuned = load(tmp_path, vllm_with({}, npus=16, npu_health={"period_s": 5, "hold_level": "SeparateNPU"}))
    assert tuned.node.npu_health.period_s == 5 and tuned.node.npu_health.failure_threshold == 1
    assert NpuMonitor.from_config(tuned).policy.expected_npus == 16


async def test_local_yaml_probe_reports_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("DSV4_AGENT_HOME", str(tmp_path / "home"))
    cfg = load_config(ROOT / "config" / "local.yaml")
    assert expected_npus(cfg) == 0, "local.yaml says node.npus: 0"
    unset = replace(cfg, node=replace(cfg.node, npus=None))
    assert expected_npus(unset) == 2, "no guess from the program's name: the stand-in's TP 2 counts without node.npus"
    assert expected_npus(load_config(ROOT / "config" / "dsv4-flash-a2.yaml")) == 8
    eight = ROOT / "config" / "dsv4-flash-a2-8node.yaml"  # 2 ranks × TP4, 8 ranks × TP1: every NPU
    assert expected_npus(load_config(eight, node="a2-0")) == expected_npus(load_config(eight, node="a2-5")) == 8
    result = await ProbeContext().run(resolve_probe(cfg.node.npu_health, cfg.components["vllm"], cfg))
    if NpuTools.locate().missing is not None:
        assert result.ok and result.skipped and result.detail.startswith("skipped: npu-smi not found")


def test_bad_npu_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"c.yaml:\d+: node.npu_health.hold_level"):
        load(tmp_path, vllm_with({}, npu_health={"hold_level": "Sometimes"}))
    with pytest.raises(ConfigError, match=r"node.npu_health.flap_limt"):
        load(tmp_path, vllm_with({}, npu_health={"flap_limt": 3}))
    with pytest.raises(ConfigError, match=r"node.npus"):
        load(tmp_path, vllm_with({}, npus=-1))


async def test_durations_are_monotonic_and_a_faults_since_is_wall_time(tmp_path: Path) -> None:
    """An NTP step of the wall clock back by an hour: the snapshot still ages (a new poll after a period), and a
    fault's `since` stays the true time ago in the new wall time (what the recovery ladder compares)."""
    fake, mono, wall = FakeAscend(tmp_path, "doc-critical-chip"), Clock(), Clock()
    mono.now = 1000.0
    mon = NpuMonitor(fake.tools(False), HealthPolicy(expected_npus=8), period_s=10, detail_every=1, roce=False,
                     clock=mono, wall=wall)  # fmt: skip
    await mon.poll()
    (fault,) = [f for f in mon.faults if f.what == "health"]
    assert fault.since == wall.now and mon.status()["polled_at"] == wall.now
    wall.now -= 3600
    mono.now += 11
    polls = mon.polls
    await mon.fresh()
    assert mon.polls == polls + 1, "older than a period by the monotonic clock: polled again"
    (fault,) = [f for f in mon.faults if f.what == "health"]
    assert fault.since == wall.now - 11

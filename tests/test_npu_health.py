"""Fault evaluation (pure): levels, debounce and escalation as the Ascend Device Plugin does, with a fake clock."""

from __future__ import annotations

from pathlib import Path

from ascend_fake import FakeAscend

from nodeagent.npu.health import HealthEvaluator, HealthPolicy, Level
from nodeagent.npu.tools import HealthDetail, NpuChip, NpuInfo, NpuProcess, NpuSnapshot

T0 = 1_700_000_000.0


def snap(at: float, health: dict[int, str] | None = None, links: dict[int, str] | None = None,
         ecc: dict[int, int] | None = None, processes: tuple[NpuProcess, ...] = (), npus: int = 8,
         error: str | None = None, detail: dict[int, HealthDetail] | None = None) -> NpuSnapshot:  # fmt: skip
    if error is not None:
        return NpuSnapshot(T0 + at, error=error)
    health = health or {}
    chips = tuple(NpuChip(n, 0, "910B3", health.get(n, "OK"), hbm_used_mb=3162, hbm_total_mb=65536)
                  for n in range(npus))  # fmt: skip
    return NpuSnapshot(
        T0 + at, NpuInfo("24.1.rc2", chips, processes), health=detail or {},
        ecc={n: {"hbm_double": v} for n, v in (ecc or {}).items()},
        links={n: (links or {}).get(n, "UP") for n in range(npus)}, roce_checked=True,
    )  # fmt: skip


def evaluator(**policy: object) -> HealthEvaluator:
    return HealthEvaluator(HealthPolicy(expected_npus=8, **policy))  # type: ignore[arg-type]


def test_healthy_host_has_no_fault() -> None:
    ev = evaluator()
    assert ev.observe(snap(0), ours=set()) == []
    assert ev.start_decision().allowed and ev.faults == []


def test_critical_chip_holds_until_it_is_ok_again() -> None:
    ev = evaluator()
    detail = {3: HealthDetail("Critical", ("80E01801",), "HBM multi-bit ECC error")}
    (change,) = ev.observe(snap(0, {3: "Critical"}, detail=detail))
    assert change.kind == "appeared" and change.fault.level is Level.SeparateNPU
    decision = ev.start_decision()
    assert not decision.allowed
    assert decision.reasons == ("npu 3 health Critical (error code 80E01801: HBM multi-bit ECC error)",)
    assert str(decision).startswith("held: npu 3 health Critical")
    assert ev.observe(snap(10, {3: "Critical"})) == [], "a lasting fault is not announced again"
    assert ev.faults[0].since == T0, "since stays the first sighting"
    (cleared,) = ev.observe(snap(20))
    assert cleared.kind == "cleared" and ev.start_decision().allowed


def test_warning_is_reported_but_does_not_hold_and_alarm_does() -> None:
    ev = evaluator()
    ev.observe(snap(0, {1: "Warning", 2: "Alarm", 4: "Abnormal"}))
    levels = {f.npu: f.level for f in ev.faults}
    assert levels == {1: Level.SubHealthFault, 2: Level.RestartNPU, 4: Level.SubHealthFault}
    assert ev.start_decision().reasons == ("npu 2 health Alarm",)


def test_a_link_down_for_10s_is_ignored_one_that_stays_down_holds() -> None:
    ev = evaluator()
    ev.observe(snap(0))
    ev.observe(snap(5, links={5: "DOWN"}))
    ev.observe(snap(10, links={5: "DOWN"}))
    ev.observe(snap(15))
    assert ev.faults == [] and ev.start_decision().allowed, "down for 10 s: ignored"
    ev.observe(snap(100, links={5: "DOWN"}))
    ev.observe(snap(120, links={5: "DOWN"}))
    assert ev.faults == [], "down for exactly 20 s is still tolerated"
    (appeared,) = ev.observe(snap(121, links={5: "DOWN"}))
    assert appeared.fault.level is Level.PreSeparateNPU and appeared.fault.since == T0 + 100
    assert ev.start_decision().reasons == ("npu 5 RoCE link down for 21s",)
    ev.observe(snap(200))
    assert not ev.start_decision().allowed, "up again, but not for 60 s yet"
    assert "up again for 0s (clears after 60s up)" in ev.faults[0].message
    ev.observe(snap(259))
    assert ev.faults
    (cleared,) = ev.observe(snap(260))
    assert cleared.kind == "cleared" and ev.start_decision().allowed


def test_repeated_flaps_escalate_to_manual_separation_then_release() -> None:
    ev = evaluator(flap_limit=3, flap_window_s=3600, flap_release_s=7200)
    t = 0.0
    for _ in range(2):
        ev.observe(snap(t, links={2: "DOWN"}))
        ev.observe(snap(t + 5))
        t += 600
    assert ev.faults == []
    ev.observe(snap(t, links={2: "DOWN"}))
    (fault,) = ev.faults
    assert fault.what == "link-flaps" and fault.level is Level.ManuallySeparateNPU
    assert fault.message == "npu 2 RoCE link went down 3 times within 1 h"
    ev.observe(snap(t + 5))
    ev.observe(snap(t + 7000))
    assert ev.faults, "sticky: the window passing does not clear it"
    ev.observe(snap(t + 7201))
    assert ev.faults == [], "released after flap_release_s without a new flap"


def test_ecc_rise_restarts_business_twice_separates_and_override_releases() -> None:
    ev = evaluator(ecc_quiet_s=300)
    ev.observe(snap(0, ecc={2: 4}))
    assert ev.faults == [], "the first count is the baseline, however high"
    ev.observe(snap(60, ecc={2: 5}))
    (fault,) = ev.faults
    assert (fault.level, fault.message) == (Level.RestartBusiness, "npu 2 HBM double-bit ECC errors 4 → 5")
    assert ev.start_decision().allowed, "a vLLM restart is the cure for one rise"
    ev.observe(snap(120))  # a fast poll without ECC keeps the fault
    assert ev.faults
    ev.observe(snap(361))
    assert ev.faults == [], "quiet for ecc_quiet_s"
    ev.observe(snap(400, ecc={2: 7}))
    (fault,) = ev.faults
    assert fault.level is Level.ManuallySeparateNPU and "rose 2 times within 24 h (now 7)" in fault.message
    assert not ev.start_decision().allowed
    ev.observe(snap(90000))
    assert ev.faults, "sticky past the window"
    (overridden,) = ev.override(npu=2)
    assert overridden.overridden and ev.start_decision().allowed
    ev.observe(snap(90010, ecc={2: 7}))
    assert ev.faults == []


def test_foreign_visible_process_holds_ours_and_invisible_do_not() -> None:
    ev = evaluator()
    procs = (NpuProcess(0, 0, 100, "VLLM::Worker_TP0", 60000, True),
             NpuProcess(4, 0, 4242, "python3", 30210, True),
             NpuProcess(6, 0, 777, "VLLM::Worker_TP6", 60000, False))  # fmt: skip
    ev.observe(snap(0, processes=procs), ours={100})
    by = {f.npu: f for f in ev.faults}
    assert by[4].level is Level.PreSeparateNPU
    assert by[4].message == "npu 4 held by pid 4242 python3 (30210 MB), not ours"
    assert by[6].level is Level.NotHandleFault and "not visible here" in by[6].message
    assert ev.start_decision().reasons == ("npu 4 held by pid 4242 python3 (30210 MB), not ours",)
    ev.observe(snap(10, processes=procs), ours=None)
    assert ev.faults == [], "without our PIDs the rule is not applied"


def test_missing_npu_and_failing_npu_smi() -> None:
    ev = evaluator(tool_failure_tolerance_s=20)
    ev.observe(snap(0, {1: "Critical"}, npus=7))
    assert {f.what for f in ev.faults} == {"missing", "health"}
    assert "7 of 8 NPUs visible: npu 7 missing" in ev.start_decision().reasons
    ev.observe(snap(10, error="npu-smi info exit 255: dcmi module initialize failed"))
    assert {f.what for f in ev.faults} == {"missing", "health"}, "what npu-smi cannot show now, it showed last"
    ev.observe(snap(31, error="npu-smi info exit 255: dcmi module initialize failed"))
    assert "npu-smi info failing for 21s: npu-smi info exit 255" in ev.start_decision().reasons[-1]
    ev.observe(snap(40))
    assert ev.faults == [] and ev.start_decision().allowed


def test_override_lasts_until_the_fault_clears() -> None:
    ev = evaluator()
    ev.observe(snap(0, {3: "Critical", 5: "Warning"}))
    assert [f.message for f in ev.override()] == ["npu 3 health Critical"], "only holding faults are overridden"
    assert ev.start_decision().allowed
    assert ev.observe(snap(10, {3: "Critical"}))[0].kind == "cleared"  # the Warning went
    assert ev.start_decision().allowed, "still overridden"
    ev.observe(snap(20))
    ev.observe(snap(30, {3: "Critical"}))
    assert not ev.start_decision().allowed, "it came back: holds again"


def test_net_health_is_reported_from_detail_polls_only() -> None:
    ev = evaluator()
    bad = NpuSnapshot(T0, snap(0).info, links={0: "UP"}, net_health={0: "Socket failed", 1: "Init"}, roce_checked=True)
    ev.observe(bad)
    (fault,) = ev.faults
    assert (fault.level, fault.message) == (Level.SubHealthFault, "npu 0 RoCE net health Socket failed")
    ev.observe(snap(10))
    assert ev.faults, "a fast poll does not ask net health: the fault stands"
    ev.observe(NpuSnapshot(T0 + 60, snap(0).info, net_health={0: "Healthy"}, roce_checked=True))
    assert ev.faults == []


async def test_the_fake_scenarios_through_the_facade(tmp_path: Path) -> None:
    """Each preset scenario, polled 5 s apart on a fake clock, gives the verdict the issue asks for."""
    verdicts = {}
    # name: (polls, check RoCE links, read ECC)
    plan = {"doc-healthy-a2": (2, True, True), "doc-critical-chip": (1, False, False),
            "doc-link-flap-10s": (5, True, False), "doc-link-down": (7, True, False),
            "doc-foreign-process": (1, False, False), "doc-ecc-rising": (5, False, True)}
    for name, (polls, roce, ecc) in plan.items():
        fake = FakeAscend(tmp_path / name, name)
        tools, ev = fake.tools(roce=roce), evaluator()
        for step in range(polls):
            shot = await tools.snapshot(detail=ecc)
            ev.observe(shot, ours=set(), now=T0 + 5 * step)
        verdicts[name] = (ev.start_decision().reasons, [f.what for f in ev.faults])
    assert verdicts["doc-healthy-a2"] == ((), [])
    assert verdicts["doc-critical-chip"][0] == (
        "npu 3 health Critical (error code 80E01801: HBM multi-bit ECC error)",)
    assert verdicts["doc-link-flap-10s"] == ((), [])
    assert verdicts["doc-link-down"][0] == ("npu 5 RoCE link down for 25s",)
    assert verdicts["doc-foreign-process"][0] == ("npu 4 held by pid 1 python3 (30210 MB), not ours",)
    assert verdicts["doc-ecc-rising"][0] == ("npu 2 HBM double-bit ECC errors rose 2 times within 24 h (now 2)",)

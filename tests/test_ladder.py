"""The ladder past node redeploy: every trigger taken and not taken on a fake clock, the reset budget, isolation
until uncordon, the reset plan as data, and the fake `npu-smi set -t reset` it will run."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ascend_fake import FAKE_BIN, FakeAscend

from nodeagent.layers.reset_ladder import (
    ChipReset,
    Isolate,
    LadderPolicy,
    LadderState,
    npu_cause,
    reset_command,
    reset_plan,
    verify_after_reset,
)
from nodeagent.npu.health import Fault, Level
from nodeagent.npu.tools import parse_npu_smi_info

T0 = 1_000_000.0
ACL = "RuntimeError: ACL stream synchronize failed, error code:507035"
EZ = ("EZ9999: [PID: 838] 2025-09-04-09:50:11.954.378 The error from device(chipId:6, dieId:0), serial number is 8, "
      "there is an exception of aivec error, core id is 40")
OOM = "RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB"
HCCL_TIMEOUT = "EI0002: The wait execution of the Notify register times out. Reason: The Notify register has not"


def fault(level: Level, npu: int | None = 3, since: float = T0, what: str = "health",
          overridden: bool = False) -> Fault:  # fmt: skip
    return Fault(npu, what, level, since, f"npu {npu} {what} {level.name}", overridden)


# ------------------------------------------------------------------------------------------ fault levels


def test_separate_npu_isolates_never_resets() -> None:
    state = LadderState()
    for level in (Level.SeparateNPU, Level.ManuallySeparateNPU):
        action = state.decide([fault(level), fault(Level.RestartNPU, npu=1)], T0)
        assert isinstance(action, Isolate) and f"{level.name}: never reset" in action.reason
    assert state.decide([fault(Level.SeparateNPU, overridden=True)], T0) is None, "an operator's override"
    assert state.decide([fault(Level.PreSeparateNPU), fault(Level.SubHealthFault)], T0) is None, "not taken"


def test_restart_npu_resets_at_once() -> None:
    state = LadderState()
    for level in (Level.RestartNPU, Level.FreeRestartNPU):
        action = state.decide([fault(level, since=T0)], T0)
        assert action == ChipReset((3,), f"npu 3 health {level.name} ({level.name})")
    assert state.decide([fault(Level.NotHandleFault), fault(Level.SubHealthFault)], T0) is None


def test_restart_business_resets_after_the_fault_lasted_60s() -> None:
    state = LadderState()
    faults = [fault(Level.RestartBusiness, npu=5, since=T0)]
    assert state.decide(faults, T0 + 59.9) is None, "the service restart gets its minute"
    action = state.decide(faults, T0 + 60)
    assert isinstance(action, ChipReset) and action.chips == (5,) and "RestartBusiness for 60s" in action.reason
    assert isinstance(state.decide([fault(Level.RestartRequest, since=T0)], T0 + 61), ChipReset)


# ------------------------------------------------------------------------------ repeated failed redeploys


def test_npu_looking_causes() -> None:
    assert npu_cause([ACL]) is not None and npu_cause(ACL).chips == ()  # type: ignore[union-attr]
    assert npu_cause(EZ).chips == (6,)  # type: ignore[union-attr]
    assert npu_cause("[ERROR] 2025-03-26 (PID:159, Device:2, RankID:-1) ERR00100 PTA call acl api failed\n" + ACL
                     ).chips == (2,)  # type: ignore[union-attr]
    for text in (OOM, HCCL_TIMEOUT, "ValueError: bad argument", "zmq.error.ZMQError: Address already in use"):
        assert npu_cause(text) is None, text


def test_repeated_redeploys_with_an_npu_cause_reset() -> None:
    state = LadderState()
    state.record_redeploy(T0, ok=False, cause=ACL)
    assert state.decide([], T0 + 1) is None, "one failed redeploy is not a pattern"
    state.record_redeploy(T0 + 600, ok=False, cause=EZ)
    action = state.decide([], T0 + 601)
    assert isinstance(action, ChipReset) and action.chips == (6,)
    assert "2 node redeploys in a row failed with an NPU error" in action.reason


def test_redeploys_that_do_not_point_at_the_npu_do_not_reset() -> None:
    for causes in ([OOM, OOM], [HCCL_TIMEOUT, ACL], [ACL, None, ACL]):
        state = LadderState()
        for i, cause in enumerate(causes):
            state.record_redeploy(T0 + i * 60, ok=cause is None, cause=cause or "")
        assert state.decide([], T0 + 600) is None, causes
    stale = LadderState()
    stale.record_redeploy(T0, ok=False, cause=ACL)
    stale.record_redeploy(T0 + 60, ok=False, cause=ACL)
    assert stale.decide([], T0 + 60 + 3601) is None, "outside the hour"


# ---------------------------------------------------------------------------------- budget and isolation


def test_three_resets_per_hour_with_a_pause_then_isolate() -> None:
    state = LadderState()
    faults = [fault(Level.RestartNPU, since=T0)]
    now = T0
    for n in range(3):
        action = state.decide(faults, now)
        assert isinstance(action, ChipReset), n
        state.record_reset(action, now, verified=False)
        assert state.decide(faults, now + 29.9) is None, "30 s pause after each reset"
        now += 30
    action = state.decide(faults, now)
    assert isinstance(action, Isolate)
    assert "3 resets of npu 3 within 1 h did not help" in action.reason, "the faulty chip named (all eight reset)"
    assert state.to_dict(now)["resets_last_hour"] == dict.fromkeys(range(8), 3)
    assert isinstance(state.decide(faults, T0 + 3600 + 1), ChipReset), "the budget is per hour"


def test_a_reset_that_helped_does_not_lead_to_isolation() -> None:
    state = LadderState()
    action = state.decide([fault(Level.RestartNPU)], T0)
    assert isinstance(action, ChipReset)
    state.record_reset(action, T0, verified=True)
    assert state.decide([], T0 + 120) is None


def test_a_lasting_fault_counts_from_the_last_reset() -> None:
    state = LadderState()
    faults = [fault(Level.RestartBusiness, since=T0)]
    action = state.decide(faults, T0 + 60)
    assert isinstance(action, ChipReset)
    state.record_reset(action, T0 + 60)
    assert state.decide(faults, T0 + 100) is None, "the minute starts again after the reset"
    assert isinstance(state.decide(faults, T0 + 120), ChipReset)


def test_redeploys_before_a_reset_do_not_trigger_another() -> None:
    state = LadderState()
    state.record_redeploy(T0, ok=False, cause=ACL)
    state.record_redeploy(T0 + 60, ok=False, cause=ACL)
    action = state.decide([], T0 + 61)
    assert isinstance(action, ChipReset)
    state.record_reset(action, T0 + 61)
    assert state.decide([], T0 + 200) is None
    state.record_redeploy(T0 + 300, ok=False, cause=ACL)
    state.record_redeploy(T0 + 400, ok=False, cause=ACL)
    assert isinstance(state.decide([], T0 + 401), ChipReset), "the NPU error came back twice after the reset"


def test_isolation_stays_until_uncordon() -> None:
    state = LadderState()
    action = state.decide([fault(Level.SeparateNPU)], T0)
    assert isinstance(action, Isolate)
    state.isolate(action, T0)
    assert state.to_dict(T0)["isolated"] == action.reason
    assert state.decide([fault(Level.SeparateNPU)], T0 + 10) is None, "isolated: nothing more to do"
    assert state.decide([], T0 + 86400) is None and state.isolated == action.reason, "healthy again: still out"
    assert state.uncordon() == action.reason and state.isolated is None
    assert state.decide([], T0 + 86401) is None
    assert state.uncordon() is None


def test_an_uncordon_of_a_node_not_isolated_changes_nothing() -> None:
    """The simulation's finding (seed 760398, `tests/test_sim_npu.py`): `nodeagentctl uncordon` while a reset ran —
    answered 409 — wiped the reset history, the budget and the running reset's own record with it (the reset then
    failed to note its end, and its rung held the node's vLLM ranks for good)."""
    state = LadderState(LadderPolicy(resets_per_chip=2))
    done = state.record_reset(ChipReset((3,), "npu 3 Alarm"), T0)
    state.record_redeploy(T0 - 100, ok=False, cause="ACL stream synchronize failed, error code:507035")
    assert state.uncordon() is None
    assert state.resets == [done] and len(state.redeploys) == 1, "refused: the budget and the history are kept"
    assert state.resets.index(done) == 0


def test_never_both_with_an_external_resetter() -> None:
    state = LadderState(LadderPolicy(external_resetter="MindCluster Ascend Device Plugin"))
    assert state.decide([fault(Level.RestartNPU)], T0) is None, "MindCluster resets: we do not"
    assert isinstance(state.decide([fault(Level.SeparateNPU)], T0), Isolate), "isolation stays ours"


# ---------------------------------------------------------------------------------------- the reset plan


def test_reset_plan_is_a_whole_node_event() -> None:
    policy = LadderPolicy()
    plan = reset_plan(ChipReset((3,), "npu 3 health RestartNPU"), ["prefill0", "decode0"],
                      ["vllm-dp0", "vllm-dp1", "datasystem"], policy, {c: 3162 for c in range(8)})  # fmt: skip
    assert [s.kind for s in plan] == ["drain_groups", "stop", "wait_idle", "reset", "settle", "verify", "start",
                                      "pause"]  # fmt: skip
    by = {s.kind: s.args for s in plan}
    assert by["drain_groups"]["groups"] == ["prefill0", "decode0"]
    assert by["wait_idle"]["chips"] == list(range(8)) and by["wait_idle"]["devices"][7] == "/dev/davinci7"
    assert by["reset"] == {"chip": 3, "argv": ["npu-smi", "set", "-t", "reset", "-i", "3", "-c", "0"],
                           "stdin": "y\n"}  # fmt: skip
    assert by["settle"]["seconds"] >= 20 and by["pause"]["seconds"] == 30
    assert by["start"]["components"] == ["vllm-dp0", "vllm-dp1", "datasystem"]


def test_verify_after_reset() -> None:
    policy = LadderPolicy()
    ok = dict.fromkeys(range(8), "OK")
    base = dict.fromkeys(range(8), 3162)
    assert verify_after_reset(ok, base, policy, base) == (True, "all chips OK, HBM at baseline")
    assert verify_after_reset({**ok, 3: "Alarm"}, base, policy, base) == (False, "npu 3 Alarm after the reset")
    missing = {c: v for c, v in ok.items() if c != 5}
    assert verify_after_reset(missing, base, policy, base)[1] == "npu 5 not visible after the reset"
    assert not verify_after_reset(ok, {**base, 2: 60000}, policy, base)[0], "HBM still held"


def test_verify_says_when_it_could_not_judge_the_hbm() -> None:
    """No idle baseline (an agent that adopted running ranks never saw the chips idle): health alone passes the
    step, and its record says the HBM was not checked and for which chips — never a silent `at baseline`."""
    policy = LadderPolicy()
    ok = dict.fromkeys(range(8), "OK")
    used = dict.fromkeys(range(8), 60000)
    passed, detail = verify_after_reset(ok, used, policy, {})
    assert passed and detail.startswith("all chips OK; HBM NOT CHECKED: no idle baseline known for npu 0-7"), detail
    partial = {c: 3162 for c in range(8) if c != 3}
    passed, detail = verify_after_reset(ok, {c: 3162 for c in range(8) if c != 5}, policy, partial)
    assert passed and "HBM at baseline on npu 0-2,4,6-7" in detail, detail
    assert "no idle baseline known for npu 3" in detail and "npu-smi gave no HBM use for npu 5" in detail
    assert not verify_after_reset(ok, {**dict.fromkeys(range(8), 3162), 2: 60000}, policy, partial)[0]


# ------------------------------------------------------------------------------ the fake npu-smi reset


def _reset(fake: FakeAscend, chip: int, answer: str = "y\n") -> subprocess.CompletedProcess[str]:
    argv = [str(FAKE_BIN / "npu-smi"), *reset_command(chip)[1:]]
    return subprocess.run(argv, input=answer, capture_output=True, text=True, env=fake.env, timeout=30)


def _health(fake: FakeAscend) -> dict[int, str]:
    out = subprocess.run([str(FAKE_BIN / "npu-smi"), "info"], capture_output=True, text=True, env=fake.env, timeout=30)
    return {c.npu: c.health for c in parse_npu_smi_info(out.stdout).chips}


def test_fake_npu_smi_reset_clears_the_fault_of_every_chip(tmp_path: Path) -> None:
    fake = FakeAscend(tmp_path, "doc-alarm-then-reset")
    assert _health(fake)[3] == "Alarm"
    done = _reset(fake, 3)
    assert done.returncode == 0, done.stdout
    assert "Are you sure you want to continue resetting?(Y/N)" in done.stdout
    assert "Status                         : OK" in done.stdout and "Reset card successfully." in done.stdout
    assert set(_health(fake).values()) == {"OK"}, "one reset resets all eight"
    assert (fake.state / "resets").read_text() == "3\n"


def test_fake_npu_smi_reset_refused_while_busy_or_not_confirmed(tmp_path: Path) -> None:
    fake = FakeAscend(tmp_path, {"npus": 8, "chips": {"3": {"health": "Alarm"}}, "after_reset": {"chips": {}},
                                 "processes": [{"npu": 1, "pid": 4242, "name": "python3", "memory_mb": 1000}]})
    busy = _reset(fake, 3)
    assert busy.returncode == 255 and "Status                         : Fail" in busy.stdout
    assert _health(fake)[3] == "Alarm" and not (fake.state / "resets").exists()
    fake.set({"npus": 8, "chips": {"3": {"health": "Alarm"}}, "after_reset": {"chips": {}}})
    no = _reset(fake, 3, answer="n\n")
    assert no.returncode == 255 and _health(fake)[3] == "Alarm"
    failing = FakeAscend(tmp_path / "f", {"npus": 8, "chips": {"3": {"health": "Alarm"}}, "reset": {"status": "Fail"},
                                          "after_reset": {"chips": {}}})
    out = _reset(failing, 3)
    assert out.returncode == 255 and "Reset card failed." in out.stdout and _health(failing)[3] == "Alarm"

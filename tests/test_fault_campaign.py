"""Issue 33: the fault campaign (bench/fault_campaign.py). Its checks on hand-made ledgers (no process: each check
must catch what it is for), and the short variant on real processes — four agents, real etcd, datasystem workers,
the PD proxy, the stand-in; a handful of faults with traffic — asserting that every check and target held."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import campaign_checks as cc  # noqa: E402


def req(sent: float, status: int = 200, nonempty: bool = True, group: str | None = "d0",
        answered: float | None = None) -> dict[str, Any]:  # fmt: skip
    return {"sent": sent, "answered": sent + 0.1 if answered is None else answered, "status": status,
            "nonempty": nonempty, "group": group, "error": ""}  # fmt: skip


def fault(fid: int, cls: str, injected: float, healed: float, recovered: float | None, *, node: str | None = "n2",
          group: str | None = "d0", detected: float | None = None) -> dict[str, Any]:  # fmt: skip
    return {"id": fid, "cls": cls, "target": node or "cluster", "node": node, "group": group,
            "planned": cls in cc.PLANNED, "injected": injected, "healed": healed, "detected": detected,
            "recovered": recovered}  # fmt: skip


def ledger(**parts: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"duration": 100.0, "requests": [], "faults": [], "processes": [], "overlaps": [],
                            "generations": [], "proxy": [], "empties": [], "attributed": [], "stopped_at_end": [],
                            "bounds": {"recovery_s": 60.0, "probe_period_s": 2.0, "warmup": 5.0}}  # fmt: skip
    return {**base, **parts}


def start(t: float, node: str = "n2", role: str = "vllm") -> dict[str, Any]:
    return {"t": t, "event": "start", "pid": 100 + int(t), "sid": 100 + int(t), "node": node, "role": role}


def test_a_clean_run_holds_everything() -> None:
    led = ledger(requests=[req(t) for t in range(10, 90)],
                 faults=[fault(1, "restart_drain", 20, 21, 30)], processes=[start(1), start(24)])  # fmt: skip
    cc.fill_detection(led)
    rep = cc.report(led)
    assert rep["ok"] and rep["violations"] == 0 and not rep["targets_missed"], rep
    assert rep["classes"]["restart_drain"]["failed"]["median"] == 0
    assert led["faults"][0]["detected"] == 24  # the replacement rank's start


def test_a_planned_operation_that_fails_one_request_misses_its_target() -> None:
    led = ledger(requests=[req(10), req(22, status=502), req(40)], faults=[fault(1, "pause_resume", 20, 25, 26)])
    rep = cc.report(led)
    assert not rep["ok"] and [m["cls"] for m in rep["targets_missed"]] == ["pause_resume"], rep


def test_a_restart_outside_every_fault_window_is_a_restart_without_cause() -> None:
    led = ledger(faults=[fault(1, "kill_vllm", 20, 20, 30)],
                 processes=[start(1), start(22), start(60, node="n1", role="datasystem")])  # fmt: skip
    found = cc.invariants(led)["restart_without_cause"]
    assert [(e["t"], e["node"]) for e in found] == [(60, "n1")]
    # an engine process or one that starts during warm-up is not a restart
    led["processes"] = [start(1, role="datasystem"), start(60, role="vllm-engine")]
    assert cc.invariants(led)["restart_without_cause"] == []


def test_a_restart_after_the_window_of_the_fault_that_stopped_it_has_that_cause() -> None:
    """Seed 3307: a SIGSTOPped rank stopped at 572 s (in its fault's window), its group backed off 10 s as one and
    started it at 583 s, past the window's end (healed 577 s, + 5 s). The stop it replaces explains the start; a
    stop outside every window does not."""
    stop = {"t": 24.0, "event": "stop", "pid": 7, "sid": 7, "node": "n2", "role": "vllm"}
    led = ledger(faults=[fault(1, "stop_vllm", 20, 25, None)], processes=[start(1), stop, start(40)])
    assert cc.invariants(led)["restart_without_cause"] == []
    led["processes"] = [start(1), {**stop, "t": 50.0}, start(52)]
    assert [e["t"] for e in cc.invariants(led)["restart_without_cause"]] == [52]


def test_two_trees_alive_stopped_processes_and_slow_or_no_recovery_are_violations() -> None:
    led = ledger(faults=[fault(1, "stop_vllm", 10, 20, 95), fault(2, "kill_agent", 30, 35, None, node="n1")],
                 overlaps=[{"t": 12, "node": "n2", "sids": [1, 2]}],
                 stopped_at_end=[{"pid": 5, "node": "n2", "role": "vllm-engine"}])  # fmt: skip
    inv = cc.invariants(led)
    assert len(inv["two_generations_alive"]) == 1 and len(inv["stopped_after_heal"]) == 1
    assert [v["fault"] for v in inv["recovery_over_bound"]] == [1]  # 75 s after the heal > 60
    assert [v["fault"] for v in inv["never_recovered"]] == [2]
    assert cc.report(led)["violations"] == 4


def test_the_recovery_bound_adds_the_group_backoff_the_agents_stated() -> None:
    """A group that failed again and again backs off as one (`not_before`): the policy's wait is a bound the config
    gives, not a slow recovery; a wait longer than bound + backoff still is one."""
    gens = [{"t": 12.0, "group": "d0", "generation": 9, "reason": "crash", "by": "n2", "backoff_s": 40.0}]
    led = ledger(faults=[fault(1, "kill_vllm", 10, 11, 100)], generations=gens)
    assert cc.invariants(led)["recovery_over_bound"] == []  # 89 s after the heal <= 60 + 40
    led = ledger(faults=[fault(1, "kill_vllm", 10, 11, 120)], generations=gens)
    assert [(v["fault"], v["backoff_s"]) for v in cc.invariants(led)["recovery_over_bound"]] == [(1, 40.0)]
    gens[0]["t"] = 5.0  # a backoff stated before the fault is not its
    led = ledger(faults=[fault(1, "kill_vllm", 10, 11, 100)], generations=gens)
    assert [v["fault"] for v in cc.invariants(led)["recovery_over_bound"]] == [1]


def test_a_rank_fault_may_cost_what_was_in_flight_and_what_was_sent_before_detection() -> None:
    inflight = [req(9.5, status=502, answered=10.5)]
    undetected = [req(10.5, status=502), req(11.0, status=0)]
    led = ledger(requests=[*inflight, *undetected, req(14.0)],
                 faults=[fault(1, "kill_vllm", 10, 10, 15, detected=11.5)])  # fmt: skip
    rep = cc.report(led)
    assert rep["per_fault"][0]["target_ok"] is True, rep["per_fault"]
    led["requests"].append(req(11.9, status=502))  # sent during the proxy's removal (11.5 + 0.5 s): allowed
    assert cc.report(led)["per_fault"][0]["target_ok"] is True
    led["requests"].append(req(12.3, status=502))  # after detection and the proxy's removal: not allowed
    rep = cc.report(led)
    assert rep["per_fault"][0]["target_ok"] is False and not rep["ok"]


def test_an_empty_answer_must_be_attributed_within_one_probe_period() -> None:
    empty = [req(20, nonempty=False), req(21, nonempty=False)]
    led = ledger(requests=[*empty, req(30)], faults=[fault(1, "empty_rank", 19, 25, 31, detected=21)],
                 empties=[{"t": 20.1, "group": "d0"}, {"t": 21.1, "group": "d0"}],
                 attributed=[{"t": 22.0, "group": "d0"}])  # fmt: skip
    rows = cc.empties_attributed(led)
    assert rows == [{"fault": 1, "group": "d0", "first_empty": 20.1, "attributed_after_s": 1.9, "ok": True}]
    led["attributed"] = [{"t": 24.0, "group": "d0"}]  # 3.9 s: later than the 2 s period (+0.5 s poll)
    assert not cc.empties_attributed(led)[0]["ok"] and not cc.report(led)["ok"]
    led["attributed"] = []
    assert cc.empties_attributed(led)[0]["attributed_after_s"] is None


def test_a_failure_while_no_fault_is_active_is_counted_against_the_run() -> None:
    led = ledger(requests=[req(10), req(50, status=500)], faults=[fault(1, "kill_proxy", 20, 20, 25, node="n0")])
    rep = cc.report(led)
    assert rep["unattributed_failures"] == 1 and not rep["ok"]


def test_overlapping_faults_name_each_other_and_are_not_held_to_a_lone_target() -> None:
    led = ledger(requests=[req(22, status=502)],
                 faults=[fault(1, "restart_drain", 20, 21, 30), fault(2, "kill_agent", 25, 28, 30, node="n1")])
    rows = {r["id"]: r for r in cc.fault_costs(led)}
    assert rows[1]["overlapped"] == [2] and rows[1]["target_ok"] is None


@pytest.mark.system
def test_the_short_campaign_holds_every_check(tmp_path: Path) -> None:
    out = tmp_path / "campaign.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "fault_campaign.py"), "--short", "--seed", "33",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.is_file(), f"no ledger: {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    data = json.loads(out.read_text())
    rep = data["report"]
    story = run.stdout[-4000:]
    assert rep["requests"] > 100 and rep["faults"] == 6, story
    assert rep["violations"] == 0, story
    assert not rep["targets_missed"] and not rep["empties_late"] and rep["unattributed_failures"] == 0, story
    assert {f["cls"] for f in data["faults"]} >= {"restart_drain", "kill_vllm", "empty_rank", "cut_etcd"}
    assert data["processes"] and data["generations"] and data["proxy"], "the outside view saw nothing"
    assert run.returncode == 0, story


def test_an_empty_group_taken_out_of_the_proxy_is_attributed_too() -> None:
    """The rank's own readiness probe can see the empty answers first: the group leaves the proxy before the PD
    watch probes it (short campaign, seed 33) — the agent attributed it all the same."""
    led = ledger(requests=[req(20, nonempty=False), req(30)], faults=[fault(1, "empty_rank", 19, 25, 31)],
                 empties=[{"t": 20.1, "group": "d0"}],
                 proxy=[{"t": 1, "prefill": 2, "decode": 2}, {"t": 21.0, "prefill": 2, "decode": 1}])  # fmt: skip
    assert cc.empties_attributed(led)[0]["attributed_after_s"] == 0.9

"""Restart policy on a fake clock: every call passes `now`, so each scenario is exact and instant."""

from __future__ import annotations

import json

import pytest

from nodeagent.config.model import DependencyEdge, RestartSpec
from nodeagent.seam.policy import (
    Intent,
    RedeployTracker,
    RestartDecision,
    RestartTracker,
    backoff_delay,
    hold_for_dependency,
    restarts_with,
)

SPEC = RestartSpec()  # 0 s first, 10 s doubling to 300 s, stable after 600 s, 5 failures / 900 s, 3 redeploys


def crash_loop(tracker: RestartTracker, start: float, count: int, run_s: float = 1.0) -> list[float]:
    """Start, run `run_s`, fail, wait out the delay; `count` times. Returns the delays."""
    now, delays = start, []
    for _ in range(count):
        tracker.record_start(now)
        now += run_s
        decision = tracker.record_failure(now, "exited 1")
        delays.append(decision.delay_s)
        now += decision.delay_s
    return delays


def test_first_restart_after_a_stable_run_is_immediate() -> None:
    tracker = RestartTracker(SPEC)
    tracker.record_start(0.0)
    tracker.record_healthy(5.0)
    decision = tracker.record_failure(5000.0, "liveness failed")
    assert decision.action == "restart"
    assert decision.delay_s == 0.0
    assert decision.consecutive_failures == 1
    assert decision.crash_loop is False
    assert decision.reason == "liveness failed"


def test_first_delay_is_configurable() -> None:
    tracker = RestartTracker(RestartSpec(first_delay_s=3.0))
    assert tracker.record_failure(0.0, "x").delay_s == 3.0


def test_consecutive_failures_double_up_to_the_cap() -> None:
    spec = RestartSpec(redeploy_after_failures=100)
    delays = crash_loop(RestartTracker(spec), 0.0, 9)
    assert delays == [0.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0, 300.0]


def test_backoff_never_overflows() -> None:
    assert backoff_delay(SPEC, 10_000) == SPEC.backoff_max_s


def test_crash_loop_flag_from_the_second_failure_on() -> None:
    tracker = RestartTracker(RestartSpec(redeploy_after_failures=100))
    first = tracker.record_failure(0.0, "x")
    second = tracker.record_failure(1.0, "x")
    assert (first.crash_loop, second.crash_loop) == (False, True)
    assert tracker.crash_loop
    assert "failure 2 in a row" in second.reason
    status = tracker.status(1.0)
    assert status["crash_loop"] is True
    assert status["consecutive_failures"] == 2
    assert status["retry_in_s"] == 10.0


def test_backoff_resets_after_a_stable_run() -> None:
    tracker = RestartTracker(RestartSpec(redeploy_after_failures=100))
    crash_loop(tracker, 0.0, 4)
    assert tracker.crash_loop
    tracker.record_start(1000.0)
    tracker.record_healthy(1060.0)  # stability counts from the first healthy check, not from the start
    assert tracker.record_healthy(1659.0) is False
    assert tracker.crash_loop
    assert tracker.record_healthy(1660.0) is True
    assert not tracker.crash_loop
    assert tracker.record_failure(1700.0, "x").delay_s == 0.0


def test_stability_is_checked_implicitly_at_the_failure() -> None:
    tracker = RestartTracker(RestartSpec(redeploy_after_failures=100))
    crash_loop(tracker, 0.0, 4)
    tracker.record_start(1000.0)
    tracker.record_healthy(1010.0)
    decision = tracker.record_failure(1010.0 + 600.0, "x")
    assert (decision.delay_s, decision.consecutive_failures, decision.crash_loop) == (0.0, 1, False)


def test_a_long_startup_that_dies_is_not_a_stable_run() -> None:
    """vLLM loading for 40 minutes and then failing never became healthy: keep backing off."""
    tracker = RestartTracker(RestartSpec(redeploy_after_failures=100))
    tracker.record_start(0.0)
    tracker.record_failure(2400.0, "startup probe budget exhausted")
    tracker.record_start(2400.0)
    decision = tracker.record_failure(4800.0, "startup probe budget exhausted")
    assert (decision.delay_s, decision.crash_loop) == (10.0, True)


def test_redeploy_after_n_failures_within_the_window() -> None:
    tracker = RestartTracker(SPEC)
    now = 0.0
    actions = []
    for _ in range(5):
        decision = tracker.record_failure(now, "exited 1")
        actions.append(decision.action)
        now += decision.delay_s + 1
    assert actions == ["restart"] * 4 + ["redeploy"]
    assert "5 failures within 900s" in decision.reason
    assert (decision.delay_s, decision.consecutive_failures, decision.crash_loop) == (80.0, 5, True)
    # the redeploy starts a fresh ladder: the next failure is an immediate plain restart
    after = tracker.record_failure(now + 100, "exited 1")
    assert (after.action, after.delay_s, after.consecutive_failures) == ("restart", 0.0, 1)


def test_a_redeploy_clears_the_other_components_ladders() -> None:
    tracker = RestartTracker(SPEC)
    for t in (0.0, 1.0, 2.0, 3.0):
        tracker.record_failure(t, "x")
    tracker.record_redeploy(10.0)
    assert (tracker.consecutive_failures, tracker.failure_times, tracker.crash_loop) == (0, [], False)
    assert tracker.record_failure(11.0, "x").action == "restart"


def test_failures_outside_the_window_do_not_escalate() -> None:
    tracker = RestartTracker(RestartSpec(failure_window_s=100.0, backoff_initial_s=0.0))
    actions = [tracker.record_failure(t, "x").action for t in (0.0, 60.0, 120.0, 180.0, 240.0, 300.0)]
    assert actions == ["restart"] * 6


def test_escalation_ladder_reaches_failed_and_keeps_retrying_at_the_cap() -> None:
    spec = RestartSpec(redeploy_after_failures=2, failed_after_redeploys=2, failure_window_s=10_000)
    tracker, node = RestartTracker(spec), RedeployTracker()
    now = 0.0
    ladder = []
    for _ in range(4):
        for _ in range(2):
            decision = node.escalate(
                tracker.record_failure(now, "exited 1", node_failed=node.failed), now, spec
            )
            now += decision.delay_s + 1
        ladder.append((decision.action, decision.delay_s))
    assert ladder == [("redeploy", 10.0), ("redeploy", 10.0), ("failed", 300.0), ("failed", 300.0)]
    assert node.failed
    assert "2 redeploys within 10000s" in node.failed_reason
    assert node.redeploys_total == 4
    # while failed, plain restarts wait at the cap too
    assert tracker.record_failure(now, "x", node_failed=node.failed).delay_s == spec.backoff_max_s


def test_restart_decisions_pass_through_the_node_tracker() -> None:
    node = RedeployTracker()
    decision = RestartTracker(SPEC).record_failure(0.0, "x")
    assert node.escalate(decision, 0.0, SPEC) is decision
    assert node.redeploys_total == 0


def test_redeploys_outside_the_window_do_not_fail_the_node() -> None:
    spec = RestartSpec(failed_after_redeploys=1, failure_window_s=100.0)
    node = RedeployTracker()
    redeploy = RestartTracker(RestartSpec(redeploy_after_failures=1)).record_failure(0.0, "x")
    assert node.escalate(redeploy, 0.0, spec).action == "redeploy"
    assert node.escalate(redeploy, 101.0, spec).action == "redeploy"
    assert node.escalate(redeploy, 150.0, spec).action == "failed"


def test_reset_clears_counters_and_the_failed_state() -> None:
    spec = RestartSpec(failed_after_redeploys=1)
    tracker, node = RestartTracker(spec), RedeployTracker()
    for t in (0.0, 1.0):
        tracker.record_failure(t, "x")
        node.escalate(RestartDecision("redeploy", 0.0, "x", 5, True), t, spec)
    assert node.failed and tracker.consecutive_failures == 2
    tracker.reset()
    node.reset()
    assert not node.failed and node.redeploy_times == []
    assert (tracker.consecutive_failures, tracker.failure_times, tracker.crash_loop) == (0, [], False)
    assert tracker.failures_total == 2  # the lifetime metric survives
    assert tracker.record_failure(5.0, "x").delay_s == 0.0


def test_node_stability_clears_the_failed_state() -> None:
    node = RedeployTracker(redeploy_times=[1.0], failed=True, failed_reason="x")
    node.record_stable()
    assert (node.failed, node.redeploy_times, node.failed_reason) == (False, [], "")


def test_tracker_state_survives_a_json_round_trip() -> None:
    spec = RestartSpec(redeploy_after_failures=100)
    tracker = RestartTracker(spec)
    crash_loop(tracker, 0.0, 3)
    tracker.record_start(100.0)
    tracker.record_healthy(101.0)
    restored = RestartTracker.from_dict(json.loads(json.dumps(tracker.to_dict())), spec)
    assert restored == tracker
    assert restored.record_failure(120.0, "x") == tracker.record_failure(120.0, "x")

    node = RedeployTracker(redeploy_times=[1.0, 2.0], failed=True, failed_reason="why", redeploys_total=7)
    assert RedeployTracker.from_dict(json.loads(json.dumps(node.to_dict()))) == node


def test_old_state_files_load_with_defaults() -> None:
    tracker = RestartTracker.from_dict({"consecutive_failures": 3, "some_future_key": 1}, SPEC)
    assert tracker.consecutive_failures == 3 and tracker.failure_times == []
    assert RedeployTracker.from_dict({}) == RedeployTracker()


def test_intent_round_trips() -> None:
    """Which automatic action an intent allows is the node's gate list now (tests/test_holds.py)."""
    intent = Intent("stopped", True)
    assert Intent.from_dict(json.loads(json.dumps(intent.to_dict()))) == intent
    with pytest.raises(ValueError, match="desired"):
        Intent.from_dict({"desired": "maybe"})


def test_datasystem_restarts_hold_while_etcd_is_unreachable() -> None:
    reason = hold_for_dependency("datasystem", etcd_reachable=False)
    assert reason is not None and "etcd unreachable" in reason
    assert hold_for_dependency("datasystem", etcd_reachable=True) is None
    first = hold_for_dependency("datasystem", etcd_reachable=False, first_start=True)
    assert first == "waiting for etcd: the datasystem worker starts once etcd answers", "no 'restart' before a start"
    assert hold_for_dependency("vllm", etcd_reachable=False) is None


def test_restarts_with_defaults() -> None:
    edge = DependencyEdge()
    assert restarts_with("vllm", "datasystem", edge) is False  # the client reconnects (test_datasystem_client)
    assert restarts_with("process", "datasystem", edge) is True
    assert restarts_with("datasystem", "etcd", edge) is False
    assert restarts_with("process", "vllm", edge) is True
    assert restarts_with("process", "etcd", edge) is False


def test_restarts_with_edge_override_wins() -> None:
    assert restarts_with("vllm", "datasystem", DependencyEdge(restart_with=True)) is True
    assert restarts_with("datasystem", "etcd", DependencyEdge(restart_with=True)) is True


def test_the_hold_order_is_the_documented_one() -> None:
    """The node's own holds come first, then the layers' gates; the gate answers with the earliest of them."""
    from nodeagent.seam.stackport import HOLD_ORDER, Hold, HoldKind

    assert [str(k) for k in HOLD_ORDER] == [
        "desired_stopped", "node_pause", "cluster_pause", "etcd_unreachable", "node_redeploy", "dependency",
        "container", "cluster_redeploy", "isolated", "npu_reset", "memory_headroom", "preflight", "npu_fault",
        "coordination", "group_backoff", "rollout", "barrier", "foreign_holder"]
    pause = Hold(HoldKind.CLUSTER_PAUSE, "cluster paused by n1", operator_passes=True, resolves_itself=False)
    assert pause.is_pause and not Hold(HoldKind.BARRIER, "paused-looking text").is_pause, "kinds, never texts"
    assert min([Hold(HoldKind.BARRIER, "b"), Hold(HoldKind.PREFLIGHT, "p")],
               key=lambda h: HOLD_ORDER.index(h.kind)).kind == HoldKind.PREFLIGHT


def test_the_proxy_killed_minutes_apart_comes_back_within_2_s_every_time() -> None:
    """The fault campaign (seed 3305): the proxy kill -9'd at 45, 997, 1035, 1430, 1497 and 1743 s, serving in
    between. With the components' default (stable after 10 min) its fifth kill in 15 min escalated with an 80 s
    wait — every request failed meanwhile; the proxy's own default restarts it at once after a minute's serving."""
    from nodeagent.config.model import PROXY_RESTART, ProxyComponent

    assert ProxyComponent().restart == PROXY_RESTART
    kills = [45.0, 997.0, 1035.0, 1430.0, 1497.0, 1743.0]

    def waits(spec: RestartSpec) -> list[tuple[str, float]]:
        tracker, out = RestartTracker(spec=spec), []
        for kill in kills:
            decision = tracker.record_failure(kill, "killed")
            out.append((decision.action, decision.delay_s))
            tracker.record_start(kill + decision.delay_s)
            tracker.record_healthy(kill + decision.delay_s + 5)  # up and serving 5 s after its start
        return out

    proxy = waits(PROXY_RESTART)
    assert {action for action, _ in proxy} == {"restart"} and max(delay for _, delay in proxy) <= 2.0, proxy
    default = waits(RestartSpec())
    assert ("redeploy", 80.0) in default, f"the components' default escalates with a long wait: {default}"

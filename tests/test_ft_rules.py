"""The fault-tolerance rung as a pure rule, on a fake clock: every branch, taken and not taken."""

from __future__ import annotations

from dataclasses import replace

from nodeagent.vllm.ft_rules import (
    AllHealthy,
    Attempt,
    Escalate,
    FtSituation,
    Instruct,
    RankStatus,
    Recovered,
    Unsupported,
    WaitRetry,
    attempt_for,
    decide,
)

T0 = 1_800_000_000.0


def _statuses(*states: str, **extra: dict[str, str]) -> dict[int, RankStatus]:
    out = {}
    for rank, state in enumerate(states):
        if state == "missing":
            continue
        fault = "RuntimeError" if state == "unhealthy" else None
        out[rank] = RankStatus(rank, state, fault_info=fault, **extra.get(f"r{rank}", {}))  # type: ignore[arg-type]
    return out


def _situation(*states: str, now: float = T0, **kw: object) -> FtSituation:
    base = FtSituation(ranks=tuple(range(len(states))), statuses=_statuses(*states), asked=True, supported=True,
                       support_reason="vllm 0.32.0", now=now, recovery_timeout_s=120, retry_timeout_s=30,
                       fault_at=T0)
    return replace(base, **kw)  # type: ignore[arg-type]


# ---- not for this group -----------------------------------------------------------------------------------------


def test_config_off_goes_to_the_gang_restart_silently() -> None:
    decision = decide(_situation("unhealthy", "unhealthy", asked=False))
    assert decision == Unsupported("fault tolerance is not enabled for this group in the config", announce=False)


def test_support_not_yet_known_is_never_guessed() -> None:
    decision = decide(_situation("unhealthy", "unhealthy", supported=None, support_reason="no answer yet"))
    assert isinstance(decision, Unsupported) and not decision.announce and "no answer yet" in decision.reason


def test_an_unsupporting_vllm_is_said_once() -> None:
    first = decide(_situation("unhealthy", "unhealthy", supported=False, support_reason="vllm 0.11.0 has no FT"))
    assert first == Unsupported("vllm 0.11.0 has no FT", announce=True)
    again = decide(_situation("unhealthy", "unhealthy", supported=False, support_reason="vllm 0.11.0 has no FT",
                              unsupported_said=True))
    assert again == Unsupported("vllm 0.11.0 has no FT", announce=False)


# ---- before a retry ---------------------------------------------------------------------------------------------


def test_every_rank_healthy_needs_nothing() -> None:
    assert decide(_situation("healthy", "healthy", fault_at=None)) == AllHealthy()


def test_a_failed_rank_that_reports_healthy_escalates() -> None:
    decision = decide(_situation("healthy", "healthy", failed_rank=1))
    assert isinstance(decision, Escalate) and "rank 1 failed but every rank reports healthy" in decision.reason


def test_every_rank_unhealthy_is_retried_on_all_of_them() -> None:
    decision = decide(_situation("unhealthy", "unhealthy", now=T0 + 5))
    assert decision == Instruct((0, 1), "retry", 30)


def test_a_failed_rank_still_answering_unhealthy_is_retried() -> None:
    assert decide(_situation("unhealthy", "unhealthy", failed_rank=1)) == Instruct((0, 1), "retry", 30)


def test_the_retry_timeout_is_capped_by_the_engines_recovery_timeout() -> None:
    decision = decide(_situation("unhealthy", "unhealthy", now=T0 + 100))
    assert decision == Instruct((0, 1), "retry", 20)


def test_no_fault_time_counts_from_now() -> None:
    decision = decide(_situation("unhealthy", "unhealthy", now=T0 + 500, fault_at=None))
    assert decision == Instruct((0, 1), "retry", 30)


def test_past_the_engines_recovery_timeout_escalates() -> None:
    decision = decide(_situation("unhealthy", "unhealthy", now=T0 + 120))
    assert isinstance(decision, Escalate) and "recovery timeout (120 s)" in decision.reason


def test_a_gone_failed_rank_escalates_at_once() -> None:
    decision = decide(_situation("unhealthy", "unreachable", failed_rank=1))
    assert isinstance(decision, Escalate) and decision.reason.startswith("rank 1 is gone")


def test_a_dead_rank_escalates_even_when_the_agent_saw_nothing() -> None:
    decision = decide(_situation("unhealthy", "dead"))
    assert isinstance(decision, Escalate) and "rank 1 gone" in decision.reason


def test_a_rank_missing_from_the_statuses_counts_as_gone() -> None:
    decision = decide(_situation("unhealthy", "missing", failed_rank=0))
    assert isinstance(decision, Escalate) and "rank 1 gone" in decision.reason


def test_peers_that_have_not_seen_the_fault_yet_are_waited_for() -> None:
    decision = decide(_situation("unhealthy", "healthy", now=T0 + 10))
    assert decision == WaitRetry(T0 + 90, "rank 0 unhealthy, waiting for rank 1")


def test_peers_that_never_see_the_fault_escalate_in_time_for_a_retry() -> None:
    decision = decide(_situation("unhealthy", "healthy", now=T0 + 90))
    assert isinstance(decision, Escalate) and "rank 1 never reported the fault of rank 0" in decision.reason


# ---- after a retry ----------------------------------------------------------------------------------------------


def _sent(now: float = T0 + 5) -> Attempt:
    instruct = decide(_situation("unhealthy", "unhealthy", now=now))
    assert isinstance(instruct, Instruct)
    return attempt_for(instruct, now, {0: "req-0", 1: "req-1"})


def test_attempt_for_records_the_deadline() -> None:
    attempt = _sent()
    assert attempt.ranks == (0, 1) and attempt.deadline == T0 + 35 and attempt.request_ids[1] == "req-1"


def test_every_rank_back_to_healthy_is_recovered() -> None:
    attempt = _sent()
    assert decide(_situation("healthy", "healthy", now=T0 + 8, attempt=attempt)) == Recovered(attempt)


def test_a_retry_under_way_is_waited_for_until_its_deadline() -> None:
    attempt = _sent()
    decision = decide(_situation("healthy", "unhealthy", now=T0 + 8, attempt=attempt))
    assert decision == WaitRetry(T0 + 35, "retry sent; rank 1 not healthy yet")


def test_a_retry_that_times_out_escalates() -> None:
    attempt = _sent()
    decision = decide(_situation("unhealthy", "unhealthy", now=T0 + 35, attempt=attempt))
    assert decision == Escalate("retry timed out after 30 s")


def test_a_retry_a_rank_rejected_escalates_at_once() -> None:
    attempt = _sent()
    s = _situation("unhealthy", "unhealthy", now=T0 + 6, attempt=attempt)
    failed = dict(s.statuses)
    failed[1] = RankStatus(1, "unhealthy", "RuntimeError", ft_error="gloo timeout", last_ft_request_id="req-1")
    decision = decide(replace(s, statuses=failed))
    assert decision == Escalate("retry failed on rank 1: gloo timeout")


def test_an_older_ft_error_is_not_this_retrys_failure() -> None:
    attempt = _sent()
    s = _situation("unhealthy", "unhealthy", now=T0 + 6, attempt=attempt)
    stale = dict(s.statuses)
    stale[1] = RankStatus(1, "unhealthy", "RuntimeError", ft_error="old", last_ft_request_id="req-from-before")
    assert isinstance(decide(replace(s, statuses=stale)), WaitRetry)


def test_a_rank_that_did_not_accept_the_retry_escalates() -> None:
    attempt = replace(_sent(), request_ids={0: "req-0"})
    decision = decide(_situation("unhealthy", "unhealthy", now=T0 + 6, attempt=attempt))
    assert decision == Escalate("rank 1 did not accept the retry")


def test_a_rank_lost_during_the_retry_escalates() -> None:
    attempt = _sent()
    decision = decide(_situation("healthy", "unreachable", now=T0 + 6, attempt=attempt))
    assert decision == Escalate("rank 1 lost during the retry")


def test_one_retry_per_episode_a_second_fault_after_it_escalates() -> None:
    """The attempt is kept for the episode: however the statuses look, no second retry is sent."""
    attempt = _sent()
    decision = decide(_situation("unhealthy", "unhealthy", now=T0 + 40, attempt=attempt))
    assert isinstance(decision, Escalate)

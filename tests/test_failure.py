"""Pure: which failed runs are permanent (no restart can help) and which are transient."""

from __future__ import annotations

from nodeagent.core.failure import Failure, classify, error_signature, exit_text

TAIL = ("2026-12-03 14:22:31 ERROR model path /models/dsv4 does not exist (pid 4242)",)


def quick_exit(tail: tuple[str, ...] = TAIL, uptime: float = 2.0, code: int = 1, was_up: bool = False) -> Failure:
    return Failure("exit", "process exited with code 1", code, uptime, tail, was_up=was_up)


def test_the_same_quick_error_twice_is_permanent_and_says_why() -> None:
    first = classify(quick_exit(), None)
    assert first.permanent is None, "one quick exit is not yet a pattern"
    second = classify(quick_exit(("2026-12-03 14:22:40 ERROR model path /models/dsv4 does not exist (pid 4250)",)),
                      first)  # fmt: skip
    assert second.permanent is not None and second.permanent.startswith("exits within 30s with the same error")
    assert "does not exist" in second.permanent


def test_a_new_error_text_or_a_long_run_stays_transient() -> None:
    first = classify(quick_exit(), None)
    assert classify(quick_exit(("RuntimeError: HCCL timeout",)), first).permanent is None
    assert classify(quick_exit(uptime=600.0), first).permanent is None
    assert classify(quick_exit(code=-9), first).permanent is None, "a SIGKILL is someone else's doing"


def test_a_run_that_came_up_then_crashed_is_a_crash_not_a_failed_start() -> None:
    """A crash loop of a component that passes its startup probe each time must back off, not end in failed."""
    first = classify(quick_exit(uptime=3.0, was_up=True), None)
    assert classify(quick_exit(uptime=3.0, was_up=True), first).permanent is None
    assert classify(quick_exit(), first).permanent is None, "the previous run came up: no pattern of failed starts"


def test_usage_errors_precheck_and_missing_commands_are_permanent_at_once() -> None:
    tail = ("usage: vllm serve", "error: unrecognized arguments: --x")
    usage = Failure("exit", "process exited with code 2", 2, 1.0, tail)
    assert (classify(usage, None).permanent or "").startswith("rejected its configuration (exit 2)")
    assert classify(Failure("precheck", "model path /m missing"), None).permanent == "model path /m missing"
    assert classify(Failure("launch", "vllm: command not found"), None).permanent == "vllm: command not found"
    assert classify(Failure("launch", "connection refused"), None).permanent is None


def test_quick_exit_zero_turns_the_pattern_rule_off() -> None:
    first = classify(quick_exit(), None, quick_exit_s=0)
    assert classify(quick_exit(), first, quick_exit_s=0).permanent is None


def test_signature_masks_times_pids_and_counts_and_round_trips() -> None:
    assert error_signature(["12:00:01 pid 1 at 0xdeadbeef"]) == error_signature(["13:59:59 pid 77 at 0x1"])
    failure = quick_exit(was_up=True)
    assert Failure.from_dict(failure.to_dict()) == failure
    assert exit_text(-9) == "killed by SIGKILL" and exit_text(137) == "exited with code 137 (killed by SIGKILL)"

"""`LivenessHolds` without processes: a held liveness failure is not acted on, and is judged again by the first
liveness result after the hold ends (released, or its deadline passed)."""

from __future__ import annotations

from typing import Any

from nodeagent.node.liveness_hold import LivenessHolds
from nodeagent.seam.host import Clock


class StillClock(Clock):
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def holds() -> tuple[LivenessHolds, StillClock, list[tuple[str, str]], list[tuple[str, int, str]]]:
    clock = StillClock()
    events: list[tuple[str, str]] = []
    acted: list[tuple[str, int, str]] = []

    def emit(kind: str, message: str, component: str | None = None, level: str = "info", **data: Any) -> None:
        events.append((kind, message))

    return LivenessHolds(clock, emit, lambda n, g, d: acted.append((n, g, d))), clock, events, acted


def test_no_hold_holds_nothing() -> None:
    h, _, events, _ = holds()
    assert not h.failed("vllm", 1, "canary timed out") and not events and h.status("vllm") is None


def test_a_failure_held_then_passing_again_is_left_alone() -> None:
    h, clock, events, acted = holds()
    h.set("vllm", "retry is recovering the group", 130)
    assert h.failed("vllm", 1, "canary timed out after 10s")
    assert h.failed("vllm", 1, "canary timed out after 10s")  # said once
    assert [k for k, _ in events] == ["liveness_held"] and "not acted on: retry is recovering" in events[0][1]
    assert h.status("vllm") == {"reason": "retry is recovering the group", "left_s": 130.0,
                                "failure_held": "canary timed out after 10s"}  # fmt: skip
    h.result("vllm", 1, False, "canary timed out")
    clock.now += 5
    h.set("vllm", None)
    assert h.status("vllm") is None and not acted
    h.result("vllm", 1, True, "")
    assert not acted and events[-1][0] == "liveness_hold_end" and "passes again" in events[-1][1]
    h.result("vllm", 1, False, "x")  # the rejudge is over: the prober counts from here again
    assert not acted


def test_a_failure_still_there_after_the_release_is_acted_on_at_the_next_result() -> None:
    h, _, events, acted = holds()
    h.set("vllm", "retry", 130)
    h.failed("vllm", 1, "canary timed out")
    h.set("vllm", None)
    h.result("vllm", 1, False, "canary timed out again")
    assert acted == [("vllm", 1, "canary timed out again")] and "acting on it now" in events[-1][1]


def test_a_pass_during_the_hold_clears_the_failure_held() -> None:
    h, _, _, acted = holds()
    h.set("vllm", "retry", 130)
    h.failed("vllm", 1, "canary timed out")
    h.result("vllm", 1, True, "")
    assert h.status("vllm")["failure_held"] is None  # type: ignore[index]
    h.set("vllm", None)
    h.result("vllm", 1, False, "a new failure: the prober's own threshold counts it")
    assert not acted


def test_the_deadline_ends_the_hold_and_the_result_past_it_judges() -> None:
    h, clock, events, acted = holds()
    h.set("vllm", "retry", 130)
    h.failed("vllm", 1, "canary timed out")
    clock.now += 129
    h.result("vllm", 1, False, "still")
    assert not acted
    clock.now += 2
    h.result("vllm", 1, False, "still")
    assert acted == [("vllm", 1, "still")]
    assert any("liveness hold expired" in m for _, m in events)
    assert not h.failed("vllm", 1, "a later failure is acted on at once")


def test_a_new_process_is_not_restarted_for_the_old_ones_failure() -> None:
    h, _, _, acted = holds()
    h.set("vllm", "retry", 130)
    h.failed("vllm", 1, "canary timed out")
    h.set("vllm", None)
    h.result("vllm", 2, False, "the new process's first result")
    assert not acted


def test_a_hold_renewed_keeps_the_failure_it_held() -> None:
    h, clock, _, acted = holds()
    h.set("vllm", "retry", 130)
    h.failed("vllm", 1, "canary timed out")
    clock.now += 100
    h.set("vllm", "the retry failed; gang restart asked", 130)
    clock.now += 100
    h.result("vllm", 1, False, "still")
    assert not acted and h.status("vllm")["reason"] == "the retry failed; gang restart asked"  # type: ignore[index]

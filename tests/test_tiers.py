"""The test suite's own machinery: the fast tier's rule (tests/tiers.py) and its check, `wait_for`'s failing fast."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import tiers
from conftest import _REFUSED, GiveUp, wait_for


@dataclass
class FakeItem:
    nodeid: str
    fixturenames: list[str] = field(default_factory=list)
    markers: tuple[str, ...] = ()

    def get_closest_marker(self, name: str) -> Any:
        return name if name in self.markers else None


def test_the_fast_tier_rule() -> None:
    assert tiers.is_fast(FakeItem("tests/test_policy.py::test_x", ["tmp_path"]))  # type: ignore[arg-type]
    assert not tiers.is_fast(FakeItem("tests/test_policy.py::test_x", markers=("system",)))  # type: ignore[arg-type]
    assert not tiers.is_fast(FakeItem("tests/test_policy.py::test_x", ["local_agent"]))  # type: ignore[arg-type]
    assert not tiers.is_fast(FakeItem("tests/test_cli.py::test_status_table"))  # type: ignore[arg-type]
    listed = "tests/test_ladder.py::test_fake_npu_smi_reset_clears_the_fault_of_every_chip"
    assert listed in tiers.NOT_FAST
    assert not tiers.is_fast(FakeItem(listed + "[a-param]"))  # type: ignore[arg-type]
    assert tiers.is_fast(FakeItem("tests/test_ladder.py::test_another"))  # type: ignore[arg-type]


def test_a_fast_test_may_start_no_process(request: pytest.FixtureRequest) -> None:
    """This test is fast, so conftest refuses and records every process it starts (a refusal swallowed by the
    code under test still fails it at teardown)."""
    assert request.node.get_closest_marker("fast") is not None
    with pytest.raises(AssertionError, match="started a process"):
        subprocess.run(["true"], check=False)
    tried = request.node.stash[_REFUSED][1].tried
    assert tried and "true" in tried[0]
    tried.clear()  # this test's attempt was on purpose


def test_wait_for_waits_through_what_is_not_there_yet() -> None:
    answers: list[Any] = [KeyError("status"), FileNotFoundError("status.json"), AssertionError, None, "up"]

    def check() -> Any:
        answer = answers.pop(0)
        if isinstance(answer, BaseException) or answer is AssertionError:
            raise answer
        return answer

    assert wait_for("up", check, timeout=10, interval=0.01) == "up"
    status: dict[str, Any] = {"recovery": None}  # a section still None is not there yet either
    with pytest.raises(AssertionError, match=r"timed out after 0\.2s"):
        wait_for("the recovery's steps", lambda: status["recovery"]["steps"], timeout=0.2, interval=0.01)


def test_a_typo_in_a_check_fails_at_once_not_after_the_timeout() -> None:
    began = time.monotonic()
    with pytest.raises(NameError, match="stauts"):
        wait_for("a typo", lambda: stauts()["ok"], timeout=5)  # type: ignore[name-defined]  # noqa: F821
    with pytest.raises(AttributeError, match="stauts"):
        wait_for("a misspelt attribute", lambda: time.stauts(), timeout=5)  # type: ignore[attr-defined]
    with pytest.raises(GiveUp, match="the agent exited"):
        wait_for("what can no longer happen", lambda: (_ for _ in ()).throw(GiveUp("the agent exited")), timeout=5)
    assert time.monotonic() - began < 2

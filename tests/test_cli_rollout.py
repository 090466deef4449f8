"""`nodeagentctl cluster rollout FILE` options → the API body, and a bad option refused with a line that names it
(before anything reaches the agent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.cli.cluster import rollout_body
from nodeagent.cli.common import CliError
from nodeagent.cli.parser import build_parser


def body(tmp_path: Path, *flags: str) -> dict[str, object]:
    args = build_parser().parse_args(["cluster", "rollout", str(tmp_path / "new.yaml"), *flags])
    return rollout_body(args)


def test_the_bake_limits_reach_the_body(tmp_path: Path) -> None:
    out = body(tmp_path, "--bake", "10m", "--bake-error-rate", "2%", "--bake-ttft-factor", "1.5")
    assert (out["bake_s"], out["bake_error_rate"], out["bake_ttft_factor"]) == (600.0, 0.02, 1.5)
    assert body(tmp_path, "--bake-error-rate", "0.1")["bake_error_rate"] == 0.1
    assert "bake_error_rate" not in body(tmp_path), "unset: the agent's default (5%)"


@pytest.mark.parametrize(("flags", "said"), [
    (("--bake-error-rate", "lots"), "--bake-error-rate: 'lots' is not a rate"),
    (("--bake-error-rate", "150%"), "--bake-error-rate: '150%' is not between 0 and 100%"),
    (("--bake-ttft-factor", "fast"), "--bake-ttft-factor: 'fast' is not a number"),
    (("--bake-ttft-factor", "0.5"), "--bake-ttft-factor: '0.5' is below 1"),
])  # fmt: skip
def test_a_bad_bake_limit_is_named(tmp_path: Path, flags: tuple[str, str], said: str) -> None:
    with pytest.raises(CliError) as caught:
        body(tmp_path, *flags)
    assert said in str(caught.value)


def view(**changes: object) -> dict[str, object]:
    """A rollout as `GET /cluster` gives it (`RolloutExecutor.view`), mid-way through an incompatible change."""
    steps = [{"groups": ["p0", "d0"], "phase": "rejoining", "since": 1000.0, "failed": "", "rollback": False,
              "note": "first pair: the old groups serve meanwhile; as it rejoins, the proxy switches"},
             {"groups": ["p1", "d1"], "phase": "pending", "since": 0.0, "failed": "", "rollback": False,
              "note": ""}]  # fmt: skip
    out: dict[str, object] = {
        "id": "ab12cd34", "status": "running", "message": "step 1 (p0, d0): gate passed; back into the proxy",
        "steps": steps, "current": 0, "time_left_s": 1900.0,
        "floor": "serving: prefill p1 (until the switch); decode d1 (until the switch)",
        "held_out": {"p1": "rollout ab12cd34: runs 0a1b while the proxy routes 9f8e (an incompatible change: "
                           "never routed together)"}}  # fmt: skip
    out.update(changes)
    return out


def test_the_rollout_lines_say_the_step_the_floor_per_kind_and_the_time_left() -> None:
    from nodeagent.cli.remote import format_cluster, rollout_lines

    lines = rollout_lines(view(), now=1090.0)
    assert lines == [
        "rollout ab12cd34: running, step 1/2 p0, d0 rejoining for 90s",
        "  step 1 (p0, d0): gate passed; back into the proxy",
        "  floor: serving: prefill p1 (until the switch); decode d1 (until the switch); time left: 32 min",
        "  out of the proxy: p1 (rollout ab12cd34: runs 0a1b while the proxy routes 9f8e (an incompatible change: "
        "never routed together))",
        "  1. p0, d0: rejoining (first pair: the old groups serve meanwhile; as it rejoins, the proxy switches)",
        "  2. p1, d1: pending",
    ]
    waiting = rollout_lines(view(current=1, time_left_s=None, held_out={},
                                 floor="step 2 waits: no other decode group serving (d0 (n4/vllm is starting))"),
                            1090.0)  # fmt: skip
    assert waiting[2] == ("  floor: step 2 waits: no other decode group serving (d0 (n4/vllm is starting)); time "
                          "left: unknown")  # fmt: skip
    halted = rollout_lines(view(status="halted", current=None), 1090.0)
    assert not any("floor" in line for line in halted), "nothing moves: no floor, no time left"
    table = format_cluster({"cluster": "c", "self": "n0", "etcd": {"state": "reachable"}, "view_complete": True,
                            "members": [], "rollout": view()}, now=1090.0)  # fmt: skip
    assert "\n\nrollout ab12cd34: running, step 1/2 p0, d0 rejoining for 90s\n" in table


def test_the_plan_says_an_incompatible_change_is_kept_apart() -> None:
    from nodeagent.cli.remote import format_plan

    text = format_plan({"old_hash": "a" * 64, "new_hash": "b" * 64, "exclusive": True, "switch_gap_s": 1.25,
                        "incompatible": ["p0: KV connector A → B"], "steps": [{"groups": ["p0", "d0"], "note": "x"}],
                        "refused": [], "ok": True})  # fmt: skip
    assert "  incompatible: p0: KV connector A → B" in text
    assert ("  never routed together: old and new groups are kept apart in the proxy; at the switch it holds no "
            "group for ~1 s") in text  # fmt: skip
    assert "  step 1: p0, d0  (x)" in text

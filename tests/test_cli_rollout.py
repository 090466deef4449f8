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

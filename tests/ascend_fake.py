"""Test helper: the fake `npu-smi`/`hccn_tool` (tests/fixtures/ascend) set up with a scenario in tmp_path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from nodeagent.npu.tools import NpuTools

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ascend"
FAKE_BIN = FIXTURES / "bin"
SCENARIOS = FIXTURES / "scenarios"


class FakeAscend:
    """A scenario file and its call counters under `folder`; `tools()` is a facade pointed at the fakes."""

    def __init__(self, folder: Path, scenario: str | dict[str, Any] = "doc-healthy-a2") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "scenario.json"
        self.state = folder / "calls"
        self.set(scenario)

    def set(self, scenario: str | dict[str, Any]) -> None:
        """Replace the scenario (a preset's name or the data) and restart its per-call sequences."""
        if isinstance(scenario, str):
            shutil.copyfile(SCENARIOS / f"{scenario}.json", self.path)
        else:
            self.path.write_text(json.dumps(scenario))
        shutil.rmtree(self.state, ignore_errors=True)

    @property
    def data(self) -> dict[str, Any]:
        return json.loads(self.path.read_text())

    @property
    def env(self) -> dict[str, str]:
        import os

        return {**os.environ, "ASCEND_FAKE_SCENARIO": str(self.path), "ASCEND_FAKE_STATE": str(self.state)}

    def tools(self, roce: bool = True) -> NpuTools:
        hccn = FAKE_BIN / "hccn_tool" if roce else None
        return NpuTools(str(FAKE_BIN / "npu-smi"), str(hccn) if hccn else None, timeout_s=10, env=self.env)

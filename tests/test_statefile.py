"""The agent's state files (`core/statefile.py`): written in C, read back as `json` reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodeagent.core.statefile import encode_state, read_json, write_json_atomic


@pytest.mark.parametrize("data", [
    {"b": 1, "a": {"y": [1.5, None, True], "x": "ü"}},
    {"npus": {0: {"health": "OK"}, 7: {"health": "Alarm"}}, "ranks": {1: "vllm-dp1"}},  # int keys (the CI's find)
])  # fmt: skip
def test_a_state_file_reads_back_as_json_wrote_it(data: dict, tmp_path: Path) -> None:
    assert json.loads(encode_state(data)) == json.loads(json.dumps(data))
    write_json_atomic(tmp_path / "s.json", data, durable=False)
    assert read_json(tmp_path / "s.json", None) == json.loads(json.dumps(data))
    text = (tmp_path / "s.json").read_text()
    assert text.endswith("}\n") and text.startswith("{\n "), "indented, one key per line"


def test_what_json_cannot_write_fails_as_json_does_and_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "s.json", {"k": {(1, 2): 1}})
    assert list(tmp_path.iterdir()) == []

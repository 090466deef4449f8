"""docs/configuration.md's key reference is what scripts/gen_config_reference.py makes of the models."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_config_reference.py"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_current(gen: ModuleType) -> None:
    document = gen.DOC.read_text(encoding="utf-8")
    assert gen.splice(document, gen.generate()) == document, (
        "docs/configuration.md differs from the models: run .venv/bin/python scripts/gen_config_reference.py --write"
    )


def test_every_key_has_a_meaning_and_no_fallback_is_stale(gen: ModuleType) -> None:
    assert gen.missing_meanings() == [], "give these keys a docstring in the model (or a FALLBACK line)"
    assert gen.stale_fallbacks() == [], "these FALLBACK lines are for keys that are gone or describe themselves"


def test_an_undocumented_key_is_reported(gen: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(gen.FALLBACK, "RestartSpec.backoff_max_s")
    assert gen.missing_meanings() == ["RestartSpec.backoff_max_s"]


def test_check_fails_on_a_hand_edit(gen: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "configuration.md"
    edited = gen.DOC.read_text(encoding="utf-8").replace("| `client_port` | int, 1–65535 | `2379` |",
                                                           "| `client_port` | int, 1–65535 | `12379` |")
    assert "`12379`" in edited
    doc.write_text(edited, encoding="utf-8")
    monkeypatch.setattr(gen, "DOC", doc)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    out: list[str] = []
    assert gen.main(["--check"], write=out.append) == 1
    assert "not current" in out[0]
    assert gen.main(["--write"]) == 0
    assert gen.main(["--check"], write=out.append) == 0
    assert "`12379`" not in doc.read_text(encoding="utf-8")


def test_rows_come_from_the_models(gen: ModuleType) -> None:
    text = gen.generate()
    # type and range from constraints, the default, the flag found by rendering, the docstring
    assert "| `worker_port` | int, 1–65535 | `18481` | `--worker_address` |" in text
    assert "| `remote_h2d` | bool | `false` | `DS_ENABLE_REMOTE_H2D` | DS_ENABLE_REMOTE_H2D; enable together" in text
    assert "| `etcd_timeout_s` | number, > 0, ≤ 60 | `2` |" in text
    assert "| `preflight` | `enforce` \\| `warn` \\| `off` | `enforce` |" in text
    # a host-dependent default is described, never this host's value
    assert "| `name` | name (no `/ + #`) | the host name |" in text
    # each kind's default probes, as probe_defaults.py has them
    assert "- {kind: vllm_progress, period_s: 2.5, timeout_s: 4, failure_threshold: 3}" in text


def test_the_script_runs_standalone() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60,
                            cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr

"""The product wheel ships the product only: the vLLM stand-in (standin/, a test double) is its own distribution.

Builds the wheel from a copy of the repo (setuptools writes build/ into the tree it builds) and reads its file list
and entry points.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".venv", ".git", ".dsv4-agent", "__pycache__", "build", "dist", "*.egg-info",
                              ".cache", ".pytest_cache", ".ruff_cache")  # fmt: skip


def build_wheel(source: Path, out: Path) -> Path:
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    if result.returncode != 0 and "Could not find a version that satisfies" in result.stderr:
        pytest.skip("pip could not fetch setuptools for the isolated build (no index, empty cache)")
    assert result.returncode == 0, result.stderr
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.timeout(300)
def test_product_wheel_has_no_standin(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=SKIP)
    wheel = build_wheel(source, tmp_path / "wheels")
    assert wheel.name.startswith("dsv4_agent-")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        metadata = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    top = {name.split("/")[0] for name in names}
    assert {n for n in top if not n.endswith(".dist-info")} == {"nodeagent"}, top
    assert not [n for n in names if "standin" in n], "the stand-in is in the product wheel"
    assert "nodeagent/api/ui/static/index.html" in names  # package data still comes along
    scripts = {line.split("=")[0].strip() for line in entry_points.splitlines() if "=" in line}
    assert scripts == {"dsv4-agent", "nodeagentctl"}
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(line.startswith("Requires-Dist: aiomqtt") and "extra ==" not in line for line in requires), requires
    assert any("dsv4-vllm-standin" in line and 'extra == "test"' in line for line in requires), requires


def test_standin_is_its_own_distribution() -> None:
    """The test venv has it (the `test` extra / scripts/install-dev.sh), importable as vllm_standin, not nodeagent."""
    import importlib.metadata as md
    import importlib.util

    assert importlib.util.find_spec("nodeagent.standin") is None
    dist = md.distribution("dsv4-vllm-standin")
    assert {ep.name for ep in dist.entry_points if ep.group == "console_scripts"} == {"vllm-standin"}
    assert (Path(sys.executable).parent / "vllm-standin").exists()

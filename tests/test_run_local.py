"""`scripts/run-local.sh` installs only when it must (issue 17: pip's "Editable installation" banner on every run).

Cheap: the real run-local.sh and install-dev.sh in a copy of the tree whose `.venv` holds stand-ins (a `python`
that answers `-m pip` with pip-like lines, a `dsv4-agent` that prints its arguments), so nothing is installed and
no agent starts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from conftest import ROOT

PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = pip ]; then
  echo "Obtaining file://$PWD (pip $*)"
  echo "  Editable installation of dsv4-agent"
fi
exit 0
"""


def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    for rel in ("scripts/run-local.sh", "scripts/install-dev.sh", "pyproject.toml", "standin/pyproject.toml"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, root / rel)
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    tools = {"python": PYTHON, "dsv4-agent": '#!/bin/sh\necho "agent ran: $*"\n',
             **{t: "#!/bin/sh\nexit 0\n" for t in ("etcd", "dscli", "vllm-standin", "nodeagentctl")}}  # fmt: skip
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return root


def run_local(root: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_", "VIRTUAL_ENV"))}
    out = subprocess.run([str(root / "scripts" / "run-local.sh"), *args], capture_output=True, text=True, timeout=60,
                         env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_a_second_start_on_an_installed_tree_prints_no_pip_output(tmp_path: Path) -> None:
    root = tree(tmp_path)
    first = run_local(root, "--version")
    assert "Editable installation" in first, "a fresh tree installs (the stand-in pip speaks)"
    assert "agent ran: --config config/local.yaml --version" in first
    for _ in range(2):
        again = run_local(root, "--version")
        assert "pip" not in again and "Editable" not in again and "Obtaining" not in again, again
        assert sorted(again.splitlines()) == ["agent ran: --config config/local.yaml --version",
                                              "dsv4-agent: starting on config/local.yaml (logs: .dsv4-agent/logs/, "
                                              "state: .dsv4-agent/state/)"], "its own line and the agent's only"
    with (root / "pyproject.toml").open("a") as f:
        f.write("\n# a new dependency\n")
    assert "Editable installation" in run_local(root, "--version"), "a changed pyproject installs again"
    assert "pip" not in run_local(root, "--version")

"""The production unit file parses cleanly with systemd-analyze and says what the design needs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "dsv4-agent.service"
EXEC = "/usr/local/bin/dsv4-agent"


def settings(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines (keys may repeat), sections ignored; enough to check our own unit."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def verify(unit_text: str, tmp_path: Path) -> str:
    """Run ``systemd-analyze verify`` on a copy; return everything it printed.

    It exits 0 even on parse warnings ("Unknown key ..., ignoring"), so callers check the output is empty.
    The copy's ExecStart and ExecReload point at an existing executable (/bin/true): verify complains when a
    binary is missing, and this test machine has no dsv4-agent/nodeagentctl in /usr/local/bin. The arguments
    stay.
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze missing: apt-get install -y --no-install-recommends systemd")
    copy = tmp_path / UNIT.name
    text = unit_text.replace(f"ExecStart={EXEC} ", "ExecStart=/bin/true ")
    copy.write_text(text.replace("ExecReload=/usr/local/bin/nodeagentctl ", "ExecReload=/bin/true "))
    res = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    return (res.stdout + res.stderr).strip() + ("" if res.returncode == 0 else f"\n(exit {res.returncode})")


def test_unit_verifies_without_output(tmp_path: Path) -> None:
    text = UNIT.read_text()
    assert f"ExecStart={EXEC} --config /etc/dsv4-agent/config.yaml\n" in text
    assert verify(text, tmp_path) == ""


def test_verify_does_catch_mistakes(tmp_path: Path) -> None:
    """The empty-output check is meaningful on this systemd: a misspelt key is reported."""
    out = verify(UNIT.read_text().replace("WatchdogSec=", "WatchdogSecs="), tmp_path)
    assert "WatchdogSecs" in out


def test_unit_settings() -> None:
    s = {k: v[-1] for k, v in settings(UNIT.read_text()).items()}
    assert s["Type"] == "notify"
    assert s["NotifyAccess"] == "main"
    assert s["WatchdogSec"] == "30"
    # The agent alone stops its children; components live in scopes of their own, so they outlive an agent
    # crash and are adopted (test_systemd_agent.py).
    assert s["KillMode"] == "mixed"
    assert int(s["TimeoutStopSec"]) >= 60 + 10 + 10
    assert int(s["TimeoutStartSec"]) >= 60
    assert s["Restart"] == "always"
    assert s["RestartPreventExitStatus"] == "75 78"  # a bad config, and a second agent on the same state
    assert s["RuntimeDirectoryPreserve"] == "yes"
    assert s["StateDirectory"] == s["RuntimeDirectory"] == "dsv4-agent"
    assert s["LimitNOFILE"] == "1048576"
    assert s["ExecReload"] == "/usr/local/bin/nodeagentctl --config /etc/dsv4-agent/config.yaml reload"
    assert "Delegate" not in s
    assert s["WantedBy"] == "multi-user.target"

"""A real agent whose log folder is full (issue 29, item 1): a tiny tmpfs with no inode left, so the launcher's open
of `<component>.log` fails with ENOSPC. The component is shown `failed: internal error …` (the task used to die
and leave it `starting` forever), the traceback is logged, and once there is room it comes back by itself."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from apihelpers import tiny_config, write_config
from conftest import LocalAgent

pytestmark = pytest.mark.system


def test_a_full_log_folder_fails_visibly_and_recovers_by_itself(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,nr_inodes=4", "tmpfs", str(logs)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    agent: LocalAgent | None = None
    try:
        fillers = []
        for i in range(8):  # every inode taken: no new file can be made (ENOSPC)
            try:
                (logs / f"filler{i}").touch()
            except OSError:
                break
            fillers.append(logs / f"filler{i}")
        data = tiny_config(tmp_path)
        data["agent"]["preflight"] = "warn"  # its disk check would hold the stack: the disk fills while running
        data["components"]["a"]["restart"] = {"backoff_initial_s": 1, "backoff_max_s": 2}
        agent = LocalAgent(tmp_path, write_config(tmp_path / "config.yaml", data))
        agent.start()
        comps = agent.wait_states({"a": {"failed"}}, 60)
        detail = comps["a"]["failure"]["detail"]
        assert detail.startswith("failed: internal error: OSError: [Errno 28] No space left on device"), detail
        assert comps["b"]["state"] in ("stopped", "starting")
        log = (tmp_path / "agent.log").read_text()
        assert "Traceback" in log and "internal error" in log
        for filler in fillers:
            filler.unlink()
        agent.wait_states({"a": {"running", "ready"}, "b": {"running", "ready"}}, 60)
        assert (logs / "a.log").exists()
    finally:
        if agent is not None:
            agent.cleanup()
        subprocess.run(["umount", "-l", str(logs)], check=False)

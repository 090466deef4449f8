"""The agent on config/local.yaml, as an operator would drive it: real etcd, the real datasystem worker, the
vLLM stand-in; kill -9 of every child, kill -9 of the agent (adoption), SIGTERM (nothing left behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import BIN, ROOT, LocalAgent, proc_cmdline, session_pids, wait_for

pytestmark = pytest.mark.system


def _pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stack_lifecycle(local_agent: LocalAgent) -> None:
    local_agent.start()
    first = local_agent.wait_all_up()
    assert set(first) == {"etcd", "datasystem", "vllm"}
    status = local_agent.status()["components"]
    # dependency order: each component came up only after its dependency
    assert status["vllm"]["state"] in ("running", "ready")
    worker = psutil.Process(first["datasystem"]["pid"])
    assert Path(worker.exe()).name == "datasystem_worker" and worker.ppid() != local_agent.proc.pid
    vllm_sid = first["vllm"]["sid"]
    tree = psutil.Process(first["vllm"]["pid"])
    engine = wait_for(
        "EngineCore child",
        lambda: [p for p in tree.children(True) if "".join(proc_cmdline(p)[:1]).startswith("VLLM::EngineCore")],
    )
    engine_pid = engine[0].pid

    # kill -9 of each child leads to a new one (vLLM's orphaned EngineCore is gone before the new start)
    for name in ("vllm", "datasystem", "etcd"):
        old = local_agent.children()[name]["pid"]
        os.kill(old, signal.SIGKILL)
        wait_for(
            f"new {name}", lambda n=name, o=old: local_agent.children().get(n, {}).get("pid") not in (None, o)
        )
        local_agent.wait_all_up()
    assert _pid_gone(engine_pid), "the killed API server's EngineCore must be stopped before a new start"
    assert not session_pids(vllm_sid), "nothing of the killed vllm session may survive"

    # kill -9 of the agent, start again: same PIDs adopted, nothing restarted
    before = {n: (c["pid"], c["create_time"]) for n, c in local_agent.children().items()}
    os.kill(local_agent.proc.pid, signal.SIGKILL)
    local_agent.proc.wait(10)
    time.sleep(1.0)
    for pid, _ in before.values():
        assert not _pid_gone(pid), "children must survive the agent's death"
    (local_agent.state_dir / "status.json").unlink()
    local_agent.start()
    wait_for("adoption of all three", lambda: local_agent.log().count("adopted running pid") == 3)
    local_agent.wait_all_up()
    after = {n: (c["pid"], c["create_time"]) for n, c in local_agent.children().items()}
    assert after == before

    # SIGTERM: orderly stop in reverse order, exit 0, no process of the stack left (EngineCore included)
    sids = {c["sid"] for c in local_agent.children().values()}
    pids = [pid for pid, _ in before.values()]
    assert local_agent.terminate(120) == 0
    for pid in pids:
        assert _pid_gone(pid)
    for sid in sids:
        assert not session_pids(sid), f"session {sid} left processes behind"
    log = local_agent.log()
    assert (
        log.index("[vllm] stopping pid")
        < log.index("[datasystem] stopping pid")
        < log.index("[etcd] stopping pid")
    )


def test_config_typo_exits_78_naming_line_and_key(tmp_path: Path) -> None:
    text = (ROOT / "config" / "local.yaml").read_text().replace("    worker_port:", "    worker_prot:")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "worker_prot" in ln)
    out = subprocess.run([str(BIN / "dsv4-agent"), "--config", str(bad)], capture_output=True, text=True,
                         timeout=30, env={**os.environ, "DSV4_AGENT_HOME": str(tmp_path)})  # fmt: skip
    assert out.returncode == 78
    assert f"{bad}:{line}: components.datasystem.worker_prot: unknown key 'worker_prot'" in out.stderr
    assert "did you mean 'worker_port'?" in out.stderr
    assert not (tmp_path / "state").exists(), "a bad config must not touch anything"


def test_unsafe_cleanup_path_is_a_config_error(tmp_path: Path) -> None:
    text = (ROOT / "config" / "local.yaml").read_text()
    text = text.replace("    data_dir: ${DSV4_AGENT_HOME:-../.dsv4-agent}/etcd-data", "    data_dir: /")
    bad = tmp_path / "unsafe.yaml"
    bad.write_text(text)
    out = subprocess.run([str(BIN / "dsv4-agent"), "--config", str(bad)], capture_output=True, text=True,
                         timeout=30, env={**os.environ, "DSV4_AGENT_HOME": str(tmp_path)})  # fmt: skip
    assert out.returncode == 78
    assert "components.etcd.data_dir: refusing to manage '/': not a safe folder to delete" in out.stderr

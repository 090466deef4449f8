"""Fault injection as an operator would, against the real etcd and datasystem worker: SIGSTOP of each
component (a stale liveness file for the worker), a hung vLLM whose /health still says 200, empty content,
a crash loop. Each must end healthy again (or visibly backing off), nothing started twice, the failed run's
logs archived, and the events saying what happened."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import BIN, LocalAgent, derived_config, wait_for

pytestmark = pytest.mark.system

FAST_PROBES = {
    "components": {
        # Fast, but tolerant of a loaded 2-core CI machine: a stall of a second or two is not a failure.
        "etcd": {"probes": {"liveness": {"period_s": 1, "timeout_s": 2, "failure_threshold": 3}}},
        "datasystem": {"probes": {"liveness": {"period_s": 1, "max_age_s": 4, "failure_threshold": 2}}},
        # A hang can freeze a readiness chat mid-flight: the engine is then busy and judged by stall_after_s
        # (60 s by default, longer than a test waits), not by the canary. CI failed so once.
        "vllm": {"probes": {"liveness": {"period_s": 1, "timeout_s": 1.5, "failure_threshold": 2,
                                         "stall_after_s": 8},
                            "readiness": {"period_s": 1, "timeout_s": 1.5}}},
    }
}  # fmt: skip


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    base = tmp_path_factory.mktemp("faults")
    home = base / "home"
    home.mkdir()
    a = LocalAgent(home, derived_config(base / "config.yaml", FAST_PROBES))
    a.start()
    try:
        a.wait_all_up()
        yield a
    finally:
        a.cleanup()


def vllm_url(agent: LocalAgent, path: str) -> str:
    return f"http://127.0.0.1:{agent.env['DSV4_VLLM_PORT']}{path}"


def http(url: str, body: dict | None = None, timeout: float = 3) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def replaced(agent: LocalAgent, name: str, old_pid: int, timeout: float = 60) -> int:
    wait_for(f"{name} replaced", lambda: agent.children().get(name, {}).get("pid") not in (None, old_pid), timeout)
    agent.wait_all_up()
    return agent.children()[name]["pid"]


def archives(agent: LocalAgent, name: str) -> list[Path]:
    """What residue cleanup archived before removing (a redeploy's worker folder)."""
    return sorted((agent.state_dir / "archive" / name).glob("*.tar.gz"))


def postmortems(agent: LocalAgent, name: str) -> list[Path]:
    """The failure bundles, written in the background once the replacement started."""
    return sorted((agent.state_dir / "postmortem" / name).glob("*.tar.gz"))


def bundle(agent: LocalAgent, name: str) -> dict[str, Any]:
    path = wait_for(f"{name} post-mortem", lambda: postmortems(agent, name), 60)[-1]
    with tarfile.open(path) as tar:
        names = tar.getnames()
        manifest = json.load(tar.extractfile(next(n for n in names if n.endswith("manifest.json"))))  # type: ignore[arg-type]
    return {"names": names, "manifest": manifest}


def single_instance(agent: LocalAgent) -> None:
    """Nothing started twice: one datasystem_worker on our address, one vllm API server on our port."""
    address = f"--worker_address=127.0.0.1:{agent.env['DSV4_WORKER_PORT']}"
    workers = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if address in (proc.info["cmdline"] or []):
                workers.append(proc.pid)
    assert len(workers) == 1, workers


def test_sigstop_etcd_restarts_etcd_only(agent: LocalAgent) -> None:
    before = agent.children()
    os.kill(before["etcd"]["pid"], signal.SIGSTOP)
    replaced(agent, "etcd", before["etcd"]["pid"])
    after = agent.children()
    assert after["datasystem"]["pid"] == before["datasystem"]["pid"], "a local etcd restart keeps the worker"
    assert after["vllm"]["pid"] == before["vllm"]["pid"]
    assert "[etcd] liveness failed" in agent.log()
    single_instance(agent)


def test_sigstop_worker_goes_stale_and_is_replaced_while_vllm_keeps_serving(agent: LocalAgent) -> None:
    before = agent.children()
    mark = len(agent.log())
    os.kill(before["datasystem"]["pid"], signal.SIGSTOP)
    new = replaced(agent, "datasystem", before["datasystem"]["pid"], 90)
    assert new != before["datasystem"]["pid"]
    agent.wait_all_up()
    # The yr.datasystem client reconnects to the new worker by itself: vLLM (a 30-60 min reload) is left alone.
    assert agent.children()["vllm"]["pid"] == before["vllm"]["pid"]
    log = agent.log()[mark:]
    assert "liveness file" in log and "[datasystem] liveness failed" in log
    assert "dependency datasystem restarts" not in log
    pm = bundle(agent, "datasystem")
    assert any("/logs/datasystem_worker" in n for n in pm["names"]), pm["names"]
    assert pm["manifest"]["failure"]["what"] == "liveness"
    assert any(p["status"] == "stopped" for p in pm["manifest"]["tree"]), "the tree as it was: SIGSTOPped"
    single_instance(agent)


def test_hung_vllm_is_caught_although_health_says_200(agent: LocalAgent) -> None:
    old = agent.children()["vllm"]["pid"]
    assert http(vllm_url(agent, "/standin/fault"), {"mode": "hang"})[0] == 200
    assert http(vllm_url(agent, "/health"))[0] == 200, "vLLM's /health does not see a hung engine"
    replaced(agent, "vllm", old)
    assert "[vllm] liveness failed" in agent.log()
    pm = bundle(agent, "vllm")
    manifest = pm["manifest"]
    assert manifest["command"]["argv"][1] == "serve" and "PYTHONHASHSEED" in manifest["command"]["env"]
    assert any(n.endswith("/metrics.txt") for n in pm["names"]), "the last /metrics scrape"
    assert any("VLLM::EngineCore" in p.get("cmdline", "") for p in manifest["tree"]), manifest["tree"]
    assert manifest["probes"]["roles"]["liveness"]["status"] == "failure"


def test_sigstop_vllm_api_server_is_replaced_and_its_tree_stopped(agent: LocalAgent) -> None:
    old = agent.children()["vllm"]
    tree = [p.pid for p in psutil.Process(old["pid"]).children(recursive=True)]
    os.kill(old["pid"], signal.SIGSTOP)
    replaced(agent, "vllm", old["pid"])
    for pid in [old["pid"], *tree]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "[vllm] liveness failed" in agent.log()


def test_empty_content_is_a_liveness_failure(agent: LocalAgent) -> None:
    old = agent.children()["vllm"]["pid"]
    assert http(vllm_url(agent, "/standin/fault"), {"mode": "empty"})[0] == 200
    mark = len(agent.log())
    replaced(agent, "vllm", old)
    assert "[vllm] liveness failed: engine idle, but the canary chat failed" in agent.log()[mark:]
    assert "HTTP 200 from" in agent.log()[mark:] and "but choices.0.message.content is empty" in agent.log()[mark:]


def test_crash_loop_backs_off_visibly(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    # Fast probes for vLLM only: the worker's and etcd's own fast liveness could fail on a loaded machine and
    # restart the worker for a reason of its own, which is not what this test is about.
    changes = {"components": {"vllm": json.loads(json.dumps(FAST_PROBES["components"]["vllm"]))}}
    # Up, then the engine dies after its first completion (the readiness chat): a crash loop of a stack that
    # starts fine — backed off, never taken for a broken start (that is `failed`, tested elsewhere).
    fault = {"VLLM_STANDIN_STARTUP_DELAY_S": "0.3", "VLLM_STANDIN_FAULT": "crash_after:1"}
    changes["components"]["vllm"]["env"] = fault
    agent = LocalAgent(home, derived_config(tmp_path / "config.yaml", changes))
    agent.start()
    try:
        worker = agent.wait_states({"datasystem": {"ready"}}, timeout=90)["datasystem"]["pid"]
        comps = agent.wait_states({"vllm": {"backoff"}}, timeout=90)
        vllm = comps["vllm"]
        assert vllm["policy"]["crash_loop"] is True
        assert vllm["policy"]["consecutive_failures"] >= 2
        assert vllm["backoff_remaining_s"] > 0
        ds = agent.status()["components"]["datasystem"]
        left_alone = (ds["state"], ds["pid"]) in {("running", worker), ("ready", worker)}
        assert left_alone, f"a vLLM crash loop leaves the worker alone: {ds['state']}, {ds.get('last_exit')}"
        assert "backing off" in agent.log()
        # An operator's stop during the backoff ends it: the component shows stopped, and stays so.
        ctl = subprocess.run([str(BIN / "nodeagentctl"), "--config", str(agent.config_path), "stop", "vllm"],
                             env=agent.env, capture_output=True, text=True, timeout=30)  # fmt: skip
        assert ctl.returncode == 0, ctl.stderr
        agent.wait_states({"vllm": {"stopped"}}, timeout=30)
        time.sleep(2)
        assert agent.states()["vllm"] == "stopped" and "vllm" not in agent.children()
    finally:
        agent.cleanup()


def _squat(port: int, deadline_s: float = 2.0) -> socket.socket:
    """Take a port the moment its owner dies: etcd cannot come back while we hold it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # probes' connections linger in TIME_WAIT
    end = time.monotonic() + deadline_s
    while True:
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
            return sock
        except OSError:
            if time.monotonic() > end:
                sock.close()
                raise
            time.sleep(0.0005)


def test_worker_restart_is_held_while_etcd_is_down(agent: LocalAgent) -> None:
    agent.wait_all_up()
    etcd_port = int(agent.env["DSV4_ETCD_PORT"])
    before = agent.children()
    failures_before = agent.status()["components"]["datasystem"]["policy"]["failures_total"]
    os.kill(before["etcd"]["pid"], signal.SIGKILL)
    squatter = _squat(etcd_port)
    try:
        agent.wait_states({"etcd": {"starting", "backoff", "stopped", "unhealthy", "stopping"}}, timeout=20)
        os.kill(before["datasystem"]["pid"], signal.SIGKILL)
        wait_for("the hold", lambda: "etcd unreachable: holding the datasystem worker restart" in agent.log(), 30)
        time.sleep(3)
        assert "datasystem" not in agent.children(), "no worker may be started while etcd is down"
        ds = agent.status()["components"]["datasystem"]
        assert ds["state"] == "stopped"
        assert ds["policy"]["failures_total"] == failures_before, "a hold is not a failure: it burns no backoff"
    finally:
        squatter.close()
    agent.wait_all_up(timeout=120)
    after = agent.children()
    assert after["datasystem"]["pid"] != before["datasystem"]["pid"]
    single_instance(agent)


def test_escalation_to_node_redeploy_then_failed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    changes = json.loads(json.dumps(FAST_PROBES))
    changes["components"]["vllm"]["env"] = {"VLLM_STANDIN_STARTUP_DELAY_S": "0.3",
                                            "VLLM_STANDIN_FAULT": "crash_after:0"}  # fmt: skip
    # quick_exit_s 0: these crashes count as transient (a residue-type failure), not as a broken config
    changes["components"]["vllm"]["restart"] = {"backoff_initial_s": 1, "backoff_max_s": 2, "quick_exit_s": 0,
                                                "redeploy_after_failures": 2, "failed_after_redeploys": 1}
    agent = LocalAgent(home, derived_config(tmp_path / "config.yaml", changes))
    agent.start()
    try:
        agent.wait_states({n: {"running", "ready"} for n in ("etcd", "datasystem")}, timeout=90)
        first = agent.children()
        wait_for("a node redeploy", lambda: "node redeploy:" in agent.log(), 90)
        wait_for("node failed after the redeploy did not help",
                 lambda: agent.status()["node_policy"]["failed"], 120)  # fmt: skip
        assert "node failed" in agent.log()
        wait_for("still retrying while failed", lambda: agent.log().count("node redeploy:") >= 2, 120)
        # the smallest blast radius: vLLM's redeploys never stop its worker (and its KV pool) nor etcd
        log = agent.log()
        redeploy_at = log.index("node redeploy:")
        assert "[datasystem] stopping pid" not in log[redeploy_at:] and "[etcd] stopping pid" not in log[redeploy_at:]
        assert all(agent.children()[n]["pid"] == first[n]["pid"] for n in ("etcd", "datasystem"))
    finally:
        agent.cleanup()

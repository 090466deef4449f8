"""`scripts/run-local.sh --cluster`: three agents from config/local-cluster.yaml on one host, a request through the
PD proxy, Ctrl-C stops them all and leaves nothing running (issue 17: a test cluster in one command)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import BIN, ROOT, wait_for

pytestmark = pytest.mark.system
PROXY = ROOT / ".cache/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "nodeagentctl"), *args], capture_output=True, text=True, timeout=30)


def ours(home: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            text = " ".join(proc.info["cmdline"] or []) + " ".join((proc.info["environ"] or {}).values())
        except (psutil.Error, TypeError):
            continue
        if str(home) in text:
            found.append(proc)
    return found


@pytest.mark.skipif(not PROXY.is_file(), reason="vllm-ascend's examples are not fetched (scripts/test.sh does)")
@pytest.mark.usefixtures("fixed_ports")
def test_run_local_cluster_starts_three_agents_and_stops_them_all(tmp_path: Path) -> None:
    # short: the datasystem worker's unix sockets live under it (sun_path is 108 bytes; a deep pytest folder fails
    # `dscli start` with exit 255)
    home = Path(tempfile.mkdtemp(prefix="dsv4lc-"))
    env = {**os.environ, "DSV4_CLUSTER_HOME": str(home), "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    env.pop("DSV4_AGENT_CONFIG", None)
    out = open(tmp_path / "run-local.out", "wb")  # noqa: SIM115 - handed to the child
    script = subprocess.Popen([str(ROOT / "scripts" / "run-local.sh"), "--cluster"], cwd=ROOT, env=env,
                              stdout=out, stderr=out, start_new_session=True)  # fmt: skip
    out.close()
    try:
        def ready(node: str) -> bool:
            r = ctl("--node", node, "status", "--json")
            if r.returncode != 0:
                return False
            comps = json.loads(r.stdout)["components"]
            return all(c["state"] in ("running", "ready") for c in comps.values()) and comps["vllm"]["ready"]

        for node in ("n0", "n1", "n2"):
            wait_for(f"{node} ready", lambda node=node: ready(node), 180)
        wait_for("the proxy ready", lambda: json.loads(ctl("--node", "n0", "status", "--json").stdout)
                 ["components"]["proxy"]["ready"], 120)  # fmt: skip
        body = json.dumps({"model": "dsv4", "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request("http://127.0.0.1:18020/v1/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200 and json.load(response)["choices"][0]["text"]
        # node-local commands with --node: that agent's own config (its ${DSV4_NODE_NAME}, ${DSV4_API_PORT}), not
        # this shell's defaults (n0's)
        ports = ctl("--node", "n2", "ports")
        assert ports.returncode == 0 and "18702-18702" in ports.stdout and "12379" not in ports.stdout, ports
        assert "FAIL" not in ports.stdout, "its own running stack holds its ports: not a finding"
        assert ctl("--node", "n2", "pause").returncode == 0
        assert "PAUSED by " in ctl("--node", "n2", "status").stdout.splitlines()[1]
        assert ctl("--node", "n2", "resume").returncode == 0
        assert "PAUSED" not in ctl("--node", "n1", "status").stdout, "n1 was never paused"
        refused = ctl("--node", "n7", "pause")
        assert refused.returncode == 2 and "unless node 'n7' has its agent on this host" in refused.stderr
        table = ctl("--node", "n0", "cluster").stdout.splitlines()
        gens = {ln.split()[0]: ln.split()[4] for ln in table[2:] if ln.startswith("n")}
        assert gens == {"n0": "1", "n1": "1", "n2": "1"}, table
        text = (tmp_path / "run-local.out").read_text()
        assert "nodeagentctl --node n1 status" in text and "127.0.0.1:18020" in text, "it says how to reach them"
        assert ours(home), "the stack runs"
        began = time.monotonic()
        script.send_signal(signal.SIGINT)  # Ctrl-C
        assert script.wait(120) == 0
        print(f"stopped in {time.monotonic() - began:.1f}s")
        wait_for("nothing left", lambda: not ours(home), 10)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGTERM)
            script.wait(60)
        for proc in ours(home):
            proc.kill()
        for node in ("n0", "n1", "n2"):  # kept with the test's folder when it fails: how each agent stopped
            with contextlib.suppress(OSError):
                shutil.copy2(home / node / "agent.log", tmp_path / f"{node}-agent.log")
        shutil.rmtree(home, ignore_errors=True)

"""vllm-ascend's real PD proxy, rendered from a cluster file, in front of a prefill and a decode vllm-standin
(each rendered for its own member of the same file): a request goes to the prefill instance with
kv_transfer_params and max_tokens 1, then to the decode instance with the prefill's KV handle, and the proxy's
default readiness probe is that request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import free_port, wait_for

from nodeagent.config.load import parse_config
from nodeagent.probes.kinds import ProbeContext, resolve_probe_set
from nodeagent.render.launch import LaunchSpec, render_component

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROXY = ROOT / ".cache/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"

pytestmark = pytest.mark.skipif(not PROXY.is_file(), reason="vllm-ascend's examples are not fetched: run "
                                "scripts/test.sh or scripts/fetch_vllm_ascend_examples.py")


def cluster_text(tmp: Path, ports: dict[str, int]) -> str:
    return f"""
cluster:
  name: pd
  nodes:
    - {{name: p, ip: 127.0.0.1, role: master, components: {{vllm: {{port: {ports['p']}}}}}}}
    - {{name: d, ip: 127.0.0.1, components: {{vllm: {{port: {ports['d']}}}}}}}
  vllm_groups:
    - {{name: prefill0, kind: prefill, nodes: [p], dp_launch: external}}
    - {{name: decode0, kind: decode, nodes: [d], dp_launch: external}}
node: {{npus: 0}}
agent: {{state_dir: {tmp}/state, log_dir: {tmp}/logs}}
components:
  vllm:
    kind: vllm
    command: {BIN}/vllm-standin
    model: {tmp}/model
    tensor_parallel_size: 1
    data_parallel_rpc_port: {ports['rpc']}
    ld_preload: []
    env: {{VLLM_STANDIN_STARTUP_DELAY_S: "0.2"}}
  proxy:
    kind: proxy
    command: {sys.executable}
    script: {PROXY}
    port: {ports['proxy']}
"""


class Launched:
    """Process trees started from LaunchSpecs; stopped by the PIDs we saw, whatever happened."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.seen: dict[int, psutil.Process] = {}

    def start(self, key: str, spec: LaunchSpec) -> None:
        spec.cwd.mkdir(parents=True, exist_ok=True)
        for path, text in spec.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (Path(spec.env["TMPDIR"])).mkdir(parents=True, exist_ok=True)
        with open(self.tmp / f"{key}.log", "wb") as log:
            proc = subprocess.Popen(list(spec.argv), env=spec.environment(os.environ), cwd=spec.cwd, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs[key] = proc
        self.seen[proc.pid] = psutil.Process(proc.pid)

    def log(self, key: str) -> str:
        return (self.tmp / f"{key}.log").read_text(errors="replace")

    def alive(self, key: str) -> bool:
        if self.procs[key].poll() is not None:
            raise AssertionError(f"{key} exited with {self.procs[key].returncode}:\n{self.log(key)[-3000:]}")
        with contextlib.suppress(psutil.Error):
            for child in self.seen[self.procs[key].pid].children(recursive=True):
                self.seen.setdefault(child.pid, child)
        return True

    def stop(self) -> None:
        for key in self.procs:
            with contextlib.suppress(AssertionError):
                self.alive(key)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for proc in self.seen.values():
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[Launched]:
    runner = Launched(tmp_path)
    try:
        yield runner
    finally:
        runner.stop()


def get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as response:
        return response.status, response.read().decode()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with opener.open(request, timeout=30) as response:
        return json.loads(response.read())


def generation_tokens(port: int) -> float:
    _, text = get(f"http://127.0.0.1:{port}/metrics")
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def test_real_proxy_routes_through_prefill_then_decode(tmp_path: Path, launched: Launched) -> None:
    ports = {k: free_port() for k in ("p", "d", "rpc", "proxy")}
    (tmp_path / "model").mkdir()  # like vLLM, the stand-in wants a local model folder with config.json
    (tmp_path / "model" / "config.json").write_text("{}")
    text = cluster_text(tmp_path, ports)
    master = parse_config(text, str(tmp_path / "pd.yaml"), base_dir=tmp_path, node="p")
    decode = parse_config(text, str(tmp_path / "pd.yaml"), base_dir=tmp_path, node="d")
    assert list(master.active_components()) == ["vllm-dp0", "proxy"]
    launched.start("prefill", render_component("vllm-dp0", master, os.environ))
    launched.start("decode", render_component("vllm-dp0", decode, os.environ))
    for key, port in (("prefill", ports["p"]), ("decode", ports["d"])):
        url = f"http://127.0.0.1:{port}/health"
        wait_for(f"{key} to serve", lambda k=key, u=url: launched.alive(k) and get(u)[0] == 200, timeout=60)
    spec = render_component("proxy", master, os.environ)
    assert {"http_proxy", "HTTPS_PROXY"} <= set(spec.unset)
    launched.start("proxy", spec)
    base = f"http://127.0.0.1:{ports['proxy']}"
    wait_for("the proxy to listen", lambda: launched.alive("proxy") and get(f"{base}/healthcheck")[0] == 200,
             timeout=60)  # fmt: skip

    messages = [{"role": "user", "content": "tell me a story"}]
    answer = post(f"{base}/v1/chat/completions", {"model": "dsv4", "max_tokens": 6, "ignore_eos": True,
                                                  "messages": messages})
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == 6
    # The prefill instance produced one token (max_tokens 1) and handed its KV over; the decode instance the rest.
    assert generation_tokens(ports["p"]) == 1
    assert generation_tokens(ports["d"]) == 6
    wait_for("the decode instance to log the remote prefill",
             lambda: "from engine 0 at 127.0.0.1:30000" in launched.log("decode"), timeout=10)  # fmt: skip

    probes = resolve_probe_set(master.components["proxy"], master)
    assert [p.kind for p in probes["startup"] + probes["liveness"]] == ["http_get", "http_get"]
    (ready,) = probes["readiness"]
    assert ready.url == f"{base}/v1/chat/completions" and ready.body["model"] == "dsv4"

    async def probe() -> Any:
        ctx = ProbeContext()
        try:
            return [await ctx.run(p) for p in (ready, probes["liveness"][0])]
        finally:
            await ctx.close()

    through, health = asyncio.run(probe())
    assert through.ok, through.detail
    assert health.ok, health.detail
    assert generation_tokens(ports["p"]) == 2  # the readiness probe really went through both instances

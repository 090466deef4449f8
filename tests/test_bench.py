"""`nodeagentctl bench`: the guide's run_vllm_bench.py command, exactly, and the hit rates of that very run.

The command is checked against the guide's own script (tests/golden/run_vllm_bench.py, run with a recording
`vllm` first on PATH). The run goes to a real vLLM stand-in process tree with a recording fake of the
`vllm bench serve` client (tests/vllm_bench_fake.py) that sends real chat requests, so the stand-in's
prefix-cache counters move; the test reads those counters itself, before and after.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from apihelpers import tiny_config, write_config
from conftest import BIN, ROOT, free_port, session_pids, wait_for

from nodeagent.cli import bench as benchcmd
from nodeagent.cli.bench import Target, Workload, bench_command, config_target, override_target
from nodeagent.config.load import load_config

GOLDEN = ROOT / "tests" / "golden" / "run_vllm_bench.py"
FAKE = ROOT / "tests" / "vllm_bench_fake.py"
MODEL = str(ROOT / "config" / "standin-model")
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total")  # fmt: skip


def fake_vllm(folder: Path) -> Path:
    """`vllm` that runs the recording fake client; returns the folder to put first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "vllm"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    shim.chmod(0o755)
    return folder


def recorded(path: Path) -> list[list[str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def guide_argv(work: Workload, target: Target, tmp_path: Path) -> list[str]:
    """What the guide's script runs, its TODO constants set to the target (as the guide tells operators)."""
    script = GOLDEN.read_text(encoding="utf-8")
    for old, new in (('BENCH_HOST = "localhost"', f'BENCH_HOST = "{target.host}"'),
                     ("BENCH_PORT = 8080", f"BENCH_PORT = {target.port}"),
                     ('MODEL = "dsv4"', f'MODEL = "{target.model}"'),
                     ('TOKENIZER_PATH = "/mnt/cephfs/models/DeepSeek-V4-Flash-w8a8-mtp"',
                      f'TOKENIZER_PATH = "{target.tokenizer}"')):  # fmt: skip
        assert old in script
        script = script.replace(old, new)
    (tmp_path / "run_vllm_bench.py").write_text(script, encoding="utf-8")
    record = tmp_path / "guide.jsonl"
    args = ["--total-len", str(work.total_len), "--repeat-prefix-ratio", str(work.repeat_prefix_ratio),
            "--output-len", str(work.output_len), "--num-prompts", str(work.num_prompts), "--num-prefixes",
            str(work.num_prefixes), "--concurrency", str(work.concurrency), "--seed", str(work.seed)]  # fmt: skip
    if work.request_rate is not None:
        args += ["--request-rate", str(work.request_rate)]
    env = {"PATH": f"{fake_vllm(tmp_path / 'bin')}:/usr/bin:/bin", "VLLM_BENCH_RECORD": str(record),
           "VLLM_BENCH_RECORD_ONLY": "1"}  # fmt: skip
    out = subprocess.run([sys.executable, str(tmp_path / "run_vllm_bench.py"), *args], env=env, capture_output=True,
                         text=True, timeout=30, check=True)  # fmt: skip
    assert "=======bench info========" in out.stdout
    (argv,) = recorded(record)
    return argv


@pytest.mark.parametrize("rate", [None, 2.5])
def test_command_is_the_guides_script_flag_for_flag(tmp_path: Path, rate: float | None) -> None:
    work = Workload(32768, 0.9, 512, 50, 10, 8, seed=1002, request_rate=rate)  # the guide's example run
    target = Target("127.0.0.1", 18020, "dsv4", "/mnt/models/DeepSeek-V4-Flash-w8a8-mtp", "test", ())
    ours = bench_command("/usr/bin/vllm", work, target, "/out", "vllm-bench-1.json")
    assert ours[0] == "/usr/bin/vllm"
    assert ours[1:-5] == guide_argv(work, target, tmp_path)
    assert ours[-5:] == ["--save-result", "--result-dir", "/out", "--result-filename", "vllm-bench-1.json"]
    assert (work.prefix_len, work.suffix_len) == (29491, 3277)


def test_target_is_the_proxy_on_a_pd_master_and_the_vllm_elsewhere() -> None:
    path = ROOT / "config" / "dsv4-flash-a2-8node.yaml"
    master = config_target(load_config(path, node="a2-0"))
    assert (master.host, master.port, master.model) == ("10.0.0.1", 18020, "deepseek_v4")
    assert master.tokenizer == "/home/117_share/weight/DeepSeek-V4-Flash-w8a8-mtp/"
    assert len(master.metrics_urls) == 8 + 32 and "http://10.0.0.5:7107/metrics" in master.metrics_urls
    decode = config_target(load_config(path, node="a2-4"))
    assert (decode.host, decode.port, decode.metrics_urls) == ("127.0.0.1", 7100, ("http://127.0.0.1:7100/metrics",))
    local = config_target(load_config(ROOT / "config" / "local.yaml"))
    assert (local.host, local.port, local.model, local.tokenizer) == ("127.0.0.1", 8080, "dsv4", MODEL)


def test_command_line_overrides() -> None:
    base = Target("10.0.0.1", 18020, "dsv4", "/m", "PD proxy 'proxy'", ("http://10.0.0.2:7100/metrics",))
    assert override_target(base, None, None, None, None, []) == base
    moved = override_target(base, None, 9000, "other", None, [])
    assert (moved.port, moved.model, moved.tokenizer, moved.metrics_urls) == (
        9000, "other", "/m", ("http://10.0.0.1:9000/metrics",))  # fmt: skip
    assert override_target(base, None, None, None, None, ["http://x:1/metrics"]).metrics_urls == ("http://x:1/metrics",)
    with pytest.raises(benchcmd.BenchError, match="give --model, --tokenizer"):
        override_target(None, "h", 1, None, None, [])


# ---- against the stand-in --------------------------------------------------------------------------------------


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[int]:
    """A real `vllm-standin serve` tree with a small local cache, so a run has local and external hits."""
    port = free_port()
    env = {**os.environ, "VLLM_STANDIN_STARTUP_DELAY_S": "0", "VLLM_STANDIN_LOCAL_BLOCKS": "12",
           "VLLM_STANDIN_ORPHAN_EXIT_S": "60", "TMPDIR": str(tmp_path)}  # fmt: skip
    with open(tmp_path / "standin.log", "wb") as log:
        proc = subprocess.Popen([str(BIN / "vllm-standin"), "serve", MODEL, "--port", str(port), "--served-model-name",
                                 "dsv4", "--tensor-parallel-size", "1"], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)  # fmt: skip
    try:
        wait_for("the stand-in to serve", lambda: proc.poll() is None and counters(port) is not None, 30)
        yield port
    finally:
        for pid in session_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


def counters(port: int) -> dict[str, float] | None:
    """The four prefix-cache counters, summed, read independently of nodeagent.vllm.cachehit."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    sums = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def chat(port: int, text: str) -> None:
    body = {"model": "dsv4", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10).read()


def bench_config(tmp_path: Path, port: int) -> Path:
    data = tiny_config(tmp_path / "home")
    data["node"]["npus"] = 0
    data["components"] = {"vllm": {"kind": "vllm", "command": "vllm-standin", "model": MODEL, "port": port,
                                   "served_model_name": "dsv4", "tensor_parallel_size": 1}}  # fmt: skip
    return write_config(tmp_path / "config.yaml", data)


WORK = ["--total-len", "96", "--repeat-prefix-ratio", "0.75", "--output-len", "4", "--num-prompts", "8",
        "--num-prefixes", "2", "--concurrency", "2"]  # fmt: skip


def run_ctl(config: Path, tmp_path: Path, *extra: str, path: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """nodeagentctl bench in a clean environment, the fake client first on PATH."""
    env = {"PATH": path or f"{fake_vllm(tmp_path / 'bin')}:/usr/bin:/bin", "HOME": str(tmp_path),
           "VLLM_BENCH_RECORD": str(tmp_path / "calls.jsonl"), **(env or {})}  # fmt: skip
    argv = [str(BIN / "nodeagentctl"), "--config", str(config), "bench", *WORK, "--output-dir", str(tmp_path / "out")]
    return subprocess.run([*argv, *extra], env=env, capture_output=True, text=True, timeout=120)


def expected_argv(port: int, out: Path, result_file: str) -> list[str]:
    return ["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name",
            "prefix_repetition", "--prefix-repetition-prefix-len", "72", "--prefix-repetition-suffix-len", "24",
            "--prefix-repetition-output-len", "4", "--num-prompts", "8", "--prefix-repetition-num-prefixes", "2",
            "--ignore-eos", "--model", "dsv4", "--tokenizer", MODEL, "--seed", "1000", "--host", "127.0.0.1",
            "--port", str(port), "--max-concurrency", "2", "--save-result", "--result-dir", str(out),
            "--result-filename", result_file]  # fmt: skip


def test_bench_against_the_standin(standin: int, tmp_path: Path) -> None:
    config = bench_config(tmp_path, standin)
    for _ in range(2):  # earlier traffic, all hits the second time: the run's rates must leave it out
        chat(standin, " ".join(f"warm{i}" for i in range(200)))
    before = counters(standin)
    assert before is not None and before[COUNTERS[1]] + before[COUNTERS[3]] > 0
    out = run_ctl(config, tmp_path)
    after = counters(standin)
    assert out.returncode == 0, out.stderr
    # Progress passes through; the script's banner comes first.
    assert out.stdout.startswith("=======bench info========\n总长度: 96\n重复前缀率: 0.75\n前缀长度: 72\n")
    assert "fake bench: 8/8 requests done" in out.stderr and "Serving Benchmark Result" in out.stdout
    (saved,) = (tmp_path / "out").glob("dsv4-bench-*.json")
    report = json.loads(saved.read_text())
    vllm_file = Path(report["vllm_result_file"])
    (argv,) = recorded(tmp_path / "calls.jsonl")
    assert argv == expected_argv(standin, tmp_path / "out", vllm_file.name)
    assert report["command"][1:] == argv and report["exit_code"] == 0

    assert after is not None
    q, h, eq, eh = (after[k] - before[k] for k in COUNTERS)
    assert h > 0 and eh > 0, "the workload should hit both caches"
    cache = report["cache"]
    assert (cache["local_queries"], cache["local_hits"], cache["external_queries"], cache["external_hits"]) == (
        q, h, eq, eh)  # fmt: skip
    assert cache["local_hit_rate"] == pytest.approx(h / q)
    assert cache["external_hit_rate"] == pytest.approx(eh / eq)
    assert cache["effective_hit_rate"] == pytest.approx((h + eh) / q)
    assert cache["vllm_restarted"] is False and report["cache_error"] is None

    written = json.loads(vllm_file.read_text())
    assert report["vllm"]["completed"] == 8 and report["vllm"]["failed"] == 0
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "duration"):
        assert report["vllm"][key] == written[key]
    assert "generated_texts" not in report["vllm"]
    line = f"local {h / q * 100:.2f}% · external {eh / eq * 100:.2f}% · effective {(h + eh) / q * 100:.2f}%"
    assert line in out.stdout
    assert f"saved: {saved}" in out.stdout


def test_json_output_and_a_failing_client(standin: int, tmp_path: Path) -> None:
    """--json: stdout is the saved JSON alone (vllm's output goes to stderr); a failing client's exit code is
    nodeagentctl's, and what it saved is still reported."""
    config = bench_config(tmp_path, standin)
    out = run_ctl(config, tmp_path, "--json", "--seed", "7", "--request-rate", "50", env={"VLLM_BENCH_EXIT": "3"})
    assert out.returncode == 3, out.stderr
    report = json.loads(out.stdout)
    assert "Serving Benchmark Result" in out.stderr and "=======bench info" in out.stderr
    assert Path(report["saved"]).read_text().strip() == json.dumps(report, indent=2)
    assert report["command"][-7:-5] == ["--request-rate", "50.0"] and report["workload"]["seed"] == 7
    assert report["exit_code"] == 3 and report["vllm"]["completed"] == 8 and report["cache"]["local_queries"] > 0


def test_no_vllm_is_one_clear_line(tmp_path: Path) -> None:
    config = bench_config(tmp_path, free_port())
    empty = tmp_path / "nothing"
    empty.mkdir()
    out = run_ctl(config, tmp_path, path=str(empty))
    assert out.returncode == benchcmd.EXIT_NO_VLLM
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("nodeagentctl: vllm not found (vllm on PATH)")
    assert not (tmp_path / "out").exists()


def test_bad_arguments_and_unreachable_metrics(tmp_path: Path) -> None:
    config = bench_config(tmp_path, free_port())
    assert run_ctl(config, tmp_path, "--repeat-prefix-ratio", "1.5").returncode == 2
    out = run_ctl(config, tmp_path, "--vllm", str(tmp_path / "no-such-vllm"))
    assert out.returncode == benchcmd.EXIT_NO_VLLM and "no-such-vllm" in out.stderr

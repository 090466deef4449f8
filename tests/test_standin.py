"""The vLLM stand-in: pure prefix-cache simulation, command line, and the real process tree over HTTP.

Every process started here is tracked by PID (API server, EngineCore and workers as soon as they
exist) and SIGKILLed at teardown even when a test fails; VLLM_STANDIN_ORPHAN_EXIT_S is a second
safety net for orphans of a crashed test run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from conftest import free_port
from vllm_standin.cache_sim import PrefixCacheSim, block_hashes, tokenize
from vllm_standin.vllm import (
    HitRateWindow,
    UsageError,
    main,
    parse_fault,
    parse_serve_args,
    render_chat,
)

MODEL_PATH = str(Path(__file__).resolve().parents[1] / "config" / "standin-model")  # vllm needs a real folder
KV_TRANSFER = """{
  "kv_connector": "YuanRongConnector",
  "kv_role": "kv_both",
  "kv_connector_extra_config": {"worker_addr": "127.0.0.1:31501", "enable_layerwise": false}
}"""


def rendered_argv(port: int) -> list[str]:
    """The argv the agent renders for `vllm serve` (after `vllm`), with our port."""
    return [
        "serve", MODEL_PATH, "--max_model_len", "204800", "--max-num-batched-tokens", "4096",
        "--served-model-name", "dsv4", "--gpu-memory-utilization", "0.9", "--max-num-seqs", "8",
        "--data-parallel-size", "1", "--tensor-parallel-size", "8", "--enable-expert-parallel",
        "--tokenizer-mode", "deepseek_v4", "--tool-call-parser", "deepseek_v4", "--enable-auto-tool-choice",
        "--reasoning-parser", "deepseek_v4", "--safetensors-load-strategy", "prefetch", "--enable-prefix-caching",
        '--model-loader-extra-config={"enable_multithread_load": "true", "num_threads": 128}',
        "--quantization", "ascend", "--trust-remote-code", "--port", str(port), "--block-size", "128",
        "--no-disable-hybrid-kv-cache-manager", "--kv-transfer-config", KV_TRANSFER,
        "--speculative-config", '{"num_speculative_tokens": 1, "method": "deepseek_mtp"}',
        "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [8, 16]}',
        "--async-scheduling", "--additional-config", '{"ascend_scheduler_config": {"enabled": false}}',
    ]  # fmt: skip




def wait_until(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def title(proc: psutil.Process) -> str:
    try:
        return (proc.cmdline() or [""])[0]
    except psutil.Error:
        return ""


class StandIn:
    """One `vllm-standin` process tree; remembers every PID it has seen for the teardown."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, port: int) -> None:
        self.port = port
        self.log_path = log_path
        self.env = env
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_standin.vllm", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.api = psutil.Process(self.proc.pid)
        self.seen: dict[int, psutil.Process] = {self.proc.pid: self.api}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            for child in self.api.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        return [p for pid, p in self.seen.items() if pid != self.proc.pid]

    def engine(self) -> psutil.Process:
        return next(p for p in self.descendants() if title(p).startswith("VLLM::EngineCore"))

    def workers(self) -> list[psutil.Process]:
        return [p for p in self.descendants() if title(p).startswith("VLLM::Worker_TP")]

    def wait_ready(self, workers: int, timeout: float = 15.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"stand-in exited with {self.proc.returncode}:\n{self.output()}")
            self.descendants()
            return port_open(self.port) and len(self.workers()) == workers

        wait_until("the stand-in to listen", ready, timeout)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float) -> int:
        """Wait for the API server to exit, recording its children meanwhile (they may be short-lived)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"stand-in still running after {timeout}s")
            self.descendants()
            time.sleep(0.02)
        return self.proc.returncode

    def kill_all(self) -> None:
        """SIGTERM first (the tree reaps itself and removes its socket), then SIGKILL what is left, by PID."""
        self.descendants()
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=3)
        for proc in self.seen.values():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


class Launcher:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.instances: list[StandIn] = []

    def start(
        self,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        workers: int = 1,
        wait: bool = True,
        port: int | None = None,
        tp: int | None = None,
    ) -> StandIn:
        port = free_port() if port is None else port
        if argv is None:
            argv = ["serve", MODEL_PATH, "--served-model-name", "dsv4", "--port", str(port)]
            argv += ["--tensor-parallel-size", str(workers if tp is None else tp)]
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_STANDIN_", "VLLM_LOG"))}
        full_env = {
            **inherited,
            "TMPDIR": str(self.workdir),
            "VLLM_STANDIN_STARTUP_DELAY_S": "0.3",
            "VLLM_STANDIN_ORPHAN_EXIT_S": "30",
            **(env or {}),
        }
        instance = StandIn(argv, full_env, self.workdir / f"standin-{len(self.instances)}.log", port)
        self.instances.append(instance)
        if wait:
            instance.wait_ready(workers)
        return instance

    def cleanup(self) -> None:
        for instance in self.instances:
            instance.kill_all()


@pytest.fixture
def launcher() -> Iterator[Launcher]:
    workdir = Path(tempfile.mkdtemp(prefix="vsi-", dir="/tmp"))
    launch = Launcher(workdir)
    try:
        yield launch
    finally:
        launch.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def shared() -> Iterator[StandIn]:
    """The agent's full rendered command line (TP 8), a tiny local cache so eviction is quick to reach."""
    workdir = Path(tempfile.mkdtemp(prefix="vss-", dir="/tmp"))
    launch = Launcher(workdir)
    try:
        port = free_port()
        env = {"VLLM_STANDIN_LOCAL_BLOCKS": "12", "VLLM_LOG_STATS_INTERVAL": "0.5"}
        yield launch.start(rendered_argv(port), env=env, workers=8, port=port)
    finally:
        launch.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


async def chat(
    session: aiohttp.ClientSession,
    base: str,
    content: str,
    timeout: float = 10.0,
    **extra: Any,
) -> tuple[int, dict[str, Any]]:
    body = {"model": "dsv4", "messages": [{"role": "user", "content": content}], **extra}
    async with session.post(f"{base}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(timeout)) as r:
        return r.status, await r.json()


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(session: aiohttp.ClientSession, base: str) -> Samples:
    """Prometheus samples keyed by (name, labels)."""
    async with session.get(f"{base}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    samples: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE_RE.match(line)
        if match and not line.startswith("#"):
            labels = frozenset(_LABEL_RE.findall(match.group(2) or ""))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def metric(samples: Samples, name: str, **extra: str) -> float:
    """A vLLM sample for our served model and engine 0 (KeyError if it is not exposed)."""
    labels = frozenset({"model_name": "dsv4", "engine": "0", **extra}.items())
    return samples[(name, labels)]


def post_json(url: str, body: dict[str, Any], timeout: float = 10.0) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status


# ---------------------------------------------------------------- pure simulation


def test_tokenize_splits_words_and_punctuation() -> None:
    assert tokenize("Hello, wonderful-world!") == ["Hello", ",", "wonderfu", "l", "-", "world", "!"]


def test_block_hashes_chain_on_the_prefix() -> None:
    tokens = [f"t{i}" for i in range(40)]
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2
    changed_early = ["x", *tokens[1:]]
    assert block_hashes(changed_early, 16)[1] != hashes[1]
    assert block_hashes(tokens[:32] + ["other"] * 8, 16) == hashes


def test_cache_sim_shared_prefix_hits_locally() -> None:
    sim = PrefixCacheSim(block_size=16, local_blocks=64, external_blocks=0)
    prompt = [f"w{i}" for i in range(50)]
    first = sim.lookup(prompt)
    sim.store(prompt)
    assert (first.num_tokens, first.local_hit_tokens, first.external_query_tokens) == (50, 0, 0)
    again = sim.lookup(prompt)
    assert again.local_hit_tokens == 48
    longer = sim.lookup([*prompt[:40], *(f"new{i}" for i in range(30))])
    assert longer.local_hit_tokens == 32


def test_cache_sim_always_recomputes_the_last_token() -> None:
    sim = PrefixCacheSim(block_size=16, local_blocks=64, external_blocks=64)
    prompt = [f"w{i}" for i in range(32)]
    sim.store(prompt)
    found = sim.lookup(prompt)
    assert found.local_hit_tokens == 16
    assert found.external_query_tokens == 16 and found.external_hit_tokens == 0


def test_cache_sim_external_store_serves_what_local_evicted() -> None:
    sim = PrefixCacheSim(block_size=16, local_blocks=4, external_blocks=100)
    a = [f"a{i}" for i in range(49)]
    sim.store(a)
    for n in range(3):
        sim.store([f"other{n}-{i}" for i in range(64)])
    found = sim.lookup(a)
    assert found.local_hit_tokens == 0
    assert found.external_query_tokens == 49
    assert found.external_hit_tokens == 48
    assert found.computed_tokens == 48


def test_cache_sim_partial_local_hit_continues_in_external() -> None:
    sim = PrefixCacheSim(block_size=2, local_blocks=3, external_blocks=100)
    prompt = [str(i) for i in range(13)]
    sim.store(prompt)
    assert len(sim.local) == 3
    sim.local.add(block_hashes(prompt, 2)[0])
    found = sim.lookup(prompt)
    assert found.local_hit_tokens == 2
    assert found.external_query_tokens == 11
    assert found.external_hit_tokens == 10


def test_cache_sim_lru_keeps_recently_used_blocks() -> None:
    sim = PrefixCacheSim(block_size=4, local_blocks=2, external_blocks=0)
    a, b, c = ([f"{k}{i}" for i in range(5)] for k in "abc")
    sim.store(a)
    sim.store(b)
    assert sim.lookup(a).local_hit_tokens == 4
    sim.store(c)
    assert sim.lookup(a).local_hit_tokens == 4
    assert sim.lookup(b).local_hit_tokens == 0


def test_hit_rate_window_forgets_old_requests() -> None:
    window = HitRateWindow(max_requests=2)
    assert window.empty and window.hit_rate == 0.0
    window.observe(1, 100, 0)
    window.observe(1, 100, 100)
    assert window.hit_rate == 50.0
    window.observe(1, 100, 100)
    assert window.hit_rate == 100.0


def test_render_chat_keeps_previous_turns_as_a_prefix() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"}]
    assert render_chat(second).startswith(render_chat(first) + "hello there")


# ---------------------------------------------------------------- command line


def test_parse_full_rendered_command_line() -> None:
    args = parse_serve_args(rendered_argv(8080)[1:])
    assert args.model == MODEL_PATH
    assert args.served_model_names == ["dsv4"]
    assert (args.port, args.host, args.max_num_seqs, args.tensor_parallel_size) == (8080, "127.0.0.1", 8, 8)
    assert args.max_model_len == 204800
    assert args.enable_prefix_caching
    assert args.kv_transfer_config is not None and args.kv_transfer_config["kv_role"] == "kv_both"
    assert args.block_size == 128
    assert "--async-scheduling" in args.ignored and "--headless" not in args.ignored


def test_parse_other_flag_forms() -> None:
    argv = ["--headless", "--model", "/m", "--host", "0.0.0.0", "-tp", "2", "--max-model-len", "32k", "--port=9"]
    args = parse_serve_args(argv)
    assert args.model == "/m" and args.served_model_names == ["/m"] and args.host == "0.0.0.0"
    assert (args.tensor_parallel_size, args.max_model_len, args.port) == (2, 32000, 9)
    names = parse_serve_args(["/m", "--served-model-name", "a", "b", "--no-enable-prefix-caching"])
    assert names.served_model_names == ["a", "b"] and not names.enable_prefix_caching
    with pytest.raises(UsageError):
        parse_serve_args(["--port", "8080"])
    with pytest.raises(UsageError):
        parse_serve_args(["/m", "--port", "http"])


def test_main_rejects_bad_command_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["run", "/m"]) == 2
    assert main(["serve"]) == 2
    assert "model_tag" in capsys.readouterr().err
    assert main(["--version"]) == 0


def test_parse_fault_specs() -> None:
    assert parse_fault("none") == ("none", 0)
    assert parse_fault("hang") == ("hang", 0)
    assert parse_fault("503") == ("503", 0)
    assert parse_fault("crash_after:3") == ("crash_after", 3)
    for bad in ("crash_after", "explode", "hang:2"):
        with pytest.raises(ValueError):
            parse_fault(bad)


# ---------------------------------------------------------------- the process tree over HTTP


async def test_full_command_line_serves_and_builds_the_vllm_tree(shared: StandIn) -> None:
    engine = shared.engine()
    workers = shared.workers()
    assert engine.ppid() == shared.proc.pid
    assert sorted(title(w) for w in workers) == [f"VLLM::Worker_TP{i}" for i in range(8)]
    assert all(w.ppid() == engine.pid for w in workers)
    pgid = os.getpgid(shared.proc.pid)
    assert {os.getpgid(p.pid) for p in [engine, *workers]} == {pgid}
    assert "serve" in shared.api.cmdline() and MODEL_PATH in shared.api.cmdline()
    sockets = list(Path(shared.env["TMPDIR"]).glob("vllm-standin-*.sock"))
    assert len(sockets) == 1
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{shared.url}/health") as response:
            assert response.status == 200 and await response.read() == b""
        async with session.get(f"{shared.url}/v1/models") as response:
            models = await response.json()
    assert models["object"] == "list"
    assert [(m["id"], m["root"], m["max_model_len"]) for m in models["data"]] == [("dsv4", MODEL_PATH, 204800)]
    out = shared.output()
    assert f"Starting vLLM API server 0 on http://127.0.0.1:{shared.port}" in out
    assert "Application startup complete." in out


async def test_chat_completion_non_streaming(shared: StandIn) -> None:
    async with aiohttp.ClientSession() as session:
        status, body = await chat(
            session,
            shared.url,
            "Explain prefix caching briefly.",
            max_tokens=5,
            temperature=0.6,
            chat_template_kwargs={"thinking": False},
        )
        assert status == 200
        assert body["object"] == "chat.completion" and body["model"] == "dsv4"
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert len(choice["message"]["content"].split()) == 5
        assert choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 5
        prompt_tokens = len(tokenize(render_chat([{"role": "user", "content": "Explain prefix caching briefly."}])))
        assert body["usage"]["prompt_tokens"] == prompt_tokens
        status, body = await chat(session, shared.url, "And without a limit?")
        assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
        assert 24 <= body["usage"]["completion_tokens"] <= 64
        status, body = await chat(session, shared.url, "forced length", max_tokens=70, ignore_eos=True)
        assert status == 200 and body["usage"]["completion_tokens"] == 70


async def test_chat_errors_look_like_vllm(shared: StandIn) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{shared.url}/v1/chat/completions", json=body) as response:
            assert response.status == 404
            error = (await response.json())["error"]
        assert error["type"] == "NotFoundError" and error["code"] == 404 and "gpt-4" in error["message"]
        async with session.post(f"{shared.url}/v1/chat/completions", data=b"{not json") as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == 400
        async with session.post(f"{shared.url}/v1/chat/completions", json={"model": "dsv4"}) as response:
            assert response.status == 400


async def test_chat_completion_streaming(shared: StandIn) -> None:
    body = {
        "model": "dsv4",
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{shared.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = (await response.read()).decode()
    events = [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 9
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9


async def test_completions_endpoint(shared: StandIn) -> None:
    body = {"model": "dsv4", "prompt": "Once upon a time", "max_tokens": 3}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{shared.url}/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        result = await response.json()
    assert result["object"] == "text_completion"
    assert len(result["choices"][0]["text"].split()) == 3


async def test_metrics_names_labels_and_prefix_cache_counters(shared: StandIn) -> None:
    tag = uuid.uuid4().hex
    prompt = f"{tag} " + " ".join(f"word{i}" for i in range(80))
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, shared.url)
        for name in (
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:external_prefix_cache_queries_total",
            "vllm:external_prefix_cache_hits_total",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count",
        ):
            metric(before, name)
        metric(before, "vllm:time_to_first_token_seconds_bucket", le="0.001")
        for reason in ("stop", "length", "abort"):
            metric(before, "vllm:request_success_total", finished_reason=reason)

        async def delta_after(content: str) -> Samples:
            start = await scrape(session, shared.url)
            status, _ = await chat(session, shared.url, content, max_tokens=4)
            assert status == 200
            end = await scrape(session, shared.url)
            return {k: end[k] - start.get(k, 0.0) for k in end}

        n_tokens = len(tokenize(render_chat([{"role": "user", "content": prompt}])))
        cold = await delta_after(prompt)
        assert metric(cold, "vllm:prefix_cache_queries_total") == n_tokens
        assert metric(cold, "vllm:prefix_cache_hits_total") == 0
        assert metric(cold, "vllm:external_prefix_cache_queries_total") == n_tokens
        assert metric(cold, "vllm:external_prefix_cache_hits_total") == 0
        assert metric(cold, "vllm:prompt_tokens_total") == n_tokens
        assert metric(cold, "vllm:generation_tokens_total") == 4
        assert metric(cold, "vllm:request_success_total", finished_reason="length") == 1
        assert metric(cold, "vllm:e2e_request_latency_seconds_count") == 1

        warm = await delta_after(prompt)
        cached = (n_tokens - 1) // 16 * 16
        assert metric(warm, "vllm:prefix_cache_hits_total") == cached > 0
        assert metric(warm, "vllm:external_prefix_cache_queries_total") == n_tokens - cached

        for n in range(3):
            await delta_after(f"evict {n} {tag} " + " ".join(f"x{n}y{i}" for i in range(90)))
        evicted = await delta_after(prompt)
        assert metric(evicted, "vllm:prefix_cache_hits_total") == 0
        assert metric(evicted, "vllm:external_prefix_cache_queries_total") == n_tokens
        assert metric(evicted, "vllm:external_prefix_cache_hits_total") == cached

        after = await scrape(session, shared.url)
        assert metric(after, "vllm:num_requests_running") == 0
        assert metric(after, "vllm:prompt_tokens_total") > metric(before, "vllm:prompt_tokens_total")

    def logged() -> bool:
        return bool(
            re.search(
                r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                r"Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%, "
                r"External prefix cache hit rate: [\d.]+%",
                shared.output(),
            )
        )

    await asyncio.to_thread(wait_until, "the periodic stats line", logged, 5.0)


async def test_idle_tree_is_small_and_quiet(shared: StandIn) -> None:
    await asyncio.sleep(0.5)
    tree = [shared.api, *shared.descendants()]
    assert len(tree) == 10
    cpu_before = sum(sum(p.cpu_times()[:2]) for p in tree)
    await asyncio.sleep(1.0)
    cpu_used = sum(sum(p.cpu_times()[:2]) for p in tree) - cpu_before
    memory = [p.memory_full_info() for p in tree]
    pss_mb = sum(m.pss for m in memory) / 2**20
    rss_mb = sum(m.rss for m in memory) / 2**20
    assert cpu_used < 0.1, f"idle tree used {cpu_used:.2f}s CPU in 1s"
    assert pss_mb < 100, f"idle tree PSS {pss_mb:.0f} MB (RSS {rss_mb:.0f} MB)"


def test_a_slow_engine_keeps_the_tree_alive_after_sigterm_or_ignores_it(launcher: Launcher) -> None:
    """VLLM_STANDIN_EXIT_S: the engine (and the API server, which waits for it) runs on that long after a
    SIGTERM, as an A2 engine freeing its NPUs does; `inf`: the engine ignores SIGTERM, only SIGKILL ends it."""
    slow = launcher.start(env={"VLLM_STANDIN_EXIT_S": "2"})
    tree = [slow.api, slow.engine(), *slow.workers()]
    signalled = time.monotonic()
    slow.proc.terminate()
    time.sleep(1.5)
    assert all(alive(p) for p in tree), "the whole tree runs on during the engine's exit"
    assert slow.wait_exit(10) == 0
    took = time.monotonic() - signalled
    wait_until("the tree gone", lambda: not any(alive(p) for p in tree), 5)
    assert 2.0 <= took < 5.0, took
    assert "shutting down in 2s (VLLM_STANDIN_EXIT_S" in slow.output()
    stubborn = launcher.start(env={"VLLM_STANDIN_EXIT_S": "inf"})
    engine = stubborn.engine()
    engine.terminate()
    stubborn.proc.terminate()
    time.sleep(2.5)
    assert alive(engine) and stubborn.proc.poll() is None, "SIGTERM ignored; its API server waits for it"
    assert "received SIGTERM; ignored (VLLM_STANDIN_EXIT_S=inf)" in stubborn.output()
    engine.kill()
    assert stubborn.wait_exit(10) == 0
    orphan = launcher.start(env={"VLLM_STANDIN_EXIT_S": "2"})  # the API server killed; the agent stops the rest
    engine, workers = orphan.engine(), orphan.workers()
    orphan.proc.kill()
    orphan.wait_exit(10)
    signalled = time.monotonic()
    for p in (engine, *workers):
        p.terminate()
    time.sleep(1.5)
    assert alive(engine), "the orphaned engine runs on while its workers go: a shutdown, not a crash"
    wait_until("the orphaned engine gone", lambda: not alive(engine), 5)
    assert 2.0 <= time.monotonic() - signalled < 5.0
    assert "died unexpectedly" not in orphan.output()


def test_port_is_bound_only_after_the_startup_delay(launcher: Launcher) -> None:
    started = time.monotonic()
    standin = launcher.start(env={"VLLM_STANDIN_STARTUP_DELAY_S": "1.5"}, wait=False)
    refused_until = started + 1.2
    while time.monotonic() < refused_until:
        assert not port_open(standin.port), "the port was bound during the startup delay"
        assert standin.proc.poll() is None
        time.sleep(0.05)
    wait_until("the stand-in to listen", lambda: port_open(standin.port), 10.0)
    assert time.monotonic() - started >= 1.5
    out = standin.output()
    assert out.index("Loading weights took") < out.index("Starting vLLM API server")


async def test_fault_modes_switch_at_run_time(launcher: Launcher) -> None:
    standin = launcher.start()
    base = standin.url

    async def fault(session: aiohttp.ClientSession, **body: Any) -> tuple[int, dict[str, Any]]:
        async with session.post(f"{base}/standin/fault", json=body) as response:
            return response.status, await response.json()

    async def status_of(session: aiohttp.ClientSession, path: str) -> int:
        async with session.get(f"{base}{path}") as response:
            return response.status

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/standin/fault") as response:
            assert await response.json() == {"mode": "none", "n": 0}

        assert await fault(session, mode="hang") == (200, {"mode": "hang", "n": 0})
        with pytest.raises(asyncio.TimeoutError):
            await chat(session, base, "are you there?", timeout=1.0, max_tokens=3)
        assert await status_of(session, "/health") == 200
        assert await fault(session, mode="none") == (200, {"mode": "none", "n": 0})
        status, body = await chat(session, base, "back again?", max_tokens=3)
        assert status == 200 and len(body["choices"][0]["message"]["content"].split()) == 3

        await fault(session, mode="empty")
        status, body = await chat(session, base, "say nothing", max_tokens=3)
        assert status == 200 and body["choices"][0]["message"]["content"] == ""

        await fault(session, mode="503")
        assert await status_of(session, "/health") == 503
        assert await status_of(session, "/v1/models") == 503
        status, _ = await chat(session, base, "hello?")
        assert status == 503
        assert await status_of(session, "/metrics") == 200
        assert await status_of(session, "/standin/fault") == 200

        await fault(session, mode="none")
        assert await status_of(session, "/health") == 200
        assert (await fault(session, mode="explode"))[0] == 400
        assert (await fault(session, mode="crash_after"))[0] == 400

        assert await fault(session, mode="crash_after", n=1) == (200, {"mode": "crash_after", "n": 1})
        status, _ = await chat(session, base, "last words", max_tokens=2)
        assert status == 200
    code = await asyncio.to_thread(standin.proc.wait, 5.0)
    assert code != 0
    assert "EngineCore encountered a fatal error" in standin.output()


async def test_served_and_failed_requests_show_in_the_metrics_a_rollouts_bake_reads(launcher: Launcher) -> None:
    """vLLM's http_requests_total (the instrumentator's, status grouped) and the TTFT histogram, as
    `cluster.rollout_bake.parse_serving` reads them."""
    from nodeagent.cluster.rollout.bake import parse_serving

    standin = launcher.start()
    base = standin.url
    async with aiohttp.ClientSession() as session:
        for n in range(2):
            assert (await chat(session, base, f"q{n}", max_tokens=2))[0] == 200
        async with session.post(f"{base}/standin/fault", json={"mode": "503"}) as response:
            assert response.status == 200
        assert (await chat(session, base, "hello?"))[0] == 503
        async with session.get(f"{base}/metrics") as response:
            text = await response.text()
    assert 'http_requests_total{handler="/v1/chat/completions",method="POST",status="5xx"} 1.0' in text
    served = parse_serving(text)
    assert (served.requests, served.errors, served.ttft_count) == (3, 1, 2)


async def test_a_decoder_fails_kv_from_a_prefill_engine_with_another_connector(launcher: Launcher) -> None:
    """A producer's handle names its KV connector; a consumer handed KV from another one fails the pull (what an
    incompatible change mixed behind one proxy does: the rollout's system test looks for that line)."""

    def kv(role: str, direct: bool) -> str:
        return json.dumps({"kv_connector": "MultiConnector", "kv_role": role, "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "MooncakeConnectorV1", "kv_port": 30000,
                            "kv_connector_extra_config": {"use_ascend_direct": direct}}]}})  # fmt: skip

    def argv(port: int, role: str, direct: bool) -> list[str]:
        return ["serve", MODEL_PATH, "--served-model-name", "dsv4", "--port", str(port), "--kv-transfer-config",
                kv(role, direct)]  # fmt: skip

    port = free_port()
    prefill = launcher.start(argv(port, "kv_producer", True), port=port)
    port = free_port()
    decode = launcher.start(argv(port, "kv_consumer", False), port=port)
    async with aiohttp.ClientSession() as session:
        status, body = await chat(session, prefill.url, "hello", max_tokens=1,
                                  kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        assert status == 200
        handle = body["kv_transfer_params"]
        assert handle["kv_connectors"] == ["MultiConnector", "MooncakeConnectorV1", "use_ascend_direct=True"]
        status, body = await chat(session, decode.url, "hello", max_tokens=2, kv_transfer_params=handle)
        assert status == 500 and "incompatible connector" in body["error"]["message"]
        same = {**handle, "kv_connectors": ["MultiConnector", "MooncakeConnectorV1", "use_ascend_direct=False"]}
        assert (await chat(session, decode.url, "hello", max_tokens=2, kv_transfer_params=same))[0] == 200
    assert "ret=-1 (KV connector mismatch: the prefill engine runs MultiConnector/MooncakeConnectorV1/" \
           "use_ascend_direct=True, this one MultiConnector/MooncakeConnectorV1/use_ascend_direct=False)." \
           in decode.log_path.read_text()


def test_crash_after_from_env_then_api_server_exits_non_zero(launcher: Launcher) -> None:
    standin = launcher.start(env={"VLLM_STANDIN_FAULT": "crash_after:2"}, workers=2)
    tree = standin.descendants()
    for n in range(2):
        body = {"messages": [{"role": "user", "content": f"q{n}"}], "max_tokens": 2}
        assert post_json(f"{standin.url}/v1/chat/completions", body) == 200
    started = time.monotonic()
    assert standin.proc.wait(timeout=5) != 0
    assert time.monotonic() - started < 5
    wait_until("the engine and workers to exit", lambda: not any(alive(p) for p in tree), 3.0)
    assert not list(Path(standin.env["TMPDIR"]).glob("*.sock"))


def test_sigterm_stops_the_whole_tree_cleanly(launcher: Launcher) -> None:
    standin = launcher.start(workers=2)
    tree = standin.descendants()
    assert len(tree) == 3
    started = time.monotonic()
    standin.proc.send_signal(signal.SIGTERM)
    assert standin.proc.wait(timeout=5) == 0
    assert time.monotonic() - started < 2.5
    wait_until("no process of the tree", lambda: not any(alive(p) for p in tree), 1.0)
    assert not list(Path(standin.env["TMPDIR"]).glob("*.sock"))
    assert "Application shutdown complete." in standin.output()


def test_sigkill_of_api_server_orphans_engine_and_workers(launcher: Launcher, tmp_path: Path) -> None:
    lock = str(tmp_path / "npu.lock")
    standin = launcher.start(workers=2, env={"VLLM_STANDIN_DEVICE_LOCK": lock})
    engine = standin.engine()
    workers = standin.workers()
    pgid = os.getpgid(standin.proc.pid)
    standin.proc.kill()
    standin.proc.wait(timeout=5)
    time.sleep(1.0)
    assert alive(engine) and all(alive(w) for w in workers)
    assert engine.ppid() != standin.proc.pid
    assert title(engine) == "VLLM::EngineCore"
    assert sorted(title(w) for w in workers) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert {os.getpgid(p.pid) for p in [engine, *workers]} == {pgid}
    orphans = [
        p
        for p in psutil.process_iter()
        if title(p).startswith("VLLM::") and p.pid in {engine.pid, *(w.pid for w in workers)}
    ]
    assert len(orphans) == 3

    blocked = launcher.start(workers=1, env={"VLLM_STANDIN_DEVICE_LOCK": lock}, wait=False)
    assert blocked.wait_exit(10) != 0
    assert "device busy" in blocked.output()
    assert not port_open(blocked.port)

    engine.kill()
    wait_until("the workers to follow their engine", lambda: not any(alive(w) for w in workers), 3.0)
    again = launcher.start(workers=1, env={"VLLM_STANDIN_DEVICE_LOCK": lock})
    assert again.proc.poll() is None


def test_orphan_exit_safety_net_and_worker_override(launcher: Launcher) -> None:
    env = {"VLLM_STANDIN_ORPHAN_EXIT_S": "0.3", "VLLM_STANDIN_WORKERS": "3"}
    standin = launcher.start(workers=3, tp=1, env=env)
    tree = standin.descendants()
    assert sorted(title(p) for p in tree) == ["VLLM::EngineCore", *(f"VLLM::Worker_TP{i}" for i in range(3))]
    standin.proc.kill()
    wait_until("the orphaned tree to exit", lambda: not any(alive(p) for p in tree), 5.0)


def test_engine_death_makes_api_server_exit_non_zero(launcher: Launcher) -> None:
    standin = launcher.start(workers=2)
    workers = standin.workers()
    standin.engine().kill()
    started = time.monotonic()
    assert standin.proc.wait(timeout=5) != 0
    assert time.monotonic() - started < 5
    wait_until("the workers to exit", lambda: not any(alive(w) for w in workers), 3.0)
    assert "died unexpectedly" in standin.output()


def test_worker_death_kills_engine_and_api_server(launcher: Launcher) -> None:
    standin = launcher.start(workers=2)
    engine = standin.engine()
    standin.workers()[1].kill()
    assert standin.proc.wait(timeout=5) != 0
    wait_until("the engine to exit", lambda: not alive(engine), 3.0)
    assert "Worker proc VllmWorker-1 died unexpectedly" in standin.output()


async def test_stopped_engine_hangs_completions_but_not_health(launcher: Launcher) -> None:
    standin = launcher.start(workers=2)
    engine = standin.engine()
    worker = standin.workers()[0]
    async with aiohttp.ClientSession() as session:
        for stopped in (engine, worker):
            stopped.suspend()
            with pytest.raises(asyncio.TimeoutError):
                await chat(session, standin.url, "anyone?", timeout=1.0, max_tokens=2)
            async with session.get(f"{standin.url}/health") as response:
                assert response.status == 200
            stopped.resume()
            status, _ = await chat(session, standin.url, "now?", max_tokens=2)
            assert status == 200
    engine.suspend()
    tree = standin.descendants()
    started = time.monotonic()
    standin.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(standin.proc.wait, 5.0) == 0
    assert time.monotonic() - started < 3.0
    await asyncio.to_thread(wait_until, "the tree to exit", lambda: not any(alive(p) for p in tree), 2.0)


def test_port_in_use_fails_and_stops_the_engine(launcher: Launcher) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        standin = launcher.start(port=busy.getsockname()[1], wait=False)
        assert standin.wait_exit(10) == 1
    tree = standin.descendants()
    assert any(title(p) == "VLLM::EngineCore" for p in tree) or "EngineCore shut down cleanly" in standin.output()
    wait_until("the engine to be stopped", lambda: not any(alive(p) for p in tree), 2.0)
    assert "Address already in use" in standin.output()


async def _long_chat(base: str, content: str, max_tokens: int = 100000) -> None:
    body = {"model": "dsv4", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/chat/completions", json=body) as r:
        await r.read()


async def test_counters_move_per_step_and_freeze_in_a_hang_under_load(launcher: Launcher) -> None:
    env = {"VLLM_STANDIN_STEP_S": "0.05", "VLLM_STANDIN_TOKENS_PER_STEP": "1"}
    argv = ["serve", MODEL_PATH, "--served-model-name", "dsv4", "--port", str(port := free_port()),
            "--max-num-seqs", "2"]  # fmt: skip
    standin = launcher.start(argv, env=env, port=port)
    base = standin.url
    prompt = len(tokenize(render_chat([{"role": "user", "content": "tell a long story"}])))
    tasks = [asyncio.create_task(_long_chat(base, "tell a long story")) for _ in range(3)]
    try:
        async with aiohttp.ClientSession() as session:

            async def values() -> dict[str, float]:
                samples = await scrape(session, base)
                return {name: metric(samples, f"vllm:{name}") for name in (
                    "num_requests_running", "num_requests_waiting", "generation_tokens_total",
                    "prompt_tokens_total", "iteration_tokens_total_count")}  # fmt: skip

            async def settled() -> dict[str, float]:
                for _ in range(100):
                    now = await values()
                    # both prefills done (a loaded machine can show 2 running while the second still prefills)
                    if now["num_requests_running"] == 2 and now["prompt_tokens_total"] >= 2 * prompt \
                            and now["generation_tokens_total"] > 0:  # fmt: skip
                        return now
                    await asyncio.sleep(0.05)
                raise AssertionError(f"never saw 2 running with both prefills done: {now}")

            first = await settled()
            assert first["num_requests_waiting"] == 1  # --max-num-seqs 2: the third request waits
            assert first["prompt_tokens_total"] == 2 * prompt  # counted once each, when its prefill completed
            await asyncio.sleep(0.5)
            later = await values()
            steps = later["iteration_tokens_total_count"] - first["iteration_tokens_total_count"]
            tokens = later["generation_tokens_total"] - first["generation_tokens_total"]
            assert steps >= 4 and tokens == 2 * steps  # one token per running request per step
            assert later["prompt_tokens_total"] == first["prompt_tokens_total"]

            assert post_json(f"{base}/standin/fault", {"mode": "hang"}) == 200
            await asyncio.sleep(0.2)
            frozen = await values()
            await asyncio.sleep(0.5)
            assert await values() == frozen and frozen["num_requests_running"] == 2
            async with session.get(f"{base}/health") as response:
                assert response.status == 200, "a hung engine still says healthy"

            assert post_json(f"{base}/standin/fault", {"mode": "none"}) == 200
            await asyncio.sleep(0.3)
            assert (await values())["generation_tokens_total"] > frozen["generation_tokens_total"]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_long_prefill_moves_only_the_kv_cache_gauge(launcher: Launcher) -> None:
    env = {"VLLM_STANDIN_PREFILL_TOKENS_PER_S": "400", "VLLM_STANDIN_LOCAL_BLOCKS": "4096",
           "VLLM_STANDIN_EXTERNAL_BLOCKS": "0"}  # fmt: skip
    standin = launcher.start(env=env)
    content = " ".join(f"w{i}" for i in range(600))  # ~1.5 s of prefill in chunks
    task = asyncio.create_task(_long_chat(standin.url, content, max_tokens=4))
    try:
        async with aiohttp.ClientSession() as session:
            usage: list[float] = []
            for _ in range(5):
                await asyncio.sleep(0.2)
                samples = await scrape(session, standin.url)
                assert metric(samples, "vllm:num_requests_running") == 1
                assert metric(samples, "vllm:generation_tokens_total") == 0
                assert metric(samples, "vllm:iteration_tokens_total_count") == 0
                usage.append(metric(samples, "vllm:kv_cache_usage_perc"))
        assert usage == sorted(usage) and len(set(usage)) == len(usage), usage
        await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_multi_node_dp_group_is_one_unit(launcher: Launcher) -> None:
    """The head serves only once the headless node's engines joined; losing either ends the other."""
    rpc = free_port()
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
          "--data-parallel-rpc-port", str(rpc)]
    head_port = free_port()
    head = launcher.start(["serve", MODEL_PATH, "--port", str(head_port), *dp], wait=False, port=head_port)
    time.sleep(1.0)
    assert not port_open(head_port), "the head serves only once every rank joined"
    headless = launcher.start(["serve", MODEL_PATH, "--headless", "--data-parallel-start-rank", "1", *dp],
                              wait=False)
    wait_until("the head to serve", lambda: port_open(head_port), 20.0)
    assert headless.proc.poll() is None
    headless.proc.kill()
    wait_until("the head to exit", lambda: head.proc.poll() is not None, 20.0)
    assert head.proc.returncode == 1 and "the DP group lost an engine" in head.output()

    head2_port = free_port()
    head2 = launcher.start(["serve", MODEL_PATH, "--port", str(head2_port), *dp], wait=False, port=head2_port)
    headless2 = launcher.start(["serve", MODEL_PATH, "--headless", "--data-parallel-start-rank", "1", *dp],
                               wait=False)
    wait_until("the second head to serve", lambda: port_open(head2_port), 20.0)
    head2.proc.kill()
    wait_until("the headless node to exit", lambda: headless2.proc.poll() is not None, 20.0)
    assert headless2.proc.returncode == 1 and "head is gone" in headless2.output()


def test_an_externally_balanced_rank_serves_on_its_own() -> None:
    """One `vllm serve` per rank (--data-parallel-rank): no head waits for it and none binds the RPC port, so two
    ranks of one group run side by side on one machine; the internal launch's head and headless stay as they were."""
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
          "--data-parallel-rpc-port", "5000"]
    for rank in ("0", "1"):
        assert parse_serve_args([MODEL_PATH, *dp, "--data-parallel-rank", rank]).dp is None
    head = parse_serve_args([MODEL_PATH, *dp]).dp
    assert head is not None and not head.headless
    headless = parse_serve_args([MODEL_PATH, *dp, "--headless", "--data-parallel-start-rank", "1"]).dp
    assert headless is not None and headless.headless and headless.start_rank == 1

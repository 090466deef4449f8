"""vLLM 0.32's fault-tolerance API in the stand-in: the one place a stand-in stands for FT (it needs GPU all2all).

Shapes, codes and states are the wheel's (docs/architecture.md, "vLLM fault tolerance"):
`--enable-fault-tolerance` registers `GET /fault_tolerance/status` and `POST /fault_tolerance/apply`;
`--fault-tolerance-config '{"engine_recovery_timeout_sec": N}'` (no other key) sets how long an `unhealthy`
engine waits for a `retry` before it dies. Start-up refuses what vLLM refuses: FT without external load balancing
(`--data-parallel-rank` / `--data-parallel-external-lb`), with `--api-server-count` > 1, or without an FT-capable
`--all2all-backend` (deepep_low_latency, nixl_ep).

The ranks of one group find each other through a folder (`VLLM_STANDIN_FT_DIR`, default a temp folder named by
`--data-parallel-address` and `--data-parallel-rpc-port`): each rank writes its state there and reads its peers'.
A peer that turns faulty, or whose process is gone, makes this rank `unhealthy` with `fault_info`
"RuntimeError" — in vLLM its all2all times out. `retry` is collective, as in vLLM: it completes when every rank
of the group has been told to retry. `POST /standin/ft_fault {"mode": M}` makes this rank the faulty one:
`transient` (a retry recovers it), `retry_fails` (its retry fails, and so the group's), `retry_hangs` (its retry
never completes), `dead` (its executor failed: `dead`, retry refused), `none`.
The stand-in detects a peer's fault whether or not requests are running; vLLM does so at its next step.
While a rank is `unhealthy` its busy loop is parked: a request waits until the rank is healthy again (or dies),
as in vLLM, so a liveness canary times out meanwhile. `VLLM_STANDIN_FT_RETRY_S` (default 0) is how long the
collective re-initialisation takes once every rank has joined the retry (seconds on a real cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from vllm_standin.common import log

PROC = "APIServer"
FT_BACKENDS = ("deepep_low_latency", "nixl_ep")
FT_FAULT_MODES = ("none", "transient", "retry_fails", "retry_hangs", "dead")
POLL_S = 0.05
ACCEPTED_MESSAGE = "Request accepted; poll /fault_tolerance/status for updates."


@dataclass(frozen=True)
class FtSettings:
    routes: bool
    """`--enable-fault-tolerance`: the HTTP routes exist only then, as in vLLM."""
    engine: bool
    """FT in the engine: the enable flag, or a --fault-tolerance-config (vLLM turns it on with a warning)."""
    engine_recovery_timeout_sec: int = 120
    dp_rank: int | None = None
    dp_size: int = 1
    external_lb: bool = False
    all2all_backend: str = "allgather_reducescatter"
    api_server_count: int = 1
    address: str = "127.0.0.1"
    rpc_port: int = 29550

    def refusal(self) -> str | None:
        """vLLM's start-up error for an FT engine it cannot run, or None."""
        if not self.engine:
            return None
        if not (self.external_lb or self.dp_rank is not None):
            return ("ValueError: Fault tolerance requires external load balancer mode (--data-parallel-external-lb "
                    "or --data-parallel-rank). Internal LB mode is not supported.")
        if self.api_server_count > 1:
            return ("ValueError: Fault tolerance requires a single API server process (--api-server-count=1), but "
                    f"got {self.api_server_count}. The FT system assumes one AsyncMPClient manages all engines.")
        if self.all2all_backend not in FT_BACKENDS:
            return ("ValueError: Fault tolerance requires an FT-capable all2all backend (one of "
                    f"{sorted(FT_BACKENDS)}), but got '{self.all2all_backend}'.")
        return None


def _flag_values(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            continue
        name, eq, value = token.partition("=")
        name = "--" + name[2:].replace("_", "-")
        if eq:
            out.append((name, value))
        elif i < len(argv) and not argv[i].startswith("--"):
            out.append((name, argv[i]))
            i += 1
        else:
            out.append((name, None))
    return out


def _int(flag: str, value: str | None) -> int:
    try:
        return int(value or "")
    except ValueError:
        raise ValueError(f"argument {flag}: invalid int value: {value!r}") from None


def _recovery_timeout(value: str | None) -> int:
    """`--fault-tolerance-config` as vLLM's pydantic dataclass takes it: a JSON object, unknown keys forbidden."""
    flag = "--fault-tolerance-config"
    try:
        config = json.loads(value or "")
    except ValueError:
        raise ValueError(f"argument {flag}: invalid parse_dataclass value: {value!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"argument {flag}: Input should be an object: {value!r}")
    unknown = sorted(set(config) - {"engine_recovery_timeout_sec"})
    if unknown:
        raise ValueError(f"argument {flag}: {unknown[0]}: Unexpected keyword argument")
    timeout = config.get("engine_recovery_timeout_sec", 120)
    if isinstance(timeout, bool) or not isinstance(timeout, int):
        raise ValueError(f"argument {flag}: engine_recovery_timeout_sec: Input should be a valid integer")
    return timeout


def settings_from_argv(argv: Sequence[str]) -> FtSettings:
    """The FT-related flags of a `vllm serve` command line; ValueError where vLLM's argparse would fail."""
    routes, config_given, timeout = False, False, 120
    values: dict[str, str | None] = {}
    for name, value in _flag_values(argv):
        if name == "--enable-fault-tolerance":
            routes = True
        elif name == "--no-enable-fault-tolerance":
            routes = False
        elif name == "--fault-tolerance-config":
            config_given, timeout = True, _recovery_timeout(value)
        else:
            values[name] = value
    get = values.get
    return FtSettings(
        routes=routes,
        engine=routes or config_given,
        engine_recovery_timeout_sec=timeout,
        dp_rank=_int("--data-parallel-rank", get("--data-parallel-rank")) if "--data-parallel-rank" in values
        else None,
        dp_size=_int("--data-parallel-size", get("--data-parallel-size", "1")),
        external_lb="--data-parallel-external-lb" in values,
        all2all_backend=get("--all2all-backend") or "allgather_reducescatter",
        api_server_count=_int("--api-server-count", get("--api-server-count", "1")),
        address=get("--data-parallel-address") or "127.0.0.1",
        rpc_port=_int("--data-parallel-rpc-port", get("--data-parallel-rpc-port", "29550")),
    )


def group_dir(settings: FtSettings) -> Path:
    explicit = os.environ.get("VLLM_STANDIN_FT_DIR", "").strip()
    if explicit:
        return Path(explicit)
    return Path(tempfile.gettempdir()) / f"vllm-standin-ft-{settings.address}-{settings.rpc_port}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Engine(Protocol):
    proc: Any


class RankFt:
    """One rank's fault-tolerance state, shared with its peers through the group folder."""

    def __init__(self, settings: FtSettings, engine: _Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.rank = settings.dp_rank or 0
        self.dir = group_dir(settings)
        self.state = "healthy"
        self.fault_info: str | None = None
        self.ft_error: str | None = None
        self.last_ft_request_id: str | None = None
        self.fault_at = 0.0
        self.mode = "none"
        self.epoch = 0
        """Retries completed; a retry joins epoch+1 and completes once every rank has joined it."""
        self.joined: int | None = None
        self.retry_failed: int | None = None
        self.started = time.time()
        self.seen: set[int] = set()
        self.task: asyncio.Task[None] | None = None

    # ---- the group folder ----------------------------------------------------------------------------------

    def _write(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "started": self.started, "state": self.state, "origin": self.mode != "none",
                  "epoch": self.epoch, "joined": self.joined, "retry_failed": self.retry_failed}
        tmp = self.dir / f".rank{self.rank}.{os.getpid()}"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.dir / f"rank{self.rank}.json")

    def _peers(self) -> dict[int, dict[str, Any] | None]:
        """Peers this rank has seen start; None for one whose process is gone."""
        out: dict[int, dict[str, Any] | None] = {}
        for rank in range(self.settings.dp_size):
            if rank == self.rank:
                continue
            path = self.dir / f"rank{rank}.json"
            try:
                record = json.loads(path.read_text())
                written = path.stat().st_mtime
            except (OSError, ValueError):
                record, written = None, 0.0
            if record is not None and _pid_alive(int(record.get("pid", 0))):
                self.seen.add(rank)
                out[rank] = record
            elif rank in self.seen or (record is not None and written >= self.started):
                # gone — also a peer that started and died between two of our polls (its record was written
                # while we ran); a record older than this rank is a previous run's, not a peer of ours
                out[rank] = None
        return out

    # ---- state changes -------------------------------------------------------------------------------------

    def _fault(self, why: str) -> None:
        if self.state != "healthy":
            return
        self.state = "dead" if self.mode == "dead" else "unhealthy"
        self.fault_info = "RuntimeError"
        self.ft_error = self.last_ft_request_id = None
        self.fault_at = time.monotonic()
        log(PROC, "engine_core_sentinel.py:80", f"[FT] Busy loop raised RuntimeError ({why}). Waiting for recovery.",
            "WARNING")
        log(PROC, "engine_core_sentinel.py:97", f"[FT] Engine {self.rank} status -> {self.state.upper()}:")
        self._write()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode != "none":
            self._fault(f"stand-in fault mode {mode}")
        else:
            self._write()

    async def monitor(self) -> None:
        self._write()
        while True:
            await asyncio.sleep(POLL_S)
            for rank, peer in self._peers().items():
                if peer is None:
                    self._fault(f"rank {rank}'s process is gone")
                elif peer.get("origin") and int(peer.get("epoch", 0)) >= self.epoch:
                    self._fault(f"rank {rank} timed out during dispatch/combine")
            waited = time.monotonic() - self.fault_at
            if self.state != "healthy" and waited >= self.settings.engine_recovery_timeout_sec:
                self._give_up()
                return

    def _give_up(self) -> None:
        """vLLM re-raises the original error: the engine core exits and the API server follows."""
        log(PROC, "engine_core_sentinel.py:190",
            f"[FT] No recovery within {self.settings.engine_recovery_timeout_sec}s timeout.", "ERROR")
        proc = self.engine.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    async def retry(self, request_id: str) -> None:
        """The engine side of `retry`, run after the 202 as vLLM does: success shows as `healthy` again."""
        if self.state != "unhealthy":
            self._reject(request_id, f"[FT] Rejecting retry on engine {self.rank}: status is {self.state.upper()}")
            return
        target = self.epoch + 1
        if self.mode == "retry_fails":
            await asyncio.sleep(POLL_S)
            self.retry_failed = target
            self._reject(request_id, "RuntimeError: stand-in fault mode retry_fails: the all2all buffers could "
                                     "not be cleaned")
            return
        if self.mode == "retry_hangs":
            return
        self.joined = target
        self._write()
        while True:
            peers = self._peers()
            if any(p is None or p.get("retry_failed") == target for p in peers.values()):
                self._reject(request_id, "RuntimeError: the data-parallel group could not be re-initialised: a "
                                         "peer's retry failed")
                return
            if len(peers) == self.settings.dp_size - 1 and all(
                    (p.get("joined") or 0) >= target or int(p.get("epoch", 0)) >= target for p in peers.values()):
                break
            await asyncio.sleep(POLL_S)
        await asyncio.sleep(float(os.environ.get("VLLM_STANDIN_FT_RETRY_S", "0") or 0))
        self.epoch, self.joined, self.mode = target, None, "none"
        self.state, self.fault_info, self.ft_error, self.last_ft_request_id = "healthy", None, None, None
        log(PROC, "engine_core_sentinel.py:131", f"[FT] Engine {self.rank} status -> HEALTHY")
        self._write()

    async def parked(self) -> None:
        """Until the busy loop runs again: a request sent during an episode waits (vLLM queues it)."""
        while self.state == "unhealthy":
            await asyncio.sleep(POLL_S)

    def _reject(self, request_id: str, reason: str) -> None:
        log(PROC, "engine_core_sentinel.py:53", reason, "WARNING")
        self.ft_error, self.last_ft_request_id = reason, request_id
        self._write()

    def status_body(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"id": self.rank, "status": self.state}
        if self.state == "unhealthy":
            entry["fault_info"] = self.fault_info
        if self.ft_error is not None:
            entry["last_ft_request_id"] = self.last_ft_request_id
            entry["ft_error"] = self.ft_error
        return {"schema_version": 1, "total_engines": 1, "engines": [entry]}


def _bad_request(message: str) -> web.Response:
    error = {"message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response({"error": error}, status=400)


class FtRoutes:
    def __init__(self, rank: RankFt) -> None:
        self.rank = rank
        self.tasks: set[asyncio.Task[None]] = set()

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.rank.status_body())

    async def apply(self, request: web.Request) -> web.Response:
        media_type = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            return _bad_request("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = json.loads(await request.text())
        except ValueError:
            return _bad_request("Invalid JSON format")
        if not isinstance(body, dict):
            return _bad_request("Request body must be a JSON object.")
        instruction = body.get("instruction")
        if not instruction:
            return _bad_request("'instruction' is required.")
        if instruction != "retry":
            return _bad_request(f"Invalid instruction: '{instruction}'.")
        if not isinstance(body.get("params", {}), dict):
            return _bad_request("'params' must be an object.")
        request_id = str(uuid.uuid4())
        task = asyncio.create_task(self.rank.retry(request_id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return web.json_response({"message": ACCEPTED_MESSAGE, "request_id": request_id}, status=202)

    async def fault(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                body = json.loads(await request.text())
            except ValueError:
                body = None
            mode = body.get("mode") if isinstance(body, dict) else None
            if mode not in FT_FAULT_MODES:
                return _bad_request(f"mode must be one of {', '.join(FT_FAULT_MODES)}")
            self.rank.set_mode(mode)
        return web.json_response({"mode": self.rank.mode, "status": self.rank.state})


def attach(app: web.Application, argv: Sequence[str], engine: _Engine) -> RankFt | None:
    """Register the FT routes when the command line enables them; the group watch starts with the app."""
    settings = settings_from_argv(argv)
    if not settings.engine:
        return None
    rank = RankFt(settings, engine)
    if settings.routes:
        routes = FtRoutes(rank)
        app.router.add_get("/fault_tolerance/status", routes.status)
        app.router.add_post("/fault_tolerance/apply", routes.apply)
        app.router.add_get("/standin/ft_fault", routes.fault)
        app.router.add_post("/standin/ft_fault", routes.fault)

    async def start_monitor(app: web.Application) -> None:
        rank.task = asyncio.create_task(rank.monitor())

    async def stop_monitor(app: web.Application) -> None:
        if rank.task is not None:
            rank.task.cancel()

    app.on_startup.append(start_monitor)
    app.on_cleanup.append(stop_monitor)
    return rank

"""Probe kinds: one check of a component's health, as a `ProbeResult` with a one-line human detail.

`resolve_probe` (pure, in `probe_resolve`; re-exported here) fills what the config left null from the
component (URLs, paths, addresses, the vLLM probe body); `ProbeContext.run` executes a resolved probe under its
`timeout_s` without ever blocking the event loop: HTTP goes through one shared aiohttp session, commands and the
datasystem KV round trip run as subprocesses in their own process group, killed whole on timeout. A probe
reports; it never raises.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from loguru import logger

from nodeagent.config.model import NpuProbe
from nodeagent.core.bindaddr import url_host
from nodeagent.core.http import new_session
from nodeagent.core.run import run
from nodeagent.npu.tools import NpuTools
from nodeagent.probes.resolve import AnyComponent as AnyComponent
from nodeagent.probes.resolve import ProbeResult as ProbeResult
from nodeagent.probes.resolve import ResolvedProbe as ResolvedProbe
from nodeagent.probes.resolve import kv_key
from nodeagent.probes.resolve import resolve_probe as resolve_probe
from nodeagent.probes.resolve import resolve_probe_set as resolve_probe_set
from nodeagent.probes.resolve import vllm_probe_body as vllm_probe_body
from nodeagent.vllm.progress import ProgressMetricsError, ProgressMonitor, Verdict, parse_progress

LIVENESS_OK = "liveness check success"
EMPTY_READ_RETRY_S = 0.02
"""The worker rewrites its liveness file by truncate+write every ~100 ms: an empty read is retried once."""
DETAIL_MAX = 200

if TYPE_CHECKING:
    from nodeagent.npu.monitor import NpuMonitor


# ------------------------------------------------------------------------------------------------- checks


def _short(text: str, limit: int = DETAIL_MAX) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _read(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(4096)


async def check_liveness_file(path: Path, max_age_s: float) -> tuple[bool, str]:
    """Content must say success and the file must be fresh: a SIGSTOPped worker leaves it saying success."""
    try:
        content = _read(path)
        if not content.strip():
            await asyncio.sleep(EMPTY_READ_RETRY_S)
            content = _read(path)
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return False, f"liveness file {path} missing"
    except OSError as exc:
        return False, f"liveness file {path} unreadable: {exc.strerror or exc}"
    text = content.decode(errors="replace").strip()
    age = time.time() - mtime
    if not text:
        return False, f"liveness file {path} empty (read twice, {EMPTY_READ_RETRY_S * 1000:.0f} ms apart)"
    if LIVENESS_OK not in text:
        return False, f"liveness file says {_short(text, 120)!r} ({age:.1f}s old)"
    if age > max_age_s:
        return False, f"liveness file {age:.1f}s old (max {max_age_s:g}s)"
    return True, f"liveness file {max(age, 0.0):.1f}s old (max {max_age_s:g}s)"


def _os_reason(exc: OSError) -> str:
    """`Connection refused` rather than asyncio's `Connect call failed ('127.0.0.1', 1)`."""
    if isinstance(exc.errno, int) and exc.errno > 0 and not isinstance(exc, socket.gaierror):
        return os.strerror(exc.errno)
    return str(exc.strerror or exc)


def _connect_error(exc: aiohttp.ClientConnectorError, url: str) -> str:
    return f"cannot connect to {url}: {_os_reason(exc.os_error) if exc.os_error else exc}"


def _b64(data: str) -> str:
    return base64.b64encode(data.encode()).decode()


async def check_etcd(session: aiohttp.ClientSession, endpoint: str, put_get: bool, key: str | None) -> tuple[bool, str]:
    """`/health` says the member has a leader and no alarm; the put/get proves a write commits."""
    base = f"http://{endpoint}"
    try:
        async with session.get(f"{base}/health") as resp:
            text = await resp.text(errors="replace")
        try:
            health = json.loads(text)
        except ValueError:
            return False, f"etcd {endpoint} /health: HTTP {resp.status}, not JSON: {_short(text, 80)!r}"
        if not isinstance(health, dict) or health.get("health") != "true":
            reason = health.get("reason") if isinstance(health, dict) else None
            return False, f"etcd {endpoint} unhealthy: HTTP {resp.status} {_short(reason or text, 120)}"
        if not put_get:
            return True, f"etcd {endpoint} healthy"
        value = f"{time.time():.6f}-{secrets.token_hex(4)}"
        key = key or "/dsv4-agent/probe/unnamed"
        async with session.post(f"{base}/v3/kv/put", json={"key": _b64(key), "value": _b64(value)}) as resp:
            text = await resp.text(errors="replace")
            if resp.status != 200:
                return False, f"etcd {endpoint} put {key}: HTTP {resp.status} {_short(text, 120)}"
        async with session.post(f"{base}/v3/kv/range", json={"key": _b64(key)}) as resp:
            text = await resp.text(errors="replace")
            if resp.status != 200:
                return False, f"etcd {endpoint} get {key}: HTTP {resp.status} {_short(text, 120)}"
        try:
            kvs = json.loads(text).get("kvs") or []
            got = base64.b64decode(kvs[0]["value"]).decode() if kvs else None
        except (ValueError, KeyError, TypeError, AttributeError):
            return False, f"etcd {endpoint} get {key}: unexpected answer {_short(text, 120)!r}"
        if got != value:
            return False, f"etcd {endpoint} get {key} returned {got!r}, put {value!r}"
        return True, f"etcd {endpoint} healthy, put/get {key} ok"
    except aiohttp.ClientConnectorError as exc:
        return False, _connect_error(exc, base)
    except aiohttp.ClientError as exc:
        return False, f"etcd {endpoint}: {type(exc).__name__}: {_short(str(exc), 120)}"


def dig(data: Any, dotted: str) -> tuple[bool, Any]:
    """`choices.0.message.content` → (found, value): dict keys and list indexes by dotted path."""
    cur = data
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and re.fullmatch(r"-?\d+", part) and -len(cur) <= int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return False, None
    return True, cur


async def check_http(
    session: aiohttp.ClientSession,
    url: str,
    method: str = "GET",
    body: dict[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    expect_status: int = 200,
    expect_nonempty: str | None = None,
) -> tuple[bool, str]:
    """Status must match; with `expect_nonempty`, that JSON path must hold a non-empty string."""
    kwargs: dict[str, Any] = {"headers": dict(headers or {})}
    if body is not None and method != "GET":
        kwargs["json"] = body
    try:
        async with session.request(method, url, **kwargs) as resp:
            status = resp.status
            text = await resp.text(errors="replace")
    except aiohttp.ClientConnectorError as exc:
        return False, _connect_error(exc, url)
    except aiohttp.ClientError as exc:
        return False, f"{type(exc).__name__} from {url}: {_short(str(exc), 120)}"
    if status != expect_status:
        snippet = f": {_short(text, 100)}" if text.strip() else ""
        return False, f"HTTP {status} from {url} (want {expect_status}){snippet}"
    if not expect_nonempty:
        return True, f"HTTP {status} from {url}"
    try:
        data = json.loads(text)
    except ValueError:
        return False, f"HTTP {status} from {url} but the body is not JSON: {_short(text, 100)!r}"
    found, value = dig(data, expect_nonempty)
    if not found:
        return False, f"HTTP {status} from {url} but no {expect_nonempty} in the answer: {_short(text, 100)}"
    if not isinstance(value, str):
        return False, f"HTTP {status} from {url} but {expect_nonempty} is {type(value).__name__}, not text"
    if not value.strip():
        return False, f"HTTP {status} from {url} but {expect_nonempty} is empty"
    return True, f"HTTP {status} from {url}, {expect_nonempty}={_short(value, 40)!r}"


async def check_tcp(host: str, port: int) -> tuple[bool, str]:
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return False, f"cannot connect to {url_host(host)}:{port}: {_os_reason(exc)}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True, f"connected to {url_host(host)}:{port}"


async def run_command(
    argv: tuple[str, ...] | list[str], cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """(exit code, stdout and stderr merged); bounded by the probe's timeout, a cancellation, on which `core.run`
    SIGKILLs the whole process group and reaps it."""
    result = await run(argv, cwd=cwd, env=env, merge_stderr=True)
    return result.returncode, result.output


def _last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return _short(lines[-1]) if lines else ""


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit {code}"


async def check_exec(argv: tuple[str, ...] | list[str], cwd: Path | None = None,
                     inside: Any = None) -> tuple[bool, str]:  # fmt: skip
    """Exit 0 is success; the detail is the command's last line of output (so the guide's scripts fit).
    `inside`: the container the command runs in (its engine's `exec`, the cwd as `-w`)."""
    if inside is not None:
        argv, cwd = inside.exec_argv(argv, cwd=str(cwd) if cwd is not None else None), None
    try:
        code, output = await run_command(argv, cwd)
    except FileNotFoundError as exc:
        missing = exc.filename if exc.filename else argv[0]
        return False, f"cannot run {argv[0]}: {missing} not found"
    except PermissionError:
        return False, f"cannot run {argv[0]}: permission denied"
    last = _last_line(output)
    if code == 0:
        return True, last or "exit 0"
    return False, f"{_exit_text(code)}: {last}" if last else _exit_text(code)


CANARY_PATH = "/v1/chat/completions"


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int | None, str]:
    """(status, body), or (None, why it failed) — never more than `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url) as resp:
                return resp.status, await resp.text(errors="replace")
    except TimeoutError:
        return None, f"no answer from {url} within {timeout_s:g}s"
    except aiohttp.ClientConnectorError as exc:
        return None, _connect_error(exc, url)
    except aiohttp.ClientError as exc:
        return None, f"{type(exc).__name__} from {url}: {_short(str(exc), 120)}"


async def check_vllm_progress(
    session: aiohttp.ClientSession, probe: ResolvedProbe, monitor: ProgressMonitor
) -> tuple[bool, str, bool]:
    """(ok, detail, definite): /health and /metrics at once; under load the monitor judges progress, and
    only an idle engine gets the canary (under load it would queue behind the work it checks)."""
    base, timeout_s = probe.url or "", probe.spec.timeout_s
    at = time.monotonic()
    (health, health_text), (status, text) = await asyncio.gather(
        _get(session, base + "/health", timeout_s), _get(session, base + "/metrics", timeout_s)
    )
    if health == 503:
        return False, f"engine errored: {base}/health answers 503 (vLLM reports its engine dead)", True
    if health is None:
        return False, health_text, False
    if health != 200:
        return False, f"HTTP {health} from {base}/health (want 200)", False
    if status is None:
        return False, text, False
    if status != 200:
        return False, f"HTTP {status} from {base}/metrics (want 200)", False
    monitor.last_metrics = (time.time(), text)
    try:
        verdict: Verdict = monitor.observe(at, parse_progress(text))
    except ProgressMetricsError as exc:
        return False, f"{base}/metrics: {exc}", False
    if not verdict.canary:
        return verdict.ok, verdict.detail, verdict.definite
    try:
        async with asyncio.timeout(timeout_s):
            ok, detail = await check_http(
                session, base + CANARY_PATH, "POST", probe.body, probe.headers, 200, probe.expect_nonempty
            )
    except TimeoutError:
        ok, detail = False, f"no answer within {timeout_s:g}s"
    failures = monitor.canary_result(ok)
    if ok:
        return True, f"{verdict.detail}; canary answered: {detail}", False
    return False, f"{verdict.detail}, but the canary chat failed ({_plural_row(failures)}): {detail}", False


def _plural_row(n: int) -> str:
    return "1st in a row" if n == 1 else {2: "2nd", 3: "3rd"}.get(n, f"{n}th") + " in a row"


def probe_state(probe: ResolvedProbe) -> ProgressMonitor | None:
    """What a probe remembers between runs on one process (only `vllm_progress` remembers anything)."""
    return ProgressMonitor(probe.stall_after_s) if probe.kind == "vllm_progress" else None


# Runs in the datasystem's interpreter. os._exit skips the client library's teardown (~0.6 s per probe);
# the cost is that the client's own log loses its last buffered lines, while our one-line answer is flushed.
_KV_SCRIPT = r"""
import os, sys, time
def done(code, text):
    sys.stdout.write(text + "\n"); sys.stdout.flush(); os._exit(code)
host, port, key, timeout_ms = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
try:
    from yr.datasystem.kv_client import KVClient
except Exception as exc:
    done(2, "cannot import yr.datasystem in %s: %s" % (sys.executable, exc))
def why(exc):
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split(" Detail:")[0]
step = "init"
try:
    t0 = time.monotonic()
    client = KVClient(host, port, connect_timeout_ms=timeout_ms, req_timeout_ms=timeout_ms)
    client.init()
    t1 = time.monotonic()
    value = ("%.6f-%d" % (time.time(), os.getpid())).encode()
    step = "set"
    client.set(key, value)
    step = "get"
    got = client.get([key])
    if not got or got[0] != value:
        done(1, "KV get %s returned %r, set %r" % (key, got, value))
    step = "delete"
    failed = client.delete([key])
    if failed:
        done(1, "KV delete %s failed for %r" % (key, failed))
    t2 = time.monotonic()
except Exception as exc:
    done(1, "KV %s on %s:%d failed: %s" % (step, host, port, why(exc)))
done(0, "KV set/get/delete on %s:%d ok in %.1f ms (connect %.1f ms)"
     % (host, port, (t2 - t1) * 1000, (t1 - t0) * 1000))
"""


def _kv_client_timeout_ms(timeout_s: float) -> int:
    """Leave the interpreter ~0.5 s to start, so a dead worker reports its error before our timeout."""
    return int(min(2.0, max(0.2, timeout_s - 0.5)) * 1000)


async def check_datasystem_kv(
    host: str, port: int, key: str, python: str, client_log_dir: Path | None, timeout_s: float, inside: Any = None
) -> tuple[bool, str]:
    """A real set/get/delete through `yr.datasystem.KVClient`, in a subprocess (the client is C++); `inside`:
    in the node's container, where the guide installs the datasystem wheel."""
    env = dict(os.environ)
    extra: dict[str, str] = {}
    if client_log_dir is not None:
        client_log_dir.mkdir(parents=True, exist_ok=True)
        env["DATASYSTEM_CLIENT_LOG_DIR"] = extra["DATASYSTEM_CLIENT_LOG_DIR"] = str(client_log_dir)
    argv: tuple[str, ...] = (python, "-c", _KV_SCRIPT, host, str(port), key, str(_kv_client_timeout_ms(timeout_s)))
    if inside is not None:
        argv = tuple(inside.exec_argv(argv, env=extra))
    try:
        code, output = await run_command(argv, env=env)
    except OSError as exc:
        return False, f"cannot run {python}: {exc.strerror or exc}"
    last = _last_line(output)
    if code == 0:
        return True, last or "KV round trip ok"
    return False, last or f"KV probe {_exit_text(code)}"


# ---------------------------------------------------------------------------------------------- execution


class ProbeContext:
    """What probes share: one aiohttp session (created on first use, closed by `close()`), and the node's
    `NpuMonitor` (`npu`), which the agent sets; an `npu` probe without one creates it from its own spec."""

    def __init__(self, npu: NpuMonitor | None = None) -> None:
        self._session: aiohttp.ClientSession | None = None
        self.npu = npu

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = new_session(force_close=True)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def npu_monitor(self, probe: ResolvedProbe) -> NpuMonitor:
        if self.npu is None:
            from nodeagent.npu.health import policy_from
            from nodeagent.npu.monitor import NpuMonitor

            spec = probe.spec
            assert isinstance(spec, NpuProbe)
            self.npu = NpuMonitor(NpuTools.locate(spec.npu_smi, spec.hccn_tool, timeout_s=spec.timeout_s),
                                  policy_from(spec, probe.expected_npus), spec.period_s, spec.detail_every,
                                  spec.roce)  # fmt: skip
        return self.npu

    async def _check(self, probe: ResolvedProbe) -> tuple[bool, str] | tuple[bool, str, bool]:
        kind = probe.kind
        if kind == "liveness_file":
            assert probe.path is not None
            return await check_liveness_file(probe.path, probe.max_age_s)
        if kind == "etcd":
            assert probe.endpoint is not None
            return await check_etcd(self.session(), probe.endpoint, probe.put_get, probe.key)
        if kind in ("http", "http_get"):
            assert probe.url is not None
            return await check_http(
                self.session(), probe.url, probe.method, probe.body, probe.headers, probe.expect_status,
                probe.expect_nonempty,
            )  # fmt: skip
        if kind == "tcp":
            assert probe.host is not None and probe.port is not None
            return await check_tcp(probe.host, probe.port)
        if kind == "exec":
            return await check_exec(probe.command, probe.cwd, probe.inside)
        if kind == "datasystem_kv":
            assert probe.host is not None and probe.port is not None and probe.python is not None
            return await check_datasystem_kv(
                probe.host, probe.port, probe.key or kv_key("unnamed"), probe.python, probe.client_log_dir,
                probe.timeout_s, probe.inside,
            )  # fmt: skip
        if kind == "npu":
            return await self.npu_monitor(probe).check()
        return False, f"unknown probe kind {kind!r}"

    async def _progress(self, probe: ResolvedProbe, monitor: ProgressMonitor) -> tuple[bool, str, bool]:
        return await check_vllm_progress(self.session(), probe, monitor)

    async def run(self, probe: ResolvedProbe, state: ProgressMonitor | None = None) -> ProbeResult:
        """One check under `timeout_s`; overrunning is a failure `timed out after Xs`, never an exception.

        `state` is what `probe_state` made for this probe; without it a stateful probe judges one look."""
        at = time.time()
        start = time.monotonic()
        skipped = definite = False
        try:
            async with asyncio.timeout(probe.timeout_s) as scope:
                if probe.kind == "vllm_progress":
                    monitor = state if state is not None else ProgressMonitor(probe.stall_after_s)
                    ok, detail, definite = await self._progress(probe, monitor)
                else:
                    ok, detail, *rest = await self._check(probe)
                    skipped = bool(rest and rest[0])
        except TimeoutError as exc:
            if scope.expired():
                ok, detail = False, f"timed out after {probe.timeout_s:g}s"
            else:
                ok, detail = False, f"TimeoutError: {_short(str(exc), 150) or 'from the client library'}"
        except Exception as exc:  # a probe reports; a bug in one must not kill the prober
            logger.opt(exception=exc).warning("{} probe of {} raised", probe.kind, probe.target)
            ok, detail = False, f"{type(exc).__name__}: {_short(str(exc), 150)}"
        return ProbeResult(ok, detail, time.monotonic() - start, probe.kind, at, skipped, definite and not ok)

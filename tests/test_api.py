"""The agent's HTTP API.

In-process: the real Agent, Supervisor and ApiServer on `process` one-liners (fast) for auth, hostile input,
actions, events and reload. System (marked): the real dsv4-agent on config/local.yaml — etcd, the datasystem
worker and the vLLM stand-in — shared by the module: status, livez/readyz transitions, restarts with a token,
coalesced concurrent restarts, SSE, metrics, reload of only what changed, detach and adoption.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from apihelpers import InProcess, tiny_config, write_config
from conftest import BIN, LocalAgent, derived_config, wait_for

from nodeagent.api.server import MAX_BODY, ROUTES, component_liveness, ensure_token
from nodeagent.core.states import State

# ---- in-process -----------------------------------------------------------------------------------------------


async def test_token_file_is_created_private_and_reused(stack: InProcess, tmp_path: Path) -> None:
    token_file = stack.agent.config.agent.api.token_file
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    assert len(stack.token) >= 40
    assert ensure_token(token_file) == stack.token, "an existing token must be kept"
    fresh = tmp_path / "deep" / "er" / "token"
    token = ensure_token(fresh)
    assert fresh.read_text().strip() == token and token != stack.token


async def test_reads_are_open_mutations_need_the_token(stack: InProcess) -> None:
    for path in ("/healthz", "/status", "/readyz", "/livez", "/openapi.json"):
        status, _ = await stack.get(path)
        assert status == 200, path
    async with stack.session.post(stack.url + "/pause") as r:
        assert r.status == 401
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await r.json())["status"] == 401
    for header in ("Bearer wrong", "Basic " + stack.token, "Bearer", stack.token, "Bearer " + stack.token + "x"):
        async with stack.session.post(stack.url + "/pause", headers={"Authorization": header}) as r:
            assert r.status == 401, header
    assert not stack.agent.supervisor.paused
    status, body = await stack.post("/pause")
    assert (status, body["paused"]) == (200, True) and stack.agent.supervisor.paused
    status, body = await stack.post("/resume")
    assert (status, body["paused"]) == (200, False) and not stack.agent.supervisor.paused


async def test_status_has_every_component_field(stack: InProcess) -> None:
    status, data = await stack.get("/status")
    assert status == 200
    assert data["node"]["name"] == "tiny" and data["agent"]["pid"] == os.getpid()
    for name, comp in data["components"].items():
        for key in ("state", "pid", "ready", "restarts", "uptime_s", "last_exit", "probes", "desired"):
            assert key in comp, (name, key)
        assert comp["pid"] == stack.pids()[name] and comp["state"] in ("running", "ready")


def test_livez_says_a_draining_component_is_live() -> None:
    """Draining is up (`states.is_up`): a draining vLLM still serves its in-flight requests, so a /livez that
    said 503 then would have a watchdog kill the node in the middle of a planned restart."""
    assert component_liveness(State.DRAINING, "success", "running")["live"]
    assert component_liveness(State.READY, "unknown", "running") == {
        "live": True, "state": "ready", "liveness": "unknown", "reason": None}
    assert component_liveness(State.DRAINING, "failure", "running")["reason"] == "liveness probe failing"
    assert component_liveness(State.STOPPING, "success", "stopped") == {
        "live": False, "state": "stopping", "liveness": "success", "reason": "state stopping, desired stopped"}
    assert component_liveness(State.BACKOFF, "success", "running")["reason"] == "state backoff"


def _hostile_requests(token: str) -> list[tuple[str, str, dict[str, str], bytes | None, int]]:
    auth = {"Authorization": f"Bearer {token}"}
    huge = b'{"component": "' + b"a" * (MAX_BODY + 10) + b'"}'
    return [
        ("GET", "/nope", {}, None, 404),
        ("GET", "/components/a", {}, None, 404),
        ("GET", "/../../etc/passwd", {}, None, 404),
        ("GET", "/status/", {}, None, 404),
        ("POST", "/status", auth, None, 405),
        ("DELETE", "/status", auth, None, 405),
        ("PUT", "/components/a/restart", auth, b"{}", 405),
        ("OPTIONS", "/status", {}, None, 405),
        ("PATCH", "/reset", auth, b"{}", 405),
        ("GET", "/components/a/restart", {}, None, 405),
        ("GET", "/events?replay=-1", {}, None, 400),
        ("GET", "/events?replay=abc", {}, None, 400),
        ("GET", "/events?replay=1e9", {}, None, 400),
        ("POST", "/components/a/restart", {}, None, 401),
        ("POST", "/components/a/restart", {"Authorization": "Bearer \u00e9t\u00e9"}, None, 401),
        ("POST", "/components/a/explode", auth, None, 400),
        ("POST", "/components/a/restart%00", auth, None, 400),
        ("POST", "/components/nope/restart", auth, None, 404),
        ("POST", "/components/..%2F..%2Fa/restart", auth, None, 404),
        ("POST", "/components/a/restart", auth, b"{not json", 400),
        ("POST", "/components/a/restart", auth, b"[1, 2]", 400),
        ("POST", "/components/a/restart", auth, b'{"force": true}', 400),
        ("POST", "/components/a/restart", auth, b"\xff\xfe\x00garbage", 400),
        ("POST", "/components/a/restart", auth, b"[" * 100000, 413),
        ("POST", "/reset", auth, b'{"component": 5}', 400),
        ("POST", "/reset", auth, b'{"component": ["a"]}', 400),
        ("POST", "/reset", auth, b'{"component": "nope"}', 404),
        ("POST", "/reset", auth, b'{"component": "a", "extra": 1}', 400),
        ("POST", "/reset", auth, b'"a"', 400),
        ("POST", "/reset", auth, b"null", 400),
        ("POST", "/reset", auth, b"[" * 5000 + b"]" * 5000, 400),
        ("POST", "/reset", auth, huge, 413),
        ("POST", "/redeploy", auth, b'{"reason": 12}', 400),
        ("POST", "/redeploy", auth, b'{"reason": "' + b"x" * 600 + b'"}', 400),
        ("POST", "/pause", auth, b'{"really": "yes"}', 400),
        ("POST", "/detach", auth, b"[]", 400),
        ("POST", "/reload", auth, b'{"path": "/etc/shadow"}', 400),
    ]


async def test_hostile_barrage_never_500_and_leaves_the_stack_alone(stack: InProcess) -> None:
    before = stack.pids()
    restarts = {n: c.restarts for n, c in stack.agent.supervisor.components.items()}
    for method, path, headers, body, expected in _hostile_requests(stack.token):
        async with stack.session.request(method, stack.url + path, headers=headers, data=body,
                                         skip_auto_headers=["Content-Type"]) as r:  # fmt: skip
            text = await r.text()
            assert r.status == expected, (method, path, body and body[:40], r.status, text[:200])
            data = json.loads(text)
            assert data["status"] == expected and data["error"], (method, path)
    async with stack.session.head(stack.url + "/status") as r:
        assert r.status == 200
    async with stack.session.head(stack.url + "/nope") as r:
        assert r.status == 404
    async with stack.session.head(stack.url + "/events") as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
    # Raw garbage on the socket: aiohttp answers 400 (never a 500) and the agent goes on.
    for raw in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, b"GET / HTTP/9.9\r\n\r\n",
                b"POST /reset HTTP/1.1\r\nContent-Length: -5\r\n\r\n"):  # fmt: skip
        reader, writer = await asyncio.open_connection(*stack.agent.config.agent.api.listen.rsplit(":", 1))
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(200), 5)
        writer.close()
        assert b" 500 " not in answer.split(b"\r\n", 1)[0]
    await asyncio.sleep(0.3)
    assert stack.pids() == before
    assert {n: c.restarts for n, c in stack.agent.supervisor.components.items()} == restarts
    assert all(str(c.state) in ("running", "ready") for c in stack.agent.supervisor.components.values())
    assert not stack.agent.stopping and not stack.agent.supervisor.paused
    status, _ = await stack.get("/healthz")
    assert status == 200


async def test_unix_socket_trusts_root_and_own_uid_only(stack: InProcess) -> None:
    sock = str(stack.agent.config.agent.api.unix_socket)
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    connector = aiohttp.UnixConnector(path=sock)
    async with aiohttp.ClientSession(connector=connector) as session, session.post("http://agent/pause") as r:
        assert r.status == 200, await r.text()
    assert stack.agent.supervisor.paused
    python = shutil.which("python3", path="/usr/bin:/bin")  # the venv's may sit under root's private home
    if os.getuid() != 0 or python is None:
        pytest.skip("the other-uid half needs root (to switch users) and a system python3")
    # Another user on the socket: reads are open, a mutation needs the token.
    script = (
        "import http.client, socket, sys, json\n"
        "class C(http.client.HTTPConnection):\n"
        "    def connect(self):\n"
        "        self.sock = socket.socket(socket.AF_UNIX); self.sock.connect(sys.argv[1])\n"
        "out = []\n"
        "for method, path, headers in (('GET', '/status', {}), ('POST', '/resume', {}),\n"
        "                              ('POST', '/resume', {'Authorization': 'Bearer ' + sys.argv[2]})):\n"
        "    c = C('x'); c.request(method, path, headers=headers); out.append(c.getresponse().status)\n"
        "print(json.dumps(out))\n"
    )
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(None, lambda: subprocess.run(
        [python, "-c", script, sock, stack.token], capture_output=True, text=True, timeout=30,
        user=65534, group=65534, cwd="/"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [200, 401, 200]
    assert not stack.agent.supervisor.paused


async def test_stop_start_restart_a_component(stack: InProcess) -> None:
    sup = stack.agent.supervisor
    old = stack.pids()
    status, body = await stack.post("/components/b/stop")
    assert (status, body) == (202, {"accepted": True, "action": "stop", "component": "b", "message": "stop b"})
    await stack.wait_states({"b": {"stopped"}})
    assert sup.desired("b") == "stopped" and stack.pids()["a"] == old["a"]
    status, body = await stack.get("/readyz")
    assert status == 503 and "b" in body["not_ready"], "a node without vLLM is ready when every component is"
    status, _ = await stack.get("/livez")
    assert status == 200, "no component of the guide's liveness kinds here"
    status, _ = await stack.post("/components/b/start")
    assert status == 202
    await stack.wait_states({"b": {"running", "ready"}})
    assert stack.pids()["b"] not in (None, old["b"])
    status, _ = await stack.get("/readyz")
    assert status == 200
    mid = stack.pids()
    status, _ = await stack.post("/components/a/restart")
    assert status == 202
    await stack.wait("a restarted", lambda: stack.pids()["a"] not in (None, mid["a"]) and
                     str(sup.components["a"].state) in ("running", "ready"))  # fmt: skip
    assert sup.components["a"].restarts == 1


async def test_concurrent_restarts_coalesce(stack: InProcess) -> None:
    comp = stack.agent.supervisor.components["a"]
    old_pid, old_restarts = comp.record.pid, comp.restarts
    seq = stack.agent.supervisor.events.recent[-1].seq
    results = await asyncio.gather(*(stack.post("/components/a/restart") for _ in range(2)))
    assert [r[0] for r in results] == [202, 202]
    await stack.wait("a back up", lambda: comp.record is not None and comp.record.pid != old_pid
                     and str(comp.state) in ("running", "ready"))  # fmt: skip
    await asyncio.sleep(1.0)  # a second restart, if any, would have begun by now
    started = [e for e in stack.agent.supervisor.events.recent
               if e.seq > seq and e.component == "a" and e.event == "started"]  # fmt: skip
    assert comp.restarts == old_restarts + 1 and len(started) == 1


async def test_events_replay_then_live_then_unsubscribe(stack: InProcess) -> None:
    api = stack.server.api
    assert api is not None
    bus = stack.agent.supervisor.events
    recent = list(bus.recent)
    async with stack.session.get(stack.url + "/events?replay=3") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        got: list[dict[str, Any]] = []

        async def read_events(n: int) -> None:
            buf = b""
            while len(got) < n:
                buf += await r.content.readany()
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    data = [ln[6:] for ln in block.split(b"\n") if ln.startswith(b"data: ")]
                    if data:
                        got.append(json.loads(data[0]))

        await asyncio.wait_for(read_events(3), 5)
        assert [e["seq"] for e in got] == [e.seq for e in recent[-3:]]
        assert api.sse_streams == 1
        status, _ = await stack.post("/reset", {"component": "b"})
        assert status == 200
        await asyncio.wait_for(read_events(4), 5)
        assert got[3]["event"] == "reset" and got[3]["component"] == "b"
    await stack.wait("unsubscribe after disconnect", lambda: api.sse_streams == 0 and not bus._subscribers, 5)
    # Resume after an id: exactly the later events, no replay count needed.
    async with stack.session.get(stack.url + "/events", headers={"Last-Event-ID": str(got[2]["seq"])}) as r:
        line = b""
        while not line.startswith(b"data: "):
            line = await asyncio.wait_for(r.content.readline(), 5)
        assert json.loads(line[6:])["seq"] == got[2]["seq"] + 1


async def test_reload_restarts_only_what_changed_and_refuses_bad_configs(stack: InProcess) -> None:
    sup = stack.agent.supervisor
    before = stack.pids()
    data = yaml.safe_load(stack.config_path.read_text())
    original = stack.config_path.read_text()

    # Broken YAML, a typo'd key, an added component: 400 naming the problem, nothing touched.
    stack.config_path.write_text(original + "components: [\n")
    status, body = await stack.post("/reload")
    assert status == 400 and "YAML" in body["error"]
    stack.config_path.write_text(original.replace("stop_grace_s:", "stop_grace:", 1))
    status, body = await stack.post("/reload")
    assert status == 400 and "unknown key 'stop_grace'" in body["error"] and str(stack.config_path) in body["error"]
    more = json.loads(json.dumps(data))
    more["components"]["c"] = {"kind": "process", "command": ["sleep", "100"]}
    write_config(stack.config_path, more)
    status, body = await stack.post("/reload")
    assert status == 400 and "cannot add or remove" in body["error"]
    assert stack.pids() == before and all(c.restarts == 0 for c in sup.components.values())
    assert any(e.event == "reload_failed" for e in sup.events.recent)

    data["components"]["b"]["env"] = {"NEW_SETTING": "1"}
    write_config(stack.config_path, data)
    status, body = await stack.post("/reload")
    assert status == 200 and body["restarted"] == ["b"] and body["unchanged"] == ["a"]
    await stack.wait("b restarted", lambda: stack.pids()["b"] not in (None, before["b"])
                     and str(sup.components["b"].state) in ("running", "ready"))  # fmt: skip
    assert stack.pids()["a"] == before["a"]
    env = Path(f"/proc/{stack.pids()['b']}/environ").read_bytes().split(b"\0")
    assert b"NEW_SETTING=1" in env
    status, body = await stack.post("/reload")
    assert status == 200 and body["restarted"] == []


async def test_redeploy_reset_detach(stack: InProcess) -> None:
    sup = stack.agent.supervisor
    before = stack.pids()
    answers = await asyncio.gather(stack.post("/redeploy", {"reason": "test"}), stack.post("/redeploy"))
    assert [a[0] for a in answers] == [202, 202]
    assert sorted(a[1]["already_in_progress"] for a in answers) == [False, True], "two at once: one redeploy"
    assert answers[0][1]["action"] == "redeploy" and answers[0][1]["accepted"] is True
    await stack.wait("redeployed", lambda: all(p not in (None, before[n]) for n, p in stack.pids().items())
                     and all(str(c.state) in ("running", "ready") for c in sup.components.values()))  # fmt: skip
    assert [e.event for e in sup.events.recent].count("redeploy") == 1
    status, body = await stack.post("/reset")
    assert (status, body["component"]) == (200, None)
    status, body = await stack.post("/detach")
    assert status == 202 and body["action"] == "detach"
    await stack.wait("stop requested", lambda: stack.agent.stopping)
    assert stack.agent.detach
    status, body = await stack.post("/pause")
    assert status == 503 and "stopping" in body["error"]


async def test_openapi_documents_every_route(stack: InProcess) -> None:
    status, doc = await stack.get("/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    served = {(r.method, r.path) for r in ROUTES}
    assert documented == served
    app_routes = {(r.method, r.resource.canonical) for r in stack.server.runner.app.router.routes()  # type: ignore
                  if r.method != "HEAD"}  # fmt: skip
    assert app_routes == served
    for (method, path), route in zip(sorted(served), sorted(ROUTES, key=lambda r: (r.method, r.path)), strict=True):
        op = doc["paths"][path][method.lower()]
        assert op["operationId"] == route.name and op["responses"]
        assert ("security" in op) == route.mutating


def test_agent_exits_1_when_the_api_cannot_listen(tmp_path: Path) -> None:
    """Before anything of the stack is touched: the next agent (systemd restarts it) finds the stack as it was."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        data = tiny_config(tmp_path)
        data["agent"]["api"]["listen"] = f"127.0.0.1:{busy.getsockname()[1]}"
        path = write_config(tmp_path / "c.yaml", data)
        out = subprocess.run([str(BIN / "dsv4-agent"), "--config", str(path)], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"cannot listen on {data['agent']['api']['listen']}" in out.stderr
    assert not (tmp_path / "state" / "children.json").exists()


def test_agent_notifies_ready_once_the_api_listens_and_around_a_reload(tmp_path: Path) -> None:
    """READY=1 when the API answers (not when the stack is up); SIGHUP: RELOADING=1, then READY=1 again."""
    folder = tempfile.mkdtemp(prefix="ntf-")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(os.path.join(folder, "n"))
    notify.settimeout(20)
    data = tiny_config(tmp_path)
    data["components"]["a"]["command"] = ["sh", "-c", "sleep 2; exec sleep 3600"]
    data["components"]["a"]["probes"] = {"startup": {"kind": "exec", "command": ["true"], "initial_delay_s": 3}}
    path = write_config(tmp_path / "c.yaml", data)
    url = f"http://{data['agent']['api']['listen']}"
    proc = subprocess.Popen([str(BIN / "dsv4-agent"), "--config", str(path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "NOTIFY_SOCKET": notify.getsockname()})
    try:
        def until(prefix: bytes) -> bytes:
            while True:
                msg = notify.recv(4096)
                if msg.startswith(prefix):
                    return msg

        until(b"READY=1")
        with urllib.request.urlopen(url + "/status", timeout=5) as r:
            status = json.load(r)
        assert status["components"]["a"]["state"] in ("stopped", "starting"), "READY does not wait for the stack"
        proc.send_signal(signal.SIGHUP)
        assert until(b"RELOADING=1").startswith(b"RELOADING=1\nMONOTONIC_USEC=")
        until(b"READY=1")
        proc.send_signal(signal.SIGTERM)
        until(b"STOPPING=1")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
        shutil.rmtree(folder, ignore_errors=True)


# ---- the real stack --------------------------------------------------------------------------------------------


def _http(agent: LocalAgent, method: str, path: str, token: str | None = None, body: Any = None,
          timeout: float = 10.0) -> tuple[int, Any]:  # fmt: skip
    url = f"http://127.0.0.1:{agent.env['DSV4_API_PORT']}{path}"
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalAgent, dict[str, Any]]]:
    """One real stack for the module, on a copy of config/local.yaml (a unique cluster name keeps other
    agents' leftover cleanup on this shared machine away from it). Yields the agent and early observations."""
    home = tmp_path_factory.mktemp("api-real") / "home"
    home.mkdir()
    config = derived_config(home / "config.yaml", {"cluster": {"name": f"apisys{os.getpid()}"}})
    agent = LocalAgent(home, config)
    try:
        agent.start()
        wait_for("API up", lambda: _http(agent, "GET", "/healthz")[0] == 200, 30, 0.05)
        early = {"readyz": _http(agent, "GET", "/readyz"), "livez": _http(agent, "GET", "/livez")}
        agent.wait_all_up()
        wait_for("vllm ready", lambda: _http(agent, "GET", "/readyz")[0] == 200, 60)
        yield agent, early
    finally:
        agent.cleanup()


def _token(agent: LocalAgent) -> str:
    return (agent.home / "token").read_text().strip()


def _comp(agent: LocalAgent, name: str) -> dict[str, Any]:
    return _http(agent, "GET", "/status")[1]["components"][name]


@pytest.mark.system
def test_real_status_and_health(real: tuple[LocalAgent, dict[str, Any]]) -> None:
    agent, early = real
    status, data = _http(agent, "GET", "/status")
    assert status == 200 and set(data["components"]) == {"etcd", "datasystem", "vllm"}
    for name, comp in data["components"].items():
        assert comp["pid"] == agent.children()[name]["pid"]
        assert comp["state"] in ("running", "ready") and comp["desired"] == "running"
        assert comp["probes"]["roles"]["startup"]["status"] == "success"
    assert data["components"]["vllm"]["probes"]["roles"]["readiness"]["probes"][0]["last"]["ok"] is True
    assert _http(agent, "GET", "/healthz")[1]["ok"] is True
    live_status, live = _http(agent, "GET", "/livez")
    assert live_status == 200 and set(live["components"]) == {"etcd", "datasystem", "vllm"}
    # Right after the start nothing could be ready: vLLM starts only after etcd and the worker are up.
    assert early["readyz"][0] == 503 and early["readyz"][1]["not_ready"] == ["vllm"]
    assert early["livez"][0] == 503 and early["livez"][1]["failing"]


@pytest.mark.system
def test_real_readyz_livez_follow_vllm_and_token_is_required(real: tuple[LocalAgent, dict[str, Any]]) -> None:
    agent, _ = real
    pid = _comp(agent, "vllm")["pid"]
    assert _http(agent, "POST", "/components/vllm/stop")[0] == 401
    assert _http(agent, "POST", "/components/vllm/stop", "nope")[0] == 401
    assert _comp(agent, "vllm")["pid"] == pid and _comp(agent, "vllm")["desired"] == "running"
    assert _http(agent, "POST", "/components/vllm/stop", _token(agent))[0] == 202
    wait_for("vllm stopped", lambda: _comp(agent, "vllm")["state"] == "stopped", 60)
    status, body = _http(agent, "GET", "/readyz")
    assert status == 503 and body["not_ready"] == ["vllm"]
    status, body = _http(agent, "GET", "/livez")
    assert status == 503 and list(body["failing"]) == ["vllm"] and "desired stopped" in body["failing"]["vllm"]
    assert _http(agent, "POST", "/components/vllm/start", _token(agent))[0] == 202
    wait_for("ready again", lambda: _http(agent, "GET", "/readyz")[0] == 200, 90)
    assert _http(agent, "GET", "/livez")[0] == 200
    assert _comp(agent, "vllm")["pid"] != pid


@pytest.mark.system
def test_real_concurrent_restarts_coalesce(real: tuple[LocalAgent, dict[str, Any]]) -> None:
    agent, _ = real
    token = _token(agent)
    before = _comp(agent, "vllm")
    seq = max(e["seq"] for e in _events(agent, 1, 0))
    barrier = threading.Barrier(2)

    def restart() -> int:
        barrier.wait()
        return _http(agent, "POST", "/components/vllm/restart", token)[0]

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda _: restart(), range(2))) == [202, 202]
    wait_for("vllm restarted", lambda: (c := _comp(agent, "vllm"))["pid"] not in (None, before["pid"])
             and c["state"] in ("running", "ready"), 90)  # fmt: skip
    time.sleep(2.0)
    after = _comp(agent, "vllm")
    assert after["restarts"] == before["restarts"] + 1
    started = [e for e in _events(agent, 500, 0) if e["seq"] > seq and e["component"] == "vllm"
               and e["event"] == "started"]  # fmt: skip
    assert len(started) == 1 and started[0]["data"]["pid"] == after["pid"]


def _events(agent: LocalAgent, replay: int, live: int, action: Any = None, timeout: float = 30.0) -> list[dict]:
    """The replayed events (up to the `: live` comment), then — after running `action` — `live` more."""
    conn = http.client.HTTPConnection("127.0.0.1", int(agent.env["DSV4_API_PORT"]), timeout=timeout)
    conn.request("GET", f"/events?replay={replay}")
    response = conn.getresponse()
    assert response.status == 200
    events: list[dict[str, Any]] = []
    replayed: int | None = None
    try:
        while replayed is None or len(events) < replayed + live:
            line = response.fp.readline()
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
            elif line.startswith(b": live"):
                replayed = len(events)
                if action is not None:
                    action()
            elif not line:
                raise AssertionError("the event stream ended")
    finally:
        conn.close()
    return events


@pytest.mark.system
def test_real_events_replay_and_live(real: tuple[LocalAgent, dict[str, Any]]) -> None:
    agent, _ = real
    token = _token(agent)
    events = _events(agent, 5, 1, lambda: _http(agent, "POST", "/reset", token, {"component": "datasystem"}))
    assert len(events) == 6
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == 6
    assert events[-1]["event"] == "reset" and events[-1]["component"] == "datasystem"
    assert any(e["event"] == "agent_start" for e in _events(agent, 500, 0)), "the replay reaches back to the start"


@pytest.mark.system
def test_real_metrics_pass_promtool_and_carry_cache_ratios(real: tuple[LocalAgent, dict[str, Any]]) -> None:
    agent, _ = real
    url = f"http://127.0.0.1:{agent.env['DSV4_API_PORT']}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return r.read().decode()

    # The readiness probe's chat completions feed vLLM's prefix-cache counters.
    def with_ratios() -> str | None:
        text = scrape()
        return text if 'engine="all",kind="local_total"' in text else None

    text = wait_for("cache ratios", with_ratios, 60)
    for name in ("etcd", "datasystem", "vllm"):
        assert f'dsv4_component_up{{component="{name}",kind="{name}"}} 1.0' in text
        assert f'dsv4_component_state{{component="{name}",kind="{name}",state="stopped"}} 0.0' in text
    assert 'dsv4_component_processes{component="vllm",kind="vllm"} 4.0' in text, "API server, EngineCore, 2 TP"
    assert 'dsv4_probe_duration_seconds_count{component="vllm",kind="http",role="readiness"}' in text
    assert 'dsv4_vllm_cache_hit_ratio{component="vllm",engine="0",kind="eff_total"}' in text
    assert 'dsv4_agent_info{cluster="apisys' in text
    promtool = _promtool()
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (Debian package prometheus ships it: see tests/test_metrics.py)")
    return found


@pytest.mark.system
def test_real_reload_restarts_only_vllm(real: tuple[LocalAgent, dict[str, Any]]) -> None:
    agent, _ = real
    token = _token(agent)
    before = {n: c["pid"] for n, c in agent.children().items()}
    data = yaml.safe_load(agent.config_path.read_text())
    original = agent.config_path.read_text()
    agent.config_path.write_text(original.replace("  vllm:\n", "  vllm:\n    bogus_key: 1\n", 1))
    status, body = _http(agent, "POST", "/reload", token)
    assert status == 400 and "bogus_key" in body["error"]
    data["components"]["vllm"]["env"]["DSV4_TEST_RELOAD"] = "1"
    agent.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    status, body = _http(agent, "POST", "/reload", token)
    assert status == 200 and body["restarted"] == ["vllm"], body
    wait_for("vllm restarted", lambda: (c := _comp(agent, "vllm"))["pid"] not in (None, before["vllm"])
             and c["state"] in ("running", "ready"), 90)  # fmt: skip
    after = {n: c["pid"] for n, c in agent.children().items()}
    assert after["etcd"] == before["etcd"] and after["datasystem"] == before["datasystem"]

    # SIGHUP (systemctl reload) does the same.
    data["components"]["vllm"]["env"]["DSV4_TEST_RELOAD"] = "2"
    agent.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    os.kill(agent.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
    wait_for("vllm restarted by SIGHUP", lambda: (c := _comp(agent, "vllm"))["pid"] not in (None, after["vllm"])
             and c["state"] in ("running", "ready"), 90)  # fmt: skip
    final = {n: c["pid"] for n, c in agent.children().items()}
    assert final["etcd"] == before["etcd"] and final["datasystem"] == before["datasystem"]
    assert "reload: restarted vllm" in agent.log()


@pytest.mark.system
def test_real_reload_onto_the_etcd_port_is_refused_with_the_stack_untouched(
        real: tuple[LocalAgent, dict[str, Any]]) -> None:  # fmt: skip
    """Issue 29: vLLM's port set to the agent's own etcd port. `config validate` and `reload` both exit 78 naming
    the collision, and the refused reload keeps every process (same PIDs, vLLM still serving)."""
    agent, _ = real
    before = {n: (c["pid"], c["create_time"]) for n, c in agent.children().items()}
    restarts = _comp(agent, "vllm")["restarts"]
    original = agent.config_path.read_text()
    data = yaml.safe_load(original)
    data["components"]["vllm"]["port"] = "${DSV4_ETCD_PORT:-2379}"
    agent.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        ctl = [str(BIN / "nodeagentctl"), "--config", str(agent.config_path)]
        validate = subprocess.run([str(BIN / "nodeagentctl"), "config", "validate", str(agent.config_path)],
                                  env=agent.env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert validate.returncode == 78, validate.stdout + validate.stderr
        assert "components.etcd.client_port and components.vllm.port" in validate.stderr
        out = subprocess.run([*ctl, "reload"], env=agent.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 78, out.stdout + out.stderr
        port = agent.env["DSV4_ETCD_PORT"]
        assert f"components.etcd.client_port and components.vllm.port: {port}: etcd etcd client {port} and vllm " \
            f"HTTP (--port) {port} collide" in out.stderr and "nothing changed" in out.stderr, out.stderr  # fmt: skip
        assert {n: (c["pid"], c["create_time"]) for n, c in agent.children().items()} == before
        assert _comp(agent, "vllm")["state"] in ("running", "ready") and _comp(agent, "vllm")["restarts"] == restarts
        assert "config reload refused, nothing changed" in agent.log()
    finally:
        agent.config_path.write_text(original)


@pytest.mark.system
def test_real_detach_then_a_new_agent_adopts(real: tuple[LocalAgent, dict[str, Any]]) -> None:
    """Last in the module: the agent exits 0 leaving the stack; the next one adopts the very same processes."""
    agent, _ = real
    before = {n: (c["pid"], c["create_time"]) for n, c in agent.children().items()}
    history = {n: (c["restarts"], c["started_at"], c["last_exit"])
               for n, c in _http(agent, "GET", "/status")[1]["components"].items()}
    status, body = _http(agent, "POST", "/detach", _token(agent))
    assert status == 202 and body["action"] == "detach"
    assert agent.proc is not None and agent.proc.wait(60) == 0
    for pid, _ in before.values():
        os.kill(pid, 0)  # still there
    agent.start()
    wait_for("adoption", lambda: agent.log().count("adopted running pid") == 3, 60)
    wait_for("ready", lambda: _http(agent, "GET", "/readyz")[0] == 200, 60)
    after = {n: (c["pid"], c["create_time"]) for n, c in agent.children().items()}
    assert after == before
    # History survives the upgrade: restart counts, the processes' real start times, their last exits.
    adopted = {n: (c["restarts"], c["started_at"], c["last_exit"])
               for n, c in _http(agent, "GET", "/status")[1]["components"].items()}
    assert adopted == history
    assert agent.terminate(120) == 0

"""`nodeagentctl probe`: the guide's probe script's checks and messages, against real files and servers."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nodeagent.cli.probe import run_probe


class Fake(BaseHTTPRequestHandler):
    content = "hi"
    etcd = b'{"health":"true","reason":""}'

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(Fake.etcd)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["max_tokens"] == 2 and body["chat_template_kwargs"] == {"enable_thinking": False}
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"choices": [{"message": {"content": Fake.content}}]}).encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    Fake.content, Fake.etcd = "hi", b'{"health":"true","reason":""}'


def targets(tmp_path: Path, addr: str) -> dict[str, object]:
    live = tmp_path / "liveness"
    live.write_text("liveness check success")
    return {"liveness": live, "etcd": addr, "vllm_url": f"http://{addr}/v1/chat/completions", "model": "dsv4"}


def probe(t: dict[str, object], role: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_probe(t, role, 5, out, err)
    return code, out.getvalue(), err.getvalue()


def test_master_prints_the_guide_messages(tmp_path: Path, server: str) -> None:
    code, out, err = probe(targets(tmp_path, server), "master")
    assert code == 0, err
    assert out.splitlines() == ["yuanrong check success !", f"etcd is ready: {server}", "vLLM serve check success!"]


def test_slave_checks_only_the_worker(tmp_path: Path) -> None:
    t = targets(tmp_path, "127.0.0.1:9")  # nothing listens there: a slave must not look
    assert probe(t, "slave") == (0, "yuanrong check success !\n", "")


def test_failures_exit_1_with_the_guide_message(tmp_path: Path, server: str) -> None:
    t = targets(tmp_path, server)
    Fake.content = ""
    assert probe(t, "master")[0] == 1 and "response content len is 0" in probe(t, "master")[2]
    Fake.etcd = b'{"health":"false"}'
    assert "etcd is not ready" in probe(t, "master")[2]
    stale = Path(t["liveness"])  # type: ignore[arg-type]
    os.utime(stale, (time.time() - 60, time.time() - 60))
    assert probe(t, "slave") == (1, "", "liveness probe not update in 30\n")
    stale.write_text("liveness check failed: disk")
    assert "check failed" in probe(t, "slave")[2]
    stale.unlink()
    assert "not exists" in probe(t, "slave")[2]

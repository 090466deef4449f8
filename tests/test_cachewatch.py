"""`nodeagentctl cache` against a real local HTTP server serving changing vLLM metrics text."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nodeagent.cli.cachewatch import (
    EXIT_BAD_METRICS,
    EXIT_OUTPUT,
    EXIT_UNREACHABLE,
    add_cache_arguments,
    run_cache,
)
from nodeagent.vllm.cachehit import format_header

CaptureStr = pytest.CaptureFixture[str]
ROW = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (\S+)")


def metrics(engines: dict[str, tuple[int, int, int, int]]) -> str:
    """vLLM-style text: counters with HELP/TYPE and ``_created`` samples, plus an unrelated gauge."""
    out = ["# HELP vllm:num_requests_waiting Requests waiting.", "# TYPE vllm:num_requests_waiting gauge"]
    out += [f'vllm:num_requests_waiting{{engine="{e}",model_name="dsv4"}} 0.0' for e in engines]
    for idx, name in enumerate(
        (
            "prefix_cache_queries",
            "prefix_cache_hits",
            "external_prefix_cache_queries",
            "external_prefix_cache_hits",
        )
    ):
        out += [f"# HELP vllm:{name}_total Tokens.", f"# TYPE vllm:{name}_total counter"]
        out += [f'vllm:{name}_total{{engine="{e}",model_name="dsv4"}} {v[idx]}.0' for e, v in engines.items()]
        out += [f"# HELP vllm:{name}_created Tokens.", f"# TYPE vllm:{name}_created gauge"]
        out += [f'vllm:{name}_created{{engine="{e}",model_name="dsv4"}} 1.75e+09' for e in engines]
    return "\n".join(out) + "\n"


class MetricsServer:
    """Serves ``responses`` in order, one per request, then repeats the last; (status, body) pairs."""

    def __init__(self) -> None:
        self.responses: list[tuple[int, str]] = []
        self.requests = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with server._lock:
                    status, body = server.responses[min(server.requests, len(server.responses) - 1)]
                    server.requests += 1
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"

    def serve(self, *bodies: str | tuple[int, str]) -> None:
        self.responses = [b if isinstance(b, tuple) else (200, b) for b in bodies]
        self.requests = 0


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    srv = MetricsServer()
    thread = threading.Thread(target=srv.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
    thread.join(timeout=5)


def blocks(text: str) -> list[list[list[str]]]:
    """Rows grouped per scrape (blank-line separated), each row split into its cells."""
    return [[line.split()[2:] for line in chunk.splitlines()] for chunk in text.strip("\n").split("\n\n")]


def run(url: str, *, watch: bool = True, output: Path | None = None, **kwargs: Any) -> tuple[int, str]:
    """``run_cache`` at a test-friendly interval, text unless told; returns the exit code and stdout."""
    out = io.StringIO()
    kwargs.setdefault("as_json", False)
    code = run_cache(url, watch=watch, interval=0.05, output=output and str(output), stream=out, **kwargs)
    return code, out.getvalue()


def test_one_shot_prints_header_and_totals_since_start(server: MetricsServer) -> None:
    server.serve(metrics({"0": (1000, 750, 250, 100), "1": (1000, 250, 750, 150)}))
    code, printed = run(server.url, watch=False)
    assert code == 0
    header, rows = printed.split("\n", 1)
    assert header == format_header()
    [block] = blocks(rows)
    assert block == [
        ["0", "1000", "750", "75.00%", "75.00%", "250", "100", "40.00%", "40.00%", "85.00%"],
        ["1", "1000", "250", "25.00%", "25.00%", "750", "150", "20.00%", "20.00%", "40.00%"],
        ["all", "2000", "1000", "50.00%", "50.00%", "1000", "250", "25.00%", "25.00%", "62.50%"],
    ]
    assert all(ROW.match(line) for line in rows.strip().splitlines())
    assert server.requests == 1


def test_watch_windows_resets_and_output_file(server: MetricsServer, tmp_path: Path) -> None:
    server.serve(
        metrics({"0": (1000, 500, 500, 100)}),
        metrics({"0": (1400, 700, 700, 150)}),  # window: 200/400 local, 50/200 external
        metrics({"0": (1400, 700, 700, 150)}),  # idle: window undefined
        metrics({"0": (100, 80, 20, 5)}),  # vLLM restarted
    )
    log = tmp_path / "cache_hit_rate.log"
    log.write_text("earlier run\n")
    code, printed = run(server.url, output=log, count=4)
    assert code == 0
    header, rows = printed.split("\n", 1)
    assert header == format_header()
    got = blocks(rows)
    assert [[row[0] for row in block] for block in got] == [["0", "all"]] * 4
    assert [block[0][3] for block in got] == ["50.00%", "50.00%", "n/a", "80.00%"]
    assert [block[1][7] for block in got] == ["20.00%", "25.00%", "n/a", "25.00%"]
    assert got[1][1] == ["all", "1400", "700", "50.00%", "50.00%", "700", "150", "25.00%", "21.43%", "60.71%"]
    # The log gets the same rows and separators but, like the script's, no header; earlier content stays.
    assert log.read_text() == "earlier run\n" + rows
    assert server.requests == 4


def test_watch_json_lines(server: MetricsServer, tmp_path: Path) -> None:
    server.serve(metrics({"0": (10, 5, 5, 1)}), metrics({"0": (10, 5, 5, 1)}))
    log = tmp_path / "rates.jsonl"
    code, printed = run(server.url, output=log, as_json=True, count=2)
    assert code == 0
    lines = printed.splitlines()
    docs = [json.loads(line) for line in lines]
    assert [d["engine"] for d in docs] == ["0", "all", "0", "all"]
    assert docs[0]["local_win"] == pytest.approx(0.5) and docs[0]["ext_win"] == pytest.approx(0.2)
    assert docs[2]["local_win"] is None and docs[2]["ext_win"] is None
    assert docs[2]["local_total"] == pytest.approx(0.5) and docs[2]["local_q"] == 10
    assert log.read_text().splitlines() == lines


def test_unreachable_url_exits_3_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
    code, _ = run(url)
    assert code == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and url in err and "failed to fetch metrics" in err


def test_http_error_exits_3(server: MetricsServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.serve((404, "Not Found"))
    assert run(server.url, watch=False, as_json=True) == (EXIT_UNREACHABLE, "")
    err = capsys.readouterr().err
    assert server.url in err and "HTTP 404" in err


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("<html><body>It works!</body></html>", "not Prometheus metrics text"),
        ("# TYPE up gauge\nup 1\n", "no prefix cache metrics found at http://"),
    ],
)
def test_wrong_content_exits_4(server: MetricsServer, capsys: CaptureStr, body: str, message: str) -> None:
    server.serve(body)
    assert run(server.url, watch=False) == (EXIT_BAD_METRICS, format_header() + "\n")
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err


def test_watch_survives_failures_after_first_scrape(server: MetricsServer, capsys: CaptureStr) -> None:
    server.serve(metrics({"0": (10, 5, 0, 0)}), (503, "restarting"), metrics({"0": (20, 15, 0, 0)}))
    code, printed = run(server.url, count=3)
    assert code == 0
    err = capsys.readouterr().err
    assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d failed to fetch metrics from .*HTTP 503", err)
    got = blocks(printed.split("\n", 1)[1])
    assert [block[0][3] for block in got] == ["50.00%", "100.00%"]  # window spans the failed scrape


def test_unwritable_output_fails_clearly(server: MetricsServer, tmp_path: Path, capsys: CaptureStr) -> None:
    server.serve(metrics({"0": (10, 5, 0, 0)}))
    log = tmp_path / "missing-dir" / "rates.log"
    code, _ = run(server.url, output=log)
    assert code == EXIT_OUTPUT
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(log) in err and "No such file" in err


def test_ctrl_c_stops_cleanly(server: MetricsServer) -> None:
    server.serve(metrics({"0": (10, 5, 0, 0)}))
    code = (
        "import sys; from nodeagent.cli.cachewatch import run_cache; "
        f"sys.exit(run_cache({server.url!r}, watch=True, interval=0.05, output=None, as_json=False))"
    )
    pipe = subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=pipe, stderr=pipe, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == format_header() + "\n"
        assert ROW.match(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert stdout.endswith("\nStopped.\n") and "Traceback" not in stderr


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    args = parser.parse_args([])
    assert (args.url, args.watch, args.interval, args.output, args.as_json) == (None, False, 5.0, None, False)
    args = parser.parse_args(["-u", "http://h:1/metrics", "--watch", "-i", "10", "-o", "x.log", "--json"])
    assert (args.url, args.watch, args.interval, args.output, args.as_json) == (
        "http://h:1/metrics",
        True,
        10.0,
        "x.log",
        True,
    )
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--interval", bad])

"""The PD watches of issue 19 (cluster/pd_watch.py, kvlog.py): pure decisions, then the loop on the process-less
cluster (tests/cluster_fakes.py) with an HTTP double standing for the backends — a decoder that answers 200
without tokens is restarted (its group's next generation), one that answers tokens is left alone; prefill's KV
while decode is down; KV transfer failures summed per pair from the member records."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from cluster_fakes import World

from nodeagent.cluster.pd_watch import (
    RESTART_COOLDOWN_S,
    EmptyCounter,
    PdWatch,
    kv_pressure,
    kv_usage,
    merged_transfers,
    tokens_of,
)
from nodeagent.config_recovery import PdWatchConfig

GROUPS = [{"name": "p0", "kind": "prefill", "nodes": ["n0"]}, {"name": "p1", "kind": "prefill", "nodes": ["n1"]},
          {"name": "d0", "kind": "decode", "nodes": ["n2"]}]  # fmt: skip


def test_an_answer_needs_tokens() -> None:
    assert tokens_of(200, "") == (False, "200 with an empty body")  # what the proxy sends when decode failed
    assert not tokens_of(200, json.dumps({"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}))[0]
    assert not tokens_of(503, "Service Unavailable")[0]
    assert tokens_of(200, json.dumps({"choices": [{"text": " a b"}], "usage": {"completion_tokens": 2}})) == (
        True, "2 tokens")
    counter = EmptyCounter(after=2)
    assert [counter.observe("d0", ok) for ok in (False, True, False, False, False)] == [
        False, False, False, True, False], "two in a row act once; a good answer starts the count again"


def test_kv_pressure_only_while_decode_is_down_one_group_at_a_time() -> None:
    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="dsv4"} 0.42\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="dsv4"} 0.95\n')  # fmt: skip
    assert kv_usage(text) == 0.95
    usage = {"p0": 0.95, "p1": 0.97}
    assert kv_pressure([], usage, {"p0": True, "p1": True}, 0.9) is None, "decode up: prefill's KV is its own"
    group, why = kv_pressure(["d0"], usage, {"p0": True, "p1": True}, 0.9)  # type: ignore[misc]
    assert group == "p1" and "#13240" in why
    assert kv_pressure(["d0"], usage, {"p0": True, "p1": False}, 0.9) is None, "one prefill group at a time"
    assert kv_pressure(["d0"], {"p0": 0.5}, {"p0": True}, 0.9) is None


def test_transfer_failures_are_summed_per_pair_from_every_member() -> None:
    kinds = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    n2 = {"kv_transfers": [[100.0 + i, "d0", "p0"] for i in range(5)] + [[200.0 + i, "d0", "p1"] for i in range(5)]}
    verdict = merged_transfers(kinds, [n2, {}], 5, 300, {}).decide(250.0)
    assert verdict is not None and [r.engine for r in verdict] == ["d0"], "the decoder fails with every prefill"  # type: ignore[union-attr]
    one_pair = {"kv_transfers": [[100.0 + i, "d0", "p0"] for i in range(9)]}
    verdict = merged_transfers(kinds, [one_pair], 5, 300, {}).decide(250.0)
    assert [r.engine for r in verdict] == ["p0"], "p0 fails with its only decoder; d0 serves p1: not d0"  # type: ignore[union-attr]
    assert merged_transfers(kinds, [n2], 5, 300, {"d0": 300.0}).decide(350.0) is None, "counted again after a restart"


class Backends:
    """The prefill and decode instances as the probe calls them."""

    def __init__(self) -> None:
        self.decode_answer = (200, json.dumps({"choices": [{"text": " a b"}], "usage": {"completion_tokens": 2}}))
        self.calls: list[tuple[str, str]] = []
        self.prefill_id = ""

    async def __call__(self, method: str, url: str, body: dict[str, Any] | None, timeout: float,
                       headers: Mapping[str, str]) -> tuple[int, str]:  # fmt: skip
        self.calls.append((method, url))
        if url.endswith("/metrics"):
            return 200, 'vllm:kv_cache_usage_perc{engine="0",model_name="dsv4"} 0.1\n'
        if body and body["kv_transfer_params"].get("do_remote_decode"):
            self.prefill_id = headers["X-Request-Id"]
            return 200, json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": {"remote_engine_id": "p"}})
        assert body and body["kv_transfer_params"] == {"remote_engine_id": "p"}, "decode gets prefill's KV handle"
        assert headers["X-Request-Id"] == self.prefill_id, "one request id on both halves, as the proxy sends it"
        return self.decode_answer


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path / "w", ["n0", "n1", "n2"], GROUPS, proxy=True)
    w.start()
    await w.until("every component up", w.all_up, within=120)
    await w.until("the proxy ready", lambda: w.stacks["n0"].components["proxy"].ready)
    yield w
    await w.close()


@pytest.mark.parametrize("empty", [True, False])
async def test_a_decoder_answering_without_tokens_is_restarted(world: World, empty: bool) -> None:
    backends = Backends()
    if empty:
        backends.decode_answer = (200, "")
    co = world.agents["n0"].coordinator
    watch = PdWatch(co, PdWatchConfig(probe_period_s=10), lambda: {}, model="dsv4", clock=world.clock,
                    http=backends)  # fmt: skip
    co.spawn(watch.run())
    await world.advance(35)
    if empty:
        await world.until("d0 restarted", lambda: world.stacks["n2"].started("vllm") == 2, 60)
        assert world.gang("n2", "d0").record.generation == 2  # type: ignore[union-attr]
        assert "2 answers in a row without tokens from decode d0 (200 with an empty body)" in (
            world.gang("n2", "d0").record.reason)  # type: ignore[union-attr]
        assert {s.started("vllm") for n, s in world.stacks.items() if n != "n2"} == {1}, "prefill untouched"
    else:
        assert world.stacks["n2"].started("vllm") == 1 and watch.last_probe["d0"] == "2 tokens"
    assert not [c for c in backends.calls if c[1].endswith("/metrics")], "KV read only while decode is down"


async def test_one_restart_of_a_group_per_cooldown_whatever_the_reason(world: World) -> None:
    co = world.agents["n0"].coordinator
    watch = PdWatch(co, PdWatchConfig(probe_period_s=10), lambda: {}, model="dsv4", clock=world.clock,
                    http=Backends())  # fmt: skip
    assert await watch._restart("empty", "d0", "answers without tokens")
    assert not await watch._restart("transfer", "d0", "transfer failures with every prefill peer")
    assert await watch._restart("kv", "p0", "KV usage past the threshold"), "another group has its own cooldown"
    await world.until("d0 restarted", lambda: world.stacks["n2"].started("vllm") == 2, 60)
    await world.advance(RESTART_COOLDOWN_S)
    assert await watch._restart("transfer", "d0", "transfer failures again, after the cooldown")
    assert sorted(watch.status_section()["pd_watch"]["restarted"]) == ["d0 (empty)", "d0 (transfer)", "p0 (kv)"]


async def test_a_node_publishes_its_ranks_transfer_failures(world: World) -> None:
    """kvlog: the decode rank's log names the prefill peer by its Mooncake handshake port (kv_port range)."""
    from nodeagent.kvlog import KvTransferLog

    stack = world.stacks["n2"]
    kvlog = KvTransferLog(stack.config, stack, clock=world.clock)  # type: ignore[arg-type]
    p0 = world.agents["n0"].coordinator.layout.group("p0")
    kvlog.feed("vllm", [f"E20260101 transfer failed and disconnect to:127.0.0.1:{p0.kv_port}",
                        "Mooncake transfer failed for request. remote_request_id=abc, ret=-1.",
                        "INFO an unrelated line"])  # fmt: skip
    published = stack.status()["kv_transfers"]
    assert [row[1:] for row in published] == [["d0", "p0"], ["d0", None]]


async def test_the_agent_reaches_backends_and_proxy_directly_whatever_http_proxy_says(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Nodes export http_proxy for downloads, seldom with their own addresses in no_proxy (the guide unsets it
    before the proxy): the watch's probes and the proxy sync's calls must not go through it."""
    import http.server
    import threading

    from conftest import free_port

    from nodeagent.cluster.pd_watch import http_call
    from nodeagent.cluster.proxy_sync import http_post

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"id": self.headers.get("X-Request-Id")}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dead = f"http://127.0.0.1:{free_port()}"
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy"):
        monkeypatch.setenv(var, dead)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    try:
        assert await http_call("POST", url, {}, 5.0, {"X-Request-Id": "r1"}) == (200, '{"id": "r1"}')
        assert await http_post(url, {}) == {"id": None}
    finally:
        server.shutdown()
        server.server_close()


async def test_under_journald_the_relay_keeps_the_failure_lines_kvlog_counts(world: World,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd: a rank's output goes to journald through the log relay, never through a file of ours; the relay
    (the real one, around a real process) sends every line to journald and keeps the KV transfer failures in the
    component's folder, where kvlog reads them as it reads the log file outside systemd."""
    import functools
    import sys

    from journald_fake import fake_journald_socket, parse_entry

    from nodeagent import journal, logrelay, logsink
    from nodeagent.kvlog import KvTransferLog
    from nodeagent.render import component_dir

    stack = world.stacks["n2"]
    p0 = world.agents["n0"].coordinator.layout.group("p0")
    monkeypatch.setattr(logsink, "use_journal", lambda: True)
    kvlog = KvTransferLog(stack.config, stack, clock=world.clock)  # type: ignore[arg-type]
    folder = component_dir(stack.config, "vllm")
    folder.mkdir(parents=True, exist_ok=True)
    kv_file = folder / logsink.KV_FAILURES
    assert logsink.transfer_lines(stack.config.agent.log_dir, folder, "vllm") == kv_file
    assert kvlog.read_new("vllm") == [], "nothing before the rank's first line"
    lines = ["INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.32",
             f"E20260101 transfer failed and disconnect to:127.0.0.1:{p0.kv_port}",
             "ERROR [mooncake_connector.py:1329] Mooncake transfer failed for request. remote_request_id=r1, ret=-1."]
    with fake_journald_socket() as (sock, path):
        monkeypatch.setattr(logrelay, "JournalSender", functools.partial(journal.JournalSender, socket_path=path))
        # in this thread (it sets signal handlers): a short child, the loop waits a moment
        code = logrelay.relay("vllm", "dsv4-agent.service", [sys.executable, "-c", f"print({chr(10).join(lines)!r})"],
                              None, str(kv_file))  # fmt: skip
        assert code == 0
        sent = [parse_entry(sock.recv(65536)) for _ in lines]
    assert [e["MESSAGE"].decode() for e in sent] == lines, "journald got every line"
    assert {e["SYSLOG_IDENTIFIER"] for e in sent} == {b"vllm"}
    assert kv_file.read_text().splitlines() == lines[1:], "the relay kept the two failure lines"
    kvlog.feed("vllm", kvlog.read_new("vllm"))
    assert [row[1:] for row in stack.status()["kv_transfers"]] == [["d0", "p0"], ["d0", None]]

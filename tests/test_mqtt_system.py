"""The whole stack (real etcd, the real datasystem worker, the vLLM stand-in) publishing to a real mosquitto while
it is started, faulted (kill -9 of vLLM, kill -9 of the agent) and stopped: a monitor sees every event in order
with no gap in the numbers across the agent's restart, a status matching /status, the will `offline` on
kill -9, the cache hit rates, and `stopped` at the end."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import LocalAgent, derived_config, wait_for
from mqtthelpers import Mosquitto, Subscriber, first_occurrences, mqtt_config, same_components

pytestmark = pytest.mark.system


def api_get(agent: LocalAgent, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", int(agent.env["DSV4_API_PORT"]), timeout=10)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def last_seq(agent: LocalAgent) -> int:
    """The newest event's number, from the SSE replay (`/events?replay=1`, up to the `: live` comment)."""
    conn = http.client.HTTPConnection("127.0.0.1", int(agent.env["DSV4_API_PORT"]), timeout=10)
    try:
        conn.request("GET", "/events?replay=1")
        response = conn.getresponse()
        seq = 0
        while (line := response.fp.readline()) and not line.startswith(b": live"):
            if line.startswith(b"id: "):
                seq = int(line[4:])
        return seq
    finally:
        conn.close()


async def test_stack_started_faulted_and_stopped_seen_over_mqtt(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "broker").start()
    sub = await Subscriber(broker.port, "t/#").start()
    config = derived_config(tmp_path / "agent.yaml", {"agent": {"mqtt": mqtt_config(
        broker.port, cache_interval_s=0.5, status_interval_s=2)}})  # fmt: skip
    agent = LocalAgent(tmp_path / "home", config)
    agent.home.mkdir()
    try:
        agent.start()
        await asyncio.to_thread(agent.wait_all_up)

        def status_agrees() -> bool:
            status = api_get(agent, "/status")
            last = sub.on("status")[-1].payload if sub.on("status") else {}
            return status["mqtt"]["connected"] and last.get("state") == "running" and same_components(last, status)

        await sub.wait("the status topic to agree with /status", status_agrees, 60)
        cache = await sub.wait("cache hit rates", lambda: [m for m in sub.on("cache") if "vllm" in
                                                           m.payload.get("components", {})], 30)  # fmt: skip
        rows = cache[-1].payload["components"]["vllm"]
        assert rows[-1]["engine"] == "all" and {"local_win", "ext_total", "eff_total"} <= set(rows[-1])
        assert not cache[-1].retain

        # A fault: kill -9 of vLLM's API server → a new vLLM, every state change on the events topic.
        old = agent.children()["vllm"]["pid"]
        seen = len(sub.events())
        os.kill(old, signal.SIGKILL)
        await asyncio.to_thread(wait_for, "a new vllm", lambda: agent.children().get("vllm", {}).get("pid")
                                not in (None, old), 90)  # fmt: skip
        await asyncio.to_thread(agent.wait_all_up)

        def vllm_states() -> list[str]:
            return [e["data"]["state"] for e in sub.events()[seen:] if e["event"] == "state"
                    and e["component"] == "vllm"]  # fmt: skip

        def in_order(states: list[str], want: list[str]) -> bool:
            rest = iter(states)
            return all(state in rest for state in want)

        # (a failing readiness probe may get in first: ready → running before the exit is seen)
        want = ["stopping", "stopped", "starting", "running"]
        await sub.wait("vllm restarted", lambda: in_order(vllm_states(), want))

        # kill -9 of the agent once everything is delivered: the broker publishes the will.
        before = await asyncio.to_thread(last_seq, agent)
        await sub.wait("everything so far", lambda: sub.events() and sub.events()[-1]["seq"] >= before
                       and api_get(agent, "/status")["mqtt"]["queued"] == 0, 20)  # fmt: skip
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(10)
        await sub.wait("the will", lambda: sub.on("status")[-1].payload.get("state") == "offline", 30)
        late = await Subscriber(broker.port, "t/local/node0/status").start()
        will = (await late.wait("the retained will", lambda: late.on("status")))[0]
        await late.close()
        assert will.retain and will.payload["state"] == "offline" and will.payload["node"]["name"] == "node0"

        # The next agent adopts the stack and carries the event numbers on.
        agent.start()
        await asyncio.to_thread(wait_for, "adoption", lambda: agent.log().count("adopted running pid") == 3, 60)
        await sub.wait("running again", lambda: sub.on("status")[-1].payload.get("state") == "running", 30)
        await sub.wait("the status topic to agree with /status", status_agrees, 60)

        assert await asyncio.to_thread(agent.terminate, 120) == 0
        final = await sub.wait("stopped", lambda: sub.on("status")[-1].payload.get("state") == "stopped", 30)
        assert final
    finally:
        await asyncio.to_thread(agent.cleanup)
        await sub.close()
        broker.stop()
    events = sub.events()
    seqs = first_occurrences(events)
    assert seqs == list(range(1, seqs[-1] + 1)), "no gap in the numbers, across the agent's kill -9 and restart"
    starts = [e["seq"] for e in events if e["event"] == "agent_start"]
    assert len(starts) == 2 and starts[1] > before
    assert all(c["state"] == "stopped" for c in sub.on("status")[-1].payload["components"].values())

"""MQTT publishing against a real mosquitto (started per test on its own port and config file), with the in-process
agent (tiny `kind: process` components): events in order without gaps, the retained status against /status,
outages, overflow, refused credentials, a frozen broker, TLS — and no MQTT code at all without `agent.mqtt`."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from apihelpers import InProcess, start_in_process, tiny_config
from conftest import ROOT
from mqtthelpers import Mosquitto, Subscriber, first_occurrences, make_tls_files, mqtt_config, same_components

from nodeagent.api.mqtt import MqttPublisher
from nodeagent.cli import format_status


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path / "broker").start()
    try:
        yield b
    finally:
        b.stop()


NO_BACKOFF = {"first_delay_s": 0, "backoff_initial_s": 0, "backoff_max_s": 0, "redeploy_after_failures": 1000}


async def stack_with_mqtt(home: Path, **mqtt: Any) -> InProcess:
    """The tiny stack publishing to `mqtt`; a's restarts never back off, so they can be timed repeatedly."""
    data = tiny_config(home)
    data["agent"]["mqtt"] = mqtt
    data["components"]["a"]["restart"] = NO_BACKOFF
    return await start_in_process(home, data)


async def broker_outage(stack: InProcess, broker: Mosquitto) -> MqttPublisher:
    """Once the publisher is connected and idle, stop the broker and wait until the publisher knows."""
    mqtt = stack.agent.mqtt
    assert mqtt is not None
    await stack.wait("connected", lambda: mqtt.connected and not len(mqtt.outbox))
    broker.stop()
    await stack.wait("the outage noticed", lambda: not mqtt.connected, 10)
    return mqtt


async def restart_after_kill(stack: InProcess, name: str = "a") -> float:
    """kill -9 of the component → its replacement is up (seconds)."""
    comp = stack.agent.supervisor.components[name]
    old = stack.pids()[name]
    assert old is not None
    began = time.monotonic()
    os.kill(old, signal.SIGKILL)
    await stack.wait(f"{name} replaced", lambda: comp.record is not None and comp.record.pid != old
                     and comp.up.is_set())  # fmt: skip
    took = time.monotonic() - began
    await stack.wait_states({n: {"ready"} for n in stack.agent.supervisor.components})
    return took


async def test_every_event_in_order_and_the_retained_status_matches(tmp_path: Path, broker: Mosquitto) -> None:
    sub = await Subscriber(broker.port, "t/#").start()
    stack = await stack_with_mqtt(tmp_path / "home", **mqtt_config(broker.port))
    try:
        mqtt = stack.agent.mqtt
        assert mqtt is not None
        await restart_after_kill(stack)  # a fault: a dies, b restarts with it
        for action in ("stop", "start"):
            assert (await stack.post(f"/components/b/{action}"))[0] == 202
            await stack.wait_states({"b": {"stopped"} if action == "stop" else {"ready"}})
        assert (await stack.post("/pause"))[0] == 200

        _, status = await stack.get("/status")
        assert status["mqtt"]["connected"] and status["mqtt"]["broker"] == f"mqtt://127.0.0.1:{broker.port}"
        assert status["mqtt"]["topics"]["status"] == f"t/{status['node']['cluster']}/tiny/status"

        def latest_matches() -> bool:
            last = sub.on("status")[-1].payload
            return last["state"] == "running" and last["paused"] is True and same_components(last, status)

        await sub.wait("the status topic to match /status", latest_matches)
        late = await Subscriber(broker.port, mqtt.topics.status).start()  # a monitor that joins now
        retained = (await late.wait("the retained status", lambda: late.on("status")))[0]
        await late.close()
        assert retained.retain and same_components(retained.payload, status)
        assert retained.payload["node"] == status["node"] and retained.payload["agent"]["pid"] == os.getpid()
        assert (await stack.post("/resume"))[0] == 200
    finally:
        await stack.close()
    bus = stack.agent.supervisor.events
    await sub.wait("every event", lambda: sub.events() and sub.events()[-1]["seq"] == bus.last_seq)
    got = sub.events()
    assert [e["seq"] for e in got] == list(range(1, bus.last_seq + 1)), "in order, none missing, none twice"
    assert got == [e.to_dict() for e in bus.recent], "the same events /events serves"
    changes = [(e["component"], e["data"]["state"]) for e in got if e["event"] == "state"]
    assert ("a", "stopped") in changes and changes[-2:] == [("a", "stopping"), ("a", "stopped")]
    final = await sub.wait("the final status", lambda: [m for m in sub.on("status") if m.payload["state"] == "stopped"])
    assert all(c["state"] == "stopped" for c in final[-1].payload["components"].values())
    await sub.close()


async def test_broker_outage_loses_nothing_within_the_buffer(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "broker", persistence=True).start()
    # A persistent session: the broker keeps queueing for this monitor across its own restart.
    sub = await Subscriber(broker.port, "t/+/+/events", client_id="monitor", persistent=True).start()
    stack = await stack_with_mqtt(tmp_path / "home", **mqtt_config(broker.port))
    try:
        mqtt = await broker_outage(stack, broker)
        took = await restart_after_kill(stack)  # events happen meanwhile; supervision is as quick as ever
        assert took < 2.0
        for i in range(30):
            stack.agent.supervisor.events.emit("test", f"during the outage {i}")
        _, status = await stack.get("/status")
        assert not status["mqtt"]["connected"] and status["mqtt"]["last_error"]
        assert status["mqtt"]["queued"] >= 30 and status["mqtt"]["dropped"] == 0
        assert "DISCONNECTED from mqtt://127.0.0.1" in format_status(status)
        broker.start()
        await stack.wait("reconnected and flushed", lambda: mqtt.connected and not len(mqtt.outbox), 15)
        last = stack.agent.supervisor.events.last_seq
        await sub.wait("every event after the outage", lambda: sub.events() and sub.events()[-1]["seq"] == last)
    finally:
        await stack.close()
        await sub.close()
        broker.stop()
    assert first_occurrences(sub.events())[: last] == list(range(1, last + 1))
    assert mqtt.outbox.dropped == 0


async def test_overflow_drops_the_oldest_and_says_how_many(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "broker", persistence=True).start()
    sub = await Subscriber(broker.port, "t/#", client_id="monitor", persistent=True).start()
    stack = await stack_with_mqtt(tmp_path / "home", **mqtt_config(broker.port, buffer=10))
    try:
        mqtt = await broker_outage(stack, broker)
        bus = stack.agent.supervisor.events
        before = bus.last_seq
        for i in range(25):
            bus.emit("test", f"burst {i}")
        await stack.wait("all in the outbox", lambda: mqtt.outbox.last_pushed == before + 25)
        _, status = await stack.get("/status")
        assert status["mqtt"]["queued"] == 10 and status["mqtt"]["dropped"] == 15
        async with stack.session.get(stack.url + "/metrics") as r:
            text = await r.text()
        assert 'dsv4_mqtt_dropped_total{topic="events"} 15.0' in text and "dsv4_mqtt_queued 10.0" in text
        assert "dsv4_mqtt_connected 0.0" in text
        broker.start()
        await stack.wait("reconnected and flushed", lambda: mqtt.connected and not len(mqtt.outbox), 15)
        await sub.wait("the drop report", lambda: [e for e in sub.events() if e["event"] == "mqtt_dropped"])
        await sub.wait("a status counting the drops",
                       lambda: [m for m in sub.on("status") if m.payload.get("mqtt", {}).get("dropped") == 15])
    finally:
        await stack.close()
        await sub.close()
        broker.stop()
    seqs = first_occurrences(sub.events())
    after = [s for s in seqs if s > before]
    report = next(e for e in sub.events() if e["event"] == "mqtt_dropped")
    assert after[:10] == list(range(before + 16, before + 26)), "the newest ten, in order"
    assert after[10] == report["seq"] == before + 26, "then the news of the fifteen before them"
    assert report["data"] == {"dropped": 15, "first_seq": before + 1, "last_seq": before + 15, "dropped_total": 15,
                              "buffer": 10}  # fmt: skip


async def test_refused_credentials_are_explained_and_supervision_goes_on(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "broker", users={"agent": "right-one", "monitor": "m"}).start()
    password = tmp_path / "mqtt-password"
    password.write_text("wrong\n")
    password.chmod(0o600)
    try:
        stack = await stack_with_mqtt(tmp_path / "home", **mqtt_config(broker.port, username="agent",
                                                                        password_file=str(password)))  # fmt: skip
        try:
            mqtt = stack.agent.mqtt
            assert mqtt is not None
            await stack.wait("the refusal", lambda: mqtt.last_error and "refused the credentials" in mqtt.last_error)
            _, status = await stack.get("/status")
            assert not status["mqtt"]["connected"]
            assert "check agent.mqtt.username and password_file" in status["mqtt"]["last_error"]
            assert await restart_after_kill(stack) < 2.0  # the agent keeps supervising
            password.write_text("right-one\n")  # read again at every attempt: no restart needed
            await stack.wait("connected with the new password", lambda: mqtt.connected, 10)
            assert mqtt.last_error is None
        finally:
            await stack.close()
    finally:
        broker.stop()


async def test_a_frozen_broker_does_not_slow_supervision(tmp_path: Path, broker: Mosquitto) -> None:
    """The broker accepts connections and then stops reading (SIGSTOP): crash-to-restart stays as fast, the event
    loop keeps ticking, and once the broker runs again every event arrives in order."""
    sub = await Subscriber(broker.port, "t/+/+/events").start()
    stack = await stack_with_mqtt(tmp_path / "home", **mqtt_config(broker.port))
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - began - 0.01)

    tick = asyncio.create_task(ticker())
    try:
        mqtt = stack.agent.mqtt
        assert mqtt is not None
        await stack.wait("connected", lambda: mqtt.connected and not len(mqtt.outbox))
        baseline = [await restart_after_kill(stack) for _ in range(3)]
        lags.clear()
        broker.freeze()
        frozen = []
        for _ in range(3):
            for i in range(100):
                stack.agent.supervisor.events.emit("test", f"while frozen {i}")
            frozen.append(await restart_after_kill(stack))
        await stack.wait("the silent broker noticed", lambda: not mqtt.connected, 10)
        frozen.append(await restart_after_kill(stack))  # also while reconnect attempts hang on the frozen broker
        worst_lag = max(lags)
        broker.thaw()
        await stack.wait("reconnected and flushed", lambda: mqtt.connected and not len(mqtt.outbox), 20)
        last = stack.agent.supervisor.events.last_seq
        await sub.wait("every event", lambda: sub.events() and sub.events()[-1]["seq"] >= last, 20)
    finally:
        tick.cancel()
        await stack.close()
        await sub.close()
    assert statistics.median(frozen) < statistics.median(baseline) + 0.5, (baseline, frozen)
    assert worst_lag < 0.5, f"the event loop stalled for {worst_lag:.3f}s"
    assert first_occurrences(sub.events())[:last] == list(range(1, last + 1))


async def test_tls_with_a_ca_file(tmp_path: Path) -> None:
    files = make_tls_files(tmp_path / "pki")
    other = make_tls_files(tmp_path / "other-pki")
    broker = Mosquitto(tmp_path / "broker", tls=files).start()
    try:
        url = f"mqtts://localhost:{broker.port}"
        stack = await stack_with_mqtt(tmp_path / "home", **mqtt_config(broker.port, url=url, ca_file=str(files["ca"])))
        try:
            mqtt = stack.agent.mqtt
            assert mqtt is not None
            await stack.wait("connected over TLS", lambda: mqtt.connected and mqtt.published["status"], 10)
        finally:
            await stack.close()
        stack = await stack_with_mqtt(tmp_path / "home2", **mqtt_config(broker.port, url=url,
                                                                         ca_file=str(other["ca"])))  # fmt: skip
        try:
            mqtt = stack.agent.mqtt
            assert mqtt is not None
            await stack.wait("the certificate refused", lambda: mqtt.last_error and "CERTIFICATE_VERIFY_FAILED"
                             in mqtt.last_error, 10)  # fmt: skip
            assert not mqtt.connected
        finally:
            await stack.close()
    finally:
        broker.stop()


def test_without_agent_mqtt_no_mqtt_code_is_imported(tmp_path: Path) -> None:
    """A fresh interpreter runs the agent (API + supervisor) without agent.mqtt: nodeagent.api.mqtt, aiomqtt and paho
    never load, and /status has no mqtt section."""
    script = textwrap.dedent(f"""
        import asyncio, json, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from pathlib import Path
        from apihelpers import start_in_process

        async def main():
            stack = await start_in_process(Path({str(tmp_path / "home")!r}))
            try:
                _, status = await stack.get("/status")
                async with stack.session.get(stack.url + "/metrics") as r:
                    metrics = await r.text()
            finally:
                await stack.close()
            loaded = sorted(m for m in sys.modules if "mqtt" in m or m.startswith("paho"))
            print(json.dumps({{"loaded": loaded, "has_mqtt": "mqtt" in status,
                               "metrics": "dsv4_mqtt" in metrics}}))

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    result = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert result == {"loaded": [], "has_mqtt": False, "metrics": False}

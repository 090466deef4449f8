#!/usr/bin/env python3
"""What MQTT publishing costs the agent, and how fast events reach a real mosquitto.

- **seq persistence**: the cost per `EventBus.emit` of carrying the event number across restarts (one pwrite, no
  fsync), next to the emit itself (logging switched off, so only the bus is timed) — anchor: "every event is
  emitted on the supervisor's hot path; don't add an fsync per event".
- **emit with the publisher subscribed**: the supervisor-side cost per event once MQTT is on (the bus queue put
  and the pump's outbox append happen in the same loop) — anchor: "broker outages never block or slow the agent".
- **live throughput**: events/s from `emit` to a subscriber on a local mosquitto (QoS 1 both ways).
- **backlog drain**: events buffered during an outage, then delivered after the broker returns.

Usage: `.venv/bin/python bench/mqtt.py [--events 20000] [--rounds 5]`. Needs /usr/sbin/mosquitto (Debian).
Everything runs in one process on loopback with a temporary folder; the broker is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loguru import logger

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nodeagent.config.load import parse_config  # noqa: E402
from nodeagent.core.events import EventBus  # noqa: E402
from nodeagent.node.supervisor import Supervisor  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Broker:
    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.conf = home / "mosquitto.conf"
        user = __import__("pwd").getpwuid(os.getuid()).pw_name
        self.conf.write_text(f"user {user}\nlistener {self.port} 127.0.0.1\nallow_anonymous true\n"
                             f"max_queued_messages 0\nlog_dest none\npersistence true\n"
                             f"persistence_location {home}/\nautosave_interval 0\n")  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        self.proc = subprocess.Popen([exe, "-c", str(self.conf)], start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.02)
        raise SystemExit("mosquitto did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)


def per_emit_us(bus: EventBus, n: int) -> float:
    began = time.perf_counter()
    for i in range(n):
        bus.emit("bench", "m", None, "info", i=i)
    return (time.perf_counter() - began) / n * 1e6


def bench_seq(folder: Path, n: int, rounds: int) -> dict[str, float]:
    plain, persisted = [], []
    for r in range(rounds):
        plain.append(per_emit_us(EventBus(), n))
        persisted.append(per_emit_us(EventBus(seq_path=folder / f"seq-{r}"), n))
    return {"emit_us": statistics.median(plain), "emit_persisted_us": statistics.median(persisted)}


def config_for(home: Path, port: int, buffer: int) -> object:
    text = (f"cluster: {{name: bench}}\nnode: {{name: n0, ip: 127.0.0.1}}\n"
            f"agent: {{state_dir: {home}/state, log_dir: {home}/logs, mqtt: {{url: 'mqtt://127.0.0.1:{port}', "
            f"topic_prefix: b, buffer: {buffer}, timeout_s: 2, reconnect_max_s: 0.5}}}}\n")  # fmt: skip
    return parse_config(text)


class Monitor:
    """A subscriber to the events topic that says when it has `want` messages."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.got = 0
        self.want = 0
        self.ready = asyncio.Event()
        self.done = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        """A persistent session, reconnecting: the broker keeps queueing for it across its own restart."""
        import aiomqtt

        while True:
            try:
                async with aiomqtt.Client("127.0.0.1", self.port, identifier="bench-monitor",
                                          clean_session=False) as client:  # fmt: skip
                    await client.subscribe("b/bench/n0/events", qos=1)
                    self.ready.set()
                    async for _ in client.messages:
                        self.got += 1
                        if self.got >= self.want:
                            self.done.set()
            except aiomqtt.MqttError:
                await asyncio.sleep(0.01)

    def expect(self, more: int) -> None:
        self.want = self.got + more
        self.done.clear()

    async def start(self, want: int) -> None:
        self.want = want
        self.task = asyncio.create_task(self._run())
        await asyncio.wait_for(self.ready.wait(), 10)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task


async def run_publisher(home: Path, n: int, rounds: int) -> dict[str, float]:
    from nodeagent.api.mqtt import MqttPublisher
    from nodeagent.api.vllm_sampler import VllmSampler

    broker = Broker(home)
    broker.start()
    results: dict[str, list[float]] = {"emit_subscribed_us": [], "live_events_per_s": [], "drain_events_per_s": []}
    try:
        for r in range(rounds):
            config = config_for(home / f"r{r}", broker.port, buffer=n + 10)
            sup = Supervisor(config, EventBus(seq_path=home / f"r{r}" / "events.seq", queue_size=n + 10))  # type: ignore[arg-type]
            pub = MqttPublisher(config, sup, VllmSampler(sup))  # type: ignore[arg-type]
            monitor = Monitor(broker.port)
            await monitor.start(n)
            pub.start()
            while not pub.connected:
                await asyncio.sleep(0.01)
            # live: emit in slices so the loop runs the publisher meanwhile, as it would in the agent
            began = time.perf_counter()
            emit_s = 0.0
            for start in range(0, n, 200):
                t = time.perf_counter()
                for i in range(start, min(n, start + 200)):
                    sup.events.emit("bench", "live", None, "info", i=i)
                emit_s += time.perf_counter() - t
                await asyncio.sleep(0)
            await asyncio.wait_for(monitor.done.wait(), 300)
            results["live_events_per_s"].append(n / (time.perf_counter() - began))
            results["emit_subscribed_us"].append(emit_s / n * 1e6)
            # backlog: broker away, n events buffered, broker back: from its return to the last delivery (this
            # includes the publisher's reconnect backoff, ≤ 0.5 s here)
            broker.stop()
            while pub.connected:
                await asyncio.sleep(0.01)
            monitor.expect(n)
            for i in range(n):
                sup.events.emit("bench", "backlog", None, "info", i=i)
            began = time.perf_counter()
            broker.start()
            await asyncio.wait_for(monitor.done.wait(), 300)
            results["drain_events_per_s"].append(n / (time.perf_counter() - began))
            await pub.close()
            await monitor.close()
    finally:
        broker.stop()
    return {k: statistics.median(v) for k, v in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    logger.remove()  # time the bus, not the log sink
    home = Path(tempfile.mkdtemp(prefix="dsv4-mqtt-bench-"))
    try:
        seq = bench_seq(home, args.events, args.rounds)
        pub = asyncio.run(run_publisher(home, min(args.events, 10000), args.rounds))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}; medians of {args.rounds} rounds")
    print(f"emit, in-memory seq:            {seq['emit_us']:7.2f} µs")
    print(f"emit, persisted seq (pwrite):   {seq['emit_persisted_us']:7.2f} µs  "
          f"(+{seq['emit_persisted_us'] - seq['emit_us']:.2f} µs; anchor: no fsync per event)")
    print(f"emit, MQTT publisher subscribed:{pub['emit_subscribed_us']:7.2f} µs  (persisted seq + bus queue put)")
    print(f"live, emit → subscriber:        {pub['live_events_per_s']:7.0f} events/s")
    print(f"backlog drain after an outage:  {pub['drain_events_per_s']:7.0f} events/s")


if __name__ == "__main__":
    main()

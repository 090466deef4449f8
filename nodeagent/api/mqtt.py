"""Publish the node's status, events and vLLM cache hit rates to the monitoring system's MQTT broker (aiomqtt).

Imported only when `agent.mqtt` is configured. Topics under `<topic_prefix>/<cluster>/<node>/`:
`status` (retained; last will `offline`), `events` (every bus event, in order, with its persisted `seq`) and
`cache` (every scrape). Nothing here may hold the agent up: a pump moves each bus event into a bounded outbox at
once, and one task owns the connection — it connects with backoff, sends the outbox in order, and treats a
missing acknowledgement within `timeout_s` as a lost connection. A broker that is
down, refuses us, or accepts and then stops reading costs the supervisor nothing but outbox appends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from loguru import logger
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from nodeagent import __version__
from nodeagent.api.mqtt_model import (
    Outbox,
    cache_payload,
    cache_summary,
    default_client_id,
    drop_message,
    dumps,
    event_payload,
    explain_connect_error,
    offline_payload,
    reconnect_delay,
    status_digest,
    status_payload,
    topics_for,
)
from nodeagent.api.vllm_sampler import CacheWindow, VllmSampler
from nodeagent.core.task_owner import log_death

if TYPE_CHECKING:
    import aiomqtt

    from nodeagent.config.model import Config
    from nodeagent.core.events import Event
    from nodeagent.node.supervisor import Supervisor



class MqttSetupError(Exception):
    """The client cannot even be built (password file unreadable, CA file bad): retried like a connect error."""


def _import_aiomqtt() -> Any:
    import aiomqtt

    return aiomqtt


class MqttPublisher:
    """`start()` it once the supervisor exists, `close(final_state)` after the stack stopped (or detached)."""

    def __init__(self, config: Config, supervisor: Supervisor, sampler: VllmSampler,
                 started_at: float | None = None) -> None:  # fmt: skip
        assert config.agent.mqtt is not None
        self.cfg = config.agent.mqtt
        self.sup = supervisor
        self.cluster, self.node = config.cluster.name, config.node.name
        self.topics = topics_for(self.cfg.topic_prefix, self.cluster, self.node)
        self.client_id = self.cfg.client_id or default_client_id(self.cluster, self.node)
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        self.broker = f"{'mqtts' if self.cfg.tls else 'mqtt'}://{host}:{self.cfg.port}"
        self.started_at = started_at if started_at is not None else time.time()
        self.outbox = Outbox(self.cfg.buffer)
        self.scraper = CacheWindow(sampler, max_age_s=self.cfg.cache_interval_s / 2)
        self.agent_state = "running"
        self.connected = False
        self.connected_since: float | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.connects = 0
        self.connect_failures = 0
        self.published: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self._wake = asyncio.Event()
        self._status_dirty = True
        self._status_digest: bytes | None = None
        self._status_at = 0.0
        self._cache: dict[str, Any] = {}
        self._cache_message: bytes | None = None
        self._final = False
        self._finished = False
        self._queue: asyncio.Queue[Event] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ---- wiring -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Subscribe before the agent's first event, so the broker gets every one."""
        self._queue = self.sup.events.subscribe()
        self._tasks = [asyncio.create_task(coro, name=f"mqtt-{name}") for name, coro in
                       (("pump", self._pump()), ("link", self._link()), ("cache", self._scrape_loop()))]  # fmt: skip
        for task in self._tasks:
            task.add_done_callback(log_death)
        logger.info(f"MQTT: publishing to {self.broker} under {self.topics.status.rsplit('/', 1)[0]}/")

    def status_changed(self) -> None:
        """Every change of the node (a `ChangeObserver`): cheap; the publish is coalesced."""
        self._status_dirty = True
        self._wake.set()

    def set_agent_state(self, state: str) -> None:
        self.agent_state = state
        self.status_changed()

    async def close(self, final_state: str = "stopped") -> None:
        """Send what is queued and the final status, then DISCONNECT (no will); bounded by 2 × timeout_s."""
        if self._finished or not self._tasks:
            return
        self._drain_bus()
        self.agent_state = final_state
        self._final = True
        self.status_changed()
        link = self._tasks[1]
        try:
            async with asyncio.timeout(2 * self.cfg.timeout_s):
                await asyncio.shield(link)
        except TimeoutError:
            pass
        finally:
            self._finished = True
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self._queue is not None:
                self.sup.events.unsubscribe(self._queue)
        if len(self.outbox) or not self.connects:
            logger.warning(f"MQTT: exiting with {len(self.outbox)} events undelivered to {self.broker}"
                           + (f" ({self.last_error})" if self.last_error else ""))  # fmt: skip

    # ---- views ----------------------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """What /status and `nodeagentctl status` show."""
        return {
            "connected": self.connected, "broker": self.broker, "client_id": self.client_id,
            "topics": {"status": self.topics.status, "events": self.topics.events, "cache": self.topics.cache},
            "connected_since": self.connected_since, "last_error": self.last_error,
            "last_error_at": self.last_error_at, "queued": len(self.outbox), "dropped": self.outbox.dropped,
            "published": sum(self.published.values()),
        }  # fmt: skip

    def collect(self) -> Iterator[Metric]:
        """A prometheus_client collector (register this object): read at scrape time."""
        yield GaugeMetricFamily("dsv4_mqtt_connected", "1 while connected to the MQTT broker.",
                                value=float(self.connected))  # fmt: skip
        yield GaugeMetricFamily("dsv4_mqtt_queued", "Events waiting for the broker (bounded by agent.mqtt.buffer).",
                                value=len(self.outbox))  # fmt: skip
        published = CounterMetricFamily("dsv4_mqtt_published", "Messages the broker acknowledged (QoS 0: sent).",
                                        labels=["topic"])  # fmt: skip
        dropped = CounterMetricFamily("dsv4_mqtt_dropped", "Messages given up: events pushed out of the full buffer, "
                                      "cache rates scraped while disconnected.", labels=["topic"])  # fmt: skip
        for topic in ("status", "events", "cache"):
            published.add_metric([topic], self.published[topic])
            dropped.add_metric([topic], self.outbox.dropped if topic == "events" else self.dropped[topic])
        yield published
        yield dropped
        yield CounterMetricFamily("dsv4_mqtt_connection_failures", "Connection attempts that failed or were lost.",
                                  value=self.connect_failures)  # fmt: skip

    def _status_payload(self) -> dict[str, Any]:
        agent = {"version": __version__, "pid": os.getpid(), "started_at": self.started_at}
        return status_payload(self.agent_state, self.sup.status(), agent, self._cache, self.outbox.dropped,
                              time.time())  # fmt: skip

    # ---- the pump and the scraper -------------------------------------------------------------------------------
    def _drain_bus(self) -> None:
        assert self._queue is not None
        while not self._queue.empty():
            self.outbox.push(self._queue.get_nowait())

    async def _pump(self) -> None:
        assert self._queue is not None
        while True:
            self.outbox.push(await self._queue.get())
            self._drain_bus()
            self.status_changed()  # a pause, a redeploy, a reset change /status without a state change

    async def _scrape_loop(self) -> None:
        while True:
            try:
                await self.scraper.refresh()
            except Exception as exc:  # a scrape must never end the loop
                logger.warning(f"MQTT: vLLM metrics scrape failed: {exc}")
            rows = self.scraper.rows
            self._cache = cache_summary(rows)
            if rows and self.connected:
                self._cache_message = dumps(cache_payload(rows, time.time()))
                self._wake.set()
            elif rows:
                self.dropped["cache"] += 1
            await asyncio.sleep(self.cfg.cache_interval_s)

    # ---- the connection -----------------------------------------------------------------------------------------
    def _client(self, mqtt: Any) -> aiomqtt.Client:
        password = None
        if self.cfg.password_file is not None:
            try:
                password = self.cfg.password_file.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise MqttSetupError(f"cannot read agent.mqtt.password_file {self.cfg.password_file}: {exc}") from None
        context = None
        if self.cfg.tls:
            try:
                context = ssl.create_default_context(cafile=str(self.cfg.ca_file) if self.cfg.ca_file else None)
            except (OSError, ssl.SSLError) as exc:
                raise MqttSetupError(f"cannot load agent.mqtt.ca_file {self.cfg.ca_file}: {exc}") from None
        will = mqtt.Will(self.topics.status, dumps(offline_payload(self.cluster, self.node)), self.cfg.qos, True)
        return mqtt.Client(self.cfg.host, self.cfg.port, username=self.cfg.username, password=password,
                           identifier=self.client_id, will=will, keepalive=self.cfg.keepalive_s,
                           timeout=self.cfg.timeout_s, tls_context=context, clean_session=True)  # fmt: skip

    def _failed(self, message: str) -> None:
        first = message != self.last_error
        self.connected, self.connected_since = False, None
        self.last_error, self.last_error_at = message, time.time()
        self.connect_failures += 1
        self.status_changed()
        (logger.warning if first else logger.debug)(f"MQTT {self.broker}: {message}")

    async def _link(self) -> None:
        """Connect, serve, reconnect with backoff — until `close()` and the final flush."""
        try:
            mqtt = _import_aiomqtt()
        except ImportError:
            self._failed("aiomqtt is not importable (a dependency of dsv4-agent: reinstall it); "
                         "the agent goes on without MQTT")
            return
        failures = 0
        while True:
            try:
                client = self._client(mqtt)
                await self._connect(client, mqtt)
            except (MqttSetupError, mqtt.MqttError) as exc:
                failures += 1
                setup = isinstance(exc, MqttSetupError)
                self._failed(str(exc) if setup else explain_connect_error(_code(exc), str(exc)))
                if self._final:
                    return
                await self._sleep(reconnect_delay(failures, self.cfg.reconnect_max_s))
                continue
            failures = 0
            self.connected, self.connected_since, self.last_error = True, time.time(), None
            self.connects += 1
            self._status_digest, self._status_dirty = None, True  # the broker may have lost it, or sent our will
            logger.info(f"MQTT: connected to {self.broker} as {self.client_id}")
            try:
                await self._serve(client, mqtt)
                await self._disconnect(client)
                self.connected = False
                return
            except mqtt.MqttError as exc:
                self._failed(f"connection lost: {exc}")
                await self._disconnect(client)
            except Exception as exc:  # a bug here must not end publishing for the agent's lifetime
                logger.exception("MQTT: publisher error")
                self._failed(f"publisher error: {exc!r}")
                await self._disconnect(client)
            if self._final:
                return
            await self._sleep(reconnect_delay(1, self.cfg.reconnect_max_s))

    async def _sleep(self, delay: float) -> None:
        """Back off; `close()` cuts it short for one last attempt."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                while not self._final:
                    self._wake.clear()
                    await self._wake.wait()

    async def _connect(self, client: aiomqtt.Client, mqtt: Any) -> None:
        try:
            await client.__aenter__()
        except mqtt.MqttError:
            _abandon(client)
            raise

    async def _disconnect(self, client: aiomqtt.Client) -> None:
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await client.__aexit__(None, None, None)
        except (TimeoutError, Exception):  # a broker that stopped reading never acknowledges the DISCONNECT
            _abandon(client)

    async def _serve(self, client: aiomqtt.Client, mqtt: Any) -> None:
        """Until the connection fails (MqttError) or, after `close()`, everything is sent."""
        watch = asyncio.ensure_future(_until_disconnected(client, mqtt))
        send = asyncio.ensure_future(self._send(client))
        try:
            done, _ = await asyncio.wait({watch, send}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watch, send):
                task.cancel()
            for task in (watch, send):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if send in done:
            send.result()
            return
        watch.result()

    async def _publish(self, client: aiomqtt.Client, topic: str, payload: bytes, qos: int, retain: bool = False,
                       kind: str = "") -> None:  # fmt: skip
        await client.publish(topic, payload, qos=qos, retain=retain, timeout=self.cfg.timeout_s)
        self.published[kind] += 1

    async def _send(self, client: aiomqtt.Client) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            if self._status_dirty or now - self._status_at >= self.cfg.status_interval_s:
                self._status_dirty = False
                payload = self._status_payload()
                digest = status_digest(payload)
                if digest != self._status_digest or now - self._status_at >= self.cfg.status_interval_s:
                    await self._publish(client, self.topics.status, dumps(payload), self.cfg.qos, True, "status")
                    self._status_digest, self._status_at = digest, now
                continue
            if self._cache_message is not None:
                message, self._cache_message = self._cache_message, None
                await self._publish(client, self.topics.cache, message, 0, kind="cache")
                continue
            if len(self.outbox):
                await self._send_events(client)
                continue
            report = self.outbox.take_report()
            if report is not None:  # goes round through the bus: logged, on /events, and next in the outbox
                self.sup.events.emit("mqtt_dropped", drop_message(report), None, "warning", **report)
                continue
            if self._final:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self._status_at + self.cfg.status_interval_s - now)):
                    await self._wake.wait()

    async def _send_events(self, client: aiomqtt.Client) -> None:
        """One at a time, each acknowledged before the next: measured faster (~2000/s) than several in flight
        against a broker without TCP_NODELAY (mosquitto's default), whose PUBACKs then wait on delayed ACKs."""
        (event,) = self.outbox.send(1)
        try:
            await self._publish(client, self.topics.events, dumps(event_payload(event)), self.cfg.qos, kind="events")
        except BaseException:
            self.outbox.failed()
            raise
        self.outbox.acked()


def _code(exc: Exception) -> int | None:
    """The CONNACK reason of a refusal (aiomqtt gives an int or a paho ReasonCode), None for other errors."""
    rc = getattr(exc, "rc", None)
    value = getattr(rc, "value", rc)
    return value if isinstance(value, int) else None


async def _until_disconnected(client: aiomqtt.Client, mqtt: Any) -> None:
    """Returns never; raises MqttError when the connection drops (we subscribe to nothing, so no messages come)."""
    async for _ in client.messages:
        pass
    raise mqtt.MqttError("disconnected")


def _abandon(client: aiomqtt.Client) -> None:
    """Close a connection that will not finish (no CONNACK, no DISCONNECT ack) now instead of at keepalive.

    aiomqtt leaves the socket of a failed attempt open; after a broker resumes it could complete that stale
    CONNECT and take over our newer session. paho's disconnect() writes DISCONNECT and closes the socket.
    """
    paho = getattr(client, "_client", None)
    if paho is not None:
        with contextlib.suppress(Exception):
            paho.disconnect()

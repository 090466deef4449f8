"""A real mosquitto for the MQTT tests (Debian's /usr/sbin/mosquitto, own port, own config file), and a subscriber
that records every message it gets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from apihelpers import wait_until
from conftest import free_port

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Mosquitto:
    """One broker on a free loopback port. `users` turns on a password file (mosquitto_passwd), `tls` a TLS
    listener with the certificate files given; `persistence` keeps retained messages and persistent subscriber
    sessions across `stop()`/`start()`."""

    def __init__(self, home: Path, users: dict[str, str] | None = None, tls: dict[str, Path] | None = None,
                 persistence: bool = False) -> None:  # fmt: skip
        if not os.path.exists(MOSQUITTO):
            pytest.fail("mosquitto is not installed: scripts/test.sh installs it (apt-get install mosquitto)")
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        # As root mosquitto would drop to user `mosquitto`, who cannot read the test's 0700 folders.
        lines = [f"user {pwd.getpwuid(os.getuid()).pw_name}", f"listener {self.port} 127.0.0.1",
                 f"log_dest file {home / 'mosquitto.log'}", "log_type error", "log_type warning", "log_type notice",
                 "max_queued_messages 0"]  # fmt: skip
        if persistence:
            lines += ["persistence true", f"persistence_location {home}/", "autosave_interval 0"]
        if users:
            passwd = home / "passwd"
            passwd.write_text("")
            tool = shutil.which("mosquitto_passwd")
            if tool is None:
                pytest.fail("mosquitto_passwd missing: it comes with Debian's mosquitto package (scripts/test.sh)")
            for user, password in users.items():
                subprocess.run([tool, "-b", str(passwd), user, password], check=True, capture_output=True)
            lines += ["allow_anonymous false", f"password_file {passwd}"]
        else:
            lines.append("allow_anonymous true")
        if tls:
            lines += [f"cafile {tls['ca']}", f"certfile {tls['cert']}", f"keyfile {tls['key']}"]
        self.conf = home / "mosquitto.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> Mosquitto:
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 10
        while not _listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise AssertionError(f"mosquitto did not listen on {self.port}: {err}\n{self.log()}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen broker must be able to exit
            self.proc.terminate()
            self.proc.wait(10)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.home / "mosquitto.log").read_text(errors="replace")
        return ""


@dataclass
class Received:
    topic: str
    payload: Any
    retain: bool
    at: float


@dataclass
class Subscriber:
    """Subscribes to `topic` (QoS 1) and keeps every message. `client_id` + persistent: the broker keeps the
    session (and queues for it) while this subscriber or the broker is away."""

    port: int
    topic: str
    client_id: str | None = None
    persistent: bool = False
    messages: list[Received] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    subscribed: asyncio.Event = field(default_factory=asyncio.Event)
    errors: list[str] = field(default_factory=list)

    async def _run(self) -> None:
        while True:
            try:
                async with aiomqtt.Client("127.0.0.1", self.port, identifier=self.client_id,
                                          clean_session=not self.persistent, keepalive=30) as client:  # fmt: skip
                    await client.subscribe(self.topic, qos=1)
                    self.subscribed.set()
                    async for msg in client.messages:
                        raw = bytes(msg.payload) if isinstance(msg.payload, bytes | bytearray) else msg.payload
                        try:
                            payload = json.loads(raw)
                        except (TypeError, ValueError):
                            payload = raw
                        self.messages.append(Received(str(msg.topic), payload, bool(msg.retain), time.time()))
            except aiomqtt.MqttError as exc:
                self.errors.append(str(exc))
                self.subscribed.clear()
                await asyncio.sleep(0.05)

    async def start(self, timeout: float = 10.0) -> Subscriber:
        self.task = asyncio.create_task(self._run())
        await asyncio.wait_for(self.subscribed.wait(), timeout)
        return self

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    def on(self, suffix: str) -> list[Received]:
        return [m for m in self.messages if m.topic.endswith("/" + suffix)]

    def events(self) -> list[dict[str, Any]]:
        return [m.payload for m in self.on("events")]

    async def wait(self, what: str, check: Any, timeout: float = 20.0) -> Any:
        def detail() -> str:
            last = [(m.topic.rsplit("/", 1)[-1], m.payload) for m in self.messages[-5:]]
            return f"last messages: {last}; errors: {self.errors[-3:]}"

        return await wait_until(what, check, timeout, 0.02, detail)


def mqtt_config(port: int, **extra: Any) -> dict[str, Any]:
    """agent.mqtt for a test broker: short timeouts so outages are noticed quickly."""
    return {"url": f"mqtt://127.0.0.1:{port}", "topic_prefix": "t", "keepalive_s": 5, "timeout_s": 1.0,
            "reconnect_max_s": 1.0, **extra}  # fmt: skip


def first_occurrences(events: list[dict[str, Any]]) -> list[int]:
    """QoS 1 is at-least-once: a batch cut off by an outage is sent again. A subscriber keys on seq."""
    seen: set[int] = set()
    out = []
    for e in events:
        if e["seq"] not in seen:
            seen.add(e["seq"])
            out.append(e["seq"])
    return out


def same_components(payload: dict[str, Any], status: dict[str, Any]) -> bool:
    keys = ("state", "ready", "pid", "restarts", "desired", "up")
    return payload.get("components", {}).keys() == status["components"].keys() and all(
        payload["components"][n][k] == c[k] for n, c in status["components"].items() for k in keys)


def make_tls_files(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost, made with the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is not installed: scripts/test.sh installs it")
    folder.mkdir(parents=True, exist_ok=True)
    files = {name: folder / f"{name}.pem" for name in ("ca", "ca-key", "cert", "key")}
    ext = folder / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=dsv4 test CA",
        "-keyout", str(files["ca-key"]), "-out", str(files["ca"]))
    csr = folder / "server.csr"
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", str(files["key"]),
        "-out", str(csr))
    run("x509", "-req", "-in", str(csr), "-CA", str(files["ca"]), "-CAkey", str(files["ca-key"]),
        "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(files["cert"]))
    return files

"""systemd's watchdog ping requires every loop to tick (issue 29, item 1.2): the pure rule (`heartbeat`), a healthy
idle component loop ticking by itself, and the agent withholding WATCHDOG=1 while a loop is stale."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_component import rig, stop, until

from nodeagent.agent import Agent
from nodeagent.core.heartbeat import HEARTBEAT_MAX_AGE_S, Heartbeat, stale, watchdog_ok
from nodeagent.core.sdnotify import Notifier
from nodeagent.node import component


def test_every_loop_must_have_ticked_within_max_age() -> None:
    beats = {"main": Heartbeat(100.0), "component:a": Heartbeat(95.0)}
    assert watchdog_ok(beats, 100.0, max_age=10.0)
    assert watchdog_ok(beats, 105.0, max_age=10.0)
    assert not watchdog_ok(beats, 105.1, max_age=10.0)
    assert stale(beats, 105.1, max_age=10.0) == ["component:a"]
    assert stale(beats, 111.0, max_age=10.0) == ["main", "component:a"]
    assert watchdog_ok({}, 1e9, max_age=10.0)


def test_a_declared_long_operation_counts_as_alive_until_its_bound_only() -> None:
    beat = Heartbeat(0.0)
    beat.busy(100.0, 300.0, "stopping")  # a stop grace of 240 s and its margin
    assert watchdog_ok({"b": beat}, 399.0, max_age=10.0)
    assert watchdog_ok({"b": beat}, 400.0, max_age=10.0)
    assert stale({"b": beat}, 400.5, max_age=10.0) == ["b"], "a stop that never returns is a hang"
    beat.tick(400.5)
    assert beat.busy_until is None and watchdog_ok({"b": beat}, 410.0, max_age=10.0)


async def test_an_idle_component_loop_ticks_by_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A running component with nothing to do waits for its next signal: that wait is bounded, so it ticks."""
    monkeypatch.setattr(component, "TICK_S", 0.02)
    r = await rig(tmp_path)
    try:
        beats = {n: c.heartbeat.at for n, c in r.sup.components.items()}
        await asyncio.sleep(0.2)
        assert all(c.up.is_set() for c in r.sup.components.values())
        assert all(c.heartbeat.at > beats[n] for n, c in r.sup.components.items())
        assert set(r.sup.heartbeats()) == {"component:a", "component:b"}
    finally:
        await stop(r)


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    folder = tempfile.mkdtemp(prefix="wdg-")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.3)
    yield sock, path
    sock.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.rmdir(folder)


def received(sock: socket.socket) -> list[bytes]:
    out = []
    with contextlib.suppress(TimeoutError):
        while True:
            out.append(sock.recv(4096))
    return out


async def test_the_agent_withholds_the_ping_while_a_component_loop_is_stale(
        tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:  # fmt: skip
    sock, path = notify_socket
    r = await rig(tmp_path)
    agent = Agent(r.sup.config, tmp_path / "config.yaml")
    agent.supervisor = r.sup
    agent.notifier = Notifier(environ={"NOTIFY_SOCKET": path})
    try:
        assert agent.watchdog_tick(time.monotonic())
        assert received(sock) == [b"WATCHDOG=1\n"]
        b = r.sup.components["b"]
        b.heartbeat.at -= HEARTBEAT_MAX_AGE_S + 5  # its loop hangs (or died): it no longer ticks
        assert not agent.watchdog_tick(time.monotonic())
        assert received(sock) == [], "no WATCHDOG=1: systemd restarts the agent, the next one adopts"
        withheld = [e.message for e in r.sup.events.recent if e.event == "watchdog_withheld"]
        assert len(withheld) == 1 and "component:b" in withheld[0] and "component:a" not in withheld[0]
        assert not agent.watchdog_tick(time.monotonic())
        assert len([e for e in r.sup.events.recent if e.event == "watchdog_withheld"]) == 1, "said once"
        b.tick()
        assert agent.watchdog_tick(time.monotonic())
        assert received(sock) == [b"WATCHDOG=1\n"]
    finally:
        agent.notifier.close()
        await stop(r)


async def test_the_ping_loop_sends_while_every_loop_ticks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         notify_socket: tuple[socket.socket, str]) -> None:  # fmt: skip
    """The wiring end to end: `_heartbeat` (the task the agent runs) pings at WatchdogSec/3 and stops while stale."""
    sock, path = notify_socket
    monkeypatch.setattr(component, "TICK_S", 0.02)
    r = await rig(tmp_path)
    agent = Agent(r.sup.config, tmp_path / "config.yaml")
    agent.supervisor = r.sup
    agent.notifier = Notifier(environ={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "150000"})  # pings every 50 ms
    task = asyncio.create_task(agent._heartbeat())
    seen: list[bytes] = []

    def pump() -> list[bytes]:
        """Read what was sent, without blocking (a full socket buffer would block the agent's sendto)."""
        with contextlib.suppress(BlockingIOError, TimeoutError):
            while True:
                seen.append(sock.recv(4096, socket.MSG_DONTWAIT))
        return seen

    try:
        await until("pinged", lambda: b"WATCHDOG=1\n" in pump(), 2.0)
        r.sup.tasks["a"].cancel()  # stands for a loop that hangs: cancelled here, yet still one the node needs
        await asyncio.gather(r.sup.tasks["a"], return_exceptions=True)
        r.sup.components["a"].heartbeat.at -= HEARTBEAT_MAX_AGE_S + 1
        await until("withheld", lambda: pump() is not None and agent._wedged == ["component:a"], 2.0)
        seen.clear()
        for _ in range(6):
            await asyncio.sleep(0.05)
            pump()
        assert b"WATCHDOG=1\n" not in seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        agent.notifier.close()
        await stop(r)


async def test_while_a_redeploy_runs_its_own_heartbeat_stands_for_the_cancelled_loops(tmp_path: Path) -> None:
    """The redeploy cancels every component loop: the watchdog then requires the redeploy's beat, bounded by the
    cleanup it declared, and the components' again once their loops are back."""
    r = await rig(tmp_path)
    cleaning, go_on = asyncio.Event(), asyncio.Event()

    async def cleanup(comp: object, scope: str = "start", reason: str | None = None, wipe_etcd: bool = False) -> None:
        if scope == "redeploy":
            cleaning.set()
            await go_on.wait()

    r.sup.cleanup = cleanup  # type: ignore[method-assign]
    try:
        redeploy = r.sup.redeploying = asyncio.create_task(r.sup._redeploy("test"))
        await until("cleaning", cleaning.is_set)
        beats = r.sup.heartbeats()
        assert set(beats) == {"redeploy"}
        now = time.monotonic()
        assert beats["redeploy"].busy_until is not None and beats["redeploy"].busy_until > now + 180
        assert watchdog_ok(beats, now + 200, max_age=HEARTBEAT_MAX_AGE_S), "a long cleanup is not a hang"
        go_on.set()
        await redeploy
        assert set(r.sup.heartbeats()) == {"component:a", "component:b"}
    finally:
        go_on.set()
        await stop(r)

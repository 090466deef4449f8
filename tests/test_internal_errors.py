"""Supervision cannot be lost (issue 29, item 1): an exception inside a component's loop or its host, a raising
observer, an exception half-way through a node redeploy — each is logged and shown, and every component is still
supervised afterwards. The test_component rig: a real Supervisor, a fake launcher and a fake clock, no process."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import pytest
from test_component import FakeLayer, rig, stop, until

from nodeagent.core import logsink
from nodeagent.core.states import State
from nodeagent.seam.host import Process


class FullLogDir:
    """The component's log opener as a full `log_dir` makes it: ENOSPC until the disk has room again."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = True
        self.calls = 0
        real = logsink.open_output

        def open_output(component: str, log_dir: Path) -> tuple[int, str]:
            self.calls += 1
            if self.full and component == "b":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(log_dir / f"{component}.log"))
            return real(component, log_dir)

        monkeypatch.setattr(logsink, "open_output", open_output)


async def test_a_full_log_dir_shows_failed_internal_error_and_the_component_comes_back_by_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Once, the OSError of the log opener ended the component's task: `starting` forever, nothing logged."""
    r = await rig(tmp_path)
    disk = FullLogDir(monkeypatch)
    fake_launch = r.launch

    async def launch(comp: Any) -> Process:  # the launcher opens the output file before it spawns
        fd, _ = logsink.open_output(comp.name, r.sup.config.agent.log_dir)
        os.close(fd)
        return await fake_launch(comp)

    r.sup.launch = launch  # type: ignore[method-assign]
    try:
        b = r.sup.components["b"]
        r.clock.hold_at = 1.0  # the first backoff waits until the test lets it go on
        r.crash("b")
        await until("failed: internal error", lambda: b.state == State.FAILED)
        assert r.count("b") == 1
        shown = [e.message for e in r.sup.events.recent if e.event == "state" and e.component == "b"][-1]
        assert shown.startswith("failed: internal error: OSError: [Errno 28] No space left on device"), shown
        assert "retrying in" in shown
        assert b.status()["failure"]["detail"].startswith("failed: internal error: OSError")
        assert any("OSError" in m for m in r.events("internal_error"))
        assert r.sup.tasks["b"].done() is False, "the loop survives"
        disk.full = False
        r.clock.released.set()
        await until("back by itself", lambda: r.count("b") == 2 and b.up.is_set())
        assert b.internal_errors == 0, "up again: the next internal error backs off from the start"
    finally:
        await stop(r)


async def test_internal_errors_back_off_with_the_restart_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:  # fmt: skip
    """Never a tight loop: each attempt while the disk stays full waits longer (backoff_initial_s 10, doubling)."""
    r = await rig(tmp_path)
    FullLogDir(monkeypatch)
    fake_launch = r.launch

    async def launch(comp: Any) -> Process:
        fd, _ = logsink.open_output(comp.name, r.sup.config.agent.log_dir)
        os.close(fd)
        return await fake_launch(comp)

    r.sup.launch = launch  # type: ignore[method-assign]
    try:
        b = r.sup.components["b"]
        r.clock.hold_at = 40.0
        r.crash("b")
        await until("the fourth attempt waits", lambda: b.internal_errors >= 4 and b.state == State.FAILED)
        assert [s for s in r.clock.slept if s >= 1.0][:4] == [1.0, 10.0, 20.0, 40.0]
    finally:
        r.clock.released.set()
        await stop(r)


async def test_a_raising_observer_neither_stops_the_component_nor_the_other_observers(tmp_path: Path) -> None:
    """A state observer (sd_notify, MQTT, the member record) or a layer that raises is logged and skipped."""
    r = await rig(tmp_path)
    seen: list[str] = []
    b = r.sup.components["b"]

    def raising() -> None:
        raise RuntimeError("observer bug")

    class RaisingLayer(FakeLayer):
        def on_node_change(self) -> None:
            raise RuntimeError("layer bug")

    from nodeagent.seam.stackport import ChangeObserver

    r.sup.attach(ChangeObserver(raising))  # the one change channel: observers are layers that only listen
    r.sup.attach(ChangeObserver(lambda: seen.append(str(b.state))))
    counting = FakeLayer()
    r.sup.attach(RaisingLayer())
    r.sup.attach(counting)
    try:
        r.crash("b")
        await until("running again", lambda: r.count("b") == 2 and b.up.is_set())
        assert "starting" in seen and ("running" in seen or "ready" in seen)
        assert counting.changes > 0, "the layer after the raising one is still told"
        assert not r.events("internal_error"), "an observer's bug is not the component's"
    finally:
        await stop(r)


async def test_an_exception_mid_redeploy_leaves_every_component_supervised(tmp_path: Path) -> None:
    """The redeploy cancels every loop first: an exception before it made them again left nothing supervised."""
    r = await rig(tmp_path)

    async def cleanup(comp: Any, scope: str = "start", reason: str | None = None, wipe_etcd: bool = False) -> None:
        if scope == "redeploy":
            raise RuntimeError("cleanup bug")

    r.sup.cleanup = cleanup  # type: ignore[method-assign]
    try:
        before = dict(r.sup.tasks)
        task = asyncio.create_task(r.sup._redeploy("test"))
        await task  # it does not raise: logged and shown
        assert any("cleanup bug" in e.message for e in r.sup.events.recent if e.event == "redeploy_failed")
        assert set(r.sup.tasks) == set(r.sup.components)
        assert all(not t.done() and t is not before[n] for n, t in r.sup.tasks.items())
        await until("both up again", lambda: r.count("a") == 2 and r.count("b") == 2
                    and all(c.up.is_set() for c in r.sup.components.values()))  # fmt: skip
        r.crash("b")
        await until("a kill is noticed: relaunched", lambda: r.count("b") == 3)
        r.crash("a")
        await until("a too", lambda: r.count("a") == 3)
    finally:
        await stop(r)


async def test_the_end_of_a_component_loop_is_logged_and_shown(tmp_path: Path) -> None:
    """Only a cancel or a BaseException ends a loop now; whatever ends it is not silent."""
    r = await rig(tmp_path)
    try:
        b = r.sup.components["b"]

        async def broken(adopt: Any) -> None:
            raise SystemError("loop bug")

        b.run = broken  # type: ignore[method-assign]
        r.sup.tasks["b"].cancel()
        await asyncio.gather(r.sup.tasks["b"], return_exceptions=True)
        r.sup._start_loop("b", None)
        await until("shown", lambda: r.events("supervision_lost"))
        assert "SystemError: loop bug" in r.events("supervision_lost")[0]
    finally:
        await stop(r)

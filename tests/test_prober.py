"""Kubernetes probe semantics: the pure tracker, then ComponentProber running real probes at short periods."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from nodeagent.config.model import ExecProbe, LivenessFileProbe, ProbeBase
from nodeagent.probes.kinds import LIVENESS_OK, ProbeContext, ProbeResult, ResolvedProbe
from nodeagent.probes.prober import ComponentProber, ProbeTracker, aggregate


def result(ok: bool) -> ProbeResult:
    return ProbeResult(ok=ok, detail="x", latency_s=0.001, kind="tcp", at=time.time())


# ---------------------------------------------------------------------------------------------- pure part


def test_tracker_thresholds_and_hysteresis() -> None:
    t = ProbeTracker(ProbeBase(failure_threshold=3, success_threshold=2))
    assert t.status == "unknown"
    assert t.observe(result(True)) == "unknown"  # 1 of 2 successes
    assert t.observe(result(True)) == "success"
    assert t.observe(result(False)) == "success"  # 1 of 3 failures: still success
    assert t.observe(result(False)) == "success"
    assert t.observe(result(True)) == "success"  # a success breaks the failure run
    assert (t.consecutive_successes, t.consecutive_failures) == (1, 0)
    for _ in range(2):
        assert t.observe(result(False)) == "success"
    assert t.observe(result(False)) == "failure"
    assert t.observe(result(True)) == "failure"  # 1 of 2 successes: still failure
    assert t.observe(result(True)) == "success"
    assert (t.runs, t.failures_total) == (10, 5)
    snap = t.snapshot()
    assert snap["status"] == "success" and snap["consecutive_successes"] == 2 and snap["last"]["ok"] is True


def test_tracker_fails_before_first_success() -> None:
    t = ProbeTracker(ProbeBase(failure_threshold=2))
    assert t.observe(result(False)) == "unknown"
    assert t.observe(result(False)) == "failure"


def test_budget_and_aggregate() -> None:
    assert ProbeTracker(ProbeBase(period_s=5, failure_threshold=720)).budget_s == 3600
    assert ProbeTracker(ProbeBase(period_s=1, failure_threshold=3, initial_delay_s=2)).budget_s == 5
    assert aggregate([]) == "success"
    assert aggregate(["success", "unknown"]) == "unknown"
    assert aggregate(["success", "failure"]) == "failure"
    assert aggregate(["success", "success"]) == "success"


# ---------------------------------------------------------------------------------------------- worker loops


def file_probe(path: Path, period: float = 0.05, **kw: Any) -> ResolvedProbe:
    spec = LivenessFileProbe(path=path, period_s=period, timeout_s=kw.pop("timeout_s", 1.0), **kw)
    return ResolvedProbe(spec, "liveness_file", str(path), path=path, max_age_s=spec.max_age_s)


def alive(path: Path) -> None:
    path.write_text(LIVENESS_OK)


class Events:
    """Collects on_change calls; the test asserts on the order and content."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, ProbeResult | None]] = []

    def __call__(self, role: str, status: str, res: ProbeResult | None) -> None:
        self.calls.append((role, status, res))

    def seen(self) -> list[tuple[str, str]]:
        return [(role, status) for role, status, _ in self.calls]


async def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def ctx() -> AsyncIterator[ProbeContext]:
    context = ProbeContext()
    yield context
    await context.close()


async def test_startup_gates_liveness_and_readiness(ctx: ProbeContext, tmp_path: Path) -> None:
    s, live, ready = tmp_path / "s", tmp_path / "l", tmp_path / "r"
    alive(live)
    alive(ready)
    ev = Events()
    prober = ComponentProber(
        "ds",
        {"startup": [file_probe(s, failure_threshold=100)], "liveness": [file_probe(live)],
         "readiness": [file_probe(ready)]},
        ctx, ev,
    )  # fmt: skip
    prober.start()
    assert ev.calls == []  # never from inside start()
    await asyncio.sleep(0.3)
    assert prober.phase == "startup" and prober.status("startup") == "unknown"
    assert prober.trackers["startup"][0].consecutive_failures >= 3
    assert prober.trackers["liveness"][0].runs == 0 and prober.trackers["readiness"][0].runs == 0
    assert not prober.ready and not prober.live
    alive(s)
    await until(lambda: prober.ready)
    assert ev.seen()[0] == ("startup", "success")
    assert set(ev.seen()[1:]) == {("liveness", "success"), ("readiness", "success")}
    assert prober.phase == "running" and prober.live and prober.startup_succeeded_at is not None
    runs = prober.trackers["startup"][0].runs
    await asyncio.sleep(0.2)
    assert prober.trackers["startup"][0].runs == runs  # a startup probe stops once it succeeded
    assert prober.trackers["liveness"][0].runs >= 3
    await prober.stop()
    assert prober.phase == "stopped" and not prober._tasks


async def test_startup_exhausts_its_budget(ctx: ProbeContext, tmp_path: Path) -> None:
    ev = Events()
    prober = ComponentProber("v", {"startup": [file_probe(tmp_path / "never", failure_threshold=3)]}, ctx, ev)
    assert prober.startup_budget_s == pytest.approx(0.15)
    started = time.time()
    prober.start(started)
    assert prober.startup_deadline == pytest.approx(started + 0.15)
    await until(lambda: prober.startup_exhausted)
    assert time.time() - started < 1.0
    assert ev.seen() == [("startup", "failure")]
    res = ev.calls[0][2]
    assert res is not None and not res.ok and "missing" in res.detail
    assert prober.phase == "startup" and prober.snapshot()["startup_exhausted"] is True
    await prober.stop()


async def test_liveness_threshold_readiness_independent(ctx: ProbeContext, tmp_path: Path) -> None:
    live, ready = tmp_path / "l", tmp_path / "r"
    alive(live)
    alive(ready)
    ev = Events()
    prober = ComponentProber(
        "ds", {"liveness": [file_probe(live, failure_threshold=3)], "readiness": [file_probe(ready)]}, ctx, ev
    )
    prober.start()
    await until(lambda: prober.ready)
    assert ev.seen()[0] == ("startup", "success") and ev.calls[0][2] is None  # no startup probes
    live.unlink()
    await until(lambda: prober.status("liveness") == "failure")
    tracker = prober.trackers["liveness"][0]
    assert tracker.consecutive_failures == 3  # exactly at the threshold, not before
    assert prober.status("readiness") == "success" and prober.ready and not prober.live
    fail = [c for c in ev.calls if c[:2] == ("liveness", "failure")]
    assert len(fail) == 1 and fail[0][2] is not None and "missing" in fail[0][2].detail
    alive(live)
    await until(lambda: prober.status("liveness") == "success")
    ready.write_text("liveness check failed")
    await until(lambda: not prober.ready)
    assert prober.live and prober.status("readiness") == "failure"
    await prober.stop()


async def test_reset_gives_fresh_trackers(ctx: ProbeContext, tmp_path: Path) -> None:
    s = tmp_path / "s"
    ev = Events()
    prober = ComponentProber("ds", {"startup": [file_probe(s, failure_threshold=2)]}, ctx, ev)
    prober.start()
    await until(lambda: prober.startup_exhausted)
    prober.reset()  # the supervisor restarted the process
    assert prober.status("startup") == "unknown" and not prober.startup_exhausted
    assert prober.trackers["startup"][0].runs == 0 and prober.phase == "startup"
    alive(s)
    await until(lambda: prober.phase == "running")
    assert ev.seen() == [("startup", "failure"), ("startup", "success"), ("liveness", "success"),
                         ("readiness", "success")]  # fmt: skip
    await prober.stop()
    prober.reset()
    assert prober.phase == "stopped" and prober.status("startup") == "unknown"
    assert prober.snapshot()["roles"]["startup"]["probes"][0]["runs"] == 0


async def test_initial_delay(ctx: ProbeContext, tmp_path: Path) -> None:
    s = tmp_path / "s"
    alive(s)
    prober = ComponentProber("v", {"startup": [file_probe(s, initial_delay_s=0.4)]}, ctx, Events())
    prober.start()
    await asyncio.sleep(0.25)
    assert prober.trackers["startup"][0].runs == 0
    await until(lambda: prober.phase == "running")
    await prober.stop()
    # An adopted process that started long ago: the delay has already passed.
    prober.start(time.time() - 10)
    await until(lambda: prober.phase == "running", timeout=0.2)
    await prober.stop()


async def test_a_wall_clock_step_does_not_stretch_the_initial_delay(ctx: ProbeContext,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    spec = ExecProbe(command=["true"], period_s=0.05, timeout_s=1.0, initial_delay_s=0.3)
    prober = ComponentProber("v", {"startup": [ResolvedProbe(spec, "exec", "true", command=("true",))]}, ctx,
                             Events())  # fmt: skip
    real = time.time
    prober.start()
    monkeypatch.setattr(time, "time", lambda: real() - 3600)  # NTP steps the wall clock back an hour
    await until(lambda: prober.phase == "running", timeout=3.0)
    await prober.stop()


def hang_probe(pidfile: Path, timeout_s: float, period: float = 0.05) -> ResolvedProbe:
    argv = ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"]
    spec = ExecProbe(command=argv, period_s=period, timeout_s=timeout_s, failure_threshold=1)
    return ResolvedProbe(spec, "exec", "hang", command=tuple(argv))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_timeout_is_a_failure_and_never_blocks_others(ctx: ProbeContext, tmp_path: Path) -> None:
    live = tmp_path / "l"
    alive(live)
    ev = Events()
    prober = ComponentProber(
        "v", {"liveness": [hang_probe(tmp_path / "pid", timeout_s=0.5), file_probe(live)]}, ctx, ev
    )
    prober.start()
    await until(lambda: prober.trackers["liveness"][1].runs >= 1)
    runs = prober.trackers["liveness"][1].runs
    await asyncio.sleep(0.3)  # the exec probe is still in flight
    assert prober.trackers["liveness"][0].runs == 0
    assert prober.trackers["liveness"][1].runs >= runs + 3
    await until(lambda: prober.status("liveness") == "failure")
    last = prober.trackers["liveness"][0].last
    assert last is not None and last.detail == "timed out after 0.5s"
    assert ("liveness", "failure") in ev.seen()
    await prober.stop()


async def test_stop_kills_an_in_flight_probe(ctx: ProbeContext, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    prober = ComponentProber("v", {"startup": [hang_probe(pidfile, timeout_s=20)]}, ctx, Events())
    prober.start()
    await until(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
    pid = int(pidfile.read_text())
    await prober.stop()
    await until(lambda: gone(pid), timeout=2)
    assert prober.trackers["startup"][0].runs == 0  # the cancelled run was not counted


async def test_callback_errors_do_not_kill_the_worker(ctx: ProbeContext, tmp_path: Path) -> None:
    live = tmp_path / "l"
    calls: list[str] = []

    def explode(role: str, status: str, res: ProbeResult | None) -> None:
        calls.append(f"{role}:{status}")
        raise RuntimeError("supervisor bug")

    seen: list[ProbeResult] = []
    prober = ComponentProber(
        "v", {"liveness": [file_probe(live, failure_threshold=1)]}, ctx, explode,
        on_result=lambda role, p, res: seen.append(res),
    )  # fmt: skip
    prober.start()
    await until(lambda: prober.status("liveness") == "failure")
    alive(live)
    await until(lambda: prober.status("liveness") == "success")
    assert calls[-2:] == ["liveness:failure", "liveness:success"]
    assert len(seen) == prober.trackers["liveness"][0].runs >= 2
    await prober.stop()


async def test_callback_may_reset(ctx: ProbeContext, tmp_path: Path) -> None:
    """A supervisor reacting synchronously: restart on startup failure, as it would for a new process."""
    s = tmp_path / "s"
    prober: ComponentProber
    restarts: list[float] = []

    def on_change(role: str, status: str, res: ProbeResult | None) -> None:
        if role == "startup" and status == "failure" and not restarts:
            restarts.append(time.time())
            alive(s)  # "the new process" comes up fine
            prober.reset()

    prober = ComponentProber("ds", {"startup": [file_probe(s, failure_threshold=2)]}, ctx, on_change)
    prober.start()
    await until(lambda: prober.phase == "running")
    assert len(restarts) == 1 and prober.trackers["startup"][0].failures_total == 0
    await prober.stop()


async def test_run_once_and_snapshot(ctx: ProbeContext, tmp_path: Path) -> None:
    live = tmp_path / "l"
    alive(live)
    prober = ComponentProber("ds", {"liveness": [file_probe(live), file_probe(tmp_path / "no")]}, ctx, Events())
    results = await prober.run_once("liveness")
    assert [r.ok for r in results] == [True, False]
    assert prober.trackers["liveness"][0].runs == 0  # run_once leaves the trackers alone
    with pytest.raises(ValueError):
        await prober.run_once("bogus")
    prober.start()
    await until(lambda: prober.status("liveness") == "failure")
    snap = prober.snapshot()
    assert snap["component"] == "ds" and snap["phase"] == "running" and snap["startup_budget_s"] == 0
    role = snap["roles"]["liveness"]
    assert role["status"] == "failure"
    ok, bad = role["probes"]
    assert ok["status"] == "success" and ok["last"]["ok"] is True and ok["target"] == str(live)
    assert bad["consecutive_failures"] >= 3 and "missing" in bad["last"]["detail"]
    assert snap["roles"]["readiness"] == {"status": "success", "probes": []}
    await prober.stop()

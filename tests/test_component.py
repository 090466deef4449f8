"""The component state machine wired to the real Supervisor, with a fake launcher, fake probes and a fake clock:
no subprocess, no sleeps. Covers the wiring the pure policy tests cannot see — pause gating every start, a
stable run being noticed, events telling the truth about what happens next, permanent failures never
escalating, history surviving adoption."""

from __future__ import annotations

import asyncio
import functools
import itertools
import re
import time
import typing
from pathlib import Path
from typing import Any

import pytest
from apihelpers import wait_until

from nodeagent.config.load import parse_config
from nodeagent.core.errors import AdoptError, MissingPrerequisite
from nodeagent.core.events import EventBus
from nodeagent.core.process import ProcessRecord
from nodeagent.core.states import COMMANDS, Desired, SignalKind, SignalName
from nodeagent.node.blast_radius import Blast
from nodeagent.node.supervisor import Supervisor
from nodeagent.probes.kinds import ProbeResult
from nodeagent.seam.host import Clock, Process
from nodeagent.seam.stackport import ComponentView, Delegated, Hold, HoldKind, ReportLayer

_PIDS = itertools.count(4_000_000)


class FakeClock(Clock):
    """Wall time that jumps: a backoff of 300 s passes at once, and the test can see how much time passed."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0
        self.slept: list[float] = []
        self.hold_at: float | None = None
        """Sleeps this long or longer wait for `released` (a test looks at the state meanwhile)."""
        self.released = asyncio.Event()

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        if self.hold_at is not None and seconds >= self.hold_at:
            await self.released.wait()
        self.now += max(0.0, seconds)
        await asyncio.sleep(0)

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeProbes:
    """Stands in for ProbeContext: every probe answers `self.ok`, counted."""

    def __init__(self) -> None:
        self.ok = True
        self.runs = 0

    async def run(self, probe: Any, state: Any = None) -> ProbeResult:
        self.runs += 1
        await asyncio.sleep(0.001)
        return ProbeResult(self.ok, "fake ok" if self.ok else "fake failure", 0.0, probe.kind, time.time())

    async def close(self) -> None:
        pass


class Rig:
    """A real Supervisor whose OS work is replaced: launches are recorded, exits are ours to trigger."""

    def __init__(self, sup: Supervisor, clock: FakeClock) -> None:
        self.sup = sup
        self.clock = clock
        self.launches: list[tuple[str, float]] = []
        self.live: dict[str, Process] = {}
        self.missing: str | None = None
        self.redeploys: list[tuple[str, float]] = []
        self.evidence: list[tuple[str, Any, Any]] = []
        sup.prepare = self.prepare  # type: ignore[method-assign]
        sup.launch = self.launch  # type: ignore[method-assign]
        sup.terminate = self.terminate  # type: ignore[method-assign]
        sup.archive = self.archive  # type: ignore[method-assign]
        sup.output_tail = lambda comp, proc: ("Traceback", "ValueError: boom")  # type: ignore[method-assign]
        sup.request_redeploy = self.request_redeploy  # type: ignore[method-assign]
        self.probes = FakeProbes()
        sup.probe_ctx = self.probes  # type: ignore[assignment]

    async def prepare(self, comp: Any) -> None:
        if self.missing and comp.name == "b":
            raise MissingPrerequisite(self.missing)

    def slow_cleanup(self) -> tuple[asyncio.Event, asyncio.Event]:
        """b's start cleanup, from now on, sets the first event and waits for the second (a minute's cleanup)."""
        cleaning, go_on = asyncio.Event(), asyncio.Event()
        plain = self.prepare

        async def slow_prepare(comp: Any) -> None:
            if comp.name == "b":
                cleaning.set()
                await go_on.wait()
            await plain(comp)

        self.sup.prepare = slow_prepare  # type: ignore[method-assign]
        return cleaning, go_on

    async def launch(self, comp: Any) -> Process:
        self.launches.append((comp.name, self.clock.now))
        record = ProcessRecord(next(_PIDS), self.clock.now, ("fake", comp.name), 1)
        proc = Process(record, asyncio.get_running_loop().create_future(), output="fake")
        self.live[comp.name] = proc
        return proc

    async def terminate(self, comp: Any, proc: Process, why: str) -> dict[str, Any]:
        if not proc.exited.done():
            proc.exited.set_result(-15)
        return {"signalled": 1, "killed": 0, "elapsed_s": 0.0}

    def archive(self, comp: Any, failure: Any, evidence: Any, tree: Any, decision: Any) -> None:
        self.evidence.append((comp.name, evidence, decision))

    def request_redeploy(self, reason: str, components: Any = None) -> bool:
        self.redeploys.append((reason, self.clock.now, components))
        return True

    def crash(self, name: str, code: int = 1) -> None:
        self.live[name].exited.set_result(code)

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.launches if n == name)

    def events(self, kind: str, component: str = "b") -> list[str]:
        return [e.message for e in self.sup.events.recent if e.event == kind and e.component == component]


async def until(what: str, check: Any, timeout: float = 5.0) -> Any:
    return await wait_until(what, check, timeout, 0.005)


def config_text(state: Path, restart: str = "") -> str:
    cmd = '["python3", "-c", "pass"]'
    return f"""
cluster: {{name: fake}}
node: {{name: n0, ip: 127.0.0.1, role: master}}
agent: {{state_dir: {state}, log_dir: {state}/logs, systemd_scopes: never}}
components:
  a: {{kind: process, command: {cmd}}}
  b:
    kind: process
    command: {cmd}
    depends_on: [a]
    probes: {{liveness: {{kind: exec, command: ["true"], period_s: 0.01, failure_threshold: 1}}}}
    restart: {{stable_after_s: 600, backoff_initial_s: 10, backoff_max_s: 300, {restart}}}
"""


async def rig(tmp_path: Path, restart: str = "") -> Rig:
    clock = FakeClock()
    config = parse_config(config_text(tmp_path / "state", restart))
    sup = Supervisor(config, EventBus(), clock)
    r = Rig(sup, clock)
    await sup.start()
    await until("both up", lambda: all(c.up.is_set() for c in sup.components.values()))
    return r


async def stop(r: Rig) -> None:
    await r.sup.shutdown()


async def test_a_held_start_waits_without_spinning_while_its_dependency_is_up(tmp_path: Path) -> None:
    """Found by the simulation over the real node (its event loop never settled): the gate's waiters included
    `up.wait()` of a dependency that was up — done at once — so a paused `b` (its `a` up) re-checked its gate in
    a tight loop, the agent's CPU at 100% for as long as the pause (or any other hold) lasted."""
    r = await rig(tmp_path)
    try:
        r.sup.set_paused(True, "test")
        r.crash("b")
        b = r.sup.components["b"]
        await until("held by the pause", lambda: b.held and "paused" in b.held)
        asked = 0
        gate = r.sup.start_gate

        def counted(comp: Any, operator: bool = False) -> Hold | None:
            nonlocal asked
            asked += 1
            return gate(comp, operator)

        r.sup.start_gate = counted  # type: ignore[method-assign]
        await asyncio.sleep(0.3)
        assert asked <= 1, f"the held start re-checked its gate {asked} times in 0.3 s"
    finally:
        await stop(r)


async def test_pause_holds_automatic_restarts_and_an_operator_restart_still_works(tmp_path: Path) -> None:
    r = await rig(tmp_path)
    try:
        r.sup.set_paused(True, "test")
        r.crash("b")
        b = r.sup.components["b"]
        await until("held by the pause", lambda: b.held and "paused by test" in b.held)
        r.clock.advance(3600)
        await asyncio.sleep(0.1)
        assert r.count("b") == 1, "no automatic relaunch while paused (once was a tight loop)"
        assert any("not restarting: paused" in m for m in r.events("no_action"))
        r.sup.command("b", "restart")  # operator commands work while paused
        await until("operator restart", lambda: r.count("b") == 2)
        await until("up again", lambda: b.up.is_set())
        r.crash("b")
        await until("held again", lambda: b.proc is None and b.held and "paused" in b.held)
        await asyncio.sleep(0.05)
        assert r.count("b") == 2
        r.sup.set_paused(False)
        await until("resumed: relaunched once", lambda: r.count("b") == 3)
        await asyncio.sleep(0.05)
        assert r.count("b") == 3
    finally:
        await stop(r)


async def test_a_stable_run_is_noticed_and_the_next_crash_restarts_at_once(tmp_path: Path) -> None:
    r = await rig(tmp_path, "quick_exit_s: 0")  # these crashes are transient, not a broken start
    try:
        b = r.sup.components["b"]
        for n in (2, 3):  # two crashes in a row: the second backs off 10 s (a crash loop)
            r.crash("b")
            await until(f"launch {n}", lambda n=n: r.count("b") == n and b.up.is_set())
        tracker = r.sup.trackers["b"]
        assert tracker.crash_loop and r.clock.slept[-1] == 10
        await until("a first passing liveness check", lambda: tracker.healthy_since is not None)
        runs = r.probes.runs
        r.clock.advance(700)  # healthy for longer than stable_after_s, seen by liveness checks
        await until("liveness checks after the jump", lambda: r.probes.runs > runs + 3)
        assert not tracker.crash_loop, "every passing liveness check tells the policy (not only a change)"
        assert r.sup.policy_view(b)["stable"]
        slept = len(r.clock.slept)
        before = r.clock.now
        r.crash("b")
        await until("relaunched", lambda: r.count("b") == 4)
        assert r.launches[-1][1] == before, "the first crash after a stable run restarts at once"
        assert len(r.clock.slept) == slept
        assert "next: restart now" in r.events("failure")[-1]
    finally:
        await stop(r)


async def test_the_event_says_when_the_redeploy_happens_and_it_happens_then(tmp_path: Path) -> None:
    r = await rig(tmp_path, "redeploy_after_failures: 3, quick_exit_s: 0")
    try:
        b = r.sup.components["b"]
        for n in (2, 3):
            r.crash("b")
            await until(f"launch {n}", lambda n=n: r.count("b") == n and b.up.is_set())
        crashed_at = r.clock.now
        r.crash("b")
        await until("the redeploy request", lambda: r.redeploys)
        message = r.events("failure")[-1]
        assert "next: node redeploy in 20s" in message, message
        assert r.redeploys[0][1] - crashed_at == 20, "'in 20 s' means 20 s"
    finally:
        await stop(r)


async def test_a_missing_prerequisite_fails_permanently_without_redeploy(tmp_path: Path) -> None:
    r = await rig(tmp_path, "redeploy_after_failures: 2")
    try:
        b = r.sup.components["b"]
        r.missing = "model path /nowhere does not exist"
        r.crash("b")
        await until("failed", lambda: str(b.state) == "failed" and len(r.clock.slept) >= 3)
        assert r.redeploys == [], "a redeploy cannot fix it and would take `a` down"
        assert r.count("a") == 1 and r.sup.components["a"].up.is_set()
        assert set(r.clock.slept[-2:]) == {300}, "retried at the cap only"
        status = r.sup.status()["components"]["b"]
        assert status["state"] == "failed"
        assert status["failure"]["permanent"] == "model path /nowhere does not exist"
        assert any("failed: model path /nowhere does not exist; next: retry in 300s" in m for m in r.events("failure"))
        r.missing = None
        r.sup.command("b", "restart")
        await until("fixed and restarted", lambda: b.up.is_set() and r.count("b") >= 2)
        await asyncio.sleep(0.05)
        assert r.count("b") == 2, "one launch for one restart (the retry's timer ran out as the command came: CI)"
    finally:
        await stop(r)


async def test_the_same_quick_error_twice_is_permanent_with_its_output(tmp_path: Path) -> None:
    r = await rig(tmp_path, "redeploy_after_failures: 2")
    r.clock.hold_at = 300
    try:
        b = r.sup.components["b"]
        r.crash("b")  # exit 1 within seconds, first time: transient, restarted at once
        await until("restarted", lambda: r.count("b") == 2 and b.up.is_set())
        r.crash("b")  # the same error again within seconds: no restart can help
        await until("failed", lambda: str(b.state) == "failed")
        assert r.redeploys == []
        status = r.sup.status()["components"]["b"]
        assert status["failure"]["permanent"].startswith("exits within 30s with the same error each time")
        assert status["failure"]["output_tail"] == ["Traceback", "ValueError: boom"]
        assert status["last_exit"]["reason"] == "exited with code 1"
        r.clock.released.set()
    finally:
        await stop(r)


async def test_history_survives_a_new_supervisor(tmp_path: Path) -> None:
    r = await rig(tmp_path)
    try:
        r.crash("b", -9)
        await until("restarted", lambda: r.count("b") == 2 and r.sup.components["b"].up.is_set())
    finally:
        await stop(r)
    again = Supervisor(parse_config(config_text(tmp_path / "state")), EventBus(), FakeClock())
    b = again.components["b"]
    assert b.restarts == 1
    assert b.last_exit is not None and b.last_exit["reason"] == "killed by SIGKILL"


@pytest.mark.parametrize(("code", "text"), [(-9, "killed by SIGKILL"), (1, "exited with code 1"),
                                             (137, "exited with code 137 (killed by SIGKILL)"),
                                             (None, "exited (status unknown: not our child)")])  # fmt: skip
def test_exit_text(code: int | None, text: str) -> None:
    from nodeagent.core.failure import exit_text

    assert exit_text(code) == text


@pytest.mark.parametrize("scope", ["node", "cluster"])
async def test_a_failed_component_stays_failed_under_either_pause(tmp_path: Path, scope: str) -> None:
    """A pause is a pause whoever set it: a FAILED component stays visible as failed under a cluster pause as
    under a node pause (the gate once compared reason strings, and "cluster paused by …" turned it STOPPED)."""
    r = await rig(tmp_path)
    try:
        b = r.sup.components["b"]
        r.missing = "model path /nowhere does not exist"
        r.crash("b")
        await until("failed", lambda: str(b.state) == "failed")
        if scope == "node":
            r.sup.set_paused(True, "test")
        else:
            r.sup.set_cluster_pause({"by": "n1: test", "at": 0.0, "reason": "maintenance"})
        await until("held by the pause", lambda: b.hold is not None and b.hold.is_pause)
        await asyncio.sleep(0.05)
        assert str(b.state) == "failed", f"under a {scope} pause the failure stays visible"
        assert r.sup.status()["components"]["b"]["hold"]["kind"] == f"{scope}_pause"
    finally:
        await stop(r)


async def test_running_stays_true_until_the_whole_tree_is_gone(tmp_path: Path) -> None:
    """issue 16 item 0: a DP group's next generation waits for old ranks to be *stopped*, not only signalled —
    `running` (what the cluster layer's barrier reads) is True while the old tree is still being killed."""
    r = await rig(tmp_path)
    release = asyncio.Event()
    real = r.terminate

    async def slow_terminate(comp: Any, proc: Process, why: str) -> dict[str, Any]:
        await release.wait()  # an old head slow to exit (an A2 engine can take ~50 s)
        return await real(comp, proc, why)

    r.sup.terminate = slow_terminate  # type: ignore[method-assign]
    try:
        b = r.sup.components["b"]
        r.sup.command("b", "restart", drain=False)
        await until("stopping", lambda: str(b.state) == "stopping")
        assert b.running, "the component still counts as running while its tree is being stopped"
        await asyncio.sleep(0.05)
        assert b.running and r.count("b") == 1, "no new start next to the dying tree"
        release.set()
        await until("restarted", lambda: r.count("b") == 2 and b.up.is_set())
        assert b.running
    finally:
        release.set()
        await stop(r)


async def test_restarts_are_counted_by_cause(tmp_path: Path) -> None:
    """issue 17: one counter that means one thing — by cause, adding up to the total, kept in the history."""
    r = await rig(tmp_path, "quick_exit_s: 0")
    try:
        b = r.sup.components["b"]
        with pytest.raises(ValueError, match="liveness_fail"):
            b.signal("liveness_fail", b.gen, "a misspelt kind is refused, not queued and ignored")  # type: ignore[arg-type]
        r.crash("b")
        await until("relaunched after the crash", lambda: r.count("b") == 2 and b.up.is_set())
        r.sup.command("b", "restart", drain=False)
        await until("operator restart", lambda: r.count("b") == 3 and b.up.is_set())
        r.sup.command("a", "restart", drain=False)  # b restarts with its dependency
        await until("b follows a", lambda: r.count("b") == 4 and b.up.is_set())
        status = r.sup.status()["components"]["b"]
        assert status["restarts_by_cause"] == {"crash": 1, "operator": 1, "dependency": 1}
        assert status["restarts"] == 3
        assert r.sup.status()["components"]["a"]["restarts_by_cause"] == {"operator": 1}
        r.sup.flush_state()
        again = Supervisor(r.sup.config, EventBus(), r.clock)
        assert again.components["b"].restarts_by_cause == {"crash": 1, "operator": 1, "dependency": 1}
    finally:
        await stop(r)


def test_the_desired_state_is_read_as_a_desired(tmp_path: Path) -> None:
    """`ComponentView.desired` is a `Desired`, made from intent.json: a value the file should not hold reads as
    running (as the checks that compared with "stopped" read it) instead of breaking every layer's view."""
    from nodeagent.core.statefile import StateStore
    from nodeagent.node.intent import NodeIntent

    (tmp_path / "intent.json").write_text('{"desired": {"a": "stopped", "b": "sideways"}}')
    intent = NodeIntent(StateStore(tmp_path), {})
    assert intent.desired("a") is Desired.STOPPED
    assert intent.desired("b") is Desired.RUNNING and intent.desired("c") is Desired.RUNNING
    intent.set_desired("c", Desired.STOPPED)
    assert NodeIntent(StateStore(tmp_path), {}).desired("c") is Desired.STOPPED
    assert '"c": "stopped"' in (tmp_path / "intent.json").read_text(), "the same string in the file"


def test_a_signal_kind_names_the_probe_whose_failure_it_reports() -> None:
    """A probe failure's `Failure.what` is the member's `failed_probe`, no longer `kind.split("_")[0]`; the
    literal spelling the host's calls use (mypy-checked) names exactly the members."""
    assert {k: k.failed_probe for k in SignalKind if k.failed_probe} == {
        SignalKind.STARTUP_FAILED: "startup", SignalKind.LIVENESS_FAILED: "liveness"}
    assert set(typing.get_args(SignalName)) == {k.value for k in SignalKind}
    assert {"stop", "restart", "wake", "dep_restart"} == COMMANDS, "the same strings as before"


async def test_a_node_redeploy_counts_what_it_stopped_and_not_what_had_died(tmp_path: Path) -> None:
    """A container's death (or the ladder) redeploys the node: a component it stopped restarts for the redeploy;
    one that had died already is counted by its own cause only."""
    r = await rig(tmp_path, "quick_exit_s: 0")
    try:
        a, b = r.sup.components["a"], r.sup.components["b"]
        await until("both up", lambda: a.up.is_set() and b.up.is_set())
        r.crash("b")
        await until("b relaunched", lambda: r.count("b") == 2 and b.up.is_set())
        assert Supervisor.request_redeploy(r.sup, "container exited with code 137")
        await until("both relaunched", lambda: r.count("a") == 2 and r.count("b") == 3 and b.up.is_set())
        assert a.restarts_by_cause == {"redeploy": 1} and b.restarts_by_cause == {"crash": 1, "redeploy": 1}
    finally:
        await stop(r)


async def test_the_start_records_each_components_stack_run(tmp_path: Path) -> None:
    """`Supervisor.start` (under the instance lock, not at construction) begins the stack runs a crash loop
    belongs to (tests/test_container_mode.py has the rule)."""
    r = await rig(tmp_path)
    try:
        assert set(r.sup.intent_store.data["stacks"]) == {"a", "b"}
    finally:
        await stop(r)


async def test_the_ladders_redeploy_touches_the_failed_component_never_its_dependency(tmp_path: Path) -> None:
    """A component's failures escalated to a node redeploy stop, clean and start it (and what restarts with it),
    never what it depends on: a worker's redeploy took etcd down, a rank's the worker (`blast_radius`)."""
    r = await rig(tmp_path, "redeploy_after_failures: 3, quick_exit_s: 0")
    r.sup.request_redeploy = functools.partial(Supervisor.request_redeploy, r.sup)  # type: ignore[method-assign]
    try:
        a, b = r.sup.components["a"], r.sup.components["b"]
        for n in (2, 3):
            r.crash("b")
            await until(f"launch {n}", lambda n=n: r.count("b") == n and b.up.is_set())
        r.clock.hold_at = 20  # the redeploy's backoff (20 s) waits until the test has seen it
        r.crash("b")
        await until("the redeploy's backoff", lambda: b.backoff_until is not None, 20)  # (a loaded machine)
        r.clock.released.set()
        await until("b redeployed", lambda: r.count("b") == 4 and b.up.is_set() and not r.sup.redeploying, 20)
        assert r.count("a") == 1 and a.restarts_by_cause == {}, "its dependency a was left running"
        done = [e for e in r.sup.events.recent if e.event == "redeploy"]
        assert [e.data.get("components") for e in done] == [["b"]]
        # the dependency's redeploy takes b with it (a `process` restarts with what it depends on)
        Supervisor.request_redeploy(r.sup, "a failed", r.sup.blast(Blast.COMPONENT, "a"))
        await until("both relaunched", lambda: r.count("a") == 2 and r.count("b") == 5 and b.up.is_set())
    finally:
        await stop(r)


class FakeLayer:
    """A layer above the node (`stackport.NodeLayer`) whose answers the test sets."""

    def __init__(self) -> None:
        self.holds: list[Any] = []
        self.verdict: Any = None
        self.message: str | None = None
        self.asked: list[tuple[str, str]] = []
        self.changes = 0

    def gate(self, comp: Any, operator: bool) -> Any:
        from nodeagent.seam.stackport import first_hold

        self.asked.append(("gate", comp.name))
        return first_hold(self.holds) if comp.name == "b" else None

    def decide(self, comp: Any, failure: Any) -> Any:
        self.asked.append(("decide", comp.name))
        return self.verdict

    def command(self, comp: Any, action: str, drain: bool, by: str) -> str | None:
        self.asked.append(("command", comp.name))
        return self.message

    def status_section(self) -> dict[str, Any]:
        return {"fake_layer": {"asked": len(self.asked)}}

    def member_report(self) -> None:
        return None

    def on_node_change(self) -> None:
        self.changes += 1


async def test_every_gate_is_asked_and_the_earliest_hold_wins(tmp_path: Path) -> None:
    """One ordered list: the node's gates (desired stop, pauses, ...) then the layers'; whatever holds at once,
    the earliest kind of HOLD_ORDER is what the component waits on, and removing it shows the next."""
    from nodeagent.seam.stackport import Hold, HoldKind

    r = await rig(tmp_path)
    try:
        layer = FakeLayer()
        r.sup.attach(layer)
        b = r.sup.components["b"]
        layer.holds = [Hold(HoldKind.BARRIER, "group g1: barrier"), Hold(HoldKind.PREFLIGHT, "preflight failed")]
        r.sup.set_paused(True, "test")
        r.sup.set_cluster_pause({"by": "n1: test", "at": 0.0, "reason": ""})
        r.sup.set_desired("b", "stopped")
        seen = []
        undos = [lambda: r.sup.set_desired("b", "running"), lambda: r.sup.set_cluster_pause(None),
                 lambda: r.sup.set_paused(False), lambda: layer.holds.pop(), lambda: layer.holds.pop()]
        for undo in undos:
            hold = r.sup.start_gate(b, False)
            seen.append(hold.kind if hold is not None else None)
            undo()
        seen.append(r.sup.start_gate(b, False))
        assert seen == [HoldKind.DESIRED_STOPPED, HoldKind.CLUSTER_PAUSE, HoldKind.NODE_PAUSE, HoldKind.PREFLIGHT,
                        HoldKind.BARRIER, None]  # fmt: skip
        layer.holds = [Hold(HoldKind.BARRIER, "group g1: barrier")]
        r.sup.set_paused(True, "test")
        assert r.sup.start_gate(b, True).kind == HoldKind.BARRIER, "an operator passes the pause, not the barrier"
        assert r.sup.component("b").deps_up and r.sup.snapshot().paused
    finally:
        await stop(r)


async def test_a_rank_waiting_at_a_barrier_logs_on_change_then_once_a_minute(tmp_path: Path) -> None:
    """issue 17: a component waiting at a start barrier logged a line a second (a node waiting 30 min for its
    peers wrote 1,800). Five minutes at the barrier log ~6 lines; a change of who is missing logs at once; status
    shows the wait as it grows."""
    r = await rig(tmp_path)
    try:
        layer = FakeLayer()
        r.sup.attach(layer)
        b = r.sup.components["b"]
        began = r.clock.now

        def at_barrier(missing: tuple[str, ...] = ("n1",)) -> list[Hold]:
            waited = r.clock.now - began
            return [Hold(HoldKind.BARRIER, f"group g1 generation 2: waiting {waited:.0f}s at the start barrier for "
                         f"{', '.join(missing)}", data={"group": "g1", "generation": 2, "missing": list(missing)})]

        layer.holds = at_barrier()
        r.sup.restart(["b"], "gang g1 generation 2", planned=False)
        await until("at the barrier", lambda: b.proc is None and b.hold is not None and "waiting 0s" in b.hold.reason)
        for second in range(1, 301):
            r.clock.advance(1)
            layer.holds = at_barrier()
            r.sup.wake()
            await until(f"{second}s", lambda s=second: f"waiting {s}s " in (b.held or ""))
        def logged() -> list[str]:
            return [m for m in r.events("held") if "at the start barrier" in m]

        assert [m.split(": waiting ")[-1].split("s ")[0] for m in logged()] == ["0", "60", "120", "180", "240", "300"]
        assert "waiting 300s at the start barrier" in r.sup.status()["components"]["b"]["held"]
        layer.holds = at_barrier(("n1", "n2"))
        r.sup.wake()
        await until("who is missing changed", lambda: len(logged()) == 7)
        assert logged()[-1].endswith("waiting 300s at the start barrier for n1, n2")
    finally:
        await stop(r)


def slow_stops(r: Rig) -> tuple[asyncio.Event, list[str]]:
    """Every stop waits for the event returned; the list says how far each got (terminating, terminated)."""
    release = asyncio.Event()
    order: list[str] = []
    terminate = r.terminate

    async def slow_terminate(comp: Any, proc: Process, why: str) -> dict[str, Any]:
        order.append("terminating")
        await release.wait()
        order.append("terminated")
        return await terminate(comp, proc, why)

    r.sup.terminate = slow_terminate  # type: ignore[method-assign]
    return release, order


async def test_the_process_stays_ours_until_its_whole_tree_is_stopped(tmp_path: Path) -> None:
    """The cluster layer arrives at a start barrier once every local rank is stopped: the view must not say
    stopped while the old tree still dies (once the record went before the stop was awaited)."""
    r = await rig(tmp_path)
    try:
        release, order = slow_stops(r)
        layer = FakeLayer()
        from nodeagent.seam.stackport import Hold, HoldKind

        layer.holds = [Hold(HoldKind.BARRIER, "group g1: barrier")]  # b stays down once stopped
        r.sup.attach(layer)
        r.sup.restart(["b"], "gang g1 generation 2", planned=False)
        await until("stopping", lambda: order == ["terminating"])
        view = r.sup.component("b")
        assert str(view.state) == "stopping" and view.running and not view.up and view.pid is not None
        assert not await r.sup.wait("b", "stopped", timeout=0.05), "still dying: not stopped"
        waiter = asyncio.ensure_future(r.sup.wait("b", "stopped", timeout=5))
        await asyncio.sleep(0.01)
        release.set()
        assert await waiter and order == ["terminating", "terminated"]
        view = r.sup.component("b")
        assert not view.running and view.pid is None and view.hold is not None
        assert view.hold.kind == HoldKind.BARRIER
        layer.holds = []
        r.sup.wake()
        assert await r.sup.wait("b", "up", timeout=5)
        assert r.count("b") == 2
    finally:
        await stop(r)


async def test_a_failure_is_decided_while_its_tree_is_still_being_stopped(tmp_path: Path) -> None:
    """A rank's failure restarts its whole group: the layers are asked as soon as the failure is known, with the
    component `stopping` and still `running` — not a stop grace later, once its tree is gone (an orphaned A2
    EngineCore can take ~50 s). The crash is decided and counted once."""
    r = await rig(tmp_path)
    try:
        release, order = slow_stops(r)
        layer = FakeLayer()
        seen: list[Any] = []
        layer.decide = lambda comp, failure: seen.append((comp, list(order))) or layer.verdict  # type: ignore[method-assign]
        layer.verdict = Delegated("group g1 restarts as one: generation 2 on n0, n1")
        r.sup.attach(layer)
        b = r.sup.components["b"]
        r.crash("b", -9)
        await until("the stop under way", lambda: order == ["terminating"])
        await asyncio.sleep(0.02)
        assert seen, "the layers are asked while the old tree is still being stopped"
        view, before = seen[0]
        assert before == [] and str(view.state) == "stopping" and view.running and view.going_down
        assert b.restarts_by_cause == {"crash": 1} and r.events("failure"), "decided and counted already"
        release.set()
        await until("stopped", lambda: order == ["terminating", "terminated"])
        await until("started again", lambda: r.count("b") == 2)
        assert len(seen) == 1 and b.restarts_by_cause == {"crash": 1}, "one decision, one restart counted"
    finally:
        release.set()
        await stop(r)


async def test_a_layer_is_asked_at_its_gate_its_decision_its_command_and_status(tmp_path: Path) -> None:
    r = await rig(tmp_path)
    try:
        layer = FakeLayer()
        r.sup.attach(layer)
        with pytest.raises(ValueError, match="attached already"):
            r.sup.attach(layer)
        layer.verdict = Delegated("group g1 restarts as one")
        r.crash("b")
        await until("delegated", lambda: any("next: group g1 restarts as one" in m for m in r.events("failure")))
        await asyncio.sleep(0.05)
        assert ("decide", "b") in layer.asked and not r.events("no_action")
        assert r.sup.trackers["b"].status(r.clock.now)["consecutive_failures"] == 0, "the policy did not count it"
        assert layer.changes > 0, "told of every change"
        layer.message = "restarting group g1 as generation 3"
        assert r.sup.command("b", "restart") == layer.message and ("command", "b") in layer.asked
        assert r.sup.status()["fake_layer"]["asked"] == len(layer.asked)
    finally:
        await stop(r)


async def test_a_crash_the_cluster_layer_takes_over_still_counts_as_a_crash(tmp_path: Path) -> None:
    """In a gang restart the rank that crashed showed RESTARTS 0 and its peers 1: the crash is counted where it
    happened, the peers' restarts as `gang`."""
    r = await rig(tmp_path)
    layer = FakeLayer()
    layer.verdict = Delegated("group g restarts as one")  # the layer restarts the group itself
    r.sup.attach(layer)
    try:
        b = r.sup.components["b"]
        r.crash("b")
        await until("delegated", lambda: any("next: group g restarts as one" in m for m in r.events("failure")))
        assert b.restarts_by_cause == {"crash": 1}
        b.signal("restart", None, "gang g generation 2", cause="gang")
        await until("gang start", lambda: r.count("b") == 2 and b.up.is_set())
        b.signal("restart", None, "gang g generation 3", cause="gang")
        await until("gang restart", lambda: r.count("b") == 3 and b.up.is_set())
        assert b.restarts_by_cause == {"crash": 1, "gang": 1}
    finally:
        await stop(r)


async def adopted_by_a_new_agent(r: Rig) -> tuple[Supervisor, Rig]:
    """The agent goes (a detach: an upgrade), its processes stay, and a new agent adopts them."""
    await r.sup.shutdown(detach=True)
    again = Supervisor(r.sup.config, EventBus(), r.clock)
    r2 = Rig(again, r.clock)
    r2.live = r.live

    async def adopt(comp: Any, record: ProcessRecord) -> Process:
        proc = r.live[comp.name]
        return Process(record, proc.exited, output="adopted", extra={"adopted": True})

    again.adopt = adopt  # type: ignore[method-assign]
    await again.start()
    return again, r2


async def test_a_process_that_died_while_no_agent_watched_counts_as_a_restart(tmp_path: Path) -> None:
    """issue 16, measured: kill -9 of a rank's agent and of its API server together; the next agent found the
    record dead and started the rank again — but its RESTARTS stayed where they were, as if nothing happened."""
    r = await rig(tmp_path)
    b = r.sup.components["b"]
    before = (b.restarts, dict(b.restarts_by_cause))
    await r.sup.shutdown(detach=True)
    r.crash("b")  # nobody watches it die
    again = Supervisor(r.sup.config, EventBus(), r.clock)
    r2 = Rig(again, r.clock)

    async def adopt(comp: Any, record: ProcessRecord) -> Process:
        if comp.name == "b":
            raise AdoptError(f"pid {record.pid} is gone")
        return Process(record, r.live[comp.name].exited, output="adopted", extra={"adopted": True})

    again.adopt = adopt  # type: ignore[method-assign]
    await again.start()
    try:
        b2 = again.components["b"]
        await until("started again and up", lambda: r2.count("b") == 1 and b2.up.is_set())
        assert before == (0, {}), before
        assert (b2.restarts, b2.restarts_by_cause) == (1, {"crash": 1})
        assert b2.last_exit is not None and "died unwatched: pid" in b2.last_exit["reason"]
        assert again.status()["components"]["b"]["restarts"] == 1
        assert again.components["a"].restarts == 0, "the adopted one was not restarted"
    finally:
        await again.shutdown()


async def test_an_adopted_process_says_how_long_it_has_run_not_a_load_time(tmp_path: Path) -> None:
    """issue 17: "up after 835.3s" after an adoption read as a load of 835 s. An adopted process says how long it
    has been running, and its start is not timed as a load."""
    r = await rig(tmp_path)
    loads = list(r.sup.components["b"].loads)
    r.clock.advance(835.3)
    again, _ = await adopted_by_a_new_agent(r)
    try:
        await until("adopted and up", lambda: again.components["b"].up.is_set())
        ups = [e.message for e in again.events.recent if e.event == "state" and e.component == "b"
               and e.data.get("state") == "running"]  # fmt: skip
        assert len(ups) == 1 and re.fullmatch(r"adopted, up \(running for 83[5-9] s\)", ups[0]), ups
        assert again.components["b"].loads == loads, "its start was not ours to time"
    finally:
        await again.shutdown()


async def test_a_crash_loop_clears_after_a_stable_run_across_an_adoption(tmp_path: Path) -> None:
    """issue 17: 'crash loop' after two kill -9s stayed for 12+ minutes through an adoption. It clears once the
    run has been healthy for stable_after_s (600 s here), and an adoption does not restart that clock."""
    r = await rig(tmp_path, "quick_exit_s: 0")
    b = r.sup.components["b"]
    for n in (2, 3):
        r.crash("b")
        await until(f"launch {n}", lambda n=n: r.count("b") == n and b.up.is_set())
    assert r.sup.trackers["b"].crash_loop
    await until("healthy", lambda: r.sup.trackers["b"].healthy_since is not None)
    r.clock.advance(400)
    again, r2 = await adopted_by_a_new_agent(r)
    try:
        await until("adopted and up", lambda: again.components["b"].up.is_set())
        tracker = again.trackers["b"]
        assert tracker.crash_loop, "400 s of the 600 are not a stable run yet"
        runs = r2.probes.runs
        r.clock.advance(250)  # 650 s healthy in all, across the adoption
        await until("checks after the jump", lambda: r2.probes.runs > runs + 3)
        assert not tracker.crash_loop, "the adopted run's healthy time counts: the crash loop clears"
        assert again.status()["components"]["b"]["policy"]["crash_loop"] is False
    finally:
        await again.shutdown()


async def test_no_automatic_restart_of_a_component_desired_stopped(tmp_path: Path) -> None:
    """decide asks the same gates: a desired stop (set while it ran) leaves its failure alone."""
    r = await rig(tmp_path)
    try:
        b = r.sup.components["b"]
        r.sup.set_desired("b", "stopped")
        r.crash("b")
        await until("no action", lambda: any("not restarting: desired state is stopped" in m
                                              for m in r.events("no_action")))  # fmt: skip
        await until("held", lambda: b.hold is not None and str(b.hold.kind) == "desired_stopped")
        assert r.count("b") == 1
    finally:
        await stop(r)


async def test_a_start_that_lost_a_port_race_is_retried_without_counting(tmp_path: Path) -> None:
    """issue 19 item 4 (vllm-ascend #15358, #16237): "Address already in use" before the start came up is retried
    after a jittered 1-5 s, not counted; the fourth in a row counts as usual (a real collision)."""
    clock = FakeClock()
    text = config_text(tmp_path / "state").replace(
        'probes: {liveness:', 'probes: {startup: [{kind: exec, command: ["true"], initial_delay_s: 3600}], liveness:')
    sup = Supervisor(parse_config(text), EventBus(), clock)
    r = Rig(sup, clock)
    sup.output_tail = lambda comp, proc: ("zmq.error.ZMQError: Address already in use (addr='tcp://10.0.0.1:53421')",)  # type: ignore[method-assign]
    await sup.start()
    b = sup.components["b"]
    try:
        for attempt in range(1, 4):
            await until(f"start {attempt}", lambda a=attempt: r.count("b") == a and b.record is not None)
            r.crash("b")
            await until(f"retry {attempt}", lambda a=attempt: r.count("b") == a + 1)
        assert b.restarts == 0 and b.failure is None, "three lost races in a row: none counted"
        retries = [e for e in sup.events.recent if e.component == "b" and e.data.get("bind_race_retry")]
        assert [e.data["bind_race_retry"] for e in retries] == [1, 2, 3]
        assert "port 53421 was taken during the start" in retries[0].message
        assert all(1.0 <= e.data["delay_s"] <= 5.0 for e in retries)
        await until("start 4", lambda: b.record is not None)
        r.crash("b")
        await until("the fourth counts", lambda: b.restarts == 1)
    finally:
        await stop(r)


async def test_a_gate_that_closes_during_the_start_cleanup_holds_the_launch(tmp_path: Path) -> None:
    """The start cleanup can take a minute (HBM back to idle). A group's new generation acted meanwhile finds no
    process to restart here; the launch must then wait for the new generation's barrier, not go on as the old one
    (CI saw a rank start into the old generation beside its peers in the new one)."""
    r = await rig(tmp_path)
    try:
        cleaning, closed = r.slow_cleanup()
        hold = Hold(HoldKind.BARRIER, "group g generation 5: waiting at the start barrier")
        gate: list[Hold] = []

        class Barrier(ReportLayer):
            def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
                return gate[0] if gate and comp.name == "b" else None

        r.sup.attach(Barrier())
        r.crash("b")
        await until("in its start cleanup", cleaning.is_set)
        gate.append(hold)  # the new generation is acted while b has no process
        closed.set()
        b = r.sup.components["b"]
        await until("held after the cleanup", lambda: b.hold == hold)
        await asyncio.sleep(0.05)
        assert r.count("b") == 1, "not launched into the old generation"
        assert any("not starting after its cleanup" in m for m in r.events("state"))
        cleaning.clear()
        gate.clear()
        r.sup.wake()
        closed.set()
        await until("launched once the barrier released", lambda: r.count("b") == 2)
    finally:
        await stop(r)


async def test_a_restart_asked_during_the_start_cleanup_is_that_start(tmp_path: Path) -> None:
    """An operator's restart queued while a start is being prepared (the cleanup can take a minute; a backoff's timer
    can run out as the command comes) is carried out by the launch that follows: the new process is not killed
    for it at once (CI saw `stopping pid N: operator restart` a millisecond after `started pid N`)."""
    r = await rig(tmp_path, "quick_exit_s: 0")
    try:
        cleaning, go_on = r.slow_cleanup()
        r.crash("b")
        await until("in its start cleanup", cleaning.is_set)
        r.sup.command("b", "restart")
        go_on.set()
        b = r.sup.components["b"]
        await until("up again", lambda: r.count("b") == 2 and b.up.is_set())
        await asyncio.sleep(0.05)
        assert r.count("b") == 2 and b.up.is_set(), "the new process kept"
        assert not any("operator restart" in m for m in r.events("state")), r.events("state")
        r.sup.command("b", "restart")  # a restart of a running process still restarts it
        await until("restarted", lambda: r.count("b") == 3 and b.up.is_set())
    finally:
        await stop(r)


async def test_a_wall_clock_step_neither_ends_nor_stretches_a_drain(tmp_path: Path) -> None:
    """The drain timeout is a duration: measured on the monotonic clock, an NTP step of an hour changes nothing."""
    r = await rig(tmp_path)
    try:
        left = {"now": (2, 1)}

        async def inflight(comp: Any) -> tuple[int, int] | None:
            r.clock.advance(3600)  # the wall clock steps forward while the drain waits
            return left["now"]

        r.sup.drain_timeout = lambda comp: 30.0  # type: ignore[method-assign]
        r.sup.inflight = inflight  # type: ignore[method-assign]
        r.sup.command("b", "restart", drain=True)
        b = r.sup.components["b"]
        await until("draining", lambda: "draining" in b.extra_status)
        await asyncio.sleep(0.05)
        assert not r.events("drain_timeout"), "an hour of wall clock is not 30 s of drain"
        left["now"] = (0, 0)
        await until("drained", lambda: r.events("drained"))
        await until("restarted", lambda: r.count("b") == 2)
    finally:
        await stop(r)

"""The container's lifecycle decisions (nodeagent.container.plan), without an engine: inspect states in, steps out.

tests/fixtures/captured-podman_inspect_{running,exited}.json are real `podman inspect` output captured on the build
machine (podman 4.3.1, runc) of a container made by the guide's run line, before and after `podman kill`;
captured-docker_api_inspect_*.json the same through the docker CLI 28.2.2 against podman's docker-compatible API
(`podman system service`): docker's schema as podman renders it, not a Docker daemon's own output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nodeagent.container.plan import (
    ContainerInspectError,
    ContainerRecord,
    ContainerState,
    DeathWatch,
    SetupStepFailed,
    Step,
    event_status,
    parse_inspect,
    plan_container,
    setup_hash,
    setup_progress,
    setup_stamp,
    setup_todo,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
IMAGE = "localhost/dsv4-agent-probe:1"
SETUP = [["git", "am", "/workspace/yuanrong_patches/0001.patch"], ["pip", "install", "ds.whl"]]
FP = "f" * 64


def running(**changes: object) -> ContainerState:
    state = ContainerState(id="c13b642b7b00" + "0" * 52, name="box", status="running", running=True, image=IMAGE,
                           exit_code=0, pid=4242, started_at="2026-12-04T00:54:06Z")  # fmt: skip
    return dataclasses.replace(state, **changes)  # type: ignore[arg-type]


def record(state: ContainerState | None = None, **changes: object) -> ContainerRecord:
    state = state or running()
    rec = ContainerRecord(container_id=state.id, fingerprint=FP, setup_hash=setup_hash(SETUP),
                          started_at=state.started_at, setup_stamp=setup_stamp(state.id, SETUP), setup_done=len(SETUP))
    return dataclasses.replace(rec, **changes)  # type: ignore[arg-type]


def plan(state: ContainerState | None, rec: ContainerRecord | None, fp: str = FP, image: str = IMAGE,
         setup: list[list[str]] = SETUP):
    return plan_container(state, rec, fp, image, setup)


def test_parse_real_podman_inspect() -> None:
    up = parse_inspect((FIXTURES / "captured-podman_inspect_running.json").read_text())
    assert up is not None and up.running and up.status == "running" and up.pid and up.image == IMAGE
    assert up.name == "probe1" and up.started_at and up.describe() == "running"
    down = parse_inspect((FIXTURES / "captured-podman_inspect_exited.json").read_text())
    assert down is not None and not down.running and down.pid is None and down.id == up.id
    assert (down.status, down.exit_code, down.describe()) == ("exited", 137, "exited with code 137")
    assert parse_inspect("[]") is None
    with pytest.raises(ContainerInspectError):
        parse_inspect("Error: something")
    with pytest.raises(ContainerInspectError):
        parse_inspect('[{"Id": "x"}]')


def test_parse_docker_cli_inspect() -> None:
    up = parse_inspect((FIXTURES / "captured-docker_api_inspect_running.json").read_text())
    down = parse_inspect((FIXTURES / "captured-docker_api_inspect_exited.json").read_text())
    assert up is not None and up.running and up.name == "d1" and up.image.startswith("localhost/dsv4-agent-test:")
    assert down is not None and down.describe() == "exited with code 137" and down.id == up.id


def test_docker_shaped_inspect() -> None:
    text = ('[{"Id": "abc", "Name": "/box", "Image": "sha256:1", "Config": {"Image": "repo/img:1"}, "State": '
            '{"Status": "exited", "Running": false, "OOMKilled": true, "ExitCode": 137, "Pid": 0, '
            '"StartedAt": "2026-01-01T00:00:00Z", "FinishedAt": "2026-01-01T00:01:00Z", "Error": ""}}]')
    state = parse_inspect(text)
    assert state is not None and state.name == "box" and state.image == "repo/img:1"
    assert state.describe() == "exited with code 137 (OOM-killed)"


def test_absent_is_created_and_set_up() -> None:
    p = plan(None, None)
    assert p.steps == (Step.CREATE, Step.SETUP) and not p.redeploy and not p.drain
    assert plan(None, None, setup=[]).steps == (Step.CREATE,)
    gone = plan(None, record())
    assert gone.steps == (Step.CREATE, Step.SETUP) and gone.redeploy and "removed" in gone.reason


def test_up_and_set_up_is_nothing() -> None:
    p = plan(running(), record())
    assert p.nothing and p.reason == "up"


def test_created_is_started_and_set_up() -> None:
    state = running(status="created", running=False, pid=None, started_at=None)
    p = plan(state, None)
    assert p.steps == (Step.START, Step.SETUP) and not p.redeploy


def test_exited_and_oom_killed_are_recreated_and_redeployed() -> None:
    for state in (running(status="exited", running=False, exit_code=137),
                  running(status="exited", running=False, exit_code=137, oom_killed=True)):
        p = plan(state, record(running()))
        assert p.steps == (Step.REMOVE, Step.CREATE, Step.SETUP) and p.redeploy and not p.drain
        assert state.describe() in p.reason
    assert "OOM-killed" in plan(running(status="exited", running=False, oom_killed=True), None).reason


def test_stopped_by_the_agent_is_started_again_not_a_death() -> None:
    """`on_stop: stop` leaves it `Exited (137)` (bash as PID 1 ignores SIGTERM, the engine SIGKILLs it): the
    record says the agent did it, so the next agent starts it (set up already) instead of counting a death."""
    stopped = running(status="exited", running=False, exit_code=137, pid=None)
    p = plan(stopped, record(running(), stopped_by_agent="2026-12-06T23:40:00+00:00"))
    assert p.steps == (Step.START,) and not p.redeploy and not p.drain
    assert p.reason.startswith("stopped by the agent at 2026-12-06T23:40:00+00:00 (exited with code 137")
    changed = plan(stopped, record(running(), stopped_by_agent="t"), image="other:2")
    assert changed.steps == (Step.REMOVE, Step.CREATE, Step.SETUP) and not changed.redeploy
    assert ContainerRecord.from_json(record(stopped_by_agent="t").to_json()).stopped_by_agent == "t"
    # started by hand after the agent stopped it, then dead: that run is no stop of ours
    rerun = dataclasses.replace(stopped, started_at="2026-12-07T00:00:00Z")
    assert plan(rerun, record(running(), stopped_by_agent="t")).redeploy


def test_changed_image_run_line_or_setup_is_a_planned_recreate() -> None:
    rec = record()
    for p, why in ((plan(running(), rec, image="other:2"), "image changed"),
                   (plan(running(), rec, fp="e" * 64), "run line changed"),
                   (plan(running(), rec, setup=[["true"]]), "setup changed")):  # fmt: skip
        assert p.steps == (Step.REMOVE, Step.CREATE, Step.SETUP) and p.drain, why
        assert why in p.reason and not p.redeploy


def test_restarted_under_us_redeploys_without_recreate() -> None:
    p = plan(running(started_at="2026-12-04T01:00:00Z"), record())
    assert p.steps == () and p.redeploy and "restarted" in p.reason


def test_replaced_and_adopted() -> None:
    other = running(id="d" * 64)
    p = plan(other, record())
    assert p.redeploy and p.steps == (Step.SETUP,) and "replaced" in p.reason
    adopted = plan(running(), None)
    assert not adopted.redeploy and adopted.steps == (Step.SETUP,) and "adopted" in adopted.reason


def test_paused_restarting_removing() -> None:
    assert plan(running(status="paused"), record()).steps == (Step.UNPAUSE,)
    for status in ("restarting", "removing"):
        p = plan(running(status=status, running=False), record())
        assert p.wait and not p.steps


def test_setup_runs_once_per_container_and_resumes_at_the_failed_step() -> None:
    cid = running().id
    fresh = record(setup_stamp=None, setup_done=0)
    assert setup_todo(fresh, cid, SETUP) == [(1, SETUP[0]), (2, SETUP[1])]
    after_first = setup_progress(fresh, cid, SETUP, 1)
    assert setup_todo(after_first, cid, SETUP) == [(2, SETUP[1])]
    assert plan(running(), after_first).steps == (Step.SETUP,)
    done = setup_progress(fresh, cid, SETUP, 2)
    assert setup_todo(done, cid, SETUP) == [] and plan(running(), done).nothing
    # A new container (another id) starts from step 1 whatever the record says.
    assert setup_todo(done, "e" * 64, SETUP) == [(1, SETUP[0]), (2, SETUP[1])]
    assert setup_stamp(cid, SETUP) != setup_stamp(cid, [*SETUP, ["true"]])


def test_setup_failure_names_the_step() -> None:
    exc = SetupStepFailed(2, 3, ("pip", "install", "ds.whl"), 1, "ERROR: no such file ds.whl\n")
    assert str(exc) == "container setup step 2/3 (pip install ds.whl) exited 1: ERROR: no such file ds.whl"
    assert "timed out" in str(SetupStepFailed(1, 1, ("sleep", "9"), None))


def test_record_round_trips() -> None:
    rec = record()
    assert ContainerRecord.from_json({**rec.to_json(), "unknown": 1}) == rec


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def test_death_watch_sees_each_way_to_die() -> None:
    clock = FakeClock()
    up = running()
    watch = DeathWatch(up.id, up.started_at, clock.now)
    assert watch.observe(clock.advance(1), up) is None
    death = watch.observe(clock.advance(1), running(status="exited", running=False, exit_code=137, pid=None))
    assert death is not None and death.kind == "exited" and "137" in death.detail and death.state is not None
    assert DeathWatch(up.id, up.started_at, 0).observe(1, None).kind == "removed"  # type: ignore[union-attr]
    replaced = DeathWatch(up.id, up.started_at, 0).observe(1, running(id="9" * 64))
    assert replaced is not None and replaced.kind == "replaced"
    restarted = DeathWatch(up.id, up.started_at, 0).observe(1, running(started_at="2026-12-04T02:00:00Z"))
    assert restarted is not None and restarted.kind == "restarted"


def test_an_engine_that_stops_answering_is_a_death_after_the_grace() -> None:
    clock = FakeClock()
    watch = DeathWatch(running().id, None, clock.now, unresponsive_after_s=10)
    assert watch.engine_failed(clock.advance(5), "timeout") is None
    assert watch.observe(clock.advance(1), running()) is None  # an answer resets the grace
    assert watch.engine_failed(clock.advance(9.9), "timeout") is None
    death = watch.engine_failed(clock.advance(0.1), "inspect timed out after 5 s")
    assert death is not None and death.kind == "engine-unresponsive" and "10 s" in death.detail


def test_an_engine_that_stops_answering_is_no_death_while_the_containers_init_lives() -> None:
    """Found by the simulation (seed 760011, 8-node, container mode): dockerd silent for 10 s stopped every rank
    inside — a node redeploy, each rank's model load — though the container ran on. Its init, alive on the host,
    says it does; once the init is gone the grace counts from when it was last seen."""
    clock = FakeClock()
    watch = DeathWatch(running().id, None, clock.now, unresponsive_after_s=10)
    for _ in range(6):
        assert watch.engine_failed(clock.advance(5), "Cannot connect to the Docker daemon", init_alive=True) is None
    assert watch.engine_failed(clock.advance(9.9), "Cannot connect to the Docker daemon") is None
    death = watch.engine_failed(clock.advance(0.1), "Cannot connect to the Docker daemon")
    assert death is not None and death.kind == "engine-unresponsive"


def test_event_lines() -> None:
    line = '{"ID":"c1","Image":"x","Name":"box","Status":"died","Time":"now","Type":"container"}'
    assert event_status(line) == "died"
    assert event_status('{"status":"die","id":"c1","Action":"die"}') == "die"
    assert event_status("not json") is None and event_status("[]") is None


def test_never_is_none() -> None:
    up = parse_inspect((FIXTURES / "captured-podman_inspect_running.json").read_text())
    assert up is not None and up.finished_at is None

"""A real container engine (Debian's podman with runc): the rendered run line, exec, setup, and the death watch.

The image is the cached test rootfs imported offline (scripts/build-test-image.sh); the worktree with its venv and
the venv's interpreter are bind-mounted read-only at their own paths. The run line is the guide's as the agent
adapts it to this machine (no NPU devices or Ascend paths, runc and explicit ulimits where podman needs them:
DESIGN §10, nodeagent/container/host.py). Measurements print with `pytest -s`.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import wait_for
from containerhelpers import (
    SKIP_REASON,
    VENV_PYTHON,
    built_image,
    podman_docker_api,
    spec_here,
    stack_run_args,
)

from nodeagent.config.base import replace
from nodeagent.config.container import ContainerConfig
from nodeagent.container.engine import (
    ContainerEngine,
    EngineError,
    RecordStore,
    container_pids,
    ensure_container,
    inner_pid,
    run_engine,
)
from nodeagent.container.plan import SetupStepFailed, Step
from nodeagent.container.render import host_facts

pytestmark = [pytest.mark.system, pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))]


@pytest.fixture(scope="module")
def image() -> str:
    return built_image()


@pytest.fixture
def section(image: str) -> Iterator[ContainerConfig]:
    name = f"dsv4-test-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    cfg = ContainerConfig(engine="podman", image=image, name=name, run_args=stack_run_args())
    yield cfg
    subprocess.run(spec_here(cfg).rm_argv(), capture_output=True, timeout=60)


def started(section: ContainerConfig, tmp_path: Path, setup: list[list[str]] | None = None
            ) -> tuple[ContainerEngine, RecordStore, str]:
    engine = ContainerEngine(spec_here(section))
    store = RecordStore(tmp_path / "state")
    state, plan = asyncio.run(ensure_container(engine, setup or [], store, print))
    assert state.running and Step.CREATE in plan.steps
    return engine, store, state.id


def test_an_exec_probe_inside_runs_in_the_container(section: ContainerConfig, tmp_path: Path) -> None:
    """podman writes /run/.containerenv into every container it runs: the probe sees it, the host does not."""
    from nodeagent.probes.kinds import check_exec

    engine, _store, _cid = started(section, tmp_path)
    argv = ["sh", "-c", "test -e /run/.containerenv && pwd"]
    assert asyncio.run(check_exec(argv, Path("/tmp"), engine.spec)) == (True, "/tmp")
    assert not Path("/run/.containerenv").exists()
    ok, detail = asyncio.run(check_exec(argv, Path("/tmp")))
    assert not ok and detail == "exit 1"


def test_rendered_line_is_what_podman_ran(section: ContainerConfig, tmp_path: Path) -> None:
    t0 = time.monotonic()
    engine, _store, cid = started(section, tmp_path)
    created_s = time.monotonic() - t0
    out = subprocess.run([*engine.spec.inspect_argv()], capture_output=True, text=True, check=True).stdout
    data = json.loads(out)[0]
    assert data["Config"]["CreateCommand"] == list(engine.spec.run_argv())
    assert data["HostConfig"]["NetworkMode"] == "host" and data["HostConfig"]["Privileged"] is True
    assert data["HostConfig"]["ShmSize"] == 800 << 30 and data["OCIRuntime"] == "runc"  # the guide's 800g
    assert "/tmp:/tmp" in " ".join(engine.spec.run_argv())  # the guide's mounts that exist here stay
    # The venv runs inside from the read-only bind mount: the agent, etcd and dscli are all there.
    t0 = time.monotonic()
    res = asyncio.run(engine.exec([str(VENV_PYTHON), "-c", "import nodeagent, yr.datasystem; print('ok')"]))
    assert res.stdout.strip() == "ok"
    first_exec_s = time.monotonic() - t0
    assert asyncio.run(engine.exec([str(VENV_PYTHON.parent / "etcd"), "--version"])).stdout.startswith("etcd Version")
    print(f"\ncontainer create+start {created_s * 1000:.0f} ms; first python exec {first_exec_s * 1000:.0f} ms")
    init = json.loads(subprocess.run([*engine.spec.inspect_argv()], capture_output=True, text=True).stdout)[0]
    assert init["State"]["Pid"] in container_pids(cid) and os.getpid() not in container_pids(cid)


def test_exec_overhead(section: ContainerConfig, tmp_path: Path) -> None:
    engine, _store, _cid = started(section, tmp_path)

    def timed(argv: tuple[str, ...] | list[str]) -> float:
        t0 = time.monotonic()
        subprocess.run(argv, check=True, capture_output=True, timeout=30)
        return time.monotonic() - t0

    inside = [timed(engine.spec.exec_argv(["true"])) for _ in range(7)]
    host = [timed(["true"]) for _ in range(7)]
    extra = statistics.median(inside) - statistics.median(host)
    print(f"\nexec start: podman exec true median {statistics.median(inside) * 1000:.0f} ms "
          f"(host true {statistics.median(host) * 1000:.1f} ms): +{extra * 1000:.0f} ms per exec")
    assert extra < 5.0


def test_a_killed_exec_client_leaves_its_process_running(section: ContainerConfig, tmp_path: Path) -> None:
    engine, _store, cid = started(section, tmp_path)
    before = set(container_pids(cid))
    client = subprocess.Popen(engine.spec.exec_argv(["sleep", "600"], {"DSV4_AGENT_COMPONENT": "probe"}),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)

    def the_sleeper() -> int | None:
        # named "sleep" a moment before its environment is set up: the kernel sets the name early in exec, the
        # environment's bounds a little later — wait for both
        new = [p for p in set(container_pids(cid)) - before if psutil.Process(p).name() == "sleep"
               and Path(f"/proc/{p}/environ").read_bytes()]  # fmt: skip
        return new[0] if new else None

    pid = wait_for("the exec'd sleep inside the container", the_sleeper, timeout=20)
    assert "DSV4_AGENT_COMPONENT=probe" in Path(f"/proc/{pid}/environ").read_text().split("\0")
    os.kill(client.pid, signal.SIGKILL)
    client.wait(timeout=10)
    time.sleep(1.0)  # time for anything that would propagate the client's death (nothing does)
    assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE, \
        "the process should outlive its killed exec client"
    # Stop it through the container's own PID namespace: its PID in there, signalled from inside.
    ns_pid = inner_pid(pid)
    assert ns_pid is not None and ns_pid != pid
    asyncio.run(engine.exec(["bash", "-c", f"kill -KILL {ns_pid}"]))  # the builtin: minbase has no procps
    wait_for("the sleeper gone", lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie",
             timeout=10)
    assert pid not in container_pids(cid)


def kill_and_watch(section: ContainerConfig, tmp_path: Path, use_events: bool) -> float:
    engine, store, cid = started(section, tmp_path)
    record = store.load()
    assert record is not None

    async def scenario() -> tuple[float, str]:
        watcher = asyncio.create_task(engine.watch(cid, record.started_at, poll_s=1.0, use_events=use_events))
        await asyncio.sleep(1.5)  # the watcher is following by now
        assert not watcher.done()
        t0 = time.monotonic()
        await run_engine(engine.spec.kill_argv(), 30)
        death = await asyncio.wait_for(watcher, 10)
        return time.monotonic() - t0, death.kind + ": " + death.detail

    latency, what = asyncio.run(scenario())
    assert what.startswith("exited") and "137" in what
    return latency


@pytest.mark.parametrize("use_events", [True, False], ids=["events", "poll"])
def test_podman_kill_is_noticed_within_5s(section: ContainerConfig, tmp_path: Path, use_events: bool) -> None:
    latency = kill_and_watch(section, tmp_path, use_events)
    print(f"\npodman kill noticed after {latency * 1000:.0f} ms ({'events stream' if use_events else '1 s poll'})")
    assert latency < 5.0


def test_setup_runs_once_per_container_and_again_after_a_death(section: ContainerConfig, tmp_path: Path) -> None:
    setup = [["sh", "-c", "echo patched >> /root/setup.log"], ["sh", "-c", "echo wheel >> /root/setup.log"]]
    lines: list[str] = []
    engine = ContainerEngine(spec_here(section))
    store = RecordStore(tmp_path / "state")
    state, plan = asyncio.run(ensure_container(engine, setup, store, lines.append))
    assert plan.steps == (Step.CREATE, Step.SETUP) and "container setup step 2/2: sh -c echo wheel >> /root/setup.log" \
        in lines
    again, plan2 = asyncio.run(ensure_container(engine, setup, store, lines.append))
    assert plan2.nothing and again.id == state.id
    log = asyncio.run(engine.exec(["cat", "/root/setup.log"])).stdout
    assert log.split() == ["patched", "wheel"]  # once, not twice
    asyncio.run(run_engine(engine.spec.kill_argv(), 30))
    reborn, plan3 = asyncio.run(ensure_container(engine, setup, store, lines.append))
    assert plan3.redeploy and plan3.steps == (Step.REMOVE, Step.CREATE, Step.SETUP) and reborn.id != state.id
    assert "exited with code 137" in plan3.reason
    assert asyncio.run(engine.exec(["cat", "/root/setup.log"])).stdout.split() == ["patched", "wheel"]


def test_a_failed_setup_step_is_named_and_resumed_there(section: ContainerConfig, tmp_path: Path) -> None:
    marker = tmp_path / "fixed"
    setup = [["sh", "-c", "echo one >> /root/steps"], ["sh", "-c", f"test -e {marker} || {{ echo no wheel; exit 3; }}"]]
    engine = ContainerEngine(spec_here(section))
    store = RecordStore(tmp_path / "state")
    with pytest.raises(SetupStepFailed) as failed:
        asyncio.run(ensure_container(engine, setup, store, lambda line: None))
    assert str(failed.value).startswith("container setup step 2/2 (sh -c test -e") and "exited 3: no wheel" in \
        str(failed.value)
    marker.touch()  # /tmp is bind-mounted (the guide's -v /tmp:/tmp): the fix is visible inside
    _state, plan = asyncio.run(ensure_container(engine, setup, store, lambda line: None))
    assert plan.steps == (Step.SETUP,)
    assert asyncio.run(engine.exec(["cat", "/root/steps"])).stdout.split() == ["one"]  # step 1 not repeated


def test_a_changed_run_line_is_a_planned_recreate(section: ContainerConfig, tmp_path: Path) -> None:
    _engine, store, cid = started(section, tmp_path)
    changed = ContainerEngine(spec_here(replace(section, run_args=[*section.run_args,
                                                                           "-e HCCL_BUFFSIZE=512"])))
    drained: list[str] = []

    async def drain(reason: str) -> None:
        drained.append(reason)

    state, plan = asyncio.run(ensure_container(changed, [], store, print, drain))
    assert plan.drain and drained == ["run line changed"] and state.id != cid
    assert "HCCL_BUFFSIZE=512" in asyncio.run(changed.exec(["env"])).stdout


def test_a_failed_run_line_leaves_no_container_to_adopt(section: ContainerConfig, tmp_path: Path) -> None:
    """A run line that fails at the runtime's create (here a missing entrypoint; under nspawn it was the keyring)
    leaves a `created` container of that name: adopted on the next try as "not created by this agent", it was
    started with the same broken line forever and a fixed config never took effect."""
    broken = ContainerEngine(spec_here(replace(section, run_args=[*section.run_args, "--entrypoint=/no/such/bin"])))
    store = RecordStore(tmp_path / "state")
    with pytest.raises(EngineError, match="/no/such/bin"):
        asyncio.run(ensure_container(broken, [], store, print))
    assert asyncio.run(broken.inspect()) is None
    state, plan = asyncio.run(ensure_container(ContainerEngine(spec_here(section)), [], store, print))
    assert plan.steps[:1] == (Step.CREATE,) and state.running


@pytest.fixture
def docker_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """podman's docker-compatible API on a private socket, for the docker CLI (no Docker daemon here)."""
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI on PATH (Debian's docker.io ships one)")
    with podman_docker_api() as host:
        monkeypatch.setenv("DOCKER_HOST", host)
        yield host


def test_the_docker_path_is_the_same_code(docker_api: str, section: ContainerConfig, tmp_path: Path) -> None:
    docker = replace(section, engine="docker", runtime="runc")  # a configured runtime: docker's run option
    engine, store, cid = started(docker, tmp_path)
    assert engine.spec.run_argv()[:2] == ("docker", "run") and "--runtime=runc" in engine.spec.run_argv()
    assert asyncio.run(engine.exec(["sh", "-c", "echo inside"])).stdout.strip() == "inside"
    record = store.load()
    assert record is not None and record.container_id == cid

    async def scenario() -> tuple[float, str]:
        watcher = asyncio.create_task(engine.watch(cid, record.started_at, poll_s=1.0))
        await asyncio.sleep(1.5)
        t0 = time.monotonic()
        await run_engine(engine.spec.kill_argv(), 30)
        death = await asyncio.wait_for(watcher, 10)
        return time.monotonic() - t0, death.detail

    latency, detail = asyncio.run(scenario())
    print(f"\ndocker kill (via podman's API) noticed after {latency * 1000:.0f} ms: {detail}")
    assert latency < 5.0 and "137" in detail
    _state, plan = asyncio.run(ensure_container(engine, [], store, print))
    assert plan.redeploy and plan.steps == (Step.REMOVE, Step.CREATE)
    t0 = time.monotonic()
    asyncio.run(engine.remove())
    assert asyncio.run(engine.inspect()) is None
    print(f"docker rm -f of a running container: {(time.monotonic() - t0) * 1000:.0f} ms")


def test_the_host_sees_a_death_inside_as_fast_as_its_own(section: ContainerConfig, tmp_path: Path) -> None:
    """The host-side design: find the component by the container's cgroup, watch its host PID with a pidfd."""
    engine, _store, cid = started(section, tmp_path)
    before = set(container_pids(cid))
    client = subprocess.Popen(engine.spec.exec_argv(["sleep", "600"]), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        pid = wait_for("the sleeper", lambda: next((p for p in set(container_pids(cid)) - before
                                                   if psutil.Process(p).name() == "sleep"), None), timeout=20)
        fd = os.pidfd_open(pid)
        try:
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)  # a process of our container, by its host PID
            ready, _, _ = select.select([fd], [], [], 5)
            latency = time.monotonic() - t0
        finally:
            os.close(fd)
        assert ready, "pidfd did not report the death"
        print(f"\ndeath of a process inside seen by a host pidfd after {latency * 1e6:.0f} µs")
        assert latency < 0.5
    finally:
        client.wait(timeout=10)


CRUN = Path(__file__).resolve().parents[1] / ".cache" / "crun" / "crun"
"""Debian's crun unpacked, not installed (scripts/fetch-crun.sh): podman's default stays runc for the suite."""


@pytest.fixture
def crun_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """podman with the real crun as its default runtime (a containers.conf of this test), as where it is installed."""
    if not CRUN.is_file():
        pytest.skip("crun is not fetched: scripts/test.sh fetches it (scripts/fetch-crun.sh)")
    conf = tmp_path / "containers.conf"
    conf.write_text(f'[engine]\nruntime = "crun"\n\n[engine.runtimes]\ncrun = ["{CRUN}"]\n')
    monkeypatch.setenv("CONTAINERS_CONF", str(conf))
    out = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == "crun", out
    return conf


def test_the_agent_predicts_cruns_refusal_and_runs_the_container_with_runc(
        crun_default: Path, section: ContainerConfig, tmp_path: Path) -> None:  # fmt: skip
    """The adaptation checked against the real crun, not claimed: crun refuses exactly when the agent says it would
    (hybrid cgroups whose unified hierarchy has controllers, as on these hosts), and the agent's line runs."""
    facts = host_facts(section)
    spec = spec_here(section)
    ulimits = [w for o in spec.options if o.canonical == "--ulimit" for w in o.words()]
    plain = subprocess.run(["podman", "run", "--rm", *ulimits, section.image, "true"], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert (plain.returncode != 0) == facts.crun_refuses, (facts, plain.stderr)
    if facts.crun_refuses:
        assert "cgroups in hybrid mode not supported" in plain.stderr, plain.stderr
        assert facts.default_runtime == "crun" and spec.global_args == ("--runtime", "runc"), spec.global_args
        assert any(n.topic == "runtime" for n in spec.adaptations), "the change is said"
    _engine, _store, cid = started(section, tmp_path)
    ran = json.loads(subprocess.run(["podman", "inspect", "--type", "container", cid], capture_output=True,
                                    text=True, check=True).stdout)[0]  # fmt: skip
    assert ran["State"]["Running"] and ran["OCIRuntime"] == ("runc" if facts.crun_refuses else "crun")
    print(f"\ncrun here: {plain.stderr.strip() or 'ran'}; the agent's container runs with {ran['OCIRuntime']}")

"""Container mode's pure and /proc-reading parts, without an engine: the folders the container must share, the
launched process found by its marker, the init that is exiting, the container's /dev/shm swept from outside."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeagent.config.load import parse_config
from nodeagent.container.engine import PF_EXITING, host_pid, in_container, init_alive
from nodeagent.container.exec import LAUNCH_VAR, exec_spec, find_launched
from nodeagent.container.mode import ContainerMode
from nodeagent.container.render import agent_mounts, container_spec, render_container, shared_folders
from nodeagent.node.residue import _remove_shm_segments
from nodeagent.node.residue_plan import RemoveShmSegments
from nodeagent.render.launch import render_component

CID = "86326aca2515" + "0" * 52


def config(state: str, workdir: str | None = None) -> object:
    ds = f", workdir: {workdir}" if workdir else ""
    liveness = f"{workdir or '/srv/yr'}/liveness"
    return parse_config(f"node: {{name: n1, ip: 127.0.0.1}}\nagent: {{state_dir: {state}, log_dir: /var/log/x}}\n"
                        "container: {engine: docker}\ncomponents:\n"
                        "  etcd: {kind: etcd, container: false, data_dir: /srv/etcd}\n"
                        f"  datasystem: {{kind: datasystem, liveness_check_path: {liveness}{ds}}}\n")  # fmt: skip


def test_the_agents_folders_are_shared_at_their_own_paths_unless_a_mount_covers_them() -> None:
    cfg = config("/var/lib/dsv4-agent", workdir="/srv/yr")
    assert shared_folders(cfg) == [Path("/srv/yr"), Path("/var/lib/dsv4-agent")]  # type: ignore[arg-type]
    spec = render_container(cfg)  # type: ignore[arg-type]
    added = [o.value for o in agent_mounts(cfg, spec)]  # type: ignore[arg-type]
    assert added == ["/srv/yr:/srv/yr", "/var/lib/dsv4-agent:/var/lib/dsv4-agent"]
    ran = container_spec(cfg).run_argv()  # type: ignore[arg-type]
    assert ran[-5:] == ("-v", "/srv/yr:/srv/yr", "-v", "/var/lib/dsv4-agent:/var/lib/dsv4-agent", spec.image)
    # Under the guide's own mounts (/tmp, /home, /data, /mnt) nothing is added: the line stays the guide's.
    under = config("/tmp/agent/state", workdir="/data/yr")
    assert agent_mounts(under, render_container(under)) == []  # type: ignore[arg-type]
    assert container_spec(under).run_argv() == render_container(under).run_argv()  # type: ignore[arg-type]


def test_a_read_only_mount_does_not_cover_a_folder_the_stack_writes() -> None:
    """`-v /srv:/srv:ro` shows the state folder inside, but read-only: the agent mounts it read-write itself."""
    cfg = parse_config("node: {name: n1, ip: 127.0.0.1}\nagent: {state_dir: /srv/agent/state, log_dir: /var/log/x}\n"
                       "container: {engine: docker, run_args: ['-v /srv:/srv:ro', '-v /opt:/opt:rw']}\n"
                       "components: {w: {kind: process, command: [sleep, '9'], workdir: /opt/w}}\n")  # fmt: skip
    added = [o.value for o in agent_mounts(cfg, render_container(cfg))]  # type: ignore[arg-type]
    assert added == ["/srv/agent/state:/srv/agent/state"]


def test_the_exec_line_carries_the_components_env_cwd_and_marker() -> None:
    cfg = config("/tmp/agent/state")
    spec = render_component("datasystem", cfg, {})  # type: ignore[arg-type]
    outer = exec_spec(spec, render_container(cfg), "abc123")  # type: ignore[arg-type]
    argv = list(outer.argv)
    assert argv[:2] == ["docker", "exec"] and argv[argv.index("-w") + 1] == str(spec.cwd)
    assert f"{LAUNCH_VAR}=abc123" in argv and "DSV4_AGENT_COMPONENT=datasystem" in argv
    assert argv[argv.index("ds_v4_flash_yr") + 1:][:len(spec.argv)] == list(spec.argv)
    assert outer.env[LAUNCH_VAR] == "abc123" and outer.daemonizes


def fake_proc(root: Path, pid: int, *, cgroup: str, environ: dict[str, str] | None = None, sid: int | None = None,
              state: str = "S", flags: int = 0, nspid: tuple[int, ...] = ()) -> None:  # fmt: skip
    folder = root / str(pid)
    folder.mkdir(parents=True)
    (folder / "cgroup").write_text(cgroup)
    (folder / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in (environ or {}).items()) + b"\0")
    (folder / "stat").write_text(f"{pid} (a (b) c) {state} 1 {sid or pid} {sid or pid} 0 -1 {flags} 0 0\n")
    (folder / "status").write_text("NSpid:\t" + "\t".join(map(str, (pid, *nspid))) + "\n")


def test_the_launched_process_is_the_session_leader_with_its_marker_in_our_container(tmp_path: Path) -> None:
    ours = f"0::/machine.slice/libpod-{CID}.scope\n"
    fake_proc(tmp_path, 100, cgroup=ours, environ={LAUNCH_VAR: "n1"}, sid=100, nspid=(7,))
    fake_proc(tmp_path, 101, cgroup=ours, environ={LAUNCH_VAR: "n1"}, sid=100, nspid=(8,))  # its child: same marker
    fake_proc(tmp_path, 200, cgroup="0::/user.slice\n", environ={LAUNCH_VAR: "n2"}, sid=200)  # not in the container
    assert find_launched(CID, "n1", tmp_path) == 100
    assert find_launched(CID, "n2", tmp_path) is None, "a process outside our container is never ours"
    assert in_container(CID, 101, tmp_path) and not in_container(CID, 200, tmp_path) and not in_container("", 100,
                                                                                                          tmp_path)
    assert host_pid(CID, 8, tmp_path) == 101 and host_pid(CID, 9, tmp_path) is None  # dscli's PID inside → ours


def test_an_exiting_init_means_the_container_is_dying(tmp_path: Path) -> None:
    fake_proc(tmp_path, 10, cgroup="", state="S")
    fake_proc(tmp_path, 11, cgroup="", state="S", flags=PF_EXITING | 0x400000)  # in its exit path
    fake_proc(tmp_path, 12, cgroup="", state="Z")
    assert init_alive(10, tmp_path)
    assert not init_alive(11, tmp_path) and not init_alive(12, tmp_path) and not init_alive(13, tmp_path)
    assert not init_alive(None, tmp_path)


def test_a_containers_shm_is_swept_by_the_paths_its_processes_see(tmp_path: Path) -> None:
    """From outside, the container's /dev/shm is /proc/<init>/root/dev/shm while its processes map /dev/shm/...:
    a segment is in use when its name, as they see it, is mapped or open."""
    inside = tmp_path / "container-root-dev-shm"  # stands for /proc/<init>/root/dev/shm
    seen = tmp_path / "as-seen"  # stands for the /dev/shm the container's processes see
    inside.mkdir()
    seen.mkdir()
    old = time.time() - 3600
    for name in ("psm_used", "psm_free"):
        (inside / name).write_bytes(b"x" * 1024)
        os.utime(inside / name, (old, old))
    (seen / "psm_used").write_bytes(b"y")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print(1, flush=True);"
                               " time.sleep(60)", str(seen / "psm_used")], stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"1"
        ok, detail = _remove_shm_segments(RemoveShmSegments(shm_dir=inside, seen_as=seen))
    finally:
        holder.kill()
        holder.wait()
    assert ok and "removed 1" in detail and "kept 1 in use: psm_used" in detail
    assert sorted(os.listdir(inside)) == ["psm_used"]


@pytest.mark.parametrize("scope", ["start", "redeploy"])
def test_the_vllm_plan_inside_sweeps_the_containers_shm_or_nothing_while_it_is_down(scope: str) -> None:
    from nodeagent.container.mode import ContainerMode
    from nodeagent.container.plan import ContainerState
    from nodeagent.node.residue_plan import plan_start_cleanup

    cfg = parse_config("node: {name: n1, ip: 127.0.0.1, npus: 0}\nagent: {state_dir: /tmp/x/state}\n"
                       "container: {engine: docker}\n"
                       "components:\n  vllm: {kind: vllm, command: vllm, model: /m, port: 18080}\n")  # fmt: skip
    from nodeagent.container.world import HostContainerWorld

    mode = ContainerMode.__new__(ContainerMode)
    mode.world = HostContainerWorld()
    mode.runs_inside = lambda name: True  # type: ignore[method-assign]
    plan = plan_start_cleanup("vllm", cfg.components["vllm"], cfg, scope=scope, reason="t", records=[], scan=True)
    assert any(isinstance(a, RemoveShmSegments) for a in plan.actions)
    me = os.getpid()
    mode.state, mode.problem = ContainerState(CID, "n", "running", True, "img", pid=me), None
    swept = [a for a in mode.adapt_plan("vllm", plan).actions if isinstance(a, RemoveShmSegments)]
    assert swept and swept[0].shm_dir == Path(f"/proc/{me}/root/dev/shm") and swept[0].seen_as == Path("/dev/shm")
    mode.state = ContainerState(CID, "n", "exited", False, "img", pid=None)
    assert not any(isinstance(a, RemoveShmSegments) for a in mode.adapt_plan("vllm", plan).actions)


def test_exec_and_kv_probes_of_a_component_inside_run_inside(tmp_path: Path) -> None:
    """The guide's probe scripts and the datasystem wheel live in the image: the commands of exec and
    datasystem_kv probes run through the engine's exec for a component inside, on the host for one outside."""
    from nodeagent.node.supervisor import Supervisor
    from nodeagent.probes.resolve import resolve_probe_set

    cfg = parse_config(
        f"node: {{name: n1, ip: 127.0.0.1}}\nagent: {{state_dir: {tmp_path}/state, log_dir: {tmp_path}/logs}}\n"
        "container: {engine: docker, name: dsv4}\ncomponents:\n"
        "  etcd: {kind: etcd, container: false, data_dir: /srv/etcd,\n"
        "         probes: {readiness: [{kind: exec, command: [etcdctl, endpoint, health]}]}}\n"
        "  datasystem: {kind: datasystem, workdir: /srv/yr, liveness_check_path: /srv/yr/liveness,\n"
        "               depends_on: [etcd],\n"
        "               probes: {readiness: [{kind: exec, command: [sh, -c, 'test -e /.dockerenv']},\n"
        "                                    {kind: datasystem_kv}]}}\n", "c.yaml")  # fmt: skip
    sup = Supervisor(cfg, container=ContainerMode)
    assert sup.container is not None
    inside = sup.container.adapt_probes("datasystem", resolve_probe_set(cfg.components["datasystem"], cfg))
    script, kv = inside["readiness"]
    assert script.inside is sup.container.spec and kv.inside is sup.container.spec
    assert kv.python == "python3", "the container's interpreter, where the guide pip-installs the wheel"
    assert [p.inside for p in inside["liveness"]] == [None], "a file probe reads the shared folder from the host"
    assert script.cwd == Path("/srv/yr") and script.inside.exec_argv(script.command, cwd="/srv/yr")[-7:] == (
        "exec", "-w", "/srv/yr", "dsv4", "sh", "-c", "test -e /.dockerenv")
    outside = sup.container.adapt_probes("etcd", resolve_probe_set(cfg.components["etcd"], cfg))
    assert [p.inside for p in outside["readiness"]] == [None]


def test_a_reload_refuses_what_only_an_agent_restart_can_do(tmp_path: Path) -> None:
    """Switching container mode, or moving a component into or out of the container, is refused with the reason
    and nothing of the running config changes."""
    from nodeagent.node.supervisor import Supervisor

    def text(container: str, etcd_inside: bool = False) -> str:
        etcd = "" if etcd_inside else "container: false, "
        return (f"node: {{name: n1, ip: 127.0.0.1}}\nagent: {{state_dir: {tmp_path}/state, log_dir: {tmp_path}/l}}\n"
                f"{container}components:\n  etcd: {{kind: etcd, {etcd}data_dir: /srv/etcd}}\n")

    cfg = parse_config(text("container: {engine: docker, name: dsv4}\n"), "c.yaml")
    sup = Supervisor(cfg, container=ContainerMode)
    with pytest.raises(ValueError, match="cannot switch container mode on or off"):
        sup.reload(parse_config(text(""), "c.yaml"))
    with pytest.raises(ValueError, match="cannot move etcd into or out of the container"):
        sup.reload(parse_config(text("container: {engine: docker, name: dsv4}\n", etcd_inside=True), "c.yaml"))
    with pytest.raises(ValueError, match="cannot move etcd"):
        sup.reload(parse_config(text("container: {engine: docker, name: dsv4}\n", etcd_inside=True), "c.yaml"),
                   restart=False)  # fmt: skip
    assert sup.config is cfg
    staged = sup.reload(parse_config(text("container: {engine: docker, name: dsv4, image: other:1}\n"), "c.yaml"),
                        restart=False)  # fmt: skip
    assert "container" not in staged, "nothing to recreate: the container has not started"
    assert sup.container is not None and not sup.container.started
    assert sup.container.spec.image == "other:1", ("staged before the container starts (an agent restarted "
                                                   "mid-rollout): it is kept, or made, as the staged config says")
    sup.container._wake = asyncio.Event()  # what ContainerMode.start leaves: it keeps a container from now
    staged = sup.reload(parse_config(text("container: {engine: docker, name: dsv4, image: other:2}\n"), "c.yaml"),
                        restart=False)  # fmt: skip
    assert "container" not in staged and sup.container.spec.image == "other:1", "staging leaves a started one as it is"


def test_a_crash_loop_belongs_to_one_stack_run(tmp_path: Path) -> None:
    """The host stack's `crash loop` showed on a brand-new container stack (one state folder for both). It is kept
    across an agent restart of the same stack, and starts afresh when the stack changes: host ↔ container, another
    config section (a reload), a new container."""
    from nodeagent.node.supervisor import Supervisor

    def text(container: bool, etcd_dir: str = "/srv/etcd") -> str:
        where = "container: {engine: docker, name: dsv4}\n" if container else ""
        return (f"node: {{name: n1, ip: 127.0.0.1}}\nagent: {{state_dir: {tmp_path}/state, log_dir: {tmp_path}/l}}\n"
                f"{where}components:\n  etcd: {{kind: etcd, container: false, data_dir: {etcd_dir}}}\n"
                "  datasystem: {kind: datasystem, workdir: /srv/yr, liveness_check_path: /srv/yr/liveness,\n"
                "               depends_on: [etcd]}\n")  # fmt: skip

    def crash_loop(sup: Supervisor, name: str = "datasystem") -> bool:
        return bool(sup.trackers[name].crash_loop)

    def agent(container: bool) -> Supervisor:
        sup = Supervisor(parse_config(text(container), "c.yaml"), container=ContainerMode)
        sup.begin_stack_run()  # as its start does (tests/test_component.py: the rig's start records the runs)
        return sup

    host = agent(False)
    for t in (0.0, 1.0, 2.0):
        host.trackers["datasystem"].record_failure(t, "exit 1")
        host.trackers["etcd"].record_failure(t, "exit 1")
    host.intent_store.save()
    again = agent(False)
    assert crash_loop(again), "an agent restart of the same stack keeps it"
    inside = agent(True)
    assert not crash_loop(inside), "the worker now runs in a container: a new stack run"
    assert crash_loop(inside, "etcd"), "etcd still runs on the host, as it did"
    assert any(e.event == "stack_run" and "(datasystem)" in e.message for e in inside.events.recent)
    inside.trackers["datasystem"].record_failure(3.0, "exit 1")
    inside.trackers["datasystem"].record_failure(4.0, "exit 1")
    assert crash_loop(inside)
    assert inside.container is not None
    inside.container.state = _state("f" * 64)
    assert inside.begin_stack_run(["datasystem"]) == ["datasystem"] and not crash_loop(inside), "a new container"
    inside.trackers["datasystem"].record_failure(5.0, "exit 1")
    inside.trackers["datasystem"].record_failure(6.0, "exit 1")
    inside.reload(parse_config(text(True, "/srv/etcd2"), "c.yaml"))
    assert not crash_loop(inside, "etcd"), "etcd's section changed: a new stack run"
    assert crash_loop(inside), "the worker's section did not change: its run goes on"


def _state(cid: str) -> object:
    from nodeagent.container.plan import ContainerState

    return ContainerState(id=cid, name="dsv4", status="running", running=True, image="i", pid=1)


def test_the_agent_stopping_its_container_records_that_it_did(tmp_path: Path) -> None:
    """`on_stop: stop`: the record says the agent stopped it, so the next agent does not read its `Exited (137)`
    as a death (tests/test_container_plan.py has the plan); the container log says why it reads 137."""
    from types import SimpleNamespace

    from nodeagent.container.mode import ContainerMode
    from nodeagent.container.plan import ContainerRecord

    (tmp_path / "state").mkdir()
    config = parse_config(f"node: {{name: n1, ip: 127.0.0.1}}\ncontainer: {{engine: docker}}\n"
                          f"agent: {{state_dir: {tmp_path / 'state'}, log_dir: {tmp_path / 'logs'}}}\n")  # fmt: skip
    mode = ContainerMode(SimpleNamespace(config=config))
    mode.records.save(ContainerRecord("c" * 64, "f" * 64, "h"))
    stops: list[float] = []

    async def stop(grace_s: float) -> None:
        stops.append(grace_s)

    mode.engine.stop = stop  # type: ignore[method-assign]
    asyncio.run(mode.finish(detach=False))
    record = mode.records.load()
    assert stops == [5.0] and record is not None and record.stopped_by_agent is not None
    assert "Exited (137)" in (tmp_path / "logs" / "container.log").read_text()


def test_a_rank_restart_never_touches_a_healthy_container(tmp_path: Path) -> None:
    """Issue 32 item 4 (the field report vllm-ascend #15195: restarting only the ranks fixed a device-side timeout,
    host and container untouched): while the container's init is alive, a rank's crash (kill -9), a failed probe
    and an operator's restart are the rank's own restart — no hold, no wake of the container's watch, no engine
    call, no death. Only a rank that died with its container is the container's recovery."""
    from dataclasses import replace

    from nodeagent.core.failure import Failure
    from nodeagent.node.supervisor import Supervisor

    (tmp_path / "model").mkdir()
    cfg = parse_config(f"node: {{name: n1, ip: 127.0.0.1}}\nagent: {{state_dir: {tmp_path}/s, log_dir: {tmp_path}/l}}\n"
                       "container: {engine: docker, name: dsv4}\ncomponents:\n"
                       f"  vllm: {{kind: vllm, command: [vllm], model: {tmp_path}/model, port: 44801}}\n")  # fmt: skip
    sup = Supervisor(cfg, container=ContainerMode)
    mode = sup.container
    assert mode is not None and mode.runs_inside("vllm")
    sup.attach(mode)
    mode.state, mode.problem, mode._wake = replace(_state(CID), pid=os.getpid()), None, asyncio.Event()  # alive

    async def touched(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank restart called the container engine")

    for method in ("inspect", "inspect_text", "remove", "stop", "start", "create", "watch"):
        if hasattr(mode.engine, method):
            setattr(mode.engine, method, touched)
    comp = sup.components["vllm"]
    for failure in (Failure("exit", "killed by SIGKILL", code=-9, was_up=True),
                    Failure("liveness", "liveness probe failed 3 times: /health timed out", was_up=True),
                    Failure("startup", "startup probe timed out")):  # fmt: skip
        decision = sup.decide(comp, failure)
        assert decision is not None and decision.action == "restart", failure.detail
        assert mode.problem is None and not mode._wake.is_set() and mode.deaths == 0
    assert mode.command(sup.view(comp), "restart", False, "operator") is None, "an operator's restart: the rank's"
    assert mode.gate(sup.view(comp), True) is None, "nothing holds the relaunch"

    mode.state = replace(mode.state, pid=2**22 + 1)  # its init is gone: died with it
    assert sup.decide(comp, Failure("exit", "killed by SIGKILL", code=-9, was_up=True)) is None, "delegated"
    assert mode.problem is not None and mode._wake.is_set(), "the container's recovery: recreate, setup, redeploy"

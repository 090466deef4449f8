"""The agent in container mode with a real podman (runc): config/local.yaml's stack inside the node's container
(the datasystem worker and the vLLM stand-in; etcd stays on the host with `container: false`).

One agent goes through everything, to keep the run short: the stack up inside (membership checked from the
kernel's cgroups, not from the agent), kill -9 of vLLM's API server inside (its orphaned EngineCore is gone
before the relaunch), a killed exec client (the process stays supervised), kill -9 of the agent (adopted, same
PIDs), a changed run line (a planned recreate), `podman kill` of the container (recreated, setup re-run, a node
redeploy, the stack serving again, the post-mortem with the engine's inspect), SIGTERM (nothing of ours left, the
container removed).

And the section an operator writes first, `container: {engine: podman, image: ..., name: ...}` with nothing else
for this host (no `!` removals, no runtime, no ulimits): the agent adapts the guide's line itself, says so, and the
whole stack, etcd included, runs inside — found by its listening ports, in the container's cgroup.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from conftest import BIN, LocalAgent, proc_cmdline, session_pids, wait_for
from containerhelpers import SKIP_REASON, built_image, local_container_config, podman_docker_api, stack_run_args

pytestmark = [pytest.mark.system, pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def cgroup_has(pid: int, container_id: str) -> bool:
    return container_id in Path(f"/proc/{pid}/cgroup").read_text()


def inspect(name: str) -> dict | None:
    out = subprocess.run(["podman", "inspect", "--type", "container", name], capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    return json.loads(out.stdout)[0] if out.returncode == 0 else None


def environ(pid: int) -> dict[str, str]:
    """A process's environment (one inside the container too: read through the host's /proc)."""
    return psutil.Process(pid).environ()


def engine_cores(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(True) if proc_cmdline(p)[:1] == ["VLLM::EngineCore"]]


@contextlib.contextmanager
def container_agent(tmp_path: Path, prefix: str, **container: Any) -> Iterator[tuple[LocalAgent, str]]:
    """An agent on config/local.yaml's stack in container mode (what scripts/run-local.sh --container runs), the
    container section updated with `container`; its container removed afterwards."""
    home = tmp_path / "home"  # under /tmp: the guide's -v /tmp:/tmp shows it inside at the same path
    home.mkdir()
    name = f"{prefix}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    data = local_container_config(built_image(), home, name)
    data["container"].update(container)
    config = tmp_path / "container.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    local = LocalAgent(home, config)
    local.container_data = data  # type: ignore[attr-defined]
    try:
        yield local, name
    finally:
        local.cleanup()
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[LocalAgent, str]]:
    setup = [["sh", "-c", f"echo setup-ran >> {tmp_path / 'home'}/setup.log"], ["sh", "-c", "echo second step"]]
    with container_agent(tmp_path, "dsv4-sys", on_stop="remove", setup=setup) as out:
        yield out


def test_the_stack_in_a_container(agent: tuple[LocalAgent, str]) -> None:
    local, name = agent
    data = local.container_data  # type: ignore[attr-defined]
    t0 = time.monotonic()
    local.start()
    first = local.wait_all_up(180)
    up_s = time.monotonic() - t0
    cid = inspect(name)["Id"]
    # Membership from the kernel: the worker and vLLM (with its engine) in the container's cgroup, etcd not.
    assert cgroup_has(first["vllm"]["pid"], cid) and cgroup_has(first["datasystem"]["pid"], cid)
    assert not cgroup_has(first["etcd"]["pid"], cid)
    engine = wait_for("EngineCore inside", lambda: engine_cores(first["vllm"]["pid"]))
    assert all(cgroup_has(p, cid) for p in engine)
    assert (local.home / "setup.log").read_text().split() == ["setup-ran"]
    status = local.status()
    assert status["container"]["id"] == cid[:12] and status["container"]["up"]
    assert "second step" in (local.home / "logs" / "container.log").read_text()  # setup output in the logs
    print(f"\ncontainer mode: stack up after {up_s:.1f} s (container created, set up, 3 components)")
    ctl = [str(BIN / "nodeagentctl"), "--config", str(local.config_path)]
    shown = subprocess.run([*ctl, "status"], env=local.env, capture_output=True, text=True, timeout=30).stdout
    assert f"container {name} (podman, " in shown and f"{cid[:12]} up since" in shown
    inside = subprocess.run([*ctl, "shell", "--", "cat", "/proc/1/cmdline"], env=local.env, capture_output=True,
                            text=True, timeout=30)  # fmt: skip
    assert inside.returncode == 0 and inside.stdout.split("\0")[0] == "bash", inside.stderr  # the guide's init
    # the compile caches on the host (issue 32 item 2): the rank's variables point into the image's folder under the
    # agent's state folder, seen inside at the same path (a file put there on the host is read inside)
    cache = Path(environ(first["vllm"]["pid"])["VLLM_CACHE_ROOT"])
    assert cache.parent.parent == local.state_dir / "cache" and cache.is_dir()
    (cache / "torch_compile_cache").mkdir(exist_ok=True)
    (cache / "torch_compile_cache" / "warm.bin").write_bytes(b"compiled once")
    seen = subprocess.run([*ctl, "shell", "--", "cat", str(cache / "torch_compile_cache" / "warm.bin")],
                          env=local.env, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert seen.stdout == "compiled once", seen.stderr

    # kill -9 of vLLM's API server inside: its orphaned EngineCore is gone before the relaunch
    old = first["vllm"]["pid"]
    os.kill(old, signal.SIGKILL)
    t0 = time.monotonic()
    new = wait_for("vllm relaunched", lambda: (p := local.children()["vllm"]["pid"]) != old and p)
    relaunch_s = time.monotonic() - t0
    assert all(gone(p) for p in engine), "the orphaned EngineCore must be stopped before the relaunch"
    assert cgroup_has(new, cid)
    local.wait_all_up()
    print(f"kill -9 of vLLM inside: relaunched after {relaunch_s * 1000:.0f} ms")
    # restart what failed, not what holds it (issue 32 item 4): the same container, no death, the same caches
    assert inspect(name)["Id"] == cid and local.status()["container"]["deaths"] == 0
    assert environ(new)["VLLM_CACHE_ROOT"] == str(cache)
    restart = subprocess.run([*ctl, "restart", "vllm"], env=local.env, capture_output=True, text=True, timeout=120)
    assert restart.returncode == 0, restart.stderr
    new = wait_for("vllm restarted by the operator", lambda: (p := local.children()["vllm"]["pid"]) != new and p)
    local.wait_all_up()
    assert cgroup_has(new, cid) and inspect(name)["Id"] == cid and local.status()["container"]["deaths"] == 0

    # A killed exec client leaves its process running: the agent still supervises it by its host PID
    client = psutil.Process(new).parents()  # the exec'd process's parent is conmon, not the client
    def exec_clients() -> list[psutil.Process]:
        return [p for p in psutil.Process(local.proc.pid).children() if "exec" in proc_cmdline(p)[1:4]
                and any("vllm-standin" in a for a in proc_cmdline(p))]  # fmt: skip

    # the restarted rank's exec client ends with it, a moment after (podman exec waits for conmon's exit status)
    clients = wait_for("one exec client: the new rank's", lambda: c if len(c := exec_clients()) == 1 else None)
    assert len(clients) == 1 and clients[0].pid not in {c.pid for c in client}
    os.kill(clients[0].pid, signal.SIGKILL)
    wait_for("the lost client reported", lambda: "exec client" in local.log() and "still supervised" in local.log())
    assert not gone(new) and local.children()["vllm"]["pid"] == new
    os.kill(new, signal.SIGKILL)  # and its death is still seen
    wait_for("vllm relaunched after its client died", lambda: local.children()["vllm"]["pid"] not in (new, None))
    local.wait_all_up()

    # kill -9 of the agent, start again: adopted, same PIDs, nothing restarted, the container kept
    before = {n: (c["pid"], c["create_time"]) for n, c in local.children().items()}
    os.kill(local.proc.pid, signal.SIGKILL)
    local.proc.wait(10)
    (local.state_dir / "status.json").unlink()
    local.start()
    wait_for("adoption of all three", lambda: local.log().count("adopted running pid") == 3, timeout=60)
    local.wait_all_up()
    assert {n: (c["pid"], c["create_time"]) for n, c in local.children().items()} == before
    assert inspect(name)["Id"] == cid
    assert (local.home / "setup.log").read_text().split() == ["setup-ran"], "setup runs once per container"

    # A changed run line is a planned recreate: the components inside stop first, then start in the new container
    os.kill(local.proc.pid, signal.SIGKILL)
    local.proc.wait(10)
    data["container"]["run_args"].append("-e DSV4_TEST_RECREATE=1")
    local.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    local.start()
    wait_for("the recreated container", lambda: (i := inspect(name)) is not None and i["Id"] != cid, timeout=60)
    recreated = local.wait_all_up(120)
    assert "run line changed" in local.log() and local.status()["node_policy"]["redeploys_total"] == 0
    cid = inspect(name)["Id"]
    assert cgroup_has(recreated["vllm"]["pid"], cid) and recreated["etcd"]["pid"] == before["etcd"][0]
    assert "DSV4_TEST_RECREATE=1" in " ".join(inspect(name)["Config"]["Env"])
    assert (local.home / "setup.log").read_text().split() == ["setup-ran", "setup-ran"], "set up once more"

    # The same through a reload (no agent restart): a planned recreate, nothing counted as a failure
    data["container"]["run_args"].append("-e DSV4_TEST_RELOAD=1")
    local.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    reload = subprocess.run([*ctl, "reload"], env=local.env, capture_output=True, text=True, timeout=60)
    assert reload.returncode == 0, reload.stderr
    wait_for("recreated by the reload", lambda: (i := inspect(name)) is not None and i["Id"] != cid, timeout=60)
    reloaded = local.wait_all_up(120)
    cid = inspect(name)["Id"]
    assert cgroup_has(reloaded["vllm"]["pid"], cid) and reloaded["etcd"]["pid"] == before["etcd"][0]
    assert "DSV4_TEST_RELOAD=1" in " ".join(inspect(name)["Config"]["Env"])
    assert "the run line of the container changed: a planned recreate" in local.log()
    assert local.status()["node_policy"]["redeploys_total"] == 0
    assert (local.home / "setup.log").read_text().split() == ["setup-ran"] * 3

    # podman kill of the container: noticed, recreated, set up again, a node redeploy, serving again
    redeploys = local.status()["node_policy"]["redeploys_total"]
    t0 = time.monotonic()
    subprocess.run(["podman", "kill", name], check=True, capture_output=True, timeout=30)
    wait_for("the death noticed", lambda: local.status()["container"]["deaths"] == 1, timeout=5)
    noticed_s = time.monotonic() - t0
    wait_for("a new container", lambda: (i := inspect(name)) is not None and i["Id"] != cid and i["State"]["Running"])
    after = local.wait_all_up(180)
    recovered_s = time.monotonic() - t0
    new_cid = inspect(name)["Id"]
    assert cgroup_has(after["vllm"]["pid"], new_cid) and cgroup_has(after["datasystem"]["pid"], new_cid)
    # the smallest blast radius: a dead container redeploys what ran inside it, never host etcd (on the master,
    # etcd of every member) — it was stopped and restarted by this redeploy before
    assert after["etcd"]["pid"] == before["etcd"][0], "host etcd keeps its PID across the container's death"
    assert (local.home / "setup.log").read_text().split() == ["setup-ran"] * 4
    # the caches survived the recreate: the new container's rank uses the same host folder, its files there
    assert environ(after["vllm"]["pid"])["VLLM_CACHE_ROOT"] == str(cache)
    seen = subprocess.run([*ctl, "shell", "--", "cat", str(cache / "torch_compile_cache" / "warm.bin")],
                          env=local.env, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert seen.stdout == "compiled once", seen.stderr
    status = local.status()
    assert status["node_policy"]["redeploys_total"] == redeploys + 1
    assert status["container"]["last_death"]["exit_code"] == 137
    bundles = sorted((local.state_dir / "postmortem" / "container").glob("*.tar.gz"))
    with tarfile.open(bundles[-1]) as tar:
        names = {m.name.split("/", 1)[1]: m for m in tar.getmembers()}
        data = json.load(tar.extractfile(names["inspect.json"]))  # type: ignore[arg-type]
        manifest = json.load(tar.extractfile(names["manifest.json"]))  # type: ignore[arg-type]
    assert data[0]["Id"] == cid and data[0]["State"]["ExitCode"] == 137 and manifest["failure"]["exit_code"] == 137
    print(f"podman kill: noticed after {noticed_s * 1000:.0f} ms, stack up again after {recovered_s:.1f} s")

    # SIGTERM: nothing of ours left running, the container removed (on_stop: remove)
    pids = [c["pid"] for c in local.children().values()]
    sids = {c["sid"] for c in local.children().values()}
    assert local.terminate(120) == 0
    assert all(gone(p) for p in pids)
    assert not any(session_pids(s) for s in sids)
    assert inspect(name) is None


@pytest.fixture
def docker_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LocalAgent, str]]:
    """The same agent with `container.engine: docker`: the docker CLI against podman's docker-compatible API (no
    Docker daemon on these machines)."""
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI on PATH (Debian's docker.io ships one)")
    with podman_docker_api() as docker_host:
        monkeypatch.setenv("DOCKER_HOST", docker_host)
        with container_agent(tmp_path, "dsv4-dck", engine="docker", on_stop="remove") as out:
            yield out


def test_the_docker_path_runs_the_stack_too(docker_agent: tuple[LocalAgent, str]) -> None:
    """What differs from podman is only the CLI: the run line, inspect, events and exec go through `docker`."""
    local, name = docker_agent
    t0 = time.monotonic()
    local.start()
    first = local.wait_all_up(180)
    up_s = time.monotonic() - t0
    cid = inspect(name)["Id"]
    assert cgroup_has(first["vllm"]["pid"], cid) and cgroup_has(first["datasystem"]["pid"], cid)
    assert not cgroup_has(first["etcd"]["pid"], cid)
    status = local.status()
    assert status["container"]["engine"] == "docker" and status["container"]["id"] == cid[:12]

    t0 = time.monotonic()
    subprocess.run(["docker", "kill", name], check=True, capture_output=True, timeout=30)
    wait_for("the death noticed", lambda: local.status()["container"]["deaths"] == 1, timeout=5)
    noticed_s = time.monotonic() - t0
    wait_for("a new container", lambda: (i := inspect(name)) is not None and i["Id"] != cid and i["State"]["Running"])
    after = local.wait_all_up(180)
    new_cid = inspect(name)["Id"]
    assert cgroup_has(after["vllm"]["pid"], new_cid) and cgroup_has(after["datasystem"]["pid"], new_cid)
    assert after["etcd"]["pid"] == first["etcd"]["pid"], "host etcd keeps its PID across the container's death"
    print(f"\ndocker path: stack up after {up_s:.1f} s; docker kill noticed after {noticed_s * 1000:.0f} ms, "
          f"serving again after {time.monotonic() - t0:.1f} s")

    pids = [c["pid"] for c in local.children().values()]
    assert local.terminate(120) == 0
    assert all(gone(p) for p in pids) and inspect(name) is None


def listener(port: int) -> int:
    """The PID listening on a TCP port, from the kernel's socket table (not from the agent)."""
    found = [c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port
             and c.pid is not None]  # fmt: skip
    assert found, f"nothing listens on {port}"
    return found[0]


def test_a_section_of_only_engine_image_and_name_runs_the_stack_inside(tmp_path: Path) -> None:
    """No run_args for this host: it has no NPUs (node.npus: 0 in config/local.yaml), podman needs explicit ulimits
    (no CAP_SYS_RESOURCE) and /data is absent — the agent adapts the guide's defaults and says so. The only
    run_args are what the test image needs to find the stack at all (`stack_run_args`): the image is a bare Debian
    userland (scripts/build-test-image.sh), so the venv with etcd, dscli, the datasystem wheel and the stand-in,
    the worktree it is installed from and its interpreter are bind-mounted read-only, and the venv put first on
    PATH; the vllm-ascend image has its stack inside and needs none of that."""
    home = tmp_path / "home"  # under /tmp: the guide's -v /tmp:/tmp shows it inside at the same path
    home.mkdir()
    name = f"dsv4-min-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "local.yaml").read_text())
    data["container"] = {"engine": "podman", "image": built_image(), "name": name, "run_args": stack_run_args()}
    config = tmp_path / "container.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    local = LocalAgent(home, config)
    ctl = [str(BIN / "nodeagentctl"), "--config", str(config)]
    try:
        pre = subprocess.run([*ctl, "preflight", "--json"], env=local.env, capture_output=True, text=True, timeout=120)
        rows = {c["name"]: c for c in json.loads(pre.stdout)["checks"]}
        assert rows["container_devices"]["status"] == "WARN", rows["container_devices"]
        assert "/dev/davinci_manager" in rows["container_devices"]["value"]
        limits = rows["container_ulimits"]
        assert limits["status"] == "WARN" and "--ulimit nofile=" in limits["value"]
        assert rows["container_mounts"]["status"] in ("PASS", "WARN") and rows["container_runtime"]["status"] != "FAIL"
        shown = json.loads(subprocess.run([*ctl, "render", "container", "--json"], env=local.env, capture_output=True,
                                          text=True, timeout=60, check=True).stdout)  # fmt: skip
        assert shown["adapted"] and not any(w.startswith("--device") for w in shown["argv"])

        t0 = time.monotonic()
        local.start()
        local.wait_all_up(180)
        up_s = time.monotonic() - t0
        found = inspect(name)
        assert found is not None and found["State"]["Running"]
        cid = found["Id"]
        ports = {"etcd": local.env["DSV4_ETCD_PORT"], "datasystem": local.env["DSV4_WORKER_PORT"],
                 "vllm": local.env["DSV4_VLLM_PORT"]}  # fmt: skip
        for comp, port in ports.items():
            pid = listener(int(port))
            assert cgroup_has(pid, cid), f"{comp} (pid {pid}, port {port}) is not in container {name}"
        # The line podman ran is the one `render container` printed (plus the agent's folders, when any).
        added = [w for m in shown["agent_mounts"] for w in ("-v", m)]
        assert found["Config"]["CreateCommand"] == [*shown["argv"][:-1], *added, shown["argv"][-1]]
        assert local.status()["container"]["adapted"] == shown["adapted"]
        print(f"\nonly engine/image/name: stack (etcd, worker, stand-in) up inside after {up_s:.1f} s; adapted: "
              + "; ".join(shown["adapted"]))
        assert local.terminate(120) == 0
        assert inspect(name)["State"]["Running"] is False  # on_stop: stop (the default) keeps it for inspection
    finally:
        local.cleanup()
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)

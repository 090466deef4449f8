"""The guide's run line adapted to the host (nodeagent/container/host.py), without processes: facts are values,
and the shell that reads them runs on fixture trees and a fake podman."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nodeagent.config.container import ContainerConfig
from nodeagent.config.container_options import DRIVER_MOUNTS, GUIDE_DEVICES, ZONEINFO, guide_paths
from nodeagent.config.load import parse_config
from nodeagent.container.host import HostFacts, cgroup_mode, hard_limits, has_capability, read_host_facts
from nodeagent.container.render import render_container
from nodeagent.node.hostfacts import Host

IMAGE = "quay.io/ascend/vllm-ascend:v0.20.2rc1"
# Measured on this machine (DESIGN §10): hybrid cgroups whose unified hierarchy has a controller, no
# CAP_SYS_RESOURCE (bit 24 clear), hard limits 20000 files / 96362 processes, kernel.pid_max 32768.
MOUNTS_HYBRID = """tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
MOUNTS_UNIFIED = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n"
MOUNTS_LEGACY = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\ncgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n"
STATUS_NO_SYS_RESOURCE = "Name:\tpython3\nCapPrm:\t000001fffeffffff\nCapEff:\t000001fffeffffff\n"
STATUS_ROOT = "Name:\tpython3\nCapEff:\t000001ffffffffff\n"
LIMITS = """Limit                     Soft Limit           Hard Limit           Units
Max processes             96362                96362                processes
Max open files            1024                 20000                files
"""
DEV_BOX = HostFacts(absent=frozenset([*GUIDE_DEVICES, "/etc/hccn.conf", "/data"]), cgroup="hybrid",
                    unified_controllers=True, default_runtime="runc", runc="/usr/sbin/runc", cap_sys_resource=False,
                    hard_nofile=20000, hard_nproc=96362, pid_max=32768)  # fmt: skip
"""This machine as the facts reader sees it."""


def config(npus: int | None, container: str = "{engine: docker}") -> object:
    node = f", npus: {npus}" if npus is not None else ""
    return parse_config(f"node: {{name: n1, ip: 127.0.0.1{node}}}\ncontainer: {container}\n")


def words(spec: object) -> list[str]:
    return [" ".join(o.words()) for o in spec.options]  # type: ignore[attr-defined]


def test_an_a2_host_as_the_guide_expects_it_changes_nothing() -> None:
    for npus in (0, 8, None):
        spec = render_container(config(npus), facts=HostFacts())
        assert spec.run_argv() == render_container(config(npus)).run_argv()
        assert spec.adaptations == () and spec.create_on_host == ()


def test_a_host_without_npus_drops_the_devices_and_driver_paths_it_lacks() -> None:
    guide = words(render_container(config(0)))
    spec = render_container(config(0), facts=DEV_BOX)
    gone = {f"--device={d}" for d in GUIDE_DEVICES} | {"-v /etc/hccn.conf:/etc/hccn.conf"}
    added = ["--ulimit nofile=20000:20000", "--ulimit nproc=32768:32768"]
    assert words(spec) == [w for w in guide if w not in gone] + added
    assert "-v /data:/data" in words(spec) and spec.create_on_host == ("/data",)
    said = {a.topic: a.text for a in spec.adaptations}
    assert [a.topic for a in spec.adaptations] == ["devices", "mounts", "mounts", "ulimits"]
    assert said["devices"].startswith("dropped --device /dev/davinci_manager, /dev/hisi_hdc, /dev/devmm_svm")
    assert "node.npus: 0" in said["devices"] and "-v /etc/hccn.conf: the Ascend driver" in spec.adaptations[1].text
    assert spec.adaptations[2].text.startswith("/data missing on the host: the agent creates it")
    assert said["ulimits"].startswith("--ulimit nofile=20000:20000 --ulimit nproc=32768:32768: no CAP_SYS_RESOURCE")
    assert spec.global_args == () and "runtime" not in said  # podman's default here is runc already (docker anyway)


def test_an_npu_host_keeps_the_devices_and_driver_paths_it_lacks() -> None:
    """The driver missing on an NPU host is a fault preflight FAILs, not something to adapt away."""
    facts = HostFacts(absent=frozenset([*GUIDE_DEVICES, *DRIVER_MOUNTS, ZONEINFO]))
    for npus in (8, None):
        spec = render_container(config(npus), facts=facts)
        assert all(f"--device={d}" in words(spec) for d in GUIDE_DEVICES)
        assert all(f"-v {p}:{p}" in words(spec) for p in DRIVER_MOUNTS)
        assert f"-v {ZONEINFO}:/etc/localtime" not in words(spec)  # the time zone never blocks a node
        assert [a.topic for a in spec.adaptations] == ["mounts"] and "tzdata" in spec.adaptations[0].text


def test_an_operators_run_args_are_never_altered() -> None:
    section = ("{engine: podman, run_args: ['--device=/dev/davinci_manager:rw', '-v /models:/models', "
               "'--ulimit nofile=4096:4096', '-v /data2:/data']}")  # fmt: skip
    facts = HostFacts(absent=frozenset([*GUIDE_DEVICES, "/models", "/data2"]), cap_sys_resource=False,
                      hard_nofile=20000, hard_nproc=None, pid_max=32768)  # fmt: skip
    spec = render_container(config(0, section), facts=facts)
    assert "--device=/dev/davinci_manager:rw" in words(spec)  # replaced by run_args: the operator's now
    assert "--device=/dev/hisi_hdc" not in words(spec)
    assert "-v /models:/models" in words(spec) and "-v /data2:/data" in words(spec)
    assert spec.create_on_host == ()  # /data2 is the operator's source, not the guide's
    limits = [w for w in words(spec) if w.startswith("--ulimit")]
    assert limits == ["--ulimit nofile=4096:4096", "--ulimit nproc=32768:32768"]  # unlimited nproc: pid_max


CRUN_HOST = HostFacts(cgroup="hybrid", unified_controllers=True, default_runtime="crun", runc="/usr/bin/runc")


def test_podman_with_crun_on_hybrid_cgroups_gets_runc() -> None:
    spec = render_container(config(0, "{engine: podman}"), facts=CRUN_HOST)
    assert spec.run_argv()[:4] == ("podman", "--runtime", "runc", "run")
    assert spec.exec_argv(["true"])[:3] == ("podman", "--runtime", "runc")
    assert "crun refuses this host's hybrid cgroups" in spec.adaptations[0].text


@pytest.mark.parametrize(("section", "facts", "runtime"), [
    ("{engine: podman, runtime: crun}", CRUN_HOST, ("--runtime", "crun")),  # explicit always wins
    ("{engine: docker}", CRUN_HOST, ()),  # dockerd chooses its own runtime (runc)
    ("{engine: podman}", HostFacts(cgroup="hybrid", unified_controllers=False, default_runtime="crun",
                                   runc="/usr/bin/runc"), ()),  # crun accepts hybrid without controllers
    ("{engine: podman}", HostFacts(cgroup="legacy", default_runtime="crun", runc="/usr/bin/runc"), ()),
    ("{engine: podman}", HostFacts(cgroup="hybrid", unified_controllers=True, default_runtime="runc",
                                   runc="/usr/bin/runc"), ()),  # runc already (this machine)
])  # fmt: skip
def test_the_runtime_is_left_alone_otherwise(section: str, facts: HostFacts, runtime: tuple[str, ...]) -> None:
    spec = render_container(config(0, section), facts=facts)
    assert spec.global_args == runtime and not any(a.topic == "runtime" for a in spec.adaptations)


def test_crun_refusing_without_runc_is_a_problem_not_an_adaptation() -> None:
    spec = render_container(config(0, "{engine: podman}"), facts=HostFacts(
        cgroup="hybrid", unified_controllers=True, default_runtime="crun", runc=None))  # fmt: skip
    assert spec.global_args == () and "runc is not installed" in spec.problems[0].text


def test_reading_the_facts() -> None:
    assert cgroup_mode(MOUNTS_HYBRID) == "hybrid" and cgroup_mode(MOUNTS_UNIFIED) == "unified"
    assert cgroup_mode(MOUNTS_LEGACY) == "legacy" and cgroup_mode("") == "unified"
    assert has_capability(STATUS_NO_SYS_RESOURCE, 24) is False and has_capability(STATUS_ROOT, 24) is True
    assert has_capability("Name: x\n", 24) is None
    assert hard_limits(LIMITS) == {"nofile": 20000, "nproc": 96362}
    assert hard_limits("Max processes             unlimited            unlimited            processes\n") == {
        "nproc": None}  # fmt: skip


def fake_podman(bin_dir: Path, runtime: str, calls: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "podman").write_text(f"#!{sys.executable}\nimport sys\nopen({str(calls)!r}, 'a').write(' '.join("
                                    f"sys.argv[1:]) + '\\n')\nprint({runtime!r})\n")  # fmt: skip
    (bin_dir / "podman").chmod(0o755)


def host_tree(root: Path, mounts: str, controllers: str, status: str = STATUS_NO_SYS_RESOURCE) -> Host:
    for rel, text in (("proc/self/mounts", mounts), ("proc/self/status", status), ("proc/self/limits", LIMITS),
                      ("proc/sys/kernel/pid_max", "32768\n"), ("sys/fs/cgroup/unified/cgroup.controllers", controllers),
                      ("usr/sbin/runc", ""), ("dev/davinci_manager", ""), ("tmp/.keep", "")):  # fmt: skip
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return Host(root=root, path=str(root / "bin"))


def test_the_shell_reads_once_and_asks_podman_only_when_it_matters(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    host = host_tree(tmp_path / "root", MOUNTS_HYBRID, "hugetlb\n")
    fake_podman(tmp_path / "root" / "bin", "crun", calls)
    facts = read_host_facts(ContainerConfig(engine="podman"), "podman", host)
    assert calls.read_text() == "info --format {{.Host.OCIRuntime.Name}}\n"
    assert (facts.cgroup, facts.unified_controllers, facts.default_runtime) == ("hybrid", True, "crun")
    assert facts.runc == "/usr/sbin/runc" and facts.cap_sys_resource is False
    assert (facts.hard_nofile, facts.hard_nproc, facts.pid_max) == (20000, 96362, 32768)
    assert facts.absent == frozenset(guide_paths()) - {"/dev/davinci_manager", "/tmp"}
    calls.unlink()
    for section, engine in ((ContainerConfig(engine="podman", runtime="runc"), "podman"),
                            (ContainerConfig(engine="docker"), "docker")):  # fmt: skip
        assert read_host_facts(section, engine, host).default_runtime is None
    unified = host_tree(tmp_path / "root2", MOUNTS_UNIFIED, "cpu io memory pids\n", STATUS_ROOT)
    fake_podman(tmp_path / "root2" / "bin", "crun", calls)
    facts = read_host_facts(ContainerConfig(engine="podman"), "podman", unified)
    assert facts.default_runtime is None and facts.cap_sys_resource is True
    assert not calls.exists(), "no podman info where the cgroups cannot make crun fail"

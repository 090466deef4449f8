"""Preflight in container mode, on a fixture tree (devices, mounts, /proc) and a recording fake engine on PATH."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nodeagent.config.load import parse_config
from nodeagent.layers.preflight import FAIL, PASS, SKIP, WARN, run_preflight
from nodeagent.layers.preflight_container import check_container
from nodeagent.node.hostfacts import Host

GUIDE_FILES = ("usr/local/Ascend/driver/", "usr/local/dcmi/", "usr/local/bin/npu-smi", "etc/ascend_install.info",
               "usr/local/sbin/", "etc/hccn.conf", "home/", "mnt/", "tmp/", "data/", "usr/share/zoneinfo/Asia/Shanghai",
               "dev/davinci_manager", "dev/hisi_hdc", "dev/devmm_svm")  # fmt: skip


class Tree:
    def __init__(self, root: Path) -> None:
        self.root = root
        for rel in GUIDE_FILES:
            path = root / rel
            if rel.endswith("/"):
                path.mkdir(parents=True, exist_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
        (root / "proc").mkdir()
        self.bin = root / "fakebin"
        self.bin.mkdir()
        # The engine answers `version`, `info` unless told it is down, `image inspect` when the image was "pulled".
        (self.bin / "docker").write_text(f"#!{sys.executable}\nimport os, sys\nroot = {str(root)!r}\n"
                                         "a = sys.argv[1:]\n"
                                         "if a[0] == 'version': print('27.5.1'); sys.exit(0)\n"
                                         "if a[0] == 'info': sys.exit(1 if os.path.exists(root + '/down') else 0)\n"
                                         "if a[:2] == ['image', 'inspect']:\n"
                                         "    sys.exit(0 if os.path.exists(root + '/pulled') else 1)\n"
                                         "sys.exit(2)\n")  # fmt: skip
        (self.bin / "docker").chmod(0o755)

    def host(self) -> Host:
        return Host(root=self.root, path=str(self.bin))

    def process(self, pid: int, *argv: str) -> None:
        (self.root / "proc" / str(pid)).mkdir()
        (self.root / "proc" / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def config(container: str = "{engine: docker}", workdir: str | None = None, npus: int = 0) -> object:
    ds = f", workdir: {workdir}" if workdir else ""
    return parse_config(f"node: {{name: n1, ip: 127.0.0.1, npus: {npus}}}\n"
                        f"container: {container}\n"
                        "components:\n"
                        "  etcd: {kind: etcd, command: /nonexistent/etcd, container: false}\n"
                        f"  datasystem: {{kind: datasystem, command: /nonexistent/dscli{ds}}}\n")  # fmt: skip


def checks(cfg: object, host: Host) -> dict[str, tuple[str, str, str, str]]:
    return {c[0]: c for c in check_container(cfg, host)}  # type: ignore[arg-type]


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path / "root")


def test_a_ready_host_passes_and_the_image_is_pulled_first(tree: Tree) -> None:
    (tree.root / "pulled").touch()
    found = checks(config(workdir="/tmp/yr"), tree.host())
    assert {k: v[1] for k, v in found.items()} == {
        "container_engine": PASS, "container_image": PASS, "container_devices": PASS, "container_mounts": PASS,
        "container_runtime": PASS, "container_ulimits": PASS, "dscli_workdir": PASS,
        "container_manager": PASS}  # fmt: skip
    assert found["container_runtime"][2] == "docker's default runtime"
    assert found["container_engine"][2] == "docker 27.5.1 answers"
    (tree.root / "pulled").unlink()
    image = checks(config(), tree.host())["container_image"]
    assert image[1] == WARN and image[3].startswith("docker pull quay.io/ascend/vllm-ascend:v0.20.2rc1")


def test_an_engine_that_does_not_answer_fails(tree: Tree) -> None:
    (tree.root / "down").touch()
    found = checks(config(), tree.host())
    assert found["container_engine"][1] == FAIL and "does not answer" in found["container_engine"][2]
    assert found["container_engine"][3] == "systemctl start docker" and "container_image" not in found
    missing = checks(config("{engine: podman}"), tree.host())["container_engine"]
    assert missing[1] == FAIL and missing[2] == "podman not found on PATH"


def test_an_npu_host_missing_devices_and_mount_sources_fails_with_the_run_args_that_drop_them(tree: Tree) -> None:
    (tree.root / "dev" / "hisi_hdc").unlink()
    (tree.root / "etc" / "hccn.conf").unlink()
    found = checks(config(npus=8), tree.host())
    assert found["container_devices"][1] == FAIL and found["container_devices"][2].endswith("/dev/hisi_hdc")
    hint = found["container_devices"][3]
    assert "'!--device=/dev/hisi_hdc'" in hint and "node.npus: 0" in hint
    assert found["container_mounts"][1] == FAIL and "/etc/hccn.conf" in found["container_mounts"][2]
    assert "'!-v /etc/hccn.conf'" in found["container_mounts"][3]
    fixed = checks(config("{engine: docker, run_args: ['!--device=/dev/hisi_hdc', '!-v /etc/hccn.conf']}", npus=8),
                   tree.host())  # fmt: skip
    assert fixed["container_devices"][1] == PASS and fixed["container_mounts"][1] == PASS


def test_a_host_without_npus_warns_naming_what_the_line_leaves_out(tree: Tree) -> None:
    for rel in ("dev/hisi_hdc", "dev/davinci_manager", "etc/hccn.conf", "usr/share/zoneinfo/Asia/Shanghai"):
        (tree.root / rel).unlink()
    (tree.root / "data").rmdir()
    found = checks(config(), tree.host())
    devices, mounts = found["container_devices"], found["container_mounts"]
    assert devices[1] == WARN and devices[2].startswith("dropped --device /dev/davinci_manager, /dev/hisi_hdc:")
    assert mounts[1] == WARN and "dropped -v /etc/hccn.conf" in mounts[2] and "keeps its image's time zone" in mounts[2]
    assert "/data missing on the host: the agent creates it" in mounts[2]
    # an operator's own device that is missing still fails: run_args are never adapted
    own = checks(config("{engine: docker, run_args: ['--device=/dev/davinci3']}"), tree.host())["container_devices"]
    assert own[1] == FAIL and own[2] == "missing on the host: /dev/davinci3"


def hybrid_podman(tree: Tree, runtime: str, runc: bool = True) -> None:
    """This machine's kind of host: hybrid cgroups with a controller in cgroup2, no CAP_SYS_RESOURCE."""
    for rel, text in (("proc/self/mounts", "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n"
                                           "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"),
                      ("sys/fs/cgroup/unified/cgroup.controllers", "hugetlb\n"),
                      ("proc/self/status", "CapEff:\t000001fffeffffff\n"),
                      ("proc/self/limits", "Max processes             96362                96362          processes\n"
                                           "Max open files            20000                20000          files\n"),
                      ("proc/sys/kernel/pid_max", "32768\n")):  # fmt: skip
        (tree.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree.root / rel).write_text(text)
    if runc:
        (tree.root / "usr" / "bin").mkdir(parents=True, exist_ok=True)
        (tree.root / "usr" / "bin" / "runc").touch()
    (tree.bin / "podman").write_text(f"#!{sys.executable}\nimport sys\na = sys.argv[1:]\n"
                                     "a = a[2:] if a[0] == '--runtime' else a\n"
                                     "if a[:1] == ['info'] and 'OCIRuntime' in a[-1]:\n"
                                     f"    print({runtime!r})\n"
                                     "sys.exit(0 if a[0] in ('version', 'info', 'image') else 2)\n")  # fmt: skip
    (tree.bin / "podman").chmod(0o755)


def test_runtime_and_rlimits_adapted_to_the_host_are_said(tree: Tree) -> None:
    hybrid_podman(tree, "crun")
    found = checks(config("{engine: podman}"), tree.host())
    assert found["container_runtime"][1] == WARN and found["container_runtime"][2].startswith("--runtime runc: ")
    limits = found["container_ulimits"]
    assert limits[1] == WARN and limits[2].startswith("--ulimit nofile=20000:20000 --ulimit nproc=32768:32768: no CAP")
    explicit = checks(config("{engine: podman, runtime: crun, run_args: ['--ulimit nofile=1024:1024', "
                             "'--ulimit nproc=512:512']}"), tree.host())  # fmt: skip
    assert explicit["container_runtime"][1:3] == (PASS, "crun (configured)")
    assert explicit["container_ulimits"][1:3] == (PASS, "--ulimit nofile=1024:1024, --ulimit nproc=512:512 (run_args)")
    hybrid_podman(tree, "runc")
    assert checks(config("{engine: podman}"), tree.host())["container_runtime"][1:3] == (PASS, "podman's default "
                                                                                        "runtime")  # fmt: skip


def test_crun_refusing_the_cgroups_without_runc_fails(tree: Tree) -> None:
    hybrid_podman(tree, "crun", runc=False)
    found = checks(config("{engine: podman}"), Host(root=tree.root, path=str(tree.bin)))["container_runtime"]
    assert found[1] == FAIL and "runc is not installed" in found[2] and "apt-get install runc" in found[3]


def test_dscli_on_a_bind_mount_warns_with_the_faq_fix(tree: Tree) -> None:
    found = checks(config(workdir="/data/yr"), tree.host())["dscli_workdir"]
    assert found[1] == WARN and "exits 255" in found[2] and "FAQ §2" in found[2] and "/tmp/" in found[3]
    assert checks(config(workdir="/tmp/yr"), tree.host())["dscli_workdir"][1] == PASS
    assert checks(config(workdir="/opt/yr"), tree.host())["dscli_workdir"][1] == PASS  # inside the image


def test_mindcluster_container_manager_fails_unless_they_coexist(tree: Tree) -> None:
    tree.process(4242, "/usr/local/bin/container-manager", "run", "-ctrStrategy=ringRecover")
    found = checks(config(), tree.host())["container_manager"]
    assert found[1] == FAIL and "pid 4242" in found[2] and "coexist_with_container_manager" in found[3]
    assert checks(config("{engine: docker, coexist_with_container_manager: true}"),
                  tree.host())["container_manager"][1] == WARN  # fmt: skip


def test_programs_inside_are_the_images_and_host_mode_skips(tree: Tree) -> None:
    report = {c.name: c for c in run_preflight(config(), tree.host()).checks}  # type: ignore[arg-type]
    assert report["etcd"].status == FAIL, "etcd runs on the host (container: false): its program must be there"
    assert report["dscli"].status == SKIP, "dscli runs inside: the image has it, not the host"
    host_mode = parse_config("node: {name: n1, ip: 127.0.0.1}\n")
    assert [c[1] for c in check_container(host_mode, tree.host())] == [SKIP]


@pytest.mark.parametrize(("file", "node"), [("dsv4-flash-a2.yaml", None), ("dsv4-flash-a2-8node.yaml", "a2-5")])
def test_the_shipped_configs_container_passes_on_a_ready_host(tree: Tree, file: str, node: str | None) -> None:
    """issue 31: the shipped files run the guide's container; on a host as the guide expects it (its devices and
    mount sources, the image pulled) their container rows warn nothing the file could fix."""
    from nodeagent.config.load import load_config

    (tree.root / "pulled").touch()
    cfg = load_config(Path(__file__).resolve().parents[1] / "config" / file, node=node)
    found = checks(cfg, tree.host())
    assert {k: v[1] for k, v in found.items() if v[1] != PASS} == {}, found

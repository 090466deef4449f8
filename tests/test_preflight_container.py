"""Preflight in container mode, on a fixture tree (devices, mounts, /proc) and a recording fake engine on PATH."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nodeagent.config import parse_config
from nodeagent.hostfacts import Host
from nodeagent.preflight import FAIL, PASS, SKIP, WARN, run_preflight
from nodeagent.preflight_container import check_container

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


def config(container: str = "{engine: docker}", workdir: str | None = None) -> object:
    ds = f", workdir: {workdir}" if workdir else ""
    return parse_config("node: {name: n1, ip: 127.0.0.1, npus: 0}\n"
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
        "dscli_workdir": PASS, "container_manager": PASS}  # fmt: skip
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


def test_missing_devices_and_mount_sources_fail_with_the_run_args_that_drop_them(tree: Tree) -> None:
    (tree.root / "dev" / "hisi_hdc").unlink()
    (tree.root / "etc" / "hccn.conf").unlink()
    found = checks(config(), tree.host())
    assert found["container_devices"][1] == FAIL and found["container_devices"][2].endswith("/dev/hisi_hdc")
    assert "'!--device=/dev/hisi_hdc'" in found["container_devices"][3]
    assert found["container_mounts"][1] == FAIL and "/etc/hccn.conf" in found["container_mounts"][2]
    assert "'!-v /etc/hccn.conf'" in found["container_mounts"][3]
    fixed = checks(config("{engine: docker, run_args: ['!--device=/dev/hisi_hdc', '!-v /etc/hccn.conf']}"),
                   tree.host())  # fmt: skip
    assert fixed["container_devices"][1] == PASS and fixed["container_mounts"][1] == PASS


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

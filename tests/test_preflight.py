"""Preflight on fixture trees (a healthy A2 host and its broken variants), on this machine, and through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ascend_fake import FAKE_BIN, FakeAscend
from conftest import free_port

from nodeagent.config.load import load_config
from nodeagent.core.process import record_of
from nodeagent.core.statefile import StateStore
from nodeagent.layers.preflight import FAIL, PASS, SKIP, WARN, PreflightReport, run_preflight
from nodeagent.node.hostfacts import Host, parse_version, version_at_least
from nodeagent.vllm.weights import check_weights

ROOT = Path(__file__).resolve().parents[1]
A2_TREE = Path(__file__).resolve().parent / "fixtures" / "hosts" / "doc-a2"
VENV_BIN = Path(sys.executable).parent
NODE_IP = "10.20.30.40"


class FixtureHost(Host):
    """The fixture tree, plus what a tree cannot hold: NICs, /dev/shm's size and the free space of a healthy
    host's disks (the test machine's own may be short: CI's had 12 GiB free, under 3x what the logs want)."""

    nics: dict[str, list[str]] = {"lo": ["127.0.0.1"], "enp61s0f2": [NODE_IP]}  # noqa: RUF012
    shm_bytes = 800 * 2**30
    disk_bytes = 2 * 2**40

    def nic_addresses(self) -> dict[str, list[str]]:
        return self.nics

    def fs_space(self, path: Path) -> tuple[int, int] | None:
        if str(path) == "/dev/shm":
            return self.shm_bytes, self.shm_bytes
        return None if super().fs_space(path) is None else (self.disk_bytes, self.disk_bytes)


def write_safetensors(path: Path, tensors: dict[str, int]) -> None:
    """A real safetensors file: u64 header length, JSON header with data_offsets, the data."""
    header, offset = {}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x01" * offset)


def make_model(folder: Path, shards: int = 3) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["DeepseekV4ForCausalLM"]}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    weight_map = {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        write_safetensors(folder / name, {f"layer.{i}.a": 4096, f"layer.{i}.b": 1000})
        weight_map |= {f"layer.{i}.a": name, f"layer.{i}.b": name}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                     "weight_map": weight_map}))  # fmt: skip
    return folder


class A2:
    """A healthy Atlas 800I A2 host in tmp_path: the fixture tree, fake npu-smi/hccn_tool/getconf, the venv's
    etcd/dscli, a `vllm` console script on the venv's Python, a complete model, and the guide's config."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = tmp / "root"
        shutil.copytree(A2_TREE, self.root)
        self.bin = tmp / "bin"
        self.bin.mkdir()
        for name in ("npu-smi", "hccn_tool"):
            (self.bin / name).symlink_to(FAKE_BIN / name)
        for name in ("etcd", "etcdctl", "dscli"):
            (self.bin / name).symlink_to(VENV_BIN / name)
        self.set_page_size(4096)
        vllm = self.bin / "vllm"
        vllm.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(0)\n")
        vllm.chmod(0o755)
        self.fake = FakeAscend(tmp / "ascend")
        self.model_path = "/mnt/cephfs/models/DeepSeek-V4-Flash-w8a8-mtp"  # the guide's, inside the tree
        self.model = make_model(self.root / self.model_path.lstrip("/"))
        self.config_data = yaml.safe_load((ROOT / "config" / "dsv4-flash-a2.yaml").read_text())
        self.config_data["node"] |= {"name": "a2-0", "ip": NODE_IP}
        self.config_data.pop("container")  # the host's checks; tests/test_preflight_container.py has the container's
        self.config_data["cluster"]["etcd_endpoints"] = [f"{NODE_IP}:2379"]
        self.config_data["agent"] = {"state_dir": str(tmp / "state"), "log_dir": str(tmp / "logs"),
                                     "api": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(tmp / "tok")},
                                     "residue_roots": [str(tmp)]}  # fmt: skip
        comps = self.config_data["components"]
        comps["etcd"] |= {"client_port": free_port(), "peer_port": free_port(), "data_dir": str(tmp / "etcd")}
        comps["datasystem"] |= {"workdir": str(tmp / "yr"), "worker_port": free_port(),
                                "liveness_check_path": str(tmp / "liveness"), "enable_huge_tlb": True,
                                "arena_per_tenant": 1}  # fmt: skip
        comps["vllm"] |= {"port": free_port()}

    def set_page_size(self, size: int) -> None:
        getconf = self.bin / "getconf"
        getconf.write_text(f'#!/bin/sh\n[ "$1" = PAGE_SIZE ] && echo {size}\n')
        getconf.chmod(0o755)

    def write(self, relative: str, text: str) -> None:
        (self.root / relative).write_text(text)

    def host(self) -> FixtureHost:
        return FixtureHost(root=self.root, path=str(self.bin), arch="aarch64", npu=self.fake.tools())

    def preflight(self, peers: Any = None, **components: dict[str, Any]) -> PreflightReport:
        for name, changes in components.items():
            self.config_data["components"][name] |= changes
        path = self.tmp / "config.yaml"
        path.write_text(yaml.safe_dump(self.config_data, sort_keys=False))
        return run_preflight(load_config(path), self.host(), peers)


def by_name(report: PreflightReport) -> dict[str, Any]:
    return {c.name: c for c in report.checks}


@pytest.fixture
def a2(tmp_path: Path) -> A2:
    return A2(tmp_path)


def test_healthy_a2_host_passes(a2: A2) -> None:
    report = a2.preflight()
    checks = by_name(report)
    assert report.ok and not report.warnings, report.format()
    assert checks["npus"].value == "8 of 8 NPUs (910B3; HBM 64 GB)"
    assert checks["cann"].value.startswith("8.5.0 (/usr/local/Ascend/cann/aarch64-linux/")
    assert checks["hdk"].value.startswith("25.5.0") and "need >= 25.2.3" in checks["hdk"].value
    assert checks["huge_pages"].value == "256000 x 2048 kB = 512,000 MB (512,000 MB free) for 512,000 MB"
    assert checks["model"].value.endswith("3 shards, 0.0 GB, complete")
    assert checks["yr_import"].status == PASS, "the venv's Python has yr.datasystem"
    assert checks["nic"].value == f"enp61s0f2 carries {NODE_IP}"
    assert {c.status for c in report.checks} <= {PASS, SKIP}
    assert [c.name for c in report.checks if c.status == SKIP] == ["memory", "dev_shm", "clock_skew", "container"]


def test_disk_space_short_of_the_logs_warns_then_fails(a2: A2, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logs want log_max_bytes x (log_keep + 1) per component: WARN under 3x that, FAIL under it."""
    checks = by_name(a2.preflight())
    want = float(checks["disk_logs"].value.split("want ")[1].split(" GiB")[0]) * 2**30
    monkeypatch.setattr(FixtureHost, "disk_bytes", int(2 * want))
    checks = by_name(a2.preflight())
    assert checks["disk_logs"].status == WARN and checks["disk_state"].status == WARN
    assert "point agent.log_dir/state_dir elsewhere" in checks["disk_logs"].hint
    monkeypatch.setattr(FixtureHost, "disk_bytes", int(want / 2))
    assert by_name(a2.preflight())["disk_logs"].status == FAIL


def test_64k_pages_warn(a2: A2) -> None:
    a2.set_page_size(65536)
    check = by_name(a2.preflight())["page_size"]
    assert (check.status, check.value) == (WARN, "65536 (64 KB pages)")
    assert "built for 64 KB pages" in check.hint


def test_enable_huge_tlb_without_huge_pages_fails(a2: A2) -> None:
    meminfo = (A2_TREE / "proc" / "meminfo").read_text()
    a2.write("proc/meminfo", meminfo.replace("HugePages_Total:   256000", "HugePages_Total:        0")
             .replace("HugePages_Free:    256000", "HugePages_Free:         0"))  # fmt: skip
    check = by_name(a2.preflight())["huge_pages"]
    assert check.status == FAIL and check.value.startswith("0 x 2048 kB = 0 MB")
    assert check.hint.startswith("echo 256000 > /proc/sys/vm/nr_hugepages")
    a2.write("proc/meminfo", meminfo.replace("HugePages_Total:   256000", "HugePages_Total:   250000"))
    assert by_name(a2.preflight())["huge_pages"].status == WARN, "the guide's 250000 pages cover 500,000 MB"


def test_without_huge_tlb_the_guide_asks_for_it_and_memory_is_measured(a2: A2) -> None:
    report = a2.preflight(datasystem={"enable_huge_tlb": None})
    checks = by_name(report)
    assert checks["huge_pages"].status == WARN and "> 21 GB without enable_huge_tlb" in checks["huge_pages"].value
    assert checks["memory"].status == PASS and checks["dev_shm"].status == PASS
    a2.config_data["components"]["datasystem"]["shared_memory_size_mb"] = 2_000_000
    assert by_name(a2.preflight())["memory"].status == FAIL


def test_truncated_and_missing_shards_fail(a2: A2) -> None:
    shard = a2.model / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    check = by_name(a2.preflight())["model"]
    assert check.status == FAIL
    assert check.value == (f"{a2.model_path}: model-00002-of-00003.safetensors: {len(data) - 100} bytes of "
                           f"{len(data)} bytes (truncated download)")  # fmt: skip
    (a2.model / "model-00003-of-00003.safetensors").unlink()
    report = check_weights(a2.model)
    assert report.problems[-1] == "1 of 3 shards missing: model-00003-of-00003.safetensors"
    shard.write_bytes(data[:20])
    assert "truncated inside its header" in check_weights(a2.model).problems[0]
    (a2.model / "tokenizer.json").unlink()
    assert "no tokenizer (tokenizer.json or tokenizer.model)" in check_weights(a2.model).problems


def test_old_hdk_with_rh2d_fails_and_without_passes(a2: A2) -> None:
    a2.write("usr/local/Ascend/driver/version.info", "Version=25.2.3\npackage_version=25.2.3\n")
    assert by_name(a2.preflight())["hdk"].status == PASS, "25.2.3 is enough without RH2D"
    check = by_name(a2.preflight(datasystem={"remote_h2d_device_ids": list(range(8))}))["hdk"]
    assert check.status == FAIL
    assert check.value == ("25.2.3 (/usr/local/Ascend/driver/version.info; need >= 25.5.0 (RH2D is on: "
                           "remote_h2d_device_ids))")  # fmt: skip
    assert "turn RH2D off" in check.hint


def test_sick_npus_fail(a2: A2) -> None:
    a2.fake.set({"npus": 8, "missing": [5], "chips": {"3": {"health": "Critical"}}, "links": {"6": "DOWN"},
                 "processes": [{"npu": 4, "pid": 1, "name": "python3", "memory_mb": 30210}]})  # fmt: skip
    checks = by_name(a2.preflight())
    assert (checks["npus"].status, checks["npus"].value) == (FAIL, "7 of 8 NPUs (910B3; HBM 64 GB); npu 5 missing")
    assert (checks["npu_health"].status, checks["npu_health"].value) == (FAIL, "npu 3 Critical")
    assert checks["npu_processes"].status == FAIL and "npu 4 pid 1 python3 30210 MB" in checks["npu_processes"].value
    assert (checks["roce"].status, checks["roce"].value) == (WARN, "link DOWN on npu 6")


def test_cann_too_old_and_missing(a2: A2) -> None:
    a2.write("usr/local/Ascend/cann/aarch64-linux/ascend_toolkit_install.info", "version=8.0.RC3\n")
    assert by_name(a2.preflight())["cann"].status == FAIL
    shutil.rmtree(a2.root / "usr/local/Ascend/cann")
    assert by_name(a2.preflight())["cann"].value == "CANN toolkit not found (no ascend_toolkit_install.info)"


def test_ports_held_by_a_stranger_fail_held_by_our_child_pass(a2: A2, listener: subprocess.Popen[bytes]) -> None:
    port = listener.port  # type: ignore[attr-defined]
    check = by_name(a2.preflight(vllm={"port": port}))["ports"]
    assert check.status == FAIL and f"{port} (vllm) held by pid {listener.pid}" in check.value
    StateStore(a2.tmp / "state").save_children({"vllm": record_of(listener.pid).to_dict()})
    check = by_name(a2.preflight())["ports"]
    assert check.status == PASS and f"or held by our own components ({port} (vllm, ours))" in check.value


def test_peers_seed_and_clock_skew(a2: A2) -> None:
    now = a2.host().now()
    peers = [{"name": "a2-1", "pythonhashseed": "0", "wall_clock": now + 0.2, "observed_at": now},
             {"name": "a2-2", "pythonhashseed": 0, "wall_clock": now - 3.0, "observed_at": now}]  # fmt: skip
    checks = by_name(a2.preflight(peers))
    assert (checks["pythonhashseed"].status, checks["pythonhashseed"].value) == (PASS, "0, equal on 2 peers")
    assert (checks["clock_skew"].status, checks["clock_skew"].value) == (WARN, "max -3.00s (a2-2) over 2 peers")
    peers[1] |= {"pythonhashseed": "random", "wall_clock": now + 40}
    checks = by_name(a2.preflight(peers))
    assert checks["pythonhashseed"].status == FAIL and "a2-2: 'random'" in checks["pythonhashseed"].value
    assert checks["clock_skew"].status == FAIL
    a2.config_data["components"]["vllm"]["env"] = {"PYTHONHASHSEED": "42"}
    assert by_name(a2.preflight())["pythonhashseed"].value == "vllm: '42'"


def test_nic_that_does_not_carry_node_ip_fails(a2: A2) -> None:
    a2.config_data["node"]["nic_name"] = "lo"
    checks = by_name(a2.preflight())
    assert checks["nic"].status == FAIL and checks["nic"].value == f"lo does not carry {NODE_IP} (127.0.0.1)"
    a2.config_data["node"]["ip"] = "10.9.9.9"
    assert by_name(a2.preflight())["node_ip"].status == FAIL


def test_a_crashing_check_is_a_fail_not_a_crash(a2: A2, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: Host) -> dict[str, int]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(FixtureHost, "meminfo", boom)
    check = by_name(a2.preflight())["memory"]
    assert check.status == FAIL and "the check crashed: OSError" in check.value


def test_versions() -> None:
    assert parse_version("24.1.rc2") < parse_version("24.1.0") < parse_version("24.1.1")  # type: ignore[operator]
    assert version_at_least("25.5.0", "25.5.0") and version_at_least("25.5.1", "25.5.0")
    assert not version_at_least("25.5.rc1", "25.5.0") and not version_at_least("8.0.RC3", "8.5.0")
    assert version_at_least("25.2.3.10", "25.2.3") and version_at_least("8.5", "8.5.0")
    assert version_at_least("7.0.T10", "7.0.0") is False and version_at_least("v?", "1") is None


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DSV4_AGENT_HOME": str(home), "PATH": f"{VENV_BIN}:/usr/bin:/bin"}
    return subprocess.run([str(VENV_BIN / "nodeagentctl"), "preflight", *args], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip


@pytest.mark.skipif(shutil.which("npu-smi") or Path("/usr/local/bin/npu-smi").exists(), reason="a real NPU host")
@pytest.mark.usefixtures("fixed_ports")  # config/local.yaml's ports checked free
def test_cli_on_this_machine(tmp_path: Path) -> None:
    local = _cli("--config", str(ROOT / "config" / "local.yaml"), home=tmp_path)
    assert local.returncode == 0, local.stdout + local.stderr
    assert "SKIP  npus" in local.stdout and "npu-smi not found" in local.stdout
    assert ", 0 FAIL," in local.stdout.rstrip().splitlines()[-1]
    guide = _cli("--config", str(ROOT / "config" / "dsv4-flash-a2.yaml"), "--json", home=tmp_path)
    assert guide.returncode == 1, guide.stderr
    data = json.loads(guide.stdout)
    failed = {c["name"]: c for c in data["checks"] if c["status"] == FAIL}
    assert {"npus", "model", "hdk", "cann"} <= set(failed)
    assert failed["npus"]["value"] == "npu-smi not found; this config expects 8 NPUs" and failed["npus"]["hint"]
    assert "does not exist" in failed["model"]["value"]
    bad = _cli("--config", str(tmp_path / "nope.yaml"), home=tmp_path)
    assert bad.returncode == 78 and "nope.yaml" in bad.stderr


def test_a_members_rows_name_it_and_its_ranks(a2: A2) -> None:
    """One host checks every member of a cluster file (`preflight --node`): the report says which member and
    ranks it is about, and each rank's row is named, not eight identical `vllm` rows."""
    data = yaml.safe_load((ROOT / "config" / "dsv4-flash-a2-8node.yaml").read_text())
    data["components"]["vllm"]["model"] = a2.model_path
    path = a2.tmp / "eight.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    report = run_preflight(load_config(path, node="a2-5"), a2.host())
    assert report.about == "node a2-5 of cluster dsv4-flash-8node (worker; vllm-dp8 .. vllm-dp15)"
    assert report.format().splitlines()[0] == f"preflight of {report.about}" and report.to_dict()["about"]
    checks = by_name(report)
    # in the container: the programs are the image's (the container rows), said so
    assert checks["vllm"].status == SKIP and "inside the container" in checks["vllm"].value
    assert checks["etcd"].value == "this node runs no etcd (not the master)"
    # one model, read by eight ranks: one row naming them
    assert [c.name for c in report.checks if c.name.startswith("model")] == ["model"]
    assert checks["model"].status == PASS and checks["model"].value.endswith("(read by vllm-dp8 .. vllm-dp15)")
    del data["container"]  # on the host: a row per rank, each named
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    report = run_preflight(load_config(path, node="a2-5"), a2.host())
    rows = [c.name for c in report.checks if c.name.startswith("vllm")]
    assert rows == [f"vllm:vllm-dp{rank}" for rank in range(8, 16)]
    assert len({c.name for c in report.checks}) == len(report.checks), "no two rows share a name"


def test_preflight_takes_node_for_any_member() -> None:
    from nodeagent.cli.common import NODE_COMMANDS
    from nodeagent.cli.parser import build_parser

    args = build_parser("preflight").parse_args(["preflight", "--node", "a2-5", "--json"])
    assert args.node == "a2-5" and "preflight" in NODE_COMMANDS and "ports" in NODE_COMMANDS


@pytest.mark.parametrize("member", ["a2-0", "a2-4"])  # the master with a prefill group, a decode member
def test_the_shipped_cluster_file_warns_nothing_it_could_fix(a2: A2, member: str) -> None:
    """issue 31: on a healthy host, each member of config/dsv4-flash-a2-8node.yaml passes its own checks (it
    WARNed the prefill abort timeout; the host-port and huge-page rules: tests/test_portlint.py, above)."""
    data = yaml.safe_load((ROOT / "config" / "dsv4-flash-a2-8node.yaml").read_text())
    data.pop("container")  # the host's checks (the fixture has no engine)
    for entry in data["cluster"]["nodes"]:
        if entry["name"] == member:
            entry |= {"ip": NODE_IP, "nic_name": "enp61s0f2"}
    data["cluster"].pop("etcd_endpoints")  # the master's, derived
    data["agent"] = a2.config_data["agent"]
    comps = data["components"]
    comps["vllm"] |= {"model": a2.model_path, "port": free_port()}
    comps["datasystem"] |= {"workdir": str(a2.tmp / "yr"), "worker_port": free_port(),
                            "liveness_check_path": str(a2.tmp / "liveness")}  # fmt: skip
    comps["etcd"] |= {"client_port": free_port(), "peer_port": free_port(), "data_dir": str(a2.tmp / "etcd")}
    comps["proxy"] |= {"port": free_port()}
    path = a2.tmp / "eight.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    report = run_preflight(load_config(path, node=member), a2.host())
    assert not report.warnings, report.format()

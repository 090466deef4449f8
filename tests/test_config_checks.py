"""The config-level checks (issue 29 item 1): pure over a loaded config, and the one loader every door uses
(`load_checked`: validate, start, reload, a rollout's staging) refusing what they find."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.agent import load_checked, main
from nodeagent.config.load import load_config
from nodeagent.core.errors import ConfigError
from nodeagent.layers.config_checks import config_problems, port_problems, rh2d_problems

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "config" / "local.yaml"
EIGHT = ROOT / "config" / "dsv4-flash-a2-8node.yaml"


def local(tmp: Path, change: Any) -> Path:
    """config/local.yaml (its home in `tmp`), changed."""
    text = LOCAL.read_text().replace("${DSV4_AGENT_HOME:-../.dsv4-agent}", str(tmp / "home"))
    data = yaml.safe_load(text.replace("./standin-model", str(ROOT / "config" / "standin-model")))
    change(data)
    path = tmp / "changed.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def eight(tmp: Path, change: Any) -> Path:
    data = yaml.safe_load(EIGHT.read_text())
    change(data)
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_shipped_configs_have_no_problem() -> None:
    assert config_problems(load_config(LOCAL), {}) == []
    for node in (f"a2-{i}" for i in range(8)):
        assert config_problems(load_config(EIGHT, node=node), {}) == [], node


def test_vllm_on_the_agents_own_etcd_port_names_both_keys(tmp_path: Path) -> None:
    """The issue's file: vLLM's port 2379 is the etcd's client port."""
    path = local(tmp_path, lambda d: d["components"]["vllm"].__setitem__("port", 2379))
    assert port_problems(load_config(path), {}) == [
        "components.etcd.client_port and components.vllm.port: 2379: etcd etcd client 2379 and vllm HTTP (--port) "
        "2379 collide"]


def test_the_agents_api_on_its_etcd_peer_port(tmp_path: Path) -> None:
    path = local(tmp_path, lambda d: d["agent"]["api"].__setitem__("listen", "127.0.0.1:2380"))
    (problem,) = port_problems(load_config(path), {})
    assert problem.startswith("agent.api.listen and components.etcd.peer_port: 2380:")


def test_a_worker_port_inside_the_masters_handshake_range(tmp_path: Path) -> None:
    """Preflight's ports_lint FAILs it; the config checks find it too, on the master only (a worker's handshake
    ranges are elsewhere)."""
    path = eight(tmp_path, lambda d: d["components"]["datasystem"].__setitem__("worker_port", 30005))
    assert port_problems(load_config(path, node="a2-0"), {}) == [
        "components.datasystem.worker_port and components.vllm-dp1.kv_transfer_config.kv_port: 30005: datasystem "
        "datasystem worker 30005 and vllm-dp1 MooncakeHybridConnector handshake (kv_port 30000 + rank·TP) "
        "30004-30007 collide"]
    assert port_problems(load_config(path, node="a2-5"), {}) == []


def test_rh2d_without_huge_pages(tmp_path: Path) -> None:
    def rh2d(huge: bool) -> Any:
        def change(d: dict[str, Any]) -> None:
            d["components"]["datasystem"]["remote_h2d_device_ids"] = [0]
            d["components"]["datasystem"]["enable_huge_tlb"] = huge
        return change

    (problem,) = rh2d_problems(load_config(local(tmp_path, rh2d(False))))
    assert problem.startswith("components.datasystem.enable_huge_tlb: RH2D is on "
                              "(components.datasystem.remote_h2d_device_ids)")  # fmt: skip
    assert rh2d_problems(load_config(local(tmp_path, rh2d(True)))) == []


def test_load_checked_refuses_a_collision_with_the_file_name(tmp_path: Path) -> None:
    path = local(tmp_path, lambda d: d["components"]["vllm"].__setitem__("port", 2379))
    with pytest.raises(ConfigError) as caught:
        load_checked(str(path))
    assert str(caught.value).startswith(f"{path}: components.etcd.client_port and components.vllm.port: 2379")
    assert load_checked(str(local(tmp_path, lambda d: None))).components["vllm"].port == 8080


def test_the_agent_refuses_to_start_with_exit_78(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = local(tmp_path, lambda d: d["components"]["vllm"].__setitem__("port", 2379))
    assert main(["--config", str(path), "--check"]) == 78
    assert "components.vllm.port: 2379" in capsys.readouterr().err


def test_config_validate_exits_78_on_the_handshake_overlap(tmp_path: Path) -> None:
    path = eight(tmp_path, lambda d: d["components"]["datasystem"].__setitem__("worker_port", 30005))
    run = subprocess.run([sys.executable, "-m", "nodeagent.cli", "config", "validate", str(path), "--node", "a2-0"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 78, run.stdout + run.stderr
    assert f"{path}: components.datasystem.worker_port and components.vllm-dp1.kv_transfer_config.kv_port" in run.stderr

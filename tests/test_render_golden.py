"""The rendering of config/dsv4-flash-a2.yaml equals what the guide's own scripts run.

bash interprets the guide's scripts verbatim (tests/golden/) with etcd/dscli/vllm replaced by a function that
prints the argv and environment it was called with; we compare that with `render_component`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.config.base import replace
from nodeagent.config.load import load_config
from nodeagent.config.model import Config
from nodeagent.render.launch import AGENT_ENV, render_component

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
IP = "192.0.2.17"
BASE_ENV = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": "/opt/site/libfoo.so", "GOOGLE_LOGTOSTDERR": "1",
            "GOOGLE_ALSOLOGTOSTDERR": "1", "HOME": "/root"}  # fmt: skip
BASH_NOISE = {"PWD", "SHLVL", "_", "OLDPWD", "GOLDEN_OUT", "LC_CTYPE"}  # LC_CTYPE: PEP 538


def run_guide_script(name: str, program: str, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    script = (GOLDEN / name).read_text(encoding="utf-8")
    for placeholder in ("<IP_ADDRESS>", "<当前节点IP>", "<ETCD_IP>"):
        script = script.replace(placeholder, IP)
    script = script.replace("/tmp/etcd.log", str(tmp_path / "etcd.log"))
    result = tmp_path / "called.json"
    capture = (
        "import json,os,sys; env=dict(os.environ); out=env.pop('GOLDEN_OUT'); "
        "open(out,'w').write(json.dumps({'argv': sys.argv[1:], 'env': env}))"
    )
    prelude = (
        f'hostname() {{ echo "{IP} 198.51.100.3"; }}\nsleep() {{ :; }}\netcdctl() {{ :; }}\n'
        f"{program}() {{ {sys.executable} -c \"{capture}\" \"$@\"; }}\n"
    )
    subprocess.run(["bash", "-c", prelude + script + "\nwait\n"], cwd=tmp_path,
                   env={**BASE_ENV, "GOLDEN_OUT": str(result)}, capture_output=True, timeout=30, check=True)
    data = json.loads(result.read_text())
    env = {k: v for k, v in data["env"].items() if BASE_ENV.get(k) != v and k not in BASH_NOISE}
    return data["argv"], env


def normalise(argv: list[str] | tuple[str, ...]) -> list[object]:
    """JSON arguments compare as data: the guide pretty-prints them across lines, we print them compact."""
    out: list[object] = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if arg.lstrip().startswith("{"):
            out.append(json.loads(arg))
        elif eq and flag.startswith("--") and value.lstrip().startswith("{"):
            out.append((flag, json.loads(value)))
        else:
            out.append(arg)
    return out


@pytest.fixture(scope="module")
def a2_config() -> Config:
    config = load_config(ROOT / "config" / "dsv4-flash-a2.yaml")
    return replace(config, node=replace(config.node, ip=IP))


def with_component(config: Config, name: str, **changes: object) -> Config:
    comps = dict(config.components)
    comps[name] = replace(comps[name], **changes)
    return replace(config, components=comps)


def test_etcd_matches_run_etcd_sh(a2_config: Config, tmp_path: Path) -> None:
    argv, env = run_guide_script("run_etcd.sh", "etcd", tmp_path)
    spec = render_component("etcd", a2_config, BASE_ENV)
    assert list(spec.argv[1:]) == argv
    assert spec.argv[0] == "etcd"
    # The script's ETCD_IP/ETCD_PORT/ETCD_PEER_PORT only feed shell expansion; etcd would read ETCD_* as flags.
    assert set(env) == {"ETCD_IP", "ETCD_PORT", "ETCD_PEER_PORT"}
    assert not set(spec.env) & set(env)


@pytest.mark.parametrize(
    ("script", "changes"),
    [
        # the shipped file is the appendix's huge-page worker (512000 MB of SHM is above its 21 GB rule)
        ("run_yr_worker_hugepage.sh", {}),
        ("run_yr_worker.sh",
         {"node_timeout_s": 30, "node_dead_timeout_s": 60, "arena_per_tenant": None, "enable_huge_tlb": None}),
        ("run_yr_worker_rh2d.sh", {"remote_h2d_device_ids": [0, 1, 2, 3, 4, 5, 6, 7]}),
    ],
)  # fmt: skip
def test_datasystem_matches_run_yr_worker_sh(a2_config: Config, tmp_path: Path, script: str,
                                             changes: dict[str, object]) -> None:
    argv, _env = run_guide_script(script, "dscli", tmp_path)
    spec = render_component("datasystem", with_component(a2_config, "datasystem", **changes), BASE_ENV)
    assert spec.argv[0] == "dscli"
    assert list(spec.argv[1:]) == argv
    assert spec.daemonizes
    assert spec.cwd == Path("/workspace/yr")


def test_vllm_matches_run_ds_v4_flash_w8a8_mtp_sh(a2_config: Config, tmp_path: Path) -> None:
    argv, env = run_guide_script("run_ds_v4_flash_w8a8_mtp.sh", "vllm", tmp_path)
    spec = render_component("vllm", a2_config, BASE_ENV)
    assert spec.argv[0] == "vllm"
    assert normalise(spec.argv[1:]) == normalise(argv)
    guide_vars = {k: v for k, v in env.items() if k not in ("nic_name", "local_ip", "timestamp")}
    assert {k: spec.env[k] for k in guide_vars if k in spec.env} == guide_vars
    assert set(guide_vars) <= set(spec.env)
    # What the agent adds beyond the script, each for a stated reason (see render.py / DESIGN §10).
    extra = set(spec.env) - set(guide_vars)
    # HCCL_IF_BASE_PORT: the shipped file moves HCCL's host ports out of the ephemeral range (tests/test_portlint.py)
    assert extra == {"PYTHONHASHSEED", "VLLM_ENGINE_READY_TIMEOUT_S", "YR_CONFIG_PATH", "HCCL_IF_BASE_PORT", *AGENT_ENV}
    assert spec.env["PYTHONHASHSEED"] == "0"
    assert spec.env["HCCL_IF_IP"] == IP and spec.env["DS_WORKER_ADDR"] == f"{IP}:18481"
    # The script unsets the glog variables; so does the rendering.
    assert "GOOGLE_LOGTOSTDERR" not in env and set(spec.unset) == {"GOOGLE_LOGTOSTDERR", "GOOGLE_ALSOLOGTOSTDERR"}
    full = spec.environment(BASE_ENV)
    assert "GOOGLE_LOGTOSTDERR" not in full
    assert full["LD_PRELOAD"] == "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2:/opt/site/libfoo.so"
    assert json.loads(spec.files[Path(spec.env["YR_CONFIG_PATH"])]) == {"worker_addr": f"{IP}:18481"}


def test_nodeagentctl_render_prints_the_same(a2_config: Config) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nodeagent.cli", "render", "vllm", "--json",
         "--config", str(ROOT / "config" / "dsv4-flash-a2.yaml")],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    rendered = json.loads(out.stdout)
    expected = render_component("vllm", load_config(ROOT / "config" / "dsv4-flash-a2.yaml"), BASE_ENV)
    assert normalise(rendered["argv"]) == normalise(expected.argv)
    text = subprocess.run(
        [sys.executable, "-m", "nodeagent.cli", "render", "--config", str(ROOT / "config" / "dsv4-flash-a2.yaml")],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    assert "dscli \\\n    start \\\n    -t 600" in text and "export PYTHONHASHSEED=0" in text
    assert "--kv-transfer-config '{\"kv_connector\": \"AscendStoreConnector\"" in text

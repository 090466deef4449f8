"""The rendering of config/dsv4-flash-a2-8node.yaml equals what the 8-node guide's own scripts run.

bash runs the guide's server.sh line of a node, which runs vllm-ascend's real launch_online_dp.py, which runs the
guide's run_dp_template.sh once per DP rank with `vllm` replaced by a function that records its argv and
environment; we compare every rank with the component we render for it. Where the guide contradicts itself, the
test applies vllm-ascend's DeepSeek-V4-Flash tutorial (§5.2.2) to the copies, each substitution commented.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nodeagent.config.load import load_config, parse_config
from nodeagent.render.launch import AGENT_ENV, LaunchSpec, render_component

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "multinode"
EIGHT_NODE = ROOT / "config" / "dsv4-flash-a2-8node.yaml"
EXAMPLES = ROOT / ".cache" / "vllm-ascend" / "examples"
LAUNCHER = EXAMPLES / "external_online_dp" / "launch_online_dp.py"
IPS = {f"a2-{i}": f"10.0.0.{i + 1}" for i in range(8)}
PLACEHOLDERS = {f"<P{i}_IP>": IPS[f"a2-{i}"] for i in range(4)} | {f"<D{i}_IP>": IPS[f"a2-{i + 4}"] for i in range(4)}
BASE_ENV = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": "/opt/site/libfoo.so", "GOOGLE_LOGTOSTDERR": "1",
            "GOOGLE_ALSOLOGTOSTDERR": "1", "http_proxy": "http://proxy:3128", "https_proxy": "http://proxy:3128",
            "ftp_proxy": "http://proxy:3128"}  # fmt: skip
NOISE = {"PWD", "SHLVL", "_", "OLDPWD", "GOLDEN_OUT", "LC_CTYPE", "HOME"}
AGENT_EXTRAS = {"PYTHONHASHSEED", "VLLM_ENGINE_READY_TIMEOUT_S", "YR_CONFIG_PATH", "DS_WORKER_ADDR",
                "DS_ENABLE_REMOTE_H2D", "HCCL_IF_BASE_PORT", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
                "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", *AGENT_ENV}  # fmt: skip
"""What the agent adds to the guide's run_dp_template.sh: the yuanrong pool's address (the guide's RH2D appendix
adds DS_WORKER_ADDR to the same template), the FAQ's PYTHONHASHSEED, its own markers, and the shipped file's
HCCL_IF_BASE_PORT (HCCL's host ports moved out of the ephemeral range, tests/test_portlint.py) and the prefill
abort timeouts at vLLM's default, said explicitly (preflight's abort_timeout)."""
CAPTURE = ("import json,os,sys; env=dict(os.environ); out=env.pop('GOLDEN_OUT'); "
           "open(os.path.join(out, str(os.getpid()) + '.json'),'w')"
           ".write(json.dumps({'argv': sys.argv[1:], 'env': env}))")

needs_launcher = pytest.mark.skipif(not LAUNCHER.is_file(), reason="vllm-ascend's examples are not fetched: run "
                                    "scripts/test.sh or scripts/fetch_vllm_ascend_examples.py")


def template(kind: str, p_instance: int = 0) -> str:
    text = (GOLDEN / f"dsv4flash_8node_{kind}_run_dp_template.sh").read_text(encoding="utf-8")
    if kind == "p":
        # vllm-ascend's tutorial: "for each P instance only kv_port and engine_id are modified": engine_id from 0,
        # kv_port 30000, 30100, ... (the guide keeps 0 / 30000 on all four).
        text = text.replace('"engine_id": "0"', f'"engine_id": "{p_instance}"')
        text = text.replace('"kv_port": "30000"', f'"kv_port": "{30000 + 100 * p_instance}"')
        # lookup_rpc_port per rank, as the guide's D template does ($4 = the DP rank); its P template has "0".
        text = text.replace('"lookup_rpc_port": "0"', '"lookup_rpc_port": "\'$4\'"')
    else:
        # The guide's own parameter table and the tutorial: kv_port 30400 (the D template says 30100), and the D
        # instance is engine 4 after the P instances 0..3 (the D template has no engine_id).
        text = text.replace('\\"kv_port\\": \\"30100\\"', '\\"kv_port\\": \\"30400\\"')
        text = text.replace('\\"kv_role\\": \\"kv_consumer\\",\n        \\"kv_connector_extra_config',
                            '\\"kv_role\\": \\"kv_consumer\\",\n        \\"engine_id\\": \\"4\\",\n'
                            '        \\"kv_connector_extra_config')
        # vllm_ascend.distributed.mooncake_connector does not exist in vllm-ascend 0.23; the registered connector
        # name is enough.
        text = "\n".join(line for line in text.splitlines() if "kv_connector_module_path" not in line)
    return text


def server_line(node: str) -> str:
    index = int(node.split("-")[1])
    lines = [ln for ln in (GOLDEN / "dsv4flash_8node_server.sh").read_text().splitlines() if ln.startswith("python")]
    line = lines[index]
    if index > 4:
        # vllm-ascend's tutorial: every D instance's --dp-address is the main D node's IP (the guide gives each
        # D node its own, which would make four DP groups of one node each).
        line = line.replace(f"<D{index - 4}_IP>", "<D0_IP>")
    for placeholder, ip in PLACEHOLDERS.items():
        line = line.replace(placeholder, ip)
    return line


def run_bash(script: str, ip: str, cwd: Path, functions: str = "vllm") -> list[dict[str, Any]]:
    out = cwd / "captured"
    out.mkdir()
    prelude = f'hostname() {{ echo "{ip} 198.51.100.3"; }}\n'
    for name in functions.split():
        prelude += f'{name}() {{ {sys.executable} -c "{CAPTURE}" "$@"; }}\n'
    if "python" not in functions.split():  # server.sh runs launch_online_dp.py with the real interpreter
        prelude += f"python() {{ {sys.executable} \"$@\"; }}\nexport -f python\n"
    prelude += f"export -f hostname {functions}\n"
    subprocess.run(["bash", "-c", prelude + script + "\nwait\n"], cwd=cwd, capture_output=True, timeout=60,
                   check=True, env={**BASE_ENV, "GOLDEN_OUT": str(out), "HOME": str(cwd)})  # fmt: skip
    runs = [json.loads(p.read_text()) for p in sorted(out.iterdir())]
    for run in runs:
        run["env"] = {k: v for k, v in run["env"].items()
                      if BASE_ENV.get(k) != v and k not in NOISE and not k.startswith("BASH_FUNC_")}
    return runs


def options(argv: list[str] | tuple[str, ...]) -> tuple[list[str], dict[str, Any]]:
    """Positionals and `--flag value` pairs, order-free, `_` spelt `-`, JSON values as data."""
    positionals: list[str] = []
    opts: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            positionals.append(arg)
            continue
        flag, eq, value = arg.partition("=")
        flag = "--" + flag[2:].replace("_", "-")
        if not eq:
            value = argv[i] if i < len(argv) and not argv[i].startswith("--") else ""
            i += 1 if value else 0
        opts[flag] = json.loads(value) if value.lstrip().startswith("{") else value
    return positionals, opts


@pytest.fixture(scope="module")
def configs() -> dict[str, Any]:
    return {node: load_config(EIGHT_NODE, node=node) for node in IPS}


def rendered(config: Any, name: str) -> LaunchSpec:
    return render_component(name, config, BASE_ENV)


def compare_rank(run: dict[str, Any], spec: LaunchSpec) -> None:
    guide_pos, guide = options(run["argv"])
    ours_pos, ours = options(spec.argv[1:])
    assert ours_pos == guide_pos  # serve MODEL
    # The guide binds --host to the node's IP; the one shared file leaves host unset (all interfaces).
    guide.pop("--host")
    # vLLM sets the local size to 1 for an externally balanced rank; we say so explicitly.
    assert ours.pop("--data-parallel-size-local") == "1"
    assert ours == guide
    assert {k: spec.env[k] for k in run["env"] if k in spec.env} == run["env"]
    assert set(spec.env) - set(run["env"]) <= AGENT_EXTRAS
    assert spec.env["PYTHONHASHSEED"] == "0"
    full = spec.environment(BASE_ENV)
    assert not {"http_proxy", "https_proxy", "ftp_proxy", "GOOGLE_LOGTOSTDERR"} & set(full)


@needs_launcher
@pytest.mark.parametrize(("node", "kind", "p_instance"),
                         [("a2-0", "p", 0), ("a2-3", "p", 3), ("a2-4", "d", 0), ("a2-5", "d", 0)])  # fmt: skip
def test_every_rank_matches_the_guide_launch(configs: dict[str, Any], tmp_path: Path, node: str, kind: str,
                                             p_instance: int) -> None:
    """The heads of prefill0/prefill3 and decode0, and a non-head decode node: every rank of each."""
    shutil.copy(LAUNCHER, tmp_path / "launch_online_dp.py")
    (tmp_path / "run_dp_template.sh").write_text(template(kind, p_instance).replace("<IP_ADDRESS>", IPS[node]))
    runs = run_bash(server_line(node), IPS[node], tmp_path)
    config = configs[node]
    vllm = {n: c for n, c in config.active_components().items() if c.kind == "vllm"}
    assert len(runs) == len(vllm) == (2 if kind == "p" else 8)
    for run in runs:
        _, opts = options(run["argv"])
        name = f"vllm-dp{opts['--data-parallel-rank']}"
        assert name in vllm, (name, list(vllm))
        compare_rank(run, rendered(config, name))


@needs_launcher
def test_the_ranks_of_a_node_get_their_own_ports_and_npus(configs: dict[str, Any], tmp_path: Path) -> None:
    shutil.copy(LAUNCHER, tmp_path / "launch_online_dp.py")
    (tmp_path / "run_dp_template.sh").write_text(template("p").replace("<IP_ADDRESS>", IPS["a2-0"]))
    runs = run_bash(server_line("a2-0"), IPS["a2-0"], tmp_path)
    seen = {(options(r["argv"])[1]["--port"], r["env"]["ASCEND_RT_VISIBLE_DEVICES"]) for r in runs}
    assert seen == {("7100", "0,1,2,3"), ("7101", "4,5,6,7")}


def test_proxy_matches_proxy_sh(configs: dict[str, Any], tmp_path: Path) -> None:
    text = (GOLDEN / "dsv4flash_8node_proxy.sh").read_text()
    # The proxy runs on the master (P0); the guide's `--host <D0_IP>` names another machine, which it cannot bind.
    text = text.replace("--host <D0_IP>", "--host <P0_IP>")
    for placeholder, ip in PLACEHOLDERS.items():
        text = text.replace(placeholder, ip)
    (run,) = run_bash(text, IPS["a2-0"], tmp_path, functions="python")
    spec = rendered(configs["a2-0"], "proxy")
    assert spec.argv[0] == "python3"
    assert Path(spec.argv[1]).name == run["argv"][0] == "load_balance_proxy_server_example.py"
    assert spec.argv[1].startswith("/vllm-workspace/vllm-ascend/examples/disaggregated_prefill_v1/")
    # the agent adds restarted groups back and wants them routed within a second, not the script's 10 s
    assert list(spec.argv[-4:]) == ["--waiting-retry-interval", "1", "--max-waiting-retries", "60"]
    assert list(spec.argv[2:-4]) == run["argv"][1:]
    assert "proxy" not in configs["a2-1"].active_components()


def internal_pair(tmp_path: Path) -> dict[str, Any]:
    """vllm-ascend's DeepSeek-V4-Pro A3 two-node layout, written as one cluster file with an internal group."""
    text = """
cluster:
  name: pro
  nodes:
    - {name: n0, ip: 192.0.2.10, role: master, nic_name: eth9}
    - {name: n1, ip: 192.0.2.11, nic_name: eth9}
components:
  vllm: {kind: vllm, model: /m, port: 8900, host: 0.0.0.0, tensor_parallel_size: 16, data_parallel_rpc_port: 13399}
"""
    return {n: parse_config(text, str(tmp_path / "pro.yaml"), base_dir=tmp_path, node=n) for n in ("n0", "n1")}


DP_FLAGS = ("--data-parallel-size", "--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-rank",
            "--data-parallel-address", "--data-parallel-rpc-port", "--headless", "--tensor-parallel-size",
            "--enable-expert-parallel")  # fmt: skip


@pytest.mark.parametrize("node", ["n0", "n1"])
def test_internal_launch_matches_the_multi_node_tutorial(tmp_path: Path, node: str) -> None:
    script = (GOLDEN / f"dsv4pro_a3_internal_{node.replace('n', 'node')}.sh").read_text()
    ip = {"n0": "192.0.2.10", "n1": "192.0.2.11"}[node]
    script = script.replace('local_ip="xxx"', f'local_ip="{ip}"').replace('node0_ip="xxxx"', 'node0_ip="192.0.2.10"')
    (run,) = run_bash(script.replace('nic_name="xxx"', 'nic_name="eth9"'), ip, tmp_path)
    _, guide = options(run["argv"])
    config = internal_pair(tmp_path)[node]
    spec = rendered(config, "vllm")
    _, ours = options(spec.argv[1:])
    want = {k: v for k, v in guide.items() if k in DP_FLAGS}
    if node == "n0":
        # The head's start rank 0 is vLLM's default; we never render a start rank without --headless (vLLM would
        # switch a non-head node so configured to hybrid load balancing).
        assert want.pop("--data-parallel-start-rank") == "0"
        assert ours["--port"] == "8900" and spec.ports == (8900,)
    else:
        # A headless node runs no API server: no --host/--port, no port to wait for, no HTTP probes.
        assert "--port" not in ours and "--host" not in ours and spec.ports == ()
        probes = config.components["vllm"].probes
        assert not (probes.startup or probes.liveness or probes.readiness)
    assert {k: v for k, v in ours.items() if k in DP_FLAGS} == want
    assert spec.env["HCCL_IF_IP"] == run["env"]["HCCL_IF_IP"] == ip
    assert spec.env["HCCL_SOCKET_IFNAME"] == run["env"]["HCCL_SOCKET_IFNAME"] == "eth9"

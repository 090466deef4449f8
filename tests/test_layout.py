"""The cluster file and its layout: members, groups, ranks and endpoints, per-member overrides, errors with file
and line, the shared-sections hash, and a consistent rendering of every node of the 8-node file."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from nodeagent.config.cluster import cluster_file_hash
from nodeagent.config.layout import cluster_layout
from nodeagent.config.load import load_config, parse_config
from nodeagent.core.errors import ConfigError
from nodeagent.node.residue_plan import component_ports
from nodeagent.render.launch import render_component

ROOT = Path(__file__).resolve().parents[1]
EIGHT_NODE = ROOT / "config" / "dsv4-flash-a2-8node.yaml"
NODES = [f"a2-{i}" for i in range(8)]
IPS = {n: f"10.0.0.{i + 1}" for i, n in enumerate(NODES)}

# A whole cluster on one machine: every member's ports come from its entry in the one shared file.
LOOPBACK = """\
cluster:
  name: lo
  nodes:
    - {name: n0, ip: 127.0.0.1, role: master, components: {vllm: {port: 18021}, datasystem: {worker_port: 18481}}}
    - {name: n1, ip: 127.0.0.1, components: {vllm: {port: 18031}, datasystem: {worker_port: 18482}}}
    - {name: n2, ip: 127.0.0.1, components: {vllm: {port: 18041}, datasystem: {worker_port: 18483}}}
  vllm_groups:
    - {name: p0, kind: prefill, nodes: [n0], dp_launch: external, data_parallel_size_local: 2}
    - {name: d0, kind: decode, nodes: [n1, n2], data_parallel_size_local: 2, tensor_parallel_size: 1,
       data_parallel_rpc_port: 13400}
node: {name: NODE}
agent: {state_dir: /tmp/lo/NODE/state, api: {listen: "127.0.0.1:PORT"}}
components:
  etcd: {kind: etcd, client_port: 12379, peer_port: 12380}
  datasystem: {kind: datasystem, depends_on: [etcd]}
  vllm: {kind: vllm, model: /m, tensor_parallel_size: 2, data_parallel_rpc_port: 13300, depends_on: [datasystem]}
  proxy: {kind: proxy, port: 18100}
"""


def loopback(node: str, text: str = LOOPBACK, port: int = 18700) -> Any:
    body = text.replace("NODE", node).replace("PORT", str(port))
    return parse_config(body, "/etc/dsv4-agent/lo.yaml", base_dir=Path("/etc/dsv4-agent"))


def config_error(text: str, node: str | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "c.yaml", base_dir=Path("/tmp"), node=node)
    return str(info.value)


# ---- the layout ------------------------------------------------------------------------------------------------


def test_layout_of_the_8_node_file() -> None:
    layout = cluster_layout(load_config(EIGHT_NODE, node="a2-6"))
    assert [m.name for m in layout.members] == NODES and layout.master is not None and layout.master.name == "a2-0"
    assert layout.member("a2-4").ip == "10.0.0.5" and layout.member("a2-4").nic_name == "enp67s0f0np0"
    assert [g.name for g in layout.groups] == ["prefill0", "prefill1", "prefill2", "prefill3", "decode0"]
    p1, decode = layout.group("prefill1"), layout.group("decode0")
    assert (p1.kind, p1.dp_launch, p1.nodes, p1.head, p1.dp_size, p1.tensor_parallel_size) == \
        ("prefill", "external", ("a2-1",), "a2-1", 2, 4)
    assert (p1.address, p1.rpc_port, p1.kv_role, p1.engine_id, p1.kv_port) == \
        ("10.0.0.2", 12321, "kv_producer", "1", 30100)
    assert p1.endpoints == ("10.0.0.2:7100", "10.0.0.2:7101")
    assert (decode.head, decode.dp_size, decode.address, decode.kv_role, decode.engine_id, decode.kv_port) == \
        ("a2-4", 32, "10.0.0.5", "kv_consumer", "4", 30400)
    assert [(s.node, s.start_rank, s.size_local) for s in decode.slices] == \
        [("a2-4", 0, 8), ("a2-5", 8, 8), ("a2-6", 16, 8), ("a2-7", 24, 8)]
    assert decode.components("a2-5") == tuple(f"vllm-dp{r}" for r in range(8, 16))
    assert len(decode.endpoints) == 32 and decode.endpoints[8] == "10.0.0.6:7100"
    rank9 = next(p for p in decode.processes if p.rank == 9)
    assert (rank9.node, rank9.port, rank9.devices, rank9.headless) == ("a2-5", 7101, (1,), False)
    assert layout.group_of("a2-6") is decode and layout.group_of("a2-2").name == "prefill2"
    assert layout.components_of("a2-0") == ("etcd", "datasystem", "vllm-dp0", "vllm-dp1", "proxy")
    assert layout.components_of("a2-7") == ("datasystem", *(f"vllm-dp{r}" for r in range(24, 32)))
    (proxy,) = layout.proxies
    assert (proxy.node, proxy.host, proxy.port) == ("a2-0", "10.0.0.1", 18020)
    assert proxy.prefillers == tuple(e for g in layout.groups[:4] for e in g.endpoints)
    assert proxy.decoders == decode.endpoints
    assert layout.etcd_address == "10.0.0.1:2379"


def test_each_member_runs_exactly_what_the_layout_says() -> None:
    for node in NODES:
        config = load_config(EIGHT_NODE, node=node)
        layout = cluster_layout(config)
        assert tuple(config.active_components()) == layout.components_of(node)
        group = layout.group_of(node)
        assert group is not None
        for name in group.components(node):
            assert config.components[name].group == group.name  # "my group" from a component


def test_internal_group_head_and_headless_nodes() -> None:
    n1, n2 = loopback("n1"), loopback("n2")
    layout = cluster_layout(n2)
    d0 = layout.group("d0")
    assert (d0.dp_launch, d0.head, d0.dp_size, d0.address, d0.rpc_port) == ("internal", "n1", 4, "127.0.0.1", 13400)
    assert d0.endpoints == ("127.0.0.1:18031",)  # only the head serves HTTP
    assert [(s.node, s.start_rank, s.size_local, s.components) for s in d0.slices] == \
        [("n1", 0, 2, ("vllm",)), ("n2", 2, 2, ("vllm",))]
    head, headless = n1.components["vllm"], n2.components["vllm"]
    assert (head.headless, head.data_parallel_start_rank, head.data_parallel_size_local) == (False, None, 2)
    assert (headless.headless, headless.data_parallel_start_rank) == (True, 2)
    assert headless.probes.startup == headless.probes.liveness == headless.probes.readiness == []
    assert head.probes.liveness and head.probes.startup[0].kind == "http_get"  # the head keeps its HTTP probes
    assert component_ports(head) == (18031, 13400) and component_ports(headless) == ()
    argv = render_component("vllm", n2, {}).argv
    assert "--headless" in argv and "--port" not in argv
    assert argv[argv.index("--data-parallel-start-rank") + 1] == "2"
    # lookup_rpc_port per process: the start rank of its slice
    pool = headless.kv_transfer_config["kv_connector_extra_config"]["connectors"][1]
    assert pool["kv_connector_extra_config"] == {"lookup_rpc_port": "2", "backend": "yuanrong"}


def test_external_ranks_own_ports_devices_and_only_rank_0_the_rpc_port() -> None:
    n0 = loopback("n0")
    dp0, dp1 = n0.components["vllm-dp0"], n0.components["vllm-dp1"]
    assert (dp0.port, dp1.port, dp0.visible_devices, dp1.visible_devices) == (18021, 18022, [0, 1], [2, 3])
    assert (dp1.data_parallel_rank, dp1.data_parallel_size_local, dp1.data_parallel_size) == (1, 1, 2)
    assert component_ports(dp0) == (18021, 13300) and component_ports(dp1) == (18022,)
    assert render_component("vllm-dp1", n0, {}).env["ASCEND_RT_VISIBLE_DEVICES"] == "2,3"


def test_members_on_one_ip_differ_only_in_node_and_agent() -> None:
    configs = {n: loopback(n, port=18700 + i) for i, n in enumerate(("n0", "n1", "n2"))}
    assert len({cluster_file_hash(c) for c in configs.values()}) == 1
    assert [c.node.role for c in configs.values()] == ["master", "worker", "worker"]
    workers = {render_component("datasystem", c, {}).argv[6] for c in configs.values()}
    assert workers == {"127.0.0.1:18481", "127.0.0.1:18482", "127.0.0.1:18483"}
    proxy = render_component("proxy", configs["n0"], {})
    assert list(proxy.argv[proxy.argv.index("--prefiller-ports") + 1:][:2]) == ["18021", "18022"]
    assert proxy.argv[proxy.argv.index("--decoder-ports") + 1] == "18031"
    assert configs["n0"].cluster.etcd_endpoints == ["127.0.0.1:12379"]  # derived: the master's etcd
    assert all(c.components["datasystem"].etcd_address == "127.0.0.1:12379" for c in configs.values())


def test_a_single_node_file_talks_to_its_own_etcd_where_it_listens() -> None:
    """The guide's etcd listens on the node's address (`hostname -I`), not on loopback: without etcd_endpoints
    the agent's etcd client goes there too, as the worker's --etcd_address does."""
    text = "node: {name: a2, ip: 192.0.2.17}\ncomponents:\n  etcd: {kind: etcd, client_port: 2479}\n"
    assert parse_config(text).cluster.etcd_endpoints == ["192.0.2.17:2479"]
    listen = text.replace("client_port: 2479", "client_port: 2479, listen_ip: 127.0.0.1")
    assert parse_config(listen).cluster.etcd_endpoints == ["127.0.0.1:2479"]
    given = "cluster: {etcd_endpoints: ['10.0.0.9:2379']}\n" + text
    assert parse_config(given).cluster.etcd_endpoints == ["10.0.0.9:2379"]  # a remote etcd stays as written
    assert parse_config("node: {name: a2, ip: 192.0.2.17}\n").cluster.etcd_endpoints == ["127.0.0.1:2379"]
    shipped = load_config(ROOT / "config" / "dsv4-flash-a2.yaml")
    assert shipped.cluster.etcd_endpoints == [f"{shipped.node.ip}:2379"]


def test_default_group_is_every_node_mixed_internal() -> None:
    text = LOOPBACK.split("  vllm_groups:")[0] + LOOPBACK.split("       data_parallel_rpc_port: 13400}\n")[1]
    text = text.replace("  proxy: {kind: proxy, port: 18100}\n", "")
    layout = cluster_layout(loopback("n1", text))
    (group,) = layout.groups
    assert (group.name, group.kind, group.dp_launch, group.nodes, group.dp_size) == \
        ("vllm", "mixed", "internal", ("n0", "n1", "n2"), 3)
    assert loopback("n1", text).components["vllm"].kv_transfer_config["kv_role"] == "kv_both"


def test_single_node_configs_keep_their_components() -> None:
    config = load_config(ROOT / "config" / "local.yaml")
    layout = cluster_layout(config)
    assert [m.name for m in layout.members] == [config.node.name]
    (group,) = layout.groups
    assert (group.name, group.nodes, group.dp_size, group.endpoints) == ("vllm", (config.node.name,), 1,
                                                                         (f"127.0.0.1:{config.components['vllm'].port}",))
    assert layout.components_of(config.node.name) == tuple(config.active_components())
    assert config.components["vllm"].group == "vllm"


def test_hash_covers_the_shared_sections_only() -> None:
    base = loopback("n0")
    reordered = LOOPBACK.replace("cluster:\n  name: lo\n", "# a comment\ncluster:\n  name: lo\n")
    assert cluster_file_hash(loopback("n1", reordered, port=1)) == cluster_file_hash(base)
    assert cluster_file_hash(loopback("n0", LOOPBACK.replace("model: /m", "model: /m2"))) != cluster_file_hash(base)
    assert cluster_file_hash(loopback("n0", LOOPBACK.replace("name: lo", "name: lo2"))) != cluster_file_hash(base)


# ---- errors: file, line and key ---------------------------------------------------------------------------------

BASE = """\
cluster:
  nodes:
    - {name: a, ip: 10.0.0.1, role: master}
    - {name: b, ip: 10.0.0.2}
    - {name: c, ip: 10.0.0.3}
  vllm_groups:
    - {name: g0, kind: prefill, nodes: [a]}
    - {name: g1, kind: decode, nodes: [b, c]}
node: {name: a}
components:
  etcd: {kind: etcd}
  vllm: {kind: vllm, model: /m}
"""


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("nodes: [b, c]", "nodes: [b, a]", "c.yaml:8: cluster.vllm_groups.1.nodes.1: node 'a' is in two groups"),
    ("nodes: [b, c]", "nodes: [b, x]", "c.yaml:8: cluster.vllm_groups.1.nodes.1: unknown node 'x'"),
    ("ip: 10.0.0.2}", "ip: 10.0.0.2, role: master}", "c.yaml:4: cluster.nodes.1.role: two masters: 'a' and 'b'"),
    (", role: master}", "}", "c.yaml:2: cluster.nodes: no master"),
    ("name: c,", "name: b,", "c.yaml:5: cluster.nodes.2.name: duplicate node name 'b'"),
    ("node: {name: a}", "node: {name: z}", "c.yaml:9: node.name: 'z' has no entry in cluster.nodes (a, b, c)"),
    ("kind: decode,", "kind: decode, max_num_seq: 4,",
     "c.yaml:8: cluster.vllm_groups.1.max_num_seq: 'max_num_seq' is not a vLLM component setting (did you mean "
     "'max_num_seqs'?)"),
    ("kind: decode,", "kind: decode, headless: true,", "c.yaml:8: cluster.vllm_groups.1.headless: headless is derived"),
    ("model: /m}", "model: /m, data_parallel_rank: 1}", "c.yaml:12: components.vllm.data_parallel_rank: "
     "data_parallel_rank is derived from cluster.vllm_groups"),
    ("node: {name: a}", "node: {name: a, ip: 10.0.0.9}", "c.yaml:9: node.ip: '10.0.0.9' disagrees with"),
    ("ip: 10.0.0.3}", "ip: 10.0.0.3, components: {vllm: {tensor_parallel_size: 2}}}",
     "c.yaml:5: cluster.nodes.2.components.vllm.tensor_parallel_size: tensor_parallel_size must be the same"),
    ("ip: 10.0.0.3}", "ip: 10.0.0.3, components: {vllm: {port: 70000}}}",
     "c.yaml:5: cluster.nodes.2.components.vllm.port: Input should be less than or equal to 65535, got 70000"),
    ("ip: 10.0.0.2}", "ip: 10.0.0.1}", "c.yaml:4: cluster.nodes.1: 10.0.0.1:8080 is used by both a/vllm and b/vllm"),
    ("kind: decode,", "kind: mixed,", "c.yaml:6: cluster.vllm_groups: prefill groups need a decode group"),
    ("  etcd: {kind: etcd}", "  etcd: {kind: etcd}\n  p: {kind: proxy, prefillers: [x:1]}",
     "c.yaml:12: components.p.prefillers: prefillers is derived"),
])  # fmt: skip
def test_cluster_file_errors_name_file_line_and_key(old: str, new: str, expected: str) -> None:
    assert old in BASE
    assert expected in config_error(BASE.replace(old, new))


def test_more_errors() -> None:
    hostname = BASE.replace("node: {name: a}\n", "")
    assert "has no entry here" in config_error(hostname) and "set node.name or pass --node" in config_error(hostname)
    assert "--node 'q' is not a member" in config_error(BASE, node="q")
    no_pd = BASE.replace("kind: prefill", "kind: mixed").replace("kind: decode", "kind: mixed")
    proxy = no_pd + "  proxy: {kind: proxy}\n"
    assert "c.yaml:13: components.proxy: the proxy sends each request to a prefill, then a decode" in \
        config_error(proxy)
    single = "components:\n  vllm: {kind: vllm, model: /m, data_parallel_start_rank: 2}\n"
    assert "c.yaml:2: components.vllm: data_parallel_start_rank without headless" in config_error(single)
    assert "vllm_groups need cluster.nodes" in config_error("cluster:\n  vllm_groups: [{name: g, nodes: [a]}]\n")
    assert "c.yaml:2: cluster.etcd_endpoints: the cluster's etcd runs at 10.0.0.1:2379" in \
        config_error("cluster:\n  etcd_endpoints: ['10.0.0.7:2379']\n" + BASE.removeprefix("cluster:\n"))


# ---- every node of the 8-node file, as `nodeagentctl render --node N --json` prints it ----------------------------


def render_node(node: str) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "nodeagent.cli", "render", "--node", node, "--json", "--config", str(EIGHT_NODE)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_every_node_renders_a_consistent_cluster() -> None:
    rendered = {node: render_node(node) for node in NODES}
    ranks: dict[str, list[dict[str, Any]]] = {}
    for node, comps in rendered.items():
        ip = IPS[node]
        kinds = Counter(c["kind"] for c in comps)
        assert kinds["etcd"] == kinds["proxy"] == (1 if node == "a2-0" else 0), node
        (ds,) = [c for c in comps if c["kind"] == "datasystem"]
        assert flag(ds["argv"], "--worker_address") == f"{ip}:18481"
        assert flag(ds["argv"], "--etcd_address") == "10.0.0.1:2379"
        for comp in (c for c in comps if c["kind"] == "vllm"):
            env, argv = comp["env"], comp["argv"]
            assert env["HCCL_IF_IP"] == ip and env["DS_WORKER_ADDR"] == f"{ip}:18481"
            assert env["PYTHONHASHSEED"] == "0" and env["GLOO_SOCKET_IFNAME"] == "enp67s0f0np0"
            ranks.setdefault(comp["group"], []).append({"node": node, **comp})
            assert "--headless" not in argv and "--data-parallel-start-rank" not in argv  # external launch
    assert sorted(ranks) == ["decode0", "prefill0", "prefill1", "prefill2", "prefill3"]
    engine_ids, kv_ports = set(), set()
    endpoints: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for group, procs in ranks.items():
        argvs = [p["argv"] for p in procs]
        size = int(flag(argvs[0], "--data-parallel-size"))
        assert size == len(procs) == (2 if group.startswith("prefill") else 32)
        assert sorted(int(flag(a, "--data-parallel-rank")) for a in argvs) == list(range(size))  # once each
        assert {flag(a, "--data-parallel-size") for a in argvs} == {str(size)}
        assert {flag(a, "--data-parallel-size-local") for a in argvs} == {"1"}
        head_ip = IPS[min((p for p in procs), key=lambda p: int(flag(p["argv"], "--data-parallel-rank")))["node"]]
        assert {flag(a, "--data-parallel-address") for a in argvs} == {head_ip}
        assert {flag(a, "--data-parallel-rpc-port") for a in argvs} == {"12321"}
        assert len({flag(a, "--tensor-parallel-size") for a in argvs}) == 1
        assert all("--enable-expert-parallel" in a for a in argvs)
        addresses = [(IPS[p["node"]], flag(p["argv"], "--port")) for p in procs]
        assert len(set(addresses)) == len(addresses)  # every rank its own port
        tp = int(flag(argvs[0], "--tensor-parallel-size"))
        for node in {p["node"] for p in procs}:
            devices = [p["env"]["ASCEND_RT_VISIBLE_DEVICES"].split(",") for p in procs if p["node"] == node]
            flat = [d for ds in devices for d in ds]
            assert all(len(ds) == tp for ds in devices) and len(flat) == len(set(flat)) <= 8
        kv = [json.loads(flag(a, "--kv-transfer-config")) for a in argvs]
        role = "kv_producer" if group.startswith("prefill") else "kv_consumer"
        assert {k["kv_role"] for k in kv} == {role}
        assert all(c["kv_role"] == role for k in kv for c in k["kv_connector_extra_config"]["connectors"])
        assert all(k["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"] ==
                   {"lookup_rpc_port": flag(a, "--data-parallel-rank"), "backend": "yuanrong"}
                   for k, a in zip(kv, argvs, strict=True))  # fmt: skip
        (engine_id,) = {k["engine_id"] for k in kv}
        (kv_port,) = {k["kv_connector_extra_config"]["connectors"][0]["kv_port"] for k in kv}
        engine_ids.add(engine_id)
        kv_ports.add(kv_port)
        endpoints["prefill" if group.startswith("prefill") else "decode"].update(f"{h}:{p}" for h, p in addresses)
    assert len(engine_ids) == len(kv_ports) == 5
    (proxy,) = [c for c in rendered["a2-0"] if c["kind"] == "proxy"]
    argv = proxy["argv"]

    def listed(role: str) -> set[str]:
        hosts = argv[argv.index(f"--{role}-hosts") + 1:argv.index(f"--{role}-ports")]
        ports = argv[argv.index(f"--{role}-ports") + 1:][:len(hosts)]
        return {f"{h}:{p}" for h, p in zip(hosts, ports, strict=True)}

    assert listed("prefiller") == endpoints["prefill"] and len(endpoints["prefill"]) == 8
    assert listed("decoder") == endpoints["decode"] and len(endpoints["decode"]) == 32


def test_config_validate_and_render_errors_for_a_member() -> None:
    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nodeagent.cli", *args], capture_output=True, text=True,
                              timeout=60)  # fmt: skip

    ok = ctl("config", "validate", str(EIGHT_NODE), "--node", "a2-5")
    assert ok.returncode == 0, ok.stderr
    assert "node a2-5 (worker) runs: datasystem, vllm-dp8," in ok.stdout
    assert "decode0 (decode, external, DP32" in ok.stdout
    bad = ctl("render", "--node", "a2-9", "--config", str(EIGHT_NODE))
    assert bad.returncode == 78 and "--node 'a2-9' is not a member" in bad.stderr
    unknown = ctl("render", "vllm-dp0", "--node", "a2-5", "--config", str(EIGHT_NODE))
    assert unknown.returncode == 4 and "node a2-5 has" in unknown.stderr


def test_cluster_file_error_names_each_problem_once() -> None:
    """`config validate` printed one group error four times: a problem reached along several paths is one."""
    from nodeagent.config.cluster_file import ClusterFileError

    where = ("cluster", "vllm_groups", 0, "nodes", 1)
    err = ClusterFileError([(where, "unknown node 'zz'")] * 4 + [(("cluster", "nodes"), "no master")])
    assert err.problems == [(where, "unknown node 'zz'"), (("cluster", "nodes"), "no master")]
    assert str(err).count("unknown node 'zz'") == 1

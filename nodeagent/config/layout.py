"""The cluster's layout, for every member at once and without I/O: members, data-parallel groups, ranks, ports,
API endpoints, and the components each node runs.

vLLM runs a multi-node data-parallel group in one of two ways, chosen per group (`dp_launch`):
- internal: one `vllm serve` per node (component `<vllm>`, e.g. `vllm`); the group's first node is the head
  (it serves HTTP and balances), the others run `--headless` with their `--data-parallel-start-rank`;
- external: one `vllm serve` per DP rank (component `<vllm>-dp<global rank>`, e.g. `vllm-dp4`), each with its
  own `--port` (the node's port + local index), `--data-parallel-rank`, NPUs and API server — what vllm-ascend's
  `examples/external_online_dp/launch_online_dp.py` starts.
Prefill groups produce KV (`kv_producer`), decode groups consume it (`kv_consumer`), mixed ones do both; the
master's proxy sends each request to a prefill endpoint, then a decode endpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.config.base import replace
from nodeagent.config.cluster import ClusterConfig, PdConfig, SharedSections, VllmGroup
from nodeagent.config.cluster_file import ClusterFileError, KeyPath, effective_groups, member_components, vllm_template
from nodeagent.config.model import (
    MASTER_ONLY_KINDS,
    Config,
    DatasystemComponent,
    EtcdComponent,
    ProbeSet,
    ProxyComponent,
    VllmComponent,
)
from nodeagent.core.bindaddr import connect_host
from nodeagent.vllm.kv_transfer import Resolver

DEFAULT_RPC_PORT = 29550
"""vLLM's own default --data-parallel-rpc-port."""
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": "kv_both"}


@dataclass(frozen=True)
class Member:
    name: str
    ip: str
    role: str
    nic_name: str | None


@dataclass(frozen=True)
class VllmProcess:
    """One `vllm serve` of a group: a supervised component on one node."""

    component: str
    node: str
    start_rank: int
    size_local: int
    rank: int | None
    """External launch: its DP rank. Internal: None (the process serves ranks start_rank .. +size_local)."""
    headless: bool
    port: int | None
    """Its HTTP port; None when headless."""
    endpoint: str | None
    """`host:port` of its OpenAI API (the node's IP), None when headless."""
    devices: tuple[int, ...] | None = None


@dataclass(frozen=True)
class NodeSlice:
    node: str
    start_rank: int
    size_local: int
    components: tuple[str, ...]


@dataclass(frozen=True)
class Group:
    name: str
    kind: str
    dp_launch: str
    nodes: tuple[str, ...]
    dp_size: int
    tensor_parallel_size: int
    address: str
    """--data-parallel-address: the head's IP unless the group sets one."""
    rpc_port: int
    kv_role: str
    engine_id: str | None
    """PD groups: the Mooncake engine id (index among the prefill/decode groups in file order)."""
    kv_port: int | None
    slices: tuple[NodeSlice, ...]
    processes: tuple[VllmProcess, ...]

    @property
    def head(self) -> str:
        return self.nodes[0]

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every HTTP-serving process: the head for internal launch, every rank for external."""
        return tuple(p.endpoint for p in self.processes if p.endpoint)

    def slice_of(self, node: str) -> NodeSlice:
        for piece in self.slices:
            if piece.node == node:
                return piece
        raise KeyError(f"node {node!r} is not in group {self.name!r}")

    def components(self, node: str) -> tuple[str, ...]:
        return self.slice_of(node).components


@dataclass(frozen=True)
class ProxyPlan:
    component: str
    node: str
    host: str
    port: int
    prefillers: tuple[str, ...]
    decoders: tuple[str, ...]


@dataclass(frozen=True)
class ClusterLayout:
    cluster: str
    members: tuple[Member, ...]
    groups: tuple[Group, ...]
    proxies: tuple[ProxyPlan, ...] = ()
    etcd_address: str | None = None
    """The master's etcd client address (every worker's --etcd_address), if the file runs etcd."""
    node_settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, repr=False, compare=False)
    """node → component → its expanded settings: exactly what that member's `config.components` holds."""

    @property
    def master(self) -> Member | None:
        """The member that runs etcd (and the proxy); a single-node config of a worker has none."""
        return next((m for m in self.members if m.role == "master"), None)

    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(f"no member {name!r} (members: {', '.join(m.name for m in self.members)})")

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r} (groups: {', '.join(g.name for g in self.groups)})")

    def group_of(self, node: str) -> Group | None:
        return next((g for g in self.groups if node in g.nodes), None)

    def node_components(self, node: str) -> dict[str, Any]:
        self.member(node)
        return dict(self.node_settings.get(node, {}))

    def components_of(self, node: str) -> tuple[str, ...]:
        """What the node runs, in file order: `config.active_components()` of that member."""
        master = self.member(node).role == "master"
        return tuple(n for n, c in self.node_components(node).items()
                     if c.enabled and (master or c.kind not in MASTER_ONLY_KINDS))


_LAYOUTS: dict[tuple[int, int], tuple[ClusterConfig, SharedSections, ClusterLayout]] = {}
"""(id of cluster, id of shared) → the layout built from them, with both held (their ids stay theirs)."""


def cluster_layout(config: Config) -> ClusterLayout:
    """The layout of the cluster this config belongs to (a config without cluster.nodes: this node alone).

    A cluster file's is built once per loaded file (its sections are frozen): the membership, the coordinator and
    the rollout ask it again and again, and each build validates every member's settings (~10 ms for 8 nodes)."""
    if not config.cluster.nodes:
        return single_node_layout(config)
    if config.shared is None:
        raise ValueError("the layout of a cluster file needs the file's shared sections (load it with load_config)")
    key = (id(config.cluster), id(config.shared))
    seen = _LAYOUTS.get(key)
    if seen is not None and seen[0] is config.cluster and seen[1] is config.shared:
        return seen[2]
    settings = member_components(config.cluster, config.shared)
    layout = build_layout(config.cluster, settings, vllm_template(config.shared.components))
    if len(_LAYOUTS) >= 256:
        _LAYOUTS.clear()
    _LAYOUTS[key] = (config.cluster, config.shared, layout)
    return layout


def _host(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _group_path(cluster: ClusterConfig, index: int, template: str) -> KeyPath:
    return ("cluster", "vllm_groups", index) if cluster.vllm_groups is not None else ("components", template)


@dataclass
class _Builder:
    cluster: ClusterConfig
    settings: Mapping[str, Mapping[str, Any]]
    template: str | None
    problems: list[tuple[KeyPath, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.members = {n.name: Member(n.name, n.ip, n.role, n.nic_name) for n in self.cluster.nodes}
        self.entries = {n.name: (i, n) for i, n in enumerate(self.cluster.nodes)}
        self.expanded: dict[str, dict[str, Any]] = {n: {} for n in self.members}

    def vllm(self, node: str) -> VllmComponent:
        return self.settings[node][self.template]  # type: ignore[index]  # a template is set once there are groups

    def group(self, index: int, group: VllmGroup, pd_index: int | None) -> Group:
        pd: PdConfig = self.cluster.pd
        head = self.vllm(group.nodes[0])
        sizes = [self.vllm(n).data_parallel_size_local or 1 for n in group.nodes]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        address = head.data_parallel_address or self.members[group.nodes[0]].ip
        slices, processes = [], []
        for node, start, size in zip(group.nodes, starts, sizes, strict=True):
            procs = self._processes(index, group, node, start, size)
            processes += procs
            slices.append(NodeSlice(node, start, size, tuple(p.component for p in procs)))
        return Group(
            name=group.name, kind=group.kind, dp_launch=group.dp_launch, nodes=tuple(group.nodes), dp_size=sum(sizes),
            tensor_parallel_size=head.tensor_parallel_size, address=address,
            rpc_port=head.data_parallel_rpc_port or DEFAULT_RPC_PORT, kv_role=KV_ROLES[group.kind],
            engine_id=None if pd_index is None else str(pd_index),
            kv_port=None if pd_index is None else pd.kv_port_base + pd.kv_port_step * pd_index,
            slices=tuple(slices), processes=tuple(processes),
        )  # fmt: skip

    def _processes(self, index: int, group: VllmGroup, node: str, start: int, size: int) -> list[VllmProcess]:
        v, ip = self.vllm(node), self.members[node].ip
        if group.dp_launch == "internal":
            headless = node != group.nodes[0]
            return [VllmProcess(self.template, node, start, size, None, headless,  # type: ignore[arg-type]  # ditto
                                None if headless else v.port, None if headless else _host(ip, v.port))]
        tp = v.tensor_parallel_size
        devices = list(v.visible_devices) if v.visible_devices is not None else list(range(size * tp))
        if len(devices) < size * tp:
            i, _ = self.entries[node]
            self.problems.append((("cluster", "nodes", i, "components", self.template, "visible_devices"),  # type: ignore[arg-type]  # ditto
                                  f"{size} ranks × tensor_parallel_size {tp} need {size * tp} devices, "
                                  f"got {len(devices)}"))
        out = []
        for local in range(size):
            port = v.port + local
            if port > 65535:
                self.problems.append((_group_path(self.cluster, index, self.template), f"port {port} > 65535"))  # type: ignore[arg-type]  # ditto
            out.append(VllmProcess(f"{self.template}-dp{start + local}", node, start + local, 1, start + local,
                                   False, port, _host(ip, port), tuple(devices[local * tp:(local + 1) * tp])))
        return out


def _pd_sizes(groups: list[Group], cluster: ClusterConfig, template: str) -> dict[str, dict[str, int]]:
    """The Mooncake connector's `prefill`/`decode` sections: one prefill instance's and one decode instance's
    DP and TP sizes, which must then be the same across the groups of a kind."""
    sizes: dict[str, dict[str, int]] = {}
    problems = []
    for index, group in enumerate(groups):
        if group.kind == "mixed":
            continue
        this = {"dp_size": group.dp_size, "tp_size": group.tensor_parallel_size}
        first = sizes.setdefault(group.kind, this)
        if first != this:
            problems.append((_group_path(cluster, index, template), f"{group.kind} groups differ in DP/TP size "
                             f"({first} vs {this}); the KV connector describes one {group.kind} instance"))
    if sizes and len(sizes) == 1:
        (kind,) = sizes
        missing = "decode" if kind == "prefill" else "prefill"
        problems.append((("cluster", "vllm_groups"), f"{kind} groups need a {missing} group"))
    if problems:
        raise ClusterFileError(problems)
    return sizes


def kv_transfer_config(base: dict[str, Any] | None, group: Group, lookup_rpc_port: int,
                       pd_sizes: Mapping[str, Mapping[str, int]], pd: PdConfig) -> dict[str, Any] | None:
    """The group's KV connectors: the component's pool connector (AscendStoreConnector, yuanrong backend) with
    the group's role and this process's `lookup_rpc_port`, behind a MultiConnector with the Mooncake P2P
    connector for prefill and decode groups. A MultiConnector written in the file is used as it is."""
    if base is not None and base.get("kv_connector") == "MultiConnector":
        return base
    role = group.kv_role
    pool = None
    if base is not None:
        pool = {**copy.deepcopy(base), "kv_role": role}
        if pool.get("kv_connector") == "AscendStoreConnector":
            extra = dict(pool.get("kv_connector_extra_config") or {})
            extra["lookup_rpc_port"] = str(lookup_rpc_port)
            pool["kv_connector_extra_config"] = extra
    if group.kind == "mixed":
        return pool
    extra_p2p: dict[str, Any] = {"use_ascend_direct": True} if pd.use_ascend_direct else {}
    extra_p2p.update(prefill=dict(pd_sizes["prefill"]), decode=dict(pd_sizes["decode"]))
    p2p = {"kv_connector": pd.p2p_connector, "kv_role": role, "kv_port": str(group.kv_port),
           "kv_connector_extra_config": extra_p2p}
    return {"kv_connector": "MultiConnector", "kv_role": role, "engine_id": group.engine_id,
            "kv_connector_extra_config": {"connectors": [p2p, *([pool] if pool else [])]}}


def build_layout(cluster: ClusterConfig, settings: Mapping[str, Mapping[str, Any]],
                 template: str | None) -> ClusterLayout:
    """Groups, ranks and endpoints from each member's settings; raises ClusterFileError naming the keys."""
    b = _Builder(cluster, settings, template)
    specs = effective_groups(cluster, template)
    pd_index = iter(range(len(specs)))
    groups = [b.group(i, g, None if g.kind == "mixed" else next(pd_index)) for i, g in enumerate(specs)]
    if b.problems:
        raise ClusterFileError(b.problems)
    pd_sizes = _pd_sizes(groups, cluster, template) if template else {}
    master = next(m for m in b.members.values() if m.role == "master")
    etcd_nodes = list(cluster.etcd_members) or [master.name]
    etcd = {n: c for n in etcd_nodes for c in settings[n].values() if isinstance(c, EtcdComponent) and c.enabled}
    etcd_address = ",".join(_host(b.members[n].ip, c.client_port) for n, c in etcd.items()) if etcd else None
    peers = {n: f"http://{_host(b.members[n].ip, c.peer_port)}" for n, c in etcd.items()}
    proxies = _proxies(cluster, settings, groups, master, template)
    served = next((settings[g.head][template].served_model_name for g in groups), None) if template else None
    for node in b.members:
        b.expanded[node] = _node_components(b, node, groups, pd_sizes, proxies, etcd_address, served)
        if len(peers) > 1:
            b.expanded[node] = _etcd_member(b.expanded[node], node, peers, cluster.name)
    _check_addresses(b, groups, proxies)
    return ClusterLayout(cluster.name, tuple(b.members.values()), tuple(groups), tuple(proxies), etcd_address,
                         b.expanded)


def _etcd_member(components: dict[str, Any], node: str, peers: Mapping[str, str], token: str) -> dict[str, Any]:
    """One member of a multi-member etcd: named after its node, every member's peer URL in --initial-cluster."""
    out = dict(components)
    for name, comp in components.items():
        if isinstance(comp, EtcdComponent):
            out[name] = replace(comp, name=node, initial_cluster=dict(peers), cluster_token=token,
                                member=node in peers, enabled=node in peers)
    return out


def _proxies(cluster: ClusterConfig, settings: Mapping[str, Mapping[str, Any]], groups: list[Group],
             master: Member, template: str | None) -> list[ProxyPlan]:
    out = []
    for name, comp in settings[master.name].items():
        if not isinstance(comp, ProxyComponent):
            continue
        prefillers = tuple(e for g in groups if g.kind == "prefill" for e in g.endpoints)
        decoders = tuple(e for g in groups if g.kind == "decode" for e in g.endpoints)
        if not prefillers or not decoders:
            raise ClusterFileError([(("components", name), "the proxy sends each request to a prefill, then a "
                                     "decode instance: cluster.vllm_groups needs kind: prefill and kind: decode "
                                     "groups")])
        out.append(ProxyPlan(name, master.name, comp.host or master.ip, comp.port, prefillers, decoders))
    return out


def _node_components(b: _Builder, node: str, groups: list[Group], pd_sizes: Mapping[str, Mapping[str, int]],
                     proxies: list[ProxyPlan], etcd_address: str | None, served: str | None) -> dict[str, Any]:
    group = next((g for g in groups if node in g.nodes), None)
    vllm_names = group.components(node) if group else ()
    out: dict[str, Any] = {}
    for name, comp in b.settings[node].items():
        if name == b.template:
            if group is not None:
                out.update(_vllm_processes(b, node, group, pd_sizes))
            continue
        update: dict[str, Any] = {}
        if b.template in comp.depends_on:
            edges = {k: v for k, v in comp.depends_on.items() if k != b.template}
            update["depends_on"] = {**edges, **{v: comp.depends_on[b.template] for v in vllm_names}}
        if isinstance(comp, DatasystemComponent) and comp.etcd_address is None and etcd_address:
            update["etcd_address"] = etcd_address
        plan = next((p for p in proxies if p.component == name), None)
        if plan is not None:
            update.update(prefillers=list(plan.prefillers), decoders=list(plan.decoders), served_model_name=served)
        out[name] = replace(comp, **update) if update else comp
    return out


def _vllm_processes(b: _Builder, node: str, group: Group,
                    pd_sizes: Mapping[str, Mapping[str, int]]) -> dict[str, VllmComponent]:
    v = b.vllm(node)
    _, entry = b.entries[node]
    out = {}
    for proc in group.processes:
        if proc.node != node:
            continue
        update: dict[str, Any] = {
            "group": group.name, "data_parallel_size": group.dp_size, "data_parallel_address": group.address,
            "data_parallel_rpc_port": group.rpc_port, "data_parallel_start_rank": None, "data_parallel_rank": None,
            "headless": proc.headless,
            "kv_transfer_config": kv_transfer_config(v.kv_transfer_config, group, proc.start_rank, pd_sizes,
                                                     b.cluster.pd),
        }  # fmt: skip
        if proc.rank is not None:
            update.update(data_parallel_rank=proc.rank, data_parallel_size_local=1, port=proc.port,
                          visible_devices=list(proc.devices or ()))
            if v.workdir is not None:  # each rank's own cwd: residue cleanup tells their orphans apart by it
                update["workdir"] = v.workdir / proc.component
        else:
            update["data_parallel_size_local"] = proc.size_local
        if proc.headless:
            update["data_parallel_start_rank"] = proc.start_rank
            if "probes" not in entry.components.get(b.template or "", {}):
                update["probes"] = ProbeSet()
        out[proc.component] = replace(v, **update)
    return out


def _check_addresses(b: _Builder, groups: list[Group], proxies: list[ProxyPlan]) -> None:
    """Members may share an IP (a test cluster on 127.0.0.1): then every listener needs its own port."""
    owners: dict[str, str] = {}
    problems: list[tuple[KeyPath, str]] = []

    def claim(node: str, address: str, what: str) -> None:
        if address in owners and owners[address] != what:
            i, _ = b.entries[node]
            problems.append((("cluster", "nodes", i), f"{address} is used by both {owners[address]} and {what}; "
                             "give one its own port in its node entry, e.g. components: {vllm: {port: 18021}}"))
        owners.setdefault(address, what)

    for g in groups:
        for p in g.processes:
            if p.endpoint:
                claim(p.node, p.endpoint, f"{p.node}/{p.component}")
    for plan in proxies:
        claim(plan.node, _host(b.members[plan.node].ip, plan.port), f"{plan.node}/{plan.component}")
    for node, comps in b.expanded.items():
        for name, comp in comps.items():
            if isinstance(comp, DatasystemComponent) and comp.enabled:
                claim(node, _host(b.members[node].ip, comp.worker_port), f"{node}/{name}")
    if problems:
        raise ClusterFileError(problems)


def single_node_layout(config: Config) -> ClusterLayout:
    """A config without cluster.nodes knows only its own node: each vLLM component is a group of its own."""
    node = config.node
    groups = []
    for name, c in config.active_components().items():
        if not isinstance(c, VllmComponent):
            continue
        external = c.data_parallel_rank is not None
        start = c.data_parallel_rank if c.data_parallel_rank is not None else (c.data_parallel_start_rank or 0)
        size = 1 if external else (c.data_parallel_size_local or c.data_parallel_size)
        endpoint = None if c.headless else _host(connect_host(c.host, node.ip), c.port)
        kv = c.kv_transfer_config or {}
        proc = VllmProcess(name, node.name, start, size, c.data_parallel_rank, c.headless,
                           None if c.headless else c.port, endpoint,
                           tuple(c.visible_devices) if c.visible_devices is not None else None)
        groups.append(Group(
            name=c.group or name, kind="mixed", dp_launch="external" if external else "internal", nodes=(node.name,),
            dp_size=c.data_parallel_size, tensor_parallel_size=c.tensor_parallel_size,
            address=c.data_parallel_address or node.ip, rpc_port=c.data_parallel_rpc_port or DEFAULT_RPC_PORT,
            kv_role=str(kv.get("kv_role", "kv_both")), engine_id=None, kv_port=None,
            slices=(NodeSlice(node.name, start, size, (name,)),), processes=(proc,),
        ))  # fmt: skip
    member = Member(node.name, node.ip, node.role, node.nic_name)
    return ClusterLayout(config.cluster.name, (member,), tuple(groups),
                         node_settings={node.name: dict(config.components)})


def layout_resolver(layout: ClusterLayout) -> Resolver:
    """Peers by the cluster layout: a handshake port inside a group's kv_port range on that node is that group;
    otherwise the PD group(s) running on that IP (ADXL and RPC ports are random), when there is exactly one."""
    ips = {m.name: m.ip for m in layout.members}
    ranges: list[tuple[str, int, int, str]] = []
    on_ip: dict[str, set[str]] = {}
    for g in layout.groups:
        if g.kv_port is None:
            continue
        for p in g.processes:
            ip = ips[p.node]
            on_ip.setdefault(ip, set()).add(g.name)
            low = g.kv_port + p.start_rank * g.tensor_parallel_size
            ranges.append((ip, low, low + p.size_local * g.tensor_parallel_size - 1, g.name))

    def resolve(host: str, port: int) -> str | None:
        for ip, low, high, name in ranges:
            if ip == host and low <= port <= high:
                return name
        names = on_ip.get(host, set())
        return next(iter(names)) if len(names) == 1 else None

    return resolve

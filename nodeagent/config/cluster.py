"""The `cluster:` section of the one file every member shares, and the hash peers compare.

A config with `cluster.nodes` describes the whole cluster: each agent finds itself by `node.name`, and every
per-node value (IP, role, NIC, per-member ports) lives in that node's entry, so a per-node file can differ only
in `node.name` and the `agent` section. `nodeagent.config.cluster_file` resolves one member from it;
`nodeagent.config.layout` answers for all of them. Keys (see docs/architecture.md, "The cluster file"):

    cluster.nodes[]:       name, ip, role (master|worker, default worker), nic_name,
                           components: {COMPONENT: {key: value}}  (this member's overrides, e.g. ports)
    cluster.vllm_groups[]: name, kind (prefill|decode|mixed), nodes, dp_launch (internal|external),
                           any vLLM component key (overrides the component's for the group)
    cluster.pd:            p2p_connector, kv_port_base, kv_port_step, use_ascend_direct
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta, field

from nodeagent.config.base import Check, RuleProblem, Strict, to_plain
from nodeagent.config.paths import ReadableFile

GroupKind = Literal["prefill", "decode", "mixed"]
Port = Annotated[int, Meta(gt=0, lt=65536)]
DpLaunch = Literal["internal", "external"]


def _topic_safe_name(value: str) -> str:
    """Cluster and node names are one level of etcd keys and MQTT topics: no `/`, no MQTT wildcards."""
    if not value:
        raise ValueError("must not be empty")
    bad = sorted({c for c in value if c in "/+#\0"})
    if bad:
        raise ValueError(f"must not contain {' '.join(repr(c) for c in bad)}: it is one level of etcd keys and "
                         "MQTT topics")
    return value


TopicSafeName = Annotated[str, Check(_topic_safe_name)]


class ClusterNode(Strict, frozen=True):
    """One member of the cluster, as its entry in `cluster.nodes` writes it."""

    name: TopicSafeName
    ip: Annotated[str, Meta(min_length=1)]
    role: Literal["master", "worker"] = "worker"
    nic_name: str | None = None
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    """This member's own values for component keys (ports, folders): several members may share an IP."""


class VllmGroup(Strict, kw_only=True, frozen=True):
    """One data-parallel group of vLLM; every other key is a vLLM component setting for the whole group."""

    name: Annotated[str, Meta(min_length=1)]
    kind: GroupKind = "mixed"
    nodes: Annotated[list[str], Meta(min_length=1)]
    dp_launch: DpLaunch = "internal"
    """internal: one `vllm serve` per node, vLLM balances (headless non-head nodes); external: one per DP rank."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The group's other keys as written (`group_settings_apart` moves them here before validation)."""

    INTERNAL_FIELDS: ClassVar[frozenset[str]] = frozenset({"settings"})


def group_settings_apart(raw: Any) -> Any:
    """A group as written → its own keys, the rest under `settings` (pydantic's extra="allow")."""
    if not isinstance(raw, dict):
        return raw
    own = {k: v for k, v in raw.items() if k in VllmGroup.__struct_fields__ and k != "settings"}
    return {**own, "settings": {k: v for k, v in raw.items() if k not in own}}


class PdConfig(Strict, frozen=True):
    """The KV transfer between prefill and decode groups (the Mooncake P2P half of the MultiConnector)."""

    p2p_connector: str = "MooncakeHybridConnector"
    """vllm-ascend's DeepSeek-V4 tutorial and openYuanrong's 8-node guide use the hybrid connector."""
    kv_port_base: Port = 30000
    kv_port_step: Annotated[int, Meta(gt=0)] = 100
    """Group i of the prefill/decode groups (file order) gets kv_port base + i·step and engine_id i."""
    use_ascend_direct: bool = True


def _check_endpoint(value: str) -> str:
    from nodeagent.core.etcd_endpoint import parse_endpoint

    parse_endpoint(value)
    return value


class EtcdTls(Strict, frozen=True):
    """TLS to etcd (the endpoints then default to https)."""

    ca_file: ReadableFile | None = None
    """CA bundle that signed etcd's server certificate; default: the system's roots."""
    cert_file: ReadableFile | None = None
    key_file: ReadableFile | None = None
    """Client certificate and key, for etcd's --client-cert-auth; give both or neither."""
    server_name: str | None = None
    """Name to check the server certificate against (default: the endpoint's host)."""

    def _problems(self) -> Iterator[RuleProblem]:
        if (self.cert_file is None) != (self.key_file is None):
            yield None, "cert_file and key_file go together"


class EtcdAuth(Strict, frozen=True):
    username: Annotated[str, Meta(min_length=1)]
    password_file: ReadableFile
    """The password, alone in a file (0600): never in the config itself."""


class ClusterConfig(Strict, frozen=True):
    name: TopicSafeName = "local"
    etcd_endpoints: Annotated[list[Annotated[str, Check(_check_endpoint)]], Meta(min_length=1)] = field(
        default_factory=lambda: ["127.0.0.1:2379"]
    )
    """Every endpoint of the etcd cluster (the agent fails over between them). In a cluster file without this
    key: the master's etcd (or every member of `etcd_members`)."""
    etcd_tls: EtcdTls | None = None
    etcd_auth: EtcdAuth | None = None
    etcd_timeout_s: Annotated[float, Meta(gt=0, le=60)] = 2.0
    """Every etcd request answers within this or counts as etcd unreachable."""
    member_ttl_s: Annotated[float, Meta(ge=2, le=300)] = 10.0
    """TTL of the lease the node's member key lives on: a dead agent's key is gone after at most this long."""
    member_heartbeat_s: Annotated[float, Meta(gt=0, le=3600)] = 15.0
    """The member key is written on every change, and at least this often (fresh clock-skew samples)."""
    clock_skew_max_s: Annotated[float, Meta(gt=0)] = 1.0
    """Members whose clocks differ from the cluster's by more than this are flagged."""
    etcd_members: list[str] = field(default_factory=list)
    """Nodes that each run a member of one etcd cluster (3 or 5, the master among them; the guide's production
    advice). Empty: the guide's single etcd on the master."""
    nodes: list[ClusterNode] = field(default_factory=list)
    vllm_groups: list[VllmGroup] | None = None
    """Default (cluster file): one group of all nodes, kind mixed, dp_launch internal."""
    pd: PdConfig = field(default_factory=PdConfig)

    def _problems(self) -> Iterator[RuleProblem]:
        if self.vllm_groups is not None and not self.vllm_groups:
            yield "vllm_groups", "list at least one group, or leave vllm_groups out for one group of all nodes"


class SharedSections(Strict, frozen=True):
    """What every member of a cluster shares, as the file wrote it (after `${VAR}` interpolation)."""

    cluster: dict[str, Any] = field(default_factory=dict)
    components: dict[str, Any] = field(default_factory=dict)
    base_dir: Path | None = None
    """Relative paths in `components` resolve against the file's folder."""
    source: str = "<config>"

    def digest(self) -> str:
        return _digest({"cluster": self.cluster, "components": self.components})


def _digest(sections: dict[str, Any]) -> str:
    text = json.dumps(sections, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def cluster_file_hash(config: Any) -> str:
    """sha256 of the shared sections (`cluster` + `components`, not `node`/`agent`) as the file wrote them.

    Members publish it so peers detect differing files. It hashes the data, not the text (comments and key
    order do not count) and not the validated model (so folders and agent versions do not either).
    """
    shared = getattr(config, "shared", None)
    if shared is not None:
        return str(shared.digest())
    return _digest({
        "cluster": to_plain(config.cluster),
        "components": {n: to_plain(c) for n, c in config.components.items()},
    })  # fmt: skip

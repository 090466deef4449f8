"""The cluster file, member by member: who is who, and each member's component settings before DP expansion.

Pure. A member's settings of a component are the file's `components.<name>`, then (for the vLLM component) its
group's keys, then its own entry's `components.<name>`, validated together; `env` merges key by key, every other
key replaces. Problems are reported as (key path, message) so the loader can name the file and line.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from typing import Any

from nodeagent.config.base import Invalid, fields_of, replace, validate
from nodeagent.config.cluster import ClusterConfig, SharedSections, VllmGroup
from nodeagent.config.model import Component, NodeConfig, VllmComponent, prepare_component

KeyPath = tuple[str | int, ...]

DERIVED_VLLM_KEYS = frozenset(
    {"data_parallel_size", "data_parallel_start_rank", "data_parallel_rank", "headless", "group"}
)
"""Computed from the groups in a cluster file; writing them there is an error (they would be ignored)."""
GROUP_UNIFORM_KEYS = frozenset(
    {"tensor_parallel_size", "enable_expert_parallel", "data_parallel_rpc_port", "data_parallel_address"}
)
"""The same on every node of a group: set on the component or the group, never in a node entry."""
DERIVED_PROXY_KEYS = frozenset({"prefillers", "decoders", "served_model_name"})
VLLM_GROUP_KEYS = frozenset(fields_of(VllmComponent)) - DERIVED_VLLM_KEYS


class ClusterFileError(ValueError):
    """One or more problems, each with the key path it is about."""

    def __init__(self, problems: list[tuple[KeyPath, str]]) -> None:
        problems = list(dict.fromkeys(problems))  # a check reached along several paths is one problem
        super().__init__("; ".join(f"{'.'.join(map(str, p))}: {m}" for p, m in problems))
        self.problems = problems


def vllm_template(components: Mapping[str, Any]) -> str | None:
    """The one vLLM component a cluster file expands per group (None: the file runs no vLLM)."""
    names = [n for n, c in components.items() if isinstance(c, dict) and c.get("kind") == "vllm"]
    if len(names) > 1:
        raise ClusterFileError([(("components", names[1]), "a cluster file has one vllm component, expanded "
                                 f"per group and node (found {', '.join(names)}); use cluster.vllm_groups")])
    return names[0] if names else None


def effective_groups(cluster: ClusterConfig, template: str | None) -> list[VllmGroup]:
    """The file's groups, or the default: one group of all nodes named after the vLLM component."""
    if cluster.vllm_groups is not None:
        return list(cluster.vllm_groups)
    if template is None:
        return []
    return [VllmGroup(name=template, kind="mixed", nodes=[n.name for n in cluster.nodes], dp_launch="internal")]


def check_cluster(cluster: ClusterConfig, components: Mapping[str, Any]) -> list[tuple[KeyPath, str]]:
    """Members, groups and the keys only the layout may set."""
    problems: list[tuple[KeyPath, str]] = []
    seen: dict[str, int] = {}
    masters = []
    for i, node in enumerate(cluster.nodes):
        if node.name in seen:
            problems.append((("cluster", "nodes", i, "name"), f"duplicate node name {node.name!r} "
                             f"(also cluster.nodes.{seen[node.name]})"))
        seen.setdefault(node.name, i)
        if node.role == "master":
            masters.append(i)
        for comp in node.components:
            if comp not in components:
                problems.append((("cluster", "nodes", i, "components", comp),
                                 f"unknown component {comp!r} (components: {', '.join(components)})"))
    if not masters:
        problems.append((("cluster", "nodes"), "no master: give exactly one node role: master (it runs etcd)"))
    for i in masters[1:]:
        problems.append((("cluster", "nodes", i, "role"), f"two masters: {cluster.nodes[masters[0]].name!r} "
                         f"and {cluster.nodes[i].name!r}; exactly one node runs etcd"))
    problems += _check_etcd_members(cluster, seen, masters)
    template = vllm_template(components)
    problems += _check_groups(cluster, template, seen)
    problems += _check_derived(cluster, components, template)
    return list(dict.fromkeys(problems))


def _check_etcd_members(cluster: ClusterConfig, members: Mapping[str, int],
                        masters: list[int]) -> list[tuple[KeyPath, str]]:  # fmt: skip
    problems: list[tuple[KeyPath, str]] = []
    names = cluster.etcd_members
    for i, name in enumerate(names):
        if name not in members:
            problems.append((("cluster", "etcd_members", i), f"unknown node {name!r} (nodes: {', '.join(members)})"))
        elif name in names[:i]:
            problems.append((("cluster", "etcd_members", i), f"{name!r} is listed twice"))
    if names and masters and cluster.nodes[masters[0]].name not in names:
        problems.append((("cluster", "etcd_members"), f"the master {cluster.nodes[masters[0]].name!r} must be an "
                         "etcd member: its agent starts etcd before it coordinates"))
    if len(names) == 2:
        problems.append((("cluster", "etcd_members"), "2 etcd members tolerate no failure: use 1, 3 or 5"))
    return problems


def _check_groups(cluster: ClusterConfig, template: str | None,
                  members: Mapping[str, int]) -> list[tuple[KeyPath, str]]:
    problems: list[tuple[KeyPath, str]] = []
    if cluster.vllm_groups is not None and template is None:
        return [(("cluster", "vllm_groups"), "vllm_groups need a vllm component in components")]
    owner: dict[str, str] = {}
    names: set[str] = set()
    for j, group in enumerate(cluster.vllm_groups or []):
        where = ("cluster", "vllm_groups", j)
        if group.name in names:
            problems.append(((*where, "name"), f"duplicate group name {group.name!r}"))
        names.add(group.name)
        for k, node in enumerate(group.nodes):
            if node not in members:
                problems.append(((*where, "nodes", k), f"unknown node {node!r} (members: {', '.join(members)})"))
            elif node in owner:
                problems.append(((*where, "nodes", k), f"node {node!r} is in two groups: {owner[node]!r} and "
                                 f"{group.name!r}"))
            owner.setdefault(node, group.name)
        for key in group.settings:
            if key not in VLLM_GROUP_KEYS:
                problems.append(((*where, key), _not_a_vllm_key(key)))
    return problems


def _not_a_vllm_key(key: str) -> str:
    if key in DERIVED_VLLM_KEYS:
        return f"{key} is derived from the groups' nodes; remove it"
    close = difflib.get_close_matches(key, sorted(VLLM_GROUP_KEYS), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key!r} is not a vLLM component setting{hint}"


def _check_derived(cluster: ClusterConfig, components: Mapping[str, Any],
                   template: str | None) -> list[tuple[KeyPath, str]]:
    problems: list[tuple[KeyPath, str]] = []
    derived = {n: (DERIVED_VLLM_KEYS if c.get("kind") == "vllm" else DERIVED_PROXY_KEYS)
               for n, c in components.items() if isinstance(c, dict) and c.get("kind") in ("vllm", "proxy")}
    for name, keys in derived.items():
        for key in sorted(keys & set(components[name])):
            problems.append((("components", name, key), f"{key} is derived from cluster.vllm_groups; remove it"))
    for i, node in enumerate(cluster.nodes):
        for name, override in node.components.items():
            where = ("cluster", "nodes", i, "components", name)
            for key in sorted(derived.get(name, frozenset()) & set(override)):
                problems.append(((*where, key), f"{key} is derived from cluster.vllm_groups; remove it"))
            if name == template:
                for key in sorted(GROUP_UNIFORM_KEYS & set(override)):
                    problems.append(((*where, key), f"{key} must be the same on every node of a group: set it on "
                                     "the group (cluster.vllm_groups) or the component"))
            if "kind" in override:
                problems.append(((*where, "kind"), "a node entry cannot change a component's kind"))
    return problems


def _merge(layers: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, int]]:
    """Later layers win; `env` merges key by key. Also: which layer each top-level key came from."""
    merged: dict[str, Any] = {}
    origin: dict[str, int] = {}
    for index, layer in enumerate(layers):
        for key, value in layer.items():
            if key == "env" and isinstance(value, dict) and isinstance(merged.get("env"), dict):
                merged["env"] = {**merged["env"], **value}
            else:
                merged[key] = copy.deepcopy(value)
            origin[key] = index
    return merged, origin


def member_components(cluster: ClusterConfig, shared: SharedSections) -> dict[str, dict[str, Any]]:
    """node → component → validated settings (file, then group, then the node's entry), before DP expansion.

    A node outside every group runs no vLLM.
    """
    template = vllm_template(shared.components)
    group_of = {n: (j, g) for j, g in enumerate(effective_groups(cluster, template)) for n in g.nodes}
    explicit_groups = cluster.vllm_groups is not None
    problems: list[tuple[KeyPath, str]] = []
    out: dict[str, dict[str, Any]] = {}
    for i, node in enumerate(cluster.nodes):
        comps: dict[str, Any] = {}
        for name, raw in shared.components.items():
            sources: list[KeyPath] = [("components", name)]
            layers = [raw]
            if name == template:
                if node.name not in group_of:
                    continue
                j, group = group_of[node.name]
                if explicit_groups:
                    sources.append(("cluster", "vllm_groups", j))
                    layers.append(group.settings)
            if name in node.components:
                sources.append(("cluster", "nodes", i, "components", name))
                layers.append(node.components[name])
            merged, origin = _merge(layers)
            try:
                comps[name] = validate(Component, prepare_component(merged), shared.base_dir)
            except Invalid as exc:
                problems += _locate(exc, origin, sources)
        out[node.name] = comps
    if problems:
        raise ClusterFileError(problems)
    return out


def _locate(exc: Invalid, origin: dict[str, int], sources: list[KeyPath]) -> list[tuple[KeyPath, str]]:
    """Each problem at the layer that wrote its key (the file's component, the group, the node's entry)."""
    found = []
    for p in exc.problems:
        key = p.path[0] if p.path else None
        base = sources[origin[key]] if isinstance(key, str) and key in origin else sources[-1]
        found.append(((*base, *p.path), p.text()))
    return found


def identify_node(cluster: ClusterConfig, node_raw: Mapping[str, Any], node: NodeConfig,
                  override: str | None = None) -> NodeConfig:
    """This member: its name (override, `node.name`, else the host name) and its entry's ip, role and NIC.

    An explicit `node.ip`/`node.role`/`node.nic_name` must agree with the entry; a NIC the entry leaves out
    may come from `node.nic_name`.
    """
    name = override or node.name
    entries = {n.name: n for n in cluster.nodes}
    if name not in entries:
        members = ", ".join(entries)
        if override:
            raise ClusterFileError([(("cluster", "nodes"), f"--node {name!r} is not a member ({members})")])
        if "name" in node_raw:
            raise ClusterFileError([(("node", "name"), f"{name!r} has no entry in cluster.nodes ({members})")])
        raise ClusterFileError([(("cluster", "nodes"), f"this host {name!r} (node.name defaults to the host name) "
                                 f"has no entry here ({members}); set node.name or pass --node")])
    entry = entries[name]
    problems: list[tuple[KeyPath, str]] = []
    for key in ("ip", "role", "nic_name"):
        wanted = getattr(entry, key)
        if key in node_raw and wanted is not None and getattr(node, key) != wanted:
            problems.append((("node", key), f"{getattr(node, key)!r} disagrees with cluster.nodes entry "
                             f"{name!r} ({key}: {wanted!r}); remove node.{key}"))
    if problems:
        raise ClusterFileError(problems)
    return replace(node, name=name, ip=entry.ip, role=entry.role, nic_name=entry.nic_name or node.nic_name)

"""Load the YAML config: the raw layer (`config_raw`: each key's line, `${VAR}`), then validate and explain errors.

An error reads `FILE:LINE: key.path: what is wrong` so an operator can go straight to it at 3 a.m.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

from nodeagent.config.base import Invalid, replace
from nodeagent.config.cluster import SharedSections
from nodeagent.config.cluster_file import (
    ClusterFileError,
    check_cluster,
    identify_node,
    member_components,
    vllm_template,
)
from nodeagent.config.layout import build_layout
from nodeagent.config.model import Config, EtcdComponent, ProxyComponent, VllmComponent, validate_config
from nodeagent.config.raw import RawTree, dotted, read_config_text
from nodeagent.core.errors import ConfigError


def _explain(filename: str, tree: RawTree, exc: Invalid) -> ConfigError:
    return ConfigError("\n".join(f"{filename}:{_line(tree, p.path)}: {dotted(p.path)}: {p.text()}"
                                  for p in exc.problems))


def _line(tree: RawTree, path: typing.Sequence[str | int]) -> int | str:
    path = tuple(path)
    return next((tree.lines[path[:n]] for n in range(len(path), -1, -1) if path[:n] in tree.lines), "?")


def _cluster_error(filename: str, tree: RawTree, exc: ClusterFileError) -> ConfigError:
    return ConfigError("\n".join(f"{filename}:{_line(tree, p)}: {dotted(p)}: {m}" for p, m in exc.problems))


def _single_node(config: Config, data: dict[str, Any]) -> Config:
    """Today's single node, rendered exactly as before; each vLLM component is its own group."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    if config.cluster.vllm_groups is not None:
        problems.append((("cluster", "vllm_groups"), "vllm_groups need cluster.nodes (the members)"))
    comps = dict(config.components)
    for name, comp in config.components.items():
        if isinstance(comp, ProxyComponent):
            problems.append((("components", name), "the proxy's backends come from cluster.vllm_groups: it needs "
                             "cluster.nodes"))
        elif isinstance(comp, VllmComponent):
            if "group" in data["components"][name]:
                problems.append((("components", name, "group"), "group is derived; remove it"))
            comps[name] = replace(comp, group=name)
    if problems:
        raise ClusterFileError(problems)
    config = replace(config, components=comps)
    etcd = [c for c in config.active_components().values() if isinstance(c, EtcdComponent)]
    if etcd and "etcd_endpoints" not in (data.get("cluster") or {}):
        # The etcd this node runs listens on the node's address (the guide's ETCD_IP = `hostname -I`), not on
        # loopback: the agent's own etcd client goes where the worker's --etcd_address goes.
        address = f"{etcd[0].listen_ip or config.node.ip}:{etcd[0].client_port}"
        config = replace(config, cluster=replace(config.cluster, etcd_endpoints=[address]))
    return config


def resolve_member(config: Config, data: dict[str, Any], node: str | None = None) -> Config:
    """A cluster file → this member's config: its node (from its entry) and exactly the components it runs."""
    cluster, shared = config.cluster, config.shared
    assert shared is not None
    problems = check_cluster(cluster, shared.components)
    if problems:
        raise ClusterFileError(problems)
    me = identify_node(cluster, data.get("node") or {}, config.node, node)
    layout = build_layout(cluster, member_components(cluster, shared), vllm_template(shared.components))
    if layout.etcd_address is not None:
        listed = [e.removeprefix("http://").rstrip("/") for e in cluster.etcd_endpoints]
        ours = layout.etcd_address.split(",")
        if "etcd_endpoints" not in (data.get("cluster") or {}):
            cluster = replace(cluster, etcd_endpoints=ours)
        elif not set(ours) & set(listed):
            raise ClusterFileError([(("cluster", "etcd_endpoints"), f"the cluster's etcd runs at "
                                     f"{layout.etcd_address}, none of which is listed ({', '.join(listed)})")])
    return replace(config, node=me, cluster=cluster, components=layout.node_components(me.name))


def parse_config(text: str, filename: str = "<config>", base_dir: Path | None = None,
                 env: typing.Mapping[str, str] | None = None, node: str | None = None) -> Config:
    """`node`: render this member of a cluster file (default: `node.name`, else the host name)."""
    tree = RawTree(filename, os.environ if env is None else env)
    data = tree.build(text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"{filename}:1: the config must be a mapping of sections, got {kind}")
    try:
        config = validate_config(data, base_dir)
    except Invalid as exc:
        raise _explain(filename, tree, exc) from None
    shared = SharedSections(cluster=data.get("cluster") or {}, components=data.get("components") or {},
                            base_dir=base_dir, source=filename)
    config = replace(config, source=Path(filename) if base_dir else None, shared=shared)
    try:
        if config.cluster.nodes:
            return resolve_member(config, data, node)
        if node is not None and node != config.node.name:
            raise ClusterFileError([(("node", "name"), f"--node {node!r}: this config has no cluster.nodes; it "
                                     f"describes node {config.node.name!r} only")])
        return _single_node(config, data)
    except ClusterFileError as exc:
        raise _cluster_error(filename, tree, exc) from None


def load_config(path: str | Path, node: str | None = None, env: typing.Mapping[str, str] | None = None) -> Config:
    path, text = read_config_text(path)
    return parse_config(text, str(path), base_dir=path.resolve().parent, env=env, node=node)

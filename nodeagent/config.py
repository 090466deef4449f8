"""Load the YAML config: the raw layer (`config_raw`: each key's line, `${VAR}`), then validate and explain errors.

An error reads `FILE:LINE: key.path: what is wrong` so an operator can go straight to it at 3 a.m.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from nodeagent.cluster_file import (
    ClusterFileError,
    check_cluster,
    identify_node,
    member_components,
    vllm_template,
)
from nodeagent.config_cluster import SharedSections
from nodeagent.config_model import Component, Config, ProbeSpec, ProxyComponent, VllmComponent
from nodeagent.config_raw import KeyPath, RawTree, dotted, read_config_text
from nodeagent.errors import ConfigError
from nodeagent.layout import build_layout


def _data_path(data: Any, loc: typing.Sequence[str | int]) -> KeyPath:
    """Map a pydantic error location onto the YAML path (drop union tags and list wrapping)."""
    path: list[str | int] = []
    cur = data
    for part in loc:
        in_list = isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur)
        if (isinstance(cur, dict) and part in cur) or in_list:
            path.append(part)
            cur = cur[part]
        elif isinstance(cur, dict) and (isinstance(part, int) or part in _KIND_TAGS):
            continue
        else:
            path.append(part)
            cur = None
    return tuple(path)


def _members(ann: Any) -> list[Any]:
    """The alternatives of an annotation, with Annotated and None stripped."""
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(ann) if a is not type(None) for m in _members(a)]
    return [ann]


def _tag_of(model: Any) -> tuple[Any, ...]:
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return ()
    field = model.model_fields.get("kind")
    return typing.get_args(field.annotation) if field else ()


def _allowed_keys(loc: typing.Sequence[str | int]) -> list[str]:
    """The keys valid at a pydantic location, walking the model types (union tags pick the member)."""
    ann: Any = Config
    for part in loc:
        members = _members(ann)
        tagged = [m for m in members if part in _tag_of(m)]
        if tagged:
            ann = tagged[0]
            continue
        ann = members[0] if len(members) == 1 else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(str(part))
            if field is None:
                return []
            ann = field.annotation
        elif typing.get_origin(ann) in (dict, list):
            ann = typing.get_args(ann)[-1]
        else:
            return []
    members = _members(ann)
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return [name for name, f in members[0].model_fields.items() if not f.exclude]
    return []


_KIND_TAGS = frozenset(
    tag for union in (Component, ProbeSpec) for member in _members(union) for tag in _tag_of(member)
)


def _explain(filename: str, tree: RawTree, data: Any, exc: ValidationError) -> ConfigError:
    messages = []
    for err in exc.errors(include_url=False):
        path = _data_path(data, err["loc"])
        line = next((tree.lines[path[:n]] for n in range(len(path), -1, -1) if path[:n] in tree.lines), "?")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            key = str(path[-1])
            msg = f"unknown key {key!r}"
            close = difflib.get_close_matches(key, _allowed_keys(err["loc"][:-1]), n=1, cutoff=0.6)
            if close:
                msg += f" (did you mean {close[0]!r}?)"
        elif err["type"] == "union_tag_invalid":
            msg = f"unknown kind {err['input'].get('kind')!r}; expected one of {err['ctx']['expected_tags']}"
        elif err["type"] == "union_tag_not_found":
            msg = "missing 'kind'"
        messages.append(f"{filename}:{line}: {dotted(path)}: {msg}")
    return ConfigError("\n".join(messages))


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
            comps[name] = comp.model_copy(update={"group": name})
    if problems:
        raise ClusterFileError(problems)
    return config.model_copy(update={"components": comps})


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
        if "etcd_endpoints" not in cluster.model_fields_set:
            cluster = cluster.model_copy(update={"etcd_endpoints": ours})
        elif not set(ours) & set(listed):
            raise ClusterFileError([(("cluster", "etcd_endpoints"), f"the cluster's etcd runs at "
                                     f"{layout.etcd_address}, none of which is listed ({', '.join(listed)})")])
    return config.model_copy(update={"node": me, "cluster": cluster,
                                     "components": layout.node_components(me.name)})


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
        config = Config.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise _explain(filename, tree, data, exc) from None
    shared = SharedSections(cluster=data.get("cluster") or {}, components=data.get("components") or {},
                            base_dir=base_dir, source=filename)
    config = config.model_copy(update={"source": Path(filename) if base_dir else None, "shared": shared})
    try:
        if config.cluster.nodes:
            return resolve_member(config, data, node)
        if node is not None and node != config.node.name:
            raise ClusterFileError([(("node", "name"), f"--node {node!r}: this config has no cluster.nodes; it "
                                     f"describes node {config.node.name!r} only")])
        return _single_node(config, data)
    except ClusterFileError as exc:
        raise _cluster_error(filename, tree, exc) from None


def load_config(path: str | Path, node: str | None = None) -> Config:
    path, text = read_config_text(path)
    return parse_config(text, str(path), base_dir=path.resolve().parent, node=node)

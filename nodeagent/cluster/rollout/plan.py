"""Pure: which vLLM groups a new cluster file changes, and in which order they may change without taking the
cluster down (`nodeagentctl cluster rollout FILE`).

Each member's components are rendered from both files (argv, environment, cwd, written files, the container
image) and compared; a group changes when any of its ranks renders differently. A rollout changes config, never
topology (members, groups, their nodes and kinds): those need `cluster redeploy`. A change outside the vLLM
groups (etcd, the datasystem worker, the proxy) is not what a rolling restart of groups can carry: refused.

The capacity floor: every kind the cluster serves (prefill and decode, or mixed) keeps at least one group
serving, and never more than `max_unavailable` groups are down at once. A kind with a single group goes down
for its step: the plan refuses unless the operator allowed that kind's outage, and then states how long the
outage is expected to last (that group's last load time). A prefill↔decode incompatible change (the KV
connector or the vllm-ascend version differ) cannot mix old and new groups behind one proxy, which routes each
request to any prefill and any decode: the plan switches one prefill + decode pair first, then every remaining
group at once (the new pair carries the cluster meanwhile), or refuses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from nodeagent.config.base import replace as struct_replace
from nodeagent.config.layout import ClusterLayout, cluster_layout

if TYPE_CHECKING:
    from nodeagent.config.model import Config

KINDS = ("prefill", "decode", "mixed")


class PlanError(ValueError):
    """The rollout's options do not fit the cluster (an unknown canary group, a bad --order)."""


@dataclass(frozen=True)
class Options:
    max_unavailable: int = 1
    order: tuple[str, ...] = ("prefill", "decode")
    canary: str | None = None
    bake_s: float = 600.0
    allow_outage: frozenset[str] = frozenset()
    drain_timeout_s: float = 120.0
    gate_timeout_s: float = 5400.0
    """From the restart to every rank ready and the canary answered (a DeepSeek-V4 load takes 30-60 min)."""
    bake_error_rate: float = 0.05
    """The bake fails when more of the group's requests than this fail (`rollout_bake`)."""
    bake_ttft_factor: float = 2.0
    """The bake fails when the group's mean TTFT is more than this times the one before the step."""

    def to_dict(self) -> dict[str, Any]:
        return {"max_unavailable": self.max_unavailable, "order": list(self.order), "canary": self.canary,
                "bake_s": self.bake_s, "allow_outage": sorted(self.allow_outage),
                "drain_timeout_s": self.drain_timeout_s, "gate_timeout_s": self.gate_timeout_s,
                "bake_error_rate": self.bake_error_rate, "bake_ttft_factor": self.bake_ttft_factor}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Options:
        """From an API body or a stored record; raises PlanError naming the bad key."""
        out: dict[str, Any] = {}
        try:
            if "max_unavailable" in data:
                out["max_unavailable"] = int(data["max_unavailable"])
                if out["max_unavailable"] < 1:
                    raise PlanError("max_unavailable must be at least 1")
            if "order" in data:
                order = data["order"]
                order = order.split(",") if isinstance(order, str) else list(order)
                bad = [k for k in order if k not in KINDS]
                if bad or not order:
                    raise PlanError(f"order: unknown kind {bad[0] if bad else '(empty)'!r} (kinds: {', '.join(KINDS)})")
                out["order"] = tuple(order)
            if data.get("canary") is not None:
                out["canary"] = str(data["canary"])
            for key in ("bake_s", "drain_timeout_s", "gate_timeout_s"):
                if key in data:
                    out[key] = float(data[key])
                    if out[key] < 0:
                        raise PlanError(f"{key} must not be negative")
            if "bake_error_rate" in data:
                out["bake_error_rate"] = float(data["bake_error_rate"])
                if not 0 <= out["bake_error_rate"] <= 1:
                    raise PlanError("bake_error_rate must be between 0 and 1 (a fraction: 0.05 is 5%)")
            if "bake_ttft_factor" in data:
                out["bake_ttft_factor"] = float(data["bake_ttft_factor"])
                if out["bake_ttft_factor"] < 1:
                    raise PlanError("bake_ttft_factor must be at least 1 (2 fails a TTFT twice the one before)")
            if "allow_outage" in data:
                kinds = data["allow_outage"]
                kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
                bad = [k for k in kinds if k not in KINDS]
                if bad:
                    raise PlanError(f"allow_outage: unknown kind {bad[0]!r} (kinds: {', '.join(KINDS)})")
                out["allow_outage"] = frozenset(kinds)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"bad rollout option: {exc}") from None
        return cls(**out)


@dataclass(frozen=True)
class GroupChange:
    group: str
    kind: str
    nodes: tuple[str, ...]
    reasons: tuple[str, ...]
    """What renders differently, rank by rank (`n1/vllm: --max_model_len 4096 → 8192`)."""
    incompatible: tuple[str, ...] = ()
    """Why old and new ranks of this change cannot exchange KV (connector, vllm-ascend version)."""


@dataclass(frozen=True)
class PlannedStep:
    groups: tuple[str, ...]
    kinds: tuple[str, ...]
    outage: tuple[str, ...] = ()
    """Kinds with no group left serving during this step (allowed by --allow-outage)."""
    expected_outage_s: float | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "kinds": list(self.kinds), "outage": list(self.outage),
                "expected_outage_s": self.expected_outage_s, "note": self.note}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    old_hash: str
    new_hash: str
    options: Options
    changes: tuple[GroupChange, ...] = ()
    unchanged: tuple[str, ...] = ()
    steps: tuple[PlannedStep, ...] = ()
    incompatible: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    """Why this plan cannot run (empty: it can)."""
    notes: tuple[str, ...] = field(default=())
    exclusive: bool = False
    """Old and new groups are never routed together: the proxy switches from the old groups to the first pair."""
    switch_gap_s: float | None = None
    """An exclusive plan's expected time with no group in the proxy at the switch."""

    @property
    def ok(self) -> bool:
        return not self.refused and bool(self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"old_hash": self.old_hash, "new_hash": self.new_hash, "options": self.options.to_dict(),
                "changes": [{"group": c.group, "kind": c.kind, "nodes": list(c.nodes), "reasons": list(c.reasons),
                             "incompatible": list(c.incompatible)} for c in self.changes],
                "unchanged": list(self.unchanged), "steps": [s.to_dict() for s in self.steps],
                "incompatible": list(self.incompatible), "refused": list(self.refused),
                "notes": list(self.notes), "ok": self.ok, "exclusive": self.exclusive,
                "switch_gap_s": self.switch_gap_s}  # fmt: skip


# ---- rendering both files -------------------------------------------------------------------------------------


def member_config(config: Config, layout: ClusterLayout, name: str) -> Config:
    """What member `name` would load from this file (its node entry, exactly its components)."""
    m = layout.member(name)
    node = struct_replace(config.node, name=m.name, ip=m.ip, role=m.role, nic_name=m.nic_name)
    return struct_replace(config, node=node, components=layout.node_components(name))


def rendered(config: Config, base_env: Mapping[str, str]) -> dict[str, dict[str, dict[str, Any]]]:
    """member → component → what it is launched with (argv, env, unset, cwd, files, image)."""
    from nodeagent.render.launch import render_component

    layout = cluster_layout(config)
    image = config.container.image if config.container is not None else None
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for m in layout.members:
        cfg = member_config(config, layout, m.name)
        comps = {}
        for comp in layout.components_of(m.name):
            spec = render_component(comp, cfg, base_env)
            inside = bool(getattr(cfg.components.get(comp), "container", True))
            comps[comp] = {"argv": list(spec.argv), "env": dict(spec.env), "unset": sorted(spec.unset),
                           "cwd": str(spec.cwd), "files": {str(k): v for k, v in spec.files.items()},
                           "image": image if inside else None}  # fmt: skip
        out[m.name] = comps
    return out


def _flags(argv: Sequence[str]) -> dict[str, str]:
    """`--flag value` / `--flag=value` / `--switch` → {flag: value}; positional words keyed by position."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("--"):
            if "=" in word:
                key, _, value = word.partition("=")
                out[key] = value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[word], i = argv[i + 1], i + 1
            else:
                out[word] = ""
        else:
            out[f"arg{i}"] = word
        i += 1
    return out


def _short(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[: limit - 1] + "…"


def describe_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """One line per difference; environment values are not shown (they may be secrets)."""
    lines = []
    a, b = _flags(old["argv"]), _flags(new["argv"])
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            if key not in b:
                lines.append(f"{key} removed")
            elif key not in a:
                lines.append(f"{key} {_short(b[key])} added".replace("  ", " "))
            else:
                lines.append(f"{key} {_short(a[key])} → {_short(b[key])}")
    for key in sorted(old["env"].keys() | new["env"].keys()):
        if old["env"].get(key) != new["env"].get(key):
            what = "added" if key not in old["env"] else "removed" if key not in new["env"] else "changed"
            lines.append(f"env {key} {what}")
    for key in ("unset", "cwd", "files"):
        if old[key] != new[key]:
            lines.append(f"{key} changed")
    if old["image"] != new["image"]:
        lines.append(f"image {old['image']} → {new['image']}")
    return lines


def _connectors(kv_config: str | None) -> tuple[str, ...]:
    """The KV connector classes of a rendered --kv-transfer-config (a MultiConnector's parts included)."""
    if not kv_config:
        return ()
    try:
        data = json.loads(kv_config)
    except ValueError:
        return (kv_config,)
    names = [str(data.get("kv_connector"))]
    extra = data.get("kv_connector_extra_config") or {}
    for part in extra.get("connectors") or []:
        if isinstance(part, dict):
            names.append(str(part.get("kv_connector")))
            names.append(f"use_ascend_direct={(part.get('kv_connector_extra_config') or {}).get('use_ascend_direct')}")
    return tuple(names)


def _version(image: str | None) -> str | None:
    return image.rsplit(":", 1)[-1] if image and ":" in image.rsplit("/", 1)[-1] else image


def incompatibility(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    out = []
    a = _connectors(_flags(old["argv"]).get("--kv-transfer-config"))
    b = _connectors(_flags(new["argv"]).get("--kv-transfer-config"))
    if a != b:
        out.append(f"KV connector {'/'.join(a) or 'none'} → {'/'.join(b) or 'none'}")
    if _version(old["image"]) != _version(new["image"]):
        out.append(f"vllm-ascend version {_version(old['image'])} → {_version(new['image'])}")
    return out


def topology_problems(old: ClusterLayout, new: ClusterLayout) -> list[str]:
    """A rollout changes config, never the cluster's shape."""
    problems = []
    if [(m.name, m.ip, m.role) for m in old.members] != [(m.name, m.ip, m.role) for m in new.members]:
        problems.append("the members (names, addresses, roles) differ")
    shape = {g.name: (g.kind, g.nodes, g.components(g.head)) for g in old.groups}
    for g in new.groups:
        if g.name not in shape:
            problems.append(f"group {g.name} is new")
        elif shape.pop(g.name) != (g.kind, g.nodes, g.components(g.head)):
            problems.append(f"group {g.name} changes its kind, nodes or ranks")
    problems += [f"group {name} is removed" for name in shape]
    return [p + ": that is a topology change (nodeagentctl cluster redeploy), not a rollout" for p in problems]


def diff(old: Config, new: Config, base_env: Mapping[str, str]) -> tuple[list[GroupChange], list[str], list[str]]:
    """(changed groups, unchanged group names, problems: topology or changes outside the groups)."""
    old_layout, new_layout = cluster_layout(old), cluster_layout(new)
    problems = topology_problems(old_layout, new_layout)
    if problems:
        return [], [], problems
    a, b = rendered(old, base_env), rendered(new, base_env)
    owner = {(n, c): g for g in old_layout.groups for n in g.nodes for c in g.components(n)}
    node_group = {n: g for g in old_layout.groups for n in g.nodes}
    reasons: dict[str, list[str]] = {g.name: [] for g in old_layout.groups}
    incompatible: dict[str, list[str]] = {g.name: [] for g in old_layout.groups}
    for node, comps in a.items():
        for comp, spec in comps.items():
            other = b[node].get(comp)
            if other is None or other == spec:
                if other is None:
                    problems.append(f"{node}/{comp} is not in the new file")
                continue
            group = owner.get((node, comp))
            lines = describe_difference(spec, other)
            if group is None and {**spec, "image": None} == {**other, "image": None} and node in node_group:
                # only the image: the component restarts with its node's container, in the step of its group
                group = node_group[node]
                lines = [f"{line} (restarts with the node's container)" for line in lines]
            if group is None:
                problems.append(f"{node}/{comp} changes ({'; '.join(lines)}): a rollout restarts vLLM groups "
                                "only; change it with `nodeagentctl reload` on that node")  # fmt: skip
                continue
            reasons[group.name] += [f"{node}/{comp}: {line}" for line in lines]
            incompatible[group.name] += [i for i in incompatibility(spec, other) if i not in incompatible[group.name]]
    problems += [f"{node}/{comp} is new in the new file" for node, comps in b.items() for comp in comps
                 if comp not in a.get(node, {})]  # fmt: skip
    changes = [GroupChange(g.name, g.kind, g.nodes, tuple(reasons[g.name]), tuple(incompatible[g.name]))
               for g in old_layout.groups if reasons[g.name]]  # fmt: skip
    return changes, [g.name for g in old_layout.groups if not reasons[g.name]], problems


# ---- ordering under the floor -----------------------------------------------------------------------------------


def _outage_s(groups: Sequence[str], load_s: Mapping[str, float]) -> float | None:
    known = [load_s[g] for g in groups if g in load_s]
    return max(known) if known else None


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "unknown (no load of it seen since its agents started)"
    return f"~{seconds / 60:.0f} min" if seconds >= 120 else f"~{seconds:.0f} s"


def _basis(groups: Sequence[str], measured: frozenset[str]) -> str:
    """What an expected outage is made of: the load alone, until a rollout measured the rest."""
    if measured and all(g in measured for g in groups):
        return "its last load + drain, stop and proxy re-add as its last rollout step measured them"
    return "its last load"


def order_steps(changes: Sequence[GroupChange], kind_counts: Mapping[str, int], options: Options,
                load_s: Mapping[str, float], measured: frozenset[str] = frozenset(),
                ) -> tuple[list[PlannedStep], list[str]]:  # fmt: skip
    """Steps of compatible changes: the canary alone first, then kind by kind (`order`), each step at most
    max_unavailable groups and never every group of a kind unless that kind's outage is allowed."""
    rank = {k: i for i, k in enumerate([*options.order, *(k for k in KINDS if k not in options.order)])}
    queue = sorted(changes, key=lambda c: (c.group != options.canary, rank[c.kind]))
    steps: list[PlannedStep] = []
    refused: list[str] = []
    while queue:
        first = queue.pop(0)
        batch = [first]
        while (first.group != options.canary and queue and queue[0].kind == first.kind
               and len(batch) < options.max_unavailable and len(batch) + 1 < kind_counts[first.kind]):  # fmt: skip
            batch.append(queue.pop(0))
        names = tuple(c.group for c in batch)
        outage: tuple[str, ...] = ()
        expected = None
        note = "canary" if first.group == options.canary else ""
        if len(batch) >= kind_counts[first.kind]:
            outage = (first.kind,)
            expected = _outage_s(names, load_s)
            if first.kind not in options.allow_outage:
                refused.append(f"{first.kind} has {'one group' if kind_counts[first.kind] == 1 else 'no other group'} "
                               f"({', '.join(names)}): its step takes {first.kind} down for {_fmt_s(expected)} "
                               f"({_basis(names, measured)}); pass --allow-outage {first.kind}")  # fmt: skip
            # what it costs: that long with no group of the kind, each request through the proxy failing meanwhile
            note = (f"{first.kind} outage expected {_fmt_s(expected)} ({_basis(names, measured)}): requests through "
                    "the proxy fail meanwhile")  # fmt: skip
        steps.append(PlannedStep(names, (first.kind,), outage, expected, note))
    return steps, refused


def pair_steps(changes: Sequence[GroupChange], kind_counts: Mapping[str, int], options: Options,
               load_s: Mapping[str, float], switch_gap_s: float | None,
               ) -> tuple[list[PlannedStep], list[str]]:  # fmt: skip
    """An incompatible change: one prefill + decode pair first (the old groups serve meanwhile), then every
    remaining group at once. As the pair rejoins, the proxy switches: every old group leaves it, and the pair
    joins only once none is listed (`rollout_rules.fence`), so no request ever meets both files — which leaves
    the proxy with no group for about `switch_gap_s`, an outage of both kinds the operator must allow (None: no
    proxy of ours routes between the kinds). Why not keep the pair out until the rest switched: nothing would
    serve while the rest reload (30-60 min)."""
    prefill = [c for c in changes if c.kind == "prefill"]
    decode = [c for c in changes if c.kind == "decode"]
    if not prefill or not decode or len(prefill) != kind_counts["prefill"] or len(decode) != kind_counts["decode"]:
        return [], ["an incompatible prefill↔decode change must change every prefill and every decode group "
                    "(old and new groups cannot exchange KV): this file changes "
                    f"{', '.join(c.group for c in changes)}"]  # fmt: skip
    canary = next((c for c in changes if c.group == options.canary), None)
    pair = [canary] if canary is not None else []
    for group_list in (prefill, decode):
        if not any(c.kind == group_list[0].kind for c in pair):
            pair.append(group_list[0])
    rest = [c for c in changes if c not in pair]
    refused = []
    steps = []
    names = tuple(c.group for c in pair)
    outage = tuple(k for k in ("prefill", "decode") if kind_counts[k] == 1)
    expected = _outage_s(names, load_s) if outage else None
    for kind in outage:
        if kind not in options.allow_outage:
            refused.append(f"{kind} has one group: the pair's step takes {kind} down for {_fmt_s(expected)}; pass "
                           f"--allow-outage {kind}")  # fmt: skip
    missing = [k for k in ("prefill", "decode") if k not in options.allow_outage]
    if switch_gap_s is not None and missing:
        refused.append(f"an incompatible change switches the proxy from the old groups to the new pair with no group "
                       f"in it for {_fmt_s(switch_gap_s)} (the proxy cannot swap both kinds at once, and no request "
                       "may meet both files): pass --allow-outage prefill,decode")  # fmt: skip
    if options.max_unavailable < 2:
        refused.append("an incompatible change switches a prefill and a decode group together: needs "
                       "--max-unavailable 2 at least")  # fmt: skip
    down = f"; {'/'.join(outage)} down for {_fmt_s(expected)}" if outage else ""
    switch = (f"as it rejoins, the proxy switches (the old groups leave, then the pair joins: {_fmt_s(switch_gap_s)} "
              "with no group)" if switch_gap_s is not None else "no proxy of the agents keeps old and new apart")
    steps.append(PlannedStep(names, ("prefill", "decode"), outage, expected,
                             f"first pair: the old groups serve meanwhile{down}; {switch}"))
    if rest:
        if len(rest) > options.max_unavailable:
            refused.append(f"after the first pair the other {len(rest)} groups must switch at once (the proxy cannot "
                           f"keep old and new apart): needs --max-unavailable {len(rest)}")  # fmt: skip
        alone = _outage_s([c.group for c in rest], load_s)
        steps.append(PlannedStep(tuple(c.group for c in rest), tuple(sorted({c.kind for c in rest})), (), None,
                                 f"the rest at once, out of the proxy since the switch: {', '.join(names)} serve "
                                 f"alone meanwhile (their load {_fmt_s(alone)}, then the bake)"))  # fmt: skip
    return steps, refused


def switch_gap(config: Config) -> float | None:
    """Seconds with no group in the proxy at an exclusive switch: the old groups are deleted, then the pair is
    added once the sync sees them gone (`proxy_sync.FENCE_POLL_S`) and activated at the proxy's next instance
    check (`activation_check_s`; the script's own default is 10 s)."""
    from nodeagent.cluster.proxy_sync import FENCE_POLL_S

    layout = cluster_layout(config)
    checks = [getattr(layout.node_settings.get(p.node, {}).get(p.component), "activation_check_s", None)
              for p in layout.proxies]  # fmt: skip
    return max((c if c is not None else 10.0) for c in checks) + FENCE_POLL_S if checks else None


def make_plan(old: Config, new: Config, options: Options, *, old_hash: str, new_hash: str,
              load_s: Mapping[str, float] | None = None, base_env: Mapping[str, str] | None = None,
              overhead_s: Mapping[str, float] | None = None) -> Plan:  # fmt: skip
    """The plan from the running file to the new one. `load_s`: each group's last load time (start to ready);
    `overhead_s`: what its last measured step out of the proxy cost beyond that (drain, stop, proxy re-add:
    `rollout_view.measured_overhead_s`). A step's expected outage is their sum."""
    load_s = {g: s + (overhead_s or {}).get(g, 0.0) for g, s in (load_s or {}).items()}
    # Render both with the running file's agent section: only the shared sections are rolled out.
    new = struct_replace(new, agent=old.agent)
    changes, unchanged, problems = diff(old, new, base_env or {})
    layout = cluster_layout(old)
    groups = {g.name for g in layout.groups}
    if options.canary is not None and options.canary not in groups:
        raise PlanError(f"canary: unknown group {options.canary!r} (groups: {', '.join(sorted(groups))})")
    kind_counts = {k: sum(1 for g in layout.groups if g.kind == k) for k in KINDS}
    notes = []
    if options.canary is not None and options.canary not in {c.group for c in changes}:
        notes.append(f"canary {options.canary} does not change: the plan starts with the first changed group")
        options = replace(options, canary=None)
    incompatible = sorted({f"{c.group}: {why}" for c in changes for why in c.incompatible})
    steps: list[PlannedStep] = []
    exclusive, gap = False, None
    if not problems and changes:
        exclusive = bool(incompatible and kind_counts["prefill"] and kind_counts["decode"])
        if exclusive:
            gap = switch_gap(old)
            steps, refused = pair_steps(changes, kind_counts, options, load_s, gap)
        else:
            steps, refused = order_steps(changes, kind_counts, options, load_s,
                                         frozenset(g for g in overhead_s or {} if g in load_s))
        problems += refused
    if not problems and not changes:
        notes.append("no vLLM group renders differently: nothing to roll out")
    return Plan(old_hash, new_hash, options, tuple(changes), tuple(unchanged), tuple(steps), tuple(incompatible),
                tuple(problems), tuple(notes), exclusive, gap)  # fmt: skip

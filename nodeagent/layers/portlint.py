"""Every port one node's stack binds, as the cluster file renders it, checked against each other and against the
kernel's ephemeral range — pure, so preflight, `nodeagentctl ports` and tests share it.

Where the numbers come from (read in the sources, not guessed):
- vLLM: `--port` per serving process; `--data-parallel-rpc-port` on the group's address, bound by the process
  that serves DP rank 0 (vLLM's default 29550).
- vllm-ascend's Mooncake P2P connectors (`mooncake_connector.py`, `mooncake_hybrid_connector.py`): each worker
  listens on `kv_port + dp_rank * tp * pp + pp_rank * tp + tp_rank` (ZMQ handshake), so an engine of DP d × TP t
  takes kv_port .. kv_port + d·t - 1, each rank its own t ports on the node that runs it.
- Mooncake's AscendDirectTransport (ADXL, `FindAdxlListenPort`): a random free port in
  [base + 100·dev, base + 100·(dev+1)] per physical NPU, base 20000 or `ASCEND_BASE_PORT` — the range that took
  kv_port 20002 in vllm-ascend #8938. Its transfer engine's RPC port: random in 15000..17000
  (`MC_MIN_RPC_PORT`/`MC_MAX_RPC_PORT`).
- HCCL: 16 host ports from `HCCL_IF_BASE_PORT` (default 60000; Ascend's env-var reference asks to reserve them),
  or `HCCL_HOST_SOCKET_PORT_RANGE` when set (it wins).
- the datasystem worker, etcd's client and peer ports, the PD proxy, the agent's API.

A random pick cannot take a port that is already bound, but it can take a fixed listener's port before that
listener starts (#8938): a fixed port inside one of our random ranges is a collision. A fixed port inside
`net.ipv4.ip_local_port_range` can be handed to an outgoing connection before its listener binds (#15100): it
belongs in `net.ipv4.ip_local_reserved_ports`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.config.layout import DEFAULT_RPC_PORT
from nodeagent.config.model import Config, DatasystemComponent, EtcdComponent, ProxyComponent, VllmComponent

ADXL_BASE_PORT = 20000
ADXL_PORTS_PER_DEVICE = 100
"""Mooncake `utils.cpp`: kPortRange; the pick is inclusive of base + 100·(dev+1)."""
MOONCAKE_RPC_PORTS = (15000, 17000)
"""Mooncake `config.h`: rpc_min_port, rpc_max_port."""
HCCL_BASE_PORT = 60000
HCCL_PORTS = 16
DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default net.ipv4.ip_local_port_range."""
SYSCTL_DIR = "/proc/sys/net/ipv4"
COLLISION, EPHEMERAL, TAKEN = "collision", "ephemeral", "taken"


@dataclass(frozen=True)
class PortUse:
    """A port range one of our processes binds."""

    component: str
    purpose: str
    low: int
    high: int
    """Inclusive."""
    random: bool = False
    """The process picks a free port in the range when it starts (ADXL, Mooncake RPC), not a fixed one."""
    shared: str | None = None
    """Uses with the same key are one range shared by design (HCCL's host ports of a node)."""
    key: str = ""
    """The config key that sets it (`components.vllm.port`): a config check names it (`config_checks`)."""

    @property
    def label(self) -> str:
        return f"{self.component} {self.purpose} {span(self.low, self.high)}"

    def overlap(self, other: PortUse) -> tuple[int, int] | None:
        low, high = max(self.low, other.low), min(self.high, other.high)
        return (low, high) if low <= high else None


@dataclass(frozen=True)
class PortFinding:
    kind: str
    """collision (two of ours), ephemeral (a listener the kernel may hand out), taken (someone listens now)."""
    low: int
    high: int
    first: PortUse
    second: PortUse | None = None
    detail: str = ""

    @property
    def message(self) -> str:
        where = span(self.low, self.high)
        if self.kind == COLLISION:
            why = " (the random pick can take it first: vllm-ascend #8938)" if self.second and (
                self.first.random or self.second.random) else ""  # fmt: skip
            return f"{where}: {self.first.label} and {self.second.label if self.second else '?'} collide{why}"
        if self.kind == EPHEMERAL:
            return (f"{where}: {self.first.label} is inside ip_local_port_range {self.detail} and not reserved "
                    "(an outgoing connection can take it before it binds: vllm-ascend #15100)")
        return f"{where}: {self.first.label} is held by {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        users = [u.label for u in (self.first, self.second) if u is not None]
        return {"kind": self.kind, "ports": span(self.low, self.high), "users": users, "message": self.message}


@dataclass
class PortReport:
    uses: list[PortUse]
    findings: list[PortFinding] = field(default_factory=list)
    ephemeral: tuple[int, int] = DEFAULT_EPHEMERAL
    reserved_now: list[tuple[int, int]] = field(default_factory=list)
    to_reserve: list[tuple[int, int]] = field(default_factory=list)
    """The fixed ports inside the ephemeral range not yet reserved, merged into ranges."""
    ephemeral_known: bool = True
    """False: ip_local_port_range was unreadable and the default range was assumed."""

    @property
    def collisions(self) -> list[PortFinding]:
        return [f for f in self.findings if f.kind in (COLLISION, TAKEN)]

    @property
    def exposed(self) -> list[PortFinding]:
        return [f for f in self.findings if f.kind == EPHEMERAL]

    def reserved_value(self) -> str:
        """ip_local_reserved_ports after the fix: what is reserved now plus what we need."""
        return format_ranges(merge_ranges([*self.reserved_now, *self.to_reserve]))

    def sysctl_line(self) -> str:
        return f"net.ipv4.ip_local_reserved_ports = {self.reserved_value()}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": not self.collisions, "ephemeral_range": span(*self.ephemeral),
            "reserved": format_ranges(self.reserved_now), "to_reserve": format_ranges(self.to_reserve),
            "sysctl": self.sysctl_line() if self.to_reserve else None,
            "uses": [{"component": u.component, "purpose": u.purpose, "ports": span(u.low, u.high),
                      "random": u.random} for u in self.uses],
            "findings": [f.to_dict() for f in self.findings],
        }  # fmt: skip


def span(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}-{high}"


# ------------------------------------------------------------------------------------------ sysctl values


def parse_port_range(text: str | None) -> tuple[int, int] | None:
    """`32768\t60999` → (32768, 60999); None when unreadable."""
    try:
        low, high = (int(v) for v in (text or "").split())
    except ValueError:
        return None
    return (low, high) if 0 < low <= high <= 65535 else None


def parse_ranges(text: str | None) -> list[tuple[int, int]]:
    """ip_local_reserved_ports' format, `8080,20000-20100`, also HCCL_HOST_SOCKET_PORT_RANGE's; bad items skipped."""
    out = []
    for item in (text or "").replace("\n", ",").split(","):
        low, _, high = item.strip().partition("-")
        try:
            a, b = int(low), int(high or low)
        except ValueError:
            continue
        if 0 < a <= b <= 65535:
            out.append((a, b))
    return merge_ranges(out)


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def format_ranges(ranges: Iterable[tuple[int, int]]) -> str:
    return ",".join(span(a, b) for a, b in ranges)


def subtract(low: int, high: int, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [low, high] not covered by ranges."""
    left = [(low, high)]
    for a, b in merge_ranges(ranges):
        nxt = []
        for x, y in left:
            if b < x or a > y:
                nxt.append((x, y))
                continue
            if x < a:
                nxt.append((x, a - 1))
            if b < y:
                nxt.append((b + 1, y))
        left = nxt
    return left


# -------------------------------------------------------------------------------------- what we bind


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        return None


def _connectors(kv: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """Every connector in a kv_transfer_config, a MultiConnector's parts included."""
    if not kv:
        return []
    parts = (kv.get("kv_connector_extra_config") or {}).get("connectors") or []
    return [kv, *(p for c in parts if isinstance(c, Mapping) for p in _connectors(c))]


def vllm_uses(name: str, comp: VllmComponent, env: Mapping[str, str], node_ip: str) -> list[PortUse]:
    """One `vllm serve`: HTTP, DP RPC (rank 0's process), Mooncake handshake per TP rank, ADXL per NPU,
    Mooncake RPC, HCCL host ports. `env` is the rendered environment (overrides included)."""
    uses = []
    if not comp.headless:
        uses.append(PortUse(name, "HTTP (--port)", comp.port, comp.port, key=f"components.{name}.port"))
    first = comp.data_parallel_rank if comp.data_parallel_rank is not None else (comp.data_parallel_start_rank or 0)
    local = 1 if comp.data_parallel_rank is not None else (comp.data_parallel_size_local or comp.data_parallel_size)
    address = comp.data_parallel_address or node_ip
    if comp.data_parallel_size > 1 and first == 0 and address == node_ip:
        rpc = comp.data_parallel_rpc_port or DEFAULT_RPC_PORT
        uses.append(PortUse(name, "DP RPC (--data-parallel-rpc-port)", rpc, rpc,
                            key=f"components.{name}.data_parallel_rpc_port"))
    tp = comp.tensor_parallel_size
    connectors = _connectors(comp.kv_transfer_config)
    mooncake = [c for c in connectors if "Mooncake" in str(c.get("kv_connector", ""))]
    for c in mooncake:
        try:
            kv_port = int(c["kv_port"])
        except (KeyError, TypeError, ValueError):
            continue
        low = kv_port + first * tp
        uses.append(PortUse(name, f"{c['kv_connector']} handshake (kv_port {kv_port} + rank·TP)", low,
                            low + local * tp - 1, key=f"components.{name}.kv_transfer_config.kv_port"))
    if mooncake:
        low = _env_int(env, "MC_MIN_RPC_PORT") or MOONCAKE_RPC_PORTS[0]
        high = _env_int(env, "MC_MAX_RPC_PORT") or MOONCAKE_RPC_PORTS[1]
        uses.append(PortUse(name, "Mooncake transfer-engine RPC", low, max(low, high), random=True,
                            key=f"components.{name}.env.MC_MIN_RPC_PORT"))
    if any((c.get("kv_connector_extra_config") or {}).get("use_ascend_direct") for c in mooncake):
        base = _env_int(env, "ASCEND_BASE_PORT") or ADXL_BASE_PORT
        devices = list(comp.visible_devices) if comp.visible_devices is not None else list(range(local * tp))
        for dev in devices[:local * tp]:
            low = base + ADXL_PORTS_PER_DEVICE * dev
            uses.append(PortUse(name, f"ADXL listen (NPU {dev}, ASCEND_BASE_PORT {base})", low,
                                low + ADXL_PORTS_PER_DEVICE, random=True,
                                key=f"components.{name}.env.ASCEND_BASE_PORT"))
    explicit = env.get("HCCL_HOST_SOCKET_PORT_RANGE")
    if explicit and explicit.strip() != "auto":
        for a, b in parse_ranges(explicit):
            uses.append(PortUse(name, "HCCL host ports (HCCL_HOST_SOCKET_PORT_RANGE)", a, b, shared="hccl",
                                key=f"components.{name}.env.HCCL_HOST_SOCKET_PORT_RANGE"))
    elif not explicit:
        given = _env_int(env, "HCCL_IF_BASE_PORT")
        what = "HCCL host ports (" + ("HCCL_IF_BASE_PORT)" if given else "default: HCCL_IF_BASE_PORT unset)")
        base = given or HCCL_BASE_PORT
        uses.append(PortUse(name, what, base, base + HCCL_PORTS - 1, shared="hccl",
                            key=f"components.{name}.env.HCCL_IF_BASE_PORT"))
    return uses


def node_uses(config: Config, base_env: Mapping[str, str] | None = None) -> list[PortUse]:
    """Every port this node's active components bind, from their rendered commands and environment."""
    from nodeagent.render.launch import render_component

    uses = [PortUse("agent", "API (agent.api.listen)", config.agent.api.port, config.agent.api.port,
                    key="agent.api.listen")]
    for name, comp in config.active_components().items():
        spec = render_component(name, config, dict(base_env or {}))
        if isinstance(comp, VllmComponent):
            found = vllm_uses(name, comp, spec.environment(base_env or {}), config.node.ip)
            if config.node.npus == 0:  # a host without NPUs (node.npus: 0) runs no HCCL
                found = [u for u in found if u.shared != "hccl"]
            uses += found
        elif isinstance(comp, EtcdComponent):
            uses += [PortUse(name, "etcd client", comp.client_port, comp.client_port,
                             key=f"components.{name}.client_port"),
                     PortUse(name, "etcd peer", comp.peer_port, comp.peer_port, key=f"components.{name}.peer_port")]
        elif isinstance(comp, DatasystemComponent):
            uses.append(PortUse(name, "datasystem worker", comp.worker_port, comp.worker_port,
                                key=f"components.{name}.worker_port"))
        elif isinstance(comp, ProxyComponent):
            uses.append(PortUse(name, "PD proxy", comp.port, comp.port, key=f"components.{name}.port"))
        else:
            uses += [PortUse(name, "port", p, p, key=f"components.{name}") for p in spec.ports]
    return uses


# ------------------------------------------------------------------------------------------------ lint


def collisions(uses: list[PortUse]) -> list[PortFinding]:
    """Pairs of our uses that overlap where at least one is a fixed port; two random ranges, or two uses of one
    shared range, may overlap by design."""
    out = []
    for i, a in enumerate(uses):
        for b in uses[i + 1:]:
            if (a.random and b.random) or (a.shared is not None and a.shared == b.shared):
                continue
            both = a.overlap(b)
            if both:
                out.append(PortFinding(COLLISION, *both, a, b))
    return out


def ephemeral_exposure(uses: list[PortUse], ephemeral: tuple[int, int],
                       reserved: list[tuple[int, int]]) -> tuple[list[PortFinding], list[tuple[int, int]]]:
    """Fixed listeners inside the ephemeral range and not reserved; with the ranges to reserve."""
    findings, needed = [], []
    seen: set[tuple[str | None, int, int]] = set()
    for use in uses:
        if use.random:
            continue
        low, high = max(use.low, ephemeral[0]), min(use.high, ephemeral[1])
        if low > high:
            continue
        for a, b in subtract(low, high, reserved):
            needed.append((a, b))
            key = (use.shared, a, b)
            if use.shared is None or key not in seen:
                seen.add(key)
                findings.append(PortFinding(EPHEMERAL, a, b, use, detail=span(*ephemeral)))
    return findings, merge_ranges(needed)


def live_conflicts(uses: list[PortUse], listening: Mapping[int, set[int]], ours: set[int]) -> list[PortFinding]:
    """Fixed ports of ours that some other process listens on right now (`listening`: port → PIDs)."""
    from nodeagent.node.residue import describe_pid

    out = []
    for use in uses:
        if use.random:
            continue
        for port in range(use.low, use.high + 1):
            pids = listening.get(port)
            if pids is None or (pids and pids <= ours):
                continue
            who = ", ".join(describe_pid(p) for p in sorted(pids)) or "a process we cannot see"
            out.append(PortFinding(TAKEN, port, port, use, detail=who))
    return out


def lint_ports(uses: list[PortUse], ephemeral: tuple[int, int] | None, reserved: list[tuple[int, int]],
               listening: Mapping[int, set[int]] | None = None, ours: set[int] | None = None) -> PortReport:
    known, ephemeral = ephemeral is not None, ephemeral or DEFAULT_EPHEMERAL
    exposed, needed = ephemeral_exposure(uses, ephemeral, reserved) if known else ([], [])
    findings = collisions(uses)
    if listening is not None:
        findings += live_conflicts(uses, listening, ours or set())
    return PortReport(uses, findings + exposed, ephemeral, merge_ranges(reserved), needed, known)


def fixed_ports(uses: Iterable[PortUse]) -> list[int]:
    return sorted({p for u in uses if not u.random for p in range(u.low, u.high + 1)})

"""The typed configuration: one YAML describes the node and its components.

The `agent:` section is in `config_agent`, the probe kinds in `config_probes`, the `cluster:` section in
`config_cluster`; this module re-exports their models, so `nodeagent.config.model` stays the one name to import.
Every model is a strict frozen msgspec struct (`config_base`); `config.load_config` turns validation problems into
messages naming the file, the line and the key path. Relative paths resolve against the config file's folder
(`validate_config(..., base_dir=)`). Kind-specific defaults follow the deployment guide (run_etcd.sh, run_yr_worker.sh,
run_ds_v4_flash_w8a8_mtp.sh); `config/dsv4-flash-a2.yaml` is that deployment written out.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta, field

from nodeagent.config.agent import AgentSettings as AgentSettings
from nodeagent.config.agent import ApiConfig as ApiConfig
from nodeagent.config.agent import MqttConfig as MqttConfig
from nodeagent.config.agent import UiConfig as UiConfig
from nodeagent.config.base import Check, RuleProblem, Strict, Tagged, validate
from nodeagent.config.cluster import ClusterConfig, Port, SharedSections, TopicSafeName, group_settings_apart
from nodeagent.config.container import ContainerConfig
from nodeagent.config.ft import FaultToleranceSpec
from nodeagent.config.paths import Command, ConfigPath
from nodeagent.config.paths import resolve_path as _resolve_path
from nodeagent.config.probe_defaults import HOST_PROBES, merge_probe_overrides
from nodeagent.config.probes import AtLeastOne, NonNegative, Positive
from nodeagent.config.probes import DatasystemKvProbe as DatasystemKvProbe
from nodeagent.config.probes import EtcdProbe as EtcdProbe
from nodeagent.config.probes import ExecProbe as ExecProbe
from nodeagent.config.probes import HttpGetProbe as HttpGetProbe
from nodeagent.config.probes import HttpProbe as HttpProbe
from nodeagent.config.probes import LivenessFileProbe as LivenessFileProbe
from nodeagent.config.probes import NpuLevel as NpuLevel
from nodeagent.config.probes import NpuProbe as NpuProbe
from nodeagent.config.probes import ProbeBase as ProbeBase
from nodeagent.config.probes import ProbeSpec as ProbeSpec
from nodeagent.config.probes import TcpProbe as TcpProbe
from nodeagent.config.probes import VllmProgressProbe as VllmProgressProbe
from nodeagent.config.recovery import PdWatchConfig as PdWatchConfig
from nodeagent.config.recovery import RecoveryConfig
from nodeagent.config.recovery import WarmWeightsConfig as WarmWeightsConfig

PositiveInt = Annotated[int, Meta(gt=0)]


def _default_node_name() -> str:
    return socket.gethostname()


def default_node_ip() -> str:
    """The first non-loopback IPv4 address, like the guide's `hostname -I | awk '{print $1}'`."""
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return addr.address
    return "127.0.0.1"


class NodeConfig(Strict, frozen=True):
    name: TopicSafeName = field(default_factory=_default_node_name)
    ip: str = field(default_factory=default_node_ip)
    role: Literal["master", "worker"] = "master"
    nic_name: str | None = None
    """The RoCE/host NIC the guide sets GLOO/TP/HCCL_SOCKET_IFNAME to (`ifconfig` shows it)."""
    npus: Annotated[int, Meta(ge=0)] | None = None
    """NPUs this node must show in `npu-smi info`; default: what its vLLM needs (TP × local DP ranks). 0 = a host
    without NPUs (a dev box running the vLLM stand-in): NPU checks and preflight's weights check are skipped."""
    npu_health: NpuProbe = field(default_factory=lambda: validate(NpuProbe, HOST_PROBES["npu"]))
    """How the agent watches NPUs and RoCE links (`npu` probe settings; a mapping tunes the default)."""


def _prepare_node(raw: Any) -> Any:
    """`npu_health` as written tunes the host's default probe."""
    if isinstance(raw, dict) and isinstance(raw.get("npu_health"), dict):
        return {**raw, "npu_health": {**HOST_PROBES["npu"], **raw["npu_health"]}}
    return raw


class ProbeSet(Strict, frozen=True):
    """Kubernetes semantics: startup gates the others; liveness failure restarts; readiness only gates."""

    startup: list[ProbeSpec] = field(default_factory=list)
    liveness: list[ProbeSpec] = field(default_factory=list)
    readiness: list[ProbeSpec] = field(default_factory=list)

    def _problems(self) -> Iterator[RuleProblem]:
        if any(isinstance(p, VllmProgressProbe) for p in self.startup):
            yield "startup", "a vllm_progress probe judges a running engine; for startup use http_get /health"


class RestartSpec(Strict, frozen=True):
    first_delay_s: NonNegative = 0.0
    backoff_initial_s: NonNegative = 10.0
    backoff_max_s: NonNegative = 300.0
    stable_after_s: NonNegative = 600.0
    redeploy_after_failures: AtLeastOne = 5
    """Component failures within failure_window_s that escalate to a node redeploy."""
    failure_window_s: Positive = 900.0
    failed_after_redeploys: AtLeastOne = 3
    """Redeploys within failure_window_s after which the node is `failed` (alert; retries continue)."""
    quick_exit_s: NonNegative = 30.0
    """An exit this soon after the start is a failed start: twice in a row with the same error text, it is a
    permanent failure (no redeploy, retried at backoff_max_s). 0 turns the rule off."""


class DependencyEdge(Strict, frozen=True):
    restart_with: bool | None = None
    """Restart this component when the dependency restarts; default depends on the dependency's kind."""


class ComponentBase(Tagged, frozen=True):
    # Defaults pass the checks too (Strict.__post_init__): a default `command: "etcd"` becomes ["etcd"].
    command: Command
    depends_on: dict[str, DependencyEdge] = field(default_factory=dict)
    env: dict[str, str | None] = field(default_factory=dict)
    """Overrides the rendered environment; null unsets a variable."""
    extra_args: list[str] = field(default_factory=list)
    workdir: ConfigPath | None = None
    stop_grace_s: Positive = 10.0
    restart: RestartSpec = field(default_factory=RestartSpec)
    probes: ProbeSet = field(default_factory=ProbeSet)
    enabled: bool = True
    container: bool = True
    """With a `container:` section: run inside the node's container; false runs it on the host (e.g. etcd)."""


def prepare_component(raw: Any) -> Any:
    """A component as written → what its model takes: `depends_on` as a list means default edges, and `probes`
    tunes the kind's default probes (`probe_defaults.merge_probe_overrides`)."""
    if not isinstance(raw, dict):
        return raw
    data = dict(raw)
    if isinstance(data.get("depends_on"), list):
        data["depends_on"] = {name: {} for name in data["depends_on"]}
    if isinstance(data.get("kind"), str):
        data["probes"] = merge_probe_overrides(data["kind"], data.get("probes"))
    return data


class EtcdComponent(ComponentBase, tag="etcd", frozen=True):
    command: Command = "etcd"
    name: str = "etcd-single"
    client_port: Port = 2379
    peer_port: Port = 2380
    data_dir: ConfigPath = Path("/tmp/etcd-data")
    listen_ip: str | None = None
    """The guide's `<IP_ADDRESS>` in --listen-*-urls; default node.ip."""
    initial_cluster: dict[str, str] | None = None
    """Member name → peer URL of a multi-member etcd (filled from `cluster.etcd_members`; not written by hand
    in a cluster file). None: the guide's single member."""
    cluster_token: str | None = None
    member: bool = False
    """This node is one of `cluster.etcd_members` (so it runs etcd although it is not the master)."""


class DatasystemComponent(ComponentBase, tag="datasystem", frozen=True):
    command: Command = "dscli"
    workdir: ConfigPath | None = None
    """Where `dscli start` runs: the worker's `datasystem/` folder (logs, probe files, uds) lands here."""
    worker_port: Port = 18481
    etcd_address: str | None = None
    """Default: the cluster's first etcd endpoint."""
    start_timeout_s: PositiveInt = 600
    shared_memory_size_mb: PositiveInt = 512000
    node_timeout_s: PositiveInt = 30
    node_dead_timeout_s: PositiveInt = 60
    liveness_check_path: ConfigPath = Path("/workspace/liveness")
    arena_per_tenant: AtLeastOne | None = None
    enable_huge_tlb: bool | None = None
    remote_h2d_device_ids: list[int] | None = None
    """Setting it enables RH2D (needs huge pages and HDK >= 25.5.0)."""
    rpc_thread_num: AtLeastOne | None = None
    enable_worker_worker_batch_get: bool | None = None
    client_log_dir: ConfigPath | None = None
    """DATASYSTEM_CLIENT_LOG_DIR for clients the agent starts; default ~/.datasystem (guide's residue)."""
    stop_grace_s: Positive = 15.0


def _relative_model(value: str) -> str:
    return str(_resolve_path(Path(value))) if value.startswith(("./", "../")) else value


class VllmComponent(ComponentBase, tag="vllm", kw_only=True, frozen=True):
    """`vllm serve` with every flag of the guide's run_ds_v4_flash_w8a8_mtp.sh as a typed default."""

    command: Command = "vllm"
    model: Annotated[str, Check(_relative_model)]
    """A local folder (absolute, `~`, or `./`/`../` relative to this config file) or a hub repo id."""
    port: Port = 8080
    host: str | None = None
    served_model_name: str = "dsv4"
    max_model_len: int = 204800
    max_num_batched_tokens: int = 4096
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.9
    max_num_seqs: int = 8
    data_parallel_size: int = 1
    tensor_parallel_size: int = 8
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rank: Annotated[int, Meta(ge=0)] | None = None
    """External load balancing: this process is one DP rank with its own API server."""
    data_parallel_rpc_port: int | None = None
    headless: bool = False
    visible_devices: list[int] | None = None
    """ASCEND_RT_VISIBLE_DEVICES; in an external group each rank gets its slice of these (default 0..)."""
    seed: int | None = None
    enforce_eager: bool = False
    enable_expert_parallel: bool = True
    tokenizer_mode: str | None = "deepseek_v4"
    tool_call_parser: str | None = "deepseek_v4"
    enable_auto_tool_choice: bool = True
    reasoning_parser: str | None = "deepseek_v4"
    safetensors_load_strategy: str | None = "prefetch"
    enable_prefix_caching: bool = True
    model_loader_extra_config: dict[str, Any] | None = field(
        default_factory=lambda: {"enable_multithread_load": "true", "num_threads": 128}
    )
    quantization: str | None = "ascend"
    trust_remote_code: bool = True
    block_size: int | None = 128
    hybrid_kv_cache_manager: bool | None = True
    """True renders --no-disable-hybrid-kv-cache-manager, False --disable-..., null neither."""
    kv_transfer_config: dict[str, Any] | None = field(
        default_factory=lambda: {
            "kv_connector": "AscendStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lookup_rpc_port": "1", "backend": "yuanrong"},
        }
    )
    speculative_config: dict[str, Any] | None = field(
        default_factory=lambda: {"num_speculative_tokens": 1, "method": "mtp", "enforce_eager": True}
    )
    compilation_config: dict[str, Any] | None = field(
        default_factory=lambda: {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [8]}
    )
    async_scheduling: bool = True
    additional_config: dict[str, Any] | None = field(
        default_factory=lambda: {
            "ascend_compilation_config": {"enable_npugraph_ex": True, "enable_static_kernel": False},
            "enable_flashcomm1": False,
            "enable_dsa_cp": False,
            "enable_cpu_binding": "true",
            "enable_shared_expert_dp": False,
            "multistream_overlap_shared_expert": True,
        }
    )
    ld_preload: list[str] = field(default_factory=lambda: ["/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"])
    """Prepended to the inherited LD_PRELOAD, as the guide does."""
    remote_h2d: bool = False
    """DS_ENABLE_REMOTE_H2D; enable together with the worker's remote_h2d_device_ids."""
    datasystem: str | None = None
    """Which datasystem component's worker_port gives DS_WORKER_ADDR; default the only one."""
    stop_grace_s: Positive = 60.0
    """vLLM drains in-flight requests on SIGTERM."""
    clean_slate_timeout_s: Positive = 90.0
    """Before every start: how long to wait for no process on the NPUs and their HBM back to idle (device
    memory takes ~50 s to come back after an engine exits). A timeout fails the start, never a duplicate."""
    hbm_idle_tolerance_mb: Annotated[int, Meta(ge=0)] = 512
    drain_timeout_s: NonNegative = 120.0
    """Before a planned restart or stop (operator, reload, planned gang restart): readiness off, then wait up to
    this long for running and waiting requests to finish. 0: no drain. A failure restart never drains."""
    fault_tolerance: FaultToleranceSpec = field(default_factory=FaultToleranceSpec)
    """vLLM's fault-tolerance retry as the group's first rung before a gang restart (external DP ranks only)."""

    group: str | None = None
    """Derived, never written: the data-parallel group this process belongs to (`nodeagent.config.layout`)."""

    def _problems(self) -> Iterator[RuleProblem]:
        # vLLM silently switches a node with a start rank but without --headless to hybrid load balancing.
        if self.data_parallel_start_rank and not self.headless:
            yield None, ("data_parallel_start_rank without headless: vLLM would silently switch to hybrid load "
                         "balancing; set headless: true on the non-head node")
        probes = [*self.probes.liveness, *self.probes.readiness]
        if "--disable-log-stats" in self.extra_args and any(isinstance(p, VllmProgressProbe) for p in probes):
            yield None, ("extra_args has --disable-log-stats, which removes the vllm:* metrics the vllm_progress "
                         "probe reads; drop the flag, or set probes.liveness.kind: http (the guide's chat probe)")


class ProcessComponent(ComponentBase, tag="process", frozen=True):
    """Anything else (a PD proxy, an exporter): a plain command, no code change."""

    ports: list[int] = field(default_factory=list)
    """Ports the process listens on: cleanup waits for them to be free before a start."""
    process_match: list[str] = field(default_factory=list)
    """cmdline prefixes that identify leftover processes of this component."""


PROXY_SCRIPT = Path("/vllm-workspace/vllm-ascend/examples/disaggregated_prefill_v1")
PROXY_SCRIPT /= "load_balance_proxy_server_example.py"


PROXY_RESTART = RestartSpec(backoff_initial_s=2.0, backoff_max_s=30.0, stable_after_s=60.0)
"""The proxy's restart policy by default: it holds no state and is up in seconds, and while it is down every request
fails — a minute of serving proves it works, and it never waits long (the fault campaign, seed 3305: with the
components' default, kill -9s minutes apart grew its wait to 80 s, 2,829 requests failed)."""


class ProxyComponent(ComponentBase, tag="proxy", frozen=True):
    """vllm-ascend's PD load-balancing proxy, on the master; its backends come from `cluster.vllm_groups`."""

    command: Command = "python3"
    restart: RestartSpec = field(default_factory=lambda: PROXY_RESTART)
    """The proxy's own default (`PROXY_RESTART`: back off from 2 s to at most 30 s, stable after 60 s); a `restart:`
    section given replaces it, its keys not given taking the components' defaults."""
    script: ConfigPath = PROXY_SCRIPT
    """Default: where the vllm-ascend image has it."""
    host: str | None = None
    """Default: the node's IP."""
    port: Port = 18020
    prefillers: list[str] = field(default_factory=list)
    """Derived, never written: HOST:PORT of every API endpoint of the prefill groups."""
    decoders: list[str] = field(default_factory=list)
    """Derived, never written: HOST:PORT of every API endpoint of the decode groups."""
    served_model_name: str | None = None
    """Derived: the model name the default probe request asks for."""
    stop_grace_s: Positive = 15.0
    activation_check_s: Positive | None = 1.0
    """`--waiting-retry-interval`: how often the proxy checks an instance the agent added back (a group that
    restarted) before routing to it; the script's own default, 10 s, kept a healthy group out that long. None:
    leave the flag out (the guide's command line exactly)."""
    activation_retries: PositiveInt | None = 60
    """`--max-waiting-retries`: checks before the proxy gives up on an added instance (the agent re-adds it);
    None: leave the flag out."""


Component = EtcdComponent | DatasystemComponent | VllmComponent | ProcessComponent | ProxyComponent
"""A component; its `kind:` picks the class."""

KIND_ORDER = ("etcd", "datasystem", "vllm", "process", "proxy")
MASTER_ONLY_KINDS = ("etcd", "proxy")


class Config(Strict, frozen=True):
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    agent: AgentSettings = field(default_factory=AgentSettings)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """The ladder past node redeploy and the PD watches (issue 19)."""
    container: ContainerConfig | None = None
    """Run the components inside this container (the guide's vllm-ascend image); absent: host processes."""
    components: dict[str, Component] = field(default_factory=dict)
    """In a cluster file: what this member runs (vllm expanded per group, see `nodeagent.config.layout`)."""
    source: Path | None = None
    shared: SharedSections | None = None
    """The shared sections as written, for the cluster-wide layout and the file hash."""

    INTERNAL_FIELDS: ClassVar[frozenset[str]] = frozenset({"source", "shared"})
    """Set by the loader, not keys of the file."""

    def _problems(self) -> Iterator[RuleProblem]:
        for name, comp in self.components.items():
            for dep in comp.depends_on:
                if dep not in self.components:
                    yield ("components", name, "depends_on", dep), (
                        f"component {name!r} depends on unknown component {dep!r}"
                        f" (known: {', '.join(sorted(self.components))})")
        from nodeagent.core.graph import start_order

        try:
            start_order({n: [d for d in c.depends_on if d in self.components] for n, c in self.components.items()})
        except ValueError as exc:
            yield "components", str(exc)

    def active_components(self) -> dict[str, Any]:
        """The components this node runs: etcd and the proxy only on the master, disabled ones never."""
        return {
            name: comp
            for name, comp in self.components.items()
            if comp.enabled and not (comp.kind in MASTER_ONLY_KINDS and self.node.role != "master"
                                     and not getattr(comp, "member", False))
        }


def prepare_config(raw: Any) -> Any:
    """The file's sections → what `Config` takes (the `prepare_*` steps, pydantic's "before" validators)."""
    if not isinstance(raw, dict):
        return raw
    data = dict(raw)
    if "node" in data:
        data["node"] = _prepare_node(data["node"])
    if isinstance(data.get("components"), dict):
        data["components"] = {n: prepare_component(c) for n, c in data["components"].items()}
    cluster = data.get("cluster")
    if isinstance(cluster, dict) and isinstance(cluster.get("vllm_groups"), list):
        data["cluster"] = {**cluster, "vllm_groups": [group_settings_apart(g) for g in cluster["vllm_groups"]]}
    return data


def validate_config(data: Any, base_dir: Path | None = None) -> Config:
    """A config from plain data (a parsed file); `config_base.Invalid` with every problem and its key path."""
    config: Config = validate(Config, prepare_config(data), base_dir)
    return config

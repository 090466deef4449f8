"""What a probe checks, resolved from its config: `ResolvedProbe`, and the `ProbeResult` a run gives.

`resolve_probe` (pure but for one PATH lookup, the KV probe's interpreter) fills what the config left null from
the component: URLs, paths, addresses, the vLLM probe body. `probes.ProbeContext` runs what it returns.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nodeagent.config.model import (
    Config,
    DatasystemComponent,
    DatasystemKvProbe,
    EtcdComponent,
    EtcdProbe,
    ExecProbe,
    HttpGetProbe,
    HttpProbe,
    LivenessFileProbe,
    NpuProbe,
    ProbeBase,
    ProcessComponent,
    ProxyComponent,
    TcpProbe,
    VllmComponent,
    VllmProgressProbe,
)
from nodeagent.config.probe_defaults import ROLES
from nodeagent.core.bindaddr import connect_host, url_host
from nodeagent.core.errors import ConfigError
from nodeagent.render.launch import datasystem_etcd_address, datasystem_for
from nodeagent.vllm.progress import default_stall_after_s

AnyComponent = EtcdComponent | DatasystemComponent | VllmComponent | ProcessComponent | ProxyComponent


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str
    latency_s: float
    kind: str
    at: float
    """Wall-clock time (time.time()) the probe started."""
    skipped: bool = False
    """Nothing could be checked here (no npu-smi): counts as a success, shown as SKIP."""
    definite: bool = False
    """A failure that fails the role at once, whatever its failure_threshold (see `vllm_progress`)."""


@dataclass(frozen=True)
class ResolvedProbe:
    """A probe with its targets filled in, as `ProbeContext.run` takes it; unused fields stay default."""

    spec: ProbeBase
    """The configured probe: timing and thresholds (period_s, timeout_s, ...) come from here."""
    kind: str
    target: str
    """What is checked, for humans: a URL, a path, HOST:PORT or a command line."""
    path: Path | None = None
    max_age_s: float = 0.0
    endpoint: str | None = None
    put_get: bool = False
    key: str | None = None
    url: str | None = None
    method: str = "GET"
    body: dict[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    expect_status: int = 200
    expect_nonempty: str | None = None
    host: str | None = None
    port: int | None = None
    command: tuple[str, ...] = ()
    cwd: Path | None = None
    python: str | None = None
    client_log_dir: Path | None = None
    expected_npus: int = 0
    stall_after_s: float = 0.0
    inside: Any = None
    """The node's container (a `render_container.ContainerSpec`) when the command of an exec or datasystem_kv
    probe runs inside it, with its component (`ContainerMode.adapt_probes`); None: on the host."""

    @property
    def timeout_s(self) -> float:
        """The whole run's bound. A progress probe makes two requests one after the other (the scrape, then
        the canary), each bounded by the spec's timeout_s: this outer bound is only a safety net."""
        if self.kind == "vllm_progress":
            return 2 * self.spec.timeout_s + 1.0
        return self.spec.timeout_s


def vllm_probe_body(served_model_name: str | None) -> dict[str, Any]:
    """The deployment guide's probe request: 2 tokens, thinking off, so a hung engine cannot answer it.

    Without a model name vLLM serves its first model."""
    body: dict[str, Any] = {} if served_model_name is None else {"model": served_model_name}
    return body | {
        "messages": [{"role": "user", "content": "hello"}],
        "stream": False,
        "max_tokens": 2,
        "temperature": 0.6,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def _listen_address(comp: AnyComponent, config: Config) -> tuple[str, int | None]:
    """Where the component accepts connections: the address a probe on this node should dial."""
    if isinstance(comp, EtcdComponent):
        if comp.listen_ip is None:
            return config.node.ip, comp.client_port
        return connect_host(comp.listen_ip), comp.client_port
    if isinstance(comp, DatasystemComponent):
        return config.node.ip, comp.worker_port
    if isinstance(comp, VllmComponent):
        return connect_host(comp.host), comp.port
    if isinstance(comp, ProxyComponent):
        host = comp.host or config.node.ip
        return connect_host(host), comp.port
    return "127.0.0.1", (comp.ports[0] if comp.ports else None)


def _http_url(url: str | None, path: str, comp: AnyComponent, config: Config, what: str) -> str:
    """`url` as given (with `path` appended when it has none), else the component's own address + path."""
    if url:
        if "://" not in url:
            url = "http://" + url
        return url if urlsplit(url).path not in ("", "/") else url.rstrip("/") + path
    if isinstance(comp, DatasystemComponent):
        raise ConfigError(f"{what}: the datasystem worker has no HTTP endpoint; set url")
    host, port = _listen_address(comp, config)
    if port is None:
        raise ConfigError(f"{what}: set url (the component lists no ports)")
    return f"http://{url_host(host)}:{port}{path}"


def _strip_scheme(endpoint: str) -> str:
    return endpoint.split("://", 1)[-1].rstrip("/")


def _etcd_key_part(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", node)


def kv_key(node: str) -> str:
    """The datasystem accepts keys matching [a-zA-Z0-9-_!@#%^*()+=:;]{0,255}."""
    return "dsv4-agent-probe-" + re.sub(r"[^A-Za-z0-9_-]", "_", node)[:200]


def _probe_python(ds: DatasystemComponent | None, spec: DatasystemKvProbe) -> str:
    """The interpreter next to the dscli the datasystem runs (it has `yr.datasystem`), else ours.

    The one lookup here that reads the file system (PATH, the interpreter's presence)."""
    if spec.python is not None:
        return str(spec.python)
    if ds is not None:
        program = ds.command[0]
        found = program if os.path.isabs(program) else shutil.which(program)
        if found:
            for name in ("python3", "python"):
                candidate = Path(found).parent / name
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return str(candidate)
    return sys.executable


def resolve_probe(spec: ProbeBase, component: AnyComponent, config: Config) -> ResolvedProbe:
    """Fill the probe's null targets from its component; raises ConfigError when nothing can be derived."""
    what = f"{spec.kind} probe of a {component.kind} component"
    if isinstance(spec, LivenessFileProbe):
        path = spec.path
        if path is None:
            if not isinstance(component, DatasystemComponent):
                raise ConfigError(f"{what}: set path (only datasystem has a default liveness file)")
            path = component.liveness_check_path
        return ResolvedProbe(spec, spec.kind, str(path), path=path, max_age_s=spec.max_age_s)
    if isinstance(spec, EtcdProbe):
        if spec.endpoint:
            endpoint = _strip_scheme(spec.endpoint)
        elif isinstance(component, EtcdComponent):
            host, port = _listen_address(component, config)
            endpoint = f"{url_host(host)}:{port}"
        elif isinstance(component, DatasystemComponent):
            endpoint = _strip_scheme(datasystem_etcd_address(config, component))
        else:
            endpoint = _strip_scheme(config.cluster.etcd_endpoints[0])
        key = f"/dsv4-agent/probe/{_etcd_key_part(config.node.name)}"
        return ResolvedProbe(spec, spec.kind, endpoint, endpoint=endpoint, put_get=spec.put_get, key=key)
    if isinstance(spec, HttpProbe):
        url = _http_url(spec.url, spec.path, component, config, what)
        body = spec.body
        served = component.served_model_name if isinstance(component, VllmComponent | ProxyComponent) else None
        if body is None and served and spec.method == "POST":
            body = vllm_probe_body(served)  # through the proxy: a prefill and a decode instance answer it
        return ResolvedProbe(
            spec, spec.kind, f"{spec.method} {url}", url=url, method=spec.method, body=body,
            headers=dict(spec.headers), expect_status=spec.expect_status,
            expect_nonempty=spec.expect_nonempty,
        )  # fmt: skip
    if isinstance(spec, VllmProgressProbe):
        base = _http_url(spec.url, "/", component, config, what).rstrip("/")
        body = spec.body
        if body is None:
            model = component.served_model_name if isinstance(component, VllmComponent) else None
            body = vllm_probe_body(model)
        stall_after_s = spec.stall_after_s
        if stall_after_s is None:
            chunk = component.max_num_batched_tokens if isinstance(component, VllmComponent) else None
            stall_after_s = default_stall_after_s(chunk)
        return ResolvedProbe(
            spec, spec.kind, base, url=base, method="POST", body=body, headers=dict(spec.headers),
            expect_nonempty=spec.expect_nonempty, stall_after_s=stall_after_s,
        )  # fmt: skip
    if isinstance(spec, HttpGetProbe):
        url = _http_url(spec.url, spec.path, component, config, what)
        return ResolvedProbe(spec, spec.kind, url, url=url, method="GET", expect_status=spec.expect_status)
    if isinstance(spec, TcpProbe):
        host, port = _listen_address(component, config)
        host = spec.host or host
        port = spec.port or port
        if port is None:
            raise ConfigError(f"{what}: set port (the component lists no ports)")
        return ResolvedProbe(spec, spec.kind, f"{url_host(host)}:{port}", host=host.strip("[]"), port=port)
    if isinstance(spec, ExecProbe):
        argv = tuple(spec.command)
        cwd = component.workdir
        return ResolvedProbe(spec, spec.kind, shlex.join(argv), command=argv, cwd=cwd)
    if isinstance(spec, DatasystemKvProbe):
        ds = datasystem_for(config, component)
        if spec.address:
            address = _strip_scheme(spec.address)
        elif ds is not None:
            address = f"{url_host(config.node.ip)}:{ds.worker_port}"
        else:
            raise ConfigError(f"{what}: set address (no datasystem component to derive it from)")
        host, _, port_s = address.rpartition(":")
        if not host or not port_s.isdigit():
            raise ConfigError(f"{what}: address must be HOST:PORT, got {address!r}")
        log_dir = (ds.client_log_dir if ds is not None else None) or config.agent.log_dir / "probe-client"
        return ResolvedProbe(
            spec, spec.kind, address, host=host.strip("[]"), port=int(port_s), key=kv_key(config.node.name),
            python=_probe_python(ds, spec), client_log_dir=log_dir,
        )  # fmt: skip
    if isinstance(spec, NpuProbe):
        from nodeagent.npu.monitor import expected_npus

        return ResolvedProbe(spec, spec.kind, "npu-smi/hccn_tool", expected_npus=expected_npus(config))
    raise ConfigError(f"unknown probe kind {spec.kind!r}")


def resolve_probe_set(component: AnyComponent, config: Config) -> dict[str, list[ResolvedProbe]]:
    """Every role's probes of one component, resolved; a role without probes maps to []."""
    probes = component.probes
    return {role: [resolve_probe(spec, component, config) for spec in getattr(probes, role)] for role in ROLES}

"""The probe kinds of the config (`probes:` of a component, `node.npu_health`): one model per kind.

Apart from `config_model` (which imports it) so that each file holds one part of the schema; `probe_resolve`
turns these into what a probe run checks.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from nodeagent.config_cluster import Strict
from nodeagent.config_paths import Command, ConfigPath


class ProbeBase(Strict):
    period_s: float = Field(default=10.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0)
    failure_threshold: int = Field(default=3, ge=1)
    success_threshold: int = Field(default=1, ge=1)
    initial_delay_s: float = Field(default=0.0, ge=0)


class LivenessFileProbe(ProbeBase):
    kind: Literal["liveness_file"] = "liveness_file"
    path: ConfigPath | None = None
    """Default: the datasystem component's liveness_check_path."""
    max_age_s: float = Field(default=5.0, gt=0)


class EtcdProbe(ProbeBase):
    kind: Literal["etcd"] = "etcd"
    endpoint: str | None = None
    """HOST:PORT; default: the component's own client URL, else the cluster's first endpoint."""
    put_get: bool = False


class HttpProbe(ProbeBase):
    """A request with a JSON body; the guide's vLLM probe is a 2-token chat completion."""

    kind: Literal["http"] = "http"
    url: str | None = None
    path: str = "/v1/chat/completions"
    method: Literal["GET", "POST"] = "POST"
    body: dict[str, Any] | None = None
    """Default for vllm: the guide's probe request with the served model name."""
    headers: dict[str, str] = Field(default_factory=dict)
    expect_status: int = 200
    expect_nonempty: str | None = "choices.0.message.content"


class HttpGetProbe(ProbeBase):
    kind: Literal["http_get"] = "http_get"
    url: str | None = None
    path: str = "/health"
    expect_status: int = 200


class TcpProbe(ProbeBase):
    kind: Literal["tcp"] = "tcp"
    host: str | None = None
    port: int | None = Field(default=None, gt=0, lt=65536)


class ExecProbe(ProbeBase):
    kind: Literal["exec"] = "exec"
    command: Command


class DatasystemKvProbe(ProbeBase):
    kind: Literal["datasystem_kv"] = "datasystem_kv"
    address: str | None = None
    python: ConfigPath | None = None
    """The interpreter that has `yr.datasystem`; default: the one next to the dscli the component runs."""


NpuLevel = Literal["NotHandleFault", "SubHealthFault", "RestartRequest", "RestartBusiness", "FreeRestartNPU",
                   "RestartNPU", "PreSeparateNPU", "SeparateNPU", "ManuallySeparateNPU"]


class NpuProbe(ProbeBase):
    """NPU chip health, HBM ECC, foreign processes and RoCE links through npu-smi/hccn_tool (npu_health.py).

    Debounce and escalation happen inside (the Ascend Device Plugin's rules), so one failing result is
    meaningful: failure_threshold defaults to 1. Without npu-smi the probe reports SKIP (ok)."""

    kind: Literal["npu"] = "npu"
    period_s: float = Field(default=10.0, gt=0)
    timeout_s: float = Field(default=30.0, gt=0)
    failure_threshold: int = Field(default=1, ge=1)
    npu_smi: ConfigPath | None = None
    """Default: npu-smi on PATH, else /usr/local/bin/npu-smi."""
    hccn_tool: ConfigPath | None = None
    """Default: hccn_tool on PATH, else /usr/local/Ascend/driver/tools/hccn_tool."""
    roce: bool = True
    """Check RoCE links (`hccn_tool -i D -link -g` every period, `-net_health -g` on detail polls)."""
    detail_every: int = Field(default=6, ge=1)
    """Every Nth poll also reads HBM ECC counts and RoCE net health (per-device calls)."""
    hold_level: NpuLevel = "FreeRestartNPU"
    """Faults at this level or worse hold vLLM starts until they clear or an operator overrides."""
    link_down_tolerance_s: float = Field(default=20.0, ge=0)
    link_recover_s: float = Field(default=60.0, ge=0)
    flap_window_s: float = Field(default=86400.0, gt=0)
    flap_limit: int = Field(default=5, ge=1)
    flap_release_s: float = Field(default=172800.0, gt=0)
    ecc_window_s: float = Field(default=86400.0, gt=0)
    ecc_limit: int = Field(default=2, ge=1)
    ecc_quiet_s: float = Field(default=300.0, ge=0)


class VllmProgressProbe(ProbeBase):
    """Load-safe vLLM liveness (`nodeagent.vllm_progress`): engine progress from /metrics under load, the
    guide's canary chat when idle, /health 503 at once.

    `timeout_s` bounds each request (health + metrics scrape, then the canary); `failure_threshold` counts
    failed canaries or scrapes in a row. A stall (requests in flight, nothing moved for `stall_after_s`) and
    an errored engine fail at once: the probe has already waited, so the role's hysteresis does not add more."""

    kind: Literal["vllm_progress"] = "vllm_progress"
    url: str | None = None
    """Base URL (scheme, host, port); default: the component's own address."""
    stall_after_s: float = Field(default=60.0, gt=0)
    body: dict[str, Any] | None = None
    """The canary request; default for vllm: the guide's probe request with the served model name."""
    headers: dict[str, str] = Field(default_factory=dict)
    expect_nonempty: str | None = "choices.0.message.content"


ProbeSpec = Annotated[
    LivenessFileProbe | EtcdProbe | HttpProbe | HttpGetProbe | TcpProbe | ExecProbe | DatasystemKvProbe
    | NpuProbe | VllmProgressProbe,
    Field(discriminator="kind"),
]

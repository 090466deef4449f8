"""The probe kinds of the config (`probes:` of a component, `node.npu_health`): one model per kind.

Apart from `config_model` (which imports it) so that each file holds one part of the schema; `probe_resolve`
turns these into what a probe run checks.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, field

from nodeagent.config.base import Tagged
from nodeagent.config.paths import Command, ConfigPath

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
AtLeastOne = Annotated[int, Meta(ge=1)]


class ProbeBase(Tagged, frozen=True):
    period_s: Positive = 10.0
    timeout_s: Positive = 5.0
    failure_threshold: AtLeastOne = 3
    success_threshold: AtLeastOne = 1
    initial_delay_s: NonNegative = 0.0


class LivenessFileProbe(ProbeBase, tag="liveness_file", frozen=True):
    path: ConfigPath | None = None
    """Default: the datasystem component's liveness_check_path."""
    max_age_s: Positive = 30.0
    """The file must say `liveness check success` and be younger than this. 30 s is the guide's
    `yr_liveness_check.sh`: a worker stalled for less keeps its KV pool (a restart loses every node's prefix
    cache); a stopped worker still fails within this + period_s x failure_threshold (36 s by default)."""


class EtcdProbe(ProbeBase, tag="etcd", frozen=True):
    endpoint: str | None = None
    """HOST:PORT; default: the component's own client URL, else the cluster's first endpoint."""
    put_get: bool = False


class HttpProbe(ProbeBase, tag="http", frozen=True):
    """A request with a JSON body; the guide's vLLM probe is a 2-token chat completion."""

    url: str | None = None
    path: str = "/v1/chat/completions"
    method: Literal["GET", "POST"] = "POST"
    body: dict[str, Any] | None = None
    """Default for vllm: the guide's probe request with the served model name."""
    headers: dict[str, str] = field(default_factory=dict)
    expect_status: int = 200
    expect_nonempty: str | None = "choices.0.message.content"


class HttpGetProbe(ProbeBase, tag="http_get", frozen=True):
    url: str | None = None
    path: str = "/health"
    expect_status: int = 200


class TcpProbe(ProbeBase, tag="tcp", frozen=True):
    host: str | None = None
    port: Annotated[int, Meta(gt=0, lt=65536)] | None = None


class ExecProbe(ProbeBase, tag="exec", kw_only=True, frozen=True):
    command: Command


class DatasystemKvProbe(ProbeBase, tag="datasystem_kv", frozen=True):
    address: str | None = None
    python: ConfigPath | None = None
    """The interpreter that has `yr.datasystem`; default: the one next to the dscli the component runs."""


NpuLevel = Literal["NotHandleFault", "SubHealthFault", "RestartRequest", "RestartBusiness", "FreeRestartNPU",
                   "RestartNPU", "PreSeparateNPU", "SeparateNPU", "ManuallySeparateNPU"]


class NpuProbe(ProbeBase, tag="npu", frozen=True):
    """NPU chip health, HBM ECC, foreign processes and RoCE links through npu-smi/hccn_tool (npu_health.py).

    Debounce and escalation happen inside (the Ascend Device Plugin's rules), so one failing result is
    meaningful: failure_threshold defaults to 1. Without npu-smi the probe reports SKIP (ok)."""

    period_s: Positive = 10.0
    timeout_s: Positive = 30.0
    failure_threshold: AtLeastOne = 1
    npu_smi: ConfigPath | None = None
    """Default: npu-smi on PATH, else /usr/local/bin/npu-smi."""
    hccn_tool: ConfigPath | None = None
    """Default: hccn_tool on PATH, else /usr/local/Ascend/driver/tools/hccn_tool."""
    roce: bool = True
    """Check RoCE links (`hccn_tool -i D -link -g` every period, `-net_health -g` on detail polls)."""
    detail_every: AtLeastOne = 6
    """Every Nth poll also reads HBM ECC counts and RoCE net health (per-device calls)."""
    hold_level: NpuLevel = "FreeRestartNPU"
    """Faults at this level or worse hold vLLM starts until they clear or an operator overrides."""
    link_down_tolerance_s: NonNegative = 20.0
    link_recover_s: NonNegative = 60.0
    flap_window_s: Positive = 86400.0
    flap_limit: AtLeastOne = 5
    flap_release_s: Positive = 172800.0
    ecc_window_s: Positive = 86400.0
    ecc_limit: AtLeastOne = 2
    ecc_quiet_s: NonNegative = 300.0


class VllmProgressProbe(ProbeBase, tag="vllm_progress", frozen=True):
    """Load-safe vLLM liveness (`nodeagent.vllm.progress`): engine progress from /metrics under load, the
    guide's canary chat when idle, /health 503 at once.

    `timeout_s` bounds each request (health + metrics scrape, then the canary); `failure_threshold` counts
    failed canaries or scrapes in a row. A stall (requests in flight, nothing moved for `stall_after_s`) and
    an errored engine fail at once: the probe has already waited, so the role's hysteresis does not add more."""

    url: str | None = None
    """Base URL (scheme, host, port); default: the component's own address."""
    stall_after_s: Positive | None = None
    """With requests in flight: no counter or gauge moved for this long = stalled. Null: 20 s up to the guide's
    4096 `max_num_batched_tokens`, 5 x 3.5 s per 4096 above (a longer chunk is a longer healthy step)."""
    body: dict[str, Any] | None = None
    """The canary request; default for vllm: the guide's probe request with the served model name."""
    headers: dict[str, str] = field(default_factory=dict)
    expect_nonempty: str | None = "choices.0.message.content"


ProbeSpec = (LivenessFileProbe | EtcdProbe | HttpProbe | HttpGetProbe | TcpProbe | ExecProbe | DatasystemKvProbe
             | NpuProbe | VllmProgressProbe)
"""A probe; its `kind:` picks the class."""

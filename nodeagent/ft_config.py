"""The `fault_tolerance` key of a vllm component and the `vllm serve` flags it renders (vLLM 0.32's argparser).

vLLM takes `--enable-fault-tolerance` (which also registers the HTTP routes the agent watches) and
`--fault-tolerance-config` as a JSON object with exactly one key, `engine_recovery_timeout_sec`; every worker
refuses to start without an FT-capable `--all2all-backend`, and the engine without external load balancing
(docs/architecture.md, "vLLM fault tolerance").
"""

from __future__ import annotations

import json
from typing import Self

from pydantic import Field, model_validator

from nodeagent.config_cluster import Strict


class FaultToleranceSpec(Strict):
    enabled: bool = False
    """Render vLLM's fault tolerance and try its `retry` on a rank fault before the gang restart."""
    engine_recovery_timeout_s: int = Field(default=120, gt=0)
    """--fault-tolerance-config's engine_recovery_timeout_sec: how long a faulty engine waits for a retry."""
    retry_timeout_s: float = Field(default=60.0, gt=0)
    """How long the agent waits for a sent retry to bring every rank back to healthy; less than the above."""
    status_interval_s: float = Field(default=2.0, gt=0)
    """How often the agent reads each local rank's /fault_tolerance/status (twice as often during a fault)."""
    all2all_backend: str | None = "deepep_low_latency"
    """--all2all-backend; vLLM 0.32 needs deepep_low_latency or nixl_ep with FT. null: not rendered."""

    @model_validator(mode="after")
    def _retry_fits_in_the_engines_wait(self) -> Self:
        if self.retry_timeout_s >= self.engine_recovery_timeout_s:
            raise ValueError("retry_timeout_s must be less than engine_recovery_timeout_s: the engines give up "
                             "after the latter")
        return self


def fault_tolerance_argv(spec: FaultToleranceSpec, data_parallel_rank: int | None) -> list[str]:
    if not spec.enabled:
        return []
    if data_parallel_rank is None:
        raise ValueError("fault_tolerance needs external load balancing (one vllm serve per data-parallel rank, "
                         "data_parallel_rank set): vLLM refuses it otherwise")
    config = json.dumps({"engine_recovery_timeout_sec": spec.engine_recovery_timeout_s})
    argv = ["--enable-fault-tolerance", "--fault-tolerance-config", config]
    if spec.all2all_backend is not None:
        argv += ["--all2all-backend", spec.all2all_backend]
    return argv

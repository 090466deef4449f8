"""The `fault_tolerance` key of a vllm component and the `vllm serve` flags it renders (vLLM 0.32's argparser).

vLLM takes `--enable-fault-tolerance` (which also registers the HTTP routes the agent watches) and
`--fault-tolerance-config` as a JSON object with exactly one key, `engine_recovery_timeout_sec`; every worker
refuses to start without an FT-capable `--all2all-backend`, and the engine without external load balancing
(docs/architecture.md, "vLLM fault tolerance").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated

from msgspec import Meta

from nodeagent.config.base import RuleProblem, Strict
from nodeagent.vllm.ft_rules import Support


class FaultToleranceSpec(Strict, frozen=True):
    enabled: bool = False
    """Render vLLM's fault tolerance and try its `retry` on a rank fault before the gang restart."""
    engine_recovery_timeout_s: Annotated[int, Meta(gt=0)] = 120
    """--fault-tolerance-config's engine_recovery_timeout_sec: how long a faulty engine waits for a retry."""
    retry_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    """How long the agent waits for a sent retry to bring every rank back to healthy; less than the above."""
    status_interval_s: Annotated[float, Meta(gt=0)] = 2.0
    """How often the agent reads each local rank's /fault_tolerance/status (twice as often during a fault)."""
    all2all_backend: str | None = "deepep_low_latency"
    """--all2all-backend; vLLM 0.32 needs deepep_low_latency or nixl_ep with FT. null: not rendered."""

    def _problems(self) -> Iterator[RuleProblem]:
        if self.retry_timeout_s >= self.engine_recovery_timeout_s:
            yield None, ("retry_timeout_s must be less than engine_recovery_timeout_s: the engines give up after "
                         "the latter")


def fault_tolerance_argv(spec: FaultToleranceSpec, data_parallel_rank: int | None,
                         support: Support | None = None) -> list[str]:
    """The flags; none when not enabled, or when the installed vLLM is known not to take them (`support`, from
    its version: an older vLLM refuses to start on an unknown flag). Unknown support renders them."""
    if not spec.enabled or (support is not None and support.supported is False):
        return []
    if data_parallel_rank is None:
        raise ValueError("fault_tolerance needs external load balancing (one vllm serve per data-parallel rank, "
                         "data_parallel_rank set): vLLM refuses it otherwise")
    config = json.dumps({"engine_recovery_timeout_sec": spec.engine_recovery_timeout_s})
    argv = ["--enable-fault-tolerance", "--fault-tolerance-config", config]
    if spec.all2all_backend is not None:
        argv += ["--all2all-backend", spec.all2all_backend]
    return argv

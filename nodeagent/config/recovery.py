"""The `recovery:` section: the ladder past a node redeploy (chip reset, isolation) and the PD watches of
issue 19 (empty answers through the proxy, prefill KV while decode is down, KV transfer failures per pair,
the datasystem worker's memory headroom). Defaults are the issue's numbers (MindCluster's, vllm-ascend's)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, field

from nodeagent.config.base import Strict


class PdWatchConfig(Strict, frozen=True):
    """Run by the agent that runs the PD proxy (the master)."""

    enabled: bool = True
    """Run the PD watches (empty answers, prefill KV while decode is down, KV transfer failures per pair)."""
    probe_period_s: Annotated[float, Meta(gt=0)] = 30.0
    """One round: every decode instance probed end to end (prefill → it) with a 2-token request, then the same
    request through the proxy, spread evenly over the period (vllm-ascend #13140)."""
    probe_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    """How long one probe request (prefill, then decode) may take."""
    proxy_fault_after: Annotated[int, Meta(ge=0)] = 2
    """Rounds in a row in which the request through the proxy fails while every instance answers before the watch
    restarts the proxy (a hung proxy serves nothing; 0: only say so)."""
    empty_after: Annotated[int, Meta(ge=1)] = 2
    """Answers in a row without the 2 tokens asked (an error, an empty or tokenless 200, a short answer) from one
    decode instance before its group is removed and restarted."""
    kv_usage_threshold: Annotated[float, Meta(gt=0, le=1)] = 0.9
    """While a decode group is down: a prefill group whose `vllm:kv_cache_usage_perc` passes this restarts
    (vllm-ascend #13240: prefill never frees KV blocks a dead decoder would have pulled)."""
    transfer_threshold: Annotated[int, Meta(ge=1)] = 5
    """KV transfer failures per prefill↔decode pair within `transfer_window_s` (#10224, #7401, #10532)."""
    transfer_window_s: Annotated[float, Meta(gt=0)] = 300.0
    """The sliding window of `transfer_threshold`."""


class WarmWeightsConfig(Strict, frozen=True):
    """Issue 32 item 3: the node's own weight shards read into the page cache, so a rank's next load reads RAM."""

    enabled: bool = True
    """Read the shards of this node's vLLM ranks into the page cache after the agent starts and while a rank is not
    serving (its old tree stopping, the gang's barrier wait, its load)."""
    rate_mb_s: Annotated[float, Meta(gt=0)] = 500.0
    """The warmer's read rate bound (MB/s); it also reads at the idle IO class and nice 19."""
    margin_mb: Annotated[int, Meta(ge=0)] = 16384
    """Memory left alone: the warmer reads only what fits in MemAvailable after the datasystem worker's shared
    memory still to be filled (configured − what it touched) and this margin, and stops as soon as MemAvailable
    falls under them."""


class RecoveryConfig(Strict, frozen=True):
    npu_reset: bool = True
    """Reset chips with `npu-smi set -t reset` when the ladder says so (false: isolate instead)."""
    fault_lasting_s: Annotated[float, Meta(ge=0)] = 60.0
    """RestartRequest/RestartBusiness faults reset the chips once they lasted this long (MindCluster)."""
    redeploys_for_reset: Annotated[int, Meta(ge=1)] = 2
    """Failed node redeploys in a row within an hour, each ending in an NPU-looking error, that reset the chips."""
    resets_per_chip_per_hour: Annotated[int, Meta(ge=1)] = 3
    """A chip's reset budget; a trigger still there once it is spent isolates the node."""
    pause_after_reset_s: Annotated[float, Meta(ge=0)] = 30.0
    """No other reset (nor its judgement) this soon after one."""
    settle_s: Annotated[float, Meta(ge=20.0)] = 20.0
    """After the reset command, before the chips are checked: at least 20 s (the driver brings them back)."""
    idle_timeout_s: Annotated[float, Meta(gt=0)] = 120.0
    """How long the NPU users may take to let go of the chips before the reset is given up (isolate)."""
    stop_timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    """How long the NPU users' trees may take to stop (an A2 rank takes up to ~50 s)."""
    whole_node_reset: bool = True
    """Atlas 800I/800T A2: a reset of one NPU resets all eight."""
    worker_headroom_margin_mb: Annotated[int, Meta(ge=0)] = 4096
    """A crashed datasystem worker restarts alone only when free memory (huge pages with enable_huge_tlb) exceeds
    its shared memory by this much; otherwise the local vLLM ranks restart with it (openYuanrong FAQ §3)."""
    pd: PdWatchConfig = field(default_factory=PdWatchConfig)
    """The PD watches, run by the agent that runs the PD proxy."""
    warm_weights: WarmWeightsConfig = field(default_factory=WarmWeightsConfig)
    """Keep this node's weight shards in the page cache for the next start (issue 32)."""

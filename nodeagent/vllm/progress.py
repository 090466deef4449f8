"""Is a vLLM engine making progress? Pure: Prometheus text and a clock go in, a verdict comes out.

Why not a chat completion alone: under load a probe request queues behind the work it is meant to check
(DESIGN §10: a 2-token chat with a 60 s timeout restarted a busy vLLM after ~4.5 min), and `/health` only
sees an *errored* engine. vLLM's own `/metrics` tells more. Its frontend records, per batch of engine
outputs, `vllm:generation_tokens_total` (each decoded token), `vllm:prompt_tokens_total` (a request's whole
prompt, when its prefill completes) and one observation of the `vllm:iteration_tokens_total` histogram; and
every engine step publishes the scheduler gauges `vllm:num_requests_running`, `_waiting` and
`vllm:kv_cache_usage_perc`. All of these freeze when the engine hangs, while `/metrics` keeps answering.

A step that only computes a chunk of a long prefill emits no output (vLLM streams nothing for a partial
prefill), so none of the three counters moves then; the KV-cache gauge does (each chunk allocates blocks).
Progress is therefore "a counter went up, or a scheduler gauge changed", per `engine` label (one series per
data-parallel engine). An engine with requests in flight whose values stayed unchanged for `stall_after_s`
is stalled; an engine that keeps generating is never judged stalled, however long its requests take.
When no engine has work, nothing can move: only a request can tell, so the caller sends the canary.
A counter that went down means a new vLLM process: its history is dropped and watching starts again
from that sample, which is read neither as progress nor as a stall.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from nodeagent.core.errors import AgentError
from nodeagent.vllm.promtext import MetricsTextError, samples

COUNTERS = {
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:iteration_tokens_total_count": "steps",
}
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # the same gauge before vLLM 0.10
}
_WANTED = {**COUNTERS, **GAUGES}
STALL_SLACK = 0.02
STALL_SLACK_MAX_S = 0.5
"""Scrapes run on the prober's period grid, a few milliseconds late or early: without slack, a stall_after_s
that is a multiple of the period (the default 20 s = 8 x 2.5 s) would cost a whole extra period half the time.
The slack is 2 % of stall_after_s, at most 0.5 s."""
STALL_FLOOR_S = 20.0
CHUNK_STEP_S = 3.5
"""The longest healthy engine step seen for a chunk of 4096 batched tokens: ~3.4 s per 4096-token prefill chunk
at 150k context (DeepSeek-V4-Flash, GB10, vllm #41834), against 0.02-0.11 s decode steps and ~3.7 s for a whole
7k prompt on A2 (vllm-ascend #4295); the CPU vLLM's gaps are in docs/performance.md (bench/step_gaps.py)."""
CHUNK_TOKENS = 4096
STALL_MARGIN = 5.0
"""How many longest steps the stall window spans: a slow step (a busy host, a long context) is not a hang."""
UNLABELLED = "0"
"""The engine a sample without an `engine` label belongs to (a single-engine server)."""


def default_stall_after_s(max_num_batched_tokens: int | None) -> float:
    """The stall window when the probe sets none: it must outlast the longest healthy step, and a step's time
    grows with the tokens it may batch (a prefill chunk), so the window scales with `--max-num-batched-tokens`
    above the guide's 4096; never below STALL_FLOOR_S (at 4096: 20 s, so a hang under load is caught in < 30 s
    at the default 2.5 s period)."""
    tokens = max_num_batched_tokens or CHUNK_TOKENS
    return max(STALL_FLOOR_S, STALL_MARGIN * CHUNK_STEP_S * tokens / CHUNK_TOKENS)


class ProgressMetricsError(AgentError, ValueError):
    """A progress sample that cannot be read (a wrong port answering, a truncated scrape)."""


@dataclass(frozen=True, slots=True)
class EngineProgress:
    """One engine's progress values at one scrape; summed over every other label (model_name, pid)."""

    engine: str
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    steps: float = 0.0

    @property
    def in_flight(self) -> bool:
        return self.running + self.waiting > 0

    @property
    def tokens(self) -> float:
        return self.generation_tokens + self.prompt_tokens

    def counters(self) -> tuple[float, float, float]:
        return self.generation_tokens, self.prompt_tokens, self.steps

    def gauges(self) -> tuple[float, float, float]:
        return self.running, self.waiting, self.kv_usage


def parse_progress(text: str) -> dict[str, EngineProgress]:
    """The progress samples of a vLLM `/metrics` page, per engine label; {} when it has none.

    Only lines of the six metrics are parsed (a real page has hundreds of histogram buckets: `promtext`); the
    counters' `_created` timestamps and everything else are skipped by name."""
    sums: dict[str, dict[str, float]] = {}
    try:
        for sample in samples(text, _WANTED):
            if math.isnan(sample.value) or sample.value < 0:
                raise ProgressMetricsError(f"{sample.name} has the impossible value {sample.value:g}")
            per_engine = sums.setdefault(sample.labels.get("engine", UNLABELLED), {})
            field = _WANTED[sample.name]
            per_engine[field] = per_engine.get(field, 0.0) + sample.value
    except MetricsTextError as exc:
        raise ProgressMetricsError(str(exc)) from None
    return {engine: EngineProgress(engine, **values) for engine, values in sorted(sums.items())}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one look at the engine concluded."""

    ok: bool
    detail: str
    definite: bool = False
    """A failure that needs no confirmation by further probe runs: it is already debounced over
    `stall_after_s` (a stall), or it cannot heal (an errored engine)."""
    canary: bool = False
    """No engine has work, so the metrics cannot tell: send the canary and judge by its answer."""


@dataclass(slots=True)
class _Track:
    last: EngineProgress
    since: float
    """When the current values were first seen: the engine has not moved since (at the latest)."""


def _plural(n: float, one: str, many: str | None = None) -> str:
    count = int(n)
    return f"{count} {one if count == 1 else (many or one + 's')}"


def _work(e: EngineProgress) -> str:
    text = f"{_plural(e.running, 'request')} running"
    return text + (f", {int(e.waiting)} waiting" if e.waiting else "")


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


class ProgressMonitor:
    """The state machine of one probe on one vLLM process: feed it scrapes with their (monotonic) time.

    The state lives as long as the prober's trackers: a new process gets a fresh monitor."""

    def __init__(self, stall_after_s: float) -> None:
        self.stall_after_s = stall_after_s
        self._tracks: dict[str, _Track] = {}
        self._last_at: float | None = None
        self.canary_failures = 0
        """Failed canaries in a row, for the detail (the prober's tracker does the counting that acts)."""
        self.last_metrics: tuple[float, str] | None = None
        """(wall time, text) of the last /metrics page read: a failure's post-mortem includes it."""

    def canary_result(self, ok: bool) -> int:
        """Record the canary's outcome; returns the failures in a row."""
        self.canary_failures = 0 if ok else self.canary_failures + 1
        return self.canary_failures

    def observe(self, at: float, engines: Mapping[str, EngineProgress]) -> Verdict:
        previous_at, self._last_at = self._last_at, at
        if not engines:
            self._tracks.clear()
            return Verdict(True, "no vLLM progress metrics on /metrics; judged by the canary alone", canary=True)
        moved: list[tuple[EngineProgress, EngineProgress]] = []
        fresh: list[str] = []
        for name, cur in engines.items():
            track = self._tracks.get(name)
            if track is None or any(c < p for c, p in zip(cur.counters(), track.last.counters(), strict=True)):
                if track is not None:
                    fresh.append(name)
                self._tracks[name] = _Track(cur, at)
            elif cur.counters() != track.last.counters() or cur.gauges() != track.last.gauges():
                moved.append((track.last, cur))
                self._tracks[name] = _Track(cur, at)
        for gone in set(self._tracks) - set(engines):
            del self._tracks[gone]
        busy = [e for e in engines.values() if e.in_flight]
        if not busy:
            return Verdict(True, "engine idle" if len(engines) == 1 else "every engine idle", canary=True)
        self.canary_failures = 0
        many = len(engines) > 1
        stalled = [(e, at - self._tracks[e.engine].since) for e in busy]
        worst, still_for = max(stalled, key=lambda item: item[1])
        label = f"engine {worst.engine}" if many else "engine"
        if still_for >= self.stall_after_s - min(STALL_SLACK_MAX_S, STALL_SLACK * self.stall_after_s):
            return Verdict(
                False, f"{label} stalled: {_work(worst)}, no token progress for {_seconds(still_for)}", definite=True
            )
        work = _work(worst) if not many else f"{len(busy)} of {len(engines)} engines busy, {_work(_total(busy))}"
        if fresh:
            return Verdict(True, f"{work}; counters went back (a new vLLM process): watching from here")
        if still_for > 0:
            return Verdict(
                True,
                f"{work}; {label} without progress for {_seconds(still_for)} "
                f"(stalled at {_seconds(self.stall_after_s)})",
            )
        if moved and previous_at is not None:
            tokens = sum(cur.tokens - old.tokens for old, cur in moved)
            steps = sum(cur.steps - old.steps for old, cur in moved)
            pace = f"+{tokens:.0f} tokens, +{steps:.0f} steps" if tokens or steps else "scheduler state changed"
            return Verdict(True, f"{work}; {pace} in {_seconds(at - previous_at)}")
        return Verdict(True, f"{work}; first look, watching progress")


def _total(engines: list[EngineProgress]) -> EngineProgress:
    sums = {f.name: sum(getattr(e, f.name) for e in engines) for f in fields(EngineProgress) if f.name != "engine"}
    return EngineProgress("all", **sums)

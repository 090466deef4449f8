"""The bake of a rollout step: the group back in the proxy, serving real traffic with the new file — watched.

The gate before it (every rank ready, one canary answered) shows the group *can* serve; the bake shows it serves
as well as before. While a step bakes, the group's head reads each of its ranks' vLLM `/metrics` and judges the
window since the bake began against the old processes' own record, taken from the same ranks while they drained:

- **errors**: the requests that failed (`http_requests_total{status="5xx"}` on the inference routes, as vLLM's
  instrumentator counts them, or `vllm:request_success_total{finished_reason="error"}` where that is higher:
  an error the engine saw is also a 500) over every request answered — more than `bake_error_rate` fails;
- **TTFT**: the window's mean `vllm:time_to_first_token_seconds` against the old processes' lifetime mean — more
  than `bake_ttft_factor` times it, and at least `TTFT_FLOOR_S` slower (a stand-in answers in milliseconds: a
  ratio alone would judge noise), fails.

Neither is judged on fewer than `MIN_REQUESTS` requests in the window (a quiet cluster says nothing). Where the
old processes left no TTFT (they served nothing — a group that was failing before the step — or this agent
restarted since they drained), the baseline is the lifetime mean of the other groups of the same kind, read when
the bake begins; with neither, TTFT is not judged. Pure functions here (`parse_serving`, `judge_bake`);
`BakeWatch` is the thin shell that reads the ranks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from nodeagent.vllm.promtext import samples

MIN_REQUESTS = 5
TTFT_FLOOR_S = 0.5
INFERENCE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
_SERVED = frozenset({"http_requests_total", "vllm:request_success_total", "vllm:time_to_first_token_seconds_sum",
                     "vllm:time_to_first_token_seconds_count"})  # fmt: skip

Scrape = Callable[[str], Awaitable[str]]
"""An endpoint (host:port) → its /metrics text; raises OSError/ValueError when it cannot."""


@dataclass(frozen=True)
class ServingSample:
    """What a rank (or a group: the sum of its ranks) has served since its process started."""

    requests: float = 0.0
    """Every request answered on the inference routes (any status), else every request vLLM finished."""
    errors: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0

    def __add__(self, other: ServingSample) -> ServingSample:
        return ServingSample(self.requests + other.requests, self.errors + other.errors,
                             self.ttft_sum + other.ttft_sum, self.ttft_count + other.ttft_count)  # fmt: skip

    def since(self, start: ServingSample) -> ServingSample:
        """The window from `start` to this one (a counter that went down: a new process, counted from zero)."""
        if self.requests < start.requests or self.ttft_count < start.ttft_count:
            return self
        return ServingSample(self.requests - start.requests, self.errors - start.errors,
                             self.ttft_sum - start.ttft_sum, self.ttft_count - start.ttft_count)  # fmt: skip

    @property
    def mean_ttft_s(self) -> float | None:
        return self.ttft_sum / self.ttft_count if self.ttft_count else None


def parse_serving(text: str) -> ServingSample:
    """vLLM's /metrics text → what it served (every engine label summed)."""
    http_all = http_5xx = finished = engine_errors = ttft_sum = ttft_count = 0.0
    for sample in samples(text, _SERVED):
        name, labels, value = sample.name, sample.labels, sample.value
        if name == "http_requests_total" and labels.get("handler") in INFERENCE_ROUTES:
            http_all += value
            if labels.get("status", "").startswith("5"):
                http_5xx += value
        elif name == "vllm:request_success_total":
            finished += value
            if labels.get("finished_reason") == "error":
                engine_errors += value
        elif name == "vllm:time_to_first_token_seconds_sum":
            ttft_sum += value
        elif name == "vllm:time_to_first_token_seconds_count":
            ttft_count += value
    return ServingSample(http_all or finished, max(http_5xx, engine_errors), ttft_sum, ttft_count)


def judge_bake(window: ServingSample, baseline_ttft_s: float | None, error_rate: float,
               ttft_factor: float) -> str | None:  # fmt: skip
    """Why the window fails the bake, or None (also when too few requests were served to judge)."""
    if window.requests >= MIN_REQUESTS and window.errors / window.requests > error_rate:
        return (f"{window.errors:.0f} of {window.requests:.0f} requests failed while baking "
                f"({window.errors / window.requests:.0%}, more than {error_rate:.0%})")  # fmt: skip
    mean = window.mean_ttft_s
    if mean is None or baseline_ttft_s is None or window.ttft_count < MIN_REQUESTS:
        return None
    if mean > baseline_ttft_s * ttft_factor and mean - baseline_ttft_s >= TTFT_FLOOR_S:
        return (f"mean TTFT {mean:.2f}s over {window.ttft_count:.0f} requests while baking, "
                f"{mean / max(baseline_ttft_s, 1e-6):.1f}x the {baseline_ttft_s:.2f}s before the step "
                f"(more than {ttft_factor:g}x)")  # fmt: skip
    return None


class BakeWatch:
    """The head's reading of its group's ranks: the baseline while they drain, the window while they bake."""

    def __init__(self, scrape: Scrape) -> None:
        self.scrape = scrape
        self.baselines: dict[tuple[str, int, str], float | None] = {}
        self.starts: dict[tuple[str, int, str], ServingSample] = {}

    async def read(self, endpoints: Sequence[str]) -> ServingSample | None:
        """The group's ranks summed; None when one of them cannot be read (judged at the next tick)."""
        total = ServingSample()
        for endpoint in endpoints:
            try:
                total += parse_serving(await self.scrape(endpoint))
            except (OSError, ValueError, TimeoutError):
                return None
        return total

    async def remember_baseline(self, key: tuple[str, int, str], endpoints: Sequence[str]) -> None:
        if key in self.baselines:
            return
        sample = await self.read(endpoints)
        if sample is not None:
            self.baselines[key] = sample.mean_ttft_s

    async def check(self, key: tuple[str, int, str], endpoints: Sequence[str], error_rate: float,
                    ttft_factor: float, peers: Sequence[str] = ()) -> str | None:  # fmt: skip
        """`peers`: the same-kind groups' endpoints outside the step, for a baseline the old processes did not
        leave."""
        sample = await self.read(endpoints)
        if sample is None:
            return None
        if key not in self.starts and self.baselines.get(key) is None and peers:
            others = await self.read(peers)
            self.baselines[key] = others.mean_ttft_s if others is not None else None
        start = self.starts.setdefault(key, sample)
        return judge_bake(sample.since(start), self.baselines.get(key), error_rate, ttft_factor)

    def keep_only(self, rollout_id: str) -> None:
        """Drop what earlier rollouts left."""
        self.baselines = {k: v for k, v in self.baselines.items() if k[0] == rollout_id}
        self.starts = {k: v for k, v in self.starts.items() if k[0] == rollout_id}

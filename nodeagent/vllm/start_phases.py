"""Pure: the phases of a vLLM start, read from the engine's own log lines (issue 32 item 1).

A restart of a DeepSeek-V4 rank on an A2 takes 30-60 min, and the minutes sit in a few phases (weights, torch.compile,
graph capture); an operator watching a start, and the agent deciding what to keep warm, need to know which. Each
phase ends at a line the engine prints (or, for `ready` and `first_token`, at what the agent sees):

    imports      the first vLLM-shaped log line (`(APIServer pid=…) INFO MM-DD HH:MM:SS [file.py:N] …`)
    engine       a rank's engine process up (its own imports, device and distributed init) to `Starting to load model
                 M...` (vLLM's gpu/cpu_model_runner.py, vllm-ascend's model_runner_v1.py:3497): minutes on a loaded
                 host, and the gap the engine's own numbers for the weights leave out
    weights      vLLM: `Loading weights took S seconds` (default_loader.py), `Model loading took G GiB memory and
                 S seconds` (gpu_model_runner.py); vllm-ascend: `Loading model weights took G GB`,
                 `Model runner load_model total time: S seconds` (vllm_ascend/worker/model_runner_v1.py)
    compile      `torch.compile took S s in total` (older vLLM: `takes`; vllm/compilation/monitor.py); CPU vLLM 0.32
                 prints none: from `Warming up model for the compilation...` (cpu_model_runner.py) to
                 `Initial profiling/warmup run took S s` (monitor.py); a warm cache says `Directly load AOT
                 compilation from path` (decorators.py)
    kv_cache     `KV cache size: N tokens` (vllm/v1/core/kv_cache_utils.py; older: `# GPU blocks: N`)
    graphs       `Graph capturing finished in S secs, took G GiB` (gpu_model_runner.py, which vllm-ascend's runner
                 calls; its `Compile and warming up model for size N` lines, worker.py, are this phase under way)
    api          `Starting vLLM API server` (0.32: `Starting vLLM server on`) / uvicorn's `Application startup
                 complete`
    ready        the agent's startup probes passed (`/health` 200): `mark`
    first_token  the first completion answered 200 (uvicorn's access line; not seen with
                 `--disable-uvicorn-access-log`)

A phase's seconds are the engine's own number where its line has one (weights, compile, graphs: what an operator
reads in the log), else the time since the previous phase seen. A phase a version does not print (compile under
`--enforce-eager`) is "not seen", never an error; an unknown line is ignored. Data-parallel ranks that share one
output (`(EngineCore_DP1 pid=…)`) are kept apart: the start is as far as its slowest rank.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

PHASES = ("imports", "engine", "weights", "compile", "kv_cache", "graphs", "api", "ready", "first_token")
"""In the order a start passes them."""
RANK_PHASES = ("engine", "weights", "compile", "kv_cache", "graphs")
"""Printed by each engine (rank) of its own; the others belong to the API server, shared by its ranks."""
PHASE_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0)
"""dsv4_agent_vllm_start_phase_seconds: a CPU test model's sub-second weights up to an A2's hour of them."""

_STAMP = re.compile(r"^(?P<procs>(?:\([^()]*? pid=\d+\) ?)*)(?:INFO|WARNING|ERROR|DEBUG|CRITICAL) "
                    r"(?P<stamp>\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)? \[")  # fmt: skip
_DP = re.compile(r"DP(\d+)")
_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("engine", re.compile(r"Starting to load model ")),
    ("weights", re.compile(rf"Model loading took {_NUM} ?GiB memory and {_NUM} seconds")),
    ("weights", re.compile(rf"Loading model weights took {_NUM} ?GB")),
    ("weights", re.compile(rf"Model runner load_model total time: {_NUM} seconds")),
    ("weights", re.compile(rf"Loading weights took {_NUM} seconds")),
    ("compile", re.compile(rf"torch\.compile take?s? {_NUM} s in total")),
    ("compile", re.compile(rf"torch\.compile took {_NUM} s in total")),
    ("compile", re.compile(r"Initial profiling/warmup run took|Warming up done\.")),
    ("kv_cache", re.compile(r"KV cache size: (\d[\d,]*) tokens")),
    ("kv_cache", re.compile(r"# (?:GPU|NPU|npu|CPU|cpu) blocks: (\d[\d,]*)")),
    ("graphs", re.compile(rf"Graph capturing finished in {_NUM} secs")),
    ("api", re.compile(r"Starting vLLM (?:API )?server|Application startup complete")),
    ("first_token", re.compile(r'"POST /v1/(?:chat/)?completions HTTP/1\.[01]" 200')),
)  # fmt: skip
_COMPILE_CACHED = re.compile(r"Directly load the compiled graph|Directly load AOT compilation from")
_STARTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("weights", re.compile(r"Starting to load model ")),
    ("compile", re.compile(r"Starting torch\.compile|Warming up model for the compilation")),
    ("graphs", re.compile(r"Compile and warming up model for size|Capturing CUDA graphs")),
)
"""A phase's first line, where it prints one: its seconds count from there, not from the phase before."""


def phase_of_line(line: str) -> tuple[str, re.Match[str]] | None:
    """The phase this line ends (with its match), or None: most lines end none."""
    for phase, rule in _RULES:
        found = rule.search(line)
        if found:
            return phase, found
    return None


def start_line(line: str) -> bool:
    """A line this parser reads besides the first vLLM-shaped one (`vllm_shaped`): what the log relay keeps of a
    rank's output under journald (`logrelay --phases`)."""
    return (phase_of_line(line) is not None or _COMPILE_CACHED.search(line) is not None
            or any(rule.search(line) for _, rule in _STARTS))  # fmt: skip


def vllm_shaped(line: str) -> bool:
    return _STAMP.match(line) is not None


def line_time(line: str, read_at: float, not_before: float) -> float:
    """When the engine printed the line: its own stamp (local time, to the second) when it has one that falls
    between the launch and the read, else when it was read."""
    found = _STAMP.match(line)
    if found:
        try:
            parsed = time.strptime(f"{time.localtime(read_at).tm_year}-{found['stamp']}", "%Y-%m-%d %H:%M:%S")
            at = time.mktime(parsed)
        except (ValueError, OverflowError):
            return read_at
        if not_before - 1.0 <= at <= read_at + 1.0:
            return max(at, not_before)
    return read_at


def _rank(line: str) -> str | None:
    """The data-parallel rank a line is from (`EngineCore_DP1` → "1"; one engine → "0"); None: the API server's."""
    found = _STAMP.match(line)
    proc = found["procs"] if found else ""
    if proc.startswith("(APIServer"):
        return None
    dp = _DP.search(proc)
    return dp.group(1) if dp else "0"


@dataclass
class RankStart:
    """One engine's marks: when each phase ended, its seconds since the phase before, the engine's own number."""

    ended: dict[str, float] = field(default_factory=dict)
    began: dict[str, float] = field(default_factory=dict)
    gaps: dict[str, float] = field(default_factory=dict)
    own: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> dict[str, float]:
        return {**self.gaps, **self.own}


@dataclass
class StartPhases:
    """One launch's phases so far. `started_at`: the process's start (the agent's clock, as every `at`)."""

    started_at: float
    ranks: dict[str, RankStart] = field(default_factory=dict)
    shared: RankStart = field(default_factory=RankStart)
    """The API server's phases (imports, api) and the agent's marks (ready, first_token)."""
    weights_gib: float | None = None
    compile_cached: bool = False
    """vLLM said it loaded the compiled graphs from its cache (a warm torch.compile)."""

    def feed(self, line: str, read_at: float) -> str | None:
        """One output line; the phase it ended, if any."""
        at = line_time(line, read_at, self.started_at)
        if "imports" not in self.shared.ended and _STAMP.match(line):
            self._end(self.shared, "imports", at, None)
        if _COMPILE_CACHED.search(line):
            self.compile_cached = True
        for phase, rule in _STARTS:
            if rule.search(line):
                self.ranks.setdefault(_rank(line) or "0", RankStart()).began.setdefault(phase, at)
        hit = phase_of_line(line)
        if hit is None:
            return None
        phase, found = hit
        text, own = found.group(0), None
        if phase == "weights" and ("GB" in text or "GiB" in text):
            self.weights_gib = max(self.weights_gib or 0.0, float(found.group(1)))
        if phase in ("weights", "compile", "graphs") and found.lastindex and re.search(r"second|secs| s in", text):
            own = float(found.group(found.lastindex))  # the seconds are the line's last number
        if phase in RANK_PHASES:
            self._end(self.ranks.setdefault(_rank(line) or "0", RankStart()), phase, at, own)
        else:
            self._end(self.shared, phase, at, own)
        return phase

    def mark(self, phase: str, at: float) -> None:
        """A phase the agent sees itself: `ready` (startup probes passed), `first_token`."""
        self._end(self.shared, phase, at, None)

    def _end(self, marks: RankStart, phase: str, at: float, own: float | None) -> None:
        if own is not None:  # several lines of one phase (the GB, then the seconds): the engine's largest number
            marks.own[phase] = round(max(own, marks.own.get(phase, 0.0)), 3)
        if phase in marks.ended:
            return  # it ended at its first line
        before = [t for p, t in self._all_ended(marks).items() if PHASES.index(p) < PHASES.index(phase)]
        marks.ended[phase] = at
        since = marks.began.get(phase, max([self.started_at, *before]))
        marks.gaps[phase] = round(max(0.0, at - since), 3)

    def _all_ended(self, marks: RankStart) -> dict[str, float]:
        """The phases ended before: a rank's own and the shared ones; for a shared phase (api, ready) every
        rank's, the slowest's time."""
        out = dict(self.shared.ended)
        for rank in self.ranks.values() if marks is self.shared else [marks]:
            for phase, at in rank.ended.items():
                out[phase] = max(at, out.get(phase, at))
        return out

    def seconds(self) -> dict[str, float]:
        """Each phase seen, its seconds: for a rank's own phases the slowest rank's."""
        out = dict(self.shared.seconds)
        for rank in self.ranks.values():
            for phase, s in rank.seconds.items():
                out[phase] = max(out.get(phase, 0.0), s)
        return {p: out[p] for p in PHASES if p in out}

    def reached(self) -> str | None:
        """How far the slowest rank is: the least of each rank's furthest phase (a phase a version does not print
        is passed over)."""
        ends = [{**self.shared.ended, **r.ended} for r in self.ranks.values()] or [dict(self.shared.ended)]
        furthest = min(max((PHASES.index(p) for p in e), default=-1) for e in ends)
        return PHASES[furthest] if furthest >= 0 else None

    def current(self, expected: tuple[str, ...] = PHASES) -> str | None:
        """The phase it is in: the next of `expected` (the phases its last start printed, else all) after the last
        one reached; None once it is ready."""
        reached = self.reached()
        after = PHASES.index(reached) if reached else -1
        for phase in PHASES[after + 1:]:
            if phase in expected and phase != "first_token":
                return phase
        return None

    def since_last(self, now: float) -> float:
        """Seconds in the current phase: since the last phase ended (or the launch)."""
        ends = [t for r in [self.shared, *self.ranks.values()] for t in r.ended.values()]
        return max(0.0, now - max([self.started_at, *ends]))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seconds": self.seconds(), "reached": self.reached()}
        if self.weights_gib is not None:
            out["weights_gib"] = round(self.weights_gib, 3)
        if self.compile_cached:
            out["compile_cached"] = True
        if len(self.ranks) > 1:
            out["ranks"] = {r: {"seconds": {p: v.seconds[p] for p in PHASES if p in v.seconds}}
                            for r, v in sorted(self.ranks.items())}  # fmt: skip
        return out


def died_in(lines: list[str], started_at: float = 0.0) -> dict[str, Any]:
    """A failed start's post-mortem: the phase it died in (the one after the last it reached) and what it reached,
    from the failed run's output alone."""
    phases = StartPhases(started_at)
    for line in lines:
        phases.feed(line, started_at)
    return {"died_in": phases.current() or "serving", "reached": phases.reached(), **phases.to_dict()}

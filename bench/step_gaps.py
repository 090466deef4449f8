#!/usr/bin/env python3
"""The longest legitimate gap between engine steps as the `vllm_progress` probe sees them, on a real CPU vLLM.

The probe (`nodeagent/vllm/progress.py`) calls an engine with requests in flight stalled once none of its progress
values moved for `stall_after_s`: the counters `vllm:generation_tokens_total`, `vllm:prompt_tokens_total`,
`vllm:iteration_tokens_total_count` and the gauges `vllm:num_requests_running` / `_waiting` /
`vllm:kv_cache_usage_perc`. So the default must sit above the longest time a *healthy* engine goes with work in
flight and none of them moving. This script serves the tiny random MoE (`scripts/make_tiny_moe.py`, its context
raised to 16k) with the guide's `--max-num-batched-tokens 4096` (chunked prefill) and reads `/metrics` every
`--every` seconds (default 0.1) while these run:

- **first request after start**: a 12k-token prompt sent the moment `/health` answers;
- **long prompts**: prompts of 4k-16k tokens one after another, each prefilled in chunks of 4096;
- **busy batch**: `--max-num-seqs` requests at once (long prompts and long outputs, refilled as they end) for
  `--busy-s` seconds (default 60).

For each scenario it prints the gaps (seconds between two samples whose progress values differ, while requests
are in flight) — max and p99 — once over every value the probe reads and once over the counters alone (which of
them move per step), and how often each value moved. Prompts are token ids (`/v1/completions` takes them), so
their length is exact. Anchor: issue 32 item 5 (the stall window needs a margin over the max printed here).

Usage: `.venv/bin/python bench/step_gaps.py [--busy-s 60] [--every 0.1] [--compile] [--json FILE]`
(`--compile`: without `--enforce-eager`, so torch.compile runs and the first request meets compiled graphs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nodeagent.vllm.progress import EngineProgress, parse_progress  # noqa: E402

VLLM_VENV = Path(os.environ.get("DSV4_VLLM_VENV") or ROOT / ".venv-vllm")
CONTEXT = 16384
CHUNK = 4096
"""The guide's --max-num-batched-tokens."""
VOCAB = 49152
FIELDS = ("generation_tokens", "prompt_tokens", "steps", "running", "waiting", "kv_usage")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode(errors="replace")


def complete(base: str, prompt_len: int, max_tokens: int) -> None:
    body = {"model": "m", "prompt": [random.randrange(1000, VOCAB) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip
    request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=1800) as response:
        response.read()


def total(engines: dict[str, EngineProgress]) -> EngineProgress:
    sums = {name: sum(getattr(e, name) for e in engines.values()) for name in FIELDS}
    return EngineProgress("all", **sums)


@dataclass
class Gaps:
    """Gaps between changes of the probe's values while requests are in flight (the probe's stall clock)."""

    every: list[float] = field(default_factory=list)
    counters: list[float] = field(default_factory=list)
    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0))
    samples: int = 0
    first_in_flight_s: float | None = None
    """From the scenario's start to the first sample with a request in flight."""


class Sampler(threading.Thread):
    """Reads /metrics every `every` s; `scenario` names where the gaps of the current samples go."""

    def __init__(self, base: str, every: float) -> None:
        super().__init__(daemon=True)
        self.base, self.every = base, every
        self.scenario: str | None = None
        self.started = 0.0
        self.results: dict[str, Gaps] = {}
        self.stop = threading.Event()
        self.scrape_ms: list[float] = []

    def begin(self, name: str) -> None:
        self.results[name] = Gaps()
        self.started = time.monotonic()
        self.scenario = name

    def run(self) -> None:
        last: EngineProgress | None = None
        last_change = last_counter = 0.0
        current = None
        while not self.stop.is_set():
            at = time.monotonic()
            try:
                _, text = get(self.base + "/metrics")
            except OSError:
                time.sleep(self.every)
                continue
            self.scrape_ms.append((time.monotonic() - at) * 1000)
            now = total(parse_progress(text))
            if self.scenario != current:
                current, last = self.scenario, None
            gaps = self.results.get(current) if current else None
            if gaps is not None:
                gaps.samples += 1
                if now.in_flight and gaps.first_in_flight_s is None:
                    gaps.first_in_flight_s = at - self.started
                if last is None or not (now.in_flight or last.in_flight):
                    last_change = last_counter = at
                else:
                    changed = [name for name in FIELDS if getattr(now, name) != getattr(last, name)]
                    for name in changed:
                        gaps.moved[name] += 1
                    if changed:
                        gaps.every.append(at - last_change)
                        last_change = at
                    if now.counters() != last.counters():
                        gaps.counters.append(at - last_counter)
                        last_counter = at
                last = now
            self.stop.wait(max(0.0, self.every - (time.monotonic() - at)))


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def run_requests(base: str, jobs: list[tuple[int, int]], concurrency: int) -> None:
    queue = list(jobs)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt_len, max_tokens = queue.pop(0)
            complete(base, prompt_len, max_tokens)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def busy(base: str, seconds: float, seqs: int) -> None:
    deadline = time.monotonic() + seconds

    def worker() -> None:
        while time.monotonic() < deadline:
            complete(base, random.choice((512, 2048, 6000, 12000)), random.choice((64, 256)))

    threads = [threading.Thread(target=worker) for _ in range(seqs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def make_model(folder: Path) -> Path:
    python = VLLM_VENV / "bin" / "python"
    out = subprocess.run([str(python), str(ROOT / "scripts" / "make_tiny_moe.py"), str(folder)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"make_tiny_moe failed: {out.stderr[-2000:]}")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-s", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=0.1, help="seconds between /metrics reads")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="no --enforce-eager (torch.compile at start)")
    parser.add_argument("--model", type=Path, help="a model folder (default: the tiny MoE, made now)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dsv4-stepgaps-"))
    model = args.model or make_model(work / "tiny-moe")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv_vllm = [str(VLLM_VENV / "bin" / "vllm"), "serve", str(model), "--port", str(port), "--served-model-name",
                 "m", "--max-model-len", str(CONTEXT), "--max-num-batched-tokens", str(CHUNK),
                 "--enable-chunked-prefill", "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
    if not args.compile:
        argv_vllm.append("--enforce-eager")
    log = open(work / "vllm.log", "wb")  # noqa: SIM115 - handed to the child
    server = subprocess.Popen(argv_vllm, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})  # fmt: skip
    print(f"vllm serve ({'compiled' if args.compile else 'eager'}), log {work / 'vllm.log'}; "
          f"load {os.getloadavg()}", flush=True)
    sampler = Sampler(base, args.every)
    try:
        started = time.monotonic()
        while True:
            with contextlib.suppress(OSError):
                if get(base + "/health", 2)[0] == 200:
                    break
            if server.poll() is not None or time.monotonic() - started > 900:
                raise SystemExit(f"vllm serve did not come up: {(work / 'vllm.log').read_text()[-2000:]}")
            time.sleep(0.2)
        print(f"up after {time.monotonic() - started:.1f} s", flush=True)
        sampler.begin("first request after start (12k-token prompt)")
        sampler.start()
        run_requests(base, [(12000, 16)], 1)
        sampler.begin("long prompts one by one (4k-16k tokens, chunks of 4096)")
        run_requests(base, [(n, 8) for n in (4096, 8000, 12000, 16000, 16000)], 1)
        sampler.begin(f"busy batch ({args.max_num_seqs} at once, {args.busy_s:g} s)")
        busy(base, args.busy_s, args.max_num_seqs)
        time.sleep(2 * args.every)
    finally:
        sampler.stop.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()
    print(f"\n{'scenario':58} {'max gap':>8} {'p99':>7} {'counters max':>13} {'p99':>7}  moved per field")
    out: dict[str, Any] = {}
    for name, gaps in sampler.results.items():
        print(f"{name:58} {max(gaps.every, default=0):7.2f}s {p99(gaps.every):6.2f}s "
              f"{max(gaps.counters, default=0):12.2f}s {p99(gaps.counters):6.2f}s  "
              + ", ".join(f"{k} {v}" for k, v in gaps.moved.items()))  # fmt: skip
        out[name] = {"max_s": max(gaps.every, default=0), "p99_s": p99(gaps.every),
                     "counters_max_s": max(gaps.counters, default=0), "counters_p99_s": p99(gaps.counters),
                     "moved": gaps.moved, "samples": gaps.samples, "first_in_flight_s": gaps.first_in_flight_s}
    print(f"/metrics read: median {statistics.median(sampler.scrape_ms):.1f} ms, max {max(sampler.scrape_ms):.0f} "
          f"ms; load after {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A recording stand-in for the `vllm bench serve` client, for tests: put first on PATH as `vllm`.

It appends its argv to $VLLM_BENCH_RECORD (one JSON line per call), then — unless $VLLM_BENCH_RECORD_ONLY is
set — does what the real client does with `--dataset-name prefix_repetition`: `--num-prefixes` shared prefixes
of `--prefix-repetition-prefix-len` words, a seeded random suffix each, `--num-prompts` real chat requests to
`--host`/`--port` with at most `--max-concurrency` in flight, a progress line per request, vLLM's result block,
and with `--save-result` a result JSON with the field names of vllm/benchmarks/serve.py in
`--result-dir`/`--result-filename`. $VLLM_BENCH_EXIT makes it exit with that code after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm bench serve")
    for flag in ("--backend", "--endpoint", "--dataset-name", "--model", "--tokenizer", "--host", "--result-dir",
                 "--result-filename"):  # fmt: skip
        p.add_argument(flag)
    for flag in ("--prefix-repetition-prefix-len", "--prefix-repetition-suffix-len",
                 "--prefix-repetition-output-len", "--num-prompts", "--prefix-repetition-num-prefixes", "--seed",
                 "--port", "--max-concurrency"):  # fmt: skip
        p.add_argument(flag, type=int)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--save-result", action="store_true")
    return p.parse_args(argv)


def prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    prefixes = [" ".join(f"p{i}w{j}" for j in range(args.prefix_repetition_prefix_len))
                for i in range(args.prefix_repetition_num_prefixes)]  # fmt: skip
    out = []
    for n in range(args.num_prompts):
        suffix = " ".join(f"s{rng.randrange(10**6)}" for _ in range(args.prefix_repetition_suffix_len))
        out.append(f"{prefixes[n % len(prefixes)]} {suffix}")
    rng.shuffle(out)
    return out


def main() -> int:
    argv = sys.argv[1:]
    with open(os.environ["VLLM_BENCH_RECORD"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps(argv) + "\n")
    if os.environ.get("VLLM_BENCH_RECORD_ONLY"):
        return 0
    if argv[:2] != ["bench", "serve"]:
        print(f"vllm fake: only `bench serve`, not {argv[:2]}", file=sys.stderr)
        return 2
    args = parse(argv[2:])
    url = f"http://{args.host}:{args.port}{args.endpoint}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    done, lock = [0], threading.Lock()

    def one(prompt: str) -> dict[str, Any]:
        body = {"model": args.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.prefix_repetition_output_len, "ignore_eos": args.ignore_eos}  # fmt: skip
        began = time.perf_counter()
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with opener.open(request, timeout=60) as response:
            usage = json.loads(response.read())["usage"]
        latency = time.perf_counter() - began
        with lock:
            done[0] += 1
            print(f"fake bench: {done[0]}/{args.num_prompts} requests done", file=sys.stderr, flush=True)
        return {"latency": latency, "input": usage["prompt_tokens"], "output": usage["completion_tokens"]}

    print("Starting main benchmark run...", flush=True)
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.max_concurrency) as pool:
        outputs = list(pool.map(one, prompts(args)))
    duration = time.perf_counter() - began
    ttfts = [o["latency"] * 1000 * 0.4 for o in outputs]
    tpots = [o["latency"] * 1000 * 0.6 / max(1, o["output"] - 1) for o in outputs]
    total_in, total_out = sum(o["input"] for o in outputs), sum(o["output"] for o in outputs)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend, "backend": args.backend,
        "label": None, "model_id": args.model, "tokenizer_id": args.tokenizer, "num_prompts": args.num_prompts,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate, "burstiness": 1.0,
        "max_concurrency": args.max_concurrency, "duration": duration, "completed": len(outputs), "failed": 0,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(outputs) / duration, "request_goodput": None,
        "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": total_out / duration, "max_concurrent_requests": args.max_concurrency,
        "rtfx": 0.0,
    }  # fmt: skip
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", tpots)):
        result[f"mean_{name}_ms"] = statistics.fmean(values)
        result[f"median_{name}_ms"] = statistics.median(values)
        result[f"std_{name}_ms"] = statistics.pstdev(values)
        result[f"p99_{name}_ms"] = max(values)
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", len(outputs)))
    print("{:<40} {:<10.2f}".format("Mean TTFT (ms):", result["mean_ttft_ms"]))
    print("=" * 50, flush=True)
    if args.save_result:
        folder = Path(args.result_dir or ".")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / args.result_filename).write_text(json.dumps(result), encoding="utf-8")
    return int(os.environ.get("VLLM_BENCH_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())

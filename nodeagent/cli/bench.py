"""`nodeagentctl bench`: the guide's run_vllm_bench.py — its arguments, its `vllm bench serve` command against
this node's vLLM (or its PD proxy) — plus the prefix-cache hit rates of exactly that run.

The script cannot say how much of a run hit the cache: vLLM's counters count since it started. So the counters
are scraped right before and right after the run, and the window's local, external (openYuanrong) and effective
rates (`cachehit.window_rates`) are saved beside vLLM's TTFT/TPOT numbers, read from the result JSON that
`vllm bench serve --save-result` writes, as one JSON. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from nodeagent import __version__
from nodeagent.cli.cachewatch import ScrapeError, scrape
from nodeagent.core.bindaddr import connect_host, url_host
from nodeagent.core.errors import AgentError
from nodeagent.vllm.cachehit import CacheCounters, CacheMetricsError, parse_cache_counters, window_rates

GUIDE_SEED = 1000
EXIT_NO_VLLM = 69
"""EX_UNAVAILABLE: `vllm` (the benchmark client) is not installed here."""
EXIT_OUTPUT = 73
"""EX_CANTCREAT: --output-dir cannot be written."""
STAMP_FORMAT = "%Y%m%d-%H%M%S"  # vllm bench's own, in its result file names
SUMMARY_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "max_concurrency", "request_rate")  # fmt: skip
"""From vllm/benchmarks/serve.py's result JSON, with every `{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms`."""
_LATENCY_KEY = re.compile(r"^(mean|median|std|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")


class BenchError(AgentError):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Workload:
    """The script's arguments."""

    total_len: int
    repeat_prefix_ratio: float
    output_len: int
    num_prompts: int
    num_prefixes: int
    concurrency: int
    seed: int = GUIDE_SEED
    request_rate: float | None = None

    @property
    def prefix_len(self) -> int:
        return int(self.total_len * self.repeat_prefix_ratio)

    @property
    def suffix_len(self) -> int:
        return self.total_len - self.prefix_len


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    model: str
    """The served model name the requests ask for."""
    tokenizer: str
    """The model path: vllm bench counts tokens with its tokenizer."""
    via: str
    metrics_urls: tuple[str, ...]
    """Whose prefix-cache counters make up the run's hit rates."""


def _http(host: str, port: int, path: str = "") -> str:
    return f"http://{url_host(host)}:{port}{path}"


def config_target(config: Any) -> Target:
    """Through the PD proxy when this node runs one (the requests must go where prefill and decode meet; the
    counters are then every backend's), else this node's first vLLM API server."""
    active = config.active_components()
    models = [c for c in config.components.values() if c.kind == "vllm"]
    for name, comp in active.items():
        if comp.kind == "proxy":
            backends = (*comp.prefillers, *comp.decoders)
            return Target(host=connect_host(comp.host or config.node.ip), port=comp.port,
                          model=comp.served_model_name or (models[0].served_model_name if models else ""),
                          tokenizer=models[0].model if models else "", via=f"PD proxy {name!r}",
                          metrics_urls=tuple(f"http://{b}/metrics" for b in backends))  # fmt: skip
    for name, comp in active.items():
        if comp.kind == "vllm" and not comp.headless:
            host = connect_host(comp.host)
            return Target(host=host, port=comp.port, model=comp.served_model_name, tokenizer=comp.model,
                          via=f"vllm component {name!r}", metrics_urls=(_http(host, comp.port, "/metrics"),))
    raise BenchError("this node serves no vLLM API (no vllm component, or a headless rank): run bench on the "
                     "group's head node, or give --host, --port, --model and --tokenizer", 2)  # fmt: skip


def override_target(base: Target | None, host: str | None, port: int | None, model: str | None,
                    tokenizer: str | None, metrics_urls: Sequence[str]) -> Target:  # fmt: skip
    """Command-line values win; another host or port also moves the default metrics URL there."""
    if base is None:
        missing = [f"--{n}" for n, v in (("host", host), ("port", port), ("model", model), ("tokenizer", tokenizer))
                   if v is None]  # fmt: skip
        if missing:
            raise BenchError(f"without a config, give {', '.join(missing)}", 2)
        base = Target(str(host), int(port or 0), str(model), str(tokenizer), "command line", ())
    moved = (host is not None and host != base.host) or (port is not None and port != base.port)
    host, port = host or base.host, port or base.port
    urls = tuple(metrics_urls) or ((_http(host, port, "/metrics"),) if moved or not base.metrics_urls
                                   else base.metrics_urls)  # fmt: skip
    via = base.via if not (moved or model or tokenizer) else f"{base.via}, overridden on the command line"
    if not (tokenizer or base.tokenizer):
        raise BenchError("no vllm component here says which tokenizer: give --tokenizer (the model folder)", 2)
    return Target(host, port, model or base.model, tokenizer or base.tokenizer, via, urls)


def bench_command(vllm: str, work: Workload, target: Target, result_dir: str, result_file: str) -> list[str]:
    """run_vllm_bench.py's command, flag for flag, then what makes vllm save its result where we read it."""
    cmd = [
        vllm, "bench", "serve",
        "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions",
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(work.prefix_len),
        "--prefix-repetition-suffix-len", str(work.suffix_len),
        "--prefix-repetition-output-len", str(work.output_len),
        "--num-prompts", str(work.num_prompts),
        "--prefix-repetition-num-prefixes", str(work.num_prefixes),
        "--ignore-eos",
        "--model", target.model,
        "--tokenizer", target.tokenizer,
        "--seed", str(work.seed),
        "--host", target.host,
        "--port", str(target.port),
        "--max-concurrency", str(work.concurrency),
    ]  # fmt: skip
    if work.request_rate is not None:
        cmd += ["--request-rate", str(work.request_rate)]
    return [*cmd, "--save-result", "--result-dir", result_dir, "--result-filename", result_file]


def info_block(work: Workload, cmd: Sequence[str], target: Target) -> str:
    """The script's banner (its labels), then where the requests and the counters come from."""
    return "\n".join([
        "=======bench info========",
        f"总长度: {work.total_len}",
        f"重复前缀率: {work.repeat_prefix_ratio}",
        f"前缀长度: {work.prefix_len}",
        f"输出长度: {work.output_len}",
        f"并发数: {work.concurrency}",
        f"目标: {_http(target.host, target.port)} ({target.via})",
        f"cache counters: {', '.join(target.metrics_urls) or 'none'}",
        "",
        "执行命令:",
        " ".join(cmd),
        "===============",
        "",
    ])  # fmt: skip


def find_vllm(explicit: str | None, configured: str | None = None) -> str:
    """--vllm, else the config's vLLM command when it is `vllm` itself, else `vllm` on PATH."""
    import shutil

    tried = [c for c in (explicit,) if c] or [c for c in (configured, "vllm") if c]
    for candidate in tried:
        found = shutil.which(candidate)
        if found:
            return found
    raise BenchError(f"vllm not found ({' or '.join(dict.fromkeys(tried))} on PATH): nodeagentctl bench runs "
                     "`vllm bench serve` — run it where vLLM is installed, or give --vllm PATH", EXIT_NO_VLLM)


# ---- counters and results --------------------------------------------------------------------------------------


def scrape_counters(urls: Sequence[str]) -> dict[str, dict[str, CacheCounters]]:
    """Every URL's counters per engine; raises ScrapeError / CacheMetricsError naming the URL."""
    out = {}
    for url in urls:
        counters = parse_cache_counters(scrape(url))
        if not counters:
            raise CacheMetricsError(f"no prefix-cache counters at {url} (prefix caching off?)")
        out[url] = counters
    return out


def _count(value: float | None) -> int | float | None:
    return int(value) if value is not None and float(value).is_integer() else value


def cache_report(before: Mapping[str, Mapping[str, CacheCounters]],
                 after: Mapping[str, Mapping[str, CacheCounters]]) -> dict[str, Any]:  # fmt: skip
    """The run's window over every source and engine; rates are fractions, null where nothing was looked up."""

    def flat(by_url: Mapping[str, Mapping[str, CacheCounters]]) -> dict[str, CacheCounters]:
        return {f"{url} engine={engine}": c for url, engines in by_url.items() for engine, c in engines.items()}

    rates = window_rates(flat(before), flat(after))
    c = rates.counters
    return {"local_hit_rate": rates.local_total, "external_hit_rate": rates.ext_total,
            "effective_hit_rate": rates.eff_total, "local_queries": _count(c.queries), "local_hits": _count(c.hits),
            "external_queries": _count(c.ext_queries), "external_hits": _count(c.ext_hits),
            "vllm_restarted": rates.reset, "sources": list(after)}  # fmt: skip


def latency_summary(result: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's own numbers: counts, throughput and every TTFT/TPOT/ITL/E2EL statistic it saved."""
    keys = [k for k in SUMMARY_KEYS if k in result] + sorted(k for k in result if _LATENCY_KEY.match(k))
    return {k: result[k] for k in keys}


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate * 100:.2f}%"


def format_summary(report: Mapping[str, Any]) -> str:
    lines = ["=======bench result========"]
    vllm = report.get("vllm")
    if vllm:
        lines.append(f"requests: {vllm.get('completed')} completed, {vllm.get('failed')} failed in "
                     f"{float(vllm.get('duration') or 0):.2f} s")  # fmt: skip
        for metric in ("ttft", "tpot", "itl"):
            stats = [(k.split("_")[0], v) for k, v in vllm.items() if k.endswith(f"_{metric}_ms") and
                     not k.startswith("std")]  # fmt: skip
            if stats:
                lines.append(f"{metric.upper()} (ms): " + " · ".join(f"{name} {float(v):.2f}" for name, v in stats))
    else:
        lines.append(f"vllm bench serve wrote no result (exit {report.get('exit_code')})")
    cache = report.get("cache")
    if cache:
        lines.append(f"prefix cache, this run: local {_pct(cache['local_hit_rate'])} · external "
                     f"{_pct(cache['external_hit_rate'])} · effective {_pct(cache['effective_hit_rate'])} "
                     f"({cache['local_queries']} prompt tokens looked up)")  # fmt: skip
        if cache["vllm_restarted"]:
            lines.append("  (vLLM restarted during the run: the rates count only since then)")
    else:
        lines.append(f"prefix cache: unknown ({report.get('cache_error')})")
    lines.append(f"saved: {report['saved']}" + (f" (vLLM's own result: {report['vllm_result_file']})"
                                               if report.get("vllm_result_file") else ""))  # fmt: skip
    return "\n".join(lines)


# ---- the run ---------------------------------------------------------------------------------------------------


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_bench(work: Workload, target: Target, vllm: str, output_dir: Path, as_json: bool,
              out: TextIO = sys.stdout) -> int:  # fmt: skip
    """Scrape, run vllm bench (its output passes through: progress), scrape, save one JSON; vllm's exit code.
    Not `core.run`: vllm bench runs in the foreground of the user's terminal (its Ctrl-C reaches it directly)."""
    import subprocess
    from datetime import datetime

    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"cannot create --output-dir {output_dir}: {exc.strerror or exc}", EXIT_OUTPUT) from None
    stamp = datetime.now().strftime(STAMP_FORMAT)
    vllm_file, saved = output_dir / f"vllm-bench-{stamp}.json", output_dir / f"dsv4-bench-{stamp}.json"
    cmd = bench_command(vllm, work, target, str(output_dir), vllm_file.name)
    chatter = sys.stderr if as_json else out  # with --json stdout carries only the JSON
    print(info_block(work, cmd, target), file=chatter, flush=True)
    cache_error = None
    try:
        before = scrape_counters(target.metrics_urls)
    except (ScrapeError, CacheMetricsError) as exc:
        before, cache_error = None, str(exc)
        print(f"nodeagentctl bench: {exc}: the run's hit rates will be unknown", file=sys.stderr, flush=True)
    started = datetime.now().astimezone()
    code = subprocess.call(cmd, stdout=sys.stderr if as_json else None)
    finished = datetime.now().astimezone()
    cache = None
    if before is not None:
        try:
            cache = cache_report(before, scrape_counters(target.metrics_urls))
        except (ScrapeError, CacheMetricsError) as exc:
            cache_error = f"after the run: {exc}"
    result = _read_result(vllm_file)
    report = {
        "kind": "dsv4-bench", "agent_version": __version__, "started_at": started.isoformat(timespec="seconds"),
        "finished_at": finished.isoformat(timespec="seconds"),
        "workload": {**asdict(work), "prefix_len": work.prefix_len, "suffix_len": work.suffix_len},
        "target": {**asdict(target), "metrics_urls": list(target.metrics_urls)}, "command": cmd, "exit_code": code,
        "vllm_result_file": str(vllm_file) if result is not None else None,
        "vllm": latency_summary(result) if result is not None else None,
        "cache": cache, "cache_error": cache_error, "saved": str(saved),
    }  # fmt: skip
    try:
        _write_json(saved, report)
    except OSError as exc:
        raise BenchError(f"cannot write {saved}: {exc.strerror or exc}", EXIT_OUTPUT) from None
    print(json.dumps(report, indent=2) if as_json else format_summary(report), file=out, flush=True)
    return code


# ---- the command line ------------------------------------------------------------------------------------------


def run_from_args(args: argparse.Namespace, load_config: Any) -> int:
    """`load_config()` gives the full config; it is not called when --host/--port/--model/--tokenizer say all."""
    given = (args.host, args.port, args.model, args.tokenizer)
    config = None if all(v is not None for v in given) and args.config is None else load_config()
    vllm_comp = next((c for c in config.components.values() if c.kind == "vllm"), None) if config else None
    configured = vllm_comp.command[0] if vllm_comp and Path(vllm_comp.command[0]).name == "vllm" else None
    vllm = find_vllm(args.vllm, configured)
    target = override_target(config_target(config) if config else None, *given, args.metrics_url)
    work = Workload(args.total_len, args.repeat_prefix_ratio, args.output_len, args.num_prompts, args.num_prefixes,
                    args.concurrency, args.seed, args.request_rate)  # fmt: skip
    return run_bench(work, target, vllm, Path(args.output_dir), args.json)

"""`nodeagentctl bench`, `cache` and `probe`: the guide's benchmark, prefix-cache watch and health probe."""

from __future__ import annotations

import argparse

from nodeagent.cli.agentconfig import config_path, full_config
from nodeagent.cli.common import EXIT_USAGE, CliError


def cmd_cache(args: argparse.Namespace) -> int:
    from nodeagent.cli.cachewatch import run_cache

    url = args.url
    if url is None:  # the config's first vLLM, as the agent scrapes it (the validated model: ~250 ms, once)
        from nodeagent.vllm.endpoints import vllm_metrics_urls

        urls = vllm_metrics_urls(full_config(args).active_components())
        if not urls:
            raise CliError(f"no vllm component in {config_path(args)}: give the metrics URL with --url", EXIT_USAGE)
        url = next(iter(urls.values()))
    return run_cache(url, watch=args.watch, interval=args.interval, output=args.output, as_json=args.as_json)


def cmd_bench(args: argparse.Namespace) -> int:
    from nodeagent.cli.bench import BenchError, run_from_args

    try:
        return run_from_args(args, lambda: full_config(args))
    except BenchError as exc:
        raise CliError(str(exc), exc.code) from None


def cmd_probe(args: argparse.Namespace) -> int:
    from nodeagent.cli.probe import probe_targets, run_probe

    config = full_config(args)
    role = args.role or ("master" if config.node.role == "master" else "slave")
    return run_probe(probe_targets(config), role, args.timeout)


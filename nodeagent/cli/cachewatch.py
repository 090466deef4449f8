"""``nodeagentctl cache``: scrape vLLM's /metrics, print prefix-cache hit rates as watch_cache_hit_rate.sh.

Standard library only (urllib), so the CLI does not pay for aiohttp; the arithmetic lives in
``nodeagent.vllm.cachehit``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from typing import TextIO

from nodeagent.core.errors import AgentError
from nodeagent.core.parsing import positive_seconds
from nodeagent.vllm.cachehit import (
    TIMESTAMP_FORMAT,
    CacheCounters,
    CacheMetricsError,
    compute_table,
    format_header,
    format_row,
    parse_cache_counters,
    rates_to_json,
)

DEFAULT_INTERVAL = 5.0  # the script's default poll interval
SCRAPE_TIMEOUT = 5.0
EXIT_UNREACHABLE = 3
EXIT_BAD_METRICS = 4  # reachable, but not metrics text or no prefix-cache counters in it
EXIT_OUTPUT = 73  # EX_CANTCREAT: --output cannot be written


class ScrapeError(AgentError):
    """The metrics endpoint could not be read; the message names the URL."""


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT) -> str:
    """GET ``url`` and return the body; any failure becomes one :class:`ScrapeError` naming the URL."""
    # Lazy: urllib.request pulls in http.client, email and ssl (~35 ms) that other CLI commands do not need.
    import http.client
    import urllib.error
    import urllib.request

    from nodeagent.core.bindaddr import direct_opener

    opener = direct_opener()
    try:
        with opener.open(url, timeout=timeout) as response:
            charset = response.headers.get_content_charset() or "utf-8"
            return response.read().decode(charset, errors="replace")
    except urllib.error.HTTPError as exc:  # before URLError: it is a subclass
        raise ScrapeError(f"failed to fetch metrics from {url}: HTTP {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        raise ScrapeError(f"failed to fetch metrics from {url}: {exc.reason}") from exc
    except (OSError, http.client.HTTPException, ValueError) as exc:  # timeouts, resets, malformed URLs
        raise ScrapeError(f"failed to fetch metrics from {url}: {exc or type(exc).__name__}") from exc


def _read_counters(url: str, timeout: float) -> dict[str, CacheCounters]:
    counters = parse_cache_counters(scrape(url, timeout))
    if not counters:
        raise CacheMetricsError(f"no prefix cache metrics found at {url}")
    return counters


def _append(output: str | None, lines: list[str]) -> None:
    """Open per block, as the script's ``>>`` does, so logrotate can move the file between scrapes."""
    if output is not None:
        with open(output, "a", encoding="utf-8") as fh:
            fh.writelines(line + "\n" for line in lines)


def run_cache(
    url: str,
    *,
    watch: bool,
    interval: float,
    output: str | None,
    as_json: bool,
    stream: TextIO = sys.stdout,
    count: int | None = None,
    timeout: float = SCRAPE_TIMEOUT,
) -> int:
    """Print hit-rate rows for ``url`` and return the exit code.

    Without ``watch``: one block (per-engine rows and ``all``) whose window is everything since vLLM
    started. With ``watch``: a block every ``interval`` seconds, the window being the time since the
    previous one; a failure on the first scrape exits (wrong URL), later ones are reported on stderr and
    retried, since vLLM restarting is exactly what an operator may be watching. ``count`` bounds the number
    of scrapes. Rows also go to ``output`` (appended) and are JSON lines with ``as_json``.
    """
    if not as_json:
        print(format_header(), file=stream, flush=True)  # stdout only, like the script: the log has rows
    prev: dict[str, CacheCounters] | None = None
    scrapes = 0
    next_due = time.monotonic()
    try:
        while True:
            now = datetime.now().astimezone()
            try:
                cur = _read_counters(url, timeout)
            except (ScrapeError, CacheMetricsError) as exc:
                if not watch or prev is None:
                    print(f"nodeagentctl cache: {exc}", file=sys.stderr)
                    return EXIT_UNREACHABLE if isinstance(exc, ScrapeError) else EXIT_BAD_METRICS
                print(f"{now.strftime(TIMESTAMP_FORMAT):<19} {exc}", file=sys.stderr)
            else:
                rows = compute_table(prev, cur)
                if as_json:
                    lines = [json.dumps(rates_to_json(now, rates)) for rates in rows]
                else:
                    lines = [format_row(now, rates) for rates in rows] + [""]  # blank line between blocks
                print("\n".join(lines), file=stream, flush=True)
                try:
                    _append(output, lines)
                except OSError as exc:
                    print(
                        f"nodeagentctl cache: cannot append to {output}: {exc.strerror or exc}",
                        file=sys.stderr,
                    )
                    return EXIT_OUTPUT
                prev = cur
            scrapes += 1
            if not watch or (count is not None and scrapes >= count):
                return 0
            # Keep the cadence fixed rather than drifting by the scrape time; skip ticks we overran.
            next_due += interval
            now_mono = time.monotonic()
            if next_due < now_mono:
                next_due = now_mono
            time.sleep(next_due - now_mono)
    except KeyboardInterrupt:
        if not as_json:  # the script's farewell; JSON consumers get a clean stream
            print("\nStopped.", file=stream, flush=True)
        return 0


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``nodeagentctl cache``; -u/-i/-o are the script's, so operators' habits carry over."""
    parser.add_argument(
        "-u", "--url", default=None, help="metrics endpoint (default: the configured vLLM port's /metrics)"
    )
    parser.add_argument("-w", "--watch", action="store_true", help="print a block every --interval seconds")
    parser.add_argument(
        "-i",
        "--interval",
        type=positive_seconds,
        default=DEFAULT_INTERVAL,
        metavar="S",
        help=f"seconds between scrapes with --watch (default: {DEFAULT_INTERVAL:g})",
    )
    parser.add_argument("-o", "--output", default=None, metavar="FILE", help="also append the rows to FILE")
    parser.add_argument(
        "--json",
        dest="as_json",
        action="store_true",
        help="JSON lines: rates as fractions, null when undefined",
    )

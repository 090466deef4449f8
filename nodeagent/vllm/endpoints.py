"""Where a vLLM component answers over HTTP, from its config alone (no supervisor, no metrics registry needed),
and what it is busy with (the drain before a planned stop waits for it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nodeagent.core.bindaddr import connect_host, url_host
from nodeagent.core.errors import AgentError
from nodeagent.core.http import HttpError, fetch
from nodeagent.vllm.progress import parse_progress

if TYPE_CHECKING:
    import aiohttp


def vllm_metrics_urls(components: Mapping[str, Any]) -> dict[str, str]:
    """Each vLLM component's /metrics (config name → URL): loopback, or its bind address if it binds one."""
    urls = {}
    for name, cfg in components.items():
        if cfg.kind == "vllm" and not cfg.headless:  # a headless node serves no HTTP
            urls[name] = f"http://{url_host(connect_host(cfg.host))}:{cfg.port}/metrics"
    return urls


async def vllm_inflight(session: aiohttp.ClientSession, name: str, cfg: Any) -> tuple[int, int] | None:
    """(running, waiting) requests of a vLLM component right now, from its /metrics; None when unreadable."""
    url = vllm_metrics_urls({name: cfg}).get(name)
    if url is None:
        return None
    try:
        answer = await fetch("GET", url, 5.0, session=session)
    except HttpError:
        return None
    if answer.status != 200:
        return None
    text = answer.text
    try:
        engines = parse_progress(text)
    except AgentError:
        return None
    return (round(sum(e.running for e in engines.values())), round(sum(e.waiting for e in engines.values())))

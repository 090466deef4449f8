"""What a rollout reads from the ranks over HTTP: their requests in flight (the drain), the canary (the gate) and
their /metrics (the bake). Each is a plain function the executor is given, so the process-less tests give fakes."""

from __future__ import annotations

import asyncio
from typing import Any


async def http_inflight(name: str, cfg: Any) -> tuple[int, int] | None:
    import aiohttp

    from nodeagent.vllm.endpoints import vllm_inflight

    async with aiohttp.ClientSession() as session:
        return await vllm_inflight(session, name, cfg)


async def http_canary(endpoint: str, cfg: Any, timeout_s: float = 60.0) -> tuple[bool, str]:
    """The guide's 2-token chat request straight to one API server of the group: ok when tokens come back."""
    import aiohttp

    from nodeagent.probes.resolve import vllm_probe_body

    url = f"http://{endpoint}/v1/chat/completions"
    try:
        body_out = vllm_probe_body(getattr(cfg, "served_model_name", None))
        async with (aiohttp.ClientSession() as session, asyncio.timeout(timeout_s),
                    session.post(url, json=body_out) as answer):  # fmt: skip
            body = await answer.json(content_type=None)
            if answer.status != 200:
                return False, f"HTTP {answer.status} from {url}"
            text = ((body.get("choices") or [{}])[0].get("message") or {}).get("content")
            return (True, "ok") if text else (False, f"{url} answered no tokens")
    except TimeoutError:
        return False, f"no answer from {url} within {timeout_s:.0f}s"
    except (OSError, ValueError, aiohttp.ClientError) as exc:
        return False, f"{type(exc).__name__} from {url}: {exc}"


async def http_scrape(endpoint: str, timeout_s: float = 10.0) -> str:
    """One rank's /metrics text (the bake's reading); raises OSError/ValueError/TimeoutError when unreadable."""
    import aiohttp

    try:
        async with (aiohttp.ClientSession() as session, asyncio.timeout(timeout_s),
                    session.get(f"http://{endpoint}/metrics") as answer):  # fmt: skip
            if answer.status != 200:
                raise ValueError(f"HTTP {answer.status} from {endpoint}/metrics")
            return await answer.text()
    except aiohttp.ClientError as exc:
        raise OSError(f"{type(exc).__name__} from {endpoint}/metrics: {exc}") from exc

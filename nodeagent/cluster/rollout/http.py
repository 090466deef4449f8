"""What a rollout reads from the ranks over HTTP: their requests in flight (the drain), the canary (the gate) and
their /metrics (the bake). Each is a plain function the executor is given, so the process-less tests give fakes."""

from __future__ import annotations

from typing import Any

from nodeagent.core.http import fetch, new_session


async def http_inflight(name: str, cfg: Any) -> tuple[int, int] | None:
    from nodeagent.vllm.endpoints import vllm_inflight

    async with new_session() as session:
        return await vllm_inflight(session, name, cfg)


async def http_canary(endpoint: str, cfg: Any, timeout_s: float = 60.0) -> tuple[bool, str]:
    """The guide's 2-token chat request straight to one API server of the group: ok when tokens come back."""
    from nodeagent.probes.resolve import vllm_probe_body

    url = f"http://{endpoint}/v1/chat/completions"
    try:
        answer = await fetch("POST", url, timeout_s, json=vllm_probe_body(getattr(cfg, "served_model_name", None)))
        if answer.status != 200:
            return False, f"HTTP {answer.status} from {url}"
        body = answer.json() or {}
        text = ((body.get("choices") or [{}])[0].get("message") or {}).get("content")
        return (True, "ok") if text else (False, f"{url} answered no tokens")
    except (OSError, ValueError, AttributeError) as exc:
        return False, str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__} from {url}: {exc}"


async def http_scrape(endpoint: str, timeout_s: float = 10.0) -> str:
    """One rank's /metrics text (the bake's reading); raises OSError/ValueError when unreadable."""
    answer = await fetch("GET", f"http://{endpoint}/metrics", timeout_s)
    if answer.status != 200:
        raise ValueError(f"HTTP {answer.status} from {endpoint}/metrics")
    return answer.text

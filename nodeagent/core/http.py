"""The daemon's one HTTP client stack: aiohttp, its sessions made here and nowhere else, one error type.

Every session ignores the environment's proxy settings (`trust_env=False`): the agent talks to loopback, its
vLLMs, the PD proxy and its peers on the cluster network, never through a site's `http_proxy`. A request that
gets no answer (refused, reset, timed out, a broken body) raises `HttpError`, an `OSError` naming the method, the
URL and why, so callers catch one thing; an answer with any status is an `Answer`. The CLI keeps its own small
sync client (`cli/http.py`): it must not pay aiohttp's import for one request.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp


class HttpError(OSError):
    """No answer: the message names the method, the URL and why."""


@dataclass(frozen=True)
class Answer:
    status: int
    text: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        """The body as JSON (None when empty); ValueError when it is not JSON."""
        return jsonlib.loads(self.text) if self.text.strip() else None


def new_session(timeout_s: float | None = None, force_close: bool = False) -> aiohttp.ClientSession:
    """A session for one owner (kept for its connections, closed by it). `timeout_s`: each request's total bound
    unless the request gives its own; `force_close`: a new connection per request (probes: a vLLM that dropped a
    kept-alive connection must not fail the next probe)."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=force_close),
        timeout=aiohttp.ClientTimeout(total=timeout_s), trust_env=False,
    )  # fmt: skip


async def fetch(method: str, url: str, timeout_s: float, *, json: Any = None, headers: Mapping[str, str] | None = None,
                session: aiohttp.ClientSession | None = None) -> Answer:  # fmt: skip
    """One request, bounded by `timeout_s` in all; over `session`, or a session made for this call only."""
    import aiohttp

    if session is None:
        async with new_session() as own:
            return await fetch(method, url, timeout_s, json=json, headers=headers, session=own)
    try:
        async with session.request(method, url, json=json, headers=dict(headers or {}),
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:  # fmt: skip
            return Answer(response.status, await response.text(errors="replace"))
    except TimeoutError:
        raise HttpError(f"{method} {url}: no answer within {timeout_s:g}s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise HttpError(f"{method} {url}: {type(exc).__name__}: {exc}") from None

"""A thin client of vLLM's fault-tolerance API (`/fault_tolerance/status`, `/fault_tolerance/apply`, vLLM 0.32).

The shapes are those read from the 0.32 wheel (docs/architecture.md, "vLLM fault tolerance"): the status lists
this server's engines (one, its DP rank, in external load balancing), `apply` takes
`{"instruction": "retry", "params": {}}` and answers 202 with a request id while the recovery runs in the
background. `apply` also speaks the earlier upstream shape (`fault_tolerance_instruction`/`_timeout`, answered 200
once done) in the same body: each reads its own keys. Errors come out as one of three exceptions, each with a
one-line message naming the server.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from nodeagent.core.http import HttpError, fetch

# the support rule is pure (ft_rules: rendering imports it without aiohttp); its callers read it here too
from nodeagent.vllm.ft_rules import Instruction, RankStatus, Support, supports_fault_tolerance  # noqa: F401

if TYPE_CHECKING:
    import aiohttp

STATUS_PATH = "/fault_tolerance/status"
APPLY_PATH = "/fault_tolerance/apply"
SCHEMA_VERSION = 1
ENGINE_STATES = frozenset({"healthy", "unhealthy", "dead"})
DEFAULT_TIMEOUT_S = 5.0


class FtError(Exception):
    """Any failure talking to a rank's fault-tolerance API."""


class FtUnreachable(FtError):
    """No answer: connection refused or reset, or no answer within the timeout."""


class FtNotServed(FtError):
    """404: this server has no fault-tolerance routes (an older vLLM, or started without the flag)."""


class FtRejected(FtError):
    """An answer, but not the expected one: another status code, or a body of another shape."""


def parse_status(body: Any, where: str = "status") -> list[RankStatus]:
    """`GET /fault_tolerance/status`'s body as the rule reads it; FtRejected if it is not of that shape."""
    if not isinstance(body, dict) or body.get("schema_version") != SCHEMA_VERSION:
        raise FtRejected(f"{where}: not a fault-tolerance status of schema_version {SCHEMA_VERSION}: {body!r:.200}")
    engines = body.get("engines")
    if not isinstance(engines, list):
        raise FtRejected(f"{where}: 'engines' is not a list")
    out = []
    for engine in engines:
        if not isinstance(engine, dict) or not isinstance(engine.get("id"), int) or isinstance(engine["id"], bool):
            raise FtRejected(f"{where}: an engine without an integer id: {engine!r:.200}")
        state = engine.get("status")
        if state not in ENGINE_STATES:
            raise FtRejected(f"{where}: engine {engine['id']} has an unknown status {state!r}")
        out.append(RankStatus(
            rank=engine["id"],
            state=state,
            fault_info=_optional_str(engine.get("fault_info")),
            ft_error=_optional_str(engine.get("ft_error")),
            last_ft_request_id=_optional_str(engine.get("last_ft_request_id")),
        ))
    return out


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _error_message(body: Any, text: str) -> str:
    """vLLM's ErrorResponse `{"error": {"message"}}`, FastAPI's `{"detail"}`, or the text."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in body:
            return str(body["detail"])
    return text.strip()[:200]


async def _call(session: aiohttp.ClientSession, method: str, url: str, timeout_s: float,
                json_body: dict[str, Any] | None = None) -> tuple[int, Any, str]:
    try:
        answer = await fetch(method, url, timeout_s, json=json_body, session=session)
    except HttpError as exc:
        raise FtUnreachable(str(exc)) from None
    try:
        body = answer.json()
    except ValueError:
        body = None
    return answer.status, body, answer.text


async def fetch_status(session: aiohttp.ClientSession, base_url: str,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> list[RankStatus]:
    url = base_url.rstrip("/") + STATUS_PATH
    status, body, text = await _call(session, "GET", url, timeout_s)
    if status == 404:
        raise FtNotServed(f"GET {url}: 404 {_error_message(body, text)}")
    if status != 200:
        raise FtRejected(f"GET {url}: {status} {_error_message(body, text)}")
    return parse_status(body, where=f"GET {url}")


def apply_body(instruction: Instruction, instruction_timeout_s: float) -> dict[str, Any]:
    """One body both API shapes take, each reading its keys and ignoring the other's: the wheel's
    (`instruction`, `params`; 0.32's `_validate_payload` reads only those) and the earlier upstream router's
    (`fault_tolerance_instruction`, and `fault_tolerance_timeout`, required: a positive int; it reads nothing else
    but `fault_tolerance_params`, passed as keyword arguments to the engine, so not sent)."""
    return {"instruction": instruction, "params": {}, "fault_tolerance_instruction": instruction,
            "fault_tolerance_timeout": max(1, math.ceil(instruction_timeout_s))}


async def apply(session: aiohttp.ClientSession, base_url: str, instruction: Instruction,
                timeout_s: float = DEFAULT_TIMEOUT_S, instruction_timeout_s: float = 60.0) -> str:
    """Send one instruction; the request id the server gave it ("" when it gave none).

    vLLM 0.32 answers 202 with a `request_id` at once and runs the instruction in the background (its outcome shows
    in the status, under that id). The earlier upstream router (vllm-project/vllm 04918f3e,
    `vllm/entrypoints/serve/fault_tolerance/api_router.py`) runs it before answering: 200 when it succeeded (no
    id), 500 when it failed, within `fault_tolerance_timeout`. So the exchange may take `instruction_timeout_s`
    plus `timeout_s`.
    """
    url = base_url.rstrip("/") + APPLY_PATH
    status, body, text = await _call(session, "POST", url, timeout_s + instruction_timeout_s,
                                     apply_body(instruction, instruction_timeout_s))  # fmt: skip
    if status == 404:
        raise FtNotServed(f"POST {url}: 404 {_error_message(body, text)}")
    if status not in (200, 202):
        raise FtRejected(f"POST {url}: {status} {_error_message(body, text)}")
    request_id = body.get("request_id") if isinstance(body, dict) else None
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise FtRejected(f"POST {url}: {status} with a request_id that is not a string: {text.strip()[:200]}")
    if status == 202 and request_id is None:
        raise FtRejected(f"POST {url}: 202 without a request_id: {text.strip()[:200]}")
    return request_id or ""

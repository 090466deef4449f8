"""The daemon's one HTTP client stack (`core.http`): sessions are made there and nowhere else in the daemon, no
urllib outside the CLI, and a request that gets no answer is one `HttpError` (an OSError) naming the URL. The
server is aiohttp's, in this process."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from conftest import free_port

from nodeagent.core.http import HttpError, fetch, new_session

PACKAGE = Path(__file__).resolve().parent.parent / "nodeagent"
HTTP_MODULE = PACKAGE / "core" / "http.py"
CLI = PACKAGE / "cli"


def calls_and_imports(text: str) -> tuple[set[str], set[str]]:
    tree = ast.parse(text)
    calls = {ast.unparse(node.func) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)}  # fmt: skip
    imports = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imports |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    return calls, imports


def test_sessions_are_made_in_core_http_only_and_urllib_stays_in_the_cli() -> None:
    makers, urllib_users = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if not any(word in text for word in ("ClientSession", "TCPConnector", "urllib", "http.client")):
            continue
        calls, imports = calls_and_imports(text)
        if path != HTTP_MODULE and calls & {"aiohttp.ClientSession", "ClientSession", "aiohttp.TCPConnector"}:
            makers.append(str(path.relative_to(PACKAGE)))
        if CLI not in path.parents and path.name != "bindaddr.py" and {"urllib.request", "http.client"} & imports:
            urllib_users.append(str(path.relative_to(PACKAGE)))
    assert makers == [], "HTTP sessions made outside core/http.py"
    assert urllib_users == [], "a second HTTP client in the daemon"


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async def answer(request: web.Request) -> web.Response:
        if request.path == "/slow":
            await asyncio.sleep(1)
        body = await request.json() if request.can_read_body else None
        return web.json_response({"body": body, "who": request.headers.get("X-Who")},
                                 status=int(request.query.get("status", "200")))  # fmt: skip

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_an_answer_of_any_status_is_an_answer(server: str) -> None:
    answer = await fetch("POST", f"{server}/x?status=503", 5.0, json={"a": 1}, headers={"X-Who": "me"})
    assert (answer.status, answer.ok, answer.json()) == (503, False, {"body": {"a": 1}, "who": "me"})
    async with new_session() as session:
        again = await fetch("GET", f"{server}/y", 5.0, session=session)
    assert again.ok and again.json() == {"body": None, "who": None}


async def test_no_answer_is_one_error_naming_the_url(server: str) -> None:
    refused = f"http://127.0.0.1:{free_port()}/metrics"
    with pytest.raises(HttpError, match=f"GET {refused}: ClientConnectorError"):
        await fetch("GET", refused, 5.0)
    with pytest.raises(HttpError, match=rf"GET {server}/slow: no answer within 0\.2s"):
        await fetch("GET", f"{server}/slow", 0.2)
    assert issubclass(HttpError, OSError), "callers that caught urllib's OSError keep catching it"


async def test_the_rollouts_canary_and_bake_read_through_it(server: str) -> None:
    from nodeagent.cluster.rollout.http import http_canary, http_scrape

    endpoint = server.removeprefix("http://")
    assert await http_canary(endpoint, None) == (False, f"{server}/v1/chat/completions answered no tokens")
    assert (await http_scrape(endpoint)).startswith('{"body": null')
    refused = f"127.0.0.1:{free_port()}"
    ok, why = await http_canary(refused, None)
    assert not ok and why.startswith(f"POST http://{refused}/v1/chat/completions: ClientConnectorError")
    with pytest.raises(OSError, match=f"GET http://{refused}/metrics"):
        await http_scrape(refused)

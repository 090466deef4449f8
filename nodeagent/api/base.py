"""What every part of the local HTTP API shares: JSON errors, the token and who may change things, JSON bodies.

`api.Api` and its route mixins (`api_cluster.ClusterRoutes`, `ui.routes.UiRoutes`) import this module, never each
other: one direction, no import circle.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import os
import secrets
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from loguru import logger

from nodeagent.core.errors import AgentError

MAX_BODY = 64 * 1024
"""Every body this API takes is a tiny JSON object; anything bigger is refused with 413 before parsing."""
COMPONENT_ACTIONS = ("start", "stop", "restart")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def drain_flag(data: dict[str, Any]) -> bool:
    """A body's `drain` (default true): anything but a JSON boolean is a 400."""
    drain = data.get("drain", True)
    if not isinstance(drain, bool):
        raise ApiError(400, f"drain must be true or false, got {drain!r}")
    return drain


class ApiError(Exception):
    """An error with its HTTP status; the middleware turns it into the JSON error body."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status, headers=headers)


_dumps = functools.partial(json.dumps, default=str)


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=_dumps)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as JSON: aiohttp's own (404, 405, 413), ours, and — logged — anything unexpected."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, str(exc), exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "WWW-Authenticate")}
        if exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} not allowed on {request.path} (allowed: {exc.headers.get('Allow')})"
        elif exc.status == 413:
            message = f"request body too large (limit {MAX_BODY} bytes)"
        else:
            message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return error_response(exc.status, message, headers)
    except Exception:
        logger.exception(f"API: unexpected error in {request.method} {request.path}")
        return error_response(500, "internal error (logged by the agent)")


# ---- the token -------------------------------------------------------------------------------------------------


def ensure_token(path: Path) -> str:
    """The API token from `path`, created (0600, folder 0700 if new) on first start.

    Written to a temp file and renamed in, so a CLI reading it concurrently never sees half a token.
    """
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        token = ""
    except (OSError, UnicodeDecodeError) as exc:
        raise AgentError(f"cannot read the API token file {path}: {exc}") from None
    if token:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            logger.warning(f"API token file {path} is readable by others (mode {mode:o}); chmod 600 it")
        return token
    try:
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, mode=0o700)
            path.parent.chmod(0o700)  # mkdir's mode is subject to the umask
        token = secrets.token_urlsafe(32)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (token + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        raise AgentError(f"cannot create the API token file {path}: {exc}") from None
    logger.info(f"created the API token file {path}")
    return token


def peer_uid(request: web.Request) -> int | None:
    """The uid of a unix-socket peer (SO_PEERCRED), None over TCP."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    with contextlib.suppress(OSError):
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))  # fmt: skip
        return uid
    return None


class Handlers:
    """The base of `api.Api` and its route mixins: who is asking, whether they may change things, the body."""

    ctl: Any
    """The agent (`api.Controller`); the mixins read what their routes need from it."""
    token: str

    def authorize(self, request: web.Request) -> str:
        """Who is asking (for the audit log), or 401. Root or our own uid on the unix socket need no token."""
        uid = peer_uid(request)
        if uid is not None and uid in (0, os.getuid()):
            return f"unix socket uid {uid}"
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        challenge = {"WWW-Authenticate": 'Bearer realm="dsv4-agent"'}
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "this call needs 'Authorization: Bearer <token>' (the agent's token file)",
                           challenge)  # fmt: skip
        if not hmac.compare_digest(given.strip().encode(errors="surrogateescape"), self.token.encode()):
            raise ApiError(401, "wrong token", challenge)
        peer = request.remote or (f"unix socket uid {uid}" if uid is not None else "?")
        return f"token holder at {peer}"

    def mutation(self, request: web.Request) -> str:
        who = self.authorize(request)
        if self.ctl.stopping:
            raise ApiError(503, "the agent is stopping; no new actions")
        logger.info(f"API: {request.method} {request.path} by {who}")
        return who

    async def component_command(self, request: web.Request, action: str) -> tuple[str, bool]:
        """A start/stop/restart of a component, here or on a peer: who asks, and whether to drain first."""
        who = self.mutation(request)
        if action not in COMPONENT_ACTIONS:
            raise ApiError(400, f"unknown action {action!r} (expected one of: {', '.join(COMPONENT_ACTIONS)})")
        return who, drain_flag(await self.body(request, ("drain",)))

    @staticmethod
    async def body(request: web.Request, allowed: tuple[str, ...] = ()) -> dict[str, Any]:
        """The JSON object body ({} when empty); unknown keys, non-objects and bad JSON are a 400."""
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"body must be a JSON object, got {type(data).__name__}")
        extra = sorted(set(data) - set(allowed))
        if extra:
            accepted = ", ".join(allowed) or "none"
            raise ApiError(400, f"unknown body keys: {', '.join(extra)} (accepted: {accepted})")
        return data

"""The status page's routes (a mixin of `api.Api`): the page, its static files, and the hit-rate history.

Everything is read-only and served from this package: the Content-Security-Policy lets the page load and
fetch only from the agent itself, so nothing is fetched from outside even if a member's record were hostile.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from importlib import resources
from typing import Any

from aiohttp import web

from nodeagent.api.base import ApiError, json_response
from nodeagent.api.ui.firstpaint import first_paint
from nodeagent.api.ui.firstpaint_cluster import cluster_section

UI_ROUTES = (
    ("GET", "/ui", "ui_page"),
    ("GET", "/ui/{asset}", "ui_asset"),
    ("GET", "/cache", "cache_history"),
)
PAGE = "index.html"
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def static_files() -> list[str]:
    """The page's file names, listed from the package (a wheel or a source tree alike)."""
    folder = resources.files(__package__).joinpath("static")
    return sorted(f.name for f in folder.iterdir() if f.is_file() and f.name.endswith(tuple(CONTENT_TYPES)))


def read_static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def _response(name: str, body: bytes) -> web.Response:
    media = next(media for ext, media in CONTENT_TYPES.items() if name.endswith(ext))
    return web.Response(body=body, content_type=media, charset="utf-8", headers=HEADERS)


class UiRoutes:
    """Needs from the Api: `cache_sampler` (None when agent.ui.enabled is false), `status_data()` and `ctl` (the
    agent: its rollout executor, when it runs one, for the rollout box)."""

    cache_sampler: Any
    status_data: Callable[[], dict[str, Any]]
    cluster_data: Callable[[], dict[str, Any] | None]
    ctl: Any

    def _ui_enabled(self) -> None:
        if self.cache_sampler is None:
            raise ApiError(404, "the status page is off (agent.ui.enabled: false)")

    async def ui_page(self, request: web.Request) -> web.Response:
        """The page with its first paint rendered here (`firstpaint`): readable without JavaScript."""
        self._ui_enabled()
        page = read_static(PAGE).decode()
        with contextlib.suppress(Exception):  # the live page never depends on the first paint
            executor = getattr(self.ctl, "rollout", None)
            rollout = executor.view().get("rollout") if executor is not None else None
            status = self.status_data()
            page = first_paint(page, status, rollout=rollout)
            page = cluster_section(page, status, self.cluster_data())  # the member table too, as GET /cluster
        return _response(PAGE, page.encode())

    async def ui_asset(self, request: web.Request) -> web.Response:
        self._ui_enabled()
        name = request.match_info["asset"]
        if name == PAGE or name not in static_files():  # only listed names: no path ever reaches the filesystem
            raise ApiError(404, f"no such file of the status page: {name!r} (the page is GET /ui)")
        return _response(name, read_static(name))

    async def cache_history(self, request: web.Request) -> web.Response:
        """The plot's data: samples of the last hour (or those after `since`, a Unix time)."""
        self._ui_enabled()
        raw = request.query.get("since")
        since = None
        if raw is not None:
            try:
                since = float(raw)
            except ValueError:
                raise ApiError(400, f"since must be a Unix time in seconds, got {raw!r}") from None
            if not math.isfinite(since):
                raise ApiError(400, f"since must be a finite Unix time, got {raw!r}")
        return json_response(self.cache_sampler.view(since))

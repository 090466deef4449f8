"""The agent's local HTTP API (aiohttp): health, status, metrics, events, and operator actions.

Reads are open; mutating calls need `Authorization: Bearer <token>` (the token file, 0600), or — on the
optional unix socket — a peer that is root or the agent's own user (SO_PEERCRED). Every error is JSON
`{"error": ..., "status": N}`; bad input is a 4xx, never a 500, and never disturbs the stack. Actions that take
long answer 202 at once and run in the background, so /status always answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from loguru import logger

from nodeagent import __version__
from nodeagent.api.base import (
    MAX_BODY,
    ApiError,
    Handlers,
    ensure_token,
    json_errors,
    json_response,
)
from nodeagent.api.cluster import CLUSTER_ROUTES, ClusterRoutes
from nodeagent.api.metrics import CONTENT_TYPE, AgentMetrics
from nodeagent.api.ui.history import CacheSampler
from nodeagent.api.ui.routes import UI_ROUTES, UiRoutes
from nodeagent.core.errors import AgentError, ConfigError, CoordinationUnavailable, UnknownComponentError
from nodeagent.core.states import State, is_up
from nodeagent.node.blast_radius import Blast

if TYPE_CHECKING:
    from nodeagent.api.mqtt import MqttPublisher
    from nodeagent.api.vllm_sampler import VllmSampler
    from nodeagent.cluster.membership import Membership
    from nodeagent.config.model import Config
    from nodeagent.layers.guards import StartGuards
    from nodeagent.node.supervisor import Supervisor

SSE_KEEPALIVE_S = 10.0
SSE_MAX_SUBSCRIBERS = 64
REPLAY_DEFAULT = 50
LIVENESS_KINDS = ("vllm", "datasystem", "etcd")


def component_liveness(state: State, liveness: str, desired: str) -> dict[str, Any]:
    """One component's part of /livez (pure): live while up (`states.is_up`: draining too, a draining vLLM still
    serves its in-flight requests) and its liveness probe is not failing."""
    up = is_up(state)
    live = up and liveness != "failure"
    reason = None
    if not up:
        reason = f"state {state}" + (", desired stopped" if desired == "stopped" else "")
    elif not live:
        reason = "liveness probe failing"
    return {"live": live, "state": str(state), "liveness": liveness, "reason": reason}
"""What the guide's liveness check covers (etcd only runs on the master, so it is only there)."""


class Controller(Protocol):
    """What the API needs from the agent; `nodeagent.agent.Agent` is the implementation."""

    supervisor: Supervisor
    config: Config
    started_at: float
    guards: StartGuards
    mqtt: MqttPublisher | None
    membership: Membership | None
    vllm_sampler: VllmSampler

    @property
    def stopping(self) -> bool: ...

    def request_stop(self, detach: bool = False) -> None: ...

    async def reload(self) -> dict[str, Any]: ...


# ---- the routes --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Route:
    method: str
    path: str
    name: str
    """The handler method of `Api`; also the OpenAPI operationId."""
    mutating: bool = False


ROUTES = (
    Route("GET", "/healthz", "healthz"),
    Route("GET", "/livez", "livez"),
    Route("GET", "/readyz", "readyz"),
    Route("GET", "/status", "status"),
    Route("GET", "/metrics", "metrics"),
    Route("GET", "/cluster", "cluster"),
    Route("GET", "/events", "events"),
    Route("GET", "/openapi.json", "openapi"),
    Route("POST", "/components/{name}/{action}", "component_action", True),
    Route("POST", "/redeploy", "redeploy", True),
    Route("POST", "/reset", "reset", True),
    Route("POST", "/pause", "pause", True),
    Route("POST", "/resume", "resume", True),
    Route("POST", "/detach", "detach", True),
    Route("POST", "/reload", "reload", True),
    Route("GET", "/preflight", "preflight"),
    Route("POST", "/npu/override", "npu_override", True),
    Route("POST", "/uncordon", "uncordon", True),
    *(Route(method, path, name, True) for method, path, name in CLUSTER_ROUTES),
    *(Route(method, path, name) for method, path, name in UI_ROUTES),
)


class Api(ClusterRoutes, UiRoutes, Handlers):
    """Request handlers over a Controller; `build_app` wires them with the middleware and limits."""

    def __init__(self, ctl: Controller, token: str, metrics: AgentMetrics | None = None) -> None:
        self.ctl = ctl
        self.token = token
        self.agent_metrics = metrics or AgentMetrics(ctl.supervisor, ctl.vllm_sampler, started_at=ctl.started_at)
        self.closing = asyncio.Event()
        self.sse_streams = 0
        self.journal = _output_to_journal()
        ui = ctl.config.agent.ui
        self.cache_sampler = CacheSampler(ctl.vllm_sampler, ui) if ui.enabled else None
        """The status page's hit-rate history; runs while the API does."""

    @property
    def sup(self) -> Supervisor:
        return self.ctl.supervisor

    def component(self, name: Any) -> str:
        if not isinstance(name, str):
            raise ApiError(400, f"component must be a string, got {type(name).__name__}")
        try:
            self.sup.get(name)
        except UnknownComponentError as exc:
            raise ApiError(404, str(exc)) from None
        return name

    # ---- reads -----------------------------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return json_response({
            "ok": True, "version": __version__, "pid": os.getpid(), "node": self.sup.config.node.name,
            "uptime_s": round(time.time() - self.ctl.started_at, 1), "paused": self.sup.paused,
            "stopping": self.ctl.stopping,
        })  # fmt: skip

    def _liveness(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, comp in self.sup.components.items():
            if comp.kind not in LIVENESS_KINDS:
                continue
            liveness = comp.prober.status("liveness") if comp.prober is not None else "unknown"
            out[name] = component_liveness(comp.state, liveness, self.sup.desired(name))
        return out

    async def livez(self, request: web.Request) -> web.Response:
        parts = self._liveness()
        failing = {n: p["reason"] for n, p in parts.items() if not p["live"]}
        return json_response({"live": not failing, "components": parts, "failing": failing},
                             200 if not failing else 503)  # fmt: skip

    async def readyz(self, request: web.Request) -> web.Response:
        """vLLM (and the PD proxy where this node runs one) ready; on a node with neither, every component."""
        comps = self.sup.components
        gate = [n for n, c in comps.items() if c.kind in ("vllm", "proxy")] or list(comps)
        parts = {n: {"ready": comps[n].ready, "state": str(comps[n].state)} for n in gate}
        not_ready = [n for n, p in parts.items() if not p["ready"]]
        return json_response({"ready": not not_ready, "components": parts, "not_ready": not_ready},
                             200 if not not_ready else 503)  # fmt: skip

    async def status(self, request: web.Request) -> web.Response:
        return json_response(self.status_data())

    def status_data(self) -> dict[str, Any]:
        """/status: the supervisor's view with the agent's, the guards', MQTT's and the cluster's sections."""
        data = self.sup.status()
        data["agent"] = {
            "version": __version__, "pid": os.getpid(), "started_at": self.ctl.started_at,
            "uptime_s": round(time.time() - self.ctl.started_at, 1), "stopping": self.ctl.stopping,
            "config": str(self.sup.config.source or ""), "log_dir": str(self.sup.config.agent.log_dir),
            "journal": self.journal,
        }  # fmt: skip
        data.update(self.ctl.guards.status())
        if self.ctl.mqtt is not None:
            data["mqtt"] = self.ctl.mqtt.view()
        if self.ctl.membership is not None:
            data["cluster"] = {**(data.get("cluster") or {}), **self.ctl.membership.status_section()}
        return data

    async def preflight(self, request: web.Request) -> web.Response:
        """The agent's last preflight report (nodeagentctl preflight runs the checks afresh)."""
        report = self.ctl.guards.report
        if report is None:
            raise ApiError(404, "no preflight has run (agent.preflight: off, or the agent is starting)")
        return json_response({**report.to_dict(), "blocking": self.ctl.guards.blocking})

    async def npu_override(self, request: web.Request) -> web.Response:
        who = self.mutation(request)
        data = await self.body(request, ("npu",))
        npu = data.get("npu")
        if npu is not None and (not isinstance(npu, int) or isinstance(npu, bool) or npu < 0):
            raise ApiError(400, f"npu must be a non-negative whole number, got {npu!r}")
        done = self.ctl.guards.override_npu(npu, who)
        return json_response({"ok": True, "action": "npu_override", "npu": npu, "overridden": done})

    async def uncordon(self, request: web.Request) -> web.Response:
        """The operator takes an isolated node back (the ladder's last rung ends only here)."""
        from nodeagent.layers.chip_reset import NotIsolated

        who = self.mutation(request)
        await self.body(request)
        try:
            was = self.ctl.guards.recovery.uncordon(f"operator ({who})")
        except NotIsolated as exc:
            raise ApiError(409, str(exc)) from None
        return json_response({"ok": True, "action": "uncordon", "was_isolated": was})

    def cluster_data(self) -> dict[str, Any] | None:
        """/cluster's view (the status page's first paint writes it in too); None without cluster.nodes."""
        if self.ctl.membership is None:
            return None
        view = self.ctl.membership.view()
        coordinator = getattr(self.ctl, "coordinator", None)
        if coordinator is not None:
            view["coordination"] = coordinator.status()
        rollout = getattr(self.ctl, "rollout", None)
        if rollout is not None:
            view.update(rollout.view())
        return view

    async def cluster(self, request: web.Request) -> web.Response:
        view = self.cluster_data()
        if view is None:
            raise ApiError(404, "this node is not part of a cluster (its config has no cluster.nodes)")
        return json_response(view)

    async def metrics(self, request: web.Request) -> web.Response:
        await self.agent_metrics.refresh()
        return web.Response(body=self.agent_metrics.generate(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        from nodeagent.api.openapi import openapi_document

        return json_response(openapi_document())

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: up to `replay` recent events (or those after Last-Event-ID), then live ones."""
        raw = request.query.get("replay", str(REPLAY_DEFAULT))
        try:
            replay = int(raw)
        except ValueError:
            raise ApiError(400, f"replay must be a whole number, got {raw!r}") from None
        if replay < 0:
            raise ApiError(400, f"replay must be >= 0, got {replay}")
        last_id = request.headers.get("Last-Event-ID", "").strip()
        after = int(last_id) if last_id.isdigit() else None
        if request.method == "HEAD":  # headers only: no stream to hold open
            return web.Response(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        if self.sse_streams >= SSE_MAX_SUBSCRIBERS:
            raise ApiError(503, f"too many event streams open ({SSE_MAX_SUBSCRIBERS})")
        bus = self.sup.events
        queue = bus.subscribe()  # before the snapshot, so no event falls between replay and live
        self.sse_streams += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})  # fmt: skip
        closing = asyncio.ensure_future(self.closing.wait())
        getter: asyncio.Future[Any] | None = None
        try:
            recent = list(bus.recent)
            if after is not None:
                backlog = [e for e in recent if e.seq > after]
            else:
                backlog = recent[len(recent) - replay:] if replay else []
            last = recent[-1].seq if recent else 0  # up to here: replayed, or skipped on purpose
            await response.prepare(request)
            await response.write(b"".join(_sse(e) for e in backlog) + b": live\n\n")  # a comment: caught up
            while not self.closing.is_set():
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, closing}, timeout=SSE_KEEPALIVE_S,
                                             return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if getter not in done:
                    getter.cancel()
                    if not done:
                        await response.write(b": keepalive\n\n")
                    continue
                event = getter.result()
                if event.seq > last:
                    await response.write(_sse(event))
                    last = event.seq
        except ConnectionError:
            pass  # the client left
        finally:
            for fut in (getter, closing):
                if fut is not None:
                    fut.cancel()
            bus.unsubscribe(queue)
            self.sse_streams -= 1
        return response

    # ---- actions ---------------------------------------------------------------------------------------------
    async def component_action(self, request: web.Request) -> web.Response:
        action, name = request.match_info["action"], request.match_info["name"]
        who, drain = await self.component_command(request, action)
        self.component(name)
        try:
            message = self.sup.command(name, action, drain=drain, by=f"operator ({who})")
        except CoordinationUnavailable as exc:
            raise ApiError(503, str(exc)) from None
        except AgentError as exc:
            raise ApiError(409, str(exc)) from None
        return json_response({"accepted": True, "action": action, "component": name, "message": message}, 202)

    async def redeploy(self, request: web.Request) -> web.Response:
        who = self.mutation(request)
        data = await self.body(request, ("reason",))
        reason = data.get("reason", f"operator request ({who})")
        if not isinstance(reason, str) or len(reason) > 500:
            raise ApiError(400, "reason must be a string of at most 500 characters")
        started = self.sup.request_redeploy(reason, self.sup.blast(Blast.OPERATOR))
        return json_response({"accepted": True, "action": "redeploy", "component": None,
                              "already_in_progress": not started}, 202)  # fmt: skip

    async def reset(self, request: web.Request) -> web.Response:
        self.mutation(request)
        data = await self.body(request, ("component",))
        name = data.get("component")
        if name is not None:
            self.component(name)
        self.sup.reset(name)
        return json_response({"ok": True, "action": "reset", "component": name})

    async def pause(self, request: web.Request) -> web.Response:
        self.mutation(request)
        await self.body(request)
        self.sup.set_paused(True)
        return json_response({"ok": True, "action": "pause", "paused": True})

    async def resume(self, request: web.Request) -> web.Response:
        self.mutation(request)
        await self.body(request)
        self.sup.set_paused(False)
        return json_response({"ok": True, "action": "resume", "paused": False})

    async def detach(self, request: web.Request) -> web.Response:
        self.mutation(request)
        await self.body(request)
        # After this handler returns, so the answer is sent before the agent starts to wind down.
        asyncio.get_running_loop().call_soon(functools.partial(self.ctl.request_stop, detach=True))
        return json_response({"accepted": True, "action": "detach", "component": None}, 202)

    async def reload(self, request: web.Request) -> web.Response:
        self.mutation(request)
        await self.body(request)
        try:
            # Shielded: a client hanging up must not abandon a reload half-way.
            result = await asyncio.shield(self.ctl.reload())
        except ConfigError as exc:
            raise ApiError(400, f"config error, nothing changed:\n{exc}") from None
        return json_response({"ok": True, "action": "reload", **result})


def _sse(event: Any) -> bytes:
    return f"id: {event.seq}\ndata: {json.dumps(event.to_dict(), default=str)}\n\n".encode()


def _output_to_journal() -> bool:
    """Where the children's output goes (journald under systemd), so `nodeagentctl logs` reads the right place."""
    from nodeagent.core.logsink import use_journal

    return use_journal()


def build_app(api: Api) -> web.Application:
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY)
    for route in ROUTES:
        handler = getattr(api, route.name)
        if route.method == "GET":
            app.router.add_get(route.path, handler, name=route.name)  # and HEAD
        else:
            app.router.add_route(route.method, route.path, handler, name=route.name)

    async def on_startup(_app: web.Application) -> None:
        if api.cache_sampler is not None:
            api.cache_sampler.start()

    async def on_shutdown(_app: web.Application) -> None:
        api.closing.set()  # ends open event streams so shutdown does not wait for them

    async def on_cleanup(_app: web.Application) -> None:
        if api.cache_sampler is not None:
            await api.cache_sampler.close()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


class ApiServer:
    """The API on its TCP address and, optionally, its unix socket; started before the stack, closed last."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.runner: web.AppRunner | None = None
        self.socket_path: Path | None = None
        self.api: Api | None = None

    async def start(self) -> None:
        """Bind every address or raise AgentError naming the one that failed (nothing is left bound)."""
        cfg = self.ctl.config.agent.api
        token = ensure_token(cfg.token_file)
        self.api = Api(self.ctl, token)
        self.runner = web.AppRunner(build_app(self.api), handler_cancellation=True, shutdown_timeout=3.0,
                                    access_log=None)  # fmt: skip
        await self.runner.setup()
        try:
            try:
                await web.TCPSite(self.runner, cfg.host, cfg.port).start()
            except OSError as exc:
                raise AgentError(f"API: cannot listen on {cfg.listen}: {exc.strerror or exc}") from None
            if cfg.unix_socket is not None:
                await self._start_unix(cfg.unix_socket)
        except BaseException:
            await self.close()
            raise
        where = cfg.listen + (f" and {cfg.unix_socket}" if cfg.unix_socket else "")
        logger.info(f"API listening on {where}")

    async def _start_unix(self, path: Path) -> None:
        assert self.runner is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # a stale socket of a previous agent
        try:
            await web.UnixSite(self.runner, str(path)).start()
        except OSError as exc:
            raise AgentError(f"API: cannot listen on unix socket {path}: {exc.strerror or exc}") from None
        self.socket_path = path
        # Anyone local may read (as over loopback TCP); mutations are checked per peer uid or token.
        path.chmod(0o666)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                self.socket_path.unlink()
            self.socket_path = None

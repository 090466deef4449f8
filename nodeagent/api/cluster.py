"""The API's cluster actions (a mixin of `api.Api`): pause/resume, redeploy and group restarts for the whole
cluster, and a command for another node's agent — each carried through etcd by the cluster layer."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from nodeagent.api.base import ApiError, Handlers, drain_flag, json_response
from nodeagent.cluster.store import StoreError
from nodeagent.core.errors import AgentError, CoordinationUnavailable, UnknownComponentError

CLUSTER_ROUTES = (
    ("POST", "/cluster/pause", "cluster_pause"),
    ("POST", "/cluster/resume", "cluster_resume"),
    ("POST", "/cluster/redeploy", "cluster_redeploy"),
    ("POST", "/cluster/restart", "cluster_restart"),
    ("POST", "/cluster/nodes/{node}/components/{name}/{action}", "cluster_node_action"),
    ("POST", "/cluster/rollout", "cluster_rollout"),
    ("POST", "/cluster/rollout/{action}", "cluster_rollout_action"),
)
ROLLOUT_OPTIONS = ("file", "dry_run", "max_unavailable", "order", "canary", "bake_s", "allow_outage",
                   "drain_timeout_s", "gate_timeout_s", "bake_error_rate", "bake_ttft_factor")  # fmt: skip


class ClusterRoutes(Handlers):
    """Needs from the agent (`ctl`): `.coordinator`, None on a node without cluster.nodes."""

    def _coordinator(self) -> Any:
        coordinator = getattr(self.ctl, "coordinator", None)
        if coordinator is None:
            raise ApiError(404, "this node is not part of a cluster (its config has no cluster.nodes)")
        return coordinator

    async def _etcd(self, coro: Any) -> Any:
        try:
            return await coro
        except (StoreError, CoordinationUnavailable) as exc:
            raise ApiError(503, f"etcd unreachable, nothing changed: {exc}") from None

    async def cluster_pause(self, request: web.Request) -> web.Response:
        who = self.mutation(request)
        data = await self.body(request, ("reason",))
        co = self._coordinator()
        info = await self._etcd(co.set_pause(True, who, str(data.get("reason", ""))))
        return json_response({"ok": True, "action": "cluster_pause", "pause": info})

    async def cluster_resume(self, request: web.Request) -> web.Response:
        who = self.mutation(request)
        await self.body(request)
        await self._etcd(self._coordinator().set_pause(False, who))
        return json_response({"ok": True, "action": "cluster_resume"})

    async def cluster_redeploy(self, request: web.Request) -> web.Response:
        who = self.mutation(request)
        data = await self.body(request, ("reason",))
        reason = data.get("reason", f"operator request ({who})")
        if not isinstance(reason, str) or len(reason) > 500:
            raise ApiError(400, "reason must be a string of at most 500 characters")
        co = self._coordinator()
        answer = await self._etcd(co.ops.ask_redeploy(reason, f"{co.node}: {who}"))
        return json_response({"accepted": True, "action": "cluster_redeploy", "component": None, **answer}, 202)

    async def cluster_restart(self, request: web.Request) -> web.Response:
        """A new generation of vLLM groups: one (`group`), or every group running `component`'s kind."""
        who = self.mutation(request)
        data = await self.body(request, ("component", "group", "drain", "reason"))
        co = self._coordinator()
        component = data.get("component", "vllm")
        if component not in ("vllm",):
            raise ApiError(400, f"cluster restart restarts vLLM groups; got component {component!r}")
        groups = [g.name for g in co.layout.groups]
        wanted = [data["group"]] if data.get("group") is not None else groups
        unknown = [g for g in wanted if g not in groups]
        if unknown:
            raise ApiError(404, f"unknown group {unknown[0]!r} (groups: {', '.join(groups)})")
        drain = drain_flag(data)
        reason = data.get("reason")
        if reason is not None and (not isinstance(reason, str) or len(reason) > 200):
            raise ApiError(400, "reason must be a string of at most 200 characters")
        why = f"operator cluster restart ({co.node}: {who})" + (f": {reason}" if reason else "")
        answers = await self._etcd(co.ask_generations(wanted, why, drain))
        return json_response({"accepted": True, "action": "cluster_restart", "component": component,
                              "groups": answers}, 202)  # fmt: skip

    def _rollout(self) -> Any:
        self._coordinator()
        rollout = getattr(self.ctl, "rollout", None)
        if rollout is None:
            raise ApiError(404, "this agent runs no rollout executor")
        return rollout

    async def cluster_rollout(self, request: web.Request) -> web.Response:
        """Plan a rollout of this node's new file (`file`, default: the file it was started with) and store it
        unless `dry_run`; the plan either way."""
        from nodeagent.cluster.rollout.executor import RolloutRefused
        from nodeagent.cluster.rollout.plan import PlanError

        who = self.mutation(request)
        data = await self.body(request, ROLLOUT_OPTIONS)
        path, dry_run = data.pop("file", None), data.pop("dry_run", False)
        if (path is not None and not isinstance(path, str)) or not isinstance(dry_run, bool):
            raise ApiError(400, "file must be a path, dry_run true or false")
        try:
            plan = await self._etcd(self._rollout().plan(path, data, dry_run=dry_run, by=who))
        except PlanError as exc:
            raise ApiError(400, str(exc)) from None
        except RolloutRefused as exc:
            raise ApiError(409, str(exc)) from None
        return json_response(plan, 202 if plan.get("started") else 200)

    async def cluster_rollout_action(self, request: web.Request) -> web.Response:
        """pause | resume | abort | rollback the rollout in etcd."""
        from nodeagent.cluster.rollout.executor import RolloutRefused

        who = self.mutation(request)
        await self.body(request)
        action = request.match_info["action"]
        if action not in ("pause", "resume", "abort", "rollback"):
            raise ApiError(400, f"unknown rollout action {action!r} (pause, resume, abort, rollback)")
        try:
            view = await self._etcd(self._rollout().control(action, who))
        except RolloutRefused as exc:
            raise ApiError(409, str(exc)) from None
        return json_response({"ok": True, "action": f"rollout_{action}", **view})

    async def cluster_node_action(self, request: web.Request) -> web.Response:
        node, name, action = (request.match_info[k] for k in ("node", "name", "action"))
        who, drain = await self.component_command(request, action)
        co = self._coordinator()
        if node == co.node:
            try:
                message = co.port.command(name, action, drain=drain, by=f"operator ({who})")
            except UnknownComponentError as exc:
                raise ApiError(404, str(exc)) from None
            except AgentError as exc:
                raise ApiError(409, str(exc)) from None
            return json_response({"ok": True, "code": 0, "message": message, "node": node})
        try:
            result = await self._etcd(co.ops.remote(node, name, action, drain, who))
        except UnknownComponentError as exc:
            raise ApiError(404, str(exc)) from None
        return json_response({**result, "node": node}, 200 if result.get("ok") else 409)

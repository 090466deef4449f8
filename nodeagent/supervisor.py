"""Ties components together: dependency order, adoption after an agent restart, operator intent, probes,
restart policy, residue cleanup, node redeploys, and an orderly (or detached) shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from nodeagent import launcher, logsink, residue, residue_plan
from nodeagent.component import Component
from nodeagent.config_model import Config
from nodeagent.errors import LaunchError, UnknownComponentError
from nodeagent.events import EventBus
from nodeagent.graph import start_order
from nodeagent.policy import Intent, RedeployTracker, RestartTracker, hold_for_dependency, may_act, restarts_with
from nodeagent.prober import ComponentProber
from nodeagent.probes import ProbeContext, check_etcd, resolve_probe_set
from nodeagent.process import ProcessRecord
from nodeagent.render import component_dir, launch_fingerprint, render_component
from nodeagent.statefile import StateStore, write_json_atomic

BLOCKING_RESIDUE = (residue_plan.KillProcesses, residue_plan.WaitPortsFree, residue_plan.WaitDevicesFree)


class Supervisor:
    def __init__(self, config: Config, events: EventBus | None = None) -> None:
        self.config = config
        self.events = events or EventBus()
        self.store = StateStore(config.agent.state_dir)
        self.base_env = launcher.base_environment()
        self.intent_changed = asyncio.Event()
        self.on_state_change: list[Any] = []
        self.on_probe_result: list[Any] = []
        """Callbacks (component, role, ProbeResult) for metrics; called from probe tasks, keep them cheap."""
        active = config.active_components()
        self.order = start_order({n: list(c.depends_on) for n, c in active.items()})
        self.components = {name: Component(name, active[name], self) for name in self.order}
        self._intent = self.store.load_intent()
        saved = self._intent.get("trackers", {})
        self.trackers = {name: RestartTracker.from_dict(saved.get(name, {}), active[name].restart)
                         for name in self.order}  # fmt: skip
        self.redeploys = RedeployTracker.from_dict(self._intent.get("redeploys", {}))
        self.probe_ctx = ProbeContext()
        self._background: set[asyncio.Task[Any]] = set()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.redeploying: asyncio.Task[None] | None = None
        self.started_at = time.time()
        self.remote_etcd_ok = True

    # ---- intent (persisted; re-checked before every automatic action) --------------------------------------
    def desired(self, name: str) -> str:
        return self._intent.get("desired", {}).get(name, "running")

    @property
    def paused(self) -> bool:
        return bool(self._intent.get("paused", False))

    def _save_intent(self, durable: bool = True) -> None:
        """Operator intent must survive a power cut; restart counters alone need not (durable=False)."""
        self._intent["trackers"] = {n: t.to_dict() for n, t in self.trackers.items()}
        self._intent["redeploys"] = self.redeploys.to_dict()
        self.store.save_intent(self._intent, durable)
        self.intent_changed.set()
        self.intent_changed = asyncio.Event()

    def set_desired(self, name: str, desired: str) -> None:
        self._intent.setdefault("desired", {})[name] = desired
        self._save_intent()

    def set_paused(self, paused: bool) -> None:
        self._intent["paused"] = paused
        self._save_intent()
        self.events.emit("pause" if paused else "resume", "maintenance pause " + ("on" if paused else "off"))

    def intent(self, name: str) -> Intent:
        return Intent(desired=self.desired(name), paused=self.paused)  # type: ignore[arg-type]

    def deps(self, comp: Component) -> list[str]:
        return [d for d in comp.cfg.depends_on if d in self.components]

    def etcd_reachable(self) -> bool:
        """The node's etcd if it runs one (its startup/liveness probes decide), else the cluster's."""
        local = [c for c in self.components.values() if c.kind == "etcd"]
        return local[0].up.is_set() if local else self.remote_etcd_ok

    async def _watch_remote_etcd(self) -> None:
        """On worker nodes: is any cluster etcd endpoint healthy? Holds datasystem restarts while not."""
        while True:
            ok = False
            for endpoint in self.config.cluster.etcd_endpoints:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2):
                        ok, _ = await check_etcd(self.probe_ctx.session(), endpoint.removeprefix("http://"),
                                                 False, None)  # fmt: skip
                if ok:
                    break
            if ok != self.remote_etcd_ok:
                self.remote_etcd_ok = ok
                self.events.emit("etcd", "cluster etcd reachable again" if ok else "cluster etcd unreachable",
                                 None, "info" if ok else "error")  # fmt: skip
                self.intent_changed.set()
                self.intent_changed = asyncio.Event()
            await asyncio.sleep(2.0)

    def dependency_hold(self, comp: Component) -> str | None:
        return hold_for_dependency(comp.kind, self.etcd_reachable())

    def blocked(self, comp: Component) -> str | None:
        if self.desired(comp.name) != "running":
            return "desired state is stopped"
        hold = self.dependency_hold(comp)
        if hold:
            return hold
        if self.redeploying is not None and not self.redeploying.done():
            return "node redeploy in progress"
        waiting = [d for d in self.deps(comp) if not self.components[d].up.is_set()]
        if waiting:
            return "dependencies not up: " + ", ".join(waiting)
        return None

    # ---- hooks the component calls ------------------------------------------------------------------------
    def state_changed(self) -> None:
        """Persist status.json (readable when the API is not) and tell listeners (sd_notify STATUS=)."""
        with contextlib.suppress(OSError):
            write_json_atomic(self.config.agent.state_dir / "status.json", self.status(), durable=False)
        for callback in self.on_state_change:
            callback()

    async def before_start(self, comp: Component, scope: str = "start", reason: str | None = None) -> None:
        """Clean residue; a leftover that would not die or a port that stays busy fails the start, since a
        duplicate start must never happen (a second `dscli start` deletes the live worker's ready file)."""
        plan = residue_plan.plan_start_cleanup(comp.name, comp.cfg, self.config, scope=scope,  # type: ignore[arg-type]
                                          reason=reason)  # fmt: skip
        outcomes = await residue.execute(plan)
        blocking = [o for o in outcomes if not o.ok and isinstance(o.action, BLOCKING_RESIDUE)]
        if blocking:
            raise LaunchError("start blocked by residue: " + "; ".join(o.detail for o in blocking))
        failed = [o for o in outcomes if not o.ok and o not in blocking]
        for outcome in failed:
            self.events.emit("residue_failed", outcome.detail, comp.name, "warning")

    async def launch(self, comp: Component) -> launcher.Launched:
        spec = render_component(comp.name, self.config, self.base_env)
        comp.fingerprint = launch_fingerprint(spec)
        timeout = float(getattr(comp.cfg, "start_timeout_s", 60)) + 30.0
        scope = launcher.scope_unit(self.config.agent.systemd_scopes, self.config.cluster.name, comp.name)
        return await launcher.launch(spec, self.config.agent.log_dir, self.base_env,
                                     component_dir(self.config, comp.name), timeout, scope)  # fmt: skip

    def remember(self, comp: Component) -> None:
        self._save_children()

    def forget(self, comp: Component) -> None:
        comp.gen += 1
        self._save_children(durable=False)  # a stale record is harmless: adoption verifies pid + create_time

    def _save_children(self, detached: bool = False, durable: bool = True) -> None:
        children = {
            name: {**c.record.to_dict(), "started_at": c.started_at, "fingerprint": c.fingerprint}
            for name, c in self.components.items() if c.record is not None
        }  # fmt: skip
        self.store.save_children(children, detached=detached, durable=durable)

    def start_probes(self, comp: Component) -> None:
        probes = resolve_probe_set(comp.cfg, self.config)
        gen = comp.gen

        def on_change(role: str, status: str, result: Any) -> None:
            detail = getattr(result, "detail", "") if result is not None else ""
            if role == "startup":
                comp.signal("startup_ok" if status == "success" else "startup_failed", gen, detail)
            elif role == "liveness" and status == "failure":
                comp.signal("liveness_failed", gen, detail)
            elif role == "liveness" and status == "success":
                self.policy_healthy(comp)
            elif role == "readiness" and status in ("success", "failure"):
                comp.signal("ready" if status == "success" else "not_ready", gen, detail)

        def on_result(role: str, probe: Any, result: Any) -> None:
            for callback in self.on_probe_result:
                callback(comp.name, role, result)

        comp.prober = ComponentProber(comp.name, probes, self.probe_ctx, on_change, on_result)
        comp.prober.start(comp.started_at or time.time())

    def _keep(self, task: asyncio.Task[Any] | asyncio.Future[Any]) -> None:
        self._background.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._background.discard)

    def stop_probes(self, comp: Component) -> None:
        if comp.prober is not None:
            self._keep(asyncio.ensure_future(comp.prober.stop()))

    def dependency_going_down(self, comp: Component) -> None:
        for other in self.components.values():
            edge = other.cfg.depends_on.get(comp.name)
            if edge is None or other.record is None:
                continue
            if restarts_with(other.kind, comp.kind, edge):
                other.signal("dep_restart", None, f"dependency {comp.name} restarts")

    # ---- policy ---------------------------------------------------------------------------------------------
    def policy_started(self, comp: Component) -> None:
        now = time.time()
        self.trackers[comp.name].record_start(now)
        if not comp.cfg.probes.liveness:
            self.trackers[comp.name].record_healthy(now)

    def policy_healthy(self, comp: Component) -> None:
        """A passing liveness check; once every component ran stably the node's failed state clears."""
        now = time.time()
        cleared = self.trackers[comp.name].record_healthy(now)
        if self.redeploys.failed and all(t.is_stable(now) for t in self.trackers.values()):
            self.redeploys.record_stable()
            self.events.emit("recovered", "every component ran stably: node failed state cleared")
            cleared = True
        if cleared:
            self._save_intent()

    async def archive_failure(self, comp: Component, detail: str) -> None:
        reason = detail.split(":", 1)[0].split("(", 1)[0].strip().replace(" ", "-") or "failure"
        await residue.execute(residue_plan.plan_failure_evidence(comp.name, comp.cfg, self.config, reason))

    def policy_failure(self, comp: Component, detail: str) -> Any:
        hold = self.dependency_hold(comp)
        if hold:
            self.events.emit("held", f"{detail}; {hold}", comp.name, "error")
            return None
        ok, why = may_act(self.intent(comp.name), "restart")
        if not ok:
            self.events.emit("no_action", f"not restarting: {why}", comp.name, "warning")
            return None
        now = time.time()
        decision = self.trackers[comp.name].record_failure(now, detail, node_failed=self.redeploys.failed)
        decision = self.redeploys.escalate(decision, now, comp.cfg.restart)
        self._save_intent(durable=decision.action != "restart")
        level = "critical" if decision.action == "failed" else "warning"
        self.events.emit("failure", f"{detail}; next: {decision.action} in {decision.delay_s:.0f}s",
                         comp.name, level, action=decision.action, delay_s=decision.delay_s,
                         consecutive_failures=decision.consecutive_failures)  # fmt: skip
        return decision

    def policy_view(self, comp: Component) -> dict[str, Any]:
        return self.trackers[comp.name].status(time.time())

    def reset(self, name: str | None = None) -> None:
        for n in [name] if name else list(self.trackers):
            self.trackers[n].reset()
        if name is None:
            self.redeploys.reset()
        self._save_intent()
        self.events.emit("reset", f"restart counters reset ({name or 'all components'})", name)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _adoptable(self) -> dict[str, ProcessRecord]:
        saved = self.store.load_children()
        return {name: ProcessRecord.from_dict(rec) for name, rec in saved.items() if name in self.components}

    async def _rotate_logs(self, every_s: float = 30.0) -> None:
        """copytruncate each component's log file past log_max_bytes (journald rotates its own)."""
        agent = self.config.agent
        while True:
            for name in self.components:
                path = logsink.log_path(agent.log_dir, name)
                try:
                    if await asyncio.to_thread(logsink.rotate_if_large, path, agent.log_max_bytes, agent.log_keep):
                        self.events.emit("log_rotated", f"rotated {path}", name)
                except OSError as exc:
                    self.events.emit("log_rotate_failed", f"cannot rotate {path}: {exc}", name, "warning")
            await asyncio.sleep(every_s)

    async def start(self) -> None:
        if not logsink.use_journal():
            self._keep(asyncio.create_task(self._rotate_logs(), name="log-rotation"))
        kinds = {c.kind for c in self.components.values()}
        if "datasystem" in kinds and "etcd" not in kinds:
            self._keep(asyncio.create_task(self._watch_remote_etcd(), name="etcd-watch"))
        adopt = self._adoptable()
        for name in self.order:
            comp = self.components[name]
            if name in adopt:
                comp.fingerprint = self.store.load_children().get(name, {}).get("fingerprint")
            self.tasks[name] = asyncio.create_task(comp.run(adopt.get(name)), name=f"component:{name}")

    def get(self, name: str) -> Component:
        try:
            return self.components[name]
        except KeyError:
            known = ", ".join(self.components)
            raise UnknownComponentError(f"unknown component {name!r} (this node runs: {known})") from None

    def command(self, name: str, action: str) -> None:
        comp = self.get(name)
        if action == "stop":
            self.set_desired(name, "stopped")
            comp.signal("stop")
        elif action == "start":
            self.set_desired(name, "running")
            comp.signal("wake")
        elif action == "restart":
            self.set_desired(name, "running")
            comp.signal("restart", None, "operator restart")
        self.events.emit("command", f"operator: {action}", name)

    def request_redeploy(self, reason: str) -> bool:
        if self.redeploying is not None and not self.redeploying.done():
            return False
        self.redeploying = asyncio.create_task(self._redeploy(reason), name="redeploy")
        return True

    async def _redeploy(self, reason: str) -> None:
        """The guide's recovery: stop all in reverse order, clean all residue, start all in order."""
        self.events.emit("redeploy", f"node redeploy: {reason}", None, "warning")
        await self._cancel_tasks()
        await self._stop_all_processes(f"node redeploy: {reason}")
        for name in self.order:
            comp = self.components[name]
            ok, why = may_act(self.intent(name), "redeploy")
            if not ok:
                self.events.emit("no_action", f"redeploy leaves it alone: {why}", name)
                continue
            await self.before_start(comp, scope="redeploy", reason=reason)
            self.trackers[name].record_redeploy(time.time())
        self._save_intent()
        self.redeploying = None
        for name in self.order:
            self.tasks[name] = asyncio.create_task(self.components[name].run(None), name=f"component:{name}")
        self.events.emit("redeploy_done", "node redeploy: residue cleaned, starting in order")

    async def _cancel_tasks(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        for task in self.tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()

    async def _stop_all_processes(self, why: str) -> None:
        for name in reversed(self.order):
            await self.components[name].stop_process(why)

    async def shutdown(self, detach: bool = False) -> None:
        """Stop everything in reverse order — or, detached, leave the stack running for the next agent."""
        if self.redeploying is not None:
            self.redeploying.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.redeploying
        await self._cancel_tasks()
        for task in list(self._background):
            task.cancel()
        if detach:
            for comp in self.components.values():
                self.stop_probes(comp)
                if comp.watch is not None:
                    comp.watch.close()
            self._save_children(detached=True)
            self.events.emit("detached", "agent exits leaving the stack running for adoption")
        else:
            await self._stop_all_processes("agent stopping")
        await self.probe_ctx.close()

    def reload(self, config: Config) -> dict[str, list[str]]:
        """Take a new config; restart only components whose rendered argv, env, cwd or files changed.

        Added or removed components need an agent restart (their tasks and ordering are fixed at start)."""
        old_names, new_names = set(self.components), set(config.active_components())
        if old_names != new_names:
            raise ValueError(
                f"reload cannot add or remove components ({', '.join(sorted(old_names ^ new_names))}): "
                "restart the agent (nodeagentctl detach + systemctl restart keeps the stack running)"
            )
        self.config = config
        changed, unchanged = [], []
        for name, comp in self.components.items():
            comp.cfg = config.components[name]
            self.trackers[name].spec = comp.cfg.restart
            fingerprint = launch_fingerprint(render_component(name, config, self.base_env))
            if comp.fingerprint is not None and fingerprint != comp.fingerprint and comp.record is not None:
                changed.append(name)
                comp.signal("restart", None, "config reload changed its command or environment")
            else:
                unchanged.append(name)
        self.events.emit("reload", f"config reloaded; restarting: {', '.join(changed) or 'nothing'}")
        return {"restarted": changed, "unchanged": unchanged}

    def status(self) -> dict[str, Any]:
        return {
            "node": {"name": self.config.node.name, "ip": self.config.node.ip, "role": self.config.node.role,
                     "cluster": self.config.cluster.name},
            "paused": self.paused,
            "redeploying": self.redeploying is not None and not self.redeploying.done(),
            "node_policy": {"failed": self.redeploys.failed, "failed_reason": self.redeploys.failed_reason,
                            "redeploys_total": self.redeploys.redeploys_total},
            "components": {name: comp.status() for name, comp in self.components.items()},
        }  # fmt: skip

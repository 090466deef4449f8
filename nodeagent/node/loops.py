"""The supervisor's loops, owned (a mixin of `supervisor.Supervisor`, as `nodeport.NodePort` is): each component's
task started with an owner that logs and shows its end, the node redeploy that supervises every component again
whatever fails half-way, and the heartbeats the agent's watchdog ping requires (`heartbeat`).

Why: a loop that dies silently leaves a component `starting` forever with commands queued to no reader, and a
redeploy that raises between cancelling the loops and making them again leaves nothing supervised (issue 29).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.core.errors import LaunchError
from nodeagent.core.heartbeat import HOST_MARGIN_S, PREPARE_BOUND_S, Heartbeat
from nodeagent.core.task_owner import guarded, log_death
from nodeagent.seam.host import StartHeld
from nodeagent.seam.stackport import STOPS_AUTOMATIC

if TYPE_CHECKING:
    from nodeagent.core.events import EventBus
    from nodeagent.core.process import ProcessRecord
    from nodeagent.node.component import Component
    from nodeagent.seam.host import Clock
    from nodeagent.seam.stackport import Hold


class NodeLoops:
    """The component loops and the redeploy of `Supervisor` (its state, seen from its loops)."""

    if TYPE_CHECKING:  # the supervisor's own, used here
        events: EventBus
        clock: Clock
        components: dict[str, Component]
        order: list[str]
        tasks: dict[str, asyncio.Task[None]]
        redeploying: asyncio.Task[None] | None
        redeploy_beat: Heartbeat
        redeploy_scope: tuple[str, ...]
        _next_redeploy: tuple[str, tuple[str, ...]] | None

        @property
        def trackers(self) -> dict[str, Any]: ...
        def node_hold(self, comp: Component, operator: bool = False) -> Hold | None: ...
        async def cleanup(self, comp: Component, scope: str = "start", reason: str | None = None,
                          wipe_etcd: bool = False) -> None: ...  # fmt: skip
        async def _stop_all_processes(self, why: str, names: Sequence[str] | None = None) -> None: ...
        def _save_intent(self, durable: bool = True) -> None: ...

    def _start_loop(self, name: str, adopt: ProcessRecord | None) -> None:
        """A component's loop, owned: its end (only a bug or a cancel can end it) is logged and shown."""
        comp = self.components[name]
        comp.tick()  # fresh from the first moment: the watchdog may read it before the task first runs
        task = asyncio.create_task(comp.run(adopt), name=f"component:{name}")
        task.add_done_callback(functools.partial(self._loop_ended, name))
        self.tasks[name] = task

    def _loop_ended(self, name: str, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        why = f"{type(exc).__name__}: {exc}" if exc is not None else "it returned"
        logger.opt(exception=exc).critical(f"{name}: its supervision loop ended ({why})")
        guarded("an event", self.events.emit, "supervision_lost", f"supervision loop ended ({why}): not supervised "
                "any more; the watchdog ping stops, systemd restarts the agent", name, "critical")  # fmt: skip

    def heartbeats(self) -> dict[str, Heartbeat]:
        """Every loop that must be alive now (`heartbeat.watchdog_ok`): each component's, and a redeploy's while
        it runs (the component loops are cancelled then). A loop that ended by itself stays in: it ages."""
        beats = {f"component:{n}": self.components[n].heartbeat for n in self.tasks}
        if self.redeploying is not None and not self.redeploying.done():
            beats["redeploy"] = self.redeploy_beat
        return beats

    def request_redeploy(self, reason: str, components: Sequence[str] | None = None) -> bool:
        """A node redeploy of `components` (None: the whole node), each caller's by `blast_radius`; one asked while
        another runs follows it (False) unless that one touches all of it."""
        queued = self._next_redeploy[1] if self._next_redeploy else ()
        scope = tuple(n for n in self.order if components is None or n in components or n in queued)
        if self.redeploying is not None and not self.redeploying.done():
            self._next_redeploy = None if set(scope) <= set(self.redeploy_scope) else (reason, scope)
            return False
        self.redeploy_scope, self._next_redeploy = scope, None
        self.redeploy_beat.tick(self.clock.monotonic())
        self.redeploying = asyncio.create_task(self._redeploy(reason, scope), name="redeploy")
        self.redeploying.add_done_callback(log_death)
        return True

    async def _redeploy(self, reason: str, scope: tuple[str, ...] | None = None) -> None:
        """The guide's recovery within its blast radius: stop in reverse order, clean the residue, start in order.
        Whatever fails half-way (a bug, an OSError) is logged and shown, and every component is supervised again
        all the same."""
        scope = tuple(self.order) if scope is None else scope
        self.events.emit("redeploy", f"node redeploy: {reason} (of {', '.join(scope) or 'nothing'})", None, "warning",
                         components=list(scope))  # fmt: skip
        done = cancelled = False
        try:
            await self._redeploy_steps(reason, scope)
            done = True
        except asyncio.CancelledError:
            cancelled = True  # the agent stops: its shutdown takes over
            raise
        except Exception as exc:
            logger.opt(exception=exc).error(f"node redeploy: internal error: {type(exc).__name__}: {exc}")
            guarded("an event", self.events.emit, "redeploy_failed", f"node redeploy: internal error: "
                    f"{type(exc).__name__}: {exc}; supervising every component again", None, "error")  # fmt: skip
        finally:
            self.redeploying = None
            if not cancelled:
                for name in self.order:
                    if name not in self.tasks or self.tasks[name].done():
                        self._start_loop(name, None)
        if done:
            self.events.emit("redeploy_done", "node redeploy: residue cleaned, starting in order")
        if not cancelled and self._next_redeploy is not None:
            self.request_redeploy(*self._next_redeploy)

    async def _redeploy_steps(self, reason: str, scope: tuple[str, ...]) -> None:
        await self._cancel_tasks(scope)
        # what was still running restarts for the redeploy (what had died is counted already, by its own cause)
        running = {name for name in scope if self.components[name].proc is not None}
        graces = sum(float(getattr(self.components[n].cfg, "stop_grace_s", 0) or 0) + 30 for n in scope)
        self.redeploy_beat.busy(self.clock.monotonic(), graces + HOST_MARGIN_S, "stopping what it touches")
        await self._stop_all_processes(f"node redeploy: {reason}", scope)
        for name in scope:
            comp = self.components[name]
            hold = self.node_hold(comp, False)
            if hold is not None and hold.kind in STOPS_AUTOMATIC:
                self.events.emit("no_action", f"redeploy leaves it alone: {hold}", name)
                continue
            slate = float(getattr(comp.cfg, "clean_slate_timeout_s", 0) or 0)
            self.redeploy_beat.busy(self.clock.monotonic(), PREPARE_BOUND_S + slate + HOST_MARGIN_S, f"cleaning {name}")
            with contextlib.suppress(StartHeld, LaunchError):
                await self.cleanup(comp, scope="redeploy", reason=reason)
            self.trackers[name].record_redeploy(self.clock.time())
            if name in running:
                comp.count_restart("redeploy")
        self.redeploy_beat.tick(self.clock.monotonic())
        self._save_intent()

    async def _cancel_tasks(self, names: Sequence[str] | None = None) -> None:
        tasks = {n: self.tasks.pop(n) for n in list(self.tasks) if names is None or n in names}
        for task in tasks.values():
            task.cancel()
        for name, task in tasks.items():
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # already logged by its done-callback; said again where it was awaited
                logger.exception(f"{name}: its supervision loop had failed")


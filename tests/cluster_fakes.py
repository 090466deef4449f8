"""The cluster layer without processes: a virtual clock, a fake node stack behind the `StackPort`, a fake PD proxy,
and a world of several agents (Membership + Coordinator with its ClusterOps and ProxySync) on ONE FakeStore.

- `VirtualClock`: time moves only when the test says so (`advance`, `until`), and then from one sleeper's deadline
  to the next, letting the event loop run everything that is ready in between, and the work it handed to threads
  (`asyncio.to_thread`: a post-mortem's tar, a /proc scan) to its end. Nothing else waits for real.
- `FakeStack`: the node as the cluster layer sees it. Components start through the same ordered gates as the
  supervisor's (desired stop, pause, etcd for the worker, dependencies, then the layers'), are up `start_s` later,
  and a restart stops the old tree first — `running` stays True for `stop_s` (a slow-to-die tree) — then starts
  again through the gates. `crash()` is a process dying; as the supervisor does (`component_failure`), the
  failure is decided at once, while the agent stops what is left of its tree (`stop_s` again: an orphaned engine).
- `World`: agents over their config files (`tests/cluster_harness.py` writes them), their stacks, the store and
  the proxy; `kill_agent` / `start_agent` are an agent's death and its successor over the same state folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster_harness import ClusterHarness
from fakestore import FakeStore
from ft_fakes import FakeFtApi

from nodeagent.cluster.coordinator import Coordinator
from nodeagent.cluster.membership import Membership
from nodeagent.cluster.proxy_evict import ProxyEvict
from nodeagent.config.load import load_config
from nodeagent.config.model import Config
from nodeagent.core.errors import UnknownComponentError
from nodeagent.core.events import EventBus
from nodeagent.core.failure import Failure
from nodeagent.core.loadtime import load_status, remember
from nodeagent.node.component import HOLD_RECHECK_S
from nodeagent.seam.host import Clock, StartHeld
from nodeagent.seam.stackport import (
    STOPS_AUTOMATIC,
    ComponentView,
    Delegated,
    Hold,
    HoldKind,
    MemberReport,
    NodeLayer,
    NodeView,
    ProxyBackends,
    ProxyRouting,
    first_hold,
)

# ---- time -------------------------------------------------------------------------------------------------------


THREAD_WORK_S = 60.0
"""How long (real time) work handed to a thread may take before the world says it hangs."""


class ThreadWork(ThreadPoolExecutor):
    """The event loop's default executor, knowing which of its work is under way. A piece of work leaves `running`
    only after the future the loop awaits is resolved (its wake-up is then already queued on the loop): no instant
    where the loop looks idle but a result is still on its way."""

    def __init__(self) -> None:
        super().__init__(thread_name_prefix="world")
        self.running: set[Future[Any]] = set()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        outer: Future[Any] = Future()
        inner = super().submit(fn, *args, **kwargs)
        self.running.add(inner)

        def done(_: Future[Any]) -> None:
            try:
                if outer.cancelled():
                    return
                if inner.cancelled():
                    outer.cancel()
                elif (exc := inner.exception()) is not None:
                    outer.set_exception(exc)
                else:
                    outer.set_result(inner.result())
            finally:
                self.running.discard(inner)

        inner.add_done_callback(done)
        return outer

    async def finished(self, within: float) -> None:
        waits = [asyncio.wrap_future(f) for f in list(self.running)]
        if not waits:  # ended in its thread since the caller looked
            return
        _, pending = await asyncio.wait(waits, timeout=within)
        for w in waits:
            if w.done() and not w.cancelled():
                w.exception()  # retrieved: the work's own caller reports it
        if pending:
            raise AssertionError(f"work handed to a thread did not end within {within:g}s of real time")


class InlineWork(ThreadWork):
    """A simulation's default executor: work handed to a thread (a log rotation, a post-mortem's files, a rollout's
    staged file) runs at once, in the order it was handed over (`VirtualClock.inline_threads`). In real threads two
    nodes' launches at one virtual instant came back in the order the threads happened to end, and a seed did not
    replay its run (760001, real node; 11 with rollouts)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            done.set_exception(exc)
        return done


class VirtualClock(Clock):
    """Wall and monotonic time that move together, only in `advance`/`until`; sleepers wake at their deadline."""

    def __init__(self, wall: float = 1_800_000_000.0) -> None:
        self.wall = wall
        self.mono = 10_000.0
        self._wall0, self._mono0 = wall, self.mono
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self.on_tick: list[Callable[[float], None]] = []
        """Called with the seconds that just passed (the store's leases follow)."""
        self._executor: ThreadWork | None = None
        self._executor_loop: asyncio.AbstractEventLoop | None = None
        self.inline_threads = getattr(self, "inline_threads", False)
        """Run work handed to a thread at once (`InlineWork`): a simulation that must replay event for event."""

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def _timer(self, seconds: float) -> asyncio.Future[Any]:
        """A future the clock resolves `seconds` from now (unless something resolves or cancels it first)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.mono + seconds, next(self._seq), future))
        return future

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        await self._timer(seconds)

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """One future, woken by whichever comes first: the event (as one of its own waiters) or the deadline (a
        timer like a sleeper's). Two tasks and an `asyncio.wait` per call were ~a tenth of a simulation's CPU:
        every agent loop waits on its wake event or its tick."""
        if event.is_set():
            return True
        if timeout <= 0:
            await asyncio.sleep(0)
            return event.is_set()
        future = self._timer(timeout)
        waiters = event._waiters  # type: ignore[attr-defined]  # Event.set() resolves each pending one
        waiters.append(future)
        try:
            await future
        finally:
            with contextlib.suppress(ValueError):
                waiters.remove(future)
        return event.is_set()

    async def settle(self) -> None:
        """Let the event loop run until nothing is ready any more (every task waits for a timer or an event) and no
        work handed to a thread is under way: that work takes real time, and time must not move past it (a
        post-mortem written by a thread would otherwise come "late" by any number of virtual seconds)."""
        loop = asyncio.get_running_loop()
        threads = self._threads(loop)
        ready = getattr(loop, "_ready", None)
        scheduled: list[Any] | None = getattr(loop, "_scheduled", None)
        quiet = 0
        for _ in range(100_000):
            await asyncio.sleep(0)
            if threads.running:
                await threads.finished(THREAD_WORK_S)
                quiet = 0
                continue
            # nothing ready and no loop timer due (the loop's next turn would run this task alone): one such turn
            # is enough — three were asked before, each a turn of the whole loop (a tenth of a schedule's CPU)
            idle = ready is not None and not ready and not (scheduled and scheduled[0].when() <= loop.time())
            quiet = quiet + 1 if idle else 0
            if quiet >= 1 or (ready is None and _ >= 200):
                return
        raise AssertionError("the event loop never settles: something spins without waiting")

    def _threads(self, loop: asyncio.AbstractEventLoop) -> ThreadWork:
        """This loop's default executor, one that counts its work (installed on first use)."""
        if self._executor is None or self._executor_loop is not loop:
            self._executor, self._executor_loop = (InlineWork() if self.inline_threads else ThreadWork()), loop
            loop.set_default_executor(self._executor)
        return self._executor

    def _move(self, to: float) -> None:
        if to > self.mono:
            delta = to - self.mono
            # from the start, not summed step by step: a sum's rounding depends on the steps taken, and a bake that
            # ends `now - since >= 5` ended a tick later in one run of a seed than in another
            self.mono, self.wall = to, self._wall0 + (to - self._mono0)
            for tick in self.on_tick:
                tick(delta)

    def _next_deadline(self) -> float | None:
        while self._timers and self._timers[0][2].done():
            heapq.heappop(self._timers)  # cancelled sleepers
        return self._timers[0][0] if self._timers else None

    async def _step_to(self, limit: float) -> bool:
        """Wake the sleepers due by `limit`, earliest first; False when none was due."""
        await self.settle()
        due = self._next_deadline()
        if due is None or due > limit:
            return False
        self._move(due)
        while self._timers and self._timers[0][0] <= self.mono:
            _, _, future = heapq.heappop(self._timers)
            if not future.done():
                future.set_result(None)
        await self.settle()
        return True

    async def advance(self, seconds: float) -> None:
        target = self.mono + seconds
        while await self._step_to(target):
            pass
        self._move(target)
        await self.settle()

    async def until(self, what: str, check: Callable[[], Any], within: float = 600.0) -> Any:
        """Run the world until `check()` is true (its value), at most `within` seconds of virtual time."""
        limit = self.mono + within
        while True:
            await self.settle()
            result = check()
            if result:
                return result
            if not await self._step_to(limit):
                self._move(limit)
                await self.settle()
                result = check()
                if result:
                    return result
                raise AssertionError(f"not within {within:g}s of virtual time: {what}")


# ---- the node stack ------------------------------------------------------------------------------------------------

_PIDS = itertools.count(50_000)


@dataclass
class FakeComponent:
    name: str
    kind: str
    deps: tuple[str, ...]
    restart_spec: Any
    start_s: float = 1.0
    """From start to up (startup probes passed)."""
    stop_s: float = 0.5
    """From a stop to the whole tree gone: `running` stays True meanwhile."""
    desired: str = "running"
    running: bool = False
    up: bool = False
    pid: int | None = None
    state: str = "stopped"
    hold: Hold | None = None
    stopping: bool = False
    crashed: bool = False
    """The tree being stopped is what is left of a crash (it was not seen to die whole)."""
    operator_start: bool = False
    blocks: dict[str, str] = field(default_factory=dict)
    ft_unsupported: str | None = None
    """What its launch said of vLLM's fault tolerance (`ComponentView.ft_unsupported`)."""
    starts: list[float] = field(default_factory=list)
    """The virtual monotonic time of each start."""
    stops: list[float] = field(default_factory=list)
    """The virtual monotonic time each stop of its tree began (a restart, a stop, what a crash left)."""
    gone: list[float] = field(default_factory=list)
    """The virtual monotonic time each run's whole tree was gone (stopped or crashed)."""
    clean: bool = False
    """As the supervisor's `stopped_cleanly`: the last tree was stopped whole by an agent, or cleaned since."""
    cleaned_at: list[float] = field(default_factory=list)
    """The virtual monotonic time of each residue cleanup."""
    unclean: str | None = None
    """Why cleaning its residue fails (a port held by a process not ours), while it does."""
    held_cleanups: list[float] = field(default_factory=list)
    """The virtual monotonic time of each cleanup that `unclean` held (on a node, each one waits 3 s for the port
    and logs a line per action)."""
    loads: list[float] = field(default_factory=list)
    """Its load times (start → up), as the supervisor keeps them in intent.json: they outlive the agent."""
    dying: bool = False
    """Its process died and the supervisor is stopping what is left of its tree before it decides (`crash_later`):
    a restart asked meanwhile starts no second stop."""

    @property
    def ready(self) -> bool:
        return self.up and not self.blocks


class FakeStack:
    """`stackport.StackPort` and membership's `MemberHost` for one node, over fake components."""

    def __init__(self, config: Config, clock: VirtualClock, etcd_reachable: Callable[[], bool]) -> None:
        self.config = config
        self.node = config.node.name
        self.clock = clock
        self.etcd_reachable = etcd_reachable
        self.events = EventBus(replay=500)
        self.base_env: dict[str, str] = {}
        self.components: dict[str, FakeComponent] = {}
        active = config.active_components()
        for name, cfg in active.items():
            deps = tuple(d for d in cfg.depends_on if d in active)
            self.components[name] = FakeComponent(name, cfg.kind, deps, cfg.restart,
                                                  start_s={"vllm": 2.0}.get(cfg.kind, 1.0))  # fmt: skip
        self.layers: list[NodeLayer] = []
        self.listeners: list[Callable[[], None]] = []
        """Told of every change (the agent's membership publishes its record)."""
        self.routing: dict[str, ProxyRouting] = {}
        self.proxy_process: FakeProxy | None = None
        """The PD proxy this stack's proxy component is: a launch of it is a new proxy process (its lists are what
        the launch was given, the config's whole command line without a cluster layer's answer)."""
        self.proxy_launches: list[ProxyBackends | None] = []
        self.node_pause: dict[str, Any] | None = None
        self._cluster_pause: dict[str, Any] | None = None
        self.restarts: list[tuple[str, str, bool]] = []
        """Every restart the cluster layer asked: (component, reason, planned)."""
        self.crashes: list[tuple[str, float]] = []
        """(component, virtual monotonic time) of each crash an agent saw."""
        self.cleaned: list[tuple[str, str, bool]] = []
        self.commands: list[tuple[str, str, str]] = []
        self.postmortems: list[dict[str, Any]] = []
        self.liveness_holds: dict[str, tuple[str, float]] = {}
        self.liveness_hold_log: list[tuple[str, str | None]] = []
        """Post-mortems the cluster layer asked for (a component that did not fail by itself)."""
        self.on_wipe_etcd: Callable[[], None] | None = None
        self.adoptable: frozenset[str] = frozenset()
        self.recovery_view: Callable[[], Mapping[str, Any] | None] = lambda: None
        """The node's ladder (`nodeagent.layers.chip_reset.NodeRecovery` gives it: `show_recovery`)."""
        self.agent_alive = True
        """False between an agent's death and its successor: nothing starts a process then."""
        self._poked = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._starting: dict[asyncio.Future[None], None] = {}  # in the order begun (a set: by address)
        self.launched: dict[str, list[str]] = {n: [] for n in self.components}
        """The file hash each start of a component was launched with (the config in memory then)."""
        self.inflight: dict[str, tuple[int, int]] = {}
        """Requests running and waiting on a vLLM, as its /metrics would say (default: none)."""
        self.canary_answers: dict[str, str] = {}
        self.metrics_text: dict[str, str] = {}
        self.container_image: str | None = config.container.image if config.container is not None else None
        """What the node's container runs (rollout tests: a step that changes it recreates it)."""
        self.recreated: list[tuple[float, str | None]] = []
        self.images: dict[str, list[str | None]] = {n: [] for n in self.components}
        """component → the container image it was launched in, launch by launch."""
        """endpoint → what its /metrics answers (the rollout's bake reads it); none: an empty page."""
        """endpoint → why the canary fails there (absent: it answers)."""

    # ---- the test's controls -----------------------------------------------------------------------------------
    def start(self) -> None:
        """The stack's processes begin (once: they outlive an agent that dies)."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._life(c), name=f"{self.node}:{c.name}")
                           for c in self.components.values()]  # fmt: skip

    async def close(self) -> None:
        tasks = [*self._tasks, *self._starting]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def crash(self, name: str, detail: str = "killed by SIGKILL") -> str | None:
        """The process of `name` dies; what the node decides (the layer's message when it took it). With an agent,
        the decision is taken at once and the rest of the tree takes `stop_s` to be stopped (`stopping`, still
        `running`); without one, the tree is gone at once and nobody decides anything."""
        comp = self.components[name]
        assert comp.running, f"{self.node}/{name} is not running"
        failure = Failure("exit", detail, code=-9, was_up=True)
        if not self.agent_alive:
            self._gone(comp, "failed")
            self.notify()
            return None
        comp.up, comp.state, comp.stopping, comp.crashed = False, "stopping", True, True
        self.crashes.append((name, self.clock.monotonic()))
        verdict = self.decide(comp, failure)
        self.notify()
        return verdict

    async def crash_later(self, name: str, stop_s: float, detail: str = "killed by SIGKILL") -> str | None:
        """The process of `name` dies now, but — as the supervisor does — the failure is decided only once the
        rest of its tree is stopped, `stop_s` later (a killed API server's orphaned EngineCore and Worker)."""
        comp = self.components[name]
        assert comp.running, f"{self.node}/{name} is not running"
        comp.up, comp.state, comp.dying = False, "stopping", True
        self.notify()
        await self.clock.sleep(stop_s)
        comp.dying = comp.stopping = False
        return self.crash(name, detail)

    def detach(self) -> None:
        """The agent died: nobody decides for this stack until the next agent attaches."""
        self.layers.clear()
        self.listeners.clear()
        self.routing.clear()
        self.agent_alive = False
        self.adoptable = frozenset(n for n, c in self.components.items() if c.running)

    def endpoints(self) -> set[str]:
        """host:port of every vLLM API server of this node (remembered for the config it has: a rollout's canary
        and bake look their endpoints' owner up every second, and a layout is costly to render)."""
        from nodeagent.config.layout import cluster_layout

        seen = getattr(self, "_endpoints", None)
        if seen is not None and seen[0] is self.config:
            return set(seen[1])
        layout = cluster_layout(self.config)
        found = {p.endpoint for g in layout.groups for p in g.processes if p.node == self.node and p.endpoint}
        self._endpoints = (self.config, frozenset(found))
        return found

    def started(self, name: str) -> int:
        return len(self.components[name].starts)

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.events.recent if e.event == kind]

    # ---- what the supervisor does --------------------------------------------------------------------------------
    def node_hold(self, comp: FakeComponent, operator: bool) -> Hold | None:
        if comp.desired != "running":
            return Hold(HoldKind.DESIRED_STOPPED, "desired state is stopped", resolves_itself=False)
        pause = self.pause_info()
        if pause is not None and not operator:
            cluster = pause["scope"] == "cluster"
            return Hold(HoldKind.CLUSTER_PAUSE if cluster else HoldKind.NODE_PAUSE, f"paused by {pause.get('by')}",
                        operator_passes=True, resolves_itself=False)  # fmt: skip
        if comp.kind == "datasystem" and comp.starts and not self.etcd_reachable():
            return Hold(HoldKind.ETCD_UNREACHABLE, "holding the datasystem worker restart until etcd is back")
        waiting = [d for d in comp.deps if not self.components[d].up]
        if waiting:
            return Hold(HoldKind.DEPENDENCY, "dependencies not up: " + ", ".join(waiting))
        return None

    def start_gate(self, comp: FakeComponent, operator: bool) -> Hold | None:
        view = self.view(comp)
        return self.node_hold(comp, operator) or first_hold(layer.gate(view, operator) for layer in self.layers)

    def decide(self, comp: FakeComponent, failure: Failure) -> str | None:
        """The supervisor's order: a pause or a desired stop leaves it alone; then the layers; then the policy
        (here: start again as soon as the gate opens)."""
        hold = self.node_hold(comp, False)
        if hold is not None and hold.kind in STOPS_AUTOMATIC:
            self.emit("no_action", f"{failure.detail}; not restarting: {hold}", comp.name, "warning")
            return None
        view = self.view(comp)
        for layer in self.layers:
            verdict = layer.decide(view, failure)
            if isinstance(verdict, Delegated):
                self.emit("failure", f"{failure.detail}; next: {verdict}", comp.name, "warning", action="delegated")
                return verdict.message
        self.emit("failure", f"{failure.detail}; next: restart now", comp.name, "warning", action="restart")
        return None

    async def _life(self, comp: FakeComponent) -> None:
        while True:
            poked = self._poked
            if comp.stopping:
                comp.state = "stopping"
                comp.stops.append(self.clock.monotonic())
                self.notify()
                await self.clock.sleep(comp.stop_s)  # the old tree takes its time to die
                self._gone(comp, "stopped", clean=not comp.crashed)  # as the supervisor: stopped, then held
                comp.stopping = comp.crashed = False
                self.notify()
                continue
            if not comp.running and self.agent_alive:
                hold = self.start_gate(comp, comp.operator_start)
                if hold != comp.hold:
                    comp.hold = hold
                    self.notify()
                if hold is None:
                    self._launch(comp)
                    continue
                await self.clock.wait(poked, HOLD_RECHECK_S)  # as the component: a backoff ends by itself
                continue
            await poked.wait()

    def _launch(self, comp: FakeComponent) -> None:
        comp.running, comp.up, comp.pid, comp.state = True, False, next(_PIDS), "starting"
        comp.operator_start, comp.hold = False, None
        comp.starts.append(self.clock.monotonic())
        from nodeagent.config.cluster import cluster_file_hash

        self.launched[comp.name].append(cluster_file_hash(self.config))
        self.images[comp.name].append(self.container_image)
        if comp.kind == "proxy":
            routing = self.routing.get(comp.name)
            backends = routing.launch_backends() if routing is not None else None
            self.proxy_launches.append(backends)
            if self.proxy_process is not None:
                self.proxy_process.restart(backends)
        self.emit("started", f"started pid {comp.pid}", comp.name)
        self.notify()
        task = asyncio.ensure_future(self._come_up(comp, comp.pid))
        self._starting[task] = None
        task.add_done_callback(lambda t: self._starting.pop(t, None))

    async def _come_up(self, comp: FakeComponent, pid: int) -> None:
        await self.clock.sleep(comp.start_s)
        if comp.pid == pid and comp.running and not comp.stopping:
            cfg = self.config.components.get(comp.name)
            if getattr(cfg, "env", {}).get("FAKE_START") == "crash":  # a config this vLLM cannot start with
                self.crash(comp.name, "exit code 1 during start-up (FAKE_START=crash)")
                return
            comp.up, comp.state = True, "ready"
            comp.loads = remember(comp.loads, self.clock.monotonic() - comp.starts[-1])
            self.notify()

    def _gone(self, comp: FakeComponent, state: str, clean: bool = True) -> None:
        comp.running = comp.up = False
        comp.pid, comp.state = None, state
        comp.gone.append(self.clock.monotonic())
        comp.clean = clean and state == "stopped"  # a crash may leave orphans; a stop waited for the whole tree

    def notify(self) -> None:
        for layer in self.layers:
            layer.on_node_change()
        for listener in self.listeners:
            listener()
        self.wake()

    # ---- StackPort ---------------------------------------------------------------------------------------------
    def view(self, comp: FakeComponent) -> ComponentView:
        return ComponentView(name=comp.name, kind=comp.kind, state=comp.state, running=comp.running, up=comp.up,
                             ready=comp.ready, desired=comp.desired, deps=comp.deps,
                             deps_up=all(self.components[d].up for d in comp.deps), restart=comp.restart_spec,
                             pid=comp.pid, hold=comp.hold, clean=comp.clean,
                             ft_unsupported=comp.ft_unsupported if comp.running else None,
                             last_load_s=comp.loads[-1] if comp.loads else None,
                             launched_file=self.launched[comp.name][-1] if comp.running else None)  # fmt: skip

    @property
    def paused(self) -> bool:
        return self.pause_info() is not None

    def pause_info(self) -> dict[str, Any] | None:
        if self._cluster_pause is not None:
            return {**self._cluster_pause, "scope": "cluster"}
        return {**self.node_pause, "scope": "node"} if self.node_pause is not None else None

    def snapshot(self) -> NodeView:
        return NodeView(node=self.node, paused=self.paused, pause=self.pause_info(), redeploying=False,
                        components={n: self.view(c) for n, c in self.components.items()},
                        adoptable=self.adoptable, recovery=self.recovery_view())  # fmt: skip

    def component(self, name: str) -> ComponentView:
        if name not in self.components:
            raise UnknownComponentError(f"unknown component {name!r}")
        return self.view(self.components[name])

    def restart(self, names: Sequence[str], reason: str, *, planned: bool, cause: str = "gang") -> None:
        for name in names:
            comp = self.components[name]
            self.restarts.append((name, reason, planned))
            comp.operator_start = comp.operator_start or planned
            if comp.running and not comp.dying:
                comp.stopping = True
        self.wake()

    def command(self, name: str, action: str, *, drain: bool = True, by: str = "operator") -> str:
        comp = self.components.get(name)
        if comp is None:
            raise UnknownComponentError(f"unknown component {name!r}")
        self.commands.append((name, action, by))
        view = self.view(comp)
        for layer in self.layers:
            message = layer.command(view, action, drain, by)
            if message:
                return message
        comp.desired = "stopped" if action == "stop" else "running"
        if action in ("stop", "restart") and comp.running:
            comp.stopping = True
        comp.operator_start = action != "stop"
        self.wake()
        return f"{action} {name}"

    async def clean(self, name: str, scope: str, reason: str, *, wipe_etcd: bool = False) -> None:
        comp = self.components[name]
        if comp.unclean is not None:
            comp.held_cleanups.append(self.clock.monotonic())
            raise StartHeld(comp.unclean, lambda: comp.unclean)  # as the supervisor's: who holds the port now
        self.cleaned.append((name, scope, wipe_etcd))
        comp.cleaned_at.append(self.clock.monotonic())
        if not comp.running:
            comp.clean = True
        if wipe_etcd and self.on_wipe_etcd is not None:
            self.on_wipe_etcd()

    async def wait(self, name: str, condition: str, timeout: float | None = None) -> bool:
        comp = self.components[name]
        deadline = None if timeout is None else self.clock.monotonic() + timeout
        while not (not comp.running if condition == "stopped" else comp.up):
            poked = self._poked
            if deadline is None:
                await poked.wait()
            elif deadline <= self.clock.monotonic() or not await self.clock.wait(
                    poked, deadline - self.clock.monotonic()):  # fmt: skip
                return not comp.running if condition == "stopped" else comp.up
        return True

    def emit(self, kind: str, message: str, component: str | None = None, level: str = "info",
             **data: Any) -> None:  # fmt: skip
        self.events.emit(kind, message, component, level, **data)

    def recent_events(self, kinds: Collection[str]) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.events.recent if e.event in kinds]

    def hold_liveness(self, name: str, reason: str | None, for_s: float = 0.0) -> None:
        self.component(name)
        self.liveness_hold_log.append((name, reason))
        if reason is None:
            self.liveness_holds.pop(name, None)
        else:
            self.liveness_holds[name] = (reason, self.clock.monotonic() + for_s)

    def postmortem(self, name: str, detail: str, ladder: Sequence[Mapping[str, Any]], decision: str) -> None:
        self.postmortems.append({"component": name, "detail": detail, "ladder": [dict(s) for s in ladder],
                                 "decision": decision})  # fmt: skip

    def set_cluster_pause(self, info: Mapping[str, Any] | None) -> None:
        info = dict(info) if info is not None else None
        if info != self._cluster_pause:
            self._cluster_pause = info
            self.notify()

    def cluster_pause(self) -> Mapping[str, Any] | None:
        return self._cluster_pause

    def wake(self) -> None:
        self._poked.set()
        self._poked = asyncio.Event()

    def block_ready(self, name: str, key: str, reason: str | None) -> None:
        comp = self.components[name]
        before = comp.ready
        if reason is None:
            comp.blocks.pop(key, None)
        else:
            comp.blocks[key] = reason
        if comp.ready != before:
            self.notify()

    def route_proxy(self, name: str, routing: ProxyRouting) -> None:
        if name in self.routing:
            raise ValueError(f"{name} is routed already")
        self.routing[name] = routing

    def show_recovery(self, view: Callable[[], Mapping[str, Any] | None]) -> None:
        self.recovery_view = view

    def member_report(self) -> MemberReport:
        report = MemberReport()
        for layer in self.layers:
            report = report.merged(layer.member_report())
        return report

    def attach(self, layer: NodeLayer) -> None:
        self.layers.append(layer)
        self.agent_alive = True
        self.adoptable = frozenset()  # adoption is instant here: what still runs is adopted, the rest is gone
        for comp in self.components.values():
            comp.clean = False  # as a new supervisor's components: it saw nothing die

    # ---- MemberHost ----------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        sections: dict[str, Any] = {}
        for layer in self.layers:
            sections.update(layer.status_section())
        comps = {n: {"state": c.state, "pid": c.pid, "ready": c.ready,
                     "hold": c.hold.to_dict() if c.hold is not None and c.pid is None else None,
                     "load": load_status(c.loads, None)}
                 for n, c in self.components.items()}  # fmt: skip
        return {"paused": self.paused, "components": comps, **sections}


# ---- the PD proxy ------------------------------------------------------------------------------------------------


class FakeProxy:
    """vllm-ascend's proxy as the sync sees it: `/instances/remove|add`, answering what it routes to."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self.routed = {"prefill": set(prefill), "decode": set(decode)}
        self.command_line = {"prefill": tuple(prefill), "decode": tuple(decode)}
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self.busy = False
        """Requests in flight: a removed instance is only tainted (still listed, an add of it ignored) until
        `idle()`, as vllm-ascend's proxy does (`remove_instances`, `finalize_tainted_instances`)."""
        self.tainted: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        self.clock: Clock | None = None
        self.timeline: list[tuple[float, dict[str, set[str]]]] = []
        """(when, what a request may be routed to then) after every change of the proxy's lists."""
        self.on_change: list[Callable[[], None]] = []
        self.activation_dead = False
        """vllm-ascend's `NodeListener` thread ended by an exception (seed 3306): an added instance waits for good
        (not listed); a new process has the thread again."""
        self.waiting: dict[str, set[str]] = {"prefill": set(), "decode": set()}

    def _changed(self) -> None:
        when = self.clock.monotonic() if self.clock is not None else 0.0
        self.timeline.append((when, {k: set(self.serving(k)) for k in self.routed}))
        for call in self.on_change:
            call()

    def restart(self, backends: ProxyBackends | None) -> None:
        """A new process: nothing in flight, it routes to every endpoint it was launched with at once."""
        given = ({"prefill": backends.prefill, "decode": backends.decode} if backends is not None
                 else self.command_line)  # fmt: skip
        self.routed = {k: set(v) for k, v in given.items()}
        self.tainted = {"prefill": set(), "decode": set()}
        self.waiting = {"prefill": set(), "decode": set()}
        self.busy = False
        self.activation_dead = False
        self._changed()

    def idle(self) -> None:
        """No request in flight at the proxy's check: tainted instances are deleted."""
        for kind, keys in self.tainted.items():
            self.routed[kind] -= keys
            keys.clear()
        self._changed()

    def serving(self, kind: str) -> set[str]:
        """What a request may be routed to now (tainted ones only when nothing else is left)."""
        return (self.routed[kind] - self.tainted[kind]) or set(self.routed[kind])

    async def post(self, url: str, body: dict[str, Any]) -> dict[str, Any] | None:
        what = url.rsplit("/", 1)[-1]
        kind, instances = body["type"], set(body["instances"])
        if instances:
            self.calls.append((what, kind, tuple(sorted(instances))))
        if what == "remove" and self.busy:
            self.tainted[kind] |= instances  # whatever it is asked, listed or not (`remove_instances`)
        elif what == "remove":
            self.routed[kind] -= instances
            self.tainted[kind] -= instances
        else:
            new = instances - self.routed[kind]  # a listed (even tainted) one is left as it is
            if new & self.tainted[kind]:
                self.activation_dead = True  # activating one tainted but not listed: KeyError in `_push_heap`
            if self.activation_dead:
                self.waiting[kind] |= new
            else:
                self.routed[kind] |= new
        if instances:
            self._changed()
        return {f"current_{k}_instances": sorted(v) for k, v in self.routed.items()}


# ---- several agents on one store ------------------------------------------------------------------------------------


class FakeConfigHost:
    """`rollout.ConfigHost` as the agent does it: the config in memory, this node's file on disk (the harness
    writes it), staging = the stack's next starts use it and the member record publishes its hash."""

    def __init__(self, world: World, name: str, stack: FakeStack, membership: Membership) -> None:
        self.world, self.name, self.stack, self.membership = world, name, stack, membership

    def running_config(self) -> Config:
        return self.stack.config

    def read_config_file(self, path: str | None = None) -> Config:
        return self.world.load_checked(str(path or self.world.harness.config_path(self.name)), self.name)

    def stage_config(self, config: Config) -> None:
        self.stack.config = config
        self.membership.update_config(config)

    def container_pending(self) -> str | None:
        """The staged file's image against the image the node's (fake) container runs."""
        staged = self.stack.config.container.image if self.stack.config.container is not None else None
        return f"the image {self.stack.container_image} → {staged}" if staged != self.stack.container_image else None

    def recreate_container(self) -> str | None:
        what = self.container_pending()
        self.stack.container_image = self.stack.config.container.image if self.stack.config.container else None
        self.stack.recreated.append((self.world.clock.monotonic(), self.stack.container_image))
        return what


@dataclass
class Agent:
    name: str
    stack: FakeStack
    membership: Membership
    coordinator: Coordinator
    rollout: Any = None


class World:
    """Agents of one cluster on one FakeStore, one virtual clock and (optionally) one fake proxy."""

    def __init__(self, home: Path, names: Sequence[str], groups: list[dict[str, Any]] | None = None,
                 proxy: bool = False, ft: dict[str, Any] | None = None, rollouts: bool = False,
                 clock: VirtualClock | None = None) -> None:  # fmt: skip
        """ft: the vllm component's `fault_tolerance` key; the agents then call a `ft_fakes.FakeFtApi`."""
        self.clock = clock or VirtualClock()
        self.store = FakeStore(now=self.clock.time())
        self.clock.on_tick.append(self.store.advance)
        self.harness = ClusterHarness(home, "127.0.0.1:2379", names, ttl_s=3.0, heartbeat_s=5.0)
        if groups is not None:
            self.harness.data["cluster"]["vllm_groups"] = groups
        self.proxy: FakeProxy | None = None
        if proxy:
            self.harness.data["cluster"]["pd"] = {"kv_port_base": 41000}
            self.harness.data["components"]["proxy"] = {"kind": "proxy", "command": "python3", "script": __file__,
                                                        "port": 42000, "host": "127.0.0.1"}  # fmt: skip
        self.stacks: dict[str, FakeStack] = {}
        self.agents: dict[str, Agent] = {}
        self.ft: FakeFtApi | None = None
        if ft is not None:
            self.harness.data["components"]["vllm"]["fault_tolerance"] = ft
            self.ft = FakeFtApi(self)
        self.rollouts = rollouts
        self._rollout_ids = itertools.count(1)

    def config(self, name: str) -> Config:
        return load_config(self.harness.write(name))

    def load_checked(self, path: str, node: str) -> Config:
        """A node's file as the agent reads it, with the config-level checks (the simulation reuses what it parsed)."""
        from nodeagent.agent import load_checked

        return load_checked(path, node=node)

    def start_agent(self, name: str) -> Agent:
        """An agent (its first, or the next over the same state folder: its stack's processes ran on)."""
        config = self.config(name)
        stack = self.stacks.get(name)
        if stack is None:
            stack = self.stacks[name] = FakeStack(config, self.clock, lambda: self.store.reachable)
        membership = Membership(config, stack, self.store, clock=self.clock)  # type: ignore[arg-type]
        stack.listeners.append(membership.status_changed)
        if self.proxy is None and "proxy" in stack.components:
            from nodeagent.config.layout import cluster_layout

            plan = cluster_layout(config).proxies[0]
            self.proxy = FakeProxy(plan.prefillers, plan.decoders)
            self.proxy.clock = self.clock
        if "proxy" in stack.components:
            stack.proxy_process = self.proxy
        post = self.proxy.post if self.proxy is not None else None
        stack.config = config  # what this agent loaded: the file on disk now (the layers read it through the stack)
        coordinator = Coordinator(config, stack, membership, clock=self.clock, proxy_post=post, ft_client=self.ft)
        agent = self.agents[name] = Agent(name, stack, membership, coordinator)
        if self.rollouts:
            from nodeagent.cluster.rollout.executor import RolloutExecutor

            async def inflight(component: str, cfg: Any) -> tuple[int, int] | None:
                return stack.inflight.get(component, (0, 0))

            async def canary(endpoint: str, cfg: Any) -> tuple[bool, str]:
                owner = next(s for s in self.stacks.values() if endpoint in s.endpoints())
                why = owner.canary_answers.get(endpoint)
                return (why is None, why or "ok")

            async def scrape(endpoint: str) -> str:
                owner = next(s for s in self.stacks.values() if endpoint in s.endpoints())
                return owner.metrics_text.get(endpoint, "")

            agent.rollout = RolloutExecutor(coordinator, FakeConfigHost(self, name, stack, membership),
                                            clock=self.clock, inflight=inflight, canary=canary,
                                            scrape=scrape, new_id=lambda: f"r{next(self._rollout_ids)}")  # fmt: skip
        evict = ProxyEvict(coordinator, post)
        for layer in (coordinator.ft, coordinator, evict, agent.rollout):  # as `agent.Agent.layers` orders them
            if layer is not None:
                stack.attach(layer)
        self._start_container(stack)
        membership.start()
        coordinator.start()
        if agent.rollout is not None:
            agent.rollout.start()
        stack.start()
        return agent

    def _start_container(self, stack: FakeStack) -> None:
        """As `ContainerMode.start` after the rollout executor was made: the node's container is kept as the config
        in memory says; another image is a planned recreate (the components inside stop and start in the new)."""
        section = stack.config.container
        if stack.container_image is None or section is None or section.image == stack.container_image:
            return
        stack.container_image = section.image
        stack.recreated.append((self.clock.monotonic(), section.image))
        stack.restart([n for n, c in stack.components.items() if c.running], "container recreate", planned=True,
                      cause="reload")  # fmt: skip

    def install(self, edit: Callable[[dict[str, Any]], None]) -> None:
        """The operator's tool installs a new cluster file on every node (the agents keep what they loaded)."""
        edit(self.harness.data)
        for name in self.harness.names:
            self.harness.write(name)

    def start(self) -> None:
        for name in self.harness.names:
            self.start_agent(name)

    async def kill_agent(self, name: str) -> None:
        """kill -9 of the agent alone: its stack runs on, its lease is no longer kept."""
        agent = self.agents.pop(name)
        agent.membership.lease.abandon()
        if agent.rollout is not None:
            await agent.rollout.stop()
        await agent.coordinator.stop()
        await agent.membership.stop(leave=False)
        agent.stack.detach()
        await self.clock.settle()

    async def until(self, what: str, check: Callable[[], Any], within: float = 600.0) -> Any:
        return await self.clock.until(what, check, within)

    async def advance(self, seconds: float) -> None:
        await self.clock.advance(seconds)

    async def run(self, work: Any, within: float = 600.0) -> Any:
        """Await `work` while the clock moves (what it waits for may be a sleep of the agents)."""
        task = asyncio.ensure_future(work)
        try:
            await self.until("the call to return", task.done, within)
        finally:
            if not task.done():
                task.cancel()
        return task.result()

    def all_up(self, names: Sequence[str] | None = None) -> bool:
        return all(c.up for n in (names or self.harness.names) for c in self.stacks[n].components.values())

    def gang(self, node: str, group: str) -> Any:
        return self.agents[node].coordinator.gangs[group]

    async def close(self) -> None:
        for agent in list(self.agents.values()):
            if agent.rollout is not None:
                await agent.rollout.stop()
            await agent.coordinator.stop()
            await agent.membership.stop(leave=False)
        for stack in self.stacks.values():
            await stack.close()
        if self.ft is not None:
            await self.ft.shutdown()

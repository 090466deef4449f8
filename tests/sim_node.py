"""The simulated node: the real `Supervisor` and its `Component`s — start gates, restart policy, failure path, blast
radius, pause, liveness holds, adoption — over simulated processes, for `tests/simulation.py` (schedules whose
`node` is "real").

What is simulated is only what the node touches (`nodeagent.node.nodeworld.NodeWorld`, the `ProbeContext`'s
checks) and time:
- `LoopClock`: the `VirtualClock` that is also the event loop's clock, so the product's own `asyncio.sleep`,
  `asyncio.timeout` and `asyncio.wait(timeout=...)` (probe periods, hold re-checks, backoffs, the heartbeat's
  ticks) run on virtual time, in order, deterministically;
- `SimHost`: one node's processes — a launch is a process that is up `start_s` later, killed (`crash`), hung
  (`hang`: its probes time out) or killed during start-up (`start_fail`, an OOM kill while loading); a stop takes
  its tree `stop_s` (a killed API server's orphaned engine), a stop begun goes on when the agent dies; adoption
  verifies pid + start time; the residue cleanup kills what is left of a component's dead trees (nothing else is
  residue), prerequisites are always there, the tree watch sees nothing;
- `SimProbes`: the probe kinds' answers from the process table (the real prober's thresholds, periods, startup
  gating run on them);
- `RealStack`: what the simulation reads of a node (as of `cluster_fakes.FakeStack`), from the real supervisor;
- `RealWorld`: the agents, each a real `Supervisor` with the cluster layer attached in `agent.Agent.layers` order.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from cluster_fakes import Agent, FakeProxy, VirtualClock, World

from nodeagent.cluster.coordinator import Coordinator
from nodeagent.cluster.membership import Membership
from nodeagent.cluster.proxy_evict import ProxyEvict
from nodeagent.config.model import Config
from nodeagent.core.errors import AdoptError, LaunchError
from nodeagent.core.events import EventBus
from nodeagent.core.process import ProcessRecord
from nodeagent.core.states import SERVING_STATES, State
from nodeagent.node.launcher import Launched
from nodeagent.node.supervisor import Supervisor
from nodeagent.probes.kinds import ProbeContext, resolve_probe_set
from nodeagent.seam.stackport import ChangeObserver

if TYPE_CHECKING:
    from nodeagent.node.component import Component
    from nodeagent.probes.resolve import ResolvedProbe
    from nodeagent.render.launch import LaunchSpec
    from nodeagent.vllm.progress import ProgressMonitor

_PIDS = itertools.count(50_000)
START_S = {"vllm": 2.0}
"""From a launch to its probes passing (others: 1 s)."""
START_FAIL_AFTER_S = 1.0
"""A launch under `start_fail` is killed (SIGKILL: the OOM killer while loading) this long after it began."""


class LoopClock(VirtualClock):
    """A `VirtualClock` that is the event loop's clock too: the loop's timers are deadlines it steps to."""

    loop: asyncio.AbstractEventLoop | None = None

    inline_threads = True

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        loop.time = lambda: self.mono  # type: ignore[method-assign]

    def _next_deadline(self) -> float | None:
        own = super()._next_deadline()
        loop = self.loop
        if loop is None:
            return own
        scheduled: list[Any] = loop._scheduled  # type: ignore[attr-defined]
        while scheduled and scheduled[0]._cancelled:  # as the loop itself drops them
            handle = heapq.heappop(scheduled)
            handle._scheduled = False
            loop._timer_cancelled_count -= 1  # type: ignore[attr-defined]
        theirs = scheduled[0]._when if scheduled else None
        return min((d for d in (own, theirs) if d is not None), default=None)


@dataclass
class SimProc:
    pid: int
    component: str
    kind: str
    record: ProcessRecord
    started: float
    """Virtual monotonic time of its launch."""
    start_s: float
    main_alive: bool = True
    gone: bool = False
    """The whole tree is gone."""
    gone_at: float | None = None
    """When the tree will be gone (a stop or a crash under way)."""
    hung_until: float = 0.0
    watchers: list[asyncio.Future[int | None]] = field(default_factory=list)


class SimWatch:
    def __init__(self, proc: SimProc) -> None:
        self.proc = proc
        self.done: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        proc.watchers.append(self.done)

    def close(self) -> None:
        if not self.done.done():
            self.done.cancel()


class SimHost:
    """One node's processes (`NodeWorld`): they outlive the agents that watch them."""

    def __init__(self, node: str, clock: VirtualClock, etcd_reachable: Callable[[], bool]) -> None:
        self.node = node
        self.clock = clock
        self.etcd_reachable = etcd_reachable
        self.procs: dict[int, SimProc] = {}
        self.start_fail_until: dict[str, float] = {}
        self.stop_s: dict[str, float] = {}
        """component → how long its next stop (or what its next crash leaves) takes to die."""
        self.on_launch: Callable[[str], None] = lambda name: None
        self.on_stop: Callable[[str], None] = lambda name: None
        self.proxy: Callable[[], FakeProxy | None] = lambda: None
        self.backends: Callable[[str], Any] = lambda name: None
        self.tasks: set[asyncio.Future[Any]] = set()

    def later(self, seconds: float, what: Callable[[], None]) -> None:
        async def run() -> None:
            await self.clock.sleep(seconds)
            what()

        task = asyncio.ensure_future(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def current(self, name: str) -> SimProc | None:
        """The component's newest process whose main process lives."""
        live = [p for p in self.procs.values() if p.component == name and p.main_alive]
        return live[-1] if live else None

    def tree_alive(self, name: str) -> list[SimProc]:
        return [p for p in self.procs.values() if p.component == name and not p.gone]

    def is_up(self, proc: SimProc) -> bool:
        now = self.clock.monotonic()
        return proc.main_alive and now >= proc.started + proc.start_s and now >= proc.hung_until

    # ---- faults --------------------------------------------------------------------------------------------
    def _exit(self, proc: SimProc, code: int) -> None:
        if not proc.main_alive:
            return
        proc.main_alive = False
        for fut in proc.watchers:
            if not fut.done():
                fut.set_result(code)
        proc.watchers.clear()

    def _tree_ends(self, proc: SimProc, after: float) -> float:
        when = self.clock.monotonic() + after
        if proc.gone_at is None or when < proc.gone_at:
            proc.gone_at = when
            self.later(after, lambda: self._gone(proc, when))
        return proc.gone_at

    def _gone(self, proc: SimProc, when: float) -> None:
        if proc.gone_at == when:
            self._exit(proc, -9)
            proc.gone = True

    def crash(self, name: str) -> None:
        """kill -9 of its main process: what is left of its tree takes `stop_s` to end by itself."""
        proc = self.current(name)
        assert proc is not None, f"{self.node}/{name} runs no process"
        self._exit(proc, -9)
        self._tree_ends(proc, self.stop_s.pop(name, 0.2))

    def hang(self, name: str, seconds: float) -> None:
        proc = self.current(name)
        if proc is not None:
            proc.hung_until = self.clock.monotonic() + seconds

    # ---- NodeWorld -----------------------------------------------------------------------------------------
    def missing_prerequisite(self, cfg: Any, env: Mapping[str, str]) -> str | None:
        return None

    async def clean(self, plan: Any) -> list[Any]:
        """The residue plan's kill of the component's leftovers: a tree whose main process died while it was not
        stopped (an orphaned EngineCore) is killed -9 and gone before the start goes on, as the real cleanup
        waits for it (the barrier cleans a rank that was not seen to die before it arrives)."""
        left = [p for p in self.procs.values() if p.component == plan.component and not p.main_alive and not p.gone]
        for proc in left:
            until = self._tree_ends(proc, 0.05)
            while not proc.gone:
                await self.clock.sleep(max(until - self.clock.monotonic(), 0.001))
                until = proc.gone_at or until
        return []

    async def launch(self, spec: LaunchSpec, log_dir: Path, base_env: Mapping[str, str], capture_dir: Path,
                     timeout_s: float, scope: str | None,
                     tail_file: Path | None) -> tuple[Launched, SimWatch]:  # fmt: skip
        name = spec.component
        self.on_launch(name)
        pid = next(_PIDS)
        kind = "proxy" if name == "proxy" else ("vllm" if "vllm" in name else "datasystem")
        record = ProcessRecord(pid, self.clock.time(), tuple(spec.argv), pid)
        proc = SimProc(pid, name, kind, record, self.clock.monotonic(), START_S.get(kind, 1.0))
        self.procs[pid] = proc
        watch = SimWatch(proc)
        if self.start_fail_until.get(name, 0.0) > self.clock.monotonic():
            self.later(START_FAIL_AFTER_S, lambda: (self._exit(proc, -9), self._tree_ends(proc, 0.1)))
        if kind == "proxy" and (proxy := self.proxy()) is not None:
            proxy.restart(self.backends(name))
        return Launched(record, None, "simulated"), watch

    def adopt(self, record: ProcessRecord) -> SimWatch:
        proc = self.procs.get(record.pid)
        if proc is None or not proc.main_alive or proc.record.create_time != record.create_time:
            raise AdoptError(f"pid {record.pid} is gone")
        return SimWatch(proc)

    async def stop_tree(self, record: ProcessRecord, grace_s: float, what: str,
                        member: Callable[[int], bool] | None) -> dict[str, Any]:  # fmt: skip
        proc = self.procs.get(record.pid)
        if proc is None or proc.gone:
            return {"signalled": 0, "killed": 0, "survivors": 0, "elapsed_s": 0.0, "tree": []}
        self.on_stop(proc.component)
        began = self.clock.monotonic()
        until = self._tree_ends(proc, min(self.stop_s.pop(proc.component, 0.2), grace_s + 1.0))
        while not proc.gone:
            await self.clock.sleep(max(until - self.clock.monotonic(), 0.001))
            until = proc.gone_at or until
        return {"signalled": 1, "killed": 0, "survivors": 0, "elapsed_s": round(self.clock.monotonic() - began, 3),
                "tree": []}  # fmt: skip

    def record_of(self, pid: int) -> ProcessRecord:
        proc = self.procs.get(pid)
        if proc is None or not proc.main_alive:
            raise LaunchError(f"process {pid} vanished")
        return proc.record

    def watch_tree(self, record: ProcessRecord, still_ours: Callable[[], bool],
                   on_problem: Callable[[str], None]) -> Coroutine[Any, Any, None]:  # fmt: skip
        async def nothing() -> None:  # its processes are one here: none dies alone
            return None

        return nothing()

    async def inflight(self, ctx: ProbeContext, name: str, cfg: Any) -> tuple[int, int] | None:
        return (0, 0)

    async def etcd_ok(self, ctx: ProbeContext, endpoint: str) -> bool:
        return self.etcd_reachable()


class SimProbes(ProbeContext):
    """Every probe kind answered from the node's process table: up once started `start_s` ago; a hung process
    answers nothing (the real probe's timeout ends the check)."""

    def __init__(self, host: SimHost, config: Config) -> None:
        super().__init__()
        self.host = host
        self.target: dict[str, str] = {}
        for name, cfg in config.active_components().items():
            for probes in resolve_probe_set(cfg, config).values():
                for probe in probes:
                    self.target[probe.target] = name

    def session(self) -> Any:
        raise AssertionError("a simulated probe dials nothing")

    async def _answer(self, probe: ResolvedProbe) -> tuple[bool, str]:
        proc = self.host.current(self.target.get(probe.target, ""))
        if proc is None:
            return False, "connection refused"
        if self.host.clock.monotonic() < proc.hung_until:
            await asyncio.sleep(probe.timeout_s + 1.0)  # the probe's own timeout ends it
        if not self.host.is_up(proc):
            return False, "connection refused" if proc.main_alive else "gone"
        return True, "ok"

    async def _check(self, probe: ResolvedProbe) -> tuple[bool, str] | tuple[bool, str, bool]:
        return await self._answer(probe)

    async def _progress(self, probe: ResolvedProbe, monitor: ProgressMonitor) -> tuple[bool, str, bool]:
        ok, detail = await self._answer(probe)
        return ok, detail, False


class RealComp:
    """One component as the simulation reads it (`cluster_fakes.FakeComponent`'s fields), from the real one."""

    def __init__(self, stack: RealStack, name: str, kind: str) -> None:
        self.stack, self.name, self.kind = stack, name, kind
        self.starts: list[float] = []

    @property
    def real(self) -> Component | None:
        sup = self.stack.supervisor
        return sup.components.get(self.name) if sup is not None else None

    @property
    def running(self) -> bool:
        return bool(self.stack.host.tree_alive(self.name))

    @property
    def dying(self) -> bool:
        return self.running and self.stack.host.current(self.name) is None

    @property
    def stopping(self) -> bool:
        return self.real is not None and self.real.state == State.STOPPING

    @property
    def up(self) -> bool:
        real = self.real
        if real is not None:
            return real.up.is_set()
        proc = self.stack.host.current(self.name)
        return proc is not None and self.stack.host.is_up(proc)

    @property
    def state(self) -> str:
        real = self.real
        return str(real.state) if real is not None else ("running" if self.running else "stopped")

    @property
    def hold(self) -> Any:
        real = self.real
        return real.hold if real is not None else None

    @property
    def operator_start(self) -> bool:
        real = self.real
        return real is not None and real.operator_start

    @property
    def stop_s(self) -> float:
        return self.stack.host.stop_s.get(self.name, 0.2)

    @stop_s.setter
    def stop_s(self, value: float) -> None:
        self.stack.host.stop_s[self.name] = value


class RealStack:
    """A node of the simulation: its processes (they outlive agents) and the real supervisor of its agent."""

    def __init__(self, config: Config, clock: VirtualClock, etcd_reachable: Callable[[], bool]) -> None:
        self.config = config
        self.node = config.node.name
        self.clock = clock
        self.host = SimHost(self.node, clock, etcd_reachable)
        self.supervisor: Supervisor | None = None
        self.starting: asyncio.Future[None] | None = None
        """The agent's start: its container looked at (an engine call: virtual time), then the loops begun."""
        self.components = {n: RealComp(self, n, c.kind) for n, c in config.active_components().items()}
        self.listeners: list[Callable[[], None]] = []
        self.on_restart: Callable[[Sequence[str], str, bool], None] = lambda names, reason, planned: None
        self.node_pause_pending: bool | None = None

        def launched(name: str) -> None:
            self.components[name].starts.append(self.clock.monotonic())
            self.before_launch(self.components[name])

        self.host.on_launch = launched

    def before_launch(self, comp: RealComp) -> None:
        """The simulation's hook (set by it)."""

    @property
    def agent_alive(self) -> bool:
        return self.supervisor is not None

    @property
    def paused(self) -> bool:
        return self.pause_info() is not None

    def pause_info(self) -> dict[str, Any] | None:
        return self.supervisor.pause_info() if self.supervisor is not None else None

    def set_node_pause(self, on: bool) -> bool:
        """The operator's pause/resume (its CLI needs the agent: False when none answers)."""
        if self.supervisor is None:
            return False
        self.supervisor.set_paused(on, "operator")
        return True

    def endpoints(self) -> set[str]:
        from nodeagent.config.layout import cluster_layout

        layout = cluster_layout(self.config)
        return {p.endpoint for g in layout.groups for p in g.processes if p.node == self.node and p.endpoint}

    def crash(self, name: str) -> None:
        self.host.crash(name)
        self.notify()

    def command(self, name: str, action: str) -> str:
        assert self.supervisor is not None
        return self.supervisor.command(name, action)

    def wake(self) -> None:
        if self.supervisor is not None:
            self.supervisor.wake()

    def notify(self) -> None:
        for listener in self.listeners:
            listener()

    def unsupervised(self) -> list[str]:
        """Each desired-running component that is neither running, nor backing off with a reason, nor held by a
        typed hold (read when the loop is settled), or whose loop ended."""
        sup = self.supervisor
        if sup is None or (self.starting is not None and not self.starting.done()):
            return []  # the agent is starting: in container mode its loops begin once the container was looked at
        out = []
        redeploying = sup.redeploying is not None and not sup.redeploying.done()
        for name, comp in sup.components.items():
            task = sup.tasks.get(name)
            if task is None or task.done():
                if not (redeploying and name in sup.redeploy_scope):
                    out.append(f"{name}: no supervision loop")
                continue
            if sup.desired(name) != "running" or comp.proc is not None:
                continue
            if comp.state in (State.BACKOFF, State.FAILED) and comp.backoff_until is not None:
                continue
            if comp.state in (State.STARTING, State.STOPPING) or comp.hold is not None:
                continue
            out.append(f"{name}: {comp.state}, no process, no hold, no backoff")
        return out

    def abandon(self) -> None:
        """kill -9 of the agent: its tasks end, nothing is stopped or saved (its processes run on)."""
        sup, self.supervisor = self.supervisor, None
        if sup is None:
            return
        for task in [*sup.tasks.values(), *sup._background]:
            task.cancel()
        if sup.redeploying is not None:
            sup.redeploying.cancel()
        for comp in sup.components.values():
            if comp.prober is not None:
                comp.prober._cancel()
            if comp.proc is not None and comp.proc.close is not None:
                comp.proc.close()
        if sup._flush_handle is not None:
            sup._flush_handle.cancel()
        task = getattr(sup.container, "_task", None)  # the container's watch dies with its agent
        if task is not None:
            task.cancel()


def caches_off(config: Config) -> Config:
    """The node's config with the compile caches off: their folders are the host's file system, made and swept
    in threads whose order no virtual clock decides (a replay would differ); `tests/test_caches.py` has them."""
    caches = msgspec.structs.replace(config.agent.caches, enabled=False)
    return msgspec.structs.replace(config, agent=msgspec.structs.replace(config.agent, caches=caches))


class RealWorld(World):
    """The agents of `cluster_fakes.World`, each over a real `Supervisor` of its `RealStack`."""

    stacks: dict[str, RealStack]  # type: ignore[assignment]

    def start_agent(self, name: str) -> Agent:
        config = self.config(name)
        stack = self.stacks[name]
        sup = Supervisor(config, EventBus(replay=200), self.clock, world=stack.host,
                         probe_ctx=SimProbes(stack.host, config), container=self.container_for(stack))  # fmt: skip
        real_restart = sup.restart

        def restart(names: Sequence[str], reason: str, *, planned: bool, cause: str = "gang") -> None:
            stack.on_restart(names, reason, planned)  # the simulation's check of every restart a layer asks
            real_restart(names, reason, planned=planned, cause=cause)

        sup.restart = restart  # type: ignore[method-assign]
        membership = Membership(config, sup, self.store, clock=self.clock)
        if self.proxy is None and "proxy" in stack.components:
            from nodeagent.config.layout import cluster_layout

            plan = cluster_layout(config).proxies[0]
            self.proxy = FakeProxy(plan.prefillers, plan.decoders)
            self.proxy.clock = self.clock
        stack.host.proxy = lambda: self.proxy
        stack.host.backends = sup.launch_backends
        post = self.proxy.post if self.proxy is not None else None
        coordinator = Coordinator(config, sup, membership, clock=self.clock, proxy_post=post)
        first, cluster, before = self.node_layers(stack, sup, coordinator)
        # as `agent.Agent.layers` orders them
        for layer in (*first, coordinator.ft, coordinator, ProxyEvict(coordinator, post), *cluster, sup.container,
                      ChangeObserver(membership.status_changed), ChangeObserver(stack.notify)):  # fmt: skip
            if layer is not None:
                sup.attach(layer)
        stack.supervisor = sup
        membership.start()
        coordinator.start()
        task = stack.starting = asyncio.ensure_future(self._start(sup, before))
        stack.host.tasks.add(task)
        task.add_done_callback(stack.host.tasks.discard)
        agent = self.agents[name] = Agent(name, stack, membership, coordinator)  # type: ignore[arg-type]
        return agent

    def node_layers(self, stack: RealStack, sup: Supervisor,
                    coordinator: Coordinator) -> tuple[list[Any], list[Any], Callable[[], Any] | None]:  # fmt: skip
        """The node's own layers (before the cluster's), the cluster's after the proxy evict, and what starts them
        before the stack (the NPU guards and ladder: `sim_npu`); none here."""
        return [], [], None

    def container_for(self, stack: RealStack) -> Callable[[Supervisor], Any] | None:
        """The node's container mode (`sim_container` gives one over a simulated engine); None: no container."""
        return None

    @staticmethod
    async def _start(sup: Supervisor, before: Callable[[], Any] | None = None) -> None:
        if before is not None:  # the NPU guards, as the agent starts them before the stack
            await before()
        if sup.container is not None:  # before the stack, as the agent does: its components adopt or wait for it
            await sup.container.start()  # type: ignore[attr-defined]
        await sup.start()

    async def kill_agent(self, name: str) -> None:
        agent = self.agents.pop(name)
        agent.membership.lease.abandon()
        await agent.coordinator.stop()
        await agent.membership.stop(leave=False)
        self.stacks[name].abandon()
        await self.clock.settle()

    def all_up(self, names: Sequence[str] | None = None) -> bool:
        return all(c.up for n in (names or self.harness.names) for c in self.stacks[n].components.values())

    async def close(self) -> None:
        for agent in list(self.agents.values()):
            await agent.coordinator.stop()
            await agent.membership.stop(leave=False)
        for stack in self.stacks.values():
            stack.abandon()
            for task in list(stack.host.tasks):
                task.cancel()
        await asyncio.sleep(0)


def serving(comp: RealComp) -> bool:
    real = comp.real
    return real is not None and real.state in SERVING_STATES

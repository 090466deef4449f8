"""Container mode in the whole-cluster simulation (`tests/simulation.py --node container`): each node's ranks and
datasystem worker run in the node's container, kept by the **real** `ContainerMode` (its plan, setup record, death
watch, post-mortem, node redeploy by blast radius, the gate of the components inside, adoption by a successor
agent), over a simulated container engine (`nodeagent.container.world.ContainerWorld`). The proxy stays a host
component: a container's recovery must never touch it.

What is simulated (`SimEngines`, one per node; it outlives agents, as the engine does):
- the engine's CLI: `inspect` answers docker's JSON (the real `parse_inspect` reads it), `run` makes a container (a
  name in use is refused, as docker does), `start`, `stop`, `rm -f`, `exec` (setup steps succeed), the `events`
  stream (a death wakes the watch);
- /proc: a container's init is alive while it runs; a process is the container's when it was launched into it;
- faults: the container dies (exit 137, its processes die with it: the kernel kills its PID namespace), the engine
  answers every command late for a while (past the command's timeout: `EngineError`, as `core.run` raises), the
  engine refuses every command for a while (dockerd down), a new image (an operator's reload on every node).

Invariants (checked after every change): `container_recreated` — a container is made only when none is there to
keep: the first, or one per death or new image (a rank's restart never recreates a healthy container, a dead one is
recreated once); `two_containers` — no process of a component inside alive in a container that is not the node's
running one; at the end `image_stale` — each container runs the image its file names. An engine slow or down
licenses no stop: a rank inside a living container must be left alone.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim_node import SimHost

from nodeagent.container.engine import ContainerEngine, EngineError
from nodeagent.container.host import HostFacts
from nodeagent.container.mode import RETRY_MAX_S, ContainerMode
from nodeagent.container.render import ContainerSpec
from nodeagent.core.errors import AdoptError, LaunchError
from nodeagent.core.run import RunResult

if TYPE_CHECKING:
    from sim_node import RealStack, SimWatch

    from nodeagent.core.process import ProcessRecord
    from nodeagent.node.launcher import Launched
    from nodeagent.node.supervisor import Supervisor
    from nodeagent.render.launch import LaunchSpec

CONTAINER_FAULTS: dict[str, float] = {
    "container_death": 3.0,  # the node's container dies (exit 137): its ranks and worker die with it
    "engine_slow": 1.5,      # every engine command answers late for a while (past its timeout: an error)
    "engine_fail": 1.0,      # the engine refuses every command for a while (dockerd down)
    "new_image": 0.5,        # a new image in every node's file, reloaded on each node that has an agent
}  # fmt: skip
"""What container-mode schedules add to the real node's mix."""
INSPECT_TIMEOUT_S = 30.0
"""`ContainerEngine.timeout_s`: inspect's timeout."""


@dataclass
class SimContainer:
    id: str
    name: str
    image: str
    pid: int
    started_at: str
    status: str = "running"
    exit_code: int = 0
    finished_at: str | None = None
    inside: set[int] = field(default_factory=set)
    """Host PIDs launched into it."""

    @property
    def running(self) -> bool:
        return self.status == "running"

    def inspect(self) -> str:
        return json.dumps([{"Id": self.id, "Name": "/" + self.name, "Image": f"sha256:{self.image}",
                            "ImageName": self.image, "Config": {"Image": self.image},
                            "State": {"Status": self.status, "Running": self.running, "Pid": self.pid if self.running
                                      else 0, "ExitCode": self.exit_code, "OOMKilled": False, "Error": "",
                                      "StartedAt": self.started_at, "FinishedAt": self.finished_at}}])  # fmt: skip


class SimEngines:
    """One node's container engine: its containers and its health (it outlives the agents)."""

    def __init__(self, stack: RealStack, on_create: Callable[[SimContainer], None]) -> None:
        self.stack = stack
        self.host: SimHost = stack.host
        self.clock = stack.clock
        self.containers: dict[str, SimContainer] = {}
        self.all: dict[str, SimContainer] = {}
        self.slow_until, self.slow_s, self.down_until = 0.0, 0.0, 0.0
        self.wakes: set[asyncio.Event] = set()
        self.on_create = on_create
        self.ids = itertools.count(1)

    def _stamp(self) -> str:
        return datetime.fromtimestamp(self.clock.time(), UTC).isoformat()

    async def call(self, what: str, timeout_s: float) -> None:
        """An engine command's answer: late while slow (past its timeout: `core.run`'s error), refused at once
        while the engine is down (`Cannot connect to the Docker daemon`)."""
        now = self.clock.monotonic()
        if now < self.down_until:
            raise EngineError(f"docker {what} exited 1: Cannot connect to the Docker daemon. Is the docker daemon "
                              "running?")  # fmt: skip
        delay = self.slow_s if now < self.slow_until else 0.0
        if delay >= timeout_s:
            await self.clock.sleep(timeout_s)
            raise EngineError(f"docker {what} ... timed out after {timeout_s:g} s")
        if delay > 0:
            await self.clock.sleep(delay)

    def _wake(self) -> None:
        for wake in self.wakes:
            wake.set()

    def kill(self, container: SimContainer, code: int) -> None:
        """The container's init ends: every process of its PID namespace dies with it."""
        if not container.running:
            return
        container.status, container.exit_code, container.finished_at = "exited", code, self._stamp()
        for pid in sorted(container.inside):
            proc = self.host.procs.get(pid)
            if proc is not None and not proc.gone:  # the engine reports the exit once its namespace is reaped
                self.host._exit(proc, -9)
                proc.gone, proc.gone_at = True, self.clock.monotonic()
        self._wake()
        self.stack.notify()

    def create(self, name: str, image: str) -> SimContainer:
        from sim_node import _PIDS

        if name in self.containers:
            raise EngineError(f"docker run: the container name \"/{name}\" is already in use")
        container = SimContainer(f"sim-{self.stack.node}-c{next(self.ids)}", name, image, next(_PIDS), self._stamp())
        self.containers[name] = self.all[container.id] = container
        self.on_create(container)
        return container

    def remove(self, name: str) -> None:
        container = self.containers.pop(name, None)
        if container is not None:
            self.kill(container, 137)
            self._wake()

    def running(self) -> SimContainer | None:
        return next((c for c in self.containers.values() if c.running), None)

    def container_of(self, pid: int) -> SimContainer | None:
        return next((c for c in self.all.values() if pid in c.inside), None)


class SimEngine(ContainerEngine):
    """`ContainerEngine` over `SimEngines`: the real watch loop, `ensure_container` and its plan run on it."""

    def __init__(self, spec: ContainerSpec, engines: SimEngines) -> None:
        super().__init__(spec)
        self.engines = engines

    async def inspect_text(self) -> str | None:
        await self.engines.call("inspect", self.timeout_s)
        found = self.engines.containers.get(self.spec.name)
        return found.inspect() if found is not None else None

    async def create(self) -> str:
        await self.engines.call("run", max(self.timeout_s, 120.0))
        return self.engines.create(self.spec.name, self.spec.image).id

    async def start(self) -> None:
        await self.engines.call("start", self.timeout_s)
        found = self.engines.containers.get(self.spec.name)
        if found is None:
            raise EngineError(f"docker start {self.spec.name}: no such container")
        if not found.running:
            from sim_node import _PIDS

            found.status, found.pid, found.started_at, found.inside = "running", next(_PIDS), \
                self.engines._stamp(), set()  # fmt: skip

    async def unpause(self) -> None:
        await self.engines.call("unpause", self.timeout_s)

    async def stop(self, grace_s: float) -> None:
        await self.engines.call("stop", grace_s + self.timeout_s)
        found = self.engines.containers.get(self.spec.name)
        if found is not None:
            self.engines.kill(found, 137)

    async def kill(self, sig: str = "KILL") -> None:
        await self.stop(0.0)

    async def remove(self) -> None:
        await self.engines.call("rm", max(self.timeout_s, 60.0))
        self.engines.remove(self.spec.name)

    async def exec(self, argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout_s: float | None = None, check: bool = True) -> RunResult:  # fmt: skip
        await self.engines.call("exec", timeout_s or self.timeout_s)
        return RunResult(tuple(argv), 0, "", "")

    async def events(self, wake: asyncio.Event, statuses: frozenset[str] = frozenset()) -> None:
        """The event stream: a death sets `wake` (the watch inspects at once)."""
        self.engines.wakes.add(wake)
        try:
            await asyncio.Event().wait()
        finally:
            self.engines.wakes.discard(wake)


class SimContainerWorld:
    """`ContainerWorld` of one node: the simulated engine, /proc as its containers say, launches into them."""

    def __init__(self, engines: SimEngines) -> None:
        self.engines = engines

    def facts(self, config: Any) -> HostFacts:
        return HostFacts()  # an A2 host as the guide expects it: nothing adapts

    def engine(self, spec: ContainerSpec) -> ContainerEngine:
        return SimEngine(spec, self.engines)

    def init_alive(self, pid: int | None) -> bool:
        return pid is not None and any(c.running and c.pid == pid for c in self.engines.all.values())

    def in_container(self, container_id: str, pid: int) -> bool:
        found = self.engines.all.get(container_id)
        return found is not None and pid in found.inside

    async def launch(self, spec: LaunchSpec, container: ContainerSpec, container_id: str, log_dir: Path,
                     base_env: Mapping[str, str], capture_dir: Path, timeout_s: float, scope: str | None,
                     tail_file: Path | None, client_lost: Callable[[int], None]) -> tuple[Launched, SimWatch]:
        found = self.engines.all.get(container_id)
        if found is None or not found.running:
            raise LaunchError(f"docker exec: container {container_id[:12]} is not running")
        launched, watch = await self.engines.host.launch(spec, log_dir, base_env, capture_dir, timeout_s, scope,
                                                         tail_file)  # fmt: skip
        found.inside.add(launched.record.pid)
        return launched, watch

    def adopt(self, record: ProcessRecord, container_id: str) -> SimWatch:
        if not self.in_container(container_id, record.pid):
            raise AdoptError(f"pid {record.pid} is not a process of container {container_id[:12]}")
        return self.engines.host.adopt(record)


class SimContainers:
    """Container mode for a simulation: the config's `container:` section, each node's engine, the faults and
    the checks."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        data = sim.world.harness.data
        data["container"] = {"engine": "docker", "name": "dsv4-sim", "image": "sim/vllm-ascend:1",
                             "setup": [["true"]]}  # fmt: skip
        if "proxy" in data["components"]:
            data["components"]["proxy"]["container"] = False  # a host component: no container recovery touches it
        self.engines: dict[str, SimEngines] = {}
        self.deaths: dict[str, int] = {}
        """node → deaths (and new images) whose container was not made again yet (each licenses one create)."""
        self.images = 1
        self.kinds = frozenset(CONTAINER_FAULTS)
        self.made: dict[str, int] = {}
        sim.world.container_for = self.container_for

    def engines_of(self, stack: RealStack) -> SimEngines:
        engines = self.engines.get(stack.node)
        if engines is None:
            engines = self.engines[stack.node] = SimEngines(stack, lambda c: self.created(stack.node, c))
        return engines

    def container_for(self, stack: RealStack) -> Callable[[Supervisor], ContainerMode]:
        world = SimContainerWorld(self.engines_of(stack))
        return lambda sup: ContainerMode(sup, world=world)  # type: ignore[arg-type]

    def extra_bound(self) -> float:
        """A container that could not be made is tried again after at most this long (the engine's backoff)."""
        return RETRY_MAX_S + 2 * INSPECT_TIMEOUT_S

    # ---- invariants --------------------------------------------------------------------------------------------
    def created(self, node: str, container: SimContainer) -> None:
        first = self.made.get(node, 0) == 0
        self.made[node] = self.made.get(node, 0) + 1
        self.sim.log(f"container {container.id} made on {node}")
        if first or not self.sim.running:
            return
        if self.deaths.get(node, 0) <= 0:
            self.sim.violate("container_recreated", f"{node}: container {container.id} made while no death asked "
                             f"one ({self.made[node]} made)")  # fmt: skip
        else:
            self.deaths[node] -= 1

    def check(self) -> None:
        for node, engines in self.engines.items():
            current = engines.running()
            for container in engines.all.values():
                if container is current:
                    continue
                alive = [pid for pid in container.inside if (p := engines.host.procs.get(pid)) and not p.gone]
                if alive:
                    self.sim.violate("two_containers", f"{node}: processes {sorted(alive)} alive in container "
                                     f"{container.id} ({container.status}) beside "
                                     f"{current.id if current else 'none'}")  # fmt: skip

    def check_end(self) -> None:
        """After convergence: every node's container runs the image its file names."""
        image = self.sim.world.harness.data["container"]["image"]
        for node, engines in sorted(self.engines.items()):
            current = engines.running()
            if current is None or current.image != image:
                self.sim.violate("image_stale", f"{node}: container {current and current.id} runs "
                                 f"{current and current.image}, its file says {image}")  # fmt: skip

    # ---- faults ------------------------------------------------------------------------------------------------
    def license_inside(self, node: str, why: str) -> None:
        stack = self.sim.world.stacks[node]
        for name, comp in stack.config.active_components().items():
            if comp.container:
                self.sim.license_component(node, name, why)

    async def apply(self, event: Any, node: str) -> None:
        sim = self.sim
        stack = sim.world.stacks[node]
        engines = self.engines_of(stack)
        kind = event.kind
        if kind == "container_death":
            container = engines.running()
            if container is None:
                return sim.log(f"skip container_death on {node}: none running")
            sim.faults[kind] += 1
            self.license_inside(node, f"container death on {node}")
            self.deaths[node] = self.deaths.get(node, 0) + 1
            engines.kill(container, 137)
            return sim.log(f"container {container.id} of {node} died (exit 137)")
        if kind == "new_image":
            return self.new_image()
        now = sim.clock.monotonic()
        if kind == "engine_slow":
            sim.faults[kind] += 1
            engines.slow_until = now + event.duration
            engines.slow_s = 0.5 + (event.pick % 900) / 20.0  # 0.5–45 s (past 30 s inspect times out)
            return sim.log(f"engine on {node} answers in {engines.slow_s:.1f}s for {event.duration:.1f}s")
        if kind == "engine_fail":
            sim.faults[kind] += 1
            engines.down_until = now + event.duration
            return sim.log(f"engine on {node} answers nothing for {event.duration:.1f}s")
        raise ValueError(f"unknown container fault {kind!r}")

    def new_image(self) -> None:
        """The operator installs a file with a new image on every node and reloads each agent that answers
        (`nodeagentctl reload`: the planned recreate — drain, stop what runs inside, recreate, set up, start); a
        node without an agent takes it at its next agent's start. Each node's container is made once for it."""
        sim = self.sim
        sim.faults["new_image"] += 1
        self.images += 1
        image = sim.world.harness.data["container"]["image"] = f"sim/vllm-ascend:{self.images}"
        sim.write_files()
        sim.log(f"operator: new image {image} in every node's file")
        for node in sim.layout.nodes:
            self.deaths[node] = self.deaths.get(node, 0) + 1
            self.license_inside(node, f"new image {image} on {node}")
            agent = sim.world.agents.get(node)
            stack = sim.world.stacks[node]
            if agent is None or stack.supervisor is None:
                sim.log(f"operator: reload on {node}: no agent answers")
                continue
            config = sim.world.config(node)
            try:
                answer = stack.supervisor.reload(config)
            except ValueError as exc:
                answer = {"refused": str(exc)}
            else:
                agent.membership.update_config(config)
            sim.log(f"operator: reload on {node}: {answer}")

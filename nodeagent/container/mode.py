"""Container mode: the stack inside the node's container (the guide's vllm-ascend image), supervised from the host.

The agent stays on the host and drives the engine's `exec` (docs/architecture.md, "Container mode", has the
measurements behind that choice). `ContainerMode` is hooked in at one place, where the supervisor builds its
components: a component that runs inside gets `InContainerHost` (the supervisor, with its launches going through
`container_exec`), one with `container: false` the supervisor itself.

Lifecycle (`nodeagent.container.plan` decides, `nodeagent.container.engine` carries out): create the container when it
is absent, start it when it is stopped, run `setup` once per new container (its output in the `container` log,
a failure naming the step holds the stack and is retried from that step), and a changed image, run line or setup
list is a planned recreate: the components inside are drained and stopped first. The watch (the engine's
events plus a 1 s inspect) notices a death within ~1 s; a component that died with its container is recognised at
once (its init is exiting). A death is the guide's recovery: a post-mortem with the exit status and the engine's
`inspect`, a node redeploy counted by the restart policy, the container recreated and set up again, and the
components inside held until it is (a `NodeLayer` gate, `HoldKind.CONTAINER`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodeagent.config.container_options import ContainerRenderError
from nodeagent.container.engine import EngineError, RecordStore, ensure_container
from nodeagent.container.plan import ContainerState, SetupStepFailed, Step, setup_hash
from nodeagent.container.render import container_spec, shared_folders
from nodeagent.container.world import ContainerWorld, HostContainerWorld
from nodeagent.core import logsink
from nodeagent.core.errors import AdoptError, LaunchError
from nodeagent.node.blast_radius import Blast
from nodeagent.node.residue_plan import RemoveShmSegments, ResiduePlan
from nodeagent.probes.resolve import ResolvedProbe
from nodeagent.render.caches import container_parts, parse_versions, versions_argv
from nodeagent.seam.policy import RestartDecision
from nodeagent.seam.stackport import ComponentView, Delegated, Hold, HoldKind, MemberReport

if TYPE_CHECKING:
    from nodeagent.container.port import ContainerNode, NodeHost
    from nodeagent.core.failure import Failure
    from nodeagent.core.process import ProcessRecord
    from nodeagent.node.component import Component, ComponentHost
    from nodeagent.node.launcher import Launched
    from nodeagent.node.nodeworld import Watch
    from nodeagent.render.launch import LaunchSpec
    from nodeagent.seam.host import Process

RETRY_MIN_S = 5.0
RETRY_MAX_S = 120.0
START_ENGINE_WAIT_S = 60.0
"""How long an agent's start waits for an engine that does not answer before it gives its container up for
unknown: the previous agent's ranks may run inside, and taking "no answer" for "no container" made them look dead
(a new start beside them, their group restarted: simulation seeds 880505, 875065)."""
START_ENGINE_RETRY_S = 2.0
LOG_NAME = "container"
"""The log identifier of the container's own lines (setup output, lifecycle): `nodeagentctl logs container`."""


class ContainerMode:
    """The node's container: its lifecycle and watch, the gate of the components inside, their launches."""

    def __init__(self, sup: ContainerNode, world: ContainerWorld | None = None) -> None:
        self.sup = sup
        self.world: ContainerWorld = world or HostContainerWorld()
        """The engine, /proc and the exec client (`container.world`; the host by default)."""
        assert sup.config.container is not None
        self.section = sup.config.container
        try:
            self.facts = self.world.facts(sup.config)
            """Read once, at the agent's start (a reload renders against the same facts: restart the agent after
            installing the driver or runc on the host)."""
            self.spec = container_spec(sup.config, os.environ, facts=self.facts)
        except ContainerRenderError as exc:
            raise LaunchError(str(exc)) from None
        self.engine = self.world.engine(self.spec)
        self.records = RecordStore(sup.config.agent.state_dir)
        self.state: ContainerState | None = None
        self.problem: Hold | None = Hold(HoldKind.CONTAINER, f"container {self.spec.name}: not checked yet")
        self.deaths = 0
        self.last_death: dict[str, Any] | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._recreating = False
        """A planned recreate is draining: nothing more is adopted into the old container."""
        self._reconfigured = asyncio.Event()
        self._versions: dict[tuple[str, str], dict[str, str | None]] = {}
        """(container ID, a rank's command) → the versions its interpreter imports, read once per container."""

    # ---- where the supervisor hooks it in -------------------------------------------------------------------
    def host(self, cfg: Any) -> ComponentHost:
        """The host of a component: `InContainerHost` when it runs inside, else the supervisor."""
        return InContainerHost(self.sup, self) if cfg.container else self.sup

    def runs_inside(self, name: str) -> bool:
        comp = self.sup.components.get(name)
        return comp is not None and isinstance(comp.host, InContainerHost)

    def where(self, name: str) -> str:
        """Where a component runs, for its stack run (`intent.stack_identity`): the host, or which container (the
        one up, else the one the last agent kept)."""
        if not self.runs_inside(name):
            return "host"
        cid = self.state.id if self.state is not None else getattr(self.records.load(), "container_id", "")
        return f"container {cid[:12]}"

    async def read_versions(self, command: str) -> str | None:
        """Read what `command`'s interpreter imports (vLLM, vllm-ascend, torch, ...) inside the container up now,
        once per container (its setup may have installed them: one exec, ~0.2 s, before the first launch of that
        command in it); None, or why they are unknown (tried again at the next launch)."""
        if self.state is None or self.problem is not None:
            return "the container is not up"
        if (self.state.id, command) in self._versions:
            return None
        try:
            result = await self.engine.exec(versions_argv(command), timeout_s=60.0)
            self._versions[(self.state.id, command)] = parse_versions(result.stdout)
        except (EngineError, ValueError) as exc:
            return f"the versions {command} imports in the container could not be read: {exc}"
        return None

    def cache_parts(self, command: str) -> dict[str, str] | None:
        """The compile caches' key of a rank inside: the image's ID, the setup list and the versions its command
        imports there (`render.caches.container_parts`); None until `read_versions` read them."""
        if self.state is None:
            return None
        return container_parts(self.spec.image, self.state.image_id, setup_hash(self.section.setup),
                               self._versions.get((self.state.id, command)))  # fmt: skip

    @property
    def container_id(self) -> str:
        if self.state is None or self.problem is not None:
            raise LaunchError(f"container {self.spec.name} is not up: "
                              f"{self.problem.reason if self.problem else 'not checked yet'}")
        return self.state.id

    # ---- launches (called by the supervisor with inside=self) -----------------------------------------------
    async def launch(self, spec: LaunchSpec, log_dir: Path, base_env: Any, capture_dir: Path, timeout_s: float,
                     scope: str | None, tail_file: Path | None) -> tuple[Launched, Watch]:  # fmt: skip
        cid = self.container_id
        launched: list[Launched] = []

        def client_lost(client_pid: int) -> None:
            pid = launched[0].record.pid if launched else "?"
            self.sup.events.emit("exec_client_lost", f"the {self.spec.engine} exec client (pid {client_pid}) died; "
                                 f"pid {pid} runs on inside, still supervised by its host PID; its output is lost "
                                 "until its next start", spec.component, "warning")  # fmt: skip

        done, watch = await self.world.launch(spec, self.spec, cid, log_dir, base_env, capture_dir, timeout_s, scope,
                                              tail_file, client_lost)  # fmt: skip
        launched.append(done)
        return done, watch

    def adopt(self, record: ProcessRecord) -> Watch:
        if self._recreating:
            raise AdoptError(f"container {self.spec.name} is being recreated")
        return self.world.adopt(record, self.state.id if self.state is not None else "")

    def member(self, pid: int) -> bool:
        """May this PID be signalled on behalf of a component inside? Only a process of our container."""
        return self.state is not None and self.world.in_container(self.state.id, pid)

    def adapt_plan(self, name: str, plan: ResiduePlan) -> ResiduePlan:
        """Residue inside: /dev/shm of a component inside is the container's own (reached through its init's
        root), and none is left to sweep while the container is down (a new one starts with an empty one)."""
        if not self.runs_inside(name):
            return plan
        pid = self.state.pid if self.state is not None and self.problem is None else None
        actions = []
        for action in plan.actions:
            if isinstance(action, RemoveShmSegments):
                if pid is None or not self.world.init_alive(pid):
                    continue
                action = replace(action, shm_dir=Path(f"/proc/{pid}/root") / action.shm_dir.relative_to("/"),
                                 seen_as=action.shm_dir)  # fmt: skip
            actions.append(action)
        return replace(plan, actions=tuple(actions))

    def adapt_probes(self, name: str, probes: dict[str, list[ResolvedProbe]]) -> dict[str, list[ResolvedProbe]]:
        """The commands probes run (exec, the datasystem KV round trip) run where their component runs: the
        guide's scripts and the datasystem wheel are in the image, not on the host. The KV probe's interpreter is
        the container's `python3` unless the probe names one (the host's lookup beside dscli means nothing in
        here). HTTP, TCP, file and etcd probes reach the component from the host, as before (`--net=host`,
        shared folders)."""
        if not self.runs_inside(name):
            return probes
        out: dict[str, list[ResolvedProbe]] = {}
        for role, resolved in probes.items():
            out[role] = []
            for probe in resolved:
                if probe.kind == "exec":
                    probe = replace(probe, inside=self.spec)
                elif probe.kind == "datasystem_kv":
                    python = str(getattr(probe.spec, "python", None) or "python3")
                    probe = replace(probe, inside=self.spec, python=python)
                out[role].append(probe)
        return out

    # ---- NodeLayer: the gate of the components inside --------------------------------------------------------
    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        return self.problem if self.runs_inside(comp.name) else None

    def decide(self, comp: ComponentView, failure: Failure) -> RestartDecision | Delegated | None:
        """A component inside that died with the container: the container's recovery restarts it."""
        if not self.runs_inside(comp.name) or self.state is None or self.world.init_alive(self.state.pid):
            return None
        self._lost(f"its init (pid {self.state.pid}) is gone")
        return Delegated(f"the container {self.spec.name} died with it: recreate, setup, node redeploy")

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> str | None:
        return None

    def status_section(self) -> dict[str, Any]:
        return {"container": self.status()}

    def member_report(self) -> MemberReport | None:
        return None

    def on_node_change(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        state, record = self.state, self.records.load()
        return {
            "engine": self.spec.engine, "name": self.spec.name, "image": self.spec.image,
            "id": state.id[:12] if state else None, "status": state.status if state else None,
            "up_since": state.started_at if state else None, "pid": state.pid if state else None,
            "up": self.problem is None, "held": self.problem.reason if self.problem else None,
            "components": sorted(n for n in self.sup.components if self.runs_inside(n)),
            "setup": {"steps": len(self.section.setup), "done": record.setup_done if record else 0},
            "on_stop": self.section.on_stop, "deaths": self.deaths, "last_death": self.last_death,
            "adapted": [a.text for a in self.spec.adaptations],
        }  # fmt: skip

    def reconfigure(self, config: Any, apply: bool = True) -> str | None:
        """A reloaded config: the new run line, image or setup takes effect as at a start — a planned recreate
        (drain, stop the stack inside, recreate, set up, start) — without an agent restart. What changed, or None.
        Raises ValueError for what a reload cannot do (render errors; a component moving in or out); `apply`
        False checks only (a rollout's staging leaves the container as it is)."""
        assert config.container is not None
        moved = [n for n, c in config.active_components().items()
                 if n in self.sup.components and bool(c.container) != self.runs_inside(n)]  # fmt: skip
        if moved:
            raise ValueError(f"reload cannot move {', '.join(moved)} into or out of the container: restart the agent")
        spec, what = self._differences(config)
        if not apply:
            return None
        self.section, self.spec = config.container, spec
        self.engine = self.world.engine(spec)
        if what is None or not self.started:
            return None  # (not started: the container is made, or kept, as this spec says when it starts)
        # held from now, not from when the watch loop gets to it: a component inside must not start in the old
        # container in between (a rollout's rank, released by the generation, did so)
        self._hold(f"container {self.spec.name}: recreating ({what} changed)")
        self._reconfigured.set()
        return what

    @property
    def started(self) -> bool:
        """`start` ran: the container was looked at and is kept from now (a new spec is a recreate)."""
        return self._wake is not None

    def pending(self, config: Any) -> str | None:
        """What of `config`'s container differs from the container kept (a rollout staged a new image), or None."""
        try:
            return self._differences(config)[1] if config.container is not None else None
        except ValueError:
            return None

    def _differences(self, config: Any) -> tuple[Any, str | None]:
        try:
            spec = container_spec(config, os.environ, facts=self.facts)
        except ContainerRenderError as exc:
            raise ValueError(f"container: {exc}") from None
        what = [w for w, differs in (("the run line", spec.fingerprint() != self.spec.fingerprint()),
                                     ("the setup steps", list(config.container.setup) != list(self.section.setup)))
                if differs]  # fmt: skip
        return spec, " and ".join(what) or None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Keep the container (call before the supervisor starts its components; the agent attaches it as a layer)."""
        self._wake = asyncio.Event()
        found = await self._inspect_at_start()  # the container of a previous agent: its components are adopted
        record = self.records.load()
        if found is not None and found.running and record is not None and record.container_id == found.id:
            self.state = found
        for note in (*self.spec.adaptations, *self.spec.problems):
            self.sup.events.emit("container_adapted", f"container {self.spec.name}: {note.text}", None,
                                 "error" if note in self.spec.problems else "info")  # fmt: skip
        # a bind mount's source must exist before the run line: the agent's folders (the guide's shared folders
        # this host lacks are made before each run line: `container._create`)
        for folder in shared_folders(self.sup.config):
            with contextlib.suppress(OSError):
                folder.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run(), name="container")

    async def _inspect_at_start(self) -> ContainerState | None:
        """The container as the engine sees it; an engine that does not answer is asked again for up to
        `START_ENGINE_WAIT_S` (said once), then the container is taken as not there, as before."""
        waited_from, said = self.sup.clock.monotonic(), False
        while True:
            try:
                return await self.engine.inspect()
            except EngineError as exc:
                if self.sup.clock.monotonic() - waited_from >= START_ENGINE_WAIT_S:
                    self._say(f"container {self.spec.name}: the engine did not answer for {START_ENGINE_WAIT_S:g}s "
                              f"at the agent's start ({exc}): taken as not there")  # fmt: skip
                    return None
                if not said:
                    said = True
                    self._say(f"container {self.spec.name}: the engine does not answer at the agent's start ({exc}):"
                              f" asking again for up to {START_ENGINE_WAIT_S:g}s before adopting anything")  # fmt: skip
            await self.sup.clock.sleep(START_ENGINE_RETRY_S)

    async def stop_watching(self) -> None:
        """The agent stops: no recovery from now on (stopping the stack must not look like a death)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def finish(self, detach: bool) -> None:
        """After the components stopped: stop, remove or keep the container (`container.on_stop`); a detach
        keeps it running for the next agent."""
        if detach or self.section.on_stop == "keep":
            return
        try:
            if self.section.on_stop == "remove":
                await self.engine.remove()
            else:
                await self.engine.stop(self.section.stop_timeout_s)
                self._mark_stopped()
            self._log(f"container {self.spec.name}: {self.section.on_stop} on agent stop"
                      + (" (it shows `Exited (137)`: its bash entrypoint ignores SIGTERM, so the engine kills it "
                         "after stop_timeout_s; no crash, the next agent starts it again)"
                         if self.section.on_stop == "stop" else ""))  # fmt: skip
        except EngineError as exc:
            self.sup.events.emit("container_failed", f"cannot {self.section.on_stop} the container: {exc}",
                                 None, "error")  # fmt: skip

    def _mark_stopped(self) -> None:
        """Recorded, so that the next agent reads the stopped container as stopped by us, not as a death."""
        record = self.records.load()
        if record is not None:
            when = datetime.now(UTC).isoformat(timespec="seconds")
            with contextlib.suppress(OSError):
                self.records.save(replace(record, stopped_by_agent=when))

    async def _run(self) -> None:
        delay, redeployed = RETRY_MIN_S, False
        while True:
            try:
                state, plan = await ensure_container(self.engine, self.section.setup, self.records, self._log,
                                                     self._drain)  # fmt: skip
            except (SetupStepFailed, EngineError) as exc:
                kind = "container_setup_failed" if isinstance(exc, SetupStepFailed) else "container_failed"
                self._hold(f"{exc}; retrying in {delay:.0f} s", resolves_itself=not isinstance(exc, SetupStepFailed))
                self.sup.events.emit(kind, str(exc), None, "error")
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            delay, self._recreating = RETRY_MIN_S, False
            self.state, self.problem = state, None
            self.sup.events.emit("container_up", f"container {self.spec.name} {state.id[:12]} up ({plan.reason})")
            if Step.CREATE in plan.steps:  # a new container: a new stack run of what runs inside
                self.sup.begin_stack_run(self.sup.blast(Blast.CONTAINER))
            self.sup.wake()
            self.sup.on_state(None)
            if plan.redeploy and not redeployed:
                self._redeploy(f"container {plan.reason}")
            redeployed = False
            alive = functools.partial(self.world.init_alive, state.pid)
            watch = asyncio.create_task(self.engine.watch(state.id, state.started_at, wake=self._wake,
                                                          clock=self.sup.clock.monotonic, init_alive=alive))
            changed = asyncio.create_task(self._reconfigured.wait())
            try:
                await asyncio.wait({watch, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when this task is cancelled: asyncio.wait leaves its tasks (and `podman events`) running
                changed.cancel()
                if not watch.done():
                    watch.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watch
            if watch.cancelled():  # a reload changed the container: plan again (a planned recreate)
                self._reconfigured.clear()
                continue
            death = watch.result()
            self._lost(death.detail)
            self.deaths += 1
            at = self.sup.clock.time()
            self.last_death = {"at": at, "kind": death.kind, "detail": death.detail,
                               "exit_code": death.state.exit_code if death.state else None,
                               "oom_killed": death.state.oom_killed if death.state else False}  # fmt: skip
            inspect = None
            with contextlib.suppress(EngineError):
                inspect = await self.engine.inspect_text()
            self.sup.postmortems.container_death(self.spec.name, {"what": "container", **self.last_death},
                                                 inspect, at)  # fmt: skip
            self._redeploy(f"container {death.kind}: {death.detail}")
            redeployed = True

    def _lost(self, why: str) -> None:
        if self.problem is None:
            self.sup.events.emit("container_died", f"container {self.spec.name}: {why}", None, "error")
        self._hold(f"container {self.spec.name} died ({why}): recreating")
        if self._wake is not None:
            self._wake.set()

    def _hold(self, reason: str, resolves_itself: bool = True) -> None:
        self.problem = Hold(HoldKind.CONTAINER, reason, resolves_itself=resolves_itself)
        self.sup.on_state(None)

    def _redeploy(self, reason: str) -> None:
        """The guide's recovery of what ran inside — never a host component (`blast_radius`: host etcd keeps
        running) — asked of the node, which counts it as a node redeploy (it may turn the node `failed`)."""
        inside = self.sup.blast(Blast.CONTAINER)
        decision = self.sup.redeploy(inside, reason)
        level = "critical" if decision.action == "failed" else "warning"
        self.sup.events.emit("container_redeploy", f"{reason}: node redeploy of {', '.join(inside) or 'nothing'}; "
                             f"{decision.reason}", None, level)  # fmt: skip

    async def _drain(self, reason: str) -> None:
        """Before a planned recreate: hold the components inside, drain and stop them."""
        self._recreating = True
        self._hold(f"container {self.spec.name}: recreating ({reason})")
        for name in reversed(self.sup.blast(Blast.CONTAINER)):  # reverse order, as the stack stops: vLLM first
            if self.sup.components[name].running:
                self.sup.restart([name], f"container recreate: {reason}", planned=True, cause="reload")
                await self.sup.wait(name, "stopped")

    def _say(self, line: str) -> None:
        self._log(line)
        self.sup.events.emit("container_engine", line, None, "warning")

    def _log(self, line: str) -> None:
        with contextlib.suppress(OSError):
            logsink.append_text(LOG_NAME, self.sup.config.agent.log_dir, line.rstrip("\n") + "\n")


class InContainerHost:
    """The supervisor as the host of a component inside the container: launches, adoption and stops go through
    the container (`inside=`); the rest of `component.ComponentHost` is the supervisor's own, forwarded by name
    (no `__getattr__`: what a component may ask of its host stays the Protocol's list)."""

    def __init__(self, sup: NodeHost, mode: ContainerMode) -> None:
        self._sup, self._mode = sup, mode
        self.events, self.clock = sup.events, sup.clock

    async def prepare(self, comp: Component) -> None:
        await self._sup.prepare(comp, inside=self._mode)

    async def launch(self, comp: Component) -> Process:
        return await self._sup.launch(comp, inside=self._mode)

    async def adopt(self, comp: Component, record: ProcessRecord) -> Process:
        return await self._sup.adopt(comp, record, inside=self._mode)

    async def terminate(self, comp: Component, proc: Process, why: str) -> dict[str, Any]:
        return await self._sup.terminate(comp, proc, why, inside=self._mode)

    def start_gate(self, comp: Component, operator: bool) -> Hold | None:
        return self._sup.start_gate(comp, operator)

    def gate_waiters(self, comp: Component) -> list[Awaitable[Any]]:
        return self._sup.gate_waiters(comp)

    def output_tail(self, comp: Component, proc: Process) -> tuple[str, ...]:
        return self._sup.output_tail(comp, proc)

    def drain_timeout(self, comp: Component) -> float | None:
        return self._sup.drain_timeout(comp)

    async def inflight(self, comp: Component) -> tuple[int, int] | None:
        return await self._sup.inflight(comp)

    def decide(self, comp: Component, failure: Failure) -> RestartDecision | None:
        return self._sup.decide(comp, failure)

    def capture(self, comp: Component, failure: Failure) -> Any:
        return self._sup.capture(comp, failure)

    def archive(self, comp: Component, failure: Failure, evidence: Any, tree: Any,
                decision: RestartDecision | None) -> None:  # fmt: skip
        self._sup.archive(comp, failure, evidence, tree, decision)

    def request_redeploy(self, reason: str, components: Sequence[str] | None = None) -> bool:
        return self._sup.request_redeploy(reason, components)

    def blast(self, blast: Blast, origin: str | None = None) -> tuple[str, ...]:
        return self._sup.blast(blast, origin)

    def on_process(self, comp: Component) -> None:
        self._sup.on_process(comp)

    def on_up(self, comp: Component) -> None:
        self._sup.on_up(comp)

    def on_going_down(self, comp: Component) -> None:
        self._sup.on_going_down(comp)

    def on_state(self, comp: Component) -> None:
        self._sup.on_state(comp)

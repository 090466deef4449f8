"""A failure's post-mortem, as the supervisor takes it: `capture` on the crash path (in memory, before anything
is stopped or cleaned), `archive` off it (the bundle is written in the background by `postmortem.write_bundle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nodeagent.core import logsink
from nodeagent.core.postmortem import LOG_RANGE_MAX, Evidence, write_bundle
from nodeagent.core.states import State
from nodeagent.node import residue_plan
from nodeagent.npu.tools import npu_info_text
from nodeagent.vllm.start_phases import died_in

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.core.events import EventBus
    from nodeagent.core.failure import Failure
    from nodeagent.node.component import Component
    from nodeagent.seam.policy import RestartDecision

EVENTS_KEPT = 40


class PostMortems:
    """Takes what it reads as callables: the current config (it changes on a reload) and the NPU monitor's view
    (None where none runs); `spawn` keeps a background task alive until the agent stops."""

    def __init__(self, config: Callable[[], Config], events: EventBus, spawn: Callable[[Any], None],
                 npu_status: Callable[[], dict[str, Any] | None]) -> None:  # fmt: skip
        self._config = config
        self.events = events
        self._spawn = spawn
        self._npu_status = npu_status

    def capture(self, comp: Component, failure: Failure, tail: tuple[str, ...], at: float) -> Evidence:
        """The in-memory part of the post-mortem, before anything is stopped or cleaned (no file reads)."""
        command: dict[str, Any] = {}
        with contextlib.suppress(TypeError, ValueError):
            command = json.loads(comp.fingerprint or "{}")
        log_file = logsink.log_path(self._config().agent.log_dir, comp.name)
        log_range = None
        start = comp.proc.extra.get("log_offset") if comp.proc is not None else None
        if start is not None:
            with contextlib.suppress(OSError):
                log_range = (int(start), log_file.stat().st_size)
        metrics = None
        if comp.prober is not None:
            for states in comp.prober.states.values():
                for state in states:
                    metrics = getattr(state, "last_metrics", None) or metrics
        events = [e.to_dict() for e in self.events.recent if e.component == comp.name][-EVENTS_KEPT:]
        own = residue_plan.own_log_files(comp.name, comp.cfg, self._config())
        return Evidence(
            component=comp.name, kind=comp.kind, at=at, failure=failure.to_dict(),
            probes=comp.prober.snapshot() if comp.prober is not None else {}, events=events, command=command,
            log_file=str(log_file), log_range=log_range, output_tail=list(tail), metrics=metrics,
            npu=self._npu_status(),
            core_dirs=[command["cwd"]] if command.get("cwd") else [],
            extra_files=[str(own[0].parent)] if own else [],
            start_phase={"started_at": comp.started_at} if comp.kind == "vllm" and comp.state == State.STARTING
            else None,
        )  # fmt: skip

    def archive(self, name: str, failure: Failure, evidence: Evidence | None, tree: Any,
                decision: RestartDecision | None, delegated: str | None = None) -> None:  # fmt: skip
        """Complete the evidence with the stop's tree, the decision (`delegated`: what a layer does instead, the
        gang restart) and the events since the capture (what was decided), and write the bundle in the background."""
        if evidence is None:
            return
        evidence.failure = failure.to_dict()
        evidence.tree = list(tree or [])
        evidence.decision = delegated or ("no automatic action" if decision is None else (
            f"{decision.action} in {decision.delay_s:.0f}s: {decision.reason}"))  # fmt: skip
        evidence.events = [e.to_dict() for e in self.events.recent if e.component == name][-EVENTS_KEPT:]
        self._spawn(asyncio.create_task(self._write(name, evidence), name=f"postmortem:{name}"))

    def container_death(self, name: str, failure: dict[str, Any], inspect: str | None, at: float) -> None:
        """The node's container died: its exit status and the engine's `inspect` of it (taken before it is
        removed), with the agent's recent events, in a bundle of its own (`postmortem/container/`)."""
        events = [e.to_dict() for e in self.events.recent][-EVENTS_KEPT:]
        evidence = Evidence(component=name, kind="container", at=at, failure=failure, events=events,
                            decision="recreate the container, run its setup, node redeploy",
                            texts={"inspect.json": inspect} if inspect else {})  # fmt: skip
        self._spawn(asyncio.create_task(self._write("container", evidence), name="postmortem:container"))

    async def _write(self, name: str, evidence: Evidence) -> None:
        try:
            config = self._config()
            npu_text = await npu_info_text(config.node.npu_health.npu_smi)
            agent = config.agent
            if evidence.start_phase is not None:
                evidence.start_phase = await asyncio.to_thread(start_phase, evidence)
            path = await write_bundle(evidence, agent.state_dir / "postmortem" / name, agent.archive_keep, npu_text)
        except Exception as exc:  # evidence is best effort: it must never take the agent down
            self.events.emit("postmortem_failed", f"cannot write the post-mortem: {exc}", name, "warning")
            return
        died = f" (its start died in {evidence.start_phase['died_in']})" if evidence.start_phase else ""
        self.events.emit("postmortem", f"post-mortem {path.stem.removesuffix('.tar')} written{died}", name,
                         path=str(path))


def start_phase(evidence: Evidence) -> dict[str, Any]:
    """The phase a vLLM start died in, from the failed run's output (its log range from the start: the phases
    are at its beginning), else the tail the crash path kept."""
    lines = list(evidence.output_tail)
    if evidence.log_file and evidence.log_range:
        start, end = evidence.log_range
        with contextlib.suppress(OSError), open(evidence.log_file, "rb") as fh:
            fh.seek(start)
            lines = fh.read(max(0, min(end - start, LOG_RANGE_MAX))).decode(errors="replace").splitlines()
    return died_in(lines, float((evidence.start_phase or {}).get("started_at") or 0.0))

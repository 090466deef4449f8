"""Every phase of this node's vLLM starts (issue 32 item 1): each rank's output read as it loads
(`vllm.start_phases`), the phase a loading rank is in and the time left per phase from its own history, the
history kept (`state_dir/start_phases.json`, the last `LOADS_KEPT` starts per phase) and each completed start's
phases handed to the observers (`/metrics`: `dsv4_agent_vllm_start_phase_seconds`).

Reads the component's log file from this launch's offset, or under journald the log relay's copy of the run's start
lines (`logsink.start_lines`: the agent never reads the journal). A start is recorded only if it was seen loading:
an adopted process's start was not ours to time (outside journald its lines are not even read).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.core import logsink
from nodeagent.core.loadtime import LOADS_KEPT, remember
from nodeagent.core.statefile import read_json, write_json_atomic
from nodeagent.core.states import State
from nodeagent.core.task_owner import log_death
from nodeagent.render.launch import component_dir
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import ReportLayer
from nodeagent.vllm.start_phases import PHASES, StartPhases

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.seam.stackport import ComponentView, StackPort

PERIOD_S = 0.5
HISTORY_FILE = "start_phases.json"
READ_MAX = 4 * 1024 * 1024
"""At most this much new output per read: a rank that floods its log must not stall the loop."""


@dataclass
class _Run:
    phases: StartPhases
    offset: int
    recorded: bool = False
    first_token: bool = False
    seen_loading: bool = False


def _human(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class StartPhaseWatch(ReportLayer):
    """A report-only `NodeLayer`: /status → `start_phases`; `observers(component, phase, seconds)` per phase of
    every start that came up."""

    def __init__(self, port: StackPort, clock: Clock | None = None) -> None:
        self.port = port
        self.clock = clock or Clock()
        self.runs: dict[str, _Run] = {}
        self.observers: list[Callable[[str, str, float], None]] = []
        self.task: asyncio.Task[None] | None = None
        raw = read_json(self.path, {})
        self.history: dict[str, dict[str, list[float]]] = {
            str(c): {str(p): [float(x) for x in v if isinstance(x, int | float)][-LOADS_KEPT:]
                     for p, v in phases.items() if p in PHASES and isinstance(v, list)}
            for c, phases in (raw.items() if isinstance(raw, dict) else ()) if isinstance(phases, dict)
        }  # fmt: skip

    @property
    def config(self) -> Config:
        return self.port.config

    @property
    def path(self) -> Path:
        return self.config.agent.state_dir / HISTORY_FILE

    def vllm_components(self) -> list[str]:
        return [n for n, c in self.config.active_components().items() if c.kind == "vllm"]

    def read_new(self, component: str, run: _Run) -> list[str]:
        path, _ = logsink.start_lines(self.config.agent.log_dir, component_dir(self.config, component), component)
        try:
            size = path.stat().st_size
        except OSError:
            return []
        if size < run.offset:
            run.offset = 0  # rotated (copytruncate)
        if size == run.offset:
            return []
        with path.open("rb") as f:
            f.seek(run.offset)
            data = f.read(min(size - run.offset, READ_MAX))
        end = data.rfind(b"\n") + 1  # a line still being written waits for its end
        run.offset += end
        return data[:end].decode(errors="replace").splitlines()

    def poll(self, name: str, lines: list[str] | None = None) -> None:
        """One look at a component: a new launch starts a new run; its new lines; its ready and first token."""
        view = self.port.component(name)
        run = self.runs.get(name)
        _, from_start = logsink.start_lines(self.config.agent.log_dir, component_dir(self.config, name), name)
        offset = 0 if from_start else view.log_offset
        if view.started_at is not None and offset is not None and (
                run is None or run.phases.started_at != view.started_at):  # fmt: skip
            run = self.runs[name] = _Run(StartPhases(view.started_at), offset)
        if run is None or (view.started_at is not None and run.phases.started_at != view.started_at):
            return  # not ours to watch (journald, adopted): an older run's phases would be wrong for it
        now = self.clock.time()
        for line in self.read_new(name, run) if lines is None else lines:
            run.phases.feed(line, now)
        run.seen_loading = run.seen_loading or view.loading or view.log_offset is not None  # an offset: launched by us
        if view.up and run.seen_loading and not run.recorded and view.last_load_s is not None and view.started_at:
            run.phases.mark("ready", max(view.started_at + view.last_load_s, *run.phases.shared.ended.values(),
                                         *(t for r in run.phases.ranks.values() for t in r.ended.values())))
            run.recorded = True
            self.record(name, {p: s for p, s in run.phases.seconds().items() if p != "first_token"})
        first = run.phases.seconds().get("first_token")
        if run.recorded and not run.first_token and first is not None:
            run.first_token = True
            self.record(name, {"first_token": first})

    def record(self, name: str, seconds: dict[str, float]) -> None:
        mine = self.history.setdefault(name, {})
        for phase, s in seconds.items():
            mine[phase] = remember(mine.get(phase, []), s)
            for observe in self.observers:
                try:
                    observe(name, phase, s)
                except Exception as exc:  # an observer's bug must not stop the watch
                    logger.opt(exception=exc).error(f"start-phase observer failed for {name}")
        with contextlib.suppress(OSError):
            write_json_atomic(self.path, self.history, durable=False)

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self.run(), name="start-phases")
            self.task.add_done_callback(log_death)

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def run(self) -> None:
        while True:
            for name in self.vllm_components():
                try:
                    self.poll(name, await asyncio.to_thread(self._read_for, name))
                except (OSError, KeyError):
                    pass
                except Exception as exc:  # a bug here must not end the watch of every later start
                    logger.opt(exception=exc).error(f"start phases of {name}: {type(exc).__name__}: {exc}")
            await self.clock.sleep(PERIOD_S)

    def _read_for(self, name: str) -> list[str] | None:
        """The new lines of the run `poll` will see (None: the run changes, `poll` reads from its offset)."""
        view = self.port.component(name)
        run = self.runs.get(name)
        if run is None or view.started_at is None or run.phases.started_at != view.started_at:
            return None
        return self.read_new(name, run)

    # ---- what it shows -----------------------------------------------------------------------------------------
    def status_section(self) -> dict[str, Any]:
        out = {}
        for name in self.vllm_components():
            with contextlib.suppress(KeyError):
                shown = self.status_of(name, self.port.component(name))
                if shown:
                    out[name] = shown
        return {"start_phases": out}

    def status_of(self, name: str, view: ComponentView) -> dict[str, Any]:
        history = self.history.get(name, {})
        expected = {p: float(statistics.median(v)) for p, v in history.items() if v}
        out: dict[str, Any] = {"expected_s": {p: expected[p] for p in PHASES if p in expected}}
        run = self.runs.get(name)
        if run is None or run.phases.started_at != view.started_at:
            return out if expected else {}
        out["run"] = run.phases.to_dict()
        if view.state != State.STARTING or run.recorded:
            return out
        seen = tuple(p for p in PHASES if p in expected) or PHASES
        phase = run.phases.current(seen)
        if phase is None:
            return out
        now = self.clock.time()
        into = run.phases.since_last(now)
        usual = expected.get(phase)
        later = [expected[p] for p in PHASES[PHASES.index(phase) + 1:] if p in expected and p != "first_token"]
        out.update(phase=phase, in_phase_s=round(into, 1), phase_expected_s=usual,
                   phase_left_s=None if usual is None else round(max(0.0, usual - into), 1),
                   left_s=None if usual is None else round(max(0.0, usual - into) + sum(later), 1))  # fmt: skip
        if usual is None:
            out["note"] = f"{phase} for {_human(into)} (no history of it here)"
        elif into <= usual:
            out["note"] = f"{phase}: about {_human(usual - into)} left of it (usually {_human(usual)})"
        else:
            out["note"] = f"{phase} for {_human(into)}, longer than usual ({_human(usual)})"
        return out

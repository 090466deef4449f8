"""The ladder past a node redeploy, carried out: chip resets and node isolation (`ladder.py` decides).

A `stackport.NodeLayer` of the node, like the start guards: it holds every NPU user's start while a reset runs
(`npu_reset`) and while the node is isolated (`isolated`), notes each failed node redeploy's cause, and runs one
loop: on every NPU change (and every `TICK_S`: a RestartBusiness fault acts once it lasted 60 s) it asks
`LadderState.decide` and carries out the rung — `reset_plan`'s steps, each an event and a line of /status, the
whole rung a post-mortem bundle (`postmortem/node/`); isolation until `uncordon`. The cluster layer learns of
both through `NodeView.recovery`: `cluster/recovery.py` drains the groups, the member record says `isolated`, the
PD proxy drops the groups. What it needs of the node is the port, a `changed` callback (tell the layers) and the
redeploy times; of the NPUs the monitor (`faults`, `poll()`, `tools.reset`, `on_change`, `status()`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from loguru import logger

from nodeagent.config.layout import cluster_layout
from nodeagent.core.statefile import read_json, write_json_atomic
from nodeagent.layers.reset_ladder import (
    ChipReset,
    Isolate,
    LadderPolicy,
    Step,
    external_resetter,
    reset_plan,
    state_from_dict,
    state_to_dict,
    verify_after_reset,
)
from nodeagent.npu.hbm_baseline import baseline_path, lower_baseline, read_baseline, write_baseline
from nodeagent.npu.health import Fault, Level
from nodeagent.npu.tools import HostTools, NpuToolError, NpuTools, ToolRunner
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import ComponentView, Hold, HoldKind, MemberReport

if TYPE_CHECKING:
    from nodeagent.config.model import Config, NpuProbe
    from nodeagent.core.failure import Failure
    from nodeagent.core.process import ProcessRecord
    from nodeagent.npu.monitor import NpuMonitor
    from nodeagent.seam.stackport import StackPort

TICK_S = 10.0
IDLE_POLL_S = 2.0
LADDER_EVENTS = ("npu_reset", "npu_reset_step", "npu_reset_done", "npu_reset_failed", "node_isolated",
                 "node_uncordoned", "ladder_redeploy_failed", "npu_reset_skipped", "npu_fault")  # fmt: skip


class NotIsolated(Exception):
    """`uncordon` of a node that is not isolated."""


def running_resetter() -> str | None:
    """MindCluster's Container Manager (or the Device Plugin) on this host, from the process table."""
    import psutil

    cmdlines = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdlines.append(proc.info["cmdline"] or [])
    return external_resetter(cmdlines)


class NpuHost(ToolRunner, Protocol):
    """All the guards and the ladder touch of the NPUs' host: the tools (npu-smi, hccn_tool), which PIDs are ours,
    who else resets chips, who holds a device file. The composition root gives `HostNpu`; the whole-cluster
    simulation a simulated chip set (tests/sim_npu.py)."""

    def tools(self, spec: NpuProbe) -> NpuTools: ...

    async def our_pids(self, records: Iterable[ProcessRecord]) -> set[int]: ...

    def resetter(self) -> str | None: ...

    async def holders(self, devices: list[str]) -> list[str]: ...


class HostNpu(HostTools):
    """This host: the tools where `spec` (or PATH, the driver's place) says, /proc, the process table."""

    def tools(self, spec: NpuProbe) -> NpuTools:
        return NpuTools.locate(spec.npu_smi, spec.hccn_tool, timeout_s=spec.timeout_s)

    async def our_pids(self, records: Iterable[ProcessRecord]) -> set[int]:
        """From a pass begun after this call, so after npu-smi's snapshot: an older table would miss a vLLM
        worker started meanwhile, which npu-smi shows, and call it foreign."""
        from nodeagent.core.proctable import TABLES
        from nodeagent.npu.monitor import our_pids

        return our_pids(records, await TABLES.get(0))

    def resetter(self) -> str | None:
        return running_resetter()

    async def holders(self, devices: list[str]) -> list[str]:
        return await fuser([d for d in devices if Path(d).exists()])


def npu_users(config: Config) -> list[str]:
    """The components that hold NPUs: vLLM ranks, and the datasystem worker with RH2D (device memory)."""
    return [n for n, c in config.active_components().items()
            if c.kind == "vllm" or (c.kind == "datasystem" and getattr(c, "remote_h2d_device_ids", None))]  # fmt: skip


def policy_of(config: Config) -> LadderPolicy:
    from nodeagent.npu.monitor import expected_npus

    rc = config.recovery
    return LadderPolicy(fault_lasting_s=rc.fault_lasting_s, redeploys_for_reset=rc.redeploys_for_reset,
                        resets_per_chip=rc.resets_per_chip_per_hour, pause_after_reset_s=rc.pause_after_reset_s,
                        settle_after_reset_s=rc.settle_s, npus=expected_npus(config) or 8,
                        whole_node_reset=rc.whole_node_reset)  # fmt: skip


class NodeRecovery:
    """The ladder's executor for one node (a `NodeLayer`: the composition root attaches it, `agent.layers`)."""

    def __init__(self, config: Config, port: StackPort, npu: NpuMonitor, *, changed: Callable[[], None],
                 redeploy_times: Callable[[], list[float]], clock: Clock | None = None,
                 resetter: Callable[[], str | None] | None = None, host: NpuHost | None = None) -> None:  # fmt: skip
        self.host: NpuHost = host or HostNpu()
        self.port = port
        self.npu = npu
        self.clock = clock or Clock()
        self._changed = changed
        self._redeploy_times = redeploy_times
        self._resetter = resetter or self.host.resetter
        self.path = config.agent.state_dir / "recovery.json"
        self.state = state_from_dict(read_json(self.path, {}), policy_of(config))
        self.users = npu_users(config)
        self.groups = [g.name for g in cluster_layout(config).groups if config.node.name in g.nodes] \
            if config.cluster.nodes else []  # fmt: skip
        self.rung: dict[str, Any] | None = None
        """The reset being carried out (or waiting for its next rung): its step and why; None at rest."""
        self.steps: list[dict[str, Any]] = []
        """The last reset's steps with their outcomes (status, post-mortem)."""
        self.unverified: Fault | None = None
        """A reset that did not bring the chips back: a fault the ladder judges again (reset or isolate)."""
        self.baseline_file = baseline_path(config.agent.state_dir)
        self.baseline: dict[int, int] = read_baseline(self.baseline_file)
        """Each chip's lowest HBM use seen with no process on it: the verify step's reference. Kept on disk with
        the clean-slate wait's (`hbm_baseline`): an agent that adopted running ranks never sees the chips idle."""
        self.resets_total = 0
        self._seen_redeploy = max((r.at for r in self.state.redeploys), default=0.0)
        self._skipped_for: str | None = None
        self._look_now = False
        """Poll the NPUs before the next judgement (after an uncordon: the last poll may be a period old)."""
        self._wake = asyncio.Event()
        self._pending_writes: set[asyncio.Future[Any]] = set()
        npu.on_change.append(self.wake)
        port.show_recovery(self.view)

    @property
    def config(self) -> Config:
        """The node's config now, through the port: a reload reaches it (`stackport.StackPort.config`)."""
        return self.port.config

    # ---- what the cluster layer and /status read ------------------------------------------------------------
    def view(self) -> dict[str, Any] | None:
        if self.state.isolated is not None:
            return {"state": "isolated", "reason": self.state.isolated, "drain": f"isolated@{self.state.isolated_at}"}
        if self.rung is not None:
            return {"state": "resetting", "reason": self.rung["why"], "drain": f"reset@{self.rung['at']}"}
        return None

    def status(self) -> dict[str, Any]:
        return {**self.state.to_dict(self.clock.time()), "rung": self.rung, "steps": self.steps,
                "unverified": self.unverified.message if self.unverified else None,
                "resets_total": self.resets_total, "npu_users": self.users}  # fmt: skip

    # ---- NodeLayer --------------------------------------------------------------------------------------------
    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        if comp.name not in self.users:
            return None
        if self.state.isolated is not None:
            return Hold(HoldKind.ISOLATED, f"node isolated: {self.state.isolated} (nodeagentctl uncordon takes it "
                        "back)", resolves_itself=False)  # fmt: skip
        if self.rung is not None:
            return Hold(HoldKind.NPU_RESET, f"chip reset ({self.rung['step']}): {self.rung['why']}")
        return None

    def decide(self, comp: ComponentView, failure: Failure) -> None:
        """Not a decision: a failure of an NPU user after a node redeploy ends that redeploy (its cause is what
        the ladder's redeploy rule reads)."""
        if comp.name not in self.users:
            return None
        last = max(self._redeploy_times(), default=0.0)
        if last <= self._seen_redeploy:
            return None
        self._seen_redeploy = last
        stable = failure.uptime_s is not None and failure.uptime_s >= comp.restart.stable_after_s
        cause = "\n".join([failure.detail, *failure.output_tail])
        self.state.record_redeploy(last, ok=stable, cause=cause)
        self.save()
        if not stable:
            self.port.emit("ladder_redeploy_failed", f"the node redeploy at {last:.0f} ended in a failure of "
                           f"{comp.name}: {failure.detail}", comp.name, "warning")  # fmt: skip
        self.wake()
        return None

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> None:
        return None

    def status_section(self) -> dict[str, Any]:
        return {"recovery": self.status(), "isolated": self.state.isolated}

    def member_report(self) -> MemberReport | None:
        return None

    def on_node_change(self) -> None:
        pass

    # ---- the loop -------------------------------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    def save(self) -> None:
        with contextlib.suppress(OSError):
            write_json_atomic(self.path, state_to_dict(self.state))

    async def run(self) -> None:
        while True:
            await self.clock.wait(self._wake, TICK_S)
            self._wake.clear()
            try:
                await self.step()
            except Exception:  # a bug must not end the ladder silently
                logger.exception("recovery: ladder step failed")

    async def step(self) -> None:
        """One look at the ladder: the next rung, carried out to its end."""
        if self.port.snapshot().paused:
            return  # no automatic action under a maintenance pause
        if self._look_now:  # an operator fixed the chips and uncordoned: judge them as they are, not as last seen
            self._look_now = False
            await self.npu.poll(begun_after_call=True)
        self._note_baseline()
        now = self.clock.time()
        if self.unverified is not None and self.state.decide([self.unverified], now) is not None \
                and await self._chips_back():
            return  # the failed reset's next rung is due, and the chips read OK now
        faults = [*self.npu.faults, *([self.unverified] if self.unverified else [])]
        action = self.state.decide(faults, now)
        if isinstance(action, ChipReset):
            if not self.config.recovery.npu_reset:
                action = Isolate(f"{action.reason}; chip resets are off (recovery.npu_reset: false)")
            elif (who := self._resetter()) is not None:
                if self._skipped_for != action.reason:
                    self._skipped_for = action.reason
                    self.port.emit("npu_reset_skipped", f"not resetting ({action.reason}): {who} resets chips on "
                                   "this host; never both", None, "warning")  # fmt: skip
                return
        if isinstance(action, ChipReset):
            await self.reset(action)
        elif isinstance(action, Isolate):
            await self.isolate(action.reason)

    async def _chips_back(self) -> bool:
        """A failed reset judged again on the chips as they are now, by the verify step's own rule (all present and
        OK, HBM at its idle baseline): they came back late, or were replaced — the NPU users start, no next rung."""
        snap = await self.npu.poll(begun_after_call=True)
        if snap is None or snap.info is None or self.unverified is None:
            return False
        if self.state.decide(self.npu.faults, self.clock.time()) is not None:
            return False  # the fresh poll sees a fault that asks a rung of its own: the ladder goes on
        health = {c.npu: c.health for c in snap.info.chips}
        hbm = {c.npu: c.hbm_used_mb for c in snap.info.chips if c.hbm_used_mb is not None}
        ok, detail = verify_after_reset(health, hbm, self.state.policy, self.baseline)
        if not ok:
            return False
        was, self.unverified, self.rung = self.unverified, None, None
        self.port.emit("npu_reset_done", f"the chips read OK after the failed reset ({was.message}): {detail}; the "
                       "NPU users start again", None)  # fmt: skip
        self.port.wake()
        self._changed()
        return True

    def _note_baseline(self) -> None:
        snap = self.npu.last
        if snap is None or snap.info is None:
            return
        busy = {p.npu for p in snap.info.processes}
        idle = {c.npu: c.hbm_used_mb for c in snap.info.chips
                if c.npu not in busy and c.hbm_used_mb is not None and c.health == "OK"}  # fmt: skip
        lowered = lower_baseline(idle, self.baseline)
        if lowered != self.baseline:
            # merged with the file: the clean-slate wait writes it too, for chips this loop has not seen idle
            self.baseline = lower_baseline(read_baseline(self.baseline_file), lowered)
            write_baseline(self.baseline_file, self.baseline)

    # ---- a chip reset -----------------------------------------------------------------------------------------
    async def reset(self, action: ChipReset) -> bool:
        """`reset_plan`'s steps in order; True when the chips came back verified."""
        now = self.clock.time()
        done = self.state.record_reset(action, now)  # counted before the command: a crash mid-reset still counts
        self.save()
        self.resets_total += 1
        self.steps = []
        self.rung = {"step": "drain_groups", "why": action.reason, "at": now, "chips": list(action.chips)}
        self.port.emit("npu_reset", f"chip reset of npu {', '.join(map(str, action.chips))}: {action.reason} "
                       "(a reset on A2 resets all eight: the node's groups drain)", None, "critical",
                       chips=list(action.chips))  # fmt: skip
        # the clean-slate waits before vLLM starts may have seen the chips idle since: theirs counts too
        self.baseline = lower_baseline(read_baseline(self.baseline_file), self.baseline)
        plan = reset_plan(action, self.groups, self.users, self.state.policy, self.baseline)
        verified, detail, checked = False, "", ""
        for step in plan:
            self.rung = {**self.rung, "step": step.kind}
            self.port.emit("npu_reset_step", f"{step.kind}: {step.why}", None, args=_plain(step.args))
            self._changed()
            ok, detail = await self._carry(step)
            self.steps.append({"step": step.kind, "ok": ok, "detail": detail, "at": self.clock.time()})
            if not ok:
                break
            if step.kind == "verify":
                verified, checked = True, detail
            if step.kind == "start":
                break  # the pause is the ladder's (decide waits it out)
        # its time is the end of the reset: the pause after it counts from there
        self.state.resets[self.state.resets.index(done)] = replace(done, at=self.clock.time(), verified=verified)
        self.save()
        if verified:
            self.unverified = None
            self.port.emit("npu_reset_done", f"chip reset done: {checked}; the NPU users start again", None)
        else:
            failed_step = self.steps[-1]["step"] if self.steps else "?"
            chip = action.chips[0] if action.chips else None
            self.unverified = Fault(chip, "reset", Level.RestartNPU, now, f"chip reset failed at {failed_step}: "
                                    f"{detail}")  # fmt: skip
            self.rung = {**self.rung, "step": "failed", "why": self.unverified.message}
            self.port.emit("npu_reset_failed", f"{self.unverified.message}; the NPU users stay stopped, next rung "
                           f"after the {self.state.policy.pause_after_reset_s:g}s pause", None, "critical")  # fmt: skip
            if failed_step == "wait_idle":
                await self.isolate(f"chip reset impossible: {detail}")
        self._write_bundle("npu_reset", action.reason, "verified" if verified else f"failed: {detail}")
        self._changed()
        self.wake()
        return verified

    async def _carry(self, step: Step) -> tuple[bool, str]:
        """One step's OS work (thin): (done, what it saw)."""
        args = step.args
        if step.kind == "drain_groups":
            return True, "groups: " + (", ".join(args["groups"]) or "none (this node runs no cluster group)")
        if step.kind == "stop":
            here = self.port.snapshot().components
            running = [n for n in args["components"] if n in here and here[n].running]
            self.port.restart(running, f"chip reset: {self.rung['why'] if self.rung else ''}", planned=True,
                              cause="npu_reset")  # fmt: skip
            for name in running:
                if not await self.port.wait(name, "stopped", self.config.recovery.stop_timeout_s):
                    return False, f"{name} did not stop within {self.config.recovery.stop_timeout_s:g}s"
            return True, "stopped: " + (", ".join(running) or "nothing was running")
        if step.kind == "wait_idle":
            return await self._wait_idle(args["chips"], args["devices"])
        if step.kind == "reset":
            try:
                out = await self.npu.tools.reset(args["argv"])
            except NpuToolError as exc:
                return False, str(exc)
            return True, f"npu {args['chip']}: " + " ".join(line.strip() for line in out.splitlines()
                                                            if "Message" in line)[-160:]  # fmt: skip
        if step.kind == "settle":
            await self.clock.sleep(args["seconds"])
            return True, f"waited {args['seconds']:g}s"
        if step.kind == "verify":
            snap = await self.npu.poll()
            if snap is None or snap.info is None:
                return False, f"npu-smi info failed after the reset: {snap.error if snap else 'not available'}"
            health = {c.npu: c.health for c in snap.info.chips}
            hbm = {c.npu: c.hbm_used_mb for c in snap.info.chips if c.hbm_used_mb is not None}
            return verify_after_reset(health, hbm, self.state.policy, args["hbm_baseline_mb"])
        if step.kind == "start":
            self.rung = None
            self.port.wake()
            return True, "starting: " + ", ".join(args["components"])
        return True, ""

    async def _wait_idle(self, chips: list[int], devices: list[str]) -> tuple[bool, str]:
        deadline = self.clock.monotonic() + self.config.recovery.idle_timeout_s
        while True:
            snap = await self.npu.poll()
            holders = [f"npu {p.npu} pid {p.pid} {p.name}" for p in (snap.info.processes if snap and snap.info
                                                                       else ()) if p.npu in chips]  # fmt: skip
            holders += await self.host.holders(devices)
            if not holders:
                return True, "no process holds a chip"
            if self.clock.monotonic() >= deadline:
                return False, "still held after " + f"{self.config.recovery.idle_timeout_s:g}s: " + "; ".join(holders)
            await self.clock.sleep(IDLE_POLL_S)

    # ---- isolation --------------------------------------------------------------------------------------------
    async def isolate(self, reason: str) -> None:
        if self.state.isolated is not None:
            return
        self.state.isolate(Isolate(reason), self.clock.time())
        self.save()
        self.rung = None
        self.port.emit("node_isolated", f"node isolated: {reason}; its NPU users stay stopped until `nodeagentctl "
                       "uncordon`", None, "critical", reason=reason)  # fmt: skip
        self._changed()  # the cluster layer drains the groups; the member record says isolated
        here = self.port.snapshot().components
        running = [n for n in self.users if n in here and here[n].running]
        self.port.restart(running, f"node isolated: {reason}", planned=True, cause="npu_reset")
        self._write_bundle("isolation", reason, "isolated until uncordon")

    def uncordon(self, by: str = "operator") -> str:
        was = self.state.uncordon()
        if was is None:
            raise NotIsolated(f"{self.config.node.name} is not isolated")
        self.unverified, self.rung, self._skipped_for = None, None, None
        self._look_now = True
        self.save()
        self.port.emit("node_uncordoned", f"{by}: uncordon (was isolated: {was}); the reset budget starts afresh, "
                       "the NPU users start", None, "warning")  # fmt: skip
        self.port.wake()
        self._changed()
        self.wake()
        return was

    # ---- the post-mortem --------------------------------------------------------------------------------------
    def _write_bundle(self, rung: str, reason: str, outcome: str) -> None:
        from nodeagent.core.postmortem import Evidence

        events = self.port.recent_events(LADDER_EVENTS)[-60:]
        evidence = Evidence(component="node", kind=rung, at=self.clock.time(),
                            failure={"rung": rung, "reason": reason, "steps": list(self.steps)}, decision=outcome,
                            events=events, npu={"monitor": self.npu.status(), "ladder": self.status()})  # fmt: skip
        task = asyncio.ensure_future(self._write(evidence))
        self._pending_writes.add(task)
        task.add_done_callback(self._pending_writes.discard)

    async def _write(self, evidence: Any) -> None:
        from nodeagent.core.postmortem import write_bundle

        try:
            agent = self.config.agent
            text = await self._info_text()
            path = await write_bundle(evidence, agent.state_dir / "postmortem" / "node", agent.archive_keep, text)
        except Exception as exc:  # best effort, as every post-mortem
            self.port.emit("postmortem_failed", f"cannot write the ladder's post-mortem: {exc}", None, "warning")
            return
        self.port.emit("postmortem", f"post-mortem {path.stem.removesuffix('.tar')} written ({evidence.kind})", None,
                       path=str(path))  # fmt: skip

    async def _info_text(self) -> str | None:
        """The raw `npu-smi info` page for the bundle, from the monitor's own tools (None where npu-smi is absent)."""
        if self.npu.tools.missing is not None:
            return None
        try:
            return await self.npu.tools.info_text()
        except NpuToolError as exc:
            return f"npu-smi info failed: {exc}"


async def fuser(devices: list[str]) -> list[str]:
    """Who holds these device files, as `fuser /dev/davinciN` answers (read from /proc/*/fd directly: psmisc is
    not everywhere, and psutil lists regular files only)."""
    if not devices:
        return []
    import os

    def scan() -> list[str]:
        out, wanted = [], set(devices)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                fds = os.listdir(f"/proc/{pid}/fd")
                held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds} & wanted
                out += [f"{d} pid {pid}" for d in sorted(held)]
        return out

    return await asyncio.to_thread(scan)


def _plain(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in args.items() if k != "stdin"}

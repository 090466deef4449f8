"""Pure: NPU and RoCE facts over time → faults with levels, and whether vLLM may start.

The levels and the timing rules are the Ascend Device Plugin's (Ascend/mind-cluster,
component/ascend-device-plugin: pkg/common/fault_code.go, device.go, build/faultCustomization.json):
- levels, mildest first: NotHandleFault, SubHealthFault, RestartRequest, RestartBusiness, FreeRestartNPU,
  RestartNPU, PreSeparateNPU, SeparateNPU, ManuallySeparateNPU. Up to RestartBusiness a restart of the service
  is the cure; from FreeRestartNPU on the chip itself must be reset or taken out, so a vLLM start is held
  (`hold_level`).
- RoCE link down (fault code 0x81078603, FaultDuration): ignored while down for <= 20 s, PreSeparateNPU after;
  it clears once the link has been up for 60 s (RecoverTimeout).
- repeated faults escalate (FaultFrequency): 5 link-downs of one NPU within 24 h, or 2 rises of its HBM
  double-bit ECC count, → ManuallySeparateNPU, which stays until an operator overrides it, or (links) until
  48 h pass without a new one (ReleaseTimeWindow).
`npu-smi`'s health column maps Warning → SubHealthFault, Alarm → RestartNPU, Critical → SeparateNPU. A process
on an NPU that is not one of ours (PIDs of our components' trees) holds the start as PreSeparateNPU (the NPU is
taken); one whose PID we cannot see (npu-smi in a container lists host PIDs) is only reported.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from nodeagent.npu.tools import HEALTH_OK, NET_HEALTH_OK, NET_HEALTH_UNCONFIGURED, NpuProcess, NpuSnapshot


class Level(IntEnum):
    NotHandleFault = 0
    SubHealthFault = 1
    RestartRequest = 2
    RestartBusiness = 3
    FreeRestartNPU = 4
    RestartNPU = 5
    PreSeparateNPU = 6
    SeparateNPU = 7
    ManuallySeparateNPU = 8


HEALTH_LEVELS = {"Warning": Level.SubHealthFault, "Alarm": Level.RestartNPU, "Critical": Level.SeparateNPU}
UNKNOWN_HEALTH_LEVEL = Level.SubHealthFault


@dataclass(frozen=True)
class HealthPolicy:
    expected_npus: int = 0
    """0: any count is fine (no NPUs expected, or unknown)."""
    hold_level: Level = Level.FreeRestartNPU
    link_down_tolerance_s: float = 20.0
    link_recover_s: float = 60.0
    flap_window_s: float = 86400.0
    flap_limit: int = 5
    flap_release_s: float = 172800.0
    ecc_window_s: float = 86400.0
    ecc_limit: int = 2
    ecc_quiet_s: float = 300.0
    """A single rise of the double-bit count is a RestartBusiness fault for this long."""
    tool_failure_tolerance_s: float = 20.0
    """`npu-smi info` may fail once (a driver busy resetting); failing this long holds the start."""


@dataclass(frozen=True)
class Fault:
    npu: int | None
    """None: the node (an NPU missing, npu-smi failing)."""
    what: str
    """health, missing, npu-smi, process, link, link-flaps, ecc, net-health."""
    level: Level
    since: float
    message: str
    overridden: bool = False

    @property
    def key(self) -> tuple[int | None, str]:
        return (self.npu, self.what)

    def to_dict(self) -> dict[str, Any]:
        return {"npu": self.npu, "what": self.what, "level": self.level.name, "since": self.since,
                "message": self.message, "overridden": self.overridden}  # fmt: skip


@dataclass(frozen=True)
class Change:
    kind: str
    """appeared, cleared, or changed (level or message)."""
    fault: Fault


@dataclass(frozen=True)
class StartDecision:
    allowed: bool
    reasons: tuple[str, ...] = ()
    """One line per fault that holds the start, e.g. `npu 3 health Critical`."""
    checked: bool = True
    """False where nothing could be checked (no npu-smi): allowed, with the reason in `reasons`."""

    def __str__(self) -> str:
        if not self.allowed:
            return "held: " + "; ".join(self.reasons)
        return "allowed" + (f" ({'; '.join(self.reasons)})" if self.reasons else "")


@dataclass
class _LinkState:
    down_since: float | None = None
    up_since: float | None = None
    fault_since: float | None = None
    downs: deque[float] = field(default_factory=deque)
    separated_since: float | None = None


@dataclass
class _EccState:
    last: int | None = None
    rises: deque[float] = field(default_factory=deque)
    last_rise: float | None = None
    previous: int | None = None
    separated_since: float | None = None


class HealthEvaluator:
    """Feed it snapshots in time order (`observe`); ask `faults`, `start_decision`; `override` what an
    operator accepts. No I/O, no clock of its own: time is the snapshot's or the caller's `now`."""

    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self.active: dict[tuple[int | None, str], Fault] = {}
        self._links: dict[int, _LinkState] = {}
        self._ecc: dict[int, _EccState] = {}
        self._tool_failing_since: float | None = None
        self._overridden: set[tuple[int | None, str]] = set()

    # ------------------------------------------------------------------------------------------- queries

    @property
    def faults(self) -> list[Fault]:
        return sorted(self.active.values(), key=lambda f: (-f.level, f.npu if f.npu is not None else -1, f.what))

    def start_decision(self) -> StartDecision:
        holding = [f for f in self.faults if f.level >= self.policy.hold_level and not f.overridden]
        return StartDecision(not holding, tuple(f.message for f in holding))

    # ------------------------------------------------------------------------------------------- actions

    def override(self, npu: int | None = None) -> list[Fault]:
        """The operator starts anyway: the faults holding now (of `npu`, or all) stop holding until they
        clear; escalated (sticky) ones are released, their history forgotten. Returns what was overridden."""
        done = []
        for key, fault in list(self.active.items()):
            if fault.level < self.policy.hold_level or fault.overridden or (npu is not None and fault.npu != npu):
                continue
            self._overridden.add(key)
            self.active[key] = replace(fault, overridden=True)
            done.append(self.active[key])
            if fault.npu is not None and fault.what == "link-flaps":
                link = self._links.get(fault.npu)
                if link is not None:
                    link.downs.clear()
                    link.separated_since = None
            if fault.npu is not None and fault.what == "ecc":
                ecc = self._ecc.get(fault.npu)
                if ecc is not None:
                    ecc.rises.clear()
                    ecc.separated_since = None
        return done

    def observe(self, snap: NpuSnapshot, ours: set[int] | None = None, now: float | None = None) -> list[Change]:
        """One poll's facts; returns the faults that appeared, cleared or changed."""
        now = snap.at if now is None else now
        current: dict[tuple[int | None, str], tuple[Level, str, float]] = {}
        if snap.info is None:
            if self._tool_failing_since is None:
                self._tool_failing_since = now
            failing_for = now - self._tool_failing_since
            # What npu-smi cannot show now is what it showed last: keep the faults we had.
            for key, fault in self.active.items():
                if fault.what != "npu-smi":
                    current[key] = (fault.level, fault.message, fault.since)
            if failing_for >= self.policy.tool_failure_tolerance_s:
                current[(None, "npu-smi")] = (Level.PreSeparateNPU,
                                              f"npu-smi info failing for {failing_for:.0f}s: {snap.error}",
                                              self._tool_failing_since)  # fmt: skip
        else:
            self._tool_failing_since = None
            self._chips(snap, current, now)
            self._processes(snap.info.processes, ours, current, now)
            self._ecc_faults(snap, current, now)
            if snap.roce_checked:
                self._link_faults(snap, current, now)
                self._net_health(snap, current, now)
            else:
                for key, fault in self.active.items():
                    if fault.what in ("link", "link-flaps", "net-health"):
                        current[key] = (fault.level, fault.message, fault.since)
        return self._apply(current)

    # ---------------------------------------------------------------------------------------- the rules

    def _chips(self, snap: NpuSnapshot, current: dict[Any, tuple[Level, str, float]], now: float) -> None:
        assert snap.info is not None
        for chip in snap.info.chips:
            if chip.health == HEALTH_OK:
                continue
            level = HEALTH_LEVELS.get(chip.health, UNKNOWN_HEALTH_LEVEL)
            detail = snap.health.get(chip.npu)
            extra = ""
            if detail is not None and detail.error_codes:
                extra = f" (error code {' '.join(detail.error_codes)}"
                extra += f": {detail.information})" if detail.information else ")"
            current[(chip.npu, "health")] = (level, f"npu {chip.npu} health {chip.health}{extra}", now)
        expected = self.policy.expected_npus
        seen = snap.info.npu_ids
        if expected and len(seen) < expected:
            gaps = [n for n in range(expected) if n not in seen]
            which = f": npu {', '.join(map(str, gaps))} missing" if gaps else ""
            current[(None, "missing")] = (Level.SeparateNPU, f"{len(seen)} of {expected} NPUs visible{which}", now)

    def _processes(self, processes: Iterable[NpuProcess], ours: set[int] | None,
                   current: dict[Any, tuple[Level, str, float]], now: float) -> None:  # fmt: skip
        if ours is None:
            return
        by_npu: dict[int, list[NpuProcess]] = {}
        for proc in processes:
            if proc.pid not in ours:
                by_npu.setdefault(proc.npu, []).append(proc)
        for npu, procs in by_npu.items():
            seen = [p for p in procs if p.visible is not False]
            listed = ", ".join(f"pid {p.pid} {p.name} ({p.memory_mb} MB)" for p in (seen or procs))
            if seen:
                current[(npu, "process")] = (Level.PreSeparateNPU, f"npu {npu} held by {listed}, not ours", now)
            else:
                current[(npu, "process")] = (Level.NotHandleFault,
                                             f"npu {npu} used by {listed}, a PID not visible here", now)  # fmt: skip

    def _ecc_faults(self, snap: NpuSnapshot, current: dict[Any, tuple[Level, str, float]], now: float) -> None:
        policy = self.policy
        for npu, counts in snap.ecc.items():
            value = counts.get("hbm_double_total", counts.get("hbm_double"))
            if value is None:
                continue
            state = self._ecc.setdefault(npu, _EccState())
            if state.last is not None and value > state.last:
                state.rises.append(now)
                state.last_rise = now
                state.previous = state.last
            state.last = value
        for npu, state in self._ecc.items():
            while state.rises and now - state.rises[0] > policy.ecc_window_s:
                state.rises.popleft()
            if state.separated_since is None and len(state.rises) >= policy.ecc_limit:
                state.separated_since = now
            if state.separated_since is not None:
                hours = policy.ecc_window_s / 3600
                current[(npu, "ecc")] = (Level.ManuallySeparateNPU,
                                         f"npu {npu} HBM double-bit ECC errors rose {policy.ecc_limit} times within "
                                         f"{hours:g} h (now {state.last})", state.separated_since)  # fmt: skip
            elif state.last_rise is not None and now - state.last_rise < policy.ecc_quiet_s:
                current[(npu, "ecc")] = (Level.RestartBusiness,
                                         f"npu {npu} HBM double-bit ECC errors {state.previous} → {state.last}",
                                         state.last_rise)  # fmt: skip

    def _link_faults(self, snap: NpuSnapshot, current: dict[Any, tuple[Level, str, float]], now: float) -> None:
        policy = self.policy
        for npu, status in snap.links.items():
            link = self._links.setdefault(npu, _LinkState())
            if status == "DOWN":
                if link.down_since is None:
                    link.down_since, link.up_since = now, None
                    link.downs.append(now)
            elif status == "UP" and link.down_since is not None:
                link.down_since, link.up_since = None, now
        for npu, link in self._links.items():
            if link.down_since is not None and now - link.down_since > policy.link_down_tolerance_s:
                link.fault_since = link.fault_since or link.down_since
            recovered = link.up_since is not None and now - link.up_since >= policy.link_recover_s
            if link.fault_since is not None and link.down_since is None and recovered:
                link.fault_since = None
            if link.fault_since is not None:
                if link.down_since is not None:
                    message = f"npu {npu} RoCE link down for {now - link.down_since:.0f}s"
                else:
                    up_for = now - (link.up_since or now)
                    message = (f"npu {npu} RoCE link up again for {up_for:.0f}s"
                               f" (clears after {policy.link_recover_s:g}s up)")  # fmt: skip
                current[(npu, "link")] = (Level.PreSeparateNPU, message, link.fault_since)
            while link.downs and now - link.downs[0] > policy.flap_window_s:
                link.downs.popleft()
            if link.separated_since is None and len(link.downs) >= policy.flap_limit:
                link.separated_since = now
            if link.separated_since is not None:
                last = link.downs[-1] if link.downs else link.separated_since
                if now - last > policy.flap_release_s:
                    link.separated_since = None
                else:
                    message = (f"npu {npu} RoCE link went down {len(link.downs)} times within "
                               f"{policy.flap_window_s / 3600:g} h")  # fmt: skip
                    current[(npu, "link-flaps")] = (Level.ManuallySeparateNPU, message, link.separated_since)

    def _net_health(self, snap: NpuSnapshot, current: dict[Any, tuple[Level, str, float]], now: float) -> None:
        if not snap.net_health:  # not a detail poll: keep what the last one found
            for key, fault in self.active.items():
                if fault.what == "net-health":
                    current[key] = (fault.level, fault.message, fault.since)
            return
        for npu, status in snap.net_health.items():
            if status not in NET_HEALTH_OK and status not in NET_HEALTH_UNCONFIGURED:
                current[(npu, "net-health")] = (Level.SubHealthFault, f"npu {npu} RoCE net health {status}", now)

    def _apply(self, current: Mapping[tuple[int | None, str], tuple[Level, str, float]]) -> list[Change]:
        changes = []
        for key in list(self.active):
            if key not in current:
                changes.append(Change("cleared", self.active.pop(key)))
                self._overridden.discard(key)
        for key, (level, message, since) in current.items():
            old = self.active.get(key)
            if old is None:
                fault = Fault(key[0], key[1], level, since, message, key in self._overridden)
                self.active[key] = fault
                changes.append(Change("appeared", fault))
                continue
            fault = replace(old, level=level, message=message)
            self.active[key] = fault
            if old.level != level:
                changes.append(Change("changed", fault))
        return changes


def policy_from(spec: Any, expected_npus: int) -> HealthPolicy:
    """A HealthPolicy from an `npu` probe's config (config_model.NpuProbe)."""
    return HealthPolicy(
        expected_npus=expected_npus, hold_level=Level[spec.hold_level],
        link_down_tolerance_s=spec.link_down_tolerance_s, link_recover_s=spec.link_recover_s,
        flap_window_s=spec.flap_window_s, flap_limit=spec.flap_limit, flap_release_s=spec.flap_release_s,
        ecc_window_s=spec.ecc_window_s, ecc_limit=spec.ecc_limit, ecc_quiet_s=spec.ecc_quiet_s,
    )  # fmt: skip

"""Pure: the recovery ladder past a node redeploy — chip reset, then node isolation — as rules over the NPU faults
the facade reads (`npu_health`), the node's redeploy history and the reset history per chip.

Triggers (MindCluster's fault levels, Ascend Device Plugin):
- SeparateNPU and above (a chip Critical or missing, an escalated sticky fault): never reset — isolate;
- RestartNPU / FreeRestartNPU: reset at once;
- RestartRequest / RestartBusiness: the service restart is the cure; still there after 60 s → reset;
- `redeploys_for_reset` node redeploys in a row within the window, each ending in an NPU-looking failure
  (`npu_cause`: the device-side errors vllm-ascend prints, not communication timeouts a dead peer causes).
Limits: at most 3 resets per chip per hour and none within 30 s of the last one; a trigger still there when the
hour's budget is spent means the resets did not help → isolate. Isolation stays until `uncordon`.

On an Atlas 800I/800T A2 a reset of one NPU resets all eight (Ascend's toolbox docs; "reset one card and all
cards reset"), so a reset is a whole-node event: `reset_plan` drains every group with a rank here, stops every
NPU user, resets only when no process holds a chip, waits >= 20 s, verifies health and the HBM baseline, then
starts. The plan is data; the executor that runs it is a thin shell. Where Ascend's MindCluster resets chips
itself (preflight detects it) the ladder never resets: both at once would fight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodeagent.layers.portlint import format_ranges, merge_ranges
from nodeagent.npu.health import Fault, Level

RESET_AT_ONCE = (Level.FreeRestartNPU, Level.RestartNPU)
RESET_AFTER_LASTING = (Level.RestartRequest, Level.RestartBusiness)
ISOLATE_FROM = Level.SeparateNPU


@dataclass(frozen=True)
class LadderPolicy:
    fault_lasting_s: float = 60.0
    """RestartRequest/RestartBusiness faults act once they lasted this long (MindCluster)."""
    redeploys_for_reset: int = 2
    redeploy_window_s: float = 3600.0
    resets_per_chip: int = 3
    reset_window_s: float = 3600.0
    pause_after_reset_s: float = 30.0
    settle_after_reset_s: float = 20.0
    npus: int = 8
    whole_node_reset: bool = True
    """Atlas 800 A2: one reset resets all eight; every chip counts against its budget."""
    external_resetter: str | None = None
    """Set when MindCluster (or another manager) resets chips: the ladder then never resets, only isolates."""


@dataclass(frozen=True)
class ChipReset:
    chips: tuple[int, ...]
    """The chips the reset command runs on (the faulty ones); with whole_node_reset all eight are reset."""
    reason: str


@dataclass(frozen=True)
class Isolate:
    reason: str


Action = ChipReset | Isolate


# ------------------------------------------------------------------------------------- NPU-looking causes

# The device-side errors vllm-ascend's issues quote (ACL stream synchronize failed, error code:5070xx — #2763,
# #5661, #1972, #1193, #3529; rtKernelLaunch... failed: 507035 — #2349; EZ9999 "The error from device(chipId:N"
# with an aicore/aivec/vector core exception; HBM ECC; a device lost). HCCL notify/socket timeouts (EI0002,
# EI0006) are not here: a peer that died causes them on every healthy node.
NPU_CAUSES = re.compile(
    r"ACL stream synchronize failed, error code:? ?5070\d\d"
    r"|rt\w+ (?:execute )?failed[:,]? (?:reason=\[)?(?:5070\d\d|aicore exception|vector core exception)"
    r"|EZ9999: Inner Error"
    r"|The error from device\(chipId:\d+"
    r"|\b(?:aicore|aivec|vector core) (?:error|exception)"
    r"|HBM (?:multi-bit|double bit) ECC"
    r"|device (?:is )?lost|drvRet=\d+|DEVICE_TASK_ABORT|device hang",
    re.IGNORECASE,
)
_CHIP = re.compile(r"device\(chipId:(\d+)|\bDevice:(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class NpuCause:
    line: str
    chips: tuple[int, ...]
    """Chip ids the text names (the process's logical ids: map through its visible devices)."""


def npu_cause(text: str | Sequence[str]) -> NpuCause | None:
    """The NPU-looking error in a failure's text, or None (a software error, an OOM, a timeout)."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    hits = [line.strip() for line in lines if NPU_CAUSES.search(line)]
    if not hits:
        return None
    chips = sorted({int(next(g for g in m.groups() if g)) for line in lines for m in _CHIP.finditer(line)})
    return NpuCause(hits[-1][:200], tuple(chips))


# ------------------------------------------------------------------------------------------------ history


@dataclass(frozen=True)
class Redeploy:
    at: float
    ok: bool
    """The redeploy brought the node up (and it stayed up)."""
    cause: str = ""
    """What the failure that ended it said (its last lines)."""


@dataclass(frozen=True)
class Reset:
    at: float
    chips: tuple[int, ...]
    """Every chip the reset reset (all eight on A2)."""
    reason: str = ""
    verified: bool | None = None
    """Health and HBM baseline after the reset: True, False, or None while not yet checked."""


@dataclass
class LadderState:
    """A node's ladder history; `decide` is pure over it and `now` (tests drive it with a fake clock)."""

    policy: LadderPolicy = field(default_factory=LadderPolicy)
    redeploys: list[Redeploy] = field(default_factory=list)
    resets: list[Reset] = field(default_factory=list)
    isolated: str | None = None
    """`isolated: <reason>` in status; cleared only by `uncordon`."""
    isolated_at: float | None = None

    # ------------------------------------------------------------------------------------- records

    def record_redeploy(self, at: float, ok: bool, cause: str = "") -> None:
        self.redeploys.append(Redeploy(at, ok, cause))

    def record_reset(self, reset: ChipReset, at: float, verified: bool | None = None) -> Reset:
        chips = tuple(range(self.policy.npus)) if self.policy.whole_node_reset else reset.chips
        done = Reset(at, chips, reset.reason, verified)
        self.resets.append(done)
        return done

    def isolate(self, action: Isolate, at: float) -> None:
        self.isolated, self.isolated_at = action.reason, at

    def uncordon(self) -> str | None:
        """The operator takes the node back: isolation ends, the reset budget starts afresh. Returns the reason
        it was isolated for (None: it was not — refused, and nothing changes: a reset may be running)."""
        if self.isolated is None:
            return None
        was, self.isolated, self.isolated_at = self.isolated, None, None
        self.resets.clear()
        self.redeploys.clear()
        return was

    # ------------------------------------------------------------------------------------- queries

    def resets_of(self, chip: int, now: float) -> list[Reset]:
        return [r for r in self.resets if chip in r.chips and now - r.at < self.policy.reset_window_s]

    def npu_redeploy_streak(self, now: float) -> list[tuple[Redeploy, NpuCause]]:
        """The latest failed redeploys in a row within the window whose causes look like the NPU."""
        streak: list[tuple[Redeploy, NpuCause]] = []
        last_reset = max((r.at for r in self.resets), default=float("-inf"))
        for r in reversed(self.redeploys):
            if r.ok or now - r.at > self.policy.redeploy_window_s or r.at <= last_reset:
                break
            cause = npu_cause(r.cause)
            if cause is None:
                break
            streak.append((r, cause))
        return streak

    def decide(self, faults: Iterable[Fault], now: float) -> Action | None:
        """The next rung, or None (nothing to do, waiting out the pause, or already isolated)."""
        if self.isolated is not None:
            return None
        p = self.policy
        active = [f for f in faults if not f.overridden]
        separate = [f for f in active if f.level >= ISOLATE_FROM]
        if separate:
            return Isolate(f"{separate[0].message} ({separate[0].level.name}: never reset)")
        trigger = self._trigger(active, now)
        if trigger is None:
            return None
        chips, why = trigger
        if p.external_resetter:
            return None
        last = max((r.at for r in self.resets), default=None)
        if last is not None and now - last < p.pause_after_reset_s:
            return None  # the last reset gets its pause before anyone judges it
        domain = tuple(range(p.npus)) if p.whole_node_reset else chips
        spent = [c for c in domain if len(self.resets_of(c, now)) >= p.resets_per_chip]
        if spent:
            hours = p.reset_window_s / 3600
            chip = next((c for c in chips if c in spent), spent[0])  # the faulty chip, not npu 0 of a whole node
            return Isolate(f"{why}; {p.resets_per_chip} resets of npu {chip} within {hours:g} h did not help")
        return ChipReset(chips, why)

    def _trigger(self, faults: list[Fault], now: float) -> tuple[tuple[int, ...], str] | None:
        p = self.policy
        # a fault that outlived a reset counts from the reset: the service restart gets its minute again
        last_reset = max((r.at for r in self.resets), default=float("-inf"))
        at_once = [f for f in faults if f.level in RESET_AT_ONCE]
        lasting = [f for f in faults if f.level in RESET_AFTER_LASTING
                   and now - max(f.since, last_reset) >= p.fault_lasting_s]
        chosen = at_once or lasting
        if chosen:
            chips = tuple(sorted({f.npu for f in chosen if f.npu is not None})) or (0,)
            f = chosen[0]
            extra = "" if f in at_once else f" for {now - max(f.since, last_reset):.0f}s"
            return chips, f"{f.message} ({f.level.name}{extra})"
        streak = self.npu_redeploy_streak(now)
        if len(streak) >= p.redeploys_for_reset:
            chips = tuple(sorted({c for _, cause in streak for c in cause.chips})) or (0,)
            return chips, f"{len(streak)} node redeploys in a row failed with an NPU error: {streak[0][1].line}"
        return None

    def to_dict(self, now: float) -> dict[str, Any]:
        """For status, events and the post-mortem."""
        return {
            "isolated": self.isolated, "isolated_at": self.isolated_at,
            "resets_last_hour": {c: len(self.resets_of(c, now)) for c in range(self.policy.npus)
                                 if self.resets_of(c, now)},
            "last_reset": None if not self.resets else {"at": self.resets[-1].at, "reason": self.resets[-1].reason,
                                                        "verified": self.resets[-1].verified},
        }  # fmt: skip


# ----------------------------------------------------------------------------------------- the reset plan


@dataclass(frozen=True)
class Step:
    kind: str
    """drain_groups | stop | wait_idle | reset | settle | verify | start | pause"""
    why: str
    args: dict[str, Any] = field(default_factory=dict)


def reset_command(chip: int) -> list[str]:
    """The command; it asks `(Y/N)` — the executor answers `y` on stdin."""
    return ["npu-smi", "set", "-t", "reset", "-i", str(chip), "-c", "0"]


def reset_plan(reset: ChipReset, groups: Sequence[str], npu_users: Sequence[str], policy: LadderPolicy,
               hbm_baseline_mb: dict[int, int] | None = None) -> list[Step]:
    """What a chip reset does, in order. `groups`: every group with a rank on this node; `npu_users`: every
    component here that holds an NPU (vLLM ranks, the datasystem worker with RH2D)."""
    domain = list(range(policy.npus)) if policy.whole_node_reset else list(reset.chips)
    steps = [
        Step("drain_groups", "a reset of one NPU resets all eight: every group with a rank here leaves (their gangs "
             "restart elsewhere)", {"groups": list(groups)}),
        Step("stop", "no process may hold an NPU during the reset", {"components": list(npu_users)}),
        Step("wait_idle", "reset only when no process holds a chip (npu-smi's process table, fuser /dev/davinciN)",
             {"chips": domain, "devices": [f"/dev/davinci{c}" for c in domain]}),
    ]  # fmt: skip
    steps += [Step("reset", reset.reason, {"chip": c, "argv": reset_command(c), "stdin": "y\n"}) for c in reset.chips]
    steps += [
        Step("settle", "the driver brings the chips back", {"seconds": max(20.0, policy.settle_after_reset_s)}),
        Step("verify", "every chip visible and OK, HBM back at its baseline",
             {"chips": domain, "health": "OK", "hbm_baseline_mb": dict(hbm_baseline_mb or {})}),
        Step("start", "the stopped components start; the groups take their ranks back",
             {"components": list(npu_users)}),
        Step("pause", "no other reset right after this one", {"seconds": policy.pause_after_reset_s}),
    ]  # fmt: skip
    return steps


def verify_after_reset(health: dict[int, str], hbm_used_mb: dict[int, int], policy: LadderPolicy,
                       baseline_mb: dict[int, int], margin_mb: int = 512) -> tuple[bool, str]:
    """The `verify` step's rule: all chips present and OK, each chip's HBM within margin of its idle baseline."""
    domain = range(policy.npus) if policy.whole_node_reset else sorted(health)
    missing = [c for c in domain if c not in health]
    if missing:
        return False, f"npu {', '.join(map(str, missing))} not visible after the reset"
    sick = [f"npu {c} {health[c]}" for c in domain if health[c] != "OK"]
    if sick:
        return False, "; ".join(sick) + " after the reset"
    high = [f"npu {c} HBM {hbm_used_mb[c]} MB > baseline {baseline_mb[c]} MB" for c in domain
            if c in baseline_mb and c in hbm_used_mb and hbm_used_mb[c] > baseline_mb[c] + margin_mb]  # fmt: skip
    if high:
        return False, "; ".join(high)
    unknown = [c for c in domain if c not in baseline_mb]
    unread = [c for c in domain if c in baseline_mb and c not in hbm_used_mb]
    if not unknown and not unread:
        return True, "all chips OK, HBM at baseline"
    # passed on health alone: the record says which HBM was not judged, and why
    why = []
    if unknown:
        why.append(f"no idle baseline known for npu {_chips(unknown)} (never seen idle: not by this agent, not by a "
                   "clean-slate wait before a vLLM start)")
    if unread:
        why.append(f"npu-smi gave no HBM use for npu {_chips(unread)}")
    checked = [c for c in domain if c not in unknown and c not in unread]
    at = f"HBM at baseline on npu {_chips(checked)}; " if checked else ""
    return True, f"all chips OK; {at}HBM NOT CHECKED: " + "; ".join(why)



def _chips(chips: Sequence[int]) -> str:
    return format_ranges(merge_ranges((c, c) for c in chips))


# ------------------------------------------------------------------------------------ persistence, detection


def state_to_dict(state: LadderState) -> dict[str, Any]:
    """What `recovery.json` keeps across agent restarts: isolation and the reset budget survive a kill -9."""
    return {"isolated": state.isolated, "isolated_at": state.isolated_at,
            "redeploys": [{"at": r.at, "ok": r.ok, "cause": r.cause} for r in state.redeploys[-20:]],
            "resets": [{"at": r.at, "chips": list(r.chips), "reason": r.reason, "verified": r.verified}
                       for r in state.resets[-50:]]}  # fmt: skip


def state_from_dict(data: dict[str, Any], policy: LadderPolicy) -> LadderState:
    state = LadderState(policy)
    isolated = data.get("isolated")
    state.isolated = str(isolated) if isolated else None
    state.isolated_at = data.get("isolated_at") if state.isolated else None
    for r in data.get("redeploys") or []:
        state.redeploys.append(Redeploy(float(r["at"]), bool(r["ok"]), str(r.get("cause", ""))))
    for r in data.get("resets") or []:
        state.resets.append(Reset(float(r["at"]), tuple(int(c) for c in r["chips"]), str(r.get("reason", "")),
                                  r.get("verified")))  # fmt: skip
    return state


def external_resetter(cmdlines: Iterable[Sequence[str]]) -> str | None:
    """Who else resets chips on this host, from the processes' command lines: MindCluster's Container Manager
    (`container-manager run -ctrStrategy ...`, its systemd unit's ExecStart) resets faulty NPUs itself, and so does
    Ascend's Device Plugin under Kubernetes ("perform a hot reset on an idle, faulty processor": MindCluster 7.3's
    component description of both)."""
    for argv in cmdlines:
        if not argv:
            continue
        name = argv[0].rsplit("/", 1)[-1]
        if name == "container-manager" and "run" in argv[1:]:
            return "MindCluster Container Manager (" + " ".join(argv)[:120] + ")"
        if name == "device-plugin":
            return "Ascend Device Plugin (" + " ".join(argv)[:120] + ")"
    return None

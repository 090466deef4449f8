"""Pure: the cluster's rules, decided from what etcd holds — no I/O, no clock of their own.

A multi-node data-parallel vLLM cannot lose a rank, so its group restarts together, as one *generation*. The
rules here answer, for one agent and from the keys it read: does my group need a new generation (and which
transaction creates exactly one however many members fail at once), must I act on a generation, may my vLLM
start (barrier), what does the group's restart policy say, is the cluster paused, does a cluster redeploy need
me. `coordinator` does the etcd I/O and carries the answers out through the node's `StackPort`.

Keys, under `/dsv4-agent/<cluster>/`:
    gangs/<group>                    GangRecord: generation, reason, who asked, when, planned, policy counters
    barriers/<group>/<gen>/<node>    an arrival: this node's worker is up and its vLLM is about to start
    pause                            {by, at, reason}: maintenance mode for every agent
    redeploy                         RedeployRecord: one cluster redeploy at a time, its phase
    redeploy_acks/<id>/<node>        a node stopped its stack for that redeploy
    commands/<node>/<id>             a remote nodeagentctl command and, written back, its result
    epoch                            the store's incarnation: a wiped etcd gets a new one, so generations that
                                     start again are not read as restarts
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from nodeagent.config.model import RestartSpec
from nodeagent.seam.policy import RestartDecision, RestartTracker
from nodeagent.seam.stackport import ComponentView, HoldKind

# ---- keys ------------------------------------------------------------------------------------------------------


def prefix(cluster: str) -> str:
    return f"/dsv4-agent/{cluster}/"


def gang_key(cluster: str, group: str) -> str:
    return f"{prefix(cluster)}gangs/{group}"


def barrier_prefix(cluster: str, group: str, generation: int) -> str:
    return f"{prefix(cluster)}barriers/{group}/{generation}/"


def barrier_key(cluster: str, group: str, generation: int, node: str) -> str:
    return barrier_prefix(cluster, group, generation) + node


def pause_key(cluster: str) -> str:
    return f"{prefix(cluster)}pause"


def redeploy_key(cluster: str) -> str:
    return f"{prefix(cluster)}redeploy"


def redeploy_ack_prefix(cluster: str, redeploy_id: str) -> str:
    return f"{prefix(cluster)}redeploy_acks/{redeploy_id}/"


def command_prefix(cluster: str, node: str) -> str:
    return f"{prefix(cluster)}commands/{node}/"


def epoch_key(cluster: str) -> str:
    return f"{prefix(cluster)}epoch"


# ---- gang generations ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GangRecord:
    """The value of `gangs/<group>`."""

    generation: int = 0
    reason: str = ""
    by: str = ""
    at: float = 0.0
    planned: bool = False
    """An operator's restart (drain first) rather than a failure (no drain)."""
    not_before: float = 0.0
    """The group's backoff: no member starts before this wall-clock time."""
    epoch: str = ""
    policy: dict[str, Any] = field(default_factory=dict)
    """The group's RestartTracker, so a crash-looping group backs off as one whoever saw the failure."""
    base: int = 0
    """The generation of this epoch that the ranks running when it began belong to (0: not said — a record from
    before it was kept): an agent away across an etcd wipe comes back with ranks of that generation, so one asked
    after it is a restart still owed (`epoch_baseline`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"generation": self.generation, "reason": self.reason, "by": self.by, "at": self.at,
                "planned": self.planned, "not_before": self.not_before, "epoch": self.epoch,
                "policy": self.policy, "base": self.base}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Any) -> GangRecord:
        if not isinstance(data, dict):
            return cls()
        try:
            return cls(generation=int(data.get("generation", 0)), reason=str(data.get("reason", "")),
                       by=str(data.get("by", "")), at=float(data.get("at", 0.0)),
                       planned=bool(data.get("planned", False)), not_before=float(data.get("not_before", 0.0)),
                       epoch=str(data.get("epoch", "")),
                       policy=dict(data.get("policy") or {}), base=int(data.get("base", 0)))  # fmt: skip
        except (TypeError, ValueError):
            return cls()


@dataclass(frozen=True)
class GangView:
    """What one member knows of its group: the record (None: no key) and the generation it last acted on."""

    record: GangRecord | None
    acted: int
    """The generation this node's vLLM of this group was (re)started for; persisted locally."""
    acted_epoch: str
    """The store incarnation `acted` belongs to."""


def baseline(view: GangView, epoch: str) -> bool:
    """The store is new to us (first contact, or etcd was wiped): adopt its generation without restarting.

    A generation counts as news only within the epoch our `acted` belongs to."""
    return view.record is None or view.acted_epoch != epoch or view.record.epoch != epoch


def epoch_baseline(record: GangRecord, wiped: bool) -> int:
    """The generation a member adopts on first contact with an epoch (pure): the record's — but when etcd was wiped
    under it (it had acted in another epoch), the epoch's `base`: its ranks, launched before the wipe, belong to
    that one, and a generation asked after it (by a peer, an operator, while this agent was away) restarts them
    too (seed 686167: a peer waited at the barrier for ever for a rank adopted into the newer generation)."""
    return record.base if wiped and 0 < record.base <= record.generation else record.generation


def must_restart_for(view: GangView, epoch: str) -> int | None:
    """The generation this member must restart its vLLM for, exactly once; None when there is nothing to do."""
    if baseline(view, epoch):
        return None
    assert view.record is not None
    return view.record.generation if view.record.generation > view.acted else None


def failed_in(view: GangView, ran_in: int | None) -> int | None:
    """The generation a rank's failure asks its group to leave (the `seen` of `bump`), or None when the group has
    left the generation that rank ran in already: the generation under way restarts it (a peer's failure, an FT
    escalation or another rank of the same fault got there first), and asking from there would make a second
    generation for one fault. `ran_in`: the generation the failed rank was last seen running in (None: unknown —
    the one acted on; a number above it belongs to a store since wiped)."""
    seen = view.acted if ran_in is None or ran_in > view.acted else ran_in
    if seen < view.acted:
        return None
    record = view.record
    if record is not None and record.epoch == view.acted_epoch and record.generation > seen:
        return None  # asked by another member, not acted on here yet: the rank starts again through its barrier
    return seen


@dataclass(frozen=True)
class GenRequest:
    """One ask for a group's next generation, queued for the coordinator's work loop (the one writer of the group's
    record): the generation the asker saw, why, and whether it is planned (drained first, no failure counted)."""

    seen: int
    reason: str
    planned: bool = False


REASONS_SEP = " | "
"""Between the reasons of requests merged into one generation (`GangRecord.reason`)."""


def answered(current: GangRecord | None, epoch: str, request: GenRequest) -> bool:
    """A generation past the one the request saw exists already: it restarts every rank after the request was
    made, which is all a request asks (`bump` would follow it, not make another)."""
    return current is not None and current.epoch == epoch and current.generation > request.seen


def merge_requests(current: GangRecord | None, epoch: str,
                   requests: list[GenRequest]) -> tuple[GenRequest | None, list[GenRequest]]:  # fmt: skip
    """One decision over the requests queued for a group: (the one request to write as the next generation, or
    None; the requests the record already answers). Requests decided together make ONE generation — one burst,
    one launch: the newest generation any of them saw, every distinct reason, planned only if each was (a
    failure's generation counts in the group's policy, and its group is broken: nothing to drain)."""
    done = [r for r in requests if answered(current, epoch, r)]
    rest = [r for r in requests if not answered(current, epoch, r)]
    if not rest:
        return None, done
    reason = REASONS_SEP.join(dict.fromkeys(r.reason for r in rest))
    return GenRequest(max(r.seen for r in rest), reason, all(r.planned for r in rest)), done


def bump(current: GangRecord | None, seen_generation: int, *, node: str, reason: str, now: float, epoch: str,
         spec: RestartSpec, planned: bool = False) -> tuple[GangRecord, RestartDecision] | None:  # fmt: skip
    """The next generation after a failure (or an operator's restart) seen while running `seen_generation`.

    None when another member already moved the group past the generation we saw: we follow theirs instead of
    making a second one. The caller writes the result with a transaction on the record's mod_revision, so two
    members that both read generation 5 cannot both write 6 — the loser re-reads, sees 6 > 5, and follows.
    """
    if current is not None and current.epoch == epoch and current.generation > seen_generation:
        return None
    base = current if current is not None and current.epoch == epoch else GangRecord(epoch=epoch)
    tracker = RestartTracker.from_dict(base.policy, spec)
    if planned:
        decision = RestartDecision("restart", 0.0, reason, tracker.consecutive_failures, tracker.crash_loop)
    else:
        decision = tracker.record_failure(now, reason)
    generation = max(base.generation, seen_generation) + 1
    record = replace(base, generation=generation, reason=reason, by=node, at=now, planned=planned,
                     not_before=now + decision.delay_s, epoch=epoch, policy=tracker.to_dict(),
                     base=base.base if base.generation else generation - 1)  # fmt: skip
    return record, decision


def rejoins(multi: bool, acted: int, ran_in: int | None, running: bool) -> bool:
    """A stopped rank of a multi-node group that already ran in the generation acted on: it cannot join its
    running peers alone (a DP group cannot take a rank back), the group must start again."""
    return multi and ran_in == acted and not running


def unrestarted(launched_in: Mapping[str, int], acted: int, running: Iterable[str]) -> list[str]:
    """The running ranks a previous agent's act never restarted (pure): it saved the generation it acted on, then
    died before their old trees were stopped (a drain takes seconds) — they run an older generation than `acted`,
    so its successor must not adopt them as the new one (seed 760353: an operator's acknowledged restart lost)."""
    return [c for c in running if launched_in.get(c, acted) < acted]


def rank_to_rejoin(multi: bool, acted: int, released: int, ran: Mapping[str, int],
                   views: Mapping[str, ComponentView], ranks: tuple[str, ...]) -> str | None:  # fmt: skip
    """The rank whose start asks the group's next generation now (None: none). The gate only reports the
    `rejoins` hold; asking waits until that hold is the one that wins the node's gates (what the rank shows as
    held): while an earlier one holds it (a pause, preflight, isolation, a container being made) nothing is
    asked — the peers would stop for a rank that cannot start."""
    if released != acted:
        return None
    for name in ranks:
        view = views[name]
        hold = view.hold
        if (rejoins(multi, acted, ran.get(name), view.running) and view.desired == "running" and hold is not None
                and hold.kind == HoldKind.COORDINATION and hold.data.get("rejoin") == acted):  # fmt: skip
            return name
    return None


def settle(current: GangRecord, now: float, spec: RestartSpec, healthy_since: float) -> GangRecord | None:
    """The group ran stably since `healthy_since`: clear its crash loop (None when there is nothing to clear).

    Written by any member that sees it (a transaction again), and only when it changes something, so a healthy
    cluster writes nothing."""
    tracker = RestartTracker.from_dict(current.policy, spec)
    if not (tracker.consecutive_failures or tracker.failure_times):
        return None
    tracker.healthy_since = healthy_since
    if not tracker.record_healthy(now):
        return None
    return replace(current, policy=tracker.to_dict())


# ---- barriers -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BarrierState:
    released: bool
    arrived: tuple[str, ...]
    missing: tuple[str, ...]
    overdue: bool
    """Waited longer than the timeout: say which nodes are missing (and keep waiting: never half-start)."""

    def describe(self, group: str, generation: int, waited_s: float) -> str:
        if self.released:
            return f"group {group} generation {generation}: every node arrived ({', '.join(self.arrived)})"
        return (f"group {group} generation {generation}: waiting {waited_s:.0f}s at the start barrier for "
                f"{', '.join(self.missing)} ({len(self.arrived)}/{len(self.arrived) + len(self.missing)} "
                "arrived)")  # fmt: skip


def barrier_state(expected: tuple[str, ...] | list[str], arrived: set[str] | list[str], waited_s: float,
                  timeout_s: float) -> BarrierState:  # fmt: skip
    """Released once every node of the group arrived for this generation; arrivals of others are ignored."""
    have = tuple(n for n in expected if n in set(arrived))
    missing = tuple(n for n in expected if n not in set(arrived))
    return BarrierState(not missing, have, missing, bool(missing) and waited_s >= timeout_s)


# ---- pause, redeploy, commands -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PauseInfo:
    by: str
    at: float
    reason: str = ""
    scope: str = "cluster"


def effective_pause(local: dict[str, Any] | None, cluster: dict[str, Any] | None) -> PauseInfo | None:
    """Paused if the node or the whole cluster is; the cluster's pause is named first (it is wider)."""
    for scope, info in (("cluster", cluster), ("node", local)):
        if info:
            return PauseInfo(str(info.get("by", "?")), float(info.get("at") or 0.0), str(info.get("reason", "")),
                             scope)  # fmt: skip
    return None


@dataclass(frozen=True)
class RedeployRecord:
    id: str
    reason: str
    by: str
    at: float
    phase: str = "stopping"
    """stopping (every agent stops vLLM, then its worker, and acks) → wiping (the master archives and wipes
    etcd's data) → done (everything starts in order through the barriers)."""
    epoch: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "reason": self.reason, "by": self.by, "at": self.at, "phase": self.phase,
                "epoch": self.epoch}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Any) -> RedeployRecord | None:
        if not isinstance(data, dict) or not data.get("id"):
            return None
        return cls(str(data["id"]), str(data.get("reason", "")), str(data.get("by", "")),
                   float(data.get("at") or 0.0), str(data.get("phase", "stopping")),
                   str(data.get("epoch", "")))  # fmt: skip


def redeploy_duty(record: RedeployRecord | None, done_ids: set[str]) -> str | None:
    """What this agent must do for the cluster redeploy in etcd: `stop` (and ack), `start` (it is done: start
    again through the barriers), or None (nothing new)."""
    if record is None or record.id in done_ids:
        return None
    return "start" if record.phase == "done" else "stop"


def may_wipe(acked: set[str], live_members: set[str], waited_s: float, timeout_s: float) -> bool:
    """The master wipes etcd's data once every live member acked it stopped (a dead agent cannot ack and is
    not waited for beyond the timeout: it joins the redeploy when it comes back)."""
    return live_members <= acked or waited_s >= timeout_s


COMMAND_ACTIONS = ("start", "stop", "restart")


class CommandOutcome(StrEnum):
    """How a remote command ended. Its exit code (`nodeagentctl --node N ...`) comes from the outcome, never
    from the message's words (an action named "…component…" once read as an unknown component)."""

    DONE = "done"
    FAILED = "failed"
    """The node refused it (paused, held…), failed it, or did not answer."""
    BAD_REQUEST = "bad_request"
    """Not a command: not a JSON object, or an unknown action."""
    UNKNOWN_COMPONENT = "unknown_component"

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES[self]


_EXIT_CODES = {CommandOutcome.DONE: 0, CommandOutcome.FAILED: 1, CommandOutcome.BAD_REQUEST: 2,
               CommandOutcome.UNKNOWN_COMPONENT: 4}  # fmt: skip


@dataclass(frozen=True)
class CommandResult:
    outcome: CommandOutcome
    message: str

    def to_dict(self) -> dict[str, Any]:
        """The wire format: the command key's `result` and the API's answer (`ok`, `code`, `message`)."""
        return {"ok": self.outcome is CommandOutcome.DONE, "code": self.outcome.exit_code, "message": self.message}


def command_error(body: Any, components: list[str]) -> CommandResult | None:
    """Why a remote command cannot be carried out, or None (checked on the target, against its own config)."""
    if not isinstance(body, dict):
        return CommandResult(CommandOutcome.BAD_REQUEST, "a command must be a JSON object")
    action, comp = body.get("action"), body.get("component")
    if action not in COMMAND_ACTIONS:
        return CommandResult(CommandOutcome.BAD_REQUEST,
                             f"unknown action {action!r} (expected one of: {', '.join(COMMAND_ACTIONS)})")
    if comp not in components:
        return CommandResult(CommandOutcome.UNKNOWN_COMPONENT,
                             f"unknown component {comp!r} (this node runs: {', '.join(components)})")
    return None

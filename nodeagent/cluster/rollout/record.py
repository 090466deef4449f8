"""A rollout as etcd holds it: the record (`rollout` key) with its ordered steps, each step's phase and the marks
the agents added — data only; what moves it is `rollout_rules`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nodeagent.cluster.rollout.plan import Options, Plan
from nodeagent.cluster.rollout.states import ENDED, FINAL, Phase, Status

HISTORY = 60


def rollout_key(cluster: str) -> str:
    return f"/dsv4-agent/{cluster}/rollout"


def report_prefix(cluster: str) -> str:
    return f"/dsv4-agent/{cluster}/rollout_nodes/"


@dataclass(frozen=True)
class Step:
    groups: tuple[str, ...]
    kinds: tuple[str, ...]
    from_hash: str
    to_hash: str
    rollback: bool = False
    """An operator's rollback of a step that was done: back to the previous file, no bake."""
    failed: str = ""
    """Why this step failed: it is turning back (from and to swapped)."""
    phase: Phase = Phase.PENDING
    since: float = 0.0
    started: float | None = None
    finished: float | None = None
    drained: tuple[str, ...] = ()
    staged: tuple[str, ...] = ()
    stage_errors: Mapping[str, str] = field(default_factory=dict)
    canary: Mapping[str, str] = field(default_factory=dict)
    """group → "ok" or why not, written by the group's head."""
    bake: Mapping[str, str] = field(default_factory=dict)
    """group → why its bake failed (errors, TTFT: `rollout_bake`), written by the group's head."""
    proxy_out: bool = False
    proxy_in: bool = False
    base: Mapping[str, int] = field(default_factory=dict)
    """group → its generation before our restart."""
    outage: tuple[str, ...] = ()
    expected_outage_s: float | None = None
    note: str = ""
    unlisted: bool = False
    """An exclusive rollout's step: the proxy lists none of its groups any more (deleted, not only told to):
    their ranks may start on the other file (`proxy_wait`)."""
    out_at: float | None = None
    """When the proxy stopped routing to the step's groups (its `proxy_out` mark)."""
    in_at: float | None = None
    """When it routed to them again (`proxy_in`): `in_at - out_at` is what the step really cost the proxy."""
    phase_s: Mapping[str, float] = field(default_factory=dict)
    """Seconds spent in each phase it left: drain and stop (draining, staging), load (restarting), canary
    (gating), proxy re-add (rejoining) — what the next rollout's estimate is made of (`rollout_view`)."""

    @property
    def out_of_proxy_s(self) -> float | None:
        """The step's measured time out of the proxy (None until it is back in)."""
        return None if self.out_at is None or self.in_at is None else round(self.in_at - self.out_at, 3)

    @property
    def in_progress(self) -> bool:
        return self.phase not in (Phase.PENDING, *ENDED)

    def to_dict(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "kinds": list(self.kinds), "from": self.from_hash, "to": self.to_hash,
                "rollback": self.rollback, "failed": self.failed, "phase": self.phase, "since": self.since,
                "started": self.started, "finished": self.finished, "drained": list(self.drained),
                "staged": list(self.staged), "stage_errors": dict(self.stage_errors),
                "canary": dict(self.canary), "bake": dict(self.bake), "proxy_out": self.proxy_out,
                "proxy_in": self.proxy_in, "base": dict(self.base),
                "outage": list(self.outage), "expected_outage_s": self.expected_outage_s,
                "note": self.note, "unlisted": self.unlisted, "out_at": self.out_at, "in_at": self.in_at,
                "phase_s": dict(self.phase_s), "out_of_proxy_s": self.out_of_proxy_s}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Step:
        return cls(tuple(d["groups"]), tuple(d.get("kinds", ())), str(d["from"]), str(d["to"]),
                   bool(d.get("rollback")), str(d.get("failed", "")), Phase(d.get("phase", "pending")),
                   float(d.get("since") or 0.0), d.get("started"), d.get("finished"), tuple(d.get("drained", ())),
                   tuple(d.get("staged", ())), dict(d.get("stage_errors") or {}), dict(d.get("canary") or {}),
                   dict(d.get("bake") or {}), bool(d.get("proxy_out")), bool(d.get("proxy_in")),
                   {k: int(v) for k, v in (d.get("base") or {}).items()}, tuple(d.get("outage", ())),
                   d.get("expected_outage_s"), str(d.get("note", "")), bool(d.get("unlisted")),
                   d.get("out_at"), d.get("in_at"),
                   {k: float(v) for k, v in (d.get("phase_s") or {}).items()})  # fmt: skip

    def nodes(self, group_nodes: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
        return tuple(n for g in self.groups for n in group_nodes.get(g, ()))


@dataclass(frozen=True)
class Record:
    id: str
    by: str
    at: float
    old_hash: str
    new_hash: str
    options: Options
    steps: tuple[Step, ...]
    status: Status = Status.RUNNING
    message: str = ""
    plan: Mapping[str, Any] = field(default_factory=dict)
    """The plan as made (changes and why), for status."""
    history: tuple[tuple[float, str], ...] = ()
    exclusive: bool = False
    """Old and new groups are never routed together (an incompatible prefill↔decode change): `fence`."""
    new_shared: str = ""
    """The new file's `cluster_hash` as member records publish it (its shared sections): the rollout is done once
    every member publishes it ("": a record from an agent that did not wait for that)."""
    old_shared: str = ""
    """The running file's `cluster_hash` at the start: with `new_shared`, what tells a rank's launched file
    (`rollout.running`) as old or new ("": a record from an agent that did not store it)."""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "by": self.by, "at": self.at, "old_hash": self.old_hash, "new_hash": self.new_hash,
                "options": self.options.to_dict(), "steps": [s.to_dict() for s in self.steps],
                "status": self.status, "message": self.message, "plan": dict(self.plan),
                "history": [list(h) for h in self.history], "exclusive": self.exclusive,
                "new_shared": self.new_shared, "old_shared": self.old_shared}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Any) -> Record | None:
        if not isinstance(d, dict) or not d.get("id"):
            return None
        try:
            return cls(str(d["id"]), str(d.get("by", "")), float(d.get("at") or 0.0), str(d["old_hash"]),
                       str(d["new_hash"]), Options.from_dict(d.get("options") or {}),
                       tuple(Step.from_dict(s) for s in d.get("steps", ())), Status(d.get("status", "running")),
                       str(d.get("message", "")), dict(d.get("plan") or {}),
                       tuple((float(t), str(m)) for t, m in d.get("history", ())),
                       bool(d.get("exclusive")), str(d.get("new_shared") or ""),
                       str(d.get("old_shared") or ""))  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def active(self) -> bool:
        return self.status not in FINAL

    @property
    def finishing(self) -> bool:
        """Every step done, the rollout not yet: the members no step touched take the new file now."""
        return self.status == Status.RUNNING and bool(self.steps) and all(s.phase == Phase.DONE for s in self.steps)

    def current(self) -> int | None:
        """The step in progress, else the next pending one (None: every step ended)."""
        for i, s in enumerate(self.steps):
            if s.in_progress:
                return i
        for i, s in enumerate(self.steps):
            if s.phase == Phase.PENDING:
                return i
        return None

    def say(self, now: float, message: str, status: Status | None = None) -> Record:
        return replace(self, message=message, status=status or self.status,
                       history=(*self.history, (now, message))[-HISTORY:])

    def with_step(self, index: int, step: Step) -> Record:
        return replace(self, steps=(*self.steps[:index], step, *self.steps[index + 1:]))


def new_record(rid: str, by: str, now: float, plan: Plan, new_shared: str = "", old_shared: str = "") -> Record:
    steps = tuple(Step(s.groups, s.kinds, plan.old_hash, plan.new_hash, outage=s.outage,
                       expected_outage_s=s.expected_outage_s, note=s.note) for s in plan.steps)  # fmt: skip
    return Record(rid, by, now, plan.old_hash, plan.new_hash, plan.options, steps, plan=plan.to_dict(),
                  exclusive=plan.exclusive, new_shared=new_shared, old_shared=old_shared).say(
        now, f"rollout {rid} planned by {by}: {len(steps)} step(s)")

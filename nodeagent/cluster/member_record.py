"""The member record other nodes read (`nodes/<name>`), built from the node's `NodeView` and the layers' typed
`MemberReport`, never from `/status`: the record is a protocol between agents (of this version and the previous
one), /status is the API's, and renaming a key of one must not change the other. `to_wire` writes the keys the
previous version wrote (pure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodeagent.seam.stackport import ComponentView, MemberReport, NodeView


@dataclass(frozen=True)
class MemberHold:
    """Why a component without a process waits to start, as a peer's `--wait` needs it."""

    kind: str
    reason: str
    resolves_itself: bool
    """A `restart --wait` elsewhere ends early on a hold that does not."""


@dataclass(frozen=True)
class MemberComponent:
    """One component as the other nodes see it."""

    state: str
    pid: int | None
    ready: bool
    has_load: bool = False
    """It loaded here before, or loads now: `last_load_s` (and `load` while loading) are published."""
    last_load_s: float | None = None
    load: str | None = None
    """While loading: a short line, whole minutes (a loading rank does not rewrite its key every second)."""
    hold: MemberHold | None = None
    file: str | None = None
    """The cluster file (`cluster_file_hash`) its process was launched with, when known."""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "pid": self.pid, "ready": self.ready}
        if self.has_load:
            out["last_load_s"] = self.last_load_s
            if self.load is not None:
                out["load"] = self.load
        if self.file is not None:
            out["file"] = self.file
        if self.hold is not None:
            out["hold"] = {"kind": self.hold.kind, "reason": self.hold.reason,
                           "resolves_itself": self.hold.resolves_itself}  # fmt: skip
        return out


@dataclass(frozen=True)
class MemberRecord:
    """This node's member record: the config's facts (`static`), the node's state, the layers' reports."""

    static: Mapping[str, Any]
    """What changes only with the config (`membership.static_facts`): name, ip, role, group, ranks, version…"""
    wall_clock: float
    paused: bool
    components: Mapping[str, MemberComponent]
    agent: Mapping[str, Any]
    """Which agent process writes it (`membership.Identity`)."""
    isolated: str | None = None
    """Why the node is isolated (NPU users stay stopped); None: it is not."""
    gangs: Mapping[str, Any] = field(default_factory=dict)
    kv_transfers: Sequence[Sequence[Any]] = ()

    def to_wire(self) -> dict[str, Any]:
        """The JSON the key holds: the same keys as the previous version's (its agents read it)."""
        return {**self.static, "wall_clock": self.wall_clock, "paused": self.paused,
                "components": {n: c.to_wire() for n, c in self.components.items()}, "gangs": dict(self.gangs),
                "agent": dict(self.agent), "isolated": self.isolated,
                "kv_transfers": [list(t) for t in self.kv_transfers]}  # fmt: skip


def load_line(left_s: float | None) -> str:
    """A loading component's line for the others: whole minutes left, or why there is no estimate."""
    if left_s:
        return f"~{max(1, round(left_s / 60))} min left"
    return "longer than usual" if left_s == 0 else "loading, first time"


def member_component(view: ComponentView) -> MemberComponent:
    hold = view.hold if view.pid is None else None  # a hold is shown only while no process runs
    return MemberComponent(
        state=view.state, pid=view.pid, ready=view.ready,
        has_load=view.last_load_s is not None or view.loading, last_load_s=view.last_load_s,
        load=load_line(view.load_left_s) if view.loading else None,
        hold=MemberHold(str(hold.kind), hold.reason, hold.resolves_itself) if hold is not None else None,
        file=view.launched_file if view.pid is not None else None,
    )  # fmt: skip


def isolated_of(node: NodeView) -> str | None:
    recovery = node.recovery
    return recovery.get("reason") if recovery is not None and recovery.get("state") == "isolated" else None


def member_record(static: Mapping[str, Any], node: NodeView, report: MemberReport, agent: Mapping[str, Any],
                  wall_clock: float) -> MemberRecord:  # fmt: skip
    """The record from the node's view and the layers' report (pure)."""
    return MemberRecord(static=static, wall_clock=wall_clock, paused=node.paused,
                        components={n: member_component(c) for n, c in node.components.items()},
                        agent=agent, isolated=isolated_of(node), gangs=report.gangs or {},
                        kv_transfers=report.kv_transfers or ())  # fmt: skip

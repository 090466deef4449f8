"""The smallest blast radius, written once: what a node redeploy of each failure class may stop, clean and start.

A node redeploy was the guide's whole recovery — stop everything, clean all residue, start everything — whatever
failed. On a shared node that costs far more than the failure: `podman kill` of the node's container stopped and
restarted the host's etcd (on the master, etcd of every member), and a worker's failures took etcd with them. The
rule here is the one every path that redeploys asks (`Supervisor.request_redeploy`; container mode through
`NodePort.redeploy`), decided over plain values so it is tested per class without a process:

- a dead or replaced container: only what ran inside it, never a host component;
- a component's failures escalated by the restart policy (`redeploy_after_failures`, the failed state's retry):
  that component and what restarts with it (`policy.restarts_with`: a `process` on its dependency), never what it
  depends on — a worker failure never restarts etcd, a rank (vLLM) failure never restarts the worker;
- an operator's `nodeagentctl redeploy`: the whole node, as asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Blast(StrEnum):
    """The failure classes a node redeploy comes from."""

    CONTAINER = "container"
    COMPONENT = "component"
    OPERATOR = "operator"


RULES: Mapping[Blast, str] = {
    Blast.CONTAINER: "what ran inside the container; never a host component (etcd on the host keeps its PID)",
    Blast.COMPONENT: "the failed component and what restarts with it; never what it depends on",
    Blast.OPERATOR: "the whole node, in order (asked for)",
}
"""Each class's rule in words (docs/architecture.md shows this table; the redeploy event names the class)."""


@dataclass(frozen=True)
class Member:
    """What the rule reads of one component of the node."""

    name: str
    inside: bool = False
    """It runs inside the node's container (container mode)."""
    follows: Mapping[str, bool] = field(default_factory=dict)
    """Each dependency's name → does this component restart when it restarts (`policy.restarts_with`)."""


def redeploy_scope(blast: Blast, members: Sequence[Member], origin: str | None = None) -> tuple[str, ...]:
    """The components a redeploy of this class may touch, in the members' (start) order. `origin`: the component
    whose failure escalated (`Blast.COMPONENT`); an unknown one touches nothing."""
    if blast is Blast.OPERATOR:
        return tuple(m.name for m in members)
    if blast is Blast.CONTAINER:
        return tuple(m.name for m in members if m.inside)
    touched = {origin} if any(m.name == origin for m in members) else set()
    for m in members:  # start order: a dependency comes before what follows it
        if any(follows and dep in touched for dep, follows in m.follows.items()):
            touched.add(m.name)
    return tuple(m.name for m in members if m.name in touched)

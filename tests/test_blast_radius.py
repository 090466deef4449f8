"""The smallest blast radius (`nodeagent.node.blast_radius`), per failure class, without a process; and container mode
asking the node for a redeploy of what ran inside instead of writing the node's counters."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nodeagent.config.load import parse_config
from nodeagent.container.mode import ContainerMode
from nodeagent.node.blast_radius import RULES, Blast, Member, redeploy_scope

# The guide's stack in container mode: etcd on the host, the worker and vLLM inside; the PD proxy on the host
# follows vLLM (an edge with restart_with: true), vLLM does not follow its worker, nothing follows etcd.
STACK = [
    Member("etcd"),
    Member("datasystem", inside=True, follows={"etcd": False}),
    Member("vllm", inside=True, follows={"datasystem": False}),
    Member("proxy", follows={"vllm": True}),
]


def test_a_dead_container_touches_only_what_ran_inside_never_host_etcd() -> None:
    assert redeploy_scope(Blast.CONTAINER, STACK) == ("datasystem", "vllm")
    assert redeploy_scope(Blast.CONTAINER, [Member("etcd"), Member("proxy")]) == ()


def test_a_worker_failure_never_restarts_etcd() -> None:
    assert redeploy_scope(Blast.COMPONENT, STACK, "datasystem") == ("datasystem",)
    follows = [STACK[0], STACK[1], Member("vllm", True, {"datasystem": True}), STACK[3]]
    assert redeploy_scope(Blast.COMPONENT, follows, "datasystem") == ("datasystem", "vllm", "proxy"), (
        "what restarts with the worker (an edge says so) goes with it, transitively")


def test_a_rank_failure_never_restarts_the_worker() -> None:
    assert redeploy_scope(Blast.COMPONENT, STACK, "vllm") == ("vllm", "proxy")
    assert redeploy_scope(Blast.COMPONENT, STACK, "etcd") == ("etcd",), "a local etcd restart keeps the worker"
    assert redeploy_scope(Blast.COMPONENT, STACK, "gone") == ()


def test_an_operators_node_redeploy_is_the_whole_node_in_order() -> None:
    assert redeploy_scope(Blast.OPERATOR, STACK) == ("etcd", "datasystem", "vllm", "proxy")
    assert set(RULES) == set(Blast), "every class has its rule in words (docs/architecture.md)"


def test_container_mode_asks_the_node_for_a_redeploy_of_what_ran_inside(tmp_path: Path) -> None:
    """`podman kill` of the container made a node redeploy that stopped host etcd (on the master: etcd of every
    member). The container's recovery now asks the node (`NodePort.redeploy`) for its own components only; the
    node counts it as a node redeploy in its own policy."""
    from nodeagent.node.supervisor import Supervisor

    cfg = parse_config(
        f"node: {{name: n1, ip: 127.0.0.1}}\nagent: {{state_dir: {tmp_path}/state, log_dir: {tmp_path}/logs}}\n"
        "container: {engine: docker, name: dsv4}\ncomponents:\n"
        "  etcd: {kind: etcd, container: false, data_dir: /srv/etcd}\n"
        "  datasystem: {kind: datasystem, workdir: /srv/yr, liveness_check_path: /srv/yr/liveness,\n"
        "               depends_on: [etcd]}\n", "c.yaml")  # fmt: skip
    sup = Supervisor(cfg, container=ContainerMode)
    assert sup.container is not None
    stopped: list[tuple[str, ...]] = []

    async def redeploy(reason: str, scope: tuple[str, ...] | None = None) -> None:
        stopped.append(tuple(sup.order) if scope is None else scope)

    sup._redeploy = redeploy  # type: ignore[method-assign]

    async def main() -> None:
        sup.container._redeploy("container exited: exit code 137")  # type: ignore[union-attr]
        assert sup.redeploying is not None
        await sup.redeploying

    asyncio.run(main())
    assert stopped == [("datasystem",)], "host etcd is not stopped for a dead container"
    assert sup.redeploys.redeploys_total == 1, "counted by the node's restart policy"
    assert any(e.event == "container_redeploy" and "node redeploy of datasystem" in e.message
               for e in sup.events.recent)  # fmt: skip

"""Issue 33: a dead rank leaves the PD proxy at once, told by the node that saw it die (`cluster.proxy_evict`) — not
a member record's round trip through etcd later, and not never while etcd is unreachable. No process: the agents
of `cluster_fakes.World` on a virtual clock, vllm-ascend's proxy as `FakeProxy`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cluster_fakes import World

from nodeagent.cluster.proxy_evict import fallen, proxy_url
from nodeagent.config.layout import ProxyPlan
from nodeagent.core.states import State
from nodeagent.seam.stackport import ComponentView

GROUPS = [{"name": "p0", "kind": "prefill", "nodes": ["n0"]}, {"name": "p1", "kind": "prefill", "nodes": ["n1"]},
          {"name": "d0", "kind": "decode", "nodes": ["n2"]}, {"name": "d1", "kind": "decode", "nodes": ["n3"]}]
"""The fault campaign's cluster: the proxy on n0 beside p0, each decode group on a node of its own."""
BOUND_S = 0.05
"""How long after the exit a dead rank may still be routed to: the node's own event, one local HTTP call."""


def view(name: str, state: State) -> ComponentView:
    return ComponentView(name=name, kind="vllm", state=state, running=state != State.STOPPED, up=False,
                         ready=False, desired="running", deps=(), deps_up=True, restart=None)  # type: ignore[arg-type]


def test_a_rank_that_served_and_is_now_stopping_or_gone_has_fallen() -> None:
    now = {"a": view("a", State.STOPPING), "b": view("b", State.READY), "c": view("c", State.FAILED),
           "d": view("d", State.STOPPING)}  # fmt: skip
    assert fallen({"a", "b", "c"}, now) == {"a", "c"}, "d was not alive at the last look (draining, starting)"
    assert fallen(set(), now) == set()


def test_the_proxy_is_dialled_at_its_nodes_address_when_it_binds_a_wildcard() -> None:
    plan = ProxyPlan("proxy", "n0", "0.0.0.0", 8000, (), ())
    assert proxy_url(plan, "n2", {"n0": "10.0.0.5"}) == "http://10.0.0.5:8000"
    assert proxy_url(plan, "n0", {"n0": "10.0.0.5"}) == "http://127.0.0.1:8000"
    assert proxy_url(ProxyPlan("proxy", "n0", "10.0.0.7", 8000, (), ()), "n2", {}) == "http://10.0.0.7:8000"
    local = ProxyPlan("proxy", "n0", "127.0.0.1", 8000, (), ())
    assert proxy_url(local, "n2", {"n0": "10.0.0.5"}) is None, "n2's own loopback is not n0's proxy"
    assert proxy_url(local, "n2", {"n0": "127.0.0.1"}) == "http://127.0.0.1:8000", "one host (the campaign)"


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path / "w", ["n0", "n1", "n2", "n3"], GROUPS, proxy=True)
    w.start()
    try:
        await w.until("every component up", w.all_up, within=120)
        assert w.proxy is not None
        proxy = w.proxy
        every = {e for n in ("n0", "n1", "n2", "n3") for e in w.stacks[n].endpoints()}
        await w.until("every group routed", lambda: set().union(*proxy.routed.values()) >= every)
        yield w
    finally:
        await w.close()


def left_at(world: World, kind: str, endpoint: str, since: float) -> float | None:
    """When the proxy stopped routing requests of `kind` to `endpoint` after `since` (None: it still does)."""
    assert world.proxy is not None
    for when, serving in world.proxy.timeline:
        if when >= since and endpoint not in serving[kind]:
            return when
    return None


@pytest.mark.parametrize("etcd", ["reachable", "unreachable"])
@pytest.mark.parametrize("where", [("n2", "d0", "decode"), ("n0", "p0", "prefill")])
async def test_a_dead_rank_leaves_the_proxy_at_once_even_with_etcd_away(world: World, etcd: str,
                                                                          where: tuple[str, str, str]) -> None:
    """The campaign's finding: a killed decode rank answered 5 requests 200-empty in the 1.5 s before the proxy
    dropped it (its member record, then the proxy sync), and while etcd is unreachable the proxy routes to a dead
    rank for the whole outage. Now: within BOUND_S of the exit, under load (the proxy taints it) — a rank on
    another node than the proxy's, and one beside it."""
    node, group, kind = where
    assert world.proxy is not None
    world.proxy.busy = True  # steady traffic: a removal taints the instance (no new request), it stays listed
    if etcd == "unreachable":
        world.store.set_reachable(False)
        await world.advance(2)
    (endpoint,) = world.agents[node].coordinator.layout.group(group).endpoints
    died = world.clock.monotonic()
    world.stacks[node].crash("vllm")
    await world.advance(0.01)
    assert endpoint not in world.proxy.serving(kind), f"{group} still routed {etcd=}"
    when = left_at(world, kind, endpoint, died)
    assert when is not None and when - died <= BOUND_S, (when, died)
    events = world.stacks[node].events_of("proxy_evict")
    assert events and f"group {group} removed from proxy" in events[-1]["message"], events


async def test_a_rank_its_node_removed_comes_back_only_once_its_member_record_says_ready(world: World) -> None:
    """Re-adding stays the sync's, gated on the member records: with etcd away the proxy's node still sees the dead
    rank's group healthy (its last record), and its reconcile found the instance gone from an idle proxy — it
    re-added it at once, to a rank that was dead or still loading. It is kept out until the record changes: after
    etcd is back, once the record shows the restarted rank ready."""
    assert world.proxy is not None
    world.store.set_reachable(False)
    await world.advance(2)
    (endpoint,) = world.agents["n2"].coordinator.layout.group("d0").endpoints
    world.stacks["n2"].crash("vllm")
    await world.advance(0.01)
    assert endpoint not in world.proxy.routed["decode"], "an idle proxy deletes it at once"
    await world.advance(30)  # three reconciles of the sync; the rank restarted here meanwhile (a one-node group)
    assert world.stacks["n2"].started("vllm") == 2 and world.stacks["n2"].components["vllm"].ready
    assert endpoint not in world.proxy.routed["decode"], "re-added on a member record from before the death"
    sync = world.agents["n0"].coordinator.proxies[0]
    assert "removed by its node" in sync.health["d0"], sync.health
    world.store.set_reachable(True)
    await world.until("d0 routed again", lambda: endpoint in world.proxy.serving("decode"), within=30)
    assert not sync.evicted


async def test_a_node_removes_only_what_the_proxy_lists_or_a_busy_proxy_never_routes_the_group_again(
        world: World) -> None:
    """The campaign's seed 3307: the sync had taken d0 out of an idle proxy; then, under load, d0's rank died and
    its node asked the proxy to remove it again. vllm-ascend's proxy, busy, taints whatever it is asked to remove,
    listed or not; adding the restarted rank back then crashed its activation thread (`KeyError` in `_push_heap`)
    and d0 was never routed again. The node asks for what the proxy lists first and removes only that."""
    proxy = world.proxy
    assert proxy is not None
    (endpoint,) = world.agents["n2"].coordinator.layout.group("d0").endpoints
    n2 = world.stacks["n2"]
    n2.block_ready("vllm", "test", "a probe fails")
    await world.until("the sync took d0 out of the idle proxy", lambda: endpoint not in proxy.routed["decode"], 30)
    proxy.busy = True
    n2.crash("vllm")
    await world.advance(0.01)
    assert proxy.tainted["decode"] == set(), "nothing the proxy does not list is removed"
    assert "group d0 already out of proxy" in n2.events_of("proxy_evict")[-1]["message"]
    n2.block_ready("vllm", "test", None)
    await world.until("d0 routed again", lambda: endpoint in proxy.serving("decode"), within=60)
    assert not proxy.activation_dead

"""Losing etcd must never stop a serving stack — its return neither. The fault campaign (seed 3305) found the proxy
sync taking every group out of the PD proxy each time etcd came back: after a wipe every member's ack named the old
store's generation ("n0 runs generation 4, the group is at 1": 57 requests failed), and after etcd was stopped past
the members' lease TTL a member whose key was not written again yet "had no agent" (73 failed). No process: the
sync over hand-made member records, gang records and etcd connection states, a fake proxy and clock."""

from __future__ import annotations

from typing import Any

from nodeagent.cluster.proxy_sync import ProxySync, group_healthy, settled_members
from nodeagent.cluster.rules import GangRecord
from nodeagent.cluster.store import ConnectionState
from nodeagent.config.layout import Group, NodeSlice, ProxyPlan, VllmProcess
from nodeagent.config.model import RestartSpec
from nodeagent.core.states import State
from nodeagent.seam.stackport import ComponentView

SETTLE_S = 3.0


def group(name: str, kind: str, node: str, endpoint: str) -> Group:
    proc = VllmProcess("vllm", node, 0, 1, None, False, int(endpoint.rsplit(":", 1)[1]), endpoint)
    return Group(name, kind, "internal", (node,), 1, 1, "127.0.0.1", 0, "kv_both", None, None,
                 (NodeSlice(node, 0, 1, ("vllm",)),), (proc,))  # fmt: skip


GROUPS = [group("p0", "prefill", "n0", "127.0.0.1:8100"), group("p1", "prefill", "n1", "127.0.0.1:8101"),
          group("d0", "decode", "n2", "127.0.0.1:8200"), group("d1", "decode", "n3", "127.0.0.1:8201")]
NODE_OF = {"p0": "n0", "p1": "n1", "d0": "n2", "d1": "n3"}


def member(gen: int, epoch: str | None, name: str) -> dict[str, Any]:
    ack: dict[str, Any] = {"generation": gen} if epoch is None else {"generation": gen, "epoch": epoch}
    return {"components": {"vllm": {"state": State.READY.value, "ready": True}}, "gangs": {name: ack}}


def test_an_ack_of_another_store_incarnation_is_no_old_generation() -> None:
    p0 = GROUPS[0]
    assert group_healthy(p0, {"n0": member(4, "old", "p0")}, 1, "new") == (True, "")
    ok, why = group_healthy(p0, {"n0": member(4, "new", "p0")}, 1, "new")
    assert not ok and "runs generation 4, the group is at 1" in why
    assert not group_healthy(p0, {"n0": member(4, None, "p0")}, 1, "new")[0], "an ack without epoch is judged"
    assert not group_healthy(p0, {"n0": member(4, "", "p0")}, 1, "new")[0], "nor one of an agent yet to act"


def test_while_etcd_settles_a_member_not_written_again_counts_as_it_last_was() -> None:
    last = {"n0": {"a": 1}, "n1": {"b": 2}}
    assert settled_members({"n0": {"a": 3}}, last, settling=True) == {"n0": {"a": 3}, "n1": {"b": 2}}
    assert settled_members({"n0": {"a": 3}}, last, settling=False) == {"n0": {"a": 3}}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


class World:
    """One proxy sync: what it reads is plain data the test changes; what it posts is recorded."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.members = {NODE_OF[g.name]: member(1, "e1", g.name) for g in GROUPS}
        self.records = {g.name: GangRecord(generation=1, epoch="e1") for g in GROUPS}
        self.connection = ConnectionState(True, "http://etcd:2379", None, since=1.0)
        self.posts: list[tuple[str, dict[str, Any]]] = []
        self.routed = {k: {e for g in GROUPS if g.kind == k for e in g.endpoints} for k in ("prefill", "decode")}
        plan = ProxyPlan("proxy", "n0", "127.0.0.1", 18020, tuple(sorted(self.routed["prefill"])),
                         tuple(sorted(self.routed["decode"])))  # fmt: skip
        view = ComponentView(name="proxy", kind="proxy", state=State.READY, running=True, up=True, ready=True,
                             desired="running", deps=(), deps_up=True, restart=RestartSpec(), pid=42)  # fmt: skip
        self.sync = ProxySync(plan, GROUPS, lambda: view, lambda: self.members, lambda: self.records,
                              lambda *a, **k: None, lambda _r: None, self.clock, self.post,  # type: ignore[arg-type]
                              lambda: self.connection, SETTLE_S)  # fmt: skip

    async def post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        what = url.rsplit("/", 1)[1]
        self.posts.append((what, body))
        if what == "remove":
            self.routed[body["type"]] -= set(body["instances"])
        else:
            self.routed[body["type"]] |= set(body["instances"])
        return {f"current_{k}_instances": sorted(v) for k, v in self.routed.items()}

    def removed(self) -> list[str]:
        return [e for what, body in self.posts if what == "remove" for e in body["instances"]]

    async def step(self, after_s: float = 1.0) -> None:
        self.clock.now += after_s
        await self.sync.step()


async def test_etcd_back_wiped_takes_no_group_out_of_the_proxy() -> None:
    w = World()
    await w.step()
    assert not w.removed() and all(not why for why in w.sync.health.values())
    # etcd restarted empty: a new epoch, generations start again; the members' acks still name the old one
    w.connection = ConnectionState(True, "http://etcd:2379", None, since=50.0)
    w.records = {g.name: GangRecord(generation=1, epoch="e2") for g in GROUPS}
    for g in GROUPS:
        w.members[NODE_OF[g.name]] = member(4, "e1", g.name)
    await w.step()
    assert not w.removed(), w.sync.health


async def test_etcd_back_keeps_a_member_whose_key_is_not_written_again_yet_for_the_settle_time_only() -> None:
    w = World()
    await w.step()
    w.connection = ConnectionState(False, "http://etcd:2379", "timed out", since=40.0)
    await w.step()
    w.connection = ConnectionState(True, "http://etcd:2379", None, since=45.0)  # back; n1's lease had expired
    del w.members["n1"]
    await w.step(0.5)
    await w.step(1.0)
    assert not w.removed(), f"p1 taken out while n1's agent writes its key again: {w.sync.health}"
    await w.step(SETTLE_S)
    assert w.removed() == ["127.0.0.1:8101"], "no key past the settle time: its agent is gone"
    assert "n1 has no agent" in w.sync.health["p1"]


async def test_a_member_gone_while_etcd_stayed_reachable_leaves_the_proxy_at_once() -> None:
    """An agent dead (its lease expired, etcd answering throughout): no settling, as before."""
    w = World()
    await w.step()
    del w.members["n3"]
    await w.step()
    assert w.removed() == ["127.0.0.1:8201"] and "n3 has no agent" in w.sync.health["d1"]


async def test_a_return_between_two_looks_is_seen() -> None:
    """etcd away for less than the sync's period: `since` changed, reachable again at the next look."""
    w = World()
    await w.step()
    w.connection = ConnectionState(True, "http://etcd:2379", None, since=99.0)
    del w.members["n1"]
    await w.step()
    assert not w.removed() and w.sync.settling()


async def test_an_instance_the_proxy_no_longer_lists_is_not_removed_again() -> None:
    """The campaign's seed 3306: n2 removed d0 from the proxy itself as its rank died (`proxy_evict`); the proxy's
    node then saw n2 `starting` and posted a second remove, then the add — vllm-ascend's proxy crashed its
    activation thread on it and never routed d0 again. The sync asks the proxy's lists first."""
    w = World()
    await w.step()
    w.routed["decode"].discard("127.0.0.1:8200")  # taken out by its node (proxy_evict)
    w.members["n2"] = {**w.members["n2"], "components": {"vllm": {"state": State.STARTING.value, "ready": False}}}
    await w.step()
    assert "127.0.0.1:8200" not in w.removed(), w.posts
    assert "127.0.0.1:8200" not in w.sync.applied["decode"]  # type: ignore[index]
    w.members["n2"] = member(1, "e1", "d0")
    await w.step()
    assert ("add", {"type": "decode", "instances": ["127.0.0.1:8200"]}) in w.posts, w.posts

"""Membership on the in-memory store: records, the view, consistency findings and their events, a dead agent's
key expiring, a duplicate name, our own previous incarnation, an outage, and clock skew."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import ClusterHarness
from fakestore import FakeStore

from nodeagent.cluster.membership import Identity, Membership, member_key
from nodeagent.config.load import load_config
from nodeagent.config.model import RestartSpec
from nodeagent.core.events import EventBus
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import ComponentView, Hold, HoldKind, MemberReport, NodeView


class Host:
    """What membership reads of the node (`membership.MemberHost`): its view, the layers' report, its events.
    `components` as a test writes them: state, pid, ready, hold (a `Hold.to_dict()`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.events = EventBus()
        self.base_env: dict[str, str] = {}
        self.components = {"datasystem": {"state": "ready", "pid": 11}, "vllm": {"state": "starting", "pid": 12}}

    def snapshot(self) -> NodeView:
        def view(name: str, c: dict[str, Any]) -> ComponentView:
            h = c.get("hold")
            hold = Hold(HoldKind(h["kind"]), h["reason"], resolves_itself=h["resolves_itself"]) if h else None
            return ComponentView(name=name, kind="vllm", state=c["state"], running=c["pid"] is not None, up=False,
                                 ready=bool(c.get("ready")), desired="running", deps=(), deps_up=True,
                                 restart=RestartSpec(), pid=c["pid"], hold=hold)  # fmt: skip

        return NodeView(node=self.name, paused=False, pause=None, redeploying=False,
                        components={n: view(n, c) for n, c in self.components.items()})  # fmt: skip

    def member_report(self) -> MemberReport:
        return MemberReport()

    def emit(self, kind: str, message: str, component: str | None = None, level: str = "info",
             **data: Any) -> None:  # fmt: skip
        self.events.emit(kind, message, component, level, **data)

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.events.recent if e.event == kind]


async def until(what: str, check: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class StoreClock(Clock):
    """The fake store's wall clock, `ahead_s` seconds off (a skewed node); monotonic time and sleeps are real."""

    def __init__(self, store: FakeStore, ahead_s: float = 0.0) -> None:
        self.store, self.ahead_s = store, ahead_s

    def time(self) -> float:
        return self.store.clock() + self.ahead_s


class Cluster:
    def __init__(self, tmp_path: Path, names: list[str], edit: Callable[[ClusterHarness], None] | None = None) -> None:
        self.harness = ClusterHarness(tmp_path, "127.0.0.1:2379", names, ttl_s=10, heartbeat_s=3600)
        if edit is not None:
            edit(self.harness)
        self.store = FakeStore()
        self.members: dict[str, Membership] = {}
        self.hosts: dict[str, Host] = {}

    def join(self, name: str, ahead_s: float = 0.0, state_dir: str | None = None) -> Membership:
        config = load_config(self.harness.write(name))
        host = Host(name)
        m = Membership(config, host, self.store, clock=StoreClock(self.store, ahead_s))  # type: ignore[arg-type]
        if state_dir is not None:
            m.identity = Identity(m.identity.host, state_dir)
        m.start()
        self.members[name], self.hosts[name] = m, host
        return m

    async def close(self) -> None:
        for m in self.members.values():
            await m.stop(leave=False)


@pytest.fixture
async def cluster(tmp_path: Path) -> Any:
    made: list[Cluster] = []

    def make(names: list[str], edit: Callable[[ClusterHarness], None] | None = None) -> Cluster:
        made.append(Cluster(tmp_path, names, edit))
        return made[-1]

    yield make
    for c in made:
        await c.close()


def present(m: Membership) -> set[str]:
    return {r["name"] for r in m.view()["members"] if r["present"]}


async def test_members_see_each_other_with_their_records(cluster: Any) -> None:
    c = cluster(["n0", "n1", "n2"])
    n0, n1 = c.join("n0"), c.join("n1")
    await until("both see both", lambda: present(n0) == present(n1) == {"n0", "n1"})
    view = n0.view()
    rows = {r["name"]: r for r in view["members"]}
    assert rows["n2"] == {"name": "n2", "ip": "127.0.0.1", "role": "worker", "group": "g-n2",
                          "ranks": {"start": 0, "count": 1}, "present": False, "listed": True}  # fmt: skip
    record = rows["n1"]
    assert record["role"] == "worker" and record["group"] == "g-n1" and record["pythonhashseed"] == {"vllm": "0"}
    assert record["components"]["vllm"] == {"state": "starting", "pid": 12, "ready": False}
    assert record["api_url"] == f"http://127.0.0.1:{c.harness.api_ports['n1']}"
    assert record["cluster_hash"] == rows["n0"]["cluster_hash"] and len(record["cluster_hash"]) == 64
    assert view["missing"] == ["n2"] and view["warnings"] == [], "no 'missing' during the first TTL"
    kv = await c.store.get(member_key(c.harness.cluster_name, "n1"))
    assert kv is not None and kv.lease == n1._lease.id

    # a state change is published (coalesced) and seen by the others
    c.hosts["n1"].components["vllm"] = {"state": "ready", "pid": 12}
    n1.changed()
    await until("the change seen", lambda: {r["name"]: r for r in n0.view()["members"]}["n1"]["components"]["vllm"]
                ["state"] == "ready", timeout=3)  # fmt: skip

    n0.view_since -= 60  # past the start-up grace
    n0._recheck()
    assert [(w["code"], w["node"]) for w in n0.view()["warnings"]] == [("missing", "n2")]
    assert c.hosts["n0"].events_of("cluster_warning")[-1]["data"] == {"code": "missing", "node": "n2"}


async def test_a_dead_agent_leaves_with_its_lease_and_is_flagged_missing(cluster: Any) -> None:
    c = cluster(["n0", "n1"])
    n0, n1 = c.join("n0"), c.join("n1")
    await until("both", lambda: present(n0) == {"n0", "n1"})
    n0.view_since -= 60
    n1.tasks.cancel()  # kill -9: no revoke, no more keepalives
    n1._lease.abandon()
    c.store.advance(9)
    await asyncio.sleep(0.05)
    assert present(n0) == {"n0", "n1"}
    c.store.advance(2)
    await until("n1 gone", lambda: present(n0) == {"n0"})
    assert ("missing", "n1") in {(w["code"], w["node"]) for w in n0.view()["warnings"]}
    n1b = c.join("n1")
    await until("n1 back", lambda: present(n0) == {"n0", "n1"})
    assert n0.view()["warnings"] == [] and c.hosts["n0"].events_of("cluster_warning_cleared")
    assert n1b.view()["conflict"] is None


async def test_hash_seed_of_one_node_is_flagged_everywhere(cluster: Any) -> None:
    def seed(h: ClusterHarness) -> None:
        h.node("n1")["components"]["vllm"]["env"] = {"PYTHONHASHSEED": "1"}

    c = cluster(["n0", "n1"], seed)
    n0, n1 = c.join("n0"), c.join("n1")
    await until("both", lambda: present(n0) == present(n1) == {"n0", "n1"})
    for m in (n0, n1):
        await until("finding", lambda m=m: [(w["code"], w["node"]) for w in m.view()["warnings"]] == [
            ("pythonhashseed", "n1")])  # fmt: skip
    assert n0.status_section()["warnings"][0]["code"] == "pythonhashseed"


async def test_a_burst_of_member_events_costs_one_consistency_check(cluster: Any) -> None:
    """The check reads every member: one per event was O(N²) per agent for N members' heartbeats (it saturated
    the 256-agent simulation). Events coalesce; a reader of the findings never sees them stale."""
    c = cluster(["n0", "n1"])
    n0, n1 = c.join("n0"), c.join("n1")
    await until("both", lambda: present(n0) == {"n0", "n1"})
    checks = 0
    original = n0._recheck

    def counted() -> None:
        nonlocal checks
        checks += 1
        original()

    n0._recheck = counted  # type: ignore[method-assign]
    n0._cancel_recheck()  # re-arm with the counting check
    for pid in range(20):
        c.hosts["n1"].components["vllm"] = {"state": "ready", "pid": 100 + pid}
        await n1._write(n1_record(n1))
    await until("all 20 writes seen", lambda: n0.members["n1"].record["components"]["vllm"]["pid"] == 119)
    assert checks == 0 and n0._recheck_timer is not None, "20 events, no check yet: one is pending"
    n0.view()
    assert checks == 1, "view() ran the one pending check and cancelled the timer"
    c.store.advance(1)
    await n1._write(n1_record(n1))  # a heartbeat: only the clock sample is new
    await until("the heartbeat seen", lambda: n0._recheck_timer is not None)
    assert n0._recheck_due is not None
    left = n0._recheck_due - n0.clock.monotonic()
    assert left > 10, f"a heartbeat alone is checked late ({left:.1f}s), with the other heartbeats"


def n1_record(m: Membership) -> dict[str, Any]:
    from nodeagent.cluster.member_record import member_record

    return member_record(m.static, m.host.snapshot(), m.host.member_report(), m.identity.to_dict(),
                         m.clock.time()).to_wire()


async def test_a_duplicate_name_is_not_overwritten_and_takes_over_once_free(cluster: Any) -> None:
    c = cluster(["n0", "n1"])
    n0, first = c.join("n0"), c.join("n1")
    await until("both", lambda: present(n0) == {"n0", "n1"})
    holder = (await c.store.get(first.key)).mod_revision  # type: ignore[union-attr]
    imposter = Membership(load_config(c.harness.config_path("n1")), Host("n1"), c.store, clock=StoreClock(c.store))
    imposter.identity = Identity("another-host", "/elsewhere")
    imposter.start()
    await until("the duplicate reported", lambda: ("duplicate_name", "n1") in {
        (w["code"], w["node"]) for w in n0.view()["warnings"]})  # fmt: skip
    kv = await c.store.get(first.key)
    assert kv is not None and kv.lease == first._lease.id and kv.json()["agent"]["host"] != "another-host"
    assert kv.mod_revision >= holder and imposter.view()["conflict"]["agent"]["instance"] == first.identity.instance
    await first.stop(leave=True)  # the holder leaves: the imposter claims the name on its next write
    imposter.changed()
    await until("claimed", lambda: (c.store.data.get(first.key) is not None
                                   and c.store.data[first.key].lease == imposter._lease.id))  # fmt: skip
    await until("cleared", lambda: n0.view()["warnings"] == [])
    await imposter.stop()


async def test_own_previous_incarnation_is_taken_over_at_once(cluster: Any) -> None:
    c = cluster(["n0"])
    old = c.join("n0")
    await until("written", lambda: old.writes >= 1)
    old.tasks.cancel()
    old._lease.abandon()  # killed; its key lives on until the TTL
    new = c.join("n0", state_dir=old.identity.state_dir)
    await until("taken over", lambda: c.store.data[new.key].lease == new._lease.id)
    assert new.conflict is None and new.view()["warnings"] == []


async def test_an_outage_neither_raises_nor_blocks_and_is_shown(cluster: Any) -> None:
    c = cluster(["n0", "n1"])
    n0, n1 = c.join("n0"), c.join("n1")
    await until("both", lambda: present(n0) == {"n0", "n1"})
    c.store.set_reachable(False, "connection refused")
    c.hosts["n1"].components["vllm"] = {"state": "ready", "pid": 12}
    n1.changed()
    await asyncio.sleep(0.1)
    state = n0.view()["etcd"]
    assert state["state"] == "unreachable" and state["last_error"] == "connection refused"
    assert present(n0) == {"n0", "n1"}, "the view keeps what it last knew"
    c.store.set_reachable(True)
    await until("the deferred write lands", lambda: {r["name"]: r for r in n0.view()["members"]}["n1"]
                ["components"]["vllm"]["state"] == "ready", timeout=5)  # fmt: skip


async def test_clock_skew_is_measured_on_live_writes(cluster: Any) -> None:
    c = cluster(["n0", "n1", "n2"])
    n0, n1 = c.join("n0"), c.join("n1")
    n2 = c.join("n2", ahead_s=5.0)
    await until("all", lambda: present(n0) == {"n0", "n1", "n2"})
    n2.changed()  # a fresh write
    await until("skew flagged", lambda: ("clock_skew", "n2") in {(w["code"], w["node"]) for w in n0.view()["warnings"]})
    rows = {r["name"]: r for r in n0.view()["members"]}
    assert rows["n2"]["clock_offset_s"] == 5.0 and rows["n0"]["clock_offset_s"] == 0.0
    # n2 sees the others 5 s behind (once they write again: snapshot reads carry no clock sample); with the
    # median as reference it still names itself
    n0.changed()
    n1.changed()
    await until("n2 agrees", lambda: [(w["code"], w["node"]) for w in n2.view()["warnings"]] == [
        ("clock_skew", "n2")])  # fmt: skip


def test_etcd_keys_are_validated_with_file_line_and_key(tmp_path: Path) -> None:
    from nodeagent.config.load import parse_config
    from nodeagent.core.errors import ConfigError

    text = ("cluster:\n  name: c\n  etcd_endpoints: ['127.0.0.1:2379', 'no-port']\n"
            "  etcd_tls: {ca_file: missing.pem, cert_file: " + str(tmp_path) + "}\n"
            "  etcd_auth: {username: agent}\n  member_ttl_s: 1\n")  # fmt: skip
    with pytest.raises(ConfigError) as err:
        parse_config(text, "c.yaml", base_dir=tmp_path)
    message = str(err.value)
    assert "c.yaml:3: cluster.etcd_endpoints.1: etcd endpoint 'no-port' is not HOST:PORT" in message
    assert f"c.yaml:4: cluster.etcd_tls.ca_file: no such file: {tmp_path / 'missing.pem'}" in message
    assert f"cluster.etcd_tls.cert_file: no such file: {tmp_path}" in message
    assert "c.yaml:5: cluster.etcd_auth.password_file: Field required" in message
    assert "c.yaml:6: cluster.member_ttl_s: Input should be greater than or equal to 2" in message


async def test_a_hold_is_published_when_its_kind_changes_not_each_time_its_text_does(cluster: Any) -> None:
    """issue 17: a peer's `--wait` ends early on a rank held by what its agent will not resolve, so the record
    carries each component's hold. A rank at a barrier re-states its hold every 2 s ("waiting 34s…"): that text
    alone waits for the next heartbeat (each state change wrote the key before, also one that changed nothing)."""
    c = cluster(["n0", "n1"])
    n0, n1 = c.join("n0"), c.join("n1")
    await until("both", lambda: present(n0) == {"n0", "n1"})
    host = c.hosts["n1"]

    def seen() -> dict[str, Any]:
        return n0.members["n1"].record["components"]["vllm"]  # type: ignore[no-any-return]

    def hold(kind: str, reason: str, resolves_itself: bool = True) -> dict[str, Any]:
        return {"state": "stopped", "pid": None, "ready": False,
                "hold": {"kind": kind, "reason": reason, "operator_passes": False, "resolves_itself": resolves_itself,
                         "data": {"group": "g-n1"}}}  # fmt: skip

    host.components["vllm"] = hold("barrier", "waiting 0s at the start barrier")
    n1.status_changed()
    await until("the hold seen", lambda: seen().get("hold"))
    assert seen()["hold"] == {"kind": "barrier", "reason": "waiting 0s at the start barrier", "resolves_itself": True}
    writes = n1.writes
    for waited in range(2, 8, 2):
        host.components["vllm"] = hold("barrier", f"waiting {waited}s at the start barrier")
        n1.status_changed()
        await asyncio.sleep(0.4)
    assert n1.writes == writes, "only the wait's text changed: no write until the heartbeat"
    host.components["vllm"] = hold("foreign_holder", "port 8080 in use by pid 7 (nc)", resolves_itself=False)
    n1.status_changed()
    await until("the new kind seen at once", lambda: seen()["hold"]["kind"] == "foreign_holder", timeout=3)
    assert seen()["hold"] == {"kind": "foreign_holder", "reason": "port 8080 in use by pid 7 (nc)",
                              "resolves_itself": False}  # fmt: skip
    assert n1.writes == writes + 1
    n1.changed()  # a forced write (a fresh clock sample) carries the latest text whatever it is
    await until("written", lambda: n1.writes == writes + 2, timeout=3)
    host.components["vllm"] = {"state": "starting", "pid": 12}
    n1.status_changed()
    await until("the hold gone with a process", lambda: seen()["pid"] == 12 and "hold" not in seen(), timeout=3)

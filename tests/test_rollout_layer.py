"""The rollout executor without processes: five agents (Membership, Coordinator, ProxySync, RolloutExecutor) on
one FakeStore, fake stacks, a fake PD proxy and a virtual clock (`tests/cluster_fakes.py`). A change walks
through the groups one at a time under the floor, restarts each as one generation with the new file, halts and
rolls back a group that fails its gate, and survives the death of any agent (the initiator's too)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from cluster_fakes import World

from nodeagent.cluster.rollout.member_config import file_hash
from nodeagent.config.cluster import cluster_file_hash

NODES = ["n0", "n1", "n2", "n3", "n4"]
GROUPS = [
    {"name": "p0", "kind": "prefill", "nodes": ["n0", "n1"], "data_parallel_rpc_port": 43000},
    {"name": "p1", "kind": "prefill", "nodes": ["n2", "n3"], "data_parallel_rpc_port": 43001},
    {"name": "d0", "kind": "decode", "nodes": ["n4"]},
]
FAST = {"bake_s": 5, "drain_timeout_s": 30, "gate_timeout_s": 60}


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a rollout-layer test started a process: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", refuse)


OLD_IMAGE, NEW_IMAGE = "quay.io/ascend/vllm-ascend:v0.20.2rc1", "registry.a2.local/vllm-ascend:v0.20.2rc1"


async def up_world(tmp_path: Path, nodes: list[str] = NODES, groups: list[dict[str, Any]] = GROUPS,
                   image: str | None = None) -> World:  # fmt: skip
    """Agents over their stacks, every component up and the proxy ready; `image`: container mode with it."""
    w = World(tmp_path, nodes, [dict(g) for g in groups], proxy=True, rollouts=True)
    if image is not None:
        w.harness.data["container"] = {"engine": "podman", "image": image}
    w.start()
    try:
        await w.until("every component of every node up", w.all_up, within=120)
        await w.until("the proxy ready", lambda: w.stacks["n0"].components["proxy"].ready, 60)
    except BaseException:
        await w.close()
        raise
    return w


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = await up_world(tmp_path)
    yield w
    await w.close()


def set_group_env(groups: list[str], env: dict[str, str]) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        for g in data["cluster"]["vllm_groups"]:
            if g["name"] in groups:
                g["env"] = {**g.get("env", {}), **env}

    return edit


def disk_hash(world: World, node: str = "n0") -> str:
    return file_hash(world.agents[node].rollout.host.read_config_file())


def launched(world: World, node: str) -> list[str]:
    return world.stacks[node].launched["vllm"]


def record(world: World, node: str = "n0") -> Any:
    return world.agents[node].rollout.record


def status(world: World, node: str = "n0") -> str | None:
    rec = record(world, node)
    return rec.status if rec is not None else None


async def start(world: World, node: str = "n0", **options: Any) -> dict[str, Any]:
    return await world.run(world.agents[node].rollout.plan(None, {**FAST, **options}, dry_run=False, by="test"))


async def test_a_prefill_change_walks_group_by_group_under_the_floor(world: World) -> None:
    old = cluster_file_hash(world.stacks["n0"].config)
    world.install(set_group_env(["p0", "p1"], {"VLLM_NEW_FLAG": "1"}))
    new = disk_hash(world)
    await world.until("every member reports the new file",
                      lambda: all(r.get("hash") == new for r in world.agents["n0"].rollout.reports.values()))
    dry = await world.run(world.agents["n0"].rollout.plan(None, FAST, dry_run=True, by="test"))
    assert dry["ok"] and not dry["started"], dry
    assert [s["groups"] for s in dry["steps"]] == [["p0"], ["p1"]]
    assert dry["changes"][0]["reasons"] == ["n0/vllm: env VLLM_NEW_FLAG added", "n1/vllm: env VLLM_NEW_FLAG added"]
    assert dry["have_new_file"] == NODES
    assert record(world) is None, "a dry run stores nothing"

    down: list[tuple[float, set[str]]] = []

    def watch_floor() -> None:
        routed = world.proxy.routed["prefill"]
        p = {g: set(world.agents["n0"].coordinator.layout.group(g).endpoints) for g in ("p0", "p1")}
        down.append((world.clock.monotonic(), {g for g, e in p.items() if not e <= routed}))

    world.clock.on_tick.append(lambda _d: watch_floor())
    answer = await start(world)
    assert answer["started"], answer
    await world.until("the rollout done", lambda: status(world, "n3") == "done", 300)
    assert new != old
    await world.until("n4 (nothing of it changes) takes the new file too",
                      lambda: cluster_file_hash(world.stacks["n4"].config) == new)
    for node in ("n0", "n1", "n2", "n3"):
        assert launched(world, node) == [old, new], f"{node}: restarted once, with the new file"
    assert launched(world, "n4") == [old], "d0 did not change: untouched"
    assert all(len(gone) <= 1 for _, gone in down), "never both prefill groups out of the proxy"
    assert any(gone == {"p0"} for _, gone in down) and any(gone == {"p1"} for _, gone in down)
    p0_done = record(world).steps[0].finished
    assert p0_done is not None and record(world).steps[1].started >= p0_done, "p1 starts after p0 baked"
    for node in ("n0", "n1"):
        assert world.gang(node, "p0").acted == 2, "one generation for the step"
    await world.until("p1 back in the proxy", lambda: not world.agents["n0"].coordinator.proxies[0].health["p1"])


async def test_the_only_decode_group_refuses_without_allow_outage(world: World) -> None:
    world.install(set_group_env(["d0"], {"X": "1"}))
    answer = await start(world)
    assert not answer["started"] and not answer["ok"]
    assert any("decode has one group (d0)" in r and "--allow-outage decode" in r for r in answer["refused"]), answer
    assert record(world) is None
    answer = await start(world, allow_outage=["decode"])
    assert answer["started"], answer
    assert answer["steps"][0]["outage"] == ["decode"]
    await world.until("done", lambda: status(world) == "done", 200)
    assert launched(world, "n4")[-1] == cluster_file_hash(world.stacks["n4"].config)


async def test_drain_waits_for_the_groups_own_requests(world: World) -> None:
    world.install(set_group_env(["p0"], {"X": "1"}))
    world.stacks["n0"].inflight["vllm"] = (2, 1)
    await start(world, drain_timeout_s=100)
    await world.until("p0 draining", lambda: record(world).steps[0].phase == "draining", 30)
    await world.until("p0 out of the proxy", lambda: record(world).steps[0].proxy_out, 30)
    await world.advance(20)
    assert record(world).steps[0].phase == "draining" and len(launched(world, "n0")) == 1, "still serving its own"
    assert "n1" in record(world).steps[0].drained and "n0" not in record(world).steps[0].drained
    world.stacks["n0"].inflight["vllm"] = (0, 0)
    await world.until("restarted", lambda: len(launched(world, "n0")) == 2, 30)
    await world.until("done", lambda: status(world) == "done", 100)


async def test_a_group_failing_its_gate_is_rolled_back_and_the_rollout_halts(world: World) -> None:
    old = cluster_file_hash(world.stacks["n0"].config)
    world.install(set_group_env(["p0"], {"X": "1"}))
    world.install(set_group_env(["p1"], {"FAKE_START": "crash"}))
    new = disk_hash(world)
    await start(world)
    await world.until("halted", lambda: status(world, "n2") == "halted", 300)
    rec = record(world)
    assert rec.steps[0].phase == "done" and rec.steps[1].phase == "rolled_back"
    assert "failed" in rec.steps[1].failed and "rolled back" in rec.message
    for node in ("n2", "n3"):
        assert launched(world, node)[0] == old and new in launched(world, node)
        assert launched(world, node)[-1] == old, f"{node} runs the previous file again"
        assert cluster_file_hash(world.stacks[node].config) == old
    assert launched(world, "n0") == [old, new], "p0 stays as it is"
    await world.until("p1 healthy in the proxy", lambda: not world.agents["n0"].coordinator.proxies[0].health["p1"])
    again = await start(world)
    assert not again["started"] and any("is halted: abort or roll it back first" in r for r in again["refused"])


async def test_an_agent_killed_mid_step_and_the_initiator_pick_the_plan_up(world: World) -> None:
    old = cluster_file_hash(world.stacks["n0"].config)
    world.install(set_group_env(["p0", "p1"], {"X": "1"}))
    new = disk_hash(world)
    await start(world, node="n1")
    await world.until("p0's step running", lambda: record(world).steps[0].phase != "pending", 60)
    await world.kill_agent("n1")  # the initiator, a member of the step in progress
    await world.advance(10)
    world.start_agent("n1")  # loads the new file from disk
    await world.until("p1's step running", lambda: record(world).steps[1].phase != "pending", 200)
    await world.kill_agent("n3")  # a p1 member, before its group's restart... or during it
    await world.advance(5)
    world.start_agent("n3")
    await world.until("done", lambda: status(world) == "done", 400)
    for node in ("n0", "n1", "n2", "n3"):
        assert launched(world, node) == [old, new], f"{node}: exactly one restart, with the new file"
    for node, group in (("n0", "p0"), ("n2", "p1")):
        assert world.gang(node, group).acted == 2


def published_when_done(world: World) -> dict[str, str | None]:
    """Each member record's `cluster_hash` in etcd at the revision that wrote the rollout's status "done"."""
    import json

    from nodeagent.cluster.membership import member_key

    agent = world.agents["n0"]
    nodes = {member_key(agent.coordinator.cluster, n): n for n in NODES}
    seen: dict[str, str | None] = {}
    for change in world.store.history:
        if change.key in nodes and change.kv is not None:
            seen[nodes[change.key]] = json.loads(change.kv.value).get("cluster_hash")
        rollout = json.loads(change.kv.value) if change.key == agent.rollout.key and change.kv is not None else {}
        if rollout.get("status") == "done":
            return seen
    raise AssertionError("no write of the rollout said done")


async def test_done_means_every_member_publishes_the_new_file(world: World) -> None:
    """As the system test reads it: "done", then `cluster status` shows one file. d0 (n4) is in no step: it takes
    the new file once every step is done, and the rollout is done only once its member record says so; n3,
    killed in its step, loads the new file from disk and publishes it too."""
    old = cluster_file_hash(world.stacks["n0"].config)
    world.install(set_group_env(["p0", "p1"], {"X": "1"}))
    new = cluster_file_hash(world.agents["n0"].rollout.host.read_config_file())
    await start(world)
    await world.until("p1's step running", lambda: record(world).steps[1].phase != "pending", 200)
    await world.kill_agent("n3")
    world.start_agent("n3")
    await world.until("done", lambda: status(world) == "done", 400)
    at_done = published_when_done(world)
    assert new != old and at_done == dict.fromkeys(NODES, new), \
        f"when the rollout said done, members published {at_done} (new file {new[:12]}, old {old[:12]})"
    assert record(world).new_shared == new


async def test_an_agent_restarted_before_its_group_keeps_the_previous_config(world: World) -> None:
    old = cluster_file_hash(world.stacks["n0"].config)
    world.install(set_group_env(["p0", "p1"], {"X": "1"}))
    await start(world, bake_s=60)
    await world.until("p0 baking", lambda: record(world).steps[0].phase == "baking", 120)
    await world.kill_agent("n2")
    world.start_agent("n2")  # loaded the new file; its group is not rolled yet
    await world.until("n2 back on the previous config", lambda: cluster_file_hash(world.stacks["n2"].config) == old)
    world.stacks["n2"].crash("vllm")  # a crash before p1's step: the group restarts with what it runs
    await world.until("p1 restarted", lambda: len(launched(world, "n3")) == 2, 60)
    assert launched(world, "n2")[-1] == launched(world, "n3")[-1] == old, "one file within the group"


async def test_pause_resume_abort_and_rollback(world: World) -> None:
    old = cluster_file_hash(world.stacks["n0"].config)
    world.install(set_group_env(["p0", "p1"], {"X": "1"}))
    await start(world, bake_s=30)
    await world.until("p0 draining", lambda: record(world).steps[0].phase == "draining", 30)
    await world.run(world.agents["n4"].rollout.control("pause", "test"))
    await world.until("p0 done", lambda: record(world).steps[0].phase == "done", 200)
    await world.advance(30)
    assert record(world).steps[1].phase == "pending", "paused: no next step"
    await world.run(world.agents["n4"].rollout.control("resume", "test"))
    await world.until("p1 draining", lambda: record(world).steps[1].phase != "pending", 30)
    await world.run(world.agents["n2"].rollout.control("rollback", "test"))
    await world.until("rolled back", lambda: status(world) == "rolled_back", 600)
    for node in ("n0", "n1", "n2", "n3"):
        assert launched(world, node)[-1] == old, f"{node} back on the previous file"
        assert cluster_file_hash(world.stacks[node].config) == old
    with pytest.raises(Exception, match="rolled_back"):
        await world.run(world.agents["n0"].rollout.control("abort", "test"))


async def test_a_busy_proxy_keeps_a_group_isolated_and_the_next_step_waits(world: World) -> None:
    """vllm-ascend's proxy deletes a removed instance only once it is idle and ignores an add of it meanwhile:
    the step waits in rejoining (not a failure), and no other group is taken out while it is not routed."""
    proxy = world.proxy
    assert proxy is not None
    world.install(set_group_env(["p0", "p1"], {"X": "1"}))
    proxy.busy = True
    await start(world)
    p0 = set(world.agents["n0"].coordinator.layout.group("p0").endpoints)
    await world.until("p0 restarted and healthy", lambda: record(world).steps[0].phase == "rejoining", 120)
    await world.advance(300)
    assert record(world).steps[0].phase == "rejoining" and record(world).steps[1].phase == "pending"
    assert "not back in the proxy after 180s" in record(world).message
    assert p0 <= proxy.tainted["prefill"] and not p0 & proxy.serving("prefill"), "isolated, so not routed"
    proxy.busy = False
    proxy.idle()
    await world.until("p0 back, really", lambda: p0 <= proxy.serving("prefill") and record(world).steps[0].proxy_in,
                      60)  # fmt: skip
    await world.until("done", lambda: status(world) == "done", 300)


async def test_a_report_lost_with_its_lease_is_written_again(world: World) -> None:
    """Reports live on the member's lease; a long stall can lose it (found by the simulation at N = 256, where
    steps waited for reports that were gone)."""
    from nodeagent.cluster.rollout.record import report_prefix

    key = report_prefix(world.harness.cluster_name) + "n2"
    await world.until("n2's report", lambda: "n2" in world.agents["n0"].rollout.reports)
    assert await world.run(world.store.delete(key))
    await world.until("n2's report written again", lambda: key in world.store.data, 15)
    await world.until("and seen by n0", lambda: "n2" in world.agents["n0"].rollout.reports, 5)


def page(requests: int, errors: int) -> str:
    return (f'http_requests_total{{handler="/v1/chat/completions",method="POST",status="2xx"}} {requests - errors}\n'
            f'http_requests_total{{handler="/v1/chat/completions",method="POST",status="5xx"}} {errors}\n')


async def test_a_group_failing_requests_while_it_bakes_is_rolled_back(world: World) -> None:
    """The gate passed (ready, one canary answered) but real traffic fails on the new file: the head's reading
    of its ranks' /metrics during the bake fails the step, and the group goes back once drained (it served)."""
    old = cluster_file_hash(world.stacks["n0"].config)
    world.install(set_group_env(["p1"], {"X": "flaky"}))
    new = disk_hash(world)
    p1 = world.agents["n0"].coordinator.layout.group("p1")
    ranks = [(world.stacks[proc.node], proc.endpoint) for proc in p1.processes if proc.endpoint]
    assert len(ranks) == 1, "one API server for the group (vLLM's own DP launch)"
    for stack, endpoint in ranks:
        stack.metrics_text[endpoint] = page(1000, 0)  # the old processes' record; restarts do not reset a fake
    await start(world, bake_s=60)
    await world.until("p1 baking", lambda: record(world).steps[0].phase == "baking", 300)
    await world.advance(3)  # the head took the bake's first reading
    assert record(world).steps[0].phase == "baking" and not record(world).steps[0].bake
    world.stacks["n2"].inflight["vllm"] = (1, 0)  # a request of the new file's traffic still running
    for stack, endpoint in ranks:
        stack.metrics_text[endpoint] = page(1020, 4)
    await world.until("p1 failed and leaving the proxy", lambda: record(world).steps[0].failed != "", 60)
    await world.until("p1 out of the proxy", lambda: record(world).steps[0].proxy_out, 30)
    await world.advance(20)
    step = record(world).steps[0]
    assert step.phase == "draining" and launched(world, "n2") == [old, new], "the request in flight is let finish"
    world.stacks["n2"].inflight["vllm"] = (0, 0)
    await world.until("halted", lambda: status(world, "n2") == "halted", 120)
    rec = record(world)
    assert rec.steps[0].phase == "rolled_back"
    assert rec.steps[0].failed == "while baking, p1: 4 of 20 requests failed while baking (20%, more than 5%)"
    for node in ("n2", "n3"):
        assert launched(world, node) == [old, new, old], f"{node}: to the new file and back"


async def test_a_new_image_recreates_each_members_container_between_the_stop_and_the_start(tmp_path: Path) -> None:
    """Issue 20's "a new image or vllm-ascend version": the image is part of the file a rollout compares, and a
    step that changes it recreates the container of each member after the step's generation stopped its ranks
    and before they start again — the ranks never start in the old container within the new generation."""
    old_image, new_image = OLD_IMAGE, NEW_IMAGE
    w = await up_world(tmp_path, image=old_image)
    try:
        before = disk_hash(w)
        w.install(lambda data: data["container"].update(image=new_image))
        assert disk_hash(w) != before, "the image is part of the file a rollout compares"
        dry = await w.run(w.agents["n0"].rollout.plan(None, {**FAST, "allow_outage": ["decode"]}, dry_run=True,
                                                      by="test"))  # fmt: skip
        assert any(f"image {old_image} → {new_image}" in r for c in dry["changes"] for r in c["reasons"]), dry
        answer = await start(w, allow_outage=["decode"])
        assert answer["started"], (answer.get("refused"), answer.get("steps"))
        await w.until("the rollout done", lambda: status(w, "n4") == "done", 600)
        for node in NODES:
            stack = w.stacks[node]
            assert [image for _, image in stack.recreated] == [new_image], f"{node}: recreated once"
            assert stack.images["vllm"] == [old_image, new_image], f"{node}: its rank restarted once, in the new one"
            recreated_at = stack.recreated[0][0]
            assert stack.components["vllm"].starts[-1] >= recreated_at, "started after the recreate"
        assert any("recreating the container" in e.message for e in w.stacks["n2"].events.recent)
    finally:
        await w.close()


PD_GROUPS = [
    {"name": "p0", "kind": "prefill", "nodes": ["n0", "n1"], "data_parallel_rpc_port": 43000},
    {"name": "p1", "kind": "prefill", "nodes": ["n2", "n3"], "data_parallel_rpc_port": 43001},
    {"name": "d0", "kind": "decode", "nodes": ["n4"]},
    {"name": "d1", "kind": "decode", "nodes": ["n5"]},
]


def routed_files(world: World) -> set[str]:
    """The files the processes of every group the proxy may route a request to run now."""
    from nodeagent.config.layout import cluster_layout

    assert world.proxy is not None
    layout = cluster_layout(world.stacks["n0"].config)
    files = set()
    for kind in ("prefill", "decode"):
        for endpoint in world.proxy.serving(kind):
            group = next(g for g in layout.groups if endpoint in g.endpoints)
            for proc in group.processes:
                stack = world.stacks[proc.node]
                if stack.components[proc.component].running:
                    files.add(stack.launched[proc.component][-1])
    return files


def connector_change(w: World, also: Callable[[], None] | None = None) -> tuple[str, str, list[Any]]:
    """An incompatible change (the KV connector's) installed: (old file, new file, the moments the proxy may route
    a request across the two files, noted at every tick and every change of its lists, with `also`)."""
    assert w.proxy is not None
    old = cluster_file_hash(w.stacks["n0"].config)
    w.install(lambda data: data["cluster"]["pd"].update(use_ascend_direct=False))
    mixed: list[tuple[float, set[str]]] = []

    def watch(*_: Any) -> None:
        files = routed_files(w)
        if len(files) > 1:
            mixed.append((w.clock.monotonic(), files))
        if also is not None:
            also()

    w.clock.on_tick.append(watch)
    w.proxy.on_change.append(watch)
    return old, disk_hash(w), mixed


async def test_an_incompatible_change_never_routes_old_and_new_groups_together(tmp_path: Path) -> None:
    """Issue 20: "an incompatible prefill↔decode change cannot mix old and new groups". The pair p0 + d0 switches
    first while p1 + d1 serve on the old file; as the pair rejoins, the proxy lets p1 and d1 go and adds the pair
    only once it lists neither (a busy proxy keeps them, tainted and still used, until it is idle once); then p1 +
    d1 switch, out of the proxy since. At no instant does the proxy route groups of the two files."""
    w = await up_world(tmp_path, [*NODES, "n5"], PD_GROUPS)
    try:
        proxy = w.proxy
        assert proxy is not None
        empty: list[float] = []

        def watch_empty(*_: Any) -> None:
            if not proxy.serving("prefill") or not proxy.serving("decode"):
                empty.append(w.clock.monotonic())

        old, new, mixed = connector_change(w, watch_empty)
        refused = await start(w, max_unavailable=2)
        assert not refused["started"] and refused["exclusive"]
        assert any("pass --allow-outage prefill,decode" in r for r in refused["refused"]), refused["refused"]
        answer = await start(w, max_unavailable=2, allow_outage=["prefill", "decode"])
        assert answer["started"], answer["refused"]
        assert [s["groups"] for s in answer["steps"]] == [["p0", "d0"], ["p1", "d1"]]
        await w.until("the pair gating", lambda: record(w).steps[0].phase == "gating", 120)
        proxy.busy = True  # requests in flight when the pair is ready: p1 and d1 are only tainted
        await w.until("the pair rejoining", lambda: record(w).steps[0].phase == "rejoining", 60)
        await w.advance(30)
        assert not mixed, f"the proxy routed groups of both files at once: {mixed[:3]}"
        layout = w.agents["n0"].coordinator.layout
        pair = set(layout.group("p0").endpoints) | set(layout.group("d0").endpoints)
        rest = set(layout.group("p1").endpoints) | set(layout.group("d1").endpoints)
        listed = proxy.routed["prefill"] | proxy.routed["decode"]
        assert rest <= listed and not pair & listed, "the pair waits while p1 and d1 are still listed"
        assert record(w).steps[0].phase == "rejoining" and record(w).steps[1].phase == "pending"
        health = w.agents["n0"].coordinator.proxies[0].health
        assert health["p0"].startswith("healthy; waiting for d1, p1 to leave the proxy first"), health
        assert "never routed together" in health["p1"]
        assert rr_view(w)["floor"] == "serving: prefill p1 (until the switch); decode d1 (until the switch)"
        proxy.busy = False
        gone_at = w.clock.monotonic()
        proxy.idle()  # the proxy's idle moment: the tainted old ones are deleted
        await w.until("the pair in the proxy", lambda: pair <= proxy.serving("prefill") | proxy.serving("decode"), 5)
        assert w.clock.monotonic() - gone_at <= 0.5, "added within one fence poll of the old ones leaving"
        await w.until("the rollout done", lambda: status(w, "n5") == "done", 300)
        await w.until("every group back in", lambda: pair | rest <= proxy.serving("prefill") | proxy.serving("decode"),
                      30)  # fmt: skip
        assert not mixed, f"the proxy routed groups of both files at once: {mixed[:3]}"
        switch = [t for t in empty if t >= gone_at]
        assert switch and max(switch) - gone_at <= 0.5, "no group in the proxy for at most one fence poll"
        for node in ("n0", "n1", "n2", "n3", "n4", "n5"):
            assert launched(w, node) == [old, new], f"{node}: restarted once, with the new file"
    finally:
        await w.close()


async def test_an_incompatible_change_starts_the_only_decoder_only_once_the_proxy_let_it_go(world: World) -> None:
    """CI's shape: d0 is the only decode group, the proxy is busy when the pair is taken out, so d0 stays listed
    (tainted, and used: its kind's last). Started on the new file while listed, it would be sent requests prefilled
    by p1 on the old one. The pair's ranks stop, then wait for the proxy's idle moment before they start."""
    proxy = world.proxy
    assert proxy is not None
    old, new, mixed = connector_change(world)
    proxy.busy = True  # under load from before the step: removals only taint
    answer = await start(world, max_unavailable=2, allow_outage=["prefill", "decode"])
    assert answer["started"], answer["refused"]
    await world.until("the pair restarting", lambda: record(world).steps[0].phase in ("restarting", "gating"), 120)
    await world.until("d0's old process stopped", lambda: not world.stacks["n4"].components["vllm"].running, 60)
    await world.advance(30)
    d0 = set(world.agents["n0"].coordinator.layout.group("d0").endpoints)
    assert d0 <= proxy.routed["decode"], "still listed: the proxy was never idle"
    assert launched(world, "n4") == [old], "d0 waits: not started on the new file while the proxy lists it"
    held = world.stacks["n4"].components["vllm"].hold
    assert held is not None and "waiting for the proxy to delete p0, d0" in held.reason, held
    assert not record(world).steps[0].unlisted
    proxy.busy = False
    proxy.idle()  # every request to d0 fails while it is stopped: the proxy's idle moment comes
    await world.until("d0 started on the new file", lambda: launched(world, "n4") == [old, new], 30)
    assert record(world).steps[0].unlisted
    await world.until("the rollout done", lambda: status(world, "n3") == "done", 300)
    assert not mixed, f"the proxy routed groups of both files at once: {mixed[:3]}"


def rr_view(world: World, node: str = "n0") -> dict[str, Any]:
    return world.agents[node].rollout.view()["rollout"]


async def test_the_expected_outage_and_the_time_left_survive_agent_restarts(world: World) -> None:
    """The expected outage of a single-group kind and the time left come from each member's load history (issue
    16: kept in its intent.json, published as `last_load_s`), not from what an executor saw since it started —
    after any agent restart that read "unknown"."""
    world.stacks["n4"].components["vllm"].start_s = 1800.0
    world.stacks["n4"].crash("vllm")
    await world.until("d0 loaded again, in 30 min", lambda: world.stacks["n4"].components["vllm"].up, 2000)
    for node in NODES:  # every agent restarts (the stacks run on): nothing of the load is in an executor's memory
        await world.kill_agent(node)
        world.start_agent(node)
    members = world.agents["n0"].membership.members
    await world.until("n0 sees n4's last load", lambda: "n4" in members and members["n4"].record["components"]["vllm"]
                      .get("last_load_s") == 1800.0, 60)  # fmt: skip
    world.install(set_group_env(["d0"], {"X": "1"}))
    refused = await start(world)
    assert any("its step takes decode down for ~30 min (its last load)" in r for r in refused["refused"]), refused
    answer = await start(world, allow_outage=["decode"])
    assert answer["started"] and answer["steps"][0]["expected_outage_s"] == 1800.0
    await world.until("the step begun", lambda: record(world).steps[0].phase != "pending", 30)
    left = rr_view(world, "n2")["time_left_s"]
    assert left is not None and 1800 - 30 <= left <= 1800 + FAST["bake_s"], left


async def test_an_agent_restarted_before_its_step_keeps_its_container_until_then(tmp_path: Path) -> None:
    """A new image rolling group by group; n2's agent restarts during p0's step and loads the new file from disk.
    Its container is kept as its group still runs (the previous config is taken back before the container starts:
    `MemberConfig.restore`, from what the last record seen here wanted) and recreated in p1's step only."""
    old_image, new_image = OLD_IMAGE, NEW_IMAGE
    w = await up_world(tmp_path, image=old_image)
    try:
        old = cluster_file_hash(w.stacks["n2"].config)
        w.install(lambda data: data["container"].update(image=new_image))
        answer = await start(w, allow_outage=["decode"], bake_s=60)
        assert answer["started"], answer["refused"]
        await w.until("p0's step baking", lambda: record(w).steps[0].phase == "baking", 300)
        assert not w.stacks["n2"].recreated
        await w.kill_agent("n2")
        w.start_agent("n2")  # its file on disk names the new image
        await w.advance(5)
        n2 = w.stacks["n2"]
        assert not n2.recreated and n2.container_image == old_image, "kept at the agent's start"
        assert n2.config.container is not None and n2.config.container.image == old_image
        assert launched(w, "n2") == [old], "nothing of p1 restarted outside its step"
        await w.until("p1's step begun", lambda: record(w).steps[1].phase != "pending", 300)
        p1_from = w.clock.monotonic()
        await w.until("the rollout done", lambda: status(w, "n4") == "done", 600)
        assert [image for _, image in n2.recreated] == [new_image] and n2.recreated[0][0] >= p1_from
        assert n2.images["vllm"] == [old_image, new_image], "one restart, in the new container"
    finally:
        await w.close()


async def test_the_status_says_why_a_step_waits_and_what_serves_per_kind_during_it(world: World) -> None:
    """`nodeagentctl cluster` and the status page show the floor as it is: why the next step waits, and during a
    step the groups serving per kind (it read "holds" whenever a step was in progress)."""
    from nodeagent.api.ui.firstpaint import first_paint
    from nodeagent.api.ui.routes import read_static
    from nodeagent.cli.remote import rollout_lines

    world.install(set_group_env(["p0", "p1"], {"X": "1"}))
    world.stacks["n2"].components["vllm"].start_s = 60.0
    world.stacks["n2"].crash("vllm")  # p1 reloads for a minute: p0's step may not take the last prefill group
    await start(world, bake_s=30)
    await world.until("the wait said", lambda: "waits" in rr_view(world, "n4")["floor"], 30)
    assert rr_view(world, "n4")["floor"].startswith("step 1 waits: no other prefill group serving (p1 (n2/vllm is")
    await world.until("p0 restarting", lambda: record(world).steps[0].phase in ("restarting", "gating"), 120)
    world.stacks["n2"].components["vllm"].start_s = 2.0  # (p1's own step within the gate timeout)
    view = rr_view(world, "n4")
    assert view["floor"] == "serving: prefill p1; decode d0"
    assert list(view["held_out"]) == ["p0"] and view["time_left_s"] is not None
    lines = rollout_lines(view, now=world.clock.time())
    assert lines[0].startswith(f"rollout {view['id']}: running, step 1/2 p0 ")
    assert lines[2].startswith("  floor: serving: prefill p1; decode d0; time left: "), lines
    html = first_paint(read_static("index.html").decode(), {"node": {"name": "n4"}}, now=world.clock.time(),
                       rollout=view)  # fmt: skip
    assert '<div id="rollout">' in html and "floor: serving: prefill p1; decode d0 · time left " in html
    assert '<tr data-step="2"><td class="num">2</td><td data-field="groups">p1</td>' in html
    await world.until("done", lambda: status(world) == "done", 300)
    assert rr_view(world, "n4")["floor"] == "serving: prefill p0, p1; decode d0"


async def test_a_proxy_restarted_while_a_step_holds_a_group_out_starts_without_it(world: World) -> None:
    """The proxy process dies while a rollout step holds p0 out (draining, restarting): its new process is
    launched without p0's endpoints. Launched with the config's command line it would route to p0 at once, until
    the sync's next step removed it again — requests sent to a group that is being restarted."""
    proxy, stack = world.proxy, world.stacks["n0"]
    assert proxy is not None
    sync = world.agents["n0"].coordinator.proxies[0]
    p0 = set(world.agents["n0"].coordinator.layout.group("p0").endpoints)
    for node in ("n0", "n1"):
        world.stacks[node].components["vllm"].start_s = 30.0  # p0 stays out of the proxy a while
    world.install(set_group_env(["p0", "p1"], {"X": "1"}))
    await start(world)
    await world.until("p0 restarting, out of the proxy",
                      lambda: record(world).steps[0].phase == "gating" and not p0 & proxy.routed["prefill"], 120)
    old_pid = stack.components["proxy"].pid
    killed_at, calls_before = world.clock.monotonic(), len(proxy.calls)
    stack.crash("proxy")
    await world.until("a new proxy process up",
                      lambda: stack.components["proxy"].up and stack.components["proxy"].pid != old_pid, 60)
    await world.advance(3)
    assert record(world).steps[0].phase == "gating", "p0 still held out (its ranks are starting)"
    after = [routed for when, routed in proxy.timeline if when >= killed_at]
    assert after and not any(p0 & routed["prefill"] for routed in after), "p0 never routed by the new process"
    launch = stack.proxy_launches[-1]
    assert launch is not None and not p0 & set(launch.prefill) and launch.prefill and launch.decode, launch
    assert sync.applied == {"prefill": set(launch.prefill), "decode": set(launch.decode)}, "started from its launch"
    assert not [c for c in proxy.calls[calls_before:] if c[0] == "remove"], "nothing to remove: p0 was never in it"
    launched = stack.events_of("proxy_launch")
    assert launched and "p0: rollout" in launched[-1]["message"], launched
    await world.until("done", lambda: status(world) == "done", 300)
    assert p0 <= proxy.routed["prefill"], "p0 back in the new process once its step passed"

"""The PD watches of issue 19 (cluster/pd_watch.py, kvlog.py): pure decisions, then the loop on the process-less
cluster (tests/cluster_fakes.py) with an HTTP double standing for the backends — a decoder that answers 200
without tokens is restarted (its group's next generation), one that answers tokens is left alone; prefill's KV
while decode is down; KV transfer failures summed per pair from the member records."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from cluster_fakes import World

from nodeagent.cluster.pd_watch import (
    RESTART_COOLDOWN_S,
    EmptyCounter,
    PdWatch,
    completion_request,
    kv_pressure,
    kv_usage,
    merged_transfers,
    proxy_fault,
    proxy_restart,
    tokens_of,
)
from nodeagent.cluster.proxy_activation import activation_window, stuck_activations
from nodeagent.config.model import RestartSpec
from nodeagent.config.recovery import PdWatchConfig
from nodeagent.seam.stackport import ComponentView

GROUPS = [{"name": "p0", "kind": "prefill", "nodes": ["n0"]}, {"name": "p1", "kind": "prefill", "nodes": ["n1"]},
          {"name": "d0", "kind": "decode", "nodes": ["n2"]}]  # fmt: skip


def test_an_answer_needs_the_tokens_asked() -> None:
    assert tokens_of(200, "") == (False, "200 with an empty body")  # what the proxy sends when decode failed
    assert not tokens_of(200, json.dumps({"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}))[0]
    assert not tokens_of(503, "Service Unavailable")[0]
    assert tokens_of(200, json.dumps({"choices": [{"text": " a b"}], "usage": {"completion_tokens": 2}})) == (
        True, "2 tokens")
    assert tokens_of(200, json.dumps({"choices": [{"text": " a"}], "usage": {"completion_tokens": 1}})) == (
        False, "200 with 1 of the 2 tokens asked (a short answer)"), "a 2-token request must return both"
    assert tokens_of(200, json.dumps({"choices": [{"text": " a b"}]}))[0], "no usage: the text is all there is"
    request = completion_request("dsv4")
    assert (request["max_tokens"], request["min_tokens"], request["ignore_eos"]) == (2, 2, True), \
        "a healthy engine cannot stop short of the 2 tokens"
    counter = EmptyCounter(after=2)
    assert [counter.observe("d0", ok) for ok in (False, True, False, False, False)] == [
        False, False, False, True, True], "two in a row act; a good answer starts the count again"
    counter.clear(["d0"])
    assert not counter.observe("d0", False), "acted on: counted afresh"


def test_an_empty_streak_says_when_its_first_empty_answer_was_asked_for() -> None:
    """An operator (and the campaign's attribution check) reads when the instance went wrong, not when someone
    looked: the streak's first probe time, kept through the streak, gone with a good answer or a restart."""
    counter = EmptyCounter(after=3)
    counter.observe("d0", False, 100.0)
    counter.observe("d0", False, 102.0)
    assert counter.since == {"d0": 100.0}
    counter.observe("d0", True, 104.0)
    assert counter.since == {}, "a good answer ends the streak"
    counter.observe("d0", False, 106.0)
    counter.clear(["d0"])
    assert counter.since == {} and counter.streak == {"d0": 0}


def test_the_proxy_is_the_fault_only_when_every_instance_answers() -> None:
    assert proxy_fault(True, "2 tokens", {"a:1": True}) is None
    why = proxy_fault(False, "200 with an empty body", {"a:1": True, "a:2": True})
    assert why == ("the proxy answers 200 with an empty body while every prefill→decode pair answers with tokens "
                   "(2 decode instances probed): the proxy itself is the fault")
    assert proxy_fault(False, "200 with an empty body", {"a:1": True, "a:2": False}) is None, "a backend explains it"
    assert proxy_fault(False, "no answer", {}) is None, "nothing probed: nothing to compare"


def proxy_view(state: str = "ready", *, desired: str = "running", up: bool = True) -> ComponentView:
    return ComponentView(name="proxy", kind="proxy", state=state, running=state != "stopped", up=up,
                         ready=state == "ready", desired=desired, deps=(), deps_up=True,
                         restart=RestartSpec())  # fmt: skip


def test_the_proxy_restarts_once_it_was_the_fault_rounds_in_a_row_and_only_while_it_is_up() -> None:
    assert proxy_restart(2, 2, proxy_view("unhealthy")), "a hung proxy fails its readiness: still restarted"
    assert proxy_restart(3, 2, proxy_view("ready"))
    assert not proxy_restart(1, 2, proxy_view()), "one round (a short stall) is not enough"
    assert not proxy_restart(5, 0, proxy_view()), "proxy_fault_after 0: only said"
    assert not proxy_restart(2, 2, proxy_view("starting", up=False)), "its restart is under way"
    assert not proxy_restart(2, 2, proxy_view("stopping")) and not proxy_restart(2, 2, proxy_view("backoff"))
    assert not proxy_restart(2, 2, proxy_view("stopped", desired="stopped")), "an operator stopped it"
    assert not proxy_restart(2, 2, None), "no proxy component on this node"


def test_kv_pressure_only_while_decode_is_down_one_group_at_a_time() -> None:
    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="dsv4"} 0.42\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="dsv4"} 0.95\n')  # fmt: skip
    assert kv_usage(text) == 0.95
    usage = {"p0": 0.95, "p1": 0.97}
    assert kv_pressure([], usage, {"p0": True, "p1": True}, 0.9) is None, "decode up: prefill's KV is its own"
    group, why = kv_pressure(["d0"], usage, {"p0": True, "p1": True}, 0.9)  # type: ignore[misc]
    assert group == "p1" and "#13240" in why
    assert kv_pressure(["d0"], usage, {"p0": True, "p1": False}, 0.9) is None, "one prefill group at a time"
    assert kv_pressure(["d0"], {"p0": 0.5}, {"p0": True}, 0.9) is None


def test_transfer_failures_are_summed_per_pair_from_every_member() -> None:
    kinds = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    n2 = {"kv_transfers": [[100.0 + i, "d0", "p0"] for i in range(5)] + [[200.0 + i, "d0", "p1"] for i in range(5)]}
    verdict = merged_transfers(kinds, [n2, {}], 5, 300, {}).decide(250.0)
    assert verdict is not None and [r.engine for r in verdict] == ["d0"], "the decoder fails with every prefill"  # type: ignore[union-attr]
    one_pair = {"kv_transfers": [[100.0 + i, "d0", "p0"] for i in range(9)]}
    verdict = merged_transfers(kinds, [one_pair], 5, 300, {}).decide(250.0)
    assert [r.engine for r in verdict] == ["p0"], "p0 fails with its only decoder; d0 serves p1: not d0"  # type: ignore[union-attr]
    assert merged_transfers(kinds, [n2], 5, 300, {"d0": 300.0}).decide(350.0) is None, "counted again after a restart"


TWO_TOKENS = (200, json.dumps({"choices": [{"text": " a b"}], "usage": {"completion_tokens": 2}}))


class Backends:
    """The prefill and decode instances, and the proxy, as the watch calls them (by port); `calls` keeps when."""

    def __init__(self, clock: Any = None) -> None:
        self.clock = clock
        self.decode_answer = TWO_TOKENS
        self.decode_answers: dict[int, tuple[int, str]] = {}
        """decode port → its answer (default: `decode_answer`)."""
        self.dead: set[int] = set()
        """Ports nobody answers on (connection refused)."""
        self.bad_prefills: set[int] = set()
        """Prefill ports whose KV handle no decoder can pull: a decoder handed one answers 200 without a body."""
        self.proxy_answer = TWO_TOKENS
        self.on_proxy: Callable[[], None] | None = None
        """Called as the proxy is asked (an instance that breaks just then)."""
        self.usage: dict[int, float] = {}
        """prefill port → its `vllm:kv_cache_usage_perc` (default 0.1)."""
        self.calls: list[tuple[str, str]] = []
        self.at: list[tuple[float, str]] = []
        self.prefill_id = ""
        self.models_down: set[int] = set()
        """Ports whose `/v1/models` (the proxy's activation check) fails."""

    async def __call__(self, method: str, url: str, body: dict[str, Any] | None, timeout: float,
                       headers: Mapping[str, str]) -> tuple[int, str]:  # fmt: skip
        self.calls.append((method, url))
        if url.endswith("/v1/models") and int(url.split("/")[2].rsplit(":", 1)[1]) in self.models_down:
            return 503, ""
        if self.clock is not None:
            self.at.append((self.clock.monotonic(), url))
        port = int(url.split("/")[2].rsplit(":", 1)[1])
        if port in self.dead:
            raise ConnectionRefusedError(111, "Connection refused")
        if url.endswith("/v1/models"):
            return 200, json.dumps({"data": [{"id": "dsv4"}]})
        if url.endswith("/metrics"):
            return 200, f'vllm:kv_cache_usage_perc{{engine="0",model_name="dsv4"}} {self.usage.get(port, 0.1)}\n'
        if port == PROXY_PORT:
            assert body is not None and "kv_transfer_params" not in body, "a client's request"
            if self.on_proxy is not None:
                self.on_proxy()
            return self.proxy_answer
        if body and body["kv_transfer_params"].get("do_remote_decode"):
            self.prefill_id = headers["X-Request-Id"]
            return 200, json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": {"remote_engine_id": "p",
                                                                                       "remote_port": port}})
        assert body and body["kv_transfer_params"]["remote_engine_id"] == "p", "decode gets prefill's KV handle"
        assert headers["X-Request-Id"] == self.prefill_id, "one request id on both halves, as the proxy sends it"
        assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (2, 2, True)
        if body["kv_transfer_params"]["remote_port"] in self.bad_prefills:
            return 200, ""
        return self.decode_answers.get(port, self.decode_answer)


PROXY_PORT = 42000
"""tests/cluster_fakes.py's proxy."""


async def pd_world(folder: Path, groups: list[dict[str, Any]]) -> AsyncIterator[World]:
    w = World(folder, ["n0", "n1", "n2"], groups, proxy=True)
    w.start()
    await w.until("every component up", w.all_up, within=120)
    await w.until("the proxy ready", lambda: w.stacks["n0"].components["proxy"].ready)
    yield w
    await w.close()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async for w in pd_world(tmp_path / "w", GROUPS):
        yield w


@pytest.mark.parametrize("empty", [True, False])
async def test_a_decoder_answering_without_tokens_is_restarted(world: World, empty: bool) -> None:
    backends = Backends()
    if empty:
        backends.decode_answer = (200, "")
    co = world.agents["n0"].coordinator
    watch = PdWatch(co, PdWatchConfig(probe_period_s=10), lambda: {}, model="dsv4", clock=world.clock,
                    http=backends)  # fmt: skip
    watch.co.port.attach(watch)  # as the agent attaches its layers
    co.spawn(watch.run())
    await world.advance(35)
    (d0,) = co.layout.group("d0").endpoints
    if empty:
        await world.until("d0 restarted", lambda: world.stacks["n2"].started("vllm") == 2, 60)
        assert world.gang("n2", "d0").record.generation == 2  # type: ignore[union-attr]
        assert f"2 answers in a row without the 2 tokens asked from decode d0 instance {d0} (200 with an empty " \
            "body)" in world.gang("n2", "d0").record.reason  # type: ignore[union-attr]
        assert {s.started("vllm") for n, s in world.stacks.items() if n != "n2"} == {1}, "prefill untouched"
    else:
        assert world.stacks["n2"].started("vllm") == 1 and watch.last_probe["d0"] == {d0: "2 tokens"}
    assert not [c for c in backends.calls if c[1].endswith("/metrics")], "KV read only while decode is down"


GROUPS_DP = [{"name": "p0", "kind": "prefill", "nodes": ["n0"]}, {"name": "p1", "kind": "prefill", "nodes": ["n1"]},
             {"name": "d0", "kind": "decode", "nodes": ["n2"], "dp_launch": "external",
              "data_parallel_size_local": 2}]  # fmt: skip
"""d0: two DP ranks on n2, each its own API server (`vllm-dp0`, `vllm-dp1`) — the proxy routes to both."""


@pytest.fixture
async def world_dp(tmp_path: Path) -> AsyncIterator[World]:
    async for w in pd_world(tmp_path / "w", GROUPS_DP):
        yield w


def d0_starts(world: World) -> list[int]:
    return [world.stacks["n2"].started(f"vllm-dp{r}") for r in (0, 1)]


@pytest.mark.parametrize("bad", ["second rank empty", "first rank short", "none"])
async def test_every_decode_rank_is_probed_and_a_bad_one_restarts_its_group(world_dp: World, bad: str) -> None:
    """Each DP rank has its own API server, and the proxy routes to each: a rank other than the first that
    answers 200 without a body, or one that answers short (1 of the 2 tokens), restarts the group; ranks that
    all answer both tokens are left alone. One round per period, spread evenly (the ranks, then the proxy)."""
    co = world_dp.agents["n0"].coordinator
    first, second = co.layout.group("d0").endpoints
    backends = Backends(world_dp.clock)
    if bad == "second rank empty":
        backends.decode_answers[int(second.rsplit(":", 1)[1])] = (200, "")
    elif bad == "first rank short":
        backends.decode_answers[int(first.rsplit(":", 1)[1])] = (
            200, json.dumps({"choices": [{"text": " a"}], "usage": {"completion_tokens": 1}}))
    watch = PdWatch(co, PdWatchConfig(probe_period_s=12), lambda: {}, model="dsv4", clock=world_dp.clock,
                    http=backends)  # fmt: skip
    watch.co.port.attach(watch)  # as the agent attaches its layers
    co.spawn(watch.run())
    await world_dp.advance(30)
    if bad == "none":
        assert d0_starts(world_dp) == [1, 1] and world_dp.gang("n2", "d0").record.generation == 1  # type: ignore[union-attr]
        assert watch.last_probe["d0"] == {first: "2 tokens", second: "2 tokens"}
        assert watch.status_section()["pd_watch"]["proxy"]["ok"] is True
        decode = [(t, u) for t, u in backends.at if u.endswith("/v1/completions") and u.split("/")[2] in (
            first, second)]  # fmt: skip
        proxy = [t for t, u in backends.at if f":{PROXY_PORT}/" in u]
        assert [u.split("/")[2] for _, u in decode[:4]] == [first, second, first, second], "every rank, each round"
        assert decode[1][0] - decode[0][0] == pytest.approx(4.0) and proxy[0] - decode[1][0] == pytest.approx(4.0), \
            "spread over the 12 s period: rank, rank, proxy"
        assert decode[2][0] - decode[0][0] == pytest.approx(12.0), "one round per period"
        return
    await world_dp.until("d0 restarted", lambda: d0_starts(world_dp) == [2, 2], 60)
    gang = world_dp.gang("n2", "d0").record
    assert gang.generation == 2, "one generation for the group"  # type: ignore[union-attr]
    culprit, what = (second, "200 with an empty body") if bad == "second rank empty" else (
        first, "200 with 1 of the 2 tokens asked (a short answer)")
    assert f"answers in a row without the 2 tokens asked from decode d0 instance {culprit} ({what})" in \
        gang.reason  # type: ignore[union-attr]
    assert {s.started("vllm") for n, s in world_dp.stacks.items() if n != "n2"} == {1}, "prefill untouched"


@pytest.mark.parametrize("prefill", ["its KV cannot be pulled", "it does not answer"])
async def test_a_bad_prefill_rank_is_not_blamed_on_the_decoders(world_dp: World, prefill: str) -> None:
    """The prefill side turns through every prefill instance: decoders fed by a prefill whose KV cannot be
    pulled fail every other round, never `empty_after` in a row — no decode group restarts (the transfer
    watch, per pair, is what names that prefill). A prefill that does not answer at all is no decoder's failure
    even once (`empty_after` 1 here)."""
    co = world_dp.agents["n0"].coordinator
    backends = Backends(world_dp.clock)
    (p1,) = co.layout.group("p1").endpoints
    settings = PdWatchConfig(probe_period_s=10)
    if prefill == "its KV cannot be pulled":
        backends.bad_prefills.add(int(p1.rsplit(":", 1)[1]))
    else:
        backends.dead.add(int(p1.rsplit(":", 1)[1]))
        settings = PdWatchConfig(probe_period_s=10, empty_after=1)
    watch = PdWatch(co, settings, lambda: {}, model="dsv4", clock=world_dp.clock, http=backends)
    watch.co.port.attach(watch)  # as the agent attaches its layers
    co.spawn(watch.run())
    await world_dp.advance(65)
    assert d0_starts(world_dp) == [1, 1] and not watch.acted
    if prefill == "its KV cannot be pulled":
        assert set(watch.last_probe["d0"].values()) <= {"2 tokens", "200 with an empty body"}
        assert max(watch.empties.streak.values()) == 1
    else:
        assert set(watch.last_probe["d0"].values()) == {"2 tokens"} and max(watch.empties.streak.values()) == 0


@pytest.mark.parametrize("case", ["backends answer", "a backend fails", "a backend fails after its turn",
                                  "restart off"])
async def test_a_proxy_that_fails_while_every_instance_answers_is_the_fault_and_restarts(world_dp: World,
                                                                                        case: str) -> None:
    """The 2-token request through the proxy itself: when it comes back empty while every instance's probe of
    the round answered, status and an event say the proxy is the fault, and after `proxy_fault_after` rounds in a
    row the proxy — and no group — restarts, once; when an instance fails too, the instance is the explanation,
    also when it broke after its own probe of the round (asked again before the proxy is blamed)."""
    co = world_dp.agents["n0"].coordinator
    second = co.layout.group("d0").endpoints[1]
    backends = Backends(world_dp.clock)
    backends.proxy_answer = (200, "")
    if case == "a backend fails":
        backends.decode_answers[int(second.rsplit(":", 1)[1])] = (503, "Service Unavailable")
    elif case == "a backend fails after its turn":
        backends.on_proxy = lambda: backends.decode_answers.update({int(second.rsplit(":", 1)[1]): (200, "")})
    settings = PdWatchConfig(probe_period_s=10, empty_after=5, proxy_fault_after=0 if case == "restart off" else 2)
    watch = PdWatch(co, settings, lambda: {}, model="dsv4", clock=world_dp.clock, http=backends)
    watch.co.port.attach(watch)  # as the agent attaches its layers
    co.spawn(watch.run())
    await world_dp.advance(15)
    proxy = watch.status_section()["pd_watch"]["proxy"]
    assert proxy["ok"] is False and proxy["what"] == "200 with an empty body"
    n0 = world_dp.stacks["n0"]
    faults = [e for e in n0.events_of("pd_watch") if "the proxy itself is the fault" in e["message"]]
    assert n0.started("proxy") == 1, "one round: not yet"
    await world_dp.advance(10)
    if case == "backends answer":
        assert proxy["fault"].startswith("the proxy answers 200 with an empty body while every prefill→decode pair "
                                         "answers with tokens (2 decode instances probed)"), proxy
        assert len(faults) == 1 and faults[0]["level"] == "error" and faults[0]["component"] == "proxy", \
            "said once, not every round"
        assert "(it restarts after 2 such rounds in a row)" in faults[0]["message"]
        await world_dp.until("the proxy restarted", lambda: n0.started("proxy") == 2, 30)
        (restart,) = [r for r in n0.restarts if r[0] == "proxy"]
        assert restart[1].startswith("pd watch: the proxy answers 200 with an empty body") and restart[1].endswith(
            "2 rounds in a row") and restart[2] is False, restart
        backends.proxy_answer = TWO_TOKENS  # the new process routes
        await world_dp.until("the proxy ready", lambda: n0.components["proxy"].ready, 60)
        await world_dp.advance(20)
        assert watch.status_section()["pd_watch"]["proxy"]["fault"] is None
        messages = [e["message"] for e in n0.events_of("pd_watch")]
        assert "the proxy answers with tokens again (2 tokens)" in messages
        assert sum(m.startswith("the proxy restarts: ") for m in messages) == 1, messages
        assert list(watch.status_section()["pd_watch"]["restarted"]) == ["proxy (hung)"]
    elif case == "restart off":
        assert len(faults) == 1 and "(proxy_fault_after 0: not restarted)" in faults[0]["message"]
        await world_dp.advance(30)
        assert n0.started("proxy") == 1 and not watch.acted
    else:
        assert proxy["fault"] is None and not faults
        assert n0.started("proxy") == 1 and not watch.acted
        if case == "a backend fails after its turn":
            assert watch.empties.streak[second] >= 2, "the instance is counted, asked again after the proxy"
            since = watch.status_section()["pd_watch"]["empty_since"]
            assert list(since) == ["d0"] and list(since["d0"]) == [second] and since["d0"][second] <= \
                world_dp.clock.time(), "status says when the counted instance was first asked and answered empty"
    assert d0_starts(world_dp) == [1, 1], "no group restarts for the proxy's fault"


def port_of(world: World, group: str) -> int:
    (endpoint,) = world.agents["n0"].coordinator.layout.group(group).endpoints
    return int(endpoint.rsplit(":", 1)[1])


@pytest.mark.parametrize("case", ["decode down, p1 full", "decode down, prefill not full", "decode up, p1 full"])
async def test_prefill_full_of_a_dead_decoders_kv_restarts_while_decode_is_down(world: World, case: str) -> None:
    """The loop (#13240): while d0 is out of the proxy, prefill's KV usage is read; the fullest group past the
    threshold restarts, one group at a time. Prefill under the threshold, or decode up, restart nothing."""
    co = world.agents["n0"].coordinator
    backends = Backends()
    if case != "decode down, prefill not full":
        backends.usage = {port_of(world, "p0"): 0.93, port_of(world, "p1"): 0.97}
    watch = PdWatch(co, PdWatchConfig(probe_period_s=10), lambda: {}, model="dsv4", clock=world.clock,
                    http=backends)  # fmt: skip
    watch.co.port.attach(watch)  # as the agent attaches its layers
    co.spawn(watch.run())
    sync = co.proxies[0]
    world.stacks["n1"].components["vllm"].start_s = 60.0  # a restarted prefill is out of the proxy a while
    if case != "decode up, p1 full":
        world.stacks["n2"].command("vllm", "stop", by="operator (test)")  # d0 dies and stays down
        await world.until("d0 out of the proxy", lambda: sync.health.get("d0"), 60)
    await world.advance(60)
    metrics = [u for _, u in backends.calls if u.endswith("/metrics")]
    starts = {n: world.stacks[n].started("vllm") for n in ("n0", "n1")}
    if case == "decode down, p1 full":
        await world.until("p1 restarted", lambda: world.stacks["n1"].started("vllm") == 2, 60)
        assert world.gang("n1", "p1").record.generation == 2  # type: ignore[union-attr]
        assert "KV cache 97% >= 90% while decode d0 is down" in world.gang("n1", "p1").record.reason  # type: ignore[union-attr]
        backends.usage[port_of(world, "p1")] = 0.1  # a fresh engine holds no KV
        await world.until("p0 restarted next", lambda: world.stacks["n0"].started("vllm") == 2, 120)
        p1 = world.stacks["n1"].components["vllm"]
        assert watch.acted[("kv", "p0")] >= p1.starts[-1] + p1.start_s, "one group at a time: p0 once p1 is back"
        assert sorted(watch.status_section()["pd_watch"]["restarted"]) == ["p0 (kv)", "p1 (kv)"]
    elif case == "decode down, prefill not full":
        assert metrics and starts == {"n0": 1, "n1": 1} and not watch.acted, "read, under the threshold: nothing"
    else:
        assert not metrics and starts == {"n0": 1, "n1": 1} and not watch.acted, "decode up: prefill's KV is its own"


@pytest.mark.parametrize("failures", [5, 3])
async def test_transfer_failures_with_every_prefill_restart_the_decoder_only(world: World, failures: int) -> None:
    """The loop (#10224): n2 publishes its decode rank's transfer failures with both prefill groups in its member
    record; at the threshold (5 per pair in 300 s) d0 restarts — never the prefills — and once only (the events
    before its restart no longer count); below it nothing restarts."""
    co = world.agents["n0"].coordinator
    now = world.clock.time()
    record = {"kv_transfers": [[now - 10 + i, "d0", peer] for peer in ("p0", "p1") for i in range(failures)]}
    settings = PdWatchConfig(probe_period_s=10, transfer_window_s=3600)  # still in the window after the cooldown
    watch = PdWatch(co, settings, lambda: {"n2": record}, model="dsv4", clock=world.clock, http=Backends())
    watch.co.port.attach(watch)  # as the agent attaches its layers
    co.spawn(watch.run())
    await world.advance(30)
    if failures >= 5:
        await world.until("d0 restarted", lambda: world.stacks["n2"].started("vllm") == 2, 60)
        assert "10 KV transfer failures in 3600s with every prefill engine (p0, p1)" in world.gang(
            "n2", "d0").record.reason  # type: ignore[union-attr]
        await world.advance(RESTART_COOLDOWN_S + 60)
        assert world.stacks["n2"].started("vllm") == 2, "the failures before the restart are not counted again"
    else:
        assert world.stacks["n2"].started("vllm") == 1 and not watch.acted
    assert {n: world.stacks[n].started("vllm") for n in ("n0", "n1")} == {"n0": 1, "n1": 1}, "never the prefills"


async def test_one_restart_of_a_group_per_cooldown_whatever_the_reason(world: World) -> None:
    co = world.agents["n0"].coordinator
    watch = PdWatch(co, PdWatchConfig(probe_period_s=10), lambda: {}, model="dsv4", clock=world.clock,
                    http=Backends())  # fmt: skip
    watch.co.port.attach(watch)  # as the agent attaches its layers
    assert await watch._restart("empty", "d0", "answers without tokens")
    assert not await watch._restart("transfer", "d0", "transfer failures with every prefill peer")
    assert await watch._restart("kv", "p0", "KV usage past the threshold"), "another group has its own cooldown"
    await world.until("d0 restarted", lambda: world.stacks["n2"].started("vllm") == 2, 60)
    await world.advance(RESTART_COOLDOWN_S)
    assert await watch._restart("transfer", "d0", "transfer failures again, after the cooldown")
    assert sorted(watch.status_section()["pd_watch"]["restarted"]) == ["d0 (empty)", "d0 (transfer)", "p0 (kv)"]


async def test_a_node_publishes_its_ranks_transfer_failures(world: World) -> None:
    """kvlog: the decode rank's log names the prefill peer by its Mooncake handshake port (kv_port range)."""
    from nodeagent.layers.kvlog import KvTransferLog

    stack = world.stacks["n2"]
    kvlog = KvTransferLog(stack.config, stack, clock=world.clock)  # type: ignore[arg-type]
    stack.attach(kvlog)
    p0 = world.agents["n0"].coordinator.layout.group("p0")
    kvlog.feed("vllm", [f"E20260101 transfer failed and disconnect to:127.0.0.1:{p0.kv_port}",
                        "Mooncake transfer failed for request. remote_request_id=abc, ret=-1.",
                        "INFO an unrelated line"])  # fmt: skip
    published = stack.status()["kv_transfers"]
    assert [row[1:] for row in published] == [["d0", "p0"], ["d0", None]]


async def test_the_agent_reaches_backends_and_proxy_directly_whatever_http_proxy_says(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Nodes export http_proxy for downloads, seldom with their own addresses in no_proxy (the guide unsets it
    before the proxy): the watch's probes and the proxy sync's calls must not go through it."""
    import http.server
    import threading

    from conftest import free_port

    from nodeagent.cluster.pd_watch import http_call
    from nodeagent.cluster.proxy_sync import http_post

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"id": self.headers.get("X-Request-Id")}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dead = f"http://127.0.0.1:{free_port()}"
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy"):
        monkeypatch.setenv(var, dead)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    try:
        assert await http_call("POST", url, {}, 5.0, {"X-Request-Id": "r1"}) == (200, '{"id": "r1"}')
        assert await http_post(url, {}) == {"id": None}
    finally:
        server.shutdown()
        server.server_close()


async def test_under_journald_the_relay_keeps_the_failure_lines_kvlog_counts(world: World,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd: a rank's output goes to journald through the log relay, never through a file of ours; the relay
    (the real one, around a real process) sends every line to journald and keeps the KV transfer failures in the
    component's folder, where kvlog reads them as it reads the log file outside systemd."""
    import functools
    import sys

    from journald_fake import fake_journald_socket, parse_entry

    from nodeagent.core import journal, logsink
    from nodeagent.layers.kvlog import KvTransferLog
    from nodeagent.node import logrelay
    from nodeagent.render.launch import component_dir

    stack = world.stacks["n2"]
    p0 = world.agents["n0"].coordinator.layout.group("p0")
    monkeypatch.setattr(logsink, "use_journal", lambda: True)
    kvlog = KvTransferLog(stack.config, stack, clock=world.clock)  # type: ignore[arg-type]
    stack.attach(kvlog)
    folder = component_dir(stack.config, "vllm")
    folder.mkdir(parents=True, exist_ok=True)
    kv_file = folder / logsink.KV_FAILURES
    assert logsink.transfer_lines(stack.config.agent.log_dir, folder, "vllm") == kv_file
    assert kvlog.read_new("vllm") == [], "nothing before the rank's first line"
    lines = ["INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.32",
             f"E20260101 transfer failed and disconnect to:127.0.0.1:{p0.kv_port}",
             "ERROR [mooncake_connector.py:1329] Mooncake transfer failed for request. remote_request_id=r1, ret=-1."]
    with fake_journald_socket() as (sock, path):
        monkeypatch.setattr(logrelay, "JournalSender", functools.partial(journal.JournalSender, socket_path=path))
        # in this thread (it sets signal handlers): a short child, the loop waits a moment
        code = logrelay.relay("vllm", "dsv4-agent.service", [sys.executable, "-c", f"print({chr(10).join(lines)!r})"],
                              None, str(kv_file))  # fmt: skip
        assert code == 0
        sent = [parse_entry(sock.recv(65536)) for _ in lines]
    assert [e["MESSAGE"].decode() for e in sent] == lines, "journald got every line"
    assert {e["SYSLOG_IDENTIFIER"] for e in sent} == {b"vllm"}
    assert kv_file.read_text().splitlines() == lines[1:], "the relay kept the two failure lines"
    kvlog.feed("vllm", kvlog.read_new("vllm"))
    assert [row[1:] for row in stack.status()["kv_transfers"]] == [["d0", "p0"], ["d0", None]]


GROUPS_2D = [*GROUPS, {"name": "d1", "kind": "decode", "nodes": ["n3"]}]


async def test_a_decoder_joining_the_proxy_during_a_round_is_asked_before_the_proxy_is_blamed(tmp_path: Path) -> None:
    """Issue 33's campaign: a decode group re-added to the proxy after its round's probes began was not probed that
    round; the proxy routed the watch's own request to it, it answered empty, and the proxy — whose every probed
    instance answered — was named the fault (a restart of the proxy after two such rounds fails every request in
    flight). Asked again before blaming, the newcomer explains the empty answer and its streak counts."""
    w = World(tmp_path / "w", ["n0", "n1", "n2", "n3"], GROUPS_2D, proxy=True)
    w.start()
    try:
        await w.until("every component up", w.all_up, within=120)
        await w.until("the proxy ready", lambda: w.stacks["n0"].components["proxy"].ready)
        co = w.agents["n0"].coordinator
        (d1,) = co.layout.group("d1").endpoints
        backends = Backends(w.clock)
        health = {"p0": True, "p1": True, "d0": True, "d1": False}  # d1 out of the proxy as the round begins

        def d1_joins() -> None:  # back in the proxy just before its request, and empty: the proxy routes to it
            health["d1"] = True
            backends.proxy_answer = (200, "")

        backends.on_proxy = d1_joins
        backends.decode_answers[int(d1.rsplit(":", 1)[1])] = (200, "")
        watch = PdWatch(co, PdWatchConfig(probe_period_s=10, empty_after=5), lambda: {}, model="dsv4",
                        clock=w.clock, http=backends)  # fmt: skip
        watch._health = lambda: dict(health)  # type: ignore[method-assign]  # the proxy sync's view, scripted
        watch.co.port.attach(watch)
        co.spawn(watch.run())
        await w.advance(12)
        proxy = watch.status_section()["pd_watch"]["proxy"]
        assert proxy["ok"] is False and proxy["fault"] is None, proxy
        assert not [e for e in w.stacks["n0"].events_of("pd_watch") if "the proxy itself" in e["message"]]
        assert watch.empties.streak[d1] == 1, "the newcomer's empty answer is counted: the watch attributes it"
    finally:
        await w.close()


async def test_a_prefill_that_does_not_answer_is_no_proof_against_the_proxy(world_dp: World) -> None:
    """Issue 33's campaign: p0's rank stopped (SIGSTOP), the proxy's requests through it failed (500), the probes
    through p1 answered and those through p0 were left out — so the proxy was named the fault and restarted after
    two rounds, failing every request in flight and emptying its lists. A silent prefill explains the proxy's
    failure: no proxy restart."""
    co = world_dp.agents["n0"].coordinator
    (p0,) = co.layout.group("p0").endpoints
    backends = Backends(world_dp.clock)
    backends.dead.add(int(p0.rsplit(":", 1)[1]))
    backends.proxy_answer = (500, "Internal Server Error")
    watch = PdWatch(co, PdWatchConfig(probe_period_s=10, proxy_fault_after=2), lambda: {}, model="dsv4",
                    clock=world_dp.clock, http=backends)  # fmt: skip
    watch.co.port.attach(watch)
    co.spawn(watch.run())
    await world_dp.advance(35)
    assert watch.status_section()["pd_watch"]["proxy"]["fault"] is None
    assert world_dp.stacks["n0"].started("proxy") == 1 and not watch.acted


@pytest.mark.parametrize("models", ["answers", "fails"])
async def test_an_instance_the_proxy_never_activates_restarts_the_proxy_once_it_answers_the_proxys_check(
        world_dp: World, models: str) -> None:
    """vllm-ascend's proxy activates an added instance from a thread of its own; an exception ends that thread
    for good (seed 3306) and the proxy then serves on without ever routing a restarted group again. An instance
    added and still not listed after twice the proxy's window (1 s x 60 checks here: 120 s) while it answers the
    proxy's own check (`/v1/models`) is the proxy's fault: said, and the proxy restarts (the new process routes it
    at once). One that does not answer that check is its own fault: said, nothing restarts."""
    co = world_dp.agents["n0"].coordinator
    n0, proxy = world_dp.stacks["n0"], world_dp.proxy
    assert proxy is not None
    backends = Backends(world_dp.clock)
    d0 = set(co.layout.group("d0").endpoints)
    if models == "fails":
        backends.models_down = {int(e.rsplit(":", 1)[1]) for e in d0}
    watch = PdWatch(co, PdWatchConfig(probe_period_s=12), lambda: {}, model="dsv4", clock=world_dp.clock,
                    http=backends)  # fmt: skip
    watch.co.port.attach(watch)
    co.spawn(watch.run())
    await world_dp.advance(5)
    proxy.activation_dead = True
    await co.ask_generations(["d0"], "test: a restart", planned=False)
    await world_dp.until("d0 restarted and waiting in the proxy", lambda: d0_starts(world_dp) == [2, 2]
                         and proxy.waiting["decode"] == d0, 60)  # fmt: skip
    waiting_from = world_dp.clock.monotonic()
    await world_dp.advance(100)
    assert n0.started("proxy") == 1 and not proxy.routed["decode"] & d0, "within twice its window: not yet"
    said = [e for e in n0.events_of("pd_watch") if "has not activated" in e["message"]]
    assert not said
    if models == "fails":
        await world_dp.advance(60)
        said = [e["message"] for e in n0.events_of("pd_watch") if "has not activated" in e["message"]]
        assert len(said) == 1 and "do not answer /v1/models (not the proxy's fault)" in said[0], said
        assert n0.started("proxy") == 1 and d0_starts(world_dp) == [2, 2], "nothing restarts"
        return
    await world_dp.until("the proxy restarted", lambda: n0.started("proxy") == 2, 60)
    assert 120 < world_dp.clock.monotonic() - waiting_from < 130
    (restart,) = [r for r in n0.restarts if r[0] == "proxy"]
    assert restart[1].startswith("pd watch: the proxy has not activated ") and restart[1].endswith(
        "its activation thread is not running"), restart
    said = [e for e in n0.events_of("pd_watch") if e["message"].startswith("the proxy has not activated")]
    assert len(said) == 1 and said[0]["level"] == "error" and said[0]["message"].endswith("(it restarts)"), said
    assert [e["message"] for e in n0.events_of("pd_watch") if e["message"].startswith("the proxy restarts: ")] == [
        f"the proxy restarts: {restart[1].removeprefix('pd watch: ')}"]
    await world_dp.until("d0 routed by the new proxy", lambda: proxy.routed["decode"] >= d0, 60)
    await world_dp.advance(30)
    assert n0.started("proxy") == 2 and d0_starts(world_dp) == [2, 2], "one restart, of the proxy only"
    assert watch.status_section()["pd_watch"]["activation"] is None


def test_an_instance_is_stuck_past_twice_the_proxys_activation_window_and_never_under_a_minute() -> None:
    assert activation_window(1.0, 60) == 60.0 and activation_window(None, None) == 30.0, "the script's 10 s x 3"
    pending = {"a:1": 0.0, "b:2": 100.0}
    assert stuck_activations(pending, 120.0, 60.0) == [] and stuck_activations(pending, 121.0, 60.0) == ["a:1"]
    assert stuck_activations(pending, 59.0, 1.0) == [] and stuck_activations(pending, 161.0, 1.0) == ["a:1", "b:2"]

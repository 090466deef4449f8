"""Issue 19 item 2 end to end: vllm-ascend's real PD proxy on n0 in front of a prefill stand-in (n0) and a decode
group of two DP ranks on n1 (external launch: `vllm-dp0`, `vllm-dp1`, each its own API server, both in the
proxy's decoder list), each run by its real agent on the suite's one etcd. The second rank's KV pulls start
failing (the stand-in's `kv_fail`: a request handed a remote prefill answers 500, `/health` and every other
request are served), so the proxy — which has sent its 200 before it reads the decoder — answers 200 with an
empty body whenever it routes there (#13140). No probe of the rank sees it; the agent's PD watch on the proxy's
node does (prefill → each decode rank as the proxy routes), restarts the decode group once, and the proxy's
answers carry tokens again — as does the watch's own 2-token request through the proxy. The decoder's node
counts the Mooncake failure lines its rank printed and publishes them in its member record (item 6).

The proxy itself as the fault, on the same cluster (one per module): the real proxy process stopped (SIGSTOP —
its port still accepts, nothing answers) while every instance answers is named and restarted by the watch —
the proxy alone, no rank, no generation; stopped for one round only, it is named and left alone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from cluster_harness import ClusterHarness
from conftest import free_port, wait_for

pytestmark = pytest.mark.system



def without_datasystem(h: ClusterHarness) -> None:
    """The PD path needs no datasystem worker: leave it out (a faster start)."""
    h.data["components"].pop("datasystem")
    h.data["components"]["vllm"].pop("depends_on")
    for node in h.data["cluster"]["nodes"]:
        node["components"].pop("datasystem")


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, etcd: Any) -> Iterator[ClusterHarness]:
    h = ClusterHarness(tmp_path_factory.mktemp("pd"), etcd.endpoint, ["n0", "n1"])
    without_datasystem(h)
    h.data["cluster"]["vllm_groups"] = [{"name": "p0", "kind": "prefill", "nodes": ["n0"]},
                                        {"name": "d0", "kind": "decode", "nodes": ["n1"], "dp_launch": "external",
                                         "data_parallel_size_local": 2}]  # fmt: skip
    h.node("n1")["components"]["vllm"]["port"] = free_port(2)  # rank r listens on port + r
    h.data["cluster"]["pd"] = {"kv_port_base": free_port()}
    h.add_pd_proxy()
    h.data["recovery"] = {"pd": {"probe_period_s": 1, "probe_timeout_s": 5, "empty_after": 2}}
    try:
        h.start()
        yield h
    finally:
        h.cleanup()


def post(url: str, body: dict[str, Any], timeout: float = 20) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def completion_text(body: bytes) -> str:
    return str(json.loads(body)["choices"][0]["text"]) if body.strip() else ""


RANKS = {"vllm-dp0": {"ready"}, "vllm-dp1": {"ready"}}
ASK = {"model": "dsv4", "prompt": "tell me a story", "max_tokens": 4, "ignore_eos": True}


def proxy_url(pd: ClusterHarness) -> str:
    return f"http://127.0.0.1:{pd.data['components']['proxy']['port']}/v1/completions"


def pids(pd: ClusterHarness) -> dict[str, int]:
    """Every vLLM rank's pid and the proxy's."""
    n0, n1 = pd.agents["n0"].children(), pd.agents["n1"].children()
    return {"vllm": n0["vllm"]["pid"], "proxy": n0["proxy"]["pid"], **{r: n1[r]["pid"] for r in RANKS}}


def serving(pd: ClusterHarness) -> dict[str, int]:
    """Every component ready and the proxy answering with tokens: the pids then."""
    pd.wait_states("n0", {"vllm": {"ready"}, "proxy": {"ready"}}, 120)
    pd.wait_states("n1", RANKS, 120)
    wait_for("the proxy answering with tokens", lambda: completion_text(post(proxy_url(pd), ASK)[1]), 60, 0.5)
    wait_for("the watch's request through the proxy answered", lambda: pd.status("n0")["pd_watch"]["proxy"].get(
        "ok"), 30, 0.2)  # fmt: skip
    return pids(pd)


def test_a_proxy_stalled_for_one_round_is_named_and_left_alone(pd: ClusterHarness) -> None:
    """Below `proxy_fault_after` (2 rounds): one failed request through the proxy while every instance answers
    says so, restarts nothing."""
    before = serving(pd)
    gen = pd.status("n1")["cluster"]["gangs"]["d0"]["generation"]
    os.kill(before["proxy"], signal.SIGSTOP)
    try:
        fault = wait_for("the watch naming the proxy", lambda: pd.status("n0")["pd_watch"]["proxy"]["fault"], 30, 0.2)
    finally:
        os.kill(before["proxy"], signal.SIGCONT)
    assert "while every prefill→decode pair answers with tokens (2 decode instances probed): the proxy itself " \
        "is the fault" in fault, fault
    wait_for("the proxy answering again", lambda: "the proxy answers with tokens again" in pd.agents["n0"].log(), 30,
             0.2)  # fmt: skip
    assert pids(pd) == before, "nothing restarted"
    assert "the proxy restarts: " not in pd.agents["n0"].log()
    assert pd.status("n1")["cluster"]["gangs"]["d0"]["generation"] == gen


def test_a_hung_proxy_is_restarted_alone(pd: ClusterHarness) -> None:
    """SIGSTOP: the process stays, its port accepts (the kernel's backlog), nothing answers — /healthcheck too,
    but liveness needs three 10 s periods. The watch's request through the proxy fails two rounds in a row
    while every instance answers: the watch names the proxy, restarts it — and no vLLM rank."""
    before = serving(pd)
    gen = pd.status("n1")["cluster"]["gangs"]["d0"]["generation"]
    restarts = pd.status("n0")["components"]["proxy"]["restarts"]
    os.kill(before["proxy"], signal.SIGSTOP)
    agent0 = pd.agents["n0"]
    try:
        wait_for("the watch restarting the proxy", lambda: "the proxy restarts: the proxy answers " in
                 agent0.log(), 60, 0.2)  # fmt: skip
        wait_for("a new proxy process", lambda: agent0.children().get("proxy", {}).get("pid") not in (
            None, before["proxy"]), 60, 0.2)  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before["proxy"], signal.SIGCONT)
    after = serving(pd)
    assert {k: v for k, v in after.items() if k != "proxy"} == {k: v for k, v in before.items() if k != "proxy"}, \
        "no vLLM rank restarted"
    assert pd.status("n1")["cluster"]["gangs"]["d0"]["generation"] == gen, "no generation"
    proxy = pd.status("n0")["components"]["proxy"]
    assert proxy["restarts"] == restarts + 1, f"one restart: {proxy}"
    watch = pd.status("n0")["pd_watch"]
    assert "proxy (hung)" in watch["restarted"] and watch["proxy"]["fault"] is None, watch


def test_a_decode_rank_whose_answers_come_back_empty_through_the_proxy_is_restarted_once(pd: ClusterHarness) -> None:
    """Not the proxy's fault: every round one instance fails too."""
    ranks = RANKS
    proxy_pid = serving(pd)["proxy"]
    named = pd.agents["n0"].log().count("the proxy itself is the fault")
    proxy = proxy_url(pd)
    second = pd.node("n1")["components"]["vllm"]["port"] + 1
    ask = {"model": "dsv4", "prompt": "tell me a story", "max_tokens": 4, "ignore_eos": True}
    code, body = post(proxy, ask)
    assert code == 200 and completion_text(body), body
    gen = pd.status("n1")["cluster"]["gangs"]["d0"]["generation"]
    decode_pids = {r: pd.agents["n1"].children()[r]["pid"] for r in ranks}
    prefill_pid = pd.agents["n0"].children()["vllm"]["pid"]

    assert post(f"http://127.0.0.1:{second}/standin/fault", {"mode": "kv_fail"})[0] == 200
    # the proxy picks the least loaded decoder: requests one after another all go to rank 0, concurrent ones
    # reach rank 1 too
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: post(proxy, {**ask, "max_tokens": 32}), range(6)))
    assert (200, b"") in answers, f"the proxy answers 200 with an empty body when it picks rank 1 (#13140): {answers}"
    assert any(completion_text(body) for _, body in answers), "rank 0 answers: only some clients see the fault"
    assert post(f"http://127.0.0.1:{second}/v1/completions", {"model": "dsv4", "prompt": "hi", "max_tokens": 2})[0] \
        == 200, "a request without a remote prefill is still served: nothing but the PD path shows the fault"

    agent0 = pd.agents["n0"]
    wait_for("the PD watch to restart d0", lambda: "group d0 restarts: 2 answers in a row without the 2 tokens asked "
             f"from decode d0 instance 127.0.0.1:{second} (HTTP 500" in agent0.log(), 60, 0.2)  # fmt: skip
    wait_for("both of d0's ranks replaced", lambda: all(pd.agents["n1"].children().get(r, {}).get("pid")
             not in (None, decode_pids[r]) for r in ranks), 60, 0.2)  # fmt: skip
    pd.wait_states("n1", ranks, 60)
    wait_for("the proxy answering with tokens again", lambda: all(completion_text(post(proxy, ask)[1])
                                                                   for _ in range(4)), 60, 0.5)  # fmt: skip

    gang = pd.status("n1")["cluster"]["gangs"]["d0"]
    assert gang["generation"] == gen + 1, f"one generation: {gang}"
    assert pd.agents["n0"].children()["vllm"]["pid"] == prefill_pid, "prefill untouched"
    assert pd.agents["n0"].children()["proxy"]["pid"] == proxy_pid, "the proxy untouched"
    assert pd.agents["n0"].log().count("the proxy itself is the fault") == named, "the proxy not blamed"
    watch = wait_for("the watch's probes and its request through the proxy answered", lambda: (
        w := pd.status("n0")["pd_watch"])["proxy"].get("ok") and set(w["probes"]["d0"].values()) == {"2 tokens"}
        and w, 30, 0.2)  # fmt: skip
    assert sorted(watch["probes"]["d0"]) == sorted(f"127.0.0.1:{second - 1 + r}" for r in (0, 1)), watch
    assert watch["proxy"]["fault"] is None and watch["proxy"]["what"] == "2 tokens", watch
    assert set(watch["empty_streaks"]["d0"].values()) == {0} and "d0 (empty)" in watch["restarted"], watch
    # item 6: n1's rank printed the Mooncake connector's failure line; n1 counted it and published it
    member = next(m for m in pd.cluster("n0")["members"] if m["name"] == "n1")
    assert any(row[1] == "d0" for row in member.get("kv_transfers") or []), member

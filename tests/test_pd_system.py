"""Issue 19 item 2 end to end: vllm-ascend's real PD proxy on n0 in front of a prefill stand-in (n0) and a decode
group of two DP ranks on n1 (external launch: `vllm-dp0`, `vllm-dp1`, each its own API server, both in the
proxy's decoder list), each run by its real agent on the suite's one etcd. The second rank's KV pulls start
failing (the stand-in's `kv_fail`: a request handed a remote prefill answers 500, `/health` and every other
request are served), so the proxy — which has sent its 200 before it reads the decoder — answers 200 with an
empty body whenever it routes there (#13140). No probe of the rank sees it; the agent's PD watch on the proxy's
node does (prefill → each decode rank as the proxy routes), restarts the decode group once, and the proxy's
answers carry tokens again — as does the watch's own 2-token request through the proxy. The decoder's node
counts the Mooncake failure lines its rank printed and publishes them in its member record (item 6)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
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


@pytest.fixture
def pd(tmp_path: Path, etcd: Any) -> Iterator[ClusterHarness]:
    h = ClusterHarness(tmp_path, etcd.endpoint, ["n0", "n1"])
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


def test_a_decode_rank_whose_answers_come_back_empty_through_the_proxy_is_restarted_once(pd: ClusterHarness) -> None:
    ranks = {"vllm-dp0": {"ready"}, "vllm-dp1": {"ready"}}
    pd.wait_states("n0", {"vllm": {"ready"}, "proxy": {"ready"}}, 120)
    pd.wait_states("n1", ranks, 120)
    proxy = f"http://127.0.0.1:{pd.data['components']['proxy']['port']}/v1/completions"
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
    watch = wait_for("the watch's probes and its request through the proxy answered", lambda: (
        w := pd.status("n0")["pd_watch"])["proxy"].get("ok") and set(w["probes"]["d0"].values()) == {"2 tokens"}
        and w, 30, 0.2)  # fmt: skip
    assert sorted(watch["probes"]["d0"]) == sorted(f"127.0.0.1:{second - 1 + r}" for r in (0, 1)), watch
    assert watch["proxy"]["fault"] is None and watch["proxy"]["what"] == "2 tokens", watch
    assert set(watch["empty_streaks"]["d0"].values()) == {0} and list(watch["restarted"]) == ["d0 (empty)"], watch
    # item 6: n1's rank printed the Mooncake connector's failure line; n1 counted it and published it
    member = next(m for m in pd.cluster("n0")["members"] if m["name"] == "n1")
    assert any(row[1] == "d0" for row in member.get("kv_transfers") or []), member

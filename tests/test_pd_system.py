"""Issue 19 item 2 end to end: vllm-ascend's real PD proxy on n0 in front of a prefill stand-in (n0) and a decode
stand-in (n1), each run by its real agent on the suite's one etcd. The decoder's KV pulls start failing (the
stand-in's `kv_fail`: a request handed a remote prefill answers 500, `/health` and every other request are
served), so the proxy — which has sent its 200 before it reads the decoder — answers 200 with an empty body
(#13140). No probe of the decoder sees it; the agent's PD watch on the proxy's node does (prefill → decode as the
proxy routes), restarts the decode group once, and the proxy's answers carry tokens again. The decoder's node
counts the Mooncake failure lines its rank printed and publishes them in its member record (item 6)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
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
                                        {"name": "d0", "kind": "decode", "nodes": ["n1"]}]  # fmt: skip
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


def test_a_decoder_whose_answers_come_back_empty_through_the_proxy_is_restarted_once(pd: ClusterHarness) -> None:
    pd.wait_states("n0", {"vllm": {"ready"}, "proxy": {"ready"}}, 120)
    pd.wait_states("n1", {"vllm": {"ready"}}, 120)
    proxy = f"http://127.0.0.1:{pd.data['components']['proxy']['port']}/v1/completions"
    decoder = f"http://127.0.0.1:{pd.node('n1')['components']['vllm']['port']}"
    ask = {"model": "dsv4", "prompt": "tell me a story", "max_tokens": 4, "ignore_eos": True}
    code, body = post(proxy, ask)
    assert code == 200 and completion_text(body), body
    gen = pd.status("n1")["cluster"]["gangs"]["d0"]["generation"]
    decode_pid = pd.agents["n1"].children()["vllm"]["pid"]
    prefill_pid = pd.agents["n0"].children()["vllm"]["pid"]

    assert post(f"{decoder}/standin/fault", {"mode": "kv_fail"})[0] == 200
    code, body = post(proxy, ask)
    assert (code, body) == (200, b""), "the proxy answers 200 with an empty body (#13140)"
    assert post(f"{decoder}/v1/completions", {"model": "dsv4", "prompt": "hi", "max_tokens": 2})[0] == 200, \
        "a request without a remote prefill is still served: nothing but the PD path shows the fault"

    agent0 = pd.agents["n0"]
    wait_for("the PD watch to restart d0", lambda: "group d0 restarts: 2 answers in a row without tokens from "
             "decode d0 (HTTP 500" in agent0.log(), 60, 0.2)  # fmt: skip
    wait_for("d0's rank replaced", lambda: pd.agents["n1"].children().get("vllm", {}).get("pid")
             not in (None, decode_pid), 60, 0.2)  # fmt: skip
    pd.wait_states("n1", {"vllm": {"ready"}}, 60)
    wait_for("the proxy answering with tokens again", lambda: completion_text(post(proxy, ask)[1]), 60, 0.5)

    gang = pd.status("n1")["cluster"]["gangs"]["d0"]
    assert gang["generation"] == gen + 1, f"one generation: {gang}"
    assert pd.agents["n0"].children()["vllm"]["pid"] == prefill_pid, "prefill untouched"
    watch = wait_for("the watch's probe answered with tokens", lambda: (w := pd.status("n0")["pd_watch"])
                     ["probes"]["d0"] == "2 tokens" and w, 30, 0.2)  # fmt: skip
    assert watch["empty_streaks"]["d0"] == 0 and list(watch["restarted"]) == ["d0 (empty)"], watch
    # item 6: n1's rank printed the Mooncake connector's failure line; n1 counted it and published it
    member = next(m for m in pd.cluster("n0")["members"] if m["name"] == "n1")
    assert any(row[1] == "d0" for row in member.get("kv_transfers") or []), member

"""A rollout on real processes: five agents on one machine (the master runs etcd and vllm-ascend's real PD proxy),
real datasystem workers, the vLLM stand-in; groups p0 (prefill, n0 + n1), p1 (prefill, n2 + n3), d0 (decode, n4).
Requests flow through the proxy the whole time. What the process-less tests (test_rollout_layer.py) cannot show:
that no request sent while a group was drained fails through the real proxy, that the real agents restart their
ranks with the new file (their member records publish its hash), that a group failing its canary is rolled
back, that an agent killed mid-step picks the plan up, and the CLI's refusal for the single decode group."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import ClusterHarness
from conftest import free_port, wait_for

from nodeagent.config.cluster import cluster_file_hash
from nodeagent.config.load import load_config

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
PROXY = ROOT / ".cache/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"
NODES = ["n0", "n1", "n2", "n3", "n4"]


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHarness]:
    if not PROXY.is_file():
        pytest.fail("vllm-ascend's proxy is not fetched: scripts/test.sh fetches it "
                    "(scripts/fetch_vllm_ascend_examples.py)")
    h = ClusterHarness(tmp_path_factory.mktemp("rollout"), None, NODES, run_etcd=True, ttl_s=3.0, heartbeat_s=5.0)
    h.data["cluster"]["vllm_groups"] = [
        {"name": "p0", "kind": "prefill", "nodes": ["n0", "n1"], "data_parallel_rpc_port": free_port()},
        {"name": "p1", "kind": "prefill", "nodes": ["n2", "n3"], "data_parallel_rpc_port": free_port()},
        {"name": "d0", "kind": "decode", "nodes": ["n4"]},
    ]
    h.data["cluster"]["pd"] = {"kv_port_base": free_port()}
    h.data["components"]["proxy"] = {"kind": "proxy", "command": sys.executable, "script": str(PROXY),
                                     "port": free_port(), "host": "127.0.0.1",
                                     "probes": {"readiness": {"period_s": 1, "timeout_s": 10}}}  # fmt: skip
    try:
        h.start()
        h.wait_up(timeout=180)
        h.wait_routed("n0", ("p0", "p1", "d0"), 120)
        yield h
    finally:
        h.cleanup()


class Traffic:
    """Requests through the proxy one after the other (with short gaps: the proxy deletes a removed instance
    only at an idle moment), each noted with when it was sent and how it ended."""

    def __init__(self, h: ClusterHarness) -> None:
        self.url = f"http://127.0.0.1:{h.data['components']['proxy']['port']}/v1/completions"
        self.results: list[tuple[float, int, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def ask(self) -> tuple[int, str]:
        body = json.dumps({"model": "dsv4", "prompt": "hello there", "max_tokens": 4}).encode()
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.read()
                return response.status, ""
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")[:200]
        except OSError as exc:
            return 0, str(exc)

    def _run(self) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            self.results.append((sent, *self.ask()))
            time.sleep(0.05)

    def __enter__(self) -> Traffic:
        self.thread.start()
        wait_for("traffic flowing", lambda: sum(1 for r in self.results if r[1] == 200) >= 3, 30)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(60)

    def failed(self) -> list[tuple[float, int, str]]:
        return [r for r in self.results if r[1] != 200]


def install(h: ClusterHarness, edit: Callable[[dict[str, Any]], None]) -> Path:
    """The operator's tool writes the new file on every member (the agents keep what they loaded)."""
    edit(h.data)
    for name in NODES:
        h.write(name)
    return h.config_path("n1")


def group_env(*groups: str, **env: str) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        for g in data["cluster"]["vllm_groups"]:
            if g["name"] in groups:
                g["env"] = {**g.get("env", {}), **env}

    return edit


def rollout(h: ClusterHarness, node: str = "n1") -> dict[str, Any]:
    return h.cluster(node).get("rollout") or {}


def until_status(h: ClusterHarness, want: str, timeout: float, node: str = "n1", *,
                 after: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The rollout's record once its status is `want`; at once when it ended otherwise, and on a timeout before
    the test's own: either way with the record's story, not a bare timeout. `after`: the id of the rollout
    before this one (its record may still be what this agent shows for a moment)."""
    deadline, view = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        try:
            view = rollout(h, node)
        except Exception:
            view = view or {}
        if after is not None and view.get("id") == after:
            time.sleep(0.5)
            continue
        if view.get("status") == want:
            return view
        if view.get("status") in ("done", "failed", "aborted", "halted", "rolled_back"):
            break
        time.sleep(1.0)
    story = "\n".join(f"  {line}" for line in json.dumps(view, indent=1).splitlines())
    raise AssertionError(f"the rollout is {view.get('status')!r}, not {want!r} (waited up to {timeout:.0f}s):\n"
                         f"{story}")


def pids(h: ClusterHarness) -> dict[str, int]:
    return {n: h.agents[n].children()["vllm"]["pid"] for n in NODES}


def hashes(h: ClusterHarness) -> dict[str, str]:
    return {m["name"]: m.get("cluster_hash") for m in h.cluster("n0")["members"]}


def generation(h: ClusterHarness, group: str) -> int:
    node = {"p0": "n0", "p1": "n2", "d0": "n4"}[group]
    return int(h.gang(node, group)["generation"])


def test_the_single_decode_group_refuses_without_allow_outage(cl: ClusterHarness) -> None:
    path = install(cl, lambda data: data["components"]["vllm"]["env"].update(VLLM_ROLLOUT_TEST="1"))
    out = cl.ctl("n1", "cluster", "rollout", str(path))
    assert out.returncode == 1, out
    assert "d0 (decode, n4) changes:" in out.stdout and "env VLLM_ROLLOUT_TEST added" in out.stdout, out.stdout
    assert "REFUSED: decode has one group (d0): its step takes decode down for" in out.stdout, out.stdout
    assert "pass --allow-outage decode" in out.stdout, out.stdout
    assert cl.ctl("n1", "cluster", "rollout", "status").stdout.strip() == "rollout: none"
    install(cl, lambda data: data["components"]["vllm"]["env"].pop("VLLM_ROLLOUT_TEST"))


def test_a_rollout_under_traffic_survives_a_killed_agent_and_no_request_fails(cl: ClusterHarness) -> None:
    before, old = pids(cl), set(hashes(cl).values())
    gens = {g: generation(cl, g) for g in ("p0", "p1", "d0")}
    path = install(cl, group_env("p0", "p1", VLLM_ROLLOUT_FLAG="on"))
    with Traffic(cl) as traffic:
        dry = cl.ctl("n1", "cluster", "rollout", str(path), "--dry-run", "--bake", "5s")
        assert dry.returncode == 0 and "step 1: p0" in dry.stdout and "step 2: p1" in dry.stdout, dry
        previous = rollout(cl).get("id")
        out = cl.ctl("n1", "cluster", "rollout", str(path), "--bake", "5s", "--drain-timeout", "60s")
        assert out.returncode == 0 and "stored as rollout" in out.stdout, out
        wait_for("p1's step begun", lambda: rollout(cl)["steps"][1]["phase"] != "pending", 240, 0.5)
        cl.kill("n3")  # a member of the step in progress
        cl.start("n3")
        until_status(cl, "done", 240, "n4", after=previous)
        cl.wait_routed("n0", ("p1",), 60)
        sent_at = time.monotonic()
        wait_for("requests after the rollout", lambda: any(r[0] > sent_at for r in traffic.results), 30)
    print(f"{len(traffic.results)} requests during the rollout")
    assert not traffic.failed(), f"requests failed during the rollout: {traffic.failed()[:5]}"
    after = pids(cl)
    assert all(after[n] != before[n] for n in ("n0", "n1", "n2", "n3")) and after["n4"] == before["n4"]
    new_file = cluster_file_hash(load_config(path))
    other = {n: h for n, h in hashes(cl).items() if h != new_file}
    assert not other and new_file not in old, (
        "every member publishes the new file once done (d0's too: nothing of it changed): "
        + ", ".join(f"{n} has {str(h)[:12]}{' (the old file)' if h in old else ''}" for n, h in other.items())
        + f"; the new file is {new_file[:12]}, the old {', '.join(sorted(str(h)[:12] for h in old))} (as n0 sees them)")
    steps = rollout(cl)["steps"]
    assert [s["phase"] for s in steps] == ["done", "done"]
    want = {g: n + (g != "d0") for g, n in gens.items()}
    assert {g: generation(cl, g) for g in gens} == want, "one generation per step, d0 none"


def test_a_group_failing_its_gate_is_rolled_back_and_the_rollout_halts(cl: ClusterHarness) -> None:
    before = pids(cl)
    old = hashes(cl)["n2"]
    path = install(cl, group_env("p1", VLLM_STANDIN_FAULT="empty"))  # answers without tokens: the canary fails
    with Traffic(cl) as traffic:
        previous = rollout(cl).get("id")
        out = cl.ctl("n1", "cluster", "rollout", str(path), "--bake", "5s")
        assert out.returncode == 0, out
        until_status(cl, "halted", 240, after=previous)
        cl.wait_routed("n0", ("p1",), 60)
    view = rollout(cl)
    # the stand-in answers without tokens: the canary fails, or the rank's own probes restart it first
    why = view["steps"][0]["failed"]
    assert "the canary request to p1 failed" in why or "a rank failed" in why, view
    assert "rolled back" in view["message"]
    assert not traffic.failed(), f"requests failed: {traffic.failed()[:5]}"
    assert hashes(cl)["n2"] == hashes(cl)["n3"] == old, "p1 runs the previous file again"
    after = pids(cl)
    assert after["n2"] != before["n2"] and after["n0"] == before["n0"], "only p1 restarted (twice)"
    status = cl.ctl("n1", "cluster", "rollout", "status")
    assert "halted" in status.stdout and "1. p1: rolled_back" in status.stdout, status.stdout
    closed = cl.ctl("n1", "cluster", "rollout", "abort")  # a halted rollout is closed: the next may start
    assert closed.returncode == 0, closed
    until_status(cl, "aborted", 30)


def test_a_group_slower_under_traffic_fails_its_bake_and_is_rolled_back(cl: ClusterHarness) -> None:
    """The new file passes the gate (ready, a canary answered) but prefills 10000x slower: the bake reads the
    group's TTFT from its ranks' /metrics against the old processes' and rolls the group back."""
    old = hashes(cl)["n2"]

    def slow_p1(data: dict[str, Any]) -> None:
        for g in data["cluster"]["vllm_groups"]:
            if g["name"] == "p1":
                g["env"] = {"VLLM_STANDIN_PREFILL_TOKENS_PER_S": "5"}  # (the previous test's fault gone)

    path = install(cl, slow_p1)
    previous = rollout(cl).get("id")
    with Traffic(cl) as traffic:
        out = cl.ctl("n1", "cluster", "rollout", str(path), "--bake", "90s", "--bake-ttft-factor", "2")
        assert out.returncode == 0 and "stored as rollout" in out.stdout, out
        view = until_status(cl, "halted", 240, after=previous)
        cl.wait_routed("n0", ("p1",), 60)
    assert cl.ctl("n1", "cluster", "rollout", "abort").returncode == 0, "closed first: the next test's rollout"
    why = view["steps"][0]["failed"]
    print(f"\nthe step failed {why}")
    assert why.startswith("while baking, p1: mean TTFT") and "before the step (more than 2x)" in why, view
    assert view["options"]["bake_ttft_factor"] == 2.0
    assert not traffic.failed(), f"requests failed: {traffic.failed()[:5]}"
    assert hashes(cl)["n2"] == hashes(cl)["n3"] == old, "p1 runs the previous file again"


def test_an_incompatible_change_switches_the_proxy_without_ever_mixing(cl: ClusterHarness) -> None:
    """Issue 20's "cannot mix old and new groups", through the real proxy: a KV connector change rolls p0 + d0
    first (the only decode group: an allowed outage), then p1. The stand-in's decoder fails any request prefilled
    by an engine with the other connector and logs it; as the pair rejoins, the proxy lets p1 go and takes the
    pair only once p1 is gone, so no such line may appear, and nothing fails once the pair serves."""

    def connector(data: dict[str, Any]) -> None:
        groups = {g["name"]: g for g in data["cluster"]["vllm_groups"]}
        groups["p1"]["env"] = dict(groups["p0"].get("env", {}))  # what p1 runs (the previous tests' faults undone)
        data["cluster"]["pd"]["use_ascend_direct"] = False

    path = install(cl, connector)
    with Traffic(cl) as traffic:
        dry = cl.ctl("n1", "cluster", "rollout", str(path), "--dry-run", "--max-unavailable", "2")
        assert dry.returncode == 1 and "never routed together" in dry.stdout, dry
        assert "step 1: p0, d0" in dry.stdout and "step 2: p1" in dry.stdout, dry.stdout
        assert "pass --allow-outage prefill,decode" in dry.stdout and "pass --allow-outage decode" in dry.stdout
        changes = [line for line in dry.stdout.splitlines() if line.startswith("      n")]
        assert changes and all("--kv-transfer-config" in line for line in changes), dry.stdout
        previous = rollout(cl).get("id")
        out = cl.ctl("n1", "cluster", "rollout", str(path), "--max-unavailable", "2", "--allow-outage",
                     "prefill,decode", "--bake", "5s")  # fmt: skip
        assert out.returncode == 0 and "stored as rollout" in out.stdout, out
        wait_for("p1's step begun, or the rollout stopped", lambda: rollout(cl)["steps"][1]["phase"] != "pending"
                 or rollout(cl)["status"] != "running", 240, 0.5)  # fmt: skip
        switched = time.monotonic()
        assert not mixed_lines(cl), f"requests crossed the two files: {mixed_lines(cl)[:3]}"
        until_status(cl, "done", 240, "n4", after=previous)
        cl.wait_routed("n0", ("p0", "p1", "d0"), 60)
        sent_at = time.monotonic()
        wait_for("requests after the rollout", lambda: any(r[0] > sent_at and r[1] == 200 for r in traffic.results),
                 30)  # fmt: skip
    mixed = mixed_lines(cl)
    failed = traffic.failed()
    print(f"\n{len(traffic.results)} requests, {len(failed)} failed (the allowed outage of d0 in step 1)")
    assert not mixed, f"requests crossed the two files: {mixed[:3]}"
    assert not [r for r in failed if r[0] > switched], "nothing fails once the new pair serves"
    assert len(set(hashes(cl).values())) == 1


def mixed_lines(h: ClusterHarness) -> list[str]:
    """The decoder's (n4's) log lines for a request prefilled by an engine with the other KV connector."""
    return [line for f in (h.home / "n4" / "logs").rglob("*") if f.is_file()
            for line in f.read_text(errors="replace").splitlines() if "KV connector mismatch" in line]  # fmt: skip

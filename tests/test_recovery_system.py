"""Issue 19 item 1 through the real agent: the fake `npu-smi` (tests/fixtures/ascend, the real tool's formats) in
place of the driver's, a vLLM stand-in as the node's NPU user. One rung of a chip reset that works (an Alarm: stop,
no process on a chip, `npu-smi set -t reset` answered, settle, verify health and HBM, start), then the same chip
bad again with its one reset of the hour spent: the node is isolated (status, event, `dsv4_node_isolated` 1, vLLM
held) until `nodeagentctl uncordon`. The rules' every branch is tests/test_recovery_layer.py, without processes;
the proxy dropping an isolated node's groups too."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ascend_fake import FAKE_BIN, FakeAscend
from cluster_harness import STANDIN_MODEL
from conftest import BIN, LocalAgent, free_port, wait_for

pytestmark = pytest.mark.system


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[LocalAgent, FakeAscend]]:
    fake = FakeAscend(tmp_path / "ascend", "doc-healthy-a2")
    home = tmp_path / "home"
    config = {
        "node": {"name": "a2", "npus": 8,
                 "npu_health": {"npu_smi": str(FAKE_BIN / "npu-smi"), "hccn_tool": str(FAKE_BIN / "hccn_tool"),
                                "period_s": 0.5}},
        "agent": {"state_dir": str(home / "state"), "log_dir": str(home / "logs"), "systemd_scopes": "never",
                  "preflight": "warn",  # a dev box has no CANN: its FAILs must not hold the stack here
                  "api": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(home / "token")}},
        "recovery": {"resets_per_chip_per_hour": 1, "pause_after_reset_s": 0, "settle_s": 20},
        "components": {"vllm": {"kind": "vllm", "command": "vllm-standin", "model": STANDIN_MODEL,
                                "served_model_name": "dsv4", "port": free_port(), "tensor_parallel_size": 1,
                                "ld_preload": [], "env": {"VLLM_STANDIN_STARTUP_DELAY_S": "0.2"},
                                "probes": {"startup": {"period_s": 0.3}}}},
    }  # fmt: skip
    home.mkdir()
    path = tmp_path / "a2.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    agent = LocalAgent(home, path)
    agent.env.update({"ASCEND_FAKE_SCENARIO": str(fake.path), "ASCEND_FAKE_STATE": str(fake.state)})
    try:
        agent.start()
        yield agent, fake
    finally:
        agent.cleanup()


def ctl(agent: LocalAgent, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "nodeagentctl"), "--config", str(agent.config_path), *args], capture_output=True,
                          text=True, timeout=30, env=agent.env)  # fmt: skip


def api_status(agent: LocalAgent) -> dict[str, Any]:
    out = ctl(agent, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def http_get(agent: LocalAgent, path: str) -> str:
    listen = yaml.safe_load(agent.config_path.read_text())["agent"]["api"]["listen"]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{listen}{path}", timeout=10) as response:
        return response.read().decode()  # type: ignore[no-any-return]


def isolated_metric(agent: LocalAgent) -> float:
    text = http_get(agent, "/metrics")
    return float(re.search(r"^dsv4_node_isolated(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def vllm_pid(agent: LocalAgent) -> int | None:
    return agent.children().get("vllm", {}).get("pid")  # type: ignore[no-any-return]


def test_a_chip_reset_that_works_then_isolation_past_the_budget_until_uncordon(
        node: tuple[LocalAgent, FakeAscend]) -> None:  # fmt: skip
    agent, fake = node
    agent.wait_states({"vllm": {"ready"}}, 60)
    first = vllm_pid(agent)

    # one rung that works: an Alarm (RestartNPU) on chips 3 and 6, which the reset clears
    fake.set("doc-alarm-then-reset")
    # the 20 s settle leaves time to see the reset head `nodeagentctl status`
    head = wait_for("the reset in the status's header", lambda: (out := ctl(agent, "status").stdout.splitlines())
                    and out[1].startswith("CHIP RESET IN PROGRESS of npu 3, 6 (step ") and out[1], 60, 0.3)  # fmt: skip
    assert "npu 3 health Alarm" in head, head
    wait_for("the reset done", lambda: (steps := api_status(agent)["recovery"]["steps"]) and steps[-1]["step"] ==
             "start", 60, 0.3)  # fmt: skip
    recovery = api_status(agent)["recovery"]
    assert [s["step"] for s in recovery["steps"]] == ["drain_groups", "stop", "wait_idle", "reset", "reset",
                                                      "settle", "verify", "start"], recovery["steps"]  # fmt: skip
    assert all(s["ok"] for s in recovery["steps"]), recovery["steps"]
    assert (fake.state / "resets").read_text().split() == ["3", "6"], "npu-smi set -t reset -i N -c 0, answered y"
    assert "Reset card successfully" in recovery["steps"][3]["detail"]
    assert recovery["steps"][6]["detail"] == "all chips OK, HBM at baseline"
    wait_for("vllm started again", lambda: vllm_pid(agent) not in (None, first), 30, 0.2)
    agent.wait_states({"vllm": {"ready"}}, 60)
    assert api_status(agent)["isolated"] is None and isolated_metric(agent) == 0
    log = agent.log()
    assert "chip reset done" in log and "node isolated" not in log

    # the same chip bad again within the hour: its one reset is spent → isolated, no second reset
    second = vllm_pid(agent)
    fake.set({"npus": 8, "chips": {"3": {"health": "Alarm", "error_codes": ["80CB8009"]}}})
    wait_for("the node isolated", lambda: api_status(agent)["isolated"], 30, 0.3)
    state = wait_for("vllm stopped and held", lambda: (c := api_status(agent)["components"]["vllm"])["state"] ==
                     "stopped" and c["hold"] and c, 60, 0.3)  # fmt: skip
    status = api_status(agent)
    assert status["isolated"] == ("npu 3 health Alarm (error code 80CB8009) (RestartNPU); 1 resets of npu 3 within "
                                  "1 h did not help"), status["isolated"]
    assert isolated_metric(agent) == 1
    assert not (fake.state / "resets").exists(), "no reset past the budget"
    assert "node isolated" in agent.log()
    assert state["hold"]["kind"] == "isolated" and "nodeagentctl uncordon" in state["hold"]["reason"], state
    assert ctl(agent, "status").stdout.splitlines()[1] == f"ISOLATED: {status['isolated']} — its NPU users stay " \
        "stopped until `nodeagentctl uncordon`"
    assert f"<div>ISOLATED: {status['isolated']} — " in http_get(agent, "/ui"), "the status page's header too"
    wait_for("a post-mortem bundle of each rung (the reset, the isolation)",
             lambda: len(list((agent.state_dir / "postmortem" / "node").glob("*.tar.gz"))) == 2, 20, 0.2)

    # the operator: the chip replaced / healthy again, uncordon → vLLM starts
    fake.set("doc-healthy-a2")
    out = ctl(agent, "uncordon")
    assert out.returncode == 0 and "uncordon: the node is back" in out.stdout, (out.stdout, out.stderr)
    agent.wait_states({"vllm": {"ready"}}, 60)
    assert vllm_pid(agent) not in (None, second)
    assert (fake.state / "resets").exists() is False, "uncordon judges the chips as they are now: no reset"
    assert api_status(agent)["isolated"] is None and isolated_metric(agent) == 0
    assert ctl(agent, "uncordon").returncode != 0, "uncordon of a node that is not isolated is refused"


def npu_series(agent: LocalAgent) -> dict[str, float]:
    """`dsv4_npu_*` samples of the running agent's /metrics, keyed `name{label="v",...}` (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http_get(agent, "/metrics")):
        for s in family.samples:
            if s.name.startswith("dsv4_npu_"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_the_npu_monitor_series_reach_metrics(node: tuple[LocalAgent, FakeAscend]) -> None:
    """The running agent exports its NPU monitor's view (faults, HBM, RoCE links) on /metrics, read at scrape time:
    the collector was written but never attached, so none of these series existed."""
    agent, fake = node
    series = wait_for("the NPU series on /metrics", lambda: (s := npu_series(agent)).get("dsv4_npu_visible") and s,
                      60, 0.3)  # fmt: skip
    assert series["dsv4_npu_checked"] == 1 and series["dsv4_npu_expected"] == 8 and series["dsv4_npu_visible"] == 8
    assert series["dsv4_npu_start_held"] == 0
    assert all(series[f'dsv4_npu_healthy{{chip="0",npu="{n}"}}'] == 1 for n in range(8)), series
    assert series['dsv4_npu_hbm_total_bytes{chip="0",npu="0"}'] > 0
    assert series['dsv4_npu_roce_link_up{npu="5"}'] == 1
    assert not any(key.startswith("dsv4_npu_fault{") for key in series), series
    # the next poll's view, not a copy taken at start: npu 5's RoCE link goes down
    fake.set("doc-link-down")
    wait_for("npu 5's link down on /metrics", lambda: npu_series(agent)['dsv4_npu_roce_link_up{npu="5"}'] == 0, 30, 0.3)

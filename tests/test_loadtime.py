"""What a restart costs: the last loads, and how long a starting component has left (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import free_port

from nodeagent.core.loadtime import LOADS_KEPT, load_status, remember


def test_the_last_loads_are_kept_and_the_median_is_the_estimate() -> None:
    loads: list[float] = []
    for seconds in (1900, 1800, 5400, 1850, 1820, 1790):  # one cold-cache start does not move the estimate
        loads = remember(loads, seconds)
    assert loads == [1800, 5400, 1850, 1820, 1790] and len(loads) == LOADS_KEPT
    done = load_status(loads, None)
    assert done is not None and done["last_s"] == 1790 and done["expected_s"] == 1820
    assert done["note"] == "last load 30 min" and "left_s" not in done


def test_a_starting_component_says_how_long_it_has_left_or_that_it_is_late() -> None:
    loads = [1800.0, 1860.0, 1830.0]
    early = load_status(loads, 600)
    assert early is not None and early["left_s"] == 1230
    assert early["note"] == "loading, about 20 min left (usually 30 min)"
    late = load_status(loads, 2400)
    assert late is not None and late["left_s"] == 0
    assert late["note"] == "loading for 40 min, 10 min longer than usual (30 min)"
    first = load_status([], 42)
    assert first is not None and first["left_s"] is None
    assert first["note"] == "loading for 42 s (first load here: no estimate yet)"
    assert load_status([], None) is None, "never loaded, not loading: nothing to say"


# ---- through a real agent and the vLLM stand-in -------------------------------------------------------------------


async def test_a_real_agent_times_each_vllm_load_shows_the_time_left_and_keeps_the_history(tmp_path: Path) -> None:
    from apihelpers import start_in_process, tiny_config
    from test_metrics import scrape, value
    from test_ui import vllm_standin

    from nodeagent.cli.status import format_status

    data = tiny_config(tmp_path / "home")
    data["components"]["vllm"] = vllm_standin(free_port())
    data["components"]["vllm"]["env"]["VLLM_STANDIN_STARTUP_DELAY_S"] = "2"
    data["node"]["npus"] = 0
    stack = await start_in_process(tmp_path / "home", data)
    try:
        vllm = stack.agent.supervisor.components["vllm"]
        await stack.wait("vllm up", lambda: vllm.up.is_set(), 60)
        first = vllm.loads[-1]
        assert first >= 2.0, vllm.loads
        status, _ = await stack.post("/components/vllm/restart", {"drain": False})
        assert status == 202
        await stack.wait("vllm loading again", lambda: vllm.state == "starting" and vllm.record is not None, 30)
        _, data_now = await stack.get("/status")
        load = data_now["components"]["vllm"]["load"]
        assert load["loading_s"] >= 0 and load["expected_s"] == first, load
        assert load["note"].startswith(("loading, about", "loading for")), load
        assert load["note"] in format_status(data_now), "the table's NOTE says it"
        await stack.wait("vllm up again", lambda: vllm.up.is_set() and len(vllm.loads) == 2, 60)
        text = await scrape(stack)
        assert value(text, "dsv4_agent_vllm_load_seconds_count", component="vllm") == 2.0
        assert value(text, "dsv4_agent_vllm_load_seconds_sum", component="vllm") >= 4.0
        assert value(text, "dsv4_agent_vllm_load_seconds_count", component="a") is None, "vLLM only"
        loads = list(vllm.loads)
        stack.agent.supervisor.flush_state()
    finally:
        await stack.close()
    # the next agent (an upgrade, a reboot) knows what the last loads took
    again = await start_in_process(tmp_path / "home", data)
    try:
        vllm = again.agent.supervisor.components["vllm"]
        await again.wait("vllm up", lambda: vllm.up.is_set(), 60)
        assert vllm.loads[: len(loads)] == loads and len(vllm.loads) == 3, vllm.loads
    finally:
        await again.close()


def test_the_others_see_a_short_line_in_the_member_key_and_the_cluster_table() -> None:
    from nodeagent.cli.remote import _components
    from nodeagent.cluster.member_record import member_record
    from nodeagent.config.model import RestartSpec
    from nodeagent.seam.stackport import ComponentView, MemberReport, NodeView

    def view(name: str, state: str, load: dict[str, Any] | None) -> ComponentView:
        load = load or {}
        return ComponentView(name=name, kind="vllm", state=state, running=True, up=False, ready=False,
                             desired="running", deps=(), deps_up=True, restart=RestartSpec(), pid=7,
                             last_load_s=load.get("last_s"), loading=load.get("loading_s") is not None,
                             load_left_s=load.get("left_s"))  # fmt: skip

    views = {"vllm": view("vllm", "starting", load_status([1800.0], 600)),
             "vllm-dp1": view("vllm-dp1", "ready", load_status([1800.0, 1900.0], None)),
             "etcd": view("etcd", "running", None)}  # fmt: skip
    node = NodeView(node="n0", paused=False, pause=None, redeploying=False, components=views)
    record = member_record({}, node, MemberReport(), {}, 0.0).to_wire()
    comps = record["components"]
    assert comps["vllm"]["load"] == "~20 min left" and comps["vllm"]["last_load_s"] == 1800.0
    assert "load" not in comps["vllm-dp1"] and comps["vllm-dp1"]["last_load_s"] == 1900.0
    assert "last_load_s" not in comps["etcd"]
    assert _components(comps) == "vllm:starting(~20 min left) vllm-dp1:ready(load 32m) etcd:running"

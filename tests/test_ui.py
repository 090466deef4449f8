"""The status page (GET /ui) in Debian's headless Chromium over the DevTools protocol (tests/cdp.py): a real
in-process agent with tiny `kind: process` components and the vLLM stand-in serving real prefix-cache counters;
a real cluster (agents as processes on the session's etcd); the hit-rate history behind the plot.

Chromium: `apt-get install chromium` (scripts/test.sh does); without it the browser tests fail, saying so.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import statistics
import time
from collections.abc import AsyncIterator
from html import escape
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from apihelpers import InProcess, start_in_process, tiny_config
from cdp import Chromium, Page, chromium_binary
from cluster_harness import ClusterHarness
from conftest import ROOT, free_port
from mqtthelpers import Mosquitto, mqtt_config

from nodeagent.api.server import ApiServer
from nodeagent.api.ui.history import CacheHistory
from nodeagent.api.ui.routes import static_files
from nodeagent.vllm.cachehit import CacheCounters, compute_table, parse_cache_counters

PERIOD_S = 0.5
SHORT = " ".join(f"short{i}" for i in range(60))
LONG = " ".join(f"long{i}" for i in range(700))
"""The stand-in's local cache holds 32 blocks of 16 tokens: repeats of SHORT hit it, LONG evicts its own head
there, so its repeats hit the external store."""


# ---- the history, pure -----------------------------------------------------------------------------------------
def table(queries: int, hits: int, ext_q: int, ext_h: int, prev: dict[str, CacheCounters] | None = None) -> Any:
    cur = {"0": CacheCounters("0", queries, hits, ext_q, ext_h)}
    return compute_table(prev, cur), cur


def test_history_keeps_one_sample_per_scrape_for_the_window_only() -> None:
    history = CacheHistory(history_s=10, period_s=1)
    rows, prev = table(100, 40, 60, 30)
    first = history.add(1000.0, {"vllm": rows})
    assert first.components["vllm"] == pytest.approx({
        "local_total": 0.4, "local_win": 0.4, "ext_total": 0.5, "ext_win": 0.5, "eff_total": 0.7, "queries": 100,
        "reset": False})  # fmt: skip
    rows, _ = table(200, 140, 100, 30, prev)
    history.add(1001.0, {"vllm": rows, "down": []})  # a component without rows is a gap, not zeros
    second = history.samples[-1].components
    assert set(second) == {"vllm"} and second["vllm"]["local_win"] == pytest.approx(1.0)
    assert second["vllm"]["ext_win"] == pytest.approx(0.0)
    for t in range(1002, 1030):
        history.add(float(t), {})
    assert history.samples[0].ts == 1019.0 and len(history.samples) == 11
    assert [s["ts"] for s in history.since(1027.0)] == [1028.0, 1029.0]
    history.add(1029.0004, {})  # served rounded to the ms: asking after what was served never repeats it
    assert [s["ts"] for s in history.since(1029.0)] == [] and history.since(1028.9995)[-1]["ts"] == 1029.0
    history.prune(1100.0)
    assert not history.samples


def test_ui_config_is_checked(tmp_path: Path) -> None:
    from nodeagent.config.load import load_config
    from nodeagent.core.errors import ConfigError

    data = tiny_config(tmp_path)
    data["agent"]["ui"] = {"cache_period_s": 0.1, "cache_history_s": 86400}
    path = tmp_path / "c.yaml"
    path.write_text(__import__("yaml").safe_dump(data))
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: agent\.ui: .*more than 6000 samples"):
        load_config(path)


# ---- the routes, over HTTP -------------------------------------------------------------------------------------
async def test_page_files_are_served_from_the_package_with_a_strict_policy(stack: InProcess) -> None:
    async with stack.session.get(stack.url + "/ui") as r:
        assert r.status == 200 and r.content_type == "text/html"
        html = await r.text()
        policy = r.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
    referenced = set(re.findall(r'(?:src|href)="/ui/([^"]+)"', html))
    assert referenced == set(static_files()) - {"index.html"} == {"plot.js", "ui.js", "ui.css"}
    assert not re.search(r'(?:src|href)="(?:https?:)?//', html), "nothing from elsewhere"
    for name, media in (("ui.js", "text/javascript"), ("plot.js", "text/javascript"), ("ui.css", "text/css")):
        async with stack.session.get(f"{stack.url}/ui/{name}") as r:
            assert (r.status, r.content_type) == (200, media)
            urls = set(re.findall(r"https?://[^\"'\s)]+", await r.text()))
            assert urls <= {"http://www.w3.org/2000/svg"}, f"{name} names another server: {urls}"  # a namespace
    for bad in ("index.html", "nope.js", "..%2Fapi.py", "%2E%2E"):
        status, body = await stack.get(f"/ui/{bad}")
        assert status == 404 and body["status"] == 404, bad
    status, body = await stack.get("/cache")
    assert status == 200 and body["components"] == [] and body["samples"] == [], "no vLLM, no samples"
    for bad in ("soon", "nan", "inf"):
        status, body = await stack.get(f"/cache?since={bad}")
        assert status == 400 and "since" in body["error"], bad


async def test_the_first_paint_is_rendered_on_the_server(stack: InProcess) -> None:
    """issue 17: `curl /ui` showed an empty skeleton; the state is in the HTML without running any script."""
    async with stack.session.get(stack.url + "/ui") as r:
        html = await r.text()
    status = (await stack.get("/status"))[1]
    rows = re.findall(r'<tr data-component="([^"]+)">(.*?)</tr>', html)
    assert [name for name, _ in rows] == list(status["components"]), "every component, in order"
    for name, row in rows:
        state = status["components"][name]["state"]
        assert f'<td data-field="state">{state}' in row, (name, row)
        assert f'<td data-field="pid">{status["components"][name]["pid"]}</td>' in row
    assert f'<span id="node">{status["node"]["name"]}</span>' in html
    assert "server render" in html and "connecting…" not in html


def test_a_rollout_is_under_way_by_one_definition() -> None:
    """The floor and the time left are shown while the rollout is under way (not final): the server's first paint
    and `nodeagentctl cluster` read `rollout_states.UNDER_WAY`; ui.js keeps a copy, compared here."""
    from nodeagent.api.ui.firstpaint import rollout_texts
    from nodeagent.api.ui.routes import read_static
    from nodeagent.cli.remote import rollout_lines
    from nodeagent.cluster.rollout.states import FINAL, UNDER_WAY, Status

    assert set(UNDER_WAY) == set(Status) - set(FINAL) == {"running", "paused", "rolling_back", "aborting"}
    js = re.search(r"const moving = (\[.*?\])\.includes", read_static("ui.js").decode())
    assert js is not None and set(json.loads(js.group(1))) == set(UNDER_WAY)
    for status in Status:
        r = {"id": "r1", "status": str(status), "steps": [], "floor": "x", "time_left_s": 60}
        assert bool(rollout_texts(r)["floor"]) == (status in UNDER_WAY), status
        assert any("floor:" in line for line in rollout_lines(r, now=0)) == (status in UNDER_WAY), status


def test_the_first_paint_escapes_every_value() -> None:
    """Member records come from other nodes through etcd: nothing in them becomes markup."""
    from nodeagent.api.ui.firstpaint import first_paint
    from nodeagent.api.ui.routes import read_static

    hostile = "<img src=x onerror=alert(1)>"
    status = {"node": {"name": hostile, "role": "master"}, "paused": True, "pause": {"by": hostile},
              "components": {hostile: {"kind": "vllm", "state": "failed", "held": hostile, "pid": None,
                                       "last_exit": {"reason": hostile}}}}  # fmt: skip
    html = first_paint(read_static("index.html").decode(), status, now=0)
    assert hostile not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "PAUSED by &lt;img" in html and "held: &lt;img" in html


def test_the_first_paint_heads_with_an_isolation_or_a_chip_reset() -> None:
    """The ladder's node-wide states in the page's header, on the server's paint already (and escaped)."""
    from nodeagent.api.ui.firstpaint import first_paint
    from nodeagent.api.ui.routes import read_static

    page = read_static("index.html").decode()
    quiet = first_paint(page, {"node": {"name": "a2"}}, now=0)
    assert '<div id="node-alerts" class="alerts" hidden></div>' in quiet, "nothing to say: hidden"
    html = first_paint(page, {"node": {"name": "a2"}, "isolated": "npu 5 health Critical <SeparateNPU>",
                              "recovery": {"rung": None}}, now=0)  # fmt: skip
    alerts = re.search(r'<div id="node-alerts" class="alerts">(.*?)</div>\n', html, re.S)
    assert alerts, html[:2000]
    assert alerts[1] == ("<div>ISOLATED: npu 5 health Critical &lt;SeparateNPU&gt; — its NPU users stay stopped "
                         "until `nodeagentctl uncordon`</div>")
    assert html.index("node-alerts") < html.index('id="components"'), "above the components"
    rung = {"step": "wait_idle", "why": "npu 3 health Alarm (RestartNPU)", "chips": [3], "at": 1.0}
    html = first_paint(page, {"node": {"name": "a2"}, "recovery": {"rung": rung}}, now=0)
    assert "<div>CHIP RESET IN PROGRESS of npu 3 (step wait_idle): npu 3 health Alarm (RestartNPU)" in html


def rollout_view(hostile: str = "") -> dict[str, Any]:
    """A rollout as `GET /cluster` gives it (`RolloutExecutor.view`), in its first step."""
    steps = [{"groups": ["p0", "d0"], "phase": "rejoining", "since": 0, "failed": "", "rollback": False,
              "note": f"first pair{hostile}"},
             {"groups": ["p1", "d1"], "phase": "pending", "since": 0, "failed": "", "rollback": False, "note": ""},
             # a step done: what it measured out of the proxy beside what the plan expected (issue 31)
             {"groups": ["p2"], "phase": "done", "since": 0, "failed": "", "rollback": False, "outage": ["prefill"],
              "note": "prefill outage expected ~3 s (its last load)", "expected_outage_s": 3.0,
              "out_of_proxy_s": 7.5}]
    return {"id": "ab12cd34", "status": "running", "message": f"step 1 (p0, d0): gate passed{hostile}",
            "steps": steps, "current": 0, "time_left_s": 1925.0,
            "floor": f"serving: prefill p1 (until the switch); decode d1 (until the switch){hostile}",
            "held_out": {"p1": "kept apart", "d1": "kept apart"}}  # fmt: skip


def rollout_box_texts(html: str) -> dict[str, Any]:
    import html as markup

    def one(pattern: str) -> str:
        found = re.search(pattern, html, re.S)
        assert found, pattern
        return markup.unescape(re.sub(r"<[^>]+>", "", found.group(1))).strip()

    rows = re.findall(r'<tr data-step="(\d+)">(.*?)</tr>', html, re.S)
    return {"meta": one(r'id="rollout-meta">(.*?)</span>'), "message": one(r'id="rollout-message">(.*?)</div>'),
            "floor": one(r'id="rollout-floor" class="muted">(.*?)</div>'),
            "rows": {n: dict(re.findall(r'data-field="(\w+)"[^>]*>(.*?)</td>', row)) for n, row in rows}}  # fmt: skip


def test_the_first_paint_shows_the_rollout_box() -> None:
    """The plan's steps, the step, the floor (what serves per kind) and the time left, escaped like the rest."""
    from nodeagent.api.ui.firstpaint import first_paint
    from nodeagent.api.ui.routes import read_static

    page = read_static("index.html").decode()
    assert '<div id="rollout" hidden>' in first_paint(page, {"node": {"name": "n0"}}, now=0), "no rollout: hidden"
    hostile = "<img src=x onerror=alert(1)>"
    view = rollout_view(hostile)
    view["steps"][0]["since"] = 1000.0
    html = first_paint(page, {"node": {"name": "n0"}}, now=1125.0, rollout=view)
    assert '<div id="rollout">' in html and hostile not in html
    box = rollout_box_texts(html)
    assert box["meta"] == "ab12cd34 · running · step 1/3 p0, d0 rejoining"
    assert box["floor"] == (f"floor: serving: prefill p1 (until the switch); decode d1 (until the switch){hostile} "
                            "· time left 32m 5s · out of the proxy: p1, d1")  # fmt: skip
    assert box["message"] == f"step 1 (p0, d0): gate passed{hostile}"
    assert box["rows"]["1"] == {"groups": "p0, d0", "phase": '<span class="badge s-starting">rejoining</span>',
                                "since": "2m 5s ago", "note": f"first pair{escape(hostile)}"}  # fmt: skip
    assert box["rows"]["2"]["since"] == "—"
    assert box["rows"]["3"]["note"] == ("prefill outage expected ~3 s (its last load) · out of the proxy 7.5 s "
                                        "(expected ~3.0 s)")  # fmt: skip
    done = first_paint(page, {}, now=0, rollout={**view, "status": "done", "current": None})
    assert rollout_box_texts(done)["floor"] == "" and rollout_box_texts(done)["meta"] == "ab12cd34 · done"


CONTAINER_UP = {"engine": "podman", "name": "ds_v4_flash_yr", "image": "quay.io/ascend/vllm-ascend:v0.20.2rc1",
                "id": "4a496e83c8a2", "up": True, "up_since": "2026-12-05T08:00:00Z", "held": None,
                "deaths": 1, "last_death": {"detail": "exited with code 137 <killed>"}}  # fmt: skip


def test_the_first_paint_shows_the_container() -> None:
    """issue 18 item 5: the page, as `nodeagentctl status`, names the node's container (hidden without one)."""
    from nodeagent.api.ui.firstpaint import first_paint
    from nodeagent.api.ui.routes import read_static

    page = read_static("index.html").decode()
    assert '<div id="container-line" class="muted" hidden></div>' in first_paint(page, {"node": {"name": "a2"}}, now=0)
    html = first_paint(page, {"node": {"name": "a2"}, "container": CONTAINER_UP}, now=0)
    line = re.search(r'<div id="container-line" class="muted">(.*?)</div>', html)
    assert line, html[:1500]
    assert line[1] == ("container ds_v4_flash_yr (podman, quay.io/ascend/vllm-ascend:v0.20.2rc1) 4a496e83c8a2 up "
                       "since 2026-12-05T08:00:00Z · died 1x, last: exited with code 137 &lt;killed&gt;")  # fmt: skip
    down = first_paint(page, {"container": {**CONTAINER_UP, "up": False, "held": "setup step 2 failed"}}, now=0)
    assert "NOT UP: setup step 2 failed" in down


async def test_the_container_line_reads_the_same_from_the_server_and_the_script(stack: InProcess,
                                                                                browser: Chromium) -> None:  # fmt: skip
    """ui.js's containerLine writes what node_alerts.container_line (the CLI's and the first paint's) writes."""
    from nodeagent.api.node_alerts import container_line

    page = await browser.new_page()
    await page.goto(stack.url + "/ui")
    for box in (CONTAINER_UP, {**CONTAINER_UP, "up": False, "held": "engine unresponsive", "deaths": 0}):
        assert await page.js(f"containerLine({json.dumps(box)})") == container_line(box)
    assert await page.js("document.getElementById('container-line').hidden") is True, "no container here"
    assert_only_the_agent(page, stack.url)


async def test_the_rollout_box_reads_the_same_from_the_server_and_the_script(stack: InProcess,
                                                                             browser: Chromium) -> None:  # fmt: skip
    """ui.js's renderRollout and the server's first paint write the same lines for the same view."""
    view = rollout_view()
    stack.agent.rollout = SimpleNamespace(view=lambda: {"rollout": view})  # type: ignore[assignment]
    async with stack.session.get(stack.url + "/ui") as r:
        server = rollout_box_texts(await r.text())
    page = await browser.new_page()
    await page.goto(stack.url + "/ui")
    drawn = await page.js(f"""(() => {{
        renderRollout({json.dumps(view)});
        const rows = {rows_js('rollout-steps', 'step')};
        return {{meta: $('rollout-meta').textContent, floor: $('rollout-floor').textContent,
                 message: $('rollout-message').textContent, hidden: $('rollout').hidden, rows}};
    }})()""")
    assert not drawn.pop("hidden")
    rows = drawn.pop("rows")
    assert drawn == {k: server[k] for k in ("meta", "floor", "message")}, (drawn, server)
    assert {n: {k: v for k, v in r.items()} for n, r in rows.items()} == {
        n: {k: re.sub(r"<[^>]+>", "", v) for k, v in r.items()} for n, r in server["rows"].items()}
    assert drawn["floor"].endswith("· time left 32m 5s · out of the proxy: p1, d1")
    assert_only_the_agent(page, stack.url)


def cluster_view() -> dict[str, Any]:
    """A /cluster view as membership, coordinator and rollout write it: three members, one missing, one hostile."""
    return {
        "cluster": "c1", "self": "n0", "view_complete": True,
        "etcd": {"state": "reachable", "endpoint": "http://10.0.0.1:2379"},
        "warnings": [{"code": "pythonhashseed", "node": "n1", "message": "differs <b>"}],
        "members": [
            {"name": "n0", "role": "master", "ip": "10.0.0.1", "group": "p0", "ranks": {"start": 0, "count": 2},
             "present": True, "age_s": 3.2, "clock_offset_s": 0.0, "api_url": "http://10.0.0.1:18700",
             "components": {"vllm-dp0": {"state": "running", "ready": True, "last_load_s": 75}}},
            {"name": "n1<script>", "role": "worker", "ip": "10.0.0.2", "group": "d0", "ranks": {"start": 2, "count": 1},
             "present": True, "age_s": 61, "clock_offset_s": -0.0125, "api_url": "http://10.0.0.2:18700",
             "components": {"vllm-dp2": {"state": "starting", "ready": False, "load": "loading 2m"}}},
            {"name": "n2", "role": "worker", "ip": "10.0.0.3", "present": False, "listed": False},
        ],
        "coordination": {"etcd": "reachable", "gangs": {"d0": {
            "kind": "decode", "nodes": ["n1", "n2"], "generation": 3, "reason": "operator restart", "by": "n0",
            "barrier": {"arrived": ["n1"]}, "pending": True}}, "pause": {"by": "ops", "reason": "maint"}},
    }  # fmt: skip


def test_the_first_paint_has_the_cluster_table() -> None:
    """issue 31: a screenshot at load showed no member table (it came with the first poll)."""
    from nodeagent.api.ui.firstpaint_cluster import SINGLE_NODE, cluster_section
    from nodeagent.api.ui.routes import read_static

    page = read_static("index.html").decode()
    html = cluster_section(page, {"cluster": {"etcd": "reachable"}}, cluster_view())
    rows = dict(re.findall(r'<tr[^>]* data-member="([^"]+)">(.*?)</tr>', html))
    assert list(rows) == ["n0", "n1&lt;script&gt;", "n2"] and "<script>" not in html.split("<body")[1].split(
        '<script src="')[0], "every value escaped"
    assert '<table id="members">' in html and '<table id="gangs">' in html, "shown, not hidden until the poll"
    assert '<td data-field="ranks">0–1</td>' in rows["n0"] and "vllm-dp0 running ✓ (load 1m 15s)" in rows["n0"]
    assert '<span class="badge s-missing">missing</span>' in rows["n2"] and "(not in the cluster file)" in rows["n2"]
    assert 'id="cluster-meta">c1 · seen from n0 · etcd reachable (http://10.0.0.1:2379)</span>' in html
    assert "waiting for n2 · arrived: n1" in html and "cluster paused by ops: maint" in html
    single = cluster_section(page, {}, None)
    assert f'<div id="cluster-note" class="note plain">{SINGLE_NODE}</div>' in single
    assert cluster_section(page, {"cluster": {}}, None) == page, "no view: the first poll fills it"


async def test_the_cluster_table_reads_the_same_from_the_server_and_the_script(stack: InProcess,
                                                                               browser: Chromium) -> None:  # fmt: skip
    """ui.js's renderCluster and the server's first paint write the same rows for the same view."""
    import html as markup

    from nodeagent.api.ui.firstpaint_cluster import SINGLE_NODE, cluster_section
    from nodeagent.api.ui.routes import read_static

    async with stack.session.get(stack.url + "/ui") as r:  # the route writes it in: here a single node's note
        assert f'<div id="cluster-note" class="note plain">{SINGLE_NODE}</div>' in await r.text()
    assert (await stack.get("/cluster"))[0] == 404, "a single node has no /cluster"
    view = cluster_view()
    server = cluster_section(read_static("index.html").decode(), {"cluster": {}}, view)

    def texts(table: str, key: str) -> dict[str, dict[str, str]]:
        body = server.split(f'<table id="{table}">')[1].split("</table>")[0]
        rows = re.findall(rf'<tr[^>]* data-{key}="([^"]+)">(.*?)</tr>', body, re.S)
        return {markup.unescape(n): {f: markup.unescape(re.sub(r"<[^>]+>", "", v)).strip()
                                     for f, v in re.findall(r'data-field="(\w+)"[^>]*>(.*?)</td>', row)}
                for n, row in rows}  # fmt: skip

    page = await browser.new_page()
    await page.goto(stack.url + "/ui")
    drawn = await page.js(f"""(() => {{
        ui.status = {{...(ui.status || {{}}), cluster: {{}}}}; ui.cluster = {json.dumps(view)}; renderCluster();
        return {{members: {rows_js('members', 'member')}, gangs: {rows_js('gangs', 'gang')},
                 meta: $('cluster-meta').textContent, extra: $('coordination-extra').textContent}};
    }})()""")
    assert drawn["members"] == texts("members", "member")
    assert drawn["gangs"] == texts("gangs", "gang")
    assert drawn["meta"] == markup.unescape(re.search(r'id="cluster-meta">(.*?)</span>', server).group(1))
    assert drawn["extra"] == markup.unescape(re.search(r'id="coordination-extra" class="muted">(.*?)</div>',
                                                       server).group(1))  # fmt: skip
    assert_only_the_agent(page, stack.url)


async def test_the_page_can_be_switched_off(tmp_path: Path) -> None:
    data = tiny_config(tmp_path / "home")
    data["agent"]["ui"] = {"enabled": False}
    s = await start_in_process(tmp_path / "home", data)
    try:
        for path in ("/ui", "/ui/ui.js", "/cache"):
            status, body = await s.get(path)
            assert status == 404 and "agent.ui.enabled: false" in body["error"], path
    finally:
        await s.close()


# ---- in the browser --------------------------------------------------------------------------------------------
@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[Chromium]:
    if chromium_binary() is None:
        pytest.fail("chromium is not installed: scripts/test.sh installs it (apt-get install chromium)")
    chromium = await Chromium.start(tmp_path / "chromium-profile")
    try:
        yield chromium
    finally:
        await chromium.close()


async def test_an_isolated_node_says_so_in_the_header_live(stack: InProcess, browser: Chromium) -> None:
    """ui.js draws the same header lines from /status as the server's paint: the node isolated by the ladder
    (the real executor's `isolate`), gone again once the operator uncordons."""
    recovery = stack.agent.guards.recovery
    page = await browser.new_page()
    await page.goto(stack.url + "/ui")
    await page.wait_js("the live paint", "document.getElementById('conn').textContent.startsWith('live')")
    assert await page.js("document.getElementById('node-alerts').hidden") is True
    await recovery.isolate("npu 5 health Critical (error code 80E01801) (SeparateNPU: never reset)")
    text = await page.wait_js("the isolation in the header", """(() => {
        const box = document.getElementById('node-alerts');
        return !box.hidden && box.textContent; })()""")
    assert text == ("ISOLATED: npu 5 health Critical (error code 80E01801) (SeparateNPU: never reset) — its NPU "
                    "users stay stopped until `nodeagentctl uncordon`")
    status, _ = await stack.post("/uncordon")
    assert status == 200
    await page.wait_js("the header clear again", "document.getElementById('node-alerts').hidden")
    assert_only_the_agent(page, stack.url)


def rows_js(table_id: str, key: str) -> str:
    """{row key: {field: text}} of one of the page's tables."""
    return (f"Object.fromEntries([...document.querySelectorAll('#{table_id} tbody tr')].map(tr => "
            f"[tr.dataset.{key}, Object.fromEntries([...tr.querySelectorAll('td[data-field]')].map(td => "
            "[td.dataset.field, td.textContent.trim()]))]))")  # fmt: skip


def vllm_standin(port: int) -> dict[str, Any]:
    return {"kind": "vllm", "command": "vllm-standin", "model": str(ROOT / "config" / "standin-model"), "port": port,
            "served_model_name": "dsv4", "tensor_parallel_size": 1, "ld_preload": [], "stop_grace_s": 5,
            "env": {"VLLM_STANDIN_STARTUP_DELAY_S": "0.2", "VLLM_STANDIN_LOCAL_BLOCKS": "32",
                    "VLLM_STANDIN_ORPHAN_EXIT_S": "60"},
            # no canary or readiness chats: only the test's requests move the cache counters
            "probes": {"startup": {"period_s": 0.2, "failure_threshold": 150},
                       "liveness": None, "readiness": None}}  # fmt: skip


async def chat(session: aiohttp.ClientSession, port: int, text: str) -> None:
    body = {"model": "dsv4", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()


def assert_only_the_agent(page: Page, origin: str) -> None:
    elsewhere = [u for u in page.requests if not u.startswith(origin + "/") and not u.startswith(("data:", "about:"))]
    assert not elsewhere, f"the page fetched from elsewhere: {elsewhere}"
    assert not page.errors, f"the page's script failed: {page.errors}"


async def test_a_node_live_restarts_cache_rates_and_the_agent_going_away(tmp_path: Path, browser: Chromium) -> None:
    vllm_port = free_port()
    data = tiny_config(tmp_path / "home")
    data["components"]["vllm"] = vllm_standin(vllm_port)
    data["node"]["npus"] = 0
    data["components"]["a"]["probes"] = {"liveness": {"kind": "exec", "command": ["true"], "period_s": 0.5}}
    data["agent"]["ui"] = {"cache_period_s": PERIOD_S, "cache_history_s": 120}
    broker = Mosquitto(tmp_path / "mqtt").start()
    data["agent"]["mqtt"] = mqtt_config(broker.port)
    stack = await start_in_process(tmp_path / "home", data)
    try:
        sup = stack.agent.supervisor
        for prefix in (SHORT, SHORT, LONG, LONG):  # counters with both local and external hits
            await chat(stack.session, vllm_port, f"{prefix} question")
        page = await browser.new_page()
        await page.goto(stack.url + "/ui")

        # The components as /status has them, the probes' last results, the single-node note.
        comps = await page.wait_js("three component rows with pids, drawn live", f"""(() => {{
            const rows = {rows_js('components', 'component')};
            const live = document.getElementById("conn").textContent.startsWith("live");  // not the server's paint
            return live && Object.keys(rows).length === 3 && Object.values(rows).every(r => /^\\d+$/.test(r.pid))
                && rows;
        }})()""")
        for name, comp in sup.components.items():
            assert comps[name]["pid"] == str(comp.record.pid) and comps[name]["restarts"] == "0"
            assert comps[name]["state"].startswith(str(comp.state)) and comps[name]["desired"] == "running"
        assert re.fullmatch(r"liveness success ✓ exec: .+ \(\d+ ms, \d+s ago\)", (await page.wait_js(
            "a's liveness result", "document.querySelector('[data-component=a] [data-role=liveness]')?.textContent"
        )).replace("\xa0", " ")), "role, status, mark, kind, detail, latency, age"
        assert "startup success ✓ http_get: HTTP 200 from" in comps["vllm"]["probes"].replace("\xa0", " ")
        note = await page.wait_js("the single-node note", "document.getElementById('cluster-note').textContent")
        assert note.startswith("Single-node config: this config lists no cluster.nodes")
        npu = await page.js("document.querySelector('[data-section=npu]').textContent")
        assert "not checked: npu-smi not found" in npu
        assert await page.js("document.getElementById('node').textContent") == "tiny"
        mqtt = await page.wait_js("the MQTT link", """document.querySelector('[data-section=mqtt]')?.textContent
            .includes('connected to') && document.querySelector('[data-section=mqtt]').textContent""")
        assert re.fullmatch(rf"MQTTconnected to mqtt://127\.0\.0\.1:{broker.port} since \d\d:\d\d:\d\d · queued \d+, "
                            r"dropped 0, published \d+", mqtt), mqtt

        # A restart: new pid, restart count, its events.
        old_pid = sup.components["b"].record.pid
        status, _ = await stack.post("/components/b/restart")
        assert status == 202
        await stack.wait("b restarted", lambda: sup.components["b"].restarts == 1 and sup.components["b"].up.is_set())
        new_pid = sup.components["b"].record.pid
        assert new_pid != old_pid
        row = await page.wait_js("b's new pid and restart count", f"""(() => {{
            const b = {rows_js('components', 'component')}.b;
            return b.pid === '{new_pid}' && b.restarts === '1' && b;
        }})()""")
        assert row["uptime"].endswith("s")
        started = await page.wait_js("the event of b's new start", f"""[...document.querySelectorAll(
            '#events tbody tr[data-component=b][data-event=started]')].map(tr => tr.textContent)
            .find(t => t.includes('started pid {new_pid}'))""")
        assert re.match(r"\d\d:\d\d:\d\d\d+info", started)
        seqs = await page.js("[...document.querySelectorAll('#events tbody tr')].map(tr => +tr.dataset.seq)")
        assert seqs == sorted(seqs, reverse=True) and len(seqs) == len(set(seqs)) >= 10, "newest first, once each"
        assert seqs[0] >= sup.events.recent[-1].seq - 1

        # A crash: the agent restarts it at once; the page shows how it ended.
        os.kill(new_pid, signal.SIGKILL)
        await stack.wait("b back", lambda: sup.components["b"].restarts == 2 and sup.components["b"].up.is_set())
        row = await page.wait_js("b's crash and restart", f"""(() => {{
            const b = {rows_js('components', 'component')}.b;
            return b.restarts === '2' && b.pid === '{sup.components["b"].record.pid}' && b;
        }})()""")
        assert re.fullmatch(r"killed by SIGKILL · \d+s ago", row["last_exit"]), row
        await page.wait_js("the crash's event", """[...document.querySelectorAll('#events tbody tr[data-component=b]')]
            .some(tr => tr.className.match(/ev-(warning|error)/) && tr.textContent.includes('killed by SIGKILL'))""")

        # The plot: samples every PERIOD_S, a line per ratio, the legend's totals exactly vLLM's counters' ratios.
        for prefix in (SHORT, LONG):
            await chat(stack.session, vllm_port, f"{prefix} more")
        async with stack.session.get(f"http://127.0.0.1:{vllm_port}/metrics") as r:
            total = compute_table(None, parse_cache_counters(await r.text()))[-1]  # the `all` row
        assert 0 < total.local_total < total.eff_total <= 1 and total.ext_total > 0
        want = {kind: f"{getattr(total, kind) * 100:.1f}%" for kind in ("local_total", "ext_total", "eff_total")}
        legend = await page.wait_js("the legend at vLLM's totals", f"""(() => {{
            const legend = Object.fromEntries([...document.querySelectorAll(
                '[data-component=vllm] .legend [data-kind]')].map(s => [s.dataset.kind, s.lastChild.textContent]));
            const want = {json.dumps(want)};
            return Object.entries(want).every(([k, v]) => legend[k] === v) && legend;
        }})()""", timeout=20)
        assert re.fullmatch(r"\d+\.\d%|n/a", legend["local_win"])
        points = await page.js("""Object.fromEntries([...document.querySelectorAll('[data-plot=vllm] path[data-kind]')]
            .map(p => [p.dataset.kind, +p.dataset.points]))""")
        _, history = await stack.get("/cache")
        with_rates = [s for s in history["samples"] if "vllm" in s["components"]]
        assert points["eff_total"] >= 4 and abs(points["eff_total"] - len(with_rates)) <= 4, (points, len(with_rates))
        assert points["local_win"] >= 1, "the requests' windows"
        asks = [u.split("/cache", 1)[1] for u in page.requests if "/cache" in u]
        assert asks[0] == "" and len(asks) >= 3 and all(a.startswith("?since=") for a in asks[1:]), asks
        stamps = [s["ts"] for s in history["samples"]]
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        # On the sampler's grid: never more samples than periods. A sample's time is taken after its scrape, so
        # one gap may be short when the scrape before it was slow (a loaded machine), never two in one period.
        assert min(gaps) > 0 and len(gaps) <= (stamps[-1] - stamps[0]) / PERIOD_S + 1, gaps
        assert PERIOD_S * 0.8 < statistics.median(gaps) < PERIOD_S * 1.5, gaps
        shot = await page.screenshot(tmp_path / "ui-node.png")
        assert shot.stat().st_size > 20_000
        assert_only_the_agent(page, stack.url)

        # The agent goes away: a banner with the time; it comes back: the page recovers by itself.
        await stack.server.close()
        gone_at = time.time()
        banner = await page.wait_js("the unreachable banner", """!document.getElementById('banner').hidden &&
            document.getElementById('banner').textContent""", timeout=10)
        since = re.match(r"agent unreachable since (\d\d):(\d\d):(\d\d) \(connection failed\)", banner)
        assert since, banner
        local = time.localtime(gone_at)
        assert abs((int(since[1]) * 3600 + int(since[2]) * 60 + int(since[3]))
                   - (local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec)) <= 3  # fmt: skip
        assert await page.js("document.body.classList.contains('stale')")
        assert await page.js("document.getElementById('conn').textContent") == "unreachable"
        await page.screenshot(tmp_path / "ui-unreachable.png")
        asked = sum(u.endswith("/status") for u in page.requests)
        await stack.wait("two more polls", lambda: sum(u.endswith("/status") for u in page.requests) >= asked + 2)
        assert (await page.js("document.getElementById('banner').textContent")).startswith(since[0]), "same since"

        stack.server = ApiServer(stack.agent)
        await stack.server.start()
        await page.wait_js("the page recovered", """document.getElementById('banner').hidden &&
            document.getElementById('conn').textContent.startsWith('live')""", timeout=10)
        _, fresh = await stack.get("/cache")
        assert fresh["started_at"] > history["started_at"], "a new API, a new history"
        await page.wait_js("the page on the new history", f"ui.cache.started_at === {fresh['started_at']}")
        status, _ = await stack.post("/components/a/restart")
        await page.wait_js("a's restart, after the recovery", f"""(() => {{
            const a = {rows_js('components', 'component')}.a;
            return a.restarts === '1' && a.pid !== '{comps["a"]["pid"]}';
        }})()""")
        await page.wait_js("a live event after the recovery", """!!document.querySelector(
            '#events tbody tr[data-component=a][data-event=started]')""")
        page.errors = [e for e in page.errors if "ERR_CONNECTION_REFUSED" not in e]  # the outage's failed fetches
        assert_only_the_agent(page, stack.url)
    finally:
        await stack.close()
        broker.stop()


@pytest.mark.system
async def test_the_cluster_table_from_real_agents(tmp_path: Path, etcd: Any, browser: Chromium) -> None:
    """Three listed members, two running (n1 with a wrong PYTHONHASHSEED, so its preflight holds its stack)."""
    harness = ClusterHarness(tmp_path, etcd.endpoint, ["n0", "n1", "n2"], ttl_s=2.0, heartbeat_s=5.0)
    vllm = harness.data["components"]["vllm"]
    vllm.pop("depends_on")  # no datasystem here: the table is the subject, not the stack
    harness.data["components"] = {"a": {"kind": "process", "command": ["sleep", "3600"], "stop_grace_s": 2},
                                  "vllm": vllm}  # fmt: skip
    for node in harness.data["cluster"]["nodes"]:
        node["components"].pop("datasystem")
    harness.node("n1")["components"]["vllm"]["env"] = {"PYTHONHASHSEED": "1"}
    try:
        harness.start("n0", "n1")
        harness.wait_states("n0", {"a": {"ready"}, "vllm": {"running", "ready"}}, timeout=60)
        harness.wait_members("n0", {"n0", "n1"})
        page = await browser.new_page()
        url = f"http://127.0.0.1:{harness.api_ports['n0']}"
        await page.goto(url + "/ui")
        members = await page.wait_js("three members, n2 missing and flagged", f"""(() => {{
            const rows = {rows_js('members', 'member')};
            return Object.keys(rows).length === 3 && rows.n2.present === 'missing' && rows.n2.warnings === 'missing'
                && rows.n1.warnings === 'pythonhashseed' && rows;
        }})()""", timeout=30)
        assert members["n0"]["name"].startswith("n0 (this node)") and members["n0"]["role"] == "master"
        assert members["n1"]["role"] == "worker" and members["n1"]["group"] == "g-n1" and members["n1"]["ranks"] == "0"
        assert members["n0"]["present"] == "present" and re.fullmatch(r"\d+s", members["n1"]["age"])
        assert "a ready ✓" in members["n0"]["components"] and "vllm" in members["n1"]["components"]
        assert await page.js("document.querySelector('#members tr[data-member=n2]').className") == "missing"
        warnings = await page.js("[...document.querySelectorAll('#cluster-warnings li')].map(li => li.dataset.code)")
        assert sorted(warnings) == ["missing", "pythonhashseed"]
        gang = await page.wait_js("this node's vLLM group", f"{rows_js('gangs', 'gang')}['g-n0']")
        assert (gang["kind"], gang["nodes"]) == ("mixed", "n0") and gang["reason"].startswith("first generation")
        after = int(gang["generation"]) + 1
        token = (tmp_path / "n0" / "token").read_text().strip()
        async with aiohttp.ClientSession() as session, session.post(
                f"{url}/cluster/restart", json={"group": "g-n0", "reason": "new weights"},
                headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status == 202, await r.text()
        gang = await page.wait_js("a new generation of g-n0", f"""(() => {{
            const g = {rows_js('gangs', 'gang')}['g-n0'];
            return g.generation === '{after}' && g.barrier === 'released · arrived: n0' && g;
        }})()""", timeout=30)
        assert gang["reason"].startswith("operator cluster restart (n0: token holder at 127.0.0.1)"), gang
        assert ": new weights" in gang["reason"], gang
        assert (await page.js("document.getElementById('cluster-meta').textContent")).startswith(
            f"{harness.cluster_name} · seen from n0 · etcd reachable")
        preflight = await page.js("document.querySelector('[data-section=preflight]').textContent")
        assert re.search(r"enforce: \d+ PASS, \d+ WARN, 0 FAIL", preflight) and "holds" not in preflight, preflight
        await page.screenshot(tmp_path / "ui-cluster.png")
        assert_only_the_agent(page, url)

        # n1's own page: its stack held by its preflight, and why.
        n1 = await browser.new_page()
        await n1.goto(f"http://127.0.0.1:{harness.api_ports['n1']}/ui")
        held = await n1.wait_js("n1's held components", f"""(() => {{
            const rows = {rows_js('components', 'component')};
            return rows.vllm && rows.vllm.note.startsWith('held: preflight failed') && rows;
        }})()""")
        assert held["vllm"]["pid"] == "—" and "pythonhashseed" in held["vllm"]["note"]
        # the first paint is server-side (components only); the host sections come with the first poll
        await n1.wait_js("n1's preflight section says what holds it", """(() => {
            const s = document.querySelector('[data-section=preflight]');
            return s !== null && s.textContent.includes('holds the stack: pythonhashseed');
        })()""")

        harness.stop("n1", timeout=60)  # a member leaving shows up as missing on n0's page
        await page.wait_js("n1 missing", f"{rows_js('members', 'member')}.n1.present === 'missing'", timeout=20)
        await n1.wait_js("n1's page: its agent gone", "document.getElementById('banner').textContent"
                         ".startsWith('agent unreachable since')", timeout=10)
    finally:
        harness.cleanup()

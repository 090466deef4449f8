"""A reload (issue 29): a config that collides with the node's own listeners is refused with every process kept;
a reload that fixes a component down by a failure or held on a port starts it with the fixed config at once.

In process: the real Agent, Supervisor and API on `tests/apihelpers.py`'s tiny config (process one-liners)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml
from apihelpers import InProcess, write_config
from conftest import free_port

LISTENER = "import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', int(sys.argv[1])))\ns.listen()\n" \
           "print('listening', flush=True)\ntime.sleep(600)"  # fmt: skip


@pytest.fixture
def stranger() -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A process that is not ours listening on a free port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        yield port, proc
    finally:
        proc.kill()
        proc.wait(10)


async def test_a_reload_onto_the_agents_own_api_port_is_refused_and_changes_nothing(stack: InProcess) -> None:
    sup = stack.agent.supervisor
    before = stack.pids()
    data = yaml.safe_load(stack.config_path.read_text())
    api_port = stack.agent.config.agent.api.port
    data["components"]["b"]["ports"] = [api_port]
    write_config(stack.config_path, data)
    status, body = await stack.post("/reload")
    assert status == 400, body
    assert f"components.b: {api_port}: agent API (agent.api.listen) {api_port} and b port {api_port} collide" in \
        body["error"] and "agent.api.listen" in body["error"], body  # fmt: skip
    assert stack.pids() == before and all(c.restarts == 0 for c in sup.components.values())
    assert not stack.agent.config.components["b"].ports
    refused = [e for e in sup.events.recent if e.event == "reload_failed"]
    assert refused and "collide" in refused[-1].message


async def test_a_fixing_reload_starts_a_component_held_on_a_port(stack: InProcess,
                                                                 stranger: tuple[int, subprocess.Popen[str]]) -> None:
    """The issue's second half: a reload moved b onto a port someone else holds (a host fact, no config error):
    b waits, held, never signalling the holder. The file fixed, `reload` must bring b back, not say 'nothing'."""
    port, _ = stranger
    sup = stack.agent.supervisor
    b = sup.components["b"]
    data = yaml.safe_load(stack.config_path.read_text())
    data["components"]["b"].update(command=[sys.executable, "-c", LISTENER, str(port)], ports=[port])
    write_config(stack.config_path, data)
    status, body = await stack.post("/reload")
    assert (status, body["restarted"]) == (200, ["b"]), body
    await stack.wait("b held on the port", lambda: b.record is None and b.held is not None and str(port) in b.held)
    a_pid = stack.pids()["a"]

    fixed = free_port()
    data["components"]["b"].update(command=[sys.executable, "-c", LISTENER, str(fixed)], ports=[fixed])
    write_config(stack.config_path, data)
    status, body = await stack.post("/reload")
    assert status == 200 and body["restarted"] == [] and body["started"] == ["b"], body
    await stack.wait("b up again", lambda: b.record is not None and str(b.state) in ("running", "ready"))
    assert b.held is None and stack.pids()["a"] == a_pid
    assert any("starting again" in e.message and "b" in e.message for e in sup.events.recent if e.event == "reload")


async def test_a_fixing_reload_starts_a_failed_component_and_an_unchanged_one_stays(stack: InProcess) -> None:
    """b's command missing (a permanent failure: failed, retried only much later); the fixed file brings it back
    at once. A reload that does not change b leaves it failed (nothing the operator fixed)."""
    sup = stack.agent.supervisor
    b = sup.components["b"]
    data = yaml.safe_load(stack.config_path.read_text())
    good = list(data["components"]["b"]["command"])
    data["components"]["b"]["command"] = ["/nonexistent/dsv4-no-such-binary"]
    write_config(stack.config_path, data)
    status, body = await stack.post("/reload")
    assert (status, body["restarted"]) == (200, ["b"]), body
    await stack.wait("b failed", lambda: str(b.state) == "failed" and b.record is None)

    data["components"]["a"]["env"] = {"UNRELATED": "1"}
    write_config(stack.config_path, data)
    status, body = await stack.post("/reload")
    assert status == 200 and body["restarted"] == ["a"] and body["started"] == [], body
    assert str(b.state) == "failed"

    data["components"]["b"]["command"] = good
    write_config(stack.config_path, data)
    status, body = await stack.post("/reload")
    assert status == 200 and body["started"] == ["b"], json.dumps(body)
    await stack.wait("b up again", lambda: b.record is not None and str(b.state) in ("running", "ready"), 30)

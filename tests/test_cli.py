"""`nodeagentctl` against a real dsv4-agent (on `process` one-liners, so it boots in a second): the status
table, actions with --wait, logs, and the exit codes an operator's scripts rely on."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from apihelpers import tiny_config, write_config
from conftest import BIN, ROOT, free_port, wait_for

from nodeagent import cli
from nodeagent.core.logsink import rotate_if_large


def ctl(config: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "nodeagentctl"), "--config", str(config), *args], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


class RunningAgent:
    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        data = tiny_config(home)
        data["components"]["broken"] = {
            "kind": "process", "command": ["python3", "-c", "import sys; print('bye', flush=True); sys.exit(3)"],
            "restart": {"backoff_initial_s": 60, "redeploy_after_failures": 100},
        }  # fmt: skip
        self.socket_dir = Path(tempfile.mkdtemp(prefix="ctl-"))  # sun_path is 108 bytes at most
        data["agent"]["api"]["unix_socket"] = str(self.socket_dir / "api.sock")
        self.data = data
        self.config = write_config(home / "config.yaml", data)
        self.port = int(data["agent"]["api"]["listen"].rsplit(":", 1)[1])
        log = open(home / "agent.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen([str(BIN / "dsv4-agent"), "--config", str(self.config)], stdout=log, stderr=log,
                                     start_new_session=True)  # fmt: skip
        log.close()

    def status(self) -> dict[str, Any]:
        out = ctl(self.config, "status", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def comp(self, name: str) -> dict[str, Any]:
        return self.status()["components"][name]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    running = RunningAgent(tmp_path_factory.mktemp("cli") / "home")
    try:
        wait_for("agent up", lambda: all(c["state"] in ("running", "ready") for n, c in
                                         running.status()["components"].items() if n != "broken"), 30)  # fmt: skip
        yield running
    finally:
        running.stop()


def test_status_table(agent: RunningAgent) -> None:
    out = ctl(agent.config, "status")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("node tiny (master) · cluster t")
    header = next(i for i, ln in enumerate(lines) if ln.startswith("COMPONENT"))
    assert lines[header].split() == ["COMPONENT", "STATE", "PID", "READY", "RESTARTS", "UPTIME", "LAST", "EXIT", "NOTE"]
    rows = {ln.split()[0]: ln.split() for ln in lines[header + 1:]}
    status = agent.status()["components"]
    assert set(rows) == {"a", "b", "broken"}
    for name in ("a", "b"):
        assert rows[name][1] == status[name]["state"] and rows[name][2] == str(status[name]["pid"])
        assert rows[name][3] == ("yes" if status[name]["ready"] else "no")
    assert "ago: exited" in out.stdout, "broken's last exit is shown"


def test_status_json_is_the_agents_status(agent: RunningAgent) -> None:
    data = agent.status()
    assert data["node"]["name"] == "tiny" and data["agent"]["pid"] == agent.proc.pid


def test_status_stays_light() -> None:
    """No config model (msgspec), aiohttp or prometheus_client on the status path (each costs ms to hundreds)."""
    code = ("import sys\nfrom nodeagent import cli\ncli.main(['--config', sys.argv[1], 'status'])\n"
            "print(sorted(m for m in ('msgspec', 'aiohttp', 'prometheus_client', 'psutil') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "config" / "local.yaml")], capture_output=True,
                         text=True, timeout=30, env={**os.environ, "DSV4_API_PORT": str(free_port())})  # fmt: skip
    assert "agent unreachable" in out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_cli_reads_the_agent_section_through_the_agents_own_loader(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One reader: the raw layer of `nodeagent.config.load` (no model) for the agent section, the validated loader
    when the raw layer cannot tell — with the same defaults and path rules, so both give the same answers."""
    from nodeagent.config.load import load_config

    monkeypatch.setenv("DSV4_API_PORT", "18999")
    monkeypatch.setenv("DSV4_AGENT_HOME", "rel/home")
    monkeypatch.delenv("DSV4_NODE_NAME", raising=False)
    data = tiny_config(tmp_path)
    data["agent"]["api"]["unix_socket"] = "sock/api.sock"
    data["agent"]["api"]["token_file"] = "~/tok"
    data["agent"].pop("log_dir")
    tiny = write_config(tmp_path / "tiny.yaml", data)
    for path in (ROOT / "config" / "local.yaml", ROOT / "config" / "dsv4-flash-a2.yaml", tiny):
        full, light = load_config(path), cli.read_light_config(str(path))
        api = full.agent.api
        assert (light.listen, light.token_file, light.unix_socket) == (api.listen, api.token_file, api.unix_socket)
        assert (light.log_dir, light.state_dir) == (full.agent.log_dir, full.agent.state_dir)
    # A `${VAR}` outside the agent section that only the agent's environment sets does not stop the CLI.
    data["node"]["name"] = "${DSV4_NODE_NAME}"
    light = cli.read_light_config(str(write_config(tmp_path / "env.yaml", data)))
    assert light.listen == data["agent"]["api"]["listen"]
    # What the raw layer cannot take, the validated loader judges: the exact error, file and line.
    data["node"]["name"] = "tiny"
    data["agent"]["api"]["listen"] = "127.0.0.1:99999"
    bad = write_config(tmp_path / "bad.yaml", data)
    with pytest.raises(cli.CliError) as failed:
        cli.read_light_config(str(bad))
    assert failed.value.code == cli.EXIT_CONFIG and f"{bad}:" in str(failed.value) and "listen must be" in str(
        failed.value)  # fmt: skip


def test_restart_stop_start_with_wait(agent: RunningAgent) -> None:
    old = agent.comp("b")["pid"]
    out = ctl(agent.config, "restart", "b", "--wait", "--timeout", "30")
    assert out.returncode == 0, out.stderr
    new = agent.comp("b")
    assert new["pid"] != old and new["state"] in ("running", "ready") and new["restarts"] >= 1
    assert f"(pid {new['pid']}, was {old})" in out.stdout
    out = ctl(agent.config, "stop", "b", "--wait", "--timeout", "30")
    assert out.returncode == 0 and "b stopped" in out.stdout, out.stderr
    assert agent.comp("b")["state"] == "stopped" and agent.comp("b")["desired"] == "stopped"
    out = ctl(agent.config, "start", "b", "--wait", "--timeout", "30")
    assert out.returncode == 0, out.stderr
    assert agent.comp("b")["state"] in ("running", "ready")
    out = ctl(agent.config, "start", "b")
    assert (out.returncode, out.stdout.strip()) == (0, "start b: accepted")


def test_wait_reports_a_failed_action(agent: RunningAgent) -> None:
    out = ctl(agent.config, "restart", "broken", "--wait", "--timeout", "30")
    assert out.returncode == cli.EXIT_FAILED
    # it exits with code 3 within a second every time: a permanent failure, said in one line
    assert "broken restart failed: failed (exited with code 3)" in out.stderr, out.stderr


def test_unknown_component_exits_4(agent: RunningAgent) -> None:
    for args in (("restart", "nope"), ("stop", "nope", "--wait"), ("reset", "nope"), ("logs", "nope")):
        out = ctl(agent.config, *args)
        assert out.returncode == cli.EXIT_UNKNOWN, (args, out.stderr)
        assert "unknown component 'nope'" in out.stderr and out.stderr.count("\n") == 1


def test_unreachable_exits_3_naming_the_address(tmp_path: Path) -> None:
    data = tiny_config(tmp_path)
    path = write_config(tmp_path / "c.yaml", data)
    for args in (("status",), ("restart", "a"), ("pause",)):
        out = ctl(path, *args)
        assert out.returncode == cli.EXIT_UNREACHABLE, out.stderr
        assert f"agent unreachable at http://{data['agent']['api']['listen']}" in out.stderr


def test_unauthorised_exits_5_and_root_on_the_socket_needs_no_token(agent: RunningAgent, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    data = json.loads(json.dumps(agent.data))
    socket_path = data["agent"]["api"].pop("unix_socket")  # over TCP a token is needed, even as root
    data["agent"]["api"]["token_file"] = str(wrong)
    other = write_config(tmp_path / "other.yaml", data)
    out = ctl(other, "pause")
    assert out.returncode == cli.EXIT_UNAUTHORISED and "unauthorised: wrong token" in out.stderr
    data["agent"]["api"]["token_file"] = str(tmp_path / "missing")
    out = ctl(write_config(tmp_path / "other2.yaml", data), "pause")
    assert out.returncode == cli.EXIT_UNAUTHORISED and "cannot read the token file" in out.stderr
    assert not agent.status()["paused"]
    data["agent"]["api"]["unix_socket"] = socket_path  # the same missing token, but root on the socket
    out = ctl(write_config(tmp_path / "other3.yaml", data), "pause")
    assert out.returncode == 0, out.stderr
    assert agent.status()["paused"]
    assert ctl(agent.config, "resume").returncode == 0


def test_pause_resume_reset_reload(agent: RunningAgent) -> None:
    assert ctl(agent.config, "pause").returncode == 0
    out = ctl(agent.config, "status")
    assert "PAUSED" in out.stdout and agent.status()["paused"]
    assert ctl(agent.config, "resume").returncode == 0
    assert not agent.status()["paused"]
    out = ctl(agent.config, "reset", "a")
    assert out.returncode == 0 and "(a)" in out.stdout
    out = ctl(agent.config, "reload")
    assert (out.returncode, out.stdout.strip()) == (0, "reload: restarted nothing")
    original = agent.config.read_text()
    try:
        agent.config.write_text(original.replace("stop_grace_s:", "stop_grace:", 1))
        out = ctl(agent.config, "reload")
        assert out.returncode == cli.EXIT_CONFIG and "unknown key 'stop_grace'" in out.stderr, out.stderr
    finally:
        agent.config.write_text(original)


def test_redeploy_wait(agent: RunningAgent) -> None:
    before = {n: c["pid"] for n, c in agent.status()["components"].items()}
    out = ctl(agent.config, "stop", "broken", "--wait", "--timeout", "30")  # it would never come up
    assert out.returncode == 0 and "broken stopped" in out.stdout, out.stderr
    out = ctl(agent.config, "redeploy", "--wait", "--timeout", "60", "--reason", "cli test")
    assert out.returncode == 0, out.stderr
    after = agent.status()["components"]
    for name in ("a", "b"):
        assert after[name]["pid"] not in (None, before[name]) and after[name]["state"] in ("running", "ready")
    assert "redeploy done" in out.stdout


def test_logs_last_lines_from_the_file(agent: RunningAgent) -> None:
    wait_for("b's output", lambda: "b line 5" in (agent.home / "logs" / "b.log").read_text())
    out = ctl(agent.config, "logs", "b", "-n", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["b line 3", "b line 4", "b line 5"]
    out = ctl(agent.config, "logs", "b", "-n", "0")
    assert (out.returncode, out.stdout) == (0, "")


def test_follow_survives_copytruncate_and_replacement(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    log.write_text("".join(f"old {i}\n" for i in range(100)))
    lines, offset = cli.tail_lines(log, 2)
    assert lines == [b"old 98\n", b"old 99\n"]
    sink = io.BytesIO()
    follower = threading.Thread(target=cli.follow, args=(log, offset, sink, 0.02, time.monotonic() + 2.0))
    follower.start()

    def append(text: str) -> None:
        with open(log, "a") as fh:
            fh.write(text)

    append("new 1\n")
    wait_for("new 1", lambda: b"new 1\n" in sink.getvalue(), 2, 0.02)
    assert rotate_if_large(log, 10, 3)  # copytruncate, as the agent's log sink does
    append("after truncate\n")
    wait_for("after truncate", lambda: b"after truncate\n" in sink.getvalue(), 2, 0.02)
    os.replace(log, tmp_path / "c.log.old")
    log.write_text("replaced\n")
    wait_for("replaced", lambda: b"replaced\n" in sink.getvalue(), 2, 0.02)
    follower.join()
    assert sink.getvalue() == b"new 1\nafter truncate\nreplaced\n"


def test_bad_config_exits_78_and_usage_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("agent:\n  api: {listen: [\n")
    out = ctl(bad, "status")
    assert out.returncode == cli.EXIT_CONFIG and f"{bad}:" in out.stderr and "YAML" in out.stderr
    out = ctl(tmp_path / "missing.yaml", "status")
    assert out.returncode == cli.EXIT_CONFIG and "no such config file" in out.stderr
    assert ctl(bad, "restart").returncode == cli.EXIT_USAGE
    assert ctl(bad, "logs", "a", "-n", "-1").returncode == cli.EXIT_USAGE


def test_cache_defaults_to_the_configured_vllm(tmp_path: Path) -> None:
    port = free_port()
    data = tiny_config(tmp_path)
    data["components"]["vllm"] = {"kind": "vllm", "model": "/m", "port": port}
    out = ctl(write_config(tmp_path / "c.yaml", data), "cache")
    assert out.returncode == 3 and f"http://127.0.0.1:{port}/metrics" in out.stderr
    out = ctl(write_config(tmp_path / "d.yaml", tiny_config(tmp_path)), "cache")
    assert out.returncode == cli.EXIT_USAGE and "no vllm component" in out.stderr


def test_config_env_variable_and_version(agent: RunningAgent) -> None:
    env = {**os.environ, "DSV4_AGENT_CONFIG": str(agent.config)}
    out = subprocess.run([str(BIN / "nodeagentctl"), "status"], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0 and "node tiny" in out.stdout
    out = ctl(agent.config, "version")
    assert out.stdout.startswith("nodeagentctl ")
    data = yaml.safe_load(agent.config.read_text())
    assert data["node"]["name"] == "tiny"


def test_logs_under_systemd_hand_over_to_journalctl(agent: RunningAgent, tmp_path: Path) -> None:
    """The exact journalctl command (a stand-in on PATH records it): the unit's entries of that component."""
    fake = tmp_path / "bin" / "journalctl"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "journalctl $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    out = subprocess.run([str(BIN / "nodeagentctl"), "-c", str(agent.config), "logs", "b", "-n", "7", "-f",
                          "--source", "journal"], capture_output=True, text=True, timeout=30, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "journalctl -u dsv4-agent -t b -n 7 --no-pager -f"


def test_status_wide_shows_note_and_last_exit_whole() -> None:
    from nodeagent.cli.status import format_status

    reason = "exited with code 1: " + "x" * 80
    held = "start held: port 8080 in use by pid 4242 (python3 -m http.server 8080), not ours, never signalled"
    data = {"node": {"name": "n"}, "agent": {}, "components": {"vllm": {
        "state": "failed", "pid": None, "last_exit": {"reason": reason, "at": 1000.0}, "held": held,
        "failure": {"detail": "bad", "output_tail": ["Traceback", "RuntimeError: " + "y" * 150]}}}}  # fmt: skip
    cut, wide = format_status(data, now=1010.0), format_status(data, now=1010.0, wide=True)
    assert "…" in cut and reason not in cut and "y" * 150 not in cut
    assert "…" not in wide and reason in wide and held in wide and "RuntimeError: " + "y" * 150 in wide
    assert cut.splitlines()[:2] == wide.splitlines()[:2]


def test_status_says_who_paused_which_scope_and_why() -> None:
    """Under a cluster pause every member's status says so with the reason, as `nodeagentctl cluster` does."""
    from nodeagent.cli.status import format_status

    base = {"node": {"name": "n2"}, "agent": {}, "components": {}, "paused": True}
    cluster = {"by": "n0: operator", "at": 1000.0, "reason": "switch maintenance", "scope": "cluster"}
    assert format_status({**base, "pause": cluster}, now=1180.0).splitlines()[1] == (
        "CLUSTER PAUSED by n0: operator 3m ago — switch maintenance (no agent takes automatic actions)")
    node = {"by": "operator", "at": 1170.0, "scope": "node"}
    assert format_status({**base, "pause": node}, now=1180.0).splitlines()[1] == (
        "PAUSED by operator 10s ago (no automatic restarts on this node)")


def test_status_heads_with_an_isolation_or_a_chip_reset() -> None:
    """The node-wide states of the ladder come first, under the node's line — not only in a component's NOTE."""
    from nodeagent.cli.status import format_status

    base = {"node": {"name": "a2-3"}, "agent": {}, "components": {"vllm": {"state": "stopped", "held": "x"}}}
    assert format_status(base, now=0).splitlines()[1] == "", "nothing to say: no line"
    isolated = {**base, "isolated": "npu 5 health Critical (SeparateNPU: never reset)", "paused": True}
    lines = format_status(isolated, now=0).splitlines()
    assert lines[1] == ("ISOLATED: npu 5 health Critical (SeparateNPU: never reset) — its NPU users stay stopped "
                        "until `nodeagentctl uncordon`")
    assert lines[2] == "PAUSED (no automatic restarts)", "before every other flag"
    rung = {"step": "settle", "why": "npu 3 health Alarm (RestartNPU)", "at": 1.0, "chips": [3]}
    lines = format_status({**base, "recovery": {"rung": rung}}, now=0).splitlines()
    assert lines[1] == ("CHIP RESET IN PROGRESS of npu 3 (step settle): npu 3 health Alarm (RestartNPU) — every NPU "
                        "user here is stopped, its groups drained")
    failed = {**rung, "step": "failed", "why": "chip reset failed at verify: npu 3 Alarm after the reset"}
    assert format_status({**base, "recovery": {"rung": failed}}, now=0).splitlines()[1].startswith(
        "CHIP RESET FAILED of npu 3: chip reset failed at verify")


def test_status_table_says_what_the_restarts_were_for() -> None:
    """issue 17: in a gang restart the crashed rank showed RESTARTS 0 and its peer 1; the count by cause is in the
    table (the same with --wide), in the agent's order of causes."""
    from nodeagent.cli.status import format_status
    from nodeagent.node.component_status import by_cause

    assert list(by_cause({"gang": 2, "later": 1, "crash": 1})) == ["crash", "gang", "later"]
    gang = by_cause({"gang": 2, "crash": 1})
    comps = {"vllm": {"state": "ready", "pid": 7, "restarts": 3, "restarts_by_cause": gang},
             "etcd": {"state": "ready", "pid": 8, "restarts": 0, "restarts_by_cause": {}},
             "old": {"state": "ready", "pid": 9, "restarts": 2}}  # fmt: skip
    for text in (format_status({"node": {}, "agent": {}, "components": comps}, now=0.0, wide=wide)
                 for wide in (False, True)):  # fmt: skip
        lines = text.splitlines()
        header = next(ln for ln in lines if ln.startswith("COMPONENT"))
        column = header.index("RESTARTS")
        rows = [ln for ln in lines if ln.split()[:1] in (["vllm"], ["etcd"], ["old"])]
        cells = {ln.split()[0]: ln[column:].split("  ")[0] for ln in rows}
        assert cells == {"vllm": "3 (crash 1, gang 2)", "etcd": "0", "old": "2"}, text


class ClusterOf:
    """The local agent's GET /cluster answer, as `nodeagentctl --node N status` reads it."""

    def __init__(self, view: dict[str, Any]) -> None:
        self.view = view

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        assert (method, path) == ("GET", "/cluster")
        return 200, self.view


def test_remote_status_json_has_the_local_shape(agent: RunningAgent, capsys: pytest.CaptureFixture[str]) -> None:
    """From the member's own API (a real agent) and from its member key alone: the keys of the local status,
    with where it came from under `remote`."""
    from nodeagent.cli.status import _remote_status

    local = agent.status()
    member = {"name": "tiny", "present": True, "role": "master", "ip": "127.0.0.1", "version": "0.1.0",
              "api_url": f"http://127.0.0.1:{agent.port}", "components": {"a": {"state": "running", "pid": 7,
                                                                             "ready": True}}}  # fmt: skip
    assert _remote_status(ClusterOf({"members": [member]}), "tiny", True, False) == 0  # type: ignore[arg-type]
    remote = json.loads(capsys.readouterr().out)
    assert set(remote) == set(local) | {"remote"} and remote["remote"] == {"source": "api", "reason": None}
    assert remote["node"]["name"] == "tiny" and set(remote["components"]) == set(local["components"])
    del member["api_url"]  # its API listens on loopback: the member key is all there is
    assert _remote_status(ClusterOf({"members": [member]}), "tiny", True, False) == 0  # type: ignore[arg-type]
    keyed = json.loads(capsys.readouterr().out)
    assert set(keyed) - {"remote"} <= set(local) and keyed["remote"]["source"] == "member_key"
    assert "loopback" in keyed["remote"]["reason"] and keyed["remote"]["member"] == member
    assert keyed["components"] == {"a": {"state": "running", "pid": 7, "ready": True}}
    assert keyed["node"]["name"] == "tiny" and keyed["agent"]["version"] == "0.1.0"
    hold = {"kind": "foreign_holder", "reason": "port 8080 in use by pid 42 (nc)", "resolves_itself": False}
    member["components"]["a"] = {"state": "stopped", "pid": None, "ready": False, "hold": hold}
    assert _remote_status(ClusterOf({"members": [member]}), "tiny", True, False) == 0  # type: ignore[arg-type]
    keyed = json.loads(capsys.readouterr().out)["components"]["a"]
    assert keyed["held"] == hold["reason"] and keyed["hold"] == hold, "why it waits, as the local status says it"


def test_the_cluster_table_shows_a_cluster_pause() -> None:
    from nodeagent.cli.remote import format_cluster

    view = {"cluster": "c", "self": "n0", "view_complete": True, "members": [], "etcd": {"state": "reachable"},
            "coordination": {"pause": {"by": "n1: operator", "at": 1000.0, "reason": "switch maintenance"}}}
    lines = format_cluster(view, now=1180.0).splitlines()
    assert lines[1] == "CLUSTER PAUSED by n1: operator 3m ago — switch maintenance (no agent takes automatic actions)"
    view["coordination"] = {"pause": None}
    assert "PAUSED" not in format_cluster(view, now=1180.0)


def test_the_cluster_table_shows_each_members_generation_and_when_its_record_was_written() -> None:
    from nodeagent.cli.remote import format_cluster

    def member(name: str, group: str, **gang: object) -> dict[str, object]:
        return {"name": name, "ip": "127.0.0.1", "role": "worker", "group": group, "ranks": {"start": 0, "count": 1},
                "version": "0.1.0", "present": True, "age_s": 3.2, "gangs": {group: gang} if gang else {},
                "components": {"vllm": {"state": "ready"}}}

    view = {"cluster": "c", "self": "n0", "view_complete": True, "etcd": {"state": "reachable"},
            "members": [member("n1", "d0", generation=2, released=True), member("n2", "d0", generation=3,
                        released=False), member("n3", "p0"), {"name": "n4", "present": False}]}  # fmt: skip
    lines = format_cluster(view, now=0.0).splitlines()
    assert lines[1].split() == ["NAME", "IP", "ROLE", "GROUP", "GEN", "RANKS", "VERSION", "COMPONENTS", "SEEN",
                                "WARNINGS"]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["n1"][3:5] == ["d0", "2"] and rows["n1"][-3:] == ["3s", "ago", "-"]
    assert rows["n2"][3:6] == ["d0", "3", "barrier"], "its ranks wait at the group's start barrier"
    assert rows["n3"][3:5] == ["p0", "-"], "no generation published yet"
    assert "(no member key)" in " ".join(rows["n4"])


def test_status_of_a_running_agent_imports_only_what_it_needs(agent: RunningAgent) -> None:
    """Its config is the one a running agent announced: no YAML, no http.client (the `email` package), no
    dataclasses (inspect) — what keeps `nodeagentctl status` near the bare interpreter's start."""
    code = ("import sys\nfrom nodeagent import cli\ncode = cli.main(['--config', sys.argv[1], 'status', '--wide'])\n"
            "print(code, sorted(m for m in ('yaml', 'http.client', 'dataclasses', 'msgspec', 'aiohttp') "
            "if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(agent.config)], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout + out.stderr
    assert "node tiny" in out.stdout and "COMPONENT" in out.stdout


def test_wait_ends_early_on_a_hold_the_agent_will_not_resolve(tmp_path: Path) -> None:
    """issue 17: `restart --wait` while a stranger holds the component's port says why, and ends early."""
    import socket

    from apihelpers import SLEEPER

    port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    data = tiny_config(home)
    data["components"]["porty"] = {"kind": "process", "command": SLEEPER, "ports": [port], "stop_grace_s": 3}
    config = write_config(home / "config.yaml", data)
    log = open(tmp_path / "agent.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen([str(BIN / "dsv4-agent"), "--config", str(config)], stdout=log, stderr=log,
                            start_new_session=True)  # fmt: skip
    log.close()
    stranger = socket.socket()
    try:
        def up() -> bool:
            out = ctl(config, "status", "--json")
            state = json.loads(out.stdout)["components"]["porty"]["state"] if out.returncode == 0 else None
            return state in ("running", "ready")

        wait_for("porty up", up, 30)
        assert ctl(config, "stop", "porty", "--wait", "--timeout", "30").returncode == 0
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        stranger.bind(("127.0.0.1", port))
        stranger.listen()
        began = time.monotonic()
        out = ctl(config, "start", "porty", "--wait", "--timeout", "120")
        took = time.monotonic() - began
        assert out.returncode == cli.EXIT_FAILED, (out.stdout, out.stderr)
        assert f"porty start held: port {port}" in out.stderr and "not ours, never signalled" in out.stderr, out.stderr
        assert "(held: port" in out.stderr, "the hold is shown while waiting"
        assert took < 30, f"ended early, not at the timeout ({took:.1f}s)"
        status = json.loads(ctl(config, "status", "--json").stdout)["components"]["porty"]
        assert status["hold"]["kind"] == "foreign_holder" and status["hold"]["resolves_itself"] is False
        stranger.close()
        out = ctl(config, "start", "porty", "--wait", "--timeout", "60")
        assert out.returncode == 0, out.stderr
    finally:
        stranger.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()

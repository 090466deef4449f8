"""How `nodeagentctl` finds its agent: --config, $DSV4_AGENT_CONFIG, /etc/dsv4-agent/config.yaml, then an agent
that announced itself in the runtime folder. Real agents (`dsv4-agent` on `process` one-liners) and the CLI in a
subprocess with a clean environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from apihelpers import tiny_config, write_config
from conftest import BIN, free_port, wait_for

from nodeagent import cli
from nodeagent.core import discovery
from nodeagent.core.discovery import Announcement, LookupFailed, SeveralAgents, locate_config


def test_runtime_folders() -> None:
    assert discovery.runtime_dir({discovery.ENV_RUNTIME_DIR: "/x"}, 0) == Path("/x")
    assert discovery.runtime_dir({"XDG_RUNTIME_DIR": "/run/user/1000"}, 1000) == Path(
        "/run/user/1000/dsv4-agent/agents")  # fmt: skip
    assert discovery.runtime_dir({}, 0) == Path("/run/dsv4-agent/agents")
    user = discovery.runtime_dir({}, 1000)
    assert (user.name, user.parent.name) == ("agents", "dsv4-agent-1000")
    # The CLI also looks where a root agent (systemd) announces itself; an explicit folder is the only one.
    assert discovery.search_dirs({"XDG_RUNTIME_DIR": "/run/user/0"}, 0) == [
        Path("/run/user/0/dsv4-agent/agents"), discovery.ROOT_DIR]  # fmt: skip
    assert discovery.search_dirs({}, 0) == [discovery.ROOT_DIR]
    assert discovery.search_dirs({discovery.ENV_RUNTIME_DIR: "/x", "XDG_RUNTIME_DIR": "/y"}, 0) == [Path("/x")]


def test_the_cli_and_the_agent_share_the_default_config() -> None:
    from nodeagent import agent

    assert str(discovery.DEFAULT_CONFIG) == cli.DEFAULT_CONFIG == agent.DEFAULT_CONFIG


def me(config: str = "/c.yaml", **changes: object) -> Announcement:
    agent = discovery.this_agent(config, "127.0.0.1:1", None, "/t", "/s", "/l", "n")
    return agent._replace(**changes)  # type: ignore[arg-type]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lookup_order(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    default = tmp_path / "etc" / "config.yaml"
    announced = discovery.announce(runtime, me(str(tmp_path / "a.yaml")))
    assert json.loads(announced.read_text())["config"] == str(tmp_path / "a.yaml")
    assert locate_config("x.yaml", {discovery.ENV_CONFIG: "y.yaml"}, default, [runtime]).path == "x.yaml"
    assert locate_config(None, {discovery.ENV_CONFIG: "y.yaml"}, default, [runtime]).source == "$DSV4_AGENT_CONFIG"
    found = locate_config(None, {}, default, [runtime])
    assert (found.path, found.source, found.agent and found.agent.pid) == (str(tmp_path / "a.yaml"), "announced",
                                                                            os.getpid())  # fmt: skip
    default.parent.mkdir()
    default.write_text("{}")
    assert locate_config(None, {}, default, [runtime]).source == "default"


def test_stale_reused_and_untrusted_announcements_are_ignored(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    for agent in (me(pid=dead_pid()), me(start_ticks=1)):  # a dead pid; our pid with another start time (reused)
        (runtime / f"{agent.pid}-{agent.start_ticks}.json").write_text(json.dumps(agent._asdict()))
    with pytest.raises(LookupFailed) as failed:
        locate_config(None, {}, tmp_path / "none.yaml", [runtime, tmp_path / "missing"])
    text = str(failed.value)
    assert not isinstance(failed.value, SeveralAgents)
    for tried in ("--config (not given)", "$DSV4_AGENT_CONFIG (not set)", f"{tmp_path / 'none.yaml'} (no such file)",
                  f"agents announced in {runtime} (0 running, 2 stale ignored)",
                  f"agents announced in {tmp_path / 'missing'} (no such folder)"):  # fmt: skip
        assert tried in text
    # Writing an announcement drops this user's stale ones.
    discovery.announce(runtime, me())
    assert sorted(p.name for p in runtime.iterdir()) == [f"{os.getpid()}.json"]
    runtime.chmod(0o777)  # anyone could plant a file here that sends our token elsewhere
    with pytest.raises(LookupFailed, match="ignored: writable by others"):
        locate_config(None, {}, tmp_path / "none.yaml", [runtime])


def live(config: Path, node: str, cluster: str, pid: int) -> Announcement:
    """An announcement of a running process (ours or our parent's) as an agent of that node and cluster."""
    return me(str(config), pid=pid, start_ticks=discovery.start_ticks(pid), node=node, cluster=cluster)


def test_node_never_picks_an_agent_of_another_cluster(tmp_path: Path) -> None:
    """`--config mine.yaml --node n0` while only another stack's n0 runs here (run-local's agents not up yet):
    that agent answered for the wrong cluster; now the lookup refuses, naming it. Beside it, ours is chosen."""
    runtime = tmp_path / "run"
    runtime.mkdir()
    mine, theirs = tmp_path / "mine.yaml", tmp_path / "theirs.yaml"
    mine.write_text("cluster: {name: local-cluster}\n")
    theirs.write_text("cluster: {name: other}\n")
    other = live(theirs, "n0", "other", os.getppid())
    (runtime / f"{other.pid}.json").write_text(json.dumps(other._asdict()))
    cluster = discovery_cluster(mine)
    assert cluster == "local-cluster"
    with pytest.raises(LookupFailed) as refused:
        locate_config(str(mine), {}, tmp_path / "none.yaml", [runtime], node="n0", cluster=cluster)
    assert "no agent of node n0 with cluster local-cluster and config" in str(refused.value)
    assert f"pid {other.pid} (node n0, cluster other" in str(refused.value)
    ours = live(mine, "n0", "local-cluster", os.getpid())
    (runtime / f"{ours.pid}.json").write_text(json.dumps(ours._asdict()))
    found = locate_config(str(mine), {}, tmp_path / "none.yaml", [runtime], node="n0", cluster=cluster)
    assert found.agent is not None and found.agent.pid == os.getpid()
    # One file, two clusters (a `${VAR}` in its name): the cluster name decides, not the file alone.
    same = live(mine, "n0", "elsewhere", os.getppid())
    (runtime / f"{other.pid}.json").write_text(json.dumps(same._asdict()))
    found = locate_config(str(mine), {}, tmp_path / "none.yaml", [runtime], node="n0", cluster=cluster)
    assert found.agent is not None and found.agent.pid == os.getpid()
    # An agent started before announcements named their cluster: judged by its file alone (an upgrade's window).
    older = live(mine, "n0", "x", os.getppid())._replace(cluster=None)
    (runtime / f"{ours.pid}.json").unlink()
    (runtime / f"{other.pid}.json").write_text(json.dumps({k: v for k, v in older._asdict().items() if k != "cluster"}))
    found = locate_config(str(mine), {}, tmp_path / "none.yaml", [runtime], node="n0", cluster=cluster)
    assert found.agent is not None and found.agent.pid == os.getppid()
    (runtime / f"{ours.pid}.json").write_text(json.dumps(ours._asdict()))
    (runtime / f"{other.pid}.json").write_text(json.dumps(same._asdict()))
    # Without a config nothing names the cluster: two stacks' n0 are refused, not guessed.
    with pytest.raises(SeveralAgents, match="2 agents of node n0 run on this host"):
        locate_config(None, {}, tmp_path / "none.yaml", [runtime], node="n0")


def discovery_cluster(path: Path) -> str | None:
    from nodeagent.config.cluster import ClusterConfig
    from nodeagent.config.raw import DEFAULT_CLUSTER_NAME, read_cluster_name

    assert ClusterConfig().name == DEFAULT_CLUSTER_NAME
    return read_cluster_name(path)


# ---- real agents, the CLI in a clean environment ---------------------------------------------------------------


class Agent:
    def __init__(self, home: Path, runtime: Path, port_var: str | None = None, config: Path | None = None,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        data = tiny_config(home)
        self.port = data["agent"]["api"]["listen"].rsplit(":", 1)[1]
        env = {**os.environ, discovery.ENV_RUNTIME_DIR: str(runtime), **(env or {})}
        if port_var:  # a ${VAR} the operator's shell does not have
            data["agent"]["api"]["listen"] = f"127.0.0.1:${{{port_var}}}"
            env[port_var] = self.port
        home.mkdir(parents=True, exist_ok=True)
        self.config = config or write_config(home / "config.yaml", data)
        self.path = runtime / "placeholder"
        with open(home / "agent.log", "wb") as log:
            self.proc = subprocess.Popen([str(BIN / "dsv4-agent"), "--config", str(self.config)], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.path = runtime / f"{self.proc.pid}.json"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    if discovery.DEFAULT_CONFIG.exists():
        pytest.skip(f"{discovery.DEFAULT_CONFIG} exists on this host: it comes before any running agent")
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            agent.stop()


def ctl(runtime: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), discovery.ENV_RUNTIME_DIR: str(runtime),
           **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}  # a worktree's code, not the install's
    return subprocess.run([str(BIN / "nodeagentctl"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_the_cli_finds_the_running_agent(agents: list[Agent], tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    agents.append(Agent(tmp_path / "one", runtime, port_var="ONE_API_PORT"))
    one = agents[0]
    wait_for("the agent's announcement", one.path.exists, 30)
    data = json.loads(one.path.read_text())
    assert (data["config"], data["api"], data["state_dir"]) == (str(one.config), f"127.0.0.1:{one.port}",
                                                                str(tmp_path / "one" / "state"))  # fmt: skip
    # No --config, no $DSV4_AGENT_CONFIG, and ${ONE_API_PORT} unset here: the announcement says where.
    out = wait_for("status", lambda: (r := ctl(runtime, "status", cwd=tmp_path)).returncode == 0 and r, 30)
    assert "node tiny" in out.stdout and "a " in out.stdout

    agents.append(Agent(tmp_path / "two", runtime))
    wait_for("the second announcement", agents[1].path.exists, 30)
    out = ctl(runtime, "status", cwd=tmp_path)
    assert out.returncode == cli.EXIT_USAGE and out.stderr.count("\n") == 1
    assert "2 agents run on this host" in out.stderr and "choose one with --config" in out.stderr
    assert f"pid {one.proc.pid}" in out.stderr and f"pid {agents[1].proc.pid}" in out.stderr
    assert ctl(runtime, "--config", str(agents[1].config), "status", cwd=tmp_path).returncode == 0

    assert one.stop() == 0 and not one.path.exists()  # withdrawn at exit
    out = ctl(runtime, "status", "--json", cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["agent"]["pid"] == agents[1].proc.pid
    assert agents[1].stop() == 0
    out = ctl(runtime, "status", cwd=tmp_path)
    assert out.returncode == cli.EXIT_CONFIG and out.stderr.count("\n") == 1
    assert "no agent config found; tried --config (not given)" in out.stderr
    assert f"agents announced in {runtime} (0 running)" in out.stderr


def test_node_picks_among_agents_sharing_one_file(agents: list[Agent], tmp_path: Path) -> None:
    """Two agents from one file, each told its node, port and folders by its environment (as a cluster file's
    `${DSV4_NODE_NAME}`): --node NAME picks the local agent of that node, with or without --config."""
    runtime = tmp_path / "run"
    data = tiny_config(tmp_path / "${SHARED_NODE}")
    data["cluster"]["name"] += "-${SHARED_NODE}"  # each agent's leftover cleanup matches its own children only
    data["node"]["name"] = "${SHARED_NODE}"
    data["agent"]["api"]["listen"] = "127.0.0.1:${SHARED_PORT}"
    del data["components"]["b"]
    shared = write_config(tmp_path / "shared.yaml", data)
    for node in ("n0", "n1"):
        agents.append(Agent(tmp_path / node, runtime, config=shared,
                            env={"SHARED_NODE": node, "SHARED_PORT": str(free_port())}))  # fmt: skip
    for agent in agents:
        wait_for("the announcement", agent.path.exists, 30)
    out = ctl(runtime, "status", cwd=tmp_path)
    assert out.returncode == cli.EXIT_USAGE and out.stderr.count("\n") == 1
    assert "2 agents run on this host" in out.stderr and "choose one with --node NAME (n0, n1)" in out.stderr
    out = ctl(runtime, "--config", str(shared), "status", cwd=tmp_path)  # the file alone cannot say which
    assert out.returncode == cli.EXIT_CONFIG and "${SHARED_NODE} is not set" in out.stderr
    for i, node in enumerate(("n0", "n1")):
        for args in (("--node", node), ("--config", str(shared), "--node", node)):
            out = ctl(runtime, *args, "status", "--json", cwd=tmp_path)
            assert out.returncode == 0, out.stderr
            status = json.loads(out.stdout)
            assert (status["node"]["name"], status["agent"]["pid"]) == (node, agents[i].proc.pid)
            assert "remote" not in status, "its own agent answered: a local status"
    out = ctl(runtime, "--node", "n1", "stop", "a", "--wait", "--timeout", "30", cwd=tmp_path)
    assert out.returncode == 0 and "a stopped" in out.stdout, out.stderr
    states = {node: json.loads(ctl(runtime, "--node", node, "status", "--json", cwd=tmp_path).stdout)
              ["components"]["a"]["desired"] for node in ("n0", "n1")}  # fmt: skip
    assert states == {"n0": "running", "n1": "stopped"}


def test_node_never_reaches_another_clusters_agent(agents: list[Agent], tmp_path: Path) -> None:
    """The window before run-local's agents are up: another stack's agent of the same node name listens on the API
    address our file names. `--config ours --node NAME` was answered by it (another cluster); now it is refused,
    naming that agent, and its own file still reaches it."""
    runtime = tmp_path / "run"
    agents.append(Agent(tmp_path / "theirs", runtime))
    theirs = agents[0]
    wait_for("their announcement", theirs.path.exists, 30)
    data = yaml.safe_load(theirs.config.read_text())
    data["cluster"]["name"] = "ours"
    data["agent"]["state_dir"] = str(tmp_path / "ours" / "state")
    ours = write_config(tmp_path / "ours.yaml", data)
    wait_for("their API", lambda: ctl(runtime, "--config", str(theirs.config), "--node", "tiny", "status",
                                      cwd=tmp_path).returncode == 0, 30)  # fmt: skip
    out = ctl(runtime, "--config", str(ours), "--node", "tiny", "status", cwd=tmp_path)
    assert out.returncode == cli.EXIT_CONFIG, out.stdout
    assert "no agent of node tiny with cluster ours and config" in out.stderr
    assert f"pid {theirs.proc.pid} (node tiny, cluster t" in out.stderr, out.stderr

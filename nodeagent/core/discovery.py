"""How `nodeagentctl` finds its agent: --config, $DSV4_AGENT_CONFIG, /etc/dsv4-agent/config.yaml, then an agent
running on this host that announced itself in a runtime folder.

A running agent writes one small JSON file, `<runtime>/dsv4-agent/agents/<pid>.json` (its config path, API
address, state and log dirs), once its API listens, and removes it at exit; a file whose pid is dead (or reused
by another process: the start time is compared) is stale and ignored. So on a dev box `nodeagentctl status`
works next to `scripts/run-local.sh` without --config. The announcement carries the values the agent resolved,
so `${VAR}`s in its config that the operator's shell does not set still lead to the right API.

The runtime folder: $DSV4_AGENT_RUNTIME_DIR if set (tests, several private stacks), else
$XDG_RUNTIME_DIR/dsv4-agent/agents, else /run/dsv4-agent/agents for root, else a per-user folder in /tmp. The CLI
also looks in /run/dsv4-agent/agents, where a root agent (systemd) announces itself to every operator. Only files
owned by the caller or root, in folders nobody else can write, are trusted: an announcement decides where the CLI
sends its token.

Standard library only: the CLI imports it whenever it has to find a config.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

ENV_CONFIG = "DSV4_AGENT_CONFIG"
ENV_RUNTIME_DIR = "DSV4_AGENT_RUNTIME_DIR"
DEFAULT_CONFIG = Path("/etc/dsv4-agent/config.yaml")
ROOT_DIR = Path("/run/dsv4-agent/agents")


class LookupFailed(Exception):
    """No config could be found (the message lists what was tried)."""


class SeveralAgents(LookupFailed):
    """More than one agent runs here and nothing says which one is meant."""


class Announcement(NamedTuple):
    """What a running agent says about itself (a NamedTuple, not a dataclass: `dataclasses` costs the CLI ~7 ms
    of imports)."""

    pid: int
    start_ticks: int | None
    """The process's start time in clock ticks since boot (/proc/PID/stat): a reused pid does not match."""
    config: str
    api: str
    unix_socket: str | None
    token_file: str
    state_dir: str
    log_dir: str
    node: str
    cluster: str | None = None
    """Its cluster's name (None: announced by an agent older than the field): `--node` never crosses clusters."""

    def describe(self) -> str:
        return f"pid {self.pid} (node {self.node}, cluster {self.cluster}, API {self.api}, config {self.config})"


class Located(NamedTuple):
    path: str
    source: str
    """"--config", "$DSV4_AGENT_CONFIG", "default" or "announced"."""
    agent: Announcement | None = None


def runtime_dir(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """Where an agent of this user announces itself."""
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    if env.get(ENV_RUNTIME_DIR):
        return Path(env[ENV_RUNTIME_DIR])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "dsv4-agent" / "agents"
    if uid == 0:
        return ROOT_DIR
    import tempfile  # only here: the CLI imports this module on its fast path

    return Path(tempfile.gettempdir()) / f"dsv4-agent-{uid}" / "agents"


def search_dirs(env: Mapping[str, str] | None = None, uid: int | None = None) -> list[Path]:
    """Where the CLI looks: this user's runtime folder, and root's (a systemd agent) unless overridden."""
    env = os.environ if env is None else env
    own = runtime_dir(env, uid)
    if env.get(ENV_RUNTIME_DIR) or own == ROOT_DIR:
        return [own]
    return [own, ROOT_DIR]


def start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat; None where it cannot be read (then only the pid is compared)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def is_running(agent: Announcement) -> bool:
    ticks = start_ticks(agent.pid)
    if ticks is not None:
        return agent.start_ticks is None or ticks == agent.start_ticks
    try:
        os.kill(agent.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the agent's side ----------------------------------------------------------------------------------------


def announce(directory: Path, agent: Announcement) -> Path:
    """Write `<pid>.json` atomically (and drop this user's stale ones); the caller removes it at exit."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    for stale in _read_dir(directory)[1]:
        with contextlib.suppress(OSError):
            stale.unlink()
    path = directory / f"{agent.pid}.json"
    tmp = directory / f".{agent.pid}.json.tmp"
    tmp.write_text(json.dumps(agent._asdict()), encoding="utf-8")
    tmp.chmod(0o644)
    os.replace(tmp, path)
    return path


def withdraw(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def this_agent(config: str, api: str, unix_socket: str | None, token_file: str, state_dir: str, log_dir: str,
               node: str, cluster: str | None = None) -> Announcement:  # fmt: skip
    pid = os.getpid()
    return Announcement(pid=pid, start_ticks=start_ticks(pid), config=str(Path(config).resolve()), api=api,
                        unix_socket=unix_socket, token_file=token_file, state_dir=state_dir, log_dir=log_dir,
                        node=node, cluster=cluster)  # fmt: skip


# ---- the CLI's side ------------------------------------------------------------------------------------------


def _trusted(st: os.stat_result, uid: int) -> bool:
    return st.st_uid in (uid, 0) and not st.st_mode & 0o022


def _parse(path: Path) -> Announcement | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Announcement(**{k: data.get(k) for k in Announcement._fields})
    except (OSError, ValueError, TypeError):
        return None


def _read_dir(directory: Path, uid: int | None = None) -> tuple[list[Announcement], list[Path], str]:
    """(running agents, stale files, a note for the error message)."""
    uid = os.getuid() if uid is None else uid
    try:
        if not _trusted(directory.stat(), uid):
            return [], [], "ignored: writable by others or owned by another user"
        entries = sorted(directory.glob("*.json"))
    except FileNotFoundError:
        return [], [], "no such folder"
    except OSError as exc:
        return [], [], exc.strerror or str(exc)
    running: list[Announcement] = []
    stale: list[Path] = []
    for path in entries:
        agent = _parse(path)
        try:
            trusted = _trusted(path.stat(), uid)
        except OSError:
            continue
        if not trusted or agent is None or not isinstance(agent.pid, int):
            continue
        if is_running(agent):
            running.append(agent)
        else:
            stale.append(path)
    note = f"{len(running)} running" + (f", {len(stale)} stale ignored" if stale else "")
    return running, stale, note


def running_agents(dirs: list[Path]) -> tuple[list[Announcement], list[str]]:
    """Every live announcement in `dirs` (one per pid) and, per folder, what was found there."""
    found: dict[int, Announcement] = {}
    notes = []
    for directory in dirs:
        running, _stale, note = _read_dir(directory)
        notes.append(f"agents announced in {directory} ({note})")
        for agent in running:
            found.setdefault(agent.pid, agent)
    return list(found.values()), notes


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _runs(agent: Announcement, config: str | None, cluster: str | None) -> bool:
    """Does this agent run that config file (if one is given) for that cluster (if it is known; an agent started
    before announcements named their cluster is judged by its file alone)?"""
    same_cluster = cluster is None or agent.cluster in (None, cluster)
    return (not config or _same_file(agent.config, config)) and same_cluster


def _pick_node(agents: list[Announcement], node: str, wanted: str | None, cluster: str | None) -> Located | None:
    """The agent of `node` that runs the wanted file and cluster; None: none here (the node is reached through the
    cluster). Several stacks on one host may each have a node of that name (run-local's n0 in two checkouts): an
    agent of another cluster or file is never chosen, and while one runs here the lookup refuses, naming it,
    rather than let the file's API address reach whatever listens there (it answered for the wrong cluster)."""
    named = [a for a in agents if a.node == node]
    mine = [a for a in named if _runs(a, wanted, cluster)]
    if len(mine) == 1:
        return Located(mine[0].config, "announced", mine[0])
    others = [a for a in named if a not in mine]
    listed = "; ".join(a.describe() for a in sorted(mine or others, key=lambda a: a.pid))
    if len(mine) > 1:
        raise SeveralAgents(f"{len(mine)} agents of node {node} run on this host: {listed} — choose one with "
                            "--config FILE")  # fmt: skip
    if others and not any(_runs(a, wanted, cluster) for a in agents):
        want = " and ".join(w for w in (f"cluster {cluster}" if cluster else "", f"config {wanted}" if wanted else "")
                            if w)  # fmt: skip
        raise LookupFailed(f"no agent of node {node} with {want} runs on this host; not chosen (another cluster or "
                           f"config): {listed}")  # fmt: skip
    return None


def locate_config(explicit: str | None, env: Mapping[str, str] | None = None, default: Path = DEFAULT_CONFIG,
                  dirs: list[Path] | None = None, node: str | None = None,
                  cluster: str | None = None) -> Located:  # fmt: skip
    """The config to use, in the order an operator expects; LookupFailed says what was tried or who runs.

    `node`: the agent of that node if one announced itself here, of `cluster` (the given config's cluster name,
    when the caller could read it) and running the given config, if one is given — several agents may share one
    cluster file, each told its node by its environment (`${DSV4_NODE_NAME}`); `_pick_node` refuses rather than
    cross clusters. A given config that exactly one running agent uses comes with that agent's announcement: its
    resolved API address and folders, so the CLI need not parse the file (nor know the agent's `${VAR}`s)."""
    env = os.environ if env is None else env
    agents, notes = running_agents(search_dirs(env) if dirs is None else dirs)
    if node:
        picked = _pick_node(agents, node, explicit or env.get(ENV_CONFIG), cluster)
        if picked is not None:
            return picked
    given = ((explicit, "--config") if explicit else (env[ENV_CONFIG], f"${ENV_CONFIG}") if env.get(ENV_CONFIG)
             else (str(default), "default") if default.exists() else None)  # fmt: skip
    if given is not None:
        # The agent running exactly this file (one only) answers for it: its API and folders as it resolved them.
        mine = [a for a in agents if _runs(a, given[0], cluster)]
        return Located(given[0], given[1], mine[0] if len(mine) == 1 else None)
    if len(agents) == 1:
        return Located(agents[0].config, "announced", agents[0])
    if agents:
        listed = "; ".join(a.describe() for a in sorted(agents, key=lambda a: a.pid))
        nodes = sorted({a.node for a in agents})
        configs = {a.config for a in agents}
        if len(nodes) == len(agents):  # the node names tell them apart (one cluster file for all, say)
            how = f"--node NAME ({', '.join(nodes)})" + (" or --config FILE" if len(configs) == len(agents) else "")
        else:
            how = "--config FILE"
        raise SeveralAgents(f"{len(agents)} agents run on this host: {listed} — choose one with {how}")
    tried = ["--config (not given)", f"${ENV_CONFIG} (not set)", f"{default} (no such file)", *notes]
    raise LookupFailed(f"no agent config found; tried {', '.join(tried)}: give --config FILE, or start the agent "
                       "(systemctl start dsv4-agent, or scripts/run-local.sh on a dev box)")


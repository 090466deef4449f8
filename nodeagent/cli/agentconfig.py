"""Which agent a command talks to and how: the config lookup, the `agent` section through the config's raw layer,
the full validated loader for commands that need the model (and for the exact error), and the HTTP client."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from nodeagent.cli import http
from nodeagent.cli.common import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_UNAUTHORISED,
    EXIT_UNKNOWN,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
    error_text,
)


def load_full(path: str, node: str | None = None, env: dict[str, str] | None = None) -> Any:
    """The validated config (the msgspec models), CliError(78) with file, line and key on error; `env` for its
    `${VAR}`s (default: this shell's)."""
    from nodeagent.config.load import load_config
    from nodeagent.core.errors import ConfigError

    try:
        return load_config(path, node=node, env=env)
    except ConfigError as exc:
        raise CliError(f"config error:\n{exc}", EXIT_CONFIG) from None


class LightConfig:
    """The agent's API address, token file and folders: what the agent-facing commands need."""

    __slots__ = ("listen", "log_dir", "path", "state_dir", "token_file", "unix_socket")

    def __init__(self, path: Path, listen: str, token_file: Path, unix_socket: Path | None, log_dir: Path,
                 state_dir: Path) -> None:  # fmt: skip
        self.path, self.listen, self.token_file, self.unix_socket = path, listen, token_file, unix_socket
        self.log_dir, self.state_dir = log_dir, state_dir

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


def read_light_config(path: str) -> LightConfig:
    """The `agent` section through the config's raw layer; when that cannot tell, the validated loader (which
    raises the exact error, or accepts the file and answers the same)."""
    from nodeagent.config.raw import read_agent_section
    from nodeagent.core.errors import ConfigError

    try:
        agent = read_agent_section(path)
    except (ConfigError, ValueError):
        config = load_full(path)
        agent = config.agent.api
        return LightConfig(Path(path), agent.listen, agent.token_file, agent.unix_socket, config.agent.log_dir,
                           config.agent.state_dir)  # fmt: skip
    return LightConfig(Path(path), agent.listen, agent.token_file, agent.unix_socket, agent.log_dir, agent.state_dir)


def locate(args: argparse.Namespace) -> tuple[str, Any]:
    """(config path, the announced agent or None): --config, $DSV4_AGENT_CONFIG, the default file, or an agent
    announced on this host (`nodeagent.core.discovery`: also the agent that runs the given file, if one does; with
    --node NAME, the local agent of that node if one runs). Found once per command."""
    if getattr(args, "located", None) is None:
        from nodeagent.core.discovery import ENV_CONFIG, LookupFailed, SeveralAgents, locate_config

        node, cluster = getattr(args, "node", None), None
        given = args.config or os.environ.get(ENV_CONFIG)
        if node and given:  # --node never picks an agent of another cluster (read only when it is asked for)
            from nodeagent.config.raw import read_cluster_name

            cluster = read_cluster_name(given)
        try:
            found = locate_config(args.config, node=node, cluster=cluster)
        except LookupFailed as exc:
            raise CliError(str(exc), EXIT_USAGE if isinstance(exc, SeveralAgents) else EXIT_CONFIG) from None
        args.located = (found.path, found.agent)
    return args.located


def is_local_node(args: argparse.Namespace) -> bool:
    """--node NAME picked the agent of NAME on this host (so the command is a local one)."""
    agent = locate(args)[1]
    return agent is not None and agent.node == getattr(args, "node", None)


def config_path(args: argparse.Namespace) -> str:
    return locate(args)[0]


def agent_environment(pid: int) -> dict[str, str] | None:
    """The environment a running agent was started with (/proc/PID/environ), None when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def full_config(args: argparse.Namespace, node: str | None = None) -> Any:
    """The config as the command's agent runs it: for a running agent of this host (no `node`, or its own), its
    `${VAR}`s from that agent's environment, not this shell's — one cluster file serves several local agents,
    each told its node and ports by variables (scripts/run-local.sh --cluster)."""
    path, agent = locate(args)
    if agent is not None and node in (None, agent.node):
        env = agent_environment(agent.pid)
        if env is not None:
            return load_full(path, agent.node, env)
    return load_full(path, node)


def light_config(args: argparse.Namespace) -> LightConfig:
    """The light view; for an announced agent its own answers (API, dirs) win over what this shell's
    environment makes of `${VAR}`s in its config — and stand alone when this shell cannot read it."""
    path, agent = locate(args)
    if agent is None:
        return read_light_config(path)
    return LightConfig(Path(path), agent.api, Path(agent.token_file),
                       Path(agent.unix_socket) if agent.unix_socket else None, Path(agent.log_dir),
                       Path(agent.state_dir))  # fmt: skip


UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")


def systemd_runs_agent(root: Path = Path("/"), unit: str = "dsv4-agent") -> bool:
    """systemd is PID 1 here and the agent's unit is installed (scripts/install.sh): only then is `systemctl`
    the way to look at it."""
    if not (root / "run/systemd/system").is_dir():
        return False
    return any((root / d.lstrip("/") / f"{unit}.service").exists() for d in UNIT_DIRS)


def agent_down_hint(config: Path, systemd: bool, unit: str = "dsv4-agent") -> str:
    """Where to look, or how to start it, for the agent this host actually runs."""
    if systemd:
        return f"systemctl status {unit}; journalctl -u {unit} -n 50"
    return f"no {unit} unit here: start it with `dsv4-agent --config {config}`"


class Client:
    """HTTP/1.1 to the agent: the unix socket if configured and present (no token needed as root), else TCP."""

    def __init__(self, light: LightConfig, timeout: float = 10.0) -> None:
        self.light = light
        self.timeout = timeout
        sock = light.unix_socket
        self.unix = sock if sock is not None and sock.exists() else None
        self.address = f"unix:{self.unix}" if self.unix else f"http://{light.listen}"

    def _token(self) -> str | None:
        try:
            return self.light.token_file.read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """(status, parsed JSON); CliError(3) naming the address if the agent does not answer."""
        headers = {"Accept": "application/json"}
        payload = None
        if method == "POST":
            token = self._token()
            if token:
                headers["Authorization"] = f"Bearer {token}"
            payload = json.dumps(body or {}).encode()
            headers["Content-Type"] = "application/json"
        host = "localhost" if self.unix else self.light.host
        port = 80 if self.unix else self.light.port
        try:
            status, raw = http.request(host, port, method, path, payload, headers, self.timeout,
                                       str(self.unix) if self.unix else None)  # fmt: skip
        except (OSError, http.BadResponse) as exc:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise CliError(f"agent unreachable at {self.address}: {reason} (is dsv4-agent running? "
                           f"{agent_down_hint(self.light.path, systemd_runs_agent())})",
                           EXIT_UNREACHABLE) from None  # fmt: skip
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = raw.decode(errors="replace")
        return status, data

    def get(self, path: str) -> Any:
        status, data = self.request("GET", path)
        if status != 200:
            raise CliError(f"GET {path}: {error_text(data, status)}")
        return data

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        status, data = self.request("POST", path, body)
        if status in (200, 202):
            return data
        text = error_text(data, status)
        if status == 401:
            hint = "" if self._token() else f" (cannot read the token file {self.light.token_file}: run as root?)"
            raise CliError(f"unauthorised: {text}{hint}", EXIT_UNAUTHORISED)
        if status == 404 and (path.startswith("/components/") or path == "/reset"):
            raise CliError(text, EXIT_UNKNOWN)
        if status == 400 and path == "/reload":
            raise CliError(text, EXIT_CONFIG)
        raise CliError(text, EXIT_USAGE if status == 400 else EXIT_FAILED)


def connect(args: argparse.Namespace, timeout: float = 10.0) -> Client:
    return Client(light_config(args), timeout)

"""`nodeagentctl`: the operator's command line for the dsv4-agent on this node.

Imports stay light so it answers fast: HTTP with the standard library (http.client), and the commands that
talk to the agent read only the `agent` section and the vLLM ports of the config with PyYAML
(`LightConfig`), not the pydantic model (~250 ms to import). Only `render`, `config validate` and `probe`,
which need the full model, load it — and so does any command when the light read fails, to report the exact
config error.

Exit codes: 0 ok, 1 action failed, 2 usage, 3 agent unreachable, 4 unknown component, 5 unauthorised,
78 bad config or none found; `bench`: vllm bench's own code, 69 no `vllm` here, 73 --output-dir not writable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nodeagent import __version__
from nodeagent.parsing import fraction, positive_int, positive_number, positive_seconds, split_listen

DEFAULT_CONFIG = "/etc/dsv4-agent/config.yaml"
EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_UNKNOWN, EXIT_UNAUTHORISED, EXIT_CONFIG = 1, 2, 3, 4, 5, 78
# The ApiConfig / AgentSettings defaults, repeated so the light reader needs no pydantic (a test keeps them equal).
DEFAULT_LISTEN = "127.0.0.1:18700"
DEFAULT_TOKEN_FILE = "/etc/dsv4-agent/token"
DEFAULT_LOG_DIR = "/var/log/dsv4-agent"
DEFAULT_STATE_DIR = "/var/lib/dsv4-agent"
DEFAULT_VLLM_PORT = 8080
DEFAULT_UNIT = "dsv4-agent"
DEFAULT_WAIT_S = 1800.0
"""`--wait` default: DeepSeek-V4 takes up to half an hour to load."""
UP_STATES = ("running", "ready")
NODE_COMMANDS = ("status", "render", "config", "start", "stop", "restart")
"""Commands that take --node NAME (another member of the cluster)."""


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def _load(path: str, node: str | None = None):  # type: ignore[no-untyped-def]
    from nodeagent.config import load_config
    from nodeagent.errors import ConfigError

    try:
        return load_config(path, node=node)
    except ConfigError as exc:
        raise CliError(f"config error:\n{exc}", EXIT_CONFIG) from None


# ---- the light config view -----------------------------------------------------------------------------------

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\$")


class _Unreadable(Exception):
    """The light reader cannot tell; the full loader will say exactly what is wrong."""


def _interpolate(value: Any) -> Any:
    """`${VAR}` / `${VAR:-default}` / `$$` as `nodeagent.config` does, for the few scalars read here."""
    if not isinstance(value, str) or "$" not in value:
        return value

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise _Unreadable(f"${{{name}}} not set")
        return default

    return _VAR.sub(sub, value)


@dataclass(frozen=True)
class LightConfig:
    """What the agent-facing commands need from the config, read without validating the rest."""

    path: Path
    listen: str = DEFAULT_LISTEN
    token_file: Path = Path(DEFAULT_TOKEN_FILE)
    unix_socket: Path | None = None
    log_dir: Path = Path(DEFAULT_LOG_DIR)
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    vllm: dict[str, str] = field(default_factory=dict)
    """vLLM component → its /metrics URL."""
    components: tuple[str, ...] = ()

    @property
    def host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return split_listen(self.listen)[1]


def _section(data: Any, key: str) -> dict[str, Any]:
    value = data.get(key) if isinstance(data, dict) else None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Unreadable(f"{key} is not a mapping")
    return value


def _path(value: Any, base: Path, default: str) -> Path:
    value = _interpolate(value) if value is not None else default
    if not isinstance(value, str) or not value:
        raise _Unreadable("not a path")
    path = Path(value).expanduser()
    return Path(os.path.normpath(path if path.is_absolute() else base / path))


def read_light_config(path: str) -> LightConfig:
    """The API address, token file, log folder and vLLM ports; on anything odd, the full loader's error."""
    try:
        return _read_light(Path(path).expanduser())
    except (_Unreadable, OSError, ValueError, TypeError, AttributeError):
        _load(path)  # raises CliError(78) with the file, line and key, as the agent would
        # The full model accepts what the light reader could not: use it (slow path, same answers).
        return _light_from_model(path)


def _read_light(path: Path) -> LightConfig:
    import yaml

    text = path.read_text(encoding="utf-8")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        raise _Unreadable(str(exc)) from None
    if data is None:
        data = {}
    base = path.resolve().parent
    if _section(data, "cluster").get("nodes"):
        raise _Unreadable("a cluster file: what this member runs needs the full loader")
    agent = _section(data, "agent")
    api = _section(agent, "api")
    listen = str(_interpolate(api.get("listen", DEFAULT_LISTEN)))
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise _Unreadable("listen")
    socket_raw = api.get("unix_socket")
    components = _section(data, "components")
    node_role = _interpolate(_section(data, "node").get("role", "master"))
    vllm, names = {}, []
    for name, comp in components.items():
        if not isinstance(comp, dict):
            raise _Unreadable(f"component {name}")
        kind = _interpolate(comp.get("kind"))
        enabled = _interpolate(comp.get("enabled", True))
        disabled = enabled is False or str(enabled).lower() in ("false", "no", "off", "0")
        if disabled or (kind == "etcd" and node_role != "master"):
            continue
        names.append(str(name))
        if kind == "vllm":
            bind = _interpolate(comp.get("host"))
            h = "127.0.0.1" if bind in (None, "", "0.0.0.0", "::") else str(bind)
            h = f"[{h}]" if ":" in h else h
            vllm[str(name)] = f"http://{h}:{int(_interpolate(comp.get('port', DEFAULT_VLLM_PORT)))}/metrics"
    return LightConfig(
        path=path,
        listen=listen,
        token_file=_path(api.get("token_file"), base, DEFAULT_TOKEN_FILE),
        unix_socket=_path(socket_raw, base, "") if socket_raw is not None else None,
        log_dir=_path(agent.get("log_dir"), base, DEFAULT_LOG_DIR),
        state_dir=_path(agent.get("state_dir"), base, DEFAULT_STATE_DIR),
        vllm=vllm,
        components=tuple(names),
    )


def _light_from_model(path: str) -> LightConfig:
    from nodeagent.metrics import vllm_metrics_urls

    config = _load(path)
    api, active = config.agent.api, config.active_components()
    return LightConfig(path=Path(path), listen=api.listen, token_file=api.token_file, unix_socket=api.unix_socket,
                       log_dir=config.agent.log_dir, state_dir=config.agent.state_dir,
                       vllm=vllm_metrics_urls(active), components=tuple(active))  # fmt: skip


# ---- talking to the agent ------------------------------------------------------------------------------------


class Client:
    """HTTP/1.1 to the agent: the unix socket if configured and present (no token needed as root), else TCP."""

    def __init__(self, light: LightConfig, timeout: float = 10.0) -> None:
        self.light = light
        self.timeout = timeout
        sock = light.unix_socket
        self.unix = sock if sock is not None and sock.exists() else None
        self.address = f"unix:{self.unix}" if self.unix else f"http://{light.listen}"

    def _connection(self):  # type: ignore[no-untyped-def]
        import http.client
        import socket

        if self.unix is None:
            return http.client.HTTPConnection(self.light.host, self.light.port, timeout=self.timeout)
        path = str(self.unix)

        class UnixConnection(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(self.timeout)
                self.sock.connect(path)

        return UnixConnection("localhost", timeout=self.timeout)

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
        import http.client

        conn = self._connection()
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise CliError(f"agent unreachable at {self.address}: {reason} (is dsv4-agent running? "
                           "systemctl status dsv4-agent)", EXIT_UNREACHABLE) from None  # fmt: skip
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = raw.decode(errors="replace")
        return response.status, data

    def get(self, path: str) -> Any:
        status, data = self.request("GET", path)
        if status != 200:
            raise CliError(f"GET {path}: {_error_text(data, status)}")
        return data

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        status, data = self.request("POST", path, body)
        if status in (200, 202):
            return data
        text = _error_text(data, status)
        if status == 401:
            hint = "" if self._token() else f" (cannot read the token file {self.light.token_file}: run as root?)"
            raise CliError(f"unauthorised: {text}{hint}", EXIT_UNAUTHORISED)
        if status == 404 and (path.startswith("/components/") or path == "/reset"):
            raise CliError(text, EXIT_UNKNOWN)
        if status == 400 and path == "/reload":
            raise CliError(text, EXIT_CONFIG)
        raise CliError(text, EXIT_USAGE if status == 400 else EXIT_FAILED)


def _error_text(data: Any, status: int) -> str:
    if isinstance(data, dict) and "error" in data:
        return str(data["error"])
    return f"HTTP {status}: {str(data)[:200]}"


def config_path(args: argparse.Namespace) -> str:
    """--config, $DSV4_AGENT_CONFIG, the default file, or the one agent announced on this host
    (`nodeagent.discovery`); found once per command."""
    if getattr(args, "located", None) is None:
        from nodeagent.discovery import LookupFailed, SeveralAgents, locate_config

        try:
            args.located = locate_config(args.config)
        except LookupFailed as exc:
            raise CliError(str(exc), EXIT_USAGE if isinstance(exc, SeveralAgents) else EXIT_CONFIG) from None
    return str(args.located.path)


def light_config(args: argparse.Namespace) -> LightConfig:
    """The light view; for an announced agent its own answers (API, dirs) win over what this shell's
    environment makes of `${VAR}`s in its config — and stand alone when this shell cannot read it."""
    path = config_path(args)
    agent = args.located.agent
    if agent is None:
        return read_light_config(path)
    try:
        light = read_light_config(path)
    except CliError:
        light = LightConfig(path=Path(path))
    return replace(light, listen=agent.api, token_file=Path(agent.token_file), log_dir=Path(agent.log_dir),
                   state_dir=Path(agent.state_dir), unix_socket=Path(agent.unix_socket) if agent.unix_socket
                   else None)  # fmt: skip


def _client(args: argparse.Namespace) -> Client:
    return Client(light_config(args))


# ---- status --------------------------------------------------------------------------------------------------


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _last_exit(exit_info: dict[str, Any] | None, now: float) -> str:
    if not exit_info:
        return "-"
    text = str(exit_info.get("reason") or exit_info.get("code") or "?")
    text = text if len(text) <= 48 else text[:47] + "…"
    at = exit_info.get("at")
    return f"{human_duration(now - at)} ago: {text}" if isinstance(at, int | float) else text


def _note(comp: dict[str, Any]) -> str:
    notes = []
    if comp.get("desired") == "stopped":
        notes.append("desired stopped")
    if comp.get("backoff_remaining_s"):
        notes.append(f"retry in {human_duration(comp['backoff_remaining_s'])}")
    if comp.get("held"):
        notes.append(str(comp["held"]))
    failure = comp.get("failure") or {}
    if comp.get("state") == "failed" and failure:
        notes.append(f"failed: {failure.get('permanent') or failure.get('detail')}")
        last = next((line for line in reversed(failure.get("output_tail") or []) if line.strip()), None)
        if last and last not in notes[-1]:
            notes.append(f"last output: {last[:100]}")
    policy = comp.get("policy") or {}
    if policy.get("crash_loop"):
        notes.append("crash loop")
    return "; ".join(notes)


def format_mqtt(mqtt: dict[str, Any], now: float) -> str:
    """`mqtt: connected to mqtt://h:1883 · queued 0 · dropped 0` or `mqtt: DISCONNECTED from ...: <error> · ...`."""
    if mqtt.get("connected"):
        since = mqtt.get("connected_since")
        link = f"connected to {mqtt.get('broker')}" + (f" for {human_duration(now - since)}" if since else "")
    else:
        link = f"DISCONNECTED from {mqtt.get('broker')}: {mqtt.get('last_error') or 'connecting'}"
    return f"mqtt: {link} · queued {mqtt.get('queued', 0)} · dropped {mqtt.get('dropped', 0)}"


def format_status(data: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    node, agent = data.get("node", {}), data.get("agent", {})
    head = (f"node {node.get('name')} ({node.get('role')}) · cluster {node.get('cluster')} · agent "
            f"{agent.get('version', '?')} pid {agent.get('pid', '?')} up {human_duration(agent.get('uptime_s'))}")
    flags = []
    if data.get("paused"):
        flags.append("PAUSED (no automatic restarts)")
    if data.get("redeploying"):
        flags.append("REDEPLOYING")
    policy = data.get("node_policy") or {}
    if policy.get("failed"):
        flags.append(f"NODE FAILED: {policy.get('failed_reason')}")
    if agent.get("stopping"):
        flags.append("AGENT STOPPING")
    if data.get("mqtt"):
        flags.append(format_mqtt(data["mqtt"], now))
    rows = [("COMPONENT", "STATE", "PID", "READY", "RESTARTS", "UPTIME", "LAST EXIT", "NOTE")]
    for name, comp in data.get("components", {}).items():
        rows.append((name, str(comp.get("state")), str(comp.get("pid") or "-"), "yes" if comp.get("ready") else "no",
                     str(comp.get("restarts", 0)), human_duration(comp.get("uptime_s")),
                     _last_exit(comp.get("last_exit"), now), _note(comp)))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, *flags, ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    node = getattr(args, "node", None)
    data = client.get("/status")
    if node and node != (data.get("node") or {}).get("name"):
        return _remote_status(client, node, args.json)
    print(json.dumps(data, indent=2) if args.json else format_status(data))
    return 0


def _cluster_view(client: Client) -> dict[str, Any]:
    status, data = client.request("GET", "/cluster")
    if status == 404:
        raise CliError(f"{_error_text(data, status)}: --node and cluster need cluster.nodes", EXIT_USAGE)
    if status != 200:
        raise CliError(f"GET /cluster: {_error_text(data, status)}")
    return data  # type: ignore[no-any-return]


def _remote_status(client: Client, node: str, as_json: bool) -> int:
    """Another member's status: from its own API when it answers, else what its member key says (and why)."""
    from nodeagent.clustercmd import format_member_status, remote_status

    try:
        source, data, reason = remote_status(_cluster_view(client), node)
    except KeyError as exc:
        raise CliError(str(exc.args[0]), EXIT_UNKNOWN) from None
    if as_json:
        print(json.dumps({"source": source, "reason": reason, **({"status": data} if source == "api" else
                                                                 {"member": data})}, indent=2))  # fmt: skip
    elif source == "api":
        print(format_status(data))
    else:
        print(format_member_status(data, reason or ""))
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    from nodeagent.clustercmd import format_cluster

    client = _client(args)
    action = args.cluster_action
    if action in ("pause", "resume", "redeploy", "restart"):
        body: dict[str, Any] = {}
        if action in ("pause", "redeploy", "restart") and args.reason:
            body["reason"] = args.reason
        if action == "restart":
            body["component"] = args.target or "vllm"
            if args.group:
                body["group"] = args.group
            if args.no_drain:
                body["drain"] = False
        status, data = client.request("POST", f"/cluster/{action}", body)
        if status == 404:
            raise CliError(_error_text(data, status), EXIT_UNKNOWN if action == "restart" else EXIT_USAGE)
        if status == 503:
            raise CliError(_error_text(data, status), EXIT_UNREACHABLE)
        if status not in (200, 202):
            raise CliError(_error_text(data, status), EXIT_USAGE if status == 400 else EXIT_FAILED)
        if action == "restart":
            for group, what in (data.get("groups") or {}).items():
                print(f"group {group}: {what} — every rank restarts once")
        elif action == "redeploy":
            print(f"cluster redeploy {data.get('id')}: " + ("already in progress" if data.get("already_in_progress")
                                                             else "asked; every node takes part"))  # fmt: skip
        else:
            print(f"cluster {action}: done" + (" (no agent takes automatic actions now)" if action == "pause" else ""))
        return 0
    view = _cluster_view(client)
    print(json.dumps(view, indent=2) if args.json else format_cluster(view))
    return 0


# ---- actions -------------------------------------------------------------------------------------------------


def _components(client: Client) -> dict[str, Any]:
    return client.get("/status")["components"]


def _wait(client: Client, what: str, done: Any, timeout: float, interval: float = 0.5) -> dict[str, Any]:
    """Poll /status until done(status) returns a message (success) or raises CliError (failure)."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        status = client.get("/status")
        message = done(status)
        if message:
            return {"message": message}
        summary = ", ".join(f"{n} {c['state']}" for n, c in status["components"].items())
        if summary != last:
            print(f"  … {summary}", file=sys.stderr)
            last = summary
        if time.monotonic() >= deadline:
            raise CliError(f"timed out after {timeout:g}s waiting for {what} ({summary})")
        time.sleep(interval)


SETTLE_S = 1.0
"""`--wait` reports a start or restart done once the new process has been seen up this long."""


def _component_waiter(name: str, action: str, before: dict[str, Any]) -> Any:
    old_pid = before.get("pid")
    seen = {"moved": False}
    up_since: dict[Any, float] = {}
    """pid → when it was first seen up"""

    def done(status: dict[str, Any]) -> str | None:
        comp = status["components"][name]
        state, pid = comp["state"], comp["pid"]
        if action == "stop":
            # No process and none coming: a component stopped during its backoff keeps showing `backoff`.
            gone = pid is None and comp.get("desired") == "stopped" and state in ("stopped", "backoff", "failed")
            return f"{name} stopped" if gone else None
        moved = state in ("stopping", "stopped", "starting") or (pid is not None and pid != old_pid)
        seen["moved"] = seen["moved"] or moved
        if state == "failed" or (state == "backoff" and (seen["moved"] or action == "start")):
            reason = (comp.get("last_exit") or {}).get("reason") or (comp.get("policy") or {}).get("last_reason")
            raise CliError(f"{name} {action} failed: {state} ({reason or 'see nodeagentctl logs ' + name})")
        if state in UP_STATES and (action == "start" or (pid is not None and pid != old_pid)):
            # Up is only proven once it stays up: a component without a startup probe is "ready" the moment it
            # forks, and one that exits with an error a few ms later must not be reported as restarted.
            first = up_since.setdefault(pid, time.monotonic())
            if time.monotonic() - first < SETTLE_S:
                return None
            was = f", was {old_pid}" if action == "restart" else ""
            return f"{name} {state} (pid {pid}{was})"
        return None

    return done


def _remote_component(client: Client, args: argparse.Namespace) -> int:
    """Another node's start/stop/restart, carried through etcd by the local agent; its agent's answer."""
    body = {"drain": False} if getattr(args, "no_drain", False) else {}
    status, data = client.request("POST", f"/cluster/nodes/{args.node}/components/{args.component}/{args.action}",
                                  body)  # fmt: skip
    if status == 401:
        raise CliError(f"unauthorised: {_error_text(data, status)}", EXIT_UNAUTHORISED)
    if status == 404:
        raise CliError(_error_text(data, status), EXIT_UNKNOWN)
    if status == 503:
        raise CliError(_error_text(data, status), EXIT_UNREACHABLE)
    if not isinstance(data, dict) or "message" not in data:
        raise CliError(_error_text(data, status))
    code = int(data.get("code", 0 if status == 200 else EXIT_FAILED))
    print(data["message"], file=sys.stdout if code == 0 else sys.stderr)
    return code


def cmd_component(args: argparse.Namespace) -> int:
    client = _client(args)
    if getattr(args, "node", None):
        return _remote_component(client, args)
    before = None
    if args.wait:
        comps = _components(client)
        if args.component not in comps:
            raise CliError(f"unknown component {args.component!r} (this node runs: {', '.join(comps)})",
                           EXIT_UNKNOWN)  # fmt: skip
        before = comps[args.component]
    body = {"drain": False} if getattr(args, "no_drain", False) else None
    answer = client.post(f"/components/{args.component}/{args.action}", body)
    message = answer.get("message") if isinstance(answer, dict) else None
    if message == f"{args.action} {args.component}":
        message = None
    if before is None:
        print(f"{args.action} {args.component}: accepted" + (f" — {message}" if message else ""))
        return 0
    began = time.monotonic()
    result = _wait(client, f"{args.component} to {args.action}", _component_waiter(args.component, args.action, before),
                   args.timeout)  # fmt: skip
    print(f"{result['message']} after {time.monotonic() - began:.1f}s")
    return 0


def cmd_redeploy(args: argparse.Namespace) -> int:
    client = _client(args)
    before = _components(client) if args.wait else {}
    data = client.post("/redeploy", {"reason": args.reason} if args.reason else None)
    note = " (one was already in progress)" if data.get("already_in_progress") else ""
    print(f"redeploy: accepted{note}")
    if not args.wait:
        return 0
    old = {n: c["pid"] for n, c in before.items()}

    def done(status: dict[str, Any]) -> str | None:
        if status.get("redeploying"):
            return None
        comps = status["components"]
        failed = [n for n, c in comps.items() if c["state"] == "failed"]
        if failed:
            raise CliError(f"redeploy failed: {', '.join(failed)} failed")
        wanted = {n: c for n, c in comps.items() if c.get("desired") == "running"}
        if all(c["state"] in UP_STATES and c["pid"] not in (None, old.get(n)) for n, c in wanted.items()):
            return "redeploy done: " + ", ".join(f"{n} {c['state']} (pid {c['pid']})" for n, c in wanted.items())
        return None

    began = time.monotonic()
    result = _wait(client, "the redeploy", done, args.timeout)
    print(f"{result['message']} after {time.monotonic() - began:.1f}s")
    return 0


def cmd_simple(args: argparse.Namespace) -> int:
    client = _client(args)
    action = args.command
    body = {"component": args.component} if action == "reset" and args.component else None
    data = client.post(f"/{action}", body)
    if action == "reload":
        print(f"reload: restarted {', '.join(data.get('restarted', [])) or 'nothing'}")
    elif action == "detach":
        print("detach: the agent exits leaving the stack running; the next agent adopts it")
    elif action == "reset":
        print(f"reset: restart counters cleared ({args.component or 'all components and the node state'})")
    else:
        print(f"{action}: done")
    return 0


def cmd_npu(args: argparse.Namespace) -> int:
    """NPU health as the agent sees it, or an override of the faults holding vLLM."""
    client = _client(args)
    if args.npu_command == "override":
        answer = client.post("/npu/override", {} if args.npu is None else {"npu": args.npu})
        done = answer.get("overridden") or []
        if not done:
            print("npu override: no fault was holding vLLM" + (f" on npu {args.npu}" if args.npu is not None else ""))
        for fault in done:
            print(f"npu override: {fault.get('message')}")
        return 0
    npu = client.get("/status").get("npu") or {}
    if args.json:
        print(json.dumps(npu, indent=2))
        return 0
    if not npu.get("checked"):
        print(f"NPU health not checked: {npu.get('skipped')}")
        return 0
    start = npu.get("start") or {}
    print("vLLM may start" if start.get("allowed") else "vLLM start HELD: " + "; ".join(start.get("reasons") or []))
    for chip in npu.get("npus") or []:
        print(f"npu {chip['npu']} chip {chip['chip']} {chip['name']}: health {chip['health']}, HBM "
              f"{chip['hbm_used_mb']}/{chip['hbm_total_mb']} MB, link {chip.get('link') or '-'}")
    for fault in npu.get("faults") or []:
        flag = ", overridden" if fault.get("overridden") else ""
        print(f"fault: {fault.get('message')} ({fault.get('level')}{flag})")
    return 0


def cmd_postmortem(args: argparse.Namespace) -> int:
    """The failure bundles under state_dir/postmortem (read from disk: works while the agent is down)."""
    from nodeagent.postmortem import list_bundles, read_bundle

    root = light_config(args).state_dir / "postmortem"
    if args.pm_command == "show":
        if not args.bundle:
            raise CliError("postmortem show needs a bundle id (nodeagentctl postmortem list)", EXIT_USAGE)
        try:
            manifest, output = read_bundle(root, args.bundle)
        except KeyError as exc:
            raise CliError(str(exc.args[0]), EXIT_UNKNOWN) from None
        if args.json:
            print(json.dumps({**manifest, "output": output}, indent=2, default=str))
            return 0
        failure = manifest.get("failure") or {}
        print(f"{manifest['component']} ({manifest['kind']}) failed {time.ctime(manifest['at'])}: "
              f"{failure.get('permanent') or failure.get('detail')}")
        print(f"next: {manifest.get('decision')}")
        print(f"command: {' '.join((manifest.get('command') or {}).get('argv') or [])[:300]}")
        for proc in manifest.get("tree") or []:
            print(f"  pid {proc.get('pid')} ({proc.get('status', '?')}): {proc.get('cmdline', '')[:120]}")
        for name, size in (manifest.get("cores") or {}).items():
            print(f"core dump: {name} ({size} bytes)")
        print(f"files: {', '.join(manifest.get('files') or [])}")
        print("--- last output ---")
        print("\n".join(output.splitlines()[-args.lines:]))
        return 0
    bundles = list_bundles(root)
    if args.json:
        print(json.dumps(bundles, indent=2))
        return 0
    if not bundles:
        print(f"no post-mortems in {root}")
    for b in bundles:
        print(f"{b['id']}  {b['component']:<12} {b['bytes'] / 1024:8.1f} KiB  {b['path']}")
    return 0


# ---- logs ----------------------------------------------------------------------------------------------------


def tail_lines(path: Path, n: int) -> tuple[list[bytes], int]:
    """The last n lines of a file and the offset where following should continue."""
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        if n <= 0:
            return [], end
        block, data, pos = 64 * 1024, b"", end
        while pos > 0 and data.count(b"\n") <= n:
            step = min(block, pos)
            pos -= step
            fh.seek(pos)
            data = fh.read(step) + data
        lines = data.splitlines(keepends=True)
        return lines[-n:], end


def follow(path: Path, offset: int, out: Any, interval: float = 0.25, until: float | None = None) -> None:
    """Print what is appended to `path`; after copytruncate (size below our offset) start again from the top,
    and reopen when the file is replaced. `until` (monotonic) bounds it, for tests."""
    fh = open(path, "rb")  # noqa: SIM115 - reopened on rotation
    try:
        fh.seek(offset)
        inode = os.fstat(fh.fileno()).st_ino
        while until is None or time.monotonic() < until:
            chunk = fh.read(64 * 1024)
            if chunk:
                out.write(chunk)
                out.flush()
                continue
            try:
                st = os.stat(path)
            except FileNotFoundError:
                time.sleep(interval)
                continue
            if st.st_ino != inode:
                fh.close()
                fh = open(path, "rb")  # noqa: SIM115
                inode = os.fstat(fh.fileno()).st_ino
            elif st.st_size < fh.tell():
                fh.seek(0)  # truncated in place (copytruncate)
            else:
                time.sleep(interval)
    finally:
        fh.close()


def _log_source(args: argparse.Namespace, light: LightConfig) -> tuple[str, Path]:
    """("own"|"journal"|"file", folder or file): the component's own log file if it writes one (the datasystem
    worker), else where the agent sends children's output; without the agent, guess from disk."""
    client = Client(light, timeout=2.0)
    try:
        status = client.get("/status")
    except CliError as exc:
        if exc.code != EXIT_UNREACHABLE:
            raise
        if args.component not in light.components:
            raise CliError(f"unknown component {args.component!r} (config has: {', '.join(light.components)})",
                           EXIT_UNKNOWN) from None  # fmt: skip
        path = light.log_dir / f"{args.component}.log"
        if path.exists() or not _which("journalctl"):
            return "file", light.log_dir
        return "journal", light.log_dir
    if args.component not in status["components"]:
        raise CliError(f"unknown component {args.component!r} (this node runs: {', '.join(status['components'])})",
                       EXIT_UNKNOWN)  # fmt: skip
    own = [Path(p) for p in status["components"][args.component].get("log_files") or []]
    if args.source in ("auto", "own") and own and own[0].exists():
        return "own", own[0]
    if args.source == "own":
        raise CliError(f"{args.component} writes no log file of its own here ({', '.join(map(str, own)) or 'none'})")
    agent = status.get("agent", {})
    return ("journal" if agent.get("journal") else "file"), Path(agent.get("log_dir") or light.log_dir)


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def cmd_logs(args: argparse.Namespace) -> int:
    light = light_config(args)
    explicit = args.source in ("journal", "file")
    source, log_dir = (args.source, light.log_dir) if explicit else _log_source(args, light)
    if source == "journal":
        argv = ["journalctl", "-u", args.unit, "-t", args.component, "-n", str(args.lines), "--no-pager"]
        if args.follow:
            argv.append("-f")
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            raise CliError(f"cannot run journalctl: {exc}") from None
    path = log_dir if source == "own" else log_dir / f"{args.component}.log"
    if source == "own":
        print(f"==> {path} <==  (its launcher's output: --source file|journal)", file=sys.stderr)
    try:
        lines, offset = tail_lines(path, args.lines)
    except FileNotFoundError:
        raise CliError(f"no log file {path} (has {args.component} run on this node yet?)") from None
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    out = sys.stdout.buffer
    out.writelines(lines)
    out.flush()
    if args.follow:
        follow(path, offset, out)
    return 0


# ---- cache, probe, render, config --------------------------------------------------------------------------------


def cmd_cache(args: argparse.Namespace) -> int:
    from nodeagent.cachewatch import run_cache

    url = args.url
    if url is None:
        light = light_config(args)
        if not light.vllm:
            raise CliError(f"no vllm component in {light.path}: give the metrics URL with --url", EXIT_USAGE)
        url = next(iter(light.vllm.values()))
    return run_cache(url, watch=args.watch, interval=args.interval, output=args.output, as_json=args.as_json)


def cmd_bench(args: argparse.Namespace) -> int:
    from nodeagent.benchcmd import BenchError, run_from_args

    try:
        return run_from_args(args, lambda: _load(config_path(args)))
    except BenchError as exc:
        raise CliError(str(exc), exc.code) from None


def cmd_probe(args: argparse.Namespace) -> int:
    from nodeagent.probecmd import probe_targets, run_probe

    config = _load(config_path(args))
    role = args.role or ("master" if config.node.role == "master" else "slave")
    return run_probe(probe_targets(config), role, args.timeout)


def cmd_preflight(args: argparse.Namespace) -> int:
    from nodeagent.preflight import run_preflight

    config = _load(config_path(args))
    peers = None
    if config.cluster.nodes:  # peers as the running agent sees them through etcd (none when it is not running)
        from nodeagent.consistency import preflight_peers

        try:
            status, view = Client(light_config(args), timeout=3.0).request("GET", "/cluster")
        except CliError:
            status, view = 0, None
        if status == 200 and isinstance(view, dict):
            peers = preflight_peers(view, time.time())
    report = run_preflight(config, peers=peers)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return EXIT_FAILED if report.failed else 0


def cmd_render(args: argparse.Namespace) -> int:
    from nodeagent.launcher import base_environment
    from nodeagent.render import render_component

    config = _load(config_path(args), args.node)
    names = [args.component] if args.component else list(config.active_components())
    if args.component and args.component not in config.components:
        known = ", ".join(config.components)
        where = f"node {config.node.name} has" if config.cluster.nodes else "config has"
        raise CliError(f"unknown component {args.component!r} ({where}: {known})", EXIT_UNKNOWN)
    base = base_environment(os.environ)
    specs = [render_component(name, config, base) for name in names]
    if args.json:
        out = [{"component": s.component, "kind": s.kind, "argv": list(s.argv), "env": s.env,
                "unset": list(s.unset), "cwd": str(s.cwd), "daemonizes": s.daemonizes,
                "node": config.node.name, "group": getattr(config.components[s.component], "group", None),
                "ports": list(s.ports)} for s in specs]
        print(json.dumps(out if not args.component else out[0], indent=2))
        return 0
    for spec in specs:
        print(f"# --- {spec.component} ({spec.kind})")
        print(spec.shell())
        print()
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    from nodeagent.agent import load_checked
    from nodeagent.errors import ConfigError

    try:
        config = load_checked(args.file, args.node)
    except ConfigError as exc:
        raise CliError(f"config error:\n{exc}", EXIT_CONFIG) from None
    active = ", ".join(config.active_components())
    print(f"{args.file}: OK — node {config.node.name} ({config.node.role}) runs: {active}")
    if config.cluster.nodes:
        from nodeagent.config_cluster import cluster_file_hash
        from nodeagent.layout import cluster_layout

        layout = cluster_layout(config)
        groups = "; ".join(f"{g.name} ({g.kind}, {g.dp_launch}, DP{g.dp_size} TP{g.tensor_parallel_size}: "
                           f"{', '.join(g.nodes)})" for g in layout.groups)  # fmt: skip
        print(f"cluster {layout.cluster}: {len(layout.members)} members, groups {groups or 'none'}; "
              f"shared sections {cluster_file_hash(config)[:12]}")
    return 0


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    """run_vllm_bench.py's arguments (same names and defaults), then where the requests go (`benchcmd`)."""
    bench.add_argument("--total-len", type=positive_int, required=True, help="prompt tokens per request: prefix "
                       "+ suffix (the guide's table says input + output; its script makes it the prompt, as here)")
    bench.add_argument("--repeat-prefix-ratio", type=fraction, required=True,
                       help="share of the prompt that is a repeated prefix (0.9)")
    bench.add_argument("--output-len", type=positive_int, required=True, help="output tokens per request")
    bench.add_argument("--num-prompts", type=positive_int, required=True, help="requests in all")
    bench.add_argument("--num-prefixes", type=positive_int, required=True, help="distinct prefixes")
    bench.add_argument("--concurrency", type=positive_int, required=True, help="requests in flight at most")
    bench.add_argument("--output-dir", default=".", help="where both result JSONs go (default: .)")
    bench.add_argument("--seed", type=int, default=1000, help="random seed (default: 1000, the script's)")
    bench.add_argument("--request-rate", type=positive_number, default=None,
                       help="requests/s (default: unlimited)")
    bench.add_argument("--host", help="default: the PD proxy's if this node runs one, else this node's vLLM")
    bench.add_argument("--port", type=positive_int)
    bench.add_argument("--model", help="served model name (default: the config's served_model_name)")
    bench.add_argument("--tokenizer", help="default: the vllm component's model path")
    bench.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                       help="a vLLM /metrics whose prefix-cache counters count (repeatable; default: the target "
                            "vLLM, or every backend of the proxy)")
    bench.add_argument("--vllm", metavar="PATH", help="the vllm executable (default: `vllm` on PATH)")
    bench.add_argument("--json", action="store_true", help="print the saved JSON (vllm's own output to stderr)")


def build_parser() -> argparse.ArgumentParser:
    from nodeagent.cachewatch import add_cache_arguments

    parser = argparse.ArgumentParser(prog="nodeagentctl", description="Operate the dsv4-agent on this node.",
                                     epilog="exit codes: 0 ok, 1 action failed, 2 usage, 3 agent unreachable, "
                                     "4 unknown component, 5 unauthorised, 69 no vllm (bench), "
                                     "78 bad config")  # fmt: skip
    parser.add_argument("--config", "-c", default=None,
                        help=f"agent config (default: $DSV4_AGENT_CONFIG, then {DEFAULT_CONFIG}, then the agent "
                             "running on this host)")  # fmt: skip
    parser.add_argument("--node", metavar="NAME", help="act on another member of the cluster (status, render, "
                        "config validate)")
    # --config is accepted after the subcommand too (`nodeagentctl status --config FILE`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", default=argparse.SUPPRESS, help="agent config")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    status = add("status", "components: state, pid, ready, restarts, uptime, last exit", cmd_status)
    status.add_argument("--json", action="store_true", help="the agent's full /status JSON")
    status.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME", help="another member's status")
    cluster = add("cluster", "every member as seen through etcd: state, versions, key age, consistency warnings",
                  cmd_cluster)  # fmt: skip
    cluster.add_argument("cluster_action", nargs="?", default="list",
                         choices=["list", "pause", "resume", "redeploy", "restart"],
                         help="list (default); pause|resume every agent's automatic actions; redeploy the whole "
                              "cluster; restart vllm [--group G]: a new generation of vLLM groups")
    cluster.add_argument("target", nargs="?", help="with restart: the component (vllm)")
    cluster.add_argument("--group", help="with restart: only this group")
    cluster.add_argument("--reason", help="with pause, redeploy or restart: recorded for the others (restart: in "
                         "the new generation's reason, shown in every rank's events)")
    cluster.add_argument("--no-drain", action="store_true", help="with restart: do not drain in-flight requests")
    cluster.add_argument("--json", action="store_true", help="the agent's full /cluster JSON")
    for action, text in (("start", "start a component (desired: running)"),
                         ("stop", "stop a component (desired: stopped; stays stopped)"),
                         ("restart", "restart a component; concurrent restarts coalesce")):  # fmt: skip
        p = add(action, text, cmd_component)
        p.set_defaults(action=action)
        p.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME",
                       help="on another member (through etcd; a rank's restart restarts its group)")
        p.add_argument("component")
        p.add_argument("--wait", action="store_true", help="until done: up (new pid for restart) or stopped")
        if action != "start":
            p.add_argument("--no-drain", action="store_true",
                           help="do not wait for vLLM's in-flight requests (readiness off, then stop at once)")
        p.add_argument("--timeout", type=positive_seconds, default=DEFAULT_WAIT_S, metavar="S",
                       help=f"with --wait (default {DEFAULT_WAIT_S:g})")  # fmt: skip
    redeploy = add("redeploy", "the guide's recovery: stop all, clean residue, start all in order", cmd_redeploy)
    redeploy.add_argument("--reason", help="recorded in the event log")
    redeploy.add_argument("--wait", action="store_true", help="until every component is up again with a new pid")
    redeploy.add_argument("--timeout", type=positive_seconds, default=DEFAULT_WAIT_S, metavar="S")
    reset = add("reset", "clear restart counters (crash loop, backoff); without COMPONENT also the node's failed state",
                cmd_simple)  # fmt: skip
    reset.add_argument("component", nargs="?")
    add("pause", "maintenance pause: no automatic restarts or redeploys", cmd_simple)
    add("resume", "end the maintenance pause", cmd_simple)
    add("detach", "the agent exits, leaving the stack running for the next agent to adopt", cmd_simple)
    add("reload", "re-read the config; restart only components whose command or environment changed", cmd_simple)
    pm = add("postmortem", "failure bundles: list, or show ID (log tail, process tree, command, probes, cores)",
             cmd_postmortem)  # fmt: skip
    pm.add_argument("pm_command", nargs="?", choices=["list", "show"], default="list")
    pm.add_argument("bundle", nargs="?", help="with show: a bundle id (or a unique prefix)")
    pm.add_argument("-n", "--lines", type=_count, default=40, help="with show: last N lines of output (40)")
    pm.add_argument("--json", action="store_true")
    npu = add("npu", "NPU/RoCE health as the agent sees it; `npu override [N]` starts vLLM despite a fault",
              cmd_npu)  # fmt: skip
    npu.add_argument("npu_command", nargs="?", choices=["status", "override"], default="status")
    npu.add_argument("npu", nargs="?", type=_count, help="with override: only this NPU's faults")
    npu.add_argument("--json", action="store_true")
    logs = add("logs", "a component's output (journald under systemd, else log_dir/COMPONENT.log)", cmd_logs)
    logs.add_argument("component")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("-n", "--lines", type=_count, default=50, metavar="N", help="last N lines (default 50)")
    logs.add_argument("--source", choices=["auto", "own", "journal", "file"], default="auto",
                      help="auto: the component's own log if it writes one (datasystem worker), else its output "
                           "where the agent sends it; own: only its own log")  # fmt: skip
    logs.add_argument("--unit", default=DEFAULT_UNIT, help=f"systemd unit for journalctl (default {DEFAULT_UNIT})")
    cache = add("cache", "vLLM prefix-cache hit rates, like watch_cache_hit_rate.sh", cmd_cache)
    add_cache_arguments(cache)
    bench = add("bench", "the guide's run_vllm_bench.py, plus the prefix-cache hit rates of that run", cmd_bench)
    _add_bench_arguments(bench)
    probe = add("probe", "the guide's vllm_probe_yr.py checks (exit 0/1)", cmd_probe)
    probe.add_argument("role", nargs="?", choices=["master", "slave"], help="default: from node.role")
    probe.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="S")
    preflight = add("preflight", "check this host against the guide's requirements (exit 1 on any FAIL)", cmd_preflight)
    preflight.add_argument("--json", action="store_true", help="every check as JSON")
    from nodeagent.portscmd import add_ports_command

    add_ports_command(add)
    render = add("render", "print the exact command, environment and cwd of components", cmd_render)
    render.add_argument("component", nargs="?")
    render.add_argument("--json", action="store_true")
    render.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME",
                        help="render this member of a cluster file (default: node.name)")
    config = sub.add_parser("config", help="config tools")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    validate = config_sub.add_parser("validate", help="validate a config file")
    validate.add_argument("file")
    validate.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME",
                          help="validate as this member of a cluster file")
    validate.set_defaults(func=cmd_config_validate)
    version = sub.add_parser("version", help="print the version")
    version.set_defaults(func=lambda _args: print(f"nodeagentctl {__version__}") or 0)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "node", None) and args.command not in NODE_COMMANDS:
        parser.error(f"--node works with: {', '.join(NODE_COMMANDS)} (not {args.command})")
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"nodeagentctl: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

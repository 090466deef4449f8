"""The config's raw layer: YAML → plain data with the line of every key, `${VAR}` / `${VAR:-default}` / `$$`
interpolation, config-relative paths, and the `agent` section's defaults.

No model here: `nodeagentctl` reads the agent's address through this layer in a few milliseconds, and
`nodeagent.config.load` validates the very same data (one reader, one set of rules and defaults).
"""

from __future__ import annotations

import contextlib
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from nodeagent.core.errors import ConfigError

KeyPath = tuple[str | int, ...]
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\$")

# The `agent` section's defaults (ApiConfig / AgentSettings use these).
DEFAULT_LISTEN = "127.0.0.1:18700"
DEFAULT_TOKEN_FILE = Path("/etc/dsv4-agent/token")
DEFAULT_STATE_DIR = Path("/var/lib/dsv4-agent")
DEFAULT_LOG_DIR = Path("/var/log/dsv4-agent")
DEFAULT_CLUSTER_NAME = "local"
"""`ClusterConfig.name`'s default (tests/test_discovery.py holds them equal)."""


def interpolate(text: str, env: typing.Mapping[str, str], where: str) -> str:
    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise ConfigError(f"{where}: environment variable ${{{name}}} is not set (use ${{{name}:-default}})")

    return _VAR.sub(sub, text)


def dotted(path: typing.Sequence[str | int]) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def check_listen(value: str) -> str:
    """`HOST:PORT` with a port in 1..65535; ValueError otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"listen must be HOST:PORT, got {value!r}")
    return value


def resolve_path(value: Path, base_dir: Path | str | None) -> Path:
    """`~` expanded; a relative path is relative to the config file's folder."""
    value = value.expanduser()
    if not value.is_absolute() and base_dir is not None:
        value = Path(base_dir) / value
    return Path(os.path.normpath(value))


class RawTree:
    """YAML → plain data, remembering the line of every key path.

    `sections`: walk (and interpolate) only these top-level keys — the CLI reads `agent` without tripping over a
    `${VAR}` of another section that only the agent's environment sets. `loader`: libyaml's parser for the CLI's
    fast path; the agent's loader keeps PyYAML's own, whose error messages its tests and docs quote — it reads
    the text with libyaml first (~10× faster: a rollout's member reads each new file) and again with PyYAML's own
    only when that fails, so an error says what PyYAML says."""

    def __init__(self, filename: str, env: typing.Mapping[str, str], loader: Any = yaml.SafeLoader) -> None:
        self.filename = filename
        self.env = env
        self.loader = loader
        self.lines: dict[KeyPath, int] = {}

    def build(self, text: str, sections: typing.Container[str] | None = None) -> Any:
        fast = getattr(yaml, "CSafeLoader", None) if self.loader is yaml.SafeLoader else None
        if fast is not None:
            with contextlib.suppress(Exception):  # any failure: PyYAML's own answers (and words the error)
                return self._build(fast, text, sections)
        return self._build(self.loader, text, sections)

    def _build(self, loader_class: Any, text: str, sections: typing.Container[str] | None) -> Any:
        loader = loader_class(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            if sections is not None and isinstance(node, yaml.MappingNode):
                return self._walk_top(loader, node, sections)
            return self._walk(loader, node, ())
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark else "?"
            raise ConfigError(f"{self.filename}:{line}: YAML syntax: {exc.problem or exc}") from None
        finally:
            loader.dispose()

    def _walk_top(self, loader: Any, node: yaml.MappingNode, sections: typing.Container[str]) -> dict[Any, Any]:
        loader.flatten_mapping(node)
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if key in sections:
                self.lines[(key,)] = key_node.start_mark.line + 1
                out[key] = self._walk(loader, value_node, (key,))
        return out

    def _walk(self, loader: Any, node: yaml.Node, path: KeyPath) -> Any:
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            loader.flatten_mapping(node)
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = loader.construct_object(key_node, deep=True)
                where = f"{self.filename}:{key_node.start_mark.line + 1}"
                if not isinstance(key, str | int):
                    raise ConfigError(f"{where}: keys must be strings, got {key!r}")
                if key in out:
                    raise ConfigError(f"{where}: {dotted((*path, key))}: duplicate key")
                self.lines[(*path, key)] = key_node.start_mark.line + 1
                out[key] = self._walk(loader, value_node, (*path, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self._walk(loader, item, (*path, i)) for i, item in enumerate(node.value)]
        value = loader.construct_object(node, deep=True)
        if isinstance(value, str) and "$" in value:
            where = f"{self.filename}:{node.start_mark.line + 1}: {dotted(path)}"
            value = interpolate(value, self.env, where)
        return value


def read_config_text(path: str | Path) -> tuple[Path, str]:
    """(the expanded path, its text); ConfigError naming the file when it cannot be read."""
    path = Path(path).expanduser()
    try:
        return path, path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None


class AgentSection:
    """The `agent` section's address and folders, as the validated model resolves them."""

    __slots__ = ("listen", "log_dir", "state_dir", "token_file", "unix_socket")

    def __init__(self, listen: str, token_file: Path, unix_socket: Path | None, log_dir: Path,
                 state_dir: Path) -> None:  # fmt: skip
        self.listen, self.token_file, self.unix_socket = listen, token_file, unix_socket
        self.log_dir, self.state_dir = log_dir, state_dir


class NotPlain(ValueError):
    """The raw value is not the plain string the fast path takes; the validating loader decides."""


def _mapping(data: Any, key: str) -> dict[str, Any]:
    if data is None or key not in data:
        return {}
    value = data[key]
    if not isinstance(value, dict):
        raise NotPlain(f"{key} is not a mapping")
    return value


def _path(raw: Any, base: Path, default: Path) -> Path:
    if raw is None:
        return default
    if not isinstance(raw, str) or not raw:
        raise NotPlain("not a path")
    return resolve_path(Path(raw), base)


def read_agent_section(path: str | Path, env: typing.Mapping[str, str] | None = None) -> AgentSection:
    """The `agent` section of a config file (defaults filled in, paths resolved), read without validating the
    rest. ConfigError for an unreadable file, bad YAML or an unset `${VAR}` in it; NotPlain for a value the
    validating loader must judge (it raises the exact error, or accepts it)."""
    file, text = read_config_text(path)
    tree = RawTree(str(file), os.environ if env is None else env, getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    data = tree.build(text, sections=("agent",))
    if data is not None and not isinstance(data, dict):
        raise NotPlain("not a mapping of sections")
    agent = _mapping(data, "agent")
    api = _mapping(agent, "api")
    base = file.resolve().parent
    listen = api.get("listen", DEFAULT_LISTEN)
    if not isinstance(listen, str):
        raise NotPlain("listen")
    socket_raw = api.get("unix_socket")
    return AgentSection(listen=check_listen(listen), token_file=_path(api.get("token_file"), base, DEFAULT_TOKEN_FILE),
                        unix_socket=None if socket_raw is None else _path(socket_raw, base, Path()),
                        log_dir=_path(agent.get("log_dir"), base, DEFAULT_LOG_DIR),
                        state_dir=_path(agent.get("state_dir"), base, DEFAULT_STATE_DIR))  # fmt: skip


def read_cluster_name(path: str | Path, env: typing.Mapping[str, str] | None = None) -> str | None:
    """`cluster.name` of a config file as this shell reads it (`nodeagentctl --node` compares it with what a
    running agent announced); None when the fast path cannot tell (unreadable, a `${VAR}` unset here, not a
    plain string): the file alone is compared then."""
    try:
        file, text = read_config_text(path)
        tree = RawTree(str(file), os.environ if env is None else env, getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        cluster = _mapping(tree.build(text, sections=("cluster",)), "cluster")
    except (ConfigError, NotPlain):
        return None
    name = cluster.get("name", DEFAULT_CLUSTER_NAME)
    return name if isinstance(name, str) else None

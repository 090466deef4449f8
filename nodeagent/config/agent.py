"""The `agent:` section of the config: the API, the status page, MQTT, folders, logs and preflight.

Apart from `config_model` (which imports it) so that each file holds one part of the schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from msgspec import Meta, field

from nodeagent.config.base import Check, RuleProblem, Strict
from nodeagent.config.paths import ConfigPath
from nodeagent.config.raw import DEFAULT_LISTEN, DEFAULT_LOG_DIR, DEFAULT_STATE_DIR, DEFAULT_TOKEN_FILE, check_listen
from nodeagent.core.parsing import split_listen


class ApiConfig(Strict, frozen=True):
    listen: Annotated[str, Check(check_listen)] = DEFAULT_LISTEN
    token_file: ConfigPath = DEFAULT_TOKEN_FILE
    unix_socket: ConfigPath | None = None

    @property
    def host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return split_listen(self.listen)[1]


class UiConfig(Strict, frozen=True):
    """The status page at GET /ui and the cache-rate history behind it (GET /cache)."""

    enabled: bool = True
    """Serve the page and keep the history; false: both 404, no scraping for them."""
    cache_period_s: Annotated[float, Meta(ge=0.1)] = 15.0
    """How often vLLM's /metrics is scraped for the page's hit-rate plot: one sample per period."""
    cache_history_s: Annotated[float, Meta(gt=0)] = 3600.0
    """How far back the plot's samples are kept (in memory; lost when the agent restarts)."""

    def _problems(self) -> Iterator[RuleProblem]:
        if self.cache_history_s / self.cache_period_s > MAX_CACHE_SAMPLES:
            yield None, (f"cache_history_s / cache_period_s keeps more than {MAX_CACHE_SAMPLES} samples: scrape "
                         "less often or keep less history")


MAX_CACHE_SAMPLES = 6000
"""A day at 15 s. The page loads the whole history once (~1.3 MB of JSON, ~65 ms to encode at this bound),
then only new samples."""
MQTT_SCHEMES = {"mqtt": 1883, "mqtts": 8883}


def _parse_mqtt_url(value: str) -> str:
    try:
        url = urlsplit(value)
        port = url.port
    except ValueError as exc:
        raise ValueError(f"not a broker URL ({exc}): {value!r}") from None
    if url.scheme not in MQTT_SCHEMES or not url.hostname:
        raise ValueError(f"must be mqtt://HOST[:PORT] or mqtts://HOST[:PORT], got {value!r}")
    if url.username is not None or url.password is not None:
        raise ValueError("no credentials in the URL: use username and password_file")
    if url.path not in ("", "/") or url.query or url.fragment:
        raise ValueError(f"nothing may follow HOST:PORT in the broker URL, got {value!r}")
    if port == 0:
        raise ValueError(f"port must be 1-65535, got {value!r}")
    return value


def _topic_prefix(value: str) -> str:
    levels = value.split("/")
    if not value or any(not level for level in levels) or any(c in value for c in "+#\0"):
        raise ValueError(f"must be topic levels like 'dsv4' or 'site/dsv4' (no empty level, no '+' or '#'), "
                         f"got {value!r}")
    return value


class MqttConfig(Strict, frozen=True):
    """Publish status, events and cache hit rates to the monitoring system's broker. Absent: no MQTT at all.

    Topics: `<topic_prefix>/<cluster.name>/<node.name>/{status,events,cache}` (see nodeagent/api/mqtt.py)."""

    url: Annotated[str, Check(_parse_mqtt_url)]
    """mqtt://HOST[:1883] or mqtts://HOST[:8883] (TLS, verified against ca_file or the system CAs)."""
    username: str | None = None
    password_file: ConfigPath | None = None
    """Read at every connection attempt, so it may be root-only (0600) and rotated without a restart."""
    client_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    """Default: dsv4-agent-<cluster>-<node>."""
    topic_prefix: Annotated[str, Check(_topic_prefix)] = "dsv4"
    qos: Literal[0, 1, 2] = 1
    """For status and events; cache rates go out with QoS 0 (the next scrape replaces them)."""
    ca_file: ConfigPath | None = None
    keepalive_s: Annotated[int, Meta(ge=2, le=65535)] = 15
    """A broker that stops answering is noticed within about twice this."""
    timeout_s: Annotated[float, Meta(gt=0, le=300)] = 5.0
    """How long a connection attempt or one acknowledgement may take before the connection counts as lost."""
    buffer: Annotated[int, Meta(ge=10, le=10_000_000)] = 10000
    """Events kept for the broker while it is unreachable; past it the oldest are dropped (and counted)."""
    status_interval_s: Annotated[float, Meta(gt=0)] = 30.0
    """The retained status is republished at least this often (and on every change)."""
    cache_interval_s: Annotated[float, Meta(gt=0)] = 15.0
    """How often vLLM's /metrics is scraped for the `cache` topic."""
    reconnect_max_s: Annotated[float, Meta(gt=0)] = 30.0
    """Reconnect backoff: 1 s, doubling, capped here."""

    def _problems(self) -> Iterator[RuleProblem]:
        if self.password_file is not None and not self.username:
            yield "password_file", "a password needs a username (set agent.mqtt.username)"
        if self.ca_file is not None and not self.url.startswith("mqtts://"):
            yield "ca_file", "a CA file is for TLS: use an mqtts:// url"

    @property
    def tls(self) -> bool:
        return self.url.startswith("mqtts://")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        url = urlsplit(self.url)
        return url.port or MQTT_SCHEMES[url.scheme]


class CacheConfig(Strict, frozen=True):
    """The compile caches of the vLLM ranks (vLLM's torch.compile cache, inductor, Triton, CANN's kernel cache,
    torchair's graphs) kept on the host, one folder per software stack, so that a restarted rank and a recreated
    container start warm (`nodeagent.render.caches`)."""

    enabled: bool = True
    """Set the caches' variables on every vllm component (host and container) and mount the folder into the
    container; false: each cache stays where its software puts it (in the container: lost with it)."""
    dir: ConfigPath | None = None
    """The host folder of the caches, seen at the same path inside the container; default `<state_dir>/cache`."""
    keep: Annotated[int, Meta(ge=1)] = 2
    """How many software stacks' caches are kept (the least recently used beyond go); the one in use always."""
    max_gb: Annotated[float, Meta(gt=0)] = 200.0
    """Size cap of all kept caches together: past it, the least recently used stacks' folders go (never one in
    use)."""


class AgentSettings(Strict, frozen=True):
    preflight: Literal["enforce", "warn", "off"] = "enforce"
    """Before the stack starts (and every minute while it fails): enforce = a FAIL holds the stack (an
    operator start still works; `dsv4-agent --force` = warn), warn = events only, off = not run."""
    state_dir: ConfigPath = DEFAULT_STATE_DIR
    log_dir: ConfigPath = DEFAULT_LOG_DIR
    api: ApiConfig = field(default_factory=ApiConfig)
    log_max_bytes: Annotated[int, Meta(ge=1024)] = 100 * 1024 * 1024
    """A component's log file is copied and truncated (logrotate's copytruncate) past this size."""
    log_keep: Annotated[int, Meta(ge=1)] = 5
    archive_keep: Annotated[int, Meta(ge=1)] = 10
    """How many compressed log archives per component survive residue cleanup."""
    systemd_scopes: Literal["auto", "always", "never"] = "auto"
    """Under systemd, run each component in its own transient scope (`systemd-run --scope`): with the unit's
    KillMode=mixed, an agent crash or watchdog restart then cannot SIGKILL the stack, and the next agent adopts
    it. auto = when systemd is PID 1 and systemd-run exists."""
    residue_roots: list[ConfigPath] = field(default_factory=list)
    """Folders (besides state_dir and each component's own) under which cleanup may delete."""
    mqtt: MqttConfig | None = None
    ui: UiConfig = field(default_factory=UiConfig)
    """The read-only status page at GET /ui on the API's address, and the hit-rate history it plots."""
    caches: CacheConfig = field(default_factory=CacheConfig)
    """The vLLM ranks' compile caches on the host, kept across restarts and container recreates."""

    @property
    def cache_dir(self) -> Path:
        return self.caches.dir if self.caches.dir is not None else self.state_dir / "cache"

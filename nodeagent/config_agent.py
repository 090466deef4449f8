"""The `agent:` section of the config: the API, the status page, MQTT, folders, logs and preflight.

Apart from `config_model` (which imports it) so that each file holds one part of the schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from nodeagent.config_cluster import Strict
from nodeagent.config_paths import ConfigPath
from nodeagent.config_raw import DEFAULT_LISTEN, DEFAULT_LOG_DIR, DEFAULT_STATE_DIR, DEFAULT_TOKEN_FILE, check_listen
from nodeagent.parsing import split_listen


class ApiConfig(Strict):
    listen: Annotated[str, AfterValidator(check_listen)] = DEFAULT_LISTEN
    token_file: ConfigPath = DEFAULT_TOKEN_FILE
    unix_socket: ConfigPath | None = None

    @property
    def host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return split_listen(self.listen)[1]


class UiConfig(Strict):
    """The status page at GET /ui and the cache-rate history behind it (GET /cache)."""

    enabled: bool = True
    """Serve the page and keep the history; false: both 404, no scraping for them."""
    cache_period_s: float = Field(default=15.0, ge=0.1)
    """How often vLLM's /metrics is scraped for the page's hit-rate plot: one sample per period."""
    cache_history_s: float = Field(default=3600.0, gt=0)
    """How far back the plot's samples are kept (in memory; lost when the agent restarts)."""

    @model_validator(mode="after")
    def _bounded(self) -> UiConfig:
        if self.cache_history_s / self.cache_period_s > MAX_CACHE_SAMPLES:
            raise ValueError(f"cache_history_s / cache_period_s keeps more than {MAX_CACHE_SAMPLES} samples: "
                             "scrape less often or keep less history")
        return self


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


class MqttConfig(Strict):
    """Publish status, events and cache hit rates to the monitoring system's broker. Absent: no MQTT at all.

    Topics: `<topic_prefix>/<cluster.name>/<node.name>/{status,events,cache}` (see nodeagent/mqtt.py)."""

    url: Annotated[str, AfterValidator(_parse_mqtt_url)]
    """mqtt://HOST[:1883] or mqtts://HOST[:8883] (TLS, verified against ca_file or the system CAs)."""
    username: str | None = None
    password_file: ConfigPath | None = None
    """Read at every connection attempt, so it may be root-only (0600) and rotated without a restart."""
    client_id: str | None = Field(default=None, min_length=1, max_length=128)
    """Default: dsv4-agent-<cluster>-<node>."""
    topic_prefix: Annotated[str, AfterValidator(_topic_prefix)] = "dsv4"
    qos: Literal[0, 1, 2] = 1
    """For status and events; cache rates go out with QoS 0 (the next scrape replaces them)."""
    ca_file: ConfigPath | None = None
    keepalive_s: int = Field(default=15, ge=2, le=65535)
    """A broker that stops answering is noticed within about twice this."""
    timeout_s: float = Field(default=5.0, gt=0, le=300)
    """How long a connection attempt or one acknowledgement may take before the connection counts as lost."""
    buffer: int = Field(default=10000, ge=10, le=10_000_000)
    """Events kept for the broker while it is unreachable; past it the oldest are dropped (and counted)."""
    status_interval_s: float = Field(default=30.0, gt=0)
    """The retained status is republished at least this often (and on every change)."""
    cache_interval_s: float = Field(default=15.0, gt=0)
    """How often vLLM's /metrics is scraped for the `cache` topic."""
    reconnect_max_s: float = Field(default=30.0, gt=0)
    """Reconnect backoff: 1 s, doubling, capped here."""

    @field_validator("password_file")
    @classmethod
    def _password_needs_user(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and not info.data.get("username"):
            raise ValueError("a password needs a username (set agent.mqtt.username)")
        return value

    @field_validator("ca_file")
    @classmethod
    def _ca_needs_tls(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        url = info.data.get("url")
        if value is not None and url is not None and not url.startswith("mqtts://"):
            raise ValueError("a CA file is for TLS: use an mqtts:// url")
        return value

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


class AgentSettings(Strict):
    preflight: Literal["enforce", "warn", "off"] = "enforce"
    """Before the stack starts (and every minute while it fails): enforce = a FAIL holds the stack (an
    operator start still works; `dsv4-agent --force` = warn), warn = events only, off = not run."""
    state_dir: ConfigPath = DEFAULT_STATE_DIR
    log_dir: ConfigPath = DEFAULT_LOG_DIR
    api: ApiConfig = ApiConfig()
    log_max_bytes: int = Field(default=100 * 1024 * 1024, ge=1024)
    """A component's log file is copied and truncated (logrotate's copytruncate) past this size."""
    log_keep: int = Field(default=5, ge=1)
    archive_keep: int = Field(default=10, ge=1)
    """How many compressed log archives per component survive residue cleanup."""
    systemd_scopes: Literal["auto", "always", "never"] = "auto"
    """Under systemd, run each component in its own transient scope (`systemd-run --scope`): with the unit's
    KillMode=mixed, an agent crash or watchdog restart then cannot SIGKILL the stack, and the next agent adopts
    it. auto = when systemd is PID 1 and systemd-run exists."""
    residue_roots: list[ConfigPath] = Field(default_factory=list)
    """Folders (besides state_dir and each component's own) under which cleanup may delete."""
    mqtt: MqttConfig | None = None
    ui: UiConfig = UiConfig()
    """The read-only status page at GET /ui on the API's address, and the hit-rate history it plots."""

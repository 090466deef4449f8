"""The pure half of the MQTT publisher: topic names, payloads, the bounded outbox with its drop accounting, and the
reconnect backoff. No I/O, no aiomqtt: `nodeagent.api.mqtt` is the shell around these.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from nodeagent.core.events import Event
from nodeagent.vllm.cachehit import ALL_ENGINES, CacheRates, rates_to_json

AGENT_STATES = ("running", "stopping", "stopped", "detached", "offline")
"""`status.state`: supervising · stopping the stack · stopped in order · exited leaving the stack running for
the next agent · the broker lost the agent's connection (the last will; also after kill -9 or a power cut)."""
COMPONENT_KEYS = ("kind", "state", "desired", "ready", "up", "pid", "restarts", "held", "last_exit")
"""What the status topic carries of each component of /status (probe details stay on the local API)."""
REFUSED_CREDENTIALS = {4, 5, 134, 135}
"""CONNACK codes for bad credentials / not authorised, MQTT 3.1.1 and 5."""


@dataclass(frozen=True)
class Topics:
    status: str
    events: str
    cache: str


def topics_for(prefix: str, cluster: str, node: str) -> Topics:
    base = f"{prefix}/{cluster}/{node}"
    return Topics(status=f"{base}/status", events=f"{base}/events", cache=f"{base}/cache")


def default_client_id(cluster: str, node: str) -> str:
    """Stable per node: a restarted agent takes over its predecessor's session (and fires its will, if alive)."""
    return f"dsv4-agent-{cluster}-{node}"


def dumps(payload: Any) -> bytes:
    return json.dumps(payload, default=str, separators=(",", ":"), sort_keys=True).encode()


# ---- payloads ---------------------------------------------------------------------------------------------------


def component_view(comp: Mapping[str, Any]) -> dict[str, Any]:
    view = {key: comp.get(key) for key in COMPONENT_KEYS}
    view["crash_loop"] = bool((comp.get("policy") or {}).get("crash_loop"))
    return view


def status_payload(state: str, status: Mapping[str, Any], agent: Mapping[str, Any], cache: Mapping[str, Any],
                   dropped: int, now: float) -> dict[str, Any]:
    """The retained `status`: /status's node, pause, node policy and components, the agent, the cache hit rates.

    `status` is `Supervisor.status()`; `agent` what /status shows of the agent (version, pid, started_at).
    """
    return {
        "state": state,
        "ts": now,
        "node": dict(status.get("node") or {}),
        "agent": dict(agent),
        "paused": status.get("paused"),
        "redeploying": status.get("redeploying"),
        "node_policy": dict(status.get("node_policy") or {}),
        "isolated": status.get("isolated"),
        "components": {name: component_view(comp) for name, comp in (status.get("components") or {}).items()},
        "cache": dict(cache),
        "mqtt": {"dropped": dropped},
    }  # fmt: skip


def status_digest(payload: Mapping[str, Any]) -> bytes:
    """What a change means: everything but the timestamp and the cache rates (those refresh with every
    periodic publish; the `cache` topic carries each scrape)."""
    return dumps({k: v for k, v in payload.items() if k not in ("ts", "cache")})


def offline_payload(cluster: str, node: str) -> dict[str, Any]:
    """The last will: the broker publishes it (retained) when it loses the agent without a DISCONNECT."""
    return {"state": "offline", "node": {"name": node, "cluster": cluster},
            "reason": "the broker lost the agent's connection (agent killed, host down or network cut)"}  # fmt: skip


def event_payload(event: Event) -> dict[str, Any]:
    """Exactly what /events (SSE) sends, so both streams carry one `seq`."""
    return event.to_dict()


def cache_payload(rows: Mapping[str, Iterable[CacheRates]], now: float) -> dict[str, Any]:
    """Every engine's row plus the `all` row per vLLM component, in watch_cache_hit_rate.sh's column names."""
    ts = datetime.fromtimestamp(now).astimezone()
    return {"ts": now, "components": {name: [rates_to_json(ts, r) for r in table] for name, table in rows.items()}}


def cache_summary(rows: Mapping[str, Iterable[CacheRates]]) -> dict[str, Any]:
    """The `all` row's rates per component: what the status topic shows."""
    out = {}
    for name, table in rows.items():
        for rates in table:
            if rates.counters.engine == ALL_ENGINES:
                out[name] = {"local_win": rates.local_win, "local_total": rates.local_total, "ext_win": rates.ext_win,
                             "ext_total": rates.ext_total, "eff_total": rates.eff_total}  # fmt: skip
    return out


# ---- the outbox -------------------------------------------------------------------------------------------------


class Outbox:
    """Events not yet acknowledged by the broker, oldest first, at most `limit`.

    Overflow drops the oldest; so does a gap in the numbers pushed (the bus's own subscriber queue overflowed).
    Both are counted, with the range of numbers lost, until `take_report()` hands the news on.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: deque[Event] = deque()
        self.dropped = 0
        self.last_pushed: int | None = None
        self.inflight = 0
        self._unreported = 0
        self._lost_from: int | None = None
        self._lost_to: int | None = None

    def __len__(self) -> int:
        return len(self.items)

    def _lost(self, first: int, last: int) -> None:
        count = last - first + 1
        self.dropped += count
        self._unreported += count
        self._lost_from = first if self._lost_from is None else min(self._lost_from, first)
        self._lost_to = last if self._lost_to is None else max(self._lost_to, last)

    def push(self, event: Event) -> None:
        if self.last_pushed is not None and event.seq > self.last_pushed + 1:
            self._lost(self.last_pushed + 1, event.seq - 1)
        if len(self.items) >= self.limit:
            # The oldest not on the wire: one being sent may still be acknowledged.
            index = min(self.inflight, len(self.items) - 1)
            old = self.items[index]
            del self.items[index]
            self.inflight = min(self.inflight, len(self.items))
            self._lost(old.seq, old.seq)
        self.items.append(event)
        self.last_pushed = max(event.seq, self.last_pushed or 0)

    def send(self, n: int) -> list[Event]:
        """The oldest `n` (or fewer), now on the wire until `acked()` or `failed()`."""
        self.inflight = min(n, len(self.items))
        return [self.items[i] for i in range(self.inflight)]

    def acked(self) -> None:
        for _ in range(self.inflight):
            self.items.popleft()
        self.inflight = 0

    def failed(self) -> None:
        """Not acknowledged: they stay first and go again (a subscriber may see one twice, never out of order)."""
        self.inflight = 0

    def take_report(self) -> dict[str, Any] | None:
        """Drops not yet told, as `mqtt_dropped` event data; None if there is nothing new."""
        if not self._unreported:
            return None
        report = {"dropped": self._unreported, "first_seq": self._lost_from, "last_seq": self._lost_to,
                  "dropped_total": self.dropped, "buffer": self.limit}  # fmt: skip
        self._unreported, self._lost_from, self._lost_to = 0, None, None
        return report


def drop_message(report: Mapping[str, Any]) -> str:
    return (f"{report['dropped']} events (seq {report['first_seq']}-{report['last_seq']}) were dropped: the broker "
            f"was unreachable or slow and the buffer holds {report['buffer']}")  # fmt: skip


# ---- connection -------------------------------------------------------------------------------------------------


def reconnect_delay(failures: int, cap: float) -> float:
    """1 s after the first failure, doubling, capped."""
    return min(cap, 2.0 ** max(0, failures - 1))


def explain_connect_error(code: int | None, text: str) -> str:
    if code in REFUSED_CREDENTIALS:
        return f"the broker refused the credentials ({text}): check agent.mqtt.username and password_file"
    return f"cannot connect: {text}"

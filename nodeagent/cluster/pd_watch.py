"""What the PD proxy does not see (issue 19 items 2, 3, 6), watched by the agent that runs it:

- **empty 200s** (vllm-ascend #13140, #8588): the proxy streams the decoder's answer after sending 200, so a
  decoder that fails (503, a dropped connection) becomes a 200 with an empty body — its generator logs `Error
  during streaming from decoder ...` and ends (load_balance_proxy_server_example.py `generate_stream`). So every
  decode instance is probed end to end as the proxy would use it: the 2-token request to a prefill instance
  with `kv_transfer_params.do_remote_decode` (the proxy's `build_prefill_request`), then to the decoder with
  the prefill's KV handle; no tokens back `empty_after` times in a row → its group restarts (a new generation:
  the proxy sync takes it out meanwhile and back once healthy).
- **prefill holding KV for a dead decoder** (#13240): while a decode group is out of the proxy, prefill's
  `vllm:kv_cache_usage_perc` is read; past the threshold the prefill groups restart one at a time (the next
  only once the previous is back), before they wedge.
- **KV transfer failures per prefill↔decode pair** (#10224, #7401, #10532): each node counts its ranks' failures
  from their logs (`nodeagent.kvlog`) and publishes them in its member record; here they are summed per pair
  (`kvtimeouts.TransferTimeouts`) and the side that fails with every peer restarts — never both.

Decisions are pure functions below; `PdWatch` is the thin loop (HTTP through a callable, restarts through the
coordinator's `ask_generations`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.bindaddr import connect_host, direct_opener
from nodeagent.host import Clock
from nodeagent.kvtimeouts import RestartEngine, TransferTimeouts, TransportSuspect
from nodeagent.stackport import ReportLayer

if TYPE_CHECKING:
    from nodeagent.cluster.coordinator import Coordinator
    from nodeagent.config_recovery import PdWatchConfig
    from nodeagent.layout import Group

Http = Callable[[str, str, dict[str, Any] | None, float, Mapping[str, str]], Awaitable[tuple[int, str]]]
"""(method, url, JSON body or None, timeout, headers) → (status, body text); raises OSError when nobody answers."""
RESTART_COOLDOWN_S = 300.0
"""After the watch restarted a group (for any of its reasons), the group waits this long before it acts on it again."""
_KV_USAGE = re.compile(r'^vllm:kv_cache_usage_perc\{[^}]*\}\s+([0-9.eE+-]+)', re.MULTILINE)


# ---- pure ----------------------------------------------------------------------------------------------------------


def prefill_request(model: str) -> dict[str, Any]:
    """The proxy's `build_prefill_request` of a 2-token completion."""
    return {"model": model, "prompt": "ping", "max_tokens": 1, "min_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}  # fmt: skip


def tokens_of(status: int, body: str) -> tuple[bool, str]:
    """A completion answer that carries tokens: (ok, what it was)."""
    if status != 200:
        return False, f"HTTP {status}: {body.strip()[:120] or 'no body'}"
    if not body.strip():
        return False, "200 with an empty body"
    try:
        data = json.loads(body)
    except ValueError:
        return False, f"200 with a body that is not JSON: {body.strip()[:80]}"
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices:
        return False, "200 without choices"
    first = choices[0] or {}
    text = first.get("text") or (first.get("message") or {}).get("content") or ""
    used = ((data.get("usage") or {}).get("completion_tokens")) or 0
    if not text and not used:
        return False, "200 without a token"
    return True, f"{used or len(text)} tokens"


@dataclass
class EmptyCounter:
    """Answers without tokens in a row, per decode group."""

    after: int
    streak: dict[str, int] = field(default_factory=dict)

    def observe(self, group: str, ok: bool) -> bool:
        """True when this group's streak just reached `after` (act now)."""
        self.streak[group] = 0 if ok else self.streak.get(group, 0) + 1
        return not ok and self.streak[group] == self.after


def kv_usage(metrics_text: str) -> float | None:
    """The highest `vllm:kv_cache_usage_perc` (0..1) of a /metrics page (one series per DP engine)."""
    values = [float(v) for v in _KV_USAGE.findall(metrics_text)]
    return max(values) if values else None


def kv_pressure(decode_down: Iterable[str], usage: Mapping[str, float], healthy: Mapping[str, bool],
                threshold: float) -> tuple[str, str] | None:  # fmt: skip
    """(prefill group to restart, why), or None: only while a decode group is down, one prefill group at a time
    (none while another prefill group is still out of the proxy), the fullest first."""
    down = sorted(decode_down)
    if not down or not all(healthy.get(g, False) for g in usage):
        return None
    over = sorted(((u, g) for g, u in usage.items() if u >= threshold), reverse=True)
    if not over:
        return None
    u, g = over[0]
    return g, (f"KV cache {u:.0%} >= {threshold:.0%} while decode {', '.join(down)} is down: prefill keeps the KV a "
               "dead decoder never pulls (vllm-ascend #13240)")


def merged_transfers(kinds: Mapping[str, str], records: Iterable[Mapping[str, Any]], threshold: int,
                     window_s: float, since: Mapping[str, float]) -> TransferTimeouts:  # fmt: skip
    """Every node's published transfer failures `[[t, engine, peer], ...]` in one counter (events of an engine
    from before its last restart for this reason left out)."""
    counter = TransferTimeouts(dict(kinds), threshold=threshold, window_s=window_s)
    events = []
    for record in records:
        for item in record.get("kv_transfers") or []:
            with contextlib.suppress(TypeError, ValueError):
                t, engine, peer = float(item[0]), str(item[1]), (str(item[2]) if item[2] is not None else None)
                if engine in kinds and t > since.get(engine, 0.0) and (peer is None or t > since.get(peer, 0.0)):
                    events.append((t, engine, peer))
    counter.events.extend(sorted(events))
    return counter


# ---- the loop ------------------------------------------------------------------------------------------------------


async def http_call(method: str, url: str, body: dict[str, Any] | None, timeout: float,
                    headers: Mapping[str, str]) -> tuple[int, str]:  # fmt: skip
    def call() -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data, {**headers, **({"Content-Type": "application/json"} if data
                                                                   else {})}, method=method)  # fmt: skip
        try:
            with direct_opener().open(request, timeout=timeout) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    return await asyncio.to_thread(call)


class PdWatch(ReportLayer):
    """Runs beside the coordinator's ProxySync on the proxy's node; its last probes are /status's `pd_watch`."""

    def __init__(self, coordinator: Coordinator, settings: PdWatchConfig, members: Callable[[], Mapping[str, Any]],
                 *, model: str, clock: Clock | None = None, http: Http | None = None) -> None:  # fmt: skip
        self.co = coordinator
        self.settings = settings
        self.members = members
        self.model = model
        self.clock = clock or Clock()
        self.http = http or http_call
        self.groups: dict[str, Group] = {g.name: g for g in coordinator.layout.groups if g.kind in ("prefill",
                                                                                                   "decode")}
        self.empties = EmptyCounter(settings.empty_after)
        self.acted: dict[tuple[str, str], float] = {}
        """(why, group) → when it was last restarted for it (cooldown)."""
        self.last_probe: dict[str, str] = {}
        coordinator.port.attach(self)

    def _of(self, kind: str) -> list[Group]:
        return [g for g in self.groups.values() if g.kind == kind]

    def _health(self) -> dict[str, bool]:
        sync = self.co.proxies[0] if self.co.proxies else None
        health = sync.health if sync is not None else {}
        return {name: health.get(name, "") == "" for name in self.groups}

    async def run(self) -> None:
        next_probe = 0.0
        while True:
            try:
                if self.clock.monotonic() >= next_probe:
                    next_probe = self.clock.monotonic() + self.settings.probe_period_s
                    await self.probe_decoders()
                await self.watch_kv()
                await self.watch_transfers()
            except Exception:  # a bug must not end the watch
                logger.exception("pd watch: step failed")
            await self.clock.sleep(min(self.settings.probe_period_s, 5.0))

    async def _restart(self, why: str, group: str, reason: str) -> bool:
        """One restart of the group per cooldown, whatever the reason: an empty-answer restart followed by a KV or
        transfer verdict read before it took effect would restart a group that is loading already."""
        now = self.clock.monotonic()
        last = max((t for (_, g), t in self.acted.items() if g == group), default=-RESTART_COOLDOWN_S)
        if now - last < RESTART_COOLDOWN_S:
            return False
        self.acted[(why, group)] = now
        self.co.port.emit("pd_watch", f"group {group} restarts: {reason}", None, "warning", group=group, why=why)
        with contextlib.suppress(Exception):
            await self.co.ask_generations([group], f"pd watch: {reason}", planned=False)
            return True
        return False

    async def probe_decoders(self) -> None:
        """One 2-token request per decode group, prefill → decode as the proxy does; prefill must answer first."""
        healthy = self._health()
        prefills = [g for g in self._of("prefill") if healthy[g.name] and g.endpoints]
        if not prefills:
            return
        timeout = self.settings.probe_timeout_s
        for i, decode in enumerate(g for g in self._of("decode") if healthy[g.name] and g.endpoints):
            prefill = prefills[i % len(prefills)]
            # one request id on both sides, as the proxy sends it (`auth_headers`): vLLM takes X-Request-Id as
            # the request's id, and connectors that pair the two halves by id find the prefill's KV by it
            headers = {"X-Request-Id": f"dsv4-pd-probe-{uuid.uuid4()}"}
            try:
                status, body = await self.http("POST", f"http://{_host(prefill.endpoints[0])}/v1/completions",
                                               prefill_request(self.model), timeout, headers)  # fmt: skip
                if status != 200:
                    continue  # prefill's own trouble: its probes and the gangs handle it
                params = (json.loads(body) or {}).get("kv_transfer_params") or {}
                request = {**prefill_request(self.model), "max_tokens": 2, "kv_transfer_params": params}
                request.pop("min_tokens")
                status, body = await self.http("POST", f"http://{_host(decode.endpoints[0])}/v1/completions",
                                               request, timeout, headers)  # fmt: skip
                ok, what = tokens_of(status, body)
            except (OSError, ValueError) as exc:
                ok, what = False, f"no answer: {exc}"
            self.last_probe[decode.name] = what
            if self.empties.observe(decode.name, ok):
                await self._restart("empty", decode.name, f"{self.settings.empty_after} answers in a row without "
                                    f"tokens from decode {decode.name} ({what}): the proxy would answer 200 with an "
                                    "empty body (vllm-ascend #13140)")  # fmt: skip

    async def watch_kv(self) -> None:
        healthy = self._health()
        down = [g.name for g in self._of("decode") if not healthy[g.name]]
        if not down:
            return
        usage: dict[str, float] = {}
        for group in self._of("prefill"):
            values = []
            for endpoint in group.endpoints:
                with contextlib.suppress(OSError, ValueError):
                    status, text = await self.http("GET", f"http://{_host(endpoint)}/metrics", None, 5.0, {})
                    if status == 200 and (u := kv_usage(text)) is not None:
                        values.append(u)
            if values:
                usage[group.name] = max(values)
        found = kv_pressure(down, usage, healthy, self.settings.kv_usage_threshold)
        if found is not None:
            await self._restart("kv", *found)

    async def watch_transfers(self) -> None:
        kinds = {n: g.kind for n, g in self.groups.items()}
        since = {g: self.clock.time() - (self.clock.monotonic() - t) for (why, g), t in self.acted.items()
                 if why == "transfer"}  # fmt: skip
        records = [m for m in self.members().values() if isinstance(m, Mapping)]
        counter = merged_transfers(kinds, records, self.settings.transfer_threshold, self.settings.transfer_window_s,
                                   since)  # fmt: skip
        verdict = counter.decide(self.clock.time())
        if isinstance(verdict, TransportSuspect):
            if self.acted.get(("suspect", "")) is None:
                self.acted[("suspect", "")] = self.clock.monotonic()
                self.co.port.emit("pd_watch", verdict.reason + "; restarting neither side", None, "error")
            return
        for restart in verdict or []:
            assert isinstance(restart, RestartEngine)
            await self._restart("transfer", restart.engine, restart.reason)

    def status_section(self) -> dict[str, Any]:
        return {"pd_watch": {"probes": dict(self.last_probe), "empty_streaks": dict(self.empties.streak),
                             "restarted": {f"{g} ({why})": round(self.clock.time() - (self.clock.monotonic() - t), 3)
                                           for (why, g), t in self.acted.items() if g}}}  # fmt: skip


def _host(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    return f"{connect_host(host)}:{port}"

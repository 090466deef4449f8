"""What the PD proxy does not see (issue 19 items 2, 3, 6), watched by the agent that runs it:

- **empty 200s** (vllm-ascend #13140, #8588): the proxy streams the decoder's answer after sending 200, so a
  decoder that fails (503, a dropped connection) becomes a 200 with an empty body — its generator logs `Error
  during streaming from decoder ...` and ends (load_balance_proxy_server_example.py `generate_stream`). So every
  decode instance — each DP rank's API server, the proxy routes to each — is probed end to end as the proxy
  would use it: the request to a prefill instance with `kv_transfer_params.do_remote_decode` (the proxy's
  `build_prefill_request`), then a 2-token request to the decoder with the prefill's KV handle. An answer
  without tokens or with fewer than the 2 asked (forced: `min_tokens`, `ignore_eos`) `empty_after` times in a
  row → that instance's group restarts (a new generation: the proxy sync takes it out meanwhile and back once
  healthy). One round of probes per `probe_period_s`, spread evenly over it (never a burst), the prefill side
  turning through every prefill instance: a bad prefill rank then fails a decoder's probe only now and then,
  never in a row. Each round ends with the same 2-token request through the proxy itself; when that fails while
  every instance's probe of the round passed, the proxy is the fault (said in status and an event); after
  `proxy_fault_after` such rounds in a row the proxy restarts — a hung proxy serves nothing, and its liveness
  probe (`/healthcheck`, answered without routing anything) is slower to see it or does not see it at all.
- **prefill holding KV for a dead decoder** (#13240): while a decode group is out of the proxy, prefill's
  `vllm:kv_cache_usage_perc` is read; past the threshold the prefill groups restart one at a time (the next
  only once the previous is back), before they wedge.
- **KV transfer failures per prefill↔decode pair** (#10224, #7401, #10532): each node counts its ranks' failures
  from their logs (`nodeagent.layers.kvlog`) and publishes them in its member record; here they are summed per pair
  (`kvtimeouts.TransferTimeouts`) and the side that fails with every peer restarts — never both.

Decisions are pure functions below; `PdWatch` is the thin loop (HTTP through a callable, restarts through the
coordinator's `ask_generations`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.cluster.proxy_activation import ActivationWatch
from nodeagent.cluster.store import StoreError
from nodeagent.config.model import ProxyComponent, VllmComponent
from nodeagent.core.bindaddr import connect_host
from nodeagent.core.errors import CoordinationUnavailable, UnknownComponentError
from nodeagent.core.http import fetch
from nodeagent.core.states import SERVING_STATES, Desired, State
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import ReportLayer
from nodeagent.vllm.kv_transfer import RestartEngine, TransferTimeouts, TransportSuspect
from nodeagent.vllm.promtext import samples

if TYPE_CHECKING:
    from nodeagent.cluster.coordinator_port import CoordinatorPort
    from nodeagent.config.layout import Group
    from nodeagent.config.recovery import PdWatchConfig
    from nodeagent.seam.stackport import ComponentView

Http = Callable[[str, str, dict[str, Any] | None, float, Mapping[str, str]], Awaitable[tuple[int, str]]]
"""(method, url, JSON body or None, timeout, headers) → (status, body text); raises OSError when nobody answers."""
PROBE_TOKENS = 2
"""The issue's test: a 2-token request must return tokens — both of them."""
RESTART_COOLDOWN_S = 300.0
"""After the watch restarted a group (for any of its reasons), the group waits this long before it acts on it again."""


# ---- pure ----------------------------------------------------------------------------------------------------------


def prefill_request(model: str) -> dict[str, Any]:
    """The proxy's `build_prefill_request` of the probe's completion."""
    return {"model": model, "prompt": "ping", "max_tokens": 1, "min_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}  # fmt: skip


def completion_request(model: str) -> dict[str, Any]:
    """A completion of exactly PROBE_TOKENS tokens: a healthy engine cannot stop short (EOS ignored)."""
    return {"model": model, "prompt": "ping", "max_tokens": PROBE_TOKENS, "min_tokens": PROBE_TOKENS,
            "ignore_eos": True, "stream": False}  # fmt: skip


def tokens_of(status: int, body: str, asked: int = PROBE_TOKENS) -> tuple[bool, str]:
    """A completion answer that carries the tokens asked: (ok, what it was). Fewer than asked is short."""
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
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    used = usage.get("completion_tokens")
    if not text and not used:
        return False, "200 without a token"
    if isinstance(used, int) and used < asked:
        return False, f"200 with {used} of the {asked} tokens asked (a short answer)"
    return True, f"{used} tokens" if isinstance(used, int) else f"{len(text)} characters (no usage to count)"


@dataclass
class EmptyCounter:
    """Answers without (enough) tokens in a row, per decode instance."""

    after: int
    streak: dict[str, int] = field(default_factory=dict)
    since: dict[str, float] = field(default_factory=dict)
    """instance → when the probe that began its streak asked it (wall time): an operator reads when it went wrong,
    not when the streak was last looked at."""

    def observe(self, instance: str, ok: bool, at: float | None = None) -> bool:
        """True while this instance's streak is at `after` or more (act: `clear` once acted on); `at`: when this
        answer was asked for."""
        self.streak[instance] = 0 if ok else self.streak.get(instance, 0) + 1
        if ok:
            self.since.pop(instance, None)
        elif at is not None:
            self.since.setdefault(instance, at)
        return not ok and self.streak[instance] >= self.after

    def clear(self, instances: Iterable[str]) -> None:
        """The group was restarted: its instances count afresh once back."""
        for instance in instances:
            self.streak[instance] = 0
            self.since.pop(instance, None)


def proxy_fault(proxy_ok: bool, proxy_what: str, instances: Mapping[str, bool], silent_prefills: int = 0) -> str | None:
    """Why the proxy itself is the fault, or None: its answer failed while every instance probed in the same
    round answered with tokens (with none probed, or one failing, the backends explain it — as does a prefill
    that did not answer a probe of the round: the proxy routes through it too)."""
    if proxy_ok or not instances or not all(instances.values()) or silent_prefills:
        return None
    return (f"the proxy answers {proxy_what} while every prefill→decode pair answers with tokens "
            f"({len(instances)} decode instances probed): the proxy itself is the fault")


def proxy_restart(faults: int, after: int, proxy: ComponentView | None) -> bool:
    """Restart the proxy: it was the fault `after` rounds in a row (0: never) and it is up and meant to run —
    not while it starts, stops or backs off (its own restart is under way) nor once an operator stopped it."""
    return (after > 0 and faults >= after and proxy is not None and proxy.running and proxy.up
            and proxy.desired == Desired.RUNNING and (proxy.state in SERVING_STATES or proxy.state == State.UNHEALTHY))


def kv_usage(metrics_text: str) -> float | None:
    """The highest `vllm:kv_cache_usage_perc` (0..1) of a /metrics page (one series per DP engine)."""
    values = [s.value for s in samples(metrics_text, ("vllm:kv_cache_usage_perc",))]
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
    answer = await fetch(method, url, timeout, json=body, headers=headers)
    return answer.status, answer.text


class PdWatch(ReportLayer):
    """Runs beside the coordinator's ProxySync on the proxy's node; its last probes are /status's `pd_watch`."""

    def __init__(self, coordinator: CoordinatorPort, settings: PdWatchConfig | None,
                 members: Callable[[], Mapping[str, Any]], *, model: str | None = None, clock: Clock | None = None,
                 http: Http | None = None) -> None:  # fmt: skip
        """settings, model: fixed ones (tests); None: the node's config now, read at each use (a reload's)."""
        self.co = coordinator
        self._settings = settings
        self.members = members
        self._model = model
        self.clock = clock or Clock()
        self.http = http or http_call
        self.groups: dict[str, Group] = {g.name: g for g in coordinator.layout.groups if g.kind in ("prefill",
                                                                                                   "decode")}
        self.empties = EmptyCounter(self.settings.empty_after)
        self.acted: dict[tuple[str, str], float] = {}
        """(why, group) → when it was last restarted for it (cooldown)."""
        self.last_probe: dict[str, dict[str, str]] = {}
        """decode group → instance (host:port) → what its last probe got."""
        self.proxy: dict[str, Any] = {}
        """The last probe through the proxy: ok, what, at, and `fault` when the proxy itself is to blame."""
        self.proxy_faults = 0
        """Rounds in a row in which the proxy was the fault."""
        self.refused: dict[str, str] = {}
        """group → why its last restart was not granted (etcd away, busy): said once, asked again each round."""
        self.rounds = 0
        self.silent_prefills: set[str] = set()
        """The prefill instances that did not answer a probe this round."""
        self.activation = ActivationWatch(self._pending, self._activation_flags, self._get, self._activation_restart,
                                          self._say_activation, self.clock)  # fmt: skip

    @property
    def settings(self) -> PdWatchConfig:
        return self._settings if self._settings is not None else self.co.config.recovery.pd

    @property
    def model(self) -> str:
        """The name the probes ask for: the node's first vLLM's served_model_name now."""
        if self._model is not None:
            return self._model
        return next((c.served_model_name for c in self.co.config.components.values() if isinstance(c, VllmComponent)),
                    "dsv4")  # fmt: skip

    def _of(self, kind: str) -> list[Group]:
        return [g for g in self.groups.values() if g.kind == kind]

    def _health(self) -> dict[str, bool]:
        sync = self.co.proxies[0] if self.co.proxies else None
        health = sync.health if sync is not None else {}
        return {name: health.get(name, "") == "" for name in self.groups}

    async def run(self) -> None:
        await asyncio.gather(self._probe_loop(), self._watch_loop())

    async def _probe_loop(self) -> None:
        while True:
            started = self.clock.monotonic()
            try:
                await self.probe_round()
            except Exception:  # a bug must not end the watch
                logger.exception("pd watch: probe round failed")
            await self._sleep_until(started + self.settings.probe_period_s)

    async def _watch_loop(self) -> None:
        while True:
            try:
                await self.watch_kv()
                await self.watch_transfers()
                if self.co.proxies:
                    await self.activation.check()
            except Exception:  # a bug must not end the watch
                logger.exception("pd watch: step failed")
            await self.clock.sleep(min(self.settings.probe_period_s, 5.0))

    async def _sleep_until(self, at: float) -> None:
        if (left := at - self.clock.monotonic()) > 0:
            await self.clock.sleep(left)

    async def _restart(self, why: str, group: str, reason: str) -> bool:
        """One restart of the group per cooldown, whatever the reason: an empty-answer restart followed by a KV or
        transfer verdict read before it took effect would restart a group that is loading already. Claimed (the
        cooldown armed, "restarts" said) only once a generation was granted: a refusal — etcd away, the record busy
        — is said as such and the verdict is asked again at the next round."""
        now = self.clock.monotonic()
        last = max((t for (_, g), t in self.acted.items() if g == group), default=-RESTART_COOLDOWN_S)
        if now - last < RESTART_COOLDOWN_S:
            return False
        try:
            answer = (await self.co.ask_generations([group], f"pd watch: {reason}", planned=False)).get(group, "")
        except (CoordinationUnavailable, StoreError) as exc:
            answer = f"etcd unavailable: {exc}"
        if not answer.startswith("generation "):
            if self.refused.get(group) != answer:  # said once per answer; logged at every round
                self.co.port.emit("pd_watch", f"group {group} not restarted ({answer}): {reason}; asked again at "
                                  "the next round", None, "error", group=group, why=why)  # fmt: skip
            self.refused[group] = answer
            logger.warning(f"pd watch: group {group} not restarted ({answer}); asked again at the next round")
            return False
        self.refused.pop(group, None)
        self.acted[(why, group)] = now
        self.co.port.emit("pd_watch", f"group {group} restarts: {reason} ({answer})", None, "warning", group=group,
                          why=why)  # fmt: skip
        return True

    async def probe_round(self) -> None:
        """Every decode instance of the groups in the proxy, then the proxy itself, spread over one period."""
        healthy = self._health()
        prefills = [e for g in self._of("prefill") if healthy[g.name] for e in g.endpoints]
        targets = self._targets()
        if not prefills or not targets:
            return  # nothing the proxy could route a request through: its sync says why
        started, gap = self.clock.monotonic(), self.settings.probe_period_s / (len(targets) + 1)
        first = self.rounds
        self.rounds += 1
        self.silent_prefills = set()
        results = await self._probe_instances(targets, prefills, first, started, gap)
        await self._sleep_until(started + len(targets) * gap)
        if not self.co.proxies:
            return
        ok, what = await self.ask_proxy()
        if proxy_fault(ok, what, results, len(self.silent_prefills)) is not None:
            # An instance that failed after its turn in the round (up to a period ago) fails the proxy's request
            # too: the proxy is blamed only when every instance still answers now — every one the proxy routes
            # now, a group that joined it during the round as well (the campaign's empty rank, re-added just
            # before the proxy's request: the round had not probed it, and the proxy was blamed for its answer).
            results = await self._probe_instances(self._targets(), prefills, first)
        await self.judge_proxy(ok, what, results, len(self.silent_prefills))

    def _targets(self) -> list[tuple[str, str]]:
        """(group, endpoint) of every decode instance of the groups in the proxy now."""
        healthy = self._health()
        return [(g.name, e) for g in self._of("decode") if healthy[g.name] for e in g.endpoints]

    async def _probe_instances(self, targets: list[tuple[str, str]], prefills: list[str], first: int,
                               started: float | None = None, gap: float = 0.0) -> dict[str, bool]:
        """Each (group, endpoint) through a prefill in turn from `first`; spread `gap` apart from `started` when
        given, else at once. Instances that did not answer through a live prefill are left out."""
        results: dict[str, bool] = {}
        for k, (group, endpoint) in enumerate(targets):
            if started is not None:
                await self._sleep_until(started + k * gap)
            if not self._health().get(group, False):
                continue  # restarted meanwhile (this round, for another of its instances)
            prefill = prefills[(first + k) % len(prefills)]
            ok = await self.probe_instance(group, endpoint, prefill)
            if ok is not None:
                results[endpoint] = ok
            else:
                self.silent_prefills.add(prefill)
        return results

    async def probe_instance(self, group: str, endpoint: str, prefill: str) -> bool | None:
        """prefill → this decode instance as the proxy routes one request; None when prefill did not answer (its
        own probes and the gangs handle that)."""
        timeout = self.settings.probe_timeout_s
        # one request id on both sides, as the proxy sends it (`auth_headers`): vLLM takes X-Request-Id as the
        # request's id, and connectors that pair the two halves by id find the prefill's KV by it
        headers = {"X-Request-Id": f"dsv4-pd-probe-{uuid.uuid4()}"}
        try:
            status, body = await self.http("POST", f"http://{_host(prefill)}/v1/completions",
                                           prefill_request(self.model), timeout, headers)  # fmt: skip
            params = (json.loads(body) or {}).get("kv_transfer_params") or {} if status == 200 else None
        except (OSError, ValueError, AttributeError):
            params = None
        if params is None:
            return None
        request = {**completion_request(self.model), "kv_transfer_params": params}
        asked = self.clock.time()
        try:
            status, body = await self.http("POST", f"http://{_host(endpoint)}/v1/completions", request, timeout,
                                           headers)  # fmt: skip
            ok, what = tokens_of(status, body)
        except OSError as exc:
            ok, what = False, f"no answer: {exc}"
        self.last_probe.setdefault(group, {})[endpoint] = what
        if self.empties.observe(endpoint, ok, asked):
            reason = (f"{self.empties.streak[endpoint]} answers in a row without the {PROBE_TOKENS} tokens asked "
                      f"from decode {group} instance {endpoint} ({what}): the proxy would answer 200 with an empty "
                      "or short body (vllm-ascend #13140)")  # fmt: skip
            if await self._restart("empty", group, reason):
                self.empties.clear(self.groups[group].endpoints)
        return ok

    async def ask_proxy(self) -> tuple[bool, str]:
        """The 2-token request through the proxy itself, as a client sends it."""
        try:
            status, body = await self.http("POST", f"{self.co.proxies[0].url}/v1/completions",
                                           completion_request(self.model), self.settings.probe_timeout_s,
                                           {})  # fmt: skip
            return tokens_of(status, body)
        except (OSError, ValueError) as exc:
            return False, f"no answer: {exc}"

    async def judge_proxy(self, ok: bool, what: str, instances: Mapping[str, bool], silent_prefills: int = 0) -> None:
        fault = proxy_fault(ok, what, instances, silent_prefills)
        proxy = self.co.proxies[0].plan.component
        after = self.settings.proxy_fault_after
        if fault is not None and not self.proxy.get("fault"):
            then = f"it restarts after {after} such rounds in a row" if after else "proxy_fault_after 0: not restarted"
            self.co.port.emit("pd_watch", f"{fault} ({then})", proxy, "error")
        elif fault is None and self.proxy.get("fault"):
            self.co.port.emit("pd_watch", f"the proxy answers with tokens again ({what})", proxy)
        self.proxy = {"ok": ok, "what": what, "at": round(self.clock.time(), 3), "fault": fault}
        self.proxy_faults = self.proxy_faults + 1 if fault is not None else 0
        await self._restart_proxy(proxy, fault)

    async def _restart_proxy(self, proxy: str, fault: str | None, *, stuck: bool = False) -> None:
        """The thin action of `proxy_restart`, once per cooldown (as for a group): after `proxy_fault_after` rounds
        in a row, or at once for an activation thread found gone (`stuck`: its proof took minutes already)."""
        view: ComponentView | None = None
        with contextlib.suppress(UnknownComponentError):
            view = self.co.port.component(proxy)
        after = self.settings.proxy_fault_after
        if not proxy_restart(after if stuck else self.proxy_faults, after, view):
            return
        now = self.clock.monotonic()
        if now - self.acted.get(("hung", proxy), -RESTART_COOLDOWN_S) < RESTART_COOLDOWN_S:
            return
        self.acted[("hung", proxy)] = now
        reason = fault if stuck else f"{fault}, {self.proxy_faults} rounds in a row"
        self.proxy_faults = 0
        self.co.port.emit("pd_watch", f"the proxy restarts: {reason}", proxy, "warning", why="hung")
        self.co.port.restart([proxy], f"pd watch: {reason}", planned=False, cause="probe")

    def _pending(self) -> Mapping[str, float]:
        return self.co.proxies[0].pending_since if self.co.proxies else {}

    def _activation_flags(self) -> tuple[float | None, int | None]:
        comp = self.co.config.components.get(self.co.proxies[0].plan.component) if self.co.proxies else None
        if isinstance(comp, ProxyComponent):
            return comp.activation_check_s, comp.activation_retries
        return None, None

    async def _get(self, url: str, timeout: float) -> int:
        return (await self.http("GET", url, None, timeout, {}))[0]

    async def _activation_restart(self, reason: str) -> None:
        await self._restart_proxy(self.co.proxies[0].plan.component, reason, stuck=True)

    def _say_activation(self, message: str, level: str) -> None:
        after = self.settings.proxy_fault_after
        then = (" (it restarts)" if after else " (proxy_fault_after 0: not restarted)") if level == "error" else ""
        self.co.port.emit("pd_watch", message + then, self.co.proxies[0].plan.component, level)

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
        streaks = {g.name: {e: self.empties.streak.get(e, 0) for e in g.endpoints} for g in self._of("decode")}
        since = {g.name: {e: round(self.empties.since[e], 3) for e in g.endpoints if e in self.empties.since}
                 for g in self._of("decode")}  # fmt: skip
        return {"pd_watch": {"probes": {g: dict(p) for g, p in self.last_probe.items()}, "empty_streaks": streaks,
                             "empty_since": {g: s for g, s in since.items() if s},
                             "proxy": dict(self.proxy), "refused": dict(self.refused),
                             "activation": self.activation.last,
                             "restarted": {f"{g} ({why})": round(self.clock.time() - (self.clock.monotonic() - t), 3)
                                           for (why, g), t in self.acted.items() if g}}}  # fmt: skip


def _host(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    return f"{connect_host(host)}:{port}"

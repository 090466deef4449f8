"""The first rung of a data-parallel group's ladder: vLLM's fault-tolerance `retry`, before the gang restart.

A gang restart reloads the model on every rank of the group (30-60 min on the real cluster). vLLM 0.32 can recover
an engine fault in place (docs/architecture.md, "vLLM fault tolerance"): the faulty engine and its peers go
`unhealthy`, abort their requests and wait `engine_recovery_timeout_sec` for a `retry`, which rebuilds the group's
process group once every rank was told. So, per group whose config asks for it, this layer reads
`/fault_tolerance/status` of each of this node's ranks every `status_interval_s` (twice as often during a fault),
decides with the pure `ft_rules.decide`, sends `retry` to this node's ranks (the peers' agents do the same to
theirs) and follows it until every rank is `healthy` again or the timeout — and only then asks the group's new
generation from the coordinator, through which the gang restart runs as for any other rank failure. A retry that
fails or times out escalates at once; a rank whose process is gone goes straight to the gang restart (the
coordinator's `decide`; this layer only notes the skipped rung); a vLLM that cannot do it is said once — known at
the launch from its version (`ComponentView.ft_unsupported`: the flags were not rendered), or from a 404.

It is a `NodeLayer` of its own, attached before the coordinator so that it sees every rank failure: it never
holds a start and never takes a failure over. What happened at each rung is in its /status section
(`fault_tolerance`), in events (`ft_*`, carried by MQTT with the rest) and, on an escalation, in a post-mortem of
each local rank (`StackPort.postmortem`, with the ladder).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from loguru import logger

from nodeagent.config.model import VllmComponent
from nodeagent.core.bindaddr import connect_host, url_host
from nodeagent.core.http import new_session
from nodeagent.seam.host import Clock
from nodeagent.vllm import ft_client as vllm_ft
from nodeagent.vllm import ft_rules
from nodeagent.vllm.ft_rules import Attempt, RankStatus

if TYPE_CHECKING:
    from nodeagent.config.ft import FaultToleranceSpec
    from nodeagent.config.layout import Group
    from nodeagent.config.model import Config
    from nodeagent.core.failure import Failure
    from nodeagent.seam.stackport import ComponentView, Hold, MemberReport, StackPort

LADDER_KEPT = 20
"""Ladder steps kept per group for /status and post-mortems (older ones are in the event log)."""
IDLE_S = 10.0
"""How often a node without a group asking for fault tolerance looks whether a reload turned it on (no I/O)."""
LIVENESS_HOLD_SLACK_S = 10.0
"""Past vLLM's own deadline (the engine gives up after `engine_recovery_timeout_s`): the ranks' liveness is held
no longer than that, whatever the rung does."""


class GangPosition(Protocol):
    """What the rung reads of one of the coordinator's groups (`gang.GangState` is it)."""

    group: Group
    components: tuple[str, ...]
    acted: int
    """The generation this node's ranks run in."""

    @property
    def multi(self) -> bool: ...


class Coordination(Protocol):
    """What the rung needs of the coordinator beside it (`cluster.Coordinator` is it)."""

    @property
    def config(self) -> Config:
        """The node's config now (a reload's)."""

    port: StackPort
    node: str

    @property
    def gangs(self) -> Mapping[str, GangPosition]: ...

    @property
    def reachable(self) -> bool: ...

    def request_generation(self, group: str, reason: str, planned: bool = True) -> str: ...


class FtClient(Protocol):
    """How the rung talks to a rank's fault-tolerance API (`HttpFtClient`; the process-less tests give a fake)."""

    async def status(self, url: str) -> list[RankStatus]:
        """The rank's engines; raises `vllm_ft.FtError` (FtNotServed on a 404)."""

    async def retry(self, url: str, timeout_s: float) -> str:
        """Send `retry` (to be done within `timeout_s`); the request id vLLM answered with ("" if none)."""

    async def close(self) -> None: ...


class HttpFtClient:
    """`vllm_ft` over one aiohttp session, made at the first call (the daemon's loop is running by then)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _get(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = new_session()
        return self._session

    async def status(self, url: str) -> list[RankStatus]:
        return await vllm_ft.fetch_status(self._get(), url)

    async def retry(self, url: str, timeout_s: float) -> str:
        return await vllm_ft.apply(self._get(), url, "retry", instruction_timeout_s=timeout_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass(frozen=True)
class LocalRank:
    component: str
    rank: int
    url: str


@dataclass
class FtGroup:
    """One group of this node that asks for fault tolerance, and its current episode."""

    name: str
    ranks: tuple[LocalRank, ...]
    spec: FaultToleranceSpec
    supported: bool | None = None
    reason: str = "not known yet: the ranks have not answered /fault_tolerance/status"
    unsupported_said: bool = False
    statuses: dict[int, RankStatus] = field(default_factory=dict)
    fault_at: float | None = None
    """Monotonic time the episode's first fault was seen (None: no episode)."""
    attempt: Attempt | None = None
    escalated: int | None = None
    """The generation the group ran when this node escalated: nothing more is done until it changes."""
    generation: int = 0
    pids: dict[str, int | None] = field(default_factory=dict)
    ladder: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=LADDER_KEPT))
    recovered: int = 0
    escalations: int = 0

    @property
    def in_episode(self) -> bool:
        return self.fault_at is not None or self.attempt is not None or self.escalated is not None

    def rung(self) -> str:
        if self.escalated is not None:
            return "gang restart asked"
        if self.attempt is not None:
            return "retry sent"
        if self.fault_at is not None:
            return "fault seen"
        return "unsupported" if self.supported is False else "watching"


def ft_groups(coordinator: Coordination) -> dict[str, FtGroup]:
    """This node's groups whose ranks ask for fault tolerance (external launch: one `vllm serve` per rank)."""
    active = coordinator.config.active_components()
    out = {}
    for name, gs in coordinator.gangs.items():
        ranks, spec = [], None
        for comp in gs.components:
            cfg = active.get(comp)
            if isinstance(cfg, VllmComponent) and cfg.fault_tolerance.enabled and cfg.data_parallel_rank is not None:
                spec = spec or cfg.fault_tolerance
                url = f"http://{url_host(connect_host(cfg.host))}:{cfg.port}"
                ranks.append(LocalRank(comp, cfg.data_parallel_rank, url))
        if spec is not None:
            out[name] = FtGroup(name, tuple(ranks), spec)
    return out


class FtRung:
    """The fault-tolerance rung of this node's groups (`stackport.NodeLayer`), beside the coordinator."""

    def __init__(self, coordinator: Coordination, clock: Clock, client: FtClient | None = None) -> None:
        self.coordinator = coordinator
        self.port = coordinator.port
        self.clock = clock
        self.client: FtClient = client or HttpFtClient()
        self.groups = ft_groups(coordinator)
        self.by_component = {r.component: g for g in self.groups.values() for r in g.ranks}

    # ---- the watch ------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """The groups as the node's config says now (a reload changes a group's timeouts, or turns its fault
        tolerance on or off): a group kept keeps its episode; its spec and ranks are the config's."""
        fresh = ft_groups(self.coordinator)
        for name, group in fresh.items():
            kept = self.groups.get(name)
            if kept is not None:
                kept.spec, kept.ranks = group.spec, group.ranks
                fresh[name] = kept
        self.groups = fresh
        self.by_component = {r.component: g for g in self.groups.values() for r in g.ranks}

    async def run(self) -> None:
        try:
            while True:
                busy = any(g.fault_at is not None or g.attempt is not None for g in self.groups.values())
                every = min((g.spec.status_interval_s for g in self.groups.values()), default=IDLE_S)
                await self.clock.sleep(every / 2 if busy else every)
                self.refresh()
                for group in list(self.groups.values()):
                    try:
                        await self.step(group)
                    except Exception:  # a bug's last resort: the watch goes on
                        logger.exception(f"fault tolerance: the step of group {group.name} failed")
        finally:
            await self.client.close()

    async def step(self, g: FtGroup) -> None:
        here = self.port.snapshot().components
        gs = self.coordinator.gangs[g.name]
        pids = {r.component: here[r.component].pid for r in g.ranks}
        if pids != g.pids or gs.acted != g.generation:
            # a rank restarted or the group moved on: whatever was open, the gang restart took it over
            if g.in_episode:
                self._close(g, "superseded", f"the gang restart took over (generation {gs.acted})")
            g.pids, g.generation, g.statuses = pids, gs.acted, {}
            if g.supported is False:
                g.supported = None  # new processes, maybe of another vLLM: learned again (said only once)
        if g.escalated is not None:
            return  # waiting for the generation asked
        # known from the launch: the installed vLLM cannot take the flags, so they were not rendered
        told = next((here[r.component].ft_unsupported for r in g.ranks if here[r.component].ft_unsupported), None)
        if told is not None:
            g.supported, g.reason = False, told
        elif not all(here[r.component].up for r in g.ranks):
            return  # a rank not serving yet (its route refuses until ready)
        if g.supported is False and g.unsupported_said:
            return
        if told is None:
            await self._read(g)
        if self.coordinator.gangs[g.name].acted != g.generation:
            return  # the group moved on while the ranks were read (a peer escalated): the next step closes it
        situation = ft_rules.FtSituation(
            ranks=tuple(r.rank for r in g.ranks), statuses=dict(g.statuses), asked=True, supported=g.supported,
            support_reason=g.reason, now=self.clock.monotonic(),
            recovery_timeout_s=float(g.spec.engine_recovery_timeout_s), retry_timeout_s=g.spec.retry_timeout_s,
            fault_at=g.fault_at, attempt=g.attempt, unsupported_said=g.unsupported_said)  # fmt: skip
        await self._carry_out(g, ft_rules.decide(situation))

    async def _read(self, g: FtGroup) -> None:
        answers = await asyncio.gather(*(self._status(r) for r in g.ranks))
        g.statuses = {s.rank: s for s in answers if isinstance(s, RankStatus)}
        if False in answers:
            g.supported, g.reason = False, vllm_ft.supports_fault_tolerance(status_code=404).reason
        elif any(s.state != "unreachable" for s in g.statuses.values()) and g.supported is not True:
            g.supported, g.reason = True, vllm_ft.supports_fault_tolerance(status_code=200).reason
            self.port.emit("ft_armed", f"group {g.name}: fault tolerance armed ({g.reason}): a rank fault is "
                           "retried before the gang restart", None, group=g.name)  # fmt: skip

    async def _status(self, r: LocalRank) -> RankStatus | bool:
        """The rank's status (`unreachable` when it did not answer); False: it serves no FT routes (404)."""
        try:
            engines = await self.client.status(r.url)
        except vllm_ft.FtNotServed:
            return False
        except vllm_ft.FtError as exc:
            return RankStatus(r.rank, "unreachable", fault_info=str(exc))
        mine = [e for e in engines if e.rank == r.rank] or engines[:1]
        if not mine:
            return RankStatus(r.rank, "unreachable", fault_info="the status lists no engine")
        status = mine[0]
        if status.rank != r.rank:
            status = RankStatus(r.rank, status.state, status.fault_info, status.ft_error, status.last_ft_request_id)
        return status

    # ---- carrying the decision out ------------------------------------------------------------------------
    async def _carry_out(self, g: FtGroup, decision: ft_rules.Decision) -> None:
        now = self.clock.monotonic()
        if isinstance(decision, ft_rules.AllHealthy):
            if g.fault_at is not None:
                self._close(g, "cleared", "every rank healthy again without a retry")
        elif isinstance(decision, ft_rules.WaitRetry):
            self._fault_seen(g, now)
        elif isinstance(decision, ft_rules.Instruct):
            self._fault_seen(g, now)
            await self._instruct(g, decision, now)
        elif isinstance(decision, ft_rules.Recovered):
            took = now - (g.fault_at or decision.attempt.at)
            g.recovered += 1
            self._close(g, "recovered", f"every rank healthy again {took:.1f} s after the fault: no restart")
            self.port.emit("ft_recovered", f"group {g.name}: recovered by vLLM's retry in {took:.1f} s; no restart, "
                           "no new generation", None, group=g.name, seconds=round(took, 3))  # fmt: skip
        elif isinstance(decision, ft_rules.Escalate):
            self._fault_seen(g, now)
            self._escalate(g, decision.reason)
        elif isinstance(decision, ft_rules.Unsupported) and decision.announce:
            g.unsupported_said = True
            self._step(g, "retry", "unsupported", decision.reason)
            self.port.emit("ft_unsupported", f"group {g.name}: fault tolerance is asked for but {decision.reason}: "
                           "a rank fault goes straight to the gang restart", None, "warning",
                           group=g.name)  # fmt: skip

    def _fault_seen(self, g: FtGroup, now: float) -> None:
        if g.fault_at is not None:
            return
        g.fault_at = now
        # vLLM parks the busy loop and chats wait: the liveness canary fails while the retry recovers the group
        self._hold_liveness(g, "vLLM's fault-tolerance retry is recovering the group")
        bad = {s.rank: s.state for s in g.statuses.values() if s.state != "healthy"}
        what = ", ".join(f"rank {rank} {state}" for rank, state in sorted(bad.items()))
        self._step(g, "retry", "fault", f"{what} ({self._fault_info(g)})")
        self.port.emit("ft_fault", f"group {g.name}: engine fault ({what}, {self._fault_info(g)}) with the "
                       "processes alive", self._first_bad(g), "warning", group=g.name, states=bad)  # fmt: skip

    async def _instruct(self, g: FtGroup, decision: ft_rules.Instruct, now: float) -> None:
        urls = {r.rank: r.url for r in g.ranks}
        sent = await asyncio.gather(*(self._send(urls[rank], decision.timeout_s) for rank in decision.ranks))
        ids = {rank: rid for rank, rid in zip(decision.ranks, sent, strict=True) if not rid.startswith("!")}
        errors = [f"rank {rank}: {rid[1:]}" for rank, rid in zip(decision.ranks, sent, strict=True)
                  if rid.startswith("!")]  # fmt: skip
        g.attempt = ft_rules.attempt_for(decision, now, ids)
        ranks = ", ".join(str(r) for r in decision.ranks)
        detail = f"retry sent to rank {ranks}; waiting up to {decision.timeout_s:.0f} s for every rank healthy"
        if errors:
            detail += "; refused: " + "; ".join(errors)
        self._step(g, "retry", "sent", detail, request_ids={str(k): v for k, v in ids.items()})
        self.port.emit("ft_retry", f"group {g.name}: {detail}", self._first_bad(g), "warning", group=g.name,
                       request_ids={str(k): v for k, v in ids.items()}, timeout_s=decision.timeout_s)  # fmt: skip

    async def _send(self, url: str, timeout_s: float) -> str:
        """The request id ("" when the server gives none), or `!` and why the rank did not take the retry."""
        try:
            return await self.client.retry(url, timeout_s)
        except vllm_ft.FtError as exc:
            return f"!{exc}"

    def _escalate(self, g: FtGroup, reason: str) -> None:
        gs = self.coordinator.gangs[g.name]
        g.escalations += 1
        g.escalated = gs.acted
        g.fault_at = g.attempt = None
        nxt = f"gang restart: generation {gs.acted + 1} on {', '.join(gs.group.nodes)}"
        self._step(g, "retry", "escalated", reason)
        self._step(g, "gang", "asked", nxt)
        # the gang restart replaces the ranks: a local restart meanwhile would only count a second failure
        self._hold_liveness(g, f"the retry failed; {nxt} is asked")
        self.port.emit("ft_escalate", f"group {g.name}: {reason}; next rung: {nxt}", self._first_bad(g), "warning",
                       group=g.name, generation=gs.acted + 1)  # fmt: skip
        for r in g.ranks:
            self.port.postmortem(r.component, f"engine fault not recovered by vLLM's retry: {reason}", list(g.ladder),
                                 nxt)  # fmt: skip
        cause = f"fault tolerance on {self.coordinator.node}: {reason}"
        if self.coordinator.reachable or gs.multi:
            self.coordinator.request_generation(g.name, cause, planned=False)  # queued: merges with one asked already
        else:  # a one-node group while etcd is away restarts here, as the coordinator's decide would let it
            self.port.restart([r.component for r in g.ranks], cause, planned=False)

    def _close(self, g: FtGroup, outcome: str, detail: str) -> None:
        if g.escalated is None:
            self._step(g, "retry", outcome, detail)
        else:
            self._step(g, "gang", outcome, detail)
        g.fault_at = g.attempt = g.escalated = None
        self._hold_liveness(g, None)

    def _hold_liveness(self, g: FtGroup, reason: str | None) -> None:
        """Hold (reason) or release (None) the liveness of this node's ranks of the group; a hold lasts at most
        vLLM's own recovery window from now."""
        for_s = g.spec.engine_recovery_timeout_s + LIVENESS_HOLD_SLACK_S
        for r in g.ranks:
            self.port.hold_liveness(r.component, reason, for_s)

    def _step(self, g: FtGroup, rung: str, outcome: str, detail: str, **data: Any) -> None:
        g.ladder.append({"at": self.clock.time(), "rung": rung, "outcome": outcome, "detail": detail,
                         "generation": self.coordinator.gangs[g.name].acted, **data})  # fmt: skip

    def _first_bad(self, g: FtGroup) -> str | None:
        bad = {s.rank for s in g.statuses.values() if s.state != "healthy"}
        return next((r.component for r in g.ranks if r.rank in bad), g.ranks[0].component if g.ranks else None)

    @staticmethod
    def _fault_info(g: FtGroup) -> str:
        infos = sorted({s.fault_info for s in g.statuses.values() if s.fault_info})
        return ", ".join(infos) or "no fault_info"

    # ---- what the node asks (NodeLayer) -------------------------------------------------------------------
    def gate(self, comp: ComponentView, operator: bool) -> Hold | None:
        return None

    def decide(self, comp: ComponentView, failure: Failure) -> None:
        """A rank's process is gone or being stopped (an exit, a failed probe; asked before its tree is gone): a
        retry cannot bring back a lost rank. Noted as the skipped rung; the coordinator decides the gang restart."""
        g = self.by_component.get(comp.name)
        if g is None or failure.permanent:
            return None  # a permanent failure is this node's (no group restart): not a rung of the ladder
        if g.in_episode:
            self._close(g, "superseded", f"{comp.name}: {failure.detail}")
        why = (f"vLLM cannot retry ({g.reason})" if g.supported is False
               else f"{comp.name} {failure.detail}: a retry cannot bring back a lost rank")  # fmt: skip
        self._step(g, "retry", "skipped", why)
        self.port.emit("ft_skipped", f"group {g.name}: retry skipped, {why}; next rung: the gang restart",
                       comp.name, group=g.name)  # fmt: skip
        return None

    def command(self, comp: ComponentView, action: str, drain: bool, by: str) -> None:
        return None

    def member_report(self) -> MemberReport | None:
        return None

    def on_node_change(self) -> None:
        return None

    def status_section(self) -> dict[str, Any]:
        if not self.groups:
            return {}
        return {"fault_tolerance": {name: self.group_status(g) for name, g in self.groups.items()}}

    def group_status(self, g: FtGroup) -> dict[str, Any]:
        ranks: dict[str, Mapping[str, Any]] = {}
        for r in g.ranks:
            s = g.statuses.get(r.rank)
            ranks[r.component] = {"rank": r.rank, "state": s.state if s else None,
                                  "fault_info": s.fault_info if s else None, "ft_error": s.ft_error if s else None}
        attempt = None
        if g.attempt is not None:
            attempt = {"ranks": list(g.attempt.ranks), "request_ids": {str(k): v for k, v in
                                                                        g.attempt.request_ids.items()},
                       "left_s": round(max(0.0, g.attempt.deadline - self.clock.monotonic()), 1)}  # fmt: skip
        return {"supported": g.supported, "reason": g.reason, "rung": g.rung(), "ranks": ranks, "attempt": attempt,
                "recovered": g.recovered, "escalated": g.escalations,
                "engine_recovery_timeout_s": g.spec.engine_recovery_timeout_s,
                "retry_timeout_s": g.spec.retry_timeout_s, "ladder": list(g.ladder)}  # fmt: skip

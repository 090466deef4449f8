"""Pure: the first rung of a data-parallel group's ladder — vLLM's fault-tolerance `retry` before a gang restart.

A gang restart reloads the model on every rank (30-60 min on the real cluster). vLLM 0.32 can instead recover a
group in place: on a fault each engine goes `unhealthy`, aborts its requests and waits
`engine_recovery_timeout_sec` for a `retry`, which rebuilds the data-parallel process group from *every* rank of
the group (docs/architecture.md, "vLLM fault tolerance"). So a retry helps only while every rank is alive and
has seen the fault; a rank that is gone, `dead`, or silent can only be brought back by the gang restart, and a
retry that fails or runs out of time escalates at once — one retry per fault episode, never a loop. Each agent
judges and instructs its own node's ranks (`FtSituation.ranks`); the peers' agents do the same, and whichever
escalates first asks the group's one new generation.

0.32 has no `pause` instruction and no timeout in the request: the timeout here is ours (how long the agent waits
for the ranks to report `healthy` again), capped by the engines' own recovery timeout.

`decide` takes what the caller learned (statuses parsed by `vllm_ft`, the clock, what was tried) and answers one
of: `Instruct` (send `retry` to these ranks), `WaitRetry` (look again by `deadline`), `Recovered`, `AllHealthy`
(nothing to do), `Escalate` (gang restart now) or `Unsupported` (gang restart; `announce` is true once).
`supports_fault_tolerance` is the rule for whether a vLLM can take part at all (from its version or its status
endpoint): rendering asks it before it writes the flags, the rung when a rank answers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

FIRST_VERSION = (0, 32)
"""The first vLLM release whose fault-tolerance API the agent was written against (`vllm_ft`)."""
_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)")

RankState = Literal["healthy", "unhealthy", "dead", "unreachable"]
"""vLLM's three `EngineStatusType`s, plus `unreachable`: the rank's server did not answer its status."""

Instruction = Literal["retry"]
"""The only instruction vLLM 0.32's `/fault_tolerance/apply` accepts."""

GONE_STATES: frozenset[str] = frozenset({"dead", "unreachable"})


@dataclass(frozen=True)
class RankStatus:
    """One rank's entry of `GET /fault_tolerance/status`, or `unreachable` when its server did not answer."""

    rank: int
    state: RankState
    fault_info: str | None = None
    ft_error: str | None = None
    last_ft_request_id: str | None = None


@dataclass(frozen=True)
class Attempt:
    """A retry already sent in this fault episode: to which ranks, when, and the request id each rank gave."""

    ranks: tuple[int, ...]
    at: float
    deadline: float
    request_ids: Mapping[int, str] = field(default_factory=dict)
    instruction: Instruction = "retry"


@dataclass(frozen=True)
class FtSituation:
    """Everything the rule looks at; `fault_at` is when the episode's first fault was seen (None: no fault)."""

    ranks: tuple[int, ...]
    """The DP ranks this agent watches and instructs: its node's ranks of the group. Each agent retries its own;
    vLLM's retry completes once every rank of the group was told (the peers' agents do the same)."""
    statuses: Mapping[int, RankStatus]
    asked: bool
    """The config enables fault tolerance for this group."""
    supported: bool | None
    """The rendered vLLM supports it: learned from its version or its status endpoint; None while not known."""
    support_reason: str
    now: float
    recovery_timeout_s: float
    """The engines' `engine_recovery_timeout_sec`: past `fault_at` plus this, they have given up."""
    retry_timeout_s: float
    """How long a sent retry may take to bring every rank back to `healthy`."""
    failed_rank: int | None = None
    """A rank the agent itself saw fail (its process exited, a probe failed), if any."""
    fault_at: float | None = None
    attempt: Attempt | None = None
    unsupported_said: bool = False


@dataclass(frozen=True)
class Instruct:
    ranks: tuple[int, ...]
    instruction: Instruction
    timeout_s: float


@dataclass(frozen=True)
class WaitRetry:
    deadline: float
    reason: str


@dataclass(frozen=True)
class Recovered:
    attempt: Attempt


@dataclass(frozen=True)
class AllHealthy:
    pass


@dataclass(frozen=True)
class Escalate:
    reason: str


@dataclass(frozen=True)
class Unsupported:
    reason: str
    announce: bool


Decision = Instruct | WaitRetry | Recovered | AllHealthy | Escalate | Unsupported


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _missing_or_gone(s: FtSituation) -> list[int]:
    gone = []
    for rank in s.ranks:
        status = s.statuses.get(rank)
        if status is None or status.state in GONE_STATES:
            gone.append(rank)
    return gone


def _judge_attempt(s: FtSituation, attempt: Attempt) -> Decision:
    refused = [rank for rank in attempt.ranks if rank not in attempt.request_ids]
    if refused:
        return Escalate(f"rank {_ranks(refused)} did not accept the retry")
    for rank in attempt.ranks:
        status = s.statuses.get(rank)
        sent_id = attempt.request_ids.get(rank)
        if status is not None and status.ft_error and sent_id and status.last_ft_request_id == sent_id:
            return Escalate(f"retry failed on rank {rank}: {status.ft_error}")
    gone = _missing_or_gone(s)
    if gone:
        return Escalate(f"rank {_ranks(gone)} lost during the retry")
    if all(s.statuses[rank].state == "healthy" for rank in s.ranks):
        return Recovered(attempt)
    if s.now >= attempt.deadline:
        return Escalate(f"retry timed out after {attempt.deadline - attempt.at:.0f} s")
    waiting = [r for r in s.ranks if s.statuses[r].state != "healthy"]
    return WaitRetry(attempt.deadline, f"retry sent; rank {_ranks(waiting)} not healthy yet")


def decide(s: FtSituation) -> Decision:
    """The group's next step on the fault-tolerance rung (see the module docstring)."""
    if not s.asked:
        return Unsupported("fault tolerance is not enabled for this group in the config", announce=False)
    if s.supported is None:
        return Unsupported(f"not known whether this vLLM supports fault tolerance ({s.support_reason})",
                           announce=False)
    if not s.supported:
        return Unsupported(s.support_reason, announce=not s.unsupported_said)
    if s.attempt is not None:
        return _judge_attempt(s, s.attempt)
    gone = _missing_or_gone(s)
    if s.failed_rank is not None and s.failed_rank in gone:
        return Escalate(f"rank {s.failed_rank} is gone: a retry needs every rank of the group alive")
    if gone:
        return Escalate(f"rank {_ranks(gone)} gone (dead or not answering): a retry needs every rank alive")
    unhealthy = [r for r in s.ranks if s.statuses[r].state == "unhealthy"]
    if not unhealthy:
        if s.failed_rank is not None:
            return Escalate(f"rank {s.failed_rank} failed but every rank reports healthy: not a fault a retry "
                            "can recover")
        return AllHealthy()
    fault_at = s.now if s.fault_at is None else s.fault_at
    engines_give_up = fault_at + s.recovery_timeout_s
    if s.now >= engines_give_up:
        return Escalate(f"the engines' recovery timeout ({s.recovery_timeout_s:.0f} s) has passed")
    if len(unhealthy) < len(s.ranks):
        # The peers of a faulty rank notice it at their next all2all; retry must reach all of them at once.
        latest_send = engines_give_up - s.retry_timeout_s
        healthy = [r for r in s.ranks if r not in unhealthy]
        if s.now >= latest_send:
            return Escalate(f"rank {_ranks(healthy)} never reported the fault of rank {_ranks(unhealthy)}")
        return WaitRetry(latest_send, f"rank {_ranks(unhealthy)} unhealthy, waiting for rank {_ranks(healthy)}")
    return Instruct(tuple(s.ranks), "retry", min(s.retry_timeout_s, engines_give_up - s.now))


def attempt_for(decision: Instruct, now: float, request_ids: Mapping[int, str]) -> Attempt:
    """What the caller records after sending `decision`: the next `decide` judges it."""
    return Attempt(ranks=decision.ranks, at=now, deadline=now + decision.timeout_s, request_ids=dict(request_ids),
                   instruction=decision.instruction)


@dataclass(frozen=True)
class Support:
    supported: bool | None
    """None: not known from what was given."""
    reason: str


def supports_fault_tolerance(version_text: str | None = None, status_code: int | None = None) -> Support:
    """From the status endpoint's answer (it wins: it is the server itself) or else from the version string."""
    if status_code == 200:
        return Support(True, "the fault-tolerance status endpoint answers")
    if status_code == 404:
        return Support(False, "the vLLM serves no /fault_tolerance routes (older than 0.32, or started without "
                              "--enable-fault-tolerance)")
    if version_text:
        match = _VERSION_RE.match(version_text)
        if match:
            version = (int(match.group(1)), int(match.group(2)))
            if version >= FIRST_VERSION:
                return Support(True, f"vLLM {version_text.strip()} has the fault-tolerance API (0.32 or later)")
            return Support(False, f"vLLM {version_text.strip()} predates the fault-tolerance API of vLLM 0.32")
        return Support(None, f"cannot read a version from {version_text.strip()!r}")
    if status_code is not None:
        return Support(None, f"the fault-tolerance status endpoint answered {status_code}")
    return Support(None, "no version and no status answer yet")

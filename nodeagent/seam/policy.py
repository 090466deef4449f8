"""Pure restart policy: backoff, crash-loop detection, the escalation ladder, intent and dependency gates.

Nothing here reads a clock or touches a process: every function takes `now` (wall-clock seconds, so the
state the supervisor persists stays meaningful across agent restarts and reboots) and returns a decision the
supervisor carries out. The supervisor persists `RestartTracker.to_dict()` / `RedeployTracker.to_dict()`
in its state file so a restarted agent does not forget a crash loop.

The ladder (DESIGN §5):
1. A component that ran stably and then fails is restarted after `first_delay_s` (default 0: downtime is
   what operators pay for).
2. Further consecutive failures back off exponentially: `backoff_initial_s` doubling up to `backoff_max_s`.
   That is the visible crash-loop. `stable_after_s` of healthy running resets it.
3. `redeploy_after_failures` failures within `failure_window_s` escalate to a node redeploy (stop all in
   reverse order, clean all residue, start all in order).
4. Once `failed_after_redeploys` redeploys already ran within the window, the node is `failed` (alert) and
   keeps retrying at `backoff_max_s` until it runs stably again or an operator runs `nodeagentctl reset`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from nodeagent.config.model import DependencyEdge, RestartSpec

Action = Literal["restart", "redeploy", "failed"]

_MAX_EXPONENT = 60  # 2**60 * any sane initial delay is far past any cap; avoids float overflow


@dataclass(frozen=True)
class RestartDecision:
    """What the supervisor does about a failure.

    `restart`: restart this component after `delay_s`. `redeploy`: node-level recovery after `delay_s`.
    `failed`: mark the node failed and alert, and still run the redeploy after `delay_s` (the cap).
    """

    action: Action
    delay_s: float
    reason: str
    consecutive_failures: int
    crash_loop: bool


def backoff_delay(spec: RestartSpec, consecutive_failures: int) -> float:
    """Delay before the restart that follows the n-th consecutive failure (n >= 1)."""
    if consecutive_failures <= 1:
        return spec.first_delay_s
    exponent = min(consecutive_failures - 2, _MAX_EXPONENT)
    return min(spec.backoff_initial_s * 2.0**exponent, spec.backoff_max_s)


@dataclass
class RestartTracker:
    """One component's restart history; `to_dict`/`from_dict` carry it across agent restarts."""

    spec: RestartSpec = field(default_factory=RestartSpec)
    consecutive_failures: int = 0
    failure_times: list[float] = field(default_factory=list)
    """Failures inside the escalation window (pruned as time passes)."""
    started_at: float | None = None
    healthy_since: float | None = None
    """First healthy observation since the last start; stability is measured from here, not from the
    start, so a vLLM that loads for 40 minutes and then dies still counts as crash-looping."""
    last_failure_at: float | None = None
    last_reason: str = ""
    retry_at: float | None = None
    """When the pending restart is due (status shows the backoff)."""
    failures_total: int = 0

    _STATE_FIELDS = (
        "consecutive_failures",
        "failure_times",
        "started_at",
        "healthy_since",
        "last_failure_at",
        "last_reason",
        "retry_at",
        "failures_total",
    )

    @property
    def crash_loop(self) -> bool:
        """The one definition (README, status NOTE, /metrics): two or more failures in a row with no stable run
        in between, so restarts back off. It clears once the current run has been healthy for `stable_after_s`
        (10 min by default; an adoption does not restart that clock), at a node redeploy, on `nodeagentctl reset`,
        and when its stack run ends (`NodeIntent.begin_stack`). Escalation is another rule:
        `redeploy_after_failures` (5) within the window."""
        return self.consecutive_failures >= 2

    def record_start(self, now: float) -> None:
        """The supervisor launched the component."""
        self.started_at = now
        self.healthy_since = None
        self.retry_at = None

    def is_stable(self, now: float) -> bool:
        return self.healthy_since is not None and now - self.healthy_since >= self.spec.stable_after_s

    def record_healthy(self, now: float) -> bool:
        """Call on every passing liveness check (or once running, for kinds without probes).

        Returns True when this observation completed a stable run and so cleared the backoff.
        """
        if self.healthy_since is None:
            self.healthy_since = now
        if self.is_stable(now) and (self.consecutive_failures or self.failure_times):
            self.consecutive_failures = 0
            self.failure_times = []
            return True
        return False

    def record_failure(self, now: float, reason: str, *, node_failed: bool = False) -> RestartDecision:
        """The component died or failed liveness: decide restart/redeploy and the delay.

        `node_failed` (RedeployTracker.failed) pins every delay at the cap while the node is failed.
        """
        if self.is_stable(now):
            self.consecutive_failures = 0
            self.failure_times = []
        window = self.spec.failure_window_s
        self.failure_times = [t for t in self.failure_times if now - t < window]
        self.failure_times.append(now)
        self._note_failure(now, reason)

        n = self.consecutive_failures
        delay = self.spec.backoff_max_s if node_failed else backoff_delay(self.spec, n)
        action: Action = "restart"
        why = reason
        if len(self.failure_times) >= self.spec.redeploy_after_failures:
            action = "redeploy"
            why = f"{len(self.failure_times)} failures within {window:g}s, last: {reason}"
            # The redeploy starts this component's ladder afresh; RedeployTracker remembers the escalation.
            self.failure_times = []
            self.consecutive_failures = 0
        elif n >= 2:
            why = f"{reason} (failure {n} in a row, backing off {delay:g}s)"
        self.retry_at = now + delay
        return RestartDecision(action, delay, why, n, n >= 2)

    def _note_failure(self, now: float, reason: str) -> None:
        self.consecutive_failures += 1
        self.failures_total += 1
        self.last_failure_at = now
        self.last_reason = reason
        self.started_at = None
        self.healthy_since = None

    def record_permanent(self, now: float, reason: str) -> RestartDecision:
        """A failure no restart can fix (failure.classify): `failed`, retried only at the cap, never escalated
        to a node redeploy (it cannot help and it would take healthy components down)."""
        self._note_failure(now, reason)
        delay = self.spec.backoff_max_s
        self.retry_at = now + delay
        return RestartDecision("failed", delay, f"{reason} (permanent: retrying every {delay:g}s)",
                               self.consecutive_failures, True)  # fmt: skip

    def record_redeploy(self, now: float) -> None:
        """The node redeployed: every component (not only the escalating one) starts a fresh ladder."""
        self.consecutive_failures = 0
        self.failure_times = []
        self.started_at = None
        self.healthy_since = None
        self.retry_at = None

    def reset(self) -> None:
        """`nodeagentctl reset`: forget failures (keeps the lifetime total for metrics)."""
        total = self.failures_total
        for name in self._STATE_FIELDS:
            setattr(self, name, _defaults(RestartTracker)[name])
        self.failures_total = total

    def status(self, now: float) -> dict[str, Any]:
        """What /status shows: the backoff and crash-loop state."""
        return {
            "consecutive_failures": self.consecutive_failures,
            "crash_loop": self.crash_loop,
            "failures_in_window": sum(1 for t in self.failure_times if now - t < self.spec.failure_window_s),
            "retry_in_s": max(0.0, self.retry_at - now) if self.retry_at is not None else None,
            "last_failure_at": self.last_failure_at,
            "last_reason": self.last_reason,
            "stable": self.is_stable(now),
            "failures_total": self.failures_total,
        }

    def to_dict(self) -> dict[str, Any]:
        return {name: _copy(getattr(self, name)) for name in self._STATE_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any], spec: RestartSpec | None = None) -> RestartTracker:
        """Tolerates missing and unknown keys so an upgraded agent reads an older state file."""
        tracker = cls(spec=spec or RestartSpec())
        for name in cls._STATE_FIELDS:
            if name in data:
                setattr(tracker, name, _copy(data[name]))
        return tracker


@dataclass
class RedeployTracker:
    """Node-level: counts redeploys within the window and holds the `failed` state."""

    redeploy_times: list[float] = field(default_factory=list)
    failed: bool = False
    failed_reason: str = ""
    redeploys_total: int = 0

    _STATE_FIELDS = ("redeploy_times", "failed", "failed_reason", "redeploys_total")

    def escalate(self, decision: RestartDecision, now: float, spec: RestartSpec) -> RestartDecision:
        """Turn a component's `redeploy` into `redeploy` or `failed` (spec: the escalating component's)."""
        if decision.action == "restart":
            return decision
        self.redeploy_times = [t for t in self.redeploy_times if now - t < spec.failure_window_s]
        already = len(self.redeploy_times)
        self.redeploy_times.append(now)
        self.redeploys_total += 1
        if self.failed or already >= spec.failed_after_redeploys:
            if not self.failed:
                window = f"{spec.failure_window_s:g}s"
                self.failed_reason = (
                    f"{already} redeploys within {window} did not help; last: {decision.reason}"
                )
            self.failed = True
            return replace(
                decision,
                action="failed",
                delay_s=spec.backoff_max_s,
                reason=f"node failed ({self.failed_reason}); retrying every {spec.backoff_max_s:g}s",
            )
        return replace(decision, action="redeploy")

    def record_stable(self) -> None:
        """Call when every component tracker `is_stable(now)`: the node recovered by itself."""
        self.redeploy_times = []
        self.failed = False
        self.failed_reason = ""

    def reset(self) -> None:
        """`nodeagentctl reset`."""
        self.record_stable()

    def to_dict(self) -> dict[str, Any]:
        return {name: _copy(getattr(self, name)) for name in self._STATE_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RedeployTracker:
        tracker = cls()
        for name in cls._STATE_FIELDS:
            if name in data:
                setattr(tracker, name, _copy(data[name]))
        return tracker


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def _defaults(cls: Any) -> dict[str, Any]:
    blank = cls()
    return {name: _copy(getattr(blank, name)) for name in cls._STATE_FIELDS}


@dataclass(frozen=True)
class Intent:
    """Operator intent, persisted apart from the observed state (DESIGN §3)."""

    desired: Literal["running", "stopped"] = "running"
    paused: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"desired": self.desired, "paused": self.paused}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Intent:
        desired = data.get("desired", "running")
        if desired not in ("running", "stopped"):
            raise ValueError(f"intent.desired must be 'running' or 'stopped', got {desired!r}")
        return cls(desired=desired, paused=bool(data.get("paused", False)))


def hold_for_dependency(kind: str, etcd_reachable: bool, first_start: bool = False) -> str | None:
    """Why a restart of this kind must wait, or None. Hold datasystem restarts while etcd is down.

    The worker cannot start without etcd (dscli hangs until its timeout), so restarting it would only burn
    the backoff; a running worker re-registers by itself once etcd is back (DESIGN §10).
    """
    if kind == "datasystem" and not etcd_reachable:
        if first_start:
            return "waiting for etcd: the datasystem worker starts once etcd answers"
        return "etcd unreachable: holding the datasystem worker restart until etcd is back"
    return None


def restarts_with(dependent_kind: str, dependency_kind: str, edge: DependencyEdge) -> bool:
    """Does the dependent restart when its dependency restarts?

    The edge's `restart_with` wins. Defaults:
    - never for an etcd dependency (a local etcd restart with its data intact keeps every registration; the
      worker reconnects);
    - never for vLLM on its datasystem worker: measured with the real worker, a `yr.datasystem` client kept
      open across a worker restart (SIGTERM or SIGKILL, down for 30 s) works again as soon as the new worker
      is up, and vllm-ascend's yuanrong backend turns pool errors into cache misses — restarting vLLM (a
      30-60 min DeepSeek-V4 reload) would buy nothing (docs/architecture.md);
    - otherwise yes (a `process` follows what it depends on).
    """
    if edge.restart_with is not None:
        return edge.restart_with
    if dependency_kind == "etcd":
        return False
    return not (dependency_kind == "datasystem" and dependent_kind == "vllm")

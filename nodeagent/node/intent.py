"""The node's durable memory of what the operator wants and what the policy has seen (`intent.json`).

Operator intent (desired state per component, maintenance pause and who set it) must survive a power cut; restart
counters and each component's history (restarts, last exit, last failure) are written without fsync — losing the
last few on a power cut is harmless, losing them on every `kill -9` or upgrade of the agent is not.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import msgspec

from nodeagent.config.model import RestartSpec
from nodeagent.core.statefile import StateStore
from nodeagent.core.states import Desired
from nodeagent.seam.policy import RedeployTracker, RestartTracker

HISTORY_FIELDS = ("restarts", "restarts_by_cause", "last_exit", "failure", "loads")


def stack_identity(cfg: Any, where: str) -> str:
    """One stack run of a component: its config section and where it runs (the host, or which container)."""
    return hashlib.sha256(msgspec.json.encode(cfg, enc_hook=str) + b"\0" + where.encode()).hexdigest()[:16]


class NodeIntent:
    def __init__(self, store: StateStore, specs: dict[str, RestartSpec]) -> None:
        self.store = store
        self.data = store.load_intent()
        saved = self.data.get("trackers", {})
        self.trackers = {name: RestartTracker.from_dict(saved.get(name, {}), spec) for name, spec in specs.items()}
        self.redeploys = RedeployTracker.from_dict(self.data.get("redeploys", {}))
        self.changed = asyncio.Event()

    # ---- operator intent ---------------------------------------------------------------------------------
    def desired(self, name: str) -> Desired:
        """Anything but "stopped" (none saved, a hand-edited file) is running, as every check read it before."""
        return Desired.STOPPED if self.data.get("desired", {}).get(name) == Desired.STOPPED else Desired.RUNNING

    def set_desired(self, name: str, desired: str) -> None:
        self.data.setdefault("desired", {})[name] = desired
        self.save()

    @property
    def paused(self) -> bool:
        return bool(self.data.get("paused", False))

    def pause_info(self) -> dict[str, Any] | None:
        if not self.paused:
            return None
        return {"by": self.data.get("paused_by", "?"), "at": self.data.get("paused_at")}

    def set_paused(self, paused: bool, by: str = "operator") -> None:
        self.data["paused"] = paused
        if paused:
            self.data["paused_by"], self.data["paused_at"] = by, time.time()
        else:
            self.data.pop("paused_by", None)
            self.data.pop("paused_at", None)
        self.save()

    # ---- history ------------------------------------------------------------------------------------------
    def history(self, name: str) -> dict[str, Any]:
        return dict(self.data.get("history", {}).get(name, {}))

    def record_history(self, name: str, values: dict[str, Any]) -> bool:
        """Keep what changed; True if anything did (the caller then saves, without fsync)."""
        history = self.data.setdefault("history", {})
        entry = {k: values.get(k) for k in HISTORY_FIELDS}
        if history.get(name) == entry:
            return False
        history[name] = entry
        return True

    # ---- stack runs ---------------------------------------------------------------------------------------
    def begin_stack(self, name: str, identity: str) -> bool:
        """A crash loop belongs to one stack run: once the component's stack changed since its counters were kept
        (`stack_identity`: its config section, the host or another container), they start afresh (True when
        there was a failure to forget). One recorded by an agent before this field is kept: nothing says its stack
        changed."""
        stacks = self.data.setdefault("stacks", {})
        before, stacks[name] = stacks.get(name), identity
        tracker = self.trackers[name]
        if before is None or before == identity or not (tracker.consecutive_failures or tracker.failure_times):
            return False
        tracker.reset()
        return True

    # ---- persistence --------------------------------------------------------------------------------------
    def save(self, durable: bool = True, notify: bool = True) -> None:
        self.data["trackers"] = {n: t.to_dict() for n, t in self.trackers.items()}
        self.data["redeploys"] = self.redeploys.to_dict()
        self.store.save_intent(self.data, durable)
        if notify:
            self.notify()

    def notify(self) -> None:
        """Wake everything waiting on the start gate."""
        self.changed.set()
        self.changed = asyncio.Event()

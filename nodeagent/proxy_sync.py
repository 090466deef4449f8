"""The PD proxy follows the gangs: vllm-ascend's proxy never drops a dead backend by itself (its `/healthcheck`
always says ok), so the agent that runs it takes a group's endpoints out while the group restarts and puts
them back once every rank is ready again — clients are routed to the healthy groups instead of failing.

A group is healthy when every one of its members reports each of its ranks up (ready where it serves HTTP)
for the group's current generation. The proxy takes `POST /instances/remove|add {"type", "instances"}`;
removal drains in-flight requests first, an added instance is activated once its `/v1/models` answers. With no
healthy group of a kind left the proxy component is reported not ready. A restarted proxy starts with every
endpoint of its command line: the sync re-applies what it knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.layout import Group, ProxyPlan

if TYPE_CHECKING:
    from nodeagent.cluster import Coordinator

PERIOD_S = 1.0
UP = ("running", "ready")


def group_healthy(group: Group, members: dict[str, dict[str, Any]], generation: int | None) -> tuple[bool, str]:
    """(healthy, why not) from the members' records (pure)."""
    for proc in group.processes:
        record = members.get(proc.node)
        if record is None:
            return False, f"{proc.node} has no agent"
        comp = (record.get("components") or {}).get(proc.component) or {}
        if comp.get("state") not in UP or (proc.endpoint and not comp.get("ready")):
            return False, f"{proc.node}/{proc.component} is {comp.get('state', 'absent')}"
        ack = (record.get("gangs") or {}).get(group.name) or {}
        if generation is not None and ack.get("generation") not in (None, generation):
            return False, f"{proc.node} runs generation {ack.get('generation')}, the group is at {generation}"
    return True, ""


def desired_backends(groups: list[Group], health: dict[str, bool]) -> dict[str, set[str]]:
    """{"prefill": endpoints, "decode": endpoints} that should be in the proxy now (pure)."""
    out: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for group in groups:
        if group.kind in out and health.get(group.name):
            out[group.kind].update(group.endpoints)
    return out


class ProxySync:
    def __init__(self, coordinator: Coordinator, plan: ProxyPlan) -> None:
        self.co = coordinator
        self.plan = plan
        self.groups = [g for g in coordinator.layout.groups if g.kind in ("prefill", "decode")]
        self.applied: dict[str, set[str]] | None = None
        self.proxy_pid: int | None = None
        self.health: dict[str, str] = {}
        """group → why it is out of the proxy ("" when in)."""

    @property
    def url(self) -> str:
        host = self.plan.host if self.plan.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.plan.port}"

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # a bug must not end the sync
                logger.exception("proxy sync step failed")
            await asyncio.sleep(PERIOD_S)

    async def step(self) -> None:
        comp = self.co.sup.components.get(self.plan.component)
        if comp is None:
            return
        pid = comp.record.pid if comp.record is not None else None
        if pid != self.proxy_pid:
            self.proxy_pid = pid
            all_in = {"prefill": set(self.plan.prefillers), "decode": set(self.plan.decoders)}
            self.applied = all_in if pid is not None else None  # a new proxy starts with its command line
        members = {n: m.record for n, m in self.co.membership.members.items()}
        health: dict[str, bool] = {}
        for group in self.groups:
            record = self.co.records.get(group.name)
            ok, why = group_healthy(group, members, record.generation if record is not None else None)
            health[group.name] = ok
            if self.health.get(group.name) != ("" if ok else why):
                self.co.sup.events.emit("proxy_backends", f"group {group.name} " + (
                    "back in the proxy" if ok else f"out of the proxy: {why}"), self.plan.component)  # fmt: skip
            self.health[group.name] = "" if ok else why
        want = desired_backends(self.groups, health)
        empty = [kind for kind in ("prefill", "decode") if not want[kind]]
        comp.block_ready("backends", f"no healthy {' or '.join(empty)} group" if empty else None)
        if self.applied is None or not comp.up.is_set():
            return
        for kind in ("prefill", "decode"):
            gone, back = self.applied[kind] - want[kind], want[kind] - self.applied[kind]
            if gone and await self._post("remove", kind, gone):
                self.applied[kind] -= gone
            if back and await self._post("add", kind, back):
                self.applied[kind] |= back

    async def _post(self, what: str, kind: str, instances: set[str]) -> bool:
        body = json.dumps({"type": kind, "instances": sorted(instances)}).encode()

        def call() -> bool:
            request = urllib.request.Request(f"{self.url}/instances/{what}", body,
                                             {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=5) as response:
                return 200 <= response.status < 300

        with contextlib.suppress(OSError, ValueError):
            if await asyncio.to_thread(call):
                self.co.sup.events.emit("proxy_instances", f"proxy: {what} {kind} {', '.join(sorted(instances))}",
                                        self.plan.component)  # fmt: skip
                return True
        return False

    def status(self) -> dict[str, Any]:
        return {"proxy": self.plan.component, "applied": {k: sorted(v) for k, v in (self.applied or {}).items()},
                "groups": {g: (why or "in") for g, why in self.health.items()}}  # fmt: skip

"""A rank that dies leaves the PD proxy at once, told by the node that saw it die (issue 33).

The proxy sync (`proxy_sync.ProxySync`, on the proxy's node) learns of a death only through the dead rank's member
record: written at most once a second, read through etcd, acted on at the sync's next step — about 1.5 s in which
the proxy kept routing to the dead rank (the fault campaign: a killed decode rank answered 5 requests 200-empty
then), and for the whole outage while etcd is unreachable. The node whose supervisor saw the exit (its pidfd, ms
after it) knows first and needs no etcd: it asks every proxy of the cluster file directly to remove the rank's
group (`POST /instances/remove`, vllm-ascend's admin API the sync uses too; under load the proxy taints the
instance — no new request reaches it, in-flight ones finish).

It only ever removes. Adding back stays the sync's, gated on the group's readiness in the member records as
before: an instance that left the proxy without the sync removing it is not re-added until its node's record has
changed since (`ProxySync.evicted`; at most `proxy_sync.EVICTED_S`, then the proxy's own check of the rank's
/v1/models gates it).
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from loguru import logger

from nodeagent.cluster.proxy_sync import ProxyPost, http_post, proxy_lists
from nodeagent.core.bindaddr import connect_host, url_host
from nodeagent.core.states import SERVING_STATES, State
from nodeagent.seam.stackport import ReportLayer

if TYPE_CHECKING:
    from nodeagent.cluster.coordinator_port import CoordinatorPort
    from nodeagent.config.layout import Group, ProxyPlan
    from nodeagent.seam.stackport import ComponentView

ALIVE = SERVING_STATES | {State.UNHEALTHY}
"""A rank that serves, or did until a probe failed: its death is news for the proxy. A draining rank is not (a
planned stop: the rollout or the operator took its group out of the proxy first, and it finishes its requests)."""
DEAD = frozenset({State.STOPPING, State.BACKOFF, State.FAILED, State.STOPPED})


def fallen(alive: Collection[str], now: Mapping[str, ComponentView]) -> set[str]:
    """The ranks alive at the last look that are dead now (pure): their process exited or is being stopped."""
    return {name for name in alive if name in now and now[name].state in DEAD}


def proxy_url(plan: ProxyPlan, node: str, ips: Mapping[str, str]) -> str | None:
    """The proxy's admin address as `node` dials it: its bind address, or its node's IP for a wildcard (loopback
    on its own node); None when it cannot be reached from here — bound to loopback on another host (its own
    node's sync removes the group then)."""
    home = ips.get(plan.node, "127.0.0.1")
    if plan.node != node and _loopback(plan.host) and not _loopback(home):
        return None
    host = connect_host(plan.host, "127.0.0.1" if plan.node == node else home)
    return f"http://{url_host(host)}:{plan.port}"


def _loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    return host == "localhost"


class ProxyEvict(ReportLayer):
    """Told of every change of the node (a `NodeLayer` that only reports): a rank of a prefill or decode group
    alive before and dead now → its group's endpoints removed from every proxy, in a task of the coordinator."""

    def __init__(self, co: CoordinatorPort, post: ProxyPost | None = None) -> None:
        self.co = co
        self._send = post or http_post
        layout = co.layout
        ips = {m.name: m.ip for m in layout.members}
        self.proxies = [(plan, url) for plan in layout.proxies if (url := proxy_url(plan, co.node, ips)) is not None]
        self.group_of: dict[str, Group] = {
            proc.component: group for group in layout.groups if group.kind in ("prefill", "decode") and group.endpoints
            for proc in group.processes if proc.node == co.node}  # fmt: skip
        self.alive: set[str] = set()
        self.last: dict[str, str] = {}
        """group → what its last removal got (/status `proxy_evict`)."""

    def on_node_change(self) -> None:
        if not self.group_of or not self.proxies:
            return
        now = self.co.port.snapshot().components
        dead = fallen(self.alive, now)
        self.alive = {name for name in self.group_of if name in now and now[name].state in ALIVE}
        for group in {self.group_of[name].name: self.group_of[name] for name in sorted(dead)}.values():
            why = ", ".join(f"{n} {now[n].state}" for n in sorted(dead) if self.group_of[n] is group)
            for plan, url in self.proxies:
                self.co.spawn(self._remove(plan, url, group, why))

    def evict(self, groups: Collection[str], why: str) -> None:
        """These groups of this node out of every proxy now (the chip-reset drain: its planned stop is not a death
        `on_node_change` sees, and the proxy's own sync needs the proxy's agent and etcd)."""
        mine = {g.name: g for g in self.group_of.values() if g.name in groups}
        for group in mine.values():
            for plan, url in self.proxies:
                self.co.spawn(self._remove(plan, url, group, why))

    async def _remove(self, plan: ProxyPlan, url: str, group: Group, why: str) -> None:
        """`why`: the dead ranks (this node's components) and their states, as the event names them. Only what the
        proxy lists now is removed (an empty add answers its lists): vllm-ascend's proxy, busy, taints whatever it
        is asked to remove, listed or not, and an instance tainted but not listed crashes its activation thread
        when it is added back (a `KeyError` in `_push_heap`; the fault campaign's seed 3307, after the sync had
        removed the group already)."""
        listed = await self._listed(url, group.kind)
        gone = sorted(set(group.endpoints) & listed) if listed is not None else []
        answer: dict[str, object] | None = None
        if gone:
            with contextlib.suppress(OSError, ValueError):
                answer = await self._send(f"{url}/instances/remove", {"type": group.kind, "instances": gone})
        if listed is None or (gone and answer is None):
            outcome = (f"not removed from {plan.component}: the proxy did not take it (its sync removes the group "
                       "once the member record shows it)")  # fmt: skip
        elif not gone:
            outcome = f"already out of {plan.component}"
        else:
            outcome = f"removed from {plan.component}"
        self.last[group.name] = outcome
        logger.info(f"proxy evict: {why}: group {group.name} {outcome}")
        self.co.port.emit("proxy_evict", f"{why}: group {group.name} {outcome}", why.split(" ")[0],
                          "warning" if outcome.startswith("not ") else "info")  # fmt: skip

    async def _listed(self, url: str, kind: str) -> set[str] | None:
        """The instances of this kind the proxy lists now; None when it does not answer."""
        with contextlib.suppress(OSError, ValueError):
            lists = proxy_lists(await self._send(f"{url}/instances/add", {"type": kind, "instances": []}))
            return lists[kind] if lists is not None else None
        return None

    def status_section(self) -> dict[str, object]:
        return {"proxy_evict": dict(self.last)} if self.last else {}

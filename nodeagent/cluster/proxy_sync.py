"""The PD proxy follows the gangs: vllm-ascend's proxy never drops a dead backend by itself (its `/healthcheck`
always says ok), so the agent that runs it takes a group's endpoints out while the group restarts and puts
them back once every rank is ready again — clients are routed to the healthy groups instead of failing.

A group is healthy when every one of its members reports each of its ranks up (ready where it serves HTTP)
for the group's current generation. The proxy takes `POST /instances/remove|add {"type", "instances"}`;
removal drains in-flight requests first, an added instance is activated once its `/v1/models` answers. With no
healthy group of a kind left the proxy component is reported not ready.

A proxy process routes to every endpoint of its command line at once, so the node asks the sync (its
`stackport.ProxyRouting`) at each launch what to launch it with (`launch_choice`): what it wants routed now, and
the sync then starts from that list for the new process, not from the config's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from loguru import logger

from nodeagent.config.layout import Group, ProxyPlan
from nodeagent.core.bindaddr import connect_host
from nodeagent.core.http import fetch
from nodeagent.core.states import SERVING_STATES, State
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import Hold, HoldKind, ProxyBackends

if TYPE_CHECKING:
    from nodeagent.cluster.store import ConnectionState
    from nodeagent.seam.stackport import ComponentView

PERIOD_S = 1.0
FENCE_POLL_S = 0.25
"""While a group waits for others to leave the proxy (`fences`), ask the proxy this often: it deletes them only at
an idle moment, and the sooner the waiting group is added, the shorter the time with no group in it."""
RECONCILE_S = 10.0
"""At rest, ask the proxy what it routes to this often (an idempotent empty add): a restarted or confused
proxy is noticed without waiting for a group to change."""
EVICTED_S = 60.0
"""The longest a group its node removed (`evicted`) is kept out on records that did not change: a death and a
restart both between two writes of the record would leave no change to see. Then the proxy's own activation check
(the rank's /v1/models) is the gate, as for any add."""
LAUNCH_WAIT_S = 10.0
"""The longest a proxy's start waits for the members' records (an agent just started, etcd not heard from yet):
launched before them, it would route every endpoint of its command line — a group a rollout keeps out, both sides
of an incompatible change (simulation seed 760303). With etcd known away it starts at once, as it always did."""
ISOLATED_WARN_S = 180.0
"""A healthy group the proxy has kept isolated this long gets one warning: vllm-ascend's proxy deletes an
instance removed under load only when no request is in flight at its check, and ignores an add of it until then —
under steady traffic, never (the group stays out, unused)."""


def group_healthy(group: Group, members: Mapping[str, Mapping[str, Any]], generation: int | None,
                  epoch: str | None = None) -> tuple[bool, str]:  # fmt: skip
    """(healthy, why not) from the members' records (pure). A member's ack of another store incarnation (`epoch`:
    etcd was wiped) is no sign of an old generation: the new epoch's generations start again, nothing restarts."""
    for node in group.nodes:  # an isolated member first: it is why the others wait
        if (members.get(node) or {}).get("isolated"):
            return False, f"{node} is isolated: {members[node]['isolated']}"
    for proc in group.processes:
        record = members.get(proc.node)
        if record is None:
            return False, f"{proc.node} has no agent"
        comp = (record.get("components") or {}).get(proc.component) or {}
        if comp.get("state") not in SERVING_STATES or (proc.endpoint and not comp.get("ready")):
            return False, f"{proc.node}/{proc.component} is {comp.get('state', 'absent')}"
        ack = (record.get("gangs") or {}).get(group.name) or {}
        if (generation is not None and ack.get("generation") not in (None, generation)
                and (not epoch or ack.get("epoch") in (None, "", epoch))):  # fmt: skip
            return False, f"{proc.node} runs generation {ack.get('generation')}, the group is at {generation}"
    return True, ""


def settled_members(members: Mapping[str, Mapping[str, Any]], last: Mapping[str, Mapping[str, Any]],
                    settling: bool) -> dict[str, Mapping[str, Any]]:
    """The member records to judge the groups by (pure): while etcd's view settles after etcd came back (`settling`:
    wiped, restarted, or its leases expired while it was away), a member whose key is not written again yet counts
    as it last was — its absence is etcd's doing, not its node's (the campaign's seed 3305: every group taken out of
    the proxy at each etcd return). After that, a missing key is an agent gone."""
    return {**last, **members} if settling else dict(members)


def _components(group: Group, members: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The member records' components of a group's nodes: what changes when a rank of it dies or restarts."""
    return {node: (members.get(node) or {}).get("components") for node in group.nodes}


def desired_backends(groups: list[Group], health: dict[str, bool]) -> dict[str, set[str]]:
    """{"prefill": endpoints, "decode": endpoints} that should be in the proxy now (pure)."""
    out: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for group in groups:
        if group.kind in out and health.get(group.name):
            out[group.kind].update(group.endpoints)
    return out


def launch_choice(groups: Sequence[Group], want: Mapping[str, set[str]], held: Collection[str],
                  fences: Mapping[str, Collection[str]]) -> ProxyBackends:
    """What a proxy process starting now is launched with (pure). `want`: the endpoints to route (healthy groups
    not held out); `held`: the groups held out by a hold source (a rollout step, an exclusive rollout's other file).

    A new process lists nothing but its command line, so a fence holds only against that: a group is left out when
    a group it waits for is launched too. A kind left with nothing (the script's `--*-hosts` need one) falls back
    to its groups that are merely unhealthy (requests would fail there, but no group held out — draining, about to
    restart, on another file than the decoders — is routed), and only when every one is held out to all of them."""
    chosen = {"prefill": set(want.get("prefill", ())), "decode": set(want.get("decode", ()))}
    by_kind = {kind: [g for g in groups if g.kind == kind] for kind in chosen}
    apart = {(a, b) for a, others in fences.items() for b in others if a != b}

    def clash(name: str) -> bool:
        """It must not be listed beside a group launched now (either waits for the other)."""
        launched = {g.name for g in groups if g.kind in chosen and set(g.endpoints) & chosen[g.kind]} - {name}
        return any((name, other) in apart or (other, name) in apart for other in launched)

    for name in [n for n, _ in apart if clash(n)]:  # the waiting side leaves, as the sync would hold it back
        for group in (g for g in groups if g.name == name and g.kind in chosen):
            chosen[group.kind] -= set(group.endpoints)
    full: dict[str, str] = {}
    for kind, mine in by_kind.items():
        if chosen[kind]:
            continue
        spare = [g for g in mine if g.name not in held and not clash(g.name)]
        if spare:
            full[kind] = (f"no {kind} group to route to: launched with the ones not held out "
                          f"({', '.join(g.name for g in spare)}), the proxy needs one")  # fmt: skip
        else:
            spare = mine
            full[kind] = (f"no {kind} group may be routed now (held out, or kept apart from one launched): "
                          "launched with all of them, the proxy needs one")  # fmt: skip
        chosen[kind] = {e for g in spare for e in g.endpoints}
    order = {kind: [e for g in mine for e in g.endpoints] for kind, mine in by_kind.items()}
    return ProxyBackends(prefill=tuple(e for e in order["prefill"] if e in chosen["prefill"]),
                         decode=tuple(e for e in order["decode"] if e in chosen["decode"]), full=full)  # fmt: skip


ProxyPost = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any] | None]]
"""POST a JSON body to the proxy: its JSON answer ({} when none), None on a non-2xx status; raises OSError or
ValueError when it does not answer (tests give a fake proxy)."""


def proxy_lists(answer: Mapping[str, Any] | None) -> dict[str, set[str]] | None:
    """What the proxy lists, by kind, from any answer of its `/instances/add|remove` (an empty add only asks);
    None when the answer carries no lists."""
    if answer is None:
        return None
    lists = {k: answer.get(f"current_{k}_instances") for k in ("prefill", "decode")}
    if not all(isinstance(v, list) for v in lists.values()):
        return None
    return {k: {str(e) for e in v or ()} for k, v in lists.items()}


async def http_post(url: str, body: dict[str, Any]) -> dict[str, Any] | None:
    answer = await fetch("POST", url, 5.0, json=body)
    if not answer.ok:
        return None
    data = answer.json()
    return data if isinstance(data, dict) else {}


class ProxySync:
    """Takes what it reads as callables (a view of the proxy component, the member records, the groups'
    generation records) and what it does as two (`emit` an event, `block_ready` the proxy with a reason or clear
    it with None): it knows nothing of the coordinator that owns it, nor of the node's internals."""

    def __init__(self, plan: ProxyPlan, groups: Iterable[Group], component: Callable[[], ComponentView | None],
                 members: Callable[[], Mapping[str, Any]], records: Callable[[], Mapping[str, Any]],
                 emit: Callable[..., Any], block_ready: Callable[[str | None], None], clock: Clock | None = None,
                 post: ProxyPost | None = None, connection: Callable[[], ConnectionState] | None = None,
                 settle_s: float = 10.0) -> None:  # fmt: skip
        self.plan = plan
        self.clock = clock or Clock()
        self._send = post or http_post
        self.groups = [g for g in groups if g.kind in ("prefill", "decode")]
        self._component, self._members, self._records, self._emit = component, members, records, emit
        self._block_ready = block_ready
        self.applied: dict[str, set[str]] | None = None
        self.proxy_pid: int | None = None
        self.active: dict[str, set[str]] | None = None
        """What the proxy itself routes to, from its own answers (an added instance waits for activation)."""
        self._reconciled_at = 0.0
        self.pending_since: dict[str, float] = {}
        """Instance → since when it is added but the proxy does not list it yet (waiting for its activation check;
        `proxy_activation` judges one that waits too long)."""
        self.health: dict[str, str] = {}
        """group → why it is out of the proxy ("" when in)."""
        self._isolated_since: dict[str, float | None] = {}
        """group → since when the proxy keeps it isolated while healthy (None: warned already)."""
        self.isolated: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        """Removed while the proxy was busy: it keeps them listed (and routes to them only when nothing else is
        left) until it is idle once, and ignores an add meanwhile — not routed, whatever its lists say."""
        self.holds: list[Callable[[], Mapping[str, str] | None]] = []
        """Sources of groups to keep out however healthy (group → why): a rollout's step from drain to gate. A
        source answering None has not read its state yet: nothing is changed in the proxy until it has."""
        self.fences: list[Callable[[], Mapping[str, Collection[str]]]] = []
        """Sources of group → groups that must have left the proxy (not even listed: no request in flight may still
        reach them) before it is added: an incompatible rollout's switch."""
        self.fenced: dict[str, tuple[str, ...]] = {}
        """group → the groups it waits for, as of the last step."""
        self.launched: ProxyBackends | None = None
        """What the node's last launch of the proxy was given (None: the config's whole command line)."""
        self.evicted: dict[str, tuple[float, dict[str, Any]]] = {}
        """group → (since, its nodes' component records) when its instances were seen gone from the proxy without
        this sync removing them: a node removed them as its rank died (`proxy_evict`). Kept out until one of those
        records changes — they saw the death or the restart since; with etcd away, at its return — or EVICTED_S."""
        self._connection, self.settle_s = connection, settle_s
        """etcd's connection state, and how long after etcd came back the members' records are still settling (their
        agents write them again within a lease TTL)."""
        self._since_seen: float | None = None
        self._back_at: float | None = None
        """When etcd was last seen come back (monotonic): a new `since` of a reachable connection."""
        self._last_members: dict[str, Mapping[str, Any]] = {}
        self._created = self.clock.monotonic()
        self._launch_asked = False
        """A launch asked since the last new pid: the next new pid is that launch's (else one this agent did not
        launch — adopted: its lists are assumed to be its command line's, as the config says)."""

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.plan.host)}:{self.plan.port}"

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # a bug must not end the sync
                logger.exception("proxy sync step failed")
            await self.clock.sleep(FENCE_POLL_S if self.fenced else PERIOD_S)

    async def step(self) -> None:
        comp = self._component()
        if comp is None:
            return
        pid = comp.pid
        # A launch under way (asked, no pid yet) lists what it was given from its first instant (`launch_backends`):
        # not "no proxy process", or a rollout's step is marked unlisted and its ranks start on the other file while
        # the new proxy lists them (seed 760292).
        starting = pid is None and self._launch_asked and comp.state == State.STARTING
        if pid is None and not starting and self.proxy_pid is None:
            self.applied = self.active = None  # a launch that did not start
        if pid != self.proxy_pid and not starting:
            self.proxy_pid = pid
            self.isolated = {"prefill": set(), "decode": set()}
            self.evicted = {}
            # a new proxy routes to every endpoint of its command line at once: what its launch was given
            given = self.launched if self._launch_asked and pid is not None else None
            self._launch_asked = self._launch_asked and pid is None
            all_in = ({"prefill": set(given.prefill), "decode": set(given.decode)} if given is not None
                      else {"prefill": set(self.plan.prefillers), "decode": set(self.plan.decoders)})  # fmt: skip
            self.applied = all_in if pid is not None else None
            self.active = {k: set(v) for k, v in all_in.items()} if pid is not None else None
            self._reconciled_at = 0.0
        health, ready, _held, fences = self._read()
        want = desired_backends(self.groups, {g: ok for g, (ok, _) in health.items()})
        if self.applied is not None and comp.up and ready:
            await self._apply(want, fences)
        else:
            self.fenced = self._blocked(fences)
        self._track_pending()
        self._report(health)
        routed = self.active if self.active is not None else want
        empty = [kind for kind in ("prefill", "decode") if not (routed[kind] & want[kind])]
        self._block_ready(f"no healthy {' or '.join(empty)} group in the proxy" if empty else None)

    def _track_pending(self) -> None:
        now, active = self.clock.monotonic(), self.active
        pending = ({e for k, v in self.applied.items() for e in v - active.get(k, set())}
                   if self.applied is not None and active is not None else set())  # fmt: skip
        self.pending_since = {e: self.pending_since.get(e, now) for e in pending}

    def settling(self) -> bool:
        """etcd came back within `settle_s` (its connection's `since` changed while reachable: a return between two
        looks is seen too)."""
        state = self._connection() if self._connection is not None else None
        if state is None or not state.reachable:
            return False
        if state.since != self._since_seen:
            if self._since_seen is not None:
                self._back_at = self.clock.monotonic()
            self._since_seen = state.since
        return self._back_at is not None and self.clock.monotonic() - self._back_at < self.settle_s

    def _read(self) -> tuple[dict[str, tuple[bool, str]], bool, set[str], dict[str, set[str]]]:
        """(group → (healthy and not held, why not), every hold source has read its state, the groups held out,
        group → the groups it waits for)."""
        members = settled_members(self._members(), self._last_members, self.settling())
        self._last_members = dict(members)
        health: dict[str, tuple[bool, str]] = {}
        for group in self.groups:
            record = self._records().get(group.name)
            health[group.name] = group_healthy(group, members, *((record.generation, record.epoch)
                                                                 if record is not None else (None, None)))
            since, seen = self.evicted.get(group.name, (0.0, None))
            if seen is not None and seen == _components(group, members) and (
                    self.clock.monotonic() - since < EVICTED_S):  # fmt: skip
                health[group.name] = (False, "removed by its node as a rank died; its member record has not "
                                             "changed since")  # fmt: skip
            else:
                self.evicted.pop(group.name, None)
        ready, held = self._held()
        held_out = set()
        for name, why in held.items():
            if name in health:
                health[name] = (False, why)
                held_out.add(name)
        fences: dict[str, set[str]] = {}
        for fence in self.fences:
            for name, others in fence().items():
                fences.setdefault(name, set()).update(others)
        return health, ready, held_out, fences

    def _held(self) -> tuple[bool, dict[str, str]]:
        """(every hold source has read its state, group → why a source holds it out)."""
        ready = True
        held: dict[str, str] = {}
        for source in self.holds:
            answer = source()
            ready = ready and answer is not None
            held.update(answer or {})
        return ready, held

    def launch_hold(self) -> Hold | None:
        """What holds the proxy's start: the members' records not read yet while etcd may still answer, for at most
        `LAUNCH_WAIT_S` after this sync began — `launch_backends` chooses from them what the proxy may route; then
        every group of a kind held out (a rollout's step with its allowed outage): its command line needs one, so it
        would route groups being drained or restarted — an old process beside a new one of another file (seed
        760303) — and it could serve nothing meanwhile. It starts when the step lets a group back."""
        if self._members():
            _ready, held = self._held()
            for kind in ("prefill", "decode"):
                mine = [g.name for g in self.groups if g.kind == kind]
                if mine and all(name in held for name in mine):
                    return Hold(HoldKind.ROLLOUT, f"proxy {self.plan.component}: every {kind} group is held out "
                                f"({held[mine[0]]}): it starts once one may be routed")  # fmt: skip
            return None
        state = self._connection() if self._connection is not None else None
        if state is not None and state.reachable is False:
            return None  # etcd away: the proxy serves with its command line, as before (losing etcd stops nothing)
        left = LAUNCH_WAIT_S - (self.clock.monotonic() - self._created)
        if left <= 0:
            return None
        return Hold(HoldKind.COORDINATION, f"proxy {self.plan.component}: waiting for the members' records to "
                    f"choose what it may route (at most {left:.0f}s more; with etcd away: every endpoint)")  # fmt: skip

    def launch_backends(self) -> ProxyBackends | None:
        """`stackport.ProxyRouting`: what the proxy starting now is launched with (`launch_choice`); None until the
        members' records have been read (nothing known to leave out: the config's command line, as before). A hold
        source that has not read its state yet leaves out nothing more than the unhealthy groups."""
        self._launch_asked = True
        self.launched = None
        self.applied = {"prefill": set(self.plan.prefillers), "decode": set(self.plan.decoders)}
        self.active = {k: set(v) for k, v in self.applied.items()}
        if not self._members():
            logger.info("proxy {} launched with every endpoint: the members' records are not read yet",
                        self.plan.component)  # fmt: skip
            return None
        health, _ready, held, fences = self._read()
        want = desired_backends(self.groups, {g: ok for g, (ok, _) in health.items()})
        choice = self.launched = launch_choice(self.groups, want, held, fences)
        self.applied = {"prefill": set(choice.prefill), "decode": set(choice.decode)}
        self.active = {k: set(v) for k, v in self.applied.items()}
        left_out = sorted(g.name for g in self.groups
                          if not set(g.endpoints) & set(choice.prefill if g.kind == "prefill" else choice.decode))
        why = "; ".join(f"{g}: {health[g][1] or 'kept apart from a group launched (another file)'}"
                        for g in left_out)  # fmt: skip
        message = (f"launched with {', '.join([*choice.prefill, *choice.decode])}"
                   + (f" (left out: {why})" if left_out else "" if choice.full else " (every group)")
                   + "".join(f"; {text}" for text in choice.full.values()))  # fmt: skip
        listed = set(choice.prefill) | set(choice.decode)
        risky = any(g.name in held and set(g.endpoints) & listed for g in self.groups)  # the last fallback
        self._emit("proxy_launch", message, self.plan.component, "warning" if risky else "info")
        return choice

    def _blocked(self, fences: Mapping[str, set[str]]) -> dict[str, tuple[str, ...]]:
        """group → the groups of its fence the proxy still lists (tainted ones included: they may still be used)."""
        listed = set().union(*(self.active or {}).values()) if self.active is not None else None
        by_name = {g.name: g for g in self.groups}
        out = {}
        for name, others in fences.items():
            still = sorted(o for o in others if o in by_name and (
                listed is None or set(by_name[o].endpoints) & listed))  # fmt: skip
            if still:
                out[name] = tuple(still)
        return out

    async def _apply(self, want: dict[str, set[str]], fences: Mapping[str, set[str]]) -> None:
        """Every removal first, then the additions the fences allow as the proxy's answers now say."""
        assert self.applied is not None
        kinds = ("prefill", "decode")
        # only what the proxy still lists is removed, asked once for both kinds (an empty add): vllm-ascend's proxy,
        # asked to remove an instance a node already took out (`proxy_evict`) and then to add it, crashed its
        # activation thread (KeyError in `_push_heap`) and never routed it again (the campaign's seed 3306)
        listed = any(self.applied[k] - want[k] for k in kinds) and await self._post("add", "prefill", set(), quiet=True)
        for kind in kinds:
            gone = self.applied[kind] - want[kind]
            if gone and listed and self.active is not None:  # a remove's answer below refreshes `active` too
                self.applied[kind] -= gone - self.active[kind]
                gone &= self.active[kind]
            if gone and await self._post("remove", kind, gone):
                self.applied[kind] -= gone
        self.fenced = self._blocked(fences)
        for group in self.groups:
            if group.name in self.fenced:
                want[group.kind] -= set(group.endpoints)
        for kind in ("prefill", "decode"):
            back = want[kind] - self.applied[kind]
            if back and await self._post("add", kind, back):
                self.applied[kind] |= back
        pending = {k: self.applied[k] - (self.active or {}).get(k, set()) for k in self.applied}
        # Fenced, or an instance removed under load: when the proxy deletes it matters (a fence, a rollout step's
        # ranks waiting to start: `rollout_rules.proxy_wait`), and only its answers say.
        every = FENCE_POLL_S if self.fenced else PERIOD_S if any(self.isolated.values()) else RECONCILE_S
        due = self.clock.monotonic() - self._reconciled_at >= every
        if any(pending.values()) or due:
            # An added instance waits for the proxy's own activation check (its /v1/models); one that failed
            # that check too often is dropped by the proxy. Re-adding is idempotent and answers what it routes to.
            for kind, missing in pending.items():
                if missing:
                    await self._post("add", kind, missing, quiet=True)
            if not any(pending.values()):
                await self._post("add", "prefill", set(), quiet=True)
            self._reconciled_at = self.clock.monotonic()

    def _report(self, health: dict[str, tuple[bool, str]]) -> None:
        for group in self.groups:
            ok, why = health[group.name]
            routed = self.active is None or all(e in self.active.get(group.kind, set()) for e in group.endpoints)
            isolated = self.active is not None and any(e in self.isolated[group.kind] for e in group.endpoints)
            if not ok:
                now = why
            elif group.name in self.fenced:
                now = (f"healthy; waiting for {', '.join(self.fenced[group.name])} to leave the proxy first (another "
                       "file, never routed together; the proxy deletes them once it is idle)")  # fmt: skip
            elif isolated:
                now = "healthy; the proxy keeps it isolated until it is idle once, then it is added back"
            elif routed:  # (no proxy process: nothing to wait for)
                now = ""
            else:
                now = "healthy; the proxy activates it once its /v1/models answers"
            self._track_isolated(group.name, ok and group.name not in self.fenced and isolated)
            if self.health.get(group.name) != now:
                if not now:
                    text = "back in the proxy"
                elif ok:
                    text = f"added to the proxy: {now}"
                else:
                    text = f"out of the proxy: {now}"
                self._emit("proxy_backends", f"group {group.name} {text}", self.plan.component)
            self.health[group.name] = now

    def _track_isolated(self, name: str, isolated: bool) -> None:
        """One warning once a healthy group has stayed isolated ISOLATED_WARN_S; forgotten once it is not."""
        if not isolated:
            self._isolated_since.pop(name, None)
            return
        since = self._isolated_since.setdefault(name, self.clock.monotonic())
        if since is not None and self.clock.monotonic() - since >= ISOLATED_WARN_S:
            self._isolated_since[name] = None
            self._emit("proxy_isolated", f"group {name} healthy but still not routed after {ISOLATED_WARN_S:.0f}s: "
                       "the proxy re-admits an instance removed under load only once no request is in flight at "
                       "its check (vllm-ascend's proxy); under steady traffic that may be never. A restart of the "
                       "proxy at a quiet moment lists it again (in-flight requests fail)", self.plan.component,
                       "warning")  # fmt: skip

    async def _post(self, what: str, kind: str, instances: set[str], quiet: bool = False) -> bool:
        body = {"type": kind, "instances": sorted(instances)}
        with contextlib.suppress(OSError, ValueError):
            answer = await self._send(f"{self.url}/instances/{what}", body)
            if answer is None:
                return False
            if (lists := proxy_lists(answer)) is not None:
                before, self.active = self.active, lists
                self._note_evicted(before, set(instances) if what == "remove" else set(), kind)
                if what == "remove":
                    self.isolated[kind] |= instances & self.active[kind]
                for k in self.isolated:
                    self.isolated[k] &= self.active[k]
            if not quiet:
                self._emit("proxy_instances", f"proxy: {what} {kind} {', '.join(sorted(instances))}",
                           self.plan.component)
            return True
        return False

    def _note_evicted(self, before: Mapping[str, set[str]] | None, removed: set[str], kind: str) -> None:
        """Instances this sync routes that the proxy no longer lists, and that it did not remove: another node took
        them out (`proxy_evict`) — their groups stay out until their records change (`evicted`)."""
        if before is None or self.applied is None or self.active is None:
            return
        members = self._members()
        for group in self.groups:
            taken = (before.get(group.kind, set()) & self.applied[group.kind]) - self.active[group.kind]
            taken -= self.isolated[group.kind]  # removed by this sync under load, deleted by the proxy at idle now
            if group.kind == kind:
                taken -= removed
            if taken & set(group.endpoints) and group.name not in self.evicted:
                self.evicted[group.name] = (self.clock.monotonic(), _components(group, members))
                self._emit("proxy_backends", f"group {group.name} left the proxy without this sync removing it "
                           f"({', '.join(sorted(taken & set(group.endpoints)))}): its node saw a rank die; back "
                           "once its member record says ready again", self.plan.component)  # fmt: skip

    def status(self) -> dict[str, Any]:
        return {"proxy": self.plan.component, "applied": {k: sorted(v) for k, v in (self.applied or {}).items()},
                "routed": {k: sorted(v) for k, v in (self.active or {}).items()},
                "groups": {g: (why or "in") for g, why in self.health.items()}}  # fmt: skip

"""The PD watch in the whole-cluster simulation (`tests/simulation.py --pd`): the **real** `cluster.pd_watch.PdWatch`
runs on the agent of the proxy's node, as `agent.Agent._make_pd_watches` makes it — its probe rounds (prefill →
each decode instance with 2 tokens, then the proxy itself), the empty-answer streaks, the blame of the proxy, the
restarts through the coordinator's generations and the node's restart of the proxy, the cooldowns — on the virtual
clock, over a simulated HTTP (`PdWatch`'s own `http` seam).

What is simulated (`PdSim.http`): a prefill rank that is up answers its KV handle; a decode rank that is up
answers 2 tokens; a rank down or hung does not answer (connection refused; a hang: the probe's timeout); the proxy
routes its request round robin over what `FakeProxy` serves and answers 200 with an empty body when the decoder
fails (vllm-ascend #13140); `/metrics` has no KV usage (the KV-pressure and transfer watches see nothing).

Faults (`PD_FAULTS`, drawn only with `--pd`: opt-in, not in the CI budget's mix): a decode group's ranks answer
200s without tokens until they restart (`pd_empty`), the proxy accepts requests and answers none until it restarts
(`pd_hang`). Invariant `pd_unattributed`: once the faults heal, each such fault is cured — its group (or the proxy)
restarted — within the PD watch's own bound (a restart cooldown + `empty_after` + 1 rounds + two probe timeouts);
the licences: a `pd_empty` licenses its group's generation, a `pd_hang` the proxy's restart, nothing else.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nodeagent.cluster.pd_watch import RESTART_COOLDOWN_S, PdWatch, _host

PD_FAULTS: dict[str, float] = {
    "pd_empty": 2.0,  # a decode group's ranks answer 200s without tokens until they restart (vllm-ascend #13140)
    "pd_hang": 1.0,   # the proxy answers nothing until it restarts
}  # fmt: skip
PD_GAP_S = 90.0
"""The mean gap between two of them (a stream of their own: the schedule's other events are the seed's as before)."""
TOKENS = json.dumps({"choices": [{"text": "ok"}], "usage": {"completion_tokens": 2}})


class PdSim:
    """The PD watch on the proxy's agent, its simulated HTTP, its faults and its invariant."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.kinds = frozenset(PD_FAULTS)
        self.empty: dict[str, float] = {}
        """decode group → since when its ranks answer without tokens."""
        self.hung: float | None = None
        """Since when the proxy answers nothing."""
        self.cured: list[tuple[str, float]] = []
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.turn = 0
        self.hosts: dict[str, str] = {}
        self.proxy_host: str | None = None
        world = sim.world
        start_agent, kill_agent, before_launch = world.start_agent, world.kill_agent, sim.before_launch

        def started(name: str) -> Any:
            agent = start_agent(name)
            self.attach(name, agent)
            return agent

        async def killed(name: str) -> None:
            task = self.tasks.pop(name, None)
            if task is not None:
                task.cancel()
            await kill_agent(name)

        def launched(stack: Any, comp: Any) -> None:
            before_launch(stack, comp)
            self.launched(stack, comp)

        world.start_agent, world.kill_agent, sim.before_launch = started, killed, launched

    def attach(self, name: str, agent: Any) -> None:
        co = agent.coordinator
        if not co.proxies or not co.config.recovery.pd.enabled:
            return
        members = agent.membership.members
        watch = PdWatch(co, None, lambda: {n: m.record for n, m in members.items()}, clock=self.sim.clock,
                        http=self.http)  # fmt: skip
        self.proxy_host = co.proxies[0].url.split("//", 1)[1]
        self.hosts = {_host(e): e for e in self.sim.ranks}
        self.tasks[name] = asyncio.ensure_future(watch.run())

    def bound(self) -> float:
        """How long a fault may last once the others healed: a restart's cooldown, `empty_after` + 1 rounds (the
        streak, and the round under way) and two probe timeouts."""
        config = self.sim.world.stacks[self.sim.layout.nodes[0]].config.recovery.pd
        return RESTART_COOLDOWN_S + (config.empty_after + 1) * config.probe_period_s + 2 * config.probe_timeout_s

    # ---- the simulated HTTP ------------------------------------------------------------------------------------
    def _answers(self, endpoint: str) -> bool:
        rank = self.sim.ranks.get(endpoint)
        return rank is not None and rank[1].up

    async def http(self, method: str, url: str, body: dict[str, Any] | None, timeout: float,
                   headers: Any) -> tuple[int, str]:  # fmt: skip
        host, _, path = url.split("//", 1)[1].partition("/")
        if path == "metrics":
            return 200, ""
        if host == self.proxy_host:
            return await self._through_proxy(timeout)
        endpoint = self.hosts.get(host)
        if endpoint is None:
            raise OSError(f"{host}: connection refused")
        node, comp = self.sim.ranks[endpoint]
        hung = getattr(getattr(self.sim.world.stacks[node], "host", None), "current", None)
        proc = hung(comp.name) if hung is not None else None
        if proc is not None and proc.hung_until > self.sim.clock.monotonic():
            await self.sim.clock.sleep(timeout)
            raise OSError(f"{host}: timed out")
        if not comp.up:
            raise OSError(f"{host}: connection refused")
        group = self.sim.group_of.get(node, "")
        if self._kind(group) == "prefill":
            return 200, json.dumps({"kv_transfer_params": {"remote_engine_id": endpoint, "do_remote_prefill": True}})
        return (200, "") if group in self.empty else (200, TOKENS)

    def _kind(self, group: str) -> str:
        return next((g["kind"] for g in self.sim.layout.groups if g["name"] == group), "")

    async def _through_proxy(self, timeout: float) -> tuple[int, str]:
        proxy = self.sim.world.proxy
        comp = self.sim.world.stacks[self.sim.layout.nodes[0]].components.get("proxy")
        if proxy is None or comp is None or not comp.up:
            raise OSError("proxy: connection refused")
        if self.hung is not None:
            await self.sim.clock.sleep(timeout)
            raise OSError("proxy: timed out")
        prefills, decoders = sorted(proxy.serving("prefill")), sorted(proxy.serving("decode"))
        if not prefills or not decoders:
            return 503, "no instance to route to"
        self.turn += 1
        prefill, decoder = prefills[self.turn % len(prefills)], decoders[self.turn % len(decoders)]
        if not self._answers(prefill):
            return 502, "prefill failed"
        rank = self.sim.ranks.get(decoder)
        if not self._answers(decoder) or (rank and self.sim.group_of.get(rank[0]) in self.empty):
            return 200, ""  # the proxy streams after its 200: a failing decoder is an empty body
        return 200, TOKENS

    # ---- faults and cures --------------------------------------------------------------------------------------
    def launched(self, stack: Any, comp: Any) -> None:
        """A restart cures the fault: a decoder in a bad state, a hung proxy."""
        now = self.sim.clock.monotonic()
        group = self.sim.group_of.get(stack.node)
        if comp.kind == "vllm" and group in self.empty:
            self.sim.log(f"pd: decode group {group} restarted {now - self.empty.pop(group):.1f}s after its empty "
                         "answers began")  # fmt: skip
            self.cured.append((group, now))
        if comp.kind == "proxy" and self.hung is not None:
            self.sim.log(f"pd: the proxy restarted {now - self.hung:.1f}s after it hung")
            self.hung = None
            self.cured.append(("proxy", now))

    async def apply(self, event: Any, node: str) -> None:
        sim = self.sim
        now = sim.clock.monotonic()
        if event.kind == "pd_empty":
            decode = [g["name"] for g in sim.layout.groups if g["kind"] == "decode" and g["name"] not in self.empty]
            if not decode:
                return sim.log("skip pd_empty: every decode group answers empty already")
            group = decode[event.pick % len(decode)]
            sim.faults["pd_empty"] += 1
            self.empty[group] = now
            sim.license_group(group, f"empty answers of {group}")
            return sim.log(f"pd: decode group {group} answers 200s without tokens until it restarts")
        if event.kind == "pd_hang":
            if self.hung is not None:
                return sim.log("skip pd_hang: hung already")
            proxy_node = sim.layout.nodes[0]
            if "proxy" not in sim.world.stacks[proxy_node].components:
                return sim.log("skip pd_hang: no proxy")
            sim.faults["pd_hang"] += 1
            self.hung = now
            sim.license(proxy_node, "proxy", "the proxy hangs")
            return sim.log("pd: the proxy answers nothing until it restarts")
        raise ValueError(f"unknown PD fault {event.kind!r}")

    async def finish(self) -> None:
        """After the faults healed and the cluster converged: every fault cured within the bound."""
        bound = self.bound()
        try:
            await self.sim.world.until("the PD faults cured", lambda: not self.empty and self.hung is None,
                                       within=bound)  # fmt: skip
        except AssertionError:
            left = [*(f"decode group {g} (empty since {self.sim.clock.monotonic() - t:.0f}s)"
                      for g, t in self.empty.items()),
                    *([f"the proxy (hung since {self.sim.clock.monotonic() - self.hung:.0f}s)"] if self.hung else [])]
            self.sim.violate("pd_unattributed", f"not acted on {bound:.0f}s after the faults healed: "
                             f"{', '.join(left)}")  # fmt: skip

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()

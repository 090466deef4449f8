"""What a PD proxy process is launched with (`proxy_sync.launch_choice`, `render.routed_proxy`): the endpoints
the cluster layer routes to now, never a group it holds out, and one of each kind whatever happens (the script's
--prefiller-hosts/--decoder-hosts are nargs="+"). The launch fingerprint stays the config's: a reload compares
the file, not what was routed when the proxy last started."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.cluster.proxy_sync import ProxySync, launch_choice
from nodeagent.config.layout import ProxyPlan
from nodeagent.config.load import parse_config
from nodeagent.render.launch import launch_fingerprint, render_component, routed_proxy
from nodeagent.seam.stackport import ProxyBackends


@dataclass(frozen=True)
class G:
    """What `launch_choice` reads of a `layout.Group`."""

    name: str
    kind: str
    endpoints: tuple[str, ...]


P0, P1 = G("p0", "prefill", ("10.0.0.1:8100",)), G("p1", "prefill", ("10.0.0.2:8100", "10.0.0.3:8100"))
D0, D1 = G("d0", "decode", ("10.0.0.4:8200",)), G("d1", "decode", ("10.0.0.5:8200",))
GROUPS: Any = (P0, P1, D0, D1)


def want(*groups: G) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for g in groups:
        out[g.kind] |= set(g.endpoints)
    return out


def test_every_wanted_group_and_no_other() -> None:
    choice = launch_choice(GROUPS, want(P1, D0, D1), held={"p0"}, fences={})
    assert choice == ProxyBackends(prefill=P1.endpoints, decode=(*D0.endpoints, *D1.endpoints))
    assert not choice.full


def test_a_kind_with_nothing_wanted_falls_back_to_its_groups_not_held_out() -> None:
    """p0 drains for a rollout step, p1 crashed: the proxy needs a prefiller — p1 (requests fail there until it
    is back, as with no prefiller), never p0, which is about to restart."""
    choice = launch_choice(GROUPS, want(D0), held={"p0"}, fences={})
    assert choice.prefill == P1.endpoints and choice.decode == D0.endpoints
    assert set(choice.full) == {"prefill"} and "(p1)" in choice.full["prefill"]


def test_a_kind_whose_every_group_is_held_out_gets_all_of_them() -> None:
    choice = launch_choice(GROUPS, want(P1), held={"d0", "d1"}, fences={})
    assert choice.decode == (*D0.endpoints, *D1.endpoints)
    assert "no decode group may be routed now" in choice.full["decode"]


def test_nothing_known_healthy_launches_every_endpoint() -> None:
    choice = launch_choice(GROUPS, want(), held=set(), fences={})
    assert choice.prefill == (*P0.endpoints, *P1.endpoints) and choice.decode == (*D0.endpoints, *D1.endpoints)


def test_a_fence_keeps_the_waiting_group_out_only_beside_a_group_launched() -> None:
    """An incompatible rollout's switch: the new pair (p1, d1) waits for the old (p0, d0) to leave. The old ones
    are held out, so a new process lists none of them and the new pair starts at once; a group still launched
    beside its fence's others is left out, as the sync would hold it back."""
    fences = {"p1": ("p0", "d0"), "d1": ("p0", "d0")}
    switch = launch_choice(GROUPS, want(P1, D1), held={"p0", "d0"}, fences=fences)
    assert switch.prefill == P1.endpoints and switch.decode == D1.endpoints and not switch.full
    mixed = launch_choice(GROUPS, want(P0, P1, D1), held=set(), fences=fences)
    assert mixed.prefill == P0.endpoints
    assert mixed.decode == D0.endpoints, "d1 never beside p0: the decode fallback is d0, unhealthy but not held"


def test_the_fallback_skips_a_group_a_launched_one_must_not_meet() -> None:
    """p1 (new file) is launched; d0 (old file) and d1 are unhealthy: the decode fallback is d1, not d0, which p1
    waits to have left."""
    choice = launch_choice(GROUPS, want(P1), held=set(), fences={"p1": ("d0",)})
    assert choice.prefill == P1.endpoints and choice.decode == D1.endpoints, choice


def test_before_the_members_records_are_read_the_proxy_gets_its_whole_command_line() -> None:
    """etcd not reached yet: nothing is known to leave out (every group would look unhealthy)."""
    plan = ProxyPlan("proxy", "m", "127.0.0.1", 18020, ("10.0.0.1:8100",), ("10.0.0.4:8200",))
    events: list[tuple[Any, ...]] = []
    groups: Any = GROUPS
    sync = ProxySync(plan, groups, lambda: None, dict, dict, lambda *a, **k: events.append(a), lambda _r: None)
    assert sync.launch_backends() is None and sync.launched is None
    assert not events, "nothing chosen: the config's command line, as without a cluster layer"


def test_a_proxy_waits_for_the_members_records_while_etcd_may_answer_and_not_longer() -> None:
    """An agent just started: launched before the records are read, the proxy would route every endpoint of its
    command line. It waits for them — not with etcd known away (it serves with its command line, as before), and
    at most LAUNCH_WAIT_S."""
    from cluster_fakes import VirtualClock

    from nodeagent.cluster.proxy_sync import LAUNCH_WAIT_S
    from nodeagent.cluster.store import ConnectionState

    plan = ProxyPlan("proxy", "m", "127.0.0.1", 18020, ("10.0.0.1:8100",), ("10.0.0.4:8200",))
    members: dict[str, Any] = {}
    state = ConnectionState(None, "etcd", None, 0.0)
    clock = VirtualClock()
    groups: Any = GROUPS
    sync = ProxySync(plan, groups, lambda: None, lambda: members, dict, lambda *a, **k: None, lambda _r: None,
                     clock, connection=lambda: state)  # fmt: skip
    hold = sync.launch_hold()
    assert hold is not None and "waiting for the members' records" in hold.reason, hold
    state = ConnectionState(False, "etcd", "refused", 0.0)
    assert sync.launch_hold() is None, "etcd away: the proxy starts at once"
    state = ConnectionState(True, "etcd", None, 0.0)
    assert sync.launch_hold() is not None
    clock._move(clock.mono + LAUNCH_WAIT_S + 0.1)
    assert sync.launch_hold() is None, "never longer than LAUNCH_WAIT_S"
    members["n1"] = {"components": {}}
    assert sync.launch_hold() is None, "read: no group held out, nothing holds it"


def test_a_proxy_does_not_start_while_a_rollout_holds_every_group_of_a_kind_out() -> None:
    """Found by the simulation (seed 760303): a step with the operator's allowed outage holds p0, p1 (or d0, d1)
    out; a proxy starting then was launched with all of them — an old, draining process beside a new one of
    another KV connector. It starts once the step lets one back; one group of a kind left is enough."""
    plan = ProxyPlan("proxy", "m", "127.0.0.1", 18020, ("10.0.0.1:8100",), ("10.0.0.4:8200",))
    members = {"n1": {"components": {}}}
    groups: Any = GROUPS
    sync = ProxySync(plan, groups, lambda: None, lambda: members, dict, lambda *a, **k: None, lambda _r: None)
    held: dict[str, str] | None = {"d0": "rollout r2 step 1: restarting", "d1": "rollout r2 step 1: restarting"}
    sync.holds.append(lambda: held)
    hold = sync.launch_hold()
    assert hold is not None and hold.reason == ("proxy proxy: every decode group is held out (rollout r2 step 1: "
                                                "restarting): it starts once one may be routed"), hold
    held = {"d0": "rollout r2 step 1: restarting", "p0": "rollout r2 step 1: restarting"}
    assert sync.launch_hold() is None
    held = None  # the source has not read its state: it holds nothing yet
    assert sync.launch_hold() is None


async def test_a_proxy_being_launched_lists_what_it_was_given_before_its_pid_is_seen() -> None:
    """Found by the simulation (seed 760292, an incompatible rollout): between a proxy's launch and the sync's first
    look at its pid the sync said "no proxy process" (`active` None), a failed step's way back was marked unlisted
    in that window, and its ranks started on the old file while the new proxy listed them beside the new pair."""
    from nodeagent.config.model import RestartSpec
    from nodeagent.seam.stackport import ComponentView

    plan = ProxyPlan("proxy", "m", "127.0.0.1", 18020, ("10.0.0.1:8100",), ("10.0.0.4:8200",))
    listed = {"prefill": {"10.0.0.1:8100"}, "decode": {"10.0.0.4:8200"}}
    view: dict[str, Any] = {"state": "stopped", "pid": None}

    def component() -> ComponentView:
        return ComponentView(name="proxy", kind="proxy", state=view["state"], running=view["pid"] is not None,
                             up=False, ready=False, desired="running", deps=(), deps_up=True, restart=RestartSpec(),
                             pid=view["pid"])  # fmt: skip

    sync = ProxySync(plan, [], component, dict, dict, lambda *a, **k: None, lambda _r: None)
    await sync.step()
    assert sync.active is None, "no proxy process"
    view["state"] = "starting"
    sync.launch_backends()
    await sync.step()
    assert sync.active == listed and sync.applied == listed, "launched: it lists its command line before its pid"
    view["pid"] = 42
    await sync.step()
    assert sync.active == listed and sync.proxy_pid == 42
    view.update(state="stopped", pid=None)
    await sync.step()
    assert sync.active is None, "gone"
    view["state"] = "starting"
    sync.launch_backends()
    view["state"] = "backoff"
    await sync.step()
    assert sync.active is None and sync.applied is None, "a launch that did not start lists nothing"


def proxy_config(tmp: Path) -> Any:
    text = f"""
cluster:
  name: pd
  nodes:
    - {{name: m, ip: 127.0.0.1, role: master, components: {{vllm: {{port: 8100}}}}}}
    - {{name: a, ip: 127.0.0.2, components: {{vllm: {{port: 8100}}}}}}
    - {{name: b, ip: 127.0.0.3, components: {{vllm: {{port: 8200}}}}}}
  vllm_groups:
    - {{name: p0, kind: prefill, nodes: [m], dp_launch: external}}
    - {{name: p1, kind: prefill, nodes: [a], dp_launch: external}}
    - {{name: d0, kind: decode, nodes: [b], dp_launch: external}}
node: {{npus: 0}}
agent: {{state_dir: {tmp}/state, log_dir: {tmp}/logs}}
components:
  vllm: {{kind: vllm, command: vllm, model: {tmp}/model, tensor_parallel_size: 1, data_parallel_rpc_port: 43000}}
  proxy: {{kind: proxy, command: python3, script: {tmp}/proxy.py, port: 18020}}
"""
    return parse_config(text, str(tmp / "pd.yaml"), base_dir=tmp, node="m")


def test_the_proxy_is_rendered_with_the_routed_backends_and_the_configs_fingerprint(tmp_path: Path) -> None:
    config = proxy_config(tmp_path)
    spec = render_component("proxy", config, {})
    assert spec.argv[spec.argv.index("--prefiller-hosts") + 1:][:2] == ("127.0.0.1", "127.0.0.2")
    routed = routed_proxy(spec, config, ProxyBackends(prefill=("127.0.0.2:8100",), decode=("127.0.0.3:8200",)))
    hosts = routed.argv[routed.argv.index("--prefiller-hosts") + 1:]
    assert hosts[:3] == ("127.0.0.2", "--prefiller-ports", "8100"), routed.argv
    assert routed.env == spec.env and routed.cwd == spec.cwd
    assert launch_fingerprint(routed) != launch_fingerprint(spec), "so the supervisor keeps the config's"
    assert routed_proxy(spec, config, None) is spec
    unknown = routed_proxy(spec, config, ProxyBackends(prefill=("10.9.9.9:1",), decode=()))
    assert unknown.argv == spec.argv, "nothing of the file's named: the file's whole list, never an empty flag"

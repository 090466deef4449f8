"""Pure: a rollout's steps as a state machine, decided from what etcd holds — no I/O, no clock of its own.

The record (`rollout` key) holds the ordered steps and where each is; any agent may move it on, with a
transaction on the key's mod_revision (like the gang generations): whoever loses the race re-reads and
decides again, so a step moves exactly once however many agents drive it, and the plan survives any agent's
restart, including the one that started it. One step, for its groups:

    pending ─ floor holds, every member has the target file ─► draining (out of the proxy; the members wait
    until their ranks run no request, or the drain timeout) ─► staging (each member takes the target config
    for its next start, restarting nothing) ─► restarting (one planned generation of each group) ─► gating
    (every rank ready at the new generation, a canary request answered) ─► rejoining (back in the proxy)
    ─► baking (healthy for the bake time) ─► done ─► the next step

On a failure from staging on: the step turns back (from ↔ to swapped, `failed`), runs staging → rejoining again
with the previous config (from draining when it failed back in the proxy: rejoining, baking), ends `rolled_back`
and the rollout halts; the other groups stay as they are.
Marks (drained, staged, canary, proxy out/in, unlisted) are each written by the agent that can see them. The
record itself, data only, is `rollout_record`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nodeagent.cluster.rollout.record import Record, Step
from nodeagent.cluster.rollout.running import Runs
from nodeagent.cluster.rollout.states import MOVING, OUT_OF_PROXY, RESTARTS, Phase, Status

STAGE_TIMEOUT_S = 300.0
REJOIN_TIMEOUT_S = 180.0
WAIT_SAY_S = 30.0
FILES_WAIT_S = 900.0
"""How long a step waits for its members to have the new file before the rollout halts (an operator who copied it
to some members only: the step said "waiting for the file" for ever, with a frozen time left)."""
PUBLISH_TIMEOUT_S = 60.0
"""Every step done: how long the rollout waits for every member to publish the new file (a member no step touched
stages it without a restart: seconds) before it is done anyway, naming who does not."""


# ---- what the agents see ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupObs:
    kind: str
    nodes: tuple[str, ...]
    generation: int | None
    """The group's gang generation (None: no record in this epoch)."""
    healthy: bool
    """Every rank up (ready where it serves) at that generation, on every member's own record."""
    why: str = ""
    failed: Mapping[str, int] = field(default_factory=dict)
    """Ranks whose member says failed → the generation that member was acting on (an older failure is not
    this step's)."""


@dataclass(frozen=True)
class Observed:
    now: float
    groups: Mapping[str, GroupObs]
    reports: Mapping[str, Mapping[str, Any]]
    """node → its report: `hash` (the file on its disk), `previous` (the running file it saved), `running`."""
    proxy: bool
    """The cluster runs a PD proxy: its agent marks a step out of and back in it."""
    published: Mapping[str, str | None] = field(default_factory=dict)
    """node → the `cluster_hash` its member record publishes (present members)."""
    runs: Runs = field(default_factory=dict)
    """group → the files its ranks run, as its members say (`running.group_runs`)."""


@dataclass(frozen=True)
class Ask:
    """After the transition is written: make sure `group` has a generation past `base` (idempotent)."""

    group: str
    base: int
    reason: str


def floor_problem(record: Record, step: Step, obs: Observed) -> str | None:
    """Why the step may not start now: a kind left without a serving group, or too many groups down."""
    others = {g: o for g, o in obs.groups.items() if g not in step.groups}
    for kind in sorted({o.kind for o in obs.groups.values()}):
        if kind in step.outage and kind in record.options.allow_outage:
            continue
        serving = [g for g, o in others.items() if o.kind == kind and o.healthy]
        if not serving:
            why = ", ".join(f"{g} ({o.why})" for g, o in others.items() if o.kind == kind) or "none other"
            return f"floor: no other {kind} group serving ({why})"
    down = [g for g, o in others.items() if not o.healthy]
    if len(down) + len(step.groups) > record.options.max_unavailable:
        return (f"floor: {', '.join(down)} already down; {len(step.groups)} more would exceed --max-unavailable "
                f"{record.options.max_unavailable}")  # fmt: skip
    return None


def files_problem(step: Step, obs: Observed) -> str | None:
    """Every member of the step can take the target file: it has it on disk, or saved it as its previous one."""
    missing = []
    for node in step.nodes({g: o.nodes for g, o in obs.groups.items()}):
        report = obs.reports.get(node)
        if report is None:
            missing.append(f"{node} (no report from its agent)")
        elif step.to_hash not in (report.get("hash"), report.get("previous")):
            missing.append(f"{node} (its file has {str(report.get('hash'))[:12]}, {report.get('error') or 'differs'})")
    return f"waiting for the file {step.to_hash[:12]} on {', '.join(missing)}" if missing else None


def waiting_since(record: Record, prefix: str, now: float) -> float:
    """When the wait the record's latest messages say (`prefix`…) began: the oldest of them since anything else was
    said (a resume, another step); `now` if it is not waiting."""
    since = now
    for at, message in reversed(record.history):
        if not message.startswith(prefix):
            break
        since = at
    return since


def _enter(step: Step, phase: Phase, now: float, **changes: Any) -> Step:
    """The step in `phase` from now; the time spent in the phase it leaves is kept (`Step.phase_s`)."""
    spent = dict(step.phase_s)
    if step.phase != Phase.PENDING and step.since:
        spent[step.phase] = round(spent.get(step.phase, 0.0) + max(0.0, now - step.since), 3)
    return replace(step, phase=phase, since=now, phase_s=spent, **changes)


def _fail(record: Record, i: int, step: Step, why: str, now: float) -> Record:
    names = ", ".join(step.groups)
    if step.failed or step.rollback:
        return record.with_step(i, replace(step, failed=step.failed or why)).say(
            now, f"step {i + 1} ({names}): going back failed too: {why}; the group is left as it is", Status.FAILED)
    # A group the step no longer held out of the proxy (from its rejoin on) is drained first, as on the way out:
    # restarted while listed, its requests in flight fail (CI: a bake failed on TTFT, four 500s through the proxy).
    phase = Phase.STAGING if step.phase in OUT_OF_PROXY else Phase.DRAINING
    back = _enter(step, phase, now, failed=why, from_hash=step.to_hash, to_hash=step.from_hash, drained=(),
                  staged=(), stage_errors={}, canary={}, bake={}, proxy_out=False, proxy_in=False, base={},
                  unlisted=False)  # fmt: skip
    return record.with_step(i, back).say(now, f"step {i + 1} ({names}) failed: {why}; rolling {names} back to the "
                                              "previous config, then halting")  # fmt: skip


def _lagging(record: Record, obs: Observed) -> Record | None:
    """Every step done: the rollout is done once every member publishes the new file (the members no step touched
    stage it now, without a restart), so that "done" means one file in `nodeagentctl cluster status`; a member that
    does not within PUBLISH_TIMEOUT_S is named in the last word. None: nothing to wait for."""
    if not record.finishing or not record.new_shared:
        return None
    behind = {n: h for n, h in sorted(obs.published.items()) if h != record.new_shared}
    if not behind:
        return None
    since = max((s.finished for s in record.steps if s.finished is not None), default=obs.now)
    named = ", ".join(f"{n} ({str(h)[:12]})" for n, h in behind.items())
    if obs.now - since >= PUBLISH_TIMEOUT_S:
        return record.say(obs.now, f"rollout {record.id}: every step done; {named} still publish another file "
                                   f"after {PUBLISH_TIMEOUT_S:.0f}s (see their agents' rollout_stage_failed "
                                   "events)", Status.DONE)  # fmt: skip
    text = f"rollout {record.id}: every step done; waiting for every member to publish {record.new_shared[:12]}"
    return record if record.message == text else record.say(obs.now, text)


def _ended(record: Record, now: float) -> Record:
    final = {Status.RUNNING: Status.DONE, Status.ROLLING_BACK: Status.ROLLED_BACK,
             Status.ABORTING: Status.ABORTED}.get(record.status)  # fmt: skip
    if final is None:
        return record
    words = {Status.DONE: "every step done", Status.ROLLED_BACK: "rolled back", Status.ABORTED: "aborted"}[final]
    return record.say(now, f"rollout {record.id}: {words}", final)


Move = tuple[Record, list[Ask]] | None
"""A transition: the record to write and what to ask after; None when nothing moves now."""


def advance(record: Record, obs: Observed) -> Move:
    """The next transition (the record to write and what to ask after), or None when nothing moves now: the step in
    progress, else the next pending one, moved on by its phase's rule (`_BY_PHASE`)."""
    if not record.active:
        return None
    i = record.current()
    if i is None:
        lagging = _lagging(record, obs)
        if lagging is not None:
            return (lagging, []) if lagging is not record else None
        ended = _ended(record, obs.now)
        return (ended, []) if ended is not record else None
    step = record.steps[i]
    rule = _BY_PHASE.get(step.phase)
    return rule(record, i, step, obs) if rule is not None else None


def _pending(record: Record, i: int, step: Step, obs: Observed) -> Move:
    now, names = obs.now, ", ".join(step.groups)
    if record.status not in MOVING:
        ended = _ended(record, now) if record.status == Status.ABORTING else record
        return (ended, []) if ended is not record else None
    files = files_problem(step, obs)
    why = files or floor_problem(record, step, obs)
    if why is not None:
        waited = now - waiting_since(record, f"step {i + 1} ({names}) waits", now)
        if files is not None and waited >= FILES_WAIT_S:
            return record.say(now, f"step {i + 1} ({names}) halted after {waited / 60:.0f} min {files} (install "
                              "it there, then `nodeagentctl cluster rollout resume`)", Status.HALTED), []
        text = f"step {i + 1} ({names}) waits ({waited:.0f}s): {why}"
        said = record.history[-1][0] if record.history else 0.0
        # Said once, then at most every WAIT_SAY_S: each agent's view differs a little (a report, a member
        # record late), and every write of the record is read by every agent.
        if record.message == text or (record.message.startswith(f"step {i + 1} ({names}) waits")
                                      and now - said < WAIT_SAY_S):  # fmt: skip
            return None
        return record.say(now, text), []
    return record.with_step(i, _enter(step, Phase.DRAINING, now, started=now)).say(
        now, f"step {i + 1} ({names}): out of the proxy, draining"), []


def _draining(record: Record, i: int, step: Step, obs: Observed) -> Move:
    now, names, opts = obs.now, ", ".join(step.groups), record.options
    if record.status == Status.ABORTING and not step.failed:
        return record.with_step(i, _enter(step, Phase.SKIPPED, now, finished=now)).say(
            now, f"step {i + 1} ({names}) cancelled before its restart: back in the proxy"), []
    nodes = step.nodes({g: o.nodes for g, o in obs.groups.items()})
    out = step.proxy_out or not obs.proxy
    if out and set(nodes) <= set(step.drained):
        return record.with_step(i, _enter(step, Phase.STAGING, now)).say(
            now, f"step {i + 1} ({names}): drained; the members take the new config"), []
    if now - step.since >= opts.drain_timeout_s:
        left = [n for n in nodes if n not in step.drained]
        return record.with_step(i, _enter(step, Phase.STAGING, now)).say(
            now, f"step {i + 1} ({names}): drain timed out after {opts.drain_timeout_s:.0f}s "
                 f"({', '.join(left) or 'the proxy'} not drained); going on"), []  # fmt: skip
    return None


def _staging(record: Record, i: int, step: Step, obs: Observed) -> Move:
    now, names = obs.now, ", ".join(step.groups)
    if step.stage_errors:
        node, why = next(iter(step.stage_errors.items()))
        return _fail(record, i, step, f"{node} cannot take the config: {why}", now), []
    nodes = step.nodes({g: o.nodes for g, o in obs.groups.items()})
    if set(nodes) <= set(step.staged):
        base = {g: obs.groups[g].generation or 0 for g in step.groups}
        return record.with_step(i, _enter(step, Phase.RESTARTING, now, base=base)).say(
            now, f"step {i + 1} ({names}): restarting with {step.to_hash[:12]}"), _asks(record, step, base)
    if now - step.since >= STAGE_TIMEOUT_S:
        left = [n for n in nodes if n not in step.staged]
        return _fail(record, i, step, f"{', '.join(left)} did not take the config within "
                                      f"{STAGE_TIMEOUT_S:.0f}s", now), []  # fmt: skip
    return None


def _restarting(record: Record, i: int, step: Step, obs: Observed) -> Move:
    now, names = obs.now, ", ".join(step.groups)
    if all((obs.groups[g].generation or 0) > step.base.get(g, 0) for g in step.groups):
        return record.with_step(i, _enter(step, Phase.GATING, now)).say(
            now, f"step {i + 1} ({names}): restarted; waiting for every rank ready and a canary answer"), []
    return None if now - step.since < 10.0 else (record, _asks(record, step, dict(step.base)))


def _gating(record: Record, i: int, step: Step, obs: Observed) -> Move:
    now, names, opts = obs.now, ", ".join(step.groups), record.options
    problem = _health_problem(step, obs)
    if problem is not None:
        return _fail(record, i, step, problem, now), []
    canary_bad = {g: v for g, v in step.canary.items() if v != "ok"}
    if canary_bad:
        group, why = next(iter(canary_bad.items()))
        return _fail(record, i, step, f"the canary request to {group} failed: {why}", now), []
    if all(ready_again(step, obs, g) and step.canary.get(g) == "ok" for g in step.groups):
        return record.with_step(i, _enter(step, Phase.REJOINING, now)).say(
            now, f"step {i + 1} ({names}): gate passed; back into the proxy"), []
    if now - step.since >= opts.gate_timeout_s:
        waiting = "; ".join(f"{g}: {obs.groups[g].why or 'canary pending'}" for g in step.groups)
        return _fail(record, i, step, f"not ready within the gate timeout {opts.gate_timeout_s:.0f}s "
                                      f"({waiting})", now), []  # fmt: skip
    return None


def _rejoining(record: Record, i: int, step: Step, obs: Observed) -> Move:
    now, names = obs.now, ", ".join(step.groups)
    problem = _health_problem(step, obs)
    if problem is not None:
        return _fail(record, i, step, problem, now), []
    if step.proxy_in or not obs.proxy:
        if step.failed:
            ended = record.with_step(i, _enter(step, Phase.ROLLED_BACK, now, finished=now))
            return ended.say(now, f"step {i + 1} ({names}) rolled back after: {step.failed}; the rollout is "
                                  "halted (resume retries it, rollback undoes the steps done)", Status.HALTED), []
        bake = 0.0 if step.rollback else record.options.bake_s
        return record.with_step(i, _enter(step, Phase.BAKING, now)).say(
            now, f"step {i + 1} ({names}): in the proxy; baking {bake:.0f}s"), []
    if now - step.since >= REJOIN_TIMEOUT_S:
        # Not the group's fault (vllm-ascend's proxy takes a removed instance back only once it was idle):
        # wait, and say so once; the next step must not take another group out meanwhile.
        text = (f"step {i + 1} ({names}): healthy, not back in the proxy after {REJOIN_TIMEOUT_S:.0f}s (see "
                "the proxy's groups in nodeagentctl cluster --json); waiting")  # fmt: skip
        return (record.say(now, text), []) if record.message != text else None
    return None


def _baking(record: Record, i: int, step: Step, obs: Observed) -> Move:
    now, names = obs.now, ", ".join(step.groups)
    problem = _health_problem(step, obs)
    if problem is not None:
        return _fail(record, i, step, f"while baking: {problem}", now), []
    if step.bake:
        group, why = next(iter(step.bake.items()))
        return _fail(record, i, step, f"while baking, {group}: {why}", now), []
    if now - step.since >= (0.0 if step.rollback else record.options.bake_s):
        done = record.with_step(i, _enter(step, Phase.DONE, now, finished=now)).say(
            now, f"step {i + 1} ({names}) done")
        return done, []
    return None


_BY_PHASE: dict[Phase, Callable[[Record, int, Step, Observed], Move]] = {
    Phase.PENDING: _pending, Phase.DRAINING: _draining, Phase.STAGING: _staging, Phase.RESTARTING: _restarting,
    Phase.GATING: _gating, Phase.REJOINING: _rejoining, Phase.BAKING: _baking,
}
"""Each phase's rule: the step's next transition from it (an ended phase has none)."""


def _asks(record: Record, step: Step, base: Mapping[str, int]) -> list[Ask]:
    why = "rollback" if step.failed or step.rollback else "rollout"
    return [Ask(g, base.get(g, 0), f"{why} {record.id}: {step.from_hash[:12]} → {step.to_hash[:12]}")
            for g in step.groups]  # fmt: skip


def _health_problem(step: Step, obs: Observed) -> str | None:
    """A failed rank, or a generation past ours (a rank crashed with the new config and its group restarted)."""
    for g in step.groups:
        o = obs.groups[g]
        failed = [rank for rank, gen in o.failed.items() if gen > step.base.get(g, 0)]
        if failed:
            return f"{', '.join(failed)} failed"
        if o.generation is not None and o.generation > step.base.get(g, 0) + 1:
            return f"group {g} restarted again (generation {o.generation}): a rank failed"
    return None


def ready_again(step: Step, obs: Observed, group: str) -> bool:
    """Every rank ready at a generation past the step's base. Each agent reads the member records and the gang
    record through its own watch, a little late: without the generation a late view of the old ranks would pass
    the gate, and a late view after it would fail a healthy group — so after the gate only hard signals count (a
    failed rank, a generation past ours; a rank that stays unready is its own probes' business)."""
    o = obs.groups[group]
    return o.healthy and (o.generation or 0) > step.base.get(group, 0)


# ---- marks: what one agent saw, merged into the step it belongs to ------------------------------------------------


def mark(record: Record, index: int, what: str, node: str, value: str = "",
         now: float | None = None) -> Record | None:  # fmt: skip
    """The record with this agent's observation added (None: already there, or the step moved on). `now`: when
    the proxy let the step's groups go or took them back (`proxy_out`, `proxy_in`): the step's measured outage."""
    step = record.steps[index]
    phase_of = {"drained": (Phase.DRAINING,), "proxy_out": (Phase.DRAINING,), "staged": (Phase.STAGING,),
                "stage_error": (Phase.STAGING,), "canary": (Phase.GATING,), "proxy_in": (Phase.REJOINING,),
                "bake": (Phase.BAKING,),
                "unlisted": RESTARTS}  # fmt: skip
    if step.phase not in phase_of[what]:
        return None
    if what == "drained":
        new = replace(step, drained=(*step.drained, node)) if node not in step.drained else None
    elif what == "staged":
        new = replace(step, staged=(*step.staged, node)) if node not in step.staged else None
    elif what == "stage_error":
        new = replace(step, stage_errors={**step.stage_errors, node: value}) if node not in step.stage_errors else None
    elif what == "canary":
        new = replace(step, canary={**step.canary, node: value}) if node not in step.canary else None
    elif what == "bake":
        new = replace(step, bake={**step.bake, node: value}) if node not in step.bake else None
    elif what == "proxy_out":
        new = replace(step, proxy_out=True, out_at=now) if not step.proxy_out else None
    elif what == "unlisted":
        new = replace(step, unlisted=True) if not step.unlisted else None
    else:
        new = replace(step, proxy_in=True, in_at=now) if not step.proxy_in else None
    return record.with_step(index, new) if new is not None else None


def held_out(record: Record | None, runs: Runs | None = None) -> dict[str, str]:
    """group → why the proxy must not route to it now: the step in progress, from its drain to its gate; and, in
    an exclusive rollout, every group that may run another file than the one the proxy routes (`serving_hash`;
    `runs`: what the groups' ranks run, `rollout.running`)."""
    if record is None:
        return {}
    out = {}
    for i, s in enumerate(record.steps):
        # a final record's step holds nothing: one whose way back failed is left in its phase, and nothing would
        # ever take its group back into the proxy however healthy (the simulation: the only decode group, for good)
        if s.phase in OUT_OF_PROXY and record.active:
            for g in s.groups:
                out[g] = f"rollout {record.id} step {i + 1}: {s.phase}"
    return {**kept_apart(record, runs), **out}


def kept_apart(record: Record, runs: Runs | None = None) -> dict[str, str]:
    """An exclusive rollout's groups that may run another file than the one the proxy routes → why: judged by the
    files their ranks run (`runs`) where the members say, else by where the record's steps stood."""
    if not record.exclusive:
        return {}
    serving, said = serving_hash(record), members_say(record, runs)
    files = {**group_files(record), **said}
    if said and set(files) <= set(said) and len(set().union(*files.values())) == 1:
        return {}  # every group's ranks run one file: nothing to keep apart, whatever the steps say (seed 760372)
    return {g: f"rollout {record.id}: runs {'/'.join(sorted(f[:12] for f in fs))} while the proxy routes "
               f"{serving[:12]} (an incompatible change: never routed together)"
            for g, fs in files.items() if fs != {serving}}  # fmt: skip


def members_say(record: Record, runs: Runs | None) -> dict[str, frozenset[str]]:
    """group → the files (the record's `old_hash`/`new_hash`) its ranks run as its members say (`runs`, told apart
    by the shared sections' hash); a group they do not say, or running a file that is neither (reloaded since), is
    left to the record (`group_files`). A step left mid-way says "either file" for good (its way back failed, a
    rollback undid the others: seed 760050), while the ranks run one."""
    names = {record.old_shared: record.old_hash, record.new_shared: record.new_hash}
    if not record.old_shared or not record.new_shared or record.old_shared == record.new_shared:
        return {}
    return {g: frozenset(names[f] for f in files) for g, files in (runs or {}).items()
            if files and all(f in names for f in files)}  # fmt: skip


def group_files(record: Record) -> dict[str, frozenset[str]]:
    """group → the files its processes may run now: the step's two while it restarts (the old processes until
    they stopped, the new after), one otherwise (groups no step touches: absent)."""
    out: dict[str, frozenset[str]] = {}
    for s in record.steps:
        for g in s.groups:
            if s.phase in (Phase.PENDING, Phase.DRAINING, Phase.SKIPPED):
                out.setdefault(g, frozenset((s.from_hash,)))
            elif s.phase in RESTARTS:
                out[g] = frozenset((s.from_hash, s.to_hash))
            else:
                out[g] = frozenset((s.to_hash,))
    return out


def serving_hash(record: Record) -> str:
    """The file whose groups the proxy routes in an exclusive rollout: that of the last step that passed its gate
    (it switches the proxy as it rejoins), else the running one."""
    serving = record.old_hash
    for s in record.steps:
        if s.phase in (Phase.REJOINING, Phase.BAKING, Phase.DONE, Phase.ROLLED_BACK):
            serving = s.to_hash
    return serving


def fence(record: Record | None, runs: Runs | None = None) -> dict[str, tuple[str, ...]]:
    """group → the groups that must have left the proxy before it is added (an exclusive rollout's switch: the
    new pair joins only once no old group is listed, so no request is ever routed across the two files)."""
    if record is None or not record.exclusive:
        return {}
    serving, files = serving_hash(record), {**group_files(record), **members_say(record, runs)}
    others = tuple(sorted(g for g, f in files.items() if f != {serving}))
    return {g: others for g, f in files.items() if f == {serving}} if others else {}


def proxy_wait(record: Record | None, group: str, proxied: bool) -> str | None:
    """Why a rank of `group` must not start yet (None: it may). In an exclusive rollout a step's ranks start on the
    other file only once the proxy lists none of the step's groups (`Step.unlisted`): vllm-ascend's proxy keeps an
    instance removed under load (routing to it when it is its kind's last) until it is idle once, so a group
    started while still listed is sent requests prefilled on the old file (CI: the only decode group, back fast,
    got the old prefill group's requests). While its ranks are stopped every request to it fails at once, and the
    proxy's idle moment comes. `proxied`: the cluster runs a proxy (else nothing routes)."""
    if record is None or not record.exclusive or not proxied or not record.active:
        return None
    i = record.current()
    step = record.steps[i] if i is not None else None
    if i is None or step is None or group not in step.groups or step.phase not in RESTARTS or step.unlisted:
        return None
    return (f"rollout {record.id} step {i + 1}: waiting for the proxy to delete {', '.join(step.groups)} (it does "
            "once no request is in flight): started while it still lists them, the old file's groups would send "
            "them requests (an incompatible change)")


def next_restart(record: Record | None, group: str, acted: int, observe: Callable[[], Observed]) -> str | None:
    """Why a rank of `group` starting now, in generation `acted`, would be stopped again by the rollout's next
    known decision (None: it would not): one generation, one launch. The step's own generation comes after its
    drain and staging, or is asked and not yet acted on here; a forward step whose health already fails (a rank
    crashed with the new file: the group's generation moved past the step's) rolls the group back next. A start
    meanwhile is a vLLM killed as it loads (CI: the crash's generation launched a rank on the previous file, the
    rollback's generation killed it 11 ms later; on an A2, 8 NPUs grabbed mid-init). `observe`: the cluster as
    seen here, read only when the step's health decides."""
    if record is None or not record.active:
        return None
    i = record.current()
    step = record.steps[i] if i is not None else None
    if i is None or step is None or group not in step.groups:
        return None
    what = f"rollout {record.id} step {i + 1}"
    back = bool(step.failed or step.rollback)
    if step.phase == "draining" and record.status == "aborting" and not step.failed:
        return None  # cancelled before its restart: nothing follows
    if step.phase in ("draining", "staging"):
        until = "is drained and took the file" if step.phase == "draining" else "took the file"
        return f"{what} restarts {group} once every member {until}: it starts then"
    if step.phase == "restarting" and acted <= step.base.get(group, 0):
        return f"{what}: {group}'s generation past {step.base.get(group, 0)} is asked; it starts in that one"
    if step.phase in ("gating", "rejoining", "baking") and not back:
        problem = _health_problem(step, observe())
        if problem is not None:
            return f"{what} fails ({problem}): {group} goes back to the previous file next; it starts then"
    return None


def _mixed_after_abort(record: Record) -> list[str]:
    """The groups an abort would leave on another file than the proxy's (an exclusive rollout only)."""
    ended = replace(record, steps=tuple(
        replace(s, phase=Phase.SKIPPED if s.phase in (Phase.PENDING, Phase.DRAINING) else Phase.DONE)
        if s.in_progress or s.phase == Phase.PENDING else s for s in record.steps))  # fmt: skip
    serving = serving_hash(ended)
    return sorted(g for g, f in group_files(ended).items() if f != {serving})


def wanted_hash(record: Record | None, group: str | None, node: str) -> str | None:
    """The file this member's ranks of `group` run (or are staged to run) as the rollout stands; None: no say.
    A member no step changes (another group, or none) follows the cluster: the new file once every step is done
    (the rollout is done once it publishes it)."""
    if record is None:
        return None
    if group is None or not any(group in s.groups for s in record.steps):
        # Nothing of this member renders differently: it takes the new file once the rollout is done.
        return record.new_hash if record.status == Status.DONE or record.finishing else record.old_hash
    want = record.old_hash
    for s in record.steps:
        if group not in s.groups or s.phase in (Phase.PENDING, Phase.SKIPPED):
            continue
        staged = s.phase != Phase.DRAINING and (s.phase != Phase.STAGING or node in s.staged)
        want = s.to_hash if staged else s.from_hash
    return want


def control(record: Record, action: str, now: float, by: str) -> Record:
    """pause | resume | abort | rollback, as the operator asked; raises ValueError when it does not apply."""
    if action == "pause":
        if record.status != Status.RUNNING:
            raise ValueError(f"rollout {record.id} is {record.status}: only a running rollout pauses")
        return record.say(now, f"paused by {by}: the step in progress finishes, no next one starts", Status.PAUSED)
    if action == "resume":
        if record.status == Status.PAUSED:
            return record.say(now, f"resumed by {by}", Status.RUNNING)
        if record.status == Status.HALTED:
            steps = tuple(replace(s, phase=Phase.PENDING, failed="", from_hash=s.to_hash, to_hash=s.from_hash,
                                  since=now, drained=(), staged=(), stage_errors={}, canary={}, bake={},
                                  proxy_out=False, proxy_in=False, base={}, finished=None, unlisted=False)
                          if s.phase == Phase.ROLLED_BACK else s
                          for s in record.steps)  # fmt: skip
            return replace(record, steps=steps).say(now, f"resumed by {by}: retrying the step that failed",
                                                    Status.RUNNING)  # fmt: skip
        raise ValueError(f"rollout {record.id} is {record.status}: nothing to resume")
    if action == "abort":
        left = _mixed_after_abort(record) if record.exclusive else []
        if left and record.status != Status.ABORTED:
            raise ValueError(f"rollout {record.id} changes the KV connector or vllm-ascend version: stopping here "
                             f"would leave {', '.join(left)} on the other file, out of the proxy for good (old and "
                             "new are never routed together); rollback goes back, resume goes on")  # fmt: skip
        if record.status == Status.HALTED:
            # nothing runs for a halted rollout; closing it is what lets the operator start the next one
            return record.say(now, f"closed by {by}: the halted rollout ends here; the groups stay as they are",
                              Status.ABORTED)  # fmt: skip
        if not record.active:
            raise ValueError(f"rollout {record.id} is {record.status} already")
        steps = tuple(replace(s, phase=Phase.SKIPPED, finished=now) if s.phase == Phase.PENDING else s
                      for s in record.steps)  # fmt: skip
        return replace(record, steps=steps).say(now, f"aborted by {by}: no further step; a step past its restart "
                                                     "finishes", Status.ABORTING)  # fmt: skip
    if action == "rollback":
        if record.status in (Status.ROLLING_BACK, Status.ROLLED_BACK):
            raise ValueError(f"rollout {record.id} is {record.status} already")
        back = [s for s in record.steps if (s.phase == Phase.DONE or s.in_progress) and not s.rollback and not s.failed]
        # A pending step is cancelled; so is one whose way back failed (the rollout ended `failed` with it in its
        # phase): driven again it would only fail again, and the undo of the others never start (seed 760050).
        # Its groups stay as they are, routed by what their ranks run (`kept_apart`).
        stuck = record.status == Status.FAILED
        steps = tuple(replace(s, phase=Phase.SKIPPED, finished=now)
                      if s.phase == Phase.PENDING or (stuck and s.in_progress and (s.failed or s.rollback)) else s
                      for s in record.steps)  # fmt: skip
        undo = tuple(Step(s.groups, s.kinds, s.to_hash, s.from_hash, rollback=True, outage=s.outage,
                          expected_outage_s=s.expected_outage_s, note="rollback") for s in reversed(back))  # fmt: skip
        if not undo:
            raise ValueError(f"rollout {record.id}: no step was done, nothing to roll back")
        return replace(record, steps=steps + undo).say(
            now, f"rollback by {by}: {', '.join(g for s in undo for g in s.groups)} go back to the previous config",
            Status.ROLLING_BACK)  # fmt: skip
    raise ValueError(f"unknown rollout action {action!r} (pause, resume, abort, rollback)")

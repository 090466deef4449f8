"""`--wait` for a rank of a multi-node group waits for the group's whole new generation (pure: member records
as `GET /cluster` shows them)."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.cli.actions import STUCK_S, StuckHolds, group_waiter
from nodeagent.cli.common import EXIT_FAILED, CliError
from nodeagent.cli.groupwait import component_of, group_of, group_progress


def member(name: str, group: str, generation: int, pid: int | None, state: str = "ready", released: bool = True,
           present: bool = True, hold: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    vllm = {"state": state, "pid": pid, "ready": state == "ready", **({"hold": hold} if hold else {})}
    return {"name": name, "group": group, "present": present,
            "components": {"datasystem": {"state": "running", "pid": 1, "ready": True}, "vllm": vllm},
            "gangs": {group: {"generation": generation, "released": released, "ranks": ["vllm"],
                              "running": ["vllm"] if pid else []}}}  # fmt: skip


def view(*members: dict[str, Any]) -> dict[str, Any]:
    return {"members": list(members)}


def test_a_rank_of_a_two_node_group_waits_for_both_nodes_and_the_next_generation() -> None:
    before = view(member("n2", "p1", 4, 100), member("n3", "p1", 4, 200), member("n4", "d0", 1, 300))
    wait = group_of(before, "n2", "vllm")
    assert wait is not None and (wait.group, wait.nodes, wait.generation) == ("p1", ("n2", "n3"), 5)
    assert wait.before == {"n2": {"vllm": 100}, "n3": {"vllm": 200}}
    assert group_of(before, "n4", "vllm") is None, "a one-node group: the node's own wait"
    assert group_of(before, "n2", "datasystem") is None, "not a rank"

    steps = [
        view(member("n2", "p1", 4, 100), member("n3", "p1", 4, 200)),  # asked, not acted yet
        view(member("n2", "p1", 5, None, "stopped", False), member("n3", "p1", 5, None, "stopped", False)),
        view(member("n2", "p1", 5, 101, "starting"), member("n3", "p1", 5, 201)),  # one rank still loading
        view(member("n2", "p1", 5, 101), member("n3", "p1", 4, 200)),  # n3's record not yet rewritten
    ]
    for step in steps:
        message, summary = group_progress(wait, step)
        assert message is None and summary.startswith("group p1 (generation 5): n2: generation"), summary
    assert "at the barrier" in group_progress(wait, steps[1])[1]
    message, _ = group_progress(wait, view(member("n2", "p1", 5, 101), member("n3", "p1", 5, 201)))
    assert message == "group p1 generation 5 ready on every node (n2/vllm pid 101, n3/vllm pid 201)"


def test_a_failed_rank_or_a_missing_agent_is_said() -> None:
    wait = group_of(view(member("n2", "p1", 1, 100), member("n3", "p1", 1, 200)), "n3", "vllm")
    assert wait is not None
    with pytest.raises(CliError, match=r"group p1: n3/vllm failed"):
        group_progress(wait, view(member("n2", "p1", 2, 101), member("n3", "p1", 2, None, "failed")))
    message, summary = group_progress(wait, view(member("n2", "p1", 2, 101)))
    assert message is None and "n3: no agent" in summary


def test_another_nodes_component_is_followed_through_its_member_key() -> None:
    wait = component_of(view(member("n4", "d0", 1, 300)), "n4", "vllm", "restart")
    assert group_progress(wait, view(member("n4", "d0", 1, 300)))[0] is None, "the old process is not the new"
    assert group_progress(wait, view(member("n4", "d0", 1, 301, "starting")))[0] is None
    assert group_progress(wait, view(member("n4", "d0", 1, 301)))[0] == "n4/vllm ready (n4/vllm pid 301)"
    stop = component_of(view(member("n4", "d0", 1, 300)), "n4", "vllm", "stop")
    assert group_progress(stop, view(member("n4", "d0", 1, None, "stopped")))[0] == "n4/vllm stopped"


FOREIGN = {"kind": "foreign_holder", "resolves_itself": False,
           "reason": "port 18010 in use by pid 4242 (python3 -m http.server) — not ours, never signalled; starting "
                     "once it is free"}  # fmt: skip
BARRIER = {"kind": "barrier", "resolves_itself": True,
           "reason": "group p0 generation 4: waiting 2s at the start barrier for n0 (1/2 arrived)"}  # fmt: skip


def test_a_rank_held_by_what_its_agent_will_not_resolve_ends_the_group_wait_early() -> None:
    """issue 17: a stranger on one rank's port made a group's `restart --wait` run to --timeout without a word:
    the member keys carried no holds. The hold is shown, named by node and rank, and one that does not resolve
    itself ends the wait after STUCK_S, as the local wait does."""
    now = [0.0]
    wait = group_of(view(member("n0", "p0", 3, 100), member("n1", "p0", 3, 200)), "n1", "vllm")
    assert wait is not None
    progress = group_waiter(wait, "restart", StuckHolds(lambda: now[0]))
    held = view(member("n0", "p0", 4, None, "stopped", hold=FOREIGN), member("n1", "p0", 4, 201, "starting"))
    message, summary = progress(held)
    assert message is None and "n0: generation 4, vllm stopped (held: port 18010 in use by pid 4242" in summary
    now[0] = STUCK_S - 0.1
    assert progress(held)[0] is None, "a hold may be a moment's: it must stand STUCK_S"
    now[0] = STUCK_S
    with pytest.raises(CliError, match=r"^n0/vllm restart held: port 18010 in use by pid 4242 .*will not resolve "
                                       r"this by itself") as stuck:  # fmt: skip
        progress(held)
    assert stuck.value.code == EXIT_FAILED


def test_holds_that_resolve_themselves_or_end_do_not_end_the_group_wait() -> None:
    now = [0.0]
    wait = group_of(view(member("n0", "p0", 3, 100), member("n1", "p0", 3, 200)), "n0", "vllm")
    assert wait is not None
    progress = group_waiter(wait, "restart", StuckHolds(lambda: now[0]))
    at_barrier = view(member("n0", "p0", 4, None, "stopped", False, hold=BARRIER), member("n1", "p0", 4, None,
                                                                                          "stopped", False))
    for now[0] in (0.0, 60.0, 600.0):
        message, summary = progress(at_barrier)
        assert message is None and "(held: group p0 generation 4: waiting 2s" in summary and "at the barrier" in summary
    # a stranger's hold that goes (the barrier holds next) and comes back is timed afresh
    for now[0], hold in ((700.0, FOREIGN), (702.0, BARRIER), (703.0, FOREIGN), (703.0 + STUCK_S - 0.1, FOREIGN)):
        assert progress(view(member("n0", "p0", 4, None, "stopped", hold=hold), member("n1", "p0", 4, 201)))[0] is None
    # once a process runs, a stale hold in the record no longer counts
    now[0] = 800.0
    assert progress(view(member("n0", "p0", 4, 101, "starting", hold=FOREIGN), member("n1", "p0", 4, 201)))[0] is None
    stop = group_waiter(component_of(view(member("n4", "d0", 1, 300)), "n4", "vllm", "stop"), "stop",
                        StuckHolds(lambda: now[0]))  # fmt: skip
    desired_stopped = {"kind": "desired_stopped", "reason": "desired state is stopped", "resolves_itself": False}
    now[0] = 900.0
    assert stop(view(member("n4", "d0", 1, None, "stopped", hold=desired_stopped)))[0] == "n4/vllm stopped"

"""`--wait` for a rank of a multi-node group waits for the group's whole new generation (pure: member records
as `GET /cluster` shows them)."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.cli.common import CliError
from nodeagent.cli.groupwait import group_of, group_progress


def member(name: str, group: str, generation: int, pid: int | None, state: str = "ready", released: bool = True,
           present: bool = True) -> dict[str, Any]:  # fmt: skip
    return {"name": name, "group": group, "present": present,
            "components": {"datasystem": {"state": "running", "pid": 1, "ready": True},
                           "vllm": {"state": state, "pid": pid, "ready": state == "ready"}},
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
    from nodeagent.cli.groupwait import component_of

    wait = component_of(view(member("n4", "d0", 1, 300)), "n4", "vllm", "restart")
    assert group_progress(wait, view(member("n4", "d0", 1, 300)))[0] is None, "the old process is not the new"
    assert group_progress(wait, view(member("n4", "d0", 1, 301, "starting")))[0] is None
    assert group_progress(wait, view(member("n4", "d0", 1, 301)))[0] == "n4/vllm ready (n4/vllm pid 301)"
    stop = component_of(view(member("n4", "d0", 1, 300)), "n4", "vllm", "stop")
    assert group_progress(stop, view(member("n4", "d0", 1, None, "stopped")))[0] == "n4/vllm stopped"

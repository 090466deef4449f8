"""The PD watch claims a group's restart only once a generation was granted (issue 29 item 2): the cooldown and
the "restarts" event follow the grant; etcd away or a busy record is said as such and asked again at the next
round. Before, the cooldown was armed and "group X restarts" said first, and the failure was swallowed: the group
was not restarted for 300 s while the log said it was."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cluster_fakes import World
from test_pd_watch import GROUPS, Backends, pd_world

from nodeagent.cluster.pd_watch import RESTART_COOLDOWN_S, PdWatch
from nodeagent.config.recovery import PdWatchConfig

pytestmark = pytest.mark.usefixtures("no_processes")


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async for w in pd_world(tmp_path / "w", GROUPS):
        yield w


def said(world: World, text: str) -> list[str]:
    return [e["message"] for e in world.stacks["n0"].events_of("pd_watch") if text in e["message"]]


async def test_empty_answers_while_etcd_is_away_restart_the_group_once_it_answers_not_a_cooldown_later(
        world: World) -> None:  # fmt: skip
    backends = Backends()
    backends.decode_answer = (200, "")
    co = world.agents["n0"].coordinator
    watch = PdWatch(co, PdWatchConfig(probe_period_s=10), lambda: {}, model="dsv4", clock=world.clock,
                    http=backends)  # fmt: skip
    world.store.set_reachable(False)
    co.spawn(watch.run())
    await world.advance(45)
    assert world.stacks["n2"].started("vllm") == 1 and not watch.acted, "nothing granted: nothing claimed"
    assert not said(world, "restarts"), "no restart claimed"
    refused = said(world, "group d0 not restarted (etcd unavailable")
    assert len(refused) == 1 and "asked again at the next round" in refused[0], "said once, not every round"
    assert watch.status_section()["pd_watch"]["refused"]["d0"].startswith("etcd unavailable")
    world.store.set_reachable(True)
    await world.until("d0 restarted", lambda: world.stacks["n2"].started("vllm") == 2, 60)
    assert world.clock.monotonic() - watch.acted[("empty", "d0")] < RESTART_COOLDOWN_S / 4
    (claimed,) = said(world, "group d0 restarts: ")
    assert "answers in a row without the 2 tokens asked" in claimed and claimed.endswith("(generation 2)"), claimed
    assert watch.status_section()["pd_watch"]["refused"] == {}


async def test_a_busy_record_is_not_a_restart(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    co = world.agents["n0"].coordinator
    watch = PdWatch(co, PdWatchConfig(probe_period_s=10), lambda: {}, model="dsv4", clock=world.clock,
                    http=Backends())  # fmt: skip
    answers = iter(["busy: another node is changing it; try again", "generation 7"])

    async def ask(groups: list[str], reason: str, planned: bool) -> dict[str, Any]:
        return {g: next(answers) for g in groups}

    monkeypatch.setattr(co, "ask_generations", ask)
    assert not await watch._restart("transfer", "d0", "transfer failures with every prefill peer")
    assert not watch.acted and said(world, "group d0 not restarted (busy: another node is changing it")
    assert await watch._restart("transfer", "d0", "transfer failures with every prefill peer"), "asked again"
    assert said(world, "group d0 restarts: transfer failures with every prefill peer (generation 7)")

"""When is etcd's history going back? Answers of concurrent calls arrive in any order, so only an answer below
what was known when its own call was sent is a wiped store (issue 17: a brand-new cluster alarmed
`etcd revision went back from 15 to 14`). No etcd needed: the calls' answers are made up here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from nodeagent.cluster.etcdclient import EtcdSettings
from nodeagent.cluster.etcdstore import EtcdStore
from nodeagent.core.etcd_endpoint import parse_endpoint


def header(revision: int, term: int = 2) -> Any:
    return SimpleNamespace(revision=revision, raft_term=term)


async def test_out_of_order_answers_of_concurrent_calls_are_no_reset() -> None:
    store = EtcdStore(EtcdSettings((parse_endpoint("127.0.0.1:1", False),), 2.0))
    store._observe(header(10))
    slow_sent, slow_answer = asyncio.Event(), asyncio.Event()

    async def slow(_client: Any) -> None:  # sent at 10, answered at 14 — after the fast one's 15
        slow_sent.set()
        await slow_answer.wait()
        store._observe(header(14))

    async def fast(_client: Any) -> None:
        store._observe(header(15))

    try:
        pending = asyncio.ensure_future(store.call("slow put", slow))
        await slow_sent.wait()
        await store.call("fast put", fast)
        slow_answer.set()
        await pending
        assert store.epoch == 0, "a late answer of an earlier call is not history going back"

        async def after_wipe(_client: Any) -> None:  # sent once 15 was known: 3 is a wiped etcd
            store._observe(header(3))

        await store.call("get", after_wipe)
        assert store.epoch == 1, "an answer below what was known when the call went out is a reset"
    finally:
        await store.close()

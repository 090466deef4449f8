"""The shared process table: one pass over /proc in a thread, shared by its readers; a process stop on it keeps the
event loop responsive even when a pass is slow (a loaded host), and still ends the whole tree."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from nodeagent.core import proctable
from nodeagent.core.process import record_of, spawn, stop_tree, tree_of
from nodeagent.core.proctable import ProcessTable, ProcessTables, scan
from nodeagent.npu.monitor import our_pids

SLOW_PASS_S = 1.0


async def max_lag(work: Awaitable[Any]) -> tuple[Any, float]:
    """`work`'s result and the worst lateness of a 1 ms periodic task meanwhile."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            began = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - began - 0.001)

    tick = asyncio.create_task(ticker())
    try:
        result = await work
    finally:
        done.set()
        await tick
    return result, max(lags, default=0.0)


@pytest.fixture
def slow_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pass over /proc takes SLOW_PASS_S more (a host with thousands of processes, or a loaded one)."""
    real = psutil.process_iter

    def slow(*args: Any, **kwargs: Any) -> Iterator[psutil.Process]:
        time.sleep(SLOW_PASS_S)
        return real(*args, **kwargs)

    real_scan = proctable.scan

    def slow_scan(*args: Any, **kwargs: Any) -> ProcessTable:
        time.sleep(SLOW_PASS_S)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(psutil, "process_iter", slow)  # the pass before the table (psutil's objects, on the loop)
    monkeypatch.setattr(proctable, "scan", slow_scan)  # the table's pass
    monkeypatch.setattr(proctable, "TABLES", ProcessTables())
    monkeypatch.setattr("nodeagent.core.process.TABLES", proctable.TABLES, raising=False)  # (absent before the table)


def a_tree(tmp_path: Path) -> tuple[int, list[int]]:
    """A session leader with two children, one of them re-parented away (a daemonised grandchild)."""
    pidfile = tmp_path / "pids"
    script = f"sleep 60 & echo $! >> {pidfile}; (sleep 60 & echo $! >> {pidfile}) ; wait"
    with open(os.devnull, "wb") as out:
        proc = spawn(["sh", "-c", script], dict(os.environ), str(tmp_path), out.fileno())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pids = [int(x) for x in pidfile.read_text().split()] if pidfile.exists() else []
        if len(pids) == 2:
            return proc.pid, pids
        time.sleep(0.01)
    raise AssertionError("the tree did not start")


async def test_a_stop_keeps_the_loop_responsive_on_a_slow_proc_and_ends_the_whole_tree(
        tmp_path: Path, slow_proc: None) -> None:  # fmt: skip
    main, children = a_tree(tmp_path)
    record = record_of(main)
    result, lag = await max_lag(stop_tree(record, 5.0, "tree"))
    assert result["signalled"] == 3, result
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in (main, *children))  # fmt: skip
    assert lag < SLOW_PASS_S / 2, f"the loop stalled {lag * 1000:.0f} ms: a pass over /proc ran on it"


async def test_readers_share_one_pass_within_the_max_age() -> None:
    tables = ProcessTables(max_age_s=60)
    first, second = await asyncio.gather(tables.get(), tables.get())
    assert first is second and tables.scans == 1
    assert await tables.get() is first and tables.scans == 1
    fresh = await tables.get(0)  # a pass begun after the call: a stop's last look
    assert fresh is not first and tables.scans == 2 and fresh.taken_at >= first.taken_at


def test_the_table_finds_the_same_tree_as_before(tmp_path: Path) -> None:
    main, children = a_tree(tmp_path)
    try:
        record = record_of(main)
        table = scan()
        assert set(table.tree(record)) == {main, *children}
        assert {p.pid for p in tree_of(record, table=table)} == {main, *children}
        assert our_pids([record], table) == {main, *children}
        reused = type(record)(record.pid, record.create_time - 100, record.cmdline, 0)  # another process's PID
        assert table.tree(reused) == []
    finally:
        for pid in (main, *children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        os.waitpid(main, 0)


def test_a_pid_reused_after_the_pass_is_left_out() -> None:
    table = ProcessTable({os.getpid(): proctable.ProcInfo(os.getpid(), 1, 1.0, "running", 1)}, 0.0)
    record = type(record_of(os.getpid()))(os.getpid(), 1.0, ("x",), 1)
    assert table.tree(record) == [os.getpid()]
    assert tree_of(record, table=table) == [], "our create_time is not 1.0: the PID is someone else's now"


def test_the_pass_reads_what_psutil_reads(tmp_path: Path) -> None:
    """create_time, ppid, status and session as psutil gives them (records are taken through psutil)."""
    main, children = a_tree(tmp_path)
    try:
        table = scan()
        for pid in (os.getpid(), main, *children):
            proc, info = psutil.Process(pid), table.procs[pid]
            assert (info.ppid, info.status, info.sid) == (proc.ppid(), proc.status(), os.getsid(pid))
            assert abs(info.create_time - proc.create_time()) < 1e-6
        weird = proctable.parse_stat(7, b"7 (a) b (c) S 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0", 1000.0)
        assert (weird.ppid, weird.status, weird.sid) == (1, "sleeping", 7)
        assert weird.create_time == 1000.0 + 100 / os.sysconf("SC_CLK_TCK")
    finally:
        for pid in (main, *children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        os.waitpid(main, 0)


async def test_a_scrape_reads_the_trees_usage_off_the_loop(tmp_path: Path, slow_proc: None) -> None:
    from types import SimpleNamespace

    from nodeagent.api.metrics import AgentMetrics

    main, children = a_tree(tmp_path)
    try:
        comps = {"tree": SimpleNamespace(record=record_of(main))}
        owner = SimpleNamespace(supervisor=SimpleNamespace(components=comps), usage={})
        _, lag = await max_lag(AgentMetrics.refresh_usage(owner))  # type: ignore[arg-type]
        assert owner.usage["tree"][2] == 3
        assert lag < SLOW_PASS_S / 2, f"the loop stalled {lag * 1000:.0f} ms during a scrape"
    finally:
        for pid in (main, *children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        os.waitpid(main, 0)

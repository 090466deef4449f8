"""Every process of one cluster's agents' children, watched from outside: when each was first and last seen alive.

A process is the cluster's by the DSV4_AGENT_CLUSTER variable every child of its agents inherits, or by the session
of one that carried it (vLLM's `setproctitle` — the stand-in's too — overwrites the environment block /proc shows).
The system tests that restart a data-parallel group use it to show that no process of a new generation appeared
while one of the old was still alive, on any node (`assert_no_overlap`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil


def environ(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    return {}


@dataclass
class Seen:
    name: str
    component: str
    first: float
    last: float
    gone: float | None = None

    @property
    def title(self) -> str:
        """Its program or vLLM title (`VLLM::EngineCore_DP1`); `?` while its command line is empty."""
        return (self.name.split() or ["?"])[0]


@dataclass
class ProcessWatch:
    """Every process carrying DSV4_AGENT_CLUSTER=<cluster>, polled every 20 ms: when each was first and last seen
    alive (a zombie counts as gone: it holds nothing but its PID)."""

    cluster: str
    seen: dict[tuple[int, float], Seen] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ProcessWatch:
        self._thread = threading.Thread(target=self._run, daemon=True, name="process-watch")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        sids: dict[int, str] = {}
        """session → component"""
        while not self._stop.is_set():
            alive = set()
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                pid = int(entry)
                try:
                    proc = psutil.Process(pid)
                    key = (pid, proc.create_time())
                    if key not in self.seen:
                        # setproctitle (VLLM::EngineCore_DP1) overwrites the environment block /proc shows, so a
                        # process is ours by the variable or by the session of one that was
                        env, sid = environ(pid), os.getsid(pid)
                        if env.get("DSV4_AGENT_CLUSTER") == self.cluster:
                            sids.setdefault(sid, env.get("DSV4_AGENT_COMPONENT", "?"))
                        if sid not in sids:
                            continue
                        at = time.monotonic()  # when it was seen, not when this scan began
                        self.seen[key] = Seen("", sids[sid], at, at)
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        continue
                    seen = self.seen[key]
                    seen.last = time.monotonic()
                    if not seen.name.startswith("VLLM::"):  # its title is set once its imports are done
                        line = " ".join(proc.cmdline()).strip()
                        seen.name = line if line.startswith("VLLM::") else line[-40:]
                    alive.add(key)
                except (OSError, psutil.Error):
                    continue
            # the end of the scan that found it missing: it went between `last` and then (the scan's start,
            # as before, was up to a scan's time early: a slow head's 10 s tree measured 9.96 s under load)
            scanned = time.monotonic()
            for key, s in self.seen.items():
                if key not in alive and s.gone is None:
                    s.gone = scanned
            self._stop.wait(0.02)

    def timeline(self, since: float) -> str:
        """Every process seen, in order of appearance, with times relative to `since` (for failure messages)."""
        rows = sorted(self.seen.items(), key=lambda kv: kv[1].first)
        return "\n".join(f"  {s.component:9} pid {pid:<7} {s.name:40} seen {s.first - since:8.2f} .. "
                         f"{s.last - since:8.2f}  gone {'-' if s.gone is None else f'{s.gone - since:.2f}'}"
                         for (pid, _), s in rows)  # fmt: skip

    def alive(self) -> dict[tuple[int, float], Seen]:
        return {k: s for k, s in self.seen.items() if s.gone is None}


def assert_no_overlap(watch: ProcessWatch, old: dict[tuple[int, float], Seen], since: float,
                      context: str = "") -> dict[tuple[int, float], Seen]:  # fmt: skip
    """Every process of `old` is gone, and none was seen alive after the first process that appeared since
    `since` (not in `old`) was seen: the new processes, returned."""
    new = {k: s for k, s in watch.seen.items() if k not in old and s.first > since}
    timeline = f"processes (seconds from the fault):\n{watch.timeline(since)}\n{context}"
    assert all(s.gone is not None for s in old.values()), f"old processes alive\n{timeline}"
    assert new, f"no new process\n{timeline}"
    # last seen alive vs first seen: a process seen alive after a new one was seen proves they overlapped
    last_old = max(s.last for s in old.values())
    first_new = min(s.first for s in new.values())
    print(f"last old process seen alive → first new one seen: {first_new - last_old:.2f}s; "
          f"old: {sorted({s.title for s in old.values()})}")  # fmt: skip
    assert last_old < first_new, f"a process of the new generation appeared while one of the old was alive\n{timeline}"
    return new

"""One agent per state dir: an exclusive flock held for the agent's whole life.

Two agents on one state dir would adopt the same PIDs and fight over them (one's SIGTERM stops the stack, the
other reads that as crashes). The kernel releases a flock when its holder dies, so a crashed agent never blocks
its successor; the lock file also says who holds it, so the refused agent can name it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from nodeagent.core.errors import AgentError

LOCK_NAME = "agent.lock"
EXIT_LOCKED = 75
"""EX_TEMPFAIL; the unit lists it in RestartPreventExitStatus so systemd does not loop on a refused start."""


class AlreadyRunning(AgentError):
    exit_code = EXIT_LOCKED


class InstanceLock:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        self.fd: int | None = None
        self.info: dict[str, Any] = {}

    def holder(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.path.read_text(encoding="utf-8") or "{}")
            return data if isinstance(data, dict) else {}
        return {}

    def acquire(self, info: dict[str, Any], wait_s: float = 0.0) -> None:
        """Take the lock or raise AlreadyRunning naming the holder. `wait_s`: how long to wait for a holder that
        is detaching (an upgrade hands over: the old agent exits, then releases)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = self.holder()
                if holder.get("phase") in ("detaching", "stopping") and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                os.close(fd)
                who = f"pid {holder.get('pid', '?')}"
                if holder.get("api"):
                    who += f", API {holder['api']}"
                raise AlreadyRunning(
                    f"another dsv4-agent ({who}) already runs on state dir {self.path.parent}; "
                    "this one exits without touching the stack"
                ) from None
        self.fd = fd
        self.info = {}
        self.update(info)

    def update(self, info: dict[str, Any]) -> None:
        """Rewrite who holds it (pid, API, phase); only the holder writes."""
        if self.fd is None:
            return
        self.info = {**self.info, **info, "pid": os.getpid(), "since": self.info.get("since", time.time())}
        data = json.dumps(self.info).encode()
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
            self.fd = None

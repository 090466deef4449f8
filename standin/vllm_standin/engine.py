"""Stand-in for vLLM's engine process (`VLLM::EngineCore`): `python -m vllm_standin.engine CONFIG`.

This module stays light on purpose: it takes the simulated device, forks the TP workers and only
then imports the asyncio engine (engine_core), so the forked workers share a small interpreter
instead of each carrying their own (the idle tree must stay small with eight workers).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys

from setproctitle import setproctitle

from vllm_standin.common import MAX_WORKERS, log
from vllm_standin.worker import run_worker

PROC = "EngineCore_DP0"


class DeviceBusyError(Exception):
    """Another engine tree still holds the simulated NPUs."""


def take_device_lock(path: str | None) -> int:
    """Hold the simulated NPUs: an exclusive flock that the forked workers inherit, so it is released
    only when the engine and every worker are gone (like NPU memory held by an orphaned tree)."""
    if not path:
        return -1
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DeviceBusyError(f"NPU out of memory: device busy, held by another process ({path})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def fork_workers(count: int) -> list[tuple[int, int, socket.socket]]:
    """Fork `count` workers, each with its own socketpair; returns (rank, pid, engine-side socket)."""
    pairs = [socket.socketpair() for _ in range(count)]
    workers: list[tuple[int, int, socket.socket]] = []
    for rank, (ours, theirs) in enumerate(pairs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for other_rank, (a, b) in enumerate(pairs):
                    a.close()
                    if other_rank != rank:
                        b.close()
                code = run_worker(rank, theirs.fileno())
            finally:
                os._exit(code)
        workers.append((rank, pid, ours))
    for _, theirs in pairs:
        theirs.close()
    return workers


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    setproctitle("VLLM::EngineCore")
    if len(args) != 1:
        log(PROC, "core.py:60", "usage: python -m vllm_standin.engine CONFIG_JSON", level="ERROR")
        return 2
    config = json.loads(args[0])
    try:
        take_device_lock(os.environ.get("VLLM_STANDIN_DEVICE_LOCK"))
    except DeviceBusyError as exc:
        log(PROC, "core.py:711", "EngineCore failed to start.", level="ERROR")
        log(PROC, "core.py:711", f"RuntimeError: {exc}", level="ERROR")
        return 1
    workers = fork_workers(max(1, min(MAX_WORKERS, int(config.get("workers", 1)))))

    import asyncio

    from vllm_standin.engine_core import Engine, EngineConfig

    return asyncio.run(Engine(EngineConfig.from_dict(config), workers).run())


if __name__ == "__main__":
    sys.exit(main())

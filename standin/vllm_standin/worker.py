"""Stand-in for a vLLM tensor-parallel worker (`VLLM::Worker_TPn`), forked from the engine.

The engine sends one byte per model step over a socket and waits for one byte back, so a stopped
or dead worker stalls or kills the engine the way a real worker does. End of file on that socket
means the engine is gone: real workers watch their engine and exit with it. Forking (vLLM's
default on Linux) keeps eight of these cheap: they share the engine's interpreter pages.
"""

from __future__ import annotations

import os
import signal

from setproctitle import setproctitle

from vllm_standin.common import log


def run_worker(rank: int, fd: int) -> int:
    """Body of a forked worker; returns its exit code."""
    name = f"Worker_TP{rank}"
    setproctitle(f"VLLM::{name}")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log(name, "gpu_worker.py:104", f"Worker rank {rank} ready; waiting for EngineCore steps")
    os.write(fd, b"r")
    while True:
        try:
            data = os.read(fd, 4096)
        except ConnectionResetError:
            data = b""
        if not data:
            return 0
        try:
            os.write(fd, b"k" * len(data))
        except OSError:
            return 0

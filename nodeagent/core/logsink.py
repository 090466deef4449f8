"""Where a child's stdout/stderr go: under systemd journald, through the log relay (`logrelay.py`, which keeps
the lines the agent itself reads — the last ones, the KV transfer failures — in files of the component's own),
else a rotated file under log_dir.

Never a pipe the agent owns: if the agent dies, a child writing into a dead pipe would get SIGPIPE.
Rotation is logrotate's copytruncate (children write with O_APPEND, so truncation is safe).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from loguru import logger


def use_journal() -> bool:
    try:
        from nodeagent.core import journal
    except ImportError:
        return False
    return journal.running_under_systemd() and journal.journald_available()


def log_path(log_dir: Path, component: str) -> Path:
    return log_dir / f"{component}.log"


KV_FAILURES = "kv_failures.log"
"""In the component's folder: the relay's copy of its KV transfer failure lines (journald has the rest)."""


def transfer_lines(log_dir: Path, component_dir: Path, component: str) -> Path:
    """Where the agent reads a component's new KV transfer failure lines (`kvlog`): its log file, or under
    journald the relay's copy of them (the agent never reads the journal)."""
    return component_dir / KV_FAILURES if use_journal() else log_path(log_dir, component)


START_PHASES = "start_phases.log"
"""In the component's folder: the relay's copy of this run's start lines (`vllm.start_phases.start_line`), made
afresh at each launch."""


def start_lines(log_dir: Path, component_dir: Path, component: str) -> tuple[Path, bool]:
    """Where the agent reads a vLLM run's start lines (`layers.start_phases`) and whether from the file's start:
    under journald the relay's copy, else the log file (from the launch's offset)."""
    if use_journal():
        return component_dir / START_PHASES, True
    return log_path(log_dir, component), False


def log_offset(log_dir: Path, component: str) -> int | None:
    """Where the next run's output starts in its log file (None under journald: no file of ours)."""
    if use_journal():
        return None
    try:
        return log_path(log_dir, component).stat().st_size
    except FileNotFoundError:
        return 0
    except OSError:
        return None


def open_output(component: str, log_dir: Path) -> tuple[int, str]:
    """An fd for the child's output and a description of where it goes. The caller closes the fd."""
    if use_journal():
        from nodeagent.core import journal

        with contextlib.suppress(OSError):
            return journal.open_stream(component), f"journald (SYSLOG_IDENTIFIER={component})"
        logger.warning(f"[{component}] journald stream unavailable; logging to a file instead")
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_path(log_dir, component)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
    return fd, str(path)


def append_text(component: str, log_dir: Path, text: str) -> None:
    """Forward a launcher's captured output (dscli) to the component's log destination."""
    fd, _ = open_output(component, log_dir)
    try:
        os.write(fd, text.encode(errors="replace"))
    finally:
        os.close(fd)


def rotate_if_large(path: Path, max_bytes: int, keep: int) -> bool:
    """copytruncate: <name>.log → <name>.log.1 (… .keep), then truncate the live file in place."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    with open(path, "r+b") as fh:
        fh.truncate(0)
    return True

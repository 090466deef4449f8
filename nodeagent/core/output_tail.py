"""The last lines a component printed, for a failure's reason in status and events.

Outside systemd its output goes to `log_dir/<name>.log`: read what was appended since the launch. Under systemd
the log relay keeps the last lines in a small file of its own (journald is not read on the crash path).
"""

from __future__ import annotations

import os
from pathlib import Path

TAIL_LINES = 12
MAX_READ = 64 * 1024


def last_lines(data: bytes, n: int = TAIL_LINES) -> tuple[str, ...]:
    lines = [line.rstrip("\r") for line in data.decode(errors="replace").splitlines()]
    return tuple(line for line in lines if line.strip())[-n:]


def read_tail(log_file: Path, since: int | None, tail_file: Path | None = None) -> tuple[str, ...]:
    """Lines appended to `log_file` after byte offset `since` (None: not a file of ours) or, failing that,
    the relay's tail file."""
    if since is not None:
        try:
            with open(log_file, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                start = since if since <= size else 0  # truncated by rotation meanwhile
                fh.seek(max(start, size - MAX_READ))
                return last_lines(fh.read())
        except OSError:
            pass
    if tail_file is not None:
        try:
            return last_lines(Path(tail_file).read_bytes())
        except OSError:
            pass
    return ()

"""Log and environment helpers shared by the stand-in's API server, engine and workers.

Kept free of heavy imports: every worker process loads it, and the idle tree must stay small.
"""

from __future__ import annotations

import io
import os
import sys
import time

VERSION = "0.27.0+standin"
MAX_WORKERS = 8


def _write(stream: io.TextIOBase, line: str) -> None:
    """One flushed line; a closed log pipe must not kill the process (Python logging swallows it too)."""
    try:
        stream.write(line)
        stream.flush()
    except (OSError, ValueError):
        pass


def log(proc: str, where: str, msg: str, level: str = "INFO", stream: io.TextIOBase | None = None) -> None:
    """A line shaped like vLLM's: `(APIServer pid=1) INFO 05-12 10:00:00 [file.py:12] message`."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    _write(stream or sys.stdout, f"({proc} pid={os.getpid()}) {level} {stamp} [{where}] {msg}\n")


def log_plain(proc: str, text: str, stream: io.TextIOBase | None = None) -> None:
    """A uvicorn-style line (`INFO:     ...`) with vLLM's process prefix."""
    _write(stream or sys.stderr, f"({proc} pid={os.getpid()}) {text}\n")


def env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        log("standin", "common.py:42", f"ignoring {name}={raw!r}: not a number", level="WARNING")
        return default


def env_int(name: str, default: int) -> int:
    value = env_float(name, float(default))
    return default if value is None else int(value)


def package_pythonpath() -> dict[str, str]:
    """Environment for `python -S` children: this package and setproctitle importable without `site`.

    Skipping `site` (and the editable-install finder it loads) keeps the engine, and the workers
    forked from it, about 1.5 MB smaller each.
    """
    import setproctitle

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds vllm_standin/
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(setproctitle.__file__)))
    env = dict(os.environ)
    paths = [root, site_dir, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env

"""`nodeagentctl logs COMPONENT`: its own log file, the journal (journalctl), or log_dir/COMPONENT.log; `-f`
follows through copytruncate and replacement."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from nodeagent.cli.agentconfig import Client, LightConfig, full_config, light_config
from nodeagent.cli.common import EXIT_UNKNOWN, EXIT_UNREACHABLE, CliError


def tail_lines(path: Path, n: int) -> tuple[list[bytes], int]:
    """The last n lines of a file and the offset where following should continue."""
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        if n <= 0:
            return [], end
        block, data, pos = 64 * 1024, b"", end
        while pos > 0 and data.count(b"\n") <= n:
            step = min(block, pos)
            pos -= step
            fh.seek(pos)
            data = fh.read(step) + data
        lines = data.splitlines(keepends=True)
        return lines[-n:], end


def follow(path: Path, offset: int, out: Any, interval: float = 0.25, until: float | None = None) -> None:
    """Print what is appended to `path`; after copytruncate (size below our offset) start again from the top,
    and reopen when the file is replaced. `until` (monotonic) bounds it, for tests."""
    fh = open(path, "rb")  # noqa: SIM115 - reopened on rotation
    try:
        fh.seek(offset)
        inode = os.fstat(fh.fileno()).st_ino
        while until is None or time.monotonic() < until:
            chunk = fh.read(64 * 1024)
            if chunk:
                out.write(chunk)
                out.flush()
                continue
            try:
                st = os.stat(path)
            except FileNotFoundError:
                time.sleep(interval)
                continue
            if st.st_ino != inode:
                fh.close()
                fh = open(path, "rb")  # noqa: SIM115
                inode = os.fstat(fh.fileno()).st_ino
            elif st.st_size < fh.tell():
                fh.seek(0)  # truncated in place (copytruncate)
            else:
                time.sleep(interval)
    finally:
        fh.close()


def _log_source(args: argparse.Namespace, light: LightConfig) -> tuple[str, Path]:
    """("own"|"journal"|"file", folder or file): the component's own log file if it writes one (the datasystem
    worker), else where the agent sends children's output; without the agent, guess from disk."""
    client = Client(light, timeout=2.0)
    try:
        status = client.get("/status")
    except CliError as exc:
        if exc.code != EXIT_UNREACHABLE:
            raise
        config = full_config(args)  # the agent is down: what its config runs
        names = list(config.active_components()) + (["container"] if config.container is not None else [])
        if args.component not in names:
            raise CliError(f"unknown component {args.component!r} (config has: {', '.join(names)})",
                           EXIT_UNKNOWN) from None  # fmt: skip
        path = light.log_dir / f"{args.component}.log"
        if path.exists() or not _which("journalctl"):
            return "file", light.log_dir
        return "journal", light.log_dir
    # the node's container is no component, but its lines (setup steps, lifecycle) are logged as `container`
    names = list(status["components"]) + (["container"] if status.get("container") else [])
    if args.component not in names:
        raise CliError(f"unknown component {args.component!r} (this node runs: {', '.join(names)})",
                       EXIT_UNKNOWN)  # fmt: skip
    own = [Path(p) for p in (status["components"].get(args.component) or {}).get("log_files") or []]
    if args.source in ("auto", "own") and own and own[0].exists():
        return "own", own[0]
    if args.source == "own":
        raise CliError(f"{args.component} writes no log file of its own here ({', '.join(map(str, own)) or 'none'})")
    agent = status.get("agent", {})
    return ("journal" if agent.get("journal") else "file"), Path(agent.get("log_dir") or light.log_dir)


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def cmd_logs(args: argparse.Namespace) -> int:
    light = light_config(args)
    explicit = args.source in ("journal", "file")
    source, log_dir = (args.source, light.log_dir) if explicit else _log_source(args, light)
    if source == "journal":
        argv = ["journalctl", "-u", args.unit, "-t", args.component, "-n", str(args.lines), "--no-pager"]
        if args.follow:
            argv.append("-f")
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            raise CliError(f"cannot run journalctl: {exc}") from None
    path = log_dir if source == "own" else log_dir / f"{args.component}.log"
    if source == "own":
        print(f"==> {path} <==  (its launcher's output: --source file|journal)", file=sys.stderr)
    try:
        lines, offset = tail_lines(path, args.lines)
    except FileNotFoundError:
        raise CliError(f"no log file {path} (has {args.component} run on this node yet?)") from None
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    out = sys.stdout.buffer
    out.writelines(lines)
    out.flush()
    if args.follow:
        follow(path, offset, out)
    return 0


"""Turn a LaunchSpec into a running, recorded process.

Plain components are our children. The datasystem worker is daemonised by `dscli start`: we run dscli with its
output captured to a file, learn the worker's PID from that output (as early as dscli prints it, so a cancelled
start can still stop the worker), verify the PID's cmdline, and watch the worker itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from nodeagent.core import logsink
from nodeagent.core.errors import LaunchError
from nodeagent.core.process import (
    ExitWatch,
    ProcessRecord,
    find_datasystem_worker,
    parse_dscli_pid,
    record_of,
    spawn,
    stop_tree,
)
from nodeagent.render.launch import LaunchSpec

# Variables systemd gives the agent that must not leak into children (they would notify as us).
_AGENT_ONLY = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


def base_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The agent's environment for children; our interpreter's bin dir goes first on PATH so the venv's
    console scripts (etcd, dscli, vllm-standin) resolve under systemd's minimal PATH too."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in _AGENT_ONLY}
    bindir = os.path.dirname(sys.executable)
    path = env.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if bindir not in path.split(":"):
        path = f"{bindir}:{path}"
    env["PATH"] = path
    return env


_RESET_OOM = 'echo 0 > /proc/self/oom_score_adj 2>/dev/null; exec "$0" "$@"'


def _own_oom_score_adj() -> int:
    try:
        return int(Path("/proc/self/oom_score_adj").read_text())
    except (OSError, ValueError):
        return 0


def systemd_is_init() -> bool:
    return Path("/run/systemd/system").is_dir()


def host_argv(argv: list[str], unit: str | None, oom_reset: bool, relay: tuple[str, str] | None = None,
              tail_file: Path | None = None, kv_file: Path | None = None,
              phase_file: Path | None = None) -> list[str]:  # fmt: skip
    """Wrap a command for the host: a transient scope of its own (systemd-run --scope execs the command, so the
    PID is the same and nothing forks before the move), and the OOM score the unit shields the agent with
    (OOMScoreAdjust=-900) reset to 0 before the real program starts, so vLLM is not shielded."""
    if relay is not None:
        files = [*(["--tail", str(tail_file)] if tail_file is not None else []),
                 *(["--kv", str(kv_file)] if kv_file is not None else []),
                 *(["--phases", str(phase_file)] if phase_file is not None else [])]  # fmt: skip
        argv = [sys.executable, "-m", "nodeagent.node.logrelay", relay[0], relay[1], *files, "--", *argv]
    if oom_reset:
        argv = ["/bin/sh", "-c", _RESET_OOM, *argv]
    if unit:
        argv = ["systemd-run", "--scope", "--quiet", "--collect", f"--unit={unit}",
                "--description=dsv4-agent component", "--", *argv]  # fmt: skip
    return argv


def agent_unit() -> str:
    """The unit the agent runs as (from its own cgroup), so relayed output is filed under it."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            for part in reversed(line.rpartition(":")[2].split("/")):
                if part.endswith(".service"):
                    return part
    except OSError:
        pass
    return "dsv4-agent.service"


def scope_unit(mode: str, cluster: str, component: str) -> str | None:
    """The transient scope name for a start, or None when scopes are off or unavailable."""
    if mode == "never" or (mode == "auto" and not (systemd_is_init() and shutil.which("systemd-run"))):
        return None
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{cluster}-{component}")
    return f"dsv4-{safe}-{time.time_ns() // 1_000_000}.scope"


@dataclass
class Launched:
    record: ProcessRecord
    popen: subprocess.Popen[bytes] | None
    output: str


def _prepare(spec: LaunchSpec, env: Mapping[str, str]) -> None:
    spec.cwd.mkdir(parents=True, exist_ok=True)
    if "TMPDIR" in env:
        Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    for path, text in spec.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


async def launch(spec: LaunchSpec, log_dir: Path, base_env: Mapping[str, str],
                 capture_dir: Path, timeout_s: float = 900.0, scope: str | None = None,
                 tail_file: Path | None = None, map_pid: Callable[[int], int | None] | None = None) -> Launched:
    """`map_pid` turns the PID a daemonising launcher prints into ours (dscli inside a container prints the
    worker's PID in the container's namespace)."""
    env = spec.environment(base_env)
    # Under journald the relay carries the output: in a scope journald would file a stream's lines under the
    # scope (the relay sends them as the agent's unit), and with or without one the relay keeps the lines the
    # agent reads itself (the last ones, the KV transfer failures) — the agent never reads the journal.
    relay = (spec.component, agent_unit()) if not spec.daemonizes and logsink.use_journal() else None
    if relay is not None:
        capture_dir.mkdir(parents=True, exist_ok=True)
        (capture_dir / logsink.START_PHASES).unlink(missing_ok=True)  # this run's start lines only
    argv = host_argv(list(spec.argv), scope, _own_oom_score_adj() != 0, relay, tail_file,
                     capture_dir / logsink.KV_FAILURES, capture_dir / logsink.START_PHASES)  # fmt: skip
    try:
        _prepare(spec, env)
    except OSError as exc:
        raise LaunchError(f"cannot prepare {spec.cwd}: {exc}") from None
    if spec.daemonizes:
        return await _launch_daemonizing(spec, argv, env, log_dir, capture_dir, timeout_s, map_pid)
    fd, where = logsink.open_output(spec.component, log_dir)
    try:
        popen = spawn(argv, env, str(spec.cwd), fd)
    finally:
        os.close(fd)
    return Launched(record_of(popen.pid), popen, where)


async def launch_watched(spec: LaunchSpec, log_dir: Path, base_env: Mapping[str, str], capture_dir: Path,
                         timeout_s: float, scope: str | None, tail_file: Path | None) -> tuple[Launched, ExitWatch]:
    """A host launch and the watch of its exit."""
    launched = await launch(spec, log_dir, base_env, capture_dir, timeout_s, scope, tail_file)
    return launched, ExitWatch(launched.record.pid, launched.popen)


def _ours(pid: int | None, map_pid: Callable[[int], int | None] | None) -> int | None:
    return pid if pid is None or map_pid is None else map_pid(pid)


def _worker_address(spec: LaunchSpec) -> str:
    argv = list(spec.argv)
    return argv[argv.index("--worker_address") + 1]


async def _launch_daemonizing(spec: LaunchSpec, argv: list[str], env: dict[str, str], log_dir: Path,
                              capture_dir: Path, timeout_s: float,
                              map_pid: Callable[[int], int | None] | None = None) -> Launched:  # fmt: skip
    capture_dir.mkdir(parents=True, exist_ok=True)
    capture = capture_dir / "dscli.out"
    fd = os.open(capture, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
    try:
        popen = spawn(argv, env, str(spec.cwd), fd)
    finally:
        os.close(fd)
    launcher = record_of(popen.pid)
    watch = ExitWatch(popen.pid, popen)
    worker_pid: int | None = None
    try:
        async with asyncio.timeout(timeout_s):
            while not watch.done.done():
                worker_pid = worker_pid or _ours(parse_dscli_pid(capture.read_text(errors="replace")), map_pid)
                await asyncio.wait({watch.done}, timeout=0.1)
        code = watch.done.result()
    except (asyncio.CancelledError, TimeoutError):
        await stop_tree(launcher, 2.0, f"{spec.component} launcher")
        if worker_pid is not None:
            with contextlib.suppress(LaunchError):
                await stop_tree(record_of(worker_pid), 15.0, spec.component)
        raise
    finally:
        watch.close()
    output = capture.read_text(errors="replace")
    logsink.append_text(spec.component, log_dir, output)
    if code != 0:
        tail = " | ".join(line.strip() for line in output.strip().splitlines()[-3:])
        raise LaunchError(f"{spec.argv[0]} start exited with {code}: {tail or 'no output'}")
    printed = parse_dscli_pid(output)
    if printed is None:
        raise LaunchError(f"{spec.argv[0]} start printed no worker PID")
    pid = _ours(printed, map_pid)
    if pid is None:
        raise LaunchError(f"{spec.argv[0]} start printed worker PID {printed}, which is not in the container")
    return Launched(find_datasystem_worker(pid, _worker_address(spec)), None, str(capture))

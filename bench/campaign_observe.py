"""The fault campaign's outside eyes and hands (bench/fault_campaign.py): what it sees without asking an agent —
/proc, etcd's keys, the proxy's and the ranks' HTTP answers, the traffic's answers — and the one fault that needs a
helper: an etcd that one agent cannot reach while the others can (`EtcdGate`).

Everything here records into a shared `Ledger` (times: seconds since the campaign's start, `Ledger.now()`)."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.client import HTTPException
from pathlib import Path
from typing import Any

import psutil

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 2.0,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:  # fmt: skip
    """(status, body); status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with OPENER.open(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError, HTTPException) as exc:  # a body cut short (IncompleteRead) too
        return 0, f"{type(exc).__name__}: {exc}".encode()


class Ledger:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.processes: list[dict[str, Any]] = []
        self.overlaps: list[dict[str, Any]] = []
        self.generations: list[dict[str, Any]] = []
        self.proxy: list[dict[str, Any]] = []
        self.capacity: list[dict[str, Any]] = []
        self.empties: list[dict[str, Any]] = []
        self.attributed: list[dict[str, Any]] = []
        self.notes: list[dict[str, Any]] = []

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def of_wall(self, wall: float) -> float:
        """A wall time an agent reported, in the ledger's seconds."""
        return round(wall - self.wall0, 3)

    def note(self, what: str) -> None:
        with self.lock:
            self.notes.append({"t": self.now(), "what": what})
        print(f"[{self.now():8.1f}] {what}", flush=True)


# ---- traffic ------------------------------------------------------------------------------------------------------
class Traffic:
    """Clients sending completions through the proxy one after another (each its own thread), every answer in the
    ledger: status, tokens or none, the decode group that served it (the stand-in's `system_fingerprint`)."""

    def __init__(self, ledger: Ledger, url: str, clients: int = 2, gap_s: float = 0.05,
                 idle: tuple[float, float] | None = (10.0, 1.0)) -> None:  # fmt: skip
        self.ledger, self.url, self.gap_s, self.idle = ledger, url, gap_s, idle
        """`idle` (every, for): all clients pause together for a moment — vllm-ascend's proxy drops an instance
        removed while busy only once no request at all is in flight, and ignores its re-adding until then; under
        traffic without a pause that took 92 s after a decode rank's kill (issue 33, seed 1). None: no pause."""
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(40)

    def _run(self, client: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            if self.idle is not None and (into := self.ledger.now() % self.idle[0]) < self.idle[1]:
                time.sleep(self.idle[1] - into)
            sent = self.ledger.now()
            try:
                status, body = http(self.url, {"model": "dsv4", "prompt": f"client {client} request {n}",
                                               "max_tokens": 4, "ignore_eos": True}, timeout=30)  # fmt: skip
            except Exception as exc:  # a client that dies would halve the traffic and lose its request
                status, body = 0, repr(exc).encode()
            text, group, error = "", None, ""
            if status == 200:
                try:
                    data = json.loads(body)
                    text, group = data["choices"][0]["text"], data.get("system_fingerprint")
                except (ValueError, KeyError, IndexError, TypeError):
                    error = body[:120].decode(errors="replace")
            else:
                error = body[:160].decode(errors="replace")
            row = {"sent": sent, "answered": self.ledger.now(), "status": status, "nonempty": bool(text.strip()),
                   "group": group, "error": error}  # fmt: skip
            with self.ledger.lock:
                self.ledger.requests.append(row)
                if status == 200 and not row["nonempty"]:
                    self.ledger.empties.append({"t": row["answered"], "group": group})
            time.sleep(self.gap_s)


# ---- /proc, etcd, the proxy, the ranks ------------------------------------------------------------------------------
def role_of(cmdline: list[str], name: str) -> str:
    text = " ".join(cmdline)
    if name.startswith("VLLM::") or text.startswith("VLLM::"):
        return "vllm-engine"
    if "vllm-standin" in text:
        return "vllm"
    if "datasystem_worker" in text:
        return "datasystem"
    if "dscli" in text:
        return "dscli"
    if "load_balance_proxy" in text:
        return "proxy"
    if "dsv4-agent" in text:
        return "agent"
    return name or "other"


class Observer:
    """Polls every `period_s`: the processes of the agents' sessions (starts, stops, two vLLM trees of one node at
    once), the groups' generations in etcd, the proxy's membership, every rank's /health (full capacity), and the
    PD watch's count of empty answers in the proxy node's status."""

    def __init__(self, ledger: Ledger, home: Path, agents: dict[str, Any], etcd_port: int, cluster: str,
                 ranks: dict[str, tuple[str, int]], proxy_port: int, api: tuple[int, Path],
                 period_s: float = 0.5) -> None:  # fmt: skip
        self.ledger, self.home, self.agents, self.etcd_port = ledger, home, agents, etcd_port
        self.cluster, self.ranks, self.proxy_port, self.period_s = cluster, ranks, proxy_port, period_s
        self.api = api
        """The proxy node's agent API (port, token file): its PD watch's counts."""
        self.port_node = {port: node for node, (_, port) in ranks.items()}
        self.sids: dict[int, str] = {}
        """session id → node: learnt from the agents' children (and each agent's own session)."""
        self.alive: dict[int, dict[str, Any]] = {}
        self.gens: dict[str, int] = {}
        self.members: tuple[int, int] | None = None
        self.streaks: dict[str, int] = {}
        self.full = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.watch_thread = threading.Thread(target=self._run_pd_watch, daemon=True)
        """The PD watch's counts on their own beat: a streak lasts one probe period before the restart it causes
        clears it, shorter than one round of the other polls on a loaded machine (/proc, etcd, every rank)."""
        self.overlap_seen: set[tuple[str, tuple[int, ...]]] = set()

    def start(self) -> None:
        self.thread.start()
        self.watch_thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.watch_thread.join(10)

    def _run(self) -> None:
        self._loop((self.poll_procs, self.poll_gens, self.poll_capacity))

    def _run_pd_watch(self) -> None:
        self._loop((self.poll_pd_watch,))

    def _loop(self, steps: tuple[Callable[[], None], ...]) -> None:
        while not self.stop.is_set():
            began = time.monotonic()
            for step in steps:
                try:
                    step()
                except Exception as exc:  # an observer that dies silently would make the run look clean
                    self.ledger.note(f"observer: {step.__name__} failed: {exc!r}")
            self.stop.wait(max(0.05, self.period_s - (time.monotonic() - began)))

    def node_of(self, proc: dict[str, Any]) -> str | None:
        node = self.sids.get(proc["sid"])
        if node:
            return node
        text = " ".join(proc["cmdline"])
        for name in self.agents:
            if f"{self.home / name}/" in text or text.endswith(str(self.home / name)):
                return name
        for port, name in self.port_node.items():
            if f"--port {port}" in text or f"--port={port}" in text:
                return name
        return None

    def learn_sids(self) -> None:
        for name, agent in list(self.agents.items()):
            if agent.proc is not None and agent.proc.poll() is None:
                self.sids[agent.proc.pid] = name
            with contextlib.suppress(OSError, ValueError, KeyError):
                data = json.loads((agent.state_dir / "children.json").read_text())["children"]
                for rec in data.values():
                    self.sids[int(rec["sid"])] = name

    def poll_procs(self) -> None:
        self.learn_sids()
        now, seen = self.ledger.now(), {}
        for p in psutil.process_iter(["pid", "ppid", "name", "cmdline", "status"]):
            info = p.info
            if info["pid"] == os.getpid():
                continue
            try:
                sid = os.getsid(info["pid"])
            except OSError:
                continue
            if info["status"] == psutil.STATUS_ZOMBIE:
                continue  # dead, holding nothing: its parent (PID 1 for an orphan) has not reaped it yet
            cmdline = info["cmdline"] or []
            ours = sid in self.sids or info["ppid"] in self.alive or str(self.home) in " ".join(cmdline)
            if not ours:
                continue
            proc = {"pid": info["pid"], "sid": sid, "cmdline": cmdline, "status": info["status"],
                    "role": role_of(cmdline, info["name"] or "")}  # fmt: skip
            proc["node"] = self.node_of(proc)
            if proc["node"] and sid not in self.sids and proc["role"] in ("vllm", "datasystem", "proxy"):
                self.sids[sid] = proc["node"]
            seen[info["pid"]] = proc
        events = []
        for pid, proc in seen.items():
            if pid not in self.alive:
                events.append({"t": now, "event": "start", "pid": pid, "sid": proc["sid"], "node": proc["node"],
                               "role": proc["role"]})  # fmt: skip
        for pid, proc in self.alive.items():
            if pid not in seen:
                events.append({"t": now, "event": "stop", "pid": pid, "sid": proc["sid"], "node": proc["node"],
                               "role": proc["role"]})  # fmt: skip
        self.alive = seen
        trees: dict[str, set[int]] = {}
        for proc in seen.values():
            if proc["role"] in ("vllm", "vllm-engine") and proc["node"]:
                trees.setdefault(proc["node"], set()).add(proc["sid"])
        with self.ledger.lock:
            self.ledger.processes.extend(events)
            for node, sids in trees.items():
                key = (node, tuple(sorted(sids)))
                if len(sids) > 1 and key not in self.overlap_seen:
                    self.overlap_seen.add(key)
                    self.ledger.overlaps.append({"t": now, "node": node, "sids": list(key[1])})

    def stopped(self) -> list[dict[str, Any]]:
        return [{"pid": p["pid"], "node": p["node"], "role": p["role"]} for p in self.alive.values()
                if p["status"] == psutil.STATUS_STOPPED]  # fmt: skip

    def poll_gens(self) -> None:
        prefix = f"/dsv4-agent/{self.cluster}/gangs/".encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        status, body = http(f"http://127.0.0.1:{self.etcd_port}/v3/kv/range",
                            {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()},
                            timeout=1.0)  # fmt: skip
        if status != 200:
            return
        for kv in json.loads(body).get("kvs", []):
            group = base64.b64decode(kv["key"]).decode().rsplit("/", 1)[-1]
            record = json.loads(base64.b64decode(kv["value"]))
            gen = int(record.get("generation", 0))
            if self.gens.get(group) != gen:
                self.gens[group] = gen
                with self.ledger.lock:
                    # the group's restart backoff the agents stated with it (`not_before`, the crash-loop policy)
                    backoff = max(0.0, float(record.get("not_before") or 0) - float(record.get("at") or 0))
                    self.ledger.generations.append({"t": self.ledger.now(), "group": group, "generation": gen,
                                                    "reason": record.get("reason", ""), "by": record.get("by", ""),
                                                    "backoff_s": round(backoff, 2)})  # fmt: skip

    def poll_capacity(self) -> None:
        status, body = http(f"http://127.0.0.1:{self.proxy_port}/healthcheck", timeout=1.0)
        members: tuple[int, int] = (-1, -1)
        if status == 200:
            with contextlib.suppress(ValueError, KeyError):
                data = json.loads(body)
                members = (int(data["prefill_instances"]), int(data["decode_instances"]))
        now = self.ledger.now()
        if members != self.members:
            self.members = members
            with self.ledger.lock:
                self.ledger.proxy.append({"t": now, "prefill": members[0], "decode": members[1]})
        kinds = [kind for kind, _ in self.ranks.values()]
        healthy = all(http(f"http://127.0.0.1:{port}/health", timeout=1.0)[0] == 200
                      for _, port in self.ranks.values())  # fmt: skip
        full = healthy and members == (kinds.count("prefill"), kinds.count("decode"))
        if full != self.full:
            self.full = full
            with self.ledger.lock:
                self.ledger.capacity.append({"t": now, "full": full})

    def full_since(self) -> float | None:
        """When the cluster last became fully capable (None: it is not now)."""
        if not self.full:
            return None
        with self.ledger.lock:
            return next((c["t"] for c in reversed(self.ledger.capacity) if c["full"]), 0.0)

    def poll_pd_watch(self) -> None:
        """From the agent's API, not its status.json: that file is rewritten on state changes only, and a streak
        can rise and be cleared by the restart it causes between two writes."""
        port, token_file = self.api
        try:
            token = token_file.read_text().strip()
        except OSError:
            return
        status, body = http(f"http://127.0.0.1:{port}/status", timeout=1.0,
                            headers={"Authorization": f"Bearer {token}"})
        if status != 200:
            return
        try:
            watch = json.loads(body).get("pd_watch") or {}
        except ValueError:
            return
        since = watch.get("empty_since") or {}
        for group, streaks in (watch.get("empty_streaks") or {}).items():
            count = max((int(v) for v in (streaks or {}).values()), default=0)
            if count > 0 and self.streaks.get(group, 0) == 0:
                # when the agent's probe asked the instance that answered empty, not when this poll got to see it:
                # the poll and the API's own answer are the observer's latency, slow on a loaded machine
                asked = min((float(v) for v in (since.get(group) or {}).values()), default=None)
                t = self.ledger.now() if asked is None else min(self.ledger.now(), self.ledger.of_wall(asked))
                with self.ledger.lock:
                    self.ledger.attributed.append({"t": t, "group": group, "polled": self.ledger.now()})
            self.streaks[group] = count


# ---- an etcd one agent cannot reach ------------------------------------------------------------------------------
class EtcdGate:
    """A loopback TCP proxy in front of etcd that every member's file names, which knows whose connection each is
    (the connecting socket's process, from /proc, and the node folder in its or its parents' command line) and can
    cut one node off (its connections dropped, new ones refused) while the others carry on: a partition of that
    node from etcd without a network namespace per agent (the agents, their workers and the ranks all share
    loopback here, which a namespace would split as well)."""

    def __init__(self, target_port: int, port: int, home: Path, nodes: list[str]) -> None:
        self.target_port, self.port, self.home, self.nodes = target_port, port, home, nodes
        self.cut_nodes: set[str] = set()
        self.conns: dict[str, set[asyncio.StreamWriter]] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.owners: dict[str, int] = {}
        self.pid_nodes: dict[int, str | None] = {}
        self.lookups = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gate-owner")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True), self.loop).result(10)

    def owner(self, peer_port: int) -> str:
        """The node whose process holds the connecting socket ('?' when none is found): the socket's inode from
        /proc/net/tcp, then the process holding it among those whose command line (or a parent's) names a node's
        folder — cheap enough to run per connection on a loaded machine (psutil.net_connections is not)."""
        inode = None
        with contextlib.suppress(OSError):
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
                parts = line.split()
                if (int(parts[1].rsplit(":", 1)[1], 16) == peer_port
                        and int(parts[2].rsplit(":", 1)[1], 16) == self.port):  # fmt: skip
                    inode = parts[9]
                    break
        if inode is None:
            return "?"
        target = f"socket:[{inode}]"
        found = self.holder(target)
        if found is None:  # a pid reused since it was cached: look again from scratch
            self.pid_nodes.clear()
            found = self.holder(target)
        return found or "?"

    def holder(self, target: str) -> str | None:
        for pid in psutil.pids():
            node = self.node_of_pid(pid)
            if node is None:
                continue
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                            return node
        return None

    def node_of_pid(self, pid: int, depth: int = 0) -> str | None:
        """The node folder named in that process's command line or its parent's (cached per pid)."""
        if pid in self.pid_nodes:
            return self.pid_nodes[pid]
        node = None
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            node = next((n for n in self.nodes if f"{self.home / n}/" in text), None)
            if node is None and depth < 3:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                node = self.node_of_pid(ppid, depth + 1) if ppid > 1 else None
        self.pid_nodes[pid] = node
        return node

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward at once (a slow lookup must not time out a client's connect); drop the connection as soon as
        its owner is known to be cut off."""
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        pipes = asyncio.gather(self._pipe(reader, up_writer, pair), self._pipe(up_reader, writer, pair))
        peer = writer.get_extra_info("peername") or ("", 0)
        node = await self.loop.run_in_executor(self.lookups, self.owner, peer[1])
        self.owners[node] = self.owners.get(node, 0) + 1
        mine = self.conns.setdefault(node, set())
        mine.update(pair)
        if node in self.cut_nodes:
            for w in pair:
                w.transport.abort()
        await pipes
        mine.difference_update(pair)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, pair: set[Any]) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.transport.abort()

    def cut(self, node: str) -> None:
        def do() -> None:
            self.cut_nodes.add(node)
            for w in list(self.conns.get(node, ())):
                w.transport.abort()

        self.loop.call_soon_threadsafe(do)

    def restore(self, node: str) -> None:
        self.loop.call_soon_threadsafe(self.cut_nodes.discard, node)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.lookups.shutdown(wait=False, cancel_futures=True)

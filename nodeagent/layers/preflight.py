"""Preflight: every environment requirement of the deployment guide as a check — PASS, WARN, FAIL or SKIP,
with what was measured and a one-line fix.

Sources: the guide's 环境要求 (CANN >= 8.5.0, HDK >= 25.2.3, >= 25.5.0 with RH2D, 8 NPUs of 64 GB), its 常见问题
(PYTHONHASHSEED equal on every node, 64 KB pages need their own openYuanrong build, node clocks, `import
yr.datasystem`) and 附录 (huge pages for enable_huge_tlb, needed above 21 GB of shared memory; RH2D needs them).
A check that does not apply to the config is SKIP, never FAIL: `config/local.yaml` (the stand-in, no NPUs)
passes on any Linux box. Everything is read through `hostfacts.Host`, so tests use fixture trees.

`run_preflight` blocks (subprocesses, file reads); from the event loop call it with `asyncio.to_thread`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from nodeagent.config.container import NO_CONTAINER
from nodeagent.config.model import Config, DatasystemComponent, EtcdComponent, VllmComponent
from nodeagent.layers.port_check import lint_node
from nodeagent.layers.portlint import TAKEN
from nodeagent.node.hostfacts import Host, version_at_least
from nodeagent.npu.monitor import expected_npus
from nodeagent.npu.tools import HEALTH_OK, NET_HEALTH_OK, NET_HEALTH_UNCONFIGURED, NpuSnapshot

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
CANN_MIN = "8.5.0"
HDK_MIN = "25.2.3"
HDK_MIN_RH2D = "25.5.0"
HUGE_TLB_ABOVE_MB = 21 * 1024
"""附录: enable_huge_tlb 'is needed when shared memory is larger than 21G'."""
PAGE_64K = 65536
CLOCK_SKEW_WARN_S = 1.0
CLOCK_SKEW_FAIL_S = 10.0
"""One membership lease TTL (DESIGN §6): beyond it, peers' timestamps say nothing."""
MIN_FREE_BYTES = 1 << 30


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    value: str
    """What was measured (for SKIP: why it does not apply)."""
    hint: str = ""
    """One line: how to fix it (WARN/FAIL)."""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class PreflightReport:
    checks: list[Check] = field(default_factory=list)
    about: str = ""
    """The member the checks are about (`node a2-5 (worker): vllm-dp8..vllm-dp15`): one host checks them all."""

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    @property
    def ok(self) -> bool:
        return not self.failed

    def counts(self) -> dict[str, int]:
        return {status: sum(c.status == status for c in self.checks) for status in (PASS, WARN, FAIL, SKIP)}

    def summary(self) -> str:
        return "preflight: " + ", ".join(f"{n} {s}" for s, n in self.counts().items())

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "counts": self.counts(), "about": self.about,
                "checks": [c.to_dict() for c in self.checks]}

    def format(self) -> str:
        width = max((len(c.name) for c in self.checks), default=4)
        lines = [f"preflight of {self.about}"] if self.about else []
        for c in self.checks:
            lines.append(f"{c.status}  {c.name:<{width}}  {c.value}")
            if c.hint and c.status in (WARN, FAIL):
                lines.append(f"      {'':<{width}}  fix: {c.hint}")
        lines.append(self.summary())
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ context


@dataclass
class _Ctx:
    config: Config
    host: Host
    peers: Sequence[Mapping[str, Any]] | None
    expected: int
    _snapshot: NpuSnapshot | None = None
    _snapped: bool = False
    _ours: set[int] | None = None

    host_only: bool = False
    """`components` leaves out those that run inside the node's container."""

    def components(self, kind: type[Any]) -> dict[str, Any]:
        return {n: c for n, c in self.config.active_components().items() if isinstance(c, kind)
                and not (self.host_only and self.config.container is not None and c.container)}

    @property
    def snapshot(self) -> NpuSnapshot | None:
        if not self._snapped:
            self._snapshot, self._snapped = self.host.npu_snapshot(), True
        return self._snapshot

    @property
    def ours(self) -> set[int]:
        if self._ours is None:
            self._ours = self.host.our_pids(self.config.agent.state_dir) | {os.getpid()}
        return self._ours

    def no_npus(self) -> str | None:
        if self.expected:
            return None
        if self.config.node.npus == 0:
            return "no NPUs expected (node.npus: 0)"
        return "no NPUs expected: no vLLM on this node"


def _rh2d(ctx: _Ctx) -> bool:
    return any(c.remote_h2d_device_ids for c in ctx.components(DatasystemComponent).values()) or any(
        c.remote_h2d for c in ctx.components(VllmComponent).values())  # fmt: skip


def _mb(kb: int) -> str:
    return f"{kb / 1024:,.0f} MB"


# --------------------------------------------------------------------------------------------- NPU checks

NPU_HINT = "install the Ascend driver (HDK) and mount /usr/local/bin/npu-smi and /dev/davinci* into the container"


def check_npus(ctx: _Ctx) -> Iterable[Check]:
    skip = ctx.no_npus()
    if skip:
        yield Check("npus", SKIP, f"{skip}; {ctx.host.npu_tools().missing or 'npu-smi is installed'}")
        return
    snap = ctx.snapshot
    if snap is None:
        yield Check("npus", FAIL, f"npu-smi not found; this config expects {ctx.expected} NPUs", NPU_HINT)
        return
    if snap.info is None:
        yield Check("npus", FAIL, f"npu-smi info failed: {snap.error}", "check the driver: `npu-smi info` by hand")
        return
    info = snap.info
    seen = info.npu_ids
    names = ", ".join(sorted({c.name for c in info.chips}))
    hbm = sorted({c.hbm_total_mb for c in info.chips if c.hbm_total_mb})
    value = f"{len(seen)} of {ctx.expected} NPUs ({names}; HBM {'/'.join(f'{m // 1024} GB' for m in hbm)})"
    if len(seen) < ctx.expected:
        gaps = [n for n in range(ctx.expected) if n not in seen]
        yield Check("npus", FAIL, value + (f"; npu {', '.join(map(str, gaps))} missing" if gaps else ""),
                    "a card dropped off: check `lspci | grep acce`, dmesg, reseat or replace it")  # fmt: skip
    else:
        yield Check("npus", PASS, value)
    sick = [c for c in info.chips if c.health != HEALTH_OK]
    detail = "; ".join(f"npu {c.npu} {c.health}" for c in sick)
    if any(c.health in ("Alarm", "Critical") for c in sick):
        yield Check("npu_health", FAIL, detail, "`npu-smi info -t health -i N -c 0` shows the error codes; reset the"
                    " chip (`npu-smi set -t reset -i N -c 0`) or replace it")  # fmt: skip
    elif sick:
        yield Check("npu_health", WARN, detail, "`npu-smi info -t health -i N -c 0` shows the error codes")
    else:
        yield Check("npu_health", PASS, f"all {len(info.chips)} chips OK")
    foreign = [p for p in info.processes if p.pid not in ctx.ours]
    listed = ", ".join(f"npu {p.npu} pid {p.pid} {p.name} {p.memory_mb} MB" for p in foreign)
    if any(p.visible is not False for p in foreign):
        yield Check("npu_processes", FAIL, f"not ours: {listed}",
                    "stop them (another vLLM? `ps -fp PID`) before starting the stack")  # fmt: skip
    elif foreign:
        yield Check("npu_processes", WARN, f"PIDs not visible here: {listed}",
                    "npu-smi lists host PIDs: check them on the host (`ps -fp PID`)")  # fmt: skip
    else:
        yield Check("npu_processes", PASS, "no process on the NPUs" if not info.processes else "only ours")
    if not snap.roce_checked:
        yield Check("roce", SKIP, "hccn_tool not found")
        return
    down = [n for n, s in snap.links.items() if s != "UP"]
    bad_net = {n: s for n, s in snap.net_health.items() if s not in NET_HEALTH_OK + NET_HEALTH_UNCONFIGURED}
    if down or bad_net:
        parts = [f"link DOWN on npu {', '.join(map(str, down))}"] if down else []
        parts += [f"npu {n} net health {s}" for n, s in bad_net.items()]
        yield Check("roce", WARN, "; ".join(parts), "check cables/switch ports and `hccn_tool -i N -link -g`; "
                    "multi-node KV transfer and RH2D need the RoCE links")  # fmt: skip
    else:
        yield Check("roce", PASS, f"{len(snap.links)} links UP")


def check_versions(ctx: _Ctx) -> Iterable[Check]:
    versions = ctx.host.ascend_versions()
    skip = ctx.no_npus()
    if skip:
        yield Check("cann", SKIP, f"{skip}; " + (f"CANN {versions.cann}" if versions.cann else "no CANN installed"))
        yield Check("hdk", SKIP, f"{skip}; " + (f"driver {versions.driver}" if versions.driver else "no NPU driver"))
        return
    if versions.cann is None:
        hint = f"use the guide's vllm-ascend image, or install CANN >= {CANN_MIN} and source set_env.sh"
        yield Check("cann", FAIL, "CANN toolkit not found (no ascend_toolkit_install.info)", hint)
    else:
        good = version_at_least(versions.cann, CANN_MIN)
        status = PASS if good else (WARN if good is None else FAIL)
        yield Check("cann", status, f"{versions.cann} ({versions.cann_file})",
                    f"CANN >= {CANN_MIN} is required: use the image the guide names" if status != PASS else "")
    rh2d = _rh2d(ctx)
    need = HDK_MIN_RH2D if rh2d else HDK_MIN
    why = " (RH2D is on: remote_h2d_device_ids)" if rh2d else ""
    if versions.driver is None:
        yield Check("hdk", FAIL, "driver version.info not found", NPU_HINT)
        return
    good = version_at_least(versions.driver, need)
    status = PASS if good else (WARN if good is None else FAIL)
    value = f"{versions.driver} ({versions.driver_file}; need >= {need}{why})"
    hint = f"upgrade the NPU driver and firmware (HDK) to >= {need}" + (" or turn RH2D off" if rh2d else "")
    yield Check("hdk", status, value, hint if status != PASS else "")


# ------------------------------------------------------------------------------------------ memory checks


def check_memory(ctx: _Ctx) -> Iterable[Check]:
    workers = ctx.components(DatasystemComponent)
    if not workers:
        for name in ("page_size", "huge_pages", "memory", "dev_shm"):
            yield Check(name, SKIP, "no datasystem worker on this node")
        return
    page = ctx.host.page_size()
    if page is None:
        yield Check("page_size", WARN, "`getconf PAGE_SIZE` failed", "run `getconf PAGE_SIZE` by hand")
    elif page == PAGE_64K:
        yield Check("page_size", WARN, f"{page} (64 KB pages)", "install the openYuanrong datasystem package "
                    "built for 64 KB pages: the default one assumes 4 KB")  # fmt: skip
    else:
        yield Check("page_size", PASS, str(page))
    mem = ctx.host.meminfo()
    need_mb = max(c.shared_memory_size_mb for c in workers.values())
    huge = any(c.enable_huge_tlb for c in workers.values())
    total_pages, free_pages, page_kb = mem.get("HugePages_Total", 0), mem.get("HugePages_Free", 0), mem.get(
        "Hugepagesize", 0)  # fmt: skip
    if _rh2d(ctx) and not huge:
        hint = "set enable_huge_tlb: true on the datasystem component and configure huge pages (附录)"
        yield Check("huge_pages", FAIL, "RH2D is on but enable_huge_tlb is not", hint)
    elif huge:
        have_mb, free_mb = total_pages * page_kb // 1024, free_pages * page_kb // 1024
        value = f"{total_pages} x {page_kb} kB = {have_mb:,} MB ({free_mb:,} MB free) for {need_mb:,} MB"
        hint = (f"echo {need_mb * 1024 // max(page_kb, 1)} > /proc/sys/vm/nr_hugepages "
                "(check MemAvailable first, grep -i huge /proc/meminfo after)")  # fmt: skip
        if have_mb == 0:
            yield Check("huge_pages", FAIL, value, hint)
        elif have_mb < need_mb:  # the guide's own example: 250000 x 2 MB for 512000 MB
            yield Check("huge_pages", WARN, value + ": the worker fails once it grows past them", hint)
        elif free_mb < need_mb:
            yield Check("huge_pages", WARN, value, "huge pages are in use: by a running worker? stop it first")
        else:
            yield Check("huge_pages", PASS, value)
    elif need_mb > HUGE_TLB_ABOVE_MB:
        yield Check("huge_pages", WARN, f"shared_memory_size_mb {need_mb:,} > 21 GB without enable_huge_tlb",
                    "the guide asks for huge pages above 21 GB: enable_huge_tlb: true and nr_hugepages (附录)")
    else:
        yield Check("huge_pages", SKIP, "enable_huge_tlb is not set")
    if huge:
        yield Check("memory", SKIP, "the worker's shared memory comes from huge pages")
        yield Check("dev_shm", SKIP, "the worker's shared memory comes from huge pages")
        return
    available = mem.get("MemAvailable")
    if available is None:
        yield Check("memory", WARN, "no MemAvailable in /proc/meminfo", "")
    else:
        value = f"MemAvailable {_mb(available)} for shared_memory_size_mb {need_mb:,}"
        if available // 1024 >= need_mb:
            yield Check("memory", PASS, value)
        elif any(pid in ctx.ours for c in workers.values() for pid in ctx.host.port_listeners(c.worker_port)):
            yield Check("memory", WARN, value + " (our worker runs and holds its share)", "")
        else:
            yield Check("memory", FAIL, value, "lower shared_memory_size_mb (the guide's SHM_SIZE) to fit this "
                        "machine's DRAM, or free memory")  # fmt: skip
    space = ctx.host.fs_space(Path("/dev/shm"))
    if space is None:
        yield Check("dev_shm", WARN, "/dev/shm not found", "mount a tmpfs on /dev/shm (docker --shm-size)")
    elif space[1] < need_mb * 2**20:
        yield Check("dev_shm", WARN, f"/dev/shm {space[1] // 2**20:,} MB < {need_mb:,} MB",
                    "give the container a larger /dev/shm (the guide: docker run --shm-size=800g)")  # fmt: skip
    else:
        yield Check("dev_shm", PASS, f"/dev/shm {space[1] // 2**20:,} MB ({space[0] // 2**20:,} MB free)")


# ------------------------------------------------------------------------------- model, programs, imports


def check_models(ctx: _Ctx) -> Iterable[Check]:
    from nodeagent.vllm.weights import check_weights

    vllms = ctx.components(VllmComponent)
    if not vllms:
        yield Check("model", SKIP, "no vLLM on this node")
    ranks: dict[str, list[str]] = {}
    for name, comp in vllms.items():  # the ranks of a group load one model: checked once, its ranks named
        ranks.setdefault(comp.model, []).append(name)
    for model, names in ranks.items():
        label = "model" if len(ranks) == 1 else f"model:{names[0]}"
        who = "" if len(names) == 1 else f" (read by {names[0]} .. {names[-1]})"
        if ctx.config.node.npus == 0:
            yield Check(label, SKIP, "node.npus: 0 (no NPUs): no vLLM here loads weights")
            continue
        if not model.startswith(("/", ".", "~")) and not ctx.host.file(model).exists():
            yield Check(label, SKIP, f"{model!r} is a model id, not a folder (vLLM downloads it)")
            continue
        report = check_weights(ctx.host.file(os.path.expanduser(model)))
        if report.ok:
            yield Check(label, PASS, f"{model}: {report.shards} shards, {report.total_bytes / 1e9:.1f} GB, "
                                     f"complete{who}")
        else:
            yield Check(label, FAIL, f"{model}{who}: " + "; ".join(report.problems[:4]),
                        "download the missing or truncated files again (ModelScope), then re-run preflight")


def _program_check(ctx: _Ctx, label: str, program: str, hint: str, status: str = FAIL) -> Check:
    found = ctx.host.which(program)
    return Check(label, PASS, found) if found else Check(label, status, f"{program} not found on PATH", hint)


def check_programs(ctx: _Ctx) -> Iterable[Check]:
    """The programs of the components on the host; those inside the container are the image's."""
    everywhere, ctx = ctx, replace(ctx, host_only=True)
    inside = " here: it runs inside the container (the image's; the container checks)"
    etcds = ctx.components(EtcdComponent)
    if etcds:
        for comp in etcds.values():
            yield _program_check(ctx, "etcd", comp.command[0], "install etcd v3.5 (the guide's step 4)")
        yield _program_check(ctx, "etcdctl", "etcdctl", "install etcdctl with etcd: the guide's checks use it", WARN)
    elif not everywhere.components(EtcdComponent):
        yield Check("etcd", SKIP, "this node runs no etcd" + (" (not the master)" if ctx.config.node.role != "master"
                                                              else ""))  # fmt: skip
    else:
        yield Check("etcd", SKIP, "no etcd" + inside)
    workers = ctx.components(DatasystemComponent)
    for comp in workers.values():
        yield _program_check(ctx, "dscli", comp.command[0], "pip install openyuanrong-datasystem (the guide's step 3)")
    if not workers:
        yield Check("dscli", SKIP, "no datasystem worker" + (inside if everywhere.components(DatasystemComponent)
                                                             else " on this node"))  # fmt: skip
    vllms = ctx.components(VllmComponent)
    if not vllms:
        yield Check("vllm", SKIP, "no vLLM" + (inside if everywhere.components(VllmComponent) else " on this node"))
    for name, comp in vllms.items():
        # one row per rank, named: eight identical "vllm not found" rows say nothing about which
        label, yr_label = ("vllm", "yr_import") if len(vllms) == 1 else (f"vllm:{name}", f"yr_import:{name}")
        yield _program_check(ctx, label, comp.command[0], "run inside the vllm-ascend image, or install vllm-ascend")
        backend = ((comp.kv_transfer_config or {}).get("kv_connector_extra_config") or {}).get("backend")
        if backend != "yuanrong":
            yield Check(yr_label, SKIP, "vLLM's KV connector does not use the yuanrong backend")
            continue
        python = ctx.host.interpreter_of(comp.command[0])
        if ctx.host.which(comp.command[0]) is None:
            yield Check(yr_label, SKIP, f"{comp.command[0]} not found: no Python to ask")
            continue
        if python is None:
            yield Check(yr_label, WARN, f"cannot tell which Python runs {comp.command[0]}",
                        "check by hand: <vllm's python> -c 'import yr.datasystem'")  # fmt: skip
            continue
        ok, error = ctx.host.can_import(python, "yr.datasystem")
        if ok:
            yield Check(yr_label, PASS, f"import yr.datasystem in {python}")
        else:
            yield Check(yr_label, FAIL, f"{python}: {error or 'import yr.datasystem failed'}",
                        f"{python} -m pip install openyuanrong-datasystem (the wheel for this arch and page size)")


# ---------------------------------------------------------------------------------------------- network


def _ports(config: Config) -> list[tuple[str, int]]:
    ports = []
    for name, comp in config.active_components().items():
        if isinstance(comp, EtcdComponent):
            ports += [(name, comp.client_port), (name, comp.peer_port)]
        elif isinstance(comp, DatasystemComponent):
            ports.append((name, comp.worker_port))
        elif isinstance(comp, VllmComponent):
            ports.append((name, comp.port))
        else:
            ports += [(name, p) for p in getattr(comp, "ports", ())]
    return ports


def check_network(ctx: _Ctx) -> Iterable[Check]:
    node = ctx.config.node
    nics = ctx.host.nic_addresses()
    holders = [nic for nic, addrs in nics.items() if node.ip in addrs]
    if holders:
        yield Check("node_ip", PASS, f"{node.ip} on {', '.join(holders)}")
    else:
        yield Check("node_ip", FAIL, f"{node.ip} is not an address of this host",
                    "set node.ip to this host's address (`hostname -I`)")  # fmt: skip
    if node.nic_name is None:
        yield Check("nic", SKIP, "node.nic_name is not set")
    elif node.nic_name not in nics:
        yield Check("nic", FAIL, f"{node.nic_name} does not exist (have: {', '.join(sorted(nics))})",
                    "set node.nic_name to the NIC `ifconfig` shows carrying node.ip")  # fmt: skip
    elif node.ip not in nics[node.nic_name]:
        yield Check("nic", FAIL, f"{node.nic_name} does not carry {node.ip} ({', '.join(nics[node.nic_name])})",
                    "HCCL_IF_IP and HCCL_SOCKET_IFNAME must agree: fix node.ip or node.nic_name")  # fmt: skip
    else:
        yield Check("nic", PASS, f"{node.nic_name} carries {node.ip}")
    busy, ours = [], []
    for name, port in _ports(ctx.config):
        if not ctx.host.port_in_use(port):
            continue
        pids = ctx.host.port_listeners(port)
        if pids and pids <= ctx.ours:
            ours.append(f"{port} ({name}, ours)")
        else:
            from nodeagent.node.residue import describe_pid

            who = ", ".join(describe_pid(p) for p in sorted(pids)) or "a process we cannot see (another user's?)"
            busy.append(f"{port} ({name}) held by {who}")
    listed = ", ".join(str(p) for _, p in _ports(ctx.config))
    if busy:
        yield Check("ports", FAIL, "; ".join(busy), "stop what holds them (leftovers of an earlier run?) or change the "
                    "ports in the config")  # fmt: skip
    else:
        ours_note = f" or held by our own components ({', '.join(ours)})" if ours else ""
        yield Check("ports", PASS, f"{listed} free{ours_note}")


def check_peers(ctx: _Ctx) -> Iterable[Check]:
    from nodeagent.node.launcher import base_environment
    from nodeagent.render.launch import render_component

    vllms = ctx.components(VllmComponent)
    seeds = {}
    for name in vllms:
        spec = render_component(name, ctx.config, base_environment())
        seeds[name] = None if "PYTHONHASHSEED" in spec.unset else spec.env.get("PYTHONHASHSEED")
    if not vllms:
        yield Check("pythonhashseed", SKIP, "no vLLM on this node")
    elif any(v != "0" for v in seeds.values()):
        yield Check("pythonhashseed", FAIL, ", ".join(f"{n}: {v!r}" for n, v in seeds.items()),
                    "remove the PYTHONHASHSEED override from the config: it must be 0 on every node")  # fmt: skip
    else:
        differ = [f"{p.get('name', '?')}: {p.get('pythonhashseed')!r}" for p in ctx.peers or ()
                  if p.get("pythonhashseed") is not None and str(p.get("pythonhashseed")) != "0"]  # fmt: skip
        if differ:
            yield Check("pythonhashseed", FAIL, "0 here; " + ", ".join(differ),
                        "every node must render PYTHONHASHSEED=0 or KV pool keys never match (FAQ)")  # fmt: skip
        else:
            yield Check("pythonhashseed", PASS, "0" + (f", equal on {len(ctx.peers)} peers" if ctx.peers else
                                                       " (no peers to compare)"))  # fmt: skip
    if not ctx.peers:
        yield Check("clock_skew", SKIP, "no peers given")
        return
    now = ctx.host.now()
    skews = {str(p.get("name", "?")): float(p["wall_clock"]) - float(p.get("observed_at", now))
             for p in ctx.peers if isinstance(p.get("wall_clock"), int | float)}  # fmt: skip
    if not skews:
        yield Check("clock_skew", SKIP, "peers carry no wall_clock")
        return
    worst = max(skews, key=lambda n: abs(skews[n]))
    value = f"max {skews[worst]:+.2f}s ({worst}) over {len(skews)} peers"
    hint = "sync clocks (chrony/ntp; `timedatectl`): logs and timestamps across nodes must line up (FAQ)"
    size = abs(skews[worst])
    status = FAIL if size >= CLOCK_SKEW_FAIL_S else WARN if size >= CLOCK_SKEW_WARN_S else PASS
    yield Check("clock_skew", status, value, hint if status != PASS else "")


def check_disk(ctx: _Ctx) -> Iterable[Check]:
    agent = ctx.config.agent
    need = max(MIN_FREE_BYTES, agent.log_max_bytes * (agent.log_keep + 1) * max(1, len(ctx.config.active_components())))
    for label, path in (("disk_logs", agent.log_dir), ("disk_state", agent.state_dir)):
        space = ctx.host.fs_space(path)
        if space is None:
            yield Check(label, WARN, f"cannot stat {path}", "")
            continue
        value = f"{path}: {space[0] / 2**30:,.1f} GiB free (want {need / 2**30:,.1f} GiB)"
        hint = "free space there or point agent.log_dir/state_dir elsewhere"
        status = FAIL if space[0] < need else WARN if space[0] < 3 * need else PASS
        yield Check(label, status, value, hint if status != PASS else "")


def check_ports_lint(ctx: _Ctx) -> Iterable[Check]:
    """Preflight: FAIL when two of our listeners collide (a config error: it holds the stack), WARN when a
    stranger holds one of our ports (that component's start waits for it, named, like the `ports` check's) or a
    listener is inside the ephemeral range and not reserved."""
    report = lint_node(ctx.config, ctx.host, ctx.ours)
    fixed = sum(1 for u in report.uses if not u.random)
    ours = [f for f in report.collisions if f.kind != TAKEN]
    taken = [f for f in report.collisions if f.kind == TAKEN]
    if ours:
        yield Check("ports_lint", FAIL, "; ".join(f.message for f in ours),
                    "give each listener its own ports (cluster.pd.kv_port_base, ASCEND_BASE_PORT, the components' "
                    "ports)")  # fmt: skip
    elif taken:
        yield Check("ports_lint", WARN, "; ".join(f.message for f in taken),
                    "stop what holds them: the component's start waits until they are free (never signalled)")
    elif report.exposed:
        yield Check("ports_lint", WARN, "; ".join(f.message for f in report.exposed),
                    f"nodeagentctl ports --apply (as root), or sysctl -w {report.sysctl_line().replace(' ', '')}")
    elif not report.ephemeral_known:
        yield Check("ports_lint", PASS, f"{fixed} fixed port ranges, no collisions (ip_local_port_range unreadable: "
                    "ephemeral overlap not checked)")  # fmt: skip
    else:
        yield Check("ports_lint", PASS, f"{fixed} fixed port ranges, no collisions, none in the ephemeral range "
                    f"{report.ephemeral[0]}-{report.ephemeral[1]} unreserved")  # fmt: skip


def check_recovery(ctx: _Ctx) -> Iterable[Check]:
    """Preflight: another chip resetter here (never both), the prefill side's KV abort timeout (#13240)."""
    from nodeagent.layers.chip_reset import running_resetter
    from nodeagent.layers.preflight_resetter import abort_timeout_check, resetter_check
    from nodeagent.node.launcher import base_environment
    from nodeagent.render.launch import render_component

    base = base_environment()
    found = [*resetter_check(ctx.config, running_resetter),
             *abort_timeout_check(ctx.config, lambda n: render_component(n, ctx.config, base).environment(base))]
    yield from (Check(*row) for row in found)


def check_container_mode(ctx: _Ctx) -> Iterable[Check]:
    if ctx.config.container is None:
        return [Check(*NO_CONTAINER)]
    from nodeagent.layers.preflight_container import check_container

    return [Check(*found) for found in check_container(ctx.config, ctx.host)]


CHECKS: tuple[Callable[[_Ctx], Iterable[Check]], ...] = (
    check_npus, check_versions, check_memory, check_models, check_programs, check_network, check_peers, check_disk,
    check_ports_lint, check_recovery, check_container_mode,
)


def run_preflight(config: Config, host: Host | None = None,
                  peers: Sequence[Mapping[str, Any]] | None = None) -> PreflightReport:  # fmt: skip
    """Every check; a check that crashes becomes a FAIL naming the error (preflight itself never raises).

    `peers`: other members' records, plain dicts with `name`, `pythonhashseed`, `wall_clock` (their time.time()
    when written) and optionally `observed_at` (ours when read; default now)."""
    if host is None:
        from nodeagent.node.launcher import base_environment

        host = Host(path=base_environment()["PATH"])
    ctx = _Ctx(config, host, list(peers) if peers else None, expected_npus(config))
    report = PreflightReport(about=member_text(config))
    for check in CHECKS:
        try:
            report.checks.extend(check(ctx))
        except Exception as exc:  # a bug in one check must not hide the others
            report.checks.append(Check(check.__name__.removeprefix("check_"), FAIL,
                                       f"the check crashed: {type(exc).__name__}: {exc}", "report this as a bug"))
    return report


def member_text(config: Config) -> str:
    """Which member, role and vLLM ranks a report is about: `node a2-5 (worker; vllm-dp8 .. vllm-dp15)`."""
    vllms = [n for n, c in config.active_components().items() if isinstance(c, VllmComponent)]
    ranks = "" if not vllms else f"; {vllms[0]}" if len(vllms) == 1 else f"; {vllms[0]} .. {vllms[-1]}"
    cluster = f" of cluster {config.cluster.name}" if config.cluster.nodes else ""
    return f"node {config.node.name}{cluster} ({config.node.role}{ranks})"


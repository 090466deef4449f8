"""Warm weights (issue 32 item 3): the pure plan (which shards, how much fits), and the thin shell — mincore's
residency, the throttled reader, the layer's view of the node — on real small files, without processes."""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nodeagent.config.model import validate_config
from nodeagent.core.states import Desired, State
from nodeagent.layers.weight_warm import CHUNK, WeightWarmer, read_warm, resident_bytes
from nodeagent.vllm.warm_plan import Shard, WarmAction, model_of, models_by_folder, plan_warm

GB = 10**9
MB = 1 << 20


def shards(*sizes_resident: tuple[int, int]) -> list[Shard]:
    return [Shard(Path(f"/m/model-{i:05d}.safetensors"), s, r) for i, (s, r) in enumerate(sizes_resident)]


def test_the_plan_reads_everything_that_fits() -> None:
    plan = plan_warm(shards((100 * GB, 0), (100 * GB, 50 * GB)), mem_available=900 * GB,
                     shared_memory=64 * GB, margin=16 * GB)  # fmt: skip
    assert plan.action == WarmAction.ALL
    assert plan.budget == 150 * GB and plan.missing == 150 * GB
    assert len(plan.files) == 2


def test_the_plan_reads_a_prefix_when_only_part_fits() -> None:
    # 300 GB free after shm and margin; 50 GB of the shards already cached (inside MemAvailable): 250 GB more.
    plan = plan_warm(shards((200 * GB, 50 * GB), (200 * GB, 0)), mem_available=380 * GB,
                     shared_memory=64 * GB, margin=16 * GB)  # fmt: skip
    assert plan.action == WarmAction.PREFIX
    assert plan.budget == 250 * GB
    assert "reading 250 GB of the 350 GB missing" in plan.reason


def test_the_plan_skips_with_the_numbers_when_nothing_fits() -> None:
    plan = plan_warm(shards((310 * GB, 0)), mem_available=70 * GB, shared_memory=64 * GB, margin=16 * GB)
    assert plan.action == WarmAction.SKIP and plan.budget == 0 and plan.files == ()
    assert plan.reason == ("skipped: needs 310 GB of shards (0 MB resident), 0 MB free of 70 GB available after the "
                           "worker's 64 GB shared memory and the 16 GB margin")  # fmt: skip


def test_a_prefix_names_what_fits() -> None:
    plan = plan_warm(shards((310 * GB, 0)), mem_available=200 * GB, shared_memory=64 * GB, margin=16 * GB)
    assert plan.action == WarmAction.PREFIX and plan.budget == 120 * GB
    assert plan.reason == ("reading 120 GB of the 310 GB missing: needs 310 GB of shards (0 MB resident), 120 GB "
                           "free of 200 GB available after the worker's 64 GB shared memory and the 16 GB margin")


def test_cached_shards_are_counted_once_so_passes_do_not_grow_the_cache() -> None:
    """MemAvailable already holds the cached shards: a second pass after a prefix reads nothing more."""
    first = plan_warm(shards((300 * GB, 0)), mem_available=200 * GB, shared_memory=0, margin=0)
    assert first.budget == 200 * GB
    again = plan_warm(shards((300 * GB, 200 * GB)), mem_available=200 * GB, shared_memory=0, margin=0)
    assert again.action == WarmAction.SKIP


def test_the_plan_says_when_all_is_resident() -> None:
    plan = plan_warm(shards((GB, GB)), mem_available=0, shared_memory=0, margin=0)
    assert plan.action == WarmAction.RESIDENT and plan.files == ()


def test_the_model_comes_from_the_rendered_command() -> None:
    assert model_of(["vllm", "serve", "/w/dsv4", "--port", "1"]) == "/w/dsv4"
    assert model_of(["vllm", "serve", "/w/a", "--model", "/w/b"]) == "/w/b"
    assert model_of(["python", "-m", "x", "--model=/w/c"]) == "/w/c"
    assert model_of(["vllm", "serve", "--port", "1"]) is None
    ranks = {"r0": ["vllm", "serve", "/w/m"], "r1": ["vllm", "serve", "/w/m"], "o": ["vllm", "serve", "/w/o"]}
    assert models_by_folder(ranks) == {"/w/m": ["r0", "r1"], "/w/o": ["o"]}


def write_shard(path: Path, size: int) -> None:
    """A safetensors file of `size` bytes (one U8 tensor), written and then dropped from the page cache."""
    body = size - 128
    header = json.dumps({"w": {"dtype": "U8", "shape": [body], "data_offsets": [0, body]}}).encode().ljust(120)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.write(os.urandom(body))
        f.flush()
        os.fsync(f.fileno())
    drop(path)


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident_bytes(path)[1] > 0:
        pytest.skip(f"{path.parent} keeps its pages cached (tmpfs?): residency cannot be dropped here")


def test_mincore_sees_what_a_read_brings_in(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    write_shard(path, 4 * MB)
    assert resident_bytes(path) == (4 * MB, 0)
    with open(path, "rb") as f:
        f.read(MB)
    size, resident = resident_bytes(path)
    assert size == 4 * MB and MB <= resident < 4 * MB  # readahead may take a little more than the MB read


def test_the_reader_reads_the_budget_skips_what_is_resident_and_stops_on_memory(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_shard(a, 2 * CHUNK)
    write_shard(b, 2 * CHUNK)
    cancel = threading.Event()
    out = read_warm([a, b], CHUNK, 1e12, lambda: None, cancel)
    assert out.read == CHUNK and out.stopped is None
    assert resident_bytes(b)[1] == 0
    again = read_warm([a, b], 10 * CHUNK, 1e12, lambda: None, cancel)
    assert again.read == 3 * CHUNK  # a's first chunk was resident: not counted, not read again
    assert resident_bytes(a) == (2 * CHUNK, 2 * CHUNK) and resident_bytes(b) == (2 * CHUNK, 2 * CHUNK)
    drop(a)
    calls = iter([None, "MemAvailable fell"])
    stopped = read_warm([a], 10 * CHUNK, 1e12, lambda: next(calls), cancel)
    assert stopped.read == CHUNK and stopped.stopped == "MemAvailable fell"


def test_the_reader_keeps_to_its_rate(tmp_path: Path) -> None:
    path = tmp_path / "r.safetensors"
    write_shard(path, 3 * CHUNK)
    started = time.monotonic()
    out = read_warm([path], 10 * CHUNK, 3 * CHUNK / 0.6, lambda: None, threading.Event())
    assert out.read == 3 * CHUNK
    assert time.monotonic() - started >= 0.55


class Port:
    """What the warmer reads of the node: the config, a snapshot of its components, events."""

    def __init__(self, config: Any, states: dict[str, State]) -> None:
        self.config = config
        self.states = states
        self.events: list[str] = []

    workers: dict[str, int] = {}  # noqa: RUF012 - a test's fake: datasystem component → its pid

    def snapshot(self) -> Any:
        ranks = {n: SimpleNamespace(kind="vllm", desired=Desired.RUNNING, state=s, pid=None)
                 for n, s in self.states.items()}  # fmt: skip
        workers = {n: SimpleNamespace(kind="datasystem", desired=Desired.RUNNING, state=State.READY, pid=p)
                   for n, p in self.workers.items()}  # fmt: skip
        return SimpleNamespace(components={**ranks, **workers})

    def emit(self, kind: str, message: str, *args: Any) -> None:
        self.events.append(message)


def node_config(model: Path, margin_mb: int = 0, shm_mb: int = 1) -> Any:
    return validate_config({
        "node": {"name": "n0", "ip": "127.0.0.1", "npus": 0},
        "recovery": {"warm_weights": {"margin_mb": margin_mb, "rate_mb_s": 10000}},
        "components": {
            "ds": {"kind": "datasystem", "shared_memory_size_mb": shm_mb},
            "r0": {"kind": "vllm", "model": str(model), "data_parallel_rank": 0, "depends_on": ["ds"]},
            "r1": {"kind": "vllm", "model": str(model), "data_parallel_rank": 1, "port": 8081, "depends_on": ["ds"]},
        }})  # fmt: skip


def meminfo_kb(kb: int) -> str:
    return f"MemTotal: 99999999 kB\nMemAvailable: {kb} kB\n"


def test_the_warmer_reads_the_ranks_model_and_reports_it_per_component(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    write_shard(model / "model-00001-of-00002.safetensors", CHUNK)
    write_shard(model / "model-00002-of-00002.safetensors", CHUNK)
    write_shard(model / "not-in-the-index.safetensors", CHUNK)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    port = Port(node_config(model), {"r0": State.STOPPING, "r1": State.READY})
    warmer = WeightWarmer(port, read_mem=lambda: meminfo_kb(64 << 20))  # type: ignore[arg-type]
    assert warmer.wanted()
    warmer.pass_once()
    section = warmer.status_section()["weights"]
    assert section["total_bytes"] == section["resident_bytes"] == 2 * CHUNK
    assert section["components"] == {"r0": {"total_bytes": 2 * CHUNK, "resident_bytes": 2 * CHUNK},
                                     "r1": {"total_bytes": 2 * CHUNK, "resident_bytes": 2 * CHUNK}}  # fmt: skip
    assert section["read_bytes"] == 2 * CHUNK and section["plan"].startswith("reading 17 MB")
    assert resident_bytes(model / "not-in-the-index.safetensors")[1] == 0
    port.states["r0"] = State.READY
    assert not warmer.wanted()


def test_the_warmer_skips_when_the_worker_and_margin_leave_no_room(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    write_shard(model / "model.safetensors", CHUNK)
    # 100 MB available, the worker's 64 MB and a 40 MB margin: nothing fits.
    warmer = WeightWarmer(Port(node_config(model, margin_mb=40, shm_mb=64), {}),  # type: ignore[arg-type]
                          read_mem=lambda: meminfo_kb(100 << 10))  # fmt: skip
    warmer.pass_once()
    section = warmer.status_section()["weights"]
    assert section["resident_bytes"] == 0 and section["read_bytes"] == 0
    assert section["plan"].startswith("skipped: needs 8 MB of shards (0 MB resident), 0 MB free of 105 MB")
    assert warmer.memory_ok() is not None


def test_a_model_that_is_not_a_folder_here_is_named(tmp_path: Path) -> None:
    warmer = WeightWarmer(Port(node_config(tmp_path / "absent"), {}), read_mem=lambda: meminfo_kb(1))  # type: ignore[arg-type]
    warmer.pass_once()
    (entry,) = warmer.status_section()["weights"]["models"]
    assert entry["components"] == ["r0", "r1"] and "not a folder on this host" in entry["problem"]


def test_metrics_and_status_show_the_resident_bytes_per_component_and_for_the_node() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from nodeagent.api.metrics import _WeightsCollector
    from nodeagent.cli.status import format_weights

    warmer = SimpleNamespace(read_bytes=5 * GB, resident=lambda: ({"r0": (300 * GB, 120 * GB),
                                                                    "r1": (300 * GB, 120 * GB)}, 300 * GB, 120 * GB))
    registry = CollectorRegistry()
    registry.register(_WeightsCollector(warmer))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'dsv4_agent_weights_resident_bytes{component="r1"} 1.2e+11' in text
    assert "dsv4_agent_weights_node_resident_bytes 1.2e+11" in text
    assert "dsv4_agent_weights_node_bytes 3e+11" in text
    assert "dsv4_agent_weights_warmed_bytes_total 5e+09" in text
    section = {"state": "reading", "total_bytes": 300 * GB, "resident_bytes": 120 * GB, "rate_mb_s": 500.0,
               "plan": "reading 120 GB of the 300 GB missing: …",
               "models": [{"model": "org/hub-id", "problem": "not a folder on this host"}]}
    assert format_weights(section) == [
        "weights: 120 GB of 300 GB resident · reading ≤ 500.0 MB/s · reading 120 GB of the 300 GB missing: …",
        "weights org/hub-id: not a folder on this host"]
    assert format_weights({}) == []


async def test_the_loop_passes_at_start_then_only_while_a_rank_is_not_serving(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from nodeagent.layers import weight_warm

    model = tmp_path / "m"
    model.mkdir()
    shard = model / "model.safetensors"
    write_shard(shard, CHUNK)
    monkeypatch.setattr(weight_warm, "MIN_PASS_GAP_S", 0.0)
    monkeypatch.setattr(weight_warm, "REFRESH_S", 0.0)
    port = Port(node_config(model), {"r0": State.READY, "r1": State.READY})
    warmer = WeightWarmer(port, read_mem=lambda: meminfo_kb(64 << 20))  # type: ignore[arg-type]

    async def until(check: Any) -> None:
        for _ in range(500):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(warmer.status_section())

    task = asyncio.create_task(warmer.run())
    try:
        await until(lambda: warmer.read_bytes == CHUNK and warmer.status_section()["weights"]["resident_bytes"])
        drop(shard)
        measured = warmer.measured_at
        warmer.on_node_change()
        await until(lambda: warmer.measured_at != measured)
        assert warmer.read_bytes == CHUNK, "every rank serves: measured, not read"
        assert warmer.status_section()["weights"]["resident_bytes"] == 0
        port.states["r1"] = State.STOPPING
        warmer.on_node_change()
        await until(lambda: warmer.read_bytes == 2 * CHUNK)
    finally:
        warmer.close()
        task.cancel()


def test_measuring_takes_at_most_a_fiftieth_of_the_time(tmp_path: Path) -> None:
    """mincore walks the page cache: 300 GB of shards take seconds, so a measurement is repeated no sooner than
    50 times its own length (and REFRESH_S)."""
    from nodeagent.layers.weight_warm import REFRESH_S

    now = [1000.0]
    warmer = WeightWarmer(Port(node_config(tmp_path / "absent"), {}), read_mem=lambda: meminfo_kb(1),  # type: ignore[arg-type]
                          clock=lambda: now[0])  # fmt: skip
    assert warmer._measure_due()
    ticks = iter([1000.0, 1004.0])  # the measurement took 4 s
    warmer._clock = lambda: next(ticks)
    warmer.measure()
    warmer._clock = lambda: now[0]
    now[0] = 1004.0 + max(REFRESH_S, 200.0) - 1
    assert not warmer._measure_due()
    now[0] += 1
    assert warmer._measure_due()


def test_a_path_inside_the_container_is_read_where_the_host_mounts_it() -> None:
    from nodeagent.vllm.warm_plan import host_path

    volumes = ["/home:/home", "/nvme/weights:/weights:ro", "/nvme/weights/big:/weights/big", "cache:/root/.cache"]
    assert host_path(volumes, "/home/u/dsv4") == Path("/home/u/dsv4")
    assert host_path(volumes, "/weights/dsv4") == Path("/nvme/weights/dsv4")
    assert host_path(volumes, "/weights/big/m") == Path("/nvme/weights/big/m"), "the longest mount wins"
    assert host_path(volumes, "/root/.cache/m") is None, "a named volume is no host folder"
    assert host_path(volumes, "/opt/m") is None


def test_in_container_mode_the_ranks_model_is_warmed_from_the_mounts_source(tmp_path: Path) -> None:
    host = tmp_path / "nvme"
    (host / "m").mkdir(parents=True)
    write_shard(host / "m" / "model.safetensors", CHUNK)
    plain = node_config(Path("/weights/m"))
    config = validate_config({
        "node": {"name": "n0", "ip": "127.0.0.1", "npus": 0},
        "container": {"engine": "podman", "run_args": [f"-v {host}:/weights"]},
        "recovery": {"warm_weights": {"margin_mb": 0}},
        "components": {"r0": {"kind": "vllm", "model": "/weights/m"}},
    })  # fmt: skip
    warmer = WeightWarmer(Port(config, {}), read_mem=lambda: meminfo_kb(64 << 20))  # type: ignore[arg-type]
    warmer.pass_once()
    (entry,) = warmer.status_section()["weights"]["models"]
    assert entry["problem"] is None and entry["resident_bytes"] == CHUNK, entry
    on_host = WeightWarmer(Port(plain, {}), read_mem=lambda: meminfo_kb(64 << 20))  # type: ignore[arg-type]
    on_host.measure()
    assert "not a folder on this host" in on_host.status_section()["weights"]["models"][0]["problem"]


def test_the_shared_memory_a_running_worker_already_uses_is_not_reserved_twice(tmp_path: Path) -> None:
    """Its touched pool (RssShmem) is out of MemAvailable already: only the rest is held back for it."""
    model = tmp_path / "m"
    model.mkdir()
    write_shard(model / "model.safetensors", CHUNK)
    port = Port(node_config(model, margin_mb=40, shm_mb=64), {})
    port.workers = {"ds": 4242}
    statuses: list[int] = []

    def status(pid: int) -> str:
        statuses.append(pid)
        return "Name:\tdatasystem_worker\nRssShmem:\t   49152 kB\n"  # 48 of its 64 MB touched

    warmer = WeightWarmer(port, read_mem=lambda: meminfo_kb(100 << 10), read_proc_status=status)  # type: ignore[arg-type]
    assert warmer.memory_room() == (100 << 20, 16 << 20, 40 << 20)
    assert statuses == [4242]
    warmer.pass_once()
    assert warmer.status_section()["weights"]["resident_bytes"] == CHUNK
    port.workers = {}
    assert warmer.memory_room()[1] == 64 << 20, "a worker not running: its whole pool is still to come"


def test_while_a_rank_stays_down_passes_come_only_when_a_measurement_is_due(tmp_path: Path) -> None:
    """A load takes 30-60 min: a pass as the rank goes down, then none until 50 measurement-lengths later."""
    from nodeagent.layers.weight_warm import MIN_PASS_GAP_S

    now = [1000.0]
    port = Port(node_config(tmp_path / "absent"), {"r0": State.READY})
    warmer = WeightWarmer(port, read_mem=lambda: meminfo_kb(1), clock=lambda: now[0])  # type: ignore[arg-type]
    assert warmer.next_work() == warmer.pass_once, "the start's pass"
    warmer._last_pass_at, warmer._measured_mono, warmer._measure_s = now[0], now[0], 4.0
    now[0] += 1
    assert warmer.next_work() is None, "all serve, a measurement not due"
    port.states["r0"] = State.STOPPING
    assert warmer.next_work() is None, "gone down, but within MIN_PASS_GAP_S of the last pass"
    now[0] += MIN_PASS_GAP_S
    assert warmer.next_work() == warmer.pass_once, "then at once"
    warmer._last_pass_at = warmer._measured_mono = now[0]
    now[0] += 100
    assert warmer.next_work() is None, "still down: not before 50 × 4 s"
    now[0] += 100
    assert warmer.next_work() == warmer.pass_once

#!/usr/bin/env python3
"""Warm weights (issue 32 item 3): a loader's read of safetensors shards from a cold page cache against a warm one.

Writes `--gb` GB of safetensors shards (`--shards` files of bf16 tensors, random bytes) under a temp folder, then
per round:
- cold: every shard dropped from the page cache with posix_fadvise(DONTNEED) (not `echo 1 > drop_caches`: that drops
  the whole host's cache, and other work shares this host), checked empty with mincore;
- the load, timed two ways: safetensors' own loader (`safe_open(..., framework="pt")` and `get_tensor` of every
  tensor, what vLLM's safetensors iterator does; run by `--loader-python`, the CPU vLLM's interpreter, timed inside
  that child so its imports are not counted) and a plain mmap touching every page (stdlib, in this process);
- warm: dropped again, then the agent's warmer (`layers.weight_warm.read_warm`, at `--rate` MB/s, its own
  nice/idle-IO thread) reads them in — its time is what the agent spends in the background, while a rank's old tree
  stops — and the same loads are timed again.
Median of `--rounds` (3) each, and the ratio warm/cold. The anchor is issue 32's: the phases the agent influences
(weights) at <= 30 % of cold on a warm restart.

Usage: `.venv/bin/python bench/warm_weights.py [--gb 3] [--shards 6] [--rounds 3] [--rate 2000] [--json FILE]`
(`--keep DIR` reuses/keeps the shards there).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nodeagent.layers.weight_warm import lower_priority, read_warm, resident_bytes  # noqa: E402

ANCHOR = 0.30
TENSOR = 64 << 20
LOADER = r"""
import sys, time
from safetensors import safe_open
def disk():
    return int([l for l in open("/proc/self/io") if l.startswith("read_bytes:")][0].split()[1])
start, before = time.perf_counter(), disk()
n = 0
for path in sys.argv[1:]:
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            n += f.get_tensor(key).numel()
print(time.perf_counter() - start, n, disk() - before)
"""


def write_shards(folder: Path, total: int, count: int) -> list[Path]:
    """`count` safetensors files of `total` bytes together: bf16 tensors of 64 MB, random (incompressible) bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    per = total // count // TENSOR * TENSOR
    block = os.urandom(TENSOR)
    paths, weight_map = [], {}
    for i in range(count):
        path = folder / f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        paths.append(path)
        header: dict[str, Any] = {}
        for t in range(per // TENSOR):
            name = f"layers.{i}.w{t}"
            header[name] = {"dtype": "BF16", "shape": [TENSOR // 2], "data_offsets": [t * TENSOR, (t + 1) * TENSOR]}
            weight_map[name] = path.name
        if path.is_file() and path.stat().st_size >= per:
            continue
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for _ in range(per // TENSOR):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return paths


def drop(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = sum(resident_bytes(p)[1] for p in paths)
    if left > 0.01 * sum(p.stat().st_size for p in paths):
        raise SystemExit(f"the page cache kept {left >> 20} MB of the shards after DONTNEED: cannot measure cold")


def disk_read() -> int:
    """Bytes this process had fetched from storage (/proc/self/io `read_bytes`: the page cache's misses)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def touch_load(paths: list[Path]) -> tuple[float, int]:
    """mmap each shard and touch every page (one byte a page, by a strided slice: the CPU's share stays small, so
    what is timed is getting the pages); (seconds, bytes read from storage)."""
    start, before = time.perf_counter(), disk_read()
    for path in paths:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            m[::mmap.PAGESIZE]
    return time.perf_counter() - start, disk_read() - before


def prefetch_load(paths: list[Path]) -> tuple[float, int]:
    """Read each shard start to end in 16 MB reads into one buffer: vLLM's `--safetensors-load-strategy prefetch`
    (the guide's) reads the files this way before loading them."""
    start, before = time.perf_counter(), disk_read()
    buf = bytearray(16 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - start, disk_read() - before


def st_load(python: str, paths: list[Path]) -> tuple[float, int]:
    out = subprocess.run([python, "-c", LOADER, *map(str, paths)], capture_output=True, text=True, check=True)
    seconds, _, disk = out.stdout.split()
    return float(seconds), int(disk)


def warm(paths: list[Path], rate_mb_s: float) -> tuple[float, int]:
    """The agent's warmer on its own low-priority thread, as the layer runs it; (seconds, bytes read)."""
    result: dict[str, Any] = {}

    def work() -> None:
        lower_priority()
        start = time.perf_counter()
        out = read_warm(paths, 1 << 62, rate_mb_s * 1e6, lambda: None, threading.Event())
        result.update(seconds=time.perf_counter() - start, read=out.read)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return result["seconds"], result["read"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=2000.0, help="the warmer's MB/s bound (recovery.warm_weights)")
    ap.add_argument("--loader-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="dsv4-warm-"))
    have_st = Path(args.loader_python).exists() and subprocess.run(
        [args.loader_python, "-c", "import safetensors, torch"], capture_output=True).returncode == 0
    try:
        paths = write_shards(folder, int(args.gb * 1e9), args.shards)
        size = sum(p.stat().st_size for p in paths)
        samples: dict[str, list[float]] = {}

        def record(key: str, sample: tuple[float, int]) -> None:
            samples.setdefault(key, []).append(sample[0])
            samples.setdefault(f"{key}_disk", []).append(sample[1])

        for _ in range(args.rounds):
            drop(paths)
            record("cold_touch", touch_load(paths))
            drop(paths)
            record("cold_prefetch", prefetch_load(paths))
            if have_st:
                drop(paths)
                record("cold_st", st_load(args.loader_python, paths))
            drop(paths)
            seconds, read = warm(paths, args.rate)
            samples.setdefault("warm_s", []).append(seconds)
            assert read >= 0.99 * size, (read, size)
            record("warm_touch", touch_load(paths))
            record("warm_prefetch", prefetch_load(paths))
            if have_st:
                record("warm_st", st_load(args.loader_python, paths))
        med = {k: statistics.median(v) for k, v in samples.items() if v}
        print(f"{size / 1e9:.2f} GB in {len(paths)} shards, {args.rounds} rounds (medians); cold = posix_fadvise "
              f"DONTNEED on the shards, checked by mincore; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs")  # fmt: skip
        print(f"  warmer (agent, ≤ {args.rate:g} MB/s, nice 19, idle IO): {med['warm_s']:.2f} s "
              f"({size / 1e6 / med['warm_s']:.0f} MB/s)")  # fmt: skip
        rows = [("read start to end (vLLM's prefetch)", "prefetch"), ("mmap + touch every page", "touch")]
        if have_st:
            rows.append(("safetensors get_tensor (CPU vLLM's)", "st"))
        for label, key in rows:
            cold, hot = med[f"cold_{key}"], med[f"warm_{key}"]
            ratio = hot / cold
            disk_cold, disk_warm = med[f"cold_{key}_disk"] / 1e6, med[f"warm_{key}_disk"] / 1e6
            print(f"  {label:38s} cold {cold:6.2f} s ({size / 1e6 / cold:5.0f} MB/s, {disk_cold:5.0f} MB from disk)"
                  f"   warm {hot:6.2f} s ({size / 1e6 / hot:5.0f} MB/s, {disk_warm:4.0f} MB from disk)   warm/cold "
                  f"{ratio:.1%}   anchor <= {ANCHOR:.0%}: {'PASS' if ratio <= ANCHOR else 'FAIL'}")  # fmt: skip
        if not have_st:
            print(f"  (no safetensors+torch at {args.loader_python}: the loader row is left out)")
        if args.json:
            args.json.write_text(json.dumps({"bytes": size, "shards": len(paths), "samples": samples,
                                             "medians": med, "rate_mb_s": args.rate}, indent=2))  # fmt: skip
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What the compile caches on the host cost the agent (issue 32 item 2; anchor: docs/performance.md "Compile
caches on the host"): the part on a vLLM launch's path (`CacheStore.apply`: the key — for a host rank its
installed versions read from dist-info — the folder made and stamped) and the part after it, in a thread (the
retention's walk of every kept cache: `sweep`), for caches of N files.

    PYTHONPATH=. .venv/bin/python bench/compile_cache.py [--files 10000 50000] [--runs 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nodeagent.config.load import parse_config  # noqa: E402
from nodeagent.node.caches import CacheStore  # noqa: E402
from nodeagent.node.vllm_install import launch_spec  # noqa: E402
from nodeagent.render.caches import container_parts  # noqa: E402

VLLM = Path(os.environ.get("DSV4_VLLM_VENV") or ROOT / ".venv-vllm") / "bin" / "vllm"


def median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:.2f} ms (min {min(samples) * 1000:.2f}, max {max(samples) * 1000:.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, nargs="*", default=[10_000, 50_000])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsv4-cc-") as tmp:
        home = Path(tmp)
        (home / "model").mkdir()
        config = parse_config(f"node: {{name: n1, ip: 127.0.0.1}}\nagent: {{state_dir: {home}/state}}\n"
                              f"components:\n  vllm: {{kind: vllm, command: [{VLLM}], model: {home}/model}}\n")
        spec = launch_spec("vllm", config, {})
        store = CacheStore()
        async def read_versions(command: str) -> None:  # the exec's ~0.2 s is once per container, not timed here
            return None

        inside = SimpleNamespace(read_versions=read_versions,
                                 cache_parts=lambda command: container_parts("img", "sha256:" + "a" * 64, "s", {}))

        async def timed(where: object) -> float:
            t0 = time.perf_counter()
            out = await store.apply(config, "vllm", spec, {}, where)
            took = time.perf_counter() - t0
            await store.swept()
            assert "VLLM_CACHE_ROOT" in out.env, "no cache folder (is .venv-vllm there?)"
            return took

        for label, where in (("host rank (versions from dist-info)", None), ("rank in the container", inside)):
            samples = [asyncio.run(timed(where)) for _ in range(args.runs)]
            print(f"apply, on the launch's path, {label}: {median_ms(samples)}")
        folder = next(p for p in (home / "state" / "cache").iterdir() if p.is_dir())
        made = 0
        for count in sorted(args.files):
            for i in range(made, count):
                sub = folder / "inductor" / f"d{i // 1000}"
                sub.mkdir(parents=True, exist_ok=True)
                (sub / f"f{i}.py").write_bytes(b"x" * 2048)
            made = count
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                store.sweep(config)
                samples.append(time.perf_counter() - t0)
            print(f"sweep (retention + sizes, in a thread after the launch), {count} files: {median_ms(samples)}; "
                  f"{store.total_bytes() / 1e6:.0f} MB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

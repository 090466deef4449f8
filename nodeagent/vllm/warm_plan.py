"""Which weight shards this node warms into the page cache, and how much of them fits (issue 32 item 3).

A rank's load reads every shard of its model (a data/expert-parallel rank loads the whole checkpoint and keeps its
experts; tensor-parallel ranks of one node read all shards between them), so the node warms every shard of each
model its vLLM components serve — the model being the one their rendered command names.

The budget: MemAvailable, minus the datasystem worker's shared memory it has not touched yet (its pool fills as it
is used; the touched part is out of MemAvailable already) and a margin. What is already cached of the shards is
*inside* MemAvailable — the kernel counts the page cache as available (measured: reading 1 GB into the cache
lowered MemFree by 1.26 GB, MemAvailable by 0.25 GB, the noise of the host) — so the shards may hold that much in
total, and a pass reads at most that minus what is resident. Counting the cached part again would let every pass
read more, until the cache filled the host.

Pure: the caller measures (sizes, residency, /proc/meminfo) and carries the plan out. NamedTuples, not dataclasses:
`nodeagentctl status` formats with `gb` and stays clear of `dataclasses` (tests/test_cli.py keeps it lean).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple


class WarmAction(StrEnum):
    ALL = "all"
    """Everything not resident fits: read it."""
    PREFIX = "prefix"
    """Only part fits: read the shards in order until the budget is spent."""
    SKIP = "skip"
    """Nothing more fits (the reason says the numbers)."""
    RESIDENT = "resident"
    """Every byte is in the page cache already."""


class Shard(NamedTuple):
    path: Path
    size: int
    resident: int
    """Bytes of it in the page cache (mincore)."""


class WarmPlan(NamedTuple):
    action: WarmAction
    files: tuple[Path, ...]
    """The shards to read, in order (those not wholly resident)."""
    budget: int
    """At most this many bytes not yet resident may be read in this pass."""
    total: int
    resident: int
    reason: str

    @property
    def missing(self) -> int:
        return self.total - self.resident


def gb(n: int | float) -> str:
    """Bytes as an operator reads them in a reason: `310 GB`, `1.5 GB`, `12 MB`."""
    if abs(n) >= 10e9:
        return f"{n / 1e9:.0f} GB"
    if abs(n) >= 1e9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB"


def model_of(argv: Sequence[str]) -> str | None:
    """The model a `vllm serve` command loads: `--model X` / `--model=X` if given (it wins in vLLM), else the
    positional after `serve`."""
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    if "serve" in argv:
        i = list(argv).index("serve")
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
    return None


def models_by_folder(argvs: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Each model a component of this node loads → its components (ranks of one model share its shards once)."""
    out: dict[str, list[str]] = {}
    for name, argv in argvs.items():
        model = model_of(argv)
        if model is not None:
            out.setdefault(model, []).append(name)
    return out


def host_path(volumes: Sequence[str], path: str) -> Path | None:
    """Where the host sees `path` of a container whose run line has these `-v SRC:DST[:OPTS]` values: through the
    mount with the longest DST holding it; None when no host folder is mounted there (a named volume neither)."""
    target = Path(path)
    best: tuple[int, Path] | None = None
    for value in volumes:
        parts = value.split(":")
        if len(parts) < 2 or not parts[0].startswith("/"):
            continue
        src, dst = Path(parts[0]), Path(parts[1])
        if (dst == target or dst in target.parents) and (best is None or len(dst.parts) > best[0]):
            best = (len(dst.parts), src / target.relative_to(dst))
    return None if best is None else best[1]


def plan_warm(shards: Sequence[Shard], mem_available: int, shared_memory: int, margin: int) -> WarmPlan:
    """All, a prefix, or nothing of `shards`, against the memory left after the worker's shared memory and the
    margin (`mem_available` already holds what is cached of the shards: see the module's docstring)."""
    total = sum(s.size for s in shards)
    resident = sum(min(s.resident, s.size) for s in shards)
    files = tuple(s.path for s in shards if s.resident < s.size)
    missing = total - resident
    room = mem_available - shared_memory - margin
    budget = max(0, min(missing, room - resident))
    after = (f"{gb(max(room, 0))} free of {gb(mem_available)} available after the worker's {gb(shared_memory)} "
             f"shared memory and the {gb(margin)} margin")  # fmt: skip
    needs = f"{gb(total)} of shards ({gb(resident)} resident)"
    if missing <= 0:
        return WarmPlan(WarmAction.RESIDENT, (), 0, total, resident, f"all {gb(total)} of shards resident")
    if budget <= 0:
        return WarmPlan(WarmAction.SKIP, (), 0, total, resident, f"skipped: needs {needs}, {after}")
    if budget >= missing:
        return WarmPlan(WarmAction.ALL, files, budget, total, resident, f"reading {gb(missing)}: {needs}, {after}")
    return WarmPlan(WarmAction.PREFIX, files, budget, total, resident,
                    f"reading {gb(budget)} of the {gb(missing)} missing: needs {needs}, {after}")  # fmt: skip

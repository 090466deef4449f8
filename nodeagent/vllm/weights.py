"""Is a model folder complete? config.json, a tokenizer, and every safetensors shard whole.

A partial download is the classic failure: vLLM then spends half an hour loading before it dies. A safetensors
file states its own size: 8 bytes of little-endian header length, a JSON header whose tensors' `data_offsets`
end where the file must end. So a truncated shard is found exactly, by reading a few KB per shard, without
hashing 150 GB. The shards to expect are the values of `model.safetensors.index.json`'s `weight_map`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass
class WeightsReport:
    folder: Path
    problems: list[str] = field(default_factory=list)
    shards: int = 0
    total_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n} bytes"


def shard_problem(path: Path) -> tuple[str | None, int]:
    """(what is wrong or None, file size) of one safetensors file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{path.name}: {size} bytes, not a safetensors file", size
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                return f"{path.name}: truncated inside its header ({_gb(size)})", size
            header = json.loads(fh.read(header_len))
    except FileNotFoundError:
        return f"{path.name}: missing", 0
    except OSError as exc:
        return f"{path.name}: unreadable: {exc.strerror or exc}", 0
    except ValueError:
        return f"{path.name}: header is not JSON (corrupt)", size
    ends = [t["data_offsets"][1] for k, t in header.items()
            if k != "__metadata__" and isinstance(t, dict) and len(t.get("data_offsets", ())) == 2]  # fmt: skip
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"{path.name}: {_gb(size)} of {_gb(expected)} (truncated download)", size
    return None, size


def shard_names(folder: Path) -> list[str]:
    """The shard files a loader reads, sorted: the index's `weight_map` values, else every `*.safetensors`
    (what vLLM's loader globs without an index). Raises OSError/ValueError on an unreadable index."""
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return sorted(set(weight_map.values()))
    return sorted(p.name for p in folder.glob("*.safetensors"))


def check_weights(folder: Path) -> WeightsReport:
    report = WeightsReport(folder)
    if not folder.is_dir():
        report.problems.append("not a folder" if folder.exists() else "the folder does not exist")
        return report
    if not (folder / "config.json").is_file():
        report.problems.append("config.json missing")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        report.problems.append(f"no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    try:
        shards = shard_names(folder)
    except (ValueError, AttributeError, OSError) as exc:
        report.problems.append(f"{INDEX} unreadable: {exc}")
        return report
    if not shards:
        report.problems.append(f"{INDEX} names no shard" if (folder / INDEX).is_file()
                               else f"no {INDEX} and no *.safetensors")  # fmt: skip
    missing = []
    for name in shards:
        problem, size = shard_problem(folder / name)
        report.total_bytes += size
        if problem is not None and problem.endswith(": missing"):
            missing.append(name)
        elif problem is not None:
            report.problems.append(problem)
    report.shards = len(shards)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        report.problems.append(f"{len(missing)} of {len(shards)} shards missing: {shown}")
    return report

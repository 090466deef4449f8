"""Each NPU's idle HBM use — the lowest seen with no process on the chip — kept in `state_dir/npu-hbm-baseline.json`.

Two readers judge against it: the clean slate before a vLLM start (`residue`: device memory back to idle) and the
chip reset's `verify` (`recovery`). It lives on disk because an agent restarted beside running ranks (it adopts
them) never sees its chips idle: a baseline kept in memory only would be empty exactly when a reset follows.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

FILE_NAME = "npu-hbm-baseline.json"


def baseline_path(state_dir: Path) -> Path:
    return state_dir / FILE_NAME


def lower_baseline(used: Mapping[int, int], baseline: Mapping[int, int]) -> dict[int, int]:
    """The idle baseline after seeing `used` with no process on the chips: the lowest usage yet."""
    merged = dict(baseline)
    for npu, mb in used.items():
        merged[npu] = min(mb, merged.get(npu, mb))
    return merged


def read_baseline(path: Path | None) -> dict[int, int]:
    """npu → MB; empty when unknown (no file, or one that does not parse)."""
    if path is None:
        return {}
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return {int(k): int(v) for k, v in json.loads(path.read_text()).items()}
    return {}


def write_baseline(path: Path | None, baseline: Mapping[int, int]) -> None:
    """Best effort (a full disk must not fail a start or a reset); nothing written when nothing changed."""
    if path is None or dict(baseline) == read_baseline(path):
        return
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({str(k): v for k, v in sorted(baseline.items())}))
        os.replace(tmp, path)

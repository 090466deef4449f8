"""A post-mortem bundle for every failure: what an operator needs to know why it broke, in one archive.

Captured in two steps so the crash path stays fast: `capture` (synchronous, no file reads: what is in memory
and a stat of the log) runs before anything is stopped or cleaned; `write_bundle` (in the background, after
the replacement has started) reads the failed run's log range, takes an `npu-smi info` snapshot, waits —
bounded — for a core file to stop growing, and writes `state_dir/postmortem/<component>/<id>.tar.gz` with a
`manifest.json`. The newest `archive_keep` bundles per component are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import tarfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

LOG_RANGE_MAX = 4 * 1024 * 1024
"""At most this much of the failed run's own output (its end) goes into the bundle."""
CORE_SETTLE_S = 5.0
CORE_WAIT_MAX_S = 300.0
_ID = re.compile(r"^\d{8}T\d{6}\.\d{3}Z-[A-Za-z0-9_.-]+$")


@dataclass
class Evidence:
    component: str
    kind: str
    at: float
    failure: dict[str, Any]
    decision: str = ""
    tree: list[dict[str, Any]] = field(default_factory=list)
    """The process tree as it was at the failure (before it was stopped)."""
    probes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    command: dict[str, Any] = field(default_factory=dict)
    """The rendered argv, environment overrides and cwd of the failed run."""
    log_file: str | None = None
    log_range: tuple[int, int] | None = None
    """[start, end) bytes of `log_file` that the failed run wrote (None under journald: see tail)."""
    output_tail: list[str] = field(default_factory=list)
    metrics: tuple[float, str] | None = None
    """The last vLLM /metrics page scraped before the failure, with its time."""
    npu: dict[str, Any] | None = None
    core_dirs: list[str] = field(default_factory=list)
    """Where a core dump of the failed process would land (its cwd)."""
    extra_files: list[str] = field(default_factory=list)
    """Logs the component writes itself (the datasystem worker's own log folder)."""
    ladder: list[dict[str, Any]] = field(default_factory=list)
    """A data-parallel group's recovery ladder up to here: each rung (vLLM's FT retry, the gang restart) and what
    happened at it."""
    texts: dict[str, str] = field(default_factory=dict)
    """More files for the bundle, by name (the container engine's `inspect` of a dead container)."""
    start_phase: dict[str, Any] | None = None
    """A vLLM that died while starting: the phase it died in (`died_in`), what it reached and each phase's
    seconds (`vllm.start_phases.died_in`, from the failed run's output); None for any other failure."""

    def manifest(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("metrics", None)
        data["texts"] = sorted(self.texts)
        data["metrics_at"] = self.metrics[0] if self.metrics else None
        return data


def bundle_id(at: float, what: str) -> str:
    when = datetime.fromtimestamp(at, UTC)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", what).strip("-.") or "failure"
    return f"{when:%Y%m%dT%H%M%S}.{when.microsecond // 1000:03d}Z-{safe[:40]}"


def core_files(folders: list[str], since: float) -> list[Path]:
    """Core dumps (`core`, `core.<pid>`, `core.*`) written in these folders since the failed run started."""
    found = []
    for folder in folders:
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                named = entry.name == "core" or entry.name.startswith("core.")
                if named and entry.is_file(follow_symlinks=False) and entry.stat().st_mtime >= since:
                    found.append(Path(entry.path))
    return found


async def wait_cores_settled(cores: list[Path], settle_s: float = CORE_SETTLE_S,
                             limit_s: float = CORE_WAIT_MAX_S) -> dict[str, int]:  # fmt: skip
    """Wait until every core file stopped growing for `settle_s` (or `limit_s` passed): {path: size}."""
    sizes: dict[str, int] = {}
    steady_since = time.monotonic()
    deadline = time.monotonic() + limit_s
    while cores:
        now = {str(c): c.stat().st_size if c.exists() else 0 for c in cores}
        if now != sizes:
            sizes, steady_since = now, time.monotonic()
        elif time.monotonic() - steady_since >= settle_s or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    return sizes


def _read_range(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as fh:
        begin = max(start, end - LOG_RANGE_MAX)
        fh.seek(begin)
        return fh.read(max(0, end - begin))


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _add_tree(tar: tarfile.TarFile, folder: str, prefix: str, limit: int = 64 * 1024 * 1024) -> None:
    total = 0
    for root, _dirs, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                size = os.path.getsize(path)
                if total + size > limit:
                    return
                tar.add(path, arcname=os.path.join(prefix, os.path.relpath(path, folder)), recursive=False)
                total += size


async def write_bundle(evidence: Evidence, folder: Path, keep: int, npu_text: str | None = None) -> Path:
    """The archive (off the crash path). Never raises for a missing piece: the manifest says what is absent."""
    cores = core_files(evidence.core_dirs, evidence.at - 1.0)
    core_sizes = await wait_cores_settled(cores) if cores else {}
    manifest = evidence.manifest()
    manifest["cores"] = core_sizes
    manifest["written_at"] = time.time()
    log = b""
    if evidence.log_file and evidence.log_range:
        try:
            log = await asyncio.to_thread(_read_range, evidence.log_file, *evidence.log_range)
        except OSError as exc:
            manifest["log_error"] = str(exc)
    if not log and evidence.output_tail:
        log = ("\n".join(evidence.output_tail) + "\n").encode()
    bid = bundle_id(evidence.at, evidence.failure.get("what", "failure"))
    target = folder / f"{bid}.tar.gz"

    def write() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        with tarfile.open(partial, "w:gz", compresslevel=6) as tar:
            _add(tar, f"{bid}/manifest.json", json.dumps(manifest, indent=1, default=str).encode())
            _add(tar, f"{bid}/output.log", log)
            if evidence.metrics:
                _add(tar, f"{bid}/metrics.txt", evidence.metrics[1].encode())
            if npu_text:
                _add(tar, f"{bid}/npu-smi-info.txt", npu_text.encode())
            for name, text in evidence.texts.items():
                _add(tar, f"{bid}/{name}", text.encode())
            for extra in evidence.extra_files:
                if os.path.isdir(extra):
                    _add_tree(tar, extra, f"{bid}/{os.path.basename(extra.rstrip('/'))}")
        os.replace(partial, target)
        prune(folder, keep)

    await asyncio.to_thread(write)
    return target


def prune(folder: Path, keep: int) -> list[str]:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".tar.gz") and _ID.match(n[:-7]))
    gone = names[: max(0, len(names) - keep)]
    for name in gone:
        with contextlib.suppress(OSError):
            (folder / name).unlink()
    return gone


def list_bundles(root: Path) -> list[dict[str, Any]]:
    """Every bundle under `root` (state_dir/postmortem), oldest first: id, component, size."""
    out = []
    with contextlib.suppress(OSError):
        for component in sorted(os.listdir(root)):
            with contextlib.suppress(OSError):
                for name in sorted(os.listdir(root / component)):
                    if name.endswith(".tar.gz") and _ID.match(name[:-7]):
                        path = root / component / name
                        out.append({"id": name[:-7], "component": component, "path": str(path),
                                    "bytes": path.stat().st_size})  # fmt: skip
    return sorted(out, key=lambda b: b["id"])


def read_bundle(root: Path, bundle: str) -> tuple[dict[str, Any], str]:
    """(manifest, the failed run's output) of a bundle given by id (or a unique prefix of one)."""
    matches = [b for b in list_bundles(root) if b["id"].startswith(bundle)]
    if len(matches) != 1:
        known = ", ".join(b["id"] for b in list_bundles(root)[-5:]) or "none"
        raise KeyError(f"{'no' if not matches else 'more than one'} post-mortem matches {bundle!r} (newest: {known})")
    with tarfile.open(matches[0]["path"]) as tar:
        members = {m.name.split("/", 1)[-1]: m for m in tar.getmembers()}
        manifest = json.load(tar.extractfile(members["manifest.json"]))  # type: ignore[arg-type]  # a file we wrote
        out = tar.extractfile(members["output.log"]).read().decode(errors="replace")  # type: ignore[union-attr]  # ditto
    manifest["files"] = sorted(members)
    return manifest, out

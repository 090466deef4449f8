#!/usr/bin/env python3
"""Fetch vllm-ascend's `examples/` (the PD proxy, launch_online_dp.py) from its PyPI sdist into a cache folder.

`pip download --no-binary :all:` would build the sdist (it needs torch_npu); this takes the sdist's URL and
sha256 from PyPI's simple index (JSON form), checks the hash and extracts only `examples/`. Idempotent: a cache
that holds this version is left alone. Usage: fetch_vllm_ascend_examples.py [DEST] (default .cache/vllm-ascend).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = os.environ.get("VLLM_ASCEND_VERSION", "0.23.0.post1")
INDEX = "https://pypi.org/simple/vllm-ascend/"
PROXY = Path("examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py")


def sdist_url(version: str) -> tuple[str, str]:
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        index = json.load(response)
    wanted = f"vllm_ascend-{version}.tar.gz"
    for item in index["files"]:
        if item["filename"] == wanted:
            return item["url"], item["hashes"]["sha256"]
    raise SystemExit(f"fetch_vllm_ascend_examples: {wanted} is not on {INDEX}")


def fetch(dest: Path, version: str = VERSION) -> Path:
    """Under a lock beside `dest`: two callers at once (scripts/test.sh, run-local.sh --cluster) fetch it once."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch(dest, version)


def _fetch(dest: Path, version: str) -> Path:
    stamp = dest / "VERSION"
    if (dest / PROXY).is_file() and stamp.is_file() and stamp.read_text().strip() == version:
        return dest
    url, sha256 = sdist_url(version)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        archive = Path(tmp) / "sdist.tar.gz"
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=300) as response, open(archive, "wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise SystemExit(f"fetch_vllm_ascend_examples: sha256 mismatch for {url}")
        staging = Path(tmp) / "x"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["examples"]]
            tar.extractall(staging, members=members, filter="data")
        (root,) = list(staging.iterdir())
        target = dest / "examples"
        if target.exists():
            os.rename(target, Path(tmp) / "old")
        os.rename(root / "examples", target)
    stamp.write_text(version + "\n")
    return dest


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / ".cache" / "vllm-ascend"
    print(fetch(where) / PROXY)

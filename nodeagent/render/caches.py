"""Pure rules of the compile caches a vLLM start can reuse (issue 32 item 2): which variables point them where,
which folder a given software stack uses, and which old folders go.

vLLM, torch/inductor, Triton, CANN and torchair keep what they compile under the process's home by default; in
the node's container that home dies with the container, so every recreate compiled from scratch. The agent sets
each cache's variable to a folder on the host it owns (`agent.caches.dir`, the same path inside the container),
one folder per software stack: the key is a hash of what produced the cached code (the image's ID, the setup
list and the versions read inside in the container; vLLM, vllm-ascend, torch, torch-npu, Triton versions and the
interpreter on the host). A change of any of them is another key, so a cache is never used across versions;
`retention` removes the least recently used keys beyond `keep` and beyond the size cap, never one in use.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from nodeagent.render.launch import LaunchSpec

CACHE_VARS: dict[str, str] = {
    "VLLM_CACHE_ROOT": "vllm",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "ASCEND_CACHE_PATH": "ascend-cache",
    "ASCEND_WORK_PATH": "ascend-work",
    "TORCHAIR_CACHE_HOME": "torchair",
}
"""Each cache's variable → its subfolder of the key's folder. VLLM_CACHE_ROOT holds vLLM's torch.compile cache
(`torch_compile_cache/`; vLLM points inductor and Triton inside it while it compiles); TORCHINDUCTOR_CACHE_DIR
and TRITON_CACHE_DIR catch what compiles outside vLLM's own step; ASCEND_CACHE_PATH is CANN's shared operator
compile cache (`kernel_cache/`, by default `$HOME/atc_data`), ASCEND_WORK_PATH CANN's per-machine files;
TORCHAIR_CACHE_HOME is vllm-ascend's torchair graph cache (`.torchair_cache`, by default in the cwd)."""

HOST_DISTS = ("vllm", "vllm_ascend", "torch", "torch_npu", "triton", "triton_ascend")
"""The distributions whose versions make a host-mode key (whichever of them are installed)."""

_SAFE = re.compile(r"[^A-Za-z0-9_.+-]+")


def cache_key(parts: Mapping[str, str]) -> str:
    """The folder name of one software stack: readable head (vLLM's version, else the image's ID), then a hash
    of every part, so that any change is a new folder."""
    digest = hashlib.sha256(json.dumps(dict(parts), sort_keys=True).encode()).hexdigest()[:16]
    head = parts.get("vllm") or parts.get("image_id", "").removeprefix("sha256:")[:12] or "stack"
    return f"{_SAFE.sub('_', head)[:40]}-{digest}"


def host_parts(versions: Mapping[str, str | None], python: str) -> dict[str, str] | None:
    """A host-mode key's parts, or None when vLLM's version is unknown (no key: a cache that cannot be told apart
    from the next version's is not kept)."""
    if not versions.get("vllm"):
        return None
    return {"python": python, **{k: v for k, v in sorted(versions.items()) if v}}


def container_parts(image: str, image_id: str, setup_hash: str, versions: Mapping[str, str | None] | None
                    ) -> dict[str, str] | None:  # fmt: skip
    """A container's key parts: the image's ID (the name can be re-tagged), the setup list, and the versions of
    `HOST_DISTS` read inside the container after its setup (an unpinned `pip install -U` in the setup changes
    vLLM under the same image and list). None while the ID or the versions are unknown (`versions` None: not
    read yet; an empty mapping: read, nothing installed — a stand-in image)."""
    if not image_id or versions is None:
        return None
    return {"image": image, "image_id": image_id, "setup": setup_hash, **{k: v for k, v in sorted(versions.items())
                                                                          if v}}  # fmt: skip


VERSIONS_SCRIPT = (
    "import json\nfrom importlib import metadata\nout = {}\n"
    f"for name in {HOST_DISTS!r}:\n"
    "    try:\n        out[name] = metadata.version(name)\n"
    "    except metadata.PackageNotFoundError:\n        out[name] = None\n"
    "print(json.dumps(out))\n"
)
"""Run inside the container by the rank's own interpreter: the versions of `HOST_DISTS` it imports, as JSON."""

VERSIONS_SH = ('case "${1##*/}" in python*) p=$1 ;; *) c=$(command -v "$1") || exit 127; IFS= read -r l < "$c"; '
               'case "$l" in "#!"*python*) p=${l#??} ;; *) p=python3 ;; esac ;; esac; exec $p -c "$2"')
"""`sh -c VERSIONS_SH sh COMMAND SCRIPT`: SCRIPT run by the interpreter of COMMAND (the rank's argv[0]: a console
script's shebang, a python itself, else the image's python3) — the venv a bind-mounted vLLM runs from, not the
image's own Python."""


def versions_argv(command: str) -> list[str]:
    return ["sh", "-c", VERSIONS_SH, "sh", command, VERSIONS_SCRIPT]


def parse_versions(text: str) -> dict[str, str | None]:
    """`VERSIONS_SCRIPT`'s answer (its last line); ValueError naming what is wrong with anything else."""
    lines = text.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict) or not all(isinstance(v, str | None) for v in data.values()):
        raise ValueError(f"not a JSON object of versions: {text.strip()[-200:]!r}")
    return {str(k): v for k, v in data.items() if k in HOST_DISTS}


def cache_env(folder: Path) -> dict[str, str]:
    return {var: str(folder / sub) for var, sub in CACHE_VARS.items()}


def reload_env(parts: Mapping[str, str] | None) -> dict[str, str]:
    """What makes the kept cache reload for this stack. A CPU build of vLLM (version `+cpu`; 0.32 read) compiles
    with plain inductor (its platform sets DYNAMO_TRACE_ONCE), and its AOT compile cache, on by default since
    torch 2.10, is written on every start but never read back: the loader calls `finalize_loading` on what it
    unpickled, which only the VLLM_COMPILE mode's artifact has (decorators.py `_try_load_aot_compiled_fn`:
    "Compiling model again due to a load failure ... 'function' object has no attribute 'finalize_loading'"). With
    VLLM_USE_AOT_COMPILE=0 it compiles through torch's own inductor/AOTAutograd caches, which do reload. Nothing
    for other builds (vllm-ascend compiles in VLLM_COMPILE mode) or an unknown version."""
    if parts is not None and "+cpu" in parts.get("vllm", ""):
        return {"VLLM_USE_AOT_COMPILE": "0"}
    return {}


def with_caches(spec: LaunchSpec, folder: Path, parts: Mapping[str, str] | None = None) -> LaunchSpec:
    """The launch with the cache variables set (and what makes `parts`' stack reload them), except those its
    config sets or unsets itself (the operator's wins)."""
    ours = {**cache_env(folder), **reload_env(parts)}
    env = {**{k: v for k, v in ours.items() if k not in spec.env and k not in spec.unset}, **spec.env}
    return replace(spec, env=env)


@dataclass(frozen=True)
class CacheEntry:
    key: str
    size: int
    last_used: float


def retention(entries: Sequence[CacheEntry], in_use: set[str], keep: int, max_bytes: int) -> list[str]:
    """The keys to remove: the least recently used beyond `keep`, then more of them while the total is over
    `max_bytes`; a key in use (a running rank's, the one starting) is never removed."""
    order = sorted(entries, key=lambda e: e.last_used, reverse=True)
    kept = [e for e in order if e.key in in_use]
    for entry in order:
        if entry.key not in in_use and len(kept) < keep:
            kept.append(entry)
    gone = [e for e in order if e not in kept]
    total = sum(e.size for e in kept)
    for entry in sorted((e for e in kept if e.key not in in_use), key=lambda e: e.last_used):
        if total <= max_bytes:
            break
        gone.append(entry)
        total -= entry.size
    return [e.key for e in gone]

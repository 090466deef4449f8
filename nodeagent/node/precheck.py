"""What must exist before a component is worth launching: its command, and the files its config names.

Checked before every start. A miss is a permanent failure (see failure.py): no launch, no residue cleanup of
healthy neighbours, no node redeploy — a clear `failed: model path ... does not exist` instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def looks_like_path(value: str) -> bool:
    """vLLM takes a local folder or a hub repo id (`org/name`); only the former can be checked here."""
    return value.startswith(("/", "./", "../", "~"))


def required_files(comp: Any) -> list[tuple[str, Path]]:
    """(what, path) pairs a component's config says must exist."""
    needed: list[tuple[str, Path]] = []
    model = getattr(comp, "model", None)
    if isinstance(model, str) and looks_like_path(model):
        needed.append(("model path", Path(os.path.expanduser(model))))
    script = getattr(comp, "script", None)
    if script is not None:
        needed.append(("script", Path(script)))
    return needed


def find_command(program: str, path_env: str) -> str | None:
    if "/" in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    return shutil.which(program, path=path_env)


def missing_prerequisite(comp: Any, env: Mapping[str, str]) -> str | None:
    """Why this component cannot start at all, or None."""
    program = comp.command[0]
    if find_command(program, env.get("PATH", "")) is None:
        return f"command not found: {program} (PATH={env.get('PATH', '')})"
    for what, path in required_files(comp):
        if not path.exists():
            return f"{what} {path} does not exist"
    return None

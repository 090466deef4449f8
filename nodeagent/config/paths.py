"""Config paths: relative ones resolve against the config file's folder (`config_base.base_dir()`).

Apart from `config_model` so that `config_cluster` (which `config_model` imports) can use them too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from nodeagent.config.base import Check, base_dir
from nodeagent.config.raw import resolve_path as resolve_against


def resolve_path(value: Path) -> Path:
    return resolve_against(Path(value), base_dir())


def _readable_file(value: Path) -> Path:
    value = resolve_path(value)
    if not value.is_file():
        raise ValueError(f"no such file: {value}")
    return value


ConfigPath = Annotated[Path, Check(resolve_path)]
ReadableFile = Annotated[Path, Check(_readable_file)]


def _resolve_command(value: str | list[str]) -> list[str]:
    """A command is a program name, a path, or a list; a relative path with a slash is config-relative."""
    argv = [value] if isinstance(value, str) else list(value)
    if not argv or not argv[0]:
        raise ValueError("command must name a program")
    program = argv[0]
    if "/" in program and not os.path.isabs(os.path.expanduser(program)):
        argv[0] = str(resolve_path(Path(program)))
    elif program.startswith("~"):
        argv[0] = os.path.expanduser(program)
    return argv


Command = Annotated[str | list[str], Check(_resolve_command)]
"""Written as a string or a list; always a list (argv) once validated."""

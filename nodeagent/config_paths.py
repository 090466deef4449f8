"""Config paths: relative ones resolve against the config file's folder (validation context `base_dir`).

Apart from `config_model` so that `config_cluster` (which `config_model` imports) can use them too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, ValidationInfo

from nodeagent.config_raw import resolve_path as resolve_against


def resolve_path(value: Path, info: ValidationInfo) -> Path:
    return resolve_against(value, (info.context or {}).get("base_dir"))


def _readable_file(value: Path) -> Path:
    if not value.is_file():
        raise ValueError(f"no such file: {value}")
    return value


ConfigPath = Annotated[Path, AfterValidator(resolve_path)]
ReadableFile = Annotated[ConfigPath, AfterValidator(_readable_file)]


def _resolve_command(value: str | list[str], info: ValidationInfo) -> list[str]:
    """A command is a program name, a path, or a list; a relative path with a slash is config-relative."""
    argv = [value] if isinstance(value, str) else list(value)
    if not argv or not argv[0]:
        raise ValueError("command must name a program")
    program = argv[0]
    if "/" in program and not os.path.isabs(os.path.expanduser(program)):
        argv[0] = str(resolve_path(Path(program), info))
    elif program.startswith("~"):
        argv[0] = os.path.expanduser(program)
    return argv


Command = Annotated[str | list[str], AfterValidator(_resolve_command)]

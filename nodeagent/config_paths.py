"""Config paths: relative ones resolve against the config file's folder (validation context `base_dir`).

Apart from `config_model` so that `config_cluster` (which `config_model` imports) can use them too."""

from __future__ import annotations

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

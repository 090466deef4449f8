"""Config paths: relative ones resolve against the config file's folder (validation context `base_dir`).

Apart from `config_model` so that `config_cluster` (which `config_model` imports) can use them too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, ValidationInfo


def resolve_path(value: Path, info: ValidationInfo) -> Path:
    value = value.expanduser()
    base = (info.context or {}).get("base_dir")
    if not value.is_absolute() and base is not None:
        value = Path(base) / value
    return Path(os.path.normpath(value))


def _readable_file(value: Path) -> Path:
    if not value.is_file():
        raise ValueError(f"no such file: {value}")
    return value


ConfigPath = Annotated[Path, AfterValidator(resolve_path)]
ReadableFile = Annotated[ConfigPath, AfterValidator(_readable_file)]

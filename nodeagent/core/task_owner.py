"""Background work with an owner: a task's death is logged, an observer's exception never travels.

Without an owner that looks, a background task that raised dies silently (`asyncio` only complains when the task
is collected), and one raising observer would stop the loop that tells it and the observers after it (issue 29)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from loguru import logger


def log_death(task: asyncio.Future[Any]) -> None:
    """A done-callback: a background task that ended by an exception is logged with its traceback (without an
    owner that looks, its death would be silent — `asyncio` only complains when the task is collected)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
        logger.opt(exception=exc).error(f"background task {name} died: {type(exc).__name__}: {exc}")


def guarded(what: str, callback: Callable[..., Any], *args: Any) -> bool:
    """Call an observer; its exception is logged, never raised — one raising observer must not stop the loop that
    tells it, nor the observers after it. Whether it returned."""
    try:
        callback(*args)
    except Exception:
        logger.exception(f"{what} raised; ignored")
        return False
    return True

"""In-process event bus: every state change and action becomes one event, logged and fanned out.

Subscribers (the API's SSE stream, later MQTT) get their own bounded queue; a slow subscriber loses its oldest
events rather than slowing the supervisor. A bounded replay buffer serves late subscribers.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

_LEVELS = {"info": "INFO", "warning": "WARNING", "error": "ERROR", "critical": "CRITICAL"}


@dataclass(frozen=True)
class Event:
    seq: int
    ts: float
    event: str
    message: str
    component: str | None = None
    level: str = "info"
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq, "ts": self.ts, "event": self.event, "component": self.component,
            "level": self.level, "message": self.message, **({"data": self.data} if self.data else {}),
        }  # fmt: skip


class EventBus:
    def __init__(self, replay: int = 500, queue_size: int = 1000) -> None:
        self._seq = itertools.count(1)
        self.recent: deque[Event] = deque(maxlen=replay)
        self._subscribers: set[asyncio.Queue[Event]] = set()
        self._queue_size = queue_size

    def emit(self, event: str, message: str, component: str | None = None, level: str = "info",
             **data: Any) -> Event:
        ev = Event(next(self._seq), time.time(), event, message, component, level, data)
        self.recent.append(ev)
        log = logger.bind(component=component, event=event) if component else logger.bind(event=event)
        log.opt(depth=1).log(_LEVELS.get(level, "INFO"), (f"[{component}] " if component else "") + message)
        for queue in self._subscribers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(ev)
        return ev

    def subscribe(self) -> asyncio.Queue[Event]:
        queue: asyncio.Queue[Event] = asyncio.Queue(self._queue_size)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Event]) -> None:
        self._subscribers.discard(queue)

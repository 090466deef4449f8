"""In-process event bus: every state change and action becomes one event, logged and fanned out.

Subscribers (the API's SSE stream, MQTT) get their own bounded queue; a slow subscriber loses its oldest
events rather than slowing the supervisor. A bounded replay buffer serves late subscribers. With a `seq_path`
the sequence number carries on across agent restarts, so a subscriber that sees a gap knows it missed events.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
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


SEQ_JUMP_AFTER_CRASH = 1_000_000
"""How far the count skips ahead when the machine went down while the agent ran (the unsynced tail is lost)."""
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class SavedSeq:
    last: int
    boot_id: str
    clean: bool
    """The agent stopped in order (and synced the file) after writing `last`."""

    def record(self) -> bytes:
        """Fixed width, so rewriting it in place at offset 0 never leaves a longer old record's tail behind."""
        return f"{self.last:020d} {self.boot_id:<36.36} {int(self.clean)}\n".encode()

    @classmethod
    def parse(cls, raw: bytes) -> SavedSeq:
        last, boot_id, clean = raw.decode("ascii").split()
        if clean not in ("0", "1") or int(last) < 0:
            raise ValueError(f"bad record {raw[:80]!r}")
        return cls(int(last), boot_id, clean == "1")


def resume_seq(saved: SavedSeq | None, boot_id: str) -> tuple[int, str | None]:
    """The first number to use, and why numbers were skipped (None when the count simply carries on).

    Within one boot the page cache holds every write, even after a kill -9 of the agent; after a clean stop
    the file was synced. Only a machine crash while the agent ran can have lost the tail: then skip ahead, so
    a number is never reused and the subscriber sees a gap.
    """
    if saved is None:
        return 1, None
    if saved.clean or saved.boot_id == boot_id:
        return saved.last + 1, None
    return saved.last + SEQ_JUMP_AFTER_CRASH, (
        f"the machine went down while the agent ran: event numbers {saved.last + 1}-"
        f"{saved.last + SEQ_JUMP_AFTER_CRASH - 1} are skipped (events after {saved.last} may be lost)"
    )


def current_boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip() or "-"
    except OSError:
        return "-"


class SeqFile:
    """The last event number on disk: one pwrite per event and no fsync (cheap on the supervisor's hot path).

    Synced twice per agent run: when the count resumes (so a crash is recognised as unclean) and in `close()`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.boot_id = current_boot_id()
        self._fd: int | None = None
        self._unclean_on_disk = False
        """The full record with this boot's id and clean=0 is in the file: from then on only the digits change."""
        self.broken: str | None = None

    def load(self) -> tuple[int, str | None]:
        """The first number to use (see `resume_seq`); a missing file starts at 1, an unreadable one too (said)."""
        try:
            saved = SavedSeq.parse(self.path.read_bytes())
        except FileNotFoundError:
            return resume_seq(None, self.boot_id)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            return 1, f"{self.path} unreadable ({exc}): event numbers start again at 1"
        return resume_seq(saved, self.boot_id)

    def write(self, last: int, clean: bool = False, sync: bool = False) -> None:
        if self.broken is not None:
            return
        try:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if self._unclean_on_disk and not clean:
                os.pwrite(self._fd, b"%020d" % last, 0)  # the hot path: 20 bytes in the page cache
            else:
                os.pwrite(self._fd, SavedSeq(last, self.boot_id, clean).record(), 0)
                self._unclean_on_disk = not clean
            if sync:
                os.fsync(self._fd)
        except OSError as exc:
            self.broken = str(exc)
            logger.error(f"cannot persist the event sequence number in {self.path}: {exc}; "
                         "numbers restart at the next agent start")  # fmt: skip

    def close(self, last: int) -> None:
        self.write(last, clean=True, sync=True)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            self._unclean_on_disk = False


class EventBus:
    def __init__(self, replay: int = 500, queue_size: int = 1000, seq_path: Path | None = None) -> None:
        self._last: int | None = None if seq_path is not None else 0
        self._seq_file = SeqFile(seq_path) if seq_path is not None else None
        self.recent: deque[Event] = deque(maxlen=replay)
        self._subscribers: set[asyncio.Queue[Event]] = set()
        self._queue_size = queue_size

    @property
    def last_seq(self) -> int:
        return self._last or 0

    def _next_seq(self) -> int:
        if self._last is None:  # first event: resume the persisted count (lazily, so __init__ touches no disk)
            assert self._seq_file is not None
            first, why = self._seq_file.load()
            self._last = first - 1
            self._seq_file.write(self._last, sync=True)
            if why:
                self.emit("seq_discontinuity", why, None, "warning")
        self._last += 1
        if self._seq_file is not None:
            self._seq_file.write(self._last)
        return self._last

    def close(self) -> None:
        """At a clean agent exit: the file is synced and marked clean (a later emit reopens it, unclean)."""
        if self._seq_file is not None and self._last is not None:
            self._seq_file.close(self._last)

    def emit(self, event: str, message: str, component: str | None = None, level: str = "info",
             **data: Any) -> Event:
        ev = Event(self._next_seq(), time.time(), event, message, component, level, data)
        self.recent.append(ev)
        log = logger.bind(component=component, event=event) if component else logger.bind(event=event)
        log.opt(depth=1).log(_LEVELS.get(level, "INFO"), message)  # the sink adds the [component] tag
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

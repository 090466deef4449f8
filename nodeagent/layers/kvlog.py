"""KV transfer failures of this node's PD ranks, read from their logs (issue 19 item 6; the lines and the rules
are `kvtimeouts`). Each failure is counted for (this rank's group, the peer's group) and the recent ones are
published in /status → the member record (`kv_transfers: [[time, engine, peer], ...]`), where the PD proxy's
node sums them per pair (`cluster/pd_watch.py`) and restarts the side that fails with every peer.

Reads what the agent captures of each rank's output (`logsink.transfer_lines`): its log file
(`log_dir/<component>.log`), or under journald (systemd) the log relay's copy of the failure lines it passed on
(`<state>/components/<component>/kv_failures.log`) — the same lines, counted the same way; the journal itself is
never read.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from nodeagent.config.layout import cluster_layout, layout_resolver
from nodeagent.core import logsink
from nodeagent.render.launch import component_dir
from nodeagent.seam.host import Clock
from nodeagent.seam.stackport import MemberReport, ReportLayer
from nodeagent.vllm.kv_transfer import TransferTimeouts

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.seam.stackport import StackPort

PERIOD_S = 2.0
PUBLISHED = 200


class KvTransferLog(ReportLayer):
    """A `NodeLayer` that only reports: it follows the PD ranks' logs and adds `kv_transfers` to /status."""

    def __init__(self, config: Config, port: StackPort, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        layout = cluster_layout(config)
        kinds = {g.name: g.kind for g in layout.groups if g.kind in ("prefill", "decode")}
        rc = config.recovery.pd
        self.counter = TransferTimeouts(kinds, threshold=rc.transfer_threshold, window_s=rc.transfer_window_s)
        self.resolve = layout_resolver(layout)
        mine = [g for g in layout.groups if g.name in kinds and config.node.name in g.nodes]
        self.engines = {c: g.name for g in mine for c in g.components(config.node.name)
                        if c in config.active_components()}  # fmt: skip
        self.offsets: dict[str, int] = {}
        self.port = port

    @property
    def config(self) -> Config:
        """The node's config now, through the port: a reload reaches it (`stackport.StackPort.config`)."""
        return self.port.config

    def feed(self, component: str, lines: list[str]) -> None:
        engine = self.engines.get(component)
        if engine is None:
            return
        for line in lines:
            self.counter.record(engine, line, self.clock.time(), self.resolve)

    def read_new(self, component: str) -> list[str]:
        path = logsink.transfer_lines(self.config.agent.log_dir, component_dir(self.config, component), component)
        try:
            size = path.stat().st_size
        except OSError:
            self.offsets[component] = 0  # not written yet: all it will hold is new
            return []
        start = self.offsets.get(component, size)  # from now on: what was logged before is history
        if size < start:
            start = 0  # rotated (copytruncate)
        self.offsets[component] = size
        if size == start:
            return []
        with path.open("rb") as f:
            f.seek(start)
            return f.read(size - start).decode(errors="replace").splitlines()

    async def run(self) -> None:
        if not self.engines:
            return
        while True:
            for component in self.engines:
                with contextlib.suppress(OSError):
                    self.feed(component, await asyncio.to_thread(self.read_new, component))
            await self.clock.sleep(PERIOD_S)

    def status_section(self) -> dict[str, Any]:
        return {"kv_transfers": self.recent()}

    def member_report(self) -> MemberReport:
        return MemberReport(kv_transfers=self.recent())

    def recent(self) -> list[list[Any]]:
        """The last `PUBLISHED` failures in the window, `[time, engine, peer]` each."""
        self.counter.pair_counts(self.clock.time())  # trims the window
        return [[round(t, 3), e, p] for t, e, p in list(self.counter.events)[-PUBLISHED:]]


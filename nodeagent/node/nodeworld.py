"""Where the node touches the world: processes (spawn, watch their exit, adopt, stop whole trees, the process
table), residue, the checks before a start, vLLM's in-flight requests and the cluster's etcd.

The supervisor does all of it through `NodeWorld`, given by the composition root (`agent.py`); `HostWorld`, the
default, is the host (each method is the one call the supervisor made directly before). Why a seam: the whole-
cluster simulation (`tests/sim_node.py`) runs the real `Supervisor`/`Component` — restart policy, failure path,
blast radius, pause — over simulated processes, so a bug in the node's own rules is found without a process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.core.process import ExitWatch, ProcessRecord, record_of, stop_tree, verify
from nodeagent.node import launcher, residue
from nodeagent.node.precheck import missing_prerequisite
from nodeagent.probes.kinds import ProbeContext, check_etcd
from nodeagent.probes.tree_watch import watch_tree
from nodeagent.vllm.endpoints import vllm_inflight

if TYPE_CHECKING:
    from nodeagent.node.residue import ActionOutcome
    from nodeagent.node.residue_plan import ResiduePlan
    from nodeagent.render.launch import LaunchSpec


class Watch(Protocol):
    """A process's exit watch: `done` resolves with its exit code (None: not our child); `close` stops watching."""

    done: asyncio.Future[int | None]

    def close(self) -> None: ...


class NodeWorld(Protocol):
    """What the node does to the host, and reads of it."""

    def missing_prerequisite(self, cfg: Any, env: Mapping[str, str]) -> str | None: ...

    async def clean(self, plan: ResiduePlan) -> list[ActionOutcome]: ...

    async def launch(self, spec: LaunchSpec, log_dir: Path, base_env: Mapping[str, str], capture_dir: Path,
                     timeout_s: float, scope: str | None,
                     tail_file: Path | None) -> tuple[launcher.Launched, Watch]: ...  # fmt: skip

    def adopt(self, record: ProcessRecord) -> Watch:
        """Watch a process a previous agent started; AdoptError when it is not the recorded one."""

    async def stop_tree(self, record: ProcessRecord, grace_s: float, what: str,
                        member: Callable[[int], bool] | None) -> dict[str, Any]: ...  # fmt: skip

    def record_of(self, pid: int) -> ProcessRecord: ...

    def watch_tree(self, record: ProcessRecord, still_ours: Callable[[], bool],
                   on_problem: Callable[[str], None]) -> Coroutine[Any, Any, None]: ...  # fmt: skip

    async def inflight(self, ctx: ProbeContext, name: str, cfg: Any) -> tuple[int, int] | None: ...

    async def etcd_ok(self, ctx: ProbeContext, endpoint: str) -> bool: ...


class HostWorld:
    """The host itself: the calls the supervisor makes, unchanged."""

    def missing_prerequisite(self, cfg: Any, env: Mapping[str, str]) -> str | None:
        return missing_prerequisite(cfg, env)

    async def clean(self, plan: ResiduePlan) -> list[ActionOutcome]:
        return await residue.execute(plan)

    async def launch(self, spec: LaunchSpec, log_dir: Path, base_env: Mapping[str, str], capture_dir: Path,
                     timeout_s: float, scope: str | None,
                     tail_file: Path | None) -> tuple[launcher.Launched, Watch]:  # fmt: skip
        return await launcher.launch_watched(spec, log_dir, base_env, capture_dir, timeout_s, scope, tail_file)

    def adopt(self, record: ProcessRecord) -> Watch:
        verify(record)
        return ExitWatch(record.pid, None)

    async def stop_tree(self, record: ProcessRecord, grace_s: float, what: str,
                        member: Callable[[int], bool] | None) -> dict[str, Any]:  # fmt: skip
        return await stop_tree(record, grace_s, what, member)

    def record_of(self, pid: int) -> ProcessRecord:
        return record_of(pid)

    def watch_tree(self, record: ProcessRecord, still_ours: Callable[[], bool],
                   on_problem: Callable[[str], None]) -> Coroutine[Any, Any, None]:  # fmt: skip
        return watch_tree(record, still_ours, on_problem)

    async def inflight(self, ctx: ProbeContext, name: str, cfg: Any) -> tuple[int, int] | None:
        return await vllm_inflight(ctx.session(), name, cfg)

    async def etcd_ok(self, ctx: ProbeContext, endpoint: str) -> bool:
        ok = False
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                ok, _ = await check_etcd(ctx.session(), endpoint.removeprefix("http://"), False, None)
        return ok

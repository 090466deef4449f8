"""Where container mode touches the world: the host's facts, the engine's CLI, /proc (is the container's init alive,
is a PID one of its processes) and the launch/adoption of a component inside.

`ContainerMode` does all of it through `ContainerWorld`; `HostContainerWorld`, the default, is the host (each
method is the one call the mode made directly before). Why a seam: the whole-cluster simulation
(`tests/sim_container.py`) runs the real `ContainerMode` — plan, death watch, recreate, the gate of the components
inside — over a simulated engine, so its rules meet the node's faults without a container engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.container.engine import ContainerEngine, in_container, init_alive
from nodeagent.container.exec import InsideWatch, adopt_inside, launch_inside
from nodeagent.container.render import ContainerSpec, host_facts

if TYPE_CHECKING:
    from nodeagent.container.host import HostFacts
    from nodeagent.core.process import ProcessRecord
    from nodeagent.node.launcher import Launched
    from nodeagent.node.nodeworld import Watch
    from nodeagent.render.launch import LaunchSpec


class ContainerWorld(Protocol):
    """What container mode does to the host, and reads of it."""

    def facts(self, config: Any) -> HostFacts: ...

    def engine(self, spec: ContainerSpec) -> ContainerEngine: ...

    def init_alive(self, pid: int | None) -> bool: ...

    def in_container(self, container_id: str, pid: int) -> bool: ...

    async def launch(self, spec: LaunchSpec, container: ContainerSpec, container_id: str, log_dir: Path,
                     base_env: Mapping[str, str], capture_dir: Path, timeout_s: float, scope: str | None,
                     tail_file: Path | None, client_lost: Callable[[int], None]) -> tuple[Launched, Watch]:
        """Start the component inside; `client_lost(client_pid)` when the exec client dies before it."""

    def adopt(self, record: ProcessRecord, container_id: str) -> Watch:
        """Watch a process of the container a previous agent started; AdoptError when it is not that one."""


class HostContainerWorld:
    """The host itself: the engine's CLI, /proc, the exec client."""

    def facts(self, config: Any) -> HostFacts:
        return host_facts(config)

    def engine(self, spec: ContainerSpec) -> ContainerEngine:
        return ContainerEngine(spec)

    def init_alive(self, pid: int | None) -> bool:
        return init_alive(pid)

    def in_container(self, container_id: str, pid: int) -> bool:
        return in_container(container_id, pid)

    async def launch(self, spec: LaunchSpec, container: ContainerSpec, container_id: str, log_dir: Path,
                     base_env: Mapping[str, str], capture_dir: Path, timeout_s: float, scope: str | None,
                     tail_file: Path | None, client_lost: Callable[[int], None]) -> tuple[Launched, Watch]:
        launched, client = await launch_inside(spec, container, container_id, log_dir, base_env, capture_dir,
                                               timeout_s, scope, tail_file)  # fmt: skip
        return launched, InsideWatch(launched.record.pid, client, client_lost)

    def adopt(self, record: ProcessRecord, container_id: str) -> Watch:
        adopt_inside(record, container_id)
        return InsideWatch(record.pid, None)

"""`systemctl reload` (and a rollout's staging): take a new config without an agent restart.

A component restarts only when what it launches changed (its rendered argv, env, cwd or files: the launch
fingerprint); one down by a failure or held by a foreign process starts at once when the reload changes what it
launches (the operator's fix); the node's container, when its run line, image or setup changed, is recreated as at
a start (a planned recreate: drained, the stack inside stopped, recreated, set up, started). What a running agent
cannot take (components added or removed, container mode switched, a component moved into or out of the container)
is refused before anything changes: the stack keeps running on the old config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from nodeagent.core.states import State
from nodeagent.node.vllm_install import launch_spec
from nodeagent.render.launch import launch_fingerprint
from nodeagent.seam.stackport import HoldKind

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.core.events import EventBus
    from nodeagent.node.component import Component


class Reloadable(Protocol):
    """What a reload touches of the supervisor (which imports this module)."""

    config: Config
    components: dict[str, Component]
    container: Any
    """The node's `ContainerMode`, or None on the host."""
    events: EventBus

    @property
    def base_env(self) -> Mapping[str, str]: ...

    @property
    def trackers(self) -> dict[str, Any]: ...

    def begin_stack_run(self, names: Any = None) -> list[str]: ...


def reload_config(sup: Reloadable, config: Config, restart: bool = True) -> dict[str, list[str]]:
    """restart=False (a rollout's staging): every component's next start uses the config, none restarts now, and
    the container is left as it is (the rollout's generation restarts the ranks, not the container) — unless it
    has not started yet: an agent restarted mid-rollout stages its group's config before its container starts,
    and the container must then be kept (or made) as that config says, not as the file on disk does."""
    old_names, new_names = set(sup.components), set(config.active_components())
    if old_names != new_names:
        raise ValueError(f"reload cannot add or remove components ({', '.join(sorted(old_names ^ new_names))}): "
                         "restart the agent (nodeagentctl detach + systemctl restart keeps the stack running)")
    if (config.container is None) != (sup.container is None):
        raise ValueError("reload cannot switch container mode on or off: restart the agent")
    container = sup.container
    recreate = container.reconfigure(config, apply=restart or not container.started) if container else None
    old = {name: launch_fingerprint(launch_spec(name, sup.config, sup.base_env)) for name in sup.components}
    sup.config = config
    changed, started, unchanged = [], [], []
    for name, comp in sup.components.items():
        comp.reconfigure(config.components[name])
        sup.trackers[name].spec = comp.cfg.restart
        fingerprint = launch_fingerprint(launch_spec(name, config, sup.base_env))  # as its launch renders it
        if restart and comp.fingerprint is not None and fingerprint != comp.fingerprint and comp.record is not None:
            changed.append(name)
            comp.signal("restart", None, "config reload changed its command or environment", operator=True,
                        cause="reload")  # fmt: skip
        elif restart and fingerprint != old[name] and down_by_failure(comp):
            started.append(name)
            comp.signal("wake", None, "config reload changed its command or environment")
        else:
            unchanged.append(name)
    if restart:  # a component whose config section changed starts a new stack run (no crash loop carried over)
        sup.begin_stack_run()
    if recreate:
        sup.events.emit("reload", f"config reloaded: {recreate} of the container changed: a planned recreate")
    if restart:
        woken = f"; starting again (it was down by a failure or held): {', '.join(started)}" if started else ""
        sup.events.emit("reload", f"config reloaded; restarting: {', '.join(changed) or 'nothing'}{woken}")
    else:
        sup.events.emit("reload", "config staged: the next start of each component uses it")
    return {"restarted": changed, "started": started, "unchanged": unchanged,
            **({"container": [recreate]} if recreate else {})}


def down_by_failure(comp: Component) -> bool:
    """No process, because its last start or run failed (backoff, failed) or a foreign process holds its port or
    NPUs: a reload that changes its command is the operator's fix, so it starts with it at once — not after the
    backoff, and not never (a component held on a port the old config collided on waits for a holder that never
    goes: issue 29). A component stopped on purpose, paused or waiting for a gate is left as it is."""
    if comp.record is not None:
        return False
    held = comp.hold is not None and comp.hold.kind == HoldKind.FOREIGN_HOLDER
    return held or comp.state in (State.BACKOFF, State.FAILED)

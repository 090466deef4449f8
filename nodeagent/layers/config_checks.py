"""The config-level checks: what makes a loaded config unable to run on any host, as `key.path: problem` lines.

One list, shared by every door a config comes in through (`agent.load_checked`): `nodeagentctl config validate`
(exit 78), a reload (refused, nothing changed), a rollout's staging of a new file (the step refuses it) and
`dsv4-agent` at start (exit 78). Preflight reports the same findings (`ports_lint` runs the same
`portlint.collisions`, `huge_pages` the same RH2D rule). A host fact (a port someone else holds now, the
ephemeral range, memory) is not here: it can change without the file changing, so it stays preflight's. Nor is
a PYTHONHASHSEED override: that member must still join and be reported by its peers, its preflight holds its stack.

Why: issue 29 — vLLM's port set to the agent's own etcd port passed `config validate`, and the reload then
stopped vLLM for good ("port in use … not ours") while preflight had flagged the same file all along.
"""

from __future__ import annotations

from collections.abc import Mapping

from nodeagent.config.load import load_config
from nodeagent.config.model import Config, DatasystemComponent, VllmComponent
from nodeagent.core.errors import ConfigError
from nodeagent.layers.portlint import PortFinding, collisions, node_uses


def port_problems(config: Config, base_env: Mapping[str, str] | None = None) -> list[str]:
    """Two of this node's own listeners on one port (components, the agent's API, its etcd's client and peer
    ports, vLLM's handshake/ADXL/RPC ranges): `portlint`'s collisions, named by the keys that set them."""
    return [_port_line(f) for f in collisions(node_uses(config, base_env))]


def _port_line(finding: PortFinding) -> str:
    keys = [u.key or u.component for u in (finding.first, finding.second) if u is not None]
    return f"{' and '.join(dict.fromkeys(keys))}: {finding.message}"


def rh2d_problems(config: Config) -> list[str]:
    """RH2D (remote H2D) on without the datasystem worker's huge pages: the guide requires them (附录)."""
    active = config.active_components()
    workers = {n: c for n, c in active.items() if isinstance(c, DatasystemComponent)}
    if not workers or any(c.enable_huge_tlb for c in workers.values()):
        return []
    users = [f"components.{n}.remote_h2d_device_ids" for n, c in workers.items() if c.remote_h2d_device_ids]
    users += [f"components.{n}.remote_h2d" for n, c in active.items() if isinstance(c, VllmComponent) and c.remote_h2d]
    if not users:
        return []
    keys = ", ".join(f"components.{n}.enable_huge_tlb" for n in workers)
    return [f"{keys}: RH2D is on ({', '.join(users)}) but enable_huge_tlb is not: set it and configure huge "
            "pages (附录)"]


def config_problems(config: Config, base_env: Mapping[str, str] | None = None) -> list[str]:
    """Every config-level problem of this node's config; empty when it can run. Pure: `base_env` is the
    environment the components are rendered with (the agent's `launcher.base_environment()`)."""
    return [*port_problems(config, base_env), *rh2d_problems(config)]


def load_checked(path: str, node: str | None = None) -> Config:
    """The config, with residue paths vetted too: a path unsafe to delete is a config error; and the config-level
    checks (`config_checks`: two of our listeners on one port, ...) — every door a config comes in through calls
    this (validate, start, reload, a rollout's staging), so a file that cannot run is refused before anything
    changes."""
    from nodeagent.node.launcher import base_environment
    from nodeagent.node.pathsafety import validate_residue_paths

    config = load_config(path, node=node)
    problems = validate_residue_paths(config) + config_problems(config, base_environment())
    if problems:
        raise ConfigError("\n".join(f"{path}: {p}" for p in problems))
    return config

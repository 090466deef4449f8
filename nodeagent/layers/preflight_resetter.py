"""Preflight checks of issue 19 (apart from `preflight.py`, which imports them): who else resets chips here,
and the prefill side's abort timeout for KV a decoder never pulls."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nodeagent.config.model import Config

ABORT_TIMEOUT_VARS = ("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT")
"""How long a prefill instance keeps a finished request's KV for its decoder (vLLM's default 480 s; vllm-ascend
#13240: with a dead decoder the blocks stay taken that long and prefill runs out of NPU memory — the workaround
there is a smaller value)."""
ABORT_TIMEOUT_MAX_S = 480


def resetter_check(config: Config, who: Callable[[], str | None]) -> Iterable[tuple[str, str, str, str]]:
    """(name, status, value, hint): WARN when MindCluster's Container Manager (or the Device Plugin) runs here —
    the ladder then never resets a chip (both at once would fight), it only isolates."""
    if not config.recovery.npu_reset:
        yield ("npu_resetter", "SKIP", "chip resets are off (recovery.npu_reset: false)", "")
        return
    found = who()
    if found:
        yield ("npu_resetter", "WARN", f"{found} resets chips on this host: the agent will not (never both)",
               "leave it so, or stop it to let the agent's ladder reset chips (recovery.npu_reset)")
    else:
        yield ("npu_resetter", "PASS", "no other chip resetter (MindCluster Container Manager, Device Plugin) here", "")


def abort_timeout_check(config: Config, env_of: Callable[[str], dict[str, Any]]) -> Iterable[tuple[str, str, str, str]]:
    """WARN for a prefill (kv_producer) vLLM whose abort timeout is unset or above 480 s."""
    from nodeagent.config.layout import cluster_layout

    if not config.cluster.nodes:
        return
    layout = cluster_layout(config)
    node = config.node.name
    mine = [c for g in layout.groups if g.kind == "prefill" and node in g.nodes for c in g.components(node)]
    for name in mine:
        if name not in config.active_components():
            continue
        env = env_of(name)
        values = {v: env.get(v) for v in ABORT_TIMEOUT_VARS}
        set_ = {v: x for v, x in values.items() if x not in (None, "")}
        too_long = {v: x for v, x in set_.items() if not str(x).isdigit() or int(x) > ABORT_TIMEOUT_MAX_S}
        if not set_ or too_long:
            what = ", ".join(f"{v}={x}" for v, x in too_long.items()) or f"{ABORT_TIMEOUT_VARS[0]} unset"
            yield ("abort_timeout", "WARN", f"{name}: {what}: a dead decoder's KV stays on prefill that long "
                   "(vllm-ascend #13240)", f"set env {ABORT_TIMEOUT_VARS[0]}: \"{ABORT_TIMEOUT_MAX_S}\" or less on "
                   "the prefill groups; the agent also restarts a prefill group whose KV fills while decode is down")
        else:
            yield ("abort_timeout", "PASS", f"{name}: " + ", ".join(f"{v}={x}" for v, x in set_.items()), "")

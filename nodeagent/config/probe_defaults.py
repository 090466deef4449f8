"""Each kind's default probes, in YAML terms, and how a config overrides or extends them.

A role given as a mapping without `kind` (or with the default's kind) is merged onto the default, so
`probes: {liveness: {period_s: 5}}` tunes the default probe; a mapping of another kind or a list replaces it;
`null` disables the role. Values left null (URLs, paths, bodies) are derived from the component at run time.
"""

from __future__ import annotations

import copy
from typing import Any

DEFAULT_PROBES: dict[str, dict[str, list[dict[str, Any]]]] = {
    "etcd": {
        "startup": [{"kind": "etcd", "period_s": 1, "timeout_s": 2, "failure_threshold": 120}],
        "liveness": [{"kind": "etcd", "period_s": 5, "timeout_s": 3, "failure_threshold": 3}],
        "readiness": [],
    },
    "datasystem": {
        # dscli itself waits for probe/ready; the file only has to turn fresh and say success. Liveness allows
        # the guide's 30 s (yr_liveness_check.sh): a stall shorter than that must not cost the KV pool; a
        # stopped worker is still caught within 30 + 3 x 2 s.
        "startup": [{"kind": "liveness_file", "period_s": 1, "timeout_s": 2, "failure_threshold": 120}],
        "liveness": [
            {"kind": "liveness_file", "period_s": 2, "timeout_s": 2, "failure_threshold": 3, "max_age_s": 30}
        ],
        "readiness": [],
    },
    "vllm": {
        # /health answers 200 only once the engine is up; 720 x 5 s covers VLLM_ENGINE_READY_TIMEOUT_S=3600.
        "startup": [
            {"kind": "http_get", "path": "/health", "period_s": 5, "timeout_s": 5, "failure_threshold": 720}
        ],
        # /health does not see a hung engine, and a chat probe queues behind the work it checks: liveness
        # reads engine progress from /metrics under load and sends the guide's 2-token canary only when idle.
        # A scrape every 2.5 s: a hang under load fails once stall_after_s (20 s at 4096 batched tokens: 5 x
        # the longest healthy step, vllm/progress.py) passes without progress, <= 22.5 s after the hang; an idle
        # hang after 3 canaries of 4 s, 5 s apart (a 4 s canary ends before the next-but-one tick: one of 5 s
        # would skip to the third, 7.5 s apart), so <= 2.5 + 2 x 5 + 4 = 16.5 s.
        # See docs/operations.md (the detection budget) and docs/performance.md (bench/liveness.py).
        "liveness": [{"kind": "vllm_progress", "period_s": 2.5, "timeout_s": 4, "failure_threshold": 3}],
        "readiness": [{"kind": "http", "period_s": 10, "timeout_s": 60, "failure_threshold": 1}],
    },
    "process": {"startup": [], "liveness": [], "readiness": []},
    "proxy": {
        "startup": [
            {"kind": "http_get", "path": "/healthcheck", "period_s": 1, "timeout_s": 2, "failure_threshold": 120}
        ],
        # /healthcheck answers without looking at the backends: it only shows the proxy's own loop is alive, and
        # restarting the proxy cannot heal a backend, so liveness stays there. Readiness is a real request through
        # the proxy to a prefill and a decode instance: the cluster serves.
        "liveness": [
            {"kind": "http_get", "path": "/healthcheck", "period_s": 10, "timeout_s": 5, "failure_threshold": 3}
        ],
        "readiness": [{"kind": "http", "period_s": 10, "timeout_s": 60, "failure_threshold": 1}],
    },
}

HEADLESS_VLLM_PROBES: dict[str, list[dict[str, Any]]] = {"startup": [], "liveness": [], "readiness": []}
"""A headless vLLM node (internal DP launch, not the group's head) serves no HTTP: its defaults are "process
alive" only. Engine progress of the whole group — these ranks included — comes from the head's probes (its
chat completion runs on the engines of the whole group) and the gang restart (a rank's death breaks the group)."""

ROLES = ("startup", "liveness", "readiness")

HOST_PROBES: dict[str, dict[str, Any]] = {
    # The node's NPUs and RoCE links (node.npu_health), watched whatever runs: a vLLM start is held while a
    # fault holds. One `npu-smi info` and one `hccn_tool -link` per device each period; ECC and net health
    # every 6th poll (a minute).
    "npu": {"kind": "npu", "period_s": 10, "timeout_s": 30, "failure_threshold": 1, "detail_every": 6},
}


def default_probes(kind: str) -> dict[str, list[dict[str, Any]]]:
    return copy.deepcopy(DEFAULT_PROBES.get(kind, {role: [] for role in ROLES}))


def merge_probe_overrides(kind: str, overrides: Any) -> Any:
    """Defaults of `kind` with the config's `probes:` mapping applied; non-mappings pass to validation."""
    merged: dict[str, Any] = dict(default_probes(kind))
    if overrides is None:
        return merged
    if not isinstance(overrides, dict):
        return overrides
    for role, value in overrides.items():
        defaults = merged.get(role, [])
        if value is None:
            merged[role] = []
        elif isinstance(value, dict):
            same_kind = "kind" not in value or (len(defaults) == 1 and value["kind"] == defaults[0]["kind"])
            merged[role] = [{**defaults[0], **value}] if same_kind and len(defaults) == 1 else [value]
        else:
            merged[role] = value
    return merged

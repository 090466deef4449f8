"""Pure: which cluster file each group's ranks run, from the member records — what an incompatible rollout routes
the proxy by (`rules.kept_apart`), rather than by where its steps stood: a step left mid-way (its way back failed, an
operator's rollback around it) says "either file" for good, while the ranks run one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nodeagent.config.layout import Group

Runs = Mapping[str, frozenset[str]]
"""group → the cluster files (`cluster_file_hash`) its ranks run or start with next."""


def group_runs(groups: Iterable[Group], members: Mapping[str, Mapping[str, Any]]) -> dict[str, frozenset[str]]:
    """group → the files its ranks run: a rank with a process, the file its member says it was launched with
    (`file`); one without, its member's config (`cluster_hash`), which its next start takes. A group with a rank
    nobody vouches for (no member record, a process whose agent did not publish its file) is left out: the rollout
    record decides for it."""
    out: dict[str, frozenset[str]] = {}
    for group in groups:
        files: set[str] = set()
        for proc in group.processes:
            record = members.get(proc.node)
            comp = ((record or {}).get("components") or {}).get(proc.component) or {}
            file = comp.get("file") if comp.get("pid") is not None else (record or {}).get("cluster_hash")
            if not file:
                break
            files.add(str(file))
        else:
            out[group.name] = frozenset(files)
    return out

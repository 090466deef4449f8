"""The node-wide states an operator must see before anything else, one line each, from `/status`: the node
isolated (the ladder's last rung) and a chip reset under way or failed; and, in container mode, the line of the
node's container. `nodeagentctl status` prints them under
its first line, the status page's first paint in its header (ui.js's `nodeAlerts` writes the same lines live).

Plain dicts in, strings out: the status CLI imports it, and must stay light.
"""

from __future__ import annotations

from typing import Any


def node_alerts(status: dict[str, Any]) -> list[str]:
    lines = []
    if status.get("isolated"):
        lines.append(f"ISOLATED: {status['isolated']} — its NPU users stay stopped until `nodeagentctl uncordon`")
    rung = (status.get("recovery") or {}).get("rung") or {}
    if rung:
        chips = ", ".join(str(c) for c in rung.get("chips") or [])
        on = f" of npu {chips}" if chips else ""
        if rung.get("step") == "failed":
            lines.append(f"CHIP RESET FAILED{on}: {rung.get('why')} — the NPU users stay stopped; the ladder "
                         "judges again after its pause (another reset, or isolation)")  # fmt: skip
        else:
            lines.append(f"CHIP RESET IN PROGRESS{on} (step {rung.get('step')}): {rung.get('why')} — every NPU "
                         "user here is stopped, its groups drained")  # fmt: skip
    return lines


def container_line(box: dict[str, Any]) -> str:
    """`container ds_v4_flash_yr (docker, quay.io/...) 4a496e83c8a2 up since ...` or why it is not up."""
    text = f"container {box.get('name')} ({box.get('engine')}, {box.get('image')})"
    if box.get("up"):
        text += f" {box.get('id')} up since {box.get('up_since')}"
    else:
        text += f" NOT UP: {box.get('held')}"
    if box.get("deaths"):
        text += f" · died {box['deaths']}x, last: {(box.get('last_death') or {}).get('detail')}"
    return text

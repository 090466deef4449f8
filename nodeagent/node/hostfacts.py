"""The one facade through which preflight reads the host: files under a root, PATH, a few commands, psutil.

Tests point it at fixture trees (`root=` a folder holding proc/meminfo, usr/local/Ascend/..., etc/...), at a bin
folder of fake executables (`path=`), or override a method in a subclass; nothing else in preflight touches the
system. Every read returns None (or empty) when the thing is absent: absence is a finding, not an exception.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.core.run import RunTimeout, run_blocking
from nodeagent.npu.tools import HCCN_TOOL_DEFAULT, NPU_SMI_DEFAULT, NpuSnapshot, NpuTools, locate_tool

IMPORT_TIMEOUT_S = 60.0
"""`import yr.datasystem` in a cold interpreter on a busy node can take seconds."""
ASCEND_ROOT = "/usr/local/Ascend"
ASCEND_INSTALL_INFO = "/etc/ascend_install.info"
"""The driver's install record (the guide mounts it into the container); Driver_Install_Path_Param= names
where the driver went, if not under /usr/local/Ascend."""


def parse_key_values(text: str) -> dict[str, str]:
    """`key=value` lines (version.info, ascend_toolkit_install.info, ascend_install.info)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_version(text: str) -> tuple[tuple[int, int], ...] | None:
    """`25.2.3`, `24.1.rc2`, `8.0.RC3`, `7.0.T10` → comparable; a letter part (rc, T) is a pre-release,
    older than `.0` of the same release."""
    out = []
    for part in re.split(r"[.\-]", text.strip()):
        if part.isdigit():
            out.append((1, int(part)))
            continue
        match = re.fullmatch(r"([A-Za-z]+)(\d*)", part)
        if not match:
            return None
        out.append((0, int(match[2] or 0)))
    return tuple(out) if out else None


def version_at_least(found: str, minimum: str) -> bool | None:
    a, b = parse_version(found), parse_version(minimum)
    if a is None or b is None:
        return None
    width = max(len(a), len(b))
    return a + ((1, 0),) * (width - len(a)) >= b + ((1, 0),) * (width - len(b))


@dataclass
class AscendVersions:
    driver: str | None = None
    driver_file: str | None = None
    cann: str | None = None
    cann_file: str | None = None


@dataclass
class Host:
    root: Path = Path("/")
    path: str | None = None
    """PATH for `which` and the tools it runs; default the environment's."""
    arch: str = field(default_factory=platform.machine)
    npu: NpuTools | None = None
    """Default: npu-smi/hccn_tool found on `path` (or the driver's locations when root is /)."""

    def file(self, path: str | Path) -> Path:
        return self.root / str(path).lstrip("/")

    def read_text(self, path: str | Path) -> str | None:
        try:
            return self.file(path).read_text(errors="replace")
        except OSError:
            return None

    # ------------------------------------------------------------------------------------------- memory

    def meminfo(self) -> dict[str, int]:
        """/proc/meminfo in kB (HugePages_* are page counts, as the file has them)."""
        out = {}
        for line in (self.read_text("/proc/meminfo") or "").splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key.strip()] = int(parts[0])
        return out

    def page_size(self) -> int | None:
        """`getconf PAGE_SIZE`, as the guide checks it."""
        out = self.run(["getconf", "PAGE_SIZE"])
        return int(out.strip()) if out is not None and out.strip().isdigit() else None

    def fs_space(self, path: Path) -> tuple[int, int] | None:
        """(free bytes for an unprivileged writer, total bytes) of the file system that holds `path` or, if
        it does not exist yet, its nearest existing parent."""
        probe = self.file(path)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            st = os.statvfs(probe)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    # ------------------------------------------------------------------------------------------- Ascend

    def ascend_versions(self) -> AscendVersions:
        """Driver (HDK) from <install path>/driver/version.info; CANN from the toolkit's install info: CANN 8.5
        puts it at /usr/local/Ascend/cann/<arch>-linux/, earlier ones under ascend-toolkit/latest/<arch>-linux/."""
        versions = AscendVersions()
        install = parse_key_values(self.read_text(ASCEND_INSTALL_INFO) or "")
        driver_root = install.get("Driver_Install_Path_Param") or ASCEND_ROOT
        for root in dict.fromkeys((driver_root, ASCEND_ROOT)):
            info = f"{root.rstrip('/')}/driver/version.info"
            data = parse_key_values(self.read_text(info) or "")
            version = data.get("Version") or data.get("package_version")
            if version:
                versions.driver, versions.driver_file = version, info
                break
        arch = self.arch
        for info in (f"{ASCEND_ROOT}/cann/{arch}-linux/ascend_toolkit_install.info",
                     f"{ASCEND_ROOT}/ascend-toolkit/latest/{arch}-linux/ascend_toolkit_install.info",
                     f"{ASCEND_ROOT}/ascend-toolkit/latest/ascend_toolkit_install.info"):  # fmt: skip
            version = parse_key_values(self.read_text(info) or "").get("version")
            if version:
                versions.cann, versions.cann_file = version, info
                break
        return versions

    def npu_tools(self) -> NpuTools:
        """npu-smi/hccn_tool on `path`, else (on the real root) where the driver installs them."""
        if self.npu is None:
            real = self.root == Path("/")

            def find(name: str, default: Path) -> str | None:
                return shutil.which(name, path=self.path) or (locate_tool(name, default, default) if real else None)

            self.npu = NpuTools(find("npu-smi", NPU_SMI_DEFAULT), find("hccn_tool", HCCN_TOOL_DEFAULT))
        return self.npu

    def npu_snapshot(self) -> NpuSnapshot | None:
        """One detail snapshot (ECC, net health included); None without npu-smi. Blocking."""
        import asyncio

        tools = self.npu_tools()
        if tools.missing is not None:
            return None
        return asyncio.run(tools.snapshot(detail=True))

    # --------------------------------------------------------------------------------------- programs

    def which(self, name: str) -> str | None:
        if os.path.isabs(name):
            return name if os.access(name, os.X_OK) and os.path.isfile(name) else None
        return shutil.which(name, path=self.path)

    def run(self, argv: list[str], timeout: float = 10.0) -> str | None:
        """stdout of a command found on `path`; None if absent or failing."""
        program = self.which(argv[0])
        if program is None:
            return None
        env = dict(os.environ)
        if self.path is not None:
            env["PATH"] = self.path
        try:
            done = run_blocking([program, *argv[1:]], timeout, env=env)
        except (OSError, RunTimeout):
            return None
        return done.stdout if done.returncode == 0 else None

    def interpreter_of(self, program: str) -> str | None:
        """The Python a console script (`vllm`, `dscli`) runs under: its `#!` line."""
        found = self.which(program)
        if found is None:
            return None
        try:
            with open(found, "rb") as fh:
                first = fh.readline(512).decode(errors="replace").strip()
        except OSError:
            return None
        if not first.startswith("#!"):
            return None
        parts = first[2:].split()
        if not parts:
            return None
        if Path(parts[0]).name == "env" and len(parts) > 1:
            return self.which(parts[-1])
        return parts[0] if "python" in Path(parts[0]).name else None

    def can_import(self, python: str, module: str) -> tuple[bool, str]:
        """(ok, the error's last line) of `python -c 'import module'`."""
        try:
            done = run_blocking([python, "-c", f"import {module}"], IMPORT_TIMEOUT_S)
        except RunTimeout:
            return False, f"import {module} took over {IMPORT_TIMEOUT_S:g}s"
        except OSError as exc:
            return False, f"cannot run {python}: {exc.strerror or exc}"
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return done.returncode == 0, (lines[-1] if lines else "")

    # ---------------------------------------------------------------------------------------- network

    def nic_addresses(self) -> Mapping[str, list[str]]:
        import psutil

        return {name: [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
                for name, addrs in psutil.net_if_addrs().items()}  # fmt: skip

    def port_in_use(self, port: int) -> bool:
        from nodeagent.node.residue import port_in_use

        return port_in_use(port)

    def port_listeners(self, port: int) -> set[int]:
        from nodeagent.node.residue import listeners

        return listeners([port]).get(port, set())

    def our_pids(self, state_dir: Path) -> set[int]:
        """PIDs of the process trees the agent recorded in its state (children.json): ours, not strangers."""
        from nodeagent.core.process import ProcessRecord
        from nodeagent.core.statefile import StateStore
        from nodeagent.npu.monitor import our_pids

        records = []
        for data in StateStore(state_dir).load_children().values():
            try:
                records.append(ProcessRecord.from_dict(data))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
        return our_pids(records)

    def programs_running(self) -> dict[int, str]:
        """Every process's program name (the basename of its argv[0]), by PID, from `root`/proc."""
        out: dict[int, str] = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.file("/proc")):
                if entry.name.isdigit():
                    with contextlib.suppress(OSError):
                        argv0 = Path(entry.path, "cmdline").read_bytes().split(b"\0", 1)[0]
                        if argv0:
                            out[int(entry.name)] = os.path.basename(argv0.decode(errors="replace"))
        return out

    def now(self) -> float:
        return time.time()

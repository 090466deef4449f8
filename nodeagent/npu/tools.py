"""The one facade over Ascend's `npu-smi` and `hccn_tool`: run them, parse what they print.

No DCMI, no C library: the agent reads what an operator would read. The formats are the tools' own, as
captured in Ascend/mind-cluster (docs/en/faultdiag/user_guide/03_collecting_logs.md, the faultdiag test
captures `npu_info_before.txt`/`npu_info_after.txt`, `ascend-common/devmanager/hccn/hccn_tool.go`); see
docs/architecture.md. Parsers are pure and tolerant (a column more or less between driver versions is normal);
`NpuTools` is the thin shell that runs the executables it was given, so tests point it at fakes.

Cost per snapshot: one `npu-smi info` (health, HBM and processes of every chip in one table) and one
`hccn_tool -i D -link -g` per device; ECC counts and `-net_health` only on detail snapshots; the per-chip
`-t health` only for chips the table does not show as OK (to get their error codes).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nodeagent.core.run import RunTimeout, run

NPU_SMI_DEFAULT = Path("/usr/local/bin/npu-smi")
HCCN_TOOL_DEFAULT = Path("/usr/local/Ascend/driver/tools/hccn_tool")
"""Where the driver installs them (the guide mounts /usr/local/bin/npu-smi into its container)."""
TOOL_TIMEOUT_S = 15.0
PARALLEL_CALLS = 4
"""Per-device calls run this many at a time: a burst of 16 hccn_tool processes is not cheap on a busy host."""
HEALTH_OK = "OK"
NET_HEALTH_OK = ("Healthy",)
NET_HEALTH_UNCONFIGURED = ("Init",)
"""`net health status: Init`: no detect IP configured (hccn_tool -i D -netdetect -s address ...)."""


class NpuToolError(Exception):
    """A tool could not be run, timed out, or printed something we cannot read."""


@dataclass(frozen=True)
class NpuChip:
    """One chip's two rows of the `npu-smi info` table."""

    npu: int
    chip: int
    name: str
    health: str
    bus_id: str = ""
    power_w: float | None = None
    temp_c: float | None = None
    aicore_pct: float | None = None
    hbm_used_mb: int | None = None
    hbm_total_mb: int | None = None


@dataclass(frozen=True)
class NpuProcess:
    npu: int
    chip: int
    pid: int
    name: str
    memory_mb: int
    visible: bool | None = None
    """Whether the pid exists in our PID namespace (None: not checked). npu-smi run in a container may list
    the host's PIDs: a pid we cannot see is not proof of a foreign process."""


@dataclass(frozen=True)
class NpuInfo:
    version: str
    chips: tuple[NpuChip, ...]
    processes: tuple[NpuProcess, ...]

    @property
    def npu_ids(self) -> list[int]:
        return sorted({c.npu for c in self.chips})


@dataclass(frozen=True)
class HealthDetail:
    status: str
    error_codes: tuple[str, ...] = ()
    information: str = ""


@dataclass(frozen=True)
class ChipMapping:
    """A row of `npu-smi info -m`: the logic id is what `hccn_tool -i` and the runtime call a device."""

    npu: int
    chip: int
    logic_id: int
    name: str


@dataclass(frozen=True)
class NpuSnapshot:
    """Everything one poll saw; fields a poll did not ask for stay empty (`ecc`, `net_health` on fast polls)."""

    at: float
    """time.time() when the poll started."""
    info: NpuInfo | None = None
    error: str | None = None
    """Why `npu-smi info` gave nothing (then `info` is None)."""
    health: Mapping[int, HealthDetail] = field(default_factory=dict)
    """npu → detail, only for chips the table did not show as OK."""
    ecc: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    links: Mapping[int, str] = field(default_factory=dict)
    """npu → `UP`/`DOWN` (other words as printed)."""
    net_health: Mapping[int, str] = field(default_factory=dict)
    tool_errors: tuple[str, ...] = ()
    """Per-device calls that failed (hccn_tool, -t ecc, -t health): reported, not faults by themselves."""
    roce_checked: bool = False


# ------------------------------------------------------------------------------------------------ parsers

_HEALTH_WORDS = re.compile(r"^[A-Za-z][A-Za-z ]*$")
_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_FRACTION = re.compile(r"(\d+)\s*/\s*(\d+)")
_VERSION = re.compile(r"npu-smi\s+(\S+)")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def _cells(line: str) -> list[str] | None:
    """`| a | b | c |` → ['a', 'b', 'c']; None for borders and non-table lines."""
    line = line.strip()
    if not line.startswith("|"):
        return None
    return [cell.strip() for cell in line.strip("|").split("|")]


def _float(text: str) -> float | None:
    return float(text) if _NUMBER.match(text) else None


def _chip_row(first: list[str], second: list[str]) -> NpuChip | None:
    head, chip_cells = first[0].split(), second[0].split()
    if not head or not head[0].isdigit() or not chip_cells or not chip_cells[0].isdigit():
        return None
    stats1, stats2 = first[2].split() if len(first) > 2 else [], second[2] if len(second) > 2 else ""
    fractions = _FRACTION.findall(stats2)
    hbm = fractions[-1] if len(fractions) >= 2 else None  # Memory-Usage(MB) then HBM-Usage(MB)
    aicore = stats2.split()[0] if stats2.split() else ""
    return NpuChip(
        npu=int(head[0]), chip=int(chip_cells[0]), name=" ".join(head[1:]), health=first[1],
        bus_id=second[1], power_w=_float(stats1[0]) if stats1 else None,
        temp_c=_float(stats1[1]) if len(stats1) > 1 else None, aicore_pct=_float(aicore),
        hbm_used_mb=int(hbm[0]) if hbm else None, hbm_total_mb=int(hbm[1]) if hbm else None,
    )  # fmt: skip


def _process_row(cells: list[str]) -> NpuProcess | None:
    """`| 0       0 | 123456 | VLLM::Worker_TP0 | 60012 |` (A3 adds a `Process id in container` column)."""
    if len(cells) < 4:
        return None
    ids = cells[0].split()
    if len(ids) < 2 or not all(part.isdigit() for part in ids[:2]) or not cells[1].isdigit():
        return None
    memory = cells[3].split()[0] if cells[3].split() else ""
    if not memory.isdigit():
        return None
    return NpuProcess(int(ids[0]), int(ids[1]), int(cells[1]), cells[2], int(memory))


def parse_npu_smi_info(text: str) -> NpuInfo:
    """The card/chip table and the process table of plain `npu-smi info`; raises NpuToolError if neither."""
    version_match = _VERSION.search(text)
    chips: list[NpuChip] = []
    processes: list[NpuProcess] = []
    section = ""
    pending: list[str] | None = None
    for line in text.splitlines():
        cells = _cells(line)
        if cells is None:
            pending = None  # a border closes a chip's pair of rows
            continue
        joined = " ".join(cells)
        if "Process id" in joined and "Process name" in joined:
            section, pending = "processes", None
            continue
        if cells[0].startswith("NPU") and "Health" in joined:
            section = "chips"
            continue
        if section == "chips" and len(cells) >= 3:
            if pending is None and _HEALTH_WORDS.match(cells[1]) and not cells[0].startswith("Chip"):
                pending = cells
            elif pending is not None and _BUS_ID.match(cells[1]):
                chip = _chip_row(pending, cells)
                if chip is not None:
                    chips.append(chip)
                pending = None
        elif section == "processes":
            proc = _process_row(cells)
            if proc is not None:
                processes.append(proc)
    if not chips and section == "":
        raise NpuToolError(f"npu-smi info printed no NPU table: {_short(text)}")
    return NpuInfo(version_match[1] if version_match else "", tuple(chips), tuple(processes))


def _key_values(text: str) -> list[tuple[str, str]]:
    """`Key    : value` lines (npu-smi's -t outputs); continuation lines (`   : more`) have an empty key."""
    out = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.append((key.strip(), value.strip()))
    return out


def parse_health(text: str) -> HealthDetail:
    """`npu-smi info -t health -i N -c C`: Health Status, Error Code (space-separated hex or NA), Information."""
    status: str | None = None
    codes: tuple[str, ...] = ()
    info: list[str] = []
    for key, value in _key_values(text):
        if key == "Health Status":
            status = value
        elif key == "Error Code":
            codes = tuple(c for c in value.split() if c != "NA")
        elif (key == "Error Information" or (key == "" and info)) and value and value != "NA":
            info.append(value)
    if status is None:
        raise NpuToolError(f"no 'Health Status' in: {_short(text)}")
    return HealthDetail(status, codes, "; ".join(info))


ECC_KEYS = {
    "HBM Single Bit Error Count": "hbm_single",
    "HBM Double Bit Error Count": "hbm_double",
    "HBM Single Bit Aggregate Total Err Cnt": "hbm_single_total",
    "HBM Double Bit Aggregate Total Err Cnt": "hbm_double_total",
    "HBM Single Bit Isolated Pages Count": "hbm_single_isolated_pages",
    "HBM Double Bit Isolated Pages Count": "hbm_double_isolated_pages",
}


def parse_ecc(text: str) -> dict[str, int]:
    """`npu-smi info -t ecc -i N`: the HBM counters by short name (DDR lines are ignored: A2 has HBM)."""
    counts = {}
    for key, value in _key_values(text):
        name = ECC_KEYS.get(key)
        if name and value.isdigit():
            counts[name] = int(value)
    if "hbm_double" not in counts and "hbm_double_total" not in counts:
        raise NpuToolError(f"no HBM ECC counters in: {_short(text)}")
    return counts


def parse_link(text: str) -> str:
    """`hccn_tool -i D -link -g` → `link status: UP` / `link status: DOWN`."""
    match = re.search(r"link status:\s*(\S+)", text)
    if not match:
        raise NpuToolError(f"no 'link status' in: {_short(text)}")
    return match[1].upper()


def parse_net_health(text: str) -> str:
    """`hccn_tool -i D -net_health -g` → `net health status: Healthy` (or Init, Socket failed, ...)."""
    match = re.search(r"net health status:\s*(.+?)\s*$", text, re.MULTILINE)
    if not match:
        raise NpuToolError(f"no 'net health status' in: {_short(text)}")
    return match[1]


def parse_chip_map(text: str) -> list[ChipMapping]:
    """`npu-smi info -m`: NPU ID, Chip ID, Chip Logic ID, [Chip Phy-ID,] Chip Name; rows without a numeric
    logic id (an MCU) are not devices."""
    rows = []
    phy_column = "Phy-ID" in text
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or not all(p.isdigit() for p in parts[:3]):
            continue
        name_at = 4 if phy_column and len(parts) > 4 and parts[3].isdigit() else 3
        rows.append(ChipMapping(int(parts[0]), int(parts[1]), int(parts[2]), " ".join(parts[name_at:])))
    return rows


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def pid_visible(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


class ToolRunner(Protocol):
    """Where `npu-smi` and `hccn_tool` run and what their PIDs mean: the host (`HostTools`), or a simulated chip set
    that answers with the same text (the parsers and every rule above them run unchanged)."""

    async def run(self, argv: list[str], timeout_s: float, stdin: bytes | None,
                  env: Mapping[str, str] | None) -> tuple[int, str]:  # fmt: skip
        """(exit code, output with stderr merged); raises `RunTimeout` past `timeout_s`, OSError if it cannot run."""
        ...

    def pid_visible(self, pid: int) -> bool: ...


class HostTools:
    """The host's tools, through `core.run` (their own session, killed whole on a timeout)."""

    async def run(self, argv: list[str], timeout_s: float, stdin: bytes | None,
                  env: Mapping[str, str] | None) -> tuple[int, str]:  # fmt: skip
        result = await run(argv, timeout_s, input=stdin, merge_stderr=True, env=env)
        return result.returncode, result.output

    def pid_visible(self, pid: int) -> bool:
        return pid_visible(pid)


# -------------------------------------------------------------------------------------------------- shell


def _executable(path: Path | None) -> str | None:
    if path is not None and path.is_file() and os.access(path, os.X_OK):
        return str(path)
    return None


def locate_tool(
    name: str, default: Path, explicit: Path | str | None = None, bin_dir: Path | None = None
) -> str | None:
    """An explicit path, else `bin_dir/name`, else PATH, else the driver's default location."""
    if explicit is not None:
        return _executable(Path(explicit))
    if bin_dir is not None:
        return _executable(bin_dir / name)
    return shutil.which(name) or _executable(default)


class NpuTools:
    """Runs the two executables it was given; every method raises NpuToolError, nothing else."""

    def __init__(self, npu_smi: str | None, hccn_tool: str | None, timeout_s: float = TOOL_TIMEOUT_S,
                 env: Mapping[str, str] | None = None, runner: ToolRunner | None = None) -> None:  # fmt: skip
        self.runner: ToolRunner = runner or HostTools()
        self.npu_smi = npu_smi
        self.hccn_tool = hccn_tool
        self.timeout_s = timeout_s
        self.env = dict(env) if env is not None else None
        self._mapping: list[ChipMapping] | None = None
        self._limits: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    @classmethod
    def locate(cls, npu_smi: Path | str | None = None, hccn_tool: Path | str | None = None,
               bin_dir: Path | None = None, timeout_s: float = TOOL_TIMEOUT_S,
               env: Mapping[str, str] | None = None) -> NpuTools:  # fmt: skip
        return cls(
            locate_tool("npu-smi", NPU_SMI_DEFAULT, npu_smi, bin_dir),
            locate_tool("hccn_tool", HCCN_TOOL_DEFAULT, hccn_tool, bin_dir), timeout_s, env,
        )  # fmt: skip

    @property
    def missing(self) -> str | None:
        """Why there is nothing to check (None when npu-smi is there)."""
        if self.npu_smi is None:
            return f"npu-smi not found (PATH, {NPU_SMI_DEFAULT})"
        return None

    def _limit(self) -> asyncio.Semaphore:
        """One per event loop: the CLI and tests run several loops in one process."""
        loop = asyncio.get_running_loop()
        if loop not in self._limits:
            self._limits = {loop: asyncio.Semaphore(PARALLEL_CALLS)}
        return self._limits[loop]

    async def _run(self, argv: list[str], answer: bytes | None = None, check: bool = True) -> str:
        async with self._limit():
            try:
                code, output = await self.runner.run(argv, self.timeout_s, answer, self.env)
            except RunTimeout:
                raise NpuToolError(f"{' '.join(argv)} timed out after {self.timeout_s:g}s") from None
            except OSError as exc:
                raise NpuToolError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
        if code != 0 and check:
            said = _short(output) or "no output"
            raise NpuToolError(f"{' '.join(argv[1:]) or argv[0]} exit {code}: {said}")
        return output

    def _need(self, tool: str | None, name: str) -> str:
        if tool is None:
            raise NpuToolError(f"{name} not found")
        return tool

    async def reset(self, argv: list[str], answer: str = "y\n") -> str:
        """`npu-smi set -t reset -i N -c 0` (argv from `ladder.reset_command`), answering its (Y/N) prompt. Raises
        NpuToolError unless it exits 0 and says `Status : OK`."""
        text = await self._run([self._need(self.npu_smi, "npu-smi"), *argv[1:]], answer.encode(), check=False)
        if not re.search(r"^\s*Status\s*:\s*OK\s*$", text, re.MULTILINE):
            said = [" ".join(line.split()) for line in text.splitlines() if re.match(r"\s*(Status|Message)\s*:", line)]
            raise NpuToolError(f"{' '.join(argv[1:])}: {'; '.join(said) or _short(text) or 'no output'}")
        return text

    async def info_text(self) -> str:
        return await self._run([self._need(self.npu_smi, "npu-smi"), "info"])

    async def info(self) -> NpuInfo:
        return parse_npu_smi_info(await self.info_text())

    async def health(self, npu: int, chip: int = 0) -> HealthDetail:
        argv = [self._need(self.npu_smi, "npu-smi"), "info", "-t", "health", "-i", str(npu), "-c", str(chip)]
        return parse_health(await self._run(argv))

    async def ecc(self, npu: int) -> dict[str, int]:
        return parse_ecc(await self._run([self._need(self.npu_smi, "npu-smi"), "info", "-t", "ecc", "-i", str(npu)]))

    async def chip_map(self) -> list[ChipMapping]:
        """Read once: the mapping only changes with the hardware."""
        if self._mapping is None:
            self._mapping = parse_chip_map(await self._run([self._need(self.npu_smi, "npu-smi"), "info", "-m"]))
        return self._mapping

    async def link(self, device: int) -> str:
        return parse_link(await self._run([self._need(self.hccn_tool, "hccn_tool"), "-i", str(device), "-link", "-g"]))

    async def net_health(self, device: int) -> str:
        argv = [self._need(self.hccn_tool, "hccn_tool"), "-i", str(device), "-net_health", "-g"]
        return parse_net_health(await self._run(argv))

    async def devices(self, info: NpuInfo) -> dict[int, int]:
        """npu → the hccn_tool device id of its chip 0 (the logic id; on an A2 the same number)."""
        try:
            mapping = await self.chip_map()
        except NpuToolError:
            mapping = []
        by_npu = {m.npu: m.logic_id for m in mapping if m.chip == 0}
        return {npu: by_npu.get(npu, npu) for npu in info.npu_ids}

    async def snapshot(self, detail: bool = False, roce: bool = True) -> NpuSnapshot:
        """One poll; never raises: a failed `npu-smi info` is `error`, failed per-device calls `tool_errors`."""
        at = time.time()
        try:
            info = await self.info()
        except NpuToolError as exc:
            return NpuSnapshot(at, error=str(exc))
        info = NpuInfo(info.version, info.chips,
                       tuple(_with_visibility(p, self.runner) for p in info.processes))  # fmt: skip
        errors: list[str] = []
        sick = [c for c in info.chips if c.health != HEALTH_OK]
        check_roce = roce and self.hccn_tool is not None
        devices = await self.devices(info) if check_roce else {}
        jobs: dict[tuple[str, int], asyncio.Future[object]] = {}
        for chip in sick:
            jobs[("health", chip.npu)] = asyncio.ensure_future(self.health(chip.npu, chip.chip))
        if detail:
            for npu in info.npu_ids:
                jobs[("ecc", npu)] = asyncio.ensure_future(self.ecc(npu))
        for npu, device in devices.items():
            jobs[("link", npu)] = asyncio.ensure_future(self.link(device))
            if detail:
                jobs[("net", npu)] = asyncio.ensure_future(self.net_health(device))
        results = await asyncio.gather(*jobs.values(), return_exceptions=True)
        found: dict[str, dict[int, Any]] = {"health": {}, "ecc": {}, "link": {}, "net": {}}  # each job's own type
        for (what, npu), result in zip(jobs, results, strict=True):
            if isinstance(result, NpuToolError):
                errors.append(f"npu {npu} {what}: {result}")
            elif isinstance(result, BaseException):
                raise result
            else:
                found[what][npu] = result
        return NpuSnapshot(
            at, info, health=found["health"], ecc=found["ecc"], links=found["link"],
            net_health=found["net"], tool_errors=tuple(errors), roce_checked=check_roce,
        )  # fmt: skip


def _with_visibility(proc: NpuProcess, runner: ToolRunner) -> NpuProcess:
    return NpuProcess(proc.npu, proc.chip, proc.pid, proc.name, proc.memory_mb, runner.pid_visible(proc.pid))


def describe_process(proc: NpuProcess) -> str:
    return f"npu {proc.npu} pid {proc.pid} {proc.name} {proc.memory_mb} MB"


async def npu_info_text(npu_smi: Path | str | None = None) -> str | None:
    """The raw `npu-smi info` page for a post-mortem (`npu_smi`: the configured one); None where npu-smi is
    absent."""
    tools = NpuTools.locate(npu_smi)
    if tools.missing is not None:
        return None
    try:
        return await tools.info_text()
    except NpuToolError as exc:
        return f"npu-smi info failed: {exc}"

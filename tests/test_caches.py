"""The compile caches on the host (issue 32 item 2), without processes: the key (any change of the software is a
new folder, an unknown vLLM version none), the variables (the operator's own win), the retention (least recently
used beyond `keep` and the size cap, never one in use), the store's folders and sizes, the container's share of
the folder and the image ID the key of a rank inside is made of."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from test_vllm_install import XY, config_text, dist, venv

from nodeagent.config.load import parse_config
from nodeagent.container.plan import parse_inspect
from nodeagent.container.render import shared_folders
from nodeagent.node.caches import CacheStore
from nodeagent.node.vllm_install import dist_versions, launch_spec
from nodeagent.render.caches import (
    CACHE_VARS,
    HOST_DISTS,
    CacheEntry,
    cache_key,
    container_parts,
    host_parts,
    parse_versions,
    reload_env,
    retention,
    versions_argv,
    with_caches,
)
from nodeagent.render.launch import LaunchSpec

GB = 10**9


def test_any_change_of_the_software_is_another_folder() -> None:
    base = {"python": "/v/bin/python", "vllm": "0.32.0", "vllm_ascend": "0.20.2rc1", "torch": "2.8.0"}
    key = cache_key(base)
    assert key.startswith("0.32.0-") and cache_key(dict(base)) == key, "the same stack: the same folder"
    for part, value in (("vllm", "0.32.1"), ("vllm_ascend", "0.20.2"), ("torch", "2.8.1"), ("python", "/w/python")):
        assert cache_key({**base, part: value}) != key, f"{part} changed: a fresh cache"
    assert cache_key({**base, "torch_npu": "2.8.0"}) != key, "a package installed since"
    assert host_parts({"vllm": None, "torch": "2.8.0"}, "/v/bin/python") is None, "vLLM's version unknown: no key"
    assert host_parts({"vllm": "0.32.0", "torch_npu": None}, "/p") == {"python": "/p", "vllm": "0.32.0"}
    image = container_parts("quay.io/ascend/vllm-ascend:v0.20.2rc1", "sha256:" + "a" * 64, "s1", {})
    assert image is not None and cache_key(image).startswith("aaaaaaaaaaaa-")
    assert cache_key(image) != cache_key({**image, "image_id": "sha256:" + "b" * 64}), "re-tagged: another image"
    assert cache_key(image) != cache_key({**image, "setup": "s2"}), "the setup list may install other versions"
    assert container_parts("img", "", "s1", {}) is None, "no image ID yet: no key"


def test_the_variables_point_into_the_folder_unless_the_config_sets_one() -> None:
    spec = LaunchSpec("vllm", "vllm", ("vllm", "serve"), {"VLLM_CACHE_ROOT": "/mine", "A": "1"}, ("TRITON_CACHE_DIR",),
                      Path("/w"))  # fmt: skip
    out = with_caches(spec, Path("/c/k"))
    assert out.env["VLLM_CACHE_ROOT"] == "/mine" and out.env["A"] == "1"
    assert "TRITON_CACHE_DIR" not in out.env, "the config unsets it: left unset"
    assert out.env["TORCHINDUCTOR_CACHE_DIR"] == "/c/k/inductor" and out.env["ASCEND_CACHE_PATH"] == "/c/k/ascend-cache"
    assert out.env["TORCHAIR_CACHE_HOME"] == "/c/k/torchair" and out.env["ASCEND_WORK_PATH"] == "/c/k/ascend-work"
    assert out.argv == spec.argv and out.cwd == spec.cwd


def test_a_cpu_vllm_gets_the_compile_cache_that_reloads() -> None:
    """CPU vLLM 0.32 writes its AOT compile cache but cannot load it back: every warm start compiled from scratch
    (docs/performance.md, the restart cost); its older cache (VLLM_USE_AOT_COMPILE=0) reloads."""
    spec = LaunchSpec("vllm", "vllm", ("vllm", "serve"), {}, (), Path("/w"))
    cpu = {"python": "/p", "vllm": "0.32.0+cpu", "torch": "2.13.0+cpu"}
    assert with_caches(spec, Path("/c/k"), cpu).env["VLLM_USE_AOT_COMPILE"] == "0"
    for other in ({"python": "/p", "vllm": "0.20.2", "vllm_ascend": "0.20.2rc1"}, None):
        assert "VLLM_USE_AOT_COMPILE" not in with_caches(spec, Path("/c/k"), other).env, other
    mine = LaunchSpec("vllm", "vllm", ("vllm", "serve"), {"VLLM_USE_AOT_COMPILE": "1"}, (), Path("/w"))
    assert with_caches(mine, Path("/c/k"), cpu).env["VLLM_USE_AOT_COMPILE"] == "1", "the operator's own wins"
    unset = LaunchSpec("vllm", "vllm", ("vllm", "serve"), {}, ("VLLM_USE_AOT_COMPILE",), Path("/w"))
    assert "VLLM_USE_AOT_COMPILE" not in with_caches(unset, Path("/c/k"), cpu).env
    assert reload_env({"vllm": "0.32.0"}) == {}, "not a CPU build"


def test_retention_keeps_the_most_recent_and_never_one_in_use() -> None:
    entries = [CacheEntry("a", 10 * GB, 1.0), CacheEntry("b", 10 * GB, 2.0), CacheEntry("c", 10 * GB, 3.0),
               CacheEntry("d", 10 * GB, 4.0)]  # fmt: skip
    assert retention(entries, {"d"}, keep=2, max_bytes=100 * GB) == ["b", "a"]
    assert retention(entries, {"a"}, keep=2, max_bytes=100 * GB) == ["c", "b"], "in use (adopted rank): kept"
    assert retention(entries, {"a", "d"}, keep=1, max_bytes=100 * GB) == ["c", "b"], "in use beyond keep: kept"
    assert retention(entries, {"d"}, keep=4, max_bytes=25 * GB) == ["a", "b"], "over the cap: the oldest go"
    assert retention(entries, {"d"}, keep=4, max_bytes=1 * GB) == ["a", "b", "c"], "never the one in use"
    assert retention([], set(), keep=1, max_bytes=0) == []


def inside(image_id: str, setup: str = "s") -> SimpleNamespace:
    async def read_versions(command: str) -> None:
        return None

    return SimpleNamespace(read_versions=read_versions,
                           cache_parts=lambda command: container_parts("img:1", image_id, setup, {}))


def test_a_containers_key_has_the_versions_its_rank_imports() -> None:
    """Issue 32 item 2: the same image and setup list with another vLLM (an unpinned upgrade in the setup, a
    bind-mounted venv) is another folder; no key until the versions are read."""
    image, setup = "sha256:" + "a" * 64, "s1"
    old = container_parts("img:1", image, setup, {"vllm": "0.20.2", "vllm_ascend": "0.20.2rc1", "torch_npu": None})
    new = container_parts("img:1", image, setup, {"vllm": "0.20.2", "vllm_ascend": "0.20.3", "torch_npu": None})
    assert old is not None and new is not None and cache_key(old) != cache_key(new), "a stale cache across versions"
    assert old["vllm_ascend"] == "0.20.2rc1" and "torch_npu" not in old and cache_key(old).startswith("0.20.2-")
    assert container_parts("img:1", image, setup, None) is None, "not read yet: no key"
    bare = container_parts("img:1", image, setup, {"vllm": None})
    assert bare == {"image": "img:1", "image_id": image, "setup": setup}, "nothing installed (a stand-in): the image"
    assert parse_versions('noise\n{"vllm": "0.32.0+cpu", "torch": null, "other": "1"}\n') == {
        "vllm": "0.32.0+cpu", "torch": None}
    for bad in ("", "Traceback ...", '["vllm"]', '{"vllm": 1}'):
        try:
            parse_versions(bad)
        except ValueError as exc:
            assert "versions" in str(exc)
        else:
            raise AssertionError(f"{bad!r} read as versions")


def test_the_versions_are_read_by_the_interpreter_of_the_ranks_command(tmp_path: Path) -> None:
    """The container's exec runs `versions_argv`: a console script's shebang interpreter (a venv bind-mounted into
    the container), not the image's python3; a python given as the command itself is used as it is."""
    site = tmp_path / "site"
    (site / "vllm-0.32.0+cpu.dist-info").mkdir(parents=True)
    (site / "vllm-0.32.0+cpu.dist-info" / "METADATA").write_text("Name: vllm\nVersion: 0.32.0+cpu\n")
    python = tmp_path / "python-venv"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    script = tmp_path / "python-env" / "bin" / "vllm"  # ("python" in its folder: still a console script)
    script.parent.mkdir(parents=True)
    script.write_text(f"#!{python}\nraise SystemExit('the console script is not run')\n")
    script.chmod(0o755)
    env = {**os.environ, "PATH": f"{script.parent}:{os.environ['PATH']}"}
    for command in ("vllm", str(script), str(python)):
        out = subprocess.run(versions_argv(command), capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert parse_versions(out.stdout)["vllm"] == "0.32.0+cpu", command
    missing = subprocess.run(versions_argv("no-such-vllm"), capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode == 127


def test_a_container_reads_the_versions_once_per_container(tmp_path: Path) -> None:
    """One exec per container and command (its setup ran once); a recreated container is read again; a failed
    read is no key, with the reason, and is tried again at the next launch."""
    from nodeagent.container.engine import EngineError
    from nodeagent.container.mode import ContainerMode
    from nodeagent.container.plan import ContainerState

    config = parse_config(config_text(tmp_path, "vllm", container=True).replace("engine: podman", "engine: docker"))
    mode = ContainerMode(SimpleNamespace(config=config))  # (docker: not on this host, so no `info` is run)
    calls: list[list[str]] = []
    answers = ['{"vllm": "0.20.2", "vllm_ascend": "0.20.2rc1"}']

    async def exec_(argv: list[str], timeout_s: float | None = None, **_: object) -> SimpleNamespace:
        calls.append(list(argv))
        if not answers:
            raise EngineError("podman exec exited 125: no such container")
        return SimpleNamespace(stdout=answers.pop(0) + "\n", returncode=0)

    mode.engine.exec = exec_  # type: ignore[method-assign,assignment]
    assert asyncio.run(mode.read_versions("vllm")) == "the container is not up"
    mode.state, mode.problem = ContainerState("c" * 64, "n", "running", True, "img:1", "sha256:" + "d" * 64), None
    assert asyncio.run(mode.read_versions("vllm")) is None and asyncio.run(mode.read_versions("vllm")) is None
    assert len(calls) == 1 and calls[0][4] == "vllm", "read once, by the rank's command"
    first = mode.cache_parts("vllm")
    assert first is not None and first["vllm_ascend"] == "0.20.2rc1"
    assert mode.cache_parts("other") is None, "another command: not read yet"
    mode.state = replace(mode.state, id="e" * 64)
    assert mode.cache_parts("vllm") is None, "a recreated container: read again"
    answers.append('{"vllm": "0.20.2", "vllm_ascend": "0.20.3"}')
    asyncio.run(mode.read_versions("vllm"))
    second = mode.cache_parts("vllm")
    assert second is not None and cache_key(second) != cache_key(first), "upgraded by the setup: a fresh cache"
    mode.state = replace(mode.state, id="f" * 64)
    why = asyncio.run(mode.read_versions("vllm"))
    assert why is not None and "could not be read" in why and mode.cache_parts("vllm") is None
    store = CacheStore()
    spec = launch_spec("vllm", config, {})
    out = asyncio.run(store.apply(config, "vllm", spec, {}, mode))
    assert "VLLM_CACHE_ROOT" not in out.env and "could not be read" in store.unkeyed["vllm"]
    answers.append('{"vllm": "0.20.2"}')
    out = asyncio.run(store.apply(config, "vllm", spec, {}, mode))
    assert "VLLM_CACHE_ROOT" in out.env and "vllm" not in store.unkeyed, "tried again at the next launch"


def test_the_store_makes_the_folder_removes_old_stacks_and_measures(tmp_path: Path) -> None:
    config = parse_config(config_text(tmp_path, "/nonexistent/vllm").replace(
        "systemd_scopes: never}", "systemd_scopes: never, caches: {keep: 2}}"))  # fmt: skip
    spec = launch_spec("vllm", config, {})
    store = CacheStore()
    root = tmp_path / "state" / "cache"
    assert config.agent.cache_dir == root, "default: under the state folder"
    (root / "not-ours").mkdir(parents=True)  # a folder without key.json: never touched

    async def applied(image_id: str) -> LaunchSpec:
        out = await store.apply(config, "vllm", spec, {}, inside(image_id))
        await store.swept()  # the retention runs after the launch, off its path
        return out

    def launch(image_id: str, at: float) -> LaunchSpec:
        out = asyncio.run(applied(image_id))
        folder = Path(out.env["VLLM_CACHE_ROOT"]).parent
        os.utime(folder / "last_used", (at, at))
        return out

    first = launch("sha256:" + "1" * 64, 1.0)
    folder = Path(first.env["VLLM_CACHE_ROOT"]).parent
    assert folder.parent == root and all((folder / sub).is_dir() for sub in CACHE_VARS.values())
    assert json.loads((folder / "key.json").read_text())["parts"]["image_id"] == "sha256:" + "1" * 64
    (folder / "vllm" / "torch_compile_cache").mkdir()
    (folder / "vllm" / "torch_compile_cache" / "graph.bin").write_bytes(b"x" * 100_000)
    again = launch("sha256:" + "1" * 64, 2.0)
    assert again.env == first.env, "the same image: the same warm folder"
    assert (folder / "vllm" / "torch_compile_cache" / "graph.bin").is_file()
    launch("sha256:" + "2" * 64, 3.0)
    store.in_use.clear()  # (the ranks stopped: only keep decides)
    third = launch("sha256:" + "3" * 64, 4.0)
    assert not folder.exists(), "keep 2: the least recently used stack's folder is removed"
    assert (root / "not-ours").is_dir()
    status = store.status(config)
    assert status["keys"][0]["key"] == Path(third.env["VLLM_CACHE_ROOT"]).parent.name
    assert len(status["keys"]) == 2 and status["keys"][0]["used_by"] == ["vllm"]
    assert status["bytes"] == sum(k["bytes"] for k in status["keys"]) and status["dir"] == str(root)
    assert status["removed"] == [folder.name]

    unknown = asyncio.run(store.apply(config, "vllm", spec, {}, inside("")))
    assert unknown.env == spec.env and "image ID" in store.status(config)["unkeyed"]["vllm"]
    off = parse_config(config_text(tmp_path, "/nonexistent/vllm").replace(
        "systemd_scopes: never}", "systemd_scopes: never, caches: {enabled: false}}"))  # fmt: skip
    assert asyncio.run(store.apply(off, "vllm", spec, {}, inside("sha256:9"))).env == spec.env


def test_a_host_rank_is_keyed_by_its_installed_versions(tmp_path: Path) -> None:
    script = venv(tmp_path / "v", "0.32.0")
    site = tmp_path / "v" / "lib" / f"python{XY}" / "site-packages"
    dist(site, "vllm_ascend", "0.20.2rc1")
    dist(site, "torch", "2.8.0+cpu")
    python, versions = dist_versions([str(script)], {}, HOST_DISTS) or ("", {})
    assert python == str(tmp_path / "v" / "bin" / "python")
    assert versions == {"vllm": "0.32.0", "vllm_ascend": "0.20.2rc1", "torch": "2.8.0+cpu", "torch_npu": None,
                        "triton": None, "triton_ascend": None}  # fmt: skip
    config = parse_config(config_text(tmp_path, str(script)))
    spec = launch_spec("vllm", config, {})
    store = CacheStore()
    first = asyncio.run(store.apply(config, "vllm", spec, {}))
    assert first.env["VLLM_CACHE_ROOT"].startswith(str(tmp_path / "state" / "cache" / "0.32.0-"))
    (site / "vllm_ascend-0.20.2rc1.dist-info").rename(site / "vllm_ascend-0.20.3.dist-info")
    (site / "vllm_ascend-0.20.3.dist-info" / "METADATA").write_text("Name: vllm_ascend\nVersion: 0.20.3\n")
    upgraded = asyncio.run(store.apply(config, "vllm", spec, {}))
    assert upgraded.env["VLLM_CACHE_ROOT"] != first.env["VLLM_CACHE_ROOT"], "a stale cache is never used"
    assert dist_versions([sys.executable.replace("python", "no-such")], {}, HOST_DISTS) is None
    assert "VLLM_USE_AOT_COMPILE" not in first.env
    cpu = parse_config(config_text(tmp_path, str(venv(tmp_path / "cpu", "0.32.0+cpu"))))
    on_cpu = asyncio.run(store.apply(cpu, "vllm", launch_spec("vllm", cpu, {}), {}))
    assert on_cpu.env["VLLM_USE_AOT_COMPILE"] == "0", "a CPU build: the compile cache that reloads"


def test_the_container_shares_the_folder_and_the_key_is_the_image_id(tmp_path: Path) -> None:
    text = config_text(tmp_path, "vllm", container=True)
    default = parse_config(text)
    assert any(default.agent.cache_dir.is_relative_to(f) for f in shared_folders(default)), "under the state folder"
    elsewhere = parse_config(text.replace("systemd_scopes: never}", "systemd_scopes: never, caches: {dir: /data/c}}"))
    assert Path("/data/c") in shared_folders(elsewhere), "mounted at its own path"
    off = parse_config(text.replace("systemd_scopes: never}", "systemd_scopes: never, caches: {dir: /data/c, "
                                    "enabled: false}}"))  # fmt: skip
    assert Path("/data/c") not in shared_folders(off)
    state = parse_inspect(json.dumps([{"Id": "c" * 64, "Name": "n", "Image": "sha256:" + "d" * 64,
                                       "ImageName": "img:1", "State": {"Status": "running", "Running": True}}]))
    assert state is not None and state.image == "img:1" and state.image_id == "sha256:" + "d" * 64


def test_the_size_is_shown_in_status_and_exported(tmp_path: Path) -> None:
    from prometheus_client.core import Metric

    from nodeagent.api.metrics import cache_families
    from nodeagent.cli.status import caches_line, format_status

    config = parse_config(config_text(tmp_path, "/nonexistent/vllm"))
    store = CacheStore()
    out = asyncio.run(store.apply(config, "vllm", launch_spec("vllm", config, {}), {}, inside("sha256:" + "e" * 64)))
    (Path(out.env["TRITON_CACHE_DIR"]) / "kernel.bin").write_bytes(b"k" * 3_000_000)
    store.measured_at = 0.0  # a minute ago and more: the next scrape measures again
    asyncio.run(store.refresh(config))
    status = store.status(config)
    assert status["bytes"] >= 3_000_000
    key = status["keys"][0]["key"]
    line = caches_line(status)
    assert line.startswith(f"compile caches {tmp_path}/state/cache: 0.0 GB (cap 200 GB), 1 stack, in use {key} "
                           "(vllm)")  # fmt: skip
    shown = format_status({"node": {"name": "n0"}, "agent": {}, "components": {}, "caches": status}, now=0)
    assert line in shown.splitlines()
    families: dict[str, Metric] = {m.name: m for m in cache_families(status)}
    assert families["dsv4_agent_compile_cache_bytes"].samples[0].value == status["bytes"]
    assert families["dsv4_agent_compile_cache_max_bytes"].samples[0].value == 200e9
    assert [(s.labels, s.value) for s in families["dsv4_agent_compile_cache_key_bytes"].samples] == [
        ({"key": key}, status["bytes"])]


def test_render_shows_the_variables_each_rank_gets(tmp_path: Path) -> None:
    from nodeagent.node.caches import preview

    script = venv(tmp_path / "v", "0.32.0")
    host = parse_config(config_text(tmp_path, str(script)))
    spec, note = preview(host, "vllm", launch_spec("vllm", host, {}), {})
    assert spec.env["VLLM_CACHE_ROOT"].startswith(f"{tmp_path}/state/cache/0.32.0-") and note is not None
    assert "vllm 0.32.0" in note and not (tmp_path / "state" / "cache").exists(), "render makes nothing"
    inside_cfg = parse_config(config_text(tmp_path, str(script), container=True))
    spec, note = preview(inside_cfg, "vllm", launch_spec("vllm", inside_cfg, {}), {})
    assert spec.env["TORCHAIR_CACHE_HOME"] == f"{tmp_path}/state/cache/KEY/torchair" and "image ID" in (note or "")
    unknown = parse_config(config_text(tmp_path, "/nonexistent/vllm"))
    spec, note = preview(unknown, "vllm", launch_spec("vllm", unknown, {}), {})
    assert "VLLM_CACHE_ROOT" not in spec.env and note is not None and "no readable version" in note


def test_an_adopted_ranks_folder_counts_as_in_use(tmp_path: Path) -> None:
    """After an agent restart the ranks it adopts were launched by the agent before it: the key their environment
    names is in use, so a launch of another stack with `keep: 1` does not remove their folder."""
    config = parse_config(config_text(tmp_path, "/nonexistent/vllm").replace(
        "systemd_scopes: never}", "systemd_scopes: never, caches: {keep: 1}}"))  # fmt: skip
    old = config.agent.cache_dir / "0.31.0-abc"
    (old / "vllm").mkdir(parents=True)
    (old / "key.json").write_text("{}")
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "environ").write_bytes(b"A=1\0VLLM_CACHE_ROOT=" + str(old / "vllm").encode() + b"\0B=2\0")
    store = CacheStore()
    store.adopted(config, "vllm", 4242, proc)
    store.adopted(config, "other", 999, proc)  # gone: nothing
    assert store.in_use == {"vllm": "0.31.0-abc"}

    async def launch() -> None:
        await store.apply(config, "vllm-b", launch_spec("vllm", config, {}), {}, inside("sha256:" + "f" * 64))
        await store.swept()

    asyncio.run(launch())
    assert old.is_dir(), "in use by the adopted rank: kept beyond keep"
    assert len(store.status(config)["keys"]) == 2

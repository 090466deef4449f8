"""Preflight in container mode: what the node's container needs from the host, as PASS/WARN/FAIL/SKIP checks.

The engine is present and answers; the image is there (or how to pull it); every device and bind-mount source of
the run line exists on the host; the datasystem worker's working folder is not on a bind mount that breaks
`dscli start` (openYuanrong FAQ §2); Ascend MindCluster's Container Manager does not run beside us unless the
config says the two coexist. Everything is read through `hostfacts.Host` (fixture trees and fake engines in
tests). `nodeagent.preflight` registers `check_container` and leaves the programs inside to the image.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.config_container import NO_CONTAINER
from nodeagent.container_options import ContainerRenderError
from nodeagent.render_container import ContainerSpec, render_container

if TYPE_CHECKING:
    from nodeagent.config_model import Config
    from nodeagent.hostfacts import Host

Check = tuple[str, str, str, str]
"""(name, status, value, hint): `nodeagent.preflight` makes its `Check` of each (no import back into it)."""

CONTAINER_MANAGER = "container-manager"
"""MindCluster's binary (/usr/local/bin/container-manager, unit container-manager.service)."""


def _check(name: str, status: str, value: str, hint: str = "") -> Check:
    return (name, status, value, hint)


def bind_sources(spec: ContainerSpec) -> list[tuple[str, str]]:
    """(host path, container path) of each `-v` of the run line that names a host path (not a named volume)."""
    out = []
    for opt in spec.options:
        if opt.canonical == "--volume" and opt.value:
            parts = opt.value.split(":")
            if parts[0].startswith("/"):
                out.append((parts[0], parts[1] if len(parts) > 1 else parts[0]))
    return out


def devices(spec: ContainerSpec) -> list[str]:
    return [opt.value.split(":")[0] for opt in spec.options if opt.canonical == "--device" and opt.value]


def check_container(config: Config, host: Host) -> Iterable[Check]:
    if config.container is None:
        yield NO_CONTAINER
        return
    try:
        spec = render_container(config, which=host.which)
    except ContainerRenderError as exc:
        yield _check("container_engine", "FAIL", str(exc), "apt-get install docker.io (or podman)")
        return
    engine, image = spec.engine, spec.image
    if host.which(engine) is None:
        yield _check("container_engine", "FAIL", f"{engine} not found on PATH", f"install {engine} or set "
                     "container.engine to the one installed")  # fmt: skip
        return
    version = host.run([*spec.cli("version", "--format", "{{.Client.Version}}" if engine == "docker"
                                   else "{{.Version}}")], timeout=15)  # fmt: skip
    answers = host.run([*spec.cli("info", "--format", "{{json .}}")], timeout=20)
    if answers is None:
        how = "systemctl start docker" if engine == "docker" else f"{engine} info (its error says why)"
        yield _check("container_engine", "FAIL", f"{engine} {(version or '?').strip()} does not answer `info`", how)
        return
    yield _check("container_engine", "PASS", f"{engine} {(version or '?').strip()} answers")
    if host.run([*spec.cli("image", "inspect", image)], timeout=20) is not None:
        yield _check("container_image", "PASS", f"{image} present locally")
    else:
        yield _check("container_image", "WARN", f"{image} is not present locally: the first start pulls it",
                     f"{engine} pull {image} beforehand (offline: {engine} load -i IMAGE.tar)")  # fmt: skip
    missing_dev = [d for d in devices(spec) if not host.file(d).exists()]
    if missing_dev:
        yield _check("container_devices", "FAIL", "missing on the host: " + ", ".join(missing_dev),
                     "install the Ascend driver (HDK), or drop them from the line with container.run_args: "
                     + ", ".join(f"'!--device={d}'" for d in missing_dev))  # fmt: skip
    else:
        yield _check("container_devices", "PASS", ", ".join(devices(spec)) or "no --device on the run line")
    missing = [src for src, _dst in bind_sources(spec) if not host.file(src).exists()]
    if missing:
        yield _check("container_mounts", "FAIL", "bind-mount sources missing on the host: " + ", ".join(missing),
                     "create them, install what provides them (the driver, npu-smi, hccn.conf), or drop them with "
                     "container.run_args: " + ", ".join(f"'!-v {dst}'" for src, dst in bind_sources(spec)
                                                        if src in missing))  # fmt: skip
    else:
        yield _check("container_mounts", "PASS", f"{len(bind_sources(spec))} bind-mount sources exist")
    yield from _dscli_workdir(config, spec)
    yield _container_manager(config, host)


def _dscli_workdir(config: Config, spec: ContainerSpec) -> Iterable[Check]:
    from nodeagent.render import datasystem_workdir

    for name, comp in config.active_components().items():
        if comp.kind != "datasystem" or not comp.container:
            continue
        folder = Path(datasystem_workdir(config, name, comp))
        on = [dst for _src, dst in bind_sources(spec) if folder == Path(dst) or Path(dst) in folder.parents]
        if on and not any(Path(dst) == Path("/tmp") for dst in on):
            yield _check("dscli_workdir", "WARN", f"{name}: dscli's working folder {folder} is on the bind mount "
                         f"{on[-1]}: `dscli start` exits 255 there (openYuanrong FAQ §2: chmod of its socket fails)",
                         f"give it a folder such as /tmp/ (the FAQ's `dscli start -d /tmp/`): components.{name}."
                         "workdir: /tmp/<folder>")  # fmt: skip
        else:
            yield _check("dscli_workdir", "PASS", f"{name}: {folder}" + (" (under /tmp)" if on else ""))


def _container_manager(config: Config, host: Host) -> Check:
    assert config.container is not None
    found = sorted(pid for pid, prog in host.programs_running().items() if prog == CONTAINER_MANAGER)
    if not found:
        return _check("container_manager", "PASS", "MindCluster Container Manager is not running")
    what = f"MindCluster Container Manager runs (pid {', '.join(map(str, found))})"
    if config.container.coexist_with_container_manager:
        return _check("container_manager", "WARN", what + "; the config says they coexist",
                      "make sure its -ctrStrategy leaves this container alone (never)")
    return _check("container_manager", "FAIL", what + ": it stops and restarts containers that mount faulty "
                  "chips and forbids restart policies, fighting the agent over this container",
                  "systemctl disable --now container-manager, or set container.coexist_with_container_manager: "
                  "true when it is configured to leave this container alone")  # fmt: skip

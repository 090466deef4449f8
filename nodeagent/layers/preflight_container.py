"""Preflight in container mode: what the node's container needs from the host, as PASS/WARN/FAIL/SKIP checks.

The engine is present and answers; the image is there (or how to pull it); every device and bind-mount source of
the run line exists on the host, and each adaptation of the guide's defaults to this host is a WARN naming it
(`nodeagent.container.host`: dropped NPU devices and driver paths on a `node.npus: 0` host, folders created,
`--runtime runc`, `--ulimit`); the datasystem worker's working folder is not on a bind mount that breaks
`dscli start` (openYuanrong FAQ §2); Ascend MindCluster's Container Manager does not run beside us unless the
config says the two coexist. Everything is read through `hostfacts.Host` (fixture trees and fake engines in
tests). `nodeagent.layers.preflight` registers `check_container` and leaves the programs inside to the image.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.config.container import NO_CONTAINER
from nodeagent.config.container_options import ContainerRenderError
from nodeagent.container.render import ContainerSpec, host_facts, render_container

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.node.hostfacts import Host

Check = tuple[str, str, str, str]
"""(name, status, value, hint): `nodeagent.layers.preflight` makes its `Check` of each (no import back into it)."""

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
        spec = render_container(config, which=host.which, facts=host_facts(config, host))
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
    yield from _devices_and_mounts(spec, host)
    yield from _runtime_and_limits(spec)
    yield from _dscli_workdir(config, spec)
    yield _container_manager(config, host)


def _said(spec: ContainerSpec, topic: str) -> str:
    return "; ".join(a.text for a in spec.adaptations if a.topic == topic)


def _devices_and_mounts(spec: ContainerSpec, host: Host) -> Iterable[Check]:
    """What the line still names that the host lacks FAILs (the engine would refuse it); what was adapted WARNs."""
    dropped = _said(spec, "devices")
    missing_dev = [d for d in devices(spec) if not host.file(d).exists()]
    if missing_dev:
        yield _check("container_devices", "FAIL", "missing on the host: " + ", ".join(missing_dev),
                     "install the Ascend driver (HDK); a host without NPUs says node.npus: 0 (the guide's devices are "
                     "then left out), or drop them with container.run_args: "
                     + ", ".join(f"'!--device={d}'" for d in missing_dev))  # fmt: skip
    elif dropped:
        yield _check("container_devices", "WARN", dropped, "on an NPU host: install the driver and set node.npus")
    else:
        yield _check("container_devices", "PASS", ", ".join(devices(spec)) or "no --device on the run line")
    adapted = _said(spec, "mounts")
    missing = [src for src, _dst in bind_sources(spec) if not host.file(src).exists()
               and src not in spec.create_on_host]  # fmt: skip
    if missing:
        yield _check("container_mounts", "FAIL", "bind-mount sources missing on the host: " + ", ".join(missing)
                     + (f" ({adapted})" if adapted else ""),
                     "create them, install what provides them (the driver, npu-smi, hccn.conf), or drop them with "
                     "container.run_args: " + ", ".join(f"'!-v {dst}'" for src, dst in bind_sources(spec)
                                                        if src in missing))  # fmt: skip
    elif adapted:
        yield _check("container_mounts", "WARN", adapted, "create or install what is missing to keep the guide's "
                     "line (tzdata for the time zone), or set container.run_args yourself")  # fmt: skip
    else:
        yield _check("container_mounts", "PASS", f"{len(bind_sources(spec))} bind-mount sources exist")


def _runtime_and_limits(spec: ContainerSpec) -> Iterable[Check]:
    problem = next((a.text for a in spec.problems if a.topic == "runtime"), None)
    runtime = spec.global_args[1] if spec.global_args[:1] == ("--runtime",) else \
        next((o.value for o in spec.options if o.canonical == "--runtime"), None)
    if problem:
        yield _check("container_runtime", "FAIL", problem, "apt-get install runc, or set container.runtime")
    elif _said(spec, "runtime"):
        yield _check("container_runtime", "WARN", _said(spec, "runtime"), "container.runtime chooses another "
                     "(a configured runtime is always used as it is)")  # fmt: skip
    else:
        yield _check("container_runtime", "PASS", f"{runtime} (configured)" if runtime else
                     f"{spec.engine}'s default runtime")  # fmt: skip
    limits = _said(spec, "ulimits")
    if limits:
        yield _check("container_ulimits", "WARN", limits, "other values: --ulimit in container.run_args")
    else:
        set_here = [" ".join(o.words()) for o in spec.options if o.canonical == "--ulimit"]
        yield _check("container_ulimits", "PASS", ", ".join(set_here) + " (run_args)" if set_here else
                     "the engine's default rlimits (CAP_SYS_RESOURCE held)")  # fmt: skip


def _dscli_workdir(config: Config, spec: ContainerSpec) -> Iterable[Check]:
    from nodeagent.render.launch import datasystem_workdir

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

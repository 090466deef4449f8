"""The `container:` section: run the stack inside the vllm-ascend image, as the deployment guide does.

Absent, every component is a host process (as before). Present, the agent keeps one container per node (the
guide's `start-docker.sh` line, `nodeagent.container.render`) and runs each component inside it, except those
that say `container: false` (e.g. etcd on the host). The lifecycle decisions are `nodeagent.container.plan`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Literal

from msgspec import Meta, field

from nodeagent.config.base import Check, RuleProblem, Strict
from nodeagent.config.container_options import guide_options, merge_options

GUIDE_IMAGE = "quay.io/ascend/vllm-ascend:v0.20.2rc1"
GUIDE_NAME = "ds_v4_flash_yr"

_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")


def _container_name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(f"{value!r} is not a container name (letters, digits, then also _ . -)")
    return value


def _run_arg(value: str) -> str:
    text = value.removeprefix("!")
    if not text.startswith("-") or text in ("-", "--"):
        raise ValueError(f"{value!r}: each run_args entry is one option (`--flag=value`, `--flag value`, "
                         "`-v SRC:DST`), optionally prefixed with ! to remove a default")
    return value


RunArg = Annotated[str, Check(_run_arg)]


class ContainerConfig(Strict, frozen=True):
    """The node's container, created with the guide's `start-docker.sh` line (`nodeagentctl render container`
    prints it); every component runs inside unless it says `container: false`."""

    engine: Literal["docker", "podman"] | None = None
    """The container engine's CLI; default: whichever is on PATH when the agent renders the run line, docker
    first."""
    image: Annotated[str, Meta(min_length=1)] = GUIDE_IMAGE
    """The image CANN, torch-npu and vllm-ascend live in (the guide's; `docker pull` it first)."""
    name: Annotated[str, Check(_container_name)] = GUIDE_NAME
    """The container's name (the guide's `start-docker.sh` second argument)."""
    run_args: list[RunArg] = field(default_factory=list)
    """Options of the run line on top of the guide's `start-docker.sh` flags, one option per entry
    (`--shm-size=64g`, `-v /models:/models`, `-e HCCL_BUFFSIZE=512`). An option the defaults already have is
    replaced: single-valued flags by name (`--name`, `--shm-size`, `-w`, `--net`, ...), `-v` by its container
    path, `--device` by its device path, `-e` by variable, `--ulimit` by limit. `!` first removes a default:
    `!--device=/dev/davinci_manager` that one, `!--device` every device, `!-v /data` the mount at /data.
    The defaults (never these entries) adapt to the host, each change said by preflight and `render container`:
    missing NPU devices and driver paths left out when `node.npus: 0`, a missing zoneinfo left out, a missing
    /home, /mnt, /tmp or /data created, `--ulimit` without CAP_SYS_RESOURCE."""
    setup: list[Annotated[list[str], Meta(min_length=1)]] = field(default_factory=list)
    """Commands run inside once per new container before any component starts (the guide's `git am` patches,
    `pip install` of the datasystem wheel), in order; a failure names the step and holds the stack."""
    runtime: str | None = None
    """The OCI runtime (`podman --runtime runc`, `docker run --runtime=runc`), always used as given; default: the
    engine's, except podman's crun on hybrid cgroups it refuses, where the agent uses runc and says so."""
    on_stop: Literal["stop", "remove", "keep"] = "stop"
    """What the agent does to the container when it stops: stop it (kept for inspection), remove it, or leave it
    running."""
    coexist_with_container_manager: bool = False
    """Ascend MindCluster's Container Manager stops and restarts containers that mount faulty chips and forbids
    restart policies: it fights the agent over this container, so preflight FAILs while it runs, unless this says
    the two are meant to coexist (e.g. its `-ctrStrategy=never`)."""
    stop_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    """Grace the engine gives the container on stop before SIGKILL; its components are stopped first, and the
    guide's entrypoint (bash as PID 1) ignores SIGTERM, so the engine always waits this long."""

    def _problems(self) -> Iterator[RuleProblem]:
        for i, step in enumerate(self.setup):
            if not step or not step[0]:
                yield ("setup", i), f"setup step {i + 1} must name a program"
        try:
            options = merge_options(guide_options({}), self.run_args)  # a removal that removes nothing raises
        except ValueError as exc:
            yield "run_args", str(exc)
            return
        if not any(o.canonical == "--name" and o.value for o in options):
            yield "run_args", "run_args removes --name: the agent finds its container by name"


NO_CONTAINER = ("container", "SKIP", "no container: section (the components run on the host)", "")
"""Preflight's row without container mode (here, so the host agent need not import the container checks)."""

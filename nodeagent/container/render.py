"""Pure rendering of the node's container: the guide's `start-docker.sh` run line, and the engine commands.

The defaults are exactly the options `start-docker.sh` passes (`tests/golden/start-docker.sh`, compared flag for
flag by `tests/test_render_container.py`); `container.run_args` adds, replaces or removes options by the rules
of `nodeagent.config.container_options`. Given the host's facts, the defaults adapt to a host that lacks what they name
(`nodeagent.container.host`); the spec carries each adaptation so that whoever shows the line says it.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.config.container import ContainerConfig
from nodeagent.config.container_options import ContainerRenderError, RunOption, guide_options, merge_options
from nodeagent.container.host import Adaptation, HostFacts, adapt, read_host_facts

if TYPE_CHECKING:
    from nodeagent.config.model import Config
    from nodeagent.node.hostfacts import Host

ENGINES = ("docker", "podman")


def pick_engine(which: Callable[[str], str | None] = shutil.which) -> str:
    for engine in ENGINES:
        if which(engine):
            return engine
    raise ContainerRenderError("container: neither docker nor podman is on PATH; install one or set "
                               "container.engine")


@dataclass(frozen=True)
class ContainerSpec:
    engine: str
    name: str
    image: str
    options: tuple[RunOption, ...]
    global_args: tuple[str, ...] = ()
    """Engine options before the subcommand (podman's `--runtime` is one)."""
    command: tuple[str, ...] = ()
    """After the image; the guide's line has none (its entrypoint `bash -it` waits forever)."""
    adaptations: tuple[Adaptation, ...] = ()
    """How the guide's defaults were adapted to this host (`nodeagent.container.host`)."""
    problems: tuple[Adaptation, ...] = ()
    """What the host lacks that no adaptation fixes (preflight FAILs)."""
    create_on_host: tuple[str, ...] = ()
    """Missing bind-mount sources the agent creates before the run line (as docker would)."""

    def cli(self, *args: str) -> tuple[str, ...]:
        """An engine command (`podman --runtime runc ARGS...`)."""
        return (self.engine, *self.global_args, *args)

    def run_argv(self) -> tuple[str, ...]:
        """Create and start the container, detached (the guide's line)."""
        words = [w for opt in self.options for w in opt.words()]
        return self.cli("run", *words, self.image, *self.command)

    def fingerprint(self) -> str:
        """What a running container must have been created with; a change is a planned recreate."""
        data = {"image": self.image, "run": list(self.run_argv()[1:])}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def inspect_argv(self) -> tuple[str, ...]:
        return self.cli("inspect", "--type", "container", self.name)

    def start_argv(self) -> tuple[str, ...]:
        return self.cli("start", self.name)

    def unpause_argv(self) -> tuple[str, ...]:
        return self.cli("unpause", self.name)

    def stop_argv(self, timeout_s: float) -> tuple[str, ...]:
        return self.cli("stop", "-t", str(max(0, round(timeout_s))), self.name)

    def kill_argv(self, signal: str = "KILL") -> tuple[str, ...]:
        return self.cli("kill", "-s", signal, self.name)

    def rm_argv(self) -> tuple[str, ...]:
        """Remove at once: the guide's entrypoint (bash as PID 1) ignores SIGTERM, so a grace only waits."""
        return self.cli("rm", "-f", *(("-t", "0") if self.engine == "podman" else ()), self.name)

    def events_argv(self) -> tuple[str, ...]:
        """One JSON object per line for each event of this container."""
        fmt = "json" if self.engine == "podman" else "{{json .}}"
        return self.cli("events", "--filter", f"container={self.name}", "--format", fmt)

    def exec_argv(self, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None,
                  unset: Sequence[str] = (), interactive: bool = False, tty: bool = True) -> tuple[str, ...]:
        """Run `argv` inside; `env` is set on top of the image's environment, `unset` removed from it.
        `interactive`: this process's stdin goes in (`-i`), with a terminal (`-t`) when `tty`."""
        words: list[str] = ["exec"]
        if interactive:
            words.append("-it" if tty else "-i")
        if cwd is not None:
            words += ["-w", str(cwd)]
        for key, value in (env or {}).items():
            words += ["-e", f"{key}={value}"]
        words.append(self.name)
        if unset:
            words += ["env", *(w for var in unset for w in ("-u", var)), "--"]
        return self.cli(*words, *argv)

    def shell(self) -> str:
        """The run line as the guide writes it: one option per line."""
        head = " ".join(shlex.quote(w) for w in self.cli("run"))
        lines = [head] + [" ".join(shlex.quote(w) for w in opt.words()) for opt in self.options]
        lines.append(" ".join(shlex.quote(w) for w in (self.image, *self.command)))
        return " \\\n    ".join(lines)


def render_container(config: Config | ContainerConfig, env: Mapping[str, str] | None = None,
                     which: Callable[[str], str | None] = shutil.which, facts: HostFacts | None = None,
                     npu_less: bool | None = None) -> ContainerSpec:  # fmt: skip
    """The node's container (`config.container`); `env` supplies `-e http_proxy=...` (default: empty). With
    `facts` (`host_facts`), start-docker.sh's defaults adapt to that host; without, the line is the guide's.
    `npu_less` defaults to the config's `node.npus: 0` (a bare section: an NPU host)."""
    container = config if isinstance(config, ContainerConfig) else config.container
    if container is None:
        raise ContainerRenderError("this config has no container: section (its components are host processes)")
    engine = container.engine or pick_engine(which)
    defaults = [replace(o, value=container.name) if o.flag == "--name" else o for o in guide_options(env or {})]
    options = merge_options(defaults, container.run_args)
    runtime = container.runtime
    notes: tuple[Adaptation, ...] = ()
    problems: tuple[Adaptation, ...] = ()
    create: tuple[str, ...] = ()
    if facts is not None:
        if npu_less is None:
            npu_less = not isinstance(config, ContainerConfig) and config.node.npus == 0
        adapted = adapt(options, engine, runtime, facts, npu_less)
        options, runtime = list(adapted.options), adapted.runtime
        notes, problems, create = adapted.notes, adapted.problems, adapted.create
    global_args: tuple[str, ...] = ()
    if runtime and engine == "podman":
        global_args = ("--runtime", runtime)
    elif runtime and not any(o.canonical == "--runtime" for o in options):
        options.append(RunOption("--runtime", runtime, True))
    name = next((o.value for o in options if o.canonical == "--name" and o.value), container.name)
    return ContainerSpec(engine=engine, name=name, image=container.image, options=tuple(options),
                         global_args=global_args, adaptations=notes, problems=problems, create_on_host=create)


def host_facts(config: Config | ContainerConfig, host: Host | None = None) -> HostFacts:
    """This host's facts for the config's container (`host`: default the real one, PATH as the environment's)."""
    from nodeagent.node.hostfacts import Host

    host = host or Host()
    container = config if isinstance(config, ContainerConfig) else config.container
    if container is None:
        raise ContainerRenderError("this config has no container: section (its components are host processes)")
    return read_host_facts(container, container.engine or pick_engine(host.which), host)


exec_argv = ContainerSpec.exec_argv
"""`exec_argv(spec, argv, env, cwd)`: the engine command that runs a component inside the container."""


def _mounted_at_same_path(options: Sequence[RunOption], path: Path) -> bool:
    """A read-write `-v SRC:DST` of the line with SRC == DST covers `path` (the container sees it where the host
    does, and the stack can write there: a `:ro` mount of a parent does not cover a state folder)."""
    for opt in options:
        if opt.canonical != "--volume" or not opt.value:
            continue
        parts = opt.value.split(":")
        if len(parts) > 2 and "ro" in parts[2].split(","):
            continue
        if len(parts) >= 2 and parts[0] == parts[1] and parts[0].startswith("/") and \
                (path == Path(parts[0]) or Path(parts[0]) in path.parents):
            return True
    return False


def shared_folders(config: Config) -> list[Path]:
    """The agent's folders an in-container component uses that the host reads or writes too, which must be at
    the same path inside: the state folder (each component's cwd, TMPDIR and written files), the components' own
    workdirs, the worker's liveness file's folder (the agent's probe reads it) and the compile caches' folder
    (`agent.caches`: kept across a recreate)."""
    folders = [config.agent.state_dir]
    if config.agent.caches.enabled:
        folders.append(config.agent.cache_dir)
    for comp in config.active_components().values():
        if not comp.container:
            continue
        if comp.workdir is not None:
            folders.append(Path(comp.workdir))
        liveness = getattr(comp, "liveness_check_path", None)
        if comp.kind == "datasystem" and liveness is not None:
            folders.append(Path(liveness).parent)
    out: list[Path] = []
    for folder in sorted({Path(f) for f in folders}, key=lambda f: len(f.parts)):
        if not any(f == folder or f in folder.parents for f in out):
            out.append(folder)
    return out


def agent_mounts(config: Config, spec: ContainerSpec) -> list[RunOption]:
    """`-v DIR:DIR` for each shared folder no mount of the line covers (the guide's line mounts /home, /tmp,
    /data and /mnt: a state folder under one of them needs nothing)."""
    return [RunOption("-v", f"{f}:{f}") for f in shared_folders(config) if not _mounted_at_same_path(spec.options, f)]


def container_spec(config: Config, env: Mapping[str, str] | None = None,
                   which: Callable[[str], str | None] = shutil.which,
                   facts: HostFacts | None = None) -> ContainerSpec:  # fmt: skip
    """The container the agent runs: the rendered line (adapted to `facts`) plus the agent's shared folders
    (`agent_mounts`)."""
    spec = render_container(config, env, which, facts)
    extra = agent_mounts(config, spec)
    return replace(spec, options=(*spec.options, *extra)) if extra else spec

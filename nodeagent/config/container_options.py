"""The container run line's options and what makes two of them "the same" (pure; no config import).

Single-valued flags are one option by canonical name (`--net` = `--network`, `-w` = `--workdir`, ...); repeatable
ones by what they address (`-v` by container path, `--device` by device path, `-e` by variable, `--ulimit` by
limit, `--mount`/`--tmpfs` by target). `merge_options` applies `container.run_args` to the guide's defaults: a
replaced option keeps the default's place, new ones go before the image, `!OPTION` removes (`!--device` every
device, `!--device=/dev/hisi_hdc` that one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

ALIASES = {
    "-v": "--volume", "-e": "--env", "-w": "--workdir", "--net": "--network", "-d": "--detach",
    "-i": "--interactive", "-t": "--tty", "-u": "--user", "-h": "--hostname", "-p": "--publish", "-m": "--memory",
    "-l": "--label",
}  # fmt: skip


def _before(sep: str) -> Callable[[str], str]:
    return lambda value: value.split(sep, 1)[0]


def _volume_target(value: str) -> str:
    parts = value.split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def _device_path(value: str) -> str:
    parts = value.split(":")
    return parts[1] if len(parts) > 1 and parts[1].startswith("/") else parts[0]


def _mount_target(value: str) -> str:
    for item in value.split(","):
        key, _, val = item.partition("=")
        if key in ("target", "dst", "destination"):
            return val
    return value


# Repeatable options and what identifies one of them; every other flag is single-valued (keyed by its name).
REPEATABLE: dict[str, Callable[[str], str]] = {
    "--volume": _volume_target, "--device": _device_path, "--env": _before("="), "--ulimit": _before("="),
    "--mount": _mount_target, "--tmpfs": _before(":"), "--label": _before("="), "--sysctl": _before("="),
    "--add-host": _before(":"), "--cap-add": str, "--cap-drop": str, "--security-opt": str, "--group-add": str,
    "--dns": str, "--dns-search": str, "--dns-option": str, "--publish": str, "--expose": str, "--env-file": str,
    "--device-cgroup-rule": str, "--volumes-from": str, "--attach": str,
}  # fmt: skip


class ContainerRenderError(ValueError):
    """The container section cannot be rendered (no engine on PATH, a run_args entry that removes nothing)."""


@dataclass(frozen=True)
class RunOption:
    flag: str
    """As written (`--net`, `-v`, `-it`)."""
    value: str | None = None
    joined: bool = False
    """`--net=host` (one word) rather than `-w /home` (two)."""
    guide: bool = field(default=False, compare=False)
    """One of start-docker.sh's own options, not replaced by run_args: only these adapt to the host
    (`nodeagent.container.host`); an operator's run_args are never altered."""

    @classmethod
    def parse(cls, text: str) -> RunOption:
        """`--flag=value`, `--flag value`, `-v SRC:DST` or a bare flag."""
        head, space, rest = text.partition(" ")
        flag, eq, value = head.partition("=")
        if eq and flag.startswith("--"):
            return cls(flag, value + space + rest, joined=True)
        if space:
            return cls(head, rest.strip())
        return cls(head)

    def words(self) -> tuple[str, ...]:
        if self.value is None:
            return (self.flag,)
        return (f"{self.flag}={self.value}",) if self.joined else (self.flag, self.value)

    @property
    def canonical(self) -> str:
        return ALIASES.get(self.flag, self.flag)

    def key(self) -> tuple[str, str | None]:
        """Two options with the same key are the same option (the later replaces the earlier)."""
        by = REPEATABLE.get(self.canonical)
        return (self.canonical, by(self.value) if by and self.value is not None else None)


GUIDE_DEVICES = ("/dev/davinci_manager", "/dev/hisi_hdc", "/dev/devmm_svm")
DRIVER_MOUNTS = ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi", "/etc/ascend_install.info",
                 "/usr/local/sbin", "/etc/hccn.conf")  # fmt: skip
"""What the Ascend driver (HDK) install puts on an NPU host, mounted at the same path."""
DATA_MOUNTS = ("/home", "/mnt", "/tmp", "/data")
"""The host folders the guide shares with the container (scripts, weights, logs)."""
ZONEINFO = "/usr/share/zoneinfo/Asia/Shanghai"
"""Mounted at /etc/localtime: the container keeps China Standard Time like its host."""


def guide_options(env: Mapping[str, str]) -> list[RunOption]:
    """`start-docker.sh`'s options in its order; `-e http_proxy="$http_proxy"` takes the value from `env`."""
    opts = [RunOption("--name", "NAME"), RunOption("-it"), RunOption("-d"), RunOption("--net", "host", True),
            RunOption("--shm-size", "800g", True), RunOption("--privileged", "true", True), RunOption("-w", "/home")]
    opts += [RunOption("--device", dev, True) for dev in GUIDE_DEVICES]
    opts.append(RunOption("--entrypoint", "bash", True))
    opts += [RunOption("-v", f"{path}:{path}") for path in (*DRIVER_MOUNTS, *DATA_MOUNTS)]
    opts.append(RunOption("-v", f"{ZONEINFO}:/etc/localtime"))
    opts += [RunOption("-e", f"{var}={env.get(var, '')}") for var in ("http_proxy", "https_proxy")]
    return [RunOption(o.flag, o.value, o.joined, guide=True) for o in opts]


def guide_paths() -> list[str]:
    """The host paths start-docker.sh's line names (its devices and bind-mount sources)."""
    return [*GUIDE_DEVICES, *DRIVER_MOUNTS, *DATA_MOUNTS, ZONEINFO]


def merge_options(defaults: Sequence[RunOption], run_args: Iterable[str]) -> list[RunOption]:
    """Apply run_args in order: remove (`!`), replace in place (same key), or append."""
    out = list(defaults)
    for text in run_args:
        if text.startswith("!"):
            gone = RunOption.parse(text[1:])
            keep = [o for o in out if not (o.canonical == gone.canonical
                                           and (gone.value is None or o.key() == gone.key()))]
            if len(keep) == len(out):
                raise ContainerRenderError(f"container.run_args: {text!r} removes nothing (no such option)")
            out = keep
            continue
        new = RunOption.parse(text)
        at = next((i for i, o in enumerate(out) if o.key() == new.key()), None)
        if at is None:
            out.append(new)
        else:
            out[at] = new
    return out

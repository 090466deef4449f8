"""The node's container: the guide's `start-docker.sh` run line, flag for flag, and how run_args change it.

bash runs the guide's script verbatim (tests/golden/start-docker.sh) with a recording `docker` first on PATH; we
compare its argv with `render_container` of a config naming the same image and container, on an NPU host as the
guide expects it (every device and path there: nothing adapts; tests/test_container_host.py has the rest).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.config.container import ContainerConfig
from nodeagent.config.container_options import ContainerRenderError, RunOption, guide_paths
from nodeagent.config.load import parse_config
from nodeagent.container.host import HostFacts
from nodeagent.container.render import render_container
from nodeagent.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "golden" / "start-docker.sh"
IMAGE, NAME = "quay.io/ascend/vllm-ascend:v0.20.2rc1", "ds_v4_flash_yr"
PROXY_ENV = {"http_proxy": "http://proxy.example:3128"}  # https_proxy unset: the script passes it empty


def recording_engine(tmp_path: Path, engine: str = "docker") -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / engine
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['RECORD'], 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    return bin_dir


def run_start_docker_sh(tmp_path: Path, *args: str) -> list[str]:
    record = tmp_path / "argv.json"
    env = {"PATH": f"{recording_engine(tmp_path)}:/usr/bin:/bin", "RECORD": str(record), **PROXY_ENV}
    subprocess.run(["bash", str(SCRIPT), *args], env=env, check=True, timeout=30, capture_output=True)
    return json.loads(record.read_text())


def config_with(container: str, components: str = "") -> object:
    return parse_config(f"node: {{name: n1, ip: 127.0.0.1}}\ncontainer: {container}\n{components}")


def test_guide_script_equals_render(tmp_path: Path) -> None:
    guide = run_start_docker_sh(tmp_path, IMAGE, NAME)
    config = config_with(f"{{engine: docker, image: '{IMAGE}', name: {NAME}}}")
    for facts in (None, HostFacts()):  # no facts, or an NPU host's: every path there, unified cgroups, CAP held
        spec = render_container(config, PROXY_ENV, facts=facts)
        assert spec.run_argv() == ("docker", *guide)
        assert (spec.engine, spec.name, spec.image) == ("docker", NAME, IMAGE) and spec.adaptations == ()
    assert guide[-1] == IMAGE and "-e" in guide and "https_proxy=" in guide  # the script ran as the guide wrote it


def test_guide_defaults_are_the_sections_defaults(tmp_path: Path) -> None:
    guide = run_start_docker_sh(tmp_path, IMAGE, NAME)
    spec = render_container(ContainerConfig(), PROXY_ENV, which=lambda e: f"/usr/bin/{e}")
    assert spec.run_argv()[1:] == tuple(guide)


def host_tree(root: Path, lacking: tuple[str, ...] = ()) -> Path:
    """A host as the guide expects it (its devices and mount sources), less `lacking`."""
    for path in guide_paths():
        if path not in lacking:
            (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (root / path.lstrip("/")).touch()
    return root


def render_cli(tmp_path: Path, cfg: Path, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", **PROXY_ENV}
    return subprocess.run([sys.executable, "-m", "nodeagent.cli", "render", "container", *extra, "--config", str(cfg),
                           "--root", str(root)], capture_output=True, text=True, timeout=60, env=env)  # fmt: skip


def test_render_container_command_prints_the_run_line(tmp_path: Path) -> None:
    guide = run_start_docker_sh(tmp_path, IMAGE, "box1")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"node: {{name: n1, ip: 127.0.0.1}}\ncontainer: {{engine: docker, image: '{IMAGE}', name: box1}}\n"
                   "components:\n  etcd: {kind: etcd, container: false}\n  w: {kind: process, command: [sleep, '9']}\n")
    root = host_tree(tmp_path / "a2")
    out = render_cli(tmp_path, cfg, root, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["argv"] == ["docker", *guide] and data["components"] == ["w"] and data["adapted"] == []
    text = render_cli(tmp_path, cfg, root).stdout
    # The printed line, run by a shell, is the same argv.
    record = tmp_path / "printed.json"
    script = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    subprocess.run(["bash", "-c", script], check=True, timeout=30,
                   env={"PATH": f"{recording_engine(tmp_path)}:/usr/bin:/bin", "RECORD": str(record)})
    assert json.loads(record.read_text()) == guide


def test_render_container_shows_the_line_adapted_to_this_host(tmp_path: Path) -> None:
    """A host without NPUs (node.npus: 0) and without /data: the line used, and each adaptation said."""
    guide = run_start_docker_sh(tmp_path, IMAGE, "box1")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"node: {{name: n1, ip: 127.0.0.1, npus: 0}}\n"
                   f"container: {{engine: docker, image: '{IMAGE}', name: box1}}\n")
    root = host_tree(tmp_path / "devbox", ("/dev/davinci_manager", "/dev/hisi_hdc", "/dev/devmm_svm",
                                           "/usr/local/Ascend/driver", "/data"))  # fmt: skip
    data = json.loads(render_cli(tmp_path, cfg, root, "--json").stdout)
    expected = list(guide)
    for dev in ("/dev/davinci_manager", "/dev/hisi_hdc", "/dev/devmm_svm"):
        expected.remove(f"--device={dev}")
    at = expected.index("/usr/local/Ascend/driver:/usr/local/Ascend/driver")
    del expected[at - 1:at + 1]
    assert data["argv"] == ["docker", *expected] and data["create_on_host"] == ["/data"]
    text = render_cli(tmp_path, cfg, root).stdout
    said = [line for line in text.splitlines() if line.startswith("# adapted to this host")]
    assert len(said) == 3 and "(devices): dropped --device /dev/davinci_manager" in said[0]
    assert "/usr/local/Ascend/driver" in said[1] and "/data missing on the host" in said[2]
    line = "\n".join(x for x in text.splitlines() if not x.startswith("#"))
    assert "--device" not in line and "-v /data:/data" in line


def test_render_container_without_section_says_so(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("node: {name: n1, ip: 127.0.0.1}\ncomponents: {w: {kind: process, command: [sleep, '9']}}\n")
    out = subprocess.run([sys.executable, "-m", "nodeagent.cli", "render", "container", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 4 and "no container: section" in out.stderr


@pytest.mark.parametrize(("on_path", "engine"), [({"docker", "podman"}, "docker"), ({"podman"}, "podman")])
def test_engine_default_is_whichever_is_on_path_docker_first(on_path: set[str], engine: str) -> None:
    spec = render_container(ContainerConfig(), which=lambda e: f"/usr/bin/{e}" if e in on_path else None)
    assert spec.engine == engine and spec.run_argv()[0] == engine


def test_no_engine_on_path_is_a_clear_error() -> None:
    with pytest.raises(ContainerRenderError, match="neither docker nor podman"):
        render_container(ContainerConfig(), which=lambda e: None)


def argv_of(*run_args: str, **kw: object) -> list[str]:
    spec = render_container(ContainerConfig(engine="docker", run_args=list(run_args), **kw))  # type: ignore[arg-type]
    return list(spec.run_argv())


def options_of(*run_args: str) -> list[str]:
    spec = render_container(ContainerConfig(engine="docker", run_args=list(run_args)))
    return [" ".join(o.words()) for o in spec.options]


def test_a_flag_given_again_replaces_the_default_in_place() -> None:
    base = options_of()
    opts = options_of("--shm-size=64g", "-v /srv/tmp:/tmp", "--network host", "--device=/dev/davinci_manager:rw",
                      "--privileged=false", "--name=other", "-w /workspace")
    changed = {i: (a, b) for i, (a, b) in enumerate(zip(base, opts, strict=True)) if a != b}
    assert sorted(changed.values()) == sorted([
        ("--name ds_v4_flash_yr", "--name=other"), ("--net=host", "--network host"),
        ("--shm-size=800g", "--shm-size=64g"), ("--privileged=true", "--privileged=false"),
        ("-w /home", "-w /workspace"),
        ("--device=/dev/davinci_manager", "--device=/dev/davinci_manager:rw"), ("-v /tmp:/tmp", "-v /srv/tmp:/tmp"),
    ])  # fmt: skip
    assert render_container(ContainerConfig(engine="docker", run_args=["--name=other"])).name == "other"


def test_same_means_the_same_target() -> None:
    assert RunOption.parse("-v /a:/tmp:ro").key() == RunOption.parse("--volume=/b:/tmp").key()
    assert RunOption.parse("-e http_proxy=x").key() == RunOption.parse("--env http_proxy=").key()
    assert RunOption.parse("-e A=1").key() != RunOption.parse("-e B=1").key()
    assert RunOption.parse("--ulimit nofile=1:1").key() != RunOption.parse("--ulimit nproc=1:1").key()
    assert RunOption.parse("--device=/dev/x").key() == RunOption.parse("--device /dev/x:rwm").key()
    assert RunOption.parse("--device=/dev/y:/dev/x").key() == RunOption.parse("--device=/dev/x").key()
    assert RunOption.parse("-w /a").key() == RunOption.parse("--workdir=/b").key()


def test_new_options_go_before_the_image_in_order() -> None:
    argv = argv_of("-e HCCL_BUFFSIZE=512", "--ulimit nofile=1024:1024", "-v /models:/models:ro")
    assert argv[-7:] == ["-e", "HCCL_BUFFSIZE=512", "--ulimit", "nofile=1024:1024", "-v", "/models:/models:ro",
                         IMAGE]


def test_bang_removes_a_default() -> None:
    argv = argv_of("!--device=/dev/hisi_hdc", "!-v /data", "!-e https_proxy")
    assert "--device=/dev/hisi_hdc" not in argv and "--device=/dev/devmm_svm" in argv
    assert "/data:/data" not in argv and "/mnt:/mnt" in argv
    assert not any(w.startswith("https_proxy") for w in argv) and "http_proxy=" in argv
    none = argv_of("!--device", "!-v", "!-it")
    assert not any(w.startswith("--device") for w in none) and "-v" not in none and "-it" not in none
    assert none[-1] == IMAGE


def test_removing_what_is_not_there_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="removes nothing"):
        ContainerConfig(run_args=["!--device=/dev/davinci0"])
    with pytest.raises(ValueError, match="removes --name"):
        ContainerConfig(run_args=["!--name"])
    with pytest.raises(ValueError, match="one option"):
        ContainerConfig(run_args=["800g"])


def test_runtime_is_global_for_podman_and_a_run_option_for_docker() -> None:
    podman = render_container(ContainerConfig(engine="podman", runtime="runc"))
    assert podman.run_argv()[:4] == ("podman", "--runtime", "runc", "run")
    assert podman.exec_argv(["true"])[:4] == ("podman", "--runtime", "runc", "exec")
    docker = render_container(ContainerConfig(engine="docker", runtime="runc"))
    assert docker.run_argv()[:2] == ("docker", "run") and "--runtime=runc" in docker.run_argv()


def test_exec_and_lifecycle_argv() -> None:
    spec = render_container(ContainerConfig(engine="podman", name="box"))
    assert spec.exec_argv(["vllm", "serve", "m"], {"A": "1", "B": "x y"}, "/work", unset=("GOOGLE_LOGTOSTDERR",)) == (
        "podman", "exec", "-w", "/work", "-e", "A=1", "-e", "B=x y", "box",
        "env", "-u", "GOOGLE_LOGTOSTDERR", "--", "vllm", "serve", "m")  # fmt: skip
    assert spec.exec_argv(["bash"], interactive=True) == ("podman", "exec", "-it", "box", "bash")
    assert spec.exec_argv(["bash"], interactive=True, tty=False) == ("podman", "exec", "-i", "box", "bash")
    assert spec.inspect_argv() == ("podman", "inspect", "--type", "container", "box")
    assert spec.start_argv() == ("podman", "start", "box")
    assert spec.stop_argv(30) == ("podman", "stop", "-t", "30", "box")
    assert spec.rm_argv() == ("podman", "rm", "-f", "-t", "0", "box")
    assert spec.kill_argv() == ("podman", "kill", "-s", "KILL", "box")
    assert spec.events_argv()[-4:] == ("--filter", "container=box", "--format", "json")


def test_fingerprint_follows_image_and_run_args() -> None:
    base = render_container(ContainerConfig(engine="docker")).fingerprint()
    assert render_container(ContainerConfig(engine="docker")).fingerprint() == base
    assert render_container(ContainerConfig(engine="docker", image="x:1")).fingerprint() != base
    assert render_container(ContainerConfig(engine="docker", run_args=["--shm-size=1g"])).fingerprint() != base
    assert render_container(ContainerConfig(engine="docker", setup=[["true"]])).fingerprint() == base


def test_config_section_keys() -> None:
    config = config_with("{image: 'x:1', name: box, setup: [[git, am, p.patch]], on_stop: remove}",
                         "components:\n  etcd: {kind: etcd, container: false}\n")
    assert config.container is not None and config.container.on_stop == "remove"
    assert config.container.engine is None  # decided at render time
    assert config.components["etcd"].container is False
    assert parse_config("node: {name: n1, ip: 127.0.0.1}\n").container is None
    with pytest.raises(ConfigError, match="unknown key 'imgae'"):
        config_with("{imgae: 'x:1'}")
    with pytest.raises(ConfigError, match="not a container name"):
        config_with("{name: 'a b'}")
    with pytest.raises(ConfigError, match="engine"):
        config_with("{engine: lxc}")


@pytest.mark.parametrize(("words", "inside"), [
    (["--", "git", "diff", "--", "f"], ["git", "diff", "--", "f"]),  # the separator goes, the command's own stays
    (["git", "diff", "--", "f"], ["git", "diff", "--", "f"]),
    (["--", "sh", "-c", "echo -- x"], ["sh", "-c", "echo -- x"]),
    (["--"], ["bash"]),
    ([], ["bash"]),
])  # fmt: skip
def test_shell_runs_the_command_as_given(tmp_path: Path, words: list[str], inside: list[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("node: {name: n1, ip: 127.0.0.1}\ncontainer: {engine: docker, name: box1}\n")
    record = tmp_path / "argv.json"
    env = {"PATH": f"{recording_engine(tmp_path)}:/usr/bin:/bin", "RECORD": str(record)}
    out = subprocess.run([sys.executable, "-m", "nodeagent.cli", "--config", str(cfg), "shell", *words],
                         capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(record.read_text()) == ["exec", "-i", "box1", *inside], "stdin goes in (no terminal: no -t)"

"""The shipped configs run the guide's deployment as the guide runs it: inside its container, set up as it says.

bash runs the guide's own lines (tests/golden/create-container.sh → start-docker.sh, with a recording `docker`
first on PATH; tests/golden/container-setup.sh with its programs recorded) and we compare them with each shipped
config's `container:` section: the run line flag for flag, the setup steps command for command.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.config.load import load_config
from nodeagent.config.model import Config
from nodeagent.container.host import HostFacts
from nodeagent.container.render import agent_mounts, render_container

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
SHIPPED = {"dsv4-flash-a2.yaml": None, "dsv4-flash-a2-8node.yaml": "a2-0", "dsv4-flash-a2-8node.yaml@a2-5": "a2-5"}
PROXY_ENV = {"http_proxy": "http://proxy.example:3128"}
RECORDED = ("mkdir", "git", "wget", "pip", "python")


def shipped(key: str) -> Config:
    return load_config(ROOT / "config" / key.partition("@")[0], node=SHIPPED[key])


def guide_run_line(tmp_path: Path) -> list[str]:
    """The guide's `bash start-docker.sh IMAGE NAME`, run in a folder holding its start-docker.sh."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "docker"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['RECORD'], 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    (tmp_path / "start-docker.sh").write_bytes((GOLDEN / "start-docker.sh").read_bytes())
    record = tmp_path / "argv.json"
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "RECORD": str(record), **PROXY_ENV}
    subprocess.run(["bash", str(GOLDEN / "create-container.sh")], cwd=tmp_path, env=env, check=True, timeout=30,
                   capture_output=True)  # fmt: skip
    return json.loads(record.read_text())


def record_shell(script: str, tmp_path: Path, cwd: str) -> list[tuple[str, list[str]]]:
    """Run `script` under bash with the setup's programs (and cd) recorded: (working folder, argv) per call."""
    out = tmp_path / "calls.jsonl"
    out.unlink(missing_ok=True)
    rec = f"{sys.executable} -c 'import json,sys; print(json.dumps(sys.argv[1:]))' \"$CWD\""
    prelude = f"CWD={shlex.quote(cwd)}\ncd() {{ CWD=\"$1\"; }}\n" + "".join(
        f"{p}() {{ {rec} {p} \"$@\" >> {out}; }}\n" for p in RECORDED)
    subprocess.run(["bash", "-c", prelude + script], env={"PATH": "/usr/bin:/bin"}, check=True, timeout=30,
                   capture_output=True)  # fmt: skip
    calls = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return [(c[0], c[1:]) for c in calls]


def run_setup_steps(steps: list[list[str]], tmp_path: Path, workdir: str) -> list[tuple[str, list[str]]]:
    """Each step as the agent runs it: `docker exec NAME argv` in the container's -w folder; `bash -c S` runs S."""
    calls: list[tuple[str, list[str]]] = []
    for step in steps:
        script = step[2] if step[:2] == ["bash", "-c"] else shlex.join(step)
        calls += record_shell(script, tmp_path, workdir)
    return calls


@pytest.mark.parametrize("key", list(SHIPPED))
def test_the_shipped_container_is_the_guides_run_line(key: str, tmp_path: Path) -> None:
    config = shipped(key)
    assert config.container is not None, f"config/{key} runs the stack on the host; the guide runs it in a container"
    guide = guide_run_line(tmp_path)
    spec = render_container(config, PROXY_ENV, which=lambda e: f"/usr/bin/{e}", facts=HostFacts())
    assert spec.run_argv() == ("docker", *guide) and spec.adaptations == ()
    # every component inside, as the guide runs etcd, the worker and vLLM in that container
    assert all(c.container for c in config.active_components().values())
    # the patch's folder is the host's: what the operator uploads there is seen inside
    assert "/workspace:/workspace" in [o.value for o in agent_mounts(config, spec)]


@pytest.mark.parametrize("key", list(SHIPPED))
def test_the_shipped_setup_is_the_guides_steps(key: str, tmp_path: Path) -> None:
    config = shipped(key)
    assert config.container is not None
    line = guide_run_line(tmp_path)
    workdir = line[line.index("-w") + 1]  # where `docker exec` runs a step (start-docker.sh's -w /home)
    guide = record_shell((GOLDEN / "container-setup.sh").read_text(encoding="utf-8"), tmp_path, workdir)
    ours = run_setup_steps([list(s) for s in config.container.setup], tmp_path, workdir)
    assert [argv for _cwd, argv in ours] == [argv for _cwd, argv in guide]
    assert [argv[0] for _cwd, argv in guide] == ["mkdir", "git", "git", "git", "wget", "pip", "python"]
    by_program = {tuple(argv[:2]): cwd for cwd, argv in ours}
    assert by_program[("git", "am")] == "/vllm-workspace/vllm-ascend"  # the patch goes into vllm-ascend
    url = next(argv[1] for _cwd, argv in ours if argv[0] == "wget")
    assert by_program[("pip", "install")] == by_program[("wget", url)]  # pip installs the wheel wget fetched

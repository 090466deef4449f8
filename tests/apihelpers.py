"""An in-process agent for API, metrics and CLI tests: the real Agent, Supervisor and ApiServer on a tiny config
whose components are `kind: process` one-liners, so a test boots in well under a second."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from conftest import free_port

from nodeagent.agent import Agent, load_checked
from nodeagent.api.server import ApiServer

SLEEPER = ["python3", "-c", "import time; print('a up', flush=True); time.sleep(3600)"]
TALKER = ["python3", "-c", "import time\nfor i in range(1, 6): print(f'b line {i}', flush=True)\ntime.sleep(3600)"]


async def wait_until(what: str, check: Any, timeout: float = 20.0, interval: float = 0.05,
                     detail: Any = None) -> Any:
    """The asyncio twin of conftest.wait_for: poll `check` until it returns something truthy; `detail()`, if
    given, is added to the failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}" + (f"; {detail()}" if detail else ""))


def tiny_config(home: Path, socket_path: Path | None = None, **extra: Any) -> dict[str, Any]:
    """Two process components (b depends on a), a unique cluster name (leftover cleanup of other agents on
    this shared machine matches on it), and the API on a free port (plus a unix socket if given)."""
    data: dict[str, Any] = {
        "cluster": {"name": f"t{uuid.uuid4().hex[:10]}"},
        "node": {"name": "tiny", "ip": "127.0.0.1", "role": "master"},
        "agent": {
            "state_dir": str(home / "state"),
            "log_dir": str(home / "logs"),
            "systemd_scopes": "never",
            "api": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(home / "secret" / "token"),
                    **({"unix_socket": str(socket_path)} if socket_path else {})},
        },
        "components": {
            "a": {"kind": "process", "command": SLEEPER, "stop_grace_s": 3},
            "b": {"kind": "process", "command": TALKER, "depends_on": ["a"], "stop_grace_s": 3},
        },
    }  # fmt: skip
    for key, value in extra.items():
        data[key] = value
    return data


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class InProcess:
    agent: Agent
    server: ApiServer
    session: aiohttp.ClientSession
    url: str
    token: str
    config_path: Path
    socket_dir: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as r:
            return r.status, await r.json(content_type=None)

    async def post(self, path: str, json: Any = None, auth: bool = True) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=json, headers=self.auth if auth else {}) as r:
            return r.status, await r.json(content_type=None)

    def pids(self) -> dict[str, int | None]:
        return {n: c.record.pid if c.record else None for n, c in self.agent.supervisor.components.items()}

    async def wait(self, what: str, check: Any, timeout: float = 20.0) -> Any:
        return await wait_until(what, check, timeout)

    async def wait_states(self, want: dict[str, set[str]], timeout: float = 20.0) -> None:
        comps = self.agent.supervisor.components
        await self.wait(f"states {want}", lambda: all(str(comps[n].state) in s for n, s in want.items()), timeout)

    async def close(self) -> None:
        await self.session.close()
        if not self.agent.stopping:
            self.agent.request_stop()
        await self.server.close()
        self.agent.phases.close()
        await self.agent.supervisor.shutdown()
        await self.agent.stop_mqtt()
        self.agent.supervisor.events.close()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


async def start_in_process(home: Path, data: dict[str, Any] | None = None) -> InProcess:
    """Agent + API (TCP and a unix socket in a short, world-traversable folder: sun_path is 108 bytes)."""
    home.mkdir(parents=True, exist_ok=True)
    socket_dir = Path(tempfile.mkdtemp(prefix="dsv4api-"))
    socket_dir.chmod(0o755)
    data = data or tiny_config(home)
    data["agent"]["api"]["unix_socket"] = str(socket_dir / "api.sock")
    path = write_config(home / "config.yaml", data)
    config = load_checked(path)
    agent = Agent(config, path)
    server = ApiServer(agent)
    await server.start()
    token = config.agent.api.token_file.read_text().strip()
    stack = InProcess(agent, server, aiohttp.ClientSession(), f"http://{config.agent.api.listen}", token, path,
                      socket_dir)  # fmt: skip
    try:
        agent.start_mqtt(server)  # as Agent.run does: before the first event
        agent.attach_layers()  # as Agent.run does: before the stack starts
        agent.watch_start_phases(server)
        await agent.supervisor.start()
        await stack.wait_states({name: {"running", "ready"} for name in config.active_components()})
    except BaseException:
        await stack.close()
        raise
    return stack

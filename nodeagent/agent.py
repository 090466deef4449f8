"""`dsv4-agent`: load the config, supervise the stack, talk to systemd, stop in order on SIGTERM.

Exit status: 0 after an orderly stop, 78 (EX_CONFIG) on a bad config so systemd does not loop on it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

from nodeagent import __version__
from nodeagent.config import load_config
from nodeagent.config_model import Config
from nodeagent.errors import ConfigError

DEFAULT_CONFIG = "/etc/dsv4-agent/config.yaml"


def status_line(status: dict) -> str:
    """The systemd STATUS= line: `etcd running · datasystem ready · vllm starting 12m`."""
    parts = []
    now = time.time()
    for name, comp in status["components"].items():
        text = f"{name} {comp['state']}"
        if comp["state"] in ("starting", "backoff") and comp.get("uptime_s"):
            minutes = comp["uptime_s"] / 60
            text += f" {minutes:.0f}m" if minutes >= 1 else f" {comp['uptime_s']:.0f}s"
        parts.append(text)
    del now
    return " · ".join(parts) + (" · PAUSED" if status.get("paused") else "")


class Agent:
    def __init__(self, config: Config, config_path: Path) -> None:
        from nodeagent.sdnotify import Notifier
        from nodeagent.supervisor import Supervisor

        self.config = config
        self.config_path = config_path
        self.supervisor = Supervisor(config)
        self.notifier = Notifier()
        self.stop_requested = asyncio.Event()
        self.detach = False
        self._last_status = ""

    def request_stop(self, detach: bool = False) -> None:
        self.detach = self.detach or detach
        self.stop_requested.set()

    def _publish_status(self) -> None:
        line = status_line(self.supervisor.status())
        if line != self._last_status:
            self._last_status = line
            self.notifier.status(line)

    async def _heartbeat(self) -> None:
        """WATCHDOG=1 from the main loop: if the loop stalls, systemd restarts us (and we adopt the stack)."""
        interval = self.notifier.watchdog_interval()
        period = min(interval / 3, 5.0) if interval else 5.0
        while True:
            self.notifier.watchdog()
            self._publish_status()
            await asyncio.sleep(period)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        self.config.agent.state_dir.mkdir(parents=True, exist_ok=True)
        self.config.agent.log_dir.mkdir(parents=True, exist_ok=True)
        self.supervisor.on_state_change.append(self._publish_status)
        self.supervisor.events.emit("agent_start", f"dsv4-agent {__version__} on {self.config.node.name} "
                                    f"({self.config.node.role}), config {self.config_path}")
        await self.supervisor.start()
        self.notifier.ready()
        heartbeat = asyncio.create_task(self._heartbeat())
        await self.stop_requested.wait()
        self.notifier.stopping()
        heartbeat.cancel()
        self.supervisor.events.emit("agent_stop", "detaching" if self.detach else "stopping the stack")
        await self.supervisor.shutdown(detach=self.detach)
        return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsv4-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
    parser.add_argument("--log-format", choices=["auto", "text", "json", "journal"], default="auto")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.add_argument("--version", action="version", version=f"dsv4-agent {__version__}")
    return parser.parse_args(argv)


def load_checked(path: str) -> Config:
    """The config, with residue paths vetted too: a path unsafe to delete is a config error."""
    from nodeagent.pathsafety import validate_residue_paths

    config = load_config(path)
    problems = validate_residue_paths(config)
    if problems:
        raise ConfigError("\n".join(f"{path}: {p}" for p in problems))
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_checked(args.config)
    except ConfigError as exc:
        print(f"dsv4-agent: config error:\n{exc}", file=sys.stderr)
        return ConfigError.exit_code
    if args.check:
        print(f"{args.config}: OK ({len(config.active_components())} components on this node)")
        return 0
    from nodeagent.logsetup import setup_logging

    setup_logging(config.node.name, args.log_format, args.log_level)
    try:
        return asyncio.run(Agent(config, Path(args.config)).run())
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

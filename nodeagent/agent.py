"""`dsv4-agent`: load the config, supervise the stack, talk to systemd, stop in order on SIGTERM.

Exit status: 0 after an orderly stop (or a detach), 78 (EX_CONFIG) on a bad config and 75 (EX_TEMPFAIL) when
another agent already runs on the same state dir — the unit's RestartPreventExitStatus keeps systemd from looping
on either —, 1 when the API cannot listen (before anything of the stack was touched).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

from loguru import logger

from nodeagent import __version__
from nodeagent.config.model import Config
from nodeagent.core.discovery import announce, runtime_dir, this_agent, withdraw
from nodeagent.core.errors import AgentError, ConfigError
from nodeagent.core.heartbeat import HEARTBEAT_MAX_AGE_S, Heartbeat, stale
from nodeagent.core.instance_lock import AlreadyRunning, InstanceLock
from nodeagent.core.task_owner import guarded, log_death
from nodeagent.layers.config_checks import load_checked
from nodeagent.seam.stackport import ChangeObserver, NodeLayer

if TYPE_CHECKING:
    from nodeagent.api.mqtt import MqttPublisher
    from nodeagent.api.server import ApiServer
    from nodeagent.cluster.coordinator import Coordinator
    from nodeagent.cluster.membership import Membership
    from nodeagent.cluster.pd_watch import PdWatch
    from nodeagent.cluster.proxy_evict import ProxyEvict
    from nodeagent.cluster.reset_drain import RecoveryFollower
    from nodeagent.cluster.rollout.executor import RolloutExecutor
    from nodeagent.container.mode import ContainerMode
    from nodeagent.layers.kvlog import KvTransferLog

DEFAULT_CONFIG = "/etc/dsv4-agent/config.yaml"
LOCK_HANDOVER_S = 30.0
"""How long a new agent waits for a detaching/stopping predecessor to let go of the state dir."""


def status_line(status: dict) -> str:
    """The systemd STATUS= line: `etcd running · datasystem ready · vllm starting 12m`."""
    parts = []
    for name, comp in status["components"].items():
        text = f"{name} {comp['state']}"
        if comp["state"] in ("starting", "backoff") and comp.get("uptime_s"):
            minutes = comp["uptime_s"] / 60
            text += f" {minutes:.0f}m" if minutes >= 1 else f" {comp['uptime_s']:.0f}s"
        parts.append(text)
    return " · ".join(parts) + (" · PAUSED" if status.get("paused") else "")


class Agent:
    def __init__(self, config: Config, config_path: Path, force: bool = False) -> None:
        from nodeagent.api.vllm_sampler import VllmSampler
        from nodeagent.core.events import EventBus
        from nodeagent.core.sdnotify import Notifier
        from nodeagent.layers.chip_reset import HostNpu
        from nodeagent.layers.guards import StartGuards
        from nodeagent.layers.start_phases import StartPhaseWatch
        from nodeagent.layers.weight_warm import WeightWarmer
        from nodeagent.node.nodeworld import HostWorld
        from nodeagent.node.supervisor import Supervisor

        self.config = config
        self.config_path = config_path
        # The event number carries on across agent restarts: a subscriber that sees a gap missed events.
        container: type[ContainerMode] | None = None
        if config.container is not None:  # imported only in container mode: the idle host agent stays small
            from nodeagent.container.mode import ContainerMode as container
        self.supervisor = Supervisor(config, EventBus(seq_path=config.agent.state_dir / "events.seq"),
                                     container=container, world=HostWorld())  # fmt: skip
        self.vllm_sampler = VllmSampler(self.supervisor)
        """The one sampler of the node's vLLM /metrics: /metrics, MQTT and the status page read it."""
        self.container: ContainerMode | None = cast("ContainerMode | None", self.supervisor.container)
        """The node's container (container mode), as the composition root made it for the supervisor."""
        mode = "warn" if force and config.agent.preflight == "enforce" else config.agent.preflight
        self.guards = StartGuards(self.supervisor, mode, HostNpu())
        self.weights = WeightWarmer(self.supervisor)
        """Keeps this node's weight shards in the page cache (issue 32 item 3); its loop runs from the start."""
        self.phases = StartPhaseWatch(self.supervisor)
        """Every phase of this node's vLLM starts (issue 32): /status, /metrics, their history."""
        self.mqtt: MqttPublisher | None = None
        self.notifier = Notifier()
        self.stop_requested = asyncio.Event()
        self.detach = False
        self.started_at = time.time()
        self._last_status = ""
        self._reload_lock = asyncio.Lock()
        self._background: set[asyncio.Task[object]] = set()
        self.main_beat = Heartbeat(time.monotonic())
        """The agent's main loop (the watchdog's own): with every component loop's, what WATCHDOG=1 requires."""
        self._wedged: list[str] = []
        self.lock: InstanceLock | None = None
        self.membership: Membership | None = None
        self.coordinator: Coordinator | None = None
        """This node as a cluster member (etcd); only with cluster.nodes — without it nothing imports aetcd."""
        self.rollout: RolloutExecutor | None = None
        self.recovery_follower: RecoveryFollower | None = None
        self.proxy_evict: ProxyEvict | None = None
        self.kvlog: KvTransferLog | None = None
        self.pd_watch: PdWatch | None = None

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    def request_stop(self, detach: bool = False) -> None:
        self.detach = self.detach or detach
        self.stop_requested.set()
        if self.lock is not None:
            self.lock.update({"phase": "detaching" if self.detach else "stopping"})

    async def reload(self) -> dict[str, object]:
        """Re-read the config file; restart only what changed. A bad config raises ConfigError and changes nothing.

        Every component is rendered with the new config first, so a config that would fail half-way through
        the supervisor's reload is refused whole.
        """
        from nodeagent.render.launch import render_component

        async with self._reload_lock:
            self.notifier.reloading()
            try:
                config = await asyncio.to_thread(load_checked, str(self.config_path))
                try:
                    for name in config.active_components():
                        render_component(name, config, self.supervisor.base_env)
                    result = self.supervisor.reload(config)
                except (ValueError, AgentError) as exc:
                    raise ConfigError(f"{self.config_path}: {exc}") from None
            except ConfigError as exc:
                self.supervisor.events.emit("reload_failed", f"config reload refused, nothing changed: {exc}",
                                            None, "error")  # fmt: skip
                raise
            finally:
                self.notifier.ready()
            for key in ("api", "mqtt", "ui"):
                if getattr(config.agent, key) != getattr(self.config.agent, key):
                    logger.warning(f"agent.{key} changed: it takes effect when the agent restarts")
            self.config = config
            if self.membership is not None:
                self.membership.update_config(config)
            started = f"; started {', '.join(result['started'])}" if result.get("started") else ""
            logger.info(f"reload: restarted {', '.join(result['restarted']) or 'nothing'}{started}")
            return dict(result)

    def _reload_on_signal(self) -> None:
        if self.stopping:
            logger.warning("SIGHUP ignored: the agent is stopping")
            return

        async def run() -> None:
            with contextlib.suppress(ConfigError):
                await self.reload()

        task = asyncio.create_task(run(), name="reload:SIGHUP")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(log_death)

    def _publish_status(self) -> None:
        line = status_line(self.supervisor.status())
        if line != self._last_status:
            self._last_status = line
            self.notifier.status(line)

    async def _heartbeat(self) -> None:
        """WATCHDOG=1 from the main loop while every loop ticks: if the loop stalls, or a component's loop hangs or
        died, systemd restarts us (and the next agent adopts the stack)."""
        interval = self.notifier.watchdog_interval()
        period = min(interval / 3, 5.0) if interval else 5.0
        while True:
            self.watchdog_tick(time.monotonic())
            guarded("the STATUS= line", self._publish_status)
            await asyncio.sleep(period)

    def watchdog_tick(self, now: float) -> bool:
        """Ping systemd's watchdog if every loop ticked recently (`heartbeat.watchdog_ok`); whether it was pinged.
        A withheld ping is logged (with the loops that are stale) when the set of stale loops changes."""
        self.main_beat.tick(now)
        beats = {"main": self.main_beat, **self.supervisor.heartbeats()}
        wedged = stale(beats, now, HEARTBEAT_MAX_AGE_S)
        if wedged != self._wedged:
            self._wedged = wedged
            if wedged:
                ages = ", ".join(f"{name} {beats[name].age(now):.0f}s" for name in wedged)
                guarded("an event", self.supervisor.events.emit, "watchdog_withheld", f"WATCHDOG=1 withheld: not "
                        f"ticked for over {HEARTBEAT_MAX_AGE_S:.0f}s: {ages}; systemd restarts the agent at "
                        "WatchdogSec, the next one adopts the stack", None, "critical")  # fmt: skip
            else:
                logger.info("every loop ticks again: WATCHDOG=1 resumed")
        if wedged:
            return False
        self.notifier.watchdog()
        return True

    def _make_cluster(self) -> None:
        """This node as a cluster member (only with `cluster.nodes`): made here, attached by `attach_layers`,
        started by `_start_cluster`."""
        if not self.config.cluster.nodes:
            return
        from nodeagent.cluster.coordinator import Coordinator
        from nodeagent.cluster.membership import Membership
        from nodeagent.cluster.proxy_evict import ProxyEvict
        from nodeagent.cluster.reset_drain import RecoveryFollower
        from nodeagent.cluster.rollout.executor import RolloutExecutor

        self.membership = Membership(self.config, self.supervisor)
        self.coordinator = Coordinator(self.config, self.supervisor, self.membership)
        self.proxy_evict = ProxyEvict(self.coordinator)
        self.recovery_follower = RecoveryFollower(self.coordinator, self.supervisor, self.proxy_evict)
        self._make_pd_watches()
        self.rollout = RolloutExecutor(self.coordinator, self)

    def _start_cluster(self) -> None:
        """Join the cluster without waiting for etcd: on the master the supervisor is only starting it."""
        if self.membership is None or self.coordinator is None or self.rollout is None:
            return
        self.membership.start()
        self.coordinator.start()
        self.rollout.start()
        for work in (self.kvlog.run() if self.kvlog else None, self.pd_watch.run() if self.pd_watch else None):
            if work is not None:
                self.coordinator.spawn(work)

    def layers(self) -> list[NodeLayer]:
        """Every layer of this node, in the order the node asks them — written here only (no layer attaches
        itself). A start gate's earliest hold kind wins whatever the order (`stackport.HOLD_ORDER`); a failure's
        `decide` and an operator's `command` take the first layer that answers, so who decides first is this
        list's order. Observers (`ChangeObserver`) answer nothing: they are only told of every change."""
        co = self.coordinator
        cluster: list[NodeLayer | None] = [] if co is None else [
            co.ft,  # vLLM's FT retry: sees every rank failure first, takes none (escalates through co)
            co,  # a rank's failure → the group's next generation; an operator's restart of a rank → the group's
            self.proxy_evict,  # a rank dead here leaves every PD proxy at once (report only)
            self.recovery_follower,  # a chip reset or an isolation here drains the groups
            self.kvlog, self.pd_watch,  # report only
            self.rollout,  # holds a step's ranks (gate only)
        ]  # fmt: skip
        container = self.container
        return [layer for layer in (
            self.guards,  # preflight, NPU health: gates only
            self.guards.recovery,  # the NPU ladder: holds NPU users while resetting/isolated, notes their failures
            self.guards.headroom,  # a dead datasystem worker waits for the ranks that map its memory
            self.weights,  # warms the weight shards (report only)
            self.phases,  # report only: the phase each loading vLLM is in
            *cluster,
            container,  # the node's container: its death decides for the components inside
            ChangeObserver(self._publish_status),  # sd_notify's STATUS= line
            ChangeObserver(self.membership.status_changed) if self.membership else None,  # the member record
            ChangeObserver(self.mqtt.status_changed) if self.mqtt else None,  # MQTT's status
        ) if layer is not None]  # fmt: skip

    def watch_start_phases(self, api: ApiServer) -> None:
        """Issue 32: each vLLM start's phases followed (until `phases.close`) and exported on /metrics."""
        if api.api is not None:
            api.api.agent_metrics.attach_phases(self.phases)
        self.phases.start()

    def attach_layers(self) -> None:
        """Attach `layers()` to the node, once, before its components run."""
        for layer in self.layers():
            self.supervisor.attach(layer)

    # ---- the rollout's view of the config (cluster.rollout.ConfigHost) ------------------------------------------
    def running_config(self) -> Config:
        return self.config

    def read_config_file(self, path: str | None = None) -> Config:
        """This node's file as it is on disk now (the operator installs a rollout's new file first)."""
        return load_checked(path or str(self.config_path), self.config.node.name)

    def stage_config(self, config: Config) -> None:
        """A rollout's staging: the next start of every component uses `config`; nothing restarts now."""
        self.supervisor.reload(config, restart=False)
        self.config = config
        if self.membership is not None:
            self.membership.update_config(config)

    def container_pending(self) -> str | None:
        container = self.container
        return container.pending(self.supervisor.config) if container is not None else None

    def recreate_container(self) -> str | None:
        container = self.container
        return container.reconfigure(self.supervisor.config) if container is not None else None

    def _make_pd_watches(self) -> None:
        """Issue 19 items 2, 3, 6: this node's KV transfer failures (from its ranks' logs) for the member record;
        on the PD proxy's node, the end-to-end probes, prefill's KV while decode is down, the pairs' failures."""
        from nodeagent.cluster.pd_watch import PdWatch
        from nodeagent.layers.kvlog import KvTransferLog

        assert self.coordinator is not None and self.membership is not None
        if not self.config.recovery.pd.enabled:
            return
        self.kvlog = KvTransferLog(self.config, self.supervisor)
        if self.coordinator.proxies:
            members = self.membership.members
            records = lambda: {n: m.record for n, m in members.items()}  # noqa: E731
            self.pd_watch = PdWatch(self.coordinator, None, records)  # its settings and model: the config now

    def start_mqtt(self, api: ApiServer | None = None) -> None:
        """With `agent.mqtt` only: without it not even the module is imported. Call before the first event."""
        if self.config.agent.mqtt is None or self.mqtt is not None:
            return
        from nodeagent.api.mqtt import MqttPublisher

        self.mqtt = MqttPublisher(self.config, self.supervisor, self.vllm_sampler, started_at=self.started_at)
        self.mqtt.start()
        if api is not None and api.api is not None:
            api.api.agent_metrics.attach_mqtt(self.mqtt)

    async def stop_mqtt(self) -> None:
        if self.mqtt is not None:
            await self.mqtt.close("detached" if self.detach else "stopped")

    async def run(self) -> int:
        # The lock first: a second agent on this state dir must touch nothing (not even the API's token file).
        self.lock = InstanceLock(self.config.agent.state_dir)
        try:
            await asyncio.to_thread(self.lock.acquire, {"api": self.config.agent.api.listen, "phase": "starting",
                                                       "config": str(self.config_path)}, LOCK_HANDOVER_S)  # fmt: skip
        except AlreadyRunning as exc:
            logger.error(str(exc))
            self.lock = None
            return AlreadyRunning.exit_code
        try:
            return await self._run_locked()
        finally:
            self.lock.release()

    async def _run_locked(self) -> int:
        from nodeagent.api.server import ApiServer

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._reload_on_signal)
        self.config.agent.state_dir.mkdir(parents=True, exist_ok=True)
        self.config.agent.log_dir.mkdir(parents=True, exist_ok=True)
        # The API next: if it cannot listen we exit before touching the stack (the next agent adopts it).
        api = ApiServer(self)
        try:
            await api.start()
        except AgentError as exc:
            logger.error(str(exc))
            return 1
        assert api.api is not None
        api.api.agent_metrics.attach_npu(self.guards.npu)  # the NPU faults, HBM and RoCE series on /metrics
        api.api.agent_metrics.attach_weights(self.weights)  # the shards resident in the page cache
        assert self.lock is not None
        self.lock.update({"phase": "running"})
        announcement = self._announce()
        try:
            self.start_mqtt(api)
            self.supervisor.events.emit("agent_start", f"dsv4-agent {__version__} on {self.config.node.name} "
                                        f"({self.config.node.role}), config {self.config_path}")
            # READY=1 once the API answers, not when vLLM is ready: loading the model takes 30-60 min.
            self.notifier.ready()
            await self.guards.start()
            self._make_cluster()
            self.attach_layers()  # before the stack: every gate (preflight, barriers, the container) in place
            self.watch_start_phases(api)
            self._start_cluster()
            warm = asyncio.create_task(self.weights.run(), name="warm-weights")  # before the first rank's start
            warm.add_done_callback(log_death)
            container = self.container
            if container is not None:
                await container.start()  # before the stack: its components adopt or wait for it
            await self.supervisor.start()
            heartbeat = asyncio.create_task(self._heartbeat(), name="watchdog")
            heartbeat.add_done_callback(log_death)
            await self.stop_requested.wait()
            self.notifier.stopping()
            if self.mqtt is not None:
                self.mqtt.set_agent_state("stopping")
            heartbeat.cancel()
            self.weights.close()
            warm.cancel()
            self.phases.close()
            if self.rollout is not None:
                await self.rollout.stop()
            if self.coordinator is not None:
                await self.coordinator.stop()
            if self.membership is not None:
                # Leaving: the key goes now. Detaching: it stays until its TTL, or the next agent takes it over.
                await self.membership.stop(leave=not self.detach)
            self.supervisor.events.emit("agent_stop", "detaching" if self.detach else "stopping the stack")
            # The API keeps answering (status, events) while the stack drains.
            await self.guards.close()
            if container is not None:
                await container.stop_watching()  # our own stop of the stack is no death
            await self.supervisor.shutdown(detach=self.detach)
            if container is not None:
                await container.finish(self.detach)
            await self.stop_mqtt()
        finally:
            if announcement is not None:
                withdraw(announcement)
            await api.close()
            await self.vllm_sampler.close()
            self.supervisor.events.close()
        return 0

    def _announce(self) -> Path | None:
        """Tell `nodeagentctl` on this host where this agent is (`nodeagent.core.discovery`); never fatal."""
        settings, folder = self.config.agent, runtime_dir()
        me = this_agent(str(self.config_path), settings.api.listen, _str(settings.api.unix_socket),
                        str(settings.api.token_file), str(settings.state_dir), str(settings.log_dir),
                        self.config.node.name, self.config.cluster.name)  # fmt: skip
        try:
            return announce(folder, me)
        except OSError as exc:
            logger.warning(f"cannot announce this agent in {folder}: {exc} (nodeagentctl will need --config)")
            return None


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsv4-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
    parser.add_argument("--log-format", choices=["auto", "text", "json", "journal"], default="auto")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.add_argument("--force", action="store_true",
                        help="start the stack even if preflight fails (its failures become warnings)")
    parser.add_argument("--version", action="version", version=f"dsv4-agent {__version__}")
    return parser.parse_args(argv)


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
    from nodeagent.core.logsetup import setup_logging

    setup_logging(config.node.name, args.log_format, args.log_level)
    try:
        return asyncio.run(Agent(config, Path(args.config), force=args.force).run())
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

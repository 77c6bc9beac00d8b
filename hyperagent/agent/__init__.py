"""The node daemon: sources -> snapshot -> /metrics and MQTT; applies the coordinator's settings.

``Agent`` composes its parts, each the one owner of its state:

- :mod:`~hyperagent.agent.collection`: the collection loop (sources read, indicators derived,
  the snapshot exposed, the telemetry published);
- :mod:`~hyperagent.agent.gpus`: which GPUs each job holds here (attribution and the
  scheduler's word) and the per-job summary the coordinator finds jobs by;
- :mod:`~hyperagent.agent.settings`: the settings path (verify, bound, apply, ack), the
  applied versions, the power caps and the job events that restore and re-apply them;
- :mod:`~hyperagent.agent.trials`: the trial measurer (step clocks, energy, reports);
- :mod:`~hyperagent.agent.reports`: the reports sent, kept until confirmed, and resent;
- :mod:`~hyperagent.agent.devices`: the agent's own device calls, through the gates;
- :mod:`~hyperagent.agent.stats`: what it did with the coordinator's messages, counted.

The parts import downwards in that list's reverse order (stats and devices at the bottom);
none imports this package's ``__init__``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from hyperagent import bus
from hyperagent.actuators import PowerCapActuator
from hyperagent.agent.collection import LAST_COLLECTION, Collection, telemetry_payload
from hyperagent.agent.devices import DeviceCalls
from hyperagent.agent.gpus import JobGpus
from hyperagent.agent.reports import Reports
from hyperagent.agent.settings import SettingsPath, power_actuator
from hyperagent.agent.stats import AgentStats, self_readings
from hyperagent.agent.trials import Trials
from hyperagent.config import Config
from hyperagent.errors import PayloadError
from hyperagent.exporter import MetricsServer, SnapshotCollector
from hyperagent.notify import Notifier
from hyperagent.readings import Reading, Snapshot
from hyperagent.replay import Recorder
from hyperagent.signing import TrustedKeys
from hyperagent.sources import Hardware, build_sources
from hyperagent.sources.base import Source
from hyperagent.sources.job import JobSource
from hyperagent.sources.runner import SourceRunner

__all__ = ["LAST_COLLECTION", "Agent", "AgentStats", "telemetry_payload"]

log = logging.getLogger(__name__)


class Agent:
    """One node's agent. Build with ``Agent.from_config``; run with ``await agent.run()``."""

    def __init__(
        self,
        config: Config,
        hardware: Hardware,
        *,
        link: bus.MqttLink | None = None,
        trusted_keys: TrustedKeys | None = None,
        metrics: MetricsServer | None = None,
        recorder: Recorder | None = None,
        sources: list[Source] | None = None,
        notifier: Notifier | None = None,
        applied_file: Path | None = None,
    ) -> None:
        """``sources`` default to the ones ``config`` enables, over ``hardware``;
        ``trusted_keys`` are the public keys whose settings it applies (none: it refuses every
        setting); ``applied_file`` keeps the settings versions applied per job across
        restarts."""
        self._config = config
        self.notifier = notifier or Notifier()
        self.node = config.node
        self.topics = bus.Topics(config.cluster)
        self.hardware = hardware
        self.link = link
        self.stats = AgentStats()
        if sources is None:
            sources = build_sources(config, hardware)
        self.runner = SourceRunner(sources, config.sources.timeout_s, config.sources.intervals)
        self.job_source = next((s for s in self.runner.sources if isinstance(s, JobSource)), None)
        self.collection = Collection(
            config,
            self.runner,
            node_readings=self._node_readings,
            summary=self._telemetry_summary,
            link=link,
            metrics=metrics,
            recorder=recorder,
            notifier=self.notifier,
        )
        self.devices = DeviceCalls(config, hardware, self.runner, lambda: self.snapshot)
        self.nvml_source = self.devices.nvml_source
        self.accelerator_source = self.devices.accelerator_source
        self.gpus = JobGpus(config, hardware, self.job_source, self.devices)
        self.reports = Reports(link, self.topics, self.node, self.stats)
        self.trials = Trials(
            self.job_source, self.devices, self.reports, self.stats, lambda: self.snapshot
        )
        self.settings = SettingsPath(
            config,
            self.topics,
            link,
            trusted_keys,
            power_actuator(config, hardware, self.accelerator_source),
            self.job_source,
            self.gpus,
            self.trials,
            self.stats,
            applied_file,
        )
        self._wire()

    def _wire(self) -> None:
        """The parts hear the job channel's events, the attribution's answers and the
        coordinator's messages."""
        self.gpus.listeners.append(self.settings.held_changed)
        source = self.job_source
        if source is not None:
            source.listeners.append(self.trials.on_step)
            source.rank_listeners += [self.trials.rank_left, self.settings.rank_left]
            source.attach_listeners += [self.settings.rank_attached, self.gpus.rank_attached]
            source.release_listeners += [
                self.trials.job_released,
                self.gpus.job_released,
                self.settings.job_released,
            ]
        link = self.link
        if link is not None:
            link.subscribe(self.topics.settings("+"), 1, self.settings.on_settings)
            link.subscribe(self.topics.coordinator_status(), 1, self._on_coordinator_status)
            link.subscribe(self.topics.receipt("+", self.node), 1, self.reports.on_receipt)
            for job in self.settings.applied.messages:
                self.settings.follow_job(job)

    @classmethod
    def from_config(
        cls,
        config: Config,
        hardware: Hardware | None = None,
        trusted_keys: TrustedKeys | None = None,
        sources: list[Source] | None = None,
        recorder: Recorder | None = None,
    ) -> Agent:
        """An agent wired as the config says (broker link, metrics server)."""
        link = None
        if config.mqtt.enabled:
            link = bus.link_from_config(
                config,
                f"hyperagent-agent-{config.node}",
                status_node=config.node,
                spool_dir=config.agent.state_dir / "spool",
                gated=True,
                username=config.node,
            )
        metrics = (
            MetricsServer(config.agent.metrics_address) if config.agent.metrics_address else None
        )
        if hardware is None:
            from hyperagent.capture.directory import configured_hardware

            hardware = configured_hardware(config)
        return cls(
            config,
            hardware,
            link=link,
            trusted_keys=trusted_keys,
            metrics=metrics,
            recorder=recorder,
            sources=sources,
            applied_file=config.agent.state_dir / "applied-settings.json" if link else None,
        )

    # -- what the parts hold, as the agent's --------------------------------------------

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """A new configuration, seen by every part from their next use of it on."""
        self._config = config
        for part in (self.collection, self.devices, self.gpus, self.settings):
            part.config = config

    @property
    def snapshot(self) -> Snapshot | None:
        return self.collection.snapshot

    @property
    def collections(self) -> int:
        return self.collection.collections

    @property
    def collector(self) -> SnapshotCollector:
        return self.collection.collector

    @property
    def ready(self) -> asyncio.Event:
        """Set once the first collection is done."""
        return self.collection.ready

    @property
    def metrics(self) -> MetricsServer | None:
        return self.collection.metrics

    @property
    def actuator(self) -> PowerCapActuator | None:
        return self.settings.actuator

    @property
    def applied_messages(self) -> dict[str, dict[str, Any]]:
        """job -> the settings message applied last."""
        return self.settings.applied.messages

    @property
    def applied_versions(self) -> dict[str, int]:
        """job -> the settings version applied last."""
        return self.settings.applied.versions

    @property
    def live_versions(self) -> dict[str, int]:
        """Versions applied to the hardware and the job by this process."""
        return self.settings.applied.live

    @property
    def unconfirmed(self) -> dict[tuple[str, int], tuple[str, bytes, float]]:
        """(job, version) -> the final reports the coordinator has not confirmed yet."""
        return self.reports.unconfirmed

    def job_gpus(self, job: str, live: list[str] | None = None) -> tuple[set[int], bool]:
        """The GPUs ``job`` is known to hold here, and whether they are its own
        (:meth:`JobGpus.job_gpus`)."""
        return self.gpus.job_gpus(job, live)

    async def collect_once(self) -> Snapshot:
        """One cycle: read every source, derive indicators, expose and publish."""
        return await self.collection.collect_once()

    async def _apply(self, job: str, message: dict[str, Any], again: bool = False) -> None:
        await self.settings.apply(job, message, again)

    def _jobs_summary(self) -> dict[str, Any]:
        return self.gpus.summary()

    # -- running -------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until cancelled; on the way out restore power limits and close sources.

        Raises SocketInUse when another agent listens on the job socket."""
        if self.job_source is not None:
            await self.job_source.start()
            self.gpus.scheduled.held_on_node()  # Slurm's jobs here, asked before a rank attaches
            self.trials.trials_changed()
            self.settings.send_applied()
        await self.runner.start()
        await self.settings.start()
        metrics = self.metrics
        if metrics is not None:
            metrics.start()
            log.info("serving /metrics on %s:%s", metrics.host, metrics.port)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.collection.loop(), name="collect")
                tasks.create_task(self.trials.loop(), name="trials")
                tasks.create_task(self.trials.stall_loop(), name="stalls")
                tasks.create_task(self.settings.job_loop(), name="job-caps")
                tasks.create_task(self.reports.loop(), name="resend")
                tasks.create_task(self.notifier.watchdog(self.collection.alive), name="watchdog")
                if self.link is not None:
                    tasks.create_task(self.link.run(), name="mqtt")
                await self._until_stopped()
        finally:
            self.notifier.stopping()
            await self._shutdown()
            self.notifier.close()

    async def _until_stopped(self) -> None:
        """Wait to be stopped; then, while the link still runs, say offline (a clean
        disconnect sends no last will)."""
        try:
            await asyncio.Future()
        except asyncio.CancelledError:
            if self.link is not None:
                await self.link.disconnect([bus.status_message(self.topics, self.node, "offline")])
            raise

    async def _shutdown(self) -> None:
        await self.settings.restore()
        await self.gpus.scheduled.close()
        await self.runner.close()
        if self.metrics is not None:
            self.metrics.stop()

    # -- glue between the parts ----------------------------------------------------------

    async def _node_readings(self, readings: list[Reading], now: float) -> list[Reading]:
        """The agent's own readings after the sources': its counters, when this collection
        ran and the device gates' failed calls, then which job holds which GPU (from all
        the readings before)."""
        out = self_readings(self.stats, self.link, len(self.reports.unconfirmed))
        out.append(Reading(LAST_COLLECTION, now, {}, unit="s"))
        out += self.devices.gate_readings()
        return out + await self.gpus.readings(readings + out)

    def _telemetry_summary(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The jobs here and what this node can apply, for the telemetry."""
        return self.gpus.summary(), self.settings.actuation(self.collection.gpu_model)

    async def _on_coordinator_status(self, topic: str, payload: bytes) -> None:
        """The coordinator's status: the link's gate opens while it is online, when reports
        unconfirmed go again at once; the settings path hears of it too."""
        try:
            state = bus.decode(payload, "status")["state"] if payload else None
        except PayloadError:
            self.stats.invalid_payloads += 1
            return
        if self.link is not None:
            self.link.open_gate(state == "online")
        if state == "online":
            self.reports.resend_all()
        await self.settings.coordinator_status(state)

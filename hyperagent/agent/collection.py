"""The collection loop: every ``agent.interval_s`` the sources are read and the node's own
readings added, indicators derived, the snapshot exposed on /metrics (and recorded, when
recording) and, every ``agent.telemetry_interval_s``, the node's summary published for the
coordinator (``telemetry_payload``)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hyperagent import bus, ticks
from hyperagent.config import Config
from hyperagent.devices.metrics import ENERGY as GPU_ENERGY
from hyperagent.exporter import MetricsServer, SnapshotCollector
from hyperagent.indicators import JobWindows, derive
from hyperagent.notify import Notifier
from hyperagent.readings import Reading, Snapshot
from hyperagent.replay import Recorder
from hyperagent.sources.runner import DUE_FRACTION, SourceRunner

LAST_COLLECTION = "hyperagent_agent_last_collection_timestamp_seconds"

NodeReadings = Callable[[list[Reading], float], Awaitable[list[Reading]]]
"""(the sources' readings, the collection's time) -> the node's own readings to add."""

Summary = Callable[[], tuple[dict[str, Any], dict[str, Any]]]
"""() -> the jobs on this node and what it can apply, for the telemetry."""


class Collection:
    """Reads the sources on the collection's schedule; owns the latest snapshot, the count
    of collections and when the last one ran."""

    def __init__(
        self,
        config: Config,
        runner: SourceRunner,
        *,
        node_readings: NodeReadings,
        summary: Summary,
        link: bus.MqttLink | None = None,
        metrics: MetricsServer | None = None,
        recorder: Recorder | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.node = config.node
        self.topics = bus.Topics(config.cluster)
        self.runner = runner
        self.node_readings = node_readings
        self.summary = summary
        self.link = link
        self.metrics = metrics
        self.recorder = recorder
        self.notifier = notifier or Notifier()
        self.collector = metrics.collector if metrics else SnapshotCollector()
        self.snapshot: Snapshot | None = None
        self.job_windows = JobWindows()
        self.collections = 0
        self.last_collection = time.monotonic()
        self.gpu_model: str | None = None
        """The GPUs' model, as the first collection that named one said."""
        self.ready = asyncio.Event()
        """Set once the first collection is done."""
        self._telemetry_at = -math.inf

    async def loop(self) -> None:
        """A cycle every ``agent.interval_s``, on multiples of it on the loop's clock (see
        :mod:`hyperagent.ticks`); a cycle that overran its interval is followed at once."""
        interval = self.config.agent.interval_s
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self.collect_once()
            if not self.ready.is_set():
                self.ready.set()
                where = (
                    f", /metrics on {self.metrics.host}:{self.metrics.port}" if self.metrics else ""
                )
                self.notifier.ready(f"collecting {len(self.runner.sources)} sources{where}")
            await ticks.sleep_until(ticks.next_tick(began, interval))

    def alive(self) -> bool:
        """Collections keep coming (the watchdog's test)."""
        stalled_after = 3 * self.config.agent.interval_s + self.config.sources.timeout_s
        return time.monotonic() - self.last_collection < stalled_after

    async def collect_once(self) -> Snapshot:
        """One cycle: read every source, derive indicators, expose and publish."""
        by_source = await self.runner.read_by_source()
        now = time.time()
        if self.recorder is not None:
            self.recorder.write(now, by_source)
        readings = [r for batch in by_source.values() for r in batch]
        readings += self.runner.health_readings()
        readings += await self.node_readings(readings, now)
        snapshot = Snapshot(now, self.node, tuple(readings))
        indicators = derive(
            snapshot,
            self.snapshot,
            self.config.indicators.quantum_coefficients,
            self.job_windows,
        )
        snapshot = snapshot.extended(indicators)
        self.snapshot = snapshot
        if self.gpu_model is None:
            self.gpu_model = next(
                (
                    r.labels["model"]
                    for r in readings
                    if r.name == "hyperagent_gpu_info" and r.labels.get("model")
                ),
                None,
            )
        self.collector.update(snapshot.readings)
        self.collections += 1
        self.last_collection = time.monotonic()
        telemetry_due = self.last_collection - self._telemetry_at >= (
            DUE_FRACTION * self.config.agent.telemetry_interval_s
        )
        if self.link is not None and telemetry_due:
            self._telemetry_at = self.last_collection
            jobs, actuation = self.summary()
            self.link.publish(
                self.topics.telemetry(self.node),
                telemetry_payload(snapshot, indicators, jobs, actuation),
            )
        return snapshot


def telemetry_payload(
    snapshot: Snapshot,
    indicators: list[Reading],
    jobs: dict[str, Any] | None = None,
    actuation: dict[str, Any] | None = None,
) -> bytes:
    """The node's summary for MQTT: indicators, GPU power and energy, which sources are up,
    and each job's running totals (samples and step seconds, both summed over the job's ranks
    here, and ``ranks``: how many connected ranks reported steps, so that the node's throughput
    is the change of samples over the change of step seconds divided by ranks), from which the
    coordinator follows throughput after tuning. The full detail stays on /metrics for
    Prometheus: a summary keeps a cluster's telemetry small enough for one broker."""
    power = snapshot.total("hyperagent_gpu_power_watts")
    energy = snapshot.total(GPU_ENERGY)
    up = {
        f"{r.labels.get('source')}/{r.labels.get('target')}": r.value
        for r in snapshot.readings
        if r.name == "hyperagent_source_up"
    }
    return bus.encode(
        {
            "node": snapshot.node,
            "ts": snapshot.ts,
            "jobs": jobs or {},
            **({"actuation": actuation} if actuation is not None else {}),
            "gpu_power_w": power,
            "gpu_energy_j": energy,
            "sources_up": up,
            "indicators": {
                _indicator_key(r): r.value
                for r in indicators
                if r.name != "hyperagent_gpu_quantum_coefficient"
            },
        }
    )


def _indicator_key(reading: Reading) -> str:
    name = reading.name.removeprefix("hyperagent_")
    return (
        name
        if not reading.labels
        else name + "{" + ",".join(f"{k}={v}" for k, v in sorted(reading.labels.items())) + "}"
    )

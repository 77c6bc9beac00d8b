"""The node daemon: sources -> snapshot -> /metrics and MQTT; applies the coordinator's settings."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from hyperagent import bus, durable, ticks
from hyperagent.actuators import PowerCapActuator
from hyperagent.attribution import Attribution, ChannelJobs, JobLedger, passwd_file
from hyperagent.config import Config
from hyperagent.devices.metrics import ENERGY as GPU_ENERGY
from hyperagent.devices.nvml_telemetry import running_pids
from hyperagent.devices.source import AcceleratorSource
from hyperagent.errors import ActuationError, DeviceCallError, PayloadError
from hyperagent.exporter import MetricsServer, SnapshotCollector
from hyperagent.gate import DeviceGate
from hyperagent.indicators import JobWindows, derive
from hyperagent.job import JobSettings, StepReport
from hyperagent.notify import Notifier
from hyperagent.readings import Kind, Reading, Snapshot
from hyperagent.replay import Recorder
from hyperagent.signing import TrustedKeys
from hyperagent.sources import Hardware, build_sources
from hyperagent.sources.base import Source
from hyperagent.sources.job import JobSource
from hyperagent.sources.job_scheduler import ScheduledJobs
from hyperagent.sources.nvml import NvmlSource
from hyperagent.sources.runner import DUE_FRACTION, SourceRunner
from hyperagent.sources.slurm_jobs import SlurmJobs
from hyperagent.sources.smi_text import SmiTextSource
from hyperagent.tuner.trial import Measurement, MeasurementPlan, Phase, TrialMeasurement

log = logging.getLogger(__name__)

STALL_STEPS = 8
"""A job whose steps stop for this many times its median step interval has stalled ..."""

STALL_MIN_S = 2.0
"""... and for at least this long (a busy machine's hiccups are not a hang)."""

STALL_CHECK_S = 0.1
"""How often running trials are checked for a stalled job."""

RESEND_S = 5.0
"""A measurement report the coordinator has not confirmed (its receipt) is sent again this
often, and at once when the coordinator says it is online (it may have lost its session)."""

UNCONFIRMED_MAX = 256
"""Reports kept for resending at most (the oldest go first)."""

LAST_COLLECTION = "hyperagent_agent_last_collection_timestamp_seconds"
DEVICE_CALL_FAILURES = "hyperagent_device_call_failures_total"

_T = TypeVar("_T")


@dataclass
class _StepClock:
    """When one job's steps arrive on this node (monotonic wall time), per connected rank."""

    last: dict[int, float] = field(default_factory=dict)
    """Connected rank -> when its last step arrived."""
    latest: float | None = None
    """When the job's last step arrived (from any rank, connected or gone)."""
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=64))

    def tick(self, rank: int, now: float) -> None:
        """A step of ``rank`` arrived at ``now`` (a rank's steps in order; ranks' steps read
        in a pass, one rank after another)."""
        previous = self.last.get(rank)
        if previous is not None:
            self.intervals.append(now - previous)
        self.last[rank] = now
        if self.latest is None or now > self.latest:
            self.latest = now

    def leave(self, rank: int) -> None:
        """``rank``'s connection closed (a rank that comes back starts its intervals anew)."""
        self.last.pop(rank, None)

    def stalled(self, now: float) -> bool:
        """No rank stepped for ``STALL_STEPS`` median intervals (and ``STALL_MIN_S``)."""
        if len(self.intervals) < 4 or self.latest is None:
            return False
        limit = max(STALL_STEPS * statistics.median(self.intervals), STALL_MIN_S)
        return now - self.latest > limit


@dataclass
class _Trial:
    job: str
    version: int
    trial: int | None
    measurement: TrialMeasurement
    energy_start_j: float | None = None
    xid_start: float = 0.0
    windows_reported: int = 0
    gpus: frozenset[int] = frozenset()
    """The job's GPUs on this node, whose energy and XIDs the trial counts (none known: the
    trial has no energy here)."""
    energy_marks: list[float | None] = field(default_factory=list)
    """The energy counter as each measurement window closed (None: it did not answer)."""

    def energy_windows(self, windows: int, end_j: float | None = None) -> list[float] | None:
        """The GPU energy of each of the first ``windows`` windows, from the counter at the
        measurement's start and as each window closed (the last at ``end_j`` for the final
        report); None when a reading is missing."""
        marks = [self.energy_start_j, *self.energy_marks[: windows - (end_j is not None)]]
        if end_j is not None:
            marks.append(end_j)
        if len(marks) != windows + 1 or windows < 1:
            return None
        known = [m for m in marks if m is not None]
        if len(known) != len(marks):
            return None
        return [b - a for a, b in itertools.pairwise(known)]


@dataclass
class AgentStats:
    """What the agent did with settings messages, for /metrics and tests."""

    applied: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    invalid_payloads: int = 0
    reports_sent: int = 0
    reports_resent: int = 0


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
        self.config = config
        self.notifier = notifier or Notifier()
        self.last_collection = time.monotonic()
        self.recorder = recorder
        self.node = config.node
        self.topics = bus.Topics(config.cluster)
        self.hardware = hardware
        if sources is None:
            sources = build_sources(config, hardware)
        self.runner = SourceRunner(sources, config.sources.timeout_s, config.sources.intervals)
        self.job_source = next((s for s in self.runner.sources if isinstance(s, JobSource)), None)
        job_config = config.sources.job
        self.scheduled = ScheduledJobs(
            SlurmJobs(job_config.scontrol) if job_config.scontrol else None,
            job_config.slurm_node or config.node,
            job_config.squeue,
        )
        """What Slurm says of the jobs whose ranks' cgroups name a Slurm job."""
        self.nvml_source = next((s for s in self.runner.sources if isinstance(s, NvmlSource)), None)
        self.accelerator_source = next(
            (s for s in self.runner.sources if isinstance(s, AcceleratorSource)), None
        )
        self.actuator = None
        devices = hardware.power_library
        if devices is None and self.accelerator_source is not None:
            devices = self.accelerator_source.library
        if config.actuation.power_cap and devices is not None:
            state_file = None if hardware.replayed else config.agent.state_dir / "power-limits.json"
            self.actuator = PowerCapActuator(
                devices, state_file, timeout_s=config.sources.timeout_s
            )
        self.link = link
        self.trusted_keys = trusted_keys
        self.metrics = metrics
        self.collector = metrics.collector if metrics else SnapshotCollector()
        self.snapshot: Snapshot | None = None
        self.job_windows = JobWindows()
        self.stats = AgentStats()
        self.applied_file = applied_file
        self.applied_messages: dict[str, dict[str, Any]] = {}
        """job -> the settings message applied last (version, settings, backend, issued_at,
        trial), kept in ``applied_file``."""
        self.live_versions: dict[str, int] = {}
        """Versions applied to the hardware and the job by this process (after a restart, or
        after the power limits were restored, the applied version is applied again)."""
        self._load_applied()
        self._trials: dict[str, _Trial] = {}
        self._trial_events: asyncio.Queue[tuple[_Trial, Phase | int]] = asyncio.Queue()
        """A trial's phase changes, and (an int) the count of its windows every rank closed."""
        self._step_clocks: dict[str, _StepClock] = {}
        self._measuring = asyncio.Event()
        """Set while a trial is measured (the stall check runs only then)."""
        self._logged_rejections: set[str] = set()
        self.collections = 0
        self._telemetry_at = -math.inf
        self._gpu_pids: dict[str, list[int]] = {}
        self._gpu_pids_at = -math.inf
        self._ranks_at_read: frozenset[int] = frozenset()
        """The ranks' pids when NVML's processes were last read: a new rank reads them again."""
        self._job_gpus: dict[str, set[int]] = {}
        """job -> the GPU indices its ranks run on (their processes, or what they declared)."""
        self.attribution = _attribution(config, hardware)
        """Which job holds each GPU, and the per-job GPU series (``[attribution]``)."""
        self._capped: dict[str, set[int]] = {}
        """job -> the GPUs its settings capped."""
        self._awaiting_gpus: dict[str, dict[str, Any]] = {}
        """job -> its latest settings message with a power cap, waiting for the job's GPUs
        on this node to be known (its ranks not attached yet, or not yet attributed)."""
        self._limits_w: tuple[float, float] | None = None
        self._gpu_model: str | None = None
        self._job_events: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        """(job, "left" | "back"): its last rank left the node, or a rank came back."""
        self._device_problems: set[tuple[str, str]] = set()
        """(call, error type) of the agent's own NVML calls that failed, each logged once."""
        self.unconfirmed: dict[tuple[str, int], tuple[str, bytes, float]] = {}
        """(job, version) -> (topic, payload, when last sent) of each measurement report the
        coordinator has not confirmed yet."""
        self._resend_wake = asyncio.Event()
        """Set when a report is kept unconfirmed, or every one is to go again at once
        (``_resend_all``)."""
        self._resend_all = False
        self.ready = asyncio.Event()
        if self.job_source is not None:
            self.job_source.listeners.append(self._on_step)
            self.job_source.rank_listeners.append(self._on_rank_left)
            self.job_source.attach_listeners.append(self._on_rank_attached)
            self.job_source.release_listeners.append(self._on_job_released)
        if link is not None:
            link.subscribe(self.topics.settings("+"), 1, self._on_settings)
            link.subscribe(self.topics.coordinator_status(), 1, self._on_coordinator_status)
            link.subscribe(self.topics.receipt("+", self.node), 1, self._on_receipt)
            for job in self.applied_messages:
                self._follow_job(job)

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

    def _load_applied(self) -> None:
        if self.applied_file is None:
            return
        try:
            saved = orjson.loads(self.applied_file.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, orjson.JSONDecodeError) as e:
            log.error("ignoring %s: %s", self.applied_file, e)
            return
        for job, message in saved.items() if isinstance(saved, dict) else ():
            if isinstance(message, dict) and isinstance(message.get("version"), int):
                if not isinstance(message.get("settings"), dict):
                    message["settings"] = {}
                self.applied_messages[job] = message
        if self.applied_messages:
            log.info("settings applied before the restart: %s", self.applied_versions)

    @property
    def applied_versions(self) -> dict[str, int]:
        """job -> the settings version applied last."""
        return {job: m["version"] for job, m in self.applied_messages.items()}

    def _save_applied(self) -> None:
        """Queue the applied messages for the writer thread (a fsynced file renamed over the
        old one); acks spooled after this leave only once it is on disk."""
        if self.applied_file is None:
            return
        path, data = self.applied_file, orjson.dumps(self.applied_messages)

        def write() -> None:
            try:
                durable.write_file(path, data)
            except OSError as e:
                log.error("cannot save the applied settings to %s: %s", path, e)

        durable.submit(write)

    async def run(self) -> None:
        """Serve until cancelled; on the way out restore power limits and close sources.

        Raises SocketInUse when another agent listens on the job socket."""
        if self.job_source is not None:
            await self.job_source.start()
            self.scheduled.held_on_node()  # Slurm's jobs here, asked before a rank attaches
            self._trials_changed()
            for job, message in self.applied_messages.items():
                self.job_source.send_settings(job, _job_settings(message))
        await self.runner.start()
        if self.actuator is not None:
            try:
                recovered = await asyncio.to_thread(self.actuator.recover)
            except ActuationError as e:
                log.error("cannot restore the power limits a crashed run left: %s", e)
            else:
                if recovered:
                    log.warning(
                        "restored the original power limit of %d GPU(s) left by a crashed run",
                        recovered,
                    )
        if self.actuator is not None:
            try:
                self._limits_w = await asyncio.to_thread(self.actuator.limits_w)
            except ActuationError as e:
                log.warning("cannot read the GPUs' power-limit range: %s", e)
        if self.metrics is not None:
            self.metrics.start()
            log.info("serving /metrics on %s:%s", self.metrics.host, self.metrics.port)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._collect_loop(), name="collect")
                tasks.create_task(self._trial_loop(), name="trials")
                tasks.create_task(self._stall_loop(), name="stalls")
                tasks.create_task(self._job_loop(), name="job-caps")
                tasks.create_task(self._resend_loop(), name="resend")
                tasks.create_task(self.notifier.watchdog(self._alive), name="watchdog")
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

    def _alive(self) -> bool:
        """Collections keep coming (the watchdog's test)."""
        stalled_after = 3 * self.config.agent.interval_s + self.config.sources.timeout_s
        return time.monotonic() - self.last_collection < stalled_after

    async def _shutdown(self) -> None:
        if self.actuator is not None and self.actuator.original_mw:
            restored = await asyncio.to_thread(self.actuator.restore)
            log.info("restored the original power limit of %d GPU(s)", restored)
        await self.scheduled.close()
        await self.runner.close()
        if self.metrics is not None:
            self.metrics.stop()

    async def _collect_loop(self) -> None:
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

    async def collect_once(self) -> Snapshot:
        """One cycle: read every source, derive indicators, expose and publish."""
        by_source = await self.runner.read_by_source()
        now = time.time()
        if self.recorder is not None:
            self.recorder.write(now, by_source)
        readings = [r for batch in by_source.values() for r in batch]
        readings += self.runner.health_readings()
        readings += self._self_readings()
        readings += self._collection_readings(now)
        readings += await self._gpu_job_readings(readings)
        snapshot = Snapshot(now, self.node, tuple(readings))
        indicators = derive(
            snapshot,
            self.snapshot,
            self.config.indicators.quantum_coefficients,
            self.job_windows,
        )
        snapshot = snapshot.extended(indicators)
        self.snapshot = snapshot
        if self._gpu_model is None:
            self._gpu_model = next(
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
            self.link.publish(
                self.topics.telemetry(self.node),
                telemetry_payload(snapshot, indicators, self._jobs_summary(), self._actuation()),
            )
        return snapshot

    def _jobs_summary(self) -> dict[str, Any]:
        """Per job on this node: its running totals (for drift) and what the coordinator needs
        to find and tune it (its ranks and what they said, its owner, its GPUs)."""
        jobs: dict[str, Any] = {}
        if self.job_source is None:
            return jobs
        live = [j for j, t in self.job_source.jobs.items() if t.ranks]
        for j, t in self.job_source.jobs.items():
            entry: dict[str, Any] = {
                "samples": t.samples,
                "step_s": t.step_s,
                "ranks": t.reporting_ranks,
                **t.describe(),
            }
            knobs = t.knobs()
            if knobs is not None:
                entry["knobs"] = list(knobs)
            user = self.job_source.user_name(t.owner)
            if user is not None:
                entry["user"] = user
            scheduler = self.scheduled.describe(j)
            if scheduler is not None:
                entry["scheduler"] = scheduler
            gpus, separable = self.job_gpus(j, live)
            entry["gpus"] = sorted(gpus)
            entry["gpus_separable"] = separable
            if not gpus and t.ranks and self._may_get_gpus(j):
                entry["gpus_pending"] = True  # ranks just attached: their GPUs come next
            jobs[j] = entry
        return jobs

    def job_gpus(self, job: str, live: list[str] | None = None) -> tuple[set[int], bool]:
        """The GPU indices ``job`` is known to hold here while a rank of it is attached (from
        NVML's processes, its cgroup or the scheduler: none known is none, never "every GPU"),
        and whether they are its own (no other live job is known on any of them). A live job
        on no known GPU (another user's CPU-only rank) shares none."""
        if live is None:
            live = (
                []
                if self.job_source is None
                else [j for j, t in self.job_source.jobs.items() if t.ranks]
            )
        attached = self.job_source is None or self.job_source.attached(job) > 0
        mine = self._job_gpus.get(job, set()) if attached else set()
        separable = bool(mine) and not any(
            self._job_gpus.get(j, set()) & mine for j in live if j != job
        )
        return set(mine), separable

    def _actuation(self) -> dict[str, Any]:
        """What this node can apply: the coordinator narrows a job's space to it."""
        actuation = self.config.actuation
        limits = None if self.actuator is None else self._limits_w
        return {
            "power_cap": self.actuator is not None,
            "min_w": actuation.min_power_w,
            "max_w": actuation.max_power_w,
            "limits_w": list(limits) if limits else None,
            "gpu_model": self._gpu_model,
        }

    async def _gpu_job_readings(self, readings: list[Reading]) -> list[Reading]:
        """Which job holds which GPU and each job's GPUs, power and energy
        (:mod:`hyperagent.attribution`): NVML's running processes (looked at every
        ``attribution.interval_s``) matched against the job channel's peer pids and, as
        ``attribution.mode`` says, against their Slurm cgroups or a job-mapping directory;
        the GPU a rank declared in its hello where NVML shows none."""
        attribution = self.attribution
        peers = self.job_source is not None and bool(self.job_source.peers)
        if not peers and attribution.idle:
            self._job_gpus = {}
            return []
        channel = ChannelJobs()
        if self.job_source is not None and peers:
            channel.pids = self.job_source.job_pids()
            channel.declared = self.job_source.declared_gpus()
            channel.owners = {j: t.owner for j, t in self.job_source.jobs.items() if t.ranks}
        owner_uids = [uid for uid in channel.owners.values() if uid is not None]
        now = time.monotonic()
        due = now - self._gpu_pids_at >= self.config.attribution.interval_s
        due = due or not self._ranks_at_read.issuperset(channel.pids)  # a rank attached
        if due or attribution.unnamed(owner_uids):
            if due and self.hardware.nvml is not None:
                found = await self._device_call(
                    self.hardware.nvml, self._running_pids, "running processes"
                )
                if found is not None:  # NVML timed out: the last processes stand
                    self._gpu_pids = found
                self._ranks_at_read = frozenset(channel.pids)
            self._gpu_pids_at = now if due else self._gpu_pids_at
            await attribution.poll(self._gpu_pids, owner_uids)
        out, held = attribution.collect(readings, channel)
        channel_jobs = set(channel.pids.values()) | set(channel.declared.values())
        known = self._job_gpus
        self._job_gpus = {
            job: {int(g) for g in gpus if g.isdigit()}
            for job, gpus in held.items()
            if job in channel_jobs
        }
        self._job_gpus = self._held_gpus(self._job_gpus, channel.owners)
        for job, capped in self._capped.items():
            attached = self.job_source is not None and self.job_source.attached(job)
            if attached and capped - self._job_gpus.get(job, set()):
                self._job_events.put_nowait((job, "lost"))  # e.g. Slurm gave them to a job
        now_known = {job for job, gpus in self._job_gpus.items() if gpus}
        for job in now_known - {job for job, gpus in known.items() if gpus}:
            if job in self._awaiting_gpus or (
                self.live_versions.get(job) is None and job in self.applied_messages
            ):
                self._job_events.put_nowait((job, "back"))  # its cap can go on now
        return out

    def _may_get_gpus(self, job: str) -> bool:
        """``job`` may yet be known to hold GPUs here: no rank of it is attached yet, or its
        ranks are and attribution has not named its GPUs (a job attached for longer than an
        attribution interval with none known is a job without GPUs here)."""
        if self.job_source is None:
            return False
        totals = self.job_source.jobs.get(job)
        if totals is None or not totals.ranks:
            return True
        waited = self.job_source.clock() - totals.attached_at
        return waited < self.config.attribution.interval_s * 2

    def _held_gpus(self, found: dict[str, set[int]], live: Iterable[str]) -> dict[str, set[int]]:
        """The GPUs each live job holds here, the scheduler's word over what processes and
        hellos say: a Slurm job holds the GPUs Slurm gave it on this node; a job outside Slurm
        holds none of those, nor any GPU Slurm gave another job here (asked of Slurm while
        such a job holds GPUs; until Slurm answers, it holds none)."""
        held = dict(found)
        slurm_held: set[int] = set()
        for job in live:
            scheduled = self.scheduled.gpus(job)
            if scheduled is not None:
                held[job] = scheduled
                slurm_held |= scheduled
        source = self.job_source
        outside = [
            job
            for job, gpus in held.items()
            if gpus and source is not None and job in source.jobs and not source.jobs[job].slurm_job
        ]
        if outside and not self.scheduled.not_slurm:
            on_node = self.scheduled.held_on_node()
            for job in outside:
                held[job] = set() if on_node is None else held[job] - slurm_held - set(on_node)
        return held

    async def _device_call(self, library: Any, call: Callable[[], _T], what: str) -> _T | None:
        """``call`` through ``library``'s device gate, bounded by ``sources.timeout_s``; None
        when it timed out or the library is busy with a hung call (logged once, counted by the
        gate on /metrics)."""
        gate = DeviceGate.of(library)
        try:
            result = await gate.run(call, timeout_s=self.config.sources.timeout_s, what=what)
        except DeviceCallError as e:
            problem = (what, type(e).__name__)
            if problem not in self._device_problems:
                self._device_problems.add(problem)
                log.warning("%s: %s", what, e)
            return None
        self._device_problems = {p for p in self._device_problems if p[0] != what}
        return result

    def _collection_readings(self, now: float) -> list[Reading]:
        """When this collection ran, and the device gates' refused and timed-out calls."""
        out = [Reading(LAST_COLLECTION, now, {}, unit="s")]
        accel = self.accelerator_source
        accel_module = None if accel is None or accel.library is None else accel.library.module
        found = (self.hardware.nvml, self._nvml_library(), accel_module)
        libraries = {id(lib): lib for lib in found if lib is not None}
        for library in libraries.values():
            gate = DeviceGate.of(library)
            for reason, count in (("timeout", gate.timeouts), ("busy", gate.busy)):
                labels = {"library": gate.name, "reason": reason}
                out.append(Reading(DEVICE_CALL_FAILURES, count, labels, Kind.COUNTER))
        return out

    def _nvml_library(self) -> Any:
        return None if self.nvml_source is None else self.nvml_source.nvml

    def _running_pids(self) -> dict[str, list[int]]:
        """GPU index -> pids of its compute processes (empty without NVML's process list), one
        call per GPU through the handles the NVML source enumerated. Blocking: run it through
        the NVML gate."""
        nvml = self.hardware.nvml
        if nvml is None:
            return {}
        source = self.nvml_source
        gpus = source.gpus if source is not None and source.nvml is nvml else []
        try:
            return running_pids(nvml, gpus)
        except Exception as e:  # NVMLError and friends: attribution falls back to hellos
            log.debug("NVML running processes: %s", e)
            return {}

    def _self_readings(self) -> list[Reading]:
        out = [
            Reading("hyperagent_settings_applied_total", self.stats.applied, {}, Kind.COUNTER),
            Reading(
                "hyperagent_mqtt_invalid_payloads_total",
                self.stats.invalid_payloads,
                {},
                Kind.COUNTER,
            ),
        ]
        for reason, count in sorted(self.stats.rejected.items()):
            out.append(
                Reading(
                    "hyperagent_settings_rejected_total", count, {"reason": reason}, Kind.COUNTER
                )
            )
        if self.link is not None:
            out += self.link.broker_readings()
            sent, resent = self.stats.reports_sent, self.stats.reports_resent
            out.append(Reading("hyperagent_reports_sent_total", sent, {}, Kind.COUNTER))
            out.append(Reading("hyperagent_reports_resent_total", resent, {}, Kind.COUNTER))
            out.append(Reading("hyperagent_reports_unconfirmed", len(self.unconfirmed)))
            out.append(
                Reading("hyperagent_mqtt_dropped_total", self.link.dropped_total, {}, Kind.COUNTER)
            )
            out.append(Reading("hyperagent_mqtt_queued_messages", self.link.queued))
            out += self.link.handler_error_readings()
        return out

    def _reject(self, reason: str, detail: str) -> None:
        self.stats.rejected[reason] += 1
        if reason not in self._logged_rejections:
            self._logged_rejections.add(reason)
            log.warning("rejected settings (%s): %s", reason, detail)

    async def _on_settings(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            job = self.topics.name_in(topic)
            message = bus.decode(payload, "settings")
        except PayloadError as e:
            self.stats.invalid_payloads += 1
            self._reject("invalid", str(e))
            return
        if message["job"] != job:
            self._reject("invalid", f"topic job {job!r} differs from payload job")
            return
        nodes = message.get("nodes")
        if isinstance(nodes, list) and self.node not in nodes:
            return
        allowed = self.config.actuation.allowed_jobs
        if allowed and job not in allowed:
            self._reject("job_not_allowed", f"{job} is not in actuation.allowed_jobs")
            return
        unsigned = await self._signature_problem(message)
        if unsigned is not None:
            reason, detail = unsigned
            self._reject(reason, f"settings v{message['version']} for {job}: {detail}")
            return
        version, applied = message["version"], self.applied_versions.get(job, 0)
        if version < applied:
            self._reject("stale", f"v{version} is older than applied v{applied}")
            self._ack(
                job,
                version,
                ok=False,
                error=f"stale: v{applied} applied",
                applied={"version": applied},
                refusal="stale",
            )
            return
        if version == applied:
            if self.live_versions.get(job) != version:
                await self._apply(job, message, again=True)
            return
        problem = self._check_age(message)
        if problem is not None:
            self._reject("expired", problem)
            self._ack(job, version, ok=False, error=problem)
            return
        await self._apply(job, message)

    async def _signature_problem(self, message: dict[str, Any]) -> tuple[str, str] | None:
        """Why ``message`` is not signed by a trusted key (bus.signature_problem), or None. The
        trusted files are read again first if they changed (a key added or removed during a
        rotation; a few ``stat`` calls otherwise)."""
        keys = self.trusted_keys
        if keys is None:
            return "no_key", "no security.trusted_keys configured; refusing every setting"
        if keys.paths:
            if await asyncio.to_thread(keys.refresh):
                log.info("trusted settings keys read again: %s", keys.describe())
        if not len(keys):
            paths = ", ".join(map(str, keys.paths)) or "none configured"
            return "no_key", f"no key in security.trusted_keys ({paths}); refusing every setting"
        return bus.signature_problem(message, keys)

    def _check_age(self, message: dict[str, Any]) -> str | None:
        issued = message["issued_at"]  # a finite number: bus.decode checked it
        security = self.config.security
        age = time.time() - issued
        if age < -security.clock_skew_s:
            return f"settings issued {-age:.0f}s in the future (clock skew?)"
        if age > security.settings_max_age_s + security.clock_skew_s:
            return f"settings issued {age:.0f}s ago, over security.settings_max_age_s"
        return None

    async def _on_coordinator_status(self, topic: str, payload: bytes) -> None:
        """When the coordinator is lost while a trial's power cap is applied, the cap is not
        left behind; a tuned job's final settings (no trial) stay, as its tuning chose them."""
        try:
            state = bus.decode(payload, "status")["state"] if payload else None
        except PayloadError:
            self.stats.invalid_payloads += 1
            return
        if self.link is not None:
            self.link.open_gate(state == "online")
        attached = self.job_source.attached if self.job_source is not None else None
        trial_capped = any(
            m["settings"].get("power_cap_w") and m.get("trial") is not None
            for m in self.applied_messages.values()
        )
        if state == "offline" and trial_capped and self.actuator and self.actuator.original_mw:
            restored = await asyncio.to_thread(self.actuator.restore)
            log.warning(
                "coordinator offline: restored the original power limit of %d GPU(s)", restored
            )
            for job, applied in self.applied_messages.items():
                if applied["settings"].get("power_cap_w"):
                    self.live_versions.pop(job, None)
        elif state == "online":
            self._resend_all = True
            self._resend_wake.set()
            for job, message in list(self.applied_messages.items()):
                if attached is None or not attached(job):
                    continue  # no rank here: nothing to apply them to (its GPUs are unknown)
                if self.live_versions.get(job) != message["version"]:
                    log.info(
                        "coordinator online: applying v%d for %s again", message["version"], job
                    )
                    await self._apply(job, message, again=True)

    def _check_bounds(self, settings: dict[str, Any]) -> str | None:
        """Why this node can never apply ``settings``' power cap (a fact about the settings:
        the coordinator takes it as an infeasible point), or None."""
        cap = settings.get("power_cap_w")
        if cap is None:
            return None
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap):
            return f"power_cap_w {cap!r} is not a number"
        low, high = self.config.actuation.min_power_w, self.config.actuation.max_power_w
        if (low is not None and cap < low) or (high is not None and cap > high):
            return f"power_cap_w {cap} W outside this node's bounds [{low}, {high}]"
        if self.actuator is None:
            return "power capping is disabled on this node (actuation.power_cap = false)"
        return None

    async def _apply(self, job: str, message: dict[str, Any], again: bool = False) -> None:
        """Apply ``message``'s settings (``again``: the version already applied, after a
        restart or after the power limits were restored) and ack them. A power cap goes on
        the GPUs the job is known to hold here, none when none is known."""
        version, settings = message["version"], message["settings"]
        waiting = self._awaiting_gpus.get(job)
        if waiting is not None and waiting["version"] <= version:
            del self._awaiting_gpus[job]  # this version is newer than the one that waited
        problem = self._check_bounds(settings)
        refusal = "settings" if problem is not None else "node"
        applied: dict[str, Any] = {}
        if problem is None and settings.get("power_cap_w") is not None and self.actuator:
            gpus, separable = self.job_gpus(job)
            if not gpus and not again and self._may_get_gpus(job):
                # its ranks are here, or coming: applied once its GPUs are known (the
                # coordinator's ack timeout bounds the wait of a trial's version)
                self._awaiting_gpus[job] = message
                log.info("settings v%d for %s wait for its GPUs here to be known", version, job)
                return
            if not gpus:
                problem = f"no GPU of {job} is known on this node: no power cap for it"
            elif not separable:
                problem = f"cannot tell the GPUs of {job} from another job's on this node"
            else:
                try:
                    cap = float(settings["power_cap_w"])
                    before = self._capped.get(job, set()) - gpus
                    if before:  # GPUs its last version capped and it no longer holds
                        await asyncio.to_thread(self.actuator.restore, before)
                    caps = await asyncio.to_thread(self.actuator.apply, cap, gpus)
                    self._capped[job] = gpus
                    if self.job_source is not None and not self.job_source.attached(job):
                        self._job_events.put_nowait((job, "left"))  # it left meanwhile
                    applied["power_cap_w"] = [c.applied_w for c in caps]
                    applied["gpus"] = [c.gpu for c in caps]
                    if self.actuator.last_latency_s is not None and any(c.changed for c in caps):
                        applied["power_cap_latency_s"] = round(self.actuator.last_latency_s, 4)
                except ActuationError as e:
                    problem = str(e)
        if problem is not None:
            self._reject("refused", problem)
            self._ack(job, version, ok=False, error=problem, refusal=refusal)
            return
        if self.job_source is not None:
            attached = self.job_source.attached(job)
            delivered = self.job_source.send_settings(job, _job_settings(message))
            applied["job_reporters"] = delivered
            totals = self.job_source.jobs.get(job)
            knobs = totals.knobs() if totals is not None else None
            if knobs is not None:
                applied["knobs"] = list(knobs)
            if delivered < attached:
                problem = f"settings v{version} reached {delivered} of {attached} ranks"
                self._reject("undelivered", problem)
                self._ack(job, version, ok=False, error=problem, applied=applied, refusal="node")
                return
        self.live_versions[job] = version
        if again:
            if not message.get("plan"):
                self._ack(job, version, ok=True, applied=applied)
            return
        self.applied_messages[job] = {
            k: message.get(k) for k in ("version", "settings", "backend", "issued_at", "trial")
        }
        self._save_applied()
        self.stats.applied += 1
        plan_data = message.get("plan")
        if plan_data:
            try:
                plan = MeasurementPlan.from_dict(plan_data)
                job_gpus, _ = self.job_gpus(job)
                self._begin_trial(
                    _Trial(
                        job,
                        version,
                        message.get("trial"),
                        TrialMeasurement(version, plan),
                        gpus=frozenset(job_gpus),
                    )
                )
            except ValueError as e:
                log.warning("settings v%d for %s: %s; not measuring", version, job, e)
        else:
            self._end_trial(job)
        self._ack(job, version, ok=True, applied=applied)
        log.info("applied settings v%d for %s: %s", version, job, settings)

    def _ack(
        self,
        job: str,
        version: int,
        ok: bool,
        error: str | None = None,
        applied: dict[str, Any] | None = None,
        refusal: str | None = None,
    ) -> None:
        """Ack (``ok``) or refuse a version; a refusal says whether it is a fact about the
        settings (``refusal`` "settings": never applicable here) or about the node now."""
        if self.link is None:
            return
        message: dict[str, Any] = {
            "job": job,
            "node": self.node,
            "version": version,
            "ok": ok,
            "error": error,
            "applied": applied or {},
            "stalled": self.job_stalled(job),
            "ts": time.time(),
        }
        if not ok:
            message["refusal"] = refusal or "node"
        payload = bus.encode(message)
        self.link.publish(self.topics.ack(job, self.node), payload, qos=1)

    def job_stalled(self, job: str) -> bool:
        """The job's ranks reported steps here, then stopped (see ``_StepClock.stalled``)."""
        clock = self._step_clocks.get(job)
        return clock is not None and clock.stalled(time.monotonic())

    async def _stall_loop(self) -> None:
        """A running trial whose job stopped stepping ends at once: the node reports itself
        stalled (its partial windows discarded) and measures again at the next trial."""
        while True:
            if not self._trials:  # no wake-ups while nothing is measured
                self._measuring.clear()
                await self._measuring.wait()
            await asyncio.sleep(STALL_CHECK_S)
            for job, trial in list(self._trials.items()):
                if self.job_stalled(job):
                    log.warning(
                        "the steps of %s stopped during v%d; leaving the trial", job, trial.version
                    )
                    self._end_trial(job)
                    self._publish_report(trial, None, stalled=True)

    def _begin_trial(self, trial: _Trial) -> None:
        """Measure ``trial`` (in place of the job's trial before, if one is running)."""
        self._trials[trial.job] = trial
        self._measuring.set()
        self._trials_changed()

    def _end_trial(self, job: str) -> _Trial | None:
        """Stop measuring ``job``'s trial; the trial, if one was running."""
        trial = self._trials.pop(job, None)
        self._trials_changed()
        return trial

    def _trials_changed(self) -> None:
        """The job channel reads steps as they come while a trial is measured (its windows
        close, and their energy is read, as their last steps arrive), in passes otherwise
        (``sources.job.BATCH_S``; the step clock keeps each step's own arrival time)."""
        if self.job_source is not None:
            self.job_source.prompt = bool(self._trials)

    def _on_rank_left(self, job: str, rank: int) -> None:
        clock = self._step_clocks.get(job)
        if clock is not None:
            clock.leave(rank)
        if self.job_source is not None and not self.job_source.attached(job):
            self._job_events.put_nowait((job, "left"))

    def _follow_job(self, job: str) -> None:
        """Subscribe to ``job``'s settings topic itself: a broker that serves a retained
        message only to a subscriber of its exact topic (RabbitMQ) then gives this agent the
        job's current version, which ``settings/+`` alone would not. A repeat (mosquitto
        delivers through both subscriptions) is dropped by the version check."""
        if self.link is not None:
            self.link.follow(self.topics.settings(job), 1, self._on_settings)

    def _on_rank_attached(self, job: str, rank: int) -> None:
        self._follow_job(job)
        totals = self.job_source.jobs.get(job) if self.job_source is not None else None
        if totals is not None and totals.slurm_job:
            self.scheduled.follow(job, totals.slurm_job)
        if self.live_versions.get(job) is None and job in self.applied_messages:
            self._job_events.put_nowait((job, "back"))

    async def _job_loop(self) -> None:
        """A job whose ranks all left gets its GPUs' original power limits back at once (the
        next job on them must not inherit its cap); when a rank comes back, or its GPUs become
        known, its applied settings are applied again."""
        while True:
            job, what = await self._job_events.get()
            if what == "left" and job in self._capped and self.actuator is not None:
                gpus = self._capped.pop(job)
                restored = await asyncio.to_thread(self.actuator.restore, gpus)
                self.live_versions.pop(job, None)
                if restored:
                    log.info("%s left: restored the power limit of %d GPU(s)", job, restored)
            elif what == "lost" and job in self._capped and self.actuator is not None:
                lost = self._capped[job] - self._job_gpus.get(job, set())
                if lost:
                    await asyncio.to_thread(self.actuator.restore, lost)
                    log.warning(
                        "%s no longer holds GPU(s) %s here: their power limit is restored",
                        job,
                        ", ".join(map(str, sorted(lost))),
                    )
                    self._capped[job] -= lost
                    if not self._capped[job]:
                        del self._capped[job]
                        self.live_versions.pop(job, None)  # applied again if its GPUs come back
            elif what == "back" and job in self._awaiting_gpus:
                waited = self._awaiting_gpus.pop(job)
                if waited["version"] > self.applied_versions.get(job, 0):  # still the latest
                    await self._apply(job, waited)
            elif what == "back" and self.live_versions.get(job) is None:
                message = self.applied_messages.get(job)
                if message is not None and self.job_source and self.job_source.attached(job):
                    await self._apply(job, message, again=True)

    def _on_job_released(self, job: str) -> None:
        """A job released by the job channel (no rank for ``release_after_s``): its step times
        and its applied settings go (never applied again: the job is over), and a trial still
        waiting on it ends as stalled."""
        self._step_clocks.pop(job, None)
        self._awaiting_gpus.pop(job, None)
        self.scheduled.forget(job)
        if job in self._capped:
            self._job_events.put_nowait((job, "left"))  # its caps go back with it
        self.live_versions.pop(job, None)
        if self.applied_messages.pop(job, None) is not None:
            self._save_applied()
        trial = self._end_trial(job)
        if trial is not None:
            log.warning("%s was released during v%d; leaving the trial", job, trial.version)
            self._publish_report(trial, None, stalled=True)

    def _on_step(self, step: StepReport) -> None:
        clock = self._step_clocks.get(step.job)
        if clock is None:
            clock = self._step_clocks[step.job] = _StepClock()
        source = self.job_source
        clock.tick(step.rank, source.arrived if source is not None else time.monotonic())
        trial = self._trials.get(step.job)
        if trial is None:
            return
        measurement = trial.measurement
        phase = measurement.add(step)
        if phase is not None:
            self._trial_events.put_nowait((trial, phase))
        elif measurement.completed_windows > trial.windows_reported:
            trial.windows_reported = measurement.completed_windows
            self._trial_events.put_nowait((trial, trial.windows_reported))

    async def _energy_j(self, gpus: frozenset[int] | None = None) -> float | None:
        """The energy counters of ``gpus`` (None: every GPU; none: no energy) summed now: one
        device call (None when it did not answer within ``sources.timeout_s``), or a text tool
        with an energy counter (xpu-smi) run for it; without either (GPU readings replayed as
        recorded), as of the latest collection."""
        if gpus is not None and not gpus:
            return None
        source = self.nvml_source or self.accelerator_source
        if source is not None and source.device_module is not None:
            read = source.total_energy_j
            return await self._device_call(source.device_module, lambda: read(gpus), "total energy")
        tool = next((s for s in self.runner.sources if isinstance(s, SmiTextSource)), None)
        if tool is not None and tool.counts_energy:
            return await tool.total_energy_j(gpus)
        return self._collected_energy_j(gpus)

    def _collected_energy_j(self, gpus: frozenset[int] | None) -> float | None:
        """The energy counters of ``gpus`` (None: every GPU) summed, as of the latest
        collection (None where one is missing)."""
        if self.snapshot is None:
            return None
        if gpus is None:
            return self.snapshot.total(GPU_ENERGY)
        values = [
            r.value
            for r in self.snapshot.readings
            if r.name == GPU_ENERGY
            and r.labels.get("gpu", "").isdigit()
            and int(r.labels["gpu"]) in gpus
        ]
        return sum(values) if len(values) == len(gpus) else None

    async def _trial_loop(self) -> None:
        """A trial's energy readings, in the order its steps came: at the measurement's start,
        as each window closes (then its partial report goes out) and at its end (then its
        final report). A window of a trial the coordinator moved on from (new settings came)
        is not reported."""
        while True:
            trial, what = await self._trial_events.get()
            if what is Phase.MEASURING:
                trial.energy_start_j = await self._energy_j(trial.gpus)
                trial.xid_start = self._xid_total(trial.gpus)
            elif isinstance(what, int) and not isinstance(what, Phase):
                if self._trials.get(trial.job) is not trial:
                    continue
                mark = await self._energy_j(trial.gpus)
                while len(trial.energy_marks) < what:
                    trial.energy_marks.append(mark)
                if self._trials.get(trial.job) is trial:
                    self._publish_report(trial, None, partial=True)
            elif what is Phase.DONE:
                end = await self._energy_j(trial.gpus)
                energy = None
                if trial.energy_start_j is not None and end is not None:
                    energy = end - trial.energy_start_j
                self._publish_report(trial, energy, end_j=end)
                if self._trials.get(trial.job) is trial:
                    self._end_trial(trial.job)

    def _xid_total(self, gpus: frozenset[int]) -> float:
        """The XIDs counted so far on ``gpus`` (a trial's own: another job's GPU failing is
        not this job's trial failing)."""
        if self.snapshot is None or not gpus:
            return 0.0
        wanted = {str(g) for g in gpus}
        return sum(
            r.value
            for r in self.snapshot.readings
            if r.name == "hyperagent_gpu_xid_errors_total" and r.labels.get("gpu") in wanted
        )

    def _publish_report(
        self,
        trial: _Trial,
        energy_j: float | None,
        partial: bool = False,
        stalled: bool = False,
        end_j: float | None = None,
    ) -> None:
        """The node's measurement of a trial; ``partial`` ones go out after each window so the
        coordinator can abort a bad trial, or stop it early, as soon as its windows say so; a
        ``stalled`` one says the job stopped stepping, with no measurement. Both kinds carry
        each window's samples (``window_samples``) and, when the energy counter answered at
        every window's end (``end_j``: the final one), its GPU energy (``energy_windows``)."""
        if self.link is None:
            return
        measurement = trial.measurement
        result = measurement.so_far() if partial else measurement.result()
        if stalled:
            result = Measurement(0, 0.0, 0.0, [], 0, False)
        xid = 0.0 if partial else self._xid_total(trial.gpus) - trial.xid_start
        windows = len(result.windows)
        energy_windows = None
        if not stalled and windows:
            energy_windows = trial.energy_windows(windows, None if partial else end_j)
        extra: dict[str, Any] = {"window_samples": result.window_samples}
        if energy_windows is not None:
            extra["energy_windows"] = energy_windows
        payload = bus.encode(
            {
                **extra,
                "job": trial.job,
                "node": self.node,
                "version": trial.version,
                "trial": trial.trial,
                "samples": result.samples,
                "seconds": result.seconds,
                "throughput": result.throughput,
                "windows": result.windows,
                "steps": result.steps,
                "energy_j": energy_j,
                "nonfinite_loss": result.nonfinite_loss,
                "xid_errors": max(xid, 0.0),
                "partial": partial,
                "stalled": stalled,
                "ts": time.time(),
            }
        )
        topic = self.topics.report(trial.job, self.node)
        self.link.publish(topic, payload, qos=1)
        if not partial:
            self._keep_unconfirmed(trial.job, trial.version, topic, payload)
        if not partial and not stalled:
            self.stats.reports_sent += 1

    def _keep_unconfirmed(self, job: str, version: int, topic: str, payload: bytes) -> None:
        """Keep a final report until the coordinator confirms it; a job's older versions go
        (the coordinator moved on from them)."""
        for key in [k for k in self.unconfirmed if k[0] == job and k[1] < version]:
            del self.unconfirmed[key]
        self.unconfirmed[(job, version)] = (topic, payload, time.monotonic())
        self._resend_wake.set()  # its resend check begins
        while len(self.unconfirmed) > UNCONFIRMED_MAX:
            del self.unconfirmed[next(iter(self.unconfirmed))]

    async def _on_receipt(self, topic: str, payload: bytes) -> None:
        """The coordinator has this node's report of ``version`` (and so needs no older one)."""
        try:
            job = self.topics.name_in(topic)
            message = bus.decode(payload, "receipt")
        except PayloadError:
            self.stats.invalid_payloads += 1
            return
        if message["job"] != job or message["node"] != self.node:
            self.stats.invalid_payloads += 1
            return
        version = message["version"]
        for key in [k for k in self.unconfirmed if k[0] == job and k[1] <= version]:
            del self.unconfirmed[key]

    async def _resend_loop(self) -> None:
        """Send again each report unconfirmed for ``RESEND_S`` (each one at once when the
        coordinator comes online), while the link has handed everything before to the broker
        (a gated or disconnected link does not pile up copies). Looked at every
        ``RESEND_S / 2`` (on the loop's grid, :mod:`hyperagent.ticks`) while a report is
        unconfirmed; no wake-ups while none is."""
        loop = asyncio.get_running_loop()
        while True:
            due = ticks.next_tick(loop.time(), RESEND_S / 2) if self.unconfirmed else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(due):
                    await self._resend_wake.wait()
            self._resend_wake.clear()
            now_too, self._resend_all = self._resend_all, False
            link = self.link
            if link is None or not link.connected.is_set() or link.spool:
                continue
            now = time.monotonic()
            for key, (topic, payload, sent) in list(self.unconfirmed.items()):
                if now_too or now - sent >= RESEND_S:
                    link.publish(topic, payload, qos=1)
                    self.unconfirmed[key] = (topic, payload, now)
                    self.stats.reports_resent += 1


def _attribution(config: Config, hardware: Hardware) -> Attribution:
    """The job attribution ``config.attribution`` asks for; a replayed capture's ``proc/``
    and ``etc/passwd`` stand for the node's unless ``attribution.proc_root`` is set."""
    settings = config.attribution
    proc_root = settings.proc_root
    users = None
    capture = hardware.capture_dir
    if capture is not None:
        if "proc_root" not in settings.model_fields_set and (capture / "proc").is_dir():
            proc_root = capture / "proc"
        if (capture / "etc" / "passwd").is_file():
            users = passwd_file(capture / "etc" / "passwd")
    ledger = JobLedger(config.sources.job.release_after_s, config.sources.job.max_jobs)
    extra = {} if users is None else {"users": users}
    return Attribution(
        settings.mode,
        ledger,
        proc_root=proc_root,
        mapping_dir=settings.mapping_dir,
        timeout_s=config.sources.timeout_s,
        **extra,
    )


def _job_settings(message: dict[str, Any]) -> JobSettings:
    """What a settings message asks of the job's ranks: every knob but the power cap (the
    agent's own), and the backend's parameters."""
    knobs = {k: v for k, v in message["settings"].items() if k != "power_cap_w"}
    return JobSettings(message["version"], knobs, message.get("backend", {}))


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

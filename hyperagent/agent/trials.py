"""The trial measurer: when each job's steps arrive (its step clock, which tells a stalled
job), the trial a settings version asked to measure, the GPU energy read as its windows close,
and its reports to the coordinator (partial after each window, final, or stalled), the final
ones kept until confirmed (:mod:`hyperagent.agent.reports`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyperagent import bus
from hyperagent.agent.devices import DeviceCalls
from hyperagent.agent.reports import Reports
from hyperagent.agent.stats import AgentStats
from hyperagent.job import StepReport
from hyperagent.readings import Snapshot
from hyperagent.sources.job import JobSource
from hyperagent.tuner.trial import Measurement, MeasurementPlan, Phase, TrialMeasurement

log = logging.getLogger(__name__)

STALL_STEPS = 8
"""A job whose steps stop for this many times its median step interval has stalled ..."""

STALL_MIN_S = 2.0
"""... and for at least this long (a busy machine's hiccups are not a hang)."""

STALL_CHECK_S = 0.1
"""How often running trials are checked for a stalled job."""


@dataclass
class StepClock:
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
class Trial:
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


class Trials:
    """Measures the trials the coordinator's settings ask for; owns the jobs' step clocks and
    the trial running per job."""

    def __init__(
        self,
        job_source: JobSource | None,
        devices: DeviceCalls,
        reports: Reports,
        stats: AgentStats,
        latest: Callable[[], Snapshot | None],
    ) -> None:
        """``latest``: the latest collection's snapshot (the XIDs a trial counts)."""
        self.job_source = job_source
        self.devices = devices
        self.reports = reports
        self.stats = stats
        self.latest = latest
        self.trials: dict[str, Trial] = {}
        self._events: asyncio.Queue[tuple[Trial, Phase | int]] = asyncio.Queue()
        """A trial's phase changes, and (an int) the count of its windows every rank closed."""
        self.step_clocks: dict[str, StepClock] = {}
        self._measuring = asyncio.Event()
        """Set while a trial is measured (the stall check runs only then)."""

    def measure(
        self,
        job: str,
        version: int,
        trial: int | None,
        plan: dict[str, Any],
        gpus: set[int],
    ) -> None:
        """Measure ``job``'s trial of ``version`` on its ``gpus`` here as ``plan`` says (in
        place of the job's trial before, if one is running); ValueError for a plan that cannot
        be measured."""
        measurement = TrialMeasurement(version, MeasurementPlan.from_dict(plan))
        self.trials[job] = Trial(job, version, trial, measurement, gpus=frozenset(gpus))
        self._measuring.set()
        self.trials_changed()

    def end(self, job: str) -> Trial | None:
        """Stop measuring ``job``'s trial; the trial, if one was running."""
        trial = self.trials.pop(job, None)
        self.trials_changed()
        return trial

    def trials_changed(self) -> None:
        """The job channel reads steps as they come while a trial is measured (its windows
        close, and their energy is read, as their last steps arrive), in passes otherwise
        (``sources.job.BATCH_S``; the step clock keeps each step's own arrival time)."""
        if self.job_source is not None:
            self.job_source.prompt = bool(self.trials)

    def stalled(self, job: str) -> bool:
        """The job's ranks reported steps here, then stopped (see ``StepClock.stalled``)."""
        clock = self.step_clocks.get(job)
        return clock is not None and clock.stalled(time.monotonic())

    # -- the job channel's events --------------------------------------------------------

    def on_step(self, step: StepReport) -> None:
        clock = self.step_clocks.get(step.job)
        if clock is None:
            clock = self.step_clocks[step.job] = StepClock()
        source = self.job_source
        clock.tick(step.rank, source.arrived if source is not None else time.monotonic())
        trial = self.trials.get(step.job)
        if trial is None:
            return
        measurement = trial.measurement
        phase = measurement.add(step)
        if phase is not None:
            self._events.put_nowait((trial, phase))
        elif measurement.completed_windows > trial.windows_reported:
            trial.windows_reported = measurement.completed_windows
            self._events.put_nowait((trial, trial.windows_reported))

    def rank_left(self, job: str, rank: int) -> None:
        clock = self.step_clocks.get(job)
        if clock is not None:
            clock.leave(rank)

    def job_released(self, job: str) -> None:
        """A released job's step times go, and a trial still waiting on it ends as stalled."""
        self.step_clocks.pop(job, None)
        trial = self.end(job)
        if trial is not None:
            log.warning("%s was released during v%d; leaving the trial", job, trial.version)
            self._publish_report(trial, None, stalled=True)

    # -- loops ---------------------------------------------------------------------------

    async def loop(self) -> None:
        """A trial's energy readings, in the order its steps came: at the measurement's start,
        as each window closes (then its partial report goes out) and at its end (then its
        final report). A window of a trial the coordinator moved on from (new settings came)
        is not reported."""
        while True:
            trial, what = await self._events.get()
            if what is Phase.MEASURING:
                trial.energy_start_j = await self.devices.energy_j(trial.gpus)
                trial.xid_start = self._xid_total(trial.gpus)
            elif isinstance(what, int) and not isinstance(what, Phase):
                if self.trials.get(trial.job) is not trial:
                    continue
                mark = await self.devices.energy_j(trial.gpus)
                while len(trial.energy_marks) < what:
                    trial.energy_marks.append(mark)
                if self.trials.get(trial.job) is trial:
                    self._publish_report(trial, None, partial=True)
            elif what is Phase.DONE:
                end = await self.devices.energy_j(trial.gpus)
                energy = None
                if trial.energy_start_j is not None and end is not None:
                    energy = end - trial.energy_start_j
                self._publish_report(trial, energy, end_j=end)
                if self.trials.get(trial.job) is trial:
                    self.end(trial.job)

    async def stall_loop(self) -> None:
        """A running trial whose job stopped stepping ends at once: the node reports itself
        stalled (its partial windows discarded) and measures again at the next trial."""
        while True:
            if not self.trials:  # no wake-ups while nothing is measured
                self._measuring.clear()
                await self._measuring.wait()
            await asyncio.sleep(STALL_CHECK_S)
            for job, trial in list(self.trials.items()):
                if self.stalled(job):
                    log.warning(
                        "the steps of %s stopped during v%d; leaving the trial", job, trial.version
                    )
                    self.end(job)
                    self._publish_report(trial, None, stalled=True)

    # -- reports -------------------------------------------------------------------------

    def _xid_total(self, gpus: frozenset[int]) -> float:
        """The XIDs counted so far on ``gpus`` (a trial's own: another job's GPU failing is
        not this job's trial failing)."""
        snapshot = self.latest()
        if snapshot is None or not gpus:
            return 0.0
        wanted = {str(g) for g in gpus}
        return sum(
            r.value
            for r in snapshot.readings
            if r.name == "hyperagent_gpu_xid_errors_total" and r.labels.get("gpu") in wanted
        )

    def _publish_report(
        self,
        trial: Trial,
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
        reports = self.reports
        if reports.link is None:
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
                "node": reports.node,
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
        reports.send(trial.job, trial.version, payload, final=not partial)
        if not partial and not stalled:
            self.stats.reports_sent += 1

"""Watching a tuned job's throughput for drift below its tuned score. Pure.

Once a job is tuned, every :data:`DRIFT_CHECK_S` its throughput since the last check (from
its nodes' running totals, :class:`~hyperagent.tuner.jobstate.Progress`) is compared with the
tuned score. A reading below ``1 - drift_threshold`` of it is a drift; the lifecycle re-tunes
a job that stays below for ``drift_sustained_s`` (:class:`~hyperagent.tuner.lifecycle.Drift`).
Only a throughput tuning in tune mode is watched.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from hyperagent.config import JobTuningSection
from hyperagent.tuner.jobstate import Progress
from hyperagent.tuner.membership import Membership

DRIFT_CHECK_S = 10.0
"""How often a tuned job's throughput is compared with its tuned score."""


def job_throughput(
    progress: Mapping[str, Progress],
    previous: Mapping[str, Progress],
    job: Membership,
    nodes: int,
) -> float | None:
    """The job's samples/s from ``previous`` to ``progress``, in a trial score's unit: a
    node's rate is the sum over its ranks, the mean over the nodes in scoring scaled to the
    job's ``nodes``. None when no node in scoring has a rate."""
    rates = []
    for node, now in progress.items():
        before = previous.get(node)
        if before is not None and node not in job.out and node in job.nodes:
            d_samples, d_step = now.samples - before.samples, now.step_s - before.step_s
            if d_step > 0 and d_samples >= 0:
                rates.append(d_samples / (d_step / now.ranks))
    if not rates:
        return None
    return statistics.fmean(rates) * nodes


@dataclass(frozen=True)
class Reading:
    """One check's throughput ``rate`` against the ``tuned`` score, at ``now``."""

    now: float
    rate: float
    tuned: float
    below: bool
    """Below the drift line (``1 - drift_threshold`` of the tuned score)."""

    def describe(self) -> str:
        return (
            f"throughput {self.rate:.4g} is {100 * (1 - self.rate / self.tuned):.0f}% below"
            f" the tuned {self.tuned:.4g}"
        )


@dataclass
class DriftWatch:
    """When the next check is due (None: not watching) and the running totals it measures
    from."""

    at: float | None = None
    since: dict[str, Progress] = field(default_factory=dict)

    def arm(self, now: float, progress: Mapping[str, Progress]) -> None:
        """Start watching at ``now`` (a no-op while watching)."""
        if self.at is None:
            self.at = now + DRIFT_CHECK_S
            self.since = dict(progress)

    def disarm(self) -> None:
        self.at = None

    def check(
        self,
        now: float,
        progress: Mapping[str, Progress],
        job: Membership,
        config: JobTuningSection,
        tuned: float | None,
    ) -> Reading | None:
        """The reading due at ``now`` of the job's throughput against ``tuned``, the next
        check :data:`DRIFT_CHECK_S` on. None when none is due, the job is not watched (not
        throughput, not tune mode, no tuned score) or no node had a rate."""
        if self.at is None or now < self.at:
            return None
        self.at = now + DRIFT_CHECK_S
        previous, self.since = self.since, dict(progress)
        if config.objective != "throughput" or config.mode != "tune" or tuned is None:
            return None
        rate = job_throughput(progress, previous, job, len(config.nodes))
        if rate is None or not math.isfinite(rate):
            return None
        return Reading(now, rate, tuned, rate < (1 - config.drift_threshold) * tuned)

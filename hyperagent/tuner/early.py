"""Judging a search trial from its first measurement windows. Pure.

A trial measures its settings in windows (:mod:`hyperagent.tuner.trial`) until their score is
precise, which on a noisy job is the plan's cap, four times its minimum. Most candidates of a
search are not close to the best so far, and their first windows already say so: after
``min_windows`` windows, each closed window compares the trial's windows with the
incumbent's (the best trial so far) by the interval the confirmations use
(:func:`hyperagent.tuner.trial.compare`, Welch's t at 95% on the ratio of the means). When the
whole interval is below zero the trial is worse, above zero it is better, and either way its
measurement can stop: the tuner is told the windows' mean with their standard error, so it
trusts the short measurement no more than it should. Confirmations are never judged early;
they keep their full length. The coordinator (:class:`hyperagent.tuner.tuning.JobTuning`)
judges each search trial but the first (the baseline) on the nodes' partial reports, with
the job's window scores (:func:`hyperagent.tuner.trial.window_scores`: throughput, or for
energy the samples per joule of each window when the agents report energy per window).

The rule's false-cut rate (a trial stopped as worse whose settings are in
truth at least as good as the incumbent's) is measured by ``benchmarks/tuner_families.py
--cost`` with the families' noise; see the README.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from hyperagent.tuner.trial import Gain, compare

MIN_WINDOWS = 3
"""Windows a trial measures before it is judged."""


class Verdict(StrEnum):
    MEASURE_ON = "measure_on"
    WORSE = "worse"
    """Below the incumbent at the confirmations' confidence: stop."""
    BETTER = "better"
    """Above the incumbent by more than the noise: stop."""


@dataclass(frozen=True)
class EarlyStop:
    """When a search trial's measurement stops before the plan's end."""

    min_windows: int = MIN_WINDOWS
    stop_better: bool = True
    """Also stop a trial that is clearly better (False: only the clearly worse stop)."""

    def __post_init__(self) -> None:
        if self.min_windows < 2:
            raise ValueError(f"min_windows must be >= 2 (a spread), got {self.min_windows}")

    @classmethod
    def for_objective(cls, objective: str, energy_windows: bool = False) -> EarlyStop:
        """The rule for a tuning of ``objective``: both cuts for throughput; for energy both
        when the agents report energy per window (``energy_windows``: the tuner is then told
        the windows' standard error), else only the worse. Without energy windows an energy
        trial tells the tuner no standard error, so a short measurement stopped as better
        would enter the model as if it had run in full: on three energy families (20
        landscapes each, ``benchmarks/tuner_families.py --cost``) stopping the better too
        cost up to 2.1 points of the final value."""
        return cls(stop_better=objective != "energy" or energy_windows)

    def judge(self, windows: Sequence[float], incumbent: Sequence[float]) -> Verdict:
        """The verdict on a trial's windows so far (its job-level window scores, as
        :func:`hyperagent.tuner.trial.trial_samples` gives them) against the incumbent's;
        measure on while fewer than ``min_windows`` are in, or without an incumbent of at
        least two windows."""
        gain = self.gain(windows, incumbent)
        if gain is None:
            return Verdict.MEASURE_ON
        if gain.high < 0:
            return Verdict.WORSE
        if self.stop_better and gain.low > 0:
            return Verdict.BETTER
        return Verdict.MEASURE_ON

    def gain(self, windows: Sequence[float], incumbent: Sequence[float]) -> Gain | None:
        """The trial against the incumbent (None until it can be judged)."""
        if len(windows) < self.min_windows:
            return None
        return compare(incumbent, windows)


def told(windows: Sequence[float]) -> tuple[float, float | None]:
    """What the tuner is told of a measurement stopped after ``windows``: their mean and its
    standard error (None with a single window)."""
    if not windows:
        raise ValueError("no windows measured")
    mean = statistics.fmean(windows)
    if len(windows) < 2:
        return mean, None
    return mean, statistics.stdev(windows) / math.sqrt(len(windows))

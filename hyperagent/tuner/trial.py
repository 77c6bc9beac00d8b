"""One trial's measurement: settle, measure in windows, score. Pure: no I/O, no clocks.

The agent feeds every step report of the job into a ``TrialMeasurement`` for the settings
version it applied; time is the job's own step time, so a measurement means the same on a
real job and on a simulated one running faster than real time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from hyperagent.job import StepReport

TARGET_REL_SE = 0.02
"""A measurement stops once its score's standard error is this fraction of the score ..."""

MAX_WINDOWS_FACTOR = 4
"""... or once it has this many times the plan's minimum number of windows."""


@dataclass(frozen=True)
class MeasurementPlan:
    """Settle until both step and time minimums pass, then measure in windows until the score
    is known well enough to rank.

    Each window lasts at least ``measure_steps / windows`` steps and ``measure_s / windows``
    seconds of every rank. After ``windows`` windows, measuring goes on one window at a time
    until the windows' standard error is at most ``target_rel_se`` of their mean, or
    ``max_windows`` windows (0: ``MAX_WINDOWS_FACTOR`` x ``windows``) are done. A plan of one
    window has no spread to go by: it stops after that window.
    """

    settle_steps: int = 10
    settle_s: float = 3.0
    measure_steps: int = 40
    measure_s: float = 5.0
    windows: int = 4
    target_rel_se: float = TARGET_REL_SE
    max_windows: int = 0

    @property
    def window_cap(self) -> int:
        """The most windows one measurement takes."""
        return max(self.windows, self.max_windows or MAX_WINDOWS_FACTOR * self.windows)

    @property
    def window_steps(self) -> int:
        return max(1, -(-max(self.measure_steps, self.windows) // self.windows))

    @property
    def window_s(self) -> float:
        return self.measure_s / self.windows

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeasurementPlan:
        """Raises ValueError on missing or wrong fields."""
        try:
            plan = cls(
                settle_steps=int(data["settle_steps"]),
                settle_s=float(data["settle_s"]),
                measure_steps=int(data["measure_steps"]),
                measure_s=float(data["measure_s"]),
                windows=int(data["windows"]),
                target_rel_se=float(data.get("target_rel_se", TARGET_REL_SE)),
                max_windows=int(data.get("max_windows", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad measurement plan: {e}") from None
        if (
            plan.measure_steps < 1
            or plan.windows < 1
            or plan.settle_steps < 0
            or plan.max_windows < 0
            or not plan.target_rel_se >= 0
        ):
            raise ValueError("bad measurement plan: counts out of range")
        return plan


class Phase(StrEnum):
    SETTLING = "settling"
    MEASURING = "measuring"
    DONE = "done"


@dataclass(frozen=True)
class Measurement:
    """What one node measured for one settings version."""

    samples: int
    seconds: float
    throughput: float
    """Median over windows of the node's samples per second."""
    windows: list[float]
    steps: int
    nonfinite_loss: bool
    window_samples: list[float] = field(default_factory=list)
    """The node's samples in each of ``windows`` (its ranks' together): with the energy the
    node's GPUs used in each window, the window's samples per joule."""


@dataclass
class _Rank:
    settle_steps: int = 0
    settle_s: float = 0.0
    windows: list[list[StepReport]] = field(default_factory=lambda: [[]])
    """Measured steps in windows; the last one is still open."""

    @property
    def measured(self) -> list[StepReport]:
        return [s for window in self.windows for s in window]

    @property
    def measured_s(self) -> float:
        return sum(s.step_s for window in self.windows for s in window)

    @property
    def closed(self) -> int:
        return len(self.windows) - 1


class TrialMeasurement:
    """Turns the step reports of one settings version into a Measurement."""

    def __init__(self, version: int, plan: MeasurementPlan) -> None:
        self.version = version
        self.plan = plan
        self.phase = Phase.SETTLING
        self.nonfinite_loss = False
        self._ranks: dict[int, _Rank] = {}
        self._windows = 0
        """Windows of the finished measurement (0 until DONE)."""

    def add(self, step: StepReport) -> Phase | None:
        """Account one step; returns the new phase when this step changed it."""
        if self.phase is Phase.DONE or step.version != self.version:
            return None
        if step.loss is not None and not math.isfinite(step.loss):
            self.nonfinite_loss = True
            self.phase = Phase.DONE
            return self.phase
        rank = self._ranks.setdefault(step.rank, _Rank())
        if self.phase is Phase.SETTLING:
            rank.settle_steps += 1
            rank.settle_s += step.step_s
            if all(
                r.settle_steps >= self.plan.settle_steps and r.settle_s >= self.plan.settle_s
                for r in self._ranks.values()
            ):
                self.phase = Phase.MEASURING
                return self.phase
            return None
        window = rank.windows[-1]
        window.append(step)
        if (
            len(window) < self.plan.window_steps
            or sum(s.step_s for s in window) < self.plan.window_s
        ):
            return None
        rank.windows.append([])
        closed = self.completed_windows
        if closed >= self.plan.windows and (
            closed >= self.plan.window_cap or self.plan.windows < 2 or self._precise(closed)
        ):
            self._windows = closed
            self.phase = Phase.DONE
            return self.phase
        return None

    def _precise(self, windows: int) -> bool:
        values = self._window_throughputs(windows)
        mean = statistics.fmean(values)
        if len(values) < 2 or mean <= 0:
            return False
        return statistics.stdev(values) / math.sqrt(len(values)) <= self.plan.target_rel_se * mean

    def _window_samples(self, windows: int) -> list[float]:
        out = [0.0] * windows
        for rank in self._ranks.values():
            for w, chunk in enumerate(rank.windows[:windows]):
                out[w] += sum(s.samples for s in chunk)
        return out

    def _window_throughputs(self, windows: int) -> list[float]:
        out = [0.0] * windows
        for rank in self._ranks.values():
            for w, chunk in enumerate(rank.windows[:windows]):
                chunk_s = sum(s.step_s for s in chunk)
                if chunk_s > 0:
                    out[w] += sum(s.samples for s in chunk) / chunk_s
        return out

    @property
    def completed_windows(self) -> int:
        """Measurement windows every rank has finished (for partial reports)."""
        if self.phase is Phase.SETTLING or not self._ranks:
            return 0
        return min(r.closed for r in self._ranks.values())

    def so_far(self) -> Measurement:
        """The measured steps so far (for partial reports): their throughput as one window's,
        and ``windows`` the windows every rank has finished (what an early judgement of the
        trial goes by)."""
        measured = {n: r.measured for n, r in self._ranks.items()}
        samples = sum(s.samples for steps in measured.values() for s in steps)
        seconds = max((r.measured_s for r in self._ranks.values()), default=0.0)
        throughput = sum(
            sum(s.samples for s in steps) / total
            for steps in measured.values()
            if (total := sum(s.step_s for s in steps)) > 0
        )
        steps = sum(len(s) for s in measured.values())
        closed = self.completed_windows
        windows = self._window_throughputs(closed)
        return Measurement(
            samples,
            seconds,
            throughput,
            windows,
            steps,
            self.nonfinite_loss,
            self._window_samples(closed),
        )

    def result(self) -> Measurement:
        """The measurement: its finished windows (once phase is DONE: all of them)."""
        windows = self._windows or self.completed_windows
        samples, seconds, steps = 0, 0.0, 0
        for rank in self._ranks.values():
            measured = rank.measured
            samples += sum(s.samples for s in measured)
            seconds = max(seconds, rank.measured_s)
            steps += len(measured)
        values = self._window_throughputs(windows)
        throughput = statistics.median(values) if values else 0.0
        return Measurement(
            samples,
            seconds,
            throughput,
            values,
            steps,
            self.nonfinite_loss,
            self._window_samples(windows),
        )


def node_power_w(report: Mapping[str, Any]) -> float | None:
    """A node's average GPU power over its measurement, from its energy and time."""
    energy, seconds = report.get("energy_j"), report.get("seconds")
    if energy is None or not seconds:
        return None
    return float(energy) / float(seconds)


def score(
    reports: Sequence[Mapping[str, Any]],
    objective: str,
    nodes: int | None = None,
    power_budget_w: float | None = None,
) -> float | None:
    """The job's score from its nodes' reports: higher is better; None if unmeasurable or,
    with ``power_budget_w``, infeasible (the nodes' average GPU power is above the budget).

    throughput: samples/s of the whole job, the nodes' mean scaled to ``nodes`` (so a trial
    that lost a node stays comparable); energy: samples per joule of GPU energy. A report
    without ``nonfinite_loss`` (the journal's, of a trial already judged) counts as finite.
    """
    if not reports or any(r.get("nonfinite_loss") for r in reports):
        return None
    if power_budget_w is not None:
        powers = [node_power_w(r) for r in reports]
        if any(p is None for p in powers):
            return None
        if statistics.fmean(p for p in powers if p is not None) > power_budget_w:
            return None
    if objective == "throughput":
        scale = (nodes or len(reports)) / len(reports)
        return float(sum(r["throughput"] for r in reports)) * scale
    if objective == "energy":
        energy = [r["energy_j"] for r in reports]
        if any(e is None or e <= 0 for e in energy):
            return None
        samples = sum(r["samples"] for r in reports)
        return samples / sum(energy)
    raise ValueError(f"unknown objective {objective!r}; choose throughput or energy")


def score_noise(
    reports: Sequence[Mapping[str, Any]], objective: str, nodes: int | None = None
) -> float | None:
    """Standard error of the score. Throughput: from the spread of each node's windows (the
    nodes' window variances over their counts, summed, scaled like the score); None when a
    node has fewer than two windows. Energy: the standard error of the mean of the job's
    windows' samples per joule (:func:`energy_windows`); None when a node reported no energy
    per window (one energy reading for the trial, as agents before energy windows send)."""
    if not reports:
        return None
    if objective == "energy":
        windows = energy_windows(reports)
        if len(windows) < 2:
            return None
        return statistics.stdev(windows) / math.sqrt(len(windows))
    if objective != "throughput":
        return None
    variance = 0.0
    for report in reports:
        values = [float(w) for w in report.get("windows", []) if w]
        if len(values) < 2:
            return None
        variance += statistics.variance(values) / len(values)
    return math.sqrt(variance) * (nodes or len(reports)) / len(reports)


def energy_windows(reports: Sequence[Mapping[str, Any]]) -> list[float]:
    """The job's samples per joule in each measurement window: window ``w``'s samples of
    every node over the energy their GPUs used in it (``window_samples`` and
    ``energy_windows`` of the reports, the windows every node has); empty when a node has no
    energy per window, or a window no energy (a counter that did not move between two
    readings)."""
    if not reports:
        return []
    samples, energy = [], []
    for report in reports:
        s, e = report.get("window_samples"), report.get("energy_windows")
        if not isinstance(s, list) or not isinstance(e, list):
            return []
        samples.append([float(v) for v in s])
        energy.append([float(v) if v is not None else math.nan for v in e])
    count = min(min(len(s), len(e)) for s, e in zip(samples, energy, strict=True))
    out = []
    for w in range(count):
        joules = sum(e[w] for e in energy)
        if not joules > 0:
            return []
        out.append(sum(s[w] for s in samples) / joules)
    return out


def window_scores(
    reports: Sequence[Mapping[str, Any]], objective: str, nodes: int | None = None
) -> list[float]:
    """The job's score in each measurement window the reports share (an early judgement and
    the confirmations go by these): throughput, the nodes' window ``w`` together scaled to
    ``nodes`` as :func:`score` scales; energy, :func:`energy_windows`. Empty when a report
    has no such windows."""
    if not reports:
        return []
    if objective == "energy":
        return energy_windows(reports)
    windows = [[float(w) for w in r.get("windows") or []] for r in reports]
    count = min(len(w) for w in windows)
    scale = (nodes or len(reports)) / len(reports)
    return [sum(w[i] for w in windows) * scale for i in range(count)]


CONFIDENCE = 0.95
"""The confidence level of a gain's interval."""


@dataclass(frozen=True)
class Gain:
    """The best settings against the baseline, both measured the same way (interleaved
    trials, the same measurement plan): ``best / baseline - 1`` with its interval."""

    baseline: float
    """Mean of the baseline's samples (windows; trials for the energy objective when the
    agents report no energy per window)."""
    best: float
    value: float
    low: float
    high: float
    samples: tuple[int, int]
    """How many samples (baseline, best) the means are over."""

    @property
    def better(self) -> bool:
        """The best settings beat the baseline: the whole interval is above zero."""
        return self.low > 0

    def interval(self) -> str:
        """``95% interval +4.1% .. +20.5%``."""
        return interval_text(self.low, self.high)

    def describe(self) -> str:
        """``+12.3% (95% interval +4.1% .. +20.5%)``."""
        return f"{self.value:+.1%} ({self.interval()})"


def interval_text(low: float, high: float) -> str:
    """A gain's interval in words: ``95% interval +4.1% .. +20.5%``."""
    return f"{CONFIDENCE:.0%} interval {low:+.1%} .. {high:+.1%}"


def trial_samples(
    reports: Sequence[Mapping[str, Any]], objective: str, nodes: int | None = None
) -> list[float]:
    """One trial's scores per measurement window (:func:`window_scores`), when it has at
    least two; else the trial's one score (energy from agents without energy windows)."""
    if objective in ("throughput", "energy") and reports:
        windows = window_scores(reports, objective, nodes)
        if len(windows) >= 2:
            return windows
    value = score(reports, objective, nodes)
    return [] if value is None else [value]


def compare(baseline: Sequence[float], best: Sequence[float]) -> Gain | None:
    """The gain of ``best`` over ``baseline`` from their samples, with a Welch t interval on
    the ratio of the means (delta method); None with fewer than two samples on a side or a
    baseline mean that is not positive."""
    from scipy.stats import t as student_t  # type: ignore[import-untyped]

    if len(baseline) < 2 or len(best) < 2:
        return None
    a, b = statistics.fmean(baseline), statistics.fmean(best)
    if a <= 0:
        return None
    va, vb = statistics.variance(baseline) / len(baseline), statistics.variance(best) / len(best)
    ratio = b / a
    se = ratio * math.sqrt(va / a**2 + vb / max(b, 1e-300) ** 2) if b > 0 else math.sqrt(vb) / a
    terms = (va**2 / (len(baseline) - 1)) + (vb**2 / (len(best) - 1))
    dof = (va + vb) ** 2 / terms if terms > 0 else len(baseline) + len(best) - 2
    half = float(student_t.ppf(0.5 + CONFIDENCE / 2, dof)) * se
    return Gain(a, b, ratio - 1, ratio - 1 - half, ratio - 1 + half, (len(baseline), len(best)))

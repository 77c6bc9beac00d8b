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


@dataclass(frozen=True)
class MeasurementPlan:
    """Settle until both step and time minimums pass, then measure likewise, in windows."""

    settle_steps: int = 10
    settle_s: float = 3.0
    measure_steps: int = 40
    measure_s: float = 5.0
    windows: int = 4

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
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad measurement plan: {e}") from None
        if plan.measure_steps < 1 or plan.windows < 1 or plan.settle_steps < 0:
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


@dataclass
class _Rank:
    settle_steps: int = 0
    settle_s: float = 0.0
    measured: list[StepReport] = field(default_factory=list)

    @property
    def measured_s(self) -> float:
        return sum(s.step_s for s in self.measured)


class TrialMeasurement:
    """Turns the step reports of one settings version into a Measurement."""

    def __init__(self, version: int, plan: MeasurementPlan) -> None:
        self.version = version
        self.plan = plan
        self.phase = Phase.SETTLING
        self.nonfinite_loss = False
        self._ranks: dict[int, _Rank] = {}

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
        rank.measured.append(step)
        if all(
            len(r.measured) >= max(self.plan.measure_steps, self.plan.windows)
            and r.measured_s >= self.plan.measure_s
            for r in self._ranks.values()
        ):
            self.phase = Phase.DONE
            return self.phase
        return None

    @property
    def completed_windows(self) -> int:
        """Measurement windows every rank has finished (for partial reports)."""
        if self.phase is Phase.SETTLING or not self._ranks:
            return 0
        size = max(1, -(-max(self.plan.measure_steps, self.plan.windows) // self.plan.windows))
        return min(self.plan.windows, min(len(r.measured) for r in self._ranks.values()) // size)

    def so_far(self) -> Measurement:
        """The measured steps so far as one window (for partial reports)."""
        samples = sum(s.samples for r in self._ranks.values() for s in r.measured)
        seconds = max((r.measured_s for r in self._ranks.values()), default=0.0)
        throughput = sum(
            sum(s.samples for s in r.measured) / r.measured_s
            for r in self._ranks.values()
            if r.measured_s > 0
        )
        steps = sum(len(r.measured) for r in self._ranks.values())
        return Measurement(samples, seconds, throughput, [throughput], steps, self.nonfinite_loss)

    def result(self) -> Measurement:
        """The measurement so far (complete once phase is DONE)."""
        windows = [0.0] * self.plan.windows
        samples, seconds, steps = 0, 0.0, 0
        for rank in self._ranks.values():
            measured = rank.measured
            samples += sum(s.samples for s in measured)
            seconds = max(seconds, rank.measured_s)
            steps += len(measured)
            for w, chunk in enumerate(_split(measured, self.plan.windows)):
                chunk_s = sum(s.step_s for s in chunk)
                if chunk_s > 0:
                    windows[w] += sum(s.samples for s in chunk) / chunk_s
        throughput = statistics.median(windows) if steps else 0.0
        return Measurement(samples, seconds, throughput, windows, steps, self.nonfinite_loss)


def _split(steps: Sequence[StepReport], parts: int) -> list[Sequence[StepReport]]:
    size, extra = divmod(len(steps), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(steps[start:end])
        start = end
    return out


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
    that lost a node stays comparable); energy: samples per joule of GPU energy.
    """
    if not reports or any(r["nonfinite_loss"] for r in reports):
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
    """Standard error of the throughput score, from the spread of each node's windows (the
    nodes' window variances over their counts, summed, scaled like the score); None when a
    node has fewer than two windows, or for the energy objective (one energy reading)."""
    if objective != "throughput" or not reports:
        return None
    variance = 0.0
    for report in reports:
        windows = [float(w) for w in report.get("windows", []) if w]
        if len(windows) < 2:
            return None
        variance += statistics.variance(windows) / len(windows)
    return math.sqrt(variance) * (nodes or len(reports)) / len(reports)

"""Confirming a round's best settings against its start, after the search. Pure.

The search's scores are single measurements, picked as the best of many: the best is
flattered. After the search the start and the best are each measured :data:`CONFIRM_ROUNDS`
more times, interleaved (start, best, best, start, ...) so that a drift of the job over time
falls on both, and compared on those measurements alone
(:func:`~hyperagent.tuner.trial.compare`). :class:`Confirmation` holds a round's order, its
confirmations as they are measured, and the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hyperagent.tuner.jobstate import TrialRecord
from hyperagent.tuner.trial import Gain, compare, trial_samples
from hyperagent.tuner.trialrun import SCORED

CONFIRM_ROUNDS = 2
"""After the search, the start and the best settings are each measured this many times more,
interleaved (start, best, best, start), and compared on those measurements."""

CONFIRM_RUNS = 2 * CONFIRM_ROUNDS
"""Confirmations a round measures."""


def candidate(
    start: dict[str, Any], best: dict[str, Any], trials: Sequence[TrialRecord]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The start and the settings to confirm against it: ``best``, or, when the start
    measured best, the best of the other measured search trials; None when there is
    nothing to compare."""
    if best != start:
        return start, best
    others = [t for t in trials if t.status in SCORED and t.settings != start]
    if not others:
        return None
    return start, max(others, key=lambda t: t.score or 0.0).settings


@dataclass(frozen=True)
class Judgement:
    """The confirmations' verdict: the gain (None: too little was measured to compare), the
    baseline and best settings with their confirmed scores, and the line that says it."""

    gain: Gain | None
    best: tuple[dict[str, Any], float] | None
    baseline: float | None
    text: str


@dataclass
class Confirmation:
    """One round's confirmations: the order they measure in, what each measured, and once
    they are all in, the confirmed gain."""

    runs: int = CONFIRM_RUNS
    order: list[dict[str, Any]] = field(default_factory=list)
    records: list[TrialRecord] = field(default_factory=list)
    confirmed: Gain | None = None

    def plan(self, start: dict[str, Any], best: dict[str, Any]) -> list[dict[str, Any]]:
        """The order of the confirmations of ``best`` against ``start``: interleaved, in
        rounds of start, best, best, start."""
        self.order = ([start, best, best, start] * CONFIRM_ROUNDS)[: self.runs]
        return self.order

    def settings(self, index: int) -> dict[str, Any]:
        """The settings of confirmation ``index`` (0: the first)."""
        return self.order[index]

    @property
    def complete(self) -> bool:
        return bool(self.order) and len(self.records) >= self.runs

    def gain(
        self, start: Mapping[str, Any], best: Mapping[str, Any], objective: str, nodes: int
    ) -> Gain | None:
        """``best`` against the baseline ``start``, from the confirmations that measured
        them (each report's windows a sample)."""
        samples: dict[str, list[float]] = {"start": [], "best": []}
        for record in self.records:
            if record.status != "ok" or record.settings not in (start, best):
                continue
            which = "start" if record.settings == start else "best"
            samples[which] += trial_samples(list(record.reports.values()), objective, nodes)
        return compare(samples["start"], samples["best"])

    def judge(self, objective: str, nodes: int) -> Judgement:
        """The verdict of the measured confirmations (kept as :attr:`confirmed`): the best
        when it beat the start by more than the noise, else the start."""
        start, best = self.order[0], self.order[1]
        gain = self.confirmed = self.gain(start, best, objective, nodes)
        if gain is None:
            return Judgement(None, None, None, "the confirmations measured too little to compare")
        if gain.better:
            text = f"{gain.describe()} over the baseline, confirmed"
            return Judgement(gain, (best, gain.best), gain.baseline, text)
        text = f"no setting was better than the baseline (best candidate {gain.describe()})"
        return Judgement(gain, (start, gain.baseline), gain.baseline, text)

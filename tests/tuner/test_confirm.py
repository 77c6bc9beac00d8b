"""A round's confirmations alone: which settings they compare, the order they measure in,
and the verdict on what they measured."""

from __future__ import annotations

from typing import Any

import pytest

from hyperagent.tuner.confirm import CONFIRM_RUNS, Confirmation, candidate
from hyperagent.tuner.jobstate import TrialRecord

pytestmark = pytest.mark.timeout(60)

START = {"bucket_mb": 25}
BEST = {"bucket_mb": 64}
OTHER = {"bucket_mb": 8}
SPREAD = (-0.02, 0.01, 0.02, -0.01)


def trial(index: int, settings: dict[str, Any], score: float, status: str = "ok") -> TrialRecord:
    return TrialRecord(index, index + 1, settings, score, status)


def measured(index: int, settings: dict[str, Any], per_node: float) -> TrialRecord:
    """A confirmation of ``settings``: two nodes, four windows of ``per_node`` each."""
    reports = {n: {"windows": [per_node * (1 + d) for d in SPREAD]} for n in ("n0", "n1")}
    return TrialRecord(index, index + 1, settings, 2 * per_node, "ok", reports, confirmation=True)


def confirmed(start: float, best: float) -> Confirmation:
    confirmation = Confirmation()
    order = confirmation.plan(START, BEST)
    for i, settings in enumerate(order):
        per_node = start if settings == START else best
        confirmation.records.append(measured(10 + i, settings, per_node))
    return confirmation


def test_the_start_and_best_are_measured_interleaved_start_best_best_start() -> None:
    confirmation = Confirmation()
    assert confirmation.plan(START, BEST) == [START, BEST, BEST, START]
    assert CONFIRM_RUNS == 4
    assert [confirmation.settings(i) for i in range(4)] == [START, BEST, BEST, START]
    assert Confirmation(runs=2).plan(START, BEST) == [START, BEST]


def test_a_best_other_than_the_start_is_confirmed_against_it() -> None:
    assert candidate(START, BEST, [trial(0, START, 1000.0)]) == (START, BEST)


def test_when_the_start_measured_best_the_best_of_the_others_is_confirmed() -> None:
    trials = [
        trial(0, START, 1000.0),
        trial(1, OTHER, 900.0),
        trial(2, BEST, 950.0, "stopped_early"),
        trial(3, {"bucket_mb": 128}, 990.0, "aborted"),
    ]
    assert candidate(START, START, trials) == (START, BEST)
    assert candidate(START, START, [trial(0, START, 1000.0)]) is None


def test_complete_once_every_confirmation_of_the_order_is_in() -> None:
    confirmation = Confirmation()
    assert not confirmation.complete
    confirmation.plan(START, BEST)
    confirmation.records += [measured(10 + i, BEST, 500.0) for i in range(3)]
    assert not confirmation.complete
    confirmation.records.append(measured(13, START, 500.0))
    assert confirmation.complete


def test_a_best_clearly_above_the_start_is_confirmed_with_its_gain() -> None:
    confirmation = confirmed(start=500.0, best=600.0)
    judged = confirmation.judge("throughput", 2)
    assert judged.gain is not None and judged.gain.better
    assert judged.gain.value == pytest.approx(0.2, abs=0.01)
    assert judged.best == (BEST, pytest.approx(1200.0, rel=0.01))
    assert judged.baseline == pytest.approx(1000.0, rel=0.01)
    assert judged.text.endswith("over the baseline, confirmed")
    assert confirmation.confirmed == judged.gain


def test_a_best_within_the_noise_of_the_start_leaves_the_start() -> None:
    judged = confirmed(start=500.0, best=501.0).judge("throughput", 2)
    assert judged.gain is not None and not judged.gain.better
    assert judged.best == (START, judged.gain.baseline)
    assert judged.text.startswith("no setting was better than the baseline")


def test_confirmations_that_measured_nothing_cannot_compare() -> None:
    confirmation = Confirmation()
    confirmation.plan(START, BEST)
    confirmation.records += [
        TrialRecord(10 + i, 11 + i, s, None, "infeasible", confirmation=True)
        for i, s in enumerate(confirmation.order)
    ]
    judged = confirmation.judge("throughput", 2)
    assert (judged.gain, judged.best, judged.baseline) == (None, None, None)
    assert judged.text == "the confirmations measured too little to compare"

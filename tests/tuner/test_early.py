"""Judging a search trial from its first windows against the incumbent's."""

from __future__ import annotations

import random

import pytest

from hyperagent.tuner.early import MIN_WINDOWS, EarlyStop, Verdict, told

INCUMBENT = [1000.0, 1040.0, 960.0, 1010.0, 990.0, 1000.0, 1020.0, 980.0]


def test_a_clearly_worse_trial_stops_after_the_minimum_windows() -> None:
    rule = EarlyStop()
    worse = [700.0, 720.0, 690.0, 710.0]
    assert rule.judge(worse[: MIN_WINDOWS - 1], INCUMBENT) is Verdict.MEASURE_ON
    assert rule.judge(worse[:MIN_WINDOWS], INCUMBENT) is Verdict.WORSE


def test_a_clearly_better_trial_stops_unless_told_not_to() -> None:
    better = [1300.0, 1320.0, 1290.0]
    assert EarlyStop().judge(better, INCUMBENT) is Verdict.BETTER
    assert EarlyStop(stop_better=False).judge(better, INCUMBENT) is Verdict.MEASURE_ON


def test_a_trial_within_the_noise_measures_on() -> None:
    close = [990.0, 1030.0, 970.0, 1005.0]
    assert EarlyStop().judge(close, INCUMBENT) is Verdict.MEASURE_ON


def test_noisy_windows_need_more_of_them_to_be_judged() -> None:
    # 15% lower on average, but windows spread by 20%: not clear after three
    noisy = [1050.0, 650.0, 850.0, 700.0, 900.0, 820.0, 780.0, 860.0, 750.0, 830.0]
    rule = EarlyStop()
    assert rule.judge(noisy[:3], INCUMBENT) is Verdict.MEASURE_ON
    assert rule.judge(noisy, INCUMBENT) is Verdict.WORSE


def test_no_incumbent_or_a_single_window_one_measures_on() -> None:
    rule = EarlyStop()
    assert rule.judge([1.0, 1.0, 1.0], []) is Verdict.MEASURE_ON
    assert rule.judge([1.0, 1.1, 0.9], [5.0]) is Verdict.MEASURE_ON


def test_the_same_settings_are_rarely_cut() -> None:
    """Windows drawn like the incumbent's (10% spread) are cut as worse in about 2.5% of
    judgements at one look, the confirmations' 95% two-sided interval."""
    rng = random.Random(7)
    rule = EarlyStop(min_windows=4)
    cuts = 0
    for _ in range(2000):
        incumbent = [rng.gauss(1000, 100) for _ in range(8)]
        trial = [rng.gauss(1000, 100) for _ in range(4)]
        cuts += rule.judge(trial, incumbent) is Verdict.WORSE
    assert 0.01 < cuts / 2000 < 0.045


def test_the_tuner_is_told_the_mean_and_its_standard_error() -> None:
    mean, error = told([90.0, 110.0, 100.0, 100.0])
    assert mean == 100.0
    assert error == pytest.approx(8.165 / 2, rel=1e-3)
    assert told([5.0]) == (5.0, None)
    with pytest.raises(ValueError):
        told([])


def test_a_rule_needs_a_spread() -> None:
    with pytest.raises(ValueError, match="min_windows"):
        EarlyStop(min_windows=1)


def test_an_energy_trial_stops_early_only_when_worse() -> None:
    incumbent = [100.0, 101.0, 99.0, 100.0]
    better, worse = [130.0, 131.0, 129.0], [70.0, 71.0, 69.0]
    throughput, energy = EarlyStop.for_objective("throughput"), EarlyStop.for_objective("energy")
    assert throughput.judge(better, incumbent) is Verdict.BETTER
    assert energy.judge(better, incumbent) is Verdict.MEASURE_ON
    assert energy.judge(worse, incumbent) is Verdict.WORSE

"""The drift watch alone: when it checks a tuned job's throughput, what it reads, and which
jobs it leaves alone."""

from __future__ import annotations

from typing import Any

import pytest
from tuner.driver import coordinator_section

from hyperagent.config import JobTuningSection
from hyperagent.tuner.drift import DRIFT_CHECK_S, DriftWatch, job_throughput
from hyperagent.tuner.jobstate import Progress
from hyperagent.tuner.membership import Membership

pytestmark = pytest.mark.timeout(60)

NODES = ("n0", "n1")


def config(**settings: Any) -> JobTuningSection:
    return coordinator_section(drift_threshold=0.15, **settings).tuning("j", NODES)


def totals(seconds: float, rate: float, ranks: int = 2) -> dict[str, Progress]:
    """Each node's running totals after ``seconds`` at ``rate`` samples/s for the job (its
    share: half; the step seconds summed over its ``ranks``)."""
    samples = rate / len(NODES) * seconds
    return {n: Progress(samples, seconds * ranks, seconds, ranks) for n in NODES}


def test_the_jobs_throughput_is_its_nodes_rates_scaled_to_the_job() -> None:
    job = Membership(NODES)
    assert job_throughput(totals(20.0, 1000.0), totals(10.0, 1000.0), job, 2) == 1000.0
    one_out = Membership.of(NODES, {"n1": "offline"})
    assert job_throughput(totals(20.0, 1000.0), totals(10.0, 1000.0), one_out, 2) == 1000.0
    assert job_throughput(totals(20.0, 1000.0), {}, job, 2) is None


def test_a_watch_checks_every_ten_seconds_from_when_it_is_armed() -> None:
    watch = DriftWatch()
    cfg = config()
    assert watch.check(100.0, totals(100.0, 1000.0), Membership(NODES), cfg, 1000.0) is None
    watch.arm(100.0, totals(100.0, 1000.0))
    watch.arm(105.0, totals(105.0, 1000.0))  # armed already: no change
    assert watch.at == 100.0 + DRIFT_CHECK_S
    assert watch.check(105.0, totals(105.0, 1000.0), Membership(NODES), cfg, 1000.0) is None
    reading = watch.check(110.0, totals(110.0, 1000.0), Membership(NODES), cfg, 1000.0)
    assert reading is not None and reading.rate == 1000.0 and not reading.below
    assert watch.at == 120.0
    watch.disarm()
    assert watch.check(500.0, totals(500.0, 1000.0), Membership(NODES), cfg, 1000.0) is None


def slowed(progress: dict[str, Progress], factor: float) -> dict[str, Progress]:
    return {n: p._replace(samples=p.samples * factor) for n, p in progress.items()}


def test_throughput_below_the_drift_line_reads_below_and_says_by_how_much() -> None:
    cfg = config()
    for factor, below in ((0.8, True), (0.9, False)):  # the line: 15% below
        watch = DriftWatch()
        watch.arm(0.0, totals(0.0, 1000.0))
        progress = slowed(totals(10.0, 1000.0), factor)
        reading = watch.check(10.0, progress, Membership(NODES), cfg, 1000.0)
        assert reading is not None and reading.rate == pytest.approx(1000.0 * factor)
        assert reading.below is below
    assert reading.describe() == "throughput 900 is 10% below the tuned 1000"


def test_energy_tunings_recommend_mode_and_untuned_jobs_are_not_watched() -> None:
    for cfg, tuned in (
        (config(objective="energy", power_limits_w=[100, 250]), 1000.0),
        (config(mode="recommend"), 1000.0),
        (config(), None),
    ):
        watch = DriftWatch()
        watch.arm(0.0, totals(0.0, 1000.0))
        assert watch.check(10.0, totals(10.0, 100.0), Membership(NODES), cfg, tuned) is None
        assert watch.at == 20.0  # checked on schedule all the same

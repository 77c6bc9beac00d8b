"""One round alone: how each finished trial moves its tuner, best, baseline and incumbent;
how it ends (the confirmations' verdict, the final settings) and what it journals."""

from __future__ import annotations

from typing import Any

import pytest
from tuner.driver import coordinator_section, view

from hyperagent.config import JobTuningSection
from hyperagent.tuner.cost import Cost
from hyperagent.tuner.discovery import plan_space
from hyperagent.tuner.jobstate import TrialRecord
from hyperagent.tuner.resume import space_from
from hyperagent.tuner.rounds import Round, recommendation, start_entry
from hyperagent.tuner.space import SearchSpace

pytestmark = pytest.mark.timeout(60)

NODES = ("n0", "n1")
SPREAD = (-0.02, 0.01, 0.02, -0.01)


def config(**settings: Any) -> JobTuningSection:
    return coordinator_section(**settings).tuning("j", NODES)


def space_of(cfg: JobTuningSection) -> SearchSpace:
    space = plan_space(cfg, view("j", NODES)).space
    assert space is not None
    return space


def a_round(cfg: JobTuningSection | None = None) -> tuple[Round, list[dict[str, Any]]]:
    """A new round, and four distinct points of its space."""
    cfg = cfg or config()
    space = space_of(cfg)
    points = [dict(p) for p in list(space.grid())[:4]]
    return Round.begin(space, cfg, 1, points[0], confirm_runs=4), points


def trial(
    index: int, settings: dict[str, Any], score: float | None, status: str = "ok", **said: Any
) -> TrialRecord:
    reports = {} if score is None else {n: report(score / 2) for n in NODES}
    return TrialRecord(index, index + 1, settings, score, status, reports, 10.0, **said)


def report(per_node: float) -> dict[str, Any]:
    windows = [per_node * (1 + d) for d in SPREAD]
    return {"throughput": per_node, "samples": per_node * 10, "seconds": 10.0, "windows": windows}


def test_trial_zero_is_the_baseline_and_the_first_best_and_last_good() -> None:
    tuned, points = a_round()
    tuned.record(trial(0, points[0], 1000.0))
    assert tuned.baseline == 1000.0
    assert tuned.best == (points[0], 1000.0) and tuned.incumbent is tuned.trials[0]
    assert tuned.last_good == points[0]
    assert tuned.tuner is not None and tuned.tuner.observations == [(points[0], 1000.0)]


def test_a_better_trial_becomes_the_best_and_incumbent_unless_judged_worse() -> None:
    tuned, points = a_round()
    tuned.record(trial(0, points[0], 1000.0))
    tuned.record(trial(1, points[1], 1100.0, "stopped_early", verdict="worse"))
    assert tuned.best == (points[0], 1000.0)
    tuned.record(trial(2, points[2], 1200.0, "stopped_early", verdict="better"))
    assert tuned.best == (points[2], 1200.0) and tuned.incumbent is tuned.trials[2]
    assert tuned.last_good == points[2]
    assert tuned.gain == pytest.approx(0.2)


def test_an_aborted_trial_is_told_its_score_and_an_unscored_one_half_the_worst() -> None:
    tuned, points = a_round()
    tuned.record(trial(0, points[0], 1000.0))
    tuned.record(trial(1, points[1], 400.0, "aborted"))
    tuned.record(trial(2, points[2], None, "infeasible"))
    assert tuned.best == (points[0], 1000.0)
    assert tuned.tuner is not None
    assert [s for _, s in tuned.tuner.observations] == [1000.0, 400.0, 200.0]


def test_confirmations_are_kept_apart_from_the_search() -> None:
    tuned, points = a_round()
    tuned.add(trial(0, points[0], 1000.0))
    tuned.add(trial(6, points[1], 1100.0, confirmation=True))
    assert [t.index for t in tuned.trials] == [0] and [t.index for t in tuned.confirmations] == [6]


def test_the_first_settings_are_trial_zeros_then_the_start_then_the_spaces_defaults() -> None:
    tuned, points = a_round()
    space = space_of(config())
    assert tuned.first_settings(None, space) == space.snap(space.defaults())
    assert tuned.first_settings(points[1], space) == points[1]
    tuned.record(trial(0, points[2], 1000.0))
    assert tuned.first_settings(points[1], space) == points[2]


def test_a_round_ends_on_the_confirmed_best_with_the_confirmed_baseline() -> None:
    tuned, points = a_round()
    tuned.record(trial(0, points[0], 1000.0))
    tuned.record(trial(1, points[1], 1300.0))
    order = tuned.plan_confirmations(points[0])
    assert order == [points[0], points[1], points[1], points[0]]
    assert tuned.plan_confirmations(points[0]) is None  # planned once
    for i, settings in enumerate(order):
        score = 1000.0 if settings == points[0] else 1200.0
        tuned.add(trial(2 + i, settings, score, confirmation=True))
    judged, final = tuned.conclude(points[0], "throughput", 2)
    assert judged is not None and judged.gain is not None and judged.gain.better
    assert final == points[1]
    assert tuned.best == (points[1], pytest.approx(1200.0))
    assert tuned.baseline == pytest.approx(1000.0)


def test_a_round_without_a_measured_trial_ends_on_its_start() -> None:
    tuned, points = a_round()
    tuned.record(trial(0, points[0], None, "infeasible"))
    judged, final = tuned.conclude(points[0], "throughput", 2)
    assert judged is None and final == points[0] and tuned.best == (points[0], 0.0)


def test_the_final_entry_has_the_confirmed_gain_and_the_rounds_cost() -> None:
    tuned, points = a_round()
    tuned.record(trial(0, points[0], 1000.0))
    plain = tuned.final_entry(5, points[0], None)
    assert plain == {
        "type": "final",
        "version": 5,
        "settings": points[0],
        "score": 1000.0,
        "baseline": 1000.0,
    }
    tuned.record(trial(1, points[1], 1300.0))
    tuned.plan_confirmations(points[0])
    for i, settings in enumerate(tuned.confirmation.order):
        score = 1000.0 if settings == points[0] else 1200.0
        tuned.add(trial(2 + i, settings, score, confirmation=True))
    tuned.conclude(points[0], "throughput", 2)
    spent = Cost("throughput", 60.0, 1000.0, 1200.0, 100.0, 0.01, 600.0)
    entry = tuned.final_entry(9, points[1], spent)
    assert entry["better"] is True and entry["gain"] == pytest.approx(0.2, abs=0.01)
    assert entry["gain_low"] < entry["gain"] < entry["gain_high"]
    assert entry["cost"] == {
        "seconds": 60.0,
        "samples_lost": 100.0,
        "samples_lost_ratio": 0.01,
        "break_even_s": 600.0,
    }


def test_no_cost_before_the_start_is_measured_then_the_rounds_trials_count() -> None:
    tuned, points = a_round()
    assert tuned.cost("throughput", 2) is None
    tuned.record(trial(0, points[0], 1000.0))
    tuned.record(trial(1, points[1], 500.0))
    spent = tuned.cost("throughput", 2)
    assert spent is not None and spent.seconds == 20.0 and spent.lost > 0


def test_a_new_round_keeps_the_last_good_settings_and_journals_its_start() -> None:
    cfg = config()
    space = space_of(cfg)
    good = dict(list(space.grid())[3])
    tuned = Round.begin(space, cfg, 2, None, confirm_runs=4, last_good=good)
    assert tuned.last_good == good and tuned.trials == [] and tuned.best is None
    entry = start_entry(cfg, space, 2)
    assert (entry["type"], entry["round"], entry["nodes"]) == ("start", 2, list(NODES))
    assert space_from(entry["space"]) == space


def test_recommend_mode_recommends_the_last_finished_tuning_else_the_table() -> None:
    cfg = config()
    space = space_of(cfg)
    start = space.snap(space.defaults())
    final = {"settings": {"bucket_mb": 64}}
    assert recommendation(space, start, cfg, final) == (
        {"bucket_mb": 64},
        "the last finished tuning of this job",
    )
    table, why = recommendation(space, start, cfg, None)
    assert table == space.recommended(2, start)
    assert why.startswith(f"BACKGROUND.md's table for 2 nodes on {cfg.backend}")

"""Resuming from a journal's state alone: whether the journal's round fits the job as it is
now, and where replaying it puts the round (its best, its confirmations, its next step)."""

from __future__ import annotations

from typing import Any

import pytest
from tuner.driver import coordinator_section, trial_entry, view

from hyperagent.config import JobTuningSection
from hyperagent.tuner.discovery import plan_space
from hyperagent.tuner.journal import JournalState
from hyperagent.tuner.lifecycle import Finish, Trial, Tuned
from hyperagent.tuner.resume import replay, resumable, waits_on
from hyperagent.tuner.rounds import start_entry
from hyperagent.tuner.space import SearchSpace
from hyperagent.tuner.tuning import rules_of

pytestmark = pytest.mark.timeout(60)

NODES = ("n0", "n1")


def config(**settings: Any) -> JobTuningSection:
    return coordinator_section(**{"trials": 6, **settings}).tuning("j", NODES)


def space_of(cfg: JobTuningSection) -> SearchSpace:
    space = plan_space(cfg, view("j", NODES)).space
    assert space is not None
    return space


def journal(cfg: JobTuningSection, trials: list[dict[str, Any]], **more: Any) -> JournalState:
    space = space_of(cfg)
    start = start_entry(cfg, space, 1)
    return JournalState(version=len(trials), trials=trials, rounds=1, start=start, **more)


def points(cfg: JobTuningSection) -> list[dict[str, Any]]:
    return [dict(p) for p in list(space_of(cfg).grid())[:3]]


def test_a_round_of_this_jobs_space_resumes_and_one_of_another_does_not() -> None:
    cfg = config()
    p = points(cfg)
    state = journal(cfg, [trial_entry(0, p[0], 1000.0)])
    assert resumable(state, space_of(cfg), cfg)
    energy = config(objective="energy", power_limits_w=[100, 250])
    assert not resumable(state, space_of(energy), energy)  # another space: caps searched
    bigger = config(model_params_b=70)
    assert not resumable(state, space_of(bigger), bigger)  # another fingerprint: the model
    assert not resumable(journal(cfg, []), space_of(cfg), cfg)  # nothing measured yet
    refused = journal(cfg, [trial_entry(0, p[0], None, status="refused")])
    assert not resumable(refused, space_of(cfg), cfg)


def test_a_search_resumes_at_its_next_trial_with_its_best_and_baseline() -> None:
    cfg = config()
    p = points(cfg)
    state = journal(
        cfg,
        [
            trial_entry(0, p[0], 1000.0),
            trial_entry(1, p[1], 1200.0),
            trial_entry(2, p[2], None, status="infeasible"),
        ],
    )
    resumed = replay(state, space_of(cfg), cfg, p[0], rules_of(cfg))
    assert resumed.state == Trial(1, "search", 3) and resumed.actions == ()
    assert resumed.number == 1 and resumed.retrying is None
    tuned = resumed.round
    assert tuned.baseline == 1000.0 and tuned.best == (p[1], 1200.0)
    assert tuned.incumbent is not None and tuned.incumbent.index == 1
    assert tuned.tuner is not None and tuned.tuner.n_told == 3


def test_the_trial_in_flight_is_retried_with_its_settings() -> None:
    cfg = config()
    p = points(cfg)
    in_flight = {"type": "published", "version": 2, "trial": 1, "settings": p[1]}
    state = journal(cfg, [trial_entry(0, p[0], 1000.0)], in_flight=in_flight)
    resumed = replay(state, space_of(cfg), cfg, p[0], rules_of(cfg))
    assert resumed.retrying == p[1] and resumed.state == Trial(1, "search", 1)


def test_confirmations_resume_where_they_stopped_in_their_order() -> None:
    cfg = config(trials=2)
    p = points(cfg)
    order = [p[0], p[1], p[1], p[0]]
    trials = [
        trial_entry(0, p[0], 1000.0),
        trial_entry(1, p[1], 1200.0),
        trial_entry(2, p[0], 1000.0, confirmation=True),
        trial_entry(3, p[1], 1200.0, confirmation=True),
    ]
    state = journal(cfg, trials, confirm={"type": "confirm", "from": 2, "order": order})
    resumed = replay(state, space_of(cfg), cfg, p[0], rules_of(cfg))
    assert resumed.state == Trial(1, "confirm", 4, confirm_from=2)
    assert resumed.round.confirmation.order == order
    assert [t.index for t in resumed.round.confirmations] == [2, 3]
    assert [t.index for t in resumed.round.trials] == [0, 1]


def test_a_finished_round_resumes_tuned_on_its_final_settings() -> None:
    cfg = config()
    p = points(cfg)
    final = {"type": "final", "version": 9, "settings": p[1], "score": 1150.0, "baseline": 990.0}
    state = journal(cfg, [trial_entry(0, p[0], 1000.0), trial_entry(1, p[1], 1200.0)], final=final)
    resumed = replay(state, space_of(cfg), cfg, p[0], rules_of(cfg))
    assert resumed.state == Tuned(1) and resumed.actions == (Finish(),)
    assert resumed.round.best == (p[1], 1150.0) and resumed.round.baseline == 990.0
    assert resumed.round.last_good == p[1] and resumed.round.final_journalled


def test_a_restarted_job_waits_for_the_nodes_of_its_round_for_the_ranks_wait() -> None:
    cfg = config()
    state = journal(cfg, [])
    assert waits_on(state, 10.0, 120.0) == NODES
    assert waits_on(state, 120.0, 120.0) == ()
    assert waits_on(JournalState(), 0.0, 120.0) == ()

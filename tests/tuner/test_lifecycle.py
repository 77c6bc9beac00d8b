"""The tuning lifecycle's transitions, one by one, and the ones it refuses."""

from __future__ import annotations

import dataclasses

import pytest

from hyperagent.tuner.lifecycle import (
    Backoff,
    Confirm,
    Drift,
    Ended,
    Finish,
    IllegalTransition,
    Pause,
    Paused,
    Resume,
    Retry,
    Retune,
    Rollback,
    Tick,
    Trial,
    Tuned,
    WaitingForQuorum,
    advance,
    name,
)

BACKOFF = Backoff(5.0, 300.0)


def test_a_measured_trial_leads_to_the_next_one() -> None:
    state, actions = advance(Trial(1, "search", 3), Ended("ok", now=10.0))
    assert state == Trial(1, "search", 4) and actions == []
    state, actions = advance(Trial(1, "search", 4), Ended("aborted", now=11.0))
    assert state == Trial(1, "search", 5) and actions == []


def test_a_trial_that_harms_the_job_counts_and_rolls_back() -> None:
    for status in ("nonfinite_loss", "xid"):
        state, actions = advance(Trial(1, "search", 2), Ended(status, now=1.0))
        assert state == Trial(1, "search", 3)
        assert actions == [Rollback(f"trial 2 {status}")]
    state, actions = advance(Trial(1, "search", 2), Ended("infeasible", now=1.0))
    assert state == Trial(1, "search", 3) and actions == []


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        ("refused", "refused"),
        ("no_ack", "no ack"),
        ("lost_nodes", "no ack"),
        ("timeout", "no measurement"),
    ],
)
def test_what_is_not_a_trial_pauses_the_same_trial(status: str, reason: str) -> None:
    state, actions = advance(
        Trial(1, "search", 4), Ended(status, now=100.0, nodes=("n2",), more=False), BACKOFF
    )
    paused = Paused(1, "search", 4, reason, ("n2",), retry_at=105.0, attempt=0)
    assert state == paused
    # rolled back and announced; never finished, even with the budget spent
    assert actions == [Rollback(f"trial 4 {status}"), Pause(paused)]
    assert name(state) == "paused"


def test_a_pause_retries_the_same_trial_when_due_and_a_quorum_answers() -> None:
    paused = Paused(1, "search", 4, "refused", ("n2",), retry_at=105.0)
    assert advance(paused, Tick(104.9, quorum=True)) == (paused, [])
    state, actions = advance(paused, Tick(105.0, quorum=True))
    assert state == Trial(1, "search", 4, retrying=paused) and actions == [Retry(paused)]


def test_a_due_retry_without_a_quorum_waits_for_the_nodes() -> None:
    paused = Paused(1, "search", 4, "no measurement", ("n1", "n2"), retry_at=105.0)
    state, actions = advance(paused, Tick(200.0, quorum=False))
    assert state == WaitingForQuorum(paused) and actions == []
    assert name(state) == "waiting_for_quorum"
    assert advance(state, Tick(201.0, quorum=False)) == (state, [])
    state, actions = advance(state, Tick(202.0, quorum=True))
    assert state == Trial(1, "search", 4, retrying=paused) and actions == [Retry(paused)]


def test_retries_back_off_exponentially_and_announce_only_a_new_reason() -> None:
    paused = Paused(1, "search", 4, "refused", ("n2",), retry_at=105.0)
    retry = Trial(1, "search", 4, retrying=paused)
    state, actions = advance(retry, Ended("refused", now=110.0, nodes=("n2",)), BACKOFF)
    assert state == dataclasses.replace(paused, retry_at=120.0, attempt=1)
    assert actions == [Rollback("trial 4 refused")]  # the same pause: said once
    delays = [BACKOFF.delay_s(a) for a in range(9)]
    assert delays == [5, 10, 20, 40, 80, 160, 300, 300, 300]
    state, actions = advance(retry, Ended("timeout", now=110.0, nodes=("n1",)), BACKOFF)
    assert isinstance(state, Paused) and state.reason == "no measurement"
    assert actions == [Rollback("trial 4 timeout"), Pause(state)]  # a new reason: said


def test_a_retry_that_measures_resumes_the_search() -> None:
    paused = Paused(1, "search", 4, "refused", ("n2",), retry_at=105.0, attempt=3)
    state, actions = advance(Trial(1, "search", 4, retrying=paused), Ended("ok", now=120.0))
    assert state == Trial(1, "search", 5) and actions == [Resume(paused)]


def test_the_search_ends_at_its_budget_or_when_measured_trials_converge() -> None:
    state, actions = advance(Trial(1, "search", 9), Ended("ok", now=1.0, more=False))
    assert state == Tuned(1) and actions == [Finish()]
    state, actions = advance(Trial(1, "search", 5), Ended("ok", now=1.0, converged=True))
    assert state == Tuned(1) and actions == [Finish()]
    # a penalised outcome does not make the tuning converge
    state, actions = advance(Trial(1, "search", 5), Ended("infeasible", now=1.0, converged=True))
    assert state == Trial(1, "search", 6) and actions == []


def test_the_search_goes_on_to_confirmations_then_ends() -> None:
    state, actions = advance(Trial(1, "search", 9), Ended("ok", now=1.0, more=False, confirm=True))
    assert state == Trial(1, "confirm", 10) and actions == [Confirm()]
    assert name(state) == "confirming"
    state, actions = advance(state, Ended("ok", now=2.0))
    assert state == Trial(1, "confirm", 11) and actions == []
    state, actions = advance(state, Ended("ok", now=3.0, more=False, converged=True, confirm=True))
    assert state == Tuned(1) and actions == [Finish()]


def test_a_confirmation_that_is_not_measured_pauses_too() -> None:
    state, actions = advance(Trial(1, "confirm", 11), Ended("no_ack", now=1.0, nodes=("n0",)))
    assert isinstance(state, Paused) and state.phase == "confirm" and state.trial == 11
    assert actions[0] == Rollback("confirmation 11 no_ack")


def test_drift_sustained_starts_a_new_round() -> None:
    tuned = Tuned(1)
    state, actions = advance(tuned, Drift(100.0, below=True, sustained_s=300.0))
    assert state == Tuned(1, drifting_since=100.0) and actions == []
    state, actions = advance(state, Drift(399.0, below=True, sustained_s=300.0))
    assert state == Tuned(1, drifting_since=100.0) and actions == []
    recovered, actions = advance(state, Drift(399.5, below=False, sustained_s=300.0))
    assert recovered == Tuned(1) and actions == []
    state, actions = advance(state, Drift(400.0, below=True, sustained_s=300.0))
    assert state == Trial(2, "search", 0) and actions == [Retune()]
    assert name(state) == "retuning"


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (Tuned(1), Ended("ok", now=1.0)),
        (Tuned(1), Tick(1.0, quorum=True)),
        (Trial(1, "search", 0), Tick(1.0, quorum=True)),
        (Trial(1, "search", 0), Drift(1.0, below=True, sustained_s=1.0)),
        (Paused(1, "search", 0, "refused", (), 5.0), Ended("ok", now=1.0)),
        (Paused(1, "search", 0, "refused", (), 5.0), Drift(1.0, below=True, sustained_s=1.0)),
        (WaitingForQuorum(Paused(1, "search", 0, "refused", (), 5.0)), Ended("ok", now=1.0)),
        (Trial(1, "search", 0), Ended("exploded", now=1.0)),
    ],
)
def test_illegal_transitions_are_refused(state: object, event: object) -> None:
    with pytest.raises(IllegalTransition):
        advance(state, event)  # type: ignore[arg-type]


def test_states_are_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Trial().trial = 3  # type: ignore[misc]
    assert name(None) == "starting" and name(Trial()) == "searching" and name(Tuned()) == "tuned"

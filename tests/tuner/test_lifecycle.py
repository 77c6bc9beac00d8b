"""The job lifecycle's transitions, one by one, and the ones it refuses."""

from __future__ import annotations

import pytest

from hyperagent.tuner.lifecycle import (
    STATES,
    Backoff,
    Confirm,
    Drift,
    Ended,
    Fail,
    Failed,
    Finish,
    IllegalTransition,
    Journalled,
    Left,
    Pause,
    Paused,
    RanksTick,
    Ready,
    Resume,
    Retry,
    Retune,
    Rollback,
    Rules,
    RunEnded,
    SayMissing,
    Stop,
    Tick,
    Trial,
    Tuned,
    WaitingForQuorum,
    WaitingForRanks,
    advance,
    name,
    resumed,
)

RULES = Rules(
    trials=10, confirm_runs=4, max_retries=2, ranks_wait_s=120.0, backoff=Backoff(5.0, 300.0)
)


def test_a_found_job_waits_for_its_ranks_and_names_the_missing_once() -> None:
    waiting = WaitingForRanks(since=0.0)
    assert advance(waiting, RanksTick(119.0, "rank 7 on n2"), RULES) == (waiting, [])
    state, actions = advance(waiting, RanksTick(120.0, "rank 7 on n2"), RULES)
    assert state == WaitingForRanks(0.0, said=True)
    assert actions == [SayMissing("rank 7 on n2")]
    assert advance(state, RanksTick(500.0, "rank 7 on n2"), RULES) == (state, [])
    assert advance(state, Ready(501.0), RULES) == (Trial(), [])
    assert name(waiting) == "waiting_for_ranks"


def test_ready_resumes_where_the_journal_says() -> None:
    resume = (Trial(1, "confirm", 8, confirm_from=8), ())
    state, actions = advance(WaitingForRanks(0.0), Ready(1.0, resume), RULES)
    assert state == Trial(1, "confirm", 8, confirm_from=8) and actions == []
    assert name(state) == "confirming"


def test_a_measured_trial_leads_to_the_next_one() -> None:
    assert advance(Trial(1, "search", 3), RunEnded("ok", 10.0), RULES) == (
        Trial(1, "search", 4),
        [],
    )
    assert advance(Trial(1, "search", 4), RunEnded("aborted", 11.0), RULES) == (
        Trial(1, "search", 5),
        [],
    )


@pytest.mark.parametrize("status", ["nonfinite_loss", "xid", "rejected"])
def test_a_trial_that_harms_the_job_or_is_refused_by_bounds_counts_and_rolls_back(
    status: str,
) -> None:
    state, actions = advance(Trial(1, "search", 2), RunEnded(status, 1.0), RULES)
    assert state == Trial(1, "search", 3)
    assert actions == [Rollback(f"trial 2 {status}")]


def test_an_infeasible_trial_counts_without_a_rollback() -> None:
    assert advance(Trial(1, "search", 2), RunEnded("infeasible", 1.0), RULES) == (
        Trial(1, "search", 3),
        [],
    )


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
    state, actions = advance(Trial(1, "search", 4), RunEnded(status, 100.0, ("n2",)), RULES)
    paused = Paused(1, "search", 4, reason, ("n2",), retry_at=105.0, attempt=0)
    assert state == paused
    assert actions == [Rollback(f"trial 4 {status}"), Pause(paused)]
    assert name(state) == "paused"


def test_a_not_trial_never_finishes_the_search_even_on_its_last_trial() -> None:
    state, _ = advance(
        Trial(1, "search", 9), RunEnded("timeout", 0.0, ("n1",), converged=True), RULES
    )
    assert isinstance(state, Paused) and state.trial == 9


def test_a_pause_retries_the_same_trial_when_due_and_a_quorum_answers() -> None:
    paused = Paused(1, "search", 4, "refused", ("n2",), retry_at=105.0)
    assert advance(paused, Tick(104.9, quorum=True), RULES) == (paused, [])
    state, actions = advance(paused, Tick(105.0, quorum=True), RULES)
    assert state == Trial(1, "search", 4, retrying=paused) and actions == [Retry(paused)]


def test_a_due_retry_without_a_quorum_waits_for_the_nodes() -> None:
    paused = Paused(1, "search", 4, "no measurement", ("n1", "n2"), retry_at=105.0)
    state, actions = advance(paused, Tick(200.0, quorum=False), RULES)
    assert state == WaitingForQuorum(paused) and actions == []
    assert name(state) == "waiting_for_quorum"
    assert advance(state, Tick(201.0, quorum=False), RULES) == (state, [])
    state, actions = advance(state, Tick(202.0, quorum=True), RULES)
    assert state == Trial(1, "search", 4, retrying=paused) and actions == [Retry(paused)]


def test_retries_back_off_say_a_new_reason_once_and_fail_when_spent() -> None:
    first = Paused(1, "search", 4, "no ack", ("n2",), retry_at=105.0)
    state, actions = advance(
        Trial(1, "search", 4, retrying=first), RunEnded("no_ack", 200.0, ("n2",)), RULES
    )
    assert isinstance(state, Paused) and state.attempt == 1 and state.retry_at == 210.0
    assert actions == [Rollback("trial 4 no_ack")]
    state, actions = advance(
        Trial(1, "search", 4, retrying=state), RunEnded("timeout", 300.0, ("n2",)), RULES
    )
    assert isinstance(state, Paused) and state.retry_at == 320.0
    assert actions[-1] == Pause(state)
    state, actions = advance(
        Trial(1, "search", 4, retrying=state), RunEnded("timeout", 400.0, ("n2",)), RULES
    )
    assert isinstance(state, Failed) and "no measurement (n2) 3 times" in state.reason
    assert actions[-1] == Stop(state.reason) and name(state) == "failed"


def test_a_measured_retry_says_the_job_answers_again() -> None:
    paused = Paused(1, "search", 4, "no ack", ("n2",), retry_at=105.0)
    state, actions = advance(Trial(1, "search", 4, retrying=paused), RunEnded("ok", 106.0), RULES)
    assert state == Trial(1, "search", 5) and actions == [Resume(paused)]


def test_the_search_ends_on_its_budget_or_when_converged_and_confirms_a_candidate() -> None:
    state, actions = advance(Trial(1, "search", 9), RunEnded("ok", 1.0), RULES)
    assert state == Trial(1, "confirm", 10, confirm_from=10) and actions == [Confirm()]
    state, actions = advance(Trial(1, "search", 3), RunEnded("ok", 1.0, converged=True), RULES)
    assert state == Trial(1, "confirm", 4, confirm_from=4) and actions == [Confirm()]
    # an infeasible outcome never makes a search converge
    state, _ = advance(Trial(1, "search", 3), RunEnded("infeasible", 1.0, converged=True), RULES)
    assert state == Trial(1, "search", 4)
    # nothing better than the start: no confirmation, the start is final
    state, actions = advance(Trial(1, "search", 9), RunEnded("ok", 1.0, candidate=False), RULES)
    assert state == Tuned(1) and actions == [Finish()]


def test_confirmations_run_their_count_then_the_job_is_tuned() -> None:
    state: object = Trial(1, "confirm", 10, confirm_from=10)
    for expected in (11, 12, 13):
        state, actions = advance(state, RunEnded("ok", 1.0), RULES)  # type: ignore[arg-type]
        assert state == Trial(1, "confirm", expected, confirm_from=10) and actions == []
    state, actions = advance(state, RunEnded("ok", 1.0), RULES)  # type: ignore[arg-type]
    assert state == Tuned(1) and actions == [Finish()] and name(state) == "tuned"


def test_a_confirmation_that_cannot_be_measured_pauses_as_a_confirmation() -> None:
    state, actions = advance(
        Trial(1, "confirm", 12, confirm_from=10), RunEnded("timeout", 50.0, ("n3",)), RULES
    )
    assert state == Paused(1, "confirm", 12, "no measurement", ("n3",), 55.0, 0, 10)
    assert actions[0] == Rollback("confirmation 12 timeout")
    state, _ = advance(state, Tick(55.0, quorum=True), RULES)
    assert isinstance(state, Trial) and (state.phase, state.trial, state.confirm_from) == (
        "confirm",
        12,
        10,
    )


def test_drift_sustained_retunes_and_a_recovery_resets_the_watch() -> None:
    tuned = Tuned(1)
    state, _ = advance(tuned, Drift(100.0, below=True, sustained_s=60.0), RULES)
    assert state == Tuned(1, drifting_since=100.0)
    state, _ = advance(state, Drift(130.0, below=False, sustained_s=60.0), RULES)
    assert state == Tuned(1)
    state, _ = advance(state, Drift(140.0, below=True, sustained_s=60.0), RULES)
    state, actions = advance(state, Drift(200.0, below=True, sustained_s=60.0), RULES)
    assert state == Trial(2) and actions == [Retune()] and name(state) == "retuning"


@pytest.mark.parametrize(
    "state",
    [
        WaitingForRanks(0.0),
        Trial(1, "search", 3),
        Paused(1, "search", 3, "no ack", (), 9.0),
        WaitingForQuorum(Paused(1, "search", 3, "no ack", (), 9.0)),
        Tuned(1),
    ],
)
def test_every_live_state_ends_when_its_ranks_leave_or_fails_on_a_fault(state: object) -> None:
    ended, actions = advance(state, Left(5.0), RULES)  # type: ignore[arg-type]
    assert ended == Ended("every rank left") and actions == [Stop("every rank left")]
    failed, actions = advance(state, Fail("no node can cap"), RULES)  # type: ignore[arg-type]
    assert failed == Failed("no node can cap") and actions == [Stop("no node can cap")]
    assert name(ended) == "ended"


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (Ended("every rank left"), Ready(1.0)),
        (Failed("x"), Left(1.0)),
        (WaitingForRanks(0.0), RunEnded("ok", 1.0)),
        (Trial(1, "search", 1), Tick(1.0, quorum=True)),
        (Trial(1, "search", 1), RunEnded("gibberish", 1.0)),
        (Tuned(1), RunEnded("ok", 1.0)),
        (Paused(1, "search", 1, "no ack", (), 2.0), Drift(1.0, True, 60.0)),
    ],
)
def test_any_other_pair_is_refused_by_name(state: object, event: object) -> None:
    with pytest.raises(IllegalTransition, match="does not take"):
        advance(state, event, RULES)  # type: ignore[arg-type]


def test_a_restart_resumes_where_the_journal_stopped_never_searching_again() -> None:
    assert resumed(Journalled(searched=0), RULES) == (Trial(1, "search", 0), [])
    assert resumed(Journalled(searched=4), RULES) == (Trial(1, "search", 4), [])
    assert resumed(Journalled(searched=10), RULES) == (
        Trial(1, "confirm", 10, confirm_from=10),
        [Confirm()],
    )
    assert resumed(Journalled(searched=5, converged=True), RULES) == (
        Trial(1, "confirm", 5, confirm_from=5),
        [Confirm()],
    )
    # mid-confirmation: the next confirmation, even though the search budget is not spent
    assert resumed(Journalled(searched=5, confirm_from=5, confirmed=2), RULES) == (
        Trial(1, "confirm", 7, confirm_from=5),
        [],
    )
    assert resumed(Journalled(searched=5, confirm_from=5, confirmed=4), RULES) == (
        Tuned(1),
        [Finish()],
    )
    assert resumed(Journalled(round=2, searched=3, final=True), RULES) == (Tuned(2), [Finish()])


def test_every_state_name_is_listed_for_metrics() -> None:
    named = {
        name(s)
        for s in (
            WaitingForRanks(0.0),
            Trial(1),
            Trial(1, "confirm"),
            Trial(2),
            Tuned(1),
            Paused(1, "search", 0, "x", (), 0.0),
            WaitingForQuorum(Paused(1, "search", 0, "x", (), 0.0)),
            Ended("x"),
            Failed("x"),
        )
    }
    assert named == set(STATES)

"""What a job's tuning tells its operator, line by line: each led by the job, naming the
nodes, what they said and what happens next."""

from __future__ import annotations

import logging

import pytest

from hyperagent.tuner.events import Say, Status
from hyperagent.tuner.lifecycle import Paused
from hyperagent.tuner.membership import Change
from hyperagent.tuner.notices import Notices

pytestmark = pytest.mark.timeout(60)

SAY = Notices("job-7")


def paused(nodes: tuple[str, ...], attempt: int = 0) -> Paused:
    return Paused(1, "search", 3, "refused", nodes, 20.0, attempt)


def test_a_pause_names_the_nodes_what_they_said_and_when_it_retries() -> None:
    errors = {"n1": "power cap 400 W above the node's 350 W", "n2": "capping is off"}
    say, status = SAY.paused(paused(("n1", "n2")), errors, 5.0)
    assert say == Say(
        logging.WARNING,
        "job-7: paused (refused: n1, n2; n1: power cap 400 W above the node's 350 W; "
        "n2: capping is off); retrying the same settings in 5s, then with back-off",
    )
    assert status == Status("job-7: paused, refused: n1, n2")
    say, status = SAY.paused(paused(()), {}, 5.0)
    assert isinstance(say, Say) and "(refused: no node answered)" in say.text
    assert status == Status("job-7: paused, refused: no node")


def test_a_resumed_job_counts_its_retries() -> None:
    once = Say(logging.INFO, "job-7: resumed after 1 retry (refused)")
    thrice = Say(logging.INFO, "job-7: resumed after 3 retries (refused)")
    assert SAY.resumed(paused(("n1",))) == [once]
    assert SAY.resumed(paused(("n1",), attempt=2)) == [thrice]


def test_a_node_out_of_scoring_is_a_warning_and_its_return_news() -> None:
    out = SAY.changes(
        [Change("n1", None, "silent", "no ack of v4"), Change("n1", "silent", None, "its report")]
    )
    assert out == [
        Say(logging.WARNING, "job-7: node n1 excluded from scoring (silent: no ack of v4)"),
        Say(logging.INFO, "job-7: node n1 is back (its report; it was out: silent)"),
    ]


def test_a_rollback_says_where_it_goes_or_why_it_does_not() -> None:
    good = {"bucket_mb": 25}
    assert SAY.rollback("trial 3 xid", good, "", quiet=False) == Say(
        logging.WARNING, "job-7: trial 3 xid; rolling back to {'bucket_mb': 25}"
    )
    gone = SAY.rollback("trial 3 timeout", good, "rank 3 on n1", quiet=True)
    assert gone == Say(logging.DEBUG, "job-7: trial 3 timeout; rank 3 on n1: not rolling back")


def test_the_end_and_the_progress_lines() -> None:
    assert SAY.ended("every rank left", failed=False) == [
        Say(logging.INFO, "job-7: ended: every rank left"),
        Status("job-7: ended, every rank left"),
    ]
    failed = Say(logging.ERROR, "job-7: failed: no search space")
    assert SAY.ended("no search space", failed=True)[0] == failed
    assert SAY.progress(False, 3, 10, ({}, 1234.5678)) == Status("job-7: trial 3/10, best 1235")
    assert SAY.progress(True, 1, 4, None) == Status("job-7: confirm 1/4, best none")

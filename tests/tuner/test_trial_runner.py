"""The trial in play and its settings channel alone: versions that only go up, which acks
and reports count, a jump above a version the agents already apply, and a run's end."""

from __future__ import annotations

from typing import Any

import pytest
from tuner.driver import coordinator_section, view

from hyperagent.config import JobTuningSection
from hyperagent.tuner.discovery import plan_space
from hyperagent.tuner.events import Ask, Asked, Journal, Publish, Say
from hyperagent.tuner.lifecycle import Trial
from hyperagent.tuner.membership import Membership
from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.runner import Runner
from hyperagent.tuner.trialrun import Judge

pytestmark = pytest.mark.timeout(60)

NODES = ("n0", "n1")
JOB = Membership(NODES)
SETTINGS = {"bucket_mb": 64}


def config(**settings: Any) -> JobTuningSection:
    return coordinator_section(ack_timeout_s=10, **settings).tuning("j", NODES)


def ack(node: str, version: int, ok: bool = True, **said: Any) -> dict[str, Any]:
    return {"node": node, "version": version, "ok": ok, "error": None, "applied": {}, **said}


def report(node: str, version: int, **said: Any) -> dict[str, Any]:
    return {
        "node": node,
        "version": version,
        "throughput": 500.0,
        "samples": 5000.0,
        "seconds": 10.0,
        "windows": [495.0, 500.0, 505.0, 500.0],
        "energy_j": 2500.0,
        "nonfinite_loss": False,
        "xid_errors": 0.0,
        **said,
    }


def started(runner: Runner, cfg: JobTuningSection, now: float = 0.0) -> Publish:
    out = runner.start(Trial(1, "search", 1), dict(SETTINGS), None, cfg, now, now)
    assert isinstance(out[0], Journal) and isinstance(out[1], Publish)
    return out[1]


def test_each_publish_journals_first_under_a_version_above_the_last() -> None:
    runner = Runner("j", version=41)
    out = runner.publish(dict(SETTINGS), None, None, NODES, 5.0)
    assert [type(e) for e in out] == [Journal, Publish]
    journal, publish = out
    assert isinstance(journal, Journal) and isinstance(publish, Publish)
    assert journal.entry == {
        "type": "published",
        "version": 42,
        "trial": None,
        "settings": SETTINGS,
    }
    assert (publish.version, publish.nodes, publish.plan) == (42, NODES, None)
    assert runner.in_play(42) and not runner.in_play(41)
    assert runner.current == SETTINGS and runner.acks == {42: {}}


def test_a_trial_without_settings_asks_the_tuner_and_runs_its_answer_only() -> None:
    cfg = config()
    space = plan_space(cfg, view("j", NODES)).space
    assert space is not None
    tuner = Tuner(space, seed=0)
    runner = Runner("j")
    trial = Trial(1, "search", 3)
    out = runner.start(trial, None, tuner, cfg, 1.0, 1.0)
    assert out == [Ask(1, tuner)] and runner.run is None
    assert runner.asked(Asked(2.0, 7, SETTINGS), trial, cfg, 2.0) == []  # another token
    out = runner.asked(Asked(2.0, 1, SETTINGS), trial, cfg, 2.0)
    publish = out[1]
    assert isinstance(publish, Publish) and publish.trial == 3 and publish.plan is not None
    assert runner.run is not None and runner.run.deadline == 12.0
    assert runner.retrying == SETTINGS and runner.trial_started == 2.0


def test_acks_of_another_version_or_from_another_node_do_not_count() -> None:
    runner = Runner("j")
    publish = started(runner, config())
    judge = Judge(config())
    for message in (ack("n0", publish.version - 1), ack("n9", publish.version)):
        taken = runner.ack(1.0, 1.0, message, JOB, judge)
        assert taken.members is JOB and taken.changes == () and taken.effects == ()
    assert runner.acks == {publish.version: {}}


def test_a_stalled_ack_puts_its_node_out_and_an_answer_brings_it_back() -> None:
    runner = Runner("j")
    publish = started(runner, config())
    judge = Judge(config())
    taken = runner.ack(1.0, 1.0, ack("n1", publish.version, stalled=True), JOB, judge)
    assert taken.members.out == {"n1": "stalled"}
    taken = runner.report(2.0, report("n1", publish.version, partial=True), taken.members, judge)
    assert taken.members.out == {} and [c.why for c in taken.changes] == ["its report"]


def test_an_agent_applying_a_newer_version_makes_the_settings_go_out_above_it() -> None:
    runner = Runner("j")
    publish = started(runner, config())
    judge = Judge(config())
    runner.ack(1.0, 1.0, ack("n0", publish.version), JOB, judge)
    refusal = ack("n1", publish.version, ok=False, applied={"version": 40})
    taken = runner.ack(2.0, 2.0, refusal, JOB, judge)
    say, journal, again = taken.effects
    assert isinstance(say, Say) and "agents apply v40 already" in say.text
    assert isinstance(journal, Journal) and isinstance(again, Publish)
    assert again.version == 41 and again.settings == SETTINGS and again.trial == 1
    assert runner.run is not None and runner.run.version == 41 and runner.run.acks == {}


def test_a_measured_power_cap_latency_lengthens_the_next_cap_changes_settling() -> None:
    cfg = config()
    runner = Runner("j")
    publish = started(runner, cfg)
    message = ack("n0", publish.version, applied={"power_cap_latency_s": 6.0})
    runner.ack(1.0, 1.0, message, JOB, Judge(cfg))
    assert runner.cap_latency_s == 6.0
    out = runner.start(Trial(1, "search", 2), {"power_cap_w": 150}, None, cfg, 5.0, 5.0)
    publish = out[1]
    assert isinstance(publish, Publish) and publish.plan is not None
    assert publish.plan.settle_s == 7.0


def test_a_measured_run_ends_with_its_record_and_nothing_left_to_retry() -> None:
    cfg = config()
    runner = Runner("j")
    publish = started(runner, cfg)
    judge = Judge(cfg)
    job = JOB
    for node in NODES:
        job = runner.ack(1.0, 1.0, ack(node, publish.version), job, judge).members
    taken = runner.report(3.0, report("n0", publish.version), job, judge)
    assert taken.record is None
    taken = runner.report(4.0, report("n1", publish.version), job, judge)
    assert taken.record is not None
    assert (taken.record.status, taken.record.score, taken.record.seconds) == ("ok", 1000.0, 4.0)
    assert runner.run is None and runner.retrying is None and runner.trial_started is None
    assert runner.last_version == publish.version


def test_a_run_no_node_acked_ends_unmeasured_and_keeps_its_settings_to_retry() -> None:
    cfg = config()
    runner = Runner("j")
    started(runner, cfg)
    taken = runner.look(10.0, JOB, Judge(cfg))
    assert taken.record is not None and taken.record.status == "no_ack"
    assert runner.retrying == SETTINGS


def test_settled_once_every_active_node_acked_or_the_ack_deadline_passed() -> None:
    cfg = config()
    runner = Runner("j")
    assert runner.settled(NODES, 0.0, 10.0)
    publish = runner.publish(dict(SETTINGS), None, None, NODES, 100.0)[1]
    assert isinstance(publish, Publish)
    version = publish.version
    assert not runner.settled(NODES, 101.0, 10.0)
    for node in NODES:
        runner.ack(101.0, 101.0, ack(node, version), JOB, Judge(cfg))
    assert runner.settled(NODES, 101.0, 10.0)
    runner.publish(dict(SETTINGS), None, None, NODES, 200.0)
    assert runner.settled(("n0",), 205.0, 10.0) is False
    assert runner.settled(("n0",), 210.0, 10.0)

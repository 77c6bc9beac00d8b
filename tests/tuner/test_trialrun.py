"""One trial's run judged alone (no job machine around it): what the nodes' acks and reports
make of it, its status and score, and which nodes its look puts out of scoring."""

from __future__ import annotations

from typing import Any

import pytest
from tuner.driver import coordinator_section

from hyperagent.config import JobTuningSection
from hyperagent.tuner.jobstate import TrialRecord
from hyperagent.tuner.lifecycle import Phase
from hyperagent.tuner.membership import Membership
from hyperagent.tuner.trial import MeasurementPlan
from hyperagent.tuner.trialrun import Judge, Run, RunStep, measurement_plan

pytestmark = pytest.mark.timeout(60)

NODES = ("n0", "n1")
VERSION = 7
SPREAD = (-0.03, 0.02, -0.01, 0.03, -0.02, 0.01, 0.0, -0.005)


def config(**settings: Any) -> JobTuningSection:
    return coordinator_section(**settings).tuning("j", NODES)


def a_run(phase: Phase = "search", trial: int = 1) -> Run:
    return Run(trial, phase, {"bucket_mb": 64}, VERSION, MeasurementPlan(), 0.0, 10.0)


def ack(node: str, ok: bool = True, refusal: str | None = None) -> dict[str, Any]:
    error = None if ok else f"refused ({refusal})"
    return {"node": node, "version": VERSION, "ok": ok, "error": error, "refusal": refusal}


def report(node: str, per_node: float, windows: int = 4, **said: Any) -> dict[str, Any]:
    """A node's report of ``windows`` windows of ``per_node`` samples/s each (3% spread)."""
    values = [per_node * (1 + SPREAD[w]) for w in range(windows)]
    return {
        "node": node,
        "version": VERSION,
        "throughput": sum(values) / windows,
        "samples": per_node * 10.0,
        "seconds": 10.0,
        "windows": values,
        "energy_j": per_node * 5.0,
        "nonfinite_loss": False,
        "xid_errors": 0.0,
        **said,
    }


def acked(run: Run, judge: Judge, now: float = 1.0) -> RunStep:
    """Every node acks: the run goes on to measuring."""
    for node in NODES:
        run.acks[node] = ack(node)
    step = run.step(now, Membership(NODES), judge)
    assert step.outcome is None and run.measuring
    return step


def test_every_node_acks_then_the_run_measures_until_the_trial_timeout() -> None:
    run, judge = a_run(), Judge(config(trial_timeout_s=120))
    run.acks["n0"] = ack("n0")
    assert run.step(1.0, Membership(NODES), judge) == RunStep(None, Membership(NODES))
    assert not run.measuring
    acked(run, judge, now=2.0)
    assert run.deadline == 122.0


def test_full_reports_from_every_node_score_the_trial_as_the_job_sum() -> None:
    run, judge = a_run(), Judge(config())
    acked(run, judge)
    for node in NODES:
        run.took_report(node, report(node, 500.0))
    step = run.step(5.0, Membership(NODES), judge)
    assert step.outcome is not None
    assert step.outcome.status == "ok"
    assert step.outcome.score == pytest.approx(1000.0, rel=0.01)
    assert step.outcome.noise is not None and step.outcome.noise > 0
    assert step.changes == () and step.stopped is None


def test_a_refusal_of_the_settings_is_rejected_and_one_about_the_node_refused() -> None:
    judge = Judge(config())
    for kind, status in (("settings", "rejected"), ("node", "refused")):
        run = a_run()
        run.acks["n0"] = ack("n0")
        run.acks["n1"] = ack("n1", ok=False, refusal=kind)
        outcome = run.step(1.0, Membership(NODES), judge).outcome
        assert outcome is not None
        assert (outcome.status, outcome.nodes) == (status, ("n1",))
        assert outcome.errors == {"n1": f"refused ({kind})"}


def test_a_node_silent_past_the_ack_deadline_is_out_of_scoring_and_the_run_goes_on() -> None:
    run, judge = a_run(), Judge(config())
    run.acks["n0"] = ack("n0")
    step = run.step(10.0, Membership(NODES), judge)
    assert step.outcome is None and run.measuring
    assert step.members.out == {"n1": "silent"}
    assert [(c.node, c.after) for c in step.changes] == [("n1", "silent")]


def test_no_ack_at_all_is_no_ack_from_every_node() -> None:
    outcome = a_run().step(10.0, Membership(NODES), Judge(config())).outcome
    assert outcome is not None and (outcome.status, outcome.nodes) == ("no_ack", NODES)


def test_a_node_that_did_not_measure_by_the_deadline_is_out_and_the_rest_score() -> None:
    run, judge = a_run(), Judge(config(trial_timeout_s=60))
    acked(run, judge)
    run.took_report("n0", report("n0", 500.0))
    step = run.step(61.0, Membership(NODES), judge)
    assert step.outcome is not None and step.outcome.status == "ok"
    assert set(step.outcome.reports) == {"n0"}
    assert step.outcome.score == pytest.approx(1000.0, rel=0.01)  # scaled to two nodes
    assert step.members.out == {"n1": "no measurement"}


def test_nothing_measured_by_the_deadline_is_a_timeout() -> None:
    run, judge = a_run(), Judge(config(trial_timeout_s=60))
    acked(run, judge)
    outcome = run.step(61.0, Membership(NODES), judge).outcome
    assert outcome is not None and outcome.status == "timeout"


def test_an_energy_tuning_without_an_energy_reading_is_no_energy() -> None:
    run, judge = a_run(), Judge(config(objective="energy", power_limits_w=[100, 250]))
    acked(run, judge)
    for node in NODES:
        run.took_report(node, report(node, 500.0, energy_j=None))
    outcome = run.step(5.0, Membership(NODES), judge).outcome
    assert outcome is not None and outcome.status == "no_energy"


def test_a_nan_loss_or_an_xid_error_is_its_own_outcome() -> None:
    for said, status in (({"nonfinite_loss": True}, "nonfinite_loss"), ({"xid_errors": 1}, "xid")):
        run, judge = a_run(), Judge(config())
        acked(run, judge)
        run.took_report("n0", report("n0", 500.0))
        run.took_report("n1", report("n1", 500.0, **said))
        outcome = run.step(5.0, Membership(NODES), judge).outcome
        assert outcome is not None and outcome.status == status


def test_partial_reports_below_the_abort_line_abort_a_search_trial_not_a_confirmation() -> None:
    judge = Judge(config(abort_below=0.7, early_stop=False), baseline=1000.0)
    cases: tuple[tuple[Phase, bool], ...] = (("search", True), ("confirm", False))
    for phase, aborted in cases:
        run = a_run(phase)
        acked(run, judge)
        for node in NODES:
            run.took_report(node, report(node, 300.0, windows=2, partial=True))
        outcome = run.step(3.0, Membership(NODES), judge).outcome
        if aborted:
            assert outcome is not None and outcome.status == "aborted"
            assert outcome.score == pytest.approx(600.0, rel=0.02)
        else:
            assert outcome is None


def test_a_stalled_report_drops_the_nodes_partial_and_counts_as_unmeasured() -> None:
    run = a_run()
    run.took_report("n1", report("n1", 500.0, windows=2, partial=True))
    run.took_report("n1", {"node": "n1", "version": VERSION, "stalled": True})
    assert "n1" not in run.partials and run.reports["n1"]["stalled"]


def incumbent(per_node: float) -> TrialRecord:
    reports = {n: report(n, per_node, windows=8) for n in NODES}
    return TrialRecord(0, 3, {"bucket_mb": 25}, 2 * per_node, "ok", reports)


def test_a_clearly_worse_search_trial_stops_after_three_windows() -> None:
    judge = Judge(config(early_stop=True), baseline=1000.0, incumbent=incumbent(500.0))
    run = a_run()
    acked(run, judge)
    for windows in (2, 3):
        for node in NODES:
            run.took_report(node, report(node, 400.0, windows=windows, partial=True))
        step = run.step(3.0, Membership(NODES), judge)
        if windows == 2:
            assert step.outcome is None
    assert step.outcome is not None
    assert (step.outcome.status, step.outcome.verdict) == ("stopped_early", "worse")
    assert step.outcome.score == pytest.approx(800.0, rel=0.03)
    assert step.stopped is not None
    assert step.stopped.startswith("trial 1 stopped after 3 windows: worse than trial 0")


def test_the_baseline_and_confirmations_are_never_stopped_early() -> None:
    judge = Judge(config(early_stop=True), baseline=1000.0, incumbent=incumbent(500.0))
    for run in (a_run("search", trial=0), a_run("confirm", trial=6)):
        acked(run, judge)
        for node in NODES:
            run.took_report(node, report(node, 400.0, windows=3, partial=True))
        assert run.step(3.0, Membership(NODES), judge).outcome is None


def test_ending_a_run_records_its_outcome_and_duration() -> None:
    run, judge = a_run("confirm", trial=6), Judge(config())
    acked(run, judge, now=1.0)
    for node in NODES:
        run.took_report(node, report(node, 500.0))
    outcome = run.step(5.0, Membership(NODES), judge).outcome
    assert outcome is not None
    record = run.record(12.5, outcome)
    assert (record.index, record.version, record.status) == (6, VERSION, "ok")
    assert record.confirmation and record.seconds == 12.5
    assert set(record.acks) == set(NODES) and record.score == outcome.score


def test_a_changed_power_cap_settles_for_the_measured_cap_latency() -> None:
    plan = config().plan
    same = measurement_plan(plan, {"power_cap_w": 200}, {"power_cap_w": 200}, None)
    assert same.settle_s == plan.settle_s
    unmeasured = measurement_plan(plan, {"power_cap_w": 200}, {"power_cap_w": 150}, None)
    assert unmeasured.settle_s == max(plan.settle_s, 3.0)
    slow = measurement_plan(plan, {"power_cap_w": 200}, {"power_cap_w": 150}, 7.5)
    assert slow.settle_s == 8.5

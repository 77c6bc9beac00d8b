"""A tuning's cost (samples lost against the start) and its break-even, from journal files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tuner.driver import trial_entry

from hyperagent.tuner.cost import (
    Span,
    duration_text,
    journal_cost,
    objective_of,
    trial_span,
    tuning_cost,
)
from hyperagent.tuner.journal import Journal

START = {"bucket_mb": 25, "chunk_kb": 1024}
BEST = {"bucket_mb": 64, "chunk_kb": 4096}
BAD = {"bucket_mb": 1, "chunk_kb": 64}


def journal_of(
    tmp_path: Path, entries: list[dict[str, Any]], nodes: int = 2, name: str = "job"
) -> Journal:
    journal = Journal(tmp_path / f"{name}.jsonl")
    nodes_list = [f"node-{n}" for n in range(nodes)]
    journal.append({"type": "start", "fingerprint": "f", "nodes": nodes_list})
    for e in entries:
        journal.append(e)
    return journal


def test_a_bad_trial_costs_its_shortfall_and_the_best_wins_it_back(tmp_path: Path) -> None:
    # start 1000 samples/s for 10 s, a candidate at half the rate for 10 s, the best at 1100
    journal = journal_of(
        tmp_path,
        [trial_entry(0, START, 1000.0), trial_entry(1, BAD, 500.0), trial_entry(2, BEST, 1100.0)],
    )
    cost = journal_cost(journal.load(), "throughput")
    assert cost is not None
    # 30 s at 1000/s would have trained 30,000 samples; the tuning trained 26,000
    assert cost.seconds == 30.0
    assert cost.lost == pytest.approx(4000.0)
    assert cost.lost_ratio == pytest.approx(4000 / 30000)
    # 100 samples/s more at the best: 40 s to win 4,000 back
    assert cost.break_even_s == pytest.approx(40.0)
    assert "break-even 40 s" in cost.describe()


def test_the_final_entry_gives_the_confirmed_baseline_and_best(tmp_path: Path) -> None:
    journal = journal_of(
        tmp_path,
        [
            trial_entry(0, START, 1000.0),
            trial_entry(1, BAD, 500.0),
            trial_entry(2, BEST, 1100.0),
            trial_entry(3, START, 1000.0, confirmation=True),
            trial_entry(4, BEST, 1050.0, confirmation=True),
        ],
    )
    journal.append(
        {"type": "final", "version": 9, "settings": BEST, "score": 1050.0, "baseline": 1000.0}
    )
    cost = journal_cost(journal.load(), "throughput")
    assert cost is not None
    assert cost.seconds == 50.0  # confirmations are part of the tuning
    assert cost.best == 1050.0
    # lost 5,000 - 1,000 - 500 = 3,500 at 50 samples/s confirmed: 70 s
    assert cost.lost == pytest.approx(3500.0)
    assert cost.break_even_s == pytest.approx(70.0)


def test_a_tuning_that_found_nothing_better_never_breaks_even(tmp_path: Path) -> None:
    journal = journal_of(tmp_path, [trial_entry(0, START, 1000.0), trial_entry(1, BAD, 400.0)])
    journal.append(
        {"type": "final", "version": 3, "settings": START, "score": 1000.0, "baseline": 1000.0}
    )
    cost = journal_cost(journal.load(), "throughput")
    assert cost is not None and cost.lost > 0
    assert cost.break_even_s is None
    assert "never breaks even" in cost.describe()


def test_a_tuning_that_trained_faster_than_the_start_cost_nothing(tmp_path: Path) -> None:
    journal = journal_of(tmp_path, [trial_entry(0, START, 1000.0), trial_entry(1, BEST, 1500.0)])
    cost = journal_cost(journal.load(), "throughput")
    assert cost is not None
    assert cost.lost == pytest.approx(-5000.0) and cost.lost_ratio < 0
    assert cost.break_even_s == 0.0


def test_unmeasured_trials_count_as_the_start(tmp_path: Path) -> None:
    journal = journal_of(
        tmp_path,
        [
            trial_entry(0, START, 1000.0),
            trial_entry(1, BAD, None, seconds=2.0, status="rejected"),
            trial_entry(2, BEST, 1100.0),
        ],
    )
    cost = journal_cost(journal.load(), "throughput")
    assert cost is not None
    assert cost.unmeasured_s == 2.0 and cost.seconds == 22.0
    assert cost.lost == pytest.approx(-1000.0)


def test_aborted_trials_cost_their_partial_rate(tmp_path: Path) -> None:
    aborted = trial_entry(1, BAD, 300.0, seconds=4.0, status="aborted")
    journal = journal_of(
        tmp_path, [trial_entry(0, START, 1000.0), aborted, trial_entry(2, BEST, 1100.0)]
    )
    cost = journal_cost(journal.load(), "throughput")
    assert cost is not None
    assert cost.lost == pytest.approx(4 * 700.0 - 10 * 100.0)


def test_a_node_that_left_is_scaled_to_the_job(tmp_path: Path) -> None:
    one_left = trial_entry(1, BEST, 1100.0)
    del one_left["reports"]["node-1"]  # one node reporting half the job's rate
    journal = journal_of(tmp_path, [trial_entry(0, START, 1000.0), one_left])
    cost = journal_cost(journal.load(), "throughput")
    assert cost is not None
    assert cost.lost == pytest.approx(-1000.0)


def test_energy_counts_samples_the_tunings_joules_would_have_bought(tmp_path: Path) -> None:
    # start: 1000 samples/s at 500 W (2 samples/J); a cap at 300 W: 900 samples/s (3 samples/J)
    journal = journal_of(
        tmp_path,
        [
            trial_entry(0, START, 1000.0, energy_per_s=500.0),
            trial_entry(1, BAD, 400.0, energy_per_s=400.0),  # 1 sample/J
            trial_entry(2, BEST, 900.0, energy_per_s=300.0),
        ],
    )
    cost = journal_cost(journal.load(), "energy")
    assert cost is not None
    # 12,000 J at 2 samples/J = 24,000 samples; trained 10,000 + 4,000 + 9,000
    assert cost.lost == pytest.approx(1000.0)
    assert cost.lost_ratio == pytest.approx(1000 / 24000)
    # 1 sample/J more at the best, at 300 W: 1,000 J in 3.3 s
    assert cost.break_even_s == pytest.approx(1000 / 300)


def test_energy_without_an_energy_reading_has_no_cost(tmp_path: Path) -> None:
    journal = journal_of(tmp_path, [trial_entry(0, START, 1000.0), trial_entry(1, BEST, 1100.0)])
    assert journal_cost(journal.load(), "energy") is None


def test_no_cost_before_the_start_is_measured(tmp_path: Path) -> None:
    assert journal_cost(journal_of(tmp_path, []).load(), "throughput") is None
    failed = journal_of(tmp_path, [trial_entry(0, START, None, status="timeout")], name="failed")
    assert journal_cost(failed.load(), "throughput") is None


def test_only_the_current_round_counts(tmp_path: Path) -> None:
    journal = journal_of(tmp_path, [trial_entry(0, START, 1000.0), trial_entry(1, BAD, 100.0)])
    journal.append({"type": "start", "fingerprint": "f", "nodes": ["node-0", "node-1"]})
    journal.append(trial_entry(0, BEST, 1100.0))
    cost = journal_cost(journal.load(), "throughput")
    assert cost is not None and cost.seconds == 10.0 and cost.lost == 0.0


def test_the_objective_is_the_start_entrys_or_what_trial_zero_scored(tmp_path: Path) -> None:
    throughput = [trial_entry(0, START, 1000.0, energy_per_s=500.0)]
    throughput[0]["score"] = 1000.0
    energy = [trial_entry(0, START, 1000.0, energy_per_s=500.0)]
    assert objective_of(throughput) == "throughput"
    assert objective_of(energy) == "energy"
    assert objective_of(energy, {"type": "start", "objective": "throughput"}) == "throughput"
    journal = journal_of(tmp_path, [*energy, trial_entry(1, BEST, 900.0, energy_per_s=300.0)])
    cost = journal_cost(journal.load())
    assert cost is not None and cost.objective == "energy"


def test_trial_span_reads_a_reports_rate_and_power() -> None:
    span = trial_span(trial_entry(3, BEST, 800.0, energy_per_s=400.0), nodes=2)
    assert span == Span(10.0, 800.0, 400.0)
    assert trial_span(trial_entry(3, BEST, 800.0)) == Span(10.0, 800.0, None)
    assert trial_span(trial_entry(3, BEST, None, status="rejected")) == Span(10.0, None, None)


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="objective"):
        tuning_cost([], "speed", 1.0, 2.0)
    with pytest.raises(ValueError, match="positive"):
        tuning_cost([], "throughput", 0.0, 2.0)
    with pytest.raises(ValueError, match="power"):
        tuning_cost([], "energy", 1.0, 2.0)


def test_durations_read_as_people_say_them() -> None:
    assert [duration_text(s) for s in (45, 720, 12600, 190000)] == [
        "45 s",
        "12 min",
        "3.5 h",
        "2.2 d",
    ]


def test_a_finished_tuning_journals_its_cost_and_shows_it_on_metrics(tmp_path: Path) -> None:
    """A closed loop (the pure machine, its nodes answering): the final entry carries the cost
    and break-even, and the job's readings expose them, matching the journal's own figures."""
    from tuner.driver import Nodes, begin, coordinator_section

    from hyperagent.tuner.metrics import job_readings

    def score(settings: dict[str, Any]) -> float:
        return 1000.0 + 200.0 * (settings.get("bucket_mb") == 64)

    nodes = ("n0", "n1")
    path = tmp_path / "j.jsonl"
    driver = begin(
        "j",
        nodes,
        path,
        coordinator_section(trials=6, patience=6),
        Nodes(nodes, score, measure_s=10.0),
    )
    driver.run_until_done()
    final = Journal(path).load().final
    assert final is not None and "cost" in final, final
    cost = final["cost"]
    assert cost["seconds"] > 0 and cost["samples_lost"] == pytest.approx(
        cost["samples_lost_ratio"] * cost["seconds"] * final["baseline"], rel=1e-6
    )
    readings = {r.name: r.value for r in job_readings(driver.machine)}
    assert readings["hyperagent_tuner_samples_lost"] == pytest.approx(cost["samples_lost"])
    assert readings["hyperagent_tuner_tuning_seconds"] == pytest.approx(cost["seconds"])
    if cost["break_even_s"] is None:
        assert "hyperagent_tuner_break_even_seconds" not in readings
    else:
        assert readings["hyperagent_tuner_break_even_seconds"] == pytest.approx(
            cost["break_even_s"]
        )
    assert any("lost " in line and "of " in line for line in driver.said), driver.said

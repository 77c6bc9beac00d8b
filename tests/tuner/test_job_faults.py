"""What a job's tuning does with the faults that are facts about the settings or the node,
not about the moment: a refusal because of the settings themselves, a node's actuation
bounds, a missing energy reading, GPUs shared with another job, a restart mid-confirmation.
Each one, as a user would notice it: trials spent or not, what is retried, what is said."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tuner.driver import Nodes, begin, coordinator_section, empty_view, view

from hyperagent.tuner import lifecycle, tuning
from hyperagent.tuner.discovery import NodeBounds
from hyperagent.tuner.jobstate import Progress
from hyperagent.tuner.journal import Journal

NODES = ("n0", "n1", "n2")


def score(settings: dict[str, Any]) -> float:
    return 1000.0 + 50.0 * (settings.get("bucket_mb") == 64)


def statuses(driver: Any) -> list[str]:
    return [t.status for t in driver.machine.trials]


def test_a_refusal_of_the_settings_themselves_is_an_infeasible_trial_not_a_pause(
    tmp_path: Path,
) -> None:
    """n1 cannot apply 64 MB buckets (a fact about the setting): each such point is told to
    the tuner as infeasible once, the tuning never pauses on it and ends on its budget."""
    section = coordinator_section(trials=8, patience=8, confirm_best=False)

    def refuses(node: str, settings: dict[str, Any]) -> str | None:
        return "settings" if node == "n1" and settings.get("bucket_mb") == 64 else None

    nodes = Nodes(NODES, score, refuses=refuses)
    driver = begin("j", NODES, tmp_path / "j.jsonl", section, nodes)
    driver.run_until_done()
    trials = driver.machine.trials
    assert len(trials) == 8 and driver.machine.done
    rejected = [t for t in trials if t.status == "rejected"]
    assert rejected and all(t.settings["bucket_mb"] == 64 for t in rejected)
    assert all(t.settings["bucket_mb"] != 64 for t in trials if t.status != "rejected")
    entries = Journal(tmp_path / "j.jsonl").load()
    assert not [e for e in entries.trials if e["status"] == "refused"]
    assert driver.machine.best is not None and driver.machine.best[0]["bucket_mb"] != 64


def test_a_refusal_about_the_node_pauses_and_retries_without_spending_trials(
    tmp_path: Path,
) -> None:
    section = coordinator_section(trials=4, patience=4, confirm_best=False, max_retries=3)
    nodes = Nodes(NODES, score, refuse={"n2": "node"})
    driver = begin("j", NODES, tmp_path / "j.jsonl", section, nodes)
    driver.run_until_done()
    state = driver.machine.state
    assert isinstance(state, lifecycle.Failed) and "refused (n2)" in state.reason, state
    assert not [t for t in driver.machine.trials if t.status in lifecycle.TRIALS]


def test_a_nodes_actuation_bounds_narrow_the_power_caps_before_trial_0(tmp_path: Path) -> None:
    """n2 caps at most 350 W: no trial ever asks it for more, and one line says so."""
    section = coordinator_section(
        trials=6,
        patience=6,
        confirm_best=False,
        power_limits_w=[100, 400],
        search_power_cap=True,
    )
    bounds = {"n2": NodeBounds(power_cap=True, max_w=350.0)}
    driver = begin("j", NODES, tmp_path / "j.jsonl", section, Nodes(NODES, score), bounds=bounds)
    driver.run_until_done()
    caps = [p.settings["power_cap_w"] for p in driver.published if p.plan is not None]
    assert caps and max(caps) <= 350, caps
    assert statuses(driver) and "rejected" not in statuses(driver)
    said = [line for line in driver.said if "n2" in line and "350" in line]
    assert len(said) == 1, driver.said


def test_a_node_whose_bounds_meet_none_of_the_jobs_caps_leaves_the_cap_out_and_says_why(
    tmp_path: Path,
) -> None:
    """n1 caps at most 150 W, below every cap of the job's 200-400 W: no cap is published at
    all (never one outside the job's range or a node's bounds), the rest is tuned, and one
    line says why."""
    section = coordinator_section(
        trials=4, patience=4, confirm_best=False, power_limits_w=[200, 400], search_power_cap=True
    )
    bounds = {"n1": NodeBounds(power_cap=True, max_w=150.0)}
    driver = begin("j", NODES, tmp_path / "j.jsonl", section, Nodes(NODES, score), bounds=bounds)
    driver.run_until_done()
    assert driver.published and driver.machine.done
    assert not [p for p in driver.published if p.settings.get("power_cap_w") is not None]
    said = [line for line in driver.said if "power cap is not tuned" in line]
    assert said and "n1" in said[0] and "200-400 W" in said[0], driver.said


def test_a_missing_energy_reading_is_not_a_trial(tmp_path: Path) -> None:
    """An energy job on nodes whose energy counters do not answer: nothing is scored (no
    penalty told to the tuner); the job pauses for "no energy reading" and says so."""
    section = coordinator_section(objective="energy", trials=4, max_retries=2)
    nodes = Nodes(NODES, score, energy=False)
    driver = begin("j", NODES, tmp_path / "j.jsonl", section, nodes)
    samples = 0.0
    while not driver.machine.done and driver.now < 3600:  # the job steps on, every second
        driver.advance(1.0)
        samples += 100.0
        for node in NODES:
            driver.feed(tuning.Steps(driver.now, node, Progress(samples, 1.0, driver.now, 8)))
    assert not [t for t in driver.machine.trials if t.status in lifecycle.TRIALS]
    assert not [t for t in driver.machine.trials if t.status == "infeasible"]
    state = driver.machine.state
    assert isinstance(state, lifecycle.Failed) and "no energy reading" in state.reason, state


def test_gpus_shared_with_another_job_leave_the_power_cap_out_and_say_why(
    tmp_path: Path,
) -> None:
    section = coordinator_section(
        objective="energy", trials=4, patience=4, confirm_best=False, power_limits_w=[100, 250]
    )
    driver = begin("j", NODES, tmp_path / "j.jsonl", section, Nodes(NODES, score), separable=False)
    driver.run_until_done()
    caps = {p.settings.get("power_cap_w") for p in driver.published}
    assert len(caps) == 1, caps  # never searched: the cap the job started with
    assert any("cannot tell this job's GPUs from another job's" in line for line in driver.said)


def test_an_energy_tuning_restarted_after_its_last_confirmation_concludes_as_it_would_have(
    tmp_path: Path,
) -> None:
    """An energy job on agents that report no energy per window (an agent of an earlier
    version): the coordinator killed after journalling the last confirmation, before it
    published the chosen settings. Restarted, it judges the confirmations from the journal's
    reports (which keep no ``nonfinite_loss``: the trials were judged finite) and ends with
    the same final as the coordinator that was not killed."""
    section = coordinator_section(
        objective="energy", trials=4, patience=4, power_limits_w=[100, 250]
    )
    whole = begin("j", NODES, tmp_path / "whole.jsonl", section, Nodes(NODES, score))
    whole.run_until_done()
    lines = (tmp_path / "whole.jsonl").read_text().splitlines(keepends=True)
    entries = [json.loads(line) for line in lines]
    last = max(i for i, e in enumerate(entries) if e.get("confirmation"))
    expected = next(e for e in entries[last:] if e["type"] == "final")
    (tmp_path / "killed.jsonl").write_text("".join(lines[: last + 1]))
    restarted = begin("j", NODES, tmp_path / "killed.jsonl", section, Nodes(NODES, score))
    restarted.run_until_done()
    final = Journal(tmp_path / "killed.jsonl").load().final
    assert final is not None
    assert (final["settings"], final["gain"]) == (expected["settings"], expected["gain"])


def test_a_rank_dying_mid_trial_publishes_nothing_more_for_its_job(tmp_path: Path) -> None:
    """Trial 0 is measuring when a rank on n2 dies (its node's steps stop; the job is no longer
    whole) and then the rest of the job ends: no rollback version or any other goes out for
    it, and its journal says it ended."""
    section = coordinator_section(
        trials=4, patience=4, end_after_s=5, max_retries=5, ack_timeout_s=5, trial_timeout_s=20
    )
    nodes = Nodes(NODES, score)  # answered by hand
    driver = begin("j", NODES, tmp_path / "j.jsonl", section)
    (trial,) = driver.published
    for node in NODES:
        driver.feed(nodes.ack(driver.now, trial, node))
    driver.advance(1.0)
    broken = view("j", NODES)
    n2 = dataclasses.replace(broken.sightings["n2"], attached=7, rank_ids=tuple(range(16, 23)))
    sightings = {**broken.sightings, "n2": n2}
    missing = "ranks 23 (23 of 24 attached)"
    driver.feed(
        tuning.Seen(
            driver.now,
            dataclasses.replace(broken, sightings=sightings, attached=23, missing=missing),
        )
    )
    stalled = nodes.report(driver.now, trial, "n2")
    driver.feed(tuning.Report(driver.now, {**stalled.message, "stalled": True, "windows": []}))
    for _ in range(60):  # past the trial's deadline: it ends unmeasured
        driver.advance(1.0)
    assert driver.published == [trial], [p.settings for p in driver.published]
    assert any("not rolling back" in line for line in driver.said), driver.said
    driver.feed(tuning.Seen(driver.now, empty_view("j")))
    driver.run_until_done()
    assert driver.published == [trial]
    assert Journal(tmp_path / "j.jsonl").load().ended is not None

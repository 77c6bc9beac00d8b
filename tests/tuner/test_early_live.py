"""Search trials stopped early by the coordinator, through the job's machine as the coordinator
drives it: acks, a partial report from every node after each window, final reports at the
plan's end. A clearly worse trial ends after its third window with the tuner told its
windows' mean and standard error; a close one runs its whole length; confirmations and the
baseline are never cut; energy trials are judged on their energy windows; a restarted
coordinator judges against the incumbent's windows from the journal."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from tuner.driver import Driver, begin, coordinator_section

from hyperagent.tuner import tuning
from hyperagent.tuner.early import told
from hyperagent.tuner.journal import Journal
from hyperagent.tuner.metrics import job_readings

NODES = ("n0", "n1")
FULL = 8
"""Windows a trial measures when nothing stops it (the plan's cap)."""
SPREAD = (-0.03, 0.02, -0.01, 0.03, -0.02, 0.01, 0.0, -0.005)
"""Each window's deviation from the settings' value (3% spread, deterministic)."""
JOULES_PER_S = 200.0
"""A node's GPU power: constant, so samples per joule follow the throughput."""


def windows_of(value: float, count: int) -> list[float]:
    return [value * (1 + SPREAD[w % len(SPREAD)]) for w in range(count)]


class Agents:
    """Two nodes that measure a trial window by window: a partial report after each window
    (as ``TrialMeasurement.so_far`` gives it), the final report after ``FULL``, each node's
    window throughput ``value(settings) / 2`` with the spread above; with ``energy_windows``,
    the samples and joules of each window too."""

    def __init__(self, value: Callable[[Mapping[str, Any]], float], energy_windows: bool) -> None:
        self.value = value
        self.energy_windows = energy_windows
        self.windows_sent: dict[int, int] = {}
        """version -> windows the nodes measured before the coordinator moved on."""
        self.window_s = 1.25
        self.told: list[tuple[dict[str, Any], float, float | None]] = []
        """What the coordinator told the tuner: (settings, score, noise)."""

    def listen(self, tuner: Any) -> None:
        """Record what the coordinator tells ``tuner``, which still learns it."""
        if getattr(tuner, "listened", False):
            return
        tell = tuner.tell

        def recorded(settings: Any, score: float, noise: float | None = None) -> None:
            self.told.append((dict(settings), score, noise))
            tell(settings, score, noise=noise)

        tuner.tell = recorded
        tuner.listened = True

    def message(self, publish: tuning.Publish, node: str, count: int, partial: bool) -> Any:
        per_node = self.value(publish.settings) / len(NODES)
        windows = windows_of(per_node, count)
        samples = [w * self.window_s for w in windows]
        joules = [JOULES_PER_S * self.window_s for _ in windows]
        message: dict[str, Any] = {
            "job": "j",
            "node": node,
            "version": publish.version,
            "trial": publish.trial,
            "samples": sum(samples),
            "seconds": count * self.window_s,
            "throughput": statistics.median(windows) if not partial else statistics.fmean(windows),
            "windows": windows,
            "steps": 10 * count,
            "energy_j": None if partial else sum(joules),
            "nonfinite_loss": False,
            "xid_errors": 0.0,
            "partial": partial,
            "stalled": False,
        }
        if self.energy_windows:
            message["window_samples"] = samples
            message["energy_windows"] = joules
        return message

    def measure(self, driver: Driver, publish: tuning.Publish) -> None:
        """Ack ``publish`` and measure it until its plan's end or until the coordinator ends
        the trial (its run moves on to another version)."""
        for node in NODES:
            ack = {"job": "j", "node": node, "version": publish.version, "ok": True,
                   "error": None, "applied": {}, "stalled": False}  # fmt: skip
            driver.feed(tuning.Ack(driver.now, ack))
        for count in range(1, FULL + 1):
            driver.now += self.window_s
            for node in NODES:
                if not self.in_play(driver, publish):
                    return
                final = count == FULL
                message = self.message(publish, node, count, partial=not final)
                driver.feed(tuning.Report(driver.now, message))
                self.windows_sent[publish.version] = count

    @staticmethod
    def in_play(driver: Driver, publish: tuning.Publish) -> bool:
        run = driver.machine.run
        return run is not None and run.version == publish.version


def tune(
    path: Path,
    value: Callable[[Mapping[str, Any]], float],
    proposals: list[dict[str, Any]],
    energy_windows: bool = False,
    driver: Driver | None = None,
    **config: Any,
) -> tuple[Driver, Agents]:
    """Run the job's tuning with the tuner proposing ``proposals`` in turn (then the start),
    the agents measuring each trial as above, until it is done."""
    section = coordinator_section(**{"trials": 3, "patience": 3, **config})
    if driver is None:
        driver = begin("j", NODES, path, section)
    agents = Agents(value, energy_windows)
    queue = list(proposals)
    machine = driver.machine
    tuner, start = machine.tuner, machine.start
    assert tuner is not None and start is not None
    tuner.ask = lambda: dict(queue.pop(0) if queue else start)  # type: ignore[method-assign]
    agents.listen(tuner)
    done = 0
    for _ in range(200):
        if machine.done:
            break
        pending = [p for p in driver.published if p.plan is not None]
        if len(pending) > done:
            done = len(pending)
            agents.measure(driver, pending[-1])
        else:
            driver.advance(1.0)
    assert driver.machine.done
    return driver, agents


def start_settings(path: Path, **config: Any) -> dict[str, Any]:
    section = coordinator_section(trials=1, **config)
    driver = begin("j", NODES, path, section)
    assert driver.machine.start is not None
    return dict(driver.machine.start)


def test_a_clearly_worse_trial_ends_after_its_third_window_and_the_tuner_is_told_its_windows(
    tmp_path: Path,
) -> None:
    start = start_settings(tmp_path / "probe.jsonl")
    worse = {**start, "bucket_mb": start["bucket_mb"] * 2}
    driver, agents = tune(
        tmp_path / "j.jsonl",
        lambda s: 800.0 if s == worse else 1000.0,
        [worse],
        confirm_best=False,
    )
    machine = driver.machine
    baseline, cut, again = machine.trials
    assert baseline.status == "ok" and agents.windows_sent[baseline.version] == FULL
    assert cut.settings == worse
    assert (cut.status, cut.verdict) == ("stopped_early", "worse")
    assert agents.windows_sent[cut.version] == 3  # the minimum, then judged: stopped
    assert again.status == "ok"
    job = windows_of(800.0, 3)
    mean, error = told(job)
    assert error is not None
    assert cut.score == pytest.approx(mean) and cut.noise == pytest.approx(error)
    assert (worse, pytest.approx(mean), pytest.approx(error)) in agents.told
    assert cut.seconds < baseline.seconds
    entries = Journal(tmp_path / "j.jsonl").load().trials
    journalled = next(e for e in entries if e["index"] == cut.index)
    assert journalled["status"] == "stopped_early" and journalled["verdict"] == "worse"
    assert journalled["noise"] == pytest.approx(error)
    assert any("stopped after 3 windows: worse than trial 0" in line for line in driver.said)
    readings = {
        (r.name, r.labels.get("verdict"), r.labels.get("status")): r.value
        for r in job_readings(machine)
    }
    assert readings[("hyperagent_tuner_trials_stopped_early_total", "worse", None)] == 1
    assert readings[("hyperagent_tuner_trials_stopped_early_total", "better", None)] == 0
    assert readings[("hyperagent_tuner_trials_total", None, "stopped_early")] == 1


def test_early_stop_off_measures_every_trial_in_full(tmp_path: Path) -> None:
    start = start_settings(tmp_path / "probe.jsonl")
    worse = {**start, "bucket_mb": start["bucket_mb"] * 2}
    driver, agents = tune(
        tmp_path / "j.jsonl",
        lambda s: 800.0 if s == worse else 1000.0,
        [worse],
        confirm_best=False,
        early_stop=False,
    )
    assert [t.status for t in driver.machine.trials] == ["ok"] * 3
    assert all(agents.windows_sent[t.version] == FULL for t in driver.machine.trials)


def test_a_close_trial_runs_its_full_length_while_a_worse_one_is_cut(tmp_path: Path) -> None:
    start = start_settings(tmp_path / "probe.jsonl")
    close = {**start, "bucket_mb": start["bucket_mb"] * 2}
    worse = {**start, "bucket_mb": start["bucket_mb"] * 4}
    value = {str(close): 1010.0, str(worse): 850.0}
    driver, agents = tune(
        tmp_path / "j.jsonl",
        lambda s: value.get(str(s), 1000.0),
        [close, worse],
        confirm_best=False,
    )
    _, near, cut = driver.machine.trials
    assert near.settings == close and near.status == "ok" and near.verdict is None
    assert agents.windows_sent[near.version] == FULL
    assert (cut.status, cut.verdict) == ("stopped_early", "worse")
    assert agents.windows_sent[cut.version] < FULL


def test_a_clearly_better_trial_stops_and_becomes_the_incumbent(tmp_path: Path) -> None:
    start = start_settings(tmp_path / "probe.jsonl")
    better = {**start, "bucket_mb": start["bucket_mb"] * 2}
    worse_than_better = {**start, "bucket_mb": start["bucket_mb"] * 4}
    value = {str(better): 1300.0, str(worse_than_better): 1100.0}
    driver, agents = tune(
        tmp_path / "j.jsonl",
        lambda s: value.get(str(s), 1000.0),
        [better, worse_than_better],
        confirm_best=False,
    )
    _, up, down = driver.machine.trials
    assert (up.status, up.verdict) == ("stopped_early", "better")
    assert agents.windows_sent[up.version] == 3
    # 1100 is better than the start but worse than the incumbent (the stopped 1300)
    assert (down.status, down.verdict) == ("stopped_early", "worse")
    assert driver.machine.best is not None and driver.machine.best[0] == better


def test_confirmations_and_the_baseline_are_never_stopped_early(tmp_path: Path) -> None:
    """The start measured in full; a search trial worse than the best is cut; after the search
    the start and the best are measured again interleaved, each in full, though the start is
    as clearly worse than the best as the cut trial was."""
    start = start_settings(tmp_path / "probe.jsonl")
    better = {**start, "bucket_mb": start["bucket_mb"] * 2}
    worse = {**start, "bucket_mb": start["bucket_mb"] * 4}
    value = {str(better): 1300.0, str(worse): 1000.0}
    driver, agents = tune(
        tmp_path / "j.jsonl",
        lambda s: value.get(str(s), 1000.0),
        [better, worse],
    )
    machine = driver.machine
    assert agents.windows_sent[machine.trials[0].version] == FULL
    assert [(t.status, t.verdict) for t in machine.trials[1:]] == [
        ("stopped_early", "better"),
        ("stopped_early", "worse"),
    ]
    assert len(machine.confirmations) == 4
    assert [c.settings for c in machine.confirmations] == [start, better, better, start]
    assert all(c.status == "ok" for c in machine.confirmations)
    assert all(agents.windows_sent[c.version] == FULL for c in machine.confirmations)
    assert machine.confirmed is not None and machine.confirmed.better


def test_energy_trials_with_energy_windows_get_a_standard_error_and_stop_both_ways(
    tmp_path: Path,
) -> None:
    """The same energy tuning, with agents that report energy per window and with agents that
    report one energy reading per trial (older ones): the first are told a standard error and
    cut a clearly better trial after three windows; the second have nothing to judge a trial
    on, so every trial runs in full and is told without an error."""
    start = start_settings(tmp_path / "probe.jsonl", objective="energy")
    better = {**start, "bucket_mb": start["bucket_mb"] * 2}
    runs = {}
    for windowed in (True, False):
        runs[windowed] = tune(
            tmp_path / f"j-{windowed}.jsonl",
            lambda s: 1300.0 if s == better else 1000.0,
            [better],
            energy_windows=windowed,
            objective="energy",
            confirm_best=False,
        )
    driver, agents = runs[True]
    baseline, up, _ = driver.machine.trials
    per_window = [w * 1.25 / (JOULES_PER_S * 1.25 * len(NODES)) for w in windows_of(1000.0, FULL)]
    assert baseline.status == "ok"
    assert baseline.noise == pytest.approx(statistics.stdev(per_window) / math.sqrt(FULL))
    assert (up.status, up.verdict) == ("stopped_early", "better")
    assert agents.windows_sent[up.version] == 3
    mean, error = told([w * 1.3 for w in per_window[:3]])
    assert (better, pytest.approx(mean), pytest.approx(error)) in agents.told
    entry = next(e for e in Journal(tmp_path / "j-True.jsonl").load().trials if e["index"] == 0)
    assert all(len(r["energy_windows"]) == FULL for r in entry["reports"].values())

    old, old_agents = runs[False]
    assert [t.status for t in old.machine.trials] == ["ok"] * 3
    assert all(t.noise is None for t in old.machine.trials)
    assert all(old_agents.windows_sent[t.version] == FULL for t in old.machine.trials)


def test_a_restarted_coordinator_judges_against_the_incumbents_windows_from_the_journal(
    tmp_path: Path,
) -> None:
    """The coordinator is killed two windows into trial 1 (after the baseline was journalled);
    the new one resumes the round from the journal, runs trial 1 again and stops it after its
    third window, judged against the baseline's windows as the journal kept them."""
    start = start_settings(tmp_path / "probe.jsonl")
    worse = {**start, "bucket_mb": start["bucket_mb"] * 2}
    path = tmp_path / "j.jsonl"
    section = coordinator_section(trials=3, patience=3, confirm_best=False)
    first = begin("j", NODES, path, section)
    assert first.machine.tuner is not None
    first.machine.tuner.ask = lambda: dict(worse)  # type: ignore[method-assign]
    agents = Agents(lambda s: 800.0 if s == worse else 1000.0, energy_windows=False)
    agents.measure(first, first.published[-1])  # the baseline, in full
    trial_1 = first.published[-1]
    assert first.machine.trials[0].status == "ok" and trial_1.settings == worse
    for node in NODES:
        ack = {"job": "j", "node": node, "version": trial_1.version, "ok": True,
               "error": None, "applied": {}, "stalled": False}  # fmt: skip
        first.feed(tuning.Ack(first.now, ack))
    for node in NODES:
        first.feed(tuning.Report(first.now, agents.message(trial_1, node, 2, partial=True)))
    assert first.machine.run is not None  # two windows: not judged yet; then the kill

    driver = begin("j", NODES, path, section)
    driver.now = first.now
    driver.feed(tuning.VersionSeen(trial_1.version))
    incumbent = driver.machine.incumbent
    assert incumbent is not None and incumbent.index == 0
    assert all(len(r["windows"]) == FULL for r in incumbent.reports.values())
    driver, agents = tune(path, agents.value, [], driver=driver, confirm_best=False)
    again = driver.machine.trials[1]
    assert again.settings == worse
    assert (again.status, again.verdict) == ("stopped_early", "worse")
    assert agents.windows_sent[again.version] == 3

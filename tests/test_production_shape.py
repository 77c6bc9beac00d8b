"""The closed loop in production shape (tests/production/scenario.py): real daemons over a real
mosquitto, 8 ranks per node each on its own JobReporter connection, 10 s and 50 ms steps, two
jobs on disjoint nodes of one cluster with the drift watch on, and the faults production
brings: a driver that hangs, NVML errors that refuse every version, most of a job's nodes
stalling mid-trial, an agent killed mid-trial. What is asserted is what a user notices: the
tunings end, a healthy job is never re-tuned, a paused job says why and resumes, /metrics
says when a reading is stale, and no trial of the budget is spent on a fault.

Metric names live at the top of tests/production/scenario.py.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from production.scenario import (
    HANG,
    JOB_RANKS,
    JOBS,
    NO_DRIFT_WATCH_S,
    RANKS_PER_NODE,
    REFUSE,
    SOURCE_LAST_SUCCESS,
    SOURCE_UP,
    Scenario,
    scenario,
    until,
)

from conftest import BUSY

pytestmark = [
    pytest.mark.peer,
    pytest.mark.timeout(240),
    pytest.mark.long(40),
    BUSY,
]

TUNED_S = 90.0
"""A tuning of this shape ends within about 20 s on two busy cores; this bounds a slow run."""
STALL_S = 12.0
"""How long two of alpha's three nodes stop stepping (the stall check needs 2 s)."""
HANG_S = 12.0
"""How long a node's NVML calls hang."""


def both_tuned(s: Scenario) -> None:
    for job in JOBS:
        until(lambda job=job: s.tuned(job.id), TUNED_S, f"{job.id}'s tuning to end")


def observe(s: Scenario, job: str, seconds: float) -> tuple[dict[str, float], list[str]]:
    """What the coordinator says about ``job`` over ``seconds``: every pause reason seen on
    its /metrics, and its status lines (sd_notify)."""
    began, reasons = time.time(), {}
    while time.time() < began + seconds:
        reasons |= s.paused(job)
        time.sleep(0.5)
    return reasons, s.status_since(began)


def source(s: Scenario, node: str, name: str, metric: str) -> float | None:
    return next((v for labels, v in s.metric(node, metric) if labels.get("source") == name), None)


def test_a_healthy_cluster_is_tuned_once_and_never_retuned(tmp_path: Path) -> None:
    with scenario(tmp_path) as s:
        both_tuned(s)
        for job in JOBS:
            for node in job.nodes:
                ranks = [v for labels, v in s.metric(node, JOB_RANKS) if labels["job_id"] == job.id]
                assert ranks == [RANKS_PER_NODE], (node, ranks)
            assert not s.lost_trials(job.id), s.trials(job.id)
        time.sleep(NO_DRIFT_WATCH_S)  # the drift watch has looked twice; nothing changed
        retunes = {job.id: s.retunes(job.id) for job in JOBS}
        drift = [line for line in s.log("coordinator").splitlines() if "re-tuning" in line]
        assert retunes == {job.id: 0 for job in JOBS}, drift


def test_most_nodes_stalling_mid_trial_pause_the_tuning_until_they_step_again(
    tmp_path: Path,
) -> None:
    alpha = JOBS[0]
    stalled = alpha.nodes[:2]
    with scenario(tmp_path) as s:
        until(lambda: s.in_trial(alpha.id, 1), TUNED_S, "alpha in its second trial or a later one")
        time.sleep(0.5)  # the nodes acked; the trial is being measured
        for node in stalled:
            s.stall(node)
        reasons, status = observe(s, alpha.id, STALL_S)
        for node in stalled:
            s.resume(node)
        until(lambda: s.tuned(alpha.id), TUNED_S, "alpha's tuning to end after its jobs stepped")
        assert reasons, "the coordinator's /metrics never said alpha was paused"
        assert any("paused" in line and alpha.id in line for line in status), status
        assert not s.paused(alpha.id)
        assert not s.lost_trials(alpha.id), s.trials(alpha.id)
        assert s.tuned("beta") and not s.lost_trials("beta")


def test_a_node_refusing_every_version_pauses_its_job_alone(tmp_path: Path) -> None:
    with scenario(tmp_path, faults={"n3": REFUSE}) as s:
        began = time.time()
        until(lambda: s.tuned("alpha"), TUNED_S, "the healthy job's tuning to end")
        reasons: dict[str, float] = {}
        deadline = began + TUNED_S
        while not s.tuned("beta") and time.time() < deadline and len(reasons) == 0:
            reasons |= s.paused("beta")
            time.sleep(0.5)
        status = s.status_since(began)
        s.inject("n3", {})
        until(lambda: s.tuned("beta"), TUNED_S, "beta's tuning to end once n3 applies caps")
        refused = [t for t in s.trials("beta") if t["status"] == "refused"]
        assert not refused, f"refusals were recorded as trials: {refused}"
        assert reasons, "the coordinator's /metrics never said beta was paused"
        assert any("paused" in line and "beta" in line for line in status), status
        assert not s.lost_trials("beta"), s.trials("beta")
        assert not s.paused("beta")
        assert not s.lost_trials("alpha") and s.retunes("alpha") == 0


def test_a_hung_driver_is_visible_and_costs_no_trial_nor_does_an_agent_restart(
    tmp_path: Path,
) -> None:
    node = "n1"
    with scenario(tmp_path) as s:
        until(lambda: s.in_trial("alpha", 1), TUNED_S, "alpha in its second trial or a later one")
        time.sleep(0.5)
        s.restart_agent("n2", signal.SIGKILL)
        until(
            lambda: s.in_trial("alpha", 2) or s.tuned("alpha"),
            TUNED_S,
            "alpha in its third trial or a later one, or tuned",
        )
        hung_at = time.time()
        s.inject(node, HANG)
        seen: list[dict[str, Any]] = []
        while time.time() < hung_at + HANG_S:
            seen.append(
                {
                    "at": round(time.time() - hung_at, 1),
                    "nvml_up": source(s, node, "nvml", SOURCE_UP),
                    "nvml_success": source(s, node, "nvml", SOURCE_LAST_SUCCESS),
                    "job_success": source(s, node, "job", SOURCE_LAST_SUCCESS),
                }
            )
            time.sleep(0.5)
        s.inject(node, {})
        cleared_at = time.time()
        until(
            lambda: (source(s, node, "nvml", SOURCE_LAST_SUCCESS) or 0) > cleared_at,
            30,
            "NVML read again once it answers",
        )
        until(lambda: s.tuned("alpha"), TUNED_S, "alpha's tuning to end")
        # from 5 s into the hang: /metrics still updates, and says NVML is stale
        late = [x for x in seen if x["at"] >= 5.0]
        assert late, seen
        for x in late:
            assert x["nvml_up"] == 0, seen
            assert x["nvml_success"] is not None and x["nvml_success"] < hung_at + 1.5, seen
            assert x["job_success"] is not None and x["job_success"] > hung_at + x["at"] - 3, seen
        assert not s.lost_trials("alpha"), s.trials("alpha")
        assert s.tuned("beta") and not s.lost_trials("beta")

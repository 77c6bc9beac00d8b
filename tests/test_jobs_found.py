"""Jobs a scheduler starts are found, tuned and released by a coordinator with no job list:
real mosquitto, one ``hyperagent coordinator``, four agents over an 8-GPU fake NVML, 8 ranks
per node (one JobReporter connection each), each job's ranks run as their own Unix user.

What the "scheduler" does, in order, with no config edit and no restart:

- ``alpha`` (alice) on n0 (8 GPUs) and n1 (GPUs 0-3): 2 nodes, 12 ranks;
- ``slurm-7-0`` (carol, its ranks take the id from ``SLURM_JOB_ID``) on n2 and n3, ended
  while one of its trials is running;
- once it is released, ``beta`` (bob) on n1 (GPUs 4-7), n2 and n3: 3 nodes, 20 ranks,
  sharing n1 with alpha.

Every job searches the power cap (energy objective), so the sharing jobs' caps would show on
each other's GPUs if a cap landed on a node's every GPU.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from production.scenario import GPU_POWER_LIMIT, JOB_RANKS, JobShape, Scenario, scenario, until

from conftest import BUSY, system_user

pytestmark = [
    pytest.mark.peer,
    pytest.mark.timeout(300),
    pytest.mark.long(90),
    BUSY,
    pytest.mark.usefixtures("root_only"),
]

USERS = ("ha-alice", "ha-bob", "ha-carol")
STEP = {"step_s": 10.0, "wall_step_s": 0.1}
ALPHA = JobShape("alpha", ("n0", "n1"), trials=4, slots=((0, 8), (0, 4)), user=USERS[0], **STEP)
ENDING = JobShape("slurm-7-0", ("n2", "n3"), trials=4, user=USERS[2], scheduler_id="7", **STEP)
BETA = JobShape(
    "beta", ("n1", "n2", "n3"), trials=4, slots=((4, 4), (0, 8), (0, 8)), user=USERS[1], **STEP
)
POLICY = {
    "tune": "all",
    "users": USERS,
    "objective": "energy",
    "trials": 4,
    "patience": 4,
    "ack_timeout_s": 5,
    "trial_timeout_s": 20,
    "end_after_s": 2,
    "release_after_s": 3,
    "drift_sustained_s": 30,
    "plan": {
        "settle_steps": 3,
        "settle_s": 20.0,
        "measure_steps": 8,
        "measure_s": 80.0,
        "windows": 2,
        "max_windows": 2,
    },
}
TUNED_S = 150.0
TUNER_NODES = "hyperagent_tuner_nodes"


@pytest.fixture
def cluster() -> Iterator[Scenario]:
    for user in USERS:
        system_user(user)
    root = Path(tempfile.mkdtemp(prefix="hyperagent-jobs-"))
    root.chmod(0o755)  # the ranks' users reach the agents' sockets and write their logs
    (root / "logs").mkdir(mode=0o777)
    (root / "logs").chmod(0o1777)
    try:
        with scenario(
            root,
            jobs=(ALPHA, ENDING, BETA),
            policy=POLICY,
            start_jobs=False,
            agent_users=USERS,
            job_release_after_s=3.0,
        ) as s:
            yield s
    finally:
        shutil.rmtree(root, ignore_errors=True)


def final(s: Scenario, job: str) -> dict | None:
    return next((e for e in s.journal(job) if e.get("type") == "final"), None)


def verdict(s: Scenario, job: str) -> str:
    """How the job's tuning ended, in the words of its status line."""
    entry = final(s, job)
    assert entry is not None and "better" in entry, s.journal(job)
    return "confirmed" if entry["better"] else "no setting was better"


def tuned_here(s: Scenario, job: str) -> bool:
    """The coordinator holds a tuning of ``job`` (its series are on /metrics)."""
    return any(labels.get("job_id") == job for labels, _ in s.metric("coordinator", TUNER_NODES))


def limits(s: Scenario, node: str) -> dict[int, float]:
    """GPU index -> power limit (W), from the node agent's /metrics."""
    return {int(labels["gpu"]): v for labels, v in s.metric(node, GPU_POWER_LIMIT)}


def caps_published(s: Scenario, job: str) -> set[float]:
    return {
        float(e["settings"]["power_cap_w"])
        for e in s.journal(job)
        if e.get("type") in ("published", "final") and e.get("settings", {}).get("power_cap_w")
    }


def test_jobs_a_scheduler_starts_are_found_tuned_and_released(cluster: Scenario) -> None:
    s = cluster
    s.start_job(ALPHA)
    time.sleep(3)
    s.start_job(ENDING)
    until(lambda: s.in_trial(ENDING.id, 1), 60, f"{ENDING.id} in trial 1 or a later one")
    s.stop_job(ENDING)
    until(lambda: not tuned_here(s, ENDING.id), 30, f"{ENDING.id} to be released")
    ended = s.journal(ENDING.id)
    assert ended[-1]["type"] == "ended", ended[-3:]
    trials_when_ended = len(s.trials(ENDING.id))
    for node in ENDING.nodes:
        until(
            lambda node=node: (
                not any(
                    labels.get("job_id") == ENDING.id for labels, _ in s.metric(node, JOB_RANKS)
                )
            ),
            20,
            f"{node}'s series of {ENDING.id} to go",
        )

    s.start_job(BETA)
    seen: dict[str, set[float]] = {"alpha": set(), "beta": set()}
    differed = False
    deadline = time.monotonic() + TUNED_S
    while not (final(s, ALPHA.id) and final(s, BETA.id) and s.tuned(ALPHA.id) and s.tuned(BETA.id)):
        assert time.monotonic() < deadline, (s.journal(ALPHA.id)[-3:], s.journal(BETA.id)[-3:])
        shared = limits(s, "n1")
        if len(shared) == 8:
            halves = ({shared[g] for g in range(4)}, {shared[g] for g in range(4, 8)})
            seen["alpha"] |= halves[0]
            seen["beta"] |= halves[1]
            differed |= halves[0] != halves[1]
        time.sleep(0.5)

    for job in (ALPHA, BETA):
        assert verdict(s, job.id) in ("confirmed", "no setting was better")
        budget = [t["index"] for t in s.trials(job.id) if not t.get("confirmation")]
        assert budget == list(range(job.trials)), s.trials(job.id)
        nodes = [
            v for labels, v in s.metric("coordinator", TUNER_NODES) if labels["job_id"] == job.id
        ]
        assert nodes == [len(job.nodes)], nodes
        for node in job.nodes:
            ranks = [v for labels, v in s.metric(node, JOB_RANKS) if labels["job_id"] == job.id]
            assert ranks == [job.slot(node)[1]], (node, job.id, ranks)
    # the shared node's two halves took their own job's caps only, and differed at times
    assert seen["alpha"] <= caps_published(s, ALPHA.id) | {250.0}, seen
    assert seen["beta"] <= caps_published(s, BETA.id) | {250.0}, seen
    assert differed, seen
    for job in (ALPHA, ENDING, BETA):
        assert re.search(rf"{job.id}: found on .* user {job.user}\)", s.log("coordinator")), job
    until(lambda: len(limits(s, "n1")) == 8, 10, "n1's limits")
    shared = limits(s, "n1")
    assert {shared[g] for g in range(4)} == {final(s, ALPHA.id)["settings"]["power_cap_w"]}
    assert {shared[g] for g in range(4, 8)} == {final(s, BETA.id)["settings"]["power_cap_w"]}
    # the ended job stayed ended: nothing more was tried or published for it
    assert len(s.trials(ENDING.id)) == trials_when_ended
    assert s.journal(ENDING.id)[-1]["type"] == "ended"
    # no config edit, no restart: one coordinator process all along
    assert s.processes["coordinator"].poll() is None

"""A shared cluster's hostile users, each on their own Unix account (issue 44, Why 1-6 and 8):
real mosquitto, one ``hyperagent coordinator`` with no job list, agents over an 8-GPU fake NVML
that takes power caps, every rank a JobReporter process run as its user (tests/production/).
alice's and bob's jobs are what a user runs; mallory says what she likes on the job socket
under alice's ids; eve is a user the coordinator's policy leaves out. What is asserted is what
alice would notice: the coordinator's log and journals, the agents' /metrics (every GPU's
power limit, sampled through the run), what her ranks and mallory's took.

Two clusters, one per class (a class's tests share its cluster and read it in turn):

- ``TestOneOwnerPerJob``: mallory's and eve's ranks on n0 under the ids of alice's jobs on n1
  and n2, started before alice's: a squat (1), a veto (2), a forced tuning (3, under
  ``tune = "asked"``), eve joining (4), an inflated world size (5); then every job on n2 ends
  and is released, and n2's GPUs stay at their default limit across a coordinator restart
  and its re-announce (6).
- ``TestSharedNodes``: mallory's CPU-only job asking to be tuned on n0, where alice's and bob's
  processes hold GPUs 0-3 and 4-7 (6); alice's job on n1 (NVML shows her ranks on GPUs 0-3)
  and n2 (a recording in which bob's GPU 7 raises an XID every 2 s), joined mid-tuning on n1
  by a rank of mallory's declaring GPU 0 and an idle CPU-only rank of eve's (8).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from production.scenario import (
    CAPTURE,
    JOB_RANKS,
    MEASURED,
    JobShape,
    LimitWatch,
    Scenario,
    scenario,
    until,
)

from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.readings import Kind, Reading
from hyperagent.replay import RECORDING_FILE, Recorder
from hyperagent.sources.nvml import NvmlSource

from conftest import BUSY, system_user, unavailable

pytestmark = [
    pytest.mark.peer,
    pytest.mark.tenants,
    pytest.mark.timeout(300),
    pytest.mark.long(200),
    BUSY,
]

USERS = ("ha-alice", "ha-bob", "ha-mallory", "ha-eve")
ALICE, BOB, MALLORY, EVE = USERS
STEP: dict[str, Any] = {"step_s": 10.0, "wall_step_s": 0.1, "trials": 4}
DEFAULT_W = 250.0
"""Every GPU's power limit in the capture, and after a job's cap is taken off."""
POLICY = {
    "tune": "all",
    "users": (ALICE, BOB, MALLORY),
    "objective": "energy",
    "power_limits_w": (150, 200),
    "trials": 4,
    "patience": 4,
    "ack_timeout_s": 5,
    "trial_timeout_s": 20,
    "end_after_s": 2,
    "release_after_s": 3,
    "ranks_wait_s": 5,
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
"""Every cap a tuning publishes is 150-200 W: a GPU at another limit than 250 W is capped."""
TUNED_S = 180.0
ANNOUNCE_S = 30.0
"""The coordinator says "online" again this often (``hyperagent.coordinator.ANNOUNCE_S``)."""
XID_ERRORS = "hyperagent_gpu_xid_errors_total"


def make_root() -> Path:
    """A cluster's folder, with the users created: the ranks' users reach the agents' sockets
    and write their logs."""
    for user in USERS:
        system_user(user)
    root = Path(tempfile.mkdtemp(prefix="hyperagent-tenants-"))
    root.chmod(0o755)
    (root / "logs").mkdir(mode=0o777)
    (root / "logs").chmod(0o1777)
    return root


@contextlib.contextmanager
def cluster(root: Path, jobs: tuple[JobShape, ...], **shape: Any) -> Iterator[Scenario]:
    """The cluster of ``jobs`` under ``root`` (none of their ranks started), removed after."""
    if os.geteuid() != 0:
        unavailable("needs root (runs ranks as other users)")
    try:
        with scenario(
            root,
            jobs=jobs,
            policy=POLICY,
            start_jobs=False,
            agent_users=USERS,
            job_release_after_s=3.0,
            **shape,
        ) as s:
            yield s
    finally:
        shutil.rmtree(root, ignore_errors=True)


def coordinator_says(s: Scenario, job: str, what: str) -> list[str]:
    """What the coordinator's log says of ``job`` after ``<job>: <what>`` (its own lines, not
    those of a job whose id ends with ``job``'s)."""
    pattern = re.compile(rf"(?<![\w-]){re.escape(job)}: {what}(.*?)\"?$")
    return [m.group(1) for line in s.log("coordinator").splitlines() if (m := pattern.search(line))]


def found(s: Scenario, job: str) -> list[str]:
    """Each "found on ..." the coordinator logged for ``job``: its nodes, ranks and user, or why
    it is not tuned."""
    return coordinator_says(s, job, "found on ")


def admitted(s: Scenario, job: str) -> list[str]:
    """Each "found on <nodes> (<n> of <world> ranks, user <user>)" of ``job``: tuned from then."""
    return [line for line in found(s, job) if ", not tuned: " not in line]


def not_tuned(s: Scenario, job: str) -> str | None:
    """Why the coordinator said it does not tune ``job`` (the latest), None if it never did
    (but for a user's name not looked up yet: it decides again once it is)."""
    said = [
        line.split(", not tuned: ", 1)[1]
        for line in found(s, job)
        if ", not tuned: " in line and "is not known yet" not in line
    ]
    return said[-1] if said else None


def over(s: Scenario, job: str) -> bool:
    """The job's tuning ended: its best settings published, or the job ended or failed."""
    return s.tuned(job) or any(e.get("type") == "ended" for e in s.journal(job))


def settled(s: Scenario, job: str) -> bool:
    """The job's tuning ended, or the coordinator said it does not tune it or waits for it."""
    return over(s, job) or bool(not_tuned(s, job) or coordinator_says(s, job, "waiting for "))


def journal_tail(s: Scenario, job: str, n: int = 6) -> list[dict[str, Any]]:
    return s.journal(job)[-n:]


def attached(s: Scenario, node: str, jobs: tuple[JobShape, ...]) -> bool:
    """Every one of ``jobs`` has its ranks on ``node`` attached, by the node's /metrics."""
    ranks = {labels.get("job_id"): v for labels, v in s.metric(node, JOB_RANKS)}
    return all(ranks.get(job.id, 0) >= job.slot(node)[1] for job in jobs)


# -- one owner per job -------------------------------------------------------------------

SQUATTED = JobShape("alpha", ("n1", "n2"), slots=((0, 2), (0, 2)), user=ALICE, **STEP)
SQUAT = JobShape("alpha", ("n0",), slots=((0, 1),), user=MALLORY, claimed_world_size=4, **STEP)
"""(1) mallory's rank 0 of alice's world of 4 under alice's id, on a node of none of hers."""
VETOED = JobShape("beta", ("n1",), slots=((2, 2),), user=ALICE, **STEP)
VETO = JobShape("beta", ("n0",), slots=((1, 1),), user=MALLORY, tune=False, **STEP)
"""(2) mallory's rank under alice's id asking not to be tuned."""
UNASKED = JobShape("gamma", ("n1",), slots=((4, 2),), user=ALICE, **STEP)
FORCE = JobShape("gamma", ("n0",), slots=((2, 1),), user=MALLORY, tune=True, **STEP)
"""(3) mallory's rank under the id of alice's job that never asks, asking to be tuned."""
JOINED = JobShape("delta", ("n2",), slots=((2, 2),), user=ALICE, **STEP)
JOINS = JobShape(
    "delta",
    ("n0",),
    slots=((3, 1),),
    user=EVE,
    claimed_world_size=2,
    claimed_first_rank=1,
    **STEP,
)
"""(4) eve, whom the policy's users leave out, as rank 1 of alice's job."""
INFLATED = JobShape("epsilon", ("n2",), slots=((4, 2),), user=ALICE, **STEP)
INFLATES = JobShape(
    "epsilon",
    ("n0",),
    slots=((4, 1),),
    user=MALLORY,
    claimed_world_size=64,
    claimed_first_rank=63,
    **STEP,
)
"""(5) mallory's rank 63 of a world of 64 under alice's id."""
INTRUDERS = (SQUAT, VETO, FORCE, JOINS, INFLATES)
ALICES = (SQUATTED, VETOED, UNASKED, JOINED, INFLATED)
RULES = ({"id": "*gamma", "tune": "asked"},)
"""Jobs whose id ends with gamma are tuned only when their ranks ask."""


@dataclass
class Run:
    s: Scenario
    limits: LimitWatch
    """Every GPU's power limit on every node, sampled through the run."""
    intruded_at: float = 0.0


@pytest.fixture(scope="class")
def owners() -> Iterator[Run]:
    root = make_root()
    early = tuple(job for job in INTRUDERS if job is not FORCE)
    with cluster(root, jobs=INTRUDERS + ALICES, rules=RULES) as s:
        for job in early:
            s.start_job(job)
        until(lambda: attached(s, "n0", early), 60, "mallory's and eve's ranks on n0")
        watch = LimitWatch(s, s.nodes)
        try:
            for job in ALICES:
                s.start_job(job)
            # mallory asks for the tuning of alice's job once it is found and left untuned
            until(lambda: not_tuned(s, UNASKED.id), 60, f"{UNASKED.id} to be found")
            s.start_job(FORCE)
            yield Run(s, watch)
        finally:
            watch.close()


class TestOneOwnerPerJob:
    def test_a_job_id_squatted_on_another_node_stays_its_owners(self, owners: Run) -> None:
        s, job = owners.s, SQUATTED
        until(lambda: admitted(s, job.id), 60, f"{job.id} to be found")
        first = admitted(s, job.id)[0]
        assert f"user {ALICE})" in first and "n0" not in first, found(s, job.id)
        until(lambda: over(s, job.id), TUNED_S, f"{job.id}'s tuning to end")
        assert s.tuned(job.id), journal_tail(s, job.id)
        start = next(e for e in s.journal(job.id) if e.get("type") == "start")
        assert start["nodes"] == ["n1", "n2"], start
        trials = s.trials(job.id)
        assert [t for t in trials if t["status"] in MEASURED], trials
        for trial in trials:  # its score is its own ranks' measurements
            assert set(trial.get("reports", {})) <= {"n1", "n2"}, trial
        for trial in trials:
            if trial["status"] in MEASURED:
                assert set(trial["reports"]) == {"n1", "n2"}, trial
        # alice's ranks took her settings; mallory's never took any
        assert s.received(job, "n1") and s.received(job, "n2")
        assert s.received(SQUAT, "n0") == []

    def test_another_users_rank_cannot_veto_a_jobs_tuning(self, owners: Run) -> None:
        s, job = owners.s, VETOED
        until(lambda: over(s, job.id) or not_tuned(s, job.id), TUNED_S, f"{job.id}'s tuning to end")
        assert not_tuned(s, job.id) is None, found(s, job.id)
        assert s.tuned(job.id), journal_tail(s, job.id)
        assert all(f"user {ALICE})" in line for line in admitted(s, job.id)), found(s, job.id)
        assert s.received(VETO, "n0") == []

    def test_another_users_rank_cannot_have_a_job_tuned(self, owners: Run) -> None:
        s, job = owners.s, UNASKED
        until(lambda: not_tuned(s, job.id) or s.journal(job.id), 60, f"{job.id} to be found")
        assert not s.journal(job.id), journal_tail(s, job.id)
        assert "did not ask to be tuned" in (not_tuned(s, job.id) or ""), found(s, job.id)
        # mallory's own tuning of her own rank ran its course; alice's GPUs stayed as they were
        until(lambda: over(s, FORCE.id), TUNED_S, f"{FORCE.id}'s tuning to end")
        gpus = range(job.slot("n1")[0], sum(job.slot("n1")))
        assert owners.limits.scrapes("n1") > 20
        assert owners.limits.seen("n1", gpus) == {g: {DEFAULT_W} for g in gpus}
        assert not s.journal(job.id), journal_tail(s, job.id)
        assert s.received(job, "n1") == []

    def test_a_user_outside_the_policy_joining_a_jobs_id_does_not_stop_it(
        self, owners: Run
    ) -> None:
        s, job = owners.s, JOINED
        until(lambda: over(s, job.id) or not_tuned(s, job.id), TUNED_S, f"{job.id}'s tuning to end")
        assert not_tuned(s, job.id) is None, found(s, job.id)
        assert s.tuned(job.id), journal_tail(s, job.id)
        assert all(f"user {ALICE})" in line for line in admitted(s, job.id)), found(s, job.id)
        # eve's rank is a job of hers, which the policy does not tune
        until(lambda: not_tuned(s, JOINS.id), 30, f"{JOINS.id} to be found")
        assert EVE in (not_tuned(s, JOINS.id) or ""), found(s, JOINS.id)
        assert s.received(JOINS, "n0") == []

    def test_an_inflated_world_size_under_a_jobs_id_does_not_hold_it(self, owners: Run) -> None:
        s, job = owners.s, INFLATED
        until(
            lambda: over(s, job.id) or coordinator_says(s, job.id, "waiting for "),
            TUNED_S,
            f"{job.id}'s tuning to end",
        )
        assert coordinator_says(s, job.id, "waiting for ") == []
        assert s.tuned(job.id), journal_tail(s, job.id)
        assert all(" of 2 ranks, user " in line for line in admitted(s, job.id)), found(s, job.id)
        assert s.received(INFLATES, "n0") == []

    def test_a_released_jobs_caps_are_never_applied_again(self, owners: Run) -> None:
        """Every job on n2 ends and is released: its GPUs go back to 250 W and stay there
        across a coordinator restart (it says "online") and its re-announce 30 s later."""
        s, watch = owners.s, owners.limits
        on_n2 = tuple(job for job in ALICES if "n2" in job.nodes)
        until(
            lambda: over(s, SQUATTED.id) and all(settled(s, job.id) for job in on_n2),
            TUNED_S,
            "n2's tunings to end",
        )
        capped = {g for g, seen in watch.seen("n2").items() if seen - {DEFAULT_W}}
        assert capped, "no cap was ever applied on n2: nothing to check"
        for job in on_n2:
            s.stop_job(job)
        until(lambda: not s.metric("n2", JOB_RANKS), 30, "n2's jobs to be released")
        until(lambda: set(s.limits("n2").values()) == {DEFAULT_W}, 20, "n2's GPUs back at 250 W")
        began = time.time()
        s.restart_coordinator()
        time.sleep(ANNOUNCE_S + 5)
        assert watch.scrapes("n2", since=began) > 30
        assert watch.seen("n2", since=began) == {g: {DEFAULT_W} for g in range(8)}
        again = [
            line
            for line in s.log("agent-n2").splitlines()
            if "again" in line and any(job.id in line for job in on_n2)
        ]
        assert again == [], again


# -- shared nodes ------------------------------------------------------------------------

CPU_ONLY = JobShape("m6", ("n0",), slots=((0, 1),), user=MALLORY, gpus=False, tune=True, **STEP)
"""(6) mallory's own job: one CPU-only rank (no GPU declared) asking to be tuned."""
ALICE8 = JobShape("a8", ("n1", "n2"), slots=((0, 4), (0, 4)), user=ALICE, **STEP)
BOB8 = JobShape("b8", ("n2",), slots=((4, 4),), user=BOB, tune=False, **STEP)
"""bob's job on n2's GPUs 4-7 (not to be tuned), one of which raises XIDs."""
DECLARES = JobShape("m8", ("n1",), slots=((0, 1),), user=MALLORY, tune=False, **STEP)
"""(8) mallory's rank declaring GPU 0, which NVML shows alice's ranks on."""
IDLE = JobShape("e8", ("n1",), slots=((0, 1),), user=EVE, gpus=False, idle=True, **STEP)
"""(8) eve's CPU-only rank: says hello, stays connected, never steps."""
SHARED_RULES = (
    {"id": "*m6", "objective": "throughput", "search_power_cap": True},
    {"id": "*a8", "trials": 8, "patience": 8},
)
"""mallory's CPU-only job searches the power cap (for throughput: it has no energy of its
own to measure); alice's job runs trials long after mallory's and eve's ranks join it."""
XID_GPU = 7


def xid_recording(directory: Path, gpu: int, period_s: float = 2.0) -> Path:
    """A capture directory holding a recording of the 8 x V100S capture's GPUs (as the agent
    reads them) in which GPU ``gpu`` raises XID 79 once every ``period_s`` (the recording
    loops), its energy counters growing at the recorded draw."""

    async def read() -> list[Reading]:
        source = NvmlSource(FakeNvml.from_capture(CAPTURE))
        await source.start()
        try:
            return await source.read()
        finally:
            await source.close()

    readings = asyncio.run(read())
    power = {r.labels["gpu"]: r.value for r in readings if r.name == "hyperagent_gpu_power_watts"}
    uuid = next(r.labels["uuid"] for r in readings if r.labels.get("gpu") == str(gpu))
    directory.mkdir(parents=True, exist_ok=True)
    began = time.time()
    with (directory / RECORDING_FILE).open("wb") as out:
        recorder = Recorder(out, "n2", period_s / 2)
        for step, xids in enumerate((0, 1, 1)):
            at = step * period_s / 2
            frame = [
                Reading(r.name, r.value + power[r.labels["gpu"]] * at, r.labels, r.kind)
                if r.name == "hyperagent_gpu_energy_joules_total"
                else r
                for r in readings
            ]
            labels = {"gpu": str(gpu), "uuid": uuid, "xid": "79"}
            frame.append(Reading(XID_ERRORS, xids, labels, Kind.COUNTER))
            recorder.write(began + at, {"nvml": frame})
    return directory


@pytest.fixture(scope="class")
def shared() -> Iterator[Run]:
    root = make_root()
    holders = {ALICE: f"holder-{ALICE}", BOB: f"holder-{BOB}"}
    on_gpus = {
        "n0": {g: holders[ALICE] if g < 4 else holders[BOB] for g in range(8)},
        "n1": {g: f"ranks-{ALICE8.id}-n1" for g in range(4)},
    }
    with cluster(
        root,
        jobs=(CPU_ONLY, ALICE8, BOB8, DECLARES, IDLE),
        rules=SHARED_RULES,
        captures={"n2": xid_recording(root / "capture-n2", XID_GPU)},
        gpu_processes=on_gpus,
        agents_later=("n0", "n1"),
    ) as s:
        for user, name in holders.items():  # their training processes, not reporting
            s.spawn(name, ["sleep", "3600"], user=user)
        s.start_ranks(ALICE8, "n1")
        s.start_agent("n0")
        s.start_agent("n1")
        s.start_ranks(ALICE8, "n2")
        s.start_job(BOB8)
        s.start_job(CPU_ONLY)
        watch = LimitWatch(s, s.nodes)
        try:
            until(lambda: s.in_trial(ALICE8.id, 1), 90, f"{ALICE8.id} in trial 1 or later")
            s.start_job(DECLARES)
            s.start_job(IDLE)
            until(lambda: attached(s, "n1", (DECLARES, IDLE)), 60, "mallory's and eve's ranks")
            yield Run(s, watch, time.time())
        finally:
            watch.close()


def refusals(s: Scenario, job: str) -> list[dict[str, Any]]:
    """The job's pauses because a node refused its settings."""
    return [e for e in s.journal(job) if e.get("type") == "paused" and e.get("reason") == "refused"]


class TestSharedNodes:
    def test_a_cpu_only_job_caps_no_gpu(self, shared: Run) -> None:
        s, job = shared.s, CPU_ONLY
        until(lambda: over(s, job.id), TUNED_S, f"{job.id}'s tuning to end")
        assert s.tuned(job.id), journal_tail(s, job.id)
        assert len(s.trials(job.id)) >= job.trials, s.trials(job.id)
        assert shared.limits.scrapes("n0") > 20
        assert shared.limits.seen("n0") == {g: {DEFAULT_W} for g in range(8)}

    def test_other_users_ranks_do_not_pause_a_jobs_tuning(self, shared: Run) -> None:
        s, job = shared.s, ALICE8
        until(lambda: over(s, job.id) or refusals(s, job.id), TUNED_S, f"{job.id}'s tuning")
        assert refusals(s, job.id) == []
        assert s.tuned(job.id), journal_tail(s, job.id)
        # mallory's and eve's ranks were there, connected, while alice's trials ran
        assert attached(s, "n1", (DECLARES, IDLE)), s.metric("n1", JOB_RANKS)
        published = [e for e in s.journal(job.id) if e.get("type") == "published"]
        assert len([e for e in published if e["ts"] > shared.intruded_at + 2]) >= 2, published
        assert any(t.get("settings", {}).get("power_cap_w") for t in s.trials(job.id))

    def test_an_xid_on_another_users_gpu_does_not_fail_a_jobs_trial(self, shared: Run) -> None:
        s, job = shared.s, ALICE8

        def failed() -> list[dict[str, Any]]:
            return [t for t in s.trials(job.id) if t["status"] == "xid"]

        until(lambda: over(s, job.id) or failed(), TUNED_S, f"{job.id}'s tuning to end")
        assert failed() == []
        xids = {labels["gpu"]: v for labels, v in s.metric("n2", XID_ERRORS) if labels.get("gpu")}
        assert xids.get(str(XID_GPU), 0) > 2, xids
        assert set(xids) == {str(XID_GPU)}, xids
        assert s.tuned(job.id), journal_tail(s, job.id)

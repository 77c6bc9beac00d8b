"""Tenants of a real Slurm, one hostile: identity from the kernel and the scheduler, caps only on
a job's own GPUs, nothing left capped after the jobs end (issue 44's "Done when").

A real Slurm (tests/cluster/slurm.py: Debian's slurmctld, a slurmd per node namespace, munge,
proctrack/task cgroup v1, 8 fake GPUs per node) and hyperagent deployed on it
(tests/cluster/slurm_tenants.py): mosquitto and the coordinator on the controller host, an agent
per node in that node's namespaces as the ``hyperagent`` user over a replayed 8-GPU node with
power capping on, its job socket at /run/hyperagent/job.sock. The coordinator has no job list:
``tune = "all"``, the energy objective, power caps searched.

Launched by ``srun`` as their own users, every rank a JobReporter connection declaring the GPU
Slurm gave it (``SLURM_STEP_GPUS``):

- alice's job on gpu-1 and gpu-2 (4 GPUs each), bob's on gpu-2, gpu-3 and gpu-4 (4 GPUs each:
  gpu-2 shared, distinct GPUs), and a second job of bob's on gpu-3 (2 GPUs) that never asks to
  be tuned (a ``[[coordinator.jobs]]`` rule: ``tune = "asked"``);
- mallory beside them, trying issue 44's points 1, 2, 3, 6 and 7 at once: before alice's ranks
  start, her ranks say hello under alice's Slurm job id outside Slurm, on a node of alice's
  (``HYPERAGENT_JOB_ID``) and on one without (``SLURM_JOB_ID``/``SLURM_STEP_ID`` set by hand),
  each declaring a GPU of another job and claiming 100x the samples; one of her Slurm jobs has
  alice's ``SLURM_JOB_ID``/``SLURM_STEP_ID`` in its environment (2 GPUs of gpu-4 of her own);
  a CPU-only job of hers asks to be tuned (on alice's gpu-1); another asks, under alice's id,
  not to be tuned (on gpu-2); and a rank of hers asks to be tuned under the id of bob's job
  that never asked, declaring one of its GPUs.

Then every job ends (scancel, mallory's shells killed), is released, and every GPU is watched
for 2 minutes, across the coordinator's re-announces and a coordinator killed and started
again. The whole run happens once (the module's fixture, about 3 minutes on 2 cores) and each
test checks one of the "Done when" points on what it recorded: the journals, the coordinator's
log, every agent's /metrics (its GPU power limits sampled every 0.5 s all along, its job series
once every rank was attached) and every settings, ack and status message on the broker (an
ack says which GPUs a version capped). ``HYPERAGENT_TEST_KEEP=1`` keeps the cluster's folder
(logs, journals) under /var/lib.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cluster.slurm import Slurm, Unavailable, check_host, new_root, slurm_cluster
from cluster.slurm_tenants import (
    DEFAULT_LIMIT_W,
    GPU_JOB_INFO,
    JOB_RANKS,
    RUN_DIR,
    Deployment,
    LimitSample,
    Message,
    Ready,
    Watch,
    as_user_on,
    background,
    ensure_agent_user,
    parse_ready,
    rank_command,
    ready_and_wait,
)
from cluster.text import samples

from hyperagent.scheduler import qualified
from hyperagent.sources.slurm_cgroup import read_process

from conftest import BUSY, unavailable

pytestmark = [
    pytest.mark.peer,
    pytest.mark.tenants,
    pytest.mark.timeout(420),
    pytest.mark.long(240),
    BUSY,
]

USERS = ("alice", "bob", "mallory")
POLICY: dict[str, Any] = {
    "tune": "all",
    "users": USERS,
    "objective": "energy",
    "power_limits_w": [150, 250],
    "trials": 4,
    "patience": 4,
    "ack_timeout_s": 5,
    "trial_timeout_s": 20,
    "end_after_s": 2,
    "release_after_s": 3,
    "drift_sustained_s": 300,
    "ranks_wait_s": 30,
    "plan": {
        "settle_steps": 3,
        "settle_s": 20.0,
        "measure_steps": 8,
        "measure_s": 80.0,
        "windows": 2,
        "max_windows": 2,
    },
}
SQUAT_BUDGET = {"trials": 16, "patience": 16}
AGENT_RELEASE_AFTER_S = 3.0
START_S = 60.0
"""Every task's ready line, every agent's /metrics, every rank attached: within this."""
TUNED_S = 150.0
"""alice's and bob's tunings end within this (they took 12-15 s on 2 cores)."""
RELEASED_S = 30.0
WATCH_S = 120.0
"""How long every GPU is watched once every job ended and was released."""
RESTART_AT_S = 40.0
"""When in the watch the coordinator is killed (SIGKILL) and started again."""
HUNDREDFOLD = 100.0
GONE_S = 2.0
"""A cancelled job's tasks are gone, and its caps lifted, this long after Slurm is idle (the
agent lifts a job's caps as its last rank leaves; its limits are sampled every 0.5 s)."""


# -- the run ------------------------------------------------------------------------------


@dataclass
class Job:
    """A Slurm job of the scenario: its name, user, Slurm's id, and each task's ready line."""

    name: str
    user: str
    tasks: list[Ready]
    process: subprocess.Popen[bytes]

    @property
    def slurm_id(self) -> str:
        return self.tasks[0].job

    @property
    def id(self) -> str:
        """What the cluster knows it by: its job step's."""
        return f"slurm-{self.slurm_id}-0"

    @property
    def gpus(self) -> dict[str, tuple[int, ...]]:
        """node -> the node's GPU indices Slurm gave it there."""
        return {t.node: t.gpus for t in self.tasks}

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(t.node for t in sorted(self.tasks, key=lambda t: t.node_index))


@dataclass
class Run:
    """What the scenario recorded."""

    slurm: Slurm
    deployment: Deployment
    watch: Watch
    jobs: dict[str, Job] = field(default_factory=dict)
    """By name: alice, bob, quiet (bob's, never asks), gpu (mallory's GPUs), cpu (mallory's,
    asks to be tuned), veto (mallory's, asks alice's id not to be tuned)."""
    squats: dict[str, str] = field(default_factory=dict)
    """mallory's ids outside Slurm: ``alice`` (under alice's id), ``quiet`` (under the quiet
    job's), as the cluster binds them to her uid."""
    squat_gpus: dict[str, dict[str, int]] = field(default_factory=dict)
    """squat name -> node -> the GPU (another job's) her rank declared there."""
    cgroups: dict[int, str | None] = field(default_factory=dict)
    """pid of each Slurm task -> the job its cgroup names (read by the test, as root)."""
    attached: dict[str, str] = field(default_factory=dict)
    """node -> its agent's /metrics once every rank there was attached (or at the timeout)."""
    attached_in_time: bool = False
    began: float = 0.0
    tuned: float | None = None
    """When both alice's and bob's tunings had ended (None: not within TUNED_S)."""
    ended: float = 0.0
    cancelled: float = 0.0
    """When no Slurm job was left and every node was idle."""
    released: float | None = None
    watched: float = 0.0
    restarted: float = 0.0
    watch_end: float = 0.0
    journals: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    coordinator_log: str = ""
    problems: list[str] = field(default_factory=list)
    """What did not happen in time (each test says what it needs of it)."""

    def holder(self, node: str, gpu: int, at: float | None = None) -> Job | None:
        """The Slurm job Slurm gave ``gpu`` of ``node`` to, if any (at ``at``: no job once
        every job was cancelled, its tasks gone and its agents told, ``GONE_S`` after
        ``cancelled``)."""
        if at is not None and self.cancelled and at >= self.cancelled + GONE_S:
            return None
        return next((j for j in self.jobs.values() if gpu in j.gpus.get(node, ())), None)

    def caps_published(self, job: str, until: float | None = None) -> set[float]:
        out = set()
        for entry in self.journals.get(job, []):
            settings = entry.get("settings") or {}
            if entry.get("type") in ("published", "final") and settings.get("power_cap_w"):
                if until is None or entry.get("ts", 0) <= until:
                    out.add(float(settings["power_cap_w"]))
        return out

    def explain(self) -> str:
        return (
            f"problems: {self.problems}\n"
            + "\n".join(
                f"--- journal {job}: {len(entries)} entries, last 5: {entries[-5:]}"
                for job, entries in self.journals.items()
            )
            + "\n"
            + self.deployment.tails(25)
        )


def until(predicate: Callable[[], Any], timeout_s: float, every_s: float = 0.3) -> Any:
    """``predicate()``'s first true value within ``timeout_s``, else None."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(every_s)


def uid(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


def srun_job(
    run: Run,
    name: str,
    user: str,
    nodelist: list[str],
    go: Path,
    *,
    gres: str | None,
    conns: list[dict[str, Any]] | None = None,
    env: dict[str, str] | None = None,
) -> Job:
    """A job of ``user`` launched with srun, one task per node, held until ``go`` exists:
    one rank per GPU Slurm gave the task (``--slurm-ranks``), or the ranks ``conns`` says."""
    slurm = run.slurm
    command = rank_command(
        conns or [],
        slurm_ranks=conns is None,
        log=slurm.jobs / f"{name}-%N.jsonl",
        seed=len(run.jobs),
    )
    forged = ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []
    process = slurm.srun(
        user,
        "sh",
        "-c",
        ready_and_wait(go),
        "sh",
        *forged,
        *command,
        nodes=len(nodelist),
        ntasks=len(nodelist),
        gres=gres,
        nodelist=nodelist,
        extra=["--ntasks-per-node=1", f"--job-name={name}"],
    )
    lines = slurm.read_lines(process, len(nodelist), timeout_s=START_S)
    job = Job(name, user, [parse_ready(line) for line in lines], process)
    run.jobs[name] = job
    for task in job.tasks:
        seen = read_process(Path("/proc"), task.pid)
        run.cgroups[task.pid] = None if seen is None or seen.job is None else seen.job.job.id
    return job


def expected_ranks(run: Run) -> dict[str, dict[str, int]]:
    """node -> job id -> ranks attached there, once everyone started."""
    out: dict[str, dict[str, int]] = {n: {} for n in run.slurm.nodes}
    for job in run.jobs.values():
        for task in job.tasks:
            ranks = len(task.gpus) if job.name in ("alice", "bob", "quiet", "gpu") else 1
            out[task.node][job.id] = ranks
    out["gpu-1"][run.squats["alice"]] = 1
    out["gpu-3"][run.squats["alice"]] = 1
    out["gpu-3"][run.squats["quiet"]] = 1
    return out


def ranks_on(text: str) -> dict[str, int]:
    return {labels["job_id"]: int(v) for labels, v in samples(text, JOB_RANKS) if v > 0}


def tuning_ended(run: Run, job: Job) -> bool:
    return any(e.get("type") == "final" for e in run.deployment.journal(job.id))


def released(run: Run) -> bool:
    """No agent has a job series left, and the coordinator tunes nothing."""
    for node in run.slurm.nodes:
        if samples(run.watch.scrape(node), JOB_RANKS):
            return False
    tuner = samples(run.watch.scrape("coordinator"), "hyperagent_tuner_nodes")
    return not tuner


def scenario(run: Run) -> None:
    slurm, deployment, watch = run.slurm, run.deployment, run.watch
    go_mallory, go_owners = slurm.jobs / "go-mallory", slurm.jobs / "go-owners"

    # Slurm's jobs, each task held before its ranks start
    alice = srun_job(run, "alice", "alice", ["gpu-1", "gpu-2"], go_owners, gres="gpu:4")
    bob = srun_job(run, "bob", "bob", ["gpu-2", "gpu-3", "gpu-4"], go_owners, gres="gpu:4")
    quiet = srun_job(run, "quiet", "bob", ["gpu-3"], go_owners, gres="gpu:2")
    forged = {"SLURM_JOB_ID": alice.slurm_id, "SLURM_STEP_ID": "0"}
    srun_job(run, "gpu", "mallory", ["gpu-4"], go_mallory, gres="gpu:2", env=forged)
    srun_job(
        run,
        "cpu",
        "mallory",
        ["gpu-1"],
        go_mallory,
        gres=None,
        conns=[{"job": None, "rank": 0, "gpu": None, "world": 1, "local": 1, "tune": True}],
    )
    srun_job(
        run,
        "veto",
        "mallory",
        ["gpu-2"],
        go_mallory,
        gres=None,
        conns=[{"job": alice.id, "rank": 7, "gpu": None, "world": 8, "local": 1, "tune": False}],
    )
    mallory = uid("mallory")
    run.squats = {"alice": qualified(alice.id, mallory), "quiet": qualified(quiet.id, mallory)}
    run.squat_gpus = {
        "alice": {"gpu-1": alice.gpus["gpu-1"][0], "gpu-3": bob.gpus["gpu-3"][0]},
        "quiet": {"gpu-3": quiet.gpus["gpu-3"][0]},
    }

    # the quiet job never asks; jobs outside Slurm (mallory's squats) search longer, so that
    # their tuning still runs when alice's and bob's ranks start
    deployment.rules = [{"id": quiet.id, "tune": "asked"}, {"id": "u*", **SQUAT_BUDGET}]
    deployment.start_coordinator()

    with contextlib.ExitStack() as shells:
        # mallory's shells on the nodes, outside Slurm, under alice's id and the quiet job's
        squat: dict[str, Any] = {"scale": HUNDREDFOLD, "world": 2, "local": 1}
        on_gpu1: list[dict[str, Any]] = [
            {"job": None, "rank": 0, "gpu": run.squat_gpus["alice"]["gpu-1"], **squat}
        ]
        on_gpu3: list[dict[str, Any]] = [
            {"job": None, "rank": 1, "gpu": run.squat_gpus["alice"]["gpu-3"], **squat},
            {
                "job": quiet.id,
                "rank": 0,
                "gpu": run.squat_gpus["quiet"]["gpu-3"],
                "world": 1,
                "local": 1,
                "tune": True,
                "scale": HUNDREDFOLD,
            },
        ]
        for node, env, conns in (
            ("gpu-1", {"HYPERAGENT_JOB_ID": alice.id}, on_gpu1),
            ("gpu-3", {"SLURM_JOB_ID": alice.slurm_id, "SLURM_STEP_ID": "0"}, on_gpu3),
        ):
            argv = [
                *as_user_on(slurm, node, "mallory", env),
                "sh",
                "-c",
                ready_and_wait(go_mallory),
                "sh",
                *rank_command(conns, log=slurm.jobs / f"mallory-shell-{node}.jsonl"),
            ]
            shells.enter_context(background(argv, deployment.logs / f"mallory-shell-{node}.log"))

        # mallory first; alice's and bob's ranks once hers are attached
        go_mallory.touch()
        if not until(
            lambda: (
                run.squats["alice"] in ranks_on(watch.scrape("gpu-1"))
                and run.squats["quiet"] in ranks_on(watch.scrape("gpu-3"))
            ),
            START_S / 2,
        ):
            run.problems.append("mallory's shells' ranks not attached in time")
        run.began = time.time()
        go_owners.touch()

        expected = expected_ranks(run)

        def attached() -> bool:
            texts = {node: watch.scrape(node) for node in slurm.nodes}
            run.attached = texts
            return all(ranks_on(texts[n]) == expected[n] for n in slurm.nodes)

        run.attached_in_time = bool(until(attached, START_S, every_s=1.0))
        if not run.attached_in_time:
            run.problems.append(
                "ranks attached: "
                + str({n: ranks_on(t) for n, t in run.attached.items()})
                + f" expected {expected}"
            )

        if until(lambda: tuning_ended(run, alice) and tuning_ended(run, bob), TUNED_S, 1.0):
            run.tuned = time.time()
        else:
            run.problems.append(f"alice's and bob's tunings not ended within {TUNED_S:g}s")

        # every job ends: Slurm's cancelled, then mallory's shells killed (her squats' tuning
        # resumes meanwhile: the GPUs her ranks declared are no Slurm job's any more)
        run.ended = time.time()
        slurm.cancel_all()
        run.cancelled = time.time()
    for job in run.jobs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.process.wait(20)
    if until(lambda: released(run), RELEASED_S, 1.0):
        run.released = time.time()
    else:
        run.problems.append(f"jobs not released within {RELEASED_S:g}s of their end")

    # every GPU watched for 2 minutes: re-announces, and the coordinator killed and restarted
    run.watched = time.time()
    time.sleep(RESTART_AT_S)
    deployment.kill("coordinator", signal.SIGKILL)
    time.sleep(1.0)
    run.restarted = time.time()
    deployment.start_coordinator()
    time.sleep(max(0.0, run.watched + WATCH_S - time.time()))
    run.watch_end = time.time()


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    try:
        check_host()
    except Unavailable as e:
        unavailable(str(e))
    if shutil.which("mosquitto") is None:
        unavailable("mosquitto is not installed (bash .ci/run installs it)")
    ensure_agent_user()
    keep = os.environ.get("HYPERAGENT_TEST_KEEP") == "1"  # to look at the logs afterwards
    root = new_root() if keep else None
    with slurm_cluster(host_dirs=(RUN_DIR,), root=root, keep=keep) as slurm:
        deployment = Deployment(
            slurm,
            slurm.root / "hyperagent",
            job_users=USERS,
            policy=POLICY,
            agent_release_after_s=AGENT_RELEASE_AFTER_S,
        )
        deployment.prepare()
        deployment.start_broker()
        for node in slurm.nodes:
            deployment.start_agent(node)
        watch = Watch(deployment)
        run = Run(slurm, deployment, watch)
        try:
            watch.start()
            ready = until(lambda: all(watch.scrape(n) for n in slurm.nodes), START_S, 1.0)
            assert ready, f"the agents' /metrics did not answer\n{deployment.tails()}"
            scenario(run)
            for job in deployment.journals():
                run.journals[job] = deployment.journal(job)
            run.coordinator_log = deployment.log("coordinator")
            yield run
        finally:
            watch.close()
            deployment.stop()


# -- the checks ---------------------------------------------------------------------------


def test_the_harness_ran_each_job_where_slurm_put_it(run: Run) -> None:
    """The ground truth the other tests check against: Slurm's tasks, their GPUs, cgroups."""
    jobs = run.jobs
    assert jobs["alice"].nodes == ("gpu-1", "gpu-2")
    assert jobs["bob"].nodes == ("gpu-2", "gpu-3", "gpu-4")
    assert not set(jobs["alice"].gpus["gpu-2"]) & set(jobs["bob"].gpus["gpu-2"])
    for job in jobs.values():
        for task in job.tasks:
            assert run.cgroups[task.pid] == job.id, (job.name, task)
            assert len(task.gpus) == {"alice": 4, "bob": 4, "quiet": 2, "gpu": 2}.get(job.name, 0)
    assert run.attached_in_time, run.explain()


def test_alice_and_bob_tunings_end_with_only_their_own_measurements(run: Run) -> None:
    assert run.tuned is not None, run.explain()
    for name in ("alice", "bob"):
        job = run.jobs[name]
        entries = run.journals[job.id]
        final = next(e for e in entries if e.get("type") == "final")
        assert "better" in final, final  # confirmed, or "no setting was better"
        starts = [e for e in entries if e.get("type") == "start"]
        assert starts and all(sorted(s["nodes"]) == sorted(job.nodes) for s in starts), starts
        trials = [e for e in entries if e.get("type") == "trial"]
        assert trials, entries
        for trial in trials:
            reports = trial.get("reports", {})
            assert set(reports) <= set(job.nodes), (name, trial)
            measured = [r["samples"] for r in reports.values() if r.get("samples")]
            # mallory's ranks under alice's id claim 100x the samples: none of them counted
            if len(measured) > 1:
                assert max(measured) < 3 * min(measured), (name, trial)
        # what the coordinator said it found under the job's id: only the job's own ranks
        found = re.findall(
            rf"(?<![\w-]){job.id}: found on ([^(]*) \((\d+) of (\d+) ranks, user (\S+)\)",
            run.coordinator_log,
        )
        assert found, run.coordinator_log[-3000:]
        world = 4 * len(job.nodes)
        for nodes, attached, said_world, user in found:
            assert set(nodes.split(", ")) <= set(job.nodes), found
            assert (int(said_world), user) == (world, name), found
            assert int(attached) <= world, found


def acks(run: Run) -> list[Message]:
    return [m for m in run.watch.messages_of("ack") if m.payload.get("ok")]


def test_no_cap_ever_lands_on_a_gpu_its_job_does_not_hold(run: Run) -> None:
    """Every ack that applied a power cap names only GPUs Slurm gave that job on that node,
    and every GPU limit sampled off the default is one its holder's tuning published."""
    wrong: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for message in acks(run):
        job, node = message.payload["job"], message.payload["node"]
        applied = message.payload.get("applied", {})
        owner = next((j for j in run.jobs.values() if j.id == job), None)
        held = set(owner.gpus.get(node, ())) if owner is not None else set()
        for gpu, cap in zip(applied.get("gpus", []), applied.get("power_cap_w", []), strict=False):
            if gpu not in held:
                wrong.setdefault((job, node, gpu), []).append((message.at - run.began, cap))
    off: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    for sample in run.watch.limits:
        for gpu, limit in sample.limits.items():
            if limit == DEFAULT_LIMIT_W:
                continue
            holder = run.holder(sample.node, gpu, sample.at)
            if holder is None or limit not in run.caps_published(holder.id, sample.at):
                name = holder.id if holder is not None else "no job"
                off.setdefault((sample.node, gpu, name), []).append((sample.at - run.began, limit))
    assert not wrong and not off, "\n".join(
        [
            f"{job} applied a cap on {node} GPU {gpu}, not its own:"
            f" {len(times)} acks from {times[0][0]:.1f}s to {times[-1][0]:.1f}s after alice's and"
            f" bob's ranks were let start, caps {sorted({c for _, c in times})} W"
            for (job, node, gpu), times in wrong.items()
        ]
        + [
            f"{node} GPU {gpu} (Slurm gave it to {name}) sampled at {sorted({v for _, v in times})}"
            f" W, which {name} had not published, from {times[0][0]:.1f}s to {times[-1][0]:.1f}s"
            for (node, gpu, name), times in off.items()
        ]
    )
    assert len(run.watch.limits) > 100, "the limits were sampled all along"


def test_mallory_is_tuned_only_on_her_own_gpus_and_moves_nobody_else(run: Run) -> None:
    alice, quiet, gpu_job = run.jobs["alice"], run.jobs["quiet"], run.jobs["gpu"]
    # nothing under alice's id nor the quiet job's is hers: her squats are jobs of her own
    for job in (alice.id, quiet.id):
        assert not re.search(rf"(?<![\w-]){job}: found on .*user mallory", run.coordinator_log)
    # the quiet job, which never asked, was not tuned for her asking under its id
    assert not any(e.get("type") == "start" for e in run.journals.get(quiet.id, [])), (
        run.journals.get(quiet.id)
    )
    quiet_settings = [
        m for m in run.watch.messages_of("settings") if f"/job/{quiet.id}/" in m.topic and m.payload
    ]
    assert not quiet_settings, quiet_settings[:3]
    # her Slurm job with alice's SLURM_JOB_ID in its environment is her own job, tuned on the
    # 2 GPUs Slurm gave her
    capped = {
        (m.payload["node"], tuple(sorted(m.payload["applied"]["gpus"])))
        for m in acks(run)
        if m.payload["job"] == gpu_job.id and m.payload.get("applied", {}).get("gpus")
    }
    assert capped == {("gpu-4", gpu_job.gpus["gpu-4"])}, capped
    # and no job of hers applied a cap anywhere else
    mine = {run.jobs[n].id for n in ("gpu", "cpu", "veto")} | set(run.squats.values())
    elsewhere: dict[tuple[str, str], set[int]] = {}
    for message in acks(run):
        job, node = message.payload["job"], message.payload["node"]
        if job not in mine:
            continue
        gpus = set(message.payload.get("applied", {}).get("gpus", []))
        held = set(gpu_job.gpus.get(node, ())) if job == gpu_job.id else set()
        if gpus - held:
            elsewhere.setdefault((job, node), set()).update(gpus - held)
    assert not elsewhere, {f"{job} on {node}": sorted(g) for (job, node), g in elsewhere.items()}


def test_every_gpu_is_back_at_its_default_and_stays_there_once_its_jobs_ended(run: Run) -> None:
    assert run.released is not None, run.explain()
    watched: list[LimitSample] = [
        s for s in run.watch.limits_since(run.released) if s.at <= run.watch_end
    ]
    for node in run.slurm.nodes:
        times = [s.at for s in watched if s.node == node and len(s.limits) == 8]
        assert times and times[-1] >= run.watch_end - 3, (node, "not watched to the end")
        gaps = [b - a for a, b in zip([run.released, *times], times, strict=False)]
        assert max(gaps) < 10, (node, max(gaps))
    # the coordinator said "online" again and again over the watch, and after its restart
    online = [
        m
        for m in run.watch.messages_of("status", run.watched)
        if m.payload.get("state") == "online"
    ]
    assert any(m.at > run.restarted for m in online), online
    assert len(online) >= 4, [(m.at - run.watched, m.payload) for m in online]
    # every GPU at its default limit all along
    off: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for sample in watched:
        for gpu, limit in sample.limits.items():
            if limit != DEFAULT_LIMIT_W:
                off.setdefault((sample.node, gpu), []).append((sample.at - run.released, limit))
    lines = []
    for (node, gpu), seen in off.items():
        lines.append(
            f"{node} GPU {gpu} at {sorted({v for _, v in seen})} W in {len(seen)} samples from"
            f" {seen[0][0]:.1f}s to {seen[-1][0]:.1f}s after the release; the last caps applied"
            " there (seconds after the jobs' end: job, version, applied):"
        )
        lines += [
            f"    {m.at - run.ended:.1f}s {m.payload['job']} v{m.payload['version']}"
            f" {m.payload.get('applied')}"
            for m in acks(run)
            if m.payload["node"] == node and gpu in m.payload.get("applied", {}).get("gpus", [])
        ][-3:]
    assert not off, "\n".join(lines)


def test_the_attribution_names_each_rank_slurm_job_and_user(run: Run) -> None:
    assert run.attached_in_time, run.explain()
    for node, text in run.attached.items():
        ranks = ranks_on(text)
        infos = samples(text, GPU_JOB_INFO)
        for job in run.jobs.values():
            if node not in job.gpus:
                assert job.id not in ranks, (node, job.id, ranks)
                continue
            assert ranks.get(job.id) == max(1, len(job.gpus[node])), (node, job.id, ranks)
            on_gpus = {
                int(labels["gpu"]): labels
                for labels, v in infos
                if labels["job_id"] == job.id and v
            }
            assert set(on_gpus) == set(job.gpus[node]), (node, job.id, on_gpus)
            for labels in on_gpus.values():
                assert (labels["user"], labels["slurm_job"], labels["slurm_step"]) == (
                    job.user,
                    job.slurm_id,
                    "0",
                ), labels
        # each GPU is credited to the job Slurm gave it to, and to no other (mallory's
        # declared GPUs included); a GPU of no job to none
        for labels, v in infos:
            if not v:
                continue
            holder = run.holder(node, int(labels["gpu"]))
            assert holder is not None and labels["job_id"] == holder.id, (node, labels)

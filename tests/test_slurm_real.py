"""Jobs of a real Slurm (Debian's slurmctld, slurmd and munge, tests/cluster/slurm.py), launched
by their own users with ``srun`` and ``sbatch``, as the agent sees them: each task's job step
and uid from its cgroup (``slurm_cgroup.read_process``), the job's user, nodes, tasks and
per-node GPUs from the controller (``slurm_jobs.SlurmJobs``, asked as the agent's user from a
node), the prolog's job-mapping files; all checked against what Slurm told the tasks.

The cluster is installed with the Slurm page (docs/install/slurm.md) run as written: its first
shell block (the shipped systemd/slurm/ files) before the daemons start, its check once they
run."""

from __future__ import annotations

import asyncio
import pwd
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster.slurm import Slurm, Unavailable, check_host, slurm_cluster

from hyperagent.scheduler import slurm_allocation
from hyperagent.sources.job_mapping import read_mapping_dir
from hyperagent.sources.slurm_cgroup import read_process
from hyperagent.sources.slurm_jobs import SlurmJobInfo, SlurmJobs, SlurmParseError, UnknownJob

from conftest import BUSY, REPO, unavailable

pytestmark = [pytest.mark.long(10), BUSY, pytest.mark.timeout(180)]

TASK = (
    # what each task tells: where it runs, which GPUs Slurm gave it, which device nodes it may
    # open (ConstrainDevices: the others are "Operation not permitted"), its pid; then it waits
    'may=""; for g in 0 1 2 3 4 5 6 7; do'
    ' cat /dev/nvidia$g 2>&1 | grep -q "not permitted" || may="$may${may:+,}$g"; done;'
    ' echo "task $SLURMD_NODENAME $SLURM_JOB_ID ${SLURM_STEP_ID:-none} $SLURM_PROCID'
    ' ${SLURM_STEP_GPUS:-$SLURM_JOB_GPUS} ${CUDA_VISIBLE_DEVICES:--} $may $$";'
    " exec sleep 120"
)


@dataclass(frozen=True)
class Task:
    node: str
    job: str
    step: str
    rank: int
    gpus: tuple[int, ...]
    """SLURM_STEP_GPUS (SLURM_JOB_GPUS in the batch script): the node's GPU indices."""
    cuda: str
    """CUDA_VISIBLE_DEVICES as the task sees it."""
    may_open: tuple[int, ...]
    pid: int


def parse_task(line: str) -> Task:
    _, node, job, step, rank, gpus, cuda, may, pid = line.split()
    indices = tuple(int(g) for g in gpus.split(","))
    return Task(
        node, job, step, int(rank), indices, cuda, tuple(map(int, may.split(","))), int(pid)
    )


def readme_blocks() -> list[str]:
    """The ```sh blocks of the Slurm page (docs/install/slurm.md), in order."""
    section = (REPO / "docs" / "install" / "slurm.md").read_text()
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def on_host(slurm: Slurm, host: str, script: str, user: str | None = None) -> str:
    """``script`` run with ``sh -eu`` on ``host`` from the checkout's directory."""
    done = subprocess.run(
        [*slurm.client(user, host), "sh", "-euc", f'cd "$0"\n{script}', str(REPO)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, f"{script}\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    try:
        check_host()
    except Unavailable as e:
        unavailable(str(e))
    # the agent's user, as README's install makes it
    subprocess.run(
        ["systemd-sysusers", str(REPO / "systemd" / "hyperagent.sysusers")],
        check=True,
        capture_output=True,
        timeout=30,
    )
    install, check = readme_blocks()
    with slurm_cluster(install=lambda s: on_host(s, "ctl", install)) as cluster:
        on_host(cluster, "gpu-1", check)
        yield cluster


def agent_query(slurm: Slurm, node: str) -> SlurmJobs:
    """The agent's scheduler query on ``node``, as its user ``hyperagent``."""
    return SlurmJobs((*slurm.client("hyperagent", node), "scontrol"), timeout_s=20)


def uid(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


def mapping(slurm: Slurm, node: str) -> dict[str, tuple[str, ...]]:
    """GPU index -> job ids of ``node``'s /run/dcgm-job-mapping, read as the agent reads it."""
    read = read_mapping_dir(slurm.node_path(node))
    assert not read.problems
    return {gpu: tuple(j.id for j in jobs) for gpu, jobs in read.gpus.items()}


def until(predicate: Callable[[], object], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g}s for {what}")
        time.sleep(0.2)


def check_tasks(tasks: list[Task], user: str, job: str, step: str) -> None:
    """Each task is in its job step's cgroup under its user's uid, may open only its GPUs,
    and (device nodes constrained) counts them from 0."""
    for task in tasks:
        seen = read_process(Path("/proc"), task.pid)
        assert seen is not None and seen.job is not None, f"task {task} is in no Slurm cgroup"
        assert seen.job.job.id == f"slurm-{job}-{step}"
        assert seen.job.job.scheduler_id == job and seen.job.job.step == step
        assert seen.uid == uid(user) and seen.job.uid == uid(user)
        assert task.may_open == task.gpus
        assert task.cuda == ",".join(str(i) for i in range(len(task.gpus)))


def gpus_by_node(tasks: list[Task]) -> dict[str, tuple[int, ...]]:
    found: dict[str, tuple[int, ...]] = {}
    for task in tasks:
        assert found.setdefault(task.node, task.gpus) == task.gpus
    return found


def test_srun_jobs_of_two_users_are_who_slurm_says_on_each_node(slurm: Slurm) -> None:
    """alice on gpu-1 and gpu-2 (4 GPUs each), bob on gpu-2, gpu-3, gpu-4 (2 each): gpu-2
    shared, with distinct GPUs."""
    alice = slurm.srun(
        "alice",
        "sh",
        "-c",
        TASK,
        nodes=2,
        ntasks=4,
        gres="gpu:4",
        nodelist=["gpu-1", "gpu-2"],
        extra=["--ntasks-per-node=2"],
    )
    alice_tasks = [parse_task(line) for line in slurm.read_lines(alice, 4)]
    bob = slurm.srun(
        "bob",
        "sh",
        "-c",
        TASK,
        nodes=3,
        ntasks=3,
        gres="gpu:2",
        nodelist=["gpu-2", "gpu-3", "gpu-4"],
    )
    bob_tasks = [parse_task(line) for line in slurm.read_lines(bob, 3)]
    alice_job, bob_job = alice_tasks[0].job, bob_tasks[0].job
    assert {t.job for t in alice_tasks} == {alice_job} and {t.job for t in bob_tasks} == {bob_job}

    check_tasks(alice_tasks, "alice", alice_job, "0")
    check_tasks(bob_tasks, "bob", bob_job, "0")
    alice_gpus, bob_gpus = gpus_by_node(alice_tasks), gpus_by_node(bob_tasks)
    assert set(alice_gpus) == {"gpu-1", "gpu-2"} and set(bob_gpus) == {"gpu-2", "gpu-3", "gpu-4"}
    assert not set(alice_gpus["gpu-2"]) & set(bob_gpus["gpu-2"])
    assert sorted(t.rank for t in alice_tasks) == [0, 1, 2, 3]

    # the controller, asked from a node of each job as the agent's user
    async def ask() -> tuple[SlurmJobInfo, SlurmJobInfo]:
        query = agent_query(slurm, "gpu-2")
        return await query.lookup(alice_job), await query.lookup(bob_job)

    alice_info, bob_info = asyncio.run(ask())
    assert alice_info == SlurmJobInfo(
        alice_job, "alice", uid("alice"), ("gpu-1", "gpu-2"), 4, alice_gpus, "RUNNING"
    )
    assert bob_info == SlurmJobInfo(
        bob_job, "bob", uid("bob"), ("gpu-2", "gpu-3", "gpu-4"), 3, bob_gpus, "RUNNING"
    )

    # the prolog's mapping files: each node lists each job on its GPUs, and nothing else
    def expected(*jobs: tuple[str, dict[str, tuple[int, ...]]]) -> dict[str, dict[str, tuple]]:
        out: dict[str, dict[str, tuple[str, ...]]] = {n: {} for n in slurm.nodes}
        for job, gpus in jobs:
            for node, indices in gpus.items():
                for i in indices:
                    out[node][str(i)] = (*out[node].get(str(i), ()), slurm_allocation(job).id)
        return out

    both = expected((alice_job, alice_gpus), (bob_job, bob_gpus))
    assert {n: mapping(slurm, n) for n in slurm.nodes} == both

    # alice cancels her job: her tasks go, and so do her mapping lines (the epilog); bob's stay
    subprocess.run([*slurm.client("alice"), "scancel", alice_job], check=True, timeout=30)
    alice.wait(30)
    only_bob = expected((bob_job, bob_gpus))
    until(lambda: {n: mapping(slurm, n) for n in slurm.nodes} == only_bob, "alice's epilogs")
    assert all(read_process(Path("/proc"), t.pid) is None for t in alice_tasks)
    ended = asyncio.run(agent_query(slurm, "gpu-1").lookup(alice_job))
    assert ended.state == "CANCELLED" and ended.gpus == {"gpu-1": (), "gpu-2": ()}

    slurm.cancel_all()
    bob.wait(30)
    assert {n: mapping(slurm, n) for n in slurm.nodes} == {n: {} for n in slurm.nodes}


def test_a_batch_job_and_its_srun_step_are_who_slurm_says(slurm: Slurm) -> None:
    script = f"#!/bin/sh\nsh -c '{TASK}' &\nsrun sh -c '{TASK}' &\nwait\n"
    job = slurm.sbatch("mallory", script, gres="gpu:2", nodelist=["gpu-3"])
    output = slurm.jobs / f"mallory-{job}.out"

    def lines() -> list[str]:
        text = output.read_text() if output.exists() else ""
        return [line for line in text.splitlines() if line.startswith("task ")]

    until(lambda: len(lines()) == 2, f"the batch script and its step to start ({output})")
    tasks = {t.step: t for t in map(parse_task, lines())}
    assert set(tasks) == {"none", "0"}, "the batch script has no SLURM_STEP_ID, its srun 0"
    batch, step = tasks["none"], tasks["0"]
    check_tasks([batch], "mallory", job, "batch")
    check_tasks([step], "mallory", job, "0")
    info = asyncio.run(agent_query(slurm, "gpu-3").lookup(job))
    assert (info.user, info.uid, info.nodes, info.tasks) == (
        "mallory",
        uid("mallory"),
        ("gpu-3",),
        1,
    )
    assert info.gpus == {"gpu-3": batch.gpus} and step.gpus == batch.gpus
    assert mapping(slurm, "gpu-3") == {str(i): (f"slurm-{job}",) for i in batch.gpus}
    slurm.cancel_all()
    assert mapping(slurm, "gpu-3") == {}


def test_the_controller_is_not_fooled_by_a_job_named_like_its_lines(slurm: Slurm) -> None:
    """mallory names her job and comments it with newlines and the controller's own lines
    (Slurm keeps both as written): the agent's query refuses the answer; a job the controller
    does not know is UnknownJob."""
    forged_name = f"x\n   UserId=alice({uid('alice')}) GroupId=alice({uid('alice')})"
    forged_comment = (
        "y\n   NodeList=gpu-[1-4]\n     Nodes=gpu-1 CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7)"
    )
    job = slurm.sbatch(
        "mallory",
        "#!/bin/sh\nexec sleep 120\n",
        gres="gpu:1",
        nodelist=["gpu-4"],
        extra=[f"--job-name={forged_name}", f"--comment={forged_comment}"],
    )
    slurm.wait_job(job)

    async def ask() -> None:
        query = agent_query(slurm, "gpu-4")
        with pytest.raises(SlurmParseError, match="2 lines starting with UserId="):
            await query.lookup(job)
        with pytest.raises(UnknownJob):
            await query.lookup("999999")
        assert await query.get(job) is None

    asyncio.run(ask())
    slurm.cancel_all()

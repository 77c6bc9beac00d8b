"""A job on the job socket is who the kernel says it is, tried as hostile users of a shared node
would: real rank processes of their own Unix accounts against a real agent socket.

- A rank's Slurm ids come from its cgroup, never from ``SLURM_JOB_ID`` in its environment;
- a rank outside any scheduler job is bound to its uid (``u<uid>-<id>``): another user's
  rank under the same id is another job, which gets none of its settings;
- one user's connections and jobs are bounded on their own, so that the node stays open to
  every other user, and every refused rank hears why.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from hyperagent.agent import Agent
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.config import Config, build_config
from hyperagent.job import (
    REFUSED_RETRY_S,
    JobReporter,
    JobSettings,
    StepReport,
    decode,
    encode_hello,
    encode_refused,
    encode_step,
)
from hyperagent.scheduler import qualified
from hyperagent.sources import Hardware
from hyperagent.sources.job import JobSource, PeerPolicy

from conftest import FIXTURES, system_user

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("root_only")]

REPO = Path(__file__).resolve().parents[1]
ALICE, MALLORY = "ha-alice", "ha-mallory"

RANKS = """
import json, os, sys, time
from hyperagent.job import JobReporter
socket_path, job, count, hold_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
gpu = None if sys.argv[5] == "-" else int(sys.argv[5])
stay = sys.argv[6] == "stay"
print(os.getpid(), flush=True)
sys.stdin.readline()  # the test's go-ahead (it has written what it needs for this pid)
reporters = [
    JobReporter(None if job == "-" else job, rank=i, socket_path=socket_path, gpu=gpu)
    for i in range(count)
]
deadline = time.monotonic() + hold_s
versions = [0] * count
while time.monotonic() < deadline:
    for i, r in enumerate(reporters):
        if r.refused is None and r.connected:
            r.report_step(samples=4, step_s=0.1, compute_s=0.08, comm_s=0.02)
        new = r.poll_settings()
        versions[i] = new.version if new else versions[i]
    if not stay and all(v or r.refused for v, r in zip(versions, reporters)):
        break
    time.sleep(0.05)
print(json.dumps([{"refused": r.refused, "version": v} for r, v in zip(reporters, versions)]))
"""
"""``count`` ranks of ``job`` ('-': the scheduler's, from the environment) on one process,
each its own connection, until each is refused or gets settings (or, told to ``stay``, until
``hold_s`` passed), or ``hold_s`` passed."""


class Ranks:
    """One process of ranks running as a user (started paused: see RANKS)."""

    def __init__(self, process: asyncio.subprocess.Process, pid: int) -> None:
        self.process, self.pid = process, pid

    @classmethod
    async def start(
        cls,
        name: str,
        socket_path: Path,
        job: str,
        count: int = 1,
        hold_s: float = 10.0,
        env: dict[str, str] | None = None,
        gpu: int | None = None,
        stay: bool = False,
    ) -> Ranks:
        uid = system_user(name)
        process = await asyncio.create_subprocess_exec(
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--",
            sys.executable,
            "-c",
            RANKS,
            str(socket_path),
            job,
            str(count),
            str(hold_s),
            "-" if gpu is None else str(gpu),
            "stay" if stay else "go",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )
        assert process.stdout is not None
        async with asyncio.timeout(30):
            pid = int(await process.stdout.readline())
        return cls(process, pid)

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")

    async def told(self) -> list[dict[str, object]]:
        """What each rank was told: its refusal, or the settings version it got."""
        async with asyncio.timeout(60):
            out, err = await self.process.communicate()
        assert self.process.returncode == 0, err.decode()
        return list(json.loads(out.decode().splitlines()[-1]))


async def _until(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def open_policy() -> PeerPolicy:
    return PeerPolicy(users=frozenset({system_user(ALICE), system_user(MALLORY)}))


async def test_slurm_ids_in_a_ranks_environment_name_no_slurm_job(shared_dir: Path) -> None:
    """mallory's rank sets alice's SLURM_JOB_ID and SLURM_STEP_ID: outside Slurm's cgroups it
    is a job of mallory's own, and the settings of alice's Slurm job never reach it."""
    source = JobSource(shared_dir / "job.sock", open_policy())
    await source.start()
    try:
        source.send_settings("slurm-4242-0", JobSettings(2, {"bucket_mb": 8}))
        env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
        mallory = await Ranks.start(MALLORY, shared_dir / "job.sock", "-", hold_s=3, env=env)
        mallory.go()
        own = qualified("slurm-4242-0", system_user(MALLORY))
        await _until(lambda: own in source.jobs and source.jobs[own].steps > 0)
        assert source.attached("slurm-4242-0") == 0
        assert source.jobs["slurm-4242-0"].steps == 0
        assert await mallory.told() == [{"refused": None, "version": 0}]
    finally:
        await source.close()


def write_cgroup(proc_root: Path, pid: int, text: str) -> None:
    folder = proc_root / str(pid)
    folder.mkdir(parents=True)
    (folder / "cgroup").write_text(text)


async def test_a_rank_is_the_slurm_job_its_cgroup_names(shared_dir: Path) -> None:
    """alice's rank says it is job ``mine``; its cgroup (a cgroup v1 file as Slurm's
    proctrack/cgroup writes it) puts it in job 4242 step 0: it is slurm-4242-0, and that job's
    settings reach it under the id it gave."""
    proc_root = shared_dir / "proc"
    source = JobSource(shared_dir / "job.sock", open_policy(), proc_root=proc_root)
    await source.start()
    try:
        alice = await Ranks.start(ALICE, shared_dir / "job.sock", "mine", hold_s=10)
        uid = system_user(ALICE)
        write_cgroup(
            proc_root,
            alice.pid,
            f"7:freezer:/slurm_gpu-1/uid_{uid}/job_4242/step_0\n"
            f"5:devices:/slurm_gpu-1/uid_{uid}/job_4242/step_0/task_0\n"
            "1:name=systemd:/system.slice/slurmd.service\n",
        )
        alice.go()
        await _until(lambda: "slurm-4242-0" in source.jobs and source.jobs["slurm-4242-0"].steps)
        assert not any(job.endswith("mine") for job in source.jobs)
        assert source.jobs["slurm-4242-0"].owner == uid
        source.send_settings("slurm-4242-0", JobSettings(3, {"bucket_mb": 16}))
        assert await alice.told() == [{"refused": None, "version": 3}]
    finally:
        await source.close()


def fair_policy() -> PeerPolicy:
    return PeerPolicy(
        users=frozenset({system_user(ALICE), system_user(MALLORY)}),
        max_jobs=4,
        max_ranks=16,
        max_jobs_per_user=2,
        max_connections_per_user=6,
    )


async def alice_gets_in(source: JobSource, socket_path: Path) -> None:
    """alice's job attaches, steps and receives its settings."""
    alice = await Ranks.start(ALICE, socket_path, "train", hold_s=15)
    alice.go()
    train = qualified("train", system_user(ALICE))
    await _until(lambda: train in source.jobs and source.jobs[train].steps > 0)
    source.send_settings(train, JobSettings(4, {"bucket_mb": 32}))
    assert await alice.told() == [{"refused": None, "version": 4}]


async def test_one_user_cannot_take_every_connection(shared_dir: Path) -> None:
    """mallory holds 10 connections, 4 over her share: each of those 4 is refused and hears
    why; alice's job still gets in."""
    source = JobSource(shared_dir / "job.sock", fair_policy())
    await source.start()
    try:
        flood = await Ranks.start(MALLORY, shared_dir / "job.sock", "flood", count=10, hold_s=10)
        flood.go()
        await _until(lambda: source.refused["too_many_connections"] >= 4)
        await alice_gets_in(source, shared_dir / "job.sock")
        told = await flood.told()
        refused = [str(t["refused"]) for t in told if t["refused"]]
        assert len(refused) == 4, told
        assert all(r.startswith("too_many_connections") for r in refused), refused
        assert all("max_connections_per_user" in r for r in refused), refused
    finally:
        await source.close()


async def test_one_user_cannot_take_every_job_slot(shared_dir: Path) -> None:
    """mallory starts three one-rank jobs, one over her share of two: that one is refused and
    hears why; alice's job still gets in."""
    source = JobSource(shared_dir / "job.sock", fair_policy())
    await source.start()
    try:
        squat = []
        for i in range(3):
            ranks = await Ranks.start(MALLORY, shared_dir / "job.sock", f"squat-{i}", hold_s=8)
            ranks.go()
            squat.append(ranks)
        await _until(lambda: source.refused["too_many_jobs"] >= 1)
        await alice_gets_in(source, shared_dir / "job.sock")
        told = [t for ranks in squat for t in await ranks.told()]
        refused = [str(t["refused"]) for t in told if t["refused"]]
        assert len(refused) == 1, told
        assert refused[0].startswith("too_many_jobs") and "max_jobs_per_user" in refused[0]
    finally:
        await source.close()


async def test_a_rank_refused_with_its_packets_unread_reads_the_reason(shared_dir: Path) -> None:
    """A rank whose hello and steps wait unread when the agent refuses it (its user's job slots
    are full) reads the reason, not a reset: the agent reads what it sent before closing."""
    policy = PeerPolicy(max_jobs_per_user=1)
    source = JobSource(shared_dir / "job.sock", policy)
    await source.start()
    try:
        first = JobReporter("first", rank=0, socket_path=shared_dir / "job.sock")
        first.report_step(samples=1, step_s=0.1, compute_s=0.1, comm_s=0.0)
        await _until(lambda: "first" in source.jobs and source.jobs["first"].steps)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(str(shared_dir / "job.sock"))
        sock.send(encode_hello("second", 0))
        for _ in range(20):  # sent before the agent's loop turns: all queued at once
            sock.send(encode_step(StepReport("second", 0, 1, 0.1, 0.1, 0.0, None, 0)))
        await _until(lambda: source.refused["too_many_jobs"] == 1)
        sock.settimeout(5)
        message = decode(sock.recv(65536))
        assert message["type"] == "refused" and message["reason"] == "too_many_jobs", message
        sock.close()
        first.close()
    finally:
        await source.close()


def test_a_reporter_reads_the_reason_after_a_reset(tmp_path: Path) -> None:
    """An agent that closed with the rank's packets unread resets the rank's end (the reset is
    read before the packets queued): the reporter reads on past it and keeps the reason, and
    backs off for ``REFUSED_RETRY_S``, not a second."""
    path = tmp_path / "job.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)
    try:
        reporter = JobReporter("job", rank=0, socket_path=path)
        conn, _ = listener.accept()
        reporter.report_step(samples=1, step_s=0.1, compute_s=0.1, comm_s=0.0)
        conn.send(encode_refused("too_many_jobs", "uid 7 holds 8 live jobs"))
        conn.close()  # the hello and the step unread
        assert reporter.poll_settings() is None
        assert reporter.refused == "too_many_jobs: uid 7 holds 8 live jobs"
        assert not reporter.connected
        assert reporter._retry_at - time.monotonic() > REFUSED_RETRY_S - 5
    finally:
        listener.close()


ALICE_ON_TWO_NODES = FIXTURES / "slurm" / "scontrol-show-job-d-running-alice-2-nodes.txt"
"""Slurm 22.05's ``scontrol show job -d 1``: job 1 on gpu-[1-2], GPUs 0-1 of each."""


def slurm_node_config(state_dir: Path, squeue: str | None = None) -> Config:
    """An agent on gpu-1 over no broker, whose controller answers ``ALICE_ON_TWO_NODES`` for
    any job and whose ``squeue`` (when given: a shell line) lists the node's jobs."""
    job: dict[str, object] = {"scontrol": ["sh", "-c", f"cat {ALICE_ON_TWO_NODES}", "scontrol"]}
    if squeue is not None:
        job["squeue"] = ["sh", "-c", squeue, "squeue"]
    return build_config(
        {
            "node": "gpu-1",
            "mqtt": {"enabled": False},
            "agent": {"interval_s": 0.1, "metrics_address": "", "state_dir": str(state_dir)},
            "sources": {"ipmi": {"enabled": False}, "rdma": {"enabled": False}, "job": job},
        }
    )


async def test_a_slurm_jobs_gpus_are_the_ones_the_scheduler_gave_it(
    shared_dir: Path, nvidia_smi_dir: Path
) -> None:
    """alice's rank in Slurm job 1's cgroup declares GPU 5; the controller (its recorded
    answer) gave job 1 GPUs 0 and 1 of this node, gpu-1: those are the job's GPUs here, and
    its telemetry says the scheduler's user and nodes."""
    proc_root = shared_dir / "proc"
    config = slurm_node_config(shared_dir)
    source = JobSource(shared_dir / "job.sock", open_policy(), proc_root=proc_root)
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    agent = Agent(config, Hardware(nvml=nvml), sources=[source])
    running = asyncio.create_task(agent.run())
    try:
        async with asyncio.timeout(10):
            await agent.ready.wait()
        alice = await Ranks.start(ALICE, shared_dir / "job.sock", "mine", hold_s=10, gpu=5)
        uid = system_user(ALICE)
        write_cgroup(
            proc_root,
            alice.pid,
            f"7:freezer:/slurm_gpu-1/uid_{uid}/job_1/step_0\n"
            f"5:devices:/slurm_gpu-1/uid_{uid}/job_1/step_0/task_0\n",
        )
        alice.go()
        await _until(lambda: agent.job_gpus("slurm-1-0") == ({0, 1}, True))
        summary = agent._jobs_summary()["slurm-1-0"]
        assert summary["gpus"] == [0, 1]
        assert summary["scheduler"] == {"user": "alice", "uid": 1001, "nodes": ["gpu-1", "gpu-2"]}
        await alice.told()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_a_gpu_slurm_gave_a_job_is_no_other_ranks_before_that_job_starts(
    shared_dir: Path, nvidia_smi_dir: Path
) -> None:
    """Slurm gave job 1 GPUs 0 and 1 of gpu-1 (the controller's recorded answer) and its
    ranks have not started; mallory's rank outside Slurm declares GPU 0: not hers; declaring
    GPU 5, which no Slurm job holds here, it is."""
    config = slurm_node_config(shared_dir, squeue="echo 1")  # job 1 runs on gpu-1
    source = JobSource(shared_dir / "job.sock", open_policy())
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    agent = Agent(config, Hardware(nvml=nvml), sources=[source])
    running = asyncio.create_task(agent.run())
    try:
        async with asyncio.timeout(10):
            await agent.ready.wait()
        mallory = await Ranks.start(MALLORY, shared_dir / "job.sock", "squat", hold_s=10, gpu=0)
        mallory.go()
        squat = qualified("squat", system_user(MALLORY))
        await _until(lambda: squat in source.jobs and source.jobs[squat].steps)
        await asyncio.sleep(1.0)  # collections with the declaration in
        assert agent.job_gpus(squat) == (set(), False)
        mallory.process.kill()
        await mallory.process.wait()

        mallory = await Ranks.start(MALLORY, shared_dir / "job.sock", "squat", hold_s=10, gpu=5)
        mallory.go()
        await _until(lambda: agent.job_gpus(squat) == ({5}, True))
        await mallory.told()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_a_cap_comes_off_a_gpu_once_slurm_gives_it_to_a_job(
    shared_dir: Path, nvidia_smi_dir: Path
) -> None:
    """mallory's rank outside Slurm declares GPU 0, which no Slurm job holds yet: her job's
    cap goes on it. Then Slurm gives GPUs 0 and 1 to alice's job 1 (its ``squeue`` answer
    lists job 1 from then on, before any of alice's ranks start): GPU 0 gets its default
    limit back, and mallory's job holds nothing here any more."""
    running_jobs = shared_dir / "squeue.txt"
    running_jobs.write_text("")
    config = slurm_node_config(shared_dir, squeue=f"cat {running_jobs}")
    source = JobSource(shared_dir / "job.sock", open_policy())
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    agent = Agent(config, Hardware(nvml=nvml), sources=[source])

    nvml.nvmlInit()

    def limit_w(gpu: int) -> float:
        return nvml.nvmlDeviceGetEnforcedPowerLimit(nvml.nvmlDeviceGetHandleByIndex(gpu)) / 1000

    default_w = limit_w(0)
    running = asyncio.create_task(agent.run())
    try:
        async with asyncio.timeout(10):
            await agent.ready.wait()
        mallory = await Ranks.start(
            MALLORY, shared_dir / "job.sock", "squat", hold_s=40, gpu=0, stay=True
        )
        mallory.go()
        squat = qualified("squat", system_user(MALLORY))
        await _until(lambda: agent.job_gpus(squat) == ({0}, True))
        cap_w = default_w - 50
        await agent._apply(squat, {"version": 1, "settings": {"power_cap_w": cap_w}})
        assert limit_w(0) == cap_w

        running_jobs.write_text("1\n")  # Slurm gave job 1 GPUs 0 and 1 of gpu-1
        await _until(lambda: limit_w(0) == default_w, timeout_s=30)
        assert source.attached(squat) == 1 and mallory.process.returncode is None
        assert agent.job_gpus(squat) == (set(), False)
        assert {limit_w(g) for g in range(8)} == {default_w}
        mallory.process.kill()
        await mallory.process.wait()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_a_gpu_two_jobs_declare_is_neither_jobs_by_declaration(
    shared_dir: Path, nvidia_smi_dir: Path
) -> None:
    """alice's rank declares GPU 3, then mallory's rank declares it too, and NVML shows no
    process there yet: mallory's job does not get the GPU (nor its caps) for saying so last."""
    source = JobSource(shared_dir / "job.sock", open_policy())
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    agent = Agent(slurm_node_config(shared_dir), Hardware(nvml=nvml), sources=[source])
    running = asyncio.create_task(agent.run())
    try:
        async with asyncio.timeout(10):
            await agent.ready.wait()
        sock = shared_dir / "job.sock"
        alice = await Ranks.start(ALICE, sock, "train", hold_s=20, gpu=3, stay=True)
        alice.go()
        train = qualified("train", system_user(ALICE))
        await _until(lambda: agent.job_gpus(train) == ({3}, True))
        mallory = await Ranks.start(MALLORY, sock, "squat", hold_s=20, gpu=3, stay=True)
        mallory.go()
        squat = qualified("squat", system_user(MALLORY))
        await _until(lambda: squat in source.jobs and source.jobs[squat].steps)
        await asyncio.sleep(1.0)  # collections with both declarations in
        assert agent.job_gpus(squat) == (set(), False)
        assert agent.job_gpus(train) == (set(), False)
        for ranks in (alice, mallory):
            ranks.process.kill()
            await ranks.process.wait()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

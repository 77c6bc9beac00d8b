"""Jobs found from the scheduler: the Slurm cgroups of the GPUs' processes, or a dcgm-exporter
job-mapping directory, give each job's GPUs, power and energy under its own id and user.

The parsers are checked on the lines Slurm writes; the agent runs in-process over the replay
of two Slurm jobs on one 8-GPU node (``fixtures/replay/slurm-2jobs-8gpu``, copied so a test
can end a job), and /metrics is read over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from test_agent_device_calls import scrape

from hyperagent.agent import Agent
from hyperagent.attribution import Attribution, ChannelJobs, GpuValues, JobIdentity, JobLedger
from hyperagent.capture.directory import capture_sources
from hyperagent.config import build_config
from hyperagent.errors import ConfigError
from hyperagent.job import JobReporter
from hyperagent.sources.job_mapping import MappingFormatError, parse_mapping_file, read_mapping_dir
from hyperagent.sources.slurm_cgroup import (
    CgroupFormatError,
    parse_cgroup,
    parse_environ_gpus,
    parse_status_uid,
)

from conftest import FIXTURES, REPO, ManualClock, free_port, wait_for_port

pytestmark = pytest.mark.timeout(60)

NODE = FIXTURES / "replay" / "slurm-2jobs-8gpu"
ALICE = {"job_id": "slurm-4242-0", "user": "alice", "slurm_job": "4242", "slurm_step": "0"}
BOB = {"job_id": "slurm-4243-0", "user": "bob", "slurm_job": "4243", "slurm_step": "0"}
RELEASE_AFTER_S = 1.5

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# -- parsing ---------------------------------------------------------------------------------


def test_cgroup_v2_lines_name_the_job_step() -> None:
    job = parse_cgroup("0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n")
    assert job is not None and job.job.id == "slurm-4242-0" and job.uid is None
    assert job.job.scheduler_id == "4242" and job.job.step == "0"
    batch = parse_cgroup("0::/system.slice/gpu01_slurmstepd.scope/job_7/step_batch/user/task_0")
    assert batch is not None and batch.job.id == "slurm-7-batch"
    job_level = parse_cgroup("0::/system.slice/slurmstepd.scope/job_9")
    assert job_level is not None and job_level.job.id == "slurm-9" and job_level.job.step == ""


def test_cgroup_v1_lines_name_the_job_step_and_its_owner() -> None:
    text = (
        "12:pids:/system.slice/slurmd.service\n"
        "11:devices:/slurm/uid_1001/job_4242/step_0/task_1\n"
        "4:memory:/slurm/uid_1001/job_4242/step_0/task_1\n"
        "1:name=systemd:/system.slice/slurmd.service\n"
    )
    job = parse_cgroup(text)
    assert job is not None and job.job.id == "slurm-4242-0" and job.uid == 1001
    extern = parse_cgroup("3:cpuset:/slurm_gpu01/uid_5/job_8/step_extern")
    assert extern is not None and extern.job.id == "slurm-8-extern" and extern.uid == 5


def test_processes_outside_slurm_have_no_job() -> None:
    assert parse_cgroup("0::/user.slice/user-1000.slice/session-3.scope\n") is None
    assert parse_cgroup("0::/system.slice/docker-0123abcd.scope\n") is None
    assert parse_cgroup("") is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("garbage without colons\n", "line 1 'garbage without colons'"),
        ("0::/ok\nx:y\n", "line 2"),
        ("0::/system.slice/slurmstepd.scope/job_abc/step_0", "job_abc is not a Slurm job id"),
        ("0::/system.slice/slurmstepd.scope/job_1/step_a-b", "step_a-b is not a Slurm step"),
        ("4:memory:/slurm/uid_x/job_1/step_0", "uid_x is not a uid"),
    ],
)
def test_malformed_cgroup_files_say_which_line(text: str, problem: str) -> None:
    with pytest.raises(CgroupFormatError, match=problem.replace("(", r"\(")):
        parse_cgroup(text)


def test_status_and_environment() -> None:
    assert parse_status_uid("Name:\tpython\nUid:\t1001\t1001\t1001\t1001\n") == 1001
    assert parse_status_uid("Name:\tpython\n") is None
    env = b"CUDA_VISIBLE_DEVICES=0,1\0SLURM_JOB_GPUS=4,5,6,7\0SLURM_STEP_GPUS=4,5\0"
    assert parse_environ_gpus(env) == ("4", "5")
    assert parse_environ_gpus(b"SLURM_JOB_GPUS=4,5,6,7\0CUDA_VISIBLE_DEVICES=0\0") == (
        "4",
        "5",
        "6",
        "7",
    )
    assert parse_environ_gpus(b"CUDA_VISIBLE_DEVICES=GPU-a1,GPU-b2\0") == ("GPU-a1", "GPU-b2")
    assert parse_environ_gpus(b"HOME=/root\0") is None


def test_mapping_files_as_dcgm_exporter_reads_them(tmp_path: Path) -> None:
    assert parse_mapping_file("3", "4242\n\n4243\n4242\n") == (
        "3",
        (parse_mapping_file("0", "4242")[1][0], parse_mapping_file("0", "4243")[1][0]),
    )
    gpu, jobs = parse_mapping_file("3.1", "my.job-7\n")
    assert gpu == "3" and jobs[0].id == "my-job-7" and jobs[0].scheduler == "given"
    with pytest.raises(MappingFormatError, match="notes: not a GPU index"):
        parse_mapping_file("notes", "4242")
    with pytest.raises(MappingFormatError, match="2 line 2: 'job 1' is not a job id"):
        parse_mapping_file("2", "4242\njob 1\n")
    (tmp_path / "0").write_text("4242\n")
    (tmp_path / "1.0").write_text("4243\n")
    (tmp_path / "README").write_text("prolog writes here\n")
    (tmp_path / "2").write_text("")
    read = read_mapping_dir(tmp_path)
    assert {g: [j.id for j in jobs] for g, jobs in read.gpus.items()} == {
        "0": ["slurm-4242"],
        "1": ["slurm-4243"],
        "2": [],
    }
    assert read.problems == (f"{tmp_path}/README: not a GPU index or GPU.MIG index",)
    assert read_mapping_dir(tmp_path / "absent").gpus == {}


def test_config_names_the_attribution_key() -> None:
    with pytest.raises(ConfigError, match="mapping_dir"):
        build_config({"attribution": {"mode": "mapping"}})
    with pytest.raises(ConfigError, match=r"attribution\.mode"):
        build_config({"attribution": {"mode": "slurm"}})
    assert build_config({}).attribution.mode == "cgroup"


# -- the ledger ------------------------------------------------------------------------------


def _gpus(energy: dict[str, float]) -> dict[str, GpuValues]:
    return {g: GpuValues(uuid=f"GPU-{g}", power=100.0, energy=e) for g, e in energy.items()}


def test_a_shared_gpu_gives_each_job_its_share_and_the_energies_add_up() -> None:
    clock = ManualClock()
    ledger = JobLedger(release_after_s=10.0, max_jobs=4, clock=clock)
    a, b = JobIdentity("a", "alice"), JobIdentity("b", "bob")
    ledger.hold({"a": (a, frozenset({"0", "1"})), "b": (b, frozenset({"1"}))})
    ledger.readings(_gpus({"0": 1000.0, "1": 5000.0}), None)
    out = ledger.readings(_gpus({"0": 1100.0, "1": 5200.0}), None)
    energy = {r.labels["job_id"]: r.value for r in out if r.name.endswith("energy_joules_total")}
    assert energy == {"a": 100.0 + 100.0, "b": 100.0}
    assert sum(energy.values()) == 300.0


def test_an_ended_job_keeps_its_counter_until_released_and_a_job_back_in_time_resumes() -> None:
    clock = ManualClock()
    ledger = JobLedger(release_after_s=10.0, max_jobs=2, clock=clock)
    a = JobIdentity("a")
    ledger.hold({"a": (a, frozenset({"0"}))})
    ledger.readings(_gpus({"0": 0.0}), None)
    ledger.readings(_gpus({"0": 50.0}), None)
    ledger.hold({})
    clock.now = 9.0
    out = {r.name: r.value for r in ledger.readings(_gpus({"0": 80.0}), None)}
    assert out == {"hyperagent_job_gpus": 0.0, "hyperagent_job_gpu_energy_joules_total": 50.0}
    ledger.hold({"a": (a, frozenset({"0"}))})  # back before its release: the same counter
    ledger.readings(_gpus({"0": 90.0}), None)
    ledger.hold({})
    clock.now = 18.9
    assert [r.value for r in ledger.readings(_gpus({"0": 95.0}), None)] == [0.0, 60.0]
    clock.now = 19.0
    assert ledger.readings(_gpus({"0": 95.0}), None) == []


def test_jobs_are_bounded_and_an_ended_one_makes_room(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    ledger = JobLedger(release_after_s=600.0, max_jobs=2, clock=clock)
    held = {j: (JobIdentity(j), frozenset({str(i)})) for i, j in enumerate("abc")}
    ledger.hold({"a": held["a"], "b": held["b"]})
    with caplog.at_level(logging.WARNING):
        ledger.hold(held)
        ledger.hold(held)
    assert set(ledger.jobs) == {"a", "b"}
    assert caplog.text.count("not attributing c") == 1
    ledger.hold({"b": held["b"], "c": held["c"]})  # a ended: c takes its slot at once
    assert set(ledger.jobs) == {"b", "c"}


def test_a_stream_of_short_jobs_stays_bounded_and_every_joule_goes_to_one_job() -> None:
    """Churn: 200 short jobs one after another on GPU 0 (each seen for 3 cycles, then gone)
    under max_jobs 4: never more than 4 kept, each job's energy what GPU 0 used while it
    held it, their sum the GPU's."""
    clock = ManualClock()
    ledger = JobLedger(release_after_s=5.0, max_jobs=4, clock=clock)
    energy, most = 0.0, 0
    finals: dict[str, float] = {}
    for generation in range(200):
        job = f"slurm-{1000 + generation}-0"
        for _ in range(3):
            ledger.hold({job: (JobIdentity(job), frozenset({"0"}))})
            clock.now += 1.0
            energy += 250.0
            out = ledger.readings({"0": GpuValues("GPU-0", energy=energy)}, None)
            most = max(most, len(ledger.jobs))
            finals.update(
                {r.labels["job_id"]: r.value for r in out if r.name.endswith("_joules_total")}
            )
    assert most <= 4
    assert finals["slurm-1000-0"] == 500.0  # first cycle is its baseline
    assert all(finals[f"slurm-{1000 + g}-0"] == 750.0 for g in range(1, 200))
    assert sum(finals.values()) == energy - 250.0


# -- the agent over the replay ---------------------------------------------------------------


def per_job(samples: Samples, name: str) -> dict[str, float]:
    return {dict(k)["job_id"]: v for (n, k), v in samples.items() if n == name}


def per_gpu(samples: Samples, name: str) -> dict[str, float]:
    return {dict(k)["gpu"]: v for (n, k), v in samples.items() if n == name}


async def until(predicate: Any, timeout_s: float = 15.0, every_s: float = 0.1) -> Any:
    async with asyncio.timeout(timeout_s):
        while not (found := predicate()):
            await asyncio.sleep(every_s)
    return found


@contextlib.asynccontextmanager
async def replayed(
    tmp_path: Path, attribution: dict[str, Any], **sources: Any
) -> AsyncIterator[tuple[Agent, int, Path]]:
    """The agent over a copy of the two-job node (its ``proc/`` and ``job-mapping/`` may be
    changed by the test), serving /metrics on a free port; yields the agent, its port and
    the copy."""
    node = tmp_path / "node"
    shutil.copytree(NODE, node)
    port = free_port()
    config = build_config(
        {
            "node": "gpu01",
            "mqtt": {"enabled": False},
            "agent": {
                "interval_s": 0.2,
                "metrics_address": f"127.0.0.1:{port}",
                "state_dir": str(tmp_path / "state"),
            },
            "attribution": {"interval_s": 0.2, **attribution},
            "sources": {
                "job": {"release_after_s": RELEASE_AFTER_S, "socket": str(tmp_path / "job.sock")},
                **sources,
            },
        }
    )
    found, hardware = capture_sources(node, config)
    agent = Agent.from_config(config, hardware, sources=found)
    task = asyncio.create_task(agent.run(), name="replayed-slurm-node")
    try:
        await asyncio.wait_for(agent.ready.wait(), timeout=20)
        yield agent, port, node
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def labels_of(samples: Samples, job: str) -> dict[str, str]:
    (labels,) = {
        k
        for (n, k), _ in samples.items()
        if n == "hyperagent_job_gpus" and dict(k)["job_id"] == job
    }
    return dict(labels)


async def check_two_jobs(port: int, alice: dict[str, str], bob: dict[str, str]) -> Samples:
    """Both jobs on /metrics with their 4 GPUs, power and energy; the energies add up."""

    def both() -> Samples | None:
        samples = scrape(port)
        return samples if len(per_job(samples, "hyperagent_job_gpus")) == 2 else None

    first = await until(both)
    await asyncio.sleep(1.0)  # energy accumulates
    samples = scrape(port)
    assert labels_of(samples, alice["job_id"]) == alice
    assert labels_of(samples, bob["job_id"]) == bob
    owners = {
        dict(k)["gpu"]: dict(k)["job_id"]
        for (n, k), _ in samples.items()
        if n == "hyperagent_gpu_job_info"
    }
    assert owners == {str(g): alice["job_id"] if g < 4 else bob["job_id"] for g in range(8)}
    gpus = per_job(samples, "hyperagent_job_gpus")
    assert gpus == {alice["job_id"]: 4.0, bob["job_id"]: 4.0}
    power = per_gpu(samples, "hyperagent_gpu_power_watts")
    job_power = per_job(samples, "hyperagent_job_gpu_power_watts")
    assert job_power[alice["job_id"]] == pytest.approx(sum(power[str(g)] for g in range(4)))
    assert job_power[bob["job_id"]] == pytest.approx(sum(power[str(g)] for g in range(4, 8)))
    utilization = per_gpu(samples, "hyperagent_gpu_utilization_ratio")
    job_utilization = per_job(samples, "hyperagent_job_gpu_utilization_ratio")
    assert job_utilization[bob["job_id"]] == pytest.approx(
        sum(utilization[str(g)] for g in range(4, 8)) / 4
    )
    memory = per_gpu(samples, "hyperagent_gpu_memory_used_bytes")
    assert per_job(samples, "hyperagent_job_gpu_memory_used_bytes")[alice["job_id"]] == (
        pytest.approx(sum(memory[str(g)] for g in range(4)))
    )
    energy = per_job(samples, "hyperagent_job_gpu_energy_joules_total")
    total = sum(per_gpu(samples, "hyperagent_gpu_energy_joules_total").values())
    assert energy[alice["job_id"]] > 0 and energy[bob["job_id"]] > 0
    # the GPUs' counters count from the driver's start, the jobs' from when they were found:
    # what the GPUs used since then is what the jobs used
    jobs_before = sum(per_job(first, "hyperagent_job_gpu_energy_joules_total").values())
    total_before = sum(per_gpu(first, "hyperagent_gpu_energy_joules_total").values())
    assert total - total_before > 500.0  # 984 W on the 8 GPUs
    assert sum(energy.values()) - jobs_before == pytest.approx(total - total_before, rel=0.01)
    assert sum(energy.values()) <= total
    assert energy[alice["job_id"]] > energy[bob["job_id"]]  # GPUs 0-3 draw 651 W, 4-7 333 W
    assert "hyperagent_job_node_power_watts" not in {n for n, _ in samples}
    return samples


async def check_released(port: int, ended: str, live: str) -> None:
    """``ended`` shows 0 GPUs and its final energy for ``release_after_s``, then its series
    go; ``live`` goes on."""
    ended_gpus = await until(lambda: per_job(scrape(port), "hyperagent_job_gpus").get(ended) == 0.0)
    assert ended_gpus
    loop = asyncio.get_running_loop()
    ended_at = loop.time()
    final = per_job(scrape(port), "hyperagent_job_gpu_energy_joules_total")[ended]
    gone_at = None
    while loop.time() - ended_at < RELEASE_AFTER_S + 5:
        samples = scrape(port)
        energy = per_job(samples, "hyperagent_job_gpu_energy_joules_total")
        if ended not in energy:
            gone_at = loop.time()
            break
        assert energy[ended] == final
        assert not any(
            dict(k)["job_id"] == ended
            for (n, k), _ in samples.items()
            if n != "hyperagent_job_gpus"
            and n != "hyperagent_job_gpu_energy_joules_total"
            and "job_id" in dict(k)
        )
        await asyncio.sleep(0.1)
    assert gone_at is not None, f"{ended} was never released"
    assert RELEASE_AFTER_S - 0.5 <= gone_at - ended_at <= RELEASE_AFTER_S + 1.0
    samples = scrape(port)
    assert not any(dict(k).get("job_id") == ended for _, k in samples)
    assert per_job(samples, "hyperagent_job_gpus") == {live: 4.0}


async def test_two_slurm_jobs_from_their_cgroups(tmp_path: Path) -> None:
    async with replayed(tmp_path, {"mode": "cgroup"}) as (agent, port, node):
        await check_two_jobs(port, ALICE, BOB)
        for pid in range(52101, 52105):  # bob's job ends: its processes go
            shutil.rmtree(node / "proc" / str(pid))
        for gpu in range(4, 8):
            agent.hardware.nvml.set_processes(gpu, [])
        await check_released(port, "slurm-4243-0", "slurm-4242-0")


async def test_a_cgroup_v1_node_names_the_owner_in_the_path(tmp_path: Path) -> None:
    """The same node under Slurm's cgroup/v1 plugin, and an agent that may not read the
    processes' status (the uid comes from ``uid_<uid>`` in the path)."""
    node = tmp_path / "v1"
    shutil.copytree(NODE, node)
    for folder in (node / "proc").iterdir():
        parts = (folder / "cgroup").read_text().strip().split("/")
        job, step, task = parts[3], parts[4], parts[6]
        uid = "1001" if job == "job_4242" else "1002"
        lines = [
            f"{n}:{controller}:/slurm/uid_{uid}/{job}/{step}/{task}"
            for n, controller in ((11, "devices"), (7, "memory"), (3, "cpuset"), (2, "freezer"))
        ]
        (folder / "cgroup").write_text("\n".join(lines) + "\n1:name=systemd:/system.slice\n")
        (folder / "status").unlink()
    async with replayed(tmp_path, {"mode": "cgroup", "proc_root": str(node / "proc")}) as (
        _,
        port,
        _node,
    ):
        await check_two_jobs(port, ALICE, BOB)


def _node_copy(tmp_path: Path, name: str) -> Path:
    node = tmp_path / name
    shutil.copytree(NODE, node)
    return node


def _edit_environ(folder: Path, **values: str | None) -> None:
    """Set (or, for None, remove) variables of a fixture process's ``environ``."""
    entries = [e for e in (folder / "environ").read_bytes().split(b"\0") if e]
    kept = [e for e in entries if e.split(b"=", 1)[0].decode() not in values]
    kept += [f"{k}={v}".encode() for k, v in values.items() if v is not None]
    (folder / "environ").write_bytes(b"\0".join(kept) + b"\0")


async def test_a_slurm_26_05_node_names_its_jobs_by_sluid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Slurm 26.05 names a job's cgroup v2 directory by its SLUID (the SLUIDs of
    fixtures/slurm-cgroup): both jobs are attributed, under their SLUIDs, and the log says
    once why they are not job numbers. Before, no job was found and nothing was logged."""
    caplog.set_level(logging.WARNING, logger="hyperagent.attribution")
    node = _node_copy(tmp_path, "v2605")
    sluids = {"job_4242": "s5K1KKYAYG5D00", "job_4243": "sEKNKTV3WPV500"}
    for folder in (node / "proc").iterdir():
        text = (folder / "cgroup").read_text()
        for job, sluid in sluids.items():
            text = text.replace(f"/{job}/", f"/{sluid}/")
        (folder / "cgroup").write_text(text)
    alice = {**ALICE, "job_id": "slurm-s5K1KKYAYG5D00-0", "slurm_job": "s5K1KKYAYG5D00"}
    bob = {**BOB, "job_id": "slurm-sEKNKTV3WPV500-0", "slurm_job": "sEKNKTV3WPV500"}
    async with replayed(tmp_path, {"mode": "cgroup", "proc_root": str(node / "proc")}) as (
        _,
        port,
        _node,
    ):
        await check_two_jobs(port, alice, bob)
    assert caplog.text.count("names this node's job cgroups by SLUID") == 1
    assert "CgroupJobIdPaths=yes" in caplog.text


async def test_a_cgroup_v1_job_line_before_the_step_lines_gives_the_step(tmp_path: Path) -> None:
    """cgroup v1 with each process's devices line stopping at its job, before the lines that go
    down to the step: the jobs are their steps (before: ``slurm-4242``, ``slurm-4243``)."""
    node = _node_copy(tmp_path, "v1-job-lines")
    for folder in (node / "proc").iterdir():
        parts = (folder / "cgroup").read_text().strip().split("/")
        job, step, task = parts[3], parts[4], parts[6]
        uid = "1001" if job == "job_4242" else "1002"
        lines = [f"11:devices:/slurm/uid_{uid}/{job}"]
        lines += [f"{n}:{c}:/slurm/uid_{uid}/{job}/{step}/{task}" for n, c in ((7, "memory"),)]
        lines += [f"3:cpuset:/slurm/uid_{uid}/{job}/{step}", "1:name=systemd:/system.slice"]
        (folder / "cgroup").write_text("\n".join(lines) + "\n")
    async with replayed(tmp_path, {"mode": "cgroup", "proc_root": str(node / "proc")}) as (
        _,
        port,
        _node,
    ):
        await check_two_jobs(port, ALICE, BOB)


async def test_environment_gpus_that_nvml_shows_another_job_on_are_not_given(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """alice's rank 0 says SLURM_STEP_GPUS=0,1,2,3,5,6 and bob's rank 0 says 0,1,4,5,6,7:
    NVML shows bob's processes on GPUs 5 and 6 and alice's on 0 and 1, so each job keeps its
    own four GPUs and no energy is split (before: alice credited GPUs 5 and 6 she never
    touched, both jobs "holding" GPUs 0, 1, 5 and 6)."""
    caplog.set_level(logging.WARNING, logger="hyperagent.attribution")
    node = _node_copy(tmp_path, "env-gpus")
    proc = node / "proc"
    _edit_environ(proc / "51001", SLURM_STEP_GPUS="0,1,2,3,5,6", SLURM_JOB_GPUS="0,1,2,3,5,6")
    _edit_environ(proc / "52101", SLURM_STEP_GPUS="0,1,4,5,6,7")
    async with replayed(tmp_path, {"mode": "cgroup", "proc_root": str(proc)}) as (_, port, _n):
        await check_two_jobs(port, ALICE, BOB)
    assert caplog.text.count("pid 51001 of slurm-4242-0 names GPU(s) 5, 6") == 1
    assert "where NVML shows slurm-4243-0: not given to slurm-4242-0" in caplog.text
    assert caplog.text.count("pid 52101 of slurm-4243-0 names GPU(s) 0, 1") == 1


async def test_cuda_visible_devices_counts_from_the_job_s_own_gpus(tmp_path: Path) -> None:
    """bob's step sees its GPUs 4-7 as CUDA_VISIBLE_DEVICES=0,1,2,3 (ConstrainDevices), and
    his processes' environments hold no SLURM_*_GPUS; alice's job has ended, GPUs 0-3 are idle.
    bob's job holds GPUs 4-7 (before: 0-7, the indices taken as the node's)."""
    node = _node_copy(tmp_path, "visible")
    proc = node / "proc"
    for pid in range(51001, 51005):
        shutil.rmtree(proc / str(pid))
    for pid in range(52101, 52105):
        _edit_environ(proc / str(pid), SLURM_STEP_GPUS=None, SLURM_JOB_GPUS=None)
    async with replayed(tmp_path, {"mode": "cgroup", "proc_root": str(proc)}) as (
        agent,
        port,
        _n,
    ):
        for gpu in range(4):
            agent.hardware.nvml.set_processes(gpu, [])
        await until(lambda: per_job(scrape(port), "hyperagent_job_gpus") == {BOB["job_id"]: 4})
        await asyncio.sleep(0.6)  # a few attribution rounds: still GPUs 4-7
        samples = scrape(port)
        assert per_job(samples, "hyperagent_job_gpus") == {BOB["job_id"]: 4.0}
        info = {dict(k)["gpu"] for (n, k), _ in samples.items() if n == "hyperagent_gpu_job_info"}
        assert info == {"4", "5", "6", "7"}


async def test_a_gpu_declared_where_nvml_shows_another_job_is_not_the_rank_s(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank (this test process, job ``squat``) declares GPU 0 in its hello, where NVML shows
    alice's Slurm job: GPU 0 stays alice's alone and the rank's job holds no GPU, so the two
    jobs' GPUs do not overlap (before: both held GPU 0 and split its energy)."""
    caplog.set_level(logging.WARNING, logger="hyperagent.attribution")
    async with replayed(tmp_path, {"mode": "cgroup"}) as (agent, port, _node):
        reporter = JobReporter("squat", rank=0, socket_path=tmp_path / "job.sock", gpu=0)
        try:
            reporter.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)
            source = agent.job_source
            assert source is not None
            await until(lambda: source.declared_gpus() != {})
            (job,) = set(source.declared_gpus().values())
            await until(lambda: f"{job} declared GPU 0" in caplog.text)
            collections = agent.collections
            await until(lambda: agent.collections > collections + 3)
            samples = scrape(port)
            assert job not in per_job(samples, "hyperagent_job_gpus")
            owners = [
                dict(k)["job_id"]
                for (n, k), _ in samples.items()
                if n == "hyperagent_gpu_job_info" and dict(k)["gpu"] == "0"
            ]
            assert owners == [ALICE["job_id"]]
            assert per_job(samples, "hyperagent_job_gpus")[ALICE["job_id"]] == 4.0
            assert agent.job_gpus(job) == (set(), False)
        finally:
            reporter.close()
    assert f"{job} declared GPU 0, where NVML shows slurm-4242-0: not its GPU" in caplog.text


def _process(proc: Path, pid: int, uid: int, cgroup: str = "0::/user.slice\n") -> None:
    folder = proc / str(pid)
    folder.mkdir(parents=True)
    (folder / "cgroup").write_text(cgroup)
    (folder / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")


async def test_a_declared_gpu_counts_where_nvml_does_not_put_it_with_another(
    tmp_path: Path,
) -> None:
    """Which declared GPUs count: NVML shows alice's Slurm job on GPU 0 and mallory's own
    process (no job) on GPU 2, nobody on GPU 1, a process the agent cannot see on GPU 3."""
    proc = tmp_path / "proc"
    _process(proc, 100, 1001, "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n")
    _process(proc, 200, 1003)
    attribution = Attribution("cgroup", JobLedger(60.0, 16), proc_root=proc, users=str)
    await attribution.poll({"0": [100], "1": [], "2": [200], "3": [300]}, [1003, 1004])
    channel = ChannelJobs(
        pids={900: "mallory-a", 901: "mallory-b", 902: "eve", 903: "mallory-c"},
        declared={0: "mallory-a", 1: "mallory-b", 2: "eve", 3: "mallory-c"},
        owners={"mallory-a": 1003, "mallory-b": 1003, "eve": 1004, "mallory-c": 1003},
    )
    held = {j: set(g) for j, (_, g) in attribution.holders(channel, {}).items()}
    assert held == {
        "slurm-4242-0": {"0"},  # NVML's processes win
        "mallory-b": {"1"},  # no process there: NVML cannot tell, the hello can
        "mallory-c": {"3"},  # a process the agent cannot see says nothing either way
    }
    channel.declared[2] = "mallory-b"  # her own process is on GPU 2: it agrees
    held = {j: set(g) for j, (_, g) in attribution.holders(channel, {}).items()}
    assert held["mallory-b"] == {"1", "2"}


async def test_a_declared_gpu_the_mapping_gives_another_slurm_job_is_not_the_rank_s(
    tmp_path: Path,
) -> None:
    mapping = tmp_path / "job-mapping"
    mapping.mkdir()
    (mapping / "5").write_text("4243\n")
    attribution = Attribution(
        "mapping", JobLedger(60.0, 16), proc_root=tmp_path, mapping_dir=mapping, users=str
    )
    await attribution.poll({"5": []}, [])
    channel = ChannelJobs(pids={900: "squat"}, declared={5: "squat"}, owners={"squat": 1003})
    held = {j: set(g) for j, (_, g) in attribution.holders(channel, {}).items()}
    assert held == {"slurm-4243": {"5"}}
    channel = ChannelJobs(
        pids={901: "slurm-4243-0"}, declared={5: "slurm-4243-0"}, owners={"slurm-4243-0": 1002}
    )
    held = {j: set(g) for j, (_, g) in attribution.holders(channel, {}).items()}
    assert held == {"slurm-4243-0": {"5"}}  # the mapping's job is the rank's: one job


async def test_the_same_from_a_job_mapping_directory(tmp_path: Path) -> None:
    alice = {"job_id": "slurm-4242", "user": "alice", "slurm_job": "4242", "slurm_step": ""}
    bob = {"job_id": "slurm-4243", "user": "bob", "slurm_job": "4243", "slurm_step": ""}
    mapping = tmp_path / "node" / "job-mapping"
    async with replayed(tmp_path, {"mode": "mapping", "mapping_dir": str(mapping)}) as (
        _,
        port,
        _node,
    ):
        await check_two_jobs(port, alice, bob)
        for gpu in range(4, 8):  # the epilog empties bob's files
            (mapping / str(gpu)).write_text("")
        await check_released(port, "slurm-4243", "slurm-4242")


async def test_a_job_alone_on_the_node_gets_the_node_s_power(tmp_path: Path) -> None:
    async with replayed(tmp_path, {"mode": "cgroup"}) as (agent, port, node):
        for pid in range(52101, 52105):
            shutil.rmtree(node / "proc" / str(pid))
        for gpu in range(4, 8):
            agent.hardware.nvml.set_processes(gpu, [51005])  # alice's step takes every GPU
        shutil.copytree(node / "proc" / "51001", node / "proc" / "51005")
        env = (node / "proc" / "51005" / "environ").read_bytes()
        env = env.replace(b"SLURM_STEP_GPUS=0,1,2,3", b"SLURM_STEP_GPUS=0,1,2,3,4,5,6,7")
        (node / "proc" / "51005" / "environ").write_bytes(env)
        await until(lambda: per_job(scrape(port), "hyperagent_job_gpus") == {"slurm-4242-0": 8})
        # no BMC or PDU in this capture: the node's power is unknown, so it is absent
        assert "hyperagent_job_node_power_watts" not in {n for n, _ in scrape(port)}
    ledger = JobLedger(600.0, 4)
    ledger.hold({"a": (JobIdentity("a"), frozenset({"0", "1"}))})
    names = {r.name: r.value for r in ledger.readings(_gpus({"0": 1.0, "1": 1.0}), 812.0)}
    assert names["hyperagent_job_node_power_watts"] == 812.0
    ledger.hold(
        {
            "a": (JobIdentity("a"), frozenset({"0"})),
            "b": (JobIdentity("b"), frozenset({"1"})),
        }
    )
    names = {r.name for r in ledger.readings(_gpus({"0": 1.0, "1": 1.0}), 812.0)}
    assert "hyperagent_job_node_power_watts" not in names


@pytest.mark.parametrize("mode", ["cgroup", "mapping"])
async def test_a_job_reporter_job_in_a_slurm_cgroup_is_one_job(tmp_path: Path, mode: str) -> None:
    """This test process is a rank of Slurm job 4244 step 0 (its id from SLURM_JOB_ID and
    SLURM_STEP_ID), on GPU 4 in NVML, in job 4244's cgroup in the proc tree (and GPU 4's
    mapping file): one job, under the rank's id, with its user and Slurm labels."""
    pid, uid = os.getpid(), os.getuid()
    user = pwd.getpwuid(uid).pw_name
    attribution: dict[str, Any] = {"mode": mode}
    if mode == "mapping":
        attribution["mapping_dir"] = str(tmp_path / "node" / "job-mapping")
    async with replayed(tmp_path, attribution) as (agent, port, node):
        for gpu in range(4, 8):
            agent.hardware.nvml.set_processes(gpu, [pid] if gpu == 4 else [])
            (node / "job-mapping" / str(gpu)).write_text("4244\n" if gpu == 4 else "")
        mine = node / "proc" / str(pid)
        mine.mkdir()
        (mine / "cgroup").write_text(
            "0::/system.slice/slurmstepd.scope/job_4244/step_0/user/task_0\n"
        )
        (mine / "status").write_text(
            f"Name:\tpython\nPid:\t{pid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
        )
        env = {"SLURM_JOB_ID": "4244", "SLURM_STEP_ID": "0"}
        reporter = JobReporter(socket_path=tmp_path / "job.sock", environ=env)
        try:
            reporter.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)
            expected = {"slurm-4242" + ("-0" if mode == "cgroup" else ""), "slurm-4244-0"}
            await until(lambda: set(per_job(scrape(port), "hyperagent_job_gpus")) == expected)
            await asyncio.sleep(0.6)  # a few attribution rounds: still one job
            samples = scrape(port)
            assert set(per_job(samples, "hyperagent_job_gpus")) == expected
            assert per_job(samples, "hyperagent_job_gpus")["slurm-4244-0"] == 1.0
            labels = labels_of(samples, "slurm-4244-0")
            assert labels["slurm_job"] == "4244" and labels["slurm_step"] == "0"
            assert labels["user"] in (user, str(uid))
            info = [dict(k) for (n, k), _ in samples.items() if n == "hyperagent_gpu_job_info"]
            assert [i["job_id"] for i in info if i["gpu"] == "4"] == ["slurm-4244-0"]
            assert ("hyperagent_job_steps_total", frozenset({("job_id", "slurm-4244-0")})) in (
                samples
            )
        finally:
            reporter.close()


async def test_malformed_cgroups_and_mapping_files_are_logged_and_the_agent_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="hyperagent.attribution")
    node_copy = tmp_path / "cgroup"
    node_copy.mkdir()
    async with replayed(node_copy, {"mode": "cgroup"}) as (agent, port, node):
        await until(lambda: len(per_job(scrape(port), "hyperagent_job_gpus")) == 2)
        agent.hardware.nvml.set_processes(7, [52104, 52105])  # a pid seen anew: read again
        (node / "proc" / "52105").mkdir()
        (node / "proc" / "52105" / "cgroup").write_text("also garbage\n")
        await until(lambda: "52105/cgroup" in caplog.text)
        collections = agent.collections
        await until(lambda: agent.collections > collections + 3)
        assert per_job(scrape(port), "hyperagent_job_gpus") == {
            "slurm-4242-0": 4.0,
            "slurm-4243-0": 4.0,  # bob's other ranks still say GPU 7 is his
        }
    assert "also garbage" in caplog.text and "is not hierarchy-ID:controllers:path" in caplog.text
    assert caplog.text.count("52105/cgroup") == 1
    caplog.clear()
    mapped = tmp_path / "mapping"
    mapped.mkdir()
    mapping = mapped / "node" / "job-mapping"
    async with replayed(mapped, {"mode": "mapping", "mapping_dir": str(mapping)}) as (
        agent,
        port,
        node,
    ):
        await until(lambda: len(per_job(scrape(port), "hyperagent_job_gpus")) == 2)
        (mapping / "7").write_text("4243\nnot a job\n")
        (mapping / "gpu-eight").write_text("4243\n")
        await until(lambda: "7 line 2" in caplog.text and "gpu-eight" in caplog.text)
        await until(lambda: per_job(scrape(port), "hyperagent_job_gpus").get("slurm-4243") == 3)
        collections = agent.collections
        await until(lambda: agent.collections > collections + 3)
    assert caplog.text.count("gpu-eight") == 1


@pytest.mark.parametrize("config", [None, NODE / "mapping.toml"], ids=["cgroup", "mapping"])
def test_the_readme_commands_replay_both_jobs(config: Path | None) -> None:
    """``hyperagent agent --replay fixtures/replay/slurm-2jobs-8gpu --no-broker`` (and with
    its ``mapping.toml``), run from the checkout as the README says."""
    port = free_port()
    command = [sys.executable, "-m", "hyperagent.cli", "agent", "--replay", str(NODE)]
    command += ["--no-broker", "--metrics-address", f"127.0.0.1:{port}", "--interval", "0.2"]
    command += ["--config", str(config)] if config else []
    agent = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE)
    try:
        wait_for_port(port, 30)
        deadline = time.monotonic() + 20
        jobs: dict[str, float] = {}
        while time.monotonic() < deadline and len(jobs) < 2:
            jobs = per_job(scrape(port), "hyperagent_job_gpus")
            time.sleep(0.1)
        step = "-0" if config is None else ""
        assert jobs == {f"slurm-4242{step}": 4.0, f"slurm-4243{step}": 4.0}
        users = {
            dict(k)["user"] for (n, k), _ in scrape(port).items() if n == "hyperagent_job_gpus"
        }
        assert users == {"alice", "bob"}
    finally:
        agent.terminate()
        _, stderr = agent.communicate(timeout=20)
    assert b"Traceback" not in stderr, stderr.decode()[-2000:]

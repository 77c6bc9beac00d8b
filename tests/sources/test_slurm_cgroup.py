"""Slurm's cgroup layouts as ``/proc/<pid>/cgroup`` shows them: cgroup v1 (one line per
controller, some stopping at the job), cgroup v2 with ``job_<id>`` directories, Slurm 26.05's
SLUID directories, the multiple-slurmd scopes and ``CgroupSlice``; and the GPUs a process's
environment names, ``CUDA_VISIBLE_DEVICES`` read relative to the job's GPUs.

The layouts are ``fixtures/slurm-cgroup`` (written from Slurm's documentation and source, not
recorded: its SOURCES.md), checked against its ``expected.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hyperagent.sources.slurm_cgroup import (
    CgroupFormatError,
    parse_cgroup,
    parse_environ_gpus,
    parse_environ_slurm_gpus,
    parse_environ_visible,
    read_process,
    visible_gpus,
)

from conftest import FIXTURES

LAYOUTS = FIXTURES / "slurm-cgroup"
EXPECTED: dict[str, Any] = json.loads((LAYOUTS / "expected.json").read_text())


def test_every_layout_file_has_its_expectation() -> None:
    assert sorted(p.name for p in LAYOUTS.glob("*.cgroup")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_documented_layout_names_its_job(name: str) -> None:
    text = (LAYOUTS / name).read_text()
    expected = EXPECTED[name]
    if expected is not None and "error" in expected:
        with pytest.raises(CgroupFormatError, match=expected["error"].replace(".", r"\.")):
            parse_cgroup(text)
        return
    found = parse_cgroup(text)
    if expected is None:
        assert found is None
        return
    assert found is not None
    got = {
        "job": found.job.id,
        "slurm_job": found.job.scheduler_id,
        "step": found.job.step,
        "uid": found.uid,
        "sluid": found.sluid,
    }
    assert got == expected
    assert found.job.scheduler == "slurm"


def test_a_step_line_wins_over_a_job_line_before_it() -> None:
    """cgroup v1: the devices line stops at the job, the memory line goes to the step; the
    first line naming the job used to win (``slurm-518``)."""
    text = "11:devices:/slurm/uid_1001/job_518\n7:memory:/slurm/uid_1001/job_518/step_0/task_0\n"
    job = parse_cgroup(text)
    assert job is not None and job.job.id == "slurm-518-0" and job.uid == 1001
    # the other order, and a job-level line alone
    flipped = "\n".join(reversed(text.strip().splitlines()))
    assert (found := parse_cgroup(flipped)) is not None and found.job.id == "slurm-518-0"
    alone = parse_cgroup("11:devices:/slurm/uid_1001/job_518\n")
    assert alone is not None and alone.job.id == "slurm-518" and alone.job.step == ""


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "11:devices:/slurm/uid_1001/job_518/step_0\n7:memory:/slurm/uid_1002/job_519/step_0\n",
            "lines 1 and 2 name two Slurm jobs, 518 and 519",
        ),
        (
            "11:devices:/slurm/uid_1001/job_518\n7:memory:/slurm/uid_1003/job_4242/step_0\n",
            "name two Slurm jobs, 518 and 4242",
        ),
        (
            "11:devices:/slurm/uid_1001/job_518/step_0\n7:memory:/slurm/uid_1001/job_518/step_1\n",
            "name two steps of job 518, 0 and 1",
        ),
        (
            "11:devices:/slurm/uid_1001/job_518/step_0\n7:memory:/slurm/uid_1002/job_518/step_0\n",
            "name two owners of job 518, uid 1001 and uid 1002",
        ),
        (  # a hybrid host: the unified line and a v1 line disagree
            "7:memory:/slurm/uid_1001/job_518/step_0\n"
            "0::/system.slice/slurmstepd.scope/job_519/step_0/user/task_0\n",
            "name two Slurm jobs, 518 and 519",
        ),
        (
            "0::/system.slice/slurmstepd.scope/s5k1kkyayg5d00/step_0/user/task_0\n",
            "'s5k1kkyayg5d00' under the slurmstepd scope is neither job_<id> nor a SLUID",
        ),
        (
            "0::/system.slice/slurmstepd.scope/job_/step_0\n",
            "job_ is not a Slurm job id",
        ),
        (
            "4:memory:/user.slice/user-1003.slice/user@1003.service/slurm/uid_1001/job_4242/step_0",
            "under user@1003.service, which its user may create",
        ),
    ],
)
def test_lines_that_disagree_or_that_slurm_does_not_make_are_refused(
    text: str, problem: str
) -> None:
    with pytest.raises(CgroupFormatError, match=problem.replace("(", r"\(").replace(".", r"\.")):
        parse_cgroup(text)


def test_a_sluid_the_scheduler_resolved_is_its_job_id() -> None:
    text = (LAYOUTS / "v2605-sluid-step0-task0.cgroup").read_text()
    job = parse_cgroup(text, {"s5K1KKYAYG5D00": "3385"})
    assert job is not None and job.job.id == "slurm-3385-0" and job.sluid == "s5K1KKYAYG5D00"
    assert job.job.scheduler_id == "3385"
    other = parse_cgroup(text, {"sEKNKTV3WPV500": "123"})
    assert other is not None and other.job.id == "slurm-s5K1KKYAYG5D00-0"


def test_paths_that_only_look_like_slurm_s_elsewhere_are_not_jobs() -> None:
    assert parse_cgroup("0::/system.slice/slurmd.service\n") is None
    assert parse_cgroup("0::/system.slice/slurmstepd.scope\n") is None
    assert parse_cgroup("0::/user.slice/user-1000.slice/session-3.scope\n") is None


def test_the_environment_s_gpus_and_cuda_visible_devices_apart() -> None:
    env = b"CUDA_VISIBLE_DEVICES=0,1\0SLURM_JOB_GPUS=4,5,6,7\0SLURM_STEP_GPUS=4,5\0"
    assert parse_environ_slurm_gpus(env) == ("4", "5")
    assert parse_environ_visible(env) == ("0", "1")
    assert parse_environ_gpus(env) == ("4", "5")
    only_visible = b"CUDA_VISIBLE_DEVICES=0\0HOME=/root\0"
    assert parse_environ_slurm_gpus(only_visible) is None
    assert parse_environ_visible(only_visible) == ("0",)
    assert parse_environ_slurm_gpus(b"SLURM_JOB_GPUS=2,3\0") == ("2", "3")
    assert parse_environ_visible(b"HOME=/root\0") is None


def test_cuda_visible_devices_is_relative_to_the_job_s_gpus() -> None:
    """Under ConstrainDevices a job given GPUs 4-7 sees them as 0-3: ``1`` is node GPU 5; an
    index past the job's GPUs names none; a uuid names its GPU wherever it is."""
    uuids = {"GPU-a": "0", "GPU-f": "5"}
    assert visible_gpus(("1",), ["4", "5", "6", "7"], uuids) == ["5"]
    assert visible_gpus(("0", "3"), ["4", "5", "6", "7"], uuids) == ["4", "7"]
    assert visible_gpus(("0",), ["5"], uuids) == ["5"]  # the GPU NVML shows the job on
    assert visible_gpus(("1",), ["5"], uuids) == []
    assert visible_gpus(("0",), [], uuids) == []  # nothing to map it to: ignored
    assert visible_gpus(("GPU-f", "GPU-zz", "MIG-1"), [], uuids) == ["5"]
    assert visible_gpus(None, ["4"], uuids) == []


def test_read_process_keeps_each_variable(tmp_path: Path) -> None:
    folder = tmp_path / "700"
    folder.mkdir()
    (folder / "cgroup").write_text((LAYOUTS / "v2605-sluid-step0-task0.cgroup").read_text())
    (folder / "status").write_text("Name:\tpython\nUid:\t1001\t1001\t1001\t1001\n")
    (folder / "environ").write_bytes(b"SLURM_STEP_GPUS=4,5\0CUDA_VISIBLE_DEVICES=0,1\0")
    process = read_process(tmp_path, 700)
    assert process is not None and process.uid == 1001
    assert process.job is not None and process.job.job.id == "slurm-s5K1KKYAYG5D00-0"
    assert process.gpus == ("4", "5") and process.slurm_gpus == ("4", "5")
    assert process.visible_gpus == ("0", "1")
    (folder / "environ").unlink()  # another user's process: environ not readable
    hidden = read_process(tmp_path, 700)
    assert hidden is not None and hidden.gpus is None and hidden.visible_gpus is None
    assert read_process(tmp_path, 701) is None

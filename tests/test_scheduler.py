"""Job ids from the scheduler's environment and cgroup step names."""

import pytest

from hyperagent.scheduler import NoJobId, from_environment, safe_id, slurm_job, world_size


def test_an_explicit_id_wins_over_every_scheduler():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "abc"}
    assert from_environment(env, "llama").id == "llama"
    assert from_environment({**env, "HYPERAGENT_JOB_ID": "ft-7"}).id == "ft-7"


def test_slurm_wins_over_torchrun_and_names_the_step():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "abc"}
    job = from_environment(env)
    described = (job.id, job.scheduler, job.scheduler_id, job.step)
    assert described == ("slurm-4242-0", "slurm", "4242", "0")


@pytest.mark.parametrize(
    ("step", "name"),
    [(None, "batch"), ("4294967291", "batch"), ("4294967292", "extern"), ("step_3", "3"),
     ("4294967294", "batch"), ("4294967290", "interactive")],
)
def test_slurm_steps_read_as_the_cgroup_path_names_them(step, name):
    assert slurm_job("17", step).id == f"slurm-17-{name}"


def test_torchrun_run_ids_are_made_safe_for_every_broker():
    assert from_environment({"TORCHELASTIC_RUN_ID": "a.b/c+d#e"}).id == "torchrun-a-b-c-d-e"
    assert safe_id("x" * 100) == "x" * 64


def test_no_id_says_what_to_pass():
    with pytest.raises(NoJobId, match=r"SLURM_JOB_ID.*--rdzv-id"):
        from_environment({"TORCHELASTIC_RUN_ID": "none"})
    with pytest.raises(NoJobId, match="not a Slurm job id"):
        from_environment({"SLURM_JOB_ID": "12.3"})


def test_world_size_from_torchrun_else_slurm():
    assert world_size({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS": "2"}) == (16, 8)
    assert world_size({"SLURM_NTASKS": "24", "SLURM_NTASKS_PER_NODE": "8"}) == (24, 8)
    assert world_size({"SLURM_NTASKS_PER_NODE": "8(x3)"}) == (None, None)

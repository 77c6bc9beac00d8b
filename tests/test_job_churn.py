"""Job churn on one agent: jobs started and killed in turn under new ids (as a scheduler gives
every submission its own id) are each accepted, leave no series behind once released, and
ranks that come and go leave no per-rank state behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hyperagent.agent import Agent
from hyperagent.config import build_config
from hyperagent.job import JobReporter, MemoryReport
from hyperagent.sources import Hardware
from hyperagent.sources.job import JobSource, PeerPolicy

from conftest import ManualClock


async def _until(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


async def _run_job(source: JobSource, path: Path, job: str, ranks: int = 1) -> list[JobReporter]:
    """Start ``job``'s ranks, each reporting a step (with its allocator's counts); returns them
    once the source counted every step or refused a rank."""
    reporters = [JobReporter(job, rank=rank, socket_path=path) for rank in range(ranks)]
    for reporter in reporters:
        memory = MemoryReport(2**29, 2**30, alloc_retries=2, ooms=1)
        reporter.report_step(samples=8, step_s=0.1, compute_s=0.08, comm_s=0.02, memory=memory)
    await _until(
        lambda: (
            (job in source.jobs and source.jobs[job].steps == ranks)
            or source.refused["too_many_jobs"] > 0
        )
    )
    return reporters


async def _kill(source: JobSource, job: str, reporters: list[JobReporter]) -> None:
    for reporter in reporters:
        reporter.close()
    await _until(lambda: source.attached(job) == 0)


@pytest.fixture
async def source(tmp_path: Path) -> AsyncIterator[JobSource]:
    """A job source with the default bound (16 jobs) and release time (600 s)."""
    job_source = JobSource(tmp_path / "job.sock")
    await job_source.start()
    try:
        yield job_source
    finally:
        await job_source.close()


async def test_forty_jobs_started_and_killed_in_turn_are_each_accepted(
    source: JobSource, tmp_path: Path
) -> None:
    """Dead jobs hold no slot a new one needs, long before their 600 s release."""
    for n in range(40):
        job = f"run-{n}"
        reporters = await _run_job(source, tmp_path / "job.sock", job)
        assert reporters[0].refused is None and source.refused["too_many_jobs"] == 0, job
        assert source.jobs[job].steps == 1
        await _kill(source, job, reporters)
    assert len(source.jobs) == source.policy.max_jobs  # the newest dead jobs, the rest released
    assert set(source.jobs) == {f"run-{n}" for n in range(24, 40)}


async def test_the_oldest_dead_job_goes_first_and_a_refusal_names_the_live_jobs(
    tmp_path: Path,
) -> None:
    path = tmp_path / "job.sock"
    source = JobSource(path, PeerPolicy(max_jobs=3))
    await source.start()
    try:
        for job in ("first-dead", "second-dead"):
            await _kill(source, job, await _run_job(source, path, job))
        live = await _run_job(source, path, "alive")
        newcomer = await _run_job(source, path, "new")  # the bound is full: the first dead goes
        assert set(source.jobs) == {"second-dead", "alive", "new"}
        third = await _run_job(source, path, "third")  # and then the second
        assert set(source.jobs) == {"alive", "new", "third"}

        refused = await _run_job(source, path, "fourth")
        await _until(lambda: refused[0].poll_settings() is None and refused[0].refused is not None)
        assert refused[0].refused is not None
        assert refused[0].refused.startswith("too_many_jobs")
        for name in ("alive", "new", "third"):
            assert name in refused[0].refused
        assert "fourth" not in source.jobs
        for reporter in (*live, *newcomer, *third, *refused):
            reporter.close()
    finally:
        await source.close()


async def test_a_dead_job_is_released_release_after_s_after_its_last_rank_left(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    path = tmp_path / "job.sock"
    source = JobSource(path, PeerPolicy(release_after_s=600), clock=clock)
    await source.start()
    try:
        reporters = await _run_job(source, path, "done", ranks=2)
        reporters[0].close()
        await _until(lambda: source.attached("done") == 1)
        clock.now = 700.0  # one rank is still connected: nothing to release
        assert source.release_due() == []
        await _kill(source, "done", reporters)
        clock.now = 1299.0
        assert source.release_due() == [] and "done" in source.jobs
        clock.now = 1300.0
        assert not any(r.labels.get("job_id") == "done" for r in await source.read())
        assert "done" not in source.jobs
    finally:
        await source.close()


async def _series(agent: Agent) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """The series the agent exports after its next collection."""
    before = agent.collections
    await _until(lambda: agent.collections > before)
    assert agent.snapshot is not None
    return {(r.name, tuple(sorted(r.labels.items()))) for r in agent.snapshot.readings}


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    """A running agent (no broker, no GPUs) whose job channel releases jobs 0.3 s after their
    last rank left."""
    config = build_config(
        {
            "mqtt": {"enabled": False},
            "agent": {"interval_s": 0.05, "metrics_address": "", "state_dir": str(tmp_path)},
        }
    )
    source = JobSource(tmp_path / "job.sock", PeerPolicy(release_after_s=0.3))
    running = Agent(config, Hardware(nvml=None), sources=[source])
    task = asyncio.create_task(running.run())
    try:
        async with asyncio.timeout(10):
            await running.ready.wait()
        yield running
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_dead_jobs_series_go_after_release_with_no_new_job(
    agent: Agent, tmp_path: Path
) -> None:
    source = agent.job_source
    assert source is not None
    idle = await _series(agent)
    for n in range(3):
        job = f"short-{n}"
        reporters = await _run_job(source, tmp_path / "job.sock", job, ranks=2)
        assert any(dict(labels).get("job_id") == job for _, labels in await _series(agent))
        await _kill(source, job, reporters)
    assert len(await _series(agent)) > len(idle)  # the dead jobs' final values, for a while

    await _until(lambda: not source.jobs)  # nothing arrives: the agent's own clock releases
    assert await _series(agent) == idle
    assert not agent.trials.step_clocks


async def test_ranks_coming_back_under_new_numbers_leave_no_per_rank_state(
    agent: Agent, tmp_path: Path
) -> None:
    source = agent.job_source
    assert source is not None
    path = tmp_path / "job.sock"
    steady = await _run_job(source, path, "j")
    for rank in range(1, 41):
        reporter = JobReporter("j", rank=rank, socket_path=path)
        reporter.report_step(
            samples=8,
            step_s=0.1,
            compute_s=0.08,
            comm_s=0.02,
            memory=MemoryReport(2**29, 2**30, alloc_retries=2, ooms=1),
        )
        await _until(lambda: source.jobs["j"].steps == rank + 1)  # noqa: B023
        reporter.close()
        await _until(lambda: source.attached("j") == 1)
    totals = source.jobs["j"]
    assert set(totals.alloc_retries) == set(totals.ooms) == set(totals.last_step_s) == {0}
    assert set(agent.trials.step_clocks["j"].last) == {0}
    # what the departed ranks counted stays in the job's counters
    readings = {r.name: r.value for r in await source.read() if r.labels.get("job_id") == "j"}
    assert readings["hyperagent_job_alloc_retries_total"] == 2 * 41
    assert readings["hyperagent_job_oom_total"] == 41
    assert readings["hyperagent_job_rank_step_seconds"] == pytest.approx(0.1)
    steady[0].close()

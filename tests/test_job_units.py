"""One unit everywhere: a node running several ranks of a job reports sums over its ranks
with the number of ranks they cover, so that a node's throughput is the sum of its ranks'."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiomqtt
import pytest
from test_agent import KEY, node_config

from hyperagent import bus
from hyperagent.agent import Agent
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.job import JobReporter
from hyperagent.sources import Hardware

RANKS = 4
STEPS = 5
SAMPLES = 8
"""Per rank and step ..."""
STEP_S = 2.0
"""... which takes each rank this long: each rank does 4 samples/s, the node 16."""


async def test_telemetry_says_how_many_ranks_the_sums_cover(
    mosquitto,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    nvidia_smi_dir: Path,
) -> None:
    config = node_config(mosquitto.url, tmp_path)
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    agent = Agent.from_config(config, Hardware(nvml=nvml), trusted_keys=KEY.trusted())
    task = asyncio.create_task(agent.run())
    reporters = []
    try:
        async with asyncio.timeout(10):
            await agent.ready.wait()
        socket_path = tmp_path / "job.sock"
        reporters = [JobReporter("j", rank=r, socket_path=socket_path) for r in range(RANKS)]
        idle = JobReporter("j", rank=RANKS, socket_path=socket_path)  # said hello, no step yet
        reporters.append(idle)
        for _ in range(STEPS):
            for rank, reporter in enumerate(reporters[:RANKS]):
                reporter.report_step(SAMPLES, STEP_S + 0.1 * rank, STEP_S - 0.5, 0.5)
        source = agent.job_source
        assert source is not None
        async with asyncio.timeout(10):
            while source.attached("j") < RANKS + 1 or source.jobs["j"].steps < RANKS * STEPS:
                await asyncio.sleep(0.02)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as listener:
            await listener.subscribe(bus.Topics("c").telemetry("n1"), qos=0)
            async with asyncio.timeout(10):
                message = await anext(aiter(listener.messages))
        snapshot = await agent.collect_once()
    finally:
        for reporter in reporters:
            reporter.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    job = bus.decode(message.payload, "telemetry")["jobs"]["j"]  # type: ignore[arg-type]
    assert job["ranks"] == RANKS  # the rank that only said hello is not counted
    assert job["samples"] == RANKS * STEPS * SAMPLES
    node_step_s = job["step_s"] / job["ranks"]  # the sum over ranks, per rank
    mean_step_s = STEP_S + 0.1 * (RANKS - 1) / 2
    assert node_step_s == pytest.approx(STEPS * mean_step_s)
    # the node's throughput is its ranks' together, not one rank's
    assert job["samples"] / node_step_s == pytest.approx(RANKS * SAMPLES / mean_step_s)
    labels = {"job_id": "j"}
    assert snapshot.value("hyperagent_job_ranks", **labels) == RANKS + 1
    assert snapshot.value("hyperagent_job_reporting_ranks", **labels) == RANKS
    assert snapshot.value("hyperagent_job_rank_step_seconds", **labels) == pytest.approx(
        mean_step_s
    )

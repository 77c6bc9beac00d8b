"""Retained messages that must arrive on any broker: RabbitMQ's MQTT plugin serves a retained
message only to a subscriber of its exact topic, never through ``+`` or ``#``; mosquitto serves
it through both (and delivers a live message once per matching subscription)."""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from hyperagent.agent import Agent
from hyperagent.demo import (
    JOB,
    JOB_KNOBS,
    SimulatedNode,
    VirtualClock,
    demo_hardware,
    run_rank,
    simulated_cluster,
)
from hyperagent.job import JobReporter
from hyperagent.signing import SigningKey

pytestmark = [pytest.mark.peer, pytest.mark.timeout(240)]

FRESH_AGENT_S = 10.0
"""The Done-when bound: a fresh agent runs the final version within this."""


def cluster_name() -> str:
    """A topic tree of the test's own: the session's RabbitMQ keeps other tests' retained
    messages."""
    return f"retained-{uuid.uuid4().hex[:8]}"


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``condition`` holds; fails the test after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"not within {timeout_s:.0f}s: {what}")
    return loop.time() - start


async def stop(node: SimulatedNode) -> None:
    """The node's agent (saying offline on its way out) and its rank end."""
    node.stop()
    await asyncio.gather(*node.tasks, return_exceptions=True)
    node.reporter.close()


def fresh_node(
    old: SimulatedNode, state_dir: Path, key: SigningKey, world_size: int
) -> SimulatedNode:
    """``old``'s node come back with nothing on disk (re-imaged, or down through the whole
    tuning): a new agent over new fake GPUs, and its rank of the job."""
    config = old.agent.config
    config = config.model_copy(
        update={"agent": config.agent.model_copy(update={"state_dir": state_dir})}
    )
    clock = VirtualClock()
    hardware = demo_hardware(None, clock)
    agent = Agent.from_config(config, hardware.hardware, trusted_keys=key.trusted())
    assert hardware.nvml is not None
    hardware.nvml.run_on_every_device(os.getpid())  # the job's rank drives every GPU, as before
    reporter = JobReporter(
        JOB,
        rank=int(old.name.removeprefix("node-")),
        socket_path=config.sources.job.socket,
        knobs=JOB_KNOBS,
        world_size=world_size,
        local_world_size=1,
        tune=True,
        gpus=range(hardware.gpus.count()),
    )
    return SimulatedNode(old.name, hardware.nvml, clock, agent, reporter, gpus=hardware.gpus)


@pytest.mark.long(60)
async def test_an_agent_started_after_the_tuning_runs_the_final_settings(
    broker_url: str, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    async with simulated_cluster(
        broker_url, nodes=1, trials=3, seed=3, key=key, cluster=cluster_name()
    ) as (coordinator, nodes, model):
        await coordinator.run(until_tuned=True)
        final = coordinator.job(JOB).version
        old = nodes[0]
        await wait_until(
            lambda: old.agent.live_versions.get(JOB) == final, 10, f"node-0 applies v{final}"
        )
        settings = old.agent.applied_messages[JOB]["settings"]
        await stop(old)
        node = fresh_node(old, tmp_path / "fresh", key, world_size=1)
        assert node.agent.applied_versions == {}
        tasks = [asyncio.create_task(node.agent.run(), name="fresh-agent")]
        try:
            await node.agent.ready.wait()
            tasks.append(
                asyncio.create_task(run_rank(node, model, 40.0, random.Random(0)), name="rank")
            )
            took = await wait_until(
                lambda: node.agent.live_versions.get(JOB) == final,
                FRESH_AGENT_S,
                f"a fresh agent runs the final v{final} (it has {node.agent.applied_versions})",
            )
            await wait_until(lambda: final in node.versions_run, 5, f"the job's rank runs v{final}")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            node.reporter.close()
    assert node.agent.applied_messages[JOB]["settings"] == settings
    assert node.power_cap_w() == pytest.approx(settings["power_cap_w"])
    assert node.agent.stats.rejected.total() == 0
    print(f"fresh agent on {broker_url}: final v{final} applied after {took:.2f}s")


@pytest.mark.long(30)
async def test_a_coordinator_started_after_a_node_went_offline_knows_it(broker_url: str) -> None:
    async with simulated_cluster(broker_url, nodes=2, trials=3, seed=5, cluster=cluster_name()) as (
        coordinator,
        nodes,
        _,
    ):
        gone = nodes[1]
        await stop(gone)
        task = asyncio.create_task(coordinator.run(), name="coordinator")
        try:
            took = await wait_until(
                lambda: coordinator.nodes.get("node-1", (True, 0.0))[0] is False,
                10,
                "the coordinator learns that node-1 is offline",
            )
            await wait_until(lambda: JOB in coordinator.jobs, 10, f"{JOB} is found")
            online = {
                r.labels["node"]: r.value
                for r in coordinator.readings()
                if r.name == "hyperagent_node_online"
            }
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert online.get("node-1") == 0.0
    assert coordinator.nodes["node-0"][0] is True
    print(f"coordinator on {broker_url}: node-1 offline known after {took:.2f}s")

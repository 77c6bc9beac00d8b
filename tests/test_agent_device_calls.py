"""A hung or failing NVML driver, injected through FakeNvml's faults into a running agent: the
agent's own NVML calls (GPU attribution, a trial's energy, the power-cap apply in the MQTT
handler) time out instead of stopping the loops, /metrics shows the staleness, and a failed
power cap leaves the node as it was."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_agent import Harness, limits_w, node_config, running_agent, until

from hyperagent import bus
from hyperagent.agent import Agent
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.config import build_config
from hyperagent.job import JobReporter
from hyperagent.sources import Hardware

from conftest import Mosquitto, free_port

HUNG = {"block_s": 3.0, "gpus": [0]}
"""A call on GPU 0 that comes back long after ``sources.timeout_s`` (0.3 or 0.5 s here)."""

NVML = {"source": "nvml", "target": "local"}
HOST = {"source": "host", "target": "local"}


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(agent: Agent, name: str, **labels: str) -> float | None:
    assert agent.snapshot is not None
    return agent.snapshot.value(name, **labels)


async def test_a_hung_nvml_call_leaves_the_collection_going_and_metrics_show_it_stale(
    tmp_path: Path, nvidia_smi_dir: Path
) -> None:
    """``sources.timeout_s = 0.3``, NVML calls on GPU 0 hang for 3 s each (the source's field
    values and the agent's GPU attribution, checked every 0.3 s here): collections go on, host
    readings stay fresh, nvml is up 0 with its last success frozen, and /metrics says so,
    without a thread per hung call."""
    faults = tmp_path / "nvml-faults.json"
    port = free_port()
    config = build_config(
        {
            "node": "n1",
            "cluster": "c",
            "mqtt": {"enabled": False},
            "attribution": {"interval_s": 0.3},
            "agent": {
                "interval_s": 0.1,
                "metrics_address": f"127.0.0.1:{port}",
                "state_dir": str(tmp_path),
            },
            "sources": {
                "timeout_s": 0.3,
                "ipmi": {"enabled": False},
                "rdma": {"enabled": False},
                "job": {"socket": str(tmp_path / "job.sock")},
            },
        }
    )
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml", faults_file=faults)
    agent = Agent.from_config(config, Hardware(nvml=nvml))
    task = asyncio.create_task(agent.run())
    reporter = None
    try:
        await until(lambda: agent.ready.is_set())
        reporter = JobReporter("j", socket_path=tmp_path / "job.sock")
        reporter.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)
        await until(lambda: bool(agent.job_source and agent.job_source.peers))
        await until(lambda: value(agent, "hyperagent_source_up", **NVML) == 1)

        hung = json.dumps(
            {"nvmlDeviceGetFieldValues": HUNG, "nvmlDeviceGetComputeRunningProcesses": HUNG}
        )
        faults.write_text(hung)
        await until(lambda: value(agent, "hyperagent_source_up", **NVML) == 0, timeout_s=5)
        last_success = value(agent, "hyperagent_source_last_success_timestamp_seconds", **NVML)
        host_before = value(agent, "hyperagent_source_last_success_timestamp_seconds", **HOST)
        assert last_success is not None and host_before is not None
        threads, collections = threading.active_count(), agent.collections
        await until(lambda: agent.collections >= collections + 10, timeout_s=5)

        assert value(agent, "hyperagent_source_up", **NVML) == 0
        assert value(agent, "hyperagent_source_last_success_timestamp_seconds", **NVML) == (
            last_success
        )
        host_now = value(agent, "hyperagent_source_last_success_timestamp_seconds", **HOST)
        assert host_now is not None and host_now > host_before  # the other sources stay fresh
        assert threading.active_count() <= threads + 1  # no thread per hung call
        metrics = await asyncio.to_thread(scrape, port)
        assert metrics[("hyperagent_source_up", frozenset(NVML.items()))] == 0
        assert metrics[
            ("hyperagent_source_last_success_timestamp_seconds", frozenset(NVML.items()))
        ] == pytest.approx(last_success)
        collected = metrics[("hyperagent_agent_last_collection_timestamp_seconds", frozenset())]
        assert collected > last_success + 0.5
        busy = {"library": "nvml", "reason": "busy"}.items()
        assert metrics[("hyperagent_device_call_failures_total", frozenset(busy))] > 0
    finally:
        if reporter is not None:
            reporter.close()
        task.cancel()
        async with asyncio.timeout(10):  # stopping does not wait for the hung call either
            await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def harness(
    mosquitto: Mosquitto, tmp_path: Path, nvidia_smi_dir: Path
) -> AsyncIterator[Harness]:
    config = node_config(
        mosquitto.url,
        tmp_path,
        sources={
            "timeout_s": 0.5,
            "ipmi": {"enabled": False},
            "rdma": {"enabled": False},
            "job": {"socket": str(tmp_path / "job.sock")},
        },
    )
    capture = nvidia_smi_dir / "gtx-8card.xml"
    async with running_agent(config, capture, mosquitto.port, tmp_path / "job.sock") as h:
        await h.job_on_every_gpu()
        yield h


async def ack_for(harness: Harness, version: int, settings: dict[str, Any]) -> dict[str, Any]:
    async with aiomqtt.Client("127.0.0.1", harness.port) as listener:
        await listener.subscribe(harness.topics.ack("j", "n1"), qos=1)
        await harness.send(version, settings)
        async with asyncio.timeout(5):
            async for message in listener.messages:
                ack = bus.decode(message.payload, "ack")  # type: ignore[arg-type]
                if ack["version"] == version:
                    return ack
    raise AssertionError("no ack")


async def test_a_hung_power_cap_set_refuses_the_version_and_the_loop_goes_on(
    harness: Harness,
) -> None:
    harness.nvml.set_faults({"nvmlDeviceSetPowerManagementLimit": HUNG})
    collections = harness.agent.collections
    ack = await ack_for(harness, 1, {"power_cap_w": 150})
    uuid = harness.nvml.nvmlDeviceGetUUID(harness.nvml.nvmlDeviceGetHandleByIndex(0))
    assert not ack["ok"]
    assert ack["error"].startswith(f"GPU 0 ({uuid}) power limit: nvml ")
    assert "timed out after 0.5 s" in ack["error"]
    assert harness.agent.stats.rejected["refused"] == 1
    assert harness.agent.applied_versions.get("j") is None
    await until(lambda: harness.agent.collections >= collections + 5, timeout_s=5)


async def test_a_set_failure_on_gpu_3_of_8_leaves_every_gpu_at_its_previous_cap(
    harness: Harness,
) -> None:
    assert (await ack_for(harness, 1, {"power_cap_w": 175}))["ok"]
    assert limits_w(harness.nvml) == {175.0}
    harness.nvml.set_faults(
        {"nvmlDeviceSetPowerManagementLimit": {"error": "NVML_ERROR_UNKNOWN", "gpus": [3]}}
    )
    ack = await ack_for(harness, 2, {"power_cap_w": 150})
    uuid = harness.nvml.nvmlDeviceGetUUID(harness.nvml.nvmlDeviceGetHandleByIndex(3))
    assert not ack["ok"] and ack["error"] == f"GPU 3 ({uuid}) power limit: Unknown Error"
    assert limits_w(harness.nvml) == {175.0}  # GPUs 0-2 put back, 4-7 never touched
    assert harness.agent.applied_versions["j"] == 1


async def test_a_trial_s_energy_read_times_out_instead_of_hanging(harness: Harness) -> None:
    agent = harness.agent
    async with asyncio.timeout(5):
        assert await agent.devices.energy_j() is not None
    harness.nvml.set_faults({"nvmlDeviceGetTotalEnergyConsumption": HUNG})
    collections = agent.collections
    async with asyncio.timeout(5):
        assert await agent.devices.energy_j() is None  # a report without energy, not a stuck trial
    await until(lambda: agent.collections >= collections + 3, timeout_s=5)

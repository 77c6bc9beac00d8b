"""Handler errors on /metrics: the agent's and the coordinator's MQTT links count what their
handlers raise, per subscription filter, against a real mosquitto."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiomqtt

from hyperagent import bus
from hyperagent.agent import Agent
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.config import build_config
from hyperagent.coordinator import Coordinator, coordinator_link
from hyperagent.readings import Snapshot
from hyperagent.signing import SigningKey
from hyperagent.sources import Hardware

KEY = SigningKey.generate()
PROBE = "hyperagent/v1/c/probe/+"
"""A subscription whose handler always fails (what a handler bug looks like from outside)."""


async def _fail(topic: str, payload: bytes) -> None:
    raise RuntimeError("a handler bug")


async def _publish(port: int, count: int) -> None:
    async with aiomqtt.Client("127.0.0.1", port) as client:
        for i in range(count):
            await client.publish(f"hyperagent/v1/c/probe/{i}", b"x", qos=1)


async def _until_counted(link: bus.MqttLink, count: int) -> None:
    async with asyncio.timeout(20):
        while link.handler_errors_by_filter[PROBE] < count:
            await asyncio.sleep(0.01)


async def test_the_agent_exposes_its_handler_errors(
    mosquitto, tmp_path: Path, nvidia_smi_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    config = build_config(
        {
            "node": "n1",
            "cluster": "c",
            "mqtt": {"url": mosquitto.url},
            "agent": {"metrics_address": "", "state_dir": str(tmp_path)},
            "sources": {"job": {"socket": str(tmp_path / "job.sock")}},
        }
    )
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "tesla-t4.xml")
    agent = Agent.from_config(config, Hardware(nvml=nvml), trusted_keys=KEY.trusted())
    assert agent.link is not None
    agent.link.subscribe(PROBE, 1, _fail)
    task = asyncio.create_task(agent.run())
    try:
        async with asyncio.timeout(10):
            await agent.link.connected.wait()
        await _publish(mosquitto.port, 30)
        await _until_counted(agent.link, 30)
        snapshot: Snapshot = await agent.collect_once()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    errors = "hyperagent_mqtt_handler_errors_total"
    assert snapshot.value(errors, handler=PROBE) == 30
    assert snapshot.value(errors, handler="hyperagent/v1/c/job/+/settings") == 0


async def test_the_coordinator_exposes_its_handler_errors(mosquitto) -> None:  # type: ignore[no-untyped-def]
    config = build_config(
        {
            "cluster": "c",
            "mqtt": {"url": mosquitto.url},
            "coordinator": {"jobs": [{"id": "j", "nodes": ["n1"]}]},
        }
    )
    link = coordinator_link(config)
    coordinator = Coordinator(config, link, KEY)
    link.subscribe(PROBE, 1, _fail)
    task = asyncio.create_task(link.run())
    try:
        async with asyncio.timeout(10):
            await link.connected.wait()
        await _publish(mosquitto.port, 30)
        await _until_counted(link, 30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    counted = {
        r.labels["handler"]: r.value
        for r in coordinator.readings()
        if r.name == "hyperagent_mqtt_handler_errors_total"
    }
    assert counted[PROBE] == 30 and len(counted) > 1

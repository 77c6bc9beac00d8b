"""Faults at the edge of a session: a broker that accepts a connection and drops it while the
link subscribes (a real TCP server on loopback doing just that), a coordinator that ends its
tuning, whose retained status must not go on saying "online", and a node whose broker has no
retained coordinator status."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path

import aiomqtt
import orjson
import pytest

from hyperagent import bus
from hyperagent.config import build_config
from hyperagent.coordinator import Coordinator, coordinator_link
from hyperagent.demo import simulated_cluster
from hyperagent.signing import SigningKey

from conftest import Mosquitto

pytestmark = pytest.mark.timeout(120)

CONNACK = b"\x20\x02\x00\x00"


async def test_a_broker_that_drops_each_session_while_subscribing_is_retried_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It answers CONNECT, then closes the socket: the link notices at once (not after the
    reply's 10 s time-out), backs off, and asyncio logs no "Future exception was never
    retrieved" for the disconnection nobody awaited."""
    sessions = 0

    async def accept_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sessions
        sessions += 1
        await reader.read(1024)  # CONNECT
        writer.write(CONNACK)
        await writer.drain()
        await reader.read(1024)  # the first SUBSCRIBE
        writer.close()

    server = await asyncio.start_server(accept_then_drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    caplog.set_level(logging.INFO)

    delivered: list[str] = []

    async def record(topic: str, payload: bytes) -> None:
        delivered.append(topic)

    link = bus.MqttLink("127.0.0.1", port, "dropped", backoff_min_s=0.05, backoff_max_s=0.4)
    link.subscribe("a/+", 1, record)
    link.follow("a/b", 1, record)
    link.publish("a/c", b"kept", qos=1)
    task = asyncio.create_task(link.run())
    try:
        async with asyncio.timeout(5):
            while sessions < 3:
                await asyncio.sleep(0.01)
        await asyncio.sleep(1.5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()
        await server.wait_closed()
    gc.collect()
    await asyncio.sleep(0.1)  # the loop's exception handler runs
    assert "never retrieved" not in caplog.text
    assert "Disconnected while subscribing" in caplog.text
    assert "timed out" not in caplog.text
    assert not link.connected.is_set() and len(link.spool) == 1  # nothing taken as sent
    assert delivered == []  # a session that broke while subscribing delivers nothing
    # backed off: 0.05 s doubling to 0.4 s, not a reconnect every few milliseconds
    assert 3 <= sessions <= 15, sessions


async def test_a_coordinator_that_ends_leaves_its_status_offline(mosquitto: Mosquitto) -> None:
    """``run(until_tuned=True)`` returns once the job is tuned: the retained coordinator status
    says "offline" then, so an agent started later does not wait for acks nobody takes."""
    async with simulated_cluster(mosquitto.url, nodes=2, trials=2, seed=1, speedup=40) as (
        coordinator,
        _,
        _,
    ):
        await asyncio.wait_for(coordinator.run(until_tuned=True), 90)
        topic = coordinator.topics.coordinator_status()
    async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="later") as later:
        await later.subscribe(topic, qos=1)
        async with asyncio.timeout(5):
            async for message in later.messages:
                assert message.retain
                status = orjson.loads(message.payload)  # type: ignore[arg-type]
                break
    assert status["state"] == "offline"


async def test_the_coordinator_says_online_again_when_a_node_comes_online(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """A node reconnected to a broker (cluster node) that never stored the coordinator's
    retained status still hears it: the coordinator says online again when the node's own
    online status arrives."""
    config = build_config(
        {
            "cluster": "announce",
            "mqtt": {"url": mosquitto.url, "reconnect_min_s": 0.1, "reconnect_max_s": 0.5},
            "coordinator": {"state_dir": str(tmp_path / "coordinator"), "metrics_address": ""},
        },
        {"node": "coordinator"},
    )
    coordinator = Coordinator(config, coordinator_link(config), SigningKey.generate())
    topics = coordinator.topics
    running = asyncio.create_task(coordinator.run())
    try:
        async with asyncio.timeout(10):
            await coordinator.link.connected.wait()
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="node-7") as node:
            # the broker forgets the retained status, as a cluster node that never stored it
            await node.publish(topics.coordinator_status(), b"", qos=1, retain=True)
            await node.subscribe(topics.coordinator_status(), qos=1)
            await node.publish(
                topics.status("node-7"),
                bus.encode({"node": "node-7", "state": "online", "ts": time.time()}),
                qos=1,
                retain=True,
            )
            async with asyncio.timeout(5):
                async for message in node.messages:
                    if message.payload:
                        status = orjson.loads(message.payload)  # type: ignore[arg-type]
                        break
        assert status["state"] == "online"
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

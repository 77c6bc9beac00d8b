"""The shipped mosquitto config, as shipped: TLS, a credential per node, ACLs. Real broker."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiomqtt
import pytest
from pki import make_certificates

from hyperagent import bus
from hyperagent.config import build_config

from conftest import REPO, free_port, require_binary, wait_for_port

PASSWORDS = {"coordinator": "c0ord-secret", "node-1": "n1-secret", "node-2": "n2-secret"}


@dataclass
class SecureBroker:
    port: int
    ca: Path

    def client(self, user: str | None, password: str | None = None) -> aiomqtt.Client:
        return aiomqtt.Client(
            "127.0.0.1",
            self.port,
            identifier=f"test-{user}-{os.getpid()}",
            username=user,
            password=password if password is not None else PASSWORDS.get(user or ""),
            tls_params=aiomqtt.TLSParameters(ca_certs=str(self.ca)),
            timeout=10,
        )


@pytest.fixture
def secure_broker(tmp_path: Path) -> Iterator[SecureBroker]:
    mosquitto = require_binary("mosquitto", "mosquitto")
    certs = tmp_path / "certs"
    certs.mkdir()
    make_certificates(certs)
    passwd = tmp_path / "hyperagent.passwd"
    for i, (user, password) in enumerate(PASSWORDS.items()):
        create = ["-c"] if i == 0 else []
        subprocess.run(
            [
                require_binary("mosquitto_passwd", "mosquitto"),
                *create,
                "-b",
                str(passwd),
                user,
                password,
            ],
            check=True,
            timeout=30,
        )
    port = free_port()
    conf = (REPO / "systemd" / "mosquitto" / "hyperagent.conf").read_text()
    conf = (
        conf.replace("/etc/mosquitto/certs/", f"{certs}/")
        .replace("/etc/mosquitto/hyperagent.passwd", str(passwd))
        .replace(
            "/etc/mosquitto/hyperagent.acl", str(REPO / "systemd" / "mosquitto" / "hyperagent.acl")
        )
        .replace("listener 8883", f"listener {port} 127.0.0.1")
    )
    conf += f"persistence_location {tmp_path}/\n"  # Debian's mosquitto.conf sets it
    if os.geteuid() == 0:
        conf += "user root\n"
    (tmp_path / "broker.conf").write_text(conf)
    log = (tmp_path / "broker.log").open("wb")
    process = subprocess.Popen(
        [mosquitto, "-c", str(tmp_path / "broker.conf")], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_for_port(port)
        yield SecureBroker(port, certs / "ca.crt")
    finally:
        process.terminate()
        process.wait(10)


async def test_anonymous_and_wrong_passwords_are_refused(secure_broker: SecureBroker) -> None:
    for user, password in ((None, None), ("node-1", "wrong")):
        with pytest.raises(aiomqtt.MqttError):
            async with secure_broker.client(user, password):
                pytest.fail(f"the broker let {user or 'an anonymous client'} in")


async def test_a_node_writes_only_its_own_topics(secure_broker: SecureBroker) -> None:
    t = bus.Topics("prod")
    async with secure_broker.client("coordinator") as coordinator:
        await coordinator.subscribe("hyperagent/v1/#", qos=1)
        async with secure_broker.client("node-1") as node:
            await node.publish(t.telemetry("node-2"), b"impersonation", qos=1)
            await node.publish(t.settings("llama"), b"forged settings", qos=1)
            await node.publish(t.telemetry("node-1"), b"own telemetry", qos=1)
            await node.publish(t.ack("llama", "node-2"), b"another node's ack", qos=1)
            await node.publish(t.report("llama", "node-2"), b"another node's report", qos=1)
            await node.publish(t.coordinator_status(), b"coordinator impersonation", qos=1)
            await node.publish(t.ack("llama", "node-1"), b"own ack", qos=1)
        got = []
        async with asyncio.timeout(10):
            async for message in coordinator.messages:
                got.append((message.topic.value, message.payload))
                if message.payload == b"own ack":
                    break
    assert got == [
        (t.telemetry("node-1"), b"own telemetry"),
        (t.ack("llama", "node-1"), b"own ack"),
    ]


async def test_the_coordinator_status_reaches_every_node(secure_broker: SecureBroker) -> None:
    """The agents open their spool only when they see the coordinator online (the shipped ACL
    once denied both the coordinator's publish and the nodes' read)."""
    t = bus.Topics("prod")
    async with secure_broker.client("coordinator") as coordinator:
        await coordinator.publish(t.coordinator_status(), b"online", qos=1, retain=True)
    async with secure_broker.client("node-1") as node:
        await node.subscribe(t.coordinator_status(), qos=1)
        async with asyncio.timeout(10):
            message = await anext(aiter(node.messages))
    assert message.payload == b"online"


async def test_only_the_coordinator_writes_settings(secure_broker: SecureBroker) -> None:
    t = bus.Topics("prod")
    async with secure_broker.client("node-2") as node:
        await node.subscribe(t.settings("+"), qos=1)
        async with secure_broker.client("coordinator") as coordinator:
            await coordinator.publish(t.settings("llama"), b"v1", qos=1)
        async with asyncio.timeout(10):
            message = await anext(aiter(node.messages))
    assert message.payload == b"v1"


async def test_receipts_reach_their_own_node_only(secure_broker: SecureBroker) -> None:
    """The coordinator writes each node's receipts; a node reads its own, not another's, and
    cannot forge one."""
    t = bus.Topics("prod")
    async with secure_broker.client("node-1") as one, secure_broker.client("node-2") as two:
        await one.subscribe(t.receipt("+", "node-1"), qos=1)
        await one.subscribe(t.receipt("+", "node-2"), qos=1)
        await two.publish(t.receipt("llama", "node-1"), b"forged receipt", qos=1)
        async with secure_broker.client("coordinator") as coordinator:
            await coordinator.publish(t.receipt("llama", "node-2"), b"node-2's", qos=1)
            await coordinator.publish(t.receipt("llama", "node-1"), b"node-1's", qos=1)
        async with asyncio.timeout(10):
            message = await anext(aiter(one.messages))
    assert (message.topic.value, message.payload) == (t.receipt("llama", "node-1"), b"node-1's")


async def test_the_agent_connects_with_its_config(
    secure_broker: SecureBroker, tmp_path: Path
) -> None:
    password = tmp_path / "node-1.password"
    password.write_text(PASSWORDS["node-1"] + "\n")
    config = build_config(
        {
            "node": "node-1",
            "cluster": "prod",
            "mqtt": {
                "url": f"mqtts://127.0.0.1:{secure_broker.port}",
                "username": "node-1",
                "password_file": str(password),
                "tls_ca_file": str(secure_broker.ca),
            },
        }
    )
    link = bus.link_from_config(config, "agent-node-1", status_node="node-1")
    async with secure_broker.client("coordinator") as coordinator:
        await coordinator.subscribe(bus.Topics("prod").status("node-1"), qos=1)
        task = asyncio.create_task(link.run())
        try:
            async with asyncio.timeout(10):
                message = await anext(aiter(coordinator.messages))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert bus.decode(message.payload, "status")["state"] == "online"  # type: ignore[arg-type]

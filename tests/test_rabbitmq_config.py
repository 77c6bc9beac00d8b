"""The shipped RabbitMQ config, as shipped: MQTT over TLS only, a credential per node, the topic
permissions of systemd/mosquitto/hyperagent.acl granted by hyperagent-rabbitmq-users, quorum
queues for persistent sessions. A real RabbitMQ on loopback ports of its own."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiomqtt
import pytest
from pki import make_certificates

from hyperagent import bus
from hyperagent.config import build_config

from conftest import REPO, RabbitMq

pytestmark = [
    pytest.mark.peer,
    pytest.mark.timeout(180),
    pytest.mark.xdist_group("shipped-rabbitmq"),  # one broker for the module, on one worker
]

SHIPPED = REPO / "systemd" / "rabbitmq"
ACL = REPO / "systemd" / "mosquitto" / "hyperagent.acl"
PASSWORDS = {"coordinator": "c0ord secret", "node-1": "n1-secret", "node-2": "n2-secret"}
CLUSTER = "prod"
RABBITMQCTL = Path("/usr/lib/rabbitmq/bin/rabbitmqctl")
"""Debian's CLI itself: /usr/sbin/rabbitmqctl switches to the rabbitmq user and its cookie."""


def client_id(user: str) -> str:
    """The client id the user's daemon connects with (link_from_config's default)."""
    return (
        f"hyperagent-coordinator-{CLUSTER}" if user == "coordinator" else f"hyperagent-agent-{user}"
    )


class ShippedRabbitMq(RabbitMq):
    """A RabbitMQ running systemd/rabbitmq/ as shipped, but for its certificates' folder and
    its ports: MQTT over TLS on ``port``, AMQP on ``amqp_port``."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.certs = workdir / "certs"
        self.certs.mkdir()
        make_certificates(self.certs)
        conf = (SHIPPED / "rabbitmq.conf").read_text()
        for shipped, here in (
            ("/etc/rabbitmq/certs/", f"{self.certs}/"),
            ("mqtt.listeners.ssl.default = 8883", f"mqtt.listeners.ssl.default = {self.port}"),
            ("127.0.0.1:5672", f"127.0.0.1:{self.amqp_port}"),
        ):
            assert shipped in conf, f"the shipped rabbitmq.conf has no {shipped!r}"
            conf = conf.replace(shipped, here)
        (workdir / "rabbitmq.conf").write_text(conf)
        shutil.copy(SHIPPED / "enabled_plugins", workdir / "enabled_plugins")
        self.node = self.env["RABBITMQ_NODENAME"]
        self.ctl_script = workdir / "rabbitmqctl"
        self.ctl_script.write_text(f'#!/bin/sh\nexec {RABBITMQCTL} -n {self.node} "$@"\n')
        self.ctl_script.chmod(0o755)

    def refused(self, user: str) -> set[str]:
        """The routing keys and binding keys the broker's log says it refused ``user``."""
        log = (self.workdir / "log" / f"{self.node}.log").read_text(errors="replace")
        return set(
            re.findall(
                rf"access to topic '([^']+)' in exchange 'amq.topic' in vhost"
                rf" 'hyperagent' refused for user '{re.escape(user)}'",
                log,
            )
        )

    def ctl(self, *args: str, stdin: str | None = None, script: Path | None = None) -> str:
        """Output of rabbitmqctl ARGS against this node (or of ``script`` ARGS, with
        RABBITMQCTL naming it)."""
        command = [str(script), *args] if script else [str(self.ctl_script), *args]
        done = subprocess.run(
            command,
            input=stdin,
            env={**self.env, "RABBITMQCTL": str(self.ctl_script)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (
            f"{command}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        )
        return done.stdout


@pytest.fixture(scope="module")
def shipped_rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShippedRabbitMq]:
    if not RABBITMQCTL.exists():
        pytest.fail("rabbitmqctl is not installed: apt-get install -y rabbitmq-server")
    broker = ShippedRabbitMq(tmp_path_factory.mktemp("shipped-rabbitmq"))
    broker.start()
    try:
        lines = "".join(f"{user} {password}\n" for user, password in PASSWORDS.items())
        broker.ctl(str(ACL), stdin=lines, script=SHIPPED / "hyperagent-rabbitmq-users")
        yield broker
    finally:
        broker.stop()


@asynccontextmanager
async def client(
    broker: ShippedRabbitMq,
    user: str | None,
    password: str | None = None,
    identifier: str | None = None,
    clean_session: bool = True,
) -> AsyncIterator[aiomqtt.Client]:
    async with aiomqtt.Client(
        "127.0.0.1",
        broker.port,
        identifier=identifier or client_id(user or "anonymous"),
        username=user,
        password=password if password is not None else PASSWORDS.get(user or ""),
        tls_params=aiomqtt.TLSParameters(ca_certs=str(broker.certs / "ca.crt")),
        clean_session=clean_session,
        timeout=10,
    ) as c:
        yield c


async def test_anonymous_and_wrong_passwords_are_refused(shipped_rabbitmq: ShippedRabbitMq) -> None:
    for user, password in ((None, None), ("node-1", "wrong")):
        with pytest.raises(aiomqtt.MqttError):
            async with client(shipped_rabbitmq, user, password):
                pytest.fail(f"the broker let {user or 'an anonymous client'} in")


def test_mqtt_listens_only_with_tls(shipped_rabbitmq: ShippedRabbitMq) -> None:
    out = shipped_rabbitmq.ctl(
        "-s",
        "eval",
        '[io:format("~s ~w ~b~n", [P, Ip, Port])'
        " || {listener, _, P, _, Ip, Port, _} <- rabbit_networking:active_listeners()], ok.",
    )
    listeners = re.findall(r"(?m)^(\S+) \{([\d,]+)\} (\d+)$", out)
    by_protocol = {protocol: (ip, int(port)) for protocol, ip, port in listeners}
    assert by_protocol.keys() == {"amqp", "mqtt/ssl", "clustering"}, out
    assert by_protocol["mqtt/ssl"][1] == shipped_rabbitmq.port
    assert by_protocol["amqp"] == ("127,0,0,1", shipped_rabbitmq.amqp_port)


async def attempt(
    broker: ShippedRabbitMq, user: str, action: str, topic: str, identifier: str | None = None
) -> str:
    """What became of ``user`` publishing to (or subscribing to) ``topic`` in a connection of
    its own: "done" (or the SUBACK's reason), or the error. RabbitMQ answers a refused publish
    or subscription by closing the connection, without a PUBACK or SUBACK."""
    try:
        async with client(broker, user, identifier=identifier) as c:
            if action == "publish":
                await c.publish(topic, f"{user} to {topic}".encode(), qos=1, timeout=5)
            else:
                result = await c.subscribe(topic, qos=1, timeout=3)
                return ",".join(str(r) for r in result)
    except aiomqtt.MqttError as e:
        return str(e)
    return "done"


async def test_a_node_writes_only_its_own_topics(shipped_rabbitmq: ShippedRabbitMq) -> None:
    t = bus.Topics(CLUSTER)
    own = [
        t.telemetry("node-1"),
        t.status("node-1"),
        t.report("llama", "node-1"),
        t.ack("llama", "node-1"),
    ]
    others = [
        t.telemetry("node-2"),
        t.status("node-2"),
        t.report("llama", "node-2"),
        t.ack("llama", "node-2"),
        t.settings("llama"),
        t.coordinator_status(),
    ]
    got: list[str] = []
    async with client(shipped_rabbitmq, "coordinator") as coordinator:
        await coordinator.subscribe("hyperagent/v1/#", qos=1)
        outcomes = await asyncio.gather(
            *(
                attempt(shipped_rabbitmq, "node-1", "publish", topic, f"{client_id('node-1')}-{i}")
                for i, topic in enumerate(own + others)
            )
        )
        marker = t.ack("marker", "node-1")
        assert await attempt(shipped_rabbitmq, "node-1", "publish", marker) == "done"
        async with asyncio.timeout(10):
            async for message in coordinator.messages:
                if message.topic.value == marker:
                    break
                got.append(message.topic.value)
    assert dict(zip(own, outcomes[: len(own)], strict=True)) == {topic: "done" for topic in own}
    assert sorted(got) == sorted(own)
    for topic, outcome in zip(others, outcomes[len(own) :], strict=True):
        assert outcome != "done", f"node-1 published to {topic}"
    assert {topic.replace("/", ".") for topic in others} <= shipped_rabbitmq.refused("node-1")


@pytest.mark.long(25)
async def test_a_node_reads_only_settings_the_coordinator_status_and_its_receipts(
    shipped_rabbitmq: ShippedRabbitMq,
) -> None:
    t = bus.Topics(CLUSTER)
    allowed = [
        t.settings("+"),
        t.settings("llama"),
        t.coordinator_status(),
        t.receipt("+", "node-1"),
    ]
    denied = [
        t.receipt("+", "+"),
        t.receipt("llama", "node-2"),
        t.report("+", "+"),
        t.report("llama", "node-2"),
        t.ack("llama", "+"),
        t.telemetry("+"),
        t.status("node-2"),
        "hyperagent/v1/#",
        f"hyperagent/v1/{CLUSTER}/job/#",
    ]
    # one at a time: a subscription needs the session queue of the node's own client id
    granted = {
        topic: await attempt(shipped_rabbitmq, "node-1", "subscribe", topic)
        for topic in allowed + denied
    }
    assert {topic: granted[topic] for topic in allowed} == {
        topic: "Granted QoS 1" for topic in allowed
    }
    for topic in denied:
        assert granted[topic] != "Granted QoS 1", f"node-1 subscribed to {topic}"
    binding_keys = {topic.replace("/", ".").replace("+", "*") for topic in denied}
    assert binding_keys <= shipped_rabbitmq.refused("node-1")


async def test_the_coordinator_status_reaches_every_node(shipped_rabbitmq: ShippedRabbitMq) -> None:
    t = bus.Topics(CLUSTER)
    async with client(shipped_rabbitmq, "coordinator") as coordinator:
        await coordinator.publish(t.coordinator_status(), b"online", qos=1, retain=True)
    for node_name in ("node-1", "node-2"):
        async with client(shipped_rabbitmq, node_name) as node:
            await node.subscribe(t.coordinator_status(), qos=1)
            async with asyncio.timeout(10):
                message = await anext(aiter(node.messages))
        assert message.payload == b"online"


async def test_only_the_coordinator_writes_settings(shipped_rabbitmq: ShippedRabbitMq) -> None:
    t = bus.Topics(CLUSTER)
    async with client(shipped_rabbitmq, "node-2") as node:
        await node.subscribe(t.settings("+"), qos=1)
        async with client(shipped_rabbitmq, "coordinator") as coordinator:
            await coordinator.publish(t.settings("llama"), b"v1", qos=1)
        async with asyncio.timeout(10):
            message = await anext(aiter(node.messages))
    assert message.payload == b"v1"


async def test_the_coordinator_writes_a_nodes_receipts(shipped_rabbitmq: ShippedRabbitMq) -> None:
    """A refused publish would end the coordinator's connection on RabbitMQ."""
    t = bus.Topics(CLUSTER)
    async with client(shipped_rabbitmq, "node-1") as node:
        await node.subscribe(t.receipt("+", "node-1"), qos=1)
        async with client(shipped_rabbitmq, "coordinator") as coordinator:
            await coordinator.publish(t.receipt("llama", "node-1"), b"receipt", qos=1)
        async with asyncio.timeout(10):
            message = await anext(aiter(node.messages))
    assert message.payload == b"receipt"


async def test_a_node_cannot_take_the_coordinator_s_session(
    shipped_rabbitmq: ShippedRabbitMq,
) -> None:
    t = bus.Topics(CLUSTER)
    async with client(shipped_rabbitmq, "coordinator", clean_session=False) as coordinator:
        await coordinator.subscribe(t.report("+", "+"), qos=1)
    queues = shipped_rabbitmq.ctl("-s", "list_queues", "-p", "hyperagent", "name", "type")
    session = f"mqtt-subscription-{client_id('coordinator')}qos1"
    assert f"{session}\tquorum" in queues, queues
    async with client(shipped_rabbitmq, "node-1") as node:
        await node.publish(t.report("llama", "node-1"), b"queued for the coordinator", qos=1)
    with pytest.raises(aiomqtt.MqttError):
        async with (
            asyncio.timeout(10),
            client(
                shipped_rabbitmq, "node-1", identifier=client_id("coordinator"), clean_session=False
            ) as thief,
        ):
            result = await thief.subscribe(t.report("+", "+"), qos=1)
            assert [getattr(r, "value", r) for r in result] != [1]  # type: ignore[union-attr]
            async with asyncio.timeout(3):
                stolen = await anext(aiter(thief.messages))
            pytest.fail(f"node-1 read the coordinator's queued {stolen.payload!r}")
    async with client(shipped_rabbitmq, "coordinator", clean_session=False) as coordinator:
        async with asyncio.timeout(10):
            message = await anext(aiter(coordinator.messages))
        await coordinator.unsubscribe(t.report("+", "+"))
    assert message.payload == b"queued for the coordinator"


async def test_the_agent_connects_with_its_config(
    shipped_rabbitmq: ShippedRabbitMq, tmp_path: Path
) -> None:
    password = tmp_path / "node-1.password"
    password.write_text(PASSWORDS["node-1"] + "\n")
    config = build_config(
        {
            "node": "node-1",
            "cluster": CLUSTER,
            "mqtt": {
                "url": f"mqtts://127.0.0.1:{shipped_rabbitmq.port}",
                "password_file": str(password),
                "tls_ca_file": str(shipped_rabbitmq.certs / "ca.crt"),
            },
        }
    )
    link = bus.link_from_config(
        config, client_id("node-1"), status_node="node-1", username="node-1"
    )

    settings: list[bytes] = []

    async def record(topic: str, payload: bytes) -> None:
        settings.append(payload)

    topics = bus.Topics(CLUSTER)
    link.subscribe(topics.settings("+"), 1, record)
    async with client(shipped_rabbitmq, "coordinator") as coordinator:
        await coordinator.subscribe(topics.status("node-1"), qos=1)
        task = asyncio.create_task(link.run())
        try:
            async with asyncio.timeout(10):
                message = await anext(aiter(coordinator.messages))
                await coordinator.publish(topics.settings("j"), b"to node-1", qos=1)
                while not settings:
                    await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert bus.decode(message.payload, "status")["state"] == "online"  # type: ignore[arg-type]
    assert settings == [b"to node-1"]  # the agent's user reads the settings topics


async def test_a_password_that_begins_with_a_dash_is_a_password(
    shipped_rabbitmq: ShippedRabbitMq,
) -> None:
    """secrets.token_urlsafe begins one password in 64 with "-": the script must hand it to
    rabbitmqctl as a password, not as an option, both on creating the user and on changing it."""
    script = SHIPPED / "hyperagent-rabbitmq-users"
    topics = bus.Topics(CLUSTER)
    for password in ("-_Cr65Q3lIsERDOtnYUiQA", "--q"):
        shipped_rabbitmq.ctl(str(ACL), stdin=f"node-9 {password}\n", script=script)
        async with client(shipped_rabbitmq, "node-9", password) as node:
            await node.publish(topics.status("node-9"), b"online", qos=1)
    with pytest.raises(aiomqtt.MqttError):
        async with client(shipped_rabbitmq, "node-9", "-_Cr65Q3lIsERDOtnYUiQA"):
            pytest.fail("node-9's first password still works after the change")


async def test_run_again_the_script_sets_a_new_password(shipped_rabbitmq: ShippedRabbitMq) -> None:
    script = SHIPPED / "hyperagent-rabbitmq-users"
    try:
        shipped_rabbitmq.ctl(str(ACL), stdin="node-2 a new one\n", script=script)
        async with client(shipped_rabbitmq, "node-2", "a new one") as renewed:
            await renewed.publish(bus.Topics(CLUSTER).status("node-2"), b"online", qos=1)
        with pytest.raises(aiomqtt.MqttError):
            async with client(shipped_rabbitmq, "node-2"):
                pytest.fail("node-2's old password still works")
    finally:
        shipped_rabbitmq.ctl(str(ACL), stdin=f"node-2 {PASSWORDS['node-2']}\n", script=script)
    refused = subprocess.run(
        [str(script), str(ACL)],
        input="gpu-017.example secret\n",
        env={**shipped_rabbitmq.env, "RABBITMQCTL": str(shipped_rabbitmq.ctl_script)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused
    assert "gpu-017.example: a node name is letters, digits" in refused.stderr

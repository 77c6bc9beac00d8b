"""MQTT codec, signatures, and the connection loop against a real mosquitto on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator

import aiomqtt
import orjson
import pytest

from hyperagent import bus
from hyperagent.errors import PayloadError
from hyperagent.readings import Kind
from hyperagent.signing import SigningKey

KEY = SigningKey.generate()


@contextlib.asynccontextmanager
async def running(link: bus.MqttLink, connected: bool = True) -> AsyncIterator[None]:
    """``link.run()`` in a task for the block, entered once the link is connected (unless
    ``connected`` is false); the task is cancelled on the way out."""
    task = asyncio.create_task(link.run())
    try:
        if connected:
            async with asyncio.timeout(10):
                await link.connected.wait()
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_topics() -> None:
    t = bus.Topics("prod")
    assert t.telemetry("n1") == "hyperagent/v1/prod/node/n1/telemetry"
    assert t.settings("j") == "hyperagent/v1/prod/job/j/settings"
    assert t.ack("llama", "n1") == "hyperagent/v1/prod/job/llama/ack/n1"
    assert t.name_in(t.ack("llama", "n1")) == "llama"
    assert t.sender_in(t.report("llama", "n1")) == "n1"
    with pytest.raises(PayloadError):
        t.name_in("hyperagent/v1/other/job/j/ack/n1")
    with pytest.raises(PayloadError):
        t.sender_in(t.settings("llama"))


def test_sign_and_verify() -> None:
    """More in tests/test_signing.py."""
    trusted = KEY.trusted()
    message = bus.sign({"job": "j", "version": 3, "settings": {"bucket_mb": 8}}, KEY)
    assert bus.verify(message, trusted)
    assert not bus.verify(message, SigningKey.generate().trusted())
    assert not bus.verify({**message, "version": 4}, trusted)
    assert not bus.verify({**message, "settings": {"bucket_mb": 16}}, trusted)
    assert not bus.verify({k: v for k, v in message.items() if k != "signature"}, trusted)
    assert bus.verify(orjson.loads(bus.encode(message)), trusted)  # survives the wire


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"{", "ack"),
        (b'"text"', "ack"),
        (b'{"schema": 2, "job": "j", "node": "n", "version": 1, "ok": true}', "ack"),
        (b'{"schema": 1, "job": "j", "node": "n", "version": "1", "ok": true}', "ack"),
        (b'{"schema": 1, "job": "j", "node": "n", "version": true, "ok": true}', "ack"),
        (b'{"schema": 1, "job": "j", "node": "n", "version": 1}', "ack"),
    ],
)
def test_invalid_payloads(payload: bytes, kind: str) -> None:
    with pytest.raises(PayloadError):
        bus.decode(payload, kind)


def test_valid_ack() -> None:
    payload = bus.encode({"job": "j", "node": "n", "version": 1, "ok": True})
    assert bus.decode(payload, "ack")["version"] == 1


async def _collect(url_port: int, topic: str, count: int, timeout_s: float = 10) -> list[bytes]:
    got: list[bytes] = []
    async with aiomqtt.Client("127.0.0.1", url_port, identifier="test-listener") as client:
        await client.subscribe(topic, qos=1)
        async with asyncio.timeout(timeout_s):
            async for message in client.messages:
                got.append(bytes(message.payload))  # type: ignore[arg-type]
                if len(got) >= count:
                    break
    return got


async def test_link_publishes_subscribes_and_keeps_status(mosquitto) -> None:  # type: ignore[no-untyped-def]
    topics = bus.Topics("t")
    received: list[tuple[str, bytes]] = []

    async def handler(topic: str, payload: bytes) -> None:
        received.append((topic, payload))
        raise RuntimeError("a broken handler must not stop the link")

    link = bus.MqttLink(
        "127.0.0.1",
        mosquitto.port,
        "node-a",
        will=bus.status_message(topics, "node-a", "offline"),
        on_connect=lambda: [bus.status_message(topics, "node-a", "online")],
    )
    link.subscribe(topics.settings("+"), 1, handler)
    async with running(link):
        status = await _collect(mosquitto.port, topics.status("node-a"), 1)
        assert bus.decode(status[0], "status")["state"] == "online"  # retained
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as other:
            await other.publish(topics.settings("j"), b"one", qos=1)
            await other.publish(topics.settings("j"), b"two", qos=1)
        async with asyncio.timeout(10):
            while len(received) < 2:
                await asyncio.sleep(0.01)
        assert [p for _, p in received] == [b"one", b"two"] and link.handler_errors == 2
        for i in range(5):
            link.publish(topics.report("j", "n1"), f"r{i}".encode(), qos=1)
        assert await link.flush(10)


async def test_an_idle_link_keeps_its_session_with_housekeeping_on_whole_seconds(mosquitto) -> None:  # type: ignore[no-untyped-def]
    """paho's keepalive pings run from the link's own housekeeping task, on whole seconds of
    the loop's clock: an idle link with a 2 s keepalive (the broker drops a client silent for
    3 s) keeps its one session for 5 s."""
    link = bus.MqttLink("127.0.0.1", mosquitto.port, "idle-node", keepalive_s=2)
    async with running(link):
        client = link._client
        assert client is not None
        housekeeping = client._misc_task  # type: ignore[attr-defined]
        assert housekeeping is not None and housekeeping.get_name() == "mqtt-misc"
        await asyncio.sleep(5)
        assert link.connects == 1 and link.connected.is_set() and not housekeeping.done()


async def test_outbox_is_bounded_while_broker_is_down(persistent_mosquitto) -> None:  # type: ignore[no-untyped-def]
    broker = persistent_mosquitto
    report_topic = "hyperagent/v1/t/job/j/report"
    # a listener with a persistent session, so it cannot miss what arrives while it is away
    async with aiomqtt.Client(
        "127.0.0.1", broker.port, identifier="listener", clean_session=False
    ) as listener:
        await listener.subscribe(report_topic, qos=1)
    broker.stop()
    link = bus.MqttLink(
        "127.0.0.1", broker.port, "node-b", outbox_size=10, backoff_min_s=0.1, backoff_max_s=0.3
    )
    async with running(link, connected=False):
        for i in range(100):
            link.publish("hyperagent/v1/t/node/b/telemetry", str(i).encode())  # never blocks
        link.publish(report_topic, b"keep", qos=1)
        assert link.dropped == 90 and link.queued == 11
        await asyncio.sleep(0.5)
        assert not link.connected.is_set()
        broker.start()
        assert await link.flush(10)
        got = []
        async with aiomqtt.Client(
            "127.0.0.1", broker.port, identifier="listener", clean_session=False
        ) as listener:
            async with asyncio.timeout(10):
                async for message in listener.messages:
                    got.append(bytes(message.payload))  # type: ignore[arg-type]
                    break
        assert got == [b"keep"]


async def test_last_will_says_offline_when_a_node_dies(mosquitto) -> None:  # type: ignore[no-untyped-def]
    script = textwrap.dedent(f"""
        import asyncio
        from hyperagent import bus
        async def main():
            t = bus.Topics("t")
            link = bus.MqttLink("127.0.0.1", {mosquitto.port}, "node-c", keepalive_s=5,
                will=bus.status_message(t, "node-c", "offline"),
                on_connect=lambda: [bus.status_message(t, "node-c", "online")])
            task = asyncio.create_task(link.run())
            await link.connected.wait()
            print("up", flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 20)
        assert line.strip() == b"up"
        listener = asyncio.create_task(
            _collect(mosquitto.port, "hyperagent/v1/t/node/node-c/status", 2)
        )
        await asyncio.sleep(0.3)
        child.kill()
        states = [bus.decode(p, "status")["state"] for p in await listener]
        assert states == ["online", "offline"]
    finally:
        child.kill()
        child.wait(10)


def test_buffered_socket_serves_paho_from_one_read() -> None:
    import socket

    left, right = socket.socketpair()
    left.setblocking(False)
    try:
        buffered = bus._BufferedSocket(left, size=8)
        assert not buffered.fill() and not buffered.unread  # nothing there yet
        with pytest.raises(BlockingIOError):
            buffered.recv(1)
        right.sendall(b"abcdefghij")
        assert buffered.fill() and buffered.unread
        assert [buffered.recv(1), buffered.recv(2), buffered.recv(100)] == [b"a", b"bc", b"defgh"]
        assert not buffered.unread
        with pytest.raises(BlockingIOError):
            buffered.recv(4)  # never reads the socket itself: only fill() does
        assert buffered.fill() and buffered.recv(4) == b"ij"
        right.close()
        assert buffered.fill() and buffered.unread and buffered.recv(1) == b""  # end of stream
        assert buffered.pending() == 0 and buffered.fileno() == left.fileno()
    finally:
        left.close()
        right.close()


async def test_link_takes_a_burst_in_order_and_pauses_reading(mosquitto, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Thousands of messages at once all reach the handler, in order; while the handler is
    stuck the link stops reading past a small inbox (the broker holds the rest)."""
    monkeypatch.setattr(bus, "INBOX_HIGH", 50)
    monkeypatch.setattr(bus, "READ_CHUNKS", 1)
    topic = "hyperagent/v1/t/node/n1/telemetry"
    received: list[bytes] = []
    go = asyncio.Event()
    inbox_peak = 0
    paused = False

    async def handler(topic_: str, payload: bytes) -> None:
        nonlocal inbox_peak, paused
        assert topic_ == topic
        received.append(payload)
        await go.wait()
        inbox_peak = max(inbox_peak, len(link._inbox))
        paused = paused or link._resume_reading is not None

    link = bus.MqttLink("127.0.0.1", mosquitto.port, "burst")
    link.subscribe("hyperagent/v1/t/node/+/telemetry", 0, handler)
    async with running(link):
        assert not link._legacy_receive  # the link reads the socket itself
        count = 3000
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as other:
            for i in range(count):
                await other.publish(topic, b"%d" % i, qos=0)
        await asyncio.sleep(0.5)  # the handler is stuck at the first message meanwhile
        assert len(received) == 1 and len(link._inbox) < count - 1
        go.set()
        async with asyncio.timeout(20):
            while len(received) < count:
                await asyncio.sleep(0.01)
        assert received == [b"%d" % i for i in range(count)]
        # one socket read's worth of (at least 40-byte) packets past the mark, at most
        assert paused and inbox_peak <= 50 + (1 << 16) // 40
        assert link.handler_errors == 0


async def test_link_gets_what_waited_for_it_and_reconnects(persistent_mosquitto) -> None:  # type: ignore[no-untyped-def]
    """QoS 1 messages queued for a persistent session arrive on reconnect (some may come in
    before the link subscribes again), and the link keeps receiving after a broker restart."""
    broker = persistent_mosquitto
    topic = "hyperagent/v1/t/job/j/report"
    received: list[bytes] = []

    async def handler(topic_: str, payload: bytes) -> None:
        received.append(payload)

    def make_link() -> bus.MqttLink:
        link = bus.MqttLink(
            "127.0.0.1",
            broker.port,
            "keeper",
            persistent_session=True,
            backoff_min_s=0.1,
            backoff_max_s=0.3,
        )
        link.subscribe("hyperagent/v1/t/job/+/report", 1, handler)
        return link

    async def wait_for(count: int) -> None:
        async with asyncio.timeout(20):
            while len(received) < count:
                await asyncio.sleep(0.01)

    link = make_link()
    task = asyncio.create_task(link.run())
    async with asyncio.timeout(10):
        await link.connected.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    async with aiomqtt.Client("127.0.0.1", broker.port) as other:
        for i in range(200):
            await other.publish(topic, b"q%d" % i, qos=1)
    link = make_link()
    async with running(link, connected=False):
        await wait_for(200)
        assert received == [b"q%d" % i for i in range(200)]
        broker.stop()
        broker.start()
        async with asyncio.timeout(20):
            while link.connects < 2 or not link.connected.is_set():
                await asyncio.sleep(0.05)
        async with aiomqtt.Client("127.0.0.1", broker.port) as other:
            await other.publish(topic, b"after", qos=1)
        await wait_for(201)
        assert received[-1] == b"after"


async def test_link_falls_back_to_aiomqtts_iterator(mosquitto, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Should aiomqtt's internals this link relies on change, it receives as aiomqtt does."""
    monkeypatch.setattr(bus.MqttLink, "_take_over_receiving", lambda self, client: None)
    received: list[bytes] = []

    async def handler(topic: str, payload: bytes) -> None:
        received.append(payload)

    link = bus.MqttLink("127.0.0.1", mosquitto.port, "legacy")
    link.subscribe("hyperagent/v1/t/job/+/ack", 1, handler)
    async with running(link):
        assert link._legacy_receive
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as other:
            for i in range(50):
                await other.publish("hyperagent/v1/t/job/j/ack", b"%d" % i, qos=1)
        async with asyncio.timeout(10):
            while len(received) < 50:
                await asyncio.sleep(0.01)
        assert received == [b"%d" % i for i in range(50)]


async def test_a_failing_handler_is_logged_once_per_distinct_error_and_counted(
    mosquitto,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler that fails on every message of a flood writes one log line (with its
    traceback), not one per message; every failure is counted under its subscription
    filter, and a different error gets its own line."""
    settings = "hyperagent/v1/t/job/+/settings"
    received = 0

    async def handler(topic: str, payload: bytes) -> None:
        nonlocal received
        received += 1
        if payload == b"other":
            raise ValueError("another problem")
        raise KeyError("version")

    async def quiet(topic: str, payload: bytes) -> None:
        """A handler that never fails: its counter must stay at 0."""

    link = bus.MqttLink("127.0.0.1", mosquitto.port, "failing")
    link.subscribe(settings, 1, handler)
    link.subscribe("hyperagent/v1/t/node/+/status", 1, quiet)
    caplog.set_level(logging.ERROR, logger="hyperagent.bus")
    async with running(link):
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as other:
            for i in range(1000):
                await other.publish(f"hyperagent/v1/t/job/j{i % 7}/settings", b"{}", qos=1)
            await other.publish("hyperagent/v1/t/job/j/settings", b"other", qos=1)
        async with asyncio.timeout(20):
            while received < 1001:
                await asyncio.sleep(0.01)
    lines = [r for r in caplog.records if r.name == "hyperagent.bus"]
    assert len(lines) == 2, [r.getMessage() for r in lines]
    assert "KeyError: 'version'" in lines[0].getMessage() and lines[0].exc_info is not None
    assert "ValueError: another problem" in lines[1].getMessage() and lines[1].exc_info is None
    counted = {r.labels["handler"]: r.value for r in link.handler_error_readings()}
    assert counted == {settings: 1001, "hyperagent/v1/t/node/+/status": 0}
    assert all(r.kind is Kind.COUNTER for r in link.handler_error_readings())


async def test_follow_gets_a_retained_message_on_any_broker_and_unfollow_ends_it(
    broker_url: str,
) -> None:
    """A followed topic's retained message arrives (RabbitMQ serves it to no wildcard), its
    handler is called once per delivery though a wildcard with the same handler matches too,
    following again changes nothing, and after ``unfollow`` nothing more comes."""
    port = int(broker_url.rsplit(":", 1)[1])
    root = f"hyperagent/v1/follow-{uuid.uuid4().hex[:8]}"
    topic, other = f"{root}/node/n1/status", f"{root}/node/n2/status"
    async with aiomqtt.Client("127.0.0.1", port) as publisher:
        await publisher.publish(topic, b"retained", qos=1, retain=True)
    received: list[tuple[str, bytes]] = []

    async def handler(topic_: str, payload: bytes) -> None:
        received.append((topic_, payload))

    link = bus.MqttLink("127.0.0.1", port, f"follower-{uuid.uuid4().hex[:6]}")
    link.subscribe(f"{root}/other/+", 1, handler)
    async with running(link):
        link.follow(topic, 1, handler)
        link.follow(topic, 1, handler)
        async with asyncio.timeout(10):
            while (topic, b"retained") not in received:
                await asyncio.sleep(0.02)
        assert link.followed == {topic}
        assert link.handlers_for(topic) == (handler,)
        link.follow(other, 1, handler)
        link.unfollow(topic)
        link.unfollow(topic)
        async with aiomqtt.Client("127.0.0.1", port) as publisher:
            async with asyncio.timeout(10):
                while (other, b"live") not in received:  # subscribed once the unfollow went
                    await publisher.publish(other, b"live", qos=1)
                    await asyncio.sleep(0.1)
            await publisher.publish(topic, b"gone", qos=1)
            await publisher.publish(topic, b"", qos=1, retain=True)
            await publisher.publish(other, b"last", qos=1)
        async with asyncio.timeout(10):
            while (other, b"last") not in received:
                await asyncio.sleep(0.02)
    assert received.count((topic, b"retained")) == 1
    assert (topic, b"gone") not in received and link.followed == {other}


async def test_followed_topics_are_subscribed_again_after_a_reconnect(mosquitto) -> None:  # type: ignore[no-untyped-def]
    topic = "hyperagent/v1/t/job/j/settings"
    received: list[bytes] = []

    async def handler(topic_: str, payload: bytes) -> None:
        received.append(payload)

    link = bus.MqttLink("127.0.0.1", mosquitto.port, "refollower", backoff_min_s=0.1)
    link.follow(topic, 1, handler)
    with pytest.raises(ValueError):
        link.follow("hyperagent/v1/t/job/+/settings", 1, handler)
    async with running(link):
        mosquitto.stop()
        mosquitto.start()
        async with asyncio.timeout(20):
            while link.connects < 2 or not link.connected.is_set():
                await asyncio.sleep(0.05)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as publisher:
            await publisher.publish(topic, b"after", qos=1)
        async with asyncio.timeout(10):
            while b"after" not in received:
                await asyncio.sleep(0.02)

"""Several broker addresses (``mqtt.url`` a list): a link connects to them in turn, to the next
at once when the one in use dies, and loses no QoS 1 message; a tuning whose broker is killed
mid-trial goes on on the other, against two real mosquitto processes on loopback."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import aiomqtt
import orjson
import pytest

from hyperagent import bus
from hyperagent.config import build_config
from hyperagent.coordinator import Coordinator
from hyperagent.demo import JOB, simulated_cluster
from hyperagent.errors import ConfigError
from hyperagent.tuner.tuning import JobTuning as JobState

from conftest import Mosquitto, free_port

pytestmark = pytest.mark.timeout(120)


def _kill(broker: Mosquitto) -> None:
    assert broker.process is not None
    broker.process.send_signal(signal.SIGKILL)
    broker.process.wait(10)
    broker.process = None


def _brokers(*brokers: Mosquitto | int) -> list[bus.Broker]:
    out = []
    for b in brokers:
        port = b if isinstance(b, int) else b.port
        out.append(bus.Broker("127.0.0.1", port, url=f"mqtt://127.0.0.1:{port}"))
    return out


@pytest.fixture
def two_brokers(tmp_path: Path) -> Any:
    pair = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        broker = Mosquitto(tmp_path / name)
        broker.start()
        pair.append(broker)
    yield pair
    for broker in pair:
        broker.stop()


def test_mqtt_url_takes_a_list_and_checks_each_address(tmp_path: Path) -> None:
    config = build_config({"mqtt": {"url": ["mqtt://10.0.0.1", "mqtt://10.0.0.2:1884"]}})
    assert [(b.host, b.port, b.tls) for b in config.mqtt.brokers] == [
        ("10.0.0.1", 1883, False),
        ("10.0.0.2", 1884, False),
    ]
    assert build_config({"mqtt": {"url": "mqtt://h:7"}}).mqtt.brokers[0].port == 7
    for url, reason in [
        (
            ["mqtt://a", "http://b"],
            "entry 1: expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT], got 'http://b'",
        ),
        (["mqtt://a", "mqtt://b:99999"], "entry 1: bad port in 'mqtt://b:99999'"),
        ([], "lists no broker: give one URL or a list of them"),
        (["mqtt://a", "mqtt://a"], "lists a URL twice"),
    ]:
        with pytest.raises(ConfigError) as e:
            build_config({"mqtt": {"url": url}})
        assert [(p.key, p.reason) for p in e.value.problems] == [("mqtt.url", reason)]
    with pytest.raises(ConfigError, match=r"needs tls_ca_file \(mqtts://b\)"):
        build_config({"mqtt": {"url": ["mqtt://a", "mqtts://b"]}})
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    mixed = build_config({"mqtt": {"url": ["mqtt://a", "mqtts://b"], "tls_ca_file": str(ca)}})
    link = bus.link_from_config(mixed, "c")
    assert [(b.port, b.tls is not None) for b in link.brokers] == [(1883, False), (8883, True)]
    assert not link.persistent_session  # an agent's default
    persistent = build_config({"mqtt": {"persistent_session": True}})
    assert bus.link_from_config(persistent, "agent").persistent_session
    clean = build_config({"mqtt": {"persistent_session": False}})
    assert not bus.link_from_config(clean, "c", persistent_session=True).persistent_session


async def test_a_link_tries_the_addresses_in_turn_and_fails_over_at_once(
    two_brokers: list[Mosquitto], caplog: pytest.LogCaptureFixture
) -> None:
    """The first address refuses: the link connects to the second (and says so, in the log and
    on /metrics); killing the broker in use, it is on the other within a second, and what it
    published meanwhile (QoS 1) all arrives there."""
    a, b = two_brokers
    dead = free_port()
    caplog.set_level(logging.INFO, "hyperagent.bus")
    link = bus.MqttLink(
        "unused", 0, "failover", brokers=_brokers(dead, a, b), backoff_min_s=0.2, backoff_max_s=1
    )
    received: dict[int, list[bytes]] = {a.port: [], b.port: []}

    async def listen(broker: Mosquitto, ready: asyncio.Event) -> None:
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier=f"l{broker.port}") as c:
            await c.subscribe("t/#", qos=1)
            ready.set()
            async for message in c.messages:
                received[broker.port].append(bytes(message.payload))  # type: ignore[arg-type]

    ready = [asyncio.Event(), asyncio.Event()]
    listeners = [asyncio.create_task(listen(x, r)) for x, r in zip((a, b), ready, strict=True)]
    task = asyncio.create_task(link.run())
    try:
        for r in ready:
            await asyncio.wait_for(r.wait(), 10)
        async with asyncio.timeout(10):
            await link.connected.wait()
        assert link.port == a.port
        [info] = [r for r in link.broker_readings() if r.name == "hyperagent_mqtt_broker_info"]
        assert info.labels == {"url": f"mqtt://127.0.0.1:{a.port}"}
        assert f"mqtt connected to mqtt://127.0.0.1:{a.port} as failover" in caplog.text
        for i in range(5):
            link.publish("t/x", b"before%d" % i, qos=1)
        assert await link.flush(5)
        async with asyncio.timeout(5):
            while len(received[a.port]) < 5:
                await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        killed = loop.time()
        _kill(a)
        for i in range(50):
            link.publish("t/x", b"after%d" % i, qos=1)
        async with asyncio.timeout(10):
            while not (link.connected.is_set() and link.port == b.port):
                await asyncio.sleep(0.01)
        failover_s = loop.time() - killed
        assert await link.flush(5) and not link.spool
        async with asyncio.timeout(5):
            while len(received[b.port]) < 50:
                await asyncio.sleep(0.01)
        assert received[a.port] == [b"before%d" % i for i in range(5)]
        assert received[b.port] == [b"after%d" % i for i in range(50)]
        assert failover_s < 1.0, failover_s
        [info] = [r for r in link.broker_readings() if r.name == "hyperagent_mqtt_broker_info"]
        assert info.labels == {"url": f"mqtt://127.0.0.1:{b.port}"}
        print(f"failed over to the second broker {failover_s * 1000:.0f} ms after the kill")
    finally:
        for t in (task, *listeners):
            t.cancel()
        await asyncio.gather(task, *listeners, return_exceptions=True)


async def test_every_address_down_backs_off_then_connects_when_one_comes(tmp_path: Path) -> None:
    """With no broker up the link waits (its backoff) after each round over the addresses,
    and connects to whichever comes up."""
    broker = Mosquitto(tmp_path)
    link = bus.MqttLink(
        "unused",
        0,
        "late",
        brokers=_brokers(free_port(), broker),
        backoff_min_s=0.1,
        backoff_max_s=0.4,
    )
    task = asyncio.create_task(link.run())
    try:
        await asyncio.sleep(1.0)
        assert not link.connected.is_set()
        broker.start()
        async with asyncio.timeout(5):
            await link.connected.wait()
        assert link.port == broker.port
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        broker.stop()


@pytest.mark.long(40)
async def test_a_tuning_goes_on_when_its_broker_is_killed_mid_trial(
    two_brokers: list[Mosquitto],
) -> None:
    """Coordinator and agents on the first of two brokers; it is killed during a trial: every
    daemon reconnects to the second at once, every report is accepted once, the spools drain,
    and no trial waits for a time-out."""
    a, b = two_brokers
    loop = asyncio.get_running_loop()
    outage: dict[str, float] = {}

    def kill_during_the_first_trial(state: JobState, record: Any) -> None:
        if record.index == 0 and "killed" not in outage:

            def kill() -> None:
                _kill(a)
                outage["killed"] = loop.time()

            loop.call_later(0.5, kill)

    accepted: Counter[tuple[int, str]] = Counter()
    original = Coordinator._route

    def counting_route(self: Coordinator, topic: str, payload: bytes, kind: str) -> None:
        original(self, topic, payload, kind)
        if kind == "report" and b'"partial":false' in payload:
            message = orjson.loads(payload)
            accepted[(message["version"], message["node"])] = 1

    Coordinator._route = counting_route  # type: ignore[method-assign]
    try:
        async with simulated_cluster(
            [a.url, b.url],
            nodes=3,
            trials=3,
            seed=4,
            speedup=10,
            on_trial=kill_during_the_first_trial,
            job_overrides={"abort_below": 0, "early_stop": False},  # every run measured whole
        ) as (coordinator, nodes, _):
            links = [coordinator.link, *(n.agent.link for n in nodes)]
            reconnected: list[float] = []

            async def watch(link: bus.MqttLink) -> None:
                while "killed" not in outage:
                    await asyncio.sleep(0.005)
                while not (link.connected.is_set() and link.port == b.port):
                    await asyncio.sleep(0.005)
                reconnected.append(loop.time() - outage["killed"])

            watchers = [asyncio.create_task(watch(link)) for link in links if link is not None]
            started = loop.time()
            await asyncio.wait_for(coordinator.run(until_tuned=True), 100)
            await asyncio.wait_for(asyncio.gather(*watchers), 5)
            took = loop.time() - started
            state = coordinator.jobs[JOB]
            sent = sum(n.agent.stats.reports_sent for n in nodes)
            spooled_left = sum(len(link.spool) for link in links if link is not None)
            on_b = [link is not None and link.port == b.port for link in links]
    finally:
        Coordinator._route = original  # type: ignore[method-assign]
    assert "killed" in outage
    runs = [*state.trials, *state.confirmations]
    assert [t.status for t in runs] == ["ok"] * 7
    for trial in runs:
        assert set(trial.reports) == {"node-0", "node-1", "node-2"}
    assert all(on_b), on_b
    assert spooled_left == 0
    assert sum(accepted.values()) == sent == 3 * 7
    assert took < 60, took  # trial_timeout_s is 60: none waited for it
    assert max(reconnected) < 1.0, reconnected
    print(
        f"tuning of 7 runs with a broker killed mid-trial: {took:.1f} s; the coordinator and "
        f"3 agents on the other broker within {max(reconnected) * 1000:.0f} ms"
    )

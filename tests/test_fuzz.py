"""Bad input never crashes a daemon: property-based tests (hypothesis) over everything that
comes from outside. Each input gets the documented error or a counted drop, and the valid
input that follows is still taken."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperagent import bus
from hyperagent.agent import Agent
from hyperagent.capture.nvidia_smi import parse_capture
from hyperagent.config import build_config
from hyperagent.coordinator import Coordinator
from hyperagent.errors import ConfigError, PayloadError, SourceError
from hyperagent.job import JobReporter, StepReport, decode, encode_step, parse_step
from hyperagent.replay import RecordingError, load_recording
from hyperagent.signing import SigningKey
from hyperagent.sources import Hardware, ipmi, pdu, rdma, rdma_ethtool, rdma_resources
from hyperagent.sources.host import parse_numa_balancing
from hyperagent.sources.job import JobSource, Peer
from hyperagent.tuner.tuning import Ack

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=30,
)
KEYS = [
    "schema",
    "job",
    "node",
    "version",
    "ok",
    "settings",
    "backend",
    "issued_at",
    "key_id",
    "signature",
    "nodes",
    "plan",
    "samples",
    "seconds",
    "throughput",
    "windows",
    "energy_j",
    "nonfinite_loss",
    "partial",
    "state",
    "ts",
    "indicators",
    "sources_up",
    "jobs",
    "trial",
    "xid_errors",
]
# objects that look like the real payloads: right keys, any values
payload_like = st.fixed_dictionaries({}, optional={k: json_values for k in KEYS})
payloads = st.one_of(
    st.binary(max_size=300),
    json_values.map(orjson.dumps),
    payload_like.map(orjson.dumps),
    payload_like.map(lambda d: orjson.dumps({**d, "schema": 1})),
)

KEY = SigningKey.generate()
TOPICS = bus.Topics("f")


def agent(tmp_path: Path) -> Agent:
    config = build_config(
        {
            "node": "n1",
            "cluster": "f",
            "mqtt": {"enabled": False},
            "agent": {"metrics_address": "", "state_dir": str(tmp_path)},
            "sources": {
                "nvml": {"enabled": False},
                "host": {"enabled": False},
                "job": {"enabled": False},
                "ipmi": {"enabled": False},
                "rdma": {"enabled": False},
                "pdu": {"enabled": False},
            },
        }
    )
    return Agent(config, Hardware(nvml=None), trusted_keys=KEY.trusted())


@FUZZ
@given(payload=payloads, kind=st.sampled_from(sorted(bus.SCHEMAS)))
def test_decode_raises_only_payload_error(payload: bytes, kind: str) -> None:
    try:
        message = bus.decode(payload, kind)
    except PayloadError:
        return
    for key in bus.SCHEMAS[kind]:
        assert key in message


@FUZZ
@given(payload=payloads)
def test_agent_never_crashes_on_settings(payload: bytes, tmp_path: Path) -> None:
    a = agent(tmp_path)
    asyncio.run(a.settings.on_settings(TOPICS.settings("j"), payload))
    asyncio.run(a._on_coordinator_status(TOPICS.coordinator_status(), payload))
    assert a.stats.applied == 0  # nothing unsigned is ever applied
    signed = bus.sign(
        {
            "job": "j",
            "version": 1,
            "trial": None,
            "nodes": ["n1"],
            "settings": {"bucket_mb": 8},
            "backend": {},
            "plan": None,
            "issued_at": time.time(),
        },
        KEY,
    )
    asyncio.run(a.settings.on_settings(TOPICS.settings("j"), bus.encode(signed)))
    assert a.stats.applied == 1 and a.applied_versions == {"j": 1}


@FUZZ
@given(
    payload=payloads,
    topic=st.sampled_from(["ack", "report", "status", "telemetry", "settings"]),
)
def test_coordinator_never_crashes_on_input(payload: bytes, topic: str, tmp_path: Path) -> None:
    config = build_config(
        {"cluster": "f", "coordinator": {"state_dir": str(tmp_path), "metrics_address": ""}}
    )
    coordinator = Coordinator(config, bus.MqttLink("127.0.0.1", 1, "x"), KEY)
    found = {"j": {"samples": 1, "step_s": 1.0, "attached": 1, "world_size": 1, "tune": True}}
    telemetry = {"node": "n1", "ts": 1.0, "indicators": {}, "sources_up": {}, "jobs": found}

    async def feed() -> None:
        handlers = {
            "ack": coordinator._on_ack,
            "report": coordinator._on_report,
            "status": coordinator._on_status,
            "telemetry": coordinator._on_telemetry,
            "settings": coordinator._on_settings,
        }
        if topic in ("ack", "report"):
            path = getattr(TOPICS, topic)("j", "n1")
        else:
            path = getattr(TOPICS, topic)("j" if topic == "settings" else "n1")
        await handlers[topic](path, payload)
        coordinator.readings()  # /metrics still renders
        await coordinator._on_telemetry(TOPICS.telemetry("n1"), bus.encode(telemetry))
        good = bus.encode({"job": "j", "node": "n1", "version": 3, "ok": True})
        await coordinator._on_ack(TOPICS.ack("j", "n1"), good)

    asyncio.run(feed())
    inbox = coordinator.tuned["j"].inbox
    events = [inbox.get_nowait() for _ in range(inbox.qsize())]
    assert isinstance(events[-1], Ack) and events[-1].message["version"] == 3


@FUZZ
@given(datagrams=st.lists(st.binary(max_size=200) | json_values.map(orjson.dumps), max_size=8))
def test_job_socket_garbage_is_counted_and_the_rest_taken(
    datagrams: list[bytes], tmp_path: Path
) -> None:
    source = JobSource(tmp_path / "job.sock")
    with contextlib.ExitStack() as stack:

        def peer() -> Peer:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            stack.enter_context(theirs)
            return Peer(stack.enter_context(ours), os.getpid(), os.getuid(), os.getgid())

        garbage = peer()
        for datagram in datagrams:
            source.receive(datagram, garbage)
        good = encode_step(StepReport("j", 0, 32, 0.5, 0.4, 0.1, 1.0, 0))
        source.receive(good, peer())
        assert source.jobs["j"].steps >= 1
    assert source.invalid <= len(datagrams)


@FUZZ
@given(samples=st.integers(0, 2**40), step=st.floats(0, 1e6), loss=st.none() | st.floats())
def test_step_roundtrip(samples: int, step: float, loss: float | None) -> None:
    message = decode(encode_step(StepReport("j", 0, samples, step, step, 0.0, loss, 0)))
    back = parse_step(message)
    assert back.samples == samples
    assert (back.loss is None) == (loss is None)
    if loss is not None and not math.isnan(loss):
        assert back.loss == loss


@FUZZ
@given(
    data=st.dictionaries(
        st.sampled_from(
            [
                "node",
                "cluster",
                "agent",
                "mqtt",
                "sources",
                "coordinator",
                "security",
                "actuation",
                "bogus",
            ]
        ),
        json_values,
        max_size=5,
    )
)
def test_config_gives_a_config_or_a_config_error(data: dict[str, Any]) -> None:
    try:
        build_config(data)
    except ConfigError as e:
        assert e.problems and all(p.key for p in e.problems)


@FUZZ
@given(text=st.text(max_size=400))
def test_text_parsers_raise_only_their_errors(text: str) -> None:
    for parse in (
        ipmi.parse_sdr_output,
        ipmi.parse_dcmi_power,
        rdma_resources.parse_rdma_qps,
        rdma_resources.parse_rdma_cqs,
        parse_numa_balancing,
        lambda t: rdma_ethtool.parse_ethtool_pause(t, "eth0"),
    ):
        with contextlib.suppress(SourceError):  # anything else fails the test
            parse(text)
    with contextlib.suppress(ValueError):
        parse_capture(text)
    for decode_walk in (pdu.decode_snmprec, pdu.decode_snmpwalk):
        try:
            binds = decode_walk(text)
        except SourceError:
            continue
        for profile in pdu.PROFILES.values():
            pdu.parse(profile, binds, "p")


@FUZZ
@given(
    version=st.sampled_from([1, 2]),
    lines=st.lists(st.binary(max_size=120) | json_values.map(orjson.dumps), max_size=5),
)
def test_recordings_load_or_raise_recording_error(
    version: int, lines: list[bytes], tmp_path: Path
) -> None:
    path = tmp_path / "recording.jsonl"
    header = orjson.dumps({"format": "hyperagent-recording", "version": version})
    path.write_bytes(b"\n".join([header, *lines]))
    try:
        recording = load_recording(path)
    except RecordingError:
        return
    assert recording.frames


@FUZZ
@given(
    files=st.dictionaries(
        st.sampled_from(
            [
                "state",
                "phys_state",
                "rate",
                "link_layer",
                "counters/port_xmit_data",
                "counters/port_rcv_data",
                "hw_counters/out_of_buffer",
            ]
        ),
        st.binary(max_size=40),
        min_size=1,
    )
)
def test_garbage_sysfs_is_skipped_or_refused(files: dict[str, bytes], tmp_path: Path) -> None:
    port = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    for name, content in files.items():
        (port / name).parent.mkdir(parents=True, exist_ok=True)
        (port / name).write_bytes(content)
    source = rdma.RdmaSource(tmp_path / "sys", None)
    with contextlib.suppress(SourceError):  # refused with a clear error, or read
        asyncio.run(source.read())


def test_reporter_survives_an_agent_that_answers_garbage(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as agent:
        agent.bind(str(tmp_path / "agent.sock"))
        agent.listen()
        reporter = JobReporter("j", socket_path=tmp_path / "agent.sock")
        connection, _ = agent.accept()
        with connection:
            for junk in (b"\x00", b"{}", b'{"v":1,"type":"settings","job":"j","version":-1}'):
                connection.send(junk)
            assert reporter.poll_settings() is None and reporter.version == 0
            assert reporter.connected
        reporter.close()

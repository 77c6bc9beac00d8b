"""The agent against a real mosquitto: telemetry out, signed settings in, acks, power caps."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from hyperagent import bus
from hyperagent.agent import Agent
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.config import Config, build_config
from hyperagent.job import JobReporter, JobSettings, encode_hello
from hyperagent.readings import Reading
from hyperagent.signing import SigningKey
from hyperagent.sources import Hardware

from conftest import REPO, free_port, wait_for_port

KEY = SigningKey.generate()


def limits_w(nvml: FakeNvml) -> set[float]:
    return {
        nvml.nvmlDeviceGetEnforcedPowerLimit(nvml.nvmlDeviceGetHandleByIndex(i)) / 1000
        for i in range(nvml.nvmlDeviceGetCount())
    }


class Harness:
    def __init__(self, agent: Agent, nvml: FakeNvml, port: int, socket_path: Path) -> None:
        self.agent, self.nvml, self.port, self.socket_path = agent, nvml, port, socket_path
        self.topics = bus.Topics("c")
        self.acks: list[dict[str, Any]] = []
        self.ranks: list[JobReporter] = []

    async def job_on_every_gpu(self) -> JobReporter:
        """Job ``j``'s rank: this test process, which NVML shows on every GPU (a power cap
        goes only on the GPUs a job is known to hold); returns once the agent knows them."""
        gpus = set(range(self.nvml.nvmlDeviceGetCount()))
        for gpu in gpus:
            self.nvml.set_processes(gpu, [os.getpid()])
        reporter = JobReporter("j", rank=0, socket_path=self.socket_path)
        reporter.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)
        await until(lambda: self.agent.job_gpus("j")[0] == gpus)
        self.ranks.append(reporter)  # connected while the harness lives
        return reporter

    async def send(
        self,
        version: int,
        settings: dict[str, Any],
        key: SigningKey = KEY,
        nodes: list[str] | None = None,
        issued_at: float | None = None,
        trial: int | None = None,
        plan: dict[str, Any] | None = None,
    ) -> None:
        message = {
            "job": "j",
            "version": version,
            "trial": trial,
            "nodes": nodes or ["n1"],
            "settings": settings,
            "backend": {},
            "plan": plan,
            "issued_at": time.time() if issued_at is None else issued_at,
        }
        async with aiomqtt.Client("127.0.0.1", self.port) as client:
            online = bus.status_message(
                self.topics, "coordinator", "online", self.topics.coordinator_status()
            )
            await client.publish(online.topic, online.payload, qos=1, retain=True)
            await client.publish(
                self.topics.settings("j"), bus.encode(bus.sign(message, key)), qos=1, retain=True
            )


def node_config(url: str, state: Path, **sections: Any) -> Config:
    """Node n1 of cluster c on ``url``, its state and job socket under ``state``."""
    return build_config(
        {
            "node": "n1",
            "cluster": "c",
            "mqtt": {"url": url, "reconnect_min_s": 0.1},
            "agent": {"interval_s": 0.2, "metrics_address": "", "state_dir": str(state)},
            "sources": {"job": {"socket": str(state / "job.sock")}},
            **sections,
        }
    )


@contextlib.asynccontextmanager
async def running_agent(
    config: Config, capture: Path, broker_port: int, job_socket: Path
) -> AsyncIterator[Harness]:
    """An agent over a fake NVML replaying ``capture``, running and connected to the broker
    until the block ends."""
    nvml = FakeNvml.from_capture(capture)
    agent = Agent.from_config(config, Hardware(nvml=nvml), trusted_keys=KEY.trusted())
    task = asyncio.create_task(agent.run())
    try:
        async with asyncio.timeout(10):
            await agent.ready.wait()
            await agent.link.connected.wait()  # type: ignore[union-attr]
        yield Harness(agent, nvml, broker_port, job_socket)
    finally:
        task.cancel()
        async with asyncio.timeout(10):  # stopping waits for no hung device call
            await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def harness(mosquitto, tmp_path: Path, nvidia_smi_dir: Path) -> AsyncIterator[Harness]:  # type: ignore[no-untyped-def]
    config = node_config(mosquitto.url, tmp_path, actuation={"max_power_w": 225})
    capture = nvidia_smi_dir / "gtx-8card.xml"
    async with running_agent(config, capture, mosquitto.port, tmp_path / "job.sock") as h:
        yield h


async def until(predicate, timeout_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_settings_applied_acked_and_handed_to_the_job(harness: Harness) -> None:
    reporter = await harness.job_on_every_gpu()
    async with aiomqtt.Client("127.0.0.1", harness.port) as listener:
        await listener.subscribe(harness.topics.ack("j", "n1"), qos=1)
        await harness.send(
            1, {"bucket_mb": 8, "chunk_kb": 256, "allreduce": "ring", "power_cap_w": 175}
        )
        async with asyncio.timeout(10):
            message = await anext(aiter(listener.messages))
        ack = bus.decode(message.payload, "ack")  # type: ignore[arg-type]
    assert ack["ok"] and ack["version"] == 1 and ack["node"] == "n1"
    assert ack["applied"]["power_cap_w"] == [175.0] * 8
    assert limits_w(harness.nvml) == {175.0}
    await until(lambda: reporter.poll_settings() is not None or reporter.version == 1)
    assert reporter.applied.settings == {"bucket_mb": 8, "chunk_kb": 256, "allreduce": "ring"}  # type: ignore[union-attr]
    reporter.close()


async def test_forged_stale_foreign_and_out_of_bounds_settings_change_nothing(
    harness: Harness,
) -> None:
    agent = harness.agent
    await harness.job_on_every_gpu()
    await harness.send(5, {"power_cap_w": 150})
    await until(lambda: agent.applied_versions.get("j") == 5)
    await harness.send(6, {"power_cap_w": 100}, key=SigningKey.generate())
    await until(lambda: agent.stats.rejected["unknown_key"] == 1)
    await harness.send(4, {"power_cap_w": 125})
    await until(lambda: agent.stats.rejected["stale"] == 1)
    await harness.send(7, {"power_cap_w": 125}, nodes=["some-other-node"])
    await harness.send(8, {"power_cap_w": 240})  # above this node's max_power_w = 225
    await until(lambda: agent.stats.rejected["refused"] == 1)
    assert limits_w(harness.nvml) == {150.0}
    assert agent.applied_versions["j"] == 5 and agent.stats.applied == 1
    snapshot = await agent.collect_once()
    assert snapshot.value("hyperagent_settings_rejected_total", reason="unknown_key") == 1


async def test_telemetry_carries_indicators(harness: Harness) -> None:
    async with aiomqtt.Client("127.0.0.1", harness.port) as listener:
        await listener.subscribe(harness.topics.telemetry("n1"), qos=0)
        async with asyncio.timeout(10):
            message = await anext(aiter(listener.messages))
    payload = bus.decode(message.payload, "telemetry")  # type: ignore[arg-type]
    assert 0 < payload["indicators"]["qu_ratio"] < 1
    assert payload["sources_up"]["nvml/local"] == 1 and payload["gpu_power_w"] > 8 * 60
    assert payload["jobs"] == {} and payload["gpu_energy_j"] >= 0


async def test_power_limits_restored_when_the_agent_stops(
    mosquitto,
    tmp_path: Path,
    nvidia_smi_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    config = build_config(
        {
            "node": "n1",
            "cluster": "c",
            "mqtt": {"url": mosquitto.url},
            "agent": {"metrics_address": "", "state_dir": str(tmp_path)},
            "sources": {"job": {"socket": str(tmp_path / "j.sock")}},
        }
    )
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    agent = Agent.from_config(config, Hardware(nvml=nvml), trusted_keys=KEY.trusted())
    task = asyncio.create_task(agent.run())
    await until(lambda: agent.link.connected.is_set())  # type: ignore[union-attr]
    h = Harness(agent, nvml, mosquitto.port, tmp_path / "j.sock")
    await h.job_on_every_gpu()
    await h.send(1, {"power_cap_w": 125})
    await until(lambda: limits_w(nvml) == {125.0})
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert limits_w(nvml) == {250.0}


def test_replay_serves_metrics_that_promtool_accepts(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hyperagent.cli",
            "agent",
            "--replay",
            str(REPO / "fixtures/replay/v100s-8gpu-training"),
            "--no-broker",
            "--metrics-address",
            f"127.0.0.1:{port}",
            "--interval",
            "0.2",
        ],
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        wait_for_port(port, 30)
        body = b""
        for _ in range(50):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read()
            if b"hyperagent_qu_ratio" in body:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        text = body.decode()
        assert text.count("hyperagent_gpu_power_watts{") == 8
        for name in (
            "hyperagent_qu_ratio",
            "hyperagent_memory_pressure_ratio",
            "hyperagent_compute_entropy_ratio",
            "hyperagent_quantum_dispersion_ratio",
            'hyperagent_source_up{source="nvml",target="local"} 1.0',
        ):
            assert name in text
        assert "_created" not in text
        promtool = shutil.which("promtool")
        assert promtool, "promtool is not installed: apt-get install -y prometheus"
        check = subprocess.run(
            [promtool, "check", "metrics"], input=body, capture_output=True, timeout=30
        )
        assert check.returncode == 0 and not check.stdout and not check.stderr, check
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=20)
    assert agent.returncode == 0, err.decode()


def test_replay_of_a_directory_without_a_capture_fails_clearly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", "agent", "--replay", str(tmp_path), "--no-broker"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--replay" in result.stderr and "nvidia-smi.xml" in result.stderr


def test_metrics_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "hyperagent.cli",
                "agent",
                "--no-broker",
                "--replay",
                str(REPO / "fixtures/replay/v100s-8gpu-training"),
                "--metrics-address",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"agent.metrics_address: 127.0.0.1:{port}: Address already in use" in result.stderr


async def test_the_job_channel_reads_steps_as_they_come_only_while_a_trial_is_measured(
    harness: Harness,
) -> None:
    """Outside trials the job channel reads slow ranks in passes (one wake-up for many
    steps); a trial's windows and stall check need each step as it comes."""
    source = harness.agent.job_source
    assert source is not None and source.prompt is False
    plan = {"settle_steps": 1, "settle_s": 0, "measure_steps": 4, "measure_s": 0, "windows": 2}
    await harness.send(1, {"bucket_mb": 8}, trial=1, plan=plan)
    await until(lambda: source.prompt)
    await harness.send(2, {"bucket_mb": 16})  # the tuning's choice: nothing to measure
    await until(lambda: not source.prompt)


async def test_coordinator_loss_puts_the_power_limits_back(harness: Harness) -> None:
    await harness.job_on_every_gpu()
    await harness.send(1, {"power_cap_w": 150}, trial=3)
    await until(lambda: limits_w(harness.nvml) == {150.0})
    offline = bus.status_message(
        harness.topics, "coordinator", "offline", harness.topics.coordinator_status()
    )
    async with aiomqtt.Client("127.0.0.1", harness.port) as client:
        await client.publish(offline.topic, offline.payload, qos=1, retain=True)
    await until(lambda: limits_w(harness.nvml) == {250.0})
    # back online without a new version: the version it still applies is capped again
    online = bus.status_message(
        harness.topics, "coordinator", "online", harness.topics.coordinator_status()
    )
    async with aiomqtt.Client("127.0.0.1", harness.port) as client:
        await client.publish(online.topic, online.payload, qos=1, retain=True)
    await until(lambda: limits_w(harness.nvml) == {150.0})
    assert harness.agent.applied_versions == {"j": 1}


async def test_a_tuned_jobs_final_power_cap_stays_when_the_coordinator_goes(
    harness: Harness,
) -> None:
    """The final settings of a tuning (no trial) are what the job runs on: a coordinator that
    ends or is lost after it leaves them in place."""
    await harness.job_on_every_gpu()
    await harness.send(1, {"power_cap_w": 150})
    await until(lambda: limits_w(harness.nvml) == {150.0})
    offline = bus.status_message(
        harness.topics, "coordinator", "offline", harness.topics.coordinator_status()
    )
    async with aiomqtt.Client("127.0.0.1", harness.port) as client:
        await client.publish(offline.topic, offline.payload, qos=1, retain=True)
    await asyncio.sleep(2)  # a trial's cap is put back within a few ms of the message
    assert limits_w(harness.nvml) == {150.0}


async def test_the_applied_version_survives_a_restart(
    mosquitto,
    tmp_path: Path,
    nvidia_smi_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    """A restarted agent refuses an older version as stale (saying which it applies) and
    applies its own version again, caps included."""
    config = node_config(mosquitto.url, tmp_path)
    acks: list[dict[str, Any]] = []

    async def run_agent(nvml: FakeNvml) -> tuple[Harness, asyncio.Task[None]]:
        agent = Agent.from_config(config, Hardware(nvml=nvml), trusted_keys=KEY.trusted())
        task = asyncio.create_task(agent.run())
        async with asyncio.timeout(10):
            await agent.ready.wait()
            await agent.link.connected.wait()  # type: ignore[union-attr]
        return Harness(agent, nvml, mosquitto.port, tmp_path / "job.sock"), task

    first, task = await run_agent(FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml"))
    rank = await first.job_on_every_gpu()
    await first.send(5, {"power_cap_w": 175})
    await until(lambda: limits_w(first.nvml) == {175.0})
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert limits_w(first.nvml) == {250.0}  # put back on the way out

    again, task = await run_agent(FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml"))
    for gpu in range(again.nvml.nvmlDeviceGetCount()):
        again.nvml.set_processes(gpu, [os.getpid()])
    try:
        while not again.agent.job_source.attached("j"):  # type: ignore[union-attr]
            rank.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)  # it reconnects
            await asyncio.sleep(0.1)
        assert again.agent.applied_versions == {"j": 5}
        await until(lambda: limits_w(again.nvml) == {175.0})  # its retained v5, applied again
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as listener:
            await listener.subscribe(again.topics.ack("j", "n1"), qos=1)
            await again.send(3, {"power_cap_w": 200})  # a coordinator that lost its journal
            async with asyncio.timeout(10):
                async for message in listener.messages:
                    acks.append(bus.decode(message.payload, "ack"))
                    if acks[-1]["version"] == 3:
                        break
        assert acks[-1]["ok"] is False and acks[-1]["applied"] == {"version": 5}
        assert acks[-1]["error"].startswith("stale")
        assert limits_w(again.nvml) == {175.0}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_old_or_future_settings_are_refused(harness: Harness) -> None:
    await harness.job_on_every_gpu()
    for issued_at in (time.time() - 2 * 86400, time.time() + 3600):
        await harness.send(1, {"power_cap_w": 150}, issued_at=issued_at)
    await until(lambda: harness.agent.stats.rejected["expired"] == 2)
    assert harness.agent.applied_versions == {} and limits_w(harness.nvml) == {250.0}
    await harness.send(1, {"power_cap_w": 150}, issued_at=time.time() + 30)  # within the skew
    await until(lambda: limits_w(harness.nvml) == {150.0})


async def test_settings_that_miss_a_rank_turn_the_ack_into_a_refusal(harness: Harness) -> None:
    source = harness.agent.job_source
    assert source is not None
    reading = JobReporter("j", rank=0, socket_path=harness.socket_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stuck:
        stuck.connect(str(harness.socket_path))
        stuck.send(encode_hello("j", 1))  # a rank that stopped reading
        await until(lambda: source.attached("j") == 2)
        filler = JobSettings(0, {"note": "x" * 8000})
        while source.send_settings("j", filler) == 2:  # until its queue is full
            reading.poll_settings()
        async with aiomqtt.Client("127.0.0.1", harness.port) as listener:
            await listener.subscribe(harness.topics.ack("j", "n1"), qos=1)
            await harness.send(1, {"bucket_mb": 8})
            async with asyncio.timeout(10):
                ack = bus.decode((await anext(aiter(listener.messages))).payload, "ack")
    assert ack["ok"] is False and ack["error"] == "settings v1 reached 1 of 2 ranks"
    assert harness.agent.applied_versions == {}
    reading.close()


async def test_which_job_runs_on_which_gpu(harness: Harness) -> None:
    reporter = JobReporter("j", rank=0, socket_path=harness.socket_path, gpu=3)
    reporter.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)

    def attributed() -> list[Reading]:
        snapshot = harness.agent.snapshot
        readings = snapshot.readings if snapshot else ()
        return [r for r in readings if r.name == "hyperagent_gpu_job_info"]

    await until(lambda: attributed())
    (info,) = attributed()
    uuid = next(
        r.labels["uuid"]
        for r in harness.agent.snapshot.readings  # type: ignore[union-attr]
        if r.name == "hyperagent_gpu_info" and r.labels["gpu"] == "3"
    )
    user = pwd.getpwuid(os.getuid()).pw_name
    assert info.labels == {
        "gpu": "3",
        "uuid": uuid,
        "job_id": "j",
        "user": user,
        "slurm_job": "",
        "slurm_step": "",
    }
    reporter.close()
    await until(lambda: not attributed())


async def test_nvml_processes_tell_which_job_runs_on_which_gpu(harness: Harness) -> None:
    """The rank's pid (SO_PEERCRED) among a GPU's compute processes names its job there, even
    when the rank declared nothing."""
    harness.nvml.set_processes(5, [os.getpid()])  # this test process is the rank
    reporter = JobReporter("j", rank=0, socket_path=harness.socket_path)
    reporter.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)

    def attributed() -> dict[str, str]:
        snapshot = harness.agent.snapshot
        readings = snapshot.readings if snapshot else ()
        return {
            r.labels["gpu"]: r.labels["job_id"]
            for r in readings
            if r.name == "hyperagent_gpu_job_info"
        }

    await until(lambda: attributed() == {"5": "j"})
    reporter.close()


async def test_a_stopped_agent_says_offline(
    mosquitto,
    tmp_path: Path,
    nvidia_smi_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    config = build_config(
        {
            "node": "n9",
            "cluster": "c",
            "mqtt": {"url": mosquitto.url},
            "agent": {"metrics_address": "", "state_dir": str(tmp_path)},
            "sources": {"job": {"enabled": False}},
        }
    )
    agent = Agent.from_config(
        config,
        Hardware(nvml=FakeNvml.from_capture(nvidia_smi_dir / "tesla-t4.xml")),
        trusted_keys=KEY.trusted(),
    )
    task = asyncio.create_task(agent.run())
    await until(lambda: agent.link.connected.is_set())  # type: ignore[union-attr]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        await client.subscribe(bus.Topics("c").status("n9"), qos=1)
        async with asyncio.timeout(10):
            message = await anext(aiter(client.messages))
    assert bus.decode(message.payload, "status")["state"] == "offline"  # type: ignore[arg-type]


async def test_no_secret_in_logs_metrics_or_payloads(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    seen: list[bytes] = []
    async with aiomqtt.Client("127.0.0.1", harness.port) as listener:
        await listener.subscribe("hyperagent/#", qos=1)
        await harness.send(1, {"power_cap_w": 175})
        await harness.send(2, {"power_cap_w": 150}, key=SigningKey.generate())
        await until(lambda: harness.agent.stats.rejected["unknown_key"] == 1)
        async with asyncio.timeout(10):
            async for message in listener.messages:
                seen.append(bytes(message.payload))  # type: ignore[arg-type]
                if len(seen) >= 6:
                    break
    from prometheus_client import generate_latest

    from hyperagent.exporter import MetricsServer

    server = MetricsServer("127.0.0.1:0")
    server.collector.update((await harness.agent.collect_once()).readings)
    exposition = generate_latest(server.registry)
    raw = KEY.private.private_bytes_raw()
    pem = KEY.private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    for secret in (raw, raw.hex().encode(), pem.splitlines()[1]):
        assert secret not in exposition
        assert all(secret not in payload for payload in seen)
        assert secret.decode("latin-1") not in caplog.text
    assert build_config({}).agent.metrics_address.startswith("127.0.0.1:")


async def test_collecting_at_10_hz_publishes_telemetry_once_a_second(
    mosquitto,
    tmp_path: Path,
    nvidia_smi_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    config = build_config(
        {
            "node": "fast",
            "cluster": "c",
            "mqtt": {"url": mosquitto.url},
            "agent": {"interval_s": 0.1, "metrics_address": "", "state_dir": str(tmp_path)},
            "sources": {"job": {"socket": str(tmp_path / "j.sock")}},
        }
    )
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    agent = Agent.from_config(config, Hardware(nvml=nvml), trusted_keys=KEY.trusted())
    received = []
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as listener:
        await listener.subscribe(bus.Topics("c").telemetry("fast"), qos=0)
        task = asyncio.create_task(agent.run())
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3.5):  # listen for 3.5 s
                    async for message in listener.messages:
                        received.append(message)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert agent.collections >= 15  # /metrics and the indicators follow every cycle
    assert 2 <= len(received) <= 4  # the broker gets one message a second

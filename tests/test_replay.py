"""Recordings: the format, and record -> replay round trips through the real commands."""

from __future__ import annotations

import io
import itertools
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hyperagent.readings import Kind, Reading
from hyperagent.replay import (
    Player,
    RecordedSource,
    Recorder,
    RecordingError,
    load_recording,
)
from hyperagent.sources.base import Source

from conftest import REPO, ManualClock, free_port, wait_for_port

CAPTURE = REPO / "fixtures" / "replay" / "v100s-8gpu-training"
HEADER = b'{"format": "hyperagent-recording", "version": 2}\n'
HEADER_V1 = b'{"format": "hyperagent-recording", "version": 1}\n'


def test_recording_roundtrip_and_player(tmp_path: Path) -> None:
    out = io.BytesIO()
    recorder = Recorder(out, "n1", 1.0)
    for i in range(3):
        recorder.write(
            100.0 + i,
            {
                "nvml": [
                    Reading(
                        "hyperagent_gpu_energy_joules_total", 10.0 * i, {"gpu": "0"}, Kind.COUNTER
                    )
                ],
                "host": [Reading("hyperagent_host_cpu_utilization_ratio", 0.1 * i)],
            },
        )
    path = tmp_path / "recording.jsonl"
    path.write_bytes(out.getvalue())
    recording = load_recording(path)
    assert recording.node == "n1" and recording.duration_s == 2.0
    assert recording.source_names == ["nvml", "host"]
    clock = ManualClock()
    player = Player(recording, clock, speed=2.0)
    assert player.frame().ts == 100.0
    clock.now = 0.6  # 1.2 recorded seconds
    assert player.frame().ts == 101.0 and player.loops == 0
    assert player.frame() is recording.frames[1]
    # 2 s loops: at 101 recorded seconds, 50 loops done, 1 s into the next; the first frame
    # stands in for the last, so energy stays continuous and gains 20 J per loop
    clock.now = 50.5
    looped = player.frame()
    assert player.loops == 50 and looped.ts == 201.0
    (energy,) = looped.sources["nvml"]
    assert energy.kind is Kind.COUNTER and energy.value == 10.0 + 50 * 20.0
    assert looped.sources["host"][0].value == pytest.approx(0.1)  # gauges as recorded
    assert player.frame() is looped  # the same frame until the next one is due
    clock.now = 51.0
    assert player.frame().ts == 202.0 and player.frame().sources["nvml"][0].value == 51 * 20.0


def test_labels_are_written_once_and_nan_survives(tmp_path: Path) -> None:
    out = io.BytesIO()
    recorder = Recorder(out, "n1", 1.0)
    gpu = {"gpu": "0", "uuid": "GPU-1"}
    for i in range(3):
        recorder.write(100.0 + i, {"nvml": [Reading("hyperagent_gpu_power_watts", 10.0 * i, gpu)]})
    recorder.write(103.0, {"nvml": [Reading("hyperagent_gpu_power_watts", math.nan, gpu)]})
    recorder.write(104.0, {"nvml": [Reading("hyperagent_gpu_temperature_celsius", 40, gpu)]})
    assert out.getvalue().count(b"GPU-1") == 2  # first frame, and when the series changed
    path = tmp_path / "recording.jsonl"
    path.write_bytes(out.getvalue())
    frames = load_recording(path).frames
    assert [f.sources["nvml"][0].value for f in frames[:3]] == [0.0, 10.0, 20.0]
    assert math.isnan(frames[3].sources["nvml"][0].value)
    assert frames[4].sources["nvml"][0].name == "hyperagent_gpu_temperature_celsius"
    assert dict(frames[4].sources["nvml"][0].labels) == gpu


def test_version_1_recordings_still_load(tmp_path: Path) -> None:
    path = tmp_path / "recording.jsonl"
    row = b'["hyperagent_job_loss", {"job_id": "j"}, 2.5, "gauge"]'
    path.write_bytes(HEADER_V1 + b'{"ts": 5, "sources": {"job": [' + row + b"]}}\n")
    (reading,) = load_recording(path).frames[0].sources["job"]
    assert (reading.name, dict(reading.labels), reading.value) == (
        "hyperagent_job_loss",
        {"job_id": "j"},
        2.5,
    )


async def test_recorded_source_replays_readings(tmp_path: Path) -> None:
    out = io.BytesIO()
    Recorder(out, "n1", 1.0).write(
        5.0, {"job": [Reading("hyperagent_job_loss", 2.5, {"job_id": "j"})]}
    )
    path = tmp_path / "recording.jsonl"
    path.write_bytes(out.getvalue())
    source: Source = RecordedSource("job", Player(load_recording(path), ManualClock()))
    assert [(r.name, r.value) for r in await source.read()] == [("hyperagent_job_loss", 2.5)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b'{"format": "other"}\n', "not a hyperagent recording"),
        (b'{"format": "hyperagent-recording", "version": 9}\n', "unsupported version"),
        (HEADER, "no frames"),
        (HEADER + b'{"ts": "x"}\n', ":2: a frame needs"),
        (HEADER_V1 + b'{"ts": 1, "sources": {"a": [[1]]}}\n', ":2 a: bad reading"),
        (HEADER + b'{"ts": 1, "series": {"a": [["m", {}]]}, "sources": {}}\n', ":2 a: bad reading"),
        (
            HEADER + b'{"ts": 1, "series": {"a": [["m", {"l": 1}, "gauge"]]}, "sources": {}}\n',
            "bad",
        ),
        (HEADER + b'{"ts": 1, "sources": {"a": [1.0]}}\n', ":2 a: values before the series"),
        (
            HEADER + b'{"ts": 1, "series": {"a": [["m", {}, "gauge"]]}, "sources": {"a": []}}\n',
            ":2 a: 1 series but 0 values",
        ),
        (
            HEADER + b'{"ts": 1, "series": {"a": [["m", {}, "gauge"]]}, "sources": {"a": ["1"]}}\n',
            ":2 a: bad value",
        ),
        (
            HEADER + b'{"ts": 2, "sources": {}}\n{"ts": 1, "sources": {}}\n',
            ":3: frames go back in time",
        ),
        (HEADER + b"not json\n", ":2: not JSON"),
    ],
)
def test_bad_recordings_are_clear_errors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "recording.jsonl"
    path.write_bytes(content)
    with pytest.raises(RecordingError, match=message):
        load_recording(path)


def samples(text: str, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    }


def test_record_then_replay_serves_the_same_metrics(tmp_path: Path) -> None:
    out = tmp_path / "captured"
    recorded = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperagent.cli",
            "record",
            "--replay",
            str(CAPTURE),
            "--out",
            str(out),
            "--duration",
            "1.5",
            "--interval",
            "0.25",
            "--node",
            "n1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert recorded.returncode == 0, recorded.stderr
    assert "frames of nvml to" in recorded.stdout
    recording = load_recording(out / "recording.jsonl")
    assert len(recording.frames) >= 4
    last = {
        (r.name, tuple(sorted(r.labels.items()))): r.value
        for r in recording.frames[-1].sources["nvml"]
    }
    first = {
        (r.name, tuple(sorted(r.labels.items()))): r.value
        for r in recording.frames[0].sources["nvml"]
    }
    counters = {
        (r.name, tuple(sorted(r.labels.items())))
        for r in recording.frames[-1].sources["nvml"]
        if r.kind is Kind.COUNTER
    }
    assert sum(name == "hyperagent_gpu_power_watts" for name, _ in last) == 8

    port = free_port()
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hyperagent.cli",
            "agent",
            "--replay",
            str(out),
            "--no-broker",
            "--metrics-address",
            f"127.0.0.1:{port}",
            "--interval",
            "0.2",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_port(port, 30)
        time.sleep(recording.duration_s + 0.5)  # past the end: the recording loops
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        agent.terminate()
        agent.communicate(timeout=20)
    served = samples(text, "hyperagent_gpu_")
    served = {k: v for k, v in served.items() if k[0] != "hyperagent_gpu_quantum_coefficient"}
    assert served.keys() == last.keys()
    # the captured GPUs' gauges are the same in every frame: served as recorded; counters go
    # on from where the recording ended, growing as they grew over it
    gauges = {k: v for k, v in served.items() if k not in counters}
    assert gauges == pytest.approx({k: last[k] for k in gauges}, rel=1e-9)
    grown = {k for k in counters if last[k] > first[k]}
    assert any(name == "hyperagent_gpu_energy_joules_total" for name, _ in grown)
    assert all(served[k] >= last[k] for k in grown)
    assert {k: served[k] for k in counters - grown} == {k: last[k] for k in counters - grown}
    assert 'hyperagent_source_up{source="nvml",target="recording"} 1.0' in text


async def test_a_real_h200_under_bf16_load_replays_with_its_indicators(tmp_path: Path) -> None:
    """The recording made with `hyperagent record` on a real H200 (fixtures SOURCES.md)."""
    from hyperagent.agent import Agent
    from hyperagent.capture.directory import capture_sources
    from hyperagent.config import build_config

    clock = ManualClock()
    config = build_config(
        {"mqtt": {"enabled": False}, "agent": {"metrics_address": "", "state_dir": str(tmp_path)}}
    )
    directory = REPO / "fixtures" / "replay" / "h200-bf16-matmul"
    sources, hardware = capture_sources(directory, config, clock)
    agent = Agent(config, hardware, sources=sources)
    await agent.runner.start()
    try:
        for second in (10.0, 11.0):
            clock.now = second
            snapshot = await agent.collect_once()
    finally:
        await agent.runner.close()
    assert snapshot.value("hyperagent_gpu_info", model="NVIDIA H200") == 1.0
    assert 680 < (snapshot.value("hyperagent_gpu_power_watts") or 0) <= 700  # at its cap
    assert 0.9 < (snapshot.value("hyperagent_gpu_tensor_active_ratio") or 0) < 1
    assert 0.9 < (snapshot.value("hyperagent_qu_ratio") or 0) <= 1  # one busy H200
    assert snapshot.value("hyperagent_memory_pressure_ratio") == pytest.approx(0.0122, abs=1e-3)


@pytest.mark.parametrize("power_cap", [False, True])
async def test_recorded_gpus_replay_as_recorded_unless_power_caps_apply(
    tmp_path: Path, power_cap: bool
) -> None:
    """Without power capping a recording's GPU readings are served as recorded; with it they go
    through NvmlSource over a fake NVML, which takes a cap and draws less under it."""
    from hyperagent.agent import Agent
    from hyperagent.capture.directory import capture_sources
    from hyperagent.config import build_config

    clock = ManualClock()
    config = build_config(
        {
            "mqtt": {"enabled": False},
            "agent": {"metrics_address": "", "state_dir": str(tmp_path)},
            "actuation": {"power_cap": power_cap},
        }
    )
    directory = REPO / "fixtures" / "replay" / "h200-bf16-matmul"
    recording = load_recording(directory / "recording.jsonl")
    sources, hardware = capture_sources(directory, config, clock)
    player = Player(recording, clock)
    agent = Agent(config, hardware, sources=sources)
    await agent.runner.start()
    try:
        clock.now = 10.0
        recorded = player.frame().sources["nvml"]
        snapshot = await agent.collect_once()
        if agent.actuator is not None:
            agent.actuator.apply(400.0)
            clock.now = 11.0
            capped = await agent.collect_once()
    finally:
        await agent.runner.close()
    served = [r for r in snapshot.readings if r.name.startswith("hyperagent_gpu_")]
    assert (agent.actuator is not None) == power_cap
    if not power_cap:
        assert hardware.nvml is None
        assert served[: len(recorded)] == recorded
    else:
        assert {r.name for r in recorded} <= {r.name for r in served}
        assert (capped.value("hyperagent_gpu_power_limit_watts") or 0) == 400.0
        assert (capped.value("hyperagent_gpu_power_watts") or 1e9) <= 400.0


@pytest.mark.parametrize("power_cap", [False, True])
async def test_a_recording_past_its_end_loops_with_energy_keeping_pace_with_power(
    tmp_path: Path, power_cap: bool
) -> None:
    """The H200 recording lasts 39 s at about 690 W: long after its end, the energy counter
    still grows by the power shown times the time passed, across the loops' seams."""
    from hyperagent.agent import Agent
    from hyperagent.capture.directory import capture_sources
    from hyperagent.config import build_config

    clock = ManualClock()
    config = build_config(
        {
            "mqtt": {"enabled": False},
            "agent": {"metrics_address": "", "state_dir": str(tmp_path)},
            "actuation": {"power_cap": power_cap},
        }
    )
    directory = REPO / "fixtures" / "replay" / "h200-bf16-matmul"
    sources, hardware = capture_sources(directory, config, clock)
    agent = Agent(config, hardware, sources=sources)
    await agent.runner.start()
    seen: list[tuple[float, float, float]] = []
    try:
        for second in (30.0, 45.0, 80.0, 117.5, 200.0):
            clock.now = second
            snapshot = await agent.collect_once()
            energy = snapshot.value("hyperagent_gpu_energy_joules_total")
            power = snapshot.value("hyperagent_gpu_power_watts")
            assert energy is not None and power is not None
            seen.append((second, energy, power))
    finally:
        await agent.runner.close()
    for (before, energy_before, _), (after, energy_after, _) in itertools.pairwise(seen):
        watts = (energy_after - energy_before) / (after - before)
        assert 660 < watts < 720, f"{watts:.0f} W from {before:g} s to {after:g} s"
    assert all(660 < power < 720 for _, _, power in seen)

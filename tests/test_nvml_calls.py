"""NVML calls the agent saves on the replayed 8-GPU node (the benchmark's
``nvml_calls_per_gpu_cycle``, 4.15 before these two cuts, 3.87 after): a GPU without MIG is not
asked its MIG mode on every slow read, and the running processes are read through the handles
the NVML source enumerated."""

from __future__ import annotations

from pathlib import Path

from hyperagent.agent import Agent
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.config import build_config
from hyperagent.devices.nvml_telemetry import UNSUPPORTED_RETRY_READS
from hyperagent.sources import Hardware
from hyperagent.sources.nvml import NvmlSource

from conftest import ManualClock


async def test_a_gpu_without_mig_is_asked_its_mig_mode_only_on_the_retry_read(
    nvidia_smi_dir: Path,
) -> None:
    clock = ManualClock()
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml", clock=clock)  # 8 x V100S
    source = NvmlSource(nvml, clock=clock, health_interval_s=0.0)
    await source.start()
    for _ in range(20):
        clock.now += 1
        await source.read()
    assert nvml.call_counts()["nvmlDeviceGetMigMode"] == 8  # once per GPU, not 20 times
    for _ in range(UNSUPPORTED_RETRY_READS - 20):
        clock.now += 1
        await source.read()
    assert nvml.call_counts()["nvmlDeviceGetMigMode"] == 16  # asked again on the retry read
    await source.close()


async def test_a_mig_gpu_still_shows_its_mig_devices_every_slow_read(nvidia_smi_dir: Path) -> None:
    clock = ManualClock()
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "a100-sxm4-mig-q-written.txt", clock=clock)
    source = NvmlSource(nvml, clock=clock, health_interval_s=0.0)
    await source.start()
    for _ in range(3):
        clock.now += 1
        readings = await source.read()
        assert any(r.name == "hyperagent_gpu_mig_info" for r in readings)
    await source.close()


async def test_running_processes_are_read_through_the_sources_handles(
    nvidia_smi_dir: Path, tmp_path: Path
) -> None:
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    nvml.set_processes(3, [4242])
    config = build_config(
        {
            "node": "n",
            "mqtt": {"enabled": False},
            "agent": {"metrics_address": "", "state_dir": str(tmp_path)},
            "sources": {"job": {"enabled": False}, "host": {"enabled": False}},
        }
    )
    agent = Agent(config, Hardware(nvml=nvml), sources=[NvmlSource(nvml)])
    assert agent.nvml_source is not None
    await agent.nvml_source.start()
    before = nvml.call_counts()
    found = agent.devices.running_pids()
    calls = {k: v - before.get(k, 0) for k, v in nvml.call_counts().items() if v != before.get(k)}
    assert found["3"] == [4242] and len(found) == 8
    assert calls == {"nvmlDeviceGetComputeRunningProcesses": 8}
    await agent.nvml_source.close()

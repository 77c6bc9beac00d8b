"""AMD Instinct, Intel Gaudi, Ascend and Cambricon through the device layer, replayed from
their tools' recorded (or documented) output through fakes of amdsmi and pyhlml: what /metrics
shows per device, promtool's verdict, power capping through the actuator in each vendor's
units, the AMD energy check, partitions, and a missing vendor library."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from hyperagent.actuators import PowerCapActuator
from hyperagent.capture import amd_smi
from hyperagent.capture.directory import capture_sources
from hyperagent.capture.fake_amdsmi import FakeAmdsmi
from hyperagent.capture.fake_hlml import FakeHlml
from hyperagent.config import DEFAULT_QUANTUM_COEFFICIENTS, build_config
from hyperagent.devices import amd
from hyperagent.devices.amd import AmdsmiLibrary
from hyperagent.devices.gaudi import HlmlLibrary
from hyperagent.devices.source import AcceleratorSource
from hyperagent.errors import NoPermission
from hyperagent.exporter import MetricsServer
from hyperagent.indicators import derive
from hyperagent.readings import Reading, Snapshot
from hyperagent.sources import smi_text

from conftest import FIXTURES

MI300X = FIXTURES / "replay" / "amd-mi300x-8gpu"
GAUDI = FIXTURES / "replay" / "gaudi-hl205-8card"
ASCEND = FIXTURES / "replay" / "ascend-910b2c-documented"
CAMBRICON = FIXTURES / "replay" / "cambricon-mlu370-documented"
PER_DEVICE = (
    "hyperagent_gpu_power_watts",
    "hyperagent_gpu_energy_joules_total",
    "hyperagent_gpu_utilization_ratio",
    "hyperagent_gpu_memory_used_bytes",
    "hyperagent_gpu_memory_total_bytes",
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def replayed_readings(directory: Path, clock: Clock) -> list[Reading]:
    config = build_config({"node": "n", "mqtt": {"enabled": False}})
    sources, _ = capture_sources(directory, config, clock=clock)
    (source,) = sources
    await source.start()
    clock.now = 10.0
    readings = await source.read()
    await source.close()
    return readings


def exposition(readings: list[Reading]) -> bytes:
    snapshot = Snapshot(0.0, "n", tuple(readings))
    server = MetricsServer("127.0.0.1:0")
    server.collector.update([*readings, *derive(snapshot, None, DEFAULT_QUANTUM_COEFFICIENTS)])
    return generate_latest(server.registry)


def by_gpu(readings: list[Reading], name: str) -> dict[str, float]:
    return {r.labels["gpu"]: r.value for r in readings if r.name == name}


def promtool_check(text: bytes) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: apt-get install -y prometheus (bash .ci/run does)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    assert result.returncode == 0 and not result.stdout and not result.stderr, (
        result.stdout + result.stderr
    ).decode()


async def test_mi300x_replay_serves_power_energy_utilisation_and_memory_per_device() -> None:
    readings = await replayed_readings(MI300X, Clock())
    for name in PER_DEVICE:
        assert sorted(by_gpu(readings, name)) == [str(i) for i in range(8)], name
    power = by_gpu(readings, "hyperagent_gpu_power_watts")
    assert power["0"] == 133 and power["7"] == 134  # amd-smi metric's socket_power
    energy = by_gpu(readings, "hyperagent_gpu_energy_joules_total")
    # amd-smi's total_energy_consumption (J), then 10 s at the recorded 133 W
    assert energy["0"] == pytest.approx(12119300.381 + 1330, abs=0.5)
    assert by_gpu(readings, "hyperagent_gpu_memory_total_bytes")["0"] == 196592 * 2**20
    assert by_gpu(readings, "hyperagent_gpu_power_limit_max_watts")["3"] == 750
    info = [r.labels for r in readings if r.name == "hyperagent_gpu_info"]
    assert info[0] == {
        "gpu": "0",
        "uuid": "0000:0c:00.0",
        "model": "AMD Instinct MI300X",
        "driver": "",
        "vendor": "amd",
        "bus_id": "0000:0c:00.0",
    }
    text = exposition(readings)
    promtool_check(text)
    assert b'hyperagent_gpu_quantum_coefficient{gpu="0",known="true"' in text


async def test_gaudi_replay_serves_power_energy_utilisation_and_memory_per_device() -> None:
    readings = await replayed_readings(GAUDI, Clock())
    for name in PER_DEVICE:
        assert sorted(by_gpu(readings, name)) == [str(i) for i in range(8)], name
    assert by_gpu(readings, "hyperagent_gpu_power_watts")["2"] == 96
    assert by_gpu(readings, "hyperagent_gpu_utilization_ratio")["2"] == pytest.approx(0.12)
    # hl-smi holds no energy counter: HLML's mJ counter integrates 10 s at 96 W from 0
    assert by_gpu(readings, "hyperagent_gpu_energy_joules_total")["2"] == pytest.approx(960)
    assert by_gpu(readings, "hyperagent_gpu_memory_used_bytes")["2"] == 512 * 2**20
    info = {r.labels["gpu"]: r.labels for r in readings if r.name == "hyperagent_gpu_info"}
    assert info["0"]["vendor"] == "intel" and info["0"]["model"] == "HL-205"
    assert info["0"]["uuid"] == "00P1-HL2000A1-14-P64W99-13-05-03"
    promtool_check(exposition(readings))


@pytest.mark.parametrize(
    ("directory", "vendor", "model", "power"),
    [
        (ASCEND, "huawei", "Ascend 910B2C", {"0": 89.9, "1": 93.8}),
        (CAMBRICON, "cambricon", "Cambricon MLU370-X8", {"0": 106.0, "1": 106.0}),
    ],
)
async def test_text_tools_give_instant_power_and_no_energy(
    directory: Path, vendor: str, model: str, power: dict[str, float]
) -> None:
    readings = await replayed_readings(directory, Clock())
    assert by_gpu(readings, "hyperagent_gpu_power_watts") == power
    assert not by_gpu(readings, "hyperagent_gpu_energy_joules_total")
    info = [r.labels for r in readings if r.name == "hyperagent_gpu_info"]
    assert {(i["vendor"], i["model"]) for i in info} == {(vendor, model)}
    assert len(by_gpu(readings, "hyperagent_gpu_memory_total_bytes")) == 2
    promtool_check(exposition(readings))


def test_npu_smi_table_as_documented() -> None:
    text = (ASCEND / smi_text.CAPTURE_FILES["npu_smi"]).read_text()
    readings = smi_text.parse_npu_smi_info(text)
    assert by_gpu(readings, "hyperagent_gpu_memory_used_bytes") == {
        "0": 3317 * 2**20,
        "1": 3316 * 2**20,
    }
    assert by_gpu(readings, "hyperagent_gpu_temperature_celsius") == {"0": 53, "1": 53}


def test_amd_power_cap_is_set_in_microwatts_all_or_nothing_and_restored() -> None:
    fake = FakeAmdsmi.from_capture(MI300X)
    actuator = PowerCapActuator(AmdsmiLibrary(fake, check_s=0))
    assert actuator.limits_w() == (0.0, 750.0)
    caps = actuator.apply(500)
    assert [c.applied_w for c in caps] == [500.0] * 8 and all(c.changed for c in caps)
    assert [fake.power_cap_w(i) for i in range(8)] == [500.0] * 8
    assert fake.call_counts()["amdsmi_set_power_cap"] == 8
    assert [c.applied_w for c in actuator.apply(900)] == [750.0] * 8  # clamped to max_power_cap
    assert actuator.restore() == 8
    assert [fake.power_cap_w(i) for i in range(8)] == [750.0] * 8


def test_amd_cap_without_permission_is_no_permission() -> None:
    fake = FakeAmdsmi.from_capture(MI300X, writable=False)
    with pytest.raises(NoPermission) as e:
        PowerCapActuator(AmdsmiLibrary(fake, check_s=0)).apply(400)
    assert e.value.vendor_code == amd.AMDSMI_STATUS_NO_PERM


def test_a_capped_mi300x_draws_under_its_cap() -> None:
    fake = FakeAmdsmi.from_capture(MI300X)
    library = AmdsmiLibrary(fake, check_s=0)
    fake.set_load(0, util_pct=100, power_w=700)
    PowerCapActuator(library).apply(450)
    device = library.devices()[0]
    assert device.power_w() == 450 and device.activity().compute == 1.0  # type: ignore[union-attr]


def test_gaudi_power_cap_is_set_in_milliwatts() -> None:
    fake = FakeHlml.from_capture(GAUDI)
    actuator = PowerCapActuator(HlmlLibrary(fake))
    assert actuator.limits_w() == (150.0, 350.0)
    assert [c.applied_w for c in actuator.apply(200)] == [200.0] * 8
    assert [fake.power_cap_w(i) for i in range(8)] == [200.0] * 8
    assert fake.devices[0].draw_w() == 103  # under the cap already
    fake.set_load(0, power_w=300)
    assert fake.hlmlDeviceGetPowerUsage(fake.hlmlDeviceGetHandleByIndex(0)) == 200_000
    assert actuator.restore() == 8


@pytest.mark.parametrize(("ratio", "kept"), [(1.0, True), (1000.0, False), (0.001, False)])
def test_an_amd_energy_counter_that_disagrees_with_power_is_left_out(
    ratio: float, kept: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """As Zeus checks: energy counted over a short window against power x time."""
    fake = FakeAmdsmi.from_capture(MI300X, energy_ratio=ratio)
    library = AmdsmiLibrary(fake, check_s=0.05)
    with caplog.at_level(logging.WARNING, logger="hyperagent.devices.amd"):
        devices = library.devices()
    assert all((d.energy_j() is not None) == kept for d in devices)
    assert ("its energy is left out" in caplog.text) == (not kept)


def test_compute_partitions_are_devices_and_only_the_first_takes_the_cap() -> None:
    records = amd_smi.load_capture(MI300X)
    fake = FakeAmdsmi(records, partitions={"compute": "CPX", "memory": "NPS4", "count": 8})
    library = AmdsmiLibrary(fake, check_s=0)
    devices = library.devices()
    assert len(devices) == 64
    assert devices[1].identity.info["compute_partition"] == "CPX"
    assert devices[1].identity.info["memory_partition"] == "NPS4"
    assert len(library.power_devices()) == 8
    assert [c.applied_w for c in PowerCapActuator(library).apply(600)] == [600.0] * 8


async def test_a_missing_amdsmi_means_no_amd_devices_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import fails as without libamd_smi.so
    monkeypatch.setattr(amd, "_said_unavailable", set())
    config = build_config({"node": "n", "sources": {"amdsmi": {"enabled": True}}})
    from hyperagent.sources import SOURCES, Hardware

    with caplog.at_level(logging.INFO, logger="hyperagent.devices.amd"):
        sources = [*SOURCES["amdsmi"](config, Hardware(nvml=None))]
        sources += SOURCES["amdsmi"](config, Hardware(nvml=None))
    assert caplog.text.count("no AMD devices") == 1
    from hyperagent.errors import SourceUnavailable

    assert isinstance(sources[0], AcceleratorSource)
    with pytest.raises(SourceUnavailable):
        await sources[0].start()


async def test_mi100_rocm_smi_replay_takes_the_recorded_cap_and_names_the_part() -> None:
    readings = await replayed_readings(FIXTURES / "replay" / "amd-mi100-rocm602", Clock())
    assert by_gpu(readings, "hyperagent_gpu_power_watts") == {"0": 36, "1": 44, "2": 43, "3": 39}
    assert set(by_gpu(readings, "hyperagent_gpu_power_limit_watts").values()) == {290.0}
    info = [r.labels for r in readings if r.name == "hyperagent_gpu_info"]
    assert {i["model"] for i in info} == {"AMD Instinct MI100"}
    assert info[1]["uuid"] == "0x4edfb117a17a07d" and info[1]["driver"] == "6.3.6"
    promtool_check(exposition(readings))


def test_mi210_static_output_gives_model_and_cap_range() -> None:
    static = amd_smi.parse_static_json((FIXTURES / "amd-smi" / "mi210-static.json").read_text())
    assert static[0]["model"] == "AMD Instinct MI210"
    assert (static[0]["min_power_cap_w"], static[0]["max_power_cap_w"]) == (0, 300)
    assert static[0]["power_cap_w"] == 300


async def test_an_agent_over_an_amd_replay_reads_trial_energy_and_gate_failures(
    tmp_path: Path,
) -> None:
    from hyperagent.agent import Agent

    clock = Clock()
    config = build_config(
        {
            "node": "n",
            "mqtt": {"enabled": False},
            "agent": {"metrics_address": "", "state_dir": str(tmp_path)},
        }
    )
    sources, hardware = capture_sources(MI300X, config, clock=clock)
    agent = Agent(config, hardware, sources=sources)
    assert agent.actuator is not None and agent.actuator.library.name == "amdsmi"
    await agent.runner.start()
    snapshot = await agent.collect_once()
    failures = [r for r in snapshot.readings if r.name == "hyperagent_device_call_failures_total"]
    assert {r.labels["library"] for r in failures} == {"amdsmi"}
    before = await agent.devices.energy_j()
    clock.now += 10.0
    after = await agent.devices.energy_j()
    assert before is not None and after is not None
    # 8 GPUs drawing 132-139 W (1,071 W in all) for 10 s
    assert after - before == pytest.approx(
        10 * (133 + 139 + 133 + 132 + 136 + 132 + 132 + 134), rel=1e-3
    )
    await agent.runner.close()


async def test_the_cnmon_source_runs_its_tool_and_a_missing_tool_means_no_devices(
    tmp_path: Path,
) -> None:
    from hyperagent.errors import SourceUnavailable

    tool = tmp_path / "cnmon"
    tool.write_text(f"#!/bin/sh\ncat {CAMBRICON / 'cnmon.txt'}\n")
    tool.chmod(0o755)
    readings = await smi_text.SmiTextSource("cnmon", (str(tool),)).read()
    assert by_gpu(readings, "hyperagent_gpu_power_limit_watts") == {"0": 250.0, "1": 250.0}
    with pytest.raises(SourceUnavailable):
        await smi_text.SmiTextSource("cnmon", (str(tmp_path / "absent"),)).read()

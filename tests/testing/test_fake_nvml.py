"""FakeNvml: pynvml's names, units and errors over recorded GPUs."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest

from hyperagent.testing.fake_nvml import FakeNvml
from hyperagent.testing.nvidia_smi import MIB, GpuRecord

FIXTURES = Path(__file__).parents[2] / "fixtures" / "nvidia-smi"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def v100s(clock: FakeClock) -> FakeNvml:
    nvml = FakeNvml.from_capture(FIXTURES / "gtx-8card.xml", clock=clock)
    nvml.nvmlInit()
    return nvml


def _bare(**fields: Any) -> GpuRecord:
    return GpuRecord(index=0, name="bare", uuid="GPU-bare", pci_bus_id="0", driver="1", **fields)


def test_calls_before_init_and_after_shutdown_raise_uninitialized(clock: FakeClock) -> None:
    nvml = FakeNvml.from_capture(FIXTURES / "tesla-t4.xml", clock=clock)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()
    nvml.nvmlInit()
    nvml.nvmlInit()
    nvml.nvmlShutdown()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetName(handle) == "Tesla T4"
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetName(handle)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlSystemGetDriverVersion()


def test_identity(v100s: FakeNvml) -> None:
    assert v100s.nvmlSystemGetDriverVersion() == "460.73.01"
    assert v100s.nvmlDeviceGetCount() == 8
    handle = v100s.nvmlDeviceGetHandleByIndex(7)
    assert v100s.nvmlDeviceGetIndex(handle) == 7
    assert v100s.nvmlDeviceGetName(handle) == "Tesla V100S-PCIE-32GB"
    assert v100s.nvmlDeviceGetUUID(handle) == "GPU-1d955959-c95b-4f40-2cac-100d3006ffe2"
    assert v100s.nvmlDeviceGetHandleByUUID("GPU-1d955959-c95b-4f40-2cac-100d3006ffe2") is handle
    for bad in (8, -1):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            v100s.nvmlDeviceGetHandleByIndex(bad)
    with pytest.raises(pynvml.NVMLError_NotFound):
        v100s.nvmlDeviceGetHandleByUUID("GPU-nope")


def test_handles_of_another_instance_are_invalid(v100s: FakeNvml, clock: FakeClock) -> None:
    other = FakeNvml.from_capture(FIXTURES / "gtx-8card.xml", clock=clock)
    other.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        v100s.nvmlDeviceGetName(other.nvmlDeviceGetHandleByIndex(0))


def test_readings_are_in_nvml_units(v100s: FakeNvml) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    util = v100s.nvmlDeviceGetUtilizationRates(h)
    assert (util.gpu, util.memory) == (97, 52)
    assert isinstance(util.gpu, int)
    memory = v100s.nvmlDeviceGetMemoryInfo(h)
    assert (memory.total, memory.used, memory.free) == (32510 * MIB, 31689 * MIB, 821 * MIB)
    assert v100s.nvmlDeviceGetPowerUsage(h) == 232_800
    assert v100s.nvmlDeviceGetEnforcedPowerLimit(h) == 250_000
    assert v100s.nvmlDeviceGetPowerManagementLimit(h) == 250_000
    assert v100s.nvmlDeviceGetPowerManagementDefaultLimit(h) == 250_000
    assert v100s.nvmlDeviceGetPowerManagementLimitConstraints(h) == [100_000, 250_000]
    assert v100s.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 66
    assert v100s.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1410
    assert v100s.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) == 1107
    assert v100s.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_GRAPHICS) == 1410
    assert v100s.nvmlDeviceGetPcieReplayCounter(h) == 0


def test_bad_sensor_and_clock_arguments(v100s: FakeNvml) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        v100s.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_COUNT)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        v100s.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_COUNT)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        v100s.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_VIDEO)


def test_memory_info_v1_counts_reserved_as_used_and_v2_separates_it(clock: FakeClock) -> None:
    nvml = FakeNvml.from_capture(FIXTURES / "a100-sxm4-v12.xml", clock=clock)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    v1 = nvml.nvmlDeviceGetMemoryInfo(h)
    assert (v1.total, v1.used) == (81920 * MIB, (50 + 869) * MIB)
    assert v1.free == v1.total - v1.used
    v2 = nvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert (v2.total, v2.used, v2.reserved) == (81920 * MIB, 50 * MIB, 869 * MIB)
    assert v2.free == (81920 - 50 - 869) * MIB
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlDeviceGetMemoryInfo(h, version=1)


def test_missing_fields_raise_not_supported(clock: FakeClock) -> None:
    mig = FakeNvml.from_capture(FIXTURES / "a100-sxm4-v12.xml", clock=clock)
    mig.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        mig.nvmlDeviceGetUtilizationRates(mig.nvmlDeviceGetHandleByIndex(0))

    bare = FakeNvml([_bare()], clock=clock)
    bare.nvmlInit()
    h = bare.nvmlDeviceGetHandleByIndex(0)
    calls = [
        bare.nvmlDeviceGetUtilizationRates,
        bare.nvmlDeviceGetMemoryInfo,
        bare.nvmlDeviceGetPowerUsage,
        bare.nvmlDeviceGetEnforcedPowerLimit,
        bare.nvmlDeviceGetPowerManagementLimit,
        bare.nvmlDeviceGetPowerManagementDefaultLimit,
        bare.nvmlDeviceGetPowerManagementLimitConstraints,
        bare.nvmlDeviceGetTotalEnergyConsumption,
        bare.nvmlDeviceGetPcieReplayCounter,
        lambda h: bare.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        lambda h: bare.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        lambda h: bare.nvmlDeviceSetPowerManagementLimit(h, 100_000),
    ]
    for call in calls:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(h)
    assert bare.nvmlDeviceGetName(h) == "bare"


def test_set_power_limit_out_of_range_is_rejected_and_changes_nothing(v100s: FakeNvml) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    for bad in (99_999, 250_001, 0):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            v100s.nvmlDeviceSetPowerManagementLimit(h, bad)
    assert v100s.nvmlDeviceGetEnforcedPowerLimit(h) == 250_000
    assert v100s.nvmlDeviceGetPowerManagementLimit(h) == 250_000


def test_set_power_limit_in_range_reads_back(v100s: FakeNvml) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(2)
    for limit in (100_000, 175_500, 250_000):
        v100s.nvmlDeviceSetPowerManagementLimit(h, limit)
        assert v100s.nvmlDeviceGetEnforcedPowerLimit(h) == limit
        assert v100s.nvmlDeviceGetPowerManagementLimit(h) == limit
    assert v100s.nvmlDeviceGetPowerManagementDefaultLimit(h) == 250_000
    other = v100s.nvmlDeviceGetHandleByIndex(3)
    assert v100s.nvmlDeviceGetEnforcedPowerLimit(other) == 250_000


def test_set_power_limit_takes_an_int_like_ctypes(v100s: FakeNvml) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(TypeError):
        v100s.nvmlDeviceSetPowerManagementLimit(h, 150_000.0)  # type: ignore[arg-type]


def test_set_power_limit_without_permission(clock: FakeClock) -> None:
    nvml = FakeNvml.from_capture(FIXTURES / "tesla-t4.xml", clock=clock, writable=False)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nvml.nvmlDeviceSetPowerManagementLimit(h, 65_000)
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 70_000


def test_set_power_limit_unsupported_without_constraints(clock: FakeClock) -> None:
    nvml = FakeNvml([_bare(power_draw_w=50.0, power_limit_w=100.0)], clock=clock)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceSetPowerManagementLimit(h, 80_000)
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 100_000


def test_draw_is_capped_by_the_limit(v100s: FakeNvml) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    v100s.nvmlDeviceSetPowerManagementLimit(h, 150_000)
    assert v100s.nvmlDeviceGetPowerUsage(h) == 150_000
    v100s.set_load(0, power_draw_w=120.0)
    assert v100s.nvmlDeviceGetPowerUsage(h) == 120_000
    v100s.set_load(0, power_draw_w=400.0)
    assert v100s.nvmlDeviceGetPowerUsage(h) == 150_000
    v100s.nvmlDeviceSetPowerManagementLimit(h, 250_000)
    assert v100s.nvmlDeviceGetPowerUsage(h) == 250_000


def test_energy_integrates_capped_power_over_time(v100s: FakeNvml, clock: FakeClock) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    assert v100s.nvmlDeviceGetTotalEnergyConsumption(h) == 0
    clock.now = 10.0
    assert v100s.nvmlDeviceGetTotalEnergyConsumption(h) == 2_328_000  # 232.8 W * 10 s
    v100s.set_load(0, power_draw_w=100.0)
    clock.now = 15.0
    assert v100s.nvmlDeviceGetTotalEnergyConsumption(h) == 2_828_000  # + 100 W * 5 s
    v100s.set_load(0, power_draw_w=200.0)
    v100s.nvmlDeviceSetPowerManagementLimit(h, 120_000)
    clock.now = 25.0
    assert v100s.nvmlDeviceGetTotalEnergyConsumption(h) == 4_028_000  # + 120 W (cap) * 10 s
    other = v100s.nvmlDeviceGetHandleByIndex(7)
    assert v100s.nvmlDeviceGetTotalEnergyConsumption(other) == 1_536_750  # 61.47 W * 25 s


def test_energy_is_piecewise_even_without_reads_between_changes(
    v100s: FakeNvml, clock: FakeClock
) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(1)  # 152.03 W recorded
    clock.now = 4.0
    v100s.set_load(1, power_draw_w=50.0)
    clock.now = 6.0
    v100s.nvmlDeviceSetPowerManagementLimit(h, 100_000)  # no effect on 50 W
    v100s.set_load(1, power_draw_w=300.0)  # capped at 100 W
    clock.now = 9.0
    assert v100s.nvmlDeviceGetTotalEnergyConsumption(h) == 152_030 * 4 + 50_000 * 2 + 100_000 * 3


def test_set_load_changes_utilisation_and_memory(v100s: FakeNvml) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(4)
    v100s.set_load(4, util_gpu_pct=12.4, util_mem_pct=3.0, mem_used_bytes=1000 * MIB)
    util = v100s.nvmlDeviceGetUtilizationRates(h)
    assert (util.gpu, util.memory) == (12, 3)
    memory = v100s.nvmlDeviceGetMemoryInfo(h)
    assert (memory.used, memory.free) == (1000 * MIB, 31510 * MIB)
    assert v100s.nvmlDeviceGetPowerUsage(h) == 117_990  # unchanged
    with pytest.raises(IndexError):
        v100s.set_load(8, util_gpu_pct=1.0)
    with pytest.raises(ValueError, match="util_gpu_pct"):
        v100s.set_load(0, util_gpu_pct=101.0)
    with pytest.raises(ValueError, match="mem_used_bytes"):
        v100s.set_load(0, mem_used_bytes=32511 * MIB)


def test_fail_and_recover(v100s: FakeNvml) -> None:
    h1 = v100s.nvmlDeviceGetHandleByIndex(1)
    v100s.fail(1, pynvml.NVML_ERROR_GPU_IS_LOST)
    assert v100s.nvmlDeviceGetCount() == 8
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        v100s.nvmlDeviceGetHandleByIndex(1)
    for call in (
        v100s.nvmlDeviceGetName,
        v100s.nvmlDeviceGetPowerUsage,
        v100s.nvmlDeviceGetTotalEnergyConsumption,
        lambda h: v100s.nvmlDeviceSetPowerManagementLimit(h, 200_000),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(h1)
    assert v100s.nvmlDeviceGetPowerUsage(v100s.nvmlDeviceGetHandleByIndex(0)) == 232_800
    v100s.recover(1)
    assert v100s.nvmlDeviceGetHandleByIndex(1) is h1
    assert v100s.nvmlDeviceGetPowerUsage(h1) == 152_030
    assert v100s.nvmlDeviceGetEnforcedPowerLimit(h1) == 250_000


def test_records_must_be_numbered_by_position(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="renumber"):
        FakeNvml([replace(_bare(), index=1)], clock=clock)
    eight = FakeNvml([replace(_bare(), index=i, uuid=f"GPU-{i}") for i in range(8)], clock=clock)
    eight.nvmlInit()
    assert eight.nvmlDeviceGetCount() == 8


def _agent_style_sample(nvml: Any) -> dict[str, Any]:
    """Written against the pynvml module; receives FakeNvml in its place."""
    nvml.nvmlInit()
    try:
        out: dict[str, Any] = {"driver": nvml.nvmlSystemGetDriverVersion()}
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            try:
                util: int | None = nvml.nvmlDeviceGetUtilizationRates(h).gpu
            except nvml.NVMLError_NotSupported:
                util = None
            out[nvml.nvmlDeviceGetUUID(h)] = (
                util,
                nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
            )
        return out
    finally:
        nvml.nvmlShutdown()


def test_code_written_against_pynvml_runs_unchanged(clock: FakeClock) -> None:
    nvml = FakeNvml.from_capture(FIXTURES / "a100-sxm4-v12.xml", clock=clock)
    assert _agent_style_sample(nvml) == {
        "driver": "535.54.03",
        "GPU-513536b6-7d19-9063-b049-1e69664bb298": (None, 67.03, 27),
    }
    with pytest.raises(AttributeError):
        _ = nvml.nvmlDeviceGetNotImplementedHere


def test_concurrent_reads_and_load_changes_stay_consistent() -> None:
    nvml = FakeNvml.from_capture(FIXTURES / "gtx-1card.xml")
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        last = 0
        try:
            while not stop.is_set():
                energy = nvml.nvmlDeviceGetTotalEnergyConsumption(h)
                assert energy >= last
                last = energy
                assert nvml.nvmlDeviceGetPowerUsage(h) in (100_000, 200_000)
        except BaseException as exc:
            errors.append(exc)

    nvml.set_load(0, power_draw_w=100.0)
    readers = [threading.Thread(target=reader) for _ in range(4)]
    for thread in readers:
        thread.start()
    for step in range(2000):
        nvml.set_load(0, power_draw_w=200.0 if step % 2 else 100.0)
    stop.set()
    for thread in readers:
        thread.join()
    assert errors == []

"""FakeNvml: pynvml's names, units and errors over recorded GPUs."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest

from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.capture.nvidia_smi import MIB, GpuRecord, MigRecord, NvLinkRecord
from hyperagent.readings import Kind, Reading

from conftest import ManualClock

FIXTURES = Path(__file__).parents[2] / "fixtures" / "nvidia-smi"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def v100s(clock: ManualClock) -> FakeNvml:
    nvml = FakeNvml.from_capture(FIXTURES / "gtx-8card.xml", clock=clock)
    nvml.nvmlInit()
    return nvml


def _bare(**fields: Any) -> GpuRecord:
    return GpuRecord(index=0, name="bare", uuid="GPU-bare", pci_bus_id="0", driver="1", **fields)


def test_calls_before_init_and_after_shutdown_raise_uninitialized(clock: ManualClock) -> None:
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


def test_handles_of_another_instance_are_invalid(v100s: FakeNvml, clock: ManualClock) -> None:
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


def test_memory_info_v1_counts_reserved_as_used_and_v2_separates_it(clock: ManualClock) -> None:
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


def test_missing_fields_raise_not_supported(clock: ManualClock) -> None:
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


def test_set_power_limit_without_permission(clock: ManualClock) -> None:
    nvml = FakeNvml.from_capture(FIXTURES / "tesla-t4.xml", clock=clock, writable=False)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nvml.nvmlDeviceSetPowerManagementLimit(h, 65_000)
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 70_000


def test_set_power_limit_unsupported_without_constraints(clock: ManualClock) -> None:
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


def test_energy_integrates_capped_power_over_time(v100s: FakeNvml, clock: ManualClock) -> None:
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
    v100s: FakeNvml, clock: ManualClock
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


def test_records_must_be_numbered_by_position(clock: ManualClock) -> None:
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


def test_code_written_against_pynvml_runs_unchanged(clock: ManualClock) -> None:
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


# -- health, PCIe, NVLink, events, MIG and GPM ---------------------------------------------------


def _started(name: str, clock: ManualClock) -> FakeNvml:
    nvml = FakeNvml.from_capture(FIXTURES / name, clock=clock)
    nvml.nvmlInit()
    return nvml


H100 = "linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt"
L40S = "linux-x86_64__nvidia-l40s__595.80.txt"


def test_clock_event_reasons_by_driver_generation(v100s: FakeNvml, clock: ManualClock) -> None:
    capped = v100s.nvmlDeviceGetHandleByIndex(3)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):  # driver 460 predates the new name
        v100s.nvmlDeviceGetCurrentClocksEventReasons(capped)
    assert v100s.nvmlDeviceGetCurrentClocksThrottleReasons(capped) == (
        pynvml.nvmlClocksThrottleReasonSwPowerCap
    )
    assert v100s.nvmlDeviceGetCurrentClocksThrottleReasons(v100s.nvmlDeviceGetHandleByIndex(0)) == 0
    a10g = _started("a10g.xml", clock)
    assert a10g.nvmlDeviceGetCurrentClocksThrottleReasons(a10g.nvmlDeviceGetHandleByIndex(0)) == (
        pynvml.nvmlClocksEventReasonGpuIdle
    )
    a100 = _started("a100-sxm4-v12.xml", clock)
    assert a100.nvmlDeviceGetCurrentClocksEventReasons(a100.nvmlDeviceGetHandleByIndex(0)) == 0
    v100s.set_clock_event_reasons(0, {"hw_slowdown", "sync_boost"})
    assert v100s.nvmlDeviceGetCurrentClocksThrottleReasons(v100s.nvmlDeviceGetHandleByIndex(0)) == (
        pynvml.nvmlClocksEventReasonHwSlowdown | pynvml.nvmlClocksEventReasonSyncBoost
    )
    with pytest.raises(ValueError, match="unknown clock event reasons"):
        v100s.set_clock_event_reasons(0, {"tired"})


def test_violation_status_from_recorded_counters(v100s: FakeNvml, clock: ManualClock) -> None:
    l40s = _started(L40S, clock)
    h = l40s.nvmlDeviceGetHandleByIndex(0)
    power = l40s.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_POWER)
    assert power.violationTime == 204_642_816_000
    assert (
        l40s.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_SYNC_BOOST).violationTime == 0
    )
    with pytest.raises(pynvml.NVMLError_NotSupported):  # not among the capture's counters
        l40s.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        l40s.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_COUNT)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # -q -x dumps hold no counters
        v100s.nvmlDeviceGetViolationStatus(
            v100s.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_PERF_POLICY_POWER
        )


def test_ecc_retired_pages_and_remapped_rows(v100s: FakeNvml, clock: ManualClock) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    for error_type in (
        pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    ):
        for counter in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            assert v100s.nvmlDeviceGetTotalEccErrors(h, error_type, counter) == 0
    assert (
        v100s.nvmlDeviceGetMemoryErrorCounter(
            h,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
            pynvml.NVML_MEMORY_LOCATION_CBU,
        )
        == 0
    )
    with pytest.raises(pynvml.NVMLError_NotSupported):  # texture memory is N/A in the dump
        v100s.nvmlDeviceGetMemoryErrorCounter(
            h,
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            pynvml.NVML_VOLATILE_ECC,
            pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY,
        )
    cause = pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    assert v100s.nvmlDeviceGetRetiredPages(h, cause) == []
    assert v100s.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_DISABLED
    with pytest.raises(pynvml.NVMLError_NotSupported):
        v100s.nvmlDeviceGetRemappedRows(h)
    a10g = _started("a10g.xml", clock)
    h = a10g.nvmlDeviceGetHandleByIndex(0)
    assert a10g.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        a10g.nvmlDeviceGetRetiredPages(h, cause)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        a10g.nvmlDeviceGetRetiredPagesPendingStatus(h)


def test_pcie_throughput_is_in_kb_per_second(v100s: FakeNvml) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(5)
    assert v100s.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES) == 7_151_000
    assert v100s.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES) == 8_083_000
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        v100s.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_COUNT)


def test_field_values_answer_per_field(v100s: FakeNvml) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(1)
    temp, links, replays, unknown = v100s.nvmlDeviceGetFieldValues(
        h,
        [
            pynvml.NVML_FI_DEV_MEMORY_TEMP,
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0),
            pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER,
            pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON,
        ],
    )
    assert isinstance(temp, pynvml.c_nvmlFieldValue_t)
    assert (temp.nvmlReturn, temp.valueType, temp.value.uiVal) == (
        pynvml.NVML_SUCCESS,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
        56,
    )
    assert links.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # PCIe V100S: no NVLink
    assert (links.fieldId, links.scopeId) == (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0)
    assert (replays.nvmlReturn, replays.value.ullVal) == (pynvml.NVML_SUCCESS, 0)
    assert unknown.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # an id the fake does not serve


def _fields(nvml: FakeNvml, handle: Any, *ids: int | tuple[int, int]) -> list[int | None]:
    """The value of each field, None where its own return code is not SUCCESS."""
    out: list[int | None] = []
    for value in nvml.nvmlDeviceGetFieldValues(handle, list(ids)):
        if value.nvmlReturn != pynvml.NVML_SUCCESS:
            out.append(None)
        elif value.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
            out.append(value.value.uiVal)
        else:
            assert value.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            out.append(value.value.ullVal)
    return out


def test_power_energy_and_limit_fields_in_nvml_units(v100s: FakeNvml, clock: ManualClock) -> None:
    """The same numbers as the older calls: mW, mJ; the module power scope is not supported."""
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    gpu, module = pynvml.NVML_POWER_SCOPE_GPU, pynvml.NVML_POWER_SCOPE_MODULE
    assert _fields(
        v100s,
        h,
        (pynvml.NVML_FI_DEV_POWER_AVERAGE, gpu),
        (pynvml.NVML_FI_DEV_POWER_INSTANT, gpu),
        (pynvml.NVML_FI_DEV_POWER_INSTANT, module),
        (pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT, gpu),
        (pynvml.NVML_FI_DEV_POWER_MIN_LIMIT, gpu),
        (pynvml.NVML_FI_DEV_POWER_MAX_LIMIT, gpu),
    ) == [232_800, 232_800, None, 250_000, 100_000, 250_000]
    assert v100s.nvmlDeviceGetPowerUsage(h) == 232_800
    clock.now = 10.0
    energy, also = _fields(
        v100s, h, pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, pynvml.NVML_FI_DEV_ENERGY
    )
    assert energy == also == 2_328_000 == v100s.nvmlDeviceGetTotalEnergyConsumption(h)


def test_health_and_throttle_fields_match_the_older_calls(
    v100s: FakeNvml, clock: ManualClock
) -> None:
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    assert _fields(
        v100s,
        h,
        pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
        pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL,
        pynvml.NVML_FI_DEV_RETIRED_SBE,
        pynvml.NVML_FI_DEV_RETIRED_DBE,
        pynvml.NVML_FI_DEV_RETIRED_PENDING,
        pynvml.NVML_FI_DEV_REMAPPED_COR,  # the V100S has no row remapper
        pynvml.NVML_FI_DEV_PERF_POLICY_POWER,  # -q -x dumps hold no counters
    ) == [0, 0, 0, 0, 0, None, None]
    l40s = _started(L40S, clock)
    h = l40s.nvmlDeviceGetHandleByIndex(0)
    power, sync, thermal = _fields(
        l40s,
        h,
        pynvml.NVML_FI_DEV_PERF_POLICY_POWER,
        pynvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST,
        pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL,
    )
    assert (power, sync, thermal) == (204_642_816_000, 0, None)  # ns, as the violation status
    assert l40s.nvmlDeviceGetRemappedRows(h) == tuple(
        _fields(
            l40s,
            h,
            pynvml.NVML_FI_DEV_REMAPPED_COR,
            pynvml.NVML_FI_DEV_REMAPPED_UNC,
            pynvml.NVML_FI_DEV_REMAPPED_PENDING,
            pynvml.NVML_FI_DEV_REMAPPED_FAILURE,
        )
    )


def test_calls_are_counted_per_function(v100s: FakeNvml) -> None:
    before = v100s.call_counts()
    h = v100s.nvmlDeviceGetHandleByIndex(0)
    v100s.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    v100s.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a failed call is a call
        v100s.nvmlDeviceGetRemappedRows(h)
    after = v100s.call_counts()
    assert before == {"nvmlInit": 1}
    assert after == {
        "nvmlInit": 1,
        "nvmlDeviceGetHandleByIndex": 1,
        "nvmlDeviceGetFieldValues": 2,
        "nvmlDeviceGetRemappedRows": 1,
    }


def test_a_lowered_cap_holds_the_draw_only_after_the_response_time(clock: ManualClock) -> None:
    nvml = FakeNvml.from_capture(FIXTURES / "gtx-8card.xml", clock=clock, cap_response_s=0.5)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)  # draws 232.8 W under a 250 W limit
    instant = (pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_GPU)
    nvml.nvmlDeviceSetPowerManagementLimit(h, 150_000)
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 150_000
    assert _fields(nvml, h, instant) == [232_800]
    clock.now = 0.49
    assert nvml.nvmlDeviceGetPowerUsage(h) == 232_800
    clock.now = 0.5
    assert _fields(nvml, h, instant) == [150_000]
    assert nvml.nvmlDeviceGetPowerUsage(h) == 150_000
    with pytest.raises(ValueError, match="cap_response_s"):
        FakeNvml.from_capture(FIXTURES / "gtx-8card.xml", clock=clock, cap_response_s=-1)


def test_nvlink_state_and_counters(clock: ManualClock) -> None:
    h100 = _started(H100, clock)
    h = h100.nvmlDeviceGetHandleByIndex(0)
    assert [h100.nvmlDeviceGetNvLinkState(h, link) for link in range(18)] == [
        pynvml.NVML_FEATURE_ENABLED
    ] * 18
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        h100.nvmlDeviceGetNvLinkState(h, 18)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # errors are not in the capture
        h100.nvmlDeviceGetNvLinkErrorCounter(h, 0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY)
    (traffic,) = h100.nvmlDeviceGetFieldValues(
        h, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 3)]
    )
    assert traffic.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    gpu = replace(
        _bare(),
        nvlinks=(
            NvLinkRecord(0, active=True, tx_bytes=4096, rx_bytes=2048, errors={"crc_flit": 3}),
            NvLinkRecord(1, active=False),
        ),
    )
    nvml = FakeNvml([gpu], clock=clock)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetNvLinkState(h, 1) == pynvml.NVML_FEATURE_DISABLED
    assert nvml.nvmlDeviceGetNvLinkErrorCounter(h, 0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT) == 3
    tx, rx = nvml.nvmlDeviceGetFieldValues(
        h,
        [
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0),
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0),
        ],
    )
    assert (tx.value.ullVal, rx.value.ullVal) == (4, 2)  # KiB
    with pytest.raises(pynvml.NVMLError_NotSupported):
        v = FakeNvml([_bare()], clock=clock)
        v.nvmlInit()
        v.nvmlDeviceGetNvLinkState(v.nvmlDeviceGetHandleByIndex(0), 0)


def test_xid_events_reach_registered_sets_and_wait_times_out(v100s: FakeNvml) -> None:
    events = v100s.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_Timeout):
        v100s.nvmlEventSetWait_v2(events, 10)
    h2 = v100s.nvmlDeviceGetHandleByIndex(2)
    v100s.nvmlDeviceRegisterEvents(h2, pynvml.nvmlEventTypeXidCriticalError, events)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        v100s.nvmlDeviceRegisterEvents(h2, pynvml.nvmlEventTypePState, events)
    v100s.inject_xid(2, 79)
    v100s.inject_xid(2, 48)
    first = v100s.nvmlEventSetWait_v2(events, 10)
    assert (first.device, first.eventType, first.eventData) == (
        h2,
        pynvml.nvmlEventTypeXidCriticalError,
        79,
    )
    assert v100s.nvmlEventSetWait(events, 10).eventData == 48
    with pytest.raises(pynvml.NVMLError_Timeout):
        v100s.nvmlEventSetWait_v2(events, 10)
    v100s.nvmlEventSetFree(events)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        v100s.nvmlEventSetWait_v2(events, 10)


def test_an_event_wakes_a_waiting_thread(v100s: FakeNvml) -> None:
    events = v100s.nvmlEventSetCreate()
    v100s.nvmlDeviceRegisterEvents(
        v100s.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, events
    )
    got: list[int] = []
    waiter = threading.Thread(
        target=lambda: got.append(v100s.nvmlEventSetWait_v2(events, 5000).eventData)
    )
    waiter.start()
    v100s.inject_xid(0, 31)
    waiter.join(timeout=5)
    assert got == [31]


def test_xids_raised_before_registration_wait_for_the_first_set(v100s: FakeNvml) -> None:
    v100s.inject_xid(1, 13)
    events = v100s.nvmlEventSetCreate()
    v100s.nvmlDeviceRegisterEvents(
        v100s.nvmlDeviceGetHandleByIndex(1), pynvml.nvmlEventTypeXidCriticalError, events
    )
    assert v100s.nvmlEventSetWait_v2(events, 10).eventData == 13
    with pytest.raises(ValueError):
        v100s.inject_xid(1, -1)


def test_mig_devices_of_the_a100(clock: ManualClock) -> None:
    nvml = _started("a100-sxm4-v12.xml", clock)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(h) == [pynvml.NVML_DEVICE_MIG_ENABLE] * 2
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 4
    migs = [nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, slot) for slot in range(4)]
    assert migs[0] is nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert [nvml.nvmlDeviceGetGpuInstanceId(m) for m in migs] == [3, 4, 5, 6]
    assert {nvml.nvmlDeviceGetComputeInstanceId(m) for m in migs} == {0}
    assert nvml.nvmlDeviceIsMigDeviceHandle(migs[1]) and not nvml.nvmlDeviceIsMigDeviceHandle(h)
    assert nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migs[2]) is h
    memory = nvml.nvmlDeviceGetMemoryInfo(migs[3])
    assert (memory.total, memory.used) == (19968 * MIB, 12 * MIB)
    for unrecorded in (nvml.nvmlDeviceGetUUID, nvml.nvmlDeviceGetName):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            unrecorded(migs[0])
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a GPU call on a MIG device
        nvml.nvmlDeviceGetPowerUsage(migs[0])
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceId(h)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 4)


def test_mig_identity_where_recorded(clock: ManualClock) -> None:
    mig = MigRecord(
        0, 1, 0, uuid="MIG-7e3b", profile="3g.40gb", mem_total_bytes=1, mem_used_bytes=0
    )
    nvml = FakeNvml([replace(_bare(), mig_enabled=True, mig_devices=(mig,))], clock=clock)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    assert nvml.nvmlDeviceGetUUID(handle) == "MIG-7e3b"
    assert nvml.nvmlDeviceGetName(handle) == "bare MIG 3g.40gb"


def test_no_mig_and_no_gpm_on_older_gpus(v100s: FakeNvml, clock: ManualClock) -> None:
    for nvml in (v100s, _started("tesla-t4.xml", clock), _started("a10g.xml", clock)):
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetMigMode(h)
        assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0
        assert nvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0
        sample = nvml.nvmlGpmSampleAlloc()
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlGpmSampleGet(h, sample)
        nvml.nvmlGpmSampleFree(sample)


def test_gpm_metrics_over_two_samples(clock: ManualClock) -> None:
    nvml = FakeNvml([replace(_bare(), sm_active_pct=40.0, tensor_active_pct=12.5)], clock=clock)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    first, second = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmSampleGet(h, first)
    nvml.set_load(0, sm_active_pct=75.0)
    nvml.nvmlGpmSampleGet(h, second)
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = 3
    request.sample1, request.sample2 = first, second
    for i, metric in enumerate(
        (
            pynvml.NVML_GPM_METRIC_SM_UTIL,
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
        )
    ):
        request.metrics[i].metricId = metric
    nvml.nvmlGpmMetricsGet(request)
    assert [(m.nvmlReturn, m.value) for m in request.metrics[:3]] == [
        (pynvml.NVML_SUCCESS, 75.0),
        (pynvml.NVML_SUCCESS, 12.5),
        (pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0),
    ]
    request.version = 99
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlGpmMetricsGet(request)
    nvml.nvmlGpmSampleFree(first)
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # a freed sample
        nvml.nvmlGpmMetricsGet(request)


def _reading(name: str, value: float, kind: Kind = Kind.GAUGE, **labels: str) -> Reading:
    return Reading(name, value, {"gpu": "0", "uuid": "GPU-r", **labels}, kind)


def _info() -> Reading:
    return _reading("hyperagent_gpu_info", 1, Kind.INFO, model="NVIDIA H100", driver="550.1")


def test_from_readings_answers_like_the_recorded_gpu(clock: ManualClock) -> None:
    nvml = FakeNvml.from_readings(
        [
            _info(),
            _reading("hyperagent_gpu_power_watts", 312.5),
            _reading("hyperagent_gpu_energy_joules_total", 1500.25, Kind.COUNTER),
            _reading("hyperagent_gpu_sm_active_ratio", 0.07),
            _reading("hyperagent_gpu_throttle_seconds_total", 2.5, Kind.COUNTER, reason="thermal"),
            _reading("hyperagent_gpu_xid_errors_total", 2, Kind.COUNTER, xid="79"),
            _reading("hyperagent_gpu_quantum_coefficient", 1.2),  # not NVML's: ignored
            Reading("hyperagent_host_swap_used_bytes", 0.0),
        ],
        clock=clock,
    )
    nvml.nvmlInit()
    assert nvml.nvmlSystemGetDriverVersion() == "550.1"
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA H100"
    assert nvml.nvmlDeviceGetPowerUsage(h) == 312_500
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(h) == 1_500_250
    clock.now = 2.0
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(h) == 1_500_250 + 625_000
    thermal = nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL)
    assert thermal.violationTime == 2_500_000_000
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetUtilizationRates(h)
    assert nvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    events = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, events)
    assert [nvml.nvmlEventSetWait_v2(events, 10).eventData for _ in range(2)] == [79, 79]


def test_recorded_instant_power_is_replayed_and_held_by_a_set_limit(clock: ManualClock) -> None:
    def frame(average_w: float, instant_w: float) -> list[Reading]:
        return [
            _info(),
            _reading("hyperagent_gpu_power_watts", average_w),
            _reading("hyperagent_gpu_power_instant_watts", instant_w),
            _reading("hyperagent_gpu_power_limit_watts", 700.0),
            _reading("hyperagent_gpu_power_limit_min_watts", 200.0),
            _reading("hyperagent_gpu_power_limit_max_watts", 700.0),
        ]

    nvml = FakeNvml.from_readings(frame(612.0, 655.5), clock=clock)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    gpu = pynvml.NVML_POWER_SCOPE_GPU
    average = (pynvml.NVML_FI_DEV_POWER_AVERAGE, gpu)
    instant = (pynvml.NVML_FI_DEV_POWER_INSTANT, gpu)
    assert _fields(nvml, h, average, instant) == [612_000, 655_500]
    nvml.update_from_readings(frame(590.0, 720.0))  # an instant spike over the limit, recorded
    assert _fields(nvml, h, average, instant) == [590_000, 720_000]
    nvml.nvmlDeviceSetPowerManagementLimit(h, 400_000)
    assert _fields(nvml, h, average, instant) == [400_000, 400_000]
    nvml.set_load(0, power_draw_w=300.0)
    assert _fields(nvml, h, average, instant) == [300_000, 300_000]


def test_update_from_readings_fails_absent_gpus_and_raises_new_xids(clock: ManualClock) -> None:
    nvml = FakeNvml.from_readings([_info()], clock=clock)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    events = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, events)
    nvml.update_from_readings([])
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.nvmlDeviceGetName(h)
    nvml.update_from_readings(
        [_info(), _reading("hyperagent_gpu_xid_errors_total", 1, Kind.COUNTER, xid="48")]
    )
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA H100"
    assert nvml.nvmlEventSetWait_v2(events, 10).eventData == 48
    nvml.update_from_readings(
        [_info(), _reading("hyperagent_gpu_xid_errors_total", 1, Kind.COUNTER, xid="48")]
    )
    with pytest.raises(pynvml.NVMLError_Timeout):  # the same count: no new event
        nvml.nvmlEventSetWait_v2(events, 10)
    other = Reading("hyperagent_gpu_info", 1, {"gpu": "0", "uuid": "GPU-other"}, Kind.INFO)
    with pytest.raises(ValueError, match="GPU 0 is GPU-other"):
        nvml.update_from_readings([other])


@pytest.mark.parametrize(
    ("readings", "message"),
    [
        ([], "readings hold no GPU"),
        ([_reading("hyperagent_gpu_power_watts", 1.0)], "no hyperagent_gpu_info"),
        (
            [Reading("hyperagent_gpu_power_watts", 1.0, {"gpu": "zero", "uuid": "x"})],
            "not a number",
        ),
        ([Reading("hyperagent_gpu_power_watts", 1.0, {"gpu": "0"})], "label 'uuid' missing"),
        ([_info(), _reading("hyperagent_gpu_info", 1, Kind.INFO, gpu="2")], r"GPUs \[0, 2\]"),
        (
            [_info(), Reading("hyperagent_gpu_power_watts", 1.0, {"gpu": "0", "uuid": "GPU-s"})],
            "appears as",
        ),
        (
            [_info(), _reading("hyperagent_gpu_throttle_seconds_total", 1.0, Kind.COUNTER)],
            "label 'reason' missing",
        ),
    ],
)
def test_from_readings_rejects_what_no_source_produced(
    readings: list[Reading], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        FakeNvml.from_readings(readings)


# -- fault injection ------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    """Replace ``path`` atomically, as a test injecting faults into a running agent does."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)


def test_faults_from_the_environment_file_come_and_go_while_the_fake_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    faults = tmp_path / "faults.json"
    monkeypatch.setenv("HYPERAGENT_FAKE_NVML_FAULTS", str(faults))
    nvml = FakeNvml.from_capture(FIXTURES / "gtx-8card.xml")  # the file does not exist yet
    nvml.nvmlInit()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
    assert nvml.nvmlDeviceGetPowerUsage(handles[3]) > 0

    _write(faults, '{"nvmlDeviceGetPowerUsage": {"error": "NVML_ERROR_GPU_IS_LOST", "gpus": [3]}}')
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetPowerUsage(handles[3])
    assert nvml.nvmlDeviceGetPowerUsage(handles[2]) > 0  # only GPU 3's handle
    assert nvml.nvmlDeviceGetTemperature(handles[3], pynvml.NVML_TEMPERATURE_GPU) > 0

    _write(faults, '{"*": {"error": "NVML_ERROR_UNKNOWN"}}')
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.nvmlDeviceGetCount()

    _write(faults, "")  # empty: no faults
    assert nvml.nvmlDeviceGetCount() == 8

    _write(faults, '{"nvmlDeviceGetPowerUsag": {"block_s": 1}}')
    for _ in range(3):
        assert nvml.nvmlDeviceGetPowerUsage(handles[0]) > 0
    problems = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(problems) == 1  # a malformed file is said once, and injects nothing
    assert "HYPERAGENT_FAKE_NVML_FAULTS" in problems[0].getMessage()
    assert "'nvmlDeviceGetPowerUsag': no such NVML function" in problems[0].getMessage()

    faults.unlink()
    assert nvml.nvmlDeviceGetPowerUsage(handles[3]) > 0


def test_a_blocking_fault_sleeps_in_the_calling_thread_only(tmp_path: Path) -> None:
    faults = tmp_path / "faults.json"
    _write(faults, '{"nvmlDeviceSetPowerManagementLimit": {"block_s": 0.3}}')
    nvml = FakeNvml.from_capture(FIXTURES / "gtx-8card.xml", faults_file=faults)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    setter = threading.Thread(target=nvml.nvmlDeviceSetPowerManagementLimit, args=(handle, 150000))
    setter.start()
    while nvml.call_counts().get("nvmlDeviceSetPowerManagementLimit", 0) == 0:
        threading.Event().wait(0.001)
    # another thread's calls are not held by the blocked one (no lock is held while it sleeps)
    assert nvml.nvmlDeviceGetPowerManagementLimit(handle) == 250000
    setter.join(10)
    assert not setter.is_alive()
    assert nvml.nvmlDeviceGetPowerManagementLimit(handle) == 150000  # then it proceeded


def test_faults_set_in_process_are_checked_and_cleared() -> None:
    nvml = FakeNvml.from_capture(FIXTURES / "gtx-8card.xml")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(5)
    nvml.set_faults({"nvmlDeviceGetTotalEnergyConsumption": {"error": "NVML_ERROR_TIMEOUT"}})
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    nvml.set_faults(None)
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(handle) >= 0
    for bad, reason in (
        ({"nvmlDeviceGetPowerUsage": {"error": "GPU_IS_LOST"}}, "no pynvml NVML_ERROR_"),
        ({"nvmlDeviceGetPowerUsage": {"block_s": -1}}, "must be >= 0"),
        ({"nvmlDeviceGetPowerUsage": {"gpus": [1]}}, "needs block_s or error"),
        ({"nvmlDeviceGetPowerUsage": {"block_s": 1, "gpu": [1]}}, "unknown keys"),
    ):
        with pytest.raises(ValueError, match=reason):
            nvml.set_faults(bad)
    with pytest.raises(ValueError, match="no such NVML function"):
        FakeNvml.from_capture(FIXTURES / "gtx-1card.xml", faults={"nvmlBogus": {"block_s": 1}})

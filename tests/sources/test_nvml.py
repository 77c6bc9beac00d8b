"""NvmlSource over FakeNvml replaying real nvidia-smi captures, and over the real pynvml."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pynvml
import pytest
from prometheus_client import generate_latest

from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.capture.nvidia_smi import (
    GpuRecord,
    MigRecord,
    NvLinkRecord,
    RemappedRows,
    parse_capture,
)
from hyperagent.devices.metrics import HELP
from hyperagent.devices.nvml_telemetry import NvmlSourceError, mig_profile
from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.exporter import MetricsServer
from hyperagent.readings import Kind, Reading
from hyperagent.sources.nvml import NvmlSource
from hyperagent.sources.runner import SourceRunner

from conftest import FIXTURES, ManualClock

CAPTURES = FIXTURES / "nvidia-smi"
GOLDEN = Path(__file__).parents[1] / "golden" / "nvml"
ALL_CAPTURES = sorted(p.name for p in CAPTURES.iterdir() if p.suffix in {".xml", ".txt"})
H100 = "linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt"
L40S = "linux-x86_64__nvidia-l40s__595.80.txt"


def key(reading: Reading) -> tuple[str, tuple[tuple[str, str], ...]]:
    return reading.name, tuple(sorted(reading.labels.items()))


def rendered(readings: Iterable[Reading]) -> list[str]:
    """One line per reading, sorted: kind, name{labels} and the value's repr."""
    lines = []
    for r in readings:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(r.labels.items()))
        lines.append(f"{r.kind.value} {r.name}{{{labels}}} {r.value!r}")
    return sorted(lines)


def values(readings: Iterable[Reading], name: str, **labels: str) -> dict[str, float]:
    """{gpu: value} of the readings named `name` whose labels include `labels`."""
    return {
        r.labels["gpu"]: r.value
        for r in readings
        if r.name == name and all(r.labels.get(k) == v for k, v in labels.items())
    }


def names(readings: Iterable[Reading]) -> set[str]:
    return {r.name for r in readings}


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


async def started(nvml: Any, clock: ManualClock) -> NvmlSource:
    source = NvmlSource(nvml, clock=clock, event_wait_ms=20)
    await source.start()
    return source


def capture(name: str, clock: ManualClock) -> FakeNvml:
    return FakeNvml.from_capture(CAPTURES / name, clock=clock)


async def two_reads(name: str) -> list[Reading]:
    """The second of two reads ten (fake) seconds apart, as the agent would see it."""
    clock = ManualClock()
    source = await started(capture(name, clock), clock)
    try:
        await source.read()
        clock.now = 10.0
        return await source.read()
    finally:
        await source.close()


# -- every field on every capture ---------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_CAPTURES)
async def test_readings_match_golden(name: str) -> None:
    text = "\n".join(rendered(await two_reads(name))) + "\n"
    golden = GOLDEN / f"{Path(name).stem}.txt"
    if os.environ.get("HYPERAGENT_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), "rerun with HYPERAGENT_UPDATE_GOLDEN=1 to accept"


@pytest.mark.parametrize("name", ALL_CAPTURES)
async def test_every_metric_has_help_and_one_label_set(name: str) -> None:
    readings = await two_reads(name)
    assert names(readings) <= set(HELP)
    label_sets: dict[str, set[frozenset[str]]] = {}
    for r in readings:
        label_sets.setdefault(r.name, set()).add(frozenset(r.labels))
        assert (r.kind is Kind.COUNTER) == r.name.endswith("_total"), r.name
        if r.name.endswith("_ratio"):
            assert 0.0 <= r.value <= 1.0, r
    assert all(len(sets) == 1 for sets in label_sets.values()), label_sets


async def test_v100s_under_load() -> None:
    readings = await two_reads("gtx-8card.xml")
    assert values(readings, "hyperagent_gpu_memory_temperature_celsius")["0"] == 63
    assert values(readings, "hyperagent_gpu_pcie_throughput_bytes_per_second", direction="tx")[
        "5"
    ] == (7151000 * 1024)
    capped = values(readings, "hyperagent_gpu_throttle_seconds_total", reason="sw_power_cap")
    assert capped == {str(i): 10.0 if i in (3, 6) else 0.0 for i in range(8)}
    assert values(readings, "hyperagent_gpu_ecc_lifetime_errors_total", type="uncorrected") == {
        str(i): 0.0 for i in range(8)
    }
    assert values(readings, "hyperagent_gpu_retired_pages", cause="double_bit_ecc")["7"] == 0
    assert values(readings, "hyperagent_gpu_pcie_replays_total")["0"] == 0


async def test_h100_links_and_nvml_counted_throttle_time() -> None:
    readings = await two_reads(H100)
    links = [r for r in readings if r.name == "hyperagent_gpu_nvlink_up"]
    assert sorted(int(r.labels["link"]) for r in links) == list(range(18))
    assert {r.value for r in links} == {1.0}
    assert values(readings, "hyperagent_gpu_memory_temperature_celsius") == {"0": 54.0}
    assert values(readings, "hyperagent_gpu_remapped_rows", cause="uncorrectable") == {"0": 0.0}
    l40s = await two_reads(L40S)
    power_capped = values(l40s, "hyperagent_gpu_throttle_seconds_total", reason="sw_power_cap")
    assert power_capped == {"0": 204.642816}  # NVML's counter, not the agent's 10 s


# -- NOT_SUPPORTED is left out, never zero ------------------------------------------------------


@pytest.mark.parametrize("name", ["tesla-t4.xml", "a10g.xml", "gtx-1card.xml"])
async def test_older_gpus_lack_gpm_mig_and_links(name: str) -> None:
    readings = await two_reads(name)
    absent = {
        "hyperagent_gpu_sm_active_ratio",
        "hyperagent_gpu_tensor_active_ratio",
        "hyperagent_gpu_sm_occupancy_ratio",
        "hyperagent_gpu_dram_active_ratio",
        "hyperagent_gpu_mig_info",
        "hyperagent_gpu_nvlink_up",
        "hyperagent_gpu_nvlink_data_bytes_total",
    }
    assert not names(readings) & absent
    assert "hyperagent_gpu_utilization_ratio" in names(readings)


async def test_a10g_and_t4_lack_what_their_dumps_call_na() -> None:
    a10g = names(await two_reads("a10g.xml"))
    assert "hyperagent_gpu_memory_temperature_celsius" not in a10g
    assert "hyperagent_gpu_retired_pages" not in a10g
    assert "hyperagent_gpu_remapped_rows" in a10g
    t4 = names(await two_reads("tesla-t4.xml"))
    assert "hyperagent_gpu_remapped_rows" not in t4
    assert "hyperagent_gpu_retired_pages" in t4


async def test_a100_in_mig_mode() -> None:
    readings = await two_reads("a100-sxm4-v12.xml")
    assert "hyperagent_gpu_utilization_ratio" not in names(readings)
    migs = [r for r in readings if r.name == "hyperagent_gpu_mig_info"]
    assert sorted(r.labels["gi"] for r in migs) == ["3", "4", "5", "6"]
    assert {(r.labels["ci"], r.labels["mig_uuid"], r.labels["profile"]) for r in migs} == {
        ("0", "", "")  # -q -x dumps hold neither MIG UUIDs nor profiles
    }
    used = [r for r in readings if r.name == "hyperagent_gpu_mig_memory_used_bytes"]
    assert {r.value for r in used} == {12 * 2**20}
    assert set(used[0].labels) == {"gpu", "uuid", "gi", "ci"}


def test_mig_profile_from_the_name_nvml_gives() -> None:
    assert mig_profile("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb"
    assert mig_profile("NVIDIA H100 80GB HBM3 MIG 3g.40gb") == "3g.40gb"
    assert mig_profile("NVIDIA A100-SXM4-40GB") == ""
    assert mig_profile("MIG 1g.5gb") == ""


# -- a rich synthetic device: GPM, NVLink traffic and errors, MIG identity ---------------------


def rich_gpus() -> list[GpuRecord]:
    """Two GPUs exercising every call the captures cannot (test inputs, not recordings)."""
    base = GpuRecord(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        uuid="GPU-0aa",
        pci_bus_id="00000000:18:00.0",
        driver="550.54.15",
        util_gpu_pct=97,
        util_mem_pct=40,
        mem_total_bytes=80 * 2**30,
        mem_used_bytes=61 * 2**30,
        power_draw_w=612.25,
        power_limit_w=700.0,
        min_power_limit_w=200.0,
        max_power_limit_w=700.0,
        temperature_c=61,
        memory_temperature_c=70,
        sm_clock_mhz=1980,
        mem_clock_mhz=2619,
        pcie_replay_count=2,
        pcie_tx_bytes_per_s=1024 * 1000,
        pcie_rx_bytes_per_s=1024 * 3000,
        clock_event_reasons=frozenset({"sw_power_cap"}),
        clock_event_counters_ns={"sw_power_cap": 3_000_000_000, "thermal": 0},
        ecc_errors={("corrected", "volatile"): 4, ("corrected", "aggregate"): 9},
        remapped_rows=RemappedRows(1, 0, pending=True, failure=False),
        nvlinks=(
            NvLinkRecord(
                0, True, tx_bytes=2**40, rx_bytes=2**39, errors={"replay": 1, "crc_flit": 0}
            ),
            NvLinkRecord(1, False, tx_bytes=0, rx_bytes=0, errors={"replay": 0, "crc_flit": 0}),
        ),
        sm_active_pct=83.5,
        sm_occupancy_pct=41.0,
        tensor_active_pct=55.25,
        dram_active_pct=7.0,
    )
    mig = replace(
        base,
        index=1,
        uuid="GPU-1bb",
        util_gpu_pct=None,
        util_mem_pct=None,
        mig_enabled=True,
        mig_devices=(
            MigRecord(0, 1, 0, "MIG-5f1e", "3g.40gb", 40 * 2**30, 2**30),
            MigRecord(2, 2, 0, "MIG-9c2d", "3g.40gb", 40 * 2**30, 0),
        ),
        nvlinks=(),
        sm_active_pct=None,
        sm_occupancy_pct=None,
        tensor_active_pct=None,
        dram_active_pct=None,
    )
    return [base, mig]


async def test_gpm_activities_track_the_load() -> None:
    clock = ManualClock()
    nvml = FakeNvml(rich_gpus(), clock=clock)
    source = await started(nvml, clock)
    try:
        first = await source.read()  # the first interval runs from start()
        assert values(first, "hyperagent_gpu_sm_active_ratio") == {"0": 0.835}
        assert values(first, "hyperagent_gpu_tensor_active_ratio") == {"0": 0.5525}
        assert values(first, "hyperagent_gpu_sm_occupancy_ratio") == {"0": 0.41}
        assert values(first, "hyperagent_gpu_dram_active_ratio") == {"0": 0.07}
        nvml.set_load(0, sm_active_pct=12.0)
        assert values(await source.read(), "hyperagent_gpu_sm_active_ratio") == {"0": 0.12}
    finally:
        await source.close()


async def test_nvlink_traffic_errors_and_mig_identity() -> None:
    clock = ManualClock()
    source = await started(FakeNvml(rich_gpus(), clock=clock), clock)
    try:
        readings = await source.read()
    finally:
        await source.close()
    data = {
        (r.labels["link"], r.labels["direction"]): r.value
        for r in readings
        if r.name == "hyperagent_gpu_nvlink_data_bytes_total"
    }
    assert data == {("0", "tx"): 2**40, ("0", "rx"): 2**39, ("1", "tx"): 0, ("1", "rx"): 0}
    errors = {
        (r.labels["link"], r.labels["type"]): r.value
        for r in readings
        if r.name == "hyperagent_gpu_nvlink_errors_total"
    }
    assert errors == {
        ("0", "replay"): 1,
        ("0", "crc_flit"): 0,
        ("1", "replay"): 0,
        ("1", "crc_flit"): 0,
    }
    up = {r.labels["link"]: r.value for r in readings if r.name == "hyperagent_gpu_nvlink_up"}
    assert up == {"0": 1.0, "1": 0.0}
    migs = {
        (r.labels["mig_uuid"], r.labels["gi"], r.labels["profile"])
        for r in readings
        if r.name == "hyperagent_gpu_mig_info"
    }
    assert migs == {("MIG-5f1e", "1", "3g.40gb"), ("MIG-9c2d", "2", "3g.40gb")}
    assert values(readings, "hyperagent_gpu_remapped_rows_pending") == {"0": 1.0, "1": 1.0}
    assert values(readings, "hyperagent_gpu_ecc_errors_total", type="corrected")["0"] == 4
    assert "hyperagent_gpu_ecc_errors_total" not in names(
        r for r in readings if r.labels.get("type") == "uncorrected"
    )


# -- clock-event (throttle) time ----------------------------------------------------------------


async def test_throttle_seconds_grow_with_time_under_an_active_reason() -> None:
    clock = ManualClock()
    nvml = capture("gtx-8card.xml", clock)
    source = await started(nvml, clock)

    async def seconds(reason: str) -> dict[str, float]:
        return values(await source.read(), "hyperagent_gpu_throttle_seconds_total", reason=reason)

    try:
        assert set((await seconds("sw_power_cap")).values()) == {0.0}
        clock.now = 10.0
        assert (await seconds("sw_power_cap"))["3"] == 10.0
        clock.now = 25.0
        assert (await seconds("sw_power_cap"))["3"] == 25.0
        nvml.set_clock_event_reasons(0, {"hw_slowdown"})
        clock.now = 30.0
        assert (await seconds("hw_slowdown"))["0"] == 5.0  # seen active at this read
        nvml.fail(0, pynvml.NVML_ERROR_GPU_IS_LOST)
        clock.now = 40.0
        with pytest.raises(SourceError):
            await source.read()
        clock.now = 100.0
        nvml.recover(0)
        assert (await seconds("hw_slowdown"))["0"] == 5.0  # the outage is not counted
        clock.now = 104.0
        assert (await seconds("hw_slowdown"))["0"] == 9.0
        nvml.set_clock_event_reasons(0, set())
        clock.now = 200.0
        assert (await seconds("hw_slowdown"))["0"] == 9.0
        assert (await seconds("sw_power_cap"))["0"] == 0.0
    finally:
        await source.close()


async def test_nvml_violation_counters_are_taken_as_they_are() -> None:
    clock = ManualClock()
    nvml = FakeNvml(rich_gpus(), clock=clock)
    source = await started(nvml, clock)
    try:
        await source.read()
        clock.now = 50.0
        readings = await source.read()
    finally:
        await source.close()
    assert values(readings, "hyperagent_gpu_throttle_seconds_total", reason="sw_power_cap") == {
        "0": 3.0,
        "1": 3.0,
    }
    assert values(readings, "hyperagent_gpu_throttle_seconds_total", reason="thermal")["0"] == 0.0


# -- XID events ---------------------------------------------------------------------------------


async def test_xid_counter_increments_and_never_decreases() -> None:
    clock = ManualClock()
    nvml = capture("gtx-8card.xml", clock)
    source = await started(nvml, clock)
    seen: list[dict[tuple[str, str], float]] = []

    async def xids() -> dict[tuple[str, str], float]:
        readings = await source.read()
        found = {
            (r.labels["gpu"], r.labels["xid"]): r.value
            for r in readings
            if r.name == "hyperagent_gpu_xid_errors_total"
        }
        for earlier in seen:
            assert all(found.get(k, 0) >= v for k, v in earlier.items())
        seen.append(found)
        return found

    try:
        assert await xids() == {}
        nvml.inject_xid(2, 79)
        await until(lambda: source.xid_counts() == {(2, 79): 1})
        assert await xids() == {("2", "79"): 1.0}
        nvml.inject_xid(2, 79)
        nvml.inject_xid(5, 48)
        await until(lambda: sum(source.xid_counts().values()) == 3)
        assert await xids() == {("2", "79"): 2.0, ("5", "48"): 1.0}
        nvml.fail(2, pynvml.NVML_ERROR_GPU_IS_LOST)
        nvml.inject_xid(2, 79)  # the driver reports the loss; reads fail meanwhile
        await until(lambda: source.xid_counts()[(2, 79)] == 3)
        with pytest.raises(SourceError):
            await source.read()
        nvml.recover(2)
        assert await xids() == {("2", "79"): 3.0, ("5", "48"): 1.0}
        labels = next(
            r.labels for r in await source.read() if r.name == "hyperagent_gpu_xid_errors_total"
        )
        assert set(labels) == {"gpu", "uuid", "xid"}
    finally:
        await source.close()


async def test_close_leaves_the_event_thread_to_end_its_wait_and_release_nvml() -> None:
    """close() does not wait out the XID watcher's wait (a stop would take up to
    event_wait_ms); the watcher then frees its event set and drops its NVML reference."""
    clock = ManualClock()
    nvml = capture("tesla-t4.xml", clock)
    source = NvmlSource(nvml, clock=clock, event_wait_ms=2000)
    await source.start()
    watcher = source.telemetry.events_thread
    assert watcher is not None and watcher.name == "nvml-xid-events"
    await source.close()
    assert watcher.is_alive()
    assert nvml.nvmlDeviceGetCount() == 1  # the watcher's reference keeps NVML initialised
    watcher.join(timeout=10)
    assert not watcher.is_alive()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


# -- failures -----------------------------------------------------------------------------------


async def test_a_lost_gpu_fails_the_read_and_the_runner_shows_it_down_until_recovery() -> None:
    clock = ManualClock()
    nvml = capture("gtx-8card.xml", clock)
    source = NvmlSource(nvml, clock=clock, event_wait_ms=20)
    runner = SourceRunner([source], timeout_s=5.0)
    await runner.start()
    try:
        nvml.fail(3, pynvml.NVML_ERROR_GPU_IS_LOST)
        with pytest.raises(NvmlSourceError, match="GPU 3") as lost:
            await source.read()
        assert lost.value.vendor_code == pynvml.NVML_ERROR_GPU_IS_LOST
        readings = await runner.read_all()
        labels = {"source": "nvml", "target": "local"}
        assert Reading("hyperagent_source_up", 0.0, labels) in readings
        assert not [r for r in readings if r.name.startswith("hyperagent_gpu_")]
        nvml.recover(3)
        readings = await runner.read_all()
        assert Reading("hyperagent_source_up", 1.0, labels) in readings
        assert len(values(readings, "hyperagent_gpu_power_watts")) == 8
    finally:
        await runner.close()


class GatedNvml(FakeNvml):
    """Field-value reads block until `gate` opens: an NVML call that hangs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any:
        self.entered.set()
        self.gate.wait(10)
        return super().nvmlDeviceGetFieldValues(handle, fieldIds)


async def test_a_read_still_running_refuses_the_next() -> None:
    clock = ManualClock()
    nvml = GatedNvml(parse_capture((CAPTURES / "tesla-t4.xml").read_text()), clock=clock)
    source = await started(nvml, clock)
    try:
        first = asyncio.create_task(source.read())
        await until(nvml.entered.is_set)
        with pytest.raises(SourceError, match="still running"):
            await source.read()
        nvml.gate.set()
        assert "hyperagent_gpu_power_watts" in names(await first)
        assert "hyperagent_gpu_power_watts" in names(await source.read())
    finally:
        nvml.gate.set()
        await source.close()


async def test_a_timed_out_read_keeps_refusing_until_its_thread_finishes() -> None:
    clock = ManualClock()
    nvml = GatedNvml(parse_capture((CAPTURES / "tesla-t4.xml").read_text()), clock=clock)
    source = NvmlSource(nvml, clock=clock, event_wait_ms=20)
    runner = SourceRunner([source], timeout_s=0.2)
    await runner.start()
    labels = {"source": "nvml", "target": "local"}
    try:
        assert Reading("hyperagent_source_up", 0.0, labels) in await runner.read_all()  # timeout
        with pytest.raises(SourceError, match="still running"):
            await source.read()
        nvml.gate.set()
        deadline = time.monotonic() + 5.0
        while Reading("hyperagent_source_up", 1.0, labels) not in await runner.read_all():
            assert time.monotonic() < deadline, "the read never came back"
            await asyncio.sleep(0.01)
    finally:
        nvml.gate.set()
        await runner.close()


class GarbageFields(FakeNvml):
    """Memory temperature of an unknown value type, NaN for the first NVLink traffic field, and
    GPM metrics out of range."""

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any:
        found = super().nvmlDeviceGetFieldValues(handle, fieldIds)
        nan_done = False
        for value in found:
            if value.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                value.valueType = 77
            elif value.fieldId == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX and not nan_done:
                value.valueType = pynvml.NVML_VALUE_TYPE_DOUBLE
                value.value.dVal = math.nan
                nan_done = True
        return found

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        super().nvmlGpmMetricsGet(metricsGet)
        metricsGet.metrics[0].value = math.inf
        metricsGet.metrics[1].value = -3.0
        metricsGet.metrics[2].value = 100.5
        return metricsGet


async def test_garbage_values_are_skipped_not_reported() -> None:
    clock = ManualClock()
    source = await started(GarbageFields(rich_gpus()[:1], clock=clock), clock)
    try:
        readings = await source.read()
    finally:
        await source.close()
    assert "hyperagent_gpu_memory_temperature_celsius" not in names(readings)
    data = [r for r in readings if r.name == "hyperagent_gpu_nvlink_data_bytes_total"]
    assert len(data) == 3  # the NaN one is left out
    assert "hyperagent_gpu_sm_active_ratio" not in names(readings)  # inf
    assert "hyperagent_gpu_sm_occupancy_ratio" not in names(readings)  # negative
    assert values(readings, "hyperagent_gpu_tensor_active_ratio") == {"0": 1.0}  # capped
    assert values(readings, "hyperagent_gpu_dram_active_ratio") == {"0": 0.07}


class LostField(FakeNvml):
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any:
        found = super().nvmlDeviceGetFieldValues(handle, fieldIds)
        found[-1].nvmlReturn = pynvml.NVML_ERROR_GPU_IS_LOST
        return found


async def test_a_field_that_fails_for_real_fails_the_read() -> None:
    clock = ManualClock()
    source = await started(LostField(rich_gpus()[:1], clock=clock), clock)
    try:
        with pytest.raises(NvmlSourceError, match="field") as failed:
            await source.read()
        assert failed.value.vendor_code == pynvml.NVML_ERROR_GPU_IS_LOST
    finally:
        await source.close()


class OlderDriver(FakeNvml):
    """A driver that predates a perf policy and an NVLink counter: INVALID_ARGUMENT for them,
    as a field and as a call."""

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any:
        found = super().nvmlDeviceGetFieldValues(handle, fieldIds)
        for value in found:
            if value.fieldId == pynvml.NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS:
                value.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
        return found

    def nvmlDeviceGetViolationStatus(self, handle: Any, perfPolicyType: int) -> Any:
        if perfPolicyType == pynvml.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return super().nvmlDeviceGetViolationStatus(handle, perfPolicyType)

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        if counter == pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return super().nvmlDeviceGetNvLinkErrorCounter(handle, link, counter)


async def test_counter_ids_newer_than_the_driver_are_left_out() -> None:
    gpu = rich_gpus()[0]
    links = tuple(replace(link, errors={**link.errors, "ecc_data": 0}) for link in gpu.nvlinks)
    counters = {**gpu.clock_event_counters_ns, "total_base_clocks": 5_000_000_000}
    gpu = replace(gpu, nvlinks=links, clock_event_counters_ns=counters)
    clock = ManualClock()
    for nvml, present in (
        (FakeNvml([gpu], clock=clock), True),
        (OlderDriver([gpu], clock=clock), False),
    ):
        source = await started(nvml, clock)
        try:
            readings = await source.read()
        finally:
            await source.close()
        reasons = {
            r.labels["reason"]
            for r in readings
            if r.name == "hyperagent_gpu_throttle_seconds_total"
        }
        types = {
            r.labels["type"] for r in readings if r.name == "hyperagent_gpu_nvlink_errors_total"
        }
        assert ("total_base_clocks" in reasons) is present
        assert ("ecc_data" in types) is present
        assert {"sw_power_cap", "thermal", "gpu_idle"} <= reasons


async def test_start_failure_releases_nvml_and_a_later_start_succeeds() -> None:
    clock = ManualClock()
    nvml = capture("gtx-8card.xml", clock)
    nvml.fail(6, pynvml.NVML_ERROR_GPU_IS_LOST)
    source = NvmlSource(nvml, clock=clock, event_wait_ms=20)
    with pytest.raises(NvmlSourceError, match="enumerating GPUs"):
        await source.start()
    with pytest.raises(pynvml.NVMLError_Uninitialized):  # the failed start shut NVML down
        nvml.nvmlDeviceGetCount()
    nvml.recover(6)
    await source.start()
    watcher = source.telemetry.events_thread
    try:
        assert len(source.gpus) == 8
    finally:
        await source.close()
    assert watcher is not None
    watcher.join(timeout=10)  # the XID watcher holds its reference until its wait ends
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


async def test_without_a_driver_the_real_pynvml_source_is_unavailable() -> None:
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(SourceUnavailable):
        await NvmlSource(pynvml).start()


# -- a recording replays through the same code path ---------------------------------------------


def xid_total_is(source: NvmlSource, total: int) -> bool:
    return sum(source.xid_counts().values()) == total


def xids_are(source: NvmlSource, wanted: dict[tuple[int, int], float]) -> bool:
    return source.xid_counts() == wanted


async def record(
    nvml: FakeNvml, clock: ManualClock, steps: list[Callable[[], int]]
) -> list[list[Reading]]:
    """One read per step; a step changes the fake and says how many XIDs it raised."""
    source = await started(nvml, clock)
    frames: list[list[Reading]] = []
    raised = 0
    try:
        for step in steps:
            raised += step()
            await until(partial(xid_total_is, source, raised))
            frames.append(await source.read())
            clock.now += 10.0
    finally:
        await source.close()
    return frames


async def replay(frames: list[list[Reading]]) -> list[list[Reading]]:
    """The frames read back through FakeNvml.from_readings / update_from_readings."""
    clock = ManualClock()
    nvml = FakeNvml.from_readings(frames[0], clock=clock)
    source = await started(nvml, clock)
    out = []
    try:
        for number, frame in enumerate(frames):
            if number:
                clock.now += 10.0
                nvml.update_from_readings(frame)
            wanted = {
                (int(r.labels["gpu"]), int(r.labels["xid"])): r.value
                for r in frame
                if r.name == "hyperagent_gpu_xid_errors_total"
            }
            await until(partial(xids_are, source, wanted))
            out.append(await source.read())
    finally:
        await source.close()
    return out


@pytest.mark.parametrize("name", [*ALL_CAPTURES, "rich"])
async def test_round_trip_readings_to_fake_to_source(name: str) -> None:
    clock = ManualClock()
    nvml = FakeNvml(rich_gpus(), clock=clock) if name == "rich" else capture(name, clock)
    nvml.nvmlInit()
    last = nvml.nvmlDeviceGetCount() - 1
    nvml.nvmlShutdown()

    def nothing() -> int:
        return 0

    def xid_on_last() -> int:
        nvml.inject_xid(last, 79)
        return 1

    def load() -> int:
        nvml.set_load(0, power_draw_w=55.5, util_gpu_pct=7)
        nvml.set_clock_event_reasons(last, {"hw_slowdown", "gpu_idle"})
        return 0

    def xid_on_first() -> int:
        nvml.inject_xid(0, 13)
        return 1

    frames = await record(nvml, clock, [nothing, xid_on_last, load, xid_on_first])
    replayed = await replay(frames)
    for recorded, again in zip(frames, replayed, strict=True):
        assert rendered(again) == rendered(recorded)
    throttled = values(frames[-1], "hyperagent_gpu_throttle_seconds_total", reason="hw_slowdown")
    assert throttled[str(last)] == 20.0  # the agent's integration replayed, not a constant
    assert values(frames[-1], "hyperagent_gpu_xid_errors_total", xid="79") == {str(last): 1.0}


async def test_promtool_accepts_every_metric() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: apt-get install -y prometheus (bash .ci/run does)")
    clock = ManualClock()
    nvml = FakeNvml(rich_gpus(), clock=clock)
    source = await started(nvml, clock)
    try:
        nvml.inject_xid(1, 94)
        await until(lambda: bool(source.xid_counts()))
        await source.read()
        clock.now = 5.0
        readings = await source.read()
    finally:
        await source.close()
    server = MetricsServer("127.0.0.1:0")
    server.collector.update(readings)
    text = generate_latest(server.registry)
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    assert result.returncode == 0 and not result.stdout and not result.stderr, (
        result.stdout + result.stderr
    ).decode()


async def test_violation_policies_a_gpu_does_not_support_are_asked_again_only_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hyperagent.devices import nvml_telemetry as nvml_module

    clock = ManualClock()
    nvml = capture("tesla-t4.xml", clock)
    asked: list[int] = []
    violation_status = nvml.nvmlDeviceGetViolationStatus

    def counting(handle: Any, policy: int) -> Any:
        asked.append(policy)
        return violation_status(handle, policy)

    monkeypatch.setattr(nvml, "nvmlDeviceGetViolationStatus", counting, raising=False)
    monkeypatch.setattr(nvml_module, "UNSUPPORTED_RETRY_READS", 4)
    source = await started(nvml, clock)
    first = await source.read()
    per_read = len(asked)
    assert per_read > 0
    for _ in range(2):
        clock.now += 1.0
        assert await source.read()
    assert len(asked) == per_read  # nothing the T4's capture lacks was asked again
    clock.now += 1.0
    await source.read()  # the fourth read asks everything again
    assert len(asked) == 2 * per_read
    assert {r.name for r in first} == {r.name for r in await source.read()}


async def test_memory_health_is_read_every_health_interval_and_repeated_between() -> None:
    from dataclasses import replace

    clock = ManualClock()
    nvml = FakeNvml.from_capture(
        FIXTURES / "replay" / "v100s-8gpu-training" / "nvidia-smi.xml", clock=clock
    )
    source = NvmlSource(nvml, clock=clock, event_wait_ms=20, health_interval_s=10.0)
    await source.start()

    def retired(readings: list[Reading]) -> float:
        return next(
            r.value
            for r in readings
            if r.name == "hyperagent_gpu_retired_pages"
            and r.labels["gpu"] == "0"
            and r.labels["cause"] == "single_bit_ecc"
        )

    try:
        before = retired(await source.read())
        device = nvml._devices[0]
        device.record = replace(device.record, retired_pages_single_bit=int(before) + 3)
        clock.now += 5.0
        between = await source.read()
        assert retired(between) == before  # repeated, not asked
        clock.now += 5.0
        assert retired(await source.read()) == before + 3
        assert {key(r) for r in between} == {key(r) for r in await source.read()}
    finally:
        await source.close()


# -- batched reads: one field-values call per GPU and read --------------------------------------


class AskedFields(FakeNvml):
    """Records the (field id, scope) pairs of every nvmlDeviceGetFieldValues call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[set[tuple[int, int]]] = []

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any:
        self.asked.append({f if isinstance(f, tuple) else (f, 0) for f in fieldIds})
        return super().nvmlDeviceGetFieldValues(handle, fieldIds)


def per_gpu_read(before: dict[str, int], after: dict[str, int], reads: int) -> dict[str, float]:
    """NVML calls per GPU and read between two `call_counts()` of the 8-GPU capture."""
    return {
        k: (n - before.get(k, 0)) / (8 * reads) for k, n in after.items() if n > before.get(k, 0)
    }


async def test_a_steady_read_is_one_field_values_call_and_at_most_four_calls_per_gpu() -> None:
    clock = ManualClock()
    nvml = capture("gtx-8card.xml", clock)
    source = await started(nvml, clock)  # health (and slow) interval 10 s, as shipped
    try:
        first = await source.read()
        before = nvml.call_counts()
        for _ in range(20):
            clock.now += 1.0
            last = await source.read()
        calls = per_gpu_read(before, nvml.call_counts(), 20)
    finally:
        await source.close()
    assert {key(r) for r in last} == {key(r) for r in first}
    assert calls["nvmlDeviceGetFieldValues"] == pytest.approx(1.1)  # + health at t=10 and 20
    assert sum(calls.values()) <= 4.0, calls
    per_value_calls = {
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetPcieReplayCounter",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetPowerManagementLimitConstraints",
    }
    assert not per_value_calls & set(calls), calls
    assert values(last, "hyperagent_gpu_power_watts")["0"] == 232.8
    assert values(last, "hyperagent_gpu_power_instant_watts")["0"] == 232.8


class AverageNotSupported(FakeNvml):
    """A GPU without NVML's 1 s average power (before Ampere, and GA100): NOT_SUPPORTED for
    that field, instant power 7 W over the recorded draw."""

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any:
        found = super().nvmlDeviceGetFieldValues(handle, fieldIds)
        for value in found:
            if value.fieldId == pynvml.NVML_FI_DEV_POWER_AVERAGE:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif value.fieldId == pynvml.NVML_FI_DEV_POWER_INSTANT:
                value.value.uiVal += 7000
        return found


async def test_without_the_average_field_board_power_is_the_instant_value() -> None:
    clock = ManualClock()
    nvml = AverageNotSupported(rich_gpus()[:1], clock=clock)
    source = await started(nvml, clock)
    try:
        readings = await source.read()
        clock.now = 1.0
        again = await source.read()
    finally:
        await source.close()
    for found in (readings, again):
        assert values(found, "hyperagent_gpu_power_watts") == {"0": 619.25}
        assert values(found, "hyperagent_gpu_power_instant_watts") == {"0": 619.25}
    assert "nvmlDeviceGetPowerUsage" not in nvml.call_counts()


class OlderPowerFields(AskedFields):
    """A driver from before the power fields (185-192) and the perf-policy fields: their ids
    come back INVALID_ARGUMENT, each in its own nvmlReturn."""

    UNKNOWN = frozenset(
        {
            pynvml.NVML_FI_DEV_POWER_AVERAGE,
            pynvml.NVML_FI_DEV_POWER_INSTANT,
            pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT,
            pynvml.NVML_FI_DEV_POWER_MIN_LIMIT,
            pynvml.NVML_FI_DEV_POWER_MAX_LIMIT,
            pynvml.NVML_FI_DEV_PERF_POLICY_POWER,
            pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL,
        }
    )

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any:
        found = super().nvmlDeviceGetFieldValues(handle, fieldIds)
        for value in found:
            if value.fieldId in self.UNKNOWN:
                value.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
        return found


async def test_fields_the_driver_does_not_know_come_from_the_older_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hyperagent.devices import nvml_telemetry as nvml_module

    monkeypatch.setattr(nvml_module, "UNSUPPORTED_RETRY_READS", 5)
    clock = ManualClock()
    gpus = rich_gpus()[:1]
    reference_nvml = FakeNvml(gpus, clock=clock)
    reference = await started(reference_nvml, clock)
    try:
        wanted = await reference.read()
    finally:
        await reference.close()
    nvml = OlderPowerFields(gpus, clock=clock)
    source = await started(nvml, clock)
    try:
        readings = await source.read()
        counts = nvml.call_counts()
        asked_first = set().union(*nvml.asked)
        nvml.asked.clear()
        clock.now = 3.0
        second = await source.read()
        asked_second = set().union(*nvml.asked)
        for _ in range(2):
            clock.now += 3.0
            await source.read()
        nvml.asked.clear()
        clock.now = 12.0
        await source.read()  # the fifth read asks the unknown ids again (and health is due)
        asked_again = set().union(*nvml.asked)
    finally:
        await source.close()
    unknown = {(f, s) for f, s in asked_first if f in OlderPowerFields.UNKNOWN}
    assert {f for f, _ in unknown} == OlderPowerFields.UNKNOWN
    assert not unknown & asked_second and unknown <= asked_again
    assert rendered(r for r in readings if r.name != "hyperagent_gpu_power_instant_watts") == (
        rendered(r for r in wanted if r.name != "hyperagent_gpu_power_instant_watts")
    )
    assert "hyperagent_gpu_power_instant_watts" not in names(readings)  # no older call for it
    assert {key(r) for r in second} == {key(r) for r in readings}
    for call in (
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetPowerManagementLimitConstraints",
        "nvmlDeviceGetViolationStatus",
    ):
        assert counts.get(call), call


async def test_slow_readings_are_repeated_until_the_slow_interval_passes() -> None:
    clock = ManualClock()
    nvml = FakeNvml(rich_gpus()[:1], clock=clock)
    source = NvmlSource(nvml, clock=clock, event_wait_ms=20, slow_interval_s=5.0)
    every_read = NvmlSource(nvml, clock=clock, event_wait_ms=20, slow_interval_s=0.0)
    await source.start()
    await every_read.start()

    def warmer(gpu: GpuRecord) -> GpuRecord:
        return replace(gpu, temperature_c=75, sm_clock_mhz=1500)

    try:
        await source.read()
        device = nvml._devices[0]
        device.record = warmer(device.record)
        nvml.set_load(0, power_draw_w=300.0)
        clock.now = 4.0
        between = await source.read()
        assert values(between, "hyperagent_gpu_temperature_celsius") == {"0": 61.0}
        assert values(between, "hyperagent_gpu_sm_clock_hertz") == {"0": 1980e6}
        assert values(between, "hyperagent_gpu_power_watts") == {"0": 300.0}  # every read
        assert values(await every_read.read(), "hyperagent_gpu_temperature_celsius") == {"0": 75.0}
        clock.now = 5.0
        assert values(await source.read(), "hyperagent_gpu_temperature_celsius") == {"0": 75.0}
    finally:
        await source.close()
        await every_read.close()


async def test_nvlink_error_counters_a_gpu_lacks_are_not_asked_every_health_read() -> None:
    clock = ManualClock()
    nvml = FakeNvml(rich_gpus()[:1], clock=clock)  # links 0, 1 count replay and crc_flit only
    source = NvmlSource(nvml, clock=clock, event_wait_ms=20, health_interval_s=0.0)
    await source.start()
    try:
        first = await source.read()
        asked_first = nvml.call_counts()["nvmlDeviceGetNvLinkErrorCounter"]
        clock.now = 1.0
        second = await source.read()
        asked_second = nvml.call_counts()["nvmlDeviceGetNvLinkErrorCounter"] - asked_first
    finally:
        await source.close()
    assert (asked_first, asked_second) == (10, 4)  # 5 counters x 2 links, then the 2 x 2 it has
    assert {key(r) for r in second} == {key(r) for r in first}

"""Agent recordings to replayable records: one cycle's `hyperagent_gpu_*` readings decoded into
a `GpuRecord` per GPU, plus what NVML counts rather than reports (energy, XIDs, clock-event
time the agent integrates)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from hyperagent.capture.nvidia_smi import GpuRecord, MigRecord, NvLinkRecord, RemappedRows
from hyperagent.devices import metrics, nvml_api
from hyperagent.readings import Reading

_VIOLATION_REASONS = frozenset(reason for reason, _ in nvml_api.violation_policies(pynvml))


@dataclass
class Frame:
    """One recording cycle, decoded: records plus what NVML counts rather than reports."""

    records: dict[int, GpuRecord]
    energy_j: dict[int, float]
    integrated_s: dict[int, dict[str, float]]
    xids: dict[int, dict[int, int]]
    instant_w: dict[int, float] = field(default_factory=dict)


def _percent_of(ratio: float) -> float:
    """A percentage that NvmlSource's division by 100 turns back into exactly `ratio`."""
    percent = ratio * 100
    for candidate in (percent, math.nextafter(percent, math.inf), math.nextafter(percent, 0.0)):
        if candidate / 100 == ratio:
            return candidate
    return percent


@dataclass
class _GpuReadings:
    """The readings of one GPU in one cycle, gathered for building its record."""

    uuid: str
    values: dict[str, float] = field(default_factory=dict)
    by_label: dict[tuple[str, str], float] = field(default_factory=dict)
    info: dict[str, str] | None = None
    links: dict[int, dict[str, Any]] = field(default_factory=dict)
    migs: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    xids: dict[int, int] = field(default_factory=dict)
    violation_ns: dict[str, int] = field(default_factory=dict)
    integrated_s: dict[str, float] = field(default_factory=dict)

    def get(self, name: str, scale: float = 1.0) -> float | None:
        return self.values[name] * scale if name in self.values else None

    def count(self, name: str, label: str | None = None) -> int | None:
        found = self.values.get(name) if label is None else self.by_label.get((name, label))
        return None if found is None else round(found)

    def flag(self, name: str) -> bool | None:
        return None if name not in self.values else self.values[name] >= 0.5

    def percent(self, name: str) -> float | None:
        return _percent_of(self.values[name]) if name in self.values else None


_PLAIN = frozenset(
    {
        metrics.UTILIZATION,
        metrics.MEMORY_UTILIZATION,
        metrics.MEMORY_USED,
        metrics.MEMORY_TOTAL,
        metrics.POWER,
        metrics.POWER_INSTANT,
        metrics.POWER_LIMIT,
        metrics.POWER_LIMIT_MIN,
        metrics.POWER_LIMIT_MAX,
        metrics.ENERGY,
        metrics.TEMPERATURE,
        metrics.MEMORY_TEMPERATURE,
        metrics.SM_CLOCK,
        metrics.MEMORY_CLOCK,
        metrics.RETIRED_PAGES_PENDING,
        metrics.REMAPPED_ROWS_PENDING,
        metrics.REMAPPED_ROWS_FAILED,
        metrics.PCIE_REPLAYS,
        metrics.SM_ACTIVE,
        metrics.SM_OCCUPANCY,
        metrics.TENSOR_ACTIVE,
        metrics.DRAM_ACTIVE,
    }
)
_BY_LABEL = {
    metrics.ECC_ERRORS: "type",
    metrics.ECC_LIFETIME_ERRORS: "type",
    metrics.RETIRED_PAGES: "cause",
    metrics.REMAPPED_ROWS: "cause",
    metrics.PCIE_THROUGHPUT: "direction",
}


def _label(reading: Reading, key: str) -> str:
    value = reading.labels.get(key)
    if value is None:
        raise ValueError(f"{reading.name}: label {key!r} missing in {dict(reading.labels)}")
    return value


def _int_label(reading: Reading, key: str) -> int:
    text = _label(reading, key)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{reading.name}: label {key}={text!r} is not a number") from None


def decode(readings: Iterable[Reading]) -> Frame:
    """Group one cycle's `hyperagent_gpu_*` readings by GPU and turn them into records."""
    gpus: dict[int, _GpuReadings] = {}
    for reading in readings:
        if not reading.name.startswith("hyperagent_gpu_") or "gpu" not in reading.labels:
            continue
        if reading.name not in metrics.HELP:
            continue
        index = _int_label(reading, "gpu")
        uuid = _label(reading, "uuid")
        gpu = gpus.setdefault(index, _GpuReadings(uuid))
        if gpu.uuid != uuid:
            raise ValueError(f"GPU {index} appears as {gpu.uuid} and as {uuid}")
        _gather(gpu, reading)
    frame = Frame({}, {}, {}, {})
    for index, gpu in gpus.items():
        frame.records[index] = _record(index, gpu)
        if metrics.ENERGY in gpu.values:
            frame.energy_j[index] = gpu.values[metrics.ENERGY]
        if metrics.POWER_INSTANT in gpu.values:
            frame.instant_w[index] = gpu.values[metrics.POWER_INSTANT]
        frame.integrated_s[index] = gpu.integrated_s
        frame.xids[index] = gpu.xids
    return frame


def _gather(gpu: _GpuReadings, reading: Reading) -> None:
    name, value = reading.name, reading.value
    if name == metrics.GPU_INFO:
        gpu.info = dict(reading.labels)
    elif name in _PLAIN:
        gpu.values[name] = value
    elif name in _BY_LABEL:
        gpu.by_label[(name, _label(reading, _BY_LABEL[name]))] = value
    elif name == metrics.THROTTLE:
        reason = _label(reading, "reason")
        if reason in _VIOLATION_REASONS:
            gpu.violation_ns[reason] = round(value * 1e9)
        else:
            gpu.integrated_s[reason] = value
    elif name == metrics.XID_ERRORS:
        gpu.xids[_int_label(reading, "xid")] = round(value)
    elif name in (metrics.NVLINK_UP, metrics.NVLINK_DATA, metrics.NVLINK_ERRORS):
        link = gpu.links.setdefault(_int_label(reading, "link"), {"errors": {}})
        if name == metrics.NVLINK_UP:
            link["active"] = value >= 0.5
        elif name == metrics.NVLINK_DATA:
            link[f"{_label(reading, 'direction')}_bytes"] = round(value)
        else:
            link["errors"][_label(reading, "type")] = round(value)
    elif name in (metrics.MIG_INFO, metrics.MIG_MEMORY_USED, metrics.MIG_MEMORY_TOTAL):
        mig = gpu.migs.setdefault((_int_label(reading, "gi"), _int_label(reading, "ci")), {})
        if name == metrics.MIG_INFO:
            mig["uuid"] = reading.labels.get("mig_uuid") or None
            mig["profile"] = reading.labels.get("profile") or None
        else:
            mig["used" if name == metrics.MIG_MEMORY_USED else "total"] = round(value)


def _ecc(gpu: _GpuReadings) -> dict[tuple[str, str], int]:
    return {
        (error_type, scope): found
        for name, scope in (
            (metrics.ECC_ERRORS, "volatile"),
            (metrics.ECC_LIFETIME_ERRORS, "aggregate"),
        )
        for error_type in ("corrected", "uncorrected")
        if (found := gpu.count(name, error_type)) is not None
    }


def _remapped_rows(gpu: _GpuReadings) -> RemappedRows | None:
    correctable = gpu.count(metrics.REMAPPED_ROWS, "correctable")
    uncorrectable = gpu.count(metrics.REMAPPED_ROWS, "uncorrectable")
    rows_pending = gpu.flag(metrics.REMAPPED_ROWS_PENDING)
    rows_failed = gpu.flag(metrics.REMAPPED_ROWS_FAILED)
    if correctable is None or uncorrectable is None or rows_pending is None or rows_failed is None:
        return None
    return RemappedRows(correctable, uncorrectable, rows_pending, rows_failed)


def _migs(gpu: _GpuReadings) -> tuple[MigRecord, ...]:
    return tuple(
        MigRecord(
            index=slot,
            gpu_instance_id=gi,
            compute_instance_id=ci,
            uuid=mig.get("uuid"),
            profile=mig.get("profile"),
            mem_total_bytes=mig.get("total"),
            mem_used_bytes=mig.get("used"),
        )
        for slot, ((gi, ci), mig) in enumerate(sorted(gpu.migs.items()))
    )


def _nvlinks(gpu: _GpuReadings) -> tuple[NvLinkRecord, ...]:
    return tuple(
        NvLinkRecord(
            link=link,
            active=found.get("active"),
            tx_bytes=found.get("tx_bytes"),
            rx_bytes=found.get("rx_bytes"),
            errors=found["errors"],
        )
        for link, found in sorted(gpu.links.items())
    )


def _record(index: int, gpu: _GpuReadings) -> GpuRecord:
    if gpu.info is None:
        raise ValueError(f"GPU {index} ({gpu.uuid}) has readings but no {metrics.GPU_INFO}")
    migs = _migs(gpu)
    util = gpu.get(metrics.UTILIZATION, 100)
    util_mem = gpu.get(metrics.MEMORY_UTILIZATION, 100)
    mhz = 1e-6
    return GpuRecord(
        index=index,
        name=gpu.info.get("model", ""),
        uuid=gpu.uuid,
        pci_bus_id="",
        driver=gpu.info.get("driver", ""),
        util_gpu_pct=None if util is None else round(util),
        util_mem_pct=None if util_mem is None else round(util_mem),
        mem_total_bytes=gpu.count(metrics.MEMORY_TOTAL),
        mem_used_bytes=gpu.count(metrics.MEMORY_USED),
        power_draw_w=gpu.get(metrics.POWER),
        power_limit_w=gpu.get(metrics.POWER_LIMIT),
        min_power_limit_w=gpu.get(metrics.POWER_LIMIT_MIN),
        max_power_limit_w=gpu.get(metrics.POWER_LIMIT_MAX),
        temperature_c=gpu.get(metrics.TEMPERATURE),
        sm_clock_mhz=gpu.get(metrics.SM_CLOCK, mhz),
        mem_clock_mhz=gpu.get(metrics.MEMORY_CLOCK, mhz),
        pcie_replay_count=gpu.count(metrics.PCIE_REPLAYS),
        memory_temperature_c=gpu.get(metrics.MEMORY_TEMPERATURE),
        pcie_tx_bytes_per_s=gpu.count(metrics.PCIE_THROUGHPUT, "tx"),
        pcie_rx_bytes_per_s=gpu.count(metrics.PCIE_THROUGHPUT, "rx"),
        clock_event_reasons=frozenset() if gpu.integrated_s else None,
        clock_event_counters_ns=gpu.violation_ns,
        ecc_errors=_ecc(gpu),
        retired_pages_single_bit=gpu.count(metrics.RETIRED_PAGES, "single_bit_ecc"),
        retired_pages_double_bit=gpu.count(metrics.RETIRED_PAGES, "double_bit_ecc"),
        retired_pages_pending=gpu.flag(metrics.RETIRED_PAGES_PENDING),
        remapped_rows=_remapped_rows(gpu),
        mig_enabled=True if migs else None,
        mig_devices=migs,
        nvlinks=_nvlinks(gpu),
        sm_active_pct=gpu.percent(metrics.SM_ACTIVE),
        sm_occupancy_pct=gpu.percent(metrics.SM_OCCUPANCY),
        tensor_active_pct=gpu.percent(metrics.TENSOR_ACTIVE),
        dram_active_pct=gpu.percent(metrics.DRAM_ACTIVE),
    )

"""A fake ``amdsmi`` (AMD SMI's Python package) replaying amd-smi / rocm-smi captures.

`FakeAmdsmi` stands in for the ``amdsmi`` module: the functions the device layer calls, with
amdsmi's names, argument order, return shapes (dicts with amdsmi's keys, "N/A" where the device
does not say) and units: power in W, power cap in microwatts, energy as an accumulator with
its resolution in microjoules, memory in bytes, clocks in MHz, temperatures in degrees C.
Errors are `AmdSmiLibraryException` with amdsmi's status codes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path
from typing import Any

from hyperagent.capture import amd_smi
from hyperagent.capture.accelerators import AcceleratorRecord, SimulatedDevice, SimulatedLibrary

AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_NOT_INIT = 32
ENERGY_RESOLUTION_UJ = 15.259
"""The energy counter's resolution amdsmi reports on MI200/MI300 (15.259 uJ per count)."""


class AmdSmiException(Exception):
    """amdsmi's base exception."""


class AmdSmiLibraryException(AmdSmiException):
    """A failed amdsmi call, with its status code (``get_error_code()``), as amdsmi raises it."""

    def __init__(self, err_code: int) -> None:
        super().__init__(err_code)
        self.err_code = abs(err_code)

    def get_error_code(self) -> int:
        return self.err_code

    def __str__(self) -> str:
        return f"amdsmi error code {self.err_code}"


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    MEM = 4


class FakeAmdsmiHandle:
    """An opaque processor handle of one `FakeAmdsmi`."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"FakeAmdsmiHandle({self.index})"


def _na(value: float | None) -> Any:
    return "N/A" if value is None else value


class FakeAmdsmi(SimulatedLibrary):
    """The ``amdsmi`` functions a monitoring agent and a power-cap actuator use, over records.

    Power: ``current_socket_power`` and ``average_socket_power`` are min(recorded or `set_load`
    draw, power cap); ``amdsmi_set_power_cap`` checks support (a recorded cap range, else
    NOT_SUPPORTED), permission (``writable=False``: NO_PERM) and range (INVAL) in that order;
    a capture without a minimum cap (rocm-smi gives only the cap) has 0 W, the minimum amdsmi
    reports on the Instinct captures here.
    Energy: the accumulator starts at the recorded total energy (0 where none) and integrates
    the capped draw over ``clock``; ``energy_ratio`` scales what it counts (a firmware whose
    counter disagrees with its power, to test the agent's check). Devices with a compute
    partition (``partitions``, e.g. ``{"compute": "CPX", "memory": "NPS4", "count": 8}``) are
    enumerated once per partition, as amdsmi does, each with an equal share of the recorded
    device's power, memory and energy.
    ``call_counts()`` tells how many times each function was called.
    """

    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiException = AmdSmiException
    AmdSmiMemoryType = AmdSmiMemoryType
    AmdSmiTemperatureType = AmdSmiTemperatureType
    AmdSmiTemperatureMetric = AmdSmiTemperatureMetric
    AmdSmiClkType = AmdSmiClkType

    def __init__(
        self,
        records: list[AcceleratorRecord],
        clock: Callable[[], float] = time.monotonic,
        writable: bool = True,
        energy_ratio: float = 1.0,
        partitions: dict[str, Any] | None = None,
    ) -> None:
        self._clock = clock
        self._writable = writable
        self._energy_ratio = energy_ratio
        super().__init__()
        self._initialised = False
        self.devices = [SimulatedDevice(r, clock) for r in _partitioned(records, partitions)]
        self._handles = [FakeAmdsmiHandle(i) for i in range(len(self.devices))]

    @classmethod
    def from_capture(cls, directory: Path, **kwargs: Any) -> FakeAmdsmi:
        """A fake replaying the AMD capture in ``directory`` (see `amd_smi.load_capture`)."""
        records = amd_smi.load_capture(directory)
        if not records:
            raise ValueError(f"{directory}: no {' or '.join(amd_smi.CAPTURE_FILES)}")
        return cls(records, **kwargs)

    # -- amdsmi ---------------------------------------------------------------------------------

    def _device(self, name: str, handle: object) -> SimulatedDevice:
        self._calls[name] += 1
        if not self._initialised:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        if not isinstance(handle, FakeAmdsmiHandle) or handle not in self._handles:
            raise AmdSmiLibraryException(AMDSMI_STATUS_INVAL)
        return self.devices[handle.index]

    def amdsmi_init(self, flag: int = 0) -> None:
        with self._lock:
            self._calls["amdsmi_init"] += 1
            self._initialised = True

    def amdsmi_shut_down(self) -> None:
        with self._lock:
            self._calls["amdsmi_shut_down"] += 1
            self._initialised = False

    def amdsmi_get_processor_handles(self) -> list[FakeAmdsmiHandle]:
        with self._lock:
            self._calls["amdsmi_get_processor_handles"] += 1
            if not self._initialised:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
            return list(self._handles)

    def amdsmi_get_gpu_asic_info(self, handle: object) -> dict[str, Any]:
        with self._lock:
            record = self._device("amdsmi_get_gpu_asic_info", handle).record
            return {
                "market_name": record.model or "N/A",
                "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
                "vendor_id": record.vendor_id or "N/A",
                "device_id": record.device_id or "N/A",
            }

    def amdsmi_get_gpu_device_uuid(self, handle: object) -> str:
        """The recorded UUID; amd-smi metric output holds none, so there the PCI address
        (and partition) stands for it."""
        with self._lock:
            record = self._device("amdsmi_get_gpu_device_uuid", handle).record
            return record.uuid or record.bus_id or f"amd-{record.index}"

    def amdsmi_get_gpu_device_bdf(self, handle: object) -> str:
        with self._lock:
            return self._device("amdsmi_get_gpu_device_bdf", handle).record.bus_id

    def amdsmi_get_gpu_driver_info(self, handle: object) -> dict[str, Any]:
        with self._lock:
            record = self._device("amdsmi_get_gpu_driver_info", handle).record
            return {"driver_name": "amdgpu", "driver_version": record.driver or "N/A"}

    def amdsmi_get_gpu_activity(self, handle: object) -> dict[str, Any]:
        with self._lock:
            record = self._device("amdsmi_get_gpu_activity", handle).record
            return {
                "gfx_activity": _na(record.util_pct),
                "umc_activity": _na(record.mem_util_pct),
                "mm_activity": "N/A",
            }

    def amdsmi_get_power_info(self, handle: object) -> dict[str, Any]:
        with self._lock:
            device = self._device("amdsmi_get_power_info", handle)
            draw = device.draw_w()
            watts = None if draw is None else round(draw)
            cap = device.record.power_cap_w
            return {
                "socket_power": _na(watts),
                "current_socket_power": _na(watts),
                "average_socket_power": _na(watts),
                "gfx_voltage": "N/A",
                "soc_voltage": "N/A",
                "mem_voltage": "N/A",
                "power_limit": _na(None if cap is None else round(cap)),
            }

    def amdsmi_get_energy_count(self, handle: object) -> dict[str, Any]:
        with self._lock:
            device = self._device("amdsmi_get_energy_count", handle)
            if device.record.power_w is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            joules = device.integrate() * self._energy_ratio
            return {
                "energy_accumulator": int(joules * 1e6 / ENERGY_RESOLUTION_UJ),
                "counter_resolution": ENERGY_RESOLUTION_UJ,
                "timestamp": int(self._clock() * 1e9),
            }

    def amdsmi_get_power_cap_info(self, handle: object) -> dict[str, Any]:
        with self._lock:
            record = self._device("amdsmi_get_power_cap_info", handle).record
            if record.power_cap_w is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)

            def micro(watts: float | None) -> int:
                return 0 if watts is None else round(watts * 1e6)

            return {
                "power_cap": micro(record.power_cap_w),
                "default_power_cap": micro(record.default_power_cap_w or record.power_cap_w),
                "dpm_cap": 0,
                "min_power_cap": micro(record.min_power_cap_w),
                "max_power_cap": micro(record.max_power_cap_w),
            }

    def amdsmi_set_power_cap(self, handle: object, sensor_ind: int, cap: int) -> None:
        if not isinstance(cap, int):
            raise TypeError(f"cap must be an int of microwatts, got {type(cap).__name__}")
        with self._lock:
            device = self._device("amdsmi_set_power_cap", handle)
            high = device.record.max_power_cap_w
            if high is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            low = device.record.min_power_cap_w or 0.0
            if not self._writable:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NO_PERM)
            if not round(low * 1e6) <= cap <= round(high * 1e6):
                raise AmdSmiLibraryException(AMDSMI_STATUS_INVAL)
            device.set_cap(cap / 1e6)

    def amdsmi_get_gpu_memory_total(self, handle: object, mem_type: int) -> int:
        with self._lock:
            record = self._device("amdsmi_get_gpu_memory_total", handle).record
            if record.mem_total_bytes is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            return int(record.mem_total_bytes)

    def amdsmi_get_gpu_memory_usage(self, handle: object, mem_type: int) -> int:
        with self._lock:
            record = self._device("amdsmi_get_gpu_memory_usage", handle).record
            if record.mem_used_bytes is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            return int(record.mem_used_bytes)

    def amdsmi_get_temp_metric(self, handle: object, sensor_type: int, metric: int) -> int:
        with self._lock:
            record = self._device("amdsmi_get_temp_metric", handle).record
            value = (
                record.mem_temp_c if sensor_type == AmdSmiTemperatureType.VRAM else record.temp_c
            )
            if value is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            return int(value)

    def amdsmi_get_clock_info(self, handle: object, clock_type: int) -> dict[str, Any]:
        with self._lock:
            record = self._device("amdsmi_get_clock_info", handle).record
            mhz = record.mem_clock_mhz if clock_type == AmdSmiClkType.MEM else record.clock_mhz
            if mhz is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            return {
                "clk": int(mhz),
                "min_clk": "N/A",
                "max_clk": "N/A",
                "clk_locked": "N/A",
                "clk_deep_sleep": "N/A",
            }

    def amdsmi_get_gpu_total_ecc_count(self, handle: object) -> dict[str, Any]:
        with self._lock:
            record = self._device("amdsmi_get_gpu_total_ecc_count", handle).record
            if record.ecc_corrected is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            return {
                "correctable_count": record.ecc_corrected,
                "uncorrectable_count": record.ecc_uncorrected or 0,
                "deferred_count": 0,
            }

    def amdsmi_get_gpu_compute_partition(self, handle: object) -> str:
        with self._lock:
            record = self._device("amdsmi_get_gpu_compute_partition", handle).record
            if not record.compute_partition:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            return record.compute_partition

    def amdsmi_get_gpu_memory_partition(self, handle: object) -> str:
        with self._lock:
            record = self._device("amdsmi_get_gpu_memory_partition", handle).record
            if not record.memory_partition:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            return record.memory_partition


def _partitioned(
    records: list[AcceleratorRecord], partitions: dict[str, Any] | None
) -> list[AcceleratorRecord]:
    """Each record split into ``partitions["count"]`` partitions (none: as recorded)."""
    if not partitions:
        return records
    from dataclasses import replace

    count = int(partitions.get("count", 1))
    out: list[AcceleratorRecord] = []
    for record in records:

        def share(value: float | None) -> float | None:
            return None if value is None else value / count

        for part in range(count):
            out.append(
                replace(
                    record,
                    index=len(out),
                    uuid=f"{record.uuid or record.bus_id}/{part}",
                    bus_id=record.bus_id if part == 0 else f"{record.bus_id}/{part}",
                    power_w=share(record.power_w),
                    energy_j=share(record.energy_j),
                    mem_used_bytes=share(record.mem_used_bytes),
                    mem_total_bytes=share(record.mem_total_bytes),
                    compute_partition=str(partitions.get("compute", "")),
                    memory_partition=str(partitions.get("memory", "")),
                    # amdsmi takes a power cap on the first partition of a GPU only
                    min_power_cap_w=record.min_power_cap_w if part == 0 else None,
                    max_power_cap_w=record.max_power_cap_w if part == 0 else None,
                    power_cap_w=record.power_cap_w if part == 0 else None,
                )
            )
    return out

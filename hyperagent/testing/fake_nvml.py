"""A fake NVML that replays `nvidia-smi` captures behind the `pynvml` function names.

`FakeNvml` stands in for the `pynvml` module: code written against `pynvml` (the nvidia-ml-py
package) runs unchanged when handed an instance, with the same function names, return types,
units (mW, mJ, bytes, MHz, percent) and the real `pynvml.NVMLError` subclasses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from hyperagent.testing.nvidia_smi import GpuRecord, parse_capture


class FakeNvmlHandle:
    """An opaque device handle, valid only with the `FakeNvml` instance that made it."""

    __slots__ = ("_owner", "index")

    def __init__(self, owner: FakeNvml, index: int) -> None:
        self._owner = owner
        self.index = index

    def __repr__(self) -> str:
        return f"FakeNvmlHandle(index={self.index})"


@dataclass
class _Device:
    record: GpuRecord
    handle: FakeNvmlHandle
    energy_mj: float
    integrated_to: float
    failure: int | None = None

    def draw_w(self) -> float | None:
        draw, limit = self.record.power_draw_w, self.record.power_limit_w
        if draw is None or limit is None:
            return draw
        return min(draw, limit)

    def integrate(self, now: float) -> None:
        draw = self.draw_w()
        if draw is not None:
            self.energy_mj += draw * max(0.0, now - self.integrated_to) * 1000.0
        self.integrated_to = max(now, self.integrated_to)


_T = TypeVar("_T")


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _supported(value: _T | None) -> _T:
    if value is None:
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return value


def _milli(value: float | None) -> int:
    return round(_supported(value) * 1000)


class FakeNvml:
    """The subset of `pynvml` a monitoring agent and a power-cap actuator use, over recorded GPUs.

    Device `i` is `gpus[i]` (`GpuRecord.index` must equal its position). A field the capture lacks
    (None) raises `NVMLError_NotSupported`; every call before `nvmlInit()` raises
    `NVMLError_Uninitialized`; init and shutdown are refcounted as in NVML.

    Power: `nvmlDeviceGetPowerUsage` reads min(recorded or `set_load` draw, enforced limit), so a
    cap set through `nvmlDeviceSetPowerManagementLimit` limits the draw. The set call checks, in
    this order, support (min/max limits known, else NOT_SUPPORTED), permission (`writable=False`
    acts as a non-root process: NO_PERMISSION) and range (outside [min, max]: INVALID_ARGUMENT).

    Energy: captures hold no energy counter, so `nvmlDeviceGetTotalEnergyConsumption` is a
    synthesised counter consistent with the recorded power, not a recording: it starts at 0 mJ at
    construction and integrates the capped draw over time read from `clock` (seconds), piecewise
    at every read and before every change of draw or limit. A device without a recorded draw has
    no energy counter (NOT_SUPPORTED).

    Simulation controls (not NVML): `set_load`, `fail` and `recover`. All state is guarded by a
    lock, so a worker thread may read while a simulator changes the load.

    Attributes named like pynvml's constants and exception classes (`NVML_*`, `NVMLError*`,
    `nvmlMemory_v2`) are pynvml's own, so `nvml.NVML_TEMPERATURE_GPU` works on an instance too.
    """

    def __init__(
        self,
        gpus: list[GpuRecord],
        driver: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        writable: bool = True,
    ) -> None:
        for position, gpu in enumerate(gpus):
            if gpu.index != position:
                raise ValueError(f"GPU at position {position} has index {gpu.index}; renumber it")
        if driver is None:
            if not gpus:
                raise ValueError("driver is required when there are no GPUs")
            driver = gpus[0].driver
        self._driver = driver
        self._clock = clock
        self._writable = writable
        self._lock = threading.Lock()
        self._refcount = 0
        now = clock()
        self._devices = [
            _Device(
                record=gpu, handle=FakeNvmlHandle(self, gpu.index), energy_mj=0.0, integrated_to=now
            )
            for gpu in gpus
        ]

    @classmethod
    def from_capture(cls, path: Path, **kwargs: Any) -> FakeNvml:
        """A fake replaying the capture at `path` (any format `parse_capture` reads)."""
        return cls(parse_capture(path.read_text(encoding="utf-8")), **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "NVMLError", "nvmlMemory_v")):
            return getattr(pynvml, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # -- simulation controls -------------------------------------------------------------------

    def set_load(
        self,
        index: int,
        util_gpu_pct: float | None = None,
        power_draw_w: float | None = None,
        util_mem_pct: float | None = None,
        mem_used_bytes: int | None = None,
    ) -> None:
        """Change what device `index` reports from now on; None leaves a value as it is.

        Energy is integrated up to now at the old draw before the new one applies.
        """
        for name, pct in (("util_gpu_pct", util_gpu_pct), ("util_mem_pct", util_mem_pct)):
            if pct is not None and not 0.0 <= pct <= 100.0:
                raise ValueError(f"{name} must be within [0, 100], got {pct}")
        if power_draw_w is not None and power_draw_w < 0:
            raise ValueError(f"power_draw_w must be >= 0, got {power_draw_w}")
        with self._lock:
            device = self._control(index)
            total = device.record.mem_total_bytes
            if mem_used_bytes is not None and (
                mem_used_bytes < 0 or (total is not None and mem_used_bytes > total)
            ):
                raise ValueError(
                    f"mem_used_bytes must be within [0, {total}], got {mem_used_bytes}"
                )
            device.integrate(self._clock())
            changes: dict[str, Any] = {
                "util_gpu_pct": util_gpu_pct,
                "power_draw_w": power_draw_w,
                "util_mem_pct": util_mem_pct,
                "mem_used_bytes": mem_used_bytes,
            }
            device.record = replace(
                device.record, **{k: v for k, v in changes.items() if v is not None}
            )

    def fail(self, index: int, code: int) -> None:
        """Make every call on device `index` raise `pynvml.NVMLError(code)` until `recover`."""
        with self._lock:
            self._control(index).failure = code

    def recover(self, index: int) -> None:
        """Undo `fail` for device `index`."""
        with self._lock:
            self._control(index).failure = None

    def _control(self, index: int) -> _Device:
        if not 0 <= index < len(self._devices):
            raise IndexError(f"no GPU {index}; this fake has {len(self._devices)}")
        return self._devices[index]

    # -- NVML ----------------------------------------------------------------------------------

    def _check_init(self) -> None:
        if self._refcount == 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: object) -> _Device:
        self._check_init()
        if not isinstance(handle, FakeNvmlHandle) or handle._owner is not self:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        device = self._devices[handle.index]
        if device.failure is not None:
            raise _error(device.failure)
        return device

    def _record(self, handle: object) -> GpuRecord:
        with self._lock:
            return self._device(handle).record

    def nvmlInit(self) -> None:
        """Initialise (refcounted: each call needs a matching `nvmlShutdown`)."""
        with self._lock:
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        """Drop one reference; at zero every call raises NVMLError_Uninitialized."""
        with self._lock:
            self._check_init()
            self._refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        """The driver version string of the capture."""
        with self._lock:
            self._check_init()
            return self._driver

    def nvmlDeviceGetCount(self) -> int:
        """Number of GPUs, failed ones included."""
        with self._lock:
            self._check_init()
            return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeNvmlHandle:
        """Handle of GPU `index`; NVMLError_InvalidArgument when there is no such GPU."""
        with self._lock:
            self._check_init()
            if not isinstance(index, int) or not 0 <= index < len(self._devices):
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            device = self._devices[index]
            if device.failure is not None:
                raise _error(device.failure)
            return device.handle

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeNvmlHandle:
        """Handle of the GPU with `uuid`; NVMLError_NotFound when there is none."""
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        with self._lock:
            self._check_init()
            for device in self._devices:
                if device.record.uuid == wanted:
                    if device.failure is not None:
                        raise _error(device.failure)
                    return device.handle
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: FakeNvmlHandle) -> str:
        """Product name, e.g. "NVIDIA A100-SXM4-80GB"."""
        return self._record(handle).name

    def nvmlDeviceGetUUID(self, handle: FakeNvmlHandle) -> str:
        """GPU UUID string, "GPU-..."."""
        return self._record(handle).uuid

    def nvmlDeviceGetIndex(self, handle: FakeNvmlHandle) -> int:
        """NVML index of the device."""
        return self._record(handle).index

    def nvmlDeviceGetUtilizationRates(self, handle: FakeNvmlHandle) -> pynvml.c_nvmlUtilization_t:
        """`.gpu` and `.memory` utilisation, integer percent (NOT_SUPPORTED e.g. under MIG)."""
        record = self._record(handle)
        return pynvml.c_nvmlUtilization_t(
            gpu=round(_supported(record.util_gpu_pct)),
            memory=round(_supported(record.util_mem_pct)),
        )

    def nvmlDeviceGetMemoryInfo(
        self, handle: FakeNvmlHandle, version: int | None = None
    ) -> pynvml.c_nvmlMemory_t | pynvml.c_nvmlMemory_v2_t:
        """Frame-buffer memory in bytes, as NVML's v1 or (with `version=nvmlMemory_v2`) v2 struct.

        v1 `used` is reserved plus allocated memory, as NVML v1 reports it; v2 separates
        `reserved`. `free` is total - used - reserved in both.
        """
        record = self._record(handle)
        total = _supported(record.mem_total_bytes)
        used = _supported(record.mem_used_bytes)
        reserved = record.mem_reserved_bytes or 0
        free = max(0, total - used - reserved)
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=free, used=used + reserved)
        if version != pynvml.nvmlMemory_v2:
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return pynvml.c_nvmlMemory_v2_t(
            version=version, total=total, reserved=reserved, free=free, used=used
        )

    def nvmlDeviceGetPowerUsage(self, handle: FakeNvmlHandle) -> int:
        """Current draw in milliwatts, capped by the enforced limit."""
        with self._lock:
            return _milli(self._device(handle).draw_w())

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeNvmlHandle) -> int:
        """Enforced power limit in milliwatts."""
        return _milli(self._record(handle).power_limit_w)

    def nvmlDeviceGetPowerManagementLimit(self, handle: FakeNvmlHandle) -> int:
        """Power management limit in milliwatts (the enforced one; the fake has no other cap)."""
        return _milli(self._record(handle).power_limit_w)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: FakeNvmlHandle) -> int:
        """Default power limit in milliwatts."""
        return _milli(self._record(handle).default_power_limit_w)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: FakeNvmlHandle) -> list[int]:
        """`[min_mW, max_mW]`, a list as pynvml returns it."""
        record = self._record(handle)
        return [_milli(record.min_power_limit_w), _milli(record.max_power_limit_w)]

    def nvmlDeviceSetPowerManagementLimit(self, handle: FakeNvmlHandle, limit: int) -> None:
        """Set the power limit to `limit` milliwatts, checked as NVML does (see the class doc)."""
        if not isinstance(limit, int):
            raise TypeError(f"int expected instead of {type(limit).__name__}")
        with self._lock:
            device = self._device(handle)
            low = device.record.min_power_limit_w
            high = device.record.max_power_limit_w
            if low is None or high is None:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if not self._writable:
                raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
            if not round(low * 1000) <= limit <= round(high * 1000):
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            device.integrate(self._clock())
            device.record = replace(device.record, power_limit_w=limit / 1000)

    def nvmlDeviceGetTemperature(self, handle: FakeNvmlHandle, sensor: int) -> int:
        """GPU temperature in degrees C; `sensor` must be NVML_TEMPERATURE_GPU."""
        record = self._record(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(_supported(record.temperature_c))

    def nvmlDeviceGetClockInfo(self, handle: FakeNvmlHandle, type: int) -> int:
        """Current clock in MHz for NVML_CLOCK_GRAPHICS, _SM or _MEM (_VIDEO: NOT_SUPPORTED)."""
        record = self._record(handle)
        clocks = {
            pynvml.NVML_CLOCK_GRAPHICS: record.graphics_clock_mhz,
            pynvml.NVML_CLOCK_SM: record.sm_clock_mhz,
            pynvml.NVML_CLOCK_MEM: record.mem_clock_mhz,
            pynvml.NVML_CLOCK_VIDEO: None,
        }
        if type not in clocks:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(_supported(clocks[type]))

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeNvmlHandle) -> int:
        """PCIe replay count from the capture."""
        return _supported(self._record(handle).pcie_replay_count)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeNvmlHandle) -> int:
        """Millijoules since construction: the synthesised counter described on the class."""
        with self._lock:
            device = self._device(handle)
            _supported(device.record.power_draw_w)
            device.integrate(self._clock())
            return round(device.energy_mj)

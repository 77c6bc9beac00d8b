"""A fake ``pyhlml`` (habana-pyhlml, Intel Gaudi's HLML binding) replaying hl-smi captures.

`FakeHlml` stands in for the ``pyhlml`` module: the functions the device layer calls, with
pyhlml's names and units (power and limits in mW, energy in mJ, memory in bytes, clocks in
MHz) and its return shapes (``hlmlDeviceGetUtilizationRates`` a struct with ``aip``, memory a
struct with ``total``/``used``/``free``). Errors are `HLMLError` with HLML's return codes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hyperagent.capture import hl_smi
from hyperagent.capture.accelerators import AcceleratorRecord, SimulatedDevice, SimulatedLibrary

HLML_ERROR_UNINITIALIZED = 1
HLML_ERROR_INVALID_ARGUMENT = 2
HLML_ERROR_NOT_SUPPORTED = 3
HLML_ERROR_UNKNOWN = 49
"""hlml.h's return codes (pyhlml's HLML_RETURN); HLML has none for a missing permission."""
HLML_TEMPERATURE_ON_AIP = 0
HLML_CLOCK_SOC = 0


class HLMLError(Exception):
    """A failed HLML call, as pyhlml raises it: ``value`` is the HLML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"HLML Error with code {self.value}"


class FakeHlmlHandle:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class FakeHlml(SimulatedLibrary):
    """The ``pyhlml`` functions a monitoring agent and a power-cap actuator use, over records.

    Power usage is min(recorded or `set_load` draw, the power limit); the set call checks
    support (a limit range, else NOT_SUPPORTED), permission (``writable=False``: UNKNOWN, HLML
    having no code for it) and range (INVALID_ARGUMENT). The energy counter integrates the
    capped draw over ``clock`` from 0 (hl-smi captures hold none).
    """

    HLMLError = HLMLError
    HLML_ERROR_NOT_SUPPORTED = HLML_ERROR_NOT_SUPPORTED
    HLML_TEMPERATURE_ON_AIP = HLML_TEMPERATURE_ON_AIP
    HLML_CLOCK_SOC = HLML_CLOCK_SOC

    def __init__(
        self,
        records: list[AcceleratorRecord],
        clock: Callable[[], float] = time.monotonic,
        writable: bool = True,
    ) -> None:
        super().__init__()
        self._writable = writable
        self._initialised = False
        self.devices = [SimulatedDevice(r, clock) for r in records]
        self._handles = [FakeHlmlHandle(i) for i in range(len(records))]

    @classmethod
    def from_capture(cls, directory: Path, **kwargs: Any) -> FakeHlml:
        records = hl_smi.load_capture(directory)
        if not records:
            raise ValueError(f"{directory}: no {hl_smi.CAPTURE_FILE}")
        return cls(records, **kwargs)

    def _device(self, name: str, handle: object) -> SimulatedDevice:
        self._calls[name] += 1
        if not self._initialised:
            raise HLMLError(HLML_ERROR_UNINITIALIZED)
        if not isinstance(handle, FakeHlmlHandle) or handle not in self._handles:
            raise HLMLError(HLML_ERROR_INVALID_ARGUMENT)
        return self.devices[handle.index]

    @staticmethod
    def _supported(value: float | None) -> float:
        if value is None:
            raise HLMLError(HLML_ERROR_NOT_SUPPORTED)
        return value

    def hlmlInit(self) -> None:
        with self._lock:
            self._calls["hlmlInit"] += 1
            self._initialised = True

    def hlmlShutdown(self) -> None:
        with self._lock:
            self._calls["hlmlShutdown"] += 1
            self._initialised = False

    def hlmlDeviceGetCount(self) -> int:
        with self._lock:
            self._calls["hlmlDeviceGetCount"] += 1
            if not self._initialised:
                raise HLMLError(HLML_ERROR_UNINITIALIZED)
            return len(self._handles)

    def hlmlDeviceGetHandleByIndex(self, index: int) -> FakeHlmlHandle:
        with self._lock:
            self._calls["hlmlDeviceGetHandleByIndex"] += 1
            if not 0 <= index < len(self._handles):
                raise HLMLError(HLML_ERROR_INVALID_ARGUMENT)
            return self._handles[index]

    def hlmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHlmlHandle:
        with self._lock:
            self._calls["hlmlDeviceGetHandleByUUID"] += 1
            for handle, device in zip(self._handles, self.devices, strict=True):
                if device.record.uuid == uuid:
                    return handle
            raise HLMLError(HLML_ERROR_INVALID_ARGUMENT)

    def hlmlDeviceGetName(self, handle: object) -> str:
        with self._lock:
            return self._device("hlmlDeviceGetName", handle).record.model

    def hlmlDeviceGetUUID(self, handle: object) -> str:
        with self._lock:
            return self._device("hlmlDeviceGetUUID", handle).record.uuid

    def hlmlDeviceGetPCIInfo(self, handle: object) -> Any:
        with self._lock:
            bus = self._device("hlmlDeviceGetPCIInfo", handle).record.bus_id
            return SimpleNamespace(bus_id=bus.encode())

    def hlmlDeviceGetUtilizationRates(self, handle: object) -> Any:
        with self._lock:
            util = self._supported(
                self._device("hlmlDeviceGetUtilizationRates", handle).record.util_pct
            )
            return SimpleNamespace(aip=int(util), memory=0)

    def hlmlDeviceGetMemoryInfo(self, handle: object) -> Any:
        with self._lock:
            record = self._device("hlmlDeviceGetMemoryInfo", handle).record
            total = int(self._supported(record.mem_total_bytes))
            used = int(self._supported(record.mem_used_bytes))
            return SimpleNamespace(total=total, used=used, free=total - used)

    def hlmlDeviceGetPowerUsage(self, handle: object) -> int:
        with self._lock:
            return round(
                self._supported(self._device("hlmlDeviceGetPowerUsage", handle).draw_w()) * 1000
            )

    def hlmlDeviceGetTotalEnergyConsumption(self, handle: object) -> int:
        with self._lock:
            device = self._device("hlmlDeviceGetTotalEnergyConsumption", handle)
            self._supported(device.record.power_w)
            return round(device.integrate() * 1000)

    def hlmlDeviceGetTemperature(self, handle: object, sensor_type: int) -> int:
        with self._lock:
            return int(
                self._supported(self._device("hlmlDeviceGetTemperature", handle).record.temp_c)
            )

    def hlmlDeviceGetClockInfo(self, handle: object, clock_type: int = 0) -> int:
        with self._lock:
            return int(
                self._supported(self._device("hlmlDeviceGetClockInfo", handle).record.clock_mhz)
            )

    def hlmlDeviceGetPowerManagementLimit(self, handle: object) -> int:
        with self._lock:
            cap = self._device("hlmlDeviceGetPowerManagementLimit", handle).record.power_cap_w
            return round(self._supported(cap) * 1000)

    def hlmlDeviceGetPowerManagementLimitConstraints(self, handle: object) -> tuple[int, int]:
        with self._lock:
            record = self._device("hlmlDeviceGetPowerManagementLimitConstraints", handle).record
            low = self._supported(record.min_power_cap_w)
            high = self._supported(record.max_power_cap_w)
            return round(low * 1000), round(high * 1000)

    def hlmlDeviceSetPowerManagementLimit(self, handle: object, limit: int) -> None:
        if not isinstance(limit, int):
            raise TypeError(f"limit must be an int of mW, got {type(limit).__name__}")
        with self._lock:
            device = self._device("hlmlDeviceSetPowerManagementLimit", handle)
            low, high = device.record.min_power_cap_w, device.record.max_power_cap_w
            if low is None or high is None:
                raise HLMLError(HLML_ERROR_NOT_SUPPORTED)
            if not self._writable:
                raise HLMLError(HLML_ERROR_UNKNOWN)
            if not round(low * 1000) <= limit <= round(high * 1000):
                raise HLMLError(HLML_ERROR_INVALID_ARGUMENT)
            device.set_cap(limit / 1000)

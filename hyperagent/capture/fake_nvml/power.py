"""The fake's power calls: the draw under the enforced limit, the limits, setting a limit as
NVML checks it, and the energy counter synthesised from the draw."""

from __future__ import annotations

from dataclasses import replace

import pynvml

from hyperagent.capture.fake_nvml.state import FakeNvmlHandle, NvmlState, error, milli, supported


class PowerCalls(NvmlState):
    """Power draw, limits and their control, and energy, over the replayed GPUs."""

    def nvmlDeviceGetPowerUsage(self, handle: FakeNvmlHandle) -> int:
        """Current draw in milliwatts, capped by the enforced limit."""
        with self._lock:
            return milli(self._device(handle).draw_w(self._clock()))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeNvmlHandle) -> int:
        """Enforced power limit in milliwatts."""
        return milli(self._record(handle).power_limit_w)

    def nvmlDeviceGetPowerManagementLimit(self, handle: FakeNvmlHandle) -> int:
        """Power management limit in milliwatts (the enforced one; the fake has no other cap)."""
        return milli(self._record(handle).power_limit_w)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: FakeNvmlHandle) -> int:
        """Default power limit in milliwatts."""
        return milli(self._record(handle).default_power_limit_w)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: FakeNvmlHandle) -> list[int]:
        """`[min_mW, max_mW]`, a list as pynvml returns it."""
        record = self._record(handle)
        return [milli(record.min_power_limit_w), milli(record.max_power_limit_w)]

    def nvmlDeviceSetPowerManagementLimit(self, handle: FakeNvmlHandle, limit: int) -> None:
        """Set the power limit to `limit` milliwatts, checked as NVML does (see the class doc)."""
        if not isinstance(limit, int):
            raise TypeError(f"int expected instead of {type(limit).__name__}")
        with self._lock:
            device = self._device(handle)
            low = device.record.min_power_limit_w
            high = device.record.max_power_limit_w
            if low is None or high is None:
                raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if not self._writable:
                raise error(pynvml.NVML_ERROR_NO_PERMISSION)
            if not round(low * 1000) <= limit <= round(high * 1000):
                raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            now = self._clock()
            device.integrate(now)
            device.limit_before_w = device.record.power_limit_w
            device.limit_from = now + self._cap_response_s
            device.record = replace(device.record, power_limit_w=limit / 1000)
            device.set_limit_w = limit / 1000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeNvmlHandle) -> int:
        """Millijoules since construction: the synthesised counter described on the class."""
        with self._lock:
            device = self._device(handle)
            supported(device.record.power_draw_w)
            device.integrate(self._clock())
            return round(device.energy_mj)

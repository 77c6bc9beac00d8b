"""NVIDIA GPUs behind the device interface, through ``pynvml`` (or FakeNvml).

NVIDIA's telemetry is :class:`hyperagent.devices.nvml_telemetry.NvmlTelemetry` (field-value
batches, GPM, NVLink, MIG, XID events: more than the common interface holds); this adapter is
what the power-cap actuator and vendor-neutral code use, with the same NVML calls the actuator
always made (nvmlDeviceGetPowerManagementLimitConstraints, ...GetPowerManagementLimit,
...SetPowerManagementLimit, NVML_FI_DEV_POWER_INSTANT).
"""

from __future__ import annotations

from typing import Any

from hyperagent.devices.base import (
    MJ_PER_J,
    MW_PER_W,
    Activity,
    DeviceIdentity,
    Memory,
    vendor_call,
)
from hyperagent.devices.nvml_api import instant_power_w, nvml_error_code, nvml_text
from hyperagent.errors import ActuationError, NoPermission, NotSupported


class NvmlDevice:
    """One NVIDIA GPU (a handle of ``nv``)."""

    def __init__(self, nv: Any, identity: DeviceIdentity, handle: Any) -> None:
        self.nv = nv
        self.identity = identity
        self.handle = handle

    def activity(self) -> Activity | None:
        rates = self.nv.nvmlDeviceGetUtilizationRates(self.handle)
        return Activity(rates.gpu / 100, rates.memory / 100)

    def power_w(self) -> float | None:
        return float(self.nv.nvmlDeviceGetPowerUsage(self.handle)) / MW_PER_W

    def instant_power_w(self) -> float | None:
        return instant_power_w(self.nv, self.handle)

    def energy_j(self) -> float | None:
        return float(self.nv.nvmlDeviceGetTotalEnergyConsumption(self.handle)) / MJ_PER_J

    def memory(self) -> Memory | None:
        info = self.nv.nvmlDeviceGetMemoryInfo(self.handle)
        return Memory(float(info.used), float(info.total))

    def temperatures_c(self) -> dict[str, float]:
        nv = self.nv
        return {"gpu": float(nv.nvmlDeviceGetTemperature(self.handle, nv.NVML_TEMPERATURE_GPU))}

    def clocks_hz(self) -> dict[str, float]:
        nv, h = self.nv, self.handle
        return {
            "compute": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) * 1e6,
            "memory": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM) * 1e6,
        }

    def ecc_errors(self) -> dict[str, float]:
        nv, h = self.nv, self.handle
        return {
            kind: float(nv.nvmlDeviceGetTotalEccErrors(h, which, nv.NVML_VOLATILE_ECC))
            for kind, which in (
                ("corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                ("uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            )
        }

    @vendor_call("nvmlDeviceGetPowerManagementLimitConstraints")
    def power_limit_constraints_mw(self) -> tuple[int, int]:
        low, high = self.nv.nvmlDeviceGetPowerManagementLimitConstraints(self.handle)
        return int(low), int(high)

    @vendor_call("nvmlDeviceGetPowerManagementLimit")
    def power_limit_mw(self) -> int:
        return int(self.nv.nvmlDeviceGetPowerManagementLimit(self.handle))

    @vendor_call("nvmlDeviceSetPowerManagementLimit")
    def set_power_limit_mw(self, milliwatts: int) -> None:
        self.nv.nvmlDeviceSetPowerManagementLimit(self.handle, milliwatts)

    @vendor_call("nvmlDeviceGetEnforcedPowerLimit")
    def enforced_power_limit_mw(self) -> int:
        """The limit the GPU enforces (the lowest of every limit set on it)."""
        return int(self.nv.nvmlDeviceGetEnforcedPowerLimit(self.handle))


class NvmlLibrary:
    """``pynvml`` (or a fake with its API) as a :class:`~hyperagent.devices.base.DeviceLibrary`."""

    name = "nvml"
    vendor = "nvidia"

    def __init__(self, nvml: Any) -> None:
        self.module = nvml
        self.errors: tuple[type[BaseException], ...] = (nvml.NVMLError,)

    def devices(self) -> list[NvmlDevice]:
        nv = self.module
        nv.nvmlInit()
        driver = nvml_text(nv.nvmlSystemGetDriverVersion())
        out = []
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml_text(nv.nvmlDeviceGetUUID(handle))
            out.append(NvmlDevice(nv, self._identity(index, uuid, handle, driver), handle))
        return out

    def power_devices(self) -> list[NvmlDevice]:
        """Every GPU, named by index and UUID only, with the calls the actuator always made:
        nvmlInit, nvmlDeviceGetCount, ...GetHandleByIndex, ...GetUUID."""
        nv = self.module
        nv.nvmlInit()
        out = []
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml_text(nv.nvmlDeviceGetUUID(handle))
            out.append(NvmlDevice(nv, DeviceIdentity(index, uuid, self.vendor, ""), handle))
        return out

    def count(self) -> int:
        """How many GPUs NVML enumerates (nvmlInit, nvmlDeviceGetCount: no handle)."""
        self.module.nvmlInit()
        return int(self.module.nvmlDeviceGetCount())

    def by_index(self, index: int) -> NvmlDevice:
        """GPU ``index`` by its handle alone (named by index, no UUID asked)."""
        handle = self.module.nvmlDeviceGetHandleByIndex(index)
        return NvmlDevice(self.module, DeviceIdentity(index, "", self.vendor, ""), handle)

    def _identity(self, index: int, uuid: str, handle: Any, driver: str) -> DeviceIdentity:
        model = nvml_text(self.module.nvmlDeviceGetName(handle))
        return DeviceIdentity(index, uuid, self.vendor, model, driver=driver)

    @vendor_call("nvmlDeviceGetHandleByUUID")
    def by_uuid(self, uuid: str) -> NvmlDevice:
        handle = self.module.nvmlDeviceGetHandleByUUID(uuid)
        return NvmlDevice(self.module, DeviceIdentity(-1, uuid, self.vendor, ""), handle)

    def translate(self, error: BaseException, what: str) -> ActuationError:
        code = nvml_error_code(error)
        nv = self.module
        if code == nv.NVML_ERROR_NO_PERMISSION:
            return NoPermission(f"{what}: no permission (needs root or CAP_SYS_ADMIN)", code)
        if code == nv.NVML_ERROR_NOT_SUPPORTED:
            return NotSupported(f"{what}: not supported by this GPU", code)
        return ActuationError(f"{what}: {error}", code)

    def shutdown(self) -> None:
        self.module.nvmlShutdown()

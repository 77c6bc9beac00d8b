"""Intel Gaudi accelerators behind the device interface, through ``pyhlml`` (habana-pyhlml).

HLML's units: power, power limits in mW, energy in mJ (since the driver loaded), memory in
bytes, clocks in MHz; utilisation is the AIP's busy percentage over the last second. Where
pyhlml or ``libhlml.so`` is missing there are no Gaudi devices (said once, at info level).
"""

from __future__ import annotations

import logging
from typing import Any

from hyperagent.devices.base import (
    MJ_PER_J,
    MW_PER_W,
    Activity,
    DeviceIdentity,
    Memory,
    vendor_call,
)
from hyperagent.errors import ActuationError, NotSupported

log = logging.getLogger(__name__)

HLML_ERROR_NOT_SUPPORTED = 3
HLML_TEMPERATURE_ON_AIP = 0
HLML_CLOCK_SOC = 0
"""hlml.h's values (pyhlml's HLML_RETURN, HLML_TEMP_SENS, HLML_CLOCK_TYPE)."""

_said_unavailable: set[str] = set()


def load_pyhlml() -> Any | None:
    """The ``pyhlml`` module with HLML initialised, or None (said once) when it or
    ``libhlml.so`` is missing: no Gaudi devices."""
    try:
        import pyhlml  # type: ignore[import-not-found]
    except Exception as e:
        if "pyhlml" not in _said_unavailable:
            _said_unavailable.add("pyhlml")
            log.info("no Gaudi devices: the pyhlml library is not available (%s)", e)
        return None
    return pyhlml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GaudiDevice:
    """One Gaudi (a device handle of ``hl``)."""

    def __init__(self, hl: Any, identity: DeviceIdentity, handle: Any) -> None:
        self.hl = hl
        self.identity = identity
        self.handle = handle

    def _optional(self, call: Any, *args: Any) -> Any:
        try:
            return call(self.handle, *args)
        except self.hl.HLMLError as e:
            if getattr(e, "value", None) == HLML_ERROR_NOT_SUPPORTED:
                return None
            raise

    def activity(self) -> Activity | None:
        rates = self._optional(self.hl.hlmlDeviceGetUtilizationRates)
        if rates is None:
            return None
        aip = getattr(rates, "aip", rates)  # pyhlml before 1.16 returned the AIP percentage
        return Activity(float(aip) / 100)

    def power_w(self) -> float | None:
        mw = self._optional(self.hl.hlmlDeviceGetPowerUsage)
        return None if mw is None else float(mw) / MW_PER_W

    @vendor_call("hlmlDeviceGetPowerUsage")
    def instant_power_w(self) -> float | None:
        return self.power_w()

    def energy_j(self) -> float | None:
        mj = self._optional(self.hl.hlmlDeviceGetTotalEnergyConsumption)
        return None if mj is None else float(mj) / MJ_PER_J

    def memory(self) -> Memory | None:
        info = self._optional(self.hl.hlmlDeviceGetMemoryInfo)
        return None if info is None else Memory(float(info.used), float(info.total))

    def temperatures_c(self) -> dict[str, float]:
        celsius = self._optional(self.hl.hlmlDeviceGetTemperature, HLML_TEMPERATURE_ON_AIP)
        return {} if celsius is None else {"gpu": float(celsius)}

    def clocks_hz(self) -> dict[str, float]:
        mhz = self._optional(self.hl.hlmlDeviceGetClockInfo, HLML_CLOCK_SOC)
        return {} if mhz is None else {"compute": float(mhz) * 1e6}

    def ecc_errors(self) -> dict[str, float]:
        return {}

    @vendor_call("hlmlDeviceGetPowerManagementLimitConstraints")
    def power_limit_constraints_mw(self) -> tuple[int, int]:
        low, high = self.hl.hlmlDeviceGetPowerManagementLimitConstraints(self.handle)
        return int(low), int(high)

    @vendor_call("hlmlDeviceGetPowerManagementLimit")
    def power_limit_mw(self) -> int:
        return int(self.hl.hlmlDeviceGetPowerManagementLimit(self.handle))

    @vendor_call("hlmlDeviceSetPowerManagementLimit")
    def set_power_limit_mw(self, milliwatts: int) -> None:
        self.hl.hlmlDeviceSetPowerManagementLimit(self.handle, int(milliwatts))


class HlmlLibrary:
    """``pyhlml`` (or FakeHlml) as a :class:`~hyperagent.devices.base.DeviceLibrary`."""

    name = "hlml"
    vendor = "intel"

    def __init__(self, pyhlml: Any) -> None:
        self.module = pyhlml
        self.errors: tuple[type[BaseException], ...] = (pyhlml.HLMLError,)
        self._devices: list[GaudiDevice] | None = None

    def devices(self) -> list[GaudiDevice]:
        if self._devices is None:
            hl = self.module
            hl.hlmlInit()
            found = []
            for index in range(hl.hlmlDeviceGetCount()):
                handle = hl.hlmlDeviceGetHandleByIndex(index)
                bus = ""
                try:
                    bus = _text(hl.hlmlDeviceGetPCIInfo(handle).bus_id)
                except hl.HLMLError as e:
                    log.debug("Gaudi %d: no PCI address: %s", index, e)
                identity = DeviceIdentity(
                    index,
                    _text(hl.hlmlDeviceGetUUID(handle)),
                    self.vendor,
                    _text(hl.hlmlDeviceGetName(handle)),
                    bus_id=bus,
                )
                found.append(GaudiDevice(hl, identity, handle))
            self._devices = found
        return self._devices

    def power_devices(self) -> list[GaudiDevice]:
        return self.devices()

    @vendor_call("hlmlDeviceGetHandleByUUID")
    def by_uuid(self, uuid: str) -> GaudiDevice:
        for device in self.devices():
            if device.identity.uuid == uuid:
                return device
        handle = self.module.hlmlDeviceGetHandleByUUID(uuid)
        return GaudiDevice(self.module, DeviceIdentity(-1, uuid, self.vendor, ""), handle)

    def translate(self, error: BaseException, what: str) -> ActuationError:
        code = getattr(error, "value", None)
        code = code if isinstance(code, int) else None
        if code == HLML_ERROR_NOT_SUPPORTED:
            return NotSupported(f"{what}: not supported by this device", code)
        return ActuationError(f"{what}: {error}", code)

    def shutdown(self) -> None:
        self.module.hlmlShutdown()
        self._devices = None

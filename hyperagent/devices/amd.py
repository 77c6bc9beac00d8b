"""AMD Instinct GPUs behind the device interface, through ``amdsmi`` (or FakeAmdsmi).

PyPI's ``amdsmi`` is pure Python over ROCm's ``libamd_smi.so``: where the library is missing,
importing it fails, and that means "no AMD devices" (`load_amdsmi` says so once, at info
level). Units as amdsmi gives them: socket power in W, power cap in microwatts, energy as an
accumulator times its resolution in microjoules, memory in bytes, clocks in MHz.

Energy: some firmware counts energy at a resolution amdsmi misreports (Zeus found counters off
by orders of magnitude), so the counter is checked once per device when the library starts,
as Zeus does: energy counted over ``check_s`` against socket power times that time; a counter
that counts under half or over twice that is left out (no ``hyperagent_gpu_energy_joules_total``
for the device), logged once. Compute partitions (CPX) are devices of their own, as amdsmi
enumerates them, labelled with their compute and memory partition mode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hyperagent.devices.base import Activity, DeviceIdentity, Memory, vendor_call
from hyperagent.devices.parts import identified, pci_id
from hyperagent.errors import ActuationError, NoPermission, NotSupported

log = logging.getLogger(__name__)

AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NO_PERM = 10
"""amdsmi_wrapper's status codes (AmdSmiLibraryException.get_error_code())."""
ENERGY_AGREEMENT = (0.5, 2.0)
"""Counted energy over power x time must fall in this range for the counter to be used."""

_said_unavailable: set[str] = set()


def load_amdsmi() -> Any | None:
    """The ``amdsmi`` module, or None (said once per process) when it or libamd_smi.so is
    missing: no AMD devices."""
    try:
        import amdsmi  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, OSError (no libamd_smi.so), KeyError in its loader
        if "amdsmi" not in _said_unavailable:
            _said_unavailable.add("amdsmi")
            log.info("no AMD devices: the amdsmi library is not available (%s)", e)
        return None
    return amdsmi


def _number(value: Any) -> float | None:
    """amdsmi's value, or None for its "N/A" (and for anything not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _error_code(error: BaseException) -> int | None:
    get = getattr(error, "get_error_code", None)
    code = get() if callable(get) else getattr(error, "err_code", None)
    return code if isinstance(code, int) else None


class AmdDevice:
    """One AMD GPU or compute partition (a processor handle of ``amd``)."""

    def __init__(self, amd: Any, identity: DeviceIdentity, handle: Any) -> None:
        self.amd = amd
        self.identity = identity
        self.handle = handle
        self.energy_trusted = True
        """False once the start-up check found the energy counter disagreeing with power."""

    def _optional(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call`` or None when the device does not support it."""
        try:
            return call(self.handle, *args)
        except self.amd.AmdSmiLibraryException as e:
            if _error_code(e) == AMDSMI_STATUS_NOT_SUPPORTED:
                return None
            raise

    def activity(self) -> Activity | None:
        found = self._optional(self.amd.amdsmi_get_gpu_activity)
        if found is None:
            return None
        gfx, umc = _number(found.get("gfx_activity")), _number(found.get("umc_activity"))
        return Activity(None if gfx is None else gfx / 100, None if umc is None else umc / 100)

    def power_w(self) -> float | None:
        found = self._optional(self.amd.amdsmi_get_power_info)
        if found is None:
            return None
        for key in ("average_socket_power", "current_socket_power", "socket_power"):
            value = _number(found.get(key))
            if value is not None:
                return value
        return None

    @vendor_call("amdsmi_get_power_info")
    def instant_power_w(self) -> float | None:
        found = self._optional(self.amd.amdsmi_get_power_info)
        if found is None:
            return None
        value = _number(found.get("current_socket_power"))
        return value if value is not None else _number(found.get("socket_power"))

    def raw_energy_j(self) -> float | None:
        """The energy counter, unchecked: accumulator x resolution (uJ)."""
        found = self._optional(self.amd.amdsmi_get_energy_count)
        if found is None:
            return None
        count = found.get("energy_accumulator", found.get("power"))
        resolution = _number(found.get("counter_resolution"))
        if _number(count) is None or resolution is None:
            return None
        return float(count) * resolution * 1e-6

    def energy_j(self) -> float | None:
        return self.raw_energy_j() if self.energy_trusted else None

    def memory(self) -> Memory | None:
        vram = self.amd.AmdSmiMemoryType.VRAM
        total = self._optional(self.amd.amdsmi_get_gpu_memory_total, vram)
        used = self._optional(self.amd.amdsmi_get_gpu_memory_usage, vram)
        if total is None or used is None:
            return None
        return Memory(float(used), float(total))

    def temperatures_c(self) -> dict[str, float]:
        kinds = self.amd.AmdSmiTemperatureType
        current = self.amd.AmdSmiTemperatureMetric.CURRENT
        out = {}
        for sensor, kind in (("gpu", kinds.HOTSPOT), ("memory", kinds.VRAM)):
            value = self._optional(self.amd.amdsmi_get_temp_metric, kind, current)
            if _number(value) is not None:
                out[sensor] = float(value)
        return out

    def clocks_hz(self) -> dict[str, float]:
        kinds = self.amd.AmdSmiClkType
        out = {}
        for domain, kind in (("compute", kinds.GFX), ("memory", kinds.MEM)):
            found = self._optional(self.amd.amdsmi_get_clock_info, kind)
            mhz = None if found is None else _number(found.get("clk"))
            if mhz is not None:
                out[domain] = mhz * 1e6
        return out

    def ecc_errors(self) -> dict[str, float]:
        found = self._optional(self.amd.amdsmi_get_gpu_total_ecc_count)
        if found is None:
            return {}
        out = {}
        for kind, key in (
            ("corrected", "correctable_count"),
            ("uncorrected", "uncorrectable_count"),
        ):
            value = _number(found.get(key))
            if value is not None:
                out[kind] = value
        return out

    @vendor_call("amdsmi_get_power_cap_info")
    def power_limit_constraints_mw(self) -> tuple[int, int]:
        info = self.amd.amdsmi_get_power_cap_info(self.handle)
        return round(info["min_power_cap"] / 1000), round(info["max_power_cap"] / 1000)

    @vendor_call("amdsmi_get_power_cap_info")
    def power_limit_mw(self) -> int:
        return round(self.amd.amdsmi_get_power_cap_info(self.handle)["power_cap"] / 1000)

    @vendor_call("amdsmi_set_power_cap")
    def set_power_limit_mw(self, milliwatts: int) -> None:
        self.amd.amdsmi_set_power_cap(self.handle, 0, int(milliwatts) * 1000)


class AmdsmiLibrary:
    """``amdsmi`` (or FakeAmdsmi) as a :class:`~hyperagent.devices.base.DeviceLibrary`.

    ``check_s`` is the energy check's window, timed and waited with ``clock`` and ``sleep``
    (0: no check).
    """

    name = "amdsmi"
    vendor = "amd"

    def __init__(
        self,
        amdsmi: Any,
        *,
        check_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        self.module = amdsmi
        self.errors: tuple[type[BaseException], ...] = (amdsmi.AmdSmiException,)
        self.check_s = check_s
        self._clock = clock
        self._sleep = sleep
        self._devices: list[AmdDevice] | None = None

    def devices(self) -> list[AmdDevice]:
        if self._devices is None:
            amd = self.module
            amd.amdsmi_init()
            found = [
                AmdDevice(amd, self._identity(index, handle), handle)
                for index, handle in enumerate(amd.amdsmi_get_processor_handles())
            ]
            if self.check_s > 0:
                self._check_energy(found)
            self._devices = found
        return self._devices

    def power_devices(self) -> list[AmdDevice]:
        """The devices that take a power cap (of a partitioned GPU, the partition amdsmi
        answers the power-cap query for)."""
        out = []
        for device in self.devices():
            try:
                device.power_limit_constraints_mw()
            except self.module.AmdSmiLibraryException as e:
                if _error_code(e) != AMDSMI_STATUS_NOT_SUPPORTED:
                    raise
                continue
            out.append(device)
        return out

    def _identity(self, index: int, handle: Any) -> DeviceIdentity:
        amd = self.module
        asic = amd.amdsmi_get_gpu_asic_info(handle)
        name = str(asic.get("market_name", "")).strip()
        model = identified(
            "" if name == "N/A" else name, pci_id(asic.get("vendor_id"), asic.get("device_id"))
        )
        driver = ""
        try:
            driver = str(amd.amdsmi_get_gpu_driver_info(handle).get("driver_version", ""))
        except amd.AmdSmiException as e:
            log.debug("AMD GPU %d: no driver version: %s", index, e)
        extra = {}
        for label, call in (
            ("compute_partition", amd.amdsmi_get_gpu_compute_partition),
            ("memory_partition", amd.amdsmi_get_gpu_memory_partition),
        ):
            try:
                value = str(call(handle))
            except amd.AmdSmiException:
                continue
            if value and value != "N/A":
                extra[label] = value
        return DeviceIdentity(
            index,
            str(amd.amdsmi_get_gpu_device_uuid(handle)),
            self.vendor,
            model,
            bus_id=str(amd.amdsmi_get_gpu_device_bdf(handle)),
            driver="" if driver == "N/A" else driver,
            extra=extra,
        )

    def _check_energy(self, devices: list[AmdDevice]) -> None:
        """Zeus's check: energy counted over ``check_s`` against power x time."""
        begin = {d.identity.index: (d.raw_energy_j(), d.instant_power_w()) for d in devices}
        started = self._clock()
        self._sleep(self.check_s)
        elapsed = self._clock() - started
        for device in devices:
            before, power = begin[device.identity.index]
            after = device.raw_energy_j()
            if before is None or after is None or power is None or elapsed <= 0 or power <= 0:
                continue
            ratio = (after - before) / (power * elapsed)
            low, high = ENERGY_AGREEMENT
            if not low <= ratio <= high:
                device.energy_trusted = False
                log.warning(
                    "AMD GPU %d (%s): its energy counter counted %.3g x power x time over %.2g s;"
                    " its energy is left out",
                    device.identity.index,
                    device.identity.uuid,
                    ratio,
                    elapsed,
                )

    @vendor_call("amdsmi_get_processor_handles")
    def by_uuid(self, uuid: str) -> AmdDevice:
        for device in self.devices():
            if device.identity.uuid == uuid:
                return device
        raise self.module.AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)

    def translate(self, error: BaseException, what: str) -> ActuationError:
        code = _error_code(error)
        if code == AMDSMI_STATUS_NO_PERM:
            return NoPermission(f"{what}: no permission (needs root)", code)
        if code == AMDSMI_STATUS_NOT_SUPPORTED:
            return NotSupported(f"{what}: not supported by this GPU", code)
        return ActuationError(f"{what}: {error}", code)

    def shutdown(self) -> None:
        self.module.amdsmi_shut_down()
        self._devices = None

"""The telemetry source over any device library: ``hyperagent_gpu_*`` for every vendor.

Per device (labels ``gpu``, ``uuid``): ``hyperagent_gpu_info{model,driver,vendor,bus_id,...}``,
utilisation and memory-controller activity, power and the power limit with its range, the
energy counter, memory used and total, core and memory temperatures, compute and memory
clocks, ECC counts. The same names NVML's source gives, so rules, recording rules and
dashboards hold for every vendor; what a vendor does not report is left out, never 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

from hyperagent.devices.base import MW_PER_W, Accelerator, DeviceLibrary
from hyperagent.devices.metrics import (
    ECC_ERRORS,
    ENERGY,
    GPU_INFO,
    MEMORY_CLOCK,
    MEMORY_TEMPERATURE,
    MEMORY_TOTAL,
    MEMORY_USED,
    MEMORY_UTILIZATION,
    POWER,
    POWER_LIMIT,
    POWER_LIMIT_MAX,
    POWER_LIMIT_MIN,
    SM_CLOCK,
    TEMPERATURE,
    UTILIZATION,
)
from hyperagent.errors import DeviceCallError, SourceError, SourceTimeout, SourceUnavailable
from hyperagent.gate import DeviceGate
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)

_TEMPERATURES = {"gpu": TEMPERATURE, "memory": MEMORY_TEMPERATURE}
_CLOCKS = {"compute": SM_CLOCK, "memory": MEMORY_CLOCK}


class AcceleratorSource:
    """Telemetry of every device of one library (amdsmi, HLML, ...).

    ``library`` is a :class:`~hyperagent.devices.base.DeviceLibrary`, or None where the vendor
    library is not installed: "no such devices", up 0. Start and each read are one call each
    through the library's device gate, bounded by ``timeout_s``. A vendor error fails the
    read (the runner reports the source down); a reading the device does not support is left
    out. The power-limit range is read once at
    start; a device without power limits has none of the limit metrics.
    """

    target = "local"

    def __init__(
        self,
        library: DeviceLibrary | None,
        *,
        name: str,
        timeout_s: float = 2.0,
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.library = library
        self.devices: list[Accelerator] = []
        self._limits: dict[int, tuple[int, int] | None] = {}
        self._no_limit: set[int] = set()

    @property
    def device_module(self) -> Any:
        """The vendor module the source reads (the key of its device gate), None without one."""
        return None if self.library is None else self.library.module

    def _gate(self) -> DeviceGate:
        assert self.library is not None
        return DeviceGate.of(self.library.module, self.library.name)

    async def _gated(self, call: Callable[[], Any], what: str) -> Any:
        try:
            return await self._gate().run(call, timeout_s=self.timeout_s, what=what)
        except DeviceCallError as e:
            raise SourceTimeout(str(e)) from e

    async def start(self) -> None:
        if self.library is None:
            raise SourceUnavailable(f"{self.name}: the vendor library is not installed")
        await self._gated(self._start_sync, "start")

    def _start_sync(self) -> None:
        assert self.library is not None
        try:
            self.devices = list(self.library.devices())
        except self.library.errors as e:
            raise SourceUnavailable(f"{self.name}: no devices ({e})") from e
        if not self.devices:
            raise SourceUnavailable(f"{self.name}: no devices")
        for device in self.devices:
            index = device.identity.index
            try:
                self._limits[index] = device.power_limit_constraints_mw()
            except self.library.errors as e:
                log.debug("%s device %d: no power-limit range: %s", self.name, index, e)
                self._limits[index] = None

    async def read(self) -> list[Reading]:
        if self.library is None or not self.devices:
            await self.start()
        return await self._gated(self._read_sync, "read")  # type: ignore[no-any-return]

    def _read_sync(self) -> list[Reading]:
        assert self.library is not None
        out: list[Reading] = []
        try:
            for device in self.devices:
                self._read_device(device, out)
        except self.library.errors as e:
            raise SourceError(f"{self.name}: {e}") from e
        return out

    def _read_device(self, device: Accelerator, out: list[Reading]) -> None:
        identity = device.identity
        labels = identity.labels

        def gauge(name: str, value: float | None, at: dict[str, str] = labels) -> None:
            if value is not None:
                out.append(Reading(name, float(value), at))

        out.append(Reading(GPU_INFO, 1.0, identity.info, Kind.INFO))
        activity = device.activity()
        if activity is not None:
            gauge(UTILIZATION, activity.compute)
            gauge(MEMORY_UTILIZATION, activity.memory)
        gauge(POWER, device.power_w())
        energy = device.energy_j()
        if energy is not None:
            out.append(Reading(ENERGY, energy, labels, Kind.COUNTER))
        memory = device.memory()
        if memory is not None:
            gauge(MEMORY_USED, memory.used_bytes)
            gauge(MEMORY_TOTAL, memory.total_bytes)
        for sensor, celsius in device.temperatures_c().items():
            gauge(_TEMPERATURES.get(sensor, TEMPERATURE), celsius)
        for domain, hertz in device.clocks_hz().items():
            if domain in _CLOCKS:
                gauge(_CLOCKS[domain], hertz)
        for kind, count in device.ecc_errors().items():
            out.append(Reading(ECC_ERRORS, count, {**labels, "type": kind}, Kind.COUNTER))
        limits = self._limits.get(identity.index)
        if limits is not None:
            gauge(POWER_LIMIT_MIN, limits[0] / MW_PER_W)
            gauge(POWER_LIMIT_MAX, limits[1] / MW_PER_W)
            gauge(POWER_LIMIT, device.power_limit_mw() / MW_PER_W)

    def total_energy_j(self, indices: Collection[int] | None = None) -> float | None:
        """Sum of the energy counters of the devices whose index is in ``indices`` (None:
        every device), None when one has none or none is there (blocking: run it through the
        gate)."""
        devices = [d for d in self.devices if indices is None or d.identity.index in indices]
        if self.library is None or not devices:
            return None
        if indices is not None and len(devices) != len(indices):
            return None
        total = 0.0
        try:
            for device in devices:
                joules = device.energy_j()
                if joules is None:
                    return None
                total += joules
        except self.library.errors:
            return None
        return total

    async def close(self) -> None:
        if self.library is None or not self.devices:
            return
        library = self.library
        errors: tuple[type[BaseException], ...] = (SourceError, *library.errors)
        try:
            await self._gated(library.shutdown, "shutdown")
        except errors as e:
            log.debug("%s shutdown: %s", self.name, e)
        self.devices = []

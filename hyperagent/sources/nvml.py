"""GPU telemetry through NVML (the ``pynvml`` module of nvidia-ml-py, or a fake with its API)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any

from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.readings import Kind, Reading


def nvml_error_code(error: BaseException) -> int | None:
    """The NVML return code carried by a pynvml.NVMLError, else None."""
    value = getattr(error, "value", None)
    return value if isinstance(value, int) else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class GpuIdentity:
    index: int
    uuid: str
    model: str
    handle: Any


class NvmlSource:
    """Per-GPU utilisation, memory, power, limits, energy, temperature and clocks.

    Every NVML call runs in one worker thread; a field the device does not support is left out.
    A read still running when the next one is due makes that next read fail instead of piling up.
    """

    name = "nvml"
    target = "local"

    def __init__(self, nvml: ModuleType | Any) -> None:
        self.nvml = nvml
        self.gpus: list[GpuIdentity] = []
        self.driver = ""
        self._busy = threading.Lock()
        self._initialised = False

    async def start(self) -> None:
        await asyncio.to_thread(self._start_sync)

    def _start_sync(self) -> None:
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            absent = (
                nv.NVML_ERROR_DRIVER_NOT_LOADED,
                nv.NVML_ERROR_LIBRARY_NOT_FOUND,
                nv.NVML_ERROR_FUNCTION_NOT_FOUND,
            )
            if nvml_error_code(e) in absent:
                raise SourceUnavailable(f"NVML not available: {e}") from e
            raise SourceError(f"nvmlInit failed: {e}") from e
        self._initialised = True
        try:
            self.driver = _text(nv.nvmlSystemGetDriverVersion())
            gpus = []
            for index in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                gpus.append(
                    GpuIdentity(
                        index,
                        _text(nv.nvmlDeviceGetUUID(handle)),
                        _text(nv.nvmlDeviceGetName(handle)),
                        handle,
                    )
                )
        except nv.NVMLError as e:
            raise SourceError(f"enumerating GPUs failed: {e}") from e
        self.gpus = gpus

    async def read(self) -> list[Reading]:
        if not self._busy.acquire(blocking=False):
            raise SourceError("previous NVML read still running")
        try:
            return await asyncio.to_thread(self._read_sync)
        finally:
            self._busy.release()

    def _read_sync(self) -> list[Reading]:
        out: list[Reading] = []
        for gpu in self.gpus:
            out.extend(self._read_gpu(gpu))
        return out

    def _call(self, gpu: GpuIdentity, what: str, call: Callable[[], Any]) -> Any:
        """Run one NVML call; None when the device does not support it."""
        nv = self.nvml
        try:
            return call()
        except nv.NVMLError as e:
            if nvml_error_code(e) == nv.NVML_ERROR_NOT_SUPPORTED:
                return None
            raise SourceError(f"GPU {gpu.index} ({gpu.uuid}): {what}: {e}") from e

    def _read_gpu(self, gpu: GpuIdentity) -> list[Reading]:
        nv, h = self.nvml, gpu.handle
        labels = {"gpu": str(gpu.index), "uuid": gpu.uuid}
        info = {**labels, "model": gpu.model, "driver": self.driver}
        out = [Reading("hyperagent_gpu_info", 1.0, info, Kind.INFO)]

        def gauge(name: str, value: float) -> None:
            out.append(Reading(name, float(value), labels))

        util = self._call(gpu, "utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            gauge("hyperagent_gpu_utilization_ratio", util.gpu / 100)
            gauge("hyperagent_gpu_memory_utilization_ratio", util.memory / 100)
        memory = self._call(gpu, "memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        if memory is not None:
            gauge("hyperagent_gpu_memory_used_bytes", memory.used)
            gauge("hyperagent_gpu_memory_total_bytes", memory.total)
        power_mw = self._call(gpu, "power", lambda: nv.nvmlDeviceGetPowerUsage(h))
        if power_mw is not None:
            gauge("hyperagent_gpu_power_watts", power_mw / 1000)
        limit_mw = self._call(gpu, "power limit", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
        if limit_mw is not None:
            gauge("hyperagent_gpu_power_limit_watts", limit_mw / 1000)
        bounds = self._call(
            gpu,
            "power limit constraints",
            lambda: nv.nvmlDeviceGetPowerManagementLimitConstraints(h),
        )
        if bounds is not None:
            gauge("hyperagent_gpu_power_limit_min_watts", bounds[0] / 1000)
            gauge("hyperagent_gpu_power_limit_max_watts", bounds[1] / 1000)
        energy_mj = self._call(gpu, "energy", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h))
        if energy_mj is not None:
            joules = energy_mj / 1000
            out.append(Reading("hyperagent_gpu_energy_joules_total", joules, labels, Kind.COUNTER))
        temp = self._call(
            gpu, "temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
        )
        if temp is not None:
            gauge("hyperagent_gpu_temperature_celsius", temp)
        for name, clock in (
            ("hyperagent_gpu_sm_clock_hertz", nv.NVML_CLOCK_SM),
            ("hyperagent_gpu_memory_clock_hertz", nv.NVML_CLOCK_MEM),
        ):
            mhz = self._call(gpu, "clock", partial(nv.nvmlDeviceGetClockInfo, h, clock))
            if mhz is not None:
                gauge(name, mhz * 1e6)
        return out

    def total_energy_j(self) -> float | None:
        """Sum of the energy counters of every GPU (blocking: call from a worker thread)."""
        nv = self.nvml
        total = 0.0
        try:
            for gpu in self.gpus:
                total += nv.nvmlDeviceGetTotalEnergyConsumption(gpu.handle) * 1e-3
        except nv.NVMLError:
            return None
        return total if self.gpus else None

    async def close(self) -> None:
        if self._initialised:
            self._initialised = False
            await asyncio.to_thread(self.nvml.nvmlShutdown)

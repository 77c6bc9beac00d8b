"""The NVIDIA GPU source: :class:`~hyperagent.devices.nvml_telemetry.NvmlTelemetry` read
through the library's device gate, under the runner's timeout rules.

The device layer makes every NVML call and names every metric
(:mod:`hyperagent.devices.metrics`); this module only decides when and how long they may run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

from hyperagent.devices.nvml_telemetry import GpuIdentity, NvmlSourceError, NvmlTelemetry
from hyperagent.errors import DeviceCallError, SourceError, SourceTimeout
from hyperagent.gate import DeviceGate
from hyperagent.readings import Reading

__all__ = ["NvmlSource", "NvmlSourceError"]


class NvmlSource:
    """Per-GPU telemetry through NVML (:class:`NvmlTelemetry` says what is read and how).

    Every NVML call runs on the worker thread of the library's :class:`DeviceGate` (shared with
    the power-cap actuator and the agent's own NVML calls): start, each read, close and
    ``total_energy_j`` are one gated call each, bounded by ``timeout_s``; a read that times out
    leaves its call running there, and while it has been in flight past its timeout every call
    to the library fails at once as busy. A start whose caller stopped waiting still finishes
    on the gate's thread, and a later start then finds NVML started. A read still running
    when the next is due makes that next read fail instead of piling up; a read over
    ``timeout_s`` fails with SourceTimeout; an NVML error fails it with NvmlSourceError.
    """

    name = "nvml"
    target = "local"

    def __init__(
        self,
        nvml: ModuleType | Any,
        *,
        clock: Callable[[], float] = time.monotonic,
        event_wait_ms: int = 5000,
        health_interval_s: float = 10.0,
        slow_interval_s: float | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        self.nvml = nvml
        self.telemetry = NvmlTelemetry(
            nvml,
            clock=clock,
            event_wait_ms=event_wait_ms,
            health_interval_s=health_interval_s,
            slow_interval_s=slow_interval_s,
        )
        self.gate = DeviceGate.of(nvml)
        self.timeout_s = timeout_s
        self._inflight: asyncio.Task[list[Reading]] | None = None

    @property
    def device_module(self) -> Any:
        """The library the source reads: the key of its device gate."""
        return self.nvml

    @property
    def gpus(self) -> list[GpuIdentity]:
        """The GPUs enumerated at start."""
        return self.telemetry.gpus

    async def _gated(self, call: Callable[[], Any], what: str) -> Any:
        """``call`` through the library's gate; a timeout or a busy library is a SourceTimeout."""
        try:
            return await self.gate.run(call, timeout_s=self.timeout_s, what=what)
        except DeviceCallError as e:
            raise SourceTimeout(str(e)) from e

    async def start(self) -> None:
        """Initialise NVML, enumerate GPUs and their links, prime GPM, start the XID watcher."""
        await self._gated(self.telemetry.start, "start")

    async def read(self) -> list[Reading]:
        """One sample of every GPU; raises NvmlSourceError when NVML fails, SourceTimeout when
        it does not answer within ``timeout_s``."""
        if self._inflight is not None and not self._inflight.done():
            raise SourceError("previous NVML read still running")
        task = asyncio.get_running_loop().create_task(
            self._gated(self.telemetry.read, "read"), name="nvml-read"
        )
        task.add_done_callback(_retrieve)
        self._inflight = task
        return await asyncio.shield(task)

    async def close(self) -> None:
        """Wait for a read in flight, stop the XID watcher, free GPM samples, shut NVML down."""
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait({self._inflight})
        await self._gated(self.telemetry.shutdown, "close")

    def xid_counts(self) -> dict[tuple[int, int], int]:
        """XID events counted since ``start()``, by (GPU index, XID)."""
        return self.telemetry.xid_counts()

    def total_energy_j(self, indices: Collection[int] | None = None) -> float | None:
        """Sum of the energy counters of the GPUs in ``indices`` (None: every GPU; blocking:
        run it through ``gate``)."""
        return self.telemetry.total_energy_j(indices)


def _retrieve(task: asyncio.Task[list[Reading]]) -> None:
    """Mark the outcome of a read as seen, for reads whose caller stopped waiting."""
    if not task.cancelled():
        task.exception()

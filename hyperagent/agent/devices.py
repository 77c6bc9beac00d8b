"""The agent's own device calls, beside the sources' reads: each through its library's gate
(:mod:`hyperagent.gate`) under ``sources.timeout_s``, a failing call logged once. The GPUs'
energy a trial counts, NVML's running processes that attribution matches, and the gates'
refused and timed-out calls for /metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from hyperagent.config import Config
from hyperagent.devices.metrics import ENERGY as GPU_ENERGY
from hyperagent.devices.nvml_telemetry import running_pids
from hyperagent.devices.source import AcceleratorSource
from hyperagent.errors import DeviceCallError
from hyperagent.gate import DeviceGate
from hyperagent.readings import Kind, Reading, Snapshot
from hyperagent.sources import Hardware
from hyperagent.sources.nvml import NvmlSource
from hyperagent.sources.runner import SourceRunner
from hyperagent.sources.smi_text import SmiTextSource

log = logging.getLogger(__name__)

DEVICE_CALL_FAILURES = "hyperagent_device_call_failures_total"

_T = TypeVar("_T")


class DeviceCalls:
    """The agent's calls into the device libraries; owns which of them failed (logged once
    until the call answers again)."""

    def __init__(
        self,
        config: Config,
        hardware: Hardware,
        runner: SourceRunner,
        latest: Callable[[], Snapshot | None],
    ) -> None:
        """``latest``: the latest collection's snapshot (the energy a trial reads where no
        device answers for it)."""
        self.config = config
        self.hardware = hardware
        self.runner = runner
        self.latest = latest
        self.nvml_source = next((s for s in runner.sources if isinstance(s, NvmlSource)), None)
        self.accelerator_source = next(
            (s for s in runner.sources if isinstance(s, AcceleratorSource)), None
        )
        self._problems: set[tuple[str, str]] = set()
        """(call, error type) of the agent's own device calls that failed, each logged once."""

    async def call(self, library: Any, call: Callable[[], _T], what: str) -> _T | None:
        """``call`` through ``library``'s device gate, bounded by ``sources.timeout_s``; None
        when it timed out or the library is busy with a hung call (logged once, counted by the
        gate on /metrics)."""
        gate = DeviceGate.of(library)
        try:
            result = await gate.run(call, timeout_s=self.config.sources.timeout_s, what=what)
        except DeviceCallError as e:
            problem = (what, type(e).__name__)
            if problem not in self._problems:
                self._problems.add(problem)
                log.warning("%s: %s", what, e)
            return None
        self._problems = {p for p in self._problems if p[0] != what}
        return result

    async def energy_j(self, gpus: frozenset[int] | None = None) -> float | None:
        """The energy counters of ``gpus`` (None: every GPU; none: no energy) summed now: one
        device call (None when it did not answer within ``sources.timeout_s``), or a text tool
        with an energy counter (xpu-smi) run for it; without either (GPU readings replayed as
        recorded), as of the latest collection."""
        if gpus is not None and not gpus:
            return None
        source = self.nvml_source or self.accelerator_source
        if source is not None and source.device_module is not None:
            read = source.total_energy_j
            return await self.call(source.device_module, lambda: read(gpus), "total energy")
        tool = next((s for s in self.runner.sources if isinstance(s, SmiTextSource)), None)
        if tool is not None and tool.counts_energy:
            return await tool.total_energy_j(gpus)
        return self._collected_energy_j(gpus)

    def _collected_energy_j(self, gpus: frozenset[int] | None) -> float | None:
        """The energy counters of ``gpus`` (None: every GPU) summed, as of the latest
        collection (None where one is missing)."""
        snapshot = self.latest()
        if snapshot is None:
            return None
        if gpus is None:
            return snapshot.total(GPU_ENERGY)
        values = [
            r.value
            for r in snapshot.readings
            if r.name == GPU_ENERGY
            and r.labels.get("gpu", "").isdigit()
            and int(r.labels["gpu"]) in gpus
        ]
        return sum(values) if len(values) == len(gpus) else None

    async def running_processes(self) -> dict[str, list[int]] | None:
        """NVML's compute processes per GPU (``running_pids``) through the NVML gate; None
        when NVML did not answer in time."""
        return await self.call(self.hardware.nvml, self.running_pids, "running processes")

    def running_pids(self) -> dict[str, list[int]]:
        """GPU index -> pids of its compute processes (empty without NVML's process list), one
        call per GPU through the handles the NVML source enumerated. Blocking: run it through
        the NVML gate."""
        nvml = self.hardware.nvml
        if nvml is None:
            return {}
        source = self.nvml_source
        gpus = source.gpus if source is not None and source.nvml is nvml else []
        try:
            return running_pids(nvml, gpus)
        except Exception as e:  # NVMLError and friends: attribution falls back to hellos
            log.debug("NVML running processes: %s", e)
            return {}

    def gate_readings(self) -> list[Reading]:
        """The device gates' refused and timed-out calls, per library."""
        out: list[Reading] = []
        accel = self.accelerator_source
        accel_module = None if accel is None or accel.library is None else accel.library.module
        nvml_library = None if self.nvml_source is None else self.nvml_source.nvml
        found = (self.hardware.nvml, nvml_library, accel_module)
        libraries = {id(lib): lib for lib in found if lib is not None}
        for library in libraries.values():
            gate = DeviceGate.of(library)
            for reason, count in (("timeout", gate.timeouts), ("busy", gate.busy)):
                labels = {"library": gate.name, "reason": reason}
                out.append(Reading(DEVICE_CALL_FAILURES, count, labels, Kind.COUNTER))
        return out

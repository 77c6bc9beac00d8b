"""NVIDIA GPU telemetry through NVML (the ``pynvml`` module of nvidia-ml-py, or a fake with its
API): every NVML call the agent makes to read GPUs.

Every metric name this module reads is a key of :data:`hyperagent.devices.metrics.HELP`. Per
GPU (labels ``gpu``, ``uuid``): utilisation, GPM activities (Hopper and newer), memory, power
and its limits, energy, temperatures, clocks, clock-event (throttle) time per reason, ECC
counts, retired pages, remapped rows, PCIe throughput and replays, per-link NVLink state,
traffic and errors, XID events, and the MIG devices of a GPU in MIG mode; the compute
processes of each GPU for the agent's job attribution.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from types import ModuleType
from typing import Any

from hyperagent.devices.base import MJ_PER_J
from hyperagent.devices.metrics import (
    GPU_INFO,
    MEMORY_CLOCK,
    MEMORY_TOTAL,
    MEMORY_USED,
    MEMORY_UTILIZATION,
    MIG_INFO,
    MIG_MEMORY_TOTAL,
    MIG_MEMORY_USED,
    NVLINK_ERRORS,
    NVLINK_UP,
    PCIE_THROUGHPUT,
    SM_CLOCK,
    TEMPERATURE,
    THROTTLE,
    UTILIZATION,
)
from hyperagent.devices.nvml_api import (
    GpuIdentity,
    NvmlCalls,
    NvmlSourceError,
    clock_event_reason_bits,
    gpm_metrics,
    mig_profile,
    nvlink_error_counters,
    nvml_error_code,
    nvml_text,
)
from hyperagent.devices.nvml_fields import FieldReader
from hyperagent.devices.nvml_gpu import Batch, GpmState, GpuState, Link, MigDevice
from hyperagent.devices.nvml_xid import XidWatcher
from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)


UNSUPPORTED_RETRY_READS = 300
"""Reads between two tries of a field or call the GPU said it does not support (5 minutes at
1 Hz)."""


class NvmlTelemetry:
    """Per-GPU telemetry through NVML, read with blocking calls (run them through the library's
    :class:`~hyperagent.gate.DeviceGate`: :class:`hyperagent.sources.nvml.NvmlSource` does);
    see the module docstring for what is read. Only the XID watcher calls NVML on a thread of
    its own: its wait blocks by design. A second ``start()`` finds NVML started and returns.

    Every reading that has an NVML field id is read
    through ``nvmlDeviceGetFieldValues``, one call per GPU for a whole set, each field with its
    own return code; the rest takes one call each. Per GPU and read, at steady state:

    - every read: one field-values call (board power, 1 s average and instant, energy, the
      enforced power limit, memory temperature, PCIe replays, NVML's throttle counters, NVLink
      traffic), utilisation, the clock-event reasons, and on GPUs with GPM one
      ``nvmlGpmSampleGet`` and one ``nvmlGpmMetricsGet`` for every activity;
    - every ``slow_interval_s`` of ``clock`` (by default the health interval): GPU temperature,
      memory, SM and memory clocks, PCIe throughput, MIG devices;
    - every ``health_interval_s``: one field-values call (ECC counts, retired pages, remapped
      rows, the power limit range), NVLink state and error counters.

    The reads in between repeat the last slow and health readings (0 reads them every time).
    A field or call the device or driver does not support (NOT_SUPPORTED, FUNCTION_NOT_FOUND,
    and INVALID_ARGUMENT for a field, perf policy or NVLink counter id newer than the driver)
    is left out, never reported as zero, and asked again only every
    ``UNSUPPORTED_RETRY_READS`` reads; a field the driver does not know is read through its
    older call where there is one (``nvmlDeviceGetPowerUsage`` for power, ...). Any other NVML
    error, a field's included, fails the whole read with NvmlSourceError (the runner reports
    the source down) and the next read tries again.

    Units: power fields are mW (scope 0, the GPU alone), energy mJ, throttle counters ns, NVLink
    traffic KiB (scope = link), as nvml.h defines them. ``hyperagent_gpu_power_watts`` is NVML's
    1 s average where the GPU has it (Ampere on, not GA100), else the instant power, as
    ``nvmlDeviceGetPowerUsage``; ``hyperagent_gpu_power_instant_watts`` is never averaged.

    Two-sample values use the previous read of the same GPU: GPM activities (the first
    interval starts at ``start()``) and clock-event time for reasons NVML has no counter for.
    ``hyperagent_gpu_throttle_seconds_total{reason}`` takes NVML's cumulative violation time
    (NVML_FI_DEV_PERF_POLICY_*, else nvmlDeviceGetViolationStatus, ns) for sw_power_cap,
    sync_boost, thermal, board_limit, low_utilization, reliability, total_app_clocks and
    total_base_clocks where the GPU supports it; every other bit of
    nvmlDeviceGetCurrentClocksEventReasons (or ...ThrottleReasons on drivers before 535) is
    integrated by the agent: a reason active at a read counts for the whole interval since that
    GPU's previous successful read, so those counters start at 0 when the agent starts.

    XID events arrive through an NVML event set that a dedicated thread waits on with a
    ``event_wait_ms`` timeout (an event ends the wait at once; the timeout is how long the
    thread outlives ``close()``, holding its own NVML reference, and how often it wakes while
    idle); counts are kept per GPU and XID from ``start()`` on. ``clock`` (seconds, monotonic)
    times the integration and the intervals; pass the clock of a replayed NVML to use its time.
    """

    def __init__(
        self,
        nvml: ModuleType | Any,
        *,
        clock: Callable[[], float] = time.monotonic,
        event_wait_ms: int = 5000,
        health_interval_s: float = 10.0,
        slow_interval_s: float | None = None,
    ) -> None:
        nv = nvml
        self.nvml = nvml
        self.health_interval_s = health_interval_s
        self.slow_interval_s = health_interval_s if slow_interval_s is None else slow_interval_s
        self.gpus: list[GpuIdentity] = []
        self.driver = ""
        self._clock = clock
        self._initialised = False
        self._states: list[GpuState] = []
        self._calls = NvmlCalls(nv)
        self._fields = FieldReader(nv, self._calls)
        self._xids = XidWatcher(nv, self._calls, event_wait_ms)
        self._reason_bits = clock_event_reason_bits(nv)
        self._nvlink_errors = nvlink_error_counters(nv)
        self._gpm_metrics = gpm_metrics(nv)
        self._reasons_call: Callable[[Any], int] = nv.nvmlDeviceGetCurrentClocksEventReasons

    @property
    def events_thread(self) -> threading.Thread | None:
        """The XID watcher's thread (see :class:`~hyperagent.devices.nvml_xid.XidWatcher`)."""
        return self._xids.thread

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Initialise NVML, enumerate GPUs and their links, prime GPM, start the XID watcher."""
        if self._initialised:  # a start whose caller stopped waiting finished after all
            return
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
            raise NvmlSourceError(f"nvmlInit failed: {e}", nvml_error_code(e)) from e
        self._initialised = True
        try:
            self.driver = nvml_text(nv.nvmlSystemGetDriverVersion())
            for index in range(nv.nvmlDeviceGetCount()):
                state = self._gpu_state(index)
                self._states.append(state)
                self._start_gpm(state)
            self.gpus = [state.identity for state in self._states]
            self._xids.start(self._states)
        except nv.NVMLError as e:
            self.shutdown()
            raise NvmlSourceError(f"enumerating GPUs failed: {e}", nvml_error_code(e)) from e
        except BaseException:
            self.shutdown()
            raise

    def _gpu_state(self, index: int) -> GpuState:
        nv = self.nvml
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        identity = GpuIdentity(
            index,
            nvml_text(nv.nvmlDeviceGetUUID(handle)),
            nvml_text(nv.nvmlDeviceGetName(handle)),
            handle,
        )
        labels = {"gpu": str(index), "uuid": identity.uuid}
        info = {**labels, "model": identity.model, "driver": self.driver}
        state = GpuState(identity, labels, info)
        links = []
        for number in self._probe_links(identity):
            link_labels = {**labels, "link": str(number)}
            errors = {kind: {**link_labels, "type": kind} for kind, _ in self._nvlink_errors}
            links.append(Link(number, link_labels, errors))
        state.links = tuple(links)
        state.fast = Batch(self._fields.fast_fields(state))
        state.health_fields = Batch(self._fields.health_fields(state))
        state.violations = self._fields.violations()
        return state

    def _probe_links(self, gpu: GpuIdentity) -> tuple[int, ...]:
        """NVLinks the GPU has: up to the first link NVML calls invalid, skipping unsupported."""
        nv = self.nvml
        links = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                nv.nvmlDeviceGetNvLinkState(gpu.handle, link)
            except nv.NVMLError as e:
                code = nvml_error_code(e)
                if code == nv.NVML_ERROR_INVALID_ARGUMENT:
                    break
                if code in self._calls.unsupported:
                    continue
                raise
            links.append(link)
        return tuple(links)

    def _start_gpm(self, state: GpuState) -> None:
        nv, gpu = self.nvml, state.identity
        support = self._calls.call(gpu, "GPM support", nv.nvmlGpmQueryDeviceSupport, gpu.handle)
        if support is None or not support.isSupportedDevice:
            return
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self._gpm_metrics)
        for i, (_, metric) in enumerate(self._gpm_metrics):
            request.metrics[i].metricId = metric
        state.gpm = GpmState((nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()), request)
        if self._calls.call(
            gpu, "GPM sample", nv.nvmlGpmSampleGet, gpu.handle, state.gpm.samples[0]
        ):
            state.gpm.latest = 0

    def shutdown(self) -> None:
        """Stop the XID watcher, free GPM samples, shut NVML down."""
        nv = self.nvml
        self._xids.stop()
        for state in self._states:
            if state.gpm is not None:
                for sample in state.gpm.samples:
                    self._calls.quietly(nv.nvmlGpmSampleFree, sample)
        self._states, self.gpus = [], []
        if self._initialised:
            self._initialised = False
            nv.nvmlShutdown()

    # -- reading --------------------------------------------------------------------------------

    def read(self) -> list[Reading]:
        """One sample of every GPU; raises NvmlSourceError when NVML fails."""
        out: list[Reading] = []
        for state in self._states:
            try:
                self._read_gpu(state, out)
            except SourceError:
                state.forget_sampling()
                raise
        out.extend(self._xids.readings())
        return out

    def _read_gpu(self, state: GpuState, out: list[Reading]) -> None:
        nv, gpu = self.nvml, state.identity
        h, labels = gpu.handle, state.labels
        out.append(Reading(GPU_INFO, 1.0, state.info, Kind.INFO))
        state.reads += 1
        if state.reads % UNSUPPORTED_RETRY_READS == 0:
            state.retry_refused()

        def gauge(name: str, value: float, at: Mapping[str, str] = labels) -> None:
            out.append(Reading(name, float(value), at))

        def counter(name: str, value: float, at: Mapping[str, str] = labels) -> None:
            out.append(Reading(name, float(value), at, Kind.COUNTER))

        util = self._calls.call(gpu, "utilization", nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            gauge(UTILIZATION, util.gpu / 100)
            gauge(MEMORY_UTILIZATION, util.memory / 100)
        self._read_gpm(state, gauge)
        got = self._fields.read(state, state.fast, out)
        self._fields.read_power(state, got, gauge)
        self._read_throttle(state, counter, {r for r, key in state.violations if key in got})
        now = self._clock()
        if now - state.slow_at >= self.slow_interval_s:
            first = len(out)
            self._read_slow(state, gauge, counter, out)
            state.slow = out[first:]
            state.slow_at = now
        else:
            out.extend(state.slow)
        if now - state.health_at >= self.health_interval_s:
            first = len(out)
            self._fields.read(state, state.health_fields, out)
            self._read_nvlink(state, gauge, counter)
            state.health = out[first:]
            state.health_at = now
        else:
            out.extend(state.health)

    def _read_slow(
        self,
        state: GpuState,
        gauge: Callable[..., None],
        counter: Callable[..., None],
        out: list[Reading],
    ) -> None:
        """Temperature, memory, clocks, PCIe throughput and MIG devices."""
        nv, gpu = self.nvml, state.identity
        h = gpu.handle
        temp = self._calls.call(
            gpu, "temperature", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU
        )
        if temp is not None:
            gauge(TEMPERATURE, temp)
        memory = self._calls.call(gpu, "memory", nv.nvmlDeviceGetMemoryInfo, h)
        if memory is not None:
            gauge(MEMORY_USED, memory.used)
            gauge(MEMORY_TOTAL, memory.total)
        for name, clock in ((SM_CLOCK, nv.NVML_CLOCK_SM), (MEMORY_CLOCK, nv.NVML_CLOCK_MEM)):
            mhz = self._calls.call(gpu, "clock", nv.nvmlDeviceGetClockInfo, h, clock)
            if mhz is not None:
                gauge(name, mhz * 1e6)
        for direction, which in (
            ("tx", nv.NVML_PCIE_UTIL_TX_BYTES),
            ("rx", nv.NVML_PCIE_UTIL_RX_BYTES),
        ):
            kb_per_s = self._calls.call(
                gpu, "PCIe throughput", nv.nvmlDeviceGetPcieThroughput, h, which
            )
            if kb_per_s is not None:
                gauge(PCIE_THROUGHPUT, kb_per_s * 1024, state.labelled("direction", direction))
        self._read_mig(state, out)

    def _read_gpm(self, state: GpuState, gauge: Callable[..., None]) -> None:
        nv, gpu, gpm = self.nvml, state.identity, state.gpm
        if gpm is None:
            return
        target = 1 if gpm.latest == 0 else 0
        if not self._calls.call(
            gpu, "GPM sample", nv.nvmlGpmSampleGet, gpu.handle, gpm.samples[target]
        ):
            gpm.latest = None
            return
        if gpm.latest is not None:
            gpm.request.sample1 = gpm.samples[gpm.latest]
            gpm.request.sample2 = gpm.samples[target]
            if self._calls.call(gpu, "GPM metrics", nv.nvmlGpmMetricsGet, gpm.request) is not None:
                for i, (name, _) in enumerate(self._gpm_metrics):
                    metric = gpm.request.metrics[i]
                    value = metric.value
                    if metric.nvmlReturn == nv.NVML_SUCCESS and math.isfinite(value) and value >= 0:
                        gauge(name, min(value / 100, 1.0))
        gpm.latest = target

    def _read_throttle(
        self, state: GpuState, counter: Callable[..., None], counted: set[str]
    ) -> None:
        """Clock-event time for the reasons NVML does not count (``counted`` it did, this read):
        the agent's integration of the active reasons."""
        mask = self._clock_event_reasons(state.identity)
        now = self._clock()
        if mask is None:
            state.reasons_seen_at = None
            return
        elapsed = 0.0 if state.reasons_seen_at is None else max(0.0, now - state.reasons_seen_at)
        state.reasons_seen_at = now
        for reason, bit in self._reason_bits:
            if reason in counted:
                continue
            total = state.integrated_s.get(reason, 0.0) + (elapsed if mask & bit else 0.0)
            state.integrated_s[reason] = total
            counter(THROTTLE, total, state.labelled("reason", reason))

    def _clock_event_reasons(self, gpu: GpuIdentity) -> int | None:
        nv = self.nvml
        try:
            return self._reasons_call(gpu.handle)
        except nv.NVMLError as e:
            code = nvml_error_code(e)
            if code == nv.NVML_ERROR_FUNCTION_NOT_FOUND and (
                self._reasons_call is not nv.nvmlDeviceGetCurrentClocksThrottleReasons
            ):
                self._reasons_call = nv.nvmlDeviceGetCurrentClocksThrottleReasons
                return self._clock_event_reasons(gpu)
            if code in self._calls.unsupported:
                return None
            raise NvmlSourceError(
                f"GPU {gpu.index} ({gpu.uuid}): clock event reasons: {e}", code
            ) from e

    def _read_nvlink(
        self, state: GpuState, gauge: Callable[..., None], counter: Callable[..., None]
    ) -> None:
        """Link state and data-link error counters of every NVLink (no field ids cover them
        for every link and driver); a counter the GPU does not support is asked again only on
        the retry read."""
        nv, gpu = self.nvml, state.identity
        for link in state.links:
            up = self._calls.call(
                gpu, "NVLink state", nv.nvmlDeviceGetNvLinkState, gpu.handle, link.number
            )
            if up is not None:
                gauge(NVLINK_UP, 1.0 if up == nv.NVML_FEATURE_ENABLED else 0.0, link.labels)
            for error_type, which in self._nvlink_errors:
                if (link.number, which) in state.refused_counters:
                    continue
                count = self._calls.call_or_none(
                    gpu,
                    "NVLink error counter",
                    self._calls.unknown_id,
                    nv.nvmlDeviceGetNvLinkErrorCounter,
                    gpu.handle,
                    link.number,
                    which,
                )
                if count is None:
                    state.refused_counters.add((link.number, which))
                else:
                    counter(NVLINK_ERRORS, count, link.errors[error_type])

    def _read_mig(self, state: GpuState, out: list[Reading]) -> None:
        nv, gpu = self.nvml, state.identity
        if state.mig_unsupported:
            return
        mode = self._calls.call(gpu, "MIG mode", nv.nvmlDeviceGetMigMode, gpu.handle)
        if mode is None:
            state.mig_unsupported = True
        if mode is None or mode[0] != nv.NVML_DEVICE_MIG_ENABLE:
            state.mig_slots = None
            state.mig = {}
            return
        if state.mig_slots is None:
            slots = self._calls.call(
                gpu, "MIG device count", nv.nvmlDeviceGetMaxMigDeviceCount, gpu.handle
            )
            state.mig_slots = slots or 0
        empty = (*self._calls.unsupported, nv.NVML_ERROR_NOT_FOUND, nv.NVML_ERROR_INVALID_ARGUMENT)
        seen: dict[tuple[int, str], MigDevice] = {}
        for slot in range(state.mig_slots):
            handle = self._calls.call_or_none(
                gpu, "MIG device", empty, nv.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, slot
            )
            if handle is None:
                continue
            uuid = self._calls.call(gpu, "MIG device UUID", nv.nvmlDeviceGetUUID, handle)
            key = (slot, nvml_text(uuid) if uuid is not None else "")
            mig = state.mig.get(key) or self._mig_identity(state, key[1], handle)
            seen[key] = mig
            out.append(Reading(MIG_INFO, 1.0, mig.info, Kind.INFO))
            memory = self._calls.call(gpu, "MIG device memory", nv.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                out.append(Reading(MIG_MEMORY_USED, float(memory.used), mig.labels))
                out.append(Reading(MIG_MEMORY_TOTAL, float(memory.total), mig.labels))
        state.mig = seen

    def _mig_identity(self, state: GpuState, uuid: str, handle: Any) -> MigDevice:
        """Labels of a MIG device, read once per (slot, MIG UUID)."""
        nv, gpu = self.nvml, state.identity
        gi = self._calls.call(gpu, "MIG GPU instance", nv.nvmlDeviceGetGpuInstanceId, handle)
        ci = self._calls.call(
            gpu, "MIG compute instance", nv.nvmlDeviceGetComputeInstanceId, handle
        )
        name = self._calls.call(gpu, "MIG device name", nv.nvmlDeviceGetName, handle)
        labels = {
            **state.labels,
            "gi": "" if gi is None else str(gi),
            "ci": "" if ci is None else str(ci),
        }
        profile = mig_profile(nvml_text(name)) if name is not None else ""
        return MigDevice({**labels, "mig_uuid": uuid, "profile": profile}, labels)

    # -- for the agent --------------------------------------------------------------------------

    def xid_counts(self) -> dict[tuple[int, int], int]:
        """XID events counted since ``start()``, by (GPU index, XID)."""
        return self._xids.counts()

    def total_energy_j(self, indices: Collection[int] | None = None) -> float | None:
        """Sum of the energy counters of the GPUs whose index is in ``indices`` (None: every
        GPU); None when none is there or NVML fails (blocking: run it through ``gate``)."""
        nv = self.nvml
        gpus = [g for g in self.gpus if indices is None or g.index in indices]
        total = 0.0
        try:
            for gpu in gpus:
                total += nv.nvmlDeviceGetTotalEnergyConsumption(gpu.handle) / MJ_PER_J
        except nv.NVMLError:
            return None
        return total if gpus and (indices is None or len(gpus) == len(indices)) else None


def running_pids(nv: Any, gpus: Sequence[GpuIdentity] = ()) -> dict[str, list[int]]:
    """GPU index -> pids of its compute processes, one call per GPU through the handles of
    ``gpus`` (an NvmlTelemetry's, enumerated at its start; none: NVML's own enumeration);
    empty where the library has no process list. Raises the library's errors."""
    if not hasattr(nv, "nvmlDeviceGetComputeRunningProcesses"):
        return {}
    if gpus:
        handles = [(gpu.index, gpu.handle) for gpu in gpus]
    else:
        handles = [
            (index, nv.nvmlDeviceGetHandleByIndex(index))
            for index in range(nv.nvmlDeviceGetCount())
        ]
    return {
        str(index): [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)]
        for index, handle in handles
    }

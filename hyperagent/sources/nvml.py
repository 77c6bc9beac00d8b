"""GPU telemetry through NVML (the ``pynvml`` module of nvidia-ml-py, or a fake with its API).

Every metric name this module exposes is a key of ``HELP``. Per GPU (labels ``gpu``, ``uuid``):
utilisation, GPM activities (Hopper and newer), memory, power and its limits, energy,
temperatures, clocks, clock-event (throttle) time per reason, ECC counts, retired pages,
remapped rows, PCIe throughput and replays, per-link NVLink state, traffic and errors, XID
events, and the MIG devices of a GPU in MIG mode.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)

GPU_INFO = "hyperagent_gpu_info"
UTILIZATION = "hyperagent_gpu_utilization_ratio"
MEMORY_UTILIZATION = "hyperagent_gpu_memory_utilization_ratio"
SM_ACTIVE = "hyperagent_gpu_sm_active_ratio"
SM_OCCUPANCY = "hyperagent_gpu_sm_occupancy_ratio"
TENSOR_ACTIVE = "hyperagent_gpu_tensor_active_ratio"
DRAM_ACTIVE = "hyperagent_gpu_dram_active_ratio"
MEMORY_USED = "hyperagent_gpu_memory_used_bytes"
MEMORY_TOTAL = "hyperagent_gpu_memory_total_bytes"
POWER = "hyperagent_gpu_power_watts"
POWER_LIMIT = "hyperagent_gpu_power_limit_watts"
POWER_LIMIT_MIN = "hyperagent_gpu_power_limit_min_watts"
POWER_LIMIT_MAX = "hyperagent_gpu_power_limit_max_watts"
ENERGY = "hyperagent_gpu_energy_joules_total"
TEMPERATURE = "hyperagent_gpu_temperature_celsius"
MEMORY_TEMPERATURE = "hyperagent_gpu_memory_temperature_celsius"
SM_CLOCK = "hyperagent_gpu_sm_clock_hertz"
MEMORY_CLOCK = "hyperagent_gpu_memory_clock_hertz"
THROTTLE = "hyperagent_gpu_throttle_seconds_total"
ECC_ERRORS = "hyperagent_gpu_ecc_errors_total"
ECC_LIFETIME_ERRORS = "hyperagent_gpu_ecc_lifetime_errors_total"
RETIRED_PAGES = "hyperagent_gpu_retired_pages"
RETIRED_PAGES_PENDING = "hyperagent_gpu_retired_pages_pending"
REMAPPED_ROWS = "hyperagent_gpu_remapped_rows"
REMAPPED_ROWS_PENDING = "hyperagent_gpu_remapped_rows_pending"
REMAPPED_ROWS_FAILED = "hyperagent_gpu_remapped_rows_failed"
PCIE_THROUGHPUT = "hyperagent_gpu_pcie_throughput_bytes_per_second"
PCIE_REPLAYS = "hyperagent_gpu_pcie_replays_total"
NVLINK_UP = "hyperagent_gpu_nvlink_up"
NVLINK_DATA = "hyperagent_gpu_nvlink_data_bytes_total"
NVLINK_ERRORS = "hyperagent_gpu_nvlink_errors_total"
XID_ERRORS = "hyperagent_gpu_xid_errors_total"
MIG_INFO = "hyperagent_gpu_mig_info"
MIG_MEMORY_USED = "hyperagent_gpu_mig_memory_used_bytes"
MIG_MEMORY_TOTAL = "hyperagent_gpu_mig_memory_total_bytes"

HELP: dict[str, str] = {
    GPU_INFO: "GPU identity: model and driver version.",
    UTILIZATION: "Fraction of the last sample period a kernel ran.",
    MEMORY_UTILIZATION: "Fraction of the last sample period device memory was read or written.",
    SM_ACTIVE: "Fraction of SMs busy since the previous read (GPM SM utilisation).",
    SM_OCCUPANCY: "Resident warps as a fraction of the SMs' maximum since the previous read.",
    TENSOR_ACTIVE: "Fraction of time the SMs ran tensor-core instructions since the previous read.",
    DRAM_ACTIVE: "Device memory bandwidth used as a fraction of its peak since the previous read.",
    MEMORY_USED: "Device memory in use, including memory the driver reserves.",
    MEMORY_TOTAL: "Device memory installed.",
    POWER: "Power draw of the GPU board.",
    POWER_LIMIT: "Enforced power limit.",
    POWER_LIMIT_MIN: "Lowest power limit the device accepts.",
    POWER_LIMIT_MAX: "Highest power limit the device accepts.",
    ENERGY: "Energy consumed since the driver loaded.",
    TEMPERATURE: "GPU core temperature.",
    MEMORY_TEMPERATURE: "Device memory (HBM) temperature.",
    SM_CLOCK: "Current SM clock.",
    MEMORY_CLOCK: "Current memory clock.",
    THROTTLE: (
        "Time clocks were held down, by reason: NVML's own counter where it has one, "
        "else the agent's integration of the active reasons between reads."
    ),
    ECC_ERRORS: "ECC errors since the driver loaded (NVML volatile counts), by type.",
    ECC_LIFETIME_ERRORS: "ECC errors over the board's life (NVML aggregate counts), by type.",
    RETIRED_PAGES: "Device memory pages retired, by cause.",
    RETIRED_PAGES_PENDING: "1 when a page is waiting to be retired at the next driver reload.",
    REMAPPED_ROWS: "Device memory rows remapped, by the kind of error that caused it.",
    REMAPPED_ROWS_PENDING: "1 when a row remapping waits for a GPU reset.",
    REMAPPED_ROWS_FAILED: "1 when a row remapping failed: the GPU needs service.",
    PCIE_THROUGHPUT: "PCIe traffic over NVML's last 20 ms sample, by direction.",
    PCIE_REPLAYS: "PCIe link replays (retransmissions) since the driver loaded.",
    NVLINK_UP: "1 when the NVLink is active.",
    NVLINK_DATA: "NVLink payload bytes, by link and direction.",
    NVLINK_ERRORS: "NVLink data-link errors, by link and type.",
    XID_ERRORS: "Critical XID events reported by the driver since the agent started, by XID.",
    MIG_INFO: "A MIG device of the GPU: its UUID, GPU and compute instance and profile.",
    MIG_MEMORY_USED: "Memory in use in a MIG device.",
    MIG_MEMORY_TOTAL: "Memory of a MIG device.",
}


class NvmlSourceError(SourceError):
    """An NVML call failed; ``vendor_code`` is its NVML return code."""

    def __init__(self, message: str, vendor_code: int | None) -> None:
        super().__init__(message)
        self.vendor_code = vendor_code


def nvml_error_code(error: BaseException) -> int | None:
    """The NVML return code carried by a pynvml.NVMLError, else None."""
    value = getattr(error, "value", None)
    return value if isinstance(value, int) else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def handle_key(handle: Any) -> Any:
    """A hashable key equal for equal device handles: the address a pynvml (ctypes) handle
    points to, else the handle itself (a fake's handle objects are unique per device)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


def violation_policies(nv: Any) -> tuple[tuple[str, int], ...]:
    """Throttle reasons NVML counts itself (nvmlDeviceGetViolationStatus, ns), by reason label.

    NVML defines the SW power cap and sync boost clock-event counters as its POWER and
    SYNC_BOOST perf policies, so those two reasons share their label with the bit.
    """
    return (
        ("sw_power_cap", nv.NVML_PERF_POLICY_POWER),
        ("sync_boost", nv.NVML_PERF_POLICY_SYNC_BOOST),
        ("thermal", nv.NVML_PERF_POLICY_THERMAL),
        ("board_limit", nv.NVML_PERF_POLICY_BOARD_LIMIT),
        ("low_utilization", nv.NVML_PERF_POLICY_LOW_UTILIZATION),
        ("reliability", nv.NVML_PERF_POLICY_RELIABILITY),
        ("total_app_clocks", nv.NVML_PERF_POLICY_TOTAL_APP_CLOCKS),
        ("total_base_clocks", nv.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS),
    )


def clock_event_reason_bits(nv: Any) -> tuple[tuple[str, int], ...]:
    """The bits of NVML's current clock-event (throttle) reasons mask, by nvidia-smi's names."""
    return (
        ("gpu_idle", nv.nvmlClocksEventReasonGpuIdle),
        ("applications_clocks_setting", nv.nvmlClocksEventReasonApplicationsClocksSetting),
        ("sw_power_cap", nv.nvmlClocksEventReasonSwPowerCap),
        ("hw_slowdown", nv.nvmlClocksEventReasonHwSlowdown),
        ("sync_boost", nv.nvmlClocksEventReasonSyncBoost),
        ("sw_thermal_slowdown", nv.nvmlClocksEventReasonSwThermalSlowdown),
        ("hw_thermal_slowdown", nv.nvmlClocksEventReasonHwThermalSlowdown),
        ("hw_power_brake_slowdown", nv.nvmlClocksEventReasonHwPowerBrakeSlowdown),
        ("display_clocks_setting", nv.nvmlClocksEventReasonDisplayClockSetting),
    )


def nvlink_error_counters(nv: Any) -> tuple[tuple[str, int], ...]:
    """NVLink data-link error counters (nvmlDeviceGetNvLinkErrorCounter), by type label."""
    return (
        ("replay", nv.NVML_NVLINK_ERROR_DL_REPLAY),
        ("recovery", nv.NVML_NVLINK_ERROR_DL_RECOVERY),
        ("crc_flit", nv.NVML_NVLINK_ERROR_DL_CRC_FLIT),
        ("crc_data", nv.NVML_NVLINK_ERROR_DL_CRC_DATA),
        ("ecc_data", nv.NVML_NVLINK_ERROR_DL_ECC_DATA),
    )


def gpm_metrics(nv: Any) -> tuple[tuple[str, int], ...]:
    """GPM metrics read each cycle (percent in NVML, ratios here), by metric name."""
    return (
        (SM_ACTIVE, nv.NVML_GPM_METRIC_SM_UTIL),
        (SM_OCCUPANCY, nv.NVML_GPM_METRIC_SM_OCCUPANCY),
        (TENSOR_ACTIVE, nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL),
        (DRAM_ACTIVE, nv.NVML_GPM_METRIC_DRAM_BW_UTIL),
    )


def mig_profile(name: str) -> str:
    """The MIG profile in the name NVML gives a MIG device ("NVIDIA A100 ... MIG 1g.10gb")."""
    head, marker, profile = name.rpartition(" MIG ")
    return profile.strip() if marker and head else ""


@dataclass(frozen=True)
class GpuIdentity:
    index: int
    uuid: str
    model: str
    handle: Any


@dataclass
class _Gpm:
    samples: tuple[Any, Any]
    request: Any
    latest: int | None = None


@dataclass(frozen=True)
class _Link:
    """One NVLink of a GPU and the label sets of its readings."""

    number: int
    labels: dict[str, str]
    errors: dict[str, dict[str, str]]


@dataclass(frozen=True)
class _Mig:
    info: dict[str, str]
    labels: dict[str, str]


UNSUPPORTED_RETRY_READS = 300
"""Reads between two tries of a call the GPU said it does not support (5 minutes at 1 Hz)."""


@dataclass
class _GpuState:
    """What the read thread keeps per GPU: labels built once, links, and sampling state."""

    identity: GpuIdentity
    labels: dict[str, str]
    info: dict[str, str]
    by_label: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    links: tuple[_Link, ...] = ()
    fields: list[tuple[int, int]] = field(default_factory=list)
    field_targets: list[tuple[str, dict[str, str], Kind, float]] = field(default_factory=list)
    gpm: _Gpm | None = None
    reasons_seen_at: float | None = None
    integrated_s: dict[str, float] = field(default_factory=dict)
    mig_slots: int | None = None
    mig: dict[tuple[int, str], _Mig] = field(default_factory=dict)
    health: list[Reading] = field(default_factory=list)
    """The last memory health readings, repeated until ``health_at`` + the health interval."""
    health_at: float = -math.inf
    power_bounds: Any = None
    unsupported_violations: set[int] = field(default_factory=set)
    """Violation policies the GPU answered "not supported"; asked again every
    ``UNSUPPORTED_RETRY_READS`` reads (a driver update or a MIG change may add them)."""
    reads: int = 0

    def labelled(self, key: str, value: str) -> dict[str, str]:
        """The GPU's labels plus ``key=value``, built once and shared by every reading."""
        values = self.by_label.get(key)
        if values is None:
            values = self.by_label[key] = {}
        found = values.get(value)
        if found is None:
            found = values[value] = {**self.labels, key: value}
        return found

    def forget_sampling(self) -> None:
        """Drop two-sample state after a failed read, so an outage is not integrated."""
        self.reasons_seen_at = None
        self.health_at = -math.inf
        if self.gpm is not None:
            self.gpm.latest = None


class NvmlSource:
    """Per-GPU telemetry through NVML; see the module docstring for what is read.

    Every NVML call runs in a worker thread, one call per field per device and read; a field
    the device or driver does not support (NOT_SUPPORTED, FUNCTION_NOT_FOUND, and
    INVALID_ARGUMENT for a field, perf policy or NVLink counter id newer than the driver) is
    left out, never reported as zero. Any other NVML error fails the whole read with NvmlSourceError
    (the runner reports the source down) and the next read tries again. A read still running
    when the next is due makes that next read fail instead of piling up.

    Two-sample values use the previous read of the same GPU: GPM activities (the first
    interval starts at ``start()``) and clock-event time for reasons NVML has no counter for.
    ``hyperagent_gpu_throttle_seconds_total{reason}`` takes NVML's cumulative violation time
    (nvmlDeviceGetViolationStatus, ns) for sw_power_cap, sync_boost, thermal, board_limit,
    low_utilization, reliability, total_app_clocks and total_base_clocks where the GPU
    supports it; every other bit of nvmlDeviceGetCurrentClocksEventReasons (or
    ...ThrottleReasons on drivers before 535) is integrated by the agent: a reason active at
    a read counts for the whole interval since that GPU's previous successful read, so those
    counters start at 0 when the agent starts.

    XID events arrive through an NVML event set that a dedicated thread waits on with a
    ``event_wait_ms`` timeout (an event ends the wait at once; the timeout is how long the
    thread outlives ``close()``, holding its own NVML reference, and how often it wakes while
    idle); counts are kept per GPU and XID from ``start()`` on. ``clock`` (seconds, monotonic)
    times the integration; pass the clock of a replayed NVML to integrate in its time.

    Memory health (ECC counts, retired pages, remapped rows) and the power limit range change
    rarely: they are read every ``health_interval_s`` of ``clock`` (every read with 0), and
    the reads in between repeat them (39% of the NVML calls of a read, on eight V100s).
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
    ) -> None:
        nv = nvml
        self.nvml = nvml
        self.health_interval_s = health_interval_s
        self.gpus: list[GpuIdentity] = []
        self.driver = ""
        self.event_wait_ms = event_wait_ms
        self._clock = clock
        self._initialised = False
        self._states: list[_GpuState] = []
        self._by_handle: dict[Any, _GpuState] = {}
        self._by_uuid: dict[str, _GpuState] = {}
        self._inflight: asyncio.Task[list[Reading]] | None = None
        self._nvml_error: type[Exception] = nv.NVMLError
        self._unsupported = (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND)
        self._unknown_id = (*self._unsupported, nv.NVML_ERROR_INVALID_ARGUMENT)
        self._violations = violation_policies(nv)
        self._reason_bits = clock_event_reason_bits(nv)
        self._nvlink_errors = nvlink_error_counters(nv)
        self._gpm_metrics = gpm_metrics(nv)
        self._ecc = (
            ("corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        )
        self._retirement = (
            ("single_bit_ecc", nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
            ("double_bit_ecc", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
        )
        value_types = (
            ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
            ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
            ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
            ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
            ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
            ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
            ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),  # not in nvidia-ml-py 12.535
        )
        self._field_value = {
            getattr(nv, name): member for name, member in value_types if hasattr(nv, name)
        }
        self._reasons_call: Callable[[Any], int] = nv.nvmlDeviceGetCurrentClocksEventReasons
        self._events_stop = threading.Event()
        self._events_thread: threading.Thread | None = None
        self._xid_lock = threading.Lock()
        self._xids: dict[tuple[int, int], tuple[dict[str, str], int]] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Initialise NVML, enumerate GPUs and their links, prime GPM, start the XID watcher."""
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
            raise NvmlSourceError(f"nvmlInit failed: {e}", nvml_error_code(e)) from e
        self._initialised = True
        try:
            self.driver = _text(nv.nvmlSystemGetDriverVersion())
            for index in range(nv.nvmlDeviceGetCount()):
                state = self._gpu_state(index)
                self._states.append(state)
                self._start_gpm(state)
            self.gpus = [state.identity for state in self._states]
            self._by_uuid = {state.identity.uuid: state for state in self._states}
            self._by_handle = {handle_key(s.identity.handle): s for s in self._states}
            self._start_events()
        except nv.NVMLError as e:
            self._shutdown_sync()
            raise NvmlSourceError(f"enumerating GPUs failed: {e}", nvml_error_code(e)) from e
        except BaseException:
            self._shutdown_sync()
            raise

    def _gpu_state(self, index: int) -> _GpuState:
        nv = self.nvml
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        identity = GpuIdentity(
            index, _text(nv.nvmlDeviceGetUUID(handle)), _text(nv.nvmlDeviceGetName(handle)), handle
        )
        labels = {"gpu": str(index), "uuid": identity.uuid}
        info = {**labels, "model": identity.model, "driver": self.driver}
        state = _GpuState(identity, labels, info)
        state.fields = [(nv.NVML_FI_DEV_MEMORY_TEMP, 0)]
        state.field_targets = [(MEMORY_TEMPERATURE, labels, Kind.GAUGE, 1.0)]
        links = []
        for number in self._probe_links(identity):
            link_labels = {**labels, "link": str(number)}
            errors = {kind: {**link_labels, "type": kind} for kind, _ in self._nvlink_errors}
            links.append(_Link(number, link_labels, errors))
            for direction, field_id in (
                ("tx", nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX),
                ("rx", nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX),
            ):
                state.fields.append((field_id, number))
                traffic = {**link_labels, "direction": direction}
                state.field_targets.append((NVLINK_DATA, traffic, Kind.COUNTER, 1024.0))
        state.links = tuple(links)
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
                if code in self._unsupported:
                    continue
                raise
            links.append(link)
        return tuple(links)

    def _start_gpm(self, state: _GpuState) -> None:
        nv, gpu = self.nvml, state.identity
        support = self._call(gpu, "GPM support", nv.nvmlGpmQueryDeviceSupport, gpu.handle)
        if support is None or not support.isSupportedDevice:
            return
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self._gpm_metrics)
        for i, (_, metric) in enumerate(self._gpm_metrics):
            request.metrics[i].metricId = metric
        state.gpm = _Gpm((nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()), request)
        if self._call(gpu, "GPM sample", nv.nvmlGpmSampleGet, gpu.handle, state.gpm.samples[0]):
            state.gpm.latest = 0

    def _start_events(self) -> None:
        nv = self.nvml
        quiet = (*self._unsupported, nv.NVML_ERROR_NO_PERMISSION)
        try:
            events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            if nvml_error_code(e) not in quiet:
                raise
            log.info("XID events unavailable: %s", e)
            return
        registered = 0
        for state in self._states:
            try:
                nv.nvmlDeviceRegisterEvents(
                    state.identity.handle, nv.nvmlEventTypeXidCriticalError, events
                )
            except nv.NVMLError as e:
                if nvml_error_code(e) not in quiet:
                    nv.nvmlEventSetFree(events)
                    raise
                log.info("XID events unavailable on GPU %d: %s", state.identity.index, e)
                continue
            registered += 1
        if not registered:
            nv.nvmlEventSetFree(events)
            return
        try:
            nv.nvmlInit()  # the watcher's own reference: it outlives close() by one wait
        except nv.NVMLError as e:
            nv.nvmlEventSetFree(events)
            log.info("XID events unavailable: %s", e)
            return
        self._events_stop = stop = threading.Event()
        self._events_thread = threading.Thread(
            target=self._watch_events, args=(events, stop), name="nvml-xid-events", daemon=True
        )
        self._events_thread.start()

    async def close(self) -> None:
        """Wait for a read in flight, stop the XID watcher, free GPM samples, shut NVML down."""
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait({self._inflight})
        await asyncio.to_thread(self._shutdown_sync)

    def _shutdown_sync(self) -> None:
        nv = self.nvml
        self._events_thread = None
        self._events_stop.set()  # the watcher frees its event set when its wait returns
        for state in self._states:
            if state.gpm is not None:
                for sample in state.gpm.samples:
                    self._quietly(nv.nvmlGpmSampleFree, sample)
        self._states, self._by_uuid, self._by_handle, self.gpus = [], {}, {}, []
        if self._initialised:
            self._initialised = False
            nv.nvmlShutdown()

    def _quietly(self, call: Callable[[Any], Any], argument: Any) -> None:
        try:
            call(argument)
        except self.nvml.NVMLError as e:
            log.debug("NVML cleanup call %s failed: %s", getattr(call, "__name__", call), e)

    # -- reading --------------------------------------------------------------------------------

    async def read(self) -> list[Reading]:
        """One sample of every GPU; raises NvmlSourceError when NVML fails."""
        if self._inflight is not None and not self._inflight.done():
            raise SourceError("previous NVML read still running")
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(self._read_sync), name="nvml-read"
        )
        task.add_done_callback(_retrieve)
        self._inflight = task
        return await asyncio.shield(task)

    def _read_sync(self) -> list[Reading]:
        out: list[Reading] = []
        for state in self._states:
            try:
                self._read_gpu(state, out)
            except SourceError:
                state.forget_sampling()
                raise
        with self._xid_lock:
            out.extend(
                Reading(XID_ERRORS, float(count), labels, Kind.COUNTER)
                for labels, count in self._xids.values()
            )
        return out

    def _call(self, gpu: GpuIdentity, what: str, call: Callable[..., Any], *args: Any) -> Any:
        """Run one NVML call; None when the device or driver does not support it.

        A failure raises NvmlSourceError naming the GPU, ``what`` and the call's arguments
        after the handle.
        """
        try:
            return call(*args)
        except self._nvml_error as e:
            return self._failed(gpu, what, self._unsupported, args, e)

    def _call_or_none(
        self,
        gpu: GpuIdentity,
        what: str,
        absent: tuple[int, ...],
        call: Callable[..., Any],
        *args: Any,
    ) -> Any:
        """:meth:`_call`, with ``absent`` the error codes that mean "not supported"."""
        try:
            return call(*args)
        except self._nvml_error as e:
            return self._failed(gpu, what, absent, args, e)

    @staticmethod
    def _failed(
        gpu: GpuIdentity, what: str, absent: tuple[int, ...], args: tuple[Any, ...], e: Exception
    ) -> None:
        """None for an error code in ``absent``; else raise NvmlSourceError naming the call."""
        code = nvml_error_code(e)
        if code in absent:
            return None
        detail = f" {list(args[1:])}" if len(args) > 1 else ""
        raise NvmlSourceError(f"GPU {gpu.index} ({gpu.uuid}): {what}{detail}: {e}", code) from e

    def _read_gpu(self, state: _GpuState, out: list[Reading]) -> None:
        nv, gpu = self.nvml, state.identity
        h, labels = gpu.handle, state.labels
        out.append(Reading(GPU_INFO, 1.0, state.info, Kind.INFO))

        def gauge(name: str, value: float, at: Mapping[str, str] = labels) -> None:
            out.append(Reading(name, float(value), at))

        def counter(name: str, value: float, at: Mapping[str, str] = labels) -> None:
            out.append(Reading(name, float(value), at, Kind.COUNTER))

        util = self._call(gpu, "utilization", nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            gauge(UTILIZATION, util.gpu / 100)
            gauge(MEMORY_UTILIZATION, util.memory / 100)
        self._read_gpm(state, gauge)
        memory = self._call(gpu, "memory", nv.nvmlDeviceGetMemoryInfo, h)
        if memory is not None:
            gauge(MEMORY_USED, memory.used)
            gauge(MEMORY_TOTAL, memory.total)
        power_mw = self._call(gpu, "power", nv.nvmlDeviceGetPowerUsage, h)
        if power_mw is not None:
            gauge(POWER, power_mw / 1000)
        limit_mw = self._call(gpu, "power limit", nv.nvmlDeviceGetEnforcedPowerLimit, h)
        if limit_mw is not None:
            gauge(POWER_LIMIT, limit_mw / 1000)
        now = self._clock()
        health_due = now - state.health_at >= self.health_interval_s
        if health_due:
            state.power_bounds = self._call(
                gpu, "power limit constraints", nv.nvmlDeviceGetPowerManagementLimitConstraints, h
            )
        bounds = state.power_bounds
        if bounds is not None:
            gauge(POWER_LIMIT_MIN, bounds[0] / 1000)
            gauge(POWER_LIMIT_MAX, bounds[1] / 1000)
        energy_mj = self._call(gpu, "energy", nv.nvmlDeviceGetTotalEnergyConsumption, h)
        if energy_mj is not None:
            counter(ENERGY, energy_mj / 1000)
        temp = self._call(
            gpu, "temperature", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU
        )
        if temp is not None:
            gauge(TEMPERATURE, temp)
        for name, clock in ((SM_CLOCK, nv.NVML_CLOCK_SM), (MEMORY_CLOCK, nv.NVML_CLOCK_MEM)):
            mhz = self._call(gpu, "clock", nv.nvmlDeviceGetClockInfo, h, clock)
            if mhz is not None:
                gauge(name, mhz * 1e6)
        self._read_fields(state, out)
        self._read_throttle(state, counter)
        if health_due:
            first = len(out)
            self._read_memory_health(state, gauge, counter)
            state.health = out[first:]
            state.health_at = now
        else:
            out.extend(state.health)
        self._read_pcie(state, gauge, counter)
        self._read_nvlink(state, gauge, counter)
        self._read_mig(state, out)

    def _read_gpm(self, state: _GpuState, gauge: Callable[..., None]) -> None:
        nv, gpu, gpm = self.nvml, state.identity, state.gpm
        if gpm is None:
            return
        target = 1 if gpm.latest == 0 else 0
        if not self._call(gpu, "GPM sample", nv.nvmlGpmSampleGet, gpu.handle, gpm.samples[target]):
            gpm.latest = None
            return
        if gpm.latest is not None:
            gpm.request.sample1 = gpm.samples[gpm.latest]
            gpm.request.sample2 = gpm.samples[target]
            if self._call(gpu, "GPM metrics", nv.nvmlGpmMetricsGet, gpm.request) is not None:
                for i, (name, _) in enumerate(self._gpm_metrics):
                    metric = gpm.request.metrics[i]
                    value = metric.value
                    if metric.nvmlReturn == nv.NVML_SUCCESS and math.isfinite(value) and value >= 0:
                        gauge(name, min(value / 100, 1.0))
        gpm.latest = target

    def _read_fields(self, state: _GpuState, out: list[Reading]) -> None:
        """Memory temperature and NVLink traffic: one nvmlDeviceGetFieldValues per GPU."""
        nv, gpu = self.nvml, state.identity
        values = self._call(
            gpu, "field values", nv.nvmlDeviceGetFieldValues, gpu.handle, state.fields
        )
        if values is None:
            return
        for value, (name, labels, kind, scale) in zip(values, state.field_targets, strict=False):
            code = value.nvmlReturn
            if code != nv.NVML_SUCCESS:
                if code in self._unknown_id:
                    continue
                raise NvmlSourceError(
                    f"GPU {gpu.index} ({gpu.uuid}): field {value.fieldId}: NVML error {code}", code
                )
            member = self._field_value.get(value.valueType)
            if member is None:
                log.debug("GPU %d field %d: unknown value type", gpu.index, value.fieldId)
                continue
            number = float(getattr(value.value, member))
            if math.isfinite(number):
                out.append(Reading(name, number * scale, labels, kind))

    def _read_throttle(self, state: _GpuState, counter: Callable[..., None]) -> None:
        nv, gpu = self.nvml, state.identity
        counted: set[str] = set()
        state.reads += 1
        skipped = state.unsupported_violations
        if state.reads % UNSUPPORTED_RETRY_READS == 0:
            skipped.clear()
        for reason, policy in self._violations:
            if policy in skipped:
                continue
            violation = self._call_or_none(
                gpu,
                "violation status",
                self._unknown_id,
                nv.nvmlDeviceGetViolationStatus,
                gpu.handle,
                policy,
            )
            if violation is None:
                skipped.add(policy)
            else:
                counted.add(reason)
                counter(THROTTLE, violation.violationTime / 1e9, state.labelled("reason", reason))
        mask = self._clock_event_reasons(gpu)
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
            if code in self._unsupported:
                return None
            raise NvmlSourceError(
                f"GPU {gpu.index} ({gpu.uuid}): clock event reasons: {e}", code
            ) from e

    def _read_memory_health(
        self, state: _GpuState, gauge: Callable[..., None], counter: Callable[..., None]
    ) -> None:
        nv, gpu = self.nvml, state.identity
        h = gpu.handle
        for name, scope in (
            (ECC_ERRORS, nv.NVML_VOLATILE_ECC),
            (ECC_LIFETIME_ERRORS, nv.NVML_AGGREGATE_ECC),
        ):
            for error_type, kind in self._ecc:
                count = self._call(
                    gpu, "ECC error count", nv.nvmlDeviceGetTotalEccErrors, h, kind, scope
                )
                if count is not None:
                    counter(name, count, state.labelled("type", error_type))
        for cause, source in self._retirement:
            pages = self._call(gpu, "retired pages", nv.nvmlDeviceGetRetiredPages, h, source)
            if pages is not None:
                gauge(RETIRED_PAGES, len(pages), state.labelled("cause", cause))
        pending = self._call(
            gpu, "retired pages pending", nv.nvmlDeviceGetRetiredPagesPendingStatus, h
        )
        if pending is not None:
            gauge(RETIRED_PAGES_PENDING, 1.0 if pending == nv.NVML_FEATURE_ENABLED else 0.0)
        rows = self._call(gpu, "remapped rows", nv.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            correctable, uncorrectable, rows_pending, rows_failed = rows
            gauge(REMAPPED_ROWS, correctable, state.labelled("cause", "correctable"))
            gauge(REMAPPED_ROWS, uncorrectable, state.labelled("cause", "uncorrectable"))
            gauge(REMAPPED_ROWS_PENDING, 1.0 if rows_pending else 0.0)
            gauge(REMAPPED_ROWS_FAILED, 1.0 if rows_failed else 0.0)

    def _read_pcie(
        self, state: _GpuState, gauge: Callable[..., None], counter: Callable[..., None]
    ) -> None:
        nv, gpu = self.nvml, state.identity
        for direction, which in (
            ("tx", nv.NVML_PCIE_UTIL_TX_BYTES),
            ("rx", nv.NVML_PCIE_UTIL_RX_BYTES),
        ):
            kb_per_s = self._call(
                gpu, "PCIe throughput", nv.nvmlDeviceGetPcieThroughput, gpu.handle, which
            )
            if kb_per_s is not None:
                gauge(PCIE_THROUGHPUT, kb_per_s * 1024, state.labelled("direction", direction))
        replays = self._call(gpu, "PCIe replays", nv.nvmlDeviceGetPcieReplayCounter, gpu.handle)
        if replays is not None:
            counter(PCIE_REPLAYS, replays)

    def _read_nvlink(
        self, state: _GpuState, gauge: Callable[..., None], counter: Callable[..., None]
    ) -> None:
        nv, gpu = self.nvml, state.identity
        for link in state.links:
            up = self._call(
                gpu, "NVLink state", nv.nvmlDeviceGetNvLinkState, gpu.handle, link.number
            )
            if up is not None:
                gauge(NVLINK_UP, 1.0 if up == nv.NVML_FEATURE_ENABLED else 0.0, link.labels)
            for error_type, which in self._nvlink_errors:
                count = self._call_or_none(
                    gpu,
                    "NVLink error counter",
                    self._unknown_id,
                    nv.nvmlDeviceGetNvLinkErrorCounter,
                    gpu.handle,
                    link.number,
                    which,
                )
                if count is not None:
                    counter(NVLINK_ERRORS, count, link.errors[error_type])

    def _read_mig(self, state: _GpuState, out: list[Reading]) -> None:
        nv, gpu = self.nvml, state.identity
        mode = self._call(gpu, "MIG mode", nv.nvmlDeviceGetMigMode, gpu.handle)
        if mode is None or mode[0] != nv.NVML_DEVICE_MIG_ENABLE:
            state.mig_slots = None
            state.mig = {}
            return
        if state.mig_slots is None:
            slots = self._call(
                gpu, "MIG device count", nv.nvmlDeviceGetMaxMigDeviceCount, gpu.handle
            )
            state.mig_slots = slots or 0
        empty = (*self._unsupported, nv.NVML_ERROR_NOT_FOUND, nv.NVML_ERROR_INVALID_ARGUMENT)
        seen: dict[tuple[int, str], _Mig] = {}
        for slot in range(state.mig_slots):
            handle = self._call_or_none(
                gpu, "MIG device", empty, nv.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, slot
            )
            if handle is None:
                continue
            uuid = self._call(gpu, "MIG device UUID", nv.nvmlDeviceGetUUID, handle)
            key = (slot, _text(uuid) if uuid is not None else "")
            mig = state.mig.get(key) or self._mig_identity(state, key[1], handle)
            seen[key] = mig
            out.append(Reading(MIG_INFO, 1.0, mig.info, Kind.INFO))
            memory = self._call(gpu, "MIG device memory", nv.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                out.append(Reading(MIG_MEMORY_USED, float(memory.used), mig.labels))
                out.append(Reading(MIG_MEMORY_TOTAL, float(memory.total), mig.labels))
        state.mig = seen

    def _mig_identity(self, state: _GpuState, uuid: str, handle: Any) -> _Mig:
        """Labels of a MIG device, read once per (slot, MIG UUID)."""
        nv, gpu = self.nvml, state.identity
        gi = self._call(gpu, "MIG GPU instance", nv.nvmlDeviceGetGpuInstanceId, handle)
        ci = self._call(gpu, "MIG compute instance", nv.nvmlDeviceGetComputeInstanceId, handle)
        name = self._call(gpu, "MIG device name", nv.nvmlDeviceGetName, handle)
        labels = {
            **state.labels,
            "gi": "" if gi is None else str(gi),
            "ci": "" if ci is None else str(ci),
        }
        profile = mig_profile(_text(name)) if name is not None else ""
        return _Mig({**labels, "mig_uuid": uuid, "profile": profile}, labels)

    # -- XID events -----------------------------------------------------------------------------

    def _watch_events(self, events: Any, stop: threading.Event) -> None:
        """Count XID events until ``stop``; then free the event set and drop the watcher's NVML
        reference (close() does not wait for the wait in progress)."""
        nv = self.nvml
        last_problem = ""
        try:
            while not stop.is_set():
                try:
                    event = nv.nvmlEventSetWait_v2(events, self.event_wait_ms)
                except nv.NVMLError as e:
                    if nvml_error_code(e) == nv.NVML_ERROR_TIMEOUT:
                        continue
                    if str(e) != last_problem:
                        log.warning("waiting for NVML events failed: %s", e)
                        last_problem = str(e)
                    stop.wait(1.0)
                    continue
                except Exception:
                    log.exception("the NVML event watcher failed; retrying")
                    stop.wait(1.0)
                    continue
                last_problem = ""
                if event.eventType & nv.nvmlEventTypeXidCriticalError and not stop.is_set():
                    self._count_xid(event)
        finally:
            self._quietly(nv.nvmlEventSetFree, events)
            try:
                nv.nvmlShutdown()
            except nv.NVMLError as e:
                log.debug("NVML shutdown of the event watcher failed: %s", e)

    def _count_xid(self, event: Any) -> None:
        """Count an XID event, finding its GPU by handle (no NVML call: it may be lost)."""
        nv = self.nvml
        state = self._by_handle.get(handle_key(event.device))
        if state is None:
            try:
                state = self._by_uuid.get(_text(nv.nvmlDeviceGetUUID(event.device)))
            except nv.NVMLError as e:
                log.warning("XID %s on a GPU NVML cannot name: %s", event.eventData, e)
                return
        if state is None:
            log.warning("XID %s on a GPU this source did not enumerate", event.eventData)
            return
        xid = int(event.eventData)
        key = (state.identity.index, xid)
        log.warning("XID %d on GPU %d (%s)", xid, state.identity.index, state.identity.uuid)
        with self._xid_lock:
            found = self._xids.get(key)
            if found is None:
                self._xids[key] = ({**state.labels, "xid": str(xid)}, 1)
            else:
                self._xids[key] = (found[0], found[1] + 1)

    # -- for the agent --------------------------------------------------------------------------

    def xid_counts(self) -> dict[tuple[int, int], int]:
        """XID events counted since ``start()``, by (GPU index, XID)."""
        with self._xid_lock:
            return {key: count for key, (_, count) in self._xids.items()}

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


def _retrieve(task: asyncio.Task[list[Reading]]) -> None:
    """Mark the outcome of a read as seen, for reads whose caller stopped waiting."""
    if not task.cancelled():
        task.exception()

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

import ctypes
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

from hyperagent.devices.base import MJ_PER_J, MW_PER_W, NS_PER_S
from hyperagent.devices.metrics import (
    DRAM_ACTIVE,
    ECC_ERRORS,
    ECC_LIFETIME_ERRORS,
    ENERGY,
    GPU_INFO,
    MEMORY_CLOCK,
    MEMORY_TEMPERATURE,
    MEMORY_TOTAL,
    MEMORY_USED,
    MEMORY_UTILIZATION,
    MIG_INFO,
    MIG_MEMORY_TOTAL,
    MIG_MEMORY_USED,
    NVLINK_DATA,
    NVLINK_ERRORS,
    NVLINK_UP,
    PCIE_REPLAYS,
    PCIE_THROUGHPUT,
    POWER,
    POWER_INSTANT,
    POWER_LIMIT,
    POWER_LIMIT_MAX,
    POWER_LIMIT_MIN,
    REMAPPED_ROWS,
    REMAPPED_ROWS_FAILED,
    REMAPPED_ROWS_PENDING,
    RETIRED_PAGES,
    RETIRED_PAGES_PENDING,
    SM_ACTIVE,
    SM_CLOCK,
    SM_OCCUPANCY,
    TEMPERATURE,
    TENSOR_ACTIVE,
    THROTTLE,
    UTILIZATION,
    XID_ERRORS,
)
from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)


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


_VIOLATION_FIELDS = {
    "sw_power_cap": "NVML_FI_DEV_PERF_POLICY_POWER",
    "sync_boost": "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST",
    "thermal": "NVML_FI_DEV_PERF_POLICY_THERMAL",
    "board_limit": "NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT",
    "low_utilization": "NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION",
    "reliability": "NVML_FI_DEV_PERF_POLICY_RELIABILITY",
    "total_app_clocks": "NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS",
    "total_base_clocks": "NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS",
}
"""The field (nvmlDeviceGetFieldValues, ns like nvmlViolationTime_t) of each perf policy."""


def field_id(nv: Any, name: str) -> int | None:
    """The NVML field id ``name`` (``NVML_FI_...``) where this nvidia-ml-py defines it."""
    value = getattr(nv, name, None)
    return value if isinstance(value, int) else None


def violation_fields(nv: Any) -> tuple[tuple[str, int, int | None], ...]:
    """(reason label, perf policy, field id or None) of every counted throttle reason."""
    return tuple(
        (reason, policy, field_id(nv, _VIOLATION_FIELDS[reason]))
        for reason, policy in violation_policies(nv)
    )


_VALUE_TYPES = (
    ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),  # not in nvidia-ml-py 12.535
)


def value_members(nv: Any) -> dict[int, str]:
    """The ``nvmlValue_t`` member that holds each NVML value type this nvidia-ml-py knows."""
    return {getattr(nv, name): member for name, member in _VALUE_TYPES if hasattr(nv, name)}


def field_number(value: Any, members: Mapping[int, str]) -> float | None:
    """The number a successful ``c_nvmlFieldValue_t`` holds; None for an unknown value type
    or a value that is not finite."""
    member = members.get(value.valueType)
    if member is None:
        return None
    number = float(getattr(value.value, member))
    return number if math.isfinite(number) else None


def plain_layout(struct: Any) -> Any:
    """A ctypes struct with ``struct``'s fields and none of pynvml's Python-level attribute
    hooks (each read through them is a Python call), to read an array of them in place; None
    when ``struct`` has no ctypes fields."""
    fields = getattr(struct, "_fields_", None)
    if fields is None:
        return None
    return type(f"Plain{struct.__name__}", (ctypes.Structure,), {"_fields_": fields})


def instant_power_w(nv: Any, handle: Any) -> float | None:
    """The board's power at this moment (NVML_FI_DEV_POWER_INSTANT, GPU scope), in watts; None
    where the GPU or driver does not report it. Raises pynvml.NVMLError when the call fails."""
    instant = field_id(nv, "NVML_FI_DEV_POWER_INSTANT")
    if instant is None:
        return None
    scope = getattr(nv, "NVML_POWER_SCOPE_GPU", 0)
    value = nv.nvmlDeviceGetFieldValues(handle, [(instant, scope)])[0]
    if value.nvmlReturn != nv.NVML_SUCCESS:
        return None
    milliwatts = field_number(value, value_members(nv))
    return None if milliwatts is None else milliwatts / MW_PER_W


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


def _violation_ns(nv: Any, policy: int, handle: Any) -> int:
    return int(nv.nvmlDeviceGetViolationStatus(handle, policy).violationTime)


def _ecc_total(nv: Any, error_type: int, counter: int, handle: Any) -> int:
    return int(nv.nvmlDeviceGetTotalEccErrors(handle, error_type, counter))


def _retired_pages(nv: Any, cause: int, handle: Any) -> int:
    return len(nv.nvmlDeviceGetRetiredPages(handle, cause))


def _retired_pending(nv: Any, handle: Any) -> float:
    pending = nv.nvmlDeviceGetRetiredPagesPendingStatus(handle)
    return 1.0 if pending == nv.NVML_FEATURE_ENABLED else 0.0


def _remapped_rows(nv: Any, position: int, handle: Any) -> float:
    """One of (correctable, uncorrectable, pending, failed) of nvmlDeviceGetRemappedRows."""
    value = nv.nvmlDeviceGetRemappedRows(handle)[position]
    return float(value) if position < 2 else (1.0 if value else 0.0)


def _limit_constraint(nv: Any, position: int, handle: Any) -> int:
    """The lowest (0) or highest (1) power limit the device accepts, mW."""
    return int(nv.nvmlDeviceGetPowerManagementLimitConstraints(handle)[position])


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


@dataclass(frozen=True)
class _Field:
    """One value of an nvmlDeviceGetFieldValues batch and the reading it becomes."""

    key: tuple[int, int]
    """(field id, scope id): the scope is the link for NVLink fields, the power scope for power
    fields (0: the GPU alone), 0 for the rest."""
    name: str
    labels: Mapping[str, str]
    kind: Kind = Kind.GAUGE
    per: float = 1.0
    """NVML's units (mW, mJ, ns, KiB, ...) per unit of the metric: the value is divided by it."""
    legacy: Callable[[Any], Any] | None = None
    """The older call that gives the same value in the same unit from the device handle, for a
    driver that does not know the field id."""
    what: str = "field"
    """What the value is, for error messages."""


@dataclass
class _Batch:
    """Fields read together in one nvmlDeviceGetFieldValues, and what the GPU's answers so far
    leave to ask: the fields it did not refuse, and the legacy calls of those it did not know
    (kept until its ``_GpuState.epoch`` moves)."""

    fields: list[_Field]
    asked: list[_Field] = field(default_factory=list)
    keys: list[tuple[int, int]] = field(default_factory=list)
    legacy: list[_Field] = field(default_factory=list)
    epoch: int = -1


UNSUPPORTED_RETRY_READS = 300
"""Reads between two tries of a field or call the GPU said it does not support (5 minutes at
1 Hz)."""


@dataclass
class _GpuState:
    """What the read thread keeps per GPU: labels built once, links, and sampling state."""

    identity: GpuIdentity
    labels: dict[str, str]
    info: dict[str, str]
    by_label: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    links: tuple[_Link, ...] = ()
    fast: _Batch = field(default_factory=lambda: _Batch([]))
    """Fields read every cycle, in one nvmlDeviceGetFieldValues."""
    health_fields: _Batch = field(default_factory=lambda: _Batch([]))
    """Fields read every health interval, in one nvmlDeviceGetFieldValues."""
    violations: tuple[tuple[str, tuple[int, int]], ...] = ()
    """(reason, field key) of the throttle reasons NVML counts itself."""
    unknown: set[tuple[int, int]] = field(default_factory=set)
    """Fields the GPU answered "not supported" (or whose id the driver does not know): left
    out of the batch, read through their legacy call if they have one, asked again every
    ``UNSUPPORTED_RETRY_READS`` reads (a driver update or a MIG change may add them)."""
    no_legacy: set[tuple[int, int]] = field(default_factory=set)
    """Unknown fields whose legacy call is not supported either."""
    epoch: int = 0
    """Moves on whenever ``unknown`` or ``no_legacy`` change."""
    refused_counters: set[tuple[int, int]] = field(default_factory=set)
    """(link, NVML_NVLINK_ERROR_*) NVLink error counters the GPU does not support."""
    gpm: _Gpm | None = None
    reasons_seen_at: float | None = None
    integrated_s: dict[str, float] = field(default_factory=dict)
    mig_slots: int | None = None
    mig: dict[tuple[int, str], _Mig] = field(default_factory=dict)
    mig_unsupported: bool = False
    """The GPU answered "not supported" to nvmlDeviceGetMigMode (a GPU without MIG): not asked
    again until the retry read."""
    slow: list[Reading] = field(default_factory=list)
    """The last slow readings, repeated until ``slow_at`` + the slow interval."""
    slow_at: float = -math.inf
    health: list[Reading] = field(default_factory=list)
    """The last health readings, repeated until ``health_at`` + the health interval."""
    health_at: float = -math.inf
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

    def refused(self, key: tuple[int, int], legacy_too: bool = False) -> None:
        """The GPU does not support (or know) field ``key``; with ``legacy_too``, nor the
        field's legacy call."""
        (self.no_legacy if legacy_too else self.unknown).add(key)
        self.epoch += 1

    def retry_refused(self) -> None:
        """Ask again everything the GPU refused."""
        self.unknown.clear()
        self.no_legacy.clear()
        self.refused_counters.clear()
        self.mig_unsupported = False
        self.epoch += 1

    def forget_sampling(self) -> None:
        """Drop two-sample and repeated state after a failed read, so an outage is not
        integrated and the next read asks everything again."""
        self.reasons_seen_at = None
        self.health_at = self.slow_at = -math.inf
        if self.gpm is not None:
            self.gpm.latest = None


def _refresh(batch: _Batch, state: _GpuState) -> None:
    """Bring ``batch``'s asked fields and legacy calls up to what ``state`` knows."""
    if batch.epoch == state.epoch:
        return
    unknown, no_legacy = state.unknown, state.no_legacy
    batch.asked = [f for f in batch.fields if f.key not in unknown]
    batch.keys = [f.key for f in batch.asked]
    batch.legacy = [
        f
        for f in batch.fields
        if f.legacy is not None and f.key in unknown and f.key not in no_legacy
    ]
    batch.epoch = state.epoch


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
        self.event_wait_ms = event_wait_ms
        self._clock = clock
        self._initialised = False
        self._states: list[_GpuState] = []
        self._by_handle: dict[Any, _GpuState] = {}
        self._by_uuid: dict[str, _GpuState] = {}
        self._nvml_error: type[Exception] = nv.NVMLError
        self._unsupported = (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND)
        self._unknown_id = (*self._unsupported, nv.NVML_ERROR_INVALID_ARGUMENT)
        self._violations = violation_fields(nv)
        self._reason_bits = clock_event_reason_bits(nv)
        self._nvlink_errors = nvlink_error_counters(nv)
        self._gpm_metrics = gpm_metrics(nv)
        self._field_value = value_members(nv)
        self._plain_field = plain_layout(nv.c_nvmlFieldValue_t)
        power_scope = getattr(nv, "NVML_POWER_SCOPE_GPU", 0)
        average = field_id(nv, "NVML_FI_DEV_POWER_AVERAGE")
        instant = field_id(nv, "NVML_FI_DEV_POWER_INSTANT")
        self._power_average = None if average is None else (average, power_scope)
        self._power_instant = None if instant is None else (instant, power_scope)
        self._reasons_call: Callable[[Any], int] = nv.nvmlDeviceGetCurrentClocksEventReasons
        self._events_stop = threading.Event()
        self.events_thread: threading.Thread | None = None
        self._xid_lock = threading.Lock()
        self._xids: dict[tuple[int, int], tuple[dict[str, str], int]] = {}

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
            self.shutdown()
            raise NvmlSourceError(f"enumerating GPUs failed: {e}", nvml_error_code(e)) from e
        except BaseException:
            self.shutdown()
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
        links = []
        for number in self._probe_links(identity):
            link_labels = {**labels, "link": str(number)}
            errors = {kind: {**link_labels, "type": kind} for kind, _ in self._nvlink_errors}
            links.append(_Link(number, link_labels, errors))
        state.links = tuple(links)
        state.fast = _Batch(self._fast_fields(state))
        state.health_fields = _Batch(self._health_fields(state))
        state.violations = tuple(
            (reason, (fid, 0)) for reason, _, fid in self._violations if fid is not None
        )
        return state

    def _fast_fields(self, state: _GpuState) -> list[_Field]:
        """The fields read every cycle: power, energy, enforced limit, memory temperature, PCIe
        replays, NVML's throttle counters, NVLink traffic."""
        nv, labels = self.nvml, state.labels
        fields: list[_Field] = []

        def add(what: str, key: tuple[int | None, int], metric: str, **how: Any) -> None:
            if key[0] is not None:
                at = how.pop("at", labels)
                fields.append(_Field((key[0], key[1]), metric, at, what=what, **how))

        if self._power_average is not None:
            fields.append(_Field(self._power_average, POWER, labels, per=MW_PER_W, what="power"))
        if self._power_instant is not None:
            instant = _Field(self._power_instant, POWER_INSTANT, labels, per=MW_PER_W, what="power")
            fields.append(instant)
        add(
            "energy",
            (field_id(nv, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"), 0),
            ENERGY,
            kind=Kind.COUNTER,
            per=MJ_PER_J,
            legacy=nv.nvmlDeviceGetTotalEnergyConsumption,
        )
        add(
            "power limit",
            (
                field_id(nv, "NVML_FI_DEV_POWER_CURRENT_LIMIT"),
                getattr(nv, "NVML_POWER_SCOPE_GPU", 0),
            ),
            POWER_LIMIT,
            per=MW_PER_W,
            legacy=nv.nvmlDeviceGetEnforcedPowerLimit,
        )
        add("memory temperature", (field_id(nv, "NVML_FI_DEV_MEMORY_TEMP"), 0), MEMORY_TEMPERATURE)
        add(
            "PCIe replays",
            (field_id(nv, "NVML_FI_DEV_PCIE_REPLAY_COUNTER"), 0),
            PCIE_REPLAYS,
            kind=Kind.COUNTER,
            legacy=nv.nvmlDeviceGetPcieReplayCounter,
        )
        for reason, policy, fid in self._violations:
            add(
                "violation status",
                (fid, 0),
                THROTTLE,
                at=state.labelled("reason", reason),
                kind=Kind.COUNTER,
                per=NS_PER_S,
                legacy=partial(_violation_ns, nv, policy),
            )
        for link in state.links:
            for direction, name in (
                ("tx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"),
                ("rx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"),
            ):
                add(
                    "NVLink traffic",
                    (field_id(nv, name), link.number),
                    NVLINK_DATA,
                    at={**link.labels, "direction": direction},
                    kind=Kind.COUNTER,
                    per=1 / 1024,
                )
        return fields

    def _health_fields(self, state: _GpuState) -> list[_Field]:
        """The fields read every health interval: ECC counts, retired pages, remapped rows,
        the power limit range."""
        nv, labels = self.nvml, state.labels
        fields: list[_Field] = []

        def add(name: str, metric: str, at: Mapping[str, str], legacy: Any, **how: Any) -> None:
            fid = field_id(nv, name)
            if fid is not None:
                what = name.removeprefix("NVML_FI_DEV_").lower().replace("_", " ")
                fields.append(_Field((fid, 0), metric, at, legacy=legacy, what=what, **how))

        corrected, uncorrected = (
            nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        )
        for name, metric, error_type, kind, scope in (
            ("ECC_SBE_VOL_TOTAL", ECC_ERRORS, "corrected", corrected, nv.NVML_VOLATILE_ECC),
            ("ECC_DBE_VOL_TOTAL", ECC_ERRORS, "uncorrected", uncorrected, nv.NVML_VOLATILE_ECC),
            (
                "ECC_SBE_AGG_TOTAL",
                ECC_LIFETIME_ERRORS,
                "corrected",
                corrected,
                nv.NVML_AGGREGATE_ECC,
            ),
            (
                "ECC_DBE_AGG_TOTAL",
                ECC_LIFETIME_ERRORS,
                "uncorrected",
                uncorrected,
                nv.NVML_AGGREGATE_ECC,
            ),
        ):
            add(
                f"NVML_FI_DEV_{name}",
                metric,
                state.labelled("type", error_type),
                partial(_ecc_total, nv, kind, scope),
                kind=Kind.COUNTER,
            )
        for name, cause, source in (
            (
                "RETIRED_SBE",
                "single_bit_ecc",
                nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            ),
            ("RETIRED_DBE", "double_bit_ecc", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
        ):
            add(
                f"NVML_FI_DEV_{name}",
                RETIRED_PAGES,
                state.labelled("cause", cause),
                partial(_retired_pages, nv, source),
            )
        add(
            "NVML_FI_DEV_RETIRED_PENDING",
            RETIRED_PAGES_PENDING,
            labels,
            partial(_retired_pending, nv),
        )
        for position, (name, metric, at) in enumerate(
            (
                ("REMAPPED_COR", REMAPPED_ROWS, state.labelled("cause", "correctable")),
                ("REMAPPED_UNC", REMAPPED_ROWS, state.labelled("cause", "uncorrectable")),
                ("REMAPPED_PENDING", REMAPPED_ROWS_PENDING, labels),
                ("REMAPPED_FAILURE", REMAPPED_ROWS_FAILED, labels),
            )
        ):
            add(f"NVML_FI_DEV_{name}", metric, at, partial(_remapped_rows, nv, position))
        for position, (name, metric) in enumerate(
            (("POWER_MIN_LIMIT", POWER_LIMIT_MIN), ("POWER_MAX_LIMIT", POWER_LIMIT_MAX))
        ):
            add(
                f"NVML_FI_DEV_{name}",
                metric,
                labels,
                partial(_limit_constraint, nv, position),
                per=MW_PER_W,
            )
        return fields

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
        self.events_thread = threading.Thread(
            target=self._watch_events, args=(events, stop), name="nvml-xid-events", daemon=True
        )
        self.events_thread.start()

    def shutdown(self) -> None:
        """Stop the XID watcher, free GPM samples, shut NVML down."""
        nv = self.nvml
        self.events_thread = None
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
        state.reads += 1
        if state.reads % UNSUPPORTED_RETRY_READS == 0:
            state.retry_refused()

        def gauge(name: str, value: float, at: Mapping[str, str] = labels) -> None:
            out.append(Reading(name, float(value), at))

        def counter(name: str, value: float, at: Mapping[str, str] = labels) -> None:
            out.append(Reading(name, float(value), at, Kind.COUNTER))

        util = self._call(gpu, "utilization", nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            gauge(UTILIZATION, util.gpu / 100)
            gauge(MEMORY_UTILIZATION, util.memory / 100)
        self._read_gpm(state, gauge)
        got = self._read_fields(state, state.fast, out)
        self._read_power(state, got, gauge)
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
            self._read_fields(state, state.health_fields, out)
            self._read_nvlink(state, gauge, counter)
            state.health = out[first:]
            state.health_at = now
        else:
            out.extend(state.health)

    def _read_fields(
        self, state: _GpuState, batch: _Batch, out: list[Reading]
    ) -> dict[tuple[int, int], float]:
        """``batch`` in one nvmlDeviceGetFieldValues (the fields the GPU did not refuse before),
        then the legacy call of those it does not know; returns the values read, by key."""
        nv, gpu = self.nvml, state.identity
        got: dict[tuple[int, int], float] = {}
        _refresh(batch, state)
        asked, values = batch.asked, None
        if asked:
            values = self._call(
                gpu, "field values", nv.nvmlDeviceGetFieldValues, gpu.handle, batch.keys
            )
            if values is None:  # a driver without field values at all
                for wanted in asked:
                    state.refused(wanted.key)
            elif self._plain_field is not None:
                try:
                    values = (self._plain_field * len(asked)).from_buffer(values)
                except (TypeError, ValueError):
                    pass  # not a ctypes array: read it as it is
        success, members = nv.NVML_SUCCESS, self._field_value
        for wanted, value in zip(asked, values or (), strict=False):
            code = value.nvmlReturn
            if code != success:
                if code in self._unknown_id:
                    state.refused(wanted.key)
                    continue
                raise NvmlSourceError(
                    f"GPU {gpu.index} ({gpu.uuid}): {wanted.what} (field {value.fieldId}, "
                    f"scope {wanted.key[1]}): NVML error {code}",
                    code,
                )
            number = field_number(value, members)
            if number is None:
                log.debug("GPU %d field %d: unusable value", gpu.index, value.fieldId)
                continue
            got[wanted.key] = number
            out.append(Reading(wanted.name, number / wanted.per, wanted.labels, wanted.kind))
        _refresh(batch, state)
        for wanted in batch.legacy:
            assert wanted.legacy is not None  # _refresh keeps only those with one
            raw = self._call_or_none(gpu, wanted.what, self._unknown_id, wanted.legacy, gpu.handle)
            if raw is None:
                state.refused(wanted.key, legacy_too=True)
                continue
            got[wanted.key] = float(raw)
            out.append(Reading(wanted.name, float(raw) / wanted.per, wanted.labels, wanted.kind))
        return got

    def _read_power(
        self, state: _GpuState, got: dict[tuple[int, int], float], gauge: Callable[..., None]
    ) -> None:
        """Board power where the 1 s average is missing: the instant value, as
        nvmlDeviceGetPowerUsage gives it on such GPUs; that call on a driver that knows
        neither field."""
        average, instant = self._power_average, self._power_instant
        if average is not None and average in got:
            return
        if instant is not None and instant in got:
            gauge(POWER, got[instant] / MW_PER_W)
            return
        if instant is not None and instant not in state.unknown:
            return  # asked, but the value was unusable
        marker = average or instant or (-1, 0)
        if marker in state.no_legacy:
            return
        nv, gpu = self.nvml, state.identity
        mw = self._call_or_none(
            gpu, "power", self._unknown_id, nv.nvmlDeviceGetPowerUsage, gpu.handle
        )
        if mw is None:
            state.refused(marker, legacy_too=True)
        else:
            gauge(POWER, mw / MW_PER_W)

    def _read_slow(
        self,
        state: _GpuState,
        gauge: Callable[..., None],
        counter: Callable[..., None],
        out: list[Reading],
    ) -> None:
        """Temperature, memory, clocks, PCIe throughput and MIG devices."""
        nv, gpu = self.nvml, state.identity
        h = gpu.handle
        temp = self._call(
            gpu, "temperature", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU
        )
        if temp is not None:
            gauge(TEMPERATURE, temp)
        memory = self._call(gpu, "memory", nv.nvmlDeviceGetMemoryInfo, h)
        if memory is not None:
            gauge(MEMORY_USED, memory.used)
            gauge(MEMORY_TOTAL, memory.total)
        for name, clock in ((SM_CLOCK, nv.NVML_CLOCK_SM), (MEMORY_CLOCK, nv.NVML_CLOCK_MEM)):
            mhz = self._call(gpu, "clock", nv.nvmlDeviceGetClockInfo, h, clock)
            if mhz is not None:
                gauge(name, mhz * 1e6)
        for direction, which in (
            ("tx", nv.NVML_PCIE_UTIL_TX_BYTES),
            ("rx", nv.NVML_PCIE_UTIL_RX_BYTES),
        ):
            kb_per_s = self._call(gpu, "PCIe throughput", nv.nvmlDeviceGetPcieThroughput, h, which)
            if kb_per_s is not None:
                gauge(PCIE_THROUGHPUT, kb_per_s * 1024, state.labelled("direction", direction))
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

    def _read_throttle(
        self, state: _GpuState, counter: Callable[..., None], counted: set[str]
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
            if code in self._unsupported:
                return None
            raise NvmlSourceError(
                f"GPU {gpu.index} ({gpu.uuid}): clock event reasons: {e}", code
            ) from e

    def _read_nvlink(
        self, state: _GpuState, gauge: Callable[..., None], counter: Callable[..., None]
    ) -> None:
        """Link state and data-link error counters of every NVLink (no field ids cover them
        for every link and driver); a counter the GPU does not support is asked again only on
        the retry read."""
        nv, gpu = self.nvml, state.identity
        for link in state.links:
            up = self._call(
                gpu, "NVLink state", nv.nvmlDeviceGetNvLinkState, gpu.handle, link.number
            )
            if up is not None:
                gauge(NVLINK_UP, 1.0 if up == nv.NVML_FEATURE_ENABLED else 0.0, link.labels)
            for error_type, which in self._nvlink_errors:
                if (link.number, which) in state.refused_counters:
                    continue
                count = self._call_or_none(
                    gpu,
                    "NVLink error counter",
                    self._unknown_id,
                    nv.nvmlDeviceGetNvLinkErrorCounter,
                    gpu.handle,
                    link.number,
                    which,
                )
                if count is None:
                    state.refused_counters.add((link.number, which))
                else:
                    counter(NVLINK_ERRORS, count, link.errors[error_type])

    def _read_mig(self, state: _GpuState, out: list[Reading]) -> None:
        nv, gpu = self.nvml, state.identity
        if state.mig_unsupported:
            return
        mode = self._call(gpu, "MIG mode", nv.nvmlDeviceGetMigMode, gpu.handle)
        if mode is None:
            state.mig_unsupported = True
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

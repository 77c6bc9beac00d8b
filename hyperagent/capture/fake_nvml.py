"""A fake NVML that replays `nvidia-smi` captures or agent recordings behind `pynvml`'s names.

`FakeNvml` stands in for the `pynvml` module: code written against `pynvml` (the nvidia-ml-py
package) runs unchanged when handed an instance, with the same function names, return types,
units (mW, mJ, bytes, KB/s, MHz, percent, ns) and the real `pynvml.NVMLError` subclasses.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pynvml

from hyperagent.capture.nvidia_smi import (
    GpuRecord,
    MigRecord,
    NvLinkRecord,
    RemappedRows,
    parse_capture,
)
from hyperagent.devices import metrics
from hyperagent.devices import nvml_telemetry as telemetry
from hyperagent.readings import Reading

log = logging.getLogger(__name__)

FAULTS_ENV = "HYPERAGENT_FAKE_NVML_FAULTS"
"""Names a JSON file of faults every FakeNvml of the process injects (see `FakeNvml`)."""


class FakeNvmlHandle:
    """An opaque device handle, valid only with the `FakeNvml` instance that made it.

    `mig` is the MIG device slot for a MIG device handle, None for a GPU.
    """

    __slots__ = ("_owner", "index", "mig")

    def __init__(self, owner: FakeNvml, index: int, mig: int | None = None) -> None:
        self._owner = owner
        self.index = index
        self.mig = mig

    def __repr__(self) -> str:
        suffix = "" if self.mig is None else f", mig={self.mig}"
        return f"FakeNvmlHandle(index={self.index}{suffix})"


@dataclass(frozen=True)
class FakeEventData:
    """What `nvmlEventSetWait_v2` returns: the fields of pynvml's `c_nvmlEventData_t`."""

    device: FakeNvmlHandle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


class FakeEventSet:
    """An NVML event set: the devices registered on it and the events not yet waited for."""

    def __init__(self, owner: FakeNvml) -> None:
        self._owner = owner
        self.devices: set[int] = set()
        self.pending: deque[FakeEventData] = deque()
        self.freed = False


@dataclass
class _GpmSample:
    buffer: Any
    device: int | None = None
    values: dict[int, float] = field(default_factory=dict)


@dataclass
class _Device:
    record: GpuRecord
    handle: FakeNvmlHandle
    energy_mj: float
    integrated_to: float
    failure: int | None = None
    mig_handles: dict[int, FakeNvmlHandle] = field(default_factory=dict)
    xid_backlog: list[int] = field(default_factory=list)
    set_limit_w: float | None = None
    """The power limit set through NVML, kept over recorded cycles (which draw under it)."""
    limit_before_w: float | None = None
    """The limit before the last set call, which still holds the draw until ``limit_from``."""
    limit_from: float = -math.inf
    """When (``clock``) the last set limit starts to hold the draw."""
    processes: tuple[int, ...] = ()
    """pids of the compute processes running on the device (none in a capture: its pids are
    another machine's)."""
    instant_w: float | None = None
    """A recorded instant draw (agent recordings have one apart from the 1 s average); None:
    the instant draw is the draw."""

    def draw_w(self, now: float) -> float | None:
        draw, limit = self.record.power_draw_w, self.record.power_limit_w
        if now < self.limit_from:
            limit = self.limit_before_w
        if draw is None or limit is None:
            return draw
        return min(draw, limit)

    def instant_draw_w(self, now: float) -> float | None:
        """The instant draw: the recorded one, held by a limit set through NVML, else the
        draw."""
        if self.instant_w is None:
            return self.draw_w(now)
        limit = self.limit_before_w if now < self.limit_from else self.record.power_limit_w
        if self.set_limit_w is None or limit is None:
            return self.instant_w
        return min(self.instant_w, limit)

    def integrate(self, now: float) -> None:
        draw = self.draw_w(now)
        if draw is not None:
            self.energy_mj += draw * max(0.0, now - self.integrated_to) * 1000.0
        self.integrated_to = max(now, self.integrated_to)

    def mig(self, slot: int) -> MigRecord | None:
        return next((m for m in self.record.mig_devices if m.index == slot), None)


@dataclass
class _Frame:
    """One recording cycle, decoded: records plus what NVML counts rather than reports."""

    records: dict[int, GpuRecord]
    energy_j: dict[int, float]
    integrated_s: dict[int, dict[str, float]]
    xids: dict[int, dict[int, int]]
    instant_w: dict[int, float] = field(default_factory=dict)


_T = TypeVar("_T")


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _supported(value: _T | None) -> _T:
    if value is None:
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return value


def _milli(value: float | None) -> int:
    return round(_supported(value) * 1000)


def _percent_of(ratio: float) -> float:
    """A percentage that NvmlSource's division by 100 turns back into exactly `ratio`."""
    percent = ratio * 100
    for candidate in (percent, math.nextafter(percent, math.inf), math.nextafter(percent, 0.0)):
        if candidate / 100 == ratio:
            return candidate
    return percent


_PROXIED = (
    "NVML_",
    "NVMLError",
    "nvmlMemory_v",
    "nvmlClocksEventReason",
    "nvmlClocksThrottleReason",
    "nvmlEventType",
    "c_nvml",
)
_VIOLATIONS = {policy: reason for reason, policy in telemetry.violation_policies(pynvml)}
_VIOLATION_REASONS = frozenset(_VIOLATIONS.values())
_REASON_BITS = telemetry.clock_event_reason_bits(pynvml)
_NVLINK_ERRORS = {which: name for name, which in telemetry.nvlink_error_counters(pynvml)}
_GPM_FIELDS = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: "sm_active_pct",
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: "sm_occupancy_pct",
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor_active_pct",
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: "dram_active_pct",
}
_ECC_TYPES = {
    pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected",
}
_ECC_COUNTERS = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}
_ECC_LOCATIONS = {
    pynvml.NVML_MEMORY_LOCATION_L1_CACHE: "l1_cache",
    pynvml.NVML_MEMORY_LOCATION_L2_CACHE: "l2_cache",
    pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY: "device_memory",
    pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE: "register_file",
    pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY: "texture_memory",
    pynvml.NVML_MEMORY_LOCATION_TEXTURE_SHM: "texture_shm",
    pynvml.NVML_MEMORY_LOCATION_CBU: "cbu",
    pynvml.NVML_MEMORY_LOCATION_SRAM: "sram",
}
_SUPPORTED_EVENTS = pynvml.nvmlEventTypeXidCriticalError
# "No MIG instance" in event data: all ones (nvidia-ml-py 12.535 lacks the named constants).
_NO_GPU_INSTANCE = getattr(pynvml, "NVML_GPU_INSTANCE_ID_ANY", ctypes.c_uint(-1).value)
_NO_COMPUTE_INSTANCE = getattr(pynvml, "NVML_COMPUTE_INSTANCE_ID_ANY", ctypes.c_uint(-1).value)


@dataclass(frozen=True)
class Fault:
    """What an injected fault does to a call: sleep `block_s` in the calling thread, then raise
    `pynvml.NVMLError(error)` (None: proceed); only on the handles of `gpus` (None: any call)."""

    block_s: float = 0.0
    error: int | None = None
    gpus: frozenset[int] | None = None

    def applies(self, args: tuple[Any, ...]) -> bool:
        if self.gpus is None:
            return True
        handle = args[0] if args else None
        return isinstance(handle, FakeNvmlHandle) and handle.index in self.gpus


def parse_faults(data: object) -> dict[str, Fault]:
    """Faults by NVML function name ("*": every function) from their JSON form, e.g.
    ``{"nvmlDeviceGetPowerUsage": {"block_s": 5}, "*": {"error": "NVML_ERROR_GPU_IS_LOST",
    "gpus": [3]}}``. Raises ValueError naming what is wrong."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("faults must be a JSON object: NVML function name -> fault")
    faults: dict[str, Fault] = {}
    for name, spec in data.items():
        if name != "*" and name not in NVML_FUNCTIONS:
            raise ValueError(f"{name!r}: no such NVML function in FakeNvml")
        if not isinstance(spec, dict) or not spec:
            raise ValueError(f"{name}: a fault is an object with block_s and/or error")
        unknown = set(spec) - {"block_s", "error", "gpus"}
        if unknown:
            raise ValueError(f"{name}: unknown keys {sorted(unknown)} (block_s, error, gpus)")
        if not {"block_s", "error"} & set(spec):
            raise ValueError(f"{name}: a fault needs block_s or error")
        block_s = spec.get("block_s", 0.0)
        if isinstance(block_s, bool) or not isinstance(block_s, int | float):
            raise ValueError(f"{name}.block_s: a number of seconds, not {block_s!r}")
        if not 0 <= block_s < math.inf:
            raise ValueError(f"{name}.block_s: must be >= 0 and finite, not {block_s}")
        error = spec.get("error")
        code = None
        if error is not None:
            code = getattr(pynvml, error, None) if isinstance(error, str) else None
            if not isinstance(error, str) or not error.startswith("NVML_ERROR_") or code is None:
                raise ValueError(f"{name}.error: {error!r} is no pynvml NVML_ERROR_* name")
        gpus = spec.get("gpus")
        if gpus is not None and (
            not isinstance(gpus, list)
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus)
        ):
            raise ValueError(f"{name}.gpus: a list of GPU indices, not {gpus!r}")
        faults[name] = Fault(float(block_s), code, None if gpus is None else frozenset(gpus))
    return faults


class _FaultFile:
    """Faults read from a JSON file, read again whenever its mtime, size or inode change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.faults: dict[str, Fault] = {}
        self._seen: tuple[int, int, int] | None = None
        self._problem = ""
        self._lock = threading.Lock()

    def current(self) -> dict[str, Fault]:
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self.faults = None, {}
            return self.faults
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self._seen:
            return self.faults
        with self._lock:
            if key != self._seen:
                self.faults = self._load()
                self._seen = key
        return self.faults

    def _load(self) -> dict[str, Fault]:
        try:
            text = self.path.read_text(encoding="utf-8")
            faults = parse_faults(json.loads(text) if text.strip() else None)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            problem = f"{FAULTS_ENV} file {self.path}: {e}; injecting no faults"
            if problem != self._problem:
                log.error("%s", problem)
                self._problem = problem
            return {}
        self._problem = ""
        return faults


class FakeNvml:
    """The subset of `pynvml` a monitoring agent and a power-cap actuator use, over recorded GPUs.

    Device `i` is `gpus[i]` (`GpuRecord.index` must equal its position). A field the capture lacks
    (None) raises `NVMLError_NotSupported`; every call before `nvmlInit()` raises
    `NVMLError_Uninitialized`; init and shutdown are refcounted as in NVML.

    What each call replays (see `GpuRecord`): utilisation, memory, power, limits, temperature
    and clocks from their fields; `nvmlDeviceGetCurrentClocksEventReasons` (and the older
    `...ThrottleReasons`) from `clock_event_reasons`, with FUNCTION_NOT_FOUND for the newer name
    when the capture came from a driver that only knew throttle reasons;
    `nvmlDeviceGetViolationStatus` from `clock_event_counters_ns` (sw_power_cap is the POWER
    policy, sync_boost SYNC_BOOST, as NVML defines them); ECC totals and per-location counts,
    retired pages (page addresses are not captured: pages 0..n-1 stand for n pages), remapped
    rows, PCIe throughput and replays, NVLink state, traffic (field values only) and errors,
    memory temperature (field values only), MIG mode and devices (a MIG device's UUID and
    profile raise NOT_SUPPORTED when the capture does not hold them, as `-q -x` dumps do not),
    and GPM: a
    device supports GPM when its record has an activity, and a metric over two samples is the
    value the later sample took.

    Power: `nvmlDeviceGetPowerUsage` reads min(recorded or `set_load` draw, enforced limit), so a
    cap set through `nvmlDeviceSetPowerManagementLimit` limits the draw; with `cap_response_s`
    the old limit keeps holding the draw for that long (of `clock`) after the set call, as a
    real GPU takes time to slow down. The set call checks, in this order, support (min/max
    limits known, else NOT_SUPPORTED), permission (`writable=False` acts as a non-root process:
    NO_PERMISSION) and range (outside [min, max]: INVALID_ARGUMENT).

    Field values (`nvmlDeviceGetFieldValues`): the field ids NvmlSource asks for, in nvml.h's
    units and `c_nvmlFieldValue_t` structs, each with its own return code (see the method).
    NVML_FI_DEV_POWER_AVERAGE is the draw above; NVML_FI_DEV_POWER_INSTANT is the same draw,
    or the instant power an agent recording holds (`from_readings`), until `set_load` changes
    the draw.

    Calls: `call_counts()` tells how many times each NVML function was called.

    Energy: captures hold no energy counter, so `nvmlDeviceGetTotalEnergyConsumption` is a
    synthesised counter consistent with the recorded power, not a recording: it starts at 0 mJ at
    construction (at the recorded value for `from_readings`) and integrates the capped draw over
    time read from `clock` (seconds), piecewise at every read and before every change of draw or
    limit. A device without a recorded draw has no energy counter (NOT_SUPPORTED).

    Events: `inject_xid` raises an XID critical-error event on a device. It goes to every event
    set that registered the device for XID events; while none has, it is kept and handed to the
    first set that registers the device (NVML would drop it; a replay must not).
    `nvmlEventSetWait_v2` blocks for real time, not `clock` time.

    Faults: any NVML function can be made to block or fail. A fault is ``{"block_s": float}``
    (the call sleeps that long in its calling thread, holding no lock of the fake, then
    proceeds), ``{"error": "NVML_ERROR_UNKNOWN"}`` (any pynvml ``NVML_ERROR_*`` name: the call
    raises that `pynvml.NVMLError` subclass; with ``block_s`` too, after the sleep), with an
    optional ``"gpus": [indices]`` limiting it to calls whose first argument is a handle of
    those GPUs (or of a MIG device on them). Faults are keyed by function name, ``"*"`` for
    every function (a named entry wins over ``"*"``). Two ways to set them:

    - a JSON file of that mapping, named by `faults_file` or, by default, by the environment
      variable ``HYPERAGENT_FAKE_NVML_FAULTS`` (so agents started as processes over fake GPUs
      take it). Each call checks the file's mtime, size and inode (one ``stat``) and reads it
      again when they changed, so a test injects and clears faults while the agent runs
      (replace the file atomically: write, then rename). A missing or empty file means no
      faults; a malformed one (not JSON, an unknown function or error name) is logged once as
      an error and injects nothing;
    - in process: `set_faults(mapping)` (the same JSON form, checked at once: ValueError), or
      the `faults` argument. These are looked up before the file's.

    Which functions a read calls: `NvmlSource` reads power, energy and the power limit through
    `nvmlDeviceGetFieldValues` (`nvmlDeviceGetPowerUsage` only on drivers without the field),
    utilisation through `nvmlDeviceGetUtilizationRates`; the agent's GPU attribution calls
    `nvmlDeviceGetComputeRunningProcesses`, a trial's energy
    `nvmlDeviceGetTotalEnergyConsumption`, a power cap `nvmlDeviceSetPowerManagementLimit`.
    `call_counts()` tells which were called.

    Simulation controls (not NVML): `set_load`, `set_clock_event_reasons`, `inject_xid`, `fail`,
    `recover`, `set_faults` and `update_from_readings`. All state is guarded by a lock, so a
    worker thread may read while a simulator changes the load.

    Attributes named like pynvml's constants, structs and exception classes (`NVML_*`,
    `NVMLError*`, `nvmlMemory_v2`, `nvmlClocksEventReason*`, `nvmlEventType*`, `c_nvml*`) are
    pynvml's own, so `nvml.NVML_TEMPERATURE_GPU` works on an instance too.
    """

    def __init__(
        self,
        gpus: list[GpuRecord],
        driver: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        writable: bool = True,
        cap_response_s: float = 0.0,
        faults: Mapping[str, Any] | None = None,
        faults_file: Path | None = None,
    ) -> None:
        if cap_response_s < 0:
            raise ValueError(f"cap_response_s must be >= 0, got {cap_response_s}")
        for position, gpu in enumerate(gpus):
            if gpu.index != position:
                raise ValueError(f"GPU at position {position} has index {gpu.index}; renumber it")
        if driver is None:
            if not gpus:
                raise ValueError("driver is required when there are no GPUs")
            driver = gpus[0].driver
        self._driver = driver
        self._clock = clock
        self._writable = writable
        self._cap_response_s = cap_response_s
        self._lock = threading.Lock()
        self._counts_lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        self._events = threading.Condition(self._lock)
        self._event_sets: list[FakeEventSet] = []
        self._gpm_samples: dict[int, _GpmSample] = {}
        self._refcount = 0
        self._last_frame: _Frame | None = None
        self._faults = parse_faults(dict(faults) if faults is not None else None)
        if faults_file is None and os.environ.get(FAULTS_ENV):
            faults_file = Path(os.environ[FAULTS_ENV])
        self._fault_file = None if faults_file is None else _FaultFile(faults_file)
        now = clock()
        self._devices = [
            _Device(
                record=gpu, handle=FakeNvmlHandle(self, gpu.index), energy_mj=0.0, integrated_to=now
            )
            for gpu in gpus
        ]

    @classmethod
    def from_capture(cls, path: Path, **kwargs: Any) -> FakeNvml:
        """A fake replaying the capture at `path` (any format `parse_capture` reads)."""
        return cls(parse_capture(path.read_text(encoding="utf-8")), **kwargs)

    @classmethod
    def from_readings(cls, readings: Iterable[Reading], **kwargs: Any) -> FakeNvml:
        """A fake whose NVML answers reproduce one cycle of `hyperagent_gpu_*` readings.

        `readings` are what an NvmlSource produced in one read (other names are ignored);
        `NvmlSource(fake).read()` then returns the same readings, for the source's first read
        after `start()`. Energy counters start at the recorded values. Recorded XID counts are
        handed to the first event set that registers each GPU. Clock-event time for reasons
        NVML has no counter for is the agent's own integration and starts at 0 in a new
        source, as after an agent restart; `update_from_readings` reproduces its growth.
        Raises ValueError when a GPU is missing, labels are malformed or GPUs disagree.
        """
        frame = _decode(readings)
        count = len(frame.records)
        if not count:
            raise ValueError("readings hold no GPU (no hyperagent_gpu_* reading with a gpu label)")
        if sorted(frame.records) != list(range(count)):
            raise ValueError(f"readings hold GPUs {sorted(frame.records)}; need 0..{count - 1}")
        records = [frame.records[i] for i in range(count)]
        fake = cls(records, **kwargs)
        for device in fake._devices:
            device.energy_mj = frame.energy_j.get(device.record.index, 0.0) * 1000.0
            device.instant_w = frame.instant_w.get(device.record.index)
            for xid, number in sorted(frame.xids.get(device.record.index, {}).items()):
                device.xid_backlog.extend([xid] * number)
        fake._last_frame = frame
        return fake

    def update_from_readings(self, readings: Iterable[Reading]) -> None:
        """Advance to the next recorded cycle; the next read reproduces `readings`.

        For reproduction, advance `clock` by the recorded interval first. A GPU absent from
        `readings` (its read failed in the recording) fails with NVML_ERROR_UNKNOWN until a
        cycle holds it again. Energy jumps to the recorded value, unless a power limit was set
        through NVML: the limit then stays, the recorded draw is capped by it, and energy is
        integrated from the capped draw. XID counts that grew are
        raised as that many events; a clock-event reason whose agent-integrated time grew is
        the active one for this cycle. Raises ValueError when a GPU's UUID changed.
        """
        frame = _decode(readings)
        previous = self._last_frame
        with self._lock:
            for device in self._devices:
                index = device.record.index
                record = frame.records.get(index)
                if record is None:
                    device.failure = pynvml.NVML_ERROR_UNKNOWN
                    continue
                if record.uuid != device.record.uuid:
                    raise ValueError(
                        f"GPU {index} is {record.uuid} in these readings, "
                        f"{device.record.uuid} before"
                    )
                before_s = previous.integrated_s.get(index, {}) if previous is not None else {}
                grown = frozenset(
                    reason
                    for reason, seconds in frame.integrated_s.get(index, {}).items()
                    if seconds > before_s.get(reason, 0.0)
                )
                if record.clock_event_reasons is not None:
                    record = replace(record, clock_event_reasons=grown)
                device.failure = None
                device.integrate(self._clock())
                if device.set_limit_w is not None:
                    record = replace(record, power_limit_w=device.set_limit_w)
                elif index in frame.energy_j:
                    device.energy_mj = frame.energy_j[index] * 1000.0
                if record.mig_devices != device.record.mig_devices:
                    device.mig_handles.clear()
                device.record = record
                device.instant_w = frame.instant_w.get(index)
                before = previous.xids.get(index, {}) if previous is not None else {}
                for xid, number in frame.xids.get(index, {}).items():
                    for _ in range(max(0, number - before.get(xid, 0))):
                        self._raise_xid(device, xid)
            self._events.notify_all()
            self._last_frame = frame

    def __getattr__(self, name: str) -> Any:
        if name.startswith(_PROXIED):
            value = getattr(pynvml, name)
            # pynvml's constants, error and struct types never change: kept on the instance,
            # later lookups are plain attribute reads (as on the pynvml module), not this call.
            self.__dict__[name] = value
            return value
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def call_counts(self) -> dict[str, int]:
        """NVML calls made on this fake so far, by function name (a subclass's override is
        counted when it calls the fake's own function)."""
        with self._counts_lock:
            return dict(self._calls)

    # -- simulation controls -------------------------------------------------------------------

    def set_load(
        self,
        index: int,
        util_gpu_pct: float | None = None,
        power_draw_w: float | None = None,
        util_mem_pct: float | None = None,
        mem_used_bytes: int | None = None,
        sm_active_pct: float | None = None,
        tensor_active_pct: float | None = None,
    ) -> None:
        """Change what device `index` reports from now on; None leaves a value as it is.

        Energy is integrated up to now at the old draw before the new one applies.
        """
        for name, pct in (
            ("util_gpu_pct", util_gpu_pct),
            ("util_mem_pct", util_mem_pct),
            ("sm_active_pct", sm_active_pct),
            ("tensor_active_pct", tensor_active_pct),
        ):
            if pct is not None and not 0.0 <= pct <= 100.0:
                raise ValueError(f"{name} must be within [0, 100], got {pct}")
        if power_draw_w is not None and power_draw_w < 0:
            raise ValueError(f"power_draw_w must be >= 0, got {power_draw_w}")
        with self._lock:
            device = self._control(index)
            total = device.record.mem_total_bytes
            if mem_used_bytes is not None and (
                mem_used_bytes < 0 or (total is not None and mem_used_bytes > total)
            ):
                raise ValueError(
                    f"mem_used_bytes must be within [0, {total}], got {mem_used_bytes}"
                )
            device.integrate(self._clock())
            if power_draw_w is not None:
                device.instant_w = None
            changes: dict[str, Any] = {
                "util_gpu_pct": util_gpu_pct,
                "power_draw_w": power_draw_w,
                "util_mem_pct": util_mem_pct,
                "mem_used_bytes": mem_used_bytes,
                "sm_active_pct": sm_active_pct,
                "tensor_active_pct": tensor_active_pct,
            }
            device.record = replace(
                device.record, **{k: v for k, v in changes.items() if v is not None}
            )

    def set_clock_event_reasons(self, index: int, reasons: Iterable[str] | None) -> None:
        """Make `reasons` (nvidia-smi names, e.g. "sw_power_cap") the active ones on `index`.

        None makes the reasons call NOT_SUPPORTED. Raises ValueError for an unknown name.
        """
        active = None if reasons is None else frozenset(reasons)
        unknown = (active or frozenset()) - {name for name, _ in _REASON_BITS}
        if unknown:
            raise ValueError(f"unknown clock event reasons: {sorted(unknown)}")
        with self._lock:
            device = self._control(index)
            device.record = replace(device.record, clock_event_reasons=active)

    def inject_xid(self, index: int, xid: int) -> None:
        """Raise an XID critical-error event `xid` on device `index` (see the class doc)."""
        if xid < 0:
            raise ValueError(f"an XID is a positive number, got {xid}")
        with self._lock:
            self._raise_xid(self._control(index), xid)
            self._events.notify_all()

    def _raise_xid(self, device: _Device, xid: int) -> None:
        listeners = [s for s in self._event_sets if device.record.index in s.devices]
        if not listeners:
            device.xid_backlog.append(xid)
            return
        event = FakeEventData(
            device=device.handle,
            eventType=pynvml.nvmlEventTypeXidCriticalError,
            eventData=xid,
            gpuInstanceId=_NO_GPU_INSTANCE,
            computeInstanceId=_NO_COMPUTE_INSTANCE,
        )
        for event_set in listeners:
            event_set.pending.append(event)

    def set_faults(self, faults: Mapping[str, Any] | None) -> None:
        """Inject `faults` (see the class doc) from now on, replacing those set before (not the
        file's); None or {} clears them. Raises ValueError for a malformed mapping."""
        self._faults = parse_faults(dict(faults) if faults is not None else None)

    def _fault(self, name: str, args: tuple[Any, ...]) -> Fault | None:
        """The fault a call of `name` with `args` gets now, if any."""
        found = self._faults.get(name) or self._faults.get("*")
        if found is None and self._fault_file is not None:
            from_file = self._fault_file.current()
            found = from_file.get(name) or from_file.get("*")
        return found if found is not None and found.applies(args) else None

    def index_of(self, uuid: str) -> int:
        """The index of the GPU with ``uuid`` (no NVML init needed); ValueError for none."""
        for device in self._devices:
            if device.record.uuid == uuid:
                return device.record.index
        raise ValueError(f"no GPU has uuid {uuid}")

    def set_processes(self, index: int, pids: Iterable[int]) -> None:
        """Make ``pids`` the compute processes running on device ``index``."""
        with self._lock:
            self._control(index).processes = tuple(pids)

    def run_on_every_device(self, pid: int) -> None:
        """Make ``pid`` the compute process running on every device (one process driving the
        node's GPUs, as a simulated job's rank does)."""
        with self._lock:
            for device in self._devices:
                device.processes = (pid,)

    def fail(self, index: int, code: int) -> None:
        """Make every call on device `index` raise `pynvml.NVMLError(code)` until `recover`."""
        with self._lock:
            self._control(index).failure = code

    def recover(self, index: int) -> None:
        """Undo `fail` for device `index`."""
        with self._lock:
            self._control(index).failure = None

    def _control(self, index: int) -> _Device:
        if not 0 <= index < len(self._devices):
            raise IndexError(f"no GPU {index}; this fake has {len(self._devices)}")
        return self._devices[index]

    # -- NVML: library and identity ------------------------------------------------------------

    def _check_init(self) -> None:
        if self._refcount == 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: object, mig: bool = False) -> _Device:
        """The device behind `handle`; a MIG device handle only where `mig` allows one."""
        self._check_init()
        if not isinstance(handle, FakeNvmlHandle) or handle._owner is not self:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        device = self._devices[handle.index]
        if device.failure is not None:
            raise _error(device.failure)
        if handle.mig is not None and not mig:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device

    def _record(self, handle: object) -> GpuRecord:
        """`_device(handle).record`, inlined: most calls of a read go through here."""
        with self._lock:
            if self._refcount == 0:
                raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
            if not isinstance(handle, FakeNvmlHandle) or handle._owner is not self:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            device = self._devices[handle.index]
            if device.failure is not None:
                raise _error(device.failure)
            if handle.mig is not None:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return device.record

    def _mig_record(self, handle: object) -> tuple[_Device, MigRecord | None]:
        """The device and, for a MIG device handle, its MIG record (call under the lock)."""
        device = self._device(handle, mig=True)
        assert isinstance(handle, FakeNvmlHandle)
        if handle.mig is None:
            return device, None
        found = device.mig(handle.mig)
        if found is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return device, found

    def nvmlInit(self) -> None:
        """Initialise (refcounted: each call needs a matching `nvmlShutdown`)."""
        with self._lock:
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        """Drop one reference; at zero every call raises NVMLError_Uninitialized."""
        with self._lock:
            self._check_init()
            self._refcount -= 1
            self._events.notify_all()

    def nvmlSystemGetDriverVersion(self) -> str:
        """The driver version string of the capture."""
        with self._lock:
            self._check_init()
            return self._driver

    def nvmlDeviceGetCount(self) -> int:
        """Number of GPUs, failed ones included."""
        with self._lock:
            self._check_init()
            return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeNvmlHandle:
        """Handle of GPU `index`; NVMLError_InvalidArgument when there is no such GPU."""
        with self._lock:
            self._check_init()
            if not isinstance(index, int) or not 0 <= index < len(self._devices):
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            device = self._devices[index]
            if device.failure is not None:
                raise _error(device.failure)
            return device.handle

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeNvmlHandle:
        """Handle of the GPU with `uuid`; NVMLError_NotFound when there is none."""
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        with self._lock:
            self._check_init()
            for device in self._devices:
                if device.record.uuid == wanted:
                    if device.failure is not None:
                        raise _error(device.failure)
                    return device.handle
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: FakeNvmlHandle) -> str:
        """Product name, e.g. "NVIDIA A100-SXM4-80GB"; "<GPU name> MIG <profile>" for MIG."""
        with self._lock:
            device, mig = self._mig_record(handle)
            if mig is None:
                return device.record.name
            return f"{device.record.name} MIG {_supported(mig.profile)}"

    def nvmlDeviceGetUUID(self, handle: FakeNvmlHandle) -> str:
        """GPU UUID string, "GPU-..."; a MIG device's "MIG-..." where recorded."""
        with self._lock:
            device, mig = self._mig_record(handle)
            return device.record.uuid if mig is None else _supported(mig.uuid)

    def nvmlDeviceGetIndex(self, handle: FakeNvmlHandle) -> int:
        """NVML index of the device."""
        return self._record(handle).index

    # -- NVML: utilisation, memory, power, energy, temperature, clocks --------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: FakeNvmlHandle) -> pynvml.c_nvmlUtilization_t:
        """`.gpu` and `.memory` utilisation, integer percent (NOT_SUPPORTED e.g. under MIG)."""
        record = self._record(handle)
        return pynvml.c_nvmlUtilization_t(
            gpu=round(_supported(record.util_gpu_pct)),
            memory=round(_supported(record.util_mem_pct)),
        )

    def nvmlDeviceGetMemoryInfo(
        self, handle: FakeNvmlHandle, version: int | None = None
    ) -> pynvml.c_nvmlMemory_t | pynvml.c_nvmlMemory_v2_t:
        """Frame-buffer memory in bytes, as NVML's v1 or (with `version=nvmlMemory_v2`) v2 struct.

        v1 `used` is reserved plus allocated memory, as NVML v1 reports it; v2 separates
        `reserved`. `free` is total - used - reserved in both. Works on MIG device handles.
        """
        with self._lock:
            device, mig = self._mig_record(handle)
            recorded: GpuRecord | MigRecord = device.record if mig is None else mig
        total = _supported(recorded.mem_total_bytes)
        used = _supported(recorded.mem_used_bytes)
        reserved = recorded.mem_reserved_bytes or 0
        free = max(0, total - used - reserved)
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=free, used=used + reserved)
        if version != pynvml.nvmlMemory_v2:
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return pynvml.c_nvmlMemory_v2_t(
            version=version, total=total, reserved=reserved, free=free, used=used
        )

    def nvmlDeviceGetPowerUsage(self, handle: FakeNvmlHandle) -> int:
        """Current draw in milliwatts, capped by the enforced limit."""
        with self._lock:
            return _milli(self._device(handle).draw_w(self._clock()))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeNvmlHandle) -> int:
        """Enforced power limit in milliwatts."""
        return _milli(self._record(handle).power_limit_w)

    def nvmlDeviceGetPowerManagementLimit(self, handle: FakeNvmlHandle) -> int:
        """Power management limit in milliwatts (the enforced one; the fake has no other cap)."""
        return _milli(self._record(handle).power_limit_w)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: FakeNvmlHandle) -> int:
        """Default power limit in milliwatts."""
        return _milli(self._record(handle).default_power_limit_w)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: FakeNvmlHandle) -> list[int]:
        """`[min_mW, max_mW]`, a list as pynvml returns it."""
        record = self._record(handle)
        return [_milli(record.min_power_limit_w), _milli(record.max_power_limit_w)]

    def nvmlDeviceSetPowerManagementLimit(self, handle: FakeNvmlHandle, limit: int) -> None:
        """Set the power limit to `limit` milliwatts, checked as NVML does (see the class doc)."""
        if not isinstance(limit, int):
            raise TypeError(f"int expected instead of {type(limit).__name__}")
        with self._lock:
            device = self._device(handle)
            low = device.record.min_power_limit_w
            high = device.record.max_power_limit_w
            if low is None or high is None:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if not self._writable:
                raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
            if not round(low * 1000) <= limit <= round(high * 1000):
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            now = self._clock()
            device.integrate(now)
            device.limit_before_w = device.record.power_limit_w
            device.limit_from = now + self._cap_response_s
            device.record = replace(device.record, power_limit_w=limit / 1000)
            device.set_limit_w = limit / 1000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeNvmlHandle) -> int:
        """Millijoules since construction: the synthesised counter described on the class."""
        with self._lock:
            device = self._device(handle)
            _supported(device.record.power_draw_w)
            device.integrate(self._clock())
            return round(device.energy_mj)

    def nvmlDeviceGetTemperature(self, handle: FakeNvmlHandle, sensor: int) -> int:
        """GPU temperature in degrees C; `sensor` must be NVML_TEMPERATURE_GPU."""
        record = self._record(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(_supported(record.temperature_c))

    def nvmlDeviceGetClockInfo(self, handle: FakeNvmlHandle, type: int) -> int:
        """Current clock in MHz for NVML_CLOCK_GRAPHICS, _SM or _MEM (_VIDEO: NOT_SUPPORTED)."""
        record = self._record(handle)
        clocks = {
            pynvml.NVML_CLOCK_GRAPHICS: record.graphics_clock_mhz,
            pynvml.NVML_CLOCK_SM: record.sm_clock_mhz,
            pynvml.NVML_CLOCK_MEM: record.mem_clock_mhz,
            pynvml.NVML_CLOCK_VIDEO: None,
        }
        if type not in clocks:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(_supported(clocks[type]))

    def nvmlDeviceGetFieldValues(
        self, handle: FakeNvmlHandle, fieldIds: Sequence[int | tuple[int, int]]
    ) -> Any:
        """An array of `c_nvmlFieldValue_t`, one per requested field (`id` or `(id, scope)`),
        each with its own `nvmlReturn`, as NVML answers.

        Served from the record, in nvml.h's units: NVML_FI_DEV_POWER_AVERAGE and _INSTANT (mW,
        scope 0 = the GPU; the module scope is NOT_SUPPORTED), _POWER_CURRENT_LIMIT, _MIN_LIMIT,
        _MAX_LIMIT, _DEFAULT_LIMIT (mW), NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION and _ENERGY (mJ,
        the synthesised counter), _MEMORY_TEMP (C), _PCIE_REPLAY_COUNTER, _PERF_POLICY_* (ns),
        _ECC_{SBE,DBE}_{VOL,AGG}_TOTAL, _RETIRED_SBE, _DBE, _PENDING, _REMAPPED_COR, _UNC,
        _PENDING, _FAILURE, _NVLINK_LINK_COUNT and _NVLINK_THROUGHPUT_DATA_TX/RX (KiB, scope =
        link). A field the record lacks is NOT_SUPPORTED; an id the fake does not serve is
        NOT_SUPPORTED too. The fake serves every field whatever driver the capture names.
        """
        with self._lock:
            device = self._device(handle)
            now = self._clock()
            record = device.record
            draw_w = device.draw_w(now)
            instant_w = device.instant_draw_w(now)
            energy_mj: float | None = None
            if record.power_draw_w is not None:
                device.integrate(now)
                energy_mj = device.energy_mj
        raw = (_RawFieldValue * len(fieldIds))()
        stamp = round(now * 1e6)
        state = _FieldState(record, draw_w, instant_w, energy_mj)
        for value, requested in zip(raw, fieldIds, strict=True):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            value.fieldId, value.scopeId, value.timestamp = field_id, scope, stamp
            serve = _SERVED.get(field_id)
            number, kind = (None, _UINT) if serve is None else serve(state, scope)
            if number is None:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            value.nvmlReturn = pynvml.NVML_SUCCESS
            value.valueType = kind
            if kind == _UINT:
                value.value.uiVal = number
            else:
                value.value.ullVal = number
        return (pynvml.c_nvmlFieldValue_t * len(fieldIds)).from_buffer(raw)

    # -- NVML: clock events ----------------------------------------------------------------------

    def _reasons_mask(self, record: GpuRecord) -> int:
        active = _supported(record.clock_event_reasons)
        return sum(bit for name, bit in _REASON_BITS if name in active)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeNvmlHandle) -> int:
        """Active clock-event reasons as NVML's bitmask; FUNCTION_NOT_FOUND for old drivers."""
        record = self._record(handle)
        if not record.clock_event_api:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._reasons_mask(record)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeNvmlHandle) -> int:
        """The same bitmask under its pre-535 name, which every driver still exports."""
        return self._reasons_mask(self._record(handle))

    def nvmlDeviceGetViolationStatus(
        self, handle: FakeNvmlHandle, perfPolicyType: int
    ) -> pynvml.c_nvmlViolationTime_t:
        """Cumulative time (ns) clocks were held down by a perf policy, where recorded."""
        record = self._record(handle)
        if perfPolicyType not in _VIOLATIONS:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        ns = _supported(record.clock_event_counters_ns.get(_VIOLATIONS[perfPolicyType]))
        return pynvml.c_nvmlViolationTime_t(
            referenceTime=round(self._clock() * 1e6), violationTime=ns
        )

    # -- NVML: memory health, PCIe ---------------------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(
        self, handle: FakeNvmlHandle, errorType: int, counterType: int
    ) -> int:
        """ECC errors of a type (corrected/uncorrected), volatile or aggregate, all locations."""
        record = self._record(handle)
        if errorType not in _ECC_TYPES or counterType not in _ECC_COUNTERS:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _supported(
            record.ecc_errors.get((_ECC_TYPES[errorType], _ECC_COUNTERS[counterType]))
        )

    def nvmlDeviceGetMemoryErrorCounter(
        self, handle: FakeNvmlHandle, errorType: int, counterType: int, locationType: int
    ) -> int:
        """ECC errors of a type and counter at one memory location."""
        record = self._record(handle)
        if (
            errorType not in _ECC_TYPES
            or counterType not in _ECC_COUNTERS
            or locationType not in _ECC_LOCATIONS
        ):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        key = (_ECC_TYPES[errorType], _ECC_COUNTERS[counterType], _ECC_LOCATIONS[locationType])
        return _supported(record.ecc_errors_by_location.get(key))

    def nvmlDeviceGetRetiredPages(self, handle: FakeNvmlHandle, sourceFilter: int) -> list[int]:
        """Retired page addresses for a cause; pages 0..n-1 stand for n recorded pages."""
        record = self._record(handle)
        counts = {
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: (
                record.retired_pages_single_bit
            ),
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: record.retired_pages_double_bit,
        }
        if sourceFilter not in counts:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return list(range(_supported(counts[sourceFilter])))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeNvmlHandle) -> int:
        """NVML_FEATURE_ENABLED when a page waits for retirement, else NVML_FEATURE_DISABLED."""
        pending = _supported(self._record(handle).retired_pages_pending)
        return pynvml.NVML_FEATURE_ENABLED if pending else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, handle: FakeNvmlHandle) -> tuple[int, int, int, int]:
        """(correctable, uncorrectable, pending, failure) as pynvml returns them."""
        rows: RemappedRows = _supported(self._record(handle).remapped_rows)
        return (rows.correctable, rows.uncorrectable, int(rows.pending), int(rows.failure))

    def nvmlDeviceGetComputeRunningProcesses(
        self, handle: FakeNvmlHandle
    ) -> list[pynvml.c_nvmlProcessInfo_t]:
        """The compute processes on the device, as pynvml's structs (memory not tracked)."""
        device = self._device(handle)
        return [
            pynvml.c_nvmlProcessInfo_t(
                pid=pid,
                usedGpuMemory=0,
                gpuInstanceId=_NO_GPU_INSTANCE,
                computeInstanceId=_NO_COMPUTE_INSTANCE,
            )
            for pid in device.processes
        ]

    def nvmlDeviceGetPcieThroughput(self, handle: FakeNvmlHandle, counter: int) -> int:
        """PCIe throughput in KB/s (1 KB = 1024 B) for NVML_PCIE_UTIL_TX_BYTES or _RX_BYTES."""
        record = self._record(handle)
        rates = {
            pynvml.NVML_PCIE_UTIL_TX_BYTES: record.pcie_tx_bytes_per_s,
            pynvml.NVML_PCIE_UTIL_RX_BYTES: record.pcie_rx_bytes_per_s,
        }
        if counter not in rates:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _supported(rates[counter]) // 1024

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeNvmlHandle) -> int:
        """PCIe replay count from the capture."""
        return _supported(self._record(handle).pcie_replay_count)

    # -- NVML: NVLink ---------------------------------------------------------------------------

    def _link(self, handle: FakeNvmlHandle, link: int) -> NvLinkRecord:
        links = {found.link: found for found in self._record(handle).nvlinks}
        if not links:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link <= max(links):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _supported(links.get(link))

    def nvmlDeviceGetNvLinkState(self, handle: FakeNvmlHandle, link: int) -> int:
        """NVML_FEATURE_ENABLED for an active link; INVALID_ARGUMENT past the last link."""
        active = _supported(self._link(handle, link).active)
        return pynvml.NVML_FEATURE_ENABLED if active else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(
        self, handle: FakeNvmlHandle, link: int, counter: int
    ) -> int:
        """An NVLink data-link error counter (NVML_NVLINK_ERROR_DL_*) of one link."""
        found = self._link(handle, link)
        if counter not in _NVLINK_ERRORS:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _supported(found.errors.get(_NVLINK_ERRORS[counter]))

    # -- NVML: events ---------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> FakeEventSet:
        """A new, empty event set."""
        with self._lock:
            self._check_init()
            event_set = FakeEventSet(self)
            self._event_sets.append(event_set)
            return event_set

    def _event_set(self, event_set: object) -> FakeEventSet:
        if not isinstance(event_set, FakeEventSet) or event_set._owner is not self:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if event_set.freed:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeNvmlHandle) -> int:
        """The event types the fake raises: XID critical errors."""
        self._record(handle)
        return _SUPPORTED_EVENTS

    def nvmlDeviceRegisterEvents(
        self, handle: FakeNvmlHandle, eventTypes: int, eventSet: FakeEventSet
    ) -> None:
        """Listen for `eventTypes` of a device; NOT_SUPPORTED for types the fake never raises."""
        with self._lock:
            device = self._device(handle)
            event_set = self._event_set(eventSet)
            if eventTypes & ~_SUPPORTED_EVENTS:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            event_set.devices.add(device.record.index)
            backlog, device.xid_backlog = device.xid_backlog, []
            for xid in backlog:
                self._raise_xid(device, xid)
            self._events.notify_all()

    def nvmlEventSetWait_v2(self, eventSet: FakeEventSet, timeoutms: int) -> FakeEventData:
        """The next event of the set, waiting up to `timeoutms` real milliseconds (TIMEOUT)."""
        deadline = time.monotonic() + timeoutms / 1000
        with self._lock:
            while True:
                self._check_init()
                event_set = self._event_set(eventSet)
                if event_set.pending:
                    return event_set.pending.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _error(pynvml.NVML_ERROR_TIMEOUT)
                self._events.wait(remaining)

    def nvmlEventSetWait(self, eventSet: FakeEventSet, timeoutms: int) -> FakeEventData:
        """`nvmlEventSetWait_v2`, as pynvml aliases it."""
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        """Release the set; waiting on it afterwards is INVALID_ARGUMENT."""
        with self._lock:
            self._check_init()
            event_set = self._event_set(eventSet)
            event_set.freed = True
            self._event_sets.remove(event_set)
            self._events.notify_all()

    # -- NVML: MIG ------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: FakeNvmlHandle) -> list[int]:
        """`[current, pending]` MIG mode (the capture's current mode for both)."""
        enabled = _supported(self._record(handle).mig_enabled)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeNvmlHandle) -> int:
        """MIG device slots: those the capture lists (0 when MIG is off or unsupported)."""
        record = self._record(handle)
        if not record.mig_enabled or not record.mig_devices:
            return 0
        return max(mig.index for mig in record.mig_devices) + 1

    def nvmlDeviceGetMigDeviceHandleByIndex(
        self, handle: FakeNvmlHandle, index: int
    ) -> FakeNvmlHandle:
        """Handle of the MIG device in slot `index`; NOT_FOUND for an empty slot."""
        with self._lock:
            device = self._device(handle)
            if not device.record.mig_enabled:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if device.mig(index) is None:
                raise _error(pynvml.NVML_ERROR_NOT_FOUND)
            found = device.mig_handles.get(index)
            if found is None:
                found = device.mig_handles[index] = FakeNvmlHandle(self, device.record.index, index)
            return found

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeNvmlHandle) -> bool:
        """Whether `handle` is a MIG device's."""
        with self._lock:
            _, mig = self._mig_record(handle)
            return mig is not None

    def _mig_only(self, handle: FakeNvmlHandle) -> MigRecord:
        with self._lock:
            _, mig = self._mig_record(handle)
        return _supported(mig)

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeNvmlHandle) -> int:
        """GPU instance id of a MIG device (NOT_SUPPORTED on a GPU handle)."""
        return self._mig_only(handle).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeNvmlHandle) -> int:
        """Compute instance id of a MIG device (NOT_SUPPORTED on a GPU handle)."""
        return self._mig_only(handle).compute_instance_id

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
        self, handle: FakeNvmlHandle
    ) -> FakeNvmlHandle:
        """The parent GPU of a MIG device."""
        self._mig_only(handle)
        return self._devices[handle.index].handle

    # -- NVML: GPM ------------------------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, handle: FakeNvmlHandle) -> pynvml.c_nvmlGpmSupport_t:
        """GPM support: a device whose record has a GPM activity supports it."""
        record = self._record(handle)
        supported = any(getattr(record, name) is not None for name in _GPM_FIELDS.values())
        return pynvml.c_nvmlGpmSupport_t(
            version=pynvml.NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(supported)
        )

    def nvmlGpmSampleAlloc(self) -> Any:
        """A new sample, a real `c_nvmlGpmSample_t` pointer so it fits pynvml's structs."""
        buffer = ctypes.create_string_buffer(8)
        with self._lock:
            self._check_init()
            self._gpm_samples[ctypes.addressof(buffer)] = _GpmSample(buffer)
        return ctypes.cast(buffer, pynvml.c_nvmlGpmSample_t)

    def _gpm_sample(self, sample: Any) -> _GpmSample:
        address = ctypes.cast(sample, ctypes.c_void_p).value if sample else None
        found = self._gpm_samples.get(address or 0)
        if found is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return found

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        """Release a sample."""
        with self._lock:
            self._check_init()
            found = self._gpm_sample(gpmSample)
            del self._gpm_samples[ctypes.addressof(found.buffer)]

    def nvmlGpmSampleGet(self, device: FakeNvmlHandle, gpmSample: Any) -> Any:
        """Record the device's current GPM activities into `gpmSample`."""
        with self._lock:
            record = self._device(device).record
            sample = self._gpm_sample(gpmSample)
            values = {
                metric: value
                for metric, name in _GPM_FIELDS.items()
                if (value := getattr(record, name)) is not None
            }
            if not values:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            sample.device, sample.values = record.index, values
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        """Fill `metricsGet.metrics[:numMetrics]` from its two samples of one device."""
        with self._lock:
            self._check_init()
            if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
                raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            first = self._gpm_sample(metricsGet.sample1)
            second = self._gpm_sample(metricsGet.sample2)
            if first.device is None or first.device != second.device:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if not 0 < metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            for i in range(metricsGet.numMetrics):
                metric = metricsGet.metrics[i]
                value = second.values.get(metric.metricId)
                metric.nvmlReturn = (
                    pynvml.NVML_ERROR_NOT_SUPPORTED if value is None else pynvml.NVML_SUCCESS
                )
                metric.value = 0.0 if value is None else value
        return metricsGet


_UINT = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
_ULL = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
_POWER_SCOPE_GPU = getattr(pynvml, "NVML_POWER_SCOPE_GPU", 0)


class _RawFieldValue(ctypes.Structure):
    """`c_nvmlFieldValue_t`'s layout without pynvml's Python-level attribute hooks: filled at C
    speed, then handed out as the real struct over the same memory."""

    _fields_ = pynvml.c_nvmlFieldValue_t._fields_


class _FieldState(NamedTuple):
    """What a device's field values are read from at one moment."""

    record: GpuRecord
    draw_w: float | None
    instant_w: float | None
    energy_mj: float | None

    def link(self, number: int) -> NvLinkRecord | None:
        return next((link for link in self.record.nvlinks if link.link == number), None)


_Served = Callable[[_FieldState, int], tuple[int | None, int]]


def _milli_watts(watts: float | None) -> int | None:
    return None if watts is None else round(watts * 1000)


def _whole(number: float | None) -> int | None:
    return None if number is None else round(number)


def _served_fields() -> dict[int, _Served]:
    """How `nvmlDeviceGetFieldValues` answers each field id it serves, from a `_FieldState`
    and the scope: (value or None for NOT_SUPPORTED, value type), in nvml.h's units."""
    served: dict[int, _Served] = {}

    def put(name: str, serve: _Served) -> None:
        field_id = getattr(pynvml, name, None)
        if field_id is not None:
            served[field_id] = serve

    def gpu_power(get: Callable[[_FieldState], float | None]) -> _Served:
        """A power field: mW, the GPU scope only (a module scope needs a Grace CPU)."""
        return lambda s, scope: (_milli_watts(get(s)) if scope == _POWER_SCOPE_GPU else None, _UINT)

    def plain(get: Callable[[GpuRecord], int | None], kind: int = _UINT) -> _Served:
        return lambda s, scope: (get(s.record), kind)

    def link_bytes(sent: bool) -> _Served:
        def serve(s: _FieldState, scope: int) -> tuple[int | None, int]:
            link = s.link(scope)
            counted = None if link is None else (link.tx_bytes if sent else link.rx_bytes)
            return (None if counted is None else counted // 1024, _ULL)

        return serve

    def remapped(position: int) -> Callable[[GpuRecord], int | None]:
        def get(record: GpuRecord) -> int | None:
            rows = record.remapped_rows
            if rows is None:
                return None
            return int((rows.correctable, rows.uncorrectable, rows.pending, rows.failure)[position])

        return get

    put("NVML_FI_DEV_POWER_AVERAGE", gpu_power(lambda s: s.draw_w))
    put("NVML_FI_DEV_POWER_INSTANT", gpu_power(lambda s: s.instant_w))
    put("NVML_FI_DEV_POWER_CURRENT_LIMIT", gpu_power(lambda s: s.record.power_limit_w))
    put("NVML_FI_DEV_POWER_MIN_LIMIT", gpu_power(lambda s: s.record.min_power_limit_w))
    put("NVML_FI_DEV_POWER_MAX_LIMIT", gpu_power(lambda s: s.record.max_power_limit_w))
    put("NVML_FI_DEV_POWER_DEFAULT_LIMIT", gpu_power(lambda s: s.record.default_power_limit_w))
    put("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", lambda s, scope: (_whole(s.energy_mj), _ULL))
    put("NVML_FI_DEV_ENERGY", lambda s, scope: (_whole(s.energy_mj), _ULL))
    put("NVML_FI_DEV_MEMORY_TEMP", plain(lambda r: _whole(r.memory_temperature_c)))
    put("NVML_FI_DEV_PCIE_REPLAY_COUNTER", plain(lambda r: r.pcie_replay_count, _ULL))
    for reason, policy_field in telemetry._VIOLATION_FIELDS.items():
        put(policy_field, plain(functools.partial(_counter_ns, reason=reason), _ULL))
    for error_type, scope, name in (
        ("corrected", "volatile", "NVML_FI_DEV_ECC_SBE_VOL_TOTAL"),
        ("uncorrected", "volatile", "NVML_FI_DEV_ECC_DBE_VOL_TOTAL"),
        ("corrected", "aggregate", "NVML_FI_DEV_ECC_SBE_AGG_TOTAL"),
        ("uncorrected", "aggregate", "NVML_FI_DEV_ECC_DBE_AGG_TOTAL"),
    ):
        put(name, plain(functools.partial(_ecc_count, key=(error_type, scope)), _ULL))
    put("NVML_FI_DEV_RETIRED_SBE", plain(lambda r: r.retired_pages_single_bit))
    put("NVML_FI_DEV_RETIRED_DBE", plain(lambda r: r.retired_pages_double_bit))
    put(
        "NVML_FI_DEV_RETIRED_PENDING",
        plain(lambda r: None if r.retired_pages_pending is None else int(r.retired_pages_pending)),
    )
    for position, name in enumerate(("COR", "UNC", "PENDING", "FAILURE")):
        put(f"NVML_FI_DEV_REMAPPED_{name}", plain(remapped(position)))
    put("NVML_FI_DEV_NVLINK_LINK_COUNT", plain(lambda r: len(r.nvlinks) or None))
    put("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", link_bytes(sent=True))
    put("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", link_bytes(sent=False))
    return served


def _counter_ns(record: GpuRecord, reason: str) -> int | None:
    return record.clock_event_counters_ns.get(reason)


def _ecc_count(record: GpuRecord, key: tuple[str, str]) -> int | None:
    return record.ecc_errors.get(key)


_SERVED = _served_fields()


def _counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, counting its calls in the instance's `call_counts()`."""

    @functools.wraps(method)
    def call(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        with self._counts_lock:
            self._calls[name] += 1
        if self._faults or self._fault_file is not None:
            fault = self._fault(name, args)
            if fault is not None:
                if fault.block_s:
                    time.sleep(fault.block_s)
                if fault.error is not None:
                    raise _error(fault.error)
        return method(self, *args, **kwargs)

    return call


NVML_FUNCTIONS = frozenset(
    name for name, method in vars(FakeNvml).items() if name.startswith("nvml") and callable(method)
)
"""The NVML functions FakeNvml serves (and counts, and can inject faults into)."""

for _name in NVML_FUNCTIONS:
    setattr(FakeNvml, _name, _counted(_name, vars(FakeNvml)[_name]))


# -- recordings -> records ---------------------------------------------------------------------


@dataclass
class _GpuReadings:
    """The readings of one GPU in one cycle, gathered for building its record."""

    uuid: str
    values: dict[str, float] = field(default_factory=dict)
    by_label: dict[tuple[str, str], float] = field(default_factory=dict)
    info: dict[str, str] | None = None
    links: dict[int, dict[str, Any]] = field(default_factory=dict)
    migs: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    xids: dict[int, int] = field(default_factory=dict)
    violation_ns: dict[str, int] = field(default_factory=dict)
    integrated_s: dict[str, float] = field(default_factory=dict)


_PLAIN = frozenset(
    {
        metrics.UTILIZATION,
        metrics.MEMORY_UTILIZATION,
        metrics.MEMORY_USED,
        metrics.MEMORY_TOTAL,
        metrics.POWER,
        metrics.POWER_INSTANT,
        metrics.POWER_LIMIT,
        metrics.POWER_LIMIT_MIN,
        metrics.POWER_LIMIT_MAX,
        metrics.ENERGY,
        metrics.TEMPERATURE,
        metrics.MEMORY_TEMPERATURE,
        metrics.SM_CLOCK,
        metrics.MEMORY_CLOCK,
        metrics.RETIRED_PAGES_PENDING,
        metrics.REMAPPED_ROWS_PENDING,
        metrics.REMAPPED_ROWS_FAILED,
        metrics.PCIE_REPLAYS,
        metrics.SM_ACTIVE,
        metrics.SM_OCCUPANCY,
        metrics.TENSOR_ACTIVE,
        metrics.DRAM_ACTIVE,
    }
)
_BY_LABEL = {
    metrics.ECC_ERRORS: "type",
    metrics.ECC_LIFETIME_ERRORS: "type",
    metrics.RETIRED_PAGES: "cause",
    metrics.REMAPPED_ROWS: "cause",
    metrics.PCIE_THROUGHPUT: "direction",
}


def _label(reading: Reading, key: str) -> str:
    value = reading.labels.get(key)
    if value is None:
        raise ValueError(f"{reading.name}: label {key!r} missing in {dict(reading.labels)}")
    return value


def _int_label(reading: Reading, key: str) -> int:
    text = _label(reading, key)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{reading.name}: label {key}={text!r} is not a number") from None


def _decode(readings: Iterable[Reading]) -> _Frame:
    """Group one cycle's `hyperagent_gpu_*` readings by GPU and turn them into records."""
    gpus: dict[int, _GpuReadings] = {}
    for reading in readings:
        if not reading.name.startswith("hyperagent_gpu_") or "gpu" not in reading.labels:
            continue
        if reading.name not in metrics.HELP:
            continue
        index = _int_label(reading, "gpu")
        uuid = _label(reading, "uuid")
        gpu = gpus.setdefault(index, _GpuReadings(uuid))
        if gpu.uuid != uuid:
            raise ValueError(f"GPU {index} appears as {gpu.uuid} and as {uuid}")
        _gather(gpu, reading)
    frame = _Frame({}, {}, {}, {})
    for index, gpu in gpus.items():
        frame.records[index] = _record(index, gpu)
        if metrics.ENERGY in gpu.values:
            frame.energy_j[index] = gpu.values[metrics.ENERGY]
        if metrics.POWER_INSTANT in gpu.values:
            frame.instant_w[index] = gpu.values[metrics.POWER_INSTANT]
        frame.integrated_s[index] = gpu.integrated_s
        frame.xids[index] = gpu.xids
    return frame


def _gather(gpu: _GpuReadings, reading: Reading) -> None:
    name, value = reading.name, reading.value
    if name == metrics.GPU_INFO:
        gpu.info = dict(reading.labels)
    elif name in _PLAIN:
        gpu.values[name] = value
    elif name in _BY_LABEL:
        gpu.by_label[(name, _label(reading, _BY_LABEL[name]))] = value
    elif name == metrics.THROTTLE:
        reason = _label(reading, "reason")
        if reason in _VIOLATION_REASONS:
            gpu.violation_ns[reason] = round(value * 1e9)
        else:
            gpu.integrated_s[reason] = value
    elif name == metrics.XID_ERRORS:
        gpu.xids[_int_label(reading, "xid")] = round(value)
    elif name in (metrics.NVLINK_UP, metrics.NVLINK_DATA, metrics.NVLINK_ERRORS):
        link = gpu.links.setdefault(_int_label(reading, "link"), {"errors": {}})
        if name == metrics.NVLINK_UP:
            link["active"] = value >= 0.5
        elif name == metrics.NVLINK_DATA:
            link[f"{_label(reading, 'direction')}_bytes"] = round(value)
        else:
            link["errors"][_label(reading, "type")] = round(value)
    elif name in (metrics.MIG_INFO, metrics.MIG_MEMORY_USED, metrics.MIG_MEMORY_TOTAL):
        mig = gpu.migs.setdefault((_int_label(reading, "gi"), _int_label(reading, "ci")), {})
        if name == metrics.MIG_INFO:
            mig["uuid"] = reading.labels.get("mig_uuid") or None
            mig["profile"] = reading.labels.get("profile") or None
        else:
            mig["used" if name == metrics.MIG_MEMORY_USED else "total"] = round(value)


def _record(index: int, gpu: _GpuReadings) -> GpuRecord:
    if gpu.info is None:
        raise ValueError(f"GPU {index} ({gpu.uuid}) has readings but no {metrics.GPU_INFO}")
    values, by_label = gpu.values, gpu.by_label

    def get(name: str, scale: float = 1.0) -> float | None:
        return values[name] * scale if name in values else None

    def count(name: str, label: str | None = None) -> int | None:
        found = values.get(name) if label is None else by_label.get((name, label))
        return None if found is None else round(found)

    def flag(name: str) -> bool | None:
        return None if name not in values else values[name] >= 0.5

    def percent(name: str) -> float | None:
        return _percent_of(values[name]) if name in values else None

    ecc = {
        (error_type, scope): found
        for name, scope in (
            (metrics.ECC_ERRORS, "volatile"),
            (metrics.ECC_LIFETIME_ERRORS, "aggregate"),
        )
        for error_type in ("corrected", "uncorrected")
        if (found := count(name, error_type)) is not None
    }
    correctable = count(metrics.REMAPPED_ROWS, "correctable")
    uncorrectable = count(metrics.REMAPPED_ROWS, "uncorrectable")
    rows_pending = flag(metrics.REMAPPED_ROWS_PENDING)
    rows_failed = flag(metrics.REMAPPED_ROWS_FAILED)
    remapped = (
        RemappedRows(correctable, uncorrectable, rows_pending, rows_failed)
        if correctable is not None
        and uncorrectable is not None
        and rows_pending is not None
        and rows_failed is not None
        else None
    )
    migs = tuple(
        MigRecord(
            index=slot,
            gpu_instance_id=gi,
            compute_instance_id=ci,
            uuid=mig.get("uuid"),
            profile=mig.get("profile"),
            mem_total_bytes=mig.get("total"),
            mem_used_bytes=mig.get("used"),
        )
        for slot, ((gi, ci), mig) in enumerate(sorted(gpu.migs.items()))
    )
    links = tuple(
        NvLinkRecord(
            link=link,
            active=found.get("active"),
            tx_bytes=found.get("tx_bytes"),
            rx_bytes=found.get("rx_bytes"),
            errors=found["errors"],
        )
        for link, found in sorted(gpu.links.items())
    )
    pcie = {d: count(metrics.PCIE_THROUGHPUT, d) for d in ("tx", "rx")}
    util = get(metrics.UTILIZATION, 100)
    util_mem = get(metrics.MEMORY_UTILIZATION, 100)
    mhz = 1e-6
    return GpuRecord(
        index=index,
        name=gpu.info.get("model", ""),
        uuid=gpu.uuid,
        pci_bus_id="",
        driver=gpu.info.get("driver", ""),
        util_gpu_pct=None if util is None else round(util),
        util_mem_pct=None if util_mem is None else round(util_mem),
        mem_total_bytes=count(metrics.MEMORY_TOTAL),
        mem_used_bytes=count(metrics.MEMORY_USED),
        power_draw_w=get(metrics.POWER),
        power_limit_w=get(metrics.POWER_LIMIT),
        min_power_limit_w=get(metrics.POWER_LIMIT_MIN),
        max_power_limit_w=get(metrics.POWER_LIMIT_MAX),
        temperature_c=get(metrics.TEMPERATURE),
        sm_clock_mhz=get(metrics.SM_CLOCK, mhz),
        mem_clock_mhz=get(metrics.MEMORY_CLOCK, mhz),
        pcie_replay_count=count(metrics.PCIE_REPLAYS),
        memory_temperature_c=get(metrics.MEMORY_TEMPERATURE),
        pcie_tx_bytes_per_s=pcie["tx"],
        pcie_rx_bytes_per_s=pcie["rx"],
        clock_event_reasons=frozenset() if gpu.integrated_s else None,
        clock_event_counters_ns=gpu.violation_ns,
        ecc_errors=ecc,
        retired_pages_single_bit=count(metrics.RETIRED_PAGES, "single_bit_ecc"),
        retired_pages_double_bit=count(metrics.RETIRED_PAGES, "double_bit_ecc"),
        retired_pages_pending=flag(metrics.RETIRED_PAGES_PENDING),
        remapped_rows=remapped,
        mig_enabled=True if migs else None,
        mig_devices=migs,
        nvlinks=links,
        sm_active_pct=percent(metrics.SM_ACTIVE),
        sm_occupancy_pct=percent(metrics.SM_OCCUPANCY),
        tensor_active_pct=percent(metrics.TENSOR_ACTIVE),
        dram_active_pct=percent(metrics.DRAM_ACTIVE),
    )

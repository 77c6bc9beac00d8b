"""FakeNvml itself: the NVML calls of its parts over the replayed GPUs, construction from a
capture or a recording, replay of later recorded cycles, call counting and fault injection."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml

from hyperagent.capture.fake_nvml.controls import SimulationControls
from hyperagent.capture.fake_nvml.device import (
    HealthCalls,
    LibraryCalls,
    ProcessCalls,
    ReadingCalls,
)
from hyperagent.capture.fake_nvml.events import EventCalls
from hyperagent.capture.fake_nvml.faults import FAULTS_ENV, Fault, FaultFile, parse_faults
from hyperagent.capture.fake_nvml.fields import FieldValueCalls
from hyperagent.capture.fake_nvml.gpm import GpmCalls
from hyperagent.capture.fake_nvml.mig import MigCalls
from hyperagent.capture.fake_nvml.power import PowerCalls
from hyperagent.capture.fake_nvml.recordings import Frame, decode
from hyperagent.capture.fake_nvml.state import error
from hyperagent.capture.nvidia_smi import GpuRecord, parse_capture
from hyperagent.readings import Reading

_PROXIED = (
    "NVML_",
    "NVMLError",
    "nvmlMemory_v",
    "nvmlClocksEventReason",
    "nvmlClocksThrottleReason",
    "nvmlEventType",
    "c_nvml",
)


class FakeNvml(
    SimulationControls,
    LibraryCalls,
    ReadingCalls,
    PowerCalls,
    FieldValueCalls,
    HealthCalls,
    ProcessCalls,
    EventCalls,
    MigCalls,
    GpmCalls,
):
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
        super().__init__(gpus, driver, clock, writable, cap_response_s)
        self._counts_lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        self._last_frame: Frame | None = None
        self._faults = parse_faults(dict(faults) if faults is not None else None, NVML_FUNCTIONS)
        if faults_file is None and os.environ.get(FAULTS_ENV):
            faults_file = Path(os.environ[FAULTS_ENV])
        self._fault_file = None if faults_file is None else FaultFile(faults_file, NVML_FUNCTIONS)

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
        frame = decode(readings)
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
        frame = decode(readings)
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

    def set_faults(self, faults: Mapping[str, Any] | None) -> None:
        """Inject `faults` (see the class doc) from now on, replacing those set before (not the
        file's); None or {} clears them. Raises ValueError for a malformed mapping."""
        self._faults = parse_faults(dict(faults) if faults is not None else None, NVML_FUNCTIONS)

    def _fault(self, name: str, args: tuple[Any, ...]) -> Fault | None:
        """The fault a call of `name` with `args` gets now, if any."""
        found = self._faults.get(name) or self._faults.get("*")
        if found is None and self._fault_file is not None:
            from_file = self._fault_file.current()
            found = from_file.get(name) or from_file.get("*")
        return found if found is not None and found.applies(args) else None


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
                    raise error(fault.error)
        return method(self, *args, **kwargs)

    return call


NVML_FUNCTIONS = frozenset(
    name
    for klass in FakeNvml.__mro__
    for name, method in vars(klass).items()
    if name.startswith("nvml") and callable(method)
)
"""The NVML functions FakeNvml serves (and counts, and can inject faults into)."""

for _name in NVML_FUNCTIONS:
    setattr(FakeNvml, _name, _counted(_name, getattr(FakeNvml, _name)))

"""The replayed GPUs of a FakeNvml: its handles, devices and event sets, the lock guarding them,
and the lookups every NVML call of the fake starts with."""

from __future__ import annotations

import ctypes
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pynvml

from hyperagent.capture.nvidia_smi import GpuRecord, MigRecord

_T = TypeVar("_T")

# "No MIG instance" in event data: all ones (nvidia-ml-py 12.535 lacks the named constants).
NO_GPU_INSTANCE = getattr(pynvml, "NVML_GPU_INSTANCE_ID_ANY", ctypes.c_uint(-1).value)
NO_COMPUTE_INSTANCE = getattr(pynvml, "NVML_COMPUTE_INSTANCE_ID_ANY", ctypes.c_uint(-1).value)


def error(code: int) -> pynvml.NVMLError:
    """The pynvml exception NVML raises for `code`."""
    return pynvml.NVMLError(code)


def supported(value: _T | None) -> _T:
    """`value`; NOT_SUPPORTED where the capture lacks it (None)."""
    if value is None:
        raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return value


def milli(value: float | None) -> int:
    """A captured value in thousandths (W -> mW), NOT_SUPPORTED where lacking."""
    return round(supported(value) * 1000)


class FakeNvmlHandle:
    """An opaque device handle, valid only with the `FakeNvml` instance that made it.

    `mig` is the MIG device slot for a MIG device handle, None for a GPU.
    """

    __slots__ = ("_owner", "index", "mig")

    def __init__(self, owner: NvmlState, index: int, mig: int | None = None) -> None:
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

    def __init__(self, owner: NvmlState) -> None:
        self._owner = owner
        self.devices: set[int] = set()
        self.pending: deque[FakeEventData] = deque()
        self.freed = False


@dataclass
class GpmSample:
    """A GPM sample allocated through the fake: its buffer and what it last recorded."""

    buffer: Any
    device: int | None = None
    values: dict[int, float] = field(default_factory=dict)


@dataclass
class Device:
    """One replayed GPU: its current record and what NVML keeps about it beyond the record."""

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


class NvmlState:
    """The replayed GPUs and NVML's library state over them, guarded by one lock.

    Device `i` is `gpus[i]`; `driver` defaults to the first GPU's. The NVML calls of the
    fake are mixins over this class.
    """

    def __init__(
        self,
        gpus: list[GpuRecord],
        driver: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        writable: bool = True,
        cap_response_s: float = 0.0,
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
        self._events = threading.Condition(self._lock)
        self._event_sets: list[FakeEventSet] = []
        self._gpm_samples: dict[int, GpmSample] = {}
        self._refcount = 0
        now = clock()
        self._devices = [
            Device(
                record=gpu, handle=FakeNvmlHandle(self, gpu.index), energy_mj=0.0, integrated_to=now
            )
            for gpu in gpus
        ]

    def _check_init(self) -> None:
        if self._refcount == 0:
            raise error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: object, mig: bool = False) -> Device:
        """The device behind `handle`; a MIG device handle only where `mig` allows one."""
        self._check_init()
        if not isinstance(handle, FakeNvmlHandle) or handle._owner is not self:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        device = self._devices[handle.index]
        if device.failure is not None:
            raise error(device.failure)
        if handle.mig is not None and not mig:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device

    def _record(self, handle: object) -> GpuRecord:
        """`_device(handle).record`, inlined: most calls of a read go through here."""
        with self._lock:
            if self._refcount == 0:
                raise error(pynvml.NVML_ERROR_UNINITIALIZED)
            if not isinstance(handle, FakeNvmlHandle) or handle._owner is not self:
                raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            device = self._devices[handle.index]
            if device.failure is not None:
                raise error(device.failure)
            if handle.mig is not None:
                raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return device.record

    def _mig_record(self, handle: object) -> tuple[Device, MigRecord | None]:
        """The device and, for a MIG device handle, its MIG record (call under the lock)."""
        device = self._device(handle, mig=True)
        assert isinstance(handle, FakeNvmlHandle)
        if handle.mig is None:
            return device, None
        found = device.mig(handle.mig)
        if found is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return device, found

    def _control(self, index: int) -> Device:
        """Device `index` for a simulation control; IndexError for none."""
        if not 0 <= index < len(self._devices):
            raise IndexError(f"no GPU {index}; this fake has {len(self._devices)}")
        return self._devices[index]

    def _raise_xid(self, device: Device, xid: int) -> None:
        """Hand XID `xid` to the event sets listening on `device`, or keep it for the first
        set to register it (call under the lock)."""
        listeners = [s for s in self._event_sets if device.record.index in s.devices]
        if not listeners:
            device.xid_backlog.append(xid)
            return
        event = FakeEventData(
            device=device.handle,
            eventType=pynvml.nvmlEventTypeXidCriticalError,
            eventData=xid,
            gpuInstanceId=NO_GPU_INSTANCE,
            computeInstanceId=NO_COMPUTE_INSTANCE,
        )
        for event_set in listeners:
            event_set.pending.append(event)

"""The fake's NVML event sets: XID critical errors raised on a device, waited for in real time."""

from __future__ import annotations

import time

import pynvml

from hyperagent.capture.fake_nvml.state import (
    FakeEventData,
    FakeEventSet,
    FakeNvmlHandle,
    NvmlState,
    error,
)

_SUPPORTED_EVENTS = pynvml.nvmlEventTypeXidCriticalError


class EventCalls(NvmlState):
    """NVML event sets over the replayed GPUs (XID critical errors only)."""

    def nvmlEventSetCreate(self) -> FakeEventSet:
        """A new, empty event set."""
        with self._lock:
            self._check_init()
            event_set = FakeEventSet(self)
            self._event_sets.append(event_set)
            return event_set

    def _event_set(self, event_set: object) -> FakeEventSet:
        if not isinstance(event_set, FakeEventSet) or event_set._owner is not self:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if event_set.freed:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
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
                raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
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
                    raise error(pynvml.NVML_ERROR_TIMEOUT)
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

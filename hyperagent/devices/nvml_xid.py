"""XID critical-error events of NVIDIA GPUs: an NVML event set that a thread of its own waits
on, and the counts per GPU and XID."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from hyperagent.devices.metrics import XID_ERRORS
from hyperagent.devices.nvml_api import NvmlCalls, handle_key, nvml_error_code, nvml_text
from hyperagent.devices.nvml_gpu import GpuState
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)


class XidWatcher:
    """Counts the XID events of the GPUs it was started on, from ``start()`` on.

    A dedicated thread waits on the event set with an ``event_wait_ms`` timeout (an event ends
    the wait at once; the timeout is how long the thread outlives ``stop()``, holding its own
    NVML reference, and how often it wakes while idle). Counting finds an event's GPU by its
    handle, calling NVML only for a handle it does not know.
    """

    def __init__(self, nv: Any, calls: NvmlCalls, event_wait_ms: int) -> None:
        self.nv = nv
        self._calls = calls
        self.event_wait_ms = event_wait_ms
        self.thread: threading.Thread | None = None
        """The thread waiting on the event set, None while stopped or where XID events are
        unavailable."""
        self._stop = threading.Event()
        self._by_handle: dict[Any, GpuState] = {}
        self._by_uuid: dict[str, GpuState] = {}
        self._lock = threading.Lock()
        self._xids: dict[tuple[int, int], tuple[dict[str, str], int]] = {}

    def start(self, states: Sequence[GpuState]) -> None:
        """Register ``states``' GPUs for XID events and start the thread (NVML initialised;
        raises pynvml.NVMLError for a failure other than events being unavailable)."""
        self._by_uuid = {state.identity.uuid: state for state in states}
        self._by_handle = {handle_key(s.identity.handle): s for s in states}
        nv = self.nv
        quiet = (*self._calls.unsupported, nv.NVML_ERROR_NO_PERMISSION)
        try:
            events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            if nvml_error_code(e) not in quiet:
                raise
            log.info("XID events unavailable: %s", e)
            return
        registered = 0
        for state in states:
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
        self._stop = stop = threading.Event()
        self.thread = threading.Thread(
            target=self._watch, args=(events, stop), name="nvml-xid-events", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        """Stop the thread (it frees its event set when its wait returns) and forget the GPUs."""
        self.thread = None
        self._stop.set()
        self._by_uuid, self._by_handle = {}, {}

    def counts(self) -> dict[tuple[int, int], int]:
        """XID events counted since ``start()``, by (GPU index, XID)."""
        with self._lock:
            return {key: count for key, (_, count) in self._xids.items()}

    def readings(self) -> list[Reading]:
        """The counts as ``hyperagent_gpu_xid_errors_total`` readings."""
        with self._lock:
            return [
                Reading(XID_ERRORS, float(count), labels, Kind.COUNTER)
                for labels, count in self._xids.values()
            ]

    def _watch(self, events: Any, stop: threading.Event) -> None:
        """Count XID events until ``stop``; then free the event set and drop the watcher's NVML
        reference (close() does not wait for the wait in progress)."""
        nv = self.nv
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
                    self._count(event)
        finally:
            self._calls.quietly(nv.nvmlEventSetFree, events)
            try:
                nv.nvmlShutdown()
            except nv.NVMLError as e:
                log.debug("NVML shutdown of the event watcher failed: %s", e)

    def _count(self, event: Any) -> None:
        """Count an XID event, finding its GPU by handle (no NVML call: it may be lost)."""
        nv = self.nv
        state = self._by_handle.get(handle_key(event.device))
        if state is None:
            try:
                state = self._by_uuid.get(nvml_text(nv.nvmlDeviceGetUUID(event.device)))
            except nv.NVMLError as e:
                log.warning("XID %s on a GPU NVML cannot name: %s", event.eventData, e)
                return
        if state is None:
            log.warning("XID %s on a GPU this source did not enumerate", event.eventData)
            return
        xid = int(event.eventData)
        key = (state.identity.index, xid)
        log.warning("XID %d on GPU %d (%s)", xid, state.identity.index, state.identity.uuid)
        with self._lock:
            found = self._xids.get(key)
            if found is None:
                self._xids[key] = ({**state.labels, "xid": str(xid)}, 1)
            else:
                self._xids[key] = (found[0], found[1] + 1)

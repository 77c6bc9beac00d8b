"""Device calls under the runner's rules: a timeout, at most one call in flight, errors as data.

A vendor library such as NVML answers in a blocking call that can hang for seconds or for good
(a GPU fallen off the bus, a driver stuck in a reset). Every call into such a library goes
through the library's :class:`DeviceGate`: one worker thread of its own runs the calls one at a
time; a caller waits for its call at most ``timeout_s`` (its time in the queue included) and
then gets :class:`~hyperagent.errors.DeviceTimeout`; a call that hangs keeps the worker thread,
and while it has been in flight longer than its own timeout every new call fails at once with
:class:`~hyperagent.errors.DeviceBusy` ("busy: a call has been in flight for N s") instead of
queueing a thread behind it. The caller turns these errors into data (a source down, a refused
setting, a reading left out); none of them blocks the event loop.

"Device" here is the whole library, not one GPU handle: NVML serialises its calls into the
kernel driver (one lock for the resource manager, held across the ioctl), so a call that hangs
on one GPU usually holds calls to every other GPU of the node as well, and enumeration and
init calls have no handle at all. One gate per library also means a hung driver costs exactly
one thread, however many GPUs and callers there are. :meth:`DeviceGate.of` gives every caller
holding the same library object (the telemetry source, the power-cap actuator, the agent) the
same gate.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any, TypeVar

from hyperagent.errors import DeviceBusy, DeviceTimeout

log = logging.getLogger(__name__)

_T = TypeVar("_T")

IDLE_EXIT_S = 5.0
"""An idle worker thread exits after this long; the next call starts a new one."""


@dataclass
class _Call:
    call: Callable[..., Any]
    args: tuple[Any, ...]
    timeout_s: float
    what: str
    future: Future[Any]


@dataclass
class InFlight:
    """The call the worker is running: what it is, since when (monotonic), its timeout, and
    whether its caller stopped waiting for it (it is overdue from then on)."""

    what: str
    since: float
    timeout_s: float
    future: Future[Any]
    abandoned: bool = False

    def overdue(self, now: float) -> bool:
        return self.abandoned or now - self.since > self.timeout_s


class DeviceGate:
    """One library's calls, one at a time on one worker thread, each bounded by its timeout.

    ``name`` names the library in errors and logs ("nvml"). :meth:`run` is for the event loop,
    :meth:`call` for code already in a worker thread (the actuator); both raise DeviceTimeout
    or DeviceBusy (DeviceCallError) besides what the call itself raises. A call made from the
    gate's own worker thread (a gated function calling another) runs at once, in place.
    """

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._queue: SimpleQueue[_Call] = SimpleQueue()
        self._worker: threading.Thread | None = None
        self._queued = 0
        self.in_flight: InFlight | None = None
        self.timeouts = 0
        """Calls whose caller stopped waiting at their timeout."""
        self.busy = 0
        """Calls refused at once because another had been in flight past its timeout."""

    @classmethod
    def of(cls, library: Any, name: str = "nvml") -> DeviceGate:
        """The gate of ``library`` (the ``pynvml`` module, a fake with its API): the same
        object for every caller holding the same library."""
        with _registry_lock:
            try:
                gate = _gates.get(library)
                if gate is None:
                    gate = _gates[library] = cls(name)
                return gate
            except TypeError:  # not weakly referenceable: kept for the process's life
                found = _unweakable.get(id(library))
                if found is None:
                    found = _unweakable[id(library)] = (library, cls(name))
                return found[1]

    # -- calling --------------------------------------------------------------------------------

    async def run(
        self, call: Callable[..., _T], *args: Any, timeout_s: float, what: str = ""
    ) -> _T:
        """``call(*args)`` on the gate's worker, awaited at most ``timeout_s``."""
        if self._on_worker():
            return call(*args)
        future = self._submit(call, args, timeout_s, what)
        answer = asyncio.wrap_future(future)
        try:
            done, _ = await asyncio.wait({answer}, timeout=timeout_s)
        except asyncio.CancelledError:
            answer.cancel()  # a call still queued never runs
            raise
        if not done:
            answer.cancel()
            raise self._gave_up(future, what or _name(call), timeout_s)
        return answer.result()

    def call(self, call: Callable[..., _T], *args: Any, timeout_s: float, what: str = "") -> _T:
        """``call(*args)`` on the gate's worker, waited for at most ``timeout_s`` (blocking:
        from a worker thread, never from the event loop)."""
        if self._on_worker():
            return call(*args)
        future = self._submit(call, args, timeout_s, what)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            raise self._gave_up(future, what or _name(call), timeout_s) from None

    # -- the worker -----------------------------------------------------------------------------

    def _on_worker(self) -> bool:
        return threading.current_thread() is self._worker

    def _submit(
        self, call: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, what: str
    ) -> Future[Any]:
        current, now = self.in_flight, self._clock()
        if current is not None and current.overdue(now):
            self.busy += 1
            raise DeviceBusy(
                f"{self.name} busy: a call ({current.what}) has been in flight for"
                f" {now - current.since:.1f} s"
            )
        future: Future[Any] = Future()
        with self._lock:
            self._queue.put(_Call(call, args, timeout_s, what or _name(call), future))
            self._queued += 1
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name=f"hyperagent-{self.name}", daemon=True
                )
                self._worker.start()
        return future

    def _gave_up(self, future: Future[Any], what: str, timeout_s: float) -> DeviceTimeout:
        self.timeouts += 1
        if future.cancel():
            return DeviceTimeout(f"{self.name} {what}: waited {timeout_s:g} s behind another call")
        current = self.in_flight
        if current is not None and current.future is future:
            current.abandoned = True
        return DeviceTimeout(f"{self.name} {what}: timed out after {timeout_s:g} s")

    def _work(self) -> None:
        """Run queued calls until the queue has been empty for ``IDLE_EXIT_S``. A daemon
        thread: a call that never returns does not hold the process at exit."""
        while True:
            try:
                item = self._queue.get(timeout=IDLE_EXIT_S)
            except Empty:
                with self._lock:
                    if self._queued == 0:
                        self._worker = None
                        return
                continue
            with self._lock:
                self._queued -= 1
            began = self._clock()
            self.in_flight = InFlight(item.what, began, item.timeout_s, item.future)
            if not item.future.set_running_or_notify_cancel():
                self.in_flight = None
                continue  # its caller gave up while it waited
            try:
                result = item.call(*item.args)
            except BaseException as e:  # handed to the caller, who may have left
                item.future.set_exception(e)
            else:
                item.future.set_result(result)
            finally:
                self.in_flight = None
            took = self._clock() - began
            if took > item.timeout_s:
                log.info(
                    "%s: %s returned after %.1f s, past its %g s timeout",
                    self.name,
                    item.what,
                    took,
                    item.timeout_s,
                )


_gates: weakref.WeakKeyDictionary[Any, DeviceGate] = weakref.WeakKeyDictionary()
"""The gate of each library object (see DeviceGate.of)."""
_unweakable: dict[int, tuple[Any, DeviceGate]] = {}
_registry_lock = threading.Lock()


def _name(call: Callable[..., Any]) -> str:
    return getattr(call, "__name__", None) or type(call).__name__

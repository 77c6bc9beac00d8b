"""Privileged writes, kept in one narrow place: accelerator power limits through the device
layer (NVML, amdsmi, HLML: :mod:`hyperagent.devices`).

Reads before it writes, skips no-op writes, remembers each GPU's original limit the first
time it changes it, and puts them back on ``restore``. The originals are also kept in a state
file (written durably: fsynced, then renamed) until restored, so that after a crash the next
start puts them back. A node's caps change all or nothing: when one GPU fails, the GPUs this
``apply`` changed get their previous limits back. After a change it measures how long the GPUs
took to obey it (see ``PowerCapActuator.apply``). Every vendor call goes through the library's
:class:`~hyperagent.gate.DeviceGate` with ``timeout_s``, so a hung driver costs a timeout, not a
thread. Blocking: call from a worker thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import orjson

from hyperagent import durable
from hyperagent.devices import as_library
from hyperagent.devices.base import Accelerator, DeviceLibrary, call_name, clamp_mw
from hyperagent.errors import ActuationError, DeviceCallError
from hyperagent.gate import DeviceGate

_T = TypeVar("_T")
_M = TypeVar("_M", bound=Callable[..., Any])

log = logging.getLogger(__name__)


def _serialised(method: _M) -> _M:
    """Run ``method`` under the actuator's lock: the agent applies from its MQTT handler and
    restores on shutdown or when the coordinator goes offline, each from a worker thread, and a
    thread cannot be cancelled, so an apply may still run when a restore starts."""

    @functools.wraps(method)
    def serialised(self: PowerCapActuator, *args: Any) -> Any:
        with self._lock:
            return method(self, *args)

    return serialised  # type: ignore[return-value]


@dataclass(frozen=True)
class AppliedCap:
    """What one GPU ended up with after a power-cap request."""

    gpu: int
    uuid: str
    requested_w: float
    applied_w: float
    changed: bool
    latency_s: float | None = None
    """Seconds from the set call until the GPU's instant power was at or under the new limit;
    None when the limit did not change, the GPU reports no instant power, or it stayed above
    the limit for the whole ``latency_timeout_s``."""


class PowerCapActuator:
    """Applies one power cap to every GPU of the node (or of one job), clamped to each
    device's constraints.

    ``devices`` is a :class:`~hyperagent.devices.base.DeviceLibrary`, or the ``pynvml`` module
    (or a fake with its API), which stands for NVML's. ``latency_timeout_s`` bounds the wait
    for the GPUs to obey a new limit, polling their instant power (NVML_FI_DEV_POWER_INSTANT,
    amdsmi's current socket power, HLML's power usage) every ``poll_s`` seconds of ``clock``.
    ``timeout_s`` bounds each vendor call (the agent passes ``sources.timeout_s``); a call over
    it, or refused because another has hung, fails as a vendor error would.
    """

    def __init__(
        self,
        devices: DeviceLibrary | Any,
        state_file: Path | None = None,
        *,
        latency_timeout_s: float = 3.0,
        poll_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
        timeout_s: float = 2.0,
    ) -> None:
        self.library: DeviceLibrary = as_library(devices)
        self.gate = DeviceGate.of(self.library.module, self.library.name)
        self._errors: tuple[type[BaseException], ...] = (*self.library.errors, DeviceCallError)
        self.timeout_s = timeout_s
        self.state_file = state_file
        self.latency_timeout_s = latency_timeout_s
        self.poll_s = poll_s
        self._clock = clock
        self._sleep = sleep
        self._handles: list[tuple[int, str, Accelerator]] | None = None
        self._lock = threading.RLock()
        self.original_mw: dict[str, tuple[Accelerator, int]] = {}
        """uuid -> (device, limit before hyperagent first changed it)."""
        self.last_latency_s: float | None = None
        """The longest ``AppliedCap.latency_s`` of the last ``apply`` that changed a limit and
        measured it: how long this node's GPUs take to draw under a new cap, for the settle
        window of a trial."""

    def _call(self, call: Callable[..., _T], *args: Any) -> _T:
        """One vendor call through the gate; raises the library's error or DeviceCallError."""
        return self.gate.call(call, *args, timeout_s=self.timeout_s, what=call_name(call))

    def _save(self) -> None:
        """Keep the originals in the state file (fsynced, renamed over the old one); none left:
        remove it."""
        if self.state_file is None:
            return
        data = {uuid: mw for uuid, (_, mw) in self.original_mw.items()}
        try:
            if not data:
                self.state_file.unlink(missing_ok=True)
                return
            durable.write_file(self.state_file, orjson.dumps(data))
        except OSError as e:
            log.error("cannot keep the original power limits in %s: %s", self.state_file, e)

    @_serialised
    def recover(self) -> int:
        """Put back the limits a crashed run left changed (from the state file); returns how
        many GPUs it restored. A GPU that is gone is logged and skipped."""
        if self.state_file is None or not self.state_file.exists():
            return 0
        try:
            saved = orjson.loads(self.state_file.read_bytes())
        except (OSError, orjson.JSONDecodeError) as e:
            log.error("unreadable power-limit state %s: %s", self.state_file, e)
            return 0
        self._devices()
        if not isinstance(saved, dict):
            log.error("unreadable power-limit state %s: not an object", self.state_file)
            return 0
        for uuid, mw in saved.items():
            try:
                handle = self._call(self.library.by_uuid, uuid)
            except self._errors as e:
                log.error("GPU %s from the power-limit state is gone: %s", uuid, e)
                continue
            if isinstance(mw, int):
                self.original_mw.setdefault(uuid, (handle, mw))
        return self.restore()

    def _translate(self, error: BaseException, what: str) -> ActuationError:
        if isinstance(error, DeviceCallError):
            return ActuationError(f"{what}: {error}")
        return self.library.translate(error, what)

    def _devices(self) -> list[tuple[int, str, Accelerator]]:
        if self._handles is None:
            try:
                found = self._call(self.library.power_devices)
            except self._errors as e:
                raise self._translate(e, "enumerating GPUs") from e
            self._handles = [(d.identity.index, d.identity.uuid, d) for d in found]
        return self._handles

    def _selected(self, gpus: Collection[int] | None) -> list[tuple[int, str, Accelerator]]:
        """The node's GPUs whose index is in ``gpus`` (None: every GPU)."""
        found = self._devices()
        return found if gpus is None else [d for d in found if d[0] in gpus]

    @_serialised
    def limits_w(self, gpus: Collection[int] | None = None) -> tuple[float, float] | None:
        """The power-limit range every GPU (of ``gpus``, None: of the node) accepts
        (intersection), or None."""
        lows, highs = [], []
        for index, _, h in self._selected(gpus):
            try:
                low, high = self._call(h.power_limit_constraints_mw)
            except self._errors as e:
                raise self._translate(e, f"GPU {index} limit constraints") from e
            lows.append(low / 1000)
            highs.append(high / 1000)
        if not lows or max(lows) > min(highs):
            return None
        return max(lows), min(highs)

    @_serialised
    def apply(self, watts: float, gpus: Collection[int] | None = None) -> list[AppliedCap]:
        """Set ``watts`` (clamped to each GPU's [min, max]) on every GPU whose index is in
        ``gpus`` (None: every GPU of the node; two jobs on one node cap only their own), all
        or nothing.

        When a GPU fails (an NVML error, a call over ``timeout_s``), the GPUs this call changed
        get their previous limits back (best effort: a put-back that fails is logged) and
        ActuationError names the GPU (index and UUID) and the error. Returns once every changed
        GPU's instant power is at or under its new limit (or after ``latency_timeout_s``), with
        each one's latency in ``AppliedCap.latency_s``, the longest in ``last_latency_s``.
        """
        results = []
        changes: dict[int, tuple[Accelerator, float, float]] = {}
        previous: list[tuple[int, str, Accelerator, int]] = []
        """(index, uuid, handle, limit before this call) of every GPU a set call was made on."""
        for index, uuid, h in self._selected(gpus):
            setting = False
            try:
                target = clamp_mw(watts, self._call(h.power_limit_constraints_mw))
                current = self._call(h.power_limit_mw)
                changed = current != target
                if changed:
                    if uuid not in self.original_mw:
                        self.original_mw[uuid] = (h, current)
                        self._save()
                    began = self._clock()
                    setting = True
                    previous.append((index, uuid, h, current))
                    self._call(h.set_power_limit_mw, target)
                    changes[index] = (h, target / 1000, began)
            except self._errors as e:
                if setting and not isinstance(e, DeviceCallError):
                    previous.pop()  # the library refused the set: that GPU kept its limit
                    if self.original_mw.get(uuid, (None, None))[1] == current:
                        del self.original_mw[uuid]
                self._put_back(previous)
                raise self._translate(e, f"GPU {index} ({uuid}) power limit") from e
            results.append(AppliedCap(index, uuid, watts, target / 1000, changed))
        if not changes:
            return results
        latencies = self._latencies(changes)
        if latencies:
            self.last_latency_s = max(latencies.values())
        return [replace(r, latency_s=latencies.get(r.gpu)) for r in results]

    def _put_back(self, previous: list[tuple[int, str, Accelerator, int]]) -> None:
        """Give the GPUs of a failed ``apply`` the limits they had before it; each failure is
        logged and the rest still tried."""
        for index, uuid, h, limit_mw in previous:
            try:
                self._call(h.set_power_limit_mw, limit_mw)
            except self._errors as e:
                log.error(
                    "GPU %d (%s): could not put back its %.0f W power limit: %s",
                    index,
                    uuid,
                    limit_mw / 1000,
                    e,
                )
                continue
            original = self.original_mw.get(uuid)
            if original is not None and original[1] == limit_mw:
                del self.original_mw[uuid]
        self._save()

    def _latencies(self, changes: dict[int, tuple[Accelerator, float, float]]) -> dict[int, float]:
        """Seconds from each set call until the GPU's instant power was at or under its new
        limit, by GPU index; GPUs without instant power, or still above after
        ``latency_timeout_s``, are left out."""
        waiting = dict(changes)
        found: dict[int, float] = {}
        deadline = self._clock() + self.latency_timeout_s
        while waiting:
            for index, (h, limit_w, began) in list(waiting.items()):
                try:
                    power_w = self._call(h.instant_power_w)
                except self._errors as e:
                    log.debug("GPU %d: no instant power to time the new cap: %s", index, e)
                    power_w = None
                if power_w is None:
                    del waiting[index]
                elif power_w <= limit_w:
                    found[index] = self._clock() - began
                    del waiting[index]
            if not waiting or self._clock() >= deadline:
                break
            self._sleep(self.poll_s)
        for index, (_, limit_w, _) in waiting.items():
            log.info(
                "GPU %d still drew over its new %.0f W limit after %.1f s",
                index,
                limit_w,
                self.latency_timeout_s,
            )
        return found

    @_serialised
    def restore(self, gpus: Collection[int] | None = None) -> int:
        """Put back every limit hyperagent changed (on the GPUs whose index is in ``gpus``;
        None: on every GPU); returns how many were restored."""
        restored = 0
        chosen = None if gpus is None else {uuid for _, uuid, _ in self._selected(gpus)}
        for uuid, (h, original) in list(self.original_mw.items()):
            if chosen is not None and uuid not in chosen:
                continue
            try:
                if self._call(h.power_limit_mw) != original:
                    self._call(h.set_power_limit_mw, original)
                restored += 1
                del self.original_mw[uuid]
            except self._errors as e:
                log.error("could not restore the power limit of %s: %s", uuid, e)
        self._save()
        return restored

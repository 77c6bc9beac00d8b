"""Privileged writes, kept in one narrow place: GPU power limits through NVML.

Reads before it writes, skips no-op writes, remembers each GPU's original limit the first
time it changes it, and puts them back on ``restore``. The originals are also kept in a state
file until restored, so that after a crash the next start puts them back. After a change it
measures how long the GPUs took to obey it (see ``PowerCapActuator.apply``). Blocking: call
from a worker thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from hyperagent.errors import ActuationError, NoPermission, NotSupported
from hyperagent.sources.nvml import instant_power_w, nvml_error_code

log = logging.getLogger(__name__)


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
    """Applies one power cap to every GPU of the node, clamped to each device's constraints.

    ``latency_timeout_s`` bounds the wait for the GPUs to obey a new limit, polling their
    instant power (NVML_FI_DEV_POWER_INSTANT) every ``poll_s`` seconds of ``clock``.
    """

    def __init__(
        self,
        nvml: Any,
        state_file: Path | None = None,
        *,
        latency_timeout_s: float = 3.0,
        poll_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        self.nvml = nvml
        self.state_file = state_file
        self.latency_timeout_s = latency_timeout_s
        self.poll_s = poll_s
        self._clock = clock
        self._sleep = sleep
        self._handles: list[tuple[int, str, Any]] | None = None
        self.original_mw: dict[str, tuple[Any, int]] = {}
        """uuid -> (handle, limit before hyperagent first changed it)."""
        self.last_latency_s: float | None = None
        """The longest ``AppliedCap.latency_s`` of the last ``apply`` that changed a limit and
        measured it: how long this node's GPUs take to draw under a new cap, for the settle
        window of a trial."""

    def _save(self) -> None:
        if self.state_file is None:
            return
        data = {uuid: mw for uuid, (_, mw) in self.original_mw.items()}
        try:
            if not data:
                self.state_file.unlink(missing_ok=True)
                return
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            partial = self.state_file.with_suffix(".tmp")
            partial.write_bytes(orjson.dumps(data))
            os.replace(partial, self.state_file)
        except OSError as e:
            log.error("cannot keep the original power limits in %s: %s", self.state_file, e)

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
        nv = self.nvml
        self._devices()
        if not isinstance(saved, dict):
            log.error("unreadable power-limit state %s: not an object", self.state_file)
            return 0
        for uuid, mw in saved.items():
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid)
            except nv.NVMLError as e:
                log.error("GPU %s from the power-limit state is gone: %s", uuid, e)
                continue
            if isinstance(mw, int):
                self.original_mw.setdefault(uuid, (handle, mw))
        return self.restore()

    def _translate(self, error: Exception, what: str) -> ActuationError:
        code = nvml_error_code(error)
        nv = self.nvml
        if code == nv.NVML_ERROR_NO_PERMISSION:
            return NoPermission(f"{what}: no permission (needs root or CAP_SYS_ADMIN)", code)
        if code == nv.NVML_ERROR_NOT_SUPPORTED:
            return NotSupported(f"{what}: not supported by this GPU", code)
        return ActuationError(f"{what}: {error}", code)

    def _devices(self) -> list[tuple[int, str, Any]]:
        if self._handles is None:
            nv = self.nvml
            try:
                nv.nvmlInit()
                handles = []
                for i in range(nv.nvmlDeviceGetCount()):
                    h = nv.nvmlDeviceGetHandleByIndex(i)
                    uuid = nv.nvmlDeviceGetUUID(h)
                    handles.append((i, uuid.decode() if isinstance(uuid, bytes) else uuid, h))
            except nv.NVMLError as e:
                raise self._translate(e, "enumerating GPUs") from e
            self._handles = handles
        return self._handles

    def limits_w(self) -> tuple[float, float] | None:
        """The power-limit range every GPU of the node accepts (intersection), or None."""
        nv = self.nvml
        lows, highs = [], []
        for index, _, h in self._devices():
            try:
                low, high = nv.nvmlDeviceGetPowerManagementLimitConstraints(h)
            except nv.NVMLError as e:
                raise self._translate(e, f"GPU {index} limit constraints") from e
            lows.append(low / 1000)
            highs.append(high / 1000)
        if not lows or max(lows) > min(highs):
            return None
        return max(lows), min(highs)

    def apply(self, watts: float) -> list[AppliedCap]:
        """Set ``watts`` (clamped to each GPU's [min, max]) on every GPU; raises ActuationError.

        Returns once every changed GPU's instant power is at or under its new limit (or after
        ``latency_timeout_s``), with each one's latency in ``AppliedCap.latency_s``, the
        longest in ``last_latency_s``.
        """
        nv = self.nvml
        results = []
        changes: dict[int, tuple[Any, float, float]] = {}
        for index, uuid, h in self._devices():
            what = f"GPU {index} power limit"
            try:
                low, high = nv.nvmlDeviceGetPowerManagementLimitConstraints(h)
                target = round(min(max(watts * 1000, low), high))
                current = nv.nvmlDeviceGetPowerManagementLimit(h)
                changed = current != target
                if changed:
                    if uuid not in self.original_mw:
                        self.original_mw[uuid] = (h, current)
                        self._save()
                    began = self._clock()
                    nv.nvmlDeviceSetPowerManagementLimit(h, target)
                    changes[index] = (h, target / 1000, began)
            except nv.NVMLError as e:
                raise self._translate(e, what) from e
            results.append(AppliedCap(index, uuid, watts, target / 1000, changed))
        if not changes:
            return results
        latencies = self._latencies(changes)
        if latencies:
            self.last_latency_s = max(latencies.values())
        return [replace(r, latency_s=latencies.get(r.gpu)) for r in results]

    def _latencies(self, changes: dict[int, tuple[Any, float, float]]) -> dict[int, float]:
        """Seconds from each set call until the GPU's instant power was at or under its new
        limit, by GPU index; GPUs without instant power, or still above after
        ``latency_timeout_s``, are left out."""
        nv = self.nvml
        waiting = dict(changes)
        found: dict[int, float] = {}
        deadline = self._clock() + self.latency_timeout_s
        while waiting:
            for index, (h, limit_w, began) in list(waiting.items()):
                try:
                    power_w = instant_power_w(nv, h)
                except nv.NVMLError as e:
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

    def restore(self) -> int:
        """Put back every limit hyperagent changed; returns how many were restored."""
        nv = self.nvml
        restored = 0
        for uuid, (h, original) in list(self.original_mw.items()):
            try:
                if nv.nvmlDeviceGetPowerManagementLimit(h) != original:
                    nv.nvmlDeviceSetPowerManagementLimit(h, original)
                restored += 1
                del self.original_mw[uuid]
            except nv.NVMLError as e:
                log.error("could not restore the power limit of %s: %s", uuid, e)
        self._save()
        return restored

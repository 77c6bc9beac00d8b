"""Privileged writes, kept in one narrow place: GPU power limits through NVML.

Reads before it writes, skips no-op writes, remembers each GPU's original limit the first
time it changes it, and puts them back on ``restore``. The originals are also kept in a state
file until restored, so that after a crash the next start puts them back. Blocking: call from
a worker thread.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from hyperagent.errors import ActuationError, NoPermission, NotSupported
from hyperagent.sources.nvml import nvml_error_code

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppliedCap:
    """What one GPU ended up with after a power-cap request."""

    gpu: int
    uuid: str
    requested_w: float
    applied_w: float
    changed: bool


class PowerCapActuator:
    """Applies one power cap to every GPU of the node, clamped to each device's constraints."""

    def __init__(self, nvml: Any, state_file: Path | None = None) -> None:
        self.nvml = nvml
        self.state_file = state_file
        self._handles: list[tuple[int, str, Any]] | None = None
        self.original_mw: dict[str, tuple[Any, int]] = {}
        """uuid -> (handle, limit before hyperagent first changed it)."""

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
        """Set ``watts`` (clamped to each GPU's [min, max]) on every GPU; raises ActuationError."""
        nv = self.nvml
        results = []
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
                    nv.nvmlDeviceSetPowerManagementLimit(h, target)
            except nv.NVMLError as e:
                raise self._translate(e, what) from e
            results.append(AppliedCap(index, uuid, watts, target / 1000, changed))
        return results

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

"""Simulation controls of the fake (not NVML): the load a device reports, its active clock-event
reasons, XIDs, and failing devices."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from hyperagent.capture.fake_nvml.device import REASON_BITS
from hyperagent.capture.fake_nvml.state import NvmlState


class SimulationControls(NvmlState):
    """What a simulator changes on the replayed GPUs while NVML reads them."""

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
        unknown = (active or frozenset()) - {name for name, _ in REASON_BITS}
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

    def index_of(self, uuid: str) -> int:
        """The index of the GPU with ``uuid`` (no NVML init needed); ValueError for none."""
        for device in self._devices:
            if device.record.uuid == uuid:
                return device.record.index
        raise ValueError(f"no GPU has uuid {uuid}")

    def fail(self, index: int, code: int) -> None:
        """Make every call on device `index` raise `pynvml.NVMLError(code)` until `recover`."""
        with self._lock:
            self._control(index).failure = code

    def recover(self, index: int) -> None:
        """Undo `fail` for device `index`."""
        with self._lock:
            self._control(index).failure = None

"""`nvmlDeviceGetFieldValues` of the fake: each field id it serves, answered from the record in
nvml.h's units, with its own return code per field."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pynvml

from hyperagent.capture.fake_nvml.state import FakeNvmlHandle, NvmlState
from hyperagent.capture.nvidia_smi import GpuRecord, NvLinkRecord
from hyperagent.devices import nvml_api

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
    for reason, policy_field in nvml_api.VIOLATION_FIELDS.items():
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


class FieldValueCalls(NvmlState):
    """NVML's field values over the replayed GPUs."""

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

"""NVML as the device layer reads it: its error codes, the field ids, value types, perf
policies, clock-event reason bits, NVLink counters and GPM metrics of a ``pynvml`` module (or a
fake with its API), and the call wrapper that names the GPU when a call fails."""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hyperagent.devices.base import MW_PER_W
from hyperagent.devices.metrics import DRAM_ACTIVE, SM_ACTIVE, SM_OCCUPANCY, TENSOR_ACTIVE
from hyperagent.errors import SourceError

log = logging.getLogger(__name__)


class NvmlSourceError(SourceError):
    """An NVML call failed; ``vendor_code`` is its NVML return code."""

    def __init__(self, message: str, vendor_code: int | None) -> None:
        super().__init__(message)
        self.vendor_code = vendor_code


def nvml_error_code(error: BaseException) -> int | None:
    """The NVML return code carried by a pynvml.NVMLError, else None."""
    value = getattr(error, "value", None)
    return value if isinstance(value, int) else None


def nvml_text(value: str | bytes) -> str:
    """A string NVML returned, as text (older nvidia-ml-py returns bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def handle_key(handle: Any) -> Any:
    """A hashable key equal for equal device handles: the address a pynvml (ctypes) handle
    points to, else the handle itself (a fake's handle objects are unique per device)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


def violation_policies(nv: Any) -> tuple[tuple[str, int], ...]:
    """Throttle reasons NVML counts itself (nvmlDeviceGetViolationStatus, ns), by reason label.

    NVML defines the SW power cap and sync boost clock-event counters as its POWER and
    SYNC_BOOST perf policies, so those two reasons share their label with the bit.
    """
    return (
        ("sw_power_cap", nv.NVML_PERF_POLICY_POWER),
        ("sync_boost", nv.NVML_PERF_POLICY_SYNC_BOOST),
        ("thermal", nv.NVML_PERF_POLICY_THERMAL),
        ("board_limit", nv.NVML_PERF_POLICY_BOARD_LIMIT),
        ("low_utilization", nv.NVML_PERF_POLICY_LOW_UTILIZATION),
        ("reliability", nv.NVML_PERF_POLICY_RELIABILITY),
        ("total_app_clocks", nv.NVML_PERF_POLICY_TOTAL_APP_CLOCKS),
        ("total_base_clocks", nv.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS),
    )


VIOLATION_FIELDS = {
    "sw_power_cap": "NVML_FI_DEV_PERF_POLICY_POWER",
    "sync_boost": "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST",
    "thermal": "NVML_FI_DEV_PERF_POLICY_THERMAL",
    "board_limit": "NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT",
    "low_utilization": "NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION",
    "reliability": "NVML_FI_DEV_PERF_POLICY_RELIABILITY",
    "total_app_clocks": "NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS",
    "total_base_clocks": "NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS",
}
"""The field (nvmlDeviceGetFieldValues, ns like nvmlViolationTime_t) of each perf policy."""


def field_id(nv: Any, name: str) -> int | None:
    """The NVML field id ``name`` (``NVML_FI_...``) where this nvidia-ml-py defines it."""
    value = getattr(nv, name, None)
    return value if isinstance(value, int) else None


def violation_fields(nv: Any) -> tuple[tuple[str, int, int | None], ...]:
    """(reason label, perf policy, field id or None) of every counted throttle reason."""
    return tuple(
        (reason, policy, field_id(nv, VIOLATION_FIELDS[reason]))
        for reason, policy in violation_policies(nv)
    )


_VALUE_TYPES = (
    ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),  # not in nvidia-ml-py 12.535
)


def value_members(nv: Any) -> dict[int, str]:
    """The ``nvmlValue_t`` member that holds each NVML value type this nvidia-ml-py knows."""
    return {getattr(nv, name): member for name, member in _VALUE_TYPES if hasattr(nv, name)}


def field_number(value: Any, members: Mapping[int, str]) -> float | None:
    """The number a successful ``c_nvmlFieldValue_t`` holds; None for an unknown value type
    or a value that is not finite."""
    member = members.get(value.valueType)
    if member is None:
        return None
    number = float(getattr(value.value, member))
    return number if math.isfinite(number) else None


def plain_layout(struct: Any) -> Any:
    """A ctypes struct with ``struct``'s fields and none of pynvml's Python-level attribute
    hooks (each read through them is a Python call), to read an array of them in place; None
    when ``struct`` has no ctypes fields."""
    fields = getattr(struct, "_fields_", None)
    if fields is None:
        return None
    return type(f"Plain{struct.__name__}", (ctypes.Structure,), {"_fields_": fields})


def instant_power_w(nv: Any, handle: Any) -> float | None:
    """The board's power at this moment (NVML_FI_DEV_POWER_INSTANT, GPU scope), in watts; None
    where the GPU or driver does not report it. Raises pynvml.NVMLError when the call fails."""
    instant = field_id(nv, "NVML_FI_DEV_POWER_INSTANT")
    if instant is None:
        return None
    scope = getattr(nv, "NVML_POWER_SCOPE_GPU", 0)
    value = nv.nvmlDeviceGetFieldValues(handle, [(instant, scope)])[0]
    if value.nvmlReturn != nv.NVML_SUCCESS:
        return None
    milliwatts = field_number(value, value_members(nv))
    return None if milliwatts is None else milliwatts / MW_PER_W


def clock_event_reason_bits(nv: Any) -> tuple[tuple[str, int], ...]:
    """The bits of NVML's current clock-event (throttle) reasons mask, by nvidia-smi's names."""
    return (
        ("gpu_idle", nv.nvmlClocksEventReasonGpuIdle),
        ("applications_clocks_setting", nv.nvmlClocksEventReasonApplicationsClocksSetting),
        ("sw_power_cap", nv.nvmlClocksEventReasonSwPowerCap),
        ("hw_slowdown", nv.nvmlClocksEventReasonHwSlowdown),
        ("sync_boost", nv.nvmlClocksEventReasonSyncBoost),
        ("sw_thermal_slowdown", nv.nvmlClocksEventReasonSwThermalSlowdown),
        ("hw_thermal_slowdown", nv.nvmlClocksEventReasonHwThermalSlowdown),
        ("hw_power_brake_slowdown", nv.nvmlClocksEventReasonHwPowerBrakeSlowdown),
        ("display_clocks_setting", nv.nvmlClocksEventReasonDisplayClockSetting),
    )


def nvlink_error_counters(nv: Any) -> tuple[tuple[str, int], ...]:
    """NVLink data-link error counters (nvmlDeviceGetNvLinkErrorCounter), by type label."""
    return (
        ("replay", nv.NVML_NVLINK_ERROR_DL_REPLAY),
        ("recovery", nv.NVML_NVLINK_ERROR_DL_RECOVERY),
        ("crc_flit", nv.NVML_NVLINK_ERROR_DL_CRC_FLIT),
        ("crc_data", nv.NVML_NVLINK_ERROR_DL_CRC_DATA),
        ("ecc_data", nv.NVML_NVLINK_ERROR_DL_ECC_DATA),
    )


def gpm_metrics(nv: Any) -> tuple[tuple[str, int], ...]:
    """GPM metrics read each cycle (percent in NVML, ratios here), by metric name."""
    return (
        (SM_ACTIVE, nv.NVML_GPM_METRIC_SM_UTIL),
        (SM_OCCUPANCY, nv.NVML_GPM_METRIC_SM_OCCUPANCY),
        (TENSOR_ACTIVE, nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL),
        (DRAM_ACTIVE, nv.NVML_GPM_METRIC_DRAM_BW_UTIL),
    )


def mig_profile(name: str) -> str:
    """The MIG profile in the name NVML gives a MIG device ("NVIDIA A100 ... MIG 1g.10gb")."""
    head, marker, profile = name.rpartition(" MIG ")
    return profile.strip() if marker and head else ""


@dataclass(frozen=True)
class GpuIdentity:
    """A GPU NVML enumerated: its index, UUID, model name and handle."""

    index: int
    uuid: str
    model: str
    handle: Any


class NvmlCalls:
    """NVML calls for the telemetry: None where the device or driver does not support a call,
    else a failure raises NvmlSourceError naming the GPU and the call."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self._nvml_error: type[Exception] = nv.NVMLError
        self.unsupported = (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND)
        """The codes of a call the device or driver does not support."""
        self.unknown_id = (*self.unsupported, nv.NVML_ERROR_INVALID_ARGUMENT)
        """Those, and INVALID_ARGUMENT: a field, perf policy or counter id newer than the
        driver."""

    def call(self, gpu: GpuIdentity, what: str, call: Callable[..., Any], *args: Any) -> Any:
        """Run one NVML call; None when the device or driver does not support it.

        A failure raises NvmlSourceError naming the GPU, ``what`` and the call's arguments
        after the handle.
        """
        try:
            return call(*args)
        except self._nvml_error as e:
            return self._failed(gpu, what, self.unsupported, args, e)

    def call_or_none(
        self,
        gpu: GpuIdentity,
        what: str,
        absent: tuple[int, ...],
        call: Callable[..., Any],
        *args: Any,
    ) -> Any:
        """:meth:`call`, with ``absent`` the error codes that mean "not supported"."""
        try:
            return call(*args)
        except self._nvml_error as e:
            return self._failed(gpu, what, absent, args, e)

    @staticmethod
    def _failed(
        gpu: GpuIdentity, what: str, absent: tuple[int, ...], args: tuple[Any, ...], e: Exception
    ) -> None:
        """None for an error code in ``absent``; else raise NvmlSourceError naming the call."""
        code = nvml_error_code(e)
        if code in absent:
            return None
        detail = f" {list(args[1:])}" if len(args) > 1 else ""
        raise NvmlSourceError(f"GPU {gpu.index} ({gpu.uuid}): {what}{detail}: {e}", code) from e

    def quietly(self, call: Callable[[Any], Any], argument: Any) -> None:
        """A cleanup call whose failure is only logged."""
        try:
            call(argument)
        except self.nv.NVMLError as e:
            log.debug("NVML cleanup call %s failed: %s", getattr(call, "__name__", call), e)

"""NVML field values: the fields each GPU asks every read and every health interval, with the
older call that gives each where the driver does not know its id, and their read in one
``nvmlDeviceGetFieldValues`` per batch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from hyperagent.devices.base import MJ_PER_J, MW_PER_W, NS_PER_S
from hyperagent.devices.metrics import (
    ECC_ERRORS,
    ECC_LIFETIME_ERRORS,
    ENERGY,
    MEMORY_TEMPERATURE,
    NVLINK_DATA,
    PCIE_REPLAYS,
    POWER,
    POWER_INSTANT,
    POWER_LIMIT,
    POWER_LIMIT_MAX,
    POWER_LIMIT_MIN,
    REMAPPED_ROWS,
    REMAPPED_ROWS_FAILED,
    REMAPPED_ROWS_PENDING,
    RETIRED_PAGES,
    RETIRED_PAGES_PENDING,
    THROTTLE,
)
from hyperagent.devices.nvml_api import (
    NvmlCalls,
    NvmlSourceError,
    field_id,
    field_number,
    plain_layout,
    value_members,
    violation_fields,
)
from hyperagent.devices.nvml_gpu import Batch, Field, GpuState, refresh
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)


def _violation_ns(nv: Any, policy: int, handle: Any) -> int:
    return int(nv.nvmlDeviceGetViolationStatus(handle, policy).violationTime)


def _ecc_total(nv: Any, error_type: int, counter: int, handle: Any) -> int:
    return int(nv.nvmlDeviceGetTotalEccErrors(handle, error_type, counter))


def _retired_pages(nv: Any, cause: int, handle: Any) -> int:
    return len(nv.nvmlDeviceGetRetiredPages(handle, cause))


def _retired_pending(nv: Any, handle: Any) -> float:
    pending = nv.nvmlDeviceGetRetiredPagesPendingStatus(handle)
    return 1.0 if pending == nv.NVML_FEATURE_ENABLED else 0.0


def _remapped_rows(nv: Any, position: int, handle: Any) -> float:
    """One of (correctable, uncorrectable, pending, failed) of nvmlDeviceGetRemappedRows."""
    value = nv.nvmlDeviceGetRemappedRows(handle)[position]
    return float(value) if position < 2 else (1.0 if value else 0.0)


def _limit_constraint(nv: Any, position: int, handle: Any) -> int:
    """The lowest (0) or highest (1) power limit the device accepts, mW."""
    return int(nv.nvmlDeviceGetPowerManagementLimitConstraints(handle)[position])


class FieldReader:
    """Which fields a GPU asks in its two batches, and their read."""

    def __init__(self, nv: Any, calls: NvmlCalls) -> None:
        self.nv = nv
        self._calls = calls
        self._violations = violation_fields(nv)
        self._field_value = value_members(nv)
        self._plain_field = plain_layout(nv.c_nvmlFieldValue_t)
        power_scope = getattr(nv, "NVML_POWER_SCOPE_GPU", 0)
        average = field_id(nv, "NVML_FI_DEV_POWER_AVERAGE")
        instant = field_id(nv, "NVML_FI_DEV_POWER_INSTANT")
        self._power_average = None if average is None else (average, power_scope)
        self._power_instant = None if instant is None else (instant, power_scope)

    def violations(self) -> tuple[tuple[str, tuple[int, int]], ...]:
        """(reason, field key) of the throttle reasons NVML counts itself, where the driver has
        their field."""
        return tuple((reason, (fid, 0)) for reason, _, fid in self._violations if fid is not None)

    def fast_fields(self, state: GpuState) -> list[Field]:
        """The fields read every cycle: power, energy, enforced limit, memory temperature, PCIe
        replays, NVML's throttle counters, NVLink traffic."""
        nv, labels = self.nv, state.labels
        fields: list[Field] = []

        def add(what: str, key: tuple[int | None, int], metric: str, **how: Any) -> None:
            if key[0] is not None:
                at = how.pop("at", labels)
                fields.append(Field((key[0], key[1]), metric, at, what=what, **how))

        if self._power_average is not None:
            fields.append(Field(self._power_average, POWER, labels, per=MW_PER_W, what="power"))
        if self._power_instant is not None:
            instant = Field(self._power_instant, POWER_INSTANT, labels, per=MW_PER_W, what="power")
            fields.append(instant)
        add(
            "energy",
            (field_id(nv, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"), 0),
            ENERGY,
            kind=Kind.COUNTER,
            per=MJ_PER_J,
            legacy=nv.nvmlDeviceGetTotalEnergyConsumption,
        )
        add(
            "power limit",
            (
                field_id(nv, "NVML_FI_DEV_POWER_CURRENT_LIMIT"),
                getattr(nv, "NVML_POWER_SCOPE_GPU", 0),
            ),
            POWER_LIMIT,
            per=MW_PER_W,
            legacy=nv.nvmlDeviceGetEnforcedPowerLimit,
        )
        add("memory temperature", (field_id(nv, "NVML_FI_DEV_MEMORY_TEMP"), 0), MEMORY_TEMPERATURE)
        add(
            "PCIe replays",
            (field_id(nv, "NVML_FI_DEV_PCIE_REPLAY_COUNTER"), 0),
            PCIE_REPLAYS,
            kind=Kind.COUNTER,
            legacy=nv.nvmlDeviceGetPcieReplayCounter,
        )
        for reason, policy, fid in self._violations:
            add(
                "violation status",
                (fid, 0),
                THROTTLE,
                at=state.labelled("reason", reason),
                kind=Kind.COUNTER,
                per=NS_PER_S,
                legacy=partial(_violation_ns, nv, policy),
            )
        for link in state.links:
            for direction, name in (
                ("tx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"),
                ("rx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"),
            ):
                add(
                    "NVLink traffic",
                    (field_id(nv, name), link.number),
                    NVLINK_DATA,
                    at={**link.labels, "direction": direction},
                    kind=Kind.COUNTER,
                    per=1 / 1024,
                )
        return fields

    def health_fields(self, state: GpuState) -> list[Field]:
        """The fields read every health interval: ECC counts, retired pages, remapped rows,
        the power limit range."""
        nv = self.nv
        fields: list[Field] = []
        for name, metric, at, legacy, how in (
            *_ecc_fields(nv, state),
            *_page_fields(nv, state),
            *_limit_fields(nv, state),
        ):
            fid = field_id(nv, f"NVML_FI_DEV_{name}")
            if fid is not None:
                what = name.lower().replace("_", " ")
                fields.append(Field((fid, 0), metric, at, legacy=legacy, what=what, **how))
        return fields

    def read(
        self, state: GpuState, batch: Batch, out: list[Reading]
    ) -> dict[tuple[int, int], float]:
        """``batch`` in one nvmlDeviceGetFieldValues (the fields the GPU did not refuse before),
        then the legacy call of those it does not know; returns the values read, by key."""
        nv, gpu = self.nv, state.identity
        got: dict[tuple[int, int], float] = {}
        refresh(batch, state)
        asked, values = batch.asked, None
        if asked:
            values = self._calls.call(
                gpu, "field values", nv.nvmlDeviceGetFieldValues, gpu.handle, batch.keys
            )
            if values is None:  # a driver without field values at all
                for wanted in asked:
                    state.refused(wanted.key)
            elif self._plain_field is not None:
                try:
                    values = (self._plain_field * len(asked)).from_buffer(values)
                except (TypeError, ValueError):
                    pass  # not a ctypes array: read it as it is
        success, members = nv.NVML_SUCCESS, self._field_value
        for wanted, value in zip(asked, values or (), strict=False):
            code = value.nvmlReturn
            if code != success:
                if code in self._calls.unknown_id:
                    state.refused(wanted.key)
                    continue
                raise NvmlSourceError(
                    f"GPU {gpu.index} ({gpu.uuid}): {wanted.what} (field {value.fieldId}, "
                    f"scope {wanted.key[1]}): NVML error {code}",
                    code,
                )
            number = field_number(value, members)
            if number is None:
                log.debug("GPU %d field %d: unusable value", gpu.index, value.fieldId)
                continue
            got[wanted.key] = number
            out.append(Reading(wanted.name, number / wanted.per, wanted.labels, wanted.kind))
        refresh(batch, state)
        for wanted in batch.legacy:
            assert wanted.legacy is not None  # _refresh keeps only those with one
            raw = self._calls.call_or_none(
                gpu, wanted.what, self._calls.unknown_id, wanted.legacy, gpu.handle
            )
            if raw is None:
                state.refused(wanted.key, legacy_too=True)
                continue
            got[wanted.key] = float(raw)
            out.append(Reading(wanted.name, float(raw) / wanted.per, wanted.labels, wanted.kind))
        return got

    def read_power(
        self, state: GpuState, got: dict[tuple[int, int], float], gauge: Callable[..., None]
    ) -> None:
        """Board power where the 1 s average is missing: the instant value, as
        nvmlDeviceGetPowerUsage gives it on such GPUs; that call on a driver that knows
        neither field."""
        average, instant = self._power_average, self._power_instant
        if average is not None and average in got:
            return
        if instant is not None and instant in got:
            gauge(POWER, got[instant] / MW_PER_W)
            return
        if instant is not None and instant not in state.unknown:
            return  # asked, but the value was unusable
        marker = average or instant or (-1, 0)
        if marker in state.no_legacy:
            return
        nv, gpu = self.nv, state.identity
        mw = self._calls.call_or_none(
            gpu, "power", self._calls.unknown_id, nv.nvmlDeviceGetPowerUsage, gpu.handle
        )
        if mw is None:
            state.refused(marker, legacy_too=True)
        else:
            gauge(POWER, mw / MW_PER_W)


_Wanted = tuple[str, str, Mapping[str, str], Callable[[Any], Any], dict[str, Any]]
"""A health field: its name after NVML_FI_DEV_, metric, labels, legacy call, Field arguments."""


def _ecc_fields(nv: Any, state: GpuState) -> list[_Wanted]:
    corrected, uncorrected = (
        nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    )
    return [
        (
            f"ECC_{bits}_{counter}_TOTAL",
            metric,
            state.labelled("type", error_type),
            partial(_ecc_total, nv, kind, scope),
            {"kind": Kind.COUNTER},
        )
        for counter, metric, scope in (
            ("VOL", ECC_ERRORS, nv.NVML_VOLATILE_ECC),
            ("AGG", ECC_LIFETIME_ERRORS, nv.NVML_AGGREGATE_ECC),
        )
        for bits, error_type, kind in (
            ("SBE", "corrected", corrected),
            ("DBE", "uncorrected", uncorrected),
        )
    ]


def _page_fields(nv: Any, state: GpuState) -> list[_Wanted]:
    """Retired pages and remapped rows."""
    labels = state.labels
    retired: list[_Wanted] = [
        (
            name,
            RETIRED_PAGES,
            state.labelled("cause", cause),
            partial(_retired_pages, nv, source),
            {},
        )
        for name, cause, source in (
            (
                "RETIRED_SBE",
                "single_bit_ecc",
                nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            ),
            ("RETIRED_DBE", "double_bit_ecc", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
        )
    ]
    retired.append(
        ("RETIRED_PENDING", RETIRED_PAGES_PENDING, labels, partial(_retired_pending, nv), {})
    )
    remapped: list[_Wanted] = [
        (name, metric, at, partial(_remapped_rows, nv, position), {})
        for position, (name, metric, at) in enumerate(
            (
                ("REMAPPED_COR", REMAPPED_ROWS, state.labelled("cause", "correctable")),
                ("REMAPPED_UNC", REMAPPED_ROWS, state.labelled("cause", "uncorrectable")),
                ("REMAPPED_PENDING", REMAPPED_ROWS_PENDING, labels),
                ("REMAPPED_FAILURE", REMAPPED_ROWS_FAILED, labels),
            )
        )
    ]
    return retired + remapped


def _limit_fields(nv: Any, state: GpuState) -> list[_Wanted]:
    return [
        (name, metric, state.labels, partial(_limit_constraint, nv, position), {"per": MW_PER_W})
        for position, (name, metric) in enumerate(
            (("POWER_MIN_LIMIT", POWER_LIMIT_MIN), ("POWER_MAX_LIMIT", POWER_LIMIT_MAX))
        )
    ]

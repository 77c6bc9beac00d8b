"""One interface for every accelerator kind: identity, activity, power and energy, memory,
temperatures, clocks, errors, and the power limit with its constraints.

A :class:`DeviceLibrary` wraps one vendor library (``pynvml``, ``amdsmi``, ``pyhlml``, or a fake
with its API) and hands out :class:`Accelerator` objects, one per device the library enumerates
(an AMD compute partition is a device of its own, as amdsmi enumerates it). Every method is a
blocking call into the vendor library: callers run them through the library's
:class:`~hyperagent.gate.DeviceGate` (``DeviceGate.of(library.module, library.name)``), which
bounds each call and keeps at most one in flight.

Units follow the metric names, whatever the vendor's own: watts, joules, bytes, hertz, ratios
0..1; power limits in milliwatts (NVML's unit, and the one the actuator's state file keeps).
A reading the device does not give is None (or absent from a mapping), never 0. Errors of the
vendor library propagate as the library's own exceptions (``library.errors``);
``library.translate`` turns one into an :class:`~hyperagent.errors.ActuationError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from hyperagent.errors import ActuationError

_F = TypeVar("_F", bound=Callable[..., Any])

MW_PER_W = 1000.0
"""Milliwatts per watt: NVML's, amdsmi's and HLML's power unit to the metrics'."""
MJ_PER_J = 1000.0
"""Millijoules per joule: NVML's energy counter unit to the metrics'."""
NS_PER_S = 1e9
"""Nanoseconds per second: NVML's violation (throttle) time to the metrics'."""


def vendor_call(name: str) -> Callable[[_F], _F]:
    """Name the vendor function a method calls, for the gate's timeout and busy messages
    ("nvml nvmlDeviceSetPowerManagementLimit: timed out after 2 s")."""

    def mark(method: _F) -> _F:
        setattr(method, "vendor_call", name)  # noqa: B010
        return method

    return mark


def call_name(call: Callable[..., Any]) -> str:
    """The vendor function ``call`` stands for, else its own name."""
    return str(getattr(call, "vendor_call", "") or getattr(call, "__name__", repr(call)))


@dataclass(frozen=True)
class DeviceIdentity:
    """Who a device is: what ``hyperagent_gpu_info`` says about it."""

    index: int
    """Position in the library's enumeration: the ``gpu`` label."""
    uuid: str
    vendor: str
    """``nvidia``, ``amd``, ``intel`` (Gaudi), ``huawei`` (Ascend), ``cambricon``."""
    model: str
    bus_id: str = ""
    driver: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)
    """Further identity labels (an AMD device's ``compute_partition``, ``memory_partition``)."""

    @property
    def labels(self) -> dict[str, str]:
        """The labels every reading of the device carries."""
        return {"gpu": str(self.index), "uuid": self.uuid}

    @property
    def info(self) -> dict[str, str]:
        """The labels of ``hyperagent_gpu_info``."""
        out = {**self.labels, "model": self.model, "driver": self.driver, "vendor": self.vendor}
        if self.bus_id:
            out["bus_id"] = self.bus_id
        return {**out, **self.extra}


@dataclass(frozen=True)
class Activity:
    """How busy a device was over the vendor's last sample period, ratios 0..1."""

    compute: float | None
    """Engine busy fraction: NVML utilisation, amdsmi gfx_activity, HLML AIP utilisation."""
    memory: float | None = None
    """Memory controller busy fraction, where the vendor reports it."""


@dataclass(frozen=True)
class Memory:
    used_bytes: float
    total_bytes: float


class Accelerator(Protocol):
    """One device. Every method is a blocking vendor call (run it through the gate)."""

    identity: DeviceIdentity

    def activity(self) -> Activity | None: ...

    def power_w(self) -> float | None:
        """Board (socket) power, the vendor's averaged value where it has one."""

    def instant_power_w(self) -> float | None:
        """Power now, not averaged; the averaged one where that is all the vendor has."""

    def energy_j(self) -> float | None:
        """The device's energy counter (monotonic while the driver stays loaded)."""

    def memory(self) -> Memory | None: ...

    def temperatures_c(self) -> dict[str, float]:
        """By sensor: ``gpu`` (core/hotspot) and ``memory`` (HBM) where known."""

    def clocks_hz(self) -> dict[str, float]:
        """By domain: ``compute`` and ``memory`` where known."""

    def ecc_errors(self) -> dict[str, float]:
        """ECC errors since the driver loaded, by type (``corrected``, ``uncorrected``)."""

    def power_limit_constraints_mw(self) -> tuple[int, int]:
        """(lowest, highest) power limit the device accepts; raises when not supported."""

    def power_limit_mw(self) -> int:
        """The power limit in force."""

    def set_power_limit_mw(self, milliwatts: int) -> None:
        """Set the power limit (the caller clamps it to the constraints first)."""


class DeviceLibrary(Protocol):
    """One vendor library and the devices it enumerates."""

    name: str
    """The library, as the gate and ``hyperagent_source_up{source}`` name it."""
    vendor: str
    module: Any
    """The vendor module (or its fake): the key of the library's device gate."""
    errors: tuple[type[BaseException], ...]
    """The exceptions a vendor call raises."""

    def devices(self) -> Sequence[Accelerator]:
        """Initialise the library (once) and enumerate its devices."""

    def power_devices(self) -> Sequence[Accelerator]:
        """The devices whose power limit the actuator sets, with as few calls as the library
        allows (their identity may hold only index and UUID)."""

    def by_uuid(self, uuid: str) -> Accelerator:
        """The device with ``uuid``; raises one of ``errors`` when there is none."""

    def translate(self, error: BaseException, what: str) -> ActuationError:
        """``error`` (one of ``errors``) as an ActuationError: NoPermission, NotSupported, or
        ActuationError with the vendor code."""

    def shutdown(self) -> None: ...


def clamp_mw(watts: float, constraints: tuple[int, int]) -> int:
    """``watts`` as milliwatts inside ``constraints``."""
    low, high = constraints
    return round(min(max(watts * 1000, low), high))

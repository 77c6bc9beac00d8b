"""BMC sensors and DCMI power over IPMI, through python-ipmi (RMCP+/RMCP) or ipmitool.

``IpmiSource(backend)`` reads one of two backends:

- ``RmcpBackend`` talks to the BMC over the LAN with python-ipmi, which blocks: every call runs in
  one worker thread owned by the backend, each read is bounded by ``timeout_s``, a read still
  running when the next is due is refused, and a session that stopped answering is torn down and
  opened again on the next read. The SDR records are read once per session.
- ``IpmitoolBackend`` runs ``ipmitool sdr elist`` and ``ipmitool dcmi power reading`` (local
  ``-I open`` or ``-I lan``/``-I lanplus``) through an injectable ``run_command``;
  :func:`hyperagent.sources.ipmi_capture.capture_runner` answers those commands from a capture
  directory, so the same backend replays it. The SDR output may be ipmitool's (``sdr``,
  ``sdr elist``) or ipmiutil's (``sensor``); the DCMI output ipmitool's, freeipmi's or
  ipmiutil's.

Sensor metrics carry ``sensor`` (the name the BMC gives, trimmed) and ``entity`` (the IPMI
entity as ``ID.instance``, empty when the output does not say, as in plain ``ipmitool sdr``):
power, temperature, fan speed, voltage and current by the sensor's unit, and
``hyperagent_bmc_sensor_state``, the health the BMC reports for every readable sensor: 0 ok,
1 non-critical, 2 critical, 3 non-recoverable threshold crossed. A discrete sensor has no
thresholds, so a readable one is 0, as ipmitool reports it "ok". Sensors the BMC cannot read
("ns", "na", "disabled", "No Reading") are left out, never reported as zero, and so are readings
in other units (percent, feet). When two sensors share a name and entity, the first is kept. A BMC
without DCMI is read for its SDR sensors only.

``hyperagent_bmc_node_power_watts`` is the node's input power among the power sensors, chosen
by name (:data:`NODE_POWER_SENSORS`), never the largest: a standby Lenovo XCC lists the
enclosure's "Chassis Power" 450 W beside the node's "Sys Power" 20 W.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import hyperagent.sources.command as command
from hyperagent.errors import SourceError, SourceTimeout, SourceUnavailable
from hyperagent.readings import Reading
from hyperagent.sources.command import CommandFailed, RunCommand

log = logging.getLogger(__name__)

POWER = "hyperagent_bmc_power_watts"
TEMPERATURE = "hyperagent_bmc_temperature_celsius"
FAN_SPEED = "hyperagent_bmc_fan_speed_rpm"
VOLTAGE = "hyperagent_bmc_voltage_volts"
CURRENT = "hyperagent_bmc_current_amperes"
SENSOR_STATE = "hyperagent_bmc_sensor_state"
DCMI_POWER = "hyperagent_bmc_dcmi_power_watts"
DCMI_POWER_MIN = "hyperagent_bmc_dcmi_power_min_watts"
DCMI_POWER_MAX = "hyperagent_bmc_dcmi_power_max_watts"
DCMI_POWER_AVERAGE = "hyperagent_bmc_dcmi_power_average_watts"
DCMI_SAMPLING_PERIOD = "hyperagent_bmc_dcmi_sampling_period_seconds"
NODE_POWER = "hyperagent_bmc_node_power_watts"

HELP: dict[str, str] = {
    POWER: "Power reported by a BMC power sensor (SDR), e.g. the node's input power.",
    TEMPERATURE: "Temperature reported by a BMC sensor.",
    FAN_SPEED: "Fan speed reported by a BMC sensor, in revolutions per minute.",
    VOLTAGE: "Voltage reported by a BMC sensor.",
    CURRENT: "Current reported by a BMC sensor.",
    SENSOR_STATE: (
        "Health the BMC reports for a readable sensor: 0 ok, 1 non-critical, 2 critical, "
        "3 non-recoverable threshold crossed."
    ),
    DCMI_POWER: "Instantaneous node power from the BMC's DCMI power reading.",
    DCMI_POWER_MIN: "Lowest node power over the DCMI sampling period.",
    DCMI_POWER_MAX: "Highest node power over the DCMI sampling period.",
    DCMI_POWER_AVERAGE: "Average node power over the DCMI sampling period.",
    DCMI_SAMPLING_PERIOD: "Length of the DCMI sampling period the min/max/average cover.",
    NODE_POWER: (
        "The node's input power by the BMC's SDR: the power sensor whose name ranks first in"
        " the documented preference (sensor label), not the largest one."
    ),
}

OK, NON_CRITICAL, CRITICAL, NON_RECOVERABLE = 0, 1, 2, 3

Convert = Callable[[float], float]


def _same(value: float) -> float:
    return value


def _celsius_from_fahrenheit(value: float) -> float:
    return (value - 32) * 5 / 9


def _celsius_from_kelvin(value: float) -> float:
    return value - 273.15


_IPMITOOL_UNITS: dict[str, tuple[str, Convert]] = {
    "degrees C": (TEMPERATURE, _same),
    "degrees F": (TEMPERATURE, _celsius_from_fahrenheit),
    "degrees K": (TEMPERATURE, _celsius_from_kelvin),
    "Volts": (VOLTAGE, _same),
    "Amps": (CURRENT, _same),
    "Watts": (POWER, _same),
    "RPM": (FAN_SPEED, _same),
}
_IPMIUTIL_UNITS: dict[str, tuple[str, Convert]] = {
    "C": (TEMPERATURE, _same),
    "F": (TEMPERATURE, _celsius_from_fahrenheit),
    "K": (TEMPERATURE, _celsius_from_kelvin),
    "V": (VOLTAGE, _same),
    "A": (CURRENT, _same),
    "W": (POWER, _same),
    "RPM": (FAN_SPEED, _same),
}
_IPMI_UNIT_CODES: dict[int, tuple[str, Convert]] = {
    1: (TEMPERATURE, _same),
    2: (TEMPERATURE, _celsius_from_fahrenheit),
    3: (TEMPERATURE, _celsius_from_kelvin),
    4: (VOLTAGE, _same),
    5: (CURRENT, _same),
    6: (POWER, _same),
    18: (FAN_SPEED, _same),
}
"""IPMI base unit type codes (IPMI 2.0 table 43-15) of the readings exposed."""

_IPMITOOL_STATUS = {
    "ok": OK,
    "nc": NON_CRITICAL,
    "lnc": NON_CRITICAL,
    "unc": NON_CRITICAL,
    "cr": CRITICAL,
    "lcr": CRITICAL,
    "ucr": CRITICAL,
    "nr": NON_RECOVERABLE,
    "lnr": NON_RECOVERABLE,
    "unr": NON_RECOVERABLE,
}
_IPMIUTIL_STATUS = {
    "ok": OK,
    "ok*": OK,
    "warn-lo": NON_CRITICAL,
    "warn-hi": NON_CRITICAL,
    "crit-lo": CRITICAL,
    "crit-hi": CRITICAL,
    "belowcrit": NON_RECOVERABLE,
    "abovecrit": NON_RECOVERABLE,
}
_UNREADABLE = {"ns", "na", "disabled", "no reading", "not readable", "init"}
_NUMBER_AND_UNIT = re.compile(r"^([-+]?\d+(?:\.\d+)?)\s+(\S.*)$")
_ENTITY = re.compile(r"^\d+\.\d+$")


class IpmiError(SourceError):
    """A BMC request or an IPMI tool failed; ``completion_code`` is the IPMI code when known."""

    def __init__(self, message: str, completion_code: int | None = None) -> None:
        super().__init__(message)
        self.completion_code = completion_code


@dataclass(frozen=True, slots=True)
class SensorValue:
    """One readable sensor, whichever tool read it: its health and, in a known unit, its value."""

    sensor: str
    entity: str
    severity: int | None
    metric: str | None = None
    value: float | None = None


def sensor_readings(values: Iterable[SensorValue]) -> list[Reading]:
    """Readings of sensor values; of two sensors with the same name and entity the first wins."""
    out: list[Reading] = []
    seen: set[tuple[str, str]] = set()
    for v in values:
        if (v.sensor, v.entity) in seen:
            continue
        seen.add((v.sensor, v.entity))
        labels = {"sensor": v.sensor, "entity": v.entity}
        if v.metric is not None and v.value is not None:
            out.append(Reading(v.metric, v.value, labels))
        if v.severity is not None:
            out.append(Reading(SENSOR_STATE, float(v.severity), labels))
    return out


def _value_from_text(
    reading: str, units: dict[str, tuple[str, Convert]]
) -> tuple[str, float] | tuple[None, None]:
    """(metric, value) of a reading such as "12.06 Volts" or "0 Watts, Presence detected"."""
    match = _NUMBER_AND_UNIT.match(reading.split(",", 1)[0].strip())
    if match is None:
        return None, None
    known = units.get(match.group(2).strip())
    if known is None:
        return None, None
    metric, convert = known
    return metric, convert(float(match.group(1)))


class _IpmitoolReadings:
    """Readings of ``ipmitool`` sensor rows as :func:`sensor_readings` makes them of sensor
    values (the first of two sensors with the same name and entity wins), without building a
    SensorValue per row: the SDR is parsed every cycle."""

    def __init__(self) -> None:
        self.out: list[Reading] = []
        self.seen: set[tuple[str, str]] = set()

    def add(self, name: str, entity: str, severity: int, reading: str) -> None:
        """A row whose status (``severity``) is known; unnamed and unreadable ones are skipped."""
        if not name or reading.lower() in _UNREADABLE:
            return
        key = (name, entity)
        if key in self.seen:
            return
        self.seen.add(key)
        labels = {"sensor": name, "entity": entity}
        metric, value = _value_from_text(reading, _IPMITOOL_UNITS)
        if metric is not None and value is not None:
            self.out.append(Reading(metric, value, labels))
        self.out.append(Reading(SENSOR_STATE, float(severity), labels))


def _table_rows(text: str, columns: int, strip: bool = True) -> tuple[list[list[str]], int]:
    """The rows of a ``|``-separated table with ``columns`` fields (stripped unless ``strip`` is
    false: a caller that skips most rows strips only what it keeps), and the non-empty line
    count."""
    rows: list[list[str]] = []
    lines = 0
    for line in text.splitlines():
        if not line or line.isspace():
            continue
        lines += 1
        fields = line.split("|")
        if len(fields) == columns:
            rows.append([f.strip() for f in fields] if strip else fields)
    return rows, lines


def parse_sdr_elist(text: str) -> list[Reading]:
    """Readings of ``ipmitool sdr elist`` output (name | number | status | entity | reading).

    A line that does not have these five fields, or has an unknown status or a malformed entity,
    is skipped; output with no such line at all raises SourceError.
    """
    rows, lines = _table_rows(text, 5, strip=False)
    if lines and not rows:
        raise SourceError("ipmitool sdr elist output has no sensor lines")
    readings = _IpmitoolReadings()
    status_of = _IPMITOOL_STATUS.get
    entity_ok = _ENTITY.match
    for fields in rows:
        # Cheap filters first: about half the sensors of a BMC are "ns" (no reading).
        severity = status_of(fields[2].strip().lower())
        if severity is None:
            continue
        entity = fields[3].strip()
        if entity_ok(entity):
            readings.add(fields[0].strip(), entity, severity, fields[4].strip())
    return readings.out


def parse_sdr(text: str) -> list[Reading]:
    """Readings of plain ``ipmitool sdr`` output (name | reading | status); ``entity`` is "".

    The plain format cannot tell apart sensors that share a name (a dual-CPU board's two "Temp"
    sensors): only the first is kept. ``sdr elist`` output names their entities.
    """
    rows, lines = _table_rows(text, 3, strip=False)
    if lines and not rows:
        raise SourceError("ipmitool sdr output has no sensor lines")
    readings = _IpmitoolReadings()
    status_of = _IPMITOOL_STATUS.get
    for fields in rows:
        severity = status_of(fields[2].strip().lower())
        if severity is not None:
            readings.add(fields[0].strip(), "", severity, fields[1].strip())
    return readings.out


def parse_sdr_output(text: str) -> list[Reading]:
    """Readings of ``ipmitool sdr elist``, plain ``ipmitool sdr`` or ``ipmiutil sensor`` output
    (told by their columns: 5, 3 or 7)."""
    first = next((line for line in text.splitlines() if "|" in line), None)
    if first is None:
        if text.strip():
            raise SourceError("ipmitool sdr output has no sensor lines")
        return []
    columns = len(first.split("|"))
    if columns == 7:
        return parse_ipmiutil_sensor(text)
    if columns == 5:
        return parse_sdr_elist(text)
    if columns == 3:
        return parse_sdr(text)
    raise SourceError(f"unrecognised ipmitool sdr output: {columns} columns in {first.strip()!r}")


def parse_ipmiutil_sensor(text: str) -> list[Reading]:
    """Readings of ``ipmiutil sensor`` output (ID | SDR type | type | num | name | status | value).

    Threshold states (OK, Warn-*, Crit-*, BelowCrit/AboveCrit) give the sensor state. Any other
    status is a readable discrete sensor's asserted state as ipmiutil words it ("Working", "_"
    for none asserted): state 0, as ipmitool reports such a sensor "ok" and the RMCP+ backend
    reads it (a discrete sensor has no thresholds).
    """
    rows, lines = _table_rows(text, 7)
    records = [row for row in rows if re.fullmatch(r"[0-9a-fA-F]{4}", row[0])]
    if lines and not records:
        raise SourceError("ipmiutil sensor output has no sensor lines")
    values = []
    for _id, _sdr_type, _type, _number, name, status, reading in records:
        if not name or status.lower() in _UNREADABLE:
            continue
        metric, value = _value_from_text(reading, _IPMIUTIL_UNITS)
        severity = _IPMIUTIL_STATUS.get(status.lower(), OK)
        values.append(SensorValue(name, "", severity, metric, value))
    return sensor_readings(values)


@dataclass(frozen=True, slots=True)
class DcmiPower:
    """A DCMI power reading; ``active`` is false when the BMC measures no power."""

    current_w: float
    minimum_w: float | None = None
    maximum_w: float | None = None
    average_w: float | None = None
    period_s: float | None = None
    active: bool = True


def dcmi_readings(power: DcmiPower) -> list[Reading]:
    """Readings of a DCMI power reading; none when the power measurement is not active."""
    if not power.active:
        return []
    out = [Reading(DCMI_POWER, power.current_w)]
    for name, value in (
        (DCMI_POWER_MIN, power.minimum_w),
        (DCMI_POWER_MAX, power.maximum_w),
        (DCMI_POWER_AVERAGE, power.average_w),
        (DCMI_SAMPLING_PERIOD, power.period_s),
    ):
        if value is not None:
            out.append(Reading(name, value))
    return out


_DCMI_FIELDS = {
    # ipmitool dcmi power reading
    "instantaneous power reading": "current_w",
    "minimum during sampling period": "minimum_w",
    "maximum during sampling period": "maximum_w",
    "average power reading over sample period": "average_w",
    # freeipmi ipmi-dcmi --get-system-power-statistics
    "current power": "current_w",
    "minimum power over sampling duration": "minimum_w",
    "maximum power over sampling duration": "maximum_w",
    "average power over sampling duration": "average_w",
    # ipmiutil dcmi
    "min power over sample duration": "minimum_w",
    "max power over sample duration": "maximum_w",
    "avg power over sample duration": "average_w",
}
_WATTS = re.compile(r"(\d+(?:\.\d+)?)\s*watts", re.IGNORECASE)
_PERIODS = {
    "sampling period": re.compile(r"(\d+)\s*(seconds|ms)\.?", re.IGNORECASE),
    "statistics reporting time period": re.compile(r"(\d+)\s*(milliseconds)", re.IGNORECASE),
}
_PERIOD_SCALE = {"seconds": 1.0, "ms": 1e-3, "milliseconds": 1e-3}


def parse_dcmi_power(text: str) -> list[Reading]:
    """Readings of a DCMI power reading: ``ipmitool dcmi power reading``, freeipmi's
    ``ipmi-dcmi --get-system-power-statistics`` or ``ipmiutil dcmi`` output.

    Raises SourceError naming what it expected when there is no current (instantaneous)
    reading; an unreadable min/max/average or sampling period is left out; a deactivated or
    unavailable power measurement ("Power reading state is: deactivated", "Power Measurement :
    Not Available") gives no readings.
    """
    watts: dict[str, float] = {}
    period_s: float | None = None
    active = True
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = " ".join(key.lower().split()), value.strip()
        if key in _DCMI_FIELDS:
            match = _WATTS.fullmatch(value)
            if match:
                watts[_DCMI_FIELDS[key]] = float(match.group(1))
        elif key in _PERIODS:
            match = _PERIODS[key].fullmatch(value)
            if match:
                period_s = float(match.group(1)) * _PERIOD_SCALE[match.group(2).lower()]
        elif key == "power reading state is":
            active = value.lower() != "deactivated"
        elif key == "power measurement":
            active = value.lower() == "active"
    if "current_w" not in watts:
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        raise SourceError(
            "DCMI power output has no current power: expected ipmitool's 'Instantaneous power"
            f" reading' or freeipmi's/ipmiutil's 'Current Power', got {first[:80]!r}"
        )
    return dcmi_readings(DcmiPower(**watts, period_s=period_s, active=active))


NODE_POWER_SENSORS: tuple[tuple[str, ...], ...] = (
    # the node's (system's) input power, by the names vendors give it
    (
        "sys power",
        "system power",
        "node power",
        "total power",
        "pwr consumption",
        "power consumption",
        "sys input power",
        "system input power",
    ),
    # the sum of a tray's hot-swap controller inputs (GB200-class compute trays)
    ("hsc pwr sum", "hsc input pwr sum"),
    # an average or unnamed meter of the node (IBM IMM "Avg Power", Huawei iBMC "Power")
    ("avg power", "average power", "power meter", "power"),
    # the enclosure's power: a multi-node chassis (Lenovo XCC "Chassis Power") or a standby
    # node's PSU capacity; only when nothing of the node's own is there
    ("chassis power", "total chassis power"),
)
"""Sensor names (lower case, ``_`` read as a space) that carry the node's power, in order of
preference: the first group with a readable power sensor gives ``hyperagent_bmc_node_power_watts``.
Per-supply, per-GPU and per-CPU sensors are never the node's power."""

_NODE_POWER_RANK = {name: rank for rank, names in enumerate(NODE_POWER_SENSORS) for name in names}


def node_power(readings: Iterable[Reading]) -> Reading | None:
    """The node's input power among BMC power sensor readings, chosen by
    :data:`NODE_POWER_SENSORS` (the first sensor of the best-ranked name); None when no sensor
    has such a name."""
    best: tuple[int, Reading] | None = None
    for r in readings:
        if r.name != POWER:
            continue
        sensor = r.labels.get("sensor", "")
        rank = _NODE_POWER_RANK.get(" ".join(sensor.replace("_", " ").lower().split()))
        if rank is not None and (best is None or rank < best[0]):
            best = (rank, r)
    if best is None:
        return None
    return Reading(NODE_POWER, best[1].value, {"sensor": best[1].labels["sensor"]})


class IpmiBackend(Protocol):
    """Where an IpmiSource gets its readings: one BMC, read by one tool."""

    target: str

    async def read(self) -> list[Reading]:
        """Sensor and DCMI readings of one sample; SourceError when the BMC cannot be read."""
        ...

    async def close(self) -> None:
        """End any session with the BMC."""
        ...


class IpmiSource:
    """The node's BMC: SDR sensors and the DCMI power reading, through an IpmiBackend."""

    name = "ipmi"

    def __init__(self, backend: IpmiBackend) -> None:
        self.backend = backend
        self.target = backend.target
        self._reading = False

    async def start(self) -> None:
        return None

    async def read(self) -> list[Reading]:
        if self._reading:
            raise SourceError(f"previous BMC read of {self.target} still running")
        self._reading = True
        try:
            readings = await self.backend.read()
        finally:
            self._reading = False
        node = node_power(readings)
        return readings if node is None else [*readings, node]

    async def close(self) -> None:
        await self.backend.close()


_COMPLETION_CODE = re.compile(r"\(([0-9a-fA-F]{2})\)\s*$", re.MULTILINE)
_LAN_INTERFACES = ("lan", "lanplus")
_PRIVILEGES = ("user", "operator", "administrator")


class IpmitoolBackend:
    """The BMC through ``ipmitool sdr elist`` and ``ipmitool dcmi power reading``.

    ``interface="open"`` reads the local BMC (``/dev/ipmi0``; absent device: SourceUnavailable);
    ``"lan"``/``"lanplus"`` reach ``host:port`` as ``username`` with the password in
    ``password_file`` (``-f``, never on the command line), ``cipher_suite`` (``-C``) and
    ``privilege`` (``-L``). A read is bounded by ``timeout_s`` in all (commands are killed on
    expiry); DCMI gets what is left of it, and a BMC that refuses DCMI is not asked again.
    """

    def __init__(
        self,
        run_command: RunCommand = command.run_command,
        *,
        interface: str = "open",
        host: str | None = None,
        port: int = 623,
        username: str | None = None,
        password_file: Path | str | None = None,
        cipher_suite: int | None = None,
        privilege: str = "user",
        timeout_s: float = 5.0,
        dcmi: bool = True,
        binary: str = "ipmitool",
        target: str | None = None,
    ) -> None:
        if interface not in ("open", *_LAN_INTERFACES):
            raise ValueError(f"interface must be open, lan or lanplus, not {interface!r}")
        if interface in _LAN_INTERFACES and not host:
            raise ValueError(f"interface {interface} needs a host")
        if privilege.lower() not in _PRIVILEGES:
            raise ValueError(f"privilege must be one of {', '.join(_PRIVILEGES)}")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.run_command = run_command
        self.timeout_s = timeout_s
        self.dcmi = dcmi
        self.target = target or (f"{host}:{port}" if interface in _LAN_INTERFACES else "local")
        options = [binary, "-I", interface]
        if interface in _LAN_INTERFACES:
            options += ["-H", str(host), "-p", str(port), "-L", privilege.upper()]
            if username is not None:
                options += ["-U", username]
            if password_file is not None:
                options += ["-f", str(password_file)]
            if cipher_suite is not None and interface == "lanplus":
                options += ["-C", str(cipher_suite)]
        self.options = options
        self._dcmi_supported = dcmi
        self._dcmi_problem: str | None = None

    async def read(self) -> list[Reading]:
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                sdr = await self._run("sdr", "elist")
        except TimeoutError as e:
            raise SourceTimeout(
                f"ipmitool sdr elist on {self.target} did not finish within {self.timeout_s:g}s"
            ) from e
        readings = parse_sdr_output(sdr)
        if self._dcmi_supported:
            readings += await self._read_dcmi(deadline)
        return readings

    async def _read_dcmi(self, deadline: float) -> list[Reading]:
        try:
            async with asyncio.timeout_at(deadline):
                output = await self._run("dcmi", "power", "reading")
            readings = parse_dcmi_power(output)
        except TimeoutError:
            log.debug("DCMI power reading of %s skipped: no time left", self.target)
        except SourceUnavailable:
            self._dcmi_supported = False
        except IpmiError as e:
            if e.completion_code is None:
                log.debug("DCMI power reading of %s skipped: %s", self.target, e)
            else:
                self._dcmi_supported = False
                log.info("BMC %s refuses DCMI power reading (%s); reading SDR only", self.target, e)
        except SourceError as e:  # output that is not a DCMI power reading: said once
            problem = str(e)
            if problem != self._dcmi_problem:
                log.warning("DCMI power reading of %s not read: %s", self.target, problem)
            self._dcmi_problem = problem
        else:
            self._dcmi_problem = None
            return readings
        return []

    async def _run(self, *command: str) -> str:
        try:
            return await self.run_command([*self.options, *command])
        except CommandFailed as e:
            if "Could not open device" in e.stderr:
                raise SourceUnavailable(f"no local BMC device: {e}") from e
            match = _COMPLETION_CODE.search(e.stderr)
            raise IpmiError(
                f"ipmitool {' '.join(command)} on {self.target} failed: {e}",
                int(match.group(1), 16) if match else None,
            ) from e

    async def close(self) -> None:
        return None


class _Abandoned(Exception):
    """The read was given up by the event loop; the worker stops between requests."""


@dataclass(frozen=True, slots=True)
class SensorSample:
    """A Get Sensor Reading response together with the SDR record of its sensor.

    ``record`` is a python-ipmi SdrFullSensorRecord or SdrCompactSensorRecord; ``states`` holds
    the threshold comparison bits (threshold sensors) or the asserted states (discrete ones).
    """

    record: Any
    raw: int
    scanning_enabled: bool
    unavailable: bool
    states: int


def _threshold_severity(states: int) -> int:
    if states & 0x24:
        return NON_RECOVERABLE
    if states & 0x12:
        return CRITICAL
    if states & 0x09:
        return NON_CRITICAL
    return OK


def _analog_value(record: Any, raw: int) -> tuple[str, float] | tuple[None, None]:
    """(metric, value) of a full sensor record's raw reading in a unit this source exposes."""
    if not hasattr(record, "convert_sensor_raw_to_value") or record.analog_data_format == 3:
        return None, None
    if record.percentage or record.modifier_unit or record.rate_unit:
        return None, None
    known = _IPMI_UNIT_CODES.get(record.units_2)
    if known is None:
        return None, None
    from pyipmi.errors import DecodingError  # type: ignore[import-untyped]

    try:
        value = float(record.convert_sensor_raw_to_value(raw))
    except (ArithmeticError, ValueError, DecodingError):
        return None, None
    if record.linearization == 0:
        value = round(value, max(0, -record.k2 + max(0, -record.k1)))
    metric, convert = known
    return metric, convert(value)


def sample_value(sample: SensorSample) -> SensorValue | None:
    """The SensorValue of one reading, None when the BMC cannot read the sensor."""
    if not sample.scanning_enabled or sample.unavailable:
        return None
    record = sample.record
    name = record.device_id_string
    name = (name.decode("latin-1") if isinstance(name, bytes) else str(name)).strip()
    if not name:
        return None
    threshold = record.event_reading_type_code == 0x01
    severity = _threshold_severity(sample.states) if threshold else OK
    metric, value = _analog_value(record, sample.raw)
    return SensorValue(
        name, f"{record.entity_id}.{record.entity_instance}", severity, metric, value
    )


def parse_sensor_samples(samples: Iterable[SensorSample]) -> list[Reading]:
    """Readings of Get Sensor Reading responses (what ``ipmitool sdr elist`` would show)."""
    return sensor_readings(v for s in samples if (v := sample_value(s)) is not None)


def read_password_file(path: Path | str) -> str:
    """The password in an ipmitool ``-f`` file: its first line, without the line ending."""
    text = Path(path).read_text(encoding="utf-8")
    return text.splitlines()[0] if text else ""


class RmcpBackend:
    """The BMC at ``host:port`` through python-ipmi: RMCP+ (``"lanplus"``) or RMCP (``"lan"``).

    All python-ipmi calls run in one worker thread of this backend. A read is bounded by
    ``timeout_s``, each request by ``request_timeout_s`` (default a quarter of it) and retried
    once; a read still running in the worker when the next one starts makes that one fail at
    once, and a read that failed or timed out leaves the session to be closed and opened again by
    the next read. Only sensors the BMC owns (``bmc_address``) are read; ``cipher_suite`` None
    tries 17 then 3.
    """

    def __init__(
        self,
        host: str,
        port: int = 623,
        username: str = "",
        password: str = "",
        *,
        interface: str = "lanplus",
        cipher_suite: int | None = None,
        privilege: str = "user",
        timeout_s: float = 5.0,
        request_timeout_s: float | None = None,
        dcmi: bool = True,
        bmc_address: int = 0x20,
        keep_alive_s: int = 20,
    ) -> None:
        if interface not in _LAN_INTERFACES:
            raise ValueError(f"interface must be lan or lanplus, not {interface!r}")
        if privilege.lower() not in _PRIVILEGES:
            raise ValueError(f"privilege must be one of {', '.join(_PRIVILEGES)}")
        if timeout_s <= 0 or (request_timeout_s is not None and request_timeout_s <= 0):
            raise ValueError("timeout_s and request_timeout_s must be positive")
        self.host, self.port = host, port
        self.username, self.password = username, password
        self.interface = interface
        self.cipher_suite = cipher_suite
        self.privilege = privilege.lower()
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s or timeout_s / 4
        self.dcmi = dcmi
        self.bmc_address = bmc_address
        self.keep_alive_s = keep_alive_s
        self.target = f"{host}:{port}"
        self.sessions_established = 0
        """Sessions opened so far; a new one follows every failed or abandoned read."""
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ipmi-{host}")
        self._pending: Future[list[Reading]] | None = None
        self._abandon = threading.Event()
        self._ipmi: Any = None
        self._records: list[Any] | None = None
        self._dcmi_supported = dcmi
        self._stale = False

    @property
    def busy(self) -> bool:
        """Whether a read is still running in the worker thread."""
        return self._pending is not None and not self._pending.done()

    async def read(self) -> list[Reading]:
        if self.busy:
            raise SourceError(f"BMC {self.target}: the previous read is still running")
        self._abandon.clear()
        pending = self._pending = self._worker.submit(self._read_sync)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.wrap_future(pending)
        except TimeoutError as e:
            raise SourceTimeout(
                f"BMC {self.target} did not answer within {self.timeout_s:g}s"
            ) from e
        finally:
            if not pending.done():
                self._abandon.set()

    async def close(self) -> None:
        self._abandon.set()
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.wrap_future(self._worker.submit(self._disconnect))
        except TimeoutError:
            log.warning("closing the session with BMC %s timed out", self.target)

    def _read_sync(self) -> list[Reading]:
        from pyipmi.errors import CompletionCodeError  # type: ignore[import-untyped]

        try:
            if self._stale:
                self._disconnect()
            if self._ipmi is None:
                self._connect()
            readings = parse_sensor_samples(self._read_samples())
            if self._dcmi_supported:
                readings += self._read_dcmi()
            return readings
        except _Abandoned as e:
            self._stale = True
            raise SourceTimeout(f"BMC {self.target}: read abandoned") from e
        except SourceError:
            self._stale = True
            raise
        except Exception as e:
            self._stale = True
            code = e.cc if isinstance(e, CompletionCodeError) else None
            raise IpmiError(f"reading BMC {self.target} failed: {e!r}", code) from e

    def _connect(self) -> None:
        import pyipmi  # type: ignore[import-untyped]
        import pyipmi.interfaces  # type: ignore[import-untyped]

        kind = "rmcpplus" if self.interface == "lanplus" else "rmcp"
        options: dict[str, Any] = {"keep_alive_interval": self.keep_alive_s, "max_retries": 1}
        if kind == "rmcpplus":
            options["cipher_suite"] = self.cipher_suite
        interface = pyipmi.interfaces.create_interface(kind, **options)
        ipmi = pyipmi.create_connection(interface)
        ipmi.session.set_session_type_rmcp(self.host, self.port)
        ipmi.session.set_auth_type_user(self.username, self.password)
        ipmi.session.set_priv_level(self.privilege)
        ipmi.target = pyipmi.Target(ipmb_address=self.bmc_address)
        try:
            interface.open()
            interface.set_timeout(self.request_timeout_s)
            ipmi.session.establish()
        except Exception as e:
            _close_quietly(ipmi)
            raise IpmiError(
                f"opening a session with BMC {self.target} failed: {e}", getattr(e, "cc", None)
            ) from e
        self._ipmi = ipmi
        self._records = None
        self._dcmi_supported = self.dcmi
        self.sessions_established += 1

    def _disconnect(self) -> None:
        ipmi, self._ipmi = self._ipmi, None
        self._records = None
        self._stale = False
        if ipmi is not None:
            _close_quietly(ipmi)

    def _check_abandoned(self) -> None:
        if self._abandon.is_set():
            raise _Abandoned

    def _sensor_records(self) -> list[Any]:
        from pyipmi.sdr import (  # type: ignore[import-untyped]
            SdrCompactSensorRecord,
            SdrFullSensorRecord,
        )

        if self._records is None:
            records = []
            for record in self._ipmi.sdr_repository_entries():
                self._check_abandoned()
                if (
                    isinstance(record, (SdrFullSensorRecord, SdrCompactSensorRecord))
                    and record.owner_id == self.bmc_address
                ):
                    records.append(record)
            self._records = records
        return self._records

    def _read_samples(self) -> list[SensorSample]:
        from pyipmi.errors import CompletionCodeError

        records = self._sensor_records()
        samples = []
        refused: list[CompletionCodeError] = []
        for record in records:
            self._check_abandoned()
            try:
                rsp = self._ipmi.send_message_by_name(
                    "GetSensorReading", sensor_number=record.number, lun=record.owner_lun
                )
            except CompletionCodeError as e:
                refused.append(e)
                continue
            samples.append(
                SensorSample(
                    record,
                    rsp.sensor_reading,
                    # python-ipmi names the response's bit 6 "sensor_scanning_disabled"; in IPMI
                    # it is set while scanning is enabled (ipmitool reads it the same way).
                    scanning_enabled=bool(rsp.config.sensor_scanning_disabled),
                    unavailable=bool(rsp.config.initial_update_in_progress),
                    states=(rsp.states1 or 0) | ((rsp.states2 or 0) << 8),
                )
            )
        if records and len(refused) == len(records):
            raise IpmiError(
                f"BMC {self.target} refused every sensor reading: {refused[0]}", refused[0].cc
            )
        return samples

    def _read_dcmi(self) -> list[Reading]:
        from pyipmi.errors import CompletionCodeError, RetryError

        self._check_abandoned()
        try:
            rsp = self._ipmi.get_power_reading(1)
        except (CompletionCodeError, RetryError, TimeoutError) as e:
            self._dcmi_supported = False
            log.info(
                "BMC %s does not answer DCMI power reading (%s); reading SDR only", self.target, e
            )
            return []
        return dcmi_readings(
            DcmiPower(
                float(rsp.current_power),
                float(rsp.minimum_power),
                float(rsp.maximum_power),
                float(rsp.average_power),
                rsp.period / 1000,
                active=bool(rsp.reading_state & 0x40),
            )
        )


def _close_quietly(ipmi: Any) -> None:
    """Close a python-ipmi session and its socket; a BMC that does not answer is left to expire."""
    try:
        ipmi.session.close()
    except Exception as e:
        log.debug("closing the BMC session failed: %s", e)
    finally:
        ipmi.interface.close()

"""Rack PDU power over SNMP: inlet, phase and outlet power, energy, current and voltage.

A vendor profile names the table columns to walk and parses the (oid, value) pairs they hold:
APC PowerNet rPDU2, Raritan PDU2, ServerTech Sentry4, Eaton ePDU, and ENTITY-SENSOR-MIB as the
fallback for anything else. The profile comes from the target's configuration or, with
``vendor="auto"``, from the PDU's sysObjectID.

SNMP access goes through the narrow :class:`SnmpClient` interface: :class:`PysnmpClient` talks
SNMPv2c to the PDU with pysnmp 7's asyncio API, :class:`SnmprecClient` answers from a recorded
walk (an snmpsim ``.snmprec`` file, or net-snmp ``snmpwalk -On`` output saved as ``.snmpwalk``),
so a capture directory replays through the same parsers.

One :class:`PduSource` reads one PDU, so the runner reports each PDU's health on its own
(``hyperagent_source_up{source="pdu",target=NAME}``) and a dead PDU never hides the others;
:func:`pdu_sources` builds them from configuration.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

from hyperagent.errors import SourceError, SourceTimeout, SourceUnavailable
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)

Oid = tuple[int, ...]


class Missing(Enum):
    """An SNMP exception value: the agent has no such object, instance, or nothing further."""

    NO_SUCH_OBJECT = "noSuchObject"
    NO_SUCH_INSTANCE = "noSuchInstance"
    END_OF_MIB_VIEW = "endOfMibView"


SnmpValue = int | bytes | str | Missing
"""Integers (all integer types), octet strings as bytes, OIDs and IP addresses as dotted text."""

VarBind = tuple[str, SnmpValue]


class SnmpError(SourceError):
    """The PDU answered with an SNMP error; ``status`` is the SNMP error-status code."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SnmpTimeout(SourceTimeout):
    """The PDU did not answer an SNMP request within its timeout and retries."""


class SnmpClient(Protocol):
    """The SNMP operations a PDU profile needs, against a live agent or a recording."""

    async def open(self) -> None:
        """Prepare once (engine, address, recording); requests open the client if needed."""
        ...

    async def get(self, oids: Sequence[str]) -> list[VarBind]:
        """The value of each OID, in order; absent ones are a :class:`Missing` value."""
        ...

    async def walk(self, oid: str) -> list[VarBind]:
        """Every object below ``oid``, in OID order."""
        ...

    async def close(self) -> None:
        """Release sockets and dispatchers."""
        ...


@functools.lru_cache(maxsize=32768)
def parse_oid(text: str) -> Oid:
    """``"1.3.6.1"`` or ``".1.3.6.1"`` as a tuple of ints; ValueError when it is not an OID.

    Memoised (bounded): every read parses the same few hundred OIDs of a PDU's walk."""
    parts = text.strip().lstrip(".").split(".")
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not an OID: {text!r}")
    return tuple(int(p) for p in parts)


def format_oid(oid: Oid) -> str:
    return ".".join(str(n) for n in oid)


# ---------------------------------------------------------------------------------------------
# Recorded walks: snmpsim .snmprec and net-snmp snmpwalk output


_SNMPREC_INTEGER_TAGS = {"2", "65", "66", "67", "70"}
_SNMPREC_MISSING = {
    "128": Missing.NO_SUCH_OBJECT,
    "129": Missing.NO_SUCH_INSTANCE,
    "130": Missing.END_OF_MIB_VIEW,
}
_ESCAPES = {"\\": 92, "'": 39, '"': 34, "a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}


def _unescape(text: str) -> bytes:
    out = bytearray()
    i = 0
    while i < len(text):
        char = text[i]
        if char != "\\":
            out.append(ord(char) & 0xFF)
            i += 1
            continue
        code = text[i + 1 : i + 2]
        if code == "x":
            out.append(int(text[i + 2 : i + 4], 16))
            i += 4
        elif code in _ESCAPES:
            out.append(_ESCAPES[code])
            i += 2
        else:
            raise ValueError(f"unknown escape \\{code}")
    return bytes(out)


def _snmprec_value(tag: str, text: str) -> SnmpValue | None:
    encoding = tag[-1] if tag[-1] in "xe" else ""
    base = tag[:-1] if encoding else tag
    if base in _SNMPREC_MISSING:
        return _SNMPREC_MISSING[base]
    if base in _SNMPREC_INTEGER_TAGS and not encoding:
        return int(text)
    if base in ("4", "68"):
        if encoding == "x":
            return bytes.fromhex(text)
        if encoding == "e":
            return _unescape(text)
        return text.encode("iso-8859-1")
    if base == "6" and not encoding:
        return format_oid(parse_oid(text))
    if base == "64":
        return ".".join(str(b) for b in bytes.fromhex(text)) if encoding == "x" else text
    return None


def decode_snmprec(text: str) -> list[VarBind]:
    """Records of an snmpsim ``.snmprec`` file (``OID|TAG|VALUE`` lines).

    Malformed lines and values computed by snmpsim variation modules (``TAG:module``, other
    than ``writecache`` which stores a plain value) are skipped: they are not recorded data.
    """
    out: list[VarBind] = []
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) != 3:
            continue
        oid, tag, value_text = parts
        tag, _, module = tag.partition(":")
        if module and module != "writecache":
            continue
        try:
            value = _snmprec_value(tag, value_text) if tag else None
            oid = format_oid(parse_oid(oid))
        except (ValueError, IndexError):
            continue
        if value is not None:
            out.append((oid, value))
    return out


_WALK_VALUE = re.compile(r"^(\w+(?:[\-\ ]\w+)?):\ ?(.*)$")
_MAC_LIKE = re.compile(r"^[0-9a-fA-F]{1,2}(:[0-9a-fA-F]{1,2})+$")
_LEADING_INT = re.compile(r"^(-?\d+)(?:\s.*)?$")
_PARENTHESISED_INT = re.compile(r"^.*?\((-?\d+)\)")
_HEX_BYTES = re.compile(r"^([0-9a-fA-F]{2}(?:\s+[0-9a-fA-F]{2})*)")


def _walk_integer(text: str) -> int:
    match = _LEADING_INT.match(text) or _PARENTHESISED_INT.match(text)
    if match is None:
        raise ValueError(f"not an integer: {text!r}")
    return int(match.group(1))


def _walk_value(kind: str, text: str) -> SnmpValue | None:
    kind = kind.upper()
    if kind in ("INTEGER", "GAUGE32", "COUNTER32", "COUNTER64", "UNSIGNED32"):
        return _walk_integer(text)
    if kind == "TIMETICKS":
        match = _PARENTHESISED_INT.match(text)
        return int(match.group(1)) if match else int(text)
    if kind == "STRING":
        if len(text) >= 2 and text[0] == text[-1] == '"':
            return text[1:-1].encode("iso-8859-1")
        if _MAC_LIKE.match(text):
            return bytes(int(x, 16) for x in text.split(":"))
        return text.encode("iso-8859-1")
    if kind in ("HEX-STRING", "BITS"):
        if not text:
            return b""
        match = _HEX_BYTES.match(text)
        if match is None:
            raise ValueError(f"not hex: {text!r}")
        return bytes(int(x, 16) for x in match.group(1).split())
    if kind == "OID":
        return format_oid(parse_oid(text))
    if kind == "IPADDRESS":
        return text
    return None


def decode_snmpwalk(text: str) -> list[VarBind]:
    """Records of net-snmp ``snmpwalk -On`` output (``.OID = TYPE: value`` lines).

    Reads values the way snmpsim serves such a file; lines it cannot read are skipped.
    """
    out: list[VarBind] = []
    for raw in text.splitlines():
        line = raw.encode("ascii", "ignore").decode().strip()
        oid, sep, rest = line.partition(" = ")
        if not sep:
            continue
        match = _WALK_VALUE.match(rest)
        try:
            if match:
                value = _walk_value(match.group(1), match.group(2).strip())
            elif rest == '""':
                value = b""
            else:
                value = None
            oid = format_oid(parse_oid(oid))
        except ValueError:
            continue
        if value is not None:
            out.append((oid, value))
    return out


class SnmprecClient:
    """Answers SNMP requests from a recorded walk, for capture-directory replay and tests.

    ``NAME.snmprec`` is read as snmpsim records, any other name as net-snmp ``snmpwalk -On``
    output. A missing file is :class:`SourceUnavailable`; a file without a single readable
    record is a :class:`SourceError`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._oids: list[Oid] = []
        self._binds: list[VarBind] = []

    async def open(self) -> None:
        if self._binds:
            return
        try:
            text = await asyncio.to_thread(self.path.read_bytes)
        except FileNotFoundError as e:
            raise SourceUnavailable(f"no recorded SNMP walk at {self.path}") from e
        except OSError as e:
            raise SourceError(f"reading {self.path}: {e}") from e
        decode = decode_snmprec if self.path.suffix == ".snmprec" else decode_snmpwalk
        records = {parse_oid(oid): (oid, value) for oid, value in decode(text.decode("iso-8859-1"))}
        if not records:
            raise SourceError(f"{self.path}: no readable SNMP records")
        self._oids = sorted(records)
        self._binds = [records[oid] for oid in self._oids]

    async def get(self, oids: Sequence[str]) -> list[VarBind]:
        await self.open()
        out: list[VarBind] = []
        for oid in oids:
            key = parse_oid(oid)
            at = bisect.bisect_left(self._oids, key)
            found = at < len(self._oids) and self._oids[at] == key
            out.append(self._binds[at] if found else (format_oid(key), Missing.NO_SUCH_INSTANCE))
        return out

    async def walk(self, oid: str) -> list[VarBind]:
        await self.open()
        prefix = parse_oid(oid)
        at = bisect.bisect_right(self._oids, prefix)
        out: list[VarBind] = []
        while at < len(self._oids) and self._oids[at][: len(prefix)] == prefix:
            out.append(self._binds[at])
            at += 1
        return out

    async def close(self) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# A live PDU over SNMPv2c (pysnmp 7, asyncio)


@functools.cache
def _pysnmp() -> SimpleNamespace:
    """pysnmp, imported on first use: it takes about a second to import."""
    import pysnmp.hlapi.v3arch.asyncio as hlapi  # type: ignore[import-untyped]
    from pyasn1.type import univ  # type: ignore[import-untyped]
    from pysnmp.error import PySnmpError  # type: ignore[import-untyped]
    from pysnmp.proto import errind, rfc1902, rfc1905  # type: ignore[import-untyped]
    from pysnmp.smi import builder, view  # type: ignore[import-untyped]

    return SimpleNamespace(
        hlapi=hlapi,
        univ=univ,
        PySnmpError=PySnmpError,
        errind=errind,
        rfc1902=rfc1902,
        rfc1905=rfc1905,
        builder=builder,
        view=view,
    )


@functools.cache
def _mib_view() -> Any:
    """One MIB view for every engine of the process.

    pysnmp builds a MIB compiler into each engine's view on its first request when pysmi is
    installed (about a second); requests here use numeric OIDs only, so one view serves all.
    """
    snmp = _pysnmp()
    return snmp.view.MibViewController(snmp.builder.MibBuilder())


def _from_pysnmp(name: Any, value: Any) -> VarBind | None:
    """A pysnmp (name, value) pair as a VarBind; None for NULL and unknown types."""
    snmp = _pysnmp()
    oid = str(name)
    if isinstance(value, snmp.rfc1905.NoSuchObject):
        return oid, Missing.NO_SUCH_OBJECT
    if isinstance(value, snmp.rfc1905.NoSuchInstance):
        return oid, Missing.NO_SUCH_INSTANCE
    if isinstance(value, snmp.rfc1905.EndOfMibView):
        return oid, Missing.END_OF_MIB_VIEW
    if isinstance(value, snmp.rfc1902.IpAddress):
        return oid, ".".join(str(b) for b in value.asNumbers())
    if isinstance(value, snmp.univ.OctetString):
        return oid, bytes(value.asOctets())
    if isinstance(value, snmp.univ.ObjectIdentifier):
        return oid, str(value)
    if isinstance(value, snmp.univ.Integer):
        return oid, int(value)
    return None


class PysnmpClient:
    """SNMPv2c GET and GETBULK walks against one agent.

    Every request is bounded by ``timeout_s`` x (``retries`` + 1); no answer raises
    :class:`SnmpTimeout`, an SNMP error-status :class:`SnmpError` with the code.
    """

    def __init__(
        self,
        host: str,
        port: int = 161,
        community: str = "public",
        timeout_s: float = 1.0,
        retries: int = 1,
        max_repetitions: int = 25,
    ) -> None:
        self.host = host
        self.port = port
        self.community = community
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_repetitions = max_repetitions
        self._engine: Any = None
        self._target: Any = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def open(self) -> None:
        await self._session()

    async def _session(self) -> tuple[Any, Any]:
        if self._engine is None:
            # importing pysnmp and building an engine take CPU seconds: not on the event loop
            mib_view = await asyncio.to_thread(_mib_view)
            engine = await asyncio.to_thread(_pysnmp().hlapi.SnmpEngine)
            engine.cache["mibViewController"] = mib_view
            self._engine = self._engine or engine
        snmp = _pysnmp()
        if self._target is None:
            try:
                self._target = await snmp.hlapi.UdpTransportTarget.create(
                    (self.host, self.port), timeout=self.timeout_s, retries=self.retries
                )
            except snmp.PySnmpError as e:
                raise SourceError(f"SNMP agent {self.address}: {e}") from e
        return self._engine, self._target

    def _check(self, what: str, indication: Any, status: Any, index: Any) -> None:
        if isinstance(indication, _pysnmp().errind.RequestTimedOut):
            raise SnmpTimeout(
                f"SNMP agent {self.address}: no response to {what} "
                f"within {self.timeout_s:g}s x {self.retries + 1} tries"
            )
        if indication:
            raise SnmpError(f"SNMP agent {self.address}: {what}: {indication}")
        code = int(status) if status else 0
        if code:
            name = status.prettyPrint() if hasattr(status, "prettyPrint") else str(code)
            raise SnmpError(
                f"SNMP agent {self.address}: {what}: {name} (error-status {code}, index {index})",
                status=code,
            )

    async def get(self, oids: Sequence[str]) -> list[VarBind]:
        hlapi = _pysnmp().hlapi
        engine, target = await self._session()
        what = f"GET {', '.join(oids)}"
        try:
            indication, status, index, binds = await hlapi.get_cmd(
                engine,
                hlapi.CommunityData(self.community, mpModel=1),
                target,
                hlapi.ContextData(),
                *(hlapi.ObjectType(hlapi.ObjectIdentity(oid)) for oid in oids),
                lookupMib=False,
            )
        except _pysnmp().PySnmpError as e:
            raise SnmpError(f"SNMP agent {self.address}: {what}: {e}") from e
        self._check(what, indication, status, index)
        return [
            _from_pysnmp(name, value) or (str(name), Missing.NO_SUCH_OBJECT)
            for name, value in binds
        ]

    async def walk(self, oid: str) -> list[VarBind]:
        hlapi = _pysnmp().hlapi
        engine, target = await self._session()
        prefix = parse_oid(oid)
        cursor = prefix
        out: list[VarBind] = []
        while True:
            what = f"GETBULK {format_oid(cursor)}"
            try:
                indication, status, index, binds = await hlapi.bulk_cmd(
                    engine,
                    hlapi.CommunityData(self.community, mpModel=1),
                    target,
                    hlapi.ContextData(),
                    0,
                    self.max_repetitions,
                    hlapi.ObjectType(hlapi.ObjectIdentity(format_oid(cursor))),
                    lookupMib=False,
                )
            except _pysnmp().PySnmpError as e:
                raise SnmpError(f"SNMP agent {self.address}: {what}: {e}") from e
            self._check(what, indication, status, index)
            last = cursor
            for name, value in binds:
                current = parse_oid(str(name))
                bind = _from_pysnmp(name, value)
                if current[: len(prefix)] != prefix or (bind and isinstance(bind[1], Missing)):
                    return out
                if current <= last:
                    raise SnmpError(f"SNMP agent {self.address}: OIDs not increasing at {name}")
                last = current
                if bind is not None:
                    out.append(bind)
            if last == cursor:
                return out
            cursor = last

    async def close(self) -> None:
        engine, self._engine, self._target = self._engine, None, None
        if engine is not None:
            engine.close_dispatcher()


# ---------------------------------------------------------------------------------------------
# Parsing: pure functions of the walked (oid, value) pairs

PDU_INFO = "hyperagent_pdu_info"
INLET_POWER = "hyperagent_pdu_inlet_power_watts"
INLET_CURRENT = "hyperagent_pdu_inlet_current_amperes"
INLET_VOLTAGE = "hyperagent_pdu_inlet_voltage_volts"
INLET_ENERGY = "hyperagent_pdu_inlet_energy_joules_total"
PHASE_POWER = "hyperagent_pdu_phase_power_watts"
PHASE_CURRENT = "hyperagent_pdu_phase_current_amperes"
PHASE_VOLTAGE = "hyperagent_pdu_phase_voltage_volts"
OUTLET_INFO = "hyperagent_pdu_outlet_info"
OUTLET_POWER = "hyperagent_pdu_outlet_power_watts"
OUTLET_CURRENT = "hyperagent_pdu_outlet_current_amperes"
OUTLET_VOLTAGE = "hyperagent_pdu_outlet_voltage_volts"
OUTLET_ENERGY = "hyperagent_pdu_outlet_energy_joules_total"
NODE_POWER = "hyperagent_pdu_node_power_watts"
NODE_ENERGY = "hyperagent_pdu_node_energy_joules_total"
SENSOR_POWER = "hyperagent_pdu_sensor_power_watts"
SENSOR_CURRENT = "hyperagent_pdu_sensor_current_amperes"
SENSOR_VOLTAGE = "hyperagent_pdu_sensor_voltage_volts"
SENSOR_TEMPERATURE = "hyperagent_pdu_sensor_temperature_celsius"

HELP: dict[str, str] = {
    PDU_INFO: "PDU identity: vendor, the PDU's own name, model, serial number and firmware.",
    INLET_POWER: "Active power drawn through a PDU inlet (input cord).",
    INLET_CURRENT: "RMS current through a single-phase PDU inlet.",
    INLET_VOLTAGE: "RMS voltage at a single-phase PDU inlet.",
    INLET_ENERGY: "Energy drawn through a PDU inlet since the PDU's meter was last reset.",
    PHASE_POWER: "Active power on one phase of a PDU inlet.",
    PHASE_CURRENT: "RMS current on one phase or line conductor of a PDU inlet.",
    PHASE_VOLTAGE: "RMS voltage of one phase of a PDU inlet.",
    OUTLET_INFO: "Name an operator gave a PDU outlet.",
    OUTLET_POWER: "Active power drawn from a PDU outlet.",
    OUTLET_CURRENT: "RMS current drawn from a PDU outlet.",
    OUTLET_VOLTAGE: "RMS voltage at a PDU outlet.",
    OUTLET_ENERGY: "Energy drawn from a PDU outlet since the PDU's meter was last reset.",
    NODE_POWER: "Wall power of this node: the sum of its configured outlets on this PDU.",
    NODE_ENERGY: "Energy drawn by this node: the sum of its configured outlets' meters.",
    SENSOR_POWER: "Power reported by an ENTITY-SENSOR-MIB sensor of a PDU.",
    SENSOR_CURRENT: "Current reported by an ENTITY-SENSOR-MIB sensor of a PDU.",
    SENSOR_VOLTAGE: "Voltage reported by an ENTITY-SENSOR-MIB sensor of a PDU.",
    SENSOR_TEMPERATURE: "Temperature reported by an ENTITY-SENSOR-MIB sensor of a PDU.",
}

JOULES_PER_WH = 3600
JOULES_PER_TENTH_KWH = 360_000

SYS_DESCR = "1.3.6.1.2.1.1.1.0"
SYS_OBJECT_ID = "1.3.6.1.2.1.1.2.0"
SYS_NAME = "1.3.6.1.2.1.1.5.0"


Row = dict[int, SnmpValue]


class Walk:
    """Walked objects indexed by OID, read as tables of rows."""

    def __init__(self, binds: Iterable[VarBind]) -> None:
        self.values: dict[Oid, SnmpValue] = {}
        values = self.values
        for oid, value in binds:
            try:
                values[parse_oid(oid)] = value
            except ValueError:
                continue
        self._by_width: dict[int, dict[Oid, list[tuple[Oid, SnmpValue]]]] = {}

    def _objects(self, width: int) -> dict[Oid, list[tuple[Oid, SnmpValue]]]:
        """The objects with an index of ``width`` integers, by their column's entry OID (what
        is left without the column number and the index), in walk order; built once per width
        rather than scanning every object for every table."""
        found = self._by_width.get(width)
        if found is None:
            found = self._by_width[width] = {}
            cut = -1 - width
            for oid, value in self.values.items():
                entry = oid[:cut]
                group = found.get(entry)
                if group is None:
                    found[entry] = [(oid, value)]
                else:
                    group.append((oid, value))
        return found

    def scalar(self, oid: str) -> SnmpValue | None:
        return self.values.get(parse_oid(oid))

    def table(self, entry: str, width: int = 1) -> dict[Oid, Row]:
        """Rows of the table whose conceptual row is ``entry``, indexed by ``width`` integers:
        index -> column -> value. Objects with another index width are not of this table."""
        prefix = parse_oid(entry)
        n = len(prefix)
        rows: dict[Oid, Row] = {}
        for oid, value in self._objects(width).get(prefix, ()):
            rows.setdefault(oid[n + 1 :], {})[oid[n]] = value
        return dict(sorted(rows.items()))


def number(value: SnmpValue | None) -> int | None:
    """An integer reading; None for exception values and anything that is not an integer."""
    return value if isinstance(value, int) else None


def measured(value: SnmpValue | None) -> int | None:
    """A non-negative integer reading: PDUs report -1 (or less) for 'not available'."""
    n = number(value)
    return n if n is not None and n >= 0 else None


def text(value: SnmpValue | None) -> str:
    """A display string: octets decoded as UTF-8, without padding NULs or surrounding blanks."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").replace("\x00", "").strip()
    if isinstance(value, (str, int)):
        return str(value)
    return ""


def unit_id(unit: int | None, position: int | str, first: int = 1) -> str:
    """The id of an inlet or outlet: plain on the first (or only) unit of a daisy chain,
    ``unit:position`` on the others."""
    return str(position) if unit is None or unit == first else f"{unit}:{position}"


@dataclass
class _Builder:
    pdu: str
    readings: list[Reading] = field(default_factory=list)

    def gauge(self, name: str, value: float | None, **labels: str) -> None:
        if value is not None:
            self.readings.append(Reading(name, float(value), {"pdu": self.pdu, **labels}))

    def counter(self, name: str, joules: float | None, **labels: str) -> None:
        if joules is not None:
            self.readings.append(
                Reading(name, float(joules), {"pdu": self.pdu, **labels}, Kind.COUNTER)
            )

    def info(self, vendor: str, name: str, model: str, serial: str, firmware: str) -> None:
        labels = {
            "pdu": self.pdu,
            "vendor": vendor,
            "name": name,
            "model": model,
            "serial": serial,
            "firmware": firmware,
        }
        self.readings.append(Reading(PDU_INFO, 1.0, labels, Kind.INFO))

    def outlet_name(self, outlet: str, name: str) -> None:
        if name:
            labels = {"pdu": self.pdu, "outlet": outlet, "name": name}
            self.readings.append(Reading(OUTLET_INFO, 1.0, labels, Kind.INFO))


def _scaled(value: int | None, divisor: float) -> float | None:
    return None if value is None else value / divisor


def _times(value: int | None, factor: int) -> float | None:
    return None if value is None else float(value * factor)


def _first_row(rows: Mapping[Oid, Row]) -> Row:
    return next(iter(rows.values()), {})


APC = "1.3.6.1.4.1.318.1.1.26"
APC_IDENT = f"{APC}.2.1"
APC_DEVICE_STATUS = f"{APC}.4.3.1"
APC_PHASE_STATUS = f"{APC}.6.3.1"
APC_OUTLET_METERED_STATUS = f"{APC}.9.4.3.1"


def parse_apc(binds: Sequence[VarBind], pdu: str) -> list[Reading]:
    """APC PowerNet-MIB rPDU2 (Rack PDU 2G): device, phase and metered-outlet status tables.

    Device power is in hundredths of kW, energy in tenths of kWh; phase current in tenths of A,
    voltage in V, power in hundredths of kW; outlet current in tenths of A, power in W, energy
    in tenths of kWh. -1 means the model does not measure it.
    """
    walk = Walk(binds)
    out = _Builder(pdu)
    ident = _first_row(walk.table(APC_IDENT))
    out.info(
        "apc",
        text(ident.get(3)) or text(walk.scalar(SYS_NAME)),
        text(ident.get(8)),
        text(ident.get(9)),
        text(ident.get(6)),
    )
    for row in walk.table(APC_DEVICE_STATUS).values():
        inlet = str(number(row.get(2)) or 1)
        out.gauge(INLET_POWER, _times(measured(row.get(5)), 10), inlet=inlet)
        out.counter(INLET_ENERGY, _times(measured(row.get(9)), JOULES_PER_TENTH_KWH), inlet=inlet)
    for index, row in walk.table(APC_PHASE_STATUS).items():
        inlet = str(number(row.get(2)) or 1)
        phase = str(number(row.get(3)) or index[-1])
        out.gauge(PHASE_CURRENT, _scaled(measured(row.get(5)), 10), inlet=inlet, phase=phase)
        out.gauge(PHASE_VOLTAGE, measured(row.get(6)), inlet=inlet, phase=phase)
        out.gauge(PHASE_POWER, _times(measured(row.get(7)), 10), inlet=inlet, phase=phase)
    for index, row in walk.table(APC_OUTLET_METERED_STATUS).items():
        outlet = unit_id(number(row.get(2)), number(row.get(4)) or index[-1])
        out.outlet_name(outlet, text(row.get(3)))
        out.gauge(OUTLET_CURRENT, _scaled(measured(row.get(6)), 10), outlet=outlet)
        out.gauge(OUTLET_POWER, measured(row.get(7)), outlet=outlet)
        energy = _times(measured(row.get(11)), JOULES_PER_TENTH_KWH)
        out.counter(OUTLET_ENERGY, energy, outlet=outlet)
    return out.readings


RARITAN = "1.3.6.1.4.1.13742.6"
RARITAN_NAMEPLATE = f"{RARITAN}.3.2.1.1"
RARITAN_UNIT_CONFIG = f"{RARITAN}.3.2.2.1"
RARITAN_INLET_SENSOR_CONFIG = f"{RARITAN}.3.3.4.1"
RARITAN_OUTLET_CONFIG = f"{RARITAN}.3.5.3.1"
RARITAN_OUTLET_SENSOR_CONFIG = f"{RARITAN}.3.5.4.1"
RARITAN_INLET_SENSORS = f"{RARITAN}.5.2.3.1"
RARITAN_INLET_POLE_SENSORS = f"{RARITAN}.5.2.4.1"
RARITAN_OUTLET_SENSORS = f"{RARITAN}.5.4.3.1"
_RARITAN_UNAVAILABLE = -1  # sensorStateEnumeration unavailable
_RARITAN_RMS_CURRENT = 1  # sensorTypeEnumeration
_RARITAN_RMS_VOLTAGE = 4
_RARITAN_ACTIVE_POWER = 5
_RARITAN_ACTIVE_ENERGY = 8


def _raritan_add(
    out: _Builder, metrics: Mapping[int, str], sensor: int, value: float, **labels: str
) -> None:
    """The reading of one Raritan sensor, if its type has a metric here (energy is in Wh)."""
    if sensor == _RARITAN_ACTIVE_ENERGY and sensor in metrics:
        out.counter(metrics[sensor], value * JOULES_PER_WH, **labels)
    elif sensor in metrics:
        out.gauge(metrics[sensor], value, **labels)


def _raritan_values(
    sensors: Mapping[Oid, Row], digits: Mapping[Oid, Row], digits_key: Callable[[Oid], Oid]
) -> dict[Oid, float]:
    """Sensor values by index, scaled by their decimal digits; unavailable ones left out."""
    values: dict[Oid, float] = {}
    for index, row in sensors.items():
        raw = measured(row.get(4))
        if raw is None or number(row.get(3)) == _RARITAN_UNAVAILABLE:
            continue
        decimals = measured(digits.get(digits_key(index), {}).get(7)) or 0
        values[index] = raw / 10**decimals if decimals else float(raw)
    return values


def parse_raritan(binds: Sequence[VarBind], pdu: str) -> list[Reading]:
    """Raritan PDU2-MIB (PX2/PX3): inlet, inlet pole and outlet sensor measurements.

    Each value is scaled by the sensor's configured decimal digits; energy is in Wh. Pole
    sensors use the decimal digits of the inlet sensor of the same type.
    """
    walk = Walk(binds)
    out = _Builder(pdu)
    nameplate = _first_row(walk.table(RARITAN_NAMEPLATE))
    unit = _first_row(walk.table(RARITAN_UNIT_CONFIG))
    out.info(
        "raritan",
        text(unit.get(13)) or text(walk.scalar(SYS_NAME)),
        text(nameplate.get(3)),
        text(nameplate.get(4)),
        "",
    )
    inlet_digits = walk.table(RARITAN_INLET_SENSOR_CONFIG, 3)
    inlets = _raritan_values(walk.table(RARITAN_INLET_SENSORS, 3), inlet_digits, lambda i: i)
    inlet_metrics = {
        _RARITAN_RMS_CURRENT: INLET_CURRENT,
        _RARITAN_RMS_VOLTAGE: INLET_VOLTAGE,
        _RARITAN_ACTIVE_POWER: INLET_POWER,
        _RARITAN_ACTIVE_ENERGY: INLET_ENERGY,
    }
    for (pdu_id, inlet_id, sensor), value in inlets.items():
        _raritan_add(out, inlet_metrics, sensor, value, inlet=unit_id(pdu_id, inlet_id))
    poles = _raritan_values(
        walk.table(RARITAN_INLET_POLE_SENSORS, 4), inlet_digits, lambda i: (i[0], i[1], i[3])
    )
    pole_metrics = {
        _RARITAN_RMS_CURRENT: PHASE_CURRENT,
        _RARITAN_RMS_VOLTAGE: PHASE_VOLTAGE,
        _RARITAN_ACTIVE_POWER: PHASE_POWER,
    }
    for (pdu_id, inlet_id, pole, sensor), value in poles.items():
        inlet = unit_id(pdu_id, inlet_id)
        _raritan_add(out, pole_metrics, sensor, value, inlet=inlet, phase=f"L{pole}")
    config = walk.table(RARITAN_OUTLET_CONFIG, 2)
    outlet_ids = {
        index: unit_id(index[0], text(row.get(2)) or index[1]) for index, row in config.items()
    }
    for index, row in config.items():
        out.outlet_name(outlet_ids[index], text(row.get(3)))
    outlets = _raritan_values(
        walk.table(RARITAN_OUTLET_SENSORS, 3),
        walk.table(RARITAN_OUTLET_SENSOR_CONFIG, 3),
        lambda i: i,
    )
    outlet_metrics = {
        _RARITAN_RMS_CURRENT: OUTLET_CURRENT,
        _RARITAN_RMS_VOLTAGE: OUTLET_VOLTAGE,
        _RARITAN_ACTIVE_POWER: OUTLET_POWER,
        _RARITAN_ACTIVE_ENERGY: OUTLET_ENERGY,
    }
    for (pdu_id, outlet_id, sensor), value in outlets.items():
        outlet = outlet_ids.get((pdu_id, outlet_id)) or unit_id(pdu_id, outlet_id)
        _raritan_add(out, outlet_metrics, sensor, value, outlet=outlet)
    return out.readings


SENTRY4 = "1.3.6.1.4.1.1718.4.1"
SENTRY4_SYSTEM = f"{SENTRY4}.1.1"
SENTRY4_UNIT_CONFIG = f"{SENTRY4}.2.2.1"
SENTRY4_CORD_CONFIG = f"{SENTRY4}.3.2.1"
SENTRY4_CORD_MONITOR = f"{SENTRY4}.3.3.1"
SENTRY4_LINE_CONFIG = f"{SENTRY4}.4.2.1"
SENTRY4_LINE_MONITOR = f"{SENTRY4}.4.3.1"
SENTRY4_PHASE_CONFIG = f"{SENTRY4}.5.2.1"
SENTRY4_PHASE_MONITOR = f"{SENTRY4}.5.3.1"
SENTRY4_OUTLET_CONFIG = f"{SENTRY4}.8.2.1"
SENTRY4_OUTLET_MONITOR = f"{SENTRY4}.8.3.1"
_SENTRY4_LINES = {1: "L1", 2: "L2", 3: "L3", 4: "N"}


def _without_cord_prefix(label: str, cord: str) -> str:
    prefix = f"{cord}:"
    return label[len(prefix) :] if cord and label.startswith(prefix) else label


def parse_servertech(binds: Sequence[VarBind], pdu: str) -> list[Reading]:
    """ServerTech Sentry4-MIB (PRO1/PRO2): input cords, their lines and phases, and outlets.

    Cord and phase energy are in tenths of kWh, outlet energy in Wh; currents in hundredths
    of A, voltages in tenths of V, power in W. Phase current is the current on each line
    conductor (st4LineCurrent), labelled by the line (L1, L2, L3, N).
    """
    walk = Walk(binds)
    out = _Builder(pdu)
    unit = _first_row(walk.table(SENTRY4_UNIT_CONFIG))
    out.info(
        "servertech",
        text(unit.get(3)) or text(walk.scalar(SYS_NAME)),
        text(unit.get(5)) or text(walk.scalar(f"{SENTRY4_SYSTEM}.1.0")),
        text(unit.get(4)),
        text(walk.scalar(f"{SENTRY4_SYSTEM}.3.0")),
    )
    cords = {
        index: text(row.get(2)) or unit_id(index[0], index[1])
        for index, row in walk.table(SENTRY4_CORD_CONFIG, 2).items()
    }

    def cord_of(index: Oid) -> str:
        return cords.get(index[:2]) or unit_id(index[0], index[1])

    for index, row in walk.table(SENTRY4_CORD_MONITOR, 2).items():
        inlet = cord_of(index)
        out.gauge(INLET_POWER, measured(row.get(3)), inlet=inlet)
        energy = _times(measured(row.get(10)), JOULES_PER_TENTH_KWH)
        out.counter(INLET_ENERGY, energy, inlet=inlet)
    line_labels = walk.table(SENTRY4_LINE_CONFIG, 3)
    for index, row in walk.table(SENTRY4_LINE_MONITOR, 3).items():
        inlet = cord_of(index)
        label = text(line_labels.get(index, {}).get(4))
        line = _without_cord_prefix(label, inlet) or _SENTRY4_LINES.get(index[-1], str(index[-1]))
        out.gauge(PHASE_CURRENT, _scaled(measured(row.get(3)), 100), inlet=inlet, phase=line)
    phase_labels = walk.table(SENTRY4_PHASE_CONFIG, 3)
    for index, row in walk.table(SENTRY4_PHASE_MONITOR, 3).items():
        inlet = cord_of(index)
        label = text(phase_labels.get(index, {}).get(4))
        phase = _without_cord_prefix(label, inlet) or str(index[-1])
        out.gauge(PHASE_VOLTAGE, _scaled(measured(row.get(3)), 10), inlet=inlet, phase=phase)
        out.gauge(PHASE_POWER, measured(row.get(8)), inlet=inlet, phase=phase)
    outlet_config = walk.table(SENTRY4_OUTLET_CONFIG, 3)
    outlet_ids = {
        index: text(row.get(2)) or f"{cord_of(index)}{index[-1]}"
        for index, row in outlet_config.items()
    }
    for index, row in outlet_config.items():
        out.outlet_name(outlet_ids[index], text(row.get(3)))
    for index, row in walk.table(SENTRY4_OUTLET_MONITOR, 3).items():
        outlet = outlet_ids.get(index) or f"{cord_of(index)}{index[-1]}"
        out.gauge(OUTLET_CURRENT, _scaled(measured(row.get(3)), 100), outlet=outlet)
        out.gauge(OUTLET_VOLTAGE, _scaled(measured(row.get(6)), 10), outlet=outlet)
        out.gauge(OUTLET_POWER, measured(row.get(7)), outlet=outlet)
        out.counter(OUTLET_ENERGY, _times(measured(row.get(14)), JOULES_PER_WH), outlet=outlet)
    return out.readings


EATON = "1.3.6.1.4.1.534.6.6.7"
EATON_UNIT = f"{EATON}.1.2.1"
EATON_INPUT_VOLTAGE = f"{EATON}.3.2.1"
EATON_INPUT_CURRENT = f"{EATON}.3.3.1"
EATON_INPUT_POWER = f"{EATON}.3.4.1"
EATON_INPUT_TOTAL_POWER = f"{EATON}.3.5.1"
EATON_OUTLET = f"{EATON}.6.1.1"
EATON_OUTLET_VOLTAGE = f"{EATON}.6.3.1"
EATON_OUTLET_CURRENT = f"{EATON}.6.4.1"
EATON_OUTLET_POWER = f"{EATON}.6.5.1"
_EATON_VOLTAGE_PHASES = {
    1: "L",
    2: "L1-N",
    3: "L2-N",
    4: "L3-N",
    5: "L1-L2",
    6: "L2-L3",
    7: "L3-L1",
}
_EATON_CURRENT_LINES = {1: "L", 2: "N", 3: "L1", 4: "L2", 5: "L3"}
_EATON_POWER_PHASES = {1: "L1", 2: "L2", 3: "L3"}
_EATON_TOTAL = 4


def parse_eaton(binds: Sequence[VarBind], pdu: str) -> list[Reading]:
    """Eaton EATON-EPDU-MIB (G2/G3 ePDU): inputs and their phases, and outlets.

    Voltages are in mV, currents in mA, power in W, energy in Wh. Units chained by strapping
    (daisy chain) are told apart by strapping index; 0 is the master.
    """
    walk = Walk(binds)
    out = _Builder(pdu)
    unit = _first_row(walk.table(EATON_UNIT))
    out.info(
        "eaton",
        text(unit.get(6)) or text(walk.scalar(SYS_NAME)),
        text(unit.get(3)) or text(unit.get(2)),
        text(unit.get(4)),
        text(unit.get(5)),
    )
    totals: dict[str, tuple[int | None, int | None]] = {}
    for (strap, input_), row in walk.table(EATON_INPUT_TOTAL_POWER, 2).items():
        totals[unit_id(strap, input_, first=0)] = (measured(row.get(4)), measured(row.get(5)))
    for (strap, input_, _), row in walk.table(EATON_INPUT_POWER, 3).items():
        inlet = unit_id(strap, input_, first=0)
        kind = number(row.get(2))
        if kind == _EATON_TOTAL and inlet not in totals:
            totals[inlet] = (measured(row.get(4)), measured(row.get(5)))
        elif kind in _EATON_POWER_PHASES:
            phase = _EATON_POWER_PHASES[kind]
            out.gauge(PHASE_POWER, measured(row.get(4)), inlet=inlet, phase=phase)
    for inlet, (watts, wh) in totals.items():
        out.gauge(INLET_POWER, watts, inlet=inlet)
        out.counter(INLET_ENERGY, _times(wh, JOULES_PER_WH), inlet=inlet)
    for (strap, input_, measurement), row in walk.table(EATON_INPUT_VOLTAGE, 3).items():
        phase = _EATON_VOLTAGE_PHASES.get(number(row.get(2)) or 0, str(measurement))
        inlet = unit_id(strap, input_, first=0)
        out.gauge(PHASE_VOLTAGE, _scaled(measured(row.get(3)), 1000), inlet=inlet, phase=phase)
    for (strap, input_, measurement), row in walk.table(EATON_INPUT_CURRENT, 3).items():
        phase = _EATON_CURRENT_LINES.get(number(row.get(2)) or 0, str(measurement))
        inlet = unit_id(strap, input_, first=0)
        out.gauge(PHASE_CURRENT, _scaled(measured(row.get(4)), 1000), inlet=inlet, phase=phase)
    outlet_rows = walk.table(EATON_OUTLET, 2)
    outlet_ids = {
        index: unit_id(index[0], text(row.get(2)) or index[1], first=0)
        for index, row in outlet_rows.items()
    }

    def outlet_of(index: Oid) -> str:
        return outlet_ids.get(index) or unit_id(index[0], index[1], first=0)

    for index, row in outlet_rows.items():
        out.outlet_name(outlet_of(index), text(row.get(3)))
    for index, row in walk.table(EATON_OUTLET_VOLTAGE, 2).items():
        out.gauge(OUTLET_VOLTAGE, _scaled(measured(row.get(2)), 1000), outlet=outlet_of(index))
    for index, row in walk.table(EATON_OUTLET_CURRENT, 2).items():
        out.gauge(OUTLET_CURRENT, _scaled(measured(row.get(3)), 1000), outlet=outlet_of(index))
    for index, row in walk.table(EATON_OUTLET_POWER, 2).items():
        outlet = outlet_of(index)
        out.gauge(OUTLET_POWER, measured(row.get(3)), outlet=outlet)
        out.counter(OUTLET_ENERGY, _times(measured(row.get(4)), JOULES_PER_WH), outlet=outlet)
    return out.readings


ENTITY_SENSORS = "1.3.6.1.2.1.99.1.1.1"
ENTITY_PHYSICAL = "1.3.6.1.2.1.47.1.1.1.1"
_ENTITY_METRICS = {
    3: SENSOR_VOLTAGE,  # voltsAC
    4: SENSOR_VOLTAGE,  # voltsDC
    5: SENSOR_CURRENT,  # amperes
    6: SENSOR_POWER,  # watts
    8: SENSOR_TEMPERATURE,  # celsius
}
_ENTITY_OK = 1
_ENTITY_UNITS_SCALE = 9


def parse_entity_sensor(binds: Sequence[VarBind], pdu: str) -> list[Reading]:
    """ENTITY-SENSOR-MIB (RFC 3433) power, current, voltage and temperature sensors.

    value x 10^(3 x (scale - 9)) / 10^precision; sensors whose status is not ok(1) are left
    out. A sensor is labelled by its entPhysicalName, or its index when the name is empty or
    shared with another sensor.
    """
    walk = Walk(binds)
    out = _Builder(pdu)
    out.info("entity", text(walk.scalar(SYS_NAME)), text(walk.scalar(SYS_DESCR)), "", "")
    physical = walk.table(ENTITY_PHYSICAL)
    sensors = {
        index: row
        for index, row in walk.table(ENTITY_SENSORS).items()
        if number(row.get(1)) in _ENTITY_METRICS and number(row.get(5)) == _ENTITY_OK
    }
    names = {index: text(physical.get(index, {}).get(7)) for index in sensors}
    taken = [name for name in names.values() if name]
    for index, row in sensors.items():
        raw, scale, precision = number(row.get(4)), number(row.get(2)), number(row.get(3))
        if raw is None or scale is None or not 1 <= scale <= 17 or precision is None:
            continue
        exponent = 3 * (scale - _ENTITY_UNITS_SCALE) - precision
        value = raw * 10.0**exponent if exponent >= 0 else raw / 10.0**-exponent
        name = names[index]
        sensor = name if name and taken.count(name) == 1 else format_oid(index)
        out.gauge(_ENTITY_METRICS[number(row.get(1)) or 0], value, sensor=sensor)
    return out.readings


@dataclass(frozen=True)
class Profile:
    """How to read one family of PDUs: the columns to walk and how to parse what they hold."""

    vendor: str
    sys_object_ids: tuple[str, ...]
    columns: tuple[str, ...]
    parse: Callable[[Sequence[VarBind], str], list[Reading]]


def columns(entry: str, *numbers: int) -> tuple[str, ...]:
    """The OIDs of some columns of a table, by the table's entry OID and column numbers."""
    return tuple(f"{entry}.{n}" for n in numbers)


PROFILES: dict[str, Profile] = {
    "apc": Profile(
        "apc",
        ("1.3.6.1.4.1.318",),
        (
            *columns(APC_IDENT, 3, 6, 8, 9),
            *columns(APC_DEVICE_STATUS, 2, 5, 9),
            *columns(APC_PHASE_STATUS, 2, 3, 5, 6, 7),
            *columns(APC_OUTLET_METERED_STATUS, 2, 3, 4, 6, 7, 11),
        ),
        parse_apc,
    ),
    "raritan": Profile(
        "raritan",
        ("1.3.6.1.4.1.13742",),
        (
            *columns(RARITAN_NAMEPLATE, 3, 4),
            *columns(RARITAN_UNIT_CONFIG, 13),
            *columns(RARITAN_INLET_SENSOR_CONFIG, 7),
            *columns(RARITAN_OUTLET_CONFIG, 2, 3),
            *columns(RARITAN_OUTLET_SENSOR_CONFIG, 7),
            *columns(RARITAN_INLET_SENSORS, 3, 4),
            *columns(RARITAN_INLET_POLE_SENSORS, 3, 4),
            *columns(RARITAN_OUTLET_SENSORS, 3, 4),
        ),
        parse_raritan,
    ),
    "servertech": Profile(
        "servertech",
        ("1.3.6.1.4.1.1718.4",),
        (
            *columns(SENTRY4_SYSTEM, 1, 3),
            *columns(SENTRY4_UNIT_CONFIG, 3, 4, 5),
            *columns(SENTRY4_CORD_CONFIG, 2),
            *columns(SENTRY4_CORD_MONITOR, 3, 10),
            *columns(SENTRY4_LINE_CONFIG, 4),
            *columns(SENTRY4_LINE_MONITOR, 3),
            *columns(SENTRY4_PHASE_CONFIG, 4),
            *columns(SENTRY4_PHASE_MONITOR, 3, 8),
            *columns(SENTRY4_OUTLET_CONFIG, 2, 3),
            *columns(SENTRY4_OUTLET_MONITOR, 3, 6, 7, 14),
        ),
        parse_servertech,
    ),
    "eaton": Profile(
        "eaton",
        ("1.3.6.1.4.1.534.6.6.7",),
        (
            *columns(EATON_UNIT, 2, 3, 4, 5, 6),
            *columns(EATON_INPUT_VOLTAGE, 2, 3),
            *columns(EATON_INPUT_CURRENT, 2, 4),
            *columns(EATON_INPUT_POWER, 2, 4, 5),
            *columns(EATON_INPUT_TOTAL_POWER, 4, 5),
            *columns(EATON_OUTLET, 2, 3),
            *columns(EATON_OUTLET_VOLTAGE, 2),
            *columns(EATON_OUTLET_CURRENT, 3),
            *columns(EATON_OUTLET_POWER, 3, 4),
        ),
        parse_eaton,
    ),
    "entity": Profile(
        "entity",
        (),
        (*columns(ENTITY_PHYSICAL, 7), *columns(ENTITY_SENSORS, 1, 2, 3, 4, 5)),
        parse_entity_sensor,
    ),
}
"""Vendor name (as configured) -> profile. ``entity`` is the fallback for unknown PDUs."""

VENDORS = ("auto", *PROFILES)


def detect_vendor(sys_object_id: SnmpValue | None) -> str:
    """The profile for a sysObjectID: the vendor whose enterprise subtree contains it."""
    if not isinstance(sys_object_id, str):
        return "entity"
    try:
        oid = parse_oid(sys_object_id)
    except ValueError:
        return "entity"
    for vendor, profile in PROFILES.items():
        for prefix in profile.sys_object_ids:
            if oid[: len(parse_oid(prefix))] == parse_oid(prefix):
                return vendor
    return "entity"


_MEASUREMENTS = frozenset(HELP) - {PDU_INFO, OUTLET_INFO, NODE_POWER, NODE_ENERGY}


def node_readings(readings: Sequence[Reading], pdu: str, outlets: Sequence[str]) -> list[Reading]:
    """This node's wall power and energy: the sums over its configured outlets.

    An outlet is named by its id (the ``outlet`` label) or by the name the PDU gives it.
    When any configured outlet has no reading the sum would be wrong, so it is left out.
    """
    if not outlets:
        return []
    names = {r.labels["outlet"]: r.labels["name"] for r in readings if r.name == OUTLET_INFO}
    out: list[Reading] = []
    for metric, total, kind in (
        (OUTLET_POWER, NODE_POWER, Kind.GAUGE),
        (OUTLET_ENERGY, NODE_ENERGY, Kind.COUNTER),
    ):
        by_id = {r.labels["outlet"]: r.value for r in readings if r.name == metric}
        by_name = {names[o]: v for o, v in by_id.items() if o in names}
        values = [by_id.get(o, by_name.get(o)) for o in outlets]
        if all(v is not None for v in values):
            out.append(Reading(total, sum(v for v in values if v is not None), {"pdu": pdu}, kind))
    return out


# ---------------------------------------------------------------------------------------------
# The source


@dataclass(frozen=True)
class PduTarget:
    """One PDU to poll, and which of its outlets feed this node."""

    name: str
    host: str
    port: int = 161
    community: str = "public"
    vendor: str = "auto"
    outlets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.vendor not in VENDORS:
            raise ValueError(f"unknown PDU vendor {self.vendor!r}; expected one of {VENDORS}")


class PduSource:
    """Power, energy, current and voltage of one PDU (``target`` is the PDU's name).

    The vendor profile is detected from sysObjectID on the first read when configured as
    ``auto``. A read still running when the next is due makes that one fail instead of queueing.
    """

    name = "pdu"

    def __init__(self, pdu: PduTarget, client: SnmpClient) -> None:
        self.pdu = pdu
        self.target = pdu.name
        self.client = client
        self.vendor = None if pdu.vendor == "auto" else pdu.vendor
        self._busy = asyncio.Lock()
        self._missing_outlets_logged = False

    async def start(self) -> None:
        await self.client.open()

    async def read(self) -> list[Reading]:
        if self._busy.locked():
            raise SourceError(f"PDU {self.pdu.name}: previous SNMP read still running")
        async with self._busy:
            binds = await self.client.get([SYS_DESCR, SYS_OBJECT_ID, SYS_NAME])
            if self.vendor is None:
                self.vendor = detect_vendor(dict(binds).get(SYS_OBJECT_ID))
                log.debug("PDU %s: %s profile", self.pdu.name, self.vendor)
            profile = PROFILES[self.vendor]
            for column in profile.columns:
                binds.extend(await self.client.walk(column))
        readings = profile.parse(binds, self.pdu.name)
        if not any(r.name in _MEASUREMENTS for r in readings):
            raise SourceError(
                f"PDU {self.pdu.name}: no {profile.vendor} power measurements in "
                f"{len(binds)} objects read"
            )
        node = node_readings(readings, self.pdu.name, self.pdu.outlets)
        if self.pdu.outlets and len(node) < 2 and not self._missing_outlets_logged:
            self._missing_outlets_logged = True
            log.warning(
                "PDU %s: not every configured outlet of this node (%s) reports power and "
                "energy; the node's PDU totals are incomplete",
                self.pdu.name,
                ", ".join(self.pdu.outlets),
            )
        return readings + node

    async def close(self) -> None:
        await self.client.close()


def recorded_walk(replay_dir: Path, name: str) -> Path:
    """The recording of PDU ``name`` in a capture directory's ``pdu/`` folder."""
    for suffix in (".snmprec", ".snmpwalk"):
        path = replay_dir / f"{name}{suffix}"
        if path.exists():
            return path
    return replay_dir / f"{name}.snmprec"


def pdu_sources(
    targets: Sequence[PduTarget],
    *,
    replay_dir: Path | None = None,
    timeout_s: float = 1.0,
    retries: int = 1,
) -> list[PduSource]:
    """One source per PDU target.

    With ``replay_dir`` (a capture directory's ``pdu/`` folder) each target reads
    ``NAME.snmprec`` (or ``NAME.snmpwalk``) there instead of the network; without targets,
    every recording in it becomes a target of its own (vendor ``auto``, no node outlets).
    """
    if replay_dir is None:
        return [
            PduSource(t, PysnmpClient(t.host, t.port, t.community, timeout_s, retries))
            for t in targets
        ]
    if not targets:
        recordings = sorted(
            p for p in replay_dir.glob("*") if p.suffix in (".snmprec", ".snmpwalk")
        )
        targets = [PduTarget(p.stem, "replay") for p in recordings]
    return [PduSource(t, SnmprecClient(recorded_walk(replay_dir, t.name))) for t in targets]

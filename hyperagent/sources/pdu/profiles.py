"""PDU support as data: one profile per MIB, chosen by the PDU's sysObjectID.

A profile lists the tables that hold a PDU's inlet, phase and outlet measurements: each
:class:`Table` names its conceptual row (``entry``), how many integers index a row, the columns
it measures (:class:`Measure`: metric, column, unit factor) and where a row's labels come from
(id, operator name, daisy-chained unit, phase). :mod:`hyperagent.sources.pdu.parse` turns the
objects of any profile into readings; :mod:`hyperagent.sources.pdu.source` decides which of them
to request. The OIDs and units are the vendors' MIBs', cited in each profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from hyperagent.sources.pdu.metrics import (
    INLET_CURRENT,
    INLET_ENERGY,
    INLET_POWER,
    INLET_VOLTAGE,
    JOULES_PER_KWH,
    JOULES_PER_TENTH_KWH,
    JOULES_PER_WH,
    OUTLET_CURRENT,
    OUTLET_ENERGY,
    OUTLET_POWER,
    OUTLET_VOLTAGE,
    PHASE_CURRENT,
    PHASE_POWER,
    PHASE_VOLTAGE,
)
from hyperagent.sources.pdu.snmp import Oid, SnmpValue, parse_oid


class Part(StrEnum):
    """What a table measures: a PDU inlet (input cord), one phase of an inlet, or an outlet."""

    INLET = "inlet"
    PHASE = "phase"
    OUTLET = "outlet"


@dataclass(frozen=True)
class Measure:
    """One measured column: ``raw x factor / divisor`` is the metric's unit (W, A, V, J).

    ``sensor`` is for sensor-typed tables (Raritan PDU2), whose last index integer is the
    sensor type: the column holds this metric only in rows of that type.
    """

    metric: str
    column: int
    factor: int = 1
    divisor: int = 1
    sensor: int | None = None


@dataclass(frozen=True)
class Table:
    """A table of one part of the PDU and how its rows are labelled.

    Ids: ``id_column`` holds a row's id (text or number); without it the index gives it, the
    last integer being the position and the first the daisy-chained unit (``per_unit``: the row
    is a whole unit's only inlet, id ``1``). A unit other than ``first_unit`` prefixes the id
    (``unit:id``) unless ``unit_prefix`` is off (the vendor's ids name the unit already).
    ``labels_entry`` is the table holding the label columns when they are not in ``entry``
    (same index). Phases belong to the inlet indexed by their index less its last integer
    (or named in ``inlet_column``); their label is ``codes[code_column]`` when a code column is
    given (rows with other codes are skipped), else the ``id_column`` text without its
    ``inlet:`` prefix, else ``codes[last index integer]``, else that integer. Inlet rows can be
    selected by a code too (a total among phases). ``scalar``: the "table" is a group of scalars
    (``.0``) describing the PDU's only inlet.
    """

    part: Part
    entry: str
    measures: tuple[Measure, ...]
    width: int = 1
    id_column: int | None = None
    name_column: int | None = None
    unit_column: int | None = None
    labels_entry: str | None = None
    first_unit: int = 1
    unit_prefix: bool = True
    per_unit: bool = False
    scalar: bool = False
    inlet_column: int | None = None
    code_column: int | None = None
    codes: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    state_column: int | None = None
    """Sensor-typed tables: a row whose state here is -1 (unavailable) has no value."""
    digits_entry: str | None = None
    """Sensor-typed tables: the table whose column 7 holds the decimal digits of each sensor,
    indexed by the first ``digits_width`` index integers and the sensor type."""
    digits_width: int = 0
    named_only: bool = False
    """Phase tables: a row whose ``id_column`` is empty is not a phase of its own (a wye unit's
    line table beside its named phases, its rows unnamed and reading 0 A)."""
    count: str = ""
    """The object holding how many rows the unit has (PDU-MIB outletCount, inletPoleCount), read
    at ``count`` indexed by a row's index less its last integer (``.0`` where that leaves
    none): a row positioned past it is not one of the unit's (agents answer a table sized for
    the largest model of a board, the rows past the count reading 0)."""

    @property
    def sensor_typed(self) -> bool:
        return any(m.sensor is not None for m in self.measures)

    @property
    def label_entry(self) -> str:
        return self.labels_entry or self.entry

    @property
    def label_columns(self) -> tuple[int, ...]:
        """Columns of ``label_entry`` that label a row."""
        wanted = (self.id_column, self.name_column, self.unit_column)
        columns = [c for c in wanted if c is not None]
        if self.labels_entry is None:
            columns += [c for c in (self.inlet_column, self.code_column) if c is not None]
        return tuple(dict.fromkeys(columns))

    @property
    def own_label_columns(self) -> tuple[int, ...]:
        """Label columns read from ``entry`` itself when labels live in another table."""
        if self.labels_entry is None:
            return ()
        return tuple(c for c in (self.inlet_column, self.code_column) if c is not None)


@dataclass(frozen=True)
class Info:
    """Full OIDs (GET) of the PDU's own name, model, serial number and firmware; ``""``: none."""

    name: str = ""
    model: str = ""
    serial: str = ""
    firmware: str = ""

    def oids(self) -> tuple[str, ...]:
        return tuple(o for o in (self.name, self.model, self.serial, self.firmware) if o)


@dataclass(frozen=True)
class Profile:
    """How to read one MIB: the sysObjectID subtrees of the PDUs that speak it, and its tables.

    ``entity``: the generic ENTITY-SENSOR-MIB reading (no tables of its own)."""

    vendor: str
    mib: str
    sys_object_ids: tuple[str, ...]
    tables: tuple[Table, ...] = ()
    info: Info = Info()
    entity: bool = False

    def tables_of(self, *parts: Part) -> tuple[Table, ...]:
        return tuple(t for t in self.tables if t.part in parts)

    def meters(self, metric: str) -> bool:
        """Whether the MIB has an object for ``metric`` (some have no energy meters)."""
        return any(m.metric == metric for t in self.tables for m in t.measures)


def _m(metric: str, column: int, factor: int = 1, divisor: int = 1) -> Measure:
    return Measure(metric, column, factor, divisor)


# APC PowerNet-MIB rPDU2 (Rack PDU 2G): device power in hundredths of kW, energy in tenths of
# kWh; phase current in tenths of A, voltage in V, power in hundredths of kW; outlet current in
# tenths of A, power in W, energy in tenths of kWh. -1: the model does not measure it.
_APC = "1.3.6.1.4.1.318.1.1.26"
APC = Profile(
    "apc",
    "PowerNet-MIB rPDU2",
    ("1.3.6.1.4.1.318.1.3.4",),
    (
        Table(
            Part.INLET,
            f"{_APC}.4.3.1",
            (_m(INLET_POWER, 5, 10), _m(INLET_ENERGY, 9, JOULES_PER_TENTH_KWH)),
            id_column=2,
        ),
        Table(
            Part.PHASE,
            f"{_APC}.6.3.1",
            (_m(PHASE_CURRENT, 5, 1, 10), _m(PHASE_VOLTAGE, 6), _m(PHASE_POWER, 7, 10)),
            inlet_column=2,
            id_column=3,
        ),
        Table(
            Part.OUTLET,
            f"{_APC}.9.4.3.1",
            (
                _m(OUTLET_CURRENT, 6, 1, 10),
                _m(OUTLET_POWER, 7),
                _m(OUTLET_ENERGY, 11, JOULES_PER_TENTH_KWH),
            ),
            unit_column=2,
            id_column=4,
            name_column=3,
        ),
    ),
    Info(f"{_APC}.2.1.3.1", f"{_APC}.2.1.8.1", f"{_APC}.2.1.9.1", f"{_APC}.2.1.6.1"),
)

# Raritan PDU2-MIB (PX2/PX3): sensor tables indexed by (pdu, inlet|outlet[, pole], sensor type);
# each value is scaled by its sensor's configured decimal digits, energy is in Wh. Pole sensors
# use the digits of the inlet sensor of the same type.
_RARITAN = "1.3.6.1.4.1.13742.6"
_RARITAN_CURRENT, _RARITAN_VOLTAGE, _RARITAN_POWER, _RARITAN_ENERGY = 1, 4, 5, 8
RARITAN = Profile(
    "raritan",
    "PDU2-MIB",
    ("1.3.6.1.4.1.13742.6",),
    (
        Table(
            Part.INLET,
            f"{_RARITAN}.5.2.3.1",
            (
                Measure(INLET_CURRENT, 4, sensor=_RARITAN_CURRENT),
                Measure(INLET_VOLTAGE, 4, sensor=_RARITAN_VOLTAGE),
                Measure(INLET_POWER, 4, sensor=_RARITAN_POWER),
                Measure(INLET_ENERGY, 4, JOULES_PER_WH, sensor=_RARITAN_ENERGY),
            ),
            width=2,
            state_column=3,
            digits_entry=f"{_RARITAN}.3.3.4.1",
            digits_width=2,
        ),
        Table(
            Part.PHASE,
            f"{_RARITAN}.5.2.4.1",
            (
                Measure(PHASE_CURRENT, 4, sensor=_RARITAN_CURRENT),
                Measure(PHASE_VOLTAGE, 4, sensor=_RARITAN_VOLTAGE),
                Measure(PHASE_POWER, 4, sensor=_RARITAN_POWER),
            ),
            width=3,
            codes=MappingProxyType({1: "L1", 2: "L2", 3: "L3"}),
            state_column=3,
            digits_entry=f"{_RARITAN}.3.3.4.1",
            digits_width=2,
        ),
        Table(
            Part.OUTLET,
            f"{_RARITAN}.5.4.3.1",
            (
                Measure(OUTLET_CURRENT, 4, sensor=_RARITAN_CURRENT),
                Measure(OUTLET_VOLTAGE, 4, sensor=_RARITAN_VOLTAGE),
                Measure(OUTLET_POWER, 4, sensor=_RARITAN_POWER),
                Measure(OUTLET_ENERGY, 4, JOULES_PER_WH, sensor=_RARITAN_ENERGY),
            ),
            width=2,
            labels_entry=f"{_RARITAN}.3.5.3.1",
            id_column=2,
            name_column=3,
            state_column=3,
            digits_entry=f"{_RARITAN}.3.5.4.1",
            digits_width=2,
        ),
    ),
    Info(f"{_RARITAN}.3.2.2.1.13.1", f"{_RARITAN}.3.2.1.1.3.1", f"{_RARITAN}.3.2.1.1.4.1"),
)

# Raritan PDU-MIB (PX1, enterprise 13742.4): currents in mA, voltages in mV, power in W, energy
# in Wh. Firmware without the inlet table reports the unit's readings as scalars. outletIndex
# "ranges between 1 and the value of outletCount", and an inlet has inletPoleCount poles (1 for
# single phase): rows past either count are left out.
_PX1 = "1.3.6.1.4.1.13742.4.1"
RARITAN_PX1 = Profile(
    "raritan-px1",
    "PDU-MIB (Raritan)",
    ("1.3.6.1.4.1.13742.4",),
    (
        Table(
            Part.INLET,
            f"{_PX1}.20.2.1",
            (
                _m(INLET_CURRENT, 7, 1, 1000),
                _m(INLET_VOLTAGE, 8, 1, 1000),
                _m(INLET_POWER, 9),
                _m(INLET_ENERGY, 12, JOULES_PER_WH),
            ),
        ),
        Table(
            Part.INLET,
            f"{_PX1}.3.1",
            (_m(INLET_CURRENT, 1, 1, 1000), _m(INLET_VOLTAGE, 2, 1, 1000), _m(INLET_POWER, 3)),
            scalar=True,
        ),
        Table(
            Part.PHASE,
            f"{_PX1}.21.2.1",
            (_m(PHASE_CURRENT, 3, 1, 1000), _m(PHASE_VOLTAGE, 4, 1, 1000), _m(PHASE_POWER, 7)),
            width=2,
            id_column=2,
            count=f"{_PX1}.20.2.1.3",
        ),
        Table(
            Part.OUTLET,
            f"{_PX1}.2.2.1",
            (
                _m(OUTLET_CURRENT, 4, 1, 1000),
                _m(OUTLET_VOLTAGE, 6, 1, 1000),
                _m(OUTLET_POWER, 7),
                _m(OUTLET_ENERGY, 31, JOULES_PER_WH),
            ),
            name_column=2,
            count=f"{_PX1}.2.1",
        ),
    ),
    Info(serial=f"{_PX1}.1.2.0", firmware=f"{_PX1}.1.1.0"),
)

# ServerTech Sentry3-MIB (CDUs with towers): infeed current in hundredths of A, voltage in
# tenths of V, power in W, energy in tenths of kWh; outlet energy in Wh. Ids ("AA", "AA1")
# name the tower already.
_SENTRY3 = "1.3.6.1.4.1.1718.3"
SENTRY3 = Profile(
    "servertech-sentry3",
    "Sentry3-MIB",
    ("1.3.6.1.4.1.1718.3",),
    (
        Table(
            Part.INLET,
            f"{_SENTRY3}.2.2.1",
            (
                _m(INLET_CURRENT, 7, 1, 100),
                _m(INLET_VOLTAGE, 11, 1, 10),
                _m(INLET_POWER, 12),
                _m(INLET_ENERGY, 16, JOULES_PER_TENTH_KWH),
            ),
            width=2,
            id_column=2,
            unit_prefix=False,
        ),
        Table(
            Part.OUTLET,
            f"{_SENTRY3}.2.3.1",
            (
                _m(OUTLET_CURRENT, 7, 1, 100),
                _m(OUTLET_VOLTAGE, 13, 1, 10),
                _m(OUTLET_POWER, 14),
                _m(OUTLET_ENERGY, 18, JOULES_PER_WH),
            ),
            width=3,
            id_column=2,
            name_column=3,
            unit_prefix=False,
        ),
    ),
    Info(
        f"{_SENTRY3}.2.1.1.3.1",
        f"{_SENTRY3}.2.1.1.7.1",
        f"{_SENTRY3}.2.1.1.6.1",
        f"{_SENTRY3}.1.1.0",
    ),
)

# ServerTech Sentry4-MIB (PRO1/PRO2): cord power in W and energy in tenths of kWh; line
# current in hundredths of A (phase current is per line conductor, labelled L1..N); phase
# voltage in tenths of V, power in W; outlet energy in Wh.
_SENTRY4 = "1.3.6.1.4.1.1718.4.1"
SENTRY4 = Profile(
    "servertech",
    "Sentry4-MIB",
    ("1.3.6.1.4.1.1718.4",),
    (
        Table(
            Part.INLET,
            f"{_SENTRY4}.3.3.1",
            (_m(INLET_POWER, 3), _m(INLET_ENERGY, 10, JOULES_PER_TENTH_KWH)),
            width=2,
            labels_entry=f"{_SENTRY4}.3.2.1",
            id_column=2,
            unit_prefix=False,
        ),
        Table(
            Part.PHASE,
            f"{_SENTRY4}.4.3.1",
            (_m(PHASE_CURRENT, 3, 1, 100),),
            width=3,
            labels_entry=f"{_SENTRY4}.4.2.1",
            id_column=4,
            codes=MappingProxyType({1: "L1", 2: "L2", 3: "L3", 4: "N"}),
        ),
        Table(
            Part.PHASE,
            f"{_SENTRY4}.5.3.1",
            (_m(PHASE_VOLTAGE, 3, 1, 10), _m(PHASE_POWER, 8)),
            width=3,
            labels_entry=f"{_SENTRY4}.5.2.1",
            id_column=4,
        ),
        Table(
            Part.OUTLET,
            f"{_SENTRY4}.8.3.1",
            (
                _m(OUTLET_CURRENT, 3, 1, 100),
                _m(OUTLET_VOLTAGE, 6, 1, 10),
                _m(OUTLET_POWER, 7),
                _m(OUTLET_ENERGY, 14, JOULES_PER_WH),
            ),
            width=3,
            labels_entry=f"{_SENTRY4}.8.2.1",
            id_column=2,
            name_column=3,
            unit_prefix=False,
        ),
    ),
    Info(
        f"{_SENTRY4}.2.2.1.3.1",
        f"{_SENTRY4}.2.2.1.5.1",
        f"{_SENTRY4}.2.2.1.4.1",
        f"{_SENTRY4}.1.1.3.0",
    ),
)

# EATON-EPDU-MIB (G2/G3 ePDU): voltages in mV, currents in mA, power in W, energy in Wh. Units
# chained by strapping are told apart by the strapping index, 0 being the master. Measurement
# types: voltage singlePhase(1), phase1toN(2)..phase3to1(7); current singlePhase(1), neutral(2),
# phase1(3)..phase3(5); power phase1(1)..phase3(3), total(4).
_EATON = "1.3.6.1.4.1.534.6.6.7"
_EATON_VOLTAGES = MappingProxyType(
    {1: "L", 2: "L1-N", 3: "L2-N", 4: "L3-N", 5: "L1-L2", 6: "L2-L3", 7: "L3-L1"}
)
_EATON_CURRENTS = MappingProxyType({1: "L", 2: "N", 3: "L1", 4: "L2", 5: "L3"})


def _eaton_outlets(entry: str, *measures: Measure) -> Table:
    """An EATON-EPDU-MIB outlet table: labelled by outletTable (ids and names)."""
    return Table(
        Part.OUTLET,
        entry,
        measures,
        width=2,
        labels_entry=f"{_EATON}.6.1.1",
        id_column=2,
        name_column=3,
        first_unit=0,
    )


EATON = Profile(
    "eaton",
    "EATON-EPDU-MIB",
    ("1.3.6.1.4.1.534.6.6.7",),
    (
        Table(
            Part.INLET,
            f"{_EATON}.3.5.1",
            (_m(INLET_POWER, 4), _m(INLET_ENERGY, 5, JOULES_PER_WH)),
            width=2,
            first_unit=0,
        ),
        Table(
            Part.INLET,
            f"{_EATON}.3.4.1",
            (_m(INLET_POWER, 4), _m(INLET_ENERGY, 5, JOULES_PER_WH)),
            width=3,
            first_unit=0,
            code_column=2,
            codes=MappingProxyType({4: "total"}),
        ),
        Table(
            Part.PHASE,
            f"{_EATON}.3.2.1",
            (_m(PHASE_VOLTAGE, 3, 1, 1000),),
            width=3,
            first_unit=0,
            code_column=2,
            codes=_EATON_VOLTAGES,
        ),
        Table(
            Part.PHASE,
            f"{_EATON}.3.3.1",
            (_m(PHASE_CURRENT, 4, 1, 1000),),
            width=3,
            first_unit=0,
            code_column=2,
            codes=_EATON_CURRENTS,
        ),
        Table(
            Part.PHASE,
            f"{_EATON}.3.4.1",
            (_m(PHASE_POWER, 4),),
            width=3,
            first_unit=0,
            code_column=2,
            codes=MappingProxyType({1: "L1", 2: "L2", 3: "L3"}),
        ),
        _eaton_outlets(f"{_EATON}.6.3.1", _m(OUTLET_VOLTAGE, 2, 1, 1000)),
        _eaton_outlets(f"{_EATON}.6.4.1", _m(OUTLET_CURRENT, 3, 1, 1000)),
        _eaton_outlets(f"{_EATON}.6.5.1", _m(OUTLET_POWER, 3), _m(OUTLET_ENERGY, 4, JOULES_PER_WH)),
    ),
    Info(
        f"{_EATON}.1.2.1.6.0",
        f"{_EATON}.1.2.1.3.0",
        f"{_EATON}.1.2.1.4.0",
        f"{_EATON}.1.2.1.5.0",
    ),
)

# Eaton's other PDU family: the Aphel-built "Revelation" managed ePDUs, PDU-MIB under
# enterprises.534.6.6.6: the unit's current in mA, voltage in mV and power in W as scalars, and
# per-outlet current (mA), voltage and power (W); no energy meters in this MIB. Outlet voltage
# is in volts as these PDUs report it (244 on a 230 V unit; NUT reads volts too), whatever
# millivolts the MIB's text suggests.
_REVELATION = "1.3.6.1.4.1.534.6.6.6.1"
EATON_REVELATION = Profile(
    "eaton-revelation",
    "PDU-MIB (Eaton, Aphel Revelation)",
    ("1.3.6.1.4.1.534.6.6.6",),
    (
        Table(
            Part.INLET,
            f"{_REVELATION}.3.1",
            (_m(INLET_CURRENT, 1, 1, 1000), _m(INLET_VOLTAGE, 2, 1, 1000), _m(INLET_POWER, 3)),
            scalar=True,
        ),
        Table(
            Part.OUTLET,
            f"{_REVELATION}.2.2.1",
            (_m(OUTLET_CURRENT, 4, 1, 1000), _m(OUTLET_VOLTAGE, 6), _m(OUTLET_POWER, 7)),
            name_column=2,
        ),
    ),
    Info(serial=f"{_REVELATION}.1.2.0", firmware=f"{_REVELATION}.1.1.0"),
)

# Vertiv (Geist) VERTIV-V5-MIB, the rPDUs' imd branch: total and phase power in W, energy in
# Wh, voltage in tenths of V, current in hundredths of A. pduPhaseTable holds the phases (on
# delta units the phase-to-phase pairs, L1-L2...), pduLineTable the current of each line
# conductor (pduLineName: the line, Line A...; a wye unit leaves the names empty and its lines
# read 0 A beside its phases' currents: rows without a name are left out). Vertiv/Geist
# products answer with sysObjectIDs anywhere under enterprises.21239.
_VERTIV = "1.3.6.1.4.1.21239.5.2"
VERTIV = Profile(
    "vertiv",
    "VERTIV-V5-MIB",
    ("1.3.6.1.4.1.21239",),
    (
        Table(
            Part.INLET,
            f"{_VERTIV}.3.1.1",
            (_m(INLET_POWER, 9), _m(INLET_ENERGY, 12, JOULES_PER_WH)),
            per_unit=True,
        ),
        Table(
            Part.PHASE,
            f"{_VERTIV}.3.2.1",
            (_m(PHASE_VOLTAGE, 4, 1, 10), _m(PHASE_CURRENT, 8, 1, 100), _m(PHASE_POWER, 12)),
            id_column=2,
        ),
        Table(
            Part.PHASE,
            f"{_VERTIV}.3.4.1",
            (_m(PHASE_CURRENT, 4, 1, 100),),
            id_column=2,
            named_only=True,
        ),
        Table(
            Part.OUTLET,
            f"{_VERTIV}.3.6.1",
            (
                _m(OUTLET_VOLTAGE, 4, 1, 10),
                _m(OUTLET_CURRENT, 8, 1, 100),
                _m(OUTLET_POWER, 12),
                _m(OUTLET_ENERGY, 15, JOULES_PER_WH),
            ),
            name_column=3,
        ),
    ),
    Info(f"{_VERTIV}.1.3.0", f"{_VERTIV}.1.8.0", f"{_VERTIV}.1.10.0", f"{_VERTIV}.1.2.0"),
)

# Tripp Lite TRIPPLITE-PRODUCTS, for its PDUs (tlpPdu, enterprises.850.1.1.3.2) and its
# automatic transfer switches (tlpAts, 850.1.1.3.4: the PDUMH..ATNET models), which answer with
# the same sysObjectID and keep the same readings in the tlpAts tables (a device has one branch
# or the other; tlpDeviceType says which). Total output power in W; input phase voltage in
# tenths of V and current in hundredths of A (an ATS's input phases are indexed by input line:
# inlet 1 and 2 are its two sources); output (per phase) voltage in tenths of V, current in
# hundredths of A and power in W (PDUs without input phase current report the output's);
# outlet voltage in tenths of V, current in hundredths of A, power in W. No energy meters.
# A PDU's phases are as many as its tlpPduIdentNumPhases: input phase and output rows past it
# (a single-phase unit answering a second row at the line's voltage) are no phases of its inlet;
# an agent without tlpPduIdentTable keeps every row. (The ATS's phase count is per device, not
# per input line: its tables are not bounded.)
_TRIPPLITE_DEVICE = "1.3.6.1.4.1.850.1.1.1.2.1"
_TRIPPLITE = "1.3.6.1.4.1.850.1.1.3.2"
_TRIPPLITE_ATS = "1.3.6.1.4.1.850.1.1.3.4"
_TRIPPLITE_PHASES = f"{_TRIPPLITE}.1.2.1.3"


def _tripplite_tables(branch: str, input_phase: Table, phases: str = "") -> tuple[Table, ...]:
    """The device, input phase, output and outlet tables of a tlpPdu or tlpAts branch (their
    columns are numbered alike but for the input phase table); ``phases``: the object counting
    the output table's phases."""
    return (
        Table(Part.INLET, f"{branch}.2.1.1", (_m(INLET_POWER, 9),), per_unit=True),
        input_phase,
        Table(
            Part.PHASE,
            f"{branch}.3.2.1.1",
            (_m(PHASE_VOLTAGE, 4, 1, 10), _m(PHASE_CURRENT, 5, 1, 100), _m(PHASE_POWER, 8)),
            width=2,
            count=phases,
        ),
        Table(
            Part.OUTLET,
            f"{branch}.3.3.1.1",
            (_m(OUTLET_VOLTAGE, 7, 1, 10), _m(OUTLET_CURRENT, 8, 1, 100), _m(OUTLET_POWER, 9)),
            width=2,
            name_column=2,
        ),
    )


TRIPPLITE = Profile(
    "tripplite",
    "TRIPPLITE-PRODUCTS",
    ("1.3.6.1.4.1.850.1.1.1", "1.3.6.1.4.1.850.1.1.3.2", "1.3.6.1.4.1.850.1.1.3.4"),
    (
        *_tripplite_tables(
            _TRIPPLITE,
            Table(
                Part.PHASE,
                f"{_TRIPPLITE}.3.1.2.1",
                (_m(PHASE_VOLTAGE, 4, 1, 10), _m(PHASE_CURRENT, 7, 1, 100)),
                width=2,
                count=_TRIPPLITE_PHASES,
            ),
            _TRIPPLITE_PHASES,
        ),
        *_tripplite_tables(
            _TRIPPLITE_ATS,
            Table(
                Part.PHASE,
                f"{_TRIPPLITE_ATS}.3.1.2.1",
                (_m(PHASE_VOLTAGE, 5, 1, 10), _m(PHASE_CURRENT, 8, 1, 100)),
                width=3,
            ),
        ),
    ),
    Info(name=f"{_TRIPPLITE_DEVICE}.6.1", model=f"{_TRIPPLITE_DEVICE}.5.1"),
)

# HPE CPQPOWER-MIB pdu2 (HPE G2 metered/switched PDUs): voltages in mV, currents in mA, power
# in W, energy in Wh; indexed by the daisy-chained PDU, the first being 0.
_HPE = "1.3.6.1.4.1.232.165.7"
HPE = Profile(
    "hpe",
    "CPQPOWER-MIB pdu2",
    ("1.3.6.1.4.1.232.165.7",),
    (
        Table(
            Part.INLET,
            f"{_HPE}.2.1.1",
            (_m(INLET_POWER, 5), _m(INLET_ENERGY, 6, JOULES_PER_WH)),
            per_unit=True,
            first_unit=0,
        ),
        Table(
            Part.PHASE,
            f"{_HPE}.2.2.1",
            (_m(PHASE_VOLTAGE, 3, 1, 1000), _m(PHASE_CURRENT, 11, 1, 1000), _m(PHASE_POWER, 21)),
            width=2,
            first_unit=0,
        ),
        Table(
            Part.OUTLET,
            f"{_HPE}.5.1.1",
            (
                _m(OUTLET_CURRENT, 5, 1, 1000),
                _m(OUTLET_POWER, 14),
                _m(OUTLET_ENERGY, 15, JOULES_PER_WH),
            ),
            width=2,
            name_column=2,
            first_unit=0,
        ),
    ),
    Info(model=f"{_HPE}.1.2.1.3.0", serial=f"{_HPE}.1.2.1.7.0", firmware=f"{_HPE}.1.2.1.5.0"),
)

# HPE CPQPOWER-MIB pdu3 (HPE G2 PDUs of the 232.165.11 branch, the same table layout as Panduit
# G5): input power in W (the MIB's text says thousandths; its agents report W, the sum of the
# phases' W), lifetime energy in kWh; phase voltage in tenths of V, current in hundredths of A,
# power in W; outlet current in hundredths of A, power in W (pdu3OutletWh is whole kWh, reset
# from the GUI: too coarse for a node's energy, not read). Indexed by the daisy-chained PDU
# from 1; a PDU's outlets are as many as its pdu3OutletCount (pdu3IdentTable column 13): rows
# past it, at 0 A, are no outlets. These agents answer sysObjectID with a DisplayString
# (".1.3.6.1.4.1.232.165.11").
_HPE3 = "1.3.6.1.4.1.232.165.11"
HPE_PDU3 = Profile(
    "hpe-pdu3",
    "CPQPOWER-MIB pdu3",
    ("1.3.6.1.4.1.232.165.11",),
    (
        Table(
            Part.INLET,
            f"{_HPE3}.2.1.1",
            (_m(INLET_POWER, 5), _m(INLET_ENERGY, 6, JOULES_PER_KWH)),
            per_unit=True,
        ),
        Table(
            Part.PHASE,
            f"{_HPE3}.2.2.1",
            (_m(PHASE_VOLTAGE, 3, 1, 10), _m(PHASE_CURRENT, 11, 1, 100), _m(PHASE_POWER, 20)),
            width=2,
        ),
        Table(
            Part.OUTLET,
            f"{_HPE3}.5.1.1",
            (_m(OUTLET_CURRENT, 5, 1, 100), _m(OUTLET_POWER, 13)),
            width=2,
            name_column=2,
            count=f"{_HPE3}.1.2.1.13",
        ),
    ),
    Info(
        f"{_HPE3}.1.2.1.2.1",
        f"{_HPE3}.1.2.1.3.1",
        f"{_HPE3}.1.2.1.8.1",
        f"{_HPE3}.1.2.1.5.1",
    ),
)

# Dell DellrPDU-MIB: device power in hundredths of kW, energy in tenths of kWh; phase current
# in tenths of A, voltage in V, power in hundredths of kW; outlet current in A, energy in kWh.
# The MIB gives outlet power no unit; it is read as W.
_DELL = "1.3.6.1.4.1.674.10903.200.2.200"
DELL = Profile(
    "dell",
    "DellrPDU-MIB",
    ("1.3.6.1.4.1.674.10903.200",),
    (
        Table(
            Part.INLET,
            f"{_DELL}.110.2.1",
            (_m(INLET_POWER, 3, 10), _m(INLET_ENERGY, 4, JOULES_PER_TENTH_KWH)),
            per_unit=True,
        ),
        Table(
            Part.PHASE,
            f"{_DELL}.120.2.1",
            (_m(PHASE_CURRENT, 4, 1, 10), _m(PHASE_VOLTAGE, 5), _m(PHASE_POWER, 6, 10)),
            id_column=2,
        ),
        Table(
            Part.OUTLET,
            f"{_DELL}.130.2.2.1",
            (_m(OUTLET_CURRENT, 6), _m(OUTLET_ENERGY, 7, JOULES_PER_KWH), _m(OUTLET_POWER, 8)),
            id_column=2,
            name_column=3,
        ),
    ),
    Info(
        f"{_DELL}.100.2.1.2.1",
        f"{_DELL}.100.2.1.7.1",
        f"{_DELL}.100.2.1.8.1",
        f"{_DELL}.100.2.1.5.1",
    ),
)

# Enlogic ENLOGIC-PDU-MIB: unit power in W and energy in tenths of kWh; phase current in
# hundredths of A, voltage in V, power in W; metered outlet current in hundredths of A, power
# in W, energy in tenths of kWh. Indexed by the daisy-chained unit (from 1).
_ENLOGIC = "1.3.6.1.4.1.38446.1"
ENLOGIC = Profile(
    "enlogic",
    "ENLOGIC-PDU-MIB",
    ("1.3.6.1.4.1.38446",),
    (
        Table(
            Part.INLET,
            f"{_ENLOGIC}.2.4.1",
            (_m(INLET_POWER, 4), _m(INLET_ENERGY, 9, JOULES_PER_TENTH_KWH)),
            per_unit=True,
        ),
        Table(
            Part.PHASE,
            f"{_ENLOGIC}.3.4.1",
            (_m(PHASE_CURRENT, 5, 1, 100), _m(PHASE_VOLTAGE, 6), _m(PHASE_POWER, 7)),
            width=2,
        ),
        Table(
            Part.OUTLET,
            f"{_ENLOGIC}.5.9.1",
            (
                _m(OUTLET_CURRENT, 5, 1, 100),
                _m(OUTLET_POWER, 6),
                _m(OUTLET_ENERGY, 11, JOULES_PER_TENTH_KWH),
            ),
            width=2,
            id_column=2,
            name_column=3,
        ),
    ),
    Info(name=f"{_ENLOGIC}.2.4.1.2.1"),
)

# Panduit PANDUIT-MIB (SmartZone G5): input power in W, lifetime energy (pdug5InputTotalEnergy)
# in kWh (the resettable pdug5InputResettableEnergy beside it is in Wh and agrees); phase
# voltage in tenths of V, current in hundredths of A, power in W; outlet current in hundredths
# of A, power in W, energy in Wh.
_PANDUIT = "1.3.6.1.4.1.19536.10.1"
PANDUIT = Profile(
    "panduit",
    "PANDUIT-MIB (G5)",
    ("1.3.6.1.4.1.19536.10",),
    (
        Table(
            Part.INLET,
            f"{_PANDUIT}.2.1.1",
            (_m(INLET_POWER, 5), _m(INLET_ENERGY, 6, JOULES_PER_KWH)),
            per_unit=True,
        ),
        Table(
            Part.PHASE,
            f"{_PANDUIT}.2.2.1",
            (_m(PHASE_VOLTAGE, 3, 1, 10), _m(PHASE_CURRENT, 11, 1, 100), _m(PHASE_POWER, 20)),
            width=2,
        ),
        Table(
            Part.OUTLET,
            f"{_PANDUIT}.5.1.1",
            (
                _m(OUTLET_CURRENT, 5, 1, 100),
                _m(OUTLET_POWER, 13),
                _m(OUTLET_ENERGY, 14, JOULES_PER_WH),
            ),
            width=2,
            name_column=2,
        ),
    ),
)

# Schleifenbauer SCHLEIFENBAUER-DATABUS-MIB: energy in kWh, voltage and current in hundredths
# (display hint d-2), power in W; indexed by the databus device and its input or outlet.
_SCHLEIFENBAUER = "1.3.6.1.4.1.31034.12.1.1.2"
SCHLEIFENBAUER = Profile(
    "schleifenbauer",
    "SCHLEIFENBAUER-DATABUS-MIB",
    ("1.3.6.1.4.1.31034",),
    (
        Table(
            Part.INLET,
            f"{_SCHLEIFENBAUER}.6.1.1",
            (
                _m(INLET_ENERGY, 2, JOULES_PER_KWH),
                _m(INLET_VOLTAGE, 7, 1, 100),
                _m(INLET_POWER, 10),
            ),
            width=2,
        ),
        Table(
            Part.OUTLET,
            f"{_SCHLEIFENBAUER}.7.2.1",
            (
                _m(OUTLET_ENERGY, 2, JOULES_PER_KWH),
                _m(OUTLET_CURRENT, 5, 1, 100),
                _m(OUTLET_VOLTAGE, 7, 1, 100),
                _m(OUTLET_POWER, 11),
            ),
            width=2,
            labels_entry=f"{_SCHLEIFENBAUER}.7.1.1",
            name_column=2,
        ),
    ),
    Info(model=f"{_SCHLEIFENBAUER}.1.1.1.5.1"),
)

ENTITY = Profile("entity", "ENTITY-SENSOR-MIB", (), entity=True)
"""The fallback for PDUs no profile knows: RFC 3433 sensors (power, current, voltage, °C)."""

PROFILES: dict[str, Profile] = {
    p.vendor: p
    for p in (
        APC,
        RARITAN,
        RARITAN_PX1,
        SENTRY3,
        SENTRY4,
        EATON,
        EATON_REVELATION,
        VERTIV,
        TRIPPLITE,
        HPE,
        HPE_PDU3,
        DELL,
        ENLOGIC,
        PANDUIT,
        SCHLEIFENBAUER,
        ENTITY,
    )
}
"""Vendor name (as configured) -> profile."""

VENDORS = ("auto", *PROFILES)


def object_id(value: SnmpValue | None) -> str:
    """A sysObjectID as dotted text (``""`` when it is not an OID): the OID an agent answers,
    or the string holding one that others answer (CPQPOWER-MIB defines sysObjectID as a
    DisplayString, ``".1.3.6.1.4.1.232.165.11"``)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace").replace("\x00", "").strip()
    if not isinstance(value, str):
        return ""
    try:
        return ".".join(map(str, parse_oid(value)))
    except ValueError:
        return ""


def detect_vendor(sys_object_id: SnmpValue | None) -> str | None:
    """The profile whose sysObjectID subtree holds ``sys_object_id`` (an OID, or a string
    holding one; compared arc by arc, the longest subtree winning); None when no profile
    knows it."""
    text = object_id(sys_object_id)
    if not text:
        return None
    oid = parse_oid(text)
    best: tuple[int, str] | None = None
    for vendor, profile in PROFILES.items():
        for subtree in profile.sys_object_ids:
            prefix: Oid = parse_oid(subtree)
            if oid[: len(prefix)] == prefix and (best is None or len(prefix) > best[0]):
                best = (len(prefix), vendor)
    return best[1] if best else None

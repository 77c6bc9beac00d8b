"""Readings from the SNMP objects of a PDU, for any profile: pure functions of (oid, value) pairs.

The same functions read a full walk, the handful of rows a node requests with GETs, or a
recording; what is not among the objects is simply not reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from hyperagent.readings import Kind, Reading
from hyperagent.sources.pdu.metrics import (
    NODE_ENERGY,
    NODE_POWER,
    OUTLET_ENERGY,
    OUTLET_INFO,
    OUTLET_POWER,
    PDU_INFO,
    SENSOR_CURRENT,
    SENSOR_POWER,
    SENSOR_TEMPERATURE,
    SENSOR_VOLTAGE,
)
from hyperagent.sources.pdu.profiles import Measure, Part, Profile, Table
from hyperagent.sources.pdu.snmp import Oid, SnmpValue, VarBind, format_oid, parse_oid

SYS_DESCR = "1.3.6.1.2.1.1.1.0"
SYS_OBJECT_ID = "1.3.6.1.2.1.1.2.0"
SYS_NAME = "1.3.6.1.2.1.1.5.0"
SYSTEM = (SYS_DESCR, SYS_OBJECT_ID, SYS_NAME)

ENTITY_SENSORS = "1.3.6.1.2.1.99.1.1.1"
ENTITY_PHYSICAL = "1.3.6.1.2.1.47.1.1.1.1"
ENTITY_COLUMNS = (f"{ENTITY_PHYSICAL}.7", *(f"{ENTITY_SENSORS}.{n}" for n in (1, 2, 3, 4, 5)))
_ENTITY_METRICS = {
    3: SENSOR_VOLTAGE,  # voltsAC
    4: SENSOR_VOLTAGE,  # voltsDC
    5: SENSOR_CURRENT,  # amperes
    6: SENSOR_POWER,  # watts
    8: SENSOR_TEMPERATURE,  # celsius
}
_ENTITY_OK = 1
_ENTITY_UNITS_SCALE = 9
_UNAVAILABLE = -1
_DIGITS_COLUMN = 7
_PART_ORDER = {Part.INLET: 0, Part.PHASE: 1, Part.OUTLET: 2}

Row = dict[int, SnmpValue]


class Walk:
    """Objects indexed by OID, read as tables of rows."""

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
        return self.values.get(parse_oid(oid)) if oid else None

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
class Builder:
    """Readings of one PDU, each series once (the first table that gives it wins)."""

    pdu: str
    readings: list[Reading] = field(default_factory=list)
    _seen: set[tuple[str, tuple[tuple[str, str], ...]]] = field(default_factory=set)

    def add(self, metric: str, value: float, kind: Kind, /, **labels: str) -> None:
        key = (metric, tuple(sorted(labels.items())))
        if key not in self._seen:
            self._seen.add(key)
            self.readings.append(Reading(metric, float(value), {"pdu": self.pdu, **labels}, kind))

    def measure(self, metric: str, value: float, /, **labels: str) -> None:
        kind = Kind.COUNTER if metric.endswith("_total") else Kind.GAUGE
        self.add(metric, value, kind, **labels)

    def info(
        self, vendor: str, name: str, model: str, serial: str, firmware: str, sys_object_id: str
    ) -> None:
        labels = {
            "vendor": vendor,
            "name": name,
            "model": model,
            "serial": serial,
            "firmware": firmware,
            "sys_object_id": sys_object_id,
        }
        self.add(PDU_INFO, 1.0, Kind.INFO, **labels)

    def outlet_name(self, outlet: str, name: str) -> None:
        if name:
            self.add(OUTLET_INFO, 1.0, Kind.INFO, outlet=outlet, name=name)


def _value(raw: int, measure: Measure, digits: int = 0) -> float:
    return raw * measure.factor / (measure.divisor * 10**digits)


@dataclass(frozen=True)
class _Row:
    index: Oid
    cells: Row
    """The row's own columns (for sensor-typed tables: none)."""
    labels: Row
    values: dict[str, float]


def counted(table: Table, walk: Walk, index: Oid) -> bool:
    """Whether row ``index`` is within its unit's row count (:attr:`Table.count`); a row whose
    count is not among the objects, or is 0, is taken."""
    if not table.count or not index:
        return True
    limit = measured(walk.values.get((*parse_oid(table.count), *(index[:-1] or (0,)))))
    return not limit or index[-1] <= limit


def count_oid(table: Table, index: Oid) -> str:
    """The object holding the row count that row ``index`` of ``table`` is within."""
    return f"{table.count}.{format_oid(index[:-1] or (0,))}"


def _rows(table: Table, walk: Walk) -> Iterator[_Row]:
    """The rows of ``table`` present in ``walk`` (within its row count) with their labels and
    scaled values."""
    label_rows = walk.table(table.labels_entry, table.width) if table.labels_entry else {}
    if not table.sensor_typed:
        for index, cells in walk.table(table.entry, table.width).items():
            if not counted(table, walk, index):
                continue
            values = {
                m.metric: _value(raw, m)
                for m in table.measures
                if (raw := measured(cells.get(m.column))) is not None
            }
            yield _Row(index, cells, label_rows.get(index, {}) or cells, values)
        return
    digits = walk.table(table.digits_entry, table.digits_width + 1) if table.digits_entry else {}
    grouped: dict[Oid, dict[str, float]] = {}
    for full, cells in walk.table(table.entry, table.width + 1).items():
        index, sensor = full[:-1], full[-1]
        if table.state_column and number(cells.get(table.state_column)) == _UNAVAILABLE:
            continue
        for m in table.measures:
            raw = measured(cells.get(m.column)) if m.sensor == sensor else None
            if raw is not None:
                key = (*index[: table.digits_width], sensor)
                places = measured(digits.get(key, {}).get(_DIGITS_COLUMN)) or 0
                grouped.setdefault(index, {})[m.metric] = _value(raw, m, places)
    for index in sorted(set(grouped) | set(label_rows)):
        yield _Row(index, {}, label_rows.get(index, {}), grouped.get(index, {}))


def row_id(table: Table, index: Oid, labels: Row) -> str:
    """The id of an inlet or outlet row (see :class:`Table`)."""
    if table.scalar:
        return "1"
    if table.per_unit:
        return unit_id(index[0], "1", table.first_unit)
    named = text(labels.get(table.id_column)) if table.id_column is not None else ""
    if named and not table.unit_prefix:
        return named
    if table.unit_column is not None:
        unit = number(labels.get(table.unit_column))
    else:
        unit = index[0] if len(index) > 1 else None
    return unit_id(unit, named or str(index[-1]), table.first_unit)


def _inlet_of(prefix: Oid, inlet_ids: Mapping[Oid, str], first_unit: int) -> str:
    if prefix in inlet_ids:
        return inlet_ids[prefix]
    if not prefix:
        return "1"
    if len(prefix) == 1:
        return unit_id(prefix[0], "1", first_unit)
    return unit_id(prefix[0], prefix[-1], first_unit)


def _phase_of(table: Table, row: _Row, inlet: str) -> str | None:
    if table.code_column is not None:
        return table.codes.get(number(row.cells.get(table.code_column)) or 0)
    label = text(row.labels.get(table.id_column)) if table.id_column is not None else ""
    if label:
        return label.removeprefix(f"{inlet}:") if inlet else label
    return table.codes.get(row.index[-1], str(row.index[-1]))


def parse(
    profile: Profile, binds: Sequence[VarBind], pdu: str, sys_object_id: str = ""
) -> list[Reading]:
    """Readings of a PDU that speaks ``profile``'s MIB, from the objects read from it."""
    walk = Walk(binds)
    out = Builder(pdu)
    info = profile.info
    out.info(
        profile.vendor,
        text(walk.scalar(info.name)) or text(walk.scalar(SYS_NAME)),
        text(walk.scalar(info.model)),
        text(walk.scalar(info.serial)),
        text(walk.scalar(info.firmware)),
        sys_object_id,
    )
    if profile.entity:
        _entity_sensors(walk, out)
        return out.readings
    inlet_ids: dict[Oid, str] = {}
    for table in sorted(profile.tables, key=lambda t: _PART_ORDER[t.part]):
        for row in _rows(table, walk):
            if table.part is Part.INLET:
                index = row.index
                if table.code_column is not None:
                    if number(row.cells.get(table.code_column)) not in table.codes:
                        continue
                    index = index[:-1]
                inlet = row_id(table, index, row.labels)
                inlet_ids.setdefault(index, inlet)
                for metric, value in row.values.items():
                    out.measure(metric, value, inlet=inlet)
            elif table.part is Part.PHASE:
                if table.inlet_column is not None:
                    inlet = text(row.cells.get(table.inlet_column)) or "1"
                else:
                    inlet = _inlet_of(row.index[:-1], inlet_ids, table.first_unit)
                if table.named_only and (
                    table.id_column is None or not text(row.labels.get(table.id_column))
                ):
                    continue
                phase = _phase_of(table, row, inlet)
                if phase is None:
                    continue
                for metric, value in row.values.items():
                    out.measure(metric, value, inlet=inlet, phase=phase)
            else:
                outlet = row_id(table, row.index, row.labels)
                if table.name_column is not None:
                    out.outlet_name(outlet, text(row.labels.get(table.name_column)))
                for metric, value in row.values.items():
                    out.measure(metric, value, outlet=outlet)
    return out.readings


def _entity_sensors(walk: Walk, out: Builder) -> None:
    """ENTITY-SENSOR-MIB (RFC 3433) power, current, voltage and temperature sensors.

    value x 10^(3 x (scale - 9)) / 10^precision; sensors whose status is not ok(1) are left
    out. A sensor is labelled by its entPhysicalName, or its index when the name is empty or
    shared with another sensor.
    """
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
        out.measure(_ENTITY_METRICS[number(row.get(1)) or 0], value, sensor=sensor)


# -- What to request ----------------------------------------------------------------------------


def walk_columns(tables: Iterable[Table]) -> list[str]:
    """The columns to walk for every row of ``tables``: measures, labels, states and digits."""
    columns: list[str] = []
    for t in tables:
        columns += [f"{t.label_entry}.{c}" for c in t.label_columns]
        columns += [f"{t.entry}.{c}" for c in t.own_label_columns]
        columns += [f"{t.entry}.{m.column}" for m in t.measures]
        if t.state_column is not None:
            columns.append(f"{t.entry}.{t.state_column}")
        if t.digits_entry:
            columns.append(f"{t.digits_entry}.{_DIGITS_COLUMN}")
        if t.count:
            columns.append(t.count)
    return list(dict.fromkeys(columns))


def outlet_label_columns(profile: Profile) -> list[str]:
    """The columns that tell which row is which outlet (its first measure where no label)."""
    columns: list[str] = []
    for t in profile.tables_of(Part.OUTLET):
        labels = [f"{t.label_entry}.{c}" for c in t.label_columns]
        columns += labels or [f"{t.entry}.{t.measures[0].column}"]
        if t.count:
            columns.append(t.count)
    return list(dict.fromkeys(columns))


def outlet_rows(profile: Profile, binds: Sequence[VarBind]) -> dict[str, Oid]:
    """Outlet id and operator name -> row index, from the objects of the label columns."""
    walk = Walk(binds)
    found: dict[str, Oid] = {}
    for t in profile.tables_of(Part.OUTLET):
        rows = walk.table(t.label_entry if t.label_columns else t.entry, t.width)
        for index, labels in rows.items():
            if not counted(t, walk, index):
                continue
            found.setdefault(row_id(t, index, labels), index)
            if t.name_column is not None and (name := text(labels.get(t.name_column))):
                found.setdefault(name, index)
    return found


def outlet_oids(profile: Profile, indexes: Iterable[Oid]) -> list[str]:
    """Every object of the given outlet rows: their measures and labels, for GET requests."""
    oids: list[str] = []
    for index in indexes:
        at = format_oid(index)
        for t in profile.tables_of(Part.OUTLET):
            if t.count:
                oids.append(count_oid(t, index))
            oids += [f"{t.label_entry}.{c}.{at}" for c in t.label_columns]
            oids += [f"{t.entry}.{c}.{at}" for c in t.own_label_columns]
            for m in t.measures:
                if m.sensor is None:
                    oids.append(f"{t.entry}.{m.column}.{at}")
                    continue
                oids.append(f"{t.entry}.{m.column}.{at}.{m.sensor}")
                if t.state_column is not None:
                    oids.append(f"{t.entry}.{t.state_column}.{at}.{m.sensor}")
                if t.digits_entry:
                    key = format_oid((*index[: t.digits_width], m.sensor))
                    oids.append(f"{t.digits_entry}.{_DIGITS_COLUMN}.{key}")
    return list(dict.fromkeys(oids))


# -- This node ----------------------------------------------------------------------------------


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

"""The PDU source: what one node reads from one PDU, and how often it asks.

A node reads only the rows of its own outlets, with GET requests (it learns which rows they are
once, from the outlet tables' label columns, and again after ``RESOLVE_EVERY_S`` or when a row
stops answering). The rack's inlet and phase figures are read by the one node configured with
``inlets`` for that PDU, so a PDU agent answers each figure once per interval, not once per node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hyperagent.errors import SourceError
from hyperagent.readings import Kind, Reading
from hyperagent.sources.pdu.metrics import (
    MEASUREMENTS,
    NODE_ENERGY,
    NODE_POWER,
    OUTLET_ENERGY,
    PDU_INFO,
)
from hyperagent.sources.pdu.parse import (
    ENTITY_COLUMNS,
    SYS_DESCR,
    SYS_NAME,
    SYS_OBJECT_ID,
    SYSTEM,
    node_readings,
    outlet_label_columns,
    outlet_oids,
    outlet_rows,
    parse,
    text,
    walk_columns,
)
from hyperagent.sources.pdu.profiles import (
    ENTITY,
    PROFILES,
    VENDORS,
    Part,
    Profile,
    detect_vendor,
    object_id,
)
from hyperagent.sources.pdu.snmp import (
    Missing,
    Oid,
    PysnmpClient,
    SnmpClient,
    SnmprecClient,
    SnmpValue,
    VarBind,
)

log = logging.getLogger(__name__)

ALL_OUTLETS = "*"
GET_BATCH = 24
"""Objects per GET request: small enough for any PDU agent's PDU size."""
RESOLVE_EVERY_S = 600.0
"""Learn again which rows hold this node's outlets this often (operators rename outlets)."""


@dataclass(frozen=True)
class PduTarget:
    """One PDU to poll: this node's outlets on it, and whether this node reads its inlets.

    ``outlets`` are outlet ids or the names the PDU gives them (``"*"``: every outlet);
    ``inlets``: read the PDU's inlet and phase figures (set on one node per PDU).
    """

    name: str
    host: str
    port: int = 161
    community: str = "public"
    vendor: str = "auto"
    outlets: tuple[str, ...] = ()
    inlets: bool = False

    def __post_init__(self) -> None:
        if self.vendor not in VENDORS:
            raise ValueError(f"unknown PDU vendor {self.vendor!r}; expected one of {VENDORS}")
        if ALL_OUTLETS in self.outlets and len(self.outlets) > 1:
            raise ValueError(f"PDU {self.name}: outlets = ['*'] reads every outlet, alone")
        if not self.outlets and not self.inlets:
            raise ValueError(
                f"PDU {self.name} reads nothing: list this node's outlets, or set inlets = true "
                "on the one node per PDU that reads its inlet and phase figures"
            )

    @property
    def own_outlets(self) -> tuple[str, ...]:
        """The outlets that feed this node (none when reading every outlet)."""
        return () if self.outlets == (ALL_OUTLETS,) else self.outlets


class PduSource:
    """Power, energy, current and voltage of one PDU (``target`` is the PDU's name).

    The vendor profile is detected from sysObjectID on the first read when configured as
    ``auto``. A PDU no profile knows reports ``hyperagent_pdu_info{vendor="unknown"}`` with its
    sysObjectID (and its ENTITY-SENSOR-MIB sensors, where it has any) and is named in a warning.
    A read still running when the next is due makes that one fail instead of queueing.
    """

    name = "pdu"

    def __init__(self, pdu: PduTarget, client: SnmpClient) -> None:
        self.pdu = pdu
        self.target = pdu.name
        self.client = client
        self.profile: Profile | None = None if pdu.vendor == "auto" else PROFILES[pdu.vendor]
        self.unknown = False
        self.sys_object_id = ""
        self._busy = asyncio.Lock()
        self._rows: dict[str, Oid] | None = None
        self._resolved_at = 0.0
        self._warned: set[str] = set()

    @property
    def vendor(self) -> str | None:
        return self.profile.vendor if self.profile else None

    async def start(self) -> None:
        await self.client.open()

    async def read(self) -> list[Reading]:
        if self._busy.locked():
            raise SourceError(f"PDU {self.pdu.name}: previous SNMP read still running")
        async with self._busy:
            binds = await self._request()
        profile = self.profile or ENTITY
        readings = parse(profile, binds, self.pdu.name, self.sys_object_id)
        measured = any(r.name in MEASUREMENTS for r in readings)
        if self.unknown:
            self._warn_unknown(dict(binds).get(SYS_DESCR), measured)
            if not measured:
                return [self._unknown_info(readings)]
        elif not measured:
            raise SourceError(
                f"PDU {self.pdu.name}: no {profile.vendor} ({profile.mib}) power measurements "
                f"in {len(binds)} objects read"
            )
        node = node_readings(readings, self.pdu.name, self.pdu.own_outlets)
        expected = {NODE_POWER, NODE_ENERGY} if profile.meters(OUTLET_ENERGY) else {NODE_POWER}
        if self.pdu.own_outlets and not expected <= {r.name for r in node}:
            self._warn_once(
                "incomplete",
                "PDU %s: not every configured outlet of this node (%s) reports power%s; "
                "the node's PDU totals are incomplete",
                self.pdu.name,
                ", ".join(self.pdu.own_outlets),
                " and energy" if NODE_ENERGY in expected else "",
            )
        return readings + node

    async def _request(self) -> list[VarBind]:
        """The objects of one read: one GET of the system group, the PDU's identity and this
        node's outlet rows; walks of the inlet and phase tables on the inlets node."""
        binds: list[VarBind] = []
        if self.profile is None and not self.unknown:
            binds += await self._detect()
            gets = list(self.profile.info.oids() if self.profile else ())
        else:
            gets = [*SYSTEM, *(self.profile.info.oids() if self.profile else ())]
        profile = self.profile or ENTITY
        own = self.pdu.own_outlets and not profile.entity
        outlet_oids = await self._outlet_oids(profile) if own else []
        answers = await self._get([*gets, *outlet_oids])
        if outlet_oids and all(isinstance(value, Missing) for _, value in answers[len(gets) :]):
            self._rows = None  # the rows are gone (outlets renumbered): learn them again
        binds += answers
        walks: list[str] = []
        if self.pdu.inlets:
            walks += (
                list(ENTITY_COLUMNS)
                if profile.entity
                else walk_columns(profile.tables_of(Part.INLET, Part.PHASE))
            )
        if self.pdu.outlets == (ALL_OUTLETS,):
            walks += walk_columns(profile.tables_of(Part.OUTLET))
        for column in walks:
            binds.extend(await self.client.walk(column))
        return binds

    async def _detect(self) -> list[VarBind]:
        """The system group, and from its sysObjectID the profile (first read of ``auto``)."""
        binds = await self.client.get(list(SYSTEM))
        oid = dict(binds).get(SYS_OBJECT_ID)
        self.sys_object_id = object_id(oid)
        vendor = detect_vendor(oid)
        self.profile = PROFILES[vendor] if vendor else None
        self.unknown = vendor is None
        log.debug("PDU %s: %s profile", self.pdu.name, vendor or "no")
        return list(binds)

    async def _get(self, oids: Sequence[str]) -> list[VarBind]:
        out: list[VarBind] = []
        for at in range(0, len(oids), GET_BATCH):
            out.extend(await self.client.get(oids[at : at + GET_BATCH]))
        oid = object_id(dict(out).get(SYS_OBJECT_ID))
        if oid:
            self.sys_object_id = oid
        return out

    async def _outlet_oids(self, profile: Profile) -> list[str]:
        """The objects of this node's outlets' rows (learning which rows they are if needed)."""
        now = time.monotonic()
        if self._rows is None or now - self._resolved_at > RESOLVE_EVERY_S:
            labels: list[VarBind] = []
            for column in outlet_label_columns(profile):
                labels.extend(await self.client.walk(column))
            self._rows, self._resolved_at = outlet_rows(profile, labels), now
        rows = self._rows
        missing = [o for o in self.pdu.outlets if o not in rows]
        if missing:
            known = ", ".join(sorted(rows)[:12]) or "none"
            self._warn_once(
                "missing:" + ",".join(missing),
                "PDU %s has no outlet %s (%s outlet ids and names: %s)",
                self.pdu.name,
                ", ".join(missing),
                profile.vendor,
                known,
            )
        return outlet_oids(profile, dict.fromkeys(rows[o] for o in self.pdu.outlets if o in rows))

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _warn_unknown(self, sys_descr: SnmpValue | None, measured: bool) -> None:
        described = f" ({text(sys_descr)})" if text(sys_descr) else ""
        fallback = (
            "its ENTITY-SENSOR-MIB sensors are read instead"
            if measured
            else "it reports no ENTITY-SENSOR-MIB power sensors either"
        )
        self._warn_once(
            "unknown",
            "PDU %s: sysObjectID %s%s matches no PDU profile (%s); %s. Set vendor for this "
            "target if its PDU speaks one of these MIBs",
            self.pdu.name,
            self.sys_object_id or "(none)",
            described,
            ", ".join(v for v in PROFILES if v != "entity"),
            fallback,
        )

    def _unknown_info(self, readings: Sequence[Reading]) -> Reading:
        name = next((r.labels["name"] for r in readings if r.name == PDU_INFO), "")
        labels = {
            "pdu": self.pdu.name,
            "vendor": "unknown",
            "name": name,
            "model": "",
            "serial": "",
            "firmware": "",
            "sys_object_id": self.sys_object_id,
        }
        return Reading(PDU_INFO, 1.0, labels, Kind.INFO)

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
    every recording in it becomes a target of its own that reads everything (vendor ``auto``,
    inlets and every outlet, no node outlets).
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
        targets = [
            PduTarget(p.stem, "replay", outlets=(ALL_OUTLETS,), inlets=True) for p in recordings
        ]
    return [PduSource(t, SnmprecClient(recorded_walk(replay_dir, t.name))) for t in targets]


__all__ = ["ALL_OUTLETS", "SYS_NAME", "PduSource", "PduTarget", "pdu_sources", "recorded_walk"]

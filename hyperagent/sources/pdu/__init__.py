"""Rack PDU power over SNMP: inlet, phase and outlet power, energy, current and voltage.

- :mod:`.profiles`: PDU support as data, one profile per MIB (APC rPDU2, Raritan PDU2 and
  PDU-MIB, ServerTech Sentry3 and Sentry4, Eaton ePDU and Revelation, Vertiv/Geist, Tripp Lite,
  HPE, Dell, Enlogic, Panduit, Schleifenbauer; ENTITY-SENSOR-MIB as the fallback), chosen by
  the PDU's sysObjectID.
- :mod:`.parse`: readings from the objects of any profile.
- :mod:`.snmp`: SNMP access, live (pysnmp) or from a recorded walk.
- :mod:`.source`: what one node reads from one PDU: its own outlets, and on one node per PDU
  the inlets and phases.

One :class:`PduSource` reads one PDU, so the runner reports each PDU's health on its own
(``hyperagent_source_up{source="pdu",target=NAME}``) and a dead PDU never hides the others;
:func:`pdu_sources` builds them from configuration.
"""

from hyperagent.sources.pdu.metrics import HELP
from hyperagent.sources.pdu.parse import node_readings, parse
from hyperagent.sources.pdu.profiles import PROFILES, VENDORS, Profile, detect_vendor
from hyperagent.sources.pdu.snmp import (
    Missing,
    PysnmpClient,
    SnmpClient,
    SnmpError,
    SnmprecClient,
    SnmpTimeout,
    VarBind,
    decode_snmprec,
    decode_snmpwalk,
)
from hyperagent.sources.pdu.source import (
    ALL_OUTLETS,
    PduSource,
    PduTarget,
    pdu_sources,
    recorded_walk,
)

__all__ = [
    "ALL_OUTLETS",
    "HELP",
    "PROFILES",
    "VENDORS",
    "Missing",
    "PduSource",
    "PduTarget",
    "Profile",
    "PysnmpClient",
    "SnmpClient",
    "SnmpError",
    "SnmpTimeout",
    "SnmprecClient",
    "VarBind",
    "decode_snmprec",
    "decode_snmpwalk",
    "detect_vendor",
    "node_readings",
    "parse",
    "pdu_sources",
    "recorded_walk",
]

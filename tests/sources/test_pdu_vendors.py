"""Every PDU profile against a real SNMP agent (snmpsim on loopback) serving its walk: the inlet
node's inlet power and energy, and a node's own outlet (named as the PDU names it) read with
GETs, each checked against the raw values read from the walk by hand (see SOURCES.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from pdu_agent import Snmpsim, Transcript

from hyperagent.readings import Reading
from hyperagent.sources.pdu import PduSource, PduTarget
from hyperagent.sources.pdu.metrics import JOULES_PER_KWH, JOULES_PER_TENTH_KWH, JOULES_PER_WH

pytestmark = [pytest.mark.timeout(120), pytest.mark.peer]


@dataclass(frozen=True)
class Expected:
    """What a walk holds, read by hand: the inlet's power and energy, and one node outlet."""

    capture: str
    vendor: str
    inlet: str
    inlet_w: float
    inlet_j: float | None  # None: the MIB has no energy meter
    outlet_name: str
    outlet: str
    outlet_w: float
    outlet_j: float | None


VENDORS = [
    # recorded: rPDU2DeviceStatusPower 121 (hundredths of kW), Energy 19516 (tenths of kWh);
    # outlet 5 "SRV-OPSHOST12": power 71 W, energy 1346 (tenths of kWh)
    Expected(
        "apc-8641.snmprec", "apc", "1", 1210.0, 19516 * JOULES_PER_TENTH_KWH,
        "SRV-OPSHOST12", "5", 71.0, 1346 * JOULES_PER_TENTH_KWH,
    ),
    # recorded: inlet sensors activePower 242, activeEnergy 1444088 Wh (0 decimal digits);
    # outlet 2: activePower 56, activeEnergy 330830 Wh
    Expected(
        "raritan-px2.snmpwalk", "raritan", "1", 242.0, 1444088 * JOULES_PER_WH,
        "2", "2", 56.0, 330830 * JOULES_PER_WH,
    ),
    # inletActivePower 905 W, inletActiveEnergy 5590283 Wh; outlet 1 212 W, 1304421 Wh
    Expected(
        "raritan-px1.snmprec", "raritan-px1", "1", 905.0, 5590283 * JOULES_PER_WH,
        "gpu-node-01-psu1", "1", 212.0, 1304421 * JOULES_PER_WH,
    ),
    # infeed AA: infeedPower 1065 W, infeedEnergy 18342 (tenths of kWh); AA1 520 W, 912345 Wh
    Expected(
        "sentry3.snmprec", "servertech-sentry3", "AA", 1065.0, 18342 * JOULES_PER_TENTH_KWH,
        "gpu-node-11", "AA1", 520.0, 912345 * JOULES_PER_WH,
    ),
    # cord AA: 2846 W, 51233 (tenths of kWh); AA1 478 W, 1204551 Wh
    Expected(
        "sentry4.snmprec", "servertech", "AA", 2846.0, 51233 * JOULES_PER_TENTH_KWH,
        "gpu-node-21-psu1", "AA1", 478.0, 1204551 * JOULES_PER_WH,
    ),
    # inputTotalActivePower 3120 W, inputTotalWh 7436122; outlet A1 509 W, 1190347 Wh
    Expected(
        "eaton-epdu.snmprec", "eaton", "1", 3120.0, 7436122 * JOULES_PER_WH,
        "gpu-node-41-psu1", "A1", 509.0, 1190347 * JOULES_PER_WH,
    ),
    # unitActivePower 1398 W; outlet 1 340 W; the MIB has no energy objects
    Expected(
        "eaton-revelation.snmprec", "eaton-revelation", "1", 1398.0, None,
        "gpu-node-51", "1", 340.0, None,
    ),
    # pduTotalRealPower 2210 W, pduTotalEnergy 4410002 Wh; outlet 1 370 W, 738211 Wh
    Expected(
        "vertiv-geist.snmprec", "vertiv", "1", 2210.0, 4410002 * JOULES_PER_WH,
        "gpu-node-31-psu1", "1", 370.0, 738211 * JOULES_PER_WH,
    ),
    # tlpPduDeviceOutputPowerTotal 1740 W; outlet 1 440 W; the MIB has no energy objects
    Expected(
        "tripplite.snmprec", "tripplite", "1", 1740.0, None,
        "gpu-node-61-psu1", "1", 440.0, None,
    ),
    # pdu2InputPowerWatts 4020 W, pdu2InputPowerWattHour 12033410; outlet 1 498 W, 1490233 Wh
    Expected(
        "hpe-pdu.snmprec", "hpe", "1", 4020.0, 12033410 * JOULES_PER_WH,
        "gpu-node-71-psu1", "1", 498.0, 1490233 * JOULES_PER_WH,
    ),
    # rPDUDeviceStatusPower 162 (hundredths of kW), Energy 28817 (tenths of kWh);
    # outlet 1 power 455, energy 4211 kWh
    Expected(
        "dell-rpdu.snmprec", "dell", "1", 1620.0, 28817 * JOULES_PER_TENTH_KWH,
        "gpu-node-81", "1", 455.0, 4211 * JOULES_PER_KWH,
    ),
    # pduUnitStatusActivePower 3312 W, Energy 60231 (tenths of kWh); outlet 1 548 W, 10233
    Expected(
        "enlogic.snmprec", "enlogic", "1", 3312.0, 60231 * JOULES_PER_TENTH_KWH,
        "gpu-node-91-psu1", "1", 548.0, 10233 * JOULES_PER_TENTH_KWH,
    ),
    # pdug5InputPowerWatts 2644, pdug5InputTotalEnergy 7405 kWh; outlet 1 619 W, 1224301 Wh
    Expected(
        "panduit-g5.snmprec", "panduit", "1", 2644.0, 7405 * JOULES_PER_KWH,
        "gpu-node-a1-psu1", "1", 619.0, 1224301 * JOULES_PER_WH,
    ),
    # pdu3InputPowerWatts 154 W, pdu3InputTotalEnergy 2113 kWh; outlet 2 "mgmt-switch" 61 W; the
    # pdu3 outlet table has no energy column
    Expected(
        "hpe-pdu3.snmprec", "hpe-pdu3", "1", 154.0, 2113 * JOULES_PER_KWH,
        "mgmt-switch", "2", 61.0, None,
    ),
    # tlpAtsDeviceOutputPowerTotal 486 W; outlet 1 118 W; the MIB has no energy objects
    Expected(
        "tripplite-ats.snmprec", "tripplite", "1", 486.0, None,
        "gpu-node-81-psu1", "1", 118.0, None,
    ),
    # sdbDevInPowerWatt 1850, sdbDevInKWhTotal 12877; outlet 1 455 W, 5120 kWh
    Expected(
        "schleifenbauer.snmprec", "schleifenbauer", "1", 1850.0, 12877 * JOULES_PER_KWH,
        "gpu-b1-1", "1", 455.0, 5120 * JOULES_PER_KWH,
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def snmpsim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Snmpsim]:
    agent = Snmpsim(tmp_path_factory.mktemp("snmpsim-vendors"))
    agent.start()
    yield agent
    agent.stop()


def one(readings: list[Reading], name: str, **labels: str) -> float | None:
    found = [
        r.value
        for r in readings
        if r.name == name and all(r.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) <= 1, found
    return found[0] if found else None


def auto(expected: Expected) -> str:
    """The Centreon Raritan walk has no system group: its vendor is configured."""
    return "raritan" if expected.capture.endswith(".snmpwalk") else "auto"


async def read_live(snmpsim: Snmpsim, target: PduTarget, capture: str) -> list[Reading]:
    source = PduSource(target, snmpsim.client(capture))
    try:
        await source.start()
        readings = await source.read()
    finally:
        await source.close()
    assert source.vendor is not None
    return readings


@pytest.mark.parametrize("expected", VENDORS, ids=lambda e: e.vendor)
async def test_the_inlet_node_reads_inlet_power_and_energy(
    snmpsim: Snmpsim, expected: Expected
) -> None:
    target = PduTarget("pdu", "127.0.0.1", vendor=auto(expected), inlets=True)
    readings = await read_live(snmpsim, target, expected.capture)
    (info,) = [r for r in readings if r.name == "hyperagent_pdu_info"]
    assert info.labels["vendor"] == expected.vendor
    inlet = {"inlet": expected.inlet}
    assert one(readings, "hyperagent_pdu_inlet_power_watts", **inlet) == expected.inlet_w
    energy = one(readings, "hyperagent_pdu_inlet_energy_joules_total", **inlet)
    assert energy == expected.inlet_j
    assert one(readings, "hyperagent_pdu_outlet_power_watts") is None


@pytest.mark.parametrize("expected", VENDORS, ids=lambda e: e.vendor)
async def test_a_node_reads_its_outlet_power_and_energy(
    snmpsim: Snmpsim, expected: Expected
) -> None:
    live = Transcript(snmpsim.client(expected.capture))
    target = PduTarget("pdu", "127.0.0.1", vendor=auto(expected), outlets=(expected.outlet_name,))
    source = PduSource(target, live)
    try:
        await source.start()
        readings = await source.read()
    finally:
        await source.close()
    outlet = {"outlet": expected.outlet}
    assert one(readings, "hyperagent_pdu_outlet_power_watts", **outlet) == expected.outlet_w
    energy = one(readings, "hyperagent_pdu_outlet_energy_joules_total", **outlet)
    assert energy == expected.outlet_j
    assert one(readings, "hyperagent_pdu_node_power_watts") == expected.outlet_w
    assert one(readings, "hyperagent_pdu_inlet_power_watts") is None
    # only this outlet's row was requested: every other outlet stays unread
    assert {r.labels["outlet"] for r in readings if "outlet" in r.labels} == {expected.outlet}

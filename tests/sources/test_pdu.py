"""PDU source: recordings and walks through the profiles, and through a real snmpsim."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from pdu_agent import CAPTURES, Snmpsim, Transcript, free_udp_port

from hyperagent.config import PduTargetSection, build_config
from hyperagent.errors import ConfigError, SourceError, SourceTimeout, SourceUnavailable
from hyperagent.readings import Kind, Reading
from hyperagent.sources.pdu import (
    HELP,
    VENDORS,
    Missing,
    PduSource,
    PduTarget,
    PysnmpClient,
    SnmprecClient,
    VarBind,
    decode_snmprec,
    decode_snmpwalk,
    detect_vendor,
    node_readings,
    parse,
    pdu_sources,
)
from hyperagent.sources.pdu.metrics import JOULES_PER_KWH, JOULES_PER_WH
from hyperagent.sources.pdu.profiles import APC, RARITAN
from hyperagent.sources.runner import SourceRunner

from conftest import FIXTURES

pytestmark = pytest.mark.timeout(120)

GOLDEN = Path(__file__).parents[1] / "golden" / "pdu"
_APC = "1.3.6.1.4.1.318.1.1.26"
_RARITAN = "1.3.6.1.4.1.13742.6"

CAPTURE_FILES = sorted(p.name for p in CAPTURES.iterdir() if p.suffix in (".snmprec", ".snmpwalk"))
VENDOR_OF = {"raritan-px2.snmpwalk": "raritan"}  # Centreon's walk has no system group


def whole_pdu(capture: str) -> PduTarget:
    """A target that reads everything of a PDU: inlets, phases and every outlet."""
    stem = Path(capture).stem
    return PduTarget(
        stem, "127.0.0.1", vendor=VENDOR_OF.get(capture, "auto"), outlets=("*",), inlets=True
    )


def render(readings: Sequence[Reading]) -> str:
    lines = []
    for r in readings:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(r.labels.items()))
        lines.append(f"{r.name}{{{labels}}} {r.value!r} {r.kind.value}")
    return "\n".join(sorted(lines)) + "\n"


async def read(target: PduTarget, capture: str) -> list[Reading]:
    source = PduSource(target, SnmprecClient(CAPTURES / capture))
    await source.start()
    try:
        return await source.read()
    finally:
        await source.close()


def values(readings: Sequence[Reading], name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(v for k, v in sorted(r.labels.items()) if k != "pdu"): r.value
        for r in readings
        if r.name == name
    }


@pytest.mark.parametrize("capture", CAPTURE_FILES)
async def test_readings_match_golden(capture: str) -> None:
    text = render(await read(whole_pdu(capture), capture))
    golden = GOLDEN / f"{Path(capture).stem}.txt"
    if os.environ.get("HYPERAGENT_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), "rerun with HYPERAGENT_UPDATE_GOLDEN=1 to accept"


@pytest.mark.parametrize("capture", CAPTURE_FILES)
async def test_every_metric_has_help_and_one_label_set(capture: str) -> None:
    readings = await read(whole_pdu(capture), capture)
    label_sets: dict[str, set[tuple[str, ...]]] = {}
    for r in readings:
        assert r.name in HELP
        assert (r.kind is Kind.COUNTER) == r.name.endswith("_total")
        label_sets.setdefault(r.name, set()).add(tuple(sorted(r.labels)))
    assert all(len(keys) == 1 for keys in label_sets.values()), label_sets
    series = [(r.name, tuple(sorted(r.labels.items()))) for r in readings]
    assert len(series) == len(set(series))


async def test_apc_units_are_converted_from_the_recorded_raw_values() -> None:
    readings = await read(whole_pdu("apc-8641.snmprec"), "apc-8641.snmprec")
    # rPDU2DeviceStatusPower 121 (hundredths of kW), Energy 19516 (tenths of kWh)
    assert values(readings, "hyperagent_pdu_inlet_power_watts") == {("1",): 1210.0}
    assert values(readings, "hyperagent_pdu_inlet_energy_joules_total") == {("1",): 19516 * 360_000}
    # rPDU2PhaseStatus: current 65 (tenths of A), voltage 201 V, power 122 (hundredths of kW)
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {("1", "1"): 6.5}
    assert values(readings, "hyperagent_pdu_phase_voltage_volts") == {("1", "1"): 201.0}
    assert values(readings, "hyperagent_pdu_phase_power_watts") == {("1", "1"): 1220.0}
    # Outlet 5 "SRV-OPSHOST12": 71 W, 0.4 A, 1346 tenths of kWh; outlet 6 "SRV-OPSHOST11": 96 W
    power = values(readings, "hyperagent_pdu_outlet_power_watts")
    assert len(power) == 24 and power[("5",)] == 71 and power[("6",)] == 96
    assert values(readings, "hyperagent_pdu_outlet_current_amperes")[("5",)] == 0.4
    energy = values(readings, "hyperagent_pdu_outlet_energy_joules_total")
    assert energy[("5",)] == 1346 * 360_000
    (info,) = [r for r in readings if r.name == "hyperagent_pdu_info"]
    assert info.labels["model"] == "AP8641" and info.labels["serial"] == "3F3452A52295"
    assert info.labels["sys_object_id"] == "1.3.6.1.4.1.318.1.3.4.6"


async def test_a_node_reads_only_its_own_outlets() -> None:
    """Outlet 5 by id and outlet 6 by the name the PDU gives it: GETs of those two rows, after
    learning once which rows they are; no inlet, phase or other outlet is reported."""
    client = Transcript(SnmprecClient(CAPTURES / "apc-8641.snmprec"))
    target = PduTarget("apc-8641", "127.0.0.1", outlets=("5", "SRV-OPSHOST11"))
    source = PduSource(target, client)
    first = await source.read()
    second = await source.read()
    assert render(first) == render(second)
    assert values(first, "hyperagent_pdu_outlet_power_watts") == {("5",): 71.0, ("6",): 96.0}
    assert values(first, "hyperagent_pdu_node_power_watts") == {(): 71 + 96}
    assert values(first, "hyperagent_pdu_node_energy_joules_total") == {(): (1346 + 1848) * 360_000}
    assert not values(first, "hyperagent_pdu_inlet_power_watts")
    assert not values(first, "hyperagent_pdu_phase_power_watts")
    # the outlet table's label columns are walked once, on the first read; then only GETs
    assert [oid for oid, _ in client.walks] == [f"{_APC}.9.4.3.1.{c}" for c in (4, 3, 2)]
    outlet_gets = [oid for oids, _ in client.gets for oid in oids if ".9.4.3.1." in oid]
    rows = {oid.rsplit(".", 1)[1] for oid in outlet_gets}
    assert rows == {"5", "6"}  # the rows of outlets 5 and 6, nothing else


async def test_the_inlets_node_reads_inlets_and_phases_without_outlets() -> None:
    client = Transcript(SnmprecClient(CAPTURES / "apc-8641.snmprec"))
    source = PduSource(PduTarget("apc-8641", "127.0.0.1", inlets=True), client)
    readings = await source.read()
    assert values(readings, "hyperagent_pdu_inlet_power_watts") == {("1",): 1210.0}
    assert values(readings, "hyperagent_pdu_phase_power_watts") == {("1", "1"): 1220.0}
    assert not values(readings, "hyperagent_pdu_outlet_power_watts")
    assert all(".9.4.3.1." not in oid for oid, _ in client.walks)


async def test_apc_switched_pdu_reports_only_what_it_measures() -> None:
    readings = await read(whole_pdu("apc-7902b.snmprec"), "apc-7902b.snmprec")
    # AP7902B: phase current 16 (tenths of A); power, voltage and energy are -1 (not measured)
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {("1", "1"): 1.6}
    assert {r.name for r in readings} == {
        "hyperagent_pdu_info",
        "hyperagent_pdu_phase_current_amperes",
    }


async def test_raritan_values_use_the_sensor_decimal_digits() -> None:
    readings = await read(whole_pdu("raritan-px2.snmpwalk"), "raritan-px2.snmpwalk")
    # inlet rmsCurrent 1626 with 3 decimal digits; activeEnergy 1444088 Wh
    assert values(readings, "hyperagent_pdu_inlet_current_amperes") == {("1",): 1.626}
    assert values(readings, "hyperagent_pdu_inlet_voltage_volts") == {("1",): 233.0}
    assert values(readings, "hyperagent_pdu_inlet_power_watts") == {("1",): 242.0}
    assert values(readings, "hyperagent_pdu_inlet_energy_joules_total") == {
        ("1",): 1444088 * 3600.0
    }
    assert values(readings, "hyperagent_pdu_outlet_current_amperes")[("2",)] == 0.303
    assert values(readings, "hyperagent_pdu_outlet_power_watts")[("2",)] == 56


async def test_raritan_node_outlets_are_read_with_gets_of_their_sensors() -> None:
    target = PduTarget("raritan-px2", "127.0.0.1", vendor="raritan", outlets=("1", "2"))
    readings = await read(target, "raritan-px2.snmpwalk")
    assert values(readings, "hyperagent_pdu_outlet_current_amperes") == {
        ("1",): 0.074,
        ("2",): 0.303,
    }
    assert values(readings, "hyperagent_pdu_node_power_watts") == {(): 7 + 56}


async def test_entity_sensor_fallback_reads_scaled_sensors() -> None:
    capture = "westermo-entity-sensor.snmpwalk"
    readings = await read(whole_pdu(capture), capture)
    # one celsius(8) sensor, scale units(9), precision 0, value 50; truthvalue sensors ignored
    assert values(readings, "hyperagent_pdu_sensor_temperature_celsius") == {
        ("Anonymized 176",): 50.0
    }


async def test_an_unknown_pdu_reports_its_sys_object_id_and_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CyberPower PDU (a real walk): no profile knows enterprises.3808."""
    capture = "cyberpower-unknown.snmpwalk"
    with caplog.at_level(logging.WARNING, logger="hyperagent.sources.pdu.source"):
        readings = await read(whole_pdu(capture), capture)
    (info,) = readings
    assert info.name == "hyperagent_pdu_info"
    assert info.labels["vendor"] == "unknown"
    assert info.labels["sys_object_id"] == "1.3.6.1.4.1.3808.1.1.6"
    assert info.labels["name"] == "ATS011"
    (message,) = [r.getMessage() for r in caplog.records]
    assert "sysObjectID 1.3.6.1.4.1.3808.1.1.6 (CPS Power Distributed Unit)" in message
    assert "matches no PDU profile" in message and "Set vendor" in message


def test_vendor_is_detected_by_its_exact_sys_object_id_subtree() -> None:
    assert detect_vendor("1.3.6.1.4.1.318.1.3.4.6") == "apc"
    assert detect_vendor("1.3.6.1.4.1.13742.6") == "raritan"
    assert detect_vendor("1.3.6.1.4.1.13742.4") == "raritan-px1"
    assert detect_vendor("1.3.6.1.4.1.1718.4") == "servertech"
    assert detect_vendor("1.3.6.1.4.1.1718.3") == "servertech-sentry3"
    assert detect_vendor("1.3.6.1.4.1.534.6.6.7") == "eaton"
    assert detect_vendor("1.3.6.1.4.1.534.6.6.6") == "eaton-revelation"
    assert detect_vendor("1.3.6.1.4.1.21239.42.1.31") == "vertiv"
    assert detect_vendor("1.3.6.1.4.1.13742") is None  # the enterprise alone names no MIB
    assert detect_vendor("1.3.6.1.4.1.13742.60") is None  # a prefix of text is not a subtree
    assert detect_vendor("1.3.6.1.4.1.318.1.3.2.12") is None  # an APC UPS, not a rack PDU
    assert detect_vendor(Missing.NO_SUCH_OBJECT) is None
    assert detect_vendor("not an oid") is None
    assert detect_vendor(b"not an oid") is None
    # CPQPOWER agents answer sysObjectID with a DisplayString holding the OID
    assert detect_vendor(b".1.3.6.1.4.1.232.165.11") == "hpe-pdu3"
    assert detect_vendor(b"1.3.6.1.4.1.232.165.7\x00") == "hpe"


def test_targets_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown PDU vendor 'cyberpower'"):
        PduTarget("p", "h", vendor="cyberpower", inlets=True)
    with pytest.raises(ValueError, match="reads nothing"):
        PduTarget("p", "h")
    with pytest.raises(ValueError, match="alone"):
        PduTarget("p", "h", outlets=("*", "3"))


def test_a_target_that_reads_nothing_is_a_config_error() -> None:
    targets = [{"name": "rack01-pdu", "host": "10.0.0.5"}]
    with pytest.raises(ConfigError, match="would read nothing"):
        build_config({"sources": {"pdu": {"targets": targets}}})
    config = build_config({"sources": {"pdu": {"targets": [{**targets[0], "inlets": True}]}}})
    assert config.sources.pdu.targets[0].inlets
    assert config.sources.pdu.interval_s == 5.0


def test_config_accepts_exactly_the_profiles_vendors() -> None:
    accepted = typing.get_args(PduTargetSection.model_fields["vendor"].annotation)
    assert sorted(accepted) == sorted(VENDORS)


def test_garbage_values_are_skipped() -> None:
    device, phase, outlet = f"{_APC}.4.3.1", f"{_APC}.6.3.1", f"{_APC}.9.4.3.1"
    binds: list[VarBind] = [
        (f"{device}.5.1", b"1200"),  # power as a string: not a number
        (f"{device}.9.1", 50),  # energy: fine
        (f"{phase}.5.1", Missing.NO_SUCH_INSTANCE),
        (f"{phase}.6.1", 230),
        (f"{phase}.7.1", -1),  # not measured
        (f"{outlet}.7.1", "1.3.6.1"),  # power as an OID
        (f"{outlet}.7.2", 120),
        (f"{outlet}.7.2.9", 5),  # index too long for this table
        ("1.3.6.1.4.1.318.x.1", 7),  # not an OID
        (f"{outlet}.11.2", Missing.END_OF_MIB_VIEW),
    ]
    readings = parse(APC, binds, "p")
    assert {(r.name, tuple(r.labels.values())): r.value for r in readings} == {
        ("hyperagent_pdu_info", ("p", "apc", "", "", "", "", "")): 1.0,
        ("hyperagent_pdu_inlet_energy_joules_total", ("p", "1")): 50 * 360_000.0,
        ("hyperagent_pdu_phase_voltage_volts", ("p", "1", "1")): 230.0,
        ("hyperagent_pdu_outlet_power_watts", ("p", "2")): 120.0,
    }


def test_garbage_recording_lines_are_skipped() -> None:
    assert decode_snmprec(
        "1.3.6.1.2.1.1.5.0|4|pdu-a\n"
        "garbage\n"
        "1.3.6.x|2|5\n"
        "1.3.6.1.2.1.1.7.0|2|seventy\n"
        "1.3.6.1.2.1.1.3.0|67|100\n"
        "1.3.6.1.2.1.1.9.0|4x|zz\n"
        "1.3.6.1.2.1.1.8.0|2:numeric|min=1,max=2\n"
        "1.3.6.1.2.1.1.4.0|4e|a\\x41\\n\n"
    ) == [
        ("1.3.6.1.2.1.1.5.0", b"pdu-a"),
        ("1.3.6.1.2.1.1.3.0", 100),
        ("1.3.6.1.2.1.1.4.0", b"aA\n"),
    ]
    assert decode_snmpwalk(
        ".1.3.6.1.2.1.2.2.1.3.1 = INTEGER: ethernetCsmacd(6)\n"
        ".1.3.6.1.2.1.2.2.1.6.1 = STRING: 60:9c:9f:ec:a3:38\n"
        ".1.3.6.1.2.1.2.2.1.5.1 = Gauge32: 10000 bits per second\n"
        ".1.3.6.1.2.1.2.2.1.2.1 = INTEGER: lots\n"
        "no equals sign here\n"
        ".1.3.6.1.2.1.1.1.0 = Hex-STRING: ZZ\n"
        ".1.3.6.1.2.1.1.2.0 = OID: .1.3.6.1.4.1.318\n"
    ) == [
        ("1.3.6.1.2.1.2.2.1.3.1", 6),
        ("1.3.6.1.2.1.2.2.1.6.1", bytes.fromhex("609c9feca338")),
        ("1.3.6.1.2.1.2.2.1.5.1", 10000),
        ("1.3.6.1.2.1.1.2.0", "1.3.6.1.4.1.318"),
    ]


async def test_recording_without_records_is_an_error_and_a_missing_one_absent(
    tmp_path: Path,
) -> None:
    garbage = tmp_path / "garbage.snmprec"
    garbage.write_bytes(b"\x00\xff not a walk\n|||\n")
    with pytest.raises(SourceError, match="no readable SNMP records"):
        await PduSource(PduTarget("g", "replay", inlets=True), SnmprecClient(garbage)).read()
    missing = SnmprecClient(tmp_path / "m.snmprec")
    with pytest.raises(SourceUnavailable, match="no recorded SNMP walk"):
        await PduSource(PduTarget("m", "replay", inlets=True), missing).read()


async def test_a_known_pdu_without_its_tables_is_an_error(tmp_path: Path) -> None:
    recording = tmp_path / "apc.snmprec"
    recording.write_text("1.3.6.1.2.1.1.2.0|6|1.3.6.1.4.1.318.1.3.4.5\n1.3.6.1.2.1.1.5.0|4|a\n")
    source = PduSource(PduTarget("a", "replay", inlets=True), SnmprecClient(recording))
    with pytest.raises(SourceError, match=r"no apc \(PowerNet-MIB rPDU2\) power measurements"):
        await source.read()


def test_raritan_inlet_poles_from_the_mib() -> None:
    """Three-phase inlet poles (absent from the stored single-phase walk), hand-written."""
    binds: list[VarBind] = [
        (f"{_RARITAN}.3.3.4.1.7.1.1.1", 3),  # rmsCurrent: 3 decimal digits
        *((f"{_RARITAN}.5.2.4.1.3.1.1.{pole}.1", 4) for pole in (1, 2, 3)),
        *((f"{_RARITAN}.5.2.4.1.4.1.1.{pole}.1", 1000 * pole) for pole in (1, 2, 3)),
        (f"{_RARITAN}.5.2.4.1.3.1.1.3.4", -1),  # unavailable
        (f"{_RARITAN}.5.2.4.1.4.1.1.3.4", 231),
    ]
    readings = parse(RARITAN, binds, "r")
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {
        ("1", "L1"): 1.0,
        ("1", "L2"): 2.0,
        ("1", "L3"): 3.0,
    }
    assert not values(readings, "hyperagent_pdu_phase_voltage_volts")


async def test_node_totals_need_every_configured_outlet(caplog: pytest.LogCaptureFixture) -> None:
    readings = await read(whole_pdu("apc-8641.snmprec"), "apc-8641.snmprec")
    assert not node_readings(readings, "apc-8641", ["5", "99"])
    by_name = node_readings(readings, "apc-8641", ["SRV-OPSHOST12", "SRV-OPSHOST11"])
    assert [r.value for r in by_name] == [71 + 96, (1346 + 1848) * 360_000]
    with caplog.at_level(logging.WARNING, logger="hyperagent.sources.pdu.source"):
        partial = await read(PduTarget("apc-8641", "h", outlets=("5", "99")), "apc-8641.snmprec")
    assert values(partial, "hyperagent_pdu_outlet_power_watts") == {("5",): 71.0}
    assert not values(partial, "hyperagent_pdu_node_power_watts")
    assert any("has no outlet 99" in r.getMessage() for r in caplog.records)


async def test_a_pdu_without_energy_meters_gives_node_power_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TRIPPLITE-PRODUCTS has no energy objects: the node's power is complete without them."""
    target = PduTarget("tripplite", "h", outlets=("gpu-node-61-psu1",))
    with caplog.at_level(logging.WARNING, logger="hyperagent.sources.pdu.source"):
        readings = await read(target, "tripplite.snmprec")
    assert values(readings, "hyperagent_pdu_node_power_watts") == {(): 440.0}
    assert not values(readings, "hyperagent_pdu_node_energy_joules_total")
    assert not caplog.records


class BlockingClient:
    """An SNMP client whose walks wait until released (stands in for a slow PDU)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def open(self) -> None:
        return None

    async def get(self, oids: Sequence[str]) -> list[VarBind]:
        return [(oid, Missing.NO_SUCH_OBJECT) for oid in oids]

    async def walk(self, oid: str) -> list[VarBind]:
        await self.release.wait()
        return []

    async def close(self) -> None:
        return None


async def test_a_read_still_running_refuses_the_next() -> None:
    client = BlockingClient()
    source = PduSource(PduTarget("slow", "h", vendor="apc", inlets=True), client)
    first = asyncio.create_task(source.read())
    await asyncio.sleep(0.01)
    with pytest.raises(SourceError, match="previous SNMP read still running"):
        await source.read()
    client.release.set()
    with pytest.raises(SourceError, match="no apc"):
        await first


async def test_replay_directory_builds_one_source_per_recording() -> None:
    replay = FIXTURES / "replay" / "apc-ap8641-pdu" / "pdu"
    sources = pdu_sources([], replay_dir=replay)
    assert [(s.name, s.target) for s in sources] == [("pdu", "rack01-pdu")]
    everything = await sources[0].read()
    assert values(everything, "hyperagent_pdu_inlet_power_watts") == {("1",): 1210.0}
    assert len(values(everything, "hyperagent_pdu_outlet_power_watts")) == 24
    configured = pdu_sources(
        [PduTarget("rack01-pdu", "10.0.0.5", outlets=("5",))], replay_dir=replay
    )
    readings = await configured[0].read()
    assert values(readings, "hyperagent_pdu_node_power_watts") == {(): 71.0}
    (missing,) = pdu_sources([PduTarget("rack02-pdu", "10.0.0.6", inlets=True)], replay_dir=replay)
    with pytest.raises(SourceUnavailable):
        await missing.read()


# -- Against a real SNMP agent: snmpsim serving the same recordings on loopback ---------------


@pytest.fixture(scope="module")
def snmpsim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Snmpsim]:
    agent = Snmpsim(tmp_path_factory.mktemp("snmpsim"))
    agent.start()
    yield agent
    agent.stop()


@pytest.mark.peer
@pytest.mark.parametrize("capture", CAPTURE_FILES)
async def test_snmpsim_serves_the_same_walks_and_readings(snmpsim: Snmpsim, capture: str) -> None:
    live = Transcript(snmpsim.client(capture))
    source = PduSource(whole_pdu(capture), live)
    try:
        await source.start()
        readings = await source.read()
    finally:
        await source.close()
    assert render(readings) == render(await read(whole_pdu(capture), capture))
    recorded = SnmprecClient(CAPTURES / capture)
    for oids, answer in live.gets:
        assert answer == await recorded.get(oids)
    for oid, answer in live.walks:
        assert answer == await recorded.walk(oid), oid


@pytest.mark.peer
async def test_a_node_gets_its_outlets_from_a_live_agent(snmpsim: Snmpsim) -> None:
    live = Transcript(snmpsim.client("apc-8641.snmprec"))
    target = PduTarget("apc-8641", "127.0.0.1", outlets=("5", "SRV-OPSHOST11"))
    source = PduSource(target, live)
    try:
        await source.start()
        readings = await source.read()
        await source.read()
    finally:
        await source.close()
    assert values(readings, "hyperagent_pdu_node_power_watts") == {(): 167.0}
    assert len(live.walks) == 3  # the label columns, on the first read only
    # the system group to choose the profile; then each read is one GET: the system group,
    # the PDU's identity and this node's two outlet rows
    assert len(live.gets) == 3
    assert all(len(oids) <= 24 for oids, _ in live.gets)


@pytest.mark.peer
async def test_snmp_timeout_is_a_source_error_within_the_bound() -> None:
    # pysnmp's defaults would wait 1 s x 6 tries; the configured bound is 0.5 s x 2 tries
    client = PysnmpClient("127.0.0.1", free_udp_port(), "public", timeout_s=0.5, retries=1)
    source = PduSource(PduTarget("dead", "127.0.0.1", inlets=True), client)
    await source.start()
    began = time.monotonic()
    with pytest.raises(SourceTimeout, match=r"no response to GET .* within 0.5s x 2 tries"):
        await source.read()
    assert time.monotonic() - began < 3.0
    await source.close()


@pytest.mark.peer
async def test_a_dead_pdu_does_not_hide_the_others(snmpsim: Snmpsim) -> None:
    target = PduTarget("apc-8641", "127.0.0.1", outlets=("5", "SRV-OPSHOST11"))
    good = PduSource(target, snmpsim.client("apc-8641.snmprec"))
    dead_client = PysnmpClient("127.0.0.1", free_udp_port(), "public", 0.3, retries=0)
    dead = PduSource(PduTarget("rack02-pdu", "127.0.0.1", inlets=True), dead_client)
    runner = SourceRunner([good, dead], timeout_s=5.0)
    await runner.start()
    try:
        readings = await runner.read_all()
    finally:
        await runner.close()
    up = {r.labels["target"]: r.value for r in readings if r.name == "hyperagent_source_up"}
    assert up == {"apc-8641": 1.0, "rack02-pdu": 0.0}
    node = [r for r in readings if r.name == "hyperagent_pdu_node_power_watts"]
    assert [(r.labels["pdu"], r.value) for r in node] == [("apc-8641", 167.0)]


# -- Real PDUs that read wrong: walks written from the MIB and the values a real walk holds
# (fixtures/pdu-snmp/SOURCES.md, "Written from the MIB"), served by snmpsim ------------------


async def read_live(
    snmpsim: Snmpsim, capture: str, target: PduTarget | None = None
) -> list[Reading]:
    source = PduSource(target or whole_pdu(capture), snmpsim.client(capture))
    try:
        await source.start()
        return await source.read()
    finally:
        await source.close()


@pytest.mark.peer
async def test_panduit_g5_inlet_energy_is_read_in_kwh(snmpsim: Snmpsim) -> None:
    """pdug5InputTotalEnergy 7405 is kWh: the resettable meter beside it (7405276 Wh) agrees."""
    readings = await read_live(snmpsim, "panduit-g5.snmprec")
    (energy,) = values(readings, "hyperagent_pdu_inlet_energy_joules_total").values()
    assert energy == 7405 * JOULES_PER_KWH
    assert abs(energy - 7405276 * JOULES_PER_WH) < JOULES_PER_KWH


@pytest.mark.peer
async def test_hpe_pdu3_answering_sys_object_id_as_a_string_is_read(
    snmpsim: Snmpsim, caplog: pytest.LogCaptureFixture
) -> None:
    """CPQPOWER-MIB makes sysObjectID a DisplayString: the PDU is still recognised and its
    pdu3 tables read (inlet 154 W, outlets summing to 153 W)."""
    with caplog.at_level(logging.WARNING, logger="hyperagent.sources.pdu"):
        readings = await read_live(snmpsim, "hpe-pdu3.snmprec")
    assert not [r for r in caplog.records if "matches no PDU profile" in r.getMessage()]
    (info,) = [r for r in readings if r.name == "hyperagent_pdu_info"]
    assert info.labels["vendor"] == "hpe-pdu3"
    assert info.labels["sys_object_id"] == "1.3.6.1.4.1.232.165.11"
    assert info.labels["model"] == "230V, 16A, 3.7kVA, 50/60Hz"
    assert values(readings, "hyperagent_pdu_inlet_power_watts") == {("1",): 154.0}
    assert values(readings, "hyperagent_pdu_inlet_energy_joules_total") == {
        ("1",): 2113 * JOULES_PER_KWH
    }
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {("1", "1"): 0.7}
    assert values(readings, "hyperagent_pdu_phase_voltage_volts") == {("1", "1"): 230.1}
    assert sum(values(readings, "hyperagent_pdu_outlet_power_watts").values()) == 153.0
    node = PduTarget("hpe-pdu3", "127.0.0.1", outlets=("mgmt-switch",))
    mine = await read_live(snmpsim, "hpe-pdu3.snmprec", node)
    assert values(mine, "hyperagent_pdu_node_power_watts") == {(): 61.0}


@pytest.mark.peer
async def test_eaton_revelation_outlet_voltage_is_in_volts(snmpsim: Snmpsim) -> None:
    readings = await read_live(snmpsim, "eaton-revelation.snmprec")
    voltage = values(readings, "hyperagent_pdu_outlet_voltage_volts")
    assert [voltage[(str(n),)] for n in range(1, 5)] == [244.0, 241.0, 249.0, 246.0]
    assert values(readings, "hyperagent_pdu_inlet_voltage_volts") == {("1",): 229.7}


@pytest.mark.peer
async def test_tripplite_phase_current_comes_from_the_output_table(snmpsim: Snmpsim) -> None:
    """A Tripp Lite PDU without tlpPduInputPhaseCurrent: tlpPduOutputCurrent 100 is 1.00 A."""
    readings = await read_live(snmpsim, "tripplite-pdu-output-current.snmprec")
    phase = ("1", "1")
    assert values(readings, "hyperagent_pdu_phase_voltage_volts") == {phase: 207.0}
    assert values(readings, "hyperagent_pdu_phase_power_watts") == {phase: 207.0}
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {phase: 1.0}


@pytest.mark.peer
async def test_tripplite_ats_is_read_from_its_ats_tables(snmpsim: Snmpsim) -> None:
    """An ATS (tlpDeviceType tlpAts) answers the same sysObjectID as Tripp Lite PDUs and keeps
    its readings in the tlpAts tables: output power, both input lines, its outlets."""
    readings = await read_live(snmpsim, "tripplite-ats.snmprec")
    (info,) = [r for r in readings if r.name == "hyperagent_pdu_info"]
    assert (info.labels["vendor"], info.labels["model"]) == ("tripplite", "PDUMH20ATNET")
    assert values(readings, "hyperagent_pdu_inlet_power_watts") == {("1",): 486.0}
    assert values(readings, "hyperagent_pdu_phase_voltage_volts") == {
        ("1", "1"): 120.4,
        ("2", "1"): 119.8,
    }
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {
        ("1", "1"): 4.05,
        ("2", "1"): 0.0,
    }
    assert sum(values(readings, "hyperagent_pdu_outlet_power_watts").values()) == 486.0
    node = PduTarget("ats", "127.0.0.1", outlets=("gpu-node-81-psu1", "gpu-node-81-psu2"))
    mine = await read_live(snmpsim, "tripplite-ats.snmprec", node)
    assert values(mine, "hyperagent_pdu_node_power_watts") == {(): 118.0 + 117.0}


@pytest.mark.peer
async def test_vertiv_delta_unit_reads_its_line_currents(snmpsim: Snmpsim) -> None:
    """A delta unit's pduPhaseTable holds the phase pairs; the line conductors' currents
    (Line A/B/C, about 12.6 A) are in pduLineTable."""
    readings = await read_live(snmpsim, "vertiv-geist-delta.snmprec")
    current = values(readings, "hyperagent_pdu_phase_current_amperes")
    assert current == {
        ("1", "L1-L2"): 7.31,
        ("1", "L2-L3"): 7.24,
        ("1", "L3-L1"): 7.3,
        ("1", "Line A"): 12.62,
        ("1", "Line B"): 12.55,
        ("1", "Line C"): 12.64,
    }


async def test_a_wye_units_unnamed_line_rows_are_not_phases() -> None:
    """A Vertiv wye unit's pduLineTable beside its named phases L1..L3: three rows with no
    name reading 0 A. Only the three phases are published, with their 6 A each."""
    capture = "vertiv-geist-wye-lines.snmprec"
    readings = await read(whole_pdu(capture), capture)
    currents = values(readings, "hyperagent_pdu_phase_current_amperes")
    assert currents == {("1", "L1"): 6.12, ("1", "L2"): 6.05, ("1", "L3"): 6.11}


async def test_outlet_rows_past_the_outlet_count_are_not_outlets() -> None:
    """A Raritan PX1 with outletCount 8 whose agent answers the 12 rows of its board's
    outletTable, rows 9-12 unnamed at 0 mA: only outlets 1-8 are published, whether the node
    walks every outlet or names its own (a row past the count is no outlet id to resolve)."""
    capture = "raritan-px1-counted.snmprec"
    readings = await read(whole_pdu(capture), capture)
    currents = values(readings, "hyperagent_pdu_outlet_current_amperes")
    assert sorted(int(outlet) for (outlet,) in currents) == list(range(1, 9))
    assert currents[("1",)] == 0.923
    node = PduTarget("raritan-px1-counted", "127.0.0.1", outlets=("1", "2", "10"))
    own = await read(node, capture)
    assert sorted(o for (o,) in values(own, "hyperagent_pdu_outlet_power_watts")) == ["1", "2"]


async def test_a_single_phase_inlet_has_one_phase_voltage() -> None:
    """The same PX1 (inletPoleCount 1: single phase) answers a second inletPoleTable row, L2 at
    the line's 230.1 V and 0 mA: the inlet keeps its one phase, L1."""
    capture = "raritan-px1-counted.snmprec"
    readings = await read(whole_pdu(capture), capture)
    assert values(readings, "hyperagent_pdu_phase_voltage_volts") == {("1", "L1"): 230.1}
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {("1", "L1"): 3.95}


@pytest.mark.peer
async def test_hpe_pdu3_outlet_rows_past_its_outlet_count_are_not_outlets(
    snmpsim: Snmpsim,
) -> None:
    """An HPE pdu3 (pdu3OutletCount 4) whose agent answers 54 more pdu3OutletTable rows, each
    at 0 A: only outlets 1-4 are published, and a node naming outlet 10 gets no sum."""
    capture = "hpe-pdu3-counted.snmprec"
    readings = await read_live(snmpsim, capture)
    currents = values(readings, "hyperagent_pdu_outlet_current_amperes")
    assert sorted(int(outlet) for (outlet,) in currents) == [1, 2, 3, 4]
    assert sum(values(readings, "hyperagent_pdu_outlet_power_watts").values()) == 153.0
    node = PduTarget("hpe-pdu3-counted", "127.0.0.1", outlets=("2", "10"))
    mine = await read_live(snmpsim, capture, node)
    assert sorted(o for (o,) in values(mine, "hyperagent_pdu_outlet_power_watts")) == ["2"]
    assert values(mine, "hyperagent_pdu_node_power_watts") == {}


@pytest.mark.peer
async def test_a_tripplite_single_phase_inlet_has_one_phase(snmpsim: Snmpsim) -> None:
    """A Tripp Lite PDU whose tlpPduIdentNumPhases is 1 answers a second input phase row and a
    second output row at the line's 115.1 V and 0 A: the inlet keeps its one phase."""
    readings = await read_live(snmpsim, "tripplite-single-phase.snmprec")
    phase = ("1", "1")
    assert values(readings, "hyperagent_pdu_phase_voltage_volts") == {phase: 115.1}
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {phase: 12.03}
    assert values(readings, "hyperagent_pdu_phase_power_watts") == {phase: 1383.0}

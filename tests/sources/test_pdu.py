"""PDU source: vendor profiles on real walks, through a recording and through a real snmpsim."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from hyperagent.errors import SourceError, SourceTimeout, SourceUnavailable
from hyperagent.readings import Kind, Reading
from hyperagent.sources.pdu import (
    APC_DEVICE_STATUS,
    APC_OUTLET_METERED_STATUS,
    APC_PHASE_STATUS,
    EATON,
    HELP,
    PROFILES,
    RARITAN,
    SYS_OBJECT_ID,
    Missing,
    PduSource,
    PduTarget,
    PysnmpClient,
    SnmpClient,
    SnmprecClient,
    VarBind,
    decode_snmprec,
    decode_snmpwalk,
    detect_vendor,
    node_readings,
    parse_apc,
    parse_eaton,
    parse_raritan,
    pdu_sources,
)
from hyperagent.sources.runner import SourceRunner

from conftest import FIXTURES

pytestmark = pytest.mark.timeout(120)

CAPTURES = FIXTURES / "pdu-snmp"
GOLDEN = Path(__file__).parents[1] / "golden" / "pdu"

# Capture file -> the target the tests poll it as (its community is the file's stem).
TARGETS = {
    "apc-8641.snmprec": PduTarget("apc-8641", "127.0.0.1", outlets=("5", "SRV-OPSHOST11")),
    "apc-8932.snmprec": PduTarget("apc-8932", "127.0.0.1"),
    "apc-7902b.snmprec": PduTarget("apc-7902b", "127.0.0.1"),
    "raritan-px2.snmpwalk": PduTarget(
        "raritan-px2", "127.0.0.1", vendor="raritan", outlets=("1", "2")
    ),
    "sentry4.snmprec": PduTarget("sentry4", "127.0.0.1"),
    "westermo-entity-sensor.snmpwalk": PduTarget("westermo-entity-sensor", "127.0.0.1"),
}


def render(readings: Sequence[Reading]) -> str:
    lines = []
    for r in readings:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(r.labels.items()))
        lines.append(f"{r.name}{{{labels}}} {r.value!r} {r.kind.value}")
    return "\n".join(sorted(lines)) + "\n"


async def read_recording(capture: str) -> list[Reading]:
    source = PduSource(TARGETS[capture], SnmprecClient(CAPTURES / capture))
    await source.start()
    try:
        return await source.read()
    finally:
        await source.close()


@pytest.mark.parametrize("capture", sorted(TARGETS))
async def test_readings_match_golden(capture: str) -> None:
    text = render(await read_recording(capture))
    golden = GOLDEN / f"{Path(capture).stem}.txt"
    if os.environ.get("HYPERAGENT_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), "rerun with HYPERAGENT_UPDATE_GOLDEN=1 to accept"


@pytest.mark.parametrize("capture", sorted(TARGETS))
async def test_every_metric_has_help_and_one_label_set(capture: str) -> None:
    readings = await read_recording(capture)
    label_sets: dict[str, set[tuple[str, ...]]] = {}
    for r in readings:
        assert r.name in HELP
        assert (r.kind is Kind.COUNTER) == r.name.endswith("_total")
        label_sets.setdefault(r.name, set()).add(tuple(sorted(r.labels)))
    assert all(len(keys) == 1 for keys in label_sets.values()), label_sets
    series = [(r.name, tuple(sorted(r.labels.items()))) for r in readings]
    assert len(series) == len(set(series))


def values(readings: Sequence[Reading], name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(v for k, v in sorted(r.labels.items()) if k != "pdu"): r.value
        for r in readings
        if r.name == name
    }


async def test_apc_units_are_converted_from_the_recorded_raw_values() -> None:
    readings = await read_recording("apc-8641.snmprec")
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
    assert values(readings, "hyperagent_pdu_node_power_watts") == {(): 71 + 96}
    assert values(readings, "hyperagent_pdu_node_energy_joules_total") == {
        (): (1346 + 1848) * 360_000
    }
    (info,) = [r for r in readings if r.name == "hyperagent_pdu_info"]
    assert info.labels["model"] == "AP8641" and info.labels["serial"] == "3F3452A52295"


async def test_apc_switched_pdu_reports_only_what_it_measures() -> None:
    readings = await read_recording("apc-7902b.snmprec")
    # AP7902B: phase current 16 (tenths of A); power, voltage and energy are -1 (not measured)
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {("1", "1"): 1.6}
    assert {r.name for r in readings} == {
        "hyperagent_pdu_info",
        "hyperagent_pdu_phase_current_amperes",
    }


async def test_raritan_values_use_the_sensor_decimal_digits() -> None:
    readings = await read_recording("raritan-px2.snmpwalk")
    # inlet rmsCurrent 1626 with 3 decimal digits; activeEnergy 1444088 Wh
    assert values(readings, "hyperagent_pdu_inlet_current_amperes") == {("1",): 1.626}
    assert values(readings, "hyperagent_pdu_inlet_voltage_volts") == {("1",): 233.0}
    assert values(readings, "hyperagent_pdu_inlet_power_watts") == {("1",): 242.0}
    assert values(readings, "hyperagent_pdu_inlet_energy_joules_total") == {
        ("1",): 1444088 * 3600.0
    }
    assert values(readings, "hyperagent_pdu_outlet_current_amperes")[("2",)] == 0.303
    assert values(readings, "hyperagent_pdu_outlet_power_watts")[("2",)] == 56
    assert values(readings, "hyperagent_pdu_node_power_watts") == {(): 7 + 56}


async def test_servertech_cord_lines_and_phases() -> None:
    readings = await read_recording("sentry4.snmprec")
    # st4InputCordActivePower 1701 W, st4InputCordEnergy 8937 tenths of kWh
    assert values(readings, "hyperagent_pdu_inlet_power_watts") == {("AA",): 1701.0}
    assert values(readings, "hyperagent_pdu_inlet_energy_joules_total") == {
        ("AA",): 8937 * 360_000.0
    }
    # st4LineCurrent in hundredths of A; st4PhaseVoltage in tenths of V
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {
        ("AA", "L1"): 5.6,
        ("AA", "L2"): 3.69,
        ("AA", "L3"): 5.6,
    }
    assert values(readings, "hyperagent_pdu_phase_voltage_volts")[("AA", "L1-L2")] == 207.9
    assert sum(values(readings, "hyperagent_pdu_phase_power_watts").values()) == 415 + 444 + 848


async def test_entity_sensor_fallback_reads_scaled_sensors() -> None:
    readings = await read_recording("westermo-entity-sensor.snmpwalk")
    # one celsius(8) sensor, scale units(9), precision 0, value 50; truthvalue sensors ignored
    assert values(readings, "hyperagent_pdu_sensor_temperature_celsius") == {
        ("Anonymized 176",): 50.0
    }


def test_vendor_is_detected_from_sys_object_id() -> None:
    assert detect_vendor("1.3.6.1.4.1.318.1.3.4.6") == "apc"
    assert detect_vendor("1.3.6.1.4.1.13742.6") == "raritan"
    assert detect_vendor("1.3.6.1.4.1.1718.4") == "servertech"
    assert detect_vendor("1.3.6.1.4.1.534.6.6.7") == "eaton"
    assert detect_vendor("1.3.6.1.4.1.1718.3") == "entity"  # Sentry3: not this profile
    assert detect_vendor(Missing.NO_SUCH_OBJECT) == "entity"
    assert detect_vendor("not an oid") == "entity"


def test_unknown_vendor_is_refused_at_configuration() -> None:
    with pytest.raises(ValueError, match="unknown PDU vendor 'cyberpower'"):
        PduTarget("p", "h", vendor="cyberpower")


def test_garbage_values_are_skipped() -> None:
    device, phase, outlet = APC_DEVICE_STATUS, APC_PHASE_STATUS, APC_OUTLET_METERED_STATUS
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
    readings = parse_apc(binds, "p")
    assert {(r.name, tuple(r.labels.values())): r.value for r in readings} == {
        ("hyperagent_pdu_info", ("p", "apc", "", "", "", "")): 1.0,
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
        await PduSource(PduTarget("g", "replay"), SnmprecClient(garbage)).read()
    with pytest.raises(SourceUnavailable, match="no recorded SNMP walk"):
        await PduSource(PduTarget("m", "replay"), SnmprecClient(tmp_path / "m.snmprec")).read()


async def test_walk_without_pdu_tables_is_an_error(tmp_path: Path) -> None:
    recording = tmp_path / "switch.snmprec"
    recording.write_text("1.3.6.1.2.1.1.2.0|6|1.3.6.1.4.1.9.1.1\n1.3.6.1.2.1.1.5.0|4|sw1\n")
    with pytest.raises(SourceError, match="no entity power measurements"):
        await PduSource(PduTarget("sw1", "replay"), SnmprecClient(recording)).read()


def test_eaton_units_from_the_mib() -> None:
    """Unit handling of EATON-EPDU-MIB on hand-written values (no real Eaton walk is stored)."""
    binds: list[VarBind] = [
        (f"{EATON}.1.2.1.3.0", b"EMAB03"),
        (f"{EATON}.3.2.1.2.0.1.1", 2),  # phase1toN
        (f"{EATON}.3.2.1.3.0.1.1", 230_500),  # mV
        (f"{EATON}.3.3.1.2.0.1.1", 3),  # phase1
        (f"{EATON}.3.3.1.4.0.1.1", 4_250),  # mA
        (f"{EATON}.3.4.1.2.0.1.1", 1),  # phase1
        (f"{EATON}.3.4.1.4.0.1.1", 900),
        (f"{EATON}.3.4.1.2.0.1.4", 4),  # total
        (f"{EATON}.3.4.1.4.0.1.4", 2_700),
        (f"{EATON}.3.4.1.5.0.1.4", 1_000),  # Wh
        (f"{EATON}.6.1.1.2.0.3", b"A3"),
        (f"{EATON}.6.1.1.3.0.3", b"gpu-node-7"),
        (f"{EATON}.6.5.1.3.0.3", 450),
        (f"{EATON}.6.5.1.4.0.3", 12),
        (f"{EATON}.6.4.1.3.1.2", 1_500),  # second unit of a strapped chain
    ]
    readings = parse_eaton(binds, "e")
    assert values(readings, "hyperagent_pdu_phase_voltage_volts") == {("1", "L1-N"): 230.5}
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {("1", "L1"): 4.25}
    assert values(readings, "hyperagent_pdu_phase_power_watts") == {("1", "L1"): 900.0}
    assert values(readings, "hyperagent_pdu_inlet_power_watts") == {("1",): 2700.0}
    assert values(readings, "hyperagent_pdu_inlet_energy_joules_total") == {("1",): 3.6e6}
    assert values(readings, "hyperagent_pdu_outlet_power_watts") == {("A3",): 450.0}
    assert values(readings, "hyperagent_pdu_outlet_energy_joules_total") == {("A3",): 43_200.0}
    assert values(readings, "hyperagent_pdu_outlet_current_amperes") == {("1:2",): 1.5}
    assert node_readings(readings, "e", ["gpu-node-7"])[0].value == 450


def test_raritan_inlet_poles_from_the_mib() -> None:
    """Three-phase inlet poles (absent from the stored single-phase walk), hand-written."""
    binds: list[VarBind] = [
        (f"{RARITAN}.3.3.4.1.7.1.1.1", 3),  # rmsCurrent: 3 decimal digits
        *((f"{RARITAN}.5.2.4.1.3.1.1.{pole}.1", 4) for pole in (1, 2, 3)),
        *((f"{RARITAN}.5.2.4.1.4.1.1.{pole}.1", 1000 * pole) for pole in (1, 2, 3)),
        (f"{RARITAN}.5.2.4.1.3.1.1.3.4", -1),  # unavailable
        (f"{RARITAN}.5.2.4.1.4.1.1.3.4", 231),
    ]
    readings = parse_raritan(binds, "r")
    assert values(readings, "hyperagent_pdu_phase_current_amperes") == {
        ("1", "L1"): 1.0,
        ("1", "L2"): 2.0,
        ("1", "L3"): 3.0,
    }
    assert not values(readings, "hyperagent_pdu_phase_voltage_volts")


async def test_node_totals_need_every_configured_outlet() -> None:
    readings = await read_recording("apc-8641.snmprec")
    assert not node_readings(readings, "apc-8641", ["5", "99"])
    by_name = node_readings(readings, "apc-8641", ["SRV-OPSHOST12", "SRV-OPSHOST11"])
    assert [r.value for r in by_name] == [71 + 96, (1346 + 1848) * 360_000]
    apc_8932 = await read_recording("apc-8932.snmprec")  # metered at the inlet only
    assert not node_readings(apc_8932, "apc-8932", ["1"])


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
    source = PduSource(PduTarget("slow", "h", vendor="apc"), client)
    first = asyncio.create_task(source.read())
    await asyncio.sleep(0.01)
    with pytest.raises(SourceError, match="previous SNMP read still running"):
        await source.read()
    client.release.set()
    with pytest.raises(SourceError, match="no apc power measurements"):
        await first


async def test_replay_directory_builds_one_source_per_recording() -> None:
    replay = FIXTURES / "replay" / "apc-ap8641-pdu" / "pdu"
    sources = pdu_sources([], replay_dir=replay)
    assert [(s.name, s.target) for s in sources] == [("pdu", "rack01-pdu")]
    configured = pdu_sources(
        [PduTarget("rack01-pdu", "10.0.0.5", outlets=("5",))], replay_dir=replay
    )
    readings = await configured[0].read()
    assert values(readings, "hyperagent_pdu_node_power_watts") == {(): 71.0}
    (missing,) = pdu_sources([PduTarget("rack02-pdu", "10.0.0.6")], replay_dir=replay)
    with pytest.raises(SourceUnavailable):
        await missing.read()


# -- Against a real SNMP agent: snmpsim serving the same recordings on loopback ---------------


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def answers(port: int, community: str) -> bool:
    client = PysnmpClient("127.0.0.1", port, community, timeout_s=0.3, retries=0)
    try:
        await client.get([SYS_OBJECT_ID])
        return True
    except SourceTimeout:
        return False
    finally:
        await client.close()


class Snmpsim:
    """snmpsim-command-responder serving the stored recordings on a loopback UDP port."""

    def __init__(self, workdir: Path) -> None:
        binary = Path(sys.executable).parent / "snmpsim-command-responder"
        if not binary.exists():
            pytest.fail("snmpsim is not installed: pip install -e '.[test]' (bash .ci/run does)")
        self.data = workdir / "data"
        self.data.mkdir()
        for capture in TARGETS:
            shutil.copy(CAPTURES / capture, self.data / capture)
        self.port = free_udp_port()
        self.log = workdir / "snmpsim.log"
        self.command = [
            str(binary),
            f"--data-dir={self.data}",
            f"--cache-dir={workdir / 'cache'}",
            f"--agent-udpv4-endpoint=127.0.0.1:{self.port}",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        self.log_file = self.log.open("ab")
        self.process = subprocess.Popen(
            self.command,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SNMPSIM_ALLOW_ROOT": "true"},
        )
        deadline = time.monotonic() + timeout_s
        while not asyncio.run(answers(self.port, "apc-8641")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"snmpsim did not answer on 127.0.0.1:{self.port}: {self.log}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None
            self.log_file.close()


@pytest.fixture(scope="module")
def snmpsim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Snmpsim]:
    agent = Snmpsim(tmp_path_factory.mktemp("snmpsim"))
    agent.start()
    yield agent
    agent.stop()


def live_client(agent: Snmpsim, capture: str) -> PysnmpClient:
    """A client of the simulated PDU; snmpsim spends about 1 ms per object returned, so small
    GETBULK pages keep these tests fast (real PDUs are better served by the default)."""
    community = Path(capture).stem
    return PysnmpClient("127.0.0.1", agent.port, community, 2.0, retries=1, max_repetitions=10)


class Transcript:
    """Passes requests to an SNMP client and keeps each request with its answer."""

    def __init__(self, client: SnmpClient) -> None:
        self.client = client
        self.gets: list[tuple[list[str], list[VarBind]]] = []
        self.walks: list[tuple[str, list[VarBind]]] = []

    async def open(self) -> None:
        await self.client.open()

    async def get(self, oids: Sequence[str]) -> list[VarBind]:
        answer = await self.client.get(oids)
        self.gets.append((list(oids), list(answer)))
        return answer

    async def walk(self, oid: str) -> list[VarBind]:
        answer = await self.client.walk(oid)
        self.walks.append((oid, list(answer)))
        return answer

    async def close(self) -> None:
        await self.client.close()


@pytest.mark.peer
@pytest.mark.parametrize("capture", sorted(TARGETS))
async def test_snmpsim_serves_the_same_walks_and_readings(snmpsim: Snmpsim, capture: str) -> None:
    live = Transcript(live_client(snmpsim, capture))
    source = PduSource(TARGETS[capture], live)
    try:
        await source.start()
        readings = await source.read()
    finally:
        await source.close()
    assert render(readings) == render(await read_recording(capture))
    recorded = SnmprecClient(CAPTURES / capture)
    assert source.vendor is not None
    assert [oid for oid, _ in live.walks] == list(PROFILES[source.vendor].columns)
    for oids, answer in live.gets:
        assert answer == await recorded.get(oids)
    for oid, answer in live.walks:
        assert answer == await recorded.walk(oid), oid


@pytest.mark.peer
async def test_snmp_timeout_is_a_source_error_within_the_bound() -> None:
    # pysnmp's defaults would wait 1 s x 6 tries; the configured bound is 0.5 s x 2 tries
    client = PysnmpClient("127.0.0.1", free_udp_port(), "public", timeout_s=0.5, retries=1)
    source = PduSource(PduTarget("dead", "127.0.0.1"), client)
    await source.start()
    began = time.monotonic()
    with pytest.raises(SourceTimeout, match=r"no response to GET .* within 0.5s x 2 tries"):
        await source.read()
    assert time.monotonic() - began < 3.0
    await source.close()


@pytest.mark.peer
async def test_a_dead_pdu_does_not_hide_the_others(snmpsim: Snmpsim) -> None:
    good = PduSource(TARGETS["apc-8641.snmprec"], live_client(snmpsim, "apc-8641.snmprec"))
    dead_client = PysnmpClient("127.0.0.1", free_udp_port(), "public", 0.3, retries=0)
    dead = PduSource(PduTarget("rack02-pdu", "127.0.0.1"), dead_client)
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

"""The IPMI source: parsers on real BMC captures (golden files), both backends against a real
ipmi_sim BMC on 127.0.0.1, and replay of a capture directory."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from hyperagent.errors import SourceError, SourceTimeout, SourceUnavailable
from hyperagent.readings import Reading
from hyperagent.sources.ipmi import (
    HELP,
    NODE_POWER,
    POWER,
    SENSOR_STATE,
    IpmiError,
    IpmiSource,
    IpmitoolBackend,
    RmcpBackend,
    SensorSample,
    SensorValue,
    node_power,
    parse_dcmi_power,
    parse_ipmiutil_sensor,
    parse_sdr,
    parse_sdr_elist,
    parse_sdr_output,
    read_password_file,
    sample_value,
)
from hyperagent.sources.ipmi_capture import capture_runner
from hyperagent.sources.runner import SourceRunner

from conftest import FIXTURES, require_binary

pytestmark = pytest.mark.timeout(30)

CAPTURES = FIXTURES / "ipmi"
GOLDEN = Path(__file__).parents[1] / "golden" / "ipmi"
PARSERS: dict[str, Callable[[str], list[Reading]]] = {
    "dell-r620-sdr.txt": parse_sdr,
    "dell-r620-sdr-elist.txt": parse_sdr_elist,
    "dell-r740-sdr.txt": parse_sdr,
    "dell-r740-sdr-elist.txt": parse_sdr_elist,
    "huawei-rh2288v3-sdr-elist.txt": parse_sdr_elist,
    "ibm-imm-sdr.txt": parse_sdr,
    "ipmiutil-sensor-gpu-tray.txt": parse_ipmiutil_sensor,
    "dcmi-power-reading.txt": parse_dcmi_power,
}
IPMITOOL_SDR = [name for name, parse in PARSERS.items() if parse in (parse_sdr, parse_sdr_elist)]


def capture(name: str) -> str:
    return (CAPTURES / name).read_text()


def render(readings: list[Reading]) -> str:
    lines = []
    for r in readings:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(r.labels.items()))
        lines.append(f"{r.name}{{{labels}}} {r.value!r}")
    return "".join(f"{line}\n" for line in sorted(lines))


def values(readings: list[Reading], name: str) -> dict[tuple[str, str], float]:
    return {(r.labels["sensor"], r.labels["entity"]): r.value for r in readings if r.name == name}


def test_every_capture_is_parsed() -> None:
    assert sorted(p.name for p in CAPTURES.glob("*.txt")) == sorted(PARSERS)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_capture_matches_golden(name: str) -> None:
    readings = PARSERS[name](capture(name))
    text = render(readings)
    golden = GOLDEN / f"{Path(name).stem}.txt"
    if os.environ.get("HYPERAGENT_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), "rerun with HYPERAGENT_UPDATE_GOLDEN=1 to accept"
    assert readings
    keys: dict[str, set[str]] = {}
    for r in readings:
        assert r.name in HELP
        assert keys.setdefault(r.name, set(r.labels)) == set(r.labels)
    assert len(text.splitlines()) == len(readings), "two readings share a name and labels"


@pytest.mark.parametrize("name", IPMITOOL_SDR)
def test_sdr_output_tells_the_formats_apart(name: str) -> None:
    assert parse_sdr_output(capture(name)) == PARSERS[name](capture(name))


def test_dell_r740_elist_values() -> None:
    readings = parse_sdr_elist(capture("dell-r740-sdr-elist.txt"))
    assert values(readings, POWER) == {("Pwr Consumption", "7.1"): 208}
    temperatures = values(readings, "hyperagent_bmc_temperature_celsius")
    assert temperatures[("Temp", "3.1")] == 34  # two CPUs, both named "Temp"
    assert temperatures[("Temp", "3.2")] == 45
    assert temperatures[("Inlet Temp", "7.1")] == 23
    assert values(readings, "hyperagent_bmc_current_amperes")[("Current 2", "10.2")] == 0.2
    assert values(readings, "hyperagent_bmc_fan_speed_rpm")[("Fan5", "7.1")] == 3840
    states = values(readings, SENSOR_STATE)
    assert states[("PS Redundancy", "7.1")] == 0  # a discrete sensor: "Fully Redundant"
    assert ("GPU1 Temp", "7.1") not in states  # ns, Disabled
    assert ("SEL", "0.1") not in states  # ns, No Reading
    assert ("CPU Usage", "7.1") in states  # read in percent: a state, no value
    assert set(states.values()) == {0}


def test_huawei_power_sensors_and_unreadable_ones() -> None:
    readings = parse_sdr_elist(capture("huawei-rh2288v3-sdr-elist.txt"))
    assert values(readings, POWER) == {
        ("Power", "7.96"): 36,
        ("Power1", "10.96"): 18,
        ("Power2", "10.97"): 18,
    }
    assert ("PCH Temp", "7.96") not in values(readings, SENSOR_STATE)
    assert values(readings, SENSOR_STATE)[("DISK24", "4.120")] == 0  # instance above 99


def test_plain_sdr_keeps_the_first_of_two_sensors_with_one_name() -> None:
    readings = parse_sdr(capture("dell-r620-sdr.txt"))
    temperatures = values(readings, "hyperagent_bmc_temperature_celsius")
    assert temperatures[("Temp", "")] == 47
    assert len([k for k in temperatures if k[0] == "Temp"]) == 1
    assert values(readings, POWER) == {("Pwr Consumption", ""): 98}
    assert values(readings, "hyperagent_bmc_voltage_volts") == {("Voltage 1", ""): 220}


@pytest.mark.parametrize("box", ["dell-r620", "dell-r740"])
def test_plain_and_extended_lists_find_the_same_sensors(box: str) -> None:
    elist = parse_sdr_elist(capture(f"{box}-sdr-elist.txt"))
    plain = parse_sdr(capture(f"{box}-sdr.txt"))

    names = [line.split("|")[0].strip() for line in capture(f"{box}-sdr-elist.txt").splitlines()]
    unique = {name for name in names if names.count(name) == 1}

    def sensors(readings: list[Reading]) -> set[tuple[str, str]]:
        return {(r.name, r.labels["sensor"]) for r in readings if r.labels["sensor"] in unique}

    assert sensors(elist) == sensors(plain)
    assert len(sensors(plain)) > 40


def test_ibm_values_and_units_left_out() -> None:
    readings = parse_sdr(capture("ibm-imm-sdr.txt"))
    assert values(readings, POWER) == {("Avg Power", ""): 210}
    assert values(readings, "hyperagent_bmc_voltage_volts")[("Planar 3.3V", "")] == 3.29
    assert values(readings, SENSOR_STATE)[("Altitude", "")] == 0  # 80 feet: no metric for feet
    assert ("DASD Backplane 3", "") not in values(readings, SENSOR_STATE)  # Not Readable


def test_ipmiutil_gpu_tray() -> None:
    readings = parse_ipmiutil_sensor(capture("ipmiutil-sensor-gpu-tray.txt"))
    power = values(readings, POWER)
    assert power[("HSC_PWR_SUM", "")] == 1342
    assert power[("GPU_PWR_SUM", "")] == 880
    assert values(readings, "hyperagent_bmc_fan_speed_rpm")[("FAN_0A", "")] == 21904
    assert ("FANS_SWB_PWM", "") not in values(readings, "hyperagent_bmc_fan_speed_rpm")  # 66 %
    states = values(readings, SENSOR_STATE)
    assert states[("FANS_SWB_PWM", "")] == 0


def test_ipmiutil_discrete_sensors_report_their_state() -> None:
    """The tray's discrete sensors: ipmiutil words their asserted state ("Working"; "_" for
    none) where a threshold sensor says OK; each is a readable sensor in state 0, as ipmitool's
    "ok" and the RMCP+ backend report discrete sensors. Every sensor of the capture has one."""
    text = capture("ipmiutil-sensor-gpu-tray.txt")
    states = values(parse_ipmiutil_sensor(text), SENSOR_STATE)
    discrete = ["Power_Status", "SoC_0_SOCHOT", "SoC_ThermalTrip", "Subsystem_Health"]
    assert {name: states.get((name, "")) for name in [*discrete, "BMC_Health"]} == {
        name: 0 for name in [*discrete, "BMC_Health"]
    }
    rows = [line.split("|") for line in text.splitlines() if line.count("|") == 6]
    sensors = {row[4].strip() for row in rows if row[0].strip() != "ID"}
    assert len(sensors) == 108 and {name for name, _ in states} == sensors


def test_dcmi_power_reading() -> None:
    readings = {r.name: r.value for r in parse_dcmi_power(capture("dcmi-power-reading.txt"))}
    assert readings == {
        "hyperagent_bmc_dcmi_power_watts": 167,
        "hyperagent_bmc_dcmi_power_min_watts": 124,
        "hyperagent_bmc_dcmi_power_max_watts": 422,
        "hyperagent_bmc_dcmi_power_average_watts": 156,
        "hyperagent_bmc_dcmi_sampling_period_seconds": 699043,
    }


def test_dcmi_deactivated_reads_nothing() -> None:
    text = capture("dcmi-power-reading.txt").replace("activated", "deactivated")
    assert parse_dcmi_power(text) == []


def test_threshold_status_and_units() -> None:
    text = (
        "Inlet Temp       | 04h | unc |  7.1 | 45 degrees C\n"
        "Ambient          | 05h | lcr |  7.1 | 23 degrees F\n"
        "PSU Temp         | 06h | unr | 10.1 | 400 degrees K\n"
        "PSU1             | 07h | ok  | 10.1 | 0 Watts, Presence detected, Failure detected\n"
    )
    readings = parse_sdr_elist(text)
    assert values(readings, SENSOR_STATE) == {
        ("Inlet Temp", "7.1"): 1,
        ("Ambient", "7.1"): 2,
        ("PSU Temp", "10.1"): 3,
        ("PSU1", "10.1"): 0,
    }
    temperatures = values(readings, "hyperagent_bmc_temperature_celsius")
    assert temperatures[("Ambient", "7.1")] == pytest.approx(-5)
    assert temperatures[("PSU Temp", "10.1")] == pytest.approx(126.85)
    assert values(readings, POWER) == {("PSU1", "10.1"): 0}


@pytest.mark.parametrize(
    "parse", [parse_sdr_elist, parse_sdr, parse_sdr_output, parse_ipmiutil_sensor, parse_dcmi_power]
)
@pytest.mark.parametrize(
    "garbage",
    [
        "Error: Unable to establish IPMI v2 / RMCP+ session\n",
        "\x00\xff\x8b garbage \x01\n",
        "a | b | c | d\n",
    ],
)
def test_garbage_raises_source_error(parse: Callable[[str], list[Reading]], garbage: str) -> None:
    with pytest.raises(SourceError):
        parse(garbage)


def test_bad_fields_are_skipped() -> None:
    text = (
        "CPU Temp         | 01h | ok  |  3.1 | 64 degrees C\n"
        "Broken status    | 02h | zz  |  3.1 | 64 degrees C\n"
        "Broken entity    | 03h | ok  |  x.y | 64 degrees C\n"
        "Broken value     | 04h | ok  |  7.1 | abc Watts\n"
        "truncated line | 05h\n"
        "                 | 06h | ok  |  7.1 | 1 Watts\n"
    )
    readings = parse_sdr_elist(text)
    assert render(readings) == (
        'hyperagent_bmc_sensor_state{entity="3.1",sensor="CPU Temp"} 0.0\n'
        'hyperagent_bmc_sensor_state{entity="7.1",sensor="Broken value"} 0.0\n'
        'hyperagent_bmc_temperature_celsius{entity="3.1",sensor="CPU Temp"} 64.0\n'
    )
    dcmi = parse_dcmi_power("Instantaneous power reading: 90 Watts\nSampling period: soon\n")
    assert [(r.name, r.value) for r in dcmi] == [("hyperagent_bmc_dcmi_power_watts", 90)]


def simulator_sdr_records() -> dict[str, Any]:
    """The SDR records fixtures/ipmi_sim/node.emu gives the simulator, decoded by python-ipmi."""
    from pyipmi.sdr import SdrCommon

    text = (FIXTURES / "ipmi_sim" / "node.emu").read_text().replace("\\\n", " ")
    records = {}
    for line in text.splitlines():
        if line.startswith("main_sdr_add"):
            record = SdrCommon.from_data(bytes(int(b, 16) for b in line.split()[2:]))
            records[record.device_id_string] = record
    return records


def test_sensor_samples_from_sdr_records() -> None:
    records = simulator_sdr_records()
    cpu, volts, status = records["CPU Temp"], records["12V Rail"], records["PSU1 Status"]

    def sample(record: Any, raw: int, states: int = 0, **flags: bool) -> SensorSample:
        settings = {"scanning_enabled": True, "unavailable": False, **flags}
        return SensorSample(record, raw, states=states, **settings)

    assert sample_value(sample(cpu, 64)) == SensorValue(
        "CPU Temp", "3.1", 0, "hyperagent_bmc_temperature_celsius", 64
    )
    assert sample_value(sample(volts, 201)) == SensorValue(
        "12V Rail", "7.1", 0, "hyperagent_bmc_voltage_volts", 12.06
    )
    severity = {s: sample_value(sample(cpu, 150, s)).severity for s in (0x01, 0x02, 0x18, 0x38)}
    assert severity == {0x01: 1, 0x02: 2, 0x18: 2, 0x38: 3}  # lnc, lcr, unc+ucr, unc+ucr+unr
    assert sample_value(sample(status, 0, 0x01)) == SensorValue("PSU1 Status", "10.1", 0)
    assert sample_value(sample(cpu, 64, scanning_enabled=False)) is None
    assert sample_value(sample(cpu, 64, unavailable=True)) is None
    cpu.units_2 = 2  # the same sensor reporting degrees F
    assert sample_value(sample(cpu, 212)).value == pytest.approx(100)


def test_empty_output_has_no_readings() -> None:
    assert parse_sdr_output("") == []
    assert parse_sdr_elist("\n") == []


async def test_replay_directory() -> None:
    replay = FIXTURES / "replay" / "dell-r740-idrac9"
    source = IpmiSource(IpmitoolBackend(capture_runner(replay), target=replay.name))
    await source.start()
    readings = await source.read()
    await source.close()
    assert source.name == "ipmi" and source.target == "dell-r740-idrac9"
    sensors = parse_sdr_elist(capture("dell-r740-sdr-elist.txt"))
    assert readings == [*sensors, Reading(NODE_POWER, 208.0, {"sensor": "Pwr Consumption"})]


async def test_replay_directory_with_dcmi(tmp_path: Path) -> None:
    shutil.copy(CAPTURES / "dell-r740-sdr-elist.txt", tmp_path / "ipmitool-sdr.txt")
    shutil.copy(CAPTURES / "dcmi-power-reading.txt", tmp_path / "ipmitool-dcmi.txt")
    readings = await IpmitoolBackend(capture_runner(tmp_path)).read()
    assert readings == [
        *parse_sdr_elist(capture("dell-r740-sdr-elist.txt")),
        *parse_dcmi_power(capture("dcmi-power-reading.txt")),
    ]


async def test_replay_directory_without_captures(tmp_path: Path) -> None:
    with pytest.raises(SourceUnavailable):
        await IpmiSource(IpmitoolBackend(capture_runner(tmp_path))).read()


async def test_ipmitool_not_installed() -> None:
    with pytest.raises(SourceUnavailable):
        await IpmitoolBackend(binary="/nonexistent/ipmitool").read()


@pytest.mark.skipif(
    any(Path(p).exists() for p in ("/dev/ipmi0", "/dev/ipmi/0", "/dev/ipmidev/0")),
    reason="this machine has a local BMC device",
)
async def test_local_bmc_absent_is_unavailable() -> None:
    require_binary("ipmitool", "ipmitool")
    with pytest.raises(SourceUnavailable):
        await IpmitoolBackend(interface="open").read()


def test_invalid_settings_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="needs a host"):
        IpmitoolBackend(interface="lanplus")
    with pytest.raises(ValueError, match="interface"):
        IpmitoolBackend(interface="serial")
    with pytest.raises(ValueError, match="privilege"):
        RmcpBackend("127.0.0.1", privilege="root")
    with pytest.raises(ValueError, match="timeout"):
        RmcpBackend("127.0.0.1", timeout_s=0)
    with pytest.raises(ValueError, match="timeout"):
        IpmitoolBackend(timeout_s=-1)


def test_password_file(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    assert read_password_file(tmp_path / "pw") == "s3cret"


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ASF_PING = bytes([0x06, 0x00, 0xFF, 0x06, 0x00, 0x00, 0x11, 0xBE, 0x80, 0x00, 0x00, 0x00])


class SimulatedBmc:
    """OpenIPMI's ipmi_sim on a loopback UDP port, with fixtures/ipmi_sim's sensors."""

    def __init__(self, workdir: Path) -> None:
        self.binary = require_binary("ipmi_sim", "openipmi")
        self.port = free_udp_port()
        self.power_file = workdir / "power"
        self.set_power_raw(50)
        self.password_file = workdir / "password"
        self.password_file.write_text("test\n")
        self.lan_conf = workdir / "lan.conf"
        self.lan_conf.write_text(
            (FIXTURES / "ipmi_sim" / "lan.conf").read_text().replace("@PORT@", str(self.port))
        )
        self.node_emu = workdir / "node.emu"
        self.node_emu.write_text(
            (FIXTURES / "ipmi_sim" / "node.emu")
            .read_text()
            .replace("@POWER_FILE@", str(self.power_file))
        )
        self.state = workdir / "state"
        self.state.mkdir()
        self.log = workdir / "ipmi_sim.log"
        self.process: subprocess.Popen[bytes] | None = None

    def set_power_raw(self, raw: int) -> None:
        """The power sensor reads raw x 4 W; the simulator polls the file every second."""
        self.power_file.write_text(f"{raw}\n")

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "-c", self.lan_conf, "-f", self.node_emu, "-s", self.state, "-n"],
            stdin=subprocess.DEVNULL,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.1)
            while time.monotonic() < deadline:
                assert self.process.poll() is None, self.log.read_text()
                s.sendto(ASF_PING, ("127.0.0.1", self.port))
                try:
                    s.recv(64)
                    return
                except OSError:
                    continue
        raise TimeoutError(f"ipmi_sim on UDP {self.port} did not answer: {self.log.read_text()}")

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.resume()
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def rmcp(self, **options: object) -> RmcpBackend:
        settings: dict[str, object] = {
            "port": self.port,
            "username": "ipmiusr",
            "password": "test",
            "cipher_suite": 3,
            "timeout_s": 2.0,
            **options,
        }
        return RmcpBackend("127.0.0.1", **settings)  # type: ignore[arg-type]

    def ipmitool(self, **options: object) -> IpmitoolBackend:
        settings: dict[str, object] = {
            "interface": "lanplus",
            "host": "127.0.0.1",
            "port": self.port,
            "username": "ipmiusr",
            "password_file": self.password_file,
            "cipher_suite": 3,
            "timeout_s": 5.0,
            **options,
        }
        return IpmitoolBackend(**settings)  # type: ignore[arg-type]


@pytest.fixture
def bmc(tmp_path: Path) -> Iterator[SimulatedBmc]:
    simulator = SimulatedBmc(tmp_path)
    simulator.start()
    yield simulator
    simulator.stop()


SIMULATED = (
    'hyperagent_bmc_current_amperes{entity="10.1",sensor="PSU1 Current"} 1.5\n'
    'hyperagent_bmc_fan_speed_rpm{entity="29.1",sensor="Fan1 RPM"} 3000.0\n'
    'hyperagent_bmc_power_watts{entity="7.1",sensor="Pwr Consumption"} 200.0\n'
    'hyperagent_bmc_sensor_state{entity="10.1",sensor="PSU1 Current"} 0.0\n'
    'hyperagent_bmc_sensor_state{entity="10.1",sensor="PSU1 Status"} 0.0\n'
    'hyperagent_bmc_sensor_state{entity="29.1",sensor="Fan1 RPM"} 0.0\n'
    'hyperagent_bmc_sensor_state{entity="3.1",sensor="CPU Temp"} 0.0\n'
    'hyperagent_bmc_sensor_state{entity="7.1",sensor="12V Rail"} 0.0\n'
    'hyperagent_bmc_sensor_state{entity="7.1",sensor="Inlet Temp"} 1.0\n'
    'hyperagent_bmc_sensor_state{entity="7.1",sensor="Pwr Consumption"} 0.0\n'
    'hyperagent_bmc_temperature_celsius{entity="3.1",sensor="CPU Temp"} 64.0\n'
    'hyperagent_bmc_temperature_celsius{entity="7.1",sensor="Inlet Temp"} 45.0\n'
    'hyperagent_bmc_voltage_volts{entity="7.1",sensor="12V Rail"} 12.06\n'
)
"""What fixtures/ipmi_sim/node.emu serves; GPU Temp (scanning disabled) is left out."""


async def power_watts(backend: RmcpBackend | IpmitoolBackend) -> float:
    return values(await backend.read(), POWER)[("Pwr Consumption", "7.1")]


async def wait_for_power(backend: RmcpBackend | IpmitoolBackend, watts: float) -> None:
    async with asyncio.timeout(6):
        while await power_watts(backend) != watts:
            await asyncio.sleep(0.2)


@pytest.mark.peer
@pytest.mark.parametrize(
    "options",
    [
        {"interface": "lanplus", "cipher_suite": 3},
        {"interface": "lanplus", "cipher_suite": None},
        {"interface": "lan"},
    ],
    ids=["lanplus-cipher-3", "lanplus-default-ciphers", "lan"],
)
async def test_rmcp_reads_every_sensor_kind(bmc: SimulatedBmc, options: dict[str, object]) -> None:
    backend = bmc.rmcp(**options)
    try:
        assert render(await backend.read()) == SIMULATED
        assert render(await backend.read()) == SIMULATED
        assert backend.sessions_established == 1
    finally:
        await backend.close()


@pytest.mark.peer
async def test_both_backends_follow_the_power_sensor(bmc: SimulatedBmc) -> None:
    rmcp, ipmitool = bmc.rmcp(), bmc.ipmitool()
    try:
        assert render(await ipmitool.read()) == render(await rmcp.read()) == SIMULATED
        bmc.set_power_raw(75)
        await wait_for_power(rmcp, 300)
        assert await power_watts(ipmitool) == 300
        bmc.set_power_raw(40)
        await wait_for_power(ipmitool, 160)
        assert await power_watts(rmcp) == 160
        assert rmcp.sessions_established == 1
    finally:
        await rmcp.close()


@pytest.mark.peer
@pytest.mark.parametrize("privilege", ["user", "administrator"])
async def test_bmc_without_dcmi_is_read_for_its_sensors(
    bmc: SimulatedBmc, privilege: str, caplog: pytest.LogCaptureFixture
) -> None:
    rmcp, ipmitool = bmc.rmcp(privilege=privilege), bmc.ipmitool(privilege=privilege)
    caplog.set_level(logging.INFO, logger="hyperagent.sources.ipmi")
    try:
        for _ in range(2):
            assert render(await rmcp.read()) == SIMULATED
            assert render(await ipmitool.read()) == SIMULATED
    finally:
        await rmcp.close()
    refusals = [r for r in caplog.records if "DCMI" in r.getMessage()]
    assert len(refusals) == 2, "each backend asks once, then reads SDR only"


@pytest.mark.peer
async def test_wrong_password_is_an_error(bmc: SimulatedBmc, tmp_path: Path) -> None:
    with pytest.raises(IpmiError):
        await bmc.rmcp(password="wrong").read()
    (tmp_path / "wrong").write_text("wrong\n")
    with pytest.raises(SourceError) as error:
        await bmc.ipmitool(password_file=tmp_path / "wrong").read()
    assert not isinstance(error.value, SourceUnavailable)


def ipmitool_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.name() == "ipmitool"]


BOUND_SLACK_S = 4.0
"""What a loaded machine may add to a read bounded by its timeout: the bounds checked here
are far from what an unbounded read would take (ipmitool's own 20 s of retries, a request
timeout of 20 s, or forever on a stuck BMC)."""


async def test_unreachable_bmc_fails_within_the_timeout() -> None:
    port = free_udp_port()
    began = time.monotonic()
    with pytest.raises(SourceError):
        await RmcpBackend("127.0.0.1", port, "ipmiusr", "test", timeout_s=1.0).read()
    assert time.monotonic() - began < 1.0 + BOUND_SLACK_S

    require_binary("ipmitool", "ipmitool")
    backend = IpmitoolBackend(
        interface="lanplus", host="127.0.0.1", port=port, username="u", timeout_s=1.0
    )
    began = time.monotonic()
    with pytest.raises(SourceTimeout):
        await backend.read()  # ipmitool itself would retry for 20 s
    assert time.monotonic() - began < 1.0 + BOUND_SLACK_S
    assert ipmitool_children() == []


@pytest.mark.peer
async def test_stuck_bmc_fails_within_the_timeout_and_is_reconnected(bmc: SimulatedBmc) -> None:
    backend = bmc.rmcp(timeout_s=1.0)
    try:
        assert render(await backend.read()) == SIMULATED
        bmc.pause()
        began = time.monotonic()
        with pytest.raises(SourceError):
            await backend.read()  # the paused BMC would never answer
        assert time.monotonic() - began < 1.0 + BOUND_SLACK_S
        bmc.resume()
        assert render(await backend.read()) == SIMULATED
        assert backend.sessions_established == 2, "the stuck session was replaced"
    finally:
        await backend.close()


@pytest.mark.peer
async def test_read_still_running_is_refused_not_queued(bmc: SimulatedBmc) -> None:
    backend = bmc.rmcp(timeout_s=1.0, request_timeout_s=20.0)
    try:
        assert render(await backend.read()) == SIMULATED
        bmc.pause()
        began = time.monotonic()
        with pytest.raises(SourceTimeout):
            await backend.read()  # not the request's 20 s
        assert time.monotonic() - began < 1.0 + BOUND_SLACK_S
        assert backend.busy, "the worker still waits for the BMC's answer"
        began = time.monotonic()
        with pytest.raises(SourceError, match="still running"):
            await backend.read()
        assert time.monotonic() - began < 1.0, "refused at once, not queued behind the worker"
        bmc.resume()
        async with asyncio.timeout(30):
            while backend.busy:
                await asyncio.sleep(0.05)
        assert render(await backend.read()) == SIMULATED
        assert backend.sessions_established == 2, "the abandoned session was replaced"
    finally:
        await backend.close()


@pytest.mark.peer
async def test_stuck_bmc_under_ipmitool(bmc: SimulatedBmc) -> None:
    source = IpmiSource(bmc.ipmitool(timeout_s=5.0))
    bmc.pause()
    first = asyncio.create_task(source.read(), name="first read")
    async with asyncio.timeout(5):  # until ipmitool runs, waiting for the paused BMC
        while not ipmitool_children():
            await asyncio.sleep(0.02)
    with pytest.raises(SourceError, match="still running"):
        await source.read()
    with pytest.raises(SourceTimeout):
        await first
    assert ipmitool_children() == []
    bmc.resume()
    readings = await source.read()
    assert render([r for r in readings if r.name != NODE_POWER]) == SIMULATED
    assert node_power(readings) == Reading(NODE_POWER, 200.0, {"sensor": "Pwr Consumption"})


@pytest.mark.peer
async def test_runner_reports_the_bmc_as_data(bmc: SimulatedBmc) -> None:
    source = IpmiSource(bmc.rmcp(timeout_s=0.8))
    runner = SourceRunner([source], timeout_s=2.0)
    await runner.start()

    def up(readings: list[Reading]) -> float:
        return next(r.value for r in readings if r.name == "hyperagent_source_up")

    try:
        readings = await runner.read_all()
        assert up(readings) == 1
        assert values(readings, POWER) == {("Pwr Consumption", "7.1"): 200}
        bmc.pause()
        assert up(await runner.read_all()) == 0
        bmc.resume()
        async with asyncio.timeout(5):
            while up(readings := await runner.read_all()) != 1:
                await asyncio.sleep(0.1)
        assert values(readings, POWER) == {("Pwr Consumption", "7.1"): 200}
    finally:
        await runner.close()


@pytest.mark.parametrize(
    ("name", "sensor", "watts"),
    [
        ("dell-r620-sdr.txt", "Pwr Consumption", 98),
        ("dell-r740-sdr-elist.txt", "Pwr Consumption", 208),
        ("huawei-rh2288v3-sdr-elist.txt", "Power", 36),  # beside Power1/Power2 of each supply
        ("ibm-imm-sdr.txt", "Avg Power", 210),
        ("ipmiutil-sensor-gpu-tray.txt", "HSC_PWR_SUM", 1342),  # not GPU_PWR_SUM or one HSC
    ],
)
def test_node_power_is_chosen_by_sensor_name(name: str, sensor: str, watts: float) -> None:
    assert node_power(parse_sdr_output(capture(name))) == Reading(
        NODE_POWER, watts, {"sensor": sensor}
    )


STANDBY_XCC_SDR = """\
Chassis Power    | 450 Watts         | ok
Sys Power        | 20 Watts          | ok
CPU Power        | 0 Watts           | ok
Mem Power        | 0 Watts           | ok
PSU1 IN Power    | 10 Watts          | ok
"""
"""Constructed, not recorded (no capture of a Lenovo XCC under a permissive licence was found):
plain ``ipmitool sdr`` lines with the sensor names and readings that issue 12 reports for a
standby node, the enclosure's "Chassis Power" above the node's own "Sys Power"."""


async def test_standby_node_power_is_the_systems_not_the_chassis(tmp_path: Path) -> None:
    (tmp_path / "ipmitool-sdr.txt").write_text(STANDBY_XCC_SDR)
    source = IpmiSource(IpmitoolBackend(capture_runner(tmp_path)))
    readings = await source.read()
    assert max(r.value for r in readings if r.name == POWER) == 450
    assert [r for r in readings if r.name == NODE_POWER] == [
        Reading(NODE_POWER, 20.0, {"sensor": "Sys Power"})
    ]


def test_without_a_node_power_sensor_there_is_no_node_power() -> None:
    only_parts = "GPU0_PWR0 | 215 Watts | ok\nPSU1 Input | 300 Watts | ok\n"
    assert node_power(parse_sdr(only_parts)) is None


async def test_ipmiutil_sensor_output_in_replay_and_the_ipmitool_backend(tmp_path: Path) -> None:
    """An ``ipmiutil sensor`` capture (GB200-class tray) answers the backend's SDR command."""
    shutil.copy(CAPTURES / "ipmiutil-sensor-gpu-tray.txt", tmp_path / "ipmitool-sdr.txt")
    readings = await IpmitoolBackend(capture_runner(tmp_path)).read()
    assert readings == parse_ipmiutil_sensor(capture("ipmiutil-sensor-gpu-tray.txt"))
    assert values(readings, POWER)[("GPU0_PWR0", "")] == 215


FREEIPMI_DCMI = """\
Current Power                        : 332 Watts
Minimum Power over sampling duration : 68 watts
Maximum Power over sampling duration : 504 watts
Average Power over sampling duration : 348 watts
Time Stamp                           : 11/03/2023 - 08:36:29
Statistics reporting time period     : 1000 milliseconds
Power Measurement                    : Active
"""
"""Written from freeipmi's ``ipmi-dcmi --get-system-power-statistics`` output format (field
names as freeipmi prints them); the values are made up."""


def test_freeipmi_dcmi_output_is_read() -> None:
    assert {r.name: r.value for r in parse_dcmi_power(FREEIPMI_DCMI)} == {
        "hyperagent_bmc_dcmi_power_watts": 332,
        "hyperagent_bmc_dcmi_power_min_watts": 68,
        "hyperagent_bmc_dcmi_power_max_watts": 504,
        "hyperagent_bmc_dcmi_power_average_watts": 348,
        "hyperagent_bmc_dcmi_sampling_period_seconds": 1.0,
    }
    unavailable = FREEIPMI_DCMI.replace(": Active", ": Not Available")
    assert parse_dcmi_power(unavailable) == []


async def test_unreadable_dcmi_output_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shutil.copy(CAPTURES / "dell-r740-sdr-elist.txt", tmp_path / "ipmitool-sdr.txt")
    (tmp_path / "ipmitool-dcmi.txt").write_text("Power Statistics: not what anyone prints\n")
    backend = IpmitoolBackend(capture_runner(tmp_path))
    with caplog.at_level(logging.WARNING, logger="hyperagent.sources.ipmi"):
        for _ in range(3):
            readings = await backend.read()
    assert not [r for r in readings if r.name.startswith("hyperagent_bmc_dcmi")]
    warnings = [r.getMessage() for r in caplog.records if "DCMI" in r.getMessage()]
    assert len(warnings) == 1
    assert "Current Power" in warnings[0] and "not what anyone prints" in warnings[0]

"""`agent --replay DIR` builds the sources a live agent would from the config: PDU targets with
their outlets, host and job where the capture or the config has them, and BMC day files played
as a time series at ``--speed``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hyperagent.capture.directory import capture_sources
from hyperagent.config import build_config
from hyperagent.errors import ConfigError, SourceError
from hyperagent.readings import Reading
from hyperagent.sources.base import Source
from hyperagent.sources.ipmi import NODE_POWER
from hyperagent.sources.ipmi_capture import parse_timestamp, split_day_file
from hyperagent.sources.job import JobSource

from conftest import FIXTURES, ManualClock, free_port, wait_for_port

IPMI = FIXTURES / "ipmi"
PDU_REPLAY = FIXTURES / "replay" / "apc-ap8641-pdu"


def day_file(directory: Path) -> Path:
    """A day file of three real ``ipmitool sdr`` tables a minute apart, each after a
    ``Timestamp:`` line in another of the formats sites log (the tables are of three machines:
    Dell R620 98 W, Dell R740 208 W, IBM IMM 210 W average)."""
    directory.mkdir(parents=True, exist_ok=True)
    tables = [
        ("Tue Dec  1 15:13:01 UTC 2026", IPMI / "dell-r620-sdr.txt"),
        ("2026-12-01T15:14:01+00:00", IPMI / "dell-r740-sdr.txt"),
        (str(1796138101), IPMI / "ibm-imm-sdr.txt"),  # 2026-12-01T15:15:01Z
    ]
    text = "".join(f"Timestamp: {ts}\n{path.read_text().rstrip()}\n" for ts, path in tables)
    path = directory / "ipmitool-sdr.txt"
    path.write_text(text)
    return path


def node_power(readings: list[Reading]) -> tuple[str, float]:
    found = [r for r in readings if r.name == NODE_POWER]
    assert len(found) == 1, found
    return found[0].labels["sensor"], found[0].value


async def read(source: Source) -> list[Reading]:
    await source.start()
    return await source.read()


def test_day_file_timestamps() -> None:
    assert parse_timestamp("Tue Dec  1 15:13:01 UTC 2026") == 1796137981
    assert parse_timestamp("Tue Dec  1 15:13:01 CET 2026") == parse_timestamp("2026-12-01 15:13:01")
    assert parse_timestamp("1796138101.5") == 1796138101.5
    with pytest.raises(ValueError, match="not a timestamp"):
        parse_timestamp("yesterday")
    day = split_day_file("Timestamp: 10\na | 1 Watts | ok\nTimestamp: 70\na | 2 Watts | ok\n")
    assert day is not None and list(day.times) == [10.0, 70.0]
    assert day.tables[1] == "a | 2 Watts | ok\n"
    assert split_day_file("a | 1 Watts | ok\n") is None
    with pytest.raises(SourceError, match=r"sdr.txt:3: timestamp goes back in time"):
        split_day_file("Timestamp: 70\nx\nTimestamp: 10\n", "sdr.txt")
    with pytest.raises(SourceError, match=r"sdr.txt:1: not a timestamp"):
        split_day_file("Timestamp: soon\n", "sdr.txt")


async def test_a_day_file_replays_as_a_time_series_at_speed(tmp_path: Path) -> None:
    day_file(tmp_path)
    clock = ManualClock()
    sources, _ = capture_sources(tmp_path, build_config({}), clock, speed=60.0)
    (bmc,) = sources
    assert node_power(await read(bmc)) == ("Pwr Consumption", 98.0)
    clock.now = 0.99  # 59.4 recorded seconds: still the first table
    assert node_power(await bmc.read()) == ("Pwr Consumption", 98.0)
    clock.now = 1.0
    assert node_power(await bmc.read()) == ("Pwr Consumption", 208.0)
    clock.now = 2.5
    assert node_power(await bmc.read()) == ("Avg Power", 210.0)
    clock.now = 1000.0  # after the last table the replay stays there
    assert node_power(await bmc.read()) == ("Avg Power", 210.0)


async def test_replay_with_pdu_outlets_exposes_the_nodes_wall_power() -> None:
    """The APC AP8641 walk: outlet 3 "CPDXDCVHOST02" draws 81 W and outlet 4 "SERVER01" 125 W
    (rPDU2OutletMeteredStatusPower .3 and .4); configured as this node's, they are its power."""
    config = build_config(
        {
            "sources": {
                "pdu": {
                    "targets": [
                        {"name": "rack01-pdu", "host": "pdu.example", "outlets": ["3", "SERVER01"]}
                    ]
                }
            }
        }
    )
    sources, hardware = capture_sources(PDU_REPLAY, config)
    assert hardware.capture_dir == PDU_REPLAY
    (pdu,) = sources
    readings = await read(pdu)
    await pdu.close()
    node = {r.name: r.value for r in readings if r.name.startswith("hyperagent_pdu_node_")}
    assert node["hyperagent_pdu_node_power_watts"] == 206.0


def test_a_pdu_target_without_a_recording_is_refused_at_start() -> None:
    config = build_config(
        {"sources": {"pdu": {"targets": [{"name": "rack02-pdu", "host": "x", "outlets": ["1"]}]}}}
    )
    with pytest.raises(ConfigError, match=r"rack02-pdu: no rack02-pdu.snmprec .*rack01-pdu"):
        capture_sources(PDU_REPLAY, config)


async def test_replay_without_pdu_targets_reads_every_recorded_pdu() -> None:
    sources, _ = capture_sources(PDU_REPLAY, build_config({}))
    (pdu,) = sources
    readings = await read(pdu)
    await pdu.close()
    assert not [r for r in readings if r.name.startswith("hyperagent_pdu_node_")]
    assert [r for r in readings if r.name == "hyperagent_pdu_outlet_power_watts"]


def test_replay_honours_disabled_sources() -> None:
    config = build_config({"sources": {"pdu": {"enabled": False}}})
    with pytest.raises(ConfigError, match="--replay"):
        capture_sources(PDU_REPLAY, config)


async def test_job_and_host_come_from_the_config_where_the_capture_has_none(
    tmp_path: Path,
) -> None:
    day_file(tmp_path / "capture")
    plain, _ = capture_sources(tmp_path / "capture", build_config({}))
    assert [s.name for s in plain] == ["ipmi"]
    socket = tmp_path / "job.sock"
    config = build_config({"sources": {"job": {"socket": str(socket)}, "host": {}}})
    sources, _ = capture_sources(tmp_path / "capture", config)
    assert [s.name for s in sources] == ["ipmi", "host", "job"]
    job = next(s for s in sources if isinstance(s, JobSource))
    await job.start()
    try:
        assert socket.is_socket()
    finally:
        await job.close()


def copy_procfs(proc: Path) -> int:
    """This machine's ``/proc/stat`` and ``/proc/meminfo`` copied into ``proc``; its MemTotal
    in KiB."""
    proc.mkdir()
    for name in ("stat", "meminfo"):
        (proc / name).write_bytes(Path("/proc", name).read_bytes())
    meminfo = (proc / "meminfo").read_text()
    return int(next(x for x in meminfo.splitlines() if x.startswith("MemTotal:")).split()[1])


async def test_replay_reads_the_captures_procfs(tmp_path: Path) -> None:
    """A capture's ``proc/`` (here this machine's stat and meminfo, copied) is the host."""
    day_file(tmp_path)
    total_kib = copy_procfs(tmp_path / "proc")
    sources, _ = capture_sources(tmp_path, build_config({}))
    host = next(s for s in sources if s.name == "host")
    try:
        readings = await read(host)
    finally:
        await host.close()
    memory = {r.name: r.value for r in readings}["hyperagent_host_memory_total_bytes"]
    assert memory == total_kib * 1024


def test_agent_replays_a_day_file_at_the_speed_asked(tmp_path: Path) -> None:
    """``hyperagent agent --replay DIR --speed 120``: the three tables a minute apart are shown
    within about a second and a half, the last one staying."""
    day_file(tmp_path)
    port = free_port()
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hyperagent.cli",
            "agent",
            "--replay",
            str(tmp_path),
            "--speed",
            "120",
            "--no-broker",
            "--interval",
            "0.2",
            "--metrics-address",
            f"127.0.0.1:{port}",
        ],
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_for_port(port, 30)
        deadline = time.monotonic() + 20
        seen: list[str] = []
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            line = next((x for x in text.splitlines() if x.startswith(NODE_POWER + "{")), "")
            if line and (not seen or seen[-1] != line):
                seen.append(line)
            if 'sensor="Avg Power"' in line:
                break
            time.sleep(0.1)
        assert seen and 'sensor="Avg Power"' in seen[-1] and seen[-1].endswith(" 210.0"), seen
    finally:
        agent.terminate()
        _, err = agent.communicate(timeout=20)
    assert agent.returncode == 0, err.decode()


def test_speed_must_be_positive(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperagent.cli",
            "agent",
            "--replay",
            str(tmp_path),
            "--speed",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "must be a positive number" in result.stderr

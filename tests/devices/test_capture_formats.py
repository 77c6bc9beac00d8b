"""The output formats operators' tools print, as the agent replays them: headerless hl-smi CSV
with units, a file that does not parse as its name says (one line, exit 2), and the other
misreads of recordings from clusters the project's own fixtures do not cover."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from devices.test_vendors import Clock, by_gpu, replayed_readings

from hyperagent.capture import hl_smi
from hyperagent.readings import Reading

from conftest import FIXTURES

GAUDI = FIXTURES / "replay" / "gaudi-hl205-8card"
GAUDI_NOHEADER = FIXTURES / "replay" / "gaudi-hl205-noheader"
SAME_READINGS = (
    "hyperagent_gpu_power_watts",
    "hyperagent_gpu_utilization_ratio",
    "hyperagent_gpu_memory_used_bytes",
    "hyperagent_gpu_memory_total_bytes",
    "hyperagent_gpu_temperature_celsius",
)


def assert_same_per_gpu(left: list[Reading], right: list[Reading], *extra: str) -> None:
    """Each GPU's ``SAME_READINGS`` (and ``extra``) alike in two replays of one node."""
    for name in (*SAME_READINGS, *extra):
        assert by_gpu(left, name) == by_gpu(right, name), name


async def test_headerless_hl_smi_csv_with_units_reads_as_the_headed_one() -> None:
    """``hl-smi -Q ... -f csv,noheader``: every card, its model and its values with their
    units, named by the capture's ``-Q`` field list; the first card is not taken for a
    header."""
    headed = await replayed_readings(GAUDI, Clock())
    plain = await replayed_readings(GAUDI_NOHEADER, Clock())
    assert_same_per_gpu(plain, headed)
    info = {r.labels["gpu"]: r.labels for r in plain if r.name == "hyperagent_gpu_info"}
    assert sorted(info) == [str(i) for i in range(8)]
    assert {labels["model"] for labels in info.values()} == {"HL-205"}


def test_a_headerless_hl_smi_csv_without_its_field_list_is_refused_naming_the_line() -> None:
    text = (GAUDI_NOHEADER / "hl-smi.csv").read_text()
    with pytest.raises(ValueError, match=r"line 1 holds values, not a header .*hl-smi-fields"):
        hl_smi.parse_hl_smi_csv(text)


def test_a_headed_hl_smi_csv_is_read_by_its_header_even_with_a_field_list() -> None:
    text = (GAUDI / "hl-smi.csv").read_text()
    records = hl_smi.parse_hl_smi_csv(text, ["index", "power.draw"])
    assert len(records) == 8 and records[2].model == "HL-205" and records[2].power_w == 96


def _replay_agent(directory: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'node = "n"\n[mqtt]\nenabled = false\n[agent]\nstate_dir = "{tmp_path / "state"}"\n'
        'metrics_address = ""\n'
    )
    return subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", "agent", "--config", str(config),
         "--replay", str(directory), "--no-broker"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _refused_in_one_line(tmp_path: Path, name: str, text: str) -> str:
    """The one line the agent ends with (exit 2, no traceback) replaying a capture of ``text``
    under ``name``; it names the file and its line 1."""
    capture = tmp_path / "capture"
    capture.mkdir()
    (capture / name).write_text(text)
    result = _replay_agent(capture, tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert str(capture / name) in lines[0] and "line 1" in lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


def test_a_capture_that_does_not_parse_ends_the_agent_with_one_line(tmp_path: Path) -> None:
    """A headerless hl-smi CSV without its field list: exit 2 and one line naming the file,
    the line and the expected format, no traceback."""
    line = _refused_in_one_line(tmp_path, "hl-smi.csv", (GAUDI_NOHEADER / "hl-smi.csv").read_text())
    assert "hl-smi-fields.txt" in line



def test_a_rocm_smi_csv_saved_as_json_ends_the_agent_with_one_line(tmp_path: Path) -> None:
    """``rocm-smi --csv`` output under ``rocm-smi.json``: exit 2 and one line naming the file,
    the line and the format expected, not a JSONDecodeError traceback."""
    line = _refused_in_one_line(
        tmp_path,
        "rocm-smi.json",
        "device,Temperature (Sensor edge) (C),Current Socket Graphics Package Power (W)\n"
        "card0,35.0,90.0\n",
    )
    assert "rocm-smi --showallinfo --json" in line


ROCM_CSV = FIXTURES / "replay" / "amd-mi100-rocm-smi-csv"


async def test_rocm_smi_csv_replays_every_card() -> None:
    """``rocm-smi ... --csv`` with a ``WARNING:`` line before its header: the 4 MI100s, their
    power, temperature, utilisation and memory, as the same values in ``--json`` give them."""
    readings = await replayed_readings(ROCM_CSV, Clock())
    power = by_gpu(readings, "hyperagent_gpu_power_watts")
    assert power == {"0": 36.0, "1": 44.0, "2": 43.0, "3": 39.0}
    assert by_gpu(readings, "hyperagent_gpu_memory_total_bytes")["3"] == 34342961152
    assert by_gpu(readings, "hyperagent_gpu_memory_used_bytes")["3"] == 6750208
    assert by_gpu(readings, "hyperagent_gpu_temperature_celsius")["1"] == 58.0
    assert by_gpu(readings, "hyperagent_gpu_utilization_ratio") == dict.fromkeys("0123", 0.0)


def test_rocm_smi_csv_headers_of_1x_and_2x_read_alike() -> None:
    from hyperagent.capture import amd_smi

    old = amd_smi.parse_rocm_smi_csv((ROCM_CSV / "rocm-smi.csv").read_text())
    new = amd_smi.parse_rocm_smi_csv(
        (FIXTURES / "rocm-smi" / "mi100_rocm_smi_2x_header.csv").read_text()
    )
    assert [r.power_w for r in new] == [r.power_w for r in old] == [36.0, 44.0, 43.0, 39.0]
    assert [r.mem_util_pct for r in new] == [0.0] * 4
    assert {r.model for r in new} == {"AMD Instinct MI100"} and {r.model for r in old} == {""}


INTEL_MAX = FIXTURES / "replay" / "intel-max1550-documented"


async def test_intel_gpu_max_telemetry_from_xpu_smi() -> None:
    """``xpu-smi dump`` with ``xpu-smi discovery -j``, replayed through the fake xpu-smi and
    the source's own parser: each Max 1550's utilisation, power, clock, temperatures, energy
    counter, memory bandwidth use and memory, named as every vendor's GPU readings are, with
    its model, UUID and PCI address."""
    readings = await replayed_readings(INTEL_MAX, Clock())
    assert by_gpu(readings, "hyperagent_gpu_power_watts") == {"0": 512.4, "1": 498.1}
    assert by_gpu(readings, "hyperagent_gpu_utilization_ratio") == {"0": 0.875, "1": 0.8625}
    # the recorded counter, then 10 s of the replay's clock at the recorded draw
    energy = by_gpu(readings, "hyperagent_gpu_energy_joules_total")["1"]
    assert energy == pytest.approx(1801877.3 + 10 * 498.1)
    assert by_gpu(readings, "hyperagent_gpu_memory_total_bytes")["0"] == 128 * 2**30
    assert by_gpu(readings, "hyperagent_gpu_memory_used_bytes")["0"] == 96 * 2**30
    assert by_gpu(readings, "hyperagent_gpu_sm_clock_hertz")["0"] == 1.6e9
    assert by_gpu(readings, "hyperagent_gpu_memory_temperature_celsius")["1"] == 50.0
    info = {r.labels["gpu"]: r.labels for r in readings if r.name == "hyperagent_gpu_info"}
    assert info["0"]["vendor"] == "intel"
    assert info["0"]["model"] == "Intel(R) Data Center GPU Max 1550"
    assert info["1"]["bus_id"] == "0000:3a:00.0"


async def test_the_xpu_smi_source_runs_discovery_once_and_dump_each_read(tmp_path: Path) -> None:
    from hyperagent.sources import smi_text

    log = tmp_path / "calls"
    tool = tmp_path / "xpu-smi"
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$1" >> {log}\n'
        f'if [ "$1" = discovery ]; then cat {INTEL_MAX / "xpu-smi-discovery.json"};'
        f' else cat {INTEL_MAX / "xpu-smi-dump.csv"}; fi\n'
    )
    tool.chmod(0o755)
    source = smi_text.SmiTextSource("xpu_smi", (str(tool), "dump"), timeout_s=5.0)
    source.identity_argv = (str(tool), "discovery", "-j")
    for _ in range(3):
        readings = await source.read()
    assert by_gpu(readings, "hyperagent_gpu_power_watts") == {"0": 512.4, "1": 498.1}
    assert log.read_text().split() == ["discovery", "dump", "dump", "dump"]


def _copy_with(source: Path, target: Path, name: str, old: str, new: str) -> Path:
    import shutil

    shutil.copytree(source, target)
    path = target / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return target


async def test_a_card_named_generically_is_identified_by_its_pci_id(tmp_path: Path) -> None:
    """An MI300X whose amd-smi names it by a generic name, and an MI100 whose rocm-smi card
    series is its chip's code name alone: their PCI device ids (0x74a1, 0x738c) give them their
    parts' quantum coefficients."""
    from hyperagent.config import DEFAULT_QUANTUM_COEFFICIENTS
    from hyperagent.indicators import derive
    from hyperagent.readings import Snapshot

    mi300x = _copy_with(
        FIXTURES / "replay" / "amd-mi300x-8gpu", tmp_path / "mi300x", "amd-smi-static.json",
        '"AMD Instinct MI300X"', '"AMD Radeon Graphics"',
    )
    mi100 = _copy_with(
        FIXTURES / "replay" / "amd-mi100-rocm602", tmp_path / "mi100", "rocm-smi.json",
        "Arcturus GL-XL [Instinct MI100]", "Arcturus GL-XL",
    )
    for directory, q in ((mi300x, 4.19), (mi100, 0.59)):
        readings = await replayed_readings(directory, Clock())
        snapshot = Snapshot(0.0, "n", tuple(readings))
        coefficients = [
            r for r in derive(snapshot, None, DEFAULT_QUANTUM_COEFFICIENTS)
            if r.name == "hyperagent_gpu_quantum_coefficient"
        ]
        assert coefficients and {r.value for r in coefficients} == {q}, directory.name
        assert {r.labels["known"] for r in coefficients} == {"true"}


def test_a_part_unknown_by_name_and_id_is_warned_about_once_with_its_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from hyperagent.devices import parts

    with caplog.at_level(logging.WARNING, logger="hyperagent.devices.parts"):
        for _ in range(3):
            assert parts.identified("AMD Radeon Graphics", "0x1002:0x7fff") == (
                "AMD Radeon Graphics"
            )
        assert parts.identified("AMD Radeon Graphics", "0x1002:0x74a1") == (
            "AMD Radeon Graphics (MI300X)"
        )
        assert parts.identified("AMD Instinct MI300X", "0x1002:0x74a1") == "AMD Instinct MI300X"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "0x1002:0x7fff" in said[0], said
    assert parts.pci_id("0x1002", "74A1") == parts.pci_id(0x1002, 0x74A1) == "0x1002:0x74a1"


MI300X_JSON = FIXTURES / "replay" / "amd-mi300x-metric-json"


async def test_amd_smi_metric_json_replays_as_its_csv() -> None:
    """``amd-smi metric --json`` of the 8 MI300X: every device's power, energy, utilisation,
    memory, temperature and identity, as the same node's ``--csv`` gives them."""
    from devices.test_vendors import MI300X

    from_json = await replayed_readings(MI300X_JSON, Clock())
    from_csv = await replayed_readings(MI300X, Clock())
    assert_same_per_gpu(from_json, from_csv, "hyperagent_gpu_energy_joules_total")
    assert by_gpu(from_json, "hyperagent_gpu_power_watts")["7"] == 134
    info = [r.labels for r in from_json if r.name == "hyperagent_gpu_info"]
    assert info == [r.labels for r in from_csv if r.name == "hyperagent_gpu_info"]


def test_amd_smi_metric_json_under_gpu_data_reads_alike() -> None:
    """Newer amd-smi prints the device list under ``gpu_data``; a device object without its
    index, or JSON of another shape, is refused."""
    import json

    from hyperagent.capture import amd_smi

    text = (MI300X_JSON / "amd-smi-metric.json").read_text()
    wrapped = json.dumps({"gpu_data": json.loads(text)})
    assert amd_smi.parse_metric_json(wrapped) == amd_smi.parse_metric_json(text)
    with pytest.raises(ValueError, match="'gpu' index"):
        amd_smi.parse_metric_json('[{"usage": {}}]')
    with pytest.raises(ValueError, match="gpu_data"):
        amd_smi.parse_metric_json('{"card0": {}}')


def test_an_amd_smi_metric_json_that_is_not_json_ends_the_agent_with_one_line(
    tmp_path: Path,
) -> None:
    csv_text = (FIXTURES / "replay" / "amd-mi300x-8gpu" / "amd-smi-metric.csv").read_text()
    assert "amd-smi metric --json" in _refused_in_one_line(
        tmp_path, "amd-smi-metric.json", csv_text
    )


ROCM_ALL = FIXTURES / "replay" / "amd-mi100-rocm-smi-all-json"


async def test_rocm_smi_all_json_replays_its_energy_counter() -> None:
    """``rocm-smi -a --json``: each card's energy counter (``Accumulated Energy (uJ)``) is where
    its energy starts, then 10 s at its recorded draw; power, temperature and utilisation as
    the MI100 capture gives them."""
    readings = await replayed_readings(ROCM_ALL, Clock())
    power = by_gpu(readings, "hyperagent_gpu_power_watts")
    assert power == {"0": 36.0, "1": 44.0, "2": 43.0, "3": 39.0}
    energy = by_gpu(readings, "hyperagent_gpu_energy_joules_total")
    assert energy["0"] == pytest.approx(9526356.0 + 10 * 36, abs=0.01)
    assert energy["3"] == pytest.approx(10320219.0 + 10 * 39, abs=0.01)
    assert by_gpu(readings, "hyperagent_gpu_temperature_celsius")["1"] == 58.0


async def test_rocm_smi_all_json_without_package_power_reads_the_gpu_metrics(
    tmp_path: Path,
) -> None:
    """A card that prints no package power (RDNA) under ``-a``: its draw is the GPU metrics'
    ``average_socket_power (W)``, its clock ``current_gfxclk (MHz)``, its model its Device
    Name where it has no Card series."""
    import json

    data = json.loads((ROCM_ALL / "rocm-smi.json").read_text())
    for name, card in data.items():
        if name.startswith("card"):
            for key in ("Average Graphics Package Power (W)", "sclk clock speed:", "Card series"):
                del card[key]
            card["Device Name"] = "AMD Instinct MI100"
    capture = tmp_path / "capture"
    capture.mkdir()
    (capture / "rocm-smi.json").write_text(json.dumps(data))
    readings = await replayed_readings(capture, Clock())
    assert by_gpu(readings, "hyperagent_gpu_power_watts") == {
        "0": 36.0, "1": 44.0, "2": 43.0, "3": 39.0,
    }  # fmt: skip
    info = {r.labels["gpu"]: r.labels for r in readings if r.name == "hyperagent_gpu_info"}
    assert {labels["model"] for labels in info.values()} == {"AMD Instinct MI100"}
    assert by_gpu(readings, "hyperagent_gpu_sm_clock_hertz")["0"] == 300e6


GAUDI_DEFAULT = FIXTURES / "replay" / "gaudi-hl205-default-fields"


async def test_a_headerless_hl_smi_csv_of_the_default_field_list_reads_without_its_list() -> None:
    """``hl-smi -Q`` with the default list of monitoring tools (all-smi's 11 fields, no
    ``hl-smi-fields.txt`` beside it): every card's values as the headed capture gives them,
    its power cap the ``power.max`` column."""
    headed = await replayed_readings(GAUDI, Clock())
    plain = await replayed_readings(GAUDI_DEFAULT, Clock())
    assert_same_per_gpu(plain, headed)
    records = hl_smi.load_capture(GAUDI_DEFAULT)
    assert {r.power_cap_w for r in records} == {350.0}
    assert {r.model for r in records} == {"HL-205"}
    assert records[0].driver == "1.18.0-fw-53.1.1.1"

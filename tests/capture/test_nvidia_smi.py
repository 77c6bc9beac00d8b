"""The nvidia-smi parsers against the real captures in fixtures/nvidia-smi."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hyperagent.capture.nvidia_smi import (
    MIB,
    GpuRecord,
    MigRecord,
    NvLinkRecord,
    RemappedRows,
    parse_capture,
    parse_nvidia_smi_xml,
    parse_nvlink_status,
    parse_query_gpu_csv,
)

FIXTURES = Path(__file__).parents[2] / "fixtures" / "nvidia-smi"
H100 = "linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt"
L40S = "linux-x86_64__nvidia-l40s__595.80.txt"
A100_TEXT = "a100-sxm4-mig-q-written.txt"
H100_MIG = "linux-x86_64__nvidia-h100-mig__590.48.01.txt"
H200_MIG = "linux-x86_64__nvidia-h200-mig__590.48.01.txt"
P100_CSV = "tesla-p100-query-gpu-written.csv"


def _capture(name: str) -> list[GpuRecord]:
    return parse_capture((FIXTURES / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("name", "count", "model", "driver"),
    [
        ("gtx-8card.xml", 8, "Tesla V100S-PCIE-32GB", "460.73.01"),
        ("gtx-1card.xml", 1, "Tesla V100-PCIE-32GB", "460.39"),
        ("a100-sxm4-v12.xml", 1, "NVIDIA A100-SXM4-80GB", "535.54.03"),
        ("a10g.xml", 1, "NVIDIA A10G", "515.105.01"),
        ("tesla-t4.xml", 1, "Tesla T4", "515.105.01"),
        (H100, 1, "NVIDIA H100 80GB HBM3", "590.48.01"),
        (L40S, 1, "NVIDIA L40S", "595.80"),
        (A100_TEXT, 1, "NVIDIA A100-SXM4-80GB", "535.54.03"),
        (H100_MIG, 1, "NVIDIA H100 80GB HBM3", "590.48.01"),
        (H200_MIG, 1, "NVIDIA H200", "590.48.01"),
    ],
)
def test_every_capture_parses(name: str, count: int, model: str, driver: str) -> None:
    gpus = _capture(name)
    assert len(gpus) == count
    assert [g.index for g in gpus] == list(range(count))
    assert {g.name for g in gpus} == {model}
    assert {g.driver for g in gpus} == {driver}
    assert all(g.uuid.startswith("GPU-") for g in gpus)


def test_fixtures_are_all_covered() -> None:
    captures = {p.name for p in FIXTURES.iterdir() if p.suffix in {".xml", ".txt"}}
    assert len(captures) == 10


def test_gtx_8card_gpu0_under_load() -> None:
    gpu = _capture("gtx-8card.xml")[0]
    assert gpu == GpuRecord(
        index=0,
        name="Tesla V100S-PCIE-32GB",
        uuid="GPU-76098dc1-d3bc-9a1b-7ea6-f7b48837829e",
        pci_bus_id="00000000:00:0D.0",
        driver="460.73.01",
        util_gpu_pct=97.0,
        util_mem_pct=52.0,
        mem_total_bytes=32510 * MIB,
        mem_used_bytes=31689 * MIB,
        mem_reserved_bytes=None,
        power_draw_w=232.80,
        power_limit_w=250.0,
        default_power_limit_w=250.0,
        min_power_limit_w=100.0,
        max_power_limit_w=250.0,
        temperature_c=66.0,
        sm_clock_mhz=1410.0,
        mem_clock_mhz=1107.0,
        graphics_clock_mhz=1410.0,
        pcie_replay_count=0,
        memory_temperature_c=63.0,
        pcie_tx_bytes_per_s=22000 * 1024,
        pcie_rx_bytes_per_s=19000 * 1024,
        clock_event_reasons=frozenset(),
        clock_event_api=False,  # driver 460 names them clocks_throttle_reasons
        ecc_errors={
            (t, c): 0 for t in ("corrected", "uncorrected") for c in ("volatile", "aggregate")
        },
        ecc_errors_by_location={
            **{
                (t, c, where): 0
                for t in ("corrected", "uncorrected")
                for c in ("volatile", "aggregate")
                for where in ("device_memory", "register_file", "l1_cache", "l2_cache")
            },
            ("uncorrected", "volatile", "cbu"): 0,
            ("uncorrected", "aggregate", "cbu"): 0,
        },
        retired_pages_single_bit=0,
        retired_pages_double_bit=0,
        retired_pages_pending=False,
        remapped_rows=None,
        mig_enabled=None,
    )


def test_gtx_8card_other_gpus_keep_their_own_values() -> None:
    gpus = _capture("gtx-8card.xml")
    third = gpus[3]
    assert third.uuid == "GPU-3181eb56-505c-8214-ba05-c132f68f89b8"
    assert third.pci_bus_id == "00000000:00:10.0"
    assert (third.util_gpu_pct, third.util_mem_pct) == (23.0, 12.0)
    assert third.mem_used_bytes == 32099 * MIB
    assert third.power_draw_w == 198.41
    assert third.temperature_c == 61.0
    assert third.sm_clock_mhz == 1432.0
    assert gpus[7].uuid == "GPU-1d955959-c95b-4f40-2cac-100d3006ffe2"
    assert gpus[7].power_draw_w == 61.47
    assert gpus[7].util_gpu_pct == 99.0
    assert len({g.uuid for g in gpus}) == 8


def test_gtx_1card() -> None:
    gpu = _capture("gtx-1card.xml")[0]
    assert gpu.uuid == "GPU-e77ce5d8-8b63-c936-3c1b-839d45bcd0f2"
    assert gpu.pci_bus_id == "00000000:21:01.0"
    assert (gpu.util_gpu_pct, gpu.util_mem_pct) == (91.0, 47.0)
    assert (gpu.mem_total_bytes, gpu.mem_used_bytes) == (32510 * MIB, 12311 * MIB)
    assert gpu.power_draw_w == 170.16
    assert gpu.temperature_c == 66.0
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz, gpu.graphics_clock_mhz) == (1380, 877, 1380)


def test_a100_v12_mig_reads_gpu_power_readings_and_whole_gpu_memory() -> None:
    gpu = _capture("a100-sxm4-v12.xml")[0]
    assert gpu.index == 0  # minor_number is 1; the NVML index is the position in the dump
    assert gpu.pci_bus_id == "00000000:01:00.0"
    assert gpu.util_gpu_pct is None
    assert gpu.util_mem_pct is None
    assert gpu.mem_total_bytes == 81920 * MIB  # not a MIG instance's 19968 MiB
    assert gpu.mem_used_bytes == 50 * MIB
    assert gpu.mem_reserved_bytes == 869 * MIB
    assert gpu.power_draw_w == 67.03
    assert gpu.power_limit_w == 500.0
    assert gpu.default_power_limit_w == 500.0
    assert (gpu.min_power_limit_w, gpu.max_power_limit_w) == (100.0, 500.0)
    assert gpu.temperature_c == 27.0
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz, gpu.graphics_clock_mhz) == (1275, 1593, 1275)


def test_a10g() -> None:
    gpu = _capture("a10g.xml")[0]
    assert gpu.uuid == "GPU-9a9a6c50-2a47-2f51-a902-b82c3b127e94"
    assert (gpu.util_gpu_pct, gpu.util_mem_pct) == (0.0, 0.0)
    assert (gpu.mem_total_bytes, gpu.mem_used_bytes) == (23028 * MIB, 22 * MIB)
    assert gpu.mem_reserved_bytes == 435 * MIB
    assert gpu.power_draw_w == 25.58
    assert (gpu.power_limit_w, gpu.min_power_limit_w, gpu.max_power_limit_w) == (300, 100, 300)
    assert gpu.temperature_c == 17.0
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz) == (210.0, 405.0)


def test_tesla_t4() -> None:
    gpu = _capture("tesla-t4.xml")[0]
    assert gpu.uuid == "GPU-d37e67a5-91dd-3774-a5cb-99096249601a"
    assert (gpu.mem_total_bytes, gpu.mem_used_bytes) == (15360 * MIB, 1032 * MIB)
    assert gpu.power_draw_w == 26.78
    assert gpu.power_limit_w == 70.0
    assert (gpu.min_power_limit_w, gpu.max_power_limit_w) == (60.0, 70.0)
    assert gpu.temperature_c == 40.0
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz, gpu.graphics_clock_mhz) == (585, 5000, 585)


def test_h100_uses_the_load_section() -> None:
    gpu = _capture(H100)[0]
    assert gpu.pci_bus_id == "00000000:00:09.0"
    assert (gpu.util_gpu_pct, gpu.util_mem_pct) == (100.0, 11.0)
    assert gpu.mem_total_bytes == 81559 * MIB
    assert gpu.mem_used_bytes == 19818 * MIB
    assert gpu.mem_reserved_bytes == 479 * MIB
    assert gpu.power_draw_w == 631.95
    assert gpu.power_limit_w == 700.0
    assert gpu.default_power_limit_w == 700.0
    assert (gpu.min_power_limit_w, gpu.max_power_limit_w) == (200.0, 700.0)
    assert gpu.temperature_c == 59.0
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz, gpu.graphics_clock_mhz) == (1980, 2619, 1980)
    assert gpu.pcie_replay_count is None  # not a --query-gpu field


def test_l40s_uses_the_load_section() -> None:
    gpu = _capture(L40S)[0]
    assert gpu.pci_bus_id == "00000000:01:00.0"
    assert (gpu.util_gpu_pct, gpu.util_mem_pct) == (9.0, 2.0)
    assert (gpu.mem_total_bytes, gpu.mem_used_bytes) == (46068 * MIB, 1235 * MIB)
    assert gpu.power_draw_w == 110.23
    assert (gpu.power_limit_w, gpu.min_power_limit_w, gpu.max_power_limit_w) == (350, 100, 350)
    assert gpu.temperature_c == 54.0
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz) == (2520.0, 9001.0)


def test_exporter_capture_falls_back_to_the_idle_section() -> None:
    text = (FIXTURES / H100).read_text(encoding="utf-8")
    without_load = text.replace("# load :: query-gpu", "# load :: query-gpu-removed")
    gpu = parse_capture(without_load)[0]
    assert gpu.util_gpu_pct == 0.0
    assert gpu.power_draw_w == 69.85
    assert gpu.mem_used_bytes == 0
    assert gpu.temperature_c == 41.0


def test_bare_query_gpu_csv_with_and_without_units() -> None:
    with_units = (
        "index, name, uuid, pci.bus_id, driver_version, memory.total [MiB], memory.used [MiB], "
        "utilization.gpu [%], power.draw [W], enforced.power.limit [W], temperature.gpu\n"
        "0, Tesla T4, GPU-a, 00000000:00:1E.0, 515.105.01, 15360 MiB, 1032 MiB, 7 %, "
        "26.78 W, 70.00 W, 40\n"
        "1, Tesla T4, GPU-b, 00000000:00:1F.0, 515.105.01, 15360 MiB, [N/A], [Not Supported], "
        "[N/A], 70.00 W, N/A\n"
    )
    nounits = with_units.replace(" MiB,", ",").replace(" %,", ",").replace(" W,", ",")
    for text in (with_units, nounits):
        first, second = parse_capture(text)
        assert (first.index, first.uuid, first.driver) == (0, "GPU-a", "515.105.01")
        assert first.mem_total_bytes == 15360 * MIB
        assert first.mem_used_bytes == 1032 * MIB
        assert first.util_gpu_pct == 7.0
        assert first.power_draw_w == 26.78
        assert first.power_limit_w == 70.0
        assert first.temperature_c == 40.0
        assert first.util_mem_pct is None  # column absent
        assert second.index == 1
        assert second.mem_used_bytes is None
        assert second.util_gpu_pct is None
        assert second.power_draw_w is None
        assert second.temperature_c is None


def test_csv_rejects_a_wrong_unit_and_a_short_row() -> None:
    with pytest.raises(ValueError, match=r"power\.draw: unexpected unit 'mW'"):
        parse_query_gpu_csv("name, power.draw [W]\nT4, 26 mW\n")
    with pytest.raises(ValueError, match="row 1 has 1 values for 2 fields"):
        parse_query_gpu_csv("name, power.draw [W]\nT4\n")
    with pytest.raises(ValueError, match="no 'name' column"):
        parse_query_gpu_csv("index, power.draw [W]\n0, 20 W\n")


def test_xml_power_fallbacks_for_newer_dtd() -> None:
    xml = """<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
  <driver_version>550.54.15</driver_version>
  <gpu id="00000000:3B:00.0">
    <product_name>NVIDIA H100 80GB HBM3</product_name>
    <uuid>GPU-x</uuid>
    <gpu_power_readings>
      <average_power_draw>N/A</average_power_draw>
      <instant_power_draw>312.50 W</instant_power_draw>
      <current_power_limit>650.00 W</current_power_limit>
      <min_power_limit>[Not Supported]</min_power_limit>
    </gpu_power_readings>
  </gpu>
</nvidia_smi_log>
"""
    (gpu,) = parse_nvidia_smi_xml(xml)
    assert gpu.pci_bus_id == "00000000:3B:00.0"
    assert gpu.power_draw_w == 312.5
    assert gpu.power_limit_w == 650.0
    assert gpu.min_power_limit_w is None
    assert gpu.max_power_limit_w is None
    assert gpu.mem_total_bytes is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "unrecognised nvidia-smi capture"),
        ("hello world\n", "unrecognised nvidia-smi capture"),
        ("<html><body/></html>", "root element is <html>"),
        ("<nvidia_smi_log><gpu>", "not valid nvidia-smi XML"),
        ("<nvidia_smi_log><driver_version>1</driver_version></nvidia_smi_log>", "holds no GPU"),
        ("index, name, uuid\n", "holds no GPU"),
        ("# idle :: nvidia-smi (default table)\nNo devices were found\n", "without a query-gpu"),
    ],
)
def test_unrecognised_or_empty_captures_raise(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_capture(text)


def test_gtx_8card_power_capped_gpus_and_pcie_traffic() -> None:
    gpus = _capture("gtx-8card.xml")
    assert [g.index for g in gpus if g.clock_event_reasons] == [3, 6]
    assert gpus[3].clock_event_reasons == {"sw_power_cap"}
    assert gpus[5].pcie_tx_bytes_per_s == 7151000 * 1024
    assert gpus[5].pcie_rx_bytes_per_s == 8083000 * 1024
    assert [g.memory_temperature_c for g in gpus] == [63, 56, 55, 59, 58, 62, 56, 53]


def test_a100_mig_devices_ecc_and_event_reasons() -> None:
    gpu = _capture("a100-sxm4-v12.xml")[0]
    assert gpu.mig_enabled is True
    assert gpu.mig_devices == tuple(
        MigRecord(
            index=slot,
            gpu_instance_id=gi,
            compute_instance_id=0,
            mem_total_bytes=19968 * MIB,
            mem_used_bytes=12 * MIB,
            mem_reserved_bytes=0,
        )
        for slot, gi in enumerate((3, 4, 5, 6))
    )
    assert gpu.clock_event_api is True  # driver 535: clocks_event_reasons
    assert gpu.clock_event_reasons == frozenset()
    assert gpu.memory_temperature_c == 44.0
    assert gpu.pcie_tx_bytes_per_s == 4000 * 1024
    assert gpu.ecc_errors[("uncorrected", "aggregate")] == 0
    assert gpu.ecc_errors_by_location[("corrected", "volatile", "sram")] == 0
    assert gpu.ecc_errors_by_location[("corrected", "volatile", "device_memory")] == 0
    assert gpu.retired_pages_single_bit is None  # N/A: A100 remaps rows instead
    assert gpu.retired_pages_pending is None
    assert gpu.remapped_rows is None  # N/A in this dump (MIG mode)


def test_a10g_remapped_rows_and_idle_reason() -> None:
    gpu = _capture("a10g.xml")[0]
    assert gpu.remapped_rows == RemappedRows(0, 0, pending=False, failure=False)
    assert gpu.clock_event_reasons == {"gpu_idle"}
    assert gpu.clock_event_api is False
    assert gpu.memory_temperature_c is None
    assert gpu.mig_enabled is None
    assert gpu.mig_devices == ()


def test_tesla_t4_retired_pages() -> None:
    gpu = _capture("tesla-t4.xml")[0]
    assert (gpu.retired_pages_single_bit, gpu.retired_pages_double_bit) == (0, 0)
    assert gpu.retired_pages_pending is False
    assert gpu.remapped_rows is None


def test_h100_health_counters_and_nvlinks() -> None:
    gpu = _capture(H100)[0]
    assert gpu.memory_temperature_c == 54.0
    assert gpu.clock_event_api is True
    assert gpu.clock_event_reasons == frozenset()
    assert gpu.clock_event_counters_ns == {
        "sw_power_cap": 0,
        "sync_boost": 0,
        "sw_thermal_slowdown": 0,
        "hw_thermal_slowdown": 0,
        "hw_power_brake_slowdown": 0,
    }
    assert gpu.ecc_errors == {
        (t, c): 0 for t in ("corrected", "uncorrected") for c in ("volatile", "aggregate")
    }
    assert gpu.ecc_errors_by_location[("corrected", "volatile", "sram")] == 0
    assert ("corrected", "volatile", "register_file") not in gpu.ecc_errors_by_location
    assert gpu.remapped_rows == RemappedRows(0, 0, pending=False, failure=False)
    assert gpu.retired_pages_single_bit is None
    assert gpu.mig_enabled is False
    assert gpu.nvlinks == tuple(NvLinkRecord(link, active=True) for link in range(18))


def test_l40s_counts_power_capping_in_microseconds() -> None:
    gpu = _capture(L40S)[0]
    assert gpu.clock_event_counters_ns["sw_power_cap"] == 204_642_816 * 1000
    assert gpu.memory_temperature_c is None
    assert gpu.mig_enabled is None
    assert gpu.nvlinks == ()  # "Device does not have or support Nvlink"


def test_nvlink_status_lines() -> None:
    text = [
        "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-a)",
        "\t Link 0: 25 GB/s",
        "\t Link 1: <inactive>",
        "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-b)",
        "\t Link 0: 25.781 GB/s",
    ]
    assert parse_nvlink_status(text) == {
        0: (NvLinkRecord(0, active=True), NvLinkRecord(1, active=False)),
        1: (NvLinkRecord(0, active=True),),
    }
    with pytest.raises(ValueError, match="GPU 0 link 2: cannot read 'warm'"):
        parse_nvlink_status([text[0], "\t Link 2: warm"])


def test_csv_from_an_older_nvidia_smi_names_throttle_reasons() -> None:
    text = (
        "index, name, uuid, clocks_throttle_reasons.active, clocks_throttle_reasons.sw_power_cap, "
        "clocks_throttle_reasons.gpu_idle, mig.mode.current, retired_pages.pending\n"
        "0, Tesla V100, GPU-a, 0x0000000000000004, Active, Not Active, [N/A], No\n"
    )
    (gpu,) = parse_query_gpu_csv(text)
    assert gpu.clock_event_api is False
    assert gpu.clock_event_reasons == {"sw_power_cap"}
    assert gpu.mig_enabled is None
    assert gpu.retired_pages_pending is False


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("<tx_util>4000 KB/s</tx_util>", "<tx_util>4000 furlongs</tx_util>", "pci/tx_util"),
        (
            "<clocks_event_reason_gpu_idle>Not Active</clocks_event_reason_gpu_idle>",
            "<clocks_event_reason_gpu_idle>Maybe</clocks_event_reason_gpu_idle>",
            "clocks_event_reason_gpu_idle: expected one of",
        ),
        (
            "<current_mig>Enabled</current_mig>",
            "<current_mig>Sometimes</current_mig>",
            "current_mig",
        ),
        ("<gpu_instance_id>3</gpu_instance_id>", "<gpu_instance_id></gpu_instance_id>", "missing"),
        (
            "<sram_correctable>0</sram_correctable>",
            "<sram_correctable>x</sram_correctable>",
            "sram",
        ),
    ],
)
def test_a_garbage_field_raises_naming_it(old: str, new: str, message: str) -> None:
    text = (FIXTURES / "a100-sxm4-v12.xml").read_text(encoding="utf-8")
    assert old in text
    with pytest.raises(ValueError, match=message):
        parse_capture(text.replace(old, new, 1))


def test_mig_devices_from_q_text_match_the_xml() -> None:
    """`nvidia-smi -q` text keeps the MIG devices: the A100's text (written from its XML
    capture's values, see SOURCES.md) gives the same GPU record as the XML, ECC counts aside
    (not read from text)."""
    text = _capture(A100_TEXT)[0]
    xml = _capture("a100-sxm4-v12.xml")[0]
    assert text.mig_enabled is True
    assert [(m.index, m.gpu_instance_id, m.mem_used_bytes) for m in text.mig_devices] == [
        (0, 3, 12 * MIB),
        (1, 4, 12 * MIB),
        (2, 5, 12 * MIB),
        (3, 6, 12 * MIB),
    ]
    assert text == dataclasses.replace(xml, ecc_errors={}, ecc_errors_by_location={})


@pytest.mark.parametrize("name", [H100, L40S])
def test_q_text_of_real_captures_agrees_with_their_csv(name: str) -> None:
    """The `-q` sections of the real H100 and L40S captures read as their query-gpu CSV taken
    moments apart: the same GPU, memory, limits, clocks and states (power and temperatures are
    read again by each command and may move)."""
    lines = (FIXTURES / name).read_text(encoding="utf-8").splitlines()
    start = lines.index("# load :: query (-q)")
    end = next(i for i in range(start + 2, len(lines)) if lines[i].startswith("# "))
    (from_text,) = parse_capture("\n".join(lines[start + 1 : end]))
    (from_csv,) = _capture(name)
    for field in (
        "name", "uuid", "pci_bus_id", "driver", "util_gpu_pct", "util_mem_pct",
        "mem_total_bytes", "mem_used_bytes", "mem_reserved_bytes", "power_limit_w",
        "default_power_limit_w", "min_power_limit_w", "max_power_limit_w", "sm_clock_mhz",
        "mem_clock_mhz", "graphics_clock_mhz", "clock_event_reasons", "remapped_rows",
        "mig_enabled", "mig_devices",
    ):  # fmt: skip
        assert getattr(from_text, field) == getattr(from_csv, field), field
    assert from_text.power_draw_w == pytest.approx(from_csv.power_draw_w, abs=5)


def test_csv_without_memory_reserved_agrees_with_total_minus_free() -> None:
    """A query-gpu CSV without memory.reserved: used 0 MiB with total - free 552 MiB on an
    idle GPU; the reserve is what the row does not account for, so used and reserved add up
    to total - free as in the XML path."""
    csv = (
        "index, name, uuid, pci.bus_id, memory.total [MiB], memory.used [MiB],"
        " memory.free [MiB]\n"
        "0, NVIDIA A10G, GPU-x, 00000000:00:1E.0, 23028 MiB, 0 MiB, 22476 MiB\n"
    )
    (gpu,) = parse_capture(csv)
    assert gpu.mem_used_bytes == 0
    assert gpu.mem_reserved_bytes == 552 * MIB
    with_reserved = csv.replace(" memory.free [MiB]", " memory.free [MiB], memory.reserved [MiB]")
    with_reserved = with_reserved.replace("22476 MiB\n", "22476 MiB, 400 MiB\n")
    assert parse_capture(with_reserved)[0].mem_reserved_bytes == 400 * MIB


def test_csv_with_memory_reserved_and_no_used_keeps_its_memory_through_nvml() -> None:
    """A query-gpu CSV whose memory columns include memory.reserved but whose memory.used is
    N/A (a Tesla K80's row): used is total - free - reserved, so NVML still answers the
    total and used instead of NOT_SUPPORTED for all of them."""

    csv = (
        "index, name, uuid, pci.bus_id, memory.total [MiB], memory.reserved [MiB],"
        " memory.used [MiB], memory.free [MiB]\n"
        "0, Tesla K80, GPU-x, 00000000:05:00.0, 11441 MiB, 66 MiB, [N/A], 11375 MiB\n"
    )
    (gpu,) = parse_capture(csv)
    assert (gpu.mem_total_bytes, gpu.mem_used_bytes) == (11441 * MIB, 0)
    assert _nvml_memory(gpu) == (11441 * MIB, 66 * MIB, 11375 * MIB)


def _nvml_memory(gpu: GpuRecord) -> tuple[int, int, int]:
    """Total, used and free bytes of ``gpu`` as the fake NVML's memory call answers them."""
    from hyperagent.capture.fake_nvml import FakeNvml

    nvml = FakeNvml([gpu])
    nvml.nvmlInit()
    try:
        memory = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        nvml.nvmlShutdown()
    return memory.total, memory.used, memory.free


def test_csv_without_memory_total_keeps_its_memory_through_nvml() -> None:
    """A Tesla P100's query-gpu CSV of memory.reserved, used and free but no memory.total
    (values without units, no power-limit fields; written, see SOURCES.md): the total is
    their sum, so NVML answers the GPU's total and used memory instead of NOT_SUPPORTED for
    all of them (the agent's only word was then about the power-limit range it lacks)."""

    (gpu,) = _capture(P100_CSV)
    assert gpu.mem_total_bytes == 16384 * MIB
    assert (gpu.mem_used_bytes, gpu.mem_reserved_bytes) == (6 * MIB, 104 * MIB)
    assert (gpu.min_power_limit_w, gpu.max_power_limit_w) == (None, None)
    assert _nvml_memory(gpu) == (16384 * MIB, 110 * MIB, 16274 * MIB)


def test_csv_and_xml_report_the_same_memory_used_through_nvml() -> None:
    """The L40S capture's CSV with memory.reserved dropped gives NVML memory used (v1, reserve
    included) of total - free, as the full CSV does (within the 1 MiB nvidia-smi rounds each of
    its figures to)."""
    from hyperagent.capture.fake_nvml import FakeNvml

    lines = (FIXTURES / L40S).read_text(encoding="utf-8").splitlines()
    start = lines.index("# load :: query-gpu (csv, what the exporter parses)")
    header, row = [line for line in lines[start + 1 :] if not line.startswith("#")][:2]
    names = [c.strip() for c in header.split(",")]
    values = [v.strip() for v in row.split(",")]
    keep = [i for i, n in enumerate(names) if not n.startswith("memory.reserved")]
    reduced = ", ".join(names[i] for i in keep) + "\n" + ", ".join(values[i] for i in keep)
    full = header + "\n" + row

    def used(text: str) -> int:
        nvml = FakeNvml(parse_capture(text))
        nvml.nvmlInit()
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(0)
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        finally:
            nvml.nvmlShutdown()

    total = int(values[names.index("memory.total [MiB]")].split()[0])
    free = int(values[names.index("memory.free [MiB]")].split()[0])
    assert used(reduced) == (total - free) * MIB
    assert abs(used(full) - used(reduced)) <= MIB


@pytest.mark.parametrize(
    ("name", "devices"),
    [
        # (MIG slot, GPU instance, compute instance, total MiB, used MiB) of the load section
        (H100_MIG, [(0, 2, 0, 40448, 11091), (1, 3, 0, 20096, 17), (2, 9, 0, 9984, 9),
                    (3, 10, 0, 9984, 9)]),
        (H200_MIG, [(0, 2, 0, 71424, 16925), (1, 2, 1, 71424, 16925), (2, 3, 0, 33280, 17),
                    (3, 9, 0, 16384, 9), (4, 10, 0, 16384, 9)]),
    ],
)  # fmt: skip
def test_mig_memory_from_driver_590_q_text(
    name: str, devices: list[tuple[int, int, int, int, int]]
) -> None:
    """Driver 590's `-q` names a MIG device's memory "Shared FB Memory Usage" (the H100's and
    H200's captures): each MIG device keeps its total and used memory, and NVML (replayed
    from the capture, as the agent reads it) reports them for each MIG device handle."""
    from hyperagent.capture.fake_nvml import FakeNvml

    (gpu,) = _capture(name)
    assert gpu.mig_enabled is True
    assert [
        (m.index, m.gpu_instance_id, m.compute_instance_id, m.mem_total_bytes, m.mem_used_bytes)
        for m in gpu.mig_devices
    ] == [(i, gi, ci, total * MIB, used * MIB) for i, gi, ci, total, used in devices]
    nvml = FakeNvml([gpu])
    nvml.nvmlInit()
    try:
        parent = nvml.nvmlDeviceGetHandleByIndex(0)
        for index, _, _, total, used in devices:
            memory = nvml.nvmlDeviceGetMemoryInfo(
                nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
            )
            assert (memory.total, memory.used) == (total * MIB, used * MIB)
    finally:
        nvml.nvmlShutdown()

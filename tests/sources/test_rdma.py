"""The RDMA source on real sysfs trees, real `rdma`/`ethtool` outputs and the real binaries."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from hyperagent.errors import SourceError, SourceTimeout, SourceUnavailable
from hyperagent.readings import Kind, Reading
from hyperagent.sources.command import CaptureMissing, CommandFailed, CommandUnavailable
from hyperagent.sources.rdma import HELP, RdmaSource, capture_runner, run_command
from hyperagent.sources.rdma_ethtool import PAUSE_STATISTICS, parse_ethtool_pause
from hyperagent.sources.rdma_ports import (
    HW_COUNTERS,
    PMA_COUNTERS,
    PMA_EXT_COUNTERS,
    parse_rate,
    parse_sysfs,
)
from hyperagent.sources.rdma_resources import (
    RDMA_CQ_COMMAND,
    RDMA_QP_COMMAND,
    parse_rdma_cqs,
    parse_rdma_qps,
)
from hyperagent.sources.rdma_sysfs import SysfsReader, read_sysfs

from conftest import FIXTURES, require_binary

GOLDEN = Path(__file__).parents[1] / "golden" / "rdma"
TREES = FIXTURES / "infiniband-sysfs"
OUTPUTS = FIXTURES / "rdma"
REPLAY = FIXTURES / "replay" / "rxe-qemu-e1000e"

SYSFS_ROOTS = {
    "node_exporter": TREES / "node_exporter" / "sys",
    "procfs": TREES / "procfs" / "fixtures" / "sys",
    "rxe-qemu-e1000e": TREES / "rxe-qemu-e1000e" / "sys",
}


def _qps(path: Path) -> list[Reading]:
    return parse_rdma_qps(path.read_text())


def _cqs(path: Path) -> list[Reading]:
    return parse_rdma_cqs(path.read_text())


def _pause(path: Path) -> list[Reading]:
    return parse_ethtool_pause(path.read_text(), "eth0")


COMMAND_OUTPUTS: dict[str, Callable[[Path], list[Reading]]] = {
    "rxe-qemu-e1000e/rdma-resource-qp.json": _qps,
    "rxe-qemu-e1000e/rdma-resource-qp-idle.json": _qps,
    "rxe-qemu-e1000e/rdma-resource-cq.json": _cqs,
    "rxe-qemu-e1000e/rdma-resource-cq-idle.json": _cqs,
    "rxe-qemu-e1000e/ethtool-S-eth0.txt": _pause,
    "rxe-qemu-virtio/rdma-resource-qp.json": _qps,
    "rxe-qemu-virtio/rdma-resource-cq.json": _cqs,
    "rxe-qemu-virtio/ethtool-S-eth0.txt": _pause,
}


def render(readings: Sequence[Reading]) -> str:
    lines = []
    for r in readings:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(r.labels.items()))
        lines.append(f"{r.name}{{{labels}}} {r.value!r} {r.kind.value}")
    return "\n".join(sorted(lines)) + "\n"


def check_golden(name: str, readings: Sequence[Reading]) -> None:
    text = render(readings)
    golden = GOLDEN / f"{name}.txt"
    if os.environ.get("HYPERAGENT_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), "rerun with HYPERAGENT_UPDATE_GOLDEN=1 to accept"


def sysfs_readings(name: str) -> list[Reading]:
    return parse_sysfs(read_sysfs(SYSFS_ROOTS[name]))


def value(readings: Sequence[Reading], name: str, **labels: str) -> float | None:
    found = [
        r.value
        for r in readings
        if r.name == name and all(r.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} readings"
    return found[0] if found else None


def assert_well_formed(readings: Sequence[Reading]) -> None:
    label_keys: dict[str, set[str]] = {}
    for r in readings:
        assert r.name in HELP, f"{r.name} has no help text"
        assert r.name.startswith("hyperagent_rdma_")
        assert r.name.endswith("_total") == (r.kind is Kind.COUNTER), r.name
        assert r.name.endswith("_info") == (r.kind is Kind.INFO), r.name
        keys = set(r.labels)
        assert label_keys.setdefault(r.name, keys) == keys, f"{r.name}: label sets differ"
    series = [(r.name, tuple(sorted(r.labels.items()))) for r in readings]
    assert len(series) == len(set(series)), "a series is reported twice"


async def replay_source(directory: Path) -> list[Reading]:
    source = RdmaSource(sysfs_root=directory / "sys", run_command=capture_runner(directory))
    await source.start()
    try:
        return await source.read()
    finally:
        await source.close()


@pytest.mark.parametrize("name", sorted(SYSFS_ROOTS))
def test_sysfs_trees_match_golden(name: str) -> None:
    readings = sysfs_readings(name)
    assert_well_formed(readings)
    check_golden(f"sysfs-{name}", readings)


@pytest.mark.parametrize("capture", sorted(COMMAND_OUTPUTS))
def test_command_outputs_match_golden(capture: str) -> None:
    readings = COMMAND_OUTPUTS[capture](OUTPUTS / capture)
    assert_well_formed(readings)
    check_golden(capture.replace("/", "-").rsplit(".", 1)[0], readings)


async def test_replay_directory_matches_golden() -> None:
    readings = await replay_source(REPLAY)
    assert_well_formed(readings)
    check_golden("replay-rxe-qemu-e1000e", readings)
    for command in (" ".join(RDMA_QP_COMMAND), " ".join(RDMA_CQ_COMMAND), "ethtool -S eth0"):
        assert value(readings, "hyperagent_rdma_command_up", command=command) == 1.0


def test_data_counters_are_bytes_from_four_byte_words() -> None:
    readings = sysfs_readings("procfs")
    port = {"device": "mlx4_0", "port": "1"}
    assert value(readings, "hyperagent_rdma_port_data_transmitted_bytes_total", **port) == (
        26509113295 * 4
    )
    assert value(readings, "hyperagent_rdma_port_data_received_bytes_total", **port) == (
        2221223609 * 4
    )
    mlx5 = {"device": "mlx5_0", "port": "1"}
    assert value(readings, "hyperagent_rdma_port_data_transmitted_bytes_total", **mlx5) == (
        2880761508848 * 4
    )
    assert value(readings, "hyperagent_rdma_port_packets_transmitted_total", **mlx5) == (
        10907922116
    )


def test_64_bit_extended_counters_win_over_32_bit_ones() -> None:
    readings = sysfs_readings("node_exporter")
    port = {"device": "mlx4_0", "port": "1"}
    # counters/port_rcv_packets reads 6825908347, counters_ext/port_rcv_packets_64 reads 0
    assert value(readings, "hyperagent_rdma_port_packets_received_total", **port) == 0.0
    assert value(readings, "hyperagent_rdma_port_data_received_bytes_total", **port) == (
        4631917 * 4
    )
    # port 2: counters/port_xmit_data reads 0, counters_ext/port_xmit_data_64 reads 3733440
    assert value(
        readings, "hyperagent_rdma_port_data_transmitted_bytes_total", device="mlx4_0", port="2"
    ) == (3733440 * 4)
    assert value(readings, "hyperagent_rdma_port_transmit_wait_total", **port) == 4294967295


def test_port_state_rate_and_identity() -> None:
    readings = sysfs_readings("node_exporter")
    port = {"device": "mlx4_0", "port": "1"}
    assert value(readings, "hyperagent_rdma_port_state", **port) == 4
    assert value(readings, "hyperagent_rdma_port_physical_state", **port) == 5
    assert value(readings, "hyperagent_rdma_port_rate_bytes_per_second", **port) == 40e9 / 8
    assert (
        value(
            readings,
            "hyperagent_rdma_port_info",
            link_layer="InfiniBand",
            state="ACTIVE",
            physical_state="LinkUp",
            netdev="",
            **port,
        )
        == 1.0
    )
    assert (
        value(
            readings,
            "hyperagent_rdma_device_info",
            device="mlx4_0",
            fw_ver="2.31.5050",
            hca_type="MT4099",
            board_id="SM_1141000001000",
        )
        == 1.0
    )
    i40iw = {"device": "i40iw0", "port": "1"}
    assert value(readings, "hyperagent_rdma_port_rate_bytes_per_second", **i40iw) == 10e9 / 8


@pytest.mark.parametrize(
    ("tree", "device", "rate"),
    [
        ("node_exporter", "mlx4_0", 40e9),
        ("node_exporter", "i40iw0", 10e9),
        ("procfs", "mlx5_0", 25e9),
        ("rxe-qemu-e1000e", "rxe0", 2.5e9),
    ],
)
def test_rate_files_parse_to_bytes_per_second(tree: str, device: str, rate: float) -> None:
    rate_file = SYSFS_ROOTS[tree] / "class" / "infiniband" / device / "ports" / "1" / "rate"
    assert parse_rate(rate_file.read_text()) == rate / 8


def test_no_pma_counters_are_left_out_quietly() -> None:
    readings = sysfs_readings("node_exporter")
    i40iw_counters = [
        r for r in readings if r.kind is Kind.COUNTER and r.labels.get("device") == "i40iw0"
    ]
    assert i40iw_counters == []
    assert value(readings, "hyperagent_rdma_unreadable_files") == 0


def test_hw_counters_have_named_metrics_and_a_documented_tail() -> None:
    readings = sysfs_readings("procfs")
    port = {"device": "mlx5_0", "port": "1"}
    assert value(readings, "hyperagent_rdma_port_cqe_errors_total", side="requester", **port) == (
        3481
    )
    assert value(readings, "hyperagent_rdma_port_cqe_errors_total", side="responder", **port) == (
        8109
    )
    assert value(readings, "hyperagent_rdma_port_local_ack_timeouts_total", **port) == 131
    assert value(readings, "hyperagent_rdma_port_adaptive_retransmissions_total", **port) == 99
    assert value(readings, "hyperagent_rdma_port_out_of_sequence_packets_total", **port) == 1
    tail = "hyperagent_rdma_port_driver_stat_total"
    assert value(readings, tail, counter="rx_read_requests", **port) == 175528982
    assert value(readings, tail, counter="req_cqe_error", **port) is None
    assert value(readings, tail, counter="lifespan", **port) is None


def test_rxe_netdev_comes_from_the_tree() -> None:
    readings = sysfs_readings("rxe-qemu-e1000e")
    assert value(readings, "hyperagent_rdma_port_info", device="rxe0", netdev="eth0") == 1.0
    assert value(readings, "hyperagent_rdma_netdev_mtu_bytes", netdev="eth0") == 1500
    assert value(readings, "hyperagent_rdma_port_duplicate_requests_total", device="rxe0") == 1567
    assert value(readings, "hyperagent_rdma_port_driver_stat_total", counter="sent_pkts") == 168811


def test_queue_pairs_are_counted_not_listed() -> None:
    readings = parse_rdma_qps((OUTPUTS / "rxe-qemu-virtio" / "rdma-resource-qp.json").read_text())
    port = {"device": "rxe0", "port": "1"}
    assert value(readings, "hyperagent_rdma_qps", state="RTS", type="RC", **port) == 6
    assert value(readings, "hyperagent_rdma_qps", state="RTR", type="RC", **port) == 4
    assert value(readings, "hyperagent_rdma_qps", state="RTS", type="UD", **port) == 2
    assert value(readings, "hyperagent_rdma_qps", state="RTS", type="GSI", **port) == 1
    assert len(readings) == 4


def test_completion_queues_are_counted_per_device() -> None:
    text = (OUTPUTS / "rxe-qemu-e1000e" / "rdma-resource-cq.json").read_text()
    readings = parse_rdma_cqs(text, devices=["rxe0", "mlx5_0"])
    assert value(readings, "hyperagent_rdma_cqs", device="rxe0") == 7
    assert value(readings, "hyperagent_rdma_cqs", device="mlx5_0") == 0


def test_link_level_flow_control_is_the_global_priority() -> None:
    readings = parse_ethtool_pause(
        (OUTPUTS / "rxe-qemu-e1000e" / "ethtool-S-eth0.txt").read_text(), "eth0"
    )
    assert {(r.labels["direction"], r.labels["priority"]) for r in readings} == {
        ("received", "global"),
        ("transmitted", "global"),
    }
    assert (
        parse_ethtool_pause((OUTPUTS / "rxe-qemu-virtio" / "ethtool-S-eth0.txt").read_text(), "e")
        == []
    )


def test_pfc_statistic_names_of_mlx5_bnxt_and_i40e() -> None:
    """Statistic names as mlx5 (en_stats.c), bnxt_en and i40e print them; values are arbitrary."""
    text = "\n".join(
        [
            "NIC statistics:",
            "     rx_prio3_pause: 41927",
            "     rx_prio3_pause_duration: 8134",
            "     tx_prio3_pause: 1290418",
            "     tx_prio3_pause_duration: 2914772",
            "     rx_prio3_pause_transition: 39218",
            "     rx_global_pause_duration: 250",
            "     tx_pause_ctrl_phy: 1290418",
            "     rx_prio3_packets: 20693166921",
            "     [0]: rx_pause_frames: 5",
            "     tx_pfc_ena_frames_pri5: 12",
            "     pfc_pri5_tx_duration_us: 1500000",
            "     port.rx_priority_4_xon_rx: 9",
            "     port.rx_priority_4_xoff_rx: 3",
            "     port.link_xoff_tx: 2",
        ]
    )
    readings = parse_ethtool_pause(text, "ens1f0np0")
    assert_well_formed(readings)
    frames = "hyperagent_rdma_pfc_pause_frames_total"
    seconds = "hyperagent_rdma_pfc_pause_duration_seconds_total"
    assert value(readings, frames, direction="received", priority="3") == 41927
    assert value(readings, frames, direction="transmitted", priority="3") == 1290418
    assert value(readings, seconds, direction="received", priority="3") == pytest.approx(8.134e-3)
    assert value(readings, seconds, direction="transmitted", priority="3") == pytest.approx(
        2.914772
    )
    assert value(readings, seconds, direction="received", priority="global") == pytest.approx(
        250e-6
    )
    assert value(readings, "hyperagent_rdma_pfc_pause_transitions_total", priority="3") == 39218
    assert value(readings, "hyperagent_rdma_phy_pause_frames_total", direction="transmitted") == (
        1290418
    )
    assert value(readings, frames, direction="transmitted", priority="5") == 12
    assert value(readings, seconds, direction="transmitted", priority="5") == pytest.approx(1.5)
    assert value(readings, frames, direction="received", priority="4") == 3
    assert value(readings, frames, direction="transmitted", priority="global") == 2
    assert value(readings, frames, direction="received", priority="global") is None
    assert len(readings) == 11


def test_every_metric_has_help_text() -> None:
    tables = (PMA_COUNTERS, PMA_EXT_COUNTERS, HW_COUNTERS)
    names = {counter.metric for table in tables for counter in table.values()}
    names |= {metric for _, metric, _ in PAUSE_STATISTICS}
    assert names <= set(HELP)
    assert all(text.endswith(".") and "\n" not in text for text in HELP.values())


def copy_tree(name: str, tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(SYSFS_ROOTS[name], root, symlinks=True)
    return root


def test_a_garbage_counter_file_is_skipped_and_counted(tmp_path: Path) -> None:
    root = copy_tree("procfs", tmp_path)
    port = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "counters" / "port_xmit_data").write_text("lots\n")
    (port / "hw_counters" / "out_of_buffer").write_text("-3\n")
    (port / "rate").write_text("fast\n")
    (port / "state").write_bytes(b"\xff\xfe\n")
    readings = parse_sysfs(read_sysfs(root))
    labels = {"device": "mlx5_0", "port": "1"}
    assert value(readings, "hyperagent_rdma_port_data_transmitted_bytes_total", **labels) is None
    assert value(readings, "hyperagent_rdma_port_out_of_buffer_drops_total", **labels) is None
    assert value(readings, "hyperagent_rdma_port_rate_bytes_per_second", **labels) is None
    assert value(readings, "hyperagent_rdma_port_state", **labels) is None
    assert value(readings, "hyperagent_rdma_port_info", state="", **labels) == 1.0
    assert value(readings, "hyperagent_rdma_port_data_received_bytes_total", **labels) == (
        18126345378 * 4
    )
    assert value(readings, "hyperagent_rdma_unreadable_files") == 4
    assert_well_formed(readings)


async def test_a_file_that_cannot_be_read_puts_the_source_down(tmp_path: Path) -> None:
    from hyperagent.capture.fake_nvml import FakeNvml
    from hyperagent.sources.nvml import NvmlSource
    from hyperagent.sources.runner import SourceRunner

    root = copy_tree("rxe-qemu-e1000e", tmp_path)
    counter = root / "class" / "infiniband" / "rxe0" / "ports" / "1" / "hw_counters" / "send_err"
    counter.unlink()
    counter.symlink_to("/proc/self/mem")  # a regular file whose read fails with EIO
    with pytest.raises(SourceError, match="send_err: Input/output error"):
        read_sysfs(root)
    gpus = NvmlSource(FakeNvml.from_capture(FIXTURES / "nvidia-smi" / "tesla-t4.xml"))
    runner = SourceRunner([RdmaSource(root, None), gpus], timeout_s=5)
    await runner.start()
    readings = await runner.read_all()
    up = {r.labels["source"]: r.value for r in readings if r.name == "hyperagent_source_up"}
    assert up == {"rdma": 0.0, "nvml": 1.0}
    assert any(r.name == "hyperagent_gpu_power_watts" for r in readings)
    await runner.close()


def test_garbage_mtu_is_skipped_and_counted(tmp_path: Path) -> None:
    root = copy_tree("rxe-qemu-e1000e", tmp_path)
    (root / "class" / "net" / "eth0" / "mtu").write_text("jumbo\n")
    readings = parse_sysfs(read_sysfs(root))
    assert value(readings, "hyperagent_rdma_netdev_mtu_bytes", netdev="eth0") is None
    assert value(readings, "hyperagent_rdma_unreadable_files") == 1


async def test_absent_infiniband_class_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "class" / "net").mkdir(parents=True)
    source = RdmaSource(sysfs_root=tmp_path, run_command=None)
    with pytest.raises(SourceUnavailable):
        await source.read()
    (tmp_path / "class" / "infiniband").mkdir()
    with pytest.raises(SourceUnavailable):
        await source.read()


@pytest.mark.parametrize(
    "text",
    ["", "Failed to open NETLINK_RDMA socket\n", '{"ifname": "rxe0"}', "[1, 2"],
)
def test_rdma_output_that_is_not_a_json_list_is_an_error(text: str) -> None:
    with pytest.raises(SourceError):
        parse_rdma_qps(text)
    with pytest.raises(SourceError):
        parse_rdma_cqs(text)


def test_rdma_entries_without_a_device_are_skipped() -> None:
    text = '[{"ifname":"rxe0","lqpn":1,"type":"GSI","state":"RTS"}, 7, {"lqpn": 2}, null]'
    assert [r.value for r in parse_rdma_qps(text)] == [1.0]
    assert [r.labels["device"] for r in parse_rdma_cqs(text)] == ["rxe0"]


def test_ethtool_output_without_statistics_is_an_error_and_bad_values_are_skipped() -> None:
    with pytest.raises(SourceError):
        parse_ethtool_pause("Cannot get stats strings information: Operation not supported\n", "x")
    text = "NIC statistics:\n     rx_prio0_pause: n/a\n     tx_prio0_pause: 7\n"
    readings = parse_ethtool_pause(text, "eth0")
    assert [(r.labels["direction"], r.value) for r in readings] == [("transmitted", 7.0)]


async def test_failing_commands_leave_the_sysfs_readings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "rdma-resource-qp.json").write_text("not json\n")
    shutil.copy(OUTPUTS / "rxe-qemu-e1000e" / "rdma-resource-cq.json", tmp_path)
    source = RdmaSource(SYSFS_ROOTS["rxe-qemu-e1000e"], capture_runner(tmp_path))
    with caplog.at_level(logging.DEBUG, logger="hyperagent.sources.rdma"):
        await source.read()
        readings = await source.read()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not JSON" in warnings[0].getMessage()
    missing = [r for r in caplog.records if "ethtool-S-eth0.txt" in r.getMessage()]
    assert [r.levelno for r in missing] == [logging.DEBUG]
    up = "hyperagent_rdma_command_up"
    assert value(readings, up, command="rdma -j resource show qp") == 0.0
    assert value(readings, up, command="rdma -j resource show cq") == 1.0
    assert value(readings, up, command="ethtool -S eth0") == 0.0
    assert value(readings, "hyperagent_rdma_cqs", device="rxe0") == 7
    assert value(readings, "hyperagent_rdma_port_duplicate_requests_total", device="rxe0") == 1567
    assert [r for r in readings if r.name == "hyperagent_rdma_qps"] == []


async def test_commands_run_at_most_once_per_interval_while_sysfs_is_read_every_time(
    tmp_path: Path,
) -> None:
    ran: list[str] = []
    capture = capture_runner(REPLAY)

    async def counting(argv: Sequence[str]) -> str:
        ran.append(" ".join(argv))
        return await capture(argv)

    now = [100.0]
    root = tmp_path / "sys"
    shutil.copytree(SYSFS_ROOTS["rxe-qemu-e1000e"], root, symlinks=True)
    source = RdmaSource(root, counting, commands_interval_s=5.0, clock=lambda: now[0])
    first = await source.read()
    assert len(ran) == 3  # qp, cq, ethtool -S eth0
    counter = root / "class/infiniband/rxe0/ports/1/hw_counters/duplicate_request"
    counter.write_text("123456789\n")
    now[0] += 4.0
    second = await source.read()
    assert len(ran) == 3
    assert value(second, "hyperagent_rdma_port_duplicate_requests_total") == 123456789
    assert value(second, "hyperagent_rdma_cqs", device="rxe0") == value(
        first, "hyperagent_rdma_cqs", device="rxe0"
    )
    now[0] += 1.0
    await source.read()
    assert len(ran) == 6


async def test_without_a_command_runner_only_sysfs_is_read() -> None:
    source = RdmaSource(SYSFS_ROOTS["rxe-qemu-e1000e"], run_command=None)
    readings = await source.read()
    assert render(readings) == render(sysfs_readings("rxe-qemu-e1000e"))


async def test_configured_netdevs_are_read_when_the_tree_does_not_tell(tmp_path: Path) -> None:
    shutil.copy(OUTPUTS / "rxe-qemu-e1000e" / "ethtool-S-eth0.txt", tmp_path)
    asked: list[tuple[str, ...]] = []
    replay = capture_runner(tmp_path)

    async def recording(argv: Sequence[str]) -> str:
        asked.append(tuple(argv))
        return await replay(argv)

    source = RdmaSource(SYSFS_ROOTS["procfs"], recording, netdevs=["eth0"])
    readings = await source.read()
    assert ("ethtool", "-S", "eth0") in asked
    assert value(readings, "hyperagent_rdma_command_up", command="ethtool -S eth0") == 1.0
    assert value(readings, "hyperagent_rdma_pfc_pause_frames_total", direction="received") == 0


async def test_capture_runner_answers_from_files_and_misses_cleanly() -> None:
    run = capture_runner(OUTPUTS / "rxe-qemu-virtio")
    assert (await run(RDMA_QP_COMMAND)).startswith("[{")
    with pytest.raises(CaptureMissing) as missing:
        await run(("ethtool", "-S", "ib0"))
    assert isinstance(missing.value, FileNotFoundError)
    assert isinstance(missing.value, SourceUnavailable)
    with pytest.raises(CommandFailed):
        await run(("rdma", "-j", "resource", "show", "mr"))


async def test_a_read_still_running_refuses_the_next() -> None:
    release = asyncio.Event()
    replay = capture_runner(REPLAY)

    async def slow(argv: Sequence[str]) -> str:
        await release.wait()
        return await replay(argv)

    source = RdmaSource(REPLAY / "sys", slow)
    first = asyncio.create_task(source.read())
    try:
        await asyncio.sleep(0.05)
        with pytest.raises(SourceError, match="still running"):
            await asyncio.wait_for(source.read(), 5)
        release.set()
        assert render(await asyncio.wait_for(first, 5)) == render(await replay_source(REPLAY))
    finally:
        release.set()
        first.cancel()
        await source.close()


async def test_a_timed_out_read_keeps_refusing_until_it_ends() -> None:
    release = asyncio.Event()
    replay = capture_runner(REPLAY)

    async def slow(argv: Sequence[str]) -> str:
        await release.wait()
        return await replay(argv)

    source = RdmaSource(REPLAY / "sys", slow)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await source.read()
        with pytest.raises(SourceError, match="still running"):
            await asyncio.wait_for(source.read(), 5)
        release.set()
        async with asyncio.timeout(5):
            while True:
                try:
                    readings = await source.read()
                except SourceError:
                    await asyncio.sleep(0.01)
                else:
                    break
        assert value(readings, "hyperagent_rdma_cqs", device="rxe0") == 7
    finally:
        release.set()
        await source.close()


async def test_run_command_matches_the_real_rdma_tool() -> None:
    rdma = require_binary("rdma", "iproute2")
    argv = (rdma, *RDMA_QP_COMMAND[1:])
    expected = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    if expected.returncode == 0:
        assert await run_command(argv) == expected.stdout
        parse_rdma_qps(expected.stdout)
    else:
        with pytest.raises(CommandFailed) as failed:
            await run_command(argv)
        assert failed.value.returncode == expected.returncode
        assert failed.value.stderr == expected.stderr.strip()


async def test_run_command_matches_the_real_ethtool() -> None:
    ethtool = require_binary("ethtool", "ethtool")
    for netdev in sorted(os.listdir("/sys/class/net")):
        argv = (ethtool, "-S", netdev)
        expected = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        if expected.returncode == 0:
            assert await run_command(argv) == expected.stdout
            assert_well_formed(parse_ethtool_pause(expected.stdout, netdev))
        else:
            with pytest.raises(CommandFailed) as failed:
                await run_command(argv)
            assert failed.value.returncode == expected.returncode


async def test_run_command_reports_missing_failing_and_slow_programs(tmp_path: Path) -> None:
    with pytest.raises(CommandUnavailable):
        await run_command((str(tmp_path / "no-such-tool"), "-j"))
    with pytest.raises(CommandFailed) as failed:
        await run_command(("sh", "-c", "echo broken >&2; exit 3"))
    assert (failed.value.returncode, failed.value.stderr) == (3, "broken")
    pid_file = tmp_path / "pid"
    began = time.monotonic()
    with pytest.raises(SourceTimeout):
        await run_command(("sh", "-c", f"echo $$ > {pid_file}; exec sleep 30"), timeout_s=0.3)
    assert time.monotonic() - began < 5
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(int(pid_file.read_text()), 0)


async def test_the_real_tools_never_stop_the_sysfs_readings() -> None:
    require_binary("rdma", "iproute2")
    require_binary("ethtool", "ethtool")
    source = RdmaSource(SYSFS_ROOTS["rxe-qemu-e1000e"], netdevs=["lo"])
    readings = await asyncio.wait_for(source.read(), 20)
    assert_well_formed(readings)
    commands = {
        r.labels["command"]: r.value for r in readings if r.name == "hyperagent_rdma_command_up"
    }
    assert set(commands) == {
        "rdma -j resource show qp",
        "rdma -j resource show cq",
        "ethtool -S eth0",
        "ethtool -S lo",
    }
    assert commands["ethtool -S lo"] == 0.0  # loopback has no NIC statistics
    assert value(readings, "hyperagent_rdma_port_duplicate_requests_total", device="rxe0") == 1567


def test_sysfs_odd_files_read_as_path_read_text_did(tmp_path: Path) -> None:
    """Files are read with one open/read/close and no stat first: a directory in place of an
    attribute is left out like a missing one, CRLF text and counters past one read still parse,
    and a directory in place of the netdev's MTU file is an error naming it."""
    root = copy_tree("rxe-qemu-e1000e", tmp_path)
    device = root / "class" / "infiniband" / "rxe0"
    (device / "fw_ver").unlink()
    (device / "fw_ver").mkdir()
    (device / "ports" / "1" / "rate").write_text("10 Gb/sec (1X QDR)\r\n")
    (device / "ports" / "1" / "hw_counters" / "send_err").write_text(" " * 9000 + "17\n")
    readings = parse_sysfs(read_sysfs(root))
    labels = {"device": "rxe0", "port": "1"}
    assert value(readings, "hyperagent_rdma_device_info", device="rxe0", fw_ver="") == 1.0
    assert value(readings, "hyperagent_rdma_port_rate_bytes_per_second", **labels) == 1.25e9
    counter = {**labels, "counter": "send_err"}
    assert value(readings, "hyperagent_rdma_port_driver_stat_total", **counter) == 17.0
    assert value(readings, "hyperagent_rdma_unreadable_files") == 0
    mtu = root / "class" / "net" / "eth0" / "mtu"
    mtu.unlink()
    mtu.mkdir()
    with pytest.raises(SourceError, match="eth0/mtu: Is a directory"):
        read_sysfs(root)


# -- the held-file reader ------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("tree", sorted(SYSFS_ROOTS))
def test_held_file_reads_equal_a_fresh_walk(tree: str) -> None:
    now = [0.0]
    reader = SysfsReader(SYSFS_ROOTS[tree], clock=lambda: now[0])
    first = reader.read()
    now[0] += 1.0
    assert reader.read() == first == read_sysfs(SYSFS_ROOTS[tree])
    reader.close()


def test_counters_written_between_walks_are_read_without_walking(tmp_path: Path) -> None:
    root = copy_tree("rxe-qemu-e1000e", tmp_path)
    port = root / "class" / "infiniband" / "rxe0" / "ports" / "1"
    now = [0.0]
    reader = SysfsReader(root, rescan_interval_s=10.0, clock=lambda: now[0])
    reader.read()
    held = open_fds()
    (port / "hw_counters" / "duplicate_request").write_text("4242\n")
    (port / "state").write_text("1: DOWN\n")
    (root / "class" / "infiniband" / "rxe0" / "fw_ver").write_text("9.9.9\n")
    now[0] += 5.0
    readings = parse_sysfs(reader.read())
    assert open_fds() == held
    labels = {"device": "rxe0", "port": "1"}
    assert value(readings, "hyperagent_rdma_port_duplicate_requests_total", **labels) == 4242
    assert value(readings, "hyperagent_rdma_port_state", **labels) == 1.0
    assert value(readings, "hyperagent_rdma_device_info", device="rxe0", fw_ver="") == 1.0
    now[0] += 5.0  # the walk picks up the identity files
    readings = parse_sysfs(reader.read())
    assert value(readings, "hyperagent_rdma_device_info", device="rxe0", fw_ver="9.9.9") == 1.0
    reader.close()
    assert open_fds() < held


def test_a_device_that_appears_is_found_at_the_next_walk(tmp_path: Path) -> None:
    root = copy_tree("rxe-qemu-e1000e", tmp_path)
    infiniband = root / "class" / "infiniband"
    now = [0.0]
    reader = SysfsReader(root, rescan_interval_s=10.0, clock=lambda: now[0])
    assert [d.name for d in reader.read().devices] == ["rxe0"]
    shutil.copytree(infiniband / "rxe0", infiniband / "rxe1", symlinks=True)
    now[0] += 9.0
    assert [d.name for d in reader.read().devices] == ["rxe0"]
    now[0] += 1.0
    assert [d.name for d in reader.read().devices] == ["rxe0", "rxe1"]
    reader.close()


def test_a_held_file_that_fails_makes_the_reader_walk_again(tmp_path: Path) -> None:
    """A removed device's sysfs files fail on read (ENODEV); here a counter is a process's
    /proc file, which fails (ESRCH) once the process is gone. The reader walks the tree again at
    once: the vanished counter is no longer reported, the others are read as before."""
    root = copy_tree("rxe-qemu-e1000e", tmp_path)
    counters = root / "class" / "infiniband" / "rxe0" / "ports" / "1" / "hw_counters"
    child = subprocess.Popen(["sleep", "60"])
    try:
        (counters / "vanishing").symlink_to(f"/proc/{child.pid}/oom_score_adj")
        reader = SysfsReader(root, rescan_interval_s=3600.0, clock=lambda: 0.0)
        before = parse_sysfs(reader.read())
        counter = {"device": "rxe0", "port": "1", "counter": "vanishing"}
        assert value(before, "hyperagent_rdma_port_driver_stat_total", **counter) == 0.0
    finally:
        child.kill()
        child.wait()
    after = parse_sysfs(reader.read())
    assert value(after, "hyperagent_rdma_port_driver_stat_total", **counter) is None
    assert render(after) == render(parse_sysfs(read_sysfs(root)))
    assert value(after, "hyperagent_rdma_unreadable_files") == 0
    reader.close()


def test_a_low_descriptor_limit_leaves_the_reader_reading_by_path() -> None:
    """Under a low RLIMIT_NOFILE the reader holds a quarter of it and opens the other files by
    path on each read: every file is still read, and descriptors are left for the rest."""
    script = f"""
import os, resource
from pathlib import Path
from hyperagent.sources.rdma_ports import parse_sysfs
from hyperagent.sources.rdma_sysfs import SysfsReader, read_sysfs
root = Path({str(SYSFS_ROOTS["procfs"])!r})
expected = parse_sysfs(read_sysfs(root))
resource.setrlimit(resource.RLIMIT_NOFILE, (40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
before = len(os.listdir("/proc/self/fd"))
reader = SysfsReader(root, clock=lambda: 0.0)
reader.read()
print(len(os.listdir("/proc/self/fd")) - before)
assert parse_sysfs(reader.read()) == expected
print("same")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    held, same = done.stdout.split()
    assert (int(held), same) == (10, "same")


def test_a_rescan_interval_of_zero_walks_on_every_read(tmp_path: Path) -> None:
    root = copy_tree("rxe-qemu-e1000e", tmp_path)
    infiniband = root / "class" / "infiniband"
    reader = SysfsReader(root, rescan_interval_s=0.0, clock=lambda: 0.0)
    before = open_fds()
    assert [d.name for d in reader.read().devices] == ["rxe0"]
    assert open_fds() == before
    shutil.copytree(infiniband / "rxe0", infiniband / "rxe1", symlinks=True)
    assert [d.name for d in reader.read().devices] == ["rxe0", "rxe1"]


def _port_tree(root: Path, device: str, xmit: int, rcv: int) -> None:
    """A device's port 1 as the kernel lays it out: data in ``counters`` (the extended width
    the core shows there when the PMA has it) and ``counters_ext``."""
    port = root / "class" / "infiniband" / device / "ports" / "1"
    for group, suffix in (("counters", ""), ("counters_ext", "_64")):
        (port / group).mkdir(parents=True)
        (port / group / f"port_xmit_data{suffix}").write_text(f"{xmit}\n")
        (port / group / f"port_rcv_data{suffix}").write_text(f"{rcv}\n")
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("InfiniBand\n")


def _data_bytes(readings: Sequence[Reading], device: str) -> tuple[float, float]:
    def value(name: str) -> float:
        return next(r.value for r in readings if r.name == name and r.labels["device"] == device)

    return (
        value("hyperagent_rdma_port_data_transmitted_bytes_total"),
        value("hyperagent_rdma_port_data_received_bytes_total"),
    )


async def test_omni_path_data_counters_count_8_byte_flits(tmp_path: Path) -> None:
    """hfi1 answers PortXmitData/PortRcvData with its flit counters (8 bytes each), where
    InfiniBand and RoCE devices count 4-byte words: the same counter values are twice the
    bytes on an Omni-Path HFI."""
    root = tmp_path / "sys"
    _port_tree(root, "hfi1_0", xmit=1_000_000, rcv=250)
    _port_tree(root, "mlx5_0", xmit=1_000_000, rcv=250)
    readings = parse_sysfs(read_sysfs(root))
    assert _data_bytes(readings, "hfi1_0") == (8_000_000, 2_000)
    assert _data_bytes(readings, "mlx5_0") == (4_000_000, 1_000)
    source = RdmaSource(root, None)
    try:
        assert _data_bytes(await source.read(), "hfi1_0") == (8_000_000, 2_000)
    finally:
        await source.close()


def test_omni_path_32_bit_counters_count_flits_too(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    _port_tree(root, "hfi1_1", xmit=3, rcv=5)
    for name in ("port_xmit_data_64", "port_rcv_data_64"):
        (root / "class/infiniband/hfi1_1/ports/1/counters_ext" / name).unlink()
    assert _data_bytes(parse_sysfs(read_sysfs(root)), "hfi1_1") == (24, 40)


def test_omni_path_is_told_by_its_driver_under_another_name(tmp_path: Path) -> None:
    """udev may rename RDMA devices (rdma-core's persistent names): the bound driver still
    tells an Omni-Path HFI, and a device named like one but bound to another driver is not."""
    root = tmp_path / "sys"
    drivers = tmp_path / "sys" / "bus" / "pci" / "drivers"
    for device, driver in (("ibp4s0", "hfi1"), ("hfi1_lookalike", "mlx5_core")):
        _port_tree(root, device, xmit=10, rcv=10)
        (drivers / driver).mkdir(parents=True, exist_ok=True)
        parent = root / "class" / "infiniband" / device / "device"
        parent.mkdir()
        (parent / "driver").symlink_to(drivers / driver)
    readings = parse_sysfs(read_sysfs(root))
    assert _data_bytes(readings, "ibp4s0") == (80, 80)
    assert _data_bytes(readings, "hfi1_lookalike") == (40, 40)

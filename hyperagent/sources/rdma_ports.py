"""Readings of RDMA ports from a sysfs snapshot: identity, state, rate and counters.

PMA port counters (``counters``, ``counters_ext``) and driver ``hw_counters`` map to one metric
each where the counter has a meaning of its own; every other counter is
``hyperagent_rdma_port_driver_stat_total{counter=<file name>}``. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from hyperagent.readings import Kind, Reading
from hyperagent.sources.rdma_sysfs import (
    DeviceFiles,
    PortFiles,
    SysfsSnapshot,
    attribute,
    port_netdev,
)

PMA_WORD_BYTES = 4
"""``port_xmit_data``/``port_rcv_data`` (and their ``_64`` forms) count 4-byte words on
InfiniBand and RoCE devices (IBA PortCounters: "data octets divided by 4")."""

OPA_FLIT_BYTES = 8
"""On Omni-Path (hfi1) the same files count 8-byte flits: the driver answers the PMA query with
its ``C_DC_XMIT_FLITS``/``C_DC_RCV_FLITS`` counters (``pma_get_opa_port_dctrs`` in
``drivers/infiniband/hw/hfi1/mad.c``), and Intel's OPA tools (opa-ff ``FLITS_PER_MB``) read
PortXmitData/PortRcvData "in units of flits (8 bytes)"."""

OPA_DRIVERS = frozenset({"hfi1"})
"""Kernel drivers of Omni-Path host fabric interfaces."""
OPA_DEVICE_PREFIXES = ("hfi1_",)
"""Names the Omni-Path driver gives its RDMA devices (``ib_register_device(..., "hfi1_%d")``),
for a tree without the ``device/driver`` link (udev may rename devices; the link stays)."""

HW_COUNTER_SETTINGS = frozenset({"lifespan"})
"""Files in ``hw_counters`` that are settings (the refresh period in ms), not counters."""


NO_PMA = "N/A (no PMA)"
"""What the kernel prints for a PMA counter of a device without a performance agent."""


@dataclass(frozen=True)
class _Counter:
    metric: str
    scale: float = 1.0
    labels: tuple[tuple[str, str], ...] = ()


def _c(metric: str, scale: float = 1.0, **labels: str) -> _Counter:
    return _Counter(f"hyperagent_rdma_port_{metric}", scale, tuple(labels.items()))


_DATA_TX = _c("data_transmitted_bytes_total", PMA_WORD_BYTES)
_DATA_RX = _c("data_received_bytes_total", PMA_WORD_BYTES)

PMA_COUNTERS: dict[str, _Counter] = {
    "port_xmit_data": _DATA_TX,
    "port_rcv_data": _DATA_RX,
    "port_xmit_packets": _c("packets_transmitted_total"),
    "port_rcv_packets": _c("packets_received_total"),
    "unicast_xmit_packets": _c("unicast_packets_transmitted_total"),
    "unicast_rcv_packets": _c("unicast_packets_received_total"),
    "multicast_xmit_packets": _c("multicast_packets_transmitted_total"),
    "multicast_rcv_packets": _c("multicast_packets_received_total"),
    "port_xmit_wait": _c("transmit_wait_total"),
    "port_xmit_discards": _c("transmit_discards_total"),
    "port_rcv_errors": _c("receive_errors_total"),
    "port_rcv_remote_physical_errors": _c("receive_remote_physical_errors_total"),
    "port_rcv_switch_relay_errors": _c("receive_switch_relay_errors_total"),
    "port_xmit_constraint_errors": _c("transmit_constraint_errors_total"),
    "port_rcv_constraint_errors": _c("receive_constraint_errors_total"),
    "symbol_error": _c("symbol_errors_total"),
    "link_error_recovery": _c("link_error_recoveries_total"),
    "link_downed": _c("link_downed_total"),
    "local_link_integrity_errors": _c("local_link_integrity_errors_total"),
    "excessive_buffer_overrun_errors": _c("excessive_buffer_overrun_errors_total"),
    "VL15_dropped": _c("vl15_dropped_total"),
}
"""``ports/N/counters``: the IBA PortCounters, one metric each."""

PMA_EXT_COUNTERS: dict[str, _Counter] = {
    "port_xmit_data_64": _DATA_TX,
    "port_rcv_data_64": _DATA_RX,
    "port_xmit_packets_64": PMA_COUNTERS["port_xmit_packets"],
    "port_rcv_packets_64": PMA_COUNTERS["port_rcv_packets"],
    "port_unicast_xmit_packets": PMA_COUNTERS["unicast_xmit_packets"],
    "port_unicast_rcv_packets": PMA_COUNTERS["unicast_rcv_packets"],
    "port_multicast_xmit_packets": PMA_COUNTERS["multicast_xmit_packets"],
    "port_multicast_rcv_packets": PMA_COUNTERS["multicast_rcv_packets"],
}
"""``ports/N/counters_ext``: 64-bit PortCountersExtended; they win over the 32-bit ones."""

_OPA_DATA_TX = _c("data_transmitted_bytes_total", OPA_FLIT_BYTES)
_OPA_DATA_RX = _c("data_received_bytes_total", OPA_FLIT_BYTES)
OPA_PMA_COUNTERS: dict[str, _Counter] = {
    **PMA_COUNTERS,
    "port_xmit_data": _OPA_DATA_TX,
    "port_rcv_data": _OPA_DATA_RX,
}
""":data:`PMA_COUNTERS` of an Omni-Path device: data in flits."""
OPA_PMA_EXT_COUNTERS: dict[str, _Counter] = {
    **PMA_EXT_COUNTERS,
    "port_xmit_data_64": _OPA_DATA_TX,
    "port_rcv_data_64": _OPA_DATA_RX,
}
""":data:`PMA_EXT_COUNTERS` of an Omni-Path device: data in flits."""


def is_omni_path(device: DeviceFiles) -> bool:
    """Whether an RDMA device is an Omni-Path HFI, whose data counters count flits: by its
    driver, else (no driver link in the tree) by the name the driver gives it."""
    if device.driver:
        return device.driver in OPA_DRIVERS
    return device.name.startswith(OPA_DEVICE_PREFIXES)


HW_COUNTERS: dict[str, _Counter] = {
    "out_of_buffer": _c("out_of_buffer_drops_total"),
    "out_of_sequence": _c("out_of_sequence_packets_total"),
    "packet_seq_err": _c("packet_sequence_errors_total"),
    "duplicate_request": _c("duplicate_requests_total"),
    "local_ack_timeout_err": _c("local_ack_timeouts_total"),
    "roce_adp_retrans": _c("adaptive_retransmissions_total"),
    "roce_adp_retrans_to": _c("adaptive_retransmission_timeouts_total"),
    "np_cnp_sent": _c("cnp_sent_total"),
    "rp_cnp_handled": _c("cnp_handled_total"),
    "np_ecn_marked_roce_packets": _c("ecn_marked_packets_total"),
    "req_cqe_error": _c("cqe_errors_total", side="requester"),
    "resp_cqe_error": _c("cqe_errors_total", side="responder"),
    "req_cqe_flush_error": _c("cqe_flush_errors_total", side="requester"),
    "resp_cqe_flush_error": _c("cqe_flush_errors_total", side="responder"),
    "link_downed": PMA_COUNTERS["link_downed"],
}
"""``ports/N/hw_counters`` with a metric of their own (mlx5 names; rxe shares two); every other
hw counter is ``hyperagent_rdma_port_driver_stat_total{counter=<file name>}``."""

DRIVER_COUNTER = "hyperagent_rdma_port_driver_stat_total"


_STATE = re.compile(r"^\s*(\d+)\s*:\s*(\S.*?)\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")


def parse_state(text: str) -> tuple[int, str]:
    """``"4: ACTIVE"`` -> (4, "ACTIVE"); raises ValueError on anything else."""
    match = _STATE.match(text)
    if not match:
        raise ValueError(f"not a state: {text!r}")
    return int(match.group(1)), match.group(2)


def parse_rate(text: str) -> float:
    """``"40 Gb/sec (4X QDR)"`` -> 5e9 bytes/s; raises ValueError on anything else."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"not a link rate: {text!r}")
    return float(match.group(1)) * 1e9 / 8


def _counter_value(text: str) -> int | None:
    """A counter file's value; None for the kernel's no-PMA marker; ValueError on garbage."""
    stripped = text.strip()
    if stripped == NO_PMA:
        return None
    value = int(stripped)
    if value < 0:
        raise ValueError(f"negative counter {stripped}")
    return value


class _PortReadings:
    """Collects one port's counter readings; the first source of a metric wins."""

    def __init__(self, device: str, port: str) -> None:
        self.base = {"device": device, "port": port}
        # Keyed by metric and the labels beyond the port's own (the same for every key): a
        # mapped counter's label tuple, or the file name of a driver counter.
        self.readings: dict[tuple[str, object], Reading] = {}
        self.unreadable = 0

    def counters(
        self, files: Mapping[str, str | None], known: Mapping[str, _Counter], tail: bool
    ) -> None:
        """Add the counter files of one directory; unknown names go to the tail when ``tail``."""
        base = self.base
        readings = self.readings
        for file, text in files.items():
            mapped = known.get(file)
            if file in HW_COUNTER_SETTINGS or (mapped is None and not tail):
                continue
            try:
                value = _counter_value(text if text is not None else "")
            except ValueError:
                self.unreadable += 1
                continue
            if value is None:
                continue
            if mapped is None:
                key: tuple[str, object] = (DRIVER_COUNTER, file)
                if key not in readings:
                    labels = {**base, "counter": file}
                    readings[key] = Reading(DRIVER_COUNTER, float(value), labels, Kind.COUNTER)
            else:
                key = (mapped.metric, mapped.labels)
                if key not in readings:
                    # Readings are immutable: the port's counters without labels of their own
                    # share its label dict.
                    labels = {**base, **dict(mapped.labels)} if mapped.labels else base
                    readings[key] = Reading(
                        mapped.metric, float(value * mapped.scale), labels, Kind.COUNTER
                    )


def _port_readings(
    device: DeviceFiles, port_name: str, port: PortFiles
) -> tuple[list[Reading], int]:
    labels = {"device": device.name, "port": port_name}
    out: list[Reading] = []
    unreadable = 0
    info = {**labels, "link_layer": attribute(port.attributes, "link_layer")}
    for file, metric, info_label in (
        ("state", "hyperagent_rdma_port_state", "state"),
        ("phys_state", "hyperagent_rdma_port_physical_state", "physical_state"),
    ):
        info[info_label] = ""
        if file not in port.attributes:
            continue
        try:
            number, state_name = parse_state(port.attributes[file] or "")
        except ValueError:
            unreadable += 1
            continue
        info[info_label] = state_name
        out.append(Reading(metric, float(number), labels))
    if "rate" in port.attributes:
        try:
            rate = parse_rate(port.attributes["rate"] or "")
        except ValueError:
            unreadable += 1
        else:
            out.append(Reading("hyperagent_rdma_port_rate_bytes_per_second", rate, labels))
    info["netdev"] = port_netdev(device, port)
    out.append(Reading("hyperagent_rdma_port_info", 1.0, info, Kind.INFO))

    counters = _PortReadings(device.name, port_name)
    opa = is_omni_path(device)
    counters.counters(port.counters_ext, OPA_PMA_EXT_COUNTERS if opa else PMA_EXT_COUNTERS, False)
    counters.counters(port.counters, OPA_PMA_COUNTERS if opa else PMA_COUNTERS, tail=True)
    counters.counters(port.hw_counters, HW_COUNTERS, tail=True)
    out.extend(counters.readings.values())
    return out, unreadable + counters.unreadable


def parse_sysfs(snapshot: SysfsSnapshot) -> list[Reading]:
    """Readings from a sysfs snapshot; a file with garbage content is left out and counted."""
    out: list[Reading] = []
    unreadable = 0
    for device in snapshot.devices:
        out.append(
            Reading(
                "hyperagent_rdma_device_info",
                1.0,
                {
                    "device": device.name,
                    "fw_ver": attribute(device.attributes, "fw_ver"),
                    "hca_type": attribute(device.attributes, "hca_type"),
                    "board_id": attribute(device.attributes, "board_id"),
                },
                Kind.INFO,
            )
        )
        for port_name, port in device.ports.items():
            readings, bad = _port_readings(device, port_name, port)
            out.extend(readings)
            unreadable += bad
    for netdev, text in snapshot.netdev_mtus.items():
        try:
            mtu = int((text or "").strip())
        except ValueError:
            unreadable += 1
            continue
        out.append(Reading("hyperagent_rdma_netdev_mtu_bytes", float(mtu), {"netdev": netdev}))
    out.append(Reading("hyperagent_rdma_unreadable_files", float(unreadable)))
    return out

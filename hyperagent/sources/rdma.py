"""RDMA ports, queues and RoCE flow control: sysfs counters, ``rdma`` resources, ``ethtool -S``.

Three kinds of raw data, each with a pure parser:

* the ``/sys/class/infiniband`` tree (PMA port counters, driver ``hw_counters``, port state and
  rate, device identity) and ``/sys/class/net/<netdev>/mtu``: :func:`read_sysfs` copies the
  text of the files into a :class:`SysfsSnapshot`, :func:`parse_sysfs` turns it into readings;
* ``rdma -j resource show qp`` and ``... cq``: :func:`parse_rdma_qps` and :func:`parse_rdma_cqs`
  count queue pairs per device, port, state and type and completion queues per device (never
  one series per queue);
* ``ethtool -S <netdev>`` of the netdevs behind RoCE ports: :func:`parse_ethtool_pause` keeps
  the pause (PFC and link-level flow control) frame, duration and transition counters.

Commands go through a ``RunCommand`` callable: :func:`run_command` runs the real tools under a
time bound, :func:`capture_runner` answers from a capture directory. A command that is missing
or fails only costs its own readings: ``hyperagent_rdma_command_up{command}`` is 0 for it, and
the sysfs readings are still reported.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import math
import os
import re
import resource
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.readings import Kind, Reading
from hyperagent.sources import command
from hyperagent.sources.command import (
    CommandFailed,
    RunCommand,
)
from hyperagent.sources.heldfile import OPEN_FLAGS, HeldFile, read_at_zero

log = logging.getLogger(__name__)

RDMA_QP_COMMAND = ("rdma", "-j", "resource", "show", "qp")
RDMA_CQ_COMMAND = ("rdma", "-j", "resource", "show", "cq")

PMA_WORD_BYTES = 4
"""``port_xmit_data``/``port_rcv_data`` (and their ``_64`` forms) count 4-byte words."""

HW_COUNTER_SETTINGS = frozenset({"lifespan"})
"""Files in ``hw_counters`` that are settings (the refresh period in ms), not counters."""

NO_PMA = "N/A (no PMA)"
"""What the kernel prints for a PMA counter of a device without a performance agent."""

NDEV_GIDS_SCANNED = 8
"""GID table entries probed for the port's netdev; the default GID (index 0) names it."""


HELP: dict[str, str] = {
    "hyperagent_rdma_device_info": (
        "RDMA device identity from sysfs: firmware version, HCA type and board id."
    ),
    "hyperagent_rdma_port_info": (
        "RDMA port link layer, state and physical state names, and the netdev behind the port."
    ),
    "hyperagent_rdma_port_state": (
        "RDMA port logical state number (1 down, 2 init, 3 armed, 4 active, 5 active-defer)."
    ),
    "hyperagent_rdma_port_physical_state": (
        "RDMA port physical state number (2 polling, 3 disabled, 5 link up, 7 phy test)."
    ),
    "hyperagent_rdma_port_rate_bytes_per_second": (
        "RDMA port link rate as sysfs reports it (lanes times signalling rate), in bytes/s."
    ),
    "hyperagent_rdma_port_data_transmitted_bytes_total": (
        "Bytes transmitted by the RDMA port (PMA PortXmitData, 4-byte words times 4)."
    ),
    "hyperagent_rdma_port_data_received_bytes_total": (
        "Bytes received by the RDMA port (PMA PortRcvData, 4-byte words times 4)."
    ),
    "hyperagent_rdma_port_packets_transmitted_total": "Packets transmitted by the RDMA port.",
    "hyperagent_rdma_port_packets_received_total": "Packets received by the RDMA port.",
    "hyperagent_rdma_port_unicast_packets_transmitted_total": (
        "Unicast packets transmitted by the RDMA port."
    ),
    "hyperagent_rdma_port_unicast_packets_received_total": (
        "Unicast packets received by the RDMA port."
    ),
    "hyperagent_rdma_port_multicast_packets_transmitted_total": (
        "Multicast packets transmitted by the RDMA port."
    ),
    "hyperagent_rdma_port_multicast_packets_received_total": (
        "Multicast packets received by the RDMA port."
    ),
    "hyperagent_rdma_port_transmit_wait_total": (
        "Ticks in which the RDMA port had data to send but no flow-control credits (PortXmitWait;"
        " the tick length is device-specific)."
    ),
    "hyperagent_rdma_port_transmit_discards_total": (
        "Outbound packets the RDMA port discarded (port down or congested)."
    ),
    "hyperagent_rdma_port_receive_errors_total": "Packets with errors received by the RDMA port.",
    "hyperagent_rdma_port_receive_remote_physical_errors_total": (
        "Packets received by the RDMA port marked with the EBP delimiter (a remote physical error)."
    ),
    "hyperagent_rdma_port_receive_switch_relay_errors_total": (
        "Packets the RDMA port received but could not forward (switch relay errors)."
    ),
    "hyperagent_rdma_port_transmit_constraint_errors_total": (
        "Packets not transmitted by the RDMA port because of partition or rate constraints."
    ),
    "hyperagent_rdma_port_receive_constraint_errors_total": (
        "Packets dropped by the RDMA port on receive because of partition or rate constraints."
    ),
    "hyperagent_rdma_port_symbol_errors_total": "Minor link errors detected on the RDMA port.",
    "hyperagent_rdma_port_link_error_recoveries_total": (
        "Times the RDMA port's link error recovery process completed successfully."
    ),
    "hyperagent_rdma_port_link_downed_total": (
        "Times the RDMA port's link failed to recover and went down."
    ),
    "hyperagent_rdma_port_local_link_integrity_errors_total": (
        "Times the RDMA port's local physical errors exceeded the link integrity threshold."
    ),
    "hyperagent_rdma_port_excessive_buffer_overrun_errors_total": (
        "Times the RDMA port's consecutive flow-control update errors exceeded the threshold."
    ),
    "hyperagent_rdma_port_vl15_dropped_total": (
        "Subnet management packets (VL15) the RDMA port dropped for lack of buffers."
    ),
    "hyperagent_rdma_port_out_of_buffer_drops_total": (
        "Packets the RDMA port dropped because no receive WQE was posted (hw_counters"
        " out_of_buffer)."
    ),
    "hyperagent_rdma_port_out_of_sequence_packets_total": (
        "Out-of-sequence packets received by the RDMA port (hw_counters out_of_sequence)."
    ),
    "hyperagent_rdma_port_packet_sequence_errors_total": (
        "NAK sequence errors received by the RDMA port (hw_counters packet_seq_err)."
    ),
    "hyperagent_rdma_port_duplicate_requests_total": (
        "Duplicate requests (already executed) received by the RDMA port."
    ),
    "hyperagent_rdma_port_local_ack_timeouts_total": (
        "Times a queue pair's ack timer expired at the sender (hw_counters local_ack_timeout_err)."
    ),
    "hyperagent_rdma_port_adaptive_retransmissions_total": (
        "RoCE adaptive retransmissions by the RDMA port (hw_counters roce_adp_retrans)."
    ),
    "hyperagent_rdma_port_adaptive_retransmission_timeouts_total": (
        "RoCE adaptive retransmission timeouts on the RDMA port (hw_counters roce_adp_retrans_to)."
    ),
    "hyperagent_rdma_port_cnp_sent_total": (
        "Congestion notification packets sent by the RDMA port as notification point (np_cnp_sent)."
    ),
    "hyperagent_rdma_port_cnp_handled_total": (
        "Congestion notification packets handled by the RDMA port as reaction point"
        " (rp_cnp_handled)."
    ),
    "hyperagent_rdma_port_ecn_marked_packets_total": (
        "RoCE packets received ECN-marked by the RDMA port (np_ecn_marked_roce_packets)."
    ),
    "hyperagent_rdma_port_cqe_errors_total": (
        "Completions with error on the RDMA port, by side (requester or responder)."
    ),
    "hyperagent_rdma_port_cqe_flush_errors_total": (
        "Completions flushed with error on the RDMA port, by side (requester or responder)."
    ),
    "hyperagent_rdma_port_driver_stat_total": (
        "Any other RDMA port counter from sysfs (hw_counters, or a PMA counter without its own"
        " metric), named by the kernel in the counter label; its unit is the driver's."
    ),
    "hyperagent_rdma_unreadable_files": (
        "RDMA sysfs files whose content could not be parsed in the latest read (their fields are"
        " left out; a file that cannot be read at all puts the source down)."
    ),
    "hyperagent_rdma_netdev_mtu_bytes": "MTU of a netdev behind an RDMA port, in bytes.",
    "hyperagent_rdma_qps": (
        "RDMA queue pairs by device, port (empty when unbound), state and type."
    ),
    "hyperagent_rdma_cqs": "RDMA completion queues per device.",
    "hyperagent_rdma_pfc_pause_frames_total": (
        "Pause frames received from or transmitted to the link peer by a netdev behind an RDMA"
        " port, per PFC priority (0-7) or 'global' for link-level 802.3x pause."
    ),
    "hyperagent_rdma_pfc_pause_duration_seconds_total": (
        "Time spent paused (received) or pausing the peer (transmitted), per PFC priority or"
        " 'global'."
    ),
    "hyperagent_rdma_pfc_pause_transitions_total": (
        "Transitions between paused and unpaused, per direction and PFC priority or 'global'."
    ),
    "hyperagent_rdma_phy_pause_frames_total": (
        "MAC control pause frames (PFC and link-level together) counted at the physical port"
        " (mlx5 *_pause_ctrl_phy)."
    ),
    "hyperagent_rdma_command_up": (
        "Whether the command (rdma resource show, ethtool -S) ran and its output parsed in the"
        " latest read."
    ),
}


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


@dataclass(frozen=True)
class PortFiles:
    """Raw text of one port's sysfs files; None marks a file that exists but could not be read."""

    attributes: Mapping[str, str | None] = field(default_factory=dict)
    counters: Mapping[str, str | None] = field(default_factory=dict)
    counters_ext: Mapping[str, str | None] = field(default_factory=dict)
    hw_counters: Mapping[str, str | None] = field(default_factory=dict)
    gid_netdevs: tuple[str, ...] = ()
    """Netdevs named by the port's GID attributes (``gid_attrs/ndevs``)."""


@dataclass(frozen=True)
class DeviceFiles:
    """Raw text of one RDMA device's sysfs files."""

    name: str
    attributes: Mapping[str, str | None] = field(default_factory=dict)
    ports: Mapping[str, PortFiles] = field(default_factory=dict)
    pci_netdevs: tuple[str, ...] = ()
    """Netdevs of the device's PCI function (``device/net/*``)."""


@dataclass(frozen=True)
class SysfsSnapshot:
    """What :func:`read_sysfs` found: the RDMA devices and the MTU files of their netdevs."""

    devices: tuple[DeviceFiles, ...]
    netdev_mtus: Mapping[str, str | None] = field(default_factory=dict)


DEVICE_ATTRIBUTES = ("fw_ver", "hca_type", "board_id", "parent")
PORT_ATTRIBUTES = ("state", "phys_state", "rate", "link_layer")


_UNSUPPORTED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENODATA, errno.ENOENT})
"""What the kernel answers for a counter the device does not support, or one that vanished."""

_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP})
"""Errors of opening a file that mean it is not there (what ``Path.exists`` ignores)."""

_DIRECTORY_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_DIRECTORY", 0)


class _Absent:
    """What :func:`_read_file` answers for a file that is not there (or is a directory)."""


_ABSENT_FILE = _Absent()


def _read_file(
    path: str,
    absent: frozenset[int] = frozenset(),
    directory_absent: bool = False,
    name: str = "",
    dir_fd: int | None = None,
) -> str | _Absent | None:
    """A file's text, read with one open, read and close (sysfs is read every cycle).

    ``_ABSENT_FILE`` when opening it fails with an errno in ``absent`` (or it is a directory
    and ``directory_absent``), None when the device does not support it. Any other failure to
    read (EIO, EACCES) fails the whole read: the source shows up 0 and names the file.
    With ``dir_fd``, the file ``name`` in that open directory is read (``path`` names it in
    errors): the kernel walks the directory's path once, not once per file."""
    try:
        fd = os.open(path if dir_fd is None else name, OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in absent:
            return _ABSENT_FILE
        if e.errno in _UNSUPPORTED:
            return None
        raise SourceError(f"cannot read {path}: {e.strerror}") from e
    try:
        data = read_at_zero(fd)
    except OSError as e:
        if directory_absent and e.errno == errno.EISDIR:
            return _ABSENT_FILE
        if e.errno in _UNSUPPORTED:
            return None
        raise SourceError(f"cannot read {path}: {e.strerror}") from e
    finally:
        os.close(fd)
    return _decode(data)


def _decode(data: bytes) -> str:
    text = data.decode(errors="replace")
    if "\r" in text:  # what text mode's universal newlines made of it
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _read_dir(directory: str) -> dict[str, str | None]:
    try:
        dir_fd = os.open(directory, _DIRECTORY_FLAGS)
    except OSError:
        return {}
    try:
        try:
            with os.scandir(dir_fd) as it:
                entries = sorted(it, key=_entry_name)
        except OSError:
            return {}
        files: dict[str, str | None] = {}
        for entry in entries:
            if entry.is_file():
                name = entry.name
                text = _read_file(f"{directory}/{name}", name=name, dir_fd=dir_fd)
                assert not isinstance(text, _Absent)
                files[name] = text
        return files
    finally:
        os.close(dir_fd)


def _entry_name(entry: os.DirEntry[str]) -> str:
    return entry.name


def _open_dir(directory: str) -> int | None:
    """An fd of ``directory`` to read files in it by name; None when it cannot be opened (the
    files are then opened by path, and fail as they would without it); FileNotFoundError
    when it does not exist (so neither do its files)."""
    try:
        return os.open(directory, _DIRECTORY_FLAGS)
    except FileNotFoundError:
        raise
    except OSError:
        return None


def _read_attributes(directory: str, names: Iterable[str]) -> dict[str, str | None]:
    """The files among ``names`` in ``directory``: one read attempt each, no stat first."""
    found: dict[str, str | None] = {}
    try:
        dir_fd = _open_dir(directory)
    except FileNotFoundError:
        return found
    try:
        for name in names:
            text = _read_file(f"{directory}/{name}", _ABSENT, True, name, dir_fd)
            if not isinstance(text, _Absent):
                found[name] = text
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    return found


def _gid_netdevs(port_dir: str) -> tuple[str, ...]:
    ndevs = f"{port_dir}/gid_attrs/ndevs"
    found: list[str] = []
    try:
        dir_fd = _open_dir(ndevs)
    except FileNotFoundError:
        return ()  # no GID table: every entry would be unsupported
    try:
        for index in range(NDEV_GIDS_SCANNED):
            text = _read_file(f"{ndevs}/{index}", name=str(index), dir_fd=dir_fd)
            name = text.strip() if isinstance(text, str) else ""
            if name and name not in found:
                found.append(name)
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    return tuple(found)


def _listdir(directory: str) -> tuple[str, ...]:
    try:
        return tuple(sorted(os.listdir(directory)))
    except OSError:
        return ()


def _read_device(name: str, device_dir: str) -> DeviceFiles:
    ports: dict[str, PortFiles] = {}
    ports_dir = f"{device_dir}/ports"
    for port in _listdir(ports_dir):
        port_dir = f"{ports_dir}/{port}"
        ports[port] = PortFiles(
            attributes=_read_attributes(port_dir, PORT_ATTRIBUTES),
            counters=_read_dir(f"{port_dir}/counters"),
            counters_ext=_read_dir(f"{port_dir}/counters_ext"),
            hw_counters=_read_dir(f"{port_dir}/hw_counters"),
            gid_netdevs=_gid_netdevs(port_dir),
        )
    return DeviceFiles(
        name=name,
        attributes=_read_attributes(device_dir, DEVICE_ATTRIBUTES),
        ports=ports,
        pci_netdevs=_listdir(f"{device_dir}/device/net"),
    )


def read_sysfs(sysfs_root: Path, netdevs: Sequence[str] = ()) -> SysfsSnapshot:
    """Copy the text of the RDMA devices' sysfs files under ``sysfs_root`` (blocking I/O).

    Raises SourceUnavailable when ``class/infiniband`` is absent or holds no device.
    """
    class_dir = sysfs_root / "class" / "infiniband"
    names = _listdir(str(class_dir))
    if not names:
        raise SourceUnavailable(f"no RDMA devices under {class_dir}")
    devices = tuple(_read_device(name, str(class_dir / name)) for name in names)
    snapshot = SysfsSnapshot(devices)
    mtus: dict[str, str | None] = {}
    for netdev in rdma_netdevs(snapshot, netdevs):
        text = _read_file(str(sysfs_root / "class" / "net" / netdev / "mtu"), _ABSENT)
        if not isinstance(text, _Absent):
            mtus[netdev] = text
    return SysfsSnapshot(devices, mtus)


RESCAN_INTERVAL_S = 10.0
"""How often :class:`SysfsReader` walks the tree again by default (devices and ports that come
or go, firmware versions, netdevs, MTUs)."""


class _Stale(Exception):
    """A held file failed: the tree changed under the reader (or the file cannot be read)."""


HELD_SHARE_OF_FD_LIMIT = 4
"""The reader holds at most a quarter of the process's descriptor limit (``RLIMIT_NOFILE``)
open; files beyond are opened by path on each read."""


def _read_held(held: HeldFile) -> str | None:
    """A held file's text now; None when the device does not support it. Raises _Stale."""
    try:
        data = held.read()
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return None
        raise _Stale(held.path) from e
    return _decode(data)


_PortHeld = tuple[str, dict[str, dict[str, HeldFile]]]
"""A port's name and its held files by group (attributes, counters, counters_ext, hw_counters)."""


class SysfsReader:
    """Reads the RDMA sysfs tree again and again, cheaply: the tree is walked (:func:`read_sysfs`)
    and its port state and counter files opened once, then each read is one ``pread(2)`` per
    file (sysfs makes an attribute's text afresh on every read at offset 0), without path
    lookups, directory listings or open and close calls.

    The identity files (device attributes, GID and PCI netdevs, MTUs) are what the latest walk
    found. The tree is walked again every ``rescan_interval_s`` (0: on every read), and at once
    when a held file fails: a device that went away, or a file that cannot be read, is then
    reported as a fresh walk reports it. Not thread-safe: one read at a time.
    """

    def __init__(
        self,
        sysfs_root: Path,
        netdevs: Sequence[str] = (),
        rescan_interval_s: float = RESCAN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sysfs_root = sysfs_root
        self.netdevs = tuple(netdevs)
        self.rescan_interval_s = rescan_interval_s
        self.clock = clock
        self._walked: SysfsSnapshot | None = None
        self._walked_at = -math.inf
        self._held: list[tuple[DeviceFiles, list[_PortHeld]]] = []

    def read(self) -> SysfsSnapshot:
        """The tree's files now (blocking I/O); raises as :func:`read_sysfs` does."""
        now = self.clock()
        if self._walked is None or now - self._walked_at >= self.rescan_interval_s:
            return self._walk(now)
        try:
            return self._reread(self._walked)
        except _Stale:
            return self._walk(now)

    def close(self) -> None:
        """Close the held files."""
        for _, ports in self._held:
            for _, groups in ports:
                for files in groups.values():
                    for held in files.values():
                        held.close()
        self._held = []
        self._walked = None

    def _walk(self, now: float) -> SysfsSnapshot:
        self.close()
        snapshot = read_sysfs(self.sysfs_root, self.netdevs)
        if self.rescan_interval_s <= 0:
            return snapshot  # walked on every read: nothing to hold
        class_dir = self.sysfs_root / "class" / "infiniband"
        budget = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // HELD_SHARE_OF_FD_LIMIT

        def held(path: str) -> HeldFile:
            nonlocal budget
            budget -= 1
            try:
                return HeldFile(path, hold=budget >= 0)
            except OSError as e:
                raise _Stale(path) from e

        try:
            for device in snapshot.devices:
                ports: list[_PortHeld] = []
                self._held.append((device, ports))
                for name, port in device.ports.items():
                    port_dir = f"{class_dir}/{device.name}/ports/{name}"
                    groups = {
                        "attributes": {a: held(f"{port_dir}/{a}") for a in port.attributes},
                        **{
                            group: {f: held(f"{port_dir}/{group}/{f}") for f in files}
                            for group, files in (
                                ("counters", port.counters),
                                ("counters_ext", port.counters_ext),
                                ("hw_counters", port.hw_counters),
                            )
                        },
                    }
                    ports.append((name, groups))
        except _Stale:  # the tree changed since the walk: walk again at the next read
            self.close()
            return snapshot
        self._walked, self._walked_at = snapshot, now
        return snapshot

    def _reread(self, walked: SysfsSnapshot) -> SysfsSnapshot:
        devices = []
        for device, ports in self._held:
            files = {}
            for name, groups in ports:
                texts = {
                    group: {f: _read_held(held) for f, held in held_files.items()}
                    for group, held_files in groups.items()
                }
                files[name] = PortFiles(
                    texts["attributes"],
                    texts["counters"],
                    texts["counters_ext"],
                    texts["hw_counters"],
                    device.ports[name].gid_netdevs,
                )
            devices.append(DeviceFiles(device.name, device.attributes, files, device.pci_netdevs))
        return SysfsSnapshot(tuple(devices), walked.netdev_mtus)


def _attribute(files: Mapping[str, str | None], name: str) -> str:
    return (files.get(name) or "").strip()


def port_netdev(device: DeviceFiles, port: PortFiles) -> str:
    """The netdev behind a port: its GID table's, else the device's parent or only PCI netdev."""
    if port.gid_netdevs:
        return port.gid_netdevs[0]
    parent = _attribute(device.attributes, "parent")
    if parent:
        return parent
    if len(device.pci_netdevs) == 1:
        return device.pci_netdevs[0]
    return ""


def rdma_netdevs(snapshot: SysfsSnapshot, configured: Sequence[str] = ()) -> list[str]:
    """Netdevs the tree associates with RDMA ports, then the configured ones, without repeats."""
    found: list[str] = []
    for device in snapshot.devices:
        candidates = [*device.pci_netdevs, _attribute(device.attributes, "parent")]
        for port in device.ports.values():
            candidates.extend(port.gid_netdevs)
        found.extend(c for c in candidates if c)
    return list(dict.fromkeys([*found, *configured]))


def roce_netdevs(snapshot: SysfsSnapshot, configured: Sequence[str] = ()) -> list[str]:
    """Netdevs behind Ethernet (RoCE/iWARP) ports, then the configured ones: where PFC applies."""
    found = [
        port_netdev(device, port)
        for device in snapshot.devices
        for port in device.ports.values()
        if _attribute(port.attributes, "link_layer") == "Ethernet"
    ]
    return list(dict.fromkeys([n for n in found if n] + list(configured)))


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
    info = {**labels, "link_layer": _attribute(port.attributes, "link_layer")}
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
    counters.counters(port.counters_ext, PMA_EXT_COUNTERS, tail=False)
    counters.counters(port.counters, PMA_COUNTERS, tail=True)
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
                    "fw_ver": _attribute(device.attributes, "fw_ver"),
                    "hca_type": _attribute(device.attributes, "hca_type"),
                    "board_id": _attribute(device.attributes, "board_id"),
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


def _json_list(text: str, what: str) -> list[Any]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise SourceError(f"{what}: output is not JSON: {e}") from e
    if not isinstance(data, list):
        raise SourceError(f"{what}: expected a JSON list, got {type(data).__name__}")
    return data


def parse_rdma_qps(text: str) -> list[Reading]:
    """``rdma -j resource show qp`` -> queue pairs counted per device, port, state and type.

    An entry without a device name is skipped; output that is not a JSON list raises SourceError.
    """
    counts: Counter[tuple[str, str, str, str]] = Counter()
    for entry in _json_list(text, "rdma resource show qp"):
        if not isinstance(entry, dict) or not isinstance(entry.get("ifname"), str):
            continue
        port = entry.get("port")
        counts[
            (
                entry["ifname"],
                "" if port is None else str(port),
                str(entry.get("state", "")),
                str(entry.get("type", "")),
            )
        ] += 1
    return [
        Reading(
            "hyperagent_rdma_qps",
            float(n),
            {"device": device, "port": port, "state": state, "type": qp_type},
        )
        for (device, port, state, qp_type), n in sorted(counts.items())
    ]


def parse_rdma_cqs(text: str, devices: Iterable[str] = ()) -> list[Reading]:
    """``rdma -j resource show cq`` -> completion queues per device (0 for ``devices`` without).

    An entry without a device name is skipped; output that is not a JSON list raises SourceError.
    """
    counts: Counter[str] = Counter({device: 0 for device in devices})
    for entry in _json_list(text, "rdma resource show cq"):
        if isinstance(entry, dict) and isinstance(entry.get("ifname"), str):
            counts[entry["ifname"]] += 1
    return [
        Reading("hyperagent_rdma_cqs", float(n), {"device": device})
        for device, n in sorted(counts.items())
    ]


FRAMES = "hyperagent_rdma_pfc_pause_frames_total"
DURATION = "hyperagent_rdma_pfc_pause_duration_seconds_total"
TRANSITIONS = "hyperagent_rdma_pfc_pause_transitions_total"
PHY_FRAMES = "hyperagent_rdma_phy_pause_frames_total"
MICROSECONDS = 1e-6

_DIRECTION = {"rx": "received", "tx": "transmitted"}

PAUSE_STATISTICS: tuple[tuple[re.Pattern[str], str, float], ...] = tuple(
    (re.compile(pattern), metric, scale)
    for pattern, metric, scale in (
        # mlx5 (ConnectX-4 and later)
        (r"(?P<dir>rx|tx)_prio(?P<prio>[0-7])_pause", FRAMES, 1.0),
        (r"(?P<dir>rx|tx)_prio(?P<prio>[0-7])_pause_duration", DURATION, MICROSECONDS),
        (r"(?P<dir>rx|tx)_prio(?P<prio>[0-7])_pause_transition", TRANSITIONS, 1.0),
        (r"(?P<dir>rx|tx)_global_pause", FRAMES, 1.0),
        (r"(?P<dir>rx|tx)_global_pause_duration", DURATION, MICROSECONDS),
        (r"(?P<dir>rx|tx)_global_pause_transition", TRANSITIONS, 1.0),
        (r"(?P<dir>rx|tx)_pause_ctrl_phy", PHY_FRAMES, 1.0),
        # bnxt_en (Broadcom NetXtreme-C/E, RoCE through bnxt_re)
        (r"(?P<dir>rx|tx)_pfc_ena_frames_pri(?P<prio>[0-7])", FRAMES, 1.0),
        (r"pfc_pri(?P<prio>[0-7])_(?P<dir>rx|tx)_duration_us", DURATION, MICROSECONDS),
        (r"pfc_pri(?P<prio>[0-7])_(?P<dir>rx|tx)_transitions", TRANSITIONS, 1.0),
        (r"(?P<dir>rx|tx)_pause_frames", FRAMES, 1.0),
        # i40e (X710/X722, iWARP/RoCE through i40iw/irdma): XOFF frames are the pause requests
        (r"port\.(?P<dir>rx|tx)_priority_(?P<prio>[0-7])_xoff_(?:rx|tx)", FRAMES, 1.0),
        (r"port\.link_xoff_(?P<dir>rx|tx)", FRAMES, 1.0),
        # e1000e, igb, ixgbe: link-level flow control
        (r"(?P<dir>rx|tx)_flow_control_xoff", FRAMES, 1.0),
    )
)
"""``ethtool -S`` statistic name patterns -> pause metric and scale to base units."""

_STATISTIC = re.compile(r"^\s*(?P<name>[A-Za-z0-9_.\-]+):\s*(?P<value>\S+)\s*$")


def parse_ethtool_statistics(text: str, what: str = "ethtool -S") -> dict[str, str]:
    """Name -> value text of the NIC-wide lines of ``ethtool -S`` (per-queue ``[n]:`` lines
    are left out). Raises SourceError when the text has no statistics header."""
    lines = text.splitlines()
    if not any(line.strip() == "NIC statistics:" for line in lines):
        raise SourceError(f"{what}: no 'NIC statistics:' header in the output")
    statistics: dict[str, str] = {}
    for line in lines:
        match = _STATISTIC.match(line)
        if match:
            statistics.setdefault(match.group("name"), match.group("value"))
    return statistics


def _pause_statistic() -> tuple[re.Pattern[str], dict[str, tuple[str, float, str, str | None]]]:
    """:data:`PAUSE_STATISTICS` as one pattern, each alternative in a group ``p<i>`` (the
    last group a match closes, so ``lastgroup``), and what each group stands for: metric,
    scale and the names of its direction and priority groups. Alternatives are tried in
    order, so the first pattern that matches a name wins, as it would one by one."""
    alternatives: list[str] = []
    meanings: dict[str, tuple[str, float, str, str | None]] = {}
    for i, (pattern, metric, scale) in enumerate(PAUSE_STATISTICS):
        source = pattern.pattern.replace("(?P<dir>", f"(?P<dir{i}>")
        source = source.replace("(?P<prio>", f"(?P<prio{i}>")
        alternatives.append(f"(?P<p{i}>{source})")
        prio = f"prio{i}" if "prio" in pattern.groupindex else None
        meanings[f"p{i}"] = (metric, scale, f"dir{i}", prio)
    return re.compile("|".join(alternatives)), meanings


_PAUSE_STATISTIC, _PAUSE_MEANINGS = _pause_statistic()
_PAUSE_HINTS = ("pause", "pfc", "xoff")
"""Every :data:`PAUSE_STATISTICS` name holds one of these: other lines are not parsed."""
_HEADER = "NIC statistics:"


def parse_ethtool_pause(text: str, netdev: str) -> list[Reading]:
    """Pause frame, duration and transition counters of ``ethtool -S <netdev>`` output.

    A pause statistic whose value is not a non-negative integer is skipped; text without a
    statistics header raises SourceError (as :func:`parse_ethtool_statistics`).
    """
    lines = text.splitlines()
    if _HEADER not in text or not any(line.strip() == _HEADER for line in lines if _HEADER in line):
        raise SourceError(f"ethtool -S {netdev}: no 'NIC statistics:' header in the output")
    out: list[Reading] = []
    seen: set[str] = set()  # the first line of a name counts, as in parse_ethtool_statistics
    hint_a, hint_b, hint_c = _PAUSE_HINTS
    for line in lines:
        if hint_a not in line and hint_b not in line and hint_c not in line:
            continue
        statistic = _STATISTIC.match(line)
        if not statistic:
            continue
        name, value_text = statistic.group("name", "value")
        if name in seen:
            continue
        seen.add(name)
        match = _PAUSE_STATISTIC.fullmatch(name)
        if not match:
            continue
        metric, scale, dir_group, prio_group = _PAUSE_MEANINGS[match.lastgroup or ""]
        try:
            value = int(value_text)
        except ValueError:
            log.debug("ethtool -S %s: %s is not a number: %r", netdev, name, value_text)
            continue
        if value < 0:
            continue
        labels = {"netdev": netdev, "direction": _DIRECTION[match.group(dir_group)]}
        if metric != PHY_FRAMES:
            labels["priority"] = (match.group(prio_group) if prio_group else None) or "global"
        out.append(Reading(metric, value * scale, labels, Kind.COUNTER))
    return out


def capture_file(argv: Sequence[str]) -> str:
    """The file of a capture directory that holds the output of ``argv``."""
    command = tuple(argv)
    if command == RDMA_QP_COMMAND:
        return "rdma-resource-qp.json"
    if command == RDMA_CQ_COMMAND:
        return "rdma-resource-cq.json"
    if len(command) == 3 and command[:2] == ("ethtool", "-S") and "/" not in command[2]:
        return f"ethtool-S-{command[2]}.txt"
    raise CommandFailed(f"a capture directory holds no output of {' '.join(argv)}", argv)


def capture_runner(directory: Path) -> RunCommand:
    """A RunCommand answering from a capture directory.

    ``rdma -j resource show qp|cq`` reads ``rdma-resource-qp.json``/``rdma-resource-cq.json``,
    ``ethtool -S NETDEV`` reads ``ethtool-S-NETDEV.txt``; an absent file raises CaptureMissing.
    """
    return command.capture_runner(directory, capture_file)


async def run_command(argv: Sequence[str], timeout_s: float = 1.5) -> str:
    """:func:`hyperagent.sources.command.run_command` with the RDMA tools' default bound."""
    return await command.run_command(argv, timeout_s)


class RdmaSource:
    """RDMA port counters and state from sysfs, queue counts from ``rdma``, PFC from ``ethtool``.

    ``sysfs_root`` is the sysfs mount (a capture's ``sys`` folder when replaying); ``run_command``
    runs ``rdma`` and ``ethtool`` (:func:`run_command`, :func:`capture_runner`), or None to read
    sysfs only; ``netdevs`` names RDMA netdevs the tree does not tell (they are added to the
    discovered ones). ``target`` is "local" for ``/sys``, else the sysfs root.
    ``commands_interval_s`` runs the commands at most that often (each run starts processes;
    queue counts and pause counters change slowly): reads in between repeat their readings,
    while the sysfs counters are read every time. Zero runs them on every read.
    ``rescan_interval_s``: how often the sysfs tree is walked again (:class:`SysfsReader`).
    """

    name = "rdma"

    def __init__(
        self,
        sysfs_root: Path = Path("/sys"),
        run_command: RunCommand | None = run_command,
        netdevs: Sequence[str] = (),
        commands_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        rescan_interval_s: float = RESCAN_INTERVAL_S,
    ) -> None:
        self.sysfs_root = sysfs_root
        self.reader = SysfsReader(sysfs_root, netdevs, rescan_interval_s, clock)
        self._reading: asyncio.Future[SysfsSnapshot] | None = None
        self.run_command = run_command
        self.netdevs = tuple(netdevs)
        self.commands_interval_s = commands_interval_s
        self.clock = clock
        self._commands_at = -math.inf
        self._command_readings: list[Reading] = []
        self.target = "local" if sysfs_root == Path("/sys") else str(sysfs_root)
        self._inflight: asyncio.Task[list[Reading]] | None = None
        self._problems: dict[str, str] = {}

    async def start(self) -> None:
        """Nothing to open: every read looks at the tree afresh."""

    async def read(self) -> list[Reading]:
        """One sample. SourceUnavailable without RDMA devices; SourceError while the previous
        read (which a caller's timeout does not stop) is still running."""
        if self._inflight is not None and not self._inflight.done():
            raise SourceError("previous RDMA read still running")
        task = asyncio.create_task(self._collect(), name=f"rdma-read:{self.target}")
        task.add_done_callback(_consume_outcome)
        self._inflight = task
        return await asyncio.shield(task)

    async def _collect(self) -> list[Reading]:
        reading = asyncio.get_running_loop().run_in_executor(None, self.reader.read)
        self._reading = reading  # the thread's own outcome: close waits for it, cancelled or not
        snapshot = await asyncio.shield(reading)
        readings = parse_sysfs(snapshot)
        run = self.run_command
        if run is None:
            return readings
        now = self.clock()
        if now - self._commands_at < self.commands_interval_s:
            return readings + self._command_readings
        self._command_readings = await self._run_commands(run, snapshot)
        self._commands_at = now
        return readings + self._command_readings

    async def _run_commands(self, run: RunCommand, snapshot: SysfsSnapshot) -> list[Reading]:
        readings: list[Reading] = []
        devices = [device.name for device in snapshot.devices]
        commands: list[tuple[Sequence[str], Callable[[str], list[Reading]]]] = [
            (RDMA_QP_COMMAND, parse_rdma_qps),
            (RDMA_CQ_COMMAND, functools.partial(_parse_cqs_of, devices)),
        ]
        for netdev in roce_netdevs(snapshot, self.netdevs):
            commands.append((("ethtool", "-S", netdev), functools.partial(_parse_pause_of, netdev)))
        results = await asyncio.gather(
            *(_run_and_parse(run, argv, parse) for argv, parse in commands),
            return_exceptions=True,
        )
        for (argv, _), result in zip(commands, results, strict=True):
            command = " ".join(argv)
            if isinstance(result, SourceError):
                self._note_problem(command, result)
                readings.append(Reading("hyperagent_rdma_command_up", 0.0, {"command": command}))
            elif isinstance(result, BaseException):
                raise result
            else:
                self._problems.pop(command, None)
                readings.extend(result)
                readings.append(Reading("hyperagent_rdma_command_up", 1.0, {"command": command}))
        return readings

    def _note_problem(self, command: str, error: SourceError) -> None:
        problem = str(error) or type(error).__name__
        if self._problems.get(command) != problem:
            level = logging.DEBUG if isinstance(error, SourceUnavailable) else logging.WARNING
            log.log(level, "rdma source: %s failed: %s", command, problem)
        self._problems[command] = problem

    async def close(self) -> None:
        """Cancel a read still in flight; close the held sysfs files once no thread reads them."""
        task, self._inflight = self._inflight, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._reading is not None and not self._reading.done():
            await asyncio.wait({self._reading})
        self.reader.close()


async def _run_and_parse(
    run: RunCommand, argv: Sequence[str], parse: Callable[[str], list[Reading]]
) -> list[Reading]:
    return parse(await run(argv))


def _parse_pause_of(netdev: str, text: str) -> list[Reading]:
    return parse_ethtool_pause(text, netdev)


def _parse_cqs_of(devices: Sequence[str], text: str) -> list[Reading]:
    return parse_rdma_cqs(text, devices)


def _consume_outcome(task: asyncio.Task[list[Reading]]) -> None:
    if not task.cancelled():
        task.exception()

"""RDMA ports, queues and RoCE flow control: sysfs counters, ``rdma`` resources, ``ethtool -S``.

The source (:class:`RdmaSource`) and its metrics' help; each kind of raw data has a module of
its own, by what it reads, with a pure parser:

* the ``/sys/class/infiniband`` tree (PMA port counters, driver ``hw_counters``, port state and
  rate, device identity) and ``/sys/class/net/<netdev>/mtu``:
  :mod:`hyperagent.sources.rdma_sysfs` copies the text of the files into a ``SysfsSnapshot``
  (``read_sysfs``, ``SysfsReader``), :mod:`hyperagent.sources.rdma_ports` turns it into
  readings (``parse_sysfs``; Omni-Path data counters count 8-byte flits, not 4-byte words);
* ``rdma -j resource show qp`` and ``... cq``: :mod:`hyperagent.sources.rdma_resources` counts
  queue pairs per device, port, state and type and completion queues per device (never one
  series per queue);
* ``ethtool -S <netdev>`` of the netdevs behind RoCE ports: :mod:`hyperagent.sources.rdma_ethtool`
  keeps the pause (PFC and link-level flow control) frame, duration and transition counters.

Commands go through a ``RunCommand`` callable: :func:`run_command` runs the real tools under a
time bound, :func:`capture_runner` answers from a capture directory. A command that is missing
or fails only costs its own readings: ``hyperagent_rdma_command_up{command}`` is 0 for it, and
the sysfs readings are still reported.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import hyperagent.sources.command as command
from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.readings import Reading
from hyperagent.sources.command import CommandFailed, RunCommand
from hyperagent.sources.rdma_ethtool import parse_ethtool_pause
from hyperagent.sources.rdma_ports import parse_sysfs
from hyperagent.sources.rdma_resources import (
    RDMA_CQ_COMMAND,
    RDMA_QP_COMMAND,
    parse_rdma_cqs,
    parse_rdma_qps,
)
from hyperagent.sources.rdma_sysfs import (
    RESCAN_INTERVAL_S,
    SysfsReader,
    SysfsSnapshot,
    roce_netdevs,
)

log = logging.getLogger(__name__)

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
        "Bytes transmitted by the RDMA port (PMA PortXmitData: 4-byte words times 4 on"
        " InfiniBand and RoCE, 8-byte flits times 8 on Omni-Path)."
    ),
    "hyperagent_rdma_port_data_received_bytes_total": (
        "Bytes received by the RDMA port (PMA PortRcvData: 4-byte words times 4 on"
        " InfiniBand and RoCE, 8-byte flits times 8 on Omni-Path)."
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

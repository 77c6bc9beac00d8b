"""The ``/sys/class/infiniband`` tree and the MTUs of its netdevs, read as text.

:func:`read_sysfs` walks the tree once and copies the text of the files into a
:class:`SysfsSnapshot`; :class:`SysfsReader` walks it, holds the counter files open and rereads
them with one ``pread(2)`` each. What the text means is :mod:`hyperagent.sources.rdma_ports`'.
"""

from __future__ import annotations

import errno
import math
import os
import resource
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.sources.heldfile import OPEN_FLAGS, HeldFile, read_at_zero

NDEV_GIDS_SCANNED = 8
"""GID table entries probed for the port's netdev; the default GID (index 0) names it."""


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
    driver: str = ""
    """The kernel driver bound to the device (``device/driver``), "" when not known."""


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
        driver=_driver(device_dir),
    )


def _driver(device_dir: str) -> str:
    """The name of the driver bound to the device's parent (``device/driver`` links to
    ``.../drivers/<name>``); "" when there is no such link."""
    try:
        return os.path.basename(os.readlink(f"{device_dir}/device/driver"))
    except OSError:
        return ""


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
            devices.append(
                DeviceFiles(
                    device.name, device.attributes, files, device.pci_netdevs, device.driver
                )
            )
        return SysfsSnapshot(tuple(devices), walked.netdev_mtus)


def attribute(files: Mapping[str, str | None], name: str) -> str:
    return (files.get(name) or "").strip()


def port_netdev(device: DeviceFiles, port: PortFiles) -> str:
    """The netdev behind a port: its GID table's, else the device's parent or only PCI netdev."""
    if port.gid_netdevs:
        return port.gid_netdevs[0]
    parent = attribute(device.attributes, "parent")
    if parent:
        return parent
    if len(device.pci_netdevs) == 1:
        return device.pci_netdevs[0]
    return ""


def rdma_netdevs(snapshot: SysfsSnapshot, configured: Sequence[str] = ()) -> list[str]:
    """Netdevs the tree associates with RDMA ports, then the configured ones, without repeats."""
    found: list[str] = []
    for device in snapshot.devices:
        candidates = [*device.pci_netdevs, attribute(device.attributes, "parent")]
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
        if attribute(port.attributes, "link_layer") == "Ethernet"
    ]
    return list(dict.fromkeys([n for n in found if n] + list(configured)))

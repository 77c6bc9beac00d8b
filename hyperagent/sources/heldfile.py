"""Kernel files read every cycle (sysfs attributes, procfs tables), opened once.

sysfs and procfs make a file's text afresh on every read at offset 0, so a file held open is
read again with one ``pread(2)``: no path lookup, no open and no close per read. Against a
capture directory on disk the same call reads a regular file.
"""

from __future__ import annotations

import errno
import os

OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
CHUNK = 8192
"""Bytes asked for per read: a sysfs attribute (at most a page) or /proc/meminfo comes in one."""


class HeldFile:
    """One kernel file, read again and again.

    The file is opened at construction (OSError as ``os.open`` raises it); with ``hold`` false,
    or when the process has no descriptor to spare (EMFILE, ENFILE), it is opened by path on
    each read instead.
    """

    __slots__ = ("fd", "path")

    def __init__(self, path: str, hold: bool = True) -> None:
        self.path = path
        self.fd: int | None = None
        if not hold:
            return
        try:
            self.fd = os.open(path, OPEN_FLAGS)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise

    def read(self, limit: int | None = None) -> bytes:
        """The file's content now, or its first ``limit`` bytes (at least; a chunk is read
        whole). Raises OSError as read(2) does (ENODEV once a device's sysfs entry is gone)."""
        fd = self.fd
        if fd is None:
            fd = os.open(self.path, OPEN_FLAGS)
            try:
                return read_at_zero(fd, limit)
            finally:
                os.close(fd)
        return read_at_zero(fd, limit)

    def close(self) -> None:
        """Close the descriptor (reads after this open the file by path)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_at_zero(fd: int, limit: int | None = None) -> bytes:
    """The content of the open file ``fd`` from offset 0 (its first ``limit`` bytes at least)."""
    data = os.pread(fd, CHUNK, 0)
    if len(data) < CHUNK or (limit is not None and len(data) >= limit):
        return data
    chunks = [data]
    offset = len(data)
    while chunk := os.pread(fd, CHUNK, offset):
        chunks.append(chunk)
        offset += len(chunk)
        if limit is not None and offset >= limit:
            break
    return b"".join(chunks)

"""systemd's notify protocol (sd_notify): READY, STATUS, WATCHDOG and STOPPING datagrams.

Written out rather than taken from the ``sdnotify`` package (unmaintained since 2017, and it
hides send errors): the protocol is one datagram per message to ``$NOTIFY_SOCKET``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Talks to the service manager when ``NOTIFY_SOCKET`` is set; otherwise does nothing."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, **fields: str) -> None:
        """Send ``KEY=value`` lines, e.g. ``send(READY="1", STATUS="serving")``."""
        if not self.address:
            return
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message, self.address)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify the service manager at %s: %s", self.address, e)

    def ready(self, status: str) -> None:
        self.send(READY="1", STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def stopping(self) -> None:
        self.send(STOPPING="1", STATUS="stopping")

    async def watchdog(self, alive: Callable[[], bool]) -> None:
        """Ping the watchdog at half its interval while ``alive()`` says the daemon progresses.

        A daemon whose work loop is stuck stops pinging, and systemd restarts it.
        """
        if self.watchdog_s is None:
            return
        while True:
            await asyncio.sleep(self.watchdog_s / 2)
            if alive():
                self.send(WATCHDOG="1")
            else:
                log.error("work loop stalled; not pinging the watchdog")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

"""The agent's side of the job channel: step reports in (as readings), settings out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperagent import job as protocol
from hyperagent.errors import PayloadError, SourceUnavailable
from hyperagent.job import JobSettings, StepReport
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)

StepListener = Callable[[StepReport], None]


@dataclass
class JobTotals:
    """Running totals of one job's step reports on this node."""

    steps: int = 0
    samples: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    nonfinite_losses: int = 0
    loss: float | None = None
    version: int = 0
    reporters: dict[int, Any] = field(default_factory=dict)
    """rank -> the reporter's socket address, where settings go."""

    def add(self, step: StepReport) -> None:
        self.steps += 1
        self.samples += step.samples
        self.step_s += step.step_s
        self.compute_s += step.compute_s
        self.comm_s += step.comm_s
        if step.loss is not None:
            if math.isfinite(step.loss):
                self.loss = step.loss
            else:
                self.nonfinite_losses += 1


BATCH = 1000
"""Datagrams taken per wake-up at most (the rest wait for the next turn of the event loop).
Each wake-up takes everything queued: the kernel queues only ``net.unix.max_dgram_qlen``
datagrams (10 by default) before the ranks' non-blocking sends fail."""


class JobSource:
    """Listens on a unix datagram socket for the training job's reports.

    Readings are running totals per job; listeners see every valid step as it arrives (the
    agent's trial measurement uses this). Invalid datagrams are counted and dropped.
    """

    name = "job"

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.target = str(socket_path)
        self.jobs: dict[str, JobTotals] = {}
        self.invalid = 0
        self.listeners: list[StepListener] = []
        self._sock: socket.socket | None = None
        self._last_settings: dict[str, JobSettings] = {}
        self._invalid_reasons: set[str] = set()

    async def start(self) -> None:
        path = self.socket_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                if path.is_socket():
                    path.unlink()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(str(path))
            os.chmod(path, 0o666)
        except OSError as e:
            raise SourceUnavailable(f"cannot listen on {path}: {e}") from e
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(BATCH):
            try:
                data, addr = sock.recvfrom(protocol.MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                log.warning("job socket %s: %s", self.socket_path, e)
                break
            self.receive(data, addr)

    def receive(self, data: bytes, addr: Any) -> None:
        """Handle one datagram (public for tests and replays)."""
        try:
            message = protocol.decode(data)
            if message["type"] == "settings":
                raise PayloadError("settings flow from the agent to the job, not back")
            totals = self.jobs.setdefault(message["job"], JobTotals())
            if message["type"] == "step":
                step = protocol.parse_step(message)
            else:
                step = None
        except PayloadError as e:
            self.invalid += 1
            reason = str(e).split(":")[0]
            if reason not in self._invalid_reasons:
                self._invalid_reasons.add(reason)
                log.warning("dropped an invalid job report: %s", e)
            return
        rank = step.rank if step else int(message.get("rank", 0) or 0)
        if addr:
            is_new = totals.reporters.get(rank) != addr
            totals.reporters[rank] = addr
            known = self._last_settings.get(message["job"])
            if is_new and known is not None:
                self._send(addr, message["job"], known)
        if step is None:
            return
        totals.add(step)
        for listener in self.listeners:
            listener(step)

    def send_settings(self, job: str, settings: JobSettings) -> int:
        """Hand settings to every reporter of ``job``; returns how many received them.

        The latest settings are remembered and handed to reporters that attach later.
        """
        self._last_settings[job] = settings
        totals = self.jobs.setdefault(job, JobTotals())
        totals.version = settings.version
        return sum(self._send(addr, job, settings) for addr in list(totals.reporters.values()))

    def _send(self, addr: Any, job: str, settings: JobSettings) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto(protocol.encode_settings(job, settings), addr)
        except OSError as e:
            log.info("settings for %s not delivered to %s: %s", job, addr, e)
            return False
        return True

    async def read(self) -> list[Reading]:
        out = [Reading("hyperagent_job_invalid_reports_total", self.invalid, {}, Kind.COUNTER)]
        for job, t in self.jobs.items():
            labels = {"job_id": job}
            out += [
                Reading("hyperagent_job_steps_total", t.steps, labels, Kind.COUNTER),
                Reading("hyperagent_job_samples_total", t.samples, labels, Kind.COUNTER),
                Reading("hyperagent_job_step_seconds_total", t.step_s, labels, Kind.COUNTER, "s"),
                Reading("hyperagent_job_compute_seconds_total", t.compute_s, labels, Kind.COUNTER),
                Reading(
                    "hyperagent_job_communication_seconds_total", t.comm_s, labels, Kind.COUNTER
                ),
                Reading(
                    "hyperagent_job_nonfinite_loss_total", t.nonfinite_losses, labels, Kind.COUNTER
                ),
                Reading("hyperagent_job_settings_version", t.version, labels),
            ]
            if t.loss is not None:
                out.append(Reading("hyperagent_job_loss", t.loss, labels))
        return out

    async def close(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        with contextlib.suppress(OSError):
            self.socket_path.unlink()

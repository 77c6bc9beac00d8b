"""The training job's side of the node channel: step reports out, settings in.

A training script creates one ``JobReporter`` per rank and calls ``report_step`` after each
step; at an iteration boundary it calls ``poll_settings`` and applies what it gets. Datagrams
go over a unix socket to the local agent, so a missing or slow agent never blocks training.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from hyperagent.errors import PayloadError

PROTOCOL = 1
MAX_DATAGRAM = 64 * 1024
DEFAULT_SOCKET = Path("/run/hyperagent/job.sock")


@dataclass(frozen=True, slots=True)
class StepReport:
    """One training step of one rank, as the job reports it."""

    job: str
    rank: int
    samples: int
    step_s: float
    compute_s: float
    comm_s: float
    loss: float | None
    version: int
    """Settings version the step ran with (0 before any setting was applied)."""


@dataclass(frozen=True, slots=True)
class JobSettings:
    """Settings the coordinator chose for the job, as the agent hands them over."""

    version: int
    settings: Mapping[str, Any]
    backend: Mapping[str, Any] = field(default_factory=dict)
    """The same knobs in the backend's own terms (e.g. NCCL_ALGO, bucket_cap_mb)."""


def _encode_loss(loss: float | None) -> float | str | None:
    if loss is None or math.isfinite(loss):
        return loss
    return "nan" if math.isnan(loss) else ("inf" if loss > 0 else "-inf")


def _decode_loss(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise PayloadError(f"loss must be a number, null or nan/inf/-inf, got {value!r}")


def encode_step(step: StepReport) -> bytes:
    return orjson.dumps(
        {
            "v": PROTOCOL,
            "type": "step",
            "job": step.job,
            "rank": step.rank,
            "samples": step.samples,
            "step_s": step.step_s,
            "compute_s": step.compute_s,
            "comm_s": step.comm_s,
            "loss": _encode_loss(step.loss),
            "version": step.version,
        }
    )


def encode_hello(job: str, rank: int) -> bytes:
    return orjson.dumps({"v": PROTOCOL, "type": "hello", "job": job, "rank": rank})


def encode_settings(job: str, settings: JobSettings) -> bytes:
    return orjson.dumps(
        {
            "v": PROTOCOL,
            "type": "settings",
            "job": job,
            "version": settings.version,
            "settings": dict(settings.settings),
            "backend": dict(settings.backend),
        }
    )


def _number(message: Mapping[str, Any], key: str, minimum: float = 0.0) -> float:
    value = message.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PayloadError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise PayloadError(f"{key} must be finite and >= {minimum:g}, got {value!r}")
    return float(value)


def _integer(message: Mapping[str, Any], key: str) -> int:
    value = message.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PayloadError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _job_name(message: Mapping[str, Any]) -> str:
    job = message.get("job")
    if not isinstance(job, str) or not 0 < len(job) <= 64:
        raise PayloadError(f"job must be a non-empty string of at most 64 characters, got {job!r}")
    return job


def decode(datagram: bytes) -> dict[str, Any]:
    """Parse and check the envelope of a datagram; raises PayloadError."""
    try:
        message = orjson.loads(datagram)
    except orjson.JSONDecodeError as e:
        raise PayloadError(f"not JSON: {e}") from None
    if not isinstance(message, dict):
        raise PayloadError("not a JSON object")
    if message.get("v") != PROTOCOL:
        raise PayloadError(f"unsupported protocol version {message.get('v')!r}")
    if message.get("type") not in ("step", "hello", "settings"):
        raise PayloadError(f"unknown message type {message.get('type')!r}")
    _job_name(message)
    return message


def parse_step(message: Mapping[str, Any]) -> StepReport:
    """A validated StepReport from a decoded ``step`` message; raises PayloadError."""
    return StepReport(
        job=_job_name(message),
        rank=_integer(message, "rank"),
        samples=_integer(message, "samples"),
        step_s=_number(message, "step_s"),
        compute_s=_number(message, "compute_s"),
        comm_s=_number(message, "comm_s"),
        loss=_decode_loss(message.get("loss")),
        version=_integer(message, "version"),
    )


def parse_settings(message: Mapping[str, Any]) -> JobSettings:
    """A JobSettings from a decoded ``settings`` message; raises PayloadError."""
    settings, backend = message.get("settings"), message.get("backend", {})
    if not isinstance(settings, dict) or not isinstance(backend, dict):
        raise PayloadError("settings and backend must be objects")
    return JobSettings(_integer(message, "version"), settings, backend)


class JobReporter:
    """Client for training scripts: report steps, receive settings. Never blocks training.

    >>> reporter = JobReporter("llama-ft", rank=0)          # doctest: +SKIP
    >>> reporter.report_step(samples=32, step_s=0.41, compute_s=0.33, comm_s=0.08, loss=2.1)
    >>> new = reporter.poll_settings()                      # at an iteration boundary
    """

    def __init__(self, job: str, rank: int = 0, socket_path: Path | str | None = None) -> None:
        if not job or len(job) > 64:
            raise ValueError("job must be a non-empty name of at most 64 characters")
        self.job = job
        self.rank = rank
        self.agent_path = str(
            socket_path or os.environ.get("HYPERAGENT_JOB_SOCKET", DEFAULT_SOCKET)
        )
        self._dir = tempfile.TemporaryDirectory(prefix="hyperagent-job-")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(os.path.join(self._dir.name, "reporter.sock"))
        self._sock.setblocking(False)
        self.applied: JobSettings | None = None
        self._pending: JobSettings | None = None
        self.dropped = 0
        """Datagrams the agent could not take (absent, or its queue full)."""
        self._send(encode_hello(job, rank))

    @property
    def version(self) -> int:
        """The settings version the job runs with now (0 before the first)."""
        return self.applied.version if self.applied else 0

    def _send(self, datagram: bytes) -> None:
        try:
            self._sock.sendto(datagram, self.agent_path)
        except (BlockingIOError, FileNotFoundError, ConnectionRefusedError, OSError):
            self.dropped += 1

    def report_step(
        self,
        samples: int,
        step_s: float,
        compute_s: float,
        comm_s: float,
        loss: float | None = None,
    ) -> None:
        """Tell the agent one step finished; compute and communication are the exposed times."""
        step = StepReport(
            self.job, self.rank, samples, step_s, compute_s, comm_s, loss, self.version
        )
        self._send(encode_step(step))

    def poll_settings(self) -> JobSettings | None:
        """Newer settings than the job runs with, or None; from now on steps carry their version.

        Call at an iteration boundary and apply what it returns before the next step.
        """
        self._receive()
        pending, self._pending = self._pending, None
        if pending is None or pending.version <= self.version:
            return None
        self.applied = pending
        return pending

    def _receive(self) -> None:
        while True:
            try:
                datagram = self._sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            try:
                message = decode(datagram)
                if message["type"] != "settings" or message["job"] != self.job:
                    continue
                settings = parse_settings(message)
            except PayloadError:
                continue
            if self._pending is None or settings.version > self._pending.version:
                self._pending = settings

    def close(self) -> None:
        self._sock.close()
        self._dir.cleanup()

    def __enter__(self) -> JobReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The training job's side of the node channel: step reports out, settings in.

A training script creates one ``JobReporter`` per rank and calls ``report_step`` after each
step; at an iteration boundary it calls ``poll_settings`` and applies what it gets. Each rank
connects to the agent's socket under /run/hyperagent (a unix ``SOCK_SEQPACKET`` socket: one
message per packet) and the agent answers on that connection, so the channel works across
users and mount namespaces (the agent runs with PrivateTmp). The agent knows each peer's
uid and pid (SO_PEERCRED), authorises it and binds the job id to the first peer that claims it.
Every send is non-blocking: a missing, refusing or slow agent never blocks training; a lost
connection is retried at most once a second.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from hyperagent import scheduler
from hyperagent.errors import PayloadError
from hyperagent.names import name_problem

log = logging.getLogger(__name__)

PROTOCOL = 1
MAX_DATAGRAM = 64 * 1024
MAX_GPUS = 1024
"""GPU indices a rank may declare are below this."""
DEFAULT_SOCKET = Path("/run/hyperagent/job.sock")
KNOBS = ("bucket_mb", "chunk_kb", "allreduce")
"""Knobs a job may announce that it applies live (power caps are the agent's, not the job's)."""
NCCL_TUNER_KNOBS = ("protocol",)
"""Knobs only an NCCL job driving hyperagent's tuner plugin applies (and may announce)."""
ANNOUNCEABLE = KNOBS + NCCL_TUNER_KNOBS
RECONNECT_S = 1.0
"""A rank whose connection is down tries again at most this often ..."""
REFUSED_RETRY_S = 30.0
"""... and this often after the agent refused it."""


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
    memory: MemoryReport | None = None
    """What the rank's GPU memory allocator says, when the job reports it."""


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """A rank's GPU memory as its allocator sees it (e.g. ``torch.cuda.memory_stats``): memory
    held for tensors, not what the caching allocator reserved, and its cumulative retries and
    out-of-memory errors."""

    allocated_bytes: int
    total_bytes: int
    alloc_retries: int = 0
    ooms: int = 0

    @property
    def allocated_ratio(self) -> float:
        return self.allocated_bytes / self.total_bytes if self.total_bytes else 0.0


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
    message: dict[str, Any] = {
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
    if step.memory is not None:
        m = step.memory
        message["memory"] = {
            "allocated_bytes": m.allocated_bytes,
            "total_bytes": m.total_bytes,
            "alloc_retries": m.alloc_retries,
            "ooms": m.ooms,
        }
    return orjson.dumps(message)


@dataclass(frozen=True, slots=True)
class Hello:
    """A rank's first message: the job and rank it is, and what the coordinator needs to find
    and tune the job without a config edit. Every field but ``job`` and ``rank`` is optional
    (None: the rank did not say)."""

    job: str
    rank: int
    knobs: tuple[str, ...] | None = None
    """The knobs the rank applies live."""
    gpu: int | None = None
    """The GPU index the rank runs on, when it knows."""
    world_size: int | None = None
    """Ranks in the whole job (torchrun's ``WORLD_SIZE``)."""
    local_world_size: int | None = None
    """Ranks of the job on this node (``LOCAL_WORLD_SIZE``)."""
    backend: str | None = None
    """The collective backend: nccl, gloo, mpi, horovod or deepspeed."""
    tune: bool | None = None
    """Whether the job asks to be tuned (True), refuses (False) or does not say (None)."""
    model_params: int | None = None
    """The model's parameter count, for the tuning's fingerprint."""
    gpus: tuple[int, ...] | None = None
    """The GPU indices a rank that drives several runs on (one process per node)."""

    @property
    def declared(self) -> tuple[int, ...]:
        """Every GPU index the rank said it runs on."""
        return ((self.gpu,) if self.gpu is not None else ()) + (self.gpus or ())


BACKENDS = ("nccl", "gloo", "mpi", "horovod", "deepspeed")


def encode_hello(
    job: str,
    rank: int,
    knobs: Iterable[str] | None = None,
    gpu: int | None = None,
    **details: Any,
) -> bytes:
    """A rank's hello (see :class:`Hello`; ``details`` are its optional fields)."""
    hello = Hello(job, rank, None if knobs is None else tuple(knobs), gpu, **details)
    message: dict[str, Any] = {"v": PROTOCOL, "type": "hello", "job": job, "rank": rank}
    for key in Hello.__slots__:
        value = getattr(hello, key)
        if key not in ("job", "rank") and value is not None:
            message[key] = list(value) if key in ("knobs", "gpus") else value
    return orjson.dumps(message)


def common_knobs(announced: Iterable[Iterable[str] | None]) -> tuple[str, ...] | None:
    """The knobs every announcer applies, in the first one's order (None: nobody said)."""
    said = [tuple(k) for k in announced if k is not None]
    if not said:
        return None
    return tuple(k for k in said[0] if all(k in other for other in said[1:]))


def encode_refused(reason: str, detail: str) -> bytes:
    """The agent's answer to a peer it will not serve, just before it closes the connection."""
    return orjson.dumps(
        {"v": PROTOCOL, "type": "refused", "job": "-", "reason": reason, "detail": detail}
    )


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
    if not isinstance(job, str):
        raise PayloadError(f"job must be a string, got {job!r}")
    problem = name_problem(job)
    if problem is not None:
        raise PayloadError(f"job: {problem}")
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
    if message.get("type") not in ("step", "hello", "settings", "refused"):
        raise PayloadError(f"unknown message type {message.get('type')!r}")
    _job_name(message)
    return message


def parse_memory(message: Mapping[str, Any]) -> MemoryReport | None:
    """The optional ``memory`` object of a step message; raises PayloadError."""
    memory = message.get("memory")
    if memory is None:
        return None
    if not isinstance(memory, dict):
        raise PayloadError("memory must be an object")
    report = MemoryReport(
        _integer(memory, "allocated_bytes"),
        _integer(memory, "total_bytes"),
        _integer(memory, "alloc_retries"),
        _integer(memory, "ooms"),
    )
    if report.total_bytes == 0 or report.allocated_bytes > report.total_bytes:
        raise PayloadError("memory.allocated_bytes must be within 0..total_bytes > 0")
    return report


def _optional_positive(message: Mapping[str, Any], key: str) -> int | None:
    value = message.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PayloadError(f"{key} must be a positive integer, got {value!r}")
    return value


def parse_hello(message: Mapping[str, Any]) -> Hello:
    """A validated Hello from a decoded ``hello`` message; raises PayloadError."""
    rank = _integer(message, "rank")
    knobs = message.get("knobs")
    if knobs is not None:
        if not isinstance(knobs, list) or not all(k in ANNOUNCEABLE for k in knobs):
            raise PayloadError(f"knobs must be a list of {', '.join(ANNOUNCEABLE)}, got {knobs!r}")
        knobs = tuple(dict.fromkeys(knobs))
    gpu = None if message.get("gpu") is None else _integer(message, "gpu")
    gpus = message.get("gpus")
    if gpus is not None:
        if not isinstance(gpus, list) or not all(
            isinstance(g, int) and not isinstance(g, bool) and 0 <= g < MAX_GPUS for g in gpus
        ):
            raise PayloadError(f"gpus must be a list of GPU indices, got {gpus!r}")
        gpus = tuple(dict.fromkeys(gpus))
    backend = message.get("backend")
    if backend is not None and backend not in BACKENDS:
        raise PayloadError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    tune = message.get("tune")
    if tune is not None and not isinstance(tune, bool):
        raise PayloadError(f"tune must be true, false or absent, got {tune!r}")
    world, local = (
        _optional_positive(message, "world_size"),
        _optional_positive(message, "local_world_size"),
    )
    if world is not None and rank >= world:
        raise PayloadError(f"rank {rank} is outside world_size {world}")
    return Hello(
        _job_name(message),
        rank,
        knobs,
        gpu,
        world,
        local,
        backend,
        tune,
        _optional_positive(message, "model_params"),
        gpus,
    )


def parse_step(message: Mapping[str, Any], job: str | None = None) -> StepReport:
    """A validated StepReport from a decoded ``step`` message (``job``: the job it is, in place
    of the id it names, which the caller checked); raises PayloadError."""
    return StepReport(
        job=_job_name(message) if job is None else job,
        rank=_integer(message, "rank"),
        samples=_integer(message, "samples"),
        step_s=_number(message, "step_s"),
        compute_s=_number(message, "compute_s"),
        comm_s=_number(message, "comm_s"),
        loss=_decode_loss(message.get("loss")),
        version=_integer(message, "version"),
        memory=parse_memory(message),
    )


def parse_settings(message: Mapping[str, Any]) -> JobSettings:
    """A JobSettings from a decoded ``settings`` message; raises PayloadError."""
    settings, backend = message.get("settings"), message.get("backend", {})
    if not isinstance(settings, dict) or not isinstance(backend, dict):
        raise PayloadError("settings and backend must be objects")
    return JobSettings(_integer(message, "version"), settings, backend)


def _environment_rank(environ: Mapping[str, str]) -> int:
    """The rank torchrun (``RANK``) or Slurm (``SLURM_PROCID``) gave this process, else 0."""
    for key in ("RANK", "SLURM_PROCID"):
        value = environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


class JobReporter:
    """Client for training scripts: report steps, receive settings. Never blocks training.

    ``job`` defaults to the scheduler's id (:func:`hyperagent.scheduler.from_environment`:
    ``HYPERAGENT_JOB_ID``, Slurm's job and step, torchrun's run id; raises
    :class:`~hyperagent.scheduler.NoJobId` saying what to pass when there is none), ``rank`` to
    torchrun's ``RANK`` or Slurm's ``SLURM_PROCID``, ``world_size`` and ``local_world_size`` to
    torchrun's (or Slurm's task counts). ``knobs`` announces which knobs this rank applies live
    (the coordinator tunes only those); ``gpu`` is the GPU index the rank runs on (``gpus``:
    the indices, for a rank that drives several), where NVML cannot tell the agent; ``tune``
    True asks the coordinator to tune the job (False: never;
    None, the default, leaves it to the coordinator's policy; ``HYPERAGENT_TUNE=1`` or ``0``
    says the same from the environment); ``backend`` and ``model_params`` describe the job.

    >>> reporter = JobReporter("llama-ft", rank=0)          # doctest: +SKIP
    >>> reporter.report_step(samples=32, step_s=0.41, compute_s=0.33, comm_s=0.08, loss=2.1)
    >>> new = reporter.poll_settings()                      # at an iteration boundary
    """

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        socket_path: Path | str | None = None,
        knobs: Iterable[str] | None = None,
        gpu: int | None = None,
        *,
        world_size: int | None = None,
        local_world_size: int | None = None,
        tune: bool | None = None,
        backend: str | None = None,
        model_params: int | None = None,
        gpus: Iterable[int] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        job = scheduler.from_environment(env, job).id
        problem = name_problem(job)
        if problem is not None:
            raise ValueError(f"job id {problem}")
        self.job = job
        self.rank = _environment_rank(env) if rank is None else rank
        self.knobs = None if knobs is None else tuple(knobs)
        self.gpu = gpu
        world, local = scheduler.world_size(env)
        if tune is None and env.get("HYPERAGENT_TUNE") in ("0", "1"):
            tune = env["HYPERAGENT_TUNE"] == "1"
        self.details: dict[str, Any] = {
            "world_size": world if world_size is None else world_size,
            "local_world_size": local if local_world_size is None else local_world_size,
            "tune": tune,
            "backend": backend,
            "model_params": model_params,
            "gpus": None if gpus is None else tuple(gpus),
        }
        self.agent_path = str(socket_path or env.get("HYPERAGENT_JOB_SOCKET", DEFAULT_SOCKET))
        self.applied: JobSettings | None = None
        self._pending: JobSettings | None = None
        self.dropped = 0
        """Messages the agent could not take (absent, refusing, or its queue full)."""
        self.refused: str | None = None
        """Why the agent last refused this rank, or None."""
        self._sock: socket.socket | None = None
        self._retry_at = 0.0
        self._connect()

    @property
    def version(self) -> int:
        """The settings version the job runs with now (0 before the first)."""
        return self.applied.version if self.applied else 0

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _connect(self) -> None:
        now = time.monotonic()
        if self._sock is not None or now < self._retry_at:
            return
        self._retry_at = now + RECONNECT_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            sock.connect(self.agent_path)
        except OSError:
            sock.close()
            return
        self._sock = sock
        self._send(encode_hello(self.job, self.rank, self.knobs, self.gpu, **self.details))

    def _disconnect(self, retry_after_s: float = RECONNECT_S) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._retry_at = time.monotonic() + retry_after_s

    def _send(self, message: bytes) -> None:
        self._connect()
        if self._sock is None:
            self.dropped += 1
            return
        try:
            self._sock.send(message)
        except (BlockingIOError, InterruptedError):
            self.dropped += 1
        except OSError:
            self.dropped += 1
            self._receive()  # a refusal may wait there
            self._disconnect(REFUSED_RETRY_S if self.refused else RECONNECT_S)

    def report_step(
        self,
        samples: int,
        step_s: float,
        compute_s: float,
        comm_s: float,
        loss: float | None = None,
        memory: MemoryReport | None = None,
    ) -> None:
        """Tell the agent one step finished; compute and communication are the exposed times."""
        step = StepReport(
            self.job, self.rank, samples, step_s, compute_s, comm_s, loss, self.version, memory
        )
        self._send(encode_step(step))

    def poll_settings(self) -> JobSettings | None:
        """Newer settings than the job runs with, or None; from now on steps carry their version.

        Call at an iteration boundary and apply what it returns before the next step.
        """
        self._connect()
        self._receive()
        pending, self._pending = self._pending, None
        if pending is None or pending.version <= self.version:
            return None
        self.applied = pending
        return pending

    def _receive(self) -> None:
        while self._sock is not None:
            try:
                packet = self._sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionResetError:
                continue  # the agent closed with packets of ours unread; its own still wait
            except OSError:
                self._disconnect(REFUSED_RETRY_S if self.refused else RECONNECT_S)
                return
            if not packet:  # the agent closed the connection
                self._disconnect(REFUSED_RETRY_S if self.refused else RECONNECT_S)
                return
            try:
                message = decode(packet)
                if message["type"] == "refused":
                    self.refused = f"{message.get('reason')}: {message.get('detail')}"
                    log.warning(
                        "hyperagent refused job %s rank %d: %s", self.job, self.rank, self.refused
                    )
                    continue
                if message["type"] != "settings" or message["job"] != self.job:
                    continue
                settings = parse_settings(message)
            except PayloadError:
                continue
            self.refused = None
            if self._pending is None or settings.version > self._pending.version:
                self._pending = settings

    def close(self) -> None:
        self._disconnect()

    def __enter__(self) -> JobReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""PyTorch DDP under hyperagent: report every step, apply the coordinator's bucket and chunk sizes.

A training script wraps its model in :class:`TunedDDP` instead of ``DistributedDataParallel``
and marks each iteration; everything else stays as it was::

    import torch
    import torch.distributed as dist
    from hyperagent.integrations.torch import TunedDDP

    dist.init_process_group("gloo")             # or "nccl"; torchrun provides the rendezvous
    model = MyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tuned = TunedDDP(model, job="my-job")       # agent socket: $HYPERAGENT_JOB_SOCKET
    for x, y in loader:
        tuned.step_begin()                      # maybe switch settings, on every rank at once
        if tuned.stopping:                      # some rank called tuned.request_stop()
            break
        loss = torch.nn.functional.cross_entropy(tuned(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        tuned.step_end(samples=len(x), loss=loss.item())
    tuned.close()
    dist.destroy_process_group()

Every rank must construct its TunedDDP at the same point (it creates a gloo process group) and
call ``step_begin`` once per iteration (it runs one small collective).

Settings. The node's agent hands each new settings version to every rank's JobReporter, but
ranks receive them at different moments, and a rank may skip a version it never saw. At every
``step_begin`` the ranks all-gather the versions each has received (a few int64 rows, on a gloo
group of their own) and switch to the newest version that *every* rank has received, using
rank 0's copy of its values. Each rank computes the same choice from the same gathered rows, so
all switch at the same iteration: no rank ever runs a collective with a bucket layout another
rank does not share. The switch happens only in ``step_begin``, after the previous
``opt.step()``; by then backward has waited for every allreduce, so no buffer is in flight.

- ``bucket_cap_mb`` (MiB) re-wraps the module in a new DistributedDataParallel; the old one's
  autograd hooks are removed first; parameters and optimizer state are untouched.
- ``chunk_bytes`` is applied by the comm hook (:func:`chunked_allreduce_hook`): each gradient
  bucket is divided by the world size and allreduced in chunks of that many bytes, as PyTorch's
  default hook does with the whole bucket. Without it, each bucket is one allreduce.
- ``allreduce`` and ``protocol`` (NCCL's AllReduce algorithm and protocol) are set through
  hyperagent's NCCL tuner plugin (:mod:`hyperagent.nccl`), which NCCL asks before it plans
  every AllReduce. TunedDDP loads the library NCCL loads and calls its setter on every rank in
  ``step_begin``, before the iteration's first collective, so every rank's next AllReduce runs
  the same choice. It announces these two knobs only when the process group is NCCL,
  ``NCCL_TUNER_PLUGIN`` names this plugin's library and ``NCCL_ALGO``/``NCCL_PROTO`` are unset
  (they override any tuner); otherwise it says why, once, and the coordinator leaves them out.

Reports. ``step_end`` reports the step through the JobReporter, carrying the version the step
ran with. ``step_s`` is the wall time from ``step_begin`` to ``step_end``. ``comm_s`` is the
exposed communication: from the moment the step's last gradient bucket was ready (autograd had
produced every gradient) until its last allreduce completed, which backward waits for;
communication that overlapped the backward pass is not counted. ``compute_s`` is the rest.
A model on the CPU is timed by the host's clock (:class:`HostCommTimer`: gloo completes an
allreduce's future when the allreduce is done); a model on a CUDA device by CUDA events on the
streams the work runs on (:class:`CudaEventTimer`: NCCL completes the future when the kernels
are enqueued, so a host clock would read about 0). ``step_s`` is the host's: on CUDA, call
``loss.item()`` (it synchronises) before ``step_end``.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at runtime.
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hyperagent.job import BACKENDS, JobReporter, JobSettings
from hyperagent.nccl import ALGORITHMS, PROTOCOLS, Choice, TunerPlugin

log = logging.getLogger(__name__)
Future = torch.futures.Future

MIB = 1024 * 1024
DEFAULT_HISTORY = 8
"""Received settings versions each rank remembers until all ranks have them."""
MAX_BYTES = 1 << 40
_ABSENT = -1
APPLIED_KNOBS = ("bucket_mb", "chunk_kb")
"""What TunedDDP applies live and announces when it attaches, without the NCCL tuner plugin.
Not the AllReduce algorithm: NCCL reads ``NCCL_ALGO`` only when a communicator is created, and
TunedDDP keeps its process group."""
PLUGIN_KNOBS = ("allreduce", "protocol")
"""What TunedDDP also applies and announces with the NCCL tuner plugin (:func:`nccl_plugin_for`)."""
ALGORITHM_INDEX: dict[str, int] = {**ALGORITHMS, "collnet": ALGORITHMS["collnet_direct"]}
"""The space's algorithm names as NCCL's indices (``collnet``: CollNet direct)."""


@dataclass(frozen=True, slots=True)
class DdpKnobs:
    """What one settings version asks of DDP, in bytes; None leaves a knob as it is."""

    bucket_bytes: int | None = None
    chunk_bytes: int | None = None
    algorithm: int | None = None
    """NCCL's ``NCCL_ALGO_*`` index for AllReduce, through the tuner plugin."""
    protocol: int | None = None
    """NCCL's ``NCCL_PROTO_*`` index."""


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One reported step: the settings version it ran with and its time split."""

    version: int
    step_s: float
    compute_s: float
    comm_s: float
    buckets: int
    """Gradient buckets allreduced during the step."""


def _size(value: object, unit: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    size = value * unit
    if not math.isfinite(size) or not 1 <= size <= MAX_BYTES:
        return None
    return int(size)


def _index(value: object, names: Mapping[str, int]) -> int | None:
    if not isinstance(value, str):
        return None
    return names.get(value.lower().replace("-", "_"))


def knobs_from_settings(settings: JobSettings, nccl_plugin: bool = False) -> DdpKnobs:
    """The DDP knobs of a settings message.

    The backend's terms come first (``bucket_cap_mb`` in MiB, ``chunk_bytes``), else the abstract
    knobs (``bucket_mb`` MiB, ``chunk_kb`` KiB). With ``nccl_plugin`` (the ranks set the NCCL
    tuner plugin), ``allreduce`` (ring, tree, nvls, collnet, pat, ...) and ``protocol`` (ll,
    ll128, simple) become NCCL's indices; without it they are not applied. A missing value, or
    one that is not a positive number up to 1 TiB or a known name, leaves that knob as it is.
    """
    backend, knobs = settings.backend, settings.settings
    bucket = _size(backend.get("bucket_cap_mb"), MIB) or _size(knobs.get("bucket_mb"), MIB)
    chunk = _size(backend.get("chunk_bytes"), 1) or _size(knobs.get("chunk_kb"), 1024)
    if not nccl_plugin:
        return DdpKnobs(bucket, chunk)
    algorithm = _index(knobs.get("allreduce"), ALGORITHM_INDEX)
    protocol = _index(knobs.get("protocol"), PROTOCOLS)
    return DdpKnobs(bucket, chunk, algorithm, protocol)


def nccl_plugin_for(backend: str, environ: Mapping[str, str]) -> tuple[TunerPlugin | None, str]:
    """The tuner plugin NCCL loads for a process group of ``backend``, or None and why not.

    Only for an NCCL group, when ``NCCL_TUNER_PLUGIN`` names a file that is hyperagent's plugin
    (NCCL dlopens that path; loading it here shares its one copy) and neither ``NCCL_ALGO`` nor
    ``NCCL_PROTO`` is set (either overrides every tuner).
    """
    if "nccl" not in backend.lower():
        return None, f"the process group is {backend}, not NCCL"
    forced = [name for name in ("NCCL_ALGO", "NCCL_PROTO") if environ.get(name)]
    if forced:
        return None, f"{' and '.join(forced)} set: NCCL ignores any tuner"
    named = environ.get("NCCL_TUNER_PLUGIN", "")
    if not named:
        return None, "NCCL_TUNER_PLUGIN is not set (NCCL_TUNER_PLUGIN=$(hyperagent nccl-plugin))"
    if not Path(named).is_file():
        return None, f"NCCL_TUNER_PLUGIN={named} is not a file path to hyperagent's plugin"
    try:
        return TunerPlugin(named), ""
    except (OSError, AttributeError) as e:
        return None, f"NCCL_TUNER_PLUGIN={named} is not hyperagent's plugin ({e})"


def choose_version(
    received: Sequence[Mapping[int, DdpKnobs]], applied: int
) -> tuple[int, DdpKnobs] | None:
    """The newest version above ``applied`` that every rank has received, with rank 0's knobs.

    ``received[r]`` holds the versions rank ``r`` has received; None when no such version exists.
    """
    if not received:
        return None
    common = set(received[0]).intersection(*received[1:])
    newer = [version for version in common if version > applied]
    if not newer:
        return None
    version = max(newer)
    return version, received[0][version]


def _or_absent(value: int | None) -> int:
    return _ABSENT if value is None else value


def encode_received(stop: bool, received: Mapping[int, DdpKnobs], rows: int) -> torch.Tensor:
    """The rows a rank contributes to the agreement: [stop, 0, 0, 0, 0], then per version
    (newest ``rows``) [version, bucket bytes, chunk bytes, algorithm, protocol], -1 for absent
    values and unused rows."""
    table = torch.full((rows + 1, 5), _ABSENT, dtype=torch.int64)
    table[0] = torch.tensor([int(stop), 0, 0, 0, 0])
    for row, (version, knobs) in enumerate(sorted(received.items())[-rows:], start=1):
        table[row] = torch.tensor(
            [
                version,
                knobs.bucket_bytes or _ABSENT,
                knobs.chunk_bytes or _ABSENT,
                _or_absent(knobs.algorithm),
                _or_absent(knobs.protocol),
            ]
        )
    return table


def decode_received(table: torch.Tensor) -> tuple[bool, dict[int, DdpKnobs]]:
    """The inverse of :func:`encode_received`: (stop requested, version -> knobs)."""
    rows: list[list[int]] = table.tolist()
    received = {
        version: DdpKnobs(
            bucket if bucket > 0 else None,
            chunk if chunk > 0 else None,
            algorithm if algorithm >= 0 else None,
            protocol if protocol >= 0 else None,
        )
        for version, bucket, chunk, algorithm, protocol in rows[1:]
        if version >= 0
    }
    return rows[0][0] == 1, received


class CommTimer(Protocol):
    """When a step's gradient communication was exposed, for :func:`chunked_allreduce_hook`.

    Per step: :meth:`reset` at its start; in the hook, :meth:`bucket_ready` before a bucket's
    allreduces are enqueued and :meth:`completion` for the hook's future, which marks the
    bucket done when they complete; :meth:`exposed_s` once, after the step's synchronisation
    point (``opt.step()``, ``loss.item()``).
    """

    def reset(self) -> None: ...

    def bucket_ready(self) -> None: ...

    def completion(self, futures: Sequence[Future[Any]], buffer: torch.Tensor) -> Future[Any]:
        """The hook's result: a future of ``buffer`` completed when every future in
        ``futures`` (the bucket's allreduces) has, having marked the bucket done."""
        ...

    def exposed_s(self) -> float:
        """Seconds from the last bucket ready to the last allreduce done (0 without buckets)."""
        ...


class HostCommTimer:
    """The host's clock: right where an allreduce's future completes when the allreduce is done
    (gloo on CPU tensors). A bucket is ready when DDP calls the hook, done when the callback on
    its futures runs."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._last_ready: float | None = None
        self._last_done: float | None = None

    def reset(self) -> None:
        with self._lock:
            self._last_ready = self._last_done = None

    def bucket_ready(self) -> None:
        now = self.clock()
        with self._lock:
            self._last_ready = now

    def completion(self, futures: Sequence[Future[Any]], buffer: torch.Tensor) -> Future[Any]:
        def finish(done: Future[list[Future[Any]]]) -> torch.Tensor:
            for part in done.value():
                part.value()
            now = self.clock()
            with self._lock:
                self._last_done = now if self._last_done is None else max(self._last_done, now)
            return buffer

        return torch.futures.collect_all(list(futures)).then(finish)

    def exposed_s(self) -> float:
        with self._lock:
            if self._last_ready is None or self._last_done is None:
                return 0.0
            return max(0.0, self._last_done - self._last_ready)


class TimingEvent(Protocol):
    """What :class:`CudaEventTimer` uses of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self, stream: Any = None) -> None: ...

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds from this event to ``end_event``; both must have completed."""
        ...

    def synchronize(self) -> None: ...


class CudaRuntime(Protocol):
    """The CUDA calls :class:`CudaEventTimer` makes, on one device (:class:`TorchCuda`)."""

    def event(self) -> TimingEvent: ...

    def current_stream(self) -> Any: ...

    def new_stream(self) -> Any: ...

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` the current stream of the device inside the context."""
        ...

    def future(self) -> Future[Any]:
        """A future whose value may hold tensors of the device (a CUDA future)."""
        ...


class TorchCuda:
    """:class:`CudaRuntime` over ``torch.cuda`` for ``device``; touches CUDA only when used."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def event(self) -> TimingEvent:
        event: TimingEvent = torch.cuda.Event(enable_timing=True)
        return event

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def future(self) -> Future[Any]:
        return torch.futures.Future(devices=[self.device])


class CudaEventTimer:
    """CUDA events: exposed communication as the device saw it (NCCL, or gloo on CUDA tensors).

    ProcessGroupNCCL completes an allreduce's future as soon as its kernel is enqueued, with a
    CUDA event recorded on the NCCL stream after the kernel (``collective`` marks the future
    completed under a guard making that stream current); ``Future.wait()`` makes the caller's
    current stream wait for that event (``synchronizeWithCurrentStreams``) and does not block
    the host. Host clocks in the hook and its callbacks read enqueue times, so this timer
    records two events, reused every step (their last record counts):

    - *ready*, at the hook's entry, on the current stream: the stream autograd produced the
      bucket's gradients on, where DDP calls the hook. It completes when they are computed.
    - *done*, on a stream of this timer's, after that stream waited for every future of the
      bucket, so it completes when the bucket's last allreduce has. The NCCL stream itself is
      not reachable from Python; an idle stream made to wait for it marks the same moment.

    The hook's future is a CUDA future completed on this timer's stream, so the stream DDP
    reads the averaged gradients on waits for the allreduces (``c10::collectAll`` makes a future
    without devices, whose ``then`` carries no CUDA event: DDP's wait on it orders no stream).

    :meth:`exposed_s` reads the events once per step: one ``synchronize`` of *done* (nothing
    left to wait for after ``loss.item()``: DDP's stream waited for the allreduces before the
    optimizer step) and one ``elapsed_time``, milliseconds converted to seconds. As on the
    host, exposed is from the last bucket ready, the end of backward's compute, to the last
    allreduce done: the time the compute stream waits for communication at the end of backward.
    """

    def __init__(self, runtime: CudaRuntime) -> None:
        self.runtime = runtime
        self._lock = threading.Lock()
        self._ready: TimingEvent | None = None
        self._done: TimingEvent | None = None
        self._stream: Any = None
        self._marked_ready = self._marked_done = False

    def reset(self) -> None:
        with self._lock:
            self._marked_ready = self._marked_done = False

    def bucket_ready(self) -> None:
        with self._lock:
            if self._ready is None:
                self._ready = self.runtime.event()
            self._ready.record(self.runtime.current_stream())
            self._marked_ready = True

    def completion(self, futures: Sequence[Future[Any]], buffer: torch.Tensor) -> Future[Any]:
        result = self.runtime.future()
        parts = list(futures)

        def finish(done: Future[list[Future[Any]]]) -> None:
            try:
                done.value()  # raises the first allreduce's error
                stream, event = self._done_marker()
                with self.runtime.use(stream):
                    for part in parts:
                        part.wait()
                    with self._lock:
                        event.record(stream)
                        self._marked_done = True
                    result.set_result(buffer)
            except Exception as e:
                result.set_exception(e)

        torch.futures.collect_all(parts).add_done_callback(finish)
        return result

    def _done_marker(self) -> tuple[Any, TimingEvent]:
        with self._lock:
            if self._done is None:
                self._stream = self.runtime.new_stream()
                self._done = self.runtime.event()
            return self._stream, self._done

    def exposed_s(self) -> float:
        with self._lock:
            ready, done = self._ready, self._done
            if not (self._marked_ready and self._marked_done) or ready is None or done is None:
                return 0.0
        done.synchronize()
        return max(0.0, ready.elapsed_time(done) / 1000.0)


def comm_timer_for(
    device: torch.device, clock: Callable[[], float] = time.perf_counter
) -> CommTimer:
    """CUDA events for a CUDA device, else the host's ``clock``."""
    if device.type == "cuda":
        return CudaEventTimer(TorchCuda(device))
    return HostCommTimer(clock)


class ChunkedAllreduce:
    """State of :func:`chunked_allreduce_hook`: the group, the chunk size, the step's bucket
    count and the timer of its communication (call :meth:`reset` at each step's start)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        chunk_bytes: int | None = None,
        timer: CommTimer | None = None,
    ) -> None:
        self.group = group
        self.chunk_bytes = chunk_bytes
        """None: one allreduce per bucket."""
        self.timer: CommTimer = timer or HostCommTimer()
        self._lock = threading.Lock()
        self.buckets = 0

    def reset(self) -> None:
        with self._lock:
            self.buckets = 0
        self.timer.reset()

    def bucket_ready(self) -> None:
        with self._lock:
            self.buckets += 1
        self.timer.bucket_ready()

    def exposed_s(self) -> float:
        """Seconds from the last bucket ready to the last allreduce done (0 without buckets)."""
        return self.timer.exposed_s()


def chunked_allreduce_hook(
    state: ChunkedAllreduce, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average a gradient bucket over ``state.group`` in chunks.

    Like PyTorch's ``allreduce_hook`` (and DDP without a hook) the bucket is divided by the world
    size, then summed across ranks; here as consecutive chunks of ``state.chunk_bytes``, each its
    own allreduce, so the result equals the default's to float rounding (bit for bit when the
    world size is a power of two).
    """
    state.bucket_ready()
    group = state.group if state.group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    chunk = state.chunk_bytes
    elements = buffer.numel() if chunk is None else max(1, chunk // buffer.element_size())
    works = [dist.all_reduce(part, group=group, async_op=True) for part in buffer.split(elements)]
    futures = [work.get_future() for work in works if work is not None]
    return state.timer.completion(futures, buffer)


class TunedDDP:
    """DistributedDataParallel whose bucket size and allreduce chunk the coordinator tunes.

    ``module`` is the model (not yet wrapped); ``job`` names the training job for the agent
    (default: the scheduler's id, Slurm's job and step or torchrun's run id; see
    :class:`~hyperagent.job.JobReporter`), or pass a ``reporter`` (then ``job``,
    ``socket_path`` and ``tune`` are unused). Wrapping a model in TunedDDP asks for it to be
    tuned (``tune=False``: report only); the ranks also say the world size, the backend and the
    model's parameter count, from which the coordinator finds the job. ``bucket_cap_mb`` and
    ``chunk_bytes`` are the starting values (None: PyTorch's default buckets, no chunking).
    ``control_group`` is a CPU (gloo) group over the ranks DDP reduces across, for the per-step
    agreement; by default one over the whole world is created, collectively (pass one when DDP's
    ``process_group`` is a subgroup). ``history`` must be equal on every rank. ``comm_timer``
    times the exposed communication; by default :func:`comm_timer_for` the device of the
    module's first parameter (``clock`` on the CPU, CUDA events on a GPU). Other keyword
    arguments go to DistributedDataParallel on every (re-)wrap. Call as the module is called.
    ``job_world_size``: the world size the agent is told, where the job has more ranks than
    this torch world (default: the default group's size). ``gpu``: the node's GPU index the rank
    runs on, declared to the agent (it counts where NVML shows no other job there; on GPUs
    NVML lists the rank's own process, which is how the agent knows it without this).

    ``nccl_plugin`` is the NCCL tuner plugin that sets ``allreduce`` and ``protocol``; by
    default :func:`nccl_plugin_for` DDP's process group and the environment. Passing one says
    that NCCL loads that file whatever the group's backend (on gloo, NCCL never consults it,
    but the setter still runs at the agreed iteration: how the switch is tested on CPUs).
    """

    def __init__(
        self,
        module: nn.Module,
        job: str | None = None,
        *,
        reporter: JobReporter | None = None,
        socket_path: Path | str | None = None,
        bucket_cap_mb: float | None = None,
        chunk_bytes: int | None = None,
        control_group: dist.ProcessGroup | None = None,
        history: int = DEFAULT_HISTORY,
        clock: Callable[[], float] = time.perf_counter,
        comm_timer: CommTimer | None = None,
        nccl_plugin: TunerPlugin | None = None,
        tune: bool = True,
        job_world_size: int | None = None,
        gpu: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TunedDDP needs torch.distributed.init_process_group() first")
        if history < 1:
            raise ValueError(f"history must be at least 1, got {history}")
        self.rank = dist.get_rank()
        backend = str(dist.get_backend(ddp_kwargs.get("process_group")))
        if nccl_plugin is None:
            nccl_plugin, why = nccl_plugin_for(backend, os.environ)
            if nccl_plugin is None:
                log.info("rank %d: allreduce and protocol are not tuned: %s", self.rank, why)
        elif any(os.environ.get(name) for name in ("NCCL_ALGO", "NCCL_PROTO")):
            log.info("rank %d: NCCL_ALGO or NCCL_PROTO set: NCCL ignores any tuner", self.rank)
            nccl_plugin = None
        self.nccl_plugin = nccl_plugin
        """The tuner plugin the ranks set, or None: allreduce and protocol not announced."""
        knobs = APPLIED_KNOBS + (PLUGIN_KNOBS if nccl_plugin is not None else ())
        self._owns_reporter = reporter is None
        self.reporter = reporter or JobReporter(
            job,
            rank=self.rank,
            socket_path=socket_path,
            knobs=knobs,
            gpu=gpu,
            world_size=job_world_size or dist.get_world_size(),
            tune=tune,
            backend=backend if backend in BACKENDS else None,
            model_params=sum(p.numel() for p in module.parameters()) or None,
        )
        self._owns_control = control_group is None
        self._control = control_group or dist.new_group(backend="gloo")
        self._history = history
        self._clock = clock
        self._module = module
        self._ddp_kwargs = ddp_kwargs
        self._bucket_cap_mb = bucket_cap_mb
        if comm_timer is None:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
            comm_timer = comm_timer_for(device, clock)
        self._hook = ChunkedAllreduce(ddp_kwargs.get("process_group"), chunk_bytes, comm_timer)
        self._ddp = self._wrap()
        self._received: dict[int, tuple[JobSettings, DdpKnobs]] = {}
        self._applied: JobSettings | None = None
        if self.reporter.applied is not None:
            self._remember(self.reporter.applied)
        self.reporter.applied = None
        self._step_started: float | None = None
        self._stop_requested = False
        self._stopping = False
        self.steps = 0

    @property
    def module(self) -> nn.Module:
        """The model itself (its ``state_dict`` has no ``module.`` prefix)."""
        return self._module

    @property
    def ddp(self) -> DistributedDataParallel:
        """The current wrapper; replaced when the bucket size changes, so do not keep it."""
        return self._ddp

    @property
    def version(self) -> int:
        """The settings version the ranks run with (0 before the first)."""
        return self._applied.version if self._applied else 0

    @property
    def settings(self) -> JobSettings | None:
        """The settings the ranks run with, or None before the first."""
        return self._applied

    @property
    def bucket_cap_mb(self) -> float | None:
        """The DDP bucket cap in MiB (None: PyTorch's default, 25 with a 1 MiB first bucket)."""
        return self._bucket_cap_mb

    @property
    def chunk_bytes(self) -> int | None:
        """The allreduce chunk in bytes (None: one allreduce per bucket)."""
        return self._hook.chunk_bytes

    @property
    def comm_timer(self) -> CommTimer:
        """What times the exposed communication (a HostCommTimer or a CudaEventTimer)."""
        return self._hook.timer

    @property
    def received_versions(self) -> tuple[int, ...]:
        """Versions this rank has received but not yet applied (waiting for the others)."""
        return tuple(sorted(self._received))

    @property
    def stopping(self) -> bool:
        """True once a ``step_begin`` found that some rank requested a stop: leave the loop."""
        return self._stopping

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ddp(*args, **kwargs)

    def no_sync(self) -> AbstractContextManager[None]:
        """DDP's ``no_sync`` (gradient accumulation) on the current wrapper."""
        return self._ddp.no_sync()

    def request_stop(self) -> None:
        """Ask every rank to stop at the next ``step_begin`` (safe in a signal handler)."""
        self._stop_requested = True

    def step_begin(self) -> JobSettings | None:
        """Start an iteration: agree with the other ranks and switch settings if all have a
        newer version. Returns the settings switched to, or None. Call after ``opt.step()``
        of the previous iteration and before the forward pass; then check :attr:`stopping`.
        """
        if self._stopping:
            raise RuntimeError("the ranks agreed to stop; leave the training loop")
        if self._step_started is not None:
            raise RuntimeError("step_begin() called twice without step_end()")
        started = self._clock()
        self._receive()
        stop, chosen = self._agree()
        if stop:
            self._stopping = True
            return None
        switched = None
        if chosen is not None:
            switched = self._apply(*chosen)
        self._hook.reset()
        self._step_started = started
        return switched

    def step_end(self, samples: int, loss: float | torch.Tensor | None = None) -> StepTiming:
        """End the iteration (after ``opt.step()``) and report it to the agent."""
        if self._step_started is None:
            raise RuntimeError("step_end() called without step_begin()")
        step_s = max(0.0, self._clock() - self._step_started)
        self._step_started = None
        comm_s = min(self._hook.exposed_s(), step_s)
        value = float(loss.item()) if isinstance(loss, torch.Tensor) else loss
        self.reporter.report_step(samples, step_s, step_s - comm_s, comm_s, value)
        self.steps += 1
        return StepTiming(self.version, step_s, step_s - comm_s, comm_s, self._hook.buckets)

    def close(self) -> None:
        """Release the reporter (if this object created it) and the control group."""
        if self._owns_reporter:
            self.reporter.close()
        if self._owns_control and dist.is_initialized():
            dist.destroy_process_group(self._control)
            self._owns_control = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wrap(self, **overrides: Any) -> DistributedDataParallel:
        ddp = DistributedDataParallel(
            self._module, bucket_cap_mb=self._bucket_cap_mb, **{**self._ddp_kwargs, **overrides}
        )
        ddp.register_comm_hook(self._hook, chunked_allreduce_hook)
        return ddp

    def _remember(self, settings: JobSettings) -> None:
        knobs = knobs_from_settings(settings, self.nccl_plugin is not None)
        if knobs == DdpKnobs() and settings.settings:
            log.warning("settings v%d carry no usable DDP knob: %s", settings.version, settings)
        self._received[settings.version] = (settings, knobs)
        for version in sorted(self._received)[: -self._history]:
            del self._received[version]

    def _receive(self) -> None:
        new = self.reporter.poll_settings()
        # poll_settings marks what it returns as running; only the agreement switches versions.
        self.reporter.applied = self._applied
        if new is not None and new.version > self.version:
            self._remember(new)

    def _agree(self) -> tuple[bool, tuple[int, DdpKnobs] | None]:
        mine = encode_received(
            self._stop_requested,
            {version: knobs for version, (_, knobs) in self._received.items()},
            self._history,
        )
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._control))]
        dist.all_gather(gathered, mine, group=self._control)
        decoded = [decode_received(table) for table in gathered]
        stop = any(requested for requested, _ in decoded)
        return stop, choose_version([received for _, received in decoded], self.version)

    def _apply(self, version: int, knobs: DdpKnobs) -> JobSettings:
        settings = self._received[version][0]
        bucket = knobs.bucket_bytes
        current = self._bucket_cap_mb
        if bucket is not None and (current is None or int(current * MIB) != bucket):
            self._ddp._remove_autograd_hooks()
            self._bucket_cap_mb = bucket / MIB
            self._ddp = self._wrap(init_sync=False)
        if knobs.chunk_bytes is not None:
            self._hook.chunk_bytes = knobs.chunk_bytes
        plugin = self.nccl_plugin
        if plugin is not None and (knobs.algorithm is not None or knobs.protocol is not None):
            now = plugin.selected()
            choice = Choice(
                now.algorithm if knobs.algorithm is None else knobs.algorithm,
                now.protocol if knobs.protocol is None else knobs.protocol,
                now.channels,
            )
            if not plugin.select(choice):
                log.warning("rank %d: the NCCL tuner plugin refused %s", self.rank, choice)
        self._applied = settings
        self.reporter.applied = settings
        for old in [v for v in self._received if v <= version]:
            del self._received[old]
        log.info(
            "rank %d runs settings v%d: bucket_cap_mb %s, chunk_bytes %s, nccl %s",
            self.rank,
            version,
            self._bucket_cap_mb,
            self._hook.chunk_bytes,
            self.nccl_plugin.selected() if self.nccl_plugin is not None else "-",
        )
        return settings

"""TunedDDP on real gloo ranks: settings reach ranks at different times, all switch together.

The agent side is the real job channel (JobSource on unix sockets, one per rank, as if each
rank had its own node's agent). Ranks run ``python -m hyperagent.demo_torch``; the gradient
check runs this file as a script on two ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hyperagent.job import JobReporter, JobSettings, StepReport
from hyperagent.sources.job import JobSource
from hyperagent.tuner.space import SearchSpace

from conftest import BUSY, REPO, ManualClock, free_port

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from hyperagent.demo_torch import BATCH, LAYERS, build_model, launch_ranks, stop_ranks
    from hyperagent.integrations.torch import (
        CudaEventTimer,
        DdpKnobs,
        HostCommTimer,
        TorchCuda,
        TunedDDP,
        choose_version,
        comm_timer_for,
        decode_received,
        encode_received,
        knobs_from_settings,
    )

    TORCH_MISSING = ""
except ModuleNotFoundError as e:  # torch itself; a name missing from hyperagent is an error
    if e.name != "torch":
        raise
    TORCH_MISSING = str(e)

JOB = "ddp-test"
MIB = 1024 * 1024
SPACE = SearchSpace.default("gloo", 1)


@pytest.fixture(autouse=True)
def _torch_installed() -> None:
    if TORCH_MISSING:
        pytest.fail(
            f"PyTorch is missing ({TORCH_MISSING}): .venv/bin/pip install torch==2.13.0 "
            "(bash .ci/run does)"
        )


async def until(condition: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """The first truthy value of ``condition()``, polled while the loop serves the job
    socket; fails after ``timeout_s`` (generous: the CI machine is shared)."""
    async with asyncio.timeout(timeout_s):
        while not (value := condition()):
            await asyncio.sleep(0.005)
    return value


def reporting(source: JobSource) -> bool:
    """Whether a reporter of the job said hello to ``source``."""
    totals = source.jobs.get(JOB)
    return totals is not None and bool(totals.reporters)


def settings(version: int, bucket_mb: int, chunk_kb: int) -> JobSettings:
    """Settings as the agent hands them over: the abstract knobs and the gloo mapping."""
    knobs = {"bucket_mb": bucket_mb, "chunk_kb": chunk_kb, "allreduce": "ring"}
    return JobSettings(version, knobs, SPACE.backend_mapping(knobs))


# -- the pure parts ------------------------------------------------------------------------


def test_knobs_come_from_the_backend_mapping_or_the_abstract_knobs() -> None:
    assert knobs_from_settings(settings(3, 4, 256)) == DdpKnobs(4 * MIB, 256 * 1024)
    abstract = JobSettings(1, {"bucket_mb": 2, "chunk_kb": 64})
    assert knobs_from_settings(abstract) == DdpKnobs(2 * MIB, 64 * 1024)
    backend_first = JobSettings(1, {"bucket_mb": 2}, {"bucket_cap_mb": 8, "chunk_bytes": 1000})
    assert knobs_from_settings(backend_first) == DdpKnobs(8 * MIB, 1000)


@pytest.mark.parametrize(
    "garbage",
    ["32", None, True, -4, 0, math.nan, math.inf, 2.0**60, [1], {"mb": 1}],
)
def test_a_garbage_knob_is_skipped_and_the_other_kept(garbage: Any) -> None:
    message = JobSettings(7, {"bucket_mb": garbage, "chunk_kb": 128}, {"bucket_cap_mb": garbage})
    assert knobs_from_settings(message) == DdpKnobs(None, 128 * 1024)
    message = JobSettings(7, {"bucket_mb": 16, "chunk_kb": garbage}, {"chunk_bytes": garbage})
    assert knobs_from_settings(message) == DdpKnobs(16 * MIB, None)


def test_the_chosen_version_is_the_newest_every_rank_has() -> None:
    a, b, c = DdpKnobs(MIB, 1024), DdpKnobs(2 * MIB, 2048), DdpKnobs(4 * MIB, 4096)
    assert choose_version([{1: a, 2: b}, {1: a}], applied=0) == (1, a)
    assert choose_version([{1: a, 2: b}, {1: a, 2: b}], applied=0) == (2, b)
    # rank 1 jumped straight to 3 (it never saw 2): 3 once rank 0 has it, never 2
    assert choose_version([{2: b}, {3: c}], applied=1) is None
    assert choose_version([{2: b, 3: c}, {3: c}], applied=1) == (3, c)
    assert choose_version([{1: a}, {1: a}], applied=1) is None
    # the values are rank 0's, whatever another rank holds under the same version
    assert choose_version([{2: b}, {2: c}], applied=0) == (2, b)


def test_the_agreement_rows_round_trip_and_keep_the_newest_versions() -> None:
    received = {
        v: DdpKnobs(v * MIB, None if v % 2 else v * 1024, v % 7 if v % 3 else None, v % 3 or None)
        for v in range(1, 12)
    }
    table = encode_received(True, received, rows=4)
    assert table.shape == (5, 5) and table.dtype == torch.int64
    stop, decoded = decode_received(table)
    assert stop is True
    assert decoded == {v: received[v] for v in (8, 9, 10, 11)}
    assert decode_received(encode_received(False, {}, rows=4)) == (False, {})


# -- one rank in this process: the API around the agreement --------------------------------


@pytest.fixture
def single_rank(tmp_path: Path) -> Any:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_tuned_ddp_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        TunedDDP(build_model(0), job=JOB)


async def test_one_rank_applies_settings_reports_its_version_and_stops(
    tmp_path: Path, single_rank: None
) -> None:
    source = JobSource(tmp_path / "agent.sock")
    await source.start()
    seen: list[StepReport] = []
    source.listeners.append(seen.append)
    model = build_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, LAYERS[0]), torch.randint(0, 10, (8,))
    try:
        with TunedDDP(model, job=JOB, socket_path=source.socket_path) as tuned:
            await until(lambda: reporting(source))  # the reporter's hello reached the source
            # TunedDDP applies bucket and chunk live, not the AllReduce algorithm, and says so
            assert source.jobs[JOB].knobs() == ("bucket_mb", "chunk_kb")
            assert source.send_settings(JOB, settings(1, 2, 64)) == 1
            assert tuned.step_begin() == settings(1, 2, 64)
            first_ddp = tuned.ddp
            with pytest.raises(RuntimeError, match="twice"):
                tuned.step_begin()
            F.cross_entropy(tuned(x), y).backward()
            optimizer.step()
            timing = tuned.step_end(samples=8, loss=torch.tensor(1.5))
            assert (timing.version, tuned.bucket_cap_mb, tuned.chunk_bytes) == (1, 2, 64 * 1024)
            assert timing.buckets >= 1 and 0 <= timing.comm_s <= timing.step_s
            assert timing.compute_s == pytest.approx(timing.step_s - timing.comm_s)
            with pytest.raises(RuntimeError, match="without step_begin"):
                tuned.step_end(samples=8)

            assert source.send_settings(JOB, settings(2, 2, 1024)) == 1  # chunk only
            assert tuned.step_begin() is not None
            assert tuned.ddp is first_ddp and tuned.chunk_bytes == 1024 * 1024
            F.cross_entropy(tuned(x), y).backward()
            optimizer.step()
            tuned.step_end(samples=8, loss=1.0)

            tuned.request_stop()
            assert tuned.step_begin() is None and tuned.stopping
            with pytest.raises(RuntimeError, match="stop"):
                tuned.step_begin()
        await until(lambda: len(seen) >= 2)
    finally:
        await source.close()
    assert [(s.version, s.samples, s.loss) for s in seen] == [(1, 8, 1.5), (2, 8, 1.0)]


async def test_a_reporter_passed_in_keeps_its_polled_settings_for_the_agreement(
    tmp_path: Path, single_rank: None
) -> None:
    source = JobSource(tmp_path / "agent.sock")
    await source.start()
    try:
        with JobReporter(JOB, rank=0, socket_path=source.socket_path) as reporter:
            await until(lambda: reporting(source))
            assert source.send_settings(JOB, settings(4, 1, 64)) == 1
            assert await until(reporter.poll_settings) == settings(4, 1, 64)
            assert reporter.version == 4
            tuned = TunedDDP(build_model(0), reporter=reporter)
            assert reporter.version == 0 and tuned.received_versions == (4,)
            tuned.step_begin()
            assert reporter.version == tuned.version == 4 and tuned.bucket_cap_mb == 1
            tuned.close()
    finally:
        await source.close()


# -- timing the exposed communication: the host's clock on CPU, CUDA events on a GPU ---------


class FakeStream:
    """A stream of :class:`FakeCuda`: each event recorded on it completes at its next
    scripted time (ms), as the device would reach that point of the stream."""

    def __init__(self, name: str, times_ms: Iterable[float]) -> None:
        self.name = name
        self._times = iter(times_ms)

    def next_ms(self) -> float:
        return next(self._times)


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)`` on :class:`FakeCuda`'s scripted streams:
    ``elapsed_time`` fails (as CUDA's "device not ready") unless both events have completed,
    which they do once the host synchronised with them or with a later event."""

    def __init__(self, device: FakeCuda) -> None:
        self.device = device
        self.ms: float | None = None
        self.completed = False

    def record(self, stream: Any = None) -> None:
        stream = stream or self.device.current
        self.ms = stream.next_ms()
        self.completed = False
        self.device.log.append(f"record {stream.name} {self.ms:g}")

    def synchronize(self) -> None:
        assert self.ms is not None, "synchronize() on an event never recorded"
        self.device.log.append("synchronize")
        for event in self.device.events:
            if event.ms is not None and event.ms <= self.ms:
                event.completed = True

    def elapsed_time(self, end_event: FakeEvent) -> float:
        if not (self.completed and end_event.completed):
            raise RuntimeError("CUDA error: device not ready")
        assert self.ms is not None and end_event.ms is not None
        self.device.log.append("elapsed_time")
        return end_event.ms - self.ms


class FakeCuda:
    """A CudaRuntime over one fake device: the compute stream (current unless ``use`` says
    otherwise) and the streams the timer creates run on scripted clocks."""

    def __init__(self, compute_ms: Iterable[float], timer_stream_ms: Iterable[float]) -> None:
        self.compute = FakeStream("compute", compute_ms)
        self.current = self.compute
        self._timer_stream_ms = timer_stream_ms
        self.streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.log: list[str] = []

    def event(self) -> FakeEvent:
        event = FakeEvent(self)
        self.events.append(event)
        return event

    def current_stream(self) -> FakeStream:
        return self.current

    def new_stream(self) -> FakeStream:
        stream = FakeStream(f"timer{len(self.streams)}", self._timer_stream_ms)
        self.streams.append(stream)
        return stream

    @contextmanager
    def use(self, stream: FakeStream) -> Iterator[FakeStream]:
        previous, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = previous

    def future(self) -> FakeCudaFuture:
        return FakeCudaFuture(self)


class FakeCudaFuture(torch.futures.Future[Any]):
    """A future on :class:`FakeCuda`: logs on which stream it is waited for (a CUDA future's
    ``wait`` makes the current stream wait for it) and completed."""

    def __init__(self, device: FakeCuda) -> None:
        super().__init__()
        self.device = device

    def wait(self) -> Any:
        self.device.log.append(f"wait on {self.device.current.name}")
        return super().wait()

    def set_result(self, result: Any) -> None:
        self.device.log.append(f"complete on {self.device.current.name}")
        super().set_result(result)


def enqueued(cuda: FakeCuda) -> FakeCudaFuture:
    """An allreduce's future as NCCL hands it to the hook: already complete."""
    future = FakeCudaFuture(cuda)
    torch.futures.Future.set_result(future, [torch.zeros(4)])
    return future


def test_the_cuda_timer_reads_the_communication_off_the_events_once_per_step() -> None:
    # NCCL completes each future at enqueue: the host sees every bucket "done" in no time,
    # while on the device the last allreduce ends 12.5 ms after backward's last gradient
    cuda = FakeCuda(compute_ms=[10, 20, 30], timer_stream_ms=[18, 29, 42.5])
    timer = CudaEventTimer(cuda)
    timer.reset()
    buffers = [torch.full((4,), float(b)) for b in range(3)]
    results = []
    for buffer in buffers:
        timer.bucket_ready()
        results.append(timer.completion([enqueued(cuda), enqueued(cuda)], buffer))
    assert "synchronize" not in cuda.log and "elapsed_time" not in cuda.log  # backward: no read
    # the timer's stream waits for both chunks, marks done, and completes the hook's future
    # there: DDP's stream, waiting on that future, waits for the allreduces
    bucket = ["wait on timer0", "wait on timer0", "record timer0 {}", "complete on timer0"]
    assert cuda.log == [
        line.format(done)
        for ready, done in [(10, 18), (20, 29), (30, 42.5)]
        for line in [f"record compute {ready}", *bucket]
    ]
    assert all(r.wait() is b for r, b in zip(results, buffers, strict=True))
    assert timer.exposed_s() == pytest.approx(0.0125)
    assert cuda.log[-2:] == ["synchronize", "elapsed_time"]
    assert len(cuda.events) == 2 and len(cuda.streams) == 1


def test_the_cuda_timer_reuses_its_two_events_and_reads_nothing_without_buckets() -> None:
    steps = [(5, 100.0), (1, 250.0), (0, 0.0), (3, 40.0)]  # (buckets, exposed ms)
    compute, done = [], []
    clock = 0.0
    for buckets, exposed_ms in steps:
        for _ in range(buckets):
            clock += 7.0
            compute.append(clock)
            done.append(clock + 3.0)
        if buckets:
            done[-1] = compute[-1] + exposed_ms
        clock += 1000.0
    cuda = FakeCuda(compute, done)
    timer = CudaEventTimer(cuda)
    measured = []
    for buckets, _ in steps:
        timer.reset()
        for _ in range(buckets):
            timer.bucket_ready()
            timer.completion([enqueued(cuda)], torch.zeros(2)).wait()
        reads = cuda.log.count("synchronize")
        measured.append(timer.exposed_s())
        assert cuda.log.count("synchronize") == reads + (1 if buckets else 0)
    assert measured == pytest.approx([0.1, 0.25, 0.0, 0.04])
    assert len(cuda.events) == 2 and len(cuda.streams) == 1


@pytest.mark.parametrize("timer_kind", ["host", "cuda"])
def test_both_timers_count_from_the_last_bucket_ready_to_the_last_allreduce_done(
    timer_kind: str,
) -> None:
    # gloo-like: the futures complete after later buckets were ready, in their own order
    script = [("ready", 0, 10.0), ("ready", 1, 20.0), ("done", 0, 25.0), ("ready", 2, 30.0)]
    script += [("done", 2, 36.0), ("done", 1, 37.0)]
    clock = ManualClock()
    cuda = FakeCuda(
        [t for kind, _, t in script if kind == "ready"],
        [t for kind, _, t in script if kind == "done"],
    )
    timer = HostCommTimer(clock) if timer_kind == "host" else CudaEventTimer(cuda)
    timer.reset()
    allreduces: dict[int, torch.futures.Future[Any]] = {}
    results = []
    for kind, bucket, t_ms in script:
        clock.now = t_ms / 1000
        if kind == "ready":
            timer.bucket_ready()
            allreduces[bucket] = torch.futures.Future()
            results.append(timer.completion([allreduces[bucket]], torch.zeros(1)))
        else:
            allreduces[bucket].set_result([torch.zeros(1)])
    assert all(result.done() for result in results)
    assert timer.exposed_s() == pytest.approx(0.007)


def test_a_failed_allreduce_fails_the_hooks_future_and_marks_nothing_done() -> None:
    cuda = FakeCuda([10.0], [99.0])
    timer = CudaEventTimer(cuda)
    timer.reset()
    timer.bucket_ready()
    failing: torch.futures.Future[Any] = torch.futures.Future()
    result = timer.completion([enqueued(cuda), failing], torch.zeros(1))
    failing.set_exception(RuntimeError("NCCL communicator was aborted"))
    with pytest.raises(RuntimeError, match="aborted"):
        result.wait()
    assert timer.exposed_s() == 0.0


def test_cuda_devices_are_timed_by_events_and_cpu_ones_by_the_host_clock() -> None:
    # choosing touches no CUDA (this build has none); the events come at the first bucket
    timer = comm_timer_for(torch.device("cuda", 1))
    assert isinstance(timer, CudaEventTimer)
    assert isinstance(timer.runtime, TorchCuda) and timer.runtime.device == torch.device("cuda", 1)
    clock = ManualClock()
    host = comm_timer_for(torch.device("cpu"), clock)
    assert isinstance(host, HostCommTimer) and host.clock is clock


def test_a_cpu_model_is_timed_by_the_host_clock(tmp_path: Path, single_rank: None) -> None:
    with TunedDDP(build_model(0), job=JOB, socket_path=tmp_path / "no-agent.sock") as tuned:
        assert isinstance(tuned.comm_timer, HostCommTimer)


async def test_with_cuda_events_the_step_reports_their_communication_not_the_hosts(
    tmp_path: Path, single_rank: None
) -> None:
    # every bucket's allreduce ends, on the device, 900 ms after its gradients were ready;
    # on this CPU the same allreduces take microseconds by the host's clock
    cuda = FakeCuda(
        compute_ms=(100.0 + 10 * k for k in range(10_000)),
        timer_stream_ms=(1000.0 + 10 * k for k in range(10_000)),
    )
    clock = ManualClock()
    source = JobSource(tmp_path / "agent.sock")
    await source.start()
    seen: list[StepReport] = []
    source.listeners.append(seen.append)
    model = build_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, LAYERS[0]), torch.randint(0, 10, (8,))
    timings = []
    try:
        with TunedDDP(
            model,
            job=JOB,
            socket_path=source.socket_path,
            clock=clock,
            comm_timer=CudaEventTimer(cuda),
        ) as tuned:
            await until(lambda: reporting(source))
            for step in range(3):
                clock.now = 10.0 * step
                tuned.step_begin()
                F.cross_entropy(tuned(x), y).backward()
                optimizer.step()
                clock.now = 10.0 * step + 2.0
                timings.append(tuned.step_end(samples=8, loss=1.0))
        await until(lambda: len(seen) >= 3)
    finally:
        await source.close()
    assert min(t.buckets for t in timings) >= 1 and max(t.buckets for t in timings) >= 2
    assert [t.step_s for t in timings] == [2.0] * 3
    assert [t.comm_s for t in timings] == pytest.approx([0.9] * 3)
    assert [(s.compute_s, s.comm_s) for s in seen] == [(t.compute_s, t.comm_s) for t in timings]
    assert [s.compute_s for s in seen] == pytest.approx([1.1] * 3)
    assert cuda.log.count("synchronize") == cuda.log.count("elapsed_time") == 3
    assert len(cuda.events) == 2


# -- two ranks, settings arriving at different times ---------------------------------------

STEPS = 50
VERSIONS = {
    1: settings(1, 1, 64),
    2: settings(2, 4, 256),
    3: settings(3, 2, 1024),
    4: settings(4, 32, 32768),
    5: settings(5, 32, 128),  # the chunk alone changes: no re-wrap
}
SCHEDULE = [
    # (after rank 0 reported this many steps, to these ranks, this version)
    (3, (0, 1), 1),
    (10, (0,), 2),
    (18, (1,), 2),
    (24, (0,), 3),  # rank 1 never gets v3: it must never run
    (30, (1,), 4),
    (34, (0,), 4),
    (40, (0, 1), 5),
]


def expected_knobs(version: int) -> tuple[float | None, int | None]:
    if version == 0:
        return None, None
    knobs = knobs_from_settings(VERSIONS[version])
    assert knobs.bucket_bytes is not None
    return knobs.bucket_bytes / MIB, knobs.chunk_bytes


def runs(versions: list[int]) -> list[int]:
    return [v for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v]


@BUSY
@pytest.mark.long(31)
async def test_ranks_switch_settings_together_whenever_each_receives_them(tmp_path: Path) -> None:
    sources = [JobSource(tmp_path / f"agent{rank}.sock") for rank in range(2)]
    reports: list[list[StepReport]] = [[], []]
    for rank, source in enumerate(sources):
        await source.start()
        source.listeners.append(reports[rank].append)
    ranks = await launch_ranks(
        tmp_path, JOB, [s.socket_path for s in sources], steps=STEPS, checksum=True
    )
    try:
        async with asyncio.timeout(100):
            for after, targets, version in SCHEDULE:
                while len(reports[0]) < after:
                    if any(r.process.returncode is not None for r in ranks):
                        pytest.fail("a rank exited early:\n" + ranks[0].output_tail())
                    await asyncio.sleep(0.005)
                for rank in targets:
                    assert sources[rank].send_settings(JOB, VERSIONS[version]) == 1
            codes = await asyncio.gather(*(r.process.wait() for r in ranks))
    finally:
        await stop_ranks(ranks, timeout_s=10)
        for source in sources:
            await source.close()
    assert codes == [0, 0], ranks[0].output_tail() + ranks[1].output_tail()
    logs = [r.steps() for r in ranks]
    assert len(logs[0]) == len(logs[1]) == STEPS

    versions = [[s["version"] for s in log] for log in logs]
    assert versions[0] == versions[1]
    assert runs(versions[0]) == [0, 1, 2, 4, 5]
    assert [s["checksum"] for s in logs[0]] == [s["checksum"] for s in logs[1]]
    for log in logs:
        for s in log:
            assert (s["bucket_cap_mb"], s["chunk_bytes"]) == expected_knobs(s["version"]), s
    # rank 0 held v2 while rank 1 had not received it, and rank 1 held v4 likewise
    assert any(s["version"] == 1 and 2 in s["waiting"] for s in logs[0])
    assert any(s["version"] == 2 and 4 in s["waiting"] for s in logs[1])

    for rank in range(2):
        reported = reports[rank]
        assert [s.version for s in reported] == versions[rank]
        assert all(s.rank == rank and s.samples == BATCH for s in reported)
        for s, logged in zip(reported, logs[rank], strict=True):
            assert s.step_s == pytest.approx(logged["step_s"])
            assert 0 <= s.comm_s <= s.step_s
            assert s.compute_s + s.comm_s == pytest.approx(s.step_s)
        assert any(s.comm_s > 0 for s in reported)


# -- the chunked hook against DDP's own reduction ------------------------------------------

CHUNKINGS = [(1, 64 * 1024), (None, 100_000), (4, 3_000_000), (None, None)]
"""(bucket_cap_mb, chunk_bytes): chunks dividing buckets evenly, with remainders, larger than
some buckets, and none."""


def gradient_worker(rank: int, port: int, out: Path) -> None:
    """Gradients of one batch under DDP without a hook and under TunedDDP with each chunking."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    original = build_model(0)
    data = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, LAYERS[0], generator=data), torch.randint(0, 10, (32,), generator=data)

    def gradients(wrapped: Any, model: torch.nn.Module) -> list[torch.Tensor]:
        F.cross_entropy(wrapped(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    reference = copy.deepcopy(original)
    result = {"default": gradients(DistributedDataParallel(reference), reference)}
    for bucket_mb, chunk in CHUNKINGS:
        model = copy.deepcopy(original)
        tuned = TunedDDP(
            model,
            job=JOB,
            socket_path=out.parent / "no-agent.sock",
            bucket_cap_mb=bucket_mb,
            chunk_bytes=chunk,
        )
        result[f"{bucket_mb}/{chunk}"] = gradients(tuned, model)
        tuned.close()
    torch.save(result, out)
    dist.destroy_process_group()


@BUSY
@pytest.mark.long(26)
def test_the_chunked_hook_gives_the_default_hooks_gradients(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "OMP_NUM_THREADS": "1"}
    outputs = [tmp_path / f"grads{rank}.pt" for rank in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(rank), "--port", str(port), "--out", str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank, out in enumerate(outputs)
    ]
    try:
        logs = [w.communicate(timeout=100)[0].decode(errors="replace") for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    assert [w.returncode for w in workers] == [0, 0], logs
    results = [torch.load(out) for out in outputs]
    for result in results:
        default = result["default"]
        assert any(g.abs().max() > 0 for g in default)
        for key in (f"{b}/{c}" for b, c in CHUNKINGS):
            for chunked, reference in zip(result[key], default, strict=True):
                torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=1e-7)
    for key in results[0]:
        for a, b in zip(results[0][key], results[1][key], strict=True):
            assert torch.equal(a, b), f"ranks differ under {key}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args()
    gradient_worker(arguments.rank, arguments.port, arguments.out)

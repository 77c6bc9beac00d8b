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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hyperagent.job import JobReporter, JobSettings, StepReport
from hyperagent.sources.job import JobSource
from hyperagent.tuner.space import SearchSpace

from conftest import REPO, free_port

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from hyperagent.demo_torch import BATCH, LAYERS, build_model, launch_ranks, stop_ranks
    from hyperagent.integrations.torch import (
        DdpKnobs,
        TunedDDP,
        choose_version,
        decode_received,
        encode_received,
        knobs_from_settings,
    )

    TORCH_MISSING = ""
except ImportError as e:
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
    received = {v: DdpKnobs(v * MIB, None if v % 2 else v * 1024) for v in range(1, 12)}
    table = encode_received(True, received, rows=4)
    assert table.shape == (5, 3) and table.dtype == torch.int64
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

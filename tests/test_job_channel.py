"""The job channel over a real unix datagram socket: reports in, settings out, bad input counted."""

from __future__ import annotations

import asyncio
import math
import socket
from pathlib import Path

import pytest

from hyperagent.errors import PayloadError
from hyperagent.job import JobReporter, JobSettings, StepReport, decode, encode_step, parse_step
from hyperagent.sources.job import JobSource


async def _until(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


def test_step_roundtrip_keeps_nonfinite_loss() -> None:
    for loss in (1.5, None, math.nan, math.inf, -math.inf):
        step = StepReport("j", 1, 32, 0.5, 0.4, 0.1, loss, 3)
        back = parse_step(decode(encode_step(step)))
        assert back.samples == 32 and back.version == 3
        if loss is None or math.isfinite(loss):
            assert back.loss == loss
        else:
            assert not math.isfinite(back.loss) and (math.isnan(loss) == math.isnan(back.loss))


@pytest.mark.parametrize(
    "datagram",
    [
        b"not json",
        b"[1,2]",
        b'{"v": 2, "type": "step", "job": "j"}',
        b'{"v": 1, "type": "bogus", "job": "j"}',
        b'{"v": 1, "type": "step", "job": ""}',
        b'{"v": 1, "type": "step", "job": "j", "rank": 0, "samples": -1, "step_s": 1,'
        b' "compute_s": 1, "comm_s": 0, "version": 0}',
        b'{"v": 1, "type": "step", "job": "j", "rank": 0, "samples": 1, "step_s": "1",'
        b' "compute_s": 1, "comm_s": 0, "version": 0}',
    ],
)
def test_bad_datagrams_are_rejected(datagram: bytes) -> None:
    with pytest.raises(PayloadError):
        parse_step(decode(datagram))


async def test_reports_and_settings_over_the_socket(tmp_path: Path) -> None:
    source = JobSource(tmp_path / "job.sock")
    await source.start()
    seen: list[StepReport] = []
    source.listeners.append(seen.append)
    try:
        reporter = JobReporter("train-1", rank=0, socket_path=tmp_path / "job.sock")
        for _ in range(3):
            reporter.report_step(samples=64, step_s=0.5, compute_s=0.4, comm_s=0.1, loss=2.0)
        reporter.report_step(samples=64, step_s=0.5, compute_s=0.4, comm_s=0.1, loss=math.nan)
        await _until(lambda: len(seen) == 4)
        readings = {(r.name, r.labels.get("job_id")): r.value for r in await source.read()}
        assert readings[("hyperagent_job_samples_total", "train-1")] == 256
        assert readings[("hyperagent_job_compute_seconds_total", "train-1")] == pytest.approx(1.6)
        assert readings[("hyperagent_job_nonfinite_loss_total", "train-1")] == 1
        assert ("hyperagent_job_loss", "train-1") in readings

        sent = source.send_settings(
            "train-1", JobSettings(7, {"bucket_mb": 8}, {"NCCL_ALGO": "Ring"})
        )
        assert sent == 1
        await _until(lambda: reporter.poll_settings() is not None or reporter.version == 7)
        assert reporter.version == 7 and reporter.applied is not None
        assert reporter.applied.settings == {"bucket_mb": 8}
        assert reporter.poll_settings() is None  # handed out once
        reporter.report_step(samples=1, step_s=0.1, compute_s=0.1, comm_s=0.0)
        await _until(lambda: len(seen) == 5)
        assert seen[-1].version == 7

        late = JobReporter("train-1", rank=1, socket_path=tmp_path / "job.sock")
        await _until(lambda: late.poll_settings() is not None or late.version == 7)
        assert late.version == 7  # a reporter that attaches later gets the current settings
        reporter.close()
        late.close()
    finally:
        await source.close()


async def test_a_burst_of_reports_from_many_ranks_is_counted_whole(tmp_path: Path) -> None:
    """Eight ranks report at once (the kernel queues 10 datagrams): each wake-up takes them all."""
    source = JobSource(tmp_path / "job.sock")
    await source.start()
    try:
        reporters = []
        for rank in range(8):  # each says hello on creation
            reporters.append(JobReporter("burst", rank=rank, socket_path=tmp_path / "job.sock"))
            await asyncio.sleep(0.01)
        for _ in range(40):
            for reporter in reporters:
                reporter.report_step(samples=2, step_s=0.01, compute_s=0.008, comm_s=0.002)
            await asyncio.sleep(0.01)
        await _until(lambda: "burst" in source.jobs and source.jobs["burst"].steps == 320)
        await asyncio.sleep(0.2)
        assert source.jobs["burst"].samples == 640 and source.invalid == 0
        assert sum(reporter.dropped for reporter in reporters) == 0
        assert set(source.jobs["burst"].reporters) == set(range(8))
        for reporter in reporters:
            reporter.close()
    finally:
        await source.close()


async def test_garbage_is_counted_and_dropped(tmp_path: Path) -> None:
    source = JobSource(tmp_path / "job.sock")
    await source.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for garbage in (b"\xff\xfe", b"{}", b'{"v":1,"type":"settings","job":"x"}'):
                s.sendto(garbage, str(tmp_path / "job.sock"))
        await _until(lambda: source.invalid == 3)
        reporter = JobReporter("ok", socket_path=tmp_path / "job.sock")
        reporter.report_step(samples=1, step_s=0.1, compute_s=0.1, comm_s=0.0)
        await _until(lambda: "ok" in source.jobs and source.jobs["ok"].steps == 1)
        reporter.close()
    finally:
        await source.close()


def test_reporter_without_agent_never_blocks(tmp_path: Path) -> None:
    with JobReporter("alone", socket_path=tmp_path / "nobody.sock") as reporter:
        for _ in range(100):
            reporter.report_step(samples=1, step_s=0.1, compute_s=0.1, comm_s=0.0)
        assert reporter.dropped == 101  # hello + 100 steps
        assert reporter.poll_settings() is None

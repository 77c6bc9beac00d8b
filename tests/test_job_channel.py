"""The job channel over a real unix seqpacket socket: reports in, settings out, bad input
counted, peers authorised by their credentials, jobs bound to the user that claimed them."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import pwd
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from hyperagent.errors import PayloadError
from hyperagent.job import (
    JobReporter,
    JobSettings,
    MemoryReport,
    StepReport,
    decode,
    encode_hello,
    encode_step,
    parse_step,
)
from hyperagent.sources import job as job_source
from hyperagent.sources.job import GroupCache, JobSource, PeerPolicy, SocketInUse

from conftest import ManualClock


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
        b'{"v": 1, "type": "step", "job": "llama.ft", "rank": 0, "samples": 1, "step_s": 1,'
        b' "compute_s": 1, "comm_s": 0, "version": 0}',
        b'{"v": 1, "type": "hello", "job": "a/b", "rank": 0}',
        b'{"v": 1, "type": "hello", "job": "a+", "rank": 0}',
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
    """Eight ranks report at once: every packet queued on every connection is read."""
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
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(str(tmp_path / "job.sock"))
            for garbage in (b"\xff\xfe", b"{}", b'{"v":1,"type":"settings","job":"x"}'):
                s.send(garbage)
            await _until(lambda: source.invalid == 3)
        reporter = JobReporter("ok", socket_path=tmp_path / "job.sock")
        reporter.report_step(samples=1, step_s=0.1, compute_s=0.1, comm_s=0.0)
        await _until(lambda: "ok" in source.jobs and source.jobs["ok"].steps == 1)
        reporter.close()
    finally:
        await source.close()


@pytest.mark.parametrize("job", ["llama.ft", "a/b", "a#", "a+b", "x" * 65])
def test_a_job_id_that_cannot_be_a_topic_level_is_refused_at_the_rank(
    job: str, tmp_path: Path
) -> None:
    """A job id goes into MQTT topics: one holding a separator (or too long) fails at once,
    saying which id and why, wherever it came from."""
    with pytest.raises(ValueError, match="job id") as e:
        JobReporter(job, socket_path=tmp_path / "job.sock")
    assert repr(job) in str(e.value)
    with pytest.raises(ValueError, match="RabbitMQ"):
        JobReporter(environ={"HYPERAGENT_JOB_ID": "run.7"}, socket_path=tmp_path / "job.sock")


async def test_a_hello_for_a_job_id_with_a_separator_is_dropped_and_counted(
    tmp_path: Path,
) -> None:
    source = JobSource(tmp_path / "job.sock")
    await source.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(str(tmp_path / "job.sock"))
            s.send(b'{"v": 1, "type": "hello", "job": "gpu.job", "rank": 0}')
            await _until(lambda: source.invalid == 1)
        assert "gpu.job" not in source.jobs
    finally:
        await source.close()


def test_reporter_without_agent_never_blocks(tmp_path: Path) -> None:
    with JobReporter("alone", socket_path=tmp_path / "nobody.sock") as reporter:
        for _ in range(100):
            reporter.report_step(samples=1, step_s=0.1, compute_s=0.1, comm_s=0.0)
        assert reporter.dropped == 100  # the hello goes out on each connection, none here
        assert reporter.poll_settings() is None


# -- peers of other users (these run a rank as another uid through setpriv: root only) -----

NOBODY = 65534
REPO = Path(__file__).resolve().parents[1]
needs_root = pytest.mark.usefixtures("root_only")  # runs a rank as another user


RANK_AS_OTHER_USER = """
import sys, time
from hyperagent.job import JobReporter
reporter = JobReporter(sys.argv[2], rank=0, socket_path=sys.argv[1])
deadline = time.monotonic() + 10
version = 0
while time.monotonic() < deadline and reporter.refused is None and version == 0:
    reporter.report_step(samples=4, step_s=0.1, compute_s=0.08, comm_s=0.02)
    settings = reporter.poll_settings()
    version = settings.version if settings else 0
    time.sleep(0.02)
print(reporter.refused or f"settings v{version}")
"""


async def _rank_as(uid: int, socket_path: Path, job: str) -> str:
    """Run a rank of ``job`` as ``uid``; what it was told (refusal or settings version)."""
    process = await asyncio.create_subprocess_exec(
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--",
        sys.executable,
        "-c",
        RANK_AS_OTHER_USER,
        str(socket_path),
        job,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode().strip()


@needs_root
async def test_a_user_outside_the_policy_is_refused_and_counted(shared_dir: Path) -> None:
    source = JobSource(shared_dir / "job.sock")
    await source.start()
    try:
        told = await _rank_as(NOBODY, shared_dir / "job.sock", "train")
        assert told.startswith("unauthorised"), told
        assert "train" not in source.jobs and source.refused["unauthorised"] >= 1
        counted = {
            r.labels.get("reason"): r.value
            for r in await source.read()
            if r.name == "hyperagent_job_refused_total"
        }
        assert counted["unauthorised"] >= 1
    finally:
        await source.close()


@needs_root
async def test_another_users_rank_under_a_jobs_id_is_a_job_of_its_own(shared_dir: Path) -> None:
    """A rank outside any scheduler job is bound to its uid: another user saying the agent's
    user's job id runs a job of its own, ``u<uid>-<id>``; none of its steps count for the
    other job, the other job's settings never reach it, and its own do, under the id it said."""
    source = JobSource(shared_dir / "job.sock", PeerPolicy(users=frozenset({NOBODY})))
    await source.start()
    try:
        owner = JobReporter("train", rank=0, socket_path=shared_dir / "job.sock")
        owner.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)
        await _until(lambda: "train" in source.jobs and source.jobs["train"].steps == 1)
        source.send_settings("train", JobSettings(3, {"bucket_mb": 8}))

        squatter = asyncio.create_task(_rank_as(NOBODY, shared_dir / "job.sock", "train"))
        own = f"u{NOBODY}-train"
        await _until(lambda: own in source.jobs and source.jobs[own].steps, 30)
        assert source.jobs[own].owner == NOBODY and source.jobs["train"].owner == os.geteuid()
        assert source.jobs["train"].steps == 1  # nothing it sent was counted for "train"
        assert source.jobs["train"].version == 3 and source.jobs[own].version == 0
        source.send_settings(own, JobSettings(5, {"bucket_mb": 16}))
        assert await squatter == "settings v5"
        owner.close()
    finally:
        await source.close()


LDAP_GROUP = 4242
"""A group the user database says nobody is in (as a directory service would)."""


@needs_root
async def test_group_lookups_leave_the_event_loop_running_and_are_kept_a_while(
    shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member of an allowed group connects while the user database is slow (a directory
    server taking its time): the agent's loop keeps turning during the lookup, the member is
    let in, and the same user connecting again within the cache lifetime is not looked up
    again."""
    turns = 0
    entered, release = threading.Event(), threading.Event()
    lookups: list[tuple[int, int]] = []
    """(loop turns when a lookup began, loop turns when it ended)"""
    getpwuid = pwd.getpwuid

    def slow_getpwuid(uid: int) -> pwd.struct_passwd:
        began = turns
        entered.set()
        release.wait(timeout=5)
        lookups.append((began, turns))
        return getpwuid(uid)

    monkeypatch.setattr(pwd, "getpwuid", slow_getpwuid)
    monkeypatch.setattr(os, "getgrouplist", lambda user, gid: [gid, LDAP_GROUP])

    async def turn() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0.001)

    path = shared_dir / "job.sock"
    source = JobSource(path, PeerPolicy(groups=frozenset({LDAP_GROUP})))
    await source.start()
    turning = asyncio.create_task(turn())
    try:
        first = asyncio.create_task(_rank_as(NOBODY, path, "ldap-job"))
        await _until(entered.is_set, timeout_s=20)
        began = turns
        await _until(lambda: turns >= began + 20)
        release.set()
        job = f"u{NOBODY}-ldap-job"  # outside any scheduler: bound to its user
        await _until(lambda: job in source.jobs and source.jobs[job].steps > 0)
        source.send_settings(job, JobSettings(1, {}))
        assert await first == "settings v1"
        assert await _rank_as(NOBODY, path, "ldap-job") == "settings v1"
        assert source.refused["unauthorised"] == 0
        assert len(lookups) == 1, f"{len(lookups)} lookups for one user within the cache lifetime"
        assert lookups[0][1] - lookups[0][0] >= 20, "the event loop stood still during the lookup"
    finally:
        turning.cancel()
        await source.close()


@needs_root
async def test_a_user_outside_the_allowed_groups_is_refused_after_the_lookup(
    shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "getgrouplist", lambda user, gid: [gid])
    path = shared_dir / "job.sock"
    source = JobSource(path, PeerPolicy(groups=frozenset({LDAP_GROUP})))
    await source.start()
    try:
        told = await _rank_as(NOBODY, path, "train")
        assert told.startswith("unauthorised"), told
        assert "train" not in source.jobs and source.refused["unauthorised"] >= 1
        assert source.groups.lookups == 1
    finally:
        await source.close()


async def test_group_cache_asks_once_per_uid_within_its_lifetime() -> None:
    clock = ManualClock()
    asked: list[int] = []
    answers = {1000: frozenset({1000, 4242})}

    def lookup(uid: int) -> frozenset[int] | None:
        asked.append(uid)
        return answers.get(uid)

    cache = GroupCache(lookup, ttl_s=60, clock=clock)
    together = await asyncio.gather(*(cache.groups(1000) for _ in range(5)))
    assert together == [answers[1000]] * 5 and asked == [1000]  # in flight: shared
    clock.now = 59.0
    assert await cache.groups(1000) == answers[1000] and await cache.groups(7) is None
    assert asked == [1000, 7]
    answers[1000] = frozenset({1000})  # removed from the group in the directory
    clock.now = 61.0
    assert await cache.groups(1000) == frozenset({1000}) and asked == [1000, 7, 1000]


async def test_one_connection_cannot_report_for_another_job(tmp_path: Path) -> None:
    source = JobSource(tmp_path / "job.sock")
    await source.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(str(tmp_path / "job.sock"))
            s.send(encode_hello("mine", 0))
            await _until(lambda: source.attached("mine") == 1)
            s.send(encode_step(StepReport("theirs", 0, 32, 0.5, 0.4, 0.1, 1.0, 0)))
            s.send(encode_step(StepReport("mine", 0, 32, 0.5, 0.4, 0.1, 1.0, 0)))
            await _until(lambda: source.jobs["mine"].steps == 1)
        assert "theirs" not in source.jobs and source.refused["not_claimed"] == 1
    finally:
        await source.close()


async def test_jobs_and_ranks_are_bounded(tmp_path: Path) -> None:
    policy = PeerPolicy(max_jobs=2, max_ranks=2)
    source = JobSource(tmp_path / "job.sock", policy)
    await source.start()
    path = tmp_path / "job.sock"
    try:
        ranks = [JobReporter("a", rank=r, socket_path=path) for r in range(3)]
        others = [JobReporter(job, socket_path=path) for job in ("b", "c")]
        await _until(
            lambda: source.refused["too_many_ranks"] == 1 and source.refused["too_many_jobs"] == 1
        )
        assert source.attached("a") == 2 and source.attached("b") == 1 and "c" not in source.jobs
        await _until(lambda: ranks[2].poll_settings() is None and ranks[2].refused is not None)
        assert ranks[2].refused.startswith("too_many_ranks")
        for reporter in (*ranks, *others):
            reporter.close()
    finally:
        await source.close()


async def test_a_live_socket_is_never_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "job.sock"
    first = JobSource(path)
    await first.start()
    try:
        with pytest.raises(SocketInUse, match="another hyperagent agent"):
            await JobSource(path).start()
        second = JobSource(path)
        with contextlib.suppress(SocketInUse):
            await second.start()
        await second.close()  # a refused source leaves the live socket alone
        reporter = JobReporter("still", socket_path=path)
        reporter.report_step(samples=1, step_s=0.1, compute_s=0.1, comm_s=0.0)
        await _until(lambda: "still" in first.jobs and first.jobs["still"].steps == 1)
        reporter.close()
    finally:
        await first.close()
    # a socket left by a process that is gone is replaced
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
        stale.bind(str(path))
    again = JobSource(path)
    await again.start()
    await again.close()


async def test_settings_that_do_not_reach_a_rank_are_counted_as_undelivered(
    tmp_path: Path,
) -> None:
    source = JobSource(tmp_path / "job.sock")
    await source.start()
    try:
        reading = JobReporter("j", rank=0, socket_path=tmp_path / "job.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stuck:
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.connect(str(tmp_path / "job.sock"))
            stuck.send(encode_hello("j", 1))  # a rank that never reads what it is sent
            await _until(lambda: source.attached("j") == 2)
            big = {"bucket_mb": 8, "note": "x" * 8000}
            delivered = []
            for version in range(1, 200):
                delivered.append(source.send_settings("j", JobSettings(version, big)))
                reading.poll_settings()  # this rank keeps up
            assert delivered[0] == 2 and min(delivered) == 1  # the stuck rank's buffer filled
            assert source.attached("j") == 2
        reading.close()
    finally:
        await source.close()


async def test_memory_reports_become_readings(tmp_path: Path) -> None:
    source = JobSource(tmp_path / "job.sock")
    await source.start()
    try:
        reporters = [JobReporter("m", rank=r, socket_path=tmp_path / "job.sock") for r in (0, 1)]
        for rank, reporter in enumerate(reporters):
            memory = MemoryReport(int((0.5 + 0.25 * rank) * 2**30), 2**30, 3 + rank, rank)
            reporter.report_step(samples=1, step_s=0.1, compute_s=0.1, comm_s=0.0, memory=memory)
        await _until(lambda: "m" in source.jobs and source.jobs["m"].steps == 2)
        readings = {r.name: r.value for r in await source.read() if r.labels.get("job_id") == "m"}
        assert readings["hyperagent_job_gpu_memory_allocated_ratio"] == 0.75
        assert readings["hyperagent_job_alloc_retries_total"] == 7
        assert readings["hyperagent_job_oom_total"] == 1
        with pytest.raises(PayloadError, match="memory"):
            parse_step(
                decode(
                    b'{"v":1,"type":"step","job":"m","rank":0,"samples":1,'
                    b'"step_s":1,"compute_s":1,"comm_s":0,"version":0,'
                    b'"memory":{"allocated_bytes":9,"total_bytes":4,'
                    b'"alloc_retries":0,"ooms":0}}'
                )
            )
        for reporter in reporters:
            reporter.close()
    finally:
        await source.close()


class Arrivals:
    """What a source's listener saw: each step, when it was sent (``source.arrived``) and
    when it was handled."""

    def __init__(self, source: JobSource) -> None:
        self.source = source
        self.steps: list[tuple[StepReport, float, float]] = []
        source.listeners.append(self.seen)

    def seen(self, step: StepReport) -> None:
        self.steps.append((step, self.source.arrived, asyncio.get_running_loop().time()))


async def batched_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[JobSource, JobReporter, Arrivals]:
    """A source that batches, with one rank (5 steps a second) batched; the next pass is
    far away."""
    monkeypatch.setattr(job_source, "BATCH_S", 0.3)
    source = JobSource(tmp_path / "job.sock")
    await source.start()
    source.prompt = False
    arrivals = Arrivals(source)
    reporter = JobReporter("slow", rank=0, socket_path=tmp_path / "job.sock")
    await _until(lambda: source.attached("slow") == 1, 2)  # its hello, read at once
    for _ in range(3):
        reporter.report_step(samples=1, step_s=0.2, compute_s=0.2, comm_s=0.0)
        await asyncio.sleep(0.2)
    await _until(lambda: all(p.batched for p in source.peers.values()), 3)
    monkeypatch.setattr(job_source, "BATCH_S", 1e9)  # the next multiple: never here
    await asyncio.sleep(0.35)  # the pass due on the old grid
    return source, reporter, arrivals


async def test_a_rank_that_reports_slowly_is_read_in_passes_with_its_steps_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside trials (not ``prompt``) a slow rank's steps wait in its socket for the next
    pass (or a read of the source): one wake-up for many steps. Each step keeps the time it
    was sent, and none is lost."""
    source, reporter, arrivals = await batched_rank(tmp_path, monkeypatch)
    try:
        before = source.jobs["slow"].steps
        sent = []
        for _ in range(3):
            reporter.report_step(samples=1, step_s=0.05, compute_s=0.05, comm_s=0.0)
            sent.append(time.monotonic())
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert source.jobs["slow"].steps == before  # waiting in the socket
        readings = {r.name: r.value for r in await source.read()}
        assert readings["hyperagent_job_steps_total"] == before + 3 == len(arrivals.steps)
        last = arrivals.steps[-3:]
        assert max(h for _, _, h in last) - min(h for _, _, h in last) < 0.05  # one pass
        for (_, arrived, handled), at in zip(last, sent, strict=True):
            assert abs(arrived - at) < 0.03 and handled - arrived > 0.2
        assert reporter.dropped == 0
        reporter.close()
    finally:
        await source.close()


async def test_a_batched_ranks_close_is_seen_at_once_after_its_last_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, reporter, arrivals = await batched_rank(tmp_path, monkeypatch)
    left: list[tuple[str, int]] = []
    source.rank_listeners.append(lambda job, rank: left.append((job, rank)))
    try:
        before = len(arrivals.steps)
        for _ in range(2):
            reporter.report_step(samples=1, step_s=0.05, compute_s=0.05, comm_s=0.0)
        reporter.close()
        began = time.monotonic()
        await _until(lambda: left == [("slow", 0)], 2)
        assert time.monotonic() - began < 1.0  # not at a pass: none comes
        assert len(arrivals.steps) == before + 2 and source.attached("slow") == 0
    finally:
        await source.close()


async def test_prompt_reads_what_waited_and_then_each_step_as_it_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, reporter, arrivals = await batched_rank(tmp_path, monkeypatch)
    try:
        before = len(arrivals.steps)
        reporter.report_step(samples=1, step_s=0.05, compute_s=0.05, comm_s=0.0)
        await asyncio.sleep(0.1)
        assert len(arrivals.steps) == before
        source.prompt = True  # as the agent does when a trial begins
        assert len(arrivals.steps) == before + 1
        reporter.report_step(samples=1, step_s=0.05, compute_s=0.05, comm_s=0.0)
        await _until(lambda: len(arrivals.steps) == before + 2, 2)
        _, arrived, handled = arrivals.steps[-1]
        assert handled - arrived < 0.1 and not any(p.batched for p in source.peers.values())
        reporter.close()
    finally:
        await source.close()


async def test_a_rank_that_reports_fast_is_read_as_it_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over ``BATCH_RATE`` packets a second a rank's socket could fill between passes: it is
    read as it reports, and nothing is lost."""
    monkeypatch.setattr(job_source, "BATCH_S", 0.3)
    source = JobSource(tmp_path / "job.sock")
    await source.start()
    source.prompt = False
    arrivals = Arrivals(source)
    try:
        reporter = JobReporter("fast", rank=0, socket_path=tmp_path / "job.sock")
        for _ in range(150):  # 150 steps a second for a second
            reporter.report_step(samples=1, step_s=0.005, compute_s=0.005, comm_s=0.0)
            await asyncio.sleep(1 / 150)
        await _until(lambda: len(arrivals.steps) == 150, 2)
        assert not any(p.batched for p in source.peers.values())
        late = [handled - arrived for _, arrived, handled in arrivals.steps[-50:]]
        assert sorted(late)[25] < 0.05 and reporter.dropped == 0
        reporter.close()
    finally:
        await source.close()

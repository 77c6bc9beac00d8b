"""The scheduler's word on a Slurm job: ``scontrol show job -d`` of real jobs (fixtures/slurm,
recorded from Debian's Slurm 22.05.8 on the test cluster) parsed into the job's user, nodes,
tasks and per-node GPU indices; a job whose name and comment imitate the controller's lines is
refused; the query's cache, bounds and failures. tests/test_slurm_real.py asks a live Slurm."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

from hyperagent.sources.command import CommandFailed, CommandTimeout, CommandUnavailable
from hyperagent.sources.slurm_jobs import (
    MAX_HOSTS,
    SlurmJobInfo,
    SlurmJobs,
    SlurmParseError,
    SlurmQueryError,
    SlurmTimeout,
    SlurmUnavailable,
    UnknownJob,
    expand_hostlist,
    parse_index_list,
    parse_scontrol_job,
)

from conftest import FIXTURES, ManualClock

SLURM = FIXTURES / "slurm"


def capture(name: str) -> str:
    return (SLURM / f"scontrol-show-job-d-{name}.txt").read_text()


# -- parsing real jobs -----------------------------------------------------------------------


def test_a_two_node_job_has_its_user_nodes_tasks_and_gpus_of_each_node() -> None:
    info = parse_scontrol_job(capture("running-alice-2-nodes"), "1")
    assert info == SlurmJobInfo(
        job_id="1",
        user="alice",
        uid=1001,
        nodes=("gpu-1", "gpu-2"),
        tasks=4,
        gpus={"gpu-1": (0, 1), "gpu-2": (0, 1)},
        state="RUNNING",
    )
    assert info.gpus_on("gpu-2") == (0, 1) and info.gpus_on("gpu-3") is None


def test_a_job_beside_another_has_the_gpus_slurm_gave_it_on_each_node() -> None:
    info = parse_scontrol_job(capture("running-bob-3-nodes"), "2")
    assert (info.user, info.uid, info.tasks) == ("bob", 1002, 3)
    assert info.nodes == ("gpu-1", "gpu-2", "gpu-3")
    assert info.gpus == {"gpu-1": (2, 3, 4), "gpu-2": (2, 3, 4), "gpu-3": (0, 1, 2)}


def test_a_batch_job_and_a_job_without_gpus() -> None:
    batch = parse_scontrol_job(capture("running-mallory-batch"), "3")
    assert (batch.user, batch.nodes, batch.gpus, batch.tasks) == (
        "mallory",
        ("gpu-3",),
        {"gpu-3": (3,)},
        1,
    )
    cpu_only = parse_scontrol_job(capture("running-eve-no-gpu"), "4")
    assert cpu_only.user == "eve" and cpu_only.gpus == {"gpu-3": ()}


def test_pending_ended_and_cancelled_jobs_hold_no_gpu() -> None:
    pending = parse_scontrol_job(capture("pending-eve"), "9")
    assert (pending.state, pending.nodes, pending.gpus, pending.tasks) == ("PENDING", (), {}, 3)
    completed = parse_scontrol_job(capture("completed-alice"), "8")
    assert (completed.state, completed.gpus) == ("COMPLETED", {"gpu-3": ()})
    cancelled = parse_scontrol_job(capture("cancelled-alice"), "1")
    assert cancelled.state == "CANCELLED"
    assert cancelled.gpus == {"gpu-1": (), "gpu-2": ()}


def test_an_array_prints_one_record_per_task_and_the_one_asked_for_is_taken() -> None:
    text = capture("array-bob")
    assert parse_scontrol_job(text, "6").job_id == "6"
    assert parse_scontrol_job(text, "7").job_id == "7"
    with pytest.raises(SlurmParseError, match="2 records"):
        parse_scontrol_job(text)
    with pytest.raises(SlurmParseError, match="no record of job 8"):
        parse_scontrol_job(text, "8")


def test_a_job_name_and_comment_imitating_the_controller_are_refused() -> None:
    """mallory's job 5 (recorded): its name adds a line ``UserId=alice(1001)``, its comment
    ``NodeList=gpu-[1-3]`` and ``Nodes=gpu-1 ... GRES=gpu:8(IDX:0-7)``. Each forgery alone is
    refused too (the recorded text with the others taken out)."""
    text = capture("running-mallory-forged-name-comment")
    with pytest.raises(SlurmParseError, match="2 lines starting with UserId="):
        parse_scontrol_job(text, "5")
    forged_user = "   UserId=alice(1001) GroupId=alice(1001)\n"
    forged_nodes = "   NodeList=gpu-[1-3]\n"
    assert forged_user in text and forged_nodes in text
    no_user = text.replace(forged_user, "")
    with pytest.raises(SlurmParseError, match="2 lines starting with NodeList="):
        parse_scontrol_job(no_user, "5")
    only_gres = no_user.replace(forged_nodes, "")
    with pytest.raises(SlurmParseError, match="names node gpu-1, not one of the job's"):
        parse_scontrol_job(only_gres, "5")
    on_its_node = only_gres.replace("Nodes=gpu-1 CPU_IDs=0", "Nodes=gpu-3 CPU_IDs=0")
    with pytest.raises(SlurmParseError, match="two GRES lines name node gpu-3"):
        parse_scontrol_job(on_its_node, "5")
    real = on_its_node.replace("     Nodes=gpu-3 CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7) \n", "")
    info = parse_scontrol_job(real, "5")
    assert (info.user, info.nodes, info.gpus) == ("mallory", ("gpu-3",), {"gpu-3": (4,)})


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no record"),
        ("Priority=1\n", "starts with 'Priority=1'"),
        ("JobId=4 JobName=x\n   JobState=RUNNING\n", "no line starting with UserId="),
        (
            "JobId=4 JobName=x\n   UserId=alice GroupId=x\n   JobState=RUNNING\n"
            "   NodeList=\n   NumNodes=1 NumTasks=1\n",
            "is not name\\(uid\\)",
        ),
        (
            "JobId=4 JobName=x\n   UserId=a(1)\n   JobState=RUNNING\n   NodeList=n[1-\n"
            "   NumNodes=1 NumTasks=1\n",
            "unbalanced",
        ),
        (
            "JobId=4 JobName=x\n   UserId=a(1)\n   JobState=RUNNING\n   NodeList=n1\n"
            "   NumNodes=1 NumTasks=lots\n",
            "NumTasks='lots'",
        ),
        (
            "JobId=4 JobName=x\n   UserId=a(1)\n   JobState=RUNNING\n   NodeList=n1\n"
            "   NumNodes=1 NumTasks=1\n     Nodes=n1 GRES=gpu:2(IDX:3-1)\n",
            "out of range",
        ),
    ],
)
def test_output_that_is_not_one_job_is_refused_saying_why(text: str, why: str) -> None:
    with pytest.raises(SlurmParseError, match=why):
        parse_scontrol_job(text, "4")


def test_gres_with_a_type_and_other_gres_count_only_the_gpus() -> None:
    text = (
        "JobId=4 JobName=x\n   UserId=a(7)\n   JobState=RUNNING\n   NodeList=n[1-2]\n"
        "   NumNodes=2 NumTasks=N/A\n"
        "     Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:a100:2(IDX:0,5),shard:4(0/1,0/1)\n"
        "     Nodes=n2 CPU_IDs=0 Mem=0 GRES=gpu:a100:1(IDX:1),gpu:h100:1(IDX:7)\n"
    )
    info = parse_scontrol_job(text, "4")
    assert info.tasks is None
    assert info.gpus == {"n1": (0, 5), "n2": (1, 7)}


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("gpu-[1-3,5]", ("gpu-1", "gpu-2", "gpu-3", "gpu-5")),
        ("n[08-10]", ("n08", "n09", "n10")),
        ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
        ("gpu-1,gpu-[3-4],login", ("gpu-1", "gpu-3", "gpu-4", "login")),
        ("gpu-3", ("gpu-3",)),
        ("(null)", ()),
        ("", ()),
    ],
)
def test_hostlists_expand_as_slurm_writes_them(hostlist: str, hosts: tuple[str, ...]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist",
    ["gpu-[1-", "gpu-1]", "gpu-[3-1]", "gpu-[a]", "gpu-[[1]]", "a,,b", f"n[0-{MAX_HOSTS}]"],
)
def test_malformed_or_huge_hostlists_raise(hostlist: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(hostlist)


def test_index_lists() -> None:
    assert parse_index_list("0-3,5") == (0, 1, 2, 3, 5)
    assert parse_index_list("N/A") == () and parse_index_list("") == ()
    for bad in ("1-", "x", "0-99999"):
        with pytest.raises(ValueError):
            parse_index_list(bad)


# -- the query -------------------------------------------------------------------------------


class FakeScontrol:
    """Answers ``scontrol show job -d <id>`` from the recordings: job id -> capture name, or
    an exception to raise. Counts the calls and the most running at once."""

    def __init__(self, answers: dict[str, str | Exception], delay_s: float = 0.0) -> None:
        self.answers = answers
        self.delay_s = delay_s
        self.calls: list[tuple[str, ...]] = []
        self.running = 0
        self.most = 0

    async def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        self.calls.append(tuple(argv))
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(self.delay_s)
            answer = self.answers[argv[-1]]
            if isinstance(answer, Exception):
                raise answer
            return capture(answer)
        finally:
            self.running -= 1


def invalid_job(argv: Sequence[str]) -> CommandFailed:
    stderr = (SLURM / "scontrol-show-job-d-invalid-job-id.stderr").read_text()
    return CommandFailed("exited 1", argv, 1, stderr)


async def test_an_answer_is_cached_for_its_ttl_then_asked_again() -> None:
    clock = ManualClock()
    fake = FakeScontrol({"1": "running-alice-2-nodes"})
    jobs = SlurmJobs(("scontrol",), ttl_s=60, clock=clock, run=fake)
    first = await jobs.lookup("1")
    assert fake.calls == [("scontrol", "show", "job", "-d", "1")]
    clock.now = 59
    assert await jobs.lookup("1") is first and jobs.cached("1") is first
    assert len(fake.calls) == 1
    clock.now = 60
    assert jobs.cached("1") is None
    await jobs.lookup("1")
    assert len(fake.calls) == 2 and jobs.queries == 2


async def test_a_job_the_controller_does_not_know_is_none_and_asked_again_soon(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    fake = FakeScontrol({"999999": invalid_job(["scontrol"])})
    jobs = SlurmJobs(failure_ttl_s=5, clock=clock, run=fake)
    with caplog.at_level(logging.DEBUG, "hyperagent.sources.slurm_jobs"):
        with pytest.raises(UnknownJob, match="knows no job 999999") as raised:
            await jobs.lookup("999999")
        assert await jobs.get("999999") is None
    assert "Invalid job id specified" in raised.value.detail
    assert len(fake.calls) == 1, "the failure is cached"
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("DEBUG", "Slurm job 999999: the controller knows no job 999999")
    ]
    clock.now = 5
    assert await jobs.get("999999") is None
    assert len(fake.calls) == 2


async def test_timeouts_and_other_failures_are_cached_briefly_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A controller that stops answering is one warning, not one per job and query; its
    return is logged too."""
    clock = ManualClock()
    down = CommandFailed(
        "exited 1",
        ["scontrol"],
        1,
        "slurm_load_jobs error: Unable to contact slurm controller (connect failure)",
    )
    fake = FakeScontrol({"1": CommandTimeout("slow", ["scontrol"]), "2": down})
    jobs = SlurmJobs(clock=clock, run=fake)
    with caplog.at_level(logging.DEBUG, "hyperagent.sources.slurm_jobs"):
        assert await jobs.get("1") is None
        assert await jobs.get("2") is None
        with pytest.raises(SlurmTimeout):
            await jobs.lookup("1")
        with pytest.raises(SlurmQueryError, match="Unable to contact"):
            await jobs.lookup("2")
        assert len(fake.calls) == 2, "each failure is cached for failure_ttl_s"
        fake.answers["3"] = "running-mallory-batch"
        assert await jobs.get("3") is not None
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels == [
        (
            "WARNING",
            "Slurm job 1: no answer from the controller: scontrol show job 1 did not"
            " answer within 5s",
        ),
        (
            "DEBUG",
            "Slurm job 2: no answer from the controller: scontrol show job 2: slurm_load"
            "_jobs error: Unable to contact slurm controller (connect failure)",
        ),
        ("INFO", "Slurm: the controller answers again"),
    ]


async def test_a_refused_answer_is_a_warning_naming_the_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeScontrol({"5": "running-mallory-forged-name-comment"})
    with caplog.at_level(logging.WARNING, "hyperagent.sources.slurm_jobs"):
        assert await SlurmJobs(run=fake).get("5") is None
    assert "Slurm job 5: the controller's answer is refused: job 5: 2 lines" in caplog.text


async def test_a_missing_scontrol_stops_every_lookup_for_a_while() -> None:
    clock = ManualClock()
    fake = FakeScontrol({"1": CommandUnavailable("scontrol is not installed")})
    jobs = SlurmJobs(unavailable_ttl_s=300, clock=clock, run=fake)
    for job in ("1", "2", "3"):
        with pytest.raises(SlurmUnavailable, match="scontrol is not installed"):
            await jobs.lookup(job)
    assert len(fake.calls) == 1
    clock.now = 300
    fake.answers["2"] = "running-bob-3-nodes"
    assert (await jobs.lookup("2")).user == "bob"


async def test_callers_share_one_query_per_job_and_queries_are_bounded() -> None:
    fake = FakeScontrol(
        {"1": "running-alice-2-nodes", "2": "running-bob-3-nodes", "3": "running-mallory-batch"},
        delay_s=0.05,
    )
    jobs = SlurmJobs(max_concurrent=2, run=fake)
    same = await asyncio.gather(*(jobs.lookup("1") for _ in range(10)))
    assert len(fake.calls) == 1 and all(s is same[0] for s in same)
    jobs.forget("1")
    infos = await asyncio.gather(*(jobs.lookup(j) for j in ("1", "2", "3") * 3))
    assert [i.user for i in infos[:3]] == ["alice", "bob", "mallory"]
    assert len(fake.calls) == 4 and fake.most == 2
    assert not jobs._inflight, "no lock is kept for a job nobody waits on"


async def test_the_cache_keeps_the_most_recently_used_jobs() -> None:
    fake = FakeScontrol({"1": "running-alice-2-nodes", "2": "running-bob-3-nodes"})
    fake.answers["3"] = "running-mallory-batch"
    jobs = SlurmJobs(max_cached=2, run=fake)
    await jobs.lookup("1")
    await jobs.lookup("2")
    await jobs.lookup("1")
    await jobs.lookup("3")
    assert len(jobs) == 2 and jobs.cached("2") is None and jobs.cached("1") is not None


@pytest.mark.parametrize("job_id", ["", "slurm-4242-0", "-1", "4242; id", "4242 4243", "1" * 13])
async def test_only_slurm_job_ids_are_asked_about(job_id: str) -> None:
    fake = FakeScontrol({})
    with pytest.raises(ValueError, match="is not a Slurm job id"):
        await SlurmJobs(run=fake).lookup(job_id)
    assert not fake.calls


async def test_scontrol_runs_as_a_subprocess_under_its_timeout(tmp_path: Path) -> None:
    """The real subprocess path: a stand-in scontrol that prints a recording, one that prints
    the recorded error, one that hangs (killed at the timeout), one that is not there."""
    recording = SLURM / "scontrol-show-job-d-running-bob-3-nodes.txt"
    cat = SlurmJobs(("sh", "-c", 'cat "$0"', str(recording)))
    assert (await cat.lookup("2")).gpus["gpu-3"] == (0, 1, 2)
    error = SLURM / "scontrol-show-job-d-invalid-job-id.stderr"
    fails = SlurmJobs(("sh", "-c", 'cat "$0" >&2; exit 1', str(error)))
    with pytest.raises(UnknownJob):
        await fails.lookup("999999")
    started = asyncio.get_running_loop().time()
    hangs = SlurmJobs(("sh", "-c", "sleep 30"), timeout_s=0.3)
    with pytest.raises(SlurmTimeout):
        await hangs.lookup("1")
    assert asyncio.get_running_loop().time() - started < 5
    with pytest.raises(SlurmUnavailable):
        await SlurmJobs((str(tmp_path / "scontrol"),)).lookup("1")


def alive(pid: str) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def written(path: Path, count: int) -> bool:
    return path.exists() and len(path.read_text().split()) == count


async def test_a_cancelled_lookup_kills_scontrol_and_what_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"echo $$ > {pids}; sleep 30 & echo $! >> {pids}; wait"
    jobs = SlurmJobs(("sh", "-c", script), timeout_s=60)
    task = asyncio.create_task(jobs.lookup("1"), name="lookup")
    for _ in range(100):
        if written(pids, 2):
            break
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not [pid for pid in pids.read_text().split() if alive(pid)]

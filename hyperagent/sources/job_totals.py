"""The jobs on this node as the job channel knows them: each one's running totals over its
ranks (``JobTotals``) and its series, and the book of them (``JobBook``): the bounds on jobs
(``max_jobs`` live ones, ``max_jobs_per_user``) and on a job's ranks, a job id bound to the uid
that first said hello for it, the settings remembered for a job's ranks to come, and the
release of a job ``release_after_s`` after its last rank left (checked every
``release_check_s``), a dead job making room for a new one at once."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from hyperagent import job as protocol
from hyperagent.job import JobSettings, StepReport
from hyperagent.readings import Kind, Reading
from hyperagent.sources.job_peers import Peer, PeerPolicy

JobListener = Callable[[str], None]
"""A job released."""

Refusal = tuple[str, str]
"""(reason, detail) of a refused hello (a reason of ``REFUSALS``)."""

RELEASE_CHECK_S = 1.0
"""How often jobs due for release are looked for (at most; twice per ``release_after_s``)."""

REFUSAL_NAMES = 16
"""Live jobs named in a ``too_many_jobs`` refusal at most (the rest are counted)."""


@dataclass
class JobTotals:
    """Running totals of one job's step reports on this node, summed over its ranks: ``step_s``
    adds every rank's step time (a node's step time is ``step_s / steps`` per rank-step, or
    the change of ``step_s`` over ``reporting_ranks``)."""

    steps: int = 0
    samples: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    nonfinite_losses: int = 0
    loss: float | None = None
    version: int = 0
    owner: int | None = None
    """The uid the job id is bound to."""
    slurm_job: str = ""
    """The Slurm job id its ranks' cgroup names (empty: outside Slurm)."""
    ranks: dict[int, Peer] = field(default_factory=dict)
    """rank -> its live connection, where settings go."""
    attached_at: float = 0.0
    """When (on the source's clock) its first connected rank said hello."""
    left_at: float = 0.0
    """When (on the source's clock) the last rank disconnected, or the job became known
    without a rank."""
    alloc_retries: dict[int, int] = field(default_factory=dict)
    """Connected rank -> its process's allocator retries so far (as it last reported)."""
    ooms: dict[int, int] = field(default_factory=dict)
    """Connected rank -> its process's OOMs so far."""
    departed_alloc_retries: int = 0
    """The retries of ranks whose connections closed (a rank that comes back is a new
    process, whose counts start from 0)."""
    departed_ooms: int = 0
    last_step_s: dict[int, float] = field(default_factory=dict)
    """Connected rank -> the step time of its last step (the ranks that reported steps)."""

    @property
    def reporters(self) -> dict[int, Peer]:
        return self.ranks

    @property
    def reporting_ranks(self) -> int:
        """Connected ranks whose steps are counted here: the divisor that turns the sums over
        ranks into the node's step time (``step_s`` / ranks)."""
        return sum(1 for rank in self.ranks if rank in self.last_step_s)

    def rank_step_s(self) -> float | None:
        """The mean over the connected ranks of their last step time: one rank's step time."""
        times = [self.last_step_s[r] for r in self.ranks if r in self.last_step_s]
        return sum(times) / len(times) if times else None

    @property
    def total_alloc_retries(self) -> int:
        return self.departed_alloc_retries + sum(self.alloc_retries.values())

    @property
    def total_ooms(self) -> int:
        return self.departed_ooms + sum(self.ooms.values())

    def leave(self, rank: int) -> None:
        """Forget what ``rank`` alone knew (its connection closed); its counts stay summed."""
        self.ranks.pop(rank, None)
        self.last_step_s.pop(rank, None)
        self.departed_alloc_retries += self.alloc_retries.pop(rank, 0)
        self.departed_ooms += self.ooms.pop(rank, 0)

    def add(self, step: StepReport) -> None:
        self.steps += 1
        self.samples += step.samples
        self.step_s += step.step_s
        self.last_step_s[step.rank] = step.step_s
        self.compute_s += step.compute_s
        self.comm_s += step.comm_s
        if step.loss is not None:
            if math.isfinite(step.loss):
                self.loss = step.loss
            else:
                self.nonfinite_losses += 1
        if step.memory is not None:
            self.alloc_retries[step.rank] = step.memory.alloc_retries
            self.ooms[step.rank] = step.memory.ooms

    def knobs(self) -> tuple[str, ...] | None:
        """The knobs every connected rank applies (None when no rank said)."""
        return protocol.common_knobs(p.knobs for p in self.ranks.values())

    def said(self, field_name: str) -> object:
        """What the connected ranks said of ``field_name`` in their hellos: the lowest rank's
        answer among those that said (None when none did)."""
        for rank in sorted(self.ranks):
            hello = self.ranks[rank].hello
            value = None if hello is None else getattr(hello, field_name)
            if value is not None:
                return value
        return None

    def tune(self) -> bool | None:
        """Whether the job asks to be tuned: False when any connected rank refuses, True when
        one asks, None when none says."""
        said = [p.hello.tune for p in self.ranks.values() if p.hello is not None]
        if False in said:
            return False
        return True if True in said else None

    def describe(self) -> dict[str, object]:
        """What the coordinator needs to find the job (see :class:`~hyperagent.job.Hello`):
        its attached ranks, world size, backend, whether it asks to be tuned, its owner."""
        out: dict[str, object] = {
            "attached": len(self.ranks),
            "rank_ids": sorted(self.ranks),
            "uid": self.owner,
        }
        for key in ("world_size", "local_world_size", "backend", "model_params"):
            value = self.said(key)
            if value is not None:
                out[key] = value
        tune = self.tune()
        if tune is not None:
            out["tune"] = tune
        return out

    def readings(self, job: str) -> list[Reading]:
        """The job's series (``job_id`` ``job``)."""
        labels = {"job_id": job}
        out = [
            Reading("hyperagent_job_steps_total", self.steps, labels, Kind.COUNTER),
            Reading("hyperagent_job_samples_total", self.samples, labels, Kind.COUNTER),
            Reading("hyperagent_job_step_seconds_total", self.step_s, labels, Kind.COUNTER, "s"),
            Reading("hyperagent_job_compute_seconds_total", self.compute_s, labels, Kind.COUNTER),
            Reading(
                "hyperagent_job_communication_seconds_total", self.comm_s, labels, Kind.COUNTER
            ),
            Reading(
                "hyperagent_job_nonfinite_loss_total", self.nonfinite_losses, labels, Kind.COUNTER
            ),
            Reading("hyperagent_job_settings_version", self.version, labels),
            Reading("hyperagent_job_ranks", len(self.ranks), labels),
            Reading("hyperagent_job_reporting_ranks", self.reporting_ranks, labels),
        ]
        rank_step_s = self.rank_step_s()
        if rank_step_s is not None:
            out.append(Reading("hyperagent_job_rank_step_seconds", rank_step_s, labels))
        if self.loss is not None:
            out.append(Reading("hyperagent_job_loss", self.loss, labels))
        memory = [p.memory for p in self.ranks.values() if p.memory is not None]
        if memory:
            out.append(
                Reading(
                    "hyperagent_job_gpu_memory_allocated_ratio",
                    max(m.allocated_ratio for m in memory),
                    labels,
                )
            )
        out += [  # from 0, so that increase() sees a job's first retry or OOM
            Reading(
                "hyperagent_job_alloc_retries_total", self.total_alloc_retries, labels, Kind.COUNTER
            ),
            Reading("hyperagent_job_oom_total", self.total_ooms, labels, Kind.COUNTER),
        ]
        return out


class JobBook:
    """The jobs known here; owns their totals, the settings remembered for each, and when a
    job may have no rank connected (the release loop sleeps while every job is live)."""

    def __init__(self, policy: PeerPolicy, clock: Callable[[], float]) -> None:
        """``policy`` bounds the jobs and their ranks; ``clock`` times jobs' release."""
        self.policy = policy
        self.clock = clock
        self.jobs: dict[str, JobTotals] = {}
        self.settings: dict[str, JobSettings] = {}
        """job -> its latest settings, handed to its ranks that attach later."""
        self.release_listeners: list[JobListener] = []
        """Told of every job released (after its state here went)."""
        self.release_check_s = min(RELEASE_CHECK_S, max(policy.release_after_s / 2, 0.05))
        self._dead = asyncio.Event()
        """Set when a job may have no rank connected (no wake-ups while every job is live)."""

    async def release_loop(self) -> None:
        while True:
            if all(t.ranks for t in self.jobs.values()):
                self._dead.clear()
                await self._dead.wait()
            await asyncio.sleep(self.release_check_s)
            self.release_due()

    def attached(self, job: str) -> int:
        """How many ranks of ``job`` are connected."""
        totals = self.jobs.get(job)
        return len(totals.ranks) if totals else 0

    def join(self, job: str, uid: int, rank: int, slurm_job: str | None) -> JobTotals | Refusal:
        """The totals of ``job`` that rank ``rank`` of ``uid`` joins (a new job made where it
        fits the bounds; ``slurm_job``: the Slurm job its cgroup names), or why it may not."""
        totals = self.jobs.get(job)
        if totals is not None and self._due(totals):
            self.release(job)
            totals = None
        if totals is None:
            held = sum(1 for t in self.jobs.values() if t.owner == uid and t.ranks)
            if held >= self.policy.max_jobs_per_user:
                return "too_many_jobs", f"uid {uid} holds {held} live jobs (max_jobs_per_user)"
            live = self._make_room()
            if live:
                return "too_many_jobs", _live_jobs(live, self.policy.max_jobs)
            totals = self._new_job(job)
        if slurm_job:
            totals.slurm_job = slurm_job
        if totals.owner is None:
            totals.owner = uid
        elif totals.owner != uid:
            return "job_claimed", f"job {job} belongs to uid {totals.owner}"
        if rank not in totals.ranks and len(totals.ranks) >= self.policy.max_ranks:
            return "too_many_ranks", f"job {job} has {len(totals.ranks)} ranks"
        return totals

    def leave(self, peer: Peer) -> bool:
        """``peer``'s connection closed: whether it was its job's rank (then no longer)."""
        if peer.job is None:
            return False
        totals = self.jobs.get(peer.job)
        if totals is None or totals.ranks.get(peer.rank) is not peer:
            return False
        totals.leave(peer.rank)
        if not totals.ranks:
            totals.left_at = self.clock()
            self._dead.set()
        return True

    def remember(self, job: str, settings: JobSettings) -> JobTotals:
        """``job``'s latest settings, for its ranks now and to come; its totals (made, where
        the job is not here yet, without displacing a live one)."""
        self.settings[job] = settings
        totals = self.jobs.get(job)
        if totals is None:
            self._make_room()
            totals = self._new_job(job)
        totals.version = settings.version
        return totals

    def _due(self, totals: JobTotals) -> bool:
        return not totals.ranks and self.clock() - totals.left_at >= self.policy.release_after_s

    def _new_job(self, job: str) -> JobTotals:
        totals = self.jobs[job] = JobTotals(left_at=self.clock())
        self._dead.set()  # until its first rank says hello
        return totals

    def _make_room(self) -> list[str]:
        """Release dead jobs, oldest first, until a new job fits under ``max_jobs``; returns
        the live jobs that fill the bound (empty when it fits)."""
        self.release_due()
        dead = sorted((t.left_at, j) for j, t in self.jobs.items() if not t.ranks)
        while len(self.jobs) >= self.policy.max_jobs and dead:
            self.release(dead.pop(0)[1])
        if len(self.jobs) < self.policy.max_jobs:
            return []
        return [j for j, t in self.jobs.items() if t.ranks]

    def release_due(self) -> list[str]:
        """Release every job whose last rank left ``release_after_s`` ago or more; returns
        them."""
        due = [job for job, totals in self.jobs.items() if self._due(totals)]
        for job in due:
            self.release(job)
        return due

    def release(self, job: str) -> None:
        """Forget ``job`` (none of its ranks may be connected): its totals, its owner, its
        remembered settings and so its series."""
        totals = self.jobs.pop(job, None)
        self.settings.pop(job, None)
        if totals is None:
            return
        assert not totals.ranks, f"job {job} released with ranks connected"
        for listener in self.release_listeners:
            listener(job)


def _live_jobs(live: list[str], bound: int) -> str:
    """A ``too_many_jobs`` refusal's detail: the live jobs that fill the bound."""
    named = ", ".join(sorted(live)[:REFUSAL_NAMES])
    more = f" and {len(live) - REFUSAL_NAMES} more" if len(live) > REFUSAL_NAMES else ""
    return f"all {bound} job slots (max_jobs) are held by live jobs: {named}{more}"

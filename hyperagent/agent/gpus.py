"""Which GPUs each job on this node holds: attribution's answer (:mod:`hyperagent.attribution`:
NVML's processes, Slurm cgroups or a mapping directory, what ranks declared) over the job
channel's ranks, with the scheduler's word over it; and the per-job summary the coordinator
finds and tunes jobs by."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from hyperagent.agent.devices import DeviceCalls
from hyperagent.attribution import Attribution, ChannelJobs, JobLedger, passwd_file
from hyperagent.config import Config
from hyperagent.readings import Reading
from hyperagent.sources import Hardware
from hyperagent.sources.job import JobSource
from hyperagent.sources.job_scheduler import ScheduledJobs
from hyperagent.sources.slurm_jobs import SlurmJobs

HeldListener = Callable[[dict[str, set[int]], dict[str, set[int]]], None]
"""(before, now): the GPUs each job held before an attribution, and after it."""


class JobGpus:
    """The jobs' GPUs here; owns what attribution last found (``held``) and when NVML's
    processes were last read."""

    def __init__(
        self,
        config: Config,
        hardware: Hardware,
        job_source: JobSource | None,
        devices: DeviceCalls,
    ) -> None:
        self.config = config
        self.hardware = hardware
        self.job_source = job_source
        self.devices = devices
        job_config = config.sources.job
        self.scheduled = ScheduledJobs(
            SlurmJobs(job_config.scontrol) if job_config.scontrol else None,
            job_config.slurm_node or config.node,
            job_config.squeue,
        )
        """What Slurm says of the jobs whose ranks' cgroups name a Slurm job."""
        self.attribution = _attribution(config, hardware)
        """Which job holds each GPU, and the per-job GPU series (``[attribution]``)."""
        self.held: dict[str, set[int]] = {}
        """job -> the GPU indices its ranks run on (their processes, or what they declared)."""
        self.listeners: list[HeldListener] = []
        """Told after each attribution of the jobs' GPUs before and after it."""
        self._gpu_pids: dict[str, list[int]] = {}
        self._gpu_pids_at = -math.inf
        self._ranks_at_read: frozenset[int] = frozenset()
        """The ranks' pids when NVML's processes were last read: a new rank reads them again."""

    # -- the job channel's events --------------------------------------------------------

    def rank_attached(self, job: str, rank: int) -> None:
        """A rank of a Slurm job attached: Slurm is asked which GPUs the job holds here."""
        totals = self.job_source.jobs.get(job) if self.job_source is not None else None
        if totals is not None and totals.slurm_job:
            self.scheduled.follow(job, totals.slurm_job)

    def job_released(self, job: str) -> None:
        self.scheduled.forget(job)

    # -- attribution ---------------------------------------------------------------------

    async def readings(self, readings: list[Reading]) -> list[Reading]:
        """Which job holds which GPU and each job's GPUs, power and energy: NVML's running
        processes (looked at every ``attribution.interval_s``) matched against the job
        channel's peer pids and, as ``attribution.mode`` says, against their Slurm cgroups or
        a job-mapping directory; the GPU a rank declared in its hello where NVML shows none."""
        attribution = self.attribution
        peers = self.job_source is not None and bool(self.job_source.peers)
        if not peers and attribution.idle:
            self.held = {}
            return []
        channel = ChannelJobs()
        if self.job_source is not None and peers:
            channel.pids = self.job_source.job_pids()
            channel.declared = self.job_source.declared_gpus()
            channel.owners = {j: t.owner for j, t in self.job_source.jobs.items() if t.ranks}
        owner_uids = [uid for uid in channel.owners.values() if uid is not None]
        now = time.monotonic()
        due = now - self._gpu_pids_at >= self.config.attribution.interval_s
        due = due or not self._ranks_at_read.issuperset(channel.pids)  # a rank attached
        if due or attribution.unnamed(owner_uids):
            if due and self.hardware.nvml is not None:
                found = await self.devices.running_processes()
                if found is not None:  # NVML timed out: the last processes stand
                    self._gpu_pids = found
                self._ranks_at_read = frozenset(channel.pids)
            self._gpu_pids_at = now if due else self._gpu_pids_at
            await attribution.poll(self._gpu_pids, owner_uids)
        out, held = attribution.collect(readings, channel)
        channel_jobs = set(channel.pids.values()) | set(channel.declared.values())
        before = self.held
        found_gpus = {
            job: {int(g) for g in gpus if g.isdigit()}
            for job, gpus in held.items()
            if job in channel_jobs
        }
        self.held = self._held_gpus(found_gpus, channel.owners)
        for listener in self.listeners:
            listener(before, self.held)
        return out

    def _held_gpus(self, found: dict[str, set[int]], live: Iterable[str]) -> dict[str, set[int]]:
        """The GPUs each live job holds here, the scheduler's word over what processes and
        hellos say: a Slurm job holds the GPUs Slurm gave it on this node; a job outside Slurm
        holds none of those, nor any GPU Slurm gave another job here (asked of Slurm while
        such a job holds GPUs; until Slurm answers, it holds none)."""
        held = dict(found)
        slurm_held: set[int] = set()
        for job in live:
            scheduled = self.scheduled.gpus(job)
            if scheduled is not None:
                held[job] = scheduled
                slurm_held |= scheduled
        source = self.job_source
        outside = [
            job
            for job, gpus in held.items()
            if gpus and source is not None and job in source.jobs and not source.jobs[job].slurm_job
        ]
        if outside and not self.scheduled.not_slurm:
            on_node = self.scheduled.held_on_node()
            for job in outside:
                held[job] = set() if on_node is None else held[job] - slurm_held - set(on_node)
        return held

    # -- questions -----------------------------------------------------------------------

    def _live(self) -> list[str]:
        """The jobs with a rank connected."""
        if self.job_source is None:
            return []
        return [j for j, t in self.job_source.jobs.items() if t.ranks]

    def job_gpus(self, job: str, live: list[str] | None = None) -> tuple[set[int], bool]:
        """The GPU indices ``job`` is known to hold here while a rank of it is attached (from
        NVML's processes, its cgroup or the scheduler: none known is none, never "every GPU"),
        and whether they are its own (no other live job is known on any of them). A live job
        on no known GPU (another user's CPU-only rank) shares none."""
        if live is None:
            live = self._live()
        attached = self.job_source is None or self.job_source.attached(job) > 0
        mine = self.held.get(job, set()) if attached else set()
        separable = bool(mine) and not any(self.held.get(j, set()) & mine for j in live if j != job)
        return set(mine), separable

    def may_get_gpus(self, job: str) -> bool:
        """``job`` may yet be known to hold GPUs here: no rank of it is attached yet, or its
        ranks are and attribution has not named its GPUs (a job attached for longer than an
        attribution interval with none known is a job without GPUs here)."""
        if self.job_source is None:
            return False
        totals = self.job_source.jobs.get(job)
        if totals is None or not totals.ranks:
            return True
        waited = self.job_source.clock() - totals.attached_at
        return waited < self.config.attribution.interval_s * 2

    def summary(self) -> dict[str, Any]:
        """Per job on this node: its running totals (for drift) and what the coordinator needs
        to find and tune it (its ranks and what they said, its owner, its GPUs)."""
        jobs: dict[str, Any] = {}
        if self.job_source is None:
            return jobs
        live = self._live()
        for j, t in self.job_source.jobs.items():
            entry: dict[str, Any] = {
                "samples": t.samples,
                "step_s": t.step_s,
                "ranks": t.reporting_ranks,
                **t.describe(),
            }
            knobs = t.knobs()
            if knobs is not None:
                entry["knobs"] = list(knobs)
            user = self.job_source.user_name(t.owner)
            if user is not None:
                entry["user"] = user
            scheduler = self.scheduled.describe(j)
            if scheduler is not None:
                entry["scheduler"] = scheduler
            gpus, separable = self.job_gpus(j, live)
            entry["gpus"] = sorted(gpus)
            entry["gpus_separable"] = separable
            if not gpus and t.ranks and self.may_get_gpus(j):
                entry["gpus_pending"] = True  # ranks just attached: their GPUs come next
            jobs[j] = entry
        return jobs


def _attribution(config: Config, hardware: Hardware) -> Attribution:
    """The job attribution ``config.attribution`` asks for; a replayed capture's ``proc/``
    and ``etc/passwd`` stand for the node's unless ``attribution.proc_root`` is set."""
    settings = config.attribution
    proc_root = settings.proc_root
    users = None
    capture = hardware.capture_dir
    if capture is not None:
        if "proc_root" not in settings.model_fields_set and (capture / "proc").is_dir():
            proc_root = capture / "proc"
        if (capture / "etc" / "passwd").is_file():
            users = passwd_file(capture / "etc" / "passwd")
    ledger = JobLedger(config.sources.job.release_after_s, config.sources.job.max_jobs)
    extra = {} if users is None else {"users": users}
    return Attribution(
        settings.mode,
        ledger,
        proc_root=proc_root,
        mapping_dir=settings.mapping_dir,
        timeout_s=config.sources.timeout_s,
        **extra,
    )

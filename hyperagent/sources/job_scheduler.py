"""What the scheduler says of the jobs on the job socket: for a job whose ranks' cgroup names a
Slurm job, the controller's word on its user, its nodes, its task count and the GPUs it holds
on this node (:class:`~hyperagent.sources.slurm_jobs.SlurmJobs`, asked off the event loop once
per job and cached there). The GPUs the scheduler gave a job are the ones it holds, idle or
not, and the only ones a power cap of its may touch on this node.

A rank outside any Slurm job may declare GPUs, and NVML may show no process on them yet: on a
Slurm node, the GPUs Slurm gave any running job here (``squeue`` for the node's jobs, then each
job's answer) are no such rank's, even before that job's processes start. That answer is asked
only while such a job holds GPUs here, at most every ``NODE_ANSWER_S``; an answer older than
``NODE_ANSWER_MAX_AGE_S``, or one asked before a Slurm job new here attached, is no answer
(Slurm may have given the GPUs away since), so such a rank holds nothing until the next. Where
Slurm cannot list them (no controller configured or reachable), the GPUs such ranks declare
are taken as said, and Slurm is asked again ``NODE_RETRY_S`` later.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from hyperagent.errors import SourceError
from hyperagent.sources.command import CommandUnavailable
from hyperagent.sources.slurm_jobs import SlurmJobInfo, SlurmJobs, run_in_session

log = logging.getLogger(__name__)

NODE_ANSWER_S = 5.0
"""How often the jobs Slurm runs on this node are asked for at most."""

NODE_ANSWER_MAX_AGE_S = 2 * NODE_ANSWER_S
"""How long an answer on the node's Slurm jobs stands."""

NODE_RETRY_S = 60.0
"""How long after Slurm could not list the node's jobs it is asked again (the failed answer,
GPUs taken as said, stands until then)."""

JobListener = Callable[[str], None]


class ScheduledJobs:
    """The scheduler's answer for each Slurm job on the job socket, kept while the job is."""

    def __init__(
        self, slurm: SlurmJobs | None, node: str, squeue: tuple[str, ...] = ("squeue",)
    ) -> None:
        """``slurm``: how to ask the controller (None: never ask); ``node``: this node's name
        in the scheduler; ``squeue``: how to list its jobs."""
        self.slurm, self.node, self.squeue = slurm, node, squeue
        self.not_slurm = slurm is None
        """No Slurm answers here (none configured, or ``squeue`` is not installed)."""
        self._held: dict[int, str] | None = None
        self._held_at = -math.inf
        """When the ask behind ``_held`` (or the one in flight) began."""
        self._answer_until = -math.inf
        """Until when ``_held`` stands."""
        self._holding: asyncio.Task[None] | None = None
        self._answers: dict[str, SlurmJobInfo] = {}
        self._asking: dict[str, asyncio.Task[None]] = {}
        self.listeners: list[JobListener] = []
        """Told of each job whose answer came (after it is kept)."""

    def follow(self, job: str, slurm_job: str) -> None:
        """Ask about ``job`` (Slurm job ``slurm_job``) unless its answer is kept or asked."""
        if self.slurm is None or job in self._answers or job in self._asking:
            return
        if self._held is not None and slurm_job not in self._held.values():
            # a Slurm job new here: the node's jobs are asked again, the last answer stands no more
            self._held_at = self._answer_until = -math.inf
        if not slurm_job.isdigit():
            return  # a SLUID: scontrol takes it, the query's id check does not yet
        task = asyncio.get_running_loop().create_task(self._ask(job, slurm_job))
        self._asking[job] = task

    async def _ask(self, job: str, slurm_job: str) -> None:
        assert self.slurm is not None
        try:
            info = await self.slurm.get(slurm_job)
        finally:
            self._asking.pop(job, None)
        if info is None:
            return  # the query logged why; the job is asked about again at its next rank
        self._answers[job] = info
        for listener in self.listeners:
            listener(job)

    def forget(self, job: str) -> None:
        """``job`` ended here: its answer goes (a query in flight is dropped)."""
        self._answers.pop(job, None)
        task = self._asking.pop(job, None)
        if task is not None:
            task.cancel()

    def info(self, job: str) -> SlurmJobInfo | None:
        return self._answers.get(job)

    def gpus(self, job: str) -> set[int] | None:
        """The GPU indices of this node the scheduler gave ``job`` (None: not known)."""
        info = self._answers.get(job)
        held = None if info is None else info.gpus_on(self.node)
        return None if held is None else set(held)

    def describe(self, job: str) -> dict[str, Any] | None:
        """What the coordinator takes from the scheduler: the job's user, uid and nodes."""
        info = self._answers.get(job)
        if info is None:
            return None
        return {"user": info.user, "uid": info.uid, "nodes": list(info.nodes)}

    def held_on_node(self) -> dict[int, str] | None:
        """GPU index -> the Slurm job id holding it on this node, as Slurm last said (asked
        again when ``NODE_ANSWER_S`` passed; empty when it could not be asked); None while no
        answer stands (none yet, too old, or asked before a Slurm job new here attached)."""
        now = time.monotonic()
        if not self.not_slurm and self._holding is None and now - self._held_at >= NODE_ANSWER_S:
            self._held_at = now
            self._holding = asyncio.get_running_loop().create_task(self._ask_node(now))
        if now >= self._answer_until:
            return None
        return self._held

    async def _ask_node(self, asked_at: float) -> None:
        assert self.slurm is not None
        argv = (*self.squeue, "--noheader", "--nodelist", self.node, "--format", "%i")
        argv += ("--states", "CONFIGURING,RUNNING,COMPLETING")
        try:
            out = await run_in_session(argv, self.slurm.timeout_s)
            held: dict[int, str] = {}
            for job_id in out.split():
                info = await self.slurm.get(job_id)
                if info is not None:
                    for gpu in info.gpus_on(self.node) or ():
                        held[gpu] = info.job_id
            self._held, self._answer_until = held, asked_at + NODE_ANSWER_MAX_AGE_S
        except CommandUnavailable as e:
            self.not_slurm = True
            log.info("no Slurm on this node (%s): GPUs ranks declare are taken as said", e)
        except (SourceError, ValueError) as e:
            # no controller to ask (none configured here, or down): GPUs are taken as said
            if self._held is None or self._held:
                log.warning(
                    "cannot list Slurm's jobs on %s (%s): GPUs that ranks outside Slurm "
                    "declare are taken as said until Slurm answers",
                    self.node,
                    e,
                )
            self._held = {}
            self._held_at = asked_at + NODE_RETRY_S - NODE_ANSWER_S  # asked again in a minute
            self._answer_until = asked_at + NODE_RETRY_S + NODE_ANSWER_MAX_AGE_S
        finally:
            self._holding = None

    async def close(self) -> None:
        tasks = list(self._asking.values())
        if self._holding is not None:
            tasks.append(self._holding)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._asking.clear()

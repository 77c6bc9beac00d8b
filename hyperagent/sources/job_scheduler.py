"""What the scheduler says of the jobs on the job socket: for a job whose ranks' cgroup names a
Slurm job, the controller's word on its user, its nodes, its task count and the GPUs it holds
on this node (:class:`~hyperagent.sources.slurm_jobs.SlurmJobs`, asked off the event loop once
per job and cached there). The GPUs the scheduler gave a job are the ones it holds, idle or
not, and the only ones a power cap of its may touch on this node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from hyperagent.sources.slurm_jobs import SlurmJobInfo, SlurmJobs

log = logging.getLogger(__name__)

JobListener = Callable[[str], None]


class ScheduledJobs:
    """The scheduler's answer for each Slurm job on the job socket, kept while the job is."""

    def __init__(self, slurm: SlurmJobs | None, node: str) -> None:
        """``slurm``: how to ask the controller (None: never ask); ``node``: this node's name
        in the scheduler."""
        self.slurm, self.node = slurm, node
        self._answers: dict[str, SlurmJobInfo] = {}
        self._asking: dict[str, asyncio.Task[None]] = {}
        self.listeners: list[JobListener] = []
        """Told of each job whose answer came (after it is kept)."""

    def follow(self, job: str, slurm_job: str) -> None:
        """Ask about ``job`` (Slurm job ``slurm_job``) unless its answer is kept or asked."""
        if self.slurm is None or job in self._answers or job in self._asking:
            return
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

    async def close(self) -> None:
        tasks = list(self._asking.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._asking.clear()

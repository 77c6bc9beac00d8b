"""Who a rank on the job socket is: its uid and pid from the kernel (SO_PEERCRED), its job from
its cgroup, never from what it says of itself where the kernel says otherwise.

- A rank in a Slurm job step's cgroup (:mod:`hyperagent.sources.slurm_cgroup`) is that step's
  job, ``slurm-<id>-<step>``, whatever id its hello gives: ``SLURM_JOB_ID`` and
  ``HYPERAGENT_JOB_ID`` are the rank's environment, which its user sets at will.
- A rank outside any scheduler job (torchrun on a bare host, a script) is bound to its uid:
  its job is ``u<uid>-<id>`` to the agent, the coordinator and Prometheus, so that two users
  who pick the same id run two jobs, and no user can report, veto, or receive settings under
  another's. The agent's own user (the operator's) keeps the ids it gives.

The rank itself keeps the id it said: the agent answers it under that id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from hyperagent.scheduler import qualified
from hyperagent.sources.slurm_cgroup import CgroupFormatError, CgroupJob, parse_cgroup

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """What the kernel says of one connected rank, and the job id that follows from it."""

    job: str
    """The job id the cluster knows the rank's job by."""
    said: str
    """The job id the rank gave in its hello (the agent answers it under this id)."""
    uid: int
    pid: int
    cgroup: CgroupJob | None = None
    """The Slurm job step the rank's cgroup names (None: outside any Slurm job)."""

    @property
    def contradicted(self) -> bool:
        """The rank said another job than its cgroup names."""
        return self.cgroup is not None and self.said != self.job


def read_cgroup(proc_root: Path, pid: int) -> CgroupJob | None:
    """The Slurm job step ``/proc/<pid>/cgroup`` names; None outside Slurm, for a process
    gone, or a cgroup file that cannot be read or parsed (logged)."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(errors="replace")
    except OSError:
        return None
    try:
        return parse_cgroup(text)
    except CgroupFormatError as e:
        log.warning("job channel: pid %d: %s; taking it as outside Slurm", pid, e)
        return None


def identify(said: str, pid: int, uid: int, trusted_uid: int, proc_root: Path) -> RankIdentity:
    """The identity of the rank ``pid`` of ``uid`` that says it is job ``said``: the job its
    cgroup names, else ``said`` bound to ``uid`` (``said`` itself for ``trusted_uid``)."""
    cgroup = read_cgroup(proc_root, pid)
    if cgroup is not None:
        job = cgroup.job.id
    elif uid == trusted_uid:
        job = said
    else:
        job = qualified(said, uid)
    return RankIdentity(job, said, uid, pid, cgroup)

"""Which Slurm job a process belongs to, from ``/proc/<pid>/cgroup``, its owner from
``/proc/<pid>/status`` and the GPUs its job was given from ``/proc/<pid>/environ``.

Slurm puts every process of a job step in the step's cgroup (cgroup.conf, ``cgroup/v2`` and
``cgroup/v1`` plugins):

- cgroup v2: ``0::/system.slice/slurmstepd.scope/job_<id>/step_<step>/user/task_<n>`` (the
  scope is ``<nodename>_slurmstepd.scope`` when several slurmd run on one host);
- cgroup v1: one line per controller,
  ``<n>:<controller>:/slurm/uid_<uid>/job_<id>/step_<step>/task_<n>`` (``slurm_<nodename>``
  for several slurmd).

``<step>`` is a number, ``batch``, ``extern`` or ``interactive``. The GPUs come from
``SLURM_STEP_GPUS`` or ``SLURM_JOB_GPUS`` (the node's GPU indices), else
``CUDA_VISIBLE_DEVICES`` (indices, or ``GPU-<uuid>``); an agent that may not read another
user's environment (it is not root) learns the GPUs from NVML's processes alone.

Parsing is pure (``parse_*``); :func:`read_process` does the blocking file reads under a
configurable proc root, so a replay reads a fixture tree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hyperagent.scheduler import SchedulerJob, slurm_allocation, slurm_job

_LINE = re.compile(r"^(\d+):([^:]*):(/.*)$")
_V2 = re.compile(r"(?:^|/)(?:[^/]+_)?slurmstepd\.scope/job_([^/]+)(?:/step_([^/]+))?(?:/|$)")
_V1 = re.compile(r"(?:^|/)slurm(?:_[^/]+)?/uid_([^/]+)/job_([^/]+)(?:/step_([^/]+))?(?:/|$)")
_STEP = re.compile(r"^[A-Za-z0-9_]+$")
_GPU_VARIABLES = (b"SLURM_STEP_GPUS", b"SLURM_JOB_GPUS", b"CUDA_VISIBLE_DEVICES")


class CgroupFormatError(ValueError):
    """A ``/proc/<pid>/cgroup`` that is not what the kernel writes, or a Slurm cgroup path
    whose job or step is not one Slurm makes."""


@dataclass(frozen=True)
class CgroupJob:
    """The Slurm job step a process's cgroup names."""

    job: SchedulerJob
    """``slurm-<id>-<step>``, as :func:`hyperagent.scheduler.slurm_job` names it."""
    uid: int | None = None
    """The owner, where the path says it (cgroup v1's ``uid_<uid>``)."""


@dataclass(frozen=True)
class ProcessJob:
    """What the proc tree says of one process."""

    pid: int
    job: CgroupJob | None
    """None: the process is in no Slurm job's cgroup."""
    uid: int | None
    """Real uid from ``status``, else the cgroup v1 path's."""
    gpus: tuple[str, ...] | None
    """GPUs its environment names (indices or uuids); None: not readable or not set."""


def parse_cgroup(text: str) -> CgroupJob | None:
    """The Slurm job step of a ``/proc/<pid>/cgroup``'s lines, None for a process outside
    Slurm; raises CgroupFormatError naming the line that is malformed."""
    found: CgroupJob | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise CgroupFormatError(
                f"line {number} {line[:120]!r} is not hierarchy-ID:controllers:path"
            )
        path = match.group(3)
        v2 = _V2.search(path)
        if v2 is not None:
            job = _step(v2.group(1), v2.group(2), number)
            return CgroupJob(job)
        v1 = _V1.search(path)
        if v1 is not None and found is None:
            uid_text = v1.group(1)
            if not uid_text.isdigit():
                raise CgroupFormatError(f"line {number}: uid_{uid_text} is not a uid")
            found = CgroupJob(_step(v1.group(2), v1.group(3), number), int(uid_text))
    return found


def _step(job: str, step: str | None, number: int) -> SchedulerJob:
    if not job.isdigit():
        raise CgroupFormatError(f"line {number}: job_{job} is not a Slurm job id")
    if step is None:
        return slurm_allocation(job)
    if not _STEP.match(step):
        raise CgroupFormatError(f"line {number}: step_{step} is not a Slurm step")
    return slurm_job(job, step)


def parse_status_uid(text: str) -> int | None:
    """The real uid of a ``/proc/<pid>/status`` (its ``Uid:`` line), None without one."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            if len(fields) > 1 and fields[1].isdigit():
                return int(fields[1])
            return None
    return None


def parse_environ_gpus(data: bytes) -> tuple[str, ...] | None:
    """The GPUs a ``/proc/<pid>/environ`` gives the process: ``SLURM_STEP_GPUS``, else
    ``SLURM_JOB_GPUS``, else ``CUDA_VISIBLE_DEVICES`` (comma-separated indices or uuids);
    None when none is set."""
    variables: dict[bytes, bytes] = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key in _GPU_VARIABLES:
            variables[key] = value
    for key in _GPU_VARIABLES:
        found = variables.get(key)
        if found is not None:
            text = found.decode("ascii", "replace")
            return tuple(t.strip() for t in text.split(",") if t.strip())
    return None


def read_process(proc_root: Path, pid: int) -> ProcessJob | None:
    """What ``proc_root/<pid>`` says of ``pid`` (blocking: run it in a thread); None when the
    process is gone or its cgroup is not readable. Raises CgroupFormatError for a malformed
    cgroup file."""
    folder = proc_root / str(pid)
    try:
        cgroup = (folder / "cgroup").read_text(errors="replace")
    except OSError:
        return None
    job = parse_cgroup(cgroup)
    try:
        uid = parse_status_uid((folder / "status").read_text(errors="replace"))
    except OSError:
        uid = None
    if uid is None and job is not None:
        uid = job.uid
    try:
        gpus = parse_environ_gpus((folder / "environ").read_bytes())
    except OSError:
        gpus = None
    return ProcessJob(pid, job, uid, gpus)

"""Which Slurm job a process belongs to, from ``/proc/<pid>/cgroup``, its owner from
``/proc/<pid>/status`` and the GPUs its job was given from ``/proc/<pid>/environ``.

Slurm puts every process of a job step in the step's cgroup (cgroup.conf, ``cgroup/v2`` and
``cgroup/v1`` plugins):

- cgroup v2 before Slurm 26.05, or with ``CgroupJobIdPaths=yes``:
  ``0::/system.slice/slurmstepd.scope/job_<id>/step_<step>/user/task_<n>`` (slurmstepd itself
  in ``step_<step>/slurm``; the scope's ``system`` holds slurmstepd's ``infinity`` process);
- cgroup v2 from Slurm 26.05 on (the default): the job's directory is its SLUID, not
  ``job_<id>``: ``0::/system.slice/slurmstepd.scope/s5K1KKYAYG5D00/step_0/user/task_0``
  (cgroup_v2.html, cgroup.conf(5) ``CgroupJobIdPaths``). A SLUID is ``s`` and 13 digits of
  Crockford's base32 (``src/common/sluid.h``: 12 bits of cluster, 42 of milliseconds, 10 of
  sequence): it holds no job id, so such a job is ``slurm-<SLUID>-<step>`` with the SLUID as
  its Slurm job (every Slurm command takes it where a job id goes: ``scontrol show job
  <SLUID>`` prints its ``JobId``, ``squeue --json`` has ``sluid`` beside ``job_id``), unless
  the caller passes what the scheduler said (``sluids``: SLUID -> job id). The environment's
  ``SLURM_JOB_SLUID`` and ``SLURM_JOB_ID`` are not used to map one to the other: the process's
  user sets them at will;
- the scope is ``<nodename>_slurmstepd.scope`` when Slurm is built with
  ``--enable-multiple-slurmd`` (where a slurmd started by hand sits in its ``slurmd``), and
  ``CgroupSlice`` moves it out of ``system.slice``;
- cgroup v1: one line per controller,
  ``<n>:<controller>:/slurm/uid_<uid>/job_<id>/step_<step>/task_<n>`` (``slurm_<nodename>``
  for several slurmd). Some controllers' lines may stop at the job
  (``/slurm/uid_1001/job_518``): the most specific line names the step, and lines naming two
  jobs, two steps or two owners are refused.

``<step>`` is a number, ``batch``, ``extern`` or ``interactive``. A Slurm-like path under a
``user@<uid>.service`` is refused: systemd delegates that subtree to its user, who can create
any directory there, so it says nothing of Slurm.

The GPUs come from ``SLURM_STEP_GPUS`` or ``SLURM_JOB_GPUS`` (the node's GPU indices) and
``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-<uuid>``). Under ``ConstrainDevices`` a job sees
only its GPUs, renumbered from 0, so an index in ``CUDA_VISIBLE_DEVICES`` is a position among
the job's GPUs, not a node index (:func:`visible_gpus`). An agent that may not read another
user's environment (it is not root) learns the GPUs from NVML's processes alone.

Parsing is pure (``parse_*``); :func:`read_process` does the blocking file reads under a
configurable proc root, so a replay reads a fixture tree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hyperagent.scheduler import MAX_ID, SchedulerJob, slurm_allocation, slurm_job, slurm_step

_LINE = re.compile(r"^(\d+):([^:]*):(/.*)$")
_V2 = re.compile(r"(?:^|/)(?:[^/]+_)?slurmstepd\.scope/([^/]+)(?:/step_([^/]+))?(?:/|$)")
_V1 = re.compile(r"(?:^|/)slurm(?:_[^/]+)?/uid_([^/]+)/job_([^/]+)(?:/step_([^/]+))?(?:/|$)")
_SLUID = re.compile(r"^s[0-9A-HJKMNP-TV-Z]{13}$")
"""Slurm's printed SLUID: ``s`` and 13 digits of Crockford's base32 (``print_sluid``)."""
_STEPD_OWN = frozenset({"system", "slurmd"})
"""What the slurmstepd scope holds besides jobs: slurmstepd's waiting area and, with several
slurmd started by hand, slurmd itself."""
_DELEGATED = re.compile(r"/user@\d+\.service(?:/|$)")
_STEP = re.compile(r"^[A-Za-z0-9_]+$")
_STEP_GPUS, _JOB_GPUS, _VISIBLE = b"SLURM_STEP_GPUS", b"SLURM_JOB_GPUS", b"CUDA_VISIBLE_DEVICES"
_GPU_VARIABLES = (_STEP_GPUS, _JOB_GPUS, _VISIBLE)


class CgroupFormatError(ValueError):
    """A ``/proc/<pid>/cgroup`` that is not what the kernel writes, a Slurm cgroup path whose
    job or step is not one Slurm makes, or lines that name two Slurm jobs."""


@dataclass(frozen=True)
class CgroupJob:
    """The Slurm job step a process's cgroup names."""

    job: SchedulerJob
    """``slurm-<id>-<step>``, as :func:`hyperagent.scheduler.slurm_job` names it;
    ``slurm-<SLUID>-<step>`` (its ``scheduler_id`` the SLUID) for a Slurm 26.05 path whose
    SLUID the caller could not map to a job id."""
    uid: int | None = None
    """The owner, where the path says it (cgroup v1's ``uid_<uid>``)."""
    sluid: str = ""
    """The job's SLUID where the path names the job by it (Slurm 26.05's cgroup v2)."""


@dataclass(frozen=True)
class ProcessJob:
    """What the proc tree says of one process."""

    pid: int
    job: CgroupJob | None
    """None: the process is in no Slurm job's cgroup."""
    uid: int | None
    """Real uid from ``status``, else the cgroup v1 path's."""
    gpus: tuple[str, ...] | None
    """GPUs its environment names (:func:`parse_environ_gpus`: indices or uuids); None: not
    readable or not set."""
    slurm_gpus: tuple[str, ...] | None = None
    """``SLURM_STEP_GPUS``, else ``SLURM_JOB_GPUS``: the node's GPU indices Slurm gave the
    step or job; None where unset or not readable."""
    visible_gpus: tuple[str, ...] | None = None
    """``CUDA_VISIBLE_DEVICES`` as set (indices relative to the job's GPUs under
    ``ConstrainDevices``, or uuids); None where unset or not readable."""


@dataclass(frozen=True)
class _Named:
    """What one line of a ``/proc/<pid>/cgroup`` says of the Slurm job."""

    line: int
    job: str
    """``job_<id>``'s id, or the SLUID."""
    step: str | None
    uid: int | None


def parse_cgroup(text: str, sluids: Mapping[str, str] | None = None) -> CgroupJob | None:
    """The Slurm job step of a ``/proc/<pid>/cgroup``'s lines, None for a process outside
    Slurm; raises CgroupFormatError naming the line that is malformed, or the lines that name
    two jobs, two steps or two owners. ``sluids`` maps a SLUID to its job id where the
    scheduler said it (a job named by a SLUID not in it is ``slurm-<SLUID>-<step>``)."""
    named: list[_Named] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise CgroupFormatError(
                f"line {number} {line[:120]!r} is not hierarchy-ID:controllers:path"
            )
        found = _named(number, match.group(3))
        if found is not None:
            named.append(found)
    if not named:
        return None
    return _one_job(named, sluids or {})


def _named(number: int, path: str) -> _Named | None:
    v2 = _V2.search(path)
    if v2 is not None:
        directory, step = v2.group(1), v2.group(2)
        if directory in _STEPD_OWN:
            return None
        _attested(number, path, v2.start())
        if directory.startswith("job_"):
            job = directory.removeprefix("job_")
            if not job.isdigit():
                raise CgroupFormatError(f"line {number}: job_{job} is not a Slurm job id")
        elif _SLUID.match(directory):
            job = directory
        else:
            raise CgroupFormatError(
                f"line {number}: {directory!r} under the slurmstepd scope is neither job_<id>"
                " nor a SLUID"
            )
        return _Named(number, job, _checked_step(step, number), None)
    v1 = _V1.search(path)
    if v1 is None:
        return None
    _attested(number, path, v1.start())
    uid_text, job = v1.group(1), v1.group(2)
    if not uid_text.isdigit():
        raise CgroupFormatError(f"line {number}: uid_{uid_text} is not a uid")
    if not job.isdigit():
        raise CgroupFormatError(f"line {number}: job_{job} is not a Slurm job id")
    return _Named(number, job, _checked_step(v1.group(3), number), int(uid_text))


def _attested(number: int, path: str, at: int) -> None:
    """Refuse a Slurm-like path inside a subtree its user may write (systemd's per-user
    manager is delegated to the user: rootless containers, user services)."""
    delegated = _DELEGATED.search(path, 0, at + 1)
    if delegated is not None:
        where = delegated.group(0).strip("/")
        raise CgroupFormatError(
            f"line {number}: a Slurm-like path under {where}, which its user may create:"
            " not Slurm's"
        )


def _checked_step(step: str | None, number: int) -> str | None:
    if step is not None and not _STEP.match(step):
        raise CgroupFormatError(f"line {number}: step_{step} is not a Slurm step")
    return step


def _one_job(named: list[_Named], sluids: Mapping[str, str]) -> CgroupJob:
    """The one job step the lines name: the step where any line goes down to it (another
    controller's line may stop at the job)."""
    first = named[0]
    for other in named[1:]:
        if other.job != first.job:
            raise CgroupFormatError(
                f"lines {first.line} and {other.line} name two Slurm jobs,"
                f" {first.job} and {other.job}"
            )
    steps = [n for n in named if n.step is not None]
    for other in steps[1:]:
        if other.step != steps[0].step:
            raise CgroupFormatError(
                f"lines {steps[0].line} and {other.line} name two steps of job {first.job},"
                f" {steps[0].step} and {other.step}"
            )
    uids = [n for n in named if n.uid is not None]
    for other in uids[1:]:
        if other.uid != uids[0].uid:
            raise CgroupFormatError(
                f"lines {uids[0].line} and {other.line} name two owners of job {first.job},"
                f" uid {uids[0].uid} and uid {other.uid}"
            )
    step = steps[0].step if steps else None
    uid = uids[0].uid if uids else None
    if not _SLUID.match(first.job):
        return CgroupJob(_scheduler_job(first.job, step), uid)
    mapped = sluids.get(first.job)
    if mapped is not None and mapped.isdigit():
        return CgroupJob(_scheduler_job(mapped, step), uid, first.job)
    return CgroupJob(_sluid_job(first.job, step), uid, first.job)


def _scheduler_job(job: str, step: str | None) -> SchedulerJob:
    return slurm_allocation(job) if step is None else slurm_job(job, step)


def _sluid_job(sluid: str, step: str | None) -> SchedulerJob:
    """A job Slurm names by its SLUID alone: ``slurm-<SLUID>[-<step>]``."""
    if step is None:
        return SchedulerJob(f"slurm-{sluid}"[:MAX_ID], "slurm", sluid, "")
    name = slurm_step(step)
    return SchedulerJob(f"slurm-{sluid}-{name}"[:MAX_ID], "slurm", sluid, name)


def parse_status_uid(text: str) -> int | None:
    """The real uid of a ``/proc/<pid>/status`` (its ``Uid:`` line), None without one."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            if len(fields) > 1 and fields[1].isdigit():
                return int(fields[1])
            return None
    return None


def _environ_variables(data: bytes) -> dict[bytes, tuple[str, ...]]:
    variables: dict[bytes, tuple[str, ...]] = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key in _GPU_VARIABLES:
            text = value.decode("ascii", "replace")
            variables[key] = tuple(t.strip() for t in text.split(",") if t.strip())
    return variables


def parse_environ_gpus(data: bytes) -> tuple[str, ...] | None:
    """The GPUs a ``/proc/<pid>/environ`` names: ``SLURM_STEP_GPUS``, else
    ``SLURM_JOB_GPUS``, else ``CUDA_VISIBLE_DEVICES`` (comma-separated indices or uuids, as
    written: see :func:`visible_gpus` for what an index there means); None when none is
    set."""
    variables = _environ_variables(data)
    for key in _GPU_VARIABLES:
        found = variables.get(key)
        if found is not None:
            return found
    return None


def parse_environ_slurm_gpus(data: bytes) -> tuple[str, ...] | None:
    """``SLURM_STEP_GPUS``, else ``SLURM_JOB_GPUS``, of a ``/proc/<pid>/environ``: node GPU
    indices; None when neither is set."""
    variables = _environ_variables(data)
    found = variables.get(_STEP_GPUS)
    return found if found is not None else variables.get(_JOB_GPUS)


def parse_environ_visible(data: bytes) -> tuple[str, ...] | None:
    """``CUDA_VISIBLE_DEVICES`` of a ``/proc/<pid>/environ`` as written; None when unset."""
    return _environ_variables(data).get(_VISIBLE)


def visible_gpus(
    visible: Sequence[str] | None, allotted: Sequence[str], uuids: Mapping[str, str]
) -> list[str]:
    """The node GPU indices a ``CUDA_VISIBLE_DEVICES`` names, for a process of a job that was
    given ``allotted`` (node indices in order: its ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``, else
    the GPUs NVML shows its processes on). Under ``ConstrainDevices`` the job sees its GPUs
    alone, renumbered from 0, so index ``k`` is ``allotted[k]``; an index past them cannot be
    mapped and is left out, as is a uuid the node has not (``uuids``: uuid -> index)."""
    out: list[str] = []
    for token in visible or ():
        if token.isdigit():
            k = int(token)
            if k < len(allotted):
                out.append(allotted[k])
        elif token in uuids:
            out.append(uuids[token])
    return out


def read_process(
    proc_root: Path, pid: int, sluids: Mapping[str, str] | None = None
) -> ProcessJob | None:
    """What ``proc_root/<pid>`` says of ``pid`` (blocking: run it in a thread); None when the
    process is gone or its cgroup is not readable. Raises CgroupFormatError for a malformed
    cgroup file. ``sluids``: as :func:`parse_cgroup` takes it."""
    folder = proc_root / str(pid)
    try:
        cgroup = (folder / "cgroup").read_text(errors="replace")
    except OSError:
        return None
    job = parse_cgroup(cgroup, sluids)
    try:
        uid = parse_status_uid((folder / "status").read_text(errors="replace"))
    except OSError:
        uid = None
    if uid is None and job is not None:
        uid = job.uid
    try:
        environ = (folder / "environ").read_bytes()
    except OSError:
        return ProcessJob(pid, job, uid, None)
    return ProcessJob(
        pid,
        job,
        uid,
        parse_environ_gpus(environ),
        parse_environ_slurm_gpus(environ),
        parse_environ_visible(environ),
    )

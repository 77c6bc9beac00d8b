"""Job identity from the scheduler: the id a job's ranks report under when none is given, and
the id the agent attributes a GPU process to from its Slurm cgroup.

One id per scheduler job step, the same wherever it is derived (a rank's environment, a
process's cgroup path, a dcgm-exporter job-mapping file), so that a job that reports through
``JobReporter`` and the same job seen from its cgroups are one job:

- Slurm: ``slurm-<SLURM_JOB_ID>-<step>`` (``slurm-4242-0``; the batch script's own step is
  ``batch``, as in the cgroup path ``job_4242/step_batch``);
- torchrun: ``torchrun-<TORCHELASTIC_RUN_ID>`` (the rendezvous id; torchrun's default
  ``none`` is no id).

A rank outside any scheduler job is bound to its uid by the agent: its job is
``u<uid>-<id>`` (:func:`qualified`; :mod:`hyperagent.sources.job_identity`).

Ids use only ``[A-Za-z0-9_-]``: no ``/``, ``+``, ``#`` (MQTT) and no ``.`` (a level separator
on RabbitMQ), at most 64 characters. Which wins when several are there: an explicit job id,
then ``HYPERAGENT_JOB_ID``, then Slurm, then torchrun.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

MAX_ID = 64
_DIGEST = 8
"""Hex digits of the said id's hash that end a qualified id cut to ``MAX_ID``."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_SLURM_JOB = re.compile(r"^[0-9]+$")
_SLURM_ID = re.compile(r"^slurm-([0-9]+)(?:-([A-Za-z0-9_]+))?$")
_SLURM_STEP_NAMES = {
    # SLURM_STEP_ID's special values, slurm.h since 20.11: SLURM_INTERACTIVE_STEP 0xfffffffa,
    # SLURM_BATCH_SCRIPT 0xfffffffb, SLURM_EXTERN_CONT 0xfffffffc; before: 0xfffffffe, 0xffffffff
    "4294967290": "interactive",
    "4294967291": "batch",
    "4294967292": "extern",
    "4294967294": "batch",
    "4294967295": "extern",
}
NO_ID = (
    "no job id: pass one (JobReporter(job=...), TunedDDP(job=...)), set HYPERAGENT_JOB_ID, "
    "or run under Slurm (SLURM_JOB_ID) or torchrun with --rdzv-id (TORCHELASTIC_RUN_ID)"
)


class NoJobId(ValueError):
    """Neither an explicit id nor a scheduler's environment names the job."""


@dataclass(frozen=True)
class SchedulerJob:
    """A job as its scheduler names it: the hyperagent job id, and the scheduler's own."""

    id: str
    scheduler: str
    """``slurm``, ``torchrun`` or ``given``."""
    scheduler_id: str = ""
    """The scheduler's job id (Slurm's ``SLURM_JOB_ID``, torchrun's run id)."""
    step: str = ""
    """The Slurm step (``0``, ``batch``, ``extern``), else empty."""


def safe_id(text: str) -> str:
    """``text`` with every run of characters outside ``[A-Za-z0-9_-]`` replaced by ``-``,
    cut to 64 characters."""
    return _UNSAFE.sub("-", text).strip("-")[:MAX_ID]


def slurm_step(step: str | None) -> str:
    """A Slurm step as the cgroup path names it: ``0``, ``batch``, ``extern``; a batch script
    run outside ``srun`` has no ``SLURM_STEP_ID``, so None is ``batch``."""
    if step is None or step == "":
        return "batch"
    step = step.removeprefix("step_")
    return _SLURM_STEP_NAMES.get(step, step)


def slurm_job(job_id: str, step: str | None) -> SchedulerJob:
    """The job of Slurm job ``job_id``'s ``step``; raises NoJobId for a malformed id."""
    if not _SLURM_JOB.match(job_id):
        raise NoJobId(f"SLURM_JOB_ID {job_id!r} is not a Slurm job id")
    name = slurm_step(step)
    if _UNSAFE.search(name):
        raise NoJobId(f"Slurm step {step!r} is not a step id")
    return SchedulerJob(f"slurm-{job_id}-{name}"[:MAX_ID], "slurm", job_id, name)


def slurm_allocation(job_id: str) -> SchedulerJob:
    """Slurm job ``job_id`` as a whole, no step (``slurm-<id>``: what a job-mapping file or a
    cgroup above the steps names); raises NoJobId for a malformed id."""
    if not _SLURM_JOB.match(job_id):
        raise NoJobId(f"{job_id!r} is not a Slurm job id")
    return SchedulerJob(f"slurm-{job_id}"[:MAX_ID], "slurm", job_id, "")


def slurm_parts(job_id: str) -> tuple[str, str]:
    """(Slurm job, step) of an id made by :func:`slurm_job` or :func:`slurm_allocation`
    (``slurm-<job>[-<step>]``); empty for any other id."""
    match = _SLURM_ID.match(job_id)
    if match is None:
        return "", ""
    return match.group(1), match.group(2) or ""


def from_environment(environ: Mapping[str, str], given: str | None = None) -> SchedulerJob:
    """The job a rank belongs to: ``given``, else ``HYPERAGENT_JOB_ID``, else Slurm's, else
    torchrun's; raises NoJobId saying what to pass."""
    if given:
        return SchedulerJob(given, "given")
    explicit = environ.get("HYPERAGENT_JOB_ID")
    if explicit:
        return SchedulerJob(explicit, "given")
    slurm = environ.get("SLURM_JOB_ID")
    if slurm:
        return slurm_job(slurm, environ.get("SLURM_STEP_ID"))
    run = environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        name = safe_id(run)
        if name:
            return SchedulerJob(f"torchrun-{name}"[:MAX_ID], "torchrun", run)
    raise NoJobId(NO_ID)


def world_size(environ: Mapping[str, str]) -> tuple[int | None, int | None]:
    """``(WORLD_SIZE, LOCAL_WORLD_SIZE)`` as torchrun sets them, else Slurm's task counts
    (``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE`` when it is one number); None where unset."""

    def number(*keys: str) -> int | None:
        for key in keys:
            value = environ.get(key, "")
            if value.isdigit() and int(value) > 0:
                return int(value)
        return None

    return (
        number("WORLD_SIZE", "SLURM_NTASKS"),
        number("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"),
    )


def qualified(job: str, uid: int) -> str:
    """``job`` bound to ``uid``: ``u<uid>-<job>``, at most ``MAX_ID`` characters (a longer
    one keeps its start and ends with a hash of the whole id, so two ids never meet)."""
    name = f"u{uid}-{job}"
    if len(name) <= MAX_ID:
        return name
    digest = hashlib.sha256(job.encode()).hexdigest()[:_DIGEST]
    return f"{name[: MAX_ID - _DIGEST - 1]}-{digest}"


def owner_of(job: str) -> int | None:
    """The uid a job id made by :func:`qualified` is bound to; None for any other id."""
    if not job.startswith("u"):
        return None
    uid, sep, _ = job[1:].partition("-")
    return int(uid) if sep and uid.isdigit() else None

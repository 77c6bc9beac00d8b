"""The job-mapping directory dcgm-exporter reads with ``--hpc-job-mapping-dir``: the
scheduler's prolog writes one file per GPU, named by the GPU's index (``3``) or by a MIG
instance's ``<GPU>.<instance>`` (``3.1``), holding the ids of the jobs on it, one per line;
its epilog empties or removes the file.

:func:`parse_mapping_file` is pure; :func:`read_mapping_dir` does the blocking reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hyperagent.scheduler import MAX_ID, SchedulerJob, safe_id, slurm_allocation

_GPU_FILE = re.compile(r"^(\d+)(?:\.(\d+))?$")
_JOB_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")
MAX_FILES = 1024
"""Files read from the directory at most (a node has no more GPUs and MIG instances)."""


class MappingFormatError(ValueError):
    """A mapping file whose name is no GPU index, or a line that is no job id."""


@dataclass(frozen=True)
class MappingRead:
    """One read of the directory: GPU index -> the jobs on it (a MIG instance's jobs count
    on its GPU), and what could not be read, one line per problem."""

    gpus: dict[str, tuple[SchedulerJob, ...]]
    problems: tuple[str, ...] = ()


def mapped_job(text: str) -> SchedulerJob:
    """The job a mapping line names: a Slurm job id (digits) is ``slurm-<id>``, any other
    id itself (made safe); raises MappingFormatError for one with other characters."""
    if not _JOB_ID.match(text) or len(text) > MAX_ID:
        raise MappingFormatError(f"{text[:80]!r} is not a job id")
    if text.isdigit():
        return slurm_allocation(text)
    return SchedulerJob(safe_id(text), "given")


def parse_mapping_file(name: str, text: str) -> tuple[str, tuple[SchedulerJob, ...]]:
    """(GPU index, its jobs) of the mapping file ``name`` holding ``text``; raises
    MappingFormatError naming the file and the line."""
    match = _GPU_FILE.match(name)
    if match is None:
        raise MappingFormatError(f"{name}: not a GPU index or GPU.MIG index")
    jobs: list[SchedulerJob] = []
    for number, line in enumerate(text.splitlines(), 1):
        value = line.strip()
        if not value:
            continue
        try:
            job = mapped_job(value)
        except MappingFormatError as e:
            raise MappingFormatError(f"{name} line {number}: {e}") from None
        if job not in jobs:
            jobs.append(job)
    return match.group(1), tuple(jobs)


def read_mapping_dir(directory: Path) -> MappingRead:
    """Every GPU's jobs in ``directory`` (blocking: run it in a thread). A missing directory
    is no job anywhere; a malformed or unreadable file is a problem and maps nothing."""
    gpus: dict[str, list[SchedulerJob]] = {}
    problems: list[str] = []
    try:
        entries = sorted(p for p in directory.iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        return MappingRead({})
    except OSError as e:
        return MappingRead({}, (f"{directory}: {e.strerror or e}",))
    for path in entries[:MAX_FILES]:
        try:
            if not path.is_file():
                continue
            gpu, jobs = parse_mapping_file(path.name, path.read_text(errors="replace"))
        except MappingFormatError as e:
            problems.append(f"{directory}/{e}")
            continue
        except OSError as e:
            problems.append(f"{path}: {e.strerror or e}")
            continue
        held = gpus.setdefault(gpu, [])
        held += [j for j in jobs if j not in held]
    return MappingRead({g: tuple(j) for g, j in gpus.items()}, tuple(problems))

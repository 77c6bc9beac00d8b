"""GPUs, power and energy per job, for every job on the node's GPUs: the ranks that report
through the job channel, and the batch jobs that never do, found from the scheduler.

Who holds a GPU comes from, together:

- the job channel: a connected rank's pid among the GPU's NVML processes, or the GPU it
  declared in its hello;
- ``[attribution] mode = "cgroup"``: the Slurm cgroup of each process NVML shows on the GPU
  (:mod:`hyperagent.sources.slurm_cgroup`), with its owner and the GPUs its job was given;
- ``mode = "mapping"``: a dcgm-exporter job-mapping directory
  (:mod:`hyperagent.sources.job_mapping`).

A job that reports through the channel and is also found from its cgroup or a mapping file
is one job: a rank's own job id wins for its pid, and a mapping's Slurm job id is the
channel job of that Slurm job on the same GPU.

What a process's environment or a rank's hello says is user input, and names no GPU that
NVML puts with another job: NVML's processes win.

- ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS`` of a job's process give the job those GPUs only
  where NVML shows no other job's process (logged once per job and GPUs otherwise);
- ``CUDA_VISIBLE_DEVICES`` is read relative to the job's GPUs (Slurm's ``ConstrainDevices``
  renumbers them from 0: :func:`~hyperagent.sources.slurm_cgroup.visible_gpus`), under the
  same rule; an index that cannot be mapped names nothing;
- the GPU a rank declared in its hello counts for its job only where NVML agrees: no process
  of another job (by the job channel, its Slurm cgroup, or a mapping file for another Slurm
  job) nor of another user is on it. A GPU NVML shows no process on counts (NVML cannot tell,
  which is what the hello's GPU is for); one NVML shows another job on neither counts nor
  makes the two jobs' GPUs overlap.

A Slurm 26.05 node names job cgroups by SLUID (``CgroupJobIdPaths=no``, the default): such a
job is ``slurm-<SLUID>-<step>``, its ``slurm_job`` label the SLUID, and the agent says so once
in its log.

:class:`JobLedger` is the lifecycle, pure and driven by a clock: a job is live while
something holds a GPU for it; when nothing does it has *ended*, and for ``release_after_s``
its ``hyperagent_job_gpus`` is 0 and its energy counter keeps its final value (as the job
channel's series do, so Prometheus has the end of every counter), then its series go. A job
seen again before that is live again with its counter where it was. At most ``max_jobs``
jobs are kept: a new job over the bound releases the oldest ended one; when every one is
live the new job is not exported (logged once). A GPU shared by k live jobs gives each
1/k of its energy counter's advance, so the jobs' energies add up to the GPUs'.
"""

from __future__ import annotations

import asyncio
import logging
import pwd
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperagent.devices import metrics as gpu_metrics
from hyperagent.readings import Kind, Reading
from hyperagent.scheduler import SchedulerJob, slurm_parts
from hyperagent.sources import ipmi
from hyperagent.sources.job_mapping import MappingRead, read_mapping_dir
from hyperagent.sources.pdu import metrics as pdu_metrics
from hyperagent.sources.slurm_cgroup import (
    CgroupFormatError,
    ProcessJob,
    read_process,
    visible_gpus,
)

log = logging.getLogger(__name__)

GPU_JOB_INFO = "hyperagent_gpu_job_info"
JOB_GPUS = "hyperagent_job_gpus"
JOB_UTILIZATION = "hyperagent_job_gpu_utilization_ratio"
JOB_SM_ACTIVE = "hyperagent_job_gpu_sm_active_ratio"
JOB_MEMORY_USED = "hyperagent_job_gpu_memory_used_bytes"
JOB_POWER = "hyperagent_job_gpu_power_watts"
JOB_ENERGY = "hyperagent_job_gpu_energy_joules_total"
JOB_NODE_POWER = "hyperagent_job_node_power_watts"

HELP: dict[str, str] = {
    GPU_JOB_INFO: (
        "1 while the job holds the GPU (a rank's or a Slurm job's process on it in NVML, the GPU"
        " a rank declared, its Slurm job's GPUs, a job-mapping file); user, slurm_job and"
        " slurm_step empty where unknown."
    ),
    JOB_GPUS: "GPUs of this node the job holds (0 after it ended, until its series go).",
    JOB_UTILIZATION: "Mean GPU utilisation over the job's GPUs on this node.",
    JOB_SM_ACTIVE: "Mean SM activity over the job's GPUs, where the GPUs measure it.",
    JOB_MEMORY_USED: "GPU memory in use on the job's GPUs, summed.",
    JOB_POWER: "Power drawn by the job's GPUs, summed.",
    JOB_ENERGY: (
        "Energy the job's GPUs' counters advanced while it held them; a GPU shared by k jobs"
        " gives each 1/k, so the jobs' energies add up to the GPUs'."
    ),
    JOB_NODE_POWER: (
        "The node's power (PDU outlets, else BMC) while this job alone holds every GPU of the"
        " node; absent otherwise."
    ),
}

MAX_USERS = 1024
"""User names kept at most (uid -> name)."""

MODES = ("cgroup", "mapping", "off")

UserLookup = Callable[[int], str | None]
"""uid -> user name (None: unknown); blocking, called in a thread."""


def user_database(uid: int) -> str | None:
    """The name of ``uid`` in this machine's user database (NSS), None when unknown."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OSError):
        return None


def passwd_file(path: Path) -> UserLookup:
    """Names from a ``passwd(5)`` file (a replayed node's ``etc/passwd``), read now."""
    names: dict[int, str] = {}
    for line in path.read_text(errors="replace").splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[2].isdigit():
            names.setdefault(int(fields[2]), fields[0])
    return names.get


@dataclass(frozen=True)
class JobIdentity:
    """A job as its per-job series label it."""

    job_id: str
    user: str = ""
    slurm_job: str = ""
    slurm_step: str = ""

    def labels(self) -> dict[str, str]:
        return {
            "job_id": self.job_id,
            "user": self.user,
            "slurm_job": self.slurm_job,
            "slurm_step": self.slurm_step,
        }


def identity(job_id: str, user: str = "", scheduler: SchedulerJob | None = None) -> JobIdentity:
    """The identity of ``job_id``: its Slurm job and step from ``scheduler`` when that is a
    Slurm job, else from the id's own form."""
    if scheduler is not None and scheduler.scheduler == "slurm":
        return JobIdentity(job_id, user, scheduler.scheduler_id, scheduler.step)
    return JobIdentity(job_id, user, *slurm_parts(job_id))


@dataclass
class _Held:
    who: JobIdentity
    gpus: frozenset[str]
    energy_j: float = 0.0
    ended_at: float | None = None
    """None while live."""


@dataclass
class GpuValues:
    """One GPU's values in one cycle (None: not measured)."""

    uuid: str = ""
    utilization: float | None = None
    sm_active: float | None = None
    memory_used: float | None = None
    power: float | None = None
    energy: float | None = None


def gpu_values(readings: Iterable[Reading]) -> dict[str, GpuValues]:
    """GPU index -> its values among one cycle's readings (every GPU with an info series)."""
    gpus: dict[str, GpuValues] = {}
    for r in readings:
        name = r.name
        if not name.startswith("hyperagent_gpu_"):
            continue
        index = r.labels.get("gpu")
        if index is None:
            continue
        if name == gpu_metrics.GPU_INFO:
            gpus.setdefault(index, GpuValues()).uuid = r.labels.get("uuid", "")
        elif name == gpu_metrics.UTILIZATION:
            gpus.setdefault(index, GpuValues()).utilization = r.value
        elif name == gpu_metrics.SM_ACTIVE:
            gpus.setdefault(index, GpuValues()).sm_active = r.value
        elif name == gpu_metrics.MEMORY_USED:
            gpus.setdefault(index, GpuValues()).memory_used = r.value
        elif name == gpu_metrics.POWER:
            gpus.setdefault(index, GpuValues()).power = r.value
        elif name == gpu_metrics.ENERGY:
            gpus.setdefault(index, GpuValues()).energy = r.value
    return gpus


def node_power_w(readings: Iterable[Reading]) -> float | None:
    """The node's power: its PDU outlets (summed over PDUs), else its BMC's input power."""
    pdu: float | None = None
    bmc: float | None = None
    for r in readings:
        if r.name == pdu_metrics.NODE_POWER:
            pdu = (pdu or 0.0) + r.value
        elif r.name == ipmi.NODE_POWER and bmc is None:
            bmc = r.value
    return pdu if pdu is not None else bmc


class JobLedger:
    """Jobs holding GPUs, their energy and their release (see the module doc). Pure: the
    agent hands it who holds what and each cycle's readings."""

    def __init__(
        self,
        release_after_s: float,
        max_jobs: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.release_after_s = release_after_s
        self.max_jobs = max_jobs
        self.clock = clock
        self.jobs: dict[str, _Held] = {}
        self._energy: dict[str, float] = {}
        """GPU -> its energy counter at the last cycle."""
        self._refused: set[str] = set()

    def hold(self, holders: Mapping[str, tuple[JobIdentity, frozenset[str]]]) -> None:
        """Who holds which GPUs now (job id -> identity, GPUs): jobs not among them end, new
        ones are admitted under ``max_jobs``."""
        now = self.clock()
        self.release_due()
        for job, kept in self.jobs.items():
            if job not in holders and kept.ended_at is None:
                kept.ended_at = now
        for job, (who, gpus) in holders.items():
            held = self.jobs.get(job)
            if held is None:
                if not self._make_room(job):
                    continue
                held = self.jobs[job] = _Held(who, gpus)
            held.who, held.gpus, held.ended_at = who, gpus, None
        self._refused &= set(holders)

    def _make_room(self, job: str) -> bool:
        if len(self.jobs) < self.max_jobs:
            return True
        ended = sorted((h.ended_at, j) for j, h in self.jobs.items() if h.ended_at is not None)
        if ended:
            self.release(ended[0][1])
            return True
        if job not in self._refused:
            self._refused.add(job)
            log.warning(
                "not attributing %s: all %d job slots (sources.job.max_jobs) hold live jobs",
                job,
                self.max_jobs,
            )
        return False

    def release_due(self) -> list[str]:
        """Forget every job that ended ``release_after_s`` ago or more; returns them."""
        now = self.clock()
        due = [
            j
            for j, h in self.jobs.items()
            if h.ended_at is not None and now - h.ended_at >= self.release_after_s
        ]
        for job in due:
            self.release(job)
        return due

    def release(self, job: str) -> None:
        self.jobs.pop(job, None)

    def live(self) -> list[_Held]:
        return [h for h in self.jobs.values() if h.ended_at is None]

    def readings(self, gpus: Mapping[str, GpuValues], node_power: float | None) -> list[Reading]:
        """Advance the jobs' energy by the GPUs' counters since the last cycle and return the
        per-job series of this cycle."""
        self.release_due()
        live = self.live()
        sharing: dict[str, list[_Held]] = {}
        for held in live:
            for index in held.gpus:
                sharing.setdefault(index, []).append(held)
        for index, values in gpus.items():
            energy = values.energy
            if energy is None:
                continue
            last = self._energy.get(index)
            self._energy[index] = energy
            holders = sharing.get(index)
            if last is None or not holders or energy < last:
                continue
            share = (energy - last) / len(holders)
            for held in holders:
                held.energy_j += share
        every_gpu = set(gpus)
        out: list[Reading] = []
        for held in self.jobs.values():
            labels = held.who.labels()
            if held.ended_at is not None:
                out.append(Reading(JOB_GPUS, 0.0, labels))
                out.append(Reading(JOB_ENERGY, held.energy_j, labels, Kind.COUNTER, "J"))
                continue
            mine = [gpus[i] for i in sorted(held.gpus, key=_index_order) if i in gpus]
            for index in sorted(held.gpus, key=_index_order):
                found = gpus.get(index)
                if found is not None:
                    info = {"gpu": index, "uuid": found.uuid, **labels}
                    out.append(Reading(GPU_JOB_INFO, 1.0, info, Kind.INFO))
            out.append(Reading(JOB_GPUS, float(len(held.gpus)), labels))
            out += _means_and_sums(mine, labels)
            out.append(Reading(JOB_ENERGY, held.energy_j, labels, Kind.COUNTER, "J"))
            alone = len(live) == 1 and every_gpu and every_gpu <= held.gpus
            if alone and node_power is not None:
                out.append(Reading(JOB_NODE_POWER, node_power, labels, unit="W"))
        return out


def _index_order(index: str) -> tuple[int, str]:
    return (int(index), "") if index.isdigit() else (1 << 30, index)


def _means_and_sums(gpus: Sequence[GpuValues], labels: dict[str, str]) -> list[Reading]:
    out: list[Reading] = []
    util = [g.utilization for g in gpus if g.utilization is not None]
    if util:
        out.append(Reading(JOB_UTILIZATION, sum(util) / len(util), labels))
    sm = [g.sm_active for g in gpus if g.sm_active is not None]
    if sm:
        out.append(Reading(JOB_SM_ACTIVE, sum(sm) / len(sm), labels))
    memory = [g.memory_used for g in gpus if g.memory_used is not None]
    if memory:
        out.append(Reading(JOB_MEMORY_USED, sum(memory), labels, unit="B"))
    power = [g.power for g in gpus if g.power is not None]
    if power:
        out.append(Reading(JOB_POWER, sum(power), labels, unit="W"))
    return out


@dataclass
class ChannelJobs:
    """What the job channel says this cycle: connected ranks' pids and the GPUs ranks
    declared, each with its job, and each job's owner uid."""

    pids: dict[int, str] = field(default_factory=dict)
    declared: dict[int, str] = field(default_factory=dict)
    owners: dict[str, int | None] = field(default_factory=dict)


class Attribution:
    """Finds who holds each GPU (the job channel, and Slurm cgroups or a job-mapping
    directory as ``mode`` says) and keeps the per-job series through a :class:`JobLedger`.

    ``poll`` does the I/O (proc files, the mapping directory, user names) in a worker thread
    under ``timeout_s``; ``collect`` runs every cycle."""

    def __init__(
        self,
        mode: str,
        ledger: JobLedger,
        *,
        proc_root: Path = Path("/proc"),
        mapping_dir: Path | None = None,
        users: UserLookup = user_database,
        timeout_s: float = 2.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"attribution mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self.ledger = ledger
        self.proc_root = proc_root
        self.mapping_dir = mapping_dir
        self.users = users
        self.timeout_s = timeout_s
        self._processes: dict[int, ProcessJob | None] = {}
        """pid -> what its proc files said when it first appeared on a GPU."""
        self._names: dict[int, str | None] = {}
        self._mapped: dict[str, tuple[SchedulerJob, ...]] = {}
        self._gpu_pids: dict[str, list[int]] = {}
        self._logged: set[str] = set()
        self._warned_hidden = False
        self._told_sluid = False
        self._pending: (
            asyncio.Future[
                tuple[dict[int, ProcessJob | None], MappingRead | None, dict[int, str | None]]
            ]
            | None
        ) = None

    @property
    def scheduler(self) -> bool:
        """Whether jobs are found from the scheduler (cgroups or a mapping directory)."""
        return self.mode != "off"

    @property
    def idle(self) -> bool:
        """No job to export (and none found from the scheduler)."""
        return not self.scheduler and not self.ledger.jobs

    def unnamed(self, uids: Iterable[int]) -> bool:
        """Whether a user name among ``uids`` was never looked up (``poll`` looks it up)."""
        return any(uid not in self._names for uid in uids)

    def _error_once(self, message: str) -> None:
        if message not in self._logged:
            if len(self._logged) > MAX_USERS:
                self._logged.clear()
            self._logged.add(message)
            log.error("job attribution: %s", message)

    def _warn_once(self, message: str) -> None:
        if message not in self._logged:
            if len(self._logged) > MAX_USERS:
                self._logged.clear()
            self._logged.add(message)
            log.warning("job attribution: %s", message)

    async def poll(self, gpu_pids: Mapping[str, list[int]], owner_uids: Iterable[int]) -> None:
        """Read what the scheduler says of the processes on the GPUs (their proc files, new
        pids only) or the mapping directory, and the user names not known yet."""
        self._gpu_pids = {gpu: list(pids) for gpu, pids in gpu_pids.items()}
        pids = {pid for running in gpu_pids.values() for pid in running}
        self._processes = {p: j for p, j in self._processes.items() if p in pids}
        new = sorted(pids - self._processes.keys())
        uids = {u for u in owner_uids if u not in self._names}
        if self._pending is not None and not self._pending.done():
            return  # the last read still hangs in its thread: no second one beside it
        self._pending = pending = asyncio.ensure_future(asyncio.to_thread(self._read, new, uids))
        try:
            async with asyncio.timeout(self.timeout_s):
                found, mapped, names = await asyncio.shield(pending)
        except TimeoutError:
            self._error_once(f"reading the scheduler's view took over {self.timeout_s} s")
            return
        self._processes.update(found)
        if mapped is not None:
            for problem in mapped.problems:
                self._error_once(problem)
            self._mapped = mapped.gpus
        self._names.update(names)
        if len(self._names) > MAX_USERS:
            self._names.clear()

    def _read(
        self, pids: list[int], uids: set[int]
    ) -> tuple[dict[int, ProcessJob | None], MappingRead | None, dict[int, str | None]]:
        found: dict[int, ProcessJob | None] = {}
        if self.mode != "off":
            for pid in pids:
                try:
                    found[pid] = read_process(self.proc_root, pid)
                except CgroupFormatError as e:
                    self._error_once(f"{self.proc_root}/{pid}/cgroup: {e}")
                    found[pid] = None
            hidden = [p for p, job in found.items() if job is None and not self._visible(p)]
            if hidden and not self._warned_hidden:
                self._warned_hidden = True
                log.warning(
                    "job attribution: %d process(es) NVML shows on the GPUs are not under %s"
                    " (pid %d first): gone already, or hidden from this user (hidepid,"
                    " systemd ProtectProc=invisible)",
                    len(hidden),
                    self.proc_root,
                    hidden[0],
                )
            self._tell_sluid(found)
        mapped = None
        if self.mode == "mapping" and self.mapping_dir is not None:
            mapped = read_mapping_dir(self.mapping_dir)
        for process in found.values():
            if process is not None and process.uid is not None:
                uids.add(process.uid)
        names = {uid: self.users(uid) for uid in uids if uid not in self._names}
        return found, mapped, names

    def _visible(self, pid: int) -> bool:
        return (self.proc_root / str(pid)).exists()

    def _tell_sluid(self, found: Mapping[int, ProcessJob | None]) -> None:
        """Say once that Slurm names this node's job cgroups by SLUID, and what follows."""
        if self._told_sluid:
            return
        first = next(
            (p for p in found.values() if p is not None and p.job is not None and p.job.sluid),
            None,
        )
        if first is None or first.job is None:
            return
        self._told_sluid = True
        job = first.job
        log.warning(
            "job attribution: Slurm names this node's job cgroups by SLUID (Slurm 26.05's"
            " cgroup/v2 default; pid %d is in %s, step %s): such a job is %s, its slurm_job"
            " label the SLUID, which scontrol show job and squeue take for the job id; set"
            " CgroupJobIdPaths=yes in cgroup.conf for job_<id> paths",
            first.pid,
            job.sluid,
            job.job.step or "(none)",
            job.job.id,
        )

    def user(self, uid: int | None) -> str:
        """The user name of ``uid`` as looked up (the uid itself for one the database does
        not know); empty for None."""
        if uid is None:
            return ""
        name = self._names.get(uid)
        return name if name is not None else str(uid)

    def holders(
        self, channel: ChannelJobs, uuids: Mapping[str, str]
    ) -> dict[str, tuple[JobIdentity, frozenset[str]]]:
        """Job id -> (identity, GPU indices) of every job holding a GPU now; ``uuids`` maps a
        GPU uuid to its index (a ``CUDA_VISIBLE_DEVICES`` of uuids). NVML's processes first;
        then what environments and hellos say, where NVML does not put the GPU with another
        job (see the module doc)."""
        gpus: dict[str, set[str]] = {}
        who: dict[str, JobIdentity] = {}
        seen: dict[str, set[str]] = {}
        """GPU -> the jobs NVML shows a process of there."""
        environs: dict[tuple[str, Any, Any], tuple[JobIdentity, ProcessJob]] = {}
        """One process per job and environment's GPUs: a job's ranks mostly share theirs."""

        def take(job: JobIdentity, indices: Iterable[str]) -> None:
            known = who.get(job.job_id)
            if known is None or (not known.user and job.user):
                who[job.job_id] = job
            gpus.setdefault(job.job_id, set()).update(indices)

        def channel_identity(job_id: str, process: ProcessJob | None) -> JobIdentity:
            scheduler = process.job.job if process is not None and process.job else None
            return identity(job_id, self.user(channel.owners.get(job_id)), scheduler)

        for index, running in self._gpu_pids.items():
            for pid in running:
                process = self._processes.get(pid)
                job_id = channel.pids.get(pid)
                if job_id is not None:
                    job = channel_identity(job_id, process)
                elif self.mode == "cgroup" and process is not None and process.job is not None:
                    scheduler = process.job.job
                    job = identity(scheduler.id, self.user(process.uid), scheduler)
                    key = (job.job_id, process.slurm_gpus, process.visible_gpus)
                    environs.setdefault(key, (job, process))
                else:
                    continue
                take(job, [index])
                seen.setdefault(index, set()).add(job.job_id)
        on_nvml = {job: set(held) for job, held in gpus.items()}
        for job, process in environs.values():
            self._take_environ(take, job, process, on_nvml.get(job.job_id, set()), seen, uuids)
        for declared, job_id in channel.declared.items():
            index = str(declared)
            other = self._other_holder(index, job_id, channel, seen)
            if other is None:
                take(channel_identity(job_id, None), [index])
            else:
                self._warn_once(
                    f"{job_id} declared GPU {index}, where NVML shows {other}: not its GPU"
                )
        if self.mode == "mapping":
            self._take_mapped(take, gpus, who, uuids)
        return {job: (who[job], frozenset(held)) for job, held in gpus.items() if held}

    def _take_environ(
        self,
        take: Callable[[JobIdentity, Iterable[str]], None],
        job: JobIdentity,
        process: ProcessJob,
        on_nvml: set[str],
        seen: Mapping[str, set[str]],
        uuids: Mapping[str, str],
    ) -> None:
        """Give ``job`` the GPUs its process's environment names that NVML puts with no other
        job: ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``, and ``CUDA_VISIBLE_DEVICES`` read relative
        to them (else to the GPUs NVML shows the job on)."""
        allotted = _indices(process.slurm_gpus, uuids)
        known = allotted or sorted(on_nvml, key=_index_order)
        named = allotted + visible_gpus(process.visible_gpus, known, uuids)
        mine = {job.job_id}
        free = [g for g in named if seen.get(g, mine) <= mine]
        taken = set(named) - set(free)
        if taken:
            others = sorted({j for g in taken for j in seen[g]} - mine)
            self._warn_once(
                f"pid {process.pid} of {job.job_id} names GPU(s)"
                f" {', '.join(sorted(taken, key=_index_order))} in its environment, where NVML"
                f" shows {', '.join(others)}: not given to {job.job_id}"
            )
        take(job, free)

    def _other_holder(
        self, index: str, job_id: str, channel: ChannelJobs, seen: Mapping[str, set[str]]
    ) -> str | None:
        """Who NVML (or the scheduler's mapping) puts on GPU ``index`` besides ``job_id``:
        another job (its rank's pid, or a process its cgroup names), or another user's
        process; None where nothing contradicts ``job_id``."""
        others = sorted(seen.get(index, set()) - {job_id})
        if others:
            return ", ".join(others)
        owner = channel.owners.get(job_id)
        for pid in self._gpu_pids.get(index, ()):
            rank_of = channel.pids.get(pid)
            if rank_of == job_id:
                continue
            if rank_of is not None:
                return rank_of  # another job's rank, whatever its process says yet
            process = self._processes.get(pid)
            if process is None:
                continue  # gone, or hidden from the agent: says nothing either way
            if process.job is not None and process.job.job.id != job_id:
                return process.job.job.id
            if process.uid is not None and owner is not None and process.uid != owner:
                return f"a process of {self.user(process.uid)}"
        mapped = self._mapped.get(index, ()) if self.mode == "mapping" else ()
        slurm = slurm_parts(job_id)[0]
        if mapped and not any(
            m.id == job_id or (slurm and m.scheduler_id == slurm) for m in mapped
        ):
            return ", ".join(m.id for m in mapped)
        return None

    def _take_mapped(
        self,
        take: Callable[[JobIdentity, Iterable[str]], None],
        gpus: dict[str, set[str]],
        who: dict[str, JobIdentity],
        uuids: Mapping[str, str],
    ) -> None:
        known_gpus = set(uuids.values())
        for index, jobs in self._mapped.items():
            if known_gpus and index not in known_gpus:
                continue
            for scheduler in jobs:
                same = next(
                    (
                        j
                        for j, held in gpus.items()
                        if index in held
                        and scheduler.scheduler_id
                        and who[j].slurm_job == scheduler.scheduler_id
                    ),
                    None,
                )
                if same is not None:
                    continue
                users = {
                    self.user(p.uid)
                    for pid in self._gpu_pids.get(index, ())
                    if (p := self._processes.get(pid)) is not None and p.uid is not None
                }
                user = users.pop() if len(users) == 1 else ""
                take(identity(scheduler.id, user, scheduler), [index])

    def collect(
        self, readings: Sequence[Reading], channel: ChannelJobs
    ) -> tuple[list[Reading], dict[str, frozenset[str]]]:
        """This cycle's per-job series, and job id -> GPU indices of the live jobs."""
        gpus = gpu_values(readings)
        uuids = {g.uuid: index for index, g in gpus.items() if g.uuid}
        self.ledger.hold(self.holders(channel, uuids))
        held = {h.who.job_id: h.gpus for h in self.ledger.live()}
        return self.ledger.readings(gpus, node_power_w(readings)), held


def _indices(tokens: tuple[str, ...] | None, uuids: Mapping[str, str]) -> list[str]:
    """GPU indices of an environment's GPU list (indices, or uuids this node has)."""
    if not tokens:
        return []
    out = []
    for token in tokens:
        if token.isdigit():
            if not uuids or token in uuids.values():
                out.append(token)
        elif token in uuids:
            out.append(uuids[token])
    return out

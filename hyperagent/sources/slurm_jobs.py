"""What the Slurm controller says of one job: its user, nodes, task count and, per node, the
GPU indices it was given, from ``scontrol show job -d <id>``.

A job's identity is the scheduler's, not what its processes say: a process's cgroup names its
job (:mod:`hyperagent.sources.slurm_cgroup`), and this asks the controller who owns that job,
where it runs and which GPUs of each node are its (the ``IDX`` of each node's ``GRES``; under
``ConstrainDevices`` a task's ``CUDA_VISIBLE_DEVICES`` counts from 0 within them).

:func:`parse_scontrol_job` and :func:`expand_hostlist` are pure. :class:`SlurmJobs` runs
``scontrol`` as a subprocess off the event loop, under a timeout, at most ``max_concurrent`` at
once, one query per job at a time, and caches each job's answer (``ttl_s``), each failure
briefly (``failure_ttl_s``), at most ``max_cached`` jobs.

A job's name, comment, command and paths are the user's text and appear in the same output:
the parser reads only lines that start with the keys it needs and refuses a record in which
such a line appears twice or a node's line names a node outside the job, so that a job named
``x\\n   UserId=root(0)`` is refused rather than believed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from hyperagent.errors import SourceError, SourceTimeout, SourceUnavailable
from hyperagent.sources.command import CommandFailed, CommandTimeout, CommandUnavailable

log = logging.getLogger(__name__)

MAX_HOSTS = 65536
"""Host names a hostlist may expand to at most."""
MAX_GPU_INDEX = 4096
_JOB_ID = re.compile(r"^[0-9]{1,12}(?:_[0-9]{1,9})?$")
_RECORD_START = re.compile(r"^JobId=([0-9]+)(?:\s|$)")
_USER = re.compile(r"^(.*)\(([0-9]+)\)$")
_GPU = re.compile(r"(?:^|,)gpu(?::[^(),]*)?\(IDX:([^)]*)\)")
_NULL = {"", "(null)", "None", "N/A"}
_NEEDED = ("UserId", "JobState", "NumNodes", "NodeList")
"""The keys that start a line of every record, exactly once each."""

Run = Callable[[Sequence[str], float], Awaitable[str]]
"""Runs an argv under a timeout in seconds and returns its stdout; raises
CommandUnavailable, CommandTimeout or CommandFailed (:func:`run_in_session`)."""


async def run_in_session(argv: Sequence[str], timeout_s: float) -> str:
    """Run ``argv`` without a shell in a session of its own and return its stdout. At the
    timeout or a cancellation the whole process group is killed and reaped: a wrapper that
    forks (``runuser``, ``sudo``) would otherwise leave its child holding the output pipe,
    and the wait for it would outlast the timeout. Raises CommandUnavailable when the program
    is not installed, CommandTimeout, or CommandFailed (exit status and stderr kept)."""
    line = " ".join(argv)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError as e:
        raise CommandUnavailable(f"{argv[0]} is not installed") from e
    except OSError as e:
        raise CommandFailed(f"{line} could not start: {e}", argv) from e
    try:
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await process.communicate()
    except BaseException as e:  # the timeout, or the caller cancelled
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        if isinstance(e, TimeoutError):
            raise CommandTimeout(f"{line} did not finish within {timeout_s:g}s", argv) from e
        raise
    if process.returncode != 0:
        message = stderr.decode(errors="replace").strip()
        last = next((x for x in reversed(message.splitlines()) if x.strip()), "")
        raise CommandFailed(
            f"{line} exited {process.returncode}: {last}", argv, process.returncode, message
        )
    return stdout.decode(errors="replace")


class SlurmQueryError(SourceError):
    """The controller gave no usable answer about a job. ``job_id`` is the job asked about,
    ``detail`` what scontrol printed on stderr, if anything."""

    def __init__(self, message: str, job_id: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.job_id = job_id
        self.detail = detail


class SlurmUnavailable(SlurmQueryError, SourceUnavailable):
    """``scontrol`` is not installed on this host."""


class SlurmTimeout(SlurmQueryError, SourceTimeout):
    """``scontrol`` did not answer within its timeout."""


class UnknownJob(SlurmQueryError):
    """The controller does not know the job ("Invalid job id specified": it never existed,
    or ended longer ago than the controller's ``MinJobAge``)."""


class SlurmParseError(SlurmQueryError, ValueError):
    """Output that is not what ``scontrol show job -d`` prints for one job, or is ambiguous
    (a line the parser relies on twice: a user's text imitating the controller's)."""


@dataclass(frozen=True)
class SlurmJobInfo:
    """One Slurm job as its controller describes it."""

    job_id: str
    """Slurm's job id (``4242``)."""
    user: str
    """The owner's user name, as the controller resolves it."""
    uid: int
    nodes: tuple[str, ...]
    """Every node allocated to the job, in the controller's order; empty while pending."""
    tasks: int | None
    """``NumTasks``; None where the controller says none (``N/A``)."""
    gpus: dict[str, tuple[int, ...]]
    """Node -> the GPU indices (``gres.conf`` order, ``IDX``) the job holds there, for every
    node the controller lists an allocation for (running jobs; empty tuple: no GPU there).
    A node absent here: the controller did not say (pending or ended job)."""
    state: str
    """``JobState``: ``PENDING``, ``RUNNING``, ``COMPLETING``, ``COMPLETED``..."""

    def gpus_on(self, node: str) -> tuple[int, ...] | None:
        """The job's GPU indices on ``node``; None where the controller did not say."""
        return self.gpus.get(node)


def expand_hostlist(text: str) -> tuple[str, ...]:
    """The host names of a Slurm hostlist: ``gpu-[1-3,5]`` is gpu-1, gpu-2, gpu-3, gpu-5;
    ``n[01-02]-[a,b]`` n01-a, n01-b, n02-a, n02-b (zero padding kept); comma-separated lists
    outside brackets are joined; ``(null)`` and empty are no host. Raises ValueError for a
    malformed list or one of more than ``MAX_HOSTS`` names."""
    text = text.strip()
    if text in _NULL:
        return ()
    hosts: list[str] = []
    for part in _split_top(text):
        hosts += _expand_one(part)
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"hostlist {text[:80]!r} names more than {MAX_HOSTS} hosts")
    return tuple(hosts)


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"hostlist {text[:80]!r}: nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {text[:80]!r}: unbalanced brackets")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {text[:80]!r}: unbalanced brackets")
    parts.append(text[start:])
    if any(not p or any(c.isspace() for c in p) for p in parts):
        raise ValueError(f"hostlist {text[:80]!r}: empty or blank host name")
    return parts


def _expand_one(part: str) -> list[str]:
    bracket = part.find("[")
    if bracket < 0:
        return [part]
    close = part.index("]", bracket)
    prefix, ranges, rest = part[:bracket], part[bracket + 1 : close], part[close + 1 :]
    tails = _expand_one(rest)
    names: list[str] = []
    for item in ranges.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"hostlist range {item!r} in {part[:80]!r} is not N or N-M")
        first, last = int(low), int(high) if sep else int(low)
        if last < first or (last - first + 1) * len(tails) > MAX_HOSTS:
            raise ValueError(f"hostlist range {item!r} in {part[:80]!r} is empty or too long")
        for number in range(first, last + 1):
            names += [f"{prefix}{number:0{len(low)}d}{tail}" for tail in tails]
        if len(names) > MAX_HOSTS:
            raise ValueError(f"hostlist {part[:80]!r} names more than {MAX_HOSTS} hosts")
    return names


def parse_index_list(text: str) -> tuple[int, ...]:
    """GPU indices of an ``IDX`` list: ``0-3,5`` is 0, 1, 2, 3, 5; ``N/A`` and empty none.
    Raises ValueError for anything else."""
    text = text.strip()
    if text in _NULL:
        return ()
    out: list[int] = []
    for item in text.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"GPU index list {text[:80]!r}: {item!r} is not N or N-M")
        first, last = int(low), int(high) if sep else int(low)
        if last < first or last > MAX_GPU_INDEX:
            raise ValueError(f"GPU index list {text[:80]!r}: {item!r} is out of range")
        out += [i for i in range(first, last + 1) if i not in out]
    return tuple(out)


def _fields(line: str) -> dict[str, str]:
    """``Key=value`` tokens of a line (the first of each key)."""
    found: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key not in found:
            found[key] = value
    return found


def _records(text: str) -> list[tuple[str, list[str]]]:
    """(job id, lines) of each record: a record starts at an unindented ``JobId=`` line."""
    records: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        start = _RECORD_START.match(line)
        if start is not None:
            records.append((start.group(1), [line]))
        elif records:
            records[-1][1].append(line)
        elif line.strip():
            raise SlurmParseError(f"scontrol output starts with {line[:80]!r}, not JobId=")
    return records


def parse_scontrol_job(text: str, job_id: str | None = None) -> SlurmJobInfo:
    """The job of ``scontrol show job -d`` output: the record of ``job_id`` (the only record
    when None or an array task's ``<array id>_<task>``). Raises SlurmParseError naming what
    is missing, malformed or ambiguous."""
    records = _records(text)
    if job_id is not None and "_" not in job_id:  # an array task's record has its own JobId
        records = [r for r in records if r[0] == job_id]
    if not records:
        raise SlurmParseError(f"no record of job {job_id or ''} in scontrol's output", job_id or "")
    if len(records) > 1:
        raise SlurmParseError(
            f"{len(records)} records of job {records[0][0]} in scontrol's output", records[0][0]
        )
    jid, lines = records[0]
    by_key: dict[str, list[str]] = {}
    for line in lines[1:]:
        first = line.split(None, 1)[0] if line.strip() else ""
        key = first.partition("=")[0]
        by_key.setdefault(key, []).append(line)
    for key in _NEEDED:
        count = len(by_key.get(key, ()))
        if count != 1:
            what = "no line" if count == 0 else f"{count} lines"
            raise SlurmParseError(f"job {jid}: {what} starting with {key}=", jid)
    user_field = _fields(by_key["UserId"][0])["UserId"]
    user_match = _USER.match(user_field)
    if user_match is None:
        raise SlurmParseError(f"job {jid}: UserId={user_field[:80]!r} is not name(uid)", jid)
    state = _fields(by_key["JobState"][0])["JobState"]
    tasks_text = _fields(by_key["NumNodes"][0]).get("NumTasks", "")
    if tasks_text in _NULL:
        tasks = None
    elif tasks_text.isdigit():
        tasks = int(tasks_text)
    else:
        raise SlurmParseError(f"job {jid}: NumTasks={tasks_text[:40]!r} is not a count", jid)
    try:
        nodes = expand_hostlist(_fields(by_key["NodeList"][0])["NodeList"])
        gpus = _node_gpus(by_key.get("Nodes", []), nodes)
    except ValueError as e:
        raise SlurmParseError(f"job {jid}: {e}", jid) from e
    return SlurmJobInfo(
        job_id=jid,
        user=user_match.group(1),
        uid=int(user_match.group(2)),
        nodes=nodes,
        tasks=tasks,
        gpus=gpus,
        state=state,
    )


def _node_gpus(lines: list[str], nodes: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Node -> GPU indices from the ``Nodes=... GRES=gpu:N(IDX:...)`` lines of ``-d``."""
    allowed = set(nodes)
    gpus: dict[str, tuple[int, ...]] = {}
    for line in lines:
        fields = _fields(line)
        gres = fields.get("GRES", fields.get("GRES_IDX", ""))
        indices: list[int] = []
        for match in _GPU.finditer(gres):
            indices += [i for i in parse_index_list(match.group(1)) if i not in indices]
        for node in expand_hostlist(fields["Nodes"]):
            if node not in allowed:
                raise ValueError(f"a GRES line names node {node}, not one of the job's")
            if node in gpus:
                raise ValueError(f"two GRES lines name node {node}")
            gpus[node] = tuple(indices)
    return gpus


@dataclass
class _Entry:
    expires: float
    info: SlurmJobInfo | None
    error: SlurmQueryError | None


class SlurmJobs:
    """Asks the Slurm controller about jobs, with a bounded cache.

    ``scontrol`` is the argv prefix that runs scontrol (``("scontrol",)``; a test prefixes
    ``nsenter``/``runuser``); each query is ``<scontrol> show job -d <id>`` under
    ``timeout_s``. Answers are kept ``ttl_s``, failures ``failure_ttl_s`` (a missing scontrol
    ``unavailable_ttl_s``, for every job), at most ``max_cached`` jobs (least recently used
    out first); at most ``max_concurrent`` scontrol processes run at once, and callers asking
    about the same job at once share one query.
    """

    def __init__(
        self,
        scontrol: Sequence[str] = ("scontrol",),
        *,
        timeout_s: float = 5.0,
        ttl_s: float = 60.0,
        failure_ttl_s: float = 5.0,
        unavailable_ttl_s: float = 300.0,
        max_cached: int = 4096,
        max_concurrent: int = 2,
        clock: Callable[[], float] = time.monotonic,
        run: Run = run_in_session,
    ) -> None:
        if not scontrol:
            raise ValueError("scontrol: an empty command line")
        if max_cached < 1 or max_concurrent < 1:
            raise ValueError("max_cached and max_concurrent must be at least 1")
        self.scontrol = tuple(scontrol)
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.failure_ttl_s = failure_ttl_s
        self.unavailable_ttl_s = unavailable_ttl_s
        self.max_cached = max_cached
        self._clock = clock
        self._run = run
        self._slots = asyncio.Semaphore(max_concurrent)
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._inflight: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._unavailable: _Entry | None = None
        self._failing = False
        """The last query that reached no answer timed out or failed (logged once)."""
        self.queries = 0
        """scontrol processes started so far."""

    def __len__(self) -> int:
        return len(self._cache)

    def cached(self, job_id: str) -> SlurmJobInfo | None:
        """The cached, unexpired answer for ``job_id``, without asking (None: none)."""
        entry = self._fresh(job_id)
        return entry.info if entry is not None else None

    def forget(self, job_id: str) -> None:
        """Drop ``job_id``'s cached answer or failure (the next lookup asks again)."""
        self._cache.pop(job_id, None)

    async def get(self, job_id: str) -> SlurmJobInfo | None:
        """The job as the controller says, None when it cannot say. The reason is logged
        when the query fails, not at each answer from the cache: a missing scontrol and a
        refused answer at warning; a timeout or a failing scontrol at warning when the
        controller stops answering, at debug while it still does not (and at info once it
        answers again); a job the controller does not know at debug."""
        try:
            return await self.lookup(job_id)
        except SlurmQueryError:
            return None

    async def lookup(self, job_id: str) -> SlurmJobInfo:
        """The job as the controller says (cached). Raises ValueError for an id that is no
        Slurm job id (``4242``, ``4242_7``), SlurmUnavailable, SlurmTimeout, UnknownJob,
        SlurmParseError or SlurmQueryError (the controller unreachable, scontrol failing);
        a failure is raised again from the cache until it expires."""
        if not _JOB_ID.match(job_id):
            raise ValueError(f"{job_id[:40]!r} is not a Slurm job id")
        entry = self._fresh(job_id)
        if entry is not None:
            return self._answer(entry)
        lock, waiters = self._inflight.setdefault(job_id, (asyncio.Lock(), [0]))
        waiters[0] += 1
        try:
            async with lock:
                entry = self._fresh(job_id)
                if entry is None:
                    entry = await self._ask(job_id)
                return self._answer(entry)
        finally:
            waiters[0] -= 1
            if waiters[0] == 0:
                self._inflight.pop(job_id, None)

    def _fresh(self, job_id: str) -> _Entry | None:
        now = self._clock()
        if self._unavailable is not None:
            if now < self._unavailable.expires:
                return self._unavailable
            self._unavailable = None
        entry = self._cache.get(job_id)
        if entry is None:
            return None
        if now >= entry.expires:
            del self._cache[job_id]
            return None
        self._cache.move_to_end(job_id)
        return entry

    @staticmethod
    def _answer(entry: _Entry) -> SlurmJobInfo:
        if entry.error is not None:
            raise entry.error.with_traceback(None)
        assert entry.info is not None
        return entry.info

    async def _ask(self, job_id: str) -> _Entry:
        try:
            async with self._slots:
                self.queries += 1
                info = await self._query(job_id)
        except SlurmUnavailable as e:
            self._unavailable = _Entry(self._clock() + self.unavailable_ttl_s, None, e)
            log.warning("Slurm: %s; jobs are not looked up for %gs", e, self.unavailable_ttl_s)
            return self._unavailable
        except (UnknownJob, SlurmParseError) as e:
            if isinstance(e, UnknownJob):
                log.debug("Slurm job %s: %s", job_id, e)
            else:
                log.warning("Slurm job %s: the controller's answer is refused: %s", job_id, e)
            return self._store(job_id, _Entry(self._clock() + self.failure_ttl_s, None, e))
        except SlurmQueryError as e:
            level = logging.DEBUG if self._failing else logging.WARNING
            log.log(level, "Slurm job %s: no answer from the controller: %s", job_id, e)
            self._failing = True
            return self._store(job_id, _Entry(self._clock() + self.failure_ttl_s, None, e))
        if self._failing:
            log.info("Slurm: the controller answers again")
            self._failing = False
        return self._store(job_id, _Entry(self._clock() + self.ttl_s, info, None))

    def _store(self, job_id: str, entry: _Entry) -> _Entry:
        self._cache[job_id] = entry
        self._cache.move_to_end(job_id)
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return entry

    async def _query(self, job_id: str) -> SlurmJobInfo:
        argv = (*self.scontrol, "show", "job", "-d", job_id)
        try:
            text = await self._run(argv, self.timeout_s)
        except CommandUnavailable as e:
            raise SlurmUnavailable(f"{self.scontrol[0]} is not installed", job_id) from e
        except CommandTimeout as e:
            raise SlurmTimeout(
                f"scontrol show job {job_id} did not answer within {self.timeout_s:g}s", job_id
            ) from e
        except CommandFailed as e:
            detail = e.stderr.strip()
            if "Invalid job id" in detail:
                raise UnknownJob(f"the controller knows no job {job_id}", job_id, detail) from e
            last = detail.splitlines()[-1] if detail else f"exit status {e.returncode}"
            raise SlurmQueryError(f"scontrol show job {job_id}: {last}", job_id, detail) from e
        info = parse_scontrol_job(text, job_id)
        return info

"""The agent's side of the job channel: step reports in (as readings), settings out.

Ranks connect to a unix ``SOCK_SEQPACKET`` socket (one message per packet) and the agent
answers on the same connection. Who may connect is decided per peer from SO_PEERCRED: the
agent's own user, the users of ``allowed_users`` and members of ``allowed_groups`` (primary or
supplementary group, from the user database: NSS, which may ask LDAP or SSSD, so that lookup
runs in a thread and its answer is kept ``NSS_CACHE_S`` per uid). The first peer that says
hello for a job id binds it to its uid; nobody else can report for that job while any of its
ranks is connected (and for ``release_after_s`` after the last one left). Refusals are answered
with a reason (the peer's unread packets are read first, so that the reason reaches it rather
than a reset), counted and logged once per reason.

A rank's job is who the kernel says it is (:mod:`hyperagent.sources.job_identity`): the Slurm
job step its cgroup names, else the id it gives bound to its uid (``u<uid>-<id>``; the agent's
own user keeps its ids). Each user holds at most ``max_connections_per_user`` connections and
``max_jobs_per_user`` live jobs, so that no user locks the others out.

A job whose last rank left is *released* ``release_after_s`` later, on the source's own clock
(checked every ``release_check_s``, whether or not another job arrives): its id, its owner
binding, its remembered settings and its series go. Its counters are not exported any longer
than that: for the whole of ``release_after_s`` the final values were exported unchanged (with
``hyperagent_job_ranks`` 0), which is many scrapes at any sensible scrape interval, so
Prometheus has the end of every counter; when the series then vanish from /metrics Prometheus
marks them stale, and ``increase()``/``rate()`` over the job's last minutes still count up to
the final values. A job id that comes back after its release starts from 0 (a new series).
``release_after_s`` should therefore exceed the scrape interval (the 600 s default does).

The job bound (``max_jobs``) counts live jobs, those with a connected rank. A job released or
not, a dead one never holds a slot a live one needs: a new job id over the bound releases the
oldest dead job (the one whose last rank left first) at once; only when every slot is held by
a live job is it refused, and the refusal names those jobs. Per-rank state (a rank's last step
time, its allocator's retry and OOM counts) is dropped with the rank's connection; its counts
stay in the job's totals.

Packets are read as they come while the source is ``prompt`` (the agent makes it so while it
measures a trial). Otherwise a rank that reports at most ``BATCH_RATE`` packets a second, once
its hello is read, has its packets read in one pass every ``BATCH_S`` and when the source is
read: a wake-up of the agent costs about as much as handling tens of steps. A step keeps the
time it was sent (the kernel's stamp on the packet), and a rank's close is seen at once.

Who may connect, users' groups and names, and a connected rank live in
:mod:`~hyperagent.sources.job_peers`; the jobs' totals, their bounds, remembered settings and
release in :mod:`~hyperagent.sources.job_totals`. This module listens, reads the peers' packets
(as they come or in passes) and handles their messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import select
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from hyperagent import job as protocol
from hyperagent import ticks
from hyperagent.errors import ConfigError, ConfigProblem, PayloadError
from hyperagent.job import JobSettings, StepReport
from hyperagent.readings import Kind, Reading
from hyperagent.sources.job_identity import RankIdentity, identify
from hyperagent.sources.job_peers import Admission, GroupCache, Peer, PeerPolicy, UserNames
from hyperagent.sources.job_totals import JobBook, JobListener, JobTotals

__all__ = [
    "GroupCache",
    "JobListener",
    "JobSource",
    "JobTotals",
    "Peer",
    "PeerPolicy",
    "SocketInUse",
    "SocketUnusable",
]

log = logging.getLogger(__name__)

StepListener = Callable[[StepReport], None]
RankListener = Callable[[str, int], None]
"""(job, rank) of a rank whose connection closed."""

BATCH = 1000
"""Connections, or peers' packets, taken per turn of the event loop at most (the rest wait
for the next turn)."""

_PEERCRED = struct.Struct("3i")

BATCH_S = 1.0
"""While the source is not ``prompt``, a rank that sends at most ``BATCH_RATE`` packets a
second has them left in its socket and read in one pass every ``BATCH_S`` (on the grid of
:mod:`hyperagent.ticks`, where the agent's collection ticks) and whenever the source is read,
instead of one wake-up of the agent per step; its hello is read at once, and so is its
connection closing."""

BATCH_RATE = 50.0
"""Packets a second above which a rank's packets are read as they come: its socket (about 270
small packets) must not fill between two passes."""

_PROMPT = select.EPOLLIN | select.EPOLLRDHUP
_BATCHED = select.EPOLLRDHUP

SO_TIMESTAMP = getattr(socket, "SO_TIMESTAMP", 29)
"""Linux's option that stamps each packet with the time it was sent (socket.h's value where
Python does not name it)."""
_TIMEVAL = struct.Struct("@ll")
_STAMP_SPACE = socket.CMSG_SPACE(_TIMEVAL.size)

UNREAD_AT_REFUSAL = 1024
"""Packets of a refused peer read (and dropped) at most before its connection closes."""

REFUSALS = (
    "unauthorised",
    "job_claimed",
    "not_claimed",
    "too_many_jobs",
    "too_many_ranks",
    "too_many_connections",
)
"""Why a peer or a message was refused (``hyperagent_job_refused_total{reason}``)."""


class SocketInUse(ConfigError):
    """Another live process (an agent or a recorder) listens on the job socket."""

    def __init__(self, reason: str) -> None:
        super().__init__([ConfigProblem("sources.job.socket", reason)])


class SocketUnusable(ConfigError):
    """The job socket cannot be made at its path (a folder this user may not create...)."""

    def __init__(self, path: Path, error: OSError) -> None:
        reason = f"cannot listen on {path}: {error.strerror or error}"
        if isinstance(error, PermissionError):
            reason += (
                "; run the agent as its service user (hyperagent, as the shipped unit does, "
                "which creates /run/hyperagent) or set sources.job.socket to a path this user "
                "may create"
            )
        super().__init__([ConfigProblem("sources.job.socket", reason)])


class JobSource:
    """Listens on a unix seqpacket socket for the training job's ranks.

    Readings are running totals per job; listeners see every valid step as it arrives (the
    agent's trial measurement uses this). Invalid messages and refused peers are counted.
    """

    name = "job"

    def __init__(
        self,
        socket_path: Path,
        policy: PeerPolicy | None = None,
        groups: GroupCache | None = None,
        clock: Callable[[], float] = time.monotonic,
        proc_root: Path = Path("/proc"),
    ) -> None:
        """``groups`` answers the policy's group questions (default: the user database);
        ``clock`` times jobs' release; ``proc_root`` holds the peers' cgroup files."""
        self.socket_path = socket_path
        self.proc_root = proc_root
        self.trusted_uid = os.geteuid()
        """The agent's own user, whose ranks keep the job ids they give."""
        self.target = str(socket_path)
        self.policy = policy or PeerPolicy()
        self.groups = groups or GroupCache()
        self.admission = Admission(self.policy, self.groups, self._warn_once)
        self.book = JobBook(self.policy, clock)
        self.invalid = 0
        self.refused: Counter[str] = Counter()
        self.listeners: list[StepListener] = []
        self.rank_listeners: list[RankListener] = []
        """Told of every rank whose connection closed (after its state here went)."""
        self.release_listeners: list[JobListener] = self.book.release_listeners
        """Told of every job released (after its state here went)."""
        self.attach_listeners: list[RankListener] = []
        """Told of every rank that said hello (after it joined its job)."""
        self.names = UserNames()
        self.clock = clock
        self._releaser: asyncio.Task[None] | None = None
        self.peers: dict[int, Peer] = {}
        """fd -> connected peer."""
        self._sock: socket.socket | None = None
        self._poller: select.epoll | None = None
        """The connected peers' sockets, polled as one: the event loop sees the poller's
        descriptor, so a burst of steps from many ranks is one callback, not one per rank."""
        self._waiting: select.epoll | None = None
        """The batched peers' sockets, for what they sent (never seen by the event loop: a
        pass asks it which ones to read)."""
        self.arrived = 0.0
        """When the message being handled was sent (monotonic time, from the kernel's stamp
        on the packet): a step read in a later pass keeps the time it came."""
        self._prompt = True
        self._batcher: asyncio.Task[None] | None = None
        self._batching = asyncio.Event()
        """Set while peers may be batched (not ``prompt``, and peers connected)."""
        self._logged: set[str] = set()

    @property
    def jobs(self) -> dict[str, JobTotals]:
        """job -> its totals (:class:`~hyperagent.sources.job_totals.JobBook`)."""
        return self.book.jobs

    # -- listening -----------------------------------------------------------------------

    async def start(self) -> None:
        """Listen; raises SocketInUse when a live process already listens on the path, and
        SocketUnusable when the socket cannot be made there."""
        if self._sock is not None:
            return
        path = self.socket_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_socket():
                _refuse_takeover(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            sock.bind(str(path))
            os.chmod(path, 0o666)  # peers are authorised by SO_PEERCRED, not by file mode
            sock.listen(256)
        except OSError as e:
            raise SocketUnusable(path, e) from e
        sock.setblocking(False)
        self._sock = sock
        self._poller = select.epoll()
        self._waiting = select.epoll()
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._accept)
        loop.add_reader(self._poller.fileno(), self._readable_peers)
        self._releaser = asyncio.create_task(self.book.release_loop(), name="job-release")
        self._batcher = asyncio.create_task(self._batch_loop(), name="job-batches")

    def _accept(self) -> None:
        listener = self._sock
        if listener is None:
            return
        for _ in range(BATCH):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("job socket %s: %s", self.socket_path, e)
                return
            conn.setblocking(False)
            with contextlib.suppress(OSError):  # without it, a packet arrives when it is read
                conn.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMP, 1)
            pid, uid, gid = _PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            peer = Peer(conn, pid, uid, gid)
            allowed = self.policy.decides(uid, gid)
            if allowed is False:
                self._refuse_unauthorised(peer)
                continue
            crowded = self.admission.crowded(uid, len(self.peers))
            if crowded is not None:
                self._refuse(peer, "too_many_connections", crowded)
                continue
            self.admission.count(peer)
            if allowed:
                self._admit(peer)
            else:
                fd = conn.fileno()
                task = asyncio.create_task(self._authorise(peer, fd), name=f"job-peer-{pid}")
                self.admission.authorising[fd] = (peer, task)

    async def _authorise(self, peer: Peer, fd: int) -> None:
        """Admit or refuse ``peer`` once its user's groups are known (off the event loop)."""
        try:
            member = await self.admission.member(peer)
        finally:
            self.admission.authorising.pop(fd, None)
        if member:
            self._admit(peer)
        else:
            self._refuse_unauthorised(peer)

    def _admit(self, peer: Peer) -> None:
        self.peers[peer.conn.fileno()] = peer
        assert self._poller is not None, "peers are admitted once the source has started"
        self._poller.register(peer.conn.fileno(), _PROMPT)
        peer.counted_since = asyncio.get_running_loop().time()
        if not self._prompt:
            self._batching.set()

    def _refuse_unauthorised(self, peer: Peer) -> None:
        self._refuse(peer, "unauthorised", f"uid {peer.uid} gid {peer.gid} may not report jobs")

    def _refuse(self, peer: Peer, reason: str, detail: str) -> None:
        """Tell ``peer`` why, then close its connection. What it sent and the agent did not
        read is read first: closing a unix socket with packets unread resets the peer's end,
        and the peer would see the reset instead of the reason."""
        self.refused[reason] += 1
        refused = "job channel: refused pid %d uid %d (%s): %s"
        self._warn_once(reason, refused, peer.pid, peer.uid, reason, detail)
        with contextlib.suppress(OSError):
            for _ in range(UNREAD_AT_REFUSAL):
                if not peer.conn.recv(protocol.MAX_DATAGRAM, socket.MSG_DONTWAIT):
                    break
        with contextlib.suppress(OSError):
            peer.conn.send(protocol.encode_refused(reason, detail))
        self._drop(peer)

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        """Log the first problem of each kind; the counters tell how many followed."""
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message, *args)

    def _drop(self, peer: Peer) -> None:
        self.admission.uncount(peer)
        fd = peer.conn.fileno()
        if fd >= 0 and self.peers.get(fd) is peer:
            del self.peers[fd]
            for poller in (self._poller, self._waiting):
                if poller is not None:
                    with contextlib.suppress(OSError, ValueError):
                        poller.unregister(fd)
        peer.conn.close()
        job = peer.job
        if job is not None and self.book.leave(peer):
            for listener in self.rank_listeners:
                listener(job, peer.rank)

    def _readable_peers(self) -> None:
        """One packet of each peer with one waiting: a rank sends a step at a time, so a
        second ``recv`` would mostly find nothing; packets still queued are taken at the
        loop's next turn."""
        poller = self._poller
        if poller is None:
            return
        peers = self.peers
        for fd, _ in poller.poll(0, BATCH):
            peer = peers.get(fd)
            if peer is None:
                continue
            if peer.batched:  # its connection closed: what it sent before, then the close
                self._drain(peer)
            else:
                self._readable(peer)

    def _readable(self, peer: Peer) -> bool:
        """Read one packet of ``peer``'s; False when none was waiting or the peer is gone (its
        close, or an error, drops it)."""
        try:
            packet, stamp, _, _ = peer.conn.recvmsg(protocol.MAX_DATAGRAM, _STAMP_SPACE)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self._drop(peer)
            return False
        if not packet:
            self._drop(peer)
            return False
        peer.received += 1
        self.receive(packet, peer, _sent_at(stamp))
        return True

    def _drain(self, peer: Peer) -> None:
        """Read what ``peer`` sent (``BATCH`` packets at most), its close included."""
        for _ in range(BATCH):
            if peer.conn.fileno() < 0 or not self._readable(peer):
                return

    def drain(self) -> None:
        """Read what the batched peers sent so far (the source does so when read)."""
        if self._waiting is None:
            return
        peers = self.peers
        for fd, _ in self._waiting.poll(0, BATCH):
            peer = peers.get(fd)
            if peer is not None and peer.batched:
                self._drain(peer)

    @property
    def prompt(self) -> bool:
        """Whether every packet is read as it comes (the agent's choice while it measures a
        trial, whose windows and stall checks follow the steps' arrival); else ranks that
        report slowly are read in passes (``BATCH_S``)."""
        return self._prompt

    @prompt.setter
    def prompt(self, prompt: bool) -> None:
        if prompt == self._prompt:
            return
        self._prompt = prompt
        if not prompt:
            if self.peers:
                self._batching.set()
            return
        self._batching.clear()
        self.drain()
        for peer in list(self.peers.values()):
            self._batch(peer, False)

    def _batch(self, peer: Peer, batched: bool) -> None:
        if peer.batched == batched or self._poller is None or peer.conn.fileno() < 0:
            return
        fd = peer.conn.fileno()
        with contextlib.suppress(OSError):
            self._poller.modify(fd, _BATCHED if batched else _PROMPT)
            if self._waiting is not None:
                if batched:
                    self._waiting.register(fd, select.EPOLLIN)
                else:
                    self._waiting.unregister(fd)
            peer.batched = batched

    async def _batch_loop(self) -> None:
        """Every ``BATCH_S`` while batching: read the batched peers, and batch those that
        reported at most ``BATCH_RATE`` packets a second since the last pass (prompt again
        those that reported more)."""
        loop = asyncio.get_running_loop()
        while True:
            if self._prompt or not self.peers:
                self._batching.clear()
                await self._batching.wait()
            await ticks.sleep_to_tick(BATCH_S)
            if self._prompt:
                continue
            self.drain()
            now = loop.time()
            for peer in list(self.peers.values()):
                counted = now - peer.counted_since
                if counted < BATCH_S / 2:
                    continue
                if peer.job is not None:  # said hello: from now on it may wait for a pass
                    self._batch(peer, peer.received <= BATCH_RATE * counted)
                peer.received, peer.counted_since = 0, now

    # -- messages ------------------------------------------------------------------------

    def receive(self, data: bytes, peer: Peer, sent_at: float | None = None) -> None:
        """Handle one message of ``peer`` (public for tests), sent at ``sent_at`` (monotonic
        time; None: now), which listeners find in ``arrived``."""
        self.arrived = time.monotonic() if sent_at is None else sent_at
        try:
            message = protocol.decode(data)
            kind = message["type"]
            if kind in ("settings", "refused"):
                raise PayloadError(f"{kind} flows from the agent to the job, not back")
            if kind == "hello":
                self._hello(peer, protocol.parse_hello(message))
                return
            hello = peer.hello
            said = message.get("job")
            step = protocol.parse_step(
                message, peer.job if hello is not None and said == hello.job else None
            )
        except PayloadError as e:
            self.invalid += 1
            self._warn_once(str(e).split(":")[0], "dropped an invalid job report: %s", e)
            return
        if peer.job is None:
            self._hello(peer, protocol.Hello(step.job, step.rank))
            if peer.job is None:
                return
            step = dataclasses.replace(step, job=peer.job)
        if step.job != peer.job or step.rank != peer.rank:
            self.refused["not_claimed"] += 1
            self._warn_once(
                "not_claimed",
                "job channel: pid %d (job %s rank %d) reported for job %s rank %d; dropped",
                peer.pid,
                peer.job,
                peer.rank,
                said,
                step.rank,
            )
            return
        if step.memory is not None:
            peer.memory = step.memory
        totals = self.jobs[step.job]
        totals.add(step)
        for listener in self.listeners:
            listener(step)

    def _hello(self, peer: Peer, hello: protocol.Hello) -> None:
        rank = hello.rank
        if peer.job is not None and peer.hello is not None:
            if (peer.hello.job, peer.rank) != (hello.job, rank):
                said = f"connection is job {peer.hello.job} rank {peer.rank}"
                self._refuse(peer, "not_claimed", said)
                return
            job, slurm_job = peer.job, None
        else:
            identity = self._identify(peer, hello.job)
            job = identity.job
            slurm_job = None if identity.cgroup is None else identity.cgroup.job.scheduler_id
        totals = self.book.join(job, peer.uid, rank, slurm_job)
        if not isinstance(totals, JobTotals):
            self._refuse(peer, *totals)
            return
        previous = totals.ranks.get(rank)
        if previous is not None and previous is not peer:
            self._drop(previous)  # the rank restarted; its new connection replaces the old
        peer.job, peer.rank, peer.hello = job, rank, hello
        if not totals.ranks:
            totals.attached_at = self.clock()
        totals.ranks[rank] = peer
        known = self.book.settings.get(job)
        if known is not None:
            peer.send_settings(job, known)
        for listener in self.attach_listeners:
            listener(job, rank)

    def _identify(self, peer: Peer, said: str) -> RankIdentity:
        """Who ``peer`` is, from its cgroup and uid (once per connection)."""
        identity = identify(said, peer.pid, peer.uid, self.trusted_uid, self.proc_root)
        if identity.contradicted:
            self._warn_once(
                f"contradicted {identity.job}",
                "job channel: pid %d uid %d says it is job %s; its cgroup says %s, which it is",
                peer.pid,
                peer.uid,
                said,
                identity.job,
            )
        return identity

    # -- jobs ----------------------------------------------------------------------------

    def attached(self, job: str) -> int:
        """How many ranks of ``job`` are connected."""
        return self.book.attached(job)

    def release_due(self) -> list[str]:
        """Release every job whose last rank left ``release_after_s`` ago or more; returns
        them (the source does this itself every ``release_check_s``)."""
        return self.book.release_due()

    def release(self, job: str) -> None:
        """Forget ``job`` (none of its ranks may be connected): its totals, its owner, its
        remembered settings and so its series."""
        self.book.release(job)

    def send_settings(self, job: str, settings: JobSettings) -> int:
        """Hand settings to every connected rank of ``job``; returns how many received them.

        The latest settings are remembered and handed to ranks that attach later.
        """
        totals = self.book.remember(job, settings)
        return sum(peer.send_settings(job, settings) for peer in list(totals.ranks.values()))

    def user_name(self, uid: int | None) -> str | None:
        """The name of ``uid`` from the user database, once a lookup in a thread found it
        (None until then, and for a uid the database does not know)."""
        return self.names.name(uid)

    def job_pids(self) -> dict[int, str]:
        """pid -> job id of every connected rank."""
        return {p.pid: p.job for p in self.peers.values() if p.job is not None}

    def declared_gpus(self) -> dict[int, str]:
        """GPU index -> job id, as ranks declared them in their hello. A GPU that ranks of
        several jobs declare goes to the one Slurm job among them (its rank's cgroup names
        it, and Slurm constrains its devices), else to none of them (NVML's processes
        decide)."""
        declaring: dict[int, set[str]] = {}
        for peer in self.peers.values():
            if peer.job is not None:
                for gpu in peer.gpus:
                    declaring.setdefault(gpu, set()).add(peer.job)
        declared: dict[int, str] = {}
        for gpu, jobs in declaring.items():
            slurm = [j for j in jobs if j in self.jobs and self.jobs[j].slurm_job]
            if len(jobs) == 1 or len(slurm) == 1:
                declared[gpu] = next(iter(jobs)) if len(jobs) == 1 else slurm[0]
        return declared

    # -- readings ------------------------------------------------------------------------

    async def read(self) -> list[Reading]:
        self.drain()
        self.release_due()
        out = [Reading("hyperagent_job_invalid_reports_total", self.invalid, {}, Kind.COUNTER)]
        for reason in REFUSALS:
            out.append(
                Reading(
                    "hyperagent_job_refused_total",
                    self.refused.get(reason, 0),
                    {"reason": reason},
                    Kind.COUNTER,
                )
            )
        for job, totals in self.jobs.items():
            out += totals.readings(job)
        return out

    async def close(self) -> None:
        for task in (self._releaser, self._batcher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._releaser = self._batcher = None
        await self.admission.close()
        for peer in list(self.peers.values()):
            self._drop(peer)
        if self._sock is not None:
            loop = asyncio.get_running_loop()
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                self.socket_path.unlink()
        if self._poller is not None:
            asyncio.get_running_loop().remove_reader(self._poller.fileno())
            self._poller.close()
            self._poller = None
        if self._waiting is not None:
            self._waiting.close()
            self._waiting = None


def _refuse_takeover(path: Path) -> None:
    """Raise SocketInUse when a live process listens on ``path``; remove a socket file that a
    process now gone left."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink()  # left by a process that is gone
        return
    except OSError as e:
        raise SocketInUse(f"{path}: {e.strerror}; is another agent running?") from e
    finally:
        probe.close()
    raise SocketInUse(
        f"another hyperagent agent (or recorder) listens on {path}; stop it first "
        "(systemctl stop hyperagent-agent) or give this one its own sources.job.socket"
    )


def _sent_at(ancillary: list[tuple[int, int, bytes]]) -> float | None:
    """The monotonic time a packet was sent, from its SO_TIMESTAMP (None without one)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMP and len(data) >= _TIMEVAL.size:
            seconds, micros = _TIMEVAL.unpack_from(data)
            return time.monotonic() - (time.time() - seconds - micros / 1e6)
    return None

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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import logging
import math
import os
import pwd
import select
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hyperagent import job as protocol
from hyperagent import ticks
from hyperagent.errors import ConfigError, ConfigProblem, PayloadError
from hyperagent.job import JobSettings, StepReport
from hyperagent.readings import Kind, Reading
from hyperagent.sources.job_identity import RankIdentity, identify

log = logging.getLogger(__name__)

StepListener = Callable[[StepReport], None]
RankListener = Callable[[str, int], None]
"""(job, rank) of a rank whose connection closed."""
JobListener = Callable[[str], None]
"""A job released."""

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

RELEASE_CHECK_S = 1.0
"""How often jobs due for release are looked for (at most; twice per ``release_after_s``)."""

UNREAD_AT_REFUSAL = 1024
"""Packets of a refused peer read (and dropped) at most before its connection closes."""

REFUSAL_NAMES = 16
"""Live jobs named in a ``too_many_jobs`` refusal at most (the rest are counted)."""

NSS_CACHE_S = 60.0
"""How long a user's group memberships, once looked up, answer for that uid."""

NSS_CACHED_USERS = 1024
"""Users whose memberships are kept at most (expired ones are forgotten first)."""

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


@dataclass(frozen=True)
class PeerPolicy:
    """Who may use the job channel besides the agent's own user."""

    users: frozenset[int] = frozenset()
    groups: frozenset[int] = frozenset()
    max_jobs: int = 16
    max_ranks: int = 64
    max_jobs_per_user: int = 8
    """Live jobs of one uid at most."""
    max_connections_per_user: int = 128
    """Connections of one uid at most (said hello or not)."""
    release_after_s: float = 600.0
    """How long a job whose last rank left stays bound to its user (and exported)."""

    @classmethod
    def resolve(
        cls,
        users: Iterable[str | int] = (),
        groups: Iterable[str | int] = (),
        **limits: float,
    ) -> PeerPolicy:
        """Names are looked up now; one that does not exist is logged and ignored (a group
        created later is picked up at the next start)."""
        uids, gids = set(), set()
        for user in users:
            try:
                uids.add(user if isinstance(user, int) else pwd.getpwnam(user).pw_uid)
            except KeyError:
                log.warning("sources.job.allowed_users: no user %r on this host", user)
        for group in groups:
            try:
                gids.add(group if isinstance(group, int) else grp.getgrnam(group).gr_gid)
            except KeyError:
                log.warning("sources.job.allowed_groups: no group %r on this host", group)
        return cls(frozenset(uids), frozenset(gids), **limits)  # type: ignore[arg-type]

    def decides(self, uid: int, gid: int) -> bool | None:
        """Whether ``uid``/``gid`` may connect, where they alone decide; None when the answer
        depends on the user's supplementary groups (see ``admits_member``)."""
        if uid == os.geteuid() or uid in self.users or gid in self.groups:
            return True
        return False if not self.groups else None

    def admits_member(self, groups: frozenset[int] | None) -> bool:
        """Whether a user in ``groups`` (None: a user the database does not know) may connect."""
        return groups is not None and not self.groups.isdisjoint(groups)


GroupLookup = Callable[[int], "frozenset[int] | None"]
"""uid -> the user's gids (primary and supplementary), None for an unknown uid; may block."""


def user_groups(uid: int) -> frozenset[int] | None:
    """The groups of ``uid`` from the user database (NSS: files, LDAP, SSSD...); blocks."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return None
    return frozenset(os.getgrouplist(user.pw_name, user.pw_gid))


class GroupCache:
    """Users' group memberships, looked up in a thread (never on the event loop) and kept
    ``ttl_s`` per uid; connections of one uid arriving during a lookup share it. A lookup that
    fails is not kept (the next connection asks again)."""

    def __init__(
        self,
        lookup: GroupLookup = user_groups,
        ttl_s: float = NSS_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lookup, self.ttl_s, self.clock = lookup, ttl_s, clock
        self.lookups = 0
        """Calls of ``lookup`` so far."""
        self._known: dict[int, tuple[float, frozenset[int] | None]] = {}
        self._pending: dict[int, asyncio.Task[frozenset[int] | None]] = {}

    async def groups(self, uid: int) -> frozenset[int] | None:
        """The gids of ``uid``; raises what the lookup raised."""
        known = self._known.get(uid)
        if known is not None and self.clock() < known[0]:
            return known[1]
        task = self._pending.get(uid)
        if task is None:
            task = asyncio.create_task(self._look_up(uid), name=f"nss-uid-{uid}")
            self._pending[uid] = task
        return await asyncio.shield(task)

    async def _look_up(self, uid: int) -> frozenset[int] | None:
        self.lookups += 1
        try:
            groups = await asyncio.to_thread(self.lookup, uid)
        finally:
            del self._pending[uid]
        now = self.clock()
        if len(self._known) >= NSS_CACHED_USERS:
            self._known = {u: k for u, k in self._known.items() if now < k[0]}
            if len(self._known) >= NSS_CACHED_USERS:
                self._known.clear()
        self._known[uid] = (now + self.ttl_s, groups)
        return groups

    async def close(self) -> None:
        """Stop waiting for lookups in flight (their threads end on their own)."""
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pending.clear()


@dataclass
class Peer:
    """One connected rank."""

    conn: socket.socket
    pid: int
    uid: int
    gid: int
    job: str | None = None
    """The job the kernel says the rank is (its cgroup's, or its id bound to its uid)."""
    rank: int = 0
    hello: protocol.Hello | None = None
    """What the rank said of itself when it attached (``hello.job``: the id it answers to)."""
    counted: bool = False
    """It holds one of its uid's connections."""
    memory: protocol.MemoryReport | None = None
    batched: bool = False
    """Its packets are read in passes (``BATCH_S``), not as they come."""
    received: int = 0
    """Packets read since ``counted_since`` (its rate decides ``batched``)."""
    counted_since: float = 0.0

    @property
    def knobs(self) -> tuple[str, ...] | None:
        return None if self.hello is None else self.hello.knobs

    @property
    def gpus(self) -> tuple[int, ...]:
        """The GPUs the rank declared in its hello."""
        return () if self.hello is None else self.hello.declared


@dataclass
class JobTotals:
    """Running totals of one job's step reports on this node, summed over its ranks: ``step_s``
    adds every rank's step time (a node's step time is ``step_s / steps`` per rank-step, or
    the change of ``step_s`` over ``reporting_ranks``)."""

    steps: int = 0
    samples: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    nonfinite_losses: int = 0
    loss: float | None = None
    version: int = 0
    owner: int | None = None
    """The uid the job id is bound to."""
    slurm_job: str = ""
    """The Slurm job id its ranks' cgroup names (empty: outside Slurm)."""
    ranks: dict[int, Peer] = field(default_factory=dict)
    """rank -> its live connection, where settings go."""
    attached_at: float = 0.0
    """When (on the source's clock) its first connected rank said hello."""
    left_at: float = 0.0
    """When (on the source's clock) the last rank disconnected, or the job became known
    without a rank."""
    alloc_retries: dict[int, int] = field(default_factory=dict)
    """Connected rank -> its process's allocator retries so far (as it last reported)."""
    ooms: dict[int, int] = field(default_factory=dict)
    """Connected rank -> its process's OOMs so far."""
    departed_alloc_retries: int = 0
    """The retries of ranks whose connections closed (a rank that comes back is a new
    process, whose counts start from 0)."""
    departed_ooms: int = 0
    last_step_s: dict[int, float] = field(default_factory=dict)
    """Connected rank -> the step time of its last step (the ranks that reported steps)."""

    @property
    def reporters(self) -> dict[int, Peer]:
        return self.ranks

    @property
    def reporting_ranks(self) -> int:
        """Connected ranks whose steps are counted here: the divisor that turns the sums over
        ranks into the node's step time (``step_s`` / ranks)."""
        return sum(1 for rank in self.ranks if rank in self.last_step_s)

    def rank_step_s(self) -> float | None:
        """The mean over the connected ranks of their last step time: one rank's step time."""
        times = [self.last_step_s[r] for r in self.ranks if r in self.last_step_s]
        return sum(times) / len(times) if times else None

    @property
    def total_alloc_retries(self) -> int:
        return self.departed_alloc_retries + sum(self.alloc_retries.values())

    @property
    def total_ooms(self) -> int:
        return self.departed_ooms + sum(self.ooms.values())

    def leave(self, rank: int) -> None:
        """Forget what ``rank`` alone knew (its connection closed); its counts stay summed."""
        self.ranks.pop(rank, None)
        self.last_step_s.pop(rank, None)
        self.departed_alloc_retries += self.alloc_retries.pop(rank, 0)
        self.departed_ooms += self.ooms.pop(rank, 0)

    def add(self, step: StepReport) -> None:
        self.steps += 1
        self.samples += step.samples
        self.step_s += step.step_s
        self.last_step_s[step.rank] = step.step_s
        self.compute_s += step.compute_s
        self.comm_s += step.comm_s
        if step.loss is not None:
            if math.isfinite(step.loss):
                self.loss = step.loss
            else:
                self.nonfinite_losses += 1
        if step.memory is not None:
            self.alloc_retries[step.rank] = step.memory.alloc_retries
            self.ooms[step.rank] = step.memory.ooms

    def knobs(self) -> tuple[str, ...] | None:
        """The knobs every connected rank applies (None when no rank said)."""
        return protocol.common_knobs(p.knobs for p in self.ranks.values())

    def said(self, field_name: str) -> object:
        """What the connected ranks said of ``field_name`` in their hellos: the lowest rank's
        answer among those that said (None when none did)."""
        for rank in sorted(self.ranks):
            hello = self.ranks[rank].hello
            value = None if hello is None else getattr(hello, field_name)
            if value is not None:
                return value
        return None

    def tune(self) -> bool | None:
        """Whether the job asks to be tuned: False when any connected rank refuses, True when
        one asks, None when none says."""
        said = [p.hello.tune for p in self.ranks.values() if p.hello is not None]
        if False in said:
            return False
        return True if True in said else None

    def describe(self) -> dict[str, object]:
        """What the coordinator needs to find the job (see :class:`~hyperagent.job.Hello`):
        its attached ranks, world size, backend, whether it asks to be tuned, its owner."""
        out: dict[str, object] = {
            "attached": len(self.ranks),
            "rank_ids": sorted(self.ranks),
            "uid": self.owner,
        }
        for key in ("world_size", "local_world_size", "backend", "model_params"):
            value = self.said(key)
            if value is not None:
                out[key] = value
        tune = self.tune()
        if tune is not None:
            out["tune"] = tune
        return out


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
        self._connections: Counter[int] = Counter()
        """uid -> its connections (admitted or waiting for their groups)."""
        self.target = str(socket_path)
        self.policy = policy or PeerPolicy()
        self.groups = groups or GroupCache()
        self.jobs: dict[str, JobTotals] = {}
        self.invalid = 0
        self.refused: Counter[str] = Counter()
        self.listeners: list[StepListener] = []
        self.rank_listeners: list[RankListener] = []
        """Told of every rank whose connection closed (after its state here went)."""
        self.release_listeners: list[JobListener] = []
        """Told of every job released (after its state here went)."""
        self.attach_listeners: list[RankListener] = []
        """Told of every rank that said hello (after it joined its job)."""
        self._names: dict[int, str | None] = {}
        self._naming: set[int] = set()
        self._lookups: set[asyncio.Task[None]] = set()
        self.clock = clock
        self.release_check_s = min(RELEASE_CHECK_S, max(self.policy.release_after_s / 2, 0.05))
        self._releaser: asyncio.Task[None] | None = None
        self._dead = asyncio.Event()
        """Set when a job may have no rank connected (no wake-ups while every job is live)."""
        self.peers: dict[int, Peer] = {}
        """fd -> connected peer."""
        self._authorising: dict[int, tuple[Peer, asyncio.Task[None]]] = {}
        """fd -> a connecting peer and the group lookup it waits for."""
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
        self._last_settings: dict[str, JobSettings] = {}
        self._logged: set[str] = set()

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
                self._refuse_takeover(path)
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
        self._releaser = asyncio.create_task(self._release_loop(), name="job-release")
        self._batcher = asyncio.create_task(self._batch_loop(), name="job-batches")

    async def _release_loop(self) -> None:
        while True:
            if all(t.ranks for t in self.jobs.values()):
                self._dead.clear()
                await self._dead.wait()
            await asyncio.sleep(self.release_check_s)
            self.release_due()

    @staticmethod
    def _refuse_takeover(path: Path) -> None:
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
            crowded = self._crowded(uid)
            if crowded is not None:
                self._refuse(peer, "too_many_connections", crowded)
                continue
            self._connections[uid] += 1
            peer.counted = True
            if allowed:
                self._admit(peer)
            else:
                fd = conn.fileno()
                task = asyncio.create_task(self._authorise(peer, fd), name=f"job-peer-{pid}")
                self._authorising[fd] = (peer, task)

    def _crowded(self, uid: int) -> str | None:
        """Why one more connection of ``uid`` is one too many, or None. Ranks that said hello
        are bounded per job; these bound the ones that did not, in all and per user."""
        connected = len(self.peers) + len(self._authorising)
        if connected >= 2 * self.policy.max_jobs * self.policy.max_ranks:
            return f"{connected} connected"
        mine = self._connections[uid]
        if mine >= self.policy.max_connections_per_user:
            return f"uid {uid} holds {mine} connections (max_connections_per_user)"
        return None

    async def _authorise(self, peer: Peer, fd: int) -> None:
        """Admit or refuse ``peer`` once its user's groups are known (off the event loop)."""
        try:
            groups = await self.groups.groups(peer.uid)
        except Exception as e:  # NSS failing: refused, and the next connection asks again
            self._warn_once("nss", "job channel: looking up the groups of uid %d: %s", peer.uid, e)
            groups = None
        finally:
            self._authorising.pop(fd, None)
        if self.policy.admits_member(groups):
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
        if peer.counted:
            peer.counted = False
            self._connections[peer.uid] -= 1
            if self._connections[peer.uid] <= 0:
                del self._connections[peer.uid]
        fd = peer.conn.fileno()
        if fd >= 0 and self.peers.get(fd) is peer:
            del self.peers[fd]
            for poller in (self._poller, self._waiting):
                if poller is not None:
                    with contextlib.suppress(OSError, ValueError):
                        poller.unregister(fd)
        peer.conn.close()
        if peer.job is not None:
            totals = self.jobs.get(peer.job)
            if totals is not None and totals.ranks.get(peer.rank) is peer:
                totals.leave(peer.rank)
                if not totals.ranks:
                    totals.left_at = self.clock()
                    self._dead.set()
                for listener in self.rank_listeners:
                    listener(peer.job, peer.rank)

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
        totals = self.jobs.get(job)
        if totals is not None and self._due(totals):
            self.release(job)
            totals = None
        if totals is None:
            held = self._live_jobs_of(peer.uid)
            if held >= self.policy.max_jobs_per_user:
                detail = f"uid {peer.uid} holds {held} live jobs (max_jobs_per_user)"
                self._refuse(peer, "too_many_jobs", detail)
                return
            live = self._make_room()
            if live:
                self._refuse(peer, "too_many_jobs", _live_jobs(live, self.policy.max_jobs))
                return
            totals = self._new_job(job)
        if slurm_job:
            totals.slurm_job = slurm_job
        if totals.owner is None:
            totals.owner = peer.uid
        elif totals.owner != peer.uid:
            self._refuse(peer, "job_claimed", f"job {job} belongs to uid {totals.owner}")
            return
        if rank not in totals.ranks and len(totals.ranks) >= self.policy.max_ranks:
            self._refuse(peer, "too_many_ranks", f"job {job} has {len(totals.ranks)} ranks")
            return
        previous = totals.ranks.get(rank)
        if previous is not None and previous is not peer:
            self._drop(previous)  # the rank restarted; its new connection replaces the old
        peer.job, peer.rank, peer.hello = job, rank, hello
        if not totals.ranks:
            totals.attached_at = self.clock()
        totals.ranks[rank] = peer
        known = self._last_settings.get(job)
        if known is not None:
            self._send(peer, job, known)
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

    def _live_jobs_of(self, uid: int) -> int:
        return sum(1 for t in self.jobs.values() if t.owner == uid and t.ranks)

    # -- jobs' lifetime ------------------------------------------------------------------

    def _due(self, totals: JobTotals) -> bool:
        return not totals.ranks and self.clock() - totals.left_at >= self.policy.release_after_s

    def _new_job(self, job: str) -> JobTotals:
        totals = self.jobs[job] = JobTotals(left_at=self.clock())
        self._dead.set()  # until its first rank says hello
        return totals

    def _make_room(self) -> list[str]:
        """Release dead jobs, oldest first, until a new job fits under ``max_jobs``; returns
        the live jobs that fill the bound (empty when it fits)."""
        self.release_due()
        dead = sorted((t.left_at, j) for j, t in self.jobs.items() if not t.ranks)
        while len(self.jobs) >= self.policy.max_jobs and dead:
            self.release(dead.pop(0)[1])
        if len(self.jobs) < self.policy.max_jobs:
            return []
        return [j for j, t in self.jobs.items() if t.ranks]

    def release_due(self) -> list[str]:
        """Release every job whose last rank left ``release_after_s`` ago or more; returns
        them (the source does this itself every ``release_check_s``)."""
        due = [job for job, totals in self.jobs.items() if self._due(totals)]
        for job in due:
            self.release(job)
        return due

    def release(self, job: str) -> None:
        """Forget ``job`` (none of its ranks may be connected): its totals, its owner, its
        remembered settings and so its series."""
        totals = self.jobs.pop(job, None)
        self._last_settings.pop(job, None)
        if totals is None:
            return
        assert not totals.ranks, f"job {job} released with ranks connected"
        for listener in self.release_listeners:
            listener(job)

    # -- settings out --------------------------------------------------------------------

    def attached(self, job: str) -> int:
        """How many ranks of ``job`` are connected."""
        totals = self.jobs.get(job)
        return len(totals.ranks) if totals else 0

    def send_settings(self, job: str, settings: JobSettings) -> int:
        """Hand settings to every connected rank of ``job``; returns how many received them.

        The latest settings are remembered and handed to ranks that attach later.
        """
        self._last_settings[job] = settings
        totals = self.jobs.get(job)
        if totals is None:
            self._make_room()  # settings for a job not here yet do not displace a live one
            totals = self._new_job(job)
        totals.version = settings.version
        return sum(self._send(peer, job, settings) for peer in list(totals.ranks.values()))

    def _send(self, peer: Peer, job: str, settings: JobSettings) -> bool:
        """Settings of ``job`` to ``peer``, under the id the rank itself gave."""
        said = job if peer.hello is None else peer.hello.job
        try:
            peer.conn.send(protocol.encode_settings(said, settings))
        except OSError as e:
            log.warning(
                "settings v%d for %s not delivered to rank %d (pid %d): %s",
                settings.version,
                job,
                peer.rank,
                peer.pid,
                e,
            )
            return False
        return True

    def user_name(self, uid: int | None) -> str | None:
        """The name of ``uid`` from the user database, once a lookup in a thread found it
        (None until then, and for a uid the database does not know)."""
        if uid is None:
            return None
        if uid in self._names:
            return self._names[uid]
        if uid not in self._naming and len(self._names) < NSS_CACHED_USERS:
            self._naming.add(uid)
            task = asyncio.get_running_loop().create_task(self._look_up_name(uid))
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)
        return None

    async def _look_up_name(self, uid: int) -> None:
        try:
            entry = await asyncio.to_thread(pwd.getpwuid, uid)
            self._names[uid] = entry.pw_name
        except (KeyError, OSError):
            self._names[uid] = None
        finally:
            self._naming.discard(uid)

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
        for job, t in self.jobs.items():
            labels = {"job_id": job}
            out += [
                Reading("hyperagent_job_steps_total", t.steps, labels, Kind.COUNTER),
                Reading("hyperagent_job_samples_total", t.samples, labels, Kind.COUNTER),
                Reading("hyperagent_job_step_seconds_total", t.step_s, labels, Kind.COUNTER, "s"),
                Reading("hyperagent_job_compute_seconds_total", t.compute_s, labels, Kind.COUNTER),
                Reading(
                    "hyperagent_job_communication_seconds_total", t.comm_s, labels, Kind.COUNTER
                ),
                Reading(
                    "hyperagent_job_nonfinite_loss_total", t.nonfinite_losses, labels, Kind.COUNTER
                ),
                Reading("hyperagent_job_settings_version", t.version, labels),
                Reading("hyperagent_job_ranks", len(t.ranks), labels),
                Reading("hyperagent_job_reporting_ranks", t.reporting_ranks, labels),
            ]
            rank_step_s = t.rank_step_s()
            if rank_step_s is not None:
                out.append(Reading("hyperagent_job_rank_step_seconds", rank_step_s, labels))
            if t.loss is not None:
                out.append(Reading("hyperagent_job_loss", t.loss, labels))
            memory = [p.memory for p in t.ranks.values() if p.memory is not None]
            if memory:
                out.append(
                    Reading(
                        "hyperagent_job_gpu_memory_allocated_ratio",
                        max(m.allocated_ratio for m in memory),
                        labels,
                    )
                )
            out += [  # from 0, so that increase() sees a job's first retry or OOM
                Reading(
                    "hyperagent_job_alloc_retries_total",
                    t.total_alloc_retries,
                    labels,
                    Kind.COUNTER,
                ),
                Reading("hyperagent_job_oom_total", t.total_ooms, labels, Kind.COUNTER),
            ]
        return out

    async def close(self) -> None:
        for task in (self._releaser, self._batcher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._releaser = self._batcher = None
        waiting = list(self._authorising.values())
        self._authorising.clear()
        for peer, task in waiting:
            task.cancel()
            peer.conn.close()
        await asyncio.gather(*(task for _, task in waiting), return_exceptions=True)
        await self.groups.close()
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


def _sent_at(ancillary: list[tuple[int, int, bytes]]) -> float | None:
    """The monotonic time a packet was sent, from its SO_TIMESTAMP (None without one)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMP and len(data) >= _TIMEVAL.size:
            seconds, micros = _TIMEVAL.unpack_from(data)
            return time.monotonic() - (time.time() - seconds - micros / 1e6)
    return None


def _live_jobs(live: list[str], bound: int) -> str:
    """A ``too_many_jobs`` refusal's detail: the live jobs that fill the bound."""
    named = ", ".join(sorted(live)[:REFUSAL_NAMES])
    more = f" and {len(live) - REFUSAL_NAMES} more" if len(live) > REFUSAL_NAMES else ""
    return f"all {bound} job slots (max_jobs) are held by live jobs: {named}{more}"

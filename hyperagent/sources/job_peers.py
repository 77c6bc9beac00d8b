"""Who may use the job channel, and who each connection is: the policy (the agent's own user,
``allowed_users``, members of ``allowed_groups``), the users' groups and names from the user
database (NSS, which may ask LDAP or SSSD: looked up in a thread, kept ``NSS_CACHE_S`` per uid),
the bounds on connections per user and in all (``Admission``), and a connected rank (``Peer``)
with the settings it is handed."""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import pwd
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hyperagent import job as protocol
from hyperagent.job import JobSettings

log = logging.getLogger(__name__)

NSS_CACHE_S = 60.0
"""How long a user's group memberships, once looked up, answer for that uid."""

NSS_CACHED_USERS = 1024
"""Users whose memberships are kept at most (expired ones are forgotten first)."""


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

    def send_settings(self, job: str, settings: JobSettings) -> bool:
        """Settings of ``job`` to this rank, under the id the rank itself gave; whether they
        went."""
        said = job if self.hello is None else self.hello.job
        try:
            self.conn.send(protocol.encode_settings(said, settings))
        except OSError as e:
            log.warning(
                "settings v%d for %s not delivered to rank %d (pid %d): %s",
                settings.version,
                job,
                self.rank,
                self.pid,
                e,
            )
            return False
        return True


class UserNames:
    """Users' names from the user database, each looked up once in a thread."""

    def __init__(self) -> None:
        self._names: dict[int, str | None] = {}
        self._naming: set[int] = set()
        self._lookups: set[asyncio.Task[None]] = set()

    def name(self, uid: int | None) -> str | None:
        """The name of ``uid``, once a lookup in a thread found it (None until then, and for a
        uid the database does not know)."""
        if uid is None:
            return None
        if uid in self._names:
            return self._names[uid]
        if uid not in self._naming and len(self._names) < NSS_CACHED_USERS:
            self._naming.add(uid)
            task = asyncio.get_running_loop().create_task(self._look_up(uid))
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)
        return None

    async def _look_up(self, uid: int) -> None:
        try:
            entry = await asyncio.to_thread(pwd.getpwuid, uid)
            self._names[uid] = entry.pw_name
        except (KeyError, OSError):
            self._names[uid] = None
        finally:
            self._naming.discard(uid)


Warn = Callable[..., None]
"""(key, message, *args): log a problem the first time its key comes."""


class Admission:
    """Who may connect, and how many: the policy's answer, the user's groups where it depends
    on them, and the bounds on connections; owns each user's count of connections and the
    connections waiting for their user's groups."""

    def __init__(self, policy: PeerPolicy, groups: GroupCache, warn: Warn) -> None:
        self.policy = policy
        self.groups = groups
        self.warn = warn
        self.connections: Counter[int] = Counter()
        """uid -> its connections (admitted or waiting for their groups)."""
        self.authorising: dict[int, tuple[Peer, asyncio.Task[None]]] = {}
        """fd -> a connecting peer and the group lookup it waits for."""

    def crowded(self, uid: int, peers: int) -> str | None:
        """Why one more connection of ``uid`` is one too many beside ``peers`` admitted, or
        None. Ranks that said hello are bounded per job; these bound the ones that did not, in
        all and per user."""
        connected = peers + len(self.authorising)
        if connected >= 2 * self.policy.max_jobs * self.policy.max_ranks:
            return f"{connected} connected"
        mine = self.connections[uid]
        if mine >= self.policy.max_connections_per_user:
            return f"uid {uid} holds {mine} connections (max_connections_per_user)"
        return None

    def count(self, peer: Peer) -> None:
        """``peer`` holds one of its user's connections."""
        self.connections[peer.uid] += 1
        peer.counted = True

    def uncount(self, peer: Peer) -> None:
        """``peer``'s connection closed: its user holds one connection less."""
        if peer.counted:
            peer.counted = False
            self.connections[peer.uid] -= 1
            if self.connections[peer.uid] <= 0:
                del self.connections[peer.uid]

    async def member(self, peer: Peer) -> bool:
        """Whether ``peer``'s user is a member of an allowed group (its groups looked up off
        the event loop; a lookup that fails refuses it, and the next connection asks again)."""
        try:
            groups = await self.groups.groups(peer.uid)
        except Exception as e:  # NSS failing: refused, and the next connection asks again
            self.warn("nss", "job channel: looking up the groups of uid %d: %s", peer.uid, e)
            groups = None
        return self.policy.admits_member(groups)

    async def close(self) -> None:
        """Stop the lookups in flight; the connections waiting for them close."""
        waiting = list(self.authorising.values())
        self.authorising.clear()
        for peer, task in waiting:
            task.cancel()
            peer.conn.close()
        await asyncio.gather(*(task for _, task in waiting), return_exceptions=True)
        await self.groups.close()

"""Which of a job's nodes count in its scores, as a pure state machine.

A node is in (its measurements are scored) or out for a reason, and each reason has its own
way back:

    in --Offline------------------> out "offline"          back: Online
    in --Silent (no ack)----------> out "silent"           back: Answered (ack, report, steps)
    in --Unmeasured (no report)---> out "no measurement"   back: Answered
    in --Stalled (its job stopped)> out "stalled"          back: Answered
    any --Left (its ranks left)---> out "left"             back: Rejoined (ranks attached)
    (offline wins over left: the agent is gone, and its ranks with it; a node back online
    whose ranks are still gone is out "left" again on the next sighting)

:func:`step` returns the new membership and the changes it made (for the log line each).
Scores stay comparable while nodes are out: the nodes in are scaled to the job's node count.
While fewer than half the nodes are in, the job has no quorum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

READMIT = frozenset({"silent", "no measurement", "stalled"})
"""Reasons an answer from the node (its ack, report or steps) ends."""


@dataclass(frozen=True)
class Offline:
    node: str


@dataclass(frozen=True)
class Online:
    node: str


@dataclass(frozen=True)
class Answered:
    """The node answered: ``how`` ("its ack", "its report", "its job steps")."""

    node: str
    how: str


@dataclass(frozen=True)
class Silent:
    """These nodes did not ack the version in play."""

    nodes: tuple[str, ...]
    version: int


@dataclass(frozen=True)
class Unmeasured:
    """These nodes did not measure the version in play (``why``)."""

    nodes: tuple[str, ...]
    version: int
    why: str = "no measurement"


@dataclass(frozen=True)
class Stalled:
    """The node's job stopped stepping while its agent is online."""

    node: str
    version: int


@dataclass(frozen=True)
class Left:
    """The job's ranks on the node all left."""

    node: str


@dataclass(frozen=True)
class Rejoined:
    """Ranks of the job are attached on the node again."""

    node: str


Event = Offline | Online | Answered | Silent | Unmeasured | Stalled | Left | Rejoined


@dataclass(frozen=True)
class Change:
    """``node`` went from ``before`` to ``after`` (None: in), because of ``why``."""

    node: str
    before: str | None
    after: str | None
    why: str


@dataclass(frozen=True)
class Membership:
    """The job's nodes and the reason each node that is out is out."""

    nodes: tuple[str, ...]
    out_items: tuple[tuple[str, str], ...] = ()
    _out: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_out", dict(self.out_items))

    @classmethod
    def of(cls, nodes: Iterable[str], out: Mapping[str, str] | None = None) -> Membership:
        nodes = tuple(nodes)
        return cls(nodes, tuple(sorted((n, r) for n, r in (out or {}).items() if n in nodes)))

    @property
    def out(self) -> Mapping[str, str]:
        """node -> why it is out."""
        return self._out

    @property
    def active(self) -> tuple[str, ...]:
        """The nodes in, in the job's order."""
        return tuple(n for n in self.nodes if n not in self._out)

    def quorum(self) -> bool:
        """At least half the nodes (and one) are in."""
        active = len(self.active)
        return active > 0 and 2 * active >= len(self.nodes)

    def _with(self, out: dict[str, str]) -> Membership:
        return Membership.of(self.nodes, out)


def step(membership: Membership, event: Event) -> tuple[Membership, list[Change]]:
    """The membership after ``event`` and what changed; events about nodes the job does not
    have change nothing."""
    out = dict(membership.out)
    changes: list[Change] = []

    def put(node: str, reason: str | None, why: str) -> None:
        if node not in membership.nodes or out.get(node) == reason:
            return
        changes.append(Change(node, out.get(node), reason, why))
        if reason is None:
            out.pop(node, None)
        else:
            out[node] = reason

    if isinstance(event, Offline):
        put(event.node, "offline", "its status says offline")
    elif isinstance(event, Online):
        if out.get(event.node) == "offline":
            put(event.node, None, "its status says online")
    elif isinstance(event, Answered):
        if out.get(event.node) in READMIT:
            put(event.node, None, event.how)
    elif isinstance(event, Silent):
        for node in event.nodes:
            if node not in out:
                put(node, "silent", f"no ack of v{event.version}")
    elif isinstance(event, Unmeasured):
        for node in event.nodes:
            if node not in out:
                put(node, "no measurement", f"{event.why} of v{event.version}")
    elif isinstance(event, Stalled):
        if out.get(event.node) not in ("offline", "left"):
            put(event.node, "stalled", f"its job stopped stepping during v{event.version}")
    elif isinstance(event, Left):
        if out.get(event.node) != "offline":
            put(event.node, "left", "its ranks left the job")
    elif isinstance(event, Rejoined):
        if out.get(event.node) == "left":
            put(event.node, None, "ranks of the job attached again")
    if not changes:
        return membership, []
    return membership._with(out), changes

"""Jobs found, not configured: what the agents say they carry, who may be tuned, and the space
a found job is tuned in.

Every agent's telemetry says, per job on its node, what the job's ranks said when they attached
(world size, backend, knobs, whether they ask to be tuned), which ranks are attached, the job's
owner and GPUs, and the node's actuation bounds. :class:`Registry` keeps the latest of each
node's sightings and answers, per job, :class:`JobView`: its nodes, whether its world is
complete, what is missing. :func:`admission` applies the coordinator's policy;
:func:`plan_space` intersects the job's search space with what every node can apply. Pure:
time comes in as arguments.

A job has one owner across the cluster: the uid the scheduler names (an agent asks Slurm about
a job its ranks' cgroup names, and says what it answered), else the uid its id is bound to
(``u<uid>-<id>``, see :mod:`hyperagent.sources.job_identity`), else the uid of the first
node's sighting. A node that carries the id under another uid, or that the scheduler does not
list among the job's nodes, is not part of the job: its ranks count for nothing (world size,
attached ranks, opt-in and opt-out), and the job's rounds leave it out.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hyperagent.config import CoordinatorSection, JobTuningSection
from hyperagent.job import ANNOUNCEABLE, BACKENDS, common_knobs
from hyperagent.scheduler import owner_of
from hyperagent.tuner.space import SearchSpace

STALE_AFTER_S = 30.0
"""A node's sighting of a job older than this (its telemetry stopped) no longer counts its
ranks as attached."""

MISSING_NAMED = 16
"""Missing ranks named at most in a message (the rest are counted)."""


@dataclass(frozen=True, slots=True)
class Sighting:
    """One node's latest word on one job."""

    node: str
    seen: float = field(compare=False)
    """When the node said it (not part of what it said: equal sightings say the same)."""
    attached: int = 0
    rank_ids: tuple[int, ...] = ()
    world_size: int | None = None
    local_world_size: int | None = None
    uid: int | None = None
    user: str | None = None
    backend: str | None = None
    tune: bool | None = None
    model_params: int | None = None
    knobs: tuple[str, ...] | None = None
    gpus: tuple[int, ...] = ()
    separable: bool = True
    """The job's GPUs on the node can be told from another job's (or it is alone there)."""
    gpus_pending: bool = False
    """Its ranks attached so recently that the node does not know their GPUs yet."""
    scheduler_uid: int | None = None
    """The job's user as its scheduler names it (None: not asked, or no answer)."""
    scheduler_nodes: tuple[str, ...] | None = None
    """The job's nodes as its scheduler lists them."""


@dataclass(frozen=True, slots=True)
class NodeBounds:
    """What a node's agent can apply: whether it caps power, its own bounds, the GPUs' range."""

    power_cap: bool = False
    min_w: float | None = None
    max_w: float | None = None
    limits_w: tuple[float, float] | None = None
    gpu_model: str | None = None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def sighting(node: str, seen: float, entry: Mapping[str, Any]) -> Sighting:
    """A node's telemetry entry for one job as a Sighting (fields of the wrong type are
    taken as not said)."""
    ranks = entry.get("rank_ids")
    rank_ids = tuple(r for r in ranks if _int(r) is not None) if isinstance(ranks, list) else ()
    knobs = entry.get("knobs")
    announced = tuple(k for k in knobs if k in ANNOUNCEABLE) if isinstance(knobs, list) else None
    gpus = entry.get("gpus")
    backend = entry.get("backend")
    tune = entry.get("tune")
    user = entry.get("user")
    attached = _int(entry.get("attached"))
    scheduler = entry.get("scheduler")
    scheduler_uid, scheduler_nodes = None, None
    if isinstance(scheduler, Mapping):
        scheduler_uid = _int(scheduler.get("uid"))
        listed = scheduler.get("nodes")
        if isinstance(listed, list) and all(isinstance(n, str) for n in listed):
            scheduler_nodes = tuple(listed)
    return Sighting(
        node,
        seen,
        attached if attached is not None else (_int(entry.get("ranks")) or 0),
        rank_ids,
        _int(entry.get("world_size")) or None,
        _int(entry.get("local_world_size")) or None,
        _int(entry.get("uid")),
        user if isinstance(user, str) else None,
        backend if backend in BACKENDS else None,
        tune if isinstance(tune, bool) else None,
        _int(entry.get("model_params")) or None,
        announced,
        tuple(g for g in gpus if _int(g) is not None) if isinstance(gpus, list) else (),
        entry.get("gpus_separable") is not False,
        entry.get("gpus_pending") is True,
        scheduler_uid,
        scheduler_nodes,
    )


def node_bounds(payload: Any) -> NodeBounds:
    """A telemetry payload's ``actuation`` object as NodeBounds."""
    if not isinstance(payload, Mapping):
        return NodeBounds()
    limits = payload.get("limits_w")
    pair = None
    if isinstance(limits, list) and len(limits) == 2:
        low, high = _float(limits[0]), _float(limits[1])
        if low is not None and high is not None and 0 < low <= high:
            pair = (low, high)
    model = payload.get("gpu_model")
    return NodeBounds(
        payload.get("power_cap") is True,
        _float(payload.get("min_w")),
        _float(payload.get("max_w")),
        pair,
        model if isinstance(model, str) else None,
    )


@dataclass(frozen=True)
class JobView:
    """A job as the agents see it now."""

    job: str
    nodes: tuple[str, ...]
    """The nodes with ranks of the job attached (in name order)."""
    attached: int
    world_size: int | None
    missing: str
    """Which ranks (or configured nodes) are not attached; empty when none."""
    sightings: Mapping[str, Sighting]
    bounds: Mapping[str, NodeBounds]
    foreign: Mapping[str, int] = field(default_factory=dict)
    """Nodes that carry the job's id under another uid than its owner's -> that uid (not part
    of the job)."""

    @property
    def complete(self) -> bool:
        """Every rank of the world size is attached (when the ranks did not say their world
        size: some rank is attached)."""
        return self.attached > 0 and not self.missing

    def said(self, field_name: str) -> Any:
        """What the nodes' sightings say of ``field_name`` (the first node that says)."""
        for node in self.nodes:
            value = getattr(self.sightings[node], field_name)
            if value is not None:
                return value
        return None

    @property
    def tune(self) -> bool | None:
        """False when any node's ranks refuse tuning, True when some ask, else None."""
        said = [self.sightings[n].tune for n in self.nodes]
        if False in said:
            return False
        return True if True in said else None

    @property
    def knobs(self) -> tuple[str, ...] | None:
        return common_knobs(self.sightings[n].knobs for n in self.nodes)

    def details(self) -> dict[str, Any]:
        """What the ranks said that the job's tuning takes where the config is silent."""
        params = self.said("model_params")
        models = [self.bounds[n].gpu_model for n in self.nodes if n in self.bounds]
        return {
            "backend": self.said("backend"),
            "model_params_b": round(params / 1e9, 3) if params else None,
            "gpu_model": next((m for m in models if m), None),
            "power_limits_w": self.power_limits_w,
        }

    @property
    def power_limits_w(self) -> tuple[float, float] | None:
        """The power limits every node's GPUs take (their ranges intersected); None when a
        node does not say or the ranges do not meet."""
        limits = [self.bounds[n].limits_w if n in self.bounds else None for n in self.nodes]
        if not limits or None in limits:
            return None
        low = max(pair[0] for pair in limits if pair)
        high = min(pair[1] for pair in limits if pair)
        return (low, high) if low <= high else None


class Registry:
    """The latest sighting of every job on every node, and each node's bounds."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self.jobs: dict[str, dict[str, Sighting]] = {}
        self.owners: dict[str, int] = {}
        """job -> the uid that owns it (see the module doc), while a node carries it."""
        self.scheduled: dict[str, frozenset[str]] = {}
        """job -> its nodes as the scheduler lists them (first answer), while a node carries
        it."""
        self.bounds: dict[str, NodeBounds] = {}
        self._on_node: dict[str, set[str]] = {}

    def observe(
        self,
        node: str,
        now: float,
        entries: Mapping[str, Mapping[str, Any]],
        bounds: NodeBounds | None = None,
    ) -> list[str]:
        """Take one node's telemetry: its jobs and bounds. Returns the jobs whose picture
        changed (new here, attached ranks changed, or gone from the node)."""
        if bounds is not None:
            self.bounds[node] = bounds
        changed = []
        carried = self._on_node.setdefault(node, set())
        for job, entry in entries.items():
            if not isinstance(entry, Mapping):
                continue
            new = sighting(node, now, entry)
            if new.scheduler_uid is not None and job not in self.scheduled:
                self.owners[job] = new.scheduler_uid
                self.scheduled[job] = frozenset(new.scheduler_nodes or ())
            if job not in self.owners:
                owner = owner_of(job)
                if owner is None and new.attached > 0:
                    owner = new.uid
                if owner is not None:
                    self.owners[job] = owner
            seen = self.jobs.setdefault(job, {})
            old = seen.get(node)
            seen[node] = new
            carried.add(job)
            if old != new:
                changed.append(job)
        for job in carried - set(entries):
            carried.discard(job)
            seen = self.jobs.get(job, {})
            if seen.pop(node, None) is not None:
                changed.append(job)
            if not seen:
                self.jobs.pop(job, None)
                self.owners.pop(job, None)
                self.scheduled.pop(job, None)
        return changed

    def forget_node(self, node: str) -> list[str]:
        """The node is gone (offline): its sightings no longer count; returns their jobs."""
        return self.observe(node, 0.0, {})

    def view(
        self, job: str, now: float, nodes: Iterable[str] = (), why: str = "configured"
    ) -> JobView:
        """``job`` as seen now; ``nodes`` (a node set, ``why`` says whose: configured, or
        the journal's round) must all carry it."""
        seen: dict[str, Sighting] = {}
        foreign: dict[str, int] = {}
        for n, s in self.jobs.get(job, {}).items():
            if s.attached == 0 or now - s.seen > self.stale_after_s:
                continue
            if self._foreign(job, n, s):
                foreign[n] = s.uid if s.uid is not None else -1
            else:
                seen[n] = s
        attached = sum(s.attached for s in seen.values())
        world = max((s.world_size for s in seen.values() if s.world_size), default=None)
        missing = ""
        absent = [n for n in nodes if n not in seen]
        if absent:
            missing = f"nodes {', '.join(absent)} ({why}) carry no rank"
        elif world is not None and attached < world:
            missing = _missing_ranks(seen.values(), attached, world)
        pending = sorted(n for n, s in seen.items() if s.gpus_pending)
        if not missing and pending:
            missing = f"the GPUs of its ranks on {', '.join(pending)} (not known there yet)"
        ordered = tuple(sorted(seen))
        return JobView(
            job,
            ordered,
            attached,
            world,
            missing,
            seen,
            {n: self.bounds[n] for n in ordered if n in self.bounds},
            foreign,
        )

    def live(self, job: str, now: float) -> bool:
        """Some node has ranks of ``job``'s owner attached (by a fresh sighting)."""
        return any(
            s.attached > 0 and now - s.seen <= self.stale_after_s and not self._foreign(job, n, s)
            for n, s in self.jobs.get(job, {}).items()
        )

    def _foreign(self, job: str, node: str, seen: Sighting) -> bool:
        """``node``'s sighting is not of ``job``: another uid than its owner's, or a node the
        scheduler does not list as the job's."""
        owner = self.owners.get(job)
        if owner is not None and seen.uid is not None and seen.uid != owner:
            return True
        listed = self.scheduled.get(job)
        return listed is not None and bool(listed) and node not in listed


def _missing_ranks(seen: Iterable[Sighting], attached: int, world: int) -> str:
    """Which ranks of ``world`` are not attached: the first ``MISSING_NAMED`` by id where the
    sightings' rank ids account for every attached rank, else how many (without building the
    world's ids: a world of 100,000 ranks is named as fast as one of 8)."""
    ids = {r for s in seen for r in s.rank_ids if 0 <= r < world}
    absent = world - len(ids)
    if absent != world - attached or absent <= 0:
        return f"{world - attached} of {world} ranks"
    first = list(itertools.islice((r for r in range(world) if r not in ids), MISSING_NAMED))
    named = ", ".join(map(str, first))
    more = f" and {absent - MISSING_NAMED} more" if absent > MISSING_NAMED else ""
    return f"ranks {named}{more} ({attached} of {world} attached)"


def admission(coordinator: CoordinatorSection, view: JobView) -> str | None:
    """Why the policy does not tune ``view``'s job, or None when it does."""
    policy = coordinator.tune_policy(view.job)
    if policy == "never":
        return 'the policy tunes no job (tune = "never")'
    if policy == "asked" and view.tune is not True:
        return 'its ranks did not ask to be tuned (tune = "asked")'
    if view.tune is False:
        return "its ranks asked not to be tuned"
    users = coordinator.users_for(view.job)
    user, uid = view.said("user"), view.said("uid")
    if users and user not in users and uid not in users:
        if user is None and uid is not None:
            return f"its user's name (uid {uid}) is not known yet"
        return f"its user ({user or uid}) is not one of coordinator.defaults.users"
    return None


@dataclass(frozen=True)
class SpacePlan:
    """The space a job is tuned in, what narrowed it (one line each) or why none is left."""

    space: SearchSpace | None
    notes: tuple[str, ...] = ()
    failure: str | None = None


def plan_space(cfg: JobTuningSection, view: JobView | None = None) -> SpacePlan:
    """The job's space (:func:`job_space`), narrowed to the knobs its ranks announced and to
    the power caps every node can apply: a node that cannot cap, knows no GPU of the job, or
    cannot tell the job's GPUs from another job's, leaves the power cap out; each node's
    bounds and its GPUs' range narrow it (a note each), and a node where none of the job's
    caps is inside them leaves the power cap out too (a cap is never outside either)."""
    space = job_space(cfg)
    notes: list[str] = []
    if view is None:
        return SpacePlan(space)
    knobs = view.knobs
    if knobs is not None:
        start = space.snap(cfg.start.model_dump())
        space = space.announced(knobs, start)
    if not space.power_cap_w:
        return SpacePlan(space, tuple(notes))
    bounds = view.bounds
    why_not = []
    for node in view.nodes:
        if node in bounds and not bounds[node].power_cap:
            why_not.append(f"{node} does not cap power (actuation.power_cap = false)")
        if not view.sightings[node].gpus:
            why_not.append(f"{node} knows no GPU of this job")
        elif not view.sightings[node].separable:
            why_not.append(f"{node} cannot tell this job's GPUs from another job's")
    if why_not:
        notes.append("the power cap is not tuned: " + "; ".join(why_not))
        return SpacePlan(dataclasses.replace(space, power_cap_w=()), tuple(notes))
    caps = list(space.power_cap_w)
    for node in view.nodes:
        b = bounds.get(node)
        if b is None:
            continue
        low = max(x for x in (b.min_w, b.limits_w[0] if b.limits_w else None, 0.0) if x is not None)
        high = min(
            x
            for x in (b.max_w, b.limits_w[1] if b.limits_w else None, float("inf"))
            if x is not None
        )
        kept = [c for c in caps if low <= c <= high]
        if len(kept) < len(caps):
            shown = f"[{low:g}, {high:g}] W" if high != float("inf") else f"at least {low:g} W"
            held = _held_cap(caps, low, high, cfg.power_limits_w)
            if held is not None:
                kept = [held]
                notes.append(f"node {node} applies power caps in {shown}: holding {held} W")
            elif not kept:
                notes.append(
                    f"the power cap is not tuned: no cap of {caps[0]:g}-{caps[-1]:g} W is "
                    f"inside node {node}'s {shown}"
                )
                return SpacePlan(dataclasses.replace(space, power_cap_w=()), tuple(notes))
            else:
                notes.append(
                    f"node {node} applies power caps in {shown}: "
                    f"searching {kept[0]:g}-{kept[-1]:g} W"
                )
        caps = kept
    return SpacePlan(dataclasses.replace(space, power_cap_w=tuple(caps)), tuple(notes))


def _held_cap(
    caps: Sequence[float], low: float, high: float, limits: tuple[float, float] | None
) -> int | None:
    """The one cap a job that holds a single cap (it is not searched) holds on a node whose
    range [low, high] leaves it out: the nearest inside that range, where it is inside the
    job's ``power_limits_w`` too; None otherwise (also for a searched cap)."""
    if len(caps) != 1 or low > high or low <= caps[0] <= high:
        return None
    held = math.floor(high) if caps[0] > high else math.ceil(low)
    if limits is not None and not limits[0] <= held <= limits[1]:
        return None
    return held if low <= held <= high else None


def job_space(cfg: JobTuningSection) -> SearchSpace:
    """The space a job's tuning searches before its ranks' knobs and its nodes' bounds."""
    full = SearchSpace.default(
        cfg.backend, len(cfg.nodes), cfg.power_limits_w, gradient_dtype=cfg.gradient_dtype
    )
    return full.for_objective(cfg.objective, cfg.power_budget_w, cfg.search_power_cap)


def fingerprint(cfg: JobTuningSection) -> str:
    """What makes two tunings comparable: backend, node count, model size, GPU model."""
    return f"{cfg.backend}/{len(cfg.nodes)}n/{cfg.model_params_b or '?'}B/{cfg.gpu_model or '?'}"

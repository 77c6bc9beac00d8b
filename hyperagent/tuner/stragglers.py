"""Stragglers across a job's nodes: which rank, GPU and node (or which node's link) hold a
synchronous job back, and why. Pure: the caller feeds step reports, node evidence and its
clock; nothing here does I/O.

In synchronous data parallel every rank waits for the slowest at each collective, so a rank's
*own time* per step (compute plus the idle gap before its step started) is the part it
controls, and what it loses the others wait for in communication: the straggler computes
longer (or starts late) while the others wait. Each rank is compared with the job's others:

- each of its reports is divided by the median of all ranks' reports of the same moment (the
  k-th latest report of every rank covers the same time in a synchronous job), so what slows
  every rank alike (a checkpoint, a settings change, congestion) drops out;
- its level is a low quantile (``quantile``) of those over about ``window_s`` (at least
  ``min_samples`` reports): most of the window must be slow, so a stall shorter than the
  window is not a level and hiccups do not move it;
- the job's reference is the lower median of the levels (with 2 ranks, the faster), each
  rank's usual excess over it is learnt and subtracted (within ``offset_cap``), and the noise
  of a comparison is the spread between the ranks' levels or the rank's own, where larger;
- a rank whose excess is ``slower`` and ``z`` times the noise, while the others wait for it,
  is a suspect; a suspect for ``confirm_s`` is a straggler, kept down to ``hold`` of its
  threshold and cleared after ``clear_s`` under ``clear`` of ``slower``.

A slow RDMA link slows every rank's collectives alike, so no rank stands out. The rank that
arrives last at a collective waits 0, so the least communication over the ranks is the
collective's own (transfer) time. When that grows, steadily or on average, against the job's
own recent level at the same settings version, and RDMA evidence on a few of its nodes began
with the growth (``align_s``), the verdict names the node and its link.

Evidence (:class:`EvidenceBook`) is what the agents read anyway: clock-event (throttle)
reasons and SM clocks, XID and uncorrected ECC, RDMA link state, rate, flaps, errors and PFC
pauses, NUMA balancing and memory stalls on the host. It names the cause of a rank's verdict
(its GPU's evidence first, then its host's) and it is the only way a link verdict names a
node. Without evidence a compute straggler's cause is ``unknown`` and a late-start one's
``host``.

Costs: :meth:`StragglerDetector.observe` is O(1) (a write into the rank's ring of reports);
:meth:`StragglerDetector.evaluate` is O(ranks x window) in numpy. ``benchmarks/stragglers.py``
measures detection, false alarms and time to detect on simulated jobs of 16 to 1,024 ranks;
``docs/tuning/stragglers.md`` says how the coordinator feeds it and what the figures are.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from hyperagent.job import StepReport
    from hyperagent.readings import Reading

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

QUARTILE_SIGMA = 0.6745
"""Distance from the median to a quartile, in standard deviations of normal noise."""


def _median(values: FloatArray) -> float:
    """The median of a 1-d array (np.median's checks cost more than the sort here)."""
    n = len(values)
    h = n // 2
    if n % 2:
        return float(np.partition(values, h)[h])
    part = np.partition(values, (h - 1, h))
    return 0.5 * float(part[h - 1] + part[h])


def _level_and_noise(values: FloatArray) -> tuple[float, float]:
    """The median of ``values`` and their noise as a standard deviation: from the MAD, or
    from the distance to the 90th percentile where the upper tail is heavier."""
    level = _median(values)
    mad = 1.4826 * _median(np.abs(values - level))
    k = int(0.9 * (len(values) - 1))
    tail = (float(np.partition(values, k)[k]) - level) / 1.2816
    return level, max(mad, tail)


class Cause(StrEnum):
    """What kind of fault slows the rank or node."""

    GPU_THROTTLE = "gpu_throttle"
    """Clocks held down: thermal, power brake, hardware slowdown, a power cap, SM clocks low."""
    XID_ECC = "xid_ecc"
    """The GPU's driver reported an XID, uncorrectable ECC errors or pending row remaps."""
    RDMA = "rdma"
    """The node's RDMA link: down, flapping, degraded rate, link errors, PFC pauses."""
    HOST = "host"
    """The host: NUMA balancing, memory stalls, or steps that start late without a GPU sign."""
    UNKNOWN = "unknown"
    """Slower, with no evidence that says why."""


class Signal(StrEnum):
    """What the timing shows."""

    COMPUTE = "compute"
    """The rank computes longer than the others while they wait."""
    LATE_START = "late_start"
    """The rank's steps start late (the idle gap before its steps grew) while the others wait."""
    COMMUNICATION = "communication"
    """The whole job waits longer in communication (a link verdict)."""


@dataclass(frozen=True, slots=True)
class RankStep:
    """One rank's step, or ``steps`` consecutive steps summed, as its node saw it.

    ``step_s``, ``compute_s`` and ``comm_s`` are the job channel's
    (:class:`hyperagent.job.StepReport`): wall time of the step(s), the part outside exposed
    communication, and the exposed communication. ``idle_s`` is the time between the end of
    the rank's previous step and the start of the first one here (the agent knows it from
    its own timestamps); when None it is taken from ``ended`` (when the last step ended, on
    any clock steady for this rank, e.g. the agent's monotonic clock) and the rank's previous
    ``ended``: ``ended - previous ended - step_s``. Neither known: 0. An agent that forwards a
    summary of several steps per rank sends their sums with ``steps``, ``idle_s`` and
    ``comm_min_s``.
    """

    rank: int
    node: str
    gpu: int | None
    step_s: float
    compute_s: float
    comm_s: float
    samples: int = 0
    version: int = 0
    """The settings version the step(s) ran with."""
    steps: int = 1
    ended: float | None = None
    idle_s: float | None = None
    comm_min_s: float | None = None
    """The least exposed communication of one step among those summed (None: ``comm_s`` /
    ``steps``). The rank that arrives last at a collective waits 0, so the least over ranks
    and steps is the collective's own time, which hiccups of other ranks do not lengthen."""

    @classmethod
    def from_report(
        cls,
        report: StepReport,
        node: str,
        gpu: int | None,
        ended: float | None = None,
        idle_s: float | None = None,
    ) -> RankStep:
        """The job channel's report of one step, with where it ran and when it ended."""
        return cls(
            report.rank,
            node,
            gpu,
            report.step_s,
            report.compute_s,
            report.comm_s,
            report.samples,
            report.version,
            1,
            ended,
            idle_s,
        )


@dataclass(frozen=True, slots=True)
class Sign:
    """One piece of evidence on a node: its cause and reason, where (a GPU index, a link such
    as ``mlx5_0/1`` or a netdev), how strong (the rule's measure: a fraction of time, a rate,
    a count), since when it has been seen without a gap longer than the hold, and last seen."""

    cause: Cause
    reason: str
    node: str
    gpu: int | None = None
    link: str | None = None
    value: float = 1.0
    since: float = 0.0
    seen: float = 0.0

    def describe(self) -> str:
        where = f"GPU {self.gpu}" if self.gpu is not None else (self.link or "host")
        return f"{self.reason} on {where} of {self.node}"


@dataclass(frozen=True, slots=True)
class Straggler:
    """What holds the job back: a rank (with its GPU and node), or a node's link.

    ``slower`` is how much longer the rank's own time per step is than the job's typical rank
    (0.15: 15%), or for a link verdict how much longer the job's steps are than before it.
    ``waited_s`` is how much longer per step the other ranks wait in communication for it (for
    a link verdict: the job's extra communication per step). ``since`` estimates when it
    began (the first evaluation its excess crossed the clear line, less half the window the
    medians lag by); ``detected_at`` is when it became a verdict."""

    job: str
    node: str
    rank: int | None
    gpu: int | None
    link: str | None
    cause: Cause
    reason: str
    signal: Signal
    slower: float
    waited_s: float
    since: float
    detected_at: float
    evidence: tuple[Sign, ...] = ()

    @property
    def key(self) -> tuple[str, int | None, str | None, Cause]:
        """What identifies the verdict across evaluations (its figures change, this does not)."""
        return (self.node, self.rank, self.link, self.cause)

    def describe(self) -> str:
        """One line for logs, alerts and lost trials."""
        if self.rank is None:
            who = f"{self.link or 'a link'} of {self.node}"
        else:
            gpu = f"GPU {self.gpu} of " if self.gpu is not None else ""
            who = f"rank {self.rank} ({gpu}{self.node})"
        return (
            f"{who}: {self.slower:.0%} slower ({self.signal}, others wait "
            f"{self.waited_s:.3g} s a step): {self.cause}: {self.reason}"
        )


@dataclass(frozen=True, slots=True)
class JobVerdict:
    """One evaluation of a job: its stragglers, and whether they changed since the last one
    (a straggler came, went or changed cause: a trial measured across it is not comparable).
    ``slower`` is the job's step time against its recent level at the same settings version
    (None until that level is known)."""

    job: str
    at: float
    stragglers: tuple[Straggler, ...] = ()
    slower: float | None = None
    changed: bool = False

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes named, in order of first mention."""
        return tuple(dict.fromkeys(s.node for s in self.stragglers))

    def describe(self) -> str:
        """``straggler on n2: rank 13 (GPU 5 of n2): 15% slower ...``, or ``no straggler``."""
        if not self.stragglers:
            return "no straggler"
        return f"straggler on {', '.join(self.nodes)}: " + "; ".join(
            s.describe() for s in self.stragglers
        )


@dataclass(frozen=True)
class StragglerConfig:
    """The detector's thresholds and windows: defaults tuned with ``benchmarks/stragglers.py``
    for a judgement every 5 s and reports every step or every 5 s (a slower cadence detects
    later; a shorter ``confirm_s`` lets stalls of 30 s through)."""

    window_s: float = 35.0
    """Each rank's level is taken over its reports of about this long ..."""
    min_samples: int = 8
    """... and at least this many reports ..."""
    quantile: float = 0.25
    """... as this quantile of them: three quarters of the window must be slow, so a stall
    shorter than that is not a level, and hiccups (slow reports only) do not move it."""
    max_samples: int = 32
    """Reports kept per rank (the window's ceiling, in reports)."""
    slower: float = 0.05
    """A rank's own time this much above the job's typical rank makes it a suspect ..."""
    z: float = 4.5
    """... when that is also this many times the noise of the comparison."""
    waited_share: float = 0.5
    """The others' extra wait must be at least this share of the suspect's excess."""
    confirm_s: float = 10.0
    """A suspect this long is a straggler."""
    hold: float = 0.75
    """A suspect stays one down to this fraction of its threshold."""
    offset_s: float = 600.0
    """Each rank's usual excess over the job is learnt over about this long ..."""
    offset_cap: float = 0.025
    """... within +-this (a rank slower than that from the start still stands out) ..."""
    offset_every_s: float = 15.0
    """... once this often."""
    clear: float = 0.5
    """A straggler whose excess is below this fraction of ``slower`` ..."""
    clear_s: float = 30.0
    """... for this long is cleared."""
    stale_s: float = 120.0
    """A rank without a report this long is left out (and its verdict cleared)."""
    evidence_hold_s: float = 120.0
    """A sign stays active this long after it was last seen (a flapping link flaps again)."""
    baseline_s: float = 900.0
    """The job's recent level (for link verdicts) is the median over this long ..."""
    baseline_min: int = 5
    """... of at least this many evaluations at the current settings version."""
    align_s: float = 45.0
    """RDMA evidence names a node for a job-wide slowdown only if the slowdown began within
    this long after it (or a third of it before)."""
    max_link_nodes: int = 2
    """More nodes than this (or than a quarter of the job's) with aligned RDMA evidence is the
    fabric, not a node: no verdict."""

    def __post_init__(self) -> None:
        if self.min_samples < 3 or self.max_samples < self.min_samples:
            raise ValueError("need 3 <= min_samples <= max_samples")
        if not 0 < self.quantile <= 0.5:
            raise ValueError("need 0 < quantile <= 0.5")
        if not 0 < self.clear <= 1 or self.slower <= 0 or self.z <= 0:
            raise ValueError("need slower > 0, z > 0 and 0 < clear <= 1")


# -- evidence -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    """How a metric becomes a sign: ``rate`` (counter increase per second at least
    ``threshold``), ``increase`` (counter grew by at least ``threshold``), ``above`` (gauge at
    least ``threshold``), ``below`` (gauge under ``threshold``) or ``below_max`` (gauge under
    ``threshold`` times the highest value of the series seen)."""

    cause: Cause
    reason: str
    test: str
    threshold: float
    only: tuple[tuple[str, str], ...] = ()
    """Labels a series must have to count (e.g. the pause frames a NIC sends)."""


THROTTLE_REASONS: dict[str, str] = {
    "thermal": "thermal",
    "sw_thermal_slowdown": "thermal",
    "hw_thermal_slowdown": "thermal",
    "hw_slowdown": "hw_slowdown",
    "hw_power_brake_slowdown": "power_brake",
    "board_limit": "board_limit",
    "sw_power_cap": "power_cap",
    "reliability": "reliability",
}
"""Clock-event reasons that slow a GPU, by the name a verdict gives (idle, sync boost and the
clocks' settings are left out)."""

SENT = (("direction", "tx"),)

RULES: dict[str, Rule] = {
    "hyperagent_gpu_throttle_seconds_total": Rule(Cause.GPU_THROTTLE, "", "rate", 0.1),
    "hyperagent_gpu_xid_errors_total": Rule(Cause.XID_ECC, "xid", "increase", 1.0),
    "hyperagent_gpu_ecc_errors_total": Rule(Cause.XID_ECC, "ecc uncorrected", "increase", 1.0),
    "hyperagent_gpu_remapped_rows_pending": Rule(Cause.XID_ECC, "row remap pending", "above", 1),
    "hyperagent_gpu_retired_pages_pending": Rule(
        Cause.XID_ECC, "page retirement pending", "above", 1
    ),
    "hyperagent_rdma_port_state": Rule(Cause.RDMA, "link down", "below", 4),
    "hyperagent_rdma_port_link_downed_total": Rule(Cause.RDMA, "link flapping", "increase", 1),
    "hyperagent_rdma_port_rate_bytes_per_second": Rule(
        Cause.RDMA, "link degraded", "below_max", 0.99
    ),
    "hyperagent_rdma_port_symbol_errors_total": Rule(Cause.RDMA, "link errors", "rate", 0.1),
    "hyperagent_rdma_port_link_error_recoveries_total": Rule(
        Cause.RDMA, "link errors", "increase", 1
    ),
    "hyperagent_rdma_port_local_link_integrity_errors_total": Rule(
        Cause.RDMA, "link errors", "increase", 1
    ),
    "hyperagent_rdma_port_cqe_errors_total": Rule(Cause.RDMA, "completion errors", "increase", 1),
    "hyperagent_rdma_port_out_of_sequence_packets_total": Rule(
        Cause.RDMA, "retransmissions", "rate", 10.0
    ),
    "hyperagent_rdma_port_local_ack_timeouts_total": Rule(
        Cause.RDMA, "retransmissions", "rate", 1.0
    ),
    "hyperagent_rdma_pfc_pause_duration_seconds_total": Rule(
        Cause.RDMA, "pfc pause", "rate", 0.05, SENT
    ),
    "hyperagent_rdma_pfc_pause_frames_total": Rule(Cause.RDMA, "pfc pause", "rate", 1000.0, SENT),
    "hyperagent_host_numa_balancing_mode": Rule(Cause.HOST, "numa_balancing", "above", 1),
    "hyperagent_host_memory_pressure_stall_seconds_total": Rule(
        Cause.HOST, "memory pressure", "rate", 0.05
    ),
}
"""Which of the agent's metrics are evidence, and how (the thresholds of the alert rules
where ``rules/hyperagent.rules.yml`` has one). SM clocks are compared between a node's GPUs
in :meth:`EvidenceBook.observe` (``sm_clock``: under ``SM_CLOCK_LOW`` of the node's highest).
PFC pauses count where the node's NIC sends them (``direction="tx"``): a NIC that asks its
peers to pause cannot take what comes in; the peers that receive pauses are its victims."""

SM_CLOCK = "hyperagent_gpu_sm_clock_hertz"
SM_CLOCK_LOW = 0.9


def _link(labels: Mapping[str, str]) -> str | None:
    device, port = labels.get("device"), labels.get("port")
    if device is not None:
        return f"{device}/{port}" if port is not None else device
    return labels.get("netdev")


def _gpu(labels: Mapping[str, str]) -> int | None:
    value = labels.get("gpu", "")
    return int(value) if value.isdigit() else None


@dataclass(slots=True)
class _Seen:
    cause: Cause
    reason: str
    gpu: int | None
    link: str | None
    value: float
    since: float
    seen: float


class EvidenceBook:
    """What each node's telemetry says could slow a job, with when it began and was last seen.

    Feed it a node's readings (:meth:`observe`, the agent's metric names; counters become
    rates between calls) or signs directly (:meth:`note`); :meth:`active` answers what was
    seen on a node within ``hold_s``."""

    def __init__(self, hold_s: float = 120.0, rules: Mapping[str, Rule] | None = None) -> None:
        self.hold_s = hold_s
        self.rules = RULES if rules is None else rules
        self._signs: dict[str, dict[tuple[Cause, str, int | None, str | None], _Seen]] = {}
        self._series: dict[tuple[str, str, tuple[tuple[str, str], ...]], tuple[float, float]] = {}
        """(node, name, labels) -> (last value, when) of each counter, or the highest value of
        a ``below_max`` gauge."""
        self._first: dict[str, float] = {}
        """When each node was first observed: a counter series that appears later is new."""

    def note(
        self,
        node: str,
        cause: Cause,
        reason: str,
        now: float,
        gpu: int | None = None,
        link: str | None = None,
        value: float = 1.0,
    ) -> None:
        """A sign seen on ``node`` at ``now``."""
        signs = self._signs.setdefault(node, {})
        key = (cause, reason, gpu, link)
        seen = signs.get(key)
        if seen is None or now - seen.seen > self.hold_s:
            signs[key] = _Seen(cause, reason, gpu, link, value, now, now)
        else:
            seen.seen, seen.value = now, value

    def observe(self, node: str, readings: Iterable[Reading], now: float) -> None:
        """The signs in one collection of ``node``'s readings at ``now`` (the metrics of
        :data:`RULES`; the others are skipped)."""
        first = self._first.setdefault(node, now)
        clocks: dict[int, float] = {}
        for reading in readings:
            name = reading.name
            if name == SM_CLOCK:
                gpu = _gpu(reading.labels)
                if gpu is not None and reading.value > 0:
                    clocks[gpu] = reading.value
                continue
            rule = self.rules.get(name)
            if rule is None:
                continue
            labels = reading.labels
            if any(labels.get(k) != v for k, v in rule.only):
                continue
            measure = self._measure(node, name, labels, reading.value, rule, now, first)
            if measure is None:
                continue
            reason = rule.reason
            if name == "hyperagent_gpu_throttle_seconds_total":
                reason = THROTTLE_REASONS.get(labels.get("reason", ""), "")
                if not reason:
                    continue
            elif name == "hyperagent_gpu_xid_errors_total":
                reason = f"xid {labels.get('xid', '?')}"
            elif name == "hyperagent_gpu_ecc_errors_total" and labels.get("type") != "uncorrected":
                continue
            gpu = _gpu(labels) if rule.cause in (Cause.GPU_THROTTLE, Cause.XID_ECC) else None
            link = _link(labels) if rule.cause is Cause.RDMA else None
            self.note(node, rule.cause, reason, now, gpu, link, measure)
        if len(clocks) >= 2:
            top = max(clocks.values())
            for gpu, hertz in clocks.items():
                if hertz < SM_CLOCK_LOW * top:
                    self.note(node, Cause.GPU_THROTTLE, "sm_clock", now, gpu, None, hertz / top)

    def _measure(
        self,
        node: str,
        name: str,
        labels: Mapping[str, str],
        value: float,
        rule: Rule,
        now: float,
        first: float,
    ) -> float | None:
        """The rule's measure when the reading is a sign, else None."""
        test = rule.test
        if test == "above":
            return value if value >= rule.threshold else None
        if test == "below":
            return value if value < rule.threshold else None
        key = (node, name, tuple(sorted(labels.items())))
        previous = self._series.get(key)
        if test == "below_max":
            top = value if previous is None else max(previous[0], value)
            self._series[key] = (top, now)
            return value / top if top > 0 and value < rule.threshold * top else None
        self._series[key] = (value, now)
        if previous is None:
            if test == "increase" and now > first and value >= rule.threshold:
                return value  # a series that appeared on a node already known: all new
            return None
        grown = value - previous[0]
        if grown < 0:  # a counter reset (driver reload, agent restart)
            return None
        if test == "increase":
            return grown if grown >= rule.threshold else None
        elapsed = now - previous[1]
        if elapsed <= 0:
            return None
        rate = grown / elapsed
        return rate if rate >= rule.threshold else None

    def active(self, node: str, now: float) -> list[Sign]:
        """The signs seen on ``node`` within the hold, oldest first."""
        signs = self._signs.get(node)
        if not signs:
            return []
        gone = [k for k, s in signs.items() if now - s.seen > self.hold_s]
        for key in gone:
            del signs[key]
        return sorted(
            (
                Sign(s.cause, s.reason, node, s.gpu, s.link, s.value, s.since, s.seen)
                for s in signs.values()
            ),
            key=lambda s: s.since,
        )

    def forget(self, node: str) -> None:
        """Drop what is known of ``node`` (it left the cluster)."""
        self._signs.pop(node, None)
        self._first.pop(node, None)
        for key in [k for k in self._series if k[0] == node]:
            del self._series[key]


# -- the detector -------------------------------------------------------------------------


@dataclass(slots=True)
class _Flag:
    since: float
    detected_at: float
    clear_since: float | None = None


@dataclass(slots=True)
class _Base:
    """A job's recent level from its history since ``since``: step time, and transfer time
    two ways (``steady``: the low quantile of the reports, ``mean``: their mean) with the
    noise of each as a fraction of a step."""

    version: int
    cycle_s: float
    steady_s: float
    mean_s: float
    steady_noise: float
    mean_noise: float
    since: float
    frozen_at: float = 0.0


@dataclass(slots=True)
class _Job:
    capacity: int
    samples: int
    ranks: dict[int, int] = field(default_factory=dict)
    """rank -> its row in the arrays."""
    rank_of: IntArray = field(init=False)
    row_of: IntArray = field(default_factory=lambda: np.full(8, -1, np.int64))
    """rank -> row, as an array (for :meth:`StragglerDetector.observe_arrays`)."""
    nodes: list[str] = field(default_factory=list)
    gpus: list[int | None] = field(default_factory=list)
    own: FloatArray = field(init=False)
    comm: FloatArray = field(init=False)
    comm_min: FloatArray = field(init=False)
    idle: FloatArray = field(init=False)
    pos: IntArray = field(init=False)
    count: IntArray = field(init=False)
    seen: FloatArray = field(init=False)
    ended: FloatArray = field(init=False)
    covered: FloatArray = field(init=False)
    """Per row: the time its last report covered (cycle per step x steps)."""
    offset: FloatArray = field(init=False)
    """Per row: its usual excess over the job's typical rank, learnt while it is not a
    suspect, within +-``offset_cap`` (GPUs differ by a few percent at the same clocks)."""
    offset_at: float | None = None
    offset_since: float | None = None
    interval: float = 0.0
    """The time a report covers, smoothed over evaluations (the window's length in reports
    follows from it)."""
    size: int = 0
    version: int = 0
    suspects: dict[int, float] = field(default_factory=dict)
    rising: dict[int, float] = field(default_factory=dict)
    flags: dict[int, _Flag] = field(default_factory=dict)
    history: deque[tuple[float, int, float, float, float]] = field(default_factory=deque)
    base: _Base | None = None
    job_suspect: float | None = None
    job_rising: float | None = None
    """Since when the job's transfer has been above the clear line (with the verdicts'
    hysteresis): when the slowdown began, as link verdicts say."""
    job_calm: float | None = None
    ratios: deque[tuple[float, float]] = field(default_factory=deque)
    """(when, the transfer's growth over its threshold) of recent evaluations."""
    level: _Base | None = None
    level_key: tuple[int, int] | None = None
    """What the cached ``level`` was computed from (its history and version)."""
    link_flags: dict[tuple[str, str | None], _Flag] = field(default_factory=dict)
    last: JobVerdict | None = None

    def __post_init__(self) -> None:
        self._allocate(self.capacity)

    def _allocate(self, capacity: int) -> None:
        k = self.samples
        old = self.size
        arrays = {
            "rank_of": np.full(capacity, -1, np.int64),
            "own": np.zeros((capacity, k)),
            "comm": np.zeros((capacity, k)),
            "comm_min": np.zeros((capacity, k)),
            "idle": np.zeros((capacity, k)),
            "pos": np.zeros(capacity, np.int64),
            "count": np.zeros(capacity, np.int64),
            "seen": np.full(capacity, -math.inf),
            "ended": np.full(capacity, math.nan),
            "covered": np.zeros(capacity),
            "offset": np.zeros(capacity),
        }
        for name, array in arrays.items():
            if old:
                array[:old] = getattr(self, name)[:old]
            setattr(self, name, array)
        self.capacity = capacity

    def row(self, rank: int, node: str, gpu: int | None) -> int:
        row = self.ranks.get(rank)
        if row is None:
            if self.size == self.capacity:
                self._allocate(self.capacity * 2)
            row = self.ranks[rank] = self.size
            self.size += 1
            self.rank_of[row] = rank
            if rank >= len(self.row_of):
                grown = np.full(max(rank + 1, 2 * len(self.row_of)), -1, np.int64)
                grown[: len(self.row_of)] = self.row_of
                self.row_of = grown
            self.row_of[rank] = row
            self.nodes.append(node)
            self.gpus.append(gpu)
        elif self.nodes[row] != node or self.gpus[row] != gpu:
            self.nodes[row], self.gpus[row] = node, gpu  # restarted elsewhere: a new history
            self.count[row] = self.pos[row] = 0
            self.ended[row] = math.nan
            self.offset[row] = 0.0
        return row


@dataclass(slots=True)
class _Window:
    """One evaluation's view of a job's ranks over their window (rows in ``rows`` order)."""

    rows: IntArray
    index: tuple[npt.NDArray[np.intp], ...]
    ranks: IntArray
    own: FloatArray
    level: FloatArray
    middle: FloatArray
    excess: FloatArray
    waited: FloatArray
    comm_level: FloatArray
    suspect: npt.NDArray[np.bool_]
    rising: npt.NDArray[np.bool_]
    lo: int
    half: int
    span: float
    own_typical: float


class StragglerDetector:
    """Stragglers of every job the caller feeds, judged when the caller asks.

    The coordinator feeds each rank's step reports as its node forwards them
    (:meth:`observe`, or :meth:`observe_arrays` for a batch), each node's readings to
    :attr:`evidence`, and every few seconds asks :meth:`evaluate` per job; a rank that left
    is dropped with :meth:`leave`, an ended job with :meth:`forget`."""

    def __init__(
        self, config: StragglerConfig | None = None, evidence: EvidenceBook | None = None
    ) -> None:
        self.config = config or StragglerConfig()
        self.evidence = evidence or EvidenceBook(self.config.evidence_hold_s)
        self._jobs: dict[str, _Job] = {}
        self._links = _JobPace(self.config, self.evidence)
        self._arange = np.arange(self.config.max_samples)
        normal = NormalDist()
        q = self.config.quantile
        spread = normal.inv_cdf(0.5) - normal.inv_cdf(q)
        self._quantile_se = math.sqrt(q * (1 - q)) / normal.pdf(normal.inv_cdf(q)) / spread
        """Standard error of a rank's level per sqrt(report) and per (median - level)."""

    # -- what comes in -----------------------------------------------------------------

    def _job(self, job: str) -> _Job:
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = _Job(8, self.config.max_samples)
        return state

    def attach(self, job: str, rank: int, node: str, gpu: int | None) -> None:
        """Say where ``rank`` runs (before :meth:`observe_arrays`; :meth:`observe` does it)."""
        self._job(job).row(rank, node, gpu)

    def observe(self, job: str, step: RankStep, now: float) -> None:
        """One report of ``job``'s rank at ``now`` (the caller's clock, as for every other
        time here). O(1)."""
        state = self._job(job)
        row = state.row(step.rank, step.node, step.gpu)
        steps = max(step.steps, 1)
        idle = step.idle_s
        if idle is None:
            idle = 0.0
            if step.ended is not None:
                previous = float(state.ended[row])
                state.ended[row] = step.ended
                if not math.isnan(previous):
                    idle = step.ended - previous - step.step_s
        idle = min(max(idle, 0.0), self.config.window_s)
        compute = step.compute_s if step.compute_s > 0 else max(step.step_s - step.comm_s, 0.0)
        if step.version > state.version:
            state.version = step.version
        k = state.pos[row]
        state.own[row, k] = (compute + idle) / steps
        state.comm[row, k] = step.comm_s / steps
        state.comm_min[row, k] = step.comm_s / steps if step.comm_min_s is None else step.comm_min_s
        state.idle[row, k] = idle / steps
        state.pos[row] = (k + 1) % state.samples
        state.count[row] += 1
        state.seen[row] = now
        state.covered[row] = step.step_s + idle

    def observe_arrays(
        self,
        job: str,
        ranks: npt.ArrayLike,
        compute_s: npt.ArrayLike,
        comm_s: npt.ArrayLike,
        idle_s: npt.ArrayLike,
        now: float,
        steps: npt.ArrayLike = 1,
        version: int = 0,
        comm_min_s: npt.ArrayLike | None = None,
    ) -> None:
        """One report from each of ``ranks`` (distinct, attached) at ``now``, as arrays: the
        sums over each report's ``steps`` of compute, communication and idle seconds (a
        rank's ``step_s`` is its compute plus communication) and the least communication of
        one of those steps (:class:`RankStep`). O(1) per rank, in numpy."""
        state = self._jobs[job]
        wanted = np.asarray(ranks, np.int64)
        known = (wanted >= 0) & (wanted < len(state.row_of))
        rows = np.where(known, state.row_of[np.where(known, wanted, 0)], -1)
        if (rows < 0).any():
            raise ValueError(f"{job}: rank {int(wanted[rows < 0][0])} was not attached")
        n = np.maximum(np.asarray(steps, np.float64), 1.0)
        compute, comm = np.asarray(compute_s, np.float64), np.asarray(comm_s, np.float64)
        idle = np.clip(np.asarray(idle_s, np.float64), 0.0, self.config.window_s)
        k = state.pos[rows]
        state.own[rows, k] = (compute + idle) / n
        state.comm[rows, k] = comm / n
        state.comm_min[rows, k] = comm / n if comm_min_s is None else comm_min_s
        state.idle[rows, k] = idle / n
        state.pos[rows] = (k + 1) % state.samples
        state.count[rows] += 1
        state.seen[rows] = now
        state.covered[rows] = compute + comm + idle
        if version > state.version:
            state.version = version

    def leave(self, job: str, rank: int) -> None:
        """``rank`` left ``job``: its reports and verdict go (at the next evaluation)."""
        state = self._jobs.get(job)
        row = None if state is None else state.ranks.get(rank)
        if state is not None and row is not None:
            state.count[row] = 0
            state.seen[row] = -math.inf
            state.offset[row] = 0.0
            state.ended[row] = math.nan

    def forget(self, job: str) -> None:
        """``job`` ended: everything known of it goes."""
        self._jobs.pop(job, None)

    def jobs(self) -> list[str]:
        """The jobs fed so far and not forgotten."""
        return list(self._jobs)

    def verdict(self, job: str) -> JobVerdict | None:
        """The last evaluation of ``job`` (None before the first)."""
        state = self._jobs.get(job)
        return None if state is None else state.last

    # -- judging ------------------------------------------------------------------------

    def evaluate(self, job: str, now: float) -> JobVerdict:
        """Judge ``job`` at ``now`` on the reports so far (every 5 s, as the defaults assume):
        O(ranks x window). Ranks with fewer reports than a window are left out until they
        have them; with fewer than 2 ranks to compare nothing is a straggler."""
        state = self._jobs.get(job)
        if state is None:
            return JobVerdict(job, now)
        cfg = self.config
        size = state.size
        live = np.flatnonzero((state.count[:size] > 0) & (state.seen[:size] >= now - cfg.stale_s))
        stragglers: list[Straggler] = []
        slower: float | None = None
        judged = False
        if len(live) >= 2:
            covered = float(state.covered[live].mean())
            if state.interval <= 0:
                state.interval = covered
            else:
                state.interval += 0.1 * (covered - state.interval)
            n = cfg.min_samples
            if state.interval > 0:
                span = math.ceil(cfg.window_s / state.interval)
                n = int(min(max(span, n), cfg.max_samples))
            rows = live[state.count[live] >= n]
            if len(rows) >= 2:
                stragglers, slower = self._judge(job, state, rows, n, n * state.interval, now)
                judged = True
        if not judged:
            state.flags.clear()
            state.suspects.clear()
            state.rising.clear()
            state.link_flags.clear()
        keys = {s.key for s in stragglers}
        previous = set() if state.last is None else {s.key for s in state.last.stragglers}
        verdict = JobVerdict(job, now, tuple(stragglers), slower, keys != previous)
        state.last = verdict
        return verdict

    def _judge(
        self, job: str, state: _Job, rows: IntArray, n: int, span: float, now: float
    ) -> tuple[list[Straggler], float | None]:
        window = self._window(state, rows, n, span, now)
        if window is None:
            return [], None
        stragglers = self._rank_stragglers(job, state, window, now)
        comm = state.comm[window.index]
        cycle = window.own_typical + _median(window.comm_level)
        least = state.comm_min[window.index].min(axis=0)
        steady = float(np.partition(least, window.lo)[window.lo])
        mean = float(comm.min(axis=0).mean())
        links = self._links
        job_slower = links.level(state, cycle, steady, mean, span, now)
        stragglers += links.verdicts(job, state, rows, steady, mean, span, now)
        return stragglers, job_slower

    def _window(
        self, state: _Job, rows: IntArray, n: int, span: float, now: float
    ) -> _Window | None:
        """Each rank's level over its window against the job's, and who is a suspect now."""
        cfg = self.config
        pos = state.pos[rows]
        if (pos == pos[0]).all():  # every ring in step (reports arrive together): one gather
            index = np.ix_(rows, (pos[0] - 1 - self._arange[:n]) % state.samples)
        else:
            index = (rows[:, None], (pos[:, None] - 1 - self._arange[:n]) % state.samples)
        own = state.own[index]
        m = len(rows)
        half, quarter, upper = (m - 1) // 2, m // 4, m - 1 - (m - 1) // 2
        column = np.partition(own, half, axis=0)[half]
        lo, mid = int(cfg.quantile * (n - 1)), n // 2
        part = np.partition(own / np.maximum(column, 1e-9), (lo, mid), axis=1)
        level, middle = part[:, lo], part[:, mid]
        comm_level = np.partition(state.comm[index], mid, axis=1)[:, mid]
        ordered = np.partition(level, (quarter, half))
        ref = float(ordered[half])
        own_typical = _median(column)
        if ref <= 0 or own_typical <= 0:
            return None
        raw = level * (1.0 / ref) - 1.0
        offset = state.offset[rows]
        excess = raw - offset
        se = (middle - level) * (self._quantile_se / math.sqrt(n) / ref)
        typical_se = _median(se)
        spread = math.sqrt(2) * typical_se
        if m >= 8:
            spread_at = np.partition(excess, (quarter, half))
            spread = max(typical_se, float(spread_at[half] - spread_at[quarter]) / QUARTILE_SIGMA)
        # the comparison's noise: the spread between ranks, or the rank's own where larger
        threshold = cfg.z * np.maximum(se, max(spread, cfg.slower / cfg.z))
        ranks = state.rank_of[rows]
        if state.suspects:
            held = np.isin(ranks, np.fromiter(state.suspects, np.int64, len(state.suspects)))
            threshold = np.where(held, cfg.hold * threshold, threshold)
        suspect = excess >= threshold
        comm_ref = float(np.partition(comm_level, upper)[upper])
        waited = comm_ref - comm_level
        if suspect.any() and comm_ref > 1e-3 * own_typical:
            suspect &= waited >= cfg.waited_share * raw * own_typical
        rising = excess >= cfg.slower * cfg.clear
        busy = suspect
        if state.offset_since is not None and now - state.offset_since >= cfg.offset_s:
            busy = suspect | rising  # learnt: what rises now is no offset
        if state.flags:
            busy = busy | np.isin(ranks, np.fromiter(state.flags, np.int64, len(state.flags)))
        self._learn_offsets(state, rows, raw, offset, busy, now)
        return _Window(
            rows,
            index,
            ranks,
            own,
            level,
            middle,
            excess,
            waited,
            comm_level,
            suspect,
            rising,
            lo,
            half,
            span,
            own_typical,
        )

    def _rank_stragglers(
        self, job: str, state: _Job, window: _Window, now: float
    ) -> list[Straggler]:
        """Suspects long enough become stragglers, stragglers under the clear line long
        enough go; the verdicts on those that stay."""
        cfg = self.config
        ranks, excess = window.ranks, window.excess
        state.suspects = {
            int(r): state.suspects.get(int(r), now) for r in ranks[window.suspect].tolist()
        }
        state.rising = {
            int(r): state.rising.get(int(r), now) for r in ranks[window.rising].tolist()
        }
        if not state.flags and not state.suspects:
            return []
        where = {int(r): i for i, r in enumerate(ranks.tolist())}
        for rank, since in state.suspects.items():
            if rank not in state.flags and now - since >= cfg.confirm_s:
                began = state.rising.get(rank, since) - (1 - cfg.quantile) * window.span
                state.flags[rank] = _Flag(began, now)
        for rank in list(state.flags):
            flag = state.flags[rank]
            i = where.get(rank)
            if i is None:
                del state.flags[rank]
            elif excess[i] >= cfg.slower * cfg.clear:
                flag.clear_since = None
            elif flag.clear_since is None:
                flag.clear_since = now
            elif now - flag.clear_since >= cfg.clear_s:
                del state.flags[rank]
        if not state.flags:
            return []
        middle = window.middle
        typical = float(np.partition(middle, window.half)[window.half])
        own_mean = window.own.mean(axis=1)
        idle_mean = state.idle[window.index].mean(axis=1)
        own_ref, idle_ref = _median(own_mean), _median(idle_mean)
        out = []
        for rank, flag in state.flags.items():
            i = where[rank]
            extra = float(own_mean[i]) - own_ref
            late = extra > 0 and float(idle_mean[i]) - idle_ref > 0.5 * extra
            slower = max(float(middle[i]) / typical - 1.0, float(excess[i]))
            row = int(window.rows[i])
            out.append(
                self._rank_verdict(
                    job, state, row, rank, flag, slower, float(window.waited[i]), late, now
                )
            )
        return out

    def _learn_offsets(
        self,
        state: _Job,
        rows: IntArray,
        raw: FloatArray,
        offset: FloatArray,
        busy: npt.NDArray[np.bool_],
        now: float,
    ) -> None:
        """Move each calm rank's offset toward its excess: their mean over the job's first
        ``offset_s`` (every rank but suspects and stragglers), then their average over about
        ``offset_s`` (the ranks under the clear line)."""
        cfg = self.config
        if state.offset_since is None:
            state.offset_since = state.offset_at = now
        last = state.offset_at
        if last is None or now - last < cfg.offset_every_s:
            return
        state.offset_at = now
        learnt = min(cfg.offset_s, now - state.offset_since)  # a running mean at first
        weight = min(1.0, (now - last) / learnt)
        target = np.clip(raw, -cfg.offset_cap, cfg.offset_cap)
        state.offset[rows] = np.where(busy, offset, offset + weight * (target - offset))

    def _rank_verdict(
        self,
        job: str,
        state: _Job,
        row: int,
        rank: int,
        flag: _Flag,
        excess: float,
        waited: float,
        late: bool,
        now: float,
    ) -> Straggler:
        node, gpu = state.nodes[row], state.gpus[row]
        signs = self.evidence.active(node, now)
        on_gpu = [s for s in signs if gpu is not None and s.gpu == gpu]
        throttled = [s for s in on_gpu if s.cause is Cause.GPU_THROTTLE]
        errors = [s for s in on_gpu if s.cause is Cause.XID_ECC]
        host = [s for s in signs if s.cause is Cause.HOST]
        order = (host, throttled, errors) if late else (throttled, errors, host)
        chosen = next((group for group in order if group), [])
        if chosen:
            cause = chosen[0].cause
            reason = ", ".join(dict.fromkeys(s.reason for s in chosen))
        elif late:
            cause, reason = Cause.HOST, "steps start late"
        else:
            cause, reason = Cause.UNKNOWN, "no evidence"
        return Straggler(
            job,
            node,
            rank,
            gpu,
            None,
            cause,
            reason,
            Signal.LATE_START if late else Signal.COMPUTE,
            excess,
            waited,
            flag.since,
            flag.detected_at,
            tuple(on_gpu + host),
        )


class _JobPace:
    """A job's pace against its own recent level at its settings version, and the link
    verdicts that RDMA evidence makes of a slowdown in its transfer time."""

    def __init__(self, config: StragglerConfig, evidence: EvidenceBook) -> None:
        self.config = config
        self.evidence = evidence

    def level(
        self, state: _Job, cycle: float, steady: float, mean: float, span: float, now: float
    ) -> float | None:
        """The job's step time against its recent level at this version (None: unknown).

        Keeps that level's history and the job-wide suspicion that link verdicts need: the
        transfer time (the communication of the ranks that wait least, those that arrive last
        at the collective), steadily or on average, grown by ``slower`` of a step and ``z``
        times its noise."""
        cfg = self.config
        history = state.history
        while history and history[0][0] < now - cfg.baseline_s:
            history.popleft()
        busy = bool(state.suspects or state.flags)
        base = state.base
        if base is not None and (
            base.version != state.version
            or (now - base.frozen_at > cfg.baseline_s and not state.link_flags)
        ):
            base = state.base = None  # another version, or slow for long: its new level
            history.clear()
            state.level_key = None
        if base is None:
            base = self._recent_level(state, span, now)
        if base is None:
            state.job_suspect = state.job_rising = state.job_calm = None
            state.ratios.clear()
            if not busy:
                self._remember(state, cycle, steady, mean, now)
            return None
        ratio = self._transfer_ratio(base, steady, mean)
        ratios = state.ratios
        ratios.append((now, ratio))
        while ratios[0][0] < now - cfg.baseline_s:
            ratios.popleft()
        suspect = ratio >= 1.0 and not busy
        if not suspect:
            state.job_suspect = None
        elif state.job_suspect is None:
            state.job_suspect = now
        if ratio >= cfg.clear:
            state.job_calm = None
            if state.job_rising is None:
                state.job_rising = now
        elif state.job_calm is None:
            state.job_calm = now
        elif now - state.job_calm >= cfg.clear_s:
            state.job_rising = None
        if state.job_rising is not None or state.link_flags or busy:
            if state.base is None:
                state.base = replace(base, frozen_at=now)  # frozen while the job is slow
        else:
            state.base = None
            self._remember(state, cycle, steady, mean, now)
        return cycle / base.cycle_s - 1.0

    def _aligned(self, state: _Job, since: float) -> bool:
        """Whether evidence that began at ``since`` explains the job's slowdown: its transfer
        crossed the clear line within ``align_s`` after ``since`` (or a third of that
        before: the window lags), or, already slow, grew by one threshold more after it."""
        cfg = self.config
        ratios = state.ratios
        earliest, latest = since - cfg.align_s / 3, since + cfg.align_s
        below = False
        for t, ratio in ratios:
            if t > latest:
                break
            if ratio >= cfg.clear and below and t >= earliest:
                return True
            below = ratio < cfg.clear
        before = [r for t, r in ratios if since - cfg.align_s <= t < since]
        after = [r for t, r in ratios if since <= t <= latest]
        if not before or not after:
            return False
        return max(after) - _median(np.array(before)) >= 1.0

    def _transfer_ratio(self, base: _Base, steady: float, mean: float) -> float:
        """The transfer's growth over its threshold, the larger of the two ways (1: at it)."""
        cfg = self.config
        steady_grown = (steady - base.steady_s) / base.cycle_s
        mean_grown = (mean - base.mean_s) / base.cycle_s
        return max(
            steady_grown / max(cfg.slower, cfg.z * base.steady_noise),
            mean_grown / max(cfg.slower, cfg.z * base.mean_noise),
        )

    def _recent_level(self, state: _Job, span: float, now: float) -> _Base | None:
        """The job's level over its history older than ``span``, at its settings version."""
        history = state.history
        key = (state.version, math.floor(now / (self.config.window_s / 2)))
        if state.level_key == key:
            return state.level  # its history changes by an entry or two in half a window
        state.level_key, state.level = key, None
        usable = [h for h in history if h[1] == state.version and h[0] <= now - span]
        if len(usable) < self.config.baseline_min:
            return None
        cycle = _median(np.array([h[2] for h in usable]))
        if cycle <= 0:
            return None
        steady, steady_noise = _level_and_noise(np.array([h[3] for h in usable]))
        mean, mean_noise = _level_and_noise(np.array([h[4] for h in usable]))
        state.level = _Base(
            state.version,
            cycle,
            steady,
            mean,
            steady_noise / cycle,
            mean_noise / cycle,
            usable[0][0],
        )
        return state.level

    def _remember(self, state: _Job, cycle: float, steady: float, mean: float, now: float) -> None:
        """Keep the job's level at this evaluation, at most four times a window."""
        history = state.history
        if not history or now - history[-1][0] >= self.config.window_s / 4:
            history.append((now, state.version, cycle, steady, mean))

    def verdicts(
        self,
        job: str,
        state: _Job,
        rows: IntArray,
        steady: float,
        mean: float,
        span: float,
        now: float,
    ) -> list[Straggler]:
        """Link verdicts: the job's transfer time grew while RDMA evidence began on few of its
        nodes, after its recent level was taken and close to when the growth began."""
        cfg = self.config
        base = state.base
        if base is None:
            state.link_flags.clear()
            return []
        extra = max(steady - base.steady_s, mean - base.mean_s)
        grown = extra / base.cycle_s
        ratio = self._transfer_ratio(base, steady, mean)
        if not state.link_flags and (
            state.job_suspect is None or now - state.job_suspect < cfg.confirm_s
        ):
            return []
        onset = (state.job_rising if state.job_rising is not None else now) - span / 2
        nodes = dict.fromkeys(state.nodes[r] for r in rows.tolist())
        if state.job_suspect is not None and now - state.job_suspect >= cfg.confirm_s:
            aligned: dict[str, list[Sign]] = {}
            for node in nodes:
                signs = [
                    s
                    for s in self.evidence.active(node, now)
                    if s.cause is Cause.RDMA
                    and s.since >= base.since
                    and self._aligned(state, s.since)
                ]
                if signs:
                    aligned[node] = signs
            if len(aligned) <= max(1, min(cfg.max_link_nodes, len(nodes) // 4)):
                for node, signs in aligned.items():
                    for link in dict.fromkeys(s.link for s in signs):
                        if (node, link) not in state.link_flags:
                            state.link_flags[(node, link)] = _Flag(onset, now)
        out: list[Straggler] = []
        for (node, link), flag in list(state.link_flags.items()):
            signs = [
                s
                for s in self.evidence.active(node, now)
                if s.cause is Cause.RDMA and s.link == link
            ]
            recovered = ratio < cfg.clear or not signs or node not in nodes
            if not recovered:
                flag.clear_since = None
            elif flag.clear_since is None:
                flag.clear_since = now
            elif now - flag.clear_since >= cfg.clear_s:
                del state.link_flags[(node, link)]
                continue
            reason = ", ".join(dict.fromkeys(s.reason for s in signs)) or "link evidence ended"
            out.append(
                Straggler(
                    job,
                    node,
                    None,
                    None,
                    link,
                    Cause.RDMA,
                    reason,
                    Signal.COMMUNICATION,
                    grown,
                    extra,
                    flag.since,
                    flag.detected_at,
                    tuple(signs),
                )
            )
        return out

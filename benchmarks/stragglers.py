"""Straggler detection on simulated synchronous jobs: detection rate, false alarms, time to detect.

Each simulated job is synchronous data parallel, step by step, in simulated time: every rank
waits an idle gap (the data loader: 1% of the step, lognormal sigma 0.5, and on 0.05% of its
steps a hiccup of 0.1-0.5 step, which every rank waits for: a 1,024-rank job loses about 13%
to them), computes (a per-rank constant within +-3%, times 3% lognormal jitter per step), and
waits in the allreduce until the slowest rank arrives, plus the transfer (5-30% of the step,
5% jitter). Ranks: 16 to 1,024 (8 per node, log-uniform over
the powers of two); steps of 1-10 s (log-uniform). The agents' reports reach the detector
once every ``--report-s`` (5 s): per rank, the steps that ended in that time, summed; the
detector judges each job every ``--eval-s`` (5 s) with its default configuration.

What a healthy job also meets (none of which is a straggler): a settings change every 20-60
minutes (compute +-3%, transfer x0.7-1.5, a new version); a checkpoint every 30 minutes (all
ranks idle 10-60 s); fabric congestion once per 6 job-hours (transfer +5-40% of a step for
1-15 minutes; the switches pause the job's NICs, which the rules do not count: only pauses
a NIC sends are evidence against its node); per node a hiccup once a day (its ranks start
late by 0.2-1 step for 5-30 s); benign signs: NUMA
balancing on 5% of nodes and a link counting errors on 3% (all the time), a transient PFC or
link-error sign once per node-week (1-5 minutes), a GPU throttle blip once per GPU-day.

Fail-slow episodes (``--episodes``, spread evenly over 5%, 10%, 20% and 50% slower; half
compute, a quarter host, a quarter link), each 10-20 minutes healthy, 10 minutes slow, 5
minutes recovered:

- compute: one rank computes (1 + x) as long; its GPU shows thermal (45%) or hardware
  slowdown / power brake (20%) throttling, pending row remaps (20%), or nothing (15%);
- host: one node's ranks are x slower, 60% of it as a late start (idle, lognormal sigma 0.5)
  and 40% as compute; the node shows NUMA balancing (50%), memory stalls (20%) or nothing;
- link: one node's link makes every step's transfer longer by x of a step (the job is x
  slower), steadily with PFC pauses, link errors or a degraded rate, or as a flapping port
  (a quarter of the steps 4x as delayed; a link-down flap noted every 20-60 s).

Detected: a verdict naming the faulty rank (compute), the node (host) or the node's link
(link) while it is slow; time to detect from the slowdown's first step to that verdict; the
cause is right when it is the expected kind (a silent GPU: unknown). A false alarm is a
verdict appearing in a healthy job (a node named afresh, at most one per node and
evaluation); they are counted per 1,000 node-days. Evidence reaches the detector as signs
(:meth:`EvidenceBook.note`, every 5 s while a sign lasts, at each flap of a flapping port); the
rules that turn the agent's readings into signs are tested on their own. The CPU cost is
measured after the run on jobs of 16, 128 and 1,024 ranks in their steady state: process time
of :meth:`observe_arrays` per rank report, of :meth:`evaluate` per call, and of one
:meth:`observe` (a report fed alone).

    python benchmarks/stragglers.py --quick          # about 30 s on 2 cores
    python benchmarks/stragglers.py                  # 1,000 episodes, 10,000 healthy job-hours
        [--episodes N] [--healthy-hours H] [--workers W] [--seed S] [--budget-s S] [--json FILE]
        [--set KEY=VALUE ...]   # a StragglerConfig field other than its default, e.g. z=4.5

The full size takes about 40 minutes of one core (``--workers 2`` halves it on an idle
2-core machine); ``--budget-s`` stops it sooner, saying what it ran. It exits 1 if no
episode or no healthy hour ran, or nothing was reported or judged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hyperagent.tuner.stragglers import (
    Cause,
    RankStep,
    StragglerConfig,
    StragglerDetector,
)

RANKS = (16, 32, 64, 128, 256, 512, 1024)
GPUS = 8
MAGNITUDES = (0.05, 0.10, 0.20, 0.50)
DAY = 86400.0
JOB = "job"

COMPUTE_KINDS = (
    ("thermal", 0.45, Cause.GPU_THROTTLE),
    ("hw_slowdown", 0.20, Cause.GPU_THROTTLE),
    ("row remap pending", 0.20, Cause.XID_ECC),
    ("silent", 0.15, Cause.UNKNOWN),
)
HOST_KINDS = (
    ("numa_balancing", 0.5, Cause.HOST),
    ("memory pressure", 0.2, Cause.HOST),
    ("silent", 0.3, Cause.HOST),
)
LINK_KINDS = (
    ("pfc pause", 0.30, Cause.RDMA),
    ("link errors", 0.25, Cause.RDMA),
    ("link degraded", 0.25, Cause.RDMA),
    ("link flapping", 0.20, Cause.RDMA),
)


@dataclass
class Fault:
    cause: str
    kind: str
    magnitude: float
    onset_s: float
    end_s: float
    rank: int
    node: int
    link: str
    expected: Cause


@dataclass
class SimSign:
    node: int
    cause: Cause
    reason: str
    start: float
    end: float
    gpu: int | None = None
    link: str | None = None
    flaps: list[float] | None = None
    """Times it is seen (a flapping port); None: seen all along."""


@dataclass
class Window:
    start: float
    end: float
    value: float
    node: int = -1


@dataclass
class JobSpec:
    seed: int
    ranks: int
    step_s: float
    duration_s: float
    fault: Fault | None = None


@dataclass
class JobResult:
    spec: JobSpec
    node_days: float = 0.0
    reports: int = 0
    evaluations: int = 0
    steps: int = 0
    alarms: list[dict[str, Any]] = field(default_factory=list)
    """Healthy jobs (and episodes before their onset): verdicts appearing."""
    detected_at: float | None = None
    cause: str | None = None
    misnamed: int = 0
    since_error_s: float | None = None
    cleared_after_s: float | None = None
    onset_s: float | None = None


def _choose(rng: np.random.Generator, kinds: tuple[tuple[str, float, Cause], ...]) -> int:
    return int(rng.choice(len(kinds), p=[w for _, w, _ in kinds]))


def _poisson_windows(
    rng: np.random.Generator, rate_per_s: float, duration: float, lo: float, hi: float
) -> list[tuple[float, float]]:
    count = rng.poisson(rate_per_s * duration)
    starts = np.sort(rng.uniform(0, duration, count))
    return [(float(s), float(s + rng.uniform(lo, hi))) for s in starts]


class SyncJob:
    """One simulated job: its steps, its disturbances, its signs and its fault."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        rng = self.rng = np.random.default_rng(spec.seed)
        n = self.n = spec.ranks
        self.nodes = n // GPUS
        d = spec.duration_s
        t = spec.step_s
        self.comm_share = float(rng.uniform(0.05, 0.30))
        self.idle0 = 0.01 * t
        self.compute0 = t * (1 - self.comm_share) - self.idle0
        self.transfer0 = t * self.comm_share
        self.static = np.clip(rng.normal(1.0, 0.01, n), 0.97, 1.03)
        self.versions: list[tuple[float, float, float]] = [(0.0, 1.0, 1.0)]
        at = float(rng.uniform(1200, 3600))
        while at < d:
            self.versions.append((at, float(rng.uniform(0.97, 1.03)), float(rng.uniform(0.7, 1.5))))
            at += float(rng.uniform(1200, 3600))
        phase = float(rng.uniform(0, 1800))
        self.checkpoints = [
            Window(s, s + spec.step_s, float(rng.uniform(10, 60)))
            for s in np.arange(phase, d, 1800.0).tolist()
        ]
        self.signs: list[SimSign] = []
        self.congestion: list[Window] = []
        for s, e in _poisson_windows(rng, 1 / (6 * 3600), d, 60, 900):
            self.congestion.append(Window(s, e, float(rng.uniform(0.05, 0.4)) * t))
        self.hiccups = [
            Window(s, e, float(rng.uniform(0.2, 1.0)) * t, int(rng.integers(self.nodes)))
            for s, e in _poisson_windows(rng, self.nodes / DAY, d, 5, 30)
        ]
        for node in range(self.nodes):
            if rng.random() < 0.05:
                self.signs.append(SimSign(node, Cause.HOST, "numa_balancing", 0.0, d))
            if rng.random() < 0.03:
                self.signs.append(
                    SimSign(node, Cause.RDMA, "link errors", 0.0, d, link=self._link(node))
                )
        for s, e in _poisson_windows(rng, self.nodes / (7 * DAY), d, 60, 300):
            node = int(rng.integers(self.nodes))
            reason = "pfc pause" if rng.random() < 0.6 else "link errors"
            self.signs.append(SimSign(node, Cause.RDMA, reason, s, e, link=self._link(node)))
        for s, e in _poisson_windows(rng, n / DAY, d, 60, 300):
            rank = int(rng.integers(n))
            reason = "thermal" if rng.random() < 0.5 else "power_cap"
            self.signs.append(
                SimSign(rank // GPUS, Cause.GPU_THROTTLE, reason, s, e, gpu=rank % GPUS)
            )
        fault = spec.fault
        if fault is not None:
            self._fault_signs(fault)

    def _link(self, node: int) -> str:
        return f"mlx5_{int(self.rng.integers(GPUS))}/1"

    def _fault_signs(self, fault: Fault) -> None:
        start, end = fault.onset_s + 1.0, fault.end_s
        if fault.kind == "silent":
            return
        if fault.cause == "compute":
            cause = Cause.XID_ECC if fault.kind == "row remap pending" else Cause.GPU_THROTTLE
            kind = fault.kind
            if kind == "hw_slowdown" and self.rng.random() < 0.5:
                kind = "power_brake"
            self.signs.append(SimSign(fault.node, cause, kind, start, end, gpu=fault.rank % GPUS))
        elif fault.cause == "host":
            self.signs.append(SimSign(fault.node, Cause.HOST, fault.kind, start, end))
        else:
            flaps = None
            if fault.kind == "link flapping":
                flaps, at = [], start
                while at < end:
                    flaps.append(at)
                    at += float(self.rng.uniform(20, 60))
            self.signs.append(
                SimSign(
                    fault.node, Cause.RDMA, fault.kind, start, end, link=fault.link, flaps=flaps
                )
            )

    def block(self, t0: float, count: int, estimate: float) -> dict[str, np.ndarray]:
        """``count`` steps from ``t0``. The disturbances and the fault apply to the steps that
        start inside them; the steps' start times depend on those, so the block is assembled
        again from the same draws until they agree (first guess: ``estimate`` apart)."""
        rng, n = self.rng, self.n
        draws = {
            "compute": np.exp(0.03 * rng.standard_normal((count, n))),
            "idle": np.exp(0.5 * rng.standard_normal((count, n)) - 0.125),
            "spikes": rng.random((count, n)),
            "spike_size": rng.uniform(0.1, 0.5, (count, n)),
            "transfer": np.exp(0.05 * rng.standard_normal(count)),
            "jitter": rng.random((count, n)),
            "late": np.exp(0.5 * rng.standard_normal((count, GPUS)) - 0.125),
            "burst": np.exp(0.3 * rng.standard_normal(count) - 0.045),
            "flap": rng.random(count),
        }
        starts = t0 + estimate * np.arange(count)
        horizon = t0 + 3 * estimate * count
        timed = [
            w
            for w in (*self.checkpoints, *self.congestion, *self.hiccups)
            if w.start < horizon and w.end > t0
        ]
        fault = self.spec.fault
        faulted = fault is not None and fault.onset_s < horizon and fault.end_s > t0
        for _ in range(6):
            out = self._assemble(t0, starts, draws)
            if not timed and not faulted:
                break
            if np.allclose(out["starts"], starts, rtol=0, atol=1e-9):
                break
            starts = out["starts"]
        return out

    def _assemble(
        self, t0: float, starts: np.ndarray, draws: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        count = len(starts)
        cm = np.ones(count)
        xm = np.ones(count)
        version = np.zeros(count, np.int64)
        for i, (at, c, x) in enumerate(self.versions):
            on = starts >= at
            cm[on], xm[on], version[on] = c, x, i
        compute = self.compute0 * self.static * draws["compute"] * cm[:, None]
        idle = self.idle0 * draws["idle"]
        spikes = draws["spikes"] < 0.0005
        idle[spikes] += draws["spike_size"][spikes] * self.spec.step_s
        transfer = self.transfer0 * xm * draws["transfer"]
        end_t = starts[-1] + self.spec.step_s
        for w in self.checkpoints:
            if w.start < end_t and w.end > t0:
                hit = (starts >= w.start) & (starts < w.end)
                idle[hit] += w.value * (1 + 0.01 * draws["jitter"][hit])
        for w in self.congestion:
            if w.start < end_t and w.end > t0:
                hit = (starts >= w.start) & (starts < w.end)
                transfer[hit] += w.value * draws["burst"][hit]
        for w in self.hiccups:
            if w.start < end_t and w.end > t0:
                hit = (starts >= w.start) & (starts < w.end)
                cols = slice(w.node * GPUS, (w.node + 1) * GPUS)
                idle[hit, cols] += w.value
        fault = self.spec.fault
        hit = np.zeros(count, bool)
        if fault is not None and fault.onset_s < end_t and fault.end_s > t0:
            hit = (starts >= fault.onset_s) & (starts < fault.end_s)
            x = fault.magnitude
            if hit.any() and fault.cause == "compute":
                compute[hit, fault.rank] *= 1 + x
            elif hit.any() and fault.cause == "host":
                cols = slice(fault.node * GPUS, (fault.node + 1) * GPUS)
                own0 = self.compute0 * self.static[cols] + self.idle0
                idle[hit, cols] += 0.6 * x * own0 * draws["late"][hit]
                compute[hit, cols] *= 1 + 0.4 * x
            elif hit.any():
                step = self.spec.step_s
                if fault.kind == "link flapping":
                    transfer[hit] += np.where(draws["flap"][hit] < 0.25, 4 * x * step, 0.0)
                else:
                    transfer[hit] += x * step * draws["burst"][hit]
        arrival = idle + compute
        end = arrival.max(axis=1) + transfer
        comm = end[:, None] - arrival
        ends = t0 + np.cumsum(end)
        return {
            "compute": compute,
            "comm": comm,
            "idle": idle,
            "ends": ends,
            "starts": np.concatenate(([t0], ends[:-1])),
            "version": version,
            "faulty": hit,
        }

    def signs_at(self, now: float, last: float) -> Iterator[SimSign]:
        """The signs an agent reads between ``last`` and ``now`` (called with ``now`` rising)."""
        if not hasattr(self, "_pending"):
            self._pending = sorted(self.signs, key=lambda s: s.start, reverse=True)
            self._active: list[SimSign] = []
        while self._pending and self._pending[-1].start <= now:
            self._active.append(self._pending.pop())
        self._active = [s for s in self._active if s.end >= last]
        for sign in self._active:
            if sign.flaps is None or any(last < f <= now for f in sign.flaps):
                yield sign


def _matches(fault: Fault, straggler: Any) -> bool:
    if fault.cause == "compute":
        return bool(straggler.rank == fault.rank)
    if fault.cause == "host":
        return bool(straggler.node == f"n{fault.node}" and straggler.rank is not None)
    return bool(straggler.node == f"n{fault.node}" and straggler.rank is None)


def run_job(
    spec: JobSpec, report_s: float, eval_s: float, config: dict[str, Any] | None = None
) -> JobResult:
    """Simulate one job, feed the detector as the coordinator would, and score it."""
    sim = SyncJob(spec)
    detector = StragglerDetector(StragglerConfig(**(config or {})))
    evidence = detector.evidence
    result = JobResult(spec)
    n = sim.n
    ranks = np.arange(n)
    for rank in range(n):
        detector.attach(JOB, rank, f"n{rank // GPUS}", rank % GPUS)
    result.node_days = sim.nodes * spec.duration_s / DAY
    fault = spec.fault
    onset: float | None = None
    known: set[tuple[str, int | None, str | None]] = set()
    per_block = max(12, math.ceil(60 / spec.step_s))
    t = 0.0
    estimate = spec.step_s
    next_eval = eval_s
    last_signs = 0.0
    carry: dict[str, np.ndarray] | None = None

    def evaluate(at: float) -> None:
        nonlocal last_signs
        for sign in sim.signs_at(at, last_signs):
            seen = at if sign.flaps is None else max(f for f in sign.flaps if f <= at)
            evidence.note(f"n{sign.node}", sign.cause, sign.reason, seen, sign.gpu, sign.link)
        last_signs = at
        verdict = detector.evaluate(JOB, at)
        result.evaluations += 1
        keys = {(s.node, s.rank, s.link) for s in verdict.stragglers}
        fresh = [s for s in verdict.stragglers if (s.node, s.rank, s.link) not in known]
        known.clear()
        known.update(keys)
        in_fault = fault is not None and onset is not None and at >= onset
        if fault is not None and in_fault:
            slow = at <= fault.end_s + eval_s
            hits = [s for s in verdict.stragglers if _matches(fault, s)]
            if hits and result.detected_at is None and slow:
                result.detected_at = min(s.detected_at for s in hits)
                result.cause = str(hits[0].cause)
                result.since_error_s = hits[0].since - onset
            if at > fault.end_s and result.detected_at is not None:
                if not hits and result.cleared_after_s is None:
                    result.cleared_after_s = at - fault.end_s
            result.misnamed += sum(1 for s in fresh if not _matches(fault, s))
        else:
            nodes = dict.fromkeys(s.node for s in fresh)
            for node in nodes:
                kinds = sorted({str(s.cause) for s in fresh if s.node == node})
                result.alarms.append({"at": round(at, 1), "node": node, "causes": kinds})

    while t < spec.duration_s:
        block = sim.block(t, per_block, estimate)
        if carry is not None:
            block = {k: np.concatenate((carry[k], v)) for k, v in block.items()}
        ends = block["ends"]
        result.steps += per_block
        if fault is not None and onset is None:
            hit = np.flatnonzero(block["faulty"])
            if hit.size:
                onset = float(block["starts"][hit[0]])
        period = np.floor(ends / report_s).astype(np.int64)
        complete = period < period[-1]
        cut = int(complete.sum())
        if cut == 0:
            carry = block
            t = float(ends[-1])
            continue
        carry = {k: v[cut:] for k, v in block.items()}
        groups = np.flatnonzero(np.diff(period[:cut], prepend=-1))
        sums = {
            k: np.add.reduceat(block[k][:cut], groups, axis=0) for k in ("compute", "comm", "idle")
        }
        least = np.minimum.reduceat(block["comm"][:cut], groups, axis=0)
        counts = np.diff(np.append(groups, cut))
        for g, first in enumerate(groups.tolist()):
            now = float((period[first] + 1) * report_s)
            while next_eval < now:
                evaluate(next_eval)
                next_eval += eval_s
            detector.observe_arrays(
                JOB,
                ranks,
                sums["compute"][g],
                sums["comm"][g],
                sums["idle"][g],
                now,
                steps=int(counts[g]),
                version=int(block["version"][first + counts[g] - 1]),
                comm_min_s=least[g],
            )
            result.reports += n
        t = float(ends[-1])
        estimate = max(float(np.mean(np.diff(ends))) if len(ends) > 1 else estimate, 1e-3)
    while next_eval <= spec.duration_s:
        evaluate(next_eval)
        next_eval += eval_s
    result.onset_s = onset
    return result


def plan(episodes: int, healthy_hours: float, seed: int) -> tuple[list[JobSpec], list[JobSpec]]:
    """The episodes (magnitudes in turn, causes 2:1:1) and the healthy jobs (2-6 hours)."""
    rng = np.random.default_rng(seed)
    causes = ("compute", "host", "compute", "link")
    faulty: list[JobSpec] = []
    for i in range(episodes):
        magnitude = MAGNITUDES[i % len(MAGNITUDES)]
        cause = causes[(i // len(MAGNITUDES)) % len(causes)]
        ranks = int(rng.choice(RANKS))
        step = float(math.exp(rng.uniform(0, math.log(10))))
        pre = float(rng.uniform(600, 1200))
        kinds = {"compute": COMPUTE_KINDS, "host": HOST_KINDS, "link": LINK_KINDS}[cause]
        kind, _, expected = kinds[_choose(rng, kinds)]
        rank = int(rng.integers(ranks))
        node = rank // GPUS
        fault = Fault(
            cause, kind, magnitude, pre, pre + 600, rank, node, f"mlx5_{rank % GPUS}/1", expected
        )
        faulty.append(JobSpec(seed * 1_000_003 + i, ranks, step, pre + 900, fault))
    healthy: list[JobSpec] = []
    hours = 0.0
    j = 0
    while hours < healthy_hours - 1e-9:
        length = min(float(rng.uniform(2, 6)), healthy_hours - hours)
        ranks = int(rng.choice(RANKS))
        step = float(math.exp(rng.uniform(0, math.log(10))))
        healthy.append(JobSpec(seed * 1_000_003 + 500_000 + j, ranks, step, length * 3600))
        hours += length
        j += 1
    return faulty, healthy


def _run(args: tuple[JobSpec, float, float, dict[str, Any]]) -> JobResult:
    return run_job(*args)


def overrides(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as :class:`StragglerConfig` fields of their types."""
    fields = {f.name: f.type for f in dataclasses.fields(StragglerConfig)}
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {pair}: no such setting; one of {', '.join(fields)}")
        out[key] = int(value) if fields[key] in (int, "int") else float(value)
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def costs(repeat: int = 200) -> dict[str, float]:
    """Process time of the detector's calls, each timed over ``repeat`` calls on a job in its
    steady state (one clock read per batch: a read costs tens of microseconds on some VMs)."""
    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    for n in (16, 128, 1024):
        detector = StragglerDetector()
        for rank in range(n):
            detector.attach(JOB, rank, f"n{rank // GPUS}", rank % GPUS)
        ranks = np.arange(n)
        batches = [4.0 * rng.lognormal(0, 0.015, n) for _ in range(16)]
        now = 0.0
        for i in range(120):
            now += 5.0
            c = batches[i % 16]
            detector.observe_arrays(JOB, ranks, c, 5.0 - c, 0.05 + 0 * c, now, steps=4)
            detector.evaluate(JOB, now)
        began = time.process_time()
        for i in range(repeat):
            c = batches[i % 16]
            detector.observe_arrays(JOB, ranks, c, 5.0 - c, 0.05 + 0 * c, now + i, steps=4)
        out[f"observe_arrays_ns_per_report_{n}"] = (time.process_time() - began) / repeat / n * 1e9
        now += repeat
        began = time.process_time()
        for i in range(repeat):
            detector.evaluate(JOB, now + 0.01 * i)  # its ranks fresh: the whole judgement
        out[f"evaluate_us_{n}"] = (time.process_time() - began) / repeat * 1e6
    detector = StragglerDetector()
    steps = [RankStep(r, f"n{r // GPUS}", r % GPUS, 1.0, 0.8, 0.2, ended=1.0) for r in range(64)]
    count = 100 * repeat
    began = time.process_time()
    for i in range(count):
        detector.observe(JOB, steps[i % 64], i * 0.01)
    out["observe_us_per_report"] = (time.process_time() - began) / count * 1e6
    return out


def _cause(result: JobResult) -> str:
    return "" if result.spec.fault is None else result.spec.fault.cause


def _found(rows: list[JobResult], cause: str) -> str:
    """``detected/episodes`` of ``cause`` among ``rows``."""
    of = [r for r in rows if _cause(r) == cause]
    return f"{sum(1 for r in of if r.detected_at is not None)}/{len(of)}"


def summarize(faulty: list[JobResult], healthy: list[JobResult]) -> dict[str, Any]:
    out: dict[str, Any] = {"magnitudes": {}, "causes": {}}
    for magnitude in MAGNITUDES:
        rows = [r for r in faulty if r.spec.fault and r.spec.fault.magnitude == magnitude]
        if not rows:
            continue
        found = [r for r in rows if r.detected_at is not None]
        ttd = [r.detected_at - r.onset_s for r in found if r.onset_s is not None and r.detected_at]
        right = [r for r in found if r.spec.fault and r.cause == str(r.spec.fault.expected)]
        cleared = [r.cleared_after_s for r in found if r.cleared_after_s is not None]
        out["magnitudes"][f"{magnitude:.0%}"] = {
            "episodes": len(rows),
            "detected": len(found),
            "detected_ratio": len(found) / len(rows),
            "ttd_median_s": statistics.median(ttd) if ttd else math.nan,
            "ttd_p90_s": _quantile(ttd, 0.9),
            "cause_right_ratio": len(right) / len(found) if found else math.nan,
            "misnamed": sum(r.misnamed for r in rows),
            "cleared": len(cleared),
            "clear_median_s": statistics.median(cleared) if cleared else math.nan,
            "by_cause": {cause: _found(rows, cause) for cause in ("compute", "host", "link")},
        }
    node_days = sum(r.node_days for r in healthy)
    alarms = [a for r in healthy for a in r.alarms]
    warmup_alarms = [a for r in faulty for a in r.alarms]
    out["healthy"] = {
        "jobs": len(healthy),
        "job_hours": sum(r.spec.duration_s for r in healthy) / 3600,
        "node_days": node_days,
        "false_alarms": len(alarms),
        "false_alarms_per_1000_node_days": 1000 * len(alarms) / node_days
        if node_days
        else math.nan,
        "by_cause": {
            c: sum(1 for a in alarms if c in a["causes"])
            for c in sorted({c for a in alarms for c in a["causes"]})
        },
        "episode_warmup_alarms": len(warmup_alarms),
    }
    every = faulty + healthy
    out["cost"] = {
        "reports": sum(r.reports for r in every),
        "evaluations": sum(r.evaluations for r in every),
        "steps": sum(r.steps for r in every),
        **costs(),
    }
    return out


def print_summary(out: dict[str, Any], wall_s: float, args: argparse.Namespace) -> None:
    print(
        f"stragglers: {args.episodes} episodes, {args.healthy_hours:g} healthy job-hours, "
        f"reports every {args.report_s:g} s, judged every {args.eval_s:g} s, seed {args.seed}"
        + (f", {' '.join(args.set)}" if args.set else "")
    )
    print(
        f"{'slower':>6} {'episodes':>8} {'detected':>9} {'compute':>8} {'host':>6} {'link':>6} "
        f"{'ttd med':>8} {'ttd p90':>8} {'cause ok':>8} {'misnamed':>8} {'clear med':>9}"
    )
    for name, row in out["magnitudes"].items():
        by = row["by_cause"]
        print(
            f"{name:>6} {row['episodes']:>8} {row['detected_ratio']:>9.1%} {by['compute']:>8} "
            f"{by['host']:>6} {by['link']:>6} {row['ttd_median_s']:>7.0f}s "
            f"{row['ttd_p90_s']:>7.0f}s {row['cause_right_ratio']:>8.0%} {row['misnamed']:>8} "
            f"{row['clear_median_s']:>8.0f}s"
        )
    h = out["healthy"]
    print(
        f"healthy: {h['jobs']} jobs, {h['job_hours']:.0f} job-hours, {h['node_days']:.0f} "
        f"node-days: {h['false_alarms']} false alarms = "
        f"{h['false_alarms_per_1000_node_days']:.2f} per 1,000 node-days {h['by_cause'] or ''}; "
        f"before the episodes' onsets: {h['episode_warmup_alarms']}"
    )
    c = out["cost"]
    print(
        f"work: {c['steps']:,} steps simulated, {c['reports']:,} rank reports, "
        f"{c['evaluations']:,} evaluations; wall {wall_s:.0f} s"
    )
    print(
        "CPU: observe_arrays "
        + ", ".join(f"{c[f'observe_arrays_ns_per_report_{n}']:.0f}" for n in (16, 128, 1024))
        + " ns per report and evaluate "
        + ", ".join(f"{c[f'evaluate_us_{n}']:.0f}" for n in (16, 128, 1024))
        + f" us per call at 16, 128, 1,024 ranks; observe {c['observe_us_per_report']:.1f} us "
        "per lone report"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 episodes, 40 healthy job-hours")
    parser.add_argument("--episodes", type=int, default=None)
    parser.add_argument("--healthy-hours", type=float, default=None)
    parser.add_argument("--report-s", type=float, default=5.0)
    parser.add_argument("--eval-s", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=None, help="stop after this wall time")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a StragglerConfig field"
    )
    args = parser.parse_args()
    if args.episodes is None:
        args.episodes = 64 if args.quick else 1000
    if args.healthy_hours is None:
        args.healthy_hours = 40.0 if args.quick else 10_000.0
    if args.budget_s is None:
        args.budget_s = 55.0 if args.quick else 4 * 3600.0
    faulty_specs, healthy_specs = plan(args.episodes, args.healthy_hours, args.seed)
    began = time.monotonic()
    deadline = began + args.budget_s
    faulty: list[JobResult] = []
    healthy: list[JobResult] = []
    config = overrides(args.set)
    work = [(s, args.report_s, args.eval_s, config) for s in faulty_specs + healthy_specs]
    cut = False
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            for result in pool.map(_run, work, chunksize=4):
                (faulty if result.spec.fault else healthy).append(result)
                if time.monotonic() > deadline:
                    cut = True
                    pool.shutdown(wait=False, cancel_futures=True)
                    break
    else:
        for item in work:
            if time.monotonic() > deadline:
                cut = True
                break
            result = _run(item)
            (faulty if result.spec.fault else healthy).append(result)
    wall = time.monotonic() - began
    if cut:
        print(
            f"STOPPED at the {args.budget_s:g} s budget: {len(faulty)} of {len(faulty_specs)} "
            f"episodes and {len(healthy)} of {len(healthy_specs)} healthy jobs ran"
        )
    out = summarize(faulty, healthy)
    args.episodes = len(faulty)
    args.healthy_hours = out["healthy"]["job_hours"]
    print_summary(out, wall, args)
    if args.json is not None:
        out["machine"] = {
            "cpu": platform.processor() or platform.machine(),
            "nproc": os.cpu_count(),
        }
        out["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        out["wall_s"] = wall
        out["partial"] = cut
        out["episodes"] = [
            {
                **asdict(r.spec.fault),
                "ranks": r.spec.ranks,
                "step_s": r.spec.step_s,
                "detected_after_s": None
                if r.detected_at is None or r.onset_s is None
                else r.detected_at - r.onset_s,
                "cause": r.cause,
            }
            for r in faulty
            if r.spec.fault
        ]
        out["false_alarms"] = [
            {"seed": r.spec.seed, "ranks": r.spec.ranks, "step_s": r.spec.step_s, **alarm}
            for r in healthy
            for alarm in r.alarms
        ]
        args.json.write_text(json.dumps(out, indent=1, default=str))
    missing = []
    if not faulty:
        missing.append("no fail-slow episode ran")
    if not healthy:
        missing.append("no healthy job ran")
    if out["cost"]["reports"] == 0 or out["cost"]["evaluations"] == 0:
        missing.append("nothing was reported or judged")
    if faulty and all(r.onset_s is None for r in faulty):
        missing.append("no episode reached its fault")
    if missing:
        print(f"FAILED: the work did not happen: {'; '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

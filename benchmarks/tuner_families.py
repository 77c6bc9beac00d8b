"""Trials hyperagent's Tuner needs on landscapes it was not built on: random families.

``benchmarks/tuner.py`` measures the tuner on ``hyperagent/sim.py``'s jobs, whose optimum chunk
sizes and algorithm crossovers are the tuner's own seed table. Here every family (4, 16 or 128
nodes; throughput or energy; gloo, NCCL or Open MPI) is a distribution of landscapes drawn from
a seed, with the optimum anywhere:

- chunk optimum log-uniform over 64 KiB-64 MiB, one per algorithm, bucket optimum log-uniform
  over 1-256 MiB, each with its own loss per factor of two and a plateau around it of up to
  1.5 factors of two;
- the alternative algorithm (NCCL tree, Open MPI halving-doubling) beats ring above a crossover
  drawn log-uniform between 2 and 512 nodes, by 3-10% per doubling beyond it (at most 30%);
- interactions: a chunk larger than the bucket is the bucket (a plateau), the bucket optimum
  tilts with the chunk size and, for energy, with the power cap;
- energy: samples per joule peak at an efficient power cap anywhere within the limits
  (100-250 W), losing 4-15% per 25 W below it and 2-8% above, on top of the communication
  settings' throughput to a power of 0.5-1 (GPUs waiting on the network draw less); for
  throughput the cap is held at its highest value (``SearchSpace.for_objective``), where a
  step is never slower;
- a noisy ridge one grid step wide along a random line of (bucket, chunk) that adds up to 5%
  (a fresh draw per point), and a fixed 1% roughness on every point.

Each trial's score is the landscape's value times a lognormal factor whose sigma is one of the
relative standard errors the trial protocol measured (:data:`MEASURED_REL_SE`, drawn per trial;
``--noise`` sets a constant one instead); hyperagent is told that standard error, as the
coordinator tells it the windows' spread (for energy, of the windows' samples per joule that
the agents report with ``energy_windows``). Reaching
95% of the optimum is judged on the noiseless value; a search stops there, or at the budget
(40 trials; a miss counts as 41, shown ">40").

Methods, all over the space the coordinator searches for the objective:

- ``hyperagent``: :class:`hyperagent.tuner.optimizer.Tuner` as the coordinator builds it;
- ``no priors``: the same tuner without its seeds beyond the job's current settings
  (``priors=False``: neither BACKGROUND.md's table nor the energy seed);
- ``scikit-optimize``: plain ``skopt.Optimizer`` with its defaults (a Gaussian process,
  gp_hedge, 10 random initial points; ``benchmarks/tuner.py``'s encoding of the knobs);
- ``random``: points of the grid drawn without replacement.

Then "prior right": ``hyperagent/sim.py``'s eight landscapes (``benchmarks/tuner.py``'s jobs),
whose optima the seed table matches, at the same noise, ``--sim-seeds`` seeds each.

    python benchmarks/tuner_families.py [--landscapes 60] [--trials 40] [--jobs 2]
        [--families 4-nccl-throughput ...] [--json FILE] [--reuse FILE ...] [--seed 0]
    python benchmarks/tuner_families.py --cost [--arms full early] [--landscapes 60] ...

``--cost [--arms full early ...]`` runs whole tunings instead, as the coordinator does (its
default budget of 30 search trials, patience 10, the abort line, the four confirmations), each
trial measured window by window under the default plan (settling 3 s, windows of 1.25 s, at
least 4, on until 2% standard error or 16), a window's spread being the drawn standard error
times sqrt(8) (the demo's trials had 5-8 windows). Per family it reports the median wall time,
samples lost against the start (:mod:`hyperagent.tuner.cost`; for energy at a constant power,
so in joules as in seconds), the break-even at the chosen settings and their noiseless value,
for every trial measured in full (``full``) and with :mod:`hyperagent.tuner.early`'s rule
(``early``), and how many early stops were wrong in truth.

``--reuse FILE ...`` takes the baselines' runs (scikit-optimize and random search) from earlier
``--json`` files (those of the same seed, noise and budget) and measures only what they lack
and hyperagent's tuner, again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from skopt import Optimizer
from threadpoolctl import threadpool_limits

sys.path[:0] = [str(Path(__file__).resolve().parent)]

import tuner as sim_benchmark  # noqa: E402

from hyperagent.tuner.cost import Span, duration_text, tuning_cost  # noqa: E402
from hyperagent.tuner.early import EarlyStop, Verdict, told  # noqa: E402
from hyperagent.tuner.optimizer import Tuner  # noqa: E402
from hyperagent.tuner.space import OBJECTIVES, SearchSpace, Settings  # noqa: E402
from hyperagent.tuner.trial import MeasurementPlan, compare  # noqa: E402

NODES = (4, 16, 128)
BACKENDS = ("gloo", "nccl", "mpi")
POWER_LIMITS_W = (100.0, 250.0)
TARGET = 0.95
TRIALS = 40
LANDSCAPES = 60
"""Per family. The 90th percentile is the nearest rank: at 30 landscapes the third-worst, which
moved plain scikit-optimize's by up to 13 trials (128 nodes, gloo, energy: 27 at 30, 40 at
60) and a change to the search moved single families' by several trials either way."""
SIM_SEEDS = 10
MEASURED_REL_SE = (0.019, 0.027, 0.070, 0.019, 0.040, 0.051, 0.033, 0.084, 0.043, 0.027, 0.106)
"""Relative standard errors of the trials' scores (the windows' spread) that
``hyperagent demo --workload torch-ddp`` measured on a loaded 2-core machine (2026-12-03, its
10 trials and 4 confirmations but the 3 aborted ones): median 4.0%, the windows' own
coefficient of variation 11% (median). A trial draws one of them."""
PRIOR_RIGHT_MEDIAN = 10
CHECKPOINT_EVERY = 10
HYPERAGENT, NO_PRIORS, SKOPT, RANDOM = "hyperagent", "no priors", "scikit-optimize", "random"
METHODS = (HYPERAGENT, NO_PRIORS, SKOPT, RANDOM)
TUNERS = (HYPERAGENT, NO_PRIORS)


@dataclass(frozen=True)
class Family:
    """Landscapes of one node count, objective and backend."""

    nodes: int
    objective: str
    backend: str

    @property
    def name(self) -> str:
        return f"{self.nodes}-{self.backend}-{self.objective}"

    @property
    def full_space(self) -> SearchSpace:
        return SearchSpace.default(self.backend, self.nodes, POWER_LIMITS_W)

    @property
    def space(self) -> SearchSpace:
        """What the coordinator searches for this objective."""
        return self.full_space.for_objective(self.objective)


FAMILIES = tuple(
    Family(nodes, objective, backend)
    for nodes in NODES
    for objective in OBJECTIVES
    for backend in BACKENDS
)


def _loss(distance: float, slope: float, plateau: float) -> float:
    """The factor a knob costs at ``distance`` (factors of two, or 25 W steps) from its
    optimum: flat within ``plateau``, then ``1 / (1 + slope * excess)``."""
    return 1.0 / (1.0 + slope * max(0.0, abs(distance) - plateau))


@dataclass(frozen=True)
class Landscape:
    """One landscape of a family, drawn from ``(seed, family, index)``."""

    family: Family
    index: int
    seed: int

    @cached_property
    def _draw(self) -> dict[str, Any]:
        rng = random.Random(f"{self.seed}/{self.family.name}/{self.index}")
        space = self.family.full_space
        low_w, high_w = POWER_LIMITS_W
        bucket_lo, bucket_hi = math.log2(space.bucket_mb[0]), math.log2(space.bucket_mb[-1])
        chunk_lo, chunk_hi = math.log2(space.chunk_kb[0]), math.log2(space.chunk_kb[-1])
        crossover = 2 ** rng.uniform(1, 9)
        advantage = rng.uniform(0.03, 0.10) * math.log2(self.family.nodes / crossover)
        return {
            "chunk_opt": {a: rng.uniform(chunk_lo, chunk_hi) for a in space.allreduce},
            "chunk_slope": rng.uniform(0.04, 0.15),
            "chunk_plateau": rng.uniform(0.0, 1.5),
            "bucket_opt": rng.uniform(bucket_lo, bucket_hi),
            "bucket_slope": rng.uniform(0.03, 0.12),
            "bucket_plateau": rng.uniform(0.0, 1.5),
            "bucket_tilt": rng.uniform(-0.5, 0.5),
            "algorithm_gain": {
                a: (0.0 if a == "ring" else max(-0.3, min(0.3, advantage))) for a in space.allreduce
            },
            "crossover_nodes": crossover,
            "power_opt_w": rng.uniform(low_w, high_w),
            "power_slope_below": rng.uniform(0.04, 0.15),
            "power_slope_above": rng.uniform(0.02, 0.08),
            "power_plateau": rng.uniform(0.0, 1.0),
            "power_tilt": rng.uniform(-1.0, 1.0),
            "energy_exponent": rng.uniform(0.5, 1.0),
            "knee_w": rng.uniform(low_w, high_w),
            "knee_slope": rng.uniform(0.03, 0.10),
            "ridge": (rng.uniform(chunk_lo, chunk_hi), rng.choice((-1, 0, 1))),
            "ridge_rng": rng.random(),
        }

    def _smooth(self, settings: Settings) -> float:
        d = self._draw
        low_w, high_w = POWER_LIMITS_W
        algorithm = str(settings.get("allreduce", "ring"))
        cap = float(settings.get("power_cap_w", high_w))
        bucket = math.log2(settings["bucket_mb"])
        chunk = min(math.log2(settings["chunk_kb"]), bucket + 10)  # a chunk holds one bucket
        chunk_opt = d["chunk_opt"][algorithm]
        bucket_opt = d["bucket_opt"] + d["bucket_tilt"] * (chunk - chunk_opt)
        if self.family.objective == "energy":
            bucket_opt += d["power_tilt"] * 2 * (cap - d["power_opt_w"]) / (high_w - low_w)
        comm = (
            (1 + d["algorithm_gain"][algorithm])
            * _loss(chunk - chunk_opt, d["chunk_slope"], d["chunk_plateau"])
            * _loss(bucket - bucket_opt, d["bucket_slope"], d["bucket_plateau"])
        )
        if self.family.objective == "throughput":
            below_knee = max(0.0, (d["knee_w"] - cap) / 25)
            return comm * _loss(below_knee, d["knee_slope"], 0.0)
        steps = (cap - d["power_opt_w"]) / 25
        slope = d["power_slope_below"] if steps < 0 else d["power_slope_above"]
        return comm ** d["energy_exponent"] * _loss(steps, slope, d["power_plateau"])

    @cached_property
    def values(self) -> dict[tuple[Any, ...], float]:
        """The noiseless value of every point of the full space (power cap included)."""
        d = self._draw
        rng = random.Random(d["ridge_rng"])
        ridge_chunk, ridge_slope = d["ridge"]
        space = self.family.full_space
        values = {}
        for point in space.grid():
            bucket = math.log2(point["bucket_mb"])
            chunk = math.log2(point["chunk_kb"])
            on_ridge = abs(chunk - (ridge_chunk + ridge_slope * (bucket - 4))) < 0.5
            ridge = 1 + (rng.uniform(0.0, 0.05) if on_ridge else 0.0)
            rough = rng.lognormvariate(0.0, 0.01)
            values[self._key(point)] = self._smooth(point) * ridge * rough
        return values

    @staticmethod
    def _key(settings: Settings) -> tuple[Any, ...]:
        return tuple(settings.get(k) for k in ("bucket_mb", "chunk_kb", "power_cap_w", "allreduce"))

    def value(self, settings: Settings) -> float:
        full = self.family.full_space.snap(settings)
        return self.values[self._key(full)]

    @cached_property
    def target(self) -> float:
        return TARGET * max(self.value(p) for p in self.family.space.grid())


@dataclass(frozen=True)
class Problem:
    """What a method searches: a space, an objective, noiseless values and the target, and
    the noise of a measurement (None: :data:`MEASURED_REL_SE`)."""

    space: SearchSpace
    objective: str
    value: Callable[[Settings], float]
    target: float
    noise: float | None

    def on_target(self, settings: Settings) -> bool:
        return self.value(settings) >= self.target

    def measure(self, settings: Settings, rng: random.Random) -> tuple[float, float]:
        """(score, its standard error): the value times a lognormal factor whose sigma is a
        standard error the trial protocol measured (or ``noise``)."""
        sigma = rng.choice(MEASURED_REL_SE) if self.noise is None else self.noise
        score = self.value(settings) * rng.lognormvariate(0.0, sigma)
        return score, sigma * score


def tuner_trials(problem: Problem, seed: int, trials: int, priors: bool = True) -> int | None:
    """Trials hyperagent's tuner takes to the target (None: not within ``trials``)."""
    rng = random.Random(1000 + seed)
    tuner = Tuner(problem.space, seed=seed, objective=problem.objective, priors=priors)
    for trial in range(1, trials + 1):
        settings = tuner.ask()
        if problem.on_target(settings):
            return trial
        score, error = problem.measure(settings, rng)
        tuner.tell(settings, score, noise=error)
    return None


def skopt_trials(problem: Problem, seed: int, trials: int) -> int | None:
    """Plain ``skopt.Optimizer`` with its defaults, minimising the negated score."""
    space = problem.space
    dimensions = sim_benchmark.skopt_dimensions(space)

    optimizer = Optimizer(dimensions, random_state=seed)
    rng = random.Random(1000 + seed)
    with warnings.catch_warnings(), threadpool_limits(limits=1, user_api="blas"):
        warnings.simplefilter("ignore", UserWarning)  # "objective has been evaluated at point"
        for trial in range(1, trials + 1):
            point = optimizer.ask()
            settings = sim_benchmark.skopt_settings(space, dimensions, point)
            if problem.on_target(settings):
                return trial
            optimizer.tell(point, -problem.measure(settings, rng)[0])
    return None


def random_trials(problem: Problem, seed: int, trials: int) -> int | None:
    grid = list(problem.space.grid())
    for trial, settings in enumerate(random.Random(seed).sample(grid, min(trials, len(grid))), 1):
        if problem.on_target(settings):
            return trial
    return None


def run_method(method: str, problem: Problem, seed: int, trials: int) -> int | None:
    if method == HYPERAGENT:
        return tuner_trials(problem, seed, trials)
    if method == NO_PRIORS:
        return tuner_trials(problem, seed, trials, priors=False)
    if method == SKOPT:
        return skopt_trials(problem, seed, trials)
    return random_trials(problem, seed, trials)


def family_problem(landscape: Landscape, noise: float | None) -> Problem:
    space = landscape.family.space
    return Problem(space, landscape.family.objective, landscape.value, landscape.target, noise)


def sim_problem(landscape: sim_benchmark.Landscape, noise: float | None) -> Problem:
    space = landscape.space.for_objective(landscape.objective)
    best = max(landscape.value(p) for p in space.grid())
    return Problem(space, landscape.objective, landscape.value, TARGET * best, noise)


def sim_landscapes() -> tuple[sim_benchmark.Landscape, ...]:
    """``benchmarks/tuner.py``'s jobs, both objectives (their noise is not used here)."""
    return tuple(
        sim_benchmark.Landscape(job, objective, 0.0)
        for job in sim_benchmark.JOBS
        for objective in OBJECTIVES
    )


# -- the tuning's cost, with and without early-stopped trials (--cost) --------------------

PLAN = MeasurementPlan()
"""The coordinator's default measurement: at least 4 windows of 1.25 s, on until the standard
error is 2% of the score or 16 windows are done, after 3 s of settling."""
ACK_S = 0.5
"""Seconds from publishing a trial's settings to every node's ack."""
DEMO_WINDOWS = 8
"""Windows behind each of :data:`MEASURED_REL_SE` (the demo's plan stops at 8): a window's own
spread is that standard error times sqrt(8), a median of 11%, as the demo measured."""
ABORT_BELOW = 0.7
PATIENCE = 10
CONFIRM_ORDER = ("start", "best", "best", "start")
COST_TRIALS = 30
"""The coordinator's default budget of search trials."""
ARMS: dict[str, Callable[[str], EarlyStop | None]] = {
    "full": lambda objective: None,
    "early": lambda objective: EarlyStop.for_objective(objective, energy_windows=True),
    "early-both": lambda objective: EarlyStop(),
    "early-worse": lambda objective: EarlyStop(stop_better=False),
    "early-2": lambda objective: EarlyStop(min_windows=2),
}
"""Each arm's rule for an objective. ``full``: every trial measured to the plan's end (the
guardrail's abort alone ends one early); ``early``: the coordinator's rule
(:meth:`hyperagent.tuner.early.EarlyStop.for_objective` with the agents' energy windows), which
stops a search trial once it is clearly worse than the incumbent or clearly better, each
window's samples per joule judged for energy as samples per second for throughput;
``early-both``: both cuts whatever the objective;
``early-worse``: only when worse; ``early-2``: both, judged from the second window on."""


@dataclass
class SimulatedRun:
    """One trial (or confirmation) of a simulated tuning."""

    settings: Settings
    windows: list[float]
    status: str
    """ok, aborted, worse or better (the last two: stopped early)."""

    @property
    def seconds(self) -> float:
        return ACK_S + PLAN.settle_s + len(self.windows) * PLAN.window_s

    @property
    def score(self) -> float:
        return statistics.median(self.windows) if self.status == "ok" else told(self.windows)[0]


def measure_run(
    problem: Problem,
    settings: Settings,
    rng: random.Random,
    baseline: float | None = None,
    incumbent: list[float] | None = None,
    early: EarlyStop | None = None,
) -> SimulatedRun:
    """Measure ``settings`` window by window as an agent does, stopping as the coordinator
    would: the abort line (throughput only: energy has no partial score), the early rule
    against ``incumbent``'s windows, the plan's precision or its cap."""
    sigma = rng.choice(MEASURED_REL_SE) if problem.noise is None else problem.noise
    spread = sigma * math.sqrt(DEMO_WINDOWS)
    value = problem.value(settings)
    windows: list[float] = []
    while True:
        windows.append(value * rng.lognormvariate(0.0, spread))
        mean = statistics.fmean(windows)
        if baseline is not None and problem.objective == "throughput":
            if mean < ABORT_BELOW * baseline:
                return SimulatedRun(settings, windows, "aborted")
        if early is not None and incumbent:
            verdict = early.judge(windows, incumbent)
            if verdict is not Verdict.MEASURE_ON:
                return SimulatedRun(settings, windows, str(verdict))
        n = len(windows)
        if n >= PLAN.windows and (
            n >= PLAN.window_cap or statistics.stdev(windows) / math.sqrt(n) <= 0.02 * mean
        ):
            return SimulatedRun(settings, windows, "ok")


def simulate_tuning(
    problem: Problem, seed: int, early: EarlyStop | None, trials: int = COST_TRIALS
) -> dict[str, Any]:
    """One whole tuning as the coordinator runs it: search trials up to the budget or until
    the tuner converged, the confirmations (start, best, best, start, full length), the
    chosen settings. A settings' n-th measurement draws the same noise whatever the arm, so
    arms differ by their rules alone."""
    tuner = Tuner(problem.space, seed=seed, objective=problem.objective)
    seen: dict[tuple[Any, ...], int] = {}

    def rng_for(settings: Settings) -> random.Random:
        key = tuple(sorted(settings.items()))
        seen[key] = seen.get(key, 0) + 1
        return random.Random(f"{seed}/{key}/{seen[key]}")

    runs: list[SimulatedRun] = []
    best: SimulatedRun | None = None
    cuts = {"worse": 0, "better": 0, "false_worse": 0, "false_better": 0}
    for _ in range(trials):
        settings = tuner.ask()
        baseline = runs[0].score if runs else None
        run = measure_run(
            problem, settings, rng_for(settings), baseline, best.windows if best else None, early
        )
        runs.append(run)
        if run.status in ("worse", "better") and best is not None:
            cuts[run.status] += 1
            truth, against = problem.value(run.settings), problem.value(best.settings)
            if run.status == "worse" and truth >= against:
                cuts["false_worse"] += 1
            elif run.status == "better" and truth < against:
                cuts["false_better"] += 1
        noise = told(run.windows)[1]
        tuner.tell(settings, run.score, noise=None if run.status == "aborted" else noise)
        if run.status != "aborted" and (best is None or run.score > best.score):
            best = run
        if tuner.n_told >= PATIENCE and tuner.converged(PATIENCE):
            break
    assert best is not None
    searched = len(runs)
    start = runs[0].settings
    chosen, start_score, best_score = best.settings, runs[0].score, best.score
    candidate = (tuner.best or (best.settings, 0.0))[0]
    if candidate == start:
        others = [r for r in runs if r.status != "aborted" and r.settings != start]
        candidate = max(others, key=lambda r: r.score).settings if others else start
    if candidate != start:
        samples: dict[str, list[float]] = {"start": [], "best": []}
        for which in CONFIRM_ORDER:
            settings = start if which == "start" else candidate
            run = measure_run(problem, settings, rng_for(settings))
            runs.append(run)
            samples[which] += run.windows
        gain = compare(samples["start"], samples["best"])
        if gain is not None:
            start_score = gain.baseline
            chosen, best_score = (candidate, gain.best) if gain.better else (start, gain.baseline)
    spans = [Span(r.seconds, statistics.fmean(r.windows), 1.0) for r in runs]
    cost = tuning_cost(spans, problem.objective, start_score, best_score, 1.0, 1.0)
    optimum = problem.target / TARGET
    return {
        "searched": searched,
        "seconds": cost.seconds,
        "quality": problem.value(chosen) / optimum,
        "lost_ratio": cost.lost_ratio,
        "break_even_s": cost.break_even_s,
        "windows": sum(len(r.windows) for r in runs),
        **cuts,
    }


CostTask = tuple[str, int, str, int, float | None]
"""(family name, landscape index, arm, seed, noise)."""


def _cost_task(task: CostTask) -> tuple[CostTask, dict[str, Any]]:
    name, index, arm, seed, noise = task
    family = next(f for f in FAMILIES if f.name == name)
    problem = family_problem(Landscape(family, index, seed), noise)
    with threadpool_limits(limits=1, user_api="blas"):
        return task, simulate_tuning(problem, index, ARMS[arm](family.objective))


def _median_break_even(values: list[float | None]) -> float | None:
    """The median, a tuning that never breaks even counting as the longest (None: never)."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    return ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else _mid(ordered)


def _mid(ordered: list[float | None]) -> float | None:
    a, b = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
    return None if a is None or b is None else (a + b) / 2


def cost_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    judged = sum(r["worse"] + r["better"] for r in rows)
    losing = [r for r in rows if r["lost_ratio"] > 0]
    return {
        "seconds": statistics.median(r["seconds"] for r in rows),
        "quality": statistics.median(r["quality"] for r in rows),
        "lost_ratio": statistics.median(r["lost_ratio"] for r in rows),
        "break_even_s": _median_break_even([r["break_even_s"] for r in rows]),
        "never": sum(r["break_even_s"] is None for r in rows),
        "losing": len(losing),
        "losing_lost_ratio": statistics.median(r["lost_ratio"] for r in losing) if losing else None,
        "losing_break_even_s": _median_break_even([r["break_even_s"] for r in losing])
        if losing
        else None,
        "searched": statistics.median(r["searched"] for r in rows),
        "worse": sum(r["worse"] for r in rows),
        "better": sum(r["better"] for r in rows),
        "false_worse": sum(r["false_worse"] for r in rows),
        "false_better": sum(r["false_better"] for r in rows),
        "judged": judged,
    }


def cost_main(args: argparse.Namespace, chosen: list[str]) -> int:
    """``--cost``: every family's tunings in each arm, their cost and their wall time."""
    arms = args.arms
    tasks: list[CostTask] = [
        (name, index, arm, args.seed, args.noise)
        for name in chosen
        for index in range(args.landscapes)
        for arm in arms
    ]
    started = time.perf_counter()
    results: dict[CostTask, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for task, row in pool.map(_cost_task, tasks, chunksize=1):
            results[task] = row
    elapsed = time.perf_counter() - started
    idle = [f"{t[0]} #{t[1]} {t[2]}" for t, row in results.items() if not row["searched"] > 0]
    if len(results) < len(tasks) or idle:
        print(
            f"FAILED: the tunings did not happen: {len(results)} of {len(tasks)} ran"
            + (f"; no trial searched in {', '.join(idle)}" if idle else "")
        )
        return 1
    report: dict[str, Any] = {
        "families": {},
        "seconds": elapsed,
        "noise": args.noise,
        "runs": [{"task": list(t), **row} for t, row in results.items()],
    }
    for name in chosen:
        report["families"][name] = {
            arm: cost_summary(
                [results[(name, i, arm, args.seed, args.noise)] for i in range(args.landscapes)]
            )
            for arm in arms
        }
    noise = "measured" if args.noise is None else f"{args.noise:.0%}"
    table = Table(
        title=(
            f"The tuning's cost, median over {args.landscapes} landscapes per family (seed"
            f" {args.seed}, noise {noise}): wall time, samples lost (share of the tuning's time"
            f" at the start's rate), break-even at the chosen settings; of the tunings that lost"
            f" samples, how many, their median loss and break-even; final value (share of the"
            f" optimum)"
        ),
        title_justify="left",
    )
    table.add_column("family")
    metrics = ("wall", "lost", "break-even", "losing", "final")
    for what in metrics:
        for arm in arms:
            table.add_column(f"{what} {arm}", justify="right")
    if "full" in arms:
        table.add_column("wall saved", justify="right")
    for name, figures in report["families"].items():
        cells = []
        for what in metrics:
            for arm in arms:
                f = figures[arm]
                if what == "wall":
                    cells.append(duration_text(f["seconds"]))
                elif what == "lost":
                    cells.append(f"{f['lost_ratio']:.1%}")
                elif what == "break-even":
                    even = f["break_even_s"]
                    cells.append("never" if even is None else duration_text(even))
                elif what == "losing":
                    even = f["losing_break_even_s"]
                    when = "never" if even is None else duration_text(even)
                    share = f["losing_lost_ratio"]
                    lost = "" if share is None else f" {share:.1%},"
                    cells.append(f"{f['losing']}:{lost} {when}" if f["losing"] else "0")
                else:
                    cells.append(f"{f['quality']:.1%}")
        if "full" in arms:
            full = figures["full"]["seconds"]
            saved = [f"{1 - figures[a]['seconds'] / full:.0%}" for a in arms if a != "full"]
            cells.append(" ".join(saved))
        table.add_row(name, *cells)
    Console(width=200).print(table)
    console = Console(width=200)
    for arm in arms:
        if arm == "full":
            continue
        rows = [v for k, v in results.items() if k[2] == arm]
        summary_ = cost_summary(rows)
        console.print(
            f"{arm}: {summary_['worse']} trials stopped as worse ({summary_['false_worse']} of"
            f" them in truth at least as good as the incumbent:"
            f" {summary_['false_worse'] / max(1, summary_['worse']):.1%}), {summary_['better']}"
            f" as better ({summary_['false_better']} in truth worse)"
        )
        if "full" in arms:
            full_rows = [v for k, v in results.items() if k[2] == "full"]
            wall = 1 - statistics.median(r["seconds"] for r in rows) / statistics.median(
                r["seconds"] for r in full_rows
            )
            quality = statistics.median(r["quality"] for r in rows) - statistics.median(
                r["quality"] for r in full_rows
            )
            mark = "ok" if wall >= 0.25 and quality >= -0.01 else "MISSED"
            console.print(
                f"done-when {mark:6} {arm}: median wall time {wall:.0%} lower (>= 25%), median"
                f" final value {quality:+.1%} of the optimum against full trials (>= -1%)"
            )
    console.print(f"total {elapsed:.0f} s with {args.jobs} worker(s), {len(tasks)} tunings")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


Task = tuple[str, str, int, str, int, int, float | None]
"""(kind "family" or "sim", family or landscape name, index, method, seed, trials, noise)."""


def _task(task: Task) -> tuple[Task, int | None]:
    kind, name, index, method, seed, trials, noise = task
    if kind == "family":
        family = next(f for f in FAMILIES if f.name == name)
        problem = family_problem(Landscape(family, index, seed), noise)
        return task, run_method(method, problem, index, trials)
    landscape = next(ls for ls in sim_landscapes() if ls.name == name)
    return task, run_method(method, sim_problem(landscape, noise), index, trials)


def counted(reached: list[int | None], trials: int) -> list[int]:
    return [trials + 1 if r is None else r for r in reached]


def percentile(values: list[int], share: float) -> float:
    """The ``share`` quantile (nearest rank)."""
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(share * len(ordered)) - 1)])


def summary(reached: list[int | None], trials: int) -> dict[str, Any]:
    values = counted(reached, trials)
    return {
        "reached_at": reached,
        "median": statistics.median(values),
        "p90": percentile(values, 0.9),
        "missed": sum(r is None for r in reached),
    }


def _cell(value: float, trials: int) -> str:
    return f">{trials}" if value > trials else f"{value:g}"


def _write_runs(path: Path, results: dict[Task, int | None], **report: Any) -> None:
    runs = [{"task": list(t), "reached_at": r} for t, r in results.items()]
    path.write_text(json.dumps({**report, "runs": runs}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--landscapes", type=int, default=LANDSCAPES, help="per family (60)")
    parser.add_argument("--trials", type=int, default=TRIALS, help="budget per search (40)")
    parser.add_argument(
        "--noise", type=float, default=None, help="a constant sigma (the measured ones)"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the landscapes (0)")
    parser.add_argument("--sim-seeds", type=int, default=SIM_SEEDS, help="prior right (10)")
    parser.add_argument("--families", nargs="+", default=None, help="e.g. 16-mpi-energy")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--reuse", type=Path, nargs="+", default=[], help="the baselines' runs from these"
    )
    parser.add_argument(
        "--cost", action="store_true", help="whole tunings: their cost and wall time per arm"
    )
    parser.add_argument("--arms", nargs="+", default=["full", "early"], choices=list(ARMS))
    args = parser.parse_args(argv)
    if min(args.landscapes, args.trials, args.jobs) < 1 or args.sim_seeds < 0:
        parser.error("--landscapes, --trials and --jobs must be positive")
    names = [f.name for f in FAMILIES]
    chosen = args.families or names
    if unknown := set(chosen) - set(names):
        parser.error(f"unknown families {sorted(unknown)}; choose from {', '.join(names)}")
    if args.cost:
        return cost_main(args, chosen)
    methods = [m for m in METHODS if m in args.methods]
    sims = [ls.name for ls in sim_landscapes()]
    noise = "measured" if args.noise is None else f"{args.noise:.0%}"
    sim_methods = [m for m in (HYPERAGENT, NO_PRIORS, RANDOM) if m in methods]

    tasks: list[Task] = [
        ("family", name, index, method, args.seed, args.trials, args.noise)
        for method in methods  # scikit-optimize, the slowest, before the tuners' tails
        for name in chosen
        for index in range(args.landscapes)
    ]
    tasks.sort(key=lambda t: t[3] != SKOPT)
    tasks += [
        ("sim", name, index, method, args.seed, args.trials, args.noise)
        for method in sim_methods
        for name in sims
        for index in range(args.sim_seeds)
    ]
    results: dict[Task, int | None] = {}
    for path in args.reuse:
        for row in json.loads(path.read_text())["runs"]:
            task = tuple(row["task"])
            if task[3] not in TUNERS:
                results[task] = row["reached_at"]  # type: ignore[index]
    todo = [t for t in tasks if t not in results]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for done, (task, reached) in enumerate(pool.map(_task, todo, chunksize=1), 1):
            results[task] = reached
            if args.json is not None and done % CHECKPOINT_EVERY == 0:
                _write_runs(args.json, results)  # a run cut short can be --reuse'd
    elapsed = time.perf_counter() - started
    if len(results) < len(tasks):
        print(f"FAILED: the searches did not happen: {len(results)} of {len(tasks)} ran")
        return 1

    def reached_of(kind: str, name: str, method: str, count: int) -> list[int | None]:
        return [
            results[(kind, name, i, method, args.seed, args.trials, args.noise)]
            for i in range(count)
        ]

    report: dict[str, Any] = {"families": {}, "sim": {}}
    for name in chosen:
        report["families"][name] = {
            m: summary(reached_of("family", name, m, args.landscapes), args.trials) for m in methods
        }
    for name in sims if args.sim_seeds else []:
        report["sim"][name] = {
            m: summary(reached_of("sim", name, m, args.sim_seeds), args.trials) for m in sim_methods
        }

    console = Console(width=160)
    table = Table(
        title=(
            f"Trials to {TARGET:.0%} of the optimum, median / p90 over {args.landscapes}"
            f" landscapes per family (seed {args.seed}, noise {noise},"
            f" budget {args.trials})"
        ),
        title_justify="left",
    )
    table.add_column("family")
    for m in methods:
        table.add_column(m, justify="right")
    table.add_column("ours <= skopt", justify="right")
    verdicts = []
    for name, figures in report["families"].items():
        cells = [
            f"{_cell(f['median'], args.trials)} / {_cell(f['p90'], args.trials)}"
            for f in figures.values()
        ]
        verdict = ""
        if HYPERAGENT in figures and SKOPT in figures:
            ours, theirs = figures[HYPERAGENT], figures[SKOPT]
            ok = ours["median"] <= theirs["median"] and ours["p90"] <= theirs["p90"]
            verdicts.append(ok)
            verdict = "ok" if ok else "MISSED"
        table.add_row(name, *cells, verdict)
    console.print(table)
    if report["sim"]:
        table = Table(
            title=(
                f"Prior right: hyperagent/sim.py's landscapes, median / p90 over"
                f" {args.sim_seeds} seeds (noise {noise}, budget {args.trials})"
            ),
            title_justify="left",
        )
        table.add_column("landscape")
        for m in sim_methods:
            table.add_column(m, justify="right")
        for name, figures in report["sim"].items():
            table.add_row(
                name.rsplit(", ", 1)[0],  # without the unused noise
                *(
                    f"{_cell(f['median'], args.trials)} / {_cell(f['p90'], args.trials)}"
                    for f in figures.values()
                ),
            )
        console.print(table)
        if HYPERAGENT in sim_methods:
            worst = max(f[HYPERAGENT]["median"] for f in report["sim"].values())
            mark = "ok" if worst <= PRIOR_RIGHT_MEDIAN else "MISSED"
            console.print(
                f"done-when {mark:6} prior right: hyperagent's highest median {worst:g}"
                f" (<= {PRIOR_RIGHT_MEDIAN})"
            )
    if verdicts:
        mark = "ok" if all(verdicts) else "MISSED"
        console.print(
            f"done-when {mark:6} hyperagent's median and p90 at most plain scikit-optimize's"
            f" on {sum(verdicts)} of {len(verdicts)} families"
        )
    console.print(f"total {elapsed:.0f} s with {args.jobs} worker(s), {len(todo)} searches")
    if args.json is not None:
        _write_runs(args.json, results, **report, seconds=elapsed, noise=args.noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())

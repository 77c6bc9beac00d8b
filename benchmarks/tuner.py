"""How fast hyperagent's Tuner finds good settings on the simulated job, against random search.

For each landscape (a simulated job, backend and objective) and seed, both methods get the same
budget of trials. A trial's score is what the coordinator would measure: the median of four
noisy windows (``JobModel.score`` with an rng). Reaching 95% of the optimum is judged on the
noiseless value of the evaluated settings against the exhaustive optimum; a run that never
reaches it shows as ">budget". Final regret is ``1 - value(pick) / optimum``, noiseless, where
the pick is ``Tuner.best`` for hyperagent and the best measurement for random search, which
draws points of the grid uniformly without replacement. Also times one ask+tell at 25, 50 and
100 observations.

    python benchmarks/tuner.py [--seeds 10] [--trials 60] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from hyperagent.sim import JobModel
from hyperagent.tuner import SearchSpace, Settings, Tuner

WINDOWS = 4
TARGET = 0.95


@dataclass(frozen=True)
class Landscape:
    """A simulated job, the backend whose space is searched, and the objective."""

    name: str
    model: JobModel
    backend: str = "nccl"
    objective: str = "throughput"

    @property
    def space(self) -> SearchSpace:
        return self.model.space(self.backend)

    def measure(self, settings: Settings, rng: random.Random) -> float:
        return statistics.median(
            self.model.score(settings, self.objective, rng) for _ in range(WINDOWS)
        )

    def value(self, settings: Settings) -> float:
        return self.model.score(settings, self.objective)


LANDSCAPES = (
    Landscape("4 nodes, 1.3B, throughput", JobModel(nodes=4, params_b=1.3, noise=0.05)),
    Landscape(
        "4 nodes, 1.3B, energy", JobModel(nodes=4, params_b=1.3, noise=0.05), objective="energy"
    ),
    Landscape(
        "16 nodes, 0.35B, throughput, mpi",
        JobModel(nodes=16, params_b=0.35, noise=0.05),
        backend="mpi",
    ),
    Landscape("128 nodes, 1.3B, throughput", JobModel(nodes=128, params_b=1.3, noise=0.05)),
    Landscape(
        "16 nodes, 7B, 400 Gb/s, energy, mpi",
        JobModel(nodes=16, params_b=7.0, samples_per_gpu=4, link_gbps=400.0, noise=0.05),
        backend="mpi",
        objective="energy",
    ),
)
QUICK_LANDSCAPES = LANDSCAPES[:2]


@dataclass(frozen=True)
class Run:
    """One search: the trial (1-based) that first reached the target, and the final regret."""

    reached_at: int | None
    regret: float


def tuner_run(landscape: Landscape, seed: int, trials: int, optimum: float) -> Run:
    rng = random.Random(1000 + seed)
    tuner = Tuner(landscape.space, seed=seed)
    reached = None
    for trial in range(1, trials + 1):
        settings = tuner.ask()
        tuner.tell(settings, landscape.measure(settings, rng))
        if reached is None and landscape.value(settings) >= TARGET * optimum:
            reached = trial
    best = tuner.best
    assert best is not None
    return Run(reached, 1 - landscape.value(best[0]) / optimum)


def random_run(landscape: Landscape, seed: int, trials: int, optimum: float) -> Run:
    rng = random.Random(1000 + seed)
    grid = list(landscape.space.grid())
    points = random.Random(seed).sample(grid, min(trials, len(grid)))
    reached = None
    best: tuple[Settings, float] | None = None
    for trial, settings in enumerate(points, start=1):
        score = landscape.measure(settings, rng)
        if best is None or score > best[1]:
            best = (settings, score)
        if reached is None and landscape.value(settings) >= TARGET * optimum:
            reached = trial
    assert best is not None
    return Run(reached, 1 - landscape.value(best[0]) / optimum)


def _trials_cell(values: list[int | None], trials: int, pick: Callable[[list[int]], float]) -> str:
    ranked = [trials + 1 if v is None else v for v in values]
    chosen = pick(ranked)
    return f">{trials}" if chosen > trials else f"{chosen:g}"


def timing(
    observations: tuple[int, ...] = (25, 50, 100), repeats: int = 10
) -> dict[int, tuple[float, float]]:
    """(median, max) milliseconds of one ask+tell, over ``repeats`` consecutive ones starting
    when ``n`` observations exist (the max includes a kernel hyperparameter refit)."""
    landscape = LANDSCAPES[0]
    rng = random.Random(0)
    tuner = Tuner(landscape.space, seed=0)
    samples: dict[int, list[float]] = {n: [] for n in observations}
    while tuner.n_told < max(observations) + repeats:
        started = time.perf_counter()
        settings = tuner.ask()
        tuner.tell(settings, landscape.measure(settings, rng))
        elapsed = (time.perf_counter() - started) * 1000
        for n in observations:
            if n <= tuner.n_told - 1 < n + repeats:
                samples[n].append(elapsed)
    return {n: (statistics.median(v), max(v)) for n, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=None, help="seeds per landscape (10)")
    parser.add_argument("--trials", type=int, default=60, help="trial budget per search (60)")
    parser.add_argument(
        "--quick", action="store_true", help="two landscapes and 5 seeds (under a minute)"
    )
    args = parser.parse_args(argv)
    seeds = args.seeds if args.seeds is not None else (5 if args.quick else 10)
    landscapes = QUICK_LANDSCAPES if args.quick else LANDSCAPES
    trials = args.trials
    if seeds < 1 or trials < 1:
        parser.error("--seeds and --trials must be positive")

    console = Console(width=150)
    started = time.perf_counter()
    table = Table(
        title=f"Trials to reach {TARGET:.0%} of the optimum (budget {trials}, {seeds} seeds)",
        title_justify="left",
    )
    for column in (
        "landscape",
        "optimum (bucket MiB, chunk KiB, cap W, algorithm)",
        "vs defaults",
        "method",
        "median",
        "worst",
        "reached",
        "regret median",
        "regret worst",
    ):
        table.add_column(column, justify="left" if column in {"landscape", "method"} else "right")
    for landscape in landscapes:
        space = landscape.space
        optimum_settings, optimum = landscape.model.optimum(space, landscape.objective)
        gain = optimum / landscape.value(space.defaults()) - 1
        described = ", ".join(str(v) for v in optimum_settings.values())
        for index, (method, run) in enumerate(
            (("hyperagent", tuner_run), ("random search", random_run))
        ):
            runs = [run(landscape, seed, trials, optimum) for seed in range(seeds)]
            reached = [r.reached_at for r in runs]
            regrets = [r.regret for r in runs]
            table.add_row(
                landscape.name if index == 0 else "",
                described if index == 0 else "",
                f"{gain:+.0%}" if index == 0 else "",
                method,
                _trials_cell(reached, trials, statistics.median_low),
                _trials_cell(reached, trials, max),
                f"{sum(r is not None for r in reached)}/{seeds}",
                f"{statistics.median(regrets):.1%}",
                f"{max(regrets):.1%}",
                end_section=index == 1,
            )
    console.print(table)
    times = timing()
    console.print(
        f"one ask+tell, median (max) of 10 from n observations, "
        f"{landscapes[0].space.size}-point space: "
        + ", ".join(f"n={n}: {med:.0f} ms ({top:.0f})" for n, (med, top) in times.items())
    )
    console.print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

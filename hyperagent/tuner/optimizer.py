"""Bayesian optimisation over a :class:`SearchSpace`, with scikit-optimize underneath.

The tuner proposes plain settings dicts and learns from scores (higher is better). It knows
nothing of MQTT, trials or time: the coordinator asks, measures, and tells.

skopt sees one integer dimension per numeric knob (log2 of the bucket and chunk sizes, the index
of the power cap on its grid) and a categorical one for the algorithm; a knob with one value
(gloo's algorithm) is left out and added back. skopt's ``Optimizer`` keeps the observations
and fits the surrogate: a Gaussian process, Matern 5/2 with learned noise. Choices, each
measured on the simulated job (benchmarks/tuner.py) and on families of landscapes whose optima
lie anywhere (benchmarks/tuner_families.py, 30 landscapes per family, 60 from the restart on,
the trial noise ``hyperagent demo --workload torch-ddp`` measured):

- The seeds (the job's settings, BACKGROUND.md's table with Megatron-core's DDP bucket, for
  energy half the maximum power cap) are the first points of a space-filling initial design, not
  the centre of a narrowed search: the points after them are the unmeasured ones farthest from
  everything measured (maximin; a face of the space counts at twice its distance, so the design
  keeps off the corners). The model-driven search then centres on whichever measured point it
  rates best, so a prior steers it only while the measurements agree with it. Against the local
  design this replaced (random neighbours of the best seed), the families' mean trials to 95% of
  the optimum went from 13.1 to 11.6 (medians per family lower on 14 of 18, higher on 3). Its
  cost: design points far from the seeds can measure 50-80% below them (a guardrail aborts such
  trials early).
- The space is a finite grid (about 1,400 points for a typical GPU), so the acquisition
  function is evaluated on every point not yet measured and the best is proposed: exact,
  cheaper than skopt's 10,000 random candidates, and never a repeat (so skopt's duplicate
  warning cannot arise).
- Expected improvement is taken over the best posterior mean among measured points, not the
  best noisy measurement, whose lucky draw made plain EI chase high-variance corners (on the
  simulated energy landscape 7 of 10 seeds reached 95% of the optimum in 60 trials; 10 of 10
  now). For the same reason :attr:`Tuner.best` is chosen by posterior mean.
- The acquisition is maximised inside a trust region around the incumbent (the measured point
  with the best posterior mean) that grows while the best score stalls (TuRBO's idea on a
  grid): without it, EI spent trials on the far corners of the grid (1 MiB buckets, 64 KiB or
  64 MiB chunks) where its variance is largest. On benchmarks/tuner.py's eight 5%-noise
  landscapes (10 seeds) the median trials to 95% of the optimum went from 9, 16, 2, 21.5,
  12.5, 13, 18, 17 to 10, 11.5, 2, 16, 11, 13, 17, 16 (without the energy seed).
- Every 8 tells without a better score (:data:`RESTART_AFTER_STALLED`) the next point is the
  space-filling design's again: a trust region holds the search on the mode it found, and the
  families' worst searches were held on the wrong one (a plateau just below the target, or
  ring's mode when halving-doubling's held the optimum). Over the 1,080 landscapes the
  searches that missed the target in 40 trials went from 22 to 13, the mean from 12.2 to 12.0
  trials; the prior-right landscapes did not change.
- The table's point takes Megatron-core's DDP bucket for the node count (128 MiB, or 256 MiB
  from 48 nodes; :meth:`SearchSpace.recommended`): where the table is right
  (benchmarks/tuner.py's jobs) the medians of 16 nodes 7B and 128 nodes went from 13, 13 and
  15 to 6, 2 and 3; over the families, whose bucket optima are log-uniform, it costs 0.4
  trials on average (11.8 to 12.2 without the restart; with both changes 12.0, and 11.6
  without priors).
- For throughput the coordinator holds the power cap at its highest value
  (:meth:`SearchSpace.for_objective`): on the four throughput landscapes the medians went from
  10, 2, 11, 17 to 9.5, 2, 10, 12.
- For the energy objective a third seed caps power at half the maximum limit
  (:data:`ENERGY_SEED_POWER_SHARE`, from the Zeus trace that the simulator's power curve also
  comes from, so the benchmark flatters it): the energy landscapes' medians went from 11.5,
  16, 13, 16 to 3, 8.5, 12, 16. It caps whichever of the first two seeds measured better
  (it capped the start before), so that it trusts the table only when the table measured
  better than the start.
- For the energy objective the model fits the score's log with added Matern terms over the
  power cap, the bucket, and the chunk with the algorithm (:data:`POWER_TERMS`,
  :data:`LOG_ENERGY`, :data:`INTERACTION_SHARE`), and the trust region starts at one step
  (:data:`ENERGY_TRUST_RADIUS`).
- A chunk as large as its bucket or larger is one setting (:data:`CHUNK_WITHIN_BUCKET`), the
  kernel's length scales are fitted under a prior (:data:`LENGTH_SCALE_PRIOR`) and the learned
  noise is bounded (:data:`WHITE_NOISE_CEILING`): over the 1,080 family landscapes (60 per
  family, energy trials told their standard error as the coordinator tells it) the mean trials
  to 95% of the optimum went from 12.0 to 9.1, on the energy families from 14.4 to 11.1 (medians
  7-13, 90th percentiles 13-23), on the throughput ones to 7.1 (medians 5-8); the prior-right
  medians are 2-10.
- For the energy objective each additive term's variance is fitted under a log-normal prior
  (:data:`AMPLITUDE_PRIOR`): by likelihood alone the first fits switched the power cap's, the
  bucket's or the chunk's term off, a different one from one trial to the next. On the nine
  energy families (60 landscapes each) the mean trials to 95% of the optimum went from 11.1 to
  10.0 (medians 7-13 to 7-10, 90th percentiles 13-23 to 11-18), on 60 other landscapes per
  family (indices 60-119) from 11.6 to 10.2; over all 1,080 from 9.1 to 8.6, the prior-right
  medians 2-7.5. Throughput searches (one term) do not use it.
- Kernel hyperparameters are learned from the prior at every fit up to 30 observations, then
  each time the observations have grown by 10%; fits in between keep them. BLAS runs
  single-threaded for these small matrices (two threads on two cores were 2-3 times slower).
  One ask+tell takes about 15-30 ms at 100 observations on two cores, 50-75 ms when it
  re-learns the hyperparameters; skopt's default (gp_hedge, three restarts at every fit,
  L-BFGS over the acquisition) took 250 ms or more at 40.
"""

from __future__ import annotations

import math
import numbers
import random
import statistics
from collections.abc import Mapping
from typing import Any

import numpy as np
import scipy.optimize
from sklearn.gaussian_process.kernels import Hyperparameter
from skopt import Optimizer
from skopt.acquisition import gaussian_ei, gaussian_lcb, gaussian_pi
from skopt.learning import GaussianProcessRegressor
from skopt.learning.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel
from skopt.space import Categorical, Dimension, Integer, Space
from skopt.utils import normalize_dimensions
from threadpoolctl import threadpool_limits

from hyperagent.tuner.space import OBJECTIVES, SearchSpace, Settings

ACQUISITION_FUNCTIONS = ("EI", "PI", "LCB")
ENERGY_SEED_POWER_SHARE = 0.5
"""For the energy objective, a third seed: the start with the power cap nearest this share of
the maximum limit. In the Zeus V100 trace (hyperagent/data/zeus-summary_power_v100.csv) the
energy-optimal limit of 60 of 68 workloads is 100-150 W of 250 W, the median 125 W."""
PI_RELATIVE_XI = 0.01
"""PI's improvement margin, as a share of the incumbent. skopt's ``xi`` is absolute (0.01 by
default): 1% of nothing for samples/s, 10% of a samples/J score."""
REFIT_GROWTH = 1.1
"""Kernel hyperparameters are re-learned (from the prior, one L-BFGS run: starting from the
previous fit instead got stuck in poor local optima) at every fit up to ``REFIT_FROM``
observations, then whenever the observations have grown by this factor since the last time;
fits in between keep them and only solve the GP (a Cholesky factorisation)."""
REFIT_FROM = 30
WHITE_NOISE_FLOOR = 1e-5
WHITE_NOISE_CEILING = 0.1
"""The noise the model learns on top of what each trial told, as a share of the scores'
variance: unbounded, a fit to a handful of points could call the whole landscape noise (a flat
model, and proposals by variance alone)."""
LENGTH_SCALE_PRIOR = (0.3, 0.4)
"""Kernel length scales are fitted at their posterior mode under a log-normal prior of this
median (on the unit-scaled space: about a third of a knob's range, 2-3 factors of two) and
log standard deviation. By likelihood alone, fits to the first 5-20 points threw them between
the bounds (0.05: every point independent; 100: the knob ignored) from one trial to the next;
the prior is what BoTorch's default models put on theirs (Gamma around a third of the cube)."""
AMPLITUDE_PRIOR = (2.0, 1.0)
"""Where the kernel is a sum of terms (:data:`POWER_TERMS`), each additive term's variance (on
the normalised scores) is fitted under a log-normal prior of this median and log standard
deviation, as the length scales are (:data:`LENGTH_SCALE_PRIOR`); the interaction's share is
held by its bounds instead (:data:`INTERACTION_SHARE`). By likelihood alone, fits to 5-15
energy trials set one or two of the terms to their floor (the power cap's, the chunk's or the
bucket's: that knob ignored), a different one from one trial to the next."""
TRUST_RADIUS = 2
ENERGY_TRUST_RADIUS = 1
"""The trust region's starting radius for the energy objective, whose space is seven times
the throughput one's (every power cap): a step of 25 W and one factor of two per size."""
POWER_TERMS = True
"""Where the power cap is searched beside other knobs, the kernel adds to the ARD Matern over
every knob one Matern over the power cap alone, one over the bucket size alone and one over the
chunk size with the algorithm (whose chunk optimum is its own): samples per joule is samples per
second over watts, the cap sets the clocks and the draw, the communication knobs the step's
waits, so (with the score's log, :data:`LOG_ENERGY`) the terms add up and a cap measured with
any settings informs every other."""
INTERACTION_SHARE = 0.3
"""Where the power cap is searched, the ARD Matern over every knob (what the knobs do together)
may take at most this share of the scores' variance; the additive terms the rest."""
LOG_ENERGY = True
"""For the energy objective the model fits the score's log (the told standard error becomes a
relative one): a product of throughput and efficiency factors is a sum there."""
FIXED_LENGTH_SCALE = 1e5
"""A Matern term ignores a column whose length scale is held at this (the unit-scaled space
spans 1)."""
TRUST_GROWTH_TRIALS = 2
"""Once the model exists, proposals are the best by acquisition among unmeasured points at most
``TRUST_RADIUS`` grid steps (in every numeric knob; any algorithm) from the measured point with
the best posterior mean, the radius growing by one for every ``TRUST_GROWTH_TRIALS`` tells
since the best score last improved; the whole grid when that region is exhausted."""
RESTART_AFTER_STALLED = 8
"""Each time the best score has gone this many tells without improving (8, 16, ...), the next
proposal is the space-filling design's instead of the acquisition's: a search held on one mode
of the landscape by its trust region measures once far from everything measured (TuRBO restarts
its region for the same reason)."""
BOUNDARY_WEIGHT = 2.0
"""In the space-filling design a face of the space counts as a point at this many times its
distance: the design keeps off the corners (without it the families took 13 trials on average
instead of 12)."""
DESIGN_SLACK = 0.0
"""The design draws among the points whose distance is within this share of the largest: 0,
exact ties only (the seed breaks them). 0.1 left 4 of 18 families behind plain
scikit-optimize's 90th percentile instead of 1."""
ALGORITHM_DISTANCE = 0.5
"""How far apart two algorithms are in the space-filling design, against 1 for a numeric knob's
whole range."""
CHUNK_WITHIN_BUCKET = True
"""A chunk as large as the bucket or larger allreduces the whole bucket at once (the DDP comm
hook and Open MPI's segment size alike): those chunks of one bucket, the other knobs equal, are
one setting to the tuner, measured once and proposed as the smallest of them."""
LENGTH_SCALE_BOUNDS = (0.05, 100.0)
"""On the unit-scaled space: below the grid spacing (about 0.1) points would be independent."""

Point = tuple[Any, ...]
_LOG2_KNOBS = ("bucket_mb", "chunk_kb")


def _prior_of(hyperparameter: Hyperparameter, terms: int) -> tuple[float, float] | None:
    """(median, log standard deviation) of a kernel hyperparameter's log-normal prior, in a
    kernel of ``terms`` variances; None: none (the learned noise, a single term's variance, a
    variance bounded below the prior's median: the interaction's share)."""
    if hyperparameter.name.endswith("length_scale"):
        return LENGTH_SCALE_PRIOR
    variance = hyperparameter.name.endswith("constant_value")
    if variance and terms > 1 and hyperparameter.bounds[0][1] >= AMPLITUDE_PRIOR[0]:
        return AMPLITUDE_PRIOR
    return None


class _GaussianProcess(GaussianProcessRegressor):  # type: ignore[misc]
    """skopt's GP with hyperparameters fitted under priors and a batched predictive variance:
    skopt evaluates that with a three-operand einsum, O(candidates x observations^2) in pure
    loops (20 ms for 1400 candidates at 100 observations); a matrix product does the same in
    well under a millisecond."""

    def _constrained_optimization(self, obj_func: Any, initial_theta: Any, bounds: Any) -> Any:
        """Kernel hyperparameters by their posterior mode: the marginal likelihood times a
        log-normal prior on every length scale (:data:`LENGTH_SCALE_PRIOR`) and, in a sum of
        terms, on each term's variance (:data:`AMPLITUDE_PRIOR`)."""
        if self.optimizer != "fmin_l_bfgs_b":
            return super()._constrained_optimization(obj_func, initial_theta, bounds)
        free = [h for h in self.kernel_.hyperparameters if not h.fixed]
        terms = sum(h.name.endswith("constant_value") for h in free)
        precision, centre = np.zeros(len(initial_theta)), np.zeros(len(initial_theta))
        at = 0
        for h in free:
            prior = _prior_of(h, terms)
            if prior is not None:
                precision[at : at + h.n_elements] = prior[1] ** -2
                centre[at : at + h.n_elements] = math.log(prior[0])
            at += h.n_elements

        def penalised(theta: np.ndarray) -> tuple[float, np.ndarray]:
            value, gradient = obj_func(theta, eval_gradient=True)
            offset = precision * (theta - centre)
            return value + 0.5 * float(offset @ (theta - centre)), gradient + offset

        found = scipy.optimize.minimize(
            penalised, initial_theta, method="L-BFGS-B", jac=True, bounds=bounds
        )
        return found.x, float(found.fun)

    def predict(
        self,
        X: Any,
        return_std: bool = False,
        return_cov: bool = False,
        return_mean_grad: bool = False,
        return_std_grad: bool = False,
    ) -> Any:
        plain = return_std and not (return_cov or return_mean_grad or return_std_grad)
        if not plain or not hasattr(self, "X_train_"):
            return super().predict(X, return_std, return_cov, return_mean_grad, return_std_grad)
        X = np.asarray(X, dtype=float)
        k_trans = self.kernel_(X, self.X_train_)
        mean = self.y_train_std_ * k_trans.dot(self.alpha_) + self.y_train_mean_
        variance = self.kernel_.diag(X) - np.einsum("ij,ij->i", k_trans @ self.K_inv_, k_trans)
        std = np.sqrt(np.clip(variance, 0.0, None) * self.y_train_std_**2)
        return mean, std


def _effective_chunk_kb(settings: Mapping[str, Any]) -> float:
    """The chunk a setting really allreduces: at most its whole bucket."""
    return float(min(settings["chunk_kb"], settings["bucket_mb"] * 1024))


def _real(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what}: expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what}: expected a finite number, got {value!r}")
    return number


class Tuner:
    """Proposes settings from ``space`` and learns from their scores (higher is better).

    The first proposals are seeds: ``start`` (snapped into the space; default the backend's
    defaults), then BACKGROUND.md's recommendation for the node count applied over it
    (:meth:`SearchSpace.recommended`, with Megatron-core's DDP bucket), and for
    the ``energy`` objective whichever of those two measured better at half the maximum power
    cap (:data:`ENERGY_SEED_POWER_SHARE`); a seed stays first in line until it is told, and one
    equal to an already told point is skipped.
    Until ``n_initial_points`` observations exist (seeds and foreign tells included), the
    unmeasured points farthest from every measured one and every seed still to come follow
    (a space-filling design around the seeds); then the unevaluated point with the best
    acquisition value within a trust region around the incumbent (:data:`TRUST_RADIUS`),
    or the design's next point every :data:`RESTART_AFTER_STALLED` tells without a better
    score.
    Nothing is proposed twice until every point of the space has been measured, nor a setting
    equal to a measured one (a chunk as large as its bucket or larger: :data:`CHUNK_WITHIN_BUCKET`).

    ``ask()`` returns the same settings until the next ``tell()``. ``tell()`` accepts any point
    of the space, asked or not (a journal replay); the model is refitted once, lazily, at the
    next ask. Deterministic for a given ``seed`` and sequence of calls.
    """

    def __init__(
        self,
        space: SearchSpace,
        seed: int = 0,
        start: Mapping[str, object] | None = None,
        n_initial_points: int = 5,
        acq_func: str = "EI",
        objective: str = "throughput",
        priors: bool = True,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if acq_func not in ACQUISITION_FUNCTIONS:
            raise ValueError(
                f"acq_func must be one of {', '.join(ACQUISITION_FUNCTIONS)}, got {acq_func!r}"
            )
        if n_initial_points < 1:
            raise ValueError(f"n_initial_points must be >= 1, got {n_initial_points}")
        self.space = space
        self.acq_func = acq_func
        self._knobs = space.knobs
        self._free = tuple(k for k in self._knobs if len(space.values(k)) > 1)
        self._fixed = {k: space.values(k)[0] for k in self._knobs if k not in self._free}
        self._rng = random.Random(seed)
        self._grid = list(space.grid())
        self._index = {self._key(s): i for i, s in enumerate(self._grid)}
        self._evaluated = np.zeros(len(self._grid), dtype=bool)
        self._stands_for = self._same_settings()
        self._representative = self._stands_for == np.arange(len(self._grid))
        numeric = [k for k in self._free if k != "allreduce"]
        self._steps = np.array(
            [[space.values(k).index(s[k]) for k in numeric] for s in self._grid], dtype=int
        ).reshape(len(self._grid), len(numeric))[self._stands_for]
        self._unit = self._unit_coordinates(numeric)
        self._optimizer = self._build_optimizer(seed, n_initial_points) if self._free else None
        self._grid_x = (
            self._optimizer.space.transform([self._to_point(s) for s in self._grid])
            if self._optimizer is not None
            else None
        )
        first = space.defaults() if start is None else space.snap(start)
        self._seeds = [first, space.recommended(base=first)] if priors else [first]
        self._energy_seed_cap: float | None = None
        if priors and objective == "energy" and space.power_cap_w:
            self._energy_seed_cap = ENERGY_SEED_POWER_SHARE * space.power_cap_w[-1]
        self._log_scores = LOG_ENERGY and objective == "energy"
        self._trust_radius = ENERGY_TRUST_RADIUS if objective == "energy" else TRUST_RADIUS
        self._observations: list[tuple[Settings, float]] = []
        self._unfitted: list[tuple[list[Any], float]] = []
        self._noise: list[float] = []
        """Per told observation (in the model's order): the score's standard error, 0 unknown."""
        self._pending: Settings | None = None
        self._fitted_kernel: Any = None
        self._next_refit = 0

    def _same_settings(self) -> np.ndarray:
        """Per grid point, the index of the point that stands for it: itself, or under
        :data:`CHUNK_WITHIN_BUCKET` the smallest chunk of its bucket that is the whole bucket."""
        stands_for = np.arange(len(self._grid))
        if not (CHUNK_WITHIN_BUCKET and {"bucket_mb", "chunk_kb"} <= set(self._free)):
            return stands_for
        first: dict[Point, int] = {}
        for i, settings in enumerate(self._grid):
            key = self._key({**settings, "chunk_kb": _effective_chunk_kb(settings)})
            j = first.setdefault(key, i)
            if settings["chunk_kb"] < self._grid[j]["chunk_kb"]:
                first[key] = j = i
        for i, settings in enumerate(self._grid):
            key = self._key({**settings, "chunk_kb": _effective_chunk_kb(settings)})
            stands_for[i] = first[key]
        return stands_for

    def _unit_coordinates(self, numeric: list[str]) -> np.ndarray:
        """Every grid point in [0, 1] per numeric knob (its grid index over the last one)
        and 0/1 per algorithm: the geometry of the space-filling design."""
        spans = np.array([max(1, len(self.space.values(k)) - 1) for k in numeric], dtype=float)
        columns = [self._steps / spans] if numeric else []
        if "allreduce" in self._free:
            names = self.space.values("allreduce")
            columns.append(
                np.array([[float(s["allreduce"] == a) for a in names] for s in self._grid])
                * ALGORITHM_DISTANCE
            )
        if not columns:
            return np.zeros((len(self._grid), 1))
        return np.hstack(columns)

    def _dimension(self, knob: str) -> Dimension:
        values = self.space.values(knob)
        if knob == "allreduce":
            return Categorical(list(values), name=knob)
        if knob in _LOG2_KNOBS:
            return Integer(int(math.log2(values[0])), int(math.log2(values[-1])), name=knob)
        return Integer(0, len(values) - 1, name=knob)

    def _build_optimizer(self, seed: int, n_initial_points: int) -> Optimizer:
        dimensions = [self._dimension(k) for k in self._free]
        width = Space(normalize_dimensions(dimensions)).transformed_n_dims
        additive = POWER_TERMS and "power_cap_w" in self._free and len(self._free) > 1
        amplitude = (INTERACTION_SHARE, (0.01 * INTERACTION_SHARE, INTERACTION_SHARE))
        self._prior_kernel = ConstantKernel(*(amplitude if additive else (1.0, (0.01, 1000.0))))
        self._prior_kernel *= Matern(
            length_scale=np.ones(width),
            length_scale_bounds=[LENGTH_SCALE_BOUNDS] * width,
            nu=2.5,
        )
        if additive:
            sizes = [Space(normalize_dimensions([d])).transformed_n_dims for d in dimensions]
            knob_of = np.repeat(np.array(self._free), sizes)
            power, bucket = knob_of == "power_cap_w", knob_of == "bucket_mb"
            for part in (power, bucket, ~(power | bucket)):
                if not part.any():
                    continue
                fixed = (FIXED_LENGTH_SCALE, FIXED_LENGTH_SCALE)
                self._prior_kernel += ConstantKernel(1.0, (0.01, 1000.0)) * Matern(
                    length_scale=np.where(part, 1.0, FIXED_LENGTH_SCALE),
                    length_scale_bounds=[LENGTH_SCALE_BOUNDS if p else fixed for p in part],
                    nu=2.5,
                )
        self._prior_kernel += WhiteKernel(1e-3, (WHITE_NOISE_FLOOR, WHITE_NOISE_CEILING))
        surrogate = _GaussianProcess(
            kernel=self._prior_kernel,
            normalize_y=True,
            noise="gaussian",
            n_restarts_optimizer=0,
        )
        # skopt's own acquisition sampling is not used (see _propose): one point keeps it cheap.
        return Optimizer(
            dimensions,
            base_estimator=surrogate,
            acq_func=self.acq_func,
            acq_optimizer="sampling",
            acq_optimizer_kwargs={"n_points": 1},
            n_initial_points=n_initial_points,
            random_state=seed,
            model_queue_size=1,
        )

    def _to_point(self, settings: Mapping[str, object]) -> list[Any]:
        point: list[Any] = []
        for knob in self._free:
            value = settings[knob]
            if knob == "allreduce":
                point.append(str(value))
            elif knob == "chunk_kb" and CHUNK_WITHIN_BUCKET and "bucket_mb" in settings:
                low = int(math.log2(self.space.values(knob)[0]))
                point.append(max(low, int(math.log2(_effective_chunk_kb(settings)))))
            elif knob in _LOG2_KNOBS:
                point.append(int(math.log2(_real(value, knob))))
            else:
                point.append(self.space.values(knob).index(value))
        return point

    def _key(self, settings: Mapping[str, object]) -> Point:
        return tuple(settings[k] for k in self._knobs)

    def _is_evaluated(self, settings: Mapping[str, object]) -> bool:
        return bool(self._evaluated[self._index[self._key(settings)]])

    def ask(self) -> Settings:
        """The next settings to measure: a dict of JSON-safe Python values in the space."""
        if self._pending is None:
            self._pending = self._next_seed() or self._propose()
        return dict(self._pending)

    def _seed_points(self) -> list[Settings]:
        """The seeds in order: the start, the table's point, and for the energy objective the
        better measured of those two (the start while neither is measured) with its power cap
        at :data:`ENERGY_SEED_POWER_SHARE` of the maximum."""
        if self._energy_seed_cap is None:
            return self._seeds
        scores = self._scores()
        base = max(
            (seed for seed in self._seeds if self._key(seed) in scores),
            key=lambda seed: statistics.fmean(scores[self._key(seed)]),
            default=self._seeds[0],
        )
        return [*self._seeds, self.space.snap({**base, "power_cap_w": self._energy_seed_cap})]

    def _scores(self) -> dict[Point, list[float]]:
        """Every measured point's scores, in the order first told."""
        scores: dict[Point, list[float]] = {}
        for settings, value in self._observations:
            scores.setdefault(self._key(settings), []).append(value)
        return scores

    def _next_seed(self) -> Settings | None:
        for seed in self._seed_points():
            if not self._is_evaluated(seed):
                return dict(seed)
        return None

    def _propose(self) -> Settings:
        if self._optimizer is None:
            return dict(self._grid[0])
        with threadpool_limits(limits=1, user_api="blas"):
            self._fit()
            stalled = self._stalled()
            if not self._optimizer.models or (stalled and stalled % RESTART_AFTER_STALLED == 0):
                return self._space_filling()
            return self._best_by_acquisition(self._trust_radius + stalled // TRUST_GROWTH_TRIALS)

    def _fit(self) -> None:
        assert self._optimizer is not None
        if not self._unfitted:
            return
        points = [p for p, _ in self._unfitted]
        losses = [y for _, y in self._unfitted]
        self._unfitted.clear()
        surrogate = self._optimizer.base_estimator_
        # measurement noise each trial reported, as variance in the model's normalised units
        scale = float(np.std([*self._optimizer.yi, *losses])) or 1.0
        alpha = np.maximum((np.asarray(self._noise) / scale) ** 2, 1e-10)
        surrogate.set_params(alpha=alpha)
        observed = len(self._optimizer.yi) + len(points)
        refit = self._fitted_kernel is None or observed < REFIT_FROM or observed >= self._next_refit
        if refit:
            surrogate.set_params(kernel=self._prior_kernel, optimizer="fmin_l_bfgs_b")
        else:
            surrogate.set_params(kernel=self._fitted_kernel, optimizer=None)
        self._optimizer.tell(points, losses)
        if refit and self._optimizer.models:
            fitted = self._optimizer.models[-1]
            noise = max(float(fitted.noise_ or 0.0), WHITE_NOISE_FLOOR)
            self._fitted_kernel = fitted.kernel_.k1 + WhiteKernel(noise_level=noise)
            self._next_refit = math.ceil(observed * REFIT_GROWTH)

    def _space_filling(self) -> Settings:
        """An unmeasured point farthest from every measured one and from seeds still to
        come (maximin; a face of the space counts as a point at :data:`BOUNDARY_WEIGHT` times
        its distance, so the design stays off the corners), drawn at random among those within
        :data:`DESIGN_SLACK` of the farthest."""
        unevaluated = np.flatnonzero(~self._evaluated & self._representative)
        if unevaluated.size == 0:
            return dict(self._grid[0])
        taken = np.flatnonzero(self._evaluated).tolist()
        coming = [s for s in self._seed_points() if not self._is_evaluated(s)]
        taken += [self._index[self._key(s)] for s in coming]
        x = self._unit[unevaluated]
        gaps = np.full(len(unevaluated), np.inf)
        if taken:
            d = np.linalg.norm(x[:, None, :] - self._unit[taken][None, :, :], axis=2)
            gaps = d.min(axis=1)
        if BOUNDARY_WEIGHT:
            numeric = self._steps.shape[1]
            if numeric:
                face = np.minimum(x[:, :numeric], 1 - x[:, :numeric]).min(axis=1)
                gaps = np.minimum(gaps, BOUNDARY_WEIGHT * face + 1e-9)
        best = np.flatnonzero(gaps >= (1 - DESIGN_SLACK) * gaps.max() - 1e-9).tolist()
        return dict(self._grid[int(unevaluated[self._rng.choice(best)])])

    def _stalled(self) -> int:
        """Tells since the best score (0 before the first)."""
        scores = [v for _, v in self._observations]
        return len(scores) - 1 - scores.index(max(scores)) if scores else 0

    def _best_by_acquisition(self, trust_radius: int) -> Settings:
        """The unmeasured point with the best acquisition value at most ``trust_radius`` grid
        steps from the incumbent (anywhere once that region is exhausted)."""
        assert self._optimizer is not None and self._grid_x is not None
        model = self._optimizer.models[-1]
        evaluated = np.flatnonzero(self._evaluated)
        mean = model.predict(self._grid_x[evaluated])
        incumbent = float(np.min(mean))
        centre = evaluated[int(np.argmin(mean))]
        offset = np.abs(self._steps - self._steps[centre]).max(axis=1, initial=0)
        open_points = ~self._evaluated & self._representative
        candidates = np.flatnonzero(open_points & (offset <= trust_radius))
        if candidates.size == 0:
            candidates = np.flatnonzero(open_points)
        if candidates.size == 0:
            candidates = np.arange(len(self._grid))
        x = self._grid_x[candidates]
        if self.acq_func == "EI":
            values = -gaussian_ei(x, model, y_opt=incumbent, xi=0.0)
        elif self.acq_func == "PI":
            xi = PI_RELATIVE_XI * abs(incumbent)
            values = -gaussian_pi(x, model, y_opt=incumbent, xi=xi)
        else:
            values = gaussian_lcb(x, model)
        return dict(self._grid[int(candidates[int(np.argmin(values))])])

    def tell(
        self, settings: Mapping[str, object], score: float, noise: float | None = None
    ) -> None:
        """Record that ``settings`` (a point of the space, asked or not) scored ``score``;
        ``noise``, the score's standard error when the measurement estimated it (spread of its
        windows), makes the model trust that observation accordingly."""
        if not self.space.contains(settings):
            raise ValueError(
                f"settings are not a point of the search space (snap them first): {settings}"
            )
        value = _real(score, "score")
        index = self._index[self._key(settings)]
        clean = dict(self._grid[index])
        self._observations.append((clean, value))
        self._evaluated[self._stands_for == self._stands_for[index]] = True
        if self._optimizer is not None:
            error = abs(_real(noise, "noise")) if noise is not None else 0.0
            if self._log_scores:
                value, error = self._log_score(value), error / value if value > 0 else 0.0
            self._unfitted.append((self._to_point(clean), -value))
            self._noise.append(error)
        self._pending = None

    def _log_score(self, value: float) -> float:
        """The model's value of an energy score: its log, a score of 0 or less counting as half
        the least positive score told (a failed trial's, before any measured: 1)."""
        if value > 0:
            return math.log(value)
        positive = [v for _, v in self._observations if v > 0]
        return math.log(0.5 * min(positive)) if positive else 0.0

    @property
    def best(self) -> tuple[Settings, float] | None:
        """The best measured settings and their observed score (the mean if told more than
        once), or None before the first tell.

        Once the model exists, "best" is the measured point with the highest posterior mean,
        which under measurement noise is a better pick than the luckiest single measurement;
        before that, the highest observed score. Reading it may refit the model.
        """
        if not self._observations:
            return None
        scores = self._scores()
        chosen = max(scores, key=lambda k: max(scores[k]))
        if self._optimizer is not None:
            with threadpool_limits(limits=1, user_api="blas"):
                self._fit()
                if self._optimizer.models and self._grid_x is not None:
                    keys = list(scores)
                    rows = [self._index[k] for k in keys]
                    mean = self._optimizer.models[-1].predict(self._grid_x[rows])
                    chosen = keys[int(np.argmin(mean))]
        settings = dict(self._grid[self._index[chosen]])
        return settings, statistics.fmean(scores[chosen])

    @property
    def observations(self) -> list[tuple[Settings, float]]:
        """Every (settings, score) told, in order."""
        return [(dict(s), v) for s, v in self._observations]

    @property
    def n_told(self) -> int:
        """How many observations have been told."""
        return len(self._observations)

    def converged(self, patience: int, min_improvement: float = 0.01) -> bool:
        """True when the best score has not improved by more than ``min_improvement`` (relative)
        over the last ``patience`` tells; False while fewer than ``patience + 1`` exist."""
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if len(self._observations) <= patience:
            return False
        scores = [v for _, v in self._observations]
        before = max(scores[:-patience])
        after = max(scores)
        return after - before <= min_improvement * abs(before)

"""A simulated data-parallel training job, for the demo, tests and benchmarks.

A pure model of one PyTorch DDP step across ``nodes`` nodes, shaped by BACKGROUND.md's figures
and the Zeus power measurements. It is a plausible landscape for the tuner, not a calibrated
performance model of any cluster.

Compute: a sample is 256 tokens at 6 FLOPs per parameter per token, run at 40 TFLOP/s (a V100S
at about a third of its fp16 tensor peak) at the maximum power limit; backward is two thirds of
it. A lower power cap slows compute by the measured ratio ``time_per_epoch(cap) /
time_per_epoch(max)`` and draws the measured average power (see :class:`PowerCurve`).

Communication: FP32 gradients (4 bytes per parameter) are reduced across nodes over each node's
link (the intra-node phases are neglected). DDP fills ``n = G / bucket`` buckets one after
another during backward and reduces them in order, so a step exposes the last bucket's
reduction plus whatever the network falls behind: ``T + (n - 1) * max(0, T - dt)`` for buckets
of reduction time ``T`` that become ready every ``dt``. Small buckets overlap better; every
bucket pays a fixed overhead and its algorithm's latency steps. A bucket of ``m`` bytes is sent
in segments of ``s = min(chunk, m)`` bytes, an alpha-beta cost per algorithm on ``N`` nodes:

- ring: ``2(N-1)`` latency steps and ``2(N-1)/N * m`` bytes per node;
- halving-doubling (Rabenseifner): ``2 ceil(log2 N)`` steps (two more when ``N`` is not a power
  of two), the same bytes;
- tree (double binary tree, pipelined by segment): ``2 ceil(log2 N)`` steps, the same bytes,
  plus a pipeline fill of ``2 ceil(log2 N) - 1`` segments;

plus a small cost per segment. Link efficiencies are BACKGROUND.md's: ring 92%, halving-doubling
87%, tree 78%. A ring advances in lock-step, so beyond 8 nodes it loses 15% per doubling to the
slowest link; halving-doubling's distant partners contend in the fabric beyond 64 nodes (40% per
doubling). The segment size reaches full efficiency at BACKGROUND.md's sizes (8 MiB above 1 B
parameters, else 256 KiB / 1 MiB / 4 MiB by node count) and loses 10% per factor of two away
from it. With these, ring wins up to about 8 nodes, halving-doubling to 64 and tree beyond.

Power: GPUs draw the curve's average power while computing and 30% of the maximum limit while
waiting on exposed communication. Noise is multiplicative: one lognormal factor on the step's
times and one on its power.
"""

from __future__ import annotations

import bisect
import csv
import functools
import io
import math
import numbers
import random
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

from hyperagent.tuner.space import OBJECTIVES, SearchSpace, Settings

POWER_CURVE_FILE = "zeus-summary_power_v100.csv"
POWER_CURVE_WORKLOAD = ("squad", "bert_base_uncased")
"""The Zeus V100 trace rows the power curve comes from: BERT-base fine-tuning on SQuAD (the
transformer closest to the simulated job), each batch size normalised to its own time at the
maximum limit, then averaged over the batch sizes."""

SECONDS_PER_SAMPLE_PER_BPARAM = 256 * 6 * 1e9 / 40e12
GRADIENT_BYTES_PER_PARAM = 4
BACKWARD_SHARE = 2 / 3
LATENCY_S = 10e-6
SEGMENT_OVERHEAD_S = 3e-6
BUCKET_OVERHEAD_S = 300e-6
LINK_EFFICIENCY = {"ring": 0.92, "halving_doubling": 0.87, "tree": 0.78}
RING_NODES = 8
RING_LOSS_PER_DOUBLING = 0.15
HD_NODES = 64
HD_LOSS_PER_DOUBLING = 0.4
LARGE_MODEL_PARAMS_B = 1.0
LARGE_MODEL_SEGMENT_KB = 8192
SEGMENT_KB_BY_NODES = ((8, 256), (64, 1024), (math.inf, 4096))
SEGMENT_MISMATCH_LOSS = 0.1
WAIT_POWER_SHARE = 0.3
MIB = 1024 * 1024
KIB = 1024


@dataclass(frozen=True)
class PowerCurve:
    """Relative compute slowdown and average power against the power limit, on a V100."""

    limits_w: tuple[float, ...]
    slowdown: tuple[float, ...]
    average_power_w: tuple[float, ...]

    @classmethod
    def from_csv(cls, text: str, workload: tuple[str, str] = POWER_CURVE_WORKLOAD) -> PowerCurve:
        """Derive the curve from a Zeus ``summary_power_*.csv`` for one (dataset, network)."""
        runs: dict[tuple[str, str], dict[float, tuple[float, float]]] = {}
        for row in csv.DictReader(io.StringIO(text)):
            if (row["dataset"], row["network"]) != workload:
                continue
            key = (row["batch_size"], row["optimizer"])
            runs.setdefault(key, {})[float(row["power_limit"])] = (
                float(row["time_per_epoch"]),
                float(row["average_power"]),
            )
        if not runs:
            raise ValueError(f"no rows for workload {workload!r}")
        limits = sorted(set.intersection(*(set(r) for r in runs.values())))
        if len(limits) < 2:
            raise ValueError(f"workload {workload!r} needs at least two common power limits")
        top = limits[-1]
        slowdown = [sum(r[p][0] / r[top][0] for r in runs.values()) / len(runs) for p in limits]
        power = [sum(r[p][1] for r in runs.values()) / len(runs) for p in limits]
        return cls(tuple(limits), tuple(slowdown), tuple(power))

    @property
    def max_limit_w(self) -> float:
        """The highest measured limit."""
        return self.limits_w[-1]

    def _interpolate(self, values: tuple[float, ...], limit_w: float) -> float:
        x = min(max(limit_w, self.limits_w[0]), self.limits_w[-1])
        i = min(max(bisect.bisect_right(self.limits_w, x), 1), len(self.limits_w) - 1)
        x0, x1 = self.limits_w[i - 1], self.limits_w[i]
        t = (x - x0) / (x1 - x0)
        return values[i - 1] + t * (values[i] - values[i - 1])

    def at(self, cap_w: float, max_w: float) -> tuple[float, float]:
        """(slowdown, average power W) at ``cap_w`` on a GPU whose maximum limit is ``max_w``:
        the cap is scaled by ``max_limit_w / max_w`` onto the measured range, linearly
        interpolated there (and clamped to it), and the power scaled back (never above the cap:
        the trace's average at 100 W is 100.5 W)."""
        scale = self.max_limit_w / max_w
        slowdown = self._interpolate(self.slowdown, cap_w * scale)
        power = self._interpolate(self.average_power_w, cap_w * scale) / scale
        return slowdown, min(power, cap_w)


@functools.cache
def power_curve() -> PowerCurve:
    """The packaged V100 curve (Zeus NSDI'23 trace, see hyperagent/data/SOURCES.md)."""
    text = resources.files("hyperagent").joinpath("data", POWER_CURVE_FILE).read_text("utf-8")
    return PowerCurve.from_csv(text)


@dataclass(frozen=True)
class Step:
    """One training step on one node."""

    samples: int
    step_s: float
    compute_s: float
    comm_s: float
    gpu_power_w: float
    gpu_util: float


def _positive(settings: Mapping[str, object], key: str) -> float:
    value = settings[key]
    number = float(value) if isinstance(value, numbers.Real) else math.nan
    if isinstance(value, bool) or not number > 0:
        raise ValueError(f"{key}: expected a positive number, got {value!r}")
    return number


@dataclass(frozen=True)
class JobModel:
    """A data-parallel job: ``nodes`` x ``gpus_per_node`` GPUs training a ``params_b`` billion
    parameter model with ``samples_per_gpu`` samples per GPU per step."""

    params_b: float = 1.3
    nodes: int = 4
    gpus_per_node: int = 8
    samples_per_gpu: int = 16
    power_limits_w: tuple[float, float] = (100.0, 250.0)
    link_gbps: float = 100.0
    noise: float = 0.02

    def __post_init__(self) -> None:
        if self.params_b <= 0 or self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("params_b, nodes and gpus_per_node must be positive")
        if self.samples_per_gpu < 1 or self.link_gbps <= 0 or self.noise < 0:
            raise ValueError("samples_per_gpu and link_gbps must be positive, noise >= 0")
        low, high = self.power_limits_w
        if not 0 < low <= high:
            raise ValueError(f"power_limits_w must be 0 < min <= max, got {self.power_limits_w}")

    @property
    def gradient_bytes(self) -> float:
        """Bytes of gradients reduced per step."""
        return self.params_b * 1e9 * GRADIENT_BYTES_PER_PARAM

    def space(self, backend: str = "nccl") -> SearchSpace:
        """The search space of this job on ``backend``."""
        return SearchSpace.default(backend, self.nodes, self.power_limits_w)

    @property
    def best_segment_bytes(self) -> float:
        """The segment size at which the link is used best (BACKGROUND.md's figures)."""
        if self.params_b >= LARGE_MODEL_PARAMS_B:
            return LARGE_MODEL_SEGMENT_KB * KIB
        for max_nodes, chunk_kb in SEGMENT_KB_BY_NODES:
            if self.nodes <= max_nodes:
                return chunk_kb * KIB
        return SEGMENT_KB_BY_NODES[-1][1] * KIB

    def _bucket_reduce_s(self, algorithm: str, message: float, segment: float) -> float:
        n = self.nodes
        if n == 1:
            return 0.0
        if algorithm not in LINK_EFFICIENCY:
            raise ValueError(f"allreduce: unknown algorithm {algorithm!r}")
        efficiency = LINK_EFFICIENCY[algorithm]
        log_steps = 2 * math.ceil(math.log2(n))
        fill = 0.0
        if algorithm == "ring":
            steps = 2 * (n - 1)
            efficiency /= 1 + RING_LOSS_PER_DOUBLING * max(0.0, math.log2(n / RING_NODES))
        elif algorithm == "halving_doubling":
            steps = log_steps + (2 if n & (n - 1) else 0)
            efficiency /= 1 + HD_LOSS_PER_DOUBLING * max(0.0, math.log2(n / HD_NODES))
        else:
            steps = log_steps
            fill = log_steps - 1.0
        off_best = math.log2(segment / self.best_segment_bytes)
        efficiency /= 1 + SEGMENT_MISMATCH_LOSS * abs(off_best)
        bandwidth = self.link_gbps * 1e9 / 8 * efficiency
        segments = math.ceil(message / segment)
        volume = 2 * (n - 1) / n * message
        return (
            BUCKET_OVERHEAD_S
            + segments * SEGMENT_OVERHEAD_S
            + steps * LATENCY_S
            + (volume + fill * segment) / bandwidth
        )

    def _cap(self, settings: Mapping[str, object]) -> float:
        low, high = self.power_limits_w
        if settings.get("power_cap_w") is None:
            return high
        return min(max(_positive(settings, "power_cap_w"), low), high)

    def expected_step(self, settings: Mapping[str, object]) -> Step:
        """The noiseless step under ``settings``: ``bucket_mb``, ``chunk_kb``, ``allreduce``
        (ring, halving_doubling or tree) and ``power_cap_w`` (missing means the maximum limit,
        values outside the limits are clamped)."""
        bucket = _positive(settings, "bucket_mb") * MIB
        chunk = _positive(settings, "chunk_kb") * KIB
        algorithm = str(settings.get("allreduce", "ring"))
        cap = self._cap(settings)
        slowdown, compute_power = power_curve().at(cap, self.power_limits_w[1])
        compute_s = self.samples_per_gpu * self.params_b * SECONDS_PER_SAMPLE_PER_BPARAM
        compute_s *= slowdown
        gradients = self.gradient_bytes
        buckets = math.ceil(gradients / bucket)
        message = gradients / buckets
        per_bucket = self._bucket_reduce_s(algorithm, message, min(chunk, message))
        ready_every = BACKWARD_SHARE * compute_s / buckets
        comm_s = per_bucket + (buckets - 1) * max(0.0, per_bucket - ready_every)
        step_s = compute_s + comm_s
        wait_power = min(WAIT_POWER_SHARE * self.power_limits_w[1], compute_power)
        power = (compute_s * compute_power + comm_s * wait_power) / step_s
        return Step(
            samples=self.gpus_per_node * self.samples_per_gpu,
            step_s=step_s,
            compute_s=compute_s,
            comm_s=comm_s,
            gpu_power_w=power,
            gpu_util=compute_s / step_s,
        )

    def step(self, settings: Mapping[str, object], rng: random.Random) -> Step:
        """One noisy step: time and power each scaled by a lognormal factor of sigma ``noise``."""
        mean = self.expected_step(settings)
        time_factor = rng.lognormvariate(0.0, self.noise)
        power_factor = rng.lognormvariate(0.0, self.noise)
        return Step(
            samples=mean.samples,
            step_s=mean.step_s * time_factor,
            compute_s=mean.compute_s * time_factor,
            comm_s=mean.comm_s * time_factor,
            gpu_power_w=mean.gpu_power_w * power_factor,
            gpu_util=mean.gpu_util,
        )

    def _throughput(self, step: Step) -> float:
        return step.samples * self.nodes / step.step_s

    def _samples_per_joule(self, step: Step) -> float:
        joules = step.gpu_power_w * step.step_s * self.gpus_per_node * self.nodes
        return step.samples * self.nodes / joules

    def throughput(self, settings: Mapping[str, object]) -> float:
        """Noiseless samples per second of the whole job."""
        return self._throughput(self.expected_step(settings))

    def samples_per_joule(self, settings: Mapping[str, object]) -> float:
        """Noiseless samples per joule of GPU energy, whole job."""
        return self._samples_per_joule(self.expected_step(settings))

    def score(
        self,
        settings: Mapping[str, object],
        objective: str = "throughput",
        rng: random.Random | None = None,
    ) -> float:
        """``throughput`` (samples/s) or ``energy`` (samples/J), higher is better: noiseless, or
        measured over one noisy step when ``rng`` is given."""
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; choose one of: {OBJECTIVES}")
        step = self.expected_step(settings) if rng is None else self.step(settings, rng)
        if objective == "throughput":
            return self._throughput(step)
        return self._samples_per_joule(step)

    def optimum(self, space: SearchSpace, objective: str = "throughput") -> tuple[Settings, float]:
        """The best point of ``space`` and its noiseless score, by exhaustive search."""
        best: tuple[Settings, float] | None = None
        for point in space.grid():
            value = self.score(point, objective)
            if best is None or value > best[1]:
                best = (point, value)
        assert best is not None
        return best

"""The tuning knobs as one abstract search space, and their mapping onto each backend.

A space holds only what its backend can apply (DESIGN.md, "Knobs"): NCCL runs ring or tree
(no halving-doubling; NVLS and CollNet only where the fabric has them), Open MPI's ``coll_tuned``
runs ring (4) or Rabenseifner halving-doubling (6), and PyTorch does not expose gloo's algorithm,
so a gloo space has no allreduce choice. Horovod and DeepSpeed expose a fusion or bucket size
but neither a chunk size nor an algorithm: their spaces have no ``chunk_kb`` and no
``allreduce`` knob, and their settings lack those keys. Settings are plain dicts of JSON-safe
Python values.

Under NCCL with hyperagent's tuner plugin (``hyperagent.nccl``) the AllReduce algorithm and a
``protocol`` knob (LL, LL128, Simple) apply at an iteration boundary; a job says so by
announcing ``allreduce`` and ``protocol`` (:meth:`SearchSpace.announced`), and only such a
job's space has ``protocol``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

BUCKET_MB: tuple[int, ...] = tuple(2**e for e in range(0, 9))
"""DDP gradient bucket sizes, MiB: powers of two 1..256."""

CHUNK_KB: tuple[int, ...] = tuple(2**e for e in range(6, 17))
"""Chunk (segment) sizes, KiB: powers of two 64..65536."""

POWER_STEP_W = 25
"""Power caps lie on this grid, plus both endpoints of the device's limits."""

DDP_DEFAULT_BUCKET_MB = 25
DEFAULT_CHUNK_KB = 4096
MIB = 1024 * 1024
KIB = 1024

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "nccl": ("ring", "tree"),
    "gloo": ("ring",),
    "mpi": ("ring", "halving_doubling"),
    "horovod": (),
    "deepspeed": (),
}
"""Allreduce algorithms each backend can be told to use (none: no ``allreduce`` knob)."""

BACKENDS: tuple[str, ...] = tuple(ALGORITHMS)

CHUNKED_BACKENDS: frozenset[str] = frozenset({"nccl", "gloo", "mpi"})
"""Backends that can apply ``chunk_kb``: PyTorch DDP's comm hook (nccl, gloo) and Open MPI's
segment size. Horovod and DeepSpeed have no such knob."""

BACKEND_DEFAULT_BUCKET_MB: dict[str, float] = {"horovod": 64}
"""Each backend's own bucket default where it is not DDP's 25 MiB: Horovod's fusion buffer is
64 MiB; DeepSpeed's is 5e8 elements (see :data:`DEEPSPEED_DEFAULT_BUCKET_ELEMENTS`)."""

DEEPSPEED_DEFAULT_BUCKET_ELEMENTS = 500_000_000

BUCKET_FLOOR_ELEMENTS = 40_000_000
BUCKET_ELEMENTS_PER_DATA_PARALLEL_RANK = 1_000_000

GRADIENT_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
"""Bytes per gradient element; DeepSpeed sizes its buckets in elements."""

OBJECTIVES: tuple[str, ...] = ("throughput", "energy")
"""What a tuning maximises: samples per second, or samples per joule."""

ITERATION_BOUNDARY = "iteration_boundary"
NEW_COMMUNICATOR = "new_communicator"
RESTART = "restart"
APPLY_MODES: tuple[str, ...] = (ITERATION_BOUNDARY, NEW_COMMUNICATOR, RESTART)

APPLIED_AT: dict[str, dict[str, str]] = {
    "nccl": {
        "NCCL_ALGO": NEW_COMMUNICATOR,
        "bucket_cap_mb": ITERATION_BOUNDARY,
        "chunk_bytes": ITERATION_BOUNDARY,
    },
    "gloo": {"bucket_cap_mb": ITERATION_BOUNDARY, "chunk_bytes": ITERATION_BOUNDARY},
    "mpi": {
        "coll_tuned_use_dynamic_rules": NEW_COMMUNICATOR,
        "coll_tuned_allreduce_algorithm": NEW_COMMUNICATOR,
        "coll_tuned_allreduce_algorithm_segmentsize": NEW_COMMUNICATOR,
        "bucket_cap_mb": ITERATION_BOUNDARY,
    },
    "horovod": {"HOROVOD_FUSION_THRESHOLD": RESTART},
    "deepspeed": {"reduce_bucket_size": RESTART, "allgather_bucket_size": RESTART},
}
"""When each backend parameter can take effect. ``iteration_boundary``: between two steps
(DDP is re-wrapped for ``bucket_cap_mb``; the comm hook reads ``chunk_bytes`` per bucket).
``new_communicator``: read when a communicator is created (NCCL reads ``NCCL_ALGO`` at
``ncclCommInitRank``; Open MPI's ``coll_tuned`` reads its forced algorithm and segment size
when it is enabled on a communicator), so the job must build a new process group.
``restart``: read once at start-up (``hvd.init()``; ``deepspeed.initialize`` builds the ZeRO
optimiser's buckets), so the job must restart or re-initialise the framework."""

APPLIED_AT_NCCL_TUNER: dict[str, str] = {
    "tuner_algorithm": ITERATION_BOUNDARY,
    "tuner_protocol": ITERATION_BOUNDARY,
    "bucket_cap_mb": ITERATION_BOUNDARY,
    "chunk_bytes": ITERATION_BOUNDARY,
}
"""An NCCL job with hyperagent's tuner plugin (its space has ``protocol``): the algorithm and
protocol are set through the plugin, which NCCL asks before every AllReduce."""

NCCL_EXTRA_ALGORITHMS: tuple[str, ...] = ("nvls", "collnet")

NCCL_ALGO: dict[str, str] = {
    "ring": "Ring",
    "tree": "Tree",
    "nvls": "NVLS",
    "collnet": "CollNetDirect,CollNetChain",
}
MPI_ALLREDUCE_ALGORITHM: dict[str, int] = {"ring": 4, "halving_doubling": 6}

NCCL_PROTOCOLS: tuple[str, ...] = ("ll", "ll128", "simple")
"""NCCL's protocols in its own order (``NCCL_PROTO_*`` 0, 1, 2): by latency, lowest first."""
DEFAULT_PROTOCOL = "simple"
PLUGIN_KNOBS: tuple[str, ...] = ("allreduce", "protocol")
"""What an NCCL job announces when it switches the AllReduce through the tuner plugin."""

KNOBS: tuple[str, ...] = ("bucket_mb", "chunk_kb", "power_cap_w", "allreduce", "protocol")
JOB_KNOBS: tuple[str, ...] = tuple(k for k in KNOBS if k != "power_cap_w")
"""The knobs a job's ranks apply, and announce (the power cap is the agent's)."""

Settings = dict[str, Any]


def _check_backend(backend: str) -> None:
    if backend not in ALGORITHMS:
        choices = ", ".join(sorted(ALGORITHMS))
        raise ValueError(f"unknown backend {backend!r}; choose one of: {choices}")


def _has_allreduce(backend: str) -> bool:
    return bool(ALGORITHMS[backend])


def _has_ddp_buckets(backend: str) -> bool:
    """Whether ``bucket_mb`` is PyTorch DDP's ``bucket_cap_mb`` on this backend."""
    return "bucket_cap_mb" in APPLIED_AT[backend]


def power_grid(power_limits_w: tuple[float, float]) -> tuple[int, ...]:
    """Whole-watt power caps: both limits (rounded inwards) and every 25 W multiple between."""
    low, high = (float(v) for v in power_limits_w)
    if not (math.isfinite(low) and math.isfinite(high)) or low <= 0 or high < low:
        raise ValueError(f"power_limits_w must be 0 < min <= max, got {power_limits_w!r}")
    first, last = math.ceil(low), math.floor(high)
    if first > last:
        raise ValueError(f"power_limits_w {power_limits_w!r} contains no whole watt")
    inner = range((first // POWER_STEP_W + 1) * POWER_STEP_W, last, POWER_STEP_W)
    return tuple(sorted({first, *inner, last}))


def _nearest_log2(value: float, choices: tuple[int, ...]) -> int:
    if value <= 0:
        return choices[0]
    target = math.log2(value)
    return min(choices, key=lambda c: (abs(math.log2(c) - target), c))


def ddp_bucket_mb(data_parallel_size: int, gradient_dtype: str = "fp32") -> float:
    """Megatron-core's default DDP bucket for ``data_parallel_size`` ranks, in MiB:
    ``max(40M, 1M x data-parallel size)`` gradient elements ("larger DP sizes need larger
    buckets to ensure collectives do not become latency-bound";
    ``megatron/core/distributed/distributed_data_parallel_config.py``), 152.6 MiB up to 40 ranks
    with fp32 gradients. :meth:`SearchSpace.recommended` takes the data-parallel size as the node
    count, the inter-node AllReduce's participants."""
    per_rank = BUCKET_ELEMENTS_PER_DATA_PARALLEL_RANK * data_parallel_size
    elements = max(BUCKET_FLOOR_ELEMENTS, per_rank)
    return elements * GRADIENT_DTYPE_BYTES[gradient_dtype] / MIB


def _number(knob: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{knob}: expected a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{knob}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{knob}: expected a finite number, got {value!r}")
    return number


@dataclass(frozen=True)
class SearchSpace:
    """The knobs a job's backend can apply, each as an ordered tuple of allowed values.

    Sizes are increasing powers of two, power caps increasing whole watts. An empty tuple is a
    knob that is not in the space, and settings then lack its key: ``power_cap_w`` when the
    power cap is not tuned, ``chunk_kb`` and ``allreduce`` for Horovod and DeepSpeed, which
    cannot apply them. ``gradient_dtype`` (fp32, fp16 or bf16) sizes DeepSpeed's buckets in
    elements. Build one with :meth:`default`; the constructor is for narrower spaces.
    """

    backend: str
    nodes: int
    bucket_mb: tuple[int, ...] = BUCKET_MB
    chunk_kb: tuple[int, ...] = CHUNK_KB
    power_cap_w: tuple[int, ...] = ()
    allreduce: tuple[str, ...] = ("ring",)
    gradient_dtype: str = "fp32"
    protocol: tuple[str, ...] = ()
    """NCCL's protocol, through the tuner plugin: only in the space of an NCCL job that
    announced it (:meth:`announced`)."""

    def __post_init__(self) -> None:
        _check_backend(self.backend)
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes must be a positive integer, got {self.nodes!r}")
        for knob in ("bucket_mb", "chunk_kb", "power_cap_w"):
            values = getattr(self, knob)
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{knob}: values must be positive integers, got {values}")
            if list(values) != sorted(set(values)):
                raise ValueError(f"{knob}: values must be strictly increasing, got {values}")
            if knob != "power_cap_w" and any(v & (v - 1) for v in values):
                raise ValueError(f"{knob}: values must be powers of two, got {values}")
        if not self.bucket_mb:
            raise ValueError("bucket_mb needs at least one value")
        if self.backend in CHUNKED_BACKENDS and not self.chunk_kb:
            raise ValueError(f"chunk_kb needs at least one value with backend {self.backend!r}")
        if self.backend not in CHUNKED_BACKENDS and self.chunk_kb:
            raise ValueError(
                f"chunk_kb: backend {self.backend!r} cannot apply a chunk size;"
                " pass chunk_kb=() (SearchSpace.default does)"
            )
        known = set(NCCL_EXTRA_ALGORITHMS).union(*ALGORITHMS.values())
        if len(set(self.allreduce)) != len(self.allreduce) or not set(self.allreduce) <= known:
            raise ValueError(f"allreduce: unknown or repeated algorithms in {self.allreduce}")
        if _has_allreduce(self.backend) and not self.allreduce:
            raise ValueError(f"allreduce: backend {self.backend!r} needs at least one algorithm")
        if len(self.allreduce) > 1 and "ring" not in self.allreduce:
            raise ValueError(
                "allreduce: a space that chooses among algorithms includes 'ring'"
                " (one algorithm alone is a pinned knob)"
            )
        if not _has_allreduce(self.backend) and self.allreduce:
            raise ValueError(
                f"allreduce: backend {self.backend!r} has no algorithm choice;"
                " pass allreduce=() (SearchSpace.default does)"
            )
        if self.protocol and self.backend != "nccl":
            raise ValueError(f"protocol: backend {self.backend!r} has no protocol choice")
        if len(set(self.protocol)) != len(self.protocol) or not set(self.protocol) <= set(
            NCCL_PROTOCOLS
        ):
            raise ValueError(f"protocol: unknown or repeated protocols in {self.protocol}")
        if self.gradient_dtype not in GRADIENT_DTYPE_BYTES:
            choices = ", ".join(GRADIENT_DTYPE_BYTES)
            raise ValueError(
                f"gradient_dtype must be one of {choices}, got {self.gradient_dtype!r}"
            )

    @classmethod
    def default(
        cls,
        backend: str,
        nodes: int,
        power_limits_w: tuple[float, float] | None = None,
        extra_algorithms: tuple[str, ...] = (),
        gradient_dtype: str = "fp32",
    ) -> SearchSpace:
        """The standard space for ``backend`` on ``nodes`` nodes.

        ``power_limits_w`` is the GPU's (min, max) power limit as NVML reports it; None leaves
        the power cap out of the space. ``extra_algorithms`` adds NCCL's ``nvls`` or ``collnet``
        where the fabric supports them. ``gradient_dtype`` is the gradients' element type,
        which only DeepSpeed's mapping uses (its buckets count elements).
        """
        _check_backend(backend)
        algorithms = ALGORITHMS[backend]
        for extra in extra_algorithms:
            if backend != "nccl" or extra not in NCCL_EXTRA_ALGORITHMS:
                raise ValueError(
                    f"extra algorithm {extra!r} is not available with backend {backend!r}"
                    f" (nccl only: {', '.join(NCCL_EXTRA_ALGORITHMS)})"
                )
            if extra not in algorithms:
                algorithms = (*algorithms, extra)
        power = power_grid(power_limits_w) if power_limits_w is not None else ()
        chunks = CHUNK_KB if backend in CHUNKED_BACKENDS else ()
        return cls(
            backend=backend,
            nodes=nodes,
            chunk_kb=chunks,
            power_cap_w=power,
            allreduce=algorithms,
            gradient_dtype=gradient_dtype,
        )

    def announced(self, knobs: Iterable[str], start: Mapping[str, object]) -> SearchSpace:
        """The space of a job whose ranks announced they apply ``knobs`` live: the others
        pinned at their value in ``start``. An NCCL job announcing ``protocol`` (through the
        tuner plugin) gains the protocol knob; a job that did not announce it never has it."""
        knobs = tuple(knobs)
        space = self
        if self.backend == "nccl" and "protocol" in knobs and not self.protocol:
            space = dataclasses.replace(self, protocol=NCCL_PROTOCOLS)
        elif "protocol" not in knobs and self.protocol:
            space = dataclasses.replace(self, protocol=())
        pinned = [k for k in JOB_KNOBS if k not in knobs and len(space.values(k)) > 1]
        return space.pin(start, pinned)

    def pin(self, settings: Mapping[str, object], knobs: Iterable[str]) -> SearchSpace:
        """This space with each of ``knobs`` held at its value in ``settings`` (snapped)."""
        point = self.snap(settings)
        fixed = {k: (point[k],) for k in knobs if self.values(k)}
        return dataclasses.replace(self, **fixed)  # type: ignore[arg-type]

    def for_objective(
        self,
        objective: str,
        power_budget_w: float | None = None,
        search_power_cap: bool | None = None,
    ) -> SearchSpace:
        """This space as a tuning for ``objective`` searches it.

        For throughput without a power budget the power cap is held at its highest value: a
        lower cap only lowers the clocks a compute-bound step runs at, so those trials are
        spent on settings that cannot win (in the Zeus V100 trace the highest limit, 250 W,
        ran within 1% of the fastest in 47 of 68 workloads; the rest scatter without a steady
        trend but for one, shufflenetv2 at batch 16, 6% faster at 100 W).
        ``search_power_cap`` True searches it anyway, False never; None (the default)
        searches it for the energy objective and under a power budget, where a lower cap is
        what can win.
        """
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if search_power_cap is None:
            search_power_cap = objective == "energy" or power_budget_w is not None
        if search_power_cap or len(self.power_cap_w) < 2:
            return self
        return dataclasses.replace(self, power_cap_w=self.power_cap_w[-1:])

    @property
    def knobs(self) -> tuple[str, ...]:
        """The knob names settings of this space carry, in a fixed order."""
        return tuple(k for k in KNOBS if self.values(k))

    @property
    def power_limits_w(self) -> tuple[int, int] | None:
        """The (lowest, highest) power cap, or None when power is not tuned."""
        return (self.power_cap_w[0], self.power_cap_w[-1]) if self.power_cap_w else None

    @property
    def size(self) -> int:
        """The number of distinct points."""
        return math.prod(len(self.values(k)) for k in self.knobs)

    def values(self, knob: str) -> tuple[Any, ...]:
        """The allowed values of one knob (empty when the knob is not in this space)."""
        if knob not in KNOBS:
            raise ValueError(f"unknown knob {knob!r}; knobs are: {', '.join(KNOBS)}")
        values: tuple[Any, ...] = getattr(self, knob)
        return values

    def contains(self, settings: Mapping[str, object]) -> bool:
        """True when ``settings`` has exactly this space's knobs, each at an allowed value."""
        if set(settings) != set(self.knobs):
            return False
        for knob in self.knobs:
            value = settings[knob]
            if isinstance(value, bool):
                return False
            if knob in ("allreduce", "protocol"):
                if not isinstance(value, str) or value not in self.values(knob):
                    return False
            elif not isinstance(value, numbers.Real) or value not in self.values(knob):
                return False
        return True

    def snap(self, settings: Mapping[str, object]) -> Settings:
        """The nearest point of the space.

        Sizes snap to the nearest power of two by log distance (25 MiB -> 32), power caps are
        clamped into the limits then rounded to the grid (a missing cap means the maximum), a
        missing algorithm or one the space lacks becomes ``ring`` (or the space's one pinned
        algorithm), and unknown keys, or knobs
        this space does not have, are dropped. A missing bucket size (or chunk size, where the
        space has one), or a value that is not a number or an algorithm name, raises ValueError.
        """
        snapped: Settings = {}
        for knob in ("bucket_mb", "chunk_kb"):
            if not self.values(knob):
                continue
            if knob not in settings:
                raise ValueError(f"{knob}: missing")
            snapped[knob] = _nearest_log2(_number(knob, settings[knob]), self.values(knob))
        if self.power_cap_w:
            raw = settings.get("power_cap_w")
            watts = self.power_cap_w[-1] if raw is None else _number("power_cap_w", raw)
            snapped["power_cap_w"] = min(self.power_cap_w, key=lambda w: (abs(w - watts), -w))
        if self.allreduce:
            name = settings.get("allreduce", "ring")
            if not isinstance(name, str):
                raise ValueError(f"allreduce: expected an algorithm name, got {name!r}")
            name = name.lower().replace("-", "_")
            known = {a for algorithms in ALGORITHMS.values() for a in algorithms}
            if name not in known | set(NCCL_EXTRA_ALGORITHMS):
                raise ValueError(f"allreduce: unknown algorithm {name!r}")
            fallback = "ring" if "ring" in self.allreduce else self.allreduce[0]
            snapped["allreduce"] = name if name in self.allreduce else fallback
        if self.protocol:
            protocol = settings.get("protocol", DEFAULT_PROTOCOL)
            if not isinstance(protocol, str) or protocol.lower() not in NCCL_PROTOCOLS:
                raise ValueError(f"protocol: expected one of {', '.join(NCCL_PROTOCOLS)}")
            protocol = protocol.lower()
            default = DEFAULT_PROTOCOL if DEFAULT_PROTOCOL in self.protocol else self.protocol[0]
            snapped["protocol"] = protocol if protocol in self.protocol else default
        return snapped

    def defaults(self) -> Settings:
        """The backend's own defaults in this space: 25 MiB buckets for PyTorch DDP (nccl,
        gloo, mpi; snapped to 32), Horovod's 64 MiB fusion buffer, DeepSpeed's 5e8-element
        buckets (beyond the range: 256 MiB), 4 MiB chunks, the maximum power cap and ring."""
        if self.backend == "deepspeed":
            element = GRADIENT_DTYPE_BYTES[self.gradient_dtype]
            bucket = DEEPSPEED_DEFAULT_BUCKET_ELEMENTS * element / MIB
        else:
            bucket = BACKEND_DEFAULT_BUCKET_MB.get(self.backend, DDP_DEFAULT_BUCKET_MB)
        return self.snap({"bucket_mb": bucket, "chunk_kb": DEFAULT_CHUNK_KB, "allreduce": "ring"})

    def recommended(
        self, nodes: int | None = None, base: Mapping[str, object] | None = None
    ) -> Settings:
        """BACKGROUND.md's table applied over ``base`` (default :meth:`defaults`), with
        Megatron-core's bucket size for PyTorch DDP.

        Up to 8 nodes ring with 256 KiB chunks, 9-64 halving-doubling with 1 MiB, above 64 tree
        with 4 MiB. Where the backend lacks that algorithm it uses the nearest it has: NCCL has
        only ring and tree, so it keeps ring up to 64 nodes and uses tree above; Open MPI has no
        tree, so halving-doubling stays above 64 nodes; gloo is always ring. The DDP backends
        (nccl, gloo, mpi) take the bucket from :func:`ddp_bucket_mb` for the node count: 128 MiB
        up to 47 nodes, 256 MiB from 48 with fp32 gradients. A knob the space lacks is left out
        (Horovod and DeepSpeed: the table changes nothing).

        How the tuner uses it: as one candidate, measured second (after the job's current
        settings), among the points of a space-filling initial design, never as a narrowed
        space; the search then centres on whichever measured point the model rates best, so
        the table steers it only while measurements agree with it
        (:class:`hyperagent.tuner.optimizer.Tuner`). Real clusters put their optima where
        their fabric, model and NCCL version put them: on landscapes whose optima lie anywhere
        (``benchmarks/tuner_families.py``) the priors change little (8.6 trials on average with
        them, 8.7 without), and where the table is right they save up to 10.5.
        """
        nodes = self.nodes if nodes is None else nodes
        if nodes < 1:
            raise ValueError(f"nodes must be positive, got {nodes}")
        if nodes <= 8:
            algorithm, chunk = "ring", 256
        elif nodes <= 64:
            algorithm, chunk = "halving_doubling", 1024
        else:
            algorithm, chunk = "tree", 4096
        if algorithm not in self.allreduce:
            if algorithm == "halving_doubling":
                algorithm = "ring"
            elif "halving_doubling" in self.allreduce:
                algorithm = "halving_doubling"
            else:
                algorithm = "ring"
        point = dict(self.defaults() if base is None else self.snap(base))
        if _has_ddp_buckets(self.backend):
            point["bucket_mb"] = ddp_bucket_mb(nodes, self.gradient_dtype)
        if self.chunk_kb:
            point["chunk_kb"] = chunk
        if self.allreduce:
            point["allreduce"] = algorithm
        return self.snap(point)

    def grid(self) -> Iterator[Settings]:
        """Every point of the space, in a fixed order."""
        knobs = self.knobs
        for combo in itertools.product(*(self.values(k) for k in knobs)):
            yield dict(zip(knobs, combo, strict=True))

    def backend_mapping(self, settings: Mapping[str, object]) -> dict[str, Any]:
        """The backend's own parameters for a point of this space (the power cap is applied
        through NVML, not the backend, so it is not included), and under ``requires`` which of
        them take effect when (:data:`APPLIED_AT`): ``{"iteration_boundary": [...],
        "new_communicator": [...], "restart": [...]}``, each a sorted list of parameter names.

        nccl: ``NCCL_ALGO`` (a new communicator), ``bucket_cap_mb`` and ``chunk_bytes`` (the
        DDP comm hook's chunk); with ``protocol`` in the space (the tuner plugin),
        ``tuner_algorithm`` and ``tuner_protocol`` instead of ``NCCL_ALGO``, live
        (:data:`APPLIED_AT_NCCL_TUNER`; settings from before the job announced the protocol,
        such as its baseline, map without ``tuner_protocol``: NCCL's own); gloo:
        ``bucket_cap_mb`` and ``chunk_bytes``; mpi: Open MPI's ``coll_tuned_use_dynamic_rules``,
        ``coll_tuned_allreduce_algorithm`` and
        ``coll_tuned_allreduce_algorithm_segmentsize`` (bytes), plus ``bucket_cap_mb``;
        horovod: ``HOROVOD_FUSION_THRESHOLD`` (bytes); deepspeed: ZeRO's
        ``reduce_bucket_size`` and ``allgather_bucket_size`` (elements of ``gradient_dtype``,
        keys of the ``zero_optimization`` section).
        """
        tuner = self.backend == "nccl" and bool(self.protocol)
        point = settings
        if tuner and "protocol" not in settings:
            # from before the job announced the protocol (its baseline): NCCL's own protocol
            point = {**settings, "protocol": self.protocol[0]}
        if not self.contains(point):
            raise ValueError(f"settings are not a point of this {self.backend} space: {settings}")
        bucket = int(settings["bucket_mb"])  # type: ignore[call-overload]
        parameters: dict[str, Any]
        if self.backend == "horovod":
            parameters = {"HOROVOD_FUSION_THRESHOLD": bucket * MIB}
        elif self.backend == "deepspeed":
            elements = bucket * MIB // GRADIENT_DTYPE_BYTES[self.gradient_dtype]
            parameters = {"reduce_bucket_size": elements, "allgather_bucket_size": elements}
        else:
            chunk_bytes = int(settings["chunk_kb"]) * KIB  # type: ignore[call-overload]
            algorithm = str(settings["allreduce"])
            if tuner:
                parameters = {
                    "tuner_algorithm": algorithm,
                    "bucket_cap_mb": bucket,
                    "chunk_bytes": chunk_bytes,
                }
                if "protocol" in settings:
                    parameters["tuner_protocol"] = str(settings["protocol"])
            elif self.backend == "nccl":
                parameters = {
                    "NCCL_ALGO": NCCL_ALGO[algorithm],
                    "bucket_cap_mb": bucket,
                    "chunk_bytes": chunk_bytes,
                }
            elif self.backend == "gloo":
                parameters = {"bucket_cap_mb": bucket, "chunk_bytes": chunk_bytes}
            else:
                parameters = {
                    "coll_tuned_use_dynamic_rules": 1,
                    "coll_tuned_allreduce_algorithm": MPI_ALLREDUCE_ALGORITHM[algorithm],
                    "coll_tuned_allreduce_algorithm_segmentsize": chunk_bytes,
                    "bucket_cap_mb": bucket,
                }
        applied_at = APPLIED_AT_NCCL_TUNER if tuner else APPLIED_AT[self.backend]
        requires = {
            mode: sorted(p for p in parameters if applied_at[p] == mode) for mode in APPLY_MODES
        }
        return {**parameters, "requires": requires}

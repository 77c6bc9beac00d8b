"""The tuning knobs as one abstract search space, and their mapping onto each backend.

A space holds only what its backend can apply (DESIGN.md, "Knobs"): NCCL runs ring or tree
(no halving-doubling; NVLS and CollNet only where the fabric has them), Open MPI's ``coll_tuned``
runs ring (4) or Rabenseifner halving-doubling (6), and PyTorch does not expose gloo's algorithm,
so a gloo space has no allreduce choice. Settings are plain dicts of JSON-safe Python values.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterator, Mapping
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

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "nccl": ("ring", "tree"),
    "gloo": ("ring",),
    "mpi": ("ring", "halving_doubling"),
}
"""Allreduce algorithms each backend can be told to use."""

NCCL_EXTRA_ALGORITHMS: tuple[str, ...] = ("nvls", "collnet")

NCCL_ALGO: dict[str, str] = {
    "ring": "Ring",
    "tree": "Tree",
    "nvls": "NVLS",
    "collnet": "CollNetDirect,CollNetChain",
}
MPI_ALLREDUCE_ALGORITHM: dict[str, int] = {"ring": 4, "halving_doubling": 6}

KNOBS: tuple[str, ...] = ("bucket_mb", "chunk_kb", "power_cap_w", "allreduce")

Settings = dict[str, Any]


def _check_backend(backend: str) -> None:
    if backend not in ALGORITHMS:
        choices = ", ".join(sorted(ALGORITHMS))
        raise ValueError(f"unknown backend {backend!r}; choose one of: {choices}")


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

    Sizes are increasing powers of two, power caps increasing whole watts; ``power_cap_w`` is
    empty when the power cap is not tuned, and settings then have no ``power_cap_w`` key.
    Build one with :meth:`default`; the constructor is for narrower spaces.
    """

    backend: str
    nodes: int
    bucket_mb: tuple[int, ...] = BUCKET_MB
    chunk_kb: tuple[int, ...] = CHUNK_KB
    power_cap_w: tuple[int, ...] = ()
    allreduce: tuple[str, ...] = ("ring",)

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
        if not self.bucket_mb or not self.chunk_kb:
            raise ValueError("bucket_mb and chunk_kb need at least one value each")
        known = set(NCCL_EXTRA_ALGORITHMS).union(*ALGORITHMS.values())
        if len(set(self.allreduce)) != len(self.allreduce) or not set(self.allreduce) <= known:
            raise ValueError(f"allreduce: unknown or repeated algorithms in {self.allreduce}")
        if "ring" not in self.allreduce:
            raise ValueError("allreduce: every backend space includes 'ring'")

    @classmethod
    def default(
        cls,
        backend: str,
        nodes: int,
        power_limits_w: tuple[float, float] | None = None,
        extra_algorithms: tuple[str, ...] = (),
    ) -> SearchSpace:
        """The standard space for ``backend`` on ``nodes`` nodes.

        ``power_limits_w`` is the GPU's (min, max) power limit as NVML reports it; None leaves
        the power cap out of the space. ``extra_algorithms`` adds NCCL's ``nvls`` or ``collnet``
        where the fabric supports them.
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
        return cls(backend=backend, nodes=nodes, power_cap_w=power, allreduce=algorithms)

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
        """The allowed values of one knob (empty for power when it is not tuned)."""
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
            if knob == "allreduce":
                if not isinstance(value, str) or value not in self.allreduce:
                    return False
            elif not isinstance(value, numbers.Real) or value not in self.values(knob):
                return False
        return True

    def snap(self, settings: Mapping[str, object]) -> Settings:
        """The nearest point of the space.

        Sizes snap to the nearest power of two by log distance (25 MiB -> 32), power caps are
        clamped into the limits then rounded to the grid (a missing cap means the maximum), a
        missing algorithm or one the backend lacks becomes ``ring``, and unknown keys are
        dropped. A missing bucket or chunk size, or a value that is not a number or an
        algorithm name, raises ValueError.
        """
        snapped: Settings = {}
        for knob in ("bucket_mb", "chunk_kb"):
            if knob not in settings:
                raise ValueError(f"{knob}: missing")
            snapped[knob] = _nearest_log2(_number(knob, settings[knob]), self.values(knob))
        if self.power_cap_w:
            raw = settings.get("power_cap_w")
            watts = self.power_cap_w[-1] if raw is None else _number("power_cap_w", raw)
            snapped["power_cap_w"] = min(self.power_cap_w, key=lambda w: (abs(w - watts), -w))
        name = settings.get("allreduce", "ring")
        if not isinstance(name, str):
            raise ValueError(f"allreduce: expected an algorithm name, got {name!r}")
        name = name.lower().replace("-", "_")
        known = {a for algorithms in ALGORITHMS.values() for a in algorithms}
        if name not in known | set(NCCL_EXTRA_ALGORITHMS):
            raise ValueError(f"allreduce: unknown algorithm {name!r}")
        snapped["allreduce"] = name if name in self.allreduce else "ring"
        return snapped

    def defaults(self) -> Settings:
        """PyTorch DDP's defaults in this space: 25 MiB buckets (snapped to 32), 4 MiB chunks,
        the maximum power cap and ring."""
        return self.snap(
            {"bucket_mb": DDP_DEFAULT_BUCKET_MB, "chunk_kb": DEFAULT_CHUNK_KB, "allreduce": "ring"}
        )

    def recommended(
        self, nodes: int | None = None, base: Mapping[str, object] | None = None
    ) -> Settings:
        """BACKGROUND.md's table applied over ``base`` (default :meth:`defaults`).

        Up to 8 nodes ring with 256 KiB chunks, 9-64 halving-doubling with 1 MiB, above 64 tree
        with 4 MiB. Where the backend lacks that algorithm it uses the nearest it has: NCCL has
        only ring and tree, so it keeps ring up to 64 nodes and uses tree above; Open MPI has no
        tree, so halving-doubling stays above 64 nodes; gloo is always ring.
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
        point.update(chunk_kb=chunk, allreduce=algorithm)
        return self.snap(point)

    def grid(self) -> Iterator[Settings]:
        """Every point of the space, in a fixed order."""
        knobs = self.knobs
        for combo in itertools.product(*(self.values(k) for k in knobs)):
            yield dict(zip(knobs, combo, strict=True))

    def backend_mapping(self, settings: Mapping[str, object]) -> dict[str, Any]:
        """The backend's own parameters for a point of this space (the power cap is applied
        through NVML, not the backend, so it is not included).

        nccl: ``NCCL_ALGO`` (a new communicator), ``bucket_cap_mb`` and ``chunk_bytes`` (the
        DDP comm hook's chunk); gloo: ``bucket_cap_mb`` and ``chunk_bytes``; mpi: Open MPI's
        ``coll_tuned_use_dynamic_rules``, ``coll_tuned_allreduce_algorithm`` and
        ``coll_tuned_allreduce_algorithm_segmentsize`` (bytes), plus ``bucket_cap_mb``.
        """
        if not self.contains(settings):
            raise ValueError(f"settings are not a point of this {self.backend} space: {settings}")
        bucket = int(settings["bucket_mb"])  # type: ignore[call-overload]
        chunk_bytes = int(settings["chunk_kb"]) * 1024  # type: ignore[call-overload]
        algorithm = str(settings["allreduce"])
        if self.backend == "nccl":
            return {
                "NCCL_ALGO": NCCL_ALGO[algorithm],
                "bucket_cap_mb": bucket,
                "chunk_bytes": chunk_bytes,
            }
        if self.backend == "gloo":
            return {"bucket_cap_mb": bucket, "chunk_bytes": chunk_bytes}
        return {
            "coll_tuned_use_dynamic_rules": 1,
            "coll_tuned_allreduce_algorithm": MPI_ALLREDUCE_ALGORITHM[algorithm],
            "coll_tuned_allreduce_algorithm_segmentsize": chunk_bytes,
            "bucket_cap_mb": bucket,
        }

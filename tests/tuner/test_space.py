from __future__ import annotations

import dataclasses

import pytest

from hyperagent.tuner import SearchSpace


def test_nccl_space_values_and_size() -> None:
    space = SearchSpace.default("nccl", nodes=16, power_limits_w=(200, 400))
    assert space.bucket_mb == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert space.chunk_kb == tuple(2**e for e in range(6, 17))
    assert space.chunk_kb[0] == 64 and space.chunk_kb[-1] == 65536
    assert space.power_cap_w == (200, 225, 250, 275, 300, 325, 350, 375, 400)
    assert space.allreduce == ("ring", "tree")
    assert space.knobs == ("bucket_mb", "chunk_kb", "power_cap_w", "allreduce")
    assert space.size == 9 * 11 * 9 * 2
    assert space.power_limits_w == (200, 400)


def test_power_grid_keeps_both_endpoints_off_the_25w_grid() -> None:
    space = SearchSpace.default("nccl", nodes=4, power_limits_w=(102.5, 263.7))
    assert space.power_cap_w == (103, 125, 150, 175, 200, 225, 250, 263)


def test_no_power_limits_means_no_power_knob() -> None:
    space = SearchSpace.default("nccl", nodes=4)
    assert space.power_cap_w == ()
    assert "power_cap_w" not in space.knobs
    assert space.size == 9 * 11 * 2
    assert all("power_cap_w" not in point for point in space.grid())
    assert space.power_limits_w is None


def test_gloo_has_no_allreduce_choice() -> None:
    space = SearchSpace.default("gloo", nodes=128, power_limits_w=(100, 250))
    assert space.allreduce == ("ring",)
    assert space.size == 9 * 11 * 7


def test_mpi_offers_ring_and_halving_doubling() -> None:
    assert SearchSpace.default("mpi", nodes=16).allreduce == ("ring", "halving_doubling")


def test_extra_algorithms_only_for_nccl() -> None:
    space = SearchSpace.default("nccl", nodes=4, extra_algorithms=("nvls", "collnet"))
    assert space.allreduce == ("ring", "tree", "nvls", "collnet")
    with pytest.raises(ValueError, match="nvls"):
        SearchSpace.default("mpi", nodes=4, extra_algorithms=("nvls",))
    with pytest.raises(ValueError, match="halving_doubling"):
        SearchSpace.default("nccl", nodes=4, extra_algorithms=("halving_doubling",))


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match="gloo, mpi, nccl"):
        SearchSpace.default("ucc", nodes=4)


def test_invalid_power_limits_and_nodes() -> None:
    with pytest.raises(ValueError, match="power_limits_w"):
        SearchSpace.default("nccl", nodes=4, power_limits_w=(300, 200))
    with pytest.raises(ValueError, match="nodes"):
        SearchSpace.default("nccl", nodes=0)


def test_space_is_frozen() -> None:
    space = SearchSpace.default("nccl", nodes=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        space.nodes = 8  # type: ignore[misc]


def test_contains() -> None:
    space = SearchSpace.default("nccl", nodes=4, power_limits_w=(100, 250))
    good = {"bucket_mb": 32, "chunk_kb": 4096, "power_cap_w": 250, "allreduce": "ring"}
    assert space.contains(good)
    assert not space.contains({**good, "bucket_mb": 25})
    assert not space.contains({**good, "chunk_kb": 32})
    assert not space.contains({**good, "power_cap_w": 260})
    assert not space.contains({**good, "power_cap_w": 110})
    assert not space.contains({**good, "allreduce": "halving_doubling"})
    assert not space.contains({**good, "bucket_mb": True})
    assert not space.contains({**good, "extra": 1})
    assert not space.contains({k: v for k, v in good.items() if k != "power_cap_w"})


def test_snap() -> None:
    space = SearchSpace.default("nccl", nodes=4, power_limits_w=(100, 250))
    base = {"bucket_mb": 25, "chunk_kb": 4096, "power_cap_w": 250, "allreduce": "ring"}
    assert space.snap(base)["bucket_mb"] == 32
    assert space.snap({**base, "bucket_mb": 20})["bucket_mb"] == 16
    assert space.snap({**base, "bucket_mb": 0.3})["bucket_mb"] == 1
    assert space.snap({**base, "bucket_mb": 1000})["bucket_mb"] == 256
    assert space.snap({**base, "chunk_kb": 2500})["chunk_kb"] == 2048
    assert space.snap({**base, "chunk_kb": 3000})["chunk_kb"] == 4096
    assert space.snap({**base, "power_cap_w": 90})["power_cap_w"] == 100
    assert space.snap({**base, "power_cap_w": 130})["power_cap_w"] == 125
    assert space.snap({**base, "power_cap_w": 400})["power_cap_w"] == 250
    assert space.snap({**base, "power_cap_w": None})["power_cap_w"] == 250
    assert space.snap({**base, "allreduce": "halving_doubling"})["allreduce"] == "ring"
    assert space.snap({**base, "allreduce": "Tree"})["allreduce"] == "tree"
    assert space.snap({"bucket_mb": 8, "chunk_kb": 64}) == {
        "bucket_mb": 8,
        "chunk_kb": 64,
        "power_cap_w": 250,
        "allreduce": "ring",
    }
    assert space.contains(space.snap({**base, "extra": "dropped"}))


def test_snap_without_power_drops_the_cap() -> None:
    space = SearchSpace.default("mpi", nodes=4)
    snapped = space.snap({"bucket_mb": 8, "chunk_kb": 64, "power_cap_w": 150})
    assert snapped == {"bucket_mb": 8, "chunk_kb": 64, "allreduce": "ring"}


def test_snap_rejects_what_it_cannot_interpret() -> None:
    space = SearchSpace.default("nccl", nodes=4)
    with pytest.raises(ValueError, match="bucket_mb"):
        space.snap({"chunk_kb": 64})
    with pytest.raises(ValueError, match="chunk_kb"):
        space.snap({"bucket_mb": 8, "chunk_kb": "lots"})
    with pytest.raises(ValueError, match="allreduce"):
        space.snap({"bucket_mb": 8, "chunk_kb": 64, "allreduce": "butterfly"})


def test_defaults_are_ddp_defaults_snapped() -> None:
    space = SearchSpace.default("nccl", nodes=4, power_limits_w=(100, 250))
    assert space.defaults() == {
        "bucket_mb": 32,
        "chunk_kb": 4096,
        "power_cap_w": 250,
        "allreduce": "ring",
    }


@pytest.mark.parametrize(
    ("backend", "nodes", "algorithm", "chunk_kb"),
    [
        ("mpi", 1, "ring", 256),
        ("mpi", 8, "ring", 256),
        ("mpi", 9, "halving_doubling", 1024),
        ("mpi", 64, "halving_doubling", 1024),
        ("mpi", 65, "halving_doubling", 4096),
        ("nccl", 4, "ring", 256),
        ("nccl", 16, "ring", 1024),
        ("nccl", 64, "ring", 1024),
        ("nccl", 65, "tree", 4096),
        ("nccl", 512, "tree", 4096),
        ("gloo", 16, "ring", 1024),
        ("gloo", 128, "ring", 4096),
    ],
)
def test_recommended_follows_the_table(
    backend: str, nodes: int, algorithm: str, chunk_kb: int
) -> None:
    space = SearchSpace.default(backend, nodes=nodes, power_limits_w=(100, 250))
    point = space.recommended()
    assert point["allreduce"] == algorithm
    assert point["chunk_kb"] == chunk_kb
    assert point["bucket_mb"] == 32 and point["power_cap_w"] == 250
    assert space.contains(point)


def test_recommended_for_other_node_counts_and_bases() -> None:
    space = SearchSpace.default("mpi", nodes=4, power_limits_w=(100, 250))
    assert space.recommended(32)["allreduce"] == "halving_doubling"
    base = {"bucket_mb": 8, "chunk_kb": 64, "power_cap_w": 150, "allreduce": "ring"}
    assert space.recommended(base=base) == {**base, "chunk_kb": 256}


def test_grid_enumerates_every_point_once() -> None:
    space = SearchSpace.default("mpi", nodes=4, power_limits_w=(100, 250))
    points = list(space.grid())
    assert len(points) == space.size == 9 * 11 * 7 * 2
    assert len({tuple(p.values()) for p in points}) == space.size
    assert all(space.contains(p) for p in points)


def test_backend_mapping() -> None:
    nccl = SearchSpace.default("nccl", nodes=4, extra_algorithms=("nvls",))
    assert nccl.backend_mapping({"bucket_mb": 64, "chunk_kb": 1024, "allreduce": "tree"}) == {
        "NCCL_ALGO": "Tree",
        "bucket_cap_mb": 64,
        "chunk_bytes": 1024 * 1024,
    }
    assert (
        nccl.backend_mapping({"bucket_mb": 64, "chunk_kb": 1024, "allreduce": "ring"})["NCCL_ALGO"]
        == "Ring"
    )
    assert (
        nccl.backend_mapping({"bucket_mb": 64, "chunk_kb": 1024, "allreduce": "nvls"})["NCCL_ALGO"]
        == "NVLS"
    )
    mpi = SearchSpace.default("mpi", nodes=16, power_limits_w=(100, 250))
    point = {"bucket_mb": 8, "chunk_kb": 256, "power_cap_w": 150, "allreduce": "halving_doubling"}
    assert mpi.backend_mapping(point) == {
        "coll_tuned_use_dynamic_rules": 1,
        "coll_tuned_allreduce_algorithm": 6,
        "coll_tuned_allreduce_algorithm_segmentsize": 262144,
        "bucket_cap_mb": 8,
    }
    assert (
        mpi.backend_mapping({**point, "allreduce": "ring"})["coll_tuned_allreduce_algorithm"] == 4
    )
    gloo = SearchSpace.default("gloo", nodes=2)
    assert gloo.backend_mapping({"bucket_mb": 16, "chunk_kb": 64, "allreduce": "ring"}) == {
        "bucket_cap_mb": 16,
        "chunk_bytes": 65536,
    }
    with pytest.raises(ValueError, match="not a point"):
        mpi.backend_mapping({**point, "allreduce": "tree"})


def test_constructor_validates_values() -> None:
    with pytest.raises(ValueError, match="powers of two"):
        SearchSpace(backend="nccl", nodes=4, bucket_mb=(1, 3))
    with pytest.raises(ValueError, match="increasing"):
        SearchSpace(backend="nccl", nodes=4, chunk_kb=(128, 64))
    with pytest.raises(ValueError, match="allreduce"):
        SearchSpace(backend="nccl", nodes=4, allreduce=("ring", "butterfly"))
    with pytest.raises(ValueError, match="ring"):
        SearchSpace(backend="nccl", nodes=4, allreduce=("tree",))
    narrow = SearchSpace(backend="nccl", nodes=4, bucket_mb=(8, 32), power_cap_w=(150, 200))
    assert narrow.size == 2 * 11 * 2 * 1

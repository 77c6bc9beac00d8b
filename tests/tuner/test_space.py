from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

import pytest

from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.space import (
    APPLIED_AT,
    APPLY_MODES,
    BACKENDS,
    BUCKET_MB,
    MIB,
    SearchSpace,
    ddp_bucket_mb,
)


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
    with pytest.raises(ValueError, match="deepspeed, gloo, horovod, mpi, nccl"):
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
    ("backend", "nodes", "algorithm", "chunk_kb", "bucket_mb"),
    [
        ("mpi", 1, "ring", 256, 128),
        ("mpi", 8, "ring", 256, 128),
        ("mpi", 9, "halving_doubling", 1024, 128),
        ("mpi", 47, "halving_doubling", 1024, 128),
        ("mpi", 48, "halving_doubling", 1024, 256),
        ("mpi", 65, "halving_doubling", 4096, 256),
        ("nccl", 4, "ring", 256, 128),
        ("nccl", 16, "ring", 1024, 128),
        ("nccl", 64, "ring", 1024, 256),
        ("nccl", 65, "tree", 4096, 256),
        ("nccl", 512, "tree", 4096, 256),
        ("gloo", 16, "ring", 1024, 128),
        ("gloo", 128, "ring", 4096, 256),
    ],
)
def test_recommended_follows_the_table(
    backend: str, nodes: int, algorithm: str, chunk_kb: int, bucket_mb: int
) -> None:
    space = SearchSpace.default(backend, nodes=nodes, power_limits_w=(100, 250))
    point = space.recommended()
    assert point["allreduce"] == algorithm
    assert point["chunk_kb"] == chunk_kb
    assert point["bucket_mb"] == bucket_mb and point["power_cap_w"] == 250
    assert space.contains(point)


def test_the_recommended_bucket_is_megatron_cores_for_the_node_count() -> None:
    assert ddp_bucket_mb(40) == ddp_bucket_mb(1) == 40e6 * 4 / MIB
    assert ddp_bucket_mb(128) == 128e6 * 4 / MIB
    assert ddp_bucket_mb(128, "bf16") == ddp_bucket_mb(128) / 2
    half = SearchSpace.default("nccl", nodes=4, gradient_dtype="bf16")
    assert half.recommended()["bucket_mb"] == 64
    narrow = SearchSpace(backend="nccl", nodes=128, bucket_mb=(8, 16), allreduce=("ring", "tree"))
    assert narrow.recommended()["bucket_mb"] == 16


def test_recommended_for_other_node_counts_and_bases() -> None:
    space = SearchSpace.default("mpi", nodes=4, power_limits_w=(100, 250))
    assert space.recommended(32)["allreduce"] == "halving_doubling"
    assert space.recommended(128)["bucket_mb"] == 256
    base = {"bucket_mb": 8, "chunk_kb": 64, "power_cap_w": 150, "allreduce": "ring"}
    assert space.recommended(base=base) == {**base, "bucket_mb": 128, "chunk_kb": 256}


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
        "requires": {
            "iteration_boundary": ["bucket_cap_mb", "chunk_bytes"],
            "new_communicator": ["NCCL_ALGO"],
            "restart": [],
        },
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
        "requires": {
            "iteration_boundary": ["bucket_cap_mb"],
            "new_communicator": [
                "coll_tuned_allreduce_algorithm",
                "coll_tuned_allreduce_algorithm_segmentsize",
                "coll_tuned_use_dynamic_rules",
            ],
            "restart": [],
        },
    }
    assert (
        mpi.backend_mapping({**point, "allreduce": "ring"})["coll_tuned_allreduce_algorithm"] == 4
    )
    gloo = SearchSpace.default("gloo", nodes=2)
    assert gloo.backend_mapping({"bucket_mb": 16, "chunk_kb": 64, "allreduce": "ring"}) == {
        "bucket_cap_mb": 16,
        "chunk_bytes": 65536,
        "requires": {
            "iteration_boundary": ["bucket_cap_mb", "chunk_bytes"],
            "new_communicator": [],
            "restart": [],
        },
    }
    with pytest.raises(ValueError, match="not a point"):
        mpi.backend_mapping({**point, "allreduce": "tree"})


def test_mappings_are_json_and_every_parameter_has_an_apply_mode() -> None:
    spaces = [
        SearchSpace.default(backend, nodes=8, power_limits_w=(100, 250)) for backend in BACKENDS
    ]
    for space in spaces:
        for point in space.grid():
            mapping = space.backend_mapping(point)
            assert json.loads(json.dumps(mapping)) == mapping
            requires = mapping.pop("requires")
            assert set(requires) == set(APPLY_MODES)
            assert sorted(p for names in requires.values() for p in names) == sorted(mapping)
            assert set(mapping) == set(APPLIED_AT[space.backend])


@pytest.mark.parametrize("backend", ["horovod", "deepspeed"])
def test_horovod_and_deepspeed_have_no_chunk_or_algorithm_knob(backend: str) -> None:
    space = SearchSpace.default(backend, nodes=16, power_limits_w=(100, 250))
    assert space.chunk_kb == () and space.allreduce == ()
    assert space.knobs == ("bucket_mb", "power_cap_w")
    assert space.size == 9 * 7
    assert all(set(point) == {"bucket_mb", "power_cap_w"} for point in space.grid())
    full = {"bucket_mb": 8, "chunk_kb": 64, "power_cap_w": 150, "allreduce": "tree"}
    assert not space.contains(full)
    assert space.snap(full) == {"bucket_mb": 8, "power_cap_w": 150}
    assert space.snap({"bucket_mb": 8}) == {"bucket_mb": 8, "power_cap_w": 250}
    assert space.recommended() == space.defaults()
    assert space.recommended(base={"bucket_mb": 3, "power_cap_w": 140}) == {
        "bucket_mb": 4,
        "power_cap_w": 150,
    }
    with pytest.raises(ValueError, match="bucket_mb"):
        space.snap({"chunk_kb": 64})
    no_power = SearchSpace.default(backend, nodes=2)
    assert no_power.knobs == ("bucket_mb",)
    assert list(no_power.grid()) == [{"bucket_mb": b} for b in BUCKET_MB]


def test_horovod_fusion_threshold_in_bytes() -> None:
    space = SearchSpace.default("horovod", nodes=4)
    assert space.defaults() == {"bucket_mb": 64}
    assert space.backend_mapping({"bucket_mb": 64}) == {
        "HOROVOD_FUSION_THRESHOLD": 64 * 1024 * 1024,
        "requires": {
            "iteration_boundary": [],
            "new_communicator": [],
            "restart": ["HOROVOD_FUSION_THRESHOLD"],
        },
    }
    assert space.backend_mapping({"bucket_mb": 1})["HOROVOD_FUSION_THRESHOLD"] == 1048576


@pytest.mark.parametrize(
    ("dtype", "elements_per_mib"), [("fp32", 262144), ("fp16", 524288), ("bf16", 524288)]
)
def test_deepspeed_buckets_in_elements(dtype: str, elements_per_mib: int) -> None:
    space = SearchSpace.default("deepspeed", nodes=4, gradient_dtype=dtype)
    mapping = space.backend_mapping({"bucket_mb": 32})
    assert (
        mapping["reduce_bucket_size"] == mapping["allgather_bucket_size"] == 32 * elements_per_mib
    )
    assert mapping["requires"]["restart"] == ["allgather_bucket_size", "reduce_bucket_size"]
    assert space.defaults() == {"bucket_mb": 256}


def test_deepspeed_default_bucket_is_its_own_5e8_elements_capped_to_the_range() -> None:
    narrow = SearchSpace(
        backend="deepspeed",
        nodes=4,
        bucket_mb=tuple(2**e for e in range(12)),
        chunk_kb=(),
        allreduce=(),
        gradient_dtype="fp16",
    )
    assert narrow.defaults() == {"bucket_mb": 1024}


def test_constructor_rejects_knobs_a_backend_cannot_apply() -> None:
    with pytest.raises(ValueError, match=r"horovod.*chunk_kb=\(\)"):
        SearchSpace(backend="horovod", nodes=4)
    with pytest.raises(ValueError, match=r"deepspeed.*allreduce=\(\)"):
        SearchSpace(backend="deepspeed", nodes=4, chunk_kb=())
    with pytest.raises(ValueError, match="chunk_kb needs"):
        SearchSpace(backend="nccl", nodes=4, chunk_kb=())
    with pytest.raises(ValueError, match="gradient_dtype"):
        SearchSpace.default("deepspeed", nodes=4, gradient_dtype="int8")
    ok = SearchSpace(backend="horovod", nodes=4, bucket_mb=(16, 32), chunk_kb=(), allreduce=())
    assert ok.size == 2


def test_tuner_searches_a_space_without_chunk_or_algorithm() -> None:
    space = SearchSpace.default("horovod", nodes=8, power_limits_w=(100, 250))

    def score(settings: Mapping[str, object]) -> float:
        bucket = math.log2(float(settings["bucket_mb"]))  # type: ignore[arg-type]
        power = float(settings["power_cap_w"])  # type: ignore[arg-type]
        return 100 - (bucket - 3) ** 2 - ((power - 175) / 25) ** 2

    tuner = Tuner(space, seed=1)
    first = tuner.ask()
    assert first == {"bucket_mb": 64, "power_cap_w": 250}
    for _ in range(20):
        settings = tuner.ask()
        assert space.contains(settings)
        tuner.tell(settings, score(settings))
    best = tuner.best
    assert best is not None
    assert best[0] == {"bucket_mb": 8, "power_cap_w": 175}
    assert space.backend_mapping(best[0])["HOROVOD_FUSION_THRESHOLD"] == 8 * 1024 * 1024


def test_constructor_validates_values() -> None:
    with pytest.raises(ValueError, match="powers of two"):
        SearchSpace(backend="nccl", nodes=4, bucket_mb=(1, 3))
    with pytest.raises(ValueError, match="increasing"):
        SearchSpace(backend="nccl", nodes=4, chunk_kb=(128, 64))
    with pytest.raises(ValueError, match="allreduce"):
        SearchSpace(backend="nccl", nodes=4, allreduce=("ring", "butterfly"))
    with pytest.raises(ValueError, match="ring"):
        SearchSpace(backend="nccl", nodes=4, allreduce=("tree", "nvls"))
    with pytest.raises(ValueError, match="at least one algorithm"):
        SearchSpace(backend="nccl", nodes=4, allreduce=())
    pinned = SearchSpace(backend="nccl", nodes=4, allreduce=("tree",))  # one algorithm: pinned
    point = pinned.snap({"bucket_mb": 32, "chunk_kb": 64, "allreduce": "ring"})
    assert point["allreduce"] == "tree"
    narrow = SearchSpace(backend="nccl", nodes=4, bucket_mb=(8, 32), power_cap_w=(150, 200))
    assert narrow.size == 2 * 11 * 2 * 1


def test_pin_holds_knobs_a_job_cannot_apply_at_their_starting_value() -> None:
    space = SearchSpace.default("nccl", nodes=4, power_limits_w=(100, 250))
    start = {"bucket_mb": 25, "chunk_kb": 4096, "allreduce": "tree", "power_cap_w": 250}
    pinned = space.pin(start, ["allreduce"])
    assert pinned.allreduce == ("tree",) and pinned.bucket_mb == space.bucket_mb
    assert pinned.size == space.size // 2
    assert all(s["allreduce"] == "tree" for s in pinned.grid())
    assert pinned.pin(start, ["bucket_mb", "chunk_kb"]).size == len(space.power_cap_w)


def test_throughput_holds_the_power_cap_at_its_highest_value() -> None:
    space = SearchSpace.default("nccl", nodes=4, power_limits_w=(100, 250))
    throughput = space.for_objective("throughput")
    assert throughput.power_cap_w == (250,)
    assert throughput.size == space.size // len(space.power_cap_w)
    assert throughput.defaults() == space.defaults()  # the start is at the highest cap already
    searched = (
        space.for_objective("energy"),
        space.for_objective("throughput", power_budget_w=180),  # a lower cap can win
        space.for_objective("throughput", search_power_cap=True),
    )
    assert all(s == space for s in searched)
    assert space.for_objective("energy", search_power_cap=False).power_cap_w == (250,)
    uncapped = SearchSpace.default("nccl", nodes=4)
    assert uncapped.for_objective("throughput") == uncapped
    with pytest.raises(ValueError, match="objective"):
        space.for_objective("speed")


def test_energy_objective_seeds_half_the_maximum_power_cap() -> None:
    space = SearchSpace.default("nccl", nodes=4, power_limits_w=(100, 250))
    tuner = Tuner(space, seed=0, objective="energy")
    asked = []
    for _ in range(3):
        settings = tuner.ask()
        asked.append(settings)
        tuner.tell(settings, 1.0)
    assert asked[0] == space.defaults()
    assert asked[1] == space.recommended(base=space.defaults())
    assert asked[2] == {**space.defaults(), "power_cap_w": 125}
    throughput = Tuner(space, seed=0)
    for _ in range(2):
        throughput.tell(throughput.ask(), 1.0)
    assert throughput.ask() != {**space.defaults(), "power_cap_w": 125}  # no low-power seed
    assert Tuner(SearchSpace.default("nccl", nodes=4), objective="energy").ask() == {
        "bucket_mb": 32,
        "chunk_kb": 4096,
        "allreduce": "ring",
    }
    with pytest.raises(ValueError, match="objective"):
        Tuner(space, objective="speed")


def test_the_energy_seed_caps_whichever_of_the_first_two_seeds_measured_better() -> None:
    space = SearchSpace.default("mpi", nodes=16, power_limits_w=(100, 250))
    start, table = space.defaults(), space.recommended(base=space.defaults())
    assert start != table
    for start_score, table_score, capped in ((1.0, 1.2, table), (1.2, 1.0, start)):
        tuner = Tuner(space, seed=0, objective="energy")
        assert tuner.ask() == start
        tuner.tell(start, start_score)
        assert tuner.ask() == table
        tuner.tell(table, table_score)
        assert tuner.ask() == {**capped, "power_cap_w": 125}
    replayed = Tuner(space, seed=0, objective="energy")  # a journal told the table alone
    replayed.tell(table, 1.0)
    assert replayed.ask() == start
    replayed.tell(start, 0.5)
    assert replayed.ask() == {**table, "power_cap_w": 125}


def test_model_proposals_stay_near_the_incumbent_until_the_search_stalls() -> None:
    space = SearchSpace.default("mpi", nodes=16, power_limits_w=(100, 250))
    numeric = ("bucket_mb", "chunk_kb", "power_cap_w")

    def steps(a: Mapping[str, object], b: Mapping[str, object]) -> int:
        return max(abs(space.values(k).index(a[k]) - space.values(k).index(b[k])) for k in numeric)

    def score(settings: Mapping[str, object]) -> float:
        far_corner = {"bucket_mb": 1, "chunk_kb": 64, "power_cap_w": 100}
        return -sum(
            (space.values(k).index(settings[k]) - space.values(k).index(far_corner[k])) ** 2
            for k in numeric
        )

    tuner = Tuner(space, seed=4)
    best_so_far: list[float] = []
    for trial in range(12):
        best = tuner.best  # the measured point of best posterior mean: the region's centre
        settings = tuner.ask()
        if trial >= 5:
            assert best is not None
            incumbent = best[0]
            stalled = len(best_so_far) - 1 - best_so_far.index(max(best_so_far))
            assert steps(settings, incumbent) <= 2 + stalled // 2
        value = float(score(settings))
        best_so_far.append(value)
        tuner.tell(settings, value)
    final = tuner.best
    assert final is not None and score(final[0]) > score(space.defaults())


# -- NCCL's AllReduce algorithm and protocol through the tuner plugin ----------------------

TUNED_DDP = ("bucket_mb", "chunk_kb")
WITH_PLUGIN = ("bucket_mb", "chunk_kb", "allreduce", "protocol")
START = {"bucket_mb": 32, "chunk_kb": 4096, "allreduce": "ring"}


def test_an_nccl_job_announcing_allreduce_and_protocol_tunes_both_live() -> None:
    space = SearchSpace.default("nccl", 2).announced(WITH_PLUGIN, START)
    assert space.knobs == ("bucket_mb", "chunk_kb", "allreduce", "protocol")
    assert space.allreduce == ("ring", "tree")
    assert space.protocol == ("ll", "ll128", "simple")
    assert {p["protocol"] for p in space.grid()} == {"ll", "ll128", "simple"}
    assert {p["allreduce"] for p in space.grid()} == {"ring", "tree"}
    assert space.snap(START)["protocol"] == "simple"
    assert space.snap({**START, "protocol": "LL128"})["protocol"] == "ll128"
    mapping = space.backend_mapping({**START, "protocol": "ll"})
    assert mapping["tuner_algorithm"] == "ring" and mapping["tuner_protocol"] == "ll"
    assert "NCCL_ALGO" not in mapping
    assert mapping["requires"]["new_communicator"] == [] == mapping["requires"]["restart"]
    baseline = space.backend_mapping(START)  # from before the job announced the protocol
    assert "tuner_protocol" not in baseline and baseline["tuner_algorithm"] == "ring"
    tuner = Tuner(space, seed=1, start=space.snap(START))
    for score in (10.0, 11.0, 9.0, 12.0):
        point = tuner.ask()
        assert space.contains(point) and point["protocol"] in space.protocol
        tuner.tell(point, score)


def test_a_job_that_does_not_announce_them_never_sees_the_protocol() -> None:
    full = SearchSpace.default("nccl", 2)
    assert full.protocol == () and "protocol" not in full.knobs
    space = full.announced(TUNED_DDP, START)
    assert space.allreduce == ("ring",), "the algorithm stays at its start value"
    assert all("protocol" not in point for point in space.grid())
    assert not space.contains({**START, "protocol": "simple"})
    assert "tuner_protocol" not in space.backend_mapping(START)
    widened = full.announced(WITH_PLUGIN, START)
    assert widened.announced(TUNED_DDP, START).protocol == (), "a re-announcement narrows it"
    gloo = SearchSpace.default("gloo", 2).announced(WITH_PLUGIN, START)
    assert gloo.protocol == () and "protocol" not in gloo.knobs
    with pytest.raises(ValueError, match="protocol"):
        SearchSpace("gloo", 1, protocol=("simple",))
    with pytest.raises(ValueError, match="protocol"):
        SearchSpace("nccl", 1, allreduce=("ring", "tree"), protocol=("fast",))


def test_announced_knobs_never_pin_the_agents_power_cap() -> None:
    """The power cap is the agent's knob, never announced by a job's ranks: a job that
    announced its own knobs keeps the power cap its objective searches."""
    full = SearchSpace.default("nccl", 1, (100, 250)).for_objective("energy")
    assert len(full.power_cap_w) > 1
    for knobs in (TUNED_DDP, WITH_PLUGIN, ()):
        assert full.announced(knobs, {**START, "power_cap_w": 250}).power_cap_w == full.power_cap_w

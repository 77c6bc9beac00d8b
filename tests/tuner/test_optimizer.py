from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
import pytest

from hyperagent.sim import JobModel
from hyperagent.tuner import optimizer
from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.space import SearchSpace

SPACE = SearchSpace.default("nccl", nodes=16, power_limits_w=(200, 400))


def bowl(settings: Mapping[str, object]) -> float:
    """A deterministic objective peaking at bucket 64, chunk 8192, 300 W, tree."""
    bucket = math.log2(float(settings["bucket_mb"]))  # type: ignore[arg-type]
    chunk = math.log2(float(settings["chunk_kb"]))  # type: ignore[arg-type]
    power = float(settings.get("power_cap_w", 300))  # type: ignore[arg-type]
    algorithm = 0.0 if settings["allreduce"] == "tree" else 0.5
    return 100 - (bucket - 6) ** 2 - (chunk - 13) ** 2 - ((power - 300) / 50) ** 2 - algorithm


def test_asks_are_json_safe_python_values_inside_the_space() -> None:
    tuner = Tuner(SPACE, seed=3)
    for _ in range(12):
        settings = tuner.ask()
        assert SPACE.contains(settings)
        assert {type(v) for k, v in settings.items() if k != "allreduce"} <= {int}
        assert type(settings["allreduce"]) is str
        assert json.loads(json.dumps(settings)) == settings
        tuner.tell(settings, bowl(settings))
    for settings, score in tuner.observations:
        assert all(type(v) in (int, str) for v in settings.values())
        assert type(score) is float


def test_seeds_come_first_then_nothing_repeats() -> None:
    tuner = Tuner(SPACE, seed=0)
    first = tuner.ask()
    assert first == {"bucket_mb": 32, "chunk_kb": 4096, "power_cap_w": 400, "allreduce": "ring"}
    tuner.tell(first, bowl(first))
    second = tuner.ask()
    assert second == SPACE.recommended(base=first)
    assert second == {**first, "bucket_mb": 128, "chunk_kb": 1024}
    tuner.tell(second, bowl(second))
    seen = {tuple(first.values()), tuple(second.values())}
    for _ in range(15):
        settings = tuner.ask()
        key = tuple(settings.values())
        assert key not in seen
        seen.add(key)
        tuner.tell(settings, bowl(settings))


def test_start_is_snapped_and_a_seed_equal_to_it_is_skipped() -> None:
    start = {"bucket_mb": 25, "chunk_kb": 1000, "power_cap_w": 310, "allreduce": "ring"}
    tuner = Tuner(SPACE, seed=0, start=start)
    first = tuner.ask()
    assert first == {"bucket_mb": 32, "chunk_kb": 1024, "power_cap_w": 300, "allreduce": "ring"}
    tuner.tell(first, 1.0)
    assert tuner.ask() != first


def test_after_the_seeds_the_initial_points_fill_the_space() -> None:
    """The seeds are points of a space-filling design, not the centre of a narrowed search:
    the initial points after them lie far from every seed (a prior that is wrong costs a few
    trials, not a local crawl away from it)."""
    space = SearchSpace.default("mpi", nodes=16, power_limits_w=(100, 250))
    numeric = ("bucket_mb", "chunk_kb", "power_cap_w")

    def steps(a: Mapping[str, object], b: Mapping[str, object]) -> int:
        return max(abs(space.values(k).index(a[k]) - space.values(k).index(b[k])) for k in numeric)

    tuner = Tuner(space, seed=2, objective="energy")
    asked: list[dict[str, object]] = []
    for _ in range(5):
        settings = tuner.ask()
        asked.append(settings)
        tuner.tell(settings, bowl(settings))
    seeds = [
        space.defaults(),
        space.recommended(base=space.defaults()),
        {**space.defaults(), "power_cap_w": 125},
    ]
    assert asked[:3] == seeds
    assert all(steps(point, seed) >= 2 for point in asked[3:] for seed in seeds), asked


def test_without_priors_only_the_start_is_seeded() -> None:
    tuner = Tuner(SPACE, seed=0, priors=False)
    first = tuner.ask()
    assert first == SPACE.defaults()
    tuner.tell(first, bowl(first))
    assert tuner.ask() != SPACE.recommended(base=first)


def test_ask_is_stable_until_tell() -> None:
    tuner = Tuner(SPACE, seed=0)
    assert tuner.ask() == tuner.ask()
    tuner.tell(tuner.ask(), 1.0)
    assert tuner.ask() == tuner.ask()


def test_a_seed_waits_until_it_is_told() -> None:
    tuner = Tuner(SPACE, seed=0)
    first = tuner.ask()
    foreign = {"bucket_mb": 2, "chunk_kb": 64, "power_cap_w": 225, "allreduce": "tree"}
    tuner.tell(foreign, 5.0)
    assert tuner.ask() == first


def test_tell_of_settings_never_asked_and_seed_skipping() -> None:
    tuner = Tuner(SPACE, seed=0)
    defaults = SPACE.defaults()
    foreign = {
        "bucket_mb": np.int64(8),
        "chunk_kb": 512,
        "power_cap_w": np.float64(250.0),
        "allreduce": "tree",
    }
    tuner.tell(foreign, 3.0)
    tuner.tell(defaults, 2.0)
    assert tuner.n_told == 2
    assert tuner.observations[0] == (
        {"bucket_mb": 8, "chunk_kb": 512, "power_cap_w": 250, "allreduce": "tree"},
        3.0,
    )
    assert tuner.ask() == SPACE.recommended(base=defaults)


def test_tell_rejects_points_outside_the_space_and_bad_scores() -> None:
    tuner = Tuner(SPACE, seed=0)
    settings = tuner.ask()
    with pytest.raises(ValueError, match="snap"):
        tuner.tell({**settings, "bucket_mb": 25}, 1.0)
    with pytest.raises(ValueError, match="snap"):
        tuner.tell({**settings, "allreduce": "halving_doubling"}, 1.0)
    with pytest.raises(ValueError, match="score"):
        tuner.tell(settings, math.nan)
    with pytest.raises(ValueError, match="score"):
        tuner.tell(settings, "fast")  # type: ignore[arg-type]
    assert tuner.n_told == 0


def test_best() -> None:
    tuner = Tuner(SPACE, seed=0)
    assert tuner.best is None
    scores = [5.0, 9.0, 7.0]
    asked = []
    for score in scores:
        settings = tuner.ask()
        asked.append(settings)
        tuner.tell(settings, score)
    assert tuner.best == (asked[1], 9.0)


def test_best_once_the_model_exists_is_a_measured_point() -> None:
    tuner = Tuner(SPACE, seed=1)
    for _ in range(15):
        settings = tuner.ask()
        tuner.tell(settings, bowl(settings))
    best = tuner.best
    assert best is not None
    measured = {tuple(s.values()): v for s, v in tuner.observations}
    assert measured[tuple(best[0].values())] == best[1]
    assert best[1] >= sorted(measured.values())[-3]


def test_converged() -> None:
    tuner = Tuner(SPACE, seed=0)
    with pytest.raises(ValueError):
        tuner.converged(0)
    for score in (10.0, 12.0, 12.05, 11.0, 12.1):
        tuner.tell(tuner.ask(), score)
    assert not tuner.converged(patience=5)
    assert tuner.converged(patience=3)
    assert not tuner.converged(patience=3, min_improvement=0.001)
    assert not tuner.converged(patience=4)
    tuner.tell(tuner.ask(), 20.0)
    assert not tuner.converged(patience=3)


def test_same_seed_same_proposals() -> None:
    space = SearchSpace.default("nccl", nodes=16)  # its design has ties, which the seed breaks

    def run(seed: int) -> list[dict[str, object]]:
        tuner = Tuner(space, seed=seed)
        proposals = []
        for _ in range(9):
            settings = tuner.ask()
            proposals.append(settings)
            tuner.tell(settings, bowl(settings))
        return proposals

    assert run(7) == run(7)
    assert len({tuple(tuple(p.values()) for p in run(seed)) for seed in range(7, 11)}) > 1


def test_every_point_once_before_any_repeat() -> None:
    space = SearchSpace(
        backend="nccl", nodes=4, bucket_mb=(1, 2, 4), chunk_kb=(64, 128), allreduce=("ring", "tree")
    )
    tuner = Tuner(space, seed=0, n_initial_points=3)
    seen = set()
    for _ in range(space.size):
        settings = tuner.ask()
        seen.add(tuple(settings.values()))
        tuner.tell(settings, bowl(settings))
    assert len(seen) == space.size
    assert space.contains(tuner.ask())


def test_a_chunk_as_large_as_its_bucket_or_larger_is_one_setting_measured_once() -> None:
    space = SearchSpace(
        backend="nccl",
        nodes=4,
        bucket_mb=(1, 2, 4),
        chunk_kb=(256, 1024, 2048, 4096, 8192),
        allreduce=("ring", "tree"),
    )
    whole = {
        (b, min(c, 1024 * b), a)
        for b in space.bucket_mb
        for c in space.chunk_kb
        for a in space.allreduce
    }
    assert len(whole) == 18 < space.size == 30
    tuner = Tuner(space, seed=0, n_initial_points=3)
    proposed = []
    for _ in range(len(whole)):
        settings = tuner.ask()
        proposed.append(settings)
        tuner.tell(settings, bowl(settings))
    assert all(s["chunk_kb"] <= 1024 * s["bucket_mb"] for s in proposed), proposed
    assert {(s["bucket_mb"], s["chunk_kb"], s["allreduce"]) for s in proposed} == whole

    replayed = Tuner(space, seed=0, n_initial_points=3)
    replayed.tell({"bucket_mb": 1, "chunk_kb": 8192, "allreduce": "ring"}, 100.0)
    for _ in range(17):
        settings = replayed.ask()
        assert (settings["bucket_mb"], settings["chunk_kb"], settings["allreduce"]) != (
            1,
            1024,
            "ring",
        ), "the whole 1 MiB bucket in one chunk was measured already"
        replayed.tell(settings, bowl(settings))


def test_gloo_keeps_its_single_algorithm() -> None:
    space = SearchSpace.default("gloo", nodes=4, power_limits_w=(100, 250))
    tuner = Tuner(space, seed=0)
    for _ in range(8):
        settings = tuner.ask()
        assert settings["allreduce"] == "ring"
        assert space.contains(settings)
        tuner.tell(settings, bowl(settings))


def test_a_single_point_space() -> None:
    space = SearchSpace(backend="gloo", nodes=2, bucket_mb=(16,), chunk_kb=(64,))
    tuner = Tuner(space, seed=0)
    assert tuner.ask() == {"bucket_mb": 16, "chunk_kb": 64, "allreduce": "ring"}
    tuner.tell(tuner.ask(), 1.0)
    assert tuner.ask() == {"bucket_mb": 16, "chunk_kb": 64, "allreduce": "ring"}
    assert tuner.best == ({"bucket_mb": 16, "chunk_kb": 64, "allreduce": "ring"}, 1.0)


def test_rejects_unknown_acquisition() -> None:
    with pytest.raises(ValueError, match="EI"):
        Tuner(SPACE, acq_func="gp_hedge")


@pytest.mark.parametrize("acq_func", ["EI", "LCB"])
def test_finds_the_simulated_optimum(acq_func: str) -> None:
    model = JobModel(noise=0.0)
    space = model.space("nccl")
    _, optimum = model.optimum(space)
    tuner = Tuner(space, seed=0, acq_func=acq_func)
    for _ in range(30):
        settings = tuner.ask()
        tuner.tell(settings, model.throughput(settings))
    best = tuner.best
    assert best is not None
    assert model.throughput(best[0]) >= 0.95 * optimum


def broad_mode_and_a_narrow_peak(settings: Mapping[str, object]) -> float:
    """A wide hill at 64 MiB buckets and 8 MiB chunks (at most 100) and, away from it, a
    one-point-wide peak of 130 at 16 MiB and 256 KiB with ring."""
    bucket = math.log2(float(settings["bucket_mb"]))  # type: ignore[arg-type]
    chunk = math.log2(float(settings["chunk_kb"]))  # type: ignore[arg-type]
    hill = 100 - 2 * math.hypot(bucket - 6, chunk - 13)
    peak = 130 - 30 * math.hypot(bucket - 4, chunk - 8) if settings["allreduce"] == "ring" else 0
    return max(hill, peak)


def trials_to_the_peak(seed: int) -> int | None:
    tuner = Tuner(SearchSpace.default("nccl", nodes=16), seed=seed)
    for trial in range(1, 31):
        settings = tuner.ask()
        score = broad_mode_and_a_narrow_peak(settings)
        if score >= 125:
            return trial
        tuner.tell(settings, score)
    return None


def test_a_search_held_on_one_mode_still_measures_far_from_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = [trials_to_the_peak(seed) for seed in range(8)]
    assert sum(t is not None for t in found) >= 2, found
    monkeypatch.setattr(optimizer, "RESTART_AFTER_STALLED", 10**9)
    assert [trials_to_the_peak(seed) for seed in range(8)] == [None] * 8


def test_a_noisy_measurement_is_trusted_less() -> None:
    from hyperagent.tuner.optimizer import Tuner
    from hyperagent.tuner.space import SearchSpace

    space = SearchSpace.default("nccl", 4, (100, 250))

    def tuned(noise: float | None) -> dict[str, object]:
        tuner = Tuner(space, seed=3, n_initial_points=2)
        base = space.defaults()
        hump = ((2, 70.0), (4, 85.0), (8, 95.0), (16, 105.0), (32, 110.0), (64, 105.0), (128, 95.0))
        for bucket, score in hump:
            tuner.tell({**base, "bucket_mb": bucket}, score, noise=1.0)
        # one lucky reading next door, whose windows disagreed wildly (or were not reported)
        lucky = {**base, "bucket_mb": 256}
        tuner.tell(lucky, 130.0, noise=noise)
        assert tuner.best is not None
        return tuner.best[0]

    assert tuned(noise=None)["bucket_mb"] == 256
    assert tuned(noise=30.0)["bucket_mb"] == 32


def test_the_tuner_api_imports_from_the_package_and_skopt_only_with_the_tuner() -> None:
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import hyperagent.agent\n"
        "from hyperagent.tuner import SearchSpace\n"
        "from hyperagent.tuner.trial import score\n"
        "assert 'skopt' not in sys.modules, 'the agent side loaded scikit-optimize'\n"
        "from hyperagent.tuner import Tuner\n"
        "assert 'skopt' in sys.modules\n"
        "space = SearchSpace.default('nccl', nodes=4)\n"
        "print(space.contains(Tuner(space, seed=1).ask()))\n"
        "try:\n"
        "    from hyperagent.tuner import Tunr\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "True"
    assert "cannot import name 'Tunr' from 'hyperagent.tuner'" in lines[1]


def _predicted_best_cap(monkeypatch: pytest.MonkeyPatch, power_terms: bool) -> int:
    """An energy tuner told a bucket sweep at 250 W and a power sweep at a poor bucket of a
    landscape that is their product: the cap its model predicts best at the best bucket."""
    monkeypatch.setattr(optimizer, "POWER_TERMS", power_terms)
    space = SearchSpace.default("gloo", 4, (100, 250))
    tuner = Tuner(space, seed=0, objective="energy")
    base = {**space.defaults(), "chunk_kb": 1024}
    comm = {1: 0.6, 2: 0.7, 4: 0.8, 8: 0.9, 16: 0.97, 32: 1.0, 64: 0.95, 128: 0.85, 256: 0.75}
    power = {100: 0.8, 125: 0.92, 150: 1.0, 175: 0.97, 200: 0.93, 225: 0.9, 250: 0.87}
    for bucket, factor in comm.items():
        tuner.tell({**base, "bucket_mb": bucket, "power_cap_w": 250}, 3.0 * factor * power[250])
    for watts, factor in power.items():
        if watts != 250:
            tuner.tell({**base, "bucket_mb": 2, "power_cap_w": watts}, 3.0 * comm[2] * factor)
    tuner._fit()
    assert tuner._optimizer is not None and tuner._grid_x is not None
    rows = [i for i, s in enumerate(tuner._grid) if s["chunk_kb"] == 1024 and s["bucket_mb"] == 32]
    mean = tuner._optimizer.models[-1].predict(tuner._grid_x[rows])
    return int(tuner._grid[rows[int(np.argmin(mean))]]["power_cap_w"])


def test_a_power_cap_measured_with_other_settings_informs_the_best_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert abs(_predicted_best_cap(monkeypatch, power_terms=True) - 150) <= 25
    assert _predicted_best_cap(monkeypatch, power_terms=False) >= 200


def test_an_energy_score_of_zero_is_told_below_every_measured_one() -> None:
    space = SearchSpace.default("gloo", 4, (100, 250))
    tuner = Tuner(space, seed=0, objective="energy", n_initial_points=2)
    first, second = tuner.ask(), None
    tuner.tell(first, 2.0, noise=0.1)
    second = tuner.ask()
    tuner.tell(second, 0.0)
    assert tuner.best is not None and tuner.best[0] == first
    assert tuner.space.contains(tuner.ask())


def _product_of_knobs(settings: Mapping[str, object]) -> float:
    """Samples per joule as a product of one factor per knob: tree 10% ahead of ring, the
    best bucket 32 MiB, the best chunk 2 MiB and the best cap 150 W."""
    bucket = math.log2(float(settings["bucket_mb"]))  # type: ignore[arg-type]
    chunk = min(math.log2(float(settings["chunk_kb"])), bucket + 10)  # type: ignore[arg-type]
    watts = float(settings["power_cap_w"])  # type: ignore[arg-type]
    algorithm = 1.1 if settings["allreduce"] == "tree" else 1.0
    return (
        3.0
        * algorithm
        / (1 + 0.1 * abs(bucket - 5))
        / (1 + 0.1 * abs(chunk - 11))
        / (1 + 0.1 * abs(watts - 150) / 25)
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_an_energy_model_follows_every_knob_from_its_first_fits(seed: int) -> None:
    """From the first fit on, along each of the power cap, the bucket and the chunk (the
    others held at the next proposal's), the model's predicted log score spans at least a
    twentieth of what the landscape's does: no knob is ignored for a few trials."""
    space = SearchSpace.default("nccl", 16, (100, 250))
    tuner = Tuner(space, seed=seed, objective="energy")
    spans = []
    for _ in range(13):
        settings = tuner.ask()
        assert tuner._optimizer is not None and tuner._grid_x is not None
        if tuner._optimizer.models:
            model = tuner._optimizer.models[-1]
            for knob in ("power_cap_w", "bucket_mb", "chunk_kb"):
                rows = [
                    i
                    for i, point in enumerate(tuner._grid)
                    if all(point[k] == settings[k] for k in point if k != knob)
                ]
                predicted = -model.predict(tuner._grid_x[rows])
                true = [math.log(_product_of_knobs(tuner._grid[i])) for i in rows]
                spans.append((predicted.max() - predicted.min()) / (max(true) - min(true)))
        score = _product_of_knobs(settings)
        tuner.tell(settings, score, noise=0.02 * score)
    assert len(spans) >= 3 * 8
    assert min(spans) > 0.05, [round(float(s), 2) for s in spans]

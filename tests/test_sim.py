from __future__ import annotations

import csv
import hashlib
import io
import math
import random
import statistics
from importlib import resources

import pytest

from hyperagent.sim import JobModel, PowerCurve, Step, power_curve
from hyperagent.tuner.space import SearchSpace

DEFAULTS = {"bucket_mb": 32, "chunk_kb": 4096, "power_cap_w": 250, "allreduce": "ring"}
CURVE_SHA256 = "f0b066dd1a451bd78f730e001ac3a7c411979bc7f0846f12c1a9fb604aa90628"


def curve_text() -> bytes:
    return (
        resources.files("hyperagent").joinpath("data", "zeus-summary_power_v100.csv").read_bytes()
    )


def squad_slowdown_and_power(limit: int) -> tuple[float, float]:
    rows = list(csv.DictReader(io.StringIO(curve_text().decode())))
    runs: dict[str, dict[int, tuple[float, float]]] = {}
    for row in rows:
        if row["dataset"] == "squad" and row["network"] == "bert_base_uncased":
            runs.setdefault(row["batch_size"], {})[int(row["power_limit"])] = (
                float(row["time_per_epoch"]),
                float(row["average_power"]),
            )
    slowdown = statistics.fmean(r[limit][0] / r[250][0] for r in runs.values())
    power = statistics.fmean(r[limit][1] for r in runs.values())
    return slowdown, power


def best_algorithm(model: JobModel) -> str:
    space = SearchSpace(
        backend="mpi",
        nodes=model.nodes,
        power_cap_w=(250,),
        allreduce=("ring", "halving_doubling", "tree"),
    )
    best, _ = model.optimum(space)
    return str(best["allreduce"])


def test_packaged_curve_is_the_zeus_file() -> None:
    assert hashlib.sha256(curve_text()).hexdigest() == CURVE_SHA256


def test_curve_from_the_squad_bert_rows() -> None:
    curve = power_curve()
    assert curve.limits_w == (100, 125, 150, 175, 200, 225, 250)
    for limit in (100, 150, 250):
        slowdown, power = curve.at(limit, 250)
        expected_slowdown, expected_power = squad_slowdown_and_power(limit)
        assert slowdown == pytest.approx(expected_slowdown)
        assert power == pytest.approx(min(expected_power, limit))
    assert curve.at(250, 250)[0] == pytest.approx(1.0)
    low, high = squad_slowdown_and_power(125), squad_slowdown_and_power(150)
    assert curve.at(137.5, 250)[0] == pytest.approx((low[0] + high[0]) / 2)


def test_curve_scales_to_other_power_ranges() -> None:
    curve = power_curve()
    slowdown, power = curve.at(300, 500)
    expected_slowdown, expected_power = squad_slowdown_and_power(150)
    assert slowdown == pytest.approx(expected_slowdown)
    assert power == pytest.approx(expected_power * 2)
    assert curve.at(50, 500)[0] == pytest.approx(squad_slowdown_and_power(100)[0])


def test_curve_needs_its_workload() -> None:
    with pytest.raises(ValueError, match="no rows"):
        PowerCurve.from_csv(curve_text().decode(), ("imagenet", "vgg"))


@pytest.mark.parametrize(
    ("nodes", "algorithm"), [(4, "ring"), (16, "halving_doubling"), (128, "tree")]
)
@pytest.mark.parametrize("params_b", [0.35, 1.3])
def test_best_algorithm_by_node_count(nodes: int, algorithm: str, params_b: float) -> None:
    assert best_algorithm(JobModel(params_b=params_b, nodes=nodes)) == algorithm


def test_nccl_picks_tree_at_128_nodes_and_ring_at_4() -> None:
    for nodes, algorithm in ((4, "ring"), (128, "tree")):
        model = JobModel(nodes=nodes)
        best, _ = model.optimum(model.space("nccl"))
        assert best["allreduce"] == algorithm


def test_chunk_optimum_grows_with_model_size() -> None:
    large, _ = JobModel(params_b=1.3, nodes=4).optimum(SearchSpace.default("mpi", 4))
    small, _ = JobModel(params_b=0.35, nodes=4).optimum(SearchSpace.default("mpi", 4))
    assert large["chunk_kb"] == 8192
    assert small["chunk_kb"] == 256


@pytest.mark.parametrize(("nodes", "backend"), [(4, "nccl"), (16, "mpi"), (128, "nccl")])
def test_throughput_optimum_against_ddp_defaults(nodes: int, backend: str) -> None:
    model = JobModel(nodes=nodes)
    space = model.space(backend)
    best, value = model.optimum(space)
    assert best["bucket_mb"] not in (25, 32)
    assert best["bucket_mb"] not in (space.bucket_mb[0], space.bucket_mb[-1]) or nodes > 4
    gain = value / model.throughput(DEFAULTS) - 1
    assert 0.10 <= gain <= 0.60


def test_energy_optimum_caps_power_lower_than_throughput_optimum() -> None:
    for nodes in (4, 16):
        model = JobModel(nodes=nodes)
        space = model.space("mpi")
        fastest, _ = model.optimum(space, "throughput")
        frugal, _ = model.optimum(space, "energy")
        assert fastest["power_cap_w"] == 250
        assert frugal["power_cap_w"] < fastest["power_cap_w"]


def test_step_times_are_realistic() -> None:
    model = JobModel()
    for settings in model.space().grid():
        step = model.expected_step(settings)
        assert 0.1 <= step.compute_s <= step.step_s <= 8.0
    default = model.expected_step(DEFAULTS)
    assert 0.5 <= default.step_s <= 2.0
    best, _ = model.optimum(model.space())
    assert 0.5 <= model.expected_step(best).step_s <= default.step_s
    assert 0.0 < default.comm_s < default.compute_s
    assert default.gpu_util == pytest.approx(default.compute_s / default.step_s)
    assert default.samples == 8 * 16


def test_lower_power_cap_cuts_power_and_slows_compute_per_the_curve() -> None:
    model = JobModel(noise=0.0)
    full = model.expected_step(DEFAULTS)
    capped = model.expected_step({**DEFAULTS, "power_cap_w": 150})
    slowdown, compute_power = squad_slowdown_and_power(150)
    assert capped.compute_s == pytest.approx(full.compute_s * slowdown)
    assert capped.gpu_power_w < full.gpu_power_w
    assert capped.gpu_power_w <= 150
    assert capped.gpu_power_w < compute_power + 1e-9
    assert model.expected_step({k: v for k, v in DEFAULTS.items() if k != "power_cap_w"}) == full
    assert model.expected_step({**DEFAULTS, "power_cap_w": 400}) == full


def test_throughput_and_energy_are_whole_job() -> None:
    model = JobModel(nodes=4, gpus_per_node=8, samples_per_gpu=16)
    step = model.expected_step(DEFAULTS)
    assert model.throughput(DEFAULTS) == pytest.approx(4 * 8 * 16 / step.step_s)
    joules = step.gpu_power_w * step.step_s * 4 * 8
    assert model.samples_per_joule(DEFAULTS) == pytest.approx(4 * 8 * 16 / joules)
    assert model.score(DEFAULTS, "throughput") == model.throughput(DEFAULTS)
    assert model.score(DEFAULTS, "energy") == model.samples_per_joule(DEFAULTS)
    with pytest.raises(ValueError, match="objective"):
        model.score(DEFAULTS, "latency")


def test_noise_is_multiplicative_lognormal_and_seeded() -> None:
    model = JobModel(noise=0.05)
    mean = model.expected_step(DEFAULTS)
    steps = [model.step(DEFAULTS, random.Random(i)) for i in range(400)]
    ratios = [s.step_s / mean.step_s for s in steps]
    for s, ratio in zip(steps, ratios, strict=True):
        assert s.compute_s / mean.compute_s == pytest.approx(ratio)
        assert s.comm_s / mean.comm_s == pytest.approx(ratio)
    logs = [math.log(r) for r in ratios]
    assert abs(statistics.fmean(logs)) < 0.01
    assert statistics.stdev(logs) == pytest.approx(0.05, rel=0.15)
    power_logs = [math.log(s.gpu_power_w / mean.gpu_power_w) for s in steps]
    assert statistics.stdev(power_logs) == pytest.approx(0.05, rel=0.15)
    assert model.step(DEFAULTS, random.Random(7)) == model.step(DEFAULTS, random.Random(7))
    assert model.step(DEFAULTS, random.Random(7)) != model.step(DEFAULTS, random.Random(8))


def test_noisy_score_and_zero_noise() -> None:
    quiet = JobModel(noise=0.0)
    assert quiet.step(DEFAULTS, random.Random(1)) == quiet.expected_step(DEFAULTS)
    noisy = JobModel(noise=0.05)
    scores = [noisy.score(DEFAULTS, "throughput", random.Random(i)) for i in range(50)]
    assert len(set(scores)) == 50
    assert statistics.median(scores) == pytest.approx(noisy.throughput(DEFAULTS), rel=0.03)


def test_single_node_has_no_communication() -> None:
    step = JobModel(nodes=1).expected_step(DEFAULTS)
    assert step.comm_s == 0.0
    assert step.gpu_util == 1.0


def test_bad_settings_and_models() -> None:
    model = JobModel()
    with pytest.raises(ValueError, match="bucket_mb"):
        model.expected_step({**DEFAULTS, "bucket_mb": 0})
    with pytest.raises(ValueError, match="allreduce"):
        model.expected_step({**DEFAULTS, "allreduce": "nvls"})
    with pytest.raises(ValueError):
        JobModel(nodes=0)
    with pytest.raises(ValueError):
        JobModel(power_limits_w=(250.0, 100.0))


def test_space_of_the_job() -> None:
    model = JobModel(nodes=16, power_limits_w=(100.0, 250.0))
    assert model.space("mpi") == SearchSpace.default("mpi", 16, (100.0, 250.0))
    assert isinstance(model.expected_step(DEFAULTS), Step)

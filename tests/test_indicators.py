"""Indicators against values computed by hand (DESIGN.md's definitions)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from hyperagent.agent import Agent
from hyperagent.config import DEFAULT_QUANTUM_COEFFICIENTS as TABLE
from hyperagent.config import build_config
from hyperagent.indicators import (
    JobWindows,
    _warn_unknown_model,
    communication_compute_ratio,
    compute_entropy,
    derive,
    energy_per_sample,
    estimated_ccr,
    estimated_gpu_memory_pressure,
    host_memory_pressure,
    memory_pressure,
    quantum_coefficient,
    quantum_dispersion,
    quantum_utilization,
    reported_gpu_memory_pressure,
)
from hyperagent.readings import Kind, Reading, Snapshot
from hyperagent.sources import Hardware

A100_HALF_V100_FULL = [(1.0, 0.5), (0.6, 1.0)]
STALL = "hyperagent_host_memory_pressure_stall_seconds_total"


def test_quantum_utilization_weights_by_coefficient() -> None:
    # (1.0 * 0.5 + 0.6 * 1.0) / (1.0 + 0.6) = 1.1 / 1.6
    assert quantum_utilization(A100_HALF_V100_FULL) == pytest.approx(0.6875)
    assert quantum_utilization([]) is None


def test_compute_entropy_normalised() -> None:
    # p = 5/11, 6/11; H = -(5/11 ln 5/11 + 6/11 ln 6/11) = 0.689009; / ln 2 = 0.994030
    assert compute_entropy(A100_HALF_V100_FULL) == pytest.approx(0.994030, abs=1e-6)
    assert compute_entropy([(1.0, 0.8)] * 4) == pytest.approx(1.0)
    assert compute_entropy([(1.0, 1.0), (1.0, 0.0), (1.0, 0.0)]) == pytest.approx(0.0)
    assert compute_entropy([(1.0, 0.0), (1.0, 0.0)]) is None
    assert compute_entropy([(0.6, 0.3)]) == 1.0


def test_quantum_dispersion_is_coefficient_of_variation() -> None:
    # loads 0.5, 0.6: mean 0.55, population std 0.05 -> 0.090909
    assert quantum_dispersion(A100_HALF_V100_FULL) == pytest.approx(0.0909091, abs=1e-6)
    # loads 1, 0, 0: mean 1/3, std sqrt(2)/3 -> sqrt(2), above the 0.7 balancing threshold
    assert quantum_dispersion([(1.0, 1.0), (1.0, 0.0), (1.0, 0.0)]) == pytest.approx(math.sqrt(2))
    assert quantum_dispersion([(1.0, 0.0)]) is None


def test_ccr_memory_pressure_energy() -> None:
    assert communication_compute_ratio(0.3, 1.0) == pytest.approx(0.3)
    assert communication_compute_ratio(1.0, 0.0) is None
    # one port: 12.5 GB at 12.5 GB/s = 1 s of link time; two GPUs busy 4 s each
    assert estimated_ccr([(12.5e9, 12.5e9)], [4.0, 4.0]) == pytest.approx(0.25)
    # two active ports (2 s and 1 s at link rate, mean 1.5 s), an idle one left out; GPUs 3 s, 1 s
    ports = [(25e9, 12.5e9), (12.5e9, 12.5e9), (0.0, 12.5e9)]
    assert estimated_ccr(ports, [3.0, 1.0]) == pytest.approx(1.5 / 2.0)
    assert estimated_ccr([(0.0, 12.5e9)], [4.0]) == 0.0  # no traffic at all
    assert estimated_ccr([(1e9, 0.0)], [4.0]) is None  # no known link rate
    assert estimated_ccr([(1e9, 12.5e9)], [0.0, 0.0]) is None  # nothing computed
    assert memory_pressure(0.5, 0.875) == pytest.approx(0.875)
    assert memory_pressure(None, 0.25) == pytest.approx(0.25)
    assert memory_pressure(None, None) is None
    assert energy_per_sample(500.0, 1000) == pytest.approx(0.5)
    assert energy_per_sample(500.0, 0) is None


# The fullest GPU of fixtures/replay/full-node (nvidia-smi/gtx-8card.xml: 8 x V100S under
# training), as NVML reports it: 33,719,058,432 of 34,089,205,760 bytes used (98.9%).
V100S_USED, V100S_TOTAL = 33_719_058_432.0, 34_089_205_760.0


def test_gpu_memory_pressure_reported_by_the_allocator_or_estimated_from_nvml() -> None:
    assert estimated_gpu_memory_pressure([(V100S_USED, V100S_TOTAL), (8.0, 32.0)]) == (
        pytest.approx(0.98914, abs=1e-5)
    )
    assert estimated_gpu_memory_pressure([(1.0, 0.0)]) is None
    assert reported_gpu_memory_pressure([0.61, 0.58], failures=0) == pytest.approx(0.61)
    assert reported_gpu_memory_pressure([0.61], failures=1) == 1.0  # a retried cudaMalloc
    assert reported_gpu_memory_pressure([], failures=3) is None


def test_host_memory_pressure_is_used_memory_or_the_psi_stall_share() -> None:
    assert host_memory_pressure(4.0, 16.0) == pytest.approx(0.75)
    assert host_memory_pressure(12.0, 16.0, stall_share=0.4) == pytest.approx(0.4)
    assert host_memory_pressure(4.0, 16.0, stall_share=0.1) == pytest.approx(0.75)
    assert host_memory_pressure(12.0, 16.0, stall_share=3.0) == 1.0  # clock jitter, clamped
    assert host_memory_pressure(None, 16.0) is None and host_memory_pressure(1.0, 0.0) is None


def _healthy_node(ts: float, extra: list[Reading]) -> Snapshot:
    """Two V100S full as NVML sees them (the capture's fullest GPU), host memory 25% used."""
    readings = [
        Reading("hyperagent_host_memory_available_bytes", 12e9),
        Reading("hyperagent_host_memory_total_bytes", 16e9),
    ]
    for gpu in ("0", "1"):
        labels = {"gpu": gpu, "uuid": f"GPU-{gpu}"}
        readings.append(Reading("hyperagent_gpu_memory_used_bytes", V100S_USED, labels))
        readings.append(Reading("hyperagent_gpu_memory_total_bytes", V100S_TOTAL, labels))
    return Snapshot(ts, "n", (*readings, *extra))


def _allocator(job_id: str, allocated: float, retries: float, ooms: float) -> list[Reading]:
    """The job source's readings of one job's allocator reports."""
    job = {"job_id": job_id}
    return [
        Reading("hyperagent_job_gpu_memory_allocated_ratio", allocated, job),
        Reading("hyperagent_job_alloc_retries_total", retries, job, Kind.COUNTER),
        Reading("hyperagent_job_oom_total", ooms, job, Kind.COUNTER),
    ]


def _pressure(after: Snapshot, before: Snapshot | None) -> dict[str, float]:
    return {
        r.labels["method"]: r.value
        for r in derive(after, before, TABLE)
        if r.name == "hyperagent_memory_pressure_ratio"
    }


def test_memory_pressure_is_the_allocator_s_when_the_job_reports_it() -> None:
    before = _healthy_node(10.0, _allocator("a", 0.55, 2, 0) + _allocator("b", 0.61, 0, 0))
    after = _healthy_node(11.0, _allocator("a", 0.57, 2, 0) + _allocator("b", 0.62, 0, 0))
    assert _pressure(after, before) == {"reported": pytest.approx(0.62)}
    # NVML's 98.9% used only counts where no job reports its allocator
    assert _pressure(_healthy_node(11.0, []), None) == {"estimated": pytest.approx(0.98914, 1e-4)}


@pytest.mark.parametrize("counter", ["retries", "ooms"])
def test_allocation_retries_or_ooms_in_the_window_are_full_pressure(counter: str) -> None:
    before = _healthy_node(10.0, _allocator("a", 0.55, 2, 1) + _allocator("b", 0.6, 0, 0))
    grown = {"retries": 0, "ooms": 0, counter: 1}
    after = _healthy_node(11.0, _allocator("a", 0.55, 2, 1) + _allocator("b", 0.6, **grown))
    assert _pressure(after, before) == {"reported": 1.0}
    # a job seen for the first time brings its past retries: not this window's
    assert _pressure(after, _healthy_node(10.0, _allocator("a", 0.55, 2, 1))) == {
        "reported": pytest.approx(0.6)
    }


def test_host_memory_stalls_raise_the_pressure() -> None:
    def stalled(ts: float, some_s: float, full_s: float) -> Snapshot:
        return _healthy_node(
            ts,
            [
                *_allocator("a", 0.3, 0, 0),
                Reading(STALL, some_s, {"kind": "some"}, Kind.COUNTER),
                Reading(STALL, full_s, {"kind": "full"}, Kind.COUNTER),
            ],
        )

    # some task stalled 1.8 s of the 2 s window (full: 1.5 s, not counted twice)
    assert _pressure(stalled(12.0, 5.0, 4.0), stalled(10.0, 3.2, 2.5)) == {
        "reported": pytest.approx(0.9)
    }
    # no stall: host memory 25% used, the allocator's 30% is the higher
    assert _pressure(stalled(12.0, 3.2, 2.5), stalled(10.0, 3.2, 2.5)) == {
        "reported": pytest.approx(0.3)
    }


@pytest.mark.parametrize(
    ("model", "q"),
    [
        ("Tesla V100S-PCIE-32GB", 0.6),
        ("NVIDIA A100-SXM4-80GB", 1.0),
        ("NVIDIA H100 PCIe", 2.42),
        ("NVIDIA H100 80GB HBM3", 3.17),
        ("Tesla T4", 0.21),
        ("Quadro RTX 6000", None),
    ],
)
def test_quantum_coefficient_longest_match(model: str, q: float | None) -> None:
    assert quantum_coefficient(model, TABLE) == q


def _snapshot(ts: float, comm: float, compute: float, energy: float, samples: float) -> Snapshot:
    readings = []
    for gpu, (util, used) in enumerate([(0.5, 16e9), (1.0, 30e9)]):
        labels = {"gpu": str(gpu), "uuid": f"GPU-{gpu}"}
        readings += [
            Reading(
                "hyperagent_gpu_info", 1, {**labels, "model": "Tesla V100S-PCIE-32GB"}, Kind.INFO
            ),
            Reading("hyperagent_gpu_utilization_ratio", util, labels),
            Reading("hyperagent_gpu_memory_used_bytes", used, labels),
            Reading("hyperagent_gpu_memory_total_bytes", 32e9, labels),
            Reading("hyperagent_gpu_energy_joules_total", energy / 2, labels, Kind.COUNTER),
        ]
    job = {"job_id": "j"}
    readings += [
        Reading("hyperagent_host_memory_available_bytes", 12e9),
        Reading("hyperagent_host_memory_total_bytes", 16e9),
        Reading("hyperagent_job_communication_seconds_total", comm, job, Kind.COUNTER),
        Reading("hyperagent_job_compute_seconds_total", compute, job, Kind.COUNTER),
        Reading("hyperagent_job_samples_total", samples, job, Kind.COUNTER),
    ]
    return Snapshot(ts, "n", tuple(readings))


def test_derive_from_snapshots() -> None:
    before = _snapshot(10.0, comm=1.0, compute=4.0, energy=100.0, samples=0)
    after = _snapshot(11.0, comm=2.0, compute=8.0, energy=300.0, samples=400)
    out = {(r.name, tuple(sorted(r.labels.items()))): r.value for r in derive(after, before, TABLE)}
    # V100 q = 0.6 on both: (0.6*0.5 + 0.6*1.0) / 1.2
    assert out[("hyperagent_qu_ratio", ())] == pytest.approx(0.75)
    assert out[("hyperagent_memory_pressure_ratio", (("method", "estimated"),))] == (
        pytest.approx(30 / 32)
    )
    assert out[("hyperagent_ccr_ratio", (("method", "reported"),))] == pytest.approx(0.25)
    assert out[("hyperagent_energy_per_sample_joules", ())] == pytest.approx(0.5)
    coefficient = (
        "hyperagent_gpu_quantum_coefficient",
        (("gpu", "0"), ("known", "true"), ("model", "Tesla V100S-PCIE-32GB"), ("uuid", "GPU-0")),
    )
    assert out[coefficient] == 0.6
    first = {r.name for r in derive(before, None, TABLE)}
    assert (
        "hyperagent_ccr_ratio" not in first and "hyperagent_energy_per_sample_joules" not in first
    )
    assert "hyperagent_qu_ratio" in first


def _rdma_snapshot(
    ts: float, sent: dict[str, float], utilisation: list[float], rate: float = 25e9
) -> Snapshot:
    """GPUs at ``utilisation`` and mlx5 ports that have sent ``sent`` bytes so far, each
    with a ``rate`` bytes/s link; no job reports."""
    readings = []
    for gpu, util in enumerate(utilisation):
        labels = {"gpu": str(gpu), "uuid": f"GPU-{gpu}"}
        readings += [
            Reading("hyperagent_gpu_info", 1, {**labels, "model": "NVIDIA H100 80GB HBM3"}),
            Reading("hyperagent_gpu_utilization_ratio", util, labels),
        ]
    for device, total in sent.items():
        labels = {"device": device, "port": "1"}
        readings += [
            Reading("hyperagent_rdma_port_rate_bytes_per_second", rate, labels),
            Reading(
                "hyperagent_rdma_port_data_transmitted_bytes_total", total, labels, Kind.COUNTER
            ),
        ]
    return Snapshot(ts, "n", tuple(readings))


def _estimated(after: Snapshot, before: Snapshot) -> float | None:
    return Snapshot(0.0, "n", tuple(derive(after, before, TABLE))).value(
        "hyperagent_ccr_ratio", method="estimated"
    )


def test_derive_estimates_ccr_per_gpu_and_per_active_port() -> None:
    idle_ports = {f"mlx5_{i}": 1e12 for i in range(1, 8)}
    before = _rdma_snapshot(100.0, {"mlx5_0": 0.0, **idle_ports}, [1.0] * 8)
    # 10 s window: mlx5_0 sent 125 GB at 25 GB/s = 5 s of link time, half the window; the
    # other seven ports sent nothing. Eight GPUs fully busy: 10 s each. CCR = 5 / 10.
    after = _rdma_snapshot(110.0, {"mlx5_0": 125e9, **idle_ports}, [1.0] * 8)
    assert _estimated(after, before) == pytest.approx(0.5)
    # Two ports at 25 GB/s busy 2 s and 6 s (mean 4 s); GPUs at 100%, 50%, 50%, 0%: mean 5 s.
    before = _rdma_snapshot(0.0, {"a": 1e9, "b": 2e9, "c": 3e9}, [1.0, 0.5, 0.5, 0.0])
    after = _rdma_snapshot(10.0, {"a": 51e9, "b": 152e9, "c": 3e9}, [1.0, 0.5, 0.5, 0.0])
    assert _estimated(after, before) == pytest.approx(4.0 / 5.0)
    # a counter that went backwards (a reset) leaves its port out of the window
    reset = _rdma_snapshot(10.0, {"a": 51e9, "b": 1e9, "c": 3e9}, [1.0, 0.5, 0.5, 0.0])
    assert _estimated(reset, before) == pytest.approx(2.0 / 5.0)
    # no traffic: CCR 0; idle GPUs or no ports: no estimate
    quiet = _rdma_snapshot(10.0, {"a": 1e9, "b": 2e9, "c": 3e9}, [1.0, 0.5, 0.5, 0.0])
    assert _estimated(quiet, before) == 0.0
    idle = _rdma_snapshot(10.0, {"a": 51e9}, [0.0, 0.0])
    assert _estimated(idle, _rdma_snapshot(0.0, {"a": 1e9}, [0.0, 0.0])) is None
    portless = _rdma_snapshot(10.0, {}, [1.0])
    assert _estimated(portless, _rdma_snapshot(0.0, {}, [1.0])) is None


def test_an_extended_snapshot_answers_like_one_built_whole() -> None:
    base = [Reading("a", 1.0, {"gpu": "0"}), Reading("b", 2.0), Reading("a", 3.0, {"gpu": "1"})]
    extra = [Reading("a", 5.0, {"gpu": "2"}), Reading("c", 7.0), Reading("c", 8.0)]
    whole = Snapshot(1.0, "n", (*base, *extra))
    for indexed_first in (False, True):
        snapshot = Snapshot(1.0, "n", tuple(base))
        if indexed_first:
            assert snapshot.total("a") == 4.0  # builds the index that extended carries over
        grown = snapshot.extended(extra)
        assert grown.readings == whole.readings
        for name in ("a", "b", "c", "d"):
            assert list(grown.named(name)) == list(whole.named(name))
            assert grown.total(name) == whole.total(name)
        assert snapshot.total("a") == 4.0 and snapshot.named("c") == ()  # the original is intact


def test_an_unknown_gpu_model_is_said_once_and_labelled(caplog: pytest.LogCaptureFixture) -> None:
    """A K80 (2014) is not in the table: it weighs 1 in QU, a warning names it once, and its
    coefficient carries known="false" so a dashboard or alert can show it."""
    labels = {"gpu": "0", "uuid": "GPU-p100"}
    snapshot = Snapshot(
        1.0,
        "n",
        (
            Reading("hyperagent_gpu_info", 1, {**labels, "model": "Tesla K80"}, Kind.INFO),
            Reading("hyperagent_gpu_utilization_ratio", 0.5, labels),
        ),
    )
    _warn_unknown_model.cache_clear()  # the warning is once per process
    with caplog.at_level(logging.WARNING, logger="hyperagent.indicators"):
        first = derive(snapshot, None, TABLE)
        derive(snapshot, snapshot, TABLE)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "Tesla K80" in warnings[0]
    coefficient = next(r for r in first if r.name == "hyperagent_gpu_quantum_coefficient")
    assert coefficient.value == 1.0
    assert coefficient.labels == {**labels, "model": "Tesla K80", "known": "false"}
    assert next(r.value for r in first if r.name == "hyperagent_qu_ratio") == 0.5


STEP_S = 4.0
"""Each rank's step: 3 s of compute and 1 s of exposed communication (CCR 1/3)."""
NODE_W = 600.0
"""The node's GPUs draw this the whole time ..."""
NODE_SAMPLES = 100
"""... and process this many samples per step of all ranks: 24 J per sample."""


class SteppingNode:
    """What a node's sources read at time ``t`` while its ranks take 4 s steps, rank r
    completing its steps ``offsets[r]`` seconds into each 4 s (ranks of one node finish a
    synchronised step at slightly different times), with RDMA traffic for the estimate.
    As a source, each read is one second later than the last (a 1 s collection interval)."""

    name = "stepping"
    target = "node"

    def __init__(self, offsets: list[float], pause: tuple[float, float] | None = None) -> None:
        self.offsets = offsets
        self.pause = pause
        """(from, to): no rank steps in between; the GPUs keep drawing power."""
        self.t = 0.0

    def readings(self, t: float) -> list[Reading]:
        ranks = len(self.offsets)
        stepping = t
        if self.pause is not None and t >= self.pause[0]:
            stepping = self.pause[0] + max(0.0, t - self.pause[1])
        done = [max(0, math.floor((stepping - o) / STEP_S)) for o in self.offsets]
        steps = sum(done)
        job = {"job_id": "llm"}
        readings = [
            Reading(STEPS_TOTAL, steps, job, Kind.COUNTER),
            Reading(
                "hyperagent_job_samples_total", steps * NODE_SAMPLES / ranks, job, Kind.COUNTER
            ),
            Reading("hyperagent_job_compute_seconds_total", steps * 3.0, job, Kind.COUNTER),
            Reading("hyperagent_job_communication_seconds_total", steps * 1.0, job, Kind.COUNTER),
            Reading("hyperagent_job_reporting_ranks", ranks, job),
        ]
        for gpu in range(2):
            labels = {"gpu": str(gpu), "uuid": f"GPU-{gpu}"}
            readings += [
                Reading("hyperagent_gpu_info", 1, {**labels, "model": "NVIDIA H100 80GB HBM3"}),
                Reading("hyperagent_gpu_utilization_ratio", 1.0, labels),
                Reading("hyperagent_gpu_energy_joules_total", t * NODE_W / 2, labels, Kind.COUNTER),
            ]
        port = {"device": "mlx5_0", "port": "1"}
        readings += [
            Reading("hyperagent_rdma_port_rate_bytes_per_second", 25e9, port),
            Reading(
                "hyperagent_rdma_port_data_transmitted_bytes_total", t * 5e9, port, Kind.COUNTER
            ),
        ]
        return readings

    async def start(self) -> None:
        """Nothing to open: the readings are computed."""

    async def read(self) -> list[Reading]:
        self.t += 1.0
        return self.readings(self.t)

    async def close(self) -> None:
        """Nothing to close."""


STEPS_TOTAL = "hyperagent_job_steps_total"

RANK_LAYOUTS = [
    pytest.param([0.5], id="one rank"),
    pytest.param([0.5, 0.5, 1.5, 1.5], id="four ranks finishing in two cycles"),
]


@pytest.mark.parametrize("offsets", RANK_LAYOUTS)
async def test_energy_per_sample_and_ccr_are_over_whole_steps_in_every_cycle(
    offsets: list[float], tmp_path: Path
) -> None:
    """4 s steps, a 1 s interval: once the first whole step was seen, every cycle says
    24 J per sample and a reported CCR of 1/3; not 6 J one cycle in four, and not a CCR
    whose method flips to the RDMA estimate in the cycles where no step completed."""
    config = build_config(
        {
            "mqtt": {"enabled": False},
            "agent": {"metrics_address": "", "state_dir": str(tmp_path)},
        }
    )
    node = SteppingNode(offsets)
    agent = Agent(config, Hardware(nvml=None), sources=[node])
    cycles = [await agent.collect_once() for _ in range(32)]
    for cycle, snapshot in enumerate(cycles[11:], start=12):  # node.t of the snapshot
        per_sample = snapshot.value("hyperagent_energy_per_sample_joules")
        assert per_sample == pytest.approx(24.0), f"at {cycle} s: {per_sample}"
        methods = {r.labels["method"]: r.value for r in snapshot.named("hyperagent_ccr_ratio")}
        assert methods == {"reported": pytest.approx(1 / 3)}, f"at {cycle} s: {methods}"
    await agent.runner.close()


def test_windowed_indicators_are_held_until_the_job_goes_silent() -> None:
    """A job that stops stepping keeps its last values for four of its windows (16 s here),
    then CCR falls back to the traffic estimate; when it steps again its next window starts at
    its first new step, so the pause is not averaged into a sample."""
    node = SteppingNode([0.5], pause=(39.0, 60.0))
    windows = JobWindows()
    previous = None
    seen: dict[int, dict[str, float]] = {}
    for t in range(1, 90):
        snapshot = Snapshot(float(t), "n", tuple(node.readings(float(t))))
        out = derive(snapshot, previous, TABLE, windows)
        seen[t] = {
            r.labels.get("method", r.name): r.value
            for r in out
            if r.name in ("hyperagent_ccr_ratio", "hyperagent_energy_per_sample_joules")
        }
        previous = snapshot
    joules = "hyperagent_energy_per_sample_joules"
    whole_steps = {"reported": pytest.approx(1 / 3), joules: pytest.approx(24.0)}
    # steps end at 4.5, 8.5, ... 36.5 s (seen a cycle later); held until 37 + 16 s
    for t in range(9, 54):
        assert seen[t] == whole_steps, (t, seen[t])
    # silent: the estimate (5 GB/s of a 25 GB/s link, GPUs busy: 0.2) until a whole window
    # of the resumed steps (they end at 61.5 s, the window start, and 65.5 s)
    for t in range(54, 66):
        assert seen[t] == {"estimated": pytest.approx(0.2)}, (t, seen[t])
    for t in range(66, 90):
        assert seen[t] == whole_steps, (t, seen[t])


def test_counters_that_go_back_start_the_windows_over() -> None:
    """A job forgotten and reported again from 0 (or an agent's counters restarting) gives no
    negative or mixed window: nothing until a whole window of the new counters."""
    windows = JobWindows()
    node = SteppingNode([0.5])
    for t in range(1, 20):
        windows.update(Snapshot(float(t), "n", tuple(node.readings(float(t)))))
    restarted = SteppingNode([20.5])
    got = []
    for t in range(20, 40):
        readings = tuple(r for r in restarted.readings(float(t)))
        got.append(windows.update(Snapshot(float(t), "n", readings)))
    assert not got[0]
    values = [{r.name: r.value for r in out} for out in got if out]
    assert values and all(
        v["hyperagent_energy_per_sample_joules"] == pytest.approx(24.0) for v in values
    )


@pytest.mark.parametrize(
    ("model", "q"),
    [
        ("Tesla P100-PCIE-16GB", 0.07),
        ("NVIDIA A10G", 0.40),
        ("NVIDIA H100 PCIe", 2.42),
        ("NVIDIA H200", 3.17),
        ("NVIDIA H20", 0.47),
        ("NVIDIA GB200", 8.01),
        ("NVIDIA B200", 7.21),
        ("NVIDIA L4", 0.39),
        ("AMD Instinct MI300X", 4.19),
        ("AMD Instinct MI355X", 8.06),
        ("HL-225", 1.38),
        ("HL-325L", 5.88),
        ("Ascend 910B2C", 1.0),
    ],
)
def test_shipped_coefficients_name_each_part_by_its_longest_key(model: str, q: float) -> None:
    assert quantum_coefficient(model, TABLE) == q


def test_each_shipped_coefficient_is_its_stated_throughput_over_a100s() -> None:
    """The basis in hyperagent/data/quantum_coefficients.toml: dense BF16/FP16 TFLOPS / 312,
    except the three BACKGROUND.md figures kept as they are."""
    import tomllib
    from importlib import resources

    text = resources.files("hyperagent").joinpath("data", "quantum_coefficients.toml").read_text()
    models = tomllib.loads(text)["models"]
    for key, entry in models.items():
        assert entry["source"], key
        if entry["basis"] != "background":
            assert entry["q"] == pytest.approx(entry["tflops"] / 312, abs=0.006), key
    assert {k for k, e in models.items() if e["basis"] == "background"} == {
        "A100",
        "V100",
        "TPU v4",
    }

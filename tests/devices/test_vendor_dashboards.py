"""The node dashboard over a real Prometheus (shipped config and rules) scraping agents on AMD
MI300X, Intel Gaudi HL-205 or Intel Data Center GPU Max 1550 (xpu-smi, telemetry only)
replays, tuned by the demo's coordinator: every GPU and indicator panel NVIDIA's replays fill
is filled, with the same queries, and the recording rules over GPU power, energy and quantum
coefficients evaluate; what stays empty is what the vendor does not give (clock-event
reasons, XID events, retired pages, remapped rows, PCIe throughput; on the Gaudi capture,
which holds none, ECC counts, clocks and HBM temperature; xpu-smi's dump: ECC counts and the
power limit) and the sources these simulated nodes do not have (RDMA, BMC, PDU)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import pytest
from test_prometheus_e2e import CLUSTER, Prometheus, panel_queries, serving, wait_until_data

from hyperagent.demo import simulated_cluster

from conftest import FIXTURES, REPO, Mosquitto

MI300X = FIXTURES / "replay" / "amd-mi300x-8gpu"
GAUDI = FIXTURES / "replay" / "gaudi-hl205-8card"
INTEL_MAX = FIXTURES / "replay" / "intel-max1550-documented"
NODE_DASHBOARD = json.loads((REPO / "grafana" / "dashboards" / "hyperagent-node.json").read_text())
FILLED = (
    "Quantum utilisation and compute entropy",
    "Quantum dispersion",
    "Communication/compute ratio",
    "Memory pressure",
    "Training throughput",
    "Energy per sample",
    "GPU utilisation",
    "GPU memory used",
    "GPU power and limit",
    "GPU temperature",
    "SM clock",
    "ECC errors",
)
RECORDED = (
    "node:hyperagent_gpu_power_watts:sum",
    "node:hyperagent_gpu_energy_joules:rate5m",
    "node:hyperagent_gpu_quantum_coefficient:sum",
    "job_id:hyperagent_qu_ratio:avg",
    "cluster:hyperagent_gpu_power_watts:sum",
    "cluster:hyperagent_qu_ratio:avg",
)
"""Recording rules over hyperagent_gpu_* that hold for every vendor."""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("capture", "filled", "absent"),
    [
        (MI300X, FILLED, ()),
        (
            GAUDI,
            tuple(t for t in FILLED if t not in ("ECC errors", "SM clock")),
            ("hyperagent_gpu_memory_temperature_celsius",),
        ),
        (
            INTEL_MAX,
            tuple(t for t in FILLED if t != "ECC errors"),
            ("hyperagent_gpu_power_limit_watts",),
        ),
    ],
    ids=["amd-mi300x", "gaudi-hl205", "intel-max1550"],
)
async def test_the_node_dashboard_fills_on_vendor_replays(
    mosquitto: Mosquitto,
    tmp_path: Path,
    capture: Path,
    filled: tuple[str, ...],
    absent: tuple[str, ...],
) -> None:
    deadline = time.monotonic() + 90
    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=100,
        seed=0,
        speedup=100,
        objective="energy",
        capture_dir=capture,
        job_overrides={"search_power_cap": capture != INTEL_MAX},  # xpu-smi sets no cap
    ) as (coordinator, sim_nodes, _):
        tuning = asyncio.create_task(coordinator.run(), name="coordinator")
        with (
            serving([n.agent.collector for n in sim_nodes]) as nodes,
            serving([coordinator.collector]) as coordinators,
        ):
            prometheus = Prometheus(tmp_path, nodes, coordinators)
            prometheus.start()
            try:
                uid = NODE_DASHBOARD["uid"]
                queries = [
                    (where, expr)
                    for where, expr in panel_queries(nodes)
                    if where.startswith(f"{uid}: ")
                    and where.removeprefix(f"{uid}: ") in filled
                    and not expr.startswith(absent)
                ]
                assert {w.removeprefix(f"{uid}: ") for w, _ in queries} == set(filled)
                queries += [
                    ("recording rule", f'{name}{{cluster="{CLUSTER}"}}') for name in RECORDED
                ]
                empty = await wait_until_data(prometheus, queries, deadline)
            finally:
                prometheus.stop()
                tuning.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tuning
    assert not empty, empty

"""The cluster indicators of DESIGN.md as pure functions, and their derivation from snapshots.

Device i has effective utilisation u_i in [0, 1] and quantum coefficient q_i.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from hyperagent.readings import Reading, Snapshot

Unit = tuple[float, float]
"""(q_i, u_i): a device's quantum coefficient and effective utilisation."""


def quantum_utilization(units: Sequence[Unit]) -> float | None:
    """QU = sum(q_i u_i) / sum(q_i); None without devices."""
    total_q = sum(q for q, _ in units)
    if total_q <= 0:
        return None
    return sum(q * u for q, u in units) / total_q


def compute_entropy(units: Sequence[Unit]) -> float | None:
    """Normalised compute entropy H / ln N, p_i = q_i u_i / sum_j q_j u_j, in [0, 1].

    1 means the quantum-weighted load is perfectly even. None when nothing is busy; a single
    device is trivially even (1.0).
    """
    loads = [q * u for q, u in units]
    total = sum(loads)
    if not loads or total <= 0:
        return None
    if len(loads) == 1:
        return 1.0
    entropy = -sum(p * math.log(p) for p in (load / total for load in loads) if p > 0)
    return entropy / math.log(len(loads))


def quantum_dispersion(units: Sequence[Unit]) -> float | None:
    """Coefficient of variation (population) of q_i u_i; None when the mean load is 0."""
    loads = [q * u for q, u in units]
    if not loads:
        return None
    mean = sum(loads) / len(loads)
    if mean <= 0:
        return None
    variance = sum((x - mean) ** 2 for x in loads) / len(loads)
    return math.sqrt(variance) / mean


def communication_compute_ratio(comm_s: float, compute_s: float) -> float | None:
    """CCR = communication time / computation time over a window; None without compute."""
    if compute_s <= 0:
        return None
    return comm_s / compute_s


def estimated_ccr(
    port_traffic: Sequence[tuple[float, float]], gpu_busy_s: Sequence[float]
) -> float | None:
    """CCR estimated from traffic, per GPU and per active port: the mean over the ports that
    carried traffic of the seconds their bytes need at link rate, over the mean GPU busy time.

    ``port_traffic`` holds each port's (bytes sent in the window, link rate in bytes/s);
    ``gpu_busy_s`` each GPU's busy seconds (utilisation times the window). No active port is
    a CCR of 0; None without ports with a known rate, or without busy GPUs.
    """
    rated = [(sent, rate) for sent, rate in port_traffic if rate > 0]
    if not rated or not gpu_busy_s:
        return None
    compute_s = sum(gpu_busy_s) / len(gpu_busy_s)
    if compute_s <= 0:
        return None
    link_s = [sent / rate for sent, rate in rated if sent > 0]
    return (sum(link_s) / len(link_s)) / compute_s if link_s else 0.0


def memory_pressure(
    gpu_memory: Sequence[tuple[float, float]],
    host_available: float | None,
    host_total: float | None,
) -> float | None:
    """MPI = max(max_i used_i / total_i, 1 - host available / total); None without data."""
    fractions = [used / total for used, total in gpu_memory if total > 0]
    if host_available is not None and host_total:
        fractions.append(1 - host_available / host_total)
    return max(fractions) if fractions else None


def energy_per_sample(energy_j: float, samples: float) -> float | None:
    """Joules per training sample over a window; None when no sample was processed."""
    if samples <= 0 or energy_j < 0:
        return None
    return energy_j / samples


def quantum_coefficient(model: str, table: Mapping[str, float]) -> float | None:
    """q of a GPU model: the longest table key found in the model name (case-insensitive)."""
    name = model.upper()
    matches = [key for key in table if key.upper() in name]
    if not matches:
        return None
    return table[max(matches, key=len)]


def _per_gpu(snapshot: Snapshot, name: str) -> dict[str | None, Reading]:
    return {r.labels.get("uuid"): r for r in snapshot.named(name)}


def _units(snapshot: Snapshot, table: Mapping[str, float]) -> list[tuple[Reading, Unit]]:
    """(utilisation reading, (q, u)) per GPU; unknown models count as q = 1."""
    info = _per_gpu(snapshot, "hyperagent_gpu_info")
    active = _per_gpu(snapshot, "hyperagent_gpu_sm_active_ratio")
    units = []
    for uuid, util in _per_gpu(snapshot, "hyperagent_gpu_utilization_ratio").items():
        model = info[uuid].labels.get("model", "") if uuid in info else ""
        q = quantum_coefficient(model, table)
        u = active[uuid].value if uuid in active else util.value
        units.append((util, (1.0 if q is None else q, u)))
    return units


def _delta(current: Snapshot, previous: Snapshot | None, name: str) -> float | None:
    now = current.total(name)
    if previous is None or now is None:
        return None
    before = previous.total(name)
    if before is None or now < before:
        return None
    return now - before


def _port_traffic(current: Snapshot, previous: Snapshot) -> list[tuple[float, float]]:
    """(bytes sent since ``previous``, link rate) of each RDMA port with both readings; a port
    whose counter went backwards (a reset) is left out."""
    rates = {
        _port_key(r): r.value for r in current.named("hyperagent_rdma_port_rate_bytes_per_second")
    }
    before = {
        _port_key(r): r.value
        for r in previous.named("hyperagent_rdma_port_data_transmitted_bytes_total")
    }
    traffic = []
    for reading in current.named("hyperagent_rdma_port_data_transmitted_bytes_total"):
        key = _port_key(reading)
        if key in rates and key in before and reading.value >= before[key]:
            traffic.append((reading.value - before[key], rates[key]))
    return traffic


def _port_key(reading: Reading) -> tuple[str | None, str | None]:
    return reading.labels.get("device"), reading.labels.get("port")


def derive(
    current: Snapshot, previous: Snapshot | None, coefficients: Mapping[str, float]
) -> list[Reading]:
    """The indicator readings for ``current``; windowed ones use the change since ``previous``."""
    out: list[Reading] = []

    def put(name: str, value: float | None, **labels: str) -> None:
        if value is not None and math.isfinite(value):
            out.append(Reading(name, value, labels))

    per_gpu = _units(current, coefficients)
    for util, (q, _) in per_gpu:
        out.append(Reading("hyperagent_gpu_quantum_coefficient", q, util.labels))
    units = [unit for _, unit in per_gpu]
    put("hyperagent_qu_ratio", quantum_utilization(units))
    put("hyperagent_compute_entropy_ratio", compute_entropy(units))
    put("hyperagent_quantum_dispersion_ratio", quantum_dispersion(units))
    totals = _per_gpu(current, "hyperagent_gpu_memory_total_bytes")
    gpu_memory = [
        (used.value, totals[uuid].value)
        for uuid, used in _per_gpu(current, "hyperagent_gpu_memory_used_bytes").items()
        if uuid in totals
    ]
    put(
        "hyperagent_memory_pressure_ratio",
        memory_pressure(
            gpu_memory,
            current.value("hyperagent_host_memory_available_bytes"),
            current.value("hyperagent_host_memory_total_bytes"),
        ),
    )
    comm = _delta(current, previous, "hyperagent_job_communication_seconds_total")
    compute = _delta(current, previous, "hyperagent_job_compute_seconds_total")
    if comm is not None and compute:
        put("hyperagent_ccr_ratio", communication_compute_ratio(comm, compute), method="reported")
    elif previous is not None:
        window_s = current.ts - previous.ts
        busy = [u * window_s for _, u in units]
        put(
            "hyperagent_ccr_ratio",
            estimated_ccr(_port_traffic(current, previous), busy),
            method="estimated",
        )
    energy = _delta(current, previous, "hyperagent_gpu_energy_joules_total")
    samples = _delta(current, previous, "hyperagent_job_samples_total")
    if energy is not None and samples:
        put("hyperagent_energy_per_sample_joules", energy_per_sample(energy, samples))
    return out

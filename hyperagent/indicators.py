"""The cluster indicators of DESIGN.md as pure functions, and their derivation from snapshots.

Device i has effective utilisation u_i in [0, 1] and quantum coefficient q_i. Indicators that
divide two quantities of the training job (energy per sample, the reported CCR) use the job's
own windows, whole steps, which ``JobWindows`` follows cycle after cycle; the others use one
collection cycle.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence

from hyperagent.readings import Reading, Snapshot

log = logging.getLogger(__name__)

UNKNOWN_MODEL_COEFFICIENT = 1.0
"""q of a GPU model the coefficient table does not name (as if it were an A100)."""

STALL_SECONDS = "hyperagent_host_memory_pressure_stall_seconds_total"
"""PSI: seconds some task (``kind="some"``) stalled waiting for memory."""

STEPS = "hyperagent_job_steps_total"
REPORTING_RANKS = "hyperagent_job_reporting_ranks"
CCR = "hyperagent_ccr_ratio"

SILENT_WINDOWS = 4.0
"""A job that completed no window for this many times its last window's length has gone
silent: its windowed indicators are no longer held (CCR falls back to the estimate) ..."""

SILENT_MIN_S = 10.0
"""... and for at least this long."""

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


def memory_pressure(gpu: float | None, host: float | None) -> float | None:
    """MPI = max(GPU memory pressure, host memory pressure); None without either."""
    known = [value for value in (gpu, host) if value is not None]
    return max(known) if known else None


def reported_gpu_memory_pressure(allocated: Sequence[float], failures: float) -> float | None:
    """GPU memory pressure from the job's allocator: the highest fraction of a GPU's memory
    its tensors hold, or 1 when an allocation had to be retried or failed (OOM) in the window
    (the allocator reached the device's limit). None when no job reports its allocator."""
    if not allocated:
        return None
    return 1.0 if failures > 0 else max(allocated)


def estimated_gpu_memory_pressure(gpu_memory: Sequence[tuple[float, float]]) -> float | None:
    """The fullest GPU's used / total memory as NVML reports it: an upper bound only, since a
    caching allocator (PyTorch's) keeps what it took on a healthy node."""
    fractions = [used / total for used, total in gpu_memory if total > 0]
    return max(fractions) if fractions else None


def host_memory_pressure(
    available: float | None, total: float | None, stall_share: float | None = None
) -> float | None:
    """1 - available / total, or the share of the window some task stalled waiting for memory
    (PSI) when that is higher; None without the memory figures."""
    if available is None or not total:
        return None
    used = 1 - available / total
    return used if stall_share is None else max(used, min(max(stall_share, 0.0), 1.0))


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


@functools.cache
def _warn_unknown_model(model: str) -> None:
    """Say once per process that a GPU model weighs the default in QU."""
    log.warning(
        "GPU model %r is not in indicators.quantum_coefficients: it counts as q = %g in QU"
        ' (hyperagent_gpu_quantum_coefficient{known="false"}); add its coefficient to the'
        " config",
        model,
        UNKNOWN_MODEL_COEFFICIENT,
    )


def _units(snapshot: Snapshot, table: Mapping[str, float]) -> list[tuple[Unit, dict[str, str]]]:
    """((q, u), coefficient labels) per GPU; a model the table does not
    name counts as :data:`UNKNOWN_MODEL_COEFFICIENT`, is warned about once and is labelled
    ``known="false"``."""
    info = _per_gpu(snapshot, "hyperagent_gpu_info")
    active = _per_gpu(snapshot, "hyperagent_gpu_sm_active_ratio")
    units = []
    for uuid, util in _per_gpu(snapshot, "hyperagent_gpu_utilization_ratio").items():
        model = info[uuid].labels.get("model", "") if uuid in info else ""
        q = quantum_coefficient(model, table)
        if q is None:
            _warn_unknown_model(model)
        u = active[uuid].value if uuid in active else util.value
        labels = {**util.labels, "model": model, "known": "false" if q is None else "true"}
        units.append(((UNKNOWN_MODEL_COEFFICIENT if q is None else q, u), labels))
    return units


def _delta(current: Snapshot, previous: Snapshot | None, name: str) -> float | None:
    now = current.total(name)
    if previous is None or now is None:
        return None
    before = previous.total(name)
    if before is None or now < before:
        return None
    return now - before


def _increase(current: Snapshot, previous: Snapshot | None, name: str, **labels: str) -> float:
    """How much the counter ``name`` (its series with ``labels``) grew since ``previous``,
    over the series both snapshots hold."""
    if previous is None:
        return 0.0
    before = {tuple(sorted(r.labels.items())): r.value for r in previous.named(name)}
    grown = 0.0
    for r in current.named(name):
        if any(r.labels.get(k) != v for k, v in labels.items()):
            continue
        then = before.get(tuple(sorted(r.labels.items())))
        if then is not None and r.value > then:
            grown += r.value - then
    return grown


def _memory_pressure(current: Snapshot, previous: Snapshot | None) -> tuple[float | None, str]:
    """MPI and its method: ``reported`` when a job reports its allocator, else ``estimated``
    from NVML's used memory. The host part includes PSI's memory stall share where known."""
    stall_share = None
    if previous is not None and current.ts > previous.ts:
        stalled = _increase(current, previous, STALL_SECONDS, kind="some")
        if current.value(STALL_SECONDS, kind="some") is not None:
            stall_share = stalled / (current.ts - previous.ts)
    host = host_memory_pressure(
        current.value("hyperagent_host_memory_available_bytes"),
        current.value("hyperagent_host_memory_total_bytes"),
        stall_share,
    )
    allocated = [r.value for r in current.named("hyperagent_job_gpu_memory_allocated_ratio")]
    if allocated:
        failures = _increase(current, previous, "hyperagent_job_alloc_retries_total")
        failures += _increase(current, previous, "hyperagent_job_oom_total")
        return memory_pressure(reported_gpu_memory_pressure(allocated, failures), host), "reported"
    totals = _per_gpu(current, "hyperagent_gpu_memory_total_bytes")
    gpu_memory = [
        (used.value, totals[uuid].value)
        for uuid, used in _per_gpu(current, "hyperagent_gpu_memory_used_bytes").items()
        if uuid in totals
    ]
    return memory_pressure(estimated_gpu_memory_pressure(gpu_memory), host), "estimated"


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


def _window_readings(start: Snapshot | None, end: Snapshot) -> list[Reading]:
    """The reported CCR and the energy per sample from ``start`` to ``end`` (none without a
    start, without the job's compute time or samples in between)."""
    out = []
    comm = _delta(end, start, "hyperagent_job_communication_seconds_total")
    compute = _delta(end, start, "hyperagent_job_compute_seconds_total")
    if comm is not None and compute:
        ccr = communication_compute_ratio(comm, compute)
        if ccr is not None and math.isfinite(ccr):
            out.append(Reading(CCR, ccr, {"method": "reported"}))
    energy = _delta(end, start, "hyperagent_gpu_energy_joules_total")
    samples = _delta(end, start, "hyperagent_job_samples_total")
    if energy is not None and samples:
        joules = energy_per_sample(energy, samples)
        if joules is not None and math.isfinite(joules):
            out.append(Reading("hyperagent_energy_per_sample_joules", joules))
    return out


class JobWindows:
    """Energy per sample and the reported CCR over the jobs' own windows, fed one snapshot
    per collection cycle.

    A window runs from a cycle in which steps completed to the next cycle by which every rank
    that reports on this node completed at least one more (the node's step counter grew by
    ``hyperagent_job_reporting_ranks``): its energy, samples, communication and compute are
    those of whole steps, not of one cycle cut through a step longer than the interval. The
    first window starts at the first cycle in which steps completed. The last window's values
    are held (exported again) in the cycles between, so the series are continuous and the CCR's
    ``method`` stays put, until the jobs go silent: no window for ``SILENT_WINDOWS`` times the
    last one's length (at least ``SILENT_MIN_S``). Counters that go back (a job forgotten)
    start over. The node's jobs are summed: windows are a job's own on a node that runs one.
    """

    def __init__(self) -> None:
        self._start: Snapshot | None = None
        """Where the current window began."""
        self._anchored = False
        """Whether it began in a cycle where steps completed (else it is not a whole window)."""
        self._held: list[Reading] = []
        self._ended = -math.inf
        self._length = 0.0

    def update(self, current: Snapshot) -> list[Reading]:
        """The windowed readings as of ``current``: those of the window ending here, or the
        last window's while it is not over."""
        steps = current.total(STEPS)
        start = self._start
        before = None if start is None else start.total(STEPS)
        if start is None or steps is None or before is None or _went_back(start, current):
            self._start, self._anchored, self._held = current, False, []
            return []
        ranks = max(current.total(REPORTING_RANKS) or 1.0, 1.0)
        if steps - before >= ranks:
            if self._anchored:
                self._held = _window_readings(start, current)
                self._length = current.ts - start.ts
            self._start, self._anchored, self._ended = current, True, current.ts
        if current.ts - self._ended > max(SILENT_WINDOWS * self._length, SILENT_MIN_S):
            self._anchored, self._held = False, []  # the next window starts when steps do
        return list(self._held)


_WINDOW_COUNTERS = (
    STEPS,
    "hyperagent_job_samples_total",
    "hyperagent_job_communication_seconds_total",
    "hyperagent_job_compute_seconds_total",
    "hyperagent_gpu_energy_joules_total",
)


def _went_back(start: Snapshot, current: Snapshot) -> bool:
    """Whether a counter a window divides is lower now than at the window's start."""
    for name in _WINDOW_COUNTERS:
        now, then = current.total(name), start.total(name)
        if now is not None and then is not None and now < then:
            return True
    return False


def derive(
    current: Snapshot,
    previous: Snapshot | None,
    coefficients: Mapping[str, float],
    windows: JobWindows | None = None,
) -> list[Reading]:
    """The indicator readings for ``current``; those of one cycle use the change since
    ``previous``. Energy per sample and the reported CCR come from ``windows`` when given (the
    agent's, fed every cycle), else from the change since ``previous``; without a reported CCR
    it is estimated from the cycle's RDMA traffic."""
    out: list[Reading] = []

    def put(name: str, value: float | None, **labels: str) -> None:
        if value is not None and math.isfinite(value):
            out.append(Reading(name, value, labels))

    per_gpu = _units(current, coefficients)
    for (q, _), labels in per_gpu:
        out.append(Reading("hyperagent_gpu_quantum_coefficient", q, labels))
    units = [unit for unit, _ in per_gpu]
    put("hyperagent_qu_ratio", quantum_utilization(units))
    put("hyperagent_compute_entropy_ratio", compute_entropy(units))
    put("hyperagent_quantum_dispersion_ratio", quantum_dispersion(units))
    pressure, method = _memory_pressure(current, previous)
    put("hyperagent_memory_pressure_ratio", pressure, method=method)
    windowed = windows.update(current) if windows is not None else []
    if windows is None and previous is not None:
        windowed = _window_readings(previous, current)
    out += windowed
    if previous is not None and not any(r.name == CCR for r in windowed):
        window_s = current.ts - previous.ts
        busy = [u * window_s for _, u in units]
        put(CCR, estimated_ccr(_port_traffic(current, previous), busy), method="estimated")
    return out

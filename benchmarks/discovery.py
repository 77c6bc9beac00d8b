"""One coordinator with no job list finding the jobs of a large cluster: 10,000 simulated
agents publishing telemetry at 1 Hz through mosquitto, and 500 jobs that a "scheduler"
starts over 5 minutes (1 to 32 nodes each, 8 ranks per node, the ranks of each node
attaching up to 3 s apart) and that end 40 to 120 s later.

    python benchmarks/discovery.py [--agents 10000] [--jobs 500] [--minutes 5] [--json FILE]
                                   [--job-s 40,120]

Prints what the coordinator ingested per CPU second, its peak and final RSS, how many jobs it
held at most and at the end (its memory is bounded by the live jobs: an ended job is
released ``release_after_s`` later), and the time from each job's last rank attaching to
its first trial's settings being published (from the coordinator's journals). The simulated
agents do not answer settings: a job's first trial is what is timed.

Exits 1, saying what, when the work did not happen: no telemetry sent or ingested, a payload
invalid, no stats of the coordinator while the load ran, no job found or no first trial
published (a check that the work happened, not of how fast). ``.ci/run`` runs it at a small
size (``--agents 1000 --jobs 40 --minutes 0.5 --job-s 10,20``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from mqttsim import Mosquitto, publish_packet, raise_fd_limit  # noqa: E402
from run import Worker  # noqa: E402
from workers import CLUSTER, load_connections, telemetry_template  # noqa: E402

from hyperagent import bus  # noqa: E402

CAPTURE = HERE.parent / "fixtures" / "replay" / "full-node"
"""A real agent's telemetry of this 8-GPU node is what every simulated agent sends."""
RANKS_PER_NODE = 8
SIZES = (1, 2, 4, 8, 16, 32)
RELEASE_AFTER_S = 20.0
END_AFTER_S = 5.0


@dataclass
class Job:
    id: str
    start: float
    """Seconds after the run began."""
    duration: float
    nodes: list[int]
    attach: list[float]
    """Per node, seconds after ``start`` its ranks attach."""

    @property
    def last_attach(self) -> float:
        return self.start + max(self.attach)


def schedule(
    agents: int,
    jobs: int,
    seconds: float,
    rng: random.Random,
    job_s: tuple[float, float] = (40.0, 120.0),
) -> list[Job]:
    """Jobs starting evenly over ``seconds``, each on free nodes (a node runs one job), each
    running a time drawn from ``job_s``."""
    busy_until = [0.0] * agents
    free = list(range(agents))
    out = []
    for k in range(jobs):
        start = seconds * k / jobs
        free = [n for n in range(agents) if busy_until[n] <= start]
        size = min(rng.choice(SIZES), len(free))
        nodes = rng.sample(free, size)
        duration = rng.uniform(*job_s)
        for n in nodes:
            busy_until[n] = start + duration + END_AFTER_S + 1.0
        attach = [rng.uniform(0.0, 3.0) for _ in nodes]
        out.append(Job(f"sched-{k:04d}", start, duration, sorted(nodes), attach))
    return out


class ClusterLoad:
    """The agents: node i publishes its telemetry once a second (QoS 0, spread over the
    second) over ``connections`` shared connections; its ``jobs`` are the ranks attached to it
    now, as an agent says them."""

    def __init__(
        self, port: int, agents: int, jobs: list[Job], connections: int, template: dict[str, Any]
    ) -> None:
        raise_fd_limit(connections + 100)
        fixed = {k: v for k, v in template.items() if k not in ("node", "ts", "jobs")}
        self.tail = b"," + orjson.dumps(fixed)[1:]
        topics = bus.Topics(CLUSTER)
        self.topics = [topics.telemetry(f"sim{i:05d}").encode() for i in range(agents)]
        self.names = [orjson.dumps(f"sim{i:05d}") for i in range(agents)]
        self.agents = agents
        self.events: list[tuple[float, int, str, bytes | None]] = []
        for job in jobs:
            world = RANKS_PER_NODE * len(job.nodes)
            for position, (node, delay) in enumerate(zip(job.nodes, job.attach, strict=True)):
                first = position * RANKS_PER_NODE
                entry = {
                    "samples": 0,
                    "step_s": 2.0,
                    "attached": RANKS_PER_NODE,
                    "ranks": RANKS_PER_NODE,
                    "rank_ids": list(range(first, first + RANKS_PER_NODE)),
                    "world_size": world,
                    "local_world_size": RANKS_PER_NODE,
                    "tune": True,
                    "user": "bench",
                    "uid": 1000,
                    "gpus": list(range(RANKS_PER_NODE)),
                    "gpus_separable": True,
                }
                self.events.append((job.start + delay, node, job.id, orjson.dumps(entry)))
                self.events.append((job.start + job.duration, node, job.id, None))
        self.events.sort(key=lambda e: e[0])
        self.jobs_on: list[dict[str, bytes]] = [{} for _ in range(agents)]
        self.jobs_bytes: list[bytes] = [b"{}"] * agents
        self.sockets = load_connections(port, connections)
        self.sent = 0
        self.began = 0.0
        self.started = 0.0

    def _apply(self, elapsed: float) -> None:
        while self.events and self.events[0][0] <= elapsed:
            _, node, job, entry = self.events.pop(0)
            if entry is None:
                self.jobs_on[node].pop(job, None)
            else:
                self.jobs_on[node][job] = entry
            self.jobs_bytes[node] = (
                b"{"
                + b",".join(b'"%s":%s' % (j.encode(), e) for j, e in self.jobs_on[node].items())
                + b"}"
            )

    def run(self, seconds: float, stop: threading.Event) -> None:
        self.began = time.time()
        start = self.started = time.monotonic()
        index = 0
        while not stop.is_set():
            elapsed = time.monotonic() - start
            if elapsed >= seconds:
                break
            self._apply(elapsed)
            due = int(self.agents * elapsed) - self.sent
            now = orjson.dumps(time.time())
            batches: dict[int, list[bytes]] = {}
            for _ in range(due):
                node = index % self.agents
                index += 1
                payload = b'{"node":%s,"ts":%s,"jobs":%s%s' % (
                    self.names[node],
                    now,
                    self.jobs_bytes[node],
                    self.tail,
                )
                batches.setdefault(node % len(self.sockets), []).append(
                    publish_packet(self.topics[node], payload)
                )
            for i, packets in batches.items():
                self.sockets[i].sendall(b"".join(packets))
            self.sent += due
            time.sleep(0.005)

    def close(self) -> None:
        for sock in self.sockets:
            try:
                sock.sendall(b"\xe0\x00")
                sock.close()
            except OSError:
                pass


def first_trials(state: Path) -> dict[str, float]:
    """job -> wall time its first trial's settings were journalled (published after)."""
    out = {}
    for path in state.glob("*.jsonl"):
        for line in path.read_bytes().splitlines():
            entry = orjson.loads(line)
            if entry.get("type") == "published" and entry.get("trial") == 0:
                out[path.stem] = float(entry["ts"])
                break
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(
    agents: int,
    jobs: int,
    minutes: float,
    seed: int,
    job_s: tuple[float, float] = (40.0, 120.0),
) -> dict[str, Any]:
    rng = random.Random(seed)
    seconds = minutes * 60.0
    plan = schedule(agents, jobs, seconds, rng, job_s)
    last_end = max((j.start + j.duration for j in plan), default=seconds)
    tail_s = max(last_end - seconds, 0.0) + END_AFTER_S + RELEASE_AFTER_S + 5
    defaults = {
        "tune": "asked",
        "end_after_s": END_AFTER_S,
        "release_after_s": RELEASE_AFTER_S,
        "ack_timeout_s": 30,
    }
    with tempfile.TemporaryDirectory(prefix="hyperagent-discovery-") as tmp:
        work = Path(tmp)
        state = work / "state"
        with Mosquitto(work, max_connections=1000) as broker:
            coordinator = Worker(
                "coordinator",
                "--broker",
                broker.url,
                "--nodes",
                str(agents),
                "--state",
                str(state),
                "--every",
                "1",
                "--defaults",
                json.dumps(defaults),
                "--quiet",
            )
            try:
                coordinator.wait_for("READY", 120)
                load = ClusterLoad(
                    broker.port, agents, plan, connections=64, template=telemetry_template(CAPTURE)
                )
                stop = threading.Event()
                generator = threading.Thread(target=load.run, args=(seconds + tail_s, stop))
                generator.start()
                generator.join()
                ended = time.monotonic()
                load.close()
                time.sleep(1.5)
                stats = coordinator.all("STATS")
            finally:
                coordinator.stop()
        published = first_trials(state)
    began = load.began
    delays = [published[j.id] - (began + j.last_attach) for j in plan if j.id in published]
    first, last = stats[0], stats[-1]
    cpu = last["cpu_s"] - first["cpu_s"]
    ingested = last["ingested"] - first["ingested"]
    elapsed = last["t"] - first["t"]
    return {
        "agents": agents,
        "jobs": jobs,
        "minutes": minutes,
        "job_s": list(job_s),
        "sent": load.sent,
        "ingested": ingested,
        "invalid": last["invalid"],
        "samples_under_load": sum(1 for s in stats if load.started <= s["t"] <= ended),
        "ingested_per_s": ingested / elapsed if elapsed > 0 else 0.0,
        "ingested_per_cpu_s": ingested / cpu if cpu else None,
        "coordinator_cpu_s": cpu,
        "peak_rss_mib": max(s["peak_rss_mib"] for s in stats),
        "jobs_found": last["found"],
        "jobs_with_a_first_trial": len(delays),
        "held_max": max(s["held"] for s in stats),
        "held_at_end": last["held"],
        "first_trial_s": {
            "p50": statistics.median(delays) if delays else None,
            "p90": percentile(delays, 0.9) if delays else None,
            "max": max(delays) if delays else None,
        },
    }


def nothing_measured(result: dict[str, Any]) -> list[str]:
    """What of the work did not happen (empty when it all did): telemetry sent and ingested,
    every payload valid, the coordinator sampled while the load ran, jobs found and their
    first trials published. Not how fast."""
    checks = [
        (result["sent"] > 0, "the simulated agents sent no telemetry"),
        (result["ingested"] > 0, f"the coordinator ingested none of {result['sent']} messages"),
        (result["invalid"] == 0, f"{result['invalid']} telemetry payloads were invalid"),
        (
            result["samples_under_load"] >= 2,
            f"{result['samples_under_load']} stats samples of the coordinator while the load ran",
        ),
        (result["jobs"] == 0 or result["jobs_found"] > 0, f"none of {result['jobs']} jobs found"),
        (
            result["jobs"] == 0 or result["jobs_with_a_first_trial"] > 0,
            f"no first trial published for any of the {result['jobs_found']} jobs found",
        ),
        (result["jobs"] > 0, "no job was scheduled (--jobs 0): nothing to find"),
    ]
    return [what for ok, what in checks if not ok]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--job-s",
        default="40,120",
        help="LOW,HIGH: a job runs a time drawn between these seconds (default 40,120)",
    )
    args = parser.parse_args(argv)
    low, _, high = args.job_s.partition(",")
    job_s = (float(low), float(high or low))
    result = measure(args.agents, args.jobs, args.minutes, args.seed, job_s)
    result["measured_nothing"] = failures = nothing_measured(result)
    print(
        f"{result['agents']} agents, {result['jobs']} jobs over {result['minutes']:g} min: "
        f"ingested {result['ingested']} of {result['sent']} telemetry messages "
        f"({result['ingested_per_s']:.0f}/s, {result['ingested_per_cpu_s'] or 0:.0f} per CPU s, "
        f"{result['coordinator_cpu_s']:.0f} CPU s); peak RSS {result['peak_rss_mib']:.0f} MiB; "
        f"jobs found {result['jobs_found']} of {result['jobs']}, held at most "
        f"{result['held_max']}, {result['held_at_end']} at the end; last rank -> first trial: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in result["first_trial_s"].items() if v is not None)
        + f" ({result['jobs_with_a_first_trial']} jobs)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if failures:
        print(f"FAILED: the work did not happen: {'; '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

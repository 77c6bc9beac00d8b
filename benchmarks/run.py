"""hyperagent's performance figures: the agent's cost, the coordinator's ingest and settings
fan-out through a real mosquitto, the tuner, replay, and a scale run of simulated agents.

    python benchmarks/run.py [--quick] [--json FILE] [--agents N] [--only SECTIONS]

A full run takes about 12 minutes, ``--quick`` about 4 (shorter windows, no every-source
schedules, one attribution round; ``.ci/run`` runs it); ``--smoke`` runs every section for a
few seconds (the test suite's check of the harness, its figures mean nothing).

Every section checks that its workload happened: collection cycles run, readings taken,
sources up and scrapes answered (agent, attribution: and the Slurm jobs found on the GPUs),
asks and tells timed (tuner), telemetry ingested in every step of the ladder, sampled while it
ran, no payload invalid (coordinator, scale), every ack of every round (fan-out), frames
replayed with readings (replay), cap changes measured (powercap). A section whose workload did
not happen prints ``MEASURED NOTHING <section>: <what>``, the others still run, and the exit
status is 1; so is it when a headline figure of a section run is not a positive number. No
timing is judged here: the done-when lines are information.

Every measured party runs in its own process, started from ``benchmarks/workers.py`` with this
tree's ``hyperagent``, so that CPU time and peak RSS are its own:

- agent: ``Agent.run`` with every source on the replayed capture directory
  ``fixtures/replay/full-node`` (8 GPUs through FakeNvml, 2 RDMA ports with ``rdma`` and
  ``ethtool`` outputs, a Dell iDRAC9 SDR, an APC PDU walk), this host's procfs, and a job
  socket fed by 8 simulated ranks reporting 5 steps/s each. It publishes its telemetry to the
  broker and is scraped over HTTP every 15 s (``rules/prometheus.yml``) with the Accept header
  Prometheus sends (OpenMetrics). One measured process runs at a time. CPU is user + system
  time of the whole process (``getrusage``, every thread) over a measured window after a
  warm-up, divided by the window's wall time: percent of one core on the real schedule, 1 Hz
  and 10 Hz, not a compressed one. Each rate twice (once with ``--quick``): as the shipped
  config reads the sources (the BMC every 5 s, the PDU every second, ``rdma``/``ethtool`` every
  5 s: ``sources.*.interval_s``, ``sources.rdma.commands_interval_s``; telemetry published
  once a second) and with every source read, and telemetry published, every cycle. Peak RSS is
  ``VmHWM``.
  ``nvml_calls_per_gpu_cycle``: the NVML calls the agent made over the window (FakeNvml counts
  them; the XID watcher's event waits left out), per GPU and cycle, as shipped at 1 Hz; by
  function in ``details.agent.<schedule>.agent.nvml_calls_by_function``. With ``--real-gpus``
  the calls to the real pynvml are counted the same way (``workers.CountingNvml``).
- attribution: the same agent with two Slurm jobs' processes on the capture's GPUs (the pids
  and ``proc/`` tree of ``fixtures/replay/slurm-2jobs-8gpu``), found from their cgroups
  (``attribution.mode = "cgroup"``) against not looked for (``"off"``), the two side by side
  at 1 Hz and at 10 Hz in three rounds (one with ``--quick``); ``attribution_cpu_ratio`` is
  on/off CPU per cycle, the worse rate.
- floor: the same sources' ``read()`` alone on the same schedule in a process that imports
  nothing else; ``agent_overhead_vs_floor`` is agent CPU / floor CPU (the worst schedule).
- coordinator: a real ``Coordinator`` with no job list behind mosquitto (every simulated node
  carries 8 ranks of one job that did not ask to be tuned, its world the ranks of the largest
  step's nodes: found, every sighting kept, nothing tuned); simulated agents publish real
  telemetry payloads at 1 Hz each over raw MQTT connections, in steps of more agents. A step's
  rate is the messages handled per second over the step (its first second left out), from the
  coordinator's stats sampled every 0.1 s by a thread of its own (so a coordinator busy for
  seconds is still sampled); messages per CPU second of the coordinator is the figure the
  machine's other load does not change. A coordinator behind its telemetry works through what
  the broker queued for it: a step's figure is what it ingested during the step, whichever
  messages those were, and the line says how many sent were not ingested yet at its end.
- fan-out: the coordinator's link publishes a signed, retained settings version (as a trial
  does) and waits for every ack; simulated agents decode and verify
  it with ``hyperagent.bus`` and ack it at QoS 1. p50/p99 over rounds, after one warm-up round.
- tuner: ``benchmarks/tuner.py``'s ``timing()``: one ask+tell at 25, 50 and 100 observations.
- replay: a recording (``hyperagent.replay.Recorder``) of the capture directory at 1 Hz,
  replayed through ``Agent.collect_once`` on a virtual clock as fast as it goes, through the
  sources ``capture_sources`` builds for ``hyperagent agent --replay``: GPU readings as recorded,
  and (``replay_speedup_power_capped``) with ``actuation.power_cap`` on, through NvmlSource over
  a fake NVML that takes power caps.
- powercap: the agent's ``PowerCapActuator`` caps every GPU at its lowest limit, then at its
  highest, a few rounds; a change's latency runs from the set call until the GPU's instant
  power is at or under the new limit (the settle window a trial needs). Only with
  ``--real-gpus`` (GPUs under load, root) is it a measurement; over the capture's fake GPUs,
  which obey after 0.25 s, it checks the harness.
- scale: ``--agents N`` simulated agents, one MQTT connection each, at 1 Hz against one
  coordinator: what it ingests, at what CPU, and what the broker spends.

The broker runs the shipped ``systemd/mosquitto/hyperagent.conf`` settings that matter here,
without TLS, passwords or persistence, plus ``BROKER_OPTIONS``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]  # this tree's hyperagent, whatever is installed

from mqttsim import Mosquitto, free_port  # noqa: E402

CAPTURE = REPO / "fixtures" / "replay" / "full-node"
SLURM_NODE = REPO / "fixtures" / "replay" / "slurm-2jobs-8gpu"
"""Two Slurm jobs' processes (and their proc tree) put on the full node's GPUs (the same
8 x V100S capture) for the attribution section."""
WORKERS = HERE / "workers.py"
SCRAPE_S = 15.0
"""Prometheus scrape interval used against the agent (a common production setting)."""
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
BROKER_OPTIONS = ("set_tcp_nodelay true",)
"""Besides the shipped config's settings: without it the broker's small packets (PUBACKs, a
burst of acks) wait up to 40 ms for the peer's delayed ACK (Nagle's algorithm)."""
RANKS = 8
SECTIONS = (
    "agent",
    "attribution",
    "tuner",
    "coordinator",
    "fanout",
    "scale",
    "replay",
    "powercap",
)
STEPS_PER_S = 5.0

DONE_WHEN = {
    "agent_cpu_percent_1hz": ("<=", 1.0),
    "nvml_calls_per_gpu_cycle": ("<=", 4.0),
    "agent_cpu_percent_10hz": ("<=", 5.0),
    "agent_rss_mib": ("<=", 60.0),
    "agent_overhead_vs_floor": ("<=", 2.0),
    "attribution_cpu_ratio": ("<=", 1.10),
    "coordinator_msgs_per_s": (">=", 10_000.0),
    "fanout_p99_s_1000": ("<", 1.0),
    "tuner_ask_tell_ms_100": ("<=", 100.0),
    "replay_speedup": (">=", 1000.0),
}


@dataclass(frozen=True)
class Plan:
    """How long and how big each section runs."""

    agent_1hz_s: float
    agent_10hz_s: float
    warmup_s: float
    ladder: tuple[int, ...]
    ladder_step_s: float
    ladder_connections: int
    fanout: tuple[int, ...]
    fanout_rounds: int
    replay_frames: int
    scale_agents: int | None
    scale_s: float
    tuner: bool
    agents_together: bool = False
    """Run the 1 Hz and the 10 Hz agents at once (they disturb each other's figures a little)."""
    powercap_rounds: int = 3
    """Rounds of the power-cap section (one lowered and one raised cap each)."""
    all_sources: bool = True
    """Also measure the agent (and its floor) with every source read every cycle."""
    attribution_rounds: int = 3
    """Rounds of the attribution section per rate (their figures summed)."""


FULL = Plan(
    agent_1hz_s=90,
    agent_10hz_s=40,
    warmup_s=5,
    ladder=(2000, 5000, 10000, 15000, 20000, 30000, 40000),
    ladder_step_s=5,
    ladder_connections=1000,
    fanout=(10, 100, 1000),
    fanout_rounds=100,
    replay_frames=3600,
    scale_agents=10_000,
    scale_s=30,
    tuner=True,
)
QUICK = Plan(
    agent_1hz_s=20,
    agent_10hz_s=10,
    warmup_s=3,
    ladder=(2000, 5000, 10000, 20000),
    ladder_step_s=3,
    ladder_connections=500,
    fanout=(10, 100, 1000),
    fanout_rounds=20,
    replay_frames=300,
    scale_agents=None,
    scale_s=10,
    tuner=True,
    all_sources=False,
    attribution_rounds=1,
)
"""Every figure of the full run but those of every source read every cycle, on shorter
windows (``.ci/run`` runs it: about 4 minutes on 2 cores). Until 2026-12-07 it measured the
agent over 40 s at 1 Hz and 20 s at 10 Hz, every source every cycle too, attribution in three
rounds (about 7 minutes)."""
SMOKE = Plan(
    agent_1hz_s=1.5,
    agent_10hz_s=0.5,
    warmup_s=0.5,
    ladder=(50,),
    ladder_step_s=2,
    ladder_connections=5,
    fanout=(5,),
    fanout_rounds=2,
    replay_frames=20,
    scale_agents=20,
    scale_s=2,
    tuner=False,
    agents_together=True,
    powercap_rounds=1,
)
"""Seconds-long runs that exercise every path (the test suite's smoke test); figures mean
nothing."""


def say(text: str) -> None:
    print(text, flush=True)


class Worker:
    """A worker process whose standard output is read line by line in a thread."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, str(WORKERS), *args]
        self.process = subprocess.Popen(
            self.args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[tuple[str, Any]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            kind, _, data = raw.decode().strip().partition(" ")
            with self._changed:
                self.lines.append((kind, json.loads(data) if data else None))
                self._changed.notify_all()
        with self._changed:
            self.lines.append(("EXIT", self.process.wait()))
            self._changed.notify_all()

    def wait_for(self, kind: str, timeout_s: float) -> Any:
        """The data of the first line of ``kind``; raises when the worker ends or times out."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for seen, data in self.lines:
                    if seen == kind:
                        return data
                    if seen == "EXIT":
                        raise RuntimeError(f"{' '.join(self.args[2:4])} exited {data}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{' '.join(self.args[2:4])}: no {kind} in {timeout_s}s")
                self._changed.wait(left)

    def all(self, kind: str) -> list[Any]:
        with self._changed:
            return [data for seen, data in self.lines if seen == kind]

    def stop(self, timeout_s: float = 20) -> None:
        """Close standard input (workers that wait for it end), then wait or kill."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self._reader.join(timeout=5)

    def latest(self, kind: str) -> Any:
        """The data of the last line of ``kind`` so far (None: none yet)."""
        with self._changed:
            return next((data for seen, data in reversed(self.lines) if seen == kind), None)


@contextmanager
def worker(*args: str, env: dict[str, str] | None = None, stop_s: float = 20) -> Iterator[Worker]:
    w = Worker(*args, env=env)
    try:
        yield w
    finally:
        w.stop(stop_s)


class NothingMeasured(RuntimeError):
    """A section's workload did not happen (no message ingested, no cycle run, no scrape
    answered, ...): its figures would measure nothing. ``main`` says so and exits non-zero."""


def require(ok: bool, section: str, what: str) -> None:
    """Raise NothingMeasured for ``section`` unless ``ok``: a check that the workload
    happened, never a bound on how fast."""
    if not ok:
        raise NothingMeasured(f"{section}: {what}")


# -- agent ---------------------------------------------------------------------------------


class JobReports:
    """``RANKS`` reporters of a simulated training job sending steps to an agent's socket."""

    def __init__(self, socket_path: Path) -> None:
        from hyperagent.job import JobReporter

        self.reporters = [JobReporter("bench", rank, socket_path) for rank in range(RANKS)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = 1 / STEPS_PER_S
        while not self._stop.wait(period):
            for reporter in self.reporters:
                reporter.poll_settings()
                reporter.report_step(32, period, 0.8 * period, 0.2 * period, loss=2.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for reporter in self.reporters:
            reporter.close()


class Scraper:
    """GETs /metrics every ``SCRAPE_S`` seconds with Prometheus's Accept header."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.scrapes = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            request = urllib.request.Request(self.url, headers={"Accept": PROMETHEUS_ACCEPT})
            with urllib.request.urlopen(request, timeout=10) as response:
                self.bytes = len(response.read())
            self.scrapes += 1
            if self._stop.wait(SCRAPE_S):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


@dataclass(frozen=True)
class Schedule:
    """An agent scenario: the collection rate, and whether every source is read every cycle
    (else as the shipped config reads them: the BMC every 5 s, the PDU every second, the
    ``rdma``/``ethtool`` commands every 5 s, the rest every cycle)."""

    label: str
    hz: float
    every_cycle: bool = False
    attribution: str = ""
    """``attribution.mode`` with two Slurm jobs' processes on the GPUs (``SLURM_NODE``);
    empty: the shipped mode on the capture alone (no process on any GPU)."""


DEFAULT_1HZ = Schedule("1hz", 1.0)
DEFAULT_10HZ = Schedule("10hz", 10.0)
ALL_1HZ = Schedule("1hz_all", 1.0, every_cycle=True)
ALL_10HZ = Schedule("10hz_all", 10.0, every_cycle=True)
ATTRIBUTION = tuple(
    Schedule(f"{hz:g}hz_slurm_{mode}", hz, attribution=mode)
    for hz in (1.0, 10.0)
    for mode in ("cgroup", "off")
)
"""The attribution section: the same two Slurm jobs on the GPUs, found from their cgroups or
not looked for (``attribution.mode = "off"``), at 1 and 10 Hz."""
KINDS = ("agent", "floor")
"""The agent, and the raw reads alone (``workers.py``)."""


def agents(
    schedules: tuple[Schedule, ...],
    seconds: float,
    warmup: float,
    broker: Mosquitto,
    work: Path,
    real_gpus: bool = False,
    kinds: tuple[str, ...] = KINDS,
) -> dict[str, dict[str, Any]]:
    """For each schedule, the measurements of the agent and of the raw-read floor, by kind.
    The processes of one kind run at once (one per schedule), each with its job's reporters
    and, for the agent, a Prometheus scraper and the broker."""
    results: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        with ExitStack() as stack:
            running = []
            for schedule in schedules:
                state = work / f"{kind}-{schedule.label}"
                state.mkdir()
                args = [kind, "--capture", str(CAPTURE), "--hz", str(schedule.hz)]
                args += ["--seconds", str(seconds), "--warmup", str(warmup)]
                args += ["--state", str(state), "--job-socket", str(state / "job.sock")]
                args += ["--every-cycle"] if schedule.every_cycle else []
                args += ["--node", f"bench-{schedule.label}"]
                args += ["--real-gpus"] if real_gpus else []
                if schedule.attribution:
                    args += ["--slurm-jobs", str(SLURM_NODE)]
                    args += ["--attribution", schedule.attribution]
                if kind == "agent":
                    args += ["--broker", broker.url, "--metrics-port", str(free_port())]
                w = stack.enter_context(worker(*args))
                running.append((schedule, w, state / "job.sock"))
            scrapers = {}
            for schedule, w, socket_path in running:
                ready = w.wait_for("READY", 120)
                reports = JobReports(socket_path)
                stack.callback(reports.close)
                if kind == "agent":
                    scrapers[schedule.label] = scraper = Scraper(ready["metrics_port"])
                    stack.callback(scraper.close)
                results.setdefault(schedule.label, {})[kind] = {"ready": ready}
            for schedule, w, _ in running:
                results[schedule.label][kind].update(w.wait_for("RESULT", seconds + warmup + 120))
            for label, scraper in scrapers.items():
                results[label]["agent"].update(scrapes=scraper.scrapes, scrape_bytes=scraper.bytes)
    for schedule in schedules:
        for kind in kinds:
            check_agent_run(schedule, kind, results[schedule.label][kind])
    return results


def check_agent_run(schedule: Schedule, kind: str, run: dict[str, Any]) -> None:
    """The measured process collected (cycles, readings; no source down both when it was
    ready and at the window's end); the agent was scraped and answered, and with attribution
    on found the Slurm jobs on the GPUs."""
    section = "attribution" if schedule.attribution else "agent"
    where = f"{kind} {schedule.label}"
    ready = run["ready"]
    require(run["cycles"] >= 1, section, f"{where}: no collection cycle in the measured window")
    require(run["cpu_s"] > 0, section, f"{where}: no CPU time measured")
    require(ready["readings"] > 0, section, f"{where}: its first cycle read nothing")
    if kind != "agent":
        return
    at_end = run.get("sources_up_at_end", {})
    down = sorted(
        name for name, up in ready["sources_up"].items() if not up and not at_end.get(name)
    )
    require(
        not down, section, f"{where}: source(s) down at the start and the end: {', '.join(down)}"
    )
    require(
        run["scrapes"] >= 1 and run["scrape_bytes"] > 0,
        section,
        f"{where}: /metrics answered no scrape",
    )
    if schedule.attribution and schedule.attribution != "off":
        require(
            bool(ready["jobs_on_gpus"]),
            section,
            f"{where}: attribution {schedule.attribution!r} found no job on the GPUs",
        )


def compare_with_floor(results: dict[str, dict[str, Any]], schedules: tuple[Schedule, ...]) -> None:
    """Adds each schedule's agent/floor CPU ratio to ``results`` and prints the figures."""
    for schedule in schedules:
        result = results[schedule.label]
        agent, floor = result["agent"], result["floor"]
        result["overhead_vs_floor"] = agent["cpu_s"] / floor["cpu_s"]
        result["every_cycle"] = schedule.every_cycle
        how = "every source every cycle" if schedule.every_cycle else "shipped config"
        say(
            f"agent {schedule.hz:g} Hz ({how}): "
            f"{agent['cpu_percent']:.2f}% of a core ({agent['cpu_ms_per_cycle']:.2f} ms CPU per "
            f"cycle, {agent['cycles']} cycles), peak RSS {agent['peak_rss_mib']:.1f} MiB, "
            f"{agent['ready']['readings']} readings, {agent['scrapes']} scrapes of "
            f"{agent['scrape_bytes'] / 1024:.0f} KiB"
            + (
                ""
                if agent.get("nvml_calls_per_gpu_cycle") is None
                else f", {agent['nvml_calls_per_gpu_cycle']:.2f} NVML calls per GPU per cycle"
            )
        )
        say(
            f"  floor: {floor['cpu_percent']:.2f}% of a core ({floor['cpu_ms_per_cycle']:.2f} ms "
            f"per cycle), peak RSS {floor['peak_rss_mib']:.1f} MiB; agent/floor CPU "
            f"{result['overhead_vs_floor']:.2f}x"
        )


# -- coordinator ingest --------------------------------------------------------------------


DRAIN_S = 5.0
"""After the load stops, how long the coordinator is given to ingest what is queued for it."""
STATS_EVERY_S = 0.1
"""The ingesting coordinator's stats interval (``workers.Sampler``)."""


def _drain(coordinator: Worker, sent: int, timeout_s: float) -> None:
    """Wait until the coordinator ingested ``sent`` messages, or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = coordinator.latest("STATS")
        if last is not None and last["ingested"] >= sent:
            return
        time.sleep(0.1)


def ingest(
    broker: Mosquitto,
    work: Path,
    agents: tuple[int, ...],
    step_s: float,
    connections: int,
    section: str = "coordinator",
) -> list[dict[str, Any]]:
    """Steps of ``agents`` simulated agents at 1 Hz each into one coordinator, then the
    totals. A step's figures come from the coordinator's stats samples inside the step (its
    first second, or third, left out); ``check_ingest`` says whether they measured anything."""
    state = work / f"{section}-{agents[-1]}"
    state.mkdir()
    steps = []
    with worker(
        "coordinator",
        "--broker",
        broker.url,
        "--nodes",
        str(max(agents)),
        "--state",
        str(state),
        "--every",
        str(STATS_EVERY_S),
        stop_s=5,  # one busy with a backlog is killed: its figures are in
    ) as coordinator:
        coordinator.wait_for("READY", 120)
        with worker(
            "loadgen",
            "--port",
            str(broker.port),
            "--capture",
            str(CAPTURE),
            "--rates",
            ",".join(map(str, agents)),
            "--step-s",
            str(step_s),
            "--connections",
            str(connections),
        ) as load:
            load.wait_for("READY", 300)
            broker_cpu = broker.cpu_seconds()
            load.wait_for("DONE", len(agents) * step_s + 120)
            broker_cpu = broker.cpu_seconds() - broker_cpu
        load_steps = load.all("STEP")
        total_sent = sum(s["sent"] for s in load_steps)
        _drain(coordinator, total_sent, DRAIN_S)
        stats = coordinator.all("STATS")
    settle = min(1.0, step_s / 3)
    sent_so_far = 0
    for step in load_steps:
        sent_so_far += step["sent"]
        window = [s for s in stats if step["t0"] + settle <= s["t"] <= step["t1"]]
        first, last = (window[0], window[-1]) if window else ({}, {})
        elapsed = last["t"] - first["t"] if window else 0.0
        handled = last["ingested"] - first["ingested"] if window else 0
        cpu = last["cpu_s"] - first["cpu_s"] if window else 0.0
        steps.append(
            {
                "agents": step["agents"],
                "offered_per_s": step["rate"],
                "sent": step["sent"],
                "samples": len(window),
                "ingested": handled,
                "ingested_per_s": handled / elapsed if elapsed > 0 else 0.0,
                "cpu_percent": 100 * cpu / elapsed if elapsed > 0 else 0.0,
                "msgs_per_cpu_s": handled / cpu if cpu > 0 else None,
                "behind": sent_so_far - last["ingested"] if window else None,
                "peak_rss_mib": last.get("peak_rss_mib"),
            }
        )
    final = stats[-1] if stats else {}
    duration = sum(s["t1"] - s["t0"] for s in load_steps)
    for step in steps:
        say(
            f"{section}, {step['agents']} agents at 1 Hz: offered {step['offered_per_s']:.0f}/s,"
            f" ingested {step['ingested_per_s']:.0f}/s at {step['cpu_percent']:.0f}% of a core"
            f" ({step['msgs_per_cpu_s'] or 0:.0f} per CPU second; {step['ingested']} messages in"
            f" {step['samples']} samples, {step['behind']} sent not yet ingested at its end),"
            f" RSS {step['peak_rss_mib'] or 0:.0f} MiB"
        )
    ingested = final.get("ingested", 0)
    say(
        f"{section}: ingested {ingested} of the {total_sent} messages sent"
        f" ({total_sent - ingested} not ingested {DRAIN_S:g} s after the load stopped),"
        f" {final.get('invalid', 0)} invalid, {final.get('tracked_nodes', 0)} nodes' sightings"
        f" of the job kept, {final.get('connects', 0)} connection(s)"
    )
    steps.append(
        {
            "sent": total_sent,
            "ingested": ingested,
            "invalid": final.get("invalid", 0),
            "tracked_nodes": final.get("tracked_nodes", 0),
            "broker_cpu_percent": 100 * broker_cpu / duration if duration else None,
        }
    )
    return steps


def check_ingest(steps: list[dict[str, Any]], section: str) -> None:
    """Raises NothingMeasured unless every step of ``ingest`` measured messages ingested (two
    stats samples inside it at least, some message ingested between them), the coordinator
    kept the nodes' sightings, and no payload was invalid."""
    *ladder, total = steps
    require(bool(ladder) and total["sent"] > 0, section, "the load generator sent nothing")
    for step in ladder:
        where = f"{step['agents']} agents at 1 Hz"
        require(
            step["samples"] >= 2,
            section,
            f"{where}: {step['samples']} stats samples of the coordinator inside the step "
            "(it stalled or ended before the step did)",
        )
        require(
            step["ingested"] > 0 and step["msgs_per_cpu_s"] is not None,
            section,
            f"{where}: {step['sent']} messages sent, the coordinator ingested none of them "
            "during the step",
        )
    require(total["invalid"] == 0, section, f"{total['invalid']} invalid payloads")
    require(
        total["tracked_nodes"] > 0,
        section,
        "the coordinator kept no node's sighting of the job (the telemetry was not taken in)",
    )


def saturation(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The most the coordinator ingested in a step, and the first step where it fell behind
    (under 95% of the offered rate) or used a whole core."""
    ladder = [s for s in steps if "agents" in s]
    best = max(ladder, key=lambda s: s["ingested_per_s"])
    behind = next(
        (
            s
            for s in ladder
            if s["ingested_per_s"] < 0.95 * s["offered_per_s"] or s["cpu_percent"] >= 95
        ),
        None,
    )
    return {
        "msgs_per_s": best["ingested_per_s"],
        "at_agents": best["agents"],
        "cpu_percent": best["cpu_percent"],
        "saturated_at_agents": behind["agents"] if behind else None,
        "msgs_per_cpu_s": max(s["msgs_per_cpu_s"] or 0 for s in ladder),
    }


# -- fan-out -------------------------------------------------------------------------------


def fanout(broker: Mosquitto, work: Path, nodes: int, rounds: int) -> dict[str, Any]:
    processes = 1 if nodes < 100 else 2
    share = -(-nodes // processes)
    state = work / f"fanout-{nodes}"
    state.mkdir()
    with ExitStack() as stack:
        for first in range(0, nodes, share):
            count = min(share, nodes - first)
            sim = stack.enter_context(
                worker(
                    "simagents",
                    "--port",
                    str(broker.port),
                    "--first",
                    str(first),
                    "--count",
                    str(count),
                )
            )
            sim.wait_for("READY", 120)
        with worker(
            "fanout",
            "--broker",
            broker.url,
            "--nodes",
            str(nodes),
            "--rounds",
            str(rounds),
            "--state",
            str(state),
        ) as fan:
            result: dict[str, Any] = fan.wait_for("RESULT", 60 + rounds * 30)
    say(
        f"settings fan-out to {nodes} agents: p50 {1000 * result['p50_s']:.1f} ms, "
        f"p99 {1000 * result['p99_s']:.1f} ms to the last ack ({result['rounds']} rounds, "
        f"{result['missing_acks']} acks missing)"
    )
    require(
        result["rounds"] == rounds,
        "fanout",
        f"{nodes} agents: {result['rounds']} of {rounds} rounds measured",
    )
    require(
        result["missing_acks"] == 0,
        "fanout",
        f"{nodes} agents: {result['missing_acks']} acks never came (a round's time is the last "
        "ack's)",
    )
    return result


# -- tuner, replay, machine ----------------------------------------------------------------


def tuner_timing() -> dict[str, Any]:
    import tuner

    times = tuner.timing()
    require(bool(times), "tuner", "no ask+tell timed")
    for n, t in times.items():
        require(
            t["repeats"] > 0 and t["wall_median_ms"] > 0,
            "tuner",
            f"no ask+tell timed at {n} observations",
        )
        say(
            f"tuner ask+tell at {n} observations: {t['wall_median_ms']:.0f} ms median wall "
            f"({t['cpu_median_ms']:.0f} ms CPU), max {t['wall_max_ms']:.0f} ms"
        )
    return {str(n): t for n, t in times.items()}


def replay(frames: int) -> dict[str, Any]:
    with worker("replay", "--capture", str(CAPTURE), "--frames", str(frames)) as w:
        result: dict[str, Any] = w.wait_for("RESULT", 600)
    capped = result["power_capped"]
    require(result["frames"] > 0, "replay", "nothing was recorded")
    for how, run in (("as recorded", result), ("power-capped", capped)):
        require(
            run["readings_per_frame"] > 0 and run["wall_s"] > 0,
            "replay",
            f"{how}: the replayed frames gave no readings",
        )
    say(
        f"replay: {result['recorded_s']:.0f} s of recorded 8-GPU telemetry through the agent in "
        f"{result['wall_s']:.2f} s: {result['speedup']:.0f}x real time "
        f"({1000 * result['wall_s'] / result['frames']:.2f} ms per frame, "
        f"{result['readings_per_frame']} readings; {result['speedup_with_load']:.0f}x with "
        f"parsing the recording); with power capping on (GPUs through NvmlSource over a fake "
        f"NVML): {capped['speedup']:.0f}x ({1000 * capped['wall_s'] / result['frames']:.2f} ms "
        f"per frame)"
    )
    return result


def powercap(rounds: int, real_gpus: bool) -> dict[str, Any]:
    args = ["powercap", "--capture", str(CAPTURE), "--rounds", str(rounds)]
    if not real_gpus:
        args += ["--pause-s", "0"]
    with worker(*args, *(["--real-gpus"] if real_gpus else [])) as w:
        result: dict[str, Any] = w.wait_for("RESULT", 120 + rounds * 30)
    if "error" in result:
        say(f"power-cap latency: not measured: {result['error']}")
    require("error" not in result, "powercap", f"no cap changed: {result.get('error')}")
    what = "this machine's GPUs" if real_gpus else "fake GPUs, a harness check only"
    low, high = result["lowered"], result["raised"]

    def shown(spread: dict[str, Any]) -> str:
        if spread["p50_s"] is None:
            return f"none of {spread['changes']} measured"
        return (
            f"p50 {1000 * spread['p50_s']:.0f} ms, max {1000 * spread['max_s']:.0f} ms "
            f"({spread['measured']} of {spread['changes']} measured)"
        )

    say(
        f"power-cap latency ({what}): to {result['limits_w'][0]:.0f} W {shown(low)}; "
        f"back to {result['limits_w'][1]:.0f} W {shown(high)}"
    )
    for way, spread in (("lowered", low), ("raised", high)):
        require(
            spread["measured"] > 0,
            "powercap",
            f"{way}: none of {spread['changes']} cap changes measured",
        )
    return result


def machine() -> dict[str, Any]:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    mosquitto = subprocess.run(
        [Mosquitto(Path(tempfile.gettempdir())).binary, "-h"], capture_output=True, text=True
    ).stdout.splitlines()
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "mosquitto": mosquitto[0] if mosquitto else "",
    }


def attribution_rounds(
    plan: Plan, broker: Mosquitto, work: Path, real_gpus: bool
) -> dict[str, dict[str, Any]]:
    """The attribution section: per rate, the agent with attribution on and the one with it
    off run side by side (the machine's other load falls on both alike), in ``ROUNDS`` rounds
    whose CPU time and cycles are summed per mode."""
    rounds = 1 if plan.agents_together else plan.attribution_rounds
    out: dict[str, dict[str, Any]] = {}
    for hz, seconds in ((1.0, plan.agent_1hz_s), (10.0, plan.agent_10hz_s)):
        for number in range(rounds):
            schedules = tuple(
                Schedule(f"{s.label}_r{number}", s.hz, attribution=s.attribution)
                for s in ATTRIBUTION
                if s.hz == hz
            )
            measured = agents(
                schedules, seconds / rounds, plan.warmup_s, broker, work, real_gpus, ("agent",)
            )
            for label, result in measured.items():
                run = result["agent"]
                total = out.setdefault(label.rsplit("_r", 1)[0], {"agent": {"rounds": []}})
                total["agent"]["rounds"].append(run)
    for total in out.values():
        runs = total["agent"]["rounds"]
        cpu_s, wall_s = sum(r["cpu_s"] for r in runs), sum(r["wall_s"] for r in runs)
        cycles = sum(r["cycles"] for r in runs)
        total["agent"].update(
            cpu_s=cpu_s,
            cycles=cycles,
            cpu_percent=100 * cpu_s / wall_s,
            cpu_ms_per_cycle=1000 * cpu_s / cycles if cycles else None,
            ready=runs[0]["ready"],
        )
    return out


def attribution_figures(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """CPU per cycle with the Slurm jobs found from their cgroups over that with attribution
    off, per rate, and the worse of the two; printed."""
    out: dict[str, Any] = {}
    for hz in ("1", "10"):
        on = runs.get(f"{hz}hz_slurm_cgroup", {}).get("agent")
        off = runs.get(f"{hz}hz_slurm_off", {}).get("agent")
        if not on or not off or not on["cpu_ms_per_cycle"] or not off["cpu_ms_per_cycle"]:
            continue
        ratio = on["cpu_ms_per_cycle"] / off["cpu_ms_per_cycle"]
        out[f"{hz}hz"] = {
            "on_ms_per_cycle": on["cpu_ms_per_cycle"],
            "off_ms_per_cycle": off["cpu_ms_per_cycle"],
            "ratio": ratio,
        }
        say(
            f"attribution {hz} Hz, two Slurm jobs on the GPUs: cgroup "
            f"{on['cpu_ms_per_cycle']:.2f} ms CPU per cycle ({on['cpu_percent']:.2f}% of a core,"
            f" {on['cycles']} cycles), off {off['cpu_ms_per_cycle']:.2f} ms "
            f"({off['cpu_percent']:.2f}%): {ratio:.3f}x"
        )
    ratios = [v["ratio"] for v in out.values()]
    out["ratio"] = max(ratios) if ratios else None
    return out


def verdicts(figures: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, (op, bound) in DONE_WHEN.items():
        value = figures.get(key)
        ok = value is not None and (
            value <= bound if op == "<=" else value >= bound if op == ">=" else value < bound
        )
        out[key] = {"value": value, "bound": f"{op} {bound:g}", "ok": ok}
    return out


def headline(details: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The figures the issue asks for (None for a section not run): the agent as shipped
    (``DEFAULT_1HZ``, ``DEFAULT_10HZ``), and with every source read every cycle
    (``*_all_sources``)."""
    runs = details.get("agent", {})

    def agent(label: str, key: str) -> Any:
        return runs[label]["agent"][key] if label in runs else None

    limit = details.get("coordinator_limit", {})
    fan = details.get("fanout", {})
    largest = str(max(plan.fanout))
    replayed = details.get("replay", {})
    return {
        "agent_cpu_percent_1hz": agent("1hz", "cpu_percent"),
        "agent_cpu_percent_10hz": agent("10hz", "cpu_percent"),
        "agent_cpu_percent_1hz_all_sources": agent("1hz_all", "cpu_percent"),
        "agent_cpu_percent_10hz_all_sources": agent("10hz_all", "cpu_percent"),
        "nvml_calls_per_gpu_cycle": agent("1hz", "nvml_calls_per_gpu_cycle"),
        "nvml_calls_per_gpu_cycle_all_sources": agent("1hz_all", "nvml_calls_per_gpu_cycle"),
        "agent_rss_mib": max((r["agent"]["peak_rss_mib"] for r in runs.values()), default=None),
        "agent_overhead_vs_floor": max(
            (r["overhead_vs_floor"] for r in runs.values()), default=None
        ),
        "attribution_cpu_ratio": details.get("attribution", {}).get("ratio"),
        "coordinator_msgs_per_s": limit.get("msgs_per_s"),
        "coordinator_msgs_per_cpu_s": limit.get("msgs_per_cpu_s"),
        "fanout_p99_s_1000": fan.get("1000", {}).get("p99_s"),
        f"fanout_p99_s_{largest}": fan.get(largest, {}).get("p99_s"),
        "tuner_ask_tell_ms_100": details.get("tuner_ask_tell_ms", {})
        .get("100", {})
        .get("wall_median_ms"),
        "replay_speedup": replayed.get("speedup"),
        "replay_speedup_power_capped": replayed.get("power_capped", {}).get("speedup"),
        "power_cap_latency_s_max": (
            details.get("powercap", {}).get("lowered", {}).get("max_s")
            if details.get("powercap", {}).get("real_gpus")
            else None
        ),
    }


def unmeasured(figures: dict[str, Any], sections: set[str], plan: Plan) -> list[str]:
    """The headline figures of ``sections`` (those run) that are not a positive number: what a
    section's own checks should have caught, checked once more on what is reported."""
    expected = {
        "agent": [
            "agent_cpu_percent_1hz",
            "agent_cpu_percent_10hz",
            *(
                ["agent_cpu_percent_1hz_all_sources", "agent_cpu_percent_10hz_all_sources"]
                if plan.all_sources
                else []
            ),
            "nvml_calls_per_gpu_cycle",
            "agent_rss_mib",
            "agent_overhead_vs_floor",
        ],
        "attribution": ["attribution_cpu_ratio"],
        "coordinator": ["coordinator_msgs_per_s", "coordinator_msgs_per_cpu_s"],
        "fanout": [f"fanout_p99_s_{max(plan.fanout)}"],
        "tuner": ["tuner_ask_tell_ms_100"] if plan.tuner else [],
        "replay": ["replay_speedup", "replay_speedup_power_capped"],
    }
    out = []
    for section in sorted(sections & set(expected)):
        for key in expected[section]:
            value = figures.get(key)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                out.append(f"{section}: {key} = {value!r}, not a measurement")
    for failure in out:
        say(f"MEASURED NOTHING {failure}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (about 4 minutes)")
    parser.add_argument(
        "--smoke", action="store_true", help="seconds-long runs that only check the harness"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--agents",
        type=int,
        default=None,
        help="simulated agents of the scale run (default: 10000 in a full run, none with --quick)",
    )
    parser.add_argument(
        "--mosquitto-option",
        action="append",
        default=[],
        metavar="LINE",
        help="an extra mosquitto.conf line for the benchmark broker (repeatable)",
    )
    parser.add_argument(
        "--real-gpus",
        action="store_true",
        help="agent and powercap sections: this machine's GPUs through NVML, not the captured 8",
    )
    parser.add_argument(
        "--only", default="", help=f"comma-separated sections to run ({', '.join(SECTIONS)})"
    )
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    scale_agents = args.agents if args.agents is not None else plan.scale_agents
    started = time.perf_counter()
    report: dict[str, Any] = {
        "machine": machine(),
        "plan": plan.__dict__,
        "mosquitto_options": [*BROKER_OPTIONS, *args.mosquitto_option],
        "real_gpus": args.real_gpus,
    }
    m = report["machine"]
    say(f"{m['nproc']} x {m['cpu_model']}, load average {m['load_average_at_start'][0]:.2f}")
    sections = set(args.only.split(",")) if args.only else set(SECTIONS)
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}")
    details: dict[str, Any] = {}
    failures: list[str] = []

    @contextmanager
    def measuring(section: str) -> Iterator[None]:
        """Runs a section; a workload that did not happen is said and counted, and the next
        section runs."""
        try:
            yield
        except NothingMeasured as e:
            say(f"MEASURED NOTHING {e}")
            failures.append(str(e))

    with tempfile.TemporaryDirectory(prefix="hyperagent-bench-") as tmp:
        work = Path(tmp)
        extra = "".join(f"{line}\n" for line in (*BROKER_OPTIONS, *args.mosquitto_option))
        with Mosquitto(work, extra=extra) as broker:
            if "tuner" in sections and plan.tuner:
                with measuring("tuner"):
                    details["tuner_ask_tell_ms"] = tuner_timing()
            if "agent" in sections:
                with measuring("agent"):
                    timed = [
                        (DEFAULT_1HZ, plan.agent_1hz_s),
                        (ALL_1HZ, plan.agent_1hz_s),
                        (DEFAULT_10HZ, plan.agent_10hz_s),
                        (ALL_10HZ, plan.agent_10hz_s),
                    ]
                    if not plan.all_sources:
                        timed = [(s, t) for s, t in timed if not s.every_cycle]
                    runs: list[tuple[tuple[Schedule, ...], float, tuple[str, ...]]]
                    if plan.agents_together:
                        runs = [(tuple(s for s, _ in timed), max(t for _, t in timed), KINDS)]
                    else:  # one process at a time: nothing else measured shares the two cores
                        runs = [
                            ((schedule,), seconds, (kind,))
                            for schedule, seconds in timed
                            for kind in KINDS
                        ]
                    details["agent"] = {}
                    for schedules, seconds, kinds in runs:
                        measured = agents(
                            schedules, seconds, plan.warmup_s, broker, work, args.real_gpus, kinds
                        )
                        for label, result in measured.items():
                            details["agent"].setdefault(label, {}).update(result)
                    compare_with_floor(details["agent"], tuple(s for s, _ in timed))
            if "attribution" in sections:
                with measuring("attribution"):
                    attributed = attribution_rounds(plan, broker, work, args.real_gpus)
                    details["attribution_runs"] = attributed
                    details["attribution"] = attribution_figures(attributed)
            if "coordinator" in sections:
                with measuring("coordinator"):
                    ladder = ingest(
                        broker, work, plan.ladder, plan.ladder_step_s, plan.ladder_connections
                    )
                    details["coordinator_ladder"] = ladder
                    check_ingest(ladder, "coordinator")
                    details["coordinator_limit"] = limit = saturation(ladder)
                    say(
                        f"coordinator limit: {limit['msgs_per_s']:.0f} msgs/s ingested "
                        f"({limit['msgs_per_cpu_s']:.0f} per CPU second); "
                        + (
                            f"fell behind at {limit['saturated_at_agents']} agents"
                            if limit["saturated_at_agents"]
                            else "kept up at every step"
                        )
                    )
            if "fanout" in sections:
                with measuring("fanout"):
                    details["fanout"] = {}
                    for n in plan.fanout:
                        details["fanout"][str(n)] = fanout(broker, work, n, plan.fanout_rounds)
            if "scale" in sections and scale_agents:
                with measuring("scale"):
                    details["scale"] = ingest(
                        broker, work, (scale_agents,), plan.scale_s, scale_agents, "scale"
                    )
                    check_ingest(details["scale"], "scale")
        if "replay" in sections:
            with measuring("replay"):
                details["replay"] = replay(plan.replay_frames)
        if "powercap" in sections:
            with measuring("powercap"):
                details["powercap"] = powercap(plan.powercap_rounds, args.real_gpus)
    figures = headline(details, plan)
    failures += unmeasured(figures, sections - {s.partition(":")[0] for s in failures}, plan)
    report.update(figures)
    report["details"] = details
    report["done_when"] = verdicts(figures)
    report["measured_nothing"] = failures
    report["seconds"] = time.perf_counter() - started
    for key, verdict in report["done_when"].items():
        value = verdict["value"]
        mark = "ok" if verdict["ok"] else "MISSED" if value is not None else "-"
        shown = "n/a" if value is None else f"{value:.4g}"
        say(f"done-when {mark:6} {key} = {shown} ({verdict['bound']})")
    say(f"total {report['seconds']:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if failures:
        say(f"FAILED: {len(failures)} figure(s) measured nothing:")
        for failure in failures:
            say(f"  {failure}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A cluster of production shape, as real processes on loopback, with faults to inject.

One mosquitto, one ``hyperagent coordinator``, one ``hyperagent agent`` per node replaying
an 8-GPU capture (``--replay``: a fake NVML that takes power caps), and on every node the
job's 8 ranks (tests/production/ranks.py: one JobReporter connection per rank). Two jobs
on disjoint nodes of one cluster, the drift watch on:

- ``alpha`` on three nodes, 10 s steps: the ranks report 10 s steps, one every 0.1 s of real
  time (the agent measures trials, and the coordinator watches drift, from reported step
  times; the agent's stall check from when steps arrive);
- ``beta`` on one node, 50 ms steps in real time, searching the power cap.

Faults: NVML calls that block or fail on a node (the fake NVML's fault file,
``HYPERAGENT_FAKE_NVML_FAULTS``, re-read while the agent runs), a job's ranks stalled
(SIGSTOP) and resumed, an agent killed and started again. What a user sees is read where a
user reads it: the coordinator's journal, its /metrics and its status line (sd_notify), the
agents' /metrics.

Jobs found by a coordinator with no job list (``policy``), each job's ranks run as its own Unix
user and saying what any user's code may say of itself (``JobShape``: its tuning wish, a
claimed world size and rank, CPU-only or idle ranks); a node may replay its own capture
(``captures``: a recording) or show given processes on its GPUs (``gpu_processes``), and
:class:`LimitWatch` samples every GPU's power limit through a run.

Used by tests/test_production_shape.py, tests/test_coordinator_production.py,
tests/test_jobs_found.py, tests/test_hostile_tenants.py and benchmarks/soak.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.text import samples, toml_section, toml_value

from hyperagent.capture.nvidia_smi import COMPUTE_APPS_FILE, parse_capture
from hyperagent.scheduler import qualified
from hyperagent.signing import write_key_pair

from conftest import Mosquitto, free_port

REPO = Path(__file__).resolve().parents[2]
CAPTURE = REPO / "hyperagent" / "data" / "gtx-8card.xml"
"""8 x V100S under training load, 250 W limits in [100, 250] W."""
RANKS_PER_NODE = 8

# What the scenario reads, by name (one place to adapt when a name changes)
TUNER_PAUSED = "hyperagent_tuner_paused"
"""{job_id, reason}: 1 while the job's tuning is paused for that reason."""
TUNER_DONE = "hyperagent_tuner_done"
SOURCE_UP = "hyperagent_source_up"
SOURCE_LAST_SUCCESS = "hyperagent_source_last_success_timestamp_seconds"
GPU_POWER_LIMIT = "hyperagent_gpu_power_limit_watts"
JOB_RANKS = "hyperagent_job_ranks"
FAULTS_ENV = "HYPERAGENT_FAKE_NVML_FAULTS"
MEASURED = {"ok", "aborted"}
"""Trial outcomes of a measurement; any other outcome spent a trial on a fault."""


@dataclass(frozen=True)
class JobShape:
    name: str
    """The id its ranks give (``--job``)."""
    nodes: tuple[str, ...]
    step_s: float
    """The step time the ranks report."""
    wall_step_s: float
    """The step time in real time."""
    trials: int
    search_power_cap: bool = False
    slots: tuple[tuple[int, int], ...] = ()
    """Per node of ``nodes``: (first GPU, ranks) of the job there; default (0, 8) on each."""
    user: str | None = None
    """The Unix user its ranks run as (default: the test's)."""
    scheduler_id: str | None = None
    """A Slurm job id its ranks take their job id from (``SLURM_JOB_ID``, step 0) instead of
    ``id``, which is then the id the scheduler's gives (``slurm-<id>-0``)."""
    tune: bool | None = None
    """What its ranks say of being tuned (``--tune 1``/``0``; None: nothing, the policy
    decides)."""
    gpus: bool = True
    """Its ranks declare their GPUs (``--first-gpu``); False: CPU-only ranks (``--no-gpu``)."""
    idle: bool = False
    """Its ranks say hello and stay connected without reporting a step (``--idle``)."""
    claimed_world_size: int | None = None
    """The world size its ranks say (default: ``world_size``, their own count): a rank that
    joins another job's id says that job's, or any number."""
    claimed_first_rank: int | None = None
    """The rank its first rank on each node says (default: by node order)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables its ranks run with besides the harness's."""

    @property
    def id(self) -> str:
        """The id the cluster knows the job by: the ranks' id, bound to their user where they
        run as another user than the agents' (:func:`hyperagent.scheduler.qualified`)."""
        if self.user is None or pwd.getpwnam(self.user).pw_uid == os.geteuid():
            return self.name
        return qualified(self.name, pwd.getpwnam(self.user).pw_uid)

    def slot(self, node: str) -> tuple[int, int]:
        """(first GPU, ranks) of the job on ``node``."""
        return self.slots[self.nodes.index(node)] if self.slots else (0, RANKS_PER_NODE)

    @property
    def world_size(self) -> int:
        return sum(self.slot(node)[1] for node in self.nodes)

    def first_rank(self, node: str) -> int:
        return sum(self.slot(n)[1] for n in self.nodes[: self.nodes.index(node)])


JOBS = (
    JobShape("alpha", ("n0", "n1", "n2"), step_s=10.0, wall_step_s=0.1, trials=4),
    JobShape("beta", ("n3",), step_s=0.05, wall_step_s=0.05, trials=3, search_power_cap=True),
)
HANG = {"*": {"block_s": 3.0}}
"""Every NVML call of a node blocks for 3 s (a hung driver)."""
REFUSE = {"nvmlDeviceSetPowerManagementLimit": {"error": "NVML_ERROR_UNKNOWN", "gpus": [3]}}
"""Setting GPU 3's power limit fails: the node refuses every version with a new power cap."""
DRIFT_SUSTAINED_S = 2.0
WATCH_INTERVAL_S = 10.0
"""The coordinator's drift watch compares throughput this often."""
NO_DRIFT_WATCH_S = DRIFT_SUSTAINED_S + 2 * WATCH_INTERVAL_S + 2
"""Long enough after a tuning for the drift watch to have re-tuned a healthy job."""


def until(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    """``predicate()``'s first true value, polled; AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


class StatusListener:
    """The service manager's side of sd_notify: every STATUS= the coordinator sends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[float, str]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="sd-notify", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            for line in data.decode(errors="replace").splitlines():
                if line.startswith("STATUS="):
                    self.lines.append((time.time(), line.removeprefix("STATUS=")))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


@dataclass
class Scenario:
    """The cluster under ``root``; use as a context manager. ``faults`` maps a node to the
    fake NVML faults it starts with. With ``policy`` (the ``[coordinator.defaults]`` table),
    the coordinator has no job list and finds the jobs; otherwise each of ``jobs`` is a
    ``[[coordinator.jobs]]`` entry with its nodes. ``start_jobs``: start every job's ranks
    with the cluster (else :meth:`start_job`, :meth:`stop_job`)."""

    root: Path
    faults: dict[str, dict[str, Any]] = field(default_factory=dict)
    jobs: tuple[JobShape, ...] = JOBS
    policy: dict[str, Any] | None = None
    start_jobs: bool = True
    agent_users: tuple[str, ...] = ()
    """Users besides the agent's own whose ranks may attach (``sources.job.allowed_users``)."""
    job_release_after_s: float = 600.0
    """How long an agent keeps an ended job's series (``sources.job.release_after_s``)."""
    rules: tuple[dict[str, Any], ...] = ()
    """With ``policy``: ``[[coordinator.jobs]]`` rules (an ``id`` pattern and what it
    overrides of the defaults)."""
    captures: dict[str, Path] = field(default_factory=dict)
    """A node's own capture directory to replay (a recording, say) instead of the 8 x V100S
    capture."""
    gpu_processes: dict[str, dict[int, str]] = field(default_factory=dict)
    """node -> GPU index -> the process (its name in ``processes``) NVML shows running there:
    the node's capture directory gets its ``nvidia-smi-compute-apps.csv`` when its agent
    starts, so those processes must run by then (``agents_later``)."""
    agents_later: tuple[str, ...] = ()
    """Nodes whose agents the test starts itself (:meth:`start_agent`), once the processes
    NVML shows on their GPUs run."""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0

    def __post_init__(self) -> None:
        self.nodes = tuple(dict.fromkeys(n for job in self.jobs for n in job.nodes))
        self.logs = self.root / "logs"
        self.state = self.root / "coordinator"
        self.capture = self.root / "capture"

    # -- the whole cluster ---------------------------------------------------------------

    def __enter__(self) -> Scenario:
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        (self.root / "faults").mkdir(exist_ok=True)
        self.capture.mkdir(exist_ok=True)
        if not (self.capture / "nvidia-smi.xml").exists():
            (self.capture / "nvidia-smi.xml").symlink_to(CAPTURE)
        if not (self.root / "settings.key").exists():
            write_key_pair(self.root, "settings")
        self.broker = Mosquitto(self.root)
        self.broker.start()
        self.status = StatusListener(self.root / "notify.sock")
        self.started_at = time.time()
        self.ports["coordinator"] = free_port()
        for node in self.nodes:
            self.ports[node] = free_port()
            self.inject(node, self.faults.get(node, {}))
            if node not in self.agents_later:
                self.start_agent(node)
        self.start_coordinator()
        if self.start_jobs:
            for job in self.jobs:
                self.start_job(job)
        return self

    def __exit__(self, *exc: object) -> None:
        if exc and exc[0] is not None:
            self._print_what_happened()
        for name in reversed(list(self.processes)):
            self.kill(name, signal.SIGTERM)
        self.status.close()
        self.broker.stop()

    def _print_what_happened(self, lines: int = 40) -> None:
        """On a failure, what a user would look at first (pytest shows it with the failure):
        each job's journal and the tails of the coordinator's log and status lines."""
        for job in self.jobs:
            entries = self.journal(job.id)
            print(f"--- journal of {job.id}: {len(entries)} entries, the last {lines}")
            for entry in entries[-lines:]:
                print(json.dumps(entry, sort_keys=True))
        print(f"--- status lines, the last {lines}")
        for at, line in self.status.lines[-lines:]:
            print(f"{at - self.started_at:8.1f}s {line}")
        for name in ("coordinator", *(f"agent-{node}" for node in self.nodes)):
            print(f"--- {name}.log, the last {lines} lines")
            print("\n".join(self.log(name).splitlines()[-lines:]))

    # -- configuration -------------------------------------------------------------------

    def config(self, node: str) -> Path:
        """The node's hyperagent.toml (the coordinator's is ``config("coordinator")``)."""
        path = self.root / f"{node}.toml"
        text = 'cluster = "shape"\n'
        text += toml_section(
            "agent",
            {
                "interval_s": 0.5,
                "metrics_address": f"127.0.0.1:{self.ports.get(node, 0) or free_port()}",
                "state_dir": self.root / node / "state",
            },
        )
        text += toml_section(
            "mqtt",
            {"url": self.broker.url, "reconnect_min_s": 0.2, "reconnect_max_s": 2.0},
        )
        text += toml_section("sources", {"timeout_s": 1.0})
        for off in ("host", "ipmi", "rdma", "pdu"):
            text += toml_section(f"sources.{off}", {"enabled": False})
        text += toml_section(
            "sources.job",
            {
                "socket": self.socket(node),
                "allowed_users": self.agent_users,
                "release_after_s": self.job_release_after_s,
            },
        )
        text += toml_section(
            "security",
            {
                "signing_key_file": self.root / "settings.key",
                "trusted_keys": [self.root / "settings.pub"],
            },
        )
        text += toml_section(
            "coordinator",
            {
                "metrics_address": f"127.0.0.1:{self.ports.get('coordinator', 0)}",
                "state_dir": self.state,
            },
        )
        if self.policy is not None:
            policy = {k: v for k, v in self.policy.items() if k != "plan"}
            text += toml_section("coordinator.defaults", policy)
            text += toml_section("coordinator.defaults.plan", self.policy.get("plan", {}))
            for rule in self.rules:
                text += "[[coordinator.jobs]]\n" + "".join(
                    f"{k} = {toml_value(v)}\n" for k, v in rule.items()
                )
            path.write_text(text)
            return path
        for job in self.jobs:
            text += "[[coordinator.jobs]]\n" + "".join(
                f"{k} = {toml_value(v)}\n"
                for k, v in {
                    "id": job.id,
                    "nodes": job.nodes,
                    "trials": job.trials,
                    "patience": job.trials,
                    "power_limits_w": [150, 250],
                    "search_power_cap": job.search_power_cap,
                    "drift_sustained_s": DRIFT_SUSTAINED_S,
                    "ack_timeout_s": 5,
                    "trial_timeout_s": 20,
                    "seed": 1,
                }.items()
            )
            text += toml_section(
                "coordinator.jobs.plan",
                {
                    "settle_steps": 3,
                    "settle_s": 2 * job.step_s,
                    "measure_steps": 8,
                    "measure_s": 8 * job.step_s,
                    "windows": 2,
                    "max_windows": 2,
                },
            )
        path.write_text(text)
        return path

    def socket(self, node: str) -> Path:
        return self.root / node / "job.sock"

    # -- processes -----------------------------------------------------------------------

    def spawn(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        user: str | None = None,
    ) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        if user is not None:  # as the harness's units do (tests/cluster/harness.py)
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *argv]
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.processes[name] = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, **(env or {})},
        )
        log.close()

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 20) -> None:
        process = self.processes.pop(name, None)
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGCONT)  # a stalled job still hears SIGTERM
                os.killpg(process.pid, sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def start_agent(self, node: str) -> None:
        (self.root / node / "state").mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "hyperagent.cli", "agent", "--config", str(self.config(node))]
        argv += ["--replay", str(self.replayed(node)), "--node", node]
        self.spawn(f"agent-{node}", argv, {FAULTS_ENV: str(self.faults_file(node))})

    def replayed(self, node: str) -> Path:
        """The capture directory the node's agent replays: its own (``captures``), else the
        8 x V100S capture, with the processes of ``gpu_processes`` on its GPUs as they run
        now (``nvidia-smi --query-compute-apps`` of that node)."""
        if node in self.captures:
            return self.captures[node]
        running = self.gpu_processes.get(node)
        if not running:
            return self.capture
        own = self.root / f"capture-{node}"
        own.mkdir(exist_ok=True)
        if not (own / "nvidia-smi.xml").exists():
            (own / "nvidia-smi.xml").symlink_to(CAPTURE)
        uuids = [gpu.uuid for gpu in parse_capture(CAPTURE.read_text())]
        rows = ["gpu_uuid, pid, process_name, used_gpu_memory [MiB]"]
        for gpu, name in sorted(running.items()):
            rows.append(f"{uuids[gpu]}, {self.processes[name].pid}, python3, 30000 MiB")
        (own / COMPUTE_APPS_FILE).write_text("\n".join(rows) + "\n")
        return own

    def start_coordinator(self) -> None:
        argv = [sys.executable, "-m", "hyperagent.cli", "coordinator"]
        argv += ["--config", str(self.config("coordinator"))]
        self.spawn("coordinator", argv, {"NOTIFY_SOCKET": str(self.status.path)})

    def restart_coordinator(self, sig: int = signal.SIGTERM) -> None:
        """The coordinator stopped with ``sig`` and started again (it says "online" anew)."""
        self.kill("coordinator", sig)
        self.start_coordinator()

    def start_job(self, job: JobShape) -> None:
        """What a scheduler does: the job's ranks started on each of its nodes."""
        for node in job.nodes:
            self.start_ranks(job, node)

    def stop_job(self, job: JobShape) -> None:
        """The job ends: its ranks stop (SIGTERM) on every node."""
        for node in job.nodes:
            self.kill(self.ranks_name(job, node), signal.SIGTERM)

    def ranks_name(self, job: JobShape, node: str) -> str:
        return f"ranks-{node}" if self.policy is None else f"ranks-{job.id}-{node}"

    def start_ranks(self, job: JobShape, node: str) -> None:
        first_gpu, ranks = job.slot(node)
        name = self.ranks_name(job, node)
        argv = [sys.executable, str(REPO / "tests" / "production" / "ranks.py")]
        env: dict[str, str] = dict(job.env)
        if job.scheduler_id is None:
            argv += ["--job", job.name]
        else:
            env |= {"SLURM_JOB_ID": job.scheduler_id, "SLURM_STEP_ID": "0"}
        first_rank = job.first_rank(node)
        if job.claimed_first_rank is not None:
            first_rank = job.claimed_first_rank
        world_size = job.world_size if job.claimed_world_size is None else job.claimed_world_size
        argv += ["--node-rank", str(job.nodes.index(node)), "--ranks", str(ranks)]
        argv += ["--first-rank", str(first_rank), "--world-size", str(world_size)]
        argv += ["--first-gpu", str(first_gpu)] if job.gpus else ["--no-gpu"]
        argv += ["--nodes", str(len(job.nodes))]
        argv += ["--socket", str(self.socket(node)), "--step-s", str(job.step_s)]
        argv += ["--wall-step-s", str(job.wall_step_s), "--seed", str(self.nodes.index(node))]
        argv += ["--log", str(self.logs / f"{name}.jsonl")]
        if job.tune is not None:
            argv += ["--tune", "1" if job.tune else "0"]
        if job.idle:
            argv += ["--idle"]
        self.spawn(name, argv, env, job.user)

    def restart_agent(self, node: str, sig: int = signal.SIGKILL, down_s: float = 1.0) -> None:
        """The node's agent killed with ``sig`` and started again ``down_s`` later."""
        self.kill(f"agent-{node}", sig)
        time.sleep(down_s)
        self.start_agent(node)

    # -- faults --------------------------------------------------------------------------

    def faults_file(self, node: str) -> Path:
        return self.root / "faults" / f"{node}.json"

    def inject(self, node: str, faults: dict[str, Any]) -> None:
        """The node's fake NVML faults from now on (``{}``: none)."""
        path = self.faults_file(node)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(faults))
        os.replace(tmp, path)

    def stall(self, node: str) -> None:
        """The node's ranks stop stepping (their connections stay open)."""
        os.killpg(self.processes[f"ranks-{node}"].pid, signal.SIGSTOP)

    def resume(self, node: str) -> None:
        os.killpg(self.processes[f"ranks-{node}"].pid, signal.SIGCONT)

    # -- looking inside ------------------------------------------------------------------

    def scrape(self, name: str, timeout_s: float = 5.0) -> str:
        """The /metrics of a node's agent, or of "coordinator"; "" when it does not answer."""
        url = f"http://127.0.0.1:{self.ports[name]}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                return str(response.read().decode())
        except OSError:
            return ""

    def metric(self, name: str, metric: str) -> list[tuple[dict[str, str], float]]:
        return samples(self.scrape(name), metric)

    def paused(self, job: str) -> dict[str, float]:
        """reason -> 1 for each reason the coordinator's /metrics says ``job`` is paused."""
        return {
            labels.get("reason", ""): value
            for labels, value in self.metric("coordinator", TUNER_PAUSED)
            if labels.get("job_id") == job and value > 0
        }

    def journal(self, job: str) -> list[dict[str, Any]]:
        path = self.state / f"{job}.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written
                out.append(json.loads(line))
        return out

    def trials(self, job: str) -> list[dict[str, Any]]:
        return [e for e in self.journal(job) if e.get("type") == "trial"]

    def tuned(self, job: str) -> bool:
        """The job's latest tuning round ended (its best settings were published)."""
        kinds = [e.get("type") for e in self.journal(job)][::-1]
        return "final" in kinds and "start" in kinds and kinds.index("final") < kinds.index("start")

    def retunes(self, job: str) -> int:
        """Tuning rounds begun after the first (each re-tune journals a new start)."""
        return max(0, sum(e.get("type") == "start" for e in self.journal(job)) - 1)

    def tuning_s(self, job: str) -> float | None:
        """From the cluster's start to the job's first published best settings."""
        final = next((e for e in self.journal(job) if e.get("type") == "final"), None)
        return None if final is None else float(final["ts"]) - self.started_at

    def lost_trials(self, job: str) -> list[dict[str, Any]]:
        """Trials of the budget (or confirmations) that a fault cost: they measured nothing."""
        return [t for t in self.trials(job) if t["status"] not in MEASURED]

    def partial_trials(self, job: str) -> list[dict[str, Any]]:
        """Measured trials scored on fewer nodes than the job has (a node was excluded)."""
        nodes = set(next(j for j in self.jobs if j.id == job).nodes)
        return [
            t
            for t in self.trials(job)
            if t["status"] in MEASURED and set(t.get("reports", {})) != nodes
        ]

    def in_trial(self, job: str, index: int) -> bool:
        """A trial of ``job`` numbered ``index`` or later is published and not finished. (A
        trial of this shape lasts about a second: a poll starved that long on busy cores
        misses one trial, never every later one.)"""
        current = self.trial_in_progress(job)
        return current is not None and current >= index

    def trial_in_progress(self, job: str) -> int | None:
        """The index of ``job``'s trial that is published and not finished, if one is."""
        entries = self.journal(job)
        published = [i for i, e in enumerate(entries) if e.get("type") == "published"]
        if not published:
            return None
        current = entries[published[-1]].get("trial")
        after = entries[published[-1] :]
        ended = any(e.get("type") == "trial" and e.get("index") == current for e in after)
        return None if ended or not isinstance(current, int) else current

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def status_since(self, ts: float) -> list[str]:
        return [line for at, line in self.status.lines if at >= ts]

    def limits(self, node: str) -> dict[int, float]:
        """GPU index -> power limit (W), from the node agent's /metrics (empty: no answer)."""
        return {int(labels["gpu"]): v for labels, v in self.metric(node, GPU_POWER_LIMIT)}

    def received(self, job: JobShape, node: str) -> list[dict[str, Any]]:
        """The settings the job's ranks on ``node`` took, as their log says (one entry per
        rank and version: ``rank``, ``received`` (the version), ``settings``)."""
        path = self.logs / f"{self.ranks_name(job, node)}.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entry = json.loads(line)
                if "received" in entry:
                    out.append(entry)
        return out


class LimitWatch:
    """Every GPU's power limit on ``nodes``, scraped from the agents' /metrics every
    ``every_s`` in a thread while it runs: what a user would see on a dashboard."""

    def __init__(self, s: Scenario, nodes: tuple[str, ...], every_s: float = 0.5) -> None:
        self.s, self.nodes, self.every_s = s, nodes, every_s
        self.samples: list[tuple[float, str, int, float]] = []
        """(time, node, GPU, limit W) of every scrape."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="limits", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            for node in self.nodes:
                now = time.time()
                for gpu, limit in self.s.limits(node).items():
                    self.samples.append((now, node, gpu, limit))
            self._stop.wait(self.every_s)

    def seen(
        self, node: str, gpus: Iterable[int] | None = None, since: float = 0.0
    ) -> dict[int, set[float]]:
        """GPU -> every limit seen on it (of ``gpus``; all GPUs by default) since ``since``."""
        wanted = None if gpus is None else set(gpus)
        out: dict[int, set[float]] = {}
        for at, n, gpu, limit in list(self.samples):
            if n == node and at >= since and (wanted is None or gpu in wanted):
                out.setdefault(gpu, set()).add(limit)
        return out

    def scrapes(self, node: str, since: float = 0.0) -> int:
        """How many times the node's limits were read since ``since``."""
        return len({at for at, n, _, _ in list(self.samples) if n == node and at >= since})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@contextlib.contextmanager
def scenario(
    root: Path, faults: dict[str, dict[str, Any]] | None = None, **shape: Any
) -> Iterator[Scenario]:
    """A started cluster under ``root``, stopped on the way out (``shape``: Scenario's fields)."""
    with Scenario(root, dict(faults or {}), **shape) as s:
        yield s
